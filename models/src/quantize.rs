//! The NVFP4 quantizer: a Hugging Face Llama (safetensors in BF16/F16/F32 + config.json)
//! or a llama.cpp GGUF (dequantized, rounded to BF16, then requantized) → a
//! ModelOpt-compatible NVFP4 checkpoint.
//!
//! What ModelOpt 0.47 (`W4A16_NVFP4_CFG` / `NVFP4_DEFAULT_CFG` + `export_hf_checkpoint`)
//! does, and so what this writes:
//!
//! * every Linear of the decoder layers (`q/k/v/o_proj`, `gate/up/down_proj`) becomes
//!   `weight` U8 `[N, K/2]`, `weight_scale` F8_E4M3 `[N, K/16]`, `weight_scale_2` F32 `[]`;
//! * `lm_head` and `model.embed_tokens` are excluded (kept as they are), as are the norms;
//! * q/k/v share one global scale (the largest of their own `amax / 2688`), and so do
//!   gate/up; block scales are computed against the shared value
//!   ([`candle_fp4::nvfp4::quantize_nvfp4_slice`], bit-exact with ModelOpt);
//! * `model.safetensors` is written by the same serializer as Python's `safetensors`
//!   (the Rust crate it wraps), with metadata `{"format": "pt"}`.
//!
//! No activation calibration is done, so there is no `input_scale` and the algorithm is
//! recorded as `W4A16_NVFP4` (ModelOpt's W4A16 export is its NVFP4 export minus the
//! `input_scale` tensors). `config.json` gets ModelOpt's `quantization_config` block and
//! `hf_quant_config.json` is written next to it; tokenizer files are copied (or, from a
//! GGUF, built from its metadata).
//!
//! All of the above is the default method, [`QuantMethod::Rtn`]. [`QuantMethod::Gptq`]
//! picks the codes and block scales with GPTQ ([`crate::gptq`]) calibrated on text run
//! through the unquantized model instead; everything else (tensors, layouts, global
//! scales and their sharing, exclusions, json files) is the same. With `awq` it also
//! rescales input channels ([`crate::awq`]; with `awq_vo` o_proj's too, through v_proj's
//! rows): the RMSNorm weights are written rescaled and the global scales are those of
//! the scaled weights. With `asym` (asymmetric calibration, GPTAQ) GPTQ rounds weights
//! fitted to reproduce the unquantized model's outputs from the partly quantized model's
//! inputs ([`crate::gptq::asym_target`]); global scales are those of the fitted weights.

use crate::calib::{gptq_llama, CalibRun};
use crate::config::LlamaConfig;
use crate::gguf::GgufModel;
use crate::gptq::GptqParams;
use crate::norm_tweak::NormTweakParams;
use crate::tokenizer::TextTokenizer;
use crate::{KvCacheKind, Llama, LoadOptions};
use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_fp4::checkpoint::Checkpoint;
use candle_fp4::nvfp4::{global_scale_for_amax, quantize_nvfp4_slice, Nvfp4Quantized, BLOCK_SIZE};
use candle_fp4::quant_config::QuantConfig;
use half::{bf16, f16};
use safetensors::tensor::{Dtype as StDtype, View};
use serde_json::{json, Value as Json};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Modules ModelOpt leaves unquantized in a Llama.
pub const DEFAULT_EXCLUDE: [&str; 2] = ["lm_head", "model.embed_tokens"];

/// Tokenizer / generation files copied from a Hugging Face folder when present.
pub const TOKENIZER_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
];

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

