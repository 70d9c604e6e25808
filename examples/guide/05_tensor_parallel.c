/* 05_tensor_parallel.c - lesson 5 of the guide (docs/guide/05_tensor_parallel.md): tensor parallelism.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/05_tensor_parallel.c -o build/lesson05 -pthread -lm
   Run:   build/lesson05   (build/lesson05 4: four ranks; 1, 2, 4, 8 or 16)
   Check: ^forward: every rank's y = the serial y \(max difference [0-9.e+-]+\)$
   Check: ^backward: every rank's dx and its slices of dW1, dW2 = the serial ones \(max difference [0-9.e+-]+\)$
   Check: ^allreduces: 2 per step \(forward: y after the row layer; backward: dx of the column layer\)$
   Check: ^[0-9]+ steps of SGD: loss [0-9.]+ -> [0-9.]+, every rank's slices = the serial ones \(max difference

   The block y = tanh(x W1) W2 (Megatron's MLP) cut over tp ranks: W1 by columns (rank r computes its own hidden units
   from the whole x: no communication), W2 by the same rows (its hidden units times its rows give a partial sum of y:
   allreduce #1 adds them). Backward mirrors it: the gradient of x sums every rank's part (allreduce #2). Both are
   written out with dpar_allreduce; dpar_linear (docs/model_parallel.md) packages the same two layers. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define B 8  /* rows of the batch */
#define D 8  /* the block's input and output width */
#define F 16 /* hidden units; rank r owns f = F / tp of them */
#define STEPS 200
#define LR 0.5f
#define MAXR 16
static float x[B * D], t[B * D], W1[D * F], W2[F * D]; /* data, targets, the whole starting weights */
typedef struct result {                                /* what a rank holds after a step */
    float ypart[B * D];                                /* its part of y, before allreduce #1 */
    float y[B * D];                                    /* y, after it */
    float dx[B * D];                                   /* the gradient of the block's input, after allreduce #2 */
    float dw1[D * F];                                  /* the gradient of its slice of W1 */
    float dw2[F * D];                                  /* and of W2 */
} result;
static result at0[MAXR];                       /* step 0's, per rank */
static float w1[MAXR][D * F], w2[MAXR][F * D]; /* per rank: its slices of the weights */
static uint64_t calls[MAXR];                   /* allreduces each rank made */
static uint32_t seed = 5;

/* uniform in [-1, 1): a generator of our own (not rand()), so the numbers are the same on every system */
static float uniform(void) { return (float)((seed = seed * 1664525u + 1013904223u) >> 8) * (2.0f / 16777216) - 1; }

/* C (n x m) = A B, A(i, k) at A[i * ai + k * ak], B(k, j) at B[k * bk + j * bj]: the strides do the transposes */
static void mm(int n, int K, int m, const float *A, int ai, int ak, const float *Bm, int bk, int bj, float *C)
{
    int i, j, k;
    for (i = 0; i < n; i++)
        for (j = 0; j < m; j++) {
            C[i * m + j] = 0;
            for (k = 0; k < K; k++) C[i * m + j] += A[i * ai + k * ak] * Bm[k * bk + j * bj];
        }
}

/* The serial block on f hidden units (f = F: the whole block; f = F / tp: one rank's slice, W1 (D x f), W2 (f x D)) */
static void forward(const float *w1s, const float *w2s, int f, float *a, float *ys) /* a (B x f), ys (B x D) */
{
    int i;
    mm(B, D, f, x, D, 1, w1s, f, 1, a); /* h = x W1 */
    for (i = 0; i < B * f; i++) a[i] = tanhf(a[i]);
    mm(B, f, D, a, f, 1, w2s, D, 1, ys); /* y = a W2 (a partial sum when f < F) */
}
static void backward(const float *w1s, const float *w2s, int f, const float *a, const float *dy, result *g)
{
    float da[B * F];
    int i;
    mm(f, B, D, a, 1, f, dy, D, 1, g->dw2);               /* dW2 = a^T dy */
    mm(B, D, f, dy, D, 1, w2s, 1, D, da);                 /* da = dy W2^T: my hidden units only, nothing to add */
    for (i = 0; i < B * f; i++) da[i] *= 1 - a[i] * a[i]; /* through tanh */
    mm(D, B, f, x, 1, D, da, f, 1, g->dw1);               /* dW1 = x^T dh */
    mm(B, f, D, da, f, 1, w1s, 1, f, g->dx);              /* dx = dh W1^T (a partial sum when f < F) */
}

static dpar_status rank_main(void *user, int r, int tp)
{
    int f = F / tp; /* my hidden units */
    int i, k, step;
    float a[B * F];  /* my hidden units' activations */
    float dy[B * D]; /* the loss's gradient of y */
    result c;        /* this step's */
    dpar_comm *comm;
    dpar_comm_stats stats;
    dpar_status st = dpar_group_join((dpar_group *)user, r, &comm);
    for (i = 0; i < D; i++) /* my slices: columns r f .. r f + f - 1 of W1, the same rows of W2 */
        for (k = 0; k < f; k++) {
            w1[r][i * f + k] = W1[i * F + r * f + k];
            w2[r][k * D + i] = W2[(r * f + k) * D + i];
        }
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        forward(w1[r], w2[r], f, a, c.ypart); /* column layer, tanh, row layer: no communication */
        st = dpar_allreduce(comm, c.ypart, c.y, B * D, DPAR_F32, DPAR_SUM); /* allreduce #1: y = the sum of the parts */
        for (i = 0; i < B * D; i++) dy[i] = (c.y[i] - t[i]) / B; /* every rank has all of y, so the same dy */
        backward(w1[r], w2[r], f, a, dy, &c);
        if (st == DPAR_OK) /* allreduce #2: dx, for the layer below (here nobody: the check reads it) */
            st = dpar_allreduce(comm, c.dx, c.dx, B * D, DPAR_F32, DPAR_SUM);
        for (i = 0; i < D * f; i++) {
            w1[r][i] -= LR * c.dw1[i];
            w2[r][i] -= LR * c.dw2[i];
        }
        if (step == 0) at0[r] = c;
    }
    if (st == DPAR_OK && (st = dpar_comm_stats_get(comm, &stats)) == DPAR_OK)
        calls[r] = stats.by_coll[DPAR_COLL_ALLREDUCE].calls;
    dpar_comm_destroy(comm);
    return st;
}

