//! NVFP4 weights repacked once for the CUDA GEMV (`kernels/gemv_packed.cu`): a layout in
//! which one 16-byte load per thread feeds four tensor-core MMAs in order, with the block
//! scales pre-shaped so that applying one costs a mask (the layout is documented at the top
//! of the kernel file; [`PackedLayout`] and the CPU packer in `layout` mirror it).
//!
//! [`PackedNvfp4::pack`] converts the ModelOpt layout (codes `[N, K/2]`, 128×4-swizzled
//! E4M3 scales) on the weight's device; [`packed_nvfp4_gemv`] runs the GEMV with the
//! numerics of [`nvfp4_gemv`](super::nvfp4_gemv) (exact BF16 weights, FP32 accumulation,
//! the global scale on the accumulator, one rounding). A
//! [`QuantLinear`](crate::quant_linear::QuantLinear) on a GPU keeps its NVFP4 weight in this form.
//!
//! Every op here also runs on the CPU (the reference: unpack, then the CPU GEMV), so the
//! layout is tested without a GPU.

mod bf16_weight;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_bf16;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_norm;
#[cfg(feature = "cuda")]
mod cuda_pack;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_prefetch;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_weight;
mod geometry;
mod layout;
#[cfg(feature = "cuda")]
pub(crate) mod norm;

pub use bf16_weight::{
    bf16_gemv_planned_packed, plan_bf16_gemv, plan_bf16_gemv_with, Bf16GemvPlan,
};
pub use geometry::{
    bw_geometry, depth_suits, l2_prefetch_budget, packed_geometry, packed_tile_bytes, pair_suits,
    prefetch_suits, prefetch_tiles, stage_suits, staged_max_m, staged_slice_k, staged_smem,
    use_norm_prologue, BW_DEEP_RUN, BW_INFLIGHT_PER_SM, NORM_K_MAX, NORM_MAX_M, PACKED_WARPS,
    PREFETCH_FAST_DRAM, PREFETCH_FAST_DRAM_MIN_K, STAGED_MAX_M,
};
pub use layout::{
    pack_codes, pack_scales, scale_from_t, scale_t, unpack, PackedLayout, PACKED_K_ALIGN,
};

use super::checks::{check_x, contiguous_u32, contiguous_u8, x_view, MAX_M};
use super::cpu::{gemv_cpu, WeightRows};
use super::options::KernelImage;
use crate::nvfp4::{swizzle_blockscale_bytes, swizzled_shape, BLOCK_SIZE};
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};
use half::bf16;

/// An NVFP4 weight `[N, K]` in the packed layout on its device.
#[derive(Debug, Clone)]
pub struct PackedNvfp4 {
    codes: Tensor,
    scales: Tensor,
    layout: PackedLayout,
    global_scale: f32,
    /// Nibble order of the SM100 image (hardware E2M1 convert).
    hw: bool,
}

/// Whether a pack made on `device` uses the SM100 nibble order.
fn hw_order(device: &candle_core::Device) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return Ok(crate::cuda::facts(d)?.image == crate::cuda::Image::Sm100aCubin);
    }
    let _ = device;
    Ok(false)
}

impl PackedNvfp4 {
    /// Packs ModelOpt codes (U8 `[N, K/2]`) and 128×4-swizzled E4M3 block scales (U8,
    /// [`swizzled_shape`]`(N, K/16)`) on their device. `K` must be a multiple of 64; the
    /// scales are not validated here (the loaders do that).
    pub fn pack(codes: &Tensor, swizzled: &Tensor, global_scale: f32) -> Result<Self> {
        const OP: &str = "PackedNvfp4::pack";
        let (n, k) = match codes.dims() {
            [n, h] if codes.dtype() == DType::U8 => (*n, 2 * *h),
            d => bail!(
                "{OP}: codes must be U8 [N, K/2], got {:?} {d:?}",
                codes.dtype()
            ),
        };
        let layout = PackedLayout::new(n, k)?;
        let want = swizzled_shape(n, k / BLOCK_SIZE);
        if swizzled.dtype() != DType::U8 || swizzled.elem_count() != want.0 * want.1 {
            bail!(
                "{OP}: scales must be the swizzled U8 [{}, {}] of a [{n}, {k}] weight, got {:?} {:?}",
                want.0,
                want.1,
                swizzled.dtype(),
                swizzled.dims()
            );
        }
        if !(global_scale.is_finite() && global_scale > 0.0) {
            bail!("{OP}: global scale {global_scale} must be a positive finite number");
        }
        if !codes.device().same_device(swizzled.device()) {
            bail!("{OP}: the codes and the scales are on different devices");
        }
        let hw = hw_order(codes.device())?;
        let codes = codes.contiguous()?;
        let swizzled = swizzled.contiguous()?;
        let packed = codes.apply_op2_no_bwd(&swizzled, &PackCodes { layout, hw })?;
        let scales = swizzled.apply_op1_no_bwd(&PackScales { layout, hw })?;
        Ok(Self {
            codes: packed,
            scales,
            layout,
            global_scale,
            hw,
        })
    }

