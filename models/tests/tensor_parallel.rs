//! Tensor-parallel Llama on the CPU with simulated ranks: each rank a thread holding its
//! shard ([`Llama::random_sharded`], [`Llama::load_sharded`]), the ranks meeting in a
//! [`ThreadGroup`] all-reduce after every o_proj and down_proj.
//!
//! What must hold against the unsharded model:
//! * **one rank**: the same bits (a single-rank all-reduce is the identity and the
//!   re-built layers hold the same weights);
//! * **2 and 4 ranks**: the same greedy tokens, and logits within 4 BF16 ulps of the
//!   largest logit (the projections round to BF16 in either activation dtype). Why that bound: column-parallel outputs are the unsharded
//!   ones bit for bit (each row summed alone, in an order set by K); each row-parallel
//!   layer's output differs by the rounding of the ranks' partials before their sum (one
//!   rounding each, then one of the sum, instead of one), so a layer's output moves by a few
//!   BF16 roundings, and two layers of random weights pass that on
//!   without amplifying it much; the test feeds both runs the reference's tokens, and
//!   checks the argmax only where the reference's top two are further apart than the
//!   bound.
//! * the batched decode step (two sequences of different lengths, the logits of both
//!   all-gathered from the vocabulary-parallel `lm_head`) within the same bound, every rank
//!   the same logits; a rank that draws its own shard (`random_rank`) holds its slice of
//!   the vocabulary and still returns whole, identical logits;
//! * a split that does not divide (the tiny ModelOpt model's single KV head over 2 ranks) is
//!   an error naming the sizes on every rank, not a panic or a hang.

use candle_core::{DType, Device, Tensor};
use candle_fp4::tensor_parallel::{AllReduce, ThreadGroup};
use candle_fp4_models::config::LlamaConfig;
use candle_fp4_models::{Llama, LoadOptions, RandomSpec};
use std::path::Path;
use std::sync::Arc;

fn cfg() -> LlamaConfig {
    LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 16, "vocab_size": 300, "max_position_embeddings": 256,
            "tie_word_embeddings": false}"#,
        "tensor_parallel test",
    )
    .unwrap()
}

fn opts(dtype: DType) -> LoadOptions {
    LoadOptions {
        max_seq_len: Some(64),
        dtype: Some(dtype),
        ..LoadOptions::default()
    }
}

const SPEC: RandomSpec = RandomSpec {
    nvfp4: true,
    seed: 5,
};

/// Logits of `steps` greedy steps after `prompt`, each step fed `feed[i]` when given
/// (the reference's tokens), else the model's own argmax; and the argmaxes.
fn decode(
    m: &mut Llama,
    prompt: &[u32],
    steps: usize,
    feed: Option<&[u32]>,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut logits = vec![];
    let mut toks = vec![];
    let mut l = m.forward(prompt, 0).unwrap();
    for (i, pos) in (0..steps).zip(prompt.len()..) {
        let v = l.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let arg = v
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        toks.push(arg);
        logits.push(v);
        let next = feed.map_or(arg, |f| f[i]);
        l = m.forward(&[next], pos).unwrap();
    }
    (toks, logits)
}

