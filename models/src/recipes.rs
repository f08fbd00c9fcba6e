//! Named quantization recipes, the SmolLM2 default among them, and the cache key of a
//! conversion made with one (recipe settings, calibration text and
//! [`CONVERTER_VERSION`]), so that a stale conversion is never reused.

use crate::config::LlamaConfig;
use crate::mix::{quantize_with_budget, MixOptions, MixPlan};
use crate::quant::gptq::GptqParams;
use crate::quant::{
    quantize_model, CalibData, OutputFormat, Progress, QuantMethod, QuantizeOptions, Summary,
};
use crate::tokenizer::TextTokenizer;
use anyhow::{bail, Result};
use std::path::Path;

/// Version of the conversion code as far as cached checkpoints are concerned: bump it
/// whenever a change to the quantizer (RTN, GPTQ, AWQ, sensitivities, selection) or to a
/// recipe would change what a recipe writes.
pub const CONVERTER_VERSION: u32 = 1;

/// The shipped calibration text (`tests/data/text/calib/calib_mix.txt`: prose, Python
/// source and Python reference prose interleaved; none of the evaluation texts).
pub const CALIB_MIX: &str = include_str!("../../tests/data/text/calib/calib_mix.txt");

/// First token of [`CALIB_MIX`]'s tuning split (`eval --text calib_mix.txt@4096`): recipe
/// settings are chosen on the tokens from here on, so no recipe calibrates past it.
pub const TUNING_SPLIT_START: usize = 4096;

/// GPTQ (+ AWQ) settings of a recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct GptqRecipe {
    /// Dampening (fraction of the Hessian's mean diagonal).
    pub damp: f64,
    /// E4M3 scales tried below ModelOpt's.
    pub scale_search: u8,
    /// AWQ channel scaling before GPTQ.
    pub awq: bool,
    /// Calibration tokens (the first ones of [`CALIB_MIX`]).
    pub calib_tokens: usize,
    /// Tokens per calibration window (each window runs from position 0).
    pub calib_window: usize,
}

/// A named recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct Recipe {
    /// Short name (`--recipe`, the cache folder's prefix).
    pub name: &'static str,
    /// `None`: ModelOpt's round-to-nearest.
    pub gptq: Option<GptqRecipe>,
    /// Byte budget of the decoder Linears relative to all-NVFP4 (1 = all NVFP4).
    pub budget: f64,
    /// Calibration tokens the sensitivities are measured on (with a budget above 1).
    pub sens_tokens: usize,
}

// 4,096 calibration tokens in 128-token windows: chosen on the tuning split over 2,048 in
// 512-token windows (KL 0.0555 -> 0.0468, tuning prompts agreeing 23 -> 30 of 40;
// docs/accuracy.md, "More, shorter calibration windows"). The tokens end where the
// tuning split (tokens 4,096 on) begins.
const GPTQ_AWQ: GptqRecipe = GptqRecipe {
    damp: 0.1,
    scale_search: 3,
    awq: true,
    calib_tokens: 4096,
    calib_window: 128,
};

/// The recipes, by name.
pub fn all() -> Vec<Recipe> {
    // 256 sensitivity tokens: the measurement costs ~140 s of CPU time on SmolLM2 (one
    // pass over the rest of the model per group), so that with GPTQ + AWQ the whole
    // conversion stays under 300 s of CPU time, i.e. under 5 minutes on 2 cores.
    let mix = |name, budget| Recipe {
        name,
        gptq: Some(GPTQ_AWQ),
        budget,
        sens_tokens: 256,
    };
    vec![
        Recipe {
            name: "rtn",
            gptq: None,
            budget: 1.0,
            sens_tokens: 0,
        },
        mix("gptq-awq", 1.0),
        mix("gptq-awq-mix1.1", 1.1),
        mix("gptq-awq-mix1.25", 1.25),
        mix("gptq-awq-mix1.5", 1.5),
    ]
}

