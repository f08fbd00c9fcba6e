//! CPU forward of the GEMV ops: the scalar oracle the CUDA kernels are tested against,
//! and SIMD row kernels (x86-64 AVX2 + FMA, chosen at run time) with the same numerics.
//!
//! Every path converts `x` to FP32 once per call, computes the FP32 accumulator
//! `acc[row][token] = Σ_k x_k · w_k` over exactly dequantized weights (rows split
//! across rayon tasks), then runs one shared epilogue (global scale on the accumulator,
//! one BF16 rounding, optional `silu(gate)·up`). The paths differ only in how the FP32
//! sum is ordered and grouped (the AVX2 single-token path multiplies each block's
//! 16-value partial sum of exact `e2m1·x` products by the block scale, `s·Σq·x` =
//! `Σ(q·s)·x` regrouped, the AVX-512 one scales each exact product in its accumulating
//! FMA; both read `x` with each block's even elements first, a
//! permutation made while converting `x` to FP32).
//!
//! Threads: rows are split across rayon tasks, except for a single token (decode) with
//! more than one thread, where a small spinning pool (`pool`) runs the row chunks:
//! its helpers stay awake for a few ms between GEMVs instead of being woken per call.
//!
//! * [`CpuKernel::Scalar`] (the oracle): each weight row is decoded into an FP32 buffer,
//!   then dotted with every token (eight interleaved FP32 sums).
//! * [`CpuKernel::Avx2`] / [`CpuKernel::Avx512`]: one NVFP4 block (16 weights) is
//!   decoded per step into two 8-lane vectors / one 16-lane vector in registers
//!   (`pshufb` table of `2·e2m1`, int → FP32, times `e4m3/2`: exact) and used for up
//!   to 4 tokens at once; BF16 weights are widened with a shift. See `avx2` and
//!   `avx512`; what they share is in `layout`.
//!
//! [`gemv_cpu`] picks the fastest kernel the CPU runs (checked once at run time);
//! `CANDLE_FP4_CPU_GEMV=scalar|avx2|avx512` overrides the choice.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod layout;
mod pool;
mod scalar;

pub use layout::WeightRows;

use candle_core::{bail, Result};
use half::bf16;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Which CPU implementation computes the GEMV's FP32 accumulators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CpuKernel {
    /// Portable scalar code: the numerical oracle.
    Scalar,
    /// x86-64 AVX2 + FMA (8 FP32 lanes), for `K % 32 == 0`.
    Avx2,
    /// x86-64 AVX-512 F + BW (16 FP32 lanes), for `K % 64 == 0`.
    Avx512,
}

impl CpuKernel {
    /// Every kernel, in order of preference (fastest last).
    pub const ALL: [CpuKernel; 3] = [CpuKernel::Scalar, CpuKernel::Avx2, CpuKernel::Avx512];

    /// Whether this CPU can run the kernel (checked at run time).
    pub fn is_available(self) -> bool {
        match self {
            CpuKernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            CpuKernel::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            CpuKernel::Avx512 => avx512::available(),
            #[cfg(not(target_arch = "x86_64"))]
            CpuKernel::Avx2 | CpuKernel::Avx512 => false,
        }
    }

    /// Whether the kernel handles rows of `k` values (else the scalar loop runs).
    fn supports_k(self, k: usize) -> bool {
        match self {
            CpuKernel::Scalar => true,
            CpuKernel::Avx2 => k.is_multiple_of(32),
            CpuKernel::Avx512 => k.is_multiple_of(64),
        }
    }

    /// The kernel [`gemv_cpu`] uses: the fastest available one, unless the environment
    /// variable `CANDLE_FP4_CPU_GEMV` names an available one (`scalar`, `avx2`,
    /// `avx512`; read once).
    pub fn detect() -> CpuKernel {
        static KERNEL: OnceLock<CpuKernel> = OnceLock::new();
        *KERNEL.get_or_init(|| {
            let asked = std::env::var("CANDLE_FP4_CPU_GEMV").unwrap_or_default();
            let named = Self::ALL
                .into_iter()
                .find(|k| format!("{k:?}").eq_ignore_ascii_case(&asked));
            if let Some(k) = named.filter(|k| k.is_available()) {
                return k;
            }
            Self::ALL
                .into_iter()
                .rev()
                .find(|k| k.is_available())
                .unwrap_or(CpuKernel::Scalar)
        })
    }
}

