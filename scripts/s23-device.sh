#!/usr/bin/env bash
# Twenty-third session's device runs: $@ = steps; run through scripts/s23-call.sh (STEPS=...).
# boundary: scripts/proto/boundary_bench (what a kernel boundary costs in a graph: stream
#   order, PDL's griddepcontrol.wait, or a device-side arrival counter).
# Any other step is scripts/s22-device.sh's (abbin, abpf, bench, check, peers, ...).
# ON_H200="steps": run only when the card is an H200 (the issues' measured target).
set -o pipefail
cd "$(dirname "$0")/.."
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
steps="$*"
case "$gpu" in *H200*) steps="$steps ${ON_H200:-}" ;; esac
echo "== $gpu: steps $steps"
for step in $steps; do case "$step" in
boundary)
    [ -e .carry/boundary_bench.xz ] && xz -dkf .carry/boundary_bench.xz && chmod +x .carry/boundary_bench
    echo "== boundary_bench"
    timeout 120 ./.carry/boundary_bench > "$OUT/boundary.log" 2>&1
    echo "rc $?"; cat "$OUT/boundary.log"
    ;;
*)
    bash scripts/s22-device.sh "$step"
    ;;
esac; done
echo "== done $(date +%T)"
