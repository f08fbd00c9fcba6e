#!/usr/bin/env bash
# Twenty-third session's device runs: $@ = steps; run through scripts/s23-call.sh (STEPS=...).
# boundary: scripts/proto/boundary_bench (what a kernel boundary costs in a graph: stream
#   order, PDL's griddepcontrol.wait with an early or a late trigger, or a device-side
#   arrival counter), and the SASS of its acquire poll.
# ablate: main's decode_bench against decode_bench_late (the packed GEMVs trigger their
#   dependents after griddepcontrol.wait: docs/logs/s23/gemv-trigger-after-wait.patch).
# check: the carried GPU tests ($CHECK).
# abarr, flag: the arrival chain's binaries (docs/logs/s23/arrival-chain.patch, reverted):
#   decode_bench with and without CFP4_DECODE_ARRIVALS=1, and the packed GEMV harness with
#   CFP4_PGEMV_FLAG=1.
# Any other step is scripts/s22-device.sh's (abbin, abpf, bench, peers, ...).
# ON_H200="steps": run only when the card is an H200 (the issues' measured target).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
steps=$(card_steps "$@")
# ab_packed PREFIX VARIANT...: $AB_ROWS (default: 8B b1, 70B b1, 8B b8, SmolLM2 b1) under
# each variant, $AB_ROUNDS rounds (default 2), the logs packed into $OUT/PREFIX-logs.tar.xz.
ab_packed() {
    local prefix=$1; shift
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows "$prefix" "$@"
    tar -C "$OUT" -cJf "$OUT/$prefix-logs.tar.xz" $(cd "$OUT" && ls "$prefix"-*.log) && rm -f "$OUT/$prefix"-*.log
}
for step in $steps; do case "$step" in
boundary)
    echo "== boundary_bench"
    timeout 120 ./.carry/boundary_bench > "$OUT/boundary.log" 2>&1
    echo "rc $?"; cat "$OUT/boundary.log"
    # Does the acquire poll invalidate L1 (CCTL.IVALL after the strong load)?
    cuobjdump -sass .carry/boundary_bench 2>/dev/null | grep -E "CCTL|STRONG|RED|MEMBAR|FENCE" | sort | uniq -c | head -12
    ;;
ablate)
    ab_packed ablate decode_bench decode_bench_late
    ;;
abarr)
    ab_packed abarr decode_bench "decode_bench CFP4_DECODE_ARRIVALS=1"
    ;;
check)
    for b in ${CHECK:-gpu_decode_graph gpu_norm_gemv gpu_gemv_packed kv_cache_gpu}; do t $b 240; done
    ;;
flag)
    echo "== pgemv_bench, PDL and arrival counters"
    CFP4_PGEMV_FLAG=1 CFP4_PGEMV_M1=1 CFP4_PGEMV_ONLY="${FLAG_SHAPES:-8B qkv,8B o,8B gate|up,8B down,70B qkv,70B o,S qkv,S o,S down}" \
        timeout 200 ./.carry/pgemv_bench > "$OUT/pgemv_flag.log" 2>&1
    echo "rc $?"; grep -E "^copy|^\| (8B|70B|S )|flag chain|FAIL|failures" "$OUT/pgemv_flag.log" | head -40
    ;;
*)
    bash scripts/s22-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
