//! Reading tensors from safetensors checkpoints: one `model.safetensors`, or the shards
//! listed by `model.safetensors.index.json`, memory-mapped or read into memory.
//!
//! A model folder is a trust boundary. Every file is opened through [`ModelFolder`]: the
//! names an index lists must be plain file names inside the folder (no separator, no `..`,
//! not absolute), a symlink must resolve inside the folder, and anything that is not a
//! regular file (FIFO, socket, device, directory) is refused before it is opened. Every
//! header is parsed and checked once at open, and every index entry must name the shard
//! that holds the tensor. Errors are [`CheckpointError`]s naming the file and tensor.

mod folder;
mod index;
mod shard;

pub use folder::{check_file_name, ModelFolder, MAX_JSON_BYTES};
pub use index::ShardIndex;

use crate::error::CheckpointError;
use candle_core::{DType, Device, Tensor};
use shard::Shard;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Largest index file read: 64 MiB (a 400-billion-parameter model's is under 1 MiB).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

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
    pub fn to_tensor(&self, device: &Device) -> candle_core::Result<Tensor> {
        Tensor::from_raw_buffer(self.data, self.dtype, &self.shape, device)
    }
}

/// A set of safetensors files seen as one name → tensor map.
pub struct Checkpoint {
    origin: String,
    shards: Vec<Shard>,
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

/// Where the shards of a checkpoint path are.
struct Layout {
    /// The folder whose files are opened, with the index's path (or the folder's) for
    /// errors; `None` for one file named by the caller.
    folder: Option<(ModelFolder, String)>,
    /// The shards: file names in `folder`, or the one path the caller gave.
    files: Vec<String>,
    /// The parsed index and its path, for a sharded checkpoint.
    index: Option<(String, ShardIndex)>,
}

impl Layout {
    /// Opens shard `name` of the layout.
    fn open(&self, name: &str) -> Result<(PathBuf, std::fs::File), CheckpointError> {
        match &self.folder {
            Some((folder, origin)) => folder.open(origin, name),
            None => {
                // The caller named this file: any path, but a regular file.
                let path = PathBuf::from(name);
                let m = std::fs::metadata(&path).map_err(|source| CheckpointError::Io {
                    path: path.clone(),
                    source,
                })?;
                if !m.is_file() {
                    return Err(CheckpointError::NotARegularFile {
                        path,
                        kind: folder::kind_of(&m),
                    });
                }
                let f = folder::open_regular(&path)?;
                Ok((path, f))
            }
        }
    }
}

/// The shards of `path`: a folder (its `model.safetensors.index.json`, else its
/// `model.safetensors`), an index json (its shards are names in its folder), or one
/// `.safetensors` file.
fn layout(path: &Path) -> Result<Layout, CheckpointError> {
    const INDEX: &str = "model.safetensors.index.json";
    const SINGLE: &str = "model.safetensors";
    let folder_origin = |f: &ModelFolder| f.path().display().to_string();
    let (folder, index_name) = if path.is_dir() {
        let folder = ModelFolder::new(path)?;
        if folder.contains(INDEX)? {
            (folder, INDEX.to_string())
        } else if folder.contains(SINGLE)? {
            let o = folder_origin(&folder);
            return Ok(Layout {
                folder: Some((folder, o)),
                files: vec![SINGLE.to_string()],
                index: None,
            });
        } else {
            return Err(CheckpointError::NoWeights {
                dir: path.to_path_buf(),
            });
        }
    } else if path.to_string_lossy().ends_with(".json") {
        // An index the caller named: its folder is the boundary for the shards it lists.
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        (ModelFolder::new(&parent)?, name)
    } else {
        return Ok(Layout {
            folder: None,
            files: vec![path.display().to_string()],
            index: None,
        });
    };
    let index_origin = folder.path().join(&index_name).display().to_string();
    let (p, f) = folder.open(&folder_origin(&folder), &index_name)?;
    let bytes = folder::read_limited(&p, f, MAX_INDEX_BYTES)?;
    let index = ShardIndex::parse(&bytes, &index_origin)?;
    Ok(Layout {
        folder: Some((folder, index_origin.clone())),
        files: index.files.clone(),
        index: Some((index_origin, index)),
    })
}

impl Checkpoint {
    fn from_shards(
        origin: String,
        shards: Vec<Shard>,
        index: Option<&(String, ShardIndex)>,
    ) -> Result<Self, CheckpointError> {
        let mut routing = HashMap::new();
        for (i, shard) in shards.iter().enumerate() {
            for n in shard.names() {
                if let Some(j) = routing.insert(n.clone(), i) {
                    return Err(CheckpointError::DuplicateTensor {
                        origin,
                        tensor: n,
                        first: shards[j].name.clone(),
                        second: shard.name.clone(),
                    });
                }
            }
        }
        if let Some((index_origin, idx)) = index {
            for (tensor, file) in &idx.weight_map {
                if routing.get(tensor) != Some(file) {
                    return Err(CheckpointError::IndexMismatch {
                        index: index_origin.clone(),
                        tensor: tensor.clone(),
                        listed: shards[*file].name.clone(),
                        found: routing.get(tensor).map(|&j| shards[j].name.clone()),
                    });
                }
            }
        }
        Ok(Self {
            origin,
            shards,
            routing,
        })
    }