/// What [`quantize_model`] writes.
#[derive(Debug, Clone, Default)]
pub struct QuantizeOptions {
    pub format: OutputFormat,
    /// Modules to keep in 16 bits besides ModelOpt's defaults ([`DEFAULT_EXCLUDE`]):
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
    /// GPTQ ([`crate::gptq`]) calibrated on text run through the unquantized model.
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
        /// AWQ channel scaling ([`crate::awq`]) before GPTQ, folded into the RMSNorm
        /// weights (written rescaled) and up_proj's rows; needs `sequential`. With
        /// [`OutputFormat::Bf16`] the AWQ-scaled weights are written unquantized in BF16
        /// (the quantized model's unquantized equivalent, for checks).
        awq: bool,
        /// With `awq`: also scale o_proj's input channels, one scale per (KV head, head
        /// dimension) shared by the query heads of a group, folded into v_proj's rows
        /// ([`crate::awq::GqaLayout`]). Off by default: on SmolLM2 it did not lower
        /// GPTQ's o_proj loss and did not help on the tuning split (`docs/accuracy.md`).
        /// Models with attention biases are refused.
        awq_vo: bool,
        /// Asymmetric calibration (GPTAQ, [`crate::gptq::asym_target`]): fit each group
        /// so that, fed the partly quantized model's inputs, it reproduces the
        /// unquantized model's output of that group (inputs from a second copy of the
        /// unquantized model on the same tokens), instead of its own output on the same
        /// inputs. Global scales are those of the fitted weights. Needs `sequential` and
        /// the NVFP4 output format.
        asym: bool,
        /// Norm tweaking ([`crate::norm_tweak`]): after each block's Linears are
        /// quantized, tune its two RMSNorm weights so that the block's output matches the
        /// unquantized block's on the same calibration inputs (written rounded to the
        /// norms' dtype). Needs `sequential` and the NVFP4 output format.
        norm_tweak: Option<NormTweakParams>,
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

/// Progress of [`quantize_model`]: `done` of `total` tensors written so far.
#[derive(Debug, Clone)]
pub struct Progress<'a> {
    pub done: usize,
    pub total: usize,
    pub name: &'a str,
}

/// A finished conversion.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub output: PathBuf,
    /// Linears quantized to NVFP4.
    pub quantized: usize,
    /// Tensors copied unquantized.
    pub kept: usize,
    pub bytes: u64,
    /// Norm tweaking: per block, the block-output loss before and after, and whether the
    /// tweaked norms were kept.
    pub norm_tweak: Vec<(usize, f64, f64, bool)>,
}

