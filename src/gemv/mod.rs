//! Small-M GEMV ops: `y = x · Wᵀ` for `M ≤ 32` tokens, BF16 activations, NVFP4 or BF16
//! weights, as candle custom ops.
//!
//! Numerics (identical on every backend up to FP32 summation order): every weight is
//! dequantized exactly to BF16 (`e2m1 · e4m3` for NVFP4), products are accumulated in
//! FP32, the FP32 global scale multiplies the accumulator, and the result is rounded to
//! BF16 once. With `silu_mul` the `N` outputs are the halves `[gate | up]` and the op
//! returns `[M, N/2]` = BF16 of `silu(gate) · up`, computed in FP32 from the
//! BF16-rounded gate and up.
//!
//! `pdl` asks the CUDA kernel for programmatic dependent launch (its weight loads overlap
//! the previous kernel's tail); it has no effect on the CPU.

mod cpu;
#[cfg(target_arch = "x86_64")]
mod cpu_avx2;
#[cfg(target_arch = "x86_64")]
mod cpu_avx512;
mod cpu_pool;

pub use cpu::{gemv_cpu, gemv_cpu_scalar, gemv_cpu_with, CpuKernel, WeightRows};

use crate::nvfp4::{swizzled_shape, BLOCK_SIZE};
use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape,
    Tensor,
};

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

fn check_n(op: &str, n: usize, silu_mul: bool) -> Result<()> {
    if n == 0 {
        bail!("{op}: the weight has no rows");
    }
    if silu_mul && !n.is_multiple_of(2) {
        bail!("{op}: silu_mul needs an even N ([gate | up] halves), got N = {n}");
    }
    Ok(())
}

fn out_shape(m: usize, n: usize, silu_mul: bool) -> Shape {
    Shape::from((m, if silu_mul { n / 2 } else { n }))
}

/// The BF16 rows of `x` from its storage (starting at the layout's offset) and their
/// stride; `x` must have unit inner stride.
fn x_view<'a>(op: &str, s: &'a CpuStorage, l: &Layout) -> Result<(&'a [half::bf16], usize)> {
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

fn contiguous_u8<'a>(op: &str, what: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [u8]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U8(v), Some((a, b))) => Ok(&v[a..b]),
        (CpuStorage::U8(_), None) => bail!("{op}: {what} must be contiguous"),
        _ => bail!("{op}: {what} must be U8, got {:?}", s.dtype()),
    }
}

/// Which compiled kernel image the CUDA forward uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum KernelImage {
    /// The image built for the device: sm_90a cubin on Hopper, sm_100a on B200, sm_80
    /// on Ampere/Ada, compute_90 PTX on other GPUs of compute capability ≥ 9.0.
    #[default]
    Auto,
    /// The sm_80 code path (no clusters, no PDL), JIT-compiled from PTX: lets a Hopper
    /// run and test what A100 / RTX 40xx users get.
    Sm80,
}

/// Launch options of the GEMV ops. Only `silu_mul` changes the result; the others
/// choose among equivalent kernels (CUDA only; the CPU ignores them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GemvOptions {
    /// Fused `silu(gate)·up` epilogue over `[gate | up]` output halves.
    pub silu_mul: bool,
    /// Programmatic dependent launch: weight loads overlap the previous kernel's tail.
    pub pdl: bool,
    /// Token tiles (8·nt tokens, nt ∈ {1, 2, 4}, 8·nt ≥ M); `None` = smallest that fits.
    pub nt: Option<usize>,
    /// CTAs of a thread-block cluster that split K (1, 2, 4, 8); `None` = heuristic.
    pub split: Option<usize>,
    /// Kernel image.
    pub image: KernelImage,
    /// Stage x once per CTA in shared memory (split 1, nt ≤ 2, when it fits in 96 KiB)
    /// instead of reading it through L1 per chunk; `None` = off (slower on the H200).
    pub x_in_smem: Option<bool>,
}

impl GemvOptions {
    /// Options with the epilogue and PDL flags set, everything else automatic.
    pub fn new(silu_mul: bool, pdl: bool) -> Self {
        Self {
            silu_mul,
            pdl,
            ..Default::default()
        }
    }

    fn check(&self, op: &str, m: usize) -> Result<()> {
        if let Some(nt) = self.nt {
            if !crate::tables::NT_CHOICES.contains(&nt) || 8 * nt < m {
                bail!("{op}: nt = {nt} must be 1, 2 or 4 with 8·nt ≥ M = {m}");
            }
        }
        if let Some(s) = self.split {
            if ![1, 2, 4, 8].contains(&s) {
                bail!("{op}: split = {s} must be 1, 2, 4 or 8");
            }
            if s > 1 && self.image == KernelImage::Sm80 {
                bail!("{op}: the sm_80 image has no clusters, split must be 1");
            }
        }
        Ok(())
    }
}

/// The NVFP4 GEMV as a candle op: inputs `x`, `weight`, swizzled `weight_scale`.
#[derive(Debug, Clone, Copy)]
pub struct Nvfp4Gemv {
    /// FP32 per-tensor global scale (`weight_scale_2`).
    pub global_scale: f32,
    /// Launch options.
    pub opts: GemvOptions,
}

