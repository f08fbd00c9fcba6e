//! Llama (Llama 2, Llama 3 / 3.1, SmolLM2, …) on [`QuantLinear`]: every projection is
//! NVFP4 or BF16 as the checkpoint's quant config says; q|k|v and gate|up are fused into
//! one layer each (gate|up runs the GEMV's `silu_mul` epilogue); grouped-query attention
//! over a preallocated [`LayerCache`]; tied or separate `lm_head`.
//!
//! Numerics: activations (residual stream, norms, RoPE, attention) in `dtype` (F32 by
//! default on CPU, BF16 on CUDA); every projection takes BF16 input and returns BF16
//! (see `QuantLinear`); softmax in F32; logits returned as F32.
//!
//! Modules, in the style of candle-transformers' `llama.rs` (each with `load` and
//! `forward`): [`Llama`] holds the embeddings, the [`Block`]s, the final norm, `lm_head`
//! and one KV cache per layer; a [`Block`] holds its two norms, an [`Attention`] and an
//! [`Mlp`]; every `load` reads from a [`Loader`] (checkpoint, quant config, activation
//! dtype, device). Each module's `forward_captured` also reports the input of every Linear
//! group to a [`LinearInputs`] hook ([`Site`] says which group); the quantizer's
//! calibration collects its Hessians that way ([`Llama::block_output_captured`]) and
//! puts quantized layers back with [`Block::set_linears`] ([`Llama::block_mut`]).

mod attention;
mod block;
mod capture;
#[cfg(feature = "cuda")]
mod graph;
mod linear;
mod lm_head;
mod mlp;
mod norm;
mod options;
mod parts;
pub mod random;
mod step;

use attention::causal_mask;
pub use attention::Attention;
pub use block::Block;
pub use capture::{ignore_inputs, LinearInputs, Site};
pub use linear::Loader;
pub use lm_head::LmHead;
pub use mlp::Mlp;
use norm::RmsNorm;
pub use options::{LoadOptions, DEFAULT_KV_WINDOW};
use parts::Parts;
pub use step::StepOutput;
use step::{check_room, run_step, StepBuffers, StepModel};

use crate::config::LlamaConfig;
use crate::kv_cache::LayerCache;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_fp4::knobs::GemvKnobs;
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4::quant_config::QuantConfig;
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4::tensor_parallel::AllReduce;
use std::path::Path;
use std::sync::Arc;

/// Rows of hidden states sent through `lm_head` at once by [`Llama::forward_all`].
pub const MAX_LOGIT_ROWS: usize = 32;

/// A Llama model with its KV cache.
#[derive(Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    quant: QuantConfig,
    embed: Tensor,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: LmHead,
    caches: Vec<LayerCache>,
    dtype: DType,
    device: Device,
    max_seq_len: usize,
    prefill_chunk: usize,
    cuda_graph: bool,
    /// The decode step's device buffers, made at the first batched decode.
    step_buffers: Option<step::StepBuffers>,
    #[cfg(feature = "cuda")]
    graphs: graph::Graphs,
}

impl Llama {
    /// Loads a Hugging Face Llama folder (`config.json`, `model.safetensors` or a sharded
    /// index, and optionally ModelOpt's `hf_quant_config.json`) onto `device`.
    pub fn load(dir: impl AsRef<Path>, device: &Device, opts: &LoadOptions) -> Result<Self> {
        let dtype = opts.activation_dtype(device);
        let (parts, max_seq_len) = Parts::read(dir.as_ref(), device, dtype, opts)?;
        Self::assemble(parts, dtype, max_seq_len, opts, device)
    }

    /// Rank `reduce.shard()` of a tensor-parallel model (Megatron: q|k|v and gate|up
    /// column-parallel, o_proj and down_proj row-parallel with their outputs summed over
    /// the ranks by `reduce`, KV heads split, the rest replicated) from the folder `dir`,
    /// read on the host and sharded onto `device`; caches for the rank's KV heads.
    pub fn load_sharded(
        dir: impl AsRef<Path>,
        device: &Device,
        opts: &LoadOptions,
        reduce: Arc<dyn AllReduce>,
    ) -> Result<Self> {
        let dtype = opts.activation_dtype(device);
        let (full, max_seq_len) = Parts::read(dir.as_ref(), &Device::Cpu, dtype, opts)?;
        let parts = full.shard(reduce, max_seq_len, dtype, device)?;
        Self::assemble(parts, dtype, max_seq_len, opts, device)
    }

