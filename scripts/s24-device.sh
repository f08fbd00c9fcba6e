#!/usr/bin/env bash
# Twenty-fourth session's device runs: $@ = steps; run through scripts/s24-call.sh (STEPS=...).
# check: the carried GPU tests ($CHECK; default: the residual epilogue's and sums
#   prologue's tests, the norm GEMV's, the packed GEMV's, the decode graph's).
# absums: one decode_bench (this tree) with and without CFP4_DECODE_RESIDUAL_SUMS=1 (o_proj
#   and down_proj add the residual in their GEMVs and write the sums of squares; the next
#   q|k|v and gate|up GEMVs take the norm from them: no norm kernels between layers),
#   $AB_ROWS, $AB_ROUNDS alternating rounds.
# parts: the 8B b1 step's parts inside graphs with the knob on (CFP4_DECODE_PARTS=1).
# Any other step is scripts/s23-device.sh's (boundary, ablate, abbin, bench, peers, ...).
# ON_H200="steps": run only when the card is an H200 (the issues' measured target).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
steps=$(card_steps "$@")
for step in $steps; do case "$step" in
check)
    for b in ${CHECK:-gpu_residual_sums gpu_norm_gemv gpu_gemv_packed gpu_decode_graph}; do t $b 240; done
    ;;
absums)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows absums decode_bench "decode_bench CFP4_DECODE_RESIDUAL_SUMS=1"
    tar -C "$OUT" -cJf "$OUT/absums-logs.tar.xz" $(cd "$OUT" && ls absums-*.log) && rm -f "$OUT"/absums-*.log
    ;;
parts)
    echo "== decode_bench parts, residual sums on"
    CFP4_DECODE_RESIDUAL_SUMS=1 CFP4_DECODE_ONLY="=8b nvfp4 b1 ctx512 kvbf16 graph" CFP4_DECODE_PARTS=1 \
        timeout 150 ./.carry/decode_bench --bench > "$OUT/parts-sums.log" 2>&1
    echo "rc $?"; tail -20 "$OUT/parts-sums.log"
    ;;
*)
    ON_H200= bash scripts/s23-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
