// The one list of compiled kernel variants and kernel images (docs: `mod variants` in
// lib.rs). Plain Rust with no imports and no inner attributes: build.rs and
// tests/kv_cache_emu.rs `include!` it.

/// Token tiles of the GEMV kernels: a tile `nt` covers `8·nt` tokens.
pub const GEMV_NTS: [usize; 3] = [1, 2, 4];

/// Thread-block cluster sizes that split K in the GEMV kernels (sm_90+ images; the sm_80
/// images have split 1 only).
pub const GEMV_SPLITS: [usize; 4] = [1, 2, 4, 8];

/// The four GEMV kernels per (tile, split): `(fp4, silu_mul)`.
pub const GEMV_KINDS: [(bool, bool); 4] =
    [(true, false), (true, true), (false, false), (false, true)];

/// Name of the GEMV kernel for NVFP4 (`fp4`) or BF16 weights, with or without the fused
/// `silu(gate)·up` epilogue, token tile `nt` and cluster split `split`.
pub fn gemv_kernel_name(fp4: bool, silu_mul: bool, nt: usize, split: usize) -> String {
    let tag = match (fp4, silu_mul) {
        (true, false) => "fp4",
        (true, true) => "fp4silu",
        (false, false) => "bf16",
        (false, true) => "bf16silu",
    };
    format!("cfp4_gemv_{tag}_nt{nt}_s{split}")
}

/// Token tiles of the packed-NVFP4 GEMV kernels (`kernels/gemv_packed.cu`): a tile `nt`
/// covers `8·nt` tokens.
pub const PGEMV_NTS: [usize; 3] = [1, 2, 4];

/// The packed-NVFP4 GEMV kernels: `(nt, silu_mul, u)`, `u` the K pairs (1 KB of codes per
/// tile) each warp keeps in flight in registers. Every `(nt, silu_mul)` has a kernel; the
/// plain one-tile kernel also comes deep (`u` = 5: on the H200 it took the 8B / 70B layers
/// with long per-warp runs from 58–78 % to 59–85 % of copy, but costs ~0.15 µs on
/// SmolLM2's one-pair runs, docs/benchmarks.md, twelfth session); 5 pairs spill in the
/// two-tile kernels.
pub const PGEMV_KERNELS: [(usize, bool, usize); 7] = [
    (1, false, 3),
    (1, false, 5),
    (1, true, 3),
    (2, false, 3),
    (2, true, 2),
    (4, false, 2),
    (4, true, 2),
];

/// Pairs in flight (`u`) of the packed-NVFP4 pair kernel: plain, one token tile, each
/// CTA group two adjacent row tiles fed by one x fragment. On the H200 it took the 70B
/// down_proj from 78 to 87 % of copy and the 8B lm_head from 85 to 91 %, and lost where the
/// grid has fewer than ~3.5 row tiles per SM (docs/benchmarks.md, sixteenth session;
/// `pair_suits`); `u` = 4 was slower and 5 spills.
pub const PGEMV_PAIR_U: usize = 3;

/// Name of the packed-NVFP4 pair kernel (plain, one token tile, two row tiles per group).
pub fn pgemv_pair_kernel_name(u: usize) -> String {
    format!("cfp4_pgemv_fp4pair_nt1_u{u}")
}

/// The packed-NVFP4 GEMV kernels with the RMSNorm prologue (the decode step's q|k|v and
/// gate|up take the residual stream and the norm in front of them, so the step runs no
/// norm kernel): `(nt, silu_mul, u)`, one token tile (up to 8 tokens).
pub const PGEMV_NORM_KERNELS: [(usize, bool, usize); 2] = [(1, false, 3), (1, true, 3)];

/// Depths `u` of the packed-NVFP4 staged kernels: plain, one token tile, one row tile per
/// group, each CTA copying the x rows of its K slice into shared memory before its main
/// loop (cp.async, read back with `ld.shared`). One per depth of the plain one-tile kernel,
/// so the planner keeps its depth choice and only swaps where x comes from
/// (`geometry::stage_suits`). On the H200 (sixteenth session, M = 1) it took the 8B
/// down_proj from 13.29 to 11.73 µs and SmolLM2's GEMVs 6–9 % faster, and lost 3 % on the
/// 8B q|k|v (384 CTAs, 3 per SM).
pub const PGEMV_STAGED_U: [usize; 2] = [3, 5];

/// Name of the packed-NVFP4 staged kernel (x of the CTA's K slice in shared memory).
pub fn pgemv_staged_kernel_name(u: usize) -> String {
    format!("cfp4_pgemv_fp4xs_nt1_u{u}")
}

