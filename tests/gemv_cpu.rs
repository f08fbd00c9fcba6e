//! The CPU GEMV ops (`nvfp4_gemv`, `bf16_gemv`) against candle's F64 matmul on an
//! independently dequantized weight, for every M in 1..=32.
//!
//! Tolerances (per output element, u32 = 2^-24 the FP32 unit roundoff, u16 = 2^-8 the
//! BF16 unit roundoff, 8 significant bits):
//!
//! * Plain output. The op computes acc = Σ_k x_k·w_k in FP32 (the BF16 products are
//!   exact in FP32: 8 + 8 significant bits ≤ 24 for BF16 weights, 8 + 6 for NVFP4),
//!   then y = BF16(fl(acc·gs)). Any FP32 summation order of K terms is within
//!   K·u32·Σ|x·w| of the exact sum; the multiply by gs adds u32·|acc·gs|; the final
//!   rounding to BF16 adds at most u16·|pre-rounding value|. With r the exact (F64)
//!   reference and S = gs·Σ|x·w|:
//!   `|y - r| ≤ δ + u16·(|r| + δ)`, `δ = (K + 1)·u32·S`.
//! * `silu_mul`. The op rounds gate and up to BF16 (g, u), then returns
//!   BF16(silu(g)·u) evaluated in FP32. The reference rounds its own exact gate and up
//!   to BF16 (g', u'), then computes silu(g')·u' in F64. Kernel and reference BF16
//!   values differ by at most Δg = δ_g + 2·u16·(1.01·|g'| + δ_g) (pre-rounding values
//!   within δ_g of each other can land on adjacent BF16 values), same for up.
//!   |silu'| ≤ 1.1 everywhere and |silu(g)| ≤ |g|, so
//!   `|silu(g)·u - silu(g')·u'| ≤ 1.1·(|u'| + Δu)·Δg + |silu(g')|·Δu =: P`, and with
//!   the FP32 evaluation of silu (a few u32, bounded by 16·u32·|y|) and the final BF16
//!   rounding: `|y - r| ≤ P + u16·(|r| + P) + 16·u32·(|r| + P)`.
//!
//! Beyond the per-element check, the relative L2 error over the whole output must be
//! ≤ u16 + 2^-12: every element is then off by at most its final BF16 rounding
//! (≤ u16·|r|) plus the summation term (~2^-20 relative here). For `silu_mul` this also
//! needs the kernel's and the reference's gate/up to round to the same BF16 values for
//! almost all elements; their pre-rounding values differ by ~2^-20 relative, so they
//! straddle a rounding boundary with probability ~2^-12.

use candle_core::{DType, Device, Tensor};
use candle_fp4::gemv::{bf16_gemv, nvfp4_gemv, MAX_M};
use candle_fp4::nvfp4::{quantize_nvfp4_slice, swizzle_blockscale, Nvfp4Quantized};
use float8::F8E4M3;
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const U32: f64 = 1.0 / (1u64 << 24) as f64;
const U16: f64 = 1.0 / 256.0;

const SHAPES: [(usize, usize); 7] = [
    (576, 576),
    (1536, 576),
    (200, 192),
    (16, 64),
    (130, 320),
    (2, 128),
    (64, 1024),
];

fn dev() -> Device {
    Device::Cpu
}

fn random_bf16(rng: &mut StdRng, len: usize, amp: f32) -> Vec<bf16> {
    (0..len)
        .map(|_| bf16::from_f32(amp * rng.random_range(-1.0f32..1.0)))
        .collect()
}

/// A random weight with per-row amplitudes over two decades (so block scales vary).
fn random_weight(rng: &mut StdRng, n: usize, k: usize) -> Vec<f32> {
    let mut w = vec![0f32; n * k];
    for row in w.chunks_exact_mut(k) {
        let amp = 10f32.powf(rng.random_range(-2.0..0.0));
        for v in row.iter_mut() {
            *v = amp * rng.random_range(-1.0f32..1.0);
        }
    }
    w
}

/// `e2m1 · e4m3` of every element, decoded here from the row-major quantized form
/// (float8 for the scale): independent of the swizzle and of the op's decoder.
fn exact_rows(q: &Nvfp4Quantized) -> Vec<f64> {
    const E2M1: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let s_cols = q.k / 16;
    let mut out = Vec::with_capacity(q.n * q.k);
    for r in 0..q.n {
        for c in 0..q.k {
            let byte = q.weight[r * q.k / 2 + c / 2];
            let code = if c.is_multiple_of(2) {
                byte & 0xF
            } else {
                byte >> 4
            };
            let mag = E2M1[(code & 7) as usize];
            let v = if code & 8 != 0 { -mag } else { mag };
            let s = F8E4M3::from_bits(q.weight_scale[r * s_cols + c / 16]).to_f64();
            out.push(v * s);
        }
    }
    out
}

