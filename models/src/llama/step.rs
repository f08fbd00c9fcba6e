//! The batched decode step: one token of every sequence through the whole model
//! (embedding gather → every [`Block`] → final norm → `lm_head` → greedy argmax), reading
//! everything that changes per step from device buffers ([`StepBuffers`]: token ids and
//! positions) and the KV caches' device lengths, so that on CUDA the step is captured once
//! in a CUDA graph ([`super::graph`]) and replayed at every position up to the capacity.
//!
//! The step writes its own next inputs: the argmax into `ids` and `positions + 1` into
//! `positions`, so greedy decoding replays the graph with no host write at all; only the new
//! token ids (or the logits when sampling) are read back.

use super::block::Block;
use crate::kv_cache::LayerCache;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_fp4::quant_linear::QuantLinear;

/// The device buffers a step reads and writes, allocated once per model (a captured graph
/// holds their addresses).
#[derive(Debug)]
pub(crate) struct StepBuffers {
    /// U32 `[batch]`: the tokens the next step feeds (the last step's argmax, or written by
    /// the host).
    pub ids: Tensor,
    /// U32 `[batch]`: each sequence's position in the next step (its cached length).
    pub positions: Tensor,
    /// F32 `[batch, vocab]`: the last logits step's logits.
    pub logits: Tensor,
    /// What `positions` holds on the device (the host's mirror of it).
    pub positions_host: Vec<usize>,
    /// Whether `ids` holds the last step's argmax (greedy continuation without a host write).
    pub ids_are_argmax: bool,
}

impl StepBuffers {
    pub(crate) fn new(batch: usize, vocab: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            ids: Tensor::zeros(batch, DType::U32, device)?,
            positions: Tensor::zeros(batch, DType::U32, device)?,
            logits: Tensor::zeros((batch, vocab), DType::F32, device)?,
            positions_host: vec![0; batch],
            ids_are_argmax: false,
        })
    }

    /// Writes `tokens` into `ids` (outside any capture).
    pub(crate) fn set_ids(&mut self, tokens: &[u32]) -> Result<()> {
        let t = Tensor::new(tokens, self.ids.device())?;
        self.ids.slice_set(&t, 0, 0)?;
        self.ids_are_argmax = false;
        Ok(())
    }

    /// Makes `positions` hold `lens` (a host write only when they differ from what the
    /// device holds).
    pub(crate) fn set_positions(&mut self, lens: &[usize]) -> Result<()> {
        if self.positions_host != lens {
            let v: Vec<u32> = lens.iter().map(|&n| n as u32).collect();
            let t = Tensor::new(v.as_slice(), self.positions.device())?;
            self.positions.slice_set(&t, 0, 0)?;
            self.positions_host = lens.to_vec();
        }
        Ok(())
    }
}

/// The parts of a model one step runs through (borrowed from [`super::Llama`]).
pub(crate) struct StepModel<'a> {
    pub embed: &'a Tensor,
    pub blocks: &'a [Block],
    pub caches: &'a mut [LayerCache],
    pub norm: &'a Tensor,
    pub lm_head: &'a QuantLinear,
    pub eps: f32,
    pub dtype: DType,
}

/// What a step leaves behind besides the next ids and positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepOutput {
    /// Only the greedy next tokens.
    Greedy,
    /// The greedy next tokens and the logits (for sampling or scoring).
    Logits,
}

/// One step over the buffers: every launch reads its per-step inputs from the device.
/// `for_graph`: the attention's splits are planned for the caches' capacity (the launches a
/// captured graph replays); otherwise for the longest sequence.
pub(crate) fn run_step(
    m: &mut StepModel<'_>,
    bufs: &StepBuffers,
    out: StepOutput,
    for_graph: bool,
) -> candle_core::Result<()> {
    let batch = bufs.ids.dim(0)?;
    let mut x = m.embed.index_select(&bufs.ids, 0)?.to_dtype(m.dtype)?;
    for (b, cache) in m.blocks.iter().zip(m.caches.iter_mut()) {
        x = b.forward_decode(&x, &bufs.positions, cache, for_graph)?;
    }
    let x = candle_nn::ops::rms_norm(&x, m.norm, m.eps)?;
    let logits = m.lm_head.forward(&x)?.to_dtype(DType::F32)?;
    let next = logits.argmax_keepdim(1)?.reshape(batch)?;
    bufs.ids.slice_set(&next, 0, 0)?;
    bufs.positions
        .slice_set(&bufs.positions.affine(1.0, 1.0)?, 0, 0)?;
    if out == StepOutput::Logits {
        bufs.logits.slice_set(&logits, 0, 0)?;
    }
    Ok(())
}

/// Checks that every sequence has room for one more token and returns the batch.
pub(crate) fn check_room(caches: &[LayerCache], capacity: usize) -> Result<usize> {
    let Some(first) = caches.first() else {
        bail!("decode: the model has no layers")
    };
    let lens = first.lens();
    if let Some((i, &n)) = lens.iter().enumerate().find(|(_, &n)| n >= capacity) {
        bail!("decode: sequence {i} holds {n} tokens, the context of {capacity} is full")
    }
    Ok(lens.len())
}
