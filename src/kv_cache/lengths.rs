//! Per-sequence lengths of a cache: on the host (checks, read-back) and as a U32 tensor on
//! the cache's device (what the kernels read), updated in place on the device (a decode
//! step allocates nothing for them).

use super::ops::{LensUpdate, PlanRef};
use candle_core::{bail, DType, Device, Result, Tensor};

/// The lengths, host and device.
#[derive(Debug)]
pub(crate) struct Lengths {
    pub host: Vec<usize>,
    pub dev: Tensor,
    /// A host call wrote the device lengths (and with them, the cache's rows) since the
    /// last fused decode attention was queued ([`clear_written`](Self::clear_written)): the
    /// next one must not read them before the previous kernel has finished (no PDL).
    written: bool,
}

impl Clone for Lengths {
    /// A deep copy: the device lengths are updated in place, so a clone gets its own.
    fn clone(&self) -> Self {
        Self {
            host: self.host.clone(),
            dev: self.dev.copy().unwrap_or_else(|_| self.dev.clone()),
            written: true,
        }
    }
}

impl Lengths {
    pub(crate) fn zeros(batch: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            host: vec![0; batch],
            dev: Tensor::zeros(batch, DType::U32, device)?,
            written: true,
        })
    }

    /// Whether a host call wrote the device lengths since the last fused decode attention
    /// was queued (see `written`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn written(&self) -> bool {
        self.written
    }

    /// A fused decode attention was queued: the writes before it are ordered (it launched
    /// without PDL, or none was pending).
    pub(crate) fn clear_written(&mut self) {
        self.written = false;
    }

    fn update(
        &mut self,
        plan: &PlanRef,
        seq_base: usize,
        n_seq: usize,
        value: usize,
        add: bool,
    ) -> Result<()> {
        let op = LensUpdate {
            seq_base,
            n_seq,
            value,
            add,
            plan: plan.clone(),
        };
        self.dev.inplace_op1(&op)?;
        self.written = true;
        for n in &mut self.host[seq_base..seq_base + n_seq] {
            *n = if add { *n + value } else { value };
        }
        Ok(())
    }

    /// `tokens` more in sequences `seq_base .. seq_base + n_seq` (checked by the caller to fit).
    pub(crate) fn advance(
        &mut self,
        plan: &PlanRef,
        seq_base: usize,
        n_seq: usize,
        tokens: usize,
    ) -> Result<()> {
        self.update(plan, seq_base, n_seq, tokens, true)
    }

    /// Empties every sequence.
    pub(crate) fn reset(&mut self, plan: &PlanRef) -> Result<()> {
        let n = self.host.len();
        self.update(plan, 0, n, 0, false)
    }

    /// Empties sequence `seq`; `what` names the caller in the out-of-range error.
    pub(crate) fn reset_seq(&mut self, plan: &PlanRef, what: &str, seq: usize) -> Result<()> {
        if seq >= self.host.len() {
            bail!(
                "{what}: sequence {seq} out of range (batch {})",
                self.host.len()
            )
        }
        self.update(plan, seq, 1, 0, false)
    }

    /// A deep copy like `clone`, but a failed device copy is an error rather than a
    /// fallback to a shared tensor.
    pub(crate) fn try_clone(&self) -> Result<Self> {
        Ok(Self {
            host: self.host.clone(),
            dev: self.dev.copy()?,
            written: true,
        })
    }

    /// Sets sequence `dst`'s length to sequence `src`'s (both checked by the caller to be
    /// in range).
    pub(crate) fn copy_len(&mut self, plan: &PlanRef, src: usize, dst: usize) -> Result<()> {
        let n = self.host[src];
        self.update(plan, dst, 1, n, false)
    }

    /// Sets the host copy only (see `KvCache::set_host_lens`); `what` names the caller.
    pub(crate) fn set_host(&mut self, what: &str, lens: &[usize], capacity: usize) -> Result<()> {
        if lens.len() != self.host.len() {
            bail!(
                "{what}: {} lengths for batch {}",
                lens.len(),
                self.host.len()
            )
        }
        if let Some((i, &n)) = lens.iter().enumerate().find(|(_, &n)| n > capacity) {
            bail!("{what}: sequence {i} length {n} exceeds the capacity {capacity}")
        }
        self.host.copy_from_slice(lens);
        Ok(())
    }

    /// Sets sequence `seq`'s device length to `n`, and its host length with it.
    pub(crate) fn set_dev(&mut self, plan: &PlanRef, seq: usize, n: usize) -> Result<()> {
        self.update(plan, seq, 1, n, false)
    }
}