    /// The packed codes, U8 `[code_bytes]`.
    pub fn codes(&self) -> &Tensor {
        &self.codes
    }

    /// The packed scale words, U32 `[scale_words]`.
    pub fn scales(&self) -> &Tensor {
        &self.scales
    }

    /// Whether the nibble order is the SM100 image's (packed on a B200-class GPU).
    pub fn hw_order(&self) -> bool {
        self.hw
    }

    /// Checks that kernel image `image` reads this weight's nibble order (`op` names the
    /// caller in the error): the sm_80 image cannot read a weight packed for sm_100a.
    pub fn check_image(&self, op: &str, image: KernelImage) -> Result<()> {
        if image == KernelImage::Sm80 && self.hw {
            bail!("{op}: this weight is packed in the sm_100a nibble order, the sm_80 image reads the other");
        }
        Ok(())
    }

    /// The layout.
    pub fn layout(&self) -> &PackedLayout {
        &self.layout
    }

    /// The FP32 global scale.
    pub fn global_scale(&self) -> f32 {
        self.global_scale
    }

    /// The device the weight lives on.
    pub fn device(&self) -> &candle_core::Device {
        self.codes.device()
    }

    /// Bytes a GEMV reads: packed codes and scale words.
    pub fn bytes(&self) -> usize {
        self.layout.code_bytes() + 4 * self.layout.scale_words()
    }

    /// The ModelOpt codes `[N, K/2]` and row-major E4M3 scales `[N, K/16]` on the host
    /// (blocks with a zero scale come back with zero codes).
    pub fn to_modelopt(&self) -> Result<(Vec<u8>, Vec<u8>)> {
        let c = self.codes.to_vec1::<u8>()?;
        let s = self.scales.to_vec1::<u32>()?;
        unpack(&self.layout, &c, &s, self.hw)
    }

    /// The exact BF16 weight `[N, K]` (`e2m1 · e4m3`, without the global scale) on the
    /// weight's device.
    pub fn dequantize_bf16(&self) -> Result<Tensor> {
        self.codes.apply_op2_no_bwd(
            &self.scales,
            &PackedDequant {
                layout: self.layout,
                hw: self.hw,
            },
        )
    }
}

/// ModelOpt codes + swizzled scales → packed codes (U8 `[code_bytes]`).
struct PackCodes {
    layout: PackedLayout,
    hw: bool,
}

impl CustomOp2 for PackCodes {
    fn name(&self) -> &'static str {
        "nvfp4-pack-codes"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "nvfp4-pack-codes";
        let out = pack_codes(
            &self.layout,
            contiguous_u8(OP, "codes", s1, l1)?,
            contiguous_u8(OP, "scales", s2, l2)?,
            self.hw,
        )?;
        Ok((CpuStorage::U8(out), Shape::from(self.layout.code_bytes())))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda_pack::pack(&self.layout, s1, l1, s2, l2, true)
    }
}

/// Swizzled scales → packed scale words (U32 `[scale_words]`).
struct PackScales {
    layout: PackedLayout,
    hw: bool,
}

impl CustomOp1 for PackScales {
    fn name(&self) -> &'static str {
        "nvfp4-pack-scales"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = pack_scales(
            &self.layout,
            contiguous_u8("nvfp4-pack-scales", "scales", s, l)?,
            self.hw,
        )?;
        Ok((CpuStorage::U32(out), Shape::from(self.layout.scale_words())))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda_pack::pack(&self.layout, s, l, s, l, false)
    }
}

/// Packed codes + scale words → exact BF16 `[N, K]`.
struct PackedDequant {
    layout: PackedLayout,
    hw: bool,
}

impl CustomOp2 for PackedDequant {
    fn name(&self) -> &'static str {
        "nvfp4-packed-dequantize"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "nvfp4-packed-dequantize";
        let l = &self.layout;
        let (codes, scales) = unpack(
            l,
            contiguous_u8(OP, "packed codes", s1, l1)?,
            contiguous_u32(OP, "packed scales", s2, l2)?,
            self.hw,
        )?;
        let swz = swizzle_blockscale_bytes(&scales, l.n, l.k / BLOCK_SIZE)?;
        let w = crate::nvfp4::dequantize_rows_cpu(&codes, &swz, l.n, l.k)?;
        Ok((CpuStorage::BF16(w), Shape::from((l.n, l.k))))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda_pack::dequantize(&self.layout, s1, l1, s2, l2)
    }
}

