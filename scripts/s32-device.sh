#!/usr/bin/env bash
# Thirty-second session's device runs: $@ = steps; run through scripts/s32-call.sh (STEPS=...).
# bwab2: decode_bench's all-BF16 8B rows (b1, b8), alternating: the BF16-weight kernel with
#   its own geometry rule (bw_geometry, the default) and with the NVFP4 kernel's
#   (CFP4_DECODE_BW_PACKED_RULE=1), each with the table tune wrote in this call ($OUT/sm90.json,
#   else the built-in one); and the default with .carry/sm90-bw.json (every 8B BF16
#   projection on the kernel).
# Any other step is scripts/s31-device.sh's (bw2, bwcheck, tune, bench31, ...).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in "$@"; do
# DEADLINE_S: steps that would start later than this many seconds into the call are skipped.
if [ "$SECONDS" -gt "${DEADLINE_S:-100000}" ]; then echo "== $step: skipped (deadline)"; continue; fi
case "$step" in
bwab2)
    tab=""; [ -s "$OUT/sm90.json" ] && tab="CANDLE_FP4_TABLES=$OUT"
    AB_ROWS="${AB_ROWS:-8b bf16 b1 ctx512 kvbf16 graph;8b bf16 b8 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows bwab2 "decode_bench $tab" \
        "decode_bench $tab CFP4_DECODE_BW_PACKED_RULE=1" \
        "decode_bench CANDLE_FP4_TABLES=.carry/sm90-bw.json"
    pack_logs bwab2
    ;;
*)
    bash scripts/s31-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
