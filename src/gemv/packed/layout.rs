//! The packed NVFP4 layout of `kernels/gemv_packed.cu` ("Packed layout" at the top of that
//! file): its geometry, and the CPU reference of the packer and its inverse. The CUDA
//! packer must produce these bytes exactly (tested on the GPU).

use crate::nvfp4::{e4m3_encode, swizzled_offset, swizzled_shape, BLOCK_SIZE};
use candle_core::{bail, Result};

/// `K` must be a multiple of this (one 64-wide chunk per lane record).
pub const PACKED_K_ALIGN: usize = 64;

/// Geometry of one packed `[N, K]` weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackedLayout {
    /// Weight rows.
    pub n: usize,
    /// Input features (a multiple of 64).
    pub k: usize,
    /// Packed rows of one half when `N` is even (`round_up(N/2, 16)`), else 0.
    pub half_pad: usize,
    /// Packed 16-row tiles.
    pub tiles: usize,
    /// 128-wide K steps per tile, `ceil(K / 128)`.
    pub npairs: usize,
}

impl PackedLayout {
    /// The layout of an `[n, k]` weight; `k` must be a positive multiple of 64.
    pub fn new(n: usize, k: usize) -> Result<Self> {
        if n == 0 || k == 0 || !k.is_multiple_of(PACKED_K_ALIGN) {
            bail!("packed NVFP4: weight [{n}, {k}] needs N > 0 and K a positive multiple of {PACKED_K_ALIGN}");
        }
        // The kernels index with 32-bit ints; this bound also keeps the padding below
        // from overflowing.
        if n > i32::MAX as usize / 2 || k > i32::MAX as usize / 64 {
            bail!("packed NVFP4: weight [{n}, {k}] is too large for the kernels' 32-bit indices");
        }
        let half_pad = if n.is_multiple_of(2) {
            (n / 2).div_ceil(16) * 16
        } else {
            0
        };
        let rows = if half_pad > 0 {
            2 * half_pad
        } else {
            n.div_ceil(16) * 16
        };
        let l = Self {
            n,
            k,
            half_pad,
            tiles: rows / 16,
            npairs: k.div_ceil(128),
        };
        // Every size the kernels index with 32-bit ints, checked once here.
        let bytes = crate::error::checked_product(
            "packed NVFP4 code bytes",
            &[l.tiles, 2 * l.npairs, 512],
        )?;
        if bytes > i32::MAX as usize {
            bail!("packed NVFP4: weight [{n}, {k}] is too large ({bytes} packed bytes)");
        }
        Ok(l)
    }

    /// Bytes of the packed codes: `[tiles][2·npairs][32][16]`.
    pub fn code_bytes(&self) -> usize {
        self.tiles * self.tile_code_bytes()
    }

    /// Bytes of one row tile's codes, `[2·npairs][32][16]`: tile `t` starts at
    /// `t · tile_code_bytes()`.
    pub fn tile_code_bytes(&self) -> usize {
        2 * self.npairs * 512
    }

    /// Bytes of one row tile's scale words, `[npairs][32]` u32.
    pub fn tile_scale_bytes(&self) -> usize {
        self.npairs * 32 * 4
    }

    /// Words of the packed scales: `[tiles][npairs][32]`.
    pub fn scale_words(&self) -> usize {
        self.tiles * self.npairs * 32
    }

    /// CTA work groups: row tiles, or with `silu_mul` (gate tile, up tile) pairs.
    pub fn groups(&self, silu_mul: bool) -> usize {
        if silu_mul {
            self.half_pad / 16
        } else {
            self.tiles
        }
    }

    /// CTA work groups of the pair kernel: adjacent row tiles two by two (the last one
    /// alone when the count is odd).
    pub fn pair_groups(&self) -> usize {
        self.tiles.div_ceil(2)
    }

    /// The weight row of packed row `p`, or `None` for a padding row.
    pub fn real_row(&self, p: usize) -> Option<usize> {
        if self.half_pad == 0 {
            return (p < self.n).then_some(p);
        }
        let half = self.n / 2;
        if p < self.half_pad {
            (p < half).then_some(p)
        } else {
            let q = p - self.half_pad;
            (q < half).then_some(half + q)
        }
    }
}

