//! The SwiGLU MLP: fused gate|up with the GEMV's `silu(gate)·up` epilogue, then down_proj.

use super::capture::{LinearInputs, Site};
use super::linear::{check_dims, rebiased, FusedLinear, Loader};
use crate::config::LlamaConfig;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Module, Tensor};
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4::tensor_parallel::{self as tp, AllReduce, Shard};
use std::sync::Arc;

/// One layer's MLP (`model.layers.{i}.mlp`).
#[derive(Debug)]
pub struct Mlp {
    gate_up: FusedLinear,
    down: QuantLinear,
    /// Tensor parallel: the sum over the ranks after down_proj (row-parallel).
    reduce: Option<Arc<dyn AllReduce>>,
}

impl Mlp {
    /// Loads `{prefix}.gate_proj|up_proj` (fused) and `{prefix}.down_proj`, checking their
    /// shapes against `cfg`.
    pub fn load(ld: &Loader<'_>, cfg: &LlamaConfig, prefix: &str) -> Result<Self> {
        let h = cfg.hidden_size;
        let names = [format!("{prefix}.gate_proj"), format!("{prefix}.up_proj")];
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let gate_up = ld.fused(&names)?;
        check_dims(
            ld.ckpt.origin(),
            &format!("{prefix}.gate_proj|up_proj"),
            gate_up.out_features(),
            gate_up.in_features(),
            2 * cfg.intermediate_size,
            h,
        )?;
        let down = ld.linear(&format!("{prefix}.down_proj"))?;
        check_dims(
            ld.ckpt.origin(),
            &format!("{prefix}.down_proj"),
            down.out_features(),
            down.in_features(),
            h,
            cfg.intermediate_size,
        )?;
        Ok(Self {
            gate_up,
            down,
            reduce: None,
        })
    }

    /// An MLP from its fused `gate|up` layer (`[2·intermediate, hidden]`, gate rows first)
    /// and `down` (`[hidden, intermediate]`), e.g. built in memory ([`super::random`]).
    pub fn from_parts(gate_up: QuantLinear, down: QuantLinear) -> Result<Self> {
        if gate_up.out_features() != 2 * down.in_features()
            || gate_up.in_features() != down.out_features()
        {
            bail!(
                "Mlp::from_parts: gate|up [{}, {}] and down [{}, {}] do not match",
                gate_up.out_features(),
                gate_up.in_features(),
                down.out_features(),
                down.in_features()
            )
        }
        Ok(Self {
            gate_up: FusedLinear::One(gate_up),
            down,
            reduce: None,
        })
    }

    /// Rank `shard`'s part on `device` (Megatron): gate|up column-parallel as
    /// `[gate_r | up_r]` (the `silu_mul` epilogue stays), down_proj row-parallel, its output
    /// summed over the ranks by `reduce`.
    pub(super) fn shard(
        &self,
        shard: Shard,
        reduce: Arc<dyn AllReduce>,
        device: &Device,
    ) -> Result<Self> {
        let inter = self.down.in_features();
        Ok(Self {
            gate_up: self.gate_up.shard_columns(&[inter, inter], shard, device)?,
            down: tp::row_parallel(&self.down, shard, device)?,
            reduce: Some(reduce),
        })
    }

    /// Sums down_proj's output over the ranks with `reduce` (see
    /// [`Attention::set_reduce`](super::attention::Attention)).
    pub(super) fn set_reduce(&mut self, reduce: Arc<dyn AllReduce>) {
        self.reduce = Some(reduce);
    }

    /// down_proj, then (tensor parallel) the sum over the ranks.
    pub(super) fn down_out(&self, m: &Tensor) -> candle_core::Result<Tensor> {
        let d = self.down.forward(m)?;
        match &self.reduce {
            Some(r) => r.all_reduce(&d),
            None => Ok(d),
        }
    }

    /// Whether gate/up (the first of them) and down_proj all carry a bias.
    pub fn has_bias(&self) -> bool {
        self.gate_up.has_bias() && self.down.bias().is_some()
    }

    /// The Linears of `site` (gate, up fused or not, or down_proj); none for attention's.
    pub fn linears(&self, site: Site) -> Vec<&QuantLinear> {
        match site {
            Site::GateUp => self.gate_up.layers(),
            Site::Down => vec![&self.down],
            Site::Qkv | Site::O => vec![],
        }
    }

    /// Every Linear (gate/up, down), mutably.
    pub fn linears_mut(&mut self) -> Vec<&mut QuantLinear> {
        let mut v = self.gate_up.layers_mut();
        v.push(&mut self.down);
        v
    }

    /// Replaces the Linears of `site` (gate, up in that order; or down_proj) by `layers`
    /// with the old shapes, keeping the old biases.
    pub fn set_linears(&mut self, site: Site, layers: Vec<QuantLinear>) -> Result<()> {
        match site {
            Site::GateUp => self.gate_up.replace(layers),
            Site::Down => {
                let mut new = rebiased(&[&self.down], layers)?;
                self.down = new.pop().context("no layer given")?;
                Ok(())
            }
            Site::Qkv | Site::O => bail!("the MLP has no {site:?} Linears"),
        }
    }

    /// `down(silu(gate(x)) · up(x))` for `x` `[t, hidden]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_captured(x, &mut super::capture::ignore_inputs)
    }

    /// The residual add and `norm` in front of the MLP, then the MLP: `(x + delta, mlp(norm(x
    /// + delta)))`, the norm inside the gate|up GEMV's kernel where it can run there.
    pub fn forward_add_norm(
        &self,
        x: &Tensor,
        delta: Option<&Tensor>,
        norm: &super::norm::RmsNorm,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (s, m) = self.gate_up.forward_add_norm(x, delta, norm, true)?;
        Ok((s, self.down_out(&m)?))
    }

    /// [`forward`](Self::forward), reporting the inputs of gate/up ([`Site::GateUp`]) and
    /// down_proj ([`Site::Down`]) to `hook`.
    pub fn forward_captured(
        &self,
        x: &Tensor,
        hook: &mut LinearInputs<'_>,
    ) -> candle_core::Result<Tensor> {
        hook(Site::GateUp, x)?;
        let m = self.gate_up.forward_silu_mul(x)?;
        hook(Site::Down, &m)?;
        self.down_out(&m)
    }
}
