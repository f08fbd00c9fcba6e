//! Shared pieces of the command-line tools: `--model` resolution (a folder, or
//! `smollm2` / `smollm2-bf16` fetched and converted on first use), `--device`,
//! `--kv-cache`, progress bars.

use super::smollm2::{self, Variant};
use anyhow::{bail, Result};
use candle_core::Device;
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4_models::quant::Progress;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

/// A progress bar over the tensors of a conversion, on stderr.
pub fn progress_bar() -> (ProgressBar, impl FnMut(Progress<'_>)) {
    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("{spinner} quantizing [{bar:40}] {pos}/{len} tensors {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let p = pb.clone();
    let f = move |pr: Progress<'_>| {
        p.set_length(pr.total as u64);
        p.set_position(pr.done as u64);
        p.set_message(pr.name.to_string());
    };
    (pb, f)
}

/// `--model`: `smollm2` (NVFP4, the default recipe), `smollm2-rtn` (ModelOpt's
/// round-to-nearest), `smollm2@RECIPE` (a named recipe, `candle_fp4_models::recipes`),
/// `smollm2-bf16` (the dequantized GGUF in BF16), or a Hugging Face / ModelOpt folder.
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    let recipe = match spec {
        "smollm2-rtn" => Some("rtn"),
        s => s.strip_prefix("smollm2@"),
    };
    if let Some(name) = recipe {
        let r = candle_fp4_models::recipes::by_name(name)?;
        let (pb, mut on_progress) = progress_bar();
        let mut log = |s: &str| pb.suspend(|| eprintln!("{s}"));
        let dir = smollm2::ensure_recipe(&r, &mut log, &mut on_progress);
        pb.finish_and_clear();
        return dir;
    }
    let variant = match spec {
        "smollm2" | "smollm2-nvfp4" => Variant::Nvfp4,
        "smollm2-bf16" => Variant::Bf16,
        _ => {
            let p = PathBuf::from(spec);
            if !p.exists() {
                bail!("--model {spec}: no such folder (give a model folder, `smollm2` or `smollm2-bf16`)");
            }
            if !p.is_dir() {
                bail!("--model {spec}: not a folder (a GGUF must first go through the quantizer)");
            }
            return Ok(p);
        }
    };
    let (pb, mut on_progress) = progress_bar();
    let mut log = |s: &str| pb.suspend(|| eprintln!("{s}"));
    let dir = smollm2::ensure_model(variant, &mut log, &mut on_progress);
    pb.finish_and_clear();
    dir
}

/// `--device cpu|cuda|cuda:N`.
pub fn device(spec: &str) -> Result<Device> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let i: usize = match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map_err(|_| anyhow::anyhow!("--device {s}: bad GPU index"))?,
                None => 0,
            };
            if !cfg!(feature = "cuda") {
                bail!("--device {s}: this binary was built without CUDA (rebuild with `--features cuda`)");
            }
            Ok(Device::new_cuda(i)?)
        }
        s => bail!("--device {s}: expected cpu, cuda or cuda:N"),
    }
}

/// `--kv-cache bf16|ultraquant` (case-insensitive; `uq` and `fp4` also name UltraQuant), as
/// a clap value parser.
pub fn parse_kv_cache(s: &str) -> std::result::Result<KvCacheKind, String> {
    match s.to_ascii_lowercase().as_str() {
        "bf16" => Ok(KvCacheKind::Bf16),
        "ultraquant" | "uq" | "fp4" => Ok(KvCacheKind::UltraQuant),
        _ => Err(format!("unknown KV cache `{s}` (bf16 or ultraquant)")),
    }
}

/// The name `--kv-cache` takes for `kind` (what the tools print).
pub fn kv_cache_name(kind: KvCacheKind) -> &'static str {
    match kind {
        KvCacheKind::Bf16 => "bf16",
        KvCacheKind::UltraQuant => "ultraquant",
    }
}
