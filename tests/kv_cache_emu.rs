//! Runs `kernels/ultraquant.cu` on the CPU through a host emulation and compares it with the
//! CPU reference: a GPU-less check of the kernels' indexing, fragment layouts and data flow
//! (see `tests/kv_cache_emu/emu.h` for what is emulated and how).
//!
//! Needs a C++20 compiler (`$CXX`, else `c++`); skipped with a message when there is none.
//! Ignored by default (about three minutes on two cores):
//! `cargo test --test kv_cache_emu -- --ignored --nocapture`.
//!
//! Cases: head_dim 64/128/256 × (kv_heads, group) ∈ {(3, 4), (2, 6), (1, 1), (4, 3), (2, 9)},
//! batch 2 with lengths 39 and 82 (prompts by `append_seq`, then two batch appends), splits
//! 1, 2 and 5 (merged by the combine kernel, and for 2 and 5 also by the attention kernel's
//! last CTA), UltraQuant and BF16 caches; the decode step's rope and append inside the
//! attention (BF16 cache; and on 6 of the cases an UltraQuant cache with an exact window of
//! 16 and 64 tokens, both ring orders, both merges) against the unfused launches, bit for
//! bit in outputs, rows, slots and lengths.

mod emu_common;
mod kv_cache_common;

use candle_core::{Device, Tensor};
use candle_fp4::kv_cache::{CacheShape, KvCache, KvCacheKind};
use half::bf16;
use kv_cache_common::*;
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::path::Path;

/// The kernel variant list build.rs generates the instantiations from.
#[allow(dead_code)]
mod variants {
    include!("../src/variants.rs");
}

fn write<T: Copy>(path: &Path, x: &[T]) {
    // SAFETY: plain-old-data slices (u8, u32, bf16) viewed as bytes.
    let bytes =
        unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) };
    std::fs::write(path, bytes).unwrap();
}

fn host<T: candle_core::WithDType>(t: &Tensor) -> Vec<T> {
    t.flatten_all().unwrap().to_vec1::<T>().unwrap()
}

/// Writes the cases (inputs of every append, CPU slots, read-back and attention outputs).
fn dump_cases(dir: &Path) {
    let cpu = Device::Cpu;
    let mut index = String::new();
    let mut id = 0;
    for d in [64usize, 128, 256] {
        for (kh, g) in [(3usize, 4usize), (2, 6), (1, 1), (4, 3), (2, 9)] {
            let sh = CacheShape {
                batch: 2,
                capacity: 100,
                kv_heads: kh,
                head_dim: d,
            };
            let mut rng = StdRng::seed_from_u64((d * 31 + kh * 7 + g) as u64);
            let mut uq = KvCache::new(KvCacheKind::UltraQuant, sh, &cpu).unwrap();
            let mut bf = KvCache::new(KvCacheKind::Bf16, sh, &cpu).unwrap();
            let p = |s: &str| dir.join(format!("c{id}_{s}.bin"));
            let mut calls = 0;
            let mut record = |uq: &KvCache,
                              k: &[bf16],
                              v: &[bf16],
                              seq_base: usize,
                              n_seq: usize,
                              tokens: usize| {
                let lens: Vec<u32> = uq.lens().iter().map(|&x| x as u32).collect();
                write(&p(&format!("call{calls}_k")), k);
                write(&p(&format!("call{calls}_v")), v);
                write(&p(&format!("call{calls}_lens")), &lens);
                index.push_str(&format!("call {id} {calls} {seq_base} {n_seq} {tokens}\n"));
                calls += 1;
            };
            for (b, n) in [37usize, 80].into_iter().enumerate() {
                let k = gaussian_bf16(&mut rng, n * kh * d, 2.0);
                let v = with_non_finite(gaussian_bf16(&mut rng, n * kh * d, 1.0), b, kh * d);
                record(&uq, &k, &v, b, 1, n);
                let t = |x: &[bf16]| Tensor::from_slice(x, (n, kh, d), &cpu).unwrap();
                uq.append_seq(b, &t(&k), &t(&v)).unwrap();
                bf.append_seq(b, &t(&k), &t(&v)).unwrap();
            }
            for _ in 0..2 {
                let k = gaussian_bf16(&mut rng, 2 * kh * d, 2.0);
                let v = gaussian_bf16(&mut rng, 2 * kh * d, 1.0);
                record(&uq, &k, &v, 0, 2, 1);
                let t = |x: &[bf16]| Tensor::from_slice(x, (2, 1, kh, d), &cpu).unwrap();
                uq.append(&t(&k), &t(&v)).unwrap();
                bf.append(&t(&k), &t(&v)).unwrap();
            }
            let q = gaussian_bf16(&mut rng, 2 * kh * g * d, 1.0);
            let qt = Tensor::from_slice(&q, (2, kh * g, d), &cpu).unwrap();
            write(&p("q"), &q);
            write(&p("ouq"), &host::<bf16>(&uq.decode_attention(&qt).unwrap()));
            write(&p("obf"), &host::<bf16>(&bf.decode_attention(&qt).unwrap()));
            let lens: Vec<u32> = uq.lens().iter().map(|&x| x as u32).collect();
            write(&p("lens"), &lens);
            let (KvCache::UltraQuant(u), KvCache::Bf16(b16)) = (&uq, &bf) else {
                unreachable!()
            };
            write(&p("slots"), &host::<u8>(&u.slots().unwrap()));
            write(&p("kvbf16"), &host::<bf16>(b16.storage()));
            let (rk, rv) = uq.read_bf16(1).unwrap();
            write(&p("rk"), &host::<bf16>(&rk));
            write(&p("rv"), &host::<bf16>(&rv));
            index.push_str(&format!("case {id} {d} {kh} {g} 2 100 {calls}\n"));
            id += 1;
        }
    }
    std::fs::write(dir.join("cases.txt"), index).unwrap();
}

