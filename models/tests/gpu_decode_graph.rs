//! The CUDA-graph decode step on a GPU (feature `cuda`, needs a GPU): graph replays against
//! eager decoding, on the tiny ModelOpt model and on a random 2-layer model, over several
//! hundred positions (past the UltraQuant exact window, so its ring wraps), at batch 1 and
//! at batch 3 with different sequence lengths.
//!
//! Eager reference: batch 1, `forward` token by token (the host-positioned append and the
//! attention split for the actual length); batch 3, the same step without the graph
//! (`cuda_graph: false`: splits for the longest sequence, not the capacity). Both differ
//! from the graph only in the FP32 summation order of the attention's split merge: its BF16
//! output can move by one rounding, which then propagates through the layers. Bound: 4 BF16
//! ulps of the largest logit (2⁻⁷·4·max(1, max|ref|)), and the argmax must agree wherever
//! the reference's top two are further apart than the bound. Each step feeds both runs the
//! reference's choice, so one near-tie cannot make the runs diverge.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4_models::config::LlamaConfig;
use candle_fp4_models::{Llama, LoadOptions, RandomSpec};
use std::path::Path;

fn gpu() -> Device {
    static DEV: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEV.get_or_init(|| Device::new_cuda(0).expect("this test needs a CUDA GPU"))
        .clone()
}

fn tiny_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/modelopt_tiny")
}

fn random_cfg() -> LlamaConfig {
    LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "hidden_size": 512, "intermediate_size": 768,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "vocab_size": 1000, "max_position_embeddings": 1024, "tie_word_embeddings": false}"#,
        "gpu_decode_graph",
    )
    .unwrap()
}

fn opts(kind: KvCacheKind, batch: usize, graph: bool) -> LoadOptions {
    LoadOptions {
        kv_cache: kind,
        max_seq_len: Some(400),
        allow_long_context: true,
        batch,
        cuda_graph: graph,
        ..LoadOptions::default()
    }
}

fn tiny(o: &LoadOptions) -> Llama {
    Llama::load(tiny_dir(), &gpu(), o).unwrap()
}

fn random(o: &LoadOptions) -> Llama {
    Llama::random(
        random_cfg(),
        RandomSpec {
            nvfp4: true,
            seed: 11,
        },
        o,
        &gpu(),
    )
    .unwrap()
}

