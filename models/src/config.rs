//! A Llama `config.json`, in both the transformers 4 form (`torch_dtype`, top-level
//! `rope_theta`, `rope_scaling`) and the transformers 5 form (`dtype`, `rope_parameters`).
//!
//! Parsing is strict about what changes the computation: an architecture, activation
//! or RoPE type this port does not implement is an error naming the key, never a silent
//! fallback.

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_type` `default`, or no scaling block).
    None,
    /// `linear`: positions divided by `factor` (all frequencies divided by `factor`).
    Linear { factor: f64 },
    /// Llama 3.1 `llama3`: low frequencies divided by `factor`, high ones kept, a smooth
    /// blend in between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

/// The hyper-parameters of a Llama-architecture model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    /// End-of-generation ids from `config.json` (`eos_token_id`, an int or a list).
    pub eos_token_ids: Vec<u32>,
    /// `dtype` / `torch_dtype` as written (informational).
    pub dtype: Option<String>,
}

fn get<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    match o.get(key) {
        None | Some(Value::Null) => None,
        Some(v) => Some(v),
    }
}

fn usize_of(o: &Map<String, Value>, key: &str, origin: &str) -> Result<Option<usize>> {
    match get(o, key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(x) => Ok(Some(x as usize)),
            None => bail!("{origin}: `{key}` must be a non-negative integer, got {v}"),
        },
    }
}

fn req_usize(o: &Map<String, Value>, key: &str, origin: &str) -> Result<usize> {
    match usize_of(o, key, origin)? {
        Some(0) => bail!("{origin}: `{key}` must be positive, got 0"),
        Some(x) => Ok(x),
        None => bail!("{origin}: missing `{key}`"),
    }
}

fn f64_of(o: &Map<String, Value>, key: &str, origin: &str) -> Result<Option<f64>> {
    match get(o, key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x)),
            _ => bail!("{origin}: `{key}` must be a finite number, got {v}"),
        },
    }
}

fn bool_of(o: &Map<String, Value>, key: &str, default: bool, origin: &str) -> Result<bool> {
    match get(o, key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => bail!("{origin}: `{key}` must be true or false, got {v}"),
    }
}

fn str_of<'a>(o: &'a Map<String, Value>, key: &str, origin: &str) -> Result<Option<&'a str>> {
    match get(o, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => bail!("{origin}: `{key}` must be a string, got {v}"),
    }
}

/// `eos_token_id`-style field: an int or a list of ints.
pub(crate) fn ids_of(o: &Map<String, Value>, key: &str, origin: &str) -> Result<Vec<u32>> {
    let one = |v: &Value| -> Result<u32> {
        v.as_u64()
            .filter(|&x| x <= u32::MAX as u64)
            .map(|x| x as u32)
            .with_context(|| format!("{origin}: `{key}` must hold token ids, got {v}"))
    };
    match get(o, key) {
        None => Ok(vec![]),
        Some(Value::Array(a)) => a.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

fn rope_scaling(block: &Map<String, Value>, origin: &str) -> Result<RopeScaling> {
    let ty = match str_of(block, "rope_type", origin)? {
        Some(t) => t,
        None => str_of(block, "type", origin)?.unwrap_or("default"),
    };
    let factor = || -> Result<f64> {
        match f64_of(block, "factor", origin)? {
            Some(f) if f > 0.0 => Ok(f),
            Some(f) => bail!("{origin}: rope `factor` must be positive, got {f}"),
            None => bail!("{origin}: rope_type `{ty}` needs a `factor`"),
        }
    };
    match ty {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
        "llama3" => {
            let need = |k: &str| -> Result<f64> {
                f64_of(block, k, origin)?
                    .with_context(|| format!("{origin}: rope_type `llama3` needs `{k}`"))
            };
            let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
            if !(low > 0.0 && high > low) {
                bail!("{origin}: llama3 rope needs 0 < low_freq_factor < high_freq_factor, got {low} and {high}");
            }
            Ok(RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: req_usize(
                    block,
                    "original_max_position_embeddings",
                    origin,
                )?,
            })
        }
        t => bail!(
            "{origin}: rope_type `{t}` is not supported by this Llama port (default, linear, llama3)"
        ),
    }
}

impl LlamaConfig {
    /// Parses the text of a `config.json`; `origin` names it in errors.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self> {
        let root: Value =
            serde_json::from_str(text).with_context(|| format!("{origin}: invalid JSON"))?;
        let Value::Object(o) = root else {
            bail!("{origin}: expected a JSON object");
        };
        let model_type = str_of(&o, "model_type", origin)?;
        let archs: Vec<&str> = match get(&o, "architectures") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        match model_type {
            Some("llama") => {}
            Some(t) => bail!(
                "{origin}: model_type `{t}` is not supported (this port runs Llama-architecture models: model_type `llama`)"
            ),
            None if archs.contains(&"LlamaForCausalLM") => {}
            None => bail!("{origin}: no `model_type` (expected `llama`)"),
        }
        if let Some(a) = archs.iter().find(|a| **a != "LlamaForCausalLM") {
            bail!("{origin}: architecture `{a}` is not supported (expected LlamaForCausalLM)");
        }
        let act = str_of(&o, "hidden_act", origin)?.unwrap_or("silu");
        if act != "silu" {
            bail!("{origin}: hidden_act `{act}` is not supported (Llama uses silu)");
        }
        let hidden_size = req_usize(&o, "hidden_size", origin)?;
        let num_attention_heads = req_usize(&o, "num_attention_heads", origin)?;
        let num_key_value_heads =
            usize_of(&o, "num_key_value_heads", origin)?.unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || !num_attention_heads.is_multiple_of(num_key_value_heads) {
            bail!("{origin}: num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}");
        }
        let head_dim = match usize_of(&o, "head_dim", origin)? {
            Some(d) => d,
            None => {
                if !hidden_size.is_multiple_of(num_attention_heads) {
                    bail!("{origin}: no `head_dim` and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}");
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            bail!("{origin}: head_dim {head_dim} must be positive and even (RoPE rotates pairs)");
        }
        // RoPE: transformers 5 `rope_parameters` (holds rope_theta too), else the 4.x
        // top-level `rope_theta` + `rope_scaling` (which wins when both are present).
        let rp = match get(&o, "rope_parameters") {
            Some(Value::Object(p)) => Some(p),
            Some(v) => bail!("{origin}: `rope_parameters` must be an object, got {v}"),
            None => None,
        };
        let rope_theta = match rp.map(|p| f64_of(p, "rope_theta", origin)).transpose()? {
            Some(Some(t)) => t,
            _ => f64_of(&o, "rope_theta", origin)?.unwrap_or(10000.0),
        };
        if rope_theta <= 0.0 {
            bail!("{origin}: rope_theta must be positive, got {rope_theta}");
        }
        let rope_scaling = match (rp, get(&o, "rope_scaling")) {
            (_, Some(Value::Object(s))) => rope_scaling(s, origin)?,
            (_, Some(v)) => bail!("{origin}: `rope_scaling` must be an object or null, got {v}"),
            (Some(p), None) => rope_scaling(p, origin)?,
            (None, None) => RopeScaling::None,
        };
        let dtype = match str_of(&o, "dtype", origin)? {
            Some(d) => Some(d.to_string()),
            None => str_of(&o, "torch_dtype", origin)?.map(str::to_string),
        };
        let bos = ids_of(&o, "bos_token_id", origin)?;
        Ok(Self {
            hidden_size,
            intermediate_size: req_usize(&o, "intermediate_size", origin)?,
            num_hidden_layers: req_usize(&o, "num_hidden_layers", origin)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: req_usize(&o, "vocab_size", origin)?,
            max_position_embeddings: usize_of(&o, "max_position_embeddings", origin)?
                .unwrap_or(2048),
            rms_norm_eps: f64_of(&o, "rms_norm_eps", origin)?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: bool_of(&o, "tie_word_embeddings", false, origin)?,
            attention_bias: bool_of(&o, "attention_bias", false, origin)?,
            mlp_bias: bool_of(&o, "mlp_bias", false, origin)?,
            bos_token_id: bos.first().copied(),
            eos_token_ids: ids_of(&o, "eos_token_id", origin)?,
            dtype,
        })
    }

    /// Reads `dir/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let p = dir.as_ref().join("config.json");
        let text = std::fs::read_to_string(&p).with_context(|| {
            format!(
                "{}: cannot read config.json (is this a Hugging Face model folder?)",
                p.display()
            )
        })?;
        Self::from_json_str(&text, &p.display().to_string())
    }

    /// Query heads per KV head.
    pub fn n_rep(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}
