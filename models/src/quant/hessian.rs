//! The calibration Hessian of a Linear's inputs (`H = XᵀX / n`, f64) and the factor GPTQ
//! works with: the upper Cholesky factor `U` of the dampened `H⁻¹` (`H⁻¹ = UᵀU`).

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

/// The second moment of a Linear's calibration inputs, `H = XᵀX / n` (`[K, K]`, f64).
#[derive(Debug, Clone)]
pub struct Hessian {
    k: usize,
    /// `Σ xᵀx` over the rows added, row-major `[K, K]`.
    sum: Vec<f64>,
    samples: usize,
}

/// `x` as an F64 CPU tensor.
fn cpu_f64(x: &Tensor) -> Result<Tensor> {
    Ok(x.to_device(&candle_core::Device::Cpu)?
        .to_dtype(DType::F64)?)
}

impl Hessian {
    /// An empty accumulator for inputs of `k` features.
    pub fn new(k: usize) -> Self {
        Self {
            k,
            sum: vec![0.0; k * k],
            samples: 0,
        }
    }

    /// A given symmetric matrix `[k, k]` (row-major), counted as one sample.
    pub fn from_matrix(k: usize, h: Vec<f64>) -> Result<Self> {
        if h.len() != k * k {
            bail!("Hessian::from_matrix: {} values for [{k}, {k}]", h.len());
        }
        Ok(Self {
            k,
            sum: h,
            samples: 1,
        })
    }

    /// Input features `K`.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Input rows accumulated so far.
    pub fn samples(&self) -> usize {
        self.samples
    }

    /// Adds the rows of `x` (`[t, K]`, any float dtype, any device) to `XᵀX`.
    pub fn add(&mut self, x: &Tensor) -> Result<()> {
        let (t, k) = x.dims2()?;
        if k != self.k {
            bail!("Hessian::add: input has {k} features, expected {}", self.k);
        }
        let x = cpu_f64(x)?;
        let p = x.t()?.contiguous()?.matmul(&x)?;
        let v = p.flatten_all()?.to_vec1::<f64>()?;
        for (s, x) in self.sum.iter_mut().zip(v) {
            *s += x;
        }
        self.samples += t;
        Ok(())
    }

    /// The Hessian of the inputs `x ∘ d` (each input channel `j` multiplied by `d_j`):
    /// `diag(d) H diag(d)`.
    pub fn scaled(&self, d: &[f64]) -> Result<Hessian> {
        let k = self.k;
        if d.len() != k {
            bail!("Hessian::scaled: {} factors for K = {k}", d.len());
        }
        let sum = (0..k * k)
            .map(|idx| self.sum[idx] * d[idx / k] * d[idx % k])
            .collect();
        Ok(Self {
            k,
            sum,
            samples: self.samples,
        })
    }

    /// Adds `d_j` to the diagonal of `XᵀX / n`.
    pub fn add_diag(&mut self, d: &[f64]) {
        let (k, n) = (self.k, self.samples as f64);
        for (j, v) in d.iter().enumerate() {
            self.sum[j * k + j] += v * n;
        }
    }

    /// `XᵀX / n`, row-major `[K, K]`.
    pub fn matrix(&self) -> Result<Vec<f64>> {
        if self.samples == 0 {
            bail!("Hessian: no calibration inputs were accumulated");
        }
        let n = self.samples as f64;
        Ok(self.sum.iter().map(|v| v / n).collect())
    }
}

/// Lower Cholesky factor of `a` `[k, k]` (row-major), or `None` if not positive definite.
fn cholesky_lower(a: &[f64], k: usize) -> Option<Vec<f64>> {
    let mut l = vec![0f64; k * k];
    for i in 0..k {
        for j in 0..=i {
            let (li, lj) = (&l[i * k..i * k + j], &l[j * k..j * k + j]);
            let dot: f64 = li.iter().zip(lj).map(|(a, b)| a * b).sum();
            let v = a[i * k + j] - dot;
            if i == j {
                if !(v > 0.0 && v.is_finite()) {
                    return None;
                }
                l[i * k + i] = v.sqrt();
            } else {
                l[i * k + j] = v / l[j * k + j];
            }
        }
    }
    Some(l)
}

