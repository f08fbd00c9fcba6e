//! Hostile model folders, configs, GGUFs and load options through the models crate: every
//! case is an error of the exact typed kind (never message text), no panic escapes, and
//! nothing hangs (each call runs under a timeout).

use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device, Tensor};
use candle_fp4::error::{CheckpointError, SizeError};
use candle_fp4_models::errors::{find, ConfigError, GgufError, NumericError};
use candle_fp4_models::gguf::GgufModel;
use candle_fp4_models::sampling::Sampler;
use candle_fp4_models::tokenizer::TextTokenizer;
use candle_fp4_models::{Llama, LlamaConfig, LoadOptions};
use std::path::{Path, PathBuf};

mod hostile;
use hostile::*;

/// `Llama::load(dir, opts)` under [`guarded`].
fn load(dir: &Path, opts: LoadOptions) -> anyhow::Result<Llama> {
    let dir = dir.to_path_buf();
    guarded(move || Llama::load(&dir, &Device::Cpu, &opts))
}

fn load_err(dir: &Path) -> anyhow::Error {
    load(dir, LoadOptions::default()).unwrap_err()
}

fn config_err(e: &anyhow::Error) -> ConfigError {
    find::<ConfigError>(e)
        .unwrap_or_else(|| panic!("not a ConfigError: {e:#}"))
        .clone()
}

#[test]
fn config_sizes_never_wrap() {
    // 2^58 + 3 heads of 64: (nh + 2·nkv)·hd wrapped to 192 before ("the config needs [0, 192]").
    let d = tiny_with(|c| {
        c.insert("num_attention_heads".into(), ((1u64 << 58) + 3).into());
        c.insert("num_key_value_heads".into(), ((1u64 << 58) + 3).into());
    });
    let e = load_err(d.path());
    match config_err(&e) {
        ConfigError::Overflow { expr, .. } => {
            assert!(expr.contains("288230376151711747"), "{expr}")
        }
        other => panic!("{other:?}"),
    }
    for (key, v) in [
        ("vocab_size", u64::MAX / 2),
        ("intermediate_size", 1 << 63),
        ("num_attention_heads", 1 << 60),
    ] {
        let d = tiny_with(|c| {
            c.insert(key.into(), v.into());
            c.insert("num_key_value_heads".into(), 1.into());
        });
        assert!(
            matches!(
                config_err(&load_err(d.path())),
                ConfigError::Overflow { .. }
            ),
            "{key}"
        );
    }
}

#[test]
fn layer_count_must_match_the_weights() {
    // 1 on a 2-layer checkpoint dropped a layer silently; 3 said "missing tensor"; 1e15
    // and 1e18 aborted ("capacity overflow").
    for n in [
        1u64,
        3,
        1_000_000_000_000_000,
        1_000_000_000_000_000_000,
        u64::MAX,
    ] {
        let d = tiny_with(|c| {
            c.insert("num_hidden_layers".into(), n.into());
        });
        match config_err(&load_err(d.path())) {
            ConfigError::LayerCountMismatch { config, found, .. } => {
                assert_eq!((config, found), (n, 2))
            }
            other => panic!("{n}: {other:?}"),
        }
    }
    // A float where a count belongs.
    let d = tiny_with(|c| {
        c.insert("num_hidden_layers".into(), serde_json::json!(1e15));
    });
    assert!(matches!(
        config_err(&load_err(d.path())),
        ConfigError::BadField { .. }
    ));
}

#[test]
fn numeric_fields_out_of_range() {
    let cases: Vec<(&str, serde_json::Value)> = vec![
        ("rms_norm_eps", (-1).into()),
        ("rms_norm_eps", 0.into()),
        ("rms_norm_eps", 2.into()),
        ("rms_norm_eps", "NaN".into()),
        ("max_position_embeddings", 0.into()),
        ("head_dim", 0.into()),
        ("head_dim", 63.into()),
        ("head_dim", (1u64 << 17).into()),
        ("num_key_value_heads", 0.into()),
        ("num_key_value_heads", 2.into()),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "default", "rope_theta": -1.0}),
        ),
        ("rope_parameters", serde_json::json!([1])),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "linear", "factor": -2.0}),
        ),
        ("eos_token_id", (-1).into()),
        ("bos_token_id", (1u64 << 40).into()),
        ("hidden_size", (-192).into()),
        ("hidden_size", 192.5.into()),
        ("tie_word_embeddings", "yes".into()),
    ];
    for (key, v) in cases {
        let d = tiny_with(|c| {
            c.insert(key.into(), v.clone());
        });
        let e = load(d.path(), LoadOptions::default())
            .err()
            .unwrap_or_else(|| panic!("{key} = {v}: loaded"));
        match config_err(&e) {
            ConfigError::BadField { field, .. } => {
                let want = match key {
                    "rope_parameters" if v.is_object() => "rope_theta",
                    "rope_scaling" => "factor",
                    k => k,
                };
                assert_eq!(field, want, "{key} = {v}")
            }
            other => panic!("{key} = {v}: {other:?}"),
        }
    }
}

