//! Which layers of a checkpoint are quantized, and how, as NVIDIA ModelOpt records it:
//! `hf_quant_config.json`, or the `quantization_config` block of `config.json`.
//!
//! ```json
//! {"producer": {"name": "modelopt", "version": "0.47.0"},
//!  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
//!                   "exclude_modules": ["lm_head", "model.embed_tokens"]}}
//! ```
//!
//! `config.json` form: `"quantization_config": {"quant_method": "modelopt", "quant_algo":
//! "NVFP4", "ignore": [...], "config_groups": {"group_0": {"weights": {"group_size": 16, ...}}}}`.

use crate::nvfp4::BLOCK_SIZE;
use candle_core::{bail, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// The weight quantization algorithm of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantAlgo {
    /// `"NVFP4"` (ModelOpt's `NVFP4_DEFAULT_CFG`, W4A4). We run it as W4A16: the
    /// `input_scale` tensors are ignored.
    Nvfp4,
    /// `"W4A16_NVFP4"`: NVFP4 weights, 16-bit activations.
    W4A16Nvfp4,
    /// No weight quantization (no quant config, or `quant_algo: null`).
    #[default]
    None,
}

impl QuantAlgo {
    /// Parses ModelOpt's `quant_algo` string (`None` for JSON `null` or a missing key).
    /// Anything other than `NVFP4` / `W4A16_NVFP4` (e.g. `FP8`, `NVFP4_AWQ`,
    /// `MIXED_PRECISION`) is an error naming `origin`.
    pub fn from_modelopt(algo: Option<&str>, origin: &str) -> Result<Self> {
        match algo {
            None => Ok(Self::None),
            Some(s) => match s.to_ascii_uppercase().as_str() {
                "NVFP4" => Ok(Self::Nvfp4),
                "W4A16_NVFP4" => Ok(Self::W4A16Nvfp4),
                _ => bail!(
                    "{origin}: quant_algo `{s}` is not supported (candle-fp4 loads NVFP4 and W4A16_NVFP4)"
                ),
            },
        }
    }

    /// Whether the weights are NVFP4 (both algorithms load the same way).
    pub fn is_nvfp4(self) -> bool {
        !matches!(self, Self::None)
    }
}

/// A checkpoint's quantization settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantConfig {
    /// Weight algorithm.
    pub quant_algo: QuantAlgo,
    /// Weights per block scale (always 16 for NVFP4).
    pub group_size: usize,
    /// Module-name patterns left unquantized (`exclude_modules` / `ignore`), fnmatch style.
    pub exclude: Vec<String>,
    /// KV-cache quantization as recorded (e.g. `"FP8"`); informational, not applied here.
    pub kv_cache_quant_algo: Option<String>,
    /// The exporter, e.g. `"modelopt 0.47.0"`.
    pub producer: Option<String>,
}

impl Default for QuantConfig {
    fn default() -> Self {
        Self::unquantized()
    }
}

fn str_field(obj: &Map<String, Value>, key: &str, origin: &str) -> Result<Option<String>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => bail!("{origin}: `{key}` must be a string or null, got {v}"),
    }
}

fn list_field(obj: &Map<String, Value>, key: &str, origin: &str) -> Result<Vec<String>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                v => bail!("{origin}: `{key}` must hold strings, got {v}"),
            })
            .collect(),
        Some(v) => bail!("{origin}: `{key}` must be a list of strings, got {v}"),
    }
}

fn usize_field(obj: &Map<String, Value>, key: &str, origin: &str) -> Result<Option<usize>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(g) => Ok(Some(g as usize)),
            None => bail!("{origin}: `{key}` must be a non-negative integer, got {v}"),
        },
    }
}

fn producer(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => {
            let name = o.get("name").and_then(Value::as_str).unwrap_or("unknown");
            Some(match o.get("version").and_then(Value::as_str) {
                Some(ver) => format!("{name} {ver}"),
                None => name.to_string(),
            })
        }
        _ => None,
    }
}

fn parse_json(text: &str, origin: &str) -> Result<Map<String, Value>> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => bail!("{origin}: expected a JSON object"),
        Err(e) => bail!("{origin}: invalid JSON: {e}"),
    }
}

