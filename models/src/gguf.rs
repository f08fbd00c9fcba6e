//! A llama.cpp GGUF seen as a Hugging Face Llama checkpoint: `config.json` from the
//! `llama.*` metadata, tensors dequantized (candle's GGUF reader) under their HF names
//! with Q/K un-permuted, and a `tokenizer.json` built from `tokenizer.ggml.*`.
//!
//! llama.cpp's converter permutes the rows of `q_proj` / `k_proj` for its interleaved
//! RoPE: `gguf = hf.reshape(heads, 2, d/2, K).swapaxes(1, 2)`. We undo it with
//! `hf = gguf.reshape(heads, d/2, 2, K).swapaxes(1, 2)`.

use crate::errors::GgufError;
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Map, Value as Json};
use std::fs::File;
use std::io::{BufReader, Cursor, Read, Seek};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Token texts llama.cpp treats as end of generation besides `eos_token_id` (its
/// `llama-vocab.cpp` list; `<reponame>` is a fill-in-the-middle token it also stops on).
const EOG_TEXTS: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "<reponame>",
];

/// What a GGUF is read from: a file or bytes in memory.
trait Source: Read + Seek + Send {}
impl<T: Read + Seek + Send> Source for T {}

/// An open GGUF file of a Llama-architecture model.
pub struct GgufModel {
    path: PathBuf,
    content: Content,
    file: Mutex<Box<dyn Source>>,
    n_head: usize,
    n_head_kv: usize,
    n_layer: usize,
}

impl std::fmt::Debug for GgufModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufModel")
            .field("path", &self.path)
            .finish()
    }
}

fn md<'a>(c: &'a Content, key: &str, path: &Path) -> Result<&'a Value> {
    c.metadata
        .get(key)
        .with_context(|| format!("{}: GGUF metadata `{key}` is missing", path.display()))
}

fn md_u32(c: &Content, key: &str, path: &Path) -> Result<usize> {
    let Some(v) = c.metadata.get(key) else {
        return Err(GgufError::MissingMetadata {
            path: path.display().to_string(),
            key: key.to_string(),
        }
        .into());
    };
    // Writers use u32, some i32 / u64.
    let x = match v {
        Value::U32(x) => Some(*x as u64),
        Value::I32(x) if *x >= 0 => Some(*x as u64),
        Value::U64(x) => Some(*x),
        Value::I64(x) if *x >= 0 => Some(*x as u64),
        Value::U16(x) => Some(*x as u64),
        Value::U8(x) => Some(*x as u64),
        _ => None,
    };
    match x.and_then(|x| usize::try_from(x).ok()) {
        Some(x) => Ok(x),
        None => Err(GgufError::BadMetadata {
            path: path.display().to_string(),
            key: key.to_string(),
            value: format!("{v:?}"),
            expected: "a count (a non-negative integer)".into(),
        }
        .into()),
    }
}

/// [`md_u32`], which must also be positive.
fn md_count(c: &Content, key: &str, path: &Path) -> Result<usize> {
    match md_u32(c, key, path)? {
        0 => Err(GgufError::BadMetadata {
            path: path.display().to_string(),
            key: key.to_string(),
            value: "0".into(),
            expected: "positive".into(),
        }
        .into()),
        n => Ok(n),
    }
}

/// One more than the largest block index `N` of the `blk.N.*` tensors (0 if none).
fn blocks_in(c: &Content) -> u64 {
    c.tensor_infos
        .keys()
        .filter_map(|n| {
            n.strip_prefix("blk.")?
                .split_once('.')?
                .0
                .parse::<u64>()
                .ok()
        })
        .map(|i| i.saturating_add(1))
        .max()
        .unwrap_or(0)
}

fn md_f32(c: &Content, key: &str, path: &Path) -> Result<Option<f64>> {
    match c.metadata.get(key) {
        None => Ok(None),
        // The decimal the writer meant (1e-5, not 9.99999974e-6): shortest f32 repr.
        Some(Value::F32(x)) => Ok(Some(x.to_string().parse().unwrap_or(*x as f64))),
        Some(Value::F64(x)) => Ok(Some(*x)),
        Some(v) => bail!(
            "{}: GGUF metadata `{key}` = {v:?} is not a float",
            path.display()
        ),
    }
}

fn md_str<'a>(c: &'a Content, key: &str) -> Option<&'a str> {
    match c.metadata.get(key) {
        Some(Value::String(s)) => Some(s),
        _ => None,
    }
}

fn md_opt_id(c: &Content, key: &str) -> Option<u32> {
    match c.metadata.get(key)? {
        Value::U32(x) => Some(*x),
        Value::I32(x) if *x >= 0 => Some(*x as u32),
        Value::U64(x) => u32::try_from(*x).ok(),
        _ => None,
    }
}

