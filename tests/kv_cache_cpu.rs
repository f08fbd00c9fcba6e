//! KV caches on the CPU.
//!
//! * UltraQuant store and read-back bit for bit against the format reference
//!   (`ultraquant::encode_slot` / `decode_slot_unrotated`), for every head_dim and batch
//!   layouts with different lengths.
//! * Decode attention (the CPU forward, the oracle of the CUDA kernels) against an
//!   independent f64 attention over the same dequantized K/V: within one BF16 ulp.
//! * Decode attention against FP32 (here f64) attention over the **unquantized** K/V, with an
//!   error bound derived from the format (see `ultraquant_attention_error_vs_unquantized`).
//! * The BF16 cache, the `KvCache` enum, and the errors.

mod kv_cache_common;

use candle_core::{DType, Device, Tensor};
use candle_fp4::kv_cache::{CacheShape, KvCache, KvCacheKind, UltraQuantCache};
use candle_fp4::ultraquant::{decode_slot, decode_slot_unrotated, encode_slot, slot_size};
use half::bf16;
use kv_cache_common::*;
use rand::rngs::StdRng;
use rand::SeedableRng;

const CPU: Device = Device::Cpu;

fn shape(batch: usize, capacity: usize, kv_heads: usize, head_dim: usize) -> CacheShape {
    CacheShape {
        batch,
        capacity,
        kv_heads,
        head_dim,
    }
}

fn tensor(x: &[bf16], dims: &[usize]) -> Tensor {
    Tensor::from_slice(x, dims, &CPU).unwrap()
}

/// The sequences' K/V as appended, `kv[b] = (k, v)` each `[len][kv_heads][d]` BF16.
type History = Vec<(Vec<bf16>, Vec<bf16>)>;

/// Builds a cache of `kind` from per-sequence histories: first `append_seq` of a prompt per
/// sequence, then `steps` batch-wide appends of one token.
fn build(
    kind: KvCacheKind,
    sh: CacheShape,
    prompts: &[usize],
    steps: usize,
    seed: u64,
) -> (KvCache, History) {
    build_window(kind, sh, 0, prompts, steps, seed)
}

/// [`build`] with an exact window of `window` tokens.
fn build_window(
    kind: KvCacheKind,
    sh: CacheShape,
    window: usize,
    prompts: &[usize],
    steps: usize,
    seed: u64,
) -> (KvCache, History) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (kh, d) = (sh.kv_heads, sh.head_dim);
    let mut cache = KvCache::with_window(kind, sh, window, &CPU).unwrap();
    let mut hist: History = vec![(Vec::new(), Vec::new()); sh.batch];
    for (b, &n) in prompts.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let k = gaussian_bf16(&mut rng, n * kh * d, 1.0);
        let v = gaussian_bf16(&mut rng, n * kh * d, 1.0);
        cache
            .append_seq(b, &tensor(&k, &[n, kh, d]), &tensor(&v, &[n, kh, d]))
            .unwrap();
        hist[b].0.extend(k);
        hist[b].1.extend(v);
    }
    for _ in 0..steps {
        let k = gaussian_bf16(&mut rng, sh.batch * kh * d, 1.0);
        let v = gaussian_bf16(&mut rng, sh.batch * kh * d, 1.0);
        cache
            .append(
                &tensor(&k, &[sh.batch, 1, kh, d]),
                &tensor(&v, &[sh.batch, 1, kh, d]),
            )
            .unwrap();
        for (b, h) in hist.iter_mut().enumerate() {
            h.0.extend_from_slice(&k[b * kh * d..(b + 1) * kh * d]);
            h.1.extend_from_slice(&v[b * kh * d..(b + 1) * kh * d]);
        }
    }
    (cache, hist)
}

fn uq(cache: &KvCache) -> &UltraQuantCache {
    match cache {
        KvCache::UltraQuant(c) => c,
        KvCache::Bf16(_) => panic!("not an UltraQuant cache"),
    }
}

