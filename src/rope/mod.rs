//! Rotary position embedding fused over a `q|k|v` projection, at per-row positions that
//! live on the device ([`QkvRope`]): the decode step's one kernel for what took a split
//! into heads, two gathers of the tables and a rope per head group. Numerics are those of
//! `candle_nn::rotary_emb::rope` on the CPU (non-interleaved halves, every product and sum
//! rounded to BF16), bit for bit, on the CPU (the reference here) and on CUDA
//! (`kernels/rope.cu`, which keeps nvcc from fusing a product and a sum: candle's own CUDA
//! rope may, so it can differ from this by one BF16 rounding).

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::bf16;

/// The fused rope of one attention shape with its cos / sin tables (BF16
/// `[max_pos, head_dim/2]`, on the device the op runs on), made once per model.
#[derive(Debug, Clone)]
pub struct QkvRope {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    tables: Tables,
}

/// The tables as each backend reads them, resolved once in [`QkvRope::new`].
#[derive(Debug, Clone)]
enum Tables {
    /// Host copies (`cos`, `sin`, row-major `[max_pos, head_dim/2]`).
    Cpu(std::sync::Arc<(Vec<bf16>, Vec<bf16>)>),
    /// The kernel and the tables' device pointers (the plan keeps the tensors alive).
    #[cfg(feature = "cuda")]
    Cuda(cuda::RopePlan),
}

impl QkvRope {
    /// The op for `q_heads` query and `kv_heads` key/value heads of `head_dim` (even),
    /// with BF16 tables `cos`, `sin` `[max_pos, head_dim/2]`; on a GPU the kernel is
    /// resolved here.
    pub fn new(
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Self> {
        const WHAT: &str = "QkvRope::new";
        if q_heads == 0 || kv_heads == 0 || head_dim == 0 || !head_dim.is_multiple_of(2) {
            bail!("{WHAT}: {q_heads} q heads, {kv_heads} kv heads, head_dim {head_dim}: need positive counts and an even head_dim")
        }
        for (name, t) in [("cos", cos), ("sin", sin)] {
            match t.dims() {
                [n, h] if *n > 0 && *h == head_dim / 2 && t.dtype() == DType::BF16 => {}
                d => bail!(
                    "{WHAT}: {name} must be BF16 [max_pos, {}], got {:?} {d:?}",
                    head_dim / 2,
                    t.dtype()
                ),
            }
        }
        if cos.dims() != sin.dims() || !cos.device().same_device(sin.device()) {
            bail!(
                "{WHAT}: cos {:?} and sin {:?} differ in shape or device",
                cos.dims(),
                sin.dims()
            )
        }
        let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
        if cos.dim(0)? > i32::MAX as usize
            || (q_heads + 2 * kv_heads) * head_dim > i32::MAX as usize
        {
            bail!("{WHAT}: tables or heads too large")
        }
        let tables = match cos.device() {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(d) => Tables::Cuda(cuda::plan(d, &cos, &sin, head_dim)?),
            candle_core::Device::Cpu => Tables::Cpu(std::sync::Arc::new((
                cos.flatten_all()?.to_vec1::<bf16>()?,
                sin.flatten_all()?.to_vec1::<bf16>()?,
            ))),
            d => bail!("{WHAT}: tables on {d:?}: only the CPU and CUDA run this op"),
        };
        Ok(Self {
            q_heads,
            kv_heads,
            head_dim,
            tables,
        })
    }

    /// `qkv` BF16 `[batch, (q_heads + 2·kv_heads)·head_dim]` (q, then k, then v heads) and
    /// `positions` U32 `[batch]` → BF16 `[batch, q_heads + 2·kv_heads, head_dim]` with the
    /// q and k heads rotated for their row's position and v copied.
    pub fn forward(&self, qkv: &Tensor, positions: &Tensor) -> Result<Tensor> {
        self.check(qkv, positions)?;
        qkv.contiguous()?.apply_op2_no_bwd(positions, self)
    }

    /// `(q_heads, kv_heads, head_dim)`.
    pub fn dims(&self) -> (usize, usize, usize) {
        (self.q_heads, self.kv_heads, self.head_dim)
    }

    /// On CUDA, the tables' device pointers (cos, sin) and rows, for kernels that rotate
    /// inside (the BF16 cache's decode attention); `None` on the CPU. They stay valid while
    /// this op (or a clone) lives.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_tables(&self) -> Option<(u64, u64, usize)> {
        match &self.tables {
            Tables::Cuda(p) => Some(p.tables()),
            Tables::Cpu(_) => None,
        }
    }

    /// Checks `qkv` `[b, heads·d]` BF16 against `positions` U32 `[b]`; returns `b`.
    pub(crate) fn check(&self, qkv: &Tensor, positions: &Tensor) -> Result<usize> {
        let heads = self.q_heads + 2 * self.kv_heads;
        let b = match qkv.dims() {
            [b, w] if *w == heads * self.head_dim && qkv.dtype() == DType::BF16 => *b,
            d => bail!(
                "QkvRope: qkv must be BF16 [batch, {}], got {:?} {d:?}",
                heads * self.head_dim,
                qkv.dtype()
            ),
        };
        if positions.dims() != [b] || positions.dtype() != DType::U32 {
            bail!(
                "QkvRope: positions must be U32 [{b}], got {:?} {:?}",
                positions.dtype(),
                positions.dims()
            )
        }
        Ok(b)
    }

