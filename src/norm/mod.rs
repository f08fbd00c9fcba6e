//! RMSNorm fused with the residual add in front of it ([`AddRmsNorm`]): the decode step's
//! one kernel for what took a residual add and a norm, at every layer boundary.
//!
//! Numerics are those of `candle_nn::ops::rms_norm` on the CPU, bit for bit on the CPU
//! (the reference here, so the decode step equals the model's forward there): `s = x + δ`
//! rounded to BF16, `m = bf16(sqrt(Σ s² / n + ε))` with the sum in f32, `out = bf16(bf16(s
//! / m) · w)`. The CUDA kernel (`kernels/rmsnorm.cu`) performs the same IEEE operations; only
//! the order of its f32 sum of squares differs, which can move `m` by one BF16 rounding in
//! rare rows and then `out` by up to two BF16 ulps there (the GPU test's bound).
//!
//! On sm_90 and newer the kernel can also ask L2 for the first weights of the layer that
//! follows it (`QuantLinear::forward_add_norm` passes them, planned at load; extra CTAs,
//! up to one per SM, issue the prefetch so the rows' CTAs keep their latency chain). A
//! hint: it changes no value.

#[cfg(feature = "cuda")]
mod cuda;

use crate::kernel_params::L2Prefetch;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::bf16;

/// One call of an [`AddRmsNorm`]: the op and what the call adds (the L2 prefetch).
struct NormCall<'a> {
    norm: &'a AddRmsNorm,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    prefetch: L2Prefetch,
}

/// The fused residual add + RMSNorm of one norm weight, made once per layer (on a GPU the
/// kernel and the weight's device pointer are resolved here).
#[derive(Debug, Clone)]
pub struct AddRmsNorm {
    n: usize,
    eps: f32,
    weight: Weight,
}

/// The weight as each backend reads it, resolved once in [`AddRmsNorm::new`].
#[derive(Debug, Clone)]
enum Weight {
    Cpu(std::sync::Arc<Vec<bf16>>),
    #[cfg(feature = "cuda")]
    Cuda(cuda::NormPlan),
}

impl AddRmsNorm {
    /// The op for the norm weight `weight` (BF16 `[n]`) and `eps` (finite, ≥ 0).
    pub fn new(weight: &Tensor, eps: f32) -> Result<Self> {
        const WHAT: &str = "AddRmsNorm::new";
        let n = match weight.dims() {
            [n] if *n > 0 && weight.dtype() == DType::BF16 => *n,
            d => bail!(
                "{WHAT}: the weight must be BF16 [n], n > 0, got {:?} {d:?}",
                weight.dtype()
            ),
        };
        if !eps.is_finite() || eps < 0.0 {
            bail!("{WHAT}: eps must be finite and ≥ 0, got {eps}")
        }
        if n > i32::MAX as usize {
            bail!("{WHAT}: a row of {n} values is too long")
        }
        let w = weight.contiguous()?;
        let weight = match w.device() {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(d) => Weight::Cuda(cuda::plan(d, &w)?),
            candle_core::Device::Cpu => Weight::Cpu(std::sync::Arc::new(w.to_vec1::<bf16>()?)),
            d => bail!("{WHAT}: weight on {d:?}: only the CPU and CUDA run this op"),
        };
        Ok(Self { n, eps, weight })
    }

    /// Row length.
    pub fn dim(&self) -> usize {
        self.n
    }

    /// The epsilon under the square root.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// The weight's device pointer when it lives on a GPU (for the GEMVs that run this
    /// norm in their prologue).
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_weight_ptr(&self) -> Option<u64> {
        match &self.weight {
            Weight::Cuda(p) => Some(p.w_ptr()),
            Weight::Cpu(_) => None,
        }
    }

    /// `x` BF16 `[rows, n]` and the residual `delta` (same shape, or `None`) →
    /// `(x + delta, rms_norm(x + delta) · weight)`; with no `delta` the first is `x` itself.
    pub fn forward(&self, x: &Tensor, delta: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        self.forward_prefetch(x, delta, None)
    }

    /// [`forward`](Self::forward) that also asks L2 for `prefetch`'s ranges (the weights of
    /// the GEMV that follows, planned by its layer) once the previous kernel has finished
    /// (CUDA, sm_90 and newer; elsewhere ignored). The values are `forward`'s.
    pub(crate) fn forward_prefetch(
        &self,
        x: &Tensor,
        delta: Option<&Tensor>,
        prefetch: Option<&L2Prefetch>,
    ) -> Result<(Tensor, Tensor)> {
        let op = NormCall {
            norm: self,
            prefetch: prefetch.copied().unwrap_or_default(),
        };
        let rows = match x.dims() {
            [r, n] if *n == self.n && x.dtype() == DType::BF16 => *r,
            d => bail!(
                "AddRmsNorm: x must be BF16 [rows, {}], got {:?} {d:?}",
                self.n,
                x.dtype()
            ),
        };
        let x = x.contiguous()?;
        match delta {
            None => Ok((x.clone(), x.apply_op1_no_bwd(&op)?)),
            Some(d) => {
                if d.dims() != x.dims() || d.dtype() != DType::BF16 {
                    bail!(
                        "AddRmsNorm: delta must be BF16 {:?} like x, got {:?} {:?}",
                        x.dims(),
                        d.dtype(),
                        d.dims()
                    )
                }
                let both = x.apply_op2_no_bwd(&d.contiguous()?, &op)?; // [2, rows, n]
                debug_assert_eq!(both.dims(), [2, rows, self.n]);
                Ok((both.get(0)?, both.get(1)?))
            }
        }
    }