    /// The model from its modules: makes the KV caches of `opts` for `max_seq_len` tokens.
    pub(crate) fn assemble(
        parts: Parts,
        dtype: DType,
        max_seq_len: usize,
        opts: &LoadOptions,
        device: &Device,
    ) -> Result<Self> {
        let Parts {
            cfg,
            quant,
            embed,
            blocks,
            norm,
            lm_head,
        } = parts;
        let norm = RmsNorm::new(norm, cfg.rms_norm_eps as f32)?;
        let (mut blocks, mut lm_head) = (blocks, lm_head);
        if opts.knobs.gemv != GemvKnobs::default() && device.is_cuda() {
            for l in blocks.iter_mut().flat_map(|b| b.linears_mut()) {
                l.set_gemv_knobs(&opts.knobs.gemv)?;
            }
            lm_head.linear_mut().set_gemv_knobs(&opts.knobs.gemv)?;
        }
        for l in blocks.iter_mut().flat_map(|b| b.linears_mut()) {
            l.set_l2_prefetch(opts.knobs.l2_prefetch);
        }
        let (nkv, hd) = (cfg.num_key_value_heads, cfg.head_dim);
        if opts.batch == 0 {
            bail!("LoadOptions::batch must be at least 1")
        }
        let caches = (0..cfg.num_hidden_layers)
            .map(|_| {
                let mut c = LayerCache::new(
                    opts.kv_cache,
                    (opts.batch, nkv, hd),
                    max_seq_len,
                    opts.kv_window,
                    device,
                )?;
                c.set_decode_options(opts.knobs.attention);
                Ok(c)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            cfg,
            quant,
            embed,
            blocks,
            norm,
            lm_head,
            caches,
            dtype,
            device: device.clone(),
            max_seq_len,
            prefill_chunk: opts.prefill_chunk.max(1),
            cuda_graph: opts.cuda_graph,
            step_buffers: None,
            #[cfg(feature = "cuda")]
            graphs: Default::default(),
        })
    }

    /// A model of `cfg`'s shapes with seeded random weights built directly on `device`
    /// ([`random::RandomSpec`]; for benchmarks: no checkpoint), `lm_head` and the embeddings
    /// BF16 (tied when `cfg` says so); caches and options as [`Llama::load`] makes them.
    pub fn random(
        cfg: LlamaConfig,
        spec: random::RandomSpec,
        opts: &LoadOptions,
        device: &Device,
    ) -> Result<Self> {
        Self::random_sharded(cfg, spec, opts, device, None)
    }

    /// [`random`](Self::random), or with `reduce` rank `reduce.shard()` of it sharded as
    /// [`load_sharded`](Self::load_sharded) shards (the whole model drawn on the host, so
    /// every rank's shard is of the same weights).
    pub fn random_sharded(
        cfg: LlamaConfig,
        spec: random::RandomSpec,
        opts: &LoadOptions,
        device: &Device,
        reduce: Option<Arc<dyn AllReduce>>,
    ) -> Result<Self> {
        let dtype = opts.activation_dtype(device);
        let max_seq_len = random::max_seq_len(&cfg, opts)?;
        let parts = match reduce {
            None => random::random_parts(cfg, spec, dtype, max_seq_len, device, None)?,
            // Every rank draws the whole model on the host (the same seed, so the same
            // weights) and keeps its shard.
            Some(r) => random::random_parts(cfg, spec, dtype, max_seq_len, &Device::Cpu, None)?
                .shard(r, max_seq_len, dtype, device)?,
        };
        Self::assemble(parts, dtype, max_seq_len, opts, device)
    }

