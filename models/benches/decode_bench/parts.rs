//! `CFP4_DECODE_PARTS=1`: where a graph-replayed step's GPU time goes, measured inside
//! CUDA graphs rather than kernel by kernel (ncu serializes and isolates every kernel, so
//! its sum is not the step).
//!
//! Each part is a chain of the model's own ops (its layers, norms and `lm_head`, through
//! the public API) over every layer, recorded once as a CUDA graph with the decode step's
//! protocol (one eager run under candle's htod cache, then the recording) and replayed:
//! the median of 9 single replays between CUDA events, and 20 replays back to back over
//! 20. The full step's own graph is timed the same way. Differences between chains are
//! what the left-out ops cost inside a graph, kernel boundaries included; the chains with
//! 64-value norms split a norm's cost into its kernel boundary and its own work.

use anyhow::{bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::{Device, Module, Tensor};
use candle_fp4::norm::AddRmsNorm;
use candle_fp4_models::llama::Site;
use candle_fp4_models::Llama;

/// One recorded chain of ops.
type Body<'a> = Box<dyn FnMut() -> candle_core::Result<()> + 'a>;

/// Median of 9 single runs of `f` and the mean of 20 back to back, in µs, between CUDA
/// events on the model's stream.
fn time_gpu(dev: &Device, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    let Device::Cuda(cu) = dev else {
        bail!("decode_bench parts need a CUDA device")
    };
    let st = cu.cuda_stream();
    let ev = || st.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT));
    let mut one = vec![];
    for _ in 0..9 {
        let e0 = ev()?;
        f()?;
        let e1 = ev()?;
        e1.synchronize()?;
        one.push(e0.elapsed_ms(&e1)? as f64 * 1e3);
    }
    one.sort_by(|a, b| a.total_cmp(b));
    let e0 = ev()?;
    for _ in 0..20 {
        f()?;
    }
    let e1 = ev()?;
    e1.synchronize()?;
    Ok((one[4], e0.elapsed_ms(&e1)? as f64 * 1e3 / 20.0))
}

/// Records `body` as a CUDA graph (warm-up run, then the capture) and times its replays.
fn time_chain(dev: &Device, mut body: Body<'_>) -> Result<(f64, f64)> {
    let Device::Cuda(cu) = dev else {
        bail!("decode_bench parts need a CUDA device")
    };
    let stream = cu.cuda_stream();
    let graph = {
        let _cache = cu.enable_cuda_graph_htod_cache();
        body()?;
        stream.synchronize()?;
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let r = body();
        let g = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        r.context("recording a part")?;
        g?.context("a part recorded no work")?
    };
    time_gpu(dev, || Ok(graph.launch()?))
}

