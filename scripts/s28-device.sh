#!/usr/bin/env bash
# Twenty-eighth session's device runs: $@ = steps; run through scripts/s28-call.sh (STEPS=...).
# abcl: decode_bench with the combine kernel (CFP4_DECODE_ATTN=cluster=0) / the splits
#   merged inside a thread-block cluster where they fit one (cluster=1), BF16-cache rows, one
#   binary, $AB_ROUNDS rounds; logs packed. Needs a binary of the cluster-merge patch
#   (docs/logs/s28/cluster-merge/): main's decode_bench has no `cluster` knob.
# uqctx: the UltraQuant launch's split count at 1k / 2k / 512 (heuristic / 6 / 12 splits),
#   one binary, $AB_ROUNDS rounds: the data the split floor's rule needs.
# abfloor: decode_bench (the cluster build, its cluster merge off) / decode_bench_new (the
#   UltraQuant split floor), UltraQuant rows and one BF16-cache control row.
# uqctx2: decode_bench_new (the floor) at 2k / 4k UltraQuant: default / 6 / 7 / 12 splits.
# Any other step is scripts/s27-device.sh's (and through it s26's, s25's: check, bench, ...).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
steps=$(card_steps "$@")
for step in $steps; do case "$step" in
abcl)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;8b nvfp4 b32 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b1 ctx32768 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abcl "${CL_BIN:-decode_bench} CFP4_DECODE_ATTN=cluster=0" "${CL_BIN:-decode_bench} CFP4_DECODE_ATTN=cluster=1"
    pack_logs abcl
    ;;
uqctx)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx1024 kvuq graph;8b nvfp4 b1 ctx2048 kvuq graph;8b nvfp4 b1 ctx512 kvuq graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows uqctx "${CL_BIN:-decode_bench}" "${CL_BIN:-decode_bench} CFP4_DECODE_ATTN=splits=6" \
        "${CL_BIN:-decode_bench} CFP4_DECODE_ATTN=splits=12"
    pack_logs uqctx
    ;;
abfloor)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b1 ctx1024 kvuq graph;smollm2 nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b8 ctx512 kvuq graph;8b nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows abfloor "decode_bench CFP4_DECODE_ATTN=cluster=0" decode_bench_new
    pack_logs abfloor
    ;;
uqctx2)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx2048 kvuq graph;8b nvfp4 b1 ctx4096 kvuq graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows uqctx2 decode_bench_new "decode_bench_new CFP4_DECODE_ATTN=splits=6" \
        "decode_bench_new CFP4_DECODE_ATTN=splits=7" "decode_bench_new CFP4_DECODE_ATTN=splits=12"
    pack_logs uqctx2
    ;;
*)
    ON_H200= bash scripts/s27-device.sh "$step"
    ;;
esac; done
