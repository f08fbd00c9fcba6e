//! Which Linear groups stay BF16 under a byte budget: pure byte accounting and a greedy
//! choice by sensitivity per byte.
//!
//! **What the budget counts**: the weight bytes of the decoder Linears that NVFP4 can
//! quantize (`q/k/v/o_proj`, `gate/up/down_proj` of every layer), as stored in the
//! checkpoint: NVFP4 = `N·K/2` code bytes + `N·K/16` E4M3 scale bytes + 4 bytes of FP32
//! global scale per Linear; BF16 = `2·N·K`. Embeddings, `lm_head` and the norms are not
//! counted (they are BF16 in every recipe, so they would only dilute the ratio). A
//! budget of `r` allows `floor(r · B₀)` bytes, `B₀` the all-NVFP4 total.

use thiserror::Error;

/// Bytes of an NVFP4 Linear `[n, k]` in a ModelOpt checkpoint.
pub fn nvfp4_bytes(n: usize, k: usize) -> u64 {
    (n * k / 2 + n * k / 16 + 4) as u64
}

/// Bytes of a BF16 Linear `[n, k]`.
pub fn bf16_bytes(n: usize, k: usize) -> u64 {
    (2 * n * k) as u64
}

/// A group of Linears that is kept BF16 or quantized whole (members sharing a global
/// scale: q/k/v, gate/up; or one Linear).
#[derive(Debug, Clone, PartialEq)]
pub struct MixCandidate {
    /// Module prefixes, e.g. `model.layers.3.mlp.down_proj`.
    pub modules: Vec<String>,
    /// Bytes as NVFP4 (all members).
    pub nvfp4_bytes: u64,
    /// Bytes as BF16 (all members).
    pub bf16_bytes: u64,
    /// Measured cost of quantizing this group (larger = more sensitive), ≥ 0.
    pub sensitivity: f64,
}

impl MixCandidate {
    /// Extra bytes of keeping the group BF16.
    pub fn extra_bytes(&self) -> u64 {
        self.bf16_bytes.saturating_sub(self.nvfp4_bytes)
    }
}

/// Errors of the selection.
#[derive(Debug, Error, PartialEq)]
pub enum MixError {
    /// The budget ratio is not a finite number ≥ 1.
    #[error("budget {0} must be a finite number ≥ 1 (bytes relative to all-NVFP4)")]
    BadBudget(f64),
    /// A sensitivity is negative or not finite.
    #[error("sensitivity of `{0}` is {1}: must be finite and ≥ 0")]
    BadSensitivity(String, f64),
    /// A group costs nothing extra as BF16 (or its sizes are inconsistent).
    #[error("group `{0}`: BF16 bytes {1} not above NVFP4 bytes {2}")]
    BadBytes(String, u64, u64),
    /// No candidates.
    #[error("no Linear groups to choose from")]
    Empty,
}

/// The outcome of [`select_bf16`].
#[derive(Debug, Clone, PartialEq)]
pub struct MixSelection {
    /// Indices into the candidates kept BF16, in the order they were chosen.
    pub bf16: Vec<usize>,
    /// All-NVFP4 bytes `B₀`.
    pub base_bytes: u64,
    /// The allowance `floor(budget · B₀)`.
    pub budget_bytes: u64,
    /// Bytes of the chosen mix (≤ `budget_bytes`).
    pub bytes: u64,
}

impl MixSelection {
    /// Bytes of the mix relative to all-NVFP4.
    pub fn ratio(&self) -> f64 {
        self.bytes as f64 / self.base_bytes as f64
    }
}

