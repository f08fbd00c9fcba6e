#!/usr/bin/env bash
# Eighteenth session's device runs: $@ = steps (check | tune | bench | parts | attn | trace8b)
# check: $CHECK test binaries. tune: the table for the 8B, 70B (and TP-2 shards) and SmolLM2
# shapes into $OUT/sm90.json. bench: decode_bench (with $OUT/sm90.json when tune wrote it).
# parts: the 8B b1 rows' step parts timed inside CUDA graphs (CFP4_DECODE_PARTS).
# attn: the 8B b1 512 row under decode-attention knobs (CFP4_DECODE_ATTN), one run each.
# trace8b: ncu per kernel of the 8B step.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in ${@}; do case "$step" in
check)
    for b in ${CHECK:-gpu_gemv_packed gpu_decode_graph gpu_llama_tiny}; do t $b 200; done
    ;;
tune)
    echo "== tune (8B and 70B with their tensor-parallel-2 shards, SmolLM2)"
    timeout 150 ./.carry/tune --config tests/data/configs/llama-3.1-8b.json \
        --config tests/data/configs/llama-3.1-70b.json --tp 2 \
        --shapes 960x576,576x576,3072x576s,576x1536,49152x576 --ms 1,2,4,6,8,12,16,24,32 \
        --out "$OUT/sm90.json" > "$OUT/tune.log" 2>&1; echo "rc $?"
    grep -E "m= (1|8):" "$OUT/tune.log" | cut -c1-150
    ;;
bench)
    [ -s "$OUT/sm90.json" ] && export CANDLE_FP4_TABLES="$OUT"
    echo "== decode_bench (tables: ${CANDLE_FP4_TABLES:-built in})"
    timeout 400 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -24 "$OUT/decode_bench.log"
    ;;
parts)
    [ -s "$OUT/sm90.json" ] && export CANDLE_FP4_TABLES="$OUT"
    for row in "8b nvfp4 b1 ctx512 kvbf16 graph" ${PARTS_BF16:+"8b bf16 b1 ctx512 kvbf16 graph"}; do
        tag=$(echo "$row" | cut -d' ' -f2)
        echo "== parts: $row"
        CFP4_DECODE_ONLY="=$row" CFP4_DECODE_PARTS=1 CFP4_DECODE_TRACE=1 timeout 200 \
            ./.carry/decode_bench --bench > "$OUT/parts-$tag.log" 2>&1
        echo "rc $?"; grep -vE "^\s*$" "$OUT/parts-$tag.log" | grep -E "step GPU|parts|chain|x layers|only|norm|full|GEMV|ms/step|tok/s" | tail -16
    done
    ;;
attn)
    for a in ${ATTN:-default fused=1 splits=4 splits=4,fused=1 splits=8 splits=16 splits=16,fused=1 splits=2}; do
        tag=$(echo "$a" | tr '=,' '__'); [ "$a" = default ] && a=""
        CFP4_DECODE_ONLY="=8b nvfp4 b1 ctx512 kvbf16 graph" CFP4_DECODE_ATTN="$a" timeout 100 \
            ./.carry/decode_bench --bench > "$OUT/attn-$tag.log" 2>&1
        echo "attn $tag: rc $? $(grep -E '^8b nvfp4 b1' "$OUT/attn-$tag.log" | tail -1)"
    done
    ;;
trace8b)
    trace "8b nvfp4 b1 ctx512 kvbf16 graph" 8b
    ;;
esac; done
