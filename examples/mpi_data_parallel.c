/* mpi_data_parallel.c - data-parallel training across MPI processes with dpar's allreduce, and an elastic restart.
   Build: mpicc -std=c99 -O2 -I. examples/mpi_data_parallel.c -o mpi_data_parallel -lm
   Run:   mpirun -np 2 ./mpi_data_parallel
   Check: replicas_identical=yes

   Softmax regression (a linear classifier) on synthetic data: 4 Gaussian blobs in 16 dimensions, 8192 samples.
   dpar_sampler deals each epoch's shuffle over the processes; each computes the gradient of its part of the global
   batch (240 samples a step), and dpar_allreduce(DPAR_AVG) makes every replica take the same step: the model stays
   identical on every rank, which the program checks at the end. On several machines: mpirun -np 8 --hostfile hosts
   ./mpi_data_parallel (see docs/mpi.md).

   Elastic restart: --stop-at K --save PATH stops after step K with a checkpoint (the weights and the step as
   replicas, written once; the sampler's position as the epoch's global count of samples consumed), and --resume
   PATH continues it on any number of processes that divides 240, neither repeating nor skipping a sample:
       mpirun -np 3 ./mpi_data_parallel --steps 60 --stop-at 25 --save run.ckpt
       mpirun -np 2 ./mpi_data_parallel --steps 60 --resume run.ckpt
   ends within float rounding of `mpirun -np 3 ./mpi_data_parallel --steps 60` (tests/run.sh checks it). */
#define DPAR_MPI
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define D 16      /* features */
#define K 4       /* classes */
#define N 8192    /* samples */
#define BATCH 240 /* the global batch of a step */
#define LR 0.5f

static unsigned long long rng_state;
static double uniform(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}
static double gauss(void) { return sqrt(-2.0 * log(uniform() + 1e-300)) * cos(6.283185307179586 * uniform()); }

/* loss and gradient of the mean cross-entropy over the n samples idx; grad is (K, D+1) with the bias last */
static float loss_and_grad(const float *x, const int *y, const size_t *idx, int n, const float *w, float *grad)
{
    double loss = 0;
    int i, k, j;
    memset(grad, 0, sizeof(float) * K * (D + 1));
    for (i = 0; i < n; i++) {
        float z[K], zmax = -1e30f, sum = 0;
        const float *xi = x + idx[i] * D;
        int yi = y[idx[i]];
        for (k = 0; k < K; k++) { /* logits (K) = W (K, D) x (D) + b (K) */
            const float *wk = w + k * (D + 1);
            z[k] = wk[D];
            for (j = 0; j < D; j++) z[k] += wk[j] * xi[j];
            if (z[k] > zmax) zmax = z[k];
        }
        for (k = 0; k < K; k++) sum += (z[k] = expf(z[k] - zmax));
        loss -= log(z[yi] / sum);
        for (k = 0; k < K; k++) { /* d loss / d logit = softmax - onehot */
            float g = z[k] / sum - (k == yi ? 1.0f : 0.0f);
            float *gk = grad + k * (D + 1);
            for (j = 0; j < D; j++) gk[j] += g * xi[j] / (float)n;
            gk[D] += g / (float)n;
        }
    }
    return (float)(loss / n);
}

