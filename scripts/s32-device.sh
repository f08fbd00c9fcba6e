#!/usr/bin/env bash
# Thirty-second session's device runs: $@ = steps; run through scripts/s32-call.sh (STEPS=...).
# bwab2: decode_bench's all-BF16 8B rows (b1, b8), alternating: the BF16-weight kernel with
#   the NVFP4 kernel's geometry rule (the default, what the step was measured with), with its
#   own rule (bw_geometry: CFP4_DECODE_BW_FITTED_RULE=1), and with its own rule and
#   .carry/sm90-bw.json (every 8B BF16 projection on the kernel).
# tunefit: tune's BF16 rows with the fitted rule (--bw-fitted-rule) into $OUT/sm90-fitted.json.
# Any other step is scripts/s31-device.sh's (bw2, bwcheck, tune, bench31, ...).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in "$@"; do
# DEADLINE_S: steps that would start later than this many seconds into the call are skipped.
if [ "$SECONDS" -gt "${DEADLINE_S:-100000}" ]; then echo "== $step: skipped (deadline)"; continue; fi
case "$step" in
bwab2)
    # The candidate table: tables/sm90.json plus the GEMV at nt 1 on 8B q|k|v and down (BF16).
    [ -s .carry/sm90-bw.json ] || python3 - <<'PY'
import json
t = json.load(open("tables/sm90.json"))
for n, k in ((6144, 4096), (4096, 14336)):
    t["entries"].append({"n": n, "k": k, "silu_mul": False, "bf16": True, "nts": [1], "margins": [1.0]})
json.dump(t, open(".carry/sm90-bw.json", "w"), indent=2)
PY
    AB_ROWS="${AB_ROWS:-8b bf16 b1 ctx512 kvbf16 graph;8b bf16 b8 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows bwab2 decode_bench \
        "decode_bench CFP4_DECODE_BW_FITTED_RULE=1" \
        "decode_bench CANDLE_FP4_TABLES=.carry/sm90-bw.json CFP4_DECODE_BW_FITTED_RULE=1"
    pack_logs bwab2
    ;;
tunefit)
    echo "== tune --bw-fitted-rule (8B, 70B and their TP-2 shards)"
    timeout 240 ./.carry/tune --config tests/data/configs/llama-3.1-8b.json \
        --config tests/data/configs/llama-3.1-70b.json --tp 2 --ms 1,2,4,8 --bw-fitted-rule \
        --out "$OUT/sm90-fitted.json" > "$OUT/tune-fitted.log" 2>&1; echo "rc $?"
    grep -E "m= 1:" "$OUT/tune-fitted.log" | cut -c1-150
    ;;
*)
    bash scripts/s31-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
