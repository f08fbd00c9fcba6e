#!/usr/bin/env bash
# Thirty-first session's device runs: $@ = steps; run through scripts/s31-call.sh (STEPS=...).
# bw: scripts/proto/bgemv_bench (carried as .carry/bgemv_bench): the packed GEMV kernel over
#   BF16 weights in their natural layout, swept over variants, warps and splits, against
#   cuBLAS and gemv.cu's BF16 kernel, 8B / 70B / SmolLM2 shapes, M = 1 and 8, spacer protocol.
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
*)
    bash scripts/s30-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
