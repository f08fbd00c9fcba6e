//! UltraQuant FP4 KV-cache format (vLLM PR #57057, `vllm/v1/attention/ops/ultraquant/`),
//! CPU reference.
//!
//! # Format
//!
//! * Codes are E2M1 (FP4): bit 3 sign, bits 0–2 the magnitude `[0, 0.5, 1, 1.5, 2, 3, 4, 6]`
//!   ([`e2m1`]).
//! * Groups of [`GROUP_SIZE`] = 32 values along head_dim share one UE8M0 scale byte
//!   `s = 2^(byte − 127)` ([`ue8m0`]). The scale is `s = 2^round(log2(c · absmax))` with
//!   `c` = [`DEFAULT_CONSTANT_C`] = 0.156, rounding half up in f32; byte 0 is the zero
//!   sentinel; a group holding NaN or ±∞ gets byte 255 (NaN) and decodes to NaN (vLLM writes
//!   the zero sentinel there; we propagate instead, as the BF16 cache does). `absmax / s` lies in about [4.53, 9.07], so the top of some groups is clipped
//!   to ±6 on purpose (MSE-optimal).
//! * Values are encoded as `e2m1(x / s)`: nearest level, a midpoint goes to the lower level,
//!   saturating at ±6. Decoding is `e2m1 · s`.
//! * K is rotated at store by the normalized Sylvester Walsh–Hadamard transform over the whole
//!   head_dim ([`hadamard`]); the query gets the same rotation at decode, so `q · k` is kept.
//!   V is not rotated. There is no per-token norm.
//!
//! # Slot layout
//!
//! One slot per (token, head), `D` = head_dim, `G = D / 32` groups:
//!
//! | bytes | content |
//! |---|---|
//! | `[0, D/2)` | K codes (rotated K), two per byte, even element in the low nibble |
//! | `[D/2, D/2 + G)` | K scales, one UE8M0 byte per group |
//! | `[D/2 + G, D + G)` | V codes |
//! | `[D + G, D + 2G)` | V scales |
//!
//! 68 bytes at D = 64, 136 at D = 128, 272 at D = 256 ([`slot_size`]).
//!
//! # Modules
//!
//! * [`format`](mod@format): constants, sizes and offsets (mirrors vLLM's `format.py`).
//! * [`ue8m0`]: scale bytes, with an exact integer form of the f32 `log2` rounding.
//! * [`e2m1`]: FP4 codes and the tie rule.
//! * [`hadamard`]: the Walsh–Hadamard rotation.
//! * [`group`]: one group / one row: absmax, scale, codes, nibble packing.
//! * [`reference`](mod@reference): one whole slot, K and V.

pub mod e2m1;
pub mod format;
pub mod group;
pub mod hadamard;
pub mod reference;
pub mod ue8m0;

pub use e2m1::{decode_e2m1, encode_e2m1};
pub use format::{
    get_constant_c, get_group_size, k_codes_bytes, k_codes_offset, k_scales_bytes, k_scales_offset,
    n_groups, slot_size, v_codes_bytes, v_codes_offset, v_scales_bytes, v_scales_offset,
    DEFAULT_CONSTANT_C, FP4_MAX, GROUP_SIZE,
};
pub use group::{decode_group, decode_row, encode_group, encode_row};
pub use hadamard::wht_inplace;
pub use reference::{decode_slot, decode_slot_unrotated, encode_slot, encode_slot_with_c};
pub use ue8m0::{round_log2_half_up, scale_for_absmax, ue8m0_decode, ue8m0_encode};
