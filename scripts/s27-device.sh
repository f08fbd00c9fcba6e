#!/usr/bin/env bash
# Twenty-seventh session's device runs: $@ = steps; run through scripts/s27-call.sh (STEPS=...).
# trace_uq: per-kernel ncu trace of the 8B UltraQuant step at 512 and of the BF16-cache step.
# trace_uq_new: the same trace of decode_bench_new's UltraQuant step.
# abuq: decode_bench_new with the UltraQuant step's rope and append inside the attention
#   launches (default) / off (CFP4_DECODE_ATTN=append=0) / ring launched first, against main,
#   on the UltraQuant rows and the 8B BF16-cache row; $AB_ROUNDS rounds; logs packed.
# abwht: main / decode_bench_new (the query's rotation by one warp per row), UltraQuant rows.
# abbusy: main / decode_bench_new (the warp merge skips warps without tiles), with the 8B
#   BF16-cache row.
# abmw: main / decode_bench_new (the warp merge's weights once per (warp, head)).
# abuqmerge: main's UltraQuant rows, in-kernel split merge (default) / combine kernel.
# abrule: main / decode_bench_new (the UltraQuant merge rule: combine up to 8 partials).
# uqsplits2: the merge rule's build, UltraQuant splits at 512: heuristic / 6 / 12, 3 rounds.
# uqsplits: the UltraQuant launch's split count forced (CFP4_DECODE_ATTN=splits=N), 512 and 32k.
# Any other step is scripts/s26-device.sh's (abcomb, ...) and through it s25's (check, bench, ...).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
steps=$(card_steps "$@")
for step in $steps; do case "$step" in
trace_uq)
    trace "8b nvfp4 b1 ctx512 kvuq graph" uq512
    trace "8b nvfp4 b1 ctx512 kvbf16 graph" bf512
    ;;
trace_uq_new)
    TRACE_BIN=decode_bench_new trace "8b nvfp4 b1 ctx512 kvuq graph" uq512new
    ;;
abuq)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b1 ctx32768 kvuq graph;smollm2 nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b8 ctx512 kvuq graph;8b nvfp4 b32 ctx512 kvuq graph;8b nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows abuq decode_bench decode_bench_new \
        "decode_bench_new CFP4_DECODE_ATTN=append=0" "decode_bench_new CFP4_DECODE_ATTN=ring=1"
    pack_logs abuq
    ;;
abwht)
    # main / decode_bench_new (the query rotated by one warp per row in registers).
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b1 ctx32768 kvuq graph;smollm2 nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b8 ctx512 kvuq graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abwht decode_bench decode_bench_new
    pack_logs abwht
    ;;
abbusy)
    # main / decode_bench_new (the CTA's warp merge bounded by the warps with tiles).
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b1 ctx32768 kvuq graph;smollm2 nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b8 ctx512 kvuq graph;8b nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abbusy decode_bench decode_bench_new
    pack_logs abbusy
    ;;
abmw)
    # main / decode_bench_new (the warp merge's weights once per (warp, head)).
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b1 ctx32768 kvuq graph;smollm2 nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b8 ctx512 kvuq graph;8b nvfp4 b1 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abmw decode_bench decode_bench_new
    pack_logs abmw
    ;;
abuqmerge)
    # main's UltraQuant rows with the in-kernel split merge (default) / the combine kernel.
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b1 ctx32768 kvuq graph;smollm2 nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b8 ctx512 kvuq graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abuqmerge decode_bench "decode_bench CFP4_DECODE_ATTN=fused=0"
    pack_logs abuqmerge
    ;;
abrule)
    # main / decode_bench_new (UltraQuant: the combine kernel up to 8 partials per head).
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b1 ctx32768 kvuq graph;smollm2 nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b8 ctx512 kvuq graph;8b nvfp4 b32 ctx512 kvuq graph;8b nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abrule decode_bench decode_bench_new
    pack_logs abrule
    ;;
uqsplits2)
    # decode_bench_new (the merge rule): the UltraQuant launch's splits at 512, heuristic / 6 / 12.
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvuq graph;smollm2 nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b8 ctx512 kvuq graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows uqsplits2 decode_bench_new "decode_bench_new CFP4_DECODE_ATTN=splits=6" \
        "decode_bench_new CFP4_DECODE_ATTN=splits=12"
    pack_logs uqsplits2
    ;;
uqsplits)
    # The UltraQuant launch's split count at 512 and 32k (heuristic: 3 at 512, 16 at 32k).
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b1 ctx32768 kvuq graph}" \
        AB_ROUNDS="${AB_ROUNDS:-1}" ab_rows uqsplits decode_bench "decode_bench CFP4_DECODE_ATTN=splits=1" \
        "decode_bench CFP4_DECODE_ATTN=splits=2" "decode_bench CFP4_DECODE_ATTN=splits=6" \
        "decode_bench CFP4_DECODE_ATTN=splits=12" "decode_bench CFP4_DECODE_ATTN=splits=24"
    pack_logs uqsplits
    ;;
*)
    ON_H200= bash scripts/s26-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
