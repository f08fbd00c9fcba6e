//! The packed NVFP4 layout on the CPU (no GPU needed): the packer against an emulation of
//! what the CUDA kernel computes from each packed word (the software E2M1 decode of
//! `kernels/nvfp4_decode.cuh`, the T scale format, the bf16 multiply), which must give
//! `e2m1 · e4m3 · 2^-8` of the right (row, k) of the ModelOpt source exactly; the unpacker as
//! its inverse; and the CPU op against the ModelOpt-layout GEMV.

use candle_core::{DType, Device, Tensor};
use candle_fp4::gemv::packed::{pack_codes, pack_scales, unpack, PackedLayout};
use candle_fp4::gemv::{nvfp4_gemv, packed_nvfp4_gemv, PackedNvfp4};
use candle_fp4::nvfp4::{
    e2m1_decode, e4m3_decode, swizzle_blockscale_bytes, swizzled_offset, swizzled_shape,
};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Random codes and row-major scales, with zero, subnormal and large scales.
fn source(n: usize, k: usize, rng: &mut StdRng) -> (Vec<u8>, Vec<u8>) {
    let codes = (0..n * k / 2).map(|_| rng.random()).collect();
    let scales = (0..n * k / 16)
        .map(|_| match rng.random_range(0..20) {
            0 => 0,
            1 => rng.random_range(0x01..0x08),
            2 => rng.random_range(0x60..0x7f),
            _ => rng.random_range(0x28..0x48),
        })
        .collect();
    (codes, scales)
}

/// `packed_word_pairs` of the kernel (software decode): out[r] = bf16 bits of pair r
/// · 2^-126: the word, rotated right by 0, 3, 6 bits, under the mask; pair 3 from the
/// bits left through one multiply (`wrapping_mul`: the kernel's 32-bit IMAD).
fn raw_pairs(q: u32) -> [u32; 4] {
    const M: u32 = 0x81c0_81c0;
    [
        q & M,
        q.rotate_right(3) & M,
        q.rotate_right(6) & M,
        ((q & 0x001b_001b).wrapping_mul(0x4108)) & M,
    ]
}

fn halves(v: u32) -> [f32; 2] {
    [
        bf16::from_bits(v as u16).to_f32(),
        bf16::from_bits((v >> 16) as u16).to_f32(),
    ]
}

