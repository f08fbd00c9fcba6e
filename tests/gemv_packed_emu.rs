//! Runs `kernels/gemv_packed.cu` on the CPU through the host emulation of
//! `tests/kv_cache_emu/emu.h` (with `tests/gemv_packed_emu/emu_gemv.h`) and compares what
//! each variant writes with the CPU: the plain, pair, split-K, `silu_mul`, staged and
//! RMSNorm-prologue kernels, the residual epilogue with its sums of squares and `x · w`, and
//! the norm on the accumulator that takes them. It checks logic (indexing, split-K arrivals, epilogues, the
//! prologues' data flow), not timing. Ignored in the default run (a C++ compile of every
//! variant, ~1 minute); CI runs it: `cargo test --test gemv_packed_emu -- --ignored`.
//!
//! Tolerances. Most cases use inputs whose products and sums are exact in f32 (x a multiple
//! of 1/8 in [-2, 2], block scales powers of two, global scale 1/2: every product is a
//! multiple of 2^-6 below 24 in magnitude, so a K ≤ 1088 sum needs ≤ 21 significant bits),
//! so the kernel's FP32 accumulation in any order gives the exact sum and its one rounding
//! to BF16 must equal the FP64 reference rounded once: bit for bit. The residual add is
//! `bf16(resid + y)` on both sides. The `silu_mul` epilogue's `expf` may differ from Rust's
//! `exp` by an f32 ulp, so it may move the BF16 result by one ulp (the tolerance). The norm
//! variants multiply x by a BF16 norm weight of arbitrary bits, so their sums are not exact:
//! |got − ref| ≤ 2^-8 |ref| + 2^-23 K Σ|terms| (FP32 accumulation of K terms in any order is
//! within (K − 1) 2^-24 Σ|terms|, one BF16 rounding within 2^-9 |ref|; both doubled). Their
//! residual inputs are multiples of 1/4 below 5, so the f32 sum of squares is exact in any
//! order and the normalized row equals the CPU norm's bit for bit. The epilogue's sums of
//! squares of ≤ 32 positive terms: within 2^-18 relative; its `bf16(s · w)` bit for bit
//! (the f32 product of two BF16 is exact). The norm on the accumulator: its parts are exact
//! partial sums of x² (multiples of 1/64 below 4: exact in f32 in any order), so m =
//! bf16(sqrt(Σ / K + eps)) in f32 IEEE steps is the kernel's, and the exact f32 sum divided
//! by it and rounded once is the kernel's output: bit for bit.

use candle_core::{Device, Tensor};
use candle_fp4::gemv::packed::{staged_slice_k, PackedLayout};
use candle_fp4::gemv::PackedNvfp4;
use candle_fp4::norm::AddRmsNorm;
use candle_fp4::nvfp4::{swizzle_blockscale_bytes, swizzled_shape};
use candle_fp4::variants::{
    pgemv_fs_name, pgemv_instances, pgemv_kernel_name, pgemv_norm_kernel_name,
    pgemv_pair_kernel_name, pgemv_staged_kernel_name, PGEMV_PAIR_U,
};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::Path;

mod emu_common;

/// Which kernel family a case runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Plain { nt: usize, u: usize },
    Silu { nt: usize, u: usize },
    Pair,
    Staged { u: usize },
    Norm { silu: bool },
}

/// One case: the kernel, the shape, the launch, and what the epilogue / prologue does.
#[derive(Clone, Debug)]
struct Case {
    kind: Kind,
    m: usize,
    n: usize,
    k: usize,
    warps: usize,
    split: usize,
    /// Residual epilogue (plain and pair): resid added, sums of squares written.
    resid: bool,
    /// Norm variants: a delta added to x (else none).
    delta: bool,
    /// Plain, silu, pair and staged kernels: the norm on the accumulator, given x's sums of
    /// squares in this many parts (each token's output divided by the RMS they give; 0: off).
    ss_parts: usize,
    /// Residual epilogue: also `bf16(s · w_norm)` written (the norm on the accumulator's x).
    xw: bool,
}

