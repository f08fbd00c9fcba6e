//! Llama (Llama 2, Llama 3 / 3.1, SmolLM2, …) on [`QuantLinear`]: every projection is
//! NVFP4 or BF16 as the checkpoint's quant config says; q|k|v and gate|up are fused into
//! one layer each (gate|up runs the GEMV's `silu_mul` epilogue); grouped-query attention
//! over a preallocated [`LayerCache`]; tied or separate `lm_head`.
//!
//! Numerics: activations (residual stream, norms, RoPE, attention) in `dtype` (F32 by
//! default on CPU, BF16 on CUDA); every projection takes BF16 input and returns BF16
//! (see `QuantLinear`); softmax in F32; logits returned as F32.

use crate::config::LlamaConfig;
use crate::kv_cache::{KvCacheKind, LayerCache};
use crate::rope::Rope;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_fp4::checkpoint::Checkpoint;
use candle_fp4::quant_config::QuantConfig;
use candle_fp4::quant_linear::QuantLinear;
use std::path::Path;

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// KV-cache storage.
    pub kv_cache: KvCacheKind,
    /// Tokens the KV cache holds (prompt + generated); default
    /// `min(max_position_embeddings, 4096)`.
    pub max_seq_len: Option<usize>,
    /// Activation dtype; default F32 on CPU (candle's CPU BF16 ops are slower and
    /// QuantLinear takes BF16 input either way), BF16 elsewhere.
    pub dtype: Option<DType>,
    /// Longest run of tokens pushed through the layers at once; longer inputs are split.
    /// Default 32, the GEMV's largest M. A chunk of more than 32 tokens runs the
    /// projections as dequantize + matmul: on the CPU that is ~1.5× faster over a
    /// 512-token prompt but slower for short ones (every weight is dequantized once per
    /// chunk). With the UltraQuant cache a chunk attends over its own K/V exactly (see
    /// `kv_cache`), so this also sets how much of a prompt sees unquantized K/V.
    pub prefill_chunk: usize,
    /// UltraQuant cache only: the most recent tokens kept exact in BF16 besides their FP4
    /// slots (`candle_fp4::kv_cache`'s exact window; 0 = every token read from FP4).
    /// Default [`DEFAULT_KV_WINDOW`].
    pub kv_window: usize,
    /// Accept a `max_seq_len` beyond the model's `max_position_embeddings` (positions the
    /// model was not trained for); default `false`: such a request is a
    /// [`ConfigError::ContextTooLong`](crate::errors::ConfigError::ContextTooLong).
    pub allow_long_context: bool,
}

/// Default exact window of the UltraQuant cache: 64 tokens (docs/accuracy.md: SmolLM2's
/// perplexity cost of the FP4 cache in pure decode drops from +20.8 % to the numbers
/// there; 64 · kv_heads · head_dim · 4 bytes per layer, 96 KiB per layer for SmolLM2).
pub const DEFAULT_KV_WINDOW: usize = 64;

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            kv_cache: KvCacheKind::Bf16,
            max_seq_len: None,
            dtype: None,
            prefill_chunk: 32,
            kv_window: DEFAULT_KV_WINDOW,
            allow_long_context: false,
        }
    }
}

/// A projection that is fused when the checkpoint allows it (shared global scale), else
/// kept as separate layers whose outputs are concatenated.
#[derive(Debug)]
enum Fused {
    One(QuantLinear),
    Split(Vec<QuantLinear>),
}

impl Fused {
    fn load(ckpt: &Checkpoint, prefixes: &[&str], dev: &Device, q: &QuantConfig) -> Result<Self> {
        match QuantLinear::load_fused(ckpt, prefixes, dev, q) {
            Ok(l) => Ok(Self::One(l)),
            Err(e) if e.to_string().contains("different global scales") => {
                let ls = prefixes
                    .iter()
                    .map(|p| QuantLinear::load(ckpt, p, dev, q))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok(Self::Split(ls))
            }
            Err(e) => Err(e.into()),
        }
    }

    fn out_features(&self) -> usize {
        match self {
            Self::One(l) => l.out_features(),
            Self::Split(ls) => ls.iter().map(QuantLinear::out_features).sum(),
        }
    }

