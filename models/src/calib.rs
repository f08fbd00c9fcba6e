//! Calibration for GPTQ ([`crate::gptq`]): runs the unquantized Llama block by block over
//! the calibration tokens, accumulates each Linear group's input Hessian, quantizes the
//! group and (sequential mode) puts the quantized weights back into the model so that
//! every later group is calibrated on the activations the quantized model produces.

use crate::awq::{divide_rows, scale_columns, search_scales, AWQ_ALPHAS};
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
    /// AWQ channel scaling ([`crate::awq`]) before GPTQ on q/k/v, gate/up and down
    /// (sequential mode only).
    pub awq: bool,
    /// AWQ: also return the scaled (unquantized) weights.
    pub keep_scaled: bool,
}

/// What [`gptq_llama`] produces.
#[derive(Debug, Default)]
pub(crate) struct GptqOutput {
    /// The quantized Linears by module prefix.
    pub quantized: HashMap<String, Nvfp4Quantized>,
    /// AWQ: the RMSNorm weights divided by their channel scales (BF16 values), by tensor
    /// name.
    pub norms: HashMap<String, Vec<f32>>,
    /// AWQ with [`CalibRun::keep_scaled`]: the scaled F32 weights `(values, n, k)` by
    /// module prefix.
    pub scaled: HashMap<String, (Vec<f32>, usize, usize)>,
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
) -> Result<GptqOutput> {
    if run.awq && !run.sequential {
        bail!("AWQ scaling needs sequential calibration");
    }
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
    let mut res = GptqOutput::default();
    let out = &mut res.quantized;
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
        let has_down = jobs.iter().any(|(s, _)| *s == Site::Down);
        // AWQ: down_proj's input scales, folded into up_proj's rows with gate/up.
        let mut down_scale: Option<Vec<f32>> = None;
        for (site, g) in &jobs {
            let mut h = None;
            let mut h_down = None;
            let want_down = run.awq && *site == Site::GateUp && has_down;
            for x in hidden.iter() {
                let mut cap = BlockInputs::default();
                model.calib_block(i, x, Some(&mut cap))?;
                accumulate(&mut h, cap.get(*site))?;
                if want_down {
                    accumulate(&mut h_down, cap.get(Site::Down))?;
                }
            }
            let h = h.context("calibration: no windows")?;
            let mut ws = load_group(g, load)?;
            // With AWQ the scaled q/k/v and gate/up see the inputs `x/s`; GPTQ gets their
            // Hessian `diag(1/s) H diag(1/s)` with the dampening of the unscaled problem
            // (`λ = damp · mean(diag H)` on `H`, i.e. `λ/s_j²` on the scaled diagonal).
            // down_proj keeps GPTQ's own dampening of its (scaled) Hessian: the variant
            // chosen on the tuning split (`docs/accuracy.md`).
            let mut inv_s: Option<Vec<f64>> = None;
            let mut h = h;
            if run.awq {
                match site {
                    Site::Qkv | Site::GateUp => {
                        if let Some(hd) = &h_down {
                            if let Some(u) = g.iter().position(|p| p.ends_with(".up_proj")) {
                                let down = format!("model.layers.{i}.mlp.down_proj.weight");
                                let (_, sd) = search_scales(&[load(&down)?], hd, &AWQ_ALPHAS)
                                    .with_context(|| format!("AWQ scales of {down}"))?;
                                let (w, n, k) = &mut ws[u];
                                if *n != sd.len() {
                                    bail!(
                                        "AWQ: up_proj has {n} rows, down_proj {} inputs",
                                        sd.len()
                                    );
                                }
                                divide_rows(w, *k, &sd)?;
                                down_scale = Some(sd);
                            }
                        }
                        let (_, sc) = search_scales(&ws, &h, &AWQ_ALPHAS)
                            .with_context(|| format!("AWQ scales of {}", g.join(", ")))?;
                        for (w, _, k) in ws.iter_mut() {
                            *w = scale_columns(w, *k, &sc);
                        }
                        let norm = model.scale_norm(i, *site, &sc)?;
                        let name = if *site == Site::Qkv {
                            "input_layernorm"
                        } else {
                            "post_attention_layernorm"
                        };
                        res.norms
                            .insert(format!("model.layers.{i}.{name}.weight"), norm);
                        let inv: Vec<f64> = sc.iter().map(|v| 1.0 / *v as f64).collect();
                        h = h.scaled(&inv)?;
                        inv_s = Some(inv);
                    }
                    // The Hessian comes from the model whose up_proj rows already carry
                    // 1/s: it is the scaled input's.
                    Site::Down => {
                        if let Some(s) = down_scale.take() {
                            for (w, _, k) in ws.iter_mut() {
                                *w = scale_columns(w, *k, &s);
                            }
                        }
                    }
                    Site::O => {}
                }
            }
            let mut params = run.params.clone();
            let mut ridge: Option<Vec<f64>> = None;
            if let Some(inv) = &inv_s {
                let m = h.matrix()?;
                let k = h.k();
                // mean(diag H) of the unscaled inputs: H_jj = H'_jj · s_j².
                let mean = (0..k)
                    .map(|j| m[j * k + j] / (inv[j] * inv[j]))
                    .sum::<f64>()
                    / k as f64;
                let lam = params.damp * mean;
                ridge = Some(inv.iter().map(|v| lam * v * v).collect());
                params.damp = 0.0;
            }
            if let Some(r) = &ridge {
                h.add_diag(r);
            }
            let qs = gptq_quantize_group(&ws, &h, None, &params)
                .with_context(|| format!("GPTQ of {}", g.join(", ")))?;
            if run.keep_scaled {
                res.scaled.extend(g.iter().cloned().zip(ws));
            }
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
    Ok(res)
}

fn load_group(g: &[String], load: &mut WeightLoader<'_>) -> Result<Vec<(Vec<f32>, usize, usize)>> {
    g.iter().map(|p| load(&format!("{p}.weight"))).collect()
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
    let ws = load_group(g, load)?;
    gptq_quantize_group(&ws, &h, None, params).with_context(|| format!("GPTQ of {}", g.join(", ")))
}
