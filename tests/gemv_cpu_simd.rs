//! The SIMD CPU GEMV kernels (`CpuKernel::Avx2`, `Avx512`: those this CPU runs) against the
//! scalar oracle (`CpuKernel::Scalar`), NVFP4 and BF16 weights, M = 1..=32, awkward N
//! and K, strided x, `silu_mul` on and off.
//!
//! Two kinds of check:
//!
//! * **Exact inputs**: weights and x chosen so that every product and every partial
//!   sum is exactly representable in FP32 (block scales and the global scale powers of
//!   two, e2m1 values, x = i/16 with |i| ≤ 31; all products are multiples of 2^-7 and
//!   |Σ| ≤ 2048·24 < 2^24·2^-7). Then every summation order gives the same FP32
//!   accumulator, and the outputs must be **bit-identical**, `silu_mul` included.
//!   One wrong weight (a swapped nibble, a wrong scale) changes the result.
//! * **Random inputs** (all 16 codes, random E4M3 scales, random BF16 x). Tolerance:
//!   both kernels compute acc = Σ_k x_k·w_k in FP32 over exact products, in different
//!   orders. Any order is within (K−1)·u32·Σ|x·w| of the exact sum (u32 = 2^-24;
//!   standard recursive-summation bound, K·u32 ≪ 1), and the multiply by the global
//!   scale gs adds u32·|acc·gs|, so the two pre-rounding values a, b satisfy
//!   |a − b| ≤ 2δ, δ = (K + 1)·u32·S with S = gs·Σ|x·w| (computed here in F64). The
//!   (The AVX2 single-token paths multiply each block's 16-value partial sum by the
//!   block scale instead of every weight: a regrouping that adds at most 2 roundings
//!   per product, covered by the same bound for K ≥ 32, since a product passes through
//!   at most K/32 + 8 roundings there: the K % 32 kernel's even/odd chains K/32 + 5,
//!   the K % 64 decode kernel's four chains 1 + K/64 + 5; its AVX-512 version scales
//!   each exact product in the accumulating FMA, K/64 + 6. With M = 1 and K ∈ {64, 576,
//!   1536, 2048} below, the decode kernel (AVX2, and AVX-512 where the CPU has it) and,
//!   on a machine with more than one thread, the spinning pool are what runs.) The
//!   BF16 rounding moves each by at most u16·|value| (u16 = 2^-8), so
//!   `|y_simd − y_scalar| ≤ 2δ + 1.01·u16·(|y_simd| + |y_scalar|)`. That bound allows a
//!   1-ulp flip anywhere, so we also require that at most 2 % of the elements differ at
//!   all: a and b differ by ~2^-19 relative, and land on different BF16 values only when
//!   a rounding boundary (spaced 2^-8 relative) falls between them (~0.1 % of elements).
//!   For `silu_mul` the output must equal, bit for bit, silu(g)·u evaluated in FP32
//!   from the same kernel's own BF16 gate and up (the plain output's halves).

use candle_fp4::gemv::{gemv_cpu_with, CpuKernel, WeightRows};
use candle_fp4::nvfp4::{swizzle_blockscale_bytes, swizzled_shape};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const U32: f64 = 1.0 / (1u64 << 24) as f64;
const U16: f64 = 1.0 / 256.0;
const SHAPES: [(usize, usize); 6] = [
    (2, 32),
    (3, 64),
    (130, 96),
    (257, 576),
    (64, 1536),
    (40, 2048),
];
const MS: [usize; 9] = [1, 2, 3, 4, 5, 7, 8, 13, 32];

fn simd_kernels() -> Vec<CpuKernel> {
    let ks: Vec<_> = CpuKernel::ALL
        .into_iter()
        .filter(|k| *k != CpuKernel::Scalar && k.is_available())
        .collect();
    if ks.is_empty() {
        eprintln!("no SIMD CPU kernel on this machine: nothing to compare");
    }
    ks
}

/// A weight in both layouts the op reads, and its exact values (F64, row-major).
struct Weight {
    n: usize,
    k: usize,
    kind: Kind,
    exact: Vec<f64>,
}

enum Kind {
    Nvfp4 { codes: Vec<u8>, swz: Vec<u8> },
    Bf16(Vec<bf16>),
}