    fn cpu_weight(&self) -> Result<&[bf16]> {
        // (Irrefutable without the cuda feature.)
        #[allow(irrefutable_let_patterns)]
        let Weight::Cpu(w) = &self.weight
        else {
            bail!("AddRmsNorm: the weight is on a GPU, the input on the CPU")
        };
        Ok(w)
    }
}

/// The reference: for each row of `n`, `s = x + delta` (BF16), then candle's CPU RMSNorm of
/// `s`. Returns `(s, out)` (`s` empty when there is no `delta`).
pub(crate) fn add_rms_norm_cpu(
    x: &[bf16],
    delta: Option<&[bf16]>,
    w: &[bf16],
    eps: f32,
) -> (Vec<bf16>, Vec<bf16>) {
    let n = w.len();
    let sum: Vec<bf16> = match delta {
        Some(d) => x.iter().zip(d).map(|(&a, &b)| a + b).collect(),
        None => vec![],
    };
    let src = if delta.is_some() { &sum[..] } else { x };
    let mut out = vec![bf16::ZERO; src.len()];
    for (s, o) in src.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum2 = s
            .iter()
            .map(|&v| {
                let v = v.to_f32();
                v * v
            })
            .sum::<f32>();
        let m = bf16::from_f32((sum2 / n as f32 + eps).sqrt());
        for ((o, &s), &a) in o.iter_mut().zip(s).zip(w) {
            *o = s / m * a;
        }
    }
    (sum, out)
}

fn cpu_bf16<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [bf16]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::BF16(v), Some((a, b))) => Ok(&v[a..b]),
        _ => bail!("AddRmsNorm: {what} must be a contiguous BF16 tensor"),
    }
}

/// Without a residual: `rms_norm(x) · weight`, `[rows, n]`.
impl CustomOp1 for NormCall<'_> {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = cpu_bf16(s, l, "x")?;
        let (_, out) = add_rms_norm_cpu(x, None, self.norm.cpu_weight()?, self.norm.eps);
        Ok((CpuStorage::BF16(out), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let Weight::Cuda(plan) = &self.norm.weight else {
            bail!("AddRmsNorm: the weight is on the CPU, the input on a GPU")
        };
        let out = cuda::forward(plan, self.norm.n, self.norm.eps, s, l, None, &self.prefetch)?;
        Ok((out, l.shape().clone()))
    }
}

/// With a residual: `[2, rows, n]`, `x + delta` then its norm.
impl CustomOp2 for NormCall<'_> {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, d) = (cpu_bf16(s1, l1, "x")?, cpu_bf16(s2, l2, "delta")?);
        let (mut sum, out) = add_rms_norm_cpu(x, Some(d), self.norm.cpu_weight()?, self.norm.eps);
        sum.extend_from_slice(&out);
        let rows = x.len() / self.norm.n;
        Ok((CpuStorage::BF16(sum), Shape::from((2, rows, self.norm.n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let Weight::Cuda(plan) = &self.norm.weight else {
            bail!("AddRmsNorm: the weight is on the CPU, the input on a GPU")
        };
        let n = self.norm.n;
        let out = cuda::forward(
            plan,
            n,
            self.norm.eps,
            s1,
            l1,
            Some((s2, l2)),
            &self.prefetch,
        )?;
        let rows = l1.shape().elem_count() / n;
        Ok((out, Shape::from((2, rows, n))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn bits(t: &Tensor) -> Result<Vec<u16>> {
        Ok(t.flatten_all()?
            .to_vec1::<bf16>()?
            .iter()
            .map(|v| v.to_bits())
            .collect())
    }

    /// The op equals candle's add then candle's CPU `rms_norm`, bit for bit, on awkward
    /// row lengths, with and without the residual; bad inputs are errors.
    #[test]
    fn equals_candle_add_then_rms_norm() -> Result<()> {
        use rand::{Rng, SeedableRng};
        let dev = Device::Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut t = |shape: &[usize], lo: f32, hi: f32| -> Result<Tensor> {
            let n = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
            Tensor::from_vec(v, shape, &dev)?.to_dtype(DType::BF16)
        };
        for (rows, n, eps) in [
            (1, 576, 1e-5f32),
            (3, 4096, 1e-6),
            (5, 577, 0.0),
            (2, 1, 1e-5),
        ] {
            let x = t(&[rows, n], -3.0, 3.0)?;
            let d = t(&[rows, n], -1.0, 1.0)?;
            let w = t(&[n], 0.5, 1.5)?;
            let op = AddRmsNorm::new(&w, eps)?;
            let (s, o) = op.forward(&x, Some(&d))?;
            let want_s = (&x + &d)?;
            let want_o = candle_nn::ops::rms_norm(&want_s, &w, eps)?;
            assert_eq!(bits(&s)?, bits(&want_s)?, "sum rows {rows} n {n}");
            assert_eq!(bits(&o)?, bits(&want_o)?, "norm rows {rows} n {n}");
            let (s0, o0) = op.forward(&x, None)?;
            assert_eq!(bits(&s0)?, bits(&x)?);
            assert_eq!(bits(&o0)?, bits(&candle_nn::ops::rms_norm(&x, &w, eps)?)?);
        }
        let w = Tensor::ones(8, DType::BF16, &dev)?;
        let op = AddRmsNorm::new(&w, 1e-5)?;
        let x = Tensor::ones((2, 8), DType::BF16, &dev)?;
        assert!(op.forward(&x.narrow(1, 0, 4)?, None).is_err());
        assert!(op.forward(&x.to_dtype(DType::F32)?, None).is_err());
        assert!(op.forward(&x, Some(&x.narrow(0, 0, 1)?)).is_err());
        assert!(AddRmsNorm::new(&w, f32::NAN).is_err());
        assert!(AddRmsNorm::new(&w.to_dtype(DType::F32)?, 1e-5).is_err());
        Ok(())
    }
}
