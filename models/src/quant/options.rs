//! What [`super::quantize_model`] is asked to do ([`QuantizeOptions`]) and the checks of
//! those options that need no model.

use super::gptq::GptqParams;
use anyhow::{bail, Result};
use std::path::PathBuf;

/// What to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputFormat {
    /// ModelOpt NVFP4 (W4A16).
    #[default]
    Nvfp4,
    /// Plain BF16 Hugging Face checkpoint (the GGUF → HF conversion alone; the BF16
    /// reference for quality checks).
    Bf16,
}

/// What [`quantize_model`](super::quantize_model) writes.
#[derive(Debug, Clone, Default)]
pub struct QuantizeOptions {
    /// NVFP4 (the quantizer) or BF16 (a conversion, e.g. of a GGUF).
    pub format: OutputFormat,
    /// Modules to keep in 16 bits besides ModelOpt's defaults
    /// ([`DEFAULT_EXCLUDE`](super::rtn::DEFAULT_EXCLUDE)):
    /// fnmatch patterns as in ModelOpt's `exclude_modules` (e.g. `*.down_proj`,
    /// `model.layers.0.*`); recorded in the output's quant config. Empty = ModelOpt's
    /// exact behaviour.
    pub exclude: Vec<String>,
    /// How NVFP4 codes and block scales are chosen (the format written is the same).
    pub method: QuantMethod,
}

/// How the NVFP4 weights are chosen.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum QuantMethod {
    /// ModelOpt's round-to-nearest, byte-identical to its export.
    #[default]
    Rtn,
    /// GPTQ ([`super::gptq`]) calibrated on text run through the unquantized model.
    /// Global scales and their sharing stay ModelOpt's; codes and block scales differ.
    Gptq {
        /// The calibration tokens.
        calib: CalibData,
        /// Use the first this many tokens (the text must have at least this many).
        calib_tokens: usize,
        /// Tokens per calibration window (each window starts at position 0), capped at
        /// the model's `max_position_embeddings`.
        window: usize,
        /// Calibrate each group on the activations of the model quantized so far (blocks
        /// before it and the groups before it in its block), as GPTQ's sequential mode;
        /// `false`: one pass of the unquantized model gives every Hessian.
        sequential: bool,
        /// GPTQ settings.
        params: GptqParams,
        /// AWQ channel scaling ([`super::awq`]) before GPTQ, folded into the RMSNorm
        /// weights (written rescaled) and up_proj's rows; needs `sequential`. With
        /// [`OutputFormat::Bf16`] the AWQ-scaled weights are written unquantized in BF16
        /// (the quantized model's unquantized equivalent, for checks).
        awq: bool,
    },
}

/// Calibration data for [`QuantMethod::Gptq`].
#[derive(Debug, Clone, PartialEq)]
pub enum CalibData {
    /// A UTF-8 text file, tokenized with the model's tokenizer as the perplexity tool
    /// does (whole text, special tokens as the tokenizer adds them).
    TextFile(PathBuf),
    /// Token ids.
    TokenIds(Vec<u32>),
}

/// The fewest calibration tokens GPTQ accepts.
pub const MIN_CALIB_TOKENS: usize = 16;

/// Checks the GPTQ options that need no model.
pub(super) fn check_gptq_options(opts: &QuantizeOptions) -> Result<()> {
    let QuantMethod::Gptq {
        calib,
        calib_tokens,
        window,
        params,
        sequential,
        awq,
    } = &opts.method
    else {
        return Ok(());
    };
    if opts.format != OutputFormat::Nvfp4 && !awq {
        bail!(
            "GPTQ needs the NVFP4 output format (it chooses NVFP4 codes; a BF16 output has none)"
        );
    }
    if *awq && !sequential {
        bail!("AWQ scaling needs sequential GPTQ calibration (drop --no-sequential)");
    }
    if *calib_tokens < MIN_CALIB_TOKENS {
        bail!("GPTQ needs at least {MIN_CALIB_TOKENS} calibration tokens, {calib_tokens} asked");
    }
    if *window < 2 {
        bail!("GPTQ calibration windows need at least 2 tokens, {window} asked");
    }
    if !(params.damp.is_finite() && params.damp >= 0.0) {
        bail!("GPTQ dampening {} must be a finite number ≥ 0", params.damp);
    }
    match calib {
        CalibData::TextFile(p) if !p.is_file() => {
            bail!("calibration text {}: no such file", p.display())
        }
        CalibData::TokenIds(ids) if ids.len() < *calib_tokens => bail!(
            "{} calibration tokens given, {calib_tokens} asked",
            ids.len()
        ),
        _ => Ok(()),
    }
}
