//! The batched decode step ([`Llama::decode_greedy`] / [`Llama::decode_logits`]: device-side
//! ids, positions and cache lengths, what a CUDA graph replays) against the per-token
//! `forward` on the CPU, over random models ([`Llama::random`]).
//!
//! On the CPU both paths run the same kernels on the same values for one sequence (the
//! decode append writes the same rows the host-positioned append does; RoPE gathers the
//! same table rows; attention divides the same lengths), so batch 1 must agree **bit for
//! bit**. At batch > 1 the projections run with M = batch instead of M = 1, whose CPU GEMV
//! may sum in another order: each BF16 output can then differ by one rounding, which
//! propagates; bound 4 BF16 ulps of the largest logit (2⁻⁷·4·max(1, max|ref|)) and the same
//! argmax wherever the reference's top two differ by more than the bound.

use candle_core::{DType, Device, Tensor};
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4_models::config::LlamaConfig;
use candle_fp4_models::{Llama, LoadOptions, RandomSpec};

fn cfg() -> LlamaConfig {
    LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "hidden_size": 256, "intermediate_size": 320,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 300, "max_position_embeddings": 512, "tie_word_embeddings": false}"#,
        "decode_step test",
    )
    .unwrap()
}

fn model(kind: KvCacheKind, batch: usize, window: usize, nvfp4: bool) -> Llama {
    model_in(kind, batch, window, nvfp4, DType::F32)
}

/// `model` with `dtype` activations (BF16: the step runs the fused residual add + norm and
/// the greedy tail of `candle_fp4`; F32: candle's ops).
fn model_in(kind: KvCacheKind, batch: usize, window: usize, nvfp4: bool, dtype: DType) -> Llama {
    let opts = LoadOptions {
        dtype: Some(dtype),
        kv_cache: kind,
        max_seq_len: Some(200),
        kv_window: window,
        batch,
        ..LoadOptions::default()
    };
    Llama::random(cfg(), RandomSpec { nvfp4, seed: 7 }, &opts, &Device::Cpu).unwrap()
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Batch 1, past the exact window so that the UltraQuant ring wraps: the step's greedy
/// tokens and logits equal token-by-token `forward` bit for bit, with F32 activations
/// (candle's add and norm in the step) and BF16 ones (the fused residual add + norm and
/// the greedy tail, against `forward`'s candle add, `rms_norm` and argmax).
#[test]
fn batch_one_step_matches_forward_bit_for_bit() {
    for (kind, window, nvfp4, dt) in [
        (KvCacheKind::Bf16, 0, true, DType::F32),
        (KvCacheKind::UltraQuant, 16, true, DType::F32),
        (KvCacheKind::UltraQuant, 0, false, DType::F32),
        (KvCacheKind::Bf16, 0, true, DType::BF16),
        (KvCacheKind::UltraQuant, 16, true, DType::BF16),
    ] {
        let mut a = model_in(kind, 1, window, nvfp4, dt);
        let mut b = model_in(kind, 1, window, nvfp4, dt);
        let prompt = [3u32, 141, 59, 26, 5];
        let la = a.forward(&prompt, 0).unwrap();
        let lb = b.forward(&prompt, 0).unwrap();
        assert_eq!(la.to_vec1::<f32>().unwrap(), lb.to_vec1::<f32>().unwrap());
        let mut tok = argmax(&la.to_vec1::<f32>().unwrap());
        let mut pos = prompt.len();
        for step in 0..60 {
            // Alternate the logits step and the greedy continuation.
            let (want, got_next) = if step % 2 == 0 {
                let got = rows(&a.decode_logits(&[tok]).unwrap()).remove(0);
                let want = b.forward(&[tok], pos).unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(
                    got, want,
                    "{kind:?} {dt:?} window {window}: logits at step {step}"
                );
                (want, None)
            } else {
                let next = a.decode_greedy(None).unwrap();
                // `a` fed its own argmax: the token `b` must be fed too.
                let want = b.forward(&[tok], pos).unwrap().to_vec1::<f32>().unwrap();
                (want, Some(next[0]))
            };
            let expect = argmax(&want);
            if let Some(n) = got_next {
                assert_eq!(n, expect, "{kind:?}: greedy token at step {step}");
            }
            tok = expect;
            pos += 1;
            assert_eq!(
                a.sequence_lens(),
                vec![pos],
                "{kind:?}: lengths at step {step}"
            );
        }
    }
}

/// Three sequences of different lengths in one batch against each run alone.
#[test]
fn batched_step_matches_each_sequence_alone() {
    let prompts: [&[u32]; 3] = [&[1, 2, 3], &[9, 8, 7, 6, 5, 4, 3], &[100; 12]];
    for (kind, window) in [(KvCacheKind::Bf16, 0), (KvCacheKind::UltraQuant, 8)] {
        let mut batched = model(kind, 3, window, true);
        let mut alone: Vec<Llama> = (0..3).map(|_| model(kind, 1, window, true)).collect();
        let mut toks = vec![];
        for (s, p) in prompts.iter().enumerate() {
            let l = batched.prefill_seq(s, p).unwrap().to_vec1::<f32>().unwrap();
            let r = alone[s].forward(p, 0).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(l, r, "{kind:?}: prefill of sequence {s}");
            toks.push(argmax(&l));
        }
        assert_eq!(batched.sequence_lens(), vec![3, 7, 12]);
        for step in 0..20 {
            let got = rows(&batched.decode_logits(&toks).unwrap());
            for s in 0..3 {
                let pos = prompts[s].len() + step;
                let want = alone[s]
                    .forward(&[toks[s]], pos)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let max = want.iter().fold(1f32, |m, x| m.max(x.abs()));
                let tol = 4.0 * max / 128.0;
                let d = max_diff(&got[s], &want);
                assert!(d <= tol, "{kind:?} seq {s} step {step}: |diff| {d} > {tol}");
                let mut sorted = want.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                if sorted[0] - sorted[1] > tol {
                    assert_eq!(
                        argmax(&got[s]),
                        argmax(&want),
                        "{kind:?} seq {s} step {step}"
                    );
                }
                toks[s] = argmax(&want);
            }
        }
        let want: Vec<usize> = prompts.iter().map(|p| p.len() + 20).collect();
        assert_eq!(batched.sequence_lens(), want);
    }
}

/// The step refuses what it cannot do: a wrong token count, an id outside the vocabulary,
/// a greedy continuation before any step, a full context.
#[test]
fn step_errors_are_clear() {
    let mut m = model(KvCacheKind::Bf16, 2, 0, true);
    let e = m.decode_greedy(None).unwrap_err().to_string();
    assert!(e.contains("first step needs tokens"), "{e}");
    let e = m.decode_greedy(Some(&[1])).unwrap_err().to_string();
    assert!(e.contains("1 tokens for a batch of 2"), "{e}");
    let e = m.decode_greedy(Some(&[1, 300])).unwrap_err().to_string();
    assert!(e.contains("300"), "{e}");
    // Fill sequence 1 to the context (200), then one more step must fail.
    m.prefill_seq(1, &[5; 199]).unwrap();
    m.decode_greedy(Some(&[1, 2])).unwrap();
    let e = m.decode_greedy(None).unwrap_err().to_string();
    assert!(e.contains("sequence 1 holds 200 tokens"), "{e}");
    assert_eq!(m.sequence_lens(), vec![1, 200]);
}
