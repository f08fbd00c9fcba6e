//! QuantLinear: forward numerics on both paths, dispatch, bias, BF16 layers, the fused
//! silu·mul, checkpoint loading errors, and quant-config parsing.
//!
//! Tolerance of a forward output against an FP32 matmul of `x` with `dequantize()`:
//! `r · 2⁻⁸ · (|ref| + e) + e` with `e = (2K + 4) · 2⁻²⁴ · Σ|x·w|` (FP32 summation-order
//! differences on both sides, plus the last-bit difference between ModelOpt's
//! dequantization order and the kernels' `(x·e2m1·e4m3)·gs`), and `r` the number of BF16
//! roundings on the path: 1 for the GEMV (and for BF16 weights), 2 for the NVFP4 matmul
//! path (BF16 product, then × global scale, rounded again), plus 1 for a bias add.

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_fp4::checkpoint::Checkpoint;
use candle_fp4::gemv::nvfp4_gemv;
use candle_fp4::nvfp4::{
    dequantize_rows, quantize_nvfp4_slice, swizzle_blockscale, Nvfp4Quantized,
};
use candle_fp4::quant_config::{QuantAlgo, QuantConfig};
use candle_fp4::quant_linear::{use_gemv, QuantLinear};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::{Dtype, TensorView};

const U: f32 = 1.0 / 256.0; // BF16 unit roundoff 2^-8
const F32_U: f32 = 1.0 / 16_777_216.0; // 2^-24

/// Random weights: uniform, each 16-block scaled by 2^[-3, 2], a few all-zero blocks.
fn rand_weights(rng: &mut StdRng, n: usize, k: usize) -> Vec<f32> {
    let mut w = vec![0f32; n * k];
    for blk in w.chunks_mut(16) {
        if rng.random_range(0..40) == 0 {
            continue;
        }
        let s = 0.05 * 2f32.powf(rng.random_range(-3.0..2.0));
        for v in blk {
            *v = rng.random_range(-1.0f32..1.0) * s;
        }
    }
    w
}

fn quantized(seed: u64, n: usize, k: usize) -> Nvfp4Quantized {
    let mut rng = StdRng::seed_from_u64(seed);
    quantize_nvfp4_slice(&rand_weights(&mut rng, n, k), n, k, None).unwrap()
}

fn rand_x(seed: u64, shape: &[usize]) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let len = shape.iter().product::<usize>();
    let v: Vec<f32> = (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
}

fn rand_bias(seed: u64, n: usize) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-0.5f32..0.5)).collect();
    Tensor::from_vec(v, n, &Device::Cpu).unwrap()
}

/// FP32 reference for `x` `[..., K]`, all `[M, N]` row-major: `x·wᵀ (+ b)`, `Σ|x·w|`, and
/// the magnitude the BF16 roundings act on, `|x·wᵀ| (+ |b|)` (the bias add can cancel).
struct Ref {
    y: Vec<f32>,
    absdot: Vec<f32>,
    mag: Vec<f32>,
    k: usize,
}

impl Ref {
    fn tol(&self, r: f32, i: usize) -> f32 {
        tolerance(r, self.mag[i], self.absdot[i], self.k)
    }
}

