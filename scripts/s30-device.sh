#!/usr/bin/env bash
# Thirtieth session's device runs: $@ = steps; run through scripts/s30-call.sh (STEPS=...).
# pfr: the landed L2-prefetch rule (`prefetch_suits`, thirtieth session; built, never run on a
#   GPU): the lib tests' `peak_bandwidth` (the driver's memory clock and bus width), then
#   gpu_norm_gemv (its prefetch shapes now all wider than 4096), then decode_bench's default
#   against CFP4_DECODE_NO_L2_PREFETCH=1 on the 8B and 70B rows. Expected: on an H200 the 8B
#   default equals the knob-off time (~2.21 ms) and the 70B default is 48-60 us faster than
#   off; on an H100 the default equals the prefetch-on time on both rows. Carried binaries:
#   .carry/lib_tests.xz (the cuda-feature lib test binary, stripped), gpu_norm_gemv.xz,
#   decode_bench.xz (scripts/pack-carry.sh).
# Any other step is scripts/s29-device.sh's (and through it s28's, ...).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in "$@"; do case "$step" in
pfr)
    echo "== lib peak_bandwidth"
    ./.carry/lib_tests peak_bandwidth --test-threads=1 2>&1 | tail -3
    t gpu_norm_gemv 240
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows pfr decode_bench "decode_bench CFP4_DECODE_NO_L2_PREFETCH=1"
    pack_logs pfr
    ;;
*)
    bash scripts/s29-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
