//! A Llama `config.json` → `LlamaConfig::from_json_str`, then everything computed from a
//! config alone (sizes, RoPE frequencies, the context length check): never panics, and
//! an accepted config's sizes never overflow.
#![no_main]

use candle_fp4_models::validate::{config_sizes, context_len};
use candle_fp4_models::LlamaConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let Ok(cfg) = LlamaConfig::from_json_str(&text, "fuzz/config.json") else {
        return;
    };
    assert!(config_sizes(&cfg, "fuzz").is_ok());
    assert!(cfg.rms_norm_eps > 0.0 && cfg.max_position_embeddings > 0);
    let f = candle_fp4_models::rope::inv_freq(&cfg);
    assert_eq!(f.len(), cfg.head_dim / 2);
    let _ = cfg.n_rep();
    for n in [None, Some(1), Some(cfg.max_position_embeddings), Some(usize::MAX)] {
        let _ = context_len(&cfg, "fuzz", n, false);
    }
});
