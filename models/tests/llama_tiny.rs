//! The tiny ModelOpt-exported Llama in `tests/data/modelopt_tiny` (2 layers, hidden 192,
//! 3 heads / 1 KV head of 64, vocab 256): loading, logits vs transformers' fp32 eager
//! reference, KV-cache decode vs prefill, UltraQuant KV, and errors.
//!
//! Tolerance of the logit comparisons: the reference runs every activation in FP32; we
//! round the input and output of every projection to BF16 (QuantLinear's numerics), and
//! the logits themselves come out of `lm_head` as BF16. That last rounding alone is up to
//! half a BF16 ulp, 2⁻⁸·|logit| (≈ 0.0039 for the |logits| ≤ 1.02 here); the BF16
//! roundings upstream add a few 1e-4 through two small layers. We allow one full ulp,
//! 2⁻⁷·max(1, max|ref|), per element, and demand every argmax to agree up to that
//! tolerance: our argmax must be a token whose reference logit is within 2·tolerance of
//! the reference maximum (with every logit allowed to be off by the tolerance, closer
//! tokens are ties; e.g. row 7 of the BF16 reference has its top two 0.0004 apart,
//! a tenth of a BF16 ulp, so which of them wins depends on the FP32 summation order of
//! the CPU GEMV kernel).

use candle_core::{Device, Tensor};
use candle_fp4::kv_cache::KvCacheKind;
use candle_fp4_models::quant::{write_safetensors, OwnedTensor};
use candle_fp4_models::{Llama, LoadOptions};
use safetensors::SafeTensors;
use std::path::Path;

mod common;
use common::{bf16_dir, data, logit_tolerance, max_abs, reference};

/// (max |a − b|, number of rows whose argmax agrees up to ties: `b` at `a`'s argmax is
/// within 2·tolerance(b) of `b`'s maximum).
fn compare(a: &Tensor, b: &Tensor) -> (f32, usize) {
    assert_eq!(a.dims(), b.dims());
    let max = max_abs(&(a - b).unwrap());
    let aa = a.argmax(1).unwrap().to_vec1::<u32>().unwrap();
    let bv = b.to_vec2::<f32>().unwrap();
    let tie = 2.0 * tolerance(b);
    let agree = aa.iter().zip(&bv).filter(|(&i, row)| {
        let top = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        row[i as usize] >= top - tie
    });
    (max, agree.count())
}

fn tolerance(reference: &Tensor) -> f32 {
    logit_tolerance(reference, 1.0)
}

fn load(dir: &Path, opts: LoadOptions) -> Llama {
    Llama::load(dir, &Device::Cpu, &opts).unwrap()
}

#[test]
fn nvfp4_logits_match_transformers() {
    let r = reference();
    let mut m = load(&data(), LoadOptions::default());
    assert_eq!(
        m.nvfp4_layer_count(),
        (8, 9),
        "4 fused/plain NVFP4 linears per layer, BF16 lm_head"
    );
    let logits = m.forward_all(&r.ids, 0).unwrap();
    let (max, agree) = compare(&logits, &r.dequant);
    eprintln!(
        "NVFP4 vs transformers (dequantized weights): max |diff| {max:.5}, argmax {agree}/12"
    );
    assert!(max <= tolerance(&r.dequant), "max |diff| {max}");
    assert_eq!(agree, r.ids.len());
}

#[test]
fn bf16_logits_match_transformers() {
    let r = reference();
    let d = bf16_dir();
    let mut m = load(d.path(), LoadOptions::default());
    assert_eq!(m.nvfp4_layer_count(), (0, 9));
    let logits = m.forward_all(&r.ids, 0).unwrap();
    let (max, agree) = compare(&logits, &r.original);
    eprintln!("BF16 vs transformers (original weights): max |diff| {max:.5}, argmax {agree}/12");
    assert!(max <= tolerance(&r.original), "max |diff| {max}");
    assert_eq!(agree, r.ids.len());
}

