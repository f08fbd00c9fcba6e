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

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

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
}
