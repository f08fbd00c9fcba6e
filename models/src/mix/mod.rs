//! Mixed NVFP4 / BF16 checkpoints under a byte budget, as llama.cpp's mixes keep their
//! most sensitive tensors at a higher precision: each Linear group's sensitivity is
//! measured ([`sensitivity`]), the groups worth most per byte are kept BF16 within the
//! budget ([`select`]), and the quantizer writes the rest as NVFP4 (RTN or GPTQ/AWQ) with
//! the BF16 groups listed in `exclude_modules`, so the output is still a standard
//! ModelOpt NVFP4 export. The plan is also written next to it as `mix_plan.json`.

pub mod select;
pub mod sensitivity;

pub use select::{bf16_bytes, nvfp4_bytes, select_bf16, MixCandidate, MixError, MixSelection};
pub use sensitivity::measure_sensitivity;

use crate::config::LlamaConfig;
use crate::quant::{quantize_model, CalibData, OutputFormat, Progress, QuantizeOptions, Summary};
use crate::tokenizer::TextTokenizer;
use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_fp4::checkpoint::Checkpoint;
use serde_json::{json, Value as Json};
use std::path::{Path, PathBuf};

/// File the plan is written to in the output folder.
pub const PLAN_FILE: &str = "mix_plan.json";

/// How a budgeted mix is chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct MixOptions {
    /// Bytes of the quantizable decoder Linears relative to all-NVFP4 (≥ 1; see
    /// [`select`] for what is counted).
    pub budget: f64,
    /// Calibration tokens the sensitivities are measured on (the first ones).
    pub sens_tokens: usize,
    /// Tokens per sensitivity window (each from position 0).
    pub sens_window: usize,
    /// Take the sensitivities from this earlier [`PLAN_FILE`] of the same model instead
    /// of measuring them (e.g. the same measurement for several budgets).
    pub sensitivity_file: Option<PathBuf>,
}

impl Default for MixOptions {
    fn default() -> Self {
        Self {
            budget: 1.0,
            sens_tokens: 512,
            sens_window: 512,
            sensitivity_file: None,
        }
    }
}

/// A chosen mix.
#[derive(Debug, Clone, PartialEq)]
pub struct MixPlan {
    /// Every group with its measured sensitivity (empty at budget 1: nothing measured).
    pub candidates: Vec<MixCandidate>,
    /// The groups kept BF16 (indices into `candidates`) and the byte counts.
    pub selection: Option<MixSelection>,
    /// The budget asked for.
    pub budget: f64,
}

impl MixPlan {
    /// Module prefixes kept BF16, for the quantizer's `exclude`.
    pub fn exclude(&self) -> Vec<String> {
        match &self.selection {
            Some(s) => s
                .bf16
                .iter()
                .flat_map(|&i| self.candidates[i].modules.iter().cloned())
                .collect(),
            None => vec![],
        }
    }

    /// The plan as JSON (written as [`PLAN_FILE`]).
    pub fn to_json(&self) -> Json {
        let chosen: Vec<usize> = self
            .selection
            .as_ref()
            .map(|s| s.bf16.clone())
            .unwrap_or_default();
        json!({
            "budget": self.budget,
            "budget_counts": "weight bytes of the decoder Linears (q/k/v/o/gate/up/down); embeddings, lm_head and norms not counted",
            "base_bytes": self.selection.as_ref().map(|s| s.base_bytes),
            "budget_bytes": self.selection.as_ref().map(|s| s.budget_bytes),
            "bytes": self.selection.as_ref().map(|s| s.bytes),
            "bf16_groups": chosen.iter().map(|&i| self.candidates[i].modules.join(",")).collect::<Vec<_>>(),
            "sensitivity": self.candidates.iter().map(|c| json!({
                "modules": c.modules.join(","),
                "kl": c.sensitivity,
                "extra_bytes": c.extra_bytes(),
                "nvfp4_bytes": c.nvfp4_bytes,
                "bf16_bytes": c.bf16_bytes,
            })).collect::<Vec<_>>(),
        })
    }
}

