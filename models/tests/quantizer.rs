//! The quantizer against NVIDIA ModelOpt's own export of the tiny Llama
//! (`tests/data/modelopt_tiny`): same tensors byte for byte, same exclusions, same shared
//! global scales, same file bytes; and the GGUF path (a GGUF written from the same
//! weights in llama.cpp's layout, Q/K permuted) giving the same checkpoint.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_fp4_models::quant::{
    quantize_model, write_safetensors, OutputFormat, OwnedTensor, QuantizeOptions,
};
use candle_fp4_models::tokenizer::{ChatTemplate, TextTokenizer};
use candle_fp4_models::{Llama, LlamaConfig, LoadOptions};
use safetensors::SafeTensors;
use std::path::Path;

mod common;
use common::{bf16_dir, data};

fn owned(st: &SafeTensors, name: &str) -> OwnedTensor {
    let v = st.tensor(name).unwrap();
    OwnedTensor {
        dtype: v.dtype(),
        shape: v.shape().to_vec(),
        data: v.data().to_vec(),
    }
}

fn quantize(input: &Path, format: OutputFormat) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    let mut calls = 0;
    let opts = QuantizeOptions {
        format,
        exclude: vec![],
        ..Default::default()
    };
    let s = quantize_model(input, out.path(), &opts, &mut |p| {
        calls += 1;
        assert!(p.done <= p.total);
    })
    .unwrap();
    assert!(calls > 0);
    if format == OutputFormat::Nvfp4 {
        assert_eq!((s.quantized, s.kept), (14, 7));
    }
    out
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Checks `ours` (a quantizer output folder) against ModelOpt's export.
fn check_against_modelopt(ours: &Path) {
    let theirs_bytes = std::fs::read(data().join("model.safetensors")).unwrap();
    let ours_bytes = std::fs::read(ours.join("model.safetensors")).unwrap();
    let theirs = SafeTensors::deserialize(&theirs_bytes).unwrap();
    let mine = SafeTensors::deserialize(&ours_bytes).unwrap();

    // Every ModelOpt tensor but the activation scales (W4A4 calibration, which a weight
    // quantizer cannot produce; ModelOpt's W4A16 export has none either) is ours, byte for byte.
    let mut expected: Vec<String> = theirs
        .names()
        .into_iter()
        .filter(|n| !n.ends_with(".input_scale"))
        .map(String::from)
        .collect();
    expected.sort();
    let mut got: Vec<String> = mine.names().into_iter().map(String::from).collect();
    got.sort();
    assert_eq!(got, expected);
    for n in &expected {
        let (a, b) = (theirs.tensor(n).unwrap(), mine.tensor(n).unwrap());
        assert_eq!(a.dtype(), b.dtype(), "{n}");
        assert_eq!(a.shape(), b.shape(), "{n}");
        assert!(a.data() == b.data(), "{n}: bytes differ");
    }
    // Shared global scales: q/k/v one value, gate/up one value.
    for l in 0..2 {
        let gs = |m: &str| {
            mine.tensor(&format!("model.layers.{l}.{m}.weight_scale_2"))
                .unwrap()
                .data()
                .to_vec()
        };
        assert_eq!(gs("self_attn.q_proj"), gs("self_attn.k_proj"));
        assert_eq!(gs("self_attn.q_proj"), gs("self_attn.v_proj"));
        assert_eq!(gs("mlp.gate_proj"), gs("mlp.up_proj"));
    }
    // Whole file: the same serializer (Python's safetensors wraps this crate) gives
    // ModelOpt's bytes for ModelOpt's tensors, and ours for the W4A16 subset.
    let all: Vec<(String, OwnedTensor)> = theirs
        .names()
        .into_iter()
        .map(|n| (n.to_string(), owned(&theirs, n)))
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    write_safetensors(&all, &tmp.path().join("a.safetensors")).unwrap();
    assert!(
        std::fs::read(tmp.path().join("a.safetensors")).unwrap() == theirs_bytes,
        "serializer differs from ModelOpt's"
    );
    let w4a16: Vec<(String, OwnedTensor)> = all
        .into_iter()
        .filter(|(n, _)| !n.ends_with(".input_scale"))
        .collect();
    write_safetensors(&w4a16, &tmp.path().join("b.safetensors")).unwrap();
    assert!(
        std::fs::read(tmp.path().join("b.safetensors")).unwrap() == ours_bytes,
        "file bytes differ"
    );

    // The json files say what ModelOpt's W4A16 export says (but for the producer).
    let w4a16_dir = data().join("../modelopt_tiny_w4a16");
    let hq = json(&ours.join("hf_quant_config.json"));
    assert_eq!(
        hq["quantization"],
        json(&w4a16_dir.join("hf_quant_config.json"))["quantization"]
    );
    let mut qc = json(&ours.join("config.json"))["quantization_config"].clone();
    let mut want = json(&w4a16_dir.join("config.json"))["quantization_config"].clone();
    qc.as_object_mut().unwrap().remove("producer");
    want.as_object_mut().unwrap().remove("producer");
    assert_eq!(qc, want);
}

