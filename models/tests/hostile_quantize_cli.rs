//! Hostile inputs to the quantizer (all-or-nothing output, no escape from the input
//! folder) and to the command-line tools (flags beyond the model's limits, non-finite
//! numbers). Library calls assert the typed error; the binaries, whose errors cross a
//! process boundary, must exit with status 1 (never a panic's 101 or an abort's signal)
//! and name the offending flag or value.

use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device, Tensor};
use candle_fp4::error::CheckpointError;
use candle_fp4_models::errors::{find, ConfigError, GgufError};
use candle_fp4_models::quant::{quantize_model, QuantizeOptions};
use candle_fp4_models::staging::OutputError;
use candle_fp4_models::{Llama, LoadOptions};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod hostile;
use hostile::*;

fn quantize(input: &Path, output: &Path) -> anyhow::Result<()> {
    let (i, o) = (input.to_path_buf(), output.to_path_buf());
    guarded(move || quantize_model(&i, &o, &QuantizeOptions::default(), &mut |_| {}).map(|_| ()))
}

/// The entries of `dir` (sorted names).
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[cfg(unix)]
#[test]
fn failed_quantization_leaves_no_output() {
    let src = bf16_with(|_| {});
    write_byte_tokenizer(src.path());
    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("q");
    // The tokenizer is copied last: it used to fail after model.safetensors and
    // config.json were written, and the rerun then said the folder was not empty.
    std::fs::remove_file(src.path().join("tokenizer.json")).unwrap();
    mkfifo(&src.path().join("tokenizer.json"));
    let e = quantize(src.path(), &dest).unwrap_err();
    assert!(
        matches!(
            find::<CheckpointError>(&e),
            Some(CheckpointError::NotARegularFile { .. })
        ),
        "{e:#}"
    );
    assert!(entries(out.path()).is_empty(), "{:?}", entries(out.path()));
    // Fixed input, same destination: it runs, and the output loads.
    std::fs::remove_file(src.path().join("tokenizer.json")).unwrap();
    write_byte_tokenizer(src.path());
    quantize(src.path(), &dest).unwrap();
    assert_eq!(entries(out.path()), ["q"]);
    assert!(entries(&dest).contains(&"tokenizer.json".to_string()));
    Llama::load(&dest, &Device::Cpu, &LoadOptions::default()).unwrap();
    // A second run into the full folder is refused and changes nothing.
    let before = std::fs::read(dest.join("model.safetensors")).unwrap();
    let e = quantize(src.path(), &dest).unwrap_err();
    assert!(matches!(
        find::<OutputError>(&e),
        Some(OutputError::NotEmpty { .. })
    ));
    assert_eq!(
        std::fs::read(dest.join("model.safetensors")).unwrap(),
        before
    );
    // A file in the way; an existing empty folder is fine.
    std::fs::write(out.path().join("file"), b"x").unwrap();
    let e = quantize(src.path(), &out.path().join("file")).unwrap_err();
    assert!(matches!(
        find::<OutputError>(&e),
        Some(OutputError::NotAFolder { .. })
    ));
    std::fs::create_dir(out.path().join("empty")).unwrap();
    quantize(src.path(), &out.path().join("empty")).unwrap();
    assert_eq!(entries(out.path()), ["empty", "file", "q"]);
}

#[cfg(unix)]
#[test]
fn quantizer_reads_nothing_outside_the_input_folder() {
    use std::os::unix::fs::symlink;
    let secret = tempfile::tempdir().unwrap();
    std::fs::write(secret.path().join("secret.json"), b"{\"password\": 1}").unwrap();
    // Shards listed outside the folder: their tensors were copied into the output.
    let src = bf16_with(|_| {});
    std::fs::rename(
        src.path().join("model.safetensors"),
        secret.path().join("w.safetensors"),
    )
    .unwrap();
    for name in [
        format!(
            "../{}/w.safetensors",
            secret.path().file_name().unwrap().to_str().unwrap()
        ),
        secret.path().join("w.safetensors").display().to_string(),
    ] {
        let idx = serde_json::json!({"weight_map": {"model.embed_tokens.weight": name}});
        std::fs::write(
            src.path().join("model.safetensors.index.json"),
            idx.to_string(),
        )
        .unwrap();
        let out = tempfile::tempdir().unwrap();
        let e = quantize(src.path(), &out.path().join("q")).unwrap_err();
        assert!(
            matches!(
                find::<CheckpointError>(&e),
                Some(CheckpointError::PathOutsideFolder { .. })
            ),
            "{e:#}"
        );
        assert!(entries(out.path()).is_empty());
    }
    // A tokenizer file that is a symlink out of the folder is not copied.
    let src = bf16_with(|_| {});
    symlink(
        secret.path().join("secret.json"),
        src.path().join("tokenizer_config.json"),
    )
    .unwrap();
    let out = tempfile::tempdir().unwrap();
    let e = quantize(src.path(), &out.path().join("q")).unwrap_err();
    assert!(
        matches!(
            find::<CheckpointError>(&e),
            Some(CheckpointError::PathOutsideFolder { .. })
        ),
        "{e:#}"
    );
    assert!(entries(out.path()).is_empty());
}