/// Prints the in-graph time of the step's parts for the batch-1 model `m` (NVFP4 or BF16
/// layers with fused q|k|v and gate|up), after its graph step was timed.
/// The sequence is set back to `ctx − 1` cached tokens first (the step's timing runs 29 more).
pub fn report(m: &mut Llama, ctx: usize, dev: &Device) -> Result<()> {
    m.bench_set_sequence_lens(&[ctx - 1])?;
    let cfg = m.config().clone();
    let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
    let dt = m.dtype();
    let rnd = |n: usize, seed: f64| -> Result<Tensor> {
        // Values of an activation's size (|x| ≲ 1), deterministic.
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as f64 * 0.618 + seed).fract() - 0.5) as f32)
            .collect();
        Ok(Tensor::from_vec(v, (1, n), dev)?.to_dtype(dt)?)
    };
    let (x, d, y, act) = (rnd(h, 0.1)?, rnd(h, 0.3)?, rnd(h, 0.7)?, rnd(inter, 0.9)?);
    let step = time_gpu(dev, || {
        m.decode_greedy(None)?;
        Ok(())
    })?;
    let m: &Llama = m;
    let blocks = m.blocks();
    let one = |s: Site| -> Result<Vec<&candle_fp4::quant_linear::QuantLinear>> {
        blocks
            .iter()
            .map(|b| match b.site_linears(s).as_slice() {
                [l] => Ok(*l),
                v => bail!("parts: {s:?} has {} layers, needs one fused layer", v.len()),
            })
            .collect()
    };
    let (qkv, o, gu, down) = (
        one(Site::Qkv)?,
        one(Site::O)?,
        one(Site::GateUp)?,
        one(Site::Down)?,
    );
    let eps = cfg.rms_norm_eps as f32;
    let norms: Vec<(AddRmsNorm, AddRmsNorm)> = blocks
        .iter()
        .map(|b| {
            Ok((
                AddRmsNorm::new(b.norm(Site::Qkv)?, eps)?,
                AddRmsNorm::new(b.norm(Site::GateUp)?, eps)?,
            ))
        })
        .collect::<Result<_>>()?;
    let layers = blocks.len();
    let mut rows: Vec<(&str, (f64, f64))> = vec![("full step (its graph)", step)];
    rows.push((
        "GEMVs only (4 per layer)",
        time_chain(
            dev,
            Box::new(|| {
                for i in 0..layers {
                    qkv[i].forward(&x)?;
                    o[i].forward(&y)?;
                    gu[i].forward_silu_mul(&x)?;
                    down[i].forward(&act)?;
                }
                Ok(())
            }),
        )?,
    ));
    rows.push((
        "GEMVs + add-norms",
        time_chain(
            dev,
            Box::new(|| {
                for i in 0..layers {
                    qkv[i].forward_add_norm(&x, Some(&d), &norms[i].0, false)?;
                    o[i].forward(&y)?;
                    gu[i].forward_add_norm(&x, Some(&d), &norms[i].1, true)?;
                    down[i].forward(&act)?;
                }
                Ok(())
            }),
        )?,
    ));
    rows.push((
        "add-norms only (2 per layer)",
        time_chain(
            dev,
            Box::new(|| {
                for n in &norms {
                    n.0.forward(&x, Some(&d))?;
                    n.1.forward(&x, Some(&d))?;
                }
                Ok(())
            }),
        )?,
    ));
    // The same chains with norms of 64 values: what a norm kernel costs between the GEMVs
    // when it has almost nothing to do (its launch and the dependency), against the
    // chains above (a norm's own work on a 4096-value row).
    let (x64, d64) = (rnd(64, 0.1)?, rnd(64, 0.3)?);
    let n64 = AddRmsNorm::new(&Tensor::ones(64, dt, dev)?, eps)?;
    rows.push((
        "GEMVs + 64-value norms",
        time_chain(
            dev,
            Box::new(|| {
                for i in 0..layers {
                    n64.forward(&x64, Some(&d64))?;
                    qkv[i].forward(&x)?;
                    o[i].forward(&y)?;
                    n64.forward(&x64, Some(&d64))?;
                    gu[i].forward_silu_mul(&x)?;
                    down[i].forward(&act)?;
                }
                Ok(())
            }),
        )?,
    ));
    rows.push((
        "64-value norms only (2/layer)",
        time_chain(
            dev,
            Box::new(|| {
                for _ in 0..2 * layers {
                    n64.forward(&x64, Some(&d64))?;
                }
                Ok(())
            }),
        )?,
    ));
    for (name, ls, input, silu) in [
        ("q|k|v x layers", &qkv, &x, false),
        ("o x layers", &o, &y, false),
        ("gate|up silu x layers", &gu, &x, true),
        ("down x layers", &down, &act, false),
    ] {
        let t = time_chain(
            dev,
            Box::new(|| {
                for l in ls.iter() {
                    if silu {
                        l.forward_silu_mul(input)?;
                    } else {
                        l.forward(input)?;
                    }
                }
                Ok(())
            }),
        )?;
        rows.push((name, t));
    }
    let hn = x.clone();
    rows.push((
        "final norm + lm_head",
        time_chain(
            dev,
            Box::new(|| {
                m.logits_of(&hn).map_err(candle_core::Error::wrap)?;
                Ok(())
            }),
        )?,
    ));
    eprintln!("parts of the step inside CUDA graphs ({layers} layers, batch 1, {dt:?}):");
    eprintln!(
        "{:<30} {:>12} {:>16}",
        "chain", "single µs", "20 back-to-back"
    );
    for (n, (a, b)) in &rows {
        eprintln!("{n:<30} {a:>12.1} {b:>16.1}");
    }
    Ok(())
}
