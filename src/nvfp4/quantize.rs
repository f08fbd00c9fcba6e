//! NVFP4 weight quantization, bit-exact with NVIDIA ModelOpt (`NVFP4QTensor`).

use super::codec::{e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, BLOCK_SIZE, E4M3_MAX};
use crate::error::QuantizeError;
use candle_core::{bail, DType, Device, Result, Tensor};

/// A weight matrix `[n, k]` quantized to NVFP4, in the checkpoint layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4Quantized {
    /// Output features (rows).
    pub n: usize,
    /// Input features (columns), a multiple of 16.
    pub k: usize,
    /// Packed E2M1 codes, `[n, k/2]` row-major; low nibble = even k.
    pub weight: Vec<u8>,
    /// E4M3 block scales as raw bytes, `[n, k/16]` row-major, not swizzled.
    pub weight_scale: Vec<u8>,
    /// The FP32 per-tensor global scale (`weight_scale_2`).
    pub global_scale: f32,
}

impl Nvfp4Quantized {
    /// Dequantizes in ModelOpt's order, `e2m1 · (f32(e4m3) · global_scale)`, to FP32 `[n, k]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let s_cols = self.k / BLOCK_SIZE;
        let mut out = Vec::with_capacity(self.n * self.k);
        for row in 0..self.n {
            for j in 0..self.k {
                let byte = self.weight[row * self.k / 2 + j / 2];
                let code = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
                let s = e4m3_decode(self.weight_scale[row * s_cols + j / BLOCK_SIZE]);
                out.push(e2m1_decode(code) * (s * self.global_scale));
            }
        }
        out
    }

    /// The packed codes as a U8 tensor `[n, k/2]` and the block scales as a U8 tensor
    /// `[n, k/16]` (row-major, raw E4M3 bytes), on `device`.
    pub fn to_tensors(&self, device: &Device) -> Result<(Tensor, Tensor)> {
        let w = Tensor::from_slice(&self.weight, (self.n, self.k / 2), device)?;
        let s = Tensor::from_slice(&self.weight_scale, (self.n, self.k / BLOCK_SIZE), device)?;
        Ok((w, s))
    }
}

/// Smallest block scale ModelOpt writes: the smallest E4M3 subnormal, 2^-9.
pub const MIN_BLOCK_SCALE: f32 = 1.0 / 512.0;

/// ModelOpt's global scale for a tensor whose largest magnitude is `amax`: `amax / (6·448)`.
pub fn global_scale_for_amax(amax: f32) -> f32 {
    amax / (6.0 * E4M3_MAX)
}

/// ModelOpt 0.47's E4M3 block scale (raw byte) for a 16-block whose largest magnitude is
/// `block_amax`, against the global scale `global_scale`: `block_amax / (6·global_scale)`
/// in FP32, 0 → 1.0, clamped to `[2^-9, 448]`, cast to E4M3 with round-to-nearest-even.
pub fn block_scale_e4m3(block_amax: f32, global_scale: f32) -> u8 {
    let per_block_scale = block_amax / (6.0 * global_scale);
    let q = if per_block_scale == 0.0 {
        1.0
    } else {
        per_block_scale.clamp(MIN_BLOCK_SCALE, E4M3_MAX)
    };
    e4m3_encode(q)
}