/// Power of two the raw decode carries: 126 (software decode), 112 (the SM100 convert).
fn raw_log2(hw: bool) -> i32 {
    if hw {
        112
    } else {
        126
    }
}

/// Exponent base of T (`kTBase` of the kernel).
fn t_base(hw: bool) -> i32 {
    if hw {
        208
    } else {
        224
    }
}

/// T of an E4M3 scale byte (`scale_t` of the kernel): the biased exponent above the base
/// and the top 3 mantissa bits of `e4m3 · 2^(raw − 8)` as BF16; 0 for a zero scale.
pub fn scale_t(b: u8, hw: bool) -> u32 {
    let b = i32::from(b & 0x7f);
    if b == 0 {
        return 0;
    }
    let (e, m) = (b >> 3, b & 7);
    let bias = raw_log2(hw) - 8;
    let (big_e, m3) = if e > 0 {
        (e + bias + 120, m)
    } else {
        let lead = 31 - m.leading_zeros() as i32;
        (lead + bias + 118, (m << (3 - lead)) & 7)
    };
    (((big_e - t_base(hw)) << 3) | m3) as u32
}

/// The E4M3 byte whose T is `t` (inverse of [`scale_t`] on non-negative scales).
pub fn scale_from_t(t: u32, hw: bool) -> u8 {
    if t == 0 {
        return 0;
    }
    let big_e = (t >> 3) as i32 + t_base(hw);
    let m3 = (t & 7) as f32;
    let v = (1.0 + m3 / 8.0) * 2f32.powi(big_e - 127 - (raw_log2(hw) - 8));
    e4m3_encode(v)
}

/// Software decode: the word bit that holds bit `b` (0 = m, 1 = e0, 2 = e1, 3 = sign) of
/// half `h`'s code of pair `r` (`code_bit_pos` of `kernels/gemv_packed.cu`). The decode
/// (`packed_word_pairs`) needs the sign at bit 15 + 16h and e1 e0 m at 8..6 + 16h: pairs
/// 0–2 are the word rotated right by 0, 3 and 6 bits under that mask; pair 3 is the
/// 8 bits left, moved into place by one multiply.
fn code_bit_pos(r: usize, h: usize, b: usize) -> u32 {
    let out = (if b == 3 { 15 } else { 6 + b } + 16 * h) as u32;
    if r < 3 {
        (out + 3 * r as u32) % 32
    } else {
        [3, 4, 0, 1][b] + 16 * h as u32
    }
}

/// Places the four pairs of a packed word: pair r = (first, second) k.
fn place(pairs: [[u32; 2]; 4], hw: bool) -> u32 {
    let mut w = 0;
    for (r, [a, b]) in pairs.into_iter().enumerate() {
        if hw {
            w |= (a << (8 * r)) | (b << (8 * r + 4));
        } else {
            for (h, c) in [a, b].into_iter().enumerate() {
                for bit in 0..4 {
                    w |= ((c >> bit) & 1) << code_bit_pos(r, h, bit);
                }
            }
        }
    }
    w
}

fn unplace(w: u32, hw: bool) -> [[u32; 2]; 4] {
    let mut out = [[0; 2]; 4];
    for (r, p) in out.iter_mut().enumerate() {
        *p = if hw {
            [(w >> (8 * r)) & 15, (w >> (8 * r + 4)) & 15]
        } else {
            let code = |h| {
                (0..4)
                    .map(|bit| ((w >> code_bit_pos(r, h, bit)) & 1) << bit)
                    .sum()
            };
            [code(0), code(1)]
        };
    }
    out
}

/// Checks the ModelOpt inputs' sizes against the layout.
fn check_inputs(l: &PackedLayout, codes: &[u8], swizzled: &[u8]) -> Result<usize> {
    let (np, sp) = swizzled_shape(l.n, l.k / BLOCK_SIZE);
    if codes.len() != l.n * l.k / 2 || swizzled.len() != np * sp {
        bail!(
            "packed NVFP4: a [{}, {}] weight needs {} code bytes and {} swizzled scale bytes, got {} and {}",
            l.n,
            l.k,
            l.n * l.k / 2,
            np * sp,
            codes.len(),
            swizzled.len()
        );
    }
    Ok(sp)
}

