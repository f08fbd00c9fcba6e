#!/usr/bin/env bash
# Tenth session's device runs (packed NVFP4 GEMV): $1 = tests | kernel | bench | all
# (kernel: the pgemv_bench harness and the W4A16 peers in one call; bench: gemv_cuda, which
# writes the tuned table, then decode_bench reading it).
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
rope)
    t gpu_rope 60
    t gpu_decode_graph 150
    t gpu_llama_tiny 120
    echo "== decode_bench (tables/sm90.json as built)"
    timeout 240 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1; echo "rc $?"
    tail -14 "$OUT/decode_bench.log"
    ;;
tests|all)
    t gpu_gemv_packed 150
    t gpu_decode_graph 150
    t gpu_llama_tiny 120
    ;;&
kernel|all)
    echo "== pgemv_bench"
    timeout 150 ./.carry/pgemv_bench > "$OUT/pgemv_bench.log" 2>&1; echo "rc $?"
    echo "== peers (8B shapes, then 70B shapes)"
    timeout 150 python3 .carry/w4a16_peers.py > "$OUT/peers_8b.log" 2>&1; echo "rc $?"
    cp "$OUT/w4a16_peers.json" "$OUT/w4a16_peers_8b.json" 2>/dev/null
    timeout 150 python3 .carry/w4a16_peers_70b.py > "$OUT/peers_70b.log" 2>&1; echo "rc $?"
    grep -E "\| 1 \|" "$OUT/pgemv_bench.log" | cut -c1-120
    grep -E "tinygemm_int4_g128 .* 1 " "$OUT/peers_8b.log" "$OUT/peers_70b.log" | grep -v "M="
    ;;&
bench|all)
    echo "== gemv_cuda (writes the tuned table $OUT/sm90.json)"
    timeout 300 ./.carry/gemv_cuda --bench > "$OUT/gemv_cuda.log" 2>&1; echo "rc $?"
    echo "== decode_bench (with the table just measured)"
    CANDLE_FP4_TABLES="$OUT" timeout 240 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1; echo "rc $?"
    grep -A200 "^| shape | M |" "$OUT/gemv_cuda.log" | grep -E "\| (1|8|32) \|" | cut -d'|' -f2-4,9-11 | head -60
    tail -14 "$OUT/decode_bench.log"
    ;;
esac
