#!/usr/bin/env bash
# Builds scripts/proto/prewait_bench.cu (sm_90a) into .carry/prewait_bench.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda-env.sh
mkdir -p .carry
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o .carry/prewait_bench scripts/proto/prewait_bench.cu
echo "built .carry/prewait_bench"