struct Inputs {
    w: PackedNvfp4,
    /// Exact dequantized weights e2m1 · e4m3 (no global scale), `[n][k]`.
    wf: Vec<f64>,
    x: Vec<bf16>,
    resid: Vec<bf16>,
    delta: Vec<bf16>,
    norm_w: Vec<bf16>,
}

const GLOBAL_SCALE: f32 = 0.5;
const EPS: f32 = 1e-5;

/// A `[n, k]` NVFP4 weight with random codes and power-of-two block scales (some zero).
fn weight(n: usize, k: usize, rng: &mut StdRng) -> PackedNvfp4 {
    let codes: Vec<u8> = (0..n * k / 2).map(|_| rng.random()).collect();
    // E4M3 0x28 = 0.25, 0x30 = 0.5, 0x38 = 1, 0x40 = 2; 0 = a zero block.
    let scales: Vec<u8> = (0..n * k / 16)
        .map(|_| [0x00, 0x28, 0x30, 0x38, 0x38, 0x40][rng.random_range(0..6)])
        .collect();
    let sw = swizzle_blockscale_bytes(&scales, n, k / 16).unwrap();
    let (sn, ss) = swizzled_shape(n, k / 16);
    let c = Tensor::from_vec(codes, (n, k / 2), &Device::Cpu).unwrap();
    let s = Tensor::from_vec(sw, (sn, ss), &Device::Cpu).unwrap();
    PackedNvfp4::pack(&c, &s, GLOBAL_SCALE).unwrap()
}

/// `len` multiples of `step` in `[-lim, lim]`.
fn grid_values(len: usize, step: f32, lim: f32, rng: &mut StdRng) -> Vec<bf16> {
    let q = (lim / step) as i32;
    (0..len)
        .map(|_| bf16::from_f32(rng.random_range(-q..=q) as f32 * step))
        .collect()
}

fn inputs(c: &Case, rng: &mut StdRng) -> Inputs {
    let w = weight(c.n, c.k, rng);
    let wf: Vec<f64> = w
        .dequantize_bf16()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<bf16>()
        .unwrap()
        .iter()
        .map(|v| v.to_f64())
        .collect();
    let norm = matches!(c.kind, Kind::Norm { .. });
    // Norm cases: the residual stream in quarters below 4 (and delta below 1).
    let x = if norm {
        grid_values(c.m * c.k, 0.25, 4.0, rng)
    } else {
        grid_values(c.m * c.k, 0.125, 2.0, rng)
    };
    Inputs {
        w,
        wf,
        x,
        resid: grid_values(c.m * c.n, 0.125, 8.0, rng),
        delta: grid_values(c.m * c.k, 0.25, 1.0, rng),
        norm_w: (0..c.k)
            .map(|_| bf16::from_f32(rng.random_range(0.5f32..1.5)))
            .collect(),
    }
}

fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    let n = std::mem::size_of_val(v);
    let mut out = vec![0u8; n];
    // SAFETY: T is a plain value type (bf16, f32, u8, u32); the copy is byte for byte.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, out.as_mut_ptr(), n) };
    out
}

/// The kernel's name and whether it has two row tiles per group.
fn kernel(kind: Kind) -> (String, bool) {
    match kind {
        Kind::Plain { nt, u } => (pgemv_kernel_name(false, nt, u), false),
        Kind::Silu { nt, u } => (pgemv_kernel_name(true, nt, u), true),
        Kind::Pair => (pgemv_pair_kernel_name(PGEMV_PAIR_U), true),
        Kind::Staged { u } => (pgemv_staged_kernel_name(u), false),
        Kind::Norm { silu } => (pgemv_norm_kernel_name(silu, 1, 3), silu),
    }
}

