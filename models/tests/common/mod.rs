//! Fixtures shared by the tests of the tiny ModelOpt-exported Llama in
//! `tests/data/modelopt_tiny` (each test binary uses a subset of them).
#![allow(dead_code)]

use candle_core::{Device, Tensor};
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
