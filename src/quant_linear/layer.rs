//! The [`QuantLinear`] layer: its weight, constructors and accessors.

use super::plan::Plans;
use super::weight::{nvfp4_weight, Weight};
use crate::gemv::GemvKnobs;
use crate::nvfp4::{
    swizzle_blockscale_bytes, swizzled_shape, unswizzle_blockscale_bytes, Nvfp4Quantized,
    BLOCK_SIZE,
};
use candle_core::{bail, DType, Device, Result, Tensor};

/// A linear layer `y = x·Wᵀ + b` with an NVFP4 or BF16 weight `[N, K]`; see the module
/// [module docs](super) for the numerics. Which path runs for each token count is decided once, when the
/// layer is built on its device, from that device's tuned table ([`use_gemv`](super::use_gemv)); on a GPU
/// the GEMV launches are planned then too, so `forward` looks nothing up.
#[derive(Debug, Clone)]
pub struct QuantLinear {
    pub(super) weight: Weight,
    pub(super) bias: Option<Tensor>,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) plans: Plans,
    /// Whether the norm kernel in front of this layer asks L2 for its weights
    /// ([`set_l2_prefetch`](Self::set_l2_prefetch)).
    pub(super) l2_prefetch: bool,
}

/// A bias checked to be `[n]`, as BF16 on `device`.
fn prepare_bias(bias: Option<Tensor>, n: usize, device: &Device) -> Result<Option<Tensor>> {
    let Some(b) = bias else { return Ok(None) };
    if b.dims() != [n] {
        bail!("QuantLinear: bias has shape {:?}, expected [{n}]", b.dims());
    }
    Ok(Some(b.to_device(device)?.to_dtype(DType::BF16)?))
}

impl QuantLinear {
    /// An NVFP4 layer from a quantized weight (checkpoint layout; the scales are swizzled
    /// here) and an optional bias `[N]` (converted to BF16), placed on `device`.
    pub fn from_nvfp4(q: &Nvfp4Quantized, bias: Option<Tensor>, device: &Device) -> Result<Self> {
        let (n, k) = (q.n, q.k);
        if n == 0 || k == 0 || !k.is_multiple_of(BLOCK_SIZE) {
            bail!("QuantLinear: NVFP4 weight [{n}, {k}] needs N > 0 and K a positive multiple of {BLOCK_SIZE}");
        }
        let code_bytes =
            crate::error::checked_product("QuantLinear: NVFP4 code bytes", &[n, k / 2])?;
        let scale_bytes =
            crate::error::checked_product("QuantLinear: NVFP4 scale bytes", &[n, k / BLOCK_SIZE])?;
        if q.weight.len() != code_bytes || q.weight_scale.len() != scale_bytes {
            bail!(
                "QuantLinear: NVFP4 weight [{n}, {k}] needs {code_bytes} code bytes and {scale_bytes} scale bytes, got {} and {}",
                q.weight.len(),
                q.weight_scale.len()
            );
        }
        if let Some((i, b, v)) = crate::nvfp4::first_bad_block_scale(&q.weight_scale) {
            let s = k / BLOCK_SIZE;
            bail!(
                "QuantLinear: block scale {i} (row {}, block {}) is byte {b:#04x} = {v}: E4M3 block scales must be finite and non-negative",
                i / s,
                i % s
            );
        }
        if !(q.global_scale.is_finite() && q.global_scale > 0.0) {
            bail!(
                "QuantLinear: global scale {} must be a positive finite number",
                q.global_scale
            );
        }
        let s = k / BLOCK_SIZE;
        let swz = swizzle_blockscale_bytes(&q.weight_scale, n, s)?;
        let codes = Tensor::from_slice(&q.weight, (n, k / 2), device)?;
        let scales = Tensor::from_vec(swz, swizzled_shape(n, s), device)?;
        let weight = nvfp4_weight(codes, scales, q.global_scale)?;
        let plans = Plans::new(device, n, k, &weight)?;
        Ok(Self {
            weight,
            bias: prepare_bias(bias, n, device)?,
            n,
            k,
            plans,
            l2_prefetch: true,
        })
    }

