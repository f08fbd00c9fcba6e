//! Quantize a Llama to a ModelOpt-compatible NVFP4 checkpoint.
//!
//! ```sh
//! cargo run --release -p candle-fp4-models --bin quantize -- INPUT OUTPUT
//! ```
//!
//! INPUT is a Hugging Face model folder (safetensors in BF16/F16/F32 + config.json) or a
//! llama.cpp `.gguf` (dequantized, rounded to BF16, requantized). OUTPUT gets
//! `model.safetensors`, `config.json` (with `quantization_config`),
//! `hf_quant_config.json` and the tokenizer files. `--bf16` writes the plain BF16
//! checkpoint instead (e.g. a GGUF converted to Hugging Face form).

use anyhow::Result;
use candle_fp4_models::cli;
use candle_fp4_models::quantize::{quantize_model, OutputFormat, QuantizeOptions};
use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "HF safetensors or GGUF Llama → ModelOpt NVFP4 (W4A16) checkpoint")]
struct Args {
    /// A Hugging Face model folder or a .gguf file.
    input: PathBuf,
    /// Output folder (created; must not exist or be empty).
    output: PathBuf,
    /// Write BF16 instead of NVFP4 (no quantization).
    #[arg(long)]
    bf16: bool,
    /// Also keep these modules in 16 bits (fnmatch patterns, ModelOpt's
    /// `exclude_modules` syntax, e.g. `*.down_proj`); repeatable. Without it the output
    /// is exactly what ModelOpt writes.
    #[arg(long)]
    exclude: Vec<String>,
}

fn run(a: Args) -> Result<()> {
    let t = Instant::now();
    let (pb, mut on_progress) = cli::progress_bar();
    let format = if a.bf16 {
        OutputFormat::Bf16
    } else {
        OutputFormat::Nvfp4
    };
    let opts = QuantizeOptions {
        format,
        exclude: a.exclude,
    };
    let r = quantize_model(&a.input, &a.output, &opts, &mut on_progress);
    pb.finish_and_clear();
    let s = r?;
    println!(
        "wrote {}: {} linears NVFP4, {} tensors kept, {:.1} MB, {:.1}s",
        s.output.display(),
        s.quantized,
        s.kept,
        s.bytes as f64 / 1e6,
        t.elapsed().as_secs_f64()
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
