//! Fixtures shared by the tests of the tiny ModelOpt-exported Llama in
//! `tests/data/modelopt_tiny` (each test binary uses a subset of them).
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::Rng;
use std::path::{Path, PathBuf};

/// The fixture folder: ModelOpt's NVFP4 export, `original.safetensors`, reference logits.
pub fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/modelopt_tiny")
}

/// The BF16 model as a Hugging Face folder: `original.safetensors` + `config.json` without
/// its `quantization_config` block.
pub fn bf16_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data().join("config.json")).unwrap())
            .unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        data().join("original.safetensors"),
        d.path().join("model.safetensors"),
    )
    .unwrap();
    d
}

/// transformers' FP32 eager logits of the fixture prompt.
pub struct Reference {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// Logits of the original BF16 weights.
    pub original: Tensor,
    /// Logits of ModelOpt's dequantized NVFP4 (W4A16) weights.
    pub dequant: Tensor,
}

pub fn reference() -> Reference {
    let r =
        candle_core::safetensors::load(data().join("reference_logits.safetensors"), &Device::Cpu)
            .unwrap();
    let ids = r["input_ids"]
        .flatten_all()
        .unwrap()
        .to_vec1::<i64>()
        .unwrap();
    Reference {
        ids: ids.iter().map(|&x| x as u32).collect(),
        original: r["logits_original"].clone(),
        dequant: r["logits_w4a16_dequant"].clone(),
    }
}

/// `ulps` BF16 ulps of the largest reference logit (at least of 1.0): `ulps·2⁻⁷·max(1, max|ref|)`.
pub fn logit_tolerance(reference: &Tensor, ulps: f32) -> f32 {
    ulps * max_abs(reference).max(1.0) / 128.0
}

/// max |t| over all elements (F32 tensors).
pub fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// A standard normal sample (Box–Muller).
pub fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(1e-300);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// `n` rows of an AR(1) process over `k` features: `x_j = ρ x_{j-1} + √(1-ρ²) ε_j`, unit
/// variance, correlation `ρ^|i-j|`.
pub fn ar1_inputs(rng: &mut StdRng, n: usize, k: usize, rho: f64) -> Vec<f32> {
    let mut x = Vec::with_capacity(n * k);
    for _ in 0..n {
        let mut prev = normal(rng);
        x.push(prev as f32);
        for _ in 1..k {
            prev = rho * prev + (1.0 - rho * rho).sqrt() * normal(rng);
            x.push(prev as f32);
        }
    }
    x
}

/// A weight `[n, k]`: N(0, 0.02²) with a few 4× outliers, so block scales differ.
pub fn weights(rng: &mut StdRng, n: usize, k: usize) -> Vec<f32> {
    (0..n * k)
        .map(|i| {
            let v = 0.02 * normal(rng) as f32;
            if i % 37 == 5 {
                4.0 * v
            } else {
                v
            }
        })
        .collect()
}
