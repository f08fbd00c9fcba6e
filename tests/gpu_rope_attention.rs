//! The decode step's rope, KV append and attention inside the attention launches
//! (`KvCache::decode_rope_attention`: one kernel on a BF16 cache, the ring's and the
//! UltraQuant launch on an UltraQuant cache with an exact window) against the same steps one
//! op each (the rope kernel, the cache's `append_decode` of its k and v heads, then
//! `decode_attention_with` on its q heads), on the GPU (feature `cuda`, needs an NVIDIA GPU). Both give the attention kernel
//! the same BF16 q and k (the fused kernel rotates with the rope kernel's arithmetic, which
//! `tests/gpu_rope.rs` checks against the CPU bit for bit), the same tiles and splits, so
//! the same FP32 sums: outputs, cache rows and lengths must agree bit for bit, and any
//! difference is a bug, not rounding.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use candle_fp4::kv_cache::{
    AttnKnobs, Bf16Cache, CacheShape, KvCache, KvCacheKind, UltraQuantCache,
};
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

/// The device lengths of either cache.
fn dev_lens(c: &KvCache) -> candle_core::Result<Vec<u32>> {
    match c {
        KvCache::Bf16(c) => c.lens_tensor().to_vec1::<u32>(),
        KvCache::UltraQuant(c) => c.lens_tensor().to_vec1::<u32>(),
    }
}

/// One configuration: caches `a` (fused) and `b` (one op each) made by `make`, three
/// sequences (one empty, so its first token is row 0; the others cross 16-token tile
/// boundaries during the rounds), positions that differ from the lengths (the rope reads the
/// positions, the append the lengths), `rounds` decode steps; outputs, host and device
/// lengths after every step, the rows read back (and the UltraQuant slots) at the end must
/// agree bit for bit.
fn fused_equals_unfused(
    gpu: &Device,
    make: &dyn Fn(CacheShape) -> candle_core::Result<KvCache>,
    heads: (usize, usize, usize),
    knobs: &AttnKnobs,
    capacity_splits: bool,
    what: &str,
    seed: u64,
) -> candle_core::Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut rand_bf16 = |shape: &[usize]| -> candle_core::Result<Tensor> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        Tensor::from_vec(v, shape, gpu)?.to_dtype(DType::BF16)
    };
    let (nq, nkv, d) = heads;
    let (batch, cap, max_pos, rounds) = (3usize, 200usize, 300usize, 20usize);
    let cos = rand_bf16(&[max_pos, d / 2])?;
    let sin = rand_bf16(&[max_pos, d / 2])?;
    let rope = QkvRope::new(nq, nkv, d, &cos, &sin)?;
    let shape = CacheShape {
        batch,
        capacity: cap,
        kv_heads: nkv,
        head_dim: d,
    };
    let (mut a, mut b) = (make(shape)?, make(shape)?);
    assert!(a.fuses_rope_append(), "{what}");
    for (s, n) in [(1usize, 37usize), (2, 130)] {
        let (k, v) = (rand_bf16(&[n, nkv, d])?, rand_bf16(&[n, nkv, d])?);
        a.append_seq(s, &k, &v)?;
        b.append_seq(s, &k, &v)?;
    }
    for round in 0..rounds {
        let qkv = rand_bf16(&[batch, (nq + 2 * nkv) * d])?;
        let pos: Vec<u32> = a
            .lens()
            .iter()
            .map(|&n| ((3 * n + 1) % max_pos) as u32)
            .collect();
        let pos = Tensor::new(pos.as_slice(), gpu)?;
        let got = a.decode_rope_attention(&rope, &qkv, &pos, knobs, capacity_splits)?;
        let r = rope.forward(&qkv, &pos)?;
        let k = r.narrow(1, nq, nkv)?.contiguous()?;
        let v = r.narrow(1, nq + nkv, nkv)?.contiguous()?;
        b.append_decode(&k, &v)?;
        let q = r.narrow(1, 0, nq)?.contiguous()?;
        let want = if capacity_splits {
            b.decode_attention_capacity_with(&q, knobs)?
        } else {
            b.decode_attention_with(&q, knobs)?
        };
        assert_eq!(got.dims(), &[batch, nq, d], "{what}");
        assert!(
            bits(&got)? == bits(&want)?,
            "{what}, round {round}: outputs differ"
        );
        assert_eq!(a.lens(), b.lens(), "{what}, round {round}: host lengths");
        assert_eq!(
            dev_lens(&a)?,
            dev_lens(&b)?,
            "{what}, round {round}: device lengths"
        );
    }
    assert_eq!(a.lens(), &[rounds, 37 + rounds, 130 + rounds], "{what}");
    for s in 0..batch {
        let ((ka, va), (kb, vb)) = (a.read_bf16(s)?, b.read_bf16(s)?);
        assert!(bits(&ka)? == bits(&kb)?, "{what}, seq {s}: K rows");
        assert!(bits(&va)? == bits(&vb)?, "{what}, seq {s}: V rows");
    }
    if let (KvCache::UltraQuant(x), KvCache::UltraQuant(y)) = (&a, &b) {
        let bytes = |t: Tensor| t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u8>();
        assert!(bytes(x.slots()?)? == bytes(y.slots()?)?, "{what}: slots");
    }
    Ok(())
}

