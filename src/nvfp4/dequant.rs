//! Dequantization: ModelOpt's FP32 order, and the exact BF16 rows the kernels multiply.

use super::codec::BLOCK_SIZE;
use super::codec::{e2m1_decode, e4m3_decode};
use super::quantize::Nvfp4Quantized;
use super::swizzle::{scale_bytes, swizzled_offset, swizzled_shape};
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

/// Dequantizes checkpoint tensors (`weight` U8 `[N, K/2]`, row-major `weight_scale`
/// U8/F8E4M3 `[N, K/16]`, `global_scale`) in ModelOpt's order,
/// `e2m1 · (f32(e4m3) · global_scale)`, to an FP32 tensor `[N, K]` on the weight's device.
pub fn dequantize_nvfp4(
    weight: &Tensor,
    weight_scale: &Tensor,
    global_scale: f32,
) -> Result<Tensor> {
    let (n, k2) = match weight.dims() {
        [n, k2] => (*n, *k2),
        d => bail!("dequantize_nvfp4: weight must be U8 [N, K/2], got shape {d:?}"),
    };
    if weight.dtype() != DType::U8 {
        bail!(
            "dequantize_nvfp4: weight must be U8, got {:?}",
            weight.dtype()
        );
    }
    let k = k2.saturating_mul(2); // k2 is a tensor dimension: far below the saturation
    if k % BLOCK_SIZE != 0 {
        bail!("dequantize_nvfp4: K = {k} is not a multiple of {BLOCK_SIZE}");
    }
    if weight_scale.dims() != [n, k / BLOCK_SIZE] {
        bail!(
            "dequantize_nvfp4: weight_scale shape {:?} does not match weight [{n}, {k2}] (expected [{n}, {}])",
            weight_scale.dims(),
            k / BLOCK_SIZE
        );
    }
    let codes = weight
        .to_device(&candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1::<u8>()?;
    let scales = scale_bytes(weight_scale, "dequantize_nvfp4")?;
    let q = Nvfp4Quantized {
        n,
        k,
        weight: codes,
        weight_scale: scales,
        global_scale,
    };
    Tensor::from_vec(q.dequantize(), (n, k), weight.device())
}

/// Exact BF16 `e2m1 · e4m3` of every row, from packed codes `[n, k/2]` and swizzled
/// scales (`Np·Sp` bytes). The global scale is not applied.
pub fn dequantize_rows_cpu(codes: &[u8], swizzled: &[u8], n: usize, k: usize) -> Result<Vec<bf16>> {
    let s = k / BLOCK_SIZE;
    let (np, sp, scale_len) = super::swizzle::swizzled_len("dequantize_rows", n, s)?;
    let elems = crate::error::checked_product("dequantize_rows: n·k", &[n, k])?;
    if !k.is_multiple_of(BLOCK_SIZE) || codes.len() != elems / 2 || swizzled.len() != scale_len {
        bail!(
            "dequantize_rows: {} code bytes and {} scale bytes do not fit [{n}, {k}] (K multiple of 16, scales {np}x{sp})",
            codes.len(),
            swizzled.len()
        );
    }
    let mut out = vec![bf16::ZERO; n * k];
    out.par_chunks_mut(k).enumerate().for_each(|(row, dst)| {
        for (j, d) in dst.iter_mut().enumerate() {
            let byte = codes[row * k / 2 + j / 2];
            let code = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
            let sc = e4m3_decode(swizzled[swizzled_offset(row, j / BLOCK_SIZE, sp)]);
            // Exact: at most 2 + 4 significant bits, exponent well inside BF16's range.
            *d = bf16::from_f32(e2m1_decode(code) * sc);
        }
    });
    Ok(out)
}

struct DequantizeRows;

impl CustomOp2 for DequantizeRows {
    fn name(&self) -> &'static str {
        "nvfp4-dequantize-rows"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, k2) = l1.shape().dims2()?;
        let codes = match (s1, l1.contiguous_offsets()) {
            (CpuStorage::U8(v), Some((a, b))) => &v[a..b],
            _ => bail!("dequantize_rows: weight must be a contiguous U8 tensor"),
        };
        let scales = match (s2, l2.contiguous_offsets()) {
            (CpuStorage::U8(v), Some((a, b))) => &v[a..b],
            _ => bail!("dequantize_rows: weight_scale must be a contiguous U8 tensor"),
        };
        let out = dequantize_rows_cpu(codes, scales, n, 2 * k2)?;
        Ok((CpuStorage::BF16(out), Shape::from((n, 2 * k2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::dequant_cuda::dequantize_rows_cuda(s1, l1, s2, l2)
    }
}

/// Exact BF16 `e2m1 · e4m3` of all rows (global scale not applied): `weight` U8 `[N, K/2]`,
/// `weight_scale` the swizzled U8 scales `[Np, Sp]` (see
/// [`swizzle_blockscale`](super::swizzle_blockscale)). Returns BF16 `[N, K]` on the same device.
pub fn dequantize_rows(weight: &Tensor, weight_scale: &Tensor) -> Result<Tensor> {
    let (n, k2) = match weight.dims() {
        [n, k2] => (*n, *k2),
        d => bail!("dequantize_rows: weight must be U8 [N, K/2], got shape {d:?}"),
    };
    if weight.dtype() != DType::U8 || weight_scale.dtype() != DType::U8 {
        bail!(
            "dequantize_rows: weight and weight_scale must be U8, got {:?} and {:?}",
            weight.dtype(),
            weight_scale.dtype()
        );
    }
    let k = k2.saturating_mul(2); // k2 is a tensor dimension: far below the saturation
    if k % BLOCK_SIZE != 0 {
        bail!("dequantize_rows: K = {k} is not a multiple of {BLOCK_SIZE}");
    }
    let (np, sp) = swizzled_shape(n, k / BLOCK_SIZE);
    if weight_scale.elem_count() != np * sp {
        bail!(
            "dequantize_rows: weight_scale has {} bytes, a [{n}, {k}] weight needs {np}x{sp} swizzled scales",
            weight_scale.elem_count()
        );
    }
    let weight = weight.contiguous()?;
    let weight_scale = weight_scale.contiguous()?;
    weight.apply_op2_no_bwd(&weight_scale, &DequantizeRows)
}
