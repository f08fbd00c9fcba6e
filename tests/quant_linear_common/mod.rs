//! Helpers of the QuantLinear tests (`quant_linear.rs`, `quant_linear_load.rs`,
//! `tensor_parallel.rs`, `tensor_parallel_errors.rs`): seeded
//! weights and inputs, the FP32 reference and its tolerance (derivation in `quant_linear.rs`).
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_fp4::nvfp4::{quantize_nvfp4_slice, Nvfp4Quantized};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const U: f32 = 1.0 / 256.0; // BF16 unit roundoff 2^-8
pub const F32_U: f32 = 1.0 / 16_777_216.0; // 2^-24

/// Random weights: uniform, each 16-block scaled by 2^[-3, 2], a few all-zero blocks.
pub fn rand_weights(rng: &mut StdRng, n: usize, k: usize) -> Vec<f32> {
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

pub fn quantized(seed: u64, n: usize, k: usize) -> Nvfp4Quantized {
    let mut rng = StdRng::seed_from_u64(seed);
    quantize_nvfp4_slice(&rand_weights(&mut rng, n, k), n, k, None).unwrap()
}

pub fn rand_x(seed: u64, shape: &[usize]) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let len = shape.iter().product::<usize>();
    let v: Vec<f32> = (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
}

pub fn rand_bias(seed: u64, n: usize) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-0.5f32..0.5)).collect();
    Tensor::from_vec(v, n, &Device::Cpu).unwrap()
}

/// FP32 reference for `x` `[..., K]`, all `[M, N]` row-major: `x·wᵀ (+ b)`, `Σ|x·w|`, and
/// the magnitude the BF16 roundings act on, `|x·wᵀ| (+ |b|)` (the bias add can cancel).
pub struct Ref {
    pub y: Vec<f32>,
    pub absdot: Vec<f32>,
    pub mag: Vec<f32>,
    pub k: usize,
}

impl Ref {
    pub fn tol(&self, r: f32, i: usize) -> f32 {
        tolerance(r, self.mag[i], self.absdot[i], self.k)
    }
}

pub fn reference(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Ref {
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

pub fn tolerance(r: f32, rf: f32, absdot: f32, k: usize) -> f32 {
    let e = (2 * k + 4) as f32 * F32_U * absdot;
    r * U * (rf.abs() + e) + e
}

/// Checks `y` (any shape ending in N) against the FP32 reference with `r` roundings.
pub fn check_close(y: &Tensor, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, r: f32, what: &str) {
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

pub fn bits(t: &Tensor) -> Vec<u16> {
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

/// `silu(g)·u` of a BF16 `[M, 2h]` output `[g | u]`, in FP32 from the BF16 values and
/// rounded once (what `forward_silu_mul` computes from `forward`'s output on the CPU).
pub fn silu_mul_ref(y: &Tensor) -> candle_core::Result<Tensor> {
    let h = y.dim(1)? / 2;
    let g = y.narrow(1, 0, h)?.to_dtype(DType::F32)?;
    let u = y.narrow(1, h, h)?.to_dtype(DType::F32)?;
    let s = (&g / (g.neg()?.exp()? + 1.0)?)?;
    (s * u)?.to_dtype(DType::BF16)
}

/// A float tensor's values as f64, flattened.
pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("a float tensor")
}

/// A seeded float weight `[n, k]` (F32, [`rand_weights`]).
pub fn float_weight(seed: u64, n: usize, k: usize) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    Tensor::from_vec(rand_weights(&mut rng, n, k), (n, k), &Device::Cpu).expect("shape")
}
