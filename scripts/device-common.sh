# Sourced by the session device scripts (scripts/sNN-device.sh) from the repository root on
# the device machine: unpacks the carried binaries, prints the GPU, and defines
#   t BIN [TIMEOUT]   one carried test binary, its log under $OUT, the summary lines here;
#   trace ROW TAG     a per-kernel ncu trace of one decode_bench graph step (row ROW;
#                     the carried binary $TRACE_BIN, default decode_bench);
#   ab_rows PREFIX VARIANT...  decode_bench rows $AB_ROWS under each variant, $AB_ROUNDS rounds;
#   ab_binaries       ab_rows of the carried decode_bench against decode_bench_new, logs packed;
#   card_steps STEP...  the steps plus $ON_H200's on an H200;
#   pack_logs PREFIX  an ab_rows run's logs into one archive.
for f in .carry/*.xz; do [ -e "$f" ] && [ ! -e "${f%.xz}" ] && xz -dk "$f" && chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# card_steps STEP...: the steps named, plus $ON_H200's when the card is an H200 (the
# issues' measured target); says which card and steps on stderr.
card_steps() {
    local gpu s="$*"
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    case "$gpu" in *H200*) s="$s ${ON_H200:-}" ;; esac
    echo "== $gpu: steps $s" >&2
    echo "$s"
}
t() {
    [ -x ".carry/$1" ] || { echo "== $1: not carried"; return; }
    echo "== $1"
    timeout "${2:-120}" ./.carry/$1 --test-threads=1 --nocapture 2>&1 | tee "$OUT/$1.log" \
        | grep -E "^test |test result|FAILED|panicked|worst" | grep -v " ok$" | tail -12
}
trace() {
    echo "== trace $1"
    CFP4_DECODE_ONLY="=$1" CFP4_DECODE_TRACE=1 timeout 200 "$NCU" --profile-from-start off \
        --graph-profiling node --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv --page raw --print-units base \
        "./.carry/${TRACE_BIN:-decode_bench}" --bench > "$OUT/trace-$2.csv" 2> "$OUT/trace-$2.err"
    echo "rc $?"; grep -E "step GPU time|ms/step" "$OUT/trace-$2.err"
    python3 scripts/proto/ncu-step-summary.py "$OUT/trace-$2.csv" | tee "$OUT/trace-$2.txt"
}
# ab_rows PREFIX VARIANT...: each VARIANT is "binary[ ENV=VALUE]"; every round runs every
# row under every variant, one log each ($OUT/PREFIX-round-variant-row.log).
ab_rows() {
    local prefix=$1; shift
    IFS=';' read -ra rows <<< "${AB_ROWS:-8b nvfp4 b1 ctx512 kvbf16 graph}"
    for r in $(seq 1 "${AB_ROUNDS:-3}"); do for row in "${rows[@]}"; do for v in "$@"; do
        read -r bin env <<< "$v"
        tag="$prefix-$r-$(echo "$v $row" | tr -c 'a-z0-9\n' '_')"
        env CFP4_DECODE_ONLY="=$row" $env timeout 100 ./.carry/$bin --bench > "$OUT/$tag.log" 2>&1
        echo "round $r $v rc $? | $(grep -E "^$row" "$OUT/$tag.log" | tail -1)"
    done; done; done
}
# The two carried decode_bench builds (main's and the changed tree's) alternated row by row;
# their logs packed into $OUT/abbin-logs.tar.xz.
ab_binaries() {
    ab_rows abbin decode_bench decode_bench_new
    tar -C "$OUT" -cJf "$OUT/abbin-logs.tar.xz" $(cd "$OUT" && ls abbin-*.log) && rm -f "$OUT"/abbin-*.log
}
# peers: ../shared/peers' W4A16 timings (carried as .carry/w4a16_peers.py, 8B shapes, and
# .carry/w4a16_peers_70b.py, its 70B-shaped twin), for same-call ratios against our kernels.
peers() {
    local p
    for p in w4a16_peers w4a16_peers_70b; do
        [ -e ".carry/$p.py" ] || { echo "== $p: not carried"; continue; }
        echo "== $p"
        timeout "${PEERS_TIMEOUT:-150}" python3 ".carry/$p.py" > "$OUT/$p.log" 2>&1; echo "rc $?"
        [ -e "$OUT/w4a16_peers.json" ] && mv "$OUT/w4a16_peers.json" "$OUT/$p-rows.json"
        grep -E "^copy|^(tinygemm_int4_g128|cublas_bf16) .* M= ?(1|8) " "$OUT/$p.log" | cut -c1-90
    done
}
# pack_logs PREFIX: the $OUT/PREFIX-*.log files of an ab_rows run into
# $OUT/PREFIX-logs.tar.xz (the call brings back one file instead of dozens).
pack_logs() {
    tar -C "$OUT" -cJf "$OUT/$1-logs.tar.xz" $(cd "$OUT" && ls "$1"-*.log) && rm -f "$OUT/$1"-*.log
}
# past_deadline STEP: true, saying so, when STEP would start after $DEADLINE_S seconds of the
# calling script.
past_deadline() {
    [ "$SECONDS" -gt "${DEADLINE_S:-100000}" ] || return 1
    echo "== $1: skipped (deadline)"
}
