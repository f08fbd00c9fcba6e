//! Calibration for GPTQ ([`crate::gptq`]): runs the unquantized Llama block by block over
//! the calibration tokens, accumulates each Linear group's input Hessian, quantizes the
//! group and (sequential mode) puts the quantized weights back into the model so that
//! every later group is calibrated on the activations the quantized model produces.

use crate::gptq::{gptq_quantize_group, GptqParams, Hessian};
use crate::llama::{BlockInputs, Site};
use crate::Llama;
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use candle_fp4::nvfp4::Nvfp4Quantized;
use candle_fp4::quant_linear::QuantLinear;
use std::collections::HashMap;

/// Gives a Linear's original weight `(values, n, k)` (row-major F32) by tensor name.
pub(crate) type WeightLoader<'a> = dyn FnMut(&str) -> Result<(Vec<f32>, usize, usize)> + 'a;

/// Where a group of Linears (module prefixes) sits: block index and site.
fn locate(group: &[String]) -> Result<(usize, Site)> {
    let first = group.first().context("empty Linear group")?;
    let rest = first
        .strip_prefix("model.layers.")
        .with_context(|| format!("`{first}` is not a decoder-layer Linear"))?;
    let (i, tail) = rest
        .split_once('.')
        .with_context(|| format!("`{first}`: no layer index"))?;
    let i: usize = i
        .parse()
        .with_context(|| format!("`{first}`: bad layer index"))?;
    let site = match tail {
        "self_attn.q_proj" | "self_attn.k_proj" | "self_attn.v_proj" => Site::Qkv,
        "self_attn.o_proj" => Site::O,
        "mlp.gate_proj" | "mlp.up_proj" => Site::GateUp,
        "mlp.down_proj" => Site::Down,
        _ => bail!("`{first}`: not a Llama projection GPTQ knows"),
    };
    Ok((i, site))
}

/// How to calibrate.
pub(crate) struct CalibRun<'a> {
    /// Token windows, each run from position 0.
    pub windows: &'a [Vec<u32>],
    pub params: &'a GptqParams,
    /// Feed each group the activations of the model quantized so far (else: one pass of
    /// the unquantized model gives every Hessian).
    pub sequential: bool,
}

/// GPTQ of every group in `groups` (q/k/v, o, gate/up, down of each layer; a group is
/// quantized whole with one shared global scale), calibrated on `model` (the unquantized
/// model; its weights are replaced as it goes in sequential mode). `load` gives a Linear's
/// original weight `(values, n, k)` by prefix; `on_group` is called after each group.
pub(crate) fn gptq_llama(
    model: &mut Llama,
    run: &CalibRun<'_>,
    groups: &[Vec<String>],
    load: &mut WeightLoader<'_>,
    on_group: &mut dyn FnMut(&[String]),
) -> Result<HashMap<String, Nvfp4Quantized>> {
    let mut by_layer: HashMap<usize, Vec<(Site, &Vec<String>)>> = HashMap::new();
    for g in groups {
        let (i, site) = locate(g)?;
        by_layer.entry(i).or_default().push((site, g));
    }
    let layers = model.config().num_hidden_layers;
    if let Some(bad) = by_layer.keys().find(|&&i| i >= layers) {
        bail!("Linear group in layer {bad}, but the model has {layers} layers");
    }
    let mut hidden: Vec<Tensor> = run
        .windows
        .iter()
        .map(|w| model.calib_embed(w))
        .collect::<Result<_>>()?;
    let mut out = HashMap::new();
    for i in 0..layers {
        let mut jobs = by_layer.remove(&i).unwrap_or_default();
        jobs.sort_by_key(|(s, _)| *s as u8);
        if !run.sequential {
            // One pass: every site's Hessian from the unquantized block.
            let mut hs: Vec<Option<Hessian>> = vec![None; jobs.len()];
            for x in hidden.iter_mut() {
                let mut cap = BlockInputs::default();
                let y = model.calib_block(i, x, Some(&mut cap))?;
                for ((site, _), h) in jobs.iter().zip(hs.iter_mut()) {
                    accumulate(h, cap.get(*site))?;
                }
                *x = y;
            }
            for ((_, g), h) in jobs.iter().zip(hs) {
                let qs = quantize(g, h, load, run.params)?;
                out.extend(g.iter().cloned().zip(qs));
                on_group(g);
            }
            continue;
        }
        for (site, g) in &jobs {
            let mut h = None;
            for x in &hidden {
                let mut cap = BlockInputs::default();
                model.calib_block(i, x, Some(&mut cap))?;
                accumulate(&mut h, cap.get(*site))?;
            }
            let qs = quantize(g, h, load, run.params)?;
            let dev = model.device().clone();
            let layers = qs
                .iter()
                .map(|q| QuantLinear::from_nvfp4(q, None, &dev))
                .collect::<candle_core::Result<Vec<_>>>()?;
            model.replace_linears(i, *site, layers)?;
            out.extend(g.iter().cloned().zip(qs));
            on_group(g);
        }
        for x in hidden.iter_mut() {
            *x = model.calib_block(i, x, None)?;
        }
    }
    Ok(out)
}

fn accumulate(h: &mut Option<Hessian>, x: Option<&Tensor>) -> Result<()> {
    let x = x.context("calibration: a Linear's input was not captured")?;
    let k = x.dim(1)?;
    h.get_or_insert_with(|| Hessian::new(k)).add(x)
}

fn quantize(
    g: &[String],
    h: Option<Hessian>,
    load: &mut WeightLoader<'_>,
    params: &GptqParams,
) -> Result<Vec<Nvfp4Quantized>> {
    let h = h.context("calibration: no windows")?;
    let ws = g
        .iter()
        .map(|p| load(&format!("{p}.weight")))
        .collect::<Result<Vec<_>>>()?;
    gptq_quantize_group(&ws, &h, None, params).with_context(|| format!("GPTQ of {}", g.join(", ")))
}
