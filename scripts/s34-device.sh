#!/usr/bin/env bash
# Thirty-fourth session's device runs: $@ = steps; run through scripts/s34-call.sh (STEPS=...).
# chain: pgemv_bench-tl's chain mode (scripts/proto/pgemv_chain.cuh): the 8B and 70B
#   layers' four NVFP4 GEMVs in the step's order with spacers, at reserves 0, 4 and 8 warps
#   per SM, the chain's time and each kernel's timeline against the GEMV before it.
# resab: decode_bench's 8B NVFP4 b1 row, alternating: the planned geometry and the packed
#   GEMVs' one-wave grids leaving 4 and 8 warps per SM to the next kernel
#   (CFP4_DECODE_RESERVE_WARPS, reserve_geometry). AB_ROWS / AB_ROUNDS override.
# Any other step is scripts/s33-device.sh's (tunefull, benchfit, tl; through it s32's bwab2,
# tunefit and s31's bwcheck, bw2, ...). DEADLINE_S: steps that would start later are
# skipped. decode_bench now applies its GEMV knobs (CFP4_DECODE_BF16_LEGACY,
# CFP4_DECODE_BW_FITTED_RULE, CFP4_DECODE_RESERVE_WARPS) to the model's layers; before this
# session only PDL reached them.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in "$@"; do
if [ "$SECONDS" -gt "${DEADLINE_S:-100000}" ]; then echo "== $step: skipped (deadline)"; continue; fi
case "$step" in
chain)
    for c in 8B 70B; do
        echo "== pgemv_bench-tl chain $c"
        CFP4_PGEMV_CHAIN=$c timeout 120 ./.carry/pgemv_bench-tl > "$OUT/chain-$c.log" 2>&1; echo "rc $?"
        grep -E "^copy|^chain|^\| chain|    chain" "$OUT/chain-$c.log" | cut -c1-420
    done
    ;;
resab)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph}" AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows resab decode_bench \
        "decode_bench CFP4_DECODE_RESERVE_WARPS=4" "decode_bench CFP4_DECODE_RESERVE_WARPS=8"
    pack_logs resab
    ;;
*)
    DEADLINE_S=100000 bash scripts/s33-device.sh "$step" | grep -v "^== done"
    ;;
esac; done
echo "== done $(date +%T)"