    /// Rank `reduce.shard()` of a tensor-parallel model of `cfg`'s shapes whose shard is
    /// drawn directly on `device` ([`random`](Self::random) in the rank's shapes, its own
    /// weights, not a slice of one model's: for benchmarks of models that do not fit the
    /// host), summing its o_proj and down_proj outputs over the ranks with `reduce`; its
    /// `lm_head` is its own slice of the vocabulary where that splits (as
    /// [`load_sharded`](Self::load_sharded) splits it).
    pub fn random_rank(
        cfg: LlamaConfig,
        spec: random::RandomSpec,
        opts: &LoadOptions,
        device: &Device,
        reduce: Arc<dyn AllReduce>,
    ) -> Result<Self> {
        let (local, _) = Parts::rank_config(&cfg, reduce.shard())?;
        let dtype = opts.activation_dtype(device);
        let max_seq_len = random::max_seq_len(&local, opts)?;
        let mut parts =
            random::random_parts(local, spec, dtype, max_seq_len, device, Some(&reduce))?;
        for b in &mut parts.blocks {
            b.set_reduce(reduce.clone());
        }
        Self::assemble(parts, dtype, max_seq_len, opts, device)
    }

    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The checkpoint's quantization settings.
    pub fn quant_config(&self) -> &QuantConfig {
        &self.quant
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The activation dtype.
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

    /// The KV cache's storage.
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
        let mut all: Vec<&QuantLinear> = vec![self.lm_head.linear()];
        for b in &self.blocks {
            all.extend(b.linears());
        }
        (all.iter().filter(|l| l.is_nvfp4()).count(), all.len())
    }

    /// The `lm_head` (on a tensor-parallel rank: its slice of the vocabulary, when split).
    pub fn lm_head(&self) -> &LmHead {
        &self.lm_head
    }

    /// The decoder layers.
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// Decoder layer `i`, to change its weights ([`Block::set_linears`],
    /// [`Block::set_norm`]).
    pub fn block_mut(&mut self, i: usize) -> Result<&mut Block> {
        let n = self.blocks.len();
        // A captured decode step holds the old weights' addresses.
        #[cfg(feature = "cuda")]
        {
            self.graphs = Default::default();
        }
        self.blocks
            .get_mut(i)
            .with_context(|| format!("no block {i} (the model has {n})"))
    }

    /// Empties the KV cache.
    pub fn reset(&mut self) -> Result<()> {
        for c in &mut self.caches {
            c.reset()?;
        }
        Ok(())
    }

    /// Sequences the KV cache holds ([`LoadOptions::batch`]).
    pub fn batch(&self) -> usize {
        self.caches.first().map_or(1, LayerCache::batch)
    }

    /// Tokens cached for every sequence.
    pub fn sequence_lens(&self) -> Vec<usize> {
        self.caches
            .first()
            .map_or_else(Vec::new, |c| c.lens().to_vec())
    }

    /// Runs `tokens` through sequence `seq` of a batched cache, after the tokens it holds
    /// (the prompt of one sequence; [`forward`](Self::forward) is sequence 0), and returns the
    /// logits of the last one, F32 `[vocab]`.
    pub fn prefill_seq(&mut self, seq: usize, tokens: &[u32]) -> Result<Tensor> {
        for c in &mut self.caches {
            c.set_sequence(seq)?;
        }
        let pos = self.cached_len();
        let r = self.forward(tokens, pos);
        for c in &mut self.caches {
            c.set_sequence(0)?;
        }
        r
    }

    /// Benchmarks only: sets every sequence's cached length to `lens` without running the
    /// model ([`candle_fp4::kv_cache::KvCache::bench_set_lens`]: the skipped tokens read as
    /// zeros), so a decode benchmark runs at a 32k context without a 32k prefill.
    #[doc(hidden)]
    pub fn bench_set_sequence_lens(&mut self, lens: &[usize]) -> Result<()> {
        if lens.iter().any(|&n| n >= self.max_seq_len) {
            bail!(
                "bench_set_sequence_lens: {lens:?} must leave room in a context of {}",
                self.max_seq_len
            )
        }
        for c in &mut self.caches {
            c.bench_set_lens(lens)?;
        }
        Ok(())
    }