#[test]
fn quantizer_checks_the_config_against_the_weights_and_keeps_any_dtype() {
    let out = tempfile::tempdir().unwrap();
    let src = bf16_with(|c| {
        c.insert("num_hidden_layers".into(), 1.into());
    });
    let e = quantize(src.path(), &out.path().join("a")).unwrap_err();
    assert!(
        matches!(
            find::<ConfigError>(&e),
            Some(ConfigError::LayerCountMismatch {
                config: 1,
                found: 2,
                ..
            })
        ),
        "{e:#}"
    );
    assert!(entries(out.path()).is_empty());
    // An I32 buffer ("cannot write dtype I32", no tensor named) is now copied as it is.
    let src = bf16_with(|_| {});
    edit_weights(src.path(), |w| {
        w.push((
            "model.position_ids".into(),
            Tensor::new(&[0i32, 1, 2], &Device::Cpu).unwrap(),
        ))
    });
    let dest = out.path().join("b");
    quantize(src.path(), &dest).unwrap();
    let t = candle_core::safetensors::load(dest.join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(t["model.position_ids"].dtype(), DType::I32);
    assert_eq!(t["model.position_ids"].to_vec1::<i32>().unwrap(), [0, 1, 2]);
}

#[test]
fn quantizer_gguf_inputs() {
    let d = tempfile::tempdir().unwrap();
    let g = d.path().join("m.gguf");
    // head_count 0 divided by zero in config_json.
    std::fs::write(
        &g,
        gguf_bytes(|md| set(md, "llama.attention.head_count", Value::U32(0))),
    )
    .unwrap();
    let e = quantize(&g, &d.path().join("q")).unwrap_err();
    assert!(
        matches!(find::<GgufError>(&e), Some(GgufError::BadMetadata { .. })),
        "{e:#}"
    );
    assert_eq!(entries(d.path()), ["m.gguf"]);
    // The valid one converts and the result loads and runs.
    std::fs::write(&g, gguf_bytes(|_| {})).unwrap();
    quantize(&g, &d.path().join("q")).unwrap();
    let mut m = Llama::load(d.path().join("q"), &Device::Cpu, &LoadOptions::default()).unwrap();
    assert_eq!(m.forward(&[1, 2, 3], 0).unwrap().dims(), [8]);
}

/// A copy of the tiny NVFP4 model with a byte tokenizer, weights edited by `edit`.
fn runnable(edit: impl FnOnce(&mut Vec<(String, Tensor)>)) -> tempfile::TempDir {
    let d = tiny_with(|_| {});
    write_byte_tokenizer(d.path());
    edit_weights(d.path(), edit);
    d
}

fn run(bin: &str, args: &[&str]) -> Output {
    let exe = match bin {
        "decode" => env!("CARGO_BIN_EXE_llama_decode"),
        _ => env!("CARGO_BIN_EXE_perplexity"),
    };
    Command::new(exe).args(args).output().unwrap()
}

/// Exit status 1 (an error, not a panic or an abort) and `want` in stderr.
fn fails_with(o: &Output, want: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "status {:?}: {err}", o.status);
    let line = err.lines().find(|l| l.starts_with("error: "));
    assert!(
        line.is_some_and(|l| l.contains(want)),
        "want `{want}` in: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

fn text() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/text/alice_ch1-3.txt")
}

#[test]
fn cli_flags_beyond_the_model_are_errors() {
    let d = runnable(|_| {});
    let m = d.path().to_str().unwrap();
    // --max-tokens 0 emitted a token.
    let o = run(
        "decode",
        &[
            "--model",
            m,
            "--raw",
            "--prompt",
            "abc",
            "--max-tokens",
            "0",
        ],
    );
    fails_with(&o, "--max-tokens");
    assert!(o.stdout.is_empty());
    for n in ["0", "1000000000"] {
        let o = run(
            "decode",
            &["--model", m, "--raw", "--prompt", "abc", "--threads", n],
        );
        fails_with(&o, "--threads");
    }
    // Beyond max_position_embeddings (128): refused unless asked for; 1e12 aborted in
    // Rope::new and 2^59 wrapped to 0.
    for n in [
        "129",
        "1000000000000",
        "576460752303423488",
        "18446744073709551615",
    ] {
        let o = run(
            "decode",
            &["--model", m, "--raw", "--prompt", "abc", "--max-seq-len", n],
        );
        fails_with(&o, "max_position_embeddings 128");
        let o = run(
            "perplexity",
            &["--model", m, "--text", text().to_str().unwrap(), "--ctx", n],
        );
        fails_with(&o, "max_position_embeddings 128");
    }
    for n in ["1000000000000", "576460752303423488"] {
        let o = run(
            "decode",
            &[
                "--model",
                m,
                "--raw",
                "--prompt",
                "abc",
                "--allow-long-context",
                "--max-seq-len",
                n,
            ],
        );
        fails_with(&o, "Rope::new");
    }
    // Within the override it runs past position 128.
    let o = run(
        "perplexity",
        &[
            "--model",
            m,
            "--text",
            text().to_str().unwrap(),
            "--ctx",
            "160",
            "--max-windows",
            "1",
            "--allow-long-context",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("perplexity "));
}

#[test]
fn non_finite_logits_stop_the_tools() {
    // A NaN in the final norm makes every logit NaN: perplexity printed "perplexity NaN"
    // and exited 0.
    let d = runnable(|w| {
        let t = w
            .iter_mut()
            .find(|(n, _)| n == "model.norm.weight")
            .unwrap();
        t.1 = Tensor::full(f32::NAN, 192, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
    });
    let m = d.path().to_str().unwrap();
    let o = run(
        "perplexity",
        &[
            "--model",
            m,
            "--text",
            text().to_str().unwrap(),
            "--ctx",
            "32",
            "--max-windows",
            "1",
        ],
    );
    fails_with(&o, "window 1 (text token 0)");
    assert!(!String::from_utf8_lossy(&o.stdout).contains("NaN"));
    let o = run("decode", &["--model", m, "--raw", "--prompt", "abc"]);
    fails_with(&o, "the prompt's last token (position 2)");
}
