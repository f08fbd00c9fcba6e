#!/usr/bin/env bash
# Seventeenth session's device runs: $@ = steps (kernel | check | bench | trace8b)
# kernel: the harness with the library's plan (staged kernel by stage_suits), the same
# binary without the staged kernel (CFP4_PGEMV_NOSTAGE=1), then the W4A16 peers (8B, 70B).
# check: $CHECK test binaries. bench: decode_bench. trace8b: ncu per kernel of the 8B step.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in ${@}; do case "$step" in
kernel)
    echo "== pgemv_bench (library plan), then without the staged kernel"
    timeout 150 ./.carry/pgemv_bench > "$OUT/pgemv_bench.log" 2>&1; echo "rc $?"
    CFP4_PGEMV_NOSTAGE=1 timeout 150 ./.carry/pgemv_bench > "$OUT/pgemv_bench_nostage.log" 2>&1; echo "rc $?"
    if [ -e .carry/w4a16_peers.py ]; then
        echo "== peers (8B shapes, then 70B shapes)"
        timeout 120 python3 .carry/w4a16_peers.py > "$OUT/peers_8b.log" 2>&1; echo "rc $?"
        timeout 120 python3 .carry/w4a16_peers_70b.py > "$OUT/peers_70b.log" 2>&1; echo "rc $?"
    fi
    for f in pgemv_bench pgemv_bench_nostage; do
        echo "-- $f"; grep -E "FAIL|copy|^\| (8B|70B|S |odd)" "$OUT/$f.log" | grep -E "FAIL|copy| (1|4|8) \|" | cut -c1-100
    done
    [ -e "$OUT/peers_8b.log" ] && grep -hE "^(tinygemm_int4_g128|cublas|torch).* (1|8) " "$OUT/peers_8b.log" "$OUT/peers_70b.log" | tail -40
    ;;
check)
    for b in ${CHECK:-gpu_gemv_packed gpu_decode_graph gpu_llama_tiny}; do t $b 200; done
    ;;
bench)
    echo "== decode_bench"
    timeout 400 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -24 "$OUT/decode_bench.log"
    ;;
trace8b)
    trace "8b nvfp4 b1 ctx512 kvbf16 graph" 8b
    ;;
esac; done
