//! Checks on a GGUF file before and after candle parses it, so that no field of the file
//! can make the reader divide by zero, overflow, allocate without bound or read past the
//! end:
//!
//! * [`prescan`] walks the header and metadata (lengths only, nothing kept) before
//!   `Content::read`: every length within the file, at most [`MAX_ARRAY_ELEMENTS`]
//!   array elements in all (candle keeps each as a ~32-byte value, so a 1 GB array of
//!   bytes would take 32 GB), at most [`MAX_TENSORS`] tensors, and a nonzero
//!   `general.alignment` (candle divides by it);
//! * [`check_tensor_infos`] after it: each tensor's element count (positive) and byte size
//!   in checked arithmetic, whole blocks per row for its type, and its data inside the
//!   file.

use crate::errors::GgufError;
use candle_core::quantized::gguf_file::Content;
use std::io::{Read, Seek, SeekFrom};

/// Most array elements (all metadata arrays together) a GGUF may hold: 2^25 (the largest
/// vocabularies have a few hundred thousand tokens and merges).
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 25;
/// Most tensors a GGUF may hold: 2^20.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Deepest nesting of arrays accepted.
const MAX_DEPTH: usize = 8;

struct Scan<'a, R> {
    r: &'a mut R,
    len: u64,
    path: &'a str,
    v1: bool,
    elements: u64,
}

impl<R: Read + Seek> Scan<'_, R> {
    fn err(&self, reason: impl Into<String>) -> GgufError {
        GgufError::Header {
            path: self.path.to_string(),
            reason: reason.into(),
        }
    }

    fn pos(&mut self) -> Result<u64, GgufError> {
        self.r
            .stream_position()
            .map_err(|e| self.err(format!("cannot seek: {e}")))
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut b = [0u8; N];
        self.r
            .read_exact(&mut b)
            .map_err(|_| self.err(format!("truncated in {what}")))?;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes::<4>(what)?))
    }

    /// A length field (u32 in GGUF v1, u64 after).
    fn length(&mut self, what: &str) -> Result<u64, GgufError> {
        if self.v1 {
            Ok(self.u32(what)? as u64)
        } else {
            Ok(u64::from_le_bytes(self.bytes::<8>(what)?))
        }
    }

    /// Skips `n` bytes, which must lie inside the file.
    fn skip(&mut self, n: u64, what: &str) -> Result<(), GgufError> {
        let pos = self.pos()?;
        let remaining = self.len.saturating_sub(pos);
        if n > remaining {
            return Err(self.err(format!(
                "{what}: {n} bytes at offset {pos}, only {remaining} left in the file"
            )));
        }
        self.r
            .seek(SeekFrom::Current(n as i64))
            .map_err(|e| self.err(format!("cannot seek: {e}")))?;
        Ok(())
    }

    /// A string: its length is checked against the file; the bytes are returned only when
    /// `keep` (keys), else skipped.
    fn string(&mut self, what: &str, keep: bool) -> Result<Option<Vec<u8>>, GgufError> {
        let n = self.length(what)?;
        if !keep {
            self.skip(n, what)?;
            return Ok(None);
        }
        let pos = self.pos()?;
        if n > self.len.saturating_sub(pos) || n > 1 << 16 {
            return Err(self.err(format!("{what}: a key of {n} bytes at offset {pos}")));
        }
        let mut v = vec![0u8; n as usize];
        self.r
            .read_exact(&mut v)
            .map_err(|_| self.err(format!("truncated in {what}")))?;
        Ok(Some(v))
    }

    /// Skips one value of GGUF type `ty`; returns its integer value for integer types.
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Option<i128>, GgufError> {
        let what = format!("metadata `{key}`");
        Ok(match ty {
            0 => Some(self.bytes::<1>(&what)?[0] as i128),
            1 => Some(self.bytes::<1>(&what)?[0] as i8 as i128),
            2 => Some(u16::from_le_bytes(self.bytes::<2>(&what)?) as i128),
            3 => Some(i16::from_le_bytes(self.bytes::<2>(&what)?) as i128),
            4 => Some(self.u32(&what)? as i128),
            5 => Some(self.u32(&what)? as i32 as i128),
            6 => {
                self.skip(4, &what)?;
                None
            }
            7 => {
                self.skip(1, &what)?;
                None
            }
            8 => {
                self.string(&what, false)?;
                None
            }
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.err(format!("{what}: arrays nested deeper than {MAX_DEPTH}")));
                }
                let elem = self.u32(&what)?;
                let n = self.length(&what)?;
                self.elements = self.elements.saturating_add(n);
                if self.elements > MAX_ARRAY_ELEMENTS {
                    return Err(self.err(format!(
                        "{what}: an array of {n} elements takes the metadata past {MAX_ARRAY_ELEMENTS} array elements in all"
                    )));
                }
                let fixed = match elem {
                    0 | 1 | 7 => Some(1u64),
                    2 | 3 => Some(2),
                    4..=6 => Some(4),
                    10..=12 => Some(8),
                    _ => None,
                };
                match fixed {
                    Some(size) => self.skip(n.saturating_mul(size), &what)?,
                    None => {
                        for _ in 0..n {
                            self.value(elem, key, depth + 1)?;
                        }
                    }
                }
                None
            }
            10 => Some(u64::from_le_bytes(self.bytes::<8>(&what)?) as i128),
            11 => Some(i64::from_le_bytes(self.bytes::<8>(&what)?) as i128),
            12 => {
                self.skip(8, &what)?;
                None
            }
            t => return Err(self.err(format!("{what}: unknown value type {t}"))),
        })
    }
}

