//! AWQ channel scaling before GPTQ (`candle_fp4_models::quant::awq`, `quantize --method gptq
//! --awq`): the folds (norm → Linear, up → down) are exact in exact arithmetic, the scaled
//! model in BF16 is the original model up to BF16 roundings, the NVFP4 checkpoint loads,
//! and bad inputs are errors.

use candle_core::{Device, Tensor};
use candle_fp4_models::quant::awq::{awq_scales, divide_rows, rtn_loss, scale_columns};
use candle_fp4_models::quant::gptq::GptqParams;
use candle_fp4_models::quant::{
    quantize_model, CalibData, OutputFormat, QuantMethod, QuantizeOptions,
};
use candle_fp4_models::{Llama, LoadOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::SafeTensors;

mod common;
use common::{bf16_dir, max_abs};

#[test]
fn fold_is_exact_up_to_f32_rounding() {
    let mut rng = StdRng::seed_from_u64(3);
    let (n, k) = (8, 64);
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let x: Vec<f32> = (0..k).map(|_| rng.random_range(-4.0..4.0)).collect();
    // Channel RMS over four orders of magnitude, one dead channel.
    let mut rms: Vec<f64> = (0..k)
        .map(|_| 10f64.powf(rng.random_range(-2.0..2.0)))
        .collect();
    rms[5] = 0.0;
    for alpha in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let s = awq_scales(&rms, alpha).unwrap();
        assert_eq!(s[5], 1.0);
        assert!(s.iter().all(|v| v.is_finite() && *v > 0.0));
        let ws = scale_columns(&w, k, &s);
        let xs: Vec<f32> = x.iter().zip(&s).map(|(a, b)| a / b).collect();
        for r in 0..n {
            let row = &w[r * k..(r + 1) * k];
            let srow = &ws[r * k..(r + 1) * k];
            let y: f32 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
            let ys: f32 = srow.iter().zip(&xs).map(|(a, b)| a * b).sum();
            // Each scaled product w·s·(x/s) is w·x within 3 roundings (u = 2⁻²⁴); both
            // sums of k terms add at most (k − 1)·u·Σ|w·x| each (first order).
            let mag: f32 = row.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            let u = f32::EPSILON / 2.0;
            let bound = (3.0 + 2.0 * (k as f32 - 1.0)) * u * mag * 1.01;
            assert!((y - ys).abs() <= bound, "α {alpha} row {r}: {y} vs {ys}");
        }
    }
}

#[test]
fn rtn_loss_at_alpha_zero_is_the_plain_rtn_loss() {
    let mut rng = StdRng::seed_from_u64(4);
    let (n, k) = (4, 32);
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.1..0.1)).collect();
    let h: Vec<f64> = (0..k * k)
        .map(|i| if i % (k + 1) == 0 { 1.0 } else { 0.0 })
        .collect();
    let ones = vec![1f32; k];
    let l = rtn_loss(&[(w.clone(), n, k)], &ones, &h).unwrap();
    let q = candle_fp4::nvfp4::quantize_nvfp4_slice(&w, n, k, None)
        .unwrap()
        .dequantize();
    let want: f64 = w
        .iter()
        .zip(&q)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    assert!((l - want).abs() <= 1e-9 * want.max(1e-12), "{l} vs {want}");
}

fn awq_opts(ids: Vec<u32>, format: OutputFormat, sequential: bool) -> QuantizeOptions {
    QuantizeOptions {
        format,
        exclude: vec![],
        method: QuantMethod::Gptq {
            calib: CalibData::TokenIds(ids),
            calib_tokens: 150,
            window: 64,
            sequential,
            params: GptqParams::default(),
            awq: true,
        },
    }
}