/// Partition of `k` into `parts` uneven runs (some empty), as `(start, end)`.
fn partition(k: usize, parts: usize, rng: &mut StdRng) -> Vec<(usize, usize)> {
    let mut cuts: Vec<usize> = (0..parts - 1).map(|_| rng.random_range(0..=k)).collect();
    cuts.sort_unstable();
    let mut out = Vec::with_capacity(parts);
    let mut a = 0;
    for c in cuts.into_iter().chain([k]) {
        out.push((a, c));
        a = c;
    }
    out
}

/// The x row the norm variants multiply by (the CPU norm of x (+ delta)), and the sum.
fn normed(c: &Case, inp: &Inputs) -> (Vec<bf16>, Vec<bf16>) {
    let t = |v: &[bf16], cols: usize| Tensor::from_vec(v.to_vec(), (c.m, cols), &Device::Cpu);
    let x = t(&inp.x, c.k).unwrap();
    let d = t(&inp.delta, c.k).unwrap();
    let nw = Tensor::from_vec(inp.norm_w.clone(), c.k, &Device::Cpu).unwrap();
    let norm = AddRmsNorm::new(&nw, EPS).unwrap();
    let (s, h) = norm.forward(&x, c.delta.then_some(&d)).unwrap();
    let v = |t: Tensor| t.flatten_all().unwrap().to_vec1::<bf16>().unwrap();
    (v(h), v(s))
}

/// Writes case `i` into `dir/case{i}` and returns the directory.
fn write_case(dir: &Path, i: usize, c: &Case, inp: &Inputs, rng: &mut StdRng) -> String {
    let name = format!("case{i}");
    let d = dir.join(&name);
    std::fs::create_dir_all(&d).unwrap();
    let l = inp.w.layout();
    let (kname, two) = kernel(c.kind);
    // The residual epilogue and the norm on the accumulator live in the fused-stream twins.
    let kname = if c.resid || c.ss_parts > 0 {
        pgemv_fs_name(&kname)
    } else {
        kname
    };
    let nt = match c.kind {
        Kind::Plain { nt, .. } | Kind::Silu { nt, .. } => nt,
        _ => 1,
    };
    let groups = match c.kind {
        Kind::Pair => l.pair_groups(),
        Kind::Silu { .. } | Kind::Norm { silu: true } => l.groups(true),
        _ => l.groups(false),
    };
    let silu = two && c.kind != Kind::Pair;
    let n_out = if silu { c.n / 2 } else { c.n };
    let smem = match c.kind {
        Kind::Norm { .. } => c.m * (c.k + 8) * 2,
        Kind::Staged { .. } => c.m * (staged_slice_k(c.k, l.npairs, c.split) + 8) * 2,
        _ => 0,
    };
    let sums = if c.delta { c.m * c.k } else { 0 };
    let ss_elems = if c.resid { c.m * groups } else { 0 };
    if c.xw {
        // The next norm's weight, one per output row.
        let w: Vec<bf16> = (0..c.n)
            .map(|_| bf16::from_f32(rng.random_range(0.5f32..1.5)))
            .collect();
        std::fs::write(d.join("xw_w.bin"), bytes(&w)).unwrap();
    }
    let tiles = if two { 2 } else { 1 };
    let partial = groups * c.split * tiles * nt * 32 * 4;
    let norm = matches!(c.kind, Kind::Norm { .. });
    std::fs::write(
        d.join("params.txt"),
        format!(
            "{kname} {} {} {smem} {} {ss_elems} {partial} {} {} {} {} {} {groups} {} {} {} {} {} {} {} {} {} {}\n",
            groups * c.split,
            32 * c.warps,
            sums + c.m * n_out,
            c.m,
            c.n,
            c.k,
            c.k,
            l.half_pad,
            c.split,
            l.npairs,
            c.ss_parts,
            GLOBAL_SCALE * 256.0,
            EPS,
            u8::from(c.resid),
            u8::from(c.ss_parts > 0),
            u8::from(c.delta),
            u8::from(norm),
            u8::from(c.xw),
        ),
    )
    .unwrap();
    let codes = inp.w.codes().to_vec1::<u8>().unwrap();
    let scales = inp.w.scales().to_vec1::<u32>().unwrap();
    std::fs::write(d.join("w.bin"), codes).unwrap();
    std::fs::write(d.join("scales.bin"), bytes(&scales)).unwrap();
    std::fs::write(d.join("x.bin"), bytes(&inp.x)).unwrap();
    if c.resid {
        std::fs::write(d.join("resid.bin"), bytes(&inp.resid)).unwrap();
    }
    if c.delta {
        std::fs::write(d.join("delta.bin"), bytes(&inp.delta)).unwrap();
    }
    if norm {
        std::fs::write(d.join("norm_w.bin"), bytes(&inp.norm_w)).unwrap();
    }
    if c.ss_parts > 0 {
        // Exact partial sums of squares of x's rows over an uneven partition of K.
        let runs = partition(c.k, c.ss_parts, rng);
        let mut ss = Vec::with_capacity(c.m * c.ss_parts);
        for t in 0..c.m {
            for &(a, b) in &runs {
                let row = &inp.x[t * c.k..(t + 1) * c.k];
                ss.push(
                    row[a..b]
                        .iter()
                        .map(|v| v.to_f32() * v.to_f32())
                        .sum::<f32>(),
                );
            }
        }
        std::fs::write(d.join("ss_in.bin"), bytes(&ss)).unwrap();
    }
    name
}

