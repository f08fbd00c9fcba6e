//! decode_bench: end-to-end decode speed on one CUDA GPU (features `cuda` and `peers`).
//!
//! Models are built directly in GPU memory with seeded random weights ([`Llama::random`]:
//! a device call carries no checkpoint) in the shapes of Llama-3.1-8B (NVFP4 projections
//! with a BF16 `lm_head`, and all-BF16) and SmolLM2-135M (NVFP4, tied BF16 embeddings).
//! The context is set without a prefill (`bench_set_sequence_lens`: the skipped tokens read
//! as zeros, which costs the attention the same bytes). Each row: one eager warm-up step,
//! the CUDA graph recorded at the next, 5 more warm-up steps, then the median wall time of
//! `STEPS` steps, each returning its greedy tokens to the host (what a decode loop pays).
//!
//! Roofline: the bytes a step must read (every weight once, plus each sequence's KV cache)
//! over the copy bandwidth measured at the start of the same run. candle-transformers'
//! BF16 `llama` (its own KV cache, prefilled to the context) runs the 8B shape in the same
//! run as the reference the targets are stated against.
//!
//!   cargo bench -p candle-fp4-models --features cuda,peers --bench decode_bench
//!   CFP4_DECODE_ONLY=smollm2 ... (rows whose name contains the string; `=name`: that row)
//!   CFP4_DECODE_TRACE=1 ... (one more step between cuProfilerStart / Stop, for ncu, and its
//!   GPU time between CUDA events)
//!   CFP4_DECODE_ATTN=splits=N,fused=0|1 ... (the attention's knobs, for a sweep)
//!   CFP4_DECODE_PARTS=1 ... (the batch-1 8B NVFP4 row: its parts timed inside CUDA graphs,
//!   [`parts`])
//!   CFP4_DECODE_SMS=N [CFP4_DECODE_MEM_BW=GB/s] ... (every row planned for N SMs, and its
//!   timed steps run while a blocker holds the others; the copy bandwidth is the full
//!   chip's, and the trace and parts runs are not held: a GPU that asks more of each SM,
//!   e.g. an H200's ~32 GB/s per SM on 96 SMs of an H100; [`candle_fp4::partition`].
//!   MEM_BW: the peak DRAM bandwidth the planners see, 4917 for an H200's)

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4_models::config::LlamaConfig;
use candle_fp4_models::{Llama, LoadOptions, RandomSpec};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[path = "decode_bench/parts.rs"]
mod parts;

const STEPS: usize = 40;

const LLAMA_8B: &str = r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
 "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
 "rope_theta": 500000.0, "tie_word_embeddings": false, "bos_token_id": 128000,
 "eos_token_id": 128001,
 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;

const LLAMA_70B: &str = r#"{"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
 "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
 "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
 "rope_theta": 500000.0, "tie_word_embeddings": false, "bos_token_id": 128000,
 "eos_token_id": 128001,
 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;

const SMOLLM2: &str = r#"{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
 "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
 "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
 "rope_theta": 100000.0, "tie_word_embeddings": true, "bos_token_id": 0, "eos_token_id": 0}"#;

struct Case {
    name: String,
    cfg: &'static str,
    nvfp4: bool,
    kv: KvCacheKind,
    ctx: usize,
    batch: usize,
    graph: bool,
    /// GEMVs launched with PDL (`LoadOptions::knobs.gemv.pdl`).
    pdl: bool,
    /// Run only when `CFP4_DECODE_ONLY` names it exactly (an experiment's row, not the table's).
    extra: bool,
}

