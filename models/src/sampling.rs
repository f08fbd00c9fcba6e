//! Next-token choice: greedy, or temperature + top-p (nucleus) sampling from a seeded RNG.

use anyhow::{bail, Result};
use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id on ties).
    Greedy,
    /// Softmax of `logits / temperature`, restricted to the smallest set of most likely
    /// tokens whose probability reaches `top_p`.
    TopP {
        /// Softmax temperature (> 0).
        temperature: f64,
        /// Probability mass kept (in (0, 1]).
        top_p: f64,
    },
}

/// A seeded token sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    sampling: Sampling,
    rng: StdRng,
}

/// Index of the largest value (first one on ties).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

impl Sampler {
    /// `temperature <= 0` means greedy. `top_p` must be in (0, 1].
    pub fn new(temperature: f64, top_p: f64, seed: u64) -> Result<Self> {
        if !(top_p > 0.0 && top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {top_p}");
        }
        if !temperature.is_finite() {
            bail!("temperature must be finite, got {temperature}");
        }
        let sampling = if temperature <= 0.0 {
            Sampling::Greedy
        } else {
            Sampling::TopP { temperature, top_p }
        };
        Ok(Self {
            sampling,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    /// The sampling rule.
    pub fn sampling(&self) -> Sampling {
        self.sampling
    }

    /// Picks a token from logits `[vocab]`.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        let v: Vec<f32> = logits
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        self.sample_slice(&v)
    }

    /// Picks a token from logits given as a slice (one per vocabulary entry).
    pub fn sample_slice(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            bail!("sample: empty logits");
        }
        if let Some(i) = logits.iter().position(|x| x.is_nan()) {
            bail!(
                "sample: logit {i} of {} is NaN (the model produced non-finite numbers)",
                logits.len()
            );
        }
        let (temperature, top_p) = match self.sampling {
            Sampling::Greedy => return Ok(argmax(logits) as u32),
            Sampling::TopP { temperature, top_p } => (temperature, top_p),
        };
        let max = logits[argmax(logits)] as f64;
        let mut p: Vec<(usize, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &x)| (i, ((x as f64 - max) / temperature).exp()))
            .collect();
        let z: f64 = p.iter().map(|x| x.1).sum();
        p.iter_mut().for_each(|x| x.1 /= z);
        p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut cum = 0.0;
        let mut keep = p.len();
        for (i, x) in p.iter().enumerate() {
            cum += x.1;
            if cum >= top_p {
                keep = i + 1;
                break;
            }
        }
        let p = &p[..keep];
        let total: f64 = p.iter().map(|x| x.1).sum();
        let mut r = self.rng.random::<f64>() * total;
        for x in p {
            r -= x.1;
            if r <= 0.0 {
                return Ok(x.0 as u32);
            }
        }
        Ok(p[p.len() - 1].0 as u32)
    }
}
