#!/usr/bin/env bash
# Thirty-first session's device runs: $@ = steps; run through scripts/s31-call.sh (STEPS=...).
# bw: scripts/proto/bgemv_bench (carried as .carry/bgemv_bench): the packed GEMV kernel over
#   BF16 weights in their natural layout, swept over variants, warps and splits, against
#   cuBLAS and gemv.cu's BF16 kernel, 8B / 70B / SmolLM2 shapes, M = 1 and 8, spacer protocol.
# bwab: decode_bench's all-BF16 8B rows (b1, b8) three ways, alternating: the default (the
#   shipped table: q|k|v, o, down on cuBLAS, gate|up on the BF16 kernel, now the BW one), the
#   thirtieth session's path (CFP4_DECODE_BF16_LEGACY=1: gate|up on gemv.cu's kernel), and the
#   candidate table .carry/sm90-bw.json (every 8B/70B BF16 projection on the BW kernel).
# bwcheck: the GPU test of the BF16-weight kernels (.carry/gpu_gemv_bf16). ngcheck:
#   gpu_norm_gemv (its prefetch test's table entries fixed).
# tune: the table (8B, 70B and their TP-2 shards, SmolLM2) into $OUT/sm90.json, BF16 rows now
#   timing the BW kernel up to 8 tokens. bench31: decode_bench's table with $OUT/sm90.json when
#   tune wrote it.
# Any other step is scripts/s30-device.sh's (and through it s29's, ...).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in "$@"; do case "$step" in
bw)
    echo "== bgemv_bench"
    timeout "${BW_TIMEOUT:-300}" ./.carry/bgemv_bench > "$OUT/bgemv_bench.log" 2>&1; echo "rc $?"
    grep -E "^copy|^\||mismatch" "$OUT/bgemv_bench.log"
    ;;
bw2)
    # The sweep printed in full (M = 1), with the spacer and back to back (tune's protocol).
    echo "== bgemv_bench (spacer)"
    timeout 200 ./.carry/bgemv_bench > "$OUT/bgemv_bench-spacer.log" 2>&1; echo "rc $?"
    grep -E "^copy|^\| (8B|70B)" "$OUT/bgemv_bench-spacer.log" | cut -c1-120
    echo "== bgemv_bench (back to back)"
    CFP4_BW_NO_SPACER=1 timeout 200 ./.carry/bgemv_bench > "$OUT/bgemv_bench-b2b.log" 2>&1; echo "rc $?"
    grep -E "^copy|^\| (8B|70B)" "$OUT/bgemv_bench-b2b.log" | cut -c1-120
    ;;
bwab)
    AB_ROWS="${AB_ROWS:-8b bf16 b1 ctx512 kvbf16 graph;8b bf16 b8 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows bwab "decode_bench CFP4_DECODE_BF16_LEGACY=1" decode_bench \
        "decode_bench CANDLE_FP4_TABLES=.carry/sm90-bw.json"
    pack_logs bwab
    ;;
bwcheck)
    t gpu_gemv_bf16 200
    ;;
ngcheck)
    t gpu_norm_gemv 200
    ;;
tune)
    echo "== tune (8B and 70B with their tensor-parallel-2 shards, SmolLM2)"
    timeout 240 ./.carry/tune --config tests/data/configs/llama-3.1-8b.json \
        --config tests/data/configs/llama-3.1-70b.json --tp 2 \
        --shapes 960x576,576x576,3072x576s,576x1536,49152x576 --ms 1,2,4,6,8,12,16,24,32 \
        --out "$OUT/sm90.json" > "$OUT/tune.log" 2>&1; echo "rc $?"
    grep -E "m= (1|8):" "$OUT/tune.log" | cut -c1-150
    ;;
bench31)
    [ -s "$OUT/sm90.json" ] && export CANDLE_FP4_TABLES="$OUT"
    echo "== decode_bench (tables: ${CANDLE_FP4_TABLES:-built in})"
    timeout 300 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -26 "$OUT/decode_bench.log"
    ;;
*)
    bash scripts/s30-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
