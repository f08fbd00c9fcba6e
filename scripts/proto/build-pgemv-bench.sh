#!/usr/bin/env bash
# Builds scripts/proto/pgemv_bench.cu with the kernels it times (sm_90a) into .carry/.
# Usage: [SUFFIX=-x] [DEEP_U=5] scripts/proto/build-pgemv-bench.sh [extra nvcc flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda-env.sh
inc=$(mktemp -d)
{
    echo "#ifdef CFP4_PGEMV_CONFIG"
    echo "constexpr int MAX_WARPS = 8;"
    echo "#else"
    # src/variants.rs PGEMV_KERNELS: (nt, silu, u)
    for v in "1 false 3" "1 false 5" "1 true 3" "2 false 3" "2 true 2" "4 false 2" "4 true 2"; do
        read -r nt silu u <<< "$v"
        tag=fp4; [ "$silu" = true ] && tag=fp4silu
        echo "CFP4_PGEMV($nt, $silu, $u, Global, cfp4_pgemv_${tag}_nt${nt}_u$u)"
    done
    # The harness's deep kernel: DEEP_U pairs in flight (the library's is 5).
    echo "CFP4_PGEMV(1, false, ${DEEP_U:-5}, Global, cfp4_pgemv_fp4_nt1_deep)"
    # The staged kernels (src/variants.rs PGEMV_STAGED_U; the deep one at DEEP_U).
    echo "CFP4_PGEMV(1, false, 3, Staged, cfp4_pgemv_fp4xs_nt1_u3)"
    echo "CFP4_PGEMV(1, false, ${DEEP_U:-5}, Staged, cfp4_pgemv_fp4xs_nt1_deep)"
    echo "CFP4_PGEMV_PAIR(3, cfp4_pgemv_fp4pair_nt1_u3)"
    echo "#endif"
} > "$inc/gemv_packed_instances.inc"
for nt in 1 2 4; do
    for silu in false true; do
        tag=fp4; [ $silu = true ] && tag=fp4silu
        echo "CFP4_GEMV($nt, 1, $silu, true, cfp4_gemv_${tag}_nt${nt}_s1)" >> "$inc/gemv_instances.inc"
    done
done
out=.carry/pgemv_bench${SUFFIX:-}
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels -I"$inc" "$@" \
    -o "$out" scripts/proto/pgemv_bench.cu kernels/gemv_packed.cu kernels/gemv_pack.cu kernels/gemv.cu \
    -L"$CUDA_PATH/lib/stubs" -lcuda
rm -rf "$inc"
echo "built $out"
