//! What the binaries (`llama_decode`, `perplexity`, `quantize`) share and the library does
//! not need: the command-line helpers ([`cli`]) and the SmolLM2 download ([`smollm2`], the
//! one place that runs an external program, `pip`). Each binary includes this module with
//! `mod common;` and uses a part of it.
#![allow(dead_code)]

pub mod cli;
pub mod smollm2;