/// `hf = gguf.reshape(heads, d/2, 2, K).transpose(1, 2).reshape(N, K)`.
pub fn unpermute_rope_rows(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    if heads == 0 || !n.is_multiple_of(2 * heads) {
        bail!("cannot un-permute a [{n}, {k}] Q/K weight over {heads} heads");
    }
    let hd = n / heads;
    Ok(w.reshape((heads, hd / 2, 2, k))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((n, k))?)
}

impl GgufModel {
    /// Opens a GGUF and checks that it holds a Llama-architecture model.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let m =
            std::fs::metadata(&path).with_context(|| format!("cannot open {}", path.display()))?;
        if !m.is_file() {
            bail!("{}: not a regular file", path.display());
        }
        let f = File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        Self::from_reader(Box::new(BufReader::new(f)), m.len(), path)
    }

    /// A GGUF from its bytes in memory (`origin` names it in errors); the same checks as
    /// [`open`](Self::open).
    pub fn from_bytes(bytes: Vec<u8>, origin: &str) -> Result<Self> {
        let len = bytes.len() as u64;
        Self::from_reader(Box::new(Cursor::new(bytes)), len, PathBuf::from(origin))
    }

    fn from_reader(mut r: Box<dyn Source>, len: u64, path: PathBuf) -> Result<Self> {
        let p = path.display().to_string();
        crate::gguf_check::prescan(&mut r, len, &p)?;
        let content = Content::read(&mut r)
            .with_context(|| format!("{}: not a readable GGUF file", path.display()))?;
        crate::gguf_check::check_tensor_infos(&content, len, &p)?;
        let arch = md_str(&content, "general.architecture").unwrap_or("?");
        if arch != "llama" {
            bail!(
                "{}: GGUF architecture `{arch}` is not supported (this port runs `llama`)",
                path.display()
            );
        }
        if content.tensor_infos.contains_key("rope_freqs.weight") {
            bail!("{}: GGUF has `rope_freqs.weight` (Llama 3.1 frequency factors): convert from the Hugging Face checkpoint instead", path.display());
        }
        let n_head = md_count(&content, "llama.attention.head_count", &path)?;
        let n_head_kv = match content.metadata.get("llama.attention.head_count_kv") {
            Some(_) => md_count(&content, "llama.attention.head_count_kv", &path)?,
            None => n_head,
        };
        let n_layer = md_count(&content, "llama.block_count", &path)?;
        let found = blocks_in(&content);
        if n_layer as u64 != found {
            return Err(GgufError::LayerCountMismatch {
                path: p,
                block_count: n_layer as u64,
                found,
            }
            .into());
        }
        Ok(Self {
            path,
            content,
            file: Mutex::new(r),
            n_head,
            n_head_kv,
            n_layer,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn content(&self) -> &Content {
        &self.content
    }

    /// The HF `config.json` of the model (transformers 4 keys).
    pub fn config_json(&self) -> Result<Json> {
        let c = &self.content;
        let p = &self.path;
        let hidden = md_u32(c, "llama.embedding_length", p)?;
        let vocab = match c.metadata.get("llama.vocab_size") {
            Some(_) => md_u32(c, "llama.vocab_size", p)?,
            None => match md(c, "tokenizer.ggml.tokens", p)? {
                Value::Array(a) => a.len(),
                _ => bail!("{}: `tokenizer.ggml.tokens` is not an array", p.display()),
            },
        };
        let head_dim = match c.metadata.get("llama.attention.key_length") {
            Some(_) => md_u32(c, "llama.attention.key_length", p)?,
            None => hidden / self.n_head,
        };
        if let Some(rd) = c.metadata.get("llama.rope.dimension_count") {
            let rd = rd.to_u32().map_err(anyhow::Error::msg)? as usize;
            if rd != head_dim {
                bail!("{}: partial RoPE (rope.dimension_count {rd} != head_dim {head_dim}) is not supported", p.display());
            }
        }
        let mut o = Map::new();
        o.insert("architectures".into(), json!(["LlamaForCausalLM"]));
        o.insert("model_type".into(), json!("llama"));
        o.insert("hidden_size".into(), json!(hidden));
        o.insert(
            "intermediate_size".into(),
            json!(md_u32(c, "llama.feed_forward_length", p)?),
        );
        o.insert("num_hidden_layers".into(), json!(self.n_layer));
        o.insert("num_attention_heads".into(), json!(self.n_head));
        o.insert("num_key_value_heads".into(), json!(self.n_head_kv));
        o.insert("head_dim".into(), json!(head_dim));
        o.insert("vocab_size".into(), json!(vocab));
        o.insert(
            "max_position_embeddings".into(),
            json!(md_u32(c, "llama.context_length", p)?),
        );
        o.insert(
            "rms_norm_eps".into(),
            json!(md_f32(c, "llama.attention.layer_norm_rms_epsilon", p)?.unwrap_or(1e-5)),
        );
        o.insert(
            "rope_theta".into(),
            json!(md_f32(c, "llama.rope.freq_base", p)?.unwrap_or(10000.0)),
        );
        match md_str(c, "llama.rope.scaling.type") {
            None | Some("none") => {}
            Some("linear") => {
                let f = md_f32(c, "llama.rope.scaling.factor", p)?.with_context(|| {
                    format!("{}: linear rope scaling without a factor", p.display())
                })?;
                o.insert(
                    "rope_scaling".into(),
                    json!({"type": "linear", "factor": f}),
                );
            }
            Some(t) => bail!("{}: GGUF rope scaling `{t}` is not supported", p.display()),
        }
        o.insert("hidden_act".into(), json!("silu"));
        o.insert("attention_bias".into(), json!(false));
        o.insert("mlp_bias".into(), json!(false));
        o.insert(
            "tie_word_embeddings".into(),
            json!(!self.content.tensor_infos.contains_key("output.weight")),
        );
        if let Some(b) = md_opt_id(c, "tokenizer.ggml.bos_token_id") {
            o.insert("bos_token_id".into(), json!(b));
        }
        if let Some(e) = md_opt_id(c, "tokenizer.ggml.eos_token_id") {
            o.insert("eos_token_id".into(), json!(e));
        }
        if let Some(pd) = md_opt_id(c, "tokenizer.ggml.padding_token_id") {
            o.insert("pad_token_id".into(), json!(pd));
        }
        o.insert("torch_dtype".into(), json!("bfloat16"));
        o.insert("use_cache".into(), json!(true));
        Ok(Json::Object(o))
    }

    /// HF tensor names of the model, in a stable order (embeddings, layers, norm, head).
    pub fn hf_names(&self) -> Vec<String> {
        let mut v = vec!["model.embed_tokens.weight".to_string()];
        for i in 0..self.n_layer {
            for s in [
                "input_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "post_attention_layernorm.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            ] {
                v.push(format!("model.layers.{i}.{s}"));
            }
        }
        v.push("model.norm.weight".to_string());
        if self.content.tensor_infos.contains_key("output.weight") {
            v.push("lm_head.weight".to_string());
        }
        v
    }

    /// The GGUF tensor behind an HF name, and the head count to un-permute over (Q/K).
    fn gguf_name(&self, hf: &str) -> Result<(String, Option<usize>)> {
        let simple = match hf {
            "model.embed_tokens.weight" => Some("token_embd.weight"),
            "model.norm.weight" => Some("output_norm.weight"),
            "lm_head.weight" => Some("output.weight"),
            _ => None,
        };
        if let Some(s) = simple {
            return Ok((s.to_string(), None));
        }
        let rest = hf
            .strip_prefix("model.layers.")
            .with_context(|| format!("no GGUF tensor for `{hf}`"))?;
        let (i, name) = rest
            .split_once('.')
            .with_context(|| format!("no GGUF tensor for `{hf}`"))?;
        let (g, perm) = match name {
            "input_layernorm.weight" => ("attn_norm", None),
            "self_attn.q_proj.weight" => ("attn_q", Some(self.n_head)),
            "self_attn.k_proj.weight" => ("attn_k", Some(self.n_head_kv)),
            "self_attn.v_proj.weight" => ("attn_v", None),
            "self_attn.o_proj.weight" => ("attn_output", None),
            "post_attention_layernorm.weight" => ("ffn_norm", None),
            "mlp.gate_proj.weight" => ("ffn_gate", None),
            "mlp.up_proj.weight" => ("ffn_up", None),
            "mlp.down_proj.weight" => ("ffn_down", None),
            _ => bail!("no GGUF tensor for `{hf}`"),
        };
        Ok((format!("blk.{i}.{g}.weight"), perm))
    }

    /// The tensor `hf_name` dequantized to F32 on the CPU, in HF layout.
    pub fn tensor_f32(&self, hf_name: &str) -> Result<Tensor> {
        let (g, perm) = self.gguf_name(hf_name)?;
        let q = {
            let mut r = self
                .file
                .lock()
                .map_err(|_| anyhow::anyhow!("GGUF reader poisoned"))?;
            self.content
                .tensor(&mut *r, &g, &Device::Cpu)
                .with_context(|| format!("{}: cannot read tensor `{g}`", self.path.display()))?
        };
        let t = q.dequantize(&Device::Cpu)?.to_dtype(DType::F32)?;
        match perm {
            Some(h) => unpermute_rope_rows(&t, h),
            None => Ok(t),
        }
    }

    fn tokens(&self) -> Result<Vec<String>> {
        match md(&self.content, "tokenizer.ggml.tokens", &self.path)? {
            Value::Array(a) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    v => bail!("tokenizer.ggml.tokens holds {v:?}"),
                })
                .collect(),
            v => bail!("tokenizer.ggml.tokens is {v:?}"),
        }
    }

    /// End-of-generation ids as llama.cpp sees them: `eos_token_id` plus the tokens
    /// named in its EOG list.
    pub fn eog_ids(&self) -> Result<Vec<u32>> {
        let mut ids: Vec<u32> = md_opt_id(&self.content, "tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect();
        for (i, t) in self.tokens()?.iter().enumerate() {
            if EOG_TEXTS.contains(&t.as_str()) && !ids.contains(&(i as u32)) {
                ids.push(i as u32);
            }
        }
        Ok(ids)
    }

    /// A Hugging Face `tokenizer.json` for a `gpt2` (byte-level BPE) GGUF vocabulary.
    /// Pre-tokenizer types `smollm` (every digit its own token, then GPT-2's regex),
    /// `gpt2` / `default` / missing (GPT-2's regex) are supported.
    pub fn tokenizer_json(&self) -> Result<Json> {
        let c = &self.content;
        let model = md_str(c, "tokenizer.ggml.model").unwrap_or("?");
        if model != "gpt2" {
            bail!(
                "{}: tokenizer model `{model}` is not supported (byte-level BPE `gpt2` only)",
                self.path.display()
            );
        }
        let tokens = self.tokens()?;
        let types: Vec<i64> = match c.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::I32(x) => *x as i64,
                    Value::U32(x) => *x as i64,
                    _ => 1,
                })
                .collect(),
            _ => vec![1; tokens.len()],
        };
        let merges: Vec<Json> = match md(c, "tokenizer.ggml.merges", &self.path)? {
            Value::Array(a) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => match s.split_once(' ') {
                        Some((a, b)) => Ok(json!([a, b])),
                        None => bail!("merge `{s}` has no space"),
                    },
                    v => bail!("tokenizer.ggml.merges holds {v:?}"),
                })
                .collect::<Result<_>>()?,
            v => bail!("tokenizer.ggml.merges is {v:?}"),
        };
        let mut vocab = Map::new();
        let mut added = vec![];
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert(t.clone(), json!(i));
            // 3 = control, 4 = user-defined: matched whole in the input, never split.
            let ty = types.get(i).copied().unwrap_or(1);
            if ty == 3 || ty == 4 {
                added.push(json!({
                    "id": i, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": ty == 3,
                }));
            }
        }
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        let pre = match md_str(c, "tokenizer.ggml.pre").unwrap_or("default") {
            "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level]}),
            "gpt2" | "default" => byte_level,
            p => bail!(
                "{}: pre-tokenizer `{p}` is not supported (smollm, gpt2)",
                self.path.display()
            ),
        };
        let unk = md_opt_id(c, "tokenizer.ggml.unknown_token_id")
            .and_then(|i| tokens.get(i as usize).cloned());
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre,
            "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": unk,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges,
            }
        }))
    }

    /// `tokenizer_config.json`: special tokens, BOS policy and the chat template.
    pub fn tokenizer_config_json(&self) -> Result<Json> {
        let c = &self.content;
        let tokens = self.tokens()?;
        let name = |key: &str| md_opt_id(c, key).and_then(|i| tokens.get(i as usize).cloned());
        let mut o = Map::new();
        let add_bos = matches!(
            c.metadata.get("tokenizer.ggml.add_bos_token"),
            Some(Value::Bool(true))
        );
        o.insert("add_bos_token".into(), json!(add_bos));
        o.insert("add_eos_token".into(), json!(false));
        for (k, key) in [
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("unk_token", "tokenizer.ggml.unknown_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id"),
        ] {
            if let Some(t) = name(key) {
                o.insert(k.into(), json!(t));
            }
        }
        if let Some(t) = md_str(c, "tokenizer.chat_template") {
            o.insert("chat_template".into(), json!(t));
        }
        o.insert("clean_up_tokenization_spaces".into(), json!(false));
        o.insert(
            "model_max_length".into(),
            json!(md_u32(c, "llama.context_length", &self.path)?),
        );
        o.insert("tokenizer_class".into(), json!("GPT2Tokenizer"));
        Ok(Json::Object(o))
    }

    /// `generation_config.json` with the end-of-generation ids llama.cpp stops on.
    pub fn generation_config_json(&self) -> Result<Json> {
        let mut o = Map::new();
        if let Some(b) = md_opt_id(&self.content, "tokenizer.ggml.bos_token_id") {
            o.insert("bos_token_id".into(), json!(b));
        }
        o.insert("eos_token_id".into(), json!(self.eog_ids()?));
        Ok(Json::Object(o))
    }
}