    fn in_features(&self) -> usize {
        match self {
            Self::One(l) => l.in_features(),
            Self::Split(ls) => ls[0].in_features(),
        }
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::One(l) => l.forward(x),
            Self::Split(ls) => {
                let ys = ls
                    .iter()
                    .map(|l| l.forward(x))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&ys, D::Minus1)
            }
        }
    }

    /// `silu(gate) · up` for `[gate | up]`.
    fn forward_silu_mul(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::One(l) => l.forward_silu_mul(x),
            Self::Split(ls) => {
                let dt = x.dtype();
                let g = ls[0].forward(x)?.to_dtype(DType::F32)?;
                let u = ls[1].forward(x)?.to_dtype(DType::F32)?;
                (candle_nn::ops::silu(&g)? * u)?
                    .to_dtype(DType::BF16)?
                    .to_dtype(dt)
            }
        }
    }
}

#[derive(Debug)]
struct Block {
    attn_norm: Tensor,
    qkv: Fused,
    o: QuantLinear,
    mlp_norm: Tensor,
    gate_up: Fused,
    down: QuantLinear,
}

/// A Llama model with its KV cache.
#[derive(Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    quant: QuantConfig,
    embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    lm_head: QuantLinear,
    rope: Rope,
    caches: Vec<LayerCache>,
    dtype: DType,
    device: Device,
    max_seq_len: usize,
    prefill_chunk: usize,
}

fn check_dims(origin: &str, what: &str, l: &Fused, n: usize, k: usize) -> Result<()> {
    if l.out_features() != n || l.in_features() != k {
        return Err(crate::errors::ConfigError::ShapeMismatch {
            origin: origin.to_string(),
            tensor: what.to_string(),
            found: vec![l.out_features(), l.in_features()],
            expected: vec![n, k],
        }
        .into());
    }
    Ok(())
}

fn load_vector(ckpt: &Checkpoint, name: &str, n: usize, dt: DType, dev: &Device) -> Result<Tensor> {
    let t = ckpt.get_checked(name, &[DType::BF16, DType::F16, DType::F32], &[n])?;
    Ok(t.to_tensor(dev)?.to_dtype(dt)?)
}

