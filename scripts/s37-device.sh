#!/usr/bin/env bash
# Thirty-seventh session's device runs: $@ = steps; run through scripts/s37-call.sh (STEPS=...).
# prewait: .carry/prewait_bench (scripts/proto/prewait_bench.cu): streaming stand-ins of the
#   8B and 70B layer chains under PDL with each pre-wait prefetch mode (none, register
#   stages, 16-96 KB per CTA into shared memory): does a deeper prefetch before
#   griddepcontrol.wait shorten the boundary, and does the release wait for it?
# spchain / spm1: .carry/pgemv_bench-sptl (the packed GEMV's shared-memory weight steps before
#   the wait, CFP4_PGEMV_SMEMPRE KB per CTA, $SP_KB, default "0 48 96"; timelines on) in the
#   8B / 70B layer chains, and the seven layers at M = 1.
# spab: decode_bench rows (8B b1, 70B b1, 8B b8) with CFP4_DECODE_SMEM_PRE = 0 and $SPAB_KB (48 96) KB,
#   alternating, $AB_ROUNDS rounds. sptest: gpu_gemv_packed (the steps change no bit).
# Any other step is scripts/s36-device.sh's (dproxy, ptest, tlproxy; through it s35 → s31).
# DEADLINE_S: steps that would start later are skipped.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh > /dev/null
for step in "$@"; do
if [ "$SECONDS" -gt "${DEADLINE_S:-100000}" ]; then echo "== $step: skipped (deadline)"; continue; fi
case "$step" in
prewait)
    echo "== prewait_bench"
    timeout 150 ./.carry/prewait_bench > "$OUT/prewait.log" 2>&1; echo "rc $?"
    grep -E "copy|^\| (8B|70B)" "$OUT/prewait.log" | cut -c1-300
    ;;
spchain)
    for c in 8B 70B; do for kb in ${SP_KB:-0 48 96}; do
        echo "== pgemv_bench-sptl chain $c, CFP4_PGEMV_SMEMPRE=$kb"
        CFP4_PGEMV_SMEMPRE=$kb CFP4_PGEMV_CHAIN=$c timeout 120 ./.carry/pgemv_bench-sptl > "$OUT/spchain-$c-$kb.log" 2>&1
        echo "rc $?"; grep -E "^\| chain|    chain|FAIL" "$OUT/spchain-$c-$kb.log" | cut -c1-330
    done; done
    ;;
spm1)
    for kb in ${SP_KB:-0 48 96}; do
        echo "== pgemv_bench-sptl M = 1 spacers, CFP4_PGEMV_SMEMPRE=$kb"
        CFP4_PGEMV_SMEMPRE=$kb CFP4_PGEMV_SPACER=1 CFP4_PGEMV_M1=1 \
            CFP4_PGEMV_ONLY="8B qkv,8B o,8B gate|up,8B down,70B qkv,70B o,70B down" \
            timeout 120 ./.carry/pgemv_bench-sptl > "$OUT/spm1-$kb.log" 2>&1; echo "rc $?"
        grep -E "^copy|^\| (8B|70B)|FAIL" "$OUT/spm1-$kb.log" | cut -c1-200
    done
    ;;
spab)
    vs=(decode_bench)
    for kb in ${SPAB_KB:-48 96}; do vs+=("decode_bench CFP4_DECODE_SMEM_PRE=$kb"); done
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows spab "${vs[@]}"
    pack_logs spab
    ;;
sptest)
    t gpu_gemv_packed 300
    ;;
*)
    DEADLINE_S=100000 bash scripts/s36-device.sh "$step" | grep -v "^== done"
    ;;
esac; done
echo "== done $(date +%T)"
