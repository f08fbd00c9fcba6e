//! Measured sensitivity of each Linear group: the mean KL divergence of the model's
//! next-token distributions, with only that group quantized (ModelOpt's round-to-nearest)
//! and everything else BF16, from the unquantized model's, over calibration tokens.
//!
//! Each group is measured from its block's input (the unquantized model's hidden states
//! there, computed once), through the rest of the model to the logits, so a group of
//! block `i` costs `L − i` blocks and the `lm_head` per token.

use super::select::{bf16_bytes, nvfp4_bytes, MixCandidate};
use crate::eval::metrics::{kl_divergence, log_softmax};
use crate::llama::Site;
use crate::llama::{Llama, LoadOptions};
use crate::quant::rtn::quantize_group;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_fp4::checkpoint::Checkpoint;
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4::quant_linear::QuantLinear;
use std::path::Path;

/// The Linear groups of a Llama with `layers` decoder layers, in the quantizer's order
/// (per layer: q/k/v, o, gate/up, down), with their sites.
pub fn llama_groups(layers: usize) -> Vec<(usize, Site, Vec<String>)> {
    let mut out = vec![];
    for i in 0..layers {
        let a = format!("model.layers.{i}.self_attn");
        let m = format!("model.layers.{i}.mlp");
        out.push((
            i,
            Site::Qkv,
            vec![
                format!("{a}.q_proj"),
                format!("{a}.k_proj"),
                format!("{a}.v_proj"),
            ],
        ));
        out.push((i, Site::O, vec![format!("{a}.o_proj")]));
        out.push((
            i,
            Site::GateUp,
            vec![format!("{m}.gate_proj"), format!("{m}.up_proj")],
        ));
        out.push((i, Site::Down, vec![format!("{m}.down_proj")]));
    }
    out
}