/// `bf16(a + b)` as the kernels' `__hadd_rn` and the CPU's bf16 add round it.
fn add_bf16(a: bf16, b: bf16) -> bf16 {
    bf16::from_f32(a.to_f32() + b.to_f32())
}

fn ulp(v: f64) -> f64 {
    let a = v.abs().max(f64::MIN_POSITIVE);
    2f64.powi(a.log2().floor() as i32 - 7)
}

/// Compares case `i`'s outputs with the CPU; returns the failures as text.
fn check(dir: &Path, name: &str, c: &Case, inp: &Inputs) -> Vec<String> {
    let mut bad = Vec::new();
    let raw = std::fs::read(dir.join(name).join("out.bin")).unwrap();
    let out: Vec<bf16> = raw
        .chunks_exact(2)
        .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
        .collect();
    let (_, two) = kernel(c.kind);
    let silu = two && c.kind != Kind::Pair;
    let n_out = if silu { c.n / 2 } else { c.n };
    let norm = matches!(c.kind, Kind::Norm { .. });
    let (xrow, sum) = if norm {
        normed(c, inp)
    } else {
        (inp.x.clone(), Vec::new())
    };
    let sums = if c.delta { c.m * c.k } else { 0 };
    if c.delta && out[..sums] != sum[..] {
        bad.push(format!("{name} {c:?}: x + delta differs from the CPU's"));
    }
    let gs = f64::from(GLOBAL_SCALE);
    // (reference, Σ|terms|) of output row r, token t.
    let dot = |t: usize, r: usize| {
        let (mut s, mut a) = (0f64, 0f64);
        for kk in 0..c.k {
            let p = inp.wf[r * c.k + kk] * xrow[t * c.k + kk].to_f64();
            s += p;
            a += p.abs();
        }
        (s * gs, a * gs)
    };
    // The norm on the accumulator: each token's m = bf16(sqrt(Σ x² / K + eps)) in f32 IEEE
    // steps as the kernel (and the norm kernel) rounds it; the exact f32 sum (see the
    // tolerances) divided by it and rounded once. Else none (`None`: the plain rounding).
    let acc_norm = !norm && c.ss_parts > 0;
    let mt: Vec<f32> = (0..c.m)
        .map(|t| {
            let sq: f32 = inp.x[t * c.k..(t + 1) * c.k]
                .iter()
                .map(|v| v.to_f32() * v.to_f32())
                .sum();
            bf16::from_f32((sq / c.k as f32 + EPS).sqrt()).to_f32()
        })
        .collect();
    let round = |t: usize, v: f64| {
        if acc_norm {
            bf16::from_f32(v as f32 / mt[t])
        } else {
            bf16::from_f64(v)
        }
    };
    let mut s_exp = vec![0f64; c.m * c.n];
    for t in 0..c.m {
        for r in 0..n_out {
            let got = out[sums + t * n_out + r];
            let (ok, want) = if silu {
                let g = round(t, dot(t, r).0).to_f32();
                let u = round(t, dot(t, r + n_out).0).to_f32();
                let w = bf16::from_f32(g / (1.0 + (-g).exp()) * u);
                let ok = (got.to_f64() - w.to_f64()).abs() <= ulp(w.to_f64()) && got.is_finite();
                (ok, w.to_f64())
            } else if norm {
                let (s, a) = dot(t, r);
                let tol = s.abs() / 256.0 + a * c.k as f64 * 2f64.powi(-23);
                ((got.to_f64() - s).abs() <= tol, s)
            } else {
                let mut w = round(t, dot(t, r).0);
                if c.resid {
                    w = add_bf16(inp.resid[t * c.n + r], w);
                    s_exp[t * c.n + r] = w.to_f64();
                }
                (got.to_bits() == w.to_bits(), w.to_f64())
            };
            if !ok && bad.len() < 8 {
                bad.push(format!(
                    "{name} {c:?}: token {t} row {r}: got {got} want {want}"
                ));
            }
        }
    }
    if c.xw {
        let rd = |f: &str| -> Vec<bf16> {
            std::fs::read(dir.join(name).join(f))
                .unwrap()
                .chunks_exact(2)
                .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                .collect()
        };
        let (xw, w) = (rd("xw.bin"), rd("xw_w.bin"));
        for t in 0..c.m {
            for r in 0..c.n {
                // bf16(s · w): the f32 product of two bf16 is exact, one rounding.
                let want = bf16::from_f32(s_exp[t * c.n + r] as f32 * w[r].to_f32());
                let got = xw[t * c.n + r];
                if got.to_bits() != want.to_bits() && bad.len() < 16 {
                    bad.push(format!(
                        "{name} {c:?}: x · w, token {t} row {r}: got {got} want {want}"
                    ));
                }
            }
        }
    }
    if c.resid {
        let raw = std::fs::read(dir.join(name).join("ss.bin")).unwrap();
        let ss: Vec<f32> = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        // The kernel's groups: one packed row tile each, or two (pair).
        let l = inp.w.layout();
        let per = if c.kind == Kind::Pair { 2 } else { 1 };
        let groups = ss.len() / c.m;
        for t in 0..c.m {
            for g in 0..groups {
                let want: f64 = (16 * per * g..16 * per * (g + 1))
                    .filter_map(|p| l.real_row(p))
                    .map(|r| s_exp[t * c.n + r] * s_exp[t * c.n + r])
                    .sum();
                let got = f64::from(ss[t * groups + g]);
                let within = (got - want).abs() <= want * 2f64.powi(-18);
                if !within && bad.len() < 16 {
                    bad.push(format!(
                        "{name} {c:?}: sum of squares, token {t} group {g}: got {got} want {want}"
                    ));
                }
            }
        }
    }
    bad
}