/// Quantizes a row-major FP32 matrix `[n, k]` to NVFP4 exactly as ModelOpt does.
///
/// * global scale: `global_scale` if given (ModelOpt shares one across q/k/v and across
///   gate/up: the largest of the group's), else `amax(|w|) / (6·448)`;
/// * per 16-block: `scale = block_amax / (6·global_scale)`, 1.0 for an all-zero block,
///   clamped to `[2^-9, 448]` (so never 0 or NaN: ModelOpt 0.47's `_cast_per_block_scale_to_fp8`),
///   cast to E4M3 with round-to-nearest-even (small scales become subnormal);
/// * codes: E2M1 of `w / (f32(scale) · global_scale)`, ties to even, saturating at ±6.
///
/// Errors on `k` not a multiple of 16, a length that is not `n·k` (or an `n·k` that
/// overflows), NaN/Inf in `w`, an all-zero matrix or one whose amax is so small (below
/// about 1.5e-42) that its global scale underflows to 0, or a given global scale that is not a
/// positive finite number or is smaller than this matrix needs (`amax / (6·448)`).
pub fn quantize_nvfp4_slice(
    w: &[f32],
    n: usize,
    k: usize,
    global_scale: Option<f32>,
) -> Result<Nvfp4Quantized> {
    if k == 0 || !k.is_multiple_of(BLOCK_SIZE) {
        Err(QuantizeError::BadK { k })?
    }
    let len = crate::error::checked_product("quantize_nvfp4: n·k", &[n, k])?;
    if w.len() != len {
        Err(QuantizeError::Length { len: w.len(), n, k })?
    }
    let mut amax = 0f32;
    for (i, &v) in w.iter().enumerate() {
        if !v.is_finite() {
            Err(QuantizeError::NonFinite {
                row: i / k,
                col: i % k,
                value: v,
            })?
        }
        amax = amax.max(v.abs());
    }
    let own = global_scale_for_amax(amax);
    let gs = match global_scale {
        None => {
            if amax == 0.0 {
                Err(QuantizeError::AllZero { n, k })?
            }
            if own == 0.0 {
                Err(QuantizeError::GlobalScaleUnderflow { n, k, amax })?
            }
            own
        }
        Some(g) => {
            if !(g.is_finite() && g > 0.0) {
                Err(QuantizeError::BadGlobalScale { value: g })?
            }
            if g < own {
                Err(QuantizeError::GlobalScaleTooSmall {
                    value: g,
                    needed: own,
                })?
            }
            g
        }
    };
    let s_cols = k / BLOCK_SIZE;
    let mut weight = vec![0u8; n * k / 2];
    let mut weight_scale = vec![0u8; n * s_cols];
    let mut codes = [0u8; BLOCK_SIZE];
    for (b, block) in w.chunks_exact(BLOCK_SIZE).enumerate() {
        let bamax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let sbyte = block_scale_e4m3(bamax, gs);
        weight_scale[b] = sbyte;
        let denom = e4m3_decode(sbyte) * gs;
        for (c, &v) in codes.iter_mut().zip(block) {
            *c = e2m1_encode(v / denom);
        }
        let dst = &mut weight[b * BLOCK_SIZE / 2..(b + 1) * BLOCK_SIZE / 2];
        for (j, d) in dst.iter_mut().enumerate() {
            *d = codes[2 * j] | (codes[2 * j + 1] << 4);
        }
    }
    Ok(Nvfp4Quantized {
        n,
        k,
        weight,
        weight_scale,
        global_scale: gs,
    })
}

fn matrix_to_f32(w: &Tensor, what: &str) -> Result<(Vec<f32>, usize, usize)> {
    let (n, k) = match w.dims() {
        [n, k] => (*n, *k),
        d => bail!("{what}: expected a 2-d weight [out_features, in_features], got shape {d:?}"),
    };
    match w.dtype() {
        DType::BF16 | DType::F16 | DType::F32 | DType::F64 => {}
        dt => bail!("{what}: weight dtype {dt:?} is not a float type"),
    }
    let v = w
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok((v, n, k))
}

/// Quantizes a 2-d float tensor `[N, K]` (BF16, F16, F32 or F64) with its own global
/// scale; see [`quantize_nvfp4_slice`].
pub fn quantize_nvfp4(w: &Tensor) -> Result<Nvfp4Quantized> {
    let (v, n, k) = matrix_to_f32(w, "quantize_nvfp4")?;
    quantize_nvfp4_slice(&v, n, k, None)
}

/// Quantizes a 2-d float tensor against a given (shared) global scale; see
/// [`quantize_nvfp4_slice`].
pub fn quantize_nvfp4_with_global_scale(w: &Tensor, global_scale: f32) -> Result<Nvfp4Quantized> {
    let (v, n, k) = matrix_to_f32(w, "quantize_nvfp4")?;
    quantize_nvfp4_slice(&v, n, k, Some(global_scale))
}
