/* 02_data_parallel.c - lesson 2 of the guide (docs/guide/02_data_parallel.md): data parallelism, the simple way.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/02_data_parallel.c -o build/lesson02 -pthread -lm
   Run:   build/lesson02     (build/lesson02 2: two ranks; the ranks must divide the batch, 64)
   Check: ^ranks: [0-9]+ replicas identical bit for bit$
   Check: ^data-parallel = one thread on the whole batch: max parameter difference [0-9.e+-]+ < 1e-4$
   Check: ^loss [0-9.]+ \(first epoch\) -> [0-9.]+ \(last epoch\): falls$

   Every rank holds a whole copy of the model and trains on its own slice of each batch; after backward one
   allreduce averages the gradients, so every rank takes the same step and the copies never drift. The fast
   version (buckets overlapping backward, a sampler, a split update) is examples/data_parallel.c. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define D 4                   /* inputs */
#define H 16                  /* hidden units */
#define P (H * D + H + H + 1) /* parameters: W1 (H,D), b1 (H), w2 (H), b2 (1), in one flat array */
#define NDATA 1024            /* samples */
#define BATCH 64              /* global batch: every rank gets BATCH / ranks of it */
#define EPOCH (NDATA / BATCH) /* steps per pass over the data */
#define STEPS 640             /* 40 epochs of 16 steps */
#define LR 0.3f
#define MAX_RANKS 64
static float data_x[NDATA * D], data_y[NDATA]; /* sample i: inputs data_x + i * D, target data_y[i] */
static float init[P], final[MAX_RANKS][P], loss_at[STEPS];
static dpar_group *group;
static uint32_t seed = 1;

/* uniform in [-1, 1): a generator of our own (not rand()), so the numbers are the same on every system */
static float uniform(void)
{
    seed = seed * 1664525u + 1013904223u;
    return (float)(seed >> 8) * (2.0f / 16777216) - 1;
}

/* Forward and backward of the MLP y = w2 . tanh(W1 x + b1) + b2 on n samples with the mean squared error.
   Writes the gradient of the mean loss into grad (P floats) and returns the mean loss. */
static float forward_backward(const float *p, const float *x, const float *y, int n, float *grad)
{
    const float *W1 = p, *b1 = p + H * D, *w2 = p + H * D + H, *b2 = p + H * D + 2 * H;
    float *gW1 = grad, *gb1 = grad + H * D, *gw2 = grad + H * D + H, *gb2 = grad + H * D + 2 * H;
    float loss = 0, h[H];
    int s, j, k;
    memset(grad, 0, P * sizeof(float));
    for (s = 0; s < n; s++) {
        float out = *b2, err, dh;
        for (j = 0; j < H; j++) { /* forward: hidden layer, then the output */
            float a = b1[j];
            for (k = 0; k < D; k++) a += W1[j * D + k] * x[s * D + k];
            h[j] = tanhf(a);
            out += w2[j] * h[j];
        }
        err = out - y[s]; /* d(0.5 err^2)/d(out) */
        loss += 0.5f * err * err;
        *gb2 += err / n; /* backward: the output, then through tanh to W1 */
        for (j = 0; j < H; j++) {
            gw2[j] += err * h[j] / n;
            dh = err * w2[j] * (1 - h[j] * h[j]) / n;
            gb1[j] += dh;
            for (k = 0; k < D; k++) gW1[j * D + k] += dh * x[s * D + k];
        }
    }
    return loss / n;
}

static void sgd(float *p, const float *grad)
{
    int i;
    for (i = 0; i < P; i++) p[i] -= LR * grad[i];
}

