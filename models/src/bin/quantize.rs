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
//!
//! `--budget R --calib-text FILE` keeps the Linear groups most sensitive per byte in BF16
//! (sensitivity: the KL divergence of the logits with only that group quantized, on the
//! first `--sens-tokens` tokens of FILE) so that the decoder Linears take at most R times
//! their all-NVFP4 bytes; they are listed in `exclude_modules` (`candle_fp4_models::mix`).

mod common;

use anyhow::Result;
use candle_fp4_models::mix::{quantize_with_budget, MixOptions};
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
    /// Byte budget of the decoder Linears relative to all-NVFP4 (e.g. 1.25): the groups
    /// most sensitive per byte (measured on `--calib-text`) stay BF16, listed in
    /// `exclude_modules` (candle_fp4_models::mix).
    #[arg(long)]
    budget: Option<f64>,
    /// `--budget`: calibration tokens the sensitivities are measured on.
    #[arg(long, default_value_t = 512)]
    sens_tokens: usize,
    /// `--budget`: reuse the sensitivities of an earlier run's `mix_plan.json`.
    #[arg(long)]
    sens_from: Option<PathBuf>,
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
            let Some(text) = a.calib_text.clone() else {
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
    let r = match a.budget {
        None => quantize_model(&a.input, &a.output, &opts, &mut on_progress),
        Some(budget) => {
            let Some(text) = a.calib_text.clone() else {
                anyhow::bail!(
                    "--budget needs --calib-text FILE (the sensitivities are measured on it)"
                );
            };
            let mix = MixOptions {
                budget,
                sens_tokens: a.sens_tokens,
                sens_window: a.calib_window,
                sensitivity_file: a.sens_from.clone(),
            };
            let calib = CalibData::TextFile(text);
            let p = pb.clone();
            let mut on_group =
                move |d: usize, t: usize| p.set_message(format!("sensitivity {d}/{t}"));
            quantize_with_budget(
                &a.input,
                &a.output,
                &opts,
                &mix,
                &calib,
                &mut on_group,
                &mut on_progress,
            )
            .map(|(s, plan)| {
                if let Some(sel) = &plan.selection {
                    pb.suspend(|| {
                        println!(
                            "budget {budget}: {} groups BF16, decoder Linears {} of {} bytes allowed ({:.4}x all-NVFP4)",
                            sel.bf16.len(),
                            sel.bytes,
                            sel.budget_bytes,
                            sel.ratio()
                        )
                    });
                }
                s
            })
        }
    };
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