struct Row {
    name: String,
    step: Duration,
    batch: usize,
    bytes: usize,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Device-to-device copy bandwidth (read + write bytes per second), the method of
/// `benches/gemv_cuda.rs` ([`candle_fp4::timing::copy_bandwidth`]).
fn copy_bandwidth(dev: &Device) -> Result<f64> {
    Ok(candle_fp4::timing::copy_bandwidth(dev)?)
}

fn ours(c: &Case, dev: &Device, held: Option<usize>) -> Result<Row> {
    let cfg = LlamaConfig::from_json_str(c.cfg, &c.name)?;
    let opts = LoadOptions {
        kv_cache: c.kv,
        max_seq_len: Some(c.ctx + STEPS + 16),
        batch: c.batch,
        cuda_graph: c.graph,
        knobs: candle_fp4::knobs::Knobs {
            // CFP4_DECODE_BF16_LEGACY=1: BF16 layers on gemv.cu's kernel, not the packed
            // kernel over their natural layout (an A/B in one binary).
            gemv: candle_fp4::knobs::GemvKnobs {
                bf16_legacy: std::env::var_os("CFP4_DECODE_BF16_LEGACY").is_some(),
                ..candle_fp4::knobs::GemvKnobs::with_pdl(c.pdl)
            },
            attention: attn_knobs()?,
            // CFP4_DECODE_NO_L2_PREFETCH=1: the norms do not prefetch the next layer's
            // weights (an A/B in one binary).
            l2_prefetch: std::env::var_os("CFP4_DECODE_NO_L2_PREFETCH").is_none(),
        },
        ..LoadOptions::default()
    };
    let spec = RandomSpec {
        nvfp4: c.nvfp4,
        seed: 42,
    };
    let mut m = Llama::random(cfg, spec, &opts, dev).with_context(|| c.name.clone())?;
    let t = time_steps(&mut m, c.ctx, c.batch, dev, held)?;
    if std::env::var_os("CFP4_DECODE_TRACE").is_some() {
        trace_one_step(&mut m, dev)?;
    }
    if std::env::var_os("CFP4_DECODE_PARTS").is_some() && c.batch == 1 && c.ctx <= 512 {
        parts::report(&mut m, c.ctx, dev)?;
    }
    let kv = m.kv_bytes_per_token() * c.ctx * c.batch;
    Ok(Row {
        name: c.name.clone(),
        step: median(t),
        batch: c.batch,
        bytes: m.weight_bytes() + kv,
    })
}

/// `CFP4_DECODE_ATTN=splits=N,fused=0|1,ring=0|1,append=0|1`: the decode attention's knobs
/// for every row (an experiment's sweep; unset: the planned defaults). `ring`: the exact
/// window's ring launched first; `append`: the rope and append inside the attention.
fn attn_knobs() -> Result<candle_fp4::kv_cache::AttnKnobs> {
    let mut k = candle_fp4::kv_cache::AttnKnobs::default();
    let Ok(v) = std::env::var("CFP4_DECODE_ATTN") else {
        return Ok(k);
    };
    for item in v.split(',').filter(|s| !s.is_empty()) {
        match item.split_once('=') {
            Some(("splits", n)) => k.splits = Some(n.parse().context("CFP4_DECODE_ATTN splits")?),
            Some(("fused", b)) => k.fused_merge = Some(b == "1"),
            Some(("ring", b)) => k.ring_first = Some(b == "1"),
            Some(("append", b)) => k.rope_append = Some(b == "1"),
            _ => anyhow::bail!(
                "CFP4_DECODE_ATTN: `{item}` is not splits=N, fused=0|1, ring=0|1 or append=0|1"
            ),
        }
    }
    Ok(k)
}

/// The wall times of `STEPS` greedy steps at context `ctx` after the warm-up (one eager
/// step, the graph recorded at the next, 5 more); with `held`, on the partition
/// ([`on_partition`]: the blocker comes after the warm-up has loaded every kernel).
fn time_steps(
    m: &mut Llama,
    ctx: usize,
    batch: usize,
    dev: &Device,
    held: Option<usize>,
) -> Result<Vec<Duration>> {
    m.bench_set_sequence_lens(&vec![ctx - 1; batch])?;
    m.decode_greedy(Some(&vec![1u32; batch]))?;
    for _ in 0..6 {
        m.decode_greedy(None)?;
    }
    on_partition(dev, held, || {
        let mut t = Vec::with_capacity(STEPS);
        for _ in 0..STEPS {
            let s = Instant::now();
            m.decode_greedy(None)?;
            t.push(s.elapsed());
        }
        Ok(t)
    })
}

/// The options of a batch-1 graph row at context `ctx`, GEMVs with PDL (the
/// tensor-parallel rows').
#[cfg(feature = "nccl")]
fn row_opts(kv: KvCacheKind, ctx: usize) -> LoadOptions {
    LoadOptions {
        kv_cache: kv,
        max_seq_len: Some(ctx + STEPS + 16),
        batch: 1,
        cuda_graph: true,
        knobs: candle_fp4::knobs::Knobs {
            gemv: candle_fp4::knobs::GemvKnobs::with_pdl(true),
            ..Default::default()
        },
        ..LoadOptions::default()
    }
}

/// The 70B-shaped NVFP4 model at batch 1, context 512, tensor parallel over `ranks` GPUs
/// (cuda:0..ranks, a thread and an NCCL rank each; every rank draws its own shard at
/// random on its GPU, [`Llama::random_rank`]). The row's bytes are one rank's (weights and
/// KV cache), against one GPU's copy bandwidth. One rank runs NCCL's all-reduce too (a
/// one-rank sum), so the row measures what the collectives cost inside the graph.
#[cfg(feature = "nccl")]
fn tensor_parallel_row(ranks: usize, ctx: usize) -> Result<Row> {
    use candle_fp4::tensor_parallel::{AllReduce, NcclGroup, NcclId, Shard};
    let id = NcclId::new()?;
    let name = format!("70b nvfp4 b1 ctx{ctx} tp{ranks} (nccl)");
    let rows = std::thread::scope(|s| {
        let hs: Vec<_> = Shard::all(ranks)?
            .into_iter()
            .map(|shard| {
                s.spawn(move || -> Result<(Duration, usize)> {
                    let dev = Device::new_cuda(shard.rank())?;
                    let g: std::sync::Arc<dyn AllReduce> =
                        std::sync::Arc::new(NcclGroup::new(&dev, shard, id)?);
                    let cfg = LlamaConfig::from_json_str(LLAMA_70B, "70b")?;
                    let spec = RandomSpec {
                        nvfp4: true,
                        seed: 42 + shard.rank() as u64,
                    };
                    let opts = row_opts(KvCacheKind::Bf16, ctx);
                    let mut m = Llama::random_rank(cfg, spec, &opts, &dev, g)?;
                    let t = time_steps(&mut m, ctx, 1, &dev, None)?;
                    Ok((median(t), m.weight_bytes() + m.kv_bytes_per_token() * ctx))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))?)
            .collect::<Result<Vec<_>>>()
    })
    .with_context(|| name.clone())?;
    let (step, bytes) = rows[0];
    Ok(Row {
        name,
        step,
        batch: 1,
        bytes,
    })
}

/// One more step between `cuProfilerStart` / `cuProfilerStop`, for a per-kernel trace
/// (`ncu --profile-from-start off --graph-profiling node`), and its GPU time between two
/// CUDA events (kernels and the gaps between them, no host work).
fn trace_one_step(m: &mut Llama, dev: &Device) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let Device::Cuda(cu) = dev else {
        anyhow::bail!("decode_bench needs a CUDA device")
    };
    let st = cu.cuda_stream();
    let mut gpu = vec![];
    for _ in 0..9 {
        let e0 = st.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        m.decode_greedy(None)?;
        let e1 = st.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        e1.synchronize()?;
        gpu.push(e0.elapsed_ms(&e1)? as f64);
    }
    gpu.sort_by(|a, b| a.total_cmp(b));
    eprintln!(
        "step GPU time (events, median of 9): {:.1} us",
        gpu[4] * 1e3
    );
    // SAFETY: plain driver calls with no arguments; the context is current on this thread.
    unsafe { sys::cuProfilerStart() }.result()?;
    m.decode_greedy(None)?;
    st.synchronize()?;
    unsafe { sys::cuProfilerStop() }.result()?;
    Ok(())
}

/// candle-transformers' BF16 Llama of `json`'s shape with random weights, batch 1, its KV
/// cache prefilled to `ctx - 1` tokens.
fn candle_transformers_llama(json: &str, ctx: usize, dev: &Device) -> Result<Row> {
    use candle_transformers::models::llama as ct;
    let c: ct::LlamaConfig = serde_json::from_str(json)?;
    let cfg = c.into_config(false);
    let (h, inter, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let hd = h / cfg.num_attention_heads;
    let kvd = cfg.num_key_value_heads * hd;
    dev.set_seed(43)?;
    let mut w: HashMap<String, Tensor> = HashMap::new();
    let mut bytes = 0usize;
    let mut put =
        |w: &mut HashMap<String, Tensor>, name: String, shape: (usize, usize)| -> Result<()> {
            let std = (1.0 / shape.1 as f64).sqrt() as f32;
            let t = Tensor::randn(0f32, std, shape, dev)?.to_dtype(DType::BF16)?;
            bytes += 2 * shape.0 * shape.1;
            w.insert(name, t);
            Ok(())
        };
    put(&mut w, "model.embed_tokens.weight".into(), (v, h))?;
    put(&mut w, "lm_head.weight".into(), (v, h))?;
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        put(&mut w, format!("{p}.self_attn.q_proj.weight"), (h, h))?;
        put(&mut w, format!("{p}.self_attn.k_proj.weight"), (kvd, h))?;
        put(&mut w, format!("{p}.self_attn.v_proj.weight"), (kvd, h))?;
        put(&mut w, format!("{p}.self_attn.o_proj.weight"), (h, h))?;
        put(&mut w, format!("{p}.mlp.gate_proj.weight"), (inter, h))?;
        put(&mut w, format!("{p}.mlp.up_proj.weight"), (inter, h))?;
        put(&mut w, format!("{p}.mlp.down_proj.weight"), (h, inter))?;
        for n in ["input_layernorm", "post_attention_layernorm"] {
            w.insert(
                format!("{p}.{n}.weight"),
                Tensor::ones(h, DType::BF16, dev)?,
            );
        }
    }
    bytes -= 2 * v * h; // the embedding is gathered, not read whole
    w.insert(
        "model.norm.weight".into(),
        Tensor::ones(h, DType::BF16, dev)?,
    );
    let vb = candle_nn::VarBuilder::from_tensors(w, DType::BF16, dev);
    let model = ct::Llama::load(vb, &cfg)?;
    let mut cache = ct::Cache::new(true, DType::BF16, &cfg, dev)?;
    let prompt = Tensor::new(vec![1u32; ctx - 1], dev)?.unsqueeze(0)?;
    let logits = model.forward(&prompt, 0, &mut cache)?;
    let mut tok = logits.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?[0];
    let mut t = vec![];
    for (i, pos) in (0..STEPS + 6).zip(ctx - 1..) {
        let s = Instant::now();
        let x = Tensor::new(&[tok], dev)?.unsqueeze(0)?;
        let logits = model.forward(&x, pos, &mut cache)?;
        tok = logits.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?[0];
        if i >= 6 {
            t.push(s.elapsed());
        }
    }
    let kv = 2 * 2 * cfg.num_hidden_layers * kvd * ctx;
    Ok(Row {
        name: "8b bf16 b1 ctx512 candle-transformers".into(),
        step: median(t),
        batch: 1,
        bytes: bytes + kv,
    })
}

/// `CFP4_DECODE_SMS=N`: plan for N SMs (and `CFP4_DECODE_MEM_BW` GB/s of peak DRAM
/// bandwidth); returns how many SMs [`time_steps`] holds with the blocker while it times.
fn partition(dev: &Device) -> Result<Option<usize>> {
    use candle_fp4::partition::{device_sms, plan_for};
    let Ok(n) = std::env::var("CFP4_DECODE_SMS") else {
        return Ok(None);
    };
    let sms: usize = n.parse().context("CFP4_DECODE_SMS must be an SM count")?;
    let mem_bw = match std::env::var("CFP4_DECODE_MEM_BW") {
        Ok(v) => Some(
            v.parse::<u64>()
                .ok()
                .and_then(|g| g.checked_mul(1_000_000_000))
                .context("CFP4_DECODE_MEM_BW must be whole GB/s")?,
        ),
        Err(_) => None,
    };
    let total = device_sms(dev)?;
    let held = total
        .checked_sub(sms)
        .filter(|&h| h > 0)
        .with_context(|| format!("CFP4_DECODE_SMS={sms}: the device has {total} SMs"))?;
    plan_for(dev, sms, mem_bw)?;
    eprintln!(
        "partition: planned for {sms} of {total} SMs (peak DRAM {}); {held} held while timing",
        mem_bw.map_or("the device's".into(), |b| format!(
            "{} GB/s",
            b / 1_000_000_000
        )),
    );
    Ok(Some(held))
}

/// Holds `held` SMs (if any) with [`candle_fp4::partition::SmBlocker`] around `f` (its
/// `hold` checks the hold), and fails if any of its CTAs left before the release.
fn on_partition<T>(dev: &Device, held: Option<usize>, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let Some(held) = held else { return f() };
    let b = candle_fp4::partition::SmBlocker::hold(dev, held, Duration::from_secs(300))?;
    let out = f();
    let r = b.release()?;
    if r.timed_out > 0 {
        anyhow::bail!(
            "PARTITION BROKEN: {} blocker CTAs left before the release",
            r.timed_out
        );
    }
    out
}

fn cases() -> Vec<Case> {
    let mut v = vec![];
    let mut add = |model: &str, cfg, nvfp4, kv: KvCacheKind, ctx, batch, graph, pdl| {
        let kvn = match kv {
            KvCacheKind::Bf16 => "kvbf16",
            KvCacheKind::UltraQuant => "kvuq",
        };
        let mode = if graph { "graph" } else { "eager" };
        let nopdl = if pdl { "" } else { " no-pdl" };
        v.push(Case {
            name: format!("{model} b{batch} ctx{ctx} {kvn} {mode}{nopdl}"),
            cfg,
            nvfp4,
            kv,
            ctx,
            batch,
            graph,
            pdl,
            // Contexts between the table's 512 and 32k: split-count experiments' rows.
            extra: ctx != 512 && ctx != 32768,
        });
    };

    use KvCacheKind::{Bf16, UltraQuant};
    add("smollm2 nvfp4", SMOLLM2, true, Bf16, 512, 1, true, true);
    add("smollm2 nvfp4", SMOLLM2, true, Bf16, 512, 1, true, false);
    add("smollm2 nvfp4", SMOLLM2, true, Bf16, 512, 1, false, true);
    add(
        "smollm2 nvfp4",
        SMOLLM2,
        true,
        UltraQuant,
        512,
        1,
        true,
        true,
    );
    add("8b nvfp4", LLAMA_8B, true, Bf16, 512, 1, true, true);
    add("8b nvfp4", LLAMA_8B, true, Bf16, 512, 1, true, false);
    add("8b nvfp4", LLAMA_8B, true, Bf16, 512, 1, false, true);
    add("8b nvfp4", LLAMA_8B, true, UltraQuant, 512, 1, true, true);
    add("8b nvfp4", LLAMA_8B, true, Bf16, 512, 8, true, true);
    add("8b nvfp4", LLAMA_8B, true, UltraQuant, 512, 8, true, true);
    add("8b nvfp4", LLAMA_8B, true, Bf16, 512, 32, true, true);
    add("8b nvfp4", LLAMA_8B, true, UltraQuant, 512, 32, true, true);
    add("8b nvfp4", LLAMA_8B, true, Bf16, 32768, 1, true, true);
    add("8b nvfp4", LLAMA_8B, true, UltraQuant, 32768, 1, true, true);
    add("8b bf16", LLAMA_8B, false, Bf16, 512, 1, true, true);
    add("8b bf16", LLAMA_8B, false, Bf16, 512, 8, true, true);
    add("70b nvfp4", LLAMA_70B, true, Bf16, 512, 1, true, true);
    for ctx in [1024, 2048, 3072, 4096] {
        add("8b nvfp4", LLAMA_8B, true, UltraQuant, ctx, 1, true, true);
        add("8b nvfp4", LLAMA_8B, true, Bf16, ctx, 1, true, true);
    }
    v
}

fn main() -> Result<()> {
    let only = std::env::var("CFP4_DECODE_ONLY").unwrap_or_default();
    let dev = Device::new_cuda(0)?;
    let bw = copy_bandwidth(&dev)?;
    eprintln!("copy bandwidth {:.0} GB/s", bw / 1e9);
    let held = partition(&dev)?;
    let mut rows = vec![];
    // `=name`: that row only; otherwise every row whose name contains the string.
    let pick = |name: &str| match only.strip_prefix('=') {
        Some(exact) => name == exact,
        None => name.contains(&only),
    };
    for c in cases()
        .iter()
        .filter(|c| pick(&c.name) && (!c.extra || only.starts_with('=')))
    {
        match ours(c, &dev, held) {
            Ok(r) => {
                eprintln!("{}: {:.3} ms/step", r.name, r.step.as_secs_f64() * 1e3);
                rows.push(r)
            }
            Err(e) => eprintln!("{}: FAILED: {e:#}", c.name),
        }
    }
    // CFP4_DECODE_TP=N (feature `nccl`): the 70B row tensor parallel over 1 (NCCL's
    // one-rank sum in the graph) and N GPUs.
    #[cfg(feature = "nccl")]
    if let Ok(n) = std::env::var("CFP4_DECODE_TP") {
        let n: usize = n.parse().context("CFP4_DECODE_TP must be a GPU count")?;
        for ranks in if n > 1 { vec![1, n] } else { vec![1] } {
            match tensor_parallel_row(ranks, 512) {
                Ok(r) => {
                    eprintln!("{}: {:.3} ms/step", r.name, r.step.as_secs_f64() * 1e3);
                    rows.push(r)
                }
                Err(e) => eprintln!("70b tp{ranks}: FAILED: {e:#}"),
            }
        }
    }
    if "candle-transformers".contains(&only) || only.is_empty() {
        match candle_transformers_llama(LLAMA_8B, 512, &dev) {
            Ok(r) => rows.push(r),
            Err(e) => eprintln!("candle-transformers: FAILED: {e:#}"),
        }
    }
    let ct = rows
        .iter()
        .find(|r| r.name.contains("candle-transformers"))
        .map(|r| r.step);
    println!(
        "\ncopy bandwidth {:.0} GB/s (full chip); median of {STEPS} steps{}",
        bw / 1e9,
        std::env::var("CFP4_DECODE_SMS").map_or(String::new(), |n| format!("; on {n} SMs"))
    );
    println!(
        "{:<42} {:>9} {:>10} {:>10} {:>9} {:>9} {:>8}",
        "row", "ms/step", "tok/s/seq", "tok/s", "MB/step", "roofline", "vs c-t"
    );
    for r in &rows {
        let s = r.step.as_secs_f64();
        let roof = r.bytes as f64 / bw / s;
        let vs = ct.map_or(String::from("-"), |c| {
            format!("{:.2}x", c.as_secs_f64() * r.batch as f64 / s)
        });
        println!(
            "{:<42} {:>9.3} {:>10.1} {:>10.1} {:>9.1} {:>8.1}% {:>8}",
            r.name,
            s * 1e3,
            1.0 / s,
            r.batch as f64 / s,
            r.bytes as f64 / 1e6,
            100.0 * roof,
            vs
        );
    }
    Ok(())
}
