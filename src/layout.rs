//! Layout helpers shared by the ops' CPU and CUDA forwards.

use candle_core::{bail, Layout, Result};

/// Contiguous `[start, end)` element range of a layout, or an error naming `what` (`op`
/// names the caller).
pub(crate) fn contiguous_range(op: &str, what: &str, l: &Layout) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{op}: {what} must be contiguous"),
    }
}
