//! Limits derived from a model's config, checked before anything is allocated: every size
//! computed from config fields in checked arithmetic, the layer count equal to the layers
//! the weights hold, and the context no longer than `max_position_embeddings` unless the
//! caller says so.

use crate::errors::ConfigError;
use crate::LlamaConfig;

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
/// computed from the config alone ([`crate::rope::inv_freq`]), so this bounds what a
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

/// One more than the largest decoder-layer index `N` among tensor names
/// `model.layers.N.…` (0 when there is none); `u64` so that a hostile index cannot wrap.
pub fn layers_in(names: &[&str]) -> u64 {
    names
        .iter()
        .filter_map(|n| {
            n.strip_prefix("model.layers.")?
                .split_once('.')?
                .0
                .parse::<u64>()
                .ok()
        })
        .map(|i| i.saturating_add(1))
        .max()
        .unwrap_or(0)
}

/// Checks `num_hidden_layers` against the layers the weights `names` (of `weights`) hold.
pub fn check_layer_count(
    cfg: &LlamaConfig,
    origin: &str,
    weights: &str,
    names: &[&str],
) -> Result<(), ConfigError> {
    let found = layers_in(names);
    if cfg.num_hidden_layers as u64 != found {
        return Err(ConfigError::LayerCountMismatch {
            origin: origin.to_string(),
            config: cfg.num_hidden_layers as u64,
            weights: weights.to_string(),
            found,
        });
    }
    Ok(())
}

/// The KV-cache length of a load: `requested`, else `min(max_position_embeddings, 4096)`;
/// positive, and at most `max_position_embeddings` unless `allow_long` (the explicit
/// override, [`crate::LoadOptions::allow_long_context`]).
pub fn context_len(
    cfg: &LlamaConfig,
    origin: &str,
    requested: Option<usize>,
    allow_long: bool,
) -> Result<usize, ConfigError> {
    let n = requested.unwrap_or(cfg.max_position_embeddings.min(4096));
    if n == 0 {
        return Err(ConfigError::BadOption {
            option: "max_seq_len".into(),
            value: "0".into(),
            expected: "must be positive".into(),
        });
    }
    if n > cfg.max_position_embeddings && !allow_long {
        return Err(ConfigError::ContextTooLong {
            origin: origin.to_string(),
            requested: n as u64,
            max_position_embeddings: cfg.max_position_embeddings as u64,
        });
    }
    Ok(n)
}

/// The checks of `Llama::load` before any weight is read: the layer count against the
/// checkpoint's tensors and the context length (returned) against the config.
pub(crate) fn check_load(
    cfg: &LlamaConfig,
    dir: &std::path::Path,
    ckpt: &candle_fp4::checkpoint::Checkpoint,
    opts: &crate::LoadOptions,
) -> Result<usize, ConfigError> {
    let origin = dir.join("config.json").display().to_string();
    check_layer_count(cfg, &origin, ckpt.origin(), &ckpt.names())?;
    context_len(cfg, &origin, opts.max_seq_len, opts.allow_long_context)
}