/// Chooses the groups kept BF16 under `budget` (bytes relative to all-NVFP4): greedy by
/// sensitivity per extra byte, highest first (ties: lower index first); a group that
/// does not fit in what is left is skipped and smaller ones are still tried, so no
/// unchosen group fits in the remainder. Groups with sensitivity 0 are never chosen.
/// Deterministic; `budget = 1` chooses nothing.
pub fn select_bf16(cands: &[MixCandidate], budget: f64) -> Result<MixSelection, MixError> {
    if !(budget.is_finite() && budget >= 1.0) {
        return Err(MixError::BadBudget(budget));
    }
    if cands.is_empty() {
        return Err(MixError::Empty);
    }
    for c in cands {
        let name = c.modules.join(",");
        if !(c.sensitivity.is_finite() && c.sensitivity >= 0.0) {
            return Err(MixError::BadSensitivity(name, c.sensitivity));
        }
        if c.bf16_bytes <= c.nvfp4_bytes {
            return Err(MixError::BadBytes(name, c.bf16_bytes, c.nvfp4_bytes));
        }
    }
    let base: u64 = cands.iter().map(|c| c.nvfp4_bytes).sum();
    // floor(budget · base) in exact arithmetic where it matters: f64 holds base (< 2^53)
    // exactly; the product is rounded once, so step back while it overshoots.
    let mut allowance = (budget * base as f64).floor() as u64;
    while allowance as f64 > budget * base as f64 {
        allowance -= 1;
    }
    let mut order: Vec<usize> = (0..cands.len()).collect();
    let density = |i: usize| cands[i].sensitivity / cands[i].extra_bytes() as f64;
    order.sort_by(|&a, &b| density(b).total_cmp(&density(a)).then(a.cmp(&b)));
    let mut bytes = base;
    let mut chosen = vec![];
    for i in order {
        let extra = cands[i].extra_bytes();
        if cands[i].sensitivity > 0.0 && bytes + extra <= allowance {
            bytes += extra;
            chosen.push(i);
        }
    }
    Ok(MixSelection {
        bf16: chosen,
        base_bytes: base,
        budget_bytes: allowance,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn cand(i: usize, n: usize, k: usize, s: f64) -> MixCandidate {
        MixCandidate {
            modules: vec![format!("m{i}")],
            nvfp4_bytes: nvfp4_bytes(n, k),
            bf16_bytes: bf16_bytes(n, k),
            sensitivity: s,
        }
    }

    /// SmolLM2-like groups: 30 layers × (q/k/v, o, gate/up, down), random sensitivities.
    fn smollm2_like(seed: u64) -> Vec<MixCandidate> {
        let mut rng = StdRng::seed_from_u64(seed);
        let shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)];
        (0..120)
            .map(|i| {
                let (n, k) = shapes[i % 4];
                cand(i, n, k, rng.random_range(0.0..1.0f64).powi(4))
            })
            .collect()
    }

    #[test]
    fn bytes_are_modelopt_layouts() {
        // SmolLM2's q_proj: 576 × 576 → 165,888 code + 20,736 scale + 4 bytes.
        assert_eq!(nvfp4_bytes(576, 576), 165_888 + 20_736 + 4);
        assert_eq!(bf16_bytes(576, 576), 663_552);
    }

    #[test]
    fn the_budget_is_respected_exactly_and_nothing_else_fits() {
        for seed in 0..20 {
            let c = smollm2_like(seed);
            for budget in [1.0, 1.1, 1.25, 1.5, 2.0, 4.0] {
                let s = select_bf16(&c, budget).unwrap();
                let base: u64 = c.iter().map(|c| c.nvfp4_bytes).sum();
                assert_eq!(s.base_bytes, base);
                assert_eq!(s.budget_bytes, (budget * base as f64).floor() as u64);
                let bytes = base + s.bf16.iter().map(|&i| c[i].extra_bytes()).sum::<u64>();
                assert_eq!(s.bytes, bytes);
                assert!(
                    s.bytes <= s.budget_bytes,
                    "{} > {}",
                    s.bytes,
                    s.budget_bytes
                );
                // Maximal: no unchosen group with a positive sensitivity still fits.
                for (i, ci) in c.iter().enumerate() {
                    if !s.bf16.contains(&i) && ci.sensitivity > 0.0 {
                        assert!(s.bytes + ci.extra_bytes() > s.budget_bytes);
                    }
                }
                if budget == 1.0 {
                    assert!(s.bf16.is_empty());
                }
            }
        }
        // Room for everything: everything with a positive sensitivity.
        let c = smollm2_like(1);
        let s = select_bf16(&c, 4.0).unwrap();
        assert_eq!(
            s.bf16.len(),
            c.iter().filter(|c| c.sensitivity > 0.0).count()
        );
    }

    #[test]
    fn greedy_order_is_by_sensitivity_per_byte() {
        // Same sensitivity, the smaller group first; a dense small group beats a big one.
        let c = vec![
            cand(0, 3072, 576, 1.0), // extra 2.54 MB
            cand(1, 576, 576, 1.0),  // extra 0.48 MB: denser
            cand(2, 576, 576, 0.1),
            cand(3, 576, 576, 0.0), // never
        ];
        let all = select_bf16(&c, 10.0).unwrap();
        assert_eq!(all.bf16, [1, 0, 2]);
        // Room for only group 1's extra bytes (and less than group 0's): 1 then 2 fit.
        let base: u64 = c.iter().map(|c| c.nvfp4_bytes).sum();
        let room = 2 * c[1].extra_bytes() + 10;
        let s = select_bf16(&c, (base + room) as f64 / base as f64).unwrap();
        assert_eq!(s.bf16, [1, 2]);
        // The chosen densities never increase along the order.
        let big = smollm2_like(5);
        let s = select_bf16(&big, 1.25).unwrap();
        let d: Vec<f64> = s
            .bf16
            .iter()
            .map(|&i| big[i].sensitivity / big[i].extra_bytes() as f64)
            .collect();
        assert!(d.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn ties_and_repeats_are_deterministic() {
        let c: Vec<MixCandidate> = (0..8).map(|i| cand(i, 576, 576, 0.5)).collect();
        let base: u64 = c.iter().map(|c| c.nvfp4_bytes).sum();
        let room = 3 * c[0].extra_bytes();
        let s = select_bf16(&c, (base + room) as f64 / base as f64 + 1e-12).unwrap();
        assert_eq!(s.bf16, [0, 1, 2]);
        let big = smollm2_like(9);
        assert_eq!(select_bf16(&big, 1.25), select_bf16(&big, 1.25));
    }

    #[test]
    fn bad_inputs_are_errors() {
        let c = vec![cand(0, 16, 16, 1.0)];
        assert_eq!(select_bf16(&c, 0.9), Err(MixError::BadBudget(0.9)));
        assert!(select_bf16(&c, f64::NAN).is_err());
        assert_eq!(select_bf16(&[], 1.2), Err(MixError::Empty));
        let mut bad = c.clone();
        bad[0].sensitivity = -1.0;
        assert!(matches!(
            select_bf16(&bad, 1.2),
            Err(MixError::BadSensitivity(..))
        ));
        bad[0].sensitivity = f64::INFINITY;
        assert!(select_bf16(&bad, 1.2).is_err());
        let mut bad = c;
        bad[0].bf16_bytes = bad[0].nvfp4_bytes;
        assert!(matches!(
            select_bf16(&bad, 1.2),
            Err(MixError::BadBytes(..))
        ));
    }
}