#[test]
fn tiny_model_awq_checkpoint_loads_and_its_bf16_equivalent_matches() {
    let src = bf16_dir();
    let mut rng = StdRng::seed_from_u64(8);
    let ids: Vec<u32> = (0..150).map(|_| rng.random_range(3..256)).collect();
    let (a, orig) = (
        std::fs::read(src.path().join("model.safetensors")).unwrap(),
        logits(src.path(), &ids[..40]),
    );
    let a = SafeTensors::deserialize(&a).unwrap();
    let q = tempfile::tempdir().unwrap();
    let s = quantize_model(
        src.path(),
        q.path(),
        &awq_opts(ids.clone(), OutputFormat::Nvfp4, true),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!((s.quantized, s.kept), (14, 7));
    let mut m = Llama::load(q.path(), &Device::Cpu, &LoadOptions::default()).unwrap();
    assert_eq!(m.nvfp4_layer_count(), (8, 9));
    let v = m.forward(&ids[..20], 0).unwrap().to_vec1::<f32>().unwrap();
    assert!(v.iter().all(|x| x.is_finite()));
    // The norms were rescaled (AWQ chose some α > 0 somewhere).
    let b = std::fs::read(q.path().join("model.safetensors")).unwrap();
    let b = SafeTensors::deserialize(&b).unwrap();
    let norms: Vec<String> = a
        .names()
        .into_iter()
        .filter(|n| n.ends_with("layernorm.weight"))
        .map(str::to_string)
        .collect();
    assert_eq!(norms.len(), 4);
    assert!(norms
        .iter()
        .any(|n| a.tensor(n).unwrap().data() != b.tensor(n).unwrap().data()));
    for n in &norms {
        let t = b.tensor(n).unwrap();
        assert_eq!(
            (t.dtype(), t.shape()),
            (a.tensor(n).unwrap().dtype(), a.tensor(n).unwrap().shape())
        );
    }

    // The unquantized equivalent: BF16 scaled weights and scaled norms.
    let r = tempfile::tempdir().unwrap();
    quantize_model(
        src.path(),
        r.path(),
        &awq_opts(ids.clone(), OutputFormat::Bf16, true),
        &mut |_| {},
    )
    .unwrap();
    let diff = max_abs(&(&orig - &logits(r.path(), &ids[..40])).unwrap());
    // In exact arithmetic the folds leave the model unchanged; what remains are the
    // BF16 roundings of the rescaled tensors, each a relative error ≤ 2⁻⁸ per value
    // (8 significant bits).
    // Per layer every path through it meets five of them: input_layernorm, q/k/v,
    // post_attention_layernorm, gate/up (up's row and column scales are applied in
    // F32 and rounded once), down_proj. To first order the logits move by at most
    // (1 + 2⁻⁸)^(roundings·layers) − 1 relative, of the largest logit.
    let (layers, roundings) = (2, 5);
    let bound = ((1.0 + 2f32.powi(-8)).powi(roundings * layers) - 1.0) * max_abs(&orig);
    eprintln!(
        "max |Δ logit| {diff:.3e}, bound {bound:.3e} (max |logit| {:.3})",
        max_abs(&orig)
    );
    assert!(
        diff > 0.0,
        "the scaled model is bit-identical: AWQ did nothing"
    );
    assert!(diff <= bound, "max |Δ logit| {diff} > {bound}");
}

/// The logits of the model in `dir` over `ids`.
fn logits(dir: &std::path::Path, ids: &[u32]) -> Tensor {
    let mut m = Llama::load(dir, &Device::Cpu, &LoadOptions::default()).unwrap();
    m.forward_all(ids, 0).unwrap()
}

#[test]
fn bad_awq_inputs_are_errors() {
    let src = bf16_dir();
    let ids: Vec<u32> = (3..203).collect();
    let out = tempfile::tempdir().unwrap();
    let e = quantize_model(
        src.path(),
        out.path(),
        &awq_opts(ids, OutputFormat::Nvfp4, false),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("sequential"), "{e:#}");
    assert!(awq_scales(&[1.0, 2.0], -0.5).is_err());
    assert!(awq_scales(&[1.0, f64::NAN], 0.5).is_err());
    assert!(awq_scales(&[1.0, -2.0], 0.5).is_err());
    // All-dead channels: no scaling.
    assert_eq!(awq_scales(&[0.0, 0.0], 0.5).unwrap(), vec![1.0, 1.0]);
    let w = vec![0.1f32; 32];
    assert!(rtn_loss(&[(w.clone(), 1, 32)], &[1.0; 16], &[1.0; 256]).is_err());
    assert!(rtn_loss(&[(w, 1, 32)], &[1.0; 32], &[1.0; 16]).is_err());
    // Row scales not matching the weight.
    let mut w = vec![1.0f32; 32];
    assert!(divide_rows(&mut w, 16, &[1.0; 3]).is_err());
    assert!(divide_rows(&mut w, 0, &[]).is_err());
}