#[test]
fn bf16_activations_also_match() {
    // The CUDA default (BF16 activations) on the CPU: same checks, looser (every
    // activation, not only the projections, is rounded to BF16).
    let r = reference();
    let opts = LoadOptions {
        dtype: Some(candle_core::DType::BF16),
        ..Default::default()
    };
    let mut m = load(&data(), opts);
    let logits = m.forward_all(&r.ids, 0).unwrap();
    let (max, agree) = compare(&logits, &r.dequant);
    eprintln!("NVFP4, BF16 activations: max |diff| {max:.5}, argmax {agree}/12");
    assert!(max <= 2.0 * tolerance(&r.dequant), "max |diff| {max}");
    assert!(agree >= 11);
}

#[test]
fn decode_with_kv_cache_matches_prefill() {
    let r = reference();
    let mut m = load(&data(), LoadOptions::default());
    let all = m.forward_all(&r.ids, 0).unwrap();
    // Prefill 5 tokens, then one token at a time from the cache.
    let mut rows = vec![m.forward_all(&r.ids[..5], 0).unwrap()];
    for (i, &t) in r.ids.iter().enumerate().skip(5) {
        assert_eq!(m.cached_len(), i);
        rows.push(m.forward(&[t], i).unwrap().unsqueeze(0).unwrap());
    }
    let step = Tensor::cat(&rows, 0).unwrap();
    let (max, agree) = compare(&step, &all);
    eprintln!("decode vs prefill: max |diff| {max:.6}");
    assert!(max <= tolerance(&all), "max |diff| {max}");
    assert_eq!(agree, r.ids.len());

    // Chunked prefill (3 tokens at a time) and rewinding to position 0 give the same.
    let opts = LoadOptions {
        prefill_chunk: 3,
        ..Default::default()
    };
    let mut c = load(&data(), opts);
    let chunked = c.forward_all(&r.ids, 0).unwrap();
    let again = c.forward_all(&r.ids, 0).unwrap();
    assert!(compare(&chunked, &all).0 <= tolerance(&all));
    assert_eq!(compare(&chunked, &again).0, 0.0);
    // `forward` returns the last row.
    let last = c.forward(&r.ids, 0).unwrap();
    assert_eq!(
        compare(
            &last.unsqueeze(0).unwrap(),
            &again.narrow(0, 11, 1).unwrap()
        )
        .0,
        0.0
    );
}

#[test]
fn ultraquant_kv_cache_stays_close() {
    let r = reference();
    let mut bf = load(&data(), LoadOptions::default());
    let base = bf.forward_all(&r.ids, 0).unwrap();
    let opts = LoadOptions {
        kv_cache: KvCacheKind::UltraQuant,
        // Every token attends as in decode, over FP4 K/V only.
        prefill_chunk: 1,
        kv_window: 0,
        ..Default::default()
    };
    let mut uq = load(&data(), opts);
    assert_eq!(uq.kv_cache_kind(), KvCacheKind::UltraQuant);
    // 2 layers × 1 KV head × 68-byte slots vs 2 × 2·64·2 bytes in BF16.
    assert_eq!(uq.kv_bytes_per_token(), 2 * 68);
    assert_eq!(bf.kv_bytes_per_token(), 2 * 256);
    let l = uq.forward_all(&r.ids, 0).unwrap();
    let (max, agree) = compare(&l, &base);
    eprintln!("UltraQuant KV vs BF16 KV: max |diff| {max:.5}, argmax {agree}/12");
    assert!(max > 0.0, "the FP4 cache must change something");
    // A smoke bound: this random model's K/V are noise, and FP4 with one power-of-two
    // scale per 32 values moves them by ~10%; the real measure is SmolLM2's perplexity
    // (docs/accuracy.md). NVFP4 weights alone move these logits by 0.18.
    assert!(max < 0.5, "max |diff| {max}");
    assert!(agree >= 9);
    // One prefill chunk sees exact K/V: the FP4 cache changes nothing but roundings.
    let opts = LoadOptions {
        kv_cache: KvCacheKind::UltraQuant,
        ..Default::default()
    };
    let mut uq = load(&data(), opts);
    let l = uq.forward_all(&r.ids, 0).unwrap();
    let (max, agree) = compare(&l, &base);
    assert!(max <= tolerance(&base), "max |diff| {max}");
    assert_eq!(agree, 12);
    // Decode token by token with an exact window covering the text (the default, 64 >
    // 12 tokens): every token reads exact K/V, so again only roundings differ.
    let opts = LoadOptions {
        kv_cache: KvCacheKind::UltraQuant,
        prefill_chunk: 1,
        ..Default::default()
    };
    let mut uq = load(&data(), opts);
    let l = uq.forward_all(&r.ids, 0).unwrap();
    let (max, agree) = compare(&l, &base);
    assert!(max <= tolerance(&base), "exact window: max |diff| {max}");
    assert_eq!(agree, 12);
}