impl Weight {
    fn rows(&self) -> WeightRows<'_> {
        match &self.kind {
            Kind::Nvfp4 { codes, swz } => WeightRows::Nvfp4 {
                codes,
                scales: swz,
                sp: swizzled_shape(self.n, self.k / 16).1,
            },
            Kind::Bf16(w) => WeightRows::Bf16 { w },
        }
    }
}

fn e2m1(code: u8) -> f64 {
    const MAG: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let m = MAG[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// E4M3 byte → value, independent of the crate's codec.
fn e4m3(b: u8) -> f64 {
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f64;
    let mag = if e == 0 {
        m * 2f64.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    };
    if b & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// NVFP4 weight: random codes; scale bytes random (finite, either sign), or powers of
/// two in [2^-2, 2] when `exact`.
fn nvfp4_weight(rng: &mut StdRng, n: usize, k: usize, exact: bool) -> Weight {
    let codes: Vec<u8> = (0..n * k / 2).map(|_| rng.random()).collect();
    let scales: Vec<u8> = (0..n * k / 16)
        .map(|_| {
            if exact {
                (rng.random_range(5u8..=8)) << 3 // exponent field 5..=8: 2^-2..=2
            } else {
                let b: u8 = rng.random_range(0..0x7F); // excludes NaN (0x7F)
                b | (rng.random::<u8>() & 0x80)
            }
        })
        .collect();
    let swz = swizzle_blockscale_bytes(&scales, n, k / 16).expect("swizzle");
    let exact = (0..n * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            let byte = codes[r * k / 2 + c / 2];
            let code = if c % 2 == 0 { byte & 0xF } else { byte >> 4 };
            e2m1(code) * e4m3(scales[r * k / 16 + c / 16])
        })
        .collect();
    Weight {
        n,
        k,
        kind: Kind::Nvfp4 { codes, swz },
        exact,
    }
}

/// BF16 weight: random, or j/8 with |j| ≤ 15 when `exact`.
fn bf16_weight(rng: &mut StdRng, n: usize, k: usize, exact: bool) -> Weight {
    let w: Vec<bf16> = (0..n * k)
        .map(|_| {
            if exact {
                bf16::from_f32(rng.random_range(-15i32..=15) as f32 / 8.0)
            } else {
                bf16::from_f32(rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-3..1)))
            }
        })
        .collect();
    let exact = w.iter().map(|v| v.to_f64()).collect();
    Weight {
        n,
        k,
        kind: Kind::Bf16(w),
        exact,
    }
}

/// `m` rows of `k` values with row stride `rs`; x = i/16, |i| ≤ 31, when `exact`.
fn random_x(rng: &mut StdRng, m: usize, k: usize, rs: usize, exact: bool) -> Vec<bf16> {
    (0..(m - 1) * rs + k)
        .map(|_| {
            if exact {
                bf16::from_f32(rng.random_range(-31i32..=31) as f32 / 16.0)
            } else {
                bf16::from_f32(rng.random_range(-4.0f32..4.0))
            }
        })
        .collect()
}

struct Case<'a> {
    w: &'a Weight,
    x: &'a [bf16],
    rs: usize,
    m: usize,
    gs: f32,
}

impl Case<'_> {
    fn run(&self, kernel: CpuKernel, silu: bool) -> Vec<bf16> {
        let rows = self.w.rows();
        let (n, k) = (self.w.n, self.w.k);
        gemv_cpu_with(kernel, self.x, self.rs, self.m, k, n, &rows, self.gs, silu)
            .expect("gemv_cpu_with")
    }

    /// S = gs·Σ_k |x_k·w_k| per output, `[m][n]`.
    fn abs_sum(&self) -> Vec<f64> {
        let (n, k) = (self.w.n, self.w.k);
        let mut s = vec![0f64; self.m * n];
        for t in 0..self.m {
            let xt = &self.x[t * self.rs..t * self.rs + k];
            for j in 0..n {
                let wr = &self.w.exact[j * k..(j + 1) * k];
                let a: f64 = xt.iter().zip(wr).map(|(x, w)| (x.to_f64() * w).abs()).sum();
                s[t * n + j] = a * self.gs as f64;
            }
        }
        s
    }
}

fn silu_from_halves(plain: &[bf16], m: usize, n: usize) -> Vec<bf16> {
    let h = n / 2;
    let mut out = Vec::with_capacity(m * h);
    for t in 0..m {
        for j in 0..h {
            let g = plain[t * n + j].to_f32();
            let u = plain[t * n + h + j].to_f32();
            out.push(bf16::from_f32(g / (1.0 + (-g).exp()) * u));
        }
    }
    out
}

