#!/usr/bin/env bash
# Bounded fuzzing of the file readers (docs/reliability.md): each cargo-fuzz target for 10 s
# from its seeds. Was a step of .ci/run; run it by hand: scripts/fuzz-bounded.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# Bounded fuzzing of the file readers (docs/reliability.md): each cargo-fuzz target for
# 10 s from its seeds, 60 s of fuzzing in all. cargo-fuzz is installed once (kept in
# ~/.cargo/bin); only the stable toolchain is needed: RUSTC_BOOTSTRAP=1 lets it pass its
# -Z flags. The fuzz crate is its own workspace with its own target folder.
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz"
    cargo install cargo-fuzz --locked --version 0.13.2
fi
(
    cd fuzz
    export RUSTC_BOOTSTRAP=1
    export CARGO_TARGET_DIR="${CFP4_FUZZ_TARGET_DIR:-target}"
    cargo fuzz build
    mkdir -p logs
    for t in $(cargo fuzz list); do
        mkdir -p "corpus/$t"
        # -timeout: an input that runs 10 s is a hang (a failure); the outer timeout
        # bounds the step even if libFuzzer misbehaves.
        rc=0
        timeout 120 cargo fuzz run "$t" "corpus/$t" "seeds/$t" -- \
            -max_total_time=10 -max_len=65536 -timeout=10 -rss_limit_mb=4096 \
            -print_final_stats=1 >"logs/$t.log" 2>&1 || rc=$?
        echo "$t: $(grep -E '^stat::number_of_executed_units' "logs/$t.log" || echo 'no stats')"
        if [ "$rc" -ne 0 ]; then
            tail -n 60 "logs/$t.log"
            echo "fuzz target $t failed (exit $rc; the input is in fuzz/artifacts/$t)"
            exit 1
        fi
    done
)

