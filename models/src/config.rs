//! A Llama `config.json`, in both the transformers 4 form (`torch_dtype`, top-level
//! `rope_theta`, `rope_scaling`) and the transformers 5 form (`dtype`, `rope_parameters`).
//!
//! Parsing is strict about what changes the computation: an architecture, activation
//! or RoPE type this port does not implement is an error naming the key, never a silent
//! fallback.

use crate::errors::ConfigError;
use anyhow::{bail, Context, Result};
use candle_fp4::checkpoint::ModelFolder;
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

/// [`ConfigError::BadField`] for `key` = `v`.
fn bad(origin: &str, key: &str, v: impl std::fmt::Display, expected: &str) -> ConfigError {
    let v = v.to_string();
    let value = match v.char_indices().nth(80) {
        Some((i, _)) => format!("{}…", &v[..i]),
        None => v,
    };
    ConfigError::BadField {
        origin: origin.to_string(),
        field: key.to_string(),
        value,
        expected: expected.to_string(),
    }
}

fn usize_of(o: &Map<String, Value>, key: &str, origin: &str) -> Result<Option<usize>> {
    match get(o, key) {
        None => Ok(None),
        Some(v) => match v.as_u64().and_then(|x| usize::try_from(x).ok()) {
            Some(x) => Ok(Some(x)),
            None => Err(bad(origin, key, v, "a non-negative integer").into()),
        },
    }
}

fn req_usize(o: &Map<String, Value>, key: &str, origin: &str) -> Result<usize> {
    match usize_of(o, key, origin)? {
        Some(0) => Err(bad(origin, key, 0, "positive").into()),
        Some(x) => Ok(x),
        None => Err(ConfigError::MissingField {
            origin: origin.to_string(),
            field: key.to_string(),
        }
        .into()),
    }
}

fn f64_of(o: &Map<String, Value>, key: &str, origin: &str) -> Result<Option<f64>> {
    match get(o, key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x)),
            _ => Err(bad(origin, key, v, "a finite number").into()),
        },
    }
}

fn bool_of(o: &Map<String, Value>, key: &str, default: bool, origin: &str) -> Result<bool> {
    match get(o, key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(bad(origin, key, v, "true or false").into()),
    }
}

fn str_of<'a>(o: &'a Map<String, Value>, key: &str, origin: &str) -> Result<Option<&'a str>> {
    match get(o, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(bad(origin, key, v, "a string").into()),
    }
}

/// [`ConfigError::Unsupported`].
fn unsupported(origin: &str, field: &str, value: &str, supported: &str) -> anyhow::Error {
    ConfigError::Unsupported {
        origin: origin.to_string(),
        field: field.to_string(),
        value: value.to_string(),
        supported: supported.to_string(),
    }
    .into()
}

