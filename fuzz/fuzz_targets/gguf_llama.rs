//! GGUF bytes → `GgufModel::from_bytes` → the Hugging Face config, tensor names, small
//! tensors dequantized, and the tokenizer files: never panics, never allocates beyond
//! what the file holds.
#![no_main]

use candle_fp4_models::gguf::GgufModel;
use candle_fp4_models::tokenizer::TextTokenizer;
use candle_fp4_models::LlamaConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufModel::from_bytes(data.to_vec(), "fuzz.gguf") else {
        return;
    };
    let names = g.hf_names();
    assert!(names.len() <= 9 * g.content().tensor_infos.len() + 3);
    for n in names.iter().take(32) {
        let small = g
            .content()
            .tensor_infos
            .values()
            .all(|t| t.shape.elem_count() <= 1 << 16);
        if small {
            let _ = g.tensor_f32(n);
        }
    }
    let _ = g.eog_ids();
    let _ = g.tokenizer_config_json();
    let _ = g.generation_config_json();
    let Ok(cfg) = g.config_json() else { return };
    let Ok(cfg) = LlamaConfig::from_json_str(&cfg.to_string(), "fuzz.gguf: config") else {
        return;
    };
    if let Ok(tj) = g.tokenizer_json() {
        if let Ok(t) = TextTokenizer::from_parts(&tj.to_string(), None, None, None, &cfg, "fuzz") {
            let _ = t.encode("ab a<|im_end|>", true);
        }
    }
});
