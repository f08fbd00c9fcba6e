//! Typed errors of the file-reading layer ([`CheckpointError`], [`SizeError`],
//! [`QuantizeError`]) and
//! [`find`], which digs one out of the candle or `anyhow` error that carries it.
//!
//! The library's functions return `candle_core::Result`; the checkpoint reader returns
//! `Result<_, CheckpointError>` directly. When one of these errors travels through a function returning `candle_core::Result`, it is boxed as
//! `candle_core::Error::Io(std::io::Error::other(e))`: that is candle's only variant whose
//! `Display` is the inner error's own and whose payload can be downcast again. Callers that
//! branch on the kind of failure call [`find`] instead of matching message text:
//!
//! ```
//! use candle_fp4::checkpoint::Checkpoint;
//! use candle_fp4::error::{find, CheckpointError};
//!
//! // An empty folder: no weights.
//! let dir = std::env::temp_dir().join(format!("candle-fp4-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let err = Checkpoint::read(&dir).unwrap_err();
//! assert!(matches!(err, CheckpointError::NoWeights { .. }));
//! // Through a function that returns candle's error type, the same error is found again.
//! let loaded = |d: &std::path::Path| -> candle_core::Result<()> {
//!     Checkpoint::read(d)?;
//!     Ok(())
//! };
//! let err = loaded(&dir).unwrap_err();
//! assert!(matches!(
//!     find::<CheckpointError>(&err),
//!     Some(CheckpointError::NoWeights { .. })
//! ));
//! std::fs::remove_dir(&dir).unwrap();
//! ```
//!
//! Every message names the file, tensor or field and shows the offending value as it was
//! read (never a wrapped or clamped one).

use candle_core::DType;
use std::error::Error as StdError;
use std::path::PathBuf;

/// Why a model folder, index or safetensors file was refused. See the module docs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The OS refused to read `path` (missing, permission, I/O error).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `dir` is not a directory (missing, or a file).
    #[error("{}: not a model folder (it does not exist or is not a directory)", dir.display())]
    NotAFolder {
        /// The path given.
        dir: PathBuf,
    },
    /// The folder has neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{}: no model.safetensors or model.safetensors.index.json", dir.display())]
    NoWeights {
        /// The folder.
        dir: PathBuf,
    },
    /// `model.safetensors.index.json` is not what transformers writes.
    #[error("{file}: {reason}")]
    InvalidIndex {
        /// The index file.
        file: String,
        /// What is wrong, with the offending value.
        reason: String,
    },
    /// A file name read from a file (an index's `weight_map` entry) is not a plain file
    /// name inside the model folder: it is empty, absolute, has a separator or `..`, or is
    /// a symlink whose target lies outside the folder.
    #[error("{origin}: `{name}` is not a file inside the model folder ({reason})")]
    PathOutsideFolder {
        /// Where the name was read (the index file and key), or the folder.
        origin: String,
        /// The name as read.
        name: String,
        /// Which rule it breaks.
        reason: String,
    },
    /// A path in the model folder is not a regular file (a FIFO, socket, device or
    /// directory); it was not opened.
    #[error("{}: not a regular file ({kind})", path.display())]
    NotARegularFile {
        /// The path.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// A JSON file larger than the reader accepts.
    #[error("{}: {size} bytes, more than the {limit} this reader accepts", path.display())]
    FileTooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The bytes of a shard are not a valid safetensors file.
    #[error("{file}: not a safetensors file: {reason}")]
    NotSafetensors {
        /// The shard (or the name given to a buffer).
        file: String,
        /// The parser's complaint.
        reason: String,
    },
    /// A tensor the model needs is in no shard.
    #[error("{file}: tensor `{tensor}` is missing")]
    MissingTensor {
        /// The checkpoint (folder, index or file).
        file: String,
        /// The tensor.
        tensor: String,
    },
    /// Two shards hold a tensor of the same name.
    #[error("{origin}: tensor `{tensor}` is in both {first} and {second}")]
    DuplicateTensor {
        /// The checkpoint.
        origin: String,
        /// The tensor.
        tensor: String,
        /// One shard.
        first: String,
        /// The other.
        second: String,
    },
    /// The index's `weight_map` puts a tensor in a shard that does not hold it.
    #[error("{index}: weight_map puts `{tensor}` in {listed}, which does not hold it{}",
        found.as_ref().map(|f| format!(" (it is in {f})")).unwrap_or_default())]
    IndexMismatch {
        /// The index file.
        index: String,
        /// The tensor.
        tensor: String,
        /// The shard the index names.
        listed: String,
        /// The shard that holds it, if any.
        found: Option<String>,
    },
    /// A tensor's stored dtype has no candle equivalent.
    #[error("{file}: tensor `{tensor}` has dtype {dtype}, which candle cannot hold")]
    UnsupportedDtype {
        /// The shard.
        file: String,
        /// The tensor.
        tensor: String,
        /// The safetensors dtype as stored.
        dtype: String,
    },
    /// A tensor has a dtype the caller cannot use.
    #[error("{file}: tensor `{tensor}` has dtype {found:?}, expected {expected}")]
    WrongDtype {
        /// The checkpoint.
        file: String,
        /// The tensor.
        tensor: String,
        /// The stored dtype.
        found: DType,
        /// What was expected, e.g. `BF16 or F32`.
        expected: String,
    },
    /// A tensor has a shape the caller cannot use.
    #[error("{file}: tensor `{tensor}` has shape {found:?}, expected {expected}")]
    WrongShape {
        /// The checkpoint.
        file: String,
        /// The tensor.
        tensor: String,
        /// The stored shape.
        found: Vec<usize>,
        /// What was expected, e.g. `[576]` or `a scalar ([] or [1])`.
        expected: String,
    },
    /// An NVFP4 E4M3 block scale is negative or NaN (ModelOpt writes only positive
    /// finite scales); `index` is the first bad one in row-major order.
    #[error("{file}: tensor `{tensor}`: block scale {index} (row {row}, block {block}) is byte {byte:#04x} = {value}: E4M3 block scales must be finite and non-negative")]
    BadBlockScale {
        /// The checkpoint.
        file: String,
        /// The `weight_scale` tensor.
        tensor: String,
        /// Row-major index of the first bad scale.
        index: usize,
        /// Its row (output feature).
        row: usize,
        /// Its 16-block within the row.
        block: usize,
        /// The stored byte.
        byte: u8,
        /// Its E4M3 value.
        value: f32,
    },
    /// An NVFP4 global scale (`weight_scale_2`) that is not a positive finite number.
    #[error(
        "{file}: tensor `{tensor}` = {value}: a global scale must be a positive finite number"
    )]
    BadGlobalScale {
        /// The checkpoint.
        file: String,
        /// The `weight_scale_2` tensor.
        tensor: String,
        /// The value as stored.
        value: f32,
    },
}

