//! Loading the model's weights ([`Loader`], the checkpoint and its quant config, as
//! candle's `VarBuilder` is to candle-transformers) and the row-fused projections
//! ([`FusedLinear`]: q|k|v and gate|up as one [`QuantLinear`] when their global scales
//! allow it, else as separate layers).

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_fp4::checkpoint::Checkpoint;
use candle_fp4::quant_config::QuantConfig;
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4::tensor_parallel::{self as tp, Shard};

/// Where the modules' `load` functions read their weights from (what candle's
/// `VarBuilder` is to candle-transformers).
pub struct Loader<'a> {
    /// The checkpoint.
    pub ckpt: &'a Checkpoint,
    /// Which modules are NVFP4.
    pub quant: &'a QuantConfig,
    /// The activation dtype (norm weights are converted to it).
    pub dtype: DType,
    /// Where the weights go.
    pub device: &'a Device,
}

impl Loader<'_> {
    /// The Linear `prefix` (NVFP4 or BF16, as the quant config says).
    pub fn linear(&self, prefix: &str) -> Result<QuantLinear> {
        Ok(QuantLinear::load(
            self.ckpt,
            prefix,
            self.device,
            self.quant,
        )?)
    }

    /// The Linears `prefixes` with their rows concatenated ([`FusedLinear::load`]).
    pub(super) fn fused(&self, prefixes: &[&str]) -> Result<FusedLinear> {
        FusedLinear::load(self, prefixes)
    }

    /// A vector `name` of `n` values (BF16, F16 or F32) in the activation dtype.
    pub fn vector(&self, name: &str, n: usize) -> Result<Tensor> {
        let t = self
            .ckpt
            .get_checked(name, &[DType::BF16, DType::F16, DType::F32], &[n])?;
        Ok(t.to_tensor(self.device)?.to_dtype(self.dtype)?)
    }

    /// Whether `prefixes` must be kept as separate layers: all NVFP4 with global scales
    /// (`weight_scale_2`) that are not bit for bit the same, which a fused layer cannot
    /// represent. Decided on the stored values, before anything is loaded; a scale that
    /// cannot be read leaves the decision to the fused load (which reports it).
    fn global_scales_differ(&self, prefixes: &[&str]) -> bool {
        if prefixes.len() < 2 || !prefixes.iter().all(|p| self.quant.is_nvfp4(p)) {
            return false;
        }
        let scales: Option<Vec<u32>> = prefixes
            .iter()
            .map(|p| {
                self.ckpt
                    .scalar_f32(&format!("{p}.weight_scale_2"))
                    .ok()
                    .map(f32::to_bits)
            })
            .collect();
        scales.is_some_and(|s| s.iter().any(|b| *b != s[0]))
    }
}

/// A projection that is fused when the checkpoint allows it (shared global scale), else
/// kept as separate layers whose outputs are concatenated.
#[derive(Debug)]
pub(super) enum FusedLinear {
    /// One layer holding every member's rows.
    One(QuantLinear),
    /// The members, in order.
    Split(Vec<QuantLinear>),
}

impl FusedLinear {
    /// Loads `prefixes` as one fused layer ([`QuantLinear::load_fused`]), or, when they
    /// are NVFP4 with different global scales, as separate layers checked as the fused
    /// load checks them (same `in_features`, a bias on all or none).
    fn load(ld: &Loader<'_>, prefixes: &[&str]) -> Result<Self> {
        if !ld.global_scales_differ(prefixes) {
            return Ok(Self::One(QuantLinear::load_fused(
                ld.ckpt, prefixes, ld.device, ld.quant,
            )?));
        }
        let ls = prefixes
            .iter()
            .map(|p| QuantLinear::load(ld.ckpt, p, ld.device, ld.quant))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let origin = ld.ckpt.origin();
        let (first, k) = (prefixes[0], ls[0].in_features());
        for (p, l) in prefixes.iter().zip(&ls).skip(1) {
            if l.in_features() != k {
                bail!(
                    "{origin}: cannot fuse `{first}` (in_features {k}) with `{p}` (in_features {})",
                    l.in_features()
                );
            }
            if l.bias().is_some() != ls[0].bias().is_some() {
                bail!("{origin}: cannot fuse `{first}` and `{p}`: only one of them has a bias");
            }
        }
        Ok(Self::Split(ls))
    }

    /// The member layers, in order.
    pub fn layers(&self) -> Vec<&QuantLinear> {
        match self {
            Self::One(l) => vec![l],
            Self::Split(ls) => ls.iter().collect(),
        }
    }

    /// The member layers, in order, mutably.
    pub fn layers_mut(&mut self) -> Vec<&mut QuantLinear> {
        match self {
            Self::One(l) => vec![l],
            Self::Split(ls) => ls.iter_mut().collect(),
        }
    }