impl CustomOp3 for Nvfp4Gemv {
    fn name(&self) -> &'static str {
        "nvfp4-gemv"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "nvfp4_gemv";
        let (m, k) = l1.shape().dims2()?;
        let (n, _) = l2.shape().dims2()?;
        let (x, rs) = x_view(OP, s1, l1)?;
        let codes = contiguous_u8(OP, "weight", s2, l2)?;
        let scales = contiguous_u8(OP, "weight_scale", s3, l3)?;
        let sp = swizzled_shape(n, k / BLOCK_SIZE).1;
        let rows = WeightRows::Nvfp4 { codes, scales, sp };
        let silu = self.opts.silu_mul;
        let out = gemv_cpu(x, rs, m, k, n, &rows, self.global_scale, silu)?;
        Ok((CpuStorage::BF16(out), out_shape(m, n, silu)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::nvfp4_gemv_cuda(self, s1, l1, s2, l2, s3, l3)
    }
}

/// The BF16 GEMV as a candle op: inputs `x`, `weight`.
#[derive(Debug, Clone, Copy)]
pub struct Bf16Gemv {
    /// Launch options.
    pub opts: GemvOptions,
}

impl CustomOp2 for Bf16Gemv {
    fn name(&self) -> &'static str {
        "bf16-gemv"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "bf16_gemv";
        let (m, k) = l1.shape().dims2()?;
        let (n, _) = l2.shape().dims2()?;
        let (x, rs) = x_view(OP, s1, l1)?;
        let w = match (s2, l2.contiguous_offsets()) {
            (CpuStorage::BF16(v), Some((a, b))) => &v[a..b],
            _ => bail!("{OP}: weight must be a contiguous BF16 tensor"),
        };
        let rows = WeightRows::Bf16 { w };
        let silu = self.opts.silu_mul;
        let out = gemv_cpu(x, rs, m, k, n, &rows, 1.0, silu)?;
        Ok((CpuStorage::BF16(out), out_shape(m, n, silu)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::bf16_gemv_cuda(self, s1, l1, s2, l2)
    }
}

/// NVFP4 W4A16 GEMV: `x` BF16 `[M, K]` (M ≤ 32, K % 64 == 0, unit inner stride) times
/// the NVFP4 weight (`weight` U8 `[N, K/2]`, `weight_scale` swizzled U8 `[Np, Sp]` as
/// made by [`swizzle_blockscale`](crate::nvfp4::swizzle_blockscale)), scaled by
/// `global_scale`. Returns BF16 `[M, N]`, or `[M, N/2]` with `silu_mul`.
pub fn nvfp4_gemv(
    x: &Tensor,
    weight: &Tensor,
    weight_scale: &Tensor,
    global_scale: f32,
    silu_mul: bool,
    pdl: bool,
) -> Result<Tensor> {
    nvfp4_gemv_with(
        x,
        weight,
        weight_scale,
        global_scale,
        &GemvOptions::new(silu_mul, pdl),
    )
}

/// [`nvfp4_gemv`] with explicit [`GemvOptions`] (kernel variant selection for tests and
/// benchmarks).
pub fn nvfp4_gemv_with(
    x: &Tensor,
    weight: &Tensor,
    weight_scale: &Tensor,
    global_scale: f32,
    opts: &GemvOptions,
) -> Result<Tensor> {
    const OP: &str = "nvfp4_gemv";
    let silu_mul = opts.silu_mul;
    let (m, k) = check_x(OP, x)?;
    opts.check(OP, m)?;
    let n = match weight.dims() {
        [n, k2] if *k2 * 2 == k && weight.dtype() == DType::U8 => *n,
        d => bail!(
            "{OP}: weight must be U8 [N, K/2] = [N, {}], got {:?} {d:?}",
            k / 2,
            weight.dtype()
        ),
    };
    check_n(OP, n, silu_mul)?;
    let (np, sp) = swizzled_shape(n, k / BLOCK_SIZE);
    if weight_scale.dtype() != DType::U8 || weight_scale.elem_count() != np * sp {
        bail!(
            "{OP}: weight_scale must be the swizzled U8 scales [{np}, {sp}] of a [{n}, {k}] weight, got {:?} {:?}",
            weight_scale.dtype(),
            weight_scale.dims()
        );
    }
    if !(global_scale.is_finite() && global_scale > 0.0) {
        bail!("{OP}: global scale {global_scale} must be a positive finite number");
    }
    if !x.device().same_device(weight.device()) || !x.device().same_device(weight_scale.device()) {
        bail!("{OP}: x, weight and weight_scale must be on the same device");
    }
    let weight = weight.contiguous()?;
    let weight_scale = weight_scale.contiguous()?;
    let op = Nvfp4Gemv {
        global_scale,
        opts: *opts,
    };
    x.apply_op3_no_bwd(&weight, &weight_scale, &op)
}

/// BF16 GEMV: `x` BF16 `[M, K]` (M ≤ 32, K % 64 == 0, unit inner stride) times
/// `weight` BF16 `[N, K]`. Returns BF16 `[M, N]`, or `[M, N/2]` with `silu_mul`.
pub fn bf16_gemv(x: &Tensor, weight: &Tensor, silu_mul: bool, pdl: bool) -> Result<Tensor> {
    bf16_gemv_with(x, weight, &GemvOptions::new(silu_mul, pdl))
}

/// [`bf16_gemv`] with explicit [`GemvOptions`].
pub fn bf16_gemv_with(x: &Tensor, weight: &Tensor, opts: &GemvOptions) -> Result<Tensor> {
    const OP: &str = "bf16_gemv";
    let silu_mul = opts.silu_mul;
    let (m, k) = check_x(OP, x)?;
    opts.check(OP, m)?;
    let n = match weight.dims() {
        [n, kk] if *kk == k && weight.dtype() == DType::BF16 => *n,
        d => bail!(
            "{OP}: weight must be BF16 [N, K] = [N, {k}], got {:?} {d:?}",
            weight.dtype()
        ),
    };
    check_n(OP, n, silu_mul)?;
    if !x.device().same_device(weight.device()) {
        bail!("{OP}: x and weight must be on the same device");
    }
    let weight = weight.contiguous()?;
    x.apply_op2_no_bwd(&weight, &Bf16Gemv { opts: *opts })
}
