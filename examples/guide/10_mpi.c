/* 10_mpi.c - lesson 10 of the guide (docs/guide/10_mpi.md): the same data-parallel trainer on MPI processes.
   Build: mkdir -p build && mpicc -std=c99 -O2 -DDPAR_MPI -I. examples/guide/10_mpi.c -o build/lesson10 -lm
   Run:   mpirun --oversubscribe -np 2 build/lesson10   (-np 3: three processes; as root: see the page)
   Check: ^ranks: 2 in 2 processes \(one rank per process\)$
   Check: ^every rank = its own serial run: max parameter difference [0-9.e+-]+ < 1e-5; replicas identical$
   Check: ^loss [0-9.]+ -> [0-9.]+: falls, as in the serial run$

   train() is lesson 2's loop for a linear model: each rank's share of the batch, one allreduce of the gradients.
   With -DDPAR_MPI its ranks are processes (mpirun starts them, dpar_comm_from_mpi makes their comm); without it,
   `cc -std=c99 -O2 -I. examples/guide/10_mpi.c -o build/lesson10_threads -pthread -lm && build/lesson10_threads 2`
   runs the very same train() on thread ranks of one process. Each rank checks itself against the serial run every
   process makes. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define D 8       /* features */
#define P (D + 1) /* parameters: w (D), then the bias */
#define NDATA 960 /* samples */
#define BATCH 48  /* global batch: 1, 2, 3, 4, 6 ... ranks divide it */
#define STEPS 200 /* 10 passes over the data */
#define MAX_RANKS 48
#define LR 0.1f /* learning rate */
static float data_x[NDATA * D], data_y[NDATA], ref[P], ref_loss[STEPS], loss_at[STEPS];
static uint32_t seed = 1; /* uniform(): in [-1, 1), a generator of our own, the same numbers on every system */
static float uniform(void) { return (float)((seed = seed * 1664525u + 1013904223u) >> 8) * (2.0f / 16777216) - 1; }
/* the gradient of the mean 0.5 (w.x + b - y)^2 over samples first..first+n-1 into g; returns that mean loss */
static float grad(const float *w, int first, int n, float *g)
{
    float loss = 0;
    int s, k;
    memset(g, 0, P * sizeof *g);
    for (s = first; s < first + n; s++) {
        float e = w[D] - data_y[s]; /* the model's error on sample s */
        for (k = 0; k < D; k++) e += w[k] * data_x[s * D + k];
        loss += 0.5f * e * e / n;
        for (k = 0; k < D; k++) g[k] += e * data_x[s * D + k] / n;
        g[D] += e / n;
    }
    return loss;
}
/* Every process draws the same data and runs the serial trainer itself: it has no memory to share with the others. */
static void setup(void)
{
    float g[P];
    int i, k, step;
    for (i = 0; i < NDATA; i++) {
        data_y[i] = 0.2f * uniform(); /* noise, then w . x */
        for (k = 0; k < D; k++) {
            data_x[i * D + k] = uniform();
            data_y[i] += sinf(k + 1.0f) * data_x[i * D + k];
        }
    }
    for (step = 0; step < STEPS; step++) { /* the serial run: one rank, the whole batch */
        ref_loss[step] = grad(ref, step * BATCH % NDATA, BATCH, g);
        for (i = 0; i < P; i++) ref[i] -= LR * g[i];
    }
}
/* One rank, on threads or processes alike: train, then check this rank and tell the others how it went. */
static dpar_status train(dpar_comm *comm)
{
    int rank = dpar_comm_rank(comm);
    int n = dpar_comm_size(comm);
    int per = BATCH / n; /* my share of each batch */
    int procs = 0;       /* how many processes the ranks are in */
    int step, i, j;
    int32_t pid = (int32_t)getpid();
    int32_t pids[MAX_RANKS]; /* every rank's process id */
    int32_t ok = 1;
    float w[P] = {0};   /* my replica */
    float g[P];         /* the gradient */
    float lo[P], hi[P]; /* each parameter's smallest and largest value over the ranks */
    float loss;
    float first = 0;                                                /* the first step's loss */
    float diff = 0;                                                 /* the largest difference from the serial run */
    dpar_status st = dpar_allgather(comm, &pid, pids, n, DPAR_I32); /* every rank's process id */
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        loss = grad(w, step * BATCH % NDATA + rank * per, per, g); /* my share of the batch */
        st = dpar_allreduce(comm, g, g, P, DPAR_F32, DPAR_AVG);    /* = the gradient of the whole batch */
        if (st == DPAR_OK) st = dpar_allreduce(comm, &loss, &loss, 1, DPAR_F32, DPAR_AVG);
        for (i = 0; i < P; i++) w[i] -= LR * g[i];
        ok &= fabsf(loss - ref_loss[step]) <= 1e-5f * ref_loss[step]; /* the loss of the serial run's step */
        if (step == 0) first = loss;
        if (rank == 0) loss_at[step] = loss;
    }
    for (i = 0; i < P; i++) diff = fmaxf(diff, fabsf(w[i] - ref[i])); /* a NaN fails the loss check */
    ok &= diff < 1e-5f && loss < 0.5f * first;
    /* replicas identical: the largest and the smallest value of each parameter over the ranks are one number */
    if (st == DPAR_OK) st = dpar_allreduce(comm, w, hi, P, DPAR_F32, DPAR_MAX);
    if (st == DPAR_OK) st = dpar_allreduce(comm, w, lo, P, DPAR_F32, DPAR_MIN);
    ok &= memcmp(lo, hi, sizeof lo) == 0;
    if (st == DPAR_OK) st = dpar_allreduce(comm, &ok, &ok, 1, DPAR_I32, DPAR_MIN); /* 1 if every rank is ok */
    if (st == DPAR_OK) st = dpar_allreduce(comm, &diff, &diff, 1, DPAR_F32, DPAR_MAX);
    for (i = 0; i < n; i++) { /* count the different process ids */
        for (j = 0; j < i && pids[j] != pids[i]; j++) continue;
        procs += j == i;
    }
    if (st != DPAR_OK || rank != 0) return st != DPAR_OK ? st : ok ? DPAR_OK : DPAR_EUSER;
