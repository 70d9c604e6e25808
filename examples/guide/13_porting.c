/* 13_porting.c - lesson 13 of the guide (docs/guide/13_porting.md): 13_serial.c made data-parallel.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/13_porting.c -o build/lesson13 -pthread -lm
   Run:   build/lesson13
   Check: ^deterministic mode, 8 fixed leaves: 1, 2 and 4 ranks end with the same bits \(crc32 [0-9a-f]{8}\)$
   Check: ^data-parallel = the serial trainer: max weight difference [0-9.e+-]+ < 1e-5$
   MPI:   mpicc -std=c99 -O2 -DDPAR_MPI -I. examples/guide/13_porting.c -o build/lesson13_mpi -lm
          mpirun --oversubscribe -np 4 build/lesson13_mpi   (the crc32 of the thread ranks, on 1, 2, 4 or 8 processes)

   From 13_serial.c: rand() became pick(), a draw from (step, sample) alone; the static scratch buffer each rank's
   own; the gradient is summed over fixed leaves of the batch (dpar_tree_reduce, then a deterministic allreduce),
   so that the weights do not depend on the rank count: 1, 2, 4 or 8 ranks, threads or processes. */
#ifdef DPAR_MPI
#include <mpi.h>
#endif
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define D 8        /* inputs */
#define NDATA 4096 /* samples */
#define BATCH 64   /* samples per step */
#define LEAVES 8   /* the batch in 8 fixed leaves of 8 samples: 1, 2, 4 or 8 ranks */
#define STEPS 300
#define LR 0.1f
static float data_x[NDATA][D], data_y[NDATA]; /* written before the ranks start, then only read: safe to share */

static uint64_t mix(uint64_t z) /* splitmix64's finaliser: a good hash of a counter */
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float uniform(uint64_t i) { return (float)(mix(i) >> 40) * (2.0f / 16777216) - 1; } /* draw number i */
/* sample j of step `step`'s batch: a function of (step, j) alone, so whichever rank draws it gets it */
static int pick(int step, int j) { return (int)(mix(0x5EEDull << 32 | (uint64_t)(step * BATCH + j)) % NDATA); }

/* The serial gradient on samples [j0, j1) of the step's batch, made reentrant: err is the caller's scratch
   (j1 - j0 floats), which was a static buffer. grad gets this part's share of the batch's mean gradient. */
static void gradient(const float *w, int step, int j0, int j1, float *err, float *grad)
{
    int j, k;
    for (j = j0; j < j1; j++) { /* forward */
        const float *x = data_x[pick(step, j)];
        float out = w[D];
        for (k = 0; k < D; k++) out += w[k] * x[k];
        err[j - j0] = out - data_y[pick(step, j)];
    }
    memset(grad, 0, (D + 1) * sizeof(float));
    for (j = j0; j < j1; j++) { /* backward */
        for (k = 0; k < D; k++) grad[k] += err[j - j0] * data_x[pick(step, j)][k] / BATCH;
        grad[D] += err[j - j0] / BATCH;
    }
}

/* One rank's training: its leaves of every batch are [rank * leaves / ranks, (rank + 1) * leaves / ranks).
   out: the weights at the end, then the last step's gradient. */
static dpar_status train(dpar_comm *comm, int rank, int ranks, int leaves, float *out)
{
    float part[LEAVES][D + 1];              /* each of my leaves' gradient */
    float err[BATCH];                       /* gradient()'s scratch: on this rank's stack, no longer a static buffer */
    float *w = out;                         /* the weights */
    float *grad = out + D + 1;              /* the step's gradient */
    const void *mine[LEAVES];               /* my leaves, for the tree */
    int first = rank * leaves / ranks;      /* my first leaf */
    int last = (rank + 1) * leaves / ranks; /* one past my last */
    int size = BATCH / leaves;              /* samples per leaf */
    int step, l, k;
    dpar_status st = DPAR_OK;
    memset(w, 0, (D + 1) * sizeof(float)); /* every rank starts from the same weights: zeros */
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        for (l = first; l < last; l++) {
            gradient(w, step, l * size, (l + 1) * size, err, part[l]);
            mine[l - first] = part[l];
        }
        st = dpar_tree_reduce(grad, mine, last - first, D + 1, DPAR_F32, DPAR_SUM); /* my leaves, in the tree */
        if (st == DPAR_OK) st = dpar_allreduce(comm, grad, grad, D + 1, DPAR_F32, DPAR_SUM); /* the rest of it */
        for (k = 0; k <= D; k++) w[k] -= LR * grad[k];
    }
    return st;
}

