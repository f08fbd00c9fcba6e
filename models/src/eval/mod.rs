//! An evaluation that does not flatter: a quantized model against its BF16 source on
//! texts it was not calibrated on (perplexity, KL divergence and top-1 agreement of the
//! next-token distributions) and on short factual completions (greedy, first two words).
//! Driven by the `eval` binary; numbers in `docs/accuracy.md`.

pub mod metrics;
pub mod prompts;
pub mod runner;

pub use metrics::TextSums;
pub use prompts::{load_prompts, Prompt};