/// Name of the packed-NVFP4 GEMV kernel with the RMSNorm prologue.
pub fn pgemv_norm_kernel_name(silu_mul: bool, nt: usize, u: usize) -> String {
    let tag = if silu_mul { "fp4silu" } else { "fp4" };
    format!("cfp4_pgemv_{tag}norm_nt{nt}_u{u}")
}

/// Name of the packed-NVFP4 GEMV kernel with or without the `silu(gate)·up` epilogue,
/// token tile `nt` and `u` pairs in flight.
pub fn pgemv_kernel_name(silu_mul: bool, nt: usize, u: usize) -> String {
    let tag = if silu_mul { "fp4silu" } else { "fp4" };
    format!("cfp4_pgemv_{tag}_nt{nt}_u{u}")
}

/// The depths `u` of the packed kernels for `(nt, silu_mul)`, deepest first.
pub fn pgemv_depths(nt: usize, silu_mul: bool) -> Vec<usize> {
    let mut us: Vec<usize> = PGEMV_KERNELS
        .iter()
        .filter(|&&(n, s, _)| n == nt && s == silu_mul)
        .map(|&(_, _, u)| u)
        .collect();
    us.sort_unstable_by(|a, b| b.cmp(a));
    us
}

/// Kinds of the packed GEMV kernel over BF16 weights in their natural `[N, K]` layout
/// (`kernels/gemv_packed.cu`, "BF16 weights"): one token tile (up to 8 tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwKind {
    /// One row tile per CTA group, x read from global memory.
    Plain,
    /// Two adjacent row tiles per group fed by one x fragment.
    Pair,
    /// `silu(gate)·up` over a `[gate | up]` weight.
    Silu,
    /// Plain, with the CTA's K slice of x copied into shared memory first.
    Staged,
}

/// The packed GEMV kernels over BF16 weights: `(kind, u)`, `u` the 64-wide K chunks (2 KB
/// per row tile) each warp keeps in flight in registers.
/// Each plain depth has its staged twin (the planner keeps the depth and swaps where x is
/// read, as for NVFP4).
pub const PGEMV_BW_KERNELS: [(BwKind, usize); 6] = [
    (BwKind::Plain, 2),
    (BwKind::Plain, 4),
    (BwKind::Pair, 2),
    (BwKind::Silu, 2),
    (BwKind::Staged, 2),
    (BwKind::Staged, 4),
];

/// Name of a packed GEMV kernel over BF16 weights.
pub fn pgemv_bw_kernel_name(kind: BwKind, u: usize) -> String {
    let tag = match kind {
        BwKind::Plain => "bf16",
        BwKind::Pair => "bf16pair",
        BwKind::Silu => "bf16silu",
        BwKind::Staged => "bf16xs",
    };
    format!("cfp4_pgemv_{tag}_nt1_u{u}")
}

/// Decode-attention kernels: `(fp4, head_dim, query-head tiles nt)`; a tile serves `4·nt`
/// query heads of one KV head. `fp4` = UltraQuant slots, else BF16 K/V.
pub const KV_ATTN: [(bool, usize, &[usize]); 8] = [
    (true, 64, &[1, 2]),
    (true, 128, &[1, 2]),
    (true, 256, &[1]),
    (false, 64, &[1, 2]),
    (false, 80, &[1, 2]),
    (false, 96, &[1, 2]),
    (false, 128, &[1, 2]),
    (false, 256, &[1]),
];

/// Name of a decode-attention kernel.
pub fn kv_attn_kernel_name(fp4: bool, head_dim: usize, nt: usize) -> String {
    let tag = if fp4 { "uq" } else { "bf16" };
    format!("cfp4_kv_attn_{tag}_d{head_dim}_nt{nt}")
}

/// The head_dims with decode-attention kernels for UltraQuant (`fp4`) or BF16 caches (the
/// UltraQuant store / read-back kernels exist for the UltraQuant ones).
pub fn kv_head_dims(fp4: bool) -> impl Iterator<Item = usize> {
    KV_ATTN
        .iter()
        .filter(move |(f, _, _)| *f == fp4)
        .map(|(_, d, _)| *d)
}

/// Whether decode attention has a kernel for `(fp4, head_dim, nt)`.
pub fn kv_attn_has(fp4: bool, head_dim: usize, nt: usize) -> bool {
    KV_ATTN
        .iter()
        .any(|(f, d, nts)| *f == fp4 && *d == head_dim && nts.contains(&nt))
}

