//! Helpers of the GPU GEMV tests (`gpu_gemv`, `gpu_gemv_packed`): one device, random
//! NVFP4 layers, and the element-wise check with the tolerance derived in `gpu_gemv.rs`.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_fp4::nvfp4::swizzled_shape;
use rand::{rngs::StdRng, Rng};

pub type R<T> = candle_core::Result<T>;

/// One CUDA device for the whole test binary (candle gives every `new_cuda(0)` its own id).
pub fn gpu() -> Device {
    static DEV: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEV.get_or_init(|| Device::new_cuda(0).expect("these tests need a CUDA GPU"))
        .clone()
}

/// SMs of the test GPU.
pub fn gpu_sms() -> R<usize> {
    candle_fp4::partition::device_sms(&gpu())
}

/// Random NVFP4 layer: every code byte, scales spanning subnormal to 448 (swizzled, with
/// the padding bytes 0), returned on CPU and GPU.
pub struct Layer {
    pub codes: Tensor,
    pub scales: Tensor,
    pub gs: f32,
}

pub fn layer(n: usize, k: usize, rng: &mut StdRng) -> R<Layer> {
    let codes: Vec<u8> = (0..n * k / 2).map(|_| rng.random()).collect();
    let s = k / 16;
    // Mostly moderate scales, some subnormal (0x01..0x07) and some large ones.
    let raw: Vec<u8> = (0..n * s)
        .map(|_| match rng.random_range(0..20) {
            0 => rng.random_range(0x01..0x08),
            1 => rng.random_range(0x60..0x7f),
            _ => rng.random_range(0x28..0x48),
        })
        .collect();
    let swz = candle_fp4::nvfp4::swizzle_blockscale_bytes(&raw, n, s)?;
    let (np, sp) = swizzled_shape(n, s);
    Ok(Layer {
        codes: Tensor::from_vec(codes, (n, k / 2), &Device::Cpu)?,
        scales: Tensor::from_vec(swz, (np, sp), &Device::Cpu)?,
        gs: 0.37 * rng.random_range(0.5f32..2.0),
    })
}

/// A random BF16 `[n, k]` weight on the CPU.
pub fn bf16_weight(n: usize, k: usize, rng: &mut StdRng) -> R<Tensor> {
    let v: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.1f32..0.1)).collect();
    Tensor::from_vec(v, (n, k), &Device::Cpu)?.to_dtype(DType::BF16)
}

/// x · wᵀ in FP64, rounded to F32 (the reference before the epilogue).
pub fn fp64_reference(x: &Tensor, w: &Tensor) -> R<Vec<Vec<f32>>> {
    x.to_dtype(DType::F64)?
        .matmul(&w.to_dtype(DType::F64)?.t()?)?
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()
}

pub fn rand_x(m: usize, k: usize, rng: &mut StdRng) -> R<Tensor> {
    let v: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, (m, k), &Device::Cpu)?.to_dtype(DType::BF16)
}

/// Σ|x·w|·gs per output, in F32 (for the summation-error term).
pub fn abs_dot(x: &Tensor, w_deq: &Tensor, gs: f32) -> R<Vec<Vec<f32>>> {
    let xa = x.to_dtype(DType::F32)?.abs()?;
    let wa = w_deq.to_dtype(DType::F32)?.abs()?;
    (xa.matmul(&wa.t()?)? * gs as f64)?
        .to_device(&Device::Cpu)?
        .to_vec2::<f32>()
}

pub fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// Checks `got` against `want` element by element with the bound of the module docs.
/// `extra_round` adds one BF16 rounding of `want` (cuBLAS path).
#[allow(clippy::too_many_arguments)]
pub fn check(
    what: &str,
    got: &Tensor,
    want_pre: &[Vec<f32>],
    absd: &[Vec<f32>],
    k: usize,
    silu_mul: bool,
    extra_round: bool,
) -> R<()> {
    let got = got
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .to_vec2::<f32>()?;
    let gamma = k as f64 * 2f64.powi(-24);
    let u = 2f64.powi(-8);
    let mut worst = 0f64;
    for (t, row) in got.iter().enumerate() {
        let n = want_pre[t].len();
        for (j, &g) in row.iter().enumerate() {
            if !g.is_finite() {
                panic!("{what}: token {t} output {j} is {g} (unwritten or overflow)");
            }
            let (want, tol) = if silu_mul {
                let h = n / 2;
                let (gate, up) = (want_pre[t][j] as f64, want_pre[t][j + h] as f64);
                let (eg, eu) = (gamma * absd[t][j] as f64, gamma * absd[t][j + h] as f64);
                let s = silu(gate) * up;
                let dsilu = (silu(gate) / gate.max(1e-30)).abs() + 0.3; // |silu'(g)| ≤ 1.1
                let prop = (dsilu * (eg + u * gate.abs())) * up.abs()
                    + silu(gate).abs() * (eu + u * up.abs());
                let r = if extra_round { 2.0 } else { 1.0 };
                (s, r * prop + u * s.abs() + 1e-30)
            } else {
                let w = want_pre[t][j] as f64;
                let e = gamma * absd[t][j] as f64;
                let r = if extra_round { 2.0 } else { 1.0 };
                (w, e + r * u * w.abs().max(g.abs() as f64) + 1e-30)
            };
            let err = (g as f64 - want).abs();
            worst = worst.max(err / tol);
            if err > tol {
                panic!("{what}: token {t} output {j}: got {g}, want {want} (tolerance {tol:e})");
            }
        }
    }
    assert!(worst <= 1.0, "{what}: worst error/tolerance {worst}");
    Ok(())
}

/// The shipped sm90 table plus entries `(n, k, silu_mul)` for a test's untuned shapes (so
/// the layer plans the packed GEMV for them, every token tile), as the
/// `CANDLE_FP4_TABLES` override; set once per test binary, before any table is loaded
/// (every test calls it first, with the same entries or a subset of the first call's).
pub fn test_tables(extra: &[(usize, usize, bool)]) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let text = candle_fp4::tables::embedded_table("sm90").expect("sm90 table");
        let mut t: serde_json::Value = serde_json::from_str(text).expect("sm90 table parses");
        let entries = t["entries"].as_array_mut().expect("entries");
        for &(n, k, silu) in extra {
            entries.push(serde_json::json!({
                "n": n, "k": k, "silu_mul": silu, "bf16": false,
                "nts": [1, 2, 4], "margins": [1.0, 1.0, 1.0]
            }));
        }
        let dir = std::env::temp_dir().join(format!("cfp4-test-tables-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::write(dir.join("sm90.json"), t.to_string()).expect("table written");
        std::env::set_var(candle_fp4::tables::TABLES_ENV, &dir);
    });
}

/// `rows × k` BF16 multiples of 1/4 in [-2, 2] (on the CPU): their squares and sums are
/// exact in f32 in any order (the norm tests' inputs).
pub fn quarters(rows: usize, k: usize, rng: &mut StdRng) -> R<Tensor> {
    let v: Vec<f32> = (0..rows * k)
        .map(|_| rng.random_range(-8i32..=8) as f32 / 4.0)
        .collect();
    Tensor::from_vec(v, (rows, k), &Device::Cpu)?.to_dtype(DType::BF16)
}

/// The BF16 bits of `t` (any device), flattened.
pub fn bits(t: &Tensor) -> R<Vec<u16>> {
    Ok(t.to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<half::bf16>()?
        .iter()
        .map(|v| v.to_bits())
        .collect())
}
