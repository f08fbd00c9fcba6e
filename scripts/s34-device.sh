#!/usr/bin/env bash
# Thirty-fourth session's device runs: $@ = steps; run through scripts/s34-call.sh (STEPS=...).
# chain: pgemv_bench-tl's chain mode (scripts/proto/pgemv_chain.cuh): the 8B and 70B
#   layers' four NVFP4 GEMVs in the step's order with spacers, the chain's time and each
#   kernel's timeline against the GEMV before it; .carry/pgemv_bench-tl-old (the staged
#   kernels' CTA-wide x copy) beside .carry/pgemv_bench-tl (per-warp copy in two groups).
# stagedab: decode_bench_old (CTA-wide staged copy) against decode_bench_new (per-warp, two
#   cp.async groups), alternating rows ($AB_ROWS, $AB_ROUNDS).
# tlm1: the single-GEMV timelines (M = 1, spacers) of both harness builds.
# TL_OLD, DB_OLD, DB_NEW: the builds chain, tlm1 and stagedab compare (call 5: the per-warp
#   two-group copy, pgemv_bench-tl-v2 / decode_bench_v2, against the first U steps on x from
#   L2, pgemv_bench-tl / decode_bench).
# pcheck: tests/gpu_gemv_packed.rs; bcheck: tests/gpu_gemv_bf16.rs (with the knob test).
# bfab: all-BF16 8B rows (b1, b8), decode_bench_new (call 2's build: the NVFP4 kernel's
#   geometry rule for BF16 layers) against decode_bench (the fitted rule, now the default).
# pre: pgemv_bench-tl without and with CFP4_PGEMV_PRE=1 (step 0 decoded before the PDL
#   wait), M = 1 rows (spacers) and the 8B / 70B chains, same binary.
# preab: decode_bench without and with CFP4_DECODE_PREDECODE=1 (the plain one-tile packed
#   GEMVs' predecoded twins), alternating rows ($AB_ROWS, $AB_ROUNDS).
# mcheck: models/tests/gpu_decode_graph.rs and gpu_llama_tiny.rs (the loader's knob path).
# parts: the 8B NVFP4 b1 step part by part inside CUDA graphs (CFP4_DECODE_PARTS).
# tune34: the whole table with this tree's tune into $OUT/sm90.json.
# bench: decode_bench --bench, every row (the tree's table unless tune34 wrote one and
#   TABLE34=1).
# Any other step is scripts/s33-device.sh's (tunefull, benchfit, tl; through it s32's bwab2,
# tunefit and s31's bwcheck, bw2, ...). DEADLINE_S: steps that would start later are
# skipped. decode_bench now applies its GEMV knobs (CFP4_DECODE_BF16_LEGACY,
# CFP4_DECODE_BW_FITTED_RULE) to the model's layers; before this
# session only PDL reached them.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
[ -e .carry/decode_bench ] || ln -s decode_bench_new .carry/decode_bench
for step in "$@"; do
if [ "$SECONDS" -gt "${DEADLINE_S:-100000}" ]; then echo "== $step: skipped (deadline)"; continue; fi
case "$step" in
chain)
    for b in ${TL_OLD:-pgemv_bench-tl-old} pgemv_bench-tl; do for c in 8B 70B; do
        [ -x ".carry/$b" ] || continue
        echo "== $b chain $c"
        CFP4_PGEMV_CHAIN_RESERVES=0 CFP4_PGEMV_CHAIN=$c timeout 120 ./.carry/$b > "$OUT/chain-$b-$c.log" 2>&1; echo "rc $?"
        grep -E "^\| chain|    chain" "$OUT/chain-$b-$c.log" | cut -c1-420
    done; done
    ;;
tlm1)
    for b in ${TL_OLD:-pgemv_bench-tl-old} pgemv_bench-tl; do
        echo "== $b (NVFP4, M = 1, spacers)"
        CFP4_PGEMV_SPACER=1 CFP4_PGEMV_M1=1 CFP4_PGEMV_ONLY="8B qkv,8B o,8B gate|up,8B down,70B qkv,70B o,70B down" \
            timeout 120 ./.carry/$b > "$OUT/tlm1-$b.log" 2>&1; echo "rc $?"
        grep -E "^copy|^\| (8B|70B)|timeline|FAIL" "$OUT/tlm1-$b.log" | cut -c1-330
    done
    ;;
