#!/usr/bin/env bash
# Sixteenth session's device runs: $@ = steps (proto | kernel | check | bench)
# proto: every carried .carry/pgemv_bench-* build on $SHAPES (CFP4_PGEMV_ONLY), logs under
# $OUT, the M = 1 rows here. check: $CHECK test binaries. bench: decode_bench + peers.
set -o pipefail
cd "$(dirname "$0")/.."
for f in .carry/*.xz; do [ -e "$f" ] && xz -dkf "$f" && chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
t() { # one test binary: its log under $OUT, the summary lines here
    [ -x ".carry/$1" ] || { echo "== $1: not carried"; return; }
    echo "== $1"
    timeout "${2:-120}" ./.carry/$1 --test-threads=1 --nocapture 2>&1 | tee "$OUT/$1.log" \
        | grep -E "^test |test result|FAILED|panicked|worst" | grep -v " ok$" | tail -12
}
SHAPES=${SHAPES:-8B qkv,8B o,8B down,8B lm_head,70B qkv,70B o,70B down,S down}
for step in ${@}; do case "$step" in
proto)
    for b in .carry/pgemv_bench-*; do
        case "$b" in *.xz) continue;; esac
        n=${b#.carry/pgemv_bench-}
        CFP4_PGEMV_ONLY="$SHAPES" timeout 200 "$b" > "$OUT/pgemv-$n.log" 2>&1
        echo "== $n rc $? $(head -1 "$OUT/pgemv-$n.log")"
    done
    for b in "$OUT"/pgemv-*.log; do
        echo "-- $(basename "$b")"; grep -E "^\| .* \| 1 \||FAIL|pair sweep m=1" "$b" | cut -c1-150 | head -30
    done
    ;;
kernel)
    echo "== pgemv_bench (the library's plan, pair kernel included), then one-tile only"
    timeout 150 ./.carry/pgemv_bench > "$OUT/pgemv_bench.log" 2>&1; echo "rc $?"
    CFP4_PGEMV_NOPAIR=1 timeout 150 ./.carry/pgemv_bench > "$OUT/pgemv_bench_nopair.log" 2>&1; echo "rc $?"
    echo "== peers (8B shapes, then 70B shapes)"
    timeout 120 python3 .carry/w4a16_peers.py > "$OUT/peers_8b.log" 2>&1; echo "rc $?"
    timeout 120 python3 .carry/w4a16_peers_70b.py > "$OUT/peers_70b.log" 2>&1; echo "rc $?"
    for f in pgemv_bench pgemv_bench_nopair; do
        echo "-- $f"; grep -E "FAIL|copy|^\| (8B|70B)" "$OUT/$f.log" | grep -E "FAIL|copy| (1|8) \|" | cut -c1-110
    done
    grep -hE "^(tinygemm_int4_g128|cublas|torch).* (1|8) " "$OUT/peers_8b.log" "$OUT/peers_70b.log" | tail -40
    ;;
check)
    for b in ${CHECK:-gpu_gemv_packed gpu_decode_graph gpu_llama_tiny}; do t $b 200; done
    ;;
bench)
    echo "== decode_bench"
    timeout 400 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -24 "$OUT/decode_bench.log"
    ;;
esac; done
