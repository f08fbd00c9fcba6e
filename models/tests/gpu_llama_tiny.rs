//! The tiny ModelOpt-exported Llama on a CUDA GPU (feature `cuda`, needs a GPU): prefill
//! and token-by-token decode with the BF16 and the UltraQuant KV cache, against
//! transformers' FP32 logits (BF16 cache) and against the same model on the CPU
//! (UltraQuant cache).
//!
//! Tolerances as in `llama_tiny.rs`: one BF16 ulp of the largest logit, 2⁻⁷·max(1, max|ref|),
//! doubled because on CUDA every activation is BF16 (the CPU test with BF16 activations
//! uses the same bound). GPU vs CPU with the FP4 cache: the encoders agree bit for bit on
//! the same input (`tests/kv_cache_gpu.rs`), but the K/V they receive differ by BF16
//! roundings of the projections, and an element that crosses an E2M1 rounding boundary
//! moves by a whole code step (a quarter to one group scale) instead of an ulp; the first
//! H200 run measured 0.028 against the two-ulp bound 0.016. Bound: 8 BF16 ulps,
//! 2⁻⁴·max(1, max|ref|), and the argmax must agree.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4_models::{Llama, LoadOptions};

mod common;
use common::{data, logit_tolerance, max_abs};

fn gpu() -> Device {
    static DEV: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEV.get_or_init(|| Device::new_cuda(0).expect("this test needs a CUDA GPU"))
        .clone()
}

fn reference() -> (Vec<u32>, Tensor) {
    let r = common::reference();
    (r.ids, r.dequant)
}

fn tolerance(reference: &Tensor) -> f32 {
    logit_tolerance(reference, 2.0)
}

fn check(what: &str, got: &Tensor, want: &Tensor) {
    check_with(what, got, want, tolerance(want))
}

fn check_with(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    let got = got
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let want = want.to_dtype(DType::F32).unwrap();
    assert_eq!(got.dims(), want.dims(), "{what}");
    let max = max_abs(&(&got - &want).unwrap());
    let a = got.argmax(1).unwrap().to_vec1::<u32>().unwrap();
    let b = want.argmax(1).unwrap().to_vec1::<u32>().unwrap();
    let agree = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    eprintln!("{what}: max |diff| {max:.5}, argmax {agree}/{}", a.len());
    assert!(max <= tol, "{what}: max |diff| {max} > {tol}");
    assert!(
        agree + 1 >= a.len(),
        "{what}: argmax agrees on {agree}/{}",
        a.len()
    );
}

/// Prefill of the first half, then one token at a time: logits of every position.
fn prefill_then_decode(m: &mut Llama, ids: &[u32]) -> Tensor {
    let half = ids.len() / 2;
    let mut rows = vec![m
        .forward_all(&ids[..half], 0)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()];
    for (i, &t) in ids.iter().enumerate().skip(half) {
        let l = m
            .forward_all(&[t], i)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        rows.push(l);
    }
    Tensor::cat(&rows, 0).unwrap()
}

#[test]
fn nvfp4_model_on_gpu_matches_transformers() {
    let (ids, want) = reference();
    let opts = LoadOptions {
        kv_cache: KvCacheKind::Bf16,
        ..Default::default()
    };
    let mut m = Llama::load(data(), &gpu(), &opts).unwrap();
    check(
        "GPU, BF16 cache, prefill",
        &m.forward_all(&ids, 0).unwrap(),
        &want,
    );
    m.reset().unwrap();
    check(
        "GPU, BF16 cache, decode",
        &prefill_then_decode(&mut m, &ids),
        &want,
    );
}

#[test]
fn ultraquant_cache_on_gpu_matches_cpu() {
    let (ids, _) = reference();
    // Window 0: every token from the FP4 slots; 5: the last 5 tokens exact (the ring wraps
    // during the decode), as the models' default window does on longer texts.
    for kv_window in [0, 5] {
        let opts = LoadOptions {
            kv_cache: KvCacheKind::UltraQuant,
            dtype: Some(DType::BF16),
            kv_window,
            ..Default::default()
        };
        let mut g = Llama::load(data(), &gpu(), &opts).unwrap();
        let mut c = Llama::load(data(), &Device::Cpu, &opts).unwrap();
        let want = prefill_then_decode(&mut c, &ids);
        let tol = 4.0 * tolerance(&want);
        check_with(
            &format!("GPU vs CPU, UltraQuant cache (exact window {kv_window}), decode"),
            &prefill_then_decode(&mut g, &ids),
            &want,
            tol,
        );
    }
}