impl Llama {
    /// Loads a Hugging Face Llama folder (`config.json`, `model.safetensors` or a sharded
    /// index, and optionally ModelOpt's `hf_quant_config.json`) onto `device`.
    pub fn load(dir: impl AsRef<Path>, device: &Device, opts: &LoadOptions) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            bail!(
                "{}: not a model folder (it does not exist or is not a directory)",
                dir.display()
            );
        }
        let cfg = LlamaConfig::from_dir(dir)?;
        let quant = QuantConfig::from_dir(dir)?;
        // SAFETY: the checkpoint files are memory-mapped read-only; like every mmap-based
        // loader we rely on nobody rewriting them while the model is being loaded (the
        // tensors are copied into device memory before `ckpt` is dropped).
        let ckpt = unsafe { Checkpoint::open(dir) }
            .with_context(|| format!("{}: cannot open the weights", dir.display()))?;
        let dtype = opts.dtype.unwrap_or(if device.is_cpu() {
            DType::F32
        } else {
            DType::BF16
        });
        let max_seq_len = crate::validate::check_load(&cfg, dir, &ckpt, opts)?;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);

        let ename = "model.embed_tokens.weight";
        let e = ckpt.get(ename)?;
        if !e.dtype.is_float() {
            bail!("{}: `{ename}` is {:?}: quantized embeddings are not supported (ModelOpt keeps them in 16 bits)", ckpt.origin(), e.dtype);
        }
        if e.shape != [cfg.vocab_size, h] {
            return Err(crate::errors::ConfigError::ShapeMismatch {
                origin: ckpt.origin().to_string(),
                tensor: ename.to_string(),
                found: e.shape.clone(),
                expected: vec![cfg.vocab_size, h],
            }
            .into());
        }
        let embed_w = e.to_tensor(device)?.to_dtype(DType::BF16)?;

        let mut blocks = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let m = format!("{p}.mlp");
            let names = [
                format!("{a}.q_proj"),
                format!("{a}.k_proj"),
                format!("{a}.v_proj"),
            ];
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let qkv = Fused::load(&ckpt, &names, device, &quant)?;
            check_dims(
                ckpt.origin(),
                &format!("{a}.q_proj|k_proj|v_proj"),
                &qkv,
                (nh + 2 * nkv) * hd,
                h,
            )?;
            let o = QuantLinear::load(&ckpt, &format!("{a}.o_proj"), device, &quant)?;
            check_dims(
                ckpt.origin(),
                &format!("{a}.o_proj"),
                &Fused::One(o.clone()),
                h,
                nh * hd,
            )?;
            let gu = [format!("{m}.gate_proj"), format!("{m}.up_proj")];
            let gu: Vec<&str> = gu.iter().map(String::as_str).collect();
            let gate_up = Fused::load(&ckpt, &gu, device, &quant)?;
            check_dims(
                ckpt.origin(),
                &format!("{m}.gate_proj|up_proj"),
                &gate_up,
                2 * cfg.intermediate_size,
                h,
            )?;
            let down = QuantLinear::load(&ckpt, &format!("{m}.down_proj"), device, &quant)?;
            check_dims(
                ckpt.origin(),
                &format!("{m}.down_proj"),
                &Fused::One(down.clone()),
                h,
                cfg.intermediate_size,
            )?;
            // A bias the config promises must be there (never silently run without).
            let missing = |t: String| candle_fp4::error::CheckpointError::MissingTensor {
                file: ckpt.origin().to_string(),
                tensor: t,
            };
            if cfg.attention_bias && !qkv_has_bias(&qkv) {
                return Err(missing(format!("{a}.q_proj.bias")).into());
            }
            if cfg.mlp_bias && !(qkv_has_bias(&gate_up) && down.bias().is_some()) {
                return Err(missing(format!(
                    "{m}.gate_proj.bias / up_proj.bias / down_proj.bias"
                ))
                .into());
            }
            blocks.push(Block {
                attn_norm: load_vector(
                    &ckpt,
                    &format!("{p}.input_layernorm.weight"),
                    h,
                    dtype,
                    device,
                )?,
                qkv,
                o,
                mlp_norm: load_vector(
                    &ckpt,
                    &format!("{p}.post_attention_layernorm.weight"),
                    h,
                    dtype,
                    device,
                )?,
                gate_up,
                down,
            });
        }
        let norm = load_vector(&ckpt, "model.norm.weight", h, dtype, device)?;
        // Untied: `lm_head.weight` must be there (a missing one is an error naming it,
        // never a silent fallback to the embedding).
        let lm_head = if cfg.tie_word_embeddings {
            QuantLinear::from_bf16(embed_w.clone(), None)?
        } else {
            let l = QuantLinear::load(&ckpt, "lm_head", device, &quant)?;
            check_dims(
                ckpt.origin(),
                "lm_head",
                &Fused::One(l.clone()),
                cfg.vocab_size,
                h,
            )?;
            l
        };
        let rope = Rope::new(&cfg, max_seq_len, dtype, device)?;
        let caches = (0..cfg.num_hidden_layers)
            .map(|_| LayerCache::new(opts.kv_cache, nkv, hd, max_seq_len, opts.kv_window, device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            cfg,
            quant,
            embed: embed_w,
            blocks,
            norm,
            lm_head,
            rope,
            caches,
            dtype,
            device: device.clone(),
            max_seq_len,
            prefill_chunk: opts.prefill_chunk.max(1),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    pub fn quant_config(&self) -> &QuantConfig {
        &self.quant
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Tokens the KV cache can hold.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// Tokens in the KV cache.
    pub fn cached_len(&self) -> usize {
        self.caches.first().map_or(0, LayerCache::len)
    }

    pub fn kv_cache_kind(&self) -> KvCacheKind {
        self.caches
            .first()
            .map_or(KvCacheKind::Bf16, LayerCache::kind)
    }

    /// KV-cache bytes per token (all layers).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.caches.iter().map(LayerCache::bytes_per_token).sum()
    }

    /// How many of the model's Linear layers hold NVFP4 weights, out of all.
    pub fn nvfp4_layer_count(&self) -> (usize, usize) {
        let mut all: Vec<&QuantLinear> = vec![&self.lm_head];
        for b in &self.blocks {
            for f in [&b.qkv, &b.gate_up] {
                match f {
                    Fused::One(l) => all.push(l),
                    Fused::Split(ls) => all.extend(ls.iter()),
                }
            }
            all.push(&b.o);
            all.push(&b.down);
        }
        (all.iter().filter(|l| l.is_nvfp4()).count(), all.len())
    }

    /// Empties the KV cache.
    pub fn reset(&mut self) -> Result<()> {
        for c in &mut self.caches {
            c.reset()?;
        }
        Ok(())
    }

    /// Runs `tokens` at positions `position..position + tokens.len()` and returns the
    /// logits of the last one, F32 `[vocab]`. `position` is the number of cached tokens
    /// (continue) or 0 (start over).
    pub fn forward(&mut self, tokens: &[u32], position: usize) -> Result<Tensor> {
        let h = self.run(tokens, position)?;
        let last = h.narrow(0, h.dim(0)? - 1, 1)?;
        Ok(self.logits(&last)?.squeeze(0)?)
    }

    /// Like [`forward`](Self::forward) but returns the logits of every token, F32
    /// `[tokens.len(), vocab]`.
    pub fn forward_all(&mut self, tokens: &[u32], position: usize) -> Result<Tensor> {
        let h = self.run(tokens, position)?;
        let mut out = vec![];
        for s in (0..h.dim(0)?).step_by(crate::MAX_LOGIT_ROWS) {
            let n = crate::MAX_LOGIT_ROWS.min(h.dim(0)? - s);
            out.push(self.logits(&h.narrow(0, s, n)?)?);
        }
        Ok(Tensor::cat(&out, 0)?)
    }

    fn logits(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let x = candle_nn::ops::rms_norm(h, &self.norm, self.cfg.rms_norm_eps as f32)?;
        self.lm_head.forward(&x)?.to_dtype(DType::F32)
    }

    /// The final hidden states (before the last norm) of `tokens`, `[t, hidden]`.
    fn run(&mut self, tokens: &[u32], position: usize) -> Result<Tensor> {
        if tokens.is_empty() {
            bail!("forward: no tokens");
        }
        let cached = self.cached_len();
        if position > cached {
            bail!("forward: position {position} is past the {cached} cached tokens");
        }
        if position + tokens.len() > self.max_seq_len {
            bail!(
                "{} tokens at position {position} exceed the context of {} tokens{}",
                tokens.len(),
                self.max_seq_len,
                if self.max_seq_len < self.cfg.max_position_embeddings {
                    " (raise max_seq_len, up to max_position_embeddings)"
                } else {
                    " (the model's max_position_embeddings)"
                }
            );
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary of {}",
                self.cfg.vocab_size
            );
        }
        if position != cached {
            if position != 0 {
                bail!("forward: position {position} would rewind the KV cache of {cached} tokens; only 0 (start over) or {cached} (continue) are supported");
            }
            self.reset()?;
        }
        let mut outs = vec![];
        let mut pos = position;
        for chunk in tokens.chunks(self.prefill_chunk) {
            outs.push(self.run_chunk(chunk, pos)?);
            pos += chunk.len();
        }
        Ok(if outs.len() == 1 {
            outs.pop().unwrap()
        } else {
            Tensor::cat(&outs, 0)?
        })
    }

    fn run_chunk(&mut self, tokens: &[u32], pos: usize) -> candle_core::Result<Tensor> {
        let t = tokens.len();
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?.to_dtype(self.dtype)?;
        let mask = causal_mask(t, pos, &self.device)?;
        for (b, cache) in self.blocks.iter().zip(self.caches.iter_mut()) {
            x = block_forward(
                &self.cfg,
                &self.rope,
                b,
                &x,
                pos,
                cache,
                mask.as_ref(),
                self.dtype,
                None,
            )?;
        }
        Ok(x)
    }

    /// Calibration: the embeddings of `tokens`, `[t, hidden]` in the activation dtype.
    pub(crate) fn calib_embed(&self, tokens: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary of {}",
                self.cfg.vocab_size
            );
        }
        let ids = Tensor::new(tokens, &self.device)?;
        Ok(self.embed.index_select(&ids, 0)?.to_dtype(self.dtype)?)
    }

    /// Calibration: block `i` alone over the hidden states `x` `[t, hidden]` of one
    /// sequence starting at position 0 (its KV cache is emptied first), optionally
    /// capturing the inputs of its Linears. Returns the block's output.
    pub(crate) fn calib_block(
        &mut self,
        i: usize,
        x: &Tensor,
        capture: Option<&mut BlockInputs>,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        if i >= self.blocks.len() || t == 0 || t > self.max_seq_len {
            bail!(
                "calib_block: block {i} of {}, {t} tokens (context {})",
                self.blocks.len(),
                self.max_seq_len
            );
        }
        let cache = &mut self.caches[i];
        cache.reset()?;
        let mask = causal_mask(t, 0, &self.device)?;
        let y = block_forward(
            &self.cfg,
            &self.rope,
            &self.blocks[i],
            x,
            0,
            cache,
            mask.as_ref(),
            self.dtype,
            capture,
        )?;
        cache.reset()?;
        Ok(y)
    }

    /// Calibration (AWQ): divides the RMSNorm weight in front of `site` (q/k/v: the
    /// attention norm; gate/up: the MLP norm) of block `i` by `s`, rounded once to BF16
    /// (the checkpoint's dtype for norms). Returns the new weight's values.
    pub(crate) fn scale_norm(&mut self, i: usize, site: Site, s: &[f32]) -> Result<Vec<f32>> {
        let Some(b) = self.blocks.get_mut(i) else {
            bail!("scale_norm: no block {i}");
        };
        let norm = match site {
            Site::Qkv => &mut b.attn_norm,
            Site::GateUp => &mut b.mlp_norm,
            _ => bail!("scale_norm: {site:?} has no norm in front"),
        };
        let g = norm.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if g.len() != s.len() {
            bail!("scale_norm: {} scales for a norm of {}", s.len(), g.len());
        }
        let v: Vec<f32> = g
            .iter()
            .zip(s)
            .map(|(g, s)| half::bf16::from_f32(g / s).to_f32())
            .collect();
        *norm = Tensor::from_slice(&v, v.len(), &self.device)?.to_dtype(norm.dtype())?;
        Ok(v)
    }

    /// The embeddings of `tokens`, `[t, hidden]` in the activation dtype (the input of
    /// block 0; see [`block_output`](Self::block_output)).
    pub fn embed_tokens(&self, tokens: &[u32]) -> Result<Tensor> {
        self.calib_embed(tokens)
    }

    /// Block `i` alone over the hidden states `x` `[t, hidden]` of one sequence starting
    /// at position 0 (the inference forward of that block; the KV cache is left empty).
    pub fn block_output(&mut self, i: usize, x: &Tensor) -> Result<Tensor> {
        self.calib_block(i, x, None)
    }

    /// Block `i`'s norms and projections for the differentiable forward of norm tweaking
    /// ([`crate::norm_tweak::BlockParams`]).
    pub fn block_params(&self, i: usize) -> Result<crate::norm_tweak::BlockParams> {
        use crate::norm_tweak::{BlockParams, DiffLinear};
        let Some(b) = self.blocks.get(i) else {
            bail!("block_params: no block {i}");
        };
        let fused = |f: &Fused| -> Result<Vec<DiffLinear>> {
            match f {
                Fused::One(l) => Ok(vec![DiffLinear::from_quant_linear(l)?]),
                Fused::Split(ls) => ls.iter().map(DiffLinear::from_quant_linear).collect(),
            }
        };
        BlockParams::new(
            &self.cfg,
            b.attn_norm.to_dtype(DType::F32)?.to_vec1::<f32>()?,
            b.mlp_norm.to_dtype(DType::F32)?.to_vec1::<f32>()?,
            fused(&b.qkv)?,
            DiffLinear::from_quant_linear(&b.o)?,
            fused(&b.gate_up)?,
            DiffLinear::from_quant_linear(&b.down)?,
        )
    }

    /// Calibration (norm tweaking): sets block `i`'s two norm weights.
    pub(crate) fn set_block_norms(&mut self, i: usize, attn: &[f32], mlp: &[f32]) -> Result<()> {
        let h = self.cfg.hidden_size;
        let Some(b) = self.blocks.get_mut(i) else {
            bail!("set_block_norms: no block {i}");
        };
        if attn.len() != h || mlp.len() != h {
            bail!(
                "set_block_norms: {} and {} values for hidden size {h}",
                attn.len(),
                mlp.len()
            );
        }
        b.attn_norm = Tensor::from_slice(attn, h, &self.device)?.to_dtype(b.attn_norm.dtype())?;
        b.mlp_norm = Tensor::from_slice(mlp, h, &self.device)?.to_dtype(b.mlp_norm.dtype())?;
        Ok(())
    }

    /// Calibration: replaces the Linears of `site` in block `i` by `layers` (q, k, v or
    /// gate, up in that order for the fused sites), keeping their biases.
    pub(crate) fn replace_linears(
        &mut self,
        i: usize,
        site: Site,
        layers: Vec<QuantLinear>,
    ) -> Result<()> {
        let Some(b) = self.blocks.get_mut(i) else {
            bail!("replace_linears: no block {i}");
        };
        let old: Vec<&QuantLinear> = match site {
            Site::Qkv | Site::GateUp => {
                let f = if site == Site::Qkv {
                    &b.qkv
                } else {
                    &b.gate_up
                };
                match f {
                    Fused::One(l) => vec![l],
                    Fused::Split(ls) => ls.iter().collect(),
                }
            }
            Site::O => vec![&b.o],
            Site::Down => vec![&b.down],
        };
        let old_n: usize = old.iter().map(|l| l.out_features()).sum();
        let new_n: usize = layers.iter().map(QuantLinear::out_features).sum();
        if old_n != new_n
            || layers
                .iter()
                .any(|l| l.in_features() != old[0].in_features())
        {
            bail!("replace_linears: block {i} {site:?}: the new layers do not have the old shapes");
        }
        // Biases: the old layers' (fused or not), cut to the new layers' rows.
        let bias = old
            .iter()
            .filter_map(|l| l.bias().cloned())
            .collect::<Vec<_>>();
        let bias = if bias.is_empty() {
            None
        } else {
            Some(Tensor::cat(&bias, 0)?)
        };
        let mut start = 0;
        let mut new = Vec::with_capacity(layers.len());
        for l in layers {
            let n = l.out_features();
            new.push(match (&bias, l.bias()) {
                (Some(bb), None) => rebias(&l, Some(bb.narrow(0, start, n)?))?,
                _ => l,
            });
            start += n;
        }
        match site {
            Site::Qkv => b.qkv = Fused::Split(new),
            Site::GateUp => b.gate_up = Fused::Split(new),
            Site::O | Site::Down => {
                let l = new.pop().context("replace_linears: no layer given")?;
                if site == Site::O {
                    b.o = l;
                } else {
                    b.down = l;
                }
            }
        }
        Ok(())
    }
}