pcheck)
    t gpu_gemv_packed 300
    ;;
bcheck)
    t gpu_gemv_bf16 300
    ;;
stagedab)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph}" AB_ROUNDS="${AB_ROUNDS:-2}" \
        ab_rows stagedab ${DB_OLD:-decode_bench_old} ${DB_NEW:-decode_bench_new}
    pack_logs stagedab
    ;;
pre)
    for v in 0 1; do
        pre=""; [ $v = 1 ] && pre=1
        echo "== pgemv_bench-tl M = 1, CFP4_PGEMV_PRE=$pre"
        env ${pre:+CFP4_PGEMV_PRE=1} CFP4_PGEMV_SPACER=1 CFP4_PGEMV_M1=1 \
            CFP4_PGEMV_ONLY="8B qkv,8B o,8B down,70B qkv,S qkv,S o,S down,odd" \
            timeout 120 ./.carry/pgemv_bench-tl > "$OUT/pre$v-m1.log" 2>&1; echo "rc $?"
        grep -E "^\| (8B|70B|S |odd)|timeline|FAIL" "$OUT/pre$v-m1.log" | cut -c1-330
        for c in 8B 70B; do
            env ${pre:+CFP4_PGEMV_PRE=1} CFP4_PGEMV_CHAIN=$c timeout 120 ./.carry/pgemv_bench-tl > "$OUT/pre$v-chain-$c.log" 2>&1
            echo "rc $?"; grep -E "^\| chain|    chain" "$OUT/pre$v-chain-$c.log" | cut -c1-420
        done
    done
    ;;
preab)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows preab decode_bench "decode_bench CFP4_DECODE_PREDECODE=1"
    pack_logs preab
    ;;
mcheck)
    t gpu_decode_graph 300
    t gpu_llama_tiny 200
    ;;
parts)
    echo "== decode_bench parts, 8B NVFP4 b1 512"
    CFP4_DECODE_ONLY="=8b nvfp4 b1 ctx512 kvbf16 graph" CFP4_DECODE_PARTS=1 timeout 200 ./.carry/decode_bench --bench \
        > "$OUT/parts.log" 2>&1; echo "rc $?"
    grep -vE "^\s*$" "$OUT/parts.log" | tail -24
    ;;
bfab)
    AB_ROWS="${AB_ROWS:-8b bf16 b1 ctx512 kvbf16 graph;8b bf16 b8 ctx512 kvbf16 graph}" AB_ROUNDS="${AB_ROUNDS:-2}" \
        ab_rows bfab decode_bench_new decode_bench
    pack_logs bfab
    ;;
tune34)
    echo "== tune (8B and 70B with their tensor-parallel-2 shards, SmolLM2)"
    timeout 240 ./.carry/tune --config tests/data/configs/llama-3.1-8b.json \
        --config tests/data/configs/llama-3.1-70b.json --tp 2 \
        --shapes 960x576,576x576,3072x576s,576x1536,49152x576 --ms 1,2,4,6,8,12,16,24,32 \
        --out "$OUT/sm90.json" > "$OUT/tune.log" 2>&1; echo "rc $?"
    grep -E "m= 1:" "$OUT/tune.log" | cut -c1-150
    ;;
bench)
    [ -n "${TABLE34:-}" ] && [ -s "$OUT/sm90.json" ] && export CANDLE_FP4_TABLES="$OUT"
    echo "== decode_bench --bench (tables: ${CANDLE_FP4_TABLES:-built in})"
    timeout 300 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -26 "$OUT/decode_bench.log"
    ;;
*)
    DEADLINE_S=100000 bash scripts/s33-device.sh "$step" | grep -v "^== done"
    ;;
esac; done
echo "== done $(date +%T)"
