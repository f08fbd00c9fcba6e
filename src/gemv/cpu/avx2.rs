//! x86-64 AVX2 + FMA row kernels of the CPU GEMV (see `cpu` for the numerics; `cpu_avx512` is
//! the 16-lane version).
//!
//! NVFP4: one block of 16 E2M1 codes (8 bytes) becomes two 8-lane FP32 vectors: the
//! nibbles index a `pshufb` table of `2·e2m1` (integers −12..=12), which are converted
//! to FP32 and multiplied by `e4m3/2`. Every step is exact (a ≤ 4-bit integer times a
//! 4-bit-significand scale), so each lane holds exactly `e2m1 · e4m3`. The block is then
//! used for up to 4 tokens (one FMA per 8 weights per token). BF16: 8 weights widened to
//! FP32 by a 16-bit shift (exact). Accumulation is FP32 throughout.
//!
//! Single token, NVFP4, `K % 64 == 0` (the decode case, [`single_token_path`]): a separate
//! kernel, `row_nvfp4_t1`. `x` arrives with each block's even elements first (the low
//! nibbles), so the nibbles need no interleave; one `pshufb` per nibble half maps 32
//! codes to the FP16 high bytes of their E2M1 values, `vcvtph2ps` widens them (exact),
//! and the E4M3 scale multiplies the block's partial sum `Σ e2m1·x` (exact products,
//! summed in FP32) once, with one FMA into one of four accumulators. The same sum
//! regrouped: per product at most 1 + K/64 + 5 FP32 roundings (pair sum, accumulator
//! chain, the final 2 + 3 additions), inside the K/32 + 8 that `tests/gemv_cpu_simd.rs`
//! allows.

use super::layout::{
    e2m1_fp16_words, half_e4m3_table, rows_nvfp4_t1, single_token_path, RowBlocks, WeightRows,
};
use candle_core::{bail, Result};
use half::bf16;
use std::arch::x86_64::*;

/// Tokens per kernel call: the weights decoded once are used for this many tokens.
const MAX_T: usize = 4;

/// Sum of the 8 lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// 16 weights of one NVFP4 block (8 code bytes, low nibble first) as two vectors,
/// exactly `e2m1 · 2·half_scale`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn decode_nvfp4(c: &[u8; 8], half_scale: f32) -> [__m256; 2] {
    let [q0, q1] = decode_nvfp4_x2(c);
    let s = _mm256_set1_ps(half_scale);
    [_mm256_mul_ps(q0, s), _mm256_mul_ps(q1, s)]
}

/// `2·e2m1` of the 16 codes of one block as FP32 (exact small integers).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn decode_nvfp4_x2(c: &[u8; 8]) -> [__m256; 2] {
    let lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    let v = _mm_cvtsi64_si128(i64::from_le_bytes(*c));
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
    let q = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
    let w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    let w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));
    [w0, w1]
}

/// One token, NVFP4: `acc += s · (q[0]·x[0..8] + q[1]·x[8..16])` — the block scale on
/// the 16-value partial sum (3 FP operations per block instead of 4).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn fma_block_scaled(acc: &mut __m256, q: [__m256; 2], half_scale: f32, x: &[f32; 16]) {
    // SAFETY: `x` holds 16 FP32 values: two unaligned 8-lane loads.
    let (x0, x1) = unsafe {
        (
            _mm256_loadu_ps(x.as_ptr()),
            _mm256_loadu_ps(x.as_ptr().add(8)),
        )
    };
    let p = _mm256_fmadd_ps(q[1], x1, _mm256_mul_ps(q[0], x0));
    *acc = _mm256_fmadd_ps(p, _mm256_set1_ps(half_scale), *acc);
}

/// 16 BF16 weights as two FP32 vectors (exact).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn decode_bf16(w: &[bf16; 16]) -> [__m256; 2] {
    // SAFETY: `w` is 16 BF16 values = 32 readable bytes; unaligned loads.
    let v = unsafe { _mm256_loadu_si256(w.as_ptr().cast()) };
    let w0 = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)));
    let w1 = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm256_extracti128_si256::<1>(v)));
    [_mm256_castsi256_ps(w0), _mm256_castsi256_ps(w1)]
}

/// `acc[t] += w · x[t][16 values]` for the tokens in `x`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn fma_tokens<const T: usize>(acc: &mut [[__m256; 2]; T], w: [__m256; 2], x: [&[f32; 16]; T]) {
    for t in 0..T {
        // SAFETY: `x[t]` holds 16 FP32 values: two unaligned 8-lane loads.
        let (x0, x1) = unsafe {
            (
                _mm256_loadu_ps(x[t].as_ptr()),
                _mm256_loadu_ps(x[t].as_ptr().add(8)),
            )
        };
        acc[t][0] = _mm256_fmadd_ps(w[0], x0, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w[1], x1, acc[t][1]);
    }
}

