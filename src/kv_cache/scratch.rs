//! Per-stream scratch memory of split-KV decode attention: the split partials and the
//! counters of the in-kernel merge, kept across calls so that a decode step allocates
//! nothing but its output (and the counters, zeroed once, stay zero between calls: the
//! kernel's last CTA per head group resets its own).

use crate::cuda::cuda_err;
use candle_core::cuda_backend::cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use candle_core::{bail, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Device addresses of one call's scratch (valid until the stream's next larger request).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvScratch {
    pub part_o: u64,
    pub part_ml: u64,
    pub counters: u64,
}

struct Buffers {
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    counters: CudaSlice<u32>,
}

/// Per stream: the buffers in use last, and earlier, smaller ones. Those are never freed:
/// a CUDA graph captured before the growth may still point at them.
type Table = Mutex<HashMap<usize, Vec<Buffers>>>;

fn table() -> &'static Table {
    static T: OnceLock<Table> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

fn capturing(stream: &CudaStream) -> Result<bool> {
    let st = stream
        .capture_status()
        .map_err(|e| cuda_err("cuStreamIsCapturing", e))?;
    Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Scratch of at least `part_o` / `part_ml` floats and `counters` zeroed counters for a
/// launch on `stream`. Grows (to the next power of two) outside stream capture only: a call
/// that needs more while the stream is being captured is an error, so run the largest shape
/// once before capturing a graph.
pub(crate) fn kv_scratch(
    stream: &Arc<CudaStream>,
    part_o: usize,
    part_ml: usize,
    counters: usize,
) -> Result<KvScratch> {
    let key = stream.cu_stream() as usize;
    let mut t = table()
        .lock()
        .map_err(|_| cuda_err("decode attention scratch", "poisoned lock"))?;
    let list = t.entry(key).or_default();
    let fits = |b: &Buffers| {
        b.part_o.len() >= part_o && b.part_ml.len() >= part_ml && b.counters.len() >= counters
    };
    if !list.last().is_some_and(fits) {
        if capturing(stream)? {
            bail!(
                "decode attention: its scratch must grow to {part_o} + {part_ml} floats, which \
                 can't be allocated during CUDA graph capture; run the largest batch and \
                 context once before capturing"
            )
        }
        let grow =
            |need: usize, have: Option<usize>| need.max(have.unwrap_or(0)).next_power_of_two();
        let last = list.last();
        let n_o = grow(part_o, last.map(|b| b.part_o.len()));
        let n_ml = grow(part_ml, last.map(|b| b.part_ml.len()));
        let n_c = grow(counters, last.map(|b| b.counters.len()));
        let alloc_err = |e| cuda_err("allocating decode attention scratch", e);
        let b = Buffers {
            part_o: unsafe { stream.alloc::<f32>(n_o) }.map_err(alloc_err)?,
            part_ml: unsafe { stream.alloc::<f32>(n_ml) }.map_err(alloc_err)?,
            counters: stream.alloc_zeros::<u32>(n_c).map_err(alloc_err)?,
        };
        list.push(b);
    }
    let b = list
        .last()
        .ok_or_else(|| cuda_err("decode attention scratch", "empty table"))?;
    let (po, _g0) = b.part_o.device_ptr(stream);
    let (pm, _g1) = b.part_ml.device_ptr(stream);
    let (pc, _g2) = b.counters.device_ptr(stream);
    Ok(KvScratch {
        part_o: po,
        part_ml: pm,
        counters: pc,
    })
}
