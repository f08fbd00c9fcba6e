#!/usr/bin/env bash
# Twenty-ninth session's device runs: $@ = steps; run through scripts/s29-call.sh (STEPS=...).
# h200: on an H200 only (the issues' measured target): the full decode_bench table of main
#   (.carry/decode_bench), then the norm kernel's L2 prefetch off / on (abpf, same binary),
#   the A/B the twenty-fifth session left for this card.
# gemv: the packed-GEMV harness, plain and with spacers, main's kernels and the
#   warp-specialized ones (.carry/pgemv_bench_ws, docs/logs/s21/ws-library.patch: rejected
#   on the H100, never run on an H200), then the W4A16 peers: issue 15's same-call ratios.
# abws: decode_bench (main) / decode_bench_ws (main with docs/logs/s21/ws-library.patch,
#   its two planner conflicts resolved as a union), $AB_ROWS, $AB_ROUNDS alternating rounds.
# abacc: the norm on the accumulator (docs/logs/s29/prediction-acc-norm.md): decode_bench
#   (main) / decode_bench_acc with the knob off / on (CFP4_DECODE_RESIDUAL_SUMS=1), after
#   gpu_residual_sums_acc and gpu_decode_graph_acc (graph against eager with the knob on,
#   300 steps). The *_acc binaries are built from main with
#   docs/logs/s29/acc-norm/acc-norm.patch applied (rejected: the patch left main).
# tracc: ncu over one 8B b1 graph step of decode_bench_acc, path off / on (per kernel).
# uqctx3: main's decode_bench at 3k UltraQuant (tile bound 12 splits) with 6 / 7 / 16
#   forced: the bounds between 2k (six win) and 4k (sixteen win) that auto_splits has not
#   measured (needs decode_bench built after the 3072 row was added).
# Any other step is scripts/s28-device.sh's (and through it s27's, s26's, ...).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
for step in "$@"; do case "$step" in
h200)
    case "$gpu" in *H200*) ;; *) echo "== h200: skipped on $gpu"; continue ;; esac
    BENCH_BIN=decode_bench BENCH_TIMEOUT="${BENCH_TIMEOUT:-420}" bash scripts/s22-device.sh bench
    PF_BIN=decode_bench AB_ROUNDS="${AB_ROUNDS:-3}" bash scripts/s22-device.sh abpf
    ;;
gemv)
    bash scripts/s22-device.sh spacer
    peers
    ;;
abws)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows abws decode_bench decode_bench_ws
    pack_logs abws
    ;;
abacc)
    t gpu_residual_sums_acc 200
    t gpu_decode_graph_acc 300
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows abacc decode_bench decode_bench_acc "decode_bench_acc CFP4_DECODE_RESIDUAL_SUMS=1"
    pack_logs abacc
    ;;
tracc)
    TRACE_BIN=decode_bench_acc trace "8b nvfp4 b1 ctx512 kvbf16 graph" acc-off
    CFP4_DECODE_RESIDUAL_SUMS=1 TRACE_BIN=decode_bench_acc trace "8b nvfp4 b1 ctx512 kvbf16 graph" acc-on
    ;;
uqctx3)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx3072 kvuq graph}" AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows uqctx3 decode_bench \
        "decode_bench CFP4_DECODE_ATTN=splits=6" "decode_bench CFP4_DECODE_ATTN=splits=7" "decode_bench CFP4_DECODE_ATTN=splits=16"
    pack_logs uqctx3
    ;;
*)
    bash scripts/s28-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
