//! Llama models with seeded random weights built directly on their device, with no
//! checkpoint: what the decode benchmark runs (a device call carries 64 MiB, not an 8B
//! model). Layouts and fusions are those a ModelOpt checkpoint loads into (fused q|k|v and
//! gate|up, NVFP4 codes with 128×4-swizzled block scales), so the same kernels run.
//!
//! Magnitudes keep activations finite through any depth: NVFP4 weights draw uniform E2M1
//! codes (RMS ≈ 2.9) with E4M3 block scales in 0.25..0.94 and a global scale that makes the
//! element RMS ≈ 1/√K; BF16 weights are N(0, 1/K); norm weights are 1.

use super::{attention::Attention, block::Block, lm_head::LmHead, mlp::Mlp};
use super::{options::LoadOptions, parts::Parts};
use crate::config::LlamaConfig;
use crate::rope::Rope;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_fp4::nvfp4::{swizzled_shape, BLOCK_SIZE};
use candle_fp4::quant_config::{QuantAlgo, QuantConfig};
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4::tensor_parallel::{self as tp, AllReduce};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// Which weights a random model gets.
#[derive(Debug, Clone, Copy)]
pub struct RandomSpec {
    /// The decoder layers' projections in NVFP4 (else BF16).
    pub nvfp4: bool,
    /// The seed of the device's generator.
    pub seed: u64,
}

/// The random source: the device's generator (seeded once; CUDA's curand, so an 8B model
/// is drawn in GPU memory), or a seeded host generator on the CPU (candle's CPU device
/// cannot be seeded).
struct Gen<'a> {
    device: &'a Device,
    host: Option<StdRng>,
}

impl<'a> Gen<'a> {
    fn new(device: &'a Device, seed: u64) -> Result<Self> {
        if device.is_cpu() {
            return Ok(Self {
                device,
                host: Some(StdRng::seed_from_u64(seed)),
            });
        }
        device.set_seed(seed)?;
        Ok(Self { device, host: None })
    }

    /// F32 uniform `[0, 1)` of `shape`.
    fn uniform(&mut self, shape: (usize, usize)) -> Result<Tensor> {
        Ok(match &mut self.host {
            Some(r) => {
                let v: Vec<f32> = (0..shape.0 * shape.1).map(|_| r.random::<f32>()).collect();
                Tensor::from_vec(v, shape, self.device)?
            }
            None => Tensor::rand(0f32, 1f32, shape, self.device)?,
        })
    }

