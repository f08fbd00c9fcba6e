//! CUDA-graph capture and replay of the decode step ([`super::step`]).
//!
//! Protocol (per [`StepOutput`]): the first call runs the step eagerly with the launches a
//! graph will hold (splits planned for the capacity), which also loads every kernel and
//! sizes every scratch buffer; the second call records the step on the model's stream
//! (relaxed capture mode: recording runs no kernel) and replays it; later calls only replay.
//! Recording runs the host code once, which advanced the caches' host lengths: the driver
//! sets them back, and after every replay sets them one further
//! ([`LayerCache::set_host_lens`](crate::kv_cache::LayerCache::set_host_lens)).
//! candle's small per-launch uploads (layout vectors) go through its CUDA-graph htod cache
//! during the warm-up and the recording, so the graph reads persistent device copies.
//! Allocations inside the step are stream-ordered (`cuMemAllocAsync`) and freed inside it,
//! so the graph owns them; the buffers it reads and writes persist in [`super::step::StepBuffers`].

use super::step::StepOutput;
use anyhow::{bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph};
use candle_core::Device;

/// A step's state: not run yet, run once eagerly (warmed), or captured.
#[derive(Default)]
enum Slot {
    #[default]
    Cold,
    Warm,
    Captured(Exec),
}

/// An instantiated graph and the thread that recorded it: candle's htod cache, which holds
/// the device copies of the graph's layout vectors, is thread-local, so a graph is only
/// replayed on its recording thread (another thread records its own).
struct Exec(CudaGraph, std::thread::ThreadId);

// SAFETY: CUDA graph objects may be used from any thread provided calls on one graph are
// serialized (CUDA driver API, "Graph object thread safety"). The only access is
// `Graphs::run`, which takes `&mut self`, so moving the model to another thread (Send) or
// sharing `&Llama` (Sync: no `&self` method reaches the graph) cannot race on it.
unsafe impl Send for Exec {}
unsafe impl Sync for Exec {}

/// The captured steps of one model (one per [`StepOutput`]).
#[derive(Default)]
pub(crate) struct Graphs {
    greedy: Slot,
    logits: Slot,
}

impl std::fmt::Debug for Graphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = |x: &Slot| match x {
            Slot::Cold => "cold",
            Slot::Warm => "warm",
            Slot::Captured(_) => "captured",
        };
        f.debug_struct("Graphs")
            .field("greedy", &s(&self.greedy))
            .field("logits", &s(&self.logits))
            .finish()
    }
}

/// What [`Graphs::run`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ran {
    /// The step ran eagerly (host lengths advanced by the step itself).
    Eager,
    /// A graph was replayed (host lengths to be advanced by the caller), `true` when it was
    /// recorded by this call (host lengths to be restored first).
    Replayed { recorded: bool },
}

impl Graphs {
    /// Runs the step `body` for `out` on `device`: eagerly the first time, then recorded and
    /// replayed. `body` must read its per-step inputs from device buffers only.
    pub(crate) fn run(
        &mut self,
        device: &Device,
        out: StepOutput,
        mut body: impl FnMut() -> candle_core::Result<()>,
    ) -> Result<Ran> {
        let Device::Cuda(cu) = device else {
            bail!("CUDA graph decode: the model is not on a CUDA device")
        };
        let slot = match out {
            StepOutput::Greedy => &mut self.greedy,
            StepOutput::Logits => &mut self.logits,
        };
        match slot {
            Slot::Cold => {
                // candle uploads small layout vectors (dims, strides) per launch from host
                // memory; its htod cache keeps them in persistent device buffers while the
                // guard lives, filled here and only read while recording (a miss there is
                // an error), so the graph never copies from freed host memory.
                let _cache = cu.enable_cuda_graph_htod_cache();
                body()?;
                *slot = Slot::Warm;
                Ok(Ran::Eager)
            }
            Slot::Warm => {
                let stream = cu.cuda_stream();
                let _cache = cu.enable_cuda_graph_htod_cache();
                stream
                    .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                    .context("CUDA graph decode: cannot start capturing the step")?;
                let recorded = body();
                // End the capture whatever happened, so the stream is usable again.
                let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
                recorded.context("CUDA graph decode: recording the step failed")?;
                let graph = graph
                    .context("CUDA graph decode: instantiating the step's graph failed")?
                    .context("CUDA graph decode: the capture recorded no work")?;
                graph
                    .launch()
                    .context("CUDA graph decode: replaying the step failed")?;
                *slot = Slot::Captured(Exec(graph, std::thread::current().id()));
                Ok(Ran::Replayed { recorded: true })
            }
            Slot::Captured(Exec(_, t)) if *t != std::thread::current().id() => {
                // Moved to another thread: warm up and record again there.
                let _cache = cu.enable_cuda_graph_htod_cache();
                body()?;
                *slot = Slot::Warm;
                Ok(Ran::Eager)
            }
            Slot::Captured(Exec(g, _)) => {
                g.launch()
                    .context("CUDA graph decode: replaying the step failed")?;
                Ok(Ran::Replayed { recorded: false })
            }
        }
    }
}
