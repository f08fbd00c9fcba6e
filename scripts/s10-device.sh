#!/usr/bin/env bash
# Tenth session's device runs (packed NVFP4 GEMV): $1 = tests | bench | all.
# Carry: .carry (xz-compressed test / bench binaries, the pgemv_bench harness, the peers
# scripts). Logs under $OUT; the summary lines here.
set -o pipefail
cd "$(dirname "$0")/.."
for f in .carry/*.xz; do [ -e "$f" ] && xz -dkf "$f" && chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t() { # one test binary: its log under $OUT, the summary lines here
    [ -x ".carry/$1" ] || { echo "== $1: not carried"; return; }
    echo "== $1"
    timeout "${2:-120}" ./.carry/$1 --test-threads=1 --nocapture 2>&1 | tee "$OUT/$1.log" \
        | grep -E "^test |test result|FAILED|panicked" | grep -v " ok$" | tail -12
}
case "$1" in
tests|all)
    t gpu_gemv_packed 150
    t gpu_decode_graph 150
    t gpu_llama_tiny 120
    t kv_cache_decode_append 60
    ;;&
bench|all)
    echo "== pgemv_bench"
    timeout 150 ./.carry/pgemv_bench > "$OUT/pgemv_bench.log" 2>&1; echo "rc $?"
    echo "== peers (8B shapes, then 70B shapes)"
    timeout 150 python3 .carry/w4a16_peers.py > "$OUT/peers_8b.log" 2>&1; echo "rc $?"
    cp "$OUT/w4a16_peers.json" "$OUT/w4a16_peers_8b.json" 2>/dev/null
    timeout 150 python3 .carry/w4a16_peers_70b.py > "$OUT/peers_70b.log" 2>&1; echo "rc $?"
    echo "== decode_bench"
    timeout 240 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1; echo "rc $?"
    grep -E "\| 1 \|" "$OUT/pgemv_bench.log" | cut -c1-120
    grep -E "tinygemm_int4_g128 .* 1 " "$OUT/peers_8b.log" "$OUT/peers_70b.log"
    tail -14 "$OUT/decode_bench.log"
    ;;
esac
