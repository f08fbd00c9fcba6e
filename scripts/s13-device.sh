#!/usr/bin/env bash
# Thirteenth session's device runs: $@ = steps (proto | sass | check | kernel | bench | tune | bench-tuned | trace1)
# CHECK="a b": the test binaries of `check` (default: the thirteenth session's list). trace8b: the 8B step.
# proto: every .carry/pgemv_bench_* harness (the bulk-copy GEMV against the register
# pipeline, same run); peers: ../shared/peers' W4A16 timings (same call as our bench).
# Carry: .carry (binaries, xz-compressed or not). Logs under $OUT; summary lines here.
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
trace() { # $1 = decode_bench row name, $2 = log tag: a per-kernel ncu trace of one graph step
    echo "== trace $1"
    CFP4_DECODE_ONLY="=$1" CFP4_DECODE_TRACE=1 timeout 200 "$NCU" --profile-from-start off \
        --graph-profiling node --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv --page raw --print-units base \
        ./.carry/decode_bench --bench > "$OUT/trace-$2.csv" 2> "$OUT/trace-$2.err"
    echo "rc $?"; grep -E "step GPU time|ms/step" "$OUT/trace-$2.err"
    python3 scripts/proto/ncu-step-summary.py "$OUT/trace-$2.csv" | tee "$OUT/trace-$2.txt"
}
for step in ${@}; do case "$step" in
trace1)
    trace "smollm2 nvfp4 b1 ctx512 kvbf16 graph" smollm2
    ;;
trace8b)
    trace "8b nvfp4 b1 ctx512 kvbf16 graph" 8b
    ;;
proto)
    for b in .carry/pgemv_bench_*; do
        case "$b" in *.xz) continue ;; esac
        n=$(basename "$b")
        echo "== $n"
        timeout 150 "$b" > "$OUT/$n.log" 2>&1; echo "rc $?"
        grep -E "FAIL|copy|^\| (8B|70B|S )|read-only" "$OUT/$n.log" | grep -E "FAIL|copy| 1 \||read-only" | cut -c1-170
    done
    ;;
sass)
    for c in .carry/*.cubin; do
        for f in cfp4_pgemv_fp4_nt1 cfp4_pgemv_fp4silu_nt1; do
            echo "== $(basename $c) $f"
            cuobjdump -sass -fun $f "$c" > "$OUT/$(basename $c .cubin)-$f.sass" 2>&1
            python3 scripts/proto/sass-count.py < "$OUT/$(basename $c .cubin)-$f.sass"
        done
    done
    ;;
check)
    for b in ${CHECK:-gpu_norm_gemv gpu_gemv_packed gpu_gemv gpu_norm_greedy gpu_rope gpu_decode_graph gpu_llama_tiny}; do
        [ -e ".carry/$b" ] && t $b 150
    done
    ;;
kernel)
    echo "== pgemv_bench"
    timeout 150 ./.carry/pgemv_bench > "$OUT/pgemv_bench.log" 2>&1; echo "rc $?"
    echo "== peers (8B shapes, then 70B shapes)"
    timeout 120 python3 .carry/w4a16_peers.py > "$OUT/peers_8b.log" 2>&1; echo "rc $?"
    timeout 120 python3 .carry/w4a16_peers_70b.py > "$OUT/peers_70b.log" 2>&1; echo "rc $?"
    grep -E "FAIL|copy|^\| (8B|70B)|read-only" "$OUT/pgemv_bench.log" | grep -E "FAIL|copy| 1 \|" | cut -c1-110
    grep -hE "^tinygemm_int4_g128 .* (1|8) " "$OUT/peers_8b.log" "$OUT/peers_70b.log" | tail -20
    ;;
bench)
    echo "== decode_bench"
    CFP4_DECODE_TRACE=1 timeout 300 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -24 "$OUT/decode_bench.log"
    ;;
tune)
    echo "== tune (8B and 70B with their tensor-parallel-2 shards, SmolLM2)"
    timeout 400 ./.carry/tune --config tests/data/configs/llama-3.1-8b.json \
        --config tests/data/configs/llama-3.1-70b.json --tp 2 \
        --shapes 960x576,576x576,3072x576s,576x1536,49152x576 --ms 1,2,4,6,8,12,16,24,32 \
        --out "$OUT/sm90.json" > "$OUT/tune.log" 2>&1; echo "rc $?"
    grep -E "m= (1|8|32):" "$OUT/tune.log" | cut -c1-150
    ;;
bench-tuned)
    echo "== decode_bench (with the table tune just wrote)"
    [ -s "$OUT/sm90.json" ] && export CANDLE_FP4_TABLES="$OUT"
    CFP4_DECODE_TRACE=1 timeout 200 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $? (tables: ${CANDLE_FP4_TABLES:-built in})"; tail -16 "$OUT/decode_bench.log"
    ;;
esac; done
