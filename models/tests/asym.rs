//! Asymmetric calibration (GPTAQ; `candle_fp4_models::gptq::asym_target`,
//! `quantize --method gptq --asym`): the plain GPTQ bytes when the float and quantized
//! inputs coincide, a lower asymmetric output error than plain GPTQ when they differ by a
//! margin the setup guarantees, the ridge normal equations solved to f64 accuracy, errors
//! for bad inputs, and a tiny-model run that loads.

use candle_core::{Device, Tensor};
use candle_fp4::nvfp4::Nvfp4Quantized;
use candle_fp4_models::gptq::{
    asym_target, dampened_hessian, gptq_quantize_group, CrossMoment, GptqParams, Hessian,
};
use candle_fp4_models::quantize::{
    quantize_model, CalibData, OutputFormat, QuantMethod, QuantizeOptions,
};
use candle_fp4_models::{Llama, LoadOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::SafeTensors;

mod common;
use common::{ar1_inputs, bf16_dir, normal, weights};

fn t(x: &[f32], rows: usize, k: usize) -> Tensor {
    Tensor::from_slice(x, (rows, k), &Device::Cpu).unwrap()
}

fn moments(x_f: &[f32], x_q: &[f32], rows: usize, k: usize) -> (Hessian, CrossMoment) {
    let mut h = Hessian::new(k);
    h.add(&t(x_q, rows, k)).unwrap();
    let mut c = CrossMoment::new(k);
    c.add(&t(x_f, rows, k), &t(x_q, rows, k)).unwrap();
    (h, c)
}

/// `‖A X_aᵀ − B X_bᵀ‖² / rows` for weights `a`, `b` `[n, k]` (f64) and inputs `[rows, k]`.
fn out_diff(a: &[f64], x_a: &[f32], b: &[f64], x_b: &[f32], n: usize, k: usize) -> f64 {
    let rows = x_a.len() / k;
    let mut s = 0.0;
    for r in 0..rows {
        let (xa, xb) = (&x_a[r * k..(r + 1) * k], &x_b[r * k..(r + 1) * k]);
        for i in 0..n {
            let (wa, wb) = (&a[i * k..(i + 1) * k], &b[i * k..(i + 1) * k]);
            let y: f64 = (0..k)
                .map(|j| wa[j] * xa[j] as f64 - wb[j] * xb[j] as f64)
                .sum();
            s += y * y;
        }
    }
    s / rows as f64
}

fn f64s(w: &[f32]) -> Vec<f64> {
    w.iter().map(|v| *v as f64).collect()
}

fn deq(q: &Nvfp4Quantized) -> Vec<f64> {
    f64s(&q.dequantize())
}

fn params(damp: f64, scale_search: u8, act_order: bool) -> GptqParams {
    GptqParams {
        damp,
        scale_search,
        act_order,
    }
}

#[test]
fn same_float_and_quantized_inputs_give_plain_gptq_bytes() {
    // X_f = X_q: C = H bit for bit (the same products), so W_t = W + W·0·M⁻¹ = W exactly,
    // and GPTQ on W_t is GPTQ on W, for any dampening, scale search and act-order, for a
    // group sharing one global scale too.
    for (seed, k) in [(11u64, 48usize), (12, 80)] {
        let mut rng = StdRng::seed_from_u64(seed);
        let a = weights(&mut rng, 7, k);
        let b: Vec<f32> = weights(&mut rng, 5, k).iter().map(|v| v * 3.0).collect();
        let rows = 512;
        let x = ar1_inputs(&mut rng, rows, k, 0.9);
        let (h, c) = moments(&x, &x, rows, k);
        assert_eq!(h.matrix().unwrap(), c.matrix().unwrap());
        let ws = vec![(a.clone(), 7, k), (b.clone(), 5, k)];
        for p in [
            params(0.01, 0, false),
            params(0.1, 3, false),
            params(0.0, 0, false),
            params(0.1, 3, true),
        ] {
            let tg = asym_target(&ws, &h, &c, p.damp, None).unwrap();
            let wt: Vec<(Vec<f32>, usize, usize)> = tg
                .iter()
                .zip(&ws)
                .map(|(t, (_, n, _))| (t.iter().map(|v| *v as f32).collect(), *n, k))
                .collect();
            assert_eq!(wt, ws, "K={k} {p:?}: W_t ≠ W");
            let plain = gptq_quantize_group(&ws, &h, None, &p).unwrap();
            let asym = gptq_quantize_group(&wt, &h, None, &p).unwrap();
            assert_eq!(plain, asym, "K={k} {p:?}");
        }
    }
}

/// The drifted-input setup: `X_f` AR(1) (ρ = 0.9), `X_q = X_f (I + E) + σ Z` with a
/// structured drift `E` (per-channel gains of ±10 % and a rank-2 mixing of 5 %, what
/// upstream quantization errors look like: systematic, correlated with the signal) and a
/// small independent part `σ = 0.05` that no weight can undo.
fn drifted(rng: &mut StdRng, rows: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
    let x_f = ar1_inputs(rng, rows, k, 0.9);
    let gain: Vec<f64> = (0..k).map(|_| 0.1 * normal(rng)).collect();
    let u: Vec<[f64; 2]> = (0..k).map(|_| [normal(rng), normal(rng)]).collect();
    let v: Vec<[f64; 2]> = (0..k).map(|_| [normal(rng), normal(rng)]).collect();
    let s = 0.05 / k as f64;
    let mut x_q = vec![0f32; rows * k];
    for r in 0..rows {
        let xr = &x_f[r * k..(r + 1) * k];
        // (x E)_j = x_j g_j + s Σ_i x_i (u_i · v_j)
        let p: [f64; 2] = [0, 1].map(|m| xr.iter().zip(&u).map(|(x, ui)| *x as f64 * ui[m]).sum());
        for j in 0..k {
            let d = xr[j] as f64 * gain[j] + s * (p[0] * v[j][0] + p[1] * v[j][1]);
            x_q[r * k + j] = (xr[j] as f64 + d + 0.05 * normal(rng)) as f32;
        }
    }
    (x_f, x_q)
}

#[test]
fn asym_beats_plain_gptq_by_the_drift_it_undoes() {
    // Without dampening the asymmetric loss splits exactly:
    //   L(Ŵ) = ‖W X_f − Ŵ X_q‖²/n = L_min + ‖(W_t − Ŵ) X_q‖²/n,   W_t = W C H⁻¹,
    // (W_t is the least-squares map of W X_f onto X_q; the cross term vanishes by the
    // normal equations). Asymmetric GPTQ rounds W_t: L_a = L_min + Q_a with Q_a its own
    // GPTQ loss. Plain GPTQ rounds W: L_p = L_min + ‖(W_t − W)X_q + (W − Ŵ_p)X_q‖²/n
    //   ≥ L_min + (√G − √Q_p)²  (triangle inequality),
    // G = ‖(W_t − W) X_q‖²/n the drift W_t undoes, Q_p plain GPTQ's own loss. So
    //   L_p − L_a ≥ (√G − √Q_p)² − Q_a,
    // a guaranteed margin once G exceeds the rounding losses (here G ≈ 9·Q_p, Q_a ≈ Q_p:
    // the same rounding of similar weights, so the bound is ≈ ((1 − 1/3)² − 1/9)·G =
    // G/3). Expected: plain GPTQ's rounding error is about orthogonal to the drift
    // `(W_t − W)X_q` (it is driven by the rounding grid, not by the drift), so
    // L_p − L_a ≈ G + Q_p − Q_a ≈ G. Asserted: the split holds to f64 accuracy, the margin
    // is at least the (positive) triangle bound, and at least G/2.
    for (seed, k) in [(21u64, 48usize), (22, 96)] {
        let (n, rows) = (16, 4096);
        let mut rng = StdRng::seed_from_u64(seed);
        let w = weights(&mut rng, n, k);
        let (x_f, x_q) = drifted(&mut rng, rows, k);
        let (h, c) = moments(&x_f, &x_q, rows, k);
        let ws = vec![(w.clone(), n, k)];
        let p = params(0.0, 3, false);
        let wt = asym_target(&ws, &h, &c, 0.0, None).unwrap().remove(0);
        let wt32: Vec<f32> = wt.iter().map(|v| *v as f32).collect();
        let qp = gptq_quantize_group(&ws, &h, None, &p).unwrap().remove(0);
        let qa = gptq_quantize_group(&[(wt32, n, k)], &h, None, &p)
            .unwrap()
            .remove(0);
        let w64 = f64s(&w);
        let (dp, da) = (deq(&qp), deq(&qa));
        let l_p = out_diff(&w64, &x_f, &dp, &x_q, n, k);
        let l_a = out_diff(&w64, &x_f, &da, &x_q, n, k);
        let l_min = out_diff(&w64, &x_f, &wt, &x_q, n, k);
        let g = out_diff(&wt, &x_q, &w64, &x_q, n, k);
        let q_p = out_diff(&w64, &x_q, &dp, &x_q, n, k);
        let q_a = out_diff(&wt, &x_q, &da, &x_q, n, k);
        // The split, for both: L(Ŵ) − L_min = ‖(W_t − Ŵ)X_q‖²/n.
        for (l, dq) in [(l_p, &dp), (l_a, &da)] {
            let rest = out_diff(&wt, &x_q, dq, &x_q, n, k);
            assert!(
                (l - l_min - rest).abs() <= 1e-9 * l,
                "K={k}: split {l} vs {l_min} + {rest}"
            );
        }
        let bound = (g.sqrt() - q_p.sqrt()).powi(2) - q_a;
        println!(
            "K={k}: L_plain {l_p:.5e} L_asym {l_a:.5e} L_min {l_min:.5e} G {g:.5e} Q_p {q_p:.5e} Q_a {q_a:.5e} margin {:.5e} bound {bound:.5e}",
            l_p - l_a
        );
        assert!(
            l_p - l_a >= bound * (1.0 - 1e-9),
            "K={k}: margin below its bound"
        );
        assert!(bound > 0.25 * g, "K={k}: the setup should make G dominate");
        assert!(
            l_p - l_a >= 0.5 * g,
            "K={k}: margin {} below G/2",
            l_p - l_a
        );
        // With GPTQ's dampening (the ridge pull towards W), still better by most of G.
        for damp in [0.01, 0.1] {
            let p = params(damp, 3, false);
            let wt = asym_target(&ws, &h, &c, damp, None).unwrap().remove(0);
            let wt32: Vec<f32> = wt.iter().map(|v| *v as f32).collect();
            let qp = gptq_quantize_group(&ws, &h, None, &p).unwrap().remove(0);
            let qa = gptq_quantize_group(&[(wt32, n, k)], &h, None, &p)
                .unwrap()
                .remove(0);
            let l_p = out_diff(&w64, &x_f, &deq(&qp), &x_q, n, k);
            let l_a = out_diff(&w64, &x_f, &deq(&qa), &x_q, n, k);
            println!("K={k} damp={damp}: L_plain {l_p:.5e} L_asym {l_a:.5e}");
            assert!(l_p - l_a >= 0.5 * g, "K={k} damp={damp}");
        }
    }
}

#[test]
fn target_solves_the_ridge_normal_equations() {
    // W_t M = W (C + Λ), M = H + Λ the dampened Hessian (Λ = M − H). W_t = W + T with
    // T = ((W (C − H)) Uᵀ) U in f64; a Cholesky-based solve has a residual of the order
    // of K·ε₆₄·κ(M) times the size of the terms, κ(M) ≤ tr(M)/λ (H is PSD, so every
    // eigenvalue of M is ≥ λ). Asserted per element: |W_t M − W(C + Λ)| ≤
    // 4·K·ε₆₄·κ·(|W_t||M| + |W||C + Λ|): with the κ here (≤ 6.5·10⁴) at least 16 times
    // below f32's rounding of the terms (2⁻²⁴); measured 10⁻⁷–10⁻⁵ of the bound (the
    // residual is ε₆₄-sized).
    for (seed, k, damp) in [(31u64, 48usize, 0.01), (32, 96, 0.1), (33, 64, 1e-3)] {
        let n = 9;
        let mut rng = StdRng::seed_from_u64(seed);
        let w = weights(&mut rng, n, k);
        let (x_f, x_q) = drifted(&mut rng, 1024, k);
        let (h, c) = moments(&x_f, &x_q, 1024, k);
        let wt = asym_target(&[(w.clone(), n, k)], &h, &c, damp, None)
            .unwrap()
            .remove(0);
        let m = dampened_hessian(&h, damp).unwrap();
        let hm = h.matrix().unwrap();
        let cm = c.matrix().unwrap();
        let tr: f64 = (0..k).map(|i| m[i * k + i]).sum();
        let lambda = (0..k)
            .map(|i| m[i * k + i] - hm[i * k + i])
            .fold(f64::INFINITY, f64::min);
        assert!(lambda > 0.0);
        let kappa = tr / lambda;
        let eps = f64::EPSILON;
        let mut worst = 0f64;
        for r in 0..n {
            for col in 0..k {
                let (mut lhs, mut rhs, mut mag) = (0.0, 0.0, 0.0);
                for j in 0..k {
                    let wr = w[r * k + j] as f64;
                    let rj = cm[j * k + col] + m[j * k + col] - hm[j * k + col];
                    lhs += wt[r * k + j] * m[j * k + col];
                    rhs += wr * rj;
                    mag += (wt[r * k + j] * m[j * k + col]).abs() + (wr * rj).abs();
                }
                let bound = 4.0 * k as f64 * eps * kappa * mag;
                worst = worst.max((lhs - rhs).abs() / bound);
                assert!(
                    (lhs - rhs).abs() <= bound,
                    "K={k} ({r},{col}): {lhs} vs {rhs}, bound {bound}"
                );
            }
        }
        println!("K={k} damp={damp}: κ ≤ {kappa:.1}, worst residual / bound {worst:.2e}");
    }
}

#[test]
fn bad_asym_inputs_are_errors() {
    let k = 32;
    let mut rng = StdRng::seed_from_u64(41);
    let w = weights(&mut rng, 4, k);
    let x = ar1_inputs(&mut rng, 64, k, 0.5);
    let err = |r: anyhow::Result<Vec<Vec<f64>>>| format!("{:#}", r.unwrap_err());
    // Shape mismatches when accumulating.
    let mut c = CrossMoment::new(k);
    assert!(c.add(&t(&x, 64, k), &t(&x[..32 * k], 32, k)).is_err());
    assert!(c.add(&t(&x, 64, k), &t(&x, 128, 16)).is_err());
    assert!(c.add(&t(&x, 128, 16), &t(&x, 128, 16)).is_err());
    assert!(c.scaled(&[1.0; 31], &[1.0; 32]).is_err());
    assert!(c.scaled(&[1.0; 32], &[1.0; 33]).is_err());
    assert!(CrossMoment::from_matrix(k, vec![0.0; 10]).is_err());
    let (h, c) = moments(&x, &x, 64, k);
    let ws = vec![(w.clone(), 4, k)];
    // No float activations accumulated.
    let e = err(asym_target(&ws, &h, &CrossMoment::new(k), 0.01, None));
    assert!(e.contains("samples") || e.contains("no calibration"), "{e}");
    // Moments from different token counts.
    let mut c2 = c.clone();
    c2.add(&t(&x[..8 * k], 8, k), &t(&x[..8 * k], 8, k))
        .unwrap();
    assert!(err(asym_target(&ws, &h, &c2, 0.01, None)).contains("same tokens"));
    // Cross moment of another width.
    let (_, c16) = moments(&x, &x, 128, 16);
    assert!(err(asym_target(&ws, &h, &c16, 0.01, None)).contains("K = 16"));
    // Weight of another width, non-finite weights, bad dampening, non-finite moments.
    assert!(err(asym_target(&[(w.clone(), 8, 16)], &h, &c, 0.01, None)).contains("K = 32"));
    let mut bad = w.clone();
    bad[2] = f32::INFINITY;
    assert!(err(asym_target(&[(bad, 4, k)], &h, &c, 0.01, None)).contains("non-finite"));
    assert!(err(asym_target(&ws, &h, &c, -0.1, None)).contains("dampening"));
    assert!(err(asym_target(&ws, &h, &c, f64::NAN, None)).contains("dampening"));
    let nan = CrossMoment::from_matrix(k, vec![f64::NAN; k * k]).unwrap();
    let h1 = Hessian::from_matrix(k, h.matrix().unwrap()).unwrap();
    assert!(err(asym_target(&ws, &h1, &nan, 0.01, None)).contains("non-finite"));
    assert!(dampened_hessian(&h, -1.0).is_err());
    // Ridge values: one per input, finite and ≥ 0.
    assert!(err(asym_target(&ws, &h, &c, 0.0, Some(&[0.1; 31]))).contains("ridge"));
    let mut r = vec![0.1; k];
    r[3] = -1.0;
    assert!(err(asym_target(&ws, &h, &c, 0.0, Some(&r))).contains("ridge"));
    assert!(asym_target(&ws, &h, &c, 0.0, Some(&[0.1; 32])).is_ok());
    // Options: asym needs sequential calibration and the NVFP4 output.
    let src = bf16_dir();
    let run = |o: &QuantizeOptions| {
        let out = tempfile::tempdir().unwrap();
        format!(
            "{:#}",
            quantize_model(src.path(), out.path(), o, &mut |_| {}).unwrap_err()
        )
    };
    let ids: Vec<u32> = (3..203).collect();
    let e = run(&asym_opts(ids.clone(), false, false));
    assert!(e.contains("--asym") && e.contains("sequential"), "{e}");
    let mut o = asym_opts(ids, true, true);
    o.format = OutputFormat::Bf16;
    assert!(run(&o).contains("--asym"), "{}", run(&o));
    // The binary: --asym needs --method gptq.
    let out = tempfile::tempdir().unwrap();
    let r = std::process::Command::new(env!("CARGO_BIN_EXE_quantize"))
        .arg(src.path())
        .arg(out.path().join("q"))
        .arg("--asym")
        .output()
        .unwrap();
    assert!(!r.status.success());
    let e = String::from_utf8_lossy(&r.stderr);
    assert!(e.contains("--asym needs --method gptq"), "{e}");
}

fn asym_opts(ids: Vec<u32>, sequential: bool, awq: bool) -> QuantizeOptions {
    QuantizeOptions {
        format: OutputFormat::Nvfp4,
        exclude: vec![],
        method: QuantMethod::Gptq {
            calib: CalibData::TokenIds(ids),
            calib_tokens: 150,
            window: 64,
            sequential,
            params: GptqParams::default(),
            awq,
            awq_vo: false,
            asym: true,
            norm_tweak: None,
        },
    }
}

#[test]
fn tiny_model_asym_checkpoint_loads() {
    // The tiny ModelOpt fixture end to end with --asym (with and without AWQ): the same
    // tensors, dtypes and shapes as the plain GPTQ checkpoint of the same options, other
    // NVFP4 codes (the first block's q/k/v see the same inputs in both models, later
    // groups do not), and a model that loads and gives finite logits.
    let src = bf16_dir();
    let mut rng = StdRng::seed_from_u64(8);
    let ids: Vec<u32> = (0..150).map(|_| rng.random_range(3..256)).collect();
    for awq in [false, true] {
        let plain_dir = tempfile::tempdir().unwrap();
        let mut plain = asym_opts(ids.clone(), true, awq);
        if let QuantMethod::Gptq { asym, .. } = &mut plain.method {
            *asym = false;
        }
        quantize_model(src.path(), plain_dir.path(), &plain, &mut |_| {}).unwrap();
        let out = tempfile::tempdir().unwrap();
        let s = quantize_model(
            src.path(),
            out.path(),
            &asym_opts(ids.clone(), true, awq),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!((s.quantized, s.kept), (14, 7));
        let pb = std::fs::read(plain_dir.path().join("model.safetensors")).unwrap();
        let ab = std::fs::read(out.path().join("model.safetensors")).unwrap();
        let (ps, st) = (
            SafeTensors::deserialize(&pb).unwrap(),
            SafeTensors::deserialize(&ab).unwrap(),
        );
        let mut names: Vec<&str> = st.names().into_iter().collect();
        let mut want: Vec<&str> = ps.names().into_iter().collect();
        names.sort();
        want.sort();
        assert_eq!(names, want);
        let mut differ = 0;
        for n in &want {
            let (a, b) = (ps.tensor(n).unwrap(), st.tensor(n).unwrap());
            assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{n}");
            if a.data() != b.data() {
                differ += 1;
                // AWQ's scales (so the norms) depend on the quantized model's inputs,
                // which asymmetric calibration changes; but for layer 0's q/k/v.
                let may = !n.contains("norm") || (awq && !n.contains("layers.0.input_layernorm"));
                assert!(may && !n.contains("embed"), "{n} changed");
            }
        }
        // Layer 0's q/k/v: the float and the quantized model feed them the same inputs,
        // so they are plain GPTQ's bytes.
        for p in ["q_proj", "k_proj", "v_proj"] {
            let n = format!("model.layers.0.self_attn.{p}.weight");
            assert!(
                ps.tensor(&n).unwrap().data() == st.tensor(&n).unwrap().data(),
                "{n}"
            );
        }
        assert!(
            differ > 0,
            "asymmetric calibration changed nothing (awq {awq})"
        );
        for f in ["config.json", "hf_quant_config.json"] {
            assert_eq!(
                std::fs::read(out.path().join(f)).unwrap(),
                std::fs::read(plain_dir.path().join(f)).unwrap(),
                "{f}"
            );
        }
        let mut m = Llama::load(out.path(), &Device::Cpu, &LoadOptions::default()).unwrap();
        assert_eq!(m.nvfp4_layer_count(), (8, 9));
        let logits = m.forward(&ids[..20], 0).unwrap();
        let v = logits.to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|x| x.is_finite()));
    }
}
