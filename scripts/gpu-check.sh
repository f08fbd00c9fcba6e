#!/usr/bin/env bash
# gpu-check.sh: builds every cuda-feature test and bench binary here (no GPU needed),
# strips and xz-compresses them into .carry/ (git-ignored), and prints the one device
# command that runs them all on the GPU machine (see docs/benchmarks.md).
#
#   scripts/gpu-check.sh            build + pack; prints the device command
#   CFP4_GPU_TESTS="gpu_gemv kv_cache_gpu" CFP4_GPU_BENCHES="gemv_cuda" scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cfp4-cuda-target}"
tests="${CFP4_GPU_TESTS:-$(cd tests && ls gpu_*.rs kv_cache_gpu*.rs 2>/dev/null | sed 's/\.rs$//' | tr '\n' ' ')}"
benches="${CFP4_GPU_BENCHES:-$(cd benches && grep -l 'features = \["cuda"\]\|cuda_backend' *.rs 2>/dev/null | sed 's/\.rs$//' | tr '\n' ' ')}"
mkdir -p .carry
excl=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$excl")"
grep -qx '/.carry/' "$excl" 2>/dev/null || echo /.carry/ >> "$excl"
rm -f .carry/*
pack() { # $1 = cargo subcommand, $2 = target kind flag, $3 = name
    local exe
    local rel="--release"; [ "$1" = bench ] && rel=""
    # shellcheck disable=SC2086
    exe=$(cargo "$1" $rel --features cuda "$2" "$3" --no-run 2>&1 | tee /dev/stderr | sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -1)
    [ -n "$exe" ] || { echo "gpu-check: no executable for $3" >&2; exit 1; }
    strip "$exe" 2>/dev/null || true
    xz -T2 -6 -c "$exe" > ".carry/$3.xz"
}
for t in $tests; do pack test --test "$t"; done
for b in $benches; do pack bench --bench "$b"; done
ls -la .carry
run="set -o pipefail; for f in .carry/*.xz; do xz -dkf \"\$f\" && chmod +x \"\${f%.xz}\"; done; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv"
for t in $tests; do run="$run; ./.carry/$t --test-threads=1 2>&1 | tee \$OUT/$t.log"; done
for b in $benches; do run="$run; ./.carry/$b --bench 2>&1 | tee \$OUT/$b.log"; done
echo
echo "device command (carry .carry):"
echo "$run"
