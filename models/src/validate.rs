//! Limits derived from a model's config, checked before anything is allocated: every size
//! computed from config fields in checked arithmetic, the layer count equal to the layers
//! the weights hold, and the context no longer than `max_position_embeddings` unless the
//! caller says so.

use crate::config::LlamaConfig;
use crate::errors::ConfigError;

pub use crate::config::{check_config_sizes, config_sizes, ConfigSizes, MAX_HEAD_DIM};

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
/// override, [`crate::llama::LoadOptions::allow_long_context`]).
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
    max_seq_len: Option<usize>,
    allow_long_context: bool,
) -> Result<usize, ConfigError> {
    let origin = dir.join("config.json").display().to_string();
    check_layer_count(cfg, &origin, ckpt.origin(), &ckpt.names())?;
    context_len(cfg, &origin, max_seq_len, allow_long_context)
}
