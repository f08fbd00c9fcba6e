//! QuantLinear from checkpoints: NVFP4 and BF16 layers, fused layers and their global
//! scales, the errors naming the tensor, and both quant-config forms.

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_fp4::checkpoint::Checkpoint;
use candle_fp4::nvfp4::{quantize_nvfp4_slice, Nvfp4Quantized};
use candle_fp4::quant_config::{QuantAlgo, QuantConfig};
use candle_fp4::quant_linear::QuantLinear;
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;
use safetensors::tensor::{Dtype, TensorView};

mod quant_linear_common;
use quant_linear_common::*;

// ---- checkpoints -------------------------------------------------------------------

type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

fn nvfp4_entries(prefix: &str, q: &Nvfp4Quantized) -> Vec<Entry> {
    vec![
        (
            format!("{prefix}.weight"),
            Dtype::U8,
            vec![q.n, q.k / 2],
            q.weight.clone(),
        ),
        (
            format!("{prefix}.weight_scale"),
            Dtype::F8_E4M3,
            vec![q.n, q.k / 16],
            q.weight_scale.clone(),
        ),
        (
            format!("{prefix}.weight_scale_2"),
            Dtype::F32,
            vec![],
            q.global_scale.to_le_bytes().to_vec(),
        ),
        (
            format!("{prefix}.input_scale"),
            Dtype::F32,
            vec![],
            0.01f32.to_le_bytes().to_vec(),
        ),
    ]
}

fn set(entries: &mut Vec<Entry>, name: &str, dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) {
    entries.retain(|e| e.0 != name);
    entries.push((name.to_string(), dtype, shape, data));
}

