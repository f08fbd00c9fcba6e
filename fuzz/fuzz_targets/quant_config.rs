//! Both JSON forms of ModelOpt's quant config (`hf_quant_config.json` and config.json's
//! `quantization_config`), then module-name matching against the parsed patterns: never
//! panics.
#![no_main]

use candle_fp4::quant_config::QuantConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks a module name to match; the rest is the JSON.
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let names = [
        "model.layers.0.self_attn.q_proj",
        "lm_head",
        "model.embed_tokens",
        "model.layers.12.mlp.down_proj",
        "",
    ];
    let module = names[pick as usize % names.len()];
    for q in [
        QuantConfig::from_hf_quant_config_str(&text, "fuzz/hf_quant_config.json"),
        QuantConfig::from_config_json_str(&text, "fuzz/config.json"),
    ]
    .into_iter()
    .flatten()
    {
        let _ = q.is_nvfp4(module);
        let _ = q.quantizes();
        // Patterns against each other (long, star-heavy names).
        for p in q.exclude.iter().take(8) {
            let _ = q.is_excluded(p);
        }
    }
});