/// A size computed from a file, a flag or an argument that does not fit (overflow) or
/// exceeds what can be allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SizeError {
    /// `a × b` (or a longer product) overflows `u64`/`usize`; the factors as given.
    #[error("{what}: {expr} overflows")]
    Overflow {
        /// The caller and quantity, e.g. `quantize_nvfp4: n·k`.
        what: String,
        /// The product with its factors as given, e.g. `2305843009213693952 × 16`.
        expr: String,
    },
    /// An allocation of `bytes` bytes that the host refused (instead of aborting).
    #[error("{what}: cannot allocate {bytes} bytes on the host")]
    Alloc {
        /// The caller and buffer.
        what: String,
        /// The size asked for.
        bytes: u64,
    },
}

/// Why [`quantize_nvfp4_slice`](crate::nvfp4::quantize_nvfp4_slice) refused a matrix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum QuantizeError {
    /// `k` is 0 or not a multiple of 16.
    #[error("quantize_nvfp4: in_features k = {k} must be a positive multiple of 16")]
    BadK {
        /// The given `k`.
        k: usize,
    },
    /// The slice does not hold `n·k` values.
    #[error("quantize_nvfp4: got {len} values for a [{n}, {k}] matrix")]
    Length {
        /// Values given.
        len: usize,
        /// Rows.
        n: usize,
        /// Columns.
        k: usize,
    },
    /// A weight is NaN or ±∞.
    #[error("quantize_nvfp4: non-finite weight {value} at row {row}, column {col}")]
    NonFinite {
        /// Its row.
        row: usize,
        /// Its column.
        col: usize,
        /// The value.
        value: f32,
    },
    /// Every weight is zero: the global scale would be 0.
    #[error("quantize_nvfp4: the [{n}, {k}] matrix is all zeros; its global scale would be 0")]
    AllZero {
        /// Rows.
        n: usize,
        /// Columns.
        k: usize,
    },
    /// The largest magnitude is so small that `amax / (6·448)` underflows to 0 in FP32.
    #[error("quantize_nvfp4: the [{n}, {k}] matrix's amax {amax:e} is so small that its global scale amax/(6*448) underflows to 0 in FP32")]
    GlobalScaleUnderflow {
        /// Rows.
        n: usize,
        /// Columns.
        k: usize,
        /// The largest magnitude.
        amax: f32,
    },
    /// A given global scale that is not a positive finite number.
    #[error("quantize_nvfp4: global scale {value} must be a positive finite number")]
    BadGlobalScale {
        /// The given scale.
        value: f32,
    },
    /// A given global scale smaller than the matrix needs.
    #[error("quantize_nvfp4: global scale {value} is below this matrix's amax/(6*448) = {needed}")]
    GlobalScaleTooSmall {
        /// The given scale.
        value: f32,
        /// `amax / (6·448)`.
        needed: f32,
    },
}

