//! Pure next-token metrics of a model against a reference model over the same tokens:
//! negative log-likelihood of the text, KL divergence of the next-token distributions and
//! top-1 agreement. No model here: rows of logits in, sums out.

use candle_core::{bail, Result};

/// `log_softmax(logits)` in f64 (the sums of a 49k-entry row stay exact enough for KL
/// values down to ~1e-12).
pub fn log_softmax(logits: &[f32]) -> Result<Vec<f64>> {
    if logits.is_empty() {
        bail!("log_softmax: empty row");
    }
    if let Some(bad) = logits.iter().find(|v| !v.is_finite()) {
        bail!("log_softmax: non-finite logit {bad}");
    }
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    Ok(logits.iter().map(|&v| v as f64 - lse).collect())
}

/// Index of the largest value (the first one on ties).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

/// `KL(p || q) = Σ p (log p − log q)` from log-probabilities (≥ 0 up to rounding).
pub fn kl_divergence(log_p: &[f64], log_q: &[f64]) -> Result<f64> {
    if log_p.len() != log_q.len() {
        bail!("kl_divergence: rows of {} and {}", log_p.len(), log_q.len());
    }
    Ok(log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| {
            if lp == f64::NEG_INFINITY {
                0.0
            } else {
                lp.exp() * (lp - lq)
            }
        })
        .sum())
}

/// Sums over scored positions of one model against the reference.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TextSums {
    /// Positions scored.
    pub tokens: usize,
    /// Σ −log p_model(next token).
    pub nll: f64,
    /// Σ KL(p_reference || p_model).
    pub kl: f64,
    /// Positions where the model's top-1 token is the reference's.
    pub top1_agree: usize,
    /// Positions where the model's top-1 token is the text's next token.
    pub top1_correct: usize,
}

impl TextSums {
    /// Adds one position: the model's and the reference's logits for the token after it,
    /// and the text's actual next token.
    pub fn add(&mut self, reference: &[f32], model: &[f32], target: u32) -> Result<()> {
        if reference.len() != model.len() {
            bail!(
                "TextSums::add: vocabularies of {} and {}",
                reference.len(),
                model.len()
            );
        }
        let t = target as usize;
        if t >= model.len() {
            bail!(
                "TextSums::add: target {t} outside a vocabulary of {}",
                model.len()
            );
        }
        let lp = log_softmax(reference)?;
        self.add_with_reference(&lp, argmax(reference), model, target)
    }

    /// [`add`](Self::add) with the reference row already as log-probabilities and its
    /// top-1 token (computed once when several models are compared to one reference).
    pub fn add_with_reference(
        &mut self,
        reference_logp: &[f64],
        reference_top1: usize,
        model: &[f32],
        target: u32,
    ) -> Result<()> {
        let t = target as usize;
        if t >= model.len() {
            bail!(
                "TextSums::add: target {t} outside a vocabulary of {}",
                model.len()
            );
        }
        let lq = log_softmax(model)?;
        self.tokens += 1;
        self.nll -= lq[t];
        self.kl += kl_divergence(reference_logp, &lq)?;
        let top = argmax(model);
        self.top1_agree += usize::from(top == reference_top1);
        self.top1_correct += usize::from(top == t);
        Ok(())
    }

    /// Adds another set of sums (e.g. the next window).
    pub fn merge(&mut self, o: &TextSums) {
        self.tokens += o.tokens;
        self.nll += o.nll;
        self.kl += o.kl;
        self.top1_agree += o.top1_agree;
        self.top1_correct += o.top1_correct;
    }

    /// exp(mean NLL).
    pub fn perplexity(&self) -> f64 {
        (self.nll / self.tokens.max(1) as f64).exp()
    }

    /// Mean KL(reference || model) in nats per token.
    pub fn mean_kl(&self) -> f64 {
        self.kl / self.tokens.max(1) as f64
    }