/// Packs ModelOpt codes `[N, K/2]` and swizzled scales into the packed codes
/// (`hw`: the nibble order of the SM100 image, else of every other image). Blocks with a
/// zero scale get zero codes.
pub fn pack_codes(l: &PackedLayout, codes: &[u8], swizzled: &[u8], hw: bool) -> Result<Vec<u8>> {
    let sp = check_inputs(l, codes, swizzled)?;
    let nch = 2 * l.npairs;
    let mut out = vec![0u8; l.code_bytes()];
    for tile in 0..l.tiles {
        for c in 0..nch {
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                let rec = ((tile * nch + c) * 32 + lane) * 16;
                for j in 0..4 {
                    let kj = 64 * c + 16 * t + 4 * j;
                    let mut v = [[0u32; 4]; 2];
                    for (rr, vr) in v.iter_mut().enumerate() {
                        let Some(row) = l.real_row(16 * tile + g + 8 * rr) else {
                            continue;
                        };
                        if kj >= l.k || swizzled[swizzled_offset(row, kj / 16, sp)] & 0x7f == 0 {
                            continue;
                        }
                        let src = &codes[row * l.k / 2 + kj / 2..];
                        *vr = [
                            u32::from(src[0] & 15),
                            u32::from(src[0] >> 4),
                            u32::from(src[1] & 15),
                            u32::from(src[1] >> 4),
                        ];
                    }
                    let w = place(
                        [
                            [v[0][0], v[0][1]],
                            [v[1][0], v[1][1]],
                            [v[0][2], v[0][3]],
                            [v[1][2], v[1][3]],
                        ],
                        hw,
                    );
                    out[rec + 4 * j..rec + 4 * j + 4].copy_from_slice(&w.to_le_bytes());
                }
            }
        }
    }
    Ok(out)
}

/// Packs the swizzled E4M3 scales into the packed scale words.
pub fn pack_scales(l: &PackedLayout, swizzled: &[u8], hw: bool) -> Result<Vec<u32>> {
    let (np, sp) = swizzled_shape(l.n, l.k / BLOCK_SIZE);
    if swizzled.len() != np * sp {
        bail!(
            "packed NVFP4: a [{}, {}] weight needs {} swizzled scale bytes, got {}",
            l.n,
            l.k,
            np * sp,
            swizzled.len()
        );
    }
    let mut out = vec![0u32; l.scale_words()];
    for tile in 0..l.tiles {
        for p in 0..l.npairs {
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                let mut tt = [[0u32; 2]; 2];
                for (rr, tr) in tt.iter_mut().enumerate() {
                    let Some(row) = l.real_row(16 * tile + g + 8 * rr) else {
                        continue;
                    };
                    for (h, th) in tr.iter_mut().enumerate() {
                        let c = 2 * p + h;
                        if 64 * c < l.k {
                            *th = scale_t(swizzled[swizzled_offset(row, 4 * c + t, sp)], hw);
                        }
                    }
                }
                out[(tile * l.npairs + p) * 32 + lane] = (tt[0][0] << 4)
                    | (tt[1][0] << 20)
                    | (tt[0][1] << 12)
                    | ((tt[1][1] & 15) << 28)
                    | (tt[1][1] >> 4);
            }
        }
    }
    Ok(out)
}

