//! Tensor-parallel sharding on the CPU (`candle_fp4::tensor_parallel`): every rank's layer
//! is built from one unsharded layer and run on the same input, with 1–4 ranks, M in
//! {1, 3, 8} (and 40 for column-parallel), N not a multiple of 128 and per-rank
//! scale-block counts not a multiple of 4.
//!
//! * Column-parallel (plain, fused `q | k | v` over GQA heads, fused `gate | up` with
//!   `forward_silu_mul`): the ranks' outputs side by side are the unsharded output **bit
//!   for bit** wherever the CPU runs the GEMV (M ≤ 32, K % 64 == 0): it computes each
//!   row's dot product on its own, in an order set by K alone. On the matmul path the
//!   `gemm` crate's K blocking depends on M and N, so a rank may sum in another FP32
//!   order: there the outputs are checked against a derived bound (see [`check_column`]).
//! * Row-parallel: the all-reduce of the ranks' partial outputs is within a bound derived
//!   from the format (see [`row_bound`]) of the unsharded output, element by element; a
//!   perturbed weight byte on one rank, or the bias kept on a second rank, breaks it.
//! * Bad sizes are errors naming the values, never panics.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_fp4::nvfp4::Nvfp4Quantized;
use candle_fp4::quant_linear::{use_gemv, QuantLinear};
use candle_fp4::tensor_parallel::{
    all_gather_columns, all_reduce_sum, column_nvfp4, column_parallel, column_parallel_parts,
    column_tensor, fused_column_nvfp4, fused_column_parallel, fused_column_parallel_parts,
    fused_column_tensor, row_nvfp4, row_parallel, row_parallel_parts, row_tensor, FullWeight,
    HeadSplit, Shard,
};
use half::bf16;
use std::ops::Range;

mod quant_linear_common;
use quant_linear_common::{
    bits, f64s, float_weight, quantized, rand_bias, rand_x, silu_mul_ref, F32_U,
};

const CPU: Device = Device::Cpu;
const MS: [usize; 3] = [1, 3, 8];
/// Column-parallel checks add a prefill-sized M (> 32: the matmul path).
const COLUMN_MS: [usize; 4] = [1, 3, 8, 40];

fn shards(ranks: usize) -> Vec<Shard> {
    Shard::all(ranks).expect("ranks > 0")
}

// ---------------------------------------------------------------------------------
// Shard and HeadSplit
// ---------------------------------------------------------------------------------

#[test]
fn shard_ranges_cover_evenly() -> Result<()> {
    assert_eq!(Shard::single(), Shard::new(0, 1)?);
    for ranks in 1..=4 {
        let mut next = 0;
        for s in shards(ranks) {
            assert_eq!((s.ranks(), s.is_first()), (ranks, s.rank() == 0));
            let r = s.split("n", 12 * ranks)?;
            assert_eq!((r.start, r.len()), (next, 12));
            next = r.end;
            // Fused: each member split on its own, in member order.
            let f = s.split_fused(&[4 * ranks, 2 * ranks, 2 * ranks], 8 * ranks)?;
            let i = s.rank();
            assert_eq!(
                f,
                vec![
                    4 * i..4 * i + 4,
                    4 * ranks + 2 * i..4 * ranks + 2 * i + 2,
                    6 * ranks + 2 * i..6 * ranks + 2 * i + 2
                ]
            );
        }
        assert_eq!(next, 12 * ranks);
    }
    Ok(())
}

