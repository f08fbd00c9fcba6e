//! CUDA forwards of the ops (feature `cuda`): kernel images, module cache, launches.

mod gemv;
mod images;
mod kv;
mod launch;
mod scratch;

pub(crate) use gemv::{bf16_gemv_cuda, dequantize_rows_cuda, nvfp4_gemv_cuda};
pub(crate) use kv::{kv_attention_cuda, uq_read_cuda, uq_store_cuda};
pub(crate) use launch::{arch_tag, compute_capability};