#[test]
fn every_config_field_mutated_is_a_typed_error_or_loads() {
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data().join("config.json")).unwrap())
            .unwrap();
    let keys: Vec<String> = base.as_object().unwrap().keys().cloned().collect();
    let values: Vec<serde_json::Value> = serde_json::from_str(
        r#"[0, -1, 1, 1.5, 1e300, 18446744073709551615, 9223372036854775808, "x", null, true, [], {}, [1, 2]]"#,
    )
    .unwrap();
    let mut typed = 0;
    for key in &keys {
        for v in &values {
            let d = tiny_with(|c| {
                c.insert(key.clone(), v.clone());
            });
            match load(d.path(), LoadOptions::default()) {
                Ok(_) => {}
                Err(e) => {
                    let known = find::<ConfigError>(&e).is_some()
                        || find::<CheckpointError>(&e).is_some()
                        || find::<SizeError>(&e).is_some();
                    // Every error must be typed (the quant config, which keeps its own
                    // messages, comes from hf_quant_config.json here).
                    assert!(known, "{key} = {v}: untyped error {e:#}");
                    typed += usize::from(known);
                }
            }
        }
    }
    assert!(typed > 100, "only {typed} typed errors");
}

#[test]
fn context_longer_than_the_model_needs_an_override() {
    let d = tiny_with(|_| {});
    // 1e12 aborted in Rope::new (128 TB); 2^59 wrapped to 0 and grew until OOM; 129 was
    // accepted although max_position_embeddings is 128.
    for n in [1_000_000_000_000usize, 1 << 59, usize::MAX, 129] {
        let opts = LoadOptions {
            max_seq_len: Some(n),
            ..Default::default()
        };
        match config_err(&load(d.path(), opts).unwrap_err()) {
            ConfigError::ContextTooLong {
                requested,
                max_position_embeddings,
                ..
            } => {
                assert_eq!((requested, max_position_embeddings), (n as u64, 128))
            }
            other => panic!("{n}: {other:?}"),
        }
    }
    let zero = LoadOptions {
        max_seq_len: Some(0),
        ..Default::default()
    };
    assert!(matches!(
        config_err(&load(d.path(), zero).unwrap_err()),
        ConfigError::BadOption { .. }
    ));
    // With the override, impossible sizes are errors, not aborts.
    for n in [1_000_000_000_000usize, 1 << 59, usize::MAX] {
        let opts = LoadOptions {
            max_seq_len: Some(n),
            allow_long_context: true,
            ..Default::default()
        };
        let e = load(d.path(), opts).unwrap_err();
        assert!(find::<SizeError>(&e).is_some(), "{n}: {e:#}");
    }
    // And a modest one runs past position 128.
    let opts = LoadOptions {
        max_seq_len: Some(256),
        allow_long_context: true,
        ..Default::default()
    };
    let mut m = load(d.path(), opts).unwrap();
    let ids: Vec<u32> = (0..200).map(|i| i % 256).collect();
    assert_eq!(m.forward(&ids, 0).unwrap().dims(), [256]);
}

#[test]
fn missing_weights_are_never_replaced() {
    // Untied embeddings and no lm_head.weight: no silent fallback to the embedding.
    let d = bf16_with(|_| {});
    edit_weights(d.path(), |w| w.retain(|(n, _)| n != "lm_head.weight"));
    match find::<CheckpointError>(&load_err(d.path())) {
        Some(CheckpointError::MissingTensor { tensor, .. }) => assert_eq!(tensor, "lm_head.weight"),
        other => panic!("{other:?}"),
    }
    // A bias the config promises.
    for key in ["attention_bias", "mlp_bias"] {
        let d = bf16_with(|c| {
            c.insert(key.into(), true.into());
        });
        assert!(
            matches!(
                find::<CheckpointError>(&load_err(d.path())),
                Some(CheckpointError::MissingTensor { .. })
            ),
            "{key}"
        );
    }
    // A wrong embedding shape names the tensor.
    let d = bf16_with(|c| {
        c.insert("vocab_size".into(), 255.into());
    });
    assert!(
        matches!(config_err(&load_err(d.path())), ConfigError::ShapeMismatch { tensor, .. } if tensor == "model.embed_tokens.weight")
    );
}