fn reference(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Ref {
    let k = w.dim(1).unwrap();
    let xf = x.to_dtype(DType::F32).unwrap().reshape(((), k)).unwrap();
    let r0 = xf.matmul(&w.t().unwrap()).unwrap();
    let (mut r, mut mag) = (r0.clone(), r0.abs().unwrap());
    if let Some(b) = bias {
        let b = b
            .to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        r = r.broadcast_add(&b).unwrap();
        mag = mag.broadcast_add(&b.abs().unwrap()).unwrap();
    }
    let a = xf
        .abs()
        .unwrap()
        .matmul(&w.abs().unwrap().t().unwrap())
        .unwrap();
    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    Ref {
        y: flat(r),
        absdot: flat(a),
        mag: flat(mag),
        k,
    }
}

fn tolerance(r: f32, rf: f32, absdot: f32, k: usize) -> f32 {
    let e = (2 * k + 4) as f32 * F32_U * absdot;
    r * U * (rf.abs() + e) + e
}

/// Checks `y` (any shape ending in N) against the FP32 reference with `r` roundings.
fn check_close(y: &Tensor, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, r: f32, what: &str) {
    let rf = reference(x, w, bias);
    let yv = y
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(yv.len(), rf.y.len(), "{what}: output size");
    let mut worst = 0f32;
    for (i, (&a, &b)) in yv.iter().zip(&rf.y).enumerate() {
        let tol = rf.tol(r, i);
        assert!(
            (a - b).abs() <= tol,
            "{what}: output {i}: got {a}, reference {b}, |diff| {} > tol {tol}",
            (a - b).abs()
        );
        worst = worst.max((a - b).abs() / tol.max(f32::MIN_POSITIVE));
    }
    assert!(
        worst > 0.0 || rf.y.iter().all(|v| *v == 0.0),
        "{what}: suspiciously exact"
    );
}

fn bits(t: &Tensor) -> Vec<u16> {
    t.to_dtype(DType::BF16)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<bf16>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn use_gemv_dispatch() {
    // CPU: always for 1..=32 tokens with K % 64 == 0.
    for m in 1..=32 {
        assert!(use_gemv(true, None, m, 576), "cpu m = {m}");
    }
    assert!(!use_gemv(true, None, 0, 576));
    assert!(!use_gemv(true, None, 33, 576));
    assert!(!use_gemv(true, Some(4), 33, 576));
    assert!(!use_gemv(true, None, 1, 80), "K not a multiple of 64");
    assert!(!use_gemv(true, None, 1, 0));
    // GPU: only with a tuned tile.
    assert!(!use_gemv(false, None, 1, 4096));
    assert!(use_gemv(false, Some(1), 1, 4096));
    assert!(use_gemv(false, Some(4), 32, 4096));
    assert!(!use_gemv(false, Some(4), 33, 4096));
    assert!(!use_gemv(false, Some(1), 1, 4000));
}

#[test]
fn nvfp4_forward_matches_reference() -> Result<()> {
    // (N, K): square, awkward N, K not a multiple of 64 (always the matmul path).
    for (seed, (n, k)) in [(576, 576), (200, 192), (72, 80)].into_iter().enumerate() {
        let q = quantized(seed as u64, n, k);
        let layer = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?;
        assert!(layer.is_nvfp4());
        assert_eq!((layer.out_features(), layer.in_features()), (n, k));
        let w = layer.dequantize()?;
        for m in [1, 3, 32, 33, 70] {
            let x = rand_x(100 + m as u64, &[m, k]);
            let y = layer.forward(&x)?;
            assert_eq!(y.dims(), [m, n]);
            assert_eq!(y.dtype(), DType::BF16);
            let r = if use_gemv(true, None, m, k) { 1.0 } else { 2.0 };
            check_close(&y, &x, &w, None, r, &format!("N={n} K={k} M={m}"));
        }
    }
    Ok(())
}

#[test]
fn forward_takes_gemv_up_to_32_tokens_then_matmul() -> Result<()> {
    let (n, k) = (200, 192);
    let q = quantized(7, n, k);
    let layer = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?;
    let (codes, scales) = q.to_tensors(&Device::Cpu)?;
    let swz = swizzle_blockscale(&scales)?;
    for m in [1, 5, 32] {
        let x = rand_x(m as u64, &[m, k]);
        let want = nvfp4_gemv(&x, &codes, &swz, q.global_scale, false, false)?;
        assert_eq!(bits(&layer.forward(&x)?), bits(&want), "M = {m}");
    }
    for m in [33, 64] {
        let x = rand_x(m as u64, &[m, k]);
        let w = dequantize_rows(&codes, &swz)?;
        let want = x
            .matmul(&w.t()?)?
            .to_dtype(DType::F32)?
            .affine(q.global_scale as f64, 0.0)?
            .to_dtype(DType::BF16)?;
        assert_eq!(bits(&layer.forward(&x)?), bits(&want), "M = {m}");
    }
    Ok(())
}

#[test]
fn forward_3d_1d_and_non_contiguous_inputs() -> Result<()> {
    let (n, k) = (200, 192);
    let layer = QuantLinear::from_nvfp4(&quantized(3, n, k), None, &Device::Cpu)?;
    let w = layer.dequantize()?;
    for (b, s) in [(2, 3), (2, 20), (1, 1)] {
        let x = rand_x(b as u64 * 31 + s as u64, &[b, s, k]);
        let y = layer.forward(&x)?;
        assert_eq!(y.dims(), [b, s, n]);
        let r = if b * s <= 32 { 1.0 } else { 2.0 };
        check_close(&y, &x, &w, None, r, &format!("[{b}, {s}, {k}]"));
        // Each token's row equals the 2-d forward of the flattened input.
        let flat = layer.forward(&x.reshape((b * s, k))?)?;
        assert_eq!(bits(&y), bits(&flat));
    }
    let x1 = rand_x(9, &[k]);
    let y1 = layer.forward(&x1)?;
    assert_eq!(y1.dims(), [n]);
    assert_eq!(bits(&y1), bits(&layer.forward(&x1.unsqueeze(0)?)?));
    // Transposed (inner stride != 1) and narrowed (row stride > K) inputs.
    for m in [4, 40] {
        let xt = rand_x(50 + m as u64, &[k, m]).t()?;
        assert!(!xt.is_contiguous());
        assert_eq!(
            bits(&layer.forward(&xt)?),
            bits(&layer.forward(&xt.contiguous()?)?)
        );
        let wide = rand_x(60 + m as u64, &[m, k + 64]);
        let xn = wide.narrow(1, 32, k)?;
        assert!(!xn.is_contiguous());
        assert_eq!(
            bits(&layer.forward(&xn)?),
            bits(&layer.forward(&xn.contiguous()?)?)
        );
    }
    // F32 input: computed in BF16, returned as F32.
    let xf = rand_x(11, &[3, k]).to_dtype(DType::F32)?;
    let yf = layer.forward(&xf)?;
    assert_eq!(yf.dtype(), DType::F32);
    assert_eq!(bits(&yf), bits(&layer.forward(&xf.to_dtype(DType::BF16)?)?));
    // Wrong K is an error.
    assert!(layer.forward(&rand_x(1, &[2, k + 16])).is_err());
    Ok(())
}

#[test]
fn bias_is_added() -> Result<()> {
    let (n, k) = (200, 192);
    let q = quantized(5, n, k);
    let bias = rand_bias(6, n);
    let plain = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?;
    let layer = QuantLinear::from_nvfp4(&q, Some(bias.clone()), &Device::Cpu)?;
    assert_eq!(layer.bias().map(|b| b.dtype()), Some(DType::BF16));
    let w = layer.dequantize()?;
    for m in [1, 7, 33] {
        let x = rand_x(m as u64, &[m, k]);
        let y = layer.forward(&x)?;
        let r = if m <= 32 { 2.0 } else { 3.0 };
        check_close(&y, &x, &w, Some(&bias), r, &format!("bias M={m}"));
        let want = plain
            .forward(&x)?
            .broadcast_add(&bias.to_dtype(DType::BF16)?)?;
        assert_eq!(bits(&y), bits(&want));
    }
    assert!(QuantLinear::from_nvfp4(&q, Some(rand_bias(1, n + 1)), &Device::Cpu).is_err());
    Ok(())
}

#[test]
fn bf16_layers() -> Result<()> {
    let (n, k) = (200, 192);
    let mut rng = StdRng::seed_from_u64(21);
    let wv = rand_weights(&mut rng, n, k);
    let w = Tensor::from_vec(wv, (n, k), &Device::Cpu)?;
    let bias = rand_bias(22, n);
    for b in [None, Some(bias.clone())] {
        let layer = QuantLinear::from_bf16(w.clone(), b.clone())?;
        assert!(!layer.is_nvfp4());
        assert_eq!(layer.global_scale(), None);
        let wd = layer.dequantize()?;
        assert_eq!(wd.dtype(), DType::F32);
        // The stored weight is BF16-rounded.
        assert_eq!(bits(&wd), bits(&w));
        for m in [1, 5, 32, 33, 70] {
            let x = rand_x(m as u64, &[m, k]);
            let r = if b.is_some() { 2.0 } else { 1.0 };
            let what = format!("bf16 M={m} bias={}", b.is_some());
            check_close(&layer.forward(&x)?, &x, &wd, b.as_ref(), r, &what);
        }
    }
    assert!(QuantLinear::from_bf16(Tensor::zeros(5, DType::F32, &Device::Cpu)?, None).is_err());
    assert!(QuantLinear::from_bf16(Tensor::zeros((4, 4), DType::U8, &Device::Cpu)?, None).is_err());
    Ok(())
}

/// `silu(g)·u` from BF16 g, u in FP32, rounded once.
fn silu_mul_ref(y: &Tensor) -> Result<Tensor> {
    let h = y.dim(1)? / 2;
    let g = y.narrow(1, 0, h)?.to_dtype(DType::F32)?;
    let u = y.narrow(1, h, h)?.to_dtype(DType::F32)?;
    let s = (&g / (g.neg()?.exp()? + 1.0)?)?;
    (s * u)?.to_dtype(DType::BF16)
}

fn check_silu_mul(layer: &QuantLinear, bias: Option<&Tensor>, r: f32, what: &str) -> Result<()> {
    let (n2, k) = (layer.out_features(), layer.in_features());
    let h = n2 / 2;
    let w = layer.dequantize()?;
    for m in [1, 4, 32, 33, 40] {
        let x = rand_x(70 + m as u64, &[m, k]);
        let y = layer.forward_silu_mul(&x)?;
        assert_eq!(y.dims(), [m, h]);
        // On CPU the fused epilogue equals forward + the FP32 silu·mul bit for bit.
        assert_eq!(
            bits(&y),
            bits(&silu_mul_ref(&layer.forward(&x)?)?),
            "{what} M={m}"
        );
        // Against the FP32 reference: errors of g and u propagate through silu·mul.
        let rf = reference(&x, &w, bias);
        let yv = y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let rr = if m <= 32 { r } else { r + 1.0 };
        for t in 0..m {
            for j in 0..h {
                let (ig, iu) = (t * n2 + j, t * n2 + h + j);
                let (g, u) = (rf.y[ig], rf.y[iu]);
                let (tg, tu) = (rf.tol(rr, ig), rf.tol(rr, iu));
                let sg = g / (1.0 + (-g).exp());
                let want = sg * u;
                // |silu'| ≤ 1.1
                let tol = 1.1 * tg * (u.abs() + tu) + sg.abs() * tu + 1.01 * U * want.abs() + 1e-30;
                let got = yv[t * h + j];
                assert!(
                    (got - want).abs() <= tol,
                    "{what} M={m} ({t}, {j}): got {got}, reference {want}, tol {tol}"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn forward_silu_mul() -> Result<()> {
    let (h, k) = (160, 192);
    let q = quantized(31, 2 * h, k);
    check_silu_mul(
        &QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?,
        None,
        1.0,
        "nvfp4",
    )?;
    let bias = rand_bias(32, 2 * h);
    let with_bias = QuantLinear::from_nvfp4(&q, Some(bias.clone()), &Device::Cpu)?;
    check_silu_mul(&with_bias, Some(&bias), 2.0, "nvfp4+bias")?;
    let w = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?.dequantize()?;
    check_silu_mul(&QuantLinear::from_bf16(w, None)?, None, 1.0, "bf16")?;
    // 3-d input.
    let layer = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?;
    let x = rand_x(3, &[2, 3, k]);
    let y = layer.forward_silu_mul(&x)?;
    assert_eq!(y.dims(), [2, 3, h]);
    assert_eq!(bits(&y.i(1)?), bits(&layer.forward_silu_mul(&x.i(1)?)?));
    // Odd N.
    let odd = QuantLinear::from_nvfp4(&quantized(1, 3, 64), None, &Device::Cpu)?;
    assert!(odd.forward_silu_mul(&rand_x(1, &[1, 64])).is_err());
    Ok(())
}

#[test]
fn from_nvfp4_round_trips() -> Result<()> {
    let q = quantized(41, 200, 192);
    let layer = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?;
    assert_eq!(layer.global_scale(), Some(q.global_scale));
    assert_eq!(layer.to_nvfp4()?.as_ref(), Some(&q));
    let d = layer.dequantize()?.flatten_all()?.to_vec1::<f32>()?;
    let want = q.dequantize();
    assert!(d.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    for bad_gs in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let mut b = q.clone();
        b.global_scale = bad_gs;
        assert!(QuantLinear::from_nvfp4(&b, None, &Device::Cpu).is_err());
    }
    let mut short = q.clone();
    short.weight.pop();
    assert!(QuantLinear::from_nvfp4(&short, None, &Device::Cpu).is_err());
    Ok(())
}

// ---- checkpoints -------------------------------------------------------------------

type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

fn nvfp4_entries(prefix: &str, q: &Nvfp4Quantized) -> Vec<Entry> {
    vec![
        (
            format!("{prefix}.weight"),
            Dtype::U8,
            vec![q.n, q.k / 2],
            q.weight.clone(),
        ),
        (
            format!("{prefix}.weight_scale"),
            Dtype::F8_E4M3,
            vec![q.n, q.k / 16],
            q.weight_scale.clone(),
        ),
        (
            format!("{prefix}.weight_scale_2"),
            Dtype::F32,
            vec![],
            q.global_scale.to_le_bytes().to_vec(),
        ),
        (
            format!("{prefix}.input_scale"),
            Dtype::F32,
            vec![],
            0.01f32.to_le_bytes().to_vec(),
        ),
    ]
}

fn set(entries: &mut Vec<Entry>, name: &str, dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) {
    entries.retain(|e| e.0 != name);
    entries.push((name.to_string(), dtype, shape, data));
}

fn checkpoint(entries: &[Entry]) -> Checkpoint {
    let views: Vec<(String, TensorView<'_>)> = entries
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    Checkpoint::from_buffer(bytes, "test.safetensors").unwrap()
}

fn nvfp4_cfg() -> QuantConfig {
    QuantConfig {
        quant_algo: QuantAlgo::Nvfp4,
        group_size: 16,
        exclude: vec!["lm_head".into(), "model.layers.*.mlp.gate".into()],
        kv_cache_quant_algo: None,
        producer: None,
    }
}

#[track_caller]
fn assert_err<T: std::fmt::Debug>(r: Result<T>, needles: &[&str]) {
    match r {
        Ok(v) => panic!("expected an error mentioning {needles:?}, got Ok({v:?})"),
        Err(e) => {
            let msg = e.to_string();
            for n in needles {
                assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
            }
        }
    }
}

const P: &str = "model.layers.0.self_attn.q_proj";

#[test]
fn load_nvfp4_layer_from_checkpoint() -> Result<()> {
    let q = quantized(51, 200, 192);
    let want = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?.dequantize()?;
    let want = bits(&want.to_dtype(DType::F32)?);
    let cfg = nvfp4_cfg();
    // As exported: F8_E4M3 scales, 0-d global scale, input_scale present (ignored).
    let mut e = nvfp4_entries(P, &q);
    let l = QuantLinear::load(&checkpoint(&e), P, &Device::Cpu, &cfg)?;
    assert!(l.is_nvfp4() && l.bias().is_none());
    assert_eq!(l.to_nvfp4()?.as_ref(), Some(&q));
    assert_eq!(bits(&l.dequantize()?), want);
    // U8 scales, [1] global scale, no input_scale, a bias.
    let gs = q.global_scale.to_le_bytes().to_vec();
    set(
        &mut e,
        &format!("{P}.weight_scale"),
        Dtype::U8,
        vec![200, 12],
        q.weight_scale.clone(),
    );
    set(
        &mut e,
        &format!("{P}.weight_scale_2"),
        Dtype::F32,
        vec![1],
        gs,
    );
    e.retain(|x| !x.0.ends_with("input_scale"));
    let b: Vec<u8> = (0..200)
        .flat_map(|i| bf16::from_f32(i as f32 / 64.0).to_le_bytes())
        .collect();
    set(&mut e, &format!("{P}.bias"), Dtype::BF16, vec![200], b);
    let l = QuantLinear::load(&checkpoint(&e), P, &Device::Cpu, &cfg)?;
    assert_eq!(l.to_nvfp4()?.as_ref(), Some(&q));
    let bias = l.bias().map(|b| b.to_dtype(DType::F32)?.to_vec1::<f32>());
    assert_eq!(bias.transpose()?.map(|v| v[64]), Some(1.0));
    // W4A16 loads the same way.
    let w4a16 = QuantConfig {
        quant_algo: QuantAlgo::W4A16Nvfp4,
        ..cfg
    };
    let l = QuantLinear::load(&checkpoint(&e), P, &Device::Cpu, &w4a16)?;
    assert_eq!(l.to_nvfp4()?.as_ref(), Some(&q));
    Ok(())
}

#[test]
fn load_bf16_layers() -> Result<()> {
    let w: Vec<u8> = (0..64 * 32)
        .flat_map(|i| bf16::from_f32((i % 7) as f32 - 3.0).to_le_bytes())
        .collect();
    let f32w: Vec<u8> = (0..64 * 32)
        .flat_map(|i| ((i % 7) as f32 - 3.0).to_le_bytes())
        .collect();
    let e = vec![
        (
            "lm_head.weight".to_string(),
            Dtype::BF16,
            vec![64, 32],
            w.clone(),
        ),
        (
            "model.layers.3.mlp.gate.weight".to_string(),
            Dtype::F32,
            vec![64, 32],
            f32w,
        ),
        (format!("{P}.weight"), Dtype::BF16, vec![64, 32], w),
    ];
    let ck = checkpoint(&e);
    let cfg = nvfp4_cfg();
    for name in ["lm_head", "model.layers.3.mlp.gate"] {
        let l = QuantLinear::load(&ck, name, &Device::Cpu, &cfg)?;
        assert!(!l.is_nvfp4(), "{name}");
        assert_eq!((l.out_features(), l.in_features()), (64, 32));
        assert_eq!(
            l.dequantize()?.i((1, 0))?.to_scalar::<f32>()?,
            32.0 % 7.0 - 3.0
        );
    }
    // Unquantized config: the q_proj BF16 weight loads as is...
    let l = QuantLinear::load(&ck, P, &Device::Cpu, &QuantConfig::unquantized())?;
    assert!(!l.is_nvfp4());
    // ...but with the NVFP4 config it is an error naming the tensor.
    assert_err(
        QuantLinear::load(&ck, P, &Device::Cpu, &cfg),
        &[&format!("{P}.weight"), "U8"],
    );
    // And NVFP4 tensors under an unquantized config are an error too.
    let q = quantized(2, 64, 64);
    let ck = checkpoint(&nvfp4_entries(P, &q));
    assert_err(
        QuantLinear::load(&ck, P, &Device::Cpu, &QuantConfig::unquantized()),
        &[&format!("{P}.weight"), "U8"],
    );
    Ok(())
}

#[test]
fn checkpoint_errors_name_the_tensor() {
    let q = quantized(61, 64, 128);
    let cfg = nvfp4_cfg();
    let load = |e: &[Entry]| QuantLinear::load(&checkpoint(e), P, &Device::Cpu, &cfg);
    let (w, s, g) = (
        format!("{P}.weight"),
        format!("{P}.weight_scale"),
        format!("{P}.weight_scale_2"),
    );
    // Missing tensors.
    for name in [&w, &s, &g] {
        let mut e = nvfp4_entries(P, &q);
        e.retain(|x| &x.0 != name);
        assert_err(load(&e), &[name, "missing", "test.safetensors"]);
    }
    // Wrong dtypes.
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &s, Dtype::BF16, vec![64, 4], vec![0; 64 * 8]);
    assert_err(load(&e), &[&s, "dtype", "BF16"]);
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &g, Dtype::F16, vec![], vec![0, 0x3c]);
    assert_err(load(&e), &[&g, "dtype", "F16"]);
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &w, Dtype::I32, vec![64, 16], vec![0; 64 * 64]);
    assert_err(load(&e), &[&w, "I32"]);
    // Wrong shapes.
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &s, Dtype::F8_E4M3, vec![64, 9], vec![0x38; 64 * 9]);
    assert_err(load(&e), &[&s, "shape", "[64, 9]", "[64, 8]"]);
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &g, Dtype::F32, vec![2], vec![0; 8]);
    assert_err(load(&e), &[&g, "shape"]);
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &w, Dtype::U8, vec![64, 60], vec![0; 64 * 60]);
    assert_err(load(&e), &[&w, "multiple of 16"]);
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &w, Dtype::U8, vec![64 * 64], vec![0; 64 * 64]);
    assert_err(load(&e), &[&w, "[4096]"]);
    let mut e = nvfp4_entries(P, &q);
    let b = format!("{P}.bias");
    set(&mut e, &b, Dtype::BF16, vec![65], vec![0; 130]);
    assert_err(load(&e), &[&b, "shape"]);
    // Bad global scales.
    for v in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, -1e-3] {
        let mut e = nvfp4_entries(P, &q);
        set(&mut e, &g, Dtype::F32, vec![], v.to_le_bytes().to_vec());
        assert_err(load(&e), &[&g, "positive finite"]);
    }
}

