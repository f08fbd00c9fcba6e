//! Reading tensors from safetensors checkpoints: one `model.safetensors`, or the shards
//! listed by `model.safetensors.index.json`, memory-mapped or read into memory.
//!
//! Every lookup error names the tensor and the checkpoint.

use candle_core::safetensors::{BufferedSafetensors, MmapedSafetensors};
use candle_core::{bail, DType, Device, Result, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

enum Shard {
    Mmaped(MmapedSafetensors),
    Buffered(BufferedSafetensors),
}

/// A tensor's dtype, shape and raw little-endian bytes, borrowed from a [`Checkpoint`].
#[derive(Debug, Clone, PartialEq)]
pub struct TensorData<'a> {
    /// Element type.
    pub dtype: DType,
    /// Shape (empty for a 0-d tensor).
    pub shape: Vec<usize>,
    /// Raw bytes as stored in the file.
    pub data: &'a [u8],
}

impl TensorData<'_> {
    /// Copies the tensor onto `device` with its stored dtype.
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        Tensor::from_raw_buffer(self.data, self.dtype, &self.shape, device)
    }
}

/// A set of safetensors files seen as one name → tensor map.
pub struct Checkpoint {
    origin: String,
    shards: Vec<(String, Shard)>,
    routing: HashMap<String, usize>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("origin", &self.origin)
            .field("shards", &self.shards.len())
            .field("tensors", &self.routing.len())
            .finish()
    }
}

/// The safetensors files of `path`: a folder (its `model.safetensors.index.json`, else
/// its `model.safetensors`), an index json, or one `.safetensors` file.
fn shard_paths(path: &Path) -> Result<Vec<PathBuf>> {
    let index = if path.is_dir() {
        let index = path.join("model.safetensors.index.json");
        if !index.exists() {
            let single = path.join("model.safetensors");
            if !single.exists() {
                bail!(
                    "{}: no model.safetensors or model.safetensors.index.json",
                    path.display()
                );
            }
            return Ok(vec![single]);
        }
        index
    } else if path.to_string_lossy().ends_with(".json") {
        path.to_path_buf()
    } else {
        return Ok(vec![path.to_path_buf()]);
    };
    let text = std::fs::read_to_string(&index)
        .map_err(|e| candle_core::Error::Msg(format!("cannot read {}: {e}", index.display())))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| candle_core::Error::Msg(format!("{}: invalid JSON: {e}", index.display())))?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        bail!("{}: no `weight_map` object", index.display());
    };
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = vec![];
    for (name, file) in map {
        let Some(file) = file.as_str() else {
            bail!("{}: weight_map[{name}] is not a file name", index.display());
        };
        let p = dir.join(file);
        if !files.contains(&p) {
            files.push(p);
        }
    }
    if files.is_empty() {
        bail!("{}: `weight_map` lists no files", index.display());
    }
    Ok(files)
}

impl Checkpoint {
    fn from_shards(origin: String, shards: Vec<(String, Shard)>) -> Result<Self> {
        let mut routing = HashMap::new();
        for (i, (file, shard)) in shards.iter().enumerate() {
            let names: Vec<String> = match shard {
                Shard::Mmaped(s) => s.tensors().into_iter().map(|(n, _)| n).collect(),
                Shard::Buffered(s) => s.tensors().into_iter().map(|(n, _)| n).collect(),
            };
            for n in names {
                if let Some(j) = routing.insert(n.clone(), i) {
                    bail!(
                        "{origin}: tensor `{n}` is in both {} and {file}",
                        shards[j].0
                    );
                }
            }
        }
        Ok(Self {
            origin,
            shards,
            routing,
        })
    }