fn host(t: &Tensor) -> Vec<Vec<f32>> {
    let t = t
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    match t.rank() {
        1 => vec![t.to_vec1::<f32>().unwrap()],
        _ => t.to_vec2::<f32>().unwrap(),
    }
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

/// 4 BF16 ulps of the largest logit (see the module docs).
fn tolerance(want: &[f32]) -> f32 {
    4.0 * want.iter().fold(1f32, |m, x| m.max(x.abs())) / 128.0
}

/// The gap between the largest and the second largest logit.
fn margin(want: &[f32]) -> f32 {
    let mut s = want.to_vec();
    s.sort_by(|a, b| b.total_cmp(a));
    s[0] - s[1]
}

/// Checks `got` against `want` (the bound of the module docs); returns the worst |diff|.
fn check(what: &str, got: &[f32], want: &[f32]) -> f32 {
    let tol = tolerance(want);
    let d = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(d.is_finite() && d <= tol, "{what}: |diff| {d} > {tol}");
    if margin(want) > tol {
        assert_eq!(argmax(got), argmax(want), "{what}: argmax");
    }
    d
}

/// Batch 1: graph replays (`decode_logits`, and `decode_greedy` continuing from the graph's
/// own choice) against `forward` token by token, 300 steps.
fn batch_one(what: &str, make: &dyn Fn(&LoadOptions) -> Llama, kind: KvCacheKind) {
    let mut g = make(&opts(kind, 1, true));
    let mut e = make(&opts(kind, 1, true));
    let prompt = [1u32, 17, 42, 99, 3];
    let lg = host(&g.forward(&prompt, 0).unwrap()).remove(0);
    let le = host(&e.forward(&prompt, 0).unwrap()).remove(0);
    assert_eq!(lg, le, "{what}: prefill");
    let mut tok = argmax(&le);
    let mut worst = 0f32;
    // Whether the graph's own last choice is certainly `tok` (the last step's margin was
    // beyond the bound); only then may a step continue from it without a host write.
    let mut own_choice_is_tok = false;
    for step in 0..300 {
        let pos = prompt.len() + step;
        let want = host(&e.forward(&[tok], pos).unwrap()).remove(0);
        let clear = margin(&want) > tolerance(&want);
        if step % 3 == 2 && own_choice_is_tok {
            let next = g.decode_greedy(None).unwrap()[0];
            if clear {
                assert_eq!(next, argmax(&want), "{what} step {step}: greedy token");
            }
        } else {
            let got = host(&g.decode_logits(&[tok]).unwrap()).remove(0);
            worst = worst.max(check(&format!("{what} step {step}"), &got, &want));
        }
        own_choice_is_tok = clear;
        tok = argmax(&want);
    }
    assert_eq!(g.sequence_lens(), vec![prompt.len() + 300]);
    eprintln!("{what}: 300 graph steps, worst |diff| {worst:.5}");
}

#[test]
fn graph_matches_eager_batch_one() {
    for kind in [KvCacheKind::Bf16, KvCacheKind::UltraQuant] {
        batch_one(&format!("tiny {kind:?}"), &tiny, kind);
        batch_one(&format!("random {kind:?}"), &random, kind);
    }
}

/// The greedy continuation replays with no host write: its tokens equal those of eager
/// greedy decoding (`forward` fed its own argmax) up to the first step where the eager
/// logits have a (near-)tie within the bound, where the graph's choice must be one of the
/// tied tokens (the runs then continue from different tokens, so the comparison stops).
#[test]
fn graph_greedy_tokens_match_eager() {
    for kind in [KvCacheKind::Bf16, KvCacheKind::UltraQuant] {
        let mut g = tiny(&opts(kind, 1, true));
        let mut e = tiny(&opts(kind, 1, false));
        let prompt = [1u32, 5, 9];
        let l = host(&g.forward(&prompt, 0).unwrap()).remove(0);
        e.forward(&prompt, 0).unwrap();
        let first = argmax(&l);
        let mut want = vec![];
        let mut logits = vec![];
        let mut tok = first;
        for step in 0..200 {
            want.push(tok);
            let l = host(&e.forward(&[tok], prompt.len() + step).unwrap()).remove(0);
            tok = argmax(&l);
            logits.push(l);
        }
        let mut got = vec![first];
        got.push(g.decode_greedy(Some(&[first])).unwrap()[0]);
        while got.len() < 200 {
            got.push(g.decode_greedy(None).unwrap()[0]);
        }
        let agree = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!("{kind:?}: greedy tokens agree on the first {agree} of 200");
        if agree < 200 {
            // Token `agree` is the choice from the logits of step `agree - 1`.
            let l = &logits[agree - 1];
            let max = l[argmax(l) as usize];
            let mine = l[got[agree] as usize];
            eprintln!(
                "{kind:?}: token {agree}: graph {} ({mine}), eager {} ({max})",
                got[agree], want[agree]
            );
            assert!(
                max - mine <= tolerance(l),
                "{kind:?}: token {agree}: the graph chose {} ({mine}), eager {} ({max}): not a near-tie",
                got[agree],
                want[agree]
            );
        }
    }
}

/// Batch 3, sequences of 4, 40 and 150 tokens: graph against the same step eager, 249 steps
/// (the longest then holds 399 of the 400-token context).
#[test]
fn graph_matches_eager_batch_three() {
    let prompts: [Vec<u32>; 3] = [
        vec![2, 3, 4, 5],
        (0..40).map(|i| (i * 7 % 250) as u32).collect(),
        (0..150).map(|i| (i * 13 % 250) as u32).collect(),
    ];
    for kind in [KvCacheKind::Bf16, KvCacheKind::UltraQuant] {
        for (name, make) in [
            ("tiny", &tiny as &dyn Fn(&LoadOptions) -> Llama),
            ("random", &random),
        ] {
            let mut g = make(&opts(kind, 3, true));
            let mut e = make(&opts(kind, 3, false));
            let mut toks = vec![];
            for (s, p) in prompts.iter().enumerate() {
                let a = host(&g.prefill_seq(s, p).unwrap()).remove(0);
                let b = host(&e.prefill_seq(s, p).unwrap()).remove(0);
                assert_eq!(a, b, "{name} {kind:?}: prefill {s}");
                toks.push(argmax(&b));
            }
            let mut worst = 0f32;
            for step in 0..249 {
                let got = host(&g.decode_logits(&toks).unwrap());
                let want = host(&e.decode_logits(&toks).unwrap());
                for s in 0..3 {
                    let w = check(
                        &format!("{name} {kind:?} seq {s} step {step}"),
                        &got[s],
                        &want[s],
                    );
                    worst = worst.max(w);
                    toks[s] = argmax(&want[s]);
                }
            }
            assert_eq!(g.sequence_lens(), e.sequence_lens());
            eprintln!("{name} {kind:?} batch 3: 249 graph steps, worst |diff| {worst:.5}");
        }
    }
}