/// The weights' group size from `config_groups.*.weights.group_size` (all groups must agree).
fn config_groups_group_size(obj: &Map<String, Value>, origin: &str) -> Result<Option<usize>> {
    let Some(groups) = obj.get("config_groups").and_then(Value::as_object) else {
        return Ok(None);
    };
    let mut found: Option<usize> = None;
    for (name, g) in groups {
        let Some(w) = g.get("weights").and_then(Value::as_object) else {
            continue;
        };
        let origin = format!("{origin}: config_groups.{name}.weights");
        if let Some(bits) = usize_field(w, "num_bits", &origin)? {
            if bits != 4 {
                bail!("{origin}: num_bits = {bits}, NVFP4 weights have 4");
            }
        }
        if let Some(gs) = usize_field(w, "group_size", &origin)? {
            match found {
                Some(prev) if prev != gs => {
                    bail!("{origin}: group_size {gs} differs from another group's {prev}")
                }
                _ => found = Some(gs),
            }
        }
    }
    Ok(found)
}

impl QuantConfig {
    /// No quantization: every layer is loaded as a 16-bit weight.
    pub fn unquantized() -> Self {
        Self {
            quant_algo: QuantAlgo::None,
            group_size: BLOCK_SIZE,
            exclude: vec![],
            kv_cache_quant_algo: None,
            producer: None,
        }
    }

    fn build(
        algo: Option<String>,
        group_size: Option<usize>,
        exclude: Vec<String>,
        kv_cache_quant_algo: Option<String>,
        producer: Option<String>,
        origin: &str,
    ) -> Result<Self> {
        let quant_algo = QuantAlgo::from_modelopt(algo.as_deref(), origin)?;
        let group_size = group_size.unwrap_or(BLOCK_SIZE);
        if quant_algo.is_nvfp4() && group_size != BLOCK_SIZE {
            bail!("{origin}: group_size {group_size} is not supported (NVFP4 uses {BLOCK_SIZE})");
        }
        Ok(Self {
            quant_algo,
            group_size,
            exclude,
            kv_cache_quant_algo,
            producer,
        })
    }

    /// Parses ModelOpt's `hf_quant_config.json` (`origin` names it in errors).
    pub fn from_hf_quant_config_str(text: &str, origin: &str) -> Result<Self> {
        let root = parse_json(text, origin)?;
        let Some(q) = root.get("quantization").and_then(Value::as_object) else {
            bail!("{origin}: no `quantization` object");
        };
        Self::from_flat(q, producer(root.get("producer")), origin)
    }

    /// `quant_algo`, `group_size`, `exclude_modules`/`ignore`, `kv_cache_quant_algo` of one object.
    fn from_flat(q: &Map<String, Value>, producer: Option<String>, origin: &str) -> Result<Self> {
        let mut exclude = list_field(q, "exclude_modules", origin)?;
        exclude.extend(list_field(q, "ignore", origin)?);
        let group_size = match usize_field(q, "group_size", origin)? {
            Some(g) => Some(g),
            None => config_groups_group_size(q, origin)?,
        };
        Self::build(
            str_field(q, "quant_algo", origin)?,
            group_size,
            exclude,
            str_field(q, "kv_cache_quant_algo", origin)?,
            producer,
            origin,
        )
    }

    /// Parses a model's `config.json`: its `quantization_config` block, which must have
    /// `quant_method` `"modelopt"` (vLLM's `"modelopt_fp4"` is accepted too); no block
    /// means unquantized.
    pub fn from_config_json_str(text: &str, origin: &str) -> Result<Self> {
        let root = parse_json(text, origin)?;
        let q = match root.get("quantization_config") {
            None | Some(Value::Null) => return Ok(Self::unquantized()),
            Some(Value::Object(q)) => q,
            Some(v) => bail!("{origin}: `quantization_config` must be an object, got {v}"),
        };
        let origin = format!("{origin}: quantization_config");
        match str_field(q, "quant_method", &origin)?.as_deref() {
            Some("modelopt") | Some("modelopt_fp4") => {}
            Some(m) => bail!(
                "{origin}: quant_method `{m}` is not supported (candle-fp4 loads ModelOpt NVFP4 checkpoints)"
            ),
            None => bail!("{origin}: no `quant_method`"),
        }
        let producer = producer(q.get("producer"));
        // Some exports nest a copy of hf_quant_config's `quantization` object.
        match q.get("quantization").and_then(Value::as_object) {
            Some(inner) => Self::from_flat(inner, producer, &origin),
            None => Self::from_flat(q, producer, &origin),
        }
    }

