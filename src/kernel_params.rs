//! `#[repr(C)]` parameter blocks of the CUDA kernels, mirrored field for field from
//! `kernels/*.cuh`. Compiled on every build so the layout tests run in CI without a GPU.
#![allow(dead_code)]

/// `GemvParams` of `kernels/gemv.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemvParams {
    pub w: u64,
    pub scales: u64,
    pub x: u64,
    pub out: u64,
    pub out_scale: f32,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub x_stride: i32,
    pub sp: i32,
    pub n_tiles: i32,
    pub pad: i32,
}

/// `DequantParams` of `kernels/gemv.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct DequantParams {
    pub codes: u64,
    pub scales: u64,
    pub out: u64,
    pub n: i32,
    pub k: i32,
    pub sp: i32,
    pub pad: i32,
}

/// `UqStoreParams` of `kernels/ultraquant.cuh` (UltraQuant store kernel).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct UqStoreParams {
    pub cache: u64,
    pub k: u64,
    pub v: u64,
    pub lens: u64,
    pub c: f32,
    pub seq_base: i32,
    pub n_seq: i32,
    pub tokens: i32,
    pub kv_heads: i32,
    pub capacity: i32,
    pub head_dim: i32,
    pub pad: i32,
}

/// `UqReadParams` of `kernels/ultraquant.cuh` (UltraQuant read-back kernel).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct UqReadParams {
    pub cache: u64,
    pub out: u64,
    pub seq: i32,
    pub start: i32,
    pub count: i32,
    pub kv_heads: i32,
    pub capacity: i32,
    pub head_dim: i32,
}

/// `KvAttnParams` of `kernels/ultraquant.cuh` (split-KV decode attention).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvAttnParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub lens: u64,
    pub out: u64,
    pub part_o: u64,
    pub part_ml: u64,
    pub scale_log2: f32,
    pub q_heads: i32,
    pub kv_heads: i32,
    pub group: i32,
    pub capacity: i32,
    pub splits: i32,
    pub head_dim: i32,
    pub win: i32,
    pub counters: u64,
    pub split_base: i32,
    pub part_splits: i32,
    pub late_wait: i32,
    pub q_row: i32,
    pub positions: u64,
    pub cos: u64,
    pub sin: u64,
    pub max_pos: i32,
    pub store_c: f32,
}

/// `KvCombineParams` of `kernels/ultraquant.cuh` (merge of the attention splits).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvCombineParams {
    pub part_o: u64,
    pub part_ml: u64,
    pub out: u64,
    pub q_heads: i32,
    pub splits: i32,
    pub head_dim: i32,
    pub pad: i32,
    pub lens: u64,
}

/// `KvLensParams` of `kernels/ultraquant.cuh` (in-place update of the cache lengths).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvLensParams {
    pub lens: u64,
    pub seq_base: i32,
    pub n_seq: i32,
    pub value: i32,
    pub add: i32,
}

/// `KvAppendParams` of `kernels/ultraquant.cuh` (decode append at the device lengths).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvAppendParams {
    pub k: u64,
    pub v: u64,
    pub dst: u64,
    pub lens: u64,
    pub batch: i32,
    pub rows: i32,
    pub row_elems: i32,
    pub limit: i32,
}

/// `PackedGemvParams` of `kernels/gemv_packed.cuh` (packed NVFP4 GEMV).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackedGemvParams {
    pub w: u64,
    pub scales: u64,
    pub x: u64,
    pub out: u64,
    pub partial: u64,
    pub counters: u64,
    pub out_scale: f32,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub x_stride: i32,
    pub half_pad: i32,
    pub groups: i32,
    pub split: i32,
    pub npairs: i32,
    pub pad: i32,
    /// Norm variants: bf16 `[M, K]` added to x, or 0.
    pub delta: u64,
    /// Norm variants: the RMSNorm weight, bf16 `[K]`.
    pub norm_w: u64,
    /// Norm variants with a delta: bf16 `[M, K]`, x + delta.
    pub sum: u64,
    pub eps: f32,
    pub pad2: i32,
}

