#!/usr/bin/env bash
# Thirty-third session's device runs: $@ = steps; run through scripts/s33-call.sh (STEPS=...).
# tunefull: the whole table (8B, 70B, their TP-2 shards, SmolLM2; every M) with the BF16
#   rows planned by the fitted rule (tune --bw-fitted-rule) into $OUT/sm90.json.
# tl: the timeline builds of the harnesses (.carry/pgemv_bench-tl, bgemv_bench-tl).
# benchfit: decode_bench --bench with the fitted rule (CFP4_DECODE_BW_FITTED_RULE=1) and
#   $OUT/sm90.json where tunefull wrote it.
# Any other step is scripts/s32-device.sh's (bwab2, tunefit; through it s31's bwcheck, bw2,
# tune, bench31, ...). DEADLINE_S: steps that would start later are skipped.
set -o pipefail
cd "$(dirname "$0")/.."
for step in "$@"; do
if [ "$SECONDS" -gt "${DEADLINE_S:-100000}" ]; then echo "== $step: skipped (deadline)"; continue; fi
case "$step" in
tunefull)
    echo "== tune --bw-fitted-rule (8B and 70B with their tensor-parallel-2 shards, SmolLM2)"
    timeout 240 ./.carry/tune --config tests/data/configs/llama-3.1-8b.json \
        --config tests/data/configs/llama-3.1-70b.json --tp 2 \
        --shapes 960x576,576x576,3072x576s,576x1536,49152x576 --ms 1,2,4,6,8,12,16,24,32 \
        --bw-fitted-rule --out "$OUT/sm90.json" > "$OUT/tune.log" 2>&1; echo "rc $?"
    grep -E "m= (1|8):" "$OUT/tune.log" | cut -c1-150
    ;;
benchfit)
    [ -s "$OUT/sm90.json" ] && export CANDLE_FP4_TABLES="$OUT"
    echo "== decode_bench, fitted BF16 rule (tables: ${CANDLE_FP4_TABLES:-built in})"
    CFP4_DECODE_BW_FITTED_RULE=1 timeout 300 ./.carry/decode_bench --bench \
        > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -26 "$OUT/decode_bench.log"
    ;;
tl)
    # Per-warp %globaltimer stamps of the planned NVFP4 kernel (M = 1, spacer protocol) and
    # of the best BF16-weight configuration: where a GEMV's fixed cost goes.
    echo "== pgemv_bench-tl (NVFP4, M = 1, spacers)"
    CFP4_PGEMV_SPACER=1 CFP4_PGEMV_M1=1 CFP4_PGEMV_ONLY="8B qkv,8B o,8B gate|up,8B down,70B qkv,70B o,70B down" \
        timeout 120 ./.carry/pgemv_bench-tl > "$OUT/pgemv_bench-tl.log" 2>&1; echo "rc $?"
    grep -E "^copy|^\| (8B|70B)|timeline|FAIL" "$OUT/pgemv_bench-tl.log" | cut -c1-400
    echo "== bgemv_bench-tl (BF16 weights, spacers)"
    timeout 200 ./.carry/bgemv_bench-tl > "$OUT/bgemv_bench-tl.log" 2>&1; echo "rc $?"
    grep -E "^copy|timeline" "$OUT/bgemv_bench-tl.log" | cut -c1-400
    ;;
*)
    DEADLINE_S=100000 bash scripts/s32-device.sh "$step" | grep -v "^== done"
    ;;
esac; done
echo "== done $(date +%T)"
