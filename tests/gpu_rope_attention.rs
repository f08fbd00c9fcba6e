//! The decode step's rope, KV append and attention in one kernel
//! (`Bf16Cache::decode_rope_attention`) against the same steps one op each (the rope kernel,
//! the cache's `append_decode` of its k and v heads, then `decode_attention_with` on its q
//! heads), on the GPU (feature `cuda`, needs an NVIDIA GPU). Both give the attention kernel
//! the same BF16 q and k (the fused kernel rotates with the rope kernel's arithmetic, which
//! `tests/gpu_rope.rs` checks against the CPU bit for bit), the same tiles and splits, so
//! the same FP32 sums: outputs, cache rows and lengths must agree bit for bit, and any
//! difference is a bug, not rounding.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use candle_fp4::kv_cache::{AttnKnobs, Bf16Cache, CacheShape};
use candle_fp4::rope::QkvRope;
use rand::{Rng, SeedableRng};

fn bits(t: &Tensor) -> candle_core::Result<Vec<u16>> {
    Ok(t.to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<half::bf16>()?
        .iter()
        .map(|x| x.to_bits())
        .collect())
}

/// Heads (nt 1 and 2 kernels, head_dim 64 / 80 / 128), three sequences (one empty, so its
/// first token is row 0; the others cross 16-token tile boundaries during the rounds),
/// positions that differ from the lengths (the rope reads the positions, the append the
/// lengths), and the launch variants that change who advances the lengths: heuristic and
/// capacity-planned splits with the combine kernel, one split and the in-kernel merge (the
/// lengths kernel), PDL off.
#[test]
fn rope_in_attention_equals_rope_then_attention() -> candle_core::Result<()> {
    let gpu = Device::new_cuda(0)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut rand_bf16 = |shape: &[usize]| -> candle_core::Result<Tensor> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        Tensor::from_vec(v, shape, &gpu)?.to_dtype(DType::BF16)
    };
    let opt = |splits, fused_merge, pdl| AttnKnobs {
        splits,
        fused_merge,
        pdl,
        ..AttnKnobs::default()
    };
    let variants = [
        ("heuristic splits", opt(None, None, None), false),
        ("capacity splits", opt(None, None, None), true),
        ("one split", opt(Some(1), None, None), true),
        ("in-kernel merge", opt(Some(3), Some(true), None), false),
        ("no PDL", opt(None, None, Some(false)), true),
    ];
    let (batch, cap, max_pos, rounds) = (3usize, 200usize, 300usize, 20usize);
    for (nq, nkv, d) in [
        (9usize, 3usize, 64usize),
        (32, 8, 128),
        (16, 2, 128),
        (12, 2, 80),
    ] {
        let heads = nq + 2 * nkv;
        let cos = rand_bf16(&[max_pos, d / 2])?;
        let sin = rand_bf16(&[max_pos, d / 2])?;
        let rope = QkvRope::new(nq, nkv, d, &cos, &sin)?;
        let shape = CacheShape {
            batch,
            capacity: cap,
            kv_heads: nkv,
            head_dim: d,
        };
        for (name, o, capacity_splits) in &variants {
            let what = format!("{nq}/{nkv} heads of {d}, {name}");
            let (mut a, mut b) = (Bf16Cache::new(shape, &gpu)?, Bf16Cache::new(shape, &gpu)?);
            for (s, n) in [(1usize, 37usize), (2, 130)] {
                let (k, v) = (rand_bf16(&[n, nkv, d])?, rand_bf16(&[n, nkv, d])?);
                a.append_seq(s, &k, &v)?;
                b.append_seq(s, &k, &v)?;
            }
            for round in 0..rounds {
                let qkv = rand_bf16(&[batch, heads * d])?;
                let pos: Vec<u32> = a
                    .lens()
                    .iter()
                    .map(|&n| ((3 * n + 1) % max_pos) as u32)
                    .collect();
                let pos = Tensor::new(pos.as_slice(), &gpu)?;
                let got = a.decode_rope_attention(&rope, &qkv, &pos, o, *capacity_splits)?;
                let r = rope.forward(&qkv, &pos)?;
                let k = r.narrow(1, nq, nkv)?.contiguous()?;
                let v = r.narrow(1, nq + nkv, nkv)?.contiguous()?;
                b.append_decode(&k, &v)?;
                let q = r.narrow(1, 0, nq)?.contiguous()?;
                let want = if *capacity_splits {
                    b.decode_attention_capacity_with(&q, o)?
                } else {
                    b.decode_attention_with(&q, o)?
                };
                assert_eq!(got.dims(), &[batch, nq, d], "{what}");
                assert!(
                    bits(&got)? == bits(&want)?,
                    "{what}, round {round}: outputs differ"
                );
                assert_eq!(a.lens(), b.lens(), "{what}, round {round}: host lengths");
                assert_eq!(
                    a.lens_tensor().to_vec1::<u32>()?,
                    b.lens_tensor().to_vec1::<u32>()?,
                    "{what}, round {round}: device lengths"
                );
            }
            assert_eq!(a.lens(), &[rounds, 37 + rounds, 130 + rounds], "{what}");
            for s in 0..batch {
                let ((ka, va), (kb, vb)) = (a.read_bf16(s)?, b.read_bf16(s)?);
                assert!(bits(&ka)? == bits(&kb)?, "{what}, seq {s}: K rows");
                assert!(bits(&va)? == bits(&vb)?, "{what}, seq {s}: V rows");
            }
        }
    }
    Ok(())
}