    /// Weight bytes a decode step reads: every projection's stored weight (codes and block
    /// scales, or BF16) and `lm_head`; the embedding rows gathered are negligible.
    pub fn weight_bytes(&self) -> usize {
        let mut all: Vec<&QuantLinear> = vec![self.lm_head.linear()];
        for b in &self.blocks {
            all.extend(b.linears());
        }
        all.iter().map(|l| l.weight_bytes()).sum()
    }

    /// Empties sequence `seq` of the KV cache.
    pub fn reset_seq(&mut self, seq: usize) -> Result<()> {
        for c in &mut self.caches {
            c.set_sequence(seq)?;
            let r = c.reset_sequence();
            c.set_sequence(0)?;
            r?;
        }
        Ok(())
    }

    /// One decode step of every sequence: feeds `tokens` (one per sequence, each at its
    /// cached length; `None` feeds the previous step's greedy choices, with no host write)
    /// and returns the greedy next token of each. On CUDA with [`LoadOptions::cuda_graph`]
    /// the step is a CUDA graph, recorded at the second call and replayed after; only the
    /// new token ids come back.
    pub fn decode_greedy(&mut self, tokens: Option<&[u32]>) -> Result<Vec<u32>> {
        self.decode_step(tokens, StepOutput::Greedy)?;
        let ids = self.buffers()?.ids.to_vec1::<u32>()?;
        Ok(ids)
    }

    /// Like [`decode_greedy`](Self::decode_greedy) but returns the logits, F32 `[batch,
    /// vocab]` (for sampling; the greedy choices are kept for a later `decode_greedy(None)`).
    pub fn decode_logits(&mut self, tokens: &[u32]) -> Result<Tensor> {
        self.decode_step(Some(tokens), StepOutput::Logits)?;
        Ok(self.buffers()?.logits.copy()?)
    }

    fn buffers(&self) -> Result<&StepBuffers> {
        self.step_buffers
            .as_ref()
            .context("decode: no step has run yet")
    }

    fn decode_step(&mut self, tokens: Option<&[u32]>, out: StepOutput) -> Result<()> {
        let batch = check_room(&self.caches, self.max_seq_len)?;
        if let Some(t) = tokens {
            if t.len() != batch {
                bail!("decode: {} tokens for a batch of {batch}", t.len());
            }
            self.check_vocab(t)?;
        }
        if self.step_buffers.is_none() {
            self.step_buffers = Some(StepBuffers::new(batch, self.cfg.vocab_size, &self.device)?);
        }
        let Self {
            embed,
            blocks,
            caches,
            norm,
            lm_head,
            dtype,
            step_buffers,
            ..
        } = self;
        let bufs = step_buffers.as_mut().context("decode: no step buffers")?;
        match tokens {
            Some(t) => bufs.set_ids(t)?,
            None if bufs.ids_are_argmax => {}
            None => bail!(
                "decode_greedy(None) continues from the last step's choices; the first step needs tokens"
            ),
        }
        bufs.set_positions(caches[0].lens())?;
        let mut m = StepModel {
            embed,
            blocks,
            caches,
            norm,
            lm_head,
            dtype: *dtype,
        };
        let graph = self.cuda_graph && self.device.is_cuda();
        if graph {
            #[cfg(feature = "cuda")]
            {
                let bufs = &*bufs;
                self.graphs
                    .run(&self.device, out, || run_step(&mut m, bufs, out, true))?;
            }
        } else {
            run_step(&mut m, bufs, out, false)?;
        }
        // Eager steps and recordings advanced the host lengths, replays the device's only.
        // The positions' mirror becomes the new lengths in place (no per-step allocation).
        bufs.positions_host.iter_mut().for_each(|n| *n += 1);
        for c in m.caches.iter_mut() {
            c.set_host_lens(&bufs.positions_host)?;
        }
        bufs.ids_are_argmax = true;
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
        for s in (0..h.dim(0)?).step_by(MAX_LOGIT_ROWS) {
            let n = MAX_LOGIT_ROWS.min(h.dim(0)? - s);
            out.push(self.logits(&h.narrow(0, s, n)?)?);
        }
        Ok(Tensor::cat(&out, 0)?)
    }