fn weights(rng: &mut StdRng, n: usize, k: usize, exact: bool) -> [Weight; 2] {
    [
        nvfp4_weight(rng, n, k, exact),
        bf16_weight(rng, n, k, exact),
    ]
}

#[test]
fn simd_matches_scalar_bit_for_bit_on_exact_inputs() {
    let mut rng = StdRng::seed_from_u64(0x51_4d_44);
    for kernel in simd_kernels() {
        for &(n, k) in &SHAPES {
            for w in weights(&mut rng, n, k, true) {
                for &m in &MS {
                    let rs = if m % 2 == 1 { k + 64 } else { k };
                    let x = random_x(&mut rng, m, k, rs, true);
                    for gs in [1.0, 0.25] {
                        let c = Case {
                            w: &w,
                            x: &x,
                            rs,
                            m,
                            gs,
                        };
                        for silu in [false, n % 2 == 0] {
                            let (a, b) = (c.run(kernel, silu), c.run(CpuKernel::Scalar, silu));
                            let differ =
                                a.iter().zip(&b).filter(|(p, q)| p.to_bits() != q.to_bits());
                            assert_eq!(
                                differ.count(),
                                0,
                                "{kernel:?} n={n} k={k} m={m} silu={silu}: differs from the oracle"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn simd_matches_scalar_within_fp32_summation_bound() {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for kernel in simd_kernels() {
        for &(n, k) in &SHAPES {
            for w in weights(&mut rng, n, k, false) {
                for &m in &MS {
                    let rs = if m % 3 == 0 { k + 32 } else { k };
                    let x = random_x(&mut rng, m, k, rs, false);
                    let gs = rng.random_range(1e-3f32..10.0);
                    let c = Case {
                        w: &w,
                        x: &x,
                        rs,
                        m,
                        gs,
                    };
                    let (a, b) = (c.run(kernel, false), c.run(CpuKernel::Scalar, false));
                    let s = c.abs_sum();
                    let mut flips = 0;
                    for (i, ((ya, yb), s)) in a.iter().zip(&b).zip(&s).enumerate() {
                        let (ya, yb) = (ya.to_f64(), yb.to_f64());
                        let delta = (k as f64 + 1.0) * U32 * s;
                        let tol = 2.0 * delta + 1.01 * U16 * (ya.abs() + yb.abs());
                        assert!(
                            (ya - yb).abs() <= tol,
                            "{kernel:?} n={n} k={k} m={m} elem {i}: {ya} vs oracle {yb} (tol {tol})"
                        );
                        flips += usize::from(ya != yb);
                    }
                    assert!(
                        flips * 50 <= a.len(),
                        "{kernel:?} n={n} k={k} m={m}: {flips} of {} elements differ",
                        a.len()
                    );
                    if n % 2 == 0 {
                        let silu = c.run(kernel, true);
                        let want = silu_from_halves(&a, m, n);
                        let same = silu
                            .iter()
                            .zip(&want)
                            .all(|(p, q)| p.to_bits() == q.to_bits());
                        assert!(same, "{kernel:?} n={n} k={k} m={m}: silu_mul epilogue");
                    }
                }
            }
        }
    }
}

#[test]
fn unavailable_or_odd_k_is_handled() {
    let mut rng = StdRng::seed_from_u64(7);
    // K = 48 is not a multiple of 32: every kernel falls back to the oracle's loop.
    for kernel in CpuKernel::ALL.into_iter().filter(|k| k.is_available()) {
        let w = nvfp4_weight(&mut rng, 5, 48, false);
        let x = random_x(&mut rng, 3, 48, 48, false);
        let c = Case {
            w: &w,
            x: &x,
            rs: 48,
            m: 3,
            gs: 1.0,
        };
        assert_eq!(c.run(kernel, false), c.run(CpuKernel::Scalar, false));
    }
    for kernel in CpuKernel::ALL.into_iter().filter(|k| !k.is_available()) {
        let w = bf16_weight(&mut rng, 2, 64, false);
        let x = random_x(&mut rng, 1, 64, 64, false);
        let rows = w.rows();
        assert!(gemv_cpu_with(kernel, &x, 64, 1, 64, 2, &rows, 1.0, false).is_err());
    }
}