/// The calibration tokens of `calib`, tokenized with the model in `dir`'s tokenizer as
/// the quantizer does (whole text, special tokens as the tokenizer adds them).
pub fn calib_token_ids(dir: &Path, calib: &CalibData) -> Result<Vec<u32>> {
    match calib {
        CalibData::TokenIds(ids) => Ok(ids.clone()),
        CalibData::TextFile(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read the calibration text {}", p.display()))?;
            let cfg = LlamaConfig::from_dir(dir)?;
            TextTokenizer::from_dir(dir, &cfg)?.encode(&text, true)
        }
    }
}

/// Measures the sensitivities of the unquantized Llama in `dir` on the first
/// `opts.sens_tokens` tokens of `calib` and chooses the BF16 groups within
/// `opts.budget`. At budget 1 nothing is measured and nothing is kept BF16.
pub fn plan_mix(
    dir: &Path,
    calib: &CalibData,
    opts: &MixOptions,
    on_group: &mut dyn FnMut(usize, usize),
) -> Result<MixPlan> {
    if !(opts.budget.is_finite() && opts.budget >= 1.0) {
        bail!(
            "--budget {}: must be a number ≥ 1 (bytes relative to all-NVFP4)",
            opts.budget
        );
    }
    if opts.budget == 1.0 {
        return Ok(MixPlan {
            candidates: vec![],
            selection: None,
            budget: 1.0,
        });
    }
    if let Some(f) = &opts.sensitivity_file {
        let candidates = sensitivities_from_plan(dir, f)?;
        let selection = select_bf16(&candidates, opts.budget)?;
        return Ok(MixPlan {
            candidates,
            selection: Some(selection),
            budget: opts.budget,
        });
    }
    if opts.sens_tokens < 2 || opts.sens_window < 2 {
        bail!("sensitivity tokens and window must be at least 2");
    }
    let ids = calib_token_ids(dir, calib)?;
    if ids.len() < opts.sens_tokens {
        bail!(
            "the calibration data has {} tokens, {} asked for the sensitivities",
            ids.len(),
            opts.sens_tokens
        );
    }
    let windows: Vec<Vec<u32>> = ids[..opts.sens_tokens]
        .chunks(opts.sens_window)
        .filter(|w| w.len() >= 2)
        .map(<[u32]>::to_vec)
        .collect();
    let candidates = measure_sensitivity(dir, &windows, on_group)?;
    let selection = select_bf16(&candidates, opts.budget)?;
    Ok(MixPlan {
        candidates,
        selection: Some(selection),
        budget: opts.budget,
    })
}

/// The candidates of the Llama in `dir` with the sensitivities recorded in an earlier
/// plan file (matched by module names; byte counts from `dir`'s shapes).
pub fn sensitivities_from_plan(dir: &Path, plan: &Path) -> Result<Vec<MixCandidate>> {
    let text =
        std::fs::read_to_string(plan).with_context(|| format!("cannot read {}", plan.display()))?;
    let j: Json =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", plan.display()))?;
    let recorded = j["sensitivity"]
        .as_array()
        .with_context(|| format!("{}: no `sensitivity` list", plan.display()))?;
    // SAFETY: read-only mapping, not modified while it is read.
    let ckpt = unsafe { Checkpoint::open(dir)? };
    let cfg = LlamaConfig::from_dir(dir)?;
    let mut out = vec![];
    for (_, _, modules) in sensitivity::llama_groups(cfg.num_hidden_layers) {
        let name = modules.join(",");
        let Some(kl) = recorded
            .iter()
            .find(|r| r["modules"].as_str() == Some(name.as_str()))
            .and_then(|r| r["kl"].as_f64())
        else {
            bail!("{}: no sensitivity for `{name}`", plan.display());
        };
        let (mut nv, mut bf) = (0, 0);
        for p in &modules {
            let w = ckpt.get(&format!("{p}.weight"))?;
            let [n, k] = w.shape[..] else {
                bail!("`{p}.weight` is not 2-d");
            };
            nv += nvfp4_bytes(n, k);
            bf += bf16_bytes(n, k);
        }
        out.push(MixCandidate {
            modules,
            nvfp4_bytes: nv,
            bf16_bytes: bf,
            sensitivity: kl,
        });
    }
    Ok(out)
}