#[test]
fn bad_block_scales_name_the_tensor_and_index() {
    let d = tiny_with(|_| {});
    let name = "model.layers.1.mlp.down_proj.weight_scale";
    edit_raw(d.path(), name, |b| b[45] = 0xC0); // -2.0: row 2 of [192, 20], block 5
    match find::<CheckpointError>(&load_err(d.path())) {
        Some(CheckpointError::BadBlockScale {
            tensor,
            index,
            row,
            block,
            ..
        }) => {
            assert_eq!((tensor.as_str(), *index, *row, *block), (name, 45, 2, 5))
        }
        other => panic!("{other:?}"),
    }
}

#[cfg(unix)]
#[test]
fn model_folder_files_cannot_escape_or_block() {
    use std::os::unix::fs::symlink;
    let secret = tempfile::tempdir().unwrap();
    std::fs::copy(
        data().join("config.json"),
        secret.path().join("config.json"),
    )
    .unwrap();
    // An index that points out of the folder (the weights exist there: still refused).
    let d = tiny_with(|_| {});
    std::fs::rename(
        d.path().join("model.safetensors"),
        secret.path().join("model.safetensors"),
    )
    .unwrap();
    let rel = format!(
        "../{}/model.safetensors",
        secret.path().file_name().unwrap().to_str().unwrap()
    );
    let idx = serde_json::json!({"weight_map": {"model.embed_tokens.weight": rel}});
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        idx.to_string(),
    )
    .unwrap();
    assert!(matches!(
        find::<CheckpointError>(&load_err(d.path())),
        Some(CheckpointError::PathOutsideFolder { .. })
    ));
    // config.json as a symlink out of the folder, or a FIFO.
    let d = tiny_with(|_| {});
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    symlink(
        secret.path().join("config.json"),
        d.path().join("config.json"),
    )
    .unwrap();
    assert!(matches!(
        find::<CheckpointError>(&load_err(d.path())),
        Some(CheckpointError::PathOutsideFolder { .. })
    ));
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    mkfifo(&d.path().join("config.json"));
    assert!(matches!(
        find::<CheckpointError>(&load_err(d.path())),
        Some(CheckpointError::NotARegularFile { .. })
    ));
    // Tokenizer files: a FIFO, a symlink out.
    let d = tiny_with(|_| {});
    let cfg = LlamaConfig::from_dir(d.path()).unwrap();
    for (name, fifo) in [
        ("tokenizer.json", true),
        ("tokenizer_config.json", false),
        ("generation_config.json", true),
    ] {
        let t = tempfile::tempdir().unwrap();
        write_byte_tokenizer(t.path());
        if fifo {
            let _ = std::fs::remove_file(t.path().join(name));
            mkfifo(&t.path().join(name));
        } else {
            symlink(secret.path().join("config.json"), t.path().join(name)).unwrap();
        }
        let (p, c) = (t.path().to_path_buf(), cfg.clone());
        let e = guarded(move || TextTokenizer::from_dir(&p, &c)).unwrap_err();
        assert!(
            matches!(
                find::<CheckpointError>(&e),
                Some(
                    CheckpointError::NotARegularFile { .. }
                        | CheckpointError::PathOutsideFolder { .. }
                )
            ),
            "{name}: {e:#}"
        );
    }
}

#[test]
fn tokenizers_from_garbage_are_errors() {
    let cfg = LlamaConfig::from_dir(data()).unwrap();
    for (tok, tc, gc) in [
        ("", None, None),
        ("{", None, None),
        (
            r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}"#,
            None,
            None,
        ),
        ("{}", Some("[1]"), None),
        (
            r#"{"version":"1.0","model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"}}"#,
            Some("{"),
            None,
        ),
        (
            r#"{"version":"1.0","model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"}}"#,
            None,
            Some(r#"{"eos_token_id": -3}"#),
        ),
    ] {
        let c = cfg.clone();
        let r = guarded(move || TextTokenizer::from_parts(tok, tc, None, gc, &c, "garbage"));
        assert!(r.is_err(), "{tok} {tc:?} {gc:?}");
    }
    // NaN logits: an error from the sampler and a typed one from the check the tools use.
    let mut s = Sampler::new(0.0, 0.9, 1).unwrap();
    assert!(s.sample_slice(&[0.0, f32::NAN]).is_err());
    let e = candle_fp4_models::errors::check_finite_logits(&[0.0, 1.0, f32::INFINITY], || {
        "step 3".into()
    });
    assert!(matches!(
        e,
        Err(NumericError::NonFiniteLogits { id: 2, .. })
    ));
}

