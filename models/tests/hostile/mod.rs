//! Helpers of the hostile-input tests: copies of the tiny model with edits, a small GGUF
//! writer, a byte-level tokenizer, FIFOs, and a guard that turns a panic or a hang into a
//! test failure.
#![allow(dead_code)]

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The tiny ModelOpt fixture.
pub fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/modelopt_tiny")
}

/// Runs `f` on another thread; fails the test on a panic or after 60 s.
pub fn guarded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(Ok(v)) => v,
        Ok(Err(_)) => panic!("a panic escaped"),
        Err(_) => panic!("the call hung (no answer in 60 s)"),
    }
}

pub type Json = serde_json::Map<String, serde_json::Value>;

/// A copy of the tiny NVFP4 model (weights, quant config, config.json with `edit`).
pub fn tiny_with(edit: impl FnOnce(&mut Json)) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "hf_quant_config.json"] {
        std::fs::copy(data().join(f), d.path().join(f)).unwrap();
    }
    write_config(d.path(), &data().join("config.json"), edit);
    d
}

/// The tiny BF16 model (`original.safetensors`, no quant config), config edited.
pub fn bf16_with(edit: impl FnOnce(&mut Json)) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::copy(
        data().join("original.safetensors"),
        d.path().join("model.safetensors"),
    )
    .unwrap();
    write_config(d.path(), &data().join("config.json"), |c| {
        c.remove("quantization_config");
        edit(c)
    });
    d
}

fn write_config(dir: &Path, from: &Path, edit: impl FnOnce(&mut Json)) {
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(from).unwrap()).unwrap();
    edit(cfg.as_object_mut().unwrap());
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

/// Rewrites `dir/model.safetensors`, applying `edit` to the list of `(name, tensor)`.
pub fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) {
    let p = dir.join("model.safetensors");
    let w = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
    let mut w: Vec<(String, Tensor)> = w.into_iter().collect();
    edit(&mut w);
    let map: std::collections::HashMap<String, Tensor> = w.into_iter().collect();
    candle_core::safetensors::save(&map, &p).unwrap();
}

/// Rewrites `dir/model.safetensors` with `edit` applied to the raw bytes of tensor `name`.
pub fn edit_raw(dir: &Path, name: &str, edit: impl FnOnce(&mut Vec<u8>)) {
    use safetensors::tensor::TensorView;
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut owned.iter_mut().find(|t| t.0 == name).unwrap().3);
    let views: Vec<(&str, TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(&p, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// A tokenizer.json where every printable ASCII character is its own token (ids = bytes).
pub fn write_byte_tokenizer(dir: &Path) {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .filter(|b| b.is_ascii_graphic())
        .map(|b| ((b as char).to_string(), (b as u64).into()))
        .collect();
    let tok = serde_json::json!({"version": "1.0", "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": false},
        "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "unk_token": null}});
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
}

#[cfg(unix)]
pub fn mkfifo(p: &Path) {
    let st = std::process::Command::new("mkfifo")
        .arg(p)
        .status()
        .unwrap();
    assert!(st.success(), "mkfifo {}", p.display());
}

/// The metadata of [`gguf_bytes`]'s model: hidden 32, 2 heads of 16, 1 KV head, FFN 32,
/// 2 blocks, 8 tokens.
pub fn gguf_metadata() -> Vec<(String, Value)> {
    let u = Value::U32;
    let s = |x: &str| Value::String(x.into());
    let tokens: Vec<Value> = [
        "a",
        "b",
        "c",
        "d",
        "ab",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    ]
    .iter()
    .map(|t| s(t))
    .collect();
    vec![
        ("general.architecture".into(), s("llama")),
        ("llama.block_count".into(), u(2)),
        ("llama.context_length".into(), u(64)),
        ("llama.embedding_length".into(), u(32)),
        ("llama.feed_forward_length".into(), u(32)),
        ("llama.attention.head_count".into(), u(2)),
        ("llama.attention.head_count_kv".into(), u(1)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
        ("llama.rope.freq_base".into(), Value::F32(10000.0)),
        ("llama.rope.dimension_count".into(), u(16)),
        ("llama.vocab_size".into(), u(8)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("smollm")),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array([1, 1, 1, 1, 1, 3, 3, 3].map(Value::I32).to_vec()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(vec![s("a b")])),
        ("tokenizer.ggml.bos_token_id".into(), u(5)),
        ("tokenizer.ggml.eos_token_id".into(), u(6)),
        (
            "tokenizer.chat_template".into(),
            s("{{'<|im_start|>' + m + '<|im_end|>'}}"),
        ),
    ]
}

/// The tensors of [`gguf_bytes`]'s model (F32, small random values).
pub fn gguf_tensors(blocks: usize) -> Vec<(String, Tensor)> {
    let r = |n: usize, k: usize| Tensor::randn(0f32, 0.1, (n, k), &Device::Cpu).unwrap();
    let one = |n: usize| Tensor::ones(n, candle_core::DType::F32, &Device::Cpu).unwrap();
    let mut t = vec![
        ("token_embd.weight".to_string(), r(8, 32)),
        ("output_norm.weight".to_string(), one(32)),
    ];
    for b in 0..blocks {
        let p = |s: &str| format!("blk.{b}.{s}.weight");
        t.push((p("attn_norm"), one(32)));
        t.push((p("attn_q"), r(32, 32)));
        t.push((p("attn_k"), r(16, 32)));
        t.push((p("attn_v"), r(16, 32)));
        t.push((p("attn_output"), r(32, 32)));
        t.push((p("ffn_norm"), one(32)));
        t.push((p("ffn_gate"), r(32, 32)));
        t.push((p("ffn_up"), r(32, 32)));
        t.push((p("ffn_down"), r(32, 32)));
    }
    t
}

/// A GGUF of `metadata` and `tensors`, as candle writes it.
pub fn gguf_from(metadata: &[(String, Value)], tensors: &[(String, Tensor)]) -> Vec<u8> {
    let q: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), QTensor::quantize(t, GgmlDType::F32).unwrap()))
        .collect();
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = q.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &md, &ts).unwrap();
    out.into_inner()
}

/// A valid tiny Llama GGUF, with `edit` applied to its metadata.
pub fn gguf_bytes(edit: impl FnOnce(&mut Vec<(String, Value)>)) -> Vec<u8> {
    let mut md = gguf_metadata();
    edit(&mut md);
    gguf_from(&md, &gguf_tensors(2))
}

/// Sets metadata `key` to `v` (replacing or adding it).
pub fn set(md: &mut Vec<(String, Value)>, key: &str, v: Value) {
    md.retain(|(k, _)| k != key);
    md.push((key.to_string(), v));
}
