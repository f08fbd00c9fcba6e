#!/usr/bin/env bash
# Twentieth session's device runs: $@ = steps (ws | check | peers | abbin | bench)
# ws: the packed-GEMV harness with the warp-specialized kernels (CFP4_PGEMV_WS=1; needs
#   docs/logs/s21/ws-library.patch applied, then scripts/proto/build-pgemv-bench.sh) on
#   $WS_SHAPES (default: the 8B / 70B plain layers and SmolLM2's), M = 1, 4, 8, 16, 32.
# check: $CHECK test binaries. bench: decode_bench. peers: the W4A16 peers (device-common.sh).
# abbin: rows $AB_ROWS (';'-separated) from the carried decode_bench (main) and
#   decode_bench_new (this tree), $AB_ROUNDS alternating rounds; logs in abbin-logs.tar.xz.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in ${@}; do case "$step" in
ws)
    echo "== pgemv_bench ws"
    CFP4_PGEMV_WS=1 CFP4_PGEMV_ONLY="${WS_SHAPES:-8B qkv,8B o,8B down,8B lm_head,70B qkv,70B o,70B down,S qkv,S o,S down,odd}" \
        timeout 400 ./.carry/pgemv_bench > "$OUT/pgemv_ws.log" 2>&1
    echo "rc $?"; grep -E "^copy|^\| (8B|70B|S |odd)|ws \(|FAIL|failures" "$OUT/pgemv_ws.log" | grep -E " 1 \||ws|copy|FAIL|failures" | head -60
    ;;
check)
    for b in ${CHECK:-gpu_gemv_packed gpu_decode_graph gpu_llama_tiny}; do t $b 200; done
    ;;
abbin)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_binaries
    ;;
peers)
    peers
    ;;
bench)
    echo "== decode_bench"
    timeout 400 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -24 "$OUT/decode_bench.log"
    ;;
esac; done
