//! Runs `kernels/gemv_packed.cu` on the CPU through the host emulation of
//! `tests/kv_cache_emu/emu.h` (with `tests/gemv_packed_emu/emu_gemv.h`) and compares what
//! each variant writes with the CPU: the plain, pair, split-K, `silu_mul`, staged and
//! RMSNorm-prologue kernels. It checks logic (indexing, split-K arrivals, epilogues, the
//! prologue's data flow), not timing. Ignored in the default run (a C++ compile of every
//! variant, ~1 minute); CI runs it: `cargo test --test gemv_packed_emu -- --ignored`.
//!
//! Tolerances. Most cases use inputs whose products and sums are exact in f32 (x a multiple
//! of 1/8 in [-2, 2], block scales powers of two, global scale 1/2: every product is a
//! multiple of 2^-6 below 24 in magnitude, so a K ≤ 1088 sum needs ≤ 21 significant bits),
//! so the kernel's FP32 accumulation in any order gives the exact sum and its one rounding
//! to BF16 must equal the FP64 reference rounded once: bit for bit. The `silu_mul`
//! epilogue's `expf` may differ from Rust's `exp` by an f32 ulp, so it may move the BF16
//! result by one ulp (the tolerance). The norm variants multiply x by a BF16 norm weight of
//! arbitrary bits, so their sums are not exact: |got − ref| ≤ 2^-8 |ref| + 2^-23 K Σ|terms|
//! (FP32 accumulation of K terms in any order is within (K − 1) 2^-24 Σ|terms|, one BF16
//! rounding within 2^-9 |ref|; both doubled). Their residual inputs are multiples of 1/4
//! below 5, so the f32 sum of squares is exact in any order and the normalized row equals
//! the CPU norm's bit for bit.

use candle_core::{Device, Tensor};
use candle_fp4::gemv::packed::staged_slice_k;
use candle_fp4::gemv::PackedNvfp4;
use candle_fp4::norm::AddRmsNorm;
use candle_fp4::nvfp4::{swizzle_blockscale_bytes, swizzled_shape};
use candle_fp4::variants::{
    pgemv_bw_kernel_name, pgemv_instances, pgemv_kernel_name, pgemv_norm_kernel_name,
    pgemv_pair_kernel_name, pgemv_staged_kernel_name, BwKind, PGEMV_BW_KERNELS, PGEMV_KERNELS,
    PGEMV_NORM_KERNELS, PGEMV_PAIR_U, PGEMV_STAGED_U,
};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::Path;

#[path = "gemv_packed_emu/cases.rs"]
mod cases;
mod emu_common;
use cases::{cases, Case, Kind};

struct Inputs {
    /// The NVFP4 weight (the `Bw` cases: unused, a 16×64 stand-in).
    w: PackedNvfp4,
    /// The `Bw` cases' BF16 weight `[n][k]`.
    wb: Vec<bf16>,
    /// Exact weights (NVFP4: dequantized e2m1 · e4m3, no global scale), `[n][k]`.
    wf: Vec<f64>,
    x: Vec<bf16>,
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
    if matches!(c.kind, Kind::Bw { .. }) {
        // Multiples of 1/16 in [-2, 2] times x's multiples of 1/8 below 2: products are
        // multiples of 2^-7 below 4, so K ≤ 1088 sums need ≤ 20 significant bits (exact).
        let wb = grid_values(c.n * c.k, 0.0625, 2.0, rng);
        return Inputs {
            w: weight(16, 64, rng),
            wf: wb.iter().map(|v| v.to_f64()).collect(),
            wb,
            x: grid_values(c.m * c.k, 0.125, 2.0, rng),
            delta: Vec::new(),
            norm_w: Vec::new(),
        };
    }
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
        wb: Vec::new(),
        wf,
        x,
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
        Kind::Bw { kind, u } => (
            pgemv_bw_kernel_name(kind, u),
            matches!(kind, BwKind::Pair | BwKind::Silu),
        ),
    }
}

/// Whether the case's two row tiles per group are gate and up (else a pair of tiles).
fn is_silu(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Silu { .. }
            | Kind::Norm { silu: true }
            | Kind::Bw {
                kind: BwKind::Silu,
                ..
            }
    )
}

