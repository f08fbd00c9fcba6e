//! Reading the quantizer's input: a Hugging Face folder (safetensors + config.json) or a
//! llama.cpp GGUF (dequantized, rounded to BF16, Q/K un-permuted by [`crate::gguf`]).

use super::export::{st_dtype, OwnedTensor};
use crate::gguf::GgufModel;
use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_fp4::checkpoint::Checkpoint;
use candle_fp4::quant_config::QuantConfig;
use half::{bf16, f16};
use safetensors::tensor::Dtype as StDtype;
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

/// Where the weights come from.
pub(super) enum Source {
    Hf {
        dir: PathBuf,
        ckpt: Checkpoint,
        config: Json,
    },
    Gguf(Box<GgufModel>),
}

impl Source {
    pub fn open(input: &Path) -> Result<Self> {
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

    pub fn config(&self) -> Result<Json> {
        match self {
            Self::Hf { config, .. } => Ok(config.clone()),
            Self::Gguf(g) => g.config_json(),
        }
    }

    pub fn names(&self) -> Vec<String> {
        match self {
            Self::Hf { ckpt, .. } => ckpt.names().into_iter().map(str::to_string).collect(),
            Self::Gguf(g) => g.hf_names(),
        }
    }

    /// The tensor as stored (HF) or as BF16 (GGUF, dequantized then rounded).
    pub fn raw(&self, name: &str) -> Result<OwnedTensor> {
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
    pub fn matrix_shape(&self, name: &str) -> Result<(usize, usize)> {
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
    pub fn matrix_f32(&self, name: &str) -> Result<(Vec<f32>, usize, usize)> {
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
