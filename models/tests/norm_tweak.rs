//! Norm tweaking (`candle_fp4_models::norm_tweak`, `quantize --norm-tweak`): the
//! differentiable block forward computes what the inference forward computes, the tweak
//! lowers the block-output loss it optimizes (also measured through the inference forward
//! of the written checkpoint), it changes only the norm tensors, and bad options are errors.

use candle_core::{DType, Device, Tensor};
use candle_fp4_models::gptq::GptqParams;
use candle_fp4_models::norm_tweak::{tweak_norms, NormTweakParams};
use candle_fp4_models::quantize::{
    quantize_model, CalibData, OutputFormat, QuantMethod, QuantizeOptions, Summary,
};
use candle_fp4_models::{Llama, LoadOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::SafeTensors;
use std::path::Path;

mod common;
use common::{bf16_dir, data, max_abs};

fn load(dir: &Path) -> Llama {
    let opts = LoadOptions {
        max_seq_len: Some(128),
        ..Default::default()
    };
    Llama::load(dir, &Device::Cpu, &opts).unwrap()
}

fn ids(seed: u64, n: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(3..256)).collect()
}

fn norm(v: &[f32]) -> Tensor {
    Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
}

/// BF16 unit roundoff.
const U_BF16: f64 = 1.0 / 256.0;

/// Rounding points of the inference block forward on one path from the block's input to
/// its output (QuantLinear's matmul path, KV cache): q/k/v input, the `e2m1·e4m3` product,
/// the global-scale product, K in the cache, o_proj input, product, global scale,
/// gate/up input, product, global scale, `silu(g)·u`, down_proj product, global scale.
const ROUNDINGS: i32 = 13;

#[test]
fn differentiable_block_forward_matches_the_inference_forward() {
    // ModelOpt's NVFP4 export of the fixture (fused q/k/v and gate/up) and the BF16
    // original (BF16 projections).
    let bf16 = bf16_dir();
    for dir in [data(), bf16.path().to_path_buf()] {
        let mut m = load(&dir);
        // 48 tokens: more than the GEMV's 32, so the projections run the matmul path the
        // differentiable forward mirrors (the calibration windows are longer still).
        let mut x = m.embed_tokens(&ids(3, 48)).unwrap();
        for i in 0..m.config().num_hidden_layers {
            let y = m.block_output(i, &x).unwrap();
            let p = m.block_params(i).unwrap();
            let (a, g) = (norm(&p.attn_norm), norm(&p.mlp_norm));
            let d = p.forward(&x, &a, &g, true).unwrap();
            let plain = p.forward(&x, &a, &g, false).unwrap();
            let branch = max_abs(&(&y - &x).unwrap()) as f64;
            let err = max_abs(&(&d - &y).unwrap()) as f64;
            let err_plain = max_abs(&(&plain - &y).unwrap()) as f64;
            // The two forwards round at the same points, so they differ only where F32
            // reorderings (matmul accumulation order, fused RMSNorm / softmax kernels)
            // tip a BF16 rounding the other way: at most one BF16 ulp (2·u relative) at
            // each of the ROUNDINGS points of a path, carried to the output of the two
            // branches (attention, MLP), each at most `branch` in size.
            let tol = 2.0 * ((1.0 + 2.0 * U_BF16).powi(ROUNDINGS) - 1.0) * branch;
            eprintln!(
                "{} block {i}: err {err:.3e} (without the roundings {err_plain:.3e}), tol {tol:.3e}, branch {branch:.3e}",
                dir.display()
            );
            assert!(err <= tol, "block {i}: {err} > {tol}");
            assert!(d.dtype() == DType::F32 && d.dims() == y.dims());
            x = y;
        }
    }
}

fn opts(ids: Vec<u32>, tweak: Option<NormTweakParams>) -> QuantizeOptions {
    QuantizeOptions {
        format: OutputFormat::Nvfp4,
        exclude: vec![],
        method: QuantMethod::Gptq {
            calib: CalibData::TokenIds(ids),
            calib_tokens: 128,
            window: 64,
            sequential: true,
            params: GptqParams::default(),
            awq: true,
            awq_vo: false,
            norm_tweak: tweak,
        },
    }
}

