//! Format constants and the per-slot byte layout (mirror of vLLM's
//! `ultraquant/format.py`).
//!
//! A slot holds one (token, head): `[K codes D/2][K scales D/G][V codes D/2][V scales D/G]`
//! with `G` the group size (32). The `*_bytes` functions give the size of each part and the
//! `*_offset` functions where it starts inside the slot.

use candle_core::{bail, Result};

/// The UltraQuant scale constant `c`: a group's raw scale is `c · absmax` before it is
/// snapped to a power of two. 0.156 is MSE-optimal for the E2M1 grid (it deliberately clips
/// the top of some groups to ±6).
pub const DEFAULT_CONSTANT_C: f32 = 0.156;

/// Largest E2M1 magnitude.
pub const FP4_MAX: f32 = 6.0;

/// Elements per group along head_dim; one UE8M0 scale byte per group. Fixed at 32 by the
/// AMD CDNA4 scaled F8F6F4 MFMA (and equal to the MXFP4 block size).
pub const GROUP_SIZE: usize = 32;

/// The fixed scale constant, [`DEFAULT_CONSTANT_C`].
pub fn get_constant_c() -> f32 {
    DEFAULT_CONSTANT_C
}

/// The fixed group size, [`GROUP_SIZE`].
pub fn get_group_size() -> usize {
    GROUP_SIZE
}

/// Bytes of one head's packed K codes (two E2M1 codes per byte): `head_dim / 2`.
///
/// Errors when `head_dim` is zero or odd.
pub fn k_codes_bytes(head_dim: usize) -> Result<usize> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        bail!("ultraquant k_codes_bytes: head_dim must be even and positive, got {head_dim}")
    }
    Ok(head_dim / 2)
}

/// Groups per head: `head_dim / group_size` (`group_size` defaults to [`GROUP_SIZE`]).
///
/// Errors when `head_dim` or `group_size` is zero, or `head_dim` is not a multiple of
/// `group_size`.
pub fn n_groups(head_dim: usize, group_size: Option<usize>) -> Result<usize> {
    let gs = group_size.unwrap_or(GROUP_SIZE);
    if gs == 0 {
        bail!("ultraquant n_groups: group_size must be positive, got 0")
    }
    if head_dim == 0 || !head_dim.is_multiple_of(gs) {
        bail!("ultraquant n_groups: head_dim={head_dim} must be a positive multiple of group_size={gs}")
    }
    Ok(head_dim / gs)
}

/// Bytes of one head's K scales: one UE8M0 byte per group (see [`n_groups`]).
pub fn k_scales_bytes(head_dim: usize, group_size: Option<usize>) -> Result<usize> {
    n_groups(head_dim, group_size)
}

/// Bytes of one head's packed V codes; same as [`k_codes_bytes`].
pub fn v_codes_bytes(head_dim: usize) -> Result<usize> {
    k_codes_bytes(head_dim)
}

/// Bytes of one head's V scales; same as [`k_scales_bytes`].
pub fn v_scales_bytes(head_dim: usize, group_size: Option<usize>) -> Result<usize> {
    k_scales_bytes(head_dim, group_size)
}

/// Bytes per (token, head) slot: `2 · (head_dim / 2 + head_dim / group_size)`.
///
/// 68 at head_dim 64, 136 at 128, 272 at 256 (group size 32). Errors as [`k_codes_bytes`]
/// and [`n_groups`] do.
pub fn slot_size(head_dim: usize, group_size: Option<usize>) -> Result<usize> {
    Ok(k_codes_bytes(head_dim)?
        + k_scales_bytes(head_dim, group_size)?
        + v_codes_bytes(head_dim)?
        + v_scales_bytes(head_dim, group_size)?)
}

/// Byte offset of the K codes inside a slot (always 0; validates the arguments).
pub fn k_codes_offset(head_dim: usize, group_size: Option<usize>) -> Result<usize> {
    slot_size(head_dim, group_size)?;
    Ok(0)
}

/// Byte offset of the K scales inside a slot: `head_dim / 2`.
pub fn k_scales_offset(head_dim: usize, group_size: Option<usize>) -> Result<usize> {
    slot_size(head_dim, group_size)?;
    k_codes_bytes(head_dim)
}

/// Byte offset of the V codes inside a slot: `head_dim / 2 + n_groups`.
pub fn v_codes_offset(head_dim: usize, group_size: Option<usize>) -> Result<usize> {
    Ok(k_codes_bytes(head_dim)? + k_scales_bytes(head_dim, group_size)?)
}

/// Byte offset of the V scales inside a slot: `head_dim + n_groups`.
pub fn v_scales_offset(head_dim: usize, group_size: Option<usize>) -> Result<usize> {
    Ok(v_codes_offset(head_dim, group_size)? + v_codes_bytes(head_dim)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_vllm_docstring() {
        for (d, size) in [(64, 68), (128, 136), (256, 272)] {
            assert_eq!(slot_size(d, None).unwrap(), size);
            let g = d / 32;
            assert_eq!(k_scales_offset(d, None).unwrap(), d / 2);
            assert_eq!(v_codes_offset(d, None).unwrap(), d / 2 + g);
            assert_eq!(v_scales_offset(d, None).unwrap(), d + g);
            assert_eq!(v_scales_offset(d, None).unwrap() + g, size);
        }
        assert!(k_codes_bytes(7).is_err());
        assert!(n_groups(48, None).is_err());
        assert!(n_groups(32, Some(0)).is_err());
    }
}