fn cases() -> Vec<Case> {
    let base = Case {
        kind: Kind::Plain { nt: 1, u: 3 },
        m: 1,
        n: 80,
        k: 320,
        warps: 4,
        split: 1,
        resid: false,
        delta: false,
        ss_parts: 0,
        xw: false,
    };
    let p = |nt, u| Kind::Plain { nt, u };
    vec![
        Case {
            m: 3,
            ..base.clone()
        },
        Case {
            kind: p(1, 5),
            n: 48,
            k: 1088,
            warps: 2,
            split: 3,
            ..base.clone()
        },
        Case {
            kind: p(2, 3),
            m: 11,
            n: 40,
            k: 256,
            split: 2,
            ..base.clone()
        },
        Case {
            kind: p(4, 2),
            m: 27,
            n: 33,
            k: 192,
            warps: 3,
            ..base.clone()
        },
        Case {
            kind: Kind::Pair,
            m: 2,
            n: 41,
            k: 384,
            ..base.clone()
        },
        Case {
            kind: Kind::Silu { nt: 1, u: 3 },
            m: 5,
            n: 80,
            k: 192,
            warps: 3,
            ..base.clone()
        },
        Case {
            kind: Kind::Silu { nt: 2, u: 2 },
            m: 9,
            n: 96,
            k: 256,
            split: 2,
            ..base.clone()
        },
        Case {
            kind: Kind::Staged { u: 3 },
            n: 64,
            k: 640,
            split: 2,
            ..base.clone()
        },
        Case {
            kind: Kind::Staged { u: 5 },
            n: 32,
            k: 1088,
            warps: 2,
            ..base.clone()
        },
        // The norm on the accumulator: the plain (split-K, deep), silu, staged and pair
        // kernels given sums in more parts than a warp's lanes, up to one token tile.
        Case {
            m: 3,
            ss_parts: 5,
            ..base.clone()
        },
        Case {
            kind: p(1, 5),
            m: 8,
            n: 48,
            k: 1088,
            warps: 2,
            split: 3,
            ss_parts: 40,
            ..base.clone()
        },
        Case {
            kind: Kind::Silu { nt: 1, u: 3 },
            m: 2,
            n: 80,
            k: 192,
            warps: 3,
            ss_parts: 7,
            ..base.clone()
        },
        Case {
            kind: Kind::Staged { u: 3 },
            m: 4,
            n: 64,
            k: 640,
            split: 2,
            ss_parts: 33,
            ..base.clone()
        },
        Case {
            kind: Kind::Pair,
            m: 2,
            n: 41,
            k: 384,
            ss_parts: 1,
            ..base.clone()
        },
        // The residual epilogue's x · w_norm: plain after split-K, pair, staged.
        Case {
            m: 4,
            split: 2,
            resid: true,
            xw: true,
            ..base.clone()
        },
        Case {
            kind: Kind::Pair,
            n: 41,
            k: 256,
            resid: true,
            xw: true,
            ..base.clone()
        },
        Case {
            kind: p(1, 5),
            m: 8,
            n: 40,
            k: 448,
            warps: 2,
            resid: true,
            xw: true,
            ..base.clone()
        },
        // The residual epilogue (the fused-stream twins: one token tile): after a split-K
        // sum, with an odd pair tile, 7 tokens over 3 warps.
        Case {
            m: 4,
            split: 2,
            resid: true,
            ..base.clone()
        },
        Case {
            kind: Kind::Pair,
            n: 41,
            k: 256,
            resid: true,
            ..base.clone()
        },
        Case {
            m: 7,
            n: 48,
            k: 128,
            warps: 3,
            resid: true,
            ..base.clone()
        },
        Case {
            kind: p(1, 5),
            m: 8,
            n: 40,
            k: 448,
            warps: 2,
            resid: true,
            ..base.clone()
        },
        Case {
            kind: Kind::Staged { u: 5 },
            n: 48,
            k: 640,
            split: 2,
            resid: true,
            ..base.clone()
        },
        // The norm prologue: x (+ delta) reduced in every CTA, with a split-K sum.
        Case {
            kind: Kind::Norm { silu: false },
            m: 3,
            n: 48,
            k: 512,
            delta: true,
            ..base.clone()
        },
        Case {
            kind: Kind::Norm { silu: true },
            m: 8,
            n: 64,
            k: 256,
            ..base.clone()
        },
        Case {
            kind: Kind::Norm { silu: false },
            m: 5,
            n: 48,
            k: 576,
            warps: 2,
            delta: true,
            ..base.clone()
        },
        Case {
            kind: Kind::Norm { silu: true },
            m: 1,
            n: 32,
            k: 1024,
            split: 2,
            ..base.clone()
        },
    ]
}