/// `PackParams` of `kernels/gemv_packed.cuh` (ModelOpt layout → packed layout).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackParams {
    pub codes: u64,
    pub scales: u64,
    pub out_codes: u64,
    pub out_scales: u64,
    pub n: i32,
    pub k: i32,
    pub sp: i32,
    pub half_pad: i32,
    pub tiles: i32,
    pub npairs: i32,
}

/// `PackedDequantParams` of `kernels/gemv_packed.cuh` (packed layout → exact BF16).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackedDequantParams {
    pub w: u64,
    pub scales: u64,
    pub out: u64,
    pub n: i32,
    pub k: i32,
    pub half_pad: i32,
    pub tiles: i32,
    pub npairs: i32,
    pub pad: i32,
}

/// `QkvRopeParams` of `kernels/rope.cuh` (fused q|k|v rotary embedding).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct QkvRopeParams {
    pub qkv: u64,
    pub positions: u64,
    pub cos: u64,
    pub sin: u64,
    pub out: u64,
    pub batch: i32,
    pub rot_heads: i32,
    pub heads: i32,
    pub d: i32,
    pub max_pos: i32,
    pub pad: i32,
}

/// `L2Prefetch` of `kernels/l2_prefetch.cuh`: up to four device byte ranges (16-byte
/// aligned, lengths multiples of 16) a kernel asks L2 for; a zero pointer is unused.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct L2Prefetch {
    pub ptr: [u64; 4],
    pub bytes: [u64; 4],
}

/// `AddRmsNormParams` of `kernels/rmsnorm.cuh` (residual add + RMSNorm).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct AddRmsNormParams {
    pub x: u64,
    pub delta: u64,
    pub weight: u64,
    pub sum: u64,
    pub out: u64,
    pub rows: i32,
    pub n: i32,
    pub eps: f32,
    pub vec: i32,
    pub prefetch: L2Prefetch,
}

