//! The SwiGLU MLP: fused gate|up with the GEMV's `silu(gate)·up` epilogue, then down_proj.

use super::capture::{LinearInputs, Site};
use super::linear::{check_dims, rebiased, FusedLinear, Loader};
use crate::config::LlamaConfig;
use anyhow::{bail, Context, Result};
use candle_core::{Module, Tensor};
use candle_fp4::quant_linear::QuantLinear;

/// One layer's MLP (`model.layers.{i}.mlp`).
#[derive(Debug)]
pub struct Mlp {
    gate_up: FusedLinear,
    down: QuantLinear,
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
        Ok(Self { gate_up, down })
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
        })
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
        Ok((s, self.down.forward(&m)?))
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
        self.down.forward(&m)
    }
}