/// An owned tensor for the safetensors writer.
#[derive(Debug, Clone)]
pub struct OwnedTensor {
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl View for &OwnedTensor {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The safetensors dtype of a candle dtype (every dtype a checkpoint can hold maps back).
fn st_dtype(dt: DType) -> Result<StDtype> {
    Ok(StDtype::from(dt))
}

/// Serializes `tensors` as Python's `safetensors.torch.save_file(..., metadata={"format": "pt"})` does.
pub fn write_safetensors(tensors: &[(String, OwnedTensor)], path: &Path) -> Result<()> {
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize_to_file(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        Some(meta),
        path,
    )
    .with_context(|| format!("cannot write {}", path.display()))
}

/// The NVFP4 tensors of one Linear `prefix`, in ModelOpt's names and dtypes.
pub fn nvfp4_tensors(prefix: &str, q: &Nvfp4Quantized) -> Vec<(String, OwnedTensor)> {
    vec![
        (
            format!("{prefix}.weight"),
            OwnedTensor {
                dtype: StDtype::U8,
                shape: vec![q.n, q.k / 2],
                data: q.weight.clone(),
            },
        ),
        (
            format!("{prefix}.weight_scale"),
            OwnedTensor {
                dtype: StDtype::F8_E4M3,
                shape: vec![q.n, q.k / BLOCK_SIZE],
                data: q.weight_scale.clone(),
            },
        ),
        (
            format!("{prefix}.weight_scale_2"),
            OwnedTensor {
                dtype: StDtype::F32,
                shape: vec![],
                data: q.global_scale.to_le_bytes().to_vec(),
            },
        ),
    ]
}

/// Quantizes a group of Linears that share one global scale (q/k/v, gate/up, or a
/// single layer): each `(values, n, k)` is a row-major F32 weight.
pub fn quantize_group(weights: &[(Vec<f32>, usize, usize)]) -> Result<Vec<Nvfp4Quantized>> {
    let mut shared = 0f32;
    for (w, n, k) in weights {
        if n.checked_mul(*k) != Some(w.len()) {
            bail!("quantize_group: {} values for [{n}, {k}]", w.len());
        }
        let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        shared = shared.max(global_scale_for_amax(amax));
    }
    weights
        .iter()
        .map(|(w, n, k)| Ok(quantize_nvfp4_slice(w, *n, *k, Some(shared))?))
        .collect()
}

/// Where the weights come from.
enum Source {
    Hf {
        dir: PathBuf,
        ckpt: Checkpoint,
        config: Json,
    },
    Gguf(Box<GgufModel>),
}

impl Source {
    fn open(input: &Path) -> Result<Self> {
        if input.is_file() {
            let mut magic = [0u8; 4];
            use std::io::Read;
            std::fs::File::open(input)
                .and_then(|mut f| f.read_exact(&mut magic))
                .with_context(|| format!("cannot read {}", input.display()))?;
            if &magic != b"GGUF" {
                bail!(
                    "{}: not a GGUF file (give a GGUF or a Hugging Face model folder)",
                    input.display()
                );
            }
            return Ok(Self::Gguf(Box::new(GgufModel::open(input)?)));
        }
        if !input.is_dir() {
            bail!("{}: no such file or folder", input.display());
        }
        let cpath = input.join("config.json");
        let text = crate::config::read_config_text(input)?;
        let config: Json = serde_json::from_str(&text)
            .with_context(|| format!("{}: invalid JSON", cpath.display()))?;
        if QuantConfig::from_dir(input)?.quantizes() {
            bail!("{}: the checkpoint is already quantized", input.display());
        }
        // SAFETY: read-only mapping of the input files, not modified during the run.
        let ckpt = unsafe { Checkpoint::open(input)? };
        Ok(Self::Hf {
            dir: input.to_path_buf(),
            ckpt,
            config,
        })
    }

    fn config(&self) -> Result<Json> {
        match self {
            Self::Hf { config, .. } => Ok(config.clone()),
            Self::Gguf(g) => g.config_json(),
        }
    }

    fn names(&self) -> Vec<String> {
        match self {
            Self::Hf { ckpt, .. } => ckpt.names().into_iter().map(str::to_string).collect(),
            Self::Gguf(g) => g.hf_names(),
        }
    }

    /// The tensor as stored (HF) or as BF16 (GGUF, dequantized then rounded).
    fn raw(&self, name: &str) -> Result<OwnedTensor> {
        match self {
            Self::Hf { ckpt, .. } => {
                let t = ckpt.get(name)?;
                Ok(OwnedTensor {
                    dtype: st_dtype(t.dtype).with_context(|| format!("tensor `{name}`"))?,
                    shape: t.shape.clone(),
                    data: t.data.to_vec(),
                })
            }
            Self::Gguf(g) => {
                let t = g.tensor_f32(name)?.to_dtype(DType::BF16)?;
                let shape = t.dims().to_vec();
                let v = t.flatten_all()?.to_vec1::<bf16>()?;
                let data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Ok(OwnedTensor {
                    dtype: StDtype::BF16,
                    shape,
                    data,
                })
            }
        }
    }

    /// The shape `[n, k]` of a 2-d tensor.
    fn matrix_shape(&self, name: &str) -> Result<(usize, usize)> {
        let shape = match self {
            Self::Hf { ckpt, .. } => ckpt.get(name)?.shape.clone(),
            Self::Gguf(_) => self.raw(name)?.shape,
        };
        match shape.as_slice() {
            [n, k] => Ok((*n, *k)),
            s => bail!("tensor `{name}` has shape {s:?}, expected a 2-d Linear weight"),
        }
    }

    /// A 2-d float weight as F32 values (exact from BF16/F16).
    fn matrix_f32(&self, name: &str) -> Result<(Vec<f32>, usize, usize)> {
        let t = self.raw(name)?;
        let (n, k) = match t.shape.as_slice() {
            [n, k] => (*n, *k),
            s => bail!("tensor `{name}` has shape {s:?}, expected a 2-d Linear weight"),
        };
        let v: Vec<f32> = match t.dtype {
            StDtype::BF16 => t
                .data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            StDtype::F16 => t
                .data
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            StDtype::F32 => t
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            d => bail!("tensor `{name}` is {d:?}; the quantizer reads BF16, F16 or F32 weights"),
        };
        Ok((v, n, k))
    }
}

/// The groups of Linears (by module prefix) that share a global scale, for a Llama.
fn linear_groups(names: &[String]) -> Vec<Vec<String>> {
    let mut layers: Vec<usize> = names
        .iter()
        .filter_map(|n| {
            n.strip_prefix("model.layers.")?
                .split_once('.')?
                .0
                .parse()
                .ok()
        })
        .collect();
    layers.sort_unstable();
    layers.dedup();
    let has = |p: &str| names.iter().any(|n| n == &format!("{p}.weight"));
    let mut groups = vec![];
    for i in layers {
        let a = format!("model.layers.{i}.self_attn");
        let m = format!("model.layers.{i}.mlp");
        for g in [
            vec![
                format!("{a}.q_proj"),
                format!("{a}.k_proj"),
                format!("{a}.v_proj"),
            ],
            vec![format!("{a}.o_proj")],
            vec![format!("{m}.gate_proj"), format!("{m}.up_proj")],
            vec![format!("{m}.down_proj")],
        ] {
            let present: Vec<String> = g.into_iter().filter(|p| has(p)).collect();
            if !present.is_empty() {
                groups.push(present);
            }
        }
    }
    groups
}

/// ModelOpt's `quantization_config` block (W4A16 form) for `config.json`.
pub fn quantization_config_block(exclude: &[String]) -> Json {
    json!({
        "config_groups": {"group_0": {
            "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
            "targets": ["Linear"]}},
        "ignore": exclude,
        "quant_algo": "W4A16_NVFP4",
        "producer": {"name": "candle-fp4", "version": env!("CARGO_PKG_VERSION")},
        "quant_method": "modelopt",
    })
}

/// `hf_quant_config.json`, as ModelOpt writes it.
pub fn hf_quant_config(exclude: &[String]) -> Json {
    json!({
        "producer": {"name": "candle-fp4", "version": env!("CARGO_PKG_VERSION")},
        "quantization": {
            "quant_algo": "W4A16_NVFP4",
            "kv_cache_quant_algo": null,
            "group_size": 16,
            "exclude_modules": exclude,
        }
    })
}

fn write_json(path: &Path, v: &Json) -> Result<()> {
    let text = serde_json::to_string_pretty(v)?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))
}