#[test]
fn load_fused_checks_global_scales_and_k() -> Result<()> {
    let (pq, pk, pv, po) = (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.o_proj",
    );
    // q/k/v quantized against one shared global scale (the largest of the three).
    let mut rng = StdRng::seed_from_u64(71);
    let ws: Vec<Vec<f32>> = [96, 32, 32]
        .iter()
        .map(|&n| rand_weights(&mut rng, n, 128))
        .collect();
    let own: Vec<f32> = ws
        .iter()
        .zip([96, 32, 32])
        .map(|(w, n)| quantize_nvfp4_slice(w, n, 128, None).unwrap().global_scale)
        .collect();
    let shared = own.iter().copied().fold(0f32, f32::max);
    let qs: Vec<Nvfp4Quantized> = ws
        .iter()
        .zip([96, 32, 32])
        .map(|(w, n)| quantize_nvfp4_slice(w, n, 128, Some(shared)).unwrap())
        .collect();
    let o = quantized(72, 64, 128);
    assert_ne!(o.global_scale, shared);
    let mut e = vec![];
    for (p, q) in [(pq, &qs[0]), (pk, &qs[1]), (pv, &qs[2]), (po, &o)] {
        e.extend(nvfp4_entries(p, q));
    }
    let odd_k = quantized(73, 16, 64);
    e.extend(nvfp4_entries("odd", &odd_k));
    let ck = checkpoint(&e);
    let cfg = nvfp4_cfg();
    let fused = QuantLinear::load_fused(&ck, &[pq, pk, pv], &Device::Cpu, &cfg)?;
    assert_eq!((fused.out_features(), fused.in_features()), (160, 128));
    assert_eq!(fused.global_scale(), Some(shared));
    let f = fused.to_nvfp4()?.unwrap_or_else(|| panic!("NVFP4"));
    let cat = |g: fn(&Nvfp4Quantized) -> &Vec<u8>| {
        qs.iter().flat_map(|q| g(q).clone()).collect::<Vec<u8>>()
    };
    assert_eq!(f.weight, cat(|q| &q.weight));
    assert_eq!(f.weight_scale, cat(|q| &q.weight_scale));
    // Forward of the fused layer = the three forwards side by side.
    let x = rand_x(5, &[3, 128]);
    let parts: Vec<Tensor> = [pq, pk, pv]
        .iter()
        .map(|p| QuantLinear::load(&ck, p, &Device::Cpu, &cfg)?.forward(&x))
        .collect::<Result<_>>()?;
    assert_eq!(bits(&fused.forward(&x)?), bits(&Tensor::cat(&parts, 1)?));
    // Different global scales: the error names both tensors and values.
    assert_err(
        QuantLinear::load_fused(&ck, &[pq, po], &Device::Cpu, &cfg),
        &[
            &format!("{pq}.weight_scale_2"),
            &format!("{po}.weight_scale_2"),
            &format!("{:e}", o.global_scale),
        ],
    );
    assert_err(
        QuantLinear::load_fused(&ck, &[pq, "odd"], &Device::Cpu, &cfg),
        &[pq, "odd", "in_features"],
    );
    assert_err(
        QuantLinear::load_fused(&ck, &[], &Device::Cpu, &cfg),
        &["at least one"],
    );
    Ok(())
}

