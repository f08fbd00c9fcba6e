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

/// The rope fused with the decode append (`Bf16Cache::append_decode_rope`) against the rope
/// followed by the cache's own `append_decode`, on the GPU: the rotated heads, every
/// sequence's cache contents and the lengths must agree bit for bit (the kernel copies the
/// rope's BF16 outputs; nothing is rounded twice). Three sequences of different lengths,
/// several rounds (a lengths advance missed or doubled would write the wrong rows), up to
/// a full cache, which both refuse.
#[test]
fn fused_append_equals_rope_then_append() -> candle_core::Result<()> {
    use candle_fp4::kv_cache::{Bf16Cache, CacheShape};
    use rand::{Rng, SeedableRng};
    let gpu = Device::new_cuda(0)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut rand_bf16 = |shape: &[usize]| -> candle_core::Result<Tensor> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        Tensor::from_vec(v, shape, &gpu)?.to_dtype(DType::BF16)
    };
    let (nq, nkv, d, batch, cap) = (8usize, 2usize, 128usize, 3usize, 12usize);
    let heads = nq + 2 * nkv;
    let cos = rand_bf16(&[64, d / 2])?;
    let sin = rand_bf16(&[64, d / 2])?;
    let rope = QkvRope::new(nq, nkv, d, &cos, &sin)?;
    let shape = CacheShape {
        batch,
        capacity: cap,
        kv_heads: nkv,
        head_dim: d,
    };
    let (mut a, mut b) = (Bf16Cache::new(shape, &gpu)?, Bf16Cache::new(shape, &gpu)?);
    for (s, n) in [(0usize, 0usize), (1, 5), (2, 9)] {
        if n > 0 {
            let (k, v) = (rand_bf16(&[n, nkv, d])?, rand_bf16(&[n, nkv, d])?);
            a.append_seq(s, &k, &v)?;
            b.append_seq(s, &k, &v)?;
        }
    }
    let host = |t: &Tensor| -> candle_core::Result<Vec<u16>> {
        Ok(t.to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<half::bf16>()?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    };
    for round in 0..3 {
        let qkv = rand_bf16(&[batch, heads * d])?;
        let pos: Vec<u32> = a.lens().iter().map(|&n| n as u32).collect();
        let pos = Tensor::new(pos.as_slice(), &gpu)?;
        let fused = a.append_decode_rope(&rope, &qkv, &pos)?;
        let r = rope.forward(&qkv, &pos)?;
        let k = r.narrow(1, nq, nkv)?.contiguous()?;
        let v = r.narrow(1, nq + nkv, nkv)?.contiguous()?;
        b.append_decode(&k, &v)?;
        assert_eq!(host(&fused)?, host(&r)?, "round {round}: rotated heads");
        assert_eq!(a.lens(), b.lens(), "round {round}: host lengths");
        assert_eq!(
            a.lens_tensor().to_vec1::<u32>()?,
            b.lens_tensor().to_vec1::<u32>()?,
            "round {round}: device lengths"
        );
        for s in 0..batch {
            let ((ka, va), (kb, vb)) = (a.read_bf16(s)?, b.read_bf16(s)?);
            assert_eq!(host(&ka)?, host(&kb)?, "round {round} seq {s}: K");
            assert_eq!(host(&va)?, host(&vb)?, "round {round} seq {s}: V");
        }
    }
    // Sequence 2 is full (9 + 3 = 12): both refuse, and nothing moves.
    let qkv = rand_bf16(&[batch, heads * d])?;
    let pos = Tensor::new(&[3u32, 8, 12], &gpu)?;
    assert!(a.append_decode_rope(&rope, &qkv, &pos).is_err());
    assert_eq!(a.lens(), &[3, 8, 12]);
    Ok(())
}