#[test]
fn kernel_decode_of_the_packed_bytes_is_the_exact_weight() {
    let mut rng = StdRng::seed_from_u64(21);
    for (n, k) in [(200, 960), (33, 64), (64, 4032), (48, 128)] {
        let (codes, scales) = source(n, k, &mut rng);
        let s = k / 16;
        let swz = swizzle_blockscale_bytes(&scales, n, s).unwrap();
        let sp = swizzled_shape(n, s).1;
        let l = PackedLayout::new(n, k).unwrap();
        let pc = pack_codes(&l, &codes, &swz, false).unwrap();
        let ps = pack_scales(&l, &swz, false).unwrap();
        let want = |row: usize, kk: usize| -> f32 {
            let b = codes[row * k / 2 + kk / 2];
            let c = if kk.is_multiple_of(2) { b & 15 } else { b >> 4 };
            e2m1_decode(c) * e4m3_decode(swz[swizzled_offset(row, kk / 16, sp)]) / 256.0
        };
        let mut seen = vec![false; n * k];
        for tile in 0..l.tiles {
            for c in 0..2 * l.npairs {
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    // scale_regs: (w & 0x0ff00ff0) | base, the odd chunk rotated by 8.
                    let w = ps[(tile * l.npairs + c / 2) * 32 + lane];
                    let w = if c % 2 == 0 { w } else { w.rotate_right(8) };
                    let sc = halves((w & 0x0ff0_0ff0) | 0x7000_7000);
                    for j in 0..4 {
                        let o = ((tile * 2 * l.npairs + c) * 32 + lane) * 16 + 4 * j;
                        let q = u32::from_le_bytes(pc[o..o + 4].try_into().unwrap());
                        let r = raw_pairs(q);
                        // A fragment: r0 (kj, kj+1), r1 (kj, kj+1), r0 (kj+2, kj+3), r1 (...).
                        let kj = 64 * c + 16 * t + 4 * j;
                        for (p, (rr, dk)) in
                            [(0, 0), (1, 0), (0, 2), (1, 2)].into_iter().enumerate()
                        {
                            let v = halves(r[p]);
                            for (e, raw) in v.into_iter().enumerate() {
                                // bf16 mul: exact (≤ 6 significant bits, normal range).
                                let got = (raw as f64 * sc[rr] as f64) as f32;
                                let prow = 16 * tile + g + 8 * rr;
                                let kk = kj + dk + e;
                                match l.real_row(prow) {
                                    Some(row) if kk < k => {
                                        assert_eq!(got, want(row, kk), "{n}x{k} row {row} k {kk}");
                                        seen[row * k + kk] = true;
                                    }
                                    _ => assert_eq!(got, 0.0, "{n}x{k} padding row {prow} k {kk}"),
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(
            seen.iter().all(|&b| b),
            "{n}x{k}: some weights are not in the packed layout"
        );
    }
}

#[test]
fn unpack_inverts_pack_in_both_nibble_orders() {
    let mut rng = StdRng::seed_from_u64(22);
    for (n, k) in [(200, 960), (33, 64), (1000, 4032)] {
        let (mut codes, scales) = source(n, k, &mut rng);
        let s = k / 16;
        let swz = swizzle_blockscale_bytes(&scales, n, s).unwrap();
        // Blocks with a zero scale come back with zero codes.
        for row in 0..n {
            for b in 0..s {
                if scales[row * s + b] == 0 {
                    codes[row * k / 2 + b * 8..row * k / 2 + b * 8 + 8].fill(0);
                }
            }
        }
        let l = PackedLayout::new(n, k).unwrap();
        for hw in [false, true] {
            let pc = pack_codes(&l, &codes, &swz, hw).unwrap();
            let ps = pack_scales(&l, &swz, hw).unwrap();
            let (c2, s2) = unpack(&l, &pc, &ps, hw).unwrap();
            assert!(c2 == codes, "{n}x{k} hw {hw}: codes");
            assert!(s2 == scales, "{n}x{k} hw {hw}: scales");
        }
    }
}

#[test]
fn cpu_op_equals_the_modelopt_gemv() -> candle_core::Result<()> {
    let mut rng = StdRng::seed_from_u64(23);
    for (n, k, m, silu) in [
        (200, 960, 3, true),
        (33, 64, 1, false),
        (96, 4032, 9, false),
    ] {
        let (codes, scales) = source(n, k, &mut rng);
        let s = k / 16;
        let swz = swizzle_blockscale_bytes(&scales, n, s)?;
        let (np, sp) = swizzled_shape(n, s);
        let ct = Tensor::from_vec(codes, (n, k / 2), &Device::Cpu)?;
        let st = Tensor::from_vec(swz, (np, sp), &Device::Cpu)?;
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x = Tensor::from_vec(x, (m, k), &Device::Cpu)?.to_dtype(DType::BF16)?;
        let p = PackedNvfp4::pack(&ct, &st, 0.3)?;
        let a = packed_nvfp4_gemv(&x, &p, silu, false)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let b = nvfp4_gemv(&x, &ct, &st, 0.3, silu, false)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        assert!(a == b, "{n}x{k} m={m}: the packed CPU op differs");
        let d = p
            .dequantize_bf16()?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let e = candle_fp4::nvfp4::dequantize_rows(&ct, &st)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        assert!(d == e, "{n}x{k}: packed dequantize");
    }
    // Bad inputs are errors, not panics.
    let ct = Tensor::zeros((16, 48), DType::U8, &Device::Cpu)?;
    let st = Tensor::zeros(swizzled_shape(16, 6), DType::U8, &Device::Cpu)?;
    assert!(PackedNvfp4::pack(&ct, &st, 1.0).is_err(), "K = 96");
    let ct = Tensor::zeros((16, 32), DType::U8, &Device::Cpu)?;
    let st = Tensor::zeros(swizzled_shape(16, 4), DType::U8, &Device::Cpu)?;
    assert!(
        PackedNvfp4::pack(&ct, &st, f32::NAN).is_err(),
        "NaN global scale"
    );
    let unswizzled = Tensor::zeros((16, 4), DType::U8, &Device::Cpu)?;
    assert!(
        PackedNvfp4::pack(&ct, &unswizzled, 1.0).is_err(),
        "scales not swizzled"
    );
    Ok(())
}
