//! Calibration for GPTQ ([`super::gptq`]): the calibration token windows, and the driver
//! that runs the unquantized Llama block by block over them, accumulates each Linear
//! group's input Hessian (through the model's capture hook,
//! [`Llama::block_output_captured`]), quantizes the group (with AWQ's channel scaling
//! first, [`super::awq`]) and, in sequential mode, puts the quantized weights back into the
//! model ([`Block::set_linears`](crate::llama::Block::set_linears)) so that every later
//! group is calibrated on the activations the quantized model produces.

use super::awq::{divide_rows, scale_columns, search_scales, AWQ_ALPHAS};
use super::gptq::{gptq_quantize_group, GptqParams};
use super::hessian::Hessian;
use super::options::CalibData;
use crate::config::LlamaConfig;
use crate::llama::{Llama, Site};
use crate::tokenizer::TextTokenizer;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_fp4::nvfp4::Nvfp4Quantized;
use candle_fp4::quant_linear::QuantLinear;
use std::collections::HashMap;
use std::path::Path;

/// Gives a Linear's original weight `(values, n, k)` (row-major F32) by tensor name.
pub(super) type WeightLoader<'a> = dyn FnMut(&str) -> Result<(Vec<f32>, usize, usize)> + 'a;

/// The calibration token windows of a GPTQ run on the model in `dir`: the first
/// `calib_tokens` tokens in windows of `window` (capped at the model's context; a last
/// window shorter than 2 tokens is dropped).
pub(super) fn calib_windows(
    dir: &Path,
    cfg: &LlamaConfig,
    calib: &CalibData,
    calib_tokens: usize,
    window: usize,
) -> Result<Vec<Vec<u32>>> {
    let ids = match calib {
        CalibData::TokenIds(ids) => ids.clone(),
        CalibData::TextFile(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read the calibration text {}", p.display()))?;
            let tok = TextTokenizer::from_dir(dir, cfg)
                .context("GPTQ tokenizes the calibration text with the model's tokenizer")?;
            tok.encode(&text, true)?
        }
    };
    if ids.len() < calib_tokens {
        bail!(
            "the calibration data has {} tokens, {calib_tokens} asked",
            ids.len()
        );
    }
    let window = window.min(cfg.max_position_embeddings).max(2);
    Ok(ids[..calib_tokens]
        .chunks(window)
        .filter(|w| w.len() >= 2)
        .map(<[u32]>::to_vec)
        .collect())
}

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
pub(super) struct CalibRun<'a> {
    /// Token windows, each run from position 0.
    pub windows: &'a [Vec<u32>],
    /// GPTQ settings.
    pub params: &'a GptqParams,
    /// Feed each group the activations of the model quantized so far (else: one pass of
    /// the unquantized model gives every Hessian).
    pub sequential: bool,
    /// AWQ channel scaling ([`super::awq`]) before GPTQ on q/k/v, gate/up and down
    /// (sequential mode only).
    pub awq: bool,
    /// AWQ: also return the scaled (unquantized) weights.
    pub keep_scaled: bool,
}

/// What [`gptq_llama`] produces.
#[derive(Debug, Default)]
pub(super) struct GptqOutput {
    /// The quantized Linears by module prefix.
    pub quantized: HashMap<String, Nvfp4Quantized>,
    /// AWQ: the RMSNorm weights divided by their channel scales (BF16 values), by tensor
    /// name.
    pub norms: HashMap<String, Vec<f32>>,
    /// AWQ with [`CalibRun::keep_scaled`]: the scaled F32 weights `(values, n, k)` by
    /// module prefix.
    pub scaled: HashMap<String, (Vec<f32>, usize, usize)>,
}

/// The inputs of a block's Linears captured in one forward, in BF16 (what the projections
/// multiply), for the sites asked for.
#[derive(Debug, Default)]
struct Captured([Option<Tensor>; 4], [Option<Tensor>; 4]);

impl Captured {
    fn get(&self, site: Site) -> Option<&Tensor> {
        self.0[site.index()].as_ref()
    }

    /// The input as the forward had it (the activation dtype), for [`capture_inputs`]'s
    /// sites.
    fn raw(&self, site: Site) -> Option<&Tensor> {
        self.1[site.index()].as_ref()
    }
}

/// What the capture hook of [`capture_inputs`] raises once it holds every input it was
/// asked for: the rest of the block's forward is not needed, so it stops there.
#[derive(Debug)]
struct CaptureDone;

impl std::fmt::Display for CaptureDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("calibration: every asked-for input captured")
    }
}

impl std::error::Error for CaptureDone {}

