//! Budgeted NVFP4 / BF16 mixes and the evaluation runner on the tiny ModelOpt Llama
//! (`tests/data/modelopt_tiny`, 2 layers): sensitivities, the checkpoint a budget writes
//! (a valid ModelOpt export whose BF16 groups are in `exclude_modules`), its byte count,
//! and the text metrics of a model against itself and against its NVFP4 version.

mod common;

use candle_core::Device;
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4::quant_config::QuantConfig;
use candle_fp4_models::eval::runner::score_windows;
use candle_fp4_models::mix::{
    checkpoint_linear_bytes, measure_sensitivity, quantize_with_budget, MixOptions, PLAN_FILE,
};
use candle_fp4_models::quant::{quantize_model, CalibData, QuantizeOptions};
use candle_fp4_models::{Llama, LoadOptions};
use common::bf16_dir;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Seeded token ids inside the tiny vocabulary.
fn ids(seed: u64, n: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(3..200u32)).collect()
}

fn load(dir: &std::path::Path) -> Llama {
    let o = LoadOptions {
        kv_cache: KvCacheKind::Bf16,
        max_seq_len: Some(128),
        prefill_chunk: 64,
        ..Default::default()
    };
    Llama::load(dir, &Device::Cpu, &o).unwrap()
}

#[test]
fn sensitivities_are_measured_per_group_and_repeat() {
    let d = bf16_dir();
    let w = vec![ids(1, 64), ids(2, 40)];
    let c = measure_sensitivity(d.path(), &w, &mut |_, _| {}).unwrap();
    assert_eq!(c.len(), 8); // 2 layers × (q/k/v, o, gate/up, down)
    assert_eq!(c[0].modules.len(), 3);
    assert!(c[0].modules[0].ends_with("layers.0.self_attn.q_proj"));
    assert!(c[7].modules[0].ends_with("layers.1.mlp.down_proj"));
    for x in &c {
        // Quantizing any group moves the output distribution a little, never by much
        // on a random-weight model (KL in nats per token).
        assert!(x.sensitivity > 0.0 && x.sensitivity < 1.0, "{x:?}");
        assert!(x.bf16_bytes > x.nvfp4_bytes);
    }
    // q/k/v: [192 + 64 + 64, 192] → NVFP4 320·192·(1/2 + 1/16) + 3·4 bytes.
    assert_eq!(c[0].nvfp4_bytes, 320 * 192 * 9 / 16 + 12);
    assert_eq!(c[0].bf16_bytes, 320 * 192 * 2);
    let again = measure_sensitivity(d.path(), &w, &mut |_, _| {}).unwrap();
    assert_eq!(c, again);
    assert!(measure_sensitivity(d.path(), &[vec![5]], &mut |_, _| {}).is_err());
}