fn quantize(o: &QuantizeOptions) -> (tempfile::TempDir, Summary) {
    let src = bf16_dir();
    let out = tempfile::tempdir().unwrap();
    let s = quantize_model(src.path(), out.path(), o, &mut |_| {}).unwrap();
    (out, s)
}

/// Block 0's mean squared output error against the BF16 model over the windows of `ids`
/// (inference forward; block 0's input, the embeddings, is the same in every model).
fn block0_mse(dir: &Path, reference: &mut Llama, ids: &[u32]) -> f64 {
    let mut m = load(dir);
    let (mut se, mut n) = (0f64, 0usize);
    for w in ids.chunks(64) {
        let x = m.embed_tokens(w).unwrap();
        let d = (m.block_output(0, &x).unwrap() - reference.block_output(0, &x).unwrap()).unwrap();
        se += d
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        n += d.elem_count();
    }
    se / n as f64
}

#[test]
fn norm_tweaking_lowers_the_block_loss_and_changes_only_norms() {
    let ids = ids(8, 128);
    let (plain, s0) = quantize(&opts(ids.clone(), None));
    assert!(s0.norm_tweak.is_empty());
    let tweak = NormTweakParams {
        steps: 30,
        lr: 1e-2,
    };
    let (tweaked, s1) = quantize(&opts(ids.clone(), Some(tweak)));
    assert_eq!(s1.norm_tweak.len(), 2);
    for (i, before, after, kept) in &s1.norm_tweak {
        eprintln!("layer {i}: {before:.4e} -> {after:.4e} kept {kept}");
        assert!(after <= before && after.is_finite());
        assert_eq!(*kept, after < before);
    }
    let (_, before0, after0, kept0) = s1.norm_tweak[0];
    assert!(kept0 && after0 < 0.9 * before0, "{after0} vs {before0}");
    // Layer 0 is quantized the same way in both runs (same inputs), so its tweak lowers
    // the loss measured through the inference forward of the written checkpoints too.
    let bf = bf16_dir();
    let mut reference = load(bf.path());
    let mse_plain = block0_mse(plain.path(), &mut reference, &ids);
    let mse_tweaked = block0_mse(tweaked.path(), &mut reference, &ids);
    eprintln!("block 0 inference MSE: plain {mse_plain:.4e}, tweaked {mse_tweaked:.4e}");
    assert!(mse_tweaked < mse_plain);
    // Same tensors, names, dtypes and shapes. Layer 0's Linears are the same bytes, its
    // norms differ; layer 1's Linears are calibrated (sequential GPTQ) on layer 0's tweaked
    // output, so they may differ too.
    let changed = changed_tensors(plain.path(), tweaked.path());
    assert!(
        changed
            .iter()
            .all(|n| n.ends_with("layernorm.weight") || n.starts_with("model.layers.1.")),
        "{changed:?}"
    );
    assert!(changed.contains(&"model.layers.0.input_layernorm.weight".to_string()));
    for f in ["config.json", "hf_quant_config.json"] {
        assert_eq!(
            std::fs::read(plain.path().join(f)).unwrap(),
            std::fs::read(tweaked.path().join(f)).unwrap()
        );
    }
    // It loads and runs.
    let mut m = load(tweaked.path());
    assert_eq!(m.nvfp4_layer_count().0, 8);
    let v = m.forward(&ids[..20], 0).unwrap().to_vec1::<f32>().unwrap();
    assert!(v.iter().all(|x| x.is_finite()));
}

/// The tensors whose bytes differ between two checkpoints with the same names, dtypes and
/// shapes.
fn changed_tensors(a: &Path, b: &Path) -> Vec<String> {
    let (a, b) = (
        std::fs::read(a.join("model.safetensors")).unwrap(),
        std::fs::read(b.join("model.safetensors")).unwrap(),
    );
    let (a, b) = (
        SafeTensors::deserialize(&a).unwrap(),
        SafeTensors::deserialize(&b).unwrap(),
    );
    let mut names = a.names();
    names.sort();
    let mut names_b = b.names();
    names_b.sort();
    assert_eq!(names, names_b);
    let mut changed = vec![];
    for n in names {
        let (ta, tb) = (a.tensor(n).unwrap(), b.tensor(n).unwrap());
        assert_eq!((ta.dtype(), ta.shape()), (tb.dtype(), tb.shape()), "{n}");
        if ta.data() != tb.data() {
            changed.push(n.to_string());
        }
    }
    changed
}

