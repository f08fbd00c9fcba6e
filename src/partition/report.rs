//! What the blocker's CTAs report through their slots (pure: decoded on the host).

/// Slot bit: the CTA saw the release.
pub(crate) const RELEASED: u32 = 1 << 30;
/// Slot bit: the CTA left at its time limit.
pub(crate) const TIMED_OUT: u32 = 1 << 31;

/// What the blocker's CTAs reported: the SM each sat on, and whether any left before it
/// was released (then the measurement it covered ran on more SMs than planned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockerReport {
    /// The SM of each CTA that started (`%smid`).
    pub sms: Vec<u32>,
    /// CTAs that gave up at their time limit.
    pub timed_out: usize,
    /// CTAs that saw the release.
    pub released: usize,
}

impl BlockerReport {
    /// Decodes the CTAs' slot words: 0 (not started), or `smid + 1` with `RELEASED` (1 << 30) or
    /// `TIMED_OUT` (1 << 31) set when the CTA left.
    pub fn from_slots(slots: &[u32]) -> Self {
        let mut r = BlockerReport {
            sms: vec![],
            timed_out: 0,
            released: 0,
        };
        for &v in slots.iter().filter(|&&v| v != 0) {
            r.sms.push((v & !(RELEASED | TIMED_OUT)).saturating_sub(1));
            r.timed_out += usize::from(v & TIMED_OUT != 0);
            r.released += usize::from(v & RELEASED != 0);
        }
        r
    }

    /// Every CTA started, on distinct SMs, and none has left on its own.
    pub fn holds(&self, ctas: usize) -> bool {
        let mut s = self.sms.clone();
        s.sort_unstable();
        s.dedup();
        s.len() == ctas && self.sms.len() == ctas && self.timed_out == 0
    }
}

#[cfg(test)]
mod tests {
    use super::{BlockerReport, RELEASED, TIMED_OUT};

    #[test]
    fn a_blocker_holds_only_distinct_sms_and_no_timeouts() {
        let r = |sms: Vec<u32>, timed_out| BlockerReport {
            sms,
            timed_out,
            released: 0,
        };
        assert!(r(vec![3, 0, 7], 0).holds(3));
        assert!(!r(vec![3, 0, 3], 0).holds(3)); // two CTAs on one SM
        assert!(!r(vec![3, 0], 0).holds(3)); // one never started
        assert!(!r(vec![3, 0, 7], 1).holds(3)); // one left on its own
    }

    #[test]
    fn slots_decode_as_the_blocker_writes_them() {
        // The PTX ORs -2147483648 and 1073741824 into `smid + 1`.
        assert_eq!((TIMED_OUT, RELEASED), (0x8000_0000, 0x4000_0000));
        let r = BlockerReport::from_slots(&[0, 125, 1 | RELEASED, 9 | TIMED_OUT, 0]);
        assert_eq!(r.sms, vec![124, 0, 8]);
        assert_eq!((r.released, r.timed_out), (1, 1));
        assert!(!r.holds(3)); // a timeout
        let r = BlockerReport::from_slots(&[125, 1, 9]);
        assert!(r.holds(3) && r.released == 0);
        assert!(!r.holds(4)); // one of four never wrote its slot
    }
}
