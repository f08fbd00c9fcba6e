//! [`ModelFolder`]: the only way files of a model folder are opened. A name read from a
//! file must be a plain file name; the path must be a regular file (or a symlink to one
//! inside the folder); FIFOs, sockets, devices and directories are refused before they
//! are opened, so that nothing outside the folder is read and nothing blocks.

use crate::error::CheckpointError;
use std::fs::{File, Metadata};
use std::io::Read;
use std::path::{Component, Path, PathBuf};

/// Largest JSON file (config, index, tokenizer) read into memory: 256 MiB. The biggest
/// real tokenizer.json files are tens of MiB.
pub const MAX_JSON_BYTES: u64 = 256 << 20;

/// A model folder whose files are opened only through [`ModelFolder::open`] and friends.
#[derive(Debug, Clone)]
pub struct ModelFolder {
    dir: PathBuf,
    canon: PathBuf,
}

/// Whether `name` is a plain file name: not empty, not `.` or `..`, no `/`, `\` or NUL
/// (and on Windows no `:`). `origin` names where it was read in the error.
pub fn check_file_name(origin: &str, name: &str) -> Result<(), CheckpointError> {
    let bad = |reason: &str| {
        Err(CheckpointError::PathOutsideFolder {
            origin: origin.to_string(),
            name: name.to_string(),
            reason: reason.to_string(),
        })
    };
    if name.is_empty() {
        return bad("an empty name");
    }
    if name == "." || name == ".." {
        return bad("`.` and `..` are not file names");
    }
    if name.contains('\0') {
        return bad("it contains a NUL byte");
    }
    if name.starts_with('/') || name.starts_with('\\') {
        return bad("an absolute path");
    }
    if name.contains('/') || name.contains('\\') {
        return bad("a path with separators; shards must sit in the folder itself");
    }
    if cfg!(windows) && name.contains(':') {
        return bad("a drive or stream prefix");
    }
    Ok(())
}

/// What a file type is, for [`CheckpointError::NotARegularFile`].
pub(crate) fn kind_of(m: &Metadata) -> &'static str {
    let t = m.file_type();
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_block_device() || t.is_char_device() {
            return "a device";
        }
    }
    "not a regular file"
}

/// Whether the lexical target of a symlink at `link` (inside `dir`) can leave `dir`: an
/// absolute target, or one that climbs above the folder with `..`.
fn target_leaves(target: &Path) -> bool {
    let mut depth = 0i64;
    for c in target.components() {
        match c {
            Component::Prefix(_) | Component::RootDir => return true,
            Component::ParentDir => {
                depth -= 1;
                if depth < 0 {
                    return true;
                }
            }
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
        }
    }
    false
}

