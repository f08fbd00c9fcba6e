//! The CUDA runtime of the ops (feature `cuda`): the kernel images per architecture, the
//! module and function cache per device, the device facts (queried once per device), and
//! the one launch wrapper. The ops' CUDA forwards live beside the ops
//! (`gemv/cuda.rs`, `kv_cache/cuda.rs`, `kv_cache/attention_cuda.rs`, `nvfp4/dequant_cuda.rs`); this folder imports none
//! of them.

mod device;
mod images;
mod launch;

pub(crate) use device::{attribute, facts, override_facts};
pub(crate) use images::{Image, KernelFile};
pub(crate) use launch::{cuda_err, launch, module, Launch, Loaded};