/// The inputs of the Linears of `sites` in block `i` of `model` over `x`, the block's
/// forward stopped as soon as the last of them is there (the same values as a whole
/// forward's: everything before that point runs as in it).
fn capture_inputs(model: &mut Llama, i: usize, x: &Tensor, sites: &[Site]) -> Result<Captured> {
    let mut cap = Captured::default();
    let r = model.block_output_captured(i, x, &mut |site, t| {
        if sites.contains(&site) {
            cap.0[site.index()] = Some(t.to_dtype(DType::BF16)?);
            cap.1[site.index()] = Some(t.clone());
        }
        if sites.iter().all(|s| cap.get(*s).is_some()) {
            return Err(candle_core::Error::Io(std::io::Error::other(CaptureDone)));
        }
        Ok(())
    });
    match r {
        Err(e) if candle_fp4::error::find::<CaptureDone>(e.as_ref()).is_none() => Err(e),
        _ => Ok(cap),
    }
}

/// Block `i` of `model` over `x`: its output and the inputs of the Linears of `sites`.
fn capture(model: &mut Llama, i: usize, x: &Tensor, sites: &[Site]) -> Result<(Tensor, Captured)> {
    let mut cap = Captured::default();
    let y = model.block_output_captured(i, x, &mut |site, t| {
        if sites.contains(&site) {
            cap.0[site.index()] = Some(t.to_dtype(DType::BF16)?);
        }
        Ok(())
    })?;
    Ok((y, cap))
}

/// GPTQ of every group in `groups` (q/k/v, o, gate/up, down of each layer; a group is
/// quantized whole with one shared global scale), calibrated on `model` (the unquantized
/// model; its weights are replaced as it goes in sequential mode). `load` gives a Linear's
/// original weight `(values, n, k)` by prefix; `on_group` is called after each group.
pub(super) fn gptq_llama(
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
    let hidden: Vec<Tensor> = run
        .windows
        .iter()
        .map(|w| model.embed_tokens(w))
        .collect::<Result<_>>()?;
    let mut c = Calibrator {
        model,
        run,
        load,
        on_group,
        hidden,
        res: GptqOutput::default(),
    };
    for i in 0..layers {
        let mut jobs = by_layer.remove(&i).unwrap_or_default();
        jobs.sort_by_key(|(s, _)| s.index());
        if run.sequential {
            c.sequential_layer(i, &jobs)?;
        } else {
            c.one_pass_layer(i, &jobs)?;
        }
    }
    Ok(c.res)
}

/// The state of a [`gptq_llama`] run between layers.
struct Calibrator<'a, 'b> {
    model: &'a mut Llama,
    run: &'a CalibRun<'a>,
    load: &'a mut WeightLoader<'b>,
    on_group: &'a mut dyn FnMut(&[String]),
    /// Every window's input of the next layer.
    hidden: Vec<Tensor>,
    res: GptqOutput,
}

impl Calibrator<'_, '_> {
    /// Layer `i` without sequential calibration: one pass of the unquantized block gives
    /// every group's Hessian.
    fn one_pass_layer(&mut self, i: usize, jobs: &[(Site, &Vec<String>)]) -> Result<()> {
        let sites: Vec<Site> = jobs.iter().map(|(s, _)| *s).collect();
        let mut hs: Vec<Option<Hessian>> = vec![None; jobs.len()];
        for x in self.hidden.iter_mut() {
            let (y, cap) = capture(self.model, i, x, &sites)?;
            for ((site, _), h) in jobs.iter().zip(hs.iter_mut()) {
                accumulate(h, cap.get(*site))?;
            }
            *x = y;
        }
        for ((_, g), h) in jobs.iter().zip(hs) {
            let h = h.context("calibration: no windows")?;
            let ws = load_group(g, self.load)?;
            let qs = gptq_quantize_group(&ws, &h, None, self.run.params)
                .with_context(|| format!("GPTQ of {}", g.join(", ")))?;
            self.res.quantized.extend(g.iter().cloned().zip(qs));
            (self.on_group)(g);
        }
        Ok(())
    }

