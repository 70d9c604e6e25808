/* bench_mpi.c - dpar's ring allreduce over MPI next to MPI_Allreduce, in the same run.

   Build: mpicc -std=c99 -O2 -I. bench/bench_mpi.c -o bench_mpi
   Run:   mpirun -np 2 ./bench_mpi [max_bytes]      (4 B to 64 MiB by default; rank 0 prints one line per size)

   For each size: f32 sum, both ranks, alternating samples of dpar_allreduce (the algorithm chosen by
   size, printed as algo=: one-shot for small ones, through the block the processes of a node share,
   the ring over MPI point-to-point above, in segments of DPAR_MPI_SEGMENT_BYTES, 1 MiB), the same on
   a comm made with DPAR_MPI_SHM=0 (msg_us: one-shot over messages, as between nodes), dpar_allreduce
   forced to the ring (ring_us: the state before the choice by size) and MPI_Allreduce; medians of 7. The
   order changes from sample to sample so that none always follows the same one (a balanced Latin square):
   the call right after an MPI_Allreduce of 64 MiB took 33-228 ms where the same ring otherwise took 17-27.
   Every comm has the default options, as a program that sets none gets them.
   ratio = mpi_us / dpar_us, msg_ratio = mpi_us / msg_us, ring_ratio = mpi_us / ring_us: above 1
   means dpar is faster. rt_ns: the machine's round trip of a cache line between ranks 0 and 1 (below).

   Then alltoallv, 4 KiB to 4 MiB sent per rank (bytes=, rank 0's): uneven counts (rank i sends
   u (1 + (i + 2 j) % 3) f32 to rank j), dpar_alltoallv on a default comm (the pairwise rounds, the count check on)
   against MPI_Alltoallv with the same counts and displacements, alternating samples, medians of 7;
   ratio = mpi_us / us. */
#define DPAR_MPI
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <stdio.h>
#include <stdlib.h>

#include "line_probe.h"

#define SAMPLES 7

/* The machine's price of a message between ranks 0 and 1 (bench/line_probe.h), through an MPI-3 shared window,
   right before each size: rt_ns in its line (0 where the processes are not all on one node). It tells a small
   size's figure measured while the host had the two virtual CPUs far apart. */
