#!/usr/bin/env bash
# Ninth session's device runs (CUDA-graph decode): $1 = tests | bench | all.
# Carry: .carry (the xz-compressed test / bench binaries built here).
set -o pipefail
cd "$(dirname "$0")/.."
for f in .carry/*.xz; do xz -dkf "$f" && chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
t() { # one test binary: its log under $OUT, the summary lines here
    [ -x ".carry/$1" ] || { echo "== $1: not carried"; return; }
    echo "== $1"
    ./.carry/$1 --test-threads=1 --nocapture 2>&1 | tee "$OUT/$1.log" | grep -E "worst|agree|test result|FAILED|panicked" | tail -20
}
case "$1" in
tests|all)
    t kv_cache_decode_append
    t gpu_decode_graph
    t gpu_llama_tiny
    t kv_cache_gpu
    ;;&
bench|all)
    echo "== decode_bench"
    ./.carry/decode_bench --bench 2>&1 | tee "$OUT/decode_bench.log" | tail -16
    ;;
esac