/// SiLU in FP32: `g / (1 + e^-g)`.
#[inline]
pub(crate) fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// The CPU GEMV with the kernel [`CpuKernel::detect`] picks. `x` holds `m` rows of `k`
/// BF16 values with row stride `rs`; returns BF16 `[m, n]` (or `[m, n/2]` with
/// `silu_mul`) with the numerics of the module docs.
#[allow(clippy::too_many_arguments)]
pub fn gemv_cpu(
    x: &[bf16],
    rs: usize,
    m: usize,
    k: usize,
    n: usize,
    rows: &WeightRows<'_>,
    global_scale: f32,
    silu_mul: bool,
) -> Result<Vec<bf16>> {
    let kernel = CpuKernel::detect();
    gemv_cpu_with(kernel, x, rs, m, k, n, rows, global_scale, silu_mul)
}

/// The scalar CPU GEMV, the oracle of every other implementation (same arguments as
/// [`gemv_cpu`]).
#[allow(clippy::too_many_arguments)]
pub fn gemv_cpu_scalar(
    x: &[bf16],
    rs: usize,
    m: usize,
    k: usize,
    n: usize,
    rows: &WeightRows<'_>,
    global_scale: f32,
    silu_mul: bool,
) -> Result<Vec<bf16>> {
    let kernel = CpuKernel::Scalar;
    gemv_cpu_with(kernel, x, rs, m, k, n, rows, global_scale, silu_mul)
}

/// The CPU GEMV with an explicit [`CpuKernel`] (an error if this CPU cannot run it).
/// For a `k` the kernel does not handle (AVX2: `k % 32 != 0`, AVX-512: `k % 64 != 0`;
/// the ops require `k % 64 == 0`) the scalar kernel runs.
#[allow(clippy::too_many_arguments)]
pub fn gemv_cpu_with(
    kernel: CpuKernel,
    x: &[bf16],
    rs: usize,
    m: usize,
    k: usize,
    n: usize,
    rows: &WeightRows<'_>,
    global_scale: f32,
    silu_mul: bool,
) -> Result<Vec<bf16>> {
    rows.check(n, k)?;
    if m == 0 || x.len() < (m - 1) * rs + k {
        bail!(
            "gemv: x has {} values, too few for {m} rows of {k} (stride {rs})",
            x.len()
        );
    }
    if silu_mul && !n.is_multiple_of(2) {
        bail!("gemv: silu_mul needs an even N, got {n}");
    }
    if !kernel.is_available() {
        bail!("gemv: this CPU cannot run the {kernel:?} kernel");
    }
    let kernel = if kernel.supports_k(k) {
        kernel
    } else {
        CpuKernel::Scalar
    };
    let mut xf = Vec::with_capacity(m * k);
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, CpuKernel::Avx2 | CpuKernel::Avx512)
        && layout::single_token_path(rows, m, k)
    {
        // The single-token NVFP4 kernel's layout: each block's even elements, then its
        // odd ones (a permutation of the same FP32 values).
        xf.resize(k, 0.0);
        for (src, dst) in x[..k]
            .as_chunks::<16>()
            .0
            .iter()
            .zip(xf.as_chunks_mut::<16>().0)
        {
            layout::split_x_block(src, dst);
        }
    }
    if xf.is_empty() {
        for i in 0..m {
            xf.extend(x[i * rs..i * rs + k].iter().map(|v| v.to_f32()));
        }
    }
    let acc = accumulate(kernel, rows, &xf, m, k, n)?;
    Ok(epilogue(&acc, m, n, global_scale, silu_mul))
}

/// Rows per rayon task.
const ROWS_PER_TASK: usize = 32;

