#!/usr/bin/env bash
# Thirty-sixth session's device runs: $@ = steps; run through scripts/s36-call.sh (STEPS=...).
# dproxy: decode_bench's batch-1 ctx-512 BF16-cache graph rows (SmolLM2, 8B NVFP4, 8B BF16,
#   70B NVFP4) on the full chip, then planned for $DPROXY_SMS SMs (default 96) with an
#   H200's peak DRAM bandwidth (4917 GB/s) while candle_fp4::partition::SmBlocker holds the
#   others: does the decode step on an H100's 96 SMs land at the H200's fractions?
# ptest: the GPU test of candle_fp4::partition (tests/gpu_partition.rs).
# tlproxy: .carry/pgemv_bench-tl's per-warp timelines of the seven Llama layers (M = 1,
#   spacers) on the full chip and on $DPROXY_SMS SMs (green context).
# Any other step is scripts/s35-device.sh's (proxy, kvcheck, bench, benchtab, issue15; through
# it s34 → s31). DEADLINE_S: steps that would start later are skipped.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh > /dev/null
for step in "$@"; do
if [ "$SECONDS" -gt "${DEADLINE_S:-100000}" ]; then echo "== $step: skipped (deadline)"; continue; fi
case "$step" in
dproxy)
    for n in full ${DPROXY_SMS:-96}; do
        sm=""; [ "$n" = full ] || sm=$n
        echo "== decode_bench b1 ctx512 kvbf16 graph rows, SMs: $n"
        env ${sm:+CFP4_DECODE_SMS=$sm CFP4_DECODE_MEM_BW=4917} CFP4_DECODE_ONLY="b1 ctx512 kvbf16 graph" \
            timeout 200 ./.carry/decode_bench --bench > "$OUT/dproxy-$n.log" 2>&1
        echo "rc $?"; grep -E "^partition|^blocker|BROKEN|^copy|^row|graph" "$OUT/dproxy-$n.log" | cut -c1-120
    done
    ;;
ptest)
    t gpu_partition 120
    ;;
tlproxy)
    for n in full ${DPROXY_SMS:-96}; do
        sm=""; [ "$n" = full ] || sm=$n
        echo "== pgemv_bench-tl M = 1 spacers (timelines), SMs: $n"
        env ${sm:+CFP4_PGEMV_SMS=$sm} CFP4_PGEMV_SPACER=1 CFP4_PGEMV_M1=1 \
            CFP4_PGEMV_ONLY="8B qkv,8B o,8B gate|up,8B down,70B qkv,70B o,70B down" \
            timeout 120 ./.carry/pgemv_bench-tl > "$OUT/tlproxy-$n.log" 2>&1; echo "rc $?"
        grep -E "^copy|^green|^\| (8B|70B)|timeline|FAIL" "$OUT/tlproxy-$n.log" | cut -c1-330
    done
    ;;
*)
    DEADLINE_S=100000 bash scripts/s35-device.sh "$step" | grep -v "^== done"
    ;;
esac; done
echo "== done $(date +%T)"