#[test]
fn hf_checkpoint_quantizes_like_modelopt() {
    let src = bf16_dir();
    let out = quantize(src.path(), OutputFormat::Nvfp4);
    check_against_modelopt(out.path());
    // And it loads and runs, with ModelOpt's export's logits exactly.
    let ids: Vec<u32> = (0..10).map(|i| (i * 23 + 5) % 256).collect();
    let mut a = Llama::load(out.path(), &Device::Cpu, &LoadOptions::default()).unwrap();
    let mut b = Llama::load(data(), &Device::Cpu, &LoadOptions::default()).unwrap();
    assert_eq!(a.nvfp4_layer_count(), (8, 9));
    let (la, lb) = (
        a.forward_all(&ids, 0).unwrap(),
        b.forward_all(&ids, 0).unwrap(),
    );
    assert_eq!(
        (la - lb)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        0.0
    );
}

#[test]
fn quantizer_refuses_bad_inputs() {
    let out = tempfile::tempdir().unwrap();
    let o = out.path().join("x");
    let opts = QuantizeOptions::default();
    let err = |input: &Path| {
        quantize_model(input, &o, &opts, &mut |_| {})
            .unwrap_err()
            .to_string()
    };
    // An already quantized checkpoint.
    assert!(
        err(&data()).contains("already quantized"),
        "{}",
        err(&data())
    );
    // No such input.
    assert!(err(Path::new("/nonexistent/model")).contains("no such file or folder"));
    // A folder without config.json.
    let empty = tempfile::tempdir().unwrap();
    assert!(err(empty.path()).contains("config.json"));
    // A file that is not a GGUF.
    let f = empty.path().join("x.gguf");
    std::fs::write(&f, b"nope, not a gguf").unwrap();
    assert!(err(&f).contains("not a GGUF"));
    // A non-empty output folder.
    let src = bf16_dir();
    let e = quantize_model(src.path(), src.path(), &opts, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("not empty"), "{e}");
}

/// GPT-2's byte → printable character map (byte-level BPE alphabet).
fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut out = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        out[*b as usize] = char::from_u32(c).unwrap();
    }
    out
}

/// llama.cpp's converter permutation of Q/K rows: `w.reshape(heads, 2, d/2, K).swapaxes(1, 2)`.
fn permute(w: &Tensor, heads: usize) -> Tensor {
    let (n, k) = w.dims2().unwrap();
    w.reshape((heads, 2, n / heads / 2, k))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((n, k))
        .unwrap()
}

