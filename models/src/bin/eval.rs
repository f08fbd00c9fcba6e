//! A quantized model against its BF16 source, on data no recipe was tuned on.
//!
//! ```sh
//! cargo run --release -p candle-fp4-models --bin eval -- --model q=/tmp/q --model smollm2-rtn
//! ```
//!
//! For every `--model` (against `--reference`, default `smollm2-bf16`):
//! * per text (`--text FILE[@SKIP]`, default the shipped evaluation texts in
//!   `tests/data/text/eval/`; `@SKIP` leaves out the first SKIP tokens, e.g. a
//!   calibration text's calibrated part): perplexity, mean KL(reference || model) of the
//!   next-token distributions and top-1 agreement, over windows of `--ctx` tokens each
//!   from an empty KV cache;
//! * on the factual prompts (`--prompts`, default `tests/data/prompts/factual_eval.tsv`):
//!   greedy raw completions, the first two words compared with the reference's, and both
//!   checked against the expected answer;
//! * decode speed (`--decode-tokens` single-token steps after a short prompt);
//! * the bytes of its decoder Linears relative to all-NVFP4 (the budget's measure).
//!
//! `--json FILE` writes everything (the input of `examples/eval_chart.rs`).

mod common;

use anyhow::{bail, Context, Result};
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4_models::eval::prompts::{is_correct, load_prompts, same_start};
use candle_fp4_models::eval::runner::{decode_speed, greedy, score_windows, windows};
use candle_fp4_models::eval::TextSums;
use candle_fp4_models::mix::checkpoint_linear_bytes;
use candle_fp4_models::tokenizer::TextTokenizer;
use candle_fp4_models::{Llama, LoadOptions};
use clap::Parser;
use common::cli;
use serde_json::{json, Value as Json};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Quantized Llama vs its BF16 source: unseen texts, factual prompts, speed")]
struct Args {
    /// The reference: a model folder or `smollm2-bf16`.
    #[arg(long, default_value = "smollm2-bf16")]
    reference: String,
    /// A model to evaluate, `LABEL=FOLDER` or `FOLDER` (also `smollm2`, `smollm2-rtn`,
    /// `smollm2@RECIPE`); repeatable.
    #[arg(long, required = true)]
    model: Vec<String>,
    /// Evaluation text `FILE[@SKIP]`; repeatable (default: tests/data/text/eval/*).
    #[arg(long)]
    text: Vec<String>,
    /// Score at most this many tokens per text (the first windows).
    #[arg(long)]
    max_text_tokens: Option<usize>,
    /// Prompt set (`prompt<TAB>expected` lines); `none` skips the prompts.
    #[arg(long, default_value = "tests/data/prompts/factual_eval.tsv")]
    prompts: String,
    /// Tokens generated per prompt (the first two words are compared).
    #[arg(long, default_value_t = 8)]
    max_new: usize,
    /// Tokens per scoring window.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Single-token decode steps timed per model (0 = no timing).
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Print every prompt's completions.
    #[arg(long)]
    show_prompts: bool,
    /// Write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

const DEFAULT_TEXTS: [&str; 4] = [
    "tests/data/text/eval/prose_the_ferry_keeper.txt",
    "tests/data/text/eval/tech_python_reference.txt",
    "tests/data/text/eval/legal_us_constitution.txt",
    "tests/data/text/eval/code_python_textwrap.py.txt",
];

fn load(dir: &Path, ctx: usize) -> Result<Llama> {
    let opts = LoadOptions {
        kv_cache: KvCacheKind::Bf16,
        max_seq_len: Some(ctx.max(256)),
        // Whole windows through the matmul path (the GEMV's numerics, faster on the CPU).
        prefill_chunk: ctx,
        ..Default::default()
    };
    Llama::load(dir, &candle_core::Device::Cpu, &opts)
        .with_context(|| format!("loading {}", dir.display()))
}

fn parse_text(spec: &str) -> Result<(PathBuf, usize)> {
    match spec.rsplit_once('@') {
        Some((p, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            Ok((PathBuf::from(p), n.parse()?))
        }
        _ => Ok((PathBuf::from(spec), 0)),
    }
}

fn text_json(name: &str, s: &TextSums) -> Json {
    json!({"text": name, "tokens": s.tokens, "ppl": s.perplexity(), "kl": s.mean_kl(),
           "top1": s.top1_agreement()})
}

fn run(a: Args) -> Result<()> {
    let ref_dir = cli::resolve_model(&a.reference)?;
    let mut labels = vec![];
    let mut dirs = vec![];
    for m in &a.model {
        let (label, spec) = match m.split_once('=') {
            Some((l, s)) => (l.to_string(), s.to_string()),
            None => (m.clone(), m.clone()),
        };
        dirs.push(cli::resolve_model(&spec)?);
        labels.push(label);
    }
    let mut reference = load(&ref_dir, a.ctx)?;
    let tok = TextTokenizer::from_dir(&ref_dir, reference.config())?;
    let mut models = dirs
        .iter()
        .map(|d| load(d, a.ctx))
        .collect::<Result<Vec<_>>>()?;
    let texts: Vec<String> = if a.text.is_empty() {
        DEFAULT_TEXTS.iter().map(|s| s.to_string()).collect()
    } else {
        a.text.clone()
    };
    let t0 = Instant::now();
    let mut ref_texts = vec![];
    let mut model_texts: Vec<Vec<Json>> = vec![vec![]; models.len()];
    println!(
        "| text | tokens | BF16 ppl | {} |",
        labels
            .iter()
            .map(|l| format!("{l}: ppl (Δ) / KL / top-1"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    for spec in &texts {
        let (path, skip) = parse_text(spec)?;
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let ids = tok.encode(&text, true)?;
        let mut ws = windows(&ids, a.ctx, skip)?;
        if let Some(max) = a.max_text_tokens {
            let mut n = 0;
            ws.retain(|w| {
                n += w.len();
                n - w.len() < max
            });
        }
        if ws.is_empty() {
            bail!(
                "{}: nothing to score after skipping {skip} tokens",
                path.display()
            );
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
            + &if skip > 0 {
                format!("@{skip}")
            } else {
                String::new()
            };
        let mut refs: Vec<&mut Llama> = models.iter_mut().collect();
        let n = ws.len();
        let (r, sums) = score_windows(&mut reference, &mut refs, &ws, &mut |i| {
            eprintln!(
                "{name}: window {}/{n} ({:.0} s)",
                i + 1,
                t0.elapsed().as_secs_f64()
            )
        })?;
        println!(
            "| {name} | {} | {:.3} | {} |",
            r.tokens,
            r.perplexity(),
            sums.iter()
                .map(|s| format!(
                    "{:.3} ({:+.1} %) / {:.4} / {:.1} %",
                    s.perplexity(),
                    100.0 * (s.perplexity() / r.perplexity() - 1.0),
                    s.mean_kl(),
                    100.0 * s.top1_agreement()
                ))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        ref_texts.push(text_json(&name, &r));
        for (mt, s) in model_texts.iter_mut().zip(&sums) {
            mt.push(text_json(&name, s));
        }
    }
    // Factual prompts.
    let mut ref_prompts = Json::Null;
    let mut model_prompts = vec![Json::Null; models.len()];
    if a.prompts != "none" {
        let prompts = load_prompts(Path::new(&a.prompts))?;
        let (mut ref_ok, mut ok, mut agree) = (0, vec![0; models.len()], vec![0; models.len()]);
        for p in &prompts {
            let ids = tok.prompt_ids(&p.text, true, None)?;
            let r = tok.decode(&greedy(&mut reference, &tok, &ids, a.max_new)?)?;
            ref_ok += usize::from(is_correct(&r, &p.expected));
            let mut line = format!("{:?} -> ref {:?}", p.text, r);
            for (i, m) in models.iter_mut().enumerate() {
                let c = tok.decode(&greedy(m, &tok, &ids, a.max_new)?)?;
                ok[i] += usize::from(is_correct(&c, &p.expected));
                agree[i] += usize::from(same_start(&c, &r));
                line += &format!(" | {} {:?}", labels[i], c);
            }
            if a.show_prompts {
                println!("{line}");
            }
        }
        let n = prompts.len();
        println!(
            "prompts ({}, {n}): BF16 correct {ref_ok} | {}",
            a.prompts,
            labels
                .iter()
                .enumerate()
                .map(|(i, l)| format!(
                    "{l}: agree {} ({:.1} %), correct {}",
                    agree[i],
                    100.0 * agree[i] as f64 / n as f64,
                    ok[i]
                ))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        ref_prompts = json!({"set": a.prompts, "total": n, "correct": ref_ok});
        for (i, mp) in model_prompts.iter_mut().enumerate() {
            *mp = json!({"set": a.prompts, "total": n, "correct": ok[i], "agree": agree[i],
                         "agreement": agree[i] as f64 / n as f64});
        }
    }
    // Decode speed (one prompt, `decode_tokens` steps; the first model after the
    // reference, in turn).
    let speed = |m: &mut Llama| -> Result<Option<f64>> {
        if a.decode_tokens == 0 {
            return Ok(None);
        }
        let ids = tok.prompt_ids("The history of the city begins", true, None)?;
        Ok(Some(decode_speed(m, &ids, a.decode_tokens)?))
    };
    let ref_speed = speed(&mut reference)?;
    let mut out_models = vec![];
    for (i, m) in models.iter_mut().enumerate() {
        let tps = speed(m)?;
        let (bytes, base) = checkpoint_linear_bytes(&dirs[i])?;
        let file = std::fs::metadata(dirs[i].join("model.safetensors"))
            .map(|m| m.len())
            .ok();
        println!(
            "{}: decoder Linears {bytes} bytes = {:.4}x all-NVFP4 ({base}); file {} bytes; decode {} tok/s",
            labels[i],
            bytes as f64 / base as f64,
            file.unwrap_or(0),
            tps.map(|t| format!("{t:.1}")).unwrap_or_else(|| "-".into())
        );
        out_models.push(json!({
            "label": labels[i], "path": dirs[i], "linear_bytes": bytes, "base_bytes": base,
            "ratio": bytes as f64 / base as f64, "file_bytes": file, "decode_tok_s": tps,
            "texts": model_texts[i], "prompts": model_prompts[i],
        }));
    }
    if let Some(t) = ref_speed {
        println!("reference decode {t:.1} tok/s");
    }
    if let Some(p) = &a.json {
        let (rb, base) = checkpoint_linear_bytes(&ref_dir)?;
        let j = json!({
            "reference": {"label": a.reference, "path": ref_dir, "texts": ref_texts,
                          "prompts": ref_prompts, "decode_tok_s": ref_speed,
                          "linear_bytes": rb, "base_bytes": base},
            "models": out_models, "ctx": a.ctx, "texts": texts,
        });
        std::fs::write(p, serde_json::to_string_pretty(&j)? + "\n")
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    eprintln!("done in {:.0} s", t0.elapsed().as_secs_f64());
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