/// A Linear's weight from a (BF16/F16/F32) checkpoint as F32 `(values, n, k)`.
fn load_weight(ckpt: &Checkpoint, name: &str) -> Result<(Vec<f32>, usize, usize)> {
    let t = ckpt
        .get(name)
        .with_context(|| format!("sensitivity: no tensor `{name}`"))?;
    let (n, k) = match t.shape.as_slice() {
        [n, k] => (*n, *k),
        s => bail!("`{name}` has shape {s:?}, expected a 2-d Linear weight"),
    };
    if !matches!(t.dtype, DType::BF16 | DType::F16 | DType::F32) {
        bail!(
            "`{name}` is {:?}: sensitivities are measured on an unquantized model",
            t.dtype
        );
    }
    let v = t
        .to_tensor(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok((v, n, k))
}

/// Mean KL(reference || model) over the rows of `logits` against the stored reference
/// log-probabilities.
fn mean_kl(reference: &[Vec<f32>], logits: &Tensor) -> Result<(f64, usize)> {
    use rayon::prelude::*;
    let q = logits.to_vec2::<f32>()?;
    if q.len() != reference.len() {
        bail!("sensitivity: {} rows against {}", q.len(), reference.len());
    }
    // The rows on all cores (a vocabulary-wide log-softmax and KL each), summed in row
    // order afterwards: the same sum, bit for bit, as a sequential loop.
    let per_row = reference
        .par_iter()
        .zip(q.par_iter())
        .map(|(r, row)| -> Result<f64> {
            let lp: Vec<f64> = r.iter().map(|&v| v as f64).collect();
            Ok(kl_divergence(&lp, &log_softmax(row)?)?)
        })
        .collect::<Result<Vec<f64>>>()?;
    let mut sum = 0.0;
    for v in per_row {
        sum += v;
    }
    Ok((sum, q.len()))
}

/// Sensitivity of every Linear group of the unquantized Llama in `dir` over the token
/// windows `windows` (each run from position 0), with its NVFP4 and BF16 byte counts.
/// `on_group(done, total)` reports progress. Deterministic for a given machine.
pub fn measure_sensitivity(
    dir: &Path,
    windows: &[Vec<u32>],
    on_group: &mut dyn FnMut(usize, usize),
) -> Result<Vec<MixCandidate>> {
    if windows.is_empty() || windows.iter().any(|w| w.len() < 2) {
        bail!("sensitivity: needs at least one window of at least 2 tokens");
    }
    let longest = windows.iter().map(Vec::len).max().unwrap_or(2);
    let lopts = LoadOptions {
        kv_cache: KvCacheKind::Bf16,
        max_seq_len: Some(longest),
        dtype: None,
        prefill_chunk: longest,
        kv_window: 0,
        ..Default::default()
    };
    let mut model = Llama::load(dir, &Device::Cpu, &lopts)
        .context("loading the unquantized model for the sensitivity measurement")?;
    if model.quant_config().quantizes() {
        bail!(
            "{}: sensitivities are measured on an unquantized model",
            dir.display()
        );
    }
    // SAFETY: read-only mapping of the input files, not modified during the run.
    let ckpt = unsafe { Checkpoint::open(dir)? };
    let layers = model.config().num_hidden_layers;
    // Per window: every block's input, and the reference log-probabilities.
    let mut inputs: Vec<Vec<Tensor>> = vec![];
    let mut reference: Vec<Vec<Vec<f32>>> = vec![];
    for w in windows {
        let mut x = model.embed_tokens(w)?;
        let mut per_block = Vec::with_capacity(layers);
        for i in 0..layers {
            per_block.push(x.clone());
            x = model.block_output(i, &x)?;
        }
        let logits = model.logits_of(&x)?.to_vec2::<f32>()?;
        let lp = logits
            .iter()
            .map(|r| Ok(log_softmax(r)?.iter().map(|&v| v as f32).collect()))
            .collect::<Result<Vec<Vec<f32>>>>()?;
        inputs.push(per_block);
        reference.push(lp);
    }
    let groups = llama_groups(layers);
    let total = groups.len();
    let mut out = Vec::with_capacity(total);
    for (done, (i, site, modules)) in groups.iter().enumerate() {
        out.push(measure_group(
            &mut model, &ckpt, &inputs, &reference, *i, *site, modules,
        )?);
        on_group(done + 1, total);
    }
    Ok(out)
}

/// The sensitivity of one group (`modules`, at `site` of block `i`): quantized alone, the
/// rest of `model` unquantized, over every window (`inputs`: each window's block inputs,
/// `reference`: its unquantized log-probabilities); `model` is restored afterwards.
fn measure_group(
    model: &mut Llama,
    ckpt: &Checkpoint,
    inputs: &[Vec<Tensor>],
    reference: &[Vec<Vec<f32>>],
    i: usize,
    site: Site,
    modules: &[String],
) -> Result<MixCandidate> {
    let layers = model.config().num_hidden_layers;
    let ws = modules
        .iter()
        .map(|p| load_weight(ckpt, &format!("{p}.weight")))
        .collect::<Result<Vec<_>>>()?;
    let qs = quantize_group(&ws)?;
    let quantized = qs
        .iter()
        .map(|q| QuantLinear::from_nvfp4(q, None, &Device::Cpu))
        .collect::<candle_core::Result<Vec<_>>>()?;
    model.block_mut(i)?.set_linears(site, quantized)?;
    let (mut kl, mut rows) = (0.0, 0usize);
    for (per_block, lp) in inputs.iter().zip(reference) {
        let mut x = per_block[i].clone();
        for j in i..layers {
            x = model.block_output(j, &x)?;
        }
        let (s, n) = mean_kl(lp, &model.logits_of(&x)?)?;
        kl += s;
        rows += n;
    }
    // Back to the unquantized weights (the same BF16 values).
    let restored = ws
        .iter()
        .map(|(w, n, k)| {
            let t = Tensor::from_slice(w, (*n, *k), &Device::Cpu)?;
            QuantLinear::from_bf16(t, None)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    model.block_mut(i)?.set_linears(site, restored)?;
    let (nv, bf) = ws.iter().fold((0, 0), |(a, b), (_, n, k)| {
        (a + nvfp4_bytes(*n, *k), b + bf16_bytes(*n, *k))
    });
    Ok(MixCandidate {
        modules: modules.to_vec(),
        nvfp4_bytes: nv,
        bf16_bytes: bf,
        sensitivity: (kl / rows.max(1) as f64).max(0.0),
    })
}