/// The tiny model as llama.cpp would write it (F32 tensors, so every value survives),
/// with a 256-token byte-level vocabulary and a ChatML template.
fn write_tiny_gguf(path: &Path) {
    let w =
        candle_core::safetensors::load(data().join("original.safetensors"), &Device::Cpu).unwrap();
    let mut tensors: Vec<(String, QTensor)> = vec![];
    let mut put = |name: &str, t: &Tensor| {
        tensors.push((
            name.to_string(),
            QTensor::quantize(&t.to_dtype(DType::F32).unwrap(), GgmlDType::F32).unwrap(),
        ));
    };
    put("token_embd.weight", &w["model.embed_tokens.weight"]);
    put("output.weight", &w["lm_head.weight"]);
    put("output_norm.weight", &w["model.norm.weight"]);
    for l in 0..2 {
        let g = |s: &str| w[&format!("model.layers.{l}.{s}.weight")].clone();
        put(&format!("blk.{l}.attn_norm.weight"), &g("input_layernorm"));
        put(
            &format!("blk.{l}.attn_q.weight"),
            &permute(&g("self_attn.q_proj"), 3),
        );
        put(
            &format!("blk.{l}.attn_k.weight"),
            &permute(&g("self_attn.k_proj"), 1),
        );
        put(&format!("blk.{l}.attn_v.weight"), &g("self_attn.v_proj"));
        put(
            &format!("blk.{l}.attn_output.weight"),
            &g("self_attn.o_proj"),
        );
        put(
            &format!("blk.{l}.ffn_norm.weight"),
            &g("post_attention_layernorm"),
        );
        put(&format!("blk.{l}.ffn_gate.weight"), &g("mlp.gate_proj"));
        put(&format!("blk.{l}.ffn_up.weight"), &g("mlp.up_proj"));
        put(&format!("blk.{l}.ffn_down.weight"), &g("mlp.down_proj"));
    }
    let chars = byte_chars();
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    let mut types = vec![3i32, 3, 3];
    // Byte tokens for printable ASCII and '\n', then a few merges, then unused slots.
    for b in (b' '..=b'~').chain([b'\n']) {
        tokens.push(chars[b as usize].to_string());
        types.push(1);
    }
    let sp = chars[b' ' as usize];
    let merges = [
        format!("{sp} h"),
        "h e".into(),
        format!("{sp}h e"),
        "l l".into(),
        "ll o".into(),
    ];
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    while tokens.len() < 256 {
        tokens.push(format!("<unused{}>", tokens.len()));
        types.push(5);
    }
    let template = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";
    let u32v = Value::U32;
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", u32v(2)),
        ("llama.context_length", u32v(128)),
        ("llama.embedding_length", u32v(192)),
        ("llama.feed_forward_length", u32v(320)),
        ("llama.attention.head_count", u32v(3)),
        ("llama.attention.head_count_kv", u32v(1)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("llama.rope.dimension_count", u32v(64)),
        ("llama.vocab_size", u32v(256)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("smollm".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        (
            "tokenizer.ggml.merges",
            Value::Array(merges.iter().cloned().map(Value::String).collect()),
        ),
        ("tokenizer.ggml.bos_token_id", u32v(1)),
        ("tokenizer.ggml.eos_token_id", u32v(2)),
        ("tokenizer.ggml.unknown_token_id", u32v(0)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
        ("tokenizer.chat_template", Value::String(template.into())),
    ];
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

#[test]
fn gguf_input_unpermutes_and_quantizes_like_modelopt() {
    let d = tempfile::tempdir().unwrap();
    let gguf = d.path().join("tiny.gguf");
    write_tiny_gguf(&gguf);

    // GGUF → BF16: exactly the original weights (Q/K un-permuted), BF16 throughout.
    let bf = quantize(&gguf, OutputFormat::Bf16);
    let orig_bytes = std::fs::read(data().join("original.safetensors")).unwrap();
    let orig = SafeTensors::deserialize(&orig_bytes).unwrap();
    let got_bytes = std::fs::read(bf.path().join("model.safetensors")).unwrap();
    let got = SafeTensors::deserialize(&got_bytes).unwrap();
    assert_eq!(got.len(), orig.len());
    for n in orig.names() {
        assert!(
            orig.tensor(n).unwrap().data() == got.tensor(n).unwrap().data(),
            "{n}"
        );
    }
    assert!(!bf.path().join("hf_quant_config.json").exists());

    // GGUF → NVFP4: ModelOpt's export.
    let q = quantize(&gguf, OutputFormat::Nvfp4);
    check_against_modelopt(q.path());

    // config.json describes the same model as ModelOpt's.
    let a = LlamaConfig::from_dir(q.path()).unwrap();
    let mut b = LlamaConfig::from_dir(data()).unwrap();
    b.dtype = a.dtype.clone();
    b.eos_token_ids = a.eos_token_ids.clone();
    b.max_position_embeddings = a.max_position_embeddings;
    assert_eq!(a, b);

    // The tokenizer built from the GGUF metadata: digits one by one, merges applied,
    // special tokens whole, ChatML with the template's default system prompt.
    let t = TextTokenizer::from_dir(q.path(), &a).unwrap();
    assert_eq!(
        t.template,
        Some(ChatTemplate::ChatMl {
            default_system: Some("You are a tiny test model".into())
        })
    );
    assert!(t.is_eos(2) && t.is_eos(0), "{:?}", t.eos_ids);
    let ids = t.encode("hello 2012", true).unwrap();
    let toks: Vec<String> = ids
        .iter()
        .map(|&i| t.tokenizer().id_to_token(i).unwrap())
        .collect();
    let sp = byte_chars()[b' ' as usize];
    assert_eq!(
        toks,
        ["he", "llo", &format!("{sp}"), "2", "0", "1", "2"].map(String::from)
    );
    assert_eq!(t.decode(&ids).unwrap(), "hello 2012");
    let chat = t.prompt_ids("hi", false, None).unwrap();
    assert_eq!(
        t.decode(&chat).unwrap(),
        "system\nYou are a tiny test model\nuser\nhi\nassistant\n"
    );
    assert_eq!(chat[0], 1);
    assert_eq!(t.prompt_ids("hi", true, None).unwrap().len(), 2);
}

#[test]
fn extra_exclusions_stay_bf16_and_load() {
    let src = bf16_dir();
    let out = tempfile::tempdir().unwrap();
    let opts = QuantizeOptions {
        format: OutputFormat::Nvfp4,
        exclude: vec![
            "*.down_proj".into(),
            "model.layers.0.self_attn.k_proj".into(),
        ],
        ..Default::default()
    };
    let s = quantize_model(src.path(), out.path(), &opts, &mut |_| {}).unwrap();
    // k_proj excluded keeps all of q|k|v in BF16 (one shared global scale or none).
    assert_eq!(s.quantized, 14 - 2 - 3);
    let hq = json(&out.path().join("hf_quant_config.json"));
    assert_eq!(
        hq["quantization"]["exclude_modules"],
        serde_json::json!([
            "lm_head",
            "model.embed_tokens",
            "*.down_proj",
            "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.v_proj"
        ])
    );
    let bytes = std::fs::read(out.path().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        st.tensor("model.layers.1.mlp.down_proj.weight")
            .unwrap()
            .dtype(),
        safetensors::Dtype::BF16
    );
    assert_eq!(
        st.tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .dtype(),
        safetensors::Dtype::BF16
    );
    assert_eq!(
        st.tensor("model.layers.1.self_attn.q_proj.weight")
            .unwrap()
            .dtype(),
        safetensors::Dtype::U8
    );
    let m = Llama::load(out.path(), &Device::Cpu, &LoadOptions::default()).unwrap();
    assert_eq!(m.nvfp4_layer_count(), (5, 9));
}

#[test]
fn f32_and_f16_checkpoints_quantize() {
    // The same BF16 values stored as F32 (exact) quantize to ModelOpt's bytes; unquantized
    // tensors keep the stored dtype.
    let w =
        candle_core::safetensors::load(data().join("original.safetensors"), &Device::Cpu).unwrap();
    let theirs_bytes = std::fs::read(data().join("model.safetensors")).unwrap();
    let theirs = SafeTensors::deserialize(&theirs_bytes).unwrap();
    for dt in [DType::F32, DType::F16] {
        let d = bf16_dir();
        let conv: std::collections::HashMap<String, Tensor> = w
            .iter()
            .map(|(n, t)| (n.clone(), t.to_dtype(dt).unwrap()))
            .collect();
        candle_core::safetensors::save(&conv, d.path().join("model.safetensors")).unwrap();
        let out = quantize(d.path(), OutputFormat::Nvfp4);
        let bytes = std::fs::read(out.path().join("model.safetensors")).unwrap();
        let mine = SafeTensors::deserialize(&bytes).unwrap();
        let st_dt = if dt == DType::F32 {
            safetensors::Dtype::F32
        } else {
            safetensors::Dtype::F16
        };
        for n in theirs.names() {
            if n.ends_with(".input_scale") {
                continue;
            }
            let (a, b) = (theirs.tensor(n).unwrap(), mine.tensor(n).unwrap());
            assert_eq!(b.shape(), a.shape(), "{n}");
            if a.dtype() == safetensors::Dtype::BF16 {
                assert_eq!(b.dtype(), st_dt, "{n}");
            } else if dt == DType::F32 {
                assert!(a.data() == b.data(), "{n} (F32 input): bytes differ");
            }
        }
        // F16 rounds the fixture's planted ~1e-6 weights, so only check it runs.
        let mut m = Llama::load(out.path(), &Device::Cpu, &LoadOptions::default()).unwrap();
        assert_eq!(m.nvfp4_layer_count(), (8, 9));
        m.forward(&[1, 2, 3], 0).unwrap();
    }
}
