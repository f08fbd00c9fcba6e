//! Copying caches for beam search and prefix reuse: a deep copy of a whole cache
//! (`try_clone`) and one sequence's tokens copied over another's (`copy_seq`).
//!
//! The caches write their storage in place (`slice_set`, the UltraQuant store op), so a
//! derived `Clone`, which shares the storage, would let an append to the copy overwrite
//! the original. They implement no `Clone`; these functions copy the storage instead, with
//! device-agnostic tensor copies (`Tensor::copy`, `force_contiguous` + `slice_set`) that
//! run the same on the CPU and on CUDA.

use super::{Bf16Cache, KvCache, Lengths, UltraQuantCache};
use candle_core::{bail, Result, Tensor};

impl Lengths {
    /// A copy with its own device tensor.
    fn try_clone(&self) -> Result<Self> {
        Ok(Self {
            host: self.host.clone(),
            dev: self.dev.copy()?,
        })
    }

    /// Sets sequence `dst`'s length to sequence `src`'s (a fresh device tensor, so no
    /// other cache's lengths can change with it).
    fn copy_len(&mut self, src: usize, dst: usize) -> Result<()> {
        self.host[dst] = self.host[src];
        let v: Vec<u32> = self.host.iter().map(|&n| n as u32).collect();
        self.dev = Tensor::from_vec(v, self.host.len(), self.dev.device())?;
        Ok(())
    }
}

/// Checks `src` and `dst` against `batch`.
fn check_seqs(what: &str, src: usize, dst: usize, batch: usize) -> Result<()> {
    if src >= batch || dst >= batch {
        bail!("{what}: sequences {src} → {dst} out of range (batch {batch})")
    }
    Ok(())
}

/// Copies rows `0..rows` of `t.get(src)` over `t.get(dst)` (dimension 0 of `t` is the
/// sequence), through a fresh tensor so that source and destination never alias.
fn copy_rows(t: &Tensor, src: usize, dst: usize, rows: usize) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let from = t.get(src)?.narrow(0, 0, rows)?.force_contiguous()?;
    t.get(dst)?.slice_set(&from, 0, 0)
}

impl Bf16Cache {
    /// A deep copy: same lengths and contents, its own storage (appends to one never
    /// change the other).
    pub fn try_clone(&self) -> Result<Self> {
        Ok(Self {
            shape: self.shape,
            kv: self.kv.copy()?,
            lens: self.lens.try_clone()?,
        })
    }

    /// Makes sequence `dst` a copy of sequence `src` (its tokens and length); `src` is
    /// unchanged and later appends to either leave the other alone.
    pub fn copy_seq(&mut self, src: usize, dst: usize) -> Result<()> {
        check_seqs("Bf16Cache::copy_seq", src, dst, self.shape.batch)?;
        if src == dst {
            return Ok(());
        }
        let n = self.lens.host[src];
        for kv in 0..2 {
            copy_rows(&self.kv.get(kv)?, src, dst, n)?;
        }
        self.lens.copy_len(src, dst)
    }
}

impl UltraQuantCache {
    /// A deep copy: same lengths, slots and exact window, its own storage.
    pub fn try_clone(&self) -> Result<Self> {
        let window = match &self.window {
            Some(w) => Some(super::ops::ExactWindow {
                size: w.size,
                ring: w.ring.copy()?,
            }),
            None => None,
        };
        Ok(Self {
            shape: self.shape,
            slot: self.slot,
            data: self.data.copy()?,
            lens: self.lens.try_clone()?,
            window,
        })
    }

    /// Makes sequence `dst` a copy of sequence `src` (its slots, exact-window rows and
    /// length); `src` is unchanged and later appends to either leave the other alone.
    pub fn copy_seq(&mut self, src: usize, dst: usize) -> Result<()> {
        check_seqs("UltraQuantCache::copy_seq", src, dst, self.shape.batch)?;
        if src == dst {
            return Ok(());
        }
        let n = self.lens.host[src];
        if n > 0 {
            // `data` is flat: sequence s starts at s · capacity · kv_heads · slot (no
            // overflow: the constructor checked batch · capacity · kv_heads · slot).
            let per_token = self.shape.kv_heads * self.slot;
            let per_seq = self.shape.capacity * per_token;
            let from = self
                .data
                .narrow(0, src * per_seq, n * per_token)?
                .force_contiguous()?;
            self.data.slice_set(&from, 0, dst * per_seq)?;
        }
        if let Some(w) = &self.window {
            for kv in 0..2 {
                copy_rows(&w.ring.get(kv)?, src, dst, w.size)?;
            }
        }
        self.lens.copy_len(src, dst)
    }
}

impl KvCache {
    /// A deep copy of the cache (see [`Bf16Cache::try_clone`]); the cache types implement
    /// no `Clone`, which would share the storage.
    pub fn try_clone(&self) -> Result<Self> {
        Ok(match self {
            Self::Bf16(c) => Self::Bf16(c.try_clone()?),
            Self::UltraQuant(c) => Self::UltraQuant(c.try_clone()?),
        })
    }

    /// Makes sequence `dst` a copy of sequence `src` (beam search, a shared prefix); see
    /// [`Bf16Cache::copy_seq`].
    pub fn copy_seq(&mut self, src: usize, dst: usize) -> Result<()> {
        match self {
            Self::Bf16(c) => c.copy_seq(src, dst),
            Self::UltraQuant(c) => c.copy_seq(src, dst),
        }
    }
}