fn checkpoint(entries: &[Entry]) -> Checkpoint {
    let views: Vec<(String, TensorView<'_>)> = entries
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    Checkpoint::from_buffer(bytes, "test.safetensors").unwrap()
}

fn nvfp4_cfg() -> QuantConfig {
    QuantConfig {
        quant_algo: QuantAlgo::Nvfp4,
        group_size: 16,
        exclude: vec!["lm_head".into(), "model.layers.*.mlp.gate".into()],
        kv_cache_quant_algo: None,
        producer: None,
    }
}

#[track_caller]
fn assert_err<T: std::fmt::Debug>(r: Result<T>, needles: &[&str]) {
    match r {
        Ok(v) => panic!("expected an error mentioning {needles:?}, got Ok({v:?})"),
        Err(e) => {
            let msg = e.to_string();
            for n in needles {
                assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
            }
        }
    }
}

const P: &str = "model.layers.0.self_attn.q_proj";

#[test]
fn load_nvfp4_layer_from_checkpoint() -> Result<()> {
    let q = quantized(51, 200, 192);
    let want = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?.dequantize()?;
    let want = bits(&want.to_dtype(DType::F32)?);
    let cfg = nvfp4_cfg();
    // As exported: F8_E4M3 scales, 0-d global scale, input_scale present (ignored).
    let mut e = nvfp4_entries(P, &q);
    let l = QuantLinear::load(&checkpoint(&e), P, &Device::Cpu, &cfg)?;
    assert!(l.is_nvfp4() && l.bias().is_none());
    assert_eq!(l.to_nvfp4()?.as_ref(), Some(&q));
    assert_eq!(bits(&l.dequantize()?), want);
    // U8 scales, [1] global scale, no input_scale, a bias.
    let gs = q.global_scale.to_le_bytes().to_vec();
    set(
        &mut e,
        &format!("{P}.weight_scale"),
        Dtype::U8,
        vec![200, 12],
        q.weight_scale.clone(),
    );
    set(
        &mut e,
        &format!("{P}.weight_scale_2"),
        Dtype::F32,
        vec![1],
        gs,
    );
    e.retain(|x| !x.0.ends_with("input_scale"));
    let b: Vec<u8> = (0..200)
        .flat_map(|i| bf16::from_f32(i as f32 / 64.0).to_le_bytes())
        .collect();
    set(&mut e, &format!("{P}.bias"), Dtype::BF16, vec![200], b);
    let l = QuantLinear::load(&checkpoint(&e), P, &Device::Cpu, &cfg)?;
    assert_eq!(l.to_nvfp4()?.as_ref(), Some(&q));
    let bias = l.bias().map(|b| b.to_dtype(DType::F32)?.to_vec1::<f32>());
    assert_eq!(bias.transpose()?.map(|v| v[64]), Some(1.0));
    // W4A16 loads the same way.
    let w4a16 = QuantConfig {
        quant_algo: QuantAlgo::W4A16Nvfp4,
        ..cfg
    };
    let l = QuantLinear::load(&checkpoint(&e), P, &Device::Cpu, &w4a16)?;
    assert_eq!(l.to_nvfp4()?.as_ref(), Some(&q));
    Ok(())
}

#[test]
fn load_bf16_layers() -> Result<()> {
    let w: Vec<u8> = (0..64 * 32)
        .flat_map(|i| bf16::from_f32((i % 7) as f32 - 3.0).to_le_bytes())
        .collect();
    let f32w: Vec<u8> = (0..64 * 32)
        .flat_map(|i| ((i % 7) as f32 - 3.0).to_le_bytes())
        .collect();
    let e = vec![
        (
            "lm_head.weight".to_string(),
            Dtype::BF16,
            vec![64, 32],
            w.clone(),
        ),
        (
            "model.layers.3.mlp.gate.weight".to_string(),
            Dtype::F32,
            vec![64, 32],
            f32w,
        ),
        (format!("{P}.weight"), Dtype::BF16, vec![64, 32], w),
    ];
    let ck = checkpoint(&e);
    let cfg = nvfp4_cfg();
    for name in ["lm_head", "model.layers.3.mlp.gate"] {
        let l = QuantLinear::load(&ck, name, &Device::Cpu, &cfg)?;
        assert!(!l.is_nvfp4(), "{name}");
        assert_eq!((l.out_features(), l.in_features()), (64, 32));
        assert_eq!(
            l.dequantize()?.i((1, 0))?.to_scalar::<f32>()?,
            32.0 % 7.0 - 3.0
        );
    }
    // Unquantized config: the q_proj BF16 weight loads as is...
    let l = QuantLinear::load(&ck, P, &Device::Cpu, &QuantConfig::unquantized())?;
    assert!(!l.is_nvfp4());
    // ...but with the NVFP4 config it is an error naming the tensor.
    assert_err(
        QuantLinear::load(&ck, P, &Device::Cpu, &cfg),
        &[&format!("{P}.weight"), "U8"],
    );
    // And NVFP4 tensors under an unquantized config are an error too.
    let q = quantized(2, 64, 64);
    let ck = checkpoint(&nvfp4_entries(P, &q));
    assert_err(
        QuantLinear::load(&ck, P, &Device::Cpu, &QuantConfig::unquantized()),
        &[&format!("{P}.weight"), "U8"],
    );
    Ok(())
}

#[test]
fn checkpoint_errors_name_the_tensor() {
    let q = quantized(61, 64, 128);
    let cfg = nvfp4_cfg();
    let load = |e: &[Entry]| QuantLinear::load(&checkpoint(e), P, &Device::Cpu, &cfg);
    let (w, s, g) = (
        format!("{P}.weight"),
        format!("{P}.weight_scale"),
        format!("{P}.weight_scale_2"),
    );
    // Missing tensors.
    for name in [&w, &s, &g] {
        let mut e = nvfp4_entries(P, &q);
        e.retain(|x| &x.0 != name);
        assert_err(load(&e), &[name, "missing", "test.safetensors"]);
    }
    // Wrong dtypes.
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &s, Dtype::BF16, vec![64, 4], vec![0; 64 * 8]);
    assert_err(load(&e), &[&s, "dtype", "BF16"]);
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &g, Dtype::F16, vec![], vec![0, 0x3c]);
    assert_err(load(&e), &[&g, "dtype", "F16"]);
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &w, Dtype::I32, vec![64, 16], vec![0; 64 * 64]);
    assert_err(load(&e), &[&w, "I32"]);
    // Wrong shapes.
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &s, Dtype::F8_E4M3, vec![64, 9], vec![0x38; 64 * 9]);
    assert_err(load(&e), &[&s, "shape", "[64, 9]", "[64, 8]"]);
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &g, Dtype::F32, vec![2], vec![0; 8]);
    assert_err(load(&e), &[&g, "shape"]);
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &w, Dtype::U8, vec![64, 60], vec![0; 64 * 60]);
    assert_err(load(&e), &[&w, "multiple of 16"]);
    let mut e = nvfp4_entries(P, &q);
    set(&mut e, &w, Dtype::U8, vec![64 * 64], vec![0; 64 * 64]);
    assert_err(load(&e), &[&w, "[4096]"]);
    let mut e = nvfp4_entries(P, &q);
    let b = format!("{P}.bias");
    set(&mut e, &b, Dtype::BF16, vec![65], vec![0; 130]);
    assert_err(load(&e), &[&b, "shape"]);
    // Bad global scales.
    for v in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, -1e-3] {
        let mut e = nvfp4_entries(P, &q);
        set(&mut e, &g, Dtype::F32, vec![], v.to_le_bytes().to_vec());
        assert_err(load(&e), &[&g, "positive finite"]);
    }
}

