//! What the CPU GEMV kernels share: the weight rows of a call ([`WeightRows`]) and their
//! 16-value blocks, the scale tables, and the single-token NVFP4 path's `x` layout and row
//! loop. The SIMD kernels (`avx2`, `avx512`) import only this file.

use crate::nvfp4::{e4m3_decode, swizzled_offset, BLOCK_SIZE};
use candle_core::{bail, Result};
use half::bf16;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Where the weight rows come from.
#[derive(Debug, Clone, Copy)]
pub enum WeightRows<'a> {
    /// NVFP4: packed codes `[N, K/2]` and swizzled scales with `sp` padded columns.
    Nvfp4 {
        /// Packed E2M1 codes.
        codes: &'a [u8],
        /// Swizzled E4M3 block scales.
        scales: &'a [u8],
        /// Padded scale-column count of the swizzled layout.
        sp: usize,
    },
    /// Plain BF16 rows `[N, K]`.
    Bf16 {
        /// The weight.
        w: &'a [bf16],
    },
}

/// `e4m3_decode(b) / 2` for every byte (exact: no FP32 underflow), the block scale the
/// SIMD kernels multiply their `2·e2m1` integers by.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn half_e4m3_table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|b| e4m3_decode(b as u8) * 0.5))
}

/// One weight row as the SIMD kernels read it (see [`WeightRows::row_blocks`]).
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy)]
pub(crate) enum RowBlocks<'a> {
    /// 8-byte code blocks, and the swizzled scale bytes from the row's first one on
    /// (block `b` at `(b / 4) · 512 + b % 4`).
    Nvfp4 {
        codes: &'a [[u8; 8]],
        scale_bytes: &'a [u8],
    },
    /// 16-value BF16 blocks.
    Bf16(&'a [[bf16; 16]]),
}

impl<'a> WeightRows<'a> {
    /// Row `row` (of `k` values, `k % 16 == 0`, within the checked shape) in 16-value blocks.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn row_blocks(&self, row: usize, k: usize) -> RowBlocks<'a> {
        match *self {
            WeightRows::Nvfp4 { codes, scales, sp } => RowBlocks::Nvfp4 {
                codes: codes[row * k / 2..(row + 1) * k / 2].as_chunks().0,
                scale_bytes: &scales[swizzled_offset(row, 0, sp)..],
            },
            WeightRows::Bf16 { w } => RowBlocks::Bf16(w[row * k..(row + 1) * k].as_chunks().0),
        }
    }
}

impl WeightRows<'_> {
    /// Checks the buffers against `[n, k]`.
    pub(crate) fn check(&self, n: usize, k: usize) -> Result<()> {
        match *self {
            WeightRows::Nvfp4 { codes, scales, sp } => {
                let np = n.div_ceil(128) * 128;
                if !k.is_multiple_of(BLOCK_SIZE)
                    || codes.len() != n * k / 2
                    || scales.len() != np * sp
                    || sp < k / BLOCK_SIZE
                    || !sp.is_multiple_of(4)
                {
                    bail!("gemv: NVFP4 weight buffers do not match N = {n}, K = {k}");
                }
            }
            WeightRows::Bf16 { w } => {
                if w.len() != n * k {
                    bail!("gemv: BF16 weight has {} values, expected {n}x{k}", w.len());
                }
            }
        }
        Ok(())
    }
}

