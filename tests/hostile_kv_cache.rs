//! Hostile uses of the KV caches: clones that used to share storage written in place,
//! sizes that used to abort, and NaN in K/V, which the UltraQuant cache used to turn into
//! zeros (now it propagates like the BF16 cache's).

use candle_core::{DType, Device, Tensor};
use candle_fp4::error::{find, SizeError};
use candle_fp4::kv_cache::{CacheShape, KvCache, KvCacheKind};
use half::bf16;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

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

fn bf16s(v: &[f32], dims: &[usize]) -> Tensor {
    let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    Tensor::from_slice(&b, dims, &Device::Cpu).unwrap()
}

fn rows(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn cloned_caches_do_not_share_storage() {
    let sh = CacheShape {
        batch: 2,
        capacity: 8,
        kv_heads: 1,
        head_dim: 32,
    };
    let kv = |x: f32| bf16s(&[x; 32], &[1, 1, 32]);
    for (kind, window) in [
        (KvCacheKind::Bf16, 0),
        (KvCacheKind::UltraQuant, 0),
        (KvCacheKind::UltraQuant, 2),
    ] {
        let mut a = KvCache::with_window(kind, sh, window, &Device::Cpu).unwrap();
        a.append_seq(0, &kv(1.0), &kv(2.0)).unwrap();
        let before = a.read_bf16(0).unwrap();
        let mut b = a.try_clone().unwrap();
        // Appending to the copy, and resetting and refilling it, leaves the original alone.
        b.append_seq(0, &kv(3.0), &kv(4.0)).unwrap();
        b.reset().unwrap();
        b.append_seq(0, &kv(5.0), &kv(6.0)).unwrap();
        let after = a.read_bf16(0).unwrap();
        assert_eq!(a.lens(), [1, 0]);
        assert_eq!(rows(&before.0), rows(&after.0), "{kind:?} K");
        assert_eq!(rows(&before.1), rows(&after.1), "{kind:?} V");
        assert_eq!(
            rows(&b.read_bf16(0).unwrap().1),
            rows(&a_value(kind, 6.0)),
            "{kind:?}"
        );
        // Forking a sequence inside the batch: dst gets src's tokens; appends diverge.
        a.copy_seq(0, 1).unwrap();
        assert_eq!(a.lens(), [1, 1]);
        a.append_seq(1, &kv(7.0), &kv(8.0)).unwrap();
        assert_eq!(
            rows(&a.read_bf16(0).unwrap().1),
            rows(&before.1),
            "{kind:?} src kept"
        );
        let (_, v1) = a.read_bf16(1).unwrap();
        assert_eq!(
            rows(&v1.narrow(0, 0, 1).unwrap()),
            rows(&before.1),
            "{kind:?} fork"
        );
        assert!(a.copy_seq(0, 2).is_err() && a.copy_seq(5, 0).is_err());
    }
}

/// What one token of V = `x` (all 32 values) reads back as.
fn a_value(kind: KvCacheKind, x: f32) -> Tensor {
    let sh = CacheShape {
        batch: 1,
        capacity: 1,
        kv_heads: 1,
        head_dim: 32,
    };
    let mut c = KvCache::new(kind, sh, &Device::Cpu).unwrap();
    let t = bf16s(&[x; 32], &[1, 1, 32]);
    c.append(&t, &t).unwrap();
    c.read_bf16(0).unwrap().1
}

#[test]
fn impossible_cache_sizes_are_errors_not_aborts() {
    let dev = Device::Cpu;
    // 256 TB: more than any address space.
    let sh = CacheShape {
        batch: 4,
        capacity: i32::MAX as usize,
        kv_heads: 64,
        head_dim: 128,
    };
    for kind in [KvCacheKind::Bf16, KvCacheKind::UltraQuant] {
        let e = guarded(move || KvCache::new(kind, sh, &Device::Cpu).map(|_| ())).unwrap_err();
        assert!(
            matches!(find::<SizeError>(&e), Some(SizeError::Alloc { .. })),
            "{kind:?}: {e}"
        );
    }
    // A window ring that cannot be allocated.
    let sh = CacheShape {
        batch: 1 << 20,
        capacity: 1 << 20,
        kv_heads: 1,
        head_dim: 32,
    };
    let e = KvCache::with_window(KvCacheKind::UltraQuant, sh, 1 << 20, &dev).unwrap_err();
    assert!(find::<SizeError>(&e).is_some(), "{e}");
}

#[test]
fn ultraquant_nan_propagates_like_the_bf16_cache() {
    let (d, g) = (64, 32);
    let sh = CacheShape {
        batch: 1,
        capacity: 4,
        kv_heads: 1,
        head_dim: d,
    };
    let q = bf16s(
        &(0..d).map(|i| (i as f32 * 0.1).sin()).collect::<Vec<_>>(),
        &[1, 1, d],
    );
    let out = |kind, window, k: &[f32], v: &[f32]| {
        let mut c = KvCache::with_window(kind, sh, window, &Device::Cpu).unwrap();
        let ok = vec![0.5f32; d];
        c.append(&bf16s(&ok, &[1, 1, d]), &bf16s(&ok, &[1, 1, d]))
            .unwrap();
        c.append(&bf16s(k, &[1, 1, d]), &bf16s(v, &[1, 1, d]))
            .unwrap();
        c.append(&bf16s(&ok, &[1, 1, d]), &bf16s(&ok, &[1, 1, d]))
            .unwrap();
        rows(&c.decode_attention(&q).unwrap())
    };
    let ok: Vec<f32> = (0..d).map(|i| (i as f32 * 0.3).cos()).collect();
    let mut v_nan = ok.clone();
    v_nan[40] = f32::NAN; // group 1 (values 32..64)
    let bf = out(KvCacheKind::Bf16, 0, &ok, &v_nan);
    assert!(bf[40].is_nan() && bf.iter().filter(|x| x.is_nan()).count() == 1);
    // UltraQuant read from FP4 (window 0): the NaN's whole group is NaN, never zeros.
    let uq = out(KvCacheKind::UltraQuant, 0, &ok, &v_nan);
    for (i, x) in uq.iter().enumerate() {
        assert_eq!(x.is_nan(), i / g == 1, "dim {i}: {x}");
    }
    // With the token in the exact window the BF16 value itself is read.
    let w = out(KvCacheKind::UltraQuant, 4, &ok, &v_nan);
    assert_eq!(
        w.iter().map(|x| x.is_nan()).collect::<Vec<_>>(),
        bf.iter().map(|x| x.is_nan()).collect::<Vec<_>>()
    );
    // NaN or ∞ in K: every output of that head is NaN, for both caches.
    for bad in [f32::NAN, f32::INFINITY] {
        let mut k_bad = ok.clone();
        k_bad[3] = bad;
        for kind in [KvCacheKind::Bf16, KvCacheKind::UltraQuant] {
            assert!(
                out(kind, 0, &k_bad, &ok).iter().all(|x| x.is_nan()),
                "{kind:?} {bad}"
            );
        }
    }
}