/// `l` with bias `bias` (an NVFP4 or BF16 layer rebuilt with the same weight).
fn rebias(l: &QuantLinear, bias: Option<Tensor>) -> Result<QuantLinear> {
    Ok(match l.to_nvfp4()? {
        Some(q) => QuantLinear::from_nvfp4(&q, bias, l.device())?,
        None => QuantLinear::from_bf16(l.dequantize()?, bias)?,
    })
}

/// The Linears of a decoder block that see the same input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Site {
    /// q/k/v_proj: the attention norm's output.
    Qkv,
    /// o_proj: the attention heads' output.
    O,
    /// gate/up_proj: the MLP norm's output.
    GateUp,
    /// down_proj: `silu(gate)·up`.
    Down,
}

/// The inputs of a block's Linears, captured for calibration, in BF16 (what the
/// projections multiply).
#[derive(Debug, Default)]
pub(crate) struct BlockInputs {
    pub qkv: Option<Tensor>,
    pub o: Option<Tensor>,
    pub gate_up: Option<Tensor>,
    pub down: Option<Tensor>,
}

impl BlockInputs {
    pub fn get(&self, site: Site) -> Option<&Tensor> {
        match site {
            Site::Qkv => self.qkv.as_ref(),
            Site::O => self.o.as_ref(),
            Site::GateUp => self.gate_up.as_ref(),
            Site::Down => self.down.as_ref(),
        }
    }
}