/// Inverse of a lower-triangular `l` `[k, k]` (lower-triangular), row by row.
fn lower_inverse(l: &[f64], k: usize) -> Vec<f64> {
    let mut x = vec![0f64; k * k];
    let mut row = vec![0f64; k];
    for i in 0..k {
        row[..=i].fill(0.0);
        row[i] = 1.0;
        for m in 0..i {
            let c = l[i * k + m];
            if c != 0.0 {
                let xm = &x[m * k..m * k + m + 1];
                for (r, v) in row[..=m].iter_mut().zip(xm) {
                    *r -= c * v;
                }
            }
        }
        let d = l[i * k + i];
        for (dst, r) in x[i * k..i * k + i + 1].iter_mut().zip(&row[..=i]) {
            *dst = r / d;
        }
    }
    x
}

/// The upper Cholesky factor `U` of `H⁻¹` (`H⁻¹ = UᵀU`) for a positive definite `h`.
///
/// With `P` the index reversal and `P H P = L Lᵀ`, `H⁻¹ = (P L⁻ᵀ P)(P L⁻¹ P)` and
/// `U = P L⁻¹ P` is upper triangular with a positive diagonal, hence the factor: one
/// Cholesky and one triangular inverse, no explicit `H⁻¹`.
pub fn inverse_cholesky_upper(h: &[f64], k: usize) -> Result<Vec<f64>> {
    if h.len() != k * k {
        bail!("inverse_cholesky_upper: {} values for [{k}, {k}]", h.len());
    }
    let rev: Vec<f64> = (0..k * k)
        .map(|idx| h[(k - 1 - idx / k) * k + (k - 1 - idx % k)])
        .collect();
    let Some(l) = cholesky_lower(&rev, k) else {
        bail!("the Hessian is not positive definite");
    };
    let li = lower_inverse(&l, k);
    Ok((0..k * k)
        .map(|idx| li[(k - 1 - idx / k) * k + (k - 1 - idx % k)])
        .collect())
}

/// The dampened Hessian's `U` (see [`inverse_cholesky_upper`]) and the dead columns
/// (zero diagonal: inputs that were always 0). Retries with 10× the damping, up to 4
/// times, if rounding leaves the matrix not positive definite.
pub(super) fn prepare(h: &Hessian, damp: f64) -> Result<(Vec<f64>, Vec<bool>)> {
    let k = h.k();
    let mut m = h.matrix()?;
    if m.iter().any(|v| !v.is_finite()) {
        bail!("the calibration Hessian has non-finite values");
    }
    let dead: Vec<bool> = (0..k).map(|i| m[i * k + i] == 0.0).collect();
    for (i, &d) in dead.iter().enumerate() {
        if d {
            m[i * k + i] = 1.0;
        }
    }
    let mean_diag = (0..k).map(|i| m[i * k + i]).sum::<f64>() / k as f64;
    let mut damp = damp;
    let mut added = 0.0;
    for _ in 0..5 {
        let lambda = damp * mean_diag;
        for i in 0..k {
            m[i * k + i] += lambda - added;
        }
        added = lambda;
        if let Ok(u) = inverse_cholesky_upper(&m, k) {
            return Ok((u, dead));
        }
        damp = if damp > 0.0 { damp * 10.0 } else { 1e-4 };
    }
    bail!("the calibration Hessian is not positive definite even with dampening {damp}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_cholesky_factor_inverts() {
        let k = 5;
        // A symmetric positive definite matrix: B Bᵀ + I.
        let b: Vec<f64> = (0..k * k)
            .map(|i| ((i * 7 % 11) as f64) / 5.0 - 1.0)
            .collect();
        let mut h = vec![0f64; k * k];
        for i in 0..k {
            for j in 0..k {
                h[i * k + j] = (0..k).map(|m| b[i * k + m] * b[j * k + m]).sum::<f64>()
                    + if i == j { 1.0 } else { 0.0 };
            }
        }
        let u = inverse_cholesky_upper(&h, k).unwrap();
        for i in 0..k {
            assert!(u[i * k + i] > 0.0);
            for j in 0..i {
                assert_eq!(u[i * k + j], 0.0);
            }
        }
        // UᵀU H = I.
        for i in 0..k {
            for j in 0..k {
                let v: f64 = (0..k)
                    .map(|m| {
                        (0..k).map(|p| u[p * k + i] * u[p * k + m]).sum::<f64>() * h[m * k + j]
                    })
                    .sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-10, "({i},{j}): {v}");
            }
        }
    }
}
