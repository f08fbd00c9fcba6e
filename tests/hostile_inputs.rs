//! Hostile inputs to the library: model folders that try to escape, block, lie or overflow,
//! and quantizer arguments that used to wrap (the KV caches: `hostile_kv_cache.rs`). Each
//! case asserts the exact kind of error (the typed variant, never message text) and that
//! no panic escapes; loads run under a timeout so that a hang fails the test instead of
//! blocking it.

use candle_core::{DType, Device};
use candle_fp4::checkpoint::{Checkpoint, ShardIndex};
use candle_fp4::error::{find, CheckpointError, QuantizeError, SizeError};
use candle_fp4::nvfp4::quantize_nvfp4_slice;
use candle_fp4::quant_config::QuantConfig;
use candle_fp4::quant_linear::QuantLinear;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/modelopt_tiny")
}

/// Runs `f` on another thread; fails the test if it panics or takes longer than 30 s.
fn guarded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = catch_unwind(AssertUnwindSafe(f));
        let _ = tx.send(r);
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Ok(v)) => v,
        Ok(Err(_)) => panic!("a panic escaped the library"),
        Err(_) => panic!("the call hung (no answer in 30 s)"),
    }
}

/// Both readers of `path` (mmap and in-memory), each under [`guarded`].
fn both(path: &Path) -> [Result<Checkpoint, CheckpointError>; 2] {
    let (a, b) = (path.to_path_buf(), path.to_path_buf());
    // SAFETY: the test's files are not modified while mapped.
    [
        guarded(move || unsafe { Checkpoint::open(&a) }),
        guarded(move || Checkpoint::read(&b)),
    ]
}

/// A safetensors file of `tensors` (name, dtype, shape, bytes).
fn safetensors_bytes(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn one_tensor(name: &str) -> Vec<u8> {
    safetensors_bytes(&[(name, Dtype::F32, vec![2], vec![0; 8])])
}

fn write_index(dir: &Path, map: serde_json::Value) {
    let idx = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), idx.to_string()).unwrap();
}

#[cfg(unix)]
fn mkfifo(p: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

#[test]
fn index_names_must_be_plain_files_inside_the_folder() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("x.safetensors"), one_tensor("a")).unwrap();
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("a").join("b");
    std::fs::create_dir_all(model.join("sub")).unwrap();
    std::fs::write(model.join("sub/s.safetensors"), one_tensor("a")).unwrap();
    std::fs::write(d.path().join("x.safetensors"), one_tensor("a")).unwrap();
    let escape = outside.path().join("x.safetensors");
    // Traversal, absolute paths (existing and not: the same error), separators, `..`,
    // empty and NUL names: refused before any file is touched.
    for name in [
        "../../x.safetensors",
        escape.to_str().unwrap(),
        "/etc/passwd",
        "/nonexistent/secret",
        "sub/s.safetensors",
        "..",
        ".",
        "",
        "a\\..\\x.safetensors",
        "x\0.safetensors",
    ] {
        write_index(&model, serde_json::json!({"a": name}));
        for r in both(&model) {
            match r {
                Err(CheckpointError::PathOutsideFolder { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name:?}: {other:?}"),
            }
        }
        // The pure parser says the same.
        let bytes = std::fs::read(model.join("model.safetensors.index.json")).unwrap();
        assert!(matches!(
            ShardIndex::parse(&bytes, "index"),
            Err(CheckpointError::PathOutsideFolder { .. })
        ));
    }
}

