//! ModelOpt's round-to-nearest NVFP4 (the default method, byte-identical to its export)
//! and its rules for a Llama: which modules stay unquantized and which Linears share one
//! global scale.

use anyhow::{bail, Result};
use candle_fp4::nvfp4::{global_scale_for_amax, quantize_nvfp4_slice, Nvfp4Quantized};

/// Modules ModelOpt leaves unquantized in a Llama.
pub const DEFAULT_EXCLUDE: [&str; 2] = ["lm_head", "model.embed_tokens"];

/// Quantizes a group of Linears that share one global scale (q/k/v, gate/up, or a
/// single layer): each `(values, n, k)` is a row-major F32 weight.
pub fn quantize_group(weights: &[(Vec<f32>, usize, usize)]) -> Result<Vec<Nvfp4Quantized>> {
    let mut shared = 0f32;
    for (w, n, k) in weights {
        if n.checked_mul(*k) != Some(w.len()) {
            bail!("quantize_group: {} values for [{n}, {k}]", w.len());
        }
        let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        shared = shared.max(global_scale_for_amax(amax));
    }
    weights
        .iter()
        .map(|(w, n, k)| Ok(quantize_nvfp4_slice(w, *n, *k, Some(shared))?))
        .collect()
}

/// The groups of Linears (by module prefix) that share a global scale, for a Llama.
pub(super) fn linear_groups(names: &[String]) -> Vec<Vec<String>> {
    let mut layers: Vec<usize> = names
        .iter()
        .filter_map(|n| {
            n.strip_prefix("model.layers.")?
                .split_once('.')?
                .0
                .parse()
                .ok()
        })
        .collect();
    layers.sort_unstable();
    layers.dedup();
    let has = |p: &str| names.iter().any(|n| n == &format!("{p}.weight"));
    let mut groups = vec![];
    for i in layers {
        let a = format!("model.layers.{i}.self_attn");
        let m = format!("model.layers.{i}.mlp");
        for g in [
            vec![
                format!("{a}.q_proj"),
                format!("{a}.k_proj"),
                format!("{a}.v_proj"),
            ],
            vec![format!("{a}.o_proj")],
            vec![format!("{m}.gate_proj"), format!("{m}.up_proj")],
            vec![format!("{m}.down_proj")],
        ] {
            let present: Vec<String> = g.into_iter().filter(|p| has(p)).collect();
            if !present.is_empty() {
                groups.push(present);
            }
        }
    }
    groups
}