/// Runs `f` on every rank of a `ranks` group (a thread each) and returns rank 0's result
/// and all ranks' results.
fn on_ranks<T: Send>(ranks: usize, f: impl Fn(Arc<dyn AllReduce>) -> T + Sync) -> Vec<T> {
    let group = ThreadGroup::new(ranks).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = group
            .into_iter()
            .map(|g| {
                let f = &f;
                s.spawn(move || f(Arc::new(g)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The BF16 ulp at 1: every projection rounds its output to BF16 (`QuantLinear`'s
/// numerics), whatever the activation dtype, so the partials' extra roundings are BF16's.
fn ulp(_: DType) -> f32 {
    2f32.powi(-7)
}

#[test]
fn sharded_random_model_decodes_like_the_unsharded_one() {
    let prompt = [3u32, 141, 59, 26, 5];
    let steps = 20;
    for dtype in [DType::F32, DType::BF16] {
        let mut full = Llama::random(cfg(), SPEC, &opts(dtype), &Device::Cpu).unwrap();
        let (ref_toks, ref_logits) = decode(&mut full, &prompt, steps, None);
        for ranks in [1usize, 2, 4] {
            let runs = on_ranks(ranks, |r| {
                let mut m = Llama::random_sharded(cfg(), SPEC, &opts(dtype), &Device::Cpu, Some(r))
                    .unwrap();
                assert_eq!(m.config().num_key_value_heads, 4 / ranks);
                // 300 rows divide by 2 and 4: each rank holds its slice of the vocabulary.
                assert_eq!(m.lm_head().is_split(), ranks > 1);
                assert_eq!(m.lm_head().linear().out_features(), 300 / ranks);
                decode(&mut m, &prompt, steps, Some(&ref_toks))
            });
            // Every rank computes the same logits (the lm_head's slices all-gathered).
            for (i, r) in runs.iter().enumerate().skip(1) {
                assert_eq!(
                    r.1, runs[0].1,
                    "{dtype:?} {ranks} ranks: rank {i} differs from rank 0"
                );
            }
            let (toks, logits) = &runs[0];
            let mut worst = 0f32;
            for (step, (a, b)) in logits.iter().zip(&ref_logits).enumerate() {
                let max = b.iter().fold(1f32, |m, v| m.max(v.abs()));
                let bound = 4.0 * ulp(dtype) * max;
                let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                worst = worst.max(d / bound);
                if ranks == 1 {
                    assert_eq!(
                        a, b,
                        "{dtype:?}: one rank must give the unsharded bits (step {step})"
                    );
                }
                assert!(
                    d <= bound,
                    "{dtype:?} {ranks} ranks step {step}: |Δlogit| {d} > {bound}"
                );
                let mut s = b.clone();
                s.sort_by(|x, y| y.total_cmp(x));
                if s[0] - s[1] > 2.0 * bound {
                    assert_eq!(
                        toks[step], ref_toks[step],
                        "{dtype:?} {ranks} ranks step {step}"
                    );
                }
            }
            eprintln!("{dtype:?} {ranks} ranks: worst |Δlogit| / bound = {worst:.3}");
        }
    }
}

/// Two sequences (prompts of 5 and 2 tokens) through `steps` batched decode steps fed the
/// tokens `feed` gives per step; the logits `[2, vocab]` of each step, flattened.
fn decode_batch(m: &mut Llama, steps: usize, feed: &dyn Fn(usize) -> [u32; 2]) -> Vec<Vec<f32>> {
    m.prefill_seq(0, &[3, 141, 59, 26, 5]).unwrap();
    m.prefill_seq(1, &[77, 8]).unwrap();
    (0..steps)
        .map(|i| {
            let l = m.decode_logits(&feed(i)).unwrap();
            assert_eq!(l.dims(), [2, 300]);
            l.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        })
        .collect()
}

#[test]
fn sharded_batched_decode_step_matches_the_unsharded_one() {
    let o = LoadOptions {
        batch: 2,
        ..opts(DType::BF16)
    };
    let feed = |i: usize| [(7 * i as u32 + 1) % 300, (13 * i as u32 + 5) % 300];
    let mut full = Llama::random(cfg(), SPEC, &o, &Device::Cpu).unwrap();
    let want = decode_batch(&mut full, 6, &feed);
    for ranks in [2usize, 4] {
        let runs = on_ranks(ranks, |r| {
            let mut m = Llama::random_sharded(cfg(), SPEC, &o, &Device::Cpu, Some(r)).unwrap();
            assert!(m.lm_head().is_split());
            decode_batch(&mut m, 6, &feed)
        });
        for (i, r) in runs.iter().enumerate().skip(1) {
            assert_eq!(r, &runs[0], "{ranks} ranks: rank {i} differs from rank 0");
        }
        for (step, (a, b)) in runs[0].iter().zip(&want).enumerate() {
            // Each sequence's row against its own largest logit (the bound above).
            for (ra, rb) in a.chunks(300).zip(b.chunks(300)) {
                let max = rb.iter().fold(1f32, |m, v| m.max(v.abs()));
                let bound = 4.0 * ulp(DType::BF16) * max;
                let d = ra
                    .iter()
                    .zip(rb)
                    .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(
                    d <= bound,
                    "{ranks} ranks step {step}: |Δlogit| {d} > {bound}"
                );
            }
        }
    }
}

#[test]
fn a_rank_drawing_its_own_shard_keeps_a_slice_of_the_vocabulary() {
    let runs = on_ranks(2, |r| {
        let mut m = Llama::random_rank(cfg(), SPEC, &opts(DType::F32), &Device::Cpu, r).unwrap();
        assert!(m.lm_head().is_split());
        assert_eq!(m.lm_head().linear().out_features(), 150);
        decode(&mut m, &[3, 141, 59], 3, None).1
    });
    assert_eq!(runs[0], runs[1], "the ranks' gathered logits differ");
    assert!(runs[0]
        .iter()
        .all(|l| l.len() == 300 && l.iter().all(|v| v.is_finite())));
}

#[test]
fn a_perturbed_shard_is_caught() {
    // The comparison above is not vacuous: a rank whose all-reduce drops its partial sum
    // (as a broken collective would) changes the logits far beyond the bound.
    #[derive(Debug)]
    struct Dropping(ThreadGroup);
    impl AllReduce for Dropping {
        fn shard(&self) -> candle_fp4::tensor_parallel::Shard {
            self.0.shard()
        }
        fn all_reduce(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            let s = self.0.all_reduce(x)?;
            if self.0.shard().rank() == 0 {
                return s - x; // rank 0 forgets its own part
            }
            Ok(s)
        }
        fn all_gather_last(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            self.0.all_gather_last(x)
        }
    }
    let prompt = [3u32, 141, 59];
    let mut full = Llama::random(cfg(), SPEC, &opts(DType::F32), &Device::Cpu).unwrap();
    let (_, ref_logits) = decode(&mut full, &prompt, 1, None);
    let group = ThreadGroup::new(2).unwrap();
    let runs: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = group
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let r: Arc<dyn AllReduce> = Arc::new(Dropping(g));
                    let mut m = Llama::random_sharded(
                        cfg(),
                        SPEC,
                        &opts(DType::F32),
                        &Device::Cpu,
                        Some(r),
                    )
                    .unwrap();
                    decode(&mut m, &prompt, 1, None).1
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (a, b) = (&runs[0][0], &ref_logits[0]);
    let max = b.iter().fold(1f32, |m, v| m.max(v.abs()));
    let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let bound = 4.0 * ulp(DType::F32) * max;
    assert!(
        d > 10.0 * bound,
        "a dropped partial went unnoticed: {d} (bound {bound})"
    );
}

fn tiny_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/modelopt_tiny")
}

#[test]
fn tiny_modelopt_model_one_rank_is_bit_identical_and_two_ranks_are_refused() {
    let o = opts(DType::F32);
    let mut full = Llama::load(tiny_dir(), &Device::Cpu, &o).unwrap();
    let (_, want) = decode(&mut full, &[1, 7, 42], 8, None);
    let got = on_ranks(1, |r| {
        let mut m = Llama::load_sharded(tiny_dir(), &Device::Cpu, &o, r).unwrap();
        decode(&mut m, &[1, 7, 42], 8, None).1
    });
    assert_eq!(got[0], want);
    // One KV head (and 3 query heads) cannot be split over 2 ranks: an error on every
    // rank, before any collective (so no rank waits for another).
    let errs = on_ranks(2, |r| {
        Llama::load_sharded(tiny_dir(), &Device::Cpu, &o, r)
            .unwrap_err()
            .to_string()
    });
    for e in errs {
        assert!(
            e.contains("num_kv_heads") && e.contains("= 1") && e.contains("ranks = 2"),
            "{e}"
        );
    }
}