/// The additive causal mask of `t` tokens at positions `pos..pos + t` over `pos + t`
/// keys, `[t, pos + t]`; none for a single token.
fn causal_mask(t: usize, pos: usize, device: &Device) -> candle_core::Result<Option<Tensor>> {
    if t <= 1 {
        return Ok(None);
    }
    let l = pos + t;
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..l).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Some(Tensor::from_vec(m, (t, l), device)?))
}

/// One decoder block over `x` `[t, hidden]` at positions `pos..pos + t`.
#[allow(clippy::too_many_arguments)]
fn block_forward(
    cfg: &LlamaConfig,
    rope: &Rope,
    b: &Block,
    x: &Tensor,
    pos: usize,
    cache: &mut LayerCache,
    mask: Option<&Tensor>,
    dtype: DType,
    mut capture: Option<&mut BlockInputs>,
) -> candle_core::Result<Tensor> {
    let eps = cfg.rms_norm_eps as f32;
    let h = candle_nn::ops::rms_norm(x, &b.attn_norm, eps)?;
    if let Some(c) = capture.as_deref_mut() {
        c.qkv = Some(h.to_dtype(DType::BF16)?);
    }
    let o_in = capture.as_deref_mut().map(|c| &mut c.o);
    let a = attention(cfg, rope, b, &h, pos, cache, mask, dtype, o_in)?;
    let x = (x + a)?;
    let h = candle_nn::ops::rms_norm(&x, &b.mlp_norm, eps)?;
    if let Some(c) = capture.as_deref_mut() {
        c.gate_up = Some(h.to_dtype(DType::BF16)?);
    }
    let m = b.gate_up.forward_silu_mul(&h)?;
    if let Some(c) = capture {
        c.down = Some(m.to_dtype(DType::BF16)?);
    }
    x + b.down.forward(&m)?
}

