/* 04_buckets.c - lesson 4 of the guide (docs/guide/04_buckets.md): communication overlapped with backward.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/04_buckets.c -o build/lesson04 -pthread -lm
   Run:   build/lesson04           (build/lesson04 4: four ranks, dividing 32)
   Check: ^both ways: every rank's gradients = the serial mean \(max difference [0-9.e+-]+ of [0-9.e+-]+\)$
   Check: ^communication under backward: [0-9]+ buckets in flight [0-9.]+ ms of the [0-9.]+ ms of backward$

   The same data-parallel steps twice: as in lesson 2 (backward, then one dpar_allreduce), then with buckets: each
   layer's gradients go to dpar_buckets once backward has written them, and their allreduce runs (on the rank's
   progress thread) while backward computes the layers below. Times: rank 0's, per step. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define L 6           /* layers, each h' = tanh(W h) with W of W x W (no biases, to stay short) */
#define W 256         /* width */
#define P (L * W * W) /* parameters; layer l's weights (and gradients) at l * W * W */
#define BATCH 32      /* global batch */
#define STEPS 6       /* per way */
#define MAXR 8
enum { PLAIN, BUCKETS };

static float x[BATCH * W], target[BATCH * W], init[P];
static float local[MAXR][P], reduced[2][MAXR][P]; /* step 0's gradients: [rank] before, [way][rank] after */
static float params[MAXR][P], grads[MAXR][P], acts[MAXR][(L + 1) * BATCH * W], deltas[MAXR][2 * BATCH * W];
static double ms_backward[2], ms_wait[2], ms_window; /* rank 0's, per step */
static int nbuckets;                                 /* as dpar_buckets_count says */

static void forward(const float *p, float *h, int n) /* h: (L+1, n, W); h[0] holds the input */
{
    int l, b, j, k;
    for (l = 0; l < L; l++)
        for (b = 0; b < n; b++)
            for (j = 0; j < W; j++) {
                float a = 0;
                for (k = 0; k < W; k++) a += p[l * W * W + j * W + k] * h[(l * n + b) * W + k];
                h[((l + 1) * n + b) * W + j] = tanhf(a);
            }
}

/* Backward from the last layer to the first; after each layer's weight gradient, buckets (if any) are told
   that it is final: its allreduce can start while the layers below are computed. */
static dpar_status backward(const float *p, const float *h, const float *y, float *d, float *d2, float *g, int n,
                            dpar_buckets *buckets)
{
    int l, b, j, k, i;
    dpar_status st;
    for (i = 0; i < n * W; i++) /* the loss 0.5 |h_L - y|^2 / BATCH, through the last tanh */
        d[i] = (h[L * n * W + i] - y[i]) / BATCH * (1 - h[L * n * W + i] * h[L * n * W + i]);
    for (l = L - 1; l >= 0; l--) {
        const float *in = h + l * n * W; /* the layer's input */
        const float *Wl = p + l * W * W; /* its weights */
        float *gl = g + l * W * W;       /* their gradients */
        float *swap;
        for (j = 0; j < W; j++) /* dW = d^T in: (W, W) */
            for (k = 0; k < W; k++) {
                float s = 0;
                for (b = 0; b < n; b++) s += d[b * W + j] * in[b * W + k];
                gl[j * W + k] = s;
            }
        /* layer l's gradients are final: its bucket's allreduce starts now, under the layers below */
        if (buckets && (st = dpar_buckets_ready(buckets, (size_t)l * W * W, W * W)) != DPAR_OK) return st;
        for (b = 0; l > 0 && b < n; b++) /* the gradient for the layer below: d2 = (d W) * tanh' */
            for (k = 0; k < W; k++) {
                float s = 0;
                for (j = 0; j < W; j++) s += d[b * W + j] * Wl[j * W + k];
                d2[b * W + k] = s * (1 - in[b * W + k] * in[b * W + k]);
            }
        swap = d; /* d2 becomes the next layer's d */
        d = d2;
        d2 = swap;
    }
    return DPAR_OK;
}