/// The 16 values of block `b` of each token row.
#[inline]
fn x_block<'a, const T: usize>(x: &[&'a [[f32; 16]]; T], b: usize) -> [&'a [f32; 16]; T] {
    std::array::from_fn(|t| &x[t][b])
}

/// One weight row: NVFP4 code blocks with their `e4m3/2` scales, or BF16 blocks.
#[derive(Clone, Copy)]
enum Row<'a> {
    /// Codes, and the swizzled scale bytes from the row's first one on (block `b` at
    /// `(b / 4) · 512 + b % 4`), decoded through `table` (`e4m3 / 2`).
    Nvfp4 {
        codes: &'a [[u8; 8]],
        scale_bytes: &'a [u8],
        table: &'a [f32; 256],
    },
    Bf16(&'a [[bf16; 16]]),
}

/// One weight row dotted with `T` token rows over `blocks` 16-value blocks (an even
/// number). `NV` says which slices of the row are used (the other is empty), so the
/// block loop has no branch. With `T ≤ 2`, even and odd blocks go to separate
/// accumulators so that at least 4 FMA chains are in flight.
#[target_feature(enable = "avx2,fma")]
fn row_dot_impl<const T: usize, const NV: bool>(
    codes: &[[u8; 8]],
    (scale_bytes, table): (&[u8], &[f32; 256]),
    w: &[[bf16; 16]],
    x: [&[[f32; 16]]; T],
    blocks: usize,
) -> [f32; T] {
    let zero = _mm256_setzero_ps();
    let mut even = [[zero; 2]; T];
    let mut odd = [[zero; 2]; T];
    // Bounds established once, so the loop indexing needs no checks.
    let (codes, w) = if NV {
        (&codes[..blocks], w)
    } else {
        (codes, &w[..blocks])
    };
    let x: [&[[f32; 16]]; T] = std::array::from_fn(|t| &x[t][..blocks]);
    for b in (0..blocks).step_by(2) {
        // The scales of blocks b, b + 1 (b even): adjacent bytes of the swizzled layout,
        // read in the loop (a separate decode pass cost more than the two loads).
        let (s0, s1) = if NV {
            let i = (b / 4) * 512 + b % 4;
            (
                table[scale_bytes[i] as usize],
                table[scale_bytes[i + 1] as usize],
            )
        } else {
            (0.0, 0.0)
        };
        if NV && T == 1 {
            fma_block_scaled(&mut even[0][0], decode_nvfp4_x2(&codes[b]), s0, &x[0][b]);
            fma_block_scaled(
                &mut odd[0][0],
                decode_nvfp4_x2(&codes[b + 1]),
                s1,
                &x[0][b + 1],
            );
            continue;
        }
        let w0 = if NV {
            decode_nvfp4(&codes[b], s0)
        } else {
            decode_bf16(&w[b])
        };
        fma_tokens(&mut even, w0, x_block(&x, b));
        let w1 = if NV {
            decode_nvfp4(&codes[b + 1], s1)
        } else {
            decode_bf16(&w[b + 1])
        };
        let acc = if T <= 2 { &mut odd } else { &mut even };
        fma_tokens(acc, w1, x_block(&x, b + 1));
    }
    std::array::from_fn(|t| {
        let s = _mm256_add_ps(
            _mm256_add_ps(even[t][0], even[t][1]),
            _mm256_add_ps(odd[t][0], odd[t][1]),
        );
        hsum(s)
    })
}

#[target_feature(enable = "avx2,fma")]
fn row_dot<const T: usize>(row: Row<'_>, x: [&[[f32; 16]]; T], blocks: usize) -> [f32; T] {
    match row {
        Row::Nvfp4 {
            codes,
            scale_bytes,
            table,
        } => row_dot_impl::<T, true>(codes, (scale_bytes, table), &[], x, blocks),
        Row::Bf16(w) => row_dot_impl::<T, false>(&[], (&[], &[0.0; 256]), w, x, blocks),
    }
}