/// The recipe of `llama_decode --model smollm2` (and the `smollm2` model of every tool).
pub const DEFAULT_RECIPE: &str = "gptq-awq-mix1.25";

/// The recipe called `name`.
pub fn by_name(name: &str) -> Result<Recipe> {
    match all().into_iter().find(|r| r.name == name) {
        Some(r) => Ok(r),
        None => bail!(
            "unknown recipe `{name}` (known: {})",
            all().iter().map(|r| r.name).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// 64-bit FNV-1a (stable across Rust versions, unlike `DefaultHasher`).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl Recipe {
    /// The cache key: `<name>-<16 hex digits>` over the settings, the calibration text
    /// (when it is used) and [`CONVERTER_VERSION`].
    pub fn key(&self) -> String {
        let mut s = format!("{self:?}|converter {CONVERTER_VERSION}|");
        if self.gptq.is_some() || self.budget > 1.0 {
            s.push_str(CALIB_MIX);
        }
        format!("{}-{:016x}", self.name, fnv1a(s.as_bytes()))
    }

    /// The quantizer options of this recipe for the BF16 model in `dir` (whose tokenizer
    /// tokenizes [`CALIB_MIX`]), and the calibration tokens.
    pub fn options(&self, dir: &Path) -> Result<(QuantizeOptions, CalibData)> {
        let cfg = LlamaConfig::from_dir(dir)?;
        let ids = TextTokenizer::from_dir(dir, &cfg)?.encode(CALIB_MIX, true)?;
        let calib = CalibData::TokenIds(ids);
        let method = match &self.gptq {
            None => QuantMethod::Rtn,
            Some(g) => QuantMethod::Gptq {
                calib: calib.clone(),
                calib_tokens: g.calib_tokens,
                window: g.calib_window,
                sequential: true,
                params: GptqParams {
                    damp: g.damp,
                    scale_search: g.scale_search,
                    act_order: false,
                },
                awq: g.awq,
            },
        };
        let opts = QuantizeOptions {
            format: OutputFormat::Nvfp4,
            exclude: vec![],
            method,
        };
        Ok((opts, calib))
    }

    /// Converts the BF16 Hugging Face folder `dir` into `output` with this recipe.
    pub fn quantize(
        &self,
        dir: &Path,
        output: &Path,
        on_group: &mut dyn FnMut(usize, usize),
        on_progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<(Summary, Option<MixPlan>)> {
        let (opts, calib) = self.options(dir)?;
        if self.budget > 1.0 {
            let mix = MixOptions {
                budget: self.budget,
                sens_tokens: self.sens_tokens,
                sens_window: 512,
                sensitivity_file: None,
            };
            let (s, p) =
                quantize_with_budget(dir, output, &opts, &mix, &calib, on_group, on_progress)?;
            return Ok((s, Some(p)));
        }
        Ok((quantize_model(dir, output, &opts, on_progress)?, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ_by_recipe_and_are_stable() {
        let keys: Vec<String> = all().iter().map(Recipe::key).collect();
        let mut uniq = keys.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), keys.len());
        assert_eq!(by_name("rtn").unwrap().key(), by_name("rtn").unwrap().key());
        // A changed setting changes the key.
        let mut r = by_name(DEFAULT_RECIPE).unwrap();
        let k = r.key();
        r.sens_tokens += 1;
        assert_ne!(r.key(), k);
        let mut w = by_name(DEFAULT_RECIPE).unwrap();
        w.gptq.as_mut().unwrap().calib_window = 512;
        assert_ne!(w.key(), k);
        // The calibration tokens end where the tuning split begins.
        let g = by_name(DEFAULT_RECIPE).unwrap().gptq.unwrap();
        assert!(g.calib_tokens <= TUNING_SPLIT_START);
        assert!(k.starts_with(DEFAULT_RECIPE));
        assert!(by_name("nope").is_err());
        // FNV-1a's published test vector.
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
