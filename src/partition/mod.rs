//! Running on part of a GPU (the blocker and the planner's override: feature `cuda`), for
//! benchmarks: plan for `N` SMs and hold the
//! others with a blocker grid, so that a GPU with fewer SMs — or, with a higher planned
//! DRAM bandwidth, a GPU that asks more bytes of each SM — can be measured on the card at
//! hand. Not on any model path.
//!
//! Why: an H200 asks each of its 132 SMs for ~32 GB/s (4.24 TB/s of copy), an H100 for ~23
//! (3.02 TB/s); on 96 of its SMs an H100 asks ~31.5. A decode step's kernels cannot be put
//! in a green context from outside (candle builds its device on the primary context), so
//! `SmBlocker` keeps one CTA with all of an SM's shared memory resident on each SM to be
//! held — no other CTA fits beside it — until it is dropped, and `plan_for` makes every
//! planner that runs afterwards see the SMs left (and, if given, the DRAM bandwidth of the
//! card being imitated: the L2 prefetch rule reads it).

mod report;
pub use report::BlockerReport;

#[cfg(feature = "cuda")]
mod blocker;
#[cfg(feature = "cuda")]
pub use blocker::{device_sms, plan_for, SmBlocker};