#[cfg(unix)]
#[test]
fn symlinks_must_stay_inside_and_fifos_are_never_opened() {
    use std::os::unix::fs::symlink;
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("w.safetensors"), one_tensor("a")).unwrap();
    let d = tempfile::tempdir().unwrap();
    let m = d.path();
    // A symlink to a file outside: refused, whether the target exists or not.
    symlink(
        outside.path().join("w.safetensors"),
        m.join("model.safetensors"),
    )
    .unwrap();
    for r in both(m) {
        assert!(
            matches!(r, Err(CheckpointError::PathOutsideFolder { .. })),
            "{r:?}"
        );
    }
    std::fs::remove_file(m.join("model.safetensors")).unwrap();
    symlink("/nonexistent/file", m.join("model.safetensors")).unwrap();
    for r in both(m) {
        assert!(
            matches!(r, Err(CheckpointError::PathOutsideFolder { .. })),
            "{r:?}"
        );
    }
    std::fs::remove_file(m.join("model.safetensors")).unwrap();
    symlink("../../../../../etc/passwd", m.join("model.safetensors")).unwrap();
    for r in both(m) {
        assert!(
            matches!(r, Err(CheckpointError::PathOutsideFolder { .. })),
            "{r:?}"
        );
    }
    // A symlink inside the folder is fine; a dangling one inside is an I/O error.
    std::fs::remove_file(m.join("model.safetensors")).unwrap();
    std::fs::write(m.join("real.safetensors"), one_tensor("a")).unwrap();
    symlink("real.safetensors", m.join("model.safetensors")).unwrap();
    for r in both(m) {
        assert_eq!(r.unwrap().names(), ["a"]);
    }
    std::fs::remove_file(m.join("model.safetensors")).unwrap();
    symlink("gone.safetensors", m.join("model.safetensors")).unwrap();
    for r in both(m) {
        assert!(matches!(r, Err(CheckpointError::Io { .. })), "{r:?}");
    }
    std::fs::remove_file(m.join("model.safetensors")).unwrap();
    // FIFOs (as the single file, the index, or a listed shard) and directories: refused
    // without blocking.
    mkfifo(&m.join("model.safetensors"));
    for r in both(m) {
        assert!(
            matches!(
                r,
                Err(CheckpointError::NotARegularFile { kind: "a FIFO", .. })
            ),
            "{r:?}"
        );
    }
    mkfifo(&m.join("model.safetensors.index.json"));
    for r in both(m) {
        assert!(
            matches!(r, Err(CheckpointError::NotARegularFile { .. })),
            "{r:?}"
        );
    }
    std::fs::remove_file(m.join("model.safetensors.index.json")).unwrap();
    mkfifo(&m.join("shard.safetensors"));
    write_index(m, serde_json::json!({"a": "shard.safetensors"}));
    for r in both(m) {
        assert!(
            matches!(r, Err(CheckpointError::NotARegularFile { .. })),
            "{r:?}"
        );
    }
    std::fs::create_dir(m.join("dir.safetensors")).unwrap();
    write_index(m, serde_json::json!({"a": "dir.safetensors"}));
    for r in both(m) {
        assert!(
            matches!(
                r,
                Err(CheckpointError::NotARegularFile {
                    kind: "a directory",
                    ..
                })
            ),
            "{r:?}"
        );
    }
    // The quant config is read through the same gate.
    let q = tempfile::tempdir().unwrap();
    mkfifo(&q.path().join("hf_quant_config.json"));
    let p = q.path().to_path_buf();
    let e = guarded(move || QuantConfig::from_dir(&p)).unwrap_err();
    assert!(matches!(
        find::<CheckpointError>(&e),
        Some(CheckpointError::NotARegularFile { .. })
    ));
    std::fs::remove_file(q.path().join("hf_quant_config.json")).unwrap();
    symlink(
        outside.path().join("w.safetensors"),
        q.path().join("config.json"),
    )
    .unwrap();
    let p = q.path().to_path_buf();
    let e = guarded(move || QuantConfig::from_dir(&p)).unwrap_err();
    assert!(matches!(
        find::<CheckpointError>(&e),
        Some(CheckpointError::PathOutsideFolder { .. })
    ));
}