    /// An NVFP4 layer from parts already on their device (what a loader or a benchmark builds
    /// on the GPU): `codes` U8 `[N, K/2]`, `scales` U8 block scales **already 128×4-swizzled**,
    /// shape [`swizzled_shape`]`(N, K/16)`, the global scale and an optional bias `[N]`. The
    /// scales are checked (finite, non-negative) on a host copy.
    pub fn from_nvfp4_parts(
        codes: Tensor,
        scales: Tensor,
        global_scale: f32,
        bias: Option<Tensor>,
    ) -> Result<Self> {
        const WHAT: &str = "QuantLinear::from_nvfp4_parts";
        let (n, half) = match codes.dims() {
            [n, h] if *n > 0 && *h > 0 && (2 * h).is_multiple_of(BLOCK_SIZE) => (*n, *h),
            d => bail!("{WHAT}: codes must be U8 [N, K/2] with K a positive multiple of {BLOCK_SIZE}, got {d:?}"),
        };
        let k = 2 * half;
        let want = swizzled_shape(n, k / BLOCK_SIZE);
        if codes.dtype() != DType::U8
            || scales.dtype() != DType::U8
            || scales.dims() != [want.0, want.1]
        {
            bail!(
                "{WHAT}: codes {:?} {:?} and scales {:?} {:?}: both must be U8, the scales {want:?}",
                codes.dtype(),
                codes.dims(),
                scales.dtype(),
                scales.dims()
            )
        }
        if !codes.device().same_device(scales.device()) {
            bail!("{WHAT}: the codes and the scales are on different devices")
        }
        if !(global_scale.is_finite() && global_scale > 0.0) {
            bail!("{WHAT}: global scale {global_scale} must be a positive finite number")
        }
        let host = scales.flatten_all()?.to_vec1::<u8>()?;
        if let Some((i, b, v)) = crate::nvfp4::first_bad_block_scale(&host) {
            bail!("{WHAT}: swizzled block scale byte {i} is {b:#04x} = {v}: E4M3 block scales must be finite and non-negative");
        }
        let device = codes.device().clone();
        let weight = nvfp4_weight(codes.contiguous()?, scales.contiguous()?, global_scale)?;
        let plans = Plans::new(&device, n, k, &weight)?;
        Ok(Self {
            weight,
            bias: prepare_bias(bias, n, &device)?,
            n,
            k,
            plans,
            l2_prefetch: true,
        })
    }

    /// A 16-bit layer from a float weight `[N, K]` (converted to BF16) and an optional
    /// bias `[N]`, on the weight's device.
    pub fn from_bf16(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let (n, k) = match weight.dims() {
            [n, k] if *n > 0 && *k > 0 => (*n, *k),
            d => {
                bail!("QuantLinear: weight must be a non-empty 2-d [N, K] tensor, got shape {d:?}")
            }
        };
        if !weight.dtype().is_float() {
            bail!(
                "QuantLinear: weight dtype {:?} is not a float type",
                weight.dtype()
            );
        }
        let device = weight.device().clone();
        let weight = Weight::Bf16(weight.to_dtype(DType::BF16)?.contiguous()?);
        let plans = Plans::new(&device, n, k, &weight)?;
        Ok(Self {
            weight,
            bias: prepare_bias(bias, n, &device)?,
            n,
            k,
            plans,
            l2_prefetch: true,
        })
    }

    /// Re-plans the GEMV launches with programmatic dependent launch on (`true`) or off: the
    /// layer's kernels then start while the previous kernel runs, issue their weight loads
    /// and wait for its output on the device (sm_90 and newer; a no-op elsewhere). A tuning
    /// knob of the decode step, applied at load; the result is unchanged.
    pub fn set_pdl(&mut self, pdl: bool) -> Result<()> {
        self.set_gemv_knobs(&GemvKnobs::with_pdl(pdl))
    }

    /// Re-plans the GEMV launches with the launch knobs `knobs` (PDL, kernel image, the
    /// benchmarks' kernel A/B switch); the token tile and split stay the
    /// device table's. Applied at load; the result is unchanged.
    #[doc(hidden)]
    pub fn set_gemv_knobs(&mut self, knobs: &GemvKnobs) -> Result<()> {
        let device = self.device().clone();
        self.plans = Plans::with_knobs(&device, self.n, self.k, &self.weight, knobs)?;
        Ok(())
    }