/// One compiled form of every kernel file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Image {
    /// Hopper (H100/H200): what runs on the measured GPU.
    Sm90aCubin,
    /// Blackwell B200/GB200 (hardware E2M1 convert); assembled, not run here.
    Sm100aCubin,
    /// Ampere/Ada (A100, RTX 30xx/40xx): no clusters, no PDL.
    Sm80Cubin,
    /// JIT fallback for other GPUs of compute capability ≥ 9.0.
    Compute90Ptx,
    /// The sm_80 code as PTX, so a Hopper can run that variant in tests.
    Compute80Ptx,
}

impl Image {
    /// Every image, in build order.
    pub const ALL: [Image; 5] = [
        Image::Sm90aCubin,
        Image::Sm100aCubin,
        Image::Sm80Cubin,
        Image::Compute90Ptx,
        Image::Compute80Ptx,
    ];

    /// File-name suffix of the image (`<stem>_<suffix>` in `$OUT_DIR`).
    pub fn suffix(self) -> &'static str {
        match self {
            Image::Sm90aCubin => "sm90a.cubin",
            Image::Sm100aCubin => "sm100a.cubin",
            Image::Sm80Cubin => "sm80.cubin",
            Image::Compute90Ptx => "compute90.ptx",
            Image::Compute80Ptx => "compute80.ptx",
        }
    }

    /// nvcc's `-gencode` for the image.
    pub fn gencode(self) -> &'static str {
        match self {
            Image::Sm90aCubin => "-gencode=arch=compute_90a,code=sm_90a",
            Image::Sm100aCubin => "-gencode=arch=compute_100a,code=sm_100a",
            Image::Sm80Cubin => "-gencode=arch=compute_80,code=sm_80",
            Image::Compute90Ptx => "-gencode=arch=compute_90,code=compute_90",
            Image::Compute80Ptx => "-gencode=arch=compute_80,code=compute_80",
        }
    }

    /// Whether the image is PTX text (JIT-compiled at load) rather than a cubin.
    pub fn is_ptx(self) -> bool {
        matches!(self, Image::Compute90Ptx | Image::Compute80Ptx)
    }

    /// Whether the image has clusters and PDL (sm_90+ code).
    pub fn has_sm90_features(self) -> bool {
        !matches!(self, Image::Sm80Cubin | Image::Compute80Ptx)
    }

    /// The image a device of compute capability `(major, minor)` loads (`sm80` = the sm_80
    /// code path asked for explicitly), or `None` below sm_80.
    pub fn for_device(cc: (i32, i32), sm80: bool) -> Option<Image> {
        if cc.0 < 8 {
            return None;
        }
        Some(match (sm80, cc) {
            (true, _) => Image::Compute80Ptx,
            (false, (9, 0)) => Image::Sm90aCubin,
            (false, (10, 0)) => Image::Sm100aCubin,
            (false, (8, _)) => Image::Sm80Cubin,
            (false, _) => Image::Compute90Ptx,
        })
    }
}

/// The `extern "C"` GEMV kernels of `kernels/gemv.cu` (`$OUT_DIR/gemv_instances.inc`): one
/// `CFP4_GEMV(NT, SPLIT, SILU, FP4, NAME)` per variant, splits > 1 under `CFP4_CLUSTERS`.
pub fn gemv_instances() -> String {
    let mut s = String::from("// generated by build.rs from src/variants.rs\n");
    for nt in GEMV_NTS {
        for (fp4, silu) in GEMV_KINDS {
            for split in GEMV_SPLITS {
                let name = gemv_kernel_name(fp4, silu, nt, split);
                let line = format!("CFP4_GEMV({nt}, {split}, {silu}, {fp4}, {name})\n");
                if split > 1 {
                    s += &format!("#if CFP4_CLUSTERS\n{line}#endif\n");
                } else {
                    s += &line;
                }
            }
        }
    }
    s
}

/// Warps per CTA of the packed NVFP4 GEMV (a launch parameter; the kernel's shared
/// reduction is sized for the largest, `MAX_WARPS` in `kernels/gemv_packed.cu`).
pub const PGEMV_WARPS: std::ops::RangeInclusive<usize> = 2..=8;