/* One rank: its own copy of the weights (as a process would have), its slice of every batch. */
static dpar_status rank_main(void *user, int rank, int ranks)
{
    float p[P], grad[P], loss;
    int step, per_rank = BATCH / ranks;
    dpar_comm *comm;
    dpar_status st = dpar_group_join(group, rank, &comm); /* if it fails, the loop does not run */
    (void)user;
    memcpy(p, init, sizeof p); /* every rank starts from the same weights */
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        int first = (step * BATCH) % NDATA + rank * per_rank; /* this rank's slice of the batch */
        loss = forward_backward(p, data_x + first * D, data_y + first, per_rank, grad);
        /* The one line that makes it data-parallel: every rank ends with the average of all ranks'
           gradients, which is the gradient of the whole batch (each slice has the same size). */
        st = dpar_allreduce(comm, grad, grad, P, DPAR_F32, DPAR_AVG);
        if (st == DPAR_OK) st = dpar_allreduce(comm, &loss, &loss, 1, DPAR_F32, DPAR_AVG); /* for printing */
        sgd(p, grad);
        if (rank == 0) loss_at[step] = loss;
    }
    memcpy(final[rank], p, sizeof p);
    dpar_comm_destroy(comm);
    return st;
}

int main(int argc, char **argv)
{
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool;
    float ref[P], grad[P], ref_loss[STEPS], diff = 0, first_epoch = 0, last_epoch = 0;
    int i, k, r, step, ranks = argc > 1 ? atoi(argv[1]) : 4, ok = 1;
    if (ranks < 1 || ranks > MAX_RANKS || BATCH % ranks) {
        fprintf(stderr, "02_data_parallel: %d ranks: give 1 to %d ranks that divide the batch of %d\n", ranks,
                MAX_RANKS, BATCH);
        return 2;
    }
    /* the data and the initial weights, drawn once here, before any thread starts */
    for (i = 0; i < NDATA; i++) {
        for (k = 0; k < D; k++) data_x[i * D + k] = uniform();
        data_y[i] = sinf(3 * data_x[i * D + 0]) + data_x[i * D + 1] * data_x[i * D + 2] - 0.5f * data_x[i * D + 3];
    }
    for (i = 0; i < P; i++) init[i] = 0.5f * uniform();
    /* The reference: one thread, the whole batch of each step, the same steps. */
    memcpy(ref, init, sizeof ref);
    for (step = 0; step < STEPS; step++) {
        int first = (step * BATCH) % NDATA;
        ref_loss[step] = forward_backward(ref, data_x + first * D, data_y + first, BATCH, grad);
        sgd(ref, grad);
    }
    /* The data-parallel run: a group of `ranks` thread ranks, one per thread of a pool. */
    cd.size = ranks;
    pd.num_threads = ranks;
    if (dpar_group_create(&cd, &group) != DPAR_OK || dpar_pool_create(&pd, &pool) != DPAR_OK ||
        dpar_pool_run(pool, rank_main, NULL) != DPAR_OK) {
        fprintf(stderr, "failed: %s\n", dpar_last_error());
        return 1;
    }
    for (step = 0; step < STEPS; step += STEPS / 8)
        printf("step %3d  loss %.5f  (one thread: %.5f)\n", step, loss_at[step], ref_loss[step]);
    for (r = 1; r < ranks; r++) ok &= memcmp(final[r], final[0], sizeof final[0]) == 0;
    if (ok) printf("ranks: %d replicas identical bit for bit\n", ranks);
    for (i = 0; i < P; i++) /* written so that a NaN counts as a difference (fmaxf would drop it) */
        if (!(fabsf(final[0][i] - ref[i]) <= diff)) diff = fabsf(final[0][i] - ref[i]);
    ok &= diff < 1e-4f;
    if (ok) printf("data-parallel = one thread on the whole batch: max parameter difference %.1e < 1e-4\n", diff);
    for (step = 0; step < EPOCH; step++) { /* the mean loss of the first and of the last epoch */
        first_epoch += loss_at[step] / EPOCH;
        last_epoch += loss_at[STEPS - EPOCH + step] / EPOCH;
    }
    ok &= last_epoch < 0.25f * first_epoch;
    if (ok) printf("loss %.4f (first epoch) -> %.4f (last epoch): falls\n", first_epoch, last_epoch);
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    if (!ok) fprintf(stderr, "FAILED: a check against the one-thread reference failed\n");
    return ok ? 0 : 1;
}