/// Walks the header and metadata of the GGUF in `r` (`len` bytes; read from the current
/// position, which is restored) and checks the limits in the module docs. `path` names the
/// file in errors.
pub fn prescan<R: Read + Seek>(r: &mut R, len: u64, path: &str) -> Result<(), GgufError> {
    let start = r.stream_position().map_err(|e| GgufError::Header {
        path: path.to_string(),
        reason: format!("cannot seek: {e}"),
    })?;
    let mut s = Scan {
        r,
        len,
        path,
        v1: false,
        elements: 0,
    };
    let magic = s.bytes::<4>("the magic")?;
    if &magic != b"GGUF" {
        return Err(s.err(format!("magic {magic:02x?} is not `GGUF`")));
    }
    let version = s.u32("the version")?;
    s.v1 = match version {
        1 => true,
        2 | 3 => false,
        v => return Err(s.err(format!("GGUF version {v} (1, 2 and 3 are read)"))),
    };
    let tensors = s.length("the tensor count")?;
    if tensors > MAX_TENSORS {
        return Err(s.err(format!("{tensors} tensors, more than {MAX_TENSORS}")));
    }
    let kvs = s.length("the metadata count")?;
    for i in 0..kvs {
        let key = s
            .string(&format!("metadata key {i}"), true)?
            .unwrap_or_default();
        let key = String::from_utf8_lossy(&key).into_owned();
        let ty = s.u32(&format!("metadata `{key}`"))?;
        let v = s.value(ty, &key, 0)?;
        // candle reads the alignment from these types and divides by it.
        if key == "general.alignment" && (0..=5).contains(&ty) && v == Some(0) {
            return Err(GgufError::BadMetadata {
                path: path.to_string(),
                key,
                value: "0".into(),
                expected: "a positive alignment".into(),
            });
        }
    }
    s.r.seek(SeekFrom::Start(start))
        .map_err(|e| GgufError::Header {
            path: path.to_string(),
            reason: format!("cannot seek: {e}"),
        })?;
    Ok(())
}

/// Checks every tensor entry of `c` (a file of `len` bytes): element count and byte size
/// in checked arithmetic, whole blocks per row, data inside the file.
pub fn check_tensor_infos(c: &Content, len: u64, path: &str) -> Result<(), GgufError> {
    for (name, t) in &c.tensor_infos {
        let bad = |reason: String| GgufError::BadTensor {
            path: path.to_string(),
            tensor: name.clone(),
            reason,
        };
        let dims = t.shape.dims();
        let elems = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(|| bad(format!("shape {dims:?} overflows")))?;
        if elems == 0 {
            // candle reinterprets the (empty, unaligned) byte buffer as blocks: UB.
            return Err(bad(format!("shape {dims:?} holds no values")));
        }
        let (block, type_size) = (
            t.ggml_dtype.block_size() as u64,
            t.ggml_dtype.type_size() as u64,
        );
        let row = dims.last().copied().unwrap_or(1) as u64;
        if block == 0 || !row.is_multiple_of(block) {
            return Err(bad(format!(
                "rows of {row} values are not whole {:?} blocks of {block}",
                t.ggml_dtype
            )));
        }
        let bytes = (elems / block)
            .checked_mul(type_size)
            .ok_or_else(|| bad(format!("shape {dims:?} overflows in bytes")))?;
        let start = c.tensor_data_offset.checked_add(t.offset);
        match start.and_then(|s| s.checked_add(bytes)) {
            Some(end) if end <= len => {}
            _ => {
                return Err(bad(format!(
                    "{bytes} bytes at offset {} + {} run past the end of the file ({len} bytes)",
                    c.tensor_data_offset, t.offset
                )))
            }
        }
    }
    Ok(())
}
