//! x86-64 AVX-512 row kernels of the CPU GEMV (see `cpu` for the numerics, `cpu_avx2`
//! for the AVX2 version of the same scheme).
//!
//! One NVFP4 block (16 weights, 8 code bytes) is one 16-lane vector: the nibbles index a
//! `pshufb` table of `2·e2m1` (integers −12..=12), widened to 32-bit, converted to FP32
//! and multiplied by `e4m3/2`, all exact, so each lane holds exactly `e2m1 · e4m3`.
//! BF16 weights are widened by a 16-bit shift (exact). The FP32 products are summed in
//! FP32 with FMA, up to 4 tokens per decoded block, 4 independent blocks in flight.

use super::layout::{
    e2m1_fp16_words, half_e4m3_table, rows_nvfp4_t1, single_token_path, RowBlocks, WeightRows,
};
use candle_core::{bail, Result};
use half::bf16;
use std::arch::x86_64::*;

/// Tokens per kernel call: the weights decoded once are used for this many tokens.
const MAX_T: usize = 4;

/// Whether this CPU runs the kernels of this module.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

/// 16 weights of one NVFP4 block (8 code bytes, low nibble first), exactly
/// `e2m1 · 2·half_scale`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn decode_nvfp4(c: &[u8; 8], half_scale: f32) -> __m512 {
    let lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    let v = _mm_cvtsi64_si128(i64::from_le_bytes(*c));
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
    let q = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
    let w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    _mm512_mul_ps(w, _mm512_set1_ps(half_scale))
}

/// 16 BF16 weights as one FP32 vector (exact).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn decode_bf16(w: &[bf16; 16]) -> __m512 {
    // SAFETY: `w` is 16 BF16 values = 32 readable bytes; unaligned load.
    let v = unsafe { _mm256_loadu_si256(w.as_ptr().cast()) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
}

/// `acc[t] += w · x[t]` for the tokens' 16 values of one block.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn fma_tokens<const T: usize>(acc: &mut [__m512; T], w: __m512, x: [&[f32; 16]; T]) {
    for t in 0..T {
        // SAFETY: `x[t]` holds 16 FP32 values: one unaligned 16-lane load.
        let xv = unsafe { _mm512_loadu_ps(x[t].as_ptr()) };
        acc[t] = _mm512_fmadd_ps(w, xv, acc[t]);
    }
}

/// One weight row dotted with `T` token rows over `blocks` 16-value blocks (a multiple
/// of 4). `NV` says which weight slices are used (the other is empty). Blocks `b` go to
/// accumulator set `b % 4` for `T = 1`, `b % 2` for `T = 2`, one set for `T = 4`.
#[target_feature(enable = "avx512f,avx512bw")]
fn row_dot<const T: usize, const NV: bool>(
    codes: &[[u8; 8]],
    (scale_bytes, table): (&[u8], &[f32; 256]),
    w: &[[bf16; 16]],
    x: [&[[f32; 16]]; T],
    blocks: usize,
) -> [f32; T] {
    let zero = _mm512_setzero_ps();
    let mut acc = [[zero; T]; 4];
    let (codes, w) = if NV {
        (&codes[..blocks], w)
    } else {
        (codes, &w[..blocks])
    };
    let x: [&[[f32; 16]]; T] = std::array::from_fn(|t| &x[t][..blocks]);
    for b in (0..blocks).step_by(4) {
        // Blocks b..b + 4 have adjacent scale bytes in the swizzled layout.
        let sb: &[u8] = if NV {
            &scale_bytes[(b / 4) * 512..(b / 4) * 512 + 4]
        } else {
            &[0; 4]
        };
        for j in 0..4 {
            let wv = if NV {
                decode_nvfp4(&codes[b + j], table[sb[j] as usize])
            } else {
                decode_bf16(&w[b + j])
            };
            let set = match T {
                1 => j,
                2 => j % 2,
                _ => 0,
            };
            fma_tokens(&mut acc[set], wv, std::array::from_fn(|t| &x[t][b + j]));
        }
    }
    std::array::from_fn(|t| {
        let s = _mm512_add_ps(
            _mm512_add_ps(acc[0][t], acc[1][t]),
            _mm512_add_ps(acc[2][t], acc[3][t]),
        );
        _mm512_reduce_add_ps(s)
    })
}

/// One weight row against every token, `T` at a time: `out[t]` for `t < m`.
#[target_feature(enable = "avx512f,avx512bw")]
fn row_all_tokens<const NV: bool>(
    codes: &[[u8; 8]],
    scales: (&[u8], &[f32; 256]),
    w: &[[bf16; 16]],
    xb: &[&[[f32; 16]]],
    blocks: usize,
    out: &mut [f32],
) {
    let mut t0 = 0;
    while t0 < xb.len() {
        let left = xb.len() - t0;
        if left >= MAX_T {
            let x: [_; MAX_T] = std::array::from_fn(|i| xb[t0 + i]);
            let y = row_dot::<MAX_T, NV>(codes, scales, w, x, blocks);
            out[t0..t0 + MAX_T].copy_from_slice(&y);
            t0 += MAX_T;
        } else if left >= 2 {
            let x = [xb[t0], xb[t0 + 1]];
            let y = row_dot::<2, NV>(codes, scales, w, x, blocks);
            out[t0..t0 + 2].copy_from_slice(&y);
            t0 += 2;
        } else {
            out[t0] = row_dot::<1, NV>(codes, scales, w, [xb[t0]], blocks)[0];
            t0 += 1;
        }
    }
}

