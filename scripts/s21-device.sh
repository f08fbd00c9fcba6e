#!/usr/bin/env bash
# Twenty-first session's device runs (for the next call): $@ = steps (spacer | check | peers)
# spacer: the packed-GEMV harness twice on $SPACER_SHAPES (default: the 8B and 70B plain
#   layers and the 8B gate|up), M = 1: back-to-back replays, then CFP4_PGEMV_SPACER=1 (a
#   one-CTA kernel on x between the calls, as in the decode step); logs pgemv_plain.log and
#   pgemv_spacer.log. The per-layer sums of the spacer rows should track the decode step's
#   GEMV time (docs/benchmarks.md, twenty-first session); check that first.
# check: $CHECK test binaries (device-common.sh t). peers: the W4A16 peers.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
shapes="${SPACER_SHAPES:-8B qkv,8B o,8B gate|up,8B down,70B qkv,70B o,70B down}"
for step in ${@}; do case "$step" in
spacer)
    for mode in plain spacer; do
        echo "== pgemv_bench ($mode)"
        env $([ $mode = spacer ] && echo CFP4_PGEMV_SPACER=1) CFP4_PGEMV_M1=1 CFP4_PGEMV_ONLY="$shapes" \
            timeout 300 ./.carry/pgemv_bench > "$OUT/pgemv_$mode.log" 2>&1
        echo "rc $?"; grep -E "^copy|^spacers|^\| (8B|70B)|FAIL|failures" "$OUT/pgemv_$mode.log" | head -20
    done
    ;;
check)
    for b in ${CHECK:-gpu_gemv_packed gpu_decode_graph gpu_llama_tiny}; do t $b 200; done
    ;;
peers)
    peers
    ;;
esac; done