#[test]
fn with_one_quantized_layer_only_its_norms_change() {
    // Layer 1 kept in BF16: nothing downstream of layer 0's tweak is recalibrated, so the
    // checkpoints differ in layer 0's two norm weights and nothing else.
    let ids = ids(9, 128);
    let tweak = NormTweakParams {
        steps: 30,
        lr: 1e-2,
    };
    let mut o = opts(ids.clone(), None);
    o.exclude = vec!["model.layers.1.*".to_string()];
    let (plain, _) = quantize(&o);
    if let QuantMethod::Gptq { norm_tweak, .. } = &mut o.method {
        *norm_tweak = Some(tweak);
    }
    let (tweaked, s) = quantize(&o);
    assert_eq!(s.norm_tweak.len(), 1);
    assert!(s.norm_tweak[0].3);
    assert_eq!(
        changed_tensors(plain.path(), tweaked.path()),
        [
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight"
        ]
    );
    let mut m = load(tweaked.path());
    assert_eq!(m.nvfp4_layer_count().0, 4);
    let v = m.forward(&ids[..20], 0).unwrap().to_vec1::<f32>().unwrap();
    assert!(v.iter().all(|x| x.is_finite()));
}

#[test]
fn nothing_to_tweak_keeps_the_norms() {
    // Targets that are the block's own output: the loss is 0 already, no step lowers it,
    // the norms come back unchanged.
    let m = load(&data());
    let x = m.embed_tokens(&ids(5, 40)).unwrap();
    let p = m.block_params(0).unwrap();
    let own = p
        .forward(&x, &norm(&p.attn_norm), &norm(&p.mlp_norm), true)
        .unwrap();
    let r = tweak_norms(&p, &[x], &[own], &NormTweakParams::default()).unwrap();
    assert_eq!(r.loss_before, 0.0);
    assert!(!r.kept);
    assert_eq!(
        (r.attn_norm, r.mlp_norm),
        (p.attn_norm.clone(), p.mlp_norm.clone())
    );
    assert!(m.block_params(2).is_err());
}

#[test]
fn bad_norm_tweak_options_are_errors() {
    for (steps, lr) in [
        (0, 1e-3),
        (20_000, 1e-3),
        (10, 0.0),
        (10, -1e-3),
        (10, f64::NAN),
        (10, f64::INFINITY),
        (10, 2.0),
    ] {
        let p = NormTweakParams { steps, lr };
        assert!(p.check().is_err(), "{p:?}");
        let src = bf16_dir();
        let out = tempfile::tempdir().unwrap();
        let e = quantize_model(
            src.path(),
            out.path(),
            &opts(ids(1, 128), Some(p)),
            &mut |_| {},
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("norm tweaking"), "{e:#}");
    }
    assert!(NormTweakParams::default().check().is_ok());
    // Without sequential calibration, or with a BF16 output.
    let src = bf16_dir();
    let mut o = opts(ids(1, 128), Some(NormTweakParams::default()));
    if let QuantMethod::Gptq {
        sequential, awq, ..
    } = &mut o.method
    {
        *sequential = false;
        *awq = false;
    }
    let out = tempfile::tempdir().unwrap();
    let e = quantize_model(src.path(), out.path(), &o, &mut |_| {}).unwrap_err();
    assert!(format!("{e:#}").contains("sequential"), "{e:#}");
    let mut o = opts(ids(1, 128), Some(NormTweakParams::default()));
    o.format = OutputFormat::Bf16;
    let out = tempfile::tempdir().unwrap();
    let e = quantize_model(src.path(), out.path(), &o, &mut |_| {}).unwrap_err();
    assert!(format!("{e:#}").contains("NVFP4 output"), "{e:#}");
    // Windows and targets that do not pair up.
    let m = load(&data());
    let p = m.block_params(0).unwrap();
    let x = m.embed_tokens(&ids(2, 40)).unwrap();
    let short = x.narrow(0, 0, 30).unwrap();
    let np = NormTweakParams::default();
    assert!(tweak_norms(&p, std::slice::from_ref(&x), &[], &np).is_err());
    assert!(tweak_norms(&p, &[x], &[short], &np).is_err());
    assert!(tweak_norms(&p, &[], &[], &np).is_err());
}