/// The kernel source as the emulator compiles it: the dynamic shared memory pointed at the
/// emulator's buffer.
fn emulated_source() -> String {
    let src = include_str!("../kernels/gemv_packed.cu");
    let decl = "extern __shared__ __align__(16) unsigned char pgemv_dyn[];";
    assert!(
        src.contains(decl),
        "dynamic shared memory declaration changed"
    );
    src.replace(decl, "unsigned char* pgemv_dyn = emu_dyn_smem();")
}

/// `{"name", name},` for every kernel of the instances file.
fn registry() -> String {
    // Every instance `pgemv_instances` writes (its last macro argument is the name).
    pgemv_instances()
        .lines()
        .filter(|l| l.starts_with("CFP4_PGEMV"))
        .filter_map(|l| l.trim_end_matches(')').rsplit(", ").next())
        .map(|n| format!("{{\"{n}\", {n}}},\n"))
        .collect()
}

#[test]
#[ignore = "a C++ build of every packed GEMV variant, about a minute; run with --ignored"]
fn packed_gemv_kernels_match_cpu_under_emulation() {
    let Some(cxx) = emu_common::cxx() else { return };
    let files: [(&str, &str); 11] = [
        ("gemv_packed_emu.cu", &emulated_source()),
        ("gemv_packed_instances.inc", &pgemv_instances()),
        ("registry.inc", &registry()),
        (
            "gemv_packed.cuh",
            include_str!("../kernels/gemv_packed.cuh"),
        ),
        (
            "gemv_common.cuh",
            include_str!("../kernels/gemv_common.cuh"),
        ),
        ("pdl.cuh", include_str!("../kernels/pdl.cuh")),
        (
            "nvfp4_decode.cuh",
            include_str!("../kernels/nvfp4_decode.cuh"),
        ),
        (
            "rmsnorm_math.cuh",
            include_str!("../kernels/rmsnorm_math.cuh"),
        ),
        (
            "gemv_packed_layout.cuh",
            include_str!("../kernels/gemv_packed_layout.cuh"),
        ),
        ("emu_gemv.h", include_str!("gemv_packed_emu/emu_gemv.h")),
        ("harness.cpp", include_str!("gemv_packed_emu/harness.cpp")),
    ];
    let dir = emu_common::work_dir("gemv_packed_emu", &files);
    let mut rng = StdRng::seed_from_u64(0x9e37_79b9);
    let cases = cases();
    let mut made = Vec::new();
    let mut index = String::new();
    for (i, c) in cases.iter().enumerate() {
        let inp = inputs(c, &mut rng);
        let name = write_case(&dir, i, c, &inp, &mut rng);
        index += &format!("{name}\n");
        made.push((name, inp));
    }
    std::fs::write(dir.join("cases.txt"), index).unwrap();
    emu_common::build_and_run(&cxx, &dir, &["emu_gemv.h"]);
    let mut bad = Vec::new();
    for (c, (name, inp)) in cases.iter().zip(&made) {
        bad.extend(check(&dir, name, c, inp));
    }
    assert!(
        bad.is_empty(),
        "emulated kernels differ from the CPU:\n{}",
        bad.join("\n")
    );
    // The test must be able to fail: a poisoned output element is caught.
    let mut poisoned = std::fs::read(dir.join("case0/out.bin")).unwrap();
    poisoned[0] ^= 0x40;
    std::fs::write(dir.join("case0/out.bin"), poisoned).unwrap();
    assert!(!check(&dir, "case0", &cases[0], &made[0].1).is_empty());
}

#[test]
fn partition_covers_k() {
    let mut rng = StdRng::seed_from_u64(1);
    let runs = partition(100, 7, &mut rng);
    assert_eq!(runs.len(), 7);
    assert_eq!(runs[0].0, 0);
    assert_eq!(runs[6].1, 100);
    assert!(runs.windows(2).all(|w| w[0].1 == w[1].0));
    let _ = PackedLayout::new(16, 64).unwrap();
}
