//! The collectives of a tensor-parallel group on the CPU ([`ThreadGroup`]: ranks as
//! threads), and the rule that splits an `lm_head` by its vocabulary.
//!
//! * `all_gather_last`: every rank gets the ranks' tensors side by side on the last dim, in
//!   rank order, exactly (a gather moves values, it rounds nothing): checked against the
//!   expected layout built element by element, for 1–4 ranks, 1-, 2- and 3-d tensors with
//!   several rows (so a rank-major result that was not re-laid out row by row would fail),
//!   BF16 and F32, several collectives in a row on one group.
//! * `all_reduce` on the same group: the sum reference's bits ([`all_reduce_sum`]).
//! * A vocabulary-parallel `lm_head` ([`vocab_parallel`], [`column_parallel`]) joined by the
//!   gather gives the whole layer's logits bit for bit (CPU GEMV: each row's sum is ordered
//!   by K alone), with a vocabulary that is not a multiple of 128.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4::tensor_parallel::{
    all_reduce_sum, column_parallel, vocab_parallel, AllReduce, ThreadGroup,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Runs `f(rank's group)` on a thread per rank; the ranks' results in rank order.
fn on_ranks<T: Send>(ranks: usize, f: impl Fn(ThreadGroup) -> T + Sync) -> Vec<T> {
    let group = ThreadGroup::new(ranks).expect("ranks > 0");
    std::thread::scope(|s| {
        let hs: Vec<_> = group
            .into_iter()
            .map(|g| {
                let f = &f;
                s.spawn(move || f(g))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

/// Seeded values, distinct per rank and element (so any misplaced element shows).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut r = StdRng::seed_from_u64(seed);
    (0..n).map(|_| r.random_range(-4.0f32..4.0)).collect()
}

fn rank_tensor(rank: usize, dims: &[usize], dtype: DType) -> Result<Tensor> {
    let n = dims.iter().product();
    Tensor::from_vec(values(1000 + rank as u64, n), dims, &Device::Cpu)?.to_dtype(dtype)
}

#[test]
fn all_gather_last_lays_ranks_side_by_side_on_every_rank() -> Result<()> {
    let shapes: [&[usize]; 3] = [&[7], &[3, 5], &[2, 3, 4]];
    for ranks in 1..=4usize {
        for dtype in [DType::BF16, DType::F32] {
            let got = on_ranks(ranks, |g| -> Result<Vec<Tensor>> {
                let r = g.shard().rank();
                shapes
                    .iter()
                    .map(|d| g.all_gather_last(&rank_tensor(r, d, dtype)?))
                    .collect()
            })
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
            for (k, dims) in shapes.iter().enumerate() {
                let n = *dims.last().expect("not a scalar");
                let rows: usize = dims[..dims.len() - 1].iter().product();
                // Expected: row i = rank 0's row i, rank 1's row i, ...
                let parts: Vec<Vec<f32>> = (0..ranks)
                    .map(|r| {
                        rank_tensor(r, dims, dtype)?
                            .to_dtype(DType::F32)?
                            .flatten_all()?
                            .to_vec1::<f32>()
                    })
                    .collect::<Result<_>>()?;
                let mut want = Vec::with_capacity(rows * n * ranks);
                for i in 0..rows {
                    for p in &parts {
                        want.extend_from_slice(&p[i * n..(i + 1) * n]);
                    }
                }
                let mut out_dims = dims.to_vec();
                *out_dims.last_mut().expect("not a scalar") = n * ranks;
                for (r, outs) in got.iter().enumerate() {
                    let t = &outs[k];
                    assert_eq!(t.dims(), out_dims.as_slice(), "{ranks} ranks, rank {r}");
                    assert_eq!(t.dtype(), dtype);
                    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    assert_eq!(v, want, "{ranks} ranks {dtype:?} {dims:?}: rank {r}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn all_reduce_on_the_group_is_the_reference_sum() -> Result<()> {
    for ranks in 1..=3usize {
        let got = on_ranks(ranks, |g| {
            g.all_reduce(&rank_tensor(g.shard().rank(), &[4, 9], DType::BF16)?)
        });
        let parts: Vec<Tensor> = (0..ranks)
            .map(|r| rank_tensor(r, &[4, 9], DType::BF16))
            .collect::<Result<_>>()?;
        let want = all_reduce_sum(&parts)?
            .flatten_all()?
            .to_vec1::<half::bf16>()?;
        for (r, t) in got.into_iter().enumerate() {
            let v = t?.flatten_all()?.to_vec1::<half::bf16>()?;
            assert_eq!(v, want, "{ranks} ranks, rank {r}");
        }
    }
    Ok(())
}

#[test]
fn a_gather_of_mismatched_parts_is_an_error_on_every_rank() {
    // Rank 1 passes a wider tensor: no rank may return a silently misshapen result.
    let got = on_ranks(2, |g| {
        let r = g.shard().rank();
        let t = rank_tensor(r, &[2, 3 + r], DType::F32)?;
        g.all_gather_last(&t)
    });
    for (r, res) in got.into_iter().enumerate() {
        let e = res.expect_err("mismatched parts").to_string();
        // Each rank names the part that does not fit its own width.
        assert!(
            e.contains("all_gather_columns") && e.contains("shape"),
            "rank {r}: {e}"
        );
    }
}

#[test]
fn vocab_parallel_splits_only_whole_equal_parts() {
    assert!(vocab_parallel(128256, 2) && vocab_parallel(128256, 8));
    assert!(vocab_parallel(49152, 4) && vocab_parallel(300, 4));
    assert!(!vocab_parallel(128256, 1), "one rank keeps the whole head");
    assert!(
        !vocab_parallel(32001, 2),
        "an odd vocabulary stays replicated"
    );
    assert!(!vocab_parallel(0, 2) && !vocab_parallel(10, 0));
}

#[test]
fn vocab_parallel_lm_head_gives_the_whole_heads_logits() -> Result<()> {
    // 300 rows (not a multiple of 128), K = 192: the CPU GEMV path at M = 1 and 3.
    let (v, k) = (300usize, 192usize);
    let w = Tensor::from_vec(values(7, v * k), (v, k), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let full = QuantLinear::from_bf16(w, None)?;
    for m in [1usize, 3] {
        let x = Tensor::from_vec(values(8 + m as u64, m * k), (m, k), &Device::Cpu)?
            .to_dtype(DType::BF16)?;
        let want = full
            .forward(&x)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for ranks in [2usize, 3, 4] {
            assert!(vocab_parallel(v, ranks));
            let got = on_ranks(ranks, |g| -> Result<Vec<f32>> {
                let head = column_parallel(&full, g.shard(), &Device::Cpu)?;
                assert_eq!(head.out_features(), v / ranks);
                g.all_gather_last(&head.forward(&x)?)?
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()
            });
            for (r, res) in got.into_iter().enumerate() {
                assert_eq!(res?, want, "M = {m}, {ranks} ranks: rank {r}");
            }
        }
    }
    Ok(())
}
