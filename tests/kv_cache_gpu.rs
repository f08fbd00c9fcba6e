//! KV caches on the GPU against the CPU reference (feature `cuda`, needs a GPU).
//!
//! * Store: the CUDA slots equal the CPU slots bit for bit, and so does the read-back.
//! * Errors for tensors on the wrong device and head_dim the kernels lack.
//! * Decode attention, UltraQuant and BF16 caches, against the CPU forward on the same K/V:
//!   head_dim 64/128/256 (BF16 also 80 and 96), contexts 1, 17, 97, 4097 (and 32768 for one configuration),
//!   batch 1 and 3 with different lengths, GQA 4:1 (plus 1:1, 3:1, 8:1, 20:1), split counts
//!   forced to 1 (the kernel writes the output) and to several (partials + combine); K/V
//!   with per-group power-of-two factors (V over 2^-40 .. 2^40) and all-zero groups; the
//!   row-streaming UltraQuant kernel (8 and 16 KV heads) beside the per-head one.
//!
//! Tolerance GPU vs CPU: both approximate the same attention. The CPU forward is f32 (error
//! ~1e-6 relative); the kernel splits q and the softmax weights into BF16 hi + lo pairs
//! (~2^-17 relative each) and accumulates in FP32 on tensor cores, so its scores are within
//! ~1e-4 relative and its output within ~1e-4 · max|o| before rounding. After each side's
//! single BF16 rounding they may differ by one BF16 ulp; allowed: one ulp at
//! max(|gpu|, |cpu|) plus 2^-13 · max|o_cpu| for elements near zero through cancellation.
#![cfg(feature = "cuda")]

mod kv_cache_common;

use candle_core::{DType, Device, Tensor};
use candle_fp4::kv_cache::{AttnKnobs, CacheShape, KvCache, KvCacheKind};
use half::bf16;
use kv_cache_common::*;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// One CUDA device for the whole test binary: candle gives every `Device::new_cuda(0)`
/// its own id, and tensors of different ids are (rightly) not on the same device.
fn gpu() -> Device {
    static DEV: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEV.get_or_init(|| Device::new_cuda(0).expect("these tests need a CUDA GPU"))
        .clone()
}

/// The same appends to a CPU and a GPU cache: a prompt per sequence (`append_seq`), then
/// `steps` one-token batch appends.
fn twin(
    kind: KvCacheKind,
    sh: CacheShape,
    prompts: &[usize],
    steps: usize,
    seed: u64,
) -> (KvCache, KvCache) {
    twin_window(kind, sh, 0, prompts, steps, seed)
}

/// [`twin`] with an exact window of `window` tokens (UltraQuant).
fn twin_window(
    kind: KvCacheKind,
    sh: CacheShape,
    window: usize,
    prompts: &[usize],
    steps: usize,
    seed: u64,
) -> (KvCache, KvCache) {
    let (dev, cpu) = (gpu(), Device::Cpu);
    let mut rng = StdRng::seed_from_u64(seed);
    let (kh, d) = (sh.kv_heads, sh.head_dim);
    let mut a = KvCache::with_window(kind, sh, window, &cpu).unwrap();
    let mut g = KvCache::with_window(kind, sh, window, &dev).unwrap();
    let t = |x: &[bf16], dims: &[usize], dv: &Device| Tensor::from_slice(x, dims, dv).unwrap();
    for (b, &n) in prompts.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let k = gaussian_bf16(&mut rng, n * kh * d, 1.5);
        let v = gaussian_bf16(&mut rng, n * kh * d, 1.0);
        a.append_seq(b, &t(&k, &[n, kh, d], &cpu), &t(&v, &[n, kh, d], &cpu))
            .unwrap();
        g.append_seq(b, &t(&k, &[n, kh, d], &dev), &t(&v, &[n, kh, d], &dev))
            .unwrap();
    }
    for _ in 0..steps {
        let k = gaussian_bf16(&mut rng, sh.batch * kh * d, 1.5);
        let v = gaussian_bf16(&mut rng, sh.batch * kh * d, 1.0);
        let dims = [sh.batch, 1, kh, d];
        a.append(&t(&k, &dims, &cpu), &t(&v, &dims, &cpu)).unwrap();
        g.append(&t(&k, &dims, &dev), &t(&v, &dims, &dev)).unwrap();
    }
    assert_eq!(a.lens(), g.lens());
    (a, g)
}

fn host_bf16(t: &Tensor) -> Vec<bf16> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<bf16>()
        .unwrap()
}