/// Checks the GPTQ options that need no model.
fn check_gptq_options(opts: &QuantizeOptions) -> Result<()> {
    let QuantMethod::Gptq {
        calib,
        calib_tokens,
        window,
        params,
        sequential,
        awq,
        awq_vo,
        asym,
        norm_tweak,
    } = &opts.method
    else {
        return Ok(());
    };
    if let Some(p) = norm_tweak {
        if !sequential {
            bail!("norm tweaking (--norm-tweak) needs sequential GPTQ calibration (drop --no-sequential)");
        }
        if opts.format != OutputFormat::Nvfp4 {
            bail!("norm tweaking (--norm-tweak) tunes the norms of the NVFP4 model; it needs the NVFP4 output format");
        }
        p.check()?;
    }
    if *asym && !sequential {
        bail!(
            "asymmetric calibration (--asym) needs sequential GPTQ calibration \
             (drop --no-sequential)"
        );
    }
    if *asym && opts.format != OutputFormat::Nvfp4 {
        bail!(
            "asymmetric calibration (--asym) only changes NVFP4 weights; it needs the NVFP4 \
             output format"
        );
    }
    if opts.format != OutputFormat::Nvfp4 && !awq {
        bail!(
            "GPTQ needs the NVFP4 output format (it chooses NVFP4 codes; a BF16 output has none)"
        );
    }
    if *awq && !sequential {
        bail!("AWQ scaling needs sequential GPTQ calibration (drop --no-sequential)");
    }
    if *awq_vo && !awq {
        bail!("scaling o_proj through v_proj (--awq-vo) is part of AWQ: it needs --awq");
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

/// A sibling path of `p` for a temporary folder.
fn sibling_tmp(p: &Path, tag: &str) -> PathBuf {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    p.with_file_name(format!(".{name}.{tag}-{}", std::process::id()))
}

/// Converts `input` (a Hugging Face Llama folder or a `.gguf`) into `output` (created;
/// it must not exist or be empty). `on_progress` is called after every tensor.
///
/// With [`QuantMethod::Gptq`] the unquantized model is run over the calibration tokens
/// first (a GGUF is converted to a temporary BF16 folder next to `output` for that, and
/// the weights are read from there: the same BF16 values).
///
/// The files are written into a staging folder next to `output` and moved into place
/// only when complete ([`crate::staging::write_atomically`]): a failed run leaves `output`
/// as it was.
pub fn quantize_model(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Summary> {
    check_gptq_options(opts)?;
    let mut s = crate::staging::write_atomically(output, |staging| {
        quantize_model_staged(input, staging, opts, on_progress)
    })?;
    s.output = output.to_path_buf();
    Ok(s)
}

fn quantize_model_staged(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Summary> {
    if matches!(opts.method, QuantMethod::Gptq { .. }) && input.is_file() {
        let tmp = sibling_tmp(output, "bf16");
        let _ = std::fs::remove_dir_all(&tmp);
        let bf16 = QuantizeOptions {
            format: OutputFormat::Bf16,
            ..Default::default()
        };
        let r = quantize_model(input, &tmp, &bf16, &mut |_| {})
            .and_then(|_| quantize_model_from(&tmp, output, opts, on_progress));
        let _ = std::fs::remove_dir_all(&tmp);
        return r;
    }
    quantize_model_from(input, output, opts, on_progress)
}

/// The calibration token windows of a GPTQ run on the model in `dir`.
fn calib_windows(
    dir: &Path,
    cfg: &LlamaConfig,
    calib: &CalibData,
    calib_tokens: usize,
    window: usize,
) -> Result<Vec<Vec<u32>>> {
    let ids = match calib {
        CalibData::TokenIds(ids) => ids.clone(),
        CalibData::TextFile(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read the calibration text {}", p.display()))?;
            let tok = TextTokenizer::from_dir(dir, cfg)
                .context("GPTQ tokenizes the calibration text with the model's tokenizer")?;
            tok.encode(&text, true)?
        }
    };
    if ids.len() < calib_tokens {
        bail!(
            "the calibration data has {} tokens, {calib_tokens} asked",
            ids.len()
        );
    }
    let window = window.min(cfg.max_position_embeddings).max(2);
    Ok(ids[..calib_tokens]
        .chunks(window)
        .filter(|w| w.len() >= 2)
        .map(<[u32]>::to_vec)
        .collect())
}

fn quantize_model_from(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Summary> {
    let format = opts.format;
    let src = Source::open(input)?;
    let mut config = src.config()?;
    // Fail early on a model this port cannot run, or whose config and weights disagree.
    let corigin = format!("{}: config", input.display());
    let cfg = LlamaConfig::from_json_str(&config.to_string(), &corigin)?;
    crate::validate::check_layer_count(
        &cfg,
        &corigin,
        &input.display().to_string(),
        &src.names().iter().map(String::as_str).collect::<Vec<_>>(),
    )?;
    if output.exists() {
        let empty = std::fs::read_dir(output)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
        if !empty {
            bail!(
                "{}: output folder exists and is not empty",
                output.display()
            );
        }
    }
    std::fs::create_dir_all(output)
        .with_context(|| format!("cannot create {}", output.display()))?;

    let names = src.names();
    let mut exclude: Vec<String> = DEFAULT_EXCLUDE.iter().map(|s| s.to_string()).collect();
    for e in &opts.exclude {
        if !exclude.contains(e) {
            exclude.push(e.clone());
        }
    }
    let matcher = QuantConfig {
        exclude: exclude.clone(),
        ..QuantConfig::unquantized()
    };
    // `--bf16` with AWQ: the AWQ-scaled weights, unquantized.
    let awq_reference =
        format == OutputFormat::Bf16 && matches!(opts.method, QuantMethod::Gptq { awq: true, .. });
    let mut groups: Vec<Vec<String>> = vec![];
    if format == OutputFormat::Nvfp4 || awq_reference {
        for g in linear_groups(&names) {
            if !g.iter().any(|p| matcher.is_excluded(p)) {
                groups.push(g);
                continue;
            }
            // A group sharing a global scale is kept or quantized whole: name the members
            // the patterns did not cover, so that loaders see them as excluded too.
            for p in g {
                if !matcher.is_excluded(&p) {
                    exclude.push(p);
                }
            }
        }
    }
    let quantized: std::collections::HashSet<String> = groups
        .iter()
        .flatten()
        .map(|p| format!("{p}.weight"))
        .collect();
    let total = names.len();
    let mut done = 0;
    let mut out: Vec<(String, OwnedTensor)> = Vec::with_capacity(total + 2 * quantized.len());
    let mut summary = Summary {
        output: output.to_path_buf(),
        ..Default::default()
    };
    for g in &groups {
        for p in g {
            let (_, k) = src.matrix_shape(&format!("{p}.weight"))?;
            if !k.is_multiple_of(BLOCK_SIZE) {
                bail!("`{p}` has in_features {k}, not a multiple of {BLOCK_SIZE}: NVFP4 cannot quantize it");
            }
        }
    }
    let mut gptq = match &opts.method {
        QuantMethod::Rtn => None,
        QuantMethod::Gptq {
            calib,
            calib_tokens,
            window,
            sequential,
            params,
            awq,
            awq_vo,
            asym,
            norm_tweak,
        } => {
            let Source::Hf { dir, .. } = &src else {
                bail!("GPTQ reads a Hugging Face folder (a GGUF goes through a BF16 copy)");
            };
            let cfg = LlamaConfig::from_dir(dir)?;
            let windows = calib_windows(dir, &cfg, calib, *calib_tokens, *window)?;
            let longest = windows.iter().map(Vec::len).max().unwrap_or(2);
            let lopts = LoadOptions {
                kv_cache: KvCacheKind::Bf16,
                max_seq_len: Some(longest),
                dtype: None,
                prefill_chunk: longest,
                kv_window: 0,
                ..Default::default()
            };
            let mut model = Llama::load(dir, &candle_core::Device::Cpu, &lopts)
                .context("loading the unquantized model for GPTQ calibration")?;
            // Asymmetric calibration: a second copy, never modified, for the float inputs.
            let mut float = if *asym {
                Some(
                    Llama::load(dir, &candle_core::Device::Cpu, &lopts)
                        .context("loading the unquantized model for asymmetric calibration")?,
                )
            } else {
                None
            };
            let run = CalibRun {
                windows: &windows,
                params,
                sequential: *sequential,
                awq: *awq,
                awq_vo: *awq_vo,
                keep_scaled: awq_reference,
                asym: *asym,
                norm_tweak: norm_tweak.clone(),
            };
            let mut load = |name: &str| src.matrix_f32(name);
            let qs = gptq_llama(
                &mut model,
                float.as_mut(),
                &run,
                &groups,
                &mut load,
                &mut |g| {
                    for p in g {
                        done += 1;
                        on_progress(Progress {
                            done,
                            total,
                            name: p,
                        });
                    }
                },
            )?;
            Some(qs)
        }
    };
    let mut norms = HashMap::new();
    if let Some(o) = gptq.as_mut() {
        norms = std::mem::take(&mut o.norms);
        summary.norm_tweak = std::mem::take(&mut o.norm_tweak);
    }
    for g in &groups {
        if awq_reference {
            let o = gptq.as_mut().context("AWQ reference without calibration")?;
            for p in g {
                let (w, n, k) = o
                    .scaled
                    .remove(p)
                    .with_context(|| format!("AWQ skipped `{p}`"))?;
                let data = w
                    .iter()
                    .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                    .collect();
                let t = OwnedTensor {
                    dtype: StDtype::BF16,
                    shape: vec![n, k],
                    data,
                };
                out.push((format!("{p}.weight"), t));
                summary.kept += 1;
            }
            continue;
        }
        let qs = match gptq.as_mut() {
            Some(m) => g
                .iter()
                .map(|p| {
                    m.quantized
                        .remove(p)
                        .with_context(|| format!("GPTQ skipped `{p}`"))
                })
                .collect::<Result<Vec<_>>>()?,
            None => {
                let ws = g
                    .iter()
                    .map(|p| src.matrix_f32(&format!("{p}.weight")))
                    .collect::<Result<Vec<_>>>()?;
                quantize_group(&ws).with_context(|| format!("quantizing {}", g.join(", ")))?
            }
        };
        for (p, q) in g.iter().zip(&qs) {
            out.extend(nvfp4_tensors(p, q));
            summary.quantized += 1;
            if gptq.is_none() {
                done += 1;
                on_progress(Progress {
                    done,
                    total,
                    name: p,
                });
            }
        }
    }
    for n in &names {
        if quantized.contains(n) {
            continue;
        }
        // Kept in its stored dtype (a GGUF source is BF16 throughout); AWQ's rescaled
        // norms in that dtype too.
        let mut t = src.raw(n)?;
        if let Some(v) = norms.remove(n) {
            if t.shape.iter().product::<usize>() != v.len() {
                bail!(
                    "AWQ: `{n}` has shape {:?}, {} values computed",
                    t.shape,
                    v.len()
                );
            }
            t.data = match t.dtype {
                StDtype::BF16 => v
                    .iter()
                    .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                    .collect(),
                StDtype::F16 => v
                    .iter()
                    .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                    .collect(),
                StDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                d => bail!("AWQ: `{n}` is {d:?}; norms must be BF16, F16 or F32"),
            };
        }
        out.push((n.clone(), t));
        done += 1;
        summary.kept += 1;
        on_progress(Progress {
            done,
            total,
            name: n,
        });
    }
    let st = output.join("model.safetensors");
    write_safetensors(&out, &st)?;
    summary.bytes = std::fs::metadata(&st).map(|m| m.len()).unwrap_or(0);

    if let Json::Object(o) = &mut config {
        o.remove("quantization_config");
        if format == OutputFormat::Nvfp4 {
            o.insert(
                "quantization_config".into(),
                quantization_config_block(&exclude),
            );
        }
    }
    write_json(&output.join("config.json"), &config)?;
    if format == OutputFormat::Nvfp4 {
        write_json(
            &output.join("hf_quant_config.json"),
            &hf_quant_config(&exclude),
        )?;
    }
    match &src {
        Source::Hf { dir, .. } => {
            let folder = candle_fp4::checkpoint::ModelFolder::new(dir)?;
            for f in TOKENIZER_FILES {
                crate::staging::copy_model_file(&folder, f, &output.join(f))?;
            }
        }
        Source::Gguf(g) => {
            write_json(&output.join("tokenizer.json"), &g.tokenizer_json()?)?;
            write_json(
                &output.join("tokenizer_config.json"),
                &g.tokenizer_config_json()?,
            )?;
            write_json(
                &output.join("generation_config.json"),
                &g.generation_config_json()?,
            )?;
        }
    }
    Ok(summary)
}