static float final[3][LEAVES][2 * (D + 1)]; /* [run][rank]: each rank's weights and last gradient */
static dpar_group *group;
static dpar_status rank_main(void *user, int rank, int ranks) /* a thread rank: join, train, leave */
{
    const int *job = (const int *)user; /* leaves, run */
    dpar_comm *comm;
    dpar_status st = dpar_group_join(group, rank, &comm);
    if (st == DPAR_OK) st = train(comm, rank, ranks, job[0], final[job[1]][rank]);
    dpar_comm_destroy(comm);
    return st;
}
/* Trains on `ranks` thread ranks; deterministic: the fixed leaves and tree, else one leaf per rank. */
static dpar_status run(int ranks, int deterministic, int run)
{
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool = NULL;
    int job[2] = {deterministic ? LEAVES : ranks, run};
    dpar_status st;
    cd.size = ranks;
    pd.num_threads = ranks;
    cd.deterministic = deterministic;
    if ((st = dpar_group_create(&cd, &group)) == DPAR_OK && (st = dpar_pool_create(&pd, &pool)) == DPAR_OK)
        st = dpar_pool_run(pool, rank_main, job);
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    return st;
}

static float max_diff(const float *a, const float *b, int n) /* a NaN counts as a difference */
{
    float d = 0;
    while (n--) d = fabsf(a[n] - b[n]) <= d ? d : fabsf(a[n] - b[n]);
    return d;
}

int main(void)
{
    float serial[D + 1]; /* the serial trainer's weights */
    float grad[D + 1];
    float err[BATCH];
    float truth[D + 1]; /* the weights that make the data */
    float dg[3];        /* the plain port: the last gradient's difference from 1 rank's, for 1, 2 and 4 ranks */
    float ds;           /* the deterministic runs' difference from the serial weights */
    int i, k, step, r, n, det;
    int ok = 1;
    for (k = 0; k <= D; k++) truth[k] = uniform(k); /* the data: the same on every rank and process */
    for (i = 0; i < NDATA; i++) {
        data_y[i] = truth[D] + 0.01f * uniform(100 + (uint64_t)i * (D + 1));
        for (k = 0; k < D; k++) {
            data_x[i][k] = uniform(101 + (uint64_t)i * (D + 1) + k);
            data_y[i] += truth[k] * data_x[i][k];
        }
    }
    memset(serial, 0, sizeof serial); /* the reference: the serial trainer, one thread, the whole batch */
    for (step = 0; step < STEPS; step++) {
        gradient(serial, step, 0, BATCH, err, grad);
        for (k = 0; k <= D; k++) serial[k] -= LR * grad[k];
    }
#ifdef DPAR_MPI /* one rank per process; the reference: one thread rank */
    {
        float w[2 * (D + 1)];
        dpar_comm *comm = NULL;
        dpar_comm_desc cd = {.deterministic = 1};
        MPI_Init(NULL, NULL);
        MPI_Comm_rank(MPI_COMM_WORLD, &r);
        MPI_Comm_size(MPI_COMM_WORLD, &n);
        if (dpar_comm_from_mpi(MPI_COMM_WORLD, &cd, &comm) || train(comm, r, n, LEAVES, w) || run(1, 1, 0)) {
            fprintf(stderr, "process %d: %s\n", r, dpar_last_error());
            MPI_Abort(MPI_COMM_WORLD, 1);
            return 1;
        }
        ok = memcmp(w, final[0][0], sizeof w) == 0 && max_diff(w, serial, D + 1) < 1e-5f;
        printf("process %d of %d: crc32 %08x: %s\n", r, n, dpar_crc32(0, w, sizeof w),
               ok ? "bit for bit those of 1 thread rank" : "FAILED: not those of 1 thread rank");
        dpar_comm_destroy(comm);
        MPI_Finalize();
        return ok ? 0 : 1;
    }
#endif
    for (det = 0; det <= 1; det++) /* the plain port (one leaf per rank, the ring's order), then the deterministic */
        for (i = 0; i < 3; i++) {
            n = 1 << i; /* 1, 2, 4 ranks */
            if (run(n, det, i) != DPAR_OK) {
                fprintf(stderr, "13_porting: %s\n", dpar_last_error());
                return 1;
            }
            if (!det) dg[i] = max_diff(final[i][0] + D + 1, final[0][0] + D + 1, D + 1); /* the last gradients */
            for (r = 0; det && r < n; r++) ok &= memcmp(final[i][r], final[0][0], sizeof final[0][0]) == 0;
        }
    printf("plain allreduce, a leaf per rank: the last gradient of 2 and 4 ranks differs from 1 rank's by %.1e, %.1e\n",
           dg[1], dg[2]);
    if (ok)
        printf("deterministic mode, %d fixed leaves: 1, 2 and 4 ranks end with the same bits (crc32 %08x)\n", LEAVES,
               dpar_crc32(0, final[0][0], sizeof final[0][0]));
    ds = max_diff(final[0][0], serial, D + 1);
    ok &= ds < 1e-5f;
    if (ok) printf("data-parallel = the serial trainer: max weight difference %.1e < 1e-5\n", ds);
    if (!ok) fprintf(stderr, "FAILED: a check against the serial trainer failed\n");
    return ok ? 0 : 1;
}