/// Wrong inputs are errors that write nothing: a full sequence, a q|k|v of the wrong width,
/// a rope whose heads do not match the cache, positions of the wrong length.
#[test]
fn rope_in_attention_refuses_bad_input() -> candle_core::Result<()> {
    let gpu = Device::new_cuda(0)?;
    let (nq, nkv, d, batch, cap) = (8usize, 2usize, 64usize, 2usize, 4usize);
    let t = |shape: &[usize]| Tensor::ones(shape, DType::BF16, &gpu);
    let rope = QkvRope::new(nq, nkv, d, &t(&[16, d / 2])?, &t(&[16, d / 2])?)?;
    let shape = CacheShape {
        batch,
        capacity: cap,
        kv_heads: nkv,
        head_dim: d,
    };
    let mut c = Bf16Cache::new(shape, &gpu)?;
    let (k, v) = (t(&[cap, nkv, d])?, t(&[cap, nkv, d])?);
    c.append_seq(1, &k, &v)?;
    let o = AttnKnobs::default();
    let qkv = t(&[batch, (nq + 2 * nkv) * d])?;
    let pos = Tensor::new(&[0u32, 4], &gpu)?;
    assert!(c
        .decode_rope_attention(&rope, &qkv, &pos, &o, true)
        .is_err());
    assert_eq!(c.lens(), &[0, cap]);
    assert_eq!(c.lens_tensor().to_vec1::<u32>()?, vec![0, cap as u32]);
    c.reset_seq(1)?;
    let narrow = t(&[batch, (nq + nkv) * d])?;
    assert!(c
        .decode_rope_attention(&rope, &narrow, &pos, &o, true)
        .is_err());
    let other = QkvRope::new(nq, 4, d, &t(&[16, d / 2])?, &t(&[16, d / 2])?)?;
    let wide = t(&[batch, (nq + 8) * d])?;
    assert!(c
        .decode_rope_attention(&other, &wide, &pos, &o, true)
        .is_err());
    let short = Tensor::new(&[0u32], &gpu)?;
    assert!(c
        .decode_rope_attention(&rope, &qkv, &short, &o, true)
        .is_err());
    assert_eq!(c.lens(), &[0, 0]);
    // And a good call still works after them.
    let y = c.decode_rope_attention(&rope, &qkv, &pos, &o, true)?;
    assert_eq!(y.dims(), &[batch, nq, d]);
    assert_eq!(c.lens(), &[1, 1]);
    assert_eq!(c.lens_tensor().to_vec1::<u32>()?, vec![1, 1]);
    Ok(())
}
