/* mpi_data_parallel.c - data-parallel training across MPI processes with dpar's allreduce.
   Build: mpicc -std=c99 -O2 -I. examples/mpi_data_parallel.c -o mpi_data_parallel -lm
   Run:   mpirun -np 2 ./mpi_data_parallel
   Check: replicas_identical=yes

   Softmax regression (a linear classifier) on synthetic data: 4 Gaussian blobs in 16 dimensions.
   Each process holds its own shard of the data (it never leaves the process), computes the
   gradient of its shard, and dpar_allreduce(DPAR_AVG) makes every replica take the same step: the
   model stays identical on every rank, which the program checks at the end. On several machines:
   mpirun -np 8 --hostfile hosts ./mpi_data_parallel (see docs/mpi.md). */
#define DPAR_MPI
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define D 16     /* features */
#define K 4      /* classes */
#define PER 2048 /* samples per process */
#define STEPS 200
#define LR 0.5f

static unsigned long long rng_state;
static double uniform(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}
static double gauss(void) { return sqrt(-2.0 * log(uniform() + 1e-300)) * cos(6.283185307179586 * uniform()); }

/* loss and gradient of the mean cross-entropy over n samples; grad is (K, D+1) with the bias last */
static float loss_and_grad(const float *x, const int *y, int n, const float *w, float *grad)
{
    double loss = 0;
    int i, k, j;
    memset(grad, 0, sizeof(float) * K * (D + 1));
    for (i = 0; i < n; i++) {
        float z[K], zmax = -1e30f, sum = 0;
        const float *xi = x + (size_t)i * D;
        for (k = 0; k < K; k++) { /* logits (K) = W (K, D) x (D) + b (K) */
            const float *wk = w + k * (D + 1);
            z[k] = wk[D];
            for (j = 0; j < D; j++) z[k] += wk[j] * xi[j];
            if (z[k] > zmax) zmax = z[k];
        }
        for (k = 0; k < K; k++) sum += (z[k] = expf(z[k] - zmax));
        loss -= log(z[y[i]] / sum);
        for (k = 0; k < K; k++) { /* d loss / d logit = softmax - onehot */
            float g = z[k] / sum - (k == y[i] ? 1.0f : 0.0f);
            float *gk = grad + k * (D + 1);
            for (j = 0; j < D; j++) gk[j] += g * xi[j] / (float)n;
            gk[D] += g / (float)n;
        }
    }
    return (float)(loss / n);
}

int main(int argc, char **argv)
{
    static float x[PER * D], w[K * (D + 1)], grad[K * (D + 1)];
    static int y[PER];
    float centers[K][D], loss = 0, first_loss = 0, wmin[K * (D + 1)], wmax[K * (D + 1)];
    int provided, rank, size, i, j, k, step, same = 1;
    dpar_comm *comm;
    uint64_t t_main = dpar_time_ns(), t_init, t_comm, t_first = 0; /* time to the first step (bench=startup) */
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    t_init = dpar_time_ns();
    if (dpar_comm_from_mpi(MPI_COMM_WORLD, NULL, &comm) != DPAR_OK) {
        fprintf(stderr, "mpi_data_parallel: %s\n", dpar_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    t_comm = dpar_time_ns();
    rank = dpar_comm_rank(comm);
    size = dpar_comm_size(comm);

    /* the same class centres everywhere; each rank draws its own shard */
    rng_state = 42;
    for (k = 0; k < K; k++)
        for (j = 0; j < D; j++) centers[k][j] = (float)(2.0 * gauss());
    rng_state = 1000 + (unsigned long long)rank;
    for (i = 0; i < PER; i++) {
        y[i] = (int)(uniform() * K) % K;
        for (j = 0; j < D; j++) x[(size_t)i * D + j] = centers[y[i]][j] + (float)(1.5 * gauss());
    }
    memset(w, 0, sizeof w); /* identical start: no broadcast needed */

    for (step = 0; step < STEPS; step++) {
        loss = loss_and_grad(x, y, PER, w, grad);
        /* every rank gets the mean gradient over all shards */
        if (dpar_allreduce(comm, grad, grad, K * (D + 1), DPAR_F32, DPAR_AVG) != DPAR_OK ||
            dpar_allreduce(comm, &loss, &loss, 1, DPAR_F32, DPAR_AVG) != DPAR_OK) {
            fprintf(stderr, "rank %d: %s\n", rank, dpar_last_error());
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        for (i = 0; i < K * (D + 1); i++) w[i] -= LR * grad[i];
        if (step == 0) first_loss = loss, t_first = dpar_time_ns();
        if (rank == 0 && (step % 40 == 0 || step == STEPS - 1)) printf("step %3d  loss %.4f\n", step, loss);
    }

    /* the replicas must be identical, bit for bit */
    dpar_allreduce(comm, w, wmin, K * (D + 1), DPAR_F32, DPAR_MIN);
    dpar_allreduce(comm, w, wmax, K * (D + 1), DPAR_F32, DPAR_MAX);
    for (i = 0; i < K * (D + 1); i++) same &= wmin[i] == wmax[i];
    if (rank == 0)
        printf("train ranks=%d samples=%d first_loss=%.4f final_loss=%.4f replicas_identical=%s\n", size, size * PER,
               first_loss, loss, same ? "yes" : "no");
    if (rank == 0) /* main() to the end of the first step, of which MPI_Init and dpar_comm_from_mpi */
        printf("startup: first_step_ms=%.2f mpi_init_ms=%.2f comm_ms=%.2f\n", (double)(t_first - t_main) * 1e-6,
               (double)(t_init - t_main) * 1e-6, (double)(t_comm - t_init) * 1e-6);
    dpar_comm_destroy(comm);
    MPI_Finalize();
    return same && loss < 0.5f * first_loss ? 0 : 1;
}
