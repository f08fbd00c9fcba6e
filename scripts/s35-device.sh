#!/usr/bin/env bash
# Thirty-fifth session's device runs: $@ = steps; run through scripts/s35-call.sh (STEPS=...).
# bench: decode_bench --bench, every row, the built-in table (tables/sm90.json).
# benchtab: the same with $OUT/sm90.json (written by tune34) as the table; log decode_bench-tab.log.
# issue15: the seven Llama 8B / 70B layers at M = 1, 4, 8, 16, 32 (.carry/pgemv_bench, spacer protocol)
#   and ../shared/peers/w4a16_peers.py with its 70B-shaped twin (.carry/w4a16_peers*.py), same call.
# kvcheck: the GPU tests of the kernels whose cp.async and PDL wrappers moved into the shared
#   kernels/cp_async.cuh and pdl.cuh (kv_cache_gpu, gpu_rope_attention, gpu_gemv_packed).
# proxy: .carry/pgemv_bench's seven Llama layers at M = 1 (spacers) on the full chip and on
#   $PROXY_SMS SMs (green context; default "96 88"), and the 8B chain on each: does an H100
#   on 96 SMs stream at the H200's fractions of copy?
# Any other step is scripts/s34-device.sh's (tune34, tlm1, chain, parts, pcheck, bcheck, mcheck;
# through it s33 → s31). DEADLINE_S: steps that would start later are skipped.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh > /dev/null
for step in "$@"; do
if [ "$SECONDS" -gt "${DEADLINE_S:-100000}" ]; then echo "== $step: skipped (deadline)"; continue; fi
case "$step" in
bench | benchtab)
    log=decode_bench.log; unset CANDLE_FP4_TABLES
    if [ "$step" = benchtab ]; then
        [ -s "$OUT/sm90.json" ] || { echo "== benchtab: no \$OUT/sm90.json"; continue; }
        export CANDLE_FP4_TABLES="$OUT"; log=decode_bench-tab.log
    fi
    echo "== decode_bench --bench (tables: ${CANDLE_FP4_TABLES:-built in})"
    timeout 300 ./.carry/decode_bench --bench > "$OUT/$log" 2>&1
    echo "rc $?"; grep -A30 "^copy bandwidth" "$OUT/$log" | cut -c1-110
    unset CANDLE_FP4_TABLES
    ;;
issue15)
    echo "== pgemv_bench (spacers, M = 1, 4, 8, 16, 32)"
    CFP4_PGEMV_SPACER=1 CFP4_PGEMV_ONLY="8B qkv,8B o,8B gate|up,8B down,70B qkv,70B o,70B down" \
        timeout 150 ./.carry/pgemv_bench > "$OUT/pgemv_bench.log" 2>&1; echo "rc $?"
    grep -E "^copy|^\| (8B|70B)|FAIL" "$OUT/pgemv_bench.log" | cut -c1-200
    peers
    ;;
proxy)
    for n in full ${PROXY_SMS:-96 88}; do
        sm=""; [ "$n" = full ] || sm=$n
        echo "== pgemv_bench M = 1 spacers, SMs: $n"
        env ${sm:+CFP4_PGEMV_SMS=$sm} CFP4_PGEMV_SPACER=1 CFP4_PGEMV_M1=1 \
            CFP4_PGEMV_ONLY="8B qkv,8B o,8B gate|up,8B down,70B qkv,70B o,70B down" \
            timeout 120 ./.carry/pgemv_bench > "$OUT/proxy-$n.log" 2>&1; echo "rc $?"
        grep -E "^copy|^green|^\| (8B|70B)|FAIL" "$OUT/proxy-$n.log" | cut -c1-200
        env ${sm:+CFP4_PGEMV_SMS=$sm} CFP4_PGEMV_CHAIN=8B timeout 120 ./.carry/pgemv_bench \
            > "$OUT/proxy-chain-$n.log" 2>&1; echo "rc $?"
        grep -E "^\| chain|    chain" "$OUT/proxy-chain-$n.log" | cut -c1-300
    done
    ;;
kvcheck)
    t kv_cache_gpu 300
    t gpu_rope_attention 200
    t gpu_gemv_packed 300
    ;;
*)
    DEADLINE_S=100000 bash scripts/s34-device.sh "$step" | grep -v "^== done"
    ;;
esac; done
echo "== done $(date +%T)"