#ifdef DPAR_MPI
    ok &= procs == n; /* one rank per process */
#else
    ok &= procs == 1; /* every rank a thread of this process */
#endif
    printf("ranks: %d in %d process%s (%s)\n", n, procs, procs > 1 ? "es" : "",
           procs > 1 ? "one rank per process" : "threads of one process");
    for (step = 0; step < STEPS; step += STEPS / 5)
        printf("step %3d  loss %.6f  (serial run: %.6f)\n", step, loss_at[step], ref_loss[step]);
    if (ok) printf("every rank = its own serial run: max parameter difference %.1e < 1e-5; replicas identical\n", diff);
    if (ok) printf("loss %.4f -> %.4f: falls, as in the serial run\n", first, loss);
    else fprintf(stderr, "FAILED: a rank differs from the serial run\n");
    return ok ? DPAR_OK : DPAR_EUSER;
}

#ifdef DPAR_MPI
int main(int argc, char **argv) /* one rank per process: mpirun starts N copies of this program */
{
    dpar_comm *comm = NULL;
    dpar_status st;
    int n, rank;
    MPI_Init(&argc, &argv);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (n > MAX_RANKS || BATCH % n) { /* every process sees this, so all of them stop; one of them says why */
        if (rank == 0) fprintf(stderr, "10_mpi: the number of processes must divide %d\n", BATCH);
        MPI_Finalize();
        return 2;
    }
    setup();
    if ((st = dpar_comm_from_mpi(MPI_COMM_WORLD, NULL, &comm)) == DPAR_OK) st = train(comm);
    if (st != DPAR_OK && st != DPAR_EUSER) fprintf(stderr, "10_mpi: %s\n", dpar_last_error());
    dpar_comm_destroy(comm);
    MPI_Finalize();
    return st == DPAR_OK ? 0 : 1;
}
#else
static dpar_group *group;
static dpar_status rank_main(void *user, int rank, int n) /* one rank per thread: lesson 2's way */
{
    dpar_comm *comm;
    dpar_status st = dpar_group_join(group, rank, &comm);
    if (st == DPAR_OK) st = train(comm);
    dpar_comm_destroy(comm);
    (void)user;
    (void)n;
    return st;
}
int main(int argc, char **argv)
{
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool = NULL;
    dpar_status st;
    int n = argc > 1 ? atoi(argv[1]) : 2;
    if (n < 1 || n > MAX_RANKS || BATCH % n) {
        fprintf(stderr, "10_mpi: %d ranks: give a number of ranks that divides the batch of %d\n", n, BATCH);
        return 2;
    }
    setup();
    cd.size = n;
    pd.num_threads = n;
    if ((st = dpar_group_create(&cd, &group)) == DPAR_OK && (st = dpar_pool_create(&pd, &pool)) == DPAR_OK)
        st = dpar_pool_run(pool, rank_main, NULL);
    if (st != DPAR_OK && st != DPAR_EUSER) fprintf(stderr, "10_mpi: %s\n", dpar_last_error());
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    return st == DPAR_OK ? 0 : 1;
}
#endif
