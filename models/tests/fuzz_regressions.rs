//! Every input the fuzzers found a crash with (`fuzz/regressions/<target>/`), replayed
//! through the same entry points as the fuzz target, plus a minimal reproduction of each
//! bug as a typed-error check.

use candle_core::{DType, Device, Tensor};
use candle_fp4_models::errors::{find, GgufError};
use candle_fp4_models::gguf::GgufModel;
use candle_fp4_models::tokenizer::TextTokenizer;
use candle_fp4_models::LlamaConfig;
use std::path::Path;

mod hostile;
use hostile::*;

fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let d = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/regressions")
        .join(target);
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (p.display().to_string(), std::fs::read(&p).unwrap())
        })
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no regression inputs in {}", d.display());
    v
}

fn cfg() -> LlamaConfig {
    LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 300}"#,
        "cfg",
    )
    .unwrap()
}

/// The tokenizer target's split of an input into the four files.
fn tokenizer_parts(data: &[u8]) -> [Option<String>; 4] {
    let mut parts = data
        .split(|&b| b == 0xFF)
        .map(|p| String::from_utf8_lossy(p).into_owned());
    [parts.next(), parts.next(), parts.next(), parts.next()]
}

#[test]
fn gguf_crash_inputs_replay_cleanly() {
    for (name, data) in inputs("gguf_llama") {
        guarded(move || {
            if let Ok(g) = GgufModel::from_bytes(data, "fuzz.gguf") {
                for n in g.hf_names() {
                    let _ = g.tensor_f32(&n);
                }
                let _ = g.config_json();
                let _ = g.tokenizer_json();
            }
        });
        eprintln!("{name}: ok");
    }
    // The bug: a tensor with a zero dimension made candle cast an empty, unaligned byte
    // buffer to blocks (undefined behaviour; an abort in debug builds).
    let md = gguf_metadata();
    let mut t = gguf_tensors(2);
    t.push((
        "blk.0.empty.weight".into(),
        Tensor::zeros((0, 32), DType::F32, &Device::Cpu).unwrap(),
    ));
    let e = GgufModel::from_bytes(gguf_from(&md, &t), "empty").unwrap_err();
    assert!(
        matches!(find::<GgufError>(&e), Some(GgufError::BadTensor { tensor, .. }) if tensor == "blk.0.empty.weight"),
        "{e:#}"
    );
}

#[test]
fn tokenizer_crash_inputs_replay_cleanly() {
    for (name, data) in inputs("tokenizer") {
        let c = cfg();
        let r = guarded(move || {
            let [t, tc, tpl, gc] = tokenizer_parts(&data);
            TextTokenizer::from_parts(
                &t.unwrap_or_default(),
                tc.as_deref(),
                tpl.as_deref(),
                gc.as_deref(),
                &c,
                "fuzz",
            )
            .map(|_| ())
        });
        assert!(r.is_err(), "{name}");
    }
    // The bugs: tokenizers 0.23 `expect`s inside its deserializers — a syntax error in the
    // decoder value, and a Precompiled normalizer that does not parse.
    let ok = r#"{"version":"1.0","model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"}"#;
    for bad in [
        format!(r#"{ok},"decoder":{{"type":"ByteLevel",]}}}}"#),
        format!(r#"{ok},"normalizer":{{"type":"Precompiled","precompiled_charsmap":5}}}}"#),
        format!(
            r#"{ok},"normalizer":{{"type":"Sequence","normalizers":[{{"type":"Precompiled"}}]}}}}"#
        ),
    ] {
        let c = cfg();
        let r =
            guarded(move || TextTokenizer::from_parts(&bad, None, None, None, &c, "t").map(|_| ()));
        assert!(r.is_err());
    }
    TextTokenizer::from_parts(&format!("{ok}}}"), None, None, None, &cfg(), "t").unwrap();
}