    /// Whether the RMSNorm kernel in front of this layer
    /// ([`forward_add_norm`](Self::forward_add_norm), unfused) asks L2 for the layer's first
    /// packed weights while it runs: on by default where the planner's rule wants it (sm_90
    /// and newer; on devices with fast DRAM only for layers wider than 4096,
    /// [`prefetch_suits`](crate::gemv::packed::prefetch_suits)); a tuning knob of the decode
    /// step (`Knobs::l2_prefetch`), the result is unchanged.
    pub fn set_l2_prefetch(&mut self, on: bool) {
        self.l2_prefetch = on;
    }

    /// Input features `K`.
    pub fn in_features(&self) -> usize {
        self.k
    }

    /// Output features `N`.
    pub fn out_features(&self) -> usize {
        self.n
    }

    /// Bytes of the stored weight a forward reads: NVFP4 codes plus swizzled block scales
    /// (on a GPU: the packed codes and scale words, padding rows included), or the BF16
    /// matrix (the bias excluded).
    pub fn weight_bytes(&self) -> usize {
        match &self.weight {
            Weight::Nvfp4 { codes, scales, .. } => codes.elem_count() + scales.elem_count(),
            Weight::Packed(p) => p.bytes(),
            Weight::Bf16(w) => 2 * w.elem_count(),
        }
    }

    /// Whether the weight is NVFP4.
    pub fn is_nvfp4(&self) -> bool {
        matches!(self.weight, Weight::Nvfp4 { .. } | Weight::Packed(_))
    }

    /// The FP32 global scale (`weight_scale_2`) of an NVFP4 weight; `None` for BF16.
    pub fn global_scale(&self) -> Option<f32> {
        match &self.weight {
            Weight::Nvfp4 { global_scale, .. } => Some(*global_scale),
            Weight::Packed(p) => Some(p.global_scale()),
            Weight::Bf16(_) => None,
        }
    }

    /// The BF16 bias `[N]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The device the weight lives on.
    pub fn device(&self) -> &Device {
        match &self.weight {
            Weight::Nvfp4 { codes, .. } => codes.device(),
            Weight::Packed(p) => p.device(),
            Weight::Bf16(w) => w.device(),
        }
    }

    /// An NVFP4 weight back in checkpoint layout (row-major scales) on the host; `None`
    /// for a BF16 weight. (From a GPU layer, blocks whose scale is zero come back with
    /// zero codes: the same dequantized weight.)
    pub fn to_nvfp4(&self) -> Result<Option<Nvfp4Quantized>> {
        let (codes, scales, global_scale) = match &self.weight {
            Weight::Nvfp4 {
                codes,
                scales,
                global_scale,
            } => (codes, scales, global_scale),
            Weight::Packed(p) => {
                let (weight, weight_scale) = p.to_modelopt()?;
                return Ok(Some(Nvfp4Quantized {
                    n: self.n,
                    k: self.k,
                    weight,
                    weight_scale,
                    global_scale: p.global_scale(),
                }));
            }
            Weight::Bf16(_) => return Ok(None),
        };
        let codes = codes.flatten_all()?.to_vec1::<u8>()?;
        let swz = scales.flatten_all()?.to_vec1::<u8>()?;
        let weight_scale = unswizzle_blockscale_bytes(&swz, self.n, self.k / BLOCK_SIZE)?;
        Ok(Some(Nvfp4Quantized {
            n: self.n,
            k: self.k,
            weight: codes,
            weight_scale,
            global_scale: *global_scale,
        }))
    }

    /// The weight as FP32 `[N, K]` on the layer's device. NVFP4 is dequantized in
    /// ModelOpt's order, `e2m1 · (f32(e4m3) · global_scale)`, bit-identical to
    /// `NVFP4QTensor.dequantize(dtype=float32)` (the GEMV's `(x·e2m1·e4m3)·global_scale`
    /// groups the product differently).
    pub fn dequantize(&self) -> Result<Tensor> {
        match &self.weight {
            Weight::Bf16(w) => w.to_dtype(DType::F32),
            Weight::Nvfp4 { .. } | Weight::Packed(_) => match self.to_nvfp4()? {
                Some(q) => Tensor::from_vec(q.dequantize(), (self.n, self.k), self.device()),
                None => bail!("QuantLinear: internal error, NVFP4 weight not found"),
            },
        }
    }
}