/// Exact reference in F64 via candle's matmul: (y, S) with y = gs·x·Wᵀ and
/// S = gs·|x|·|W|ᵀ, both `[m, n]`.
fn reference(x: &Tensor, w64: &Tensor, gs: f64) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let x64 = x.to_dtype(DType::F64).unwrap();
    let y = (x64.matmul(&w64.t().unwrap()).unwrap() * gs).unwrap();
    let s = (x64
        .abs()
        .unwrap()
        .matmul(&w64.abs().unwrap().t().unwrap())
        .unwrap()
        * gs)
        .unwrap();
    (y.to_vec2().unwrap(), s.to_vec2().unwrap())
}

fn bf16_round(v: f64) -> f64 {
    bf16::from_f64(v).to_f64()
}

fn silu64(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// Checks `got` (`[m, n]` or `[m, n/2]` with silu_mul) element by element against the
/// reference with the tolerances of the module docs; returns the relative L2 error.
fn check(
    what: &str,
    got: &Tensor,
    y: &[Vec<f64>],
    s: &[Vec<f64>],
    k: usize,
    silu_mul: bool,
) -> f64 {
    let m = y.len();
    let n = y[0].len();
    let out_n = if silu_mul { n / 2 } else { n };
    assert_eq!(got.dims(), [m, out_n], "{what}: shape");
    assert_eq!(got.dtype(), DType::BF16, "{what}: dtype");
    let got: Vec<Vec<f64>> = got.to_dtype(DType::F64).unwrap().to_vec2().unwrap();
    let delta = |t: usize, j: usize| (k as f64 + 1.0) * U32 * s[t][j];
    let (mut num, mut den) = (0f64, 0f64);
    for t in 0..m {
        for j in 0..out_n {
            let (r, tol) = if silu_mul {
                let h = n / 2;
                let (g, u) = (bf16_round(y[t][j]), bf16_round(y[t][j + h]));
                // Two values within δ of each other round to BF16 values at most
                // δ + u16·(|a| + |b|) apart; |a|, |b| ≤ 1.01·|g'| + δ.
                let (dlg, dlu) = (delta(t, j), delta(t, j + h));
                let dg = dlg + 2.0 * U16 * (1.01 * g.abs() + dlg);
                let du = dlu + 2.0 * U16 * (1.01 * u.abs() + dlu);
                let r = silu64(g) * u;
                let p = 1.1 * (u.abs() + du) * dg + silu64(g).abs() * du;
                (r, p + U16 * (r.abs() + p) + 16.0 * U32 * (r.abs() + p))
            } else {
                let r = y[t][j];
                let d = delta(t, j);
                (r, d + U16 * (r.abs() + d))
            };
            let e = (got[t][j] - r).abs();
            assert!(
                e <= tol,
                "{what}: [{t}, {j}] got {} want {r} (|err| {e:e} > tol {tol:e})",
                got[t][j]
            );
            num += e * e;
            den += r * r;
        }
    }
    let rel = (num / den).sqrt();
    assert!(
        rel <= U16 + 1.0 / 4096.0,
        "{what}: relative L2 error {rel:e}"
    );
    rel
}

struct Layer {
    gs: f32,
    codes: Tensor,
    swizzled: Tensor,
    /// Exact e2m1·e4m3 weight, F64 `[n, k]` (global scale not applied).
    rows64: Tensor,
    /// A BF16 weight for `bf16_gemv`, and its F64 copy.
    wbf: Tensor,
    wbf64: Tensor,
}

fn layer(rng: &mut StdRng, n: usize, k: usize) -> Layer {
    let w = random_weight(rng, n, k);
    let q = quantize_nvfp4_slice(&w, n, k, None).unwrap();
    let (codes, scales) = q.to_tensors(&dev()).unwrap();
    let swizzled = swizzle_blockscale(&scales).unwrap();
    let rows64 = Tensor::from_vec(exact_rows(&q), (n, k), &dev()).unwrap();
    let wbf = Tensor::from_vec(random_bf16(rng, n * k, 0.1), (n, k), &dev()).unwrap();
    let wbf64 = wbf.to_dtype(DType::F64).unwrap();
    Layer {
        gs: q.global_scale,
        codes,
        swizzled,
        rows64,
        wbf,
        wbf64,
    }
}

fn random_x(rng: &mut StdRng, m: usize, k: usize) -> Tensor {
    Tensor::from_vec(random_bf16(rng, m * k, 1.0), (m, k), &dev()).unwrap()
}

#[test]
fn gemv_matches_f64_matmul_for_every_m() {
    let mut rng = StdRng::seed_from_u64(0x6E_3F);
    let mut worst = 0f64;
    for (n, k) in SHAPES {
        let l = layer(&mut rng, n, k);
        for m in 1..=MAX_M {
            let x = random_x(&mut rng, m, k);
            let (y4, s4) = reference(&x, &l.rows64, l.gs as f64);
            let (yb, sb) = reference(&x, &l.wbf64, 1.0);
            for silu_mul in [false, true] {
                let what = format!("nvfp4 {n}x{k} m={m} silu={silu_mul}");
                let got = nvfp4_gemv(&x, &l.codes, &l.swizzled, l.gs, silu_mul, false).unwrap();
                worst = worst.max(check(&what, &got, &y4, &s4, k, silu_mul));
                let what = format!("bf16 {n}x{k} m={m} silu={silu_mul}");
                let got = bf16_gemv(&x, &l.wbf, silu_mul, false).unwrap();
                worst = worst.max(check(&what, &got, &yb, &sb, k, silu_mul));
            }
        }
    }
    eprintln!("worst relative L2 error: {worst:e}");
}

#[test]
fn strided_x_works_and_transposed_x_errors() {
    let mut rng = StdRng::seed_from_u64(0x57);
    let (n, k) = (130, 320);
    let l = layer(&mut rng, n, k);
    for m in [1usize, 5, 32] {
        // A column window of a wider tensor: row stride k + 128, start offset 64.
        let wide = random_x(&mut rng, m, k + 128);
        let x = wide.narrow(1, 64, k).unwrap();
        assert!(!x.is_contiguous() || m == 1);
        assert_eq!(x.stride(), [k + 128, 1]);
        let xc = x.contiguous().unwrap();
        // Rows from the middle of a taller tensor (contiguous with an offset).
        let tall = random_x(&mut rng, m + 7, k);
        let xt = tall.narrow(0, 3, m).unwrap();
        for silu_mul in [false, true] {
            let a = nvfp4_gemv(&x, &l.codes, &l.swizzled, l.gs, silu_mul, false).unwrap();
            let b = nvfp4_gemv(&xc, &l.codes, &l.swizzled, l.gs, silu_mul, false).unwrap();
            assert_eq!(bits(&a), bits(&b), "nvfp4 strided m={m}");
            let (y, s) = reference(&xc, &l.rows64, l.gs as f64);
            check("nvfp4 strided", &a, &y, &s, k, silu_mul);
            let a = bf16_gemv(&x, &l.wbf, silu_mul, false).unwrap();
            let b = bf16_gemv(&xc, &l.wbf, silu_mul, false).unwrap();
            assert_eq!(bits(&a), bits(&b), "bf16 strided m={m}");

            let got = nvfp4_gemv(&xt, &l.codes, &l.swizzled, l.gs, silu_mul, false).unwrap();
            let (y, s) = reference(&xt, &l.rows64, l.gs as f64);
            check("nvfp4 row offset", &got, &y, &s, k, silu_mul);
            let got = bf16_gemv(&xt, &l.wbf, silu_mul, false).unwrap();
            let (y, s) = reference(&xt, &l.wbf64, 1.0);
            check("bf16 row offset", &got, &y, &s, k, silu_mul);
        }
    }
    // Transposed: [k, 4] -> [4, k] with strides [1, 4].
    let xt = random_x(&mut rng, k, 4).t().unwrap();
    assert_eq!(xt.dims(), [4, k]);
    assert!(nvfp4_gemv(&xt, &l.codes, &l.swizzled, l.gs, false, false).is_err());
    assert!(bf16_gemv(&xt, &l.wbf, false, false).is_err());
}

fn bits(t: &Tensor) -> Vec<u16> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<bf16>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn global_scale_power_of_two_scales_exactly() {
    // y = BF16(fl(acc·gs)): for gs = 2^-5 the multiply and the rounding commute with the
    // scaling (no under/overflow here), so y(2^-5) = 2^-5·y(1) bit for bit.
    let mut rng = StdRng::seed_from_u64(0x25);
    for (n, k) in [(576usize, 576usize), (200, 192)] {
        let l = layer(&mut rng, n, k);
        for m in [1usize, 7, 32] {
            let x = random_x(&mut rng, m, k);
            let one = nvfp4_gemv(&x, &l.codes, &l.swizzled, 1.0, false, false).unwrap();
            let small = nvfp4_gemv(&x, &l.codes, &l.swizzled, 1.0 / 32.0, false, false).unwrap();
            let scaled = (one.to_dtype(DType::F64).unwrap() / 32.0)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            assert_eq!(bits(&small), bits(&scaled), "{n}x{k} m={m}");
            // And gs = 1 is the un-scaled product: compare with the reference at gs = 1.
            let (y, s) = reference(&x, &l.rows64, 1.0);
            check("gs=1", &one, &y, &s, k, false);
            // A non-power-of-two gs is applied too (not ignored, not inverted).
            let g = 0.37f32;
            let got = nvfp4_gemv(&x, &l.codes, &l.swizzled, g, false, false).unwrap();
            let (y, s) = reference(&x, &l.rows64, g as f64);
            check("gs=0.37", &got, &y, &s, k, false);
        }
    }
}

#[test]
fn error_cases() {
    let mut rng = StdRng::seed_from_u64(0xE7);
    let (n, k) = (130, 128);
    let l = layer(&mut rng, n, k);
    let x = random_x(&mut rng, 4, k);
    let ok = |x: &Tensor| nvfp4_gemv(x, &l.codes, &l.swizzled, l.gs, false, false);
    assert!(ok(&x).is_ok());
    assert!(bf16_gemv(&x, &l.wbf, false, false).is_ok());
    // M = 0 and M = 33.
    for m in [0usize, MAX_M + 1] {
        let xm = Tensor::zeros((m, k), DType::BF16, &dev()).unwrap();
        assert!(ok(&xm).is_err(), "m = {m}");
        assert!(bf16_gemv(&xm, &l.wbf, false, false).is_err(), "m = {m}");
    }
    // K = 96: a multiple of 16 (valid NVFP4) but not of 64.
    let l96 = layer(&mut rng, 16, 96);
    let x96 = random_x(&mut rng, 2, 96);
    assert!(nvfp4_gemv(&x96, &l96.codes, &l96.swizzled, l96.gs, false, false).is_err());
    assert!(bf16_gemv(&x96, &l96.wbf, false, false).is_err());
    // Wrong dtypes: x F32; nvfp4 weight BF16; bf16 weight F32 / U8.
    let xf = x.to_dtype(DType::F32).unwrap();
    assert!(ok(&xf).is_err());
    assert!(bf16_gemv(&xf, &l.wbf, false, false).is_err());
    let wbf_half = l.wbf.narrow(1, 0, k / 2).unwrap().contiguous().unwrap();
    assert!(nvfp4_gemv(&x, &wbf_half, &l.swizzled, l.gs, false, false).is_err());
    let wf = l.wbf.to_dtype(DType::F32).unwrap();
    assert!(bf16_gemv(&x, &wf, false, false).is_err());
    assert!(bf16_gemv(&x, &l.codes, false, false).is_err());
    // Weight K mismatch.
    let wk = Tensor::zeros((n, k / 2 + 8), DType::U8, &dev()).unwrap();
    assert!(nvfp4_gemv(&x, &wk, &l.swizzled, l.gs, false, false).is_err());
    let wbk = Tensor::zeros((n, k + 64), DType::BF16, &dev()).unwrap();
    assert!(bf16_gemv(&x, &wbk, false, false).is_err());
    // Wrong scale size: unswizzled [n, k/16], one row of atoms too many; F8E4M3 dtype.
    let raw = Tensor::zeros((n, k / 16), DType::U8, &dev()).unwrap();
    assert!(nvfp4_gemv(&x, &l.codes, &raw, l.gs, false, false).is_err());
    let (np, sp) = l.swizzled.dims2().unwrap();
    let big = Tensor::zeros((np + 128, sp), DType::U8, &dev()).unwrap();
    assert!(nvfp4_gemv(&x, &l.codes, &big, l.gs, false, false).is_err());
    let f8 = Tensor::zeros((np, sp), DType::F8E4M3, &dev()).unwrap();
    assert!(nvfp4_gemv(&x, &l.codes, &f8, l.gs, false, false).is_err());
    // Global scale NaN, 0, negative, infinite.
    for g in [f32::NAN, 0.0, -0.0, -1.0, f32::INFINITY] {
        assert!(
            nvfp4_gemv(&x, &l.codes, &l.swizzled, g, false, false).is_err(),
            "gs = {g}"
        );
    }
    // silu_mul with odd N.
    let lo = layer(&mut rng, 129, k);
    assert!(nvfp4_gemv(&x, &lo.codes, &lo.swizzled, lo.gs, true, false).is_err());
    assert!(nvfp4_gemv(&x, &lo.codes, &lo.swizzled, lo.gs, false, false).is_ok());
    assert!(bf16_gemv(&x, &lo.wbf, true, false).is_err());
    assert!(bf16_gemv(&x, &lo.wbf, false, false).is_ok());
    // 1-d and 3-d x.
    let x1 = x.get(0).unwrap();
    assert_eq!(x1.rank(), 1);
    assert!(ok(&x1).is_err());
    assert!(bf16_gemv(&x1, &l.wbf, false, false).is_err());
    let x3 = x.unsqueeze(0).unwrap();
    assert!(ok(&x3).is_err());
    assert!(bf16_gemv(&x3, &l.wbf, false, false).is_err());
    // 1-d weight.
    let w1 = l.codes.flatten_all().unwrap();
    assert!(nvfp4_gemv(&x, &w1, &l.swizzled, l.gs, false, false).is_err());
}