/// One weight row against every token, `T` at a time: `out[t]` for `t < m`.
#[target_feature(enable = "avx2,fma")]
fn row_all_tokens(row: Row<'_>, xb: &[&[[f32; 16]]], blocks: usize, out: &mut [f32]) {
    let mut t0 = 0;
    while t0 < xb.len() {
        let left = xb.len() - t0;
        if left >= MAX_T {
            let x: [_; MAX_T] = std::array::from_fn(|i| xb[t0 + i]);
            out[t0..t0 + MAX_T].copy_from_slice(&row_dot(row, x, blocks));
            t0 += MAX_T;
        } else if left >= 2 {
            let x = [xb[t0], xb[t0 + 1]];
            out[t0..t0 + 2].copy_from_slice(&row_dot(row, x, blocks));
            t0 += 2;
        } else {
            out[t0] = row_dot(row, [xb[t0]], blocks)[0];
            t0 += 1;
        }
    }
}

/// One NVFP4 row against one token in the split layout: `Σ_b s_b · Σ_{i<16} q_{b,i}·x_{b,i}`.
///
/// Four blocks (32 code bytes) per step: the low and high nibbles go through one
/// `pshufb` each, from a table of the E2M1 values as FP16 high bytes (the low byte is
/// always zero), and `vcvtph2ps` widens them to FP32: exact, so every lane holds the
/// E2M1 value and every product `q·x` is exact. Per block: `p = q_even·x_even +
/// q_odd·x_odd` (8 lanes), then `acc_j += p · s_b` with the block's E4M3 scale `s_b`
/// (one FMA), four accumulators `acc_j`, `j = b % 4`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `codes` holds `4·groups` blocks, `scale_bytes` at
/// least `(groups − 1)·512 + 4` bytes, `x` `64·groups` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_nvfp4_t1(
    codes: &[[u8; 8]],
    scale_bytes: &[u8],
    table: &[f32; 256],
    x: &[[f32; 16]],
    groups: usize,
) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let c = codes.as_ptr().cast::<u8>();
    let xp = x.as_ptr().cast::<f32>();
    for g in 0..groups {
        // SAFETY (all pointer reads): in bounds by the caller's contract.
        let [e02, e13, o02, o13] = unsafe { e2m1_fp16_words(c.add(32 * g)) };
        let q = [
            (_mm256_castsi256_si128(e02), _mm256_castsi256_si128(o02)),
            (_mm256_castsi256_si128(e13), _mm256_castsi256_si128(o13)),
            (
                _mm256_extracti128_si256::<1>(e02),
                _mm256_extracti128_si256::<1>(o02),
            ),
            (
                _mm256_extracti128_si256::<1>(e13),
                _mm256_extracti128_si256::<1>(o13),
            ),
        ];
        let sb = unsafe { scale_bytes.as_ptr().add(512 * g) };
        for (j, (e, o)) in q.into_iter().enumerate() {
            let (s, x0, x1) = unsafe {
                let xb = xp.add(64 * g + 16 * j);
                (
                    *table.get_unchecked(*sb.add(j) as usize),
                    _mm256_loadu_ps(xb),
                    _mm256_loadu_ps(xb.add(8)),
                )
            };
            let p = _mm256_fmadd_ps(
                _mm256_cvtph_ps(o),
                x1,
                _mm256_mul_ps(_mm256_cvtph_ps(e), x0),
            );
            acc[j] = _mm256_fmadd_ps(p, _mm256_set1_ps(s), acc[j]);
        }
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum(s)
}

/// AVX2 accumulators of rows `row0..row0 + out.len() / m` (`out[row][token]`), for
/// `k % 32 == 0`.
pub(super) fn rows_avx2(
    rows: &WeightRows<'_>,
    xf: &[f32],
    m: usize,
    k: usize,
    row0: usize,
    out: &mut [f32],
) -> Result<()> {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
        bail!("gemv: the AVX2 kernel needs AVX2 and FMA");
    }
    if !k.is_multiple_of(32) || xf.len() != m * k {
        bail!("gemv: the AVX2 kernel needs K % 32 == 0 and x of [{m}, {k}]");
    }
    if single_token_path(rows, m, k) {
        return rows_nvfp4_t1(rows, xf, k, row0, out, row_nvfp4_t1);
    }
    let blocks = k / 16;
    let xb: Vec<&[[f32; 16]]> = xf.chunks_exact(k).map(|r| r.as_chunks().0).collect();
    let table = half_e4m3_table();
    for (r, o) in out.chunks_exact_mut(m).enumerate() {
        let row = row0 + r;
        let w = match rows.row_blocks(row, k) {
            RowBlocks::Nvfp4 { codes, scale_bytes } => Row::Nvfp4 {
                codes,
                scale_bytes,
                table,
            },
            RowBlocks::Bf16(w) => Row::Bf16(w),
        };
        // SAFETY: AVX2 and FMA were detected above.
        unsafe { row_all_tokens(w, &xb, blocks, o) };
    }
    Ok(())
}