static double worst(double d, float a, float b) { return fabs((double)a - b) <= d ? d : fabs((double)a - b); }
/* the largest difference between rank r's slices (s1: columns of W1, s2: rows of W2) and the whole matrices' */
static double slices_diff(double d, int r, int f, const float *s1, const float *s2, const float *m1, const float *m2)
{
    int i, k;
    for (i = 0; i < D; i++)
        for (k = 0; k < f; k++) {
            d = worst(d, s1[i * f + k], m1[i * F + r * f + k]);
            d = worst(d, s2[k * D + i], m2[(r * f + k) * D + i]);
        }
    return d;
}

int main(int argc, char **argv)
{
    static float a[B * F], ys[B * D], dy[B * D];
    static result g; /* the serial block's gradients */
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool;
    dpar_group *group;
    double dfwd = 0, dbwd = 0, dw = 0;
    float loss[STEPS];                     /* the loss 0.5 |y - t|^2 / B */
    int tp = argc > 1 ? atoi(argv[1]) : 2; /* ranks */
    int f;                                 /* hidden units per rank */
    int i, r, step;
    int ok = 1;
    if (tp < 1 || tp > MAXR || F % tp) {
        fprintf(stderr, "05_tensor_parallel: %d ranks: give 1, 2, 4, 8 or 16 (they must divide the %d hidden units)\n",
                tp, F);
        return 2;
    }
    f = F / tp;
    for (i = 0; i < B * D; i++) {
        x[i] = uniform();
        t[i] = 0.5f * uniform();
    }
    for (i = 0; i < D * F; i++) {
        W1[i] = 0.5f * uniform();
        W2[i] = 0.5f * uniform();
    }
    cd.size = tp;
    pd.num_threads = tp;
    if (dpar_group_create(&cd, &group) != DPAR_OK || dpar_pool_create(&pd, &pool) != DPAR_OK ||
        dpar_pool_run(pool, rank_main, group) != DPAR_OK) {
        fprintf(stderr, "05_tensor_parallel: %s\n", dpar_last_error());
        return 1;
    }
    printf("y = tanh(x W1) W2 on %d ranks: W1 (%d x %d) cut by columns, W2 (%d x %d) by rows\n", tp, D, F, F, D);
    for (r = 0; r < tp; r++)
        printf("rank %d: W1 columns %2d-%2d, W2 rows %2d-%2d; its part of y[0][0] %+.5f, after allreduce #1 %+.5f\n", r,
               r * f, r * f + f - 1, r * f, r * f + f - 1, at0[r].ypart[0], at0[r].y[0]);
    for (step = 0; step < STEPS; step++) { /* the serial block: the same functions on the whole weights */
        forward(W1, W2, F, a, ys);
        loss[step] = 0;
        for (i = 0; i < B * D; i++) {
            dy[i] = (ys[i] - t[i]) / B;
            loss[step] += 0.5f * (ys[i] - t[i]) * (ys[i] - t[i]) / B;
        }
        backward(W1, W2, F, a, dy, &g);
        for (r = 0; r < tp && step == 0; r++) { /* step 0: y and the gradients */
            for (i = 0; i < B * D; i++) {
                dfwd = worst(dfwd, at0[r].y[i], ys[i]);
                dbwd = worst(dbwd, at0[r].dx[i], g.dx[i]);
            }
            dbwd = slices_diff(dbwd, r, f, at0[r].dw1, at0[r].dw2, g.dw1, g.dw2);
        }
        if (step == 0) printf("serial:  y[0][0] %+.5f\n", ys[0]);
        for (i = 0; i < D * F; i++) {
            W1[i] -= LR * g.dw1[i];
            W2[i] -= LR * g.dw2[i];
        }
    }
    for (r = 0; r < tp; r++) {
        dw = slices_diff(dw, r, f, w1[r], w2[r], W1, W2);
        ok &= calls[r] == 2 * STEPS;
    }
    if ((ok &= dfwd <= 1e-5) != 0) printf("forward: every rank's y = the serial y (max difference %.1e)\n", dfwd);
    if ((ok &= dbwd <= 1e-5) != 0)
        printf("backward: every rank's dx and its slices of dW1, dW2 = the serial ones (max difference %.1e)\n", dbwd);
    if (ok) printf("allreduces: 2 per step (forward: y after the row layer; backward: dx of the column layer)\n");
    if ((ok &= dw <= 1e-4 && loss[STEPS - 1] < 0.5f * loss[0]) != 0)
        printf("%d steps of SGD: loss %.5f -> %.5f, every rank's slices = the serial ones (max difference %.1e)\n",
               STEPS, loss[0], loss[STEPS - 1], dw);
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    if (!ok) fprintf(stderr, "FAILED: a result differs from the serial block\n");
    return ok ? 0 : 1;
}