#[test]
fn store_and_read_back_match_the_format_reference() {
    for d in [32, 64, 128, 256] {
        let sh = shape(3, 40, 3, d);
        let (cache, hist) = build(KvCacheKind::UltraQuant, sh, &[5, 0, 23], 2, d as u64);
        assert_eq!(cache.lens(), &[7, 2, 25]);
        let slot = slot_size(d, None).unwrap();
        let bytes = uq(&cache)
            .slots()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<u8>()
            .unwrap();
        assert_eq!(bytes.len(), sh.batch * sh.capacity * sh.kv_heads * slot);
        let mut expect = vec![0u8; slot];
        for (b, (k, v)) in hist.iter().enumerate() {
            let len = cache.lens()[b];
            let (rk, rv) = cache.read_bf16(b).unwrap();
            assert_eq!(rk.dims(), &[len, sh.kv_heads, d]);
            let rk = rk.flatten_all().unwrap().to_vec1::<bf16>().unwrap();
            let rv = rv.flatten_all().unwrap().to_vec1::<bf16>().unwrap();
            for t in 0..sh.capacity {
                for h in 0..sh.kv_heads {
                    let at = ((b * sh.capacity + t) * sh.kv_heads + h) * slot;
                    let got = &bytes[at..at + slot];
                    if t >= len {
                        assert!(
                            got.iter().all(|&x| x == 0),
                            "d={d} b={b} t={t}: slot past the length written"
                        );
                        continue;
                    }
                    let r = (t * sh.kv_heads + h) * d;
                    encode_slot(&to_f32(&k[r..r + d]), &to_f32(&v[r..r + d]), &mut expect).unwrap();
                    assert_eq!(got, &expect[..], "d={d} b={b} t={t} h={h}: slot bytes");
                    let (dk, dv) = decode_slot_unrotated(got, d).unwrap();
                    for i in 0..d {
                        assert_eq!(
                            rk[r + i].to_bits(),
                            bf16::from_f32(dk[i]).to_bits(),
                            "d={d} b={b} t={t} h={h} K[{i}]"
                        );
                        assert_eq!(
                            rv[r + i].to_bits(),
                            bf16::from_f32(dv[i]).to_bits(),
                            "d={d} b={b} t={t} h={h} V[{i}]"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn one_token_appends_equal_one_shot_append() {
    let sh = shape(1, 33, 2, 64);
    let mut rng = StdRng::seed_from_u64(7);
    let n = 33;
    let k = gaussian_bf16(&mut rng, n * 2 * 64, 2.0);
    let v = gaussian_bf16(&mut rng, n * 2 * 64, 0.5);
    let mut a = UltraQuantCache::new(sh, &CPU).unwrap();
    a.append(&tensor(&k, &[n, 2, 64]), &tensor(&v, &[n, 2, 64]))
        .unwrap();
    let mut b = UltraQuantCache::new(sh, &CPU).unwrap();
    for t in 0..n {
        let r = t * 2 * 64..(t + 1) * 2 * 64;
        b.append(
            &tensor(&k[r.clone()], &[1, 1, 2, 64]),
            &tensor(&v[r], &[1, 1, 2, 64]),
        )
        .unwrap();
    }
    let bytes = |c: &UltraQuantCache| {
        c.slots()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<u8>()
            .unwrap()
    };
    assert_eq!(bytes(&a), bytes(&b));
    assert_eq!(a.lens(), b.lens());
}

/// Reference outputs `[batch][q_heads][d]` of f64 attention over `hist` with queries `q`;
/// `quantized` = over the cache's dequantized K (rotated, with q rotated) and V.
fn reference(
    cache: &KvCache,
    hist: &History,
    q: &[bf16],
    q_heads: usize,
    quantized: bool,
) -> Vec<f64> {
    let sh = cache.shape();
    let (kh, d) = (sh.kv_heads, sh.head_dim);
    let group = q_heads / kh;
    let slots = quantized.then(|| {
        uq(cache)
            .slots()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<u8>()
            .unwrap()
    });
    let slot = if quantized {
        slot_size(d, None).unwrap()
    } else {
        0
    };
    let mut out = Vec::with_capacity(sh.batch * q_heads * d);
    for (b, (k, v)) in hist.iter().enumerate() {
        let n = cache.lens()[b];
        for h in 0..q_heads {
            let kvh = h / group;
            let qv = to_f32(&q[(b * q_heads + h) * d..][..d]);
            let (mut kr, mut vr) = (Vec::with_capacity(n * d), Vec::with_capacity(n * d));
            for t in 0..n {
                if let Some(s) = &slots {
                    let at = ((b * sh.capacity + t) * kh + kvh) * slot;
                    let (dk, dv) = decode_slot(&s[at..at + slot], d).unwrap();
                    kr.extend(dk);
                    vr.extend(dv);
                } else {
                    kr.extend(to_f32(&k[(t * kh + kvh) * d..][..d]));
                    vr.extend(to_f32(&v[(t * kh + kvh) * d..][..d]));
                }
            }
            let qv = if quantized { wht_f64(&qv) } else { qv };
            out.extend(attend_f64(&qv, &kr, &vr, d));
        }
    }
    out
}

/// f64 attention for a cache with an exact window of `w` tokens: the dequantized slots
/// (rotated basis) for tokens before `len - w`, the appended BF16 K (rotated here by the
/// dense f64 transform) and V for the last `w`; q rotated.
fn reference_window(
    cache: &KvCache,
    hist: &History,
    w: usize,
    q: &[bf16],
    q_heads: usize,
) -> Vec<f64> {
    let sh = cache.shape();
    let (kh, d) = (sh.kv_heads, sh.head_dim);
    let group = q_heads / kh;
    let slots = uq(cache)
        .slots()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<u8>()
        .unwrap();
    let slot = slot_size(d, None).unwrap();
    let mut out = Vec::with_capacity(sh.batch * q_heads * d);
    for (b, (k, v)) in hist.iter().enumerate() {
        let n = cache.lens()[b];
        for h in 0..q_heads {
            let kvh = h / group;
            let (mut kr, mut vr) = (Vec::with_capacity(n * d), Vec::with_capacity(n * d));
            for t in 0..n {
                if t + w < n {
                    let at = ((b * sh.capacity + t) * kh + kvh) * slot;
                    let (dk, dv) = decode_slot(&slots[at..at + slot], d).unwrap();
                    kr.extend(dk);
                    vr.extend(dv);
                } else {
                    kr.extend(wht_f64(&to_f32(&k[(t * kh + kvh) * d..][..d])));
                    vr.extend(to_f32(&v[(t * kh + kvh) * d..][..d]));
                }
            }
            let qv = wht_f64(&to_f32(&q[(b * q_heads + h) * d..][..d]));
            out.extend(attend_f64(&qv, &kr, &vr, d));
        }
    }
    out
}

/// Exact window: attention over FP4 slots for older tokens and the exact BF16 values for
/// the last `w`, against the f64 reference of the same K/V, with the tolerance of
/// `attention_matches_f64_on_the_same_kv` plus 2^-17·max|s|-level slack for the rotation of
/// the exact K rows, which the reference does in f64 rounded to f32 and the cache not at all
/// (f32 products: ~1e-7 relative, far inside one BF16 ulp). Windows of 1, 16 and 50 tokens,
/// prompts shorter and longer than the window, then 7 one-token appends (the ring wraps).
#[test]
fn exact_window_attention_matches_f64() {
    for (wi, &w) in [1usize, 16, 50].iter().enumerate() {
        for (ci, &n) in [1usize, 17, 97, 300].iter().enumerate() {
            for d in [64, 128] {
                let (kh, q_heads) = (2, 8);
                let prompts = [n, n / 2 + 1, 3];
                let sh = shape(3, n.max(3) + 8 + w, kh, d);
                let seed = (wi * 10 + ci) as u64;
                let (cache, hist) =
                    build_window(KvCacheKind::UltraQuant, sh, w, &prompts, 7, 300 + seed);
                assert_eq!(cache.window(), w);
                let q = queries(400 + seed, 3 * q_heads * d);
                let got = attend(&cache, &q, q_heads);
                let want = reference_window(&cache, &hist, w, &q, q_heads);
                let vmax = max_abs_v(&hist);
                let (r, i) = worst_ulp_ratio(&got, &want, 1e-5 * vmax);
                assert!(
                    r <= 1.0,
                    "window {w} n={n} d={d}: element {i} is {} vs {} ({r:.2} of the tolerance)",
                    got[i],
                    want[i]
                );
                // The window must matter: without it the same slots give other outputs.
                if n > 16 {
                    let plain = reference(&cache, &hist, &q, q_heads, true);
                    let (r0, _) = worst_ulp_ratio(&got, &plain, 1e-5 * vmax);
                    assert!(
                        r0 > 1.0,
                        "window {w} n={n} d={d}: output equals the FP4-only one"
                    );
                }
            }
        }
    }
}

/// Exact window read-back: the last `min(len, w)` tokens are the appended values bit for
/// bit, older ones the dequantized slots (equal to a cache without the window); appends of
/// more tokens than the window at once and single tokens that wrap the ring.
#[test]
fn exact_window_read_back() {
    let (kh, d, w) = (3, 64, 16);
    let sh = shape(2, 200, kh, d);
    let (win, hist) = build_window(KvCacheKind::UltraQuant, sh, w, &[37, 5], 23, 77);
    let (plain, _) = build_window(KvCacheKind::UltraQuant, sh, 0, &[37, 5], 23, 77);
    for (b, (hk, hv)) in hist.iter().enumerate() {
        let n = win.lens()[b];
        let (k, v) = win.read_bf16(b).unwrap();
        let (pk, pv) = plain.read_bf16(b).unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<bf16>().unwrap();
        let (k, v, pk, pv) = (flat(&k), flat(&v), flat(&pk), flat(&pv));
        let cut = n.saturating_sub(w) * kh * d;
        assert_eq!(k.len(), n * kh * d);
        assert_eq!(k[..cut], pk[..cut], "seq {b}: dequantized part");
        assert_eq!(v[..cut], pv[..cut], "seq {b}: dequantized part");
        assert_eq!(k[cut..], hk[cut..], "seq {b}: exact K window");
        assert_eq!(v[cut..], hv[cut..], "seq {b}: exact V window");
        assert_ne!(
            k[cut..],
            pk[cut..],
            "seq {b}: the window must differ from FP4"
        );
    }
    let err = UltraQuantCache::with_window(shape(1, 8, 1, 64), 9, &CPU).unwrap_err();
    assert!(
        err.to_string().contains("window 9 exceeds the capacity 8"),
        "{err}"
    );
}

/// max |v| over every appended V value.
fn max_abs_v(hist: &History) -> f64 {
    hist.iter()
        .flat_map(|h| h.1.iter())
        .fold(0f64, |m, x| m.max(f64::from(x.to_f32()).abs()))
}

fn queries(seed: u64, n: usize) -> Vec<bf16> {
    gaussian_bf16(&mut StdRng::seed_from_u64(seed), n, 1.0)
}

fn attend(cache: &KvCache, q: &[bf16], q_heads: usize) -> Vec<bf16> {
    let sh = cache.shape();
    let qt = tensor(q, &[sh.batch, q_heads, sh.head_dim]);
    let out = cache.decode_attention(&qt).unwrap();
    assert_eq!(out.dims(), &[sh.batch, q_heads, sh.head_dim]);
    assert_eq!(out.dtype(), DType::BF16);
    out.flatten_all().unwrap().to_vec1::<bf16>().unwrap()
}

/// The CPU forward against f64 attention over the same K/V (UltraQuant: the dequantized
/// slots, q rotated by a dense f64 Walsh–Hadamard). The forward is f32 throughout, so it is
/// within ~1e-6 relative of the f64 value before its single BF16 rounding: allow one BF16
/// ulp of the reference, plus 1e-5 · max|v| for elements that are near zero through
/// cancellation (f32 sums of terms up to max|v|).
#[test]
fn attention_matches_f64_on_the_same_kv() {
    for kind in [KvCacheKind::UltraQuant, KvCacheKind::Bf16] {
        // The BF16 cache also takes head_dims that are not powers of two (Phi-2: 80, Phi-3: 96).
        let dims: &[usize] = match kind {
            KvCacheKind::UltraQuant => &[64, 128],
            KvCacheKind::Bf16 => &[64, 80, 96, 128],
        };
        for (ci, &n) in [1usize, 17, 97, 4097].iter().enumerate() {
            for &d in dims {
                let (kh, q_heads) = (2, 8);
                let prompts = [n, n / 2 + 1, 3];
                let sh = shape(3, n.max(3) + 1, kh, d);
                let (cache, hist) = build(kind, sh, &prompts, 1, 100 + ci as u64);
                let q = queries(200 + ci as u64, 3 * q_heads * d);
                let got = attend(&cache, &q, q_heads);
                let want = reference(&cache, &hist, &q, q_heads, kind == KvCacheKind::UltraQuant);
                let vmax = max_abs_v(&hist);
                let (r, i) = worst_ulp_ratio(&got, &want, 1e-5 * vmax);
                assert!(
                    r <= 1.0,
                    "{kind:?} n={n} d={d}: element {i} is {} vs {} ({r:.2} of the tolerance)",
                    got[i],
                    want[i]
                );
            }
        }
    }
}

/// UltraQuant attention against f64 attention over the unquantized BF16 K/V.
///
/// Error model (first order, iid zero-mean data): with K̂ = K + δK, V̂ = V + δV, the output
/// error is `Σ_t p_t δv_t + Σ_t p_t (δs_t − δs̄) v_t` with `δs_t = q·δk_t/√D`.
/// * The zero-mean parts are sums of independent terms weighted like `o = Σ_t p_t v_t`
///   itself, so relative to ‖o‖ they are `ε_v` and `σ(δs) = ε_k · rms(q) · rms(k)`, where
///   `ε_k`, `ε_v` are the relative RMS quantization errors of K and V (the rotation is
///   orthonormal, so ε_k is the same in both bases). E2M1 + UE8M0/32 with c = 0.156 gives
///   ε ≈ 0.13 on Gaussian groups.
/// * The format's tie rule (a value on a midpoint goes to the lower level, also for negative
///   values) biases δV: mean `b ≈ −0.002` on unit-Gaussian BF16 data. A bias does not average
///   out: it adds `b` to every output element, `β = |b|·√(q_heads·D) / ‖o‖` relative. For
///   zero-mean V and nearly uniform attention ‖o‖ shrinks like `1/√n`, so β grows with the
///   context (≈ 0.22 at 32k here); a K bias shifts every score equally and cancels.
///
/// Predicted relative L2 error `√(ε_v² + σ(δs)² + β²)`, with ε and b measured on the test's
/// data; the test asserts the measured error is within 1.25× the prediction (+0.01 for the
/// finite sample) and the cosine similarity within the same bound (`cos ≥ 1/√(1 + bound²)`).
/// Measured values are in docs/accuracy.md.
#[test]
fn ultraquant_attention_error_vs_unquantized() {
    let (kh, q_heads, d) = (2, 8, 128);
    println!("context  eps_k   eps_v   V bias    beta    predicted  rel_l2   cosine");
    for (ci, &n) in [1usize, 17, 97, 4097, 32768].iter().enumerate() {
        let sh = shape(1, n, kh, d);
        let (cache, hist) = build(KvCacheKind::UltraQuant, sh, &[n], 0, 300 + ci as u64);
        let q = queries(400 + ci as u64, q_heads * d);
        let got: Vec<f64> = attend(&cache, &q, q_heads)
            .iter()
            .map(|x| f64::from(x.to_f32()))
            .collect();
        let want = reference(&cache, &hist, &q, q_heads, false);
        let (rk, rv) = cache.read_bf16(0).unwrap();
        let (k, v) = (to_f32(&hist[0].0), to_f32(&hist[0].1));
        let vq = to_f32(&rv.flatten_all().unwrap().to_vec1::<bf16>().unwrap());
        let eps_k = rel_rms(
            &to_f32(&rk.flatten_all().unwrap().to_vec1::<bf16>().unwrap()),
            &k,
        );
        let eps_v = rel_rms(&vq, &v);
        let bias = vq
            .iter()
            .zip(&v)
            .map(|(a, b)| f64::from(a - b))
            .sum::<f64>()
            / v.len() as f64;
        let o_norm = want.iter().map(|x| x * x).sum::<f64>().sqrt();
        let beta = bias.abs() * ((q_heads * d) as f64).sqrt() / o_norm;
        let sigma_s = eps_k * rms(&to_f32(&q)) * rms(&k);
        let predicted = (eps_v.powi(2) + sigma_s.powi(2) + beta.powi(2)).sqrt();
        let (rel, cos) = rel_l2_and_cos(&got, &want);
        println!("{n:7}  {eps_k:.4}  {eps_v:.4}  {bias:+.5}  {beta:.4}  {predicted:.4}     {rel:.4}   {cos:.5}");
        let bound = 1.25 * predicted + 0.01;
        assert!(
            rel <= bound,
            "n={n}: relative L2 error {rel:.4} above {bound:.4}"
        );
        let cos_min = 1.0 / (1.0 + bound * bound).sqrt();
        assert!(cos >= cos_min, "n={n}: cosine {cos:.5} below {cos_min:.5}");
    }
}

#[test]
fn kinds_share_the_interface() {
    let sh = shape(2, 16, 2, 64);
    for kind in [KvCacheKind::Bf16, KvCacheKind::UltraQuant] {
        let (mut cache, hist) = build(kind, sh, &[3, 9], 2, 11);
        assert_eq!(cache.kind(), kind);
        assert_eq!(cache.lens(), &[5, 11]);
        let per_token = match kind {
            KvCacheKind::Bf16 => 2 * 2 * 64 * 2,
            KvCacheKind::UltraQuant => 2 * 68,
        };
        assert_eq!(cache.bytes_per_token(), per_token);
        let (k, v) = cache.read_bf16(1).unwrap();
        assert_eq!(k.dims(), &[11, 2, 64]);
        if kind == KvCacheKind::Bf16 {
            assert_eq!(
                k.flatten_all().unwrap().to_vec1::<bf16>().unwrap(),
                hist[1].0
            );
            assert_eq!(
                v.flatten_all().unwrap().to_vec1::<bf16>().unwrap(),
                hist[1].1
            );
        }
        cache.reset_seq(0).unwrap();
        assert_eq!(cache.lens(), &[0, 11]);
        assert_eq!(cache.read_bf16(0).unwrap().0.dims(), &[0, 2, 64]);
        cache.reset().unwrap();
        assert_eq!(cache.lens(), &[0, 0]);
        let z = Tensor::zeros((2, 16, 2, 64), DType::BF16, &CPU).unwrap();
        cache.append(&z, &z).unwrap();
        assert_eq!(cache.lens(), &[16, 16]);
    }
}

#[test]
fn errors_are_reported_not_panics() {
    for kind in [KvCacheKind::Bf16, KvCacheKind::UltraQuant] {
        let bad: &[usize] = match kind {
            KvCacheKind::UltraQuant => &[0, 16, 48, 96],
            KvCacheKind::Bf16 => &[0, 7, 81],
        };
        for &d in bad {
            assert!(
                KvCache::new(kind, shape(1, 8, 1, d), &CPU).is_err(),
                "{kind:?} head_dim {d}"
            );
        }
        assert!(KvCache::new(kind, shape(0, 8, 1, 64), &CPU).is_err());
        assert!(KvCache::new(kind, shape(1, 0, 1, 64), &CPU).is_err());
        assert!(KvCache::new(kind, shape(1, usize::MAX / 2, 1024, 64), &CPU).is_err());

        let mut c = KvCache::new(kind, shape(2, 4, 2, 64), &CPU).unwrap();
        let kv = |n: usize| Tensor::zeros((2, n, 2, 64), DType::BF16, &CPU).unwrap();
        c.append(&kv(3), &kv(3)).unwrap();
        let e = c.append(&kv(2), &kv(2)).unwrap_err().to_string();
        assert!(e.contains("capacity"), "{e}");
        assert_eq!(
            c.lens(),
            &[3, 3],
            "a failed append must not change the lengths"
        );
        c.append(&kv(1), &kv(1)).unwrap();
        let one = Tensor::zeros((1, 2, 64), DType::BF16, &CPU).unwrap();
        assert!(c.append_seq(0, &one, &one).is_err(), "append_seq overflow");
        assert!(
            c.append_seq(2, &one, &one).is_err(),
            "append_seq sequence out of range"
        );

        let f32kv = Tensor::zeros((2, 1, 2, 64), DType::F32, &CPU).unwrap();
        assert!(c.append(&f32kv, &f32kv).is_err(), "dtype");
        let wrong = Tensor::zeros((2, 1, 3, 64), DType::BF16, &CPU).unwrap();
        assert!(c.append(&wrong, &wrong).is_err(), "kv_heads");
        assert!(c.append(&kv(1), &wrong).is_err(), "k/v shapes differ");
        assert!(c.append(&one, &one).is_err(), "3-d k/v need batch 1");
        let empty = Tensor::zeros((2, 0, 2, 64), DType::BF16, &CPU).unwrap();
        assert!(c.append(&empty, &empty).is_err(), "no tokens");

        let q = |h: usize, dt: DType| Tensor::zeros((2, h, 64), dt, &CPU).unwrap();
        assert!(c.decode_attention(&q(4, DType::BF16)).is_ok());
        assert!(
            c.decode_attention(&q(3, DType::BF16)).is_err(),
            "q_heads not a multiple of kv_heads"
        );
        assert!(c.decode_attention(&q(4, DType::F32)).is_err(), "q dtype");
        assert!(
            c.decode_attention(&Tensor::zeros((1, 4, 64), DType::BF16, &CPU).unwrap())
                .is_err(),
            "batch"
        );
        assert!(c.read_bf16(2).is_err());
        c.reset_seq(1).unwrap();
        let e = c
            .decode_attention(&q(4, DType::BF16))
            .unwrap_err()
            .to_string();
        assert!(e.contains("empty"), "{e}");
        assert!(c.reset_seq(5).is_err());
    }
}
