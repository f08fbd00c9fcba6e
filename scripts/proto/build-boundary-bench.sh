#!/usr/bin/env bash
# Builds scripts/proto/boundary_bench.cu (sm_90a) into .carry/boundary_bench.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda-env.sh
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o .carry/boundary_bench scripts/proto/boundary_bench.cu
echo "built .carry/boundary_bench"