fn knobs(splits: Option<usize>, fused_merge: Option<bool>, pdl: Option<bool>) -> AttnKnobs {
    AttnKnobs {
        splits,
        fused_merge,
        pdl,
        ..AttnKnobs::default()
    }
}

/// BF16 cache: heads (nt 1 and 2 kernels, head_dim 64 / 80 / 128) and the launch variants
/// that change who advances the lengths: heuristic and capacity-planned splits with the
/// combine kernel, one split and the in-kernel merge (the lengths kernel), PDL off.
#[test]
fn rope_in_attention_equals_rope_then_attention() -> candle_core::Result<()> {
    let gpu = Device::new_cuda(0)?;
    let variants = [
        ("heuristic splits", knobs(None, None, None), false),
        ("capacity splits", knobs(None, None, None), true),
        ("one split", knobs(Some(1), None, None), true),
        ("in-kernel merge", knobs(Some(3), Some(true), None), false),
        ("no PDL", knobs(None, None, Some(false)), true),
    ];
    let make = |sh| KvCache::new(KvCacheKind::Bf16, sh, &gpu);
    for heads in [
        (9usize, 3usize, 64usize),
        (32, 8, 128),
        (16, 2, 128),
        (12, 2, 80),
    ] {
        for (name, o, capacity_splits) in &variants {
            let what = format!("BF16, {heads:?} heads, {name}");
            fused_equals_unfused(&gpu, &make, heads, o, *capacity_splits, &what, 11)?;
        }
    }
    Ok(())
}

/// UltraQuant cache with an exact window of 16 and 64 tokens (the empty sequence stays
/// inside the longer one for all rounds, so its UltraQuant range stays empty; the ring wraps
/// in the others): the ring's launch with the rope and append inside, the UltraQuant launch
/// with the rope and the new token's slot inside, against the rope kernel, the store, the ring
/// append, the lengths kernel and the same two attention launches. Both launch orders of the
/// ring, both merges, heuristic and capacity splits, PDL off; head_dim 64 / 128 / 256.
#[test]
fn rope_in_ultraquant_attention_equals_rope_then_attention() -> candle_core::Result<()> {
    let gpu = Device::new_cuda(0)?;
    let ring = |first: bool, fused_merge: Option<bool>| AttnKnobs {
        ring_first: Some(first),
        ..knobs(None, fused_merge, None)
    };
    let variants = [
        ("heuristic splits", knobs(None, None, None), false),
        ("capacity splits", knobs(None, None, None), true),
        ("ring first, in-kernel merge", ring(true, Some(true)), false),
        ("ring late, combine kernel", ring(false, Some(false)), true),
        ("ring first, combine kernel", ring(true, Some(false)), false),
        ("no PDL", knobs(Some(2), None, Some(false)), true),
    ];
    for window in [16usize, 64] {
        let make = |sh| KvCache::with_window(KvCacheKind::UltraQuant, sh, window, &gpu);
        for heads in [
            (9usize, 3usize, 64usize),
            (32, 8, 128),
            (16, 2, 128),
            (8, 2, 256),
        ] {
            for (name, o, capacity_splits) in &variants {
                let what = format!("UltraQuant window {window}, {heads:?} heads, {name}");
                fused_equals_unfused(&gpu, &make, heads, o, *capacity_splits, &what, 12)?;
            }
        }
    }
    Ok(())
}

/// Wrong inputs are errors that write nothing: a full sequence, a q|k|v of the wrong width,
/// a rope whose heads do not match the cache, positions of the wrong length, an UltraQuant
/// cache without an exact window.
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
    // An UltraQuant cache without an exact window: its new token would be attended from the
    // slot being written.
    let mut u = UltraQuantCache::new(shape, &gpu)?;
    assert!(u
        .decode_rope_attention(&rope, &qkv, &pos, &o, true)
        .is_err());
    assert_eq!(u.lens(), &[0, 0]);
    // And a good call still works after them.
    let y = c.decode_rope_attention(&rope, &qkv, &pos, &o, true)?;
    assert_eq!(y.dims(), &[batch, nq, d]);
    assert_eq!(c.lens(), &[1, 1]);
    assert_eq!(c.lens_tensor().to_vec1::<u32>()?, vec![1, 1]);
    Ok(())
}
