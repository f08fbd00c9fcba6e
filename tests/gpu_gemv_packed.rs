//! GPU tests of the packed NVFP4 GEMV (feature `cuda`, needs an NVIDIA GPU): the GPU
//! packer against the CPU reference byte for byte, the packed dequantizer against the
//! ModelOpt one bit for bit, and the GEMV against the FP64 product of the exact weight
//! with the tolerance derived in `gpu_gemv.rs` (FP32 sums in another order, one BF16
//! rounding), on shapes that reach every path: odd N, halves that are not whole tiles,
//! an odd number of 64-wide K chunks, the split-K path (few row tiles, long K), M across
//! all three token tiles, PDL on and off, and a second call (the split-K counters reset).
#![cfg(feature = "cuda")]

mod gemv_gpu_common;

use candle_core::{DType, Device, Tensor};
use candle_fp4::gemv::{packed_nvfp4_gemv, packed_nvfp4_gemv_planned, KernelImage, PackedNvfp4};
use candle_fp4::nvfp4::dequantize_rows;
use gemv_gpu_common::{abs_dot, check, gpu, layer, rand_x, R};
use rand::{rngs::StdRng, SeedableRng};

fn run(n: usize, k: usize, ms: &[usize], silus: &[bool], seed: u64) -> R<()> {
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut l = layer(n, k, &mut rng)?;
    // Some zero block scales (the packer zeroes their codes).
    let mut swz = l.scales.flatten_all()?.to_vec1::<u8>()?;
    for b in swz.iter_mut().step_by(37) {
        *b = 0;
    }
    l.scales = Tensor::from_vec(swz, l.scales.dims(), &Device::Cpu)?;
    let (cg, sg) = (l.codes.to_device(&dev)?, l.scales.to_device(&dev)?);
    let pg = PackedNvfp4::pack(&cg, &sg, l.gs)?;
    assert!(
        !pg.hw_order(),
        "the H200 image uses the software nibble order"
    );
    let pc = PackedNvfp4::pack(&l.codes, &l.scales, l.gs)?;
    let bytes = |t: &Tensor| t.to_device(&Device::Cpu)?.to_vec1::<u8>();
    let words = |t: &Tensor| t.to_device(&Device::Cpu)?.to_vec1::<u32>();
    assert!(
        bytes(pg.codes())? == bytes(pc.codes())?,
        "{n}x{k}: GPU packed codes differ from the CPU's"
    );
    assert!(
        words(pg.scales())? == words(pc.scales())?,
        "{n}x{k}: GPU packed scales differ from the CPU's"
    );
    let deq_cpu = dequantize_rows(&l.codes, &l.scales)?;
    let a = pg
        .dequantize_bf16()?
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?;
    let b = deq_cpu.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    assert!(
        a == b,
        "{n}x{k}: packed dequantize differs from dequantize_rows"
    );
    let w_gpu = deq_cpu.to_device(&dev)?;
    for &m in ms {
        let x = rand_x(m, k, &mut rng)?;
        let xg = x.to_device(&dev)?;
        let pre = (x
            .to_dtype(DType::F64)?
            .matmul(&deq_cpu.to_dtype(DType::F64)?.t()?)?
            * l.gs as f64)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let absd = abs_dot(&xg, &w_gpu, l.gs)?;
        for &silu in silus {
            for pdl in [false, true] {
                // Poison: a NaN buffer of the output's size freed just before the call.
                drop(Tensor::full(f32::NAN, (m, n), &dev)?.to_dtype(DType::BF16)?);
                let y = packed_nvfp4_gemv(&xg, &pg, silu, pdl)?;
                let what = format!("packed {n}x{k} m={m} silu={silu} pdl={pdl}");
                check(&what, &y, &pre, &absd, k, silu, false)?;
                let again = packed_nvfp4_gemv(&xg, &pg, silu, pdl)?;
                let (y1, y2) = (
                    y.to_dtype(DType::F32)?.to_vec2::<f32>()?,
                    again.to_dtype(DType::F32)?.to_vec2::<f32>()?,
                );
                assert!(
                    y1 == y2,
                    "{what}: a second call differs (split-K state not reset?)"
                );
            }
            // The sm_80 code (what A100 / RTX 40xx run), JIT-compiled from its PTX here.
            let plan = pg.plan_with_image(silu, m, false, KernelImage::Sm80)?;
            let y80 = packed_nvfp4_gemv_planned(&xg, &pg, &plan)?;
            check(
                &format!("packed sm80 {n}x{k} m={m} silu={silu}"),
                &y80,
                &pre,
                &absd,
                k,
                silu,
                false,
            )?;
            // The CPU op (unpack, then the CPU GEMV) meets the same bound.
            let yc = packed_nvfp4_gemv(&x, &pc, silu, false)?;
            check(
                &format!("packed cpu {n}x{k} m={m} silu={silu}"),
                &yc,
                &pre,
                &absd,
                k,
                silu,
                false,
            )?;
        }
    }
    Ok(())
}

