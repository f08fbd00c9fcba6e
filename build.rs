//! Compiles the CUDA kernels under `kernels/` with nvcc when the `cuda` feature is on.
//!
//! Every `kernels/*.cu` is built into these images (embedded by `src/cuda/images.rs`):
//! * `sm90a.cubin`  — Hopper (H100/H200), what runs here;
//! * `sm100a.cubin` — Blackwell B200/GB200 (hardware E2M1 convert); assembled, not run here;
//! * `sm80.cubin`   — Ampere/Ada (A100, RTX 30xx/40xx): no clusters, no PDL;
//! * `compute90.ptx` — JIT fallback for other GPUs of compute capability ≥ 9.0;
//! * `compute80.ptx` — the sm_80 code as PTX, so a Hopper can run that variant in tests.
//!
//! nvcc is `$CUDA_PATH/bin/nvcc` (or `$CUDA_HOME`), else `nvcc` on `PATH`.

use std::path::{Path, PathBuf};
use std::process::Command;

const IMAGES: [(&str, &str, &str); 5] = [
    (
        "sm90a.cubin",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-cubin",
    ),
    (
        "sm100a.cubin",
        "-gencode=arch=compute_100a,code=sm_100a",
        "-cubin",
    ),
    (
        "sm80.cubin",
        "-gencode=arch=compute_80,code=sm_80",
        "-cubin",
    ),
    (
        "compute90.ptx",
        "-gencode=arch=compute_90,code=compute_90",
        "-ptx",
    ),
    (
        "compute80.ptx",
        "-gencode=arch=compute_80,code=compute_80",
        "-ptx",
    ),
];

fn nvcc() -> PathBuf {
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        if let Ok(root) = std::env::var(var) {
            let p = Path::new(&root).join("bin").join("nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    PathBuf::from("nvcc")
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = nvcc();
    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("kernels/ must exist")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let mut jobs = Vec::new();
    for src in &sources {
        let stem = src.file_stem().unwrap().to_string_lossy().to_string();
        for (suffix, gencode, kind) in IMAGES {
            let out = out_dir.join(format!("{stem}_{suffix}"));
            let mut cmd = Command::new(&nvcc);
            cmd.args([gencode, kind, "-O3", "-std=c++17", "-Ikernels", "-o"])
                .arg(&out)
                .arg(src);
            jobs.push((format!("{} -> {stem}_{suffix}", src.display()), cmd));
        }
    }
    // Run the nvcc jobs two at a time (the build machines have 2 cores).
    let par = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .max(1);
    let mut failures = Vec::new();
    for batch in jobs.chunks_mut(par) {
        let handles: Vec<_> = batch
            .iter_mut()
            .map(|(what, cmd)| {
                let child = cmd
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn();
                (what.clone(), child)
            })
            .collect();
        for (what, child) in handles {
            match child.and_then(|c| c.wait_with_output()) {
                Ok(o) if o.status.success() => {}
                Ok(o) => failures.push(format!("{what}:\n{}", String::from_utf8_lossy(&o.stderr))),
                Err(e) => failures.push(format!("{what}: cannot run {}: {e}", nvcc.display())),
            }
        }
    }
    if !failures.is_empty() {
        panic!("nvcc failed:\n{}", failures.join("\n"));
    }
}
