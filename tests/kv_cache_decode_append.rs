//! The decode append at the device lengths (`KvCache::append_decode`, what a captured CUDA
//! graph replays) and the capacity-planned attention (`decode_attention_capacity`), against
//! the host-positioned `append` of one token and `decode_attention`.
//!
//! The append only moves bits (BF16 rows, or the same UltraQuant encoder), so the caches
//! must read back **bit for bit** equal, on the CPU and on a GPU (feature `cuda`: the GPU
//! cache built with `append_decode` against the CPU cache built with `append`; the encoders
//! agree bit for bit, `kv_cache_gpu.rs`). Attention planned for the capacity sums the same
//! terms in another split order: FP32 partials merged in another order, then one BF16
//! rounding: within one BF16 ulp of the largest output plus the CPU reference's own bound
//! (`kv_cache_gpu.rs` uses 2 ulps for the CUDA kernel against the CPU); bound 3 ulps.

mod kv_cache_common;

use candle_core::{DType, Device, Tensor};
use candle_fp4::kv_cache::{CacheShape, KvCache, KvCacheKind};
use kv_cache_common::gaussian_bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

const SHAPE: CacheShape = CacheShape {
    batch: 3,
    capacity: 40,
    kv_heads: 2,
    head_dim: 64,
};

fn kv(rng: &mut StdRng, dims: &[usize], dev: &Device) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(gaussian_bf16(rng, n, 1.0), dims, dev).unwrap()
}

/// Two caches filled alike: prompts of 1, 6 and 11 tokens by `append_seq`, then `steps`
/// decode tokens, one cache by `append` (host positions), the other by `append_decode`.
fn filled(kind: KvCacheKind, window: usize, steps: usize, dev_b: &Device) -> (KvCache, KvCache) {
    let cpu = Device::Cpu;
    let mut a = KvCache::with_window(kind, SHAPE, window, &cpu).unwrap();
    let mut b = KvCache::with_window(kind, SHAPE, window, dev_b).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    let (h, d) = (SHAPE.kv_heads, SHAPE.head_dim);
    for (seq, n) in [1, 6, 11].into_iter().enumerate() {
        let (k, v) = (
            kv(&mut rng, &[n, h, d], &cpu),
            kv(&mut rng, &[n, h, d], &cpu),
        );
        a.append_seq(seq, &k, &v).unwrap();
        b.append_seq(
            seq,
            &k.to_device(dev_b).unwrap(),
            &v.to_device(dev_b).unwrap(),
        )
        .unwrap();
    }
    for _ in 0..steps {
        let (k, v) = (
            kv(&mut rng, &[3, h, d], &cpu),
            kv(&mut rng, &[3, h, d], &cpu),
        );
        a.append(&k.unsqueeze(1).unwrap(), &v.unsqueeze(1).unwrap())
            .unwrap();
        b.append_decode(&k.to_device(dev_b).unwrap(), &v.to_device(dev_b).unwrap())
            .unwrap();
    }
    (a, b)
}

fn bits(t: &Tensor) -> Vec<u16> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<half::bf16>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Read-back bit for bit, then attention (both plans) within the bound of the module docs.
fn compare(kind: KvCacheKind, window: usize, dev: &Device) {
    let what = format!("{kind:?} window {window} on {:?}", dev.location());
    // 20 steps: past the window of 5 (its ring wraps several times).
    let (a, b) = filled(kind, window, 20, dev);
    assert_eq!(a.lens(), b.lens(), "{what}: lengths");
    assert_eq!(a.lens(), &[21, 26, 31]);
    for seq in 0..3 {
        let (ka, va) = a.read_bf16(seq).unwrap();
        let (kb, vb) = b.read_bf16(seq).unwrap();
        assert_eq!(bits(&ka), bits(&kb), "{what}: K of sequence {seq}");
        assert_eq!(bits(&va), bits(&vb), "{what}: V of sequence {seq}");
    }
    let mut rng = StdRng::seed_from_u64(9);
    let q = kv(&mut rng, &[3, 8, SHAPE.head_dim], &Device::Cpu);
    let want = f32s(&a.decode_attention(&q).unwrap());
    let qd = q.to_device(dev).unwrap();
    for (name, got) in [
        ("attention", b.decode_attention(&qd).unwrap()),
        (
            "capacity-planned attention",
            b.decode_attention_capacity(&qd).unwrap(),
        ),
    ] {
        let got = f32s(&got);
        let max = want.iter().fold(1f32, |m, x| m.max(x.abs()));
        let tol = if dev.is_cpu() { 0.0 } else { 3.0 * max / 128.0 };
        let d = got
            .iter()
            .zip(&want)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(d <= tol, "{what}: {name} |diff| {d} > {tol}");
    }
}

#[test]
fn decode_append_matches_append_on_the_cpu() {
    for (kind, window) in [
        (KvCacheKind::Bf16, 0),
        (KvCacheKind::UltraQuant, 0),
        (KvCacheKind::UltraQuant, 5),
    ] {
        compare(kind, window, &Device::Cpu);
    }
}

#[cfg(feature = "cuda")]
#[test]
fn decode_append_matches_append_on_the_gpu() {
    let dev = Device::new_cuda(0).expect("this test needs a CUDA GPU");
    for (kind, window) in [
        (KvCacheKind::Bf16, 0),
        (KvCacheKind::UltraQuant, 0),
        (KvCacheKind::UltraQuant, 5),
    ] {
        compare(kind, window, &dev);
    }
}

/// A full sequence, a wrong shape or dtype, and bad host lengths are errors that write
/// nothing.
#[test]
fn decode_append_errors() {
    let cpu = Device::Cpu;
    let (h, d) = (SHAPE.kv_heads, SHAPE.head_dim);
    let mut rng = StdRng::seed_from_u64(1);
    for kind in [KvCacheKind::Bf16, KvCacheKind::UltraQuant] {
        let mut c = KvCache::with_window(kind, SHAPE, 4, &cpu).unwrap();
        let k = kv(&mut rng, &[3, h, d], &cpu);
        let e = c.append_decode(&k.unsqueeze(1).unwrap(), &k.unsqueeze(1).unwrap());
        assert!(e.unwrap_err().to_string().contains("[3, 2, 64]"));
        let e = c.append_decode(&k.to_dtype(DType::F32).unwrap(), &k);
        assert!(e.unwrap_err().to_string().contains("BF16"));
        let full = kv(&mut rng, &[SHAPE.capacity, h, d], &cpu);
        c.append_seq(2, &full, &full).unwrap();
        let e = c.append_decode(&k, &k).unwrap_err().to_string();
        assert!(e.contains("sequence 2 holds 40 tokens"), "{e}");
        assert_eq!(
            c.lens(),
            &[0, 0, 40],
            "{kind:?}: a failed append wrote nothing"
        );
        let e = c.set_host_lens(&[1, 2]).unwrap_err().to_string();
        assert!(e.contains("2 lengths for batch 3"), "{e}");
        let e = c.set_host_lens(&[1, 2, 41]).unwrap_err().to_string();
        assert!(e.contains("length 41 exceeds the capacity 40"), "{e}");
        c.set_host_lens(&[1, 2, 3]).unwrap();
        assert_eq!(c.lens(), &[1, 2, 3]);
    }
}