#[test]
fn head_split_keeps_whole_gqa_groups() -> Result<()> {
    for (heads, kv, hd, ranks) in [(8, 2, 16, 1), (8, 2, 16, 2), (12, 4, 8, 4), (6, 6, 4, 3)] {
        let mut q_next = 0;
        for s in shards(ranks) {
            let h = HeadSplit::new(heads, kv, hd, s)?;
            assert_eq!((h.heads(), h.kv_heads()), (heads / ranks, kv / ranks));
            assert_eq!(h.qkv_members(), [heads * hd, kv * hd, kv * hd]);
            let rows = h.rank_qkv_rows();
            assert_eq!(rows, [heads / ranks * hd, kv / ranks * hd, kv / ranks * hd]);
            assert_eq!(h.o_proj_in_features(), rows[0]);
            // The rank's query heads are exactly those reading its KV heads.
            let (qr, kvr) = (h.q_head_range(), h.kv_head_range());
            assert_eq!(qr.start, q_next);
            q_next = qr.end;
            for q in 0..heads {
                assert_eq!(qr.contains(&q), kvr.contains(&(q / h.group())), "{q}");
            }
            // The rank's fused rows are its heads' rows.
            let f = s.split_fused(&h.qkv_members(), (heads + 2 * kv) * hd)?;
            assert_eq!(f[0], qr.start * hd..qr.end * hd);
            assert_eq!(f[1], heads * hd + kvr.start * hd..heads * hd + kvr.end * hd);
        }
        assert_eq!(q_next, heads);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Tolerances and shared checks
// ---------------------------------------------------------------------------------

/// Every rank's output of `layers` on `x` (plain or `silu_mul`).
fn rank_outputs(layers: &[QuantLinear], x: &Tensor, silu: bool) -> Result<Vec<Tensor>> {
    layers
        .iter()
        .map(|l| {
            if silu {
                l.forward_silu_mul(x)
            } else {
                l.forward(x)
            }
        })
        .collect()
}

/// BF16 unit roundoff: BF16 has 8 significant bits (7 stored), so round-to-nearest moves
/// a value by at most half an ulp, 2⁻⁸ of its magnitude: 1 + 2⁻⁸ (a tie) rounds to 1, a
/// relative error of 2⁻⁸/(1 + 2⁻⁸). 2⁻⁹ is not a bound.
const U: f64 = 1.0 / 256.0;

/// Bound on `|ŷ − y|` for one layer's output `ŷ` against its exact value `y` (f64, from
/// the dequantized weight): `((1+u)^r − 1)·(mag + e) + e` with `r` the BF16 roundings on
/// the path, `mag = |x·w| + |b|` (what the roundings act on; the bias add can cancel) and
/// `e = (2K + 4)·2⁻²⁴·Σ|x·w|` the FP32 part (accumulation order, the global scale's
/// product, and ModelOpt's dequantization order `e2m1·(e4m3·gs)` against the kernels'
/// `(x·e2m1·e4m3)·gs`).
fn layer_tol(rounds: i32, mag: f64, absdot: f64, k: usize) -> f64 {
    let e = (2 * k + 4) as f64 * F32_U as f64 * absdot;
    ((1.0 + U).powi(rounds) - 1.0) * (mag + e) + e
}

/// BF16 roundings of `layer`'s forward of `m` tokens on the CPU: the GEMV rounds once,
/// the NVFP4 matmul path twice (BF16 product, then × global scale), a bias add once more.
fn rounds(layer_k: usize, nvfp4: bool, bias: bool, m: usize) -> i32 {
    let path = if nvfp4 && !use_gemv(true, None, m, layer_k) {
        2
    } else {
        1
    };
    path + i32::from(bias)
}

/// The exact partial `x[:, cols] · w[:, cols]ᵀ (+ b)` in f64, its magnitude `|x·w| + |b|`
/// and `Σ|x·w|`, each `[m, n]`.
fn partial(
    x: &[f64],
    w: &[f64],
    (m, n, k): (usize, usize, usize),
    cols: Range<usize>,
    b: Option<&[f64]>,
) -> [Vec<f64>; 3] {
    let (mut y, mut mag, mut abs) = (vec![0.0; m * n], vec![0.0; m * n], vec![0.0; m * n]);
    for t in 0..m {
        for j in 0..n {
            let (mut s, mut a) = (0.0, 0.0);
            for c in cols.clone() {
                let p = x[t * k + c] * w[j * k + c];
                s += p;
                a += p.abs();
            }
            let bj = b.map_or(0.0, |b| b[j]);
            y[t * n + j] = s + bj;
            mag[t * n + j] = s.abs() + bj.abs();
            abs[t * n + j] = a;
        }
    }
    [y, mag, abs]
}

/// `got` (gathered rank outputs) against `want` (the unsharded output) where they may sum
/// in different FP32 orders: both are within [`layer_tol`] of the exact f64 output (same
/// K, same roundings), so `|got − want| ≤ 2·layer_tol`.
fn check_within(full: &QuantLinear, x: &Tensor, got: &Tensor, want: &Tensor, what: &str) {
    let (n, k, m) = (full.out_features(), full.in_features(), x.dims()[0]);
    let w = f64s(&full.dequantize().expect("weight"));
    let b = full.bias().map(f64s);
    let [_, mag, abs] = partial(&f64s(x), &w, (m, n, k), 0..k, b.as_deref());
    let r = rounds(k, full.is_nvfp4(), b.is_some(), m);
    for (i, (g, v)) in f64s(got).iter().zip(f64s(want)).enumerate() {
        let tol = 2.0 * layer_tol(r, mag[i], abs[i], k);
        assert!(
            (g - v).abs() <= tol,
            "{what} M={m} element {i}: {g} vs {v}, tol {tol}"
        );
    }
}

/// The ranks' column-parallel `layers` of `full`, run on the same `x` and gathered
/// (`members` of the output), against `full`, for every M of [`COLUMN_MS`]:
///
/// * where the CPU runs the GEMV (M ≤ 32, K % 64 == 0; [`use_gemv`] does not depend on
///   N, so the ranks and `full` take the same path): **bit for bit**, plain and `silu_mul`.
///   The GEMV computes each row's FP32 dot product on its own, in an order set by K only.
/// * on the matmul path: candle's CPU matmul is `gemm`, whose K blocking and kernel
///   depend on M and N (`m·n ≤ 256`: a dot-product kernel, 1024-deep K blocks; `m, n ≤
///   64`: K blocks of `min(k, 512)`; else blocks from the cache sizes, `k / ⌈k / kc⌉`
///   with `kc ≥ 512`; `m = 1`: a GEMV), so for K > 512 a rank can sum an element in
///   another FP32 order than `full` and a BF16 rounding can land one ulp apart (gemm
///   0.19; seen on a few elements in 10⁴ at K = 1040, and on 1 of 360 in the BF16
///   K = 1040, M = 3 case here). Checked against the derived bound ([`check_within`]),
///   and `silu_mul` bit for bit against the rank's own plain output.
fn check_column(
    full: &QuantLinear,
    layers: &[QuantLinear],
    members: &[usize],
    silu: bool,
    what: &str,
) -> Result<()> {
    let k = full.in_features();
    let width = members.iter().sum::<usize>() / layers.len();
    for m in COLUMN_MS {
        let x = rand_x(1000 + m as u64, &[m, k]);
        let exact = use_gemv(true, None, m, k);
        let parts = rank_outputs(layers, &x, false)?;
        for p in &parts {
            assert_eq!(p.dims(), [m, width], "{what} M={m}");
        }
        let (got, want) = (all_gather_columns(&parts, members)?, full.forward(&x)?);
        if exact {
            assert_eq!(bits(&got), bits(&want), "{what} M={m}");
        } else {
            check_within(full, &x, &got, &want, what);
        }
        if !silu {
            continue;
        }
        let silu_parts = rank_outputs(layers, &x, true)?;
        if exact {
            let got = all_gather_columns(&silu_parts, &[full.out_features() / 2])?;
            assert_eq!(
                bits(&got),
                bits(&full.forward_silu_mul(&x)?),
                "{what} M={m}"
            );
        } else {
            for (s, p) in silu_parts.iter().zip(&parts) {
                assert_eq!(bits(s), bits(&silu_mul_ref(p)?), "{what} M={m} silu");
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Column-parallel: bit for bit on the GEMV, bounded on the matmul
// ---------------------------------------------------------------------------------

#[test]
fn column_parallel_nvfp4_matches_unsharded() -> Result<()> {
    // (N, K): K % 64 == 0 runs the GEMV up to M = 32; K = 80, 112 and 1040 the matmul
    // path (1040: more than one gemm K block).
    for (seed, (n, k)) in [(120, 192), (120, 80), (264, 64), (24, 112), (120, 1040)]
        .into_iter()
        .enumerate()
    {
        let q = quantized(seed as u64, n, k);
        let bias = rand_bias(50 + seed as u64, n);
        let w = q.dequantize();
        for ranks in (1..=4).filter(|r| n % r == 0) {
            for b in [None, Some(&bias)] {
                let full = QuantLinear::from_nvfp4(&q, b.cloned(), &CPU)?;
                let mut layers = Vec::new();
                for s in shards(ranks) {
                    let l = column_parallel(&full, s, &Device::Cpu)?;
                    let p = column_parallel_parts(FullWeight::Nvfp4(&q), b, s, &CPU)?;
                    assert_eq!(l.to_nvfp4()?, p.to_nvfp4()?);
                    assert_eq!(l.bias().map(bits), p.bias().map(bits));
                    // The slice is the rows of the unsharded weight, global scale shared.
                    let sl = column_nvfp4(&q, s)?;
                    let rows = s.split("n", n)?;
                    assert_eq!(sl.global_scale, q.global_scale);
                    assert_eq!(sl.dequantize(), w[rows.start * k..rows.end * k]);
                    assert_eq!(l.to_nvfp4()?.as_ref(), Some(&sl));
                    layers.push(l);
                }
                let what = format!("nvfp4 [{n}, {k}] ranks={ranks} bias={}", b.is_some());
                check_column(&full, &layers, &[n], false, &what)?;
            }
        }
    }
    Ok(())
}

#[test]
fn column_parallel_bf16_matches_unsharded() -> Result<()> {
    for (seed, (n, k)) in [(120, 192), (120, 80), (120, 1040)].into_iter().enumerate() {
        let w = float_weight(seed as u64, n, k);
        let bias = rand_bias(60 + seed as u64, n);
        for ranks in (1..=4).filter(|r| n % r == 0) {
            let full = QuantLinear::from_bf16(w.clone(), Some(bias.clone()))?;
            let mut layers = Vec::new();
            for s in shards(ranks) {
                let l = column_parallel(&full, s, &Device::Cpu)?;
                let p = column_parallel_parts(FullWeight::Float(&w), Some(&bias), s, &CPU)?;
                assert!(!l.is_nvfp4());
                assert_eq!(bits(&l.dequantize()?), bits(&p.dequantize()?));
                let rows = s.split("n", n)?;
                assert_eq!(
                    bits(&column_tensor(&w, s)?),
                    bits(&w.narrow(0, rows.start, rows.len())?)
                );
                layers.push(l);
            }
            check_column(
                &full,
                &layers,
                &[n],
                false,
                &format!("bf16 [{n}, {k}] {ranks}"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn fused_qkv_over_gqa_heads_matches_unsharded() -> Result<()> {
    // (heads, kv heads, head_dim, hidden K, ranks).
    for (seed, (heads, kv, hd, k, ranks)) in [
        (8, 2, 16, 128, vec![1, 2]),
        (8, 2, 16, 96, vec![2]),
        (12, 4, 8, 64, vec![1, 2, 4]),
    ]
    .into_iter()
    .enumerate()
    {
        let n = (heads + 2 * kv) * hd;
        let q = quantized(10 + seed as u64, n, k);
        let bias = rand_bias(20 + seed as u64, n);
        let full = QuantLinear::from_nvfp4(&q, Some(bias.clone()), &CPU)?;
        for ranks in ranks {
            let mut layers = Vec::new();
            for s in shards(ranks) {
                let h = HeadSplit::new(heads, kv, hd, s)?;
                let members = h.qkv_members();
                let l = fused_column_parallel(&full, &members, s, &Device::Cpu)?;
                let p = fused_column_parallel_parts(
                    FullWeight::Nvfp4(&q),
                    Some(&bias),
                    &members,
                    s,
                    &CPU,
                )?;
                assert_eq!(l.to_nvfp4()?, p.to_nvfp4()?);
                assert_eq!(l.out_features(), h.rank_qkv_rows().iter().sum::<usize>());
                assert_eq!(l.to_nvfp4()?, Some(fused_column_nvfp4(&q, &members, s)?));
                layers.push(l);
            }
            let members = HeadSplit::new(heads, kv, hd, shards(ranks)[0])?.qkv_members();
            let what = format!("qkv {heads}/{kv}x{hd} K={k} ranks={ranks}");
            check_column(&full, &layers, &members, false, &what)?;
        }
    }
    Ok(())
}

#[test]
fn fused_gate_up_keeps_silu_mul() -> Result<()> {
    // Intermediate size 96 (N = 192, not a multiple of 128 per rank), hidden 192 and 80.
    let inter = 96;
    for (seed, k) in [192usize, 80].into_iter().enumerate() {
        let q = quantized(30 + seed as u64, 2 * inter, k);
        let wf = float_weight(40 + seed as u64, 2 * inter, k);
        let bias = rand_bias(45, 2 * inter);
        let fulls = [
            QuantLinear::from_nvfp4(&q, None, &CPU)?,
            QuantLinear::from_nvfp4(&q, Some(bias.clone()), &CPU)?,
            QuantLinear::from_bf16(wf.clone(), None)?,
        ];
        for full in &fulls {
            for ranks in 1..=4 {
                let layers = shards(ranks)
                    .into_iter()
                    .map(|s| fused_column_parallel(full, &[inter, inter], s, &Device::Cpu))
                    .collect::<Result<Vec<_>>>()?;
                let what = format!(
                    "gate|up K={k} nvfp4={} bias={} ranks={ranks}",
                    full.is_nvfp4(),
                    full.bias().is_some()
                );
                // Plain: [gate | up] gathered; silu·mul: `inter` columns gathered.
                check_column(full, &layers, &[inter, inter], true, &what)?;
            }
        }
        // The float slice: [gate_r | up_r].
        let s = Shard::new(1, 2)?;
        let got = fused_column_tensor(&wf, &[inter, inter], s)?;
        let want = Tensor::cat(&[wf.narrow(0, 48, 48)?, wf.narrow(0, 144, 48)?], 0)?;
        assert_eq!(bits(&got), bits(&want));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Row-parallel: within a derived bound
// ---------------------------------------------------------------------------------

/// Derived bound of a row-parallel output, per element. With `p_r` the exact partial of
/// rank `r` (bias on rank 0), `p̂_r` its BF16 output, `y = Σ p_r` and `ŷ` the unsharded
/// layer's output:
///
/// * `|p̂_r − p_r| ≤ tol_r` and `|ŷ − y| ≤ tol_y` ([`layer_tol`], each with its own
///   roundings and K: a rank's K/ranks may take the matmul path where K does not);
/// * the all-reduce sums the `p̂_r` in FP32 (`R − 1` additions, each within 2⁻²⁴ of the
///   running sum, so within `(R−1)·2⁻²⁴·P` with `P = Σ|p̂_r| ≤ Σ(|p_r| + tol_r)`) and
///   rounds once to BF16 (`u·|sum|`, `|sum| ≤ |y| + Σ tol_r + (R−1)·2⁻²⁴·P`);
///
/// so `|tp − ŷ| ≤ Σ tol_r + tol_y + u·(|y| + Σ tol_r + f) + f` with `f = (R−1)·2⁻²⁴·P`.
/// For one rank it is two layer tolerances (the outputs are in fact identical).
fn row_bound(full: &QuantLinear, x: &Tensor, ranks: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let (n, k) = (full.out_features(), full.in_features());
    let m = x.dim(0)?;
    let (xv, wv) = (f64s(x), f64s(&full.dequantize()?));
    let b = full.bias().map(f64s);
    let nv = full.is_nvfp4();
    let [y, ymag, yabs] = partial(&xv, &wv, (m, n, k), 0..k, b.as_deref());
    let rf = rounds(k, nv, b.is_some(), m);
    let mut bound: Vec<f64> = (0..m * n)
        .map(|i| layer_tol(rf, ymag[i], yabs[i], k))
        .collect();
    let (mut sum_tol, mut sum_mag) = (vec![0.0; m * n], vec![0.0; m * n]);
    for s in shards(ranks) {
        let cols = s.split("k", k)?;
        let kr = cols.len();
        let br = b.as_deref().filter(|_| s.is_first());
        let [_, mag, abs] = partial(&xv, &wv, (m, n, k), cols, br);
        let rr = rounds(kr, nv, br.is_some(), m);
        for i in 0..m * n {
            let t = layer_tol(rr, mag[i], abs[i], kr);
            sum_tol[i] += t;
            sum_mag[i] += mag[i] + t;
        }
    }
    for i in 0..m * n {
        let f = (ranks - 1) as f64 * F32_U as f64 * sum_mag[i];
        bound[i] += sum_tol[i] + U * (y[i].abs() + sum_tol[i] + f) + f;
    }
    Ok((y, bound))
}

/// `(violations, worst |tp − ŷ| / bound)` of the all-reduced outputs of `layers` on `x`.
fn row_check(full: &QuantLinear, layers: &[QuantLinear], x: &Tensor) -> Result<(usize, f64)> {
    let want = f64s(&full.forward(x)?);
    // Rank r sees its K columns of x (in a decode: its column-parallel layer's output).
    let parts = shards(layers.len())
        .into_iter()
        .zip(layers)
        .map(|(s, l)| {
            let cols = s.split("k", x.dim(1)?)?;
            l.forward(&x.narrow(1, cols.start, cols.len())?)
        })
        .collect::<Result<Vec<_>>>()?;
    let tp = all_reduce_sum(&parts)?;
    assert_eq!(tp.dtype(), DType::BF16);
    let got = f64s(&tp);
    let (_, bound) = row_bound(full, x, layers.len())?;
    let mut bad = 0;
    let mut worst = 0f64;
    for ((g, w), b) in got.iter().zip(&want).zip(&bound) {
        let d = (g - w).abs();
        bad += usize::from(d > *b);
        worst = worst.max(d / b);
    }
    Ok((bad, worst))
}

/// A copy of `q` with one code byte of row `row` replaced, the first of the row's block
/// with the largest scale: both nibbles set to ±6 of the opposite sign (a change of at
/// least 6 units of that block scale per value).
fn perturbed(q: &Nvfp4Quantized, row: usize) -> Nvfp4Quantized {
    let mut p = q.clone();
    let s = q.k / 16;
    let scales = &q.weight_scale[row * s..(row + 1) * s];
    let block = (0..s).max_by_key(|&b| scales[b]).unwrap_or(0);
    let i = row * q.k / 2 + block * 8;
    let flip = |c: u8| if c & 8 == 0 { 0xF } else { 0x7 };
    p.weight[i] = flip(q.weight[i] & 0xF) | (flip(q.weight[i] >> 4) << 4);
    p
}

/// A copy of a float weight with element `(0, 0)` raised by 1 (far above its BF16 ulp).
fn bumped(w: &Tensor) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    let mut v = w.flatten_all()?.to_vec1::<f32>()?;
    v[0] += 1.0;
    Tensor::from_vec(v, (n, k), w.device())
}

/// The row-parallel check of `full` over `ranks`, with its two non-vacuity checks.
fn check_row(full: &QuantLinear, ranks: usize, what: &str) -> Result<f64> {
    let k = full.in_features();
    let layers = shards(ranks)
        .into_iter()
        .map(|s| row_parallel(full, s, &Device::Cpu))
        .collect::<Result<Vec<_>>>()?;
    for (r, l) in layers.iter().enumerate() {
        assert_eq!(l.in_features(), k / ranks);
        assert_eq!(
            l.bias().is_some(),
            r == 0 && full.bias().is_some(),
            "{what}"
        );
    }
    let mut worst = 0f64;
    for m in MS {
        let x = rand_x(2000 + m as u64, &[m, k]);
        let (bad, w) = row_check(full, &layers, &x)?;
        assert_eq!(bad, 0, "{what} M={m}: worst |tp - y| / bound {w}");
        worst = worst.max(w);
        if ranks == 1 {
            assert_eq!(bits(&layers[0].forward(&x)?), bits(&full.forward(&x)?));
            assert_eq!(w, 0.0, "{what}: one rank is the unsharded layer");
            continue;
        }
        // One perturbed code byte (BF16: one weight) on the last rank breaks the bound.
        let mut broken = layers.clone();
        let l = &layers[ranks - 1];
        broken[ranks - 1] = match l.to_nvfp4()? {
            Some(q) => QuantLinear::from_nvfp4(&perturbed(&q, 0), None, &CPU)?,
            None => QuantLinear::from_bf16(bumped(&l.dequantize()?)?, None)?,
        };
        assert!(row_check(full, &broken, &x)?.0 > 0, "{what} M={m}: vacuous");
        // So does the bias kept on another rank too (added twice).
        if let Some(b) = full.bias() {
            let mut twice = layers.clone();
            let l = &layers[ranks - 1];
            twice[ranks - 1] = match l.to_nvfp4()? {
                Some(q) => QuantLinear::from_nvfp4(&q, Some(b.clone()), &CPU)?,
                None => QuantLinear::from_bf16(l.dequantize()?, Some(b.clone()))?,
            };
            assert!(
                row_check(full, &twice, &x)?.0 > 0,
                "{what} M={m}: bias twice"
            );
        }
    }
    Ok(worst)
}

#[test]
fn row_parallel_nvfp4_within_derived_bound() -> Result<()> {
    // (N, K, ranks). K/ranks = 48 is 3 scale blocks (not a multiple of 4: padded by the
    // swizzle) and runs the matmul path; 64 and 128 the GEMV.
    let cases = [
        (72, 96, vec![1, 2]),
        (200, 192, vec![1, 2, 3, 4]),
        (40, 256, vec![1, 2, 4]),
        (136, 144, vec![1, 3]),
    ];
    for (seed, (n, k, ranks)) in cases.into_iter().enumerate() {
        let q = quantized(70 + seed as u64, n, k);
        let bias = rand_bias(80 + seed as u64, n);
        for b in [None, Some(bias)] {
            let full = QuantLinear::from_nvfp4(&q, b.clone(), &CPU)?;
            for &r in &ranks {
                let what = format!("nvfp4 [{n}, {k}] ranks={r} bias={}", b.is_some());
                let worst = check_row(&full, r, &what)?;
                eprintln!("{what}: worst |tp - y| / bound = {worst:.3}");
                // From parts: the same layers.
                for s in shards(r) {
                    let a = row_parallel(&full, s, &Device::Cpu)?;
                    let p = row_parallel_parts(FullWeight::Nvfp4(&q), b.as_ref(), s, &CPU)?;
                    assert_eq!(a.to_nvfp4()?, p.to_nvfp4()?);
                    assert_eq!(a.to_nvfp4()?, Some(row_nvfp4(&q, s)?));
                    assert_eq!(p.bias().is_some(), s.is_first() && b.is_some());
                }
            }
        }
    }
    Ok(())
}

#[test]
fn row_parallel_nvfp4_slices_whole_blocks() -> Result<()> {
    // K = 96 over 2: 3 blocks (48 values, 24 code bytes) per rank; N = 72.
    let q = quantized(5, 72, 96);
    let w = q.dequantize();
    for s in shards(2) {
        let sl = row_nvfp4(&q, s)?;
        assert_eq!((sl.n, sl.k, sl.global_scale), (72, 48, q.global_scale));
        assert_eq!((sl.weight.len(), sl.weight_scale.len()), (72 * 24, 72 * 3));
        let d = sl.dequantize();
        for row in 0..72 {
            let c0 = s.rank() * 48;
            assert_eq!(
                d[row * 48..(row + 1) * 48],
                w[row * 96 + c0..row * 96 + c0 + 48]
            );
        }
        // A valid layer: built and run.
        let l = QuantLinear::from_nvfp4(&sl, None, &CPU)?;
        assert_eq!(l.forward(&rand_x(1, &[3, 48]))?.dims(), [3, 72]);
    }
    Ok(())
}

#[test]
fn row_parallel_bf16_within_derived_bound() -> Result<()> {
    for (seed, (n, k, ranks)) in [(72, 96, vec![1, 2, 3, 4]), (120, 256, vec![2, 4])]
        .into_iter()
        .enumerate()
    {
        let w = float_weight(90 + seed as u64, n, k);
        let bias = rand_bias(95, n);
        for b in [None, Some(bias)] {
            let full = QuantLinear::from_bf16(w.clone(), b.clone())?;
            for &r in &ranks {
                let what = format!("bf16 [{n}, {k}] ranks={r} bias={}", b.is_some());
                let worst = check_row(&full, r, &what)?;
                eprintln!("{what}: worst |tp - y| / bound = {worst:.3}");
                for s in shards(r) {
                    let p = row_parallel_parts(FullWeight::Float(&w), b.as_ref(), s, &CPU)?;
                    let want = row_tensor(&w, s)?;
                    assert_eq!(bits(&p.dequantize()?), bits(&want));
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// The all-reduce reference
// ---------------------------------------------------------------------------------

#[test]
fn all_reduce_sum_rounds_once_in_rank_order() -> Result<()> {
    let parts: Vec<Tensor> = (0..3).map(|i| rand_x(300 + i, &[4, 33])).collect();
    let v: Vec<Vec<bf16>> = parts
        .iter()
        .map(|p| p.flatten_all()?.to_vec1::<bf16>())
        .collect::<Result<_>>()?;
    for ranks in 1..=3 {
        let got = all_reduce_sum(&parts[..ranks])?;
        assert_eq!((got.dims(), got.dtype()), ([4, 33].as_slice(), DType::BF16));
        let want: Vec<u16> = (0..4 * 33)
            .map(|i| {
                let s = (0..ranks).fold(0f32, |a, r| a + v[r][i].to_f32());
                bf16::from_f32(s).to_bits()
            })
            .collect();
        assert_eq!(bits(&got), want, "ranks {ranks}");
    }
    // F32 parts stay F32 (FP32 additions in rank order).
    let f: Vec<Tensor> = parts
        .iter()
        .map(|p| p.to_dtype(DType::F32))
        .collect::<Result<_>>()?;
    let got = all_reduce_sum(&f)?;
    assert_eq!(got.dtype(), DType::F32);
    let want = ((&f[0] + &f[1])? + &f[2])?;
    assert_eq!(f64s(&got), f64s(&want));
    Ok(())
}