// ---- quant config -------------------------------------------------------------------

#[test]
fn quant_config_both_forms() -> Result<()> {
    let hf = r#"{"producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                         "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}}"#;
    let c = QuantConfig::from_hf_quant_config_str(hf, "hf_quant_config.json")?;
    assert_eq!(c.quant_algo, QuantAlgo::Nvfp4);
    assert_eq!(c.group_size, 16);
    assert_eq!(c.exclude, ["lm_head", "model.layers.*.mlp.gate"]);
    assert_eq!(c.kv_cache_quant_algo.as_deref(), Some("FP8"));
    assert_eq!(c.producer.as_deref(), Some("modelopt 0.47.0"));
    let cj = r#"{"hidden_size": 8, "quantization_config": {"quant_method": "modelopt",
        "quant_algo": "W4A16_NVFP4", "ignore": ["lm_head"], "producer": {"name": "modelopt"},
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                      "targets": ["Linear"]}}}}"#;
    let c = QuantConfig::from_config_json_str(cj, "config.json")?;
    assert_eq!(c.quant_algo, QuantAlgo::W4A16Nvfp4);
    assert!(c.quantizes());
    assert_eq!(c.exclude, ["lm_head"]);
    assert_eq!(c.producer.as_deref(), Some("modelopt"));
    // Nested copy of hf_quant_config's object inside config.json.
    let nested = r#"{"quantization_config": {"quant_method": "modelopt",
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["x"]}}}"#;
    let c = QuantConfig::from_config_json_str(nested, "config.json")?;
    assert_eq!(
        (c.quant_algo, c.exclude.clone()),
        (QuantAlgo::Nvfp4, vec!["x".to_string()])
    );
    // No quantization_config / quant_algo null: unquantized.
    let c = QuantConfig::from_config_json_str(r#"{"hidden_size": 8}"#, "config.json")?;
    assert_eq!(c, QuantConfig::unquantized());
    assert!(!c.quantizes() && !c.is_nvfp4("anything"));
    let kv_only = r#"{"quantization": {"quant_algo": null, "kv_cache_quant_algo": "FP8"}}"#;
    let c = QuantConfig::from_hf_quant_config_str(kv_only, "h")?;
    assert_eq!(c.quant_algo, QuantAlgo::None);
    assert_eq!(c.kv_cache_quant_algo.as_deref(), Some("FP8"));
    Ok(())
}