/// The ModelOpt codes `[N, K/2]` and row-major E4M3 scales `[N, K/16]` of a packed weight
/// (blocks with a zero scale come back with zero codes: the same dequantized weight).
pub fn unpack(
    l: &PackedLayout,
    codes: &[u8],
    scales: &[u32],
    hw: bool,
) -> Result<(Vec<u8>, Vec<u8>)> {
    if codes.len() != l.code_bytes() || scales.len() != l.scale_words() {
        bail!(
            "packed NVFP4: a [{}, {}] weight has {} packed code bytes and {} scale words, got {} and {}",
            l.n,
            l.k,
            l.code_bytes(),
            l.scale_words(),
            codes.len(),
            scales.len()
        );
    }
    let nch = 2 * l.npairs;
    let s = l.k / BLOCK_SIZE;
    let mut out_codes = vec![0u8; l.n * l.k / 2];
    let mut out_scales = vec![0u8; l.n * s];
    for tile in 0..l.tiles {
        for c in 0..nch {
            if 64 * c >= l.k {
                continue;
            }
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                let sw = scales[(tile * l.npairs + c / 2) * 32 + lane];
                let sw = if c % 2 == 0 { sw } else { sw.rotate_right(8) };
                let ts = [(sw >> 4) & 0xff, (sw >> 20) & 0xff];
                let rec = ((tile * nch + c) * 32 + lane) * 16;
                for j in 0..4 {
                    let w = u32::from_le_bytes(
                        codes[rec + 4 * j..rec + 4 * j + 4]
                            .try_into()
                            .unwrap_or([0; 4]),
                    );
                    let p = unplace(w, hw);
                    let rows = [[p[0], p[2]], [p[1], p[3]]];
                    let kj = 64 * c + 16 * t + 4 * j;
                    for (rr, [a, b]) in rows.into_iter().enumerate() {
                        let Some(row) = l.real_row(16 * tile + g + 8 * rr) else {
                            continue;
                        };
                        let dst = row * l.k / 2 + kj / 2;
                        out_codes[dst] = (a[0] | (a[1] << 4)) as u8;
                        out_codes[dst + 1] = (b[0] | (b[1] << 4)) as u8;
                        out_scales[row * s + kj / 16] = scale_from_t(ts[rr], hw);
                    }
                }
            }
        }
    }
    Ok((out_codes, out_scales))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvfp4::e4m3_decode;

    /// The BF16 value the kernel makes of T: `(T << 4) + (base << 7)` as bf16 bits.
    fn t_value(t: u32, hw: bool) -> f32 {
        let bits = (t << 4) + ((t_base(hw) as u32) << 7);
        half::bf16::from_bits(bits as u16).to_f32()
    }

    #[test]
    fn t_format_is_every_scale_times_the_decode_factor_exactly() {
        for hw in [false, true] {
            for b in 0u8..=0x7e {
                let t = scale_t(b, hw);
                assert!(t < 256, "byte {b:#04x}: T = {t} does not fit a byte");
                let want = e4m3_decode(b) * 2f32.powi(raw_log2(hw) - 8);
                if b == 0 {
                    assert_eq!(t, 0);
                    continue;
                }
                assert_eq!(t_value(t, hw), want, "byte {b:#04x} hw {hw}");
                assert_eq!(scale_from_t(t, hw), b, "byte {b:#04x} hw {hw}");
            }
        }
    }

    #[test]
    fn code_bits_fill_the_word_once() {
        let mut seen = 0u64;
        for r in 0..4 {
            for h in 0..2 {
                for b in 0..4 {
                    let p = code_bit_pos(r, h, b);
                    assert!(
                        p < 32 && seen & (1 << p) == 0,
                        "pair {r} half {h} bit {b}: {p}"
                    );
                    seen |= 1 << p;
                }
            }
        }
        assert_eq!(seen, 0xffff_ffff);
        for w in [0x1234_5678u32, 0xdead_beef, 0x0f0f_f0f0, 0xffff_ffff, 1] {
            assert_eq!(place(unplace(w, false), false), w);
        }
    }

    #[test]
    fn layout_rows_and_sizes() {
        let l = PackedLayout::new(200, 960).unwrap();
        assert_eq!((l.half_pad, l.tiles, l.npairs), (112, 14, 8));
        assert_eq!(l.real_row(99), Some(99));
        assert_eq!(l.real_row(100), None);
        assert_eq!(l.real_row(112), Some(100));
        assert_eq!(l.real_row(223), None);
        let odd = PackedLayout::new(33, 64).unwrap();
        assert_eq!((odd.half_pad, odd.tiles), (0, 3));
        assert_eq!(odd.real_row(32), Some(32));
        assert_eq!(odd.real_row(33), None);
        assert!(PackedLayout::new(16, 96).is_err());
        assert!(PackedLayout::new(0, 64).is_err());
        assert!(PackedLayout::new(usize::MAX / 4, 1 << 20).is_err());
        assert!(PackedLayout::new(usize::MAX, 64).is_err());
    }
}