/// The output scale the kernel applies: NVFP4's global scale, 1 for BF16 weights.
fn out_scale(kind: Kind) -> f32 {
    if matches!(kind, Kind::Bw { .. }) {
        1.0
    } else {
        GLOBAL_SCALE
    }
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
fn write_case(dir: &Path, i: usize, c: &Case, inp: &Inputs) -> String {
    let name = format!("case{i}");
    let d = dir.join(&name);
    std::fs::create_dir_all(&d).unwrap();
    let l = inp.w.layout();
    let (kname, two) = kernel(c.kind);
    let nt = match c.kind {
        Kind::Plain { nt, .. } | Kind::Silu { nt, .. } => nt,
        _ => 1,
    };
    let tiles16 = c.n.div_ceil(16);
    let groups = match c.kind {
        Kind::Pair => l.pair_groups(),
        Kind::Silu { .. } | Kind::Norm { silu: true } => l.groups(true),
        Kind::Bw { kind, .. } => match kind {
            BwKind::Pair => tiles16.div_ceil(2),
            BwKind::Silu => (c.n / 2).div_ceil(16),
            BwKind::Plain | BwKind::Staged => tiles16,
        },
        _ => l.groups(false),
    };
    let bw = matches!(c.kind, Kind::Bw { .. });
    // K steps: NVFP4 128-wide pairs, BF16 weights 64-wide chunks.
    let (steps, half_pad) = if bw {
        (c.k / 64, 0)
    } else {
        (l.npairs, l.half_pad)
    };
    let silu = is_silu(c.kind);
    let n_out = if silu { c.n / 2 } else { c.n };
    let smem = match c.kind {
        Kind::Norm { .. } => c.m * (c.k + 8) * 2,
        Kind::Staged { .. } => c.m * (staged_slice_k(c.k, l.npairs, c.split) + 8) * 2,
        Kind::Bw {
            kind: BwKind::Staged,
            ..
        } => c.m * ((64 * steps.div_ceil(c.split)).min(c.k) + 8) * 2,
        _ => 0,
    };
    let sums = if c.delta { c.m * c.k } else { 0 };
    let tiles = if two { 2 } else { 1 };
    let partial = groups * c.split * tiles * nt * 32 * 4;
    let norm = matches!(c.kind, Kind::Norm { .. });
    std::fs::write(
        d.join("params.txt"),
        format!(
            "{kname} {} {} {smem} {} {partial} {} {} {} {} {} {groups} {} {} {} {} {} {}\n",
            groups * c.split,
            32 * c.warps,
            sums + c.m * n_out,
            c.m,
            c.n,
            c.k,
            c.k,
            half_pad,
            c.split,
            steps,
            if bw { 1.0 } else { GLOBAL_SCALE * 256.0 },
            EPS,
            u8::from(c.delta),
            u8::from(norm),
        ),
    )
    .unwrap();
    if bw {
        std::fs::write(d.join("w.bin"), bytes(&inp.wb)).unwrap();
        std::fs::write(d.join("scales.bin"), [0u8; 4]).unwrap();
    } else {
        let codes = inp.w.codes().to_vec1::<u8>().unwrap();
        let scales = inp.w.scales().to_vec1::<u32>().unwrap();
        std::fs::write(d.join("w.bin"), codes).unwrap();
        std::fs::write(d.join("scales.bin"), bytes(&scales)).unwrap();
    }
    std::fs::write(d.join("x.bin"), bytes(&inp.x)).unwrap();
    if c.delta {
        std::fs::write(d.join("delta.bin"), bytes(&inp.delta)).unwrap();
    }
    if norm {
        std::fs::write(d.join("norm_w.bin"), bytes(&inp.norm_w)).unwrap();
    }
    name
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
    let silu = is_silu(c.kind);
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
    let gs = f64::from(out_scale(c.kind));
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
    for t in 0..c.m {
        for r in 0..n_out {
            let got = out[sums + t * n_out + r];
            let (ok, want) = if silu {
                let g = bf16::from_f64(dot(t, r).0).to_f32();
                let u = bf16::from_f64(dot(t, r + n_out).0).to_f32();
                let w = bf16::from_f32(g / (1.0 + (-g).exp()) * u);
                let ok = (got.to_f64() - w.to_f64()).abs() <= ulp(w.to_f64()) && got.is_finite();
                (ok, w.to_f64())
            } else if norm {
                let (s, a) = dot(t, r);
                let tol = s.abs() / 256.0 + a * c.k as f64 * 2f64.powi(-23);
                ((got.to_f64() - s).abs() <= tol, s)
            } else {
                let w = bf16::from_f64(dot(t, r).0);
                (got.to_bits() == w.to_bits(), w.to_f64())
            };
            if !ok && bad.len() < 8 {
                bad.push(format!(
                    "{name} {c:?}: token {t} row {r}: got {got} want {want}"
                ));
            }
        }
    }
    bad
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
    let mut names: Vec<String> = PGEMV_KERNELS
        .iter()
        .map(|&(nt, silu, u)| pgemv_kernel_name(silu, nt, u))
        .collect();
    names.extend(
        PGEMV_NORM_KERNELS
            .iter()
            .map(|&(nt, silu, u)| pgemv_norm_kernel_name(silu, nt, u)),
    );
    names.extend(PGEMV_STAGED_U.iter().map(|&u| pgemv_staged_kernel_name(u)));
    names.push(pgemv_pair_kernel_name(PGEMV_PAIR_U));
    names.extend(
        PGEMV_BW_KERNELS
            .iter()
            .map(|&(kind, u)| pgemv_bw_kernel_name(kind, u)),
    );
    names
        .iter()
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
        (
            "gemv_packed_timeline.cuh",
            include_str!("../kernels/gemv_packed_timeline.cuh"),
        ),
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
        let name = write_case(&dir, i, c, &inp);
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
