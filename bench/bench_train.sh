#!/bin/sh
# bench/bench_train.sh BINARY [BENCH_CORES] - the data-parallel training benchmark of examples/data_parallel.c:
# 784-1024-1024-10, global batch 256, on 1 and on 2 thread ranks, alternating (1 2 1 2 ...) so both
# see the same machine; the median of seven runs each. Prints
#   bench=train layers=784,1024,1024,10 batch=256 threads=T samples_per_s=X gemm_frac=F
# and the 2-rank speed-up over 1 rank (the goal: 1.8 or more, with gemm_frac 0.85 or more), and
#   bench=startup threads=2 first_step_ms=X data_ms=D setup_and_step_ms=X-D init_ms=I setup_ms=U step0_ms=Z step_ms=S
# (of X: D making the data, I the weights, U dpar's objects: pool, group, comm, sampler, buckets, stealing,
# Z the first step, its first allreduces included; S a later step, for scale)
# the time from main() to the end of the first step on 2 ranks (median of the rounds).
# The reference for that speed-up, measured in the same rounds: two independent 1-rank processes
# at batch 128 each, run at once (bench=train_ceiling): the same work split in two with no
# communication, each with its own copy of the weights (the example's ranks share one, so they
# can beat it). Each round's 2-rank run over the 1-rank run just before it gives a paired ratio;
# their median is paired_speedup (robust to the machine's speed drifting between rounds).
# With BENCH_CORES (bench/bench_cores.c), the machine's own 2-thread ceiling is measured too, after
# the rounds: register-only FMAs and the step's GEMMs alone (of_gemm_ceiling = speedup over it).
set -u
bin=$1
cores=${2:-}
steps=${BENCH_TRAIN_STEPS:-30}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for round in 1 2 3 4 5 6 7; do
    for t in 1 2; do
        "$bin" --layers 784,1024,1024,10 --batch 256 --steps "$steps" --threads "$t" >"$tmp/out" 2>&1 || { cat "$tmp/out"; exit 1; }
        sps=$(sed -n 's/^train samples_per_s=\([0-9.]*\) .*/\1/p' "$tmp/out")
        frac=$(sed -n 's/^time: .*gemm_frac=\([0-9.]*\).*/\1/p' "$tmp/out")
        echo "$sps $frac" >>"$tmp/t$t"
        [ "$t" = 2 ] && sed -n 's/^startup: first_step_ms=\([0-9.]*\) data_ms=\([0-9.]*\) init_ms=\([0-9.]*\) setup_ms=\([0-9.]*\) step0_ms=\([0-9.]*\).*/\1 \2 \3 \4 \5/p' "$tmp/out" >>"$tmp/s"
        [ "$t" = 2 ] && sed -n 's/^time: step_ms=\([0-9.]*\) .*/\1/p' "$tmp/out" >>"$tmp/st"
        [ "$t" = 1 ] && one=$sps
    done
    awk -v a="$one" -v b="$sps" 'BEGIN { print b / a }' >>"$tmp/pair"
    "$bin" --layers 784,1024,1024,10 --batch 128 --steps "$steps" --threads 1 >"$tmp/c1" 2>&1 &
    "$bin" --layers 784,1024,1024,10 --batch 128 --steps "$steps" --threads 1 >"$tmp/c2" 2>&1 || { cat "$tmp/c2"; exit 1; }
    wait $! || { cat "$tmp/c1"; exit 1; }
    sed -n 's/^train samples_per_s=\([0-9.]*\) .*/\1/p' "$tmp/c1" "$tmp/c2" | awk '{ s += $1 } END { print s }' >>"$tmp/c"
done
for t in 1 2; do
    sort -n "$tmp/t$t" | sed -n 4p >"$tmp/m$t" # the median by throughput
    read -r sps frac <"$tmp/m$t"
    echo "bench=train layers=784,1024,1024,10 batch=256 threads=$t samples_per_s=$sps gemm_frac=$frac"
done
read -r s1 f1 <"$tmp/m1"
read -r s2 f2 <"$tmp/m2"
# time to the first step on 2 ranks (issue 17): main() to the end of step 1, of which the data, and a
# later step's time for scale (the first step's own compute is part of the total)
sort -n "$tmp/s" | sed -n 4p >"$tmp/sm"
read -r fs ds is us zs <"$tmp/sm"
stm=$(sort -n "$tmp/st" | sed -n 4p)
awk -v f="$fs" -v d="$ds" -v i="$is" -v u="$us" -v z="$zs" -v s="$stm" 'BEGIN { printf "bench=startup threads=2 first_step_ms=%.2f data_ms=%.2f setup_and_step_ms=%.2f init_ms=%.2f setup_ms=%.2f step0_ms=%.2f step_ms=%.2f goal_ms=20\n", f, d, f - d, i, u, z, s }'

c=$(sort -n "$tmp/c" | sed -n 4p)
p=$(sort -n "$tmp/pair" | sed -n 4p)
awk -v a="$s1" -v b="$s2" -v c="$c" -v p="$p" 'BEGIN {
    printf "bench=train_ceiling threads=2 samples_per_s=%.1f speedup=%.2f (two 1-rank processes, batch 128 each, no communication)\n", c, c / a
    printf "bench=train_scaling threads=2 speedup=%.2f paired_speedup=%.2f goal=1.80 of_ceiling=%.2f\n", b / a, p, b / c }'
if [ -n "$cores" ]; then
    line=$("$cores" 7) || exit 1
    echo "$line"
    g=$(echo "$line" | sed -n 's/.*gemm_speedup=\([0-9.]*\).*/\1/p')
    awk -v p="$p" -v g="$g" 'BEGIN { printf "bench=train_of_machine threads=2 paired_speedup=%.2f gemm_speedup=%.2f of_gemm_ceiling=%.2f\n", p, g, p / g }'
fi