#define PROBE_TRIPS 5000
static int *probe_ball; /* [0]: the ball (rank 0 throws), [16]: the answer (rank 1), lines of their own */
static int probe_base;
static double roundtrip_ns(int me)
{
    int base = probe_base;
    double ns = 0;
    probe_base += PROBE_TRIPS;
    if (!probe_ball) return 0;
    MPI_Barrier(MPI_COMM_WORLD);
    if (me < 2) ns = line_pingpong(&probe_ball[0], &probe_ball[16], me, base, PROBE_TRIPS);
    MPI_Barrier(MPI_COMM_WORLD);
    return ns;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    size_t max_bytes, bytes, i;
    int me, n, provided, s, k, j;
    /* 0 dpar (auto), 1 ring, 2 over messages, 3 MPI_Allreduce */
    static const int order[4][4] = {{0, 1, 3, 2}, {1, 2, 0, 3}, {2, 3, 1, 0}, {3, 0, 2, 1}};
    float *x, *y;
    dpar_comm *c, *cr, *cm;
    dpar_comm_desc d;
    dpar_comm_stats st;
    MPI_Comm node;
    MPI_Win win = MPI_WIN_NULL;
    int node_size, one_node;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &node_size);
    one_node = node_size == n;
    MPI_Allreduce(MPI_IN_PLACE, &one_node, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (one_node && n > 1) { /* the probe's two lines, in rank 0's part of a shared window */
        MPI_Aint size;
        int unit;
        void *mine, *at;
        MPI_Win_allocate_shared(me == 0 ? 128 : 0, 1, MPI_INFO_NULL, node, &mine, &win);
        MPI_Win_shared_query(win, 0, &size, &unit, &at);
        probe_ball = (int *)at;
        if (me == 0) memset(at, 0, 128);
        MPI_Barrier(MPI_COMM_WORLD);
    }
    max_bytes = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : (size_t)64 << 20;
    memset(&d, 0, sizeof d); /* the defaults, as a program gets them (segments of DPAR_MPI_SEGMENT_BYTES) */
    if (dpar_comm_from_mpi(MPI_COMM_WORLD, &d, &c) != DPAR_OK) {
        fprintf(stderr, "bench_mpi: %s\n", dpar_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    setenv("DPAR_MPI_SHM", "0", 1); /* one-shot over messages */
    if (dpar_comm_from_mpi(MPI_COMM_WORLD, &d, &cm) != DPAR_OK) {
        fprintf(stderr, "bench_mpi: %s\n", dpar_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    unsetenv("DPAR_MPI_SHM");
    d.algo = DPAR_ALGO_RING;
    if (dpar_comm_from_mpi(MPI_COMM_WORLD, &d, &cr) != DPAR_OK) {
        fprintf(stderr, "bench_mpi: %s\n", dpar_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    x = (float *)malloc(max_bytes);
    y = (float *)malloc(max_bytes);
    for (i = 0; i < max_bytes / sizeof(float); i++) {
        x[i] = (float)(i % 7);
        y[i] = 0;
    }
    for (bytes = 4; bytes <= max_bytes; bytes *= 4) {
        size_t count = bytes / sizeof(float);
        int reps = bytes <= 65536 ? 500 : bytes <= (1u << 20) ? 50 : bytes <= (16u << 20) ? 20 : 2;
        double t_dpar[SAMPLES], t_mpi[SAMPLES], t_ring[SAMPLES], t_msg[SAMPLES], rt = roundtrip_ns(me);
        for (s = -1; s < SAMPLES; s++) /* sample -1 warms them up */
            for (j = 0; j < 4; j++) {  /* row s mod 4 of a balanced Latin square: in 4 rows each follows each once */
                int which = order[(s + 4) % 4][j];
                dpar_comm *on = which == 0 ? c : which == 1 ? cr : cm;
                double t0, *into = which == 0 ? t_dpar : which == 1 ? t_ring : which == 2 ? t_msg : t_mpi;
                MPI_Barrier(MPI_COMM_WORLD);
                t0 = MPI_Wtime();
                for (k = 0; k < reps; k++) {
                    if (which == 3) MPI_Allreduce(x, y, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                    else dpar_allreduce(on, x, y, count, DPAR_F32, DPAR_SUM);
                }
                MPI_Barrier(MPI_COMM_WORLD);
                if (s >= 0) into[s] = (MPI_Wtime() - t0) * 1e6 / reps;
            }
        qsort(t_dpar, SAMPLES, sizeof(double), cmp_double);
        qsort(t_mpi, SAMPLES, sizeof(double), cmp_double);
        qsort(t_ring, SAMPLES, sizeof(double), cmp_double);
        qsort(t_msg, SAMPLES, sizeof(double), cmp_double);
        dpar_comm_stats_get(c, &st);
        if (me == 0) {
            printf("bench=allreduce transport=mpi ranks=%d bytes=%zu algo=%s dpar_us=%.2f mpi_us=%.2f ratio=%.2f "
                   "msg_us=%.2f msg_ratio=%.2f ring_us=%.2f ring_ratio=%.2f rt_ns=%.0f\n",
                   n, bytes, dpar_algo_name(st.last_algo), t_dpar[SAMPLES / 2], t_mpi[SAMPLES / 2],
                   t_mpi[SAMPLES / 2] / t_dpar[SAMPLES / 2], t_msg[SAMPLES / 2],
                   t_mpi[SAMPLES / 2] / t_msg[SAMPLES / 2], t_ring[SAMPLES / 2],
                   t_mpi[SAMPLES / 2] / t_ring[SAMPLES / 2], rt);
            fflush(stdout);
        }
    }
    { /* alltoallv against MPI_Alltoallv */
        size_t *sc = (size_t *)malloc(4 * (size_t)n * sizeof(size_t)), *sd = sc + n, *rc = sc + 2 * n, *rd = sc + 3 * n;
        int *ic = (int *)malloc(4 * (size_t)n * sizeof(int)), q;
        for (bytes = 4096; bytes <= ((size_t)4 << 20) && bytes * 2 <= max_bytes; bytes *= 4) {
            size_t unit = bytes / sizeof(float) / (2 * (size_t)n), sent = 0, got = 0;
            int reps = bytes <= 65536 ? 200 : bytes <= (1u << 20) ? 20 : 5;
            double t_v[SAMPLES], t_m[SAMPLES];
            for (q = 0; q < n; q++) {
                sc[q] = unit * (size_t)(1 + (me + 2 * q) % 3), rc[q] = unit * (size_t)(1 + (q + 2 * me) % 3);
                sd[q] = sent, rd[q] = got;
                sent += sc[q], got += rc[q];
            }
            for (q = 0; q < 4 * n; q++) ic[q] = (int)sc[q];
            for (s = -1; s < SAMPLES; s++)
                for (j = 0; j < 2; j++) { /* which goes first alternates */
                    int mpi = (j + s + 2) % 2;
                    double t0;
                    MPI_Barrier(MPI_COMM_WORLD);
                    t0 = MPI_Wtime();
                    for (k = 0; k < reps; k++) {
                        if (mpi)
                            MPI_Alltoallv(x, ic, ic + n, MPI_FLOAT, y, ic + 2 * n, ic + 3 * n, MPI_FLOAT,
                                          MPI_COMM_WORLD);
                        else dpar_alltoallv(c, x, sc, sd, y, rc, rd, DPAR_F32);
                    }
                    MPI_Barrier(MPI_COMM_WORLD);
                    if (s >= 0) (mpi ? t_m : t_v)[s] = (MPI_Wtime() - t0) * 1e6 / reps;
                }
            qsort(t_v, SAMPLES, sizeof(double), cmp_double);
            qsort(t_m, SAMPLES, sizeof(double), cmp_double);
            if (me == 0) {
                printf("bench=alltoallv transport=mpi ranks=%d bytes=%zu us=%.2f mpi_us=%.2f ratio=%.2f\n", n,
                       sent * sizeof(float), t_v[SAMPLES / 2], t_m[SAMPLES / 2], t_m[SAMPLES / 2] / t_v[SAMPLES / 2]);
                fflush(stdout);
            }
        }
        free(sc);
        free(ic);
    }
    dpar_comm_destroy(c);
    dpar_comm_destroy(cr);
    dpar_comm_destroy(cm);
    free(x);
    free(y);
    if (win != MPI_WIN_NULL) MPI_Win_free(&win);
    MPI_Comm_free(&node);
    MPI_Finalize();
    return 0;
}