/// A sibling path of `p` for a temporary folder.
fn sibling_tmp(p: &Path, tag: &str) -> PathBuf {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    p.with_file_name(format!(".{name}.{tag}-{}", std::process::id()))
}

/// [`quantize_model`] with a byte budget: the groups [`plan_mix`] chooses (sensitivities
/// on `calib`) are added to `opts.exclude` and kept BF16; the plan is written to the
/// output as [`PLAN_FILE`]. A GGUF input is first converted to a temporary BF16 folder.
pub fn quantize_with_budget(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    mix: &MixOptions,
    calib: &CalibData,
    on_group: &mut dyn FnMut(usize, usize),
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<(Summary, MixPlan)> {
    if opts.format != OutputFormat::Nvfp4 {
        bail!("a byte budget mixes NVFP4 and BF16 layers: it needs the NVFP4 output format");
    }
    let mut tmp = None;
    let dir = if input.is_file() {
        let t = sibling_tmp(output, "bf16");
        let _ = std::fs::remove_dir_all(&t);
        let bf16 = QuantizeOptions {
            format: OutputFormat::Bf16,
            ..Default::default()
        };
        quantize_model(input, &t, &bf16, &mut |_| {})?;
        tmp = Some(t.clone());
        t
    } else {
        input.to_path_buf()
    };
    let r = (|| {
        let plan = plan_mix(&dir, calib, mix, on_group)?;
        let mut o = opts.clone();
        for e in plan.exclude() {
            if !o.exclude.contains(&e) {
                o.exclude.push(e);
            }
        }
        // The checkpoint and the plan go into one staging folder, moved into place only
        // when both are written (a failed run leaves `output` as it was).
        let mut s = crate::staging::write_atomically(output, |staging| {
            let s = quantize_model(&dir, staging, &o, on_progress)?;
            let text = serde_json::to_string_pretty(&plan.to_json())? + "\n";
            let p = staging.join(PLAN_FILE);
            std::fs::write(&p, text).with_context(|| format!("cannot write {}", p.display()))?;
            Ok(s)
        })?;
        s.output = output.to_path_buf();
        Ok((s, plan))
    })();
    if let Some(t) = tmp {
        let _ = std::fs::remove_dir_all(t);
    }
    r
}

/// Bytes of a checkpoint's quantizable decoder Linears as stored, and the same Linears'
/// all-NVFP4 bytes (the budget's base): `(bytes, base)`.
pub fn checkpoint_linear_bytes(dir: &Path) -> Result<(u64, u64)> {
    // SAFETY: read-only mapping, not modified while it is read.
    let ckpt = unsafe { Checkpoint::open(dir)? };
    let cfg = LlamaConfig::from_dir(dir)?;
    let (mut bytes, mut base) = (0u64, 0u64);
    for (_, _, modules) in sensitivity::llama_groups(cfg.num_hidden_layers) {
        for p in modules {
            let w = ckpt.get(&format!("{p}.weight"))?;
            let [n, cols] = w.shape[..] else {
                bail!("`{p}.weight` is not 2-d");
            };
            if w.dtype == DType::U8 {
                let k = 2 * cols;
                let s = ckpt.get(&format!("{p}.weight_scale"))?;
                bytes += (w.data.len() + s.data.len() + 4) as u64;
                base += nvfp4_bytes(n, k);
            } else {
                bytes += bf16_bytes(n, cols);
                base += nvfp4_bytes(n, cols);
            }
        }
    }
    Ok((bytes, base))
}