#[test]
fn store_and_read_back_match_cpu_bit_for_bit() {
    for d in [64, 128, 256] {
        for kh in [1, 3, 8] {
            let sh = CacheShape {
                batch: 3,
                capacity: 70,
                kv_heads: kh,
                head_dim: d,
            };
            let (a, g) = twin(
                KvCacheKind::UltraQuant,
                sh,
                &[17, 0, 66],
                3,
                (d * 10 + kh) as u64,
            );
            let (KvCache::UltraQuant(a), KvCache::UltraQuant(g)) = (&a, &g) else {
                unreachable!()
            };
            let sa = a
                .slots()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<u8>()
                .unwrap();
            let sg = g
                .slots()
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<u8>()
                .unwrap();
            if let Some(i) = sa.iter().zip(&sg).position(|(x, y)| x != y) {
                panic!(
                    "d={d} kv_heads={kh}: slot byte {i} differs: cpu {:#04x} gpu {:#04x}",
                    sa[i], sg[i]
                );
            }
            for b in 0..3 {
                let (ka, va) = a.read_bf16(b).unwrap();
                let (kg, vg) = g.read_bf16(b).unwrap();
                assert_eq!(ka.dims(), kg.dims());
                let bits = |x: Vec<bf16>| x.into_iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(host_bf16(&ka)),
                    bits(host_bf16(&kg)),
                    "d={d} kv_heads={kh} seq {b}: K read-back"
                );
                assert_eq!(
                    bits(host_bf16(&va)),
                    bits(host_bf16(&vg)),
                    "d={d} kv_heads={kh} seq {b}: V read-back"
                );
            }
        }
    }
}

/// Compares GPU and CPU decode attention on `(cpu, gpu)` twins with the tolerance of the
/// module docs, for the given split options.
fn check_attention(a: &KvCache, g: &KvCache, q_heads: usize, seed: u64, what: &str) {
    let sh = a.shape();
    let q = gaussian_bf16(
        &mut StdRng::seed_from_u64(seed),
        sh.batch * q_heads * sh.head_dim,
        1.0,
    );
    let dims = [sh.batch, q_heads, sh.head_dim];
    let want = host_bf16(
        &a.decode_attention(&Tensor::from_slice(&q, &dims[..], &Device::Cpu).unwrap())
            .unwrap(),
    );
    let omax = want
        .iter()
        .fold(0f64, |m, x| m.max(f64::from(x.to_f32()).abs()));
    let qg = Tensor::from_slice(&q, &dims[..], &gpu()).unwrap();
    let opt = |splits, fused_merge, pdl| AttnKnobs {
        splits,
        fused_merge,
        pdl,
        ..AttnKnobs::default()
    };
    // The exact window's ring before and after the UltraQuant launch (without a window the
    // option changes nothing).
    let ring = |ring_first, fused_merge, pdl| AttnKnobs {
        ring_first: Some(ring_first),
        ..opt(None, fused_merge, pdl)
    };
    // Heuristic and forced splits (1000: mostly empty ranges), the merge in the attention
    // kernel or in the combine kernel (by default UltraQuant's in-kernel with more than 8
    // partials per head), PDL on and off.
    let opts = vec![
        opt(None, None, None),
        opt(Some(1), None, None),
        opt(Some(3), None, None),
        opt(Some(64), None, None),
        opt(Some(1000), None, None),
        opt(None, Some(false), None),
        opt(Some(3), Some(false), Some(false)),
        opt(Some(64), Some(true), Some(false)),
        ring(true, None, None),
        ring(false, None, None),
        ring(false, Some(false), None),
        ring(false, Some(true), None),
        ring(false, None, Some(false)),
    ];
    for o in opts {
        let out = g.decode_attention_with(&qg, &o).unwrap();
        assert_eq!(out.dims(), &dims[..]);
        assert_eq!(out.dtype(), DType::BF16);
        let got = host_bf16(&out);
        for (i, (x, y)) in got.iter().zip(&want).enumerate() {
            let (x, y) = (f64::from(x.to_f32()), f64::from(y.to_f32()));
            let tol = bf16_ulp(x.abs().max(y.abs())) + omax * 2f64.powi(-13);
            assert!(
                (x - y).abs() <= tol,
                "{what} {o:?}: element {i}: gpu {x} cpu {y} (tolerance {tol:e})"
            );
        }
        // The in-kernel merge's counters must be back at zero: a second call gives the
        // same bits (the merge order is fixed).
        let again = host_bf16(&g.decode_attention_with(&qg, &o).unwrap());
        assert!(
            again
                .iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what} {o:?}: a second call differs from the first"
        );
    }
}

