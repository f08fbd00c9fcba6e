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
//!
//! `--method gptq --calib-text FILE --calib-tokens N` replaces ModelOpt's round-to-nearest
//! by GPTQ calibrated on the first N tokens of FILE (same checkpoint format; see
//! `candle_fp4_models::quant::gptq`). `--awq` adds AWQ channel scaling before GPTQ, folded
//! into the norms and up_proj (`candle_fp4_models::quant::awq`). The default, `--method
//! rtn`, is byte-identical to ModelOpt.

mod common;

use anyhow::Result;
use candle_fp4_models::quant::gptq::GptqParams;
use candle_fp4_models::quant::{
    quantize_model, CalibData, OutputFormat, QuantMethod, QuantizeOptions,
};
use clap::{Parser, ValueEnum};
use common::cli;
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
    /// rtn: ModelOpt's round-to-nearest (byte-identical); gptq: GPTQ calibrated on
    /// `--calib-text`.
    #[arg(long, value_enum, default_value_t = Method::Rtn)]
    method: Method,
    /// GPTQ: UTF-8 calibration text (tokenized with the model's tokenizer).
    #[arg(long)]
    calib_text: Option<PathBuf>,
    /// GPTQ: use the first N tokens of the calibration text.
    #[arg(long, default_value_t = 2048)]
    calib_tokens: usize,
    /// GPTQ: tokens per calibration window (each from position 0).
    #[arg(long, default_value_t = 512)]
    calib_window: usize,
    /// GPTQ: dampening, as a fraction of the Hessian's mean diagonal.
    #[arg(long, default_value_t = 0.01)]
    damp: f64,
    /// GPTQ: per block, also try this many E4M3 scales below ModelOpt's (and one above)
    /// and keep the one with the lowest GPTQ loss (0 = ModelOpt's scale rule).
    #[arg(long, default_value_t = 0)]
    scale_search: u8,
    /// GPTQ: calibrate every layer on the unquantized model's activations (one pass)
    /// instead of the partly quantized model's (sequential, the default).
    #[arg(long)]
    no_sequential: bool,
    /// GPTQ: process the 16-column blocks in order of decreasing input energy
    /// (block-level act-order).
    #[arg(long)]
    act_order: bool,
    /// GPTQ: activation-aware channel scaling (AWQ) before GPTQ, folded into the norms
    /// and up_proj (the checkpoint stays standard). With --bf16: write the AWQ-scaled
    /// weights unquantized (the quantized model's unquantized equivalent).
    #[arg(long)]
    awq: bool,
}

/// `--method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Method {
    Rtn,
    Gptq,
}

fn run(a: Args) -> Result<()> {
    let t = Instant::now();
    let (pb, mut on_progress) = cli::progress_bar();
    let format = if a.bf16 {
        OutputFormat::Bf16
    } else {
        OutputFormat::Nvfp4
    };
    if a.awq && a.method != Method::Gptq {
        anyhow::bail!("--awq needs --method gptq");
    }
    let method = match a.method {
        Method::Rtn => QuantMethod::Rtn,
        Method::Gptq => {
            let Some(text) = a.calib_text else {
                anyhow::bail!("--method gptq needs --calib-text FILE");
            };
            QuantMethod::Gptq {
                calib: CalibData::TextFile(text),
                calib_tokens: a.calib_tokens,
                window: a.calib_window,
                sequential: !a.no_sequential,
                params: GptqParams {
                    damp: a.damp,
                    scale_search: a.scale_search,
                    act_order: a.act_order,
                },
                awq: a.awq,
            }
        }
    };
    let opts = QuantizeOptions {
        format,
        exclude: a.exclude,
        method,
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