/* Each rank: its own weights, gradients and activations; STEPS steps of SGD the plain way, then with buckets. */
static dpar_status rank_main(void *user, int rank, int ranks)
{
    int n = BATCH / ranks, way, step, i;
    float *p = params[rank], *g = grads[rank], *h = acts[rank], *d = deltas[rank];
    dpar_comm *comm = NULL;
    dpar_status st = dpar_group_join((dpar_group *)user, rank, &comm); /* user: the group, from main */
    memcpy(h, x + rank * n * W, n * W * sizeof *h); /* this rank's slice of the batch (the same each step) */
    for (way = PLAIN; way <= BUCKETS && st == DPAR_OK; way++) {
        dpar_buckets_desc bd = {0};
        dpar_buckets *buckets = NULL;
        bd.comm = comm;
        bd.grads = g;
        bd.count = P;
        bd.op = DPAR_AVG;
        bd.bucket_bytes = W * W * sizeof(float);
        if (way == BUCKETS) st = dpar_buckets_create(&bd, &buckets); /* one bucket per layer */
        if (way == BUCKETS && rank == 0) nbuckets = dpar_buckets_count(buckets);
        memcpy(p, init, P * sizeof *p);
        for (step = 0; step < STEPS && st == DPAR_OK; step++) {
            uint64_t t0, t1, t2;
            forward(p, h, n);
            t0 = dpar_time_ns();
            st = backward(p, h, target + rank * n * W, d, d + n * W, g, n, buckets);
            if (step == 0 && way == PLAIN) memcpy(local[rank], g, P * sizeof *g); /* not reduced yet */
            t1 = dpar_time_ns();
            if (st == DPAR_OK)
                st = way == PLAIN ? dpar_allreduce(comm, g, g, P, DPAR_F32, DPAR_AVG) : dpar_buckets_wait(buckets);
            t2 = dpar_time_ns();
            if (step == 0) memcpy(reduced[way][rank], g, P * sizeof *g);
            for (i = 0; i < P; i++) p[i] -= 0.5f * g[i];
            if (rank == 0 && step > 0) { /* step 0 warms up; the others are averaged */
                ms_backward[way] += (t1 - t0) / 1e6 / (STEPS - 1);
                ms_wait[way] += (t2 - t1) / 1e6 / (STEPS - 1);
                if (way == BUCKETS) ms_window += dpar_buckets_overlap_ns(buckets) / 1e6 / (STEPS - 1);
            }
        }
        dpar_buckets_destroy(buckets);
    }
    dpar_comm_destroy(comm);
    return st;
}

int main(int argc, char **argv)
{
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool;
    dpar_group *group;
    double diff = 0, big = 0; /* the largest difference from the reference; the largest gradient */
    int ranks = 2;
    int i, r, way;
    int ok = 1;
    if (argc > 1) {
        char *end;
        long asked = strtol(argv[1], &end, 10);
        ranks = *end == '\0' && asked >= 1 && asked <= MAXR && BATCH % asked == 0 ? (int)asked : 0;
        if (ranks == 0) {
            fprintf(stderr,
                    "04_buckets: '%s' ranks: give a number of ranks from 1 to %d that divides the batch of %d\n",
                    argv[1], MAXR, BATCH);
            return 2;
        }
    }
    for (i = 0; i < P; i++) init[i] = 0.1f * sinf(i); /* fixed values: no random numbers needed */
    for (i = 0; i < BATCH * W; i++) {
        x[i] = cosf(i);
        target[i] = 0.5f * sinf(0.3f * i);
    }
    cd.size = ranks;
    pd.num_threads = ranks;
    if (dpar_group_create(&cd, &group) != DPAR_OK || dpar_pool_create(&pd, &pool) != DPAR_OK ||
        dpar_pool_run(pool, rank_main, group) != DPAR_OK) {
        fprintf(stderr, "04_buckets: %s\n", dpar_last_error());
        return 1;
    }
    for (i = 0; i < P; i++) { /* the reference: the mean of the ranks' gradients, one serial loop */
        double mean = 0;
        for (r = 0; r < ranks; r++) mean += local[r][i] / ranks;
        big = fabs(mean) > big ? fabs(mean) : big;
        for (way = PLAIN; way <= BUCKETS; way++)
            for (r = 0; r < ranks; r++)
                if (!(fabs(reduced[way][r][i] - mean) <= diff)) diff = fabs(reduced[way][r][i] - mean);
    }
    ok &= big > 0 && diff <= 1e-5 * big;
    if (ok) printf("both ways: every rank's gradients = the serial mean (max difference %.1e of %.1e)\n", diff, big);
    printf("plain:   backward %.2f ms, then dpar_allreduce %.2f ms\n", ms_backward[PLAIN], ms_wait[PLAIN]);
    printf("buckets: backward %.2f ms, then dpar_buckets_wait %.2f ms\n", ms_backward[BUCKETS], ms_wait[BUCKETS]);
    /* the window (first bucket's start to the wait) lies inside backward; one layer's bytes: a bucket per layer */
    ok &= nbuckets == L && ms_window > 0 && ms_window <= ms_backward[BUCKETS] + 0.5;
    if (ok)
        printf("communication under backward: %d buckets in flight %.2f ms of the %.2f ms of backward\n", nbuckets,
               ms_window, ms_backward[BUCKETS]);
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    if (!ok) fprintf(stderr, "FAILED: a result differs from its reference\n");
    return ok ? 0 : 1;
}
