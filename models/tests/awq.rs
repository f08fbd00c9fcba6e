//! AWQ channel scaling before GPTQ (`candle_fp4_models::awq`, `quantize --method gptq
//! --awq`): the folds (norm → Linear, up → down, v → o under grouped-query attention) are
//! exact in exact arithmetic, the scaled model in BF16 is the original model up to BF16
//! roundings, the NVFP4 checkpoint loads, and bad inputs are errors.

use candle_core::{Device, Tensor};
use candle_fp4_models::awq::{
    awq_scales, divide_rows, rtn_loss, scale_columns, search_o_scales, GqaLayout,
};
use candle_fp4_models::gptq::GptqParams;
use candle_fp4_models::gptq::Hessian;
use candle_fp4_models::quantize::{
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

/// A row-major `[n, k]` matrix of uniform values in `[-1, 1)`.
fn uniform(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

#[test]
fn gqa_layout_shares_one_scale_per_kv_head_and_dimension() {
    // 6 query heads over 2 KV heads of dimension 4: o_proj's channels (h, d) of heads 0–2
    // read V head 0, those of heads 3–5 V head 1 (the attention's head grouping).
    let l = GqaLayout::new(6, 2, 4).unwrap();
    assert_eq!((l.o_inputs(), l.v_rows()), (24, 8));
    for j in 0..24 {
        let (h, d) = (j / 4, j % 4);
        assert_eq!(l.v_row(j), (h / 3) * 4 + d, "channel {j}");
    }
    // The RMS of a V row is the RMS over the query heads that read it.
    let diag: Vec<f64> = (0..24).map(|j| (j * j) as f64 + 0.5).collect();
    let rms = l.pooled_rms(&diag).unwrap();
    for (r, got) in rms.iter().enumerate() {
        let (g, d) = (r / 4, r % 4);
        let want = ((0..3).map(|q| diag[(g * 3 + q) * 4 + d]).sum::<f64>() / 3.0).sqrt();
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "row {r}: {got} vs {want}"
        );
    }
    // One scale per (KV head, d), copied to every query head of the group.
    let s_v: Vec<f32> = (0..8).map(|r| 1.0 + r as f32).collect();
    let s = l.expand(&s_v).unwrap();
    for (j, v) in s.iter().enumerate() {
        assert_eq!(*v, s_v[(j / 4 / 3) * 4 + j % 4]);
    }
    // Multi-head attention (no sharing): the identity.
    let m = GqaLayout::new(4, 4, 8).unwrap();
    assert!((0..32).all(|j| m.v_row(j) == j));

    // search_o_scales: the scales of its α from the pooled RMS, and no α of the grid has a
    // lower loss.
    // (o_proj's width must be a multiple of NVFP4's 16-value blocks: head_dim 16.)
    let l = GqaLayout::new(6, 2, 16).unwrap();
    let mut rng = StdRng::seed_from_u64(12);
    let (n, k, t) = (16, l.o_inputs(), 64);
    let mag: Vec<f32> = (0..k)
        .map(|_| 10f32.powf(rng.random_range(-1.5..1.5)))
        .collect();
    let x: Vec<f32> = (0..t * k)
        .map(|i| rng.random_range(-1.0f32..1.0) * mag[i % k])
        .collect();
    let mut h = Hessian::new(k);
    h.add(&Tensor::from_vec(x, (t, k), &Device::Cpu).unwrap())
        .unwrap();
    let o = (uniform(&mut rng, n * k), n, k);
    let grid = [0.0, 0.25, 0.5, 0.75];
    let (alpha, s_v) = search_o_scales(&o, &h, l, &grid).unwrap();
    assert_eq!(s_v.len(), l.v_rows());
    let m = h.matrix().unwrap();
    let diag: Vec<f64> = (0..k).map(|j| m[j * k + j]).collect();
    assert_eq!(
        s_v,
        awq_scales(&l.pooled_rms(&diag).unwrap(), alpha).unwrap()
    );
    let loss = |a: f64| {
        let s = l
            .expand(&awq_scales(&l.pooled_rms(&diag).unwrap(), a).unwrap())
            .unwrap();
        rtn_loss(std::slice::from_ref(&o), &s, &m).unwrap()
    };
    let best = loss(alpha);
    assert!(grid.iter().all(|a| loss(*a) >= best), "α {alpha}");
}

#[test]
fn v_to_o_fold_is_exact_under_gqa_up_to_the_weight_roundings() {
    // o_proj(attention(x·W_vᵀ)) with v_proj's rows divided by s and o_proj's input channels
    // multiplied by s (one value per (KV head, d), shared by the group's query heads) is the
    // original: the attention weights p do not depend on V and its output is Σ_τ p_τ v_τ.
    let mut rng = StdRng::seed_from_u64(13);
    let (heads, kv, hd, t, hidden, n_out) = (6, 2, 8, 5, 24, 7);
    let l = GqaLayout::new(heads, kv, hd).unwrap();
    let x = uniform(&mut rng, t * hidden);
    let wv = uniform(&mut rng, l.v_rows() * hidden);
    let wo = uniform(&mut rng, n_out * l.o_inputs());
    // One softmax row over the t positions per query head.
    let p: Vec<Vec<f64>> = (0..heads)
        .map(|_| {
            let e: Vec<f64> = (0..t)
                .map(|_| rng.random_range(-3.0f64..3.0).exp())
                .collect();
            let z: f64 = e.iter().sum();
            e.iter().map(|v| v / z).collect()
        })
        .collect();
    // Everything after the weights in f64, so that the only roundings are those of the
    // scaled weights (f32, as the quantizer stores them before BF16/NVFP4).
    let forward = |wv: &[f32], wo: &[f32], abs: bool| -> Vec<f64> {
        let f = |v: f32| if abs { v.abs() as f64 } else { v as f64 };
        let v: Vec<f64> = (0..t * l.v_rows())
            .map(|i| {
                let (tau, r) = (i / l.v_rows(), i % l.v_rows());
                (0..hidden)
                    .map(|c| f(x[tau * hidden + c]) * f(wv[r * hidden + c]))
                    .sum()
            })
            .collect();
        let y: Vec<f64> = (0..l.o_inputs())
            .map(|j| {
                let h = j / hd;
                (0..t)
                    .map(|tau| p[h][tau] * v[tau * l.v_rows() + l.v_row(j)])
                    .sum()
            })
            .collect();
        (0..n_out)
            .map(|i| {
                (0..l.o_inputs())
                    .map(|j| f(wo[i * l.o_inputs() + j]) * y[j])
                    .sum()
            })
            .collect()
    };
    let want = forward(&wv, &wo, false);
    let mag = forward(&wv, &wo, true);
    let rms: Vec<f64> = (0..l.v_rows())
        .map(|_| 10f64.powf(rng.random_range(-2.0..2.0)))
        .collect();
    for alpha in [0.25, 0.5, 1.0] {
        let s_v = awq_scales(&rms, alpha).unwrap();
        let mut wv_s = wv.clone();
        divide_rows(&mut wv_s, hidden, &s_v).unwrap();
        let wo_s = scale_columns(&wo, l.o_inputs(), &l.expand(&s_v).unwrap());
        let got = forward(&wv_s, &wo_s, false);
        // Each path x·w_v·p·w_o has two factors rounded to f32 (w_v/s, w_o·s), relative
        // error ≤ u = 2⁻²⁴ each: |Δ| ≤ ((1 + u)² − 1)·Σ|x·w_v|·p·|w_o| (+ f64 noise).
        let u = (f32::EPSILON / 2.0) as f64;
        for i in 0..n_out {
            let bound = ((1.0 + u).powi(2) - 1.0) * mag[i] * 1.001 + 1e-12 * mag[i];
            let d = (got[i] - want[i]).abs();
            assert!(d <= bound, "α {alpha} out {i}: |Δ| {d} > {bound}");
        }
        // Control: the scales of the wrong KV head (query head h read as KV head h mod
        // kv_heads) break the fold by far more than the rounding bound.
        let wrong: Vec<f32> = (0..l.o_inputs())
            .map(|j| s_v[((j / hd) % kv) * hd + j % hd])
            .collect();
        let bad = forward(&wv_s, &scale_columns(&wo, l.o_inputs(), &wrong), false);
        let worst = (0..n_out)
            .map(|i| (bad[i] - want[i]).abs() / mag[i])
            .fold(0f64, f64::max);
        assert!(worst > 1e-3, "α {alpha}: the wrong sharing went unnoticed");
    }
}

fn awq_opts(ids: Vec<u32>, format: OutputFormat, sequential: bool, vo: bool) -> QuantizeOptions {
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
            awq_vo: vo,
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
    for vo in [false, true] {
        let q = tempfile::tempdir().unwrap();
        let s = quantize_model(
            src.path(),
            q.path(),
            &awq_opts(ids.clone(), OutputFormat::Nvfp4, true, vo),
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
            &awq_opts(ids.clone(), OutputFormat::Bf16, true, vo),
            &mut |_| {},
        )
        .unwrap();
        let diff = max_abs(&(&orig - &logits(r.path(), &ids[..40])).unwrap());
        // In exact arithmetic the folds leave the model unchanged; what remains are the
        // BF16 roundings of the rescaled tensors, each a relative error ≤ 2⁻⁸ per value
        // (8 significant bits).
        // Per layer every path through it meets five of them: input_layernorm, q/k/v,
        // post_attention_layernorm, gate/up (up's row and column scales are applied in
        // F32 and rounded once), down_proj; with the v → o fold a sixth, o_proj (v's
        // row and column scales rounded once, with q/k/v's). To first order the logits
        // move by at most (1 + 2⁻⁸)^(roundings·layers) − 1 relative, of the largest logit.
        let (layers, roundings) = (2, if vo { 6 } else { 5 });
        let bound = ((1.0 + 2f32.powi(-8)).powi(roundings * layers) - 1.0) * max_abs(&orig);
        eprintln!(
            "v → o fold {vo}: max |Δ logit| {diff:.3e}, bound {bound:.3e} (max |logit| {:.3})",
            max_abs(&orig)
        );
        assert!(
            diff > 0.0,
            "the scaled model is bit-identical: AWQ did nothing"
        );
        assert!(
            diff <= bound,
            "v → o fold {vo}: max |Δ logit| {diff} > {bound}"
        );
    }
}

/// The logits of the model in `dir` over `ids`.
fn logits(dir: &std::path::Path, ids: &[u32]) -> Tensor {
    let mut m = Llama::load(dir, &Device::Cpu, &LoadOptions::default()).unwrap();
    m.forward_all(ids, 0).unwrap()
}

/// A BF16/F32 tensor of a safetensors file as F32 rows.
fn rows(st: &SafeTensors<'_>, name: &str) -> Vec<Vec<f32>> {
    let t = st.tensor(name).unwrap();
    let t = Tensor::from_raw_buffer(t.data(), candle_core::DType::BF16, t.shape(), &Device::Cpu)
        .unwrap();
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .to_vec2()
        .unwrap()
}

#[test]
fn tiny_model_v_rows_carry_the_inverse_of_o_proj_scales() {
    // The unquantized equivalent of the tiny model (3 query heads, 1 KV head of 64): per
    // layer, o_proj's column j is W_o[:, j]·s_o[j], q_proj's column c is W_q[:, c]·s[c] and
    // v_proj's entry (r, c) is W_v[r, c]·s[c]/s_v[r], each rounded once to BF16 (8
    // significant bits: relative error ≤ u = 2⁻⁸, plus two F32 roundings of 2⁻²⁴ before
    // it for v). The fold needs
    // s_o[j] = s_v[v_row(j)]: one scale per (KV head, d), the same for the 3 query heads.
    let src = bf16_dir();
    let mut rng = StdRng::seed_from_u64(8);
    let ids: Vec<u32> = (0..150).map(|_| rng.random_range(3..256)).collect();
    let r = tempfile::tempdir().unwrap();
    quantize_model(
        src.path(),
        r.path(),
        &awq_opts(ids, OutputFormat::Bf16, true, true),
        &mut |_| {},
    )
    .unwrap();
    let (a, b) = (
        std::fs::read(src.path().join("model.safetensors")).unwrap(),
        std::fs::read(r.path().join("model.safetensors")).unwrap(),
    );
    let (a, b) = (
        SafeTensors::deserialize(&a).unwrap(),
        SafeTensors::deserialize(&b).unwrap(),
    );
    let l = GqaLayout::new(3, 1, 64).unwrap();
    let u = 2f64.powi(-8) + 2f64.powi(-23);
    // Ratios within one rounding of each other: (1 + u)/(1 − u).
    let one = (1.0 + u) / (1.0 - u);
    let mut spread = 1f64;
    for layer in 0..2 {
        let name = |m: &str| format!("model.layers.{layer}.self_attn.{m}_proj.weight");
        let ratio = |m: &str| -> Vec<Vec<f64>> {
            let (x, y) = (rows(&a, &name(m)), rows(&b, &name(m)));
            x.iter()
                .zip(&y)
                .map(|(x, y)| {
                    x.iter()
                        .zip(y)
                        .map(|(x, y)| *y as f64 / *x as f64)
                        .collect()
                })
                .collect()
        };
        // Column scales, read off row 0 and checked on every row (zeros skipped).
        let col_scales = |rt: &[Vec<f64>]| -> Vec<f64> {
            let s: Vec<f64> = (0..rt[0].len())
                .map(|c| rt.iter().map(|r| r[c]).find(|v| v.is_finite()).unwrap())
                .collect();
            for row in rt {
                for (c, v) in row.iter().enumerate().filter(|(_, v)| v.is_finite()) {
                    assert!(
                        v / s[c] <= one && s[c] / v <= one,
                        "layer {layer} column {c}: {v} vs {}",
                        s[c]
                    );
                }
            }
            s
        };
        let s_o = col_scales(&ratio("o"));
        let s_in = col_scales(&ratio("q"));
        // Shared over the group: channels (h, d) of the three query heads agree.
        for j in 0..l.o_inputs() {
            let j0 = l.v_row(j);
            assert!(
                s_o[j] / s_o[j0] <= one && s_o[j0] / s_o[j] <= one,
                "layer {layer}: o_proj channel {j} has its own scale"
            );
        }
        let hi = s_o.iter().fold(0f64, |m, v| m.max(*v));
        let lo = s_o.iter().fold(f64::INFINITY, |m, v| m.min(*v));
        spread = spread.max(hi / lo);
        // v_proj's rows carry 1/s_o: W_v'·s_o/s_in = W_v within the three roundings.
        let rv = ratio("v");
        for (row, rr) in rv.iter().enumerate() {
            for (c, v) in rr.iter().enumerate().filter(|(_, v)| v.is_finite()) {
                let f = v * s_o[row] / s_in[c];
                assert!(
                    f <= one * one && 1.0 / f <= one * one,
                    "layer {layer} v_proj ({row}, {c}): {f}"
                );
            }
        }
    }
    // AWQ chose α > 0 for o_proj somewhere, or this test checks nothing.
    assert!(spread > 1.1, "o_proj unscaled in every layer ({spread})");
}

#[test]
fn bad_awq_inputs_are_errors() {
    let src = bf16_dir();
    let ids: Vec<u32> = (3..203).collect();
    let out = tempfile::tempdir().unwrap();
    let e = quantize_model(
        src.path(),
        out.path(),
        &awq_opts(ids.clone(), OutputFormat::Nvfp4, false, false),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("sequential"), "{e:#}");
    // The v → o fold without AWQ.
    let mut o = awq_opts(ids, OutputFormat::Nvfp4, true, true);
    if let QuantMethod::Gptq { awq, .. } = &mut o.method {
        *awq = false;
    }
    let e = quantize_model(src.path(), out.path(), &o, &mut |_| {}).unwrap_err();
    assert!(format!("{e:#}").contains("--awq"), "{e:#}");
    assert!(awq_scales(&[1.0, 2.0], -0.5).is_err());
    assert!(awq_scales(&[1.0, f64::NAN], 0.5).is_err());
    assert!(awq_scales(&[1.0, -2.0], 0.5).is_err());
    // All-dead channels: no scaling.
    assert_eq!(awq_scales(&[0.0, 0.0], 0.5).unwrap(), vec![1.0, 1.0]);
    let w = vec![0.1f32; 32];
    assert!(rtn_loss(&[(w.clone(), 1, 32)], &[1.0; 16], &[1.0; 256]).is_err());
    assert!(rtn_loss(&[(w, 1, 32)], &[1.0; 32], &[1.0; 16]).is_err());
    // GQA layouts: query heads not a multiple of the KV heads, zero sizes.
    assert!(GqaLayout::new(9, 2, 64).is_err());
    assert!(GqaLayout::new(0, 1, 64).is_err());
    assert!(GqaLayout::new(4, 0, 64).is_err());
    assert!(GqaLayout::new(4, 2, 0).is_err());
    let l = GqaLayout::new(4, 2, 16).unwrap();
    assert!(l.pooled_rms(&[1.0; 32]).is_err());
    assert!(l.pooled_rms(&[f64::NAN; 64]).is_err());
    assert!(l.pooled_rms(&[-1.0; 64]).is_err());
    assert!(l.expand(&[1.0; 64]).is_err());
    // o_proj and Hessian not of the layout's width.
    let h = Hessian::from_matrix(32, vec![0.0; 32 * 32]).unwrap();
    assert!(search_o_scales(&(vec![0.1; 32], 1, 32), &h, l, &[0.5]).is_err());
    let h = Hessian::from_matrix(64, vec![0.0; 64 * 64]).unwrap();
    assert!(search_o_scales(&(vec![0.1; 32], 1, 32), &h, l, &[0.5]).is_err());
    assert!(search_o_scales(&(vec![0.1; 64], 1, 64), &h, l, &[]).is_err());
    // Row scales not matching the weight.
    let mut w = vec![1.0f32; 32];
    assert!(divide_rows(&mut w, 16, &[1.0; 3]).is_err());
    assert!(divide_rows(&mut w, 0, &[]).is_err());
}
