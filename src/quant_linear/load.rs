//! Loading a `QuantLinear` (or a row-wise fusion of several) from a ModelOpt checkpoint.

use super::layer::QuantLinear;
use crate::checkpoint::Checkpoint;
use crate::error::CheckpointError;
use crate::nvfp4::{first_bad_block_scale, Nvfp4Quantized, BLOCK_SIZE};
use crate::quant_config::QuantConfig;
use candle_core::{bail, DType, Device, Result, Tensor};

const FLOATS: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

/// One layer's weight as read from the checkpoint.
enum Part {
    Nvfp4(Nvfp4Quantized),
    Bf16(Tensor),
}

impl Part {
    fn k(&self) -> Result<usize> {
        match self {
            Part::Nvfp4(q) => Ok(q.k),
            Part::Bf16(w) => w.dim(1),
        }
    }
}

/// `prefix.weight` / `weight_scale` / `weight_scale_2` of an NVFP4 layer (`input_scale`
/// is ignored).
fn read_nvfp4(ckpt: &Checkpoint, prefix: &str, cfg: &QuantConfig) -> Result<Nvfp4Quantized> {
    let origin = ckpt.origin();
    let wname = format!("{prefix}.weight");
    let w = ckpt.get(&wname)?;
    let (n, k2) = match (w.dtype, w.shape.as_slice()) {
        (DType::U8, &[n, k2]) => (n, k2),
        (dt, shape) => bail!(
            "{origin}: tensor `{wname}` is {dt:?} {shape:?}, expected NVFP4 codes U8 [N, K/2] \
             (quant_algo {:?} and `{prefix}` is not excluded by the quant config)",
            cfg.quant_algo
        ),
    };
    let k = k2.saturating_mul(2); // k2 ≤ the file's size: no saturation in practice
    if n == 0 || k == 0 || !k.is_multiple_of(BLOCK_SIZE) {
        bail!("{origin}: tensor `{wname}` has shape [{n}, {k2}]: K = {k} must be a positive multiple of {BLOCK_SIZE}");
    }
    let sname = format!("{prefix}.weight_scale");
    let s = ckpt.get_checked(&sname, &[DType::F8E4M3, DType::U8], &[n, k / BLOCK_SIZE])?;
    if let Some((index, byte, value)) = first_bad_block_scale(s.data) {
        let (row, block) = (index / (k / BLOCK_SIZE), index % (k / BLOCK_SIZE));
        Err(CheckpointError::BadBlockScale {
            file: origin.to_string(),
            tensor: sname,
            index,
            row,
            block,
            byte,
            value,
        })?
    }
    let gname = format!("{prefix}.weight_scale_2");
    let global_scale = ckpt.scalar_f32(&gname)?;
    if !(global_scale.is_finite() && global_scale > 0.0) {
        Err(CheckpointError::BadGlobalScale {
            file: origin.to_string(),
            tensor: gname,
            value: global_scale,
        })?
    }
    Ok(Nvfp4Quantized {
        n,
        k,
        weight: w.data.to_vec(),
        weight_scale: s.data.to_vec(),
        global_scale,
    })
}

/// One layer: its weight (NVFP4 or BF16 on `device`) and optional BF16 bias.
fn read_part(
    ckpt: &Checkpoint,
    prefix: &str,
    device: &Device,
    cfg: &QuantConfig,
) -> Result<(Part, Option<Tensor>)> {
    let part = if cfg.is_nvfp4(prefix) {
        Part::Nvfp4(read_nvfp4(ckpt, prefix, cfg)?)
    } else {
        let wname = format!("{prefix}.weight");
        let w = ckpt.get(&wname)?;
        if !FLOATS.contains(&w.dtype) || w.shape.len() != 2 {
            bail!(
                "{}: tensor `{wname}` is {:?} {:?}, expected a BF16/F16/F32 [N, K] weight \
                 (the quant config does not quantize `{prefix}`: quant_algo {:?}, excluded: {})",
                ckpt.origin(),
                w.dtype,
                w.shape,
                cfg.quant_algo,
                cfg.is_excluded(prefix)
            );
        }
        Part::Bf16(w.to_tensor(device)?.to_dtype(DType::BF16)?)
    };
    let n = match &part {
        Part::Nvfp4(q) => q.n,
        Part::Bf16(w) => w.dim(0)?,
    };
    let bname = format!("{prefix}.bias");
    let bias = if ckpt.contains(&bname) {
        let b = ckpt.get_checked(&bname, &FLOATS, &[n])?;
        Some(b.to_tensor(device)?.to_dtype(DType::BF16)?)
    } else {
        None
    };
    Ok((part, bias))
}