/// `acc[row * m + token]`, FP32, rows split across rayon tasks (run inline when the
/// pool has one thread).
fn accumulate(
    kernel: CpuKernel,
    rows: &WeightRows<'_>,
    xf: &[f32],
    m: usize,
    k: usize,
    n: usize,
) -> Result<Vec<f32>> {
    let mut acc = vec![0f32; n * m];
    let task = |scratch: &mut Vec<f32>, (t, out): (usize, &mut [f32])| -> Result<()> {
        rows_chunk(kernel, rows, xf, m, k, t * ROWS_PER_TASK, out, scratch)
    };
    if rayon::current_num_threads() == 1 {
        let mut scratch = vec![];
        for item in acc.chunks_mut(ROWS_PER_TASK * m).enumerate() {
            task(&mut scratch, item)?;
        }
    } else if let Some(r) = single_token_pool(m, n, &mut acc, &task) {
        r?;
    } else {
        acc.par_chunks_mut(ROWS_PER_TASK * m)
            .enumerate()
            .try_for_each_init(Vec::new, task)?;
    }
    Ok(acc)
}

/// A single token's rows on the spinning pool (`cpu_pool`): a decode step's GEMVs are
/// 30–350 µs calls, where waking rayon's sleeping workers costs more than it saves.
/// Four tasks per thread (multiples of [`ROWS_PER_TASK`] rows), claimed dynamically, so
/// a thread slowed by another process does not hold the others back. `None` when the
/// pool does not apply (`m > 1`, one thread, another caller inside, another pool size).
fn single_token_pool<F>(m: usize, n: usize, acc: &mut [f32], task: &F) -> Option<Result<()>>
where
    F: Fn(&mut Vec<f32>, (usize, &mut [f32])) -> Result<()> + Sync,
{
    if m != 1 {
        return None;
    }
    let pool = pool::Pool::global()?;
    if pool.threads() != rayon::current_num_threads() {
        return None;
    }
    let per = n.div_ceil(4 * pool.threads() * ROWS_PER_TASK).max(1);
    let chunks: Vec<std::sync::Mutex<&mut [f32]>> = acc
        .chunks_mut(per * ROWS_PER_TASK)
        .map(std::sync::Mutex::new)
        .collect();
    let run = |i: usize| -> Result<()> {
        let Ok(mut out) = chunks[i].lock() else {
            bail!("gemv: a task's output is poisoned");
        };
        task(&mut Vec::new(), (i * per, &mut out))
    };
    pool.run_tasks(chunks.len(), &run)
}

/// Accumulators of rows `row0..row0 + out.len() / m` into `out` (`[row][token]`).
#[allow(clippy::too_many_arguments)]
fn rows_chunk(
    kernel: CpuKernel,
    rows: &WeightRows<'_>,
    xf: &[f32],
    m: usize,
    k: usize,
    row0: usize,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) -> Result<()> {
    match kernel {
        CpuKernel::Scalar => {
            scalar::rows_scalar(rows, xf, m, k, row0, out, scratch);
            Ok(())
        }
        #[cfg(target_arch = "x86_64")]
        CpuKernel::Avx2 => avx2::rows_avx2(rows, xf, m, k, row0, out),
        #[cfg(target_arch = "x86_64")]
        CpuKernel::Avx512 => avx512::rows_avx512(rows, xf, m, k, row0, out),
        #[cfg(not(target_arch = "x86_64"))]
        CpuKernel::Avx2 | CpuKernel::Avx512 => bail!("gemv: {kernel:?} needs x86-64"),
    }
}

/// Global scale, one BF16 rounding, optional `silu(gate)·up`.
fn epilogue(acc: &[f32], m: usize, n: usize, global_scale: f32, silu_mul: bool) -> Vec<bf16> {
    let round = |v: f32| bf16::from_f32(v * global_scale);
    let mut out;
    if silu_mul {
        let h = n / 2;
        out = vec![bf16::ZERO; m * h];
        for t in 0..m {
            for j in 0..h {
                let g = round(acc[j * m + t]).to_f32();
                let u = round(acc[(j + h) * m + t]).to_f32();
                out[t * h + j] = bf16::from_f32(silu(g) * u);
            }
        }
    } else {
        out = vec![bf16::ZERO; m * n];
        for t in 0..m {
            for j in 0..n {
                out[t * n + j] = round(acc[j * m + t]);
            }
        }
    }
    out
}
