//! The batched decode step: one token of every sequence through the whole model
//! (embedding gather → every [`Block`] → final norm → `lm_head` → greedy argmax), reading
//! everything that changes per step from device buffers ([`StepBuffers`]: token ids and
//! positions) and the KV caches' device lengths, so that on CUDA the step is captured once
//! in a CUDA graph ([`super::graph`]) and replayed at every position up to the capacity.
//!
//! The step writes its own next inputs: the argmax into `ids` and `positions + 1` into
//! `positions` (one kernel, [`GreedyStep`]), so greedy decoding replays the graph with no host write at all; only the new
//! token ids (or the logits when sampling) are read back.

use super::block::Block;
use super::lm_head::LmHead;
use super::norm::RmsNorm;
use crate::kv_cache::LayerCache;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_fp4::greedy::GreedyStep;

/// The device buffers a step reads and writes, and the ops of its tail, made once per model
/// (a captured graph holds their addresses).
#[derive(Debug)]
pub(crate) struct StepBuffers {
    /// U32 `[2, batch]`: row 0 the tokens the next step feeds (the last step's argmax, or
    /// written by the host), row 1 each sequence's position in the next step (its cached
    /// length). One tensor, so the greedy tail writes both in one kernel.
    pub state: Tensor,
    /// `state[0]`, a view.
    pub ids: Tensor,
    /// `state[1]`, a view.
    pub positions: Tensor,
    /// F32 `[batch, vocab]`: the last logits step's logits.
    pub logits: Tensor,
    /// What `positions` holds on the device (the host's mirror of it).
    pub positions_host: Vec<usize>,
    /// Whether `ids` holds the last step's argmax (greedy continuation without a host write).
    pub ids_are_argmax: bool,
    /// Argmax into `ids`, positions + 1.
    pub greedy: GreedyStep,
}

impl StepBuffers {
    pub(crate) fn new(batch: usize, vocab: usize, device: &Device) -> Result<Self> {
        let state = Tensor::zeros((2, batch), DType::U32, device)?;
        Ok(Self {
            ids: state.get(0)?,
            positions: state.get(1)?,
            state,
            logits: Tensor::zeros((batch, vocab), DType::F32, device)?,
            positions_host: vec![0; batch],
            ids_are_argmax: false,
            greedy: GreedyStep::new(batch, vocab, device)?,
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
    pub norm: &'a RmsNorm,
    pub lm_head: &'a LmHead,
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
    let mut x = m.embed.index_select(&bufs.ids, 0)?.to_dtype(m.dtype)?;
    // Each layer leaves its MLP output for the next one's fused residual add + norm.
    let mut delta: Option<Tensor> = None;
    for (b, cache) in m.blocks.iter().zip(m.caches.iter_mut()) {
        let (r, d) = b.forward_decode(&x, delta.as_ref(), &bufs.positions, cache, for_graph)?;
        (x, delta) = (r, Some(d));
    }
    let (_, h) = m.norm.add_forward(&x, delta.as_ref())?;
    let logits = m.lm_head.forward(&h)?;
    let logits = match logits.dtype() {
        DType::BF16 | DType::F32 => logits,
        _ => logits.to_dtype(DType::F32)?,
    };
    bufs.greedy.apply(&bufs.state, &logits)?;
    if out == StepOutput::Logits {
        bufs.logits.slice_set(&logits.to_dtype(DType::F32)?, 0, 0)?;
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
