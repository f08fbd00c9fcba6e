//! Writing a model folder all or nothing: the quantizer writes into a hidden staging
//! folder next to the destination (same parent, so the final rename is atomic) and renames
//! it into place only when every file is complete. A run that fails (or is killed) leaves
//! the destination as it was: absent, or an empty folder.
//!
//! Also [`copy_model_file`]: a file of a source model folder copied through
//! [`ModelFolder`] (no escape from the folder, no FIFO), with read and write errors told
//! apart.

use anyhow::{Context, Result};
use candle_fp4::checkpoint::ModelFolder;
use std::path::{Path, PathBuf};

/// Why an output folder cannot be written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OutputError {
    /// The destination exists and is not an empty folder.
    #[error("{}: output folder exists and is not empty", path.display())]
    NotEmpty {
        /// The destination.
        path: PathBuf,
    },
    /// The destination exists and is not a folder.
    #[error("{}: output exists and is not a folder", path.display())]
    NotAFolder {
        /// The destination.
        path: PathBuf,
    },
}

/// Checks that `output` is absent or an empty folder.
pub fn check_output(output: &Path) -> Result<(), OutputError> {
    match std::fs::symlink_metadata(output) {
        Err(_) => Ok(()),
        Ok(m) if !m.is_dir() => Err(OutputError::NotAFolder {
            path: output.to_path_buf(),
        }),
        Ok(_) => {
            let empty = std::fs::read_dir(output)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
            if empty {
                Ok(())
            } else {
                Err(OutputError::NotEmpty {
                    path: output.to_path_buf(),
                })
            }
        }
    }
}

/// The staging folder for `output`: `.<name>.partial-<pid>-<n>` in the same parent.
fn staging_path(output: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    let n = N.fetch_add(1, Ordering::Relaxed);
    output.with_file_name(format!(".{name}.partial-{}-{n}", std::process::id()))
}

/// Runs `write(staging)` and moves the staging folder to `output` when it succeeds; on
/// failure removes it, leaving `output` untouched. `output` must be absent or an empty
/// folder ([`OutputError`]); its parent is created if needed.
pub fn write_atomically<T>(output: &Path, write: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
    check_output(output)?;
    if let Some(parent) = output.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let staging = staging_path(output);
    std::fs::create_dir(&staging)
        .with_context(|| format!("cannot create the staging folder {}", staging.display()))?;
    let result = write(&staging).and_then(|v| {
        move_into_place(&staging, output)?;
        Ok(v)
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}

/// `rename(staging, output)`; an empty `output` folder is replaced (POSIX `rename` does
/// that itself; elsewhere it is removed first).
fn move_into_place(staging: &Path, output: &Path) -> Result<()> {
    if std::fs::rename(staging, output).is_ok() {
        return Ok(());
    }
    check_output(output)?;
    if output.is_dir() {
        std::fs::remove_dir(output)
            .with_context(|| format!("cannot replace the empty folder {}", output.display()))?;
    }
    std::fs::rename(staging, output)
        .with_context(|| format!("cannot move {} to {}", staging.display(), output.display()))
}

/// Copies file `name` of the model folder `src` to `dest` when `src` has it (`Ok(false)`
/// when it does not). The source is opened through [`ModelFolder`]: a symlink out of the
/// folder or a FIFO is an error, not something to copy. Errors say whether reading or
/// writing failed.
pub fn copy_model_file(src: &ModelFolder, name: &str, dest: &Path) -> Result<bool> {
    const MAX_COPY: u64 = 1 << 30; // tokenizer files are at most tens of MiB
    let Some(bytes) = src.read_optional(name, MAX_COPY)? else {
        return Ok(false);
    };
    std::fs::write(dest, bytes).with_context(|| format!("cannot write {}", dest.display()))?;
    Ok(true)
}

/// Copies `r` into `w` like `std::io::copy`, but an error says which side failed: reading
/// `from` or writing `to`.
pub fn copy_stream(
    r: &mut dyn std::io::Read,
    from: &str,
    w: &mut dyn std::io::Write,
    to: &Path,
) -> Result<u64> {
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let k = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(anyhow::Error::new(e).context(format!("cannot read {from}"))),
        };
        w.write_all(&buf[..k])
            .with_context(|| format!("cannot write {}", to.display()))?;
        n += k as u64;
    }
    w.flush()
        .with_context(|| format!("cannot write {}", to.display()))?;
    Ok(n)
}