    /// Rank `shard`'s column-parallel part on `device`: a fused layer split member by
    /// member (`members`: the unsharded member row counts, e.g. q, k, v), separate layers
    /// each split on its own (member `i` of them is `members[i]` rows).
    pub(super) fn shard_columns(
        &self,
        members: &[usize],
        shard: Shard,
        device: &Device,
    ) -> Result<Self> {
        Ok(match self {
            Self::One(l) => Self::One(tp::fused_column_parallel(l, members, shard, device)?),
            Self::Split(ls) => Self::Split(
                ls.iter()
                    .map(|l| tp::column_parallel(l, shard, device))
                    .collect::<candle_core::Result<Vec<_>>>()?,
            ),
        })
    }

    /// Output features (all members).
    pub fn out_features(&self) -> usize {
        self.layers().iter().map(|l| l.out_features()).sum()
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.layers()[0].in_features()
    }

    /// Whether the (first) layer has a bias.
    pub fn has_bias(&self) -> bool {
        self.layers()[0].bias().is_some()
    }

    /// `x · Wᵀ` of all members, concatenated along the last dimension.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::One(l) => l.forward(x),
            Self::Split(ls) => {
                let ys = ls
                    .iter()
                    .map(|l| l.forward(x))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&ys, D::Minus1)
            }
        }
    }

    /// `silu(gate) · up` for `[gate | up]`.
    pub fn forward_silu_mul(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::One(l) => l.forward_silu_mul(x),
            Self::Split(ls) => {
                let dt = x.dtype();
                let g = ls[0].forward(x)?.to_dtype(DType::F32)?;
                let u = ls[1].forward(x)?.to_dtype(DType::F32)?;
                (candle_nn::ops::silu(&g)? * u)?
                    .to_dtype(DType::BF16)?
                    .to_dtype(dt)
            }
        }
    }

    /// The residual add and the norm in front of this projection, then the projection
    /// (`silu_mul`: [`forward_silu_mul`](Self::forward_silu_mul)): `(x + delta, y)`. A fused
    /// layer behind the fused norm runs it in one kernel where it can
    /// ([`QuantLinear::forward_add_norm`]); otherwise the norm, then the projection.
    pub fn forward_add_norm(
        &self,
        x: &Tensor,
        delta: Option<&Tensor>,
        norm: &super::norm::RmsNorm,
        silu_mul: bool,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        if let (Self::One(l), Some(f)) = (self, norm.fused_for(x)) {
            return l.forward_add_norm(x, delta, f, silu_mul);
        }
        let (s, h) = norm.add_forward(x, delta)?;
        let y = if silu_mul {
            self.forward_silu_mul(&h)?
        } else {
            self.forward(&h)?
        };
        Ok((s, y))
    }

    /// Replaces the members by `layers` (same total rows and inputs), giving each the
    /// rows of the old layers' biases (fused or not) it covers, unless it has its own.
    pub fn replace(&mut self, layers: Vec<QuantLinear>) -> Result<()> {
        *self = Self::Split(rebiased(&self.layers(), layers)?);
        Ok(())
    }
}

/// Checks that a layer `[out, inp]` is `[n, k]` (`what` names it in the error, `origin`
/// its checkpoint): a typed [`ShapeMismatch`](crate::errors::ConfigError::ShapeMismatch).
pub(super) fn check_dims(
    origin: &str,
    what: &str,
    out: usize,
    inp: usize,
    n: usize,
    k: usize,
) -> Result<()> {
    if out != n || inp != k {
        return Err(crate::errors::ConfigError::ShapeMismatch {
            origin: origin.to_string(),
            tensor: what.to_string(),
            found: vec![out, inp],
            expected: vec![n, k],
        }
        .into());
    }
    Ok(())
}

/// `new` with the rows of `old`'s biases (concatenated) each new layer covers, for those
/// without a bias of their own; errors unless the new layers have the old total rows and
/// inputs.
pub(super) fn rebiased(old: &[&QuantLinear], new: Vec<QuantLinear>) -> Result<Vec<QuantLinear>> {
    let old_n: usize = old.iter().map(|l| l.out_features()).sum();
    let new_n: usize = new.iter().map(QuantLinear::out_features).sum();
    if old_n != new_n || new.iter().any(|l| l.in_features() != old[0].in_features()) {
        bail!("the new layers do not have the old shapes");
    }
    let bias = old
        .iter()
        .filter_map(|l| l.bias().cloned())
        .collect::<Vec<_>>();
    let bias = if bias.is_empty() {
        None
    } else {
        Some(Tensor::cat(&bias, 0)?)
    };
    let mut start = 0;
    let mut out = Vec::with_capacity(new.len());
    for l in new {
        let n = l.out_features();
        out.push(match (&bias, l.bias()) {
            (Some(bb), None) => with_bias(&l, Some(bb.narrow(0, start, n)?))?,
            _ => l,
        });
        start += n;
    }
    Ok(out)
}

/// `l` with bias `bias` (an NVFP4 or BF16 layer rebuilt with the same weight).
fn with_bias(l: &QuantLinear, bias: Option<Tensor>) -> Result<QuantLinear> {
    Ok(match l.to_nvfp4()? {
        Some(q) => QuantLinear::from_nvfp4(&q, bias, l.device())?,
        None => QuantLinear::from_bf16(l.dequantize()?, bias)?,
    })
}