#[test]
fn broken_indexes_and_headers_are_typed_errors() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path();
    std::fs::write(m.join("a.safetensors"), one_tensor("a")).unwrap();
    std::fs::write(m.join("b.safetensors"), one_tensor("b")).unwrap();
    std::fs::write(m.join("a2.safetensors"), one_tensor("a")).unwrap();
    for text in [
        "{ not json",
        "[1, 2]",
        r#"{"metadata": {}}"#,
        r#"{"weight_map": [1]}"#,
        r#"{"weight_map": {"a": 7}}"#,
        r#"{"weight_map": {}}"#,
        "\u{feff}\u{0}",
    ] {
        std::fs::write(m.join("model.safetensors.index.json"), text).unwrap();
        for r in both(m) {
            assert!(
                matches!(r, Err(CheckpointError::InvalidIndex { .. })),
                "{text}: {r:?}"
            );
        }
    }
    assert!(matches!(
        ShardIndex::parse(&[0xff, 0xfe], "x"),
        Err(CheckpointError::InvalidIndex { .. })
    ));
    // The index must say where each tensor really is.
    write_index(
        m,
        serde_json::json!({"a": "a.safetensors", "b": "a.safetensors"}),
    );
    for r in both(m) {
        match r {
            Err(CheckpointError::IndexMismatch { tensor, found, .. }) => {
                assert_eq!(tensor, "b");
                assert!(found.is_none());
            }
            other => panic!("{other:?}"),
        }
    }
    write_index(
        m,
        serde_json::json!({"a": "a.safetensors", "b": "b.safetensors"}),
    );
    for r in both(m) {
        let c = r.unwrap();
        assert_eq!(c.names(), ["a", "b"]);
        // A missing tensor names itself; wrong dtype and shape too.
        assert!(
            matches!(c.get("zz"), Err(CheckpointError::MissingTensor { tensor, .. }) if tensor == "zz")
        );
        assert!(matches!(
            c.get_dtype("a", &[DType::BF16]),
            Err(CheckpointError::WrongDtype {
                found: DType::F32,
                ..
            })
        ));
        assert!(matches!(
            c.get_checked("a", &[DType::F32], &[3]),
            Err(CheckpointError::WrongShape { .. })
        ));
        assert!(matches!(
            c.scalar_f32("a"),
            Err(CheckpointError::WrongShape { .. })
        ));
    }
    // One tensor in two shards.
    write_index(
        m,
        serde_json::json!({"a": "a.safetensors", "a ": "a2.safetensors"}),
    );
    for r in both(m) {
        assert!(
            matches!(r, Err(CheckpointError::DuplicateTensor { .. })),
            "{r:?}"
        );
    }
    // Broken headers: every truncation of a valid file, a huge header length, bad JSON,
    // offsets past the data, and a dtype candle cannot hold.
    let good = one_tensor("a");
    for cut in 0..good.len() {
        let r = guarded({
            let b = good[..cut].to_vec();
            move || Checkpoint::from_buffer(b, "cut")
        });
        assert!(
            matches!(r, Err(CheckpointError::NotSafetensors { .. })),
            "cut {cut}"
        );
    }
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend(b"{}");
    let mut bad_offsets = br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#.to_vec();
    let mut file = (bad_offsets.len() as u64).to_le_bytes().to_vec();
    file.append(&mut bad_offsets);
    file.extend([0u8; 8]);
    let mut overflow =
        br#"{"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}}"#.to_vec();
    let mut file2 = (overflow.len() as u64).to_le_bytes().to_vec();
    file2.append(&mut overflow);
    for bytes in [huge, file, file2, b"\x02\0\0\0\0\0\0\0{]".to_vec()] {
        let r = guarded(move || Checkpoint::from_buffer(bytes, "bad"));
        assert!(
            matches!(r, Err(CheckpointError::NotSafetensors { .. })),
            "{r:?}"
        );
    }
    let u16s = safetensors_bytes(&[("u", Dtype::U16, vec![2], vec![0; 4])]);
    let c = Checkpoint::from_buffer(u16s, "u16").unwrap();
    assert!(matches!(
        c.get("u"),
        Err(CheckpointError::UnsupportedDtype { .. })
    ));
}

/// The tiny ModelOpt checkpoint with `edit` applied to the bytes of tensor `name`.
fn tiny_with(name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> Checkpoint {
    let bytes = std::fs::read(tiny().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let t = owned.iter_mut().find(|t| t.0 == name).unwrap();
    edit(&mut t.3);
    let refs: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone()))
        .collect();
    Checkpoint::from_buffer(safetensors_bytes(&refs), "edited").unwrap()
}

