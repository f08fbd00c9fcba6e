//! GGUF bytes → `GgufModel::from_bytes` → the Hugging Face config (parsed back as a
//! `LlamaConfig`), tensor names, small tensors dequantized, and the tokenizer files
//! generated from the metadata: never panics, never allocates beyond what the file holds.
//! (Building a tokenizer from the generated `tokenizer.json` is the `tokenizer` target's
//! job, whose seeds include one; here it would cost most of each run.)
#![no_main]

use candle_fp4_models::gguf::GgufModel;
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
    let _ = g.tokenizer_json();
    if let Ok(cfg) = g.config_json() {
        let _ = LlamaConfig::from_json_str(&cfg.to_string(), "fuzz.gguf: config");
    }
});