    fn out_shape(&self, b: usize) -> Shape {
        Shape::from((b, self.q_heads + 2 * self.kv_heads, self.head_dim))
    }
}

/// The reference: candle's rope arithmetic on every q and k head, v copied.
#[allow(clippy::too_many_arguments)]
fn qkv_rope_cpu(
    x: &[bf16],
    pos: &[u32],
    cos: &[bf16],
    sin: &[bf16],
    rot_heads: usize,
    heads: usize,
    d: usize,
) -> Vec<bf16> {
    let half = d / 2;
    let max_pos = cos.len() / half;
    let mut out = x.to_vec();
    for (b, &p) in pos.iter().enumerate() {
        let p = (p as usize).min(max_pos - 1);
        let (c, s) = (
            &cos[p * half..(p + 1) * half],
            &sin[p * half..(p + 1) * half],
        );
        for h in 0..rot_heads {
            let base = (b * heads + h) * d;
            for i in 0..half {
                let (x1, x2) = (x[base + i], x[base + i + half]);
                out[base + i] = x1 * c[i] - x2 * s[i];
                out[base + i + half] = x1 * s[i] + x2 * c[i];
            }
        }
    }
    out
}

impl CustomOp2 for QkvRope {
    fn name(&self) -> &'static str {
        "qkv-rope"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = match (s1, l1.contiguous_offsets()) {
            (CpuStorage::BF16(v), Some((a, b))) => &v[a..b],
            _ => bail!("QkvRope: qkv must be a contiguous BF16 tensor"),
        };
        let pos = match (s2, l2.contiguous_offsets()) {
            (CpuStorage::U32(v), Some((a, b))) => &v[a..b],
            _ => bail!("QkvRope: positions must be a contiguous U32 tensor"),
        };
        // (Irrefutable without the cuda feature.)
        #[allow(irrefutable_let_patterns)]
        let Tables::Cpu(t) = &self.tables
        else {
            bail!("QkvRope: the tables are on a GPU, the input on the CPU")
        };
        let (cos, sin) = (&t.0, &t.1);
        let heads = self.q_heads + 2 * self.kv_heads;
        let out = qkv_rope_cpu(
            x,
            pos,
            cos,
            sin,
            self.q_heads + self.kv_heads,
            heads,
            self.head_dim,
        );
        Ok((CpuStorage::BF16(out), self.out_shape(pos.len())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda_forward(s1, l1, s2, l2)
    }
}

#[cfg(feature = "cuda")]
impl QkvRope {
    fn cuda_forward(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let Tables::Cuda(plan) = &self.tables else {
            bail!("QkvRope: the tables are on the CPU, the input on a GPU")
        };
        let b = l2.shape().elem_count();
        let s = cuda::Shape {
            batch: b,
            rot_heads: self.q_heads + self.kv_heads,
            heads: self.q_heads + 2 * self.kv_heads,
            d: self.head_dim,
        };
        let out = cuda::forward(plan, &s, s1, l1, s2, l2)?;
        Ok((out, self.out_shape(b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The op equals candle's own rope applied to the split heads, bit for bit.
    #[test]
    fn equals_candle_rope_on_the_split_heads() -> Result<()> {
        let (nq, nkv, d, max_pos, b) = (6, 2, 64, 40, 3);
        let dev = Device::Cpu;
        let cos = Tensor::rand(-1f32, 1.0, (max_pos, d / 2), &dev)?.to_dtype(DType::BF16)?;
        let sin = Tensor::rand(-1f32, 1.0, (max_pos, d / 2), &dev)?.to_dtype(DType::BF16)?;
        let heads = nq + 2 * nkv;
        let qkv = Tensor::randn(0f32, 1.0, (b, heads * d), &dev)?.to_dtype(DType::BF16)?;
        let pos_v = vec![0u32, 17, 39];
        let pos = Tensor::new(pos_v.as_slice(), &dev)?;
        let op = QkvRope::new(nq, nkv, d, &cos, &sin)?;
        let got = op.forward(&qkv, &pos)?;
        let x = qkv.reshape((b, heads, 1, d))?;
        let c = cos.index_select(&pos, 0)?.reshape((b, 1, d / 2))?;
        let s = sin.index_select(&pos, 0)?.reshape((b, 1, d / 2))?;
        let q = candle_nn::rotary_emb::rope(&x.narrow(1, 0, nq)?.contiguous()?, &c, &s)?;
        let k = candle_nn::rotary_emb::rope(&x.narrow(1, nq, nkv)?.contiguous()?, &c, &s)?;
        let v = x.narrow(1, nq + nkv, nkv)?;
        let want = Tensor::cat(&[q, k, v], 1)?.reshape((b, heads, d))?;
        let (a, w) = (
            got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            want.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        );
        assert!(a == w, "fused rope differs from candle's");
        // Bad inputs are errors.
        assert!(op.forward(&qkv.narrow(1, 0, d)?, &pos).is_err());
        assert!(op.forward(&qkv, &Tensor::new(&[0u32, 1], &dev)?).is_err());
        assert!(QkvRope::new(nq, nkv, d + 1, &cos, &sin).is_err());
        Ok(())
    }
}