#[test]
fn attention_matches_cpu() {
    for kind in [KvCacheKind::UltraQuant, KvCacheKind::Bf16] {
        let dims: &[usize] = match kind {
            KvCacheKind::UltraQuant => &[64, 128, 256],
            KvCacheKind::Bf16 => &[64, 80, 96, 128, 256],
        };
        for &d in dims {
            for (ci, &n) in [1usize, 17, 97, 4097].iter().enumerate() {
                for batch in [1, 3] {
                    let prompts: Vec<usize> = [n, n / 2 + 1, 17][..batch].to_vec();
                    let cap = n.max(17) + 1;
                    let sh = CacheShape {
                        batch,
                        capacity: cap,
                        kv_heads: 2,
                        head_dim: d,
                    };
                    let (a, g) = twin(kind, sh, &prompts, 1, (ci * 7 + d + batch) as u64);
                    check_attention(
                        &a,
                        &g,
                        8,
                        99 + ci as u64,
                        &format!("{kind:?} d={d} n={n} batch={batch} GQA 4:1"),
                    );
                }
            }
        }
    }
}

#[test]
fn attention_group_sizes() {
    for kind in [KvCacheKind::UltraQuant, KvCacheKind::Bf16] {
        let dims: &[usize] = match kind {
            KvCacheKind::UltraQuant => &[64, 128, 256],
            KvCacheKind::Bf16 => &[64, 80, 96, 128, 256],
        };
        for &d in dims {
            for (kh, qh) in [(4, 4), (3, 9), (2, 16), (1, 20)] {
                let sh = CacheShape {
                    batch: 2,
                    capacity: 300,
                    kv_heads: kh,
                    head_dim: d,
                };
                let (a, g) = twin(kind, sh, &[250, 31], 2, (kh * 100 + qh + d) as u64);
                check_attention(
                    &a,
                    &g,
                    qh,
                    5,
                    &format!("{kind:?} d={d} kv_heads={kh} q_heads={qh}"),
                );
            }
        }
    }
}

/// UltraQuant with an exact window: the ring written on the GPU reads back bit for bit as on
/// the CPU, and attention (BF16 kernel over the ring + FP4 kernel over older tokens, one
/// merge) matches the CPU reference with the same tolerance, for prompts shorter and longer
/// than the window, prompts longer than the window in one append, and a ring that wraps.
#[test]
fn attention_exact_window() {
    for &d in &[64, 128, 256] {
        for (wi, &w) in [1usize, 16, 64, 100].iter().enumerate() {
            let prompts = [300, 40, 7];
            let sh = CacheShape {
                batch: 3,
                capacity: 320,
                kv_heads: 2,
                head_dim: d,
            };
            let (a, g) = twin_window(
                KvCacheKind::UltraQuant,
                sh,
                w,
                &prompts,
                9,
                (wi * 31 + d) as u64,
            );
            assert_eq!(g.window(), w);
            for b in 0..3 {
                let (ka, va) = a.read_bf16(b).unwrap();
                let (kg, vg) = g.read_bf16(b).unwrap();
                assert_eq!(
                    host_bf16(&ka),
                    host_bf16(&kg),
                    "d={d} window={w} seq {b}: K read-back"
                );
                assert_eq!(
                    host_bf16(&va),
                    host_bf16(&vg),
                    "d={d} window={w} seq {b}: V read-back"
                );
            }
            check_attention(
                &a,
                &g,
                8,
                11 + wi as u64,
                &format!("UltraQuant d={d} window={w}"),
            );
        }
    }
}

#[test]
fn attention_long_context() {
    let sh = CacheShape {
        batch: 1,
        capacity: 32768,
        kv_heads: 8,
        head_dim: 128,
    };
    let (a, g) = twin(KvCacheKind::UltraQuant, sh, &[32767], 1, 32768);
    check_attention(&a, &g, 32, 7, "UltraQuant d=128 n=32768 GQA 4:1");
}

/// Many KV heads (the shapes of the removed row-streaming kernel, docs/logs): 8 and 16 KV
/// heads, 1, 2 and 4 query heads per KV head, batch 3 with lengths 4,097 / 97 / 1 (a partial
/// last stage, and sequences shorter than one stage), an exact window, and wide scales;
/// `check_attention` runs each against the CPU with forced splits, both merges and PDL off.
#[test]
fn attention_many_kv_heads() {
    for (kh, qh) in [(8, 32), (8, 16), (16, 16), (16, 64)] {
        let sh = CacheShape {
            batch: 3,
            capacity: 4100,
            kv_heads: kh,
            head_dim: 128,
        };
        let (a, g) = twin(
            KvCacheKind::UltraQuant,
            sh,
            &[4096, 96, 0],
            1,
            (kh * 7 + qh) as u64,
        );
        check_attention(&a, &g, qh, 3, &format!("kv_heads={kh} q_heads={qh}"));
    }
    let sh = CacheShape {
        batch: 2,
        capacity: 300,
        kv_heads: 8,
        head_dim: 128,
    };
    let (a, g) = twin_window(KvCacheKind::UltraQuant, sh, 64, &[250, 40], 3, 77);
    check_attention(&a, &g, 32, 4, "8 KV heads, window 64");
    let (dev, cpu) = (gpu(), Device::Cpu);
    let n = 1000;
    let sh = CacheShape {
        batch: 1,
        capacity: n,
        kv_heads: 8,
        head_dim: 128,
    };
    let mut rng = StdRng::seed_from_u64(5);
    let k = wide_bf16(&mut rng, n * 8 * 128, -6, 2);
    let v = wide_bf16(&mut rng, n * 8 * 128, -40, 40);
    let mut a = KvCache::new(KvCacheKind::UltraQuant, sh, &cpu).unwrap();
    let mut g = KvCache::new(KvCacheKind::UltraQuant, sh, &dev).unwrap();
    let t = |x: &[bf16], dv: &Device| Tensor::from_slice(x, &[1, n, 8, 128][..], dv).unwrap();
    a.append(&t(&k, &cpu), &t(&v, &cpu)).unwrap();
    g.append(&t(&k, &dev), &t(&v, &dev)).unwrap();
    check_attention(&a, &g, 32, 12, "8 KV heads, wide scales");
}

