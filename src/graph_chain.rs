//! Arrival counters between the crate's kernels inside a captured CUDA graph.
//!
//! Under programmatic dependent launch each kernel of the decode step waits in
//! `griddepcontrol.wait` for the previous grid to *complete*. Inside a captured graph the
//! crate can do better between two of its own kernels: each CTA of the first releases an
//! arrival on a device counter when it is done, and the second polls the counter instead
//! of waiting for the grid's completion (`kernels/pdl.cuh`, `Dep`). The waits are planned
//! once, while the step is recorded: a kernel waits on the counter only when the capture's
//! one dependency is the previous launch of a kernel that arrives (anything else in
//! between, a cuBLAS matmul, a candle op, a memset, keeps `griddepcontrol.wait`).
//!
//! This module is the pure rule (`ChainPlan`); `ArrivalChain` (feature `cuda`, at the
//! crate root) arms it on a device's stream around a capture and owns the counters.
// Without the cuda feature only the tests use the rule.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// A launch that arrives on a counter: its node in the captured graph, its counter's slot
/// and its CTA count (the arrivals to wait for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Arrival {
    pub node: usize,
    pub slot: usize,
    pub ctas: u32,
}

/// What one launch does: wait on `(slot, ctas)` (else `griddepcontrol.wait`) and arrive on
/// `arrive` (else nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Planned {
    pub wait: Option<(usize, u32)>,
    pub arrive: Option<usize>,
}

/// The recording's state: counters handed out and the last launch that arrives. Pure: the
/// graph nodes are opaque numbers.
#[derive(Debug)]
pub(crate) struct ChainPlan {
    capacity: usize,
    next: usize,
    waits: usize,
    last: Option<Arrival>,
}

impl ChainPlan {
    /// A plan over `capacity` counters (each launch takes one; past them, launches neither
    /// arrive nor wait on a counter).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            next: 0,
            waits: 0,
            last: None,
        }
    }

    /// Before a launch whose only capture dependency is `only_dep` (`None`: none, or
    /// several): wait on the previous launch's counter when that launch is the one
    /// dependency and arrives; arrive on a fresh counter while any is left.
    pub(crate) fn plan(&mut self, only_dep: Option<usize>) -> Planned {
        let wait = match (self.last, only_dep) {
            (Some(a), Some(d)) if a.node == d => Some((a.slot, a.ctas)),
            _ => None,
        };
        self.waits += usize::from(wait.is_some());
        let arrive = (self.next < self.capacity).then(|| {
            self.next += 1;
            self.next - 1
        });
        Planned { wait, arrive }
    }

    /// After the launch planned as `p` of `ctas` CTAs, which became node `node` (the
    /// capture's one dependency now; `None` if the capture could not say).
    pub(crate) fn launched(&mut self, p: Planned, node: Option<usize>, ctas: u32) {
        self.last = match (node, p.arrive) {
            (Some(node), Some(slot)) if ctas > 0 => Some(Arrival { node, slot, ctas }),
            _ => None,
        };
    }

    /// Counters handed out so far.
    pub(crate) fn used(&self) -> usize {
        self.next
    }

    /// Launches planned to wait on a counter so far.
    pub(crate) fn waits(&self) -> usize {
        self.waits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three of the crate's kernels in a row: the second and third wait on their
    /// predecessor's counter; the first (nothing recorded before it) does not.
    #[test]
    fn consecutive_kernels_chain() {
        let mut c = ChainPlan::new(8);
        let a = c.plan(Some(100));
        assert_eq!(
            a,
            Planned {
                wait: None,
                arrive: Some(0)
            }
        );
        c.launched(a, Some(1), 132);
        let b = c.plan(Some(1));
        assert_eq!(
            b,
            Planned {
                wait: Some((0, 132)),
                arrive: Some(1)
            }
        );
        c.launched(b, Some(2), 384);
        let d = c.plan(Some(2));
        assert_eq!(d.wait, Some((1, 384)));
        assert_eq!((c.used(), c.waits()), (3, 2));
    }

    /// A foreign node (cuBLAS, a memset, a candle op) between two of the crate's kernels:
    /// the second keeps griddepcontrol.wait.
    #[test]
    fn a_foreign_node_breaks_the_chain() {
        let mut c = ChainPlan::new(8);
        let a = c.plan(None);
        c.launched(a, Some(1), 10);
        // The capture's dependency is now node 7 (recorded outside the crate's launches).
        let b = c.plan(Some(7));
        assert_eq!(b.wait, None);
        assert_eq!(b.arrive, Some(1));
        // Several dependencies (a fork joined): no counter either.
        c.launched(b, Some(8), 10);
        assert_eq!(c.plan(None).wait, None);
    }

    /// A launch the capture could not name, or of no CTA, is no one's predecessor.
    #[test]
    fn unknown_node_or_empty_grid_is_not_waited_on() {
        let mut c = ChainPlan::new(8);
        let a = c.plan(None);
        c.launched(a, None, 10);
        assert_eq!(c.plan(Some(0)).wait, None);
        let mut c = ChainPlan::new(8);
        let a = c.plan(None);
        c.launched(a, Some(3), 0);
        assert_eq!(c.plan(Some(3)).wait, None);
    }

    /// Past the capacity a launch neither arrives nor is waited on; the launch after it
    /// keeps griddepcontrol.wait.
    #[test]
    fn capacity_exhausted() {
        let mut c = ChainPlan::new(1);
        let a = c.plan(None);
        assert_eq!(a.arrive, Some(0));
        c.launched(a, Some(1), 4);
        let b = c.plan(Some(1));
        assert_eq!(
            b,
            Planned {
                wait: Some((0, 4)),
                arrive: None
            }
        );
        c.launched(b, Some(2), 4);
        let d = c.plan(Some(2));
        assert_eq!(
            d,
            Planned {
                wait: None,
                arrive: None
            }
        );
        assert_eq!(c.used(), 1);
    }
}