/// The `extern "C"` kernels of `kernels/gemv_packed.cu`
/// (`$OUT_DIR/gemv_packed_instances.inc`): one `CFP4_PGEMV(NT, SILU, U, XS, NAME)` per
/// variant (`XS`: where x is read, `Global`, `Norm` or `Staged`), and `CFP4_PGEMV_PAIR(U, NAME)` for the pair kernel.
pub fn pgemv_instances() -> String {
    let mut s = String::from("// generated by build.rs from src/variants.rs\n");
    // Included twice: first with CFP4_PGEMV_CONFIG defined (the warp range), then for the
    // instantiations.
    s += &format!(
        "#ifdef CFP4_PGEMV_CONFIG\nconstexpr int MAX_WARPS = {};\n#else\n",
        PGEMV_WARPS.end()
    );
    for (nt, silu, u) in PGEMV_KERNELS {
        let name = pgemv_kernel_name(silu, nt, u);
        s += &format!("CFP4_PGEMV({nt}, {silu}, {u}, Global, {name})\n");
    }
    for (nt, silu, u) in PGEMV_NORM_KERNELS {
        let name = pgemv_norm_kernel_name(silu, nt, u);
        s += &format!("CFP4_PGEMV({nt}, {silu}, {u}, Norm, {name})\n");
    }
    for u in PGEMV_STAGED_U {
        let name = pgemv_staged_kernel_name(u);
        s += &format!("CFP4_PGEMV(1, false, {u}, Staged, {name})\n");
    }
    s += &format!(
        "CFP4_PGEMV_PAIR({PGEMV_PAIR_U}, {})\n",
        pgemv_pair_kernel_name(PGEMV_PAIR_U)
    );
    for (kind, u) in PGEMV_BW_KERNELS {
        let (silu, pair, xs) = match kind {
            BwKind::Plain => (false, false, "Global"),
            BwKind::Pair => (false, true, "Global"),
            BwKind::Silu => (true, false, "Global"),
            BwKind::Staged => (false, false, "Staged"),
        };
        let name = pgemv_bw_kernel_name(kind, u);
        s += &format!("CFP4_PGEMV_BW(1, {silu}, {pair}, {u}, {xs}, {name})\n");
    }
    s + "#endif\n"
}

/// Position of `(fp4, head_dim, nt)` in the configuration table that
/// `cfp4_kv_attn_configs` writes (`[warps, dynamic shared bytes]` per kernel).
pub fn kv_attn_index(fp4: bool, head_dim: usize, nt: usize) -> Option<usize> {
    KV_ATTN
        .iter()
        .flat_map(|(f, d, nts)| nts.iter().map(move |n| (*f, *d, *n)))
        .position(|v| v == (fp4, head_dim, nt))
}

/// Number of decode-attention kernels.
pub fn kv_attn_count() -> usize {
    KV_ATTN.iter().map(|(_, _, nts)| nts.len()).sum()
}

/// The `extern "C"` store / read-back kernels of `kernels/ultraquant.cu`
/// (`$OUT_DIR/ultraquant_instances.inc`): `CFP4_UQ_FORMAT(D)` per UltraQuant head_dim.
pub fn uq_format_instances() -> String {
    let mut s = String::from("// generated by build.rs from src/variants.rs\n");
    for d in kv_head_dims(true) {
        s += &format!("CFP4_UQ_FORMAT({d})\n");
    }
    s
}

/// The `extern "C"` kernels of `kernels/kv_attention.cu`
/// (`$OUT_DIR/kv_attention_instances.inc`): every attention kernel
/// (`CFP4_KV_ATTN(FP4, NAME, D, NT)`), and `cfp4_kv_attn_configs(int* out)`, which writes each
/// one's warps and dynamic shared memory from its `Cfg` at [`kv_attn_index`] (so the host
/// never restates `Cfg`).
pub fn kv_attn_instances() -> String {
    let mut s = String::from("// generated by build.rs from src/variants.rs\n");
    let mut cfg = String::new();
    for (fp4, d, nts) in KV_ATTN {
        for &nt in nts {
            let name = kv_attn_kernel_name(fp4, d, nt);
            s += &format!("CFP4_KV_ATTN({fp4}, {name}, {d}, {nt})\n");
            let i = kv_attn_index(fp4, d, nt).unwrap_or(0);
            cfg += &format!(
                "    out[{}] = Cfg<{fp4}, {d}, {nt}>::NW;\n    out[{}] = Cfg<{fp4}, {d}, {nt}>::SMEM;\n",
                2 * i,
                2 * i + 1
            );
        }
    }
    s += "extern \"C\" __global__ void cfp4_kv_attn_configs(int* out) {\n";
    s += "    if (threadIdx.x != 0 || blockIdx.x != 0) return;\n";
    s += &cfg;
    s += "}\n";
    s
}

/// The generated instantiation file of `kernels/<stem>.cu`, `(file name, text)`, for the
/// kernel files that have one.
pub fn instances(stem: &str) -> Option<(&'static str, String)> {
    match stem {
        "gemv" => Some(("gemv_instances.inc", gemv_instances())),
        "gemv_packed" => Some(("gemv_packed_instances.inc", pgemv_instances())),
        "ultraquant" => Some(("ultraquant_instances.inc", uq_format_instances())),
        "kv_attention" => Some(("kv_attention_instances.inc", kv_attn_instances())),
        _ => None,
    }
}