    /// Fraction of positions whose top-1 token is the reference's.
    pub fn top1_agreement(&self) -> f64 {
        self.top1_agree as f64 / self.tokens.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn row(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0) * scale)
            .collect()
    }

    #[test]
    fn log_softmax_normalizes_and_is_shift_invariant() {
        let mut rng = StdRng::seed_from_u64(7);
        let r = row(&mut rng, 4096, 8.0);
        let l = log_softmax(&r).unwrap();
        let s: f64 = l.iter().map(|v| v.exp()).sum();
        assert!((s - 1.0).abs() < 1e-12, "{s}");
        let shifted: Vec<f32> = r.iter().map(|v| v + 100.0).collect();
        let l2 = log_softmax(&shifted).unwrap();
        // f32 rounding of the shifted logits: |Δ| ≤ ulp(108) = 2^-17 per entry.
        for (a, b) in l.iter().zip(&l2) {
            assert!((a - b).abs() < 2e-5, "{a} {b}");
        }
        assert!(log_softmax(&[]).is_err());
        assert!(log_softmax(&[0.0, f32::NAN]).is_err());
    }

    #[test]
    fn kl_is_zero_for_equal_rows_and_matches_a_two_point_case() {
        let mut rng = StdRng::seed_from_u64(11);
        let r = row(&mut rng, 1000, 4.0);
        let l = log_softmax(&r).unwrap();
        assert!(kl_divergence(&l, &l).unwrap().abs() < 1e-15);
        // p = (0.5, 0.5), q = (0.9, 0.1): KL = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1).
        let p = [0.5f64.ln(), 0.5f64.ln()];
        let q = [0.9f64.ln(), 0.1f64.ln()];
        let want = 0.5 * (0.5f64 / 0.9).ln() + 0.5 * (0.5f64 / 0.1).ln();
        assert!((kl_divergence(&p, &q).unwrap() - want).abs() < 1e-15);
        // A perturbed row has positive KL, growing with the perturbation.
        let small: Vec<f32> = r
            .iter()
            .map(|v| v + rng.random_range(-0.01f32..0.01))
            .collect();
        let big: Vec<f32> = r
            .iter()
            .map(|v| v + rng.random_range(-0.5f32..0.5))
            .collect();
        let ks = kl_divergence(&l, &log_softmax(&small).unwrap()).unwrap();
        let kb = kl_divergence(&l, &log_softmax(&big).unwrap()).unwrap();
        assert!(ks > 0.0 && kb > 100.0 * ks, "{ks} {kb}");
        assert!(kl_divergence(&p, &q[..1]).is_err());
    }

    #[test]
    fn sums_count_agreement_and_perplexity() {
        let mut rng = StdRng::seed_from_u64(3);
        let mut s = TextSums::default();
        let mut agree = 0;
        let n = 50;
        for i in 0..n {
            let r = row(&mut rng, 64, 3.0);
            // Every other position: the same logits (agreement, KL 0); else the argmax
            // moved to another token.
            let mut m = r.clone();
            if i % 2 == 1 {
                let a = argmax(&r);
                m[(a + 1) % 64] = r[a] + 1.0;
            } else {
                agree += 1;
            }
            s.add(&r, &m, (i % 64) as u32).unwrap();
        }
        assert_eq!(s.tokens, n);
        assert_eq!(s.top1_agree, agree);
        assert!((s.top1_agreement() - 0.5).abs() < 1e-12);
        assert!(s.mean_kl() > 0.0);
        // Uniform logits: perplexity = vocabulary size.
        let mut u = TextSums::default();
        u.add(&[0.0; 64], &[0.0; 64], 5).unwrap();
        assert!((u.perplexity() - 64.0).abs() < 1e-9);
        let mut both = s;
        both.merge(&u);
        assert_eq!(both.tokens, n + 1);
        assert!(s.add(&[0.0; 4], &[0.0; 5], 0).is_err());
        assert!(s.add(&[0.0; 4], &[0.0; 4], 4).is_err());
    }
}
