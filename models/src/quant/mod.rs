//! The NVFP4 quantizer: a Hugging Face Llama (safetensors in BF16/F16/F32 + config.json)
//! or a llama.cpp GGUF (dequantized, rounded to BF16, then requantized) → a
//! ModelOpt-compatible NVFP4 checkpoint.
//!
//! What ModelOpt 0.47 (`W4A16_NVFP4_CFG` / `NVFP4_DEFAULT_CFG` + `export_hf_checkpoint`)
//! does, and so what this writes:
//!
//! * every Linear of the decoder layers (`q/k/v/o_proj`, `gate/up/down_proj`) becomes
//!   `weight` U8 `[N, K/2]`, `weight_scale` F8_E4M3 `[N, K/16]`, `weight_scale_2` F32 `[]`;
//! * `lm_head` and `model.embed_tokens` are excluded (kept as they are), as are the norms;
//! * q/k/v share one global scale (the largest of their own `amax / 2688`), and so do
//!   gate/up; block scales are computed against the shared value
//!   ([`candle_fp4::nvfp4::quantize_nvfp4_slice`], bit-exact with ModelOpt);
//! * `model.safetensors` is written by the same serializer as Python's `safetensors`
//!   (the Rust crate it wraps), with metadata `{"format": "pt"}`.
//!
//! No activation calibration is done, so there is no `input_scale` and the algorithm is
//! recorded as `W4A16_NVFP4` (ModelOpt's W4A16 export is its NVFP4 export minus the
//! `input_scale` tensors). `config.json` gets ModelOpt's `quantization_config` block and
//! `hf_quant_config.json` is written next to it; tokenizer files are copied (or, from a
//! GGUF, built from its metadata).
//!
//! All of the above is the default method, [`QuantMethod::Rtn`] ([`rtn`]).
//! [`QuantMethod::Gptq`] picks the codes and block scales with GPTQ ([`gptq`], on the
//! calibration [`hessian`]s) calibrated on text run through the unquantized model
//! instead; everything else (tensors, layouts, global scales and their sharing,
//! exclusions, json files) is the same. With `awq` it also rescales input channels
//! ([`awq`]): the RMSNorm weights are written rescaled and the global scales are those of
//! the scaled weights.
//!
//! Files, one job each: `options.rs` (what to do, checked before any work), `source.rs`
//! (reading the input), `rtn.rs`, `hessian.rs`, `gptq.rs`, `awq.rs` (the algorithms, no
//! model), `calib.rs` (the calibration windows and the driver that runs the Llama block by
//! block through its capture hook, [`crate::llama::Llama::block_output_captured`]),
//! `export.rs` (writing the checkpoint) and this file (the conversion from input to
//! output folder). Within `quant` the modules form a tree: `mod` → {`options`, `source`,
//! `calib`, `export`, `rtn`}; `calib` → {`awq`, `gptq`, `hessian`, `options`}; `awq` and
//! `gptq` → `hessian`; `source` → `export`; `options` → `gptq`.

pub mod awq;
mod calib;
mod export;
pub mod gptq;
pub mod hessian;
mod options;
pub mod rtn;
mod source;

pub use export::{
    hf_quant_config, nvfp4_tensors, quantization_config_block, write_safetensors, OwnedTensor,
    TOKENIZER_FILES,
};
pub use options::{CalibData, OutputFormat, QuantMethod, QuantizeOptions, MIN_CALIB_TOKENS};

use crate::config::LlamaConfig;
use crate::llama::{Llama, LoadOptions};
use anyhow::{bail, Context, Result};
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4::nvfp4::BLOCK_SIZE;
use candle_fp4::quant_config::QuantConfig;
use half::{bf16, f16};
use safetensors::tensor::Dtype as StDtype;
use serde_json::Value as Json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use calib::{calib_windows, gptq_llama, CalibRun};
use export::write_json;
use options::check_gptq_options;
use rtn::{linear_groups, quantize_group, DEFAULT_EXCLUDE};
use source::Source;

/// Progress of [`quantize_model`]: `done` of `total` tensors written so far.
#[derive(Debug, Clone)]
pub struct Progress<'a> {
    /// Tensors written so far.
    pub done: usize,
    /// Tensors in all.
    pub total: usize,
    /// The tensor (or, for a Linear, the module prefix) just written.
    pub name: &'a str,
}

/// A finished conversion.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// The output folder.
    pub output: PathBuf,
    /// Linears quantized to NVFP4.
    pub quantized: usize,
    /// Tensors copied unquantized.
    pub kept: usize,
    /// Size of `model.safetensors` in bytes.
    pub bytes: u64,
}

/// A sibling path of `p` for a temporary folder.
fn sibling_tmp(p: &Path, tag: &str) -> PathBuf {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    p.with_file_name(format!(".{name}.{tag}-{}", std::process::id()))
}

