//! `model.safetensors.index.json` bytes → `ShardIndex::parse`: never panics, and an
//! accepted index only names plain files inside the folder.
#![no_main]

use candle_fp4::checkpoint::{check_file_name, ShardIndex};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(idx) = ShardIndex::parse(data, "fuzz/model.safetensors.index.json") {
        assert!(!idx.files.is_empty());
        for f in &idx.files {
            assert!(check_file_name("fuzz", f).is_ok(), "accepted {f:?}");
            assert!(!f.contains('/') && !f.contains('\\') && f != "..");
        }
        for (_, i) in &idx.weight_map {
            assert!(*i < idx.files.len());
        }
    }
});
