//! The tokenizer files of a model folder (tokenizer.json, tokenizer_config.json,
//! chat_template.jinja, generation_config.json, separated by 0xFF bytes, which UTF-8 never
//! contains) → `TextTokenizer::from_parts`, then a prompt encoded and decoded: never
//! panics.
#![no_main]

use candle_fp4_models::tokenizer::TextTokenizer;
use candle_fp4_models::LlamaConfig;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn cfg() -> &'static LlamaConfig {
    static C: OnceLock<LlamaConfig> = OnceLock::new();
    C.get_or_init(|| {
        let text = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 300,
            "bos_token_id": 1, "eos_token_id": [2, 3]}"#;
        LlamaConfig::from_json_str(text, "fuzz").expect("the fuzz target's own config")
    })
}

fuzz_target!(|data: &[u8]| {
    let mut parts = data.split(|&b| b == 0xFF).map(String::from_utf8_lossy);
    let tok = parts.next().unwrap_or_default();
    let tc = parts.next();
    let tpl = parts.next();
    let gc = parts.next();
    let Ok(t) = TextTokenizer::from_parts(
        &tok,
        tc.as_deref(),
        tpl.as_deref(),
        gc.as_deref(),
        cfg(),
        "fuzz",
    ) else {
        return;
    };
    if let Ok(ids) = t.prompt_ids("Hello, world! 123", false, Some("sys")) {
        let _ = t.decode(&ids);
        for &i in ids.iter().take(8) {
            let _ = t.is_eos(i);
        }
    }
    let _ = t.encode("", true);
    let _ = t.decode(&[0, 1, u32::MAX]);
});
