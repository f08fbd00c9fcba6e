//! The greedy tail of a batched decode step in one op ([`GreedyStep`]): the argmax of each
//! row of the logits written into the step's token ids, and each row's position advanced by
//! one, in place in the step's `[2, rows]` U32 state (row 0 the ids, row 1 the positions),
//! so a captured CUDA graph feeds itself the next step's inputs.
//!
//! The result is the smallest index of a row's largest value (candle's `argmax` keeps the
//! first maximum too); NaN is skipped and an all-NaN row gives 0. The CUDA kernel
//! (`kernels/greedy.cu`) reduces each row over many CTAs and gives the same index as the
//! CPU here exactly (a maximum and its index do not depend on the reduction order).

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{bail, CpuStorage, DType, Device, InplaceOp2, Layout, Result, Tensor};

/// The greedy tail for `rows` sequences over `vocab` logits, made once per model (on a GPU
/// it owns the kernel and its scratch).
#[derive(Debug)]
pub struct GreedyStep {
    rows: usize,
    vocab: usize,
    #[cfg(feature = "cuda")]
    cuda: Option<cuda::GreedyPlan>,
}

impl GreedyStep {
    /// The op for `rows` sequences and `vocab` logits each, on `device`.
    pub fn new(rows: usize, vocab: usize, device: &Device) -> Result<Self> {
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        if rows == 0 || vocab == 0 || vocab > u32::MAX as usize / 2 || rows > 65_535 {
            bail!("GreedyStep::new: {rows} rows of {vocab} logits (need 1..=65535 rows and 1..2^31 logits)")
        }
        Ok(Self {
            rows,
            vocab,
            #[cfg(feature = "cuda")]
            cuda: match device {
                Device::Cuda(d) => Some(cuda::plan(d, rows)?),
                _ => None,
            },
        })
    }

    /// Writes each row's argmax of `logits` (BF16 or F32 `[rows, vocab]`) into `state[0]`
    /// and adds one to `state[1]` (`state`: U32 `[2, rows]`, contiguous, on the op's device).
    pub fn apply(&self, state: &Tensor, logits: &Tensor) -> Result<()> {
        if state.dims() != [2, self.rows] || state.dtype() != DType::U32 {
            bail!(
                "GreedyStep: state must be U32 [2, {}], got {:?} {:?}",
                self.rows,
                state.dtype(),
                state.dims()
            )
        }
        if logits.dims() != [self.rows, self.vocab]
            || !matches!(logits.dtype(), DType::BF16 | DType::F32)
        {
            bail!(
                "GreedyStep: logits must be BF16 or F32 [{}, {}], got {:?} {:?}",
                self.rows,
                self.vocab,
                logits.dtype(),
                logits.dims()
            )
        }
        state.inplace_op2(&logits.contiguous()?, self)
    }
}

/// The reference argmax of one row (smallest index of the largest value, NaN skipped).
pub(crate) fn argmax_row(row: impl Iterator<Item = f32>) -> u32 {
    let mut best: Option<(f32, u32)> = None;
    for (i, v) in row.enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(b, _)| v > b) {
            best = Some((v, i as u32));
        }
    }
    best.map_or(0, |(_, i)| i)
}

impl InplaceOp2 for GreedyStep {
    fn name(&self) -> &'static str {
        "greedy-step"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let (CpuStorage::U32(st), Some((a, b))) = (s1, l1.contiguous_offsets()) else {
            bail!("GreedyStep: state must be a contiguous U32 tensor")
        };
        let st = &mut st[a..b];
        let Some((la, lb)) = l2.contiguous_offsets() else {
            bail!("GreedyStep: logits must be contiguous")
        };
        let (r, n) = (self.rows, self.vocab);
        for row in 0..r {
            let (lo, hi) = (la + row * n, la + (row + 1) * n);
            let id = match s2 {
                CpuStorage::F32(v) => argmax_row(v[lo..hi].iter().copied()),
                CpuStorage::BF16(v) => argmax_row(v[lo..hi].iter().map(|x| x.to_f32())),
                _ => bail!("GreedyStep: logits must be BF16 or F32"),
            };
            debug_assert!(hi <= lb);
            st[row] = id;
            st[r + row] = st[r + row].wrapping_add(1);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        let Some(plan) = &self.cuda else {
            bail!("GreedyStep: made for the CPU, called on a GPU")
        };
        cuda::forward(plan, (self.rows, self.vocab), s1, l1, s2, l2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ties go to the first index, NaN is skipped, all-NaN gives 0, and the op writes the
    /// ids and advances the positions, for BF16 and F32 logits; bad shapes are errors.
    #[test]
    fn argmax_into_state() -> Result<()> {
        assert_eq!(argmax_row([1.0, 3.0, 3.0, -1.0].into_iter()), 1);
        assert_eq!(argmax_row([f32::NAN, -5.0, f32::NAN].into_iter()), 1);
        assert_eq!(argmax_row([f32::NAN; 3].into_iter()), 0);
        assert_eq!(
            argmax_row([f32::NEG_INFINITY, f32::NEG_INFINITY].into_iter()),
            0
        );
        let dev = Device::Cpu;
        let (rows, vocab) = (3, 1000);
        // Seeded; each row's maximum planted twice (a tie: the first index must win).
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut v: Vec<f32> = (0..rows * vocab)
            .map(|_| rng.random_range(-4.0..4.0))
            .collect();
        for (r, (a, b)) in [(0, (3, 998)), (1, (500, 501)), (2, (0, 999))] {
            v[r * vocab + a] = 9.0;
            v[r * vocab + b] = 9.0;
        }
        let logits = Tensor::from_vec(v, (rows, vocab), &dev)?;
        let want = vec![3u32, 500, 0];
        assert_eq!(logits.argmax(1)?.to_vec1::<u32>()?, want, "candle's argmax");
        let op = GreedyStep::new(rows, vocab, &dev)?;
        for dt in [DType::F32, DType::BF16] {
            let l = logits.to_dtype(dt)?;
            let state = Tensor::new(&[[7u32, 7, 7], [0, 5, 41]], &dev)?;
            op.apply(&state, &l)?;
            let s = state.to_vec2::<u32>()?;
            assert_eq!(s[0], want, "{dt:?}");
            assert_eq!(s[1], vec![1, 6, 42]);
        }
        let state = Tensor::zeros((2, rows), DType::U32, &dev)?;
        assert!(op.apply(&state, &logits.narrow(1, 0, 10)?).is_err());
        assert!(op.apply(&state.narrow(1, 0, 2)?, &logits).is_err());
        assert!(op.apply(&state, &logits.to_dtype(DType::F16)?).is_err());
        assert!(GreedyStep::new(0, vocab, &dev).is_err());
        Ok(())
    }
}
