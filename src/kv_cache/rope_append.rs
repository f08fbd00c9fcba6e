//! What both caches' fused decode step (`decode_rope_attention`: the rope, the KV append and
//! the attention in the attention launches) checks and hands to the kernel, and what it
//! updates after them.

use super::lengths::Lengths;
use super::ops::{KvAttention, RopeAppend};
use super::shape::{check_room, CacheShape};
use crate::rope::QkvRope;
use candle_core::{bail, Result, Tensor};

/// Checks `rope` against the cache, `qkv` and `positions` against `rope` and the batch, and
/// that every sequence has room for one more token; returns the query heads and what the
/// kernels need of `rope` (CUDA tables, whether they may launch with PDL).
pub(super) fn prepare(
    what: &str,
    rope: &QkvRope,
    qkv: &Tensor,
    positions: &Tensor,
    sh: &CacheShape,
    lens: &Lengths,
) -> Result<(usize, RopeAppend)> {
    let (q_heads, kv_heads, d) = rope.dims();
    if kv_heads != sh.kv_heads || d != sh.head_dim || q_heads % kv_heads != 0 {
        bail!(
            "{what}: the rope's {q_heads} q / {kv_heads} kv heads of {d} do not fit the cache's {} kv heads of {}",
            sh.kv_heads,
            sh.head_dim
        )
    }
    let b = rope.check(qkv, positions)?;
    if b != sh.batch {
        bail!(
            "{what}: qkv holds {b} rows, the cache {} sequences",
            sh.batch
        )
    }
    check_room(what, &lens.host, 0, 1, sh.capacity)?;
    Ok((q_heads, tables(what, rope, positions, lens)?))
}

/// The split plan's length: the capacity (`capacity_splits`, what a captured graph replays at
/// every length) or the longest sequence after this token.
pub(super) fn max_len(sh: &CacheShape, lens: &Lengths, capacity_splits: bool) -> usize {
    if capacity_splits {
        sh.capacity
    } else {
        lens.host.iter().copied().max().unwrap_or(0) + 1
    }
}

/// Runs `op` (whose `rope` is set) on the raw `qkv` over the cache storage `data` and its
/// device lengths, then advances the host lengths (the kernels advanced the device's).
pub(super) fn run(
    op: &KvAttention,
    qkv: &Tensor,
    data: &Tensor,
    lens: &mut Lengths,
) -> Result<Tensor> {
    let out = qkv.contiguous()?.apply_op3_no_bwd(data, &lens.dev, op)?;
    // Only now: a call that failed before its launch leaves the flag set.
    lens.clear_written();
    for n in &mut lens.host {
        *n += 1;
    }
    Ok(out)
}

/// What the fused decode attention needs of `rope` (CUDA tables) and the lengths (whether
/// it may launch with PDL).
#[cfg(feature = "cuda")]
fn tables(what: &str, rope: &QkvRope, positions: &Tensor, lens: &Lengths) -> Result<RopeAppend> {
    let Some((cos, sin, max_pos)) = rope.cuda_tables() else {
        bail!("{what}: the rope's tables are not on a GPU")
    };
    Ok(RopeAppend {
        positions: positions.clone(),
        cos,
        sin,
        max_pos,
        pdl: !lens.written(),
    })
}

/// Without CUDA there is no fused decode attention.
#[cfg(not(feature = "cuda"))]
fn tables(what: &str, _rope: &QkvRope, _positions: &Tensor, _lens: &Lengths) -> Result<RopeAppend> {
    bail!("{what}: runs on CUDA only (built without the cuda feature)")
}