    /// The embeddings of `tokens`, `[t, hidden]` in the activation dtype (the input of
    /// block 0; see [`block_output`](Self::block_output)).
    pub fn embed_tokens(&self, tokens: &[u32]) -> Result<Tensor> {
        self.check_vocab(tokens)?;
        let ids = Tensor::new(tokens, &self.device)?;
        Ok(self.embed.index_select(&ids, 0)?.to_dtype(self.dtype)?)
    }

    /// Block `i` alone over the hidden states `x` `[t, hidden]` of one sequence starting
    /// at position 0 (the inference forward of that block; the KV cache is left empty).
    pub fn block_output(&mut self, i: usize, x: &Tensor) -> Result<Tensor> {
        self.block_output_captured(i, x, &mut ignore_inputs)
    }

    /// [`block_output`](Self::block_output), reporting the input of each of the block's
    /// Linear groups to `hook` (what calibration collects).
    pub fn block_output_captured(
        &mut self,
        i: usize,
        x: &Tensor,
        hook: &mut LinearInputs<'_>,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        if i >= self.blocks.len() || t == 0 || t > self.max_seq_len {
            bail!(
                "block_output: block {i} of {}, {t} tokens (context {})",
                self.blocks.len(),
                self.max_seq_len
            );
        }
        let cache = &mut self.caches[i];
        cache.reset()?;
        let mask = causal_mask(t, 0, &self.device)?;
        let y = self.blocks[i].forward_captured(x, 0, mask.as_ref(), cache, hook)?;
        cache.reset()?;
        Ok(y)
    }

    fn check_vocab(&self, tokens: &[u32]) -> Result<()> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary of {}",
                self.cfg.vocab_size
            );
        }
        Ok(())
    }

    /// The logits of final hidden states `h` `[t, hidden]` (the last norm and `lm_head`,
    /// in rows of [`MAX_LOGIT_ROWS`] as [`forward_all`](Self::forward_all)), F32
    /// `[t, vocab]`: the end of a model run block by block with
    /// [`block_output`](Self::block_output).
    pub fn logits_of(&self, h: &Tensor) -> Result<Tensor> {
        let mut out = vec![];
        for s in (0..h.dim(0)?).step_by(MAX_LOGIT_ROWS) {
            let n = MAX_LOGIT_ROWS.min(h.dim(0)? - s);
            out.push(self.logits(&h.narrow(0, s, n)?)?);
        }
        Ok(Tensor::cat(&out, 0)?)
    }

    fn logits(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let x = self.norm.forward(h)?;
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
        self.check_vocab(tokens)?;
        if let Some(b) = &mut self.step_buffers {
            b.ids_are_argmax = false; // the next decode step needs its tokens again
        }
        if position != cached {
            if position != 0 {
                bail!("forward: position {position} would rewind the KV cache of {cached} tokens; only 0 (start over) or {cached} (continue) are supported");
            }
            for c in &mut self.caches {
                c.reset_sequence()?;
            }
        }
        let mut outs = vec![];
        let mut pos = position;
        for chunk in tokens.chunks(self.prefill_chunk) {
            outs.push(self.run_chunk(chunk, pos)?);
            pos += chunk.len();
        }
        match outs.len() {
            1 => Ok(outs.remove(0)),
            _ => Ok(Tensor::cat(&outs, 0)?),
        }
    }

    fn run_chunk(&mut self, tokens: &[u32], pos: usize) -> candle_core::Result<Tensor> {
        let t = tokens.len();
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?.to_dtype(self.dtype)?;
        let mask = causal_mask(t, pos, &self.device)?;
        for (b, cache) in self.blocks.iter().zip(self.caches.iter_mut()) {
            x = b.forward(&x, pos, mask.as_ref(), cache)?;
        }
        Ok(x)
    }
}
