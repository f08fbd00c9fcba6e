#!/usr/bin/env bash
# Fifteenth session's device runs: $@ = steps (check | bench | bench-tp)
# CHECK="a b": the test binaries of `check`. bench-tp: decode_bench's 70B rows, plain and
# through NCCL (CFP4_DECODE_TP=${TP:-1}: one rank on a one-GPU machine, the sum still runs
# in the graph). NCCL comes from the image's PyTorch wheels (nvidia-nccl-cu13); NVLink
# multicast stays off (NCCL_NVLS_ENABLE=0, as the device's KINDS.md asks).
# Carry: .carry (binaries, xz-compressed or not). Logs under $OUT; summary lines here.
set -o pipefail
cd "$(dirname "$0")/.."
for f in .carry/*.xz; do [ -e "$f" ] && xz -dkf "$f" && chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
export NCCL_NVLS_ENABLE=0
nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$nccl" ] && export LD_LIBRARY_PATH="$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "nccl: ${nccl:-not found}"
t() { # one test binary: its log under $OUT, the summary lines here
    [ -x ".carry/$1" ] || { echo "== $1: not carried"; return; }
    echo "== $1"
    timeout "${2:-120}" ./.carry/$1 --test-threads=1 --nocapture 2>&1 | tee "$OUT/$1.log" \
        | grep -E "^test |test result|FAILED|panicked|worst" | grep -v " ok$" | tail -12
}
for step in ${@}; do case "$step" in
check)
    for b in ${CHECK:-gpu_tensor_parallel gpu_decode_graph gpu_llama_tiny}; do
        [ -e ".carry/$b" ] && t $b 200
    done
    ;;
bench-tp)
    echo "== decode_bench 70B rows, tp ${TP:-1} through NCCL"
    CFP4_DECODE_ONLY=70b CFP4_DECODE_TP=${TP:-1} timeout 400 ./.carry/decode_bench --bench \
        > "$OUT/decode_bench_tp.log" 2>&1
    echo "rc $?"; tail -8 "$OUT/decode_bench_tp.log"
    ;;
bench)
    echo "== decode_bench"
    timeout 400 ./.carry/decode_bench --bench > "$OUT/decode_bench.log" 2>&1
    echo "rc $?"; tail -24 "$OUT/decode_bench.log"
    ;;
esac; done
