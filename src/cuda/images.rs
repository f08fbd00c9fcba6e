//! The kernel images build.rs compiled (one per [`Image`] of `src/variants.rs` and per
//! `kernels/*.cu`), embedded by the generated `$OUT_DIR/images.rs`.

pub(crate) use crate::variants::Image;

include!(concat!(env!("OUT_DIR"), "/images.rs"));
