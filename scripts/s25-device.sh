#!/usr/bin/env bash
# Twenty-fifth session's device runs: $@ = steps; run through scripts/s25-call.sh (STEPS=...).
# trsums: per-kernel ncu traces of one 8B and one 70B b1 graph step with and without
#   CFP4_DECODE_RESIDUAL_SUMS=1 (the CSVs come back: which kernel grew).
# ab3: decode_bench off, decode_bench with CFP4_DECODE_RESIDUAL_SUMS=1, decode_bench_new with
#   it ($AB_ROWS, $AB_ROUNDS alternating rounds; logs packed).
# partsoff: the 8B b1 step's parts inside graphs with the knob off (the baseline of parts).
# Any other step is scripts/s24-device.sh's (check, absums, parts, ...).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
steps=$(card_steps "$@")
for step in $steps; do case "$step" in
trsums)
    IFS=';' read -ra trows <<< "${TRACE_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph:8b;70b nvfp4 b1 ctx512 kvbf16 graph:70b}"
    for row in "${trows[@]}"; do
        trace "${row%%:*}" "${row##*:}-off"
        CFP4_DECODE_RESIDUAL_SUMS=1 trace "${row%%:*}" "${row##*:}-on"
    done
    ;;
ab3)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows ab3 decode_bench "decode_bench CFP4_DECODE_RESIDUAL_SUMS=1" "decode_bench_new CFP4_DECODE_RESIDUAL_SUMS=1"
    tar -C "$OUT" -cJf "$OUT/ab3-logs.tar.xz" $(cd "$OUT" && ls ab3-*.log) && rm -f "$OUT"/ab3-*.log
    ;;
partsoff)
    echo "== decode_bench parts, residual sums off"
    CFP4_DECODE_ONLY="=8b nvfp4 b1 ctx512 kvbf16 graph" CFP4_DECODE_PARTS=1 \
        timeout 150 ./.carry/decode_bench --bench > "$OUT/parts-off.log" 2>&1
    echo "rc $?"; tail -20 "$OUT/parts-off.log"
    ;;
*)
    ON_H200= bash scripts/s24-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