    /// Layer `i` in sequential calibration: each group's Hessian from the model with every
    /// group before it quantized, then its quantized weights put into the model.
    fn sequential_layer(&mut self, i: usize, jobs: &[(Site, &Vec<String>)]) -> Result<()> {
        let has_down = jobs.iter().any(|(s, _)| *s == Site::Down);
        // AWQ: down_proj's input scales, folded into up_proj's rows with gate/up.
        let mut down_scale: Option<Vec<f32>> = None;
        // Every window's o_proj and down_proj inputs as the layer's last forward would
        // compute them (o_proj's after q|k|v were quantized, down_proj's after gate|up):
        // with both, the layer's output needs only those two projections, not a forward.
        let (mut o_in, mut down_in): (Vec<Tensor>, Vec<Tensor>) = (vec![], vec![]);
        for (site, g) in jobs {
            let site = *site;
            // AWQ chooses down_proj's scales with gate/up, on the Hessian of down's input
            // before gate/up are quantized.
            let want_down = self.run.awq && site == Site::GateUp && has_down;
            let sites: &[Site] = if want_down {
                &[Site::GateUp, Site::Down]
            } else {
                std::slice::from_ref(&site)
            };
            let mut h = None;
            let mut h_down = None;
            for x in &self.hidden {
                let cap = capture_inputs(self.model, i, x, sites)?;
                match (site, cap.raw(site)) {
                    (Site::O, Some(t)) => o_in.push(t.clone()),
                    (Site::Down, Some(t)) => down_in.push(t.clone()),
                    _ => {}
                }
                accumulate(&mut h, cap.get(site))?;
                if want_down {
                    accumulate(&mut h_down, cap.get(Site::Down))?;
                }
            }
            let mut h = h.context("calibration: no windows")?;
            let mut ws = load_group(g, self.load)?;
            // With AWQ the scaled q/k/v and gate/up see the inputs `x/s`; GPTQ gets their
            // Hessian `diag(1/s) H diag(1/s)` with the dampening of the unscaled problem
            // (`λ = damp · mean(diag H)` on `H`, i.e. `λ/s_j²` on the scaled diagonal).
            // down_proj keeps GPTQ's own dampening of its (scaled) Hessian: the variant
            // chosen on the tuning split (`docs/accuracy.md`).
            let mut inv_s: Option<Vec<f64>> = None;
            if self.run.awq {
                match site {
                    Site::Qkv | Site::GateUp => {
                        if let Some(hd) = &h_down {
                            if let Some(u) = g.iter().position(|p| p.ends_with(".up_proj")) {
                                let down = format!("model.layers.{i}.mlp.down_proj.weight");
                                let (_, sd) =
                                    search_scales(&[(self.load)(&down)?], hd, &AWQ_ALPHAS)
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
                        let norm = scale_norm(self.model, i, site, &sc)?;
                        let name = if site == Site::Qkv {
                            "input_layernorm"
                        } else {
                            "post_attention_layernorm"
                        };
                        self.res
                            .norms
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
            let mut params = self.run.params.clone();
            if let Some(inv) = &inv_s {
                let m = h.matrix()?;
                let k = h.k();
                // mean(diag H) of the unscaled inputs: H_jj = H'_jj · s_j².
                let mean = (0..k)
                    .map(|j| m[j * k + j] / (inv[j] * inv[j]))
                    .sum::<f64>()
                    / k as f64;
                let lam = params.damp * mean;
                let ridge: Vec<f64> = inv.iter().map(|v| lam * v * v).collect();
                params.damp = 0.0;
                h.add_diag(&ridge);
            }
            let qs = gptq_quantize_group(&ws, &h, None, &params)
                .with_context(|| format!("GPTQ of {}", g.join(", ")))?;
            if self.run.keep_scaled {
                self.res.scaled.extend(g.iter().cloned().zip(ws));
            }
            let dev = self.model.device().clone();
            let layers = qs
                .iter()
                .map(|q| QuantLinear::from_nvfp4(q, None, &dev))
                .collect::<candle_core::Result<Vec<_>>>()?;
            self.model
                .block_mut(i)?
                .set_linears(site, layers)
                .with_context(|| format!("layer {i} {site:?}"))?;
            self.res.quantized.extend(g.iter().cloned().zip(qs));
            (self.on_group)(g);
        }
        let n = self.hidden.len();
        if o_in.len() == n && down_in.len() == n {
            let b = &self.model.blocks()[i];
            for ((x, o), d) in self.hidden.iter_mut().zip(&o_in).zip(&down_in) {
                *x = b.output_from_captured(x, o, d)?;
            }
        } else {
            for x in self.hidden.iter_mut() {
                *x = self.model.block_output(i, x)?;
            }
        }
        Ok(())
    }
}

/// AWQ: divides the RMSNorm weight in front of `site` (q/k/v: the attention norm;
/// gate/up: the MLP norm) of block `i` by `s`, rounded once to BF16 (the checkpoint's
/// dtype for norms). Returns the new weight's values.
fn scale_norm(model: &mut Llama, i: usize, site: Site, s: &[f32]) -> Result<Vec<f32>> {
    let b = model.block_mut(i)?;
    let g = b.norm(site)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    if g.len() != s.len() {
        bail!("scale_norm: {} scales for a norm of {}", s.len(), g.len());
    }
    let v: Vec<f32> = g
        .iter()
        .zip(s)
        .map(|(g, s)| half::bf16::from_f32(g / s).to_f32())
        .collect();
    b.set_norm(site, &v)?;
    Ok(v)
}

fn load_group(g: &[String], load: &mut WeightLoader<'_>) -> Result<Vec<(Vec<f32>, usize, usize)>> {
    g.iter().map(|p| load(&format!("{p}.weight"))).collect()
}

fn accumulate(h: &mut Option<Hessian>, x: Option<&Tensor>) -> Result<()> {
    let x = x.context("calibration: a Linear's input was not captured")?;
    let k = x.dim(1)?;
    h.get_or_insert_with(|| Hessian::new(k)).add(x)
}