    /// Memory-maps the checkpoint at `path`: a folder (`model.safetensors.index.json` and
    /// its shards, else `model.safetensors`), an index json, or one `.safetensors` file.
    ///
    /// # Safety
    ///
    /// As for [`MmapedSafetensors::new`]: the files must not be modified while the
    /// checkpoint (or a tensor borrowed from it) is alive.
    pub unsafe fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let mut shards = vec![];
        for p in shard_paths(path)? {
            let s = MmapedSafetensors::new(&p)?;
            shards.push((p.display().to_string(), Shard::Mmaped(s)));
        }
        Self::from_shards(path.display().to_string(), shards)
    }

    /// Like [`open`](Self::open), but reads the files into memory (safe; for small models
    /// and tests).
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let mut shards = vec![];
        for p in shard_paths(path)? {
            let bytes = std::fs::read(&p).map_err(|e| {
                candle_core::Error::Msg(format!("cannot read {}: {e}", p.display()))
            })?;
            let origin = p.display().to_string();
            shards.push((origin.clone(), Self::buffered(bytes, &origin)?));
        }
        Self::from_shards(path.display().to_string(), shards)
    }

    fn buffered(bytes: Vec<u8>, origin: &str) -> Result<Shard> {
        match BufferedSafetensors::new(bytes) {
            Ok(s) => Ok(Shard::Buffered(s)),
            Err(e) => bail!("{origin}: not a safetensors file: {e}"),
        }
    }

    /// A checkpoint from the bytes of one safetensors file; `origin` names it in errors.
    pub fn from_buffer(bytes: Vec<u8>, origin: &str) -> Result<Self> {
        let shard = Self::buffered(bytes, origin)?;
        Self::from_shards(origin.to_string(), vec![(origin.to_string(), shard)])
    }

    /// The path (or name) the checkpoint was opened from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.routing.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.routing.contains_key(name)
    }

    /// The tensor `name`; an error if it is missing or has a dtype candle cannot hold.
    pub fn get(&self, name: &str) -> Result<TensorData<'_>> {
        let Some(&i) = self.routing.get(name) else {
            bail!("{}: tensor `{name}` is missing", self.origin);
        };
        let (file, shard) = &self.shards[i];
        let v = match shard {
            Shard::Mmaped(s) => s.get(name),
            Shard::Buffered(s) => s.get(name),
        };
        let v = match v {
            Ok(v) => v,
            Err(e) => bail!("{file}: cannot read tensor `{name}`: {e}"),
        };
        let Ok(dtype) = DType::try_from(v.dtype()) else {
            bail!(
                "{}: tensor `{name}` has dtype {:?}, which candle cannot hold",
                self.origin,
                v.dtype()
            );
        };
        Ok(TensorData {
            dtype,
            shape: v.shape().to_vec(),
            data: v.data(),
        })
    }

    /// The tensor `name`, checked to have one of `dtypes` and exactly `shape`; the error
    /// names the tensor, what was expected and what was found.
    pub fn get_checked(
        &self,
        name: &str,
        dtypes: &[DType],
        shape: &[usize],
    ) -> Result<TensorData<'_>> {
        let t = self.get_dtype(name, dtypes)?;
        if t.shape != shape {
            bail!(
                "{}: tensor `{name}` has shape {:?}, expected {shape:?}",
                self.origin,
                t.shape
            );
        }
        Ok(t)
    }

    /// The tensor `name`, checked to have one of `dtypes` (any shape).
    pub fn get_dtype(&self, name: &str, dtypes: &[DType]) -> Result<TensorData<'_>> {
        let t = self.get(name)?;
        if !dtypes.contains(&t.dtype) {
            bail!(
                "{}: tensor `{name}` has dtype {:?}, expected {}",
                self.origin,
                t.dtype,
                dtypes
                    .iter()
                    .map(|d| format!("{d:?}"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            );
        }
        Ok(t)
    }

    /// An F32 scalar stored as a 0-d tensor or with shape `[1]`.
    pub fn scalar_f32(&self, name: &str) -> Result<f32> {
        let t = self.get_dtype(name, &[DType::F32])?;
        if !(t.shape.is_empty() || t.shape == [1]) {
            bail!(
                "{}: tensor `{name}` has shape {:?}, expected a scalar ([] or [1])",
                self.origin,
                t.shape
            );
        }
        match <[u8; 4]>::try_from(t.data) {
            Ok(b) => Ok(f32::from_le_bytes(b)),
            Err(_) => bail!(
                "{}: tensor `{name}` holds {} bytes, expected 4",
                self.origin,
                t.data.len()
            ),
        }
    }

    /// Loads tensor `name` onto `device` with its stored dtype.
    pub fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        self.get(name)?.to_tensor(device)
    }
}