    /// F32 normal `N(0, std²)` of `shape`.
    fn normal(&mut self, shape: (usize, usize), std: f32) -> Result<Tensor> {
        Ok(match &mut self.host {
            Some(r) => {
                // Box-Muller from two uniforms.
                let v: Vec<f32> = (0..shape.0 * shape.1)
                    .map(|_| {
                        let (a, b) = (1.0 - r.random::<f32>(), r.random::<f32>());
                        std * (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
                    })
                    .collect();
                Tensor::from_vec(v, shape, self.device)?
            }
            None => Tensor::randn(0f32, std, shape, self.device)?,
        })
    }

    /// Uniform random bytes `lo..hi` of `shape`.
    fn bytes(&mut self, shape: (usize, usize), lo: f64, hi: f64) -> Result<Tensor> {
        Ok(self
            .uniform(shape)?
            .affine(hi - lo, lo)?
            .to_dtype(DType::U8)?)
    }

    /// A random `[n, k]` projection.
    fn linear(&mut self, n: usize, k: usize, nvfp4: bool) -> Result<QuantLinear> {
        if nvfp4 {
            if !k.is_multiple_of(BLOCK_SIZE) {
                bail!("random NVFP4 layer [{n}, {k}]: K must be a multiple of {BLOCK_SIZE}")
            }
            let codes = self.bytes((n, k / 2), 0.0, 256.0)?;
            let scales = self.bytes(swizzled_shape(n, k / BLOCK_SIZE), 40.0, 56.0)?;
            // E2M1 RMS 2.9 × block scale ~0.55 × g = 1/√K.
            let g = 1.0 / (1.6 * (k as f32).sqrt());
            Ok(QuantLinear::from_nvfp4_parts(codes, scales, g, None)?)
        } else {
            let w = self.normal((n, k), (1.0 / k as f64).sqrt() as f32)?;
            Ok(QuantLinear::from_bf16(w.to_dtype(DType::BF16)?, None)?)
        }
    }
}

/// The context of a random model: `opts.max_seq_len`, or `cfg`'s positions up to 4096;
/// an error outside `1..=max_position_embeddings`.
pub(super) fn max_seq_len(cfg: &LlamaConfig, opts: &LoadOptions) -> Result<usize> {
    let n = opts
        .max_seq_len
        .unwrap_or(cfg.max_position_embeddings.min(4096));
    if n == 0 || n > cfg.max_position_embeddings {
        bail!(
            "Llama::random: max_seq_len {n} must be in 1..={}",
            cfg.max_position_embeddings
        )
    }
    Ok(n)
}

/// The modules of a model of `cfg`'s shapes with random weights ([`RandomSpec`]) on
/// `device`, activations in `dtype`, RoPE tables for `max_seq_len` positions; `lm_head` and
/// the embeddings are BF16 (tied when `cfg` says so). `Llama::random` makes the caches.
/// With `rank` (a rank that draws its own shard, `Llama::random_rank`) the `lm_head` is the
/// rank's slice of the vocabulary where [`tp::vocab_parallel`] says so (tied: those rows of
/// the embeddings), its logits joined by `rank`.
pub(super) fn random_parts(
    cfg: LlamaConfig,
    spec: RandomSpec,
    dtype: DType,
    max_seq_len: usize,
    device: &Device,
    rank: Option<&Arc<dyn AllReduce>>,
) -> Result<Parts> {
    let mut gen = Gen::new(device, spec.seed)?;
    let (h, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let rope = Rope::new(&cfg, max_seq_len, dtype, device)?;
    let ones = Tensor::ones(h, dtype, device)?;
    let mut blocks = Vec::with_capacity(cfg.num_hidden_layers);
    for _ in 0..cfg.num_hidden_layers {
        let qkv = gen.linear((nh + 2 * nkv) * hd, h, spec.nvfp4)?;
        let o = gen.linear(h, nh * hd, spec.nvfp4)?;
        let attn = Attention::from_parts(&cfg, qkv, o, &rope, dtype)?;
        let mlp = Mlp::from_parts(
            gen.linear(2 * inter, h, spec.nvfp4)?,
            gen.linear(h, inter, spec.nvfp4)?,
        )?;
        let eps = cfg.rms_norm_eps as f32;
        blocks.push(Block::from_parts(
            ones.clone(),
            attn,
            ones.clone(),
            mlp,
            eps,
        )?);
    }
    let embed = gen
        .normal((cfg.vocab_size, h), 1.0)?
        .to_dtype(DType::BF16)?;
    let v = cfg.vocab_size;
    let lm_head = match rank.filter(|r| tp::vocab_parallel(v, r.shard().ranks())) {
        Some(r) => {
            let rows = v / r.shard().ranks();
            let linear = if cfg.tie_word_embeddings {
                let e = embed.narrow(0, r.shard().rank() * rows, rows)?;
                QuantLinear::from_bf16(e.contiguous()?, None)?
            } else {
                gen.linear(rows, h, false)?
            };
            LmHead::from_slice(linear, r.clone())
        }
        None if cfg.tie_word_embeddings => {
            LmHead::whole(QuantLinear::from_bf16(embed.clone(), None)?)
        }
        None => LmHead::whole(gen.linear(v, h, false)?),
    };
    let quant = if spec.nvfp4 {
        QuantConfig {
            quant_algo: QuantAlgo::Nvfp4,
            group_size: BLOCK_SIZE,
            exclude: vec!["lm_head".into()],
            kv_cache_quant_algo: None,
            producer: Some("candle-fp4-models Llama::random".into()),
        }
    } else {
        QuantConfig::unquantized()
    };
    let parts = Parts {
        cfg,
        quant,
        embed,
        blocks,
        norm: ones,
        lm_head,
    };
    Ok(parts)
}
