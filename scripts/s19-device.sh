#!/usr/bin/env bash
# Nineteenth session's device runs: $@ = steps (check | ab | parts | bench)
# check: $CHECK test binaries. ab: rows $AB_ROWS (';'-separated) with the packed GEMVs' L2
# prefetch on layers up to each of $AB_PF MiB (CFP4_DECODE_GEMV=l2pf=MB|max; 0 = off),
# $AB_ROUNDS alternating rounds. parts: the 8B b1 row's
# step parts inside CUDA graphs under $PARTS_GEMV. bench: decode_bench (default knobs).
# abbin: rows $AB_ROWS from the carried decode_bench and decode_bench_new (the tree with and
# without a change), $AB_ROUNDS alternating rounds.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in ${@}; do case "$step" in
check)
    for b in ${CHECK:-gpu_gemv_packed gpu_decode_graph gpu_llama_tiny}; do t $b 200; done
    ;;
ab)
    IFS=';' read -ra rows <<< "${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph}"
    for r in $(seq 1 "${AB_ROUNDS:-3}"); do for row in "${rows[@]}"; do for pf in ${AB_PF:-0 16 max}; do
        tag="ab-$r-$pf-$(echo "$row" | tr -c 'a-z0-9\n' '_')"
        CFP4_DECODE_ONLY="=$row" CFP4_DECODE_GEMV="l2pf=$pf" timeout 100 \
            ./.carry/decode_bench --bench > "$OUT/$tag.log" 2>&1
        echo "round $r l2pf=$pf rc $? | $(grep -E "^$row" "$OUT/$tag.log" | tail -1)"
    done; done; done
    ;;
abbin)
    IFS=';' read -ra rows <<< "${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph}"
    for r in $(seq 1 "${AB_ROUNDS:-3}"); do for row in "${rows[@]}"; do for bin in decode_bench decode_bench_new; do
        tag="$bin-$r-$(echo "$row" | tr -c 'a-z0-9\n' '_')"
        CFP4_DECODE_ONLY="=$row" timeout 100 ./.carry/$bin --bench > "$OUT/$tag.log" 2>&1
        echo "round $r $bin rc $? | $(grep -E "^$row" "$OUT/$tag.log" | tail -1)"
    done; done; done
    tar -C "$OUT" -cJf "$OUT/abbin-logs.tar.xz" $(cd "$OUT" && ls decode_bench*-*.log) && rm -f "$OUT"/decode_bench*-*.log
    ;;
parts)
    echo "== parts (CFP4_DECODE_GEMV=${PARTS_GEMV:-default})"
    CFP4_DECODE_ONLY="=8b nvfp4 b1 ctx512 kvbf16 graph" CFP4_DECODE_PARTS=1 \
        CFP4_DECODE_GEMV="${PARTS_GEMV:-}" timeout 200 \
        ./.carry/decode_bench --bench > "$OUT/parts.log" 2>&1
    echo "rc $?"; grep -vE "^\s*$" "$OUT/parts.log" | grep -E "parts|chain|x layers|only|norm|full|GEMV|ms/step|tok/s" | tail -16
    ;;
bench)
    echo "== decode_bench"
    timeout 400 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -24 "$OUT/decode_bench.log"
    ;;
esac; done
