#!/bin/sh
# bench/bench_mpi_startup.sh BINARY MPIRUN - time to the first step over MPI (issue 17): examples/mpi_data_parallel.c
# on `MPIRUN -np 2`, five runs, the median by first_step_ms. Prints
#   bench=startup transport=mpi ranks=2 first_step_ms=F mpi_init_ms=I comm_ms=C after_init_ms=F-I
# F: main() to the end of step 0 on rank 0; I: MPI_Init_thread alone; C: dpar_comm_from_mpi (with the node's
# shared block); F-I: everything after MPI_Init (the comm, the data, the first step and its allreduces).
set -u
bin=$1
mpirun=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for round in 1 2 3 4 5; do
    "$mpirun" -np 2 "$bin" >"$tmp/out" 2>&1 </dev/null || { cat "$tmp/out"; exit 1; }
    sed -n 's/^startup: first_step_ms=\([0-9.]*\) mpi_init_ms=\([0-9.]*\) comm_ms=\([0-9.]*\).*/\1 \2 \3/p' "$tmp/out" >>"$tmp/s"
done
[ "$(wc -l <"$tmp/s")" = 5 ] || { echo "bench_mpi_startup: no startup line"; cat "$tmp/out"; exit 1; }
sort -n "$tmp/s" | sed -n 3p | awk '{ printf "bench=startup transport=mpi ranks=2 first_step_ms=%.2f mpi_init_ms=%.2f comm_ms=%.2f after_init_ms=%.2f\n", $1, $2, $3, $1 - $2 }'
