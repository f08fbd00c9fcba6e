//! Input checks shared by the GEMV ops (the ModelOpt-layout and the packed ones).

use candle_core::{backend::BackendStorage, bail, CpuStorage, DType, Layout, Result, Tensor};

/// Largest number of tokens (rows of `x`) the GEMV takes.
pub const MAX_M: usize = 32;
/// `K` must be a multiple of this.
pub const K_ALIGN: usize = 64;

/// Checks `x` (BF16 `[M, K]`, unit inner stride, `1 ≤ M ≤ 32`, `K % 64 == 0`) and returns `(m, k)`.
pub(crate) fn check_x(op: &str, x: &Tensor) -> Result<(usize, usize)> {
    let (m, k) = match x.dims() {
        [m, k] => (*m, *k),
        d => bail!("{op}: x must be 2-d [M, K], got shape {d:?}"),
    };
    if x.dtype() != DType::BF16 {
        bail!("{op}: x must be BF16, got {:?}", x.dtype());
    }
    if m == 0 || m > MAX_M {
        bail!("{op}: M = {m} tokens is outside 1..={MAX_M} (use a matmul for larger M)");
    }
    if k == 0 || k % K_ALIGN != 0 {
        bail!("{op}: K = {k} is not a positive multiple of {K_ALIGN}");
    }
    if x.stride()[1] != 1 && k > 1 {
        bail!(
            "{op}: x must have unit inner stride, got strides {:?}",
            x.stride()
        );
    }
    Ok((m, k))
}

/// `(m, k, row stride)` of a GEMV kernel's x `[M, K]`: unit inner stride, the row stride and
/// offset multiples of 8 elements (16-byte rows), else an error naming `op`.
#[cfg(feature = "cuda")]
pub(crate) fn x_rows(op: &str, lx: &Layout) -> Result<(usize, usize, usize)> {
    let (m, k) = lx.shape().dims2()?;
    let st = lx.stride();
    let rs = if m == 1 { k } else { st[0] };
    if st[1] != 1 || !lx.start_offset().is_multiple_of(8) || rs % 8 != 0 {
        bail!("{op}: x must have unit inner stride, a row stride and offset multiple of 8 (16-byte rows)");
    }
    Ok((m, k, rs))
}

/// The BF16 rows of `x` from its storage (starting at the layout's offset) and their
/// stride; `x` must have unit inner stride.
pub(crate) fn x_view<'a>(
    op: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<(&'a [half::bf16], usize)> {
    let x = match s {
        CpuStorage::BF16(v) => v.as_slice(),
        s => bail!("{op}: x must be BF16, got {:?}", s.dtype()),
    };
    let (m, k) = l.shape().dims2()?;
    let st = l.stride();
    if st[1] != 1 {
        bail!("{op}: x must have unit inner stride, got strides {st:?}");
    }
    let rs = if m == 1 { k } else { st[0] };
    let start = l.start_offset();
    let end = start + (m - 1) * rs + k;
    if end > x.len() {
        bail!("{op}: x layout exceeds its storage");
    }
    Ok((&x[start..end], rs))
}

/// The contiguous U8 data of a storage, or an error naming `what`.
pub(crate) fn contiguous_u8<'a>(
    op: &str,
    what: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<&'a [u8]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U8(v), Some((a, b))) => Ok(&v[a..b]),
        (CpuStorage::U8(_), None) => bail!("{op}: {what} must be contiguous"),
        _ => bail!("{op}: {what} must be U8, got {:?}", s.dtype()),
    }
}

/// The contiguous U32 data of a storage, or an error naming `what`.
pub(crate) fn contiguous_u32<'a>(
    op: &str,
    what: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<&'a [u32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U32(v), Some((a, b))) => Ok(&v[a..b]),
        (CpuStorage::U32(_), None) => bail!("{op}: {what} must be contiguous"),
        _ => bail!("{op}: {what} must be U32, got {:?}", s.dtype()),
    }
}
