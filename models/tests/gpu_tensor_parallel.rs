//! Tensor-parallel decode over NCCL on the GPUs of this machine (feature `nccl`, needs at
//! least one GPU): rank r on cuda:r in its own thread, the CUDA-graph step captured with
//! NCCL's all-reduce inside it. With one GPU the group has one rank: NCCL's one-rank sum
//! still runs in the graph, and the logits must be the unsharded model's bits. With two or
//! more GPUs (the first 2 are used: the random model has 2 KV heads), the sharded step must
//! give the unsharded model's greedy tokens, and logits within 4 BF16 ulps of the largest
//! logit: column-parallel outputs are bit for bit the unsharded ones, and each row-parallel
//! output takes one more BF16 rounding (the ranks' partials, then their sum) — the bound
//! of `gpu_decode_graph.rs`, whose graph-vs-eager differences are of the same size. The
//! argmax is checked where the reference's top two are further apart than the bound, and
//! every step feeds both runs the reference's token.
#![cfg(feature = "nccl")]

use candle_core::{DType, Device, Tensor};
use candle_fp4::tensor_parallel::{AllReduce, NcclGroup, NcclId, Shard, ThreadGroup};
use candle_fp4_models::config::LlamaConfig;
use candle_fp4_models::{Llama, LoadOptions, RandomSpec};
use std::sync::Arc;

fn cfg() -> LlamaConfig {
    LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "hidden_size": 512, "intermediate_size": 768,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "vocab_size": 1000, "max_position_embeddings": 1024, "tie_word_embeddings": false}"#,
        "gpu_tensor_parallel",
    )
    .unwrap()
}

fn opts() -> LoadOptions {
    LoadOptions {
        max_seq_len: Some(400),
        allow_long_context: true,
        cuda_graph: true,
        ..LoadOptions::default()
    }
}

const SPEC: RandomSpec = RandomSpec {
    nvfp4: true,
    seed: 11,
};

fn gpus() -> usize {
    candle_core::cuda_backend::cudarc::driver::CudaContext::device_count().unwrap() as usize
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

/// Logits of the prefill and of `steps` graph steps, step i fed `feed[i]` (or its own
/// argmax without `feed`).
fn run(m: &mut Llama, steps: usize, feed: Option<&[u32]>) -> Vec<Vec<f32>> {
    let prompt = [1u32, 17, 42, 99, 3];
    let mut out = vec![host(&m.forward(&prompt, 0).unwrap())];
    for i in 0..steps {
        let tok = feed.map_or_else(|| argmax(out.last().unwrap()), |f| f[i]);
        out.push(host(&m.decode_logits(&[tok]).unwrap()));
    }
    out
}

#[test]
fn nccl_sharded_graph_decode_matches_the_unsharded_model() {
    let ranks = gpus().min(2);
    assert!(ranks >= 1, "this test needs a CUDA GPU");
    // The reference: the same host-drawn weights, unsharded (one in-process rank) on cuda:0.
    let one: Arc<dyn AllReduce> = Arc::new(ThreadGroup::new(1).unwrap().remove(0));
    let dev0 = Device::new_cuda(0).unwrap();
    let mut full = Llama::random_sharded(cfg(), SPEC, &opts(), &dev0, Some(one)).unwrap();
    let steps = 300;
    let want = run(&mut full, steps, None);
    let feed: Vec<u32> = want.iter().map(|l| argmax(l)).collect();
    let id = NcclId::new().unwrap();
    let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = Shard::all(ranks)
            .unwrap()
            .into_iter()
            .map(|shard| {
                let feed = &feed;
                s.spawn(move || {
                    let dev = Device::new_cuda(shard.rank()).unwrap();
                    let g: Arc<dyn AllReduce> = Arc::new(NcclGroup::new(&dev, shard, id).unwrap());
                    let mut m = Llama::random_sharded(cfg(), SPEC, &opts(), &dev, Some(g)).unwrap();
                    run(&mut m, steps, Some(feed))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, g) in got.iter().enumerate().skip(1) {
        assert_eq!(g, &got[0], "rank {r}'s logits differ from rank 0's");
    }
    let mut worst = 0f32;
    for (step, (a, b)) in got[0].iter().zip(&want).enumerate() {
        if ranks == 1 {
            assert_eq!(
                a, b,
                "one NCCL rank: step {step} is not the unsharded model's bits"
            );
            continue;
        }
        let tol = 4.0 * b.iter().fold(1f32, |m, x| m.max(x.abs())) / 128.0;
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(d.is_finite() && d <= tol, "step {step}: |diff| {d} > {tol}");
        let mut s = b.clone();
        s.sort_by(|x, y| y.total_cmp(x));
        if s[0] - s[1] > tol {
            assert_eq!(argmax(a), argmax(b), "step {step}: argmax");
        }
        worst = worst.max(d);
    }
    eprintln!("{ranks} NCCL rank(s), {steps} graph steps: worst |diff| {worst}");
}

#[test]
fn nccl_all_gather_lays_ranks_side_by_side() {
    // Every rank gathers a [3, 5] (several rows: the rank-major result must be re-laid
    // out) whose values name the rank and the element; with one GPU the group has one
    // rank and the gather must be the identity, through NCCL all the same.
    let ranks = gpus().min(2);
    assert!(ranks >= 1, "this test needs a CUDA GPU");
    let value = |r: usize, i: usize| (100 * r + i) as f32;
    let id = NcclId::new().unwrap();
    let got: Vec<(Vec<usize>, Vec<f32>)> = std::thread::scope(|s| {
        let hs: Vec<_> = Shard::all(ranks)
            .unwrap()
            .into_iter()
            .map(|shard| {
                s.spawn(move || {
                    let dev = Device::new_cuda(shard.rank()).unwrap();
                    let g = NcclGroup::new(&dev, shard, id).unwrap();
                    let v: Vec<f32> = (0..15).map(|i| value(shard.rank(), i)).collect();
                    let x = Tensor::from_vec(v, (3, 5), &dev)
                        .unwrap()
                        .to_dtype(DType::BF16)
                        .unwrap();
                    let y = g.all_gather_last(&x).unwrap();
                    (y.dims().to_vec(), host(&y))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: Vec<f32> = (0..3)
        .flat_map(|row| (0..ranks).flat_map(move |r| (0..5).map(move |j| value(r, 5 * row + j))))
        .collect();
    for (r, (dims, v)) in got.iter().enumerate() {
        assert_eq!(dims, &[3, 5 * ranks], "rank {r}");
        assert_eq!(v, &want, "rank {r}");
    }
}
