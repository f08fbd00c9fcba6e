#!/usr/bin/env bash
# Builds scripts/proto/bgemv_bench.cu with the BF16-weight variants of the packed GEMV it
# sweeps (sm_90a) and gemv.cu's BF16 kernel into .carry/bgemv_bench (links cuBLAS).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda-env.sh
inc=$(mktemp -d)
{
    echo "#ifdef CFP4_PGEMV_CONFIG"
    echo "constexpr int MAX_WARPS = 8;"
    echo "#else"
    echo "CFP4_PGEMV_BW(1, false, false, 2, Global, bw_plain_u2)"
    echo "CFP4_PGEMV_BW(1, false, false, 3, Global, bw_plain_u3)"
    echo "CFP4_PGEMV_BW(1, false, false, 4, Global, bw_plain_u4)"
    echo "CFP4_PGEMV_BW(1, false, false, 6, Global, bw_plain_u6)"
    echo "CFP4_PGEMV_BW(1, false, true, 2, Global, bw_pair_u2)"
    echo "CFP4_PGEMV_BW(1, false, true, 3, Global, bw_pair_u3)"
    echo "CFP4_PGEMV_BW(1, false, false, 4, Staged, bw_staged_u4)"
    echo "CFP4_PGEMV_BW(1, true, false, 2, Global, bw_silu_u2)"
    echo "CFP4_PGEMV_BW(1, true, false, 3, Global, bw_silu_u3)"
    echo "#endif"
} > "$inc/gemv_packed_instances.inc"
for silu in false true; do
    tag=bf16; [ $silu = true ] && tag=bf16silu
    echo "CFP4_GEMV(1, 1, $silu, false, cfp4_gemv_${tag}_nt1_s1)" >> "$inc/gemv_instances.inc"
done
out=.carry/bgemv_bench${SUFFIX:-}
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels -I"$inc" -Xptxas -v "$@" \
    -o "$out" scripts/proto/bgemv_bench.cu kernels/gemv_packed.cu kernels/gemv.cu -lcublas 2>&1 \
    | grep -E "error|warning|bw_|registers|spill" | grep -B1 -A2 "bw_\|error" | grep -E "error|Function properties for bw|spill|registers" | head -60
rm -rf "$inc"
[ -x "$out" ] && echo "built $out"