#[test]
fn block_and_global_scales_are_checked_at_load() {
    let cfg = QuantConfig::from_dir(tiny()).unwrap();
    let p = "model.layers.0.self_attn.q_proj";
    let sname = format!("{p}.weight_scale");
    // [192, 12] scales: byte 30 is row 2, block 6. Negative, then NaN (both NaN codes).
    for (byte, what) in [
        (0xB8u8, "negative"),
        (0x7F, "NaN"),
        (0xFF, "-NaN"),
        (0x81, "tiny negative"),
    ] {
        let c = tiny_with(&sname, |b| b[30] = byte);
        let e = QuantLinear::load(&c, p, &Device::Cpu, &cfg).unwrap_err();
        match find::<CheckpointError>(&e) {
            Some(CheckpointError::BadBlockScale {
                tensor,
                index,
                row,
                block,
                byte: b,
                ..
            }) => {
                assert_eq!(
                    (tensor.as_str(), *index, *row, *block, *b),
                    (sname.as_str(), 30, 2, 6, byte),
                    "{what}"
                );
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    // -0 (0x80) is a zero scale: accepted.
    let c = tiny_with(&sname, |b| b[30] = 0x80);
    QuantLinear::load(&c, p, &Device::Cpu, &cfg).unwrap();
    // A global scale that is negative, zero, NaN or infinite.
    let gname = format!("{p}.weight_scale_2");
    for v in [-1.0f32, 0.0, f32::NAN, f32::INFINITY] {
        let c = tiny_with(&gname, |b| *b = v.to_le_bytes().to_vec());
        let e = QuantLinear::load(&c, p, &Device::Cpu, &cfg).unwrap_err();
        assert!(
            matches!(
                find::<CheckpointError>(&e),
                Some(CheckpointError::BadGlobalScale { .. })
            ),
            "{v}: {e}"
        );
    }
}

#[test]
fn quantizer_sizes_are_checked() {
    // n·k wraps to 0 in usize: an overflow, not an empty matrix.
    let e = quantize_nvfp4_slice(&[], 1 << 61, 16, None).unwrap_err();
    assert!(
        matches!(find::<SizeError>(&e), Some(SizeError::Overflow { .. })),
        "{e}"
    );
    let e = quantize_nvfp4_slice(&[], usize::MAX, 32, Some(1.0)).unwrap_err();
    assert!(
        matches!(find::<SizeError>(&e), Some(SizeError::Overflow { .. })),
        "{e}"
    );
    // All-subnormal: the global scale would underflow to 0 (was returned as 0).
    let w = vec![f32::from_bits(1); 32];
    let e = quantize_nvfp4_slice(&w, 2, 16, None).unwrap_err();
    assert!(
        matches!(
            find::<QuantizeError>(&e),
            Some(QuantizeError::GlobalScaleUnderflow { .. })
        ),
        "{e}"
    );
    // The smallest amax whose scale is still positive quantizes, with a positive scale.
    let mut w = vec![0f32; 16];
    w[0] = f32::MIN_POSITIVE;
    assert!(quantize_nvfp4_slice(&w, 1, 16, None).unwrap().global_scale > 0.0);
    let cases: [(Vec<f32>, usize, usize, Option<f32>); 6] = [
        (vec![0.0; 32], 2, 16, None),
        (vec![1.0; 16], 1, 8, None),
        (vec![1.0; 15], 1, 16, None),
        (vec![f32::NAN; 16], 1, 16, None),
        (vec![1.0; 16], 1, 16, Some(-1.0)),
        (vec![1.0; 16], 1, 16, Some(1e-9)),
    ];
    for (w, n, k, g) in cases {
        let e = quantize_nvfp4_slice(&w, n, k, g).unwrap_err();
        assert!(find::<QuantizeError>(&e).is_some(), "{e}");
    }
    // Scale swizzling and row dequantization with sizes whose products wrap.
    use candle_fp4::nvfp4::{
        dequantize_rows_cpu, swizzle_blockscale_bytes, unswizzle_blockscale_bytes,
    };
    for (n, s) in [(1usize << 62, 4usize), (usize::MAX, 1), (4, usize::MAX)] {
        assert!(
            guarded(move || swizzle_blockscale_bytes(&[], n, s)).is_err(),
            "{n} {s}"
        );
        assert!(
            guarded(move || unswizzle_blockscale_bytes(&[], n, s)).is_err(),
            "{n} {s}"
        );
    }
    for (n, k) in [
        (1usize << 62, 64usize),
        (usize::MAX, 16),
        (2, usize::MAX - 15),
    ] {
        assert!(
            guarded(move || dequantize_rows_cpu(&[], &[], n, k)).is_err(),
            "{n} {k}"
        );
    }
    // A hand-made NVFP4 weight with a NaN or negative scale is refused by QuantLinear too.
    let mut q = quantize_nvfp4_slice(&[1.0; 64], 4, 16, None).unwrap();
    q.weight_scale[3] = 0x7F;
    assert!(QuantLinear::from_nvfp4(&q, None, &Device::Cpu).is_err());
    q.n = usize::MAX / 2;
    assert!(QuantLinear::from_nvfp4(&q, None, &Device::Cpu).is_err());
}
