//! Every input the fuzzers found a crash with (`fuzz/regressions/<target>/`), replayed
//! through the same entry points as the fuzz target, plus a minimal reproduction of each
//! bug as a typed-error check; and (ignored) the writer of the fuzzers' seed corpora.

use candle_core::quantized::gguf_file::Value;
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

/// Writes the fuzzers' seed corpora (`fuzz/seeds/<target>/`) from the fixtures; run by hand
/// when the formats change: `cargo test -p candle-fp4-models --test hostile_inputs --
/// --ignored write_fuzz_seeds` (with `SMOLLM2_GGUF=path` to add a prefix of the real
/// SmolLM2 GGUF). Every seed written is checked to parse (or, for the prefix, to fail
/// cleanly).
#[test]
#[ignore]
fn write_fuzz_seeds() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds");
    let put = |target: &str, name: &str, bytes: &[u8]| {
        let d = root.join(target);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(name), bytes).unwrap();
    };
    let tiny = |f: &str| std::fs::read(data().join(f)).unwrap();
    let w4a16 = |f: &str| std::fs::read(data().join("../modelopt_tiny_w4a16").join(f)).unwrap();
    // Index files.
    let mut map = serde_json::Map::new();
    for (i, n) in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "lm_head.weight",
    ]
    .iter()
    .enumerate()
    {
        map.insert(
            n.to_string(),
            format!("model-0000{}-of-00002.safetensors", 1 + i / 2).into(),
        );
    }
    let idx = serde_json::json!({"metadata": {"total_size": 123456}, "weight_map": map});
    put("checkpoint_index", "index.json", idx.to_string().as_bytes());
    put(
        "checkpoint_index",
        "traversal.json",
        br#"{"weight_map": {"a": "../../x.safetensors", "b": "/etc/passwd"}}"#,
    );
    // Safetensors: an NVFP4 layer `l`, a BF16 one, a norm vector.
    let q = candle_fp4::nvfp4::quantize_nvfp4_slice(
        &(0..64).map(|i| i as f32 - 30.0).collect::<Vec<_>>(),
        2,
        32,
        None,
    )
    .unwrap();
    let st = |tensors: Vec<(&str, Tensor)>| {
        let map: std::collections::HashMap<String, Tensor> = tensors
            .into_iter()
            .map(|(n, t)| (n.to_string(), t))
            .collect();
        let p = tempfile::NamedTempFile::new().unwrap();
        candle_core::safetensors::save(&map, p.path()).unwrap();
        std::fs::read(p.path()).unwrap()
    };
    let cpu = Device::Cpu;
    let (codes, scales) = q.to_tensors(&cpu).unwrap();
    let nvfp4 = st(vec![
        ("l.weight", codes),
        ("l.weight_scale", scales.to_dtype(DType::U8).unwrap()),
        (
            "l.weight_scale_2",
            Tensor::new(q.global_scale, &cpu).unwrap(),
        ),
    ]);
    put("safetensors_header", "nvfp4_layer.safetensors", &nvfp4);
    let bf = st(vec![
        (
            "l.weight",
            Tensor::ones((4, 16), DType::BF16, &cpu).unwrap(),
        ),
        ("l.bias", Tensor::zeros(4, DType::F32, &cpu).unwrap()),
    ]);
    put("safetensors_header", "bf16_layer.safetensors", &bf);
    put(
        "safetensors_header",
        "vector.safetensors",
        &st(vec![(
            "model.norm.weight",
            Tensor::ones(8, DType::F16, &cpu).unwrap(),
        )]),
    );
    for b in [&nvfp4, &bf] {
        candle_fp4::checkpoint::Checkpoint::from_buffer(b.clone(), "seed").unwrap();
    }
    // Quant configs (first byte: which module name the target matches).
    for (n, b) in [
        ("hf_nvfp4.json", tiny("hf_quant_config.json")),
        ("hf_w4a16.json", w4a16("hf_quant_config.json")),
        ("config_nvfp4.json", tiny("config.json")),
        ("config_w4a16.json", w4a16("config.json")),
    ] {
        put("quant_config", n, &[[0u8].as_slice(), &b].concat());
    }
    // Llama configs, including the transformers 4 form with llama3 rope scaling.
    put("llama_config", "tiny.json", &tiny("config.json"));
    put("llama_config", "w4a16.json", &w4a16("config.json"));
    let v4 = r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "rope_theta": 500000.0, "eos_token_id": [128001, 128008, 128009], "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
    put("llama_config", "llama31_v4.json", v4.as_bytes());
    // GGUF: a one-block Llama, and (optional) a prefix of the real SmolLM2 file.
    let mut md = gguf_metadata();
    set(&mut md, "llama.block_count", Value::U32(1));
    let g = gguf_from(&md, &gguf_tensors(1));
    let model = GgufModel::from_bytes(g.clone(), "seed").unwrap();
    put("gguf_llama", "tiny1.gguf", &g);
    put(
        "llama_config",
        "from_gguf.json",
        model.config_json().unwrap().to_string().as_bytes(),
    );
    if let Some(p) = std::env::var_os("SMOLLM2_GGUF") {
        let b = std::fs::read(p).unwrap();
        let prefix = b[..32768].to_vec();
        assert!(GgufModel::from_bytes(prefix.clone(), "prefix").is_err());
        put("gguf_llama", "smollm2_prefix.gguf", &prefix);
    }
    // Tokenizer files, 0xFF-separated: tokenizer.json, tokenizer_config.json, template,
    // generation_config.json.
    let tj = model.tokenizer_json().unwrap().to_string();
    let tc = model.tokenizer_config_json().unwrap().to_string();
    let gc = model.generation_config_json().unwrap().to_string();
    let joined = [
        tj.as_bytes(),
        &[0xFF],
        tc.as_bytes(),
        &[0xFF],
        b"{{ '<|im_start|>' }}",
        &[0xFF],
        gc.as_bytes(),
    ]
    .concat();
    put("tokenizer", "gguf_bpe", &joined);
    let t = tempfile::tempdir().unwrap();
    write_byte_tokenizer(t.path());
    put(
        "tokenizer",
        "byte_level",
        &std::fs::read(t.path().join("tokenizer.json")).unwrap(),
    );
}