#[test]
fn awkward_shapes() -> R<()> {
    run(200, 960, &[1, 5, 9, 32], &[false, true], 1)?; // halves of 100 rows, 15 chunks
    run(1000, 4032, &[1, 8, 17], &[false, true], 2)?; // 63 chunks
    run(33, 64, &[1, 3, 32], &[false], 3)?; // odd N, one chunk
    run(1024, 4096, &[1, 8, 16, 24], &[false, true], 4) // few groups: the split-K path
}

#[test]
fn pair_kernel_shapes() -> R<()> {
    // At least 3.5 row tiles per SM (462 on the H200's 132 SMs), so the plain one-token-tile
    // GEMV runs the pair kernel (`pair_suits`): 465 tiles of odd N (the last tile has no
    // partner) and a 5-chunk K (the last pair has one chunk); 514 tiles in two segments
    // with padding rows in each; m = 9 and 32 take the two- and four-token-tile kernels.
    run(7425, 320, &[1, 3, 8, 9], &[false], 11)?;
    run(8194, 1024, &[1, 8, 32], &[false], 12)
}

#[test]
fn staged_kernel_shapes() -> R<()> {
    // Grids of at most 2 CTAs per SM take the staged kernel (x of each CTA's K slice in
    // shared memory, `stage_suits`) for the tokens it serves; past that the same plan
    // launches the plain kernel. Which kernel serves each m is asserted, then every m is
    // checked against the FP64 bound (both sides of the switch).
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(13);
    let staged = |n: usize, k: usize, m: usize, rng: &mut StdRng| -> R<String> {
        let l = layer(n, k, rng)?;
        let pg = PackedNvfp4::pack(&l.codes.to_device(&dev)?, &l.scales.to_device(&dev)?, l.gs)?;
        let plan = pg.plan(false, m, true)?;
        let name = plan.kernel_for(m).map(str::to_string);
        name.ok_or_else(|| candle_core::Error::Msg(format!("{n}x{k}: no kernel for m = {m}")))
    };
    let is_staged = |name: &str| name.starts_with("cfp4_pgemv_fp4xs_");
    // SmolLM2 down (36 tiles), a split-4 grid (1000 x 4032: 63 tiles, 4 slices of 8 pairs,
    // the last slice 7.5 pairs) and the 8B down (K = 14336: 28.7 KB of x): staged at
    // m = 1 (`STAGED_MAX_M`), the plain kernel of the same plan above.
    for (n, k) in [(576, 1536), (1000, 4032), (4096, 14336)] {
        let name = staged(n, k, 1, &mut rng)?;
        assert!(is_staged(&name), "{n}x{k} m=1: {name}");
        for m in [2, 8] {
            let name = staged(n, k, m, &mut rng)?;
            assert!(!is_staged(&name), "{n}x{k} m={m}: {name}");
        }
    }
    run(576, 1536, &[1, 2, 8], &[false], 14)?;
    run(1000, 4032, &[1, 5, 8], &[false], 15)?;
    run(4096, 14336, &[1, 2], &[false], 16)
}

#[test]
fn smollm2_shapes() -> R<()> {
    run(960, 576, &[1, 2, 8, 16, 32], &[false], 5)?;
    run(576, 1536, &[1, 8, 32], &[false], 6)?;
    run(3072, 576, &[1, 8, 9, 32], &[true], 7)
}

#[test]
fn llama_8b_shapes() -> R<()> {
    run(6144, 4096, &[1, 8, 32], &[false], 8)?;
    run(4096, 14336, &[1, 16], &[false], 9)?;
    run(28672, 4096, &[1, 8], &[true], 10)
}

#[test]
fn errors_are_errors() -> R<()> {
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(11);
    let l = layer(64, 128, &mut rng)?;
    let p = PackedNvfp4::pack(&l.codes.to_device(&dev)?, &l.scales.to_device(&dev)?, l.gs)?;
    let x = rand_x(33, 128, &mut rng)?.to_device(&dev)?;
    assert!(packed_nvfp4_gemv(&x, &p, false, false).is_err(), "M = 33");
    let x = rand_x(1, 192, &mut rng)?.to_device(&dev)?;
    assert!(
        packed_nvfp4_gemv(&x, &p, false, false).is_err(),
        "K mismatch"
    );
    let x = rand_x(2, 128, &mut rng)?;
    assert!(
        packed_nvfp4_gemv(&x, &p, false, false).is_err(),
        "x on another device"
    );
    let l = layer(16, 96, &mut rng)?;
    assert!(
        PackedNvfp4::pack(&l.codes.to_device(&dev)?, &l.scales.to_device(&dev)?, l.gs).is_err(),
        "K = 96"
    );
    Ok(())
}