static void fail(int rank, const char *what)
{
    fprintf(stderr, "mpi_data_parallel: rank %d: %s: %s\n", rank, what, dpar_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

int main(int argc, char **argv)
{
    static float x[N * D], w[K * (D + 1)], grad[K * (D + 1)];
    static int y[N];
    float centers[K][D], loss = 0, first_loss = 0, wmin[K * (D + 1)], wmax[K * (D + 1)];
    int provided, rank, size, i, j, k, steps = 200, stop = 0, b, same = 1;
    const char *save = NULL, *load = NULL;
    int overwrite = 0;
    int64_t state[3] = {0, 0, 0}; /* the next step, the epoch, the epoch's samples consumed by all ranks */
    dpar_ckpt_item items[2];
    dpar_sampler sampler;
    dpar_sampler_desc sd = {0};
    const size_t *mine = NULL;
    size_t have = 0, used = 0;
    dpar_comm *comm;
    uint64_t t_main = dpar_time_ns(), t_init, t_comm, t_first = 0; /* time to the first step (bench=startup) */
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    t_init = dpar_time_ns();
    if (dpar_comm_from_mpi(MPI_COMM_WORLD, NULL, &comm) != DPAR_OK) fail(0, "dpar_comm_from_mpi");
    t_comm = dpar_time_ns();
    rank = dpar_comm_rank(comm);
    size = dpar_comm_size(comm);
    for (i = 1; i < argc; i++) {
        const char *option = argv[i];
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(option, "--overwrite")) { /* the one option without a value */
            overwrite = 1;
            continue;
        }
        if (!value) break;
        if (!strcmp(option, "--steps")) steps = atoi(value);
        else if (!strcmp(option, "--stop-at")) stop = atoi(value);
        else if (!strcmp(option, "--save")) save = value;
        else if (!strcmp(option, "--resume")) load = value;
        else break;
        i++;
    }
    if (i < argc || steps < 1 || stop < 0 || stop > steps || (stop && !save) || (overwrite && !save) || BATCH % size) {
        if (rank == 0)
            fprintf(
                stderr,
                "mpi_data_parallel: [--steps S] [--stop-at K --save PATH [--overwrite]] [--resume PATH], on a number "
                "of processes dividing %d\n",
                BATCH);
        MPI_Finalize();
        return 2;
    }
    b = BATCH / size;
    /* before the first step, on every rank (each writes its shard beside the path): a path that cannot be written,
       or a fresh run over another run's checkpoint */
    if (load && dpar_ckpt_check(load, DPAR_CKPT_RESUME) != DPAR_OK) fail(rank, "--resume");
    if (save) {
        int continues = load && !strcmp(load, save);
        if (dpar_ckpt_check(save, continues || overwrite ? DPAR_CKPT_OVERWRITE : 0) != DPAR_OK)
            fail(rank, "--save (--overwrite replaces it)");
    }

    /* the same data everywhere (a real run reads its samples by index) */
    rng_state = 42;
    for (k = 0; k < K; k++)
        for (j = 0; j < D; j++) centers[k][j] = (float)(2.0 * gauss());
    for (i = 0; i < N; i++) {
        y[i] = (int)(uniform() * K) % K;
        for (j = 0; j < D; j++) x[(size_t)i * D + j] = centers[y[i]][j] + (float)(1.5 * gauss());
    }
    memset(w, 0, sizeof w); /* identical start: no broadcast needed */
    sd.n = N, sd.ranks = size, sd.rank = rank, sd.seed = 7, sd.drop_last = 1;
    if (dpar_sampler_init(&sampler, &sd) != DPAR_OK) fail(rank, "dpar_sampler_init");
    items[0] = dpar_ckpt_replica("w", w, sizeof w); /* the same on every rank: written once */
    items[1] = dpar_ckpt_replica("state", state, sizeof state);
    if (load) { /* saved on any number of processes */
        if (dpar_ckpt_load(comm, load, items, 2) != DPAR_OK) fail(rank, "dpar_ckpt_load");
        have = dpar_sampler_resume(&sampler, (uint64_t)state[1], (size_t)state[2], &mine);
        if (rank == 0)
            printf("resumed from %s at step %lld on %d processes (epoch %lld, %lld of its samples consumed)\n", load,
                   (long long)state[0], size, (long long)state[1], (long long)state[2]);
    } else {
        have = dpar_sampler_epoch(&sampler, 0, &mine);
    }

    for (; state[0] < (stop ? stop : steps); state[0]++) {
        if (used + (size_t)b > have) { /* the epoch is over: the next one's shuffle */
            state[1]++;
            have = dpar_sampler_epoch(&sampler, (uint64_t)state[1], &mine);
            used = 0;
        }
        loss = loss_and_grad(x, y, mine + used, b, w, grad);
        used += (size_t)b;
        /* every rank gets the mean gradient over all shards */
        if (dpar_allreduce(comm, grad, grad, K * (D + 1), DPAR_F32, DPAR_AVG) != DPAR_OK ||
            dpar_allreduce(comm, &loss, &loss, 1, DPAR_F32, DPAR_AVG) != DPAR_OK)
            fail(rank, "dpar_allreduce");
        for (i = 0; i < K * (D + 1); i++) w[i] -= LR * grad[i];
        if (first_loss == 0) first_loss = loss, t_first = dpar_time_ns();
        if (rank == 0 && (state[0] % 40 == 0 || state[0] == steps - 1))
            printf("step %3lld  loss %.4f\n", (long long)state[0], loss);
    }
    if (save) {
        state[2] = (int64_t)dpar_sampler_consumed(&sampler, used); /* the position, whatever the next job's size */
        if (dpar_ckpt_save(comm, save, items, 2) != DPAR_OK) fail(rank, "dpar_ckpt_save");
        if (rank == 0)
            printf("saved step %lld to %s from %d processes (epoch %lld, %lld of its samples consumed)\n",
                   (long long)state[0], save, size, (long long)state[1], (long long)state[2]);
    }

    /* the replicas must be identical, bit for bit */
    dpar_allreduce(comm, w, wmin, K * (D + 1), DPAR_F32, DPAR_MIN);
    dpar_allreduce(comm, w, wmax, K * (D + 1), DPAR_F32, DPAR_MAX);
    for (i = 0; i < K * (D + 1); i++) same &= wmin[i] == wmax[i];
    if (rank == 0)
        printf("train ranks=%d samples=%d first_loss=%.4f final_loss=%.6f replicas_identical=%s weights_sum=%.6f\n",
               size, N, first_loss, loss, same ? "yes" : "no", (double)wmin[0] + wmin[K * (D + 1) - 1]);
    if (rank == 0 && t_first) /* main() to the end of the first step, of which MPI_Init and dpar_comm_from_mpi */
        printf("startup: first_step_ms=%.2f mpi_init_ms=%.2f comm_ms=%.2f\n", (double)(t_first - t_main) * 1e-6,
               (double)(t_init - t_main) * 1e-6, (double)(t_comm - t_init) * 1e-6);
    dpar_sampler_destroy(&sampler);
    dpar_comm_destroy(comm);
    MPI_Finalize();
    return same && (load || stop || loss < 0.5f * first_loss) ? 0 : 1;
}