#[test]
fn quant_config_rejects_unsupported() {
    let hf = |algo: &str, gs: usize| {
        format!(r#"{{"quantization": {{"quant_algo": {algo}, "group_size": {gs}}}}}"#)
    };
    for algo in [
        "\"FP8\"",
        "\"NVFP4_AWQ\"",
        "\"W4A8_AWQ\"",
        "\"MIXED_PRECISION\"",
    ] {
        assert_err(
            QuantConfig::from_hf_quant_config_str(&hf(algo, 16), "hf_quant_config.json"),
            &[
                "hf_quant_config.json",
                algo.trim_matches('"'),
                "not supported",
            ],
        );
    }
    assert_err(
        QuantConfig::from_hf_quant_config_str(&hf("\"NVFP4\"", 32), "hf_quant_config.json"),
        &["group_size 32"],
    );
    assert_err(
        QuantConfig::from_config_json_str(
            r#"{"quantization_config": {"quant_method": "gptq", "bits": 4}}"#,
            "config.json",
        ),
        &["config.json", "quant_method `gptq`"],
    );
    assert_err(
        QuantConfig::from_config_json_str(
            r#"{"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
               "config_groups": {"g": {"weights": {"group_size": 32}}}}}"#,
            "config.json",
        ),
        &["group_size 32"],
    );
    assert_err(
        QuantConfig::from_hf_quant_config_str("{}", "h.json"),
        &["h.json", "quantization"],
    );
    assert_err(
        QuantConfig::from_hf_quant_config_str("nope", "h.json"),
        &["h.json", "JSON"],
    );
    assert_err(
        QuantConfig::from_hf_quant_config_str(
            r#"{"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}}"#,
            "h.json",
        ),
        &["exclude_modules"],
    );
}

