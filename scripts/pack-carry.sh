#!/usr/bin/env bash
# pack-carry.sh: builds one cuda-feature test or bench binary here (no GPU needed), strips
# it and xz-compresses it into .carry/ (git-ignored) for a device call's `carry`.
#
#   scripts/pack-carry.sh test gpu_norm_gemv
#   scripts/pack-carry.sh test gpu_decode_graph -p candle-fp4-models
#   scripts/pack-carry.sh bench decode_bench -p candle-fp4-models --features peers
#   OUTNAME=decode_bench_new scripts/pack-carry.sh bench decode_bench -p candle-fp4-models --features peers
# Tests build with --release; benches with cargo's bench profile. Extra arguments go to cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=$1 name=$2
shift 2
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cfp4-cuda-target}"
mkdir -p .carry
excl=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$excl")"
grep -qx '/.carry/' "$excl" 2>/dev/null || echo /.carry/ >> "$excl"
# Two trees of this repository (a worktree with a patch, main) built into one target share
# its build-script output, and build.rs only reruns when a kernel's mtime is newer than its
# last run: a tree built after another would embed the other's cubins. So a tree switch
# touches build.rs.
last="$CARGO_TARGET_DIR/.cfp4-last-tree"
[ "$(cat "$last" 2>/dev/null)" = "$PWD" ] || touch build.rs
mkdir -p "$CARGO_TARGET_DIR" && echo "$PWD" > "$last"
rel="--release"; [ "$kind" = bench ] && rel=""
exe=$(cargo "$kind" $rel --features cuda "$@" "--$kind" "$name" --no-run 2>&1 | tee /dev/stderr \
    | sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -1)
[ -n "$exe" ] || { echo "pack-carry: no executable for $name" >&2; exit 1; }
strip "$exe" 2>/dev/null || true
out="${OUTNAME:-$name}"
xz -T2 -6 -c "$exe" > ".carry/$out.xz"
ls -la ".carry/$out.xz"