/// Sequence 0's prompt V with a NaN (token 5) and a +∞ (token 9, last head): the store
/// must give both groups the NaN scale byte, bit for bit as the CPU encoder does.
fn with_non_finite(mut v: Vec<bf16>, seq: usize, row: usize) -> Vec<bf16> {
    if seq == 0 {
        v[5 * row + 3] = bf16::NAN;
        v[10 * row - 7] = bf16::INFINITY;
    }
    v
}

/// The kernel sources as one translation unit (kv_common.cuh, ultraquant_codec.cuh,
/// ultraquant.cu, kv_attention.cuh, kv_attention.cu, their includes of each other dropped), with the
/// inline-asm section cut out and the dynamic shared memory declaration pointed at the
/// emulator's buffer.
fn emulated_source() -> String {
    let common = include_str!("../kernels/kv_common.cuh");
    let (start, end) = (
        "// ---------------------------------------------------------------- PTX wrappers\n",
        "// ---------------------------------------------------------------- end of PTX wrappers\n",
    );
    let a = common.find(start).expect("PTX wrappers section start");
    let b = common.find(end).expect("PTX wrappers section end") + end.len();
    let src = [
        format!("{}{}", &common[..a], &common[b..]),
        include_str!("../kernels/ultraquant_codec.cuh").to_string(),
        include_str!("../kernels/ultraquant.cu").to_string(),
        include_str!("../kernels/kv_attention.cuh").to_string(),
        include_str!("../kernels/kv_attention.cu").to_string(),
    ]
    .join("\n");
    let out: String = src
        .lines()
        .filter(|l| {
            !l.starts_with("#include \"kv_common.cuh\"")
                && !l.starts_with("#include \"kv_attention.cuh\"")
                && !l.starts_with("#include \"ultraquant_codec.cuh\"")
                && !l.starts_with("#pragma once")
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let decl = "extern __shared__ __align__(16) uint8_t smem[];";
    assert!(
        out.contains(decl),
        "dynamic shared memory declaration changed"
    );
    out.replace(decl, "uint8_t* smem = emu_dyn_smem();")
}

#[test]
#[ignore = "about three minutes; run with --ignored"]
fn kernels_match_cpu_under_emulation() {
    let Some(cxx) = emu_common::cxx() else { return };
    let dir = emu_common::work_dir("kv_cache_emu", &[("ultraquant_emu.cu", &emulated_source())]);
    // The kernels' instantiations, generated from src/variants.rs as build.rs does.
    for stem in ["ultraquant", "kv_attention"] {
        let (name, text) = variants::instances(stem).unwrap();
        std::fs::write(dir.join(name), text).unwrap();
    }
    std::fs::write(
        dir.join("ultraquant.cuh"),
        include_str!("../kernels/ultraquant.cuh"),
    )
    .unwrap();
    std::fs::write(
        dir.join("rope_math.cuh"),
        include_str!("../kernels/rope_math.cuh"),
    )
    .unwrap();
    std::fs::write(
        dir.join("nvfp4_decode.cuh"),
        include_str!("kv_cache_emu/nvfp4_decode.cuh"),
    )
    .unwrap();
    // harness.cpp includes ultraquant_emu.cu.
    std::fs::write(
        dir.join("harness.cpp"),
        include_str!("kv_cache_emu/harness.cpp"),
    )
    .unwrap();
    dump_cases(&dir);
    emu_common::build_and_run(&cxx, &dir, &[]);
}