/// Whether the single-token NVFP4 path ([`rows_nvfp4_t1`]) runs for this call: AVX2 +
/// FMA + F16C, NVFP4 rows, `m == 1`, `k % 64 == 0`. When it does, the caller lays the
/// FP32 `x` out with [`split_x_block`] (so the row kernel needs no interleave); the AVX2
/// kernel runs its `row_nvfp4_t1` per row, the AVX-512 kernel its own 16-lane version
/// (`avx512::row_nvfp4_t1`: 74–81 vs 69–72 tokens/s with the AVX2 row, SmolLM2 decode
/// on one AVX-512 core).
#[cfg(target_arch = "x86_64")]
pub(crate) fn single_token_path(rows: &WeightRows<'_>, m: usize, k: usize) -> bool {
    m == 1
        && k.is_multiple_of(64)
        && matches!(rows, WeightRows::Nvfp4 { .. })
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// One 16-value block of `x` in the single-token path's layout: the even elements
/// (the weights' low nibbles) first, then the odd ones (high nibbles).
#[cfg(target_arch = "x86_64")]
pub(crate) fn split_x_block(src: &[bf16; 16], dst: &mut [f32; 16]) {
    for i in 0..8 {
        dst[i] = src[2 * i].to_f32();
        dst[8 + i] = src[2 * i + 1].to_f32();
    }
}

/// The 32 E2M1 codes of 4 NVFP4 blocks (the 32 code bytes at `p`) as FP16 words, exact
/// (the value's high byte, the low byte zero): `[e02, e13, o02, o13]`, the even codes (low
/// nibbles) and the odd ones; 128-bit lane 0 of `e02` / `o02` holds block 0, lane 1 block 2,
/// and `e13` / `o13` blocks 1 and 3. One `pshufb` per nibble half from a table of the FP16
/// high bytes. Shared by the single-token rows of `avx2` and `avx512`.
///
/// # Safety
/// 32 bytes are readable at `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn e2m1_fp16_words(p: *const u8) -> [__m256i; 4] {
    // E2M1 code → the high byte of the same value in FP16 (sign, 5-bit exponent, the
    // top 2 mantissa bits): 0, 0.5, 1, 1.5, 2, 3, 4, 6, then their negatives.
    let lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(
        0x00,
        0x38,
        0x3C,
        0x3E,
        0x40,
        0x42,
        0x44,
        0x46,
        0x80u8 as i8,
        0xB8u8 as i8,
        0xBCu8 as i8,
        0xBEu8 as i8,
        0xC0u8 as i8,
        0xC2u8 as i8,
        0xC4u8 as i8,
        0xC6u8 as i8,
    ));
    let mask = _mm256_set1_epi8(0x0F);
    let zero = _mm256_setzero_si256();
    // SAFETY: 32 readable bytes by the caller's contract.
    let v = unsafe { _mm256_loadu_si256(p.cast()) };
    let ql = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, mask));
    let qh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask));
    [
        _mm256_unpacklo_epi8(zero, ql),
        _mm256_unpackhi_epi8(zero, ql),
        _mm256_unpacklo_epi8(zero, qh),
        _mm256_unpackhi_epi8(zero, qh),
    ]
}

/// One NVFP4 row of the single-token path: `(codes, scale_bytes, e4m3 table, x, groups)`,
/// with the contract of `avx2::row_nvfp4_t1` (or the AVX-512 one of `avx512`).
#[cfg(target_arch = "x86_64")]
pub(crate) type RowT1 = unsafe fn(&[[u8; 8]], &[u8], &[f32; 256], &[[f32; 16]], usize) -> f32;

/// The single-token NVFP4 path over rows `row0..row0 + out.len()`, `x` in the split layout,
/// with row kernel `row` (whose CPU features the caller has checked).
#[cfg(target_arch = "x86_64")]
pub(crate) fn rows_nvfp4_t1(
    rows: &WeightRows<'_>,
    xf: &[f32],
    k: usize,
    row0: usize,
    out: &mut [f32],
    row: RowT1,
) -> Result<()> {
    let groups = k / 64;
    let x = xf.as_chunks::<16>().0;
    if groups == 0 || x.len() != 4 * groups {
        bail!("gemv: x has {} values, expected {k}", xf.len());
    }
    let table = e4m3_table();
    for (r, o) in out.iter_mut().enumerate() {
        let RowBlocks::Nvfp4 { codes, scale_bytes } = rows.row_blocks(row0 + r, k) else {
            bail!("gemv: the single-token NVFP4 path got BF16 rows");
        };
        if codes.len() != 4 * groups || scale_bytes.len() < (groups - 1) * 512 + 4 {
            bail!("gemv: NVFP4 row {} is shorter than K = {k}", row0 + r);
        }
        // SAFETY: features checked by the caller (`single_token_path`, and AVX-512 for
        // its row), the lengths just above.
        *o = unsafe { row(codes, scale_bytes, table, x, groups) };
    }
    Ok(())
}

/// `e4m3_decode(b)` for every byte.
#[cfg(target_arch = "x86_64")]
fn e4m3_table() -> &'static [f32; 256] {
    static T: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|b| crate::nvfp4::e4m3_decode(b as u8)))
}
