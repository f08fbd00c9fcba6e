#!/usr/bin/env bash
# Twenty-sixth session's device runs: $@ = steps; run through scripts/s26-call.sh (STEPS=...).
# abnext: decode_bench with the attention's L2 prefetch of o_proj off (CFP4_DECODE_ATTN=next=0)
#   and on (the default), $AB_ROWS, $AB_ROUNDS alternating rounds; logs packed.
# abnext2: off / the first build / decode_bench_new (the slice's trigger before its wait).
# abmerge: main / decode_bench_new, each with the BF16 combine kernel and the in-kernel merge.
# abmerge2: main / decode_bench_new on the UltraQuant rows and the 8B BF16-cache row.
# abmerge3: main / decode_bench_new / decode_bench_ni (the merge not inlined).
# abcomb: main / decode_bench_new (the combine kernel's loads in flight).
# Any other step is scripts/s25-device.sh's (check, bench, abpf, trsums, ...).
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device-common.sh
steps=$(card_steps "$@")
for step in $steps; do case "$step" in
abnext)
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abnext "decode_bench CFP4_DECODE_ATTN=next=0" decode_bench
    pack_logs abnext
    ;;
abnext2)
    # Off, the first build (the slice triggers the combine after its wait) and
    # decode_bench_new (before it).
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abnext2 "decode_bench CFP4_DECODE_ATTN=next=0" decode_bench decode_bench_new
    pack_logs abnext2
    ;;
abmerge)
    # The split merge: decode_bench (main) and decode_bench_new (merge_splits with its loads
    # in flight), each with the default (BF16: combine kernel) and CFP4_DECODE_ATTN=fused=1.
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph;70b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b8 ctx512 kvbf16 graph;8b nvfp4 b1 ctx32768 kvuq graph;8b nvfp4 b1 ctx32768 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows abmerge decode_bench "decode_bench CFP4_DECODE_ATTN=fused=1" \
        decode_bench_new "decode_bench_new CFP4_DECODE_ATTN=fused=1"
    pack_logs abmerge
    ;;
abmerge2)
    # The UltraQuant rows (in-kernel merge by default) and the 8B BF16-cache row: main against
    # decode_bench_new, defaults only.
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b1 ctx512 kvuq graph;smollm2 nvfp4 b1 ctx512 kvuq graph;8b nvfp4 b1 ctx32768 kvuq graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abmerge2 decode_bench decode_bench_new
    pack_logs abmerge2
    ;;
abmerge3)
    # main, decode_bench_new (the merge inlined) and decode_bench_ni (__noinline__).
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;8b nvfp4 b1 ctx32768 kvuq graph}" \
        AB_ROUNDS="${AB_ROUNDS:-3}" ab_rows abmerge3 decode_bench decode_bench_new decode_bench_ni
    pack_logs abmerge3
    ;;
abcomb)
    # main against decode_bench_new (the combine kernel with its loads in flight).
    AB_ROWS="${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph;smollm2 nvfp4 b1 ctx512 kvbf16 graph}" \
        AB_ROUNDS="${AB_ROUNDS:-2}" ab_rows abcomb decode_bench decode_bench_new
    pack_logs abcomb
    ;;
*)
    ON_H200= bash scripts/s25-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