impl ModelFolder {
    /// The folder `dir`; errors when it is not a directory.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let dir = dir.as_ref().to_path_buf();
        if !dir.is_dir() {
            return Err(CheckpointError::NotAFolder { dir });
        }
        let canon = std::fs::canonicalize(&dir).map_err(|source| CheckpointError::Io {
            path: dir.clone(),
            source,
        })?;
        Ok(Self { dir, canon })
    }

    /// The folder as given.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Whether the folder has an entry `name` (a file, link or anything else; links are
    /// not followed). Errors for a name that is not a plain file name.
    pub fn contains(&self, name: &str) -> Result<bool, CheckpointError> {
        check_file_name(&self.dir.display().to_string(), name)?;
        Ok(std::fs::symlink_metadata(self.dir.join(name)).is_ok())
    }

    /// The path of file `name` after the checks (see the type docs); `origin` says where
    /// the name was read (e.g. `index.json: weight_map[x]`) for the error.
    pub fn resolve(&self, origin: &str, name: &str) -> Result<PathBuf, CheckpointError> {
        check_file_name(origin, name)?;
        let path = self.dir.join(name);
        let io = |source| CheckpointError::Io {
            path: path.clone(),
            source,
        };
        let lm = std::fs::symlink_metadata(&path).map_err(io)?;
        if lm.file_type().is_symlink() {
            let outside = |target: &Path| CheckpointError::PathOutsideFolder {
                origin: origin.to_string(),
                name: name.to_string(),
                reason: format!("a symlink to {} outside the folder", target.display()),
            };
            match std::fs::canonicalize(&path) {
                Ok(t) if t.starts_with(&self.canon) => {}
                Ok(t) => return Err(outside(&t)),
                Err(e) => {
                    // Dangling: say "outside" from the link text alone, so that the error
                    // does not tell whether some path outside the folder exists.
                    let target = std::fs::read_link(&path).map_err(io)?;
                    if target_leaves(&target) {
                        return Err(outside(&target));
                    }
                    return Err(io(e));
                }
            }
        }
        let m = std::fs::metadata(&path).map_err(io)?;
        if !m.is_file() {
            return Err(CheckpointError::NotARegularFile {
                path,
                kind: kind_of(&m),
            });
        }
        Ok(path)
    }

    /// Opens file `name` for reading after [`resolve`](Self::resolve)'s checks. On Unix it
    /// is opened non-blocking and checked again on the open descriptor, so a FIFO swapped
    /// in after the check can neither block nor be read.
    pub fn open(&self, origin: &str, name: &str) -> Result<(PathBuf, File), CheckpointError> {
        let path = self.resolve(origin, name)?;
        let f = open_regular(&path)?;
        Ok((path, f))
    }

    /// The bytes of file `name`, at most `limit` of them (else
    /// [`CheckpointError::FileTooLarge`]).
    pub fn read(&self, name: &str, limit: u64) -> Result<Vec<u8>, CheckpointError> {
        let (path, f) = self.open(&self.dir.display().to_string(), name)?;
        read_limited(&path, f, limit)
    }

    /// Like [`read`](Self::read), but `None` when the folder has no entry `name`.
    pub fn read_optional(
        &self,
        name: &str,
        limit: u64,
    ) -> Result<Option<Vec<u8>>, CheckpointError> {
        if !self.contains(name)? {
            return Ok(None);
        }
        self.read(name, limit).map(Some)
    }

    /// A UTF-8 text file of the folder (JSON, templates), at most [`MAX_JSON_BYTES`];
    /// `None` when absent.
    pub fn read_text(&self, name: &str) -> Result<Option<(PathBuf, String)>, CheckpointError> {
        let Some(bytes) = self.read_optional(name, MAX_JSON_BYTES)? else {
            return Ok(None);
        };
        let path = self.dir.join(name);
        match String::from_utf8(bytes) {
            Ok(s) => Ok(Some((path, s))),
            Err(e) => Err(CheckpointError::Io {
                path,
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()),
            }),
        }
    }
}

/// Opens `path` (already checked to be a regular file) and checks the open descriptor.
pub(crate) fn open_regular(path: &Path) -> Result<File, CheckpointError> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NONBLOCK);
    }
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let f = o.open(path).map_err(io)?;
    let m = f.metadata().map_err(io)?;
    if !m.is_file() {
        return Err(CheckpointError::NotARegularFile {
            path: path.to_path_buf(),
            kind: kind_of(&m),
        });
    }
    Ok(f)
}

/// Reads all of `f` (at `path`), refusing more than `limit` bytes.
pub(crate) fn read_limited(path: &Path, f: File, limit: u64) -> Result<Vec<u8>, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let size = f.metadata().map_err(io)?.len();
    if size > limit {
        return Err(CheckpointError::FileTooLarge {
            path: path.to_path_buf(),
            size,
            limit,
        });
    }
    let mut v = Vec::new();
    // `take`: a file that grows while read still stops at the limit.
    f.take(limit.saturating_add(1))
        .read_to_end(&mut v)
        .map_err(io)?;
    if v.len() as u64 > limit {
        return Err(CheckpointError::FileTooLarge {
            path: path.to_path_buf(),
            size: v.len() as u64,
            limit,
        });
    }
    Ok(v)
}