impl From<QuantizeError> for candle_core::Error {
    fn from(e: QuantizeError) -> Self {
        candle_core::Error::Io(std::io::Error::other(e))
    }
}

impl From<CheckpointError> for candle_core::Error {
    fn from(e: CheckpointError) -> Self {
        candle_core::Error::Io(std::io::Error::other(e))
    }
}

impl From<SizeError> for candle_core::Error {
    fn from(e: SizeError) -> Self {
        candle_core::Error::Io(std::io::Error::other(e))
    }
}

/// The first `E` in `err`: `err` itself, its `source()` chain, and the errors candle and
/// `std::io` box (`candle_core::Error::{Context, WithBacktrace, WithPath, WrappedContext,
/// Io, Cuda}`, `io::Error::other`). For an `anyhow::Error`, pass `err.as_ref()` (or call
/// this on each of `err.chain()`).
pub fn find<'a, E: StdError + 'static>(err: &'a (dyn StdError + 'static)) -> Option<&'a E> {
    let mut cur: Option<&'a (dyn StdError + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(hit) = e.downcast_ref::<E>() {
            return Some(hit);
        }
        if let Some(c) = e.downcast_ref::<candle_core::Error>() {
            if let Some(inner) = candle_inner(c) {
                if let Some(hit) = find::<E>(inner) {
                    return Some(hit);
                }
            }
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if let Some(inner) = io.get_ref() {
                let inner: &(dyn StdError + 'static) = inner;
                if let Some(hit) = find::<E>(inner) {
                    return Some(hit);
                }
            }
        }
        cur = e.source();
    }
    None
}

/// The error a candle wrapper variant boxes, if any.
fn candle_inner(e: &candle_core::Error) -> Option<&(dyn StdError + 'static)> {
    use candle_core::Error as C;
    match e {
        C::Context { inner, .. } | C::WithBacktrace { inner, .. } | C::WithPath { inner, .. } => {
            Some(inner.as_ref())
        }
        C::WrappedContext { wrapped, .. } => Some(wrapped.as_ref()),
        C::Cuda(b) => Some(b.as_ref()),
        C::Io(io) => Some(io),
        _ => None,
    }
}

/// `a × b` in `u64`, or [`SizeError::Overflow`] naming `what` and the factors.
pub fn checked_mul(what: &str, a: u64, b: u64) -> Result<u64, SizeError> {
    a.checked_mul(b).ok_or_else(|| SizeError::Overflow {
        what: what.to_string(),
        expr: format!("{a} × {b}"),
    })
}

/// The product of `factors` in `usize`, or [`SizeError::Overflow`] naming `what` and
/// every factor.
pub fn checked_product(what: &str, factors: &[usize]) -> Result<usize, SizeError> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| SizeError::Overflow {
            what: what.to_string(),
            expr: factors
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(" × "),
        })
}

/// Checks that the host can allocate `bytes` bytes now, by reserving (and releasing) them:
/// an impossible size becomes [`SizeError::Alloc`] instead of an abort in a later
/// infallible allocation. Sizes up to 64 MiB are not probed.
pub fn check_host_alloc(what: &str, bytes: u64) -> Result<(), SizeError> {
    const SMALL: u64 = 64 << 20;
    if bytes <= SMALL {
        return Ok(());
    }
    let fail = || SizeError::Alloc {
        what: what.to_string(),
        bytes,
    };
    let n = usize::try_from(bytes).map_err(|_| fail())?;
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(n).map_err(|_| fail())?;
    Ok(())
}
