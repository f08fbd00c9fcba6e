//! One safetensors file, memory-mapped or in memory, with its header parsed once
//! (`safetensors::SafeTensors::read_metadata`: offsets contiguous, sizes checked against
//! the shapes, the data exactly filling the file).

use crate::error::CheckpointError;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::SafeTensors;
use std::fs::File;

/// The bytes of a shard.
enum Bytes {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mmap(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A parsed safetensors file.
pub(crate) struct Shard {
    pub name: String,
    bytes: Bytes,
    data_start: usize,
    meta: Metadata,
}

impl Shard {
    fn parse(name: String, bytes: Bytes) -> Result<Self, CheckpointError> {
        let (n, meta) = SafeTensors::read_metadata(bytes.as_slice()).map_err(|e| {
            CheckpointError::NotSafetensors {
                file: name.clone(),
                reason: e.to_string(),
            }
        })?;
        // read_metadata checked `8 + n + data == len`, so this cannot overflow.
        let data_start = n.saturating_add(8);
        Ok(Self {
            name,
            bytes,
            data_start,
            meta,
        })
    }

    /// A shard from bytes in memory.
    pub fn from_bytes(name: String, bytes: Vec<u8>) -> Result<Self, CheckpointError> {
        Self::parse(name, Bytes::Owned(bytes))
    }

    /// A shard memory-mapped from an open regular file.
    ///
    /// # Safety
    ///
    /// The file must not be modified while the shard is alive (as for any mmap).
    pub unsafe fn mmap(name: String, file: &File) -> Result<Self, CheckpointError> {
        let m = memmap2::MmapOptions::new()
            .map(file)
            .map_err(|source| CheckpointError::Io {
                path: name.clone().into(),
                source,
            })?;
        Self::parse(name, Bytes::Mmap(m))
    }

    /// The tensor names.
    pub fn names(&self) -> Vec<String> {
        self.meta.offset_keys()
    }

    /// The header entry of `tensor`.
    pub fn info(&self, tensor: &str) -> Option<&TensorInfo> {
        self.meta.info(tensor)
    }

    /// The bytes of `info` (an entry of this shard's header).
    pub fn data(&self, tensor: &str, info: &TensorInfo) -> Result<&[u8], CheckpointError> {
        let (s, e) = info.data_offsets;
        let range = self
            .data_start
            .checked_add(s)
            .zip(self.data_start.checked_add(e));
        match range.and_then(|(a, b)| self.bytes.as_slice().get(a..b)) {
            Some(d) => Ok(d),
            None => Err(CheckpointError::NotSafetensors {
                file: self.name.clone(),
                reason: format!("tensor `{tensor}`: data offsets {s}..{e} outside the file"),
            }),
        }
    }
}
