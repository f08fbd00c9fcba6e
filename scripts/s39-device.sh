#!/usr/bin/env bash
# Thirty-ninth session's device runs: $@ = steps; run through scripts/s39-call.sh (STEPS=...).
# deep: .carry/pgemv_bench-u$U (the harness with its deep kernel at U pairs in flight, built
#   by `DEEP_U=$U SUFFIX=-u$U scripts/proto/build-pgemv-bench.sh`) against .carry/pgemv_bench
#   (U = 5), M = 1 with spacers, alternating, $DEEP_US (default "8"): does a deeper register
#   pipeline shorten the layers with long per-warp runs on this card?
# xtma: .carry/pgemv_bench (the staged kernels' x copy by cp.async) against
#   .carry/pgemv_bench-xtma (built with -DCFP4_PGEMV_XTMA: the same copy as bulk copies on an
#   mbarrier, through the TMA engine), M = 1 with spacers, alternating, two rounds.
# abx: decode_bench against decode_bench_new (built with the bulk x copy on sm_90+), rows
#   $AB_ROWS (default 8B b1, SmolLM2 b1), $AB_ROUNDS rounds (default 2).
# tracex: per-kernel ncu times of the 8B b1 step inside its graph, decode_bench then
#   decode_bench_new (the TMA x copy): which kernels the bulk copy slows.
# abu8: decode_bench (U = 5 deepest) against decode_bench_new (built with (1, false, 8) in
#   PGEMV_KERNELS and 8 in PGEMV_STAGED_U), rows $AB_ROWS (default 8B b1 and b8), alternating,
#   $AB_ROUNDS rounds (default 2).
# Any other step is scripts/s37-device.sh's (bench, benchtab, issue15, tune34, ...).
# DEADLINE_S: steps that would start later are skipped.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh  # prints the card's name, driver and clocks
for step in "$@"; do
past_deadline "$step" && continue
case "$step" in
deep)
    for round in 1 2; do for u in 5 ${DEEP_US:-8}; do
        bin=./.carry/pgemv_bench-u$u; [ "$u" = 5 ] && bin=./.carry/pgemv_bench
        echo "== pgemv_bench deep U = $u, round $round"
        CFP4_PGEMV_SPACER=1 CFP4_PGEMV_M1=1 \
            CFP4_PGEMV_ONLY="8B qkv,8B o,8B down" \
            timeout 90 "$bin" > "$OUT/deep-u$u-r$round.log" 2>&1; echo "rc $?"
        grep -E "^copy|^\| (8B|70B)|FAIL" "$OUT/deep-u$u-r$round.log" | cut -c1-160
    done; done
    ;;
xtma)
    for round in 1 2; do for v in "" -xtma; do
        echo "== pgemv_bench$v, round $round"
        CFP4_PGEMV_SPACER=1 CFP4_PGEMV_M1=1 \
            CFP4_PGEMV_ONLY="8B o,8B down,S qkv,S o,S down,S lm_head,odd" \
            timeout 90 ./.carry/pgemv_bench$v > "$OUT/xtma$v-r$round.log" 2>&1; echo "rc $?"
        grep -E "^copy|^\| (8B|S |odd)|FAIL" "$OUT/xtma$v-r$round.log" | cut -c1-160
    done; done
    ;;
abx | abu8)
    rows="8b nvfp4 b1 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph;8b bf16 b1 ctx512 kvbf16 graph"
    [ "$step" = abu8 ] && rows="8b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph"
    AB_ROWS="${AB_ROWS:-$rows}" AB_ROUNDS="${AB_ROUNDS:-2}" ab_binaries
    ;;
tracex)
    trace "8b nvfp4 b1 ctx512 kvbf16 graph" base
    past_deadline "tracex (second build)" || TRACE_BIN=decode_bench_new trace "8b nvfp4 b1 ctx512 kvbf16 graph" xtma
    ;;
*)
    DEADLINE_S=100000 bash scripts/s37-device.sh "$step" | grep -v "^== done"
    ;;
esac; done
echo "== done $(date +%T)"
