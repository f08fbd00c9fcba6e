//! Checks against a real NVIDIA ModelOpt 0.47 NVFP4 export of a tiny Llama
//! (`tests/data/modelopt_tiny`, see its README): decoding, re-quantization from the BF16
//! originals, fused loading, quant configs, sharded and memory-mapped checkpoints.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_fp4::checkpoint::Checkpoint;
use candle_fp4::nvfp4::{dequantize_nvfp4, quantize_nvfp4, quantize_nvfp4_with_global_scale};
use candle_fp4::quant_config::{QuantAlgo, QuantConfig};
use candle_fp4::quant_linear::QuantLinear;
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/modelopt_tiny");
const W4A16_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/modelopt_tiny_w4a16"
);

fn file(name: &str) -> Vec<u8> {
    std::fs::read(Path::new(DIR).join(name)).unwrap()
}

/// The 14 quantized Linears, found by their `weight_scale_2`.
fn quantized_prefixes(st: &SafeTensors) -> Vec<String> {
    let mut v: Vec<String> = st
        .names()
        .into_iter()
        .filter_map(|n| n.strip_suffix(".weight_scale_2").map(str::to_string))
        .collect();
    v.sort();
    v
}

/// The test's own decoder: `(n, k, e2m1 · (f32(e4m3) · gs))` in ModelOpt's order, from
/// the raw bytes, plus the other order `(e2m1 · e4m3) · gs`.
fn independent_decode(st: &SafeTensors, prefix: &str) -> (usize, usize, Vec<f32>, Vec<f32>) {
    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let w = st.tensor(&format!("{prefix}.weight")).unwrap();
    let s = st.tensor(&format!("{prefix}.weight_scale")).unwrap();
    let g = st.tensor(&format!("{prefix}.weight_scale_2")).unwrap();
    assert_eq!(w.dtype(), safetensors::Dtype::U8);
    assert_eq!(s.dtype(), safetensors::Dtype::F8_E4M3);
    assert_eq!((g.dtype(), g.shape()), (safetensors::Dtype::F32, &[][..]));
    let gs = f32::from_le_bytes(g.data().try_into().unwrap());
    let (n, k) = (w.shape()[0], 2 * w.shape()[1]);
    assert_eq!(s.shape(), [n, k / 16]);
    let (mut modelopt, mut other) = (vec![], vec![]);
    for row in 0..n {
        for j in 0..k {
            let byte = w.data()[row * k / 2 + j / 2];
            let code = if j.is_multiple_of(2) {
                byte & 0xF
            } else {
                byte >> 4
            };
            let v = E2M1[(code & 7) as usize] * if code & 8 != 0 { -1.0 } else { 1.0 };
            let sc = float8::F8E4M3::from_bits(s.data()[row * (k / 16) + j / 16]).to_f32();
            modelopt.push(v * (sc * gs));
            other.push((v * sc) * gs);
        }
    }
    (n, k, modelopt, other)
}