/// BF16 values whose 32-value groups (the UltraQuant scale groups: K is rotated within the
/// head, so for K this spreads the scale across groups) carry random power-of-two factors in
/// `2^lo ..= 2^hi`, and one group in 8 is all zero (scale byte 0, the zero sentinel).
fn wide_bf16(rng: &mut StdRng, n: usize, lo: i32, hi: i32) -> Vec<bf16> {
    use rand::Rng;
    let mut x = gaussian_bf16(rng, n, 1.0);
    for g in x.chunks_mut(32) {
        let f = if rng.random_range(0..8) == 0 {
            0.0
        } else {
            2f32.powi(rng.random_range(lo..=hi))
        };
        for v in g.iter_mut() {
            *v = bf16::from_f32(v.to_f32() * f);
        }
    }
    x
}

/// Scales far from 1 and zero groups: the kernel applies the UE8M0 scales outside the MMA
/// (K: to per-group FP32 sums; V: folded into the softmax weights), so every group of every
/// token has its own scale here, V over 2^-40 .. 2^40 and K (rotated, so mixed within the
/// head) over 2^-6 .. 2^2 (wider K makes the softmax one-hot and tests nothing more).
#[test]
fn attention_wide_scales() {
    let (dev, cpu) = (gpu(), Device::Cpu);
    for d in [64, 128, 256] {
        for n in [97usize, 1000] {
            let sh = CacheShape {
                batch: 1,
                capacity: n,
                kv_heads: 2,
                head_dim: d,
            };
            let mut rng = StdRng::seed_from_u64((d + n) as u64);
            let k = wide_bf16(&mut rng, n * 2 * d, -6, 2);
            let v = wide_bf16(&mut rng, n * 2 * d, -40, 40);
            let mut a = KvCache::new(KvCacheKind::UltraQuant, sh, &cpu).unwrap();
            let mut g = KvCache::new(KvCacheKind::UltraQuant, sh, &dev).unwrap();
            let t = |x: &[bf16], dv: &Device| Tensor::from_slice(x, &[1, n, 2, d][..], dv).unwrap();
            a.append(&t(&k, &cpu), &t(&v, &cpu)).unwrap();
            g.append(&t(&k, &dev), &t(&v, &dev)).unwrap();
            check_attention(
                &a,
                &g,
                8,
                11,
                &format!("UltraQuant wide scales d={d} n={n}"),
            );
        }
    }
}

#[test]
fn wrong_device_is_an_error() {
    for kind in [KvCacheKind::UltraQuant, KvCacheKind::Bf16] {
        let sh = CacheShape {
            batch: 1,
            capacity: 8,
            kv_heads: 2,
            head_dim: 64,
        };
        let mut g = KvCache::new(kind, sh, &gpu()).unwrap();
        let host = Tensor::zeros((1, 2, 2, 64), DType::BF16, &Device::Cpu).unwrap();
        let e = g.append(&host, &host).unwrap_err().to_string();
        assert!(e.contains("cache is on"), "{kind:?}: {e}");
        assert_eq!(g.lens(), &[0]);
        let dev = Tensor::zeros((1, 2, 2, 64), DType::BF16, &gpu()).unwrap();
        g.append(&dev, &dev).unwrap();
        let q = Tensor::zeros((1, 4, 64), DType::BF16, &Device::Cpu).unwrap();
        assert!(g.decode_attention(&q).is_err(), "{kind:?}: q on the CPU");
        assert!(
            KvCache::new(kind, CacheShape { head_dim: 32, ..sh }, &gpu()).is_err(),
            "head_dim 32 on CUDA"
        );
    }
}