#[test]
fn a_budget_writes_a_modelopt_checkpoint_with_the_bf16_groups_excluded() {
    let d = bf16_dir();
    let calib = CalibData::TokenIds(ids(3, 128));
    let opts = QuantizeOptions::default();
    let out = tempfile::tempdir().unwrap();
    let q = out.path().join("mix");
    let mix = MixOptions {
        budget: 1.6,
        sens_tokens: 96,
        sens_window: 64,
        sensitivity_file: None,
    };
    let (s, plan) = quantize_with_budget(
        d.path(),
        &q,
        &opts,
        &mix,
        &calib,
        &mut |_, _| {},
        &mut |_| {},
    )
    .unwrap();
    let sel = plan.selection.clone().unwrap();
    assert!(!sel.bf16.is_empty() && sel.bf16.len() < 8, "{sel:?}");
    let chosen = plan.exclude();
    // The quantizer's summary: the chosen Linears stayed 16-bit.
    assert_eq!(s.quantized, 14 - chosen.len());
    let qc = QuantConfig::from_dir(&q).unwrap();
    for m in &chosen {
        assert!(qc.is_excluded(m), "{m} not excluded");
    }
    for c in &plan.candidates {
        let excluded = qc.is_excluded(&c.modules[0]);
        assert_eq!(excluded, chosen.contains(&c.modules[0]), "{:?}", c.modules);
    }
    // The bytes on disk are the selection's, within the budget.
    let (bytes, base) = checkpoint_linear_bytes(&q).unwrap();
    assert_eq!((bytes, base), (sel.bytes, sel.base_bytes));
    assert!(bytes as f64 <= 1.6 * base as f64);
    assert!(q.join(PLAN_FILE).is_file());
    // It loads, with the chosen Linears in BF16.
    let mut m = load(&q);
    let (nq, nl) = m.nvfp4_layer_count(); // fused layers count once
    assert!(nq > 0 && nq < nl, "{nq} of {nl}");
    let l = m
        .forward_all(&ids(4, 20), 0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert!(l.iter().flatten().all(|v| v.is_finite()));

    // The same plan from the recorded sensitivities.
    let again = MixOptions {
        sensitivity_file: Some(q.join(PLAN_FILE)),
        ..mix.clone()
    };
    let (_, p2) = quantize_with_budget(
        d.path(),
        &out.path().join("again"),
        &opts,
        &again,
        &calib,
        &mut |_, _| {},
        &mut |_| {},
    )
    .unwrap();
    // serde_json's float parsing may differ from the written value in the last bit.
    assert_eq!(p2.selection, plan.selection);
    for (a, b) in p2.candidates.iter().zip(&plan.candidates) {
        assert_eq!(
            (&a.modules, a.nvfp4_bytes, a.bf16_bytes),
            (&b.modules, b.nvfp4_bytes, b.bf16_bytes)
        );
        assert!((a.sensitivity - b.sensitivity).abs() <= 1e-15 * b.sensitivity);
    }

    // Budget 1: exactly the plain quantizer's checkpoint (nothing measured).
    let q1 = out.path().join("b1");
    let one = MixOptions {
        budget: 1.0,
        ..mix.clone()
    };
    let (_, p1) = quantize_with_budget(
        d.path(),
        &q1,
        &opts,
        &one,
        &calib,
        &mut |_, _| {},
        &mut |_| {},
    )
    .unwrap();
    assert!(p1.exclude().is_empty() && p1.candidates.is_empty());
    let plain = out.path().join("plain");
    quantize_model(d.path(), &plain, &opts, &mut |_| {}).unwrap();
    assert_eq!(
        std::fs::read(q1.join("model.safetensors")).unwrap(),
        std::fs::read(plain.join("model.safetensors")).unwrap()
    );
    let (b1, base1) = checkpoint_linear_bytes(&plain).unwrap();
    assert_eq!(b1, base1);
    // Bad budgets are errors.
    let bad = MixOptions { budget: 0.5, ..mix };
    let e = quantize_with_budget(
        d.path(),
        &out.path().join("bad"),
        &opts,
        &bad,
        &calib,
        &mut |_, _| {},
        &mut |_| {},
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("budget"), "{e:#}");
}

#[test]
fn text_metrics_of_a_model_against_itself_and_its_nvfp4_version() {
    let d = bf16_dir();
    let out = tempfile::tempdir().unwrap();
    let q = out.path().join("q");
    quantize_model(d.path(), &q, &QuantizeOptions::default(), &mut |_| {}).unwrap();
    let text = ids(9, 150);
    let ws: Vec<&[u32]> = text.chunks(64).collect();
    let mut reference = load(d.path());
    let mut same = load(d.path());
    let mut nvfp4 = load(&q);
    let (r, sums) = score_windows(
        &mut reference,
        &mut [&mut same, &mut nvfp4],
        &ws,
        &mut |_| {},
    )
    .unwrap();
    // 63 + 63 + 21 scored positions.
    assert_eq!(r.tokens, 147);
    assert_eq!(sums[0], r);
    assert!(r.mean_kl().abs() < 1e-9 && r.top1_agreement() == 1.0);
    let n = &sums[1];
    assert_eq!(n.tokens, 147);
    assert!(n.mean_kl() > 1e-6, "{}", n.mean_kl());
    assert!(n.top1_agreement() > 0.5 && n.top1_agreement() <= 1.0);
    assert!((n.perplexity() / r.perplexity() - 1.0).abs() < 0.5);
}