fn qkv_has_bias(f: &Fused) -> bool {
    match f {
        Fused::One(l) => l.bias().is_some(),
        Fused::Split(ls) => ls[0].bias().is_some(),
    }
}

/// Grouped-query attention of `x` `[t, hidden]` at positions `pos..pos + t`.
#[allow(clippy::too_many_arguments)]
fn attention(
    cfg: &LlamaConfig,
    rope: &Rope,
    b: &Block,
    x: &Tensor,
    pos: usize,
    cache: &mut LayerCache,
    mask: Option<&Tensor>,
    dtype: DType,
    o_in: Option<&mut Option<Tensor>>,
) -> candle_core::Result<Tensor> {
    let t = x.dim(0)?;
    let (nh, nkv, hd) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let n_rep = nh / nkv;
    let qkv = b.qkv.forward(x)?;
    let heads = |start: usize, n: usize| -> candle_core::Result<Tensor> {
        qkv.narrow(1, start * hd, n * hd)?
            .reshape((t, n, hd))?
            .transpose(0, 1)?
            .contiguous()
    };
    let q = rope.apply(&heads(0, nh)?.unsqueeze(0)?, pos)?.squeeze(0)?;
    let k = rope
        .apply(&heads(nh, nkv)?.unsqueeze(0)?, pos)?
        .squeeze(0)?;
    let v = heads(nh + nkv, nkv)?;
    if t == 1 {
        // Decode: the cache stores the token, then attends over everything it holds.
        let y = cache.decode(&k, &v, &q)?; // [nh, hd] BF16
        let y = y.reshape((1, nh * hd))?.to_dtype(dtype)?;
        if let Some(c) = o_in {
            *c = Some(y.to_dtype(DType::BF16)?);
        }
        return b.o.forward(&y);
    }
    let (ka, va) = cache.prefill(&k, &v)?; // [nkv, l, hd] BF16
    let l = ka.dim(1)?;
    // Query heads h·n_rep..(h+1)·n_rep share KV head h: [nkv, n_rep·t, hd].
    let q = q.reshape((nkv, n_rep * t, hd))?;
    let ka = ka.to_dtype(dtype)?.contiguous()?;
    let va = va.to_dtype(dtype)?.contiguous()?;
    let scale = 1.0 / (hd as f64).sqrt();
    let mut att = (q.matmul(&ka.t()?)? * scale)?.to_dtype(DType::F32)?;
    if let Some(m) = mask {
        att = att
            .reshape((nkv, n_rep, t, l))?
            .broadcast_add(m)?
            .reshape((nkv, n_rep * t, l))?;
    }
    let att = candle_nn::ops::softmax_last_dim(&att)?.to_dtype(dtype)?;
    let y = att.matmul(&va)?; // [nkv, n_rep·t, hd]
    let y = y
        .reshape((nh, t, hd))?
        .transpose(0, 1)?
        .reshape((t, nh * hd))?;
    if let Some(c) = o_in {
        *c = Some(y.to_dtype(DType::BF16)?);
    }
    b.o.forward(&y)
}