/// The packed GEMV as a candle op: inputs `x`, packed codes, packed scale words.
pub(crate) struct PackedGemv {
    pub(crate) layout: PackedLayout,
    pub(crate) global_scale: f32,
    pub(crate) hw: bool,
    pub(crate) silu_mul: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) pdl: bool,
    /// CUDA: the launch planned once for this weight (else planned per call).
    #[cfg(feature = "cuda")]
    pub(crate) plan: Option<std::sync::Arc<cuda::PackedPlan>>,
}

impl CustomOp3 for PackedGemv {
    fn name(&self) -> &'static str {
        "nvfp4-packed-gemv"
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
        const OP: &str = "packed_nvfp4_gemv";
        let l = &self.layout;
        let (m, k) = l1.shape().dims2()?;
        let (x, rs) = x_view(OP, s1, l1)?;
        let (codes, scales) = unpack(
            l,
            contiguous_u8(OP, "packed codes", s2, l2)?,
            contiguous_u32(OP, "packed scales", s3, l3)?,
            self.hw,
        )?;
        let swz = swizzle_blockscale_bytes(&scales, l.n, l.k / BLOCK_SIZE)?;
        let sp = swizzled_shape(l.n, l.k / BLOCK_SIZE).1;
        let rows = WeightRows::Nvfp4 {
            codes: &codes,
            scales: &swz,
            sp,
        };
        let out: Vec<bf16> = gemv_cpu(x, rs, m, k, l.n, &rows, self.global_scale, self.silu_mul)?;
        let n_out = if self.silu_mul { l.n / 2 } else { l.n };
        Ok((CpuStorage::BF16(out), Shape::from((m, n_out))))
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
        match &self.plan {
            Some(p) => cuda::forward(p, self.global_scale, s1, l1, s2, l2, s3, l3),
            None => {
                let m = l1.shape().dims2()?.0;
                let nt = cuda::tile_for(m);
                use candle_core::backend::BackendStorage;
                let p = cuda::plan(
                    s1.device(),
                    &self.layout,
                    self.silu_mul,
                    nt,
                    self.pdl,
                    false,
                )?;
                cuda::forward(&p, self.global_scale, s1, l1, s2, l2, s3, l3)
            }
        }
    }
}

/// NVFP4 W4A16 GEMV over a packed weight: `x` BF16 `[M, K]` (M ≤ 32, unit inner stride)
/// → BF16 `[M, N]`, or `[M, N/2]` = `silu(gate)·up` with `silu_mul` (`N` even). `pdl`
/// asks for programmatic dependent launch (CUDA).
pub fn packed_nvfp4_gemv(x: &Tensor, w: &PackedNvfp4, silu_mul: bool, pdl: bool) -> Result<Tensor> {
    let op = PackedGemv {
        layout: w.layout,
        global_scale: w.global_scale,
        hw: w.hw,
        silu_mul,
        pdl,
        #[cfg(feature = "cuda")]
        plan: None,
    };
    packed_gemv_with(x, w, op)
}

/// A packed GEMV launch planned once for one weight, epilogue and token tile (CUDA):
/// what [`QuantLinear`](crate::quant_linear::QuantLinear) keeps, for benchmarks and
/// callers that hold a [`PackedNvfp4`] themselves. On the CPU it carries nothing.
#[derive(Debug, Clone)]
pub struct PackedGemvPlan {
    silu_mul: bool,
    max_m: usize,
    #[cfg(feature = "cuda")]
    plan: Option<std::sync::Arc<cuda::PackedPlan>>,
}

impl PackedGemvPlan {
    /// The CUDA kernel this plan launches for `m` tokens (the plan's choice per token
    /// count, e.g. the staged kernel up to the tokens whose x fits its shared memory);
    /// `None` on the CPU or past the plan's tokens. For tests and tables, not per call.
    pub fn kernel_for(&self, m: usize) -> Option<&str> {
        #[cfg(feature = "cuda")]
        if let Some(p) = &self.plan {
            return p.kernel_for(m);
        }
        let _ = m;
        None
    }
}

impl PackedNvfp4 {
    /// Plans the GEMV of this weight for up to `max_m` tokens (≤ 32) with or without
    /// the `silu_mul` epilogue; `pdl`: programmatic dependent launch (CUDA).
    pub fn plan(&self, silu_mul: bool, max_m: usize, pdl: bool) -> Result<PackedGemvPlan> {
        self.plan_with_image(silu_mul, max_m, pdl, KernelImage::Auto)
    }