#[test]
fn load_fused_checks_global_scales_and_k() -> Result<()> {
    let (pq, pk, pv, po) = (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.o_proj",
    );
    // q/k/v quantized against one shared global scale (the largest of the three).
    let mut rng = StdRng::seed_from_u64(71);
    let ws: Vec<Vec<f32>> = [96, 32, 32]
        .iter()
        .map(|&n| rand_weights(&mut rng, n, 128))
        .collect();
    let own: Vec<f32> = ws
        .iter()
        .zip([96, 32, 32])
        .map(|(w, n)| quantize_nvfp4_slice(w, n, 128, None).unwrap().global_scale)
        .collect();
    let shared = own.iter().copied().fold(0f32, f32::max);
    let qs: Vec<Nvfp4Quantized> = ws
        .iter()
        .zip([96, 32, 32])
        .map(|(w, n)| quantize_nvfp4_slice(w, n, 128, Some(shared)).unwrap())
        .collect();
    let o = quantized(72, 64, 128);
    assert_ne!(o.global_scale, shared);
    let mut e = vec![];
    for (p, q) in [(pq, &qs[0]), (pk, &qs[1]), (pv, &qs[2]), (po, &o)] {
        e.extend(nvfp4_entries(p, q));
    }
    let odd_k = quantized(73, 16, 64);
    e.extend(nvfp4_entries("odd", &odd_k));
    let ck = checkpoint(&e);
    let cfg = nvfp4_cfg();
    let fused = QuantLinear::load_fused(&ck, &[pq, pk, pv], &Device::Cpu, &cfg)?;
    assert_eq!((fused.out_features(), fused.in_features()), (160, 128));
    assert_eq!(fused.global_scale(), Some(shared));
    let f = fused.to_nvfp4()?.unwrap_or_else(|| panic!("NVFP4"));
    let cat = |g: fn(&Nvfp4Quantized) -> &Vec<u8>| {
        qs.iter().flat_map(|q| g(q).clone()).collect::<Vec<u8>>()
    };
    assert_eq!(f.weight, cat(|q| &q.weight));
    assert_eq!(f.weight_scale, cat(|q| &q.weight_scale));
    // Forward of the fused layer = the three forwards side by side.
    let x = rand_x(5, &[3, 128]);
    let parts: Vec<Tensor> = [pq, pk, pv]
        .iter()
        .map(|p| QuantLinear::load(&ck, p, &Device::Cpu, &cfg)?.forward(&x))
        .collect::<Result<_>>()?;
    assert_eq!(bits(&fused.forward(&x)?), bits(&Tensor::cat(&parts, 1)?));
    // Different global scales: the error names both tensors and values.
    assert_err(
        QuantLinear::load_fused(&ck, &[pq, po], &Device::Cpu, &cfg),
        &[
            &format!("{pq}.weight_scale_2"),
            &format!("{po}.weight_scale_2"),
            &format!("{:e}", o.global_scale),
        ],
    );
    assert_err(
        QuantLinear::load_fused(&ck, &[pq, "odd"], &Device::Cpu, &cfg),
        &[pq, "odd", "in_features"],
    );
    assert_err(
        QuantLinear::load_fused(&ck, &[], &Device::Cpu, &cfg),
        &["at least one"],
    );
    Ok(())
}

// ---- quant config -------------------------------------------------------------------