/// One NVFP4 row against one token in the single-token path's split layout (see
/// `cpu_avx2::row_nvfp4_t1`, same contract): `Σ_b s_b · Σ_{i<16} q_{b,i}·x_{b,i}`.
///
/// Four blocks (32 code bytes) per step, decoded as in the AVX2 row
/// (`layout::e2m1_fp16_words`), then each block's even and
/// odd FP16 codes are put side by side (`vperm2i128`) so that one 16-lane `vcvtph2ps`
/// gives the block in the split layout of `x`: `acc_j += (q·x)·s_b` per lane (the
/// products are exact; one FMA rounding each), four accumulators `acc_j`, `j = b % 4`,
/// summed at the end. Per product at most `K/64` accumulation roundings plus 6 in the
/// final sums, inside the bound the tests derive for the single-token paths.
///
/// # Safety
/// The CPU has AVX-512 F and BW, AVX2, FMA and F16C; `codes` holds `4·groups` blocks,
/// `scale_bytes` at least `(groups − 1)·512 + 4` bytes, `x` `64·groups` values.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn row_nvfp4_t1(
    codes: &[[u8; 8]],
    scale_bytes: &[u8],
    table: &[f32; 256],
    x: &[[f32; 16]],
    groups: usize,
) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 4];
    let c = codes.as_ptr().cast::<u8>();
    let xp = x.as_ptr().cast::<f32>();
    for g in 0..groups {
        // SAFETY (all pointer reads): in bounds by the caller's contract.
        let [e02, e13, o02, o13] = unsafe { e2m1_fp16_words(c.add(32 * g)) };
        // Block j's 8 even then 8 odd codes.
        let q = [
            _mm256_permute2x128_si256::<0x20>(e02, o02),
            _mm256_permute2x128_si256::<0x20>(e13, o13),
            _mm256_permute2x128_si256::<0x31>(e02, o02),
            _mm256_permute2x128_si256::<0x31>(e13, o13),
        ];
        let sb = unsafe { scale_bytes.as_ptr().add(512 * g) };
        for (j, qj) in q.into_iter().enumerate() {
            let (s, xv) = unsafe {
                (
                    *table.get_unchecked(*sb.add(j) as usize),
                    _mm512_loadu_ps(xp.add(64 * g + 16 * j)),
                )
            };
            let p = _mm512_mul_ps(_mm512_cvtph_ps(qj), xv);
            acc[j] = _mm512_fmadd_ps(p, _mm512_set1_ps(s), acc[j]);
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(
        _mm512_add_ps(acc[0], acc[1]),
        _mm512_add_ps(acc[2], acc[3]),
    ))
}

/// AVX-512 accumulators of rows `row0..row0 + out.len() / m` (`out[row][token]`), for
/// `k % 64 == 0`.
pub(super) fn rows_avx512(
    rows: &WeightRows<'_>,
    xf: &[f32],
    m: usize,
    k: usize,
    row0: usize,
    out: &mut [f32],
) -> Result<()> {
    if !available() {
        bail!("gemv: the AVX-512 kernel needs AVX-512 F and BW");
    }
    if !k.is_multiple_of(64) || xf.len() != m * k {
        bail!("gemv: the AVX-512 kernel needs K % 64 == 0 and x of [{m}, {k}]");
    }
    if single_token_path(rows, m, k) {
        // `x` is in the split layout (`gemv_cpu_with`); AVX-512 F and BW checked above.
        return rows_nvfp4_t1(rows, xf, k, row0, out, row_nvfp4_t1);
    }
    let blocks = k / 16;
    let xb: Vec<&[[f32; 16]]> = xf.chunks_exact(k).map(|r| r.as_chunks().0).collect();
    let table = half_e4m3_table();
    for (r, o) in out.chunks_exact_mut(m).enumerate() {
        let row = row0 + r;
        match rows.row_blocks(row, k) {
            RowBlocks::Nvfp4 { codes, scale_bytes } => {
                let s = (scale_bytes, table);
                // SAFETY: AVX-512 F and BW were detected above.
                unsafe { row_all_tokens::<true>(codes, s, &[], &xb, blocks, o) };
            }
            RowBlocks::Bf16(w) => {
                let s = (&[][..], &[0.0; 256]);
                // SAFETY: AVX-512 F and BW were detected above.
                unsafe { row_all_tokens::<false>(&[], s, w, &xb, blocks, o) };
            }
        }
    }
    Ok(())
}