    /// Parses the bytes of a `model.safetensors.index.json` ([`ShardIndex::parse`]).
    pub fn parse_index(bytes: &[u8], origin: &str) -> Result<ShardIndex, CheckpointError> {
        ShardIndex::parse(bytes, origin)
    }

    /// Memory-maps the checkpoint at `path`: a folder (`model.safetensors.index.json` and
    /// its shards, else `model.safetensors`), an index json, or one `.safetensors` file.
    ///
    /// # Safety
    ///
    /// As for any memory map: the files must not be modified while the checkpoint (or a
    /// tensor borrowed from it) is alive.
    pub unsafe fn open(path: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let path = path.as_ref();
        let l = layout(path)?;
        let mut shards = vec![];
        for name in &l.files {
            let (p, f) = l.open(name)?;
            // SAFETY: the caller upholds the no-modification contract.
            shards.push(unsafe { Shard::mmap(p.display().to_string(), &f)? });
        }
        Self::from_shards(path.display().to_string(), shards, l.index.as_ref())
    }

    /// Like [`open`](Self::open), but reads the files into memory (safe; for small models
    /// and tests).
    pub fn read(path: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let path = path.as_ref();
        let l = layout(path)?;
        let mut shards = vec![];
        for name in &l.files {
            let (p, f) = l.open(name)?;
            let bytes = folder::read_limited(&p, f, u64::MAX)?;
            shards.push(Shard::from_bytes(p.display().to_string(), bytes)?);
        }
        Self::from_shards(path.display().to_string(), shards, l.index.as_ref())
    }

    /// A checkpoint from the bytes of one safetensors file; `origin` names it in errors.
    pub fn from_buffer(bytes: Vec<u8>, origin: &str) -> Result<Self, CheckpointError> {
        let shard = Shard::from_bytes(origin.to_string(), bytes)?;
        Self::from_shards(origin.to_string(), vec![shard], None)
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
    pub fn get(&self, name: &str) -> Result<TensorData<'_>, CheckpointError> {
        let missing = || CheckpointError::MissingTensor {
            file: self.origin.clone(),
            tensor: name.to_string(),
        };
        let shard = self
            .routing
            .get(name)
            .and_then(|&i| self.shards.get(i))
            .ok_or_else(missing)?;
        let info = shard.info(name).ok_or_else(missing)?;
        let Ok(dtype) = DType::try_from(info.dtype) else {
            return Err(CheckpointError::UnsupportedDtype {
                file: shard.name.clone(),
                tensor: name.to_string(),
                dtype: format!("{:?}", info.dtype),
            });
        };
        Ok(TensorData {
            dtype,
            shape: info.shape.clone(),
            data: shard.data(name, info)?,
        })
    }

    /// The tensor `name`, checked to have one of `dtypes` and exactly `shape`; the error
    /// names the tensor, what was expected and what was found.
    pub fn get_checked(
        &self,
        name: &str,
        dtypes: &[DType],
        shape: &[usize],
    ) -> Result<TensorData<'_>, CheckpointError> {
        let t = self.get_dtype(name, dtypes)?;
        if t.shape != shape {
            return Err(CheckpointError::WrongShape {
                file: self.origin.clone(),
                tensor: name.to_string(),
                found: t.shape,
                expected: format!("{shape:?}"),
            });
        }
        Ok(t)
    }

    /// The tensor `name`, checked to have one of `dtypes` (any shape).
    pub fn get_dtype(
        &self,
        name: &str,
        dtypes: &[DType],
    ) -> Result<TensorData<'_>, CheckpointError> {
        let t = self.get(name)?;
        if !dtypes.contains(&t.dtype) {
            return Err(CheckpointError::WrongDtype {
                file: self.origin.clone(),
                tensor: name.to_string(),
                found: t.dtype,
                expected: dtypes
                    .iter()
                    .map(|d| format!("{d:?}"))
                    .collect::<Vec<_>>()
                    .join(" or "),
            });
        }
        Ok(t)
    }

    /// An F32 scalar stored as a 0-d tensor or with shape `[1]`.
    pub fn scalar_f32(&self, name: &str) -> Result<f32, CheckpointError> {
        let t = self.get_dtype(name, &[DType::F32])?;
        let wrong = |found: Vec<usize>| CheckpointError::WrongShape {
            file: self.origin.clone(),
            tensor: name.to_string(),
            found,
            expected: "a scalar ([] or [1])".to_string(),
        };
        if !(t.shape.is_empty() || t.shape == [1]) {
            return Err(wrong(t.shape));
        }
        match <[u8; 4]>::try_from(t.data) {
            Ok(b) => Ok(f32::from_le_bytes(b)),
            Err(_) => Err(wrong(t.shape)),
        }
    }

    /// Loads tensor `name` onto `device` with its stored dtype.
    pub fn load(&self, name: &str, device: &Device) -> candle_core::Result<Tensor> {
        self.get(name)?.to_tensor(device)
    }
}