#[test]
fn quant_config_both_forms() -> Result<()> {
    let hf = r#"{"producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                         "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}}"#;
    let c = QuantConfig::from_hf_quant_config_str(hf, "hf_quant_config.json")?;
    assert_eq!(c.quant_algo, QuantAlgo::Nvfp4);
    assert_eq!(c.group_size, 16);
    assert_eq!(c.exclude, ["lm_head", "model.layers.*.mlp.gate"]);
    assert_eq!(c.kv_cache_quant_algo.as_deref(), Some("FP8"));
    assert_eq!(c.producer.as_deref(), Some("modelopt 0.47.0"));
    let cj = r#"{"hidden_size": 8, "quantization_config": {"quant_method": "modelopt",
        "quant_algo": "W4A16_NVFP4", "ignore": ["lm_head"], "producer": {"name": "modelopt"},
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                      "targets": ["Linear"]}}}}"#;
    let c = QuantConfig::from_config_json_str(cj, "config.json")?;
    assert_eq!(c.quant_algo, QuantAlgo::W4A16Nvfp4);
    assert!(c.quantizes());
    assert_eq!(c.exclude, ["lm_head"]);
    assert_eq!(c.producer.as_deref(), Some("modelopt"));
    // Nested copy of hf_quant_config's object inside config.json.
    let nested = r#"{"quantization_config": {"quant_method": "modelopt",
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["x"]}}}"#;
    let c = QuantConfig::from_config_json_str(nested, "config.json")?;
    assert_eq!(
        (c.quant_algo, c.exclude.clone()),
        (QuantAlgo::Nvfp4, vec!["x".to_string()])
    );
    // No quantization_config / quant_algo null: unquantized.
    let c = QuantConfig::from_config_json_str(r#"{"hidden_size": 8}"#, "config.json")?;
    assert_eq!(c, QuantConfig::unquantized());
    assert!(!c.quantizes() && !c.is_nvfp4("anything"));
    let kv_only = r#"{"quantization": {"quant_algo": null, "kv_cache_quant_algo": "FP8"}}"#;
    let c = QuantConfig::from_hf_quant_config_str(kv_only, "h")?;
    assert_eq!(c.quant_algo, QuantAlgo::None);
    assert_eq!(c.kv_cache_quant_algo.as_deref(), Some("FP8"));
    Ok(())
}

#[test]
fn quant_config_rejects_unsupported() {
    let hf = |algo: &str, gs: usize| {
        format!(r#"{{"quantization": {{"quant_algo": {algo}, "group_size": {gs}}}}}"#)
    };
    for algo in [
        "\"FP8\"",
        "\"NVFP4_AWQ\"",
        "\"W4A8_AWQ\"",
        "\"MIXED_PRECISION\"",
    ] {
        assert_err(
            QuantConfig::from_hf_quant_config_str(&hf(algo, 16), "hf_quant_config.json"),
            &[
                "hf_quant_config.json",
                algo.trim_matches('"'),
                "not supported",
            ],
        );
    }
    assert_err(
        QuantConfig::from_hf_quant_config_str(&hf("\"NVFP4\"", 32), "hf_quant_config.json"),
        &["group_size 32"],
    );
    assert_err(
        QuantConfig::from_config_json_str(
            r#"{"quantization_config": {"quant_method": "gptq", "bits": 4}}"#,
            "config.json",
        ),
        &["config.json", "quant_method `gptq`"],
    );
    assert_err(
        QuantConfig::from_config_json_str(
            r#"{"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
               "config_groups": {"g": {"weights": {"group_size": 32}}}}}"#,
            "config.json",
        ),
        &["group_size 32"],
    );
    assert_err(
        QuantConfig::from_hf_quant_config_str("{}", "h.json"),
        &["h.json", "quantization"],
    );
    assert_err(
        QuantConfig::from_hf_quant_config_str("nope", "h.json"),
        &["h.json", "JSON"],
    );
    assert_err(
        QuantConfig::from_hf_quant_config_str(
            r#"{"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}}"#,
            "h.json",
        ),
        &["exclude_modules"],
    );
}

#[test]
fn exclusion_patterns() {
    let c = QuantConfig {
        exclude: vec![
            "lm_head".into(),
            "model.layers.*.mlp.gate".into(),
            "model.layers.1.self_attn".into(),
            "*vision*".into(),
            "model.layers.?.block_sparse_moe.gate".into(),
        ],
        ..nvfp4_cfg()
    };
    let yes = [
        "lm_head",
        "model.layers.0.mlp.gate",
        "model.layers.17.mlp.gate",
        // A parent module's exclusion covers its children.
        "model.layers.1.self_attn",
        "model.layers.1.self_attn.q_proj",
        "model.layers.0.mlp.gate.sub",
        "model.vision_tower.blocks.0.fc1",
        "model.layers.3.block_sparse_moe.gate",
    ];
    let no = [
        "lm_head_2",
        "model.lm_head",
        "model.layers.0.mlp.gate_proj",
        "model.layers.11.self_attn.q_proj",
        "model.layers.1.self_attn_extra.q_proj",
        "model.layers.13.block_sparse_moe.gate",
        "model.embed_tokens",
    ];
    for m in yes {
        assert!(c.is_excluded(m), "{m} should be excluded");
        assert!(!c.is_nvfp4(m));
    }
    for m in no {
        assert!(!c.is_excluded(m), "{m} should not be excluded");
        assert!(c.is_nvfp4(m));
    }
}