#[test]
fn exclusion_patterns() {
    let c = QuantConfig {
        exclude: vec![
            "lm_head".into(),
            "model.layers.*.mlp.gate".into(),
            "model.layers.1.self_attn".into(),
            "*vision*".into(),
            "model.layers.?.block_sparse_moe.gate".into(),
        ],
        ..nvfp4_cfg()
    };
    let yes = [
        "lm_head",
        "model.layers.0.mlp.gate",
        "model.layers.17.mlp.gate",
        // A parent module's exclusion covers its children.
        "model.layers.1.self_attn",
        "model.layers.1.self_attn.q_proj",
        "model.layers.0.mlp.gate.sub",
        "model.vision_tower.blocks.0.fc1",
        "model.layers.3.block_sparse_moe.gate",
    ];
    let no = [
        "lm_head_2",
        "model.lm_head",
        "model.layers.0.mlp.gate_proj",
        "model.layers.11.self_attn.q_proj",
        "model.layers.1.self_attn_extra.q_proj",
        "model.layers.13.block_sparse_moe.gate",
        "model.embed_tokens",
    ];
    for m in yes {
        assert!(c.is_excluded(m), "{m} should be excluded");
        assert!(!c.is_nvfp4(m));
    }
    for m in no {
        assert!(!c.is_excluded(m), "{m} should not be excluded");
        assert!(c.is_nvfp4(m));
    }
}
