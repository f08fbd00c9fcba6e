//! Perplexity of a Llama over a text file, in non-overlapping windows.
//!
//! ```sh
//! cargo run --release -p candle-fp4-models --bin perplexity -- --model smollm2 \
//!     --text tests/data/text/alice_ch1-3.txt --ctx 512 --kv-cache ultraquant
//! ```
//!
//! The text is tokenized as plain text (no BOS unless the tokenizer adds one), cut into
//! windows of `--ctx` tokens; each window starts from an empty KV cache and every token
//! after its first is scored: perplexity = exp(mean negative log-likelihood).
//! `--skip-windows N` leaves out the first N windows (held-out evaluation after a GPTQ
//! calibration on the start of the same text).

mod common;

use anyhow::{bail, Context, Result};
use candle_core::{DType, D};
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4_models::errors::check_finite_logits;
use candle_fp4_models::tokenizer::TextTokenizer;
use candle_fp4_models::{Llama, LoadOptions, DEFAULT_KV_WINDOW};
use clap::Parser;
use common::cli;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Perplexity of a Llama on candle-fp4 over a text file")]
struct Args {
    /// Model folder, `smollm2` (NVFP4) or `smollm2-bf16`.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// UTF-8 text file.
    #[arg(long, default_value = "tests/data/text/alice_ch1-3.txt")]
    text: PathBuf,
    /// Tokens per window (at most the model's max_position_embeddings unless
    /// --allow-long-context).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Accept a --ctx beyond the model's max_position_embeddings.
    #[arg(long)]
    allow_long_context: bool,
    /// Skip the first N windows (e.g. those a GPTQ calibration used: `--skip-windows 4`
    /// after `quantize --calib-tokens 2048` on the same text with 512-token windows).
    #[arg(long, default_value_t = 0)]
    skip_windows: usize,
    /// Score at most this many windows (after the skipped ones).
    #[arg(long)]
    max_windows: Option<usize>,
    /// KV cache: bf16 or ultraquant.
    #[arg(long, default_value = "bf16", value_parser = cli::parse_kv_cache)]
    kv_cache: KvCacheKind,
    /// UltraQuant: the most recent tokens also kept exact in BF16 (0 = all FP4).
    #[arg(long, default_value_t = DEFAULT_KV_WINDOW)]
    kv_window: usize,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Write the text's token ids to this file (one per line) and exit.
    #[arg(long)]
    dump_ids: Option<PathBuf>,
    /// Tokens pushed through the layers at once (1 = every token as in decode).
    #[arg(long, default_value_t = 32)]
    prefill_chunk: usize,
}

fn run(a: Args) -> Result<()> {
    if a.ctx < 2 {
        bail!("--ctx must be at least 2");
    }
    let device = cli::device(&a.device)?;
    let dir = cli::resolve_model(&a.model)?;
    let text = std::fs::read_to_string(&a.text)
        .with_context(|| format!("cannot read {}", a.text.display()))?;
    let opts = LoadOptions {
        kv_cache: a.kv_cache,
        max_seq_len: Some(a.ctx),
        prefill_chunk: a.prefill_chunk,
        kv_window: a.kv_window,
        allow_long_context: a.allow_long_context,
        ..Default::default()
    };
    let mut model = Llama::load(&dir, &device, &opts)?;
    let tok = TextTokenizer::from_dir(&dir, model.config())?;
    let ids = tok.encode(&text, true)?;
    if let Some(p) = &a.dump_ids {
        let s: String = ids.iter().map(|i| format!("{i}\n")).collect();
        std::fs::write(p, s).with_context(|| format!("cannot write {}", p.display()))?;
        println!("wrote {} token ids to {}", ids.len(), p.display());
        return Ok(());
    }
    let mut windows: Vec<&[u32]> = ids.chunks_exact(a.ctx).collect();
    if windows.is_empty() {
        bail!(
            "{}: {} tokens, fewer than one window of {}",
            a.text.display(),
            ids.len(),
            a.ctx
        );
    }
    if a.skip_windows >= windows.len() {
        bail!(
            "--skip-windows {}: the text has only {} windows of {}",
            a.skip_windows,
            windows.len(),
            a.ctx
        );
    }
    windows.drain(..a.skip_windows);
    if let Some(m) = a.max_windows {
        windows.truncate(m.max(1));
    }
    let t = Instant::now();
    let (mut nll, mut count) = (0f64, 0usize);
    for (i, w) in windows.iter().enumerate() {
        model.reset()?;
        let logits = model.forward_all(w, 0)?; // [ctx, vocab]
        let lsm = candle_nn::ops::log_softmax(
            &logits.narrow(0, 0, w.len() - 1)?.to_dtype(DType::F32)?,
            D::Minus1,
        )?;
        let lsm = lsm.to_vec2::<f32>()?;
        for (t, row) in lsm.iter().enumerate() {
            // Non-finite logits give a non-finite log-softmax row: never a "perplexity NaN".
            check_finite_logits(row, || {
                format!(
                    "window {} (text token {})",
                    a.skip_windows + i + 1,
                    (a.skip_windows + i) * a.ctx + t
                )
            })?;
        }
        for (row, &target) in lsm.iter().zip(&w[1..]) {
            nll -= row[target as usize] as f64;
            count += 1;
        }
        eprintln!(
            "window {}/{}: running perplexity {:.4} ({:.0} tokens/s)",
            i + 1,
            windows.len(),
            (nll / count as f64).exp(),
            ((i + 1) * a.ctx) as f64 / t.elapsed().as_secs_f64()
        );
    }
    println!(
        "perplexity {:.4} over {count} scored tokens ({} windows of {}, first {} skipped) | model {} | KV {} (exact window {}) | text {} ({} tokens)",
        (nll / count as f64).exp(),
        windows.len(),
        a.ctx,
        a.skip_windows,
        a.model,
        cli::kv_cache_name(a.kv_cache),
        match a.kv_cache {
            KvCacheKind::UltraQuant => a.kv_window.to_string(),
            KvCacheKind::Bf16 => "n/a".to_string(),
        },
        a.text.display(),
        ids.len()
    );
    Ok(())
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
