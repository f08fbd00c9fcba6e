#!/usr/bin/env bash
# Twenty-second session's device runs: $@ = steps (abbin | abc | abd | abe | abpf | bench |
# check | wscheck | spacer | window | peers); run through scripts/s22-call.sh (STEPS=...).
# abbin: $AB_ROWS of the carried decode_bench (main) against decode_bench_new (main with
#   docs/logs/s21/ws-library.patch applied), $AB_ROUNDS alternating rounds.
# check: main's GPU tests. wscheck: the patched tree's gpu_gemv_packed (carried as
#   gpu_gemv_packed_ws). spacer: scripts/s21-device.sh's harness step with the
#   warp-specialized rows too (pgemv_bench built from the patched tree). peers: the W4A16 peers.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
for step in ${@}; do case "$step" in
abbin)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_binaries
    ;;
abc)
    # main; this tree without the GEMVs' next-layer prefetch (the norm prefetch only); this tree.
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows abc decode_bench "decode_bench_new CFP4_DECODE_NO_PREFETCH_NEXT=1" decode_bench_new
    tar -C "$OUT" -cJf "$OUT/abc-logs.tar.xz" $(cd "$OUT" && ls abc-*.log) && rm -f "$OUT"/abc-*.log
    ;;
abd)
    # main (with the norm prefetch) against the q|k|v -> o prefetch at the end of q|k|v's
    # main loop (decode_bench_d: docs/logs/s22/prefetch-next's patch, only that link).
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abd decode_bench_new decode_bench_d
    tar -C "$OUT" -cJf "$OUT/abd-logs.tar.xz" $(cd "$OUT" && ls abd-*.log) && rm -f "$OUT"/abd-*.log
    ;;
abe)
    # main (the norm's prefetch-only CTAs wait for the previous GEMV) against
    # decode_bench_e (they prefetch at once, in the previous GEMV's tail).
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abe decode_bench_new decode_bench_e
    tar -C "$OUT" -cJf "$OUT/abe-logs.tar.xz" $(cd "$OUT" && ls abe-*.log) && rm -f "$OUT"/abe-*.log
    ;;
bench)
    echo "== decode_bench (${BENCH_BIN:-decode_bench_new})"
    timeout "${BENCH_TIMEOUT:-380}" "./.carry/${BENCH_BIN:-decode_bench_new}" --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -40 "$OUT/decode_bench.log"
    ;;
abpf)
    # One binary ($PF_BIN, default decode_bench_new) with and without the norms' L2
    # prefetch (CFP4_DECODE_NO_L2_PREFETCH=1).
    pf_bin="${PF_BIN:-decode_bench_new}"
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abpf "$pf_bin CFP4_DECODE_NO_L2_PREFETCH=1" "$pf_bin"
    tar -C "$OUT" -cJf "$OUT/abpf-logs.tar.xz" $(cd "$OUT" && ls abpf-*.log) && rm -f "$OUT"/abpf-*.log
    ;;
check)
    for b in ${CHECK:-gpu_norm_gemv gpu_gemv_packed gpu_decode_graph gpu_llama_tiny}; do t $b 200; done
    ;;
wscheck)
    t gpu_gemv_packed_ws 200
    ;;
spacer)
    shapes="${SPACER_SHAPES:-8B qkv,8B o,8B gate|up,8B down,70B qkv,70B o,70B down}"
    for mode in plain spacer; do
        echo "== pgemv_bench ($mode)"
        env $([ $mode = spacer ] && echo CFP4_PGEMV_SPACER=1) CFP4_PGEMV_WS=1 CFP4_PGEMV_M1=1 \
            CFP4_PGEMV_ONLY="$shapes" timeout 300 ./.carry/pgemv_bench_ws > "$OUT/pgemv_$mode.log" 2>&1
        echo "rc $?"; grep -E "^copy|^spacers|^\| (8B|70B)|ws \(|FAIL|failures" "$OUT/pgemv_$mode.log" | head -30
    done
    ;;
peers)
    peers
    ;;
window)
    # The harness in the spacer protocol with a DRAM-idle window in the spacer
    # ($WINDOW_NS, default 6000) and the next call's weights prefetched to L2 in it
    # ($WINDOW_PF MB per case, 0 = none); plus the plain spacer for reference.
    shapes="${WINDOW_SHAPES:-8B qkv,8B o,8B gate|up,8B down,70B o}"
    for c in "0 0" "${WINDOW_NS:-6000} 0" ${WINDOW_CASES:-"6000 100" "6000 20" "2000 100"}; do
        read -r ns pf <<< "$c"
        echo "== pgemv_bench window $ns ns, prefetch $pf MB"
        CFP4_PGEMV_SPACER=1 CFP4_PGEMV_SPACER_NS=$ns CFP4_PGEMV_SPACER_PF=$pf CFP4_PGEMV_M1=1 \
            CFP4_PGEMV_ONLY="$shapes" timeout 200 ./.carry/pgemv_bench > "$OUT/pgemv_w${ns}_pf$pf.log" 2>&1
        echo "rc $?"; grep -E "^copy|^\| (8B|70B)|FAIL|failures" "$OUT/pgemv_w${ns}_pf$pf.log" | head -12
    done
    ;;
esac; done
echo "== done $(date +%T)"