/// `GreedyParams` of `kernels/greedy.cuh` (row argmax into the step's ids).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct GreedyParams {
    pub logits: u64,
    pub ids: u64,
    pub positions: u64,
    pub best: u64,
    pub done: u64,
    pub rows: i32,
    pub n: i32,
    pub chunk: i32,
    pub f32: i32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Offsets written in kernels/rmsnorm.cuh's comments.
    #[test]
    fn add_rmsnorm_params_layout_matches_cuh() {
        assert_eq!(offset_of!(AddRmsNormParams, x), 0);
        assert_eq!(offset_of!(AddRmsNormParams, delta), 8);
        assert_eq!(offset_of!(AddRmsNormParams, weight), 16);
        assert_eq!(offset_of!(AddRmsNormParams, sum), 24);
        assert_eq!(offset_of!(AddRmsNormParams, out), 32);
        assert_eq!(offset_of!(AddRmsNormParams, rows), 40);
        assert_eq!(offset_of!(AddRmsNormParams, n), 44);
        assert_eq!(offset_of!(AddRmsNormParams, eps), 48);
        assert_eq!(offset_of!(AddRmsNormParams, vec), 52);
        assert_eq!(offset_of!(AddRmsNormParams, prefetch), 56);
        assert_eq!(size_of::<AddRmsNormParams>(), 120);
    }

    /// Offsets written in kernels/l2_prefetch.cuh's comments.
    #[test]
    fn l2_prefetch_layout_matches_cuh() {
        assert_eq!(offset_of!(L2Prefetch, ptr), 0);
        assert_eq!(offset_of!(L2Prefetch, bytes), 32);
        assert_eq!(size_of::<L2Prefetch>(), 64);
    }

    /// Offsets written in kernels/greedy.cuh's comments.
    #[test]
    fn greedy_params_layout_matches_cuh() {
        assert_eq!(offset_of!(GreedyParams, logits), 0);
        assert_eq!(offset_of!(GreedyParams, ids), 8);
        assert_eq!(offset_of!(GreedyParams, positions), 16);
        assert_eq!(offset_of!(GreedyParams, best), 24);
        assert_eq!(offset_of!(GreedyParams, done), 32);
        assert_eq!(offset_of!(GreedyParams, rows), 40);
        assert_eq!(offset_of!(GreedyParams, n), 44);
        assert_eq!(offset_of!(GreedyParams, chunk), 48);
        assert_eq!(offset_of!(GreedyParams, f32), 52);
        assert_eq!(size_of::<GreedyParams>(), 56);
    }

    /// Offsets written in kernels/rope.cuh's comments.
    #[test]
    fn qkv_rope_params_layout_matches_cuh() {
        assert_eq!(offset_of!(QkvRopeParams, qkv), 0);
        assert_eq!(offset_of!(QkvRopeParams, positions), 8);
        assert_eq!(offset_of!(QkvRopeParams, cos), 16);
        assert_eq!(offset_of!(QkvRopeParams, sin), 24);
        assert_eq!(offset_of!(QkvRopeParams, out), 32);
        assert_eq!(offset_of!(QkvRopeParams, batch), 40);
        assert_eq!(offset_of!(QkvRopeParams, rot_heads), 44);
        assert_eq!(offset_of!(QkvRopeParams, heads), 48);
        assert_eq!(offset_of!(QkvRopeParams, d), 52);
        assert_eq!(offset_of!(QkvRopeParams, max_pos), 56);
        assert_eq!(offset_of!(QkvRopeParams, pad), 60);
        assert_eq!(size_of::<QkvRopeParams>(), 64);
    }

    /// Offsets written in kernels/gemv_packed.cuh's comments.
    #[test]
    fn packed_params_layout_matches_cuh() {
        assert_eq!(offset_of!(PackedGemvParams, w), 0);
        assert_eq!(offset_of!(PackedGemvParams, scales), 8);
        assert_eq!(offset_of!(PackedGemvParams, x), 16);
        assert_eq!(offset_of!(PackedGemvParams, out), 24);
        assert_eq!(offset_of!(PackedGemvParams, partial), 32);
        assert_eq!(offset_of!(PackedGemvParams, counters), 40);
        assert_eq!(offset_of!(PackedGemvParams, out_scale), 48);
        assert_eq!(offset_of!(PackedGemvParams, m), 52);
        assert_eq!(offset_of!(PackedGemvParams, n), 56);
        assert_eq!(offset_of!(PackedGemvParams, k), 60);
        assert_eq!(offset_of!(PackedGemvParams, x_stride), 64);
        assert_eq!(offset_of!(PackedGemvParams, half_pad), 68);
        assert_eq!(offset_of!(PackedGemvParams, groups), 72);
        assert_eq!(offset_of!(PackedGemvParams, split), 76);
        assert_eq!(offset_of!(PackedGemvParams, npairs), 80);
        assert_eq!(offset_of!(PackedGemvParams, delta), 88);
        assert_eq!(offset_of!(PackedGemvParams, norm_w), 96);
        assert_eq!(offset_of!(PackedGemvParams, sum), 104);
        assert_eq!(offset_of!(PackedGemvParams, eps), 112);
        assert_eq!(size_of::<PackedGemvParams>(), 120);
        assert_eq!(offset_of!(PackParams, codes), 0);
        assert_eq!(offset_of!(PackParams, scales), 8);
        assert_eq!(offset_of!(PackParams, out_codes), 16);
        assert_eq!(offset_of!(PackParams, out_scales), 24);
        assert_eq!(offset_of!(PackParams, n), 32);
        assert_eq!(offset_of!(PackParams, k), 36);
        assert_eq!(offset_of!(PackParams, sp), 40);
        assert_eq!(offset_of!(PackParams, half_pad), 44);
        assert_eq!(offset_of!(PackParams, tiles), 48);
        assert_eq!(offset_of!(PackParams, npairs), 52);
        assert_eq!(size_of::<PackParams>(), 56);
        assert_eq!(offset_of!(PackedDequantParams, w), 0);
        assert_eq!(offset_of!(PackedDequantParams, scales), 8);
        assert_eq!(offset_of!(PackedDequantParams, out), 16);
        assert_eq!(offset_of!(PackedDequantParams, n), 24);
        assert_eq!(offset_of!(PackedDequantParams, k), 28);
        assert_eq!(offset_of!(PackedDequantParams, half_pad), 32);
        assert_eq!(offset_of!(PackedDequantParams, tiles), 36);
        assert_eq!(offset_of!(PackedDequantParams, npairs), 40);
        assert_eq!(size_of::<PackedDequantParams>(), 48);
    }

    /// Offsets written in kernels/gemv.cuh's comments; both sides must agree.
    #[test]
    fn gemv_params_layout_matches_cuh() {
        assert_eq!(offset_of!(GemvParams, w), 0);
        assert_eq!(offset_of!(GemvParams, scales), 8);
        assert_eq!(offset_of!(GemvParams, x), 16);
        assert_eq!(offset_of!(GemvParams, out), 24);
        assert_eq!(offset_of!(GemvParams, out_scale), 32);
        assert_eq!(offset_of!(GemvParams, m), 36);
        assert_eq!(offset_of!(GemvParams, n), 40);
        assert_eq!(offset_of!(GemvParams, k), 44);
        assert_eq!(offset_of!(GemvParams, x_stride), 48);
        assert_eq!(offset_of!(GemvParams, sp), 52);
        assert_eq!(offset_of!(GemvParams, n_tiles), 56);
        assert_eq!(size_of::<GemvParams>(), 64);
    }

    #[test]
    fn dequant_params_layout_matches_cuh() {
        assert_eq!(offset_of!(DequantParams, codes), 0);
        assert_eq!(offset_of!(DequantParams, scales), 8);
        assert_eq!(offset_of!(DequantParams, out), 16);
        assert_eq!(offset_of!(DequantParams, n), 24);
        assert_eq!(offset_of!(DequantParams, k), 28);
        assert_eq!(offset_of!(DequantParams, sp), 32);
        assert_eq!(size_of::<DequantParams>(), 40);
    }

    /// The .cuh must state the same offsets (guards against editing one side only).
    #[test]
    fn cuh_comments_state_the_offsets() {
        let cuh = include_str!("../kernels/gemv.cuh");
        for needle in [
            "const void* w;           // offset  0",
            "float out_scale;         // offset 32",
            "int n_tiles;             // offset 56",
            "};                           // size 64",
            "int sp;                  // offset 32",
            "};                           // size 40",
        ] {
            assert!(cuh.contains(needle), "kernels/gemv.cuh lost `{needle}`");
        }
    }

    /// Offsets written in kernels/ultraquant.cuh's comments.
    #[test]
    fn ultraquant_params_layout_matches_cuh() {
        assert_eq!(offset_of!(UqStoreParams, cache), 0);
        assert_eq!(offset_of!(UqStoreParams, k), 8);
        assert_eq!(offset_of!(UqStoreParams, v), 16);
        assert_eq!(offset_of!(UqStoreParams, lens), 24);
        assert_eq!(offset_of!(UqStoreParams, c), 32);
        assert_eq!(offset_of!(UqStoreParams, seq_base), 36);
        assert_eq!(offset_of!(UqStoreParams, n_seq), 40);
        assert_eq!(offset_of!(UqStoreParams, tokens), 44);
        assert_eq!(offset_of!(UqStoreParams, kv_heads), 48);
        assert_eq!(offset_of!(UqStoreParams, capacity), 52);
        assert_eq!(offset_of!(UqStoreParams, head_dim), 56);
        assert_eq!(size_of::<UqStoreParams>(), 64);

        assert_eq!(offset_of!(UqReadParams, cache), 0);
        assert_eq!(offset_of!(UqReadParams, out), 8);
        assert_eq!(offset_of!(UqReadParams, seq), 16);
        assert_eq!(offset_of!(UqReadParams, start), 20);
        assert_eq!(offset_of!(UqReadParams, count), 24);
        assert_eq!(offset_of!(UqReadParams, kv_heads), 28);
        assert_eq!(offset_of!(UqReadParams, capacity), 32);
        assert_eq!(offset_of!(UqReadParams, head_dim), 36);
        assert_eq!(size_of::<UqReadParams>(), 40);

        assert_eq!(offset_of!(KvAttnParams, q), 0);
        assert_eq!(offset_of!(KvAttnParams, k), 8);
        assert_eq!(offset_of!(KvAttnParams, v), 16);
        assert_eq!(offset_of!(KvAttnParams, lens), 24);
        assert_eq!(offset_of!(KvAttnParams, out), 32);
        assert_eq!(offset_of!(KvAttnParams, part_o), 40);
        assert_eq!(offset_of!(KvAttnParams, part_ml), 48);
        assert_eq!(offset_of!(KvAttnParams, scale_log2), 56);
        assert_eq!(offset_of!(KvAttnParams, q_heads), 60);
        assert_eq!(offset_of!(KvAttnParams, kv_heads), 64);
        assert_eq!(offset_of!(KvAttnParams, group), 68);
        assert_eq!(offset_of!(KvAttnParams, capacity), 72);
        assert_eq!(offset_of!(KvAttnParams, splits), 76);
        assert_eq!(offset_of!(KvAttnParams, head_dim), 80);
        assert_eq!(offset_of!(KvAttnParams, win), 84);
        assert_eq!(offset_of!(KvAttnParams, counters), 88);
        assert_eq!(offset_of!(KvAttnParams, split_base), 96);
        assert_eq!(offset_of!(KvAttnParams, part_splits), 100);
        assert_eq!(offset_of!(KvAttnParams, late_wait), 104);
        assert_eq!(offset_of!(KvAttnParams, q_row), 108);
        assert_eq!(offset_of!(KvAttnParams, positions), 112);
        assert_eq!(offset_of!(KvAttnParams, cos), 120);
        assert_eq!(offset_of!(KvAttnParams, sin), 128);
        assert_eq!(offset_of!(KvAttnParams, max_pos), 136);
        assert_eq!(offset_of!(KvAttnParams, store_c), 140);
        assert_eq!(size_of::<KvAttnParams>(), 144);

        assert_eq!(offset_of!(KvCombineParams, part_o), 0);
        assert_eq!(offset_of!(KvCombineParams, part_ml), 8);
        assert_eq!(offset_of!(KvCombineParams, out), 16);
        assert_eq!(offset_of!(KvCombineParams, q_heads), 24);
        assert_eq!(offset_of!(KvCombineParams, splits), 28);
        assert_eq!(offset_of!(KvCombineParams, head_dim), 32);
        assert_eq!(offset_of!(KvCombineParams, lens), 40);
        assert_eq!(size_of::<KvCombineParams>(), 48);
    }

    /// kernels/ultraquant.cuh must state the same offsets.
    #[test]
    fn ultraquant_cuh_comments_state_the_offsets() {
        let cuh = include_str!("../kernels/ultraquant.cuh");
        for needle in [
            "uint8_t* cache;          // offset  0",
            "int head_dim;            // offset 56",
            "};                           // size 64",
            "int head_dim;            // offset 36",
            "};                           // size 40",
            "float scale_log2;        // offset 56",
            "int head_dim;            // offset 80",
            "int win;                 // offset 84",
            "uint32_t* counters;      // offset 88",
            "int part_splits;         // offset 100",
            "int late_wait;           // offset 104",
            "int q_row;               // offset 108",
            "const uint32_t* positions;  // offset 112",
            "const void* sin;         // offset 128",
            "int max_pos;             // offset 136",
            "float store_c;           // offset 140",
            "};                           // size 144",
            "uint32_t* lens;          // offset 40",
            "};                           // size 48",
            "int head_dim;            // offset 32",
        ] {
            assert!(
                cuh.contains(needle),
                "kernels/ultraquant.cuh lost `{needle}`"
            );
        }
    }

    #[test]
    fn kv_lens_params_layout_matches_cuh() {
        assert_eq!(offset_of!(KvLensParams, lens), 0);
        assert_eq!(offset_of!(KvLensParams, seq_base), 8);
        assert_eq!(offset_of!(KvLensParams, n_seq), 12);
        assert_eq!(offset_of!(KvLensParams, value), 16);
        assert_eq!(offset_of!(KvLensParams, add), 20);
        assert_eq!(size_of::<KvLensParams>(), 24);
    }

    #[test]
    fn kv_append_params_layout_matches_cuh() {
        assert_eq!(offset_of!(KvAppendParams, k), 0);
        assert_eq!(offset_of!(KvAppendParams, v), 8);
        assert_eq!(offset_of!(KvAppendParams, dst), 16);
        assert_eq!(offset_of!(KvAppendParams, lens), 24);
        assert_eq!(offset_of!(KvAppendParams, batch), 32);
        assert_eq!(offset_of!(KvAppendParams, rows), 36);
        assert_eq!(offset_of!(KvAppendParams, row_elems), 40);
        assert_eq!(offset_of!(KvAppendParams, limit), 44);
        assert_eq!(size_of::<KvAppendParams>(), 48);
    }
}