fn f32_bits(t: &Tensor) -> Vec<u32> {
    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

fn cfg() -> QuantConfig {
    QuantConfig::from_dir(DIR).unwrap()
}

#[test]
fn dequantization_matches_modelopt_bit_for_bit() -> Result<()> {
    let bytes = file("model.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let prefixes = quantized_prefixes(&st);
    assert_eq!(prefixes.len(), 14);
    let ckpt = Checkpoint::read(DIR)?;
    let (mut total, mut order_diffs) = (0usize, 0usize);
    for p in &prefixes {
        let (n, k, want, other) = independent_decode(&st, p);
        let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
        total += want.len();
        order_diffs += want
            .iter()
            .zip(&other)
            .filter(|(a, b)| **a != b.to_bits())
            .count();
        // nvfp4::dequantize_nvfp4 on the checkpoint tensors (F8E4M3 scales).
        let w = ckpt.load(&format!("{p}.weight"), &Device::Cpu)?;
        let s = ckpt.load(&format!("{p}.weight_scale"), &Device::Cpu)?;
        assert_eq!(s.dtype(), DType::F8E4M3);
        let gs = ckpt.scalar_f32(&format!("{p}.weight_scale_2"))?;
        let ours = dequantize_nvfp4(&w, &s, gs)?;
        assert_eq!(ours.dims(), [n, k]);
        assert!(f32_bits(&ours) == want, "{p}: dequantize_nvfp4");
        // QuantLinear::load + dequantize (swizzled and back).
        let layer = QuantLinear::load(&ckpt, p, &Device::Cpu, &cfg())?;
        assert!(layer.is_nvfp4());
        assert_eq!((layer.out_features(), layer.in_features()), (n, k));
        assert!(f32_bits(&layer.dequantize()?) == want, "{p}: QuantLinear");
    }
    // The README's counts: 565248 elements, 25825 differ in the other order.
    assert_eq!((total, order_diffs), (565_248, 25_825));
    Ok(())
}

#[test]
fn quantizer_reproduces_the_export() -> Result<()> {
    let exported = Checkpoint::read(DIR)?;
    let original = Checkpoint::read(Path::new(DIR).join("original.safetensors"))?;
    let st_bytes = file("model.safetensors");
    let prefixes = quantized_prefixes(&SafeTensors::deserialize(&st_bytes).unwrap());
    let mut own = std::collections::HashMap::new();
    for p in &prefixes {
        let w = original.load(&format!("{p}.weight"), &Device::Cpu)?;
        assert_eq!(w.dtype(), DType::BF16);
        let gs = exported.scalar_f32(&format!("{p}.weight_scale_2"))?;
        let codes = exported.get(&format!("{p}.weight"))?.data;
        let scales = exported.get(&format!("{p}.weight_scale"))?.data;
        let q = quantize_nvfp4_with_global_scale(&w, gs)?;
        assert!(q.weight == codes, "{p}: weight bytes");
        assert!(q.weight_scale == scales, "{p}: weight_scale bytes");
        own.insert(p.clone(), (quantize_nvfp4(&w)?.global_scale, gs));
    }
    for layer in 0..2 {
        let l = format!("model.layers.{layer}");
        // Own global scales: o_proj and down_proj exactly as exported.
        for m in ["self_attn.o_proj", "mlp.down_proj"] {
            let (o, e) = own[&format!("{l}.{m}")];
            assert_eq!(o.to_bits(), e.to_bits(), "{l}.{m}");
        }
        // Shared groups: the exported scale is the members' largest own scale.
        for group in [
            &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"][..],
            &["mlp.gate_proj", "mlp.up_proj"],
        ] {
            let members: Vec<(f32, f32)> = group.iter().map(|m| own[&format!("{l}.{m}")]).collect();
            let max_own = members.iter().map(|m| m.0).fold(0f32, f32::max);
            for (_, e) in &members {
                assert_eq!(e.to_bits(), max_own.to_bits(), "{l} {group:?}");
            }
        }
    }
    // Planted cases in layer 0's down_proj (README).
    let p = "model.layers.0.mlp.down_proj";
    assert_eq!(
        exported
            .scalar_f32(&format!("{p}.weight_scale_2"))?
            .to_bits(),
        0.000_279_017_87f32.to_bits()
    );
    let s = exported.get(&format!("{p}.weight_scale"))?.data;
    for ((row, blk), byte) in [
        ((11, 100 / 16), 0x7E),
        ((5, 3), 0x38),
        ((7, 0), 0x01),
        ((9, 1), 0x05),
    ] {
        assert_eq!(s[row * 20 + blk], byte, "scale ({row}, {blk})");
    }
    Ok(())
}

#[test]
fn fused_qkv_and_gate_up() -> Result<()> {
    let ckpt = Checkpoint::read(DIR)?;
    let cfg = cfg();
    let x = Tensor::arange(0f32, 4.0 * 192.0, &Device::Cpu)?
        .reshape((4, 192))?
        .affine(1.0 / 97.0, -3.0)?
        .sin()?
        .to_dtype(DType::BF16)?;
    for layer in 0..2 {
        let a = format!("model.layers.{layer}.self_attn");
        let m = format!("model.layers.{layer}.mlp");
        for (names, n) in [
            (
                vec![
                    format!("{a}.q_proj"),
                    format!("{a}.k_proj"),
                    format!("{a}.v_proj"),
                ],
                320,
            ),
            (vec![format!("{m}.gate_proj"), format!("{m}.up_proj")], 640),
        ] {
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let fused = QuantLinear::load_fused(&ckpt, &refs, &Device::Cpu, &cfg)?;
            assert_eq!((fused.out_features(), fused.in_features()), (n, 192));
            let parts: Vec<QuantLinear> = refs
                .iter()
                .map(|p| QuantLinear::load(&ckpt, p, &Device::Cpu, &cfg))
                .collect::<Result<_>>()?;
            assert!(parts
                .iter()
                .all(|p| p.global_scale() == fused.global_scale()));
            let deq: Vec<Tensor> = parts
                .iter()
                .map(|p| p.dequantize())
                .collect::<Result<_>>()?;
            assert!(f32_bits(&fused.dequantize()?) == f32_bits(&Tensor::cat(&deq, 0)?));
            // On CPU (GEMV, per-row dot products) the fused forward is the parts side by side.
            let ys: Vec<Tensor> = parts.iter().map(|p| p.forward(&x)).collect::<Result<_>>()?;
            let want = Tensor::cat(&ys, 1)?.to_dtype(DType::F32)?;
            assert!(f32_bits(&fused.forward(&x)?.to_dtype(DType::F32)?) == f32_bits(&want));
            if refs.len() == 2 {
                let (g, u) = (ys[0].to_dtype(DType::F32)?, ys[1].to_dtype(DType::F32)?);
                let want = (g.silu()? * u)?
                    .to_dtype(DType::BF16)?
                    .to_dtype(DType::F32)?;
                let got = fused.forward_silu_mul(&x)?.to_dtype(DType::F32)?;
                assert!(f32_bits(&got) == f32_bits(&want), "silu_mul {names:?}");
            }
        }
    }
    // q_proj and o_proj have different global scales.
    let (q, o) = (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.o_proj",
    );
    let err = QuantLinear::load_fused(&ckpt, &[q, o], &Device::Cpu, &cfg)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains(&format!("{q}.weight_scale_2")), "{err}");
    assert!(err.contains(&format!("{o}.weight_scale_2")), "{err}");
    Ok(())
}

#[test]
fn quant_configs_of_the_exports() -> Result<()> {
    let hf = QuantConfig::from_dir(DIR)?;
    assert_eq!(hf.quant_algo, QuantAlgo::Nvfp4);
    assert_eq!(hf.group_size, 16);
    assert_eq!(hf.exclude, ["lm_head", "model.embed_tokens"]);
    assert_eq!(hf.kv_cache_quant_algo, None);
    assert_eq!(hf.producer.as_deref(), Some("modelopt 0.47.0"));
    let text = String::from_utf8(file("config.json")).unwrap();
    assert_eq!(QuantConfig::from_config_json_str(&text, "config.json")?, hf);
    let w4a16 = QuantConfig::from_dir(W4A16_DIR)?;
    assert_eq!(w4a16.quant_algo, QuantAlgo::W4A16Nvfp4);
    assert_eq!(w4a16.exclude, hf.exclude);
    let text = std::fs::read_to_string(Path::new(W4A16_DIR).join("config.json")).unwrap();
    assert_eq!(
        QuantConfig::from_config_json_str(&text, "config.json")?,
        w4a16
    );
    for m in ["lm_head", "model.embed_tokens"] {
        assert!(hf.is_excluded(m));
    }
    assert!(hf.is_nvfp4("model.layers.1.mlp.down_proj"));
    // A folder with only config.json, and an empty folder.
    let dir = temp_dir("cfg");
    std::fs::write(dir.join("config.json"), &text).unwrap();
    assert_eq!(QuantConfig::from_dir(&dir)?, w4a16);
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert_eq!(QuantConfig::from_dir(&dir)?, QuantConfig::unquantized());
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn excluded_and_w4a16_loading() -> Result<()> {
    let ckpt = Checkpoint::read(DIR)?;
    let original = Checkpoint::read(Path::new(DIR).join("original.safetensors"))?;
    let head = QuantLinear::load(&ckpt, "lm_head", &Device::Cpu, &cfg())?;
    assert!(!head.is_nvfp4());
    let want = original
        .load("lm_head.weight", &Device::Cpu)?
        .to_dtype(DType::F32)?;
    assert!(f32_bits(&head.dequantize()?) == f32_bits(&want));
    // The W4A16 config loads the same tensors (input_scale is ignored either way).
    let w4a16 = QuantConfig::from_dir(W4A16_DIR)?;
    for p in [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
    ] {
        let a = QuantLinear::load(&ckpt, p, &Device::Cpu, &cfg())?;
        let b = QuantLinear::load(&ckpt, p, &Device::Cpu, &w4a16)?;
        assert_eq!(a.to_nvfp4()?, b.to_nvfp4()?);
    }
    // Forward of a real layer: one BF16 rounding on the GEMV path (M = 4).
    let down = QuantLinear::load(&ckpt, "model.layers.0.mlp.down_proj", &Device::Cpu, &cfg())?;
    let x = Tensor::arange(0f32, 4.0 * 320.0, &Device::Cpu)?
        .reshape((4, 320))?
        .affine(0.013, 0.0)?
        .cos()?
        .to_dtype(DType::BF16)?;
    let y = down
        .forward(&x)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let xf = x.to_dtype(DType::F32)?;
    let w = down.dequantize()?;
    let r = xf.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()?;
    let a = xf
        .abs()?
        .matmul(&w.abs()?.t()?)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for ((y, r), a) in y.iter().zip(&r).zip(&a) {
        let e = (2.0 * 320.0 + 4.0) * a / 16_777_216.0;
        assert!((y - r).abs() <= (r.abs() + e) / 256.0 + e, "{y} vs {r}");
    }
    Ok(())
}

fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let d = std::env::temp_dir().join(format!("candle-fp4-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn sharded_and_mmaped_checkpoints() -> Result<()> {
    let bytes = file("model.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let dir = temp_dir("shards");
    let (mut a, mut b) = (vec![], vec![]);
    let mut map = serde_json::Map::new();
    for (name, view) in st.tensors() {
        let shard = if name.starts_with("model.layers.0.") {
            1
        } else {
            2
        };
        let f = format!("model-0000{shard}-of-00002.safetensors");
        map.insert(name.clone(), serde_json::Value::String(f));
        if shard == 1 {
            a.push((name, view))
        } else {
            b.push((name, view))
        }
    }
    safetensors::serialize_to_file(a, None, &dir.join("model-00001-of-00002.safetensors")).unwrap();
    safetensors::serialize_to_file(b, None, &dir.join("model-00002-of-00002.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let single = Checkpoint::read(DIR)?;
    let sharded = Checkpoint::read(&dir)?;
    // SAFETY: the files are not modified while mapped.
    let mapped = unsafe { Checkpoint::open(&dir)? };
    let mapped_single = unsafe { Checkpoint::open(DIR)? };
    assert_eq!(single.names(), sharded.names());
    assert_eq!(single.names(), mapped.names());
    assert_eq!(single.names(), mapped_single.names());
    for p in [
        "model.layers.0.self_attn.k_proj",
        "model.layers.1.mlp.up_proj",
        "lm_head",
    ] {
        let want = QuantLinear::load(&single, p, &Device::Cpu, &cfg())?.dequantize()?;
        for ck in [&sharded, &mapped, &mapped_single] {
            let got = QuantLinear::load(ck, p, &Device::Cpu, &cfg())?.dequantize()?;
            assert!(
                f32_bits(&got) == f32_bits(&want),
                "{p} from {}",
                ck.origin()
            );
        }
    }
    // A missing shard file is an error naming it; a folder without weights too.
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let err = Checkpoint::read(&dir)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
    let empty = temp_dir("empty");
    let err = Checkpoint::read(&empty)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("model.safetensors"), "{err}");
    std::fs::remove_dir_all(&empty).ok();
    Ok(())
}
