//! Where a CPU decode step of a Llama goes: the model's step time vs its projections
//! timed alone (the same QuantLinear shapes, NVFP4 or BF16, M = 1).
//!
//! ```sh
//! cargo run --release -p candle-fp4-models --example decode_profile -- ~/.cache/candle-fp4/smollm2/nvfp4
//! ```

use candle_core::{DType, Device, Module, Tensor};
use candle_fp4::nvfp4::quantize_nvfp4;
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4_models::{Llama, LoadOptions};
use std::time::Instant;

fn time<F: FnMut() -> anyhow::Result<()>>(iters: usize, mut f: F) -> anyhow::Result<f64> {
    f()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e3 / iters as f64)
}

fn main() -> anyhow::Result<()> {
    let dir = std::env::args().nth(1).expect("model folder");
    let dev = Device::Cpu;
    let dtype = match std::env::var("DTYPE").as_deref() {
        Ok("bf16") => Some(DType::BF16),
        _ => None,
    };
    let mut m = Llama::load(
        &dir,
        &dev,
        &LoadOptions {
            dtype,
            ..Default::default()
        },
    )?;
    let c = m.config().clone();
    let nvfp4 = m.nvfp4_layer_count().0 > 1;
    let ids: Vec<u32> = (0..40).map(|i| 100 + i * 7).collect();
    m.forward(&ids, 0)?;
    let mut pos = ids.len();
    let step = time(32, || {
        m.forward(&[42], pos)?;
        pos += 1;
        Ok(())
    })?;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let shapes = [
        (
            "q|k|v",
            (c.num_attention_heads + 2 * c.num_key_value_heads) * hd,
            h,
            false,
        ),
        ("o", h, c.num_attention_heads * hd, false),
        ("gate|up (silu_mul)", 2 * c.intermediate_size, h, true),
        ("down", h, c.intermediate_size, false),
    ];
    let mut layers_ms = 0.0;
    for (name, n, k, silu) in shapes {
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev)?;
        let l = if nvfp4 {
            QuantLinear::from_nvfp4(&quantize_nvfp4(&w)?, None, &dev)?
        } else {
            QuantLinear::from_bf16(w, None)?
        };
        let x = Tensor::randn(0f32, 1.0, (1, k), &dev)?;
        let ms = time(50, || {
            if silu {
                l.forward_silu_mul(&x)?;
            } else {
                l.forward(&x)?;
            }
            Ok(())
        })?;
        println!(
            "{name:>20} [{n}x{k}] {}: {ms:.3} ms × {} layers",
            if nvfp4 { "NVFP4" } else { "BF16" },
            c.num_hidden_layers
        );
        layers_ms += ms * c.num_hidden_layers as f64;
    }
    let w = Tensor::randn(0f32, 0.02, (c.vocab_size, h), &dev)?.to_dtype(DType::BF16)?;
    let head = QuantLinear::from_bf16(w, None)?;
    let x = Tensor::randn(0f32, 1.0, (1, h), &dev)?;
    let head_ms = time(20, || {
        head.forward(&x)?;
        Ok(())
    })?;
    println!(
        "{:>20} [{}x{h}] BF16: {head_ms:.3} ms",
        "lm_head", c.vocab_size
    );
    println!(
        "decode step {step:.2} ms ({:.1} tokens/s): projections {:.2} ms + lm_head {head_ms:.2} ms, everything else {:.2} ms",
        1e3 / step,
        layers_ms,
        step - layers_ms - head_ms
    );
    Ok(())
}
