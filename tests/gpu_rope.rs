//! The fused q|k|v rope on the GPU against its CPU reference, bit for bit (feature `cuda`,
//! needs an NVIDIA GPU): both round every product and sum to BF16 the way candle's rope
//! does, so any difference is a bug, not rounding.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use candle_fp4::rope::QkvRope;

#[test]
fn gpu_equals_cpu_bit_for_bit() -> candle_core::Result<()> {
    let gpu = Device::new_cuda(0)?;
    for (nq, nkv, d, max_pos, b) in [
        (9usize, 3usize, 64usize, 600usize, 1usize),
        (32, 8, 128, 513, 3),
        (4, 4, 80, 17, 5),
    ] {
        let cos =
            Tensor::rand(-1f32, 1.0, (max_pos, d / 2), &Device::Cpu)?.to_dtype(DType::BF16)?;
        let sin =
            Tensor::rand(-1f32, 1.0, (max_pos, d / 2), &Device::Cpu)?.to_dtype(DType::BF16)?;
        let heads = nq + 2 * nkv;
        let qkv = Tensor::randn(0f32, 2.0, (b, heads * d), &Device::Cpu)?.to_dtype(DType::BF16)?;
        // The last position is past the tables: both read the last row.
        let pos: Vec<u32> = (0..b)
            .map(|i| {
                if i + 1 == b {
                    max_pos as u32 + 7
                } else {
                    (i * 37 % max_pos) as u32
                }
            })
            .collect();
        let pos = Tensor::new(pos.as_slice(), &Device::Cpu)?;
        let cpu = QkvRope::new(nq, nkv, d, &cos, &sin)?.forward(&qkv, &pos)?;
        let op = QkvRope::new(nq, nkv, d, &cos.to_device(&gpu)?, &sin.to_device(&gpu)?)?;
        let got = op.forward(&qkv.to_device(&gpu)?, &pos.to_device(&gpu)?)?;
        let a = cpu.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let g = got
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        assert!(
            a == g,
            "{nq}+2x{nkv} heads of {d}, batch {b}: GPU and CPU differ"
        );
        // Mixed devices are an error.
        assert!(op.forward(&qkv, &pos).is_err());
    }
    Ok(())
}
