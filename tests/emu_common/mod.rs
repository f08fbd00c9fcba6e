//! The host emulation's build and run, shared by `tests/kv_cache_emu.rs` and
//! `tests/gemv_packed_emu.rs`: each writes its kernel sources, harness and cases into a
//! folder; this writes `emu.h` (and the fake `cuda_bf16.h`, `cp_async_emu.h`, and the
//! kernels' shared `cp_async.cuh` and `pdl.cuh`), compiles `harness.cpp` there with the C++
//! compiler (`$CXX`, else `c++`) and runs it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The C++ compiler, or `None` (the caller skips) when there is none.
pub fn cxx() -> Option<String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    match Command::new(&cxx).arg("--version").output() {
        Ok(_) => Some(cxx),
        Err(_) => {
            println!("skipped: no C++ compiler `{cxx}`");
            None
        }
    }
}

/// A fresh folder `name` under the test target's temporary directory holding `files`
/// (name, text): the sources and harness a test then builds with [`build_and_run`].
pub fn work_dir(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, text) in files {
        std::fs::write(dir.join(file), text).unwrap();
    }
    dir
}

/// Compiles `dir/harness.cpp` with `emu.h` and then each of `includes` forced in, runs it
/// in `dir` and returns its output; panics (the test fails) if either step fails.
pub fn build_and_run(cxx: &str, dir: &Path, includes: &[&str]) -> String {
    std::fs::create_dir_all(dir.join("inc")).unwrap();
    std::fs::write(dir.join("emu.h"), include_str!("../kv_cache_emu/emu.h")).unwrap();
    std::fs::write(dir.join("cp_async_emu.h"), include_str!("cp_async_emu.h")).unwrap();
    // The kernels' shared headers, which their sources include.
    std::fs::write(
        dir.join("cp_async.cuh"),
        include_str!("../../kernels/cp_async.cuh"),
    )
    .unwrap();
    std::fs::write(dir.join("pdl.cuh"), include_str!("../../kernels/pdl.cuh")).unwrap();
    std::fs::write(
        dir.join("inc/cuda_bf16.h"),
        include_str!("../kv_cache_emu/cuda_bf16.h"),
    )
    .unwrap();
    let mut cmd = Command::new(cxx);
    cmd.current_dir(dir).args([
        "-std=c++20",
        "-O1",
        "-ffp-contract=off",
        "-Wno-unknown-pragmas",
        "-include",
        "emu.h",
    ]);
    for inc in includes {
        cmd.args(["-include", inc]);
    }
    let status = cmd
        .args([
            "-I",
            "inc",
            "-I",
            ".",
            "-x",
            "c++",
            "harness.cpp",
            "-o",
            "emu",
            "-lpthread",
        ])
        .status()
        .unwrap();
    assert!(status.success(), "compiling the emulator failed");
    let out = Command::new(dir.join("emu"))
        .current_dir(dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    println!("{text}");
    assert!(
        out.status.success(),
        "the emulated kernels failed or differ from the CPU:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}
