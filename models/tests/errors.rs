//! Things that must be clear errors, not panics: model folders missing files, configs
//! this port cannot run, prompts longer than the context; and the decode binary's exit
//! code and message for them.

use candle_core::Device;
use candle_fp4_models::{Llama, LlamaConfig, LoadOptions, RopeScaling};
use std::path::Path;
use std::process::Command;

mod common;
use common::data;

type JsonMap = serde_json::Map<String, serde_json::Value>;
type Edit = Box<dyn Fn(&mut JsonMap)>;

fn load_err(dir: &Path) -> String {
    let e = Llama::load(dir, &Device::Cpu, &LoadOptions::default()).unwrap_err();
    format!("{e:#}")
}

/// A copy of the tiny model folder with `edit` applied to its config.json.
fn with_config(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "hf_quant_config.json"] {
        std::fs::copy(data().join(f), d.path().join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data().join("config.json")).unwrap())
            .unwrap();
    edit(cfg.as_object_mut().unwrap());
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    d
}

#[test]
fn missing_files() {
    assert!(load_err(Path::new("/nonexistent/model")).contains("not a model folder"));
    let d = tempfile::tempdir().unwrap();
    assert!(
        load_err(d.path()).contains("config.json"),
        "{}",
        load_err(d.path())
    );
    std::fs::copy(data().join("config.json"), d.path().join("config.json")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("no model.safetensors"), "{e}");
    // A checkpoint that lacks a tensor names it.
    let w =
        candle_core::safetensors::load(data().join("original.safetensors"), &Device::Cpu).unwrap();
    let mut w: Vec<(String, candle_core::Tensor)> = w.into_iter().collect();
    w.retain(|(n, _)| n != "model.layers.1.mlp.down_proj.weight");
    let map: std::collections::HashMap<String, candle_core::Tensor> = w.into_iter().collect();
    candle_core::safetensors::save(&map, d.path().join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data().join("config.json")).unwrap())
            .unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model.layers.1.mlp.down_proj.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn configs_this_port_cannot_run() {
    let cases: Vec<(&str, Edit)> = vec![
        (
            "model_type `mistral`",
            Box::new(|c| {
                c.insert("model_type".into(), "mistral".into());
            }),
        ),
        (
            "hidden_act `gelu`",
            Box::new(|c| {
                c.insert("hidden_act".into(), "gelu".into());
            }),
        ),
        (
            "rope_type `yarn`",
            Box::new(|c| {
                c.insert(
                    "rope_parameters".into(),
                    serde_json::json!({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
                );
            }),
        ),
        (
            "missing `hidden_size`",
            Box::new(|c| {
                c.remove("hidden_size");
            }),
        ),
        (
            "not a multiple of num_key_value_heads",
            Box::new(|c| {
                c.insert("num_key_value_heads".into(), 2.into());
            }),
        ),
        (
            "the config needs",
            Box::new(|c| {
                c.insert("intermediate_size".into(), 256.into());
            }),
        ),
        (
            "quant_algo `FP8` is not supported",
            Box::new(|c| {
                c.insert(
                    "quantization_config".into(),
                    serde_json::json!({"quant_method": "modelopt", "quant_algo": "FP8"}),
                );
            }),
        ),
    ];
    for (want, edit) in cases {
        let d = with_config(edit);
        if want.contains("FP8") {
            std::fs::remove_file(d.path().join("hf_quant_config.json")).unwrap();
        }
        let e = load_err(d.path());
        assert!(e.contains(want), "expected `{want}` in: {e}");
    }
    let bad_json = with_config(|_| {});
    std::fs::write(bad_json.path().join("config.json"), "{ not json").unwrap();
    assert!(load_err(bad_json.path()).contains("invalid JSON"));
}

#[test]
fn prompt_longer_than_context() {
    let opts = LoadOptions {
        max_seq_len: Some(8),
        ..Default::default()
    };
    let mut m = Llama::load(data(), &Device::Cpu, &opts).unwrap();
    let ids: Vec<u32> = (0..12).collect();
    let e = m.forward(&ids, 0).unwrap_err().to_string();
    assert!(e.contains("exceed the context of 8 tokens"), "{e}");
    // Within the context it runs; then one step too many is an error too.
    m.forward(&ids[..8], 0).unwrap();
    assert!(m
        .forward(&[1], 8)
        .unwrap_err()
        .to_string()
        .contains("exceed the context"));
    assert!(m
        .forward(&[1], 9)
        .unwrap_err()
        .to_string()
        .contains("past the 8 cached tokens"));
    assert!(m
        .forward(&[300], 0)
        .unwrap_err()
        .to_string()
        .contains("outside the vocabulary"));
    assert!(m.forward(&[], 0).is_err());
}

#[test]
fn config_forms_and_rope_scaling() {
    // transformers 4 and 5 spellings of the same Llama 3.1 config parse the same.
    let v4 = r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16", "rope_theta": 500000.0, "eos_token_id": [128001, 128008, 128009],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
    let v5 = r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "dtype": "bfloat16", "eos_token_id": [128001, 128008, 128009],
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
    let a = LlamaConfig::from_json_str(v4, "v4").unwrap();
    let b = LlamaConfig::from_json_str(v5, "v5").unwrap();
    assert_eq!(a, b);
    assert_eq!(a.head_dim, 128);
    assert_eq!(a.eos_token_ids, [128001, 128008, 128009]);
    assert!(matches!(a.rope_scaling, RopeScaling::Llama3 { .. }));
    // transformers 5.14's ROPE_INIT_FUNCTIONS["llama3"] for this config, every 8th value.
    let want: [u32; 8] = [
        0x3f800000, 0x3e4693b0, 0x3d1a08c8, 0x3beef74f, 0x3a0995d2, 0x380fc8f8, 0x36df10c4,
        0x35ad07a7,
    ];
    let f = candle_fp4_models::rope::inv_freq(&a);
    assert_eq!(f.len(), 64);
    for (i, w) in want.iter().enumerate() {
        let w = f32::from_bits(*w);
        assert!(
            (f[i * 8] - w).abs() <= 2e-6 * w,
            "inv_freq[{}] = {} vs {w}",
            i * 8,
            f[i * 8]
        );
    }
    // Old-style `type` key and linear scaling.
    let lin = v4.replace(r#""rope_type": "llama3""#, r#""type": "linear""#);
    let c = LlamaConfig::from_json_str(&lin, "lin").unwrap();
    assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
}

fn decode_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_llama_decode"))
}

#[test]
fn decode_binary_reports_errors_with_exit_code() {
    // Folder without the model files.
    let d = tempfile::tempdir().unwrap();
    let o = decode_bin()
        .args(["--model", d.path().to_str().unwrap(), "--prompt", "hi"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.starts_with("error: ") && err.contains("config.json"),
        "{err}"
    );
    assert!(!err.contains("panicked"));
    // Nonexistent folder.
    let o = decode_bin()
        .args(["--model", "/nonexistent/dir"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no such folder"));
    // The tiny model has no tokenizer.
    let o = decode_bin()
        .args(["--model", data().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no tokenizer.json"));
    // Bad flags are clap errors (exit code 2).
    let o = decode_bin().args(["--kv-cache", "fp8"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn decode_binary_prompt_too_long() {
    // The tiny model + a byte-level tokenizer from the quantizer's GGUF test is more
    // than we need: a hand-made tokenizer.json (every byte a token) does it.
    let d = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "hf_quant_config.json", "config.json"] {
        std::fs::copy(data().join(f), d.path().join(f)).unwrap();
    }
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .filter(|b| b.is_ascii_graphic())
        .map(|b| ((b as char).to_string(), (b as u64).into()))
        .collect();
    let tok = serde_json::json!({"version": "1.0", "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": false},
        "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "unk_token": null}});
    std::fs::write(d.path().join("tokenizer.json"), tok.to_string()).unwrap();
    let dir = d.path().to_str().unwrap();
    let o = decode_bin()
        .args([
            "--model",
            dir,
            "--raw",
            "--max-seq-len",
            "16",
            "--prompt",
            "abcdefghijklmnopqrstuvwxyz",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("the prompt is 26 tokens long but the context holds 16"),
        "{err}"
    );
    // A short prompt generates (random weights: any text) and prints the speed line.
    let o = decode_bin()
        .args([
            "--model",
            dir,
            "--raw",
            "--max-tokens",
            "5",
            "--prompt",
            "abc",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap();
    assert!(
        last.starts_with("prompt: 3 tokens") && last.contains("tokens/s | decode: "),
        "{out}"
    );
}