/// `eos_token_id`-style field: an int or a list of ints.
pub(crate) fn ids_of(o: &Map<String, Value>, key: &str, origin: &str) -> Result<Vec<u32>> {
    let one = |v: &Value| -> Result<u32> {
        match v.as_u64().and_then(|x| u32::try_from(x).ok()) {
            Some(x) => Ok(x),
            None => Err(bad(origin, key, v, "token ids (integers below 2^32)").into()),
        }
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
            Some(f) => Err(bad(origin, "factor", f, "positive (rope scaling factor)").into()),
            None => Err(ConfigError::MissingField {
                origin: origin.to_string(),
                field: format!("factor` (rope_type `{ty}`)"),
            }
            .into()),
        }
    };
    match ty {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
        "llama3" => {
            let need = |k: &str| -> Result<f64> {
                match f64_of(block, k, origin)? {
                    Some(x) => Ok(x),
                    None => Err(ConfigError::MissingField {
                        origin: origin.to_string(),
                        field: format!("{k}` (rope_type `llama3`"),
                    }
                    .into()),
                }
            };
            let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
            if !(low > 0.0 && high > low) {
                return Err(bad(
                    origin,
                    "high_freq_factor",
                    format!("{high} (low_freq_factor {low})"),
                    "above low_freq_factor, which must be positive (llama3 rope)",
                )
                .into());
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
        t => Err(unsupported(
            origin,
            "rope_type",
            t,
            "this Llama port runs default, linear, llama3",
        )),
    }
}

/// The text of `dir/config.json`, read through [`ModelFolder`] (a regular file inside the
/// folder: no symlink out of it, no FIFO).
pub fn read_config_text(dir: &Path) -> Result<String> {
    let p = dir.join("config.json");
    let ctx = || {
        format!(
            "{}: cannot read config.json (is this a Hugging Face model folder?)",
            p.display()
        )
    };
    let folder = ModelFolder::new(dir).with_context(ctx)?;
    match folder.read_text("config.json").with_context(ctx)? {
        Some((_, text)) => Ok(text),
        None => bail!(
            "{}: no config.json (is this a Hugging Face model folder?)",
            dir.display()
        ),
    }
}

impl LlamaConfig {
    /// Parses the text of a `config.json`; `origin` names it in errors.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self> {
        let root: Value =
            serde_json::from_str(text).with_context(|| format!("{origin}: invalid JSON"))?;
        let Value::Object(o) = root else {
            return Err(bad(origin, "(root)", &root, "a JSON object").into());
        };
        let model_type = str_of(&o, "model_type", origin)?;
        let archs: Vec<&str> = match get(&o, "architectures") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        match model_type {
            Some("llama") => {}
            Some(t) => {
                return Err(unsupported(
                    origin,
                    "model_type",
                    t,
                    "this port runs Llama-architecture models: model_type `llama`",
                ))
            }
            None if archs.contains(&"LlamaForCausalLM") => {}
            None => {
                return Err(ConfigError::MissingField {
                    origin: origin.to_string(),
                    field: "model_type` (expected `llama`".to_string(),
                }
                .into())
            }
        }
        if let Some(a) = archs.iter().find(|a| **a != "LlamaForCausalLM") {
            return Err(unsupported(
                origin,
                "architecture",
                a,
                "expected LlamaForCausalLM",
            ));
        }
        let act = str_of(&o, "hidden_act", origin)?.unwrap_or("silu");
        if act != "silu" {
            return Err(unsupported(origin, "hidden_act", act, "Llama uses silu"));
        }
        let hidden_size = req_usize(&o, "hidden_size", origin)?;
        let num_attention_heads = req_usize(&o, "num_attention_heads", origin)?;
        let num_key_value_heads =
            usize_of(&o, "num_key_value_heads", origin)?.unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || !num_attention_heads.is_multiple_of(num_key_value_heads) {
            return Err(bad(
                origin,
                "num_key_value_heads",
                num_key_value_heads,
                &format!("a positive divisor of num_attention_heads {num_attention_heads} (num_attention_heads is not a multiple of num_key_value_heads)"),
            )
            .into());
        }
        let head_dim = match usize_of(&o, "head_dim", origin)? {
            Some(d) => d,
            None => {
                if !hidden_size.is_multiple_of(num_attention_heads) {
                    return Err(bad(
                        origin,
                        "num_attention_heads",
                        num_attention_heads,
                        &format!(
                            "a divisor of hidden_size {hidden_size} when there is no `head_dim`"
                        ),
                    )
                    .into());
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(bad(
                origin,
                "head_dim",
                head_dim,
                "positive and even (RoPE rotates pairs)",
            )
            .into());
        }
        // RoPE: transformers 5 `rope_parameters` (holds rope_theta too), else the 4.x
        // top-level `rope_theta` + `rope_scaling` (which wins when both are present).
        let rp = match get(&o, "rope_parameters") {
            Some(Value::Object(p)) => Some(p),
            Some(v) => return Err(bad(origin, "rope_parameters", v, "an object").into()),
            None => None,
        };
        let rope_theta = match rp.map(|p| f64_of(p, "rope_theta", origin)).transpose()? {
            Some(Some(t)) => t,
            _ => f64_of(&o, "rope_theta", origin)?.unwrap_or(10000.0),
        };
        if rope_theta <= 0.0 {
            return Err(bad(origin, "rope_theta", rope_theta, "positive").into());
        }
        let rope_scaling = match (rp, get(&o, "rope_scaling")) {
            (_, Some(Value::Object(s))) => rope_scaling(s, origin)?,
            (_, Some(v)) => return Err(bad(origin, "rope_scaling", v, "an object or null").into()),
            (Some(p), None) => rope_scaling(p, origin)?,
            (None, None) => RopeScaling::None,
        };
        let dtype = match str_of(&o, "dtype", origin)? {
            Some(d) => Some(d.to_string()),
            None => str_of(&o, "torch_dtype", origin)?.map(str::to_string),
        };
        let bos = ids_of(&o, "bos_token_id", origin)?;
        let max_position_embeddings = match usize_of(&o, "max_position_embeddings", origin)? {
            Some(0) => return Err(bad(origin, "max_position_embeddings", 0, "positive").into()),
            Some(n) => n,
            None => 2048,
        };
        let rms_norm_eps = f64_of(&o, "rms_norm_eps", origin)?.unwrap_or(1e-6);
        if !(rms_norm_eps > 0.0 && rms_norm_eps < 1.0) {
            return Err(bad(origin, "rms_norm_eps", rms_norm_eps, "in (0, 1)").into());
        }
        let cfg = Self {
            hidden_size,
            intermediate_size: req_usize(&o, "intermediate_size", origin)?,
            num_hidden_layers: req_usize(&o, "num_hidden_layers", origin)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: req_usize(&o, "vocab_size", origin)?,
            max_position_embeddings,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: bool_of(&o, "tie_word_embeddings", false, origin)?,
            attention_bias: bool_of(&o, "attention_bias", false, origin)?,
            mlp_bias: bool_of(&o, "mlp_bias", false, origin)?,
            bos_token_id: bos.first().copied(),
            eos_token_ids: ids_of(&o, "eos_token_id", origin)?,
            dtype,
        };
        check_config_sizes(&cfg, origin)?;
        Ok(cfg)
    }

    /// Reads `dir/config.json` ([`read_config_text`]).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let text = read_config_text(dir)?;
        Self::from_json_str(&text, &dir.join("config.json").display().to_string())
    }

    /// Query heads per KV head.
    pub fn n_rep(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}

/// `a × b` naming both config fields, or [`ConfigError::Overflow`].
fn mul(origin: &str, (na, a): (&str, usize), (nb, b): (&str, usize)) -> Result<usize, ConfigError> {
    a.checked_mul(b).ok_or_else(|| ConfigError::Overflow {
        origin: origin.to_string(),
        expr: format!("{na} {a} × {nb} {b}"),
    })
}

/// The sizes a Llama computes from its config: `[q | k | v]` rows, `o_proj` columns,
/// `[gate | up]` rows, the embedding. Errors when one overflows `usize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigSizes {
    /// `(num_attention_heads + 2·num_key_value_heads) · head_dim`.
    pub qkv_rows: usize,
    /// `num_attention_heads · head_dim`.
    pub q_dim: usize,
    /// `2 · intermediate_size`.
    pub gate_up_rows: usize,
    /// `vocab_size · hidden_size`.
    pub embed_elems: usize,
}

/// Computes [`ConfigSizes`] in checked arithmetic.
///
/// `num_attention_heads · head_dim` need not equal `hidden_size`: transformers' Llama
/// takes an explicit `head_dim` (e.g. NVIDIA's Minitron 4B: 32 × 128 over a hidden size of
/// 3072), and the weight shapes are checked against these sizes at load.
pub fn config_sizes(cfg: &LlamaConfig, origin: &str) -> Result<ConfigSizes, ConfigError> {
    let q_dim = mul(
        origin,
        ("num_attention_heads", cfg.num_attention_heads),
        ("head_dim", cfg.head_dim),
    )?;
    let kv_dim = mul(
        origin,
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("head_dim", cfg.head_dim),
    )?;
    let qkv_rows = kv_dim
        .checked_mul(2)
        .and_then(|x| x.checked_add(q_dim))
        .ok_or_else(|| ConfigError::Overflow {
            origin: origin.to_string(),
            expr: format!(
                "(num_attention_heads {} + 2 × num_key_value_heads {}) × head_dim {}",
                cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            ),
        })?;
    let gate_up_rows =
        cfg.intermediate_size
            .checked_mul(2)
            .ok_or_else(|| ConfigError::Overflow {
                origin: origin.to_string(),
                expr: format!("2 × intermediate_size {}", cfg.intermediate_size),
            })?;
    let embed_elems = mul(
        origin,
        ("vocab_size", cfg.vocab_size),
        ("hidden_size", cfg.hidden_size),
    )?;
    Ok(ConfigSizes {
        qkv_rows,
        q_dim,
        gate_up_rows,
        embed_elems,
    })
}

/// Largest `head_dim` accepted: 65536 (real models use 64 to 256). The RoPE tables are
/// computed from the config alone (`crate::rope::inv_freq`), so this bounds what a
/// config can make the loader allocate before any weight is compared.
pub const MAX_HEAD_DIM: usize = 1 << 16;

/// Checks at parse time that every size derived from the config fits ([`config_sizes`])
/// and that `head_dim` is at most [`MAX_HEAD_DIM`].
pub fn check_config_sizes(cfg: &LlamaConfig, origin: &str) -> Result<(), ConfigError> {
    if cfg.head_dim > MAX_HEAD_DIM {
        return Err(ConfigError::BadField {
            origin: origin.to_string(),
            field: "head_dim".into(),
            value: cfg.head_dim.to_string(),
            expected: format!("at most {MAX_HEAD_DIM}"),
        });
    }
    config_sizes(cfg, origin).map(|_| ())
}
