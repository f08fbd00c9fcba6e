#!/usr/bin/env bash
# Eleventh session's device runs: $1 = check | trace | bench | tune
# check: the GPU tests of the decode path; trace: a per-kernel ncu trace of one graph step
# (SmolLM2 and 8B, batch 1) plus the step's GPU time by events; bench: decode_bench;
# tune: the tune binary on a small shape set.
# Carry: .carry (xz-compressed binaries). Logs under $OUT; summary lines here.
set -o pipefail
cd "$(dirname "$0")/.."
for f in .carry/*.xz; do [ -e "$f" ] && xz -dkf "$f" && chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
t() { # one test binary: its log under $OUT, the summary lines here
    [ -x ".carry/$1" ] || { echo "== $1: not carried"; return; }
    echo "== $1"
    timeout "${2:-120}" ./.carry/$1 --test-threads=1 --nocapture 2>&1 | tee "$OUT/$1.log" \
        | grep -E "^test |test result|FAILED|panicked" | grep -v " ok$" | tail -12
}
trace() { # $1 = decode_bench row name, $2 = log tag
    echo "== trace $1"
    CFP4_DECODE_ONLY="=$1" CFP4_DECODE_TRACE=1 timeout 200 "$NCU" --profile-from-start off \
        --graph-profiling node --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv --page raw --print-units base \
        ./.carry/decode_bench --bench > "$OUT/trace-$2.csv" 2> "$OUT/trace-$2.err"
    echo "rc $?"; grep -E "step GPU time|ms/step" "$OUT/trace-$2.err"
    python3 scripts/proto/ncu-step-summary.py "$OUT/trace-$2.csv" | tee "$OUT/trace-$2.txt"
}
for step in ${@}; do case "$step" in
check)
    [ -e .carry/gpu_gemv_packed.xz ] && t gpu_gemv_packed 150
    t gpu_norm_greedy 60
    t gpu_rope 60
    t gpu_decode_graph 150
    t gpu_llama_tiny 120
    ;;
trace)
    trace "smollm2 nvfp4 b1 ctx512 kvbf16 graph" smollm2
    trace "8b nvfp4 b1 ctx512 kvbf16 graph" 8b
    ;;
trace1)
    trace "smollm2 nvfp4 b1 ctx512 kvbf16 graph" smollm2
    ;;
trace8b)
    trace "8b nvfp4 b1 ctx512 kvbf16 graph" 8b
    ;;
tune)
    echo "== tune"
    timeout 120 ./.carry/tune --config tests/data/modelopt_tiny/config.json \
        --shapes 4096x4096,28672x4096s --ms 1,8,16,32 --out "$OUT/tune.json" \
        > "$OUT/tune.log" 2>&1; echo "rc $?"; tail -8 "$OUT/tune.log"
    ;;
bench)
    echo "== decode_bench"
    CFP4_DECODE_TRACE=1 timeout 300 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; grep -A1 "step GPU time" "$OUT/decode_bench.log" | grep -v "^--" | paste - - | cut -c1-150
    tail -24 "$OUT/decode_bench.log"
    ;;
esac; done