/// Converts `input` (a Hugging Face Llama folder or a `.gguf`) into `output` (created;
/// it must not exist or be empty). `on_progress` is called after every tensor.
///
/// With [`QuantMethod::Gptq`] the unquantized model is run over the calibration tokens
/// first (a GGUF is converted to a temporary BF16 folder next to `output` for that, and
/// the weights are read from there: the same BF16 values).
///
/// The files are written into a staging folder next to `output` and moved into place
/// only when complete ([`crate::staging::write_atomically`]): a failed run leaves `output`
/// as it was.
pub fn quantize_model(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Summary> {
    check_gptq_options(opts)?;
    let mut s = crate::staging::write_atomically(output, |staging| {
        quantize_model_staged(input, staging, opts, on_progress)
    })?;
    s.output = output.to_path_buf();
    Ok(s)
}

fn quantize_model_staged(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Summary> {
    if matches!(opts.method, QuantMethod::Gptq { .. }) && input.is_file() {
        let tmp = sibling_tmp(output, "bf16");
        let _ = std::fs::remove_dir_all(&tmp);
        let bf16 = QuantizeOptions {
            format: OutputFormat::Bf16,
            ..Default::default()
        };
        let r = quantize_model(input, &tmp, &bf16, &mut |_| {})
            .and_then(|_| quantize_model_from(&tmp, output, opts, on_progress));
        let _ = std::fs::remove_dir_all(&tmp);
        return r;
    }
    quantize_model_from(input, output, opts, on_progress)
}

fn quantize_model_from(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Summary> {
    let format = opts.format;
    let src = Source::open(input)?;
    let mut config = src.config()?;
    // Fail early on a model this port cannot run, or whose config and weights disagree.
    let corigin = format!("{}: config", input.display());
    let cfg = LlamaConfig::from_json_str(&config.to_string(), &corigin)?;
    crate::validate::check_layer_count(
        &cfg,
        &corigin,
        &input.display().to_string(),
        &src.names().iter().map(String::as_str).collect::<Vec<_>>(),
    )?;
    if output.exists() {
        let empty = std::fs::read_dir(output)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
        if !empty {
            bail!(
                "{}: output folder exists and is not empty",
                output.display()
            );
        }
    }
    std::fs::create_dir_all(output)
        .with_context(|| format!("cannot create {}", output.display()))?;

    let names = src.names();
    let mut exclude: Vec<String> = DEFAULT_EXCLUDE.iter().map(|s| s.to_string()).collect();
    for e in &opts.exclude {
        if !exclude.contains(e) {
            exclude.push(e.clone());
        }
    }
    let matcher = QuantConfig {
        exclude: exclude.clone(),
        ..QuantConfig::unquantized()
    };
    // `--bf16` with AWQ: the AWQ-scaled weights, unquantized.
    let awq_reference =
        format == OutputFormat::Bf16 && matches!(opts.method, QuantMethod::Gptq { awq: true, .. });
    let mut groups: Vec<Vec<String>> = vec![];
    if format == OutputFormat::Nvfp4 || awq_reference {
        for g in linear_groups(&names) {
            if !g.iter().any(|p| matcher.is_excluded(p)) {
                groups.push(g);
                continue;
            }
            // A group sharing a global scale is kept or quantized whole: name the members
            // the patterns did not cover, so that loaders see them as excluded too.
            for p in g {
                if !matcher.is_excluded(&p) {
                    exclude.push(p);
                }
            }
        }
    }
    let quantized: std::collections::HashSet<String> = groups
        .iter()
        .flatten()
        .map(|p| format!("{p}.weight"))
        .collect();
    let total = names.len();
    let mut done = 0;
    let mut out: Vec<(String, OwnedTensor)> = Vec::with_capacity(total + 2 * quantized.len());
    let mut summary = Summary {
        output: output.to_path_buf(),
        ..Default::default()
    };
    for g in &groups {
        for p in g {
            let (_, k) = src.matrix_shape(&format!("{p}.weight"))?;
            if !k.is_multiple_of(BLOCK_SIZE) {
                bail!("`{p}` has in_features {k}, not a multiple of {BLOCK_SIZE}: NVFP4 cannot quantize it");
            }
        }
    }
    let mut gptq = match &opts.method {
        QuantMethod::Rtn => None,
        QuantMethod::Gptq {
            calib,
            calib_tokens,
            window,
            sequential,
            params,
            awq,
        } => {
            let Source::Hf { dir, .. } = &src else {
                bail!("GPTQ reads a Hugging Face folder (a GGUF goes through a BF16 copy)");
            };
            let cfg = LlamaConfig::from_dir(dir)?;
            let windows = calib_windows(dir, &cfg, calib, *calib_tokens, *window)?;
            let longest = windows.iter().map(Vec::len).max().unwrap_or(2);
            let lopts = LoadOptions {
                kv_cache: KvCacheKind::Bf16,
                max_seq_len: Some(longest),
                dtype: None,
                prefill_chunk: longest,
                kv_window: 0,
                ..Default::default()
            };
            let mut model = Llama::load(dir, &candle_core::Device::Cpu, &lopts)
                .context("loading the unquantized model for GPTQ calibration")?;
            let run = CalibRun {
                windows: &windows,
                params,
                sequential: *sequential,
                awq: *awq,
                keep_scaled: awq_reference,
            };
            let mut load = |name: &str| src.matrix_f32(name);
            let qs = gptq_llama(&mut model, &run, &groups, &mut load, &mut |g| {
                for p in g {
                    done += 1;
                    on_progress(Progress {
                        done,
                        total,
                        name: p,
                    });
                }
            })?;
            Some(qs)
        }
    };
    let mut norms = HashMap::new();
    if let Some(o) = gptq.as_mut() {
        norms = std::mem::take(&mut o.norms);
    }
    for g in &groups {
        if awq_reference {
            let o = gptq.as_mut().context("AWQ reference without calibration")?;
            for p in g {
                let (w, n, k) = o
                    .scaled
                    .remove(p)
                    .with_context(|| format!("AWQ skipped `{p}`"))?;
                let data = w
                    .iter()
                    .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                    .collect();
                let t = OwnedTensor {
                    dtype: StDtype::BF16,
                    shape: vec![n, k],
                    data,
                };
                out.push((format!("{p}.weight"), t));
                summary.kept += 1;
            }
            continue;
        }
        let qs = match gptq.as_mut() {
            Some(m) => g
                .iter()
                .map(|p| {
                    m.quantized
                        .remove(p)
                        .with_context(|| format!("GPTQ skipped `{p}`"))
                })
                .collect::<Result<Vec<_>>>()?,
            None => {
                let ws = g
                    .iter()
                    .map(|p| src.matrix_f32(&format!("{p}.weight")))
                    .collect::<Result<Vec<_>>>()?;
                quantize_group(&ws).with_context(|| format!("quantizing {}", g.join(", ")))?
            }
        };
        for (p, q) in g.iter().zip(&qs) {
            out.extend(nvfp4_tensors(p, q));
            summary.quantized += 1;
            if gptq.is_none() {
                done += 1;
                on_progress(Progress {
                    done,
                    total,
                    name: p,
                });
            }
        }
    }
    for n in &names {
        if quantized.contains(n) {
            continue;
        }
        // Kept in its stored dtype (a GGUF source is BF16 throughout); AWQ's rescaled
        // norms in that dtype too.
        let mut t = src.raw(n)?;
        if let Some(v) = norms.remove(n) {
            if t.shape.iter().product::<usize>() != v.len() {
                bail!(
                    "AWQ: `{n}` has shape {:?}, {} values computed",
                    t.shape,
                    v.len()
                );
            }
            t.data = match t.dtype {
                StDtype::BF16 => v
                    .iter()
                    .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                    .collect(),
                StDtype::F16 => v
                    .iter()
                    .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                    .collect(),
                StDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                d => bail!("AWQ: `{n}` is {d:?}; norms must be BF16, F16 or F32"),
            };
        }
        out.push((n.clone(), t));
        done += 1;
        summary.kept += 1;
        on_progress(Progress {
            done,
            total,
            name: n,
        });
    }
    let st = output.join("model.safetensors");
    write_safetensors(&out, &st)?;
    summary.bytes = std::fs::metadata(&st).map(|m| m.len()).unwrap_or(0);

    if let Json::Object(o) = &mut config {
        o.remove("quantization_config");
        if format == OutputFormat::Nvfp4 {
            o.insert(
                "quantization_config".into(),
                quantization_config_block(&exclude),
            );
        }
    }
    write_json(&output.join("config.json"), &config)?;
    if format == OutputFormat::Nvfp4 {
        write_json(
            &output.join("hf_quant_config.json"),
            &hf_quant_config(&exclude),
        )?;
    }
    match &src {
        Source::Hf { dir, .. } => {
            let folder = candle_fp4::checkpoint::ModelFolder::new(dir)?;
            for f in TOKENIZER_FILES {
                crate::staging::copy_model_file(&folder, f, &output.join(f))?;
            }
        }
        Source::Gguf(g) => {
            write_json(&output.join("tokenizer.json"), &g.tokenizer_json()?)?;
            write_json(
                &output.join("tokenizer_config.json"),
                &g.tokenizer_config_json()?,
            )?;
            write_json(
                &output.join("generation_config.json"),
                &g.generation_config_json()?,
            )?;
        }
    }
    Ok(summary)
}