/// A GGUF written to a temp file and opened, plus the same from bytes.
fn gguf_open(bytes: Vec<u8>) -> [anyhow::Result<GgufModel>; 2] {
    let d = tempfile::tempdir().unwrap();
    let p: PathBuf = d.path().join("m.gguf");
    std::fs::write(&p, &bytes).unwrap();
    let a = guarded(move || {
        let _keep = d;
        GgufModel::open(&p)
    });
    let b = guarded(move || GgufModel::from_bytes(bytes, "bytes"));
    [a, b]
}

#[test]
fn gguf_metadata_that_divides_by_zero_or_grows_without_bound() {
    // The valid file opens and converts.
    for g in gguf_open(gguf_bytes(|_| {})) {
        let g = g.unwrap();
        let cfg =
            LlamaConfig::from_json_str(&g.config_json().unwrap().to_string(), "gguf").unwrap();
        assert_eq!((cfg.num_hidden_layers, cfg.head_dim), (2, 16));
        let tj = g.tokenizer_json().unwrap().to_string();
        TextTokenizer::from_parts(&tj, None, None, None, &cfg, "gguf").unwrap();
        assert_eq!(
            g.tensor_f32("model.layers.1.self_attn.k_proj.weight")
                .unwrap()
                .dims(),
            [16, 32]
        );
    }
    let u = Value::U32;
    let cases: Vec<(&str, Value)> = vec![
        ("llama.attention.head_count", u(0)),
        ("llama.attention.head_count_kv", u(0)),
        ("llama.block_count", u(0)),
        ("llama.attention.head_count", Value::F32(2.0)),
        ("llama.attention.head_count", Value::I32(-2)),
        ("general.alignment", u(0)),
        ("general.alignment", Value::U8(0)),
    ];
    for (key, v) in cases {
        for r in gguf_open(gguf_bytes(|md| set(md, key, v.clone()))) {
            let e = r.err().unwrap_or_else(|| panic!("{key}: opened"));
            match find::<GgufError>(&e) {
                Some(GgufError::BadMetadata { key: k, .. }) => assert_eq!(k, key),
                other => panic!("{key} = {v:?}: {other:?} / {e:#}"),
            }
        }
    }
    // block_count 4e9 grew memory without bound (hf_names); now it must match the blocks.
    for n in [1u32, 3, 4_000_000_000] {
        for r in gguf_open(gguf_bytes(|md| set(md, "llama.block_count", u(n)))) {
            let e = r.err().unwrap();
            assert!(
                matches!(find::<GgufError>(&e), Some(GgufError::LayerCountMismatch { block_count, found: 2, .. }) if *block_count == n as u64),
                "{e:#}"
            );
        }
    }
    let missing = gguf_bytes(|md| md.retain(|(k, _)| k != "llama.attention.head_count"));
    for r in gguf_open(missing) {
        assert!(matches!(
            find::<GgufError>(&r.err().unwrap()),
            Some(GgufError::MissingMetadata { .. })
        ));
    }
}

#[test]
fn gguf_structure_errors_are_typed() {
    let good = gguf_bytes(|_| {});
    // Truncations anywhere: an error, never a panic or a huge allocation.
    let step = (good.len() / 97).max(1);
    for cut in (0..good.len()).step_by(step) {
        for r in gguf_open(good[..cut].to_vec()) {
            assert!(r.is_err(), "cut {cut}");
        }
    }
    // A tensor whose data lies past the end of the file.
    let md = gguf_metadata();
    let mut t = gguf_tensors(2);
    t.push((
        "blk.0.extra.weight".into(),
        Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap(),
    ));
    let mut bytes = gguf_from(&md, &t);
    bytes.truncate(bytes.len() - 8);
    for r in gguf_open(bytes) {
        assert!(matches!(
            find::<GgufError>(&r.err().unwrap()),
            Some(GgufError::BadTensor { .. })
        ));
    }
    // A metadata array claiming 2^40 elements, a string longer than the file, a huge
    // tensor count: rejected by the prescan, before candle allocates.
    let mut v = good.clone();
    v[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes()); // tensor count
    for r in gguf_open(v) {
        assert!(matches!(
            find::<GgufError>(&r.err().unwrap()),
            Some(GgufError::Header { .. })
        ));
    }
    let key = b"tokenizer.ggml.tokens";
    let at = good.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // key, then value type u32 (9 = array), element type u32, then the u64 length.
    let mut v = good.clone();
    v[at + 8..at + 16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    for r in gguf_open(v) {
        assert!(matches!(
            find::<GgufError>(&r.err().unwrap()),
            Some(GgufError::Header { .. })
        ));
    }
    let mut v = good.clone();
    v[at - key.len() - 8..at - key.len()].copy_from_slice(&u64::MAX.to_le_bytes());
    for r in gguf_open(v) {
        assert!(matches!(
            find::<GgufError>(&r.err().unwrap()),
            Some(GgufError::Header { .. })
        ));
    }
}