impl QuantLinear {
    /// Loads the layer `prefix` (e.g. `model.layers.0.mlp.down_proj`) onto `device`.
    ///
    /// NVFP4 when `cfg` quantizes and does not exclude `prefix`: `prefix.weight` U8
    /// `[N, K/2]`, `prefix.weight_scale` F8_E4M3 (or U8) `[N, K/16]`,
    /// `prefix.weight_scale_2` F32 `[]` or `[1]` (finite, > 0); `prefix.input_scale` is
    /// ignored. Otherwise `prefix.weight` BF16/F16/F32 `[N, K]`, converted to BF16.
    /// `prefix.bias` `[N]` is optional. Errors name the offending tensor.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        device: &Device,
        cfg: &QuantConfig,
    ) -> Result<Self> {
        Self::load_fused(ckpt, &[prefix], device, cfg)
    }

    /// Loads several layers with the same `K` and concatenates their rows in order
    /// (`[q | k | v]`, `[gate | up]`). NVFP4 members must share one global scale (bit
    /// for bit; ModelOpt exports q/k/v and gate/up that way) and all be NVFP4 or all
    /// BF16; either all or none have a bias.
    pub fn load_fused(
        ckpt: &Checkpoint,
        prefixes: &[&str],
        device: &Device,
        cfg: &QuantConfig,
    ) -> Result<Self> {
        let origin = ckpt.origin();
        let Some(&first) = prefixes.first() else {
            bail!("{origin}: QuantLinear::load_fused needs at least one layer");
        };
        let mut parts = Vec::with_capacity(prefixes.len());
        for p in prefixes {
            parts.push(read_part(ckpt, p, device, cfg)?);
        }
        let k = parts[0].0.k()?;
        for (p, (part, bias)) in prefixes.iter().zip(&parts).skip(1) {
            if part.k()? != k {
                bail!(
                    "{origin}: cannot fuse `{first}` (in_features {k}) with `{p}` (in_features {})",
                    part.k()?
                );
            }
            if bias.is_some() != parts[0].1.is_some() {
                bail!("{origin}: cannot fuse `{first}` and `{p}`: only one of them has a bias");
            }
        }
        let biases: Vec<Tensor> = parts.iter().filter_map(|(_, b)| b.clone()).collect();
        let bias = match biases.is_empty() {
            true => None,
            false => Some(Tensor::cat(&biases, 0)?),
        };
        let mut nvfp4 = vec![];
        let mut bf16 = vec![];
        for (p, (part, _)) in prefixes.iter().zip(parts) {
            match part {
                Part::Nvfp4(q) => nvfp4.push((p, q)),
                Part::Bf16(w) => bf16.push((p, w)),
            }
        }
        if let (Some((a, _)), Some((b, _))) = (nvfp4.first(), bf16.first()) {
            bail!("{origin}: cannot fuse NVFP4 `{a}` with 16-bit `{b}` (one is excluded by the quant config)");
        }
        if !bf16.is_empty() {
            let ws: Vec<Tensor> = bf16.into_iter().map(|(_, w)| w).collect();
            return Self::from_bf16(Tensor::cat(&ws, 0)?, bias);
        }
        let (p0, q0) = &nvfp4[0];
        for (p, q) in &nvfp4[1..] {
            if q.global_scale.to_bits() != q0.global_scale.to_bits() {
                bail!(
                    "{origin}: cannot fuse layers with different global scales: `{p0}.weight_scale_2` = {:e}, `{p}.weight_scale_2` = {:e}",
                    q0.global_scale,
                    q.global_scale
                );
            }
        }
        let fused = Nvfp4Quantized {
            n: nvfp4.iter().map(|(_, q)| q.n).sum(),
            k,
            weight: nvfp4
                .iter()
                .flat_map(|(_, q)| q.weight.iter().copied())
                .collect(),
            weight_scale: nvfp4
                .iter()
                .flat_map(|(_, q)| q.weight_scale.iter().copied())
                .collect(),
            global_scale: q0.global_scale,
        };
        Self::from_nvfp4(&fused, bias, device)
    }
}