    /// Reads `dir/hf_quant_config.json`, else `dir/config.json`'s `quantization_config`;
    /// unquantized when neither says anything. The files are read through
    /// [`ModelFolder`](crate::checkpoint::ModelFolder) (regular files inside the folder).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let folder = crate::checkpoint::ModelFolder::new(dir.as_ref())?;
        let read = |name: &str| -> Result<Option<(String, String)>> {
            Ok(folder
                .read_text(name)?
                .map(|(p, t)| (t, p.display().to_string())))
        };
        if let Some((text, origin)) = read("hf_quant_config.json")? {
            return Self::from_hf_quant_config_str(&text, &origin);
        }
        if let Some((text, origin)) = read("config.json")? {
            return Self::from_config_json_str(&text, &origin);
        }
        Ok(Self::unquantized())
    }

    /// Whether the checkpoint quantizes weights at all.
    pub fn quantizes(&self) -> bool {
        self.quant_algo.is_nvfp4()
    }

    /// Whether `module` (a full name such as `model.layers.0.mlp.gate_proj`, no
    /// `.weight`) is excluded from quantization.
    ///
    /// Patterns use Python `fnmatch` syntax as ModelOpt does (`*` matches any run of
    /// characters, dots included; `?` one character; `[seq]` / `[!seq]` a set). A pattern
    /// matches the full module name, **or any dotted ancestor of it**: excluding
    /// `model.layers.0.mlp` excludes `model.layers.0.mlp.gate_proj` (a parent module's
    /// exclusion covers its children, as vLLM's prefix matching does).
    pub fn is_excluded(&self, module: &str) -> bool {
        let ancestors = module
            .char_indices()
            .filter(|&(_, c)| c == '.')
            .map(|(i, _)| &module[..i]);
        let mut names = std::iter::once(module).chain(ancestors);
        names.any(|name| self.exclude.iter().any(|p| fnmatch(p, name)))
    }

    /// Whether `module` is loaded as NVFP4: the config quantizes and does not exclude it.
    pub fn is_nvfp4(&self, module: &str) -> bool {
        self.quantizes() && !self.is_excluded(module)
    }
}

/// If the single-character token at `p[pi]` (`?`, `[set]` or a literal) matches `c`,
/// the index after it.
fn step(p: &[char], pi: usize, c: char) -> Option<usize> {
    match p[pi] {
        '?' => Some(pi + 1),
        '[' => {
            let mut i = pi + 1;
            let negate = i < p.len() && p[i] == '!';
            if negate {
                i += 1;
            }
            let start = i;
            let mut hit = false;
            while i < p.len() && (p[i] != ']' || i == start) {
                if i + 2 < p.len() && p[i + 1] == '-' && p[i + 2] != ']' {
                    hit |= p[i] <= c && c <= p[i + 2];
                    i += 3;
                } else {
                    hit |= p[i] == c;
                    i += 1;
                }
            }
            if i >= p.len() {
                // No closing bracket: a literal '['.
                return (c == '[').then_some(pi + 1);
            }
            (hit != negate).then_some(i + 1)
        }
        l => (l == c).then_some(pi + 1),
    }
}

/// Python `fnmatch.fnmatchcase`: `*`, `?`, `[seq]`, `[!seq]`.
fn fnmatch(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let s: Vec<char> = name.chars().collect();
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && p[pi] == '*' {
            pi += 1;
            star = Some((pi, si));
            continue;
        }
        if pi < p.len() {
            if let Some(next) = step(&p, pi, s[si]) {
                pi = next;
                si += 1;
                continue;
            }
        }
        match star {
            Some((sp, ss)) => {
                pi = sp;
                si = ss + 1;
                star = Some((sp, ss + 1));
            }
            None => return false,
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::fnmatch;

    #[test]
    fn fnmatch_like_python() {
        let cases = [
            ("lm_head", "lm_head", true),
            ("lm_head", "lm_head2", false),
            ("*lm_head*", "model.lm_head.x", true),
            ("model.layers.*.mlp.gate", "model.layers.12.mlp.gate", true),
            (
                "model.layers.*.mlp.gate",
                "model.layers.12.mlp.gate_proj",
                false,
            ),
            ("model.layers.?.mlp", "model.layers.3.mlp", true),
            ("model.layers.?.mlp", "model.layers.13.mlp", false),
            ("*.[qk]_proj", "a.q_proj", true),
            ("*.[!qk]_proj", "a.q_proj", false),
            ("*.[!qk]_proj", "a.v_proj", true),
            ("layer[0-3]", "layer2", true),
            ("layer[0-3]", "layer7", false),
            ("a[b", "a[b", true),
            ("*", "", true),
            ("", "", true),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxbyy", false),
        ];
        for (p, s, want) in cases {
            assert_eq!(fnmatch(p, s), want, "fnmatch({p:?}, {s:?})");
        }
    }
}