    /// [`plan`](Self::plan) from a chosen kernel image: [`KernelImage::Sm80`] runs the
    /// sm_80 code (A100 / RTX 40xx: no PDL) on this GPU, for tests. The weight must have
    /// been packed in that image's nibble order (every image but sm_100a shares one).
    pub fn plan_with_image(
        &self,
        silu_mul: bool,
        max_m: usize,
        pdl: bool,
        image: KernelImage,
    ) -> Result<PackedGemvPlan> {
        if max_m == 0 || max_m > MAX_M {
            bail!("PackedNvfp4::plan: max_m = {max_m} is outside 1..={MAX_M}");
        }
        self.check_image("PackedNvfp4::plan", image)?;
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(d) = self.device() {
            let nt = cuda::tile_for(max_m);
            let p = cuda::plan(
                d,
                &self.layout,
                silu_mul,
                nt,
                pdl,
                image == KernelImage::Sm80,
            )?;
            return Ok(PackedGemvPlan {
                silu_mul,
                max_m: 8 * nt,
                plan: Some(std::sync::Arc::new(p)),
            });
        }
        let _ = pdl;
        Ok(PackedGemvPlan {
            silu_mul,
            max_m,
            #[cfg(feature = "cuda")]
            plan: None,
        })
    }
}

/// [`packed_nvfp4_gemv`] launching a plan made by [`PackedNvfp4::plan`] (its epilogue).
pub fn packed_nvfp4_gemv_planned(
    x: &Tensor,
    w: &PackedNvfp4,
    plan: &PackedGemvPlan,
) -> Result<Tensor> {
    if x.dims().first().is_some_and(|&m| m > plan.max_m) {
        bail!(
            "packed_nvfp4_gemv: the plan serves up to {} tokens, x has {:?}",
            plan.max_m,
            x.dims()
        );
    }
    let op = PackedGemv {
        layout: w.layout,
        global_scale: w.global_scale,
        hw: w.hw,
        silu_mul: plan.silu_mul,
        pdl: false,
        #[cfg(feature = "cuda")]
        plan: plan.plan.clone(),
    };
    packed_gemv_with(x, w, op)
}

/// [`packed_nvfp4_gemv`] launching `plan` (made once for the weight).
#[cfg(feature = "cuda")]
pub(crate) fn packed_gemv_planned(
    x: &Tensor,
    w: &PackedNvfp4,
    silu_mul: bool,
    plan: std::sync::Arc<cuda::PackedPlan>,
) -> Result<Tensor> {
    let op = PackedGemv {
        layout: w.layout,
        global_scale: w.global_scale,
        hw: w.hw,
        silu_mul,
        pdl: false,
        plan: Some(plan),
    };
    packed_gemv_with(x, w, op)
}

/// [`packed_nvfp4_gemv`] with the op (and its plan) given.
pub(crate) fn packed_gemv_with(x: &Tensor, w: &PackedNvfp4, op: PackedGemv) -> Result<Tensor> {
    const OP: &str = "packed_nvfp4_gemv";
    let (m, k) = check_x(OP, x)?;
    if m > MAX_M {
        bail!("{OP}: M = {m} is above {MAX_M}");
    }
    if k != w.layout.k {
        bail!(
            "{OP}: x has K = {k}, the weight [{}, {}]",
            w.layout.n,
            w.layout.k
        );
    }
    if op.silu_mul && !w.layout.n.is_multiple_of(2) {
        bail!(
            "{OP}: silu_mul needs an even N ([gate | up] halves), got N = {}",
            w.layout.n
        );
    }
    if !x.device().same_device(w.device()) {
        bail!("{OP}: x and the weight are on different devices");
    }
    x.apply_op3_no_bwd(&w.codes, &w.scales, &op)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The sm_80 image reads only the software nibble order: a weight packed for sm_100a
    /// (the hardware convert's order) is refused for it, whichever caller plans it
    /// (`PackedNvfp4::plan`, a `QuantLinear` with the image knob), and accepted for the
    /// device's own image.
    #[test]
    fn sm80_image_refuses_the_sm100_order() -> Result<()> {
        let (n, k) = (16, 64);
        let codes = Tensor::zeros((n, k / 2), DType::U8, &Device::Cpu)?;
        let scales = Tensor::zeros(swizzled_shape(n, k / 16), DType::U8, &Device::Cpu)?;
        let mut w = PackedNvfp4::pack(&codes, &scales, 1.0)?;
        assert!(!w.hw_order(), "a CPU pack uses the software order");
        w.check_image("test", KernelImage::Sm80)?;
        w.check_image("test", KernelImage::Auto)?;
        w.hw = true;
        assert!(w.check_image("test", KernelImage::Sm80).is_err());
        w.check_image("test", KernelImage::Auto)?;
        w.plan(false, 1, false)?;
        assert!(w
            .plan_with_image(false, 1, false, KernelImage::Sm80)
            .is_err());
        Ok(())
    }
}
