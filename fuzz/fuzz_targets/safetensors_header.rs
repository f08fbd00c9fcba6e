//! Safetensors bytes → `Checkpoint::from_buffer`, every tensor read back and copied to the
//! CPU, and an NVFP4 `QuantLinear` loaded from layer `l` when present: never panics.
#![no_main]

use candle_core::{DType, Device};
use candle_fp4::checkpoint::Checkpoint;
use candle_fp4::quant_config::{QuantAlgo, QuantConfig};
use candle_fp4::quant_linear::QuantLinear;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(c) = Checkpoint::from_buffer(data.to_vec(), "fuzz.safetensors") else {
        return;
    };
    for name in c.names() {
        if let Ok(t) = c.get(name) {
            assert!(t.data.len() <= data.len());
            let _ = t.to_tensor(&Device::Cpu);
        }
        let _ = c.get_checked(name, &[DType::U8, DType::F8E4M3], &[1, 8]);
        let _ = c.scalar_f32(name);
    }
    let cfg = QuantConfig {
        quant_algo: QuantAlgo::Nvfp4,
        ..QuantConfig::unquantized()
    };
    if let Ok(l) = QuantLinear::load(&c, "l", &Device::Cpu, &cfg) {
        let _ = l.dequantize();
    }
    let _ = QuantLinear::load(&c, "l", &Device::Cpu, &QuantConfig::unquantized());
});