/// A copy of the NVFP4 fixture folder whose tensors went through `edit`.
fn nvfp4_copy(edit: impl FnOnce(&mut Vec<(String, OwnedTensor)>)) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for f in ["config.json", "hf_quant_config.json"] {
        std::fs::copy(data().join(f), d.path().join(f)).unwrap();
    }
    let bytes = std::fs::read(data().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<(String, OwnedTensor)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let t = OwnedTensor {
                dtype: v.dtype(),
                shape: v.shape().to_vec(),
                data: v.data().to_vec(),
            };
            (n, t)
        })
        .collect();
    edit(&mut ts);
    write_safetensors(&ts, &d.path().join("model.safetensors")).unwrap();
    d
}

/// Doubles `{prefix}.weight_scale_2` and halves every block scale of `prefix` (E4M3 bytes
/// with exponent field ≥ 2: one exponent step down is exact), so the layer dequantizes to
/// the same weights with a global scale its fusion partners do not share.
fn rescale_global(ts: &mut [(String, OwnedTensor)], prefix: &str) {
    for (n, t) in ts.iter_mut() {
        if *n == format!("{prefix}.weight_scale_2") {
            let g = f32::from_le_bytes(t.data[..4].try_into().unwrap());
            t.data = (2.0 * g).to_le_bytes().to_vec();
        } else if *n == format!("{prefix}.weight_scale") {
            for b in t.data.iter_mut() {
                assert!(*b >> 7 == 0 && (*b >> 3) & 0xF >= 2, "scale byte {b:#x}");
                *b -= 8;
            }
        }
    }
}

#[test]
fn members_with_different_global_scales_load_as_separate_layers() {
    // ModelOpt shares one global scale over q/k/v and over gate/up; a checkpoint that does
    // not is loaded with those projections unfused (decided on the stored
    // `weight_scale_2` values) and computes the same model.
    let r = reference();
    let d = nvfp4_copy(|ts| {
        rescale_global(ts, "model.layers.0.self_attn.k_proj");
        rescale_global(ts, "model.layers.1.mlp.up_proj");
    });
    let mut m = load(d.path(), LoadOptions::default());
    // Layer 0's q, k, v and layer 1's gate, up as separate NVFP4 layers.
    assert_eq!(m.nvfp4_layer_count(), (11, 12));
    let logits = m.forward_all(&r.ids, 0).unwrap();
    let (max, agree) = compare(&logits, &r.dequant);
    eprintln!("unfused q/k/v and gate/up vs transformers: max |diff| {max:.5}, argmax {agree}/12");
    assert!(max <= tolerance(&r.dequant), "max |diff| {max}");
    assert_eq!(agree, r.ids.len());

    // Unfused members are still checked as a fused load checks them.
    let d = nvfp4_copy(|ts| {
        rescale_global(ts, "model.layers.0.self_attn.k_proj");
        for (n, t) in ts.iter_mut() {
            if n == "model.layers.0.self_attn.k_proj.weight" {
                t.shape = vec![64, 88];
                t.data.truncate(64 * 88);
            } else if n == "model.layers.0.self_attn.k_proj.weight_scale" {
                t.shape = vec![64, 11];
                t.data.truncate(64 * 11);
            }
        }
    });
    let e = format!(
        "{:#}",
        Llama::load(d.path(), &Device::Cpu, &LoadOptions::default()).unwrap_err()
    );
    assert!(
        e.contains(
            "cannot fuse `model.layers.0.self_attn.q_proj` (in_features 192) with \
             `model.layers.0.self_attn.k_proj` (in_features 176)"
        ),
        "{e}"
    );
}
