//! The emulated cases of `tests/gemv_packed_emu.rs`: which kernel, shape and launch.

use candle_fp4::variants::{BwKind, PGEMV_BW_KERNELS};

/// Which kernel family a case runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Plain {
        nt: usize,
        u: usize,
    },
    Silu {
        nt: usize,
        u: usize,
    },
    Pair,
    Staged {
        u: usize,
    },
    Norm {
        silu: bool,
    },
    /// BF16 weights in their natural layout.
    Bw {
        kind: BwKind,
        u: usize,
    },
}

/// One case: the kernel, the shape, the launch, and what the prologue does.
#[derive(Clone, Debug)]
pub struct Case {
    pub kind: Kind,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub warps: usize,
    pub split: usize,
    /// Norm variants: a delta added to x (else none).
    pub delta: bool,
}

/// The cases: every kernel family on awkward shapes.
pub fn cases() -> Vec<Case> {
    let base = Case {
        kind: Kind::Plain { nt: 1, u: 3 },
        m: 1,
        n: 80,
        k: 320,
        warps: 4,
        split: 1,
        delta: false,
    };
    let p = |nt, u| Kind::Plain { nt, u };
    vec![
        Case {
            m: 3,
            ..base.clone()
        },
        Case {
            kind: p(1, 5),
            n: 48,
            k: 1088,
            warps: 2,
            split: 3,
            ..base.clone()
        },
        Case {
            kind: p(2, 3),
            m: 11,
            n: 40,
            k: 256,
            split: 2,
            ..base.clone()
        },
        Case {
            kind: p(4, 2),
            m: 27,
            n: 33,
            k: 192,
            warps: 3,
            ..base.clone()
        },
        Case {
            kind: Kind::Pair,
            m: 2,
            n: 41,
            k: 384,
            ..base.clone()
        },
        Case {
            kind: Kind::Silu { nt: 1, u: 3 },
            m: 5,
            n: 80,
            k: 192,
            warps: 3,
            ..base.clone()
        },
        Case {
            kind: Kind::Silu { nt: 2, u: 2 },
            m: 9,
            n: 96,
            k: 256,
            split: 2,
            ..base.clone()
        },
        Case {
            kind: Kind::Staged { u: 3 },
            n: 64,
            k: 640,
            split: 2,
            ..base.clone()
        },
        Case {
            kind: Kind::Staged { u: 5 },
            n: 32,
            k: 1088,
            warps: 2,
            ..base.clone()
        },
        // More shapes: after a split-K sum, with an odd pair tile, 27 tokens.
        Case {
            m: 4,
            split: 2,
            ..base.clone()
        },
        Case {
            kind: Kind::Pair,
            n: 41,
            k: 256,
            ..base.clone()
        },
        Case {
            kind: p(4, 2),
            m: 27,
            n: 48,
            k: 128,
            ..base.clone()
        },
        Case {
            kind: p(1, 5),
            m: 8,
            n: 40,
            k: 448,
            warps: 2,
            ..base.clone()
        },
        Case {
            kind: Kind::Staged { u: 5 },
            n: 48,
            k: 640,
            split: 2,
            ..base.clone()
        },
        // The norm prologue: x (+ delta) reduced in every CTA, with a split-K sum.
        Case {
            kind: Kind::Norm { silu: false },
            m: 3,
            n: 48,
            k: 512,
            delta: true,
            ..base.clone()
        },
        Case {
            kind: Kind::Norm { silu: true },
            m: 8,
            n: 64,
            k: 256,
            ..base.clone()
        },
        Case {
            kind: Kind::Norm { silu: false },
            m: 5,
            n: 48,
            k: 576,
            warps: 2,
            delta: true,
            ..base.clone()
        },
        Case {
            kind: Kind::Norm { silu: true },
            m: 1,
            n: 32,
            k: 1024,
            split: 2,
            ..base.clone()
        },
        // BF16 weights: row tails (N not a multiple of 16), splits, 8 tokens, odd pairs.
        Case {
            kind: bw(BwKind::Plain, 2),
            m: 3,
            n: 37,
            k: 576,
            warps: 3,
            ..base.clone()
        },
        Case {
            kind: bw(BwKind::Plain, 4),
            m: 8,
            n: 48,
            k: 1088,
            split: 3,
            warps: 2,
            ..base.clone()
        },
        Case {
            kind: bw(BwKind::Pair, 2),
            m: 1,
            n: 41,
            k: 384,
            ..base.clone()
        },
        Case {
            kind: bw(BwKind::Pair, 2),
            m: 6,
            n: 64,
            k: 256,
            split: 2,
            warps: 2,
            ..base.clone()
        },
        Case {
            kind: bw(BwKind::Silu, 2),
            m: 5,
            n: 70,
            k: 320,
            warps: 3,
            ..base.clone()
        },
        Case {
            kind: bw(BwKind::Silu, 2),
            m: 1,
            n: 96,
            k: 512,
            split: 2,
            ..base.clone()
        },
        Case {
            kind: bw(BwKind::Staged, 2),
            m: 1,
            n: 20,
            k: 448,
            warps: 2,
            ..base.clone()
        },
        Case {
            kind: bw(BwKind::Staged, 4),
            m: 1,
            n: 33,
            k: 1024,
            split: 2,
            warps: 3,
            ..base.clone()
        },
    ]
}

/// A case kind of the packed GEMV over BF16 weights.
fn bw(kind: BwKind, u: usize) -> Kind {
    assert!(
        PGEMV_BW_KERNELS.contains(&(kind, u)),
        "no kernel {kind:?} u{u}"
    );
    Kind::Bw { kind, u }
}
