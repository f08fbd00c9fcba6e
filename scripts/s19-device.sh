#!/usr/bin/env bash
# Nineteenth session's device runs: $@ = steps (check | ab | abbin | parts | bench)
# check: $CHECK test binaries.
# ab: rows $AB_ROWS (';'-separated) with the packed GEMVs' L2 prefetch on layers up to each
#   of $AB_PF MiB (CFP4_DECODE_GEMV=l2pf=MB|max; 0 = off), $AB_ROUNDS alternating rounds;
#   needs a decode_bench built with docs/logs/s19/l2pf/l2-prefetch-before-wait.patch.
# abbin: rows $AB_ROWS from the carried decode_bench and decode_bench_new (the tree without
#   and with a change), $AB_ROUNDS alternating rounds; logs packed into abbin-logs.tar.xz.
# parts: the 8B b1 row's step parts inside CUDA graphs. bench: decode_bench.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in ${@}; do case "$step" in
check)
    for b in ${CHECK:-gpu_gemv_packed gpu_decode_graph gpu_llama_tiny}; do t $b 200; done
    ;;
ab)
    variants=(); for pf in ${AB_PF:-0 16 max}; do variants+=("decode_bench CFP4_DECODE_GEMV=l2pf=$pf"); done
    ab_rows ab "${variants[@]}"
    ;;
abbin)
    ab_binaries
    ;;
parts)
    echo "== parts"
    CFP4_DECODE_ONLY="=8b nvfp4 b1 ctx512 kvbf16 graph" CFP4_DECODE_PARTS=1 timeout 200 \
        ./.carry/decode_bench --bench > "$OUT/parts.log" 2>&1
    echo "rc $?"; grep -vE "^\s*$" "$OUT/parts.log" | grep -E "parts|chain|x layers|only|norm|full|GEMV|ms/step|tok/s" | tail -16
    ;;
bench)
    echo "== decode_bench"
    timeout 400 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -24 "$OUT/decode_bench.log"
    ;;
esac; done
