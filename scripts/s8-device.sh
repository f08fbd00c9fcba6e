#!/usr/bin/env bash
# Eighth session's device runs (restructuring check): $1 = tests | benches.
set -o pipefail
for f in .carry/*.xz; do xz -dkf "$f" && chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
case "$1" in
tests)
    ./.carry/gpu_gemv --test-threads=1 2>&1 | tee $OUT/gpu_gemv.log | tail -4
    ./.carry/kv_cache_gpu --test-threads=1 2>&1 | tee $OUT/kv_cache_gpu.log | tail -4
    ./.carry/gpu_llama_tiny --test-threads=1 2>&1 | tee $OUT/gpu_llama_tiny.log | tail -4
    ;;
sass)
    # Instruction mix of the M = 1 GEMV kernels (NVFP4 and BF16, split 1): static counts.
    for k in cfp4_gemv_fp4_nt1_s1 cfp4_gemv_bf16_nt1_s1 cfp4_gemv_fp4silu_nt1_s1; do
        cuobjdump --dump-sass --function $k .carry/gemv_sm90a.cubin > $OUT/$k.sass 2>&1
        echo "== $k: $(grep -cE '^\s+/\*[0-9a-f]{4}\*/' $OUT/$k.sass) instructions"
        grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9_]+' $OUT/$k.sass | awk '{print $NF}' | sed 's/\..*//' | sort | uniq -c | sort -rn | head -14 | tr '\n' ' '; echo
    done
    ;;
benches)
    export CFP4_BENCH_QUICK=1 CFP4_KV_BENCH_POINTS=1024x1,32768x1,32768x8
    for r in 1 2; do
        ./.carry/old_gemv_cuda --bench > $OUT/gemv_old_$r.log 2>&1
        ./.carry/gemv_cuda --bench > $OUT/gemv_new_$r.log 2>&1
        ./.carry/old_kv_attention_cuda --bench > $OUT/kv_old_$r.log 2>&1
        ./.carry/kv_attention_cuda --bench > $OUT/kv_new_$r.log 2>&1
    done
    ./.carry/old_host_cost_cuda --bench > $OUT/host_cost_old.log 2>&1
    ./.carry/host_cost_cuda --bench > $OUT/host_cost_new.log 2>&1
    for f in $OUT/gemv_*_2.log $OUT/kv_*_2.log $OUT/host_cost_*.log; do echo "== $f"; tail -14 $f; done
    ;;
esac
