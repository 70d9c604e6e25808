/* 06_pipeline.c - lesson 6 of the guide (docs/guide/06_pipeline.md): pipeline parallelism, GPipe against 1F1B.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/06_pipeline.c -o build/lesson06 -pthread -lm
   Run:   build/lesson06          (build/lesson06 2 16: 2 stages, 16 micro-batches; m divides 32)
   Check: ^GPipe: bubble \(p-1\)/\(m\+p-1\) = [0-9.]+ = the schedule's [0-9.]+ \(measured [0-9.]+\)$
   Check: ^1F1B: bubble \(p-1\)/\(m\+p-1\) = [0-9.]+ = the schedule's [0-9.]+ \(measured [0-9.]+\)$
   Check: ^GPipe: activations held at most, per stage: [0-9 ]+ = m on every stage$
   Check: ^1F1B: activations held at most, per stage: [0-9 ]+ = min\(p - stage, m\), at most p$
   Check: ^both schedules: every stage's gradients = the serial model's, bit for bit$

   A model of p layers, one per stage (thread rank), the batch of 32 rows cut into m micro-batches. dpar_pipe runs
   each schedule (every stage's ordered list of forwards, backwards, sends, receives) with the callbacks below. A
   forward sleeps 2 ms and a backward 4 ms, as if they computed: the measured idle time is the schedule's. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define W 16 /* every layer is W x W: a_out = tanh(a_in W_s) */
#define B 32 /* rows of the batch */
#define MAXP 8
typedef struct stage {
    int s;            /* the stage; its layer's weights: init + s W W */
    int sleep;        /* 1 in the pipeline (each callback sleeps as if it computed), 0 in the serial model */
    int held;         /* micro-batches whose activations are kept for backward, now */
    int peak;         /* and at most */
    float dw[W * W];  /* its layer's gradient, added up over the micro-batches */
    float act[B * W]; /* its output, every micro-batch */
} stage;
static stage pipe_stages[MAXP], serial[MAXP];
static float data[B * W], target[B * W], init[MAXP * W * W]; /* the layers' weights */
static float grads[2][MAXP][W * W], bubble[2];               /* per schedule (0: GPipe, 1: 1F1B) */
static int peaks[2][MAXP], p, m;
static dpar_pipe_schedule *sched[2];
static const struct timespec two_ms = {0, 2000000};
static const struct timespec four_ms = {0, 4000000};

/* forward of one micro-batch through this stage's layer; in: the previous stage's output (NULL: the data) */
static dpar_status forward(void *user, int micro, int chunk, const void *in, void *out)
{
    stage *st = (stage *)user;
    int rows = B / m;
    int i, j, k;
    const float *x = in ? (const float *)in : data + micro * rows * W; /* (rows, W) */
    const float *w = init + st->s * W * W;                             /* (W, W) */
    float *a = st->act + micro * rows * W;                             /* (rows, W) */
    for (i = 0; i < rows; i++)
        for (j = 0; j < W; j++) {
            a[i * W + j] = 0;
            for (k = 0; k < W; k++) a[i * W + j] += x[i * W + k] * w[k * W + j];
        }
    for (i = 0; i < rows * W; i++) a[i] = tanhf(a[i]);
    if (out) memcpy(out, a, rows * W * sizeof(float)); /* to the next stage (NULL on the last) */
    st->held++;                                        /* one more micro-batch's activations kept for backward */
    if (st->held > st->peak) st->peak = st->held;
    if (st->sleep) nanosleep(&two_ms, NULL); /* as if it computed for 2 ms */
    (void)chunk;
    return DPAR_OK;
}
/* backward: dW += x^T dz; grad_in = dz W^T (NULL on the first stage); grad_out NULL on the last: the loss's */
static dpar_status backward(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    stage *st = (stage *)user;
    int rows = B / m;
    int i, j, k;
    const float *x = in ? (const float *)in : data + micro * rows * W; /* the layer's input (rows, W) */
    const float *a = st->act + micro * rows * W;                       /* its output (rows, W) */
    const float *w = init + st->s * W * W;                             /* its weights (W, W) */
    const float *t = target + micro * rows * W;                        /* the last stage's target */
    const float *da = (const float *)grad_out;                         /* the gradient of a; NULL on the last */
    float *dx = (float *)grad_in;                                      /* the gradient of x; NULL on the first */
    float dz[B * W];                                                   /* the gradient before tanh */
    for (i = 0; i < rows * W; i++) /* the loss 0.5 |y - t|^2 / B over the whole batch, through tanh */
        dz[i] = (da ? da[i] : (a[i] - t[i]) / B) * (1 - a[i] * a[i]);
    for (k = 0; k < W; k++)
        for (j = 0; j < W; j++)
            for (i = 0; i < rows; i++) st->dw[k * W + j] += x[i * W + k] * dz[i * W + j];
    for (i = 0; dx && i < rows; i++)
        for (k = 0; k < W; k++) {
            dx[i * W + k] = 0;
            for (j = 0; j < W; j++) dx[i * W + k] += dz[i * W + j] * w[k * W + j];
        }
    st->held--;                               /* its activations are no longer needed */
    if (st->sleep) nanosleep(&four_ms, NULL); /* a backward: twice a forward */
    (void)chunk;
    return DPAR_OK;
}
static void reset(stage *st, int s, int sleep) /* zero gradients, nothing held */
{
    memset(st, 0, sizeof *st);
    st->s = s;
    st->sleep = sleep;
}
/* each stage: one step with each schedule */
static dpar_status rank_main(void *user, int s, int n)
{
    dpar_comm *comm;
    dpar_status st = dpar_group_join((dpar_group *)user, s, &comm);
    int kind;
    for (kind = 0; kind < 2 && st == DPAR_OK; kind++) {
        dpar_pipe_desc d = {0};
        dpar_pipe *pipe = NULL;
        dpar_pipe_stats stats = {0};
        d.schedule = sched[kind];
        d.comm = comm;
        d.act_bytes = B / m * W * sizeof(float); /* one micro-batch's activation, between stages */
        d.forward = forward;
        d.backward = backward;
        d.user = &pipe_stages[s];
        st = dpar_pipe_create(&d, &pipe);
        reset(&pipe_stages[s], s, 1);                        /* zero gradients, nothing held */
        if (st == DPAR_OK) st = dpar_pipe_run(pipe, &stats); /* every op of this stage's list, in order */
        memcpy(grads[kind][s], pipe_stages[s].dw, sizeof grads[kind][s]);
        peaks[kind][s] = pipe_stages[s].peak;
        if (s == 0) bubble[kind] = (float)stats.measured_bubble;
        dpar_pipe_destroy(pipe);
    }
    dpar_comm_destroy(comm);
    (void)n;
    return st;
}

int main(int argc, char **argv)
{
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool;
    dpar_group *group;
    dpar_pipe_schedule_desc sd = {0};
    float g[2][B * W]; /* the serial model's gradients between layers, in turn */
    char text[8192];
    int i, s, kind, micro;
    int ok = 1;
    p = argc > 1 ? atoi(argv[1]) : 4;
    m = argc > 2 ? atoi(argv[2]) : 8;
    if (p < 1 || p > MAXP || m < 1 || m > B || B % m) {
        fprintf(stderr, "06_pipeline: %d stages, %d micro-batches: give 1 to %d stages and micro-batches dividing %d\n",
                p, m, MAXP, B);
        return 2;
    }
    for (i = 0; i < B * W; i++) {
        data[i] = sinf(0.37f * i);
        target[i] = 0.5f * cosf(0.11f * i);
    }
    for (i = 0; i < MAXP * W * W; i++) init[i] = 0.4f * sinf(1.7f * i);
    for (kind = 0; kind < 2; kind++) {
        sd.kind = kind ? DPAR_PIPE_1F1B : DPAR_PIPE_GPIPE;
        sd.p = p;
        sd.m = m;
        if (dpar_pipe_schedule_create(&sd, &sched[kind]) != DPAR_OK) {
            fprintf(stderr, "06_pipeline: %s\n", dpar_last_error());
            return 1;
        }
        dpar_pipe_schedule_format(sched[kind], text, sizeof text); /* F = forward, B = backward, . = idle */
        printf("%s", text);
    }
    cd.size = p;
    pd.num_threads = p;
    if (dpar_group_create(&cd, &group) != DPAR_OK || dpar_pool_create(&pd, &pool) != DPAR_OK ||
        dpar_pool_run(pool, rank_main, group) != DPAR_OK) {
        fprintf(stderr, "06_pipeline: %s\n", dpar_last_error());
        return 1;
    }
    /* the serial model: the same layers one after the other on this thread, micro-batch after micro-batch */
    for (s = 0; s < p; s++) reset(&serial[s], s, 0);
    for (micro = 0; micro < m; micro++) {
        for (s = 0; s < p; s++) forward(&serial[s], micro, 0, s ? serial[s - 1].act + micro * (B / m) * W : NULL, NULL);
        for (s = p - 1; s >= 0; s--)
            backward(&serial[s], micro, 0, s ? serial[s - 1].act + micro * (B / m) * W : NULL,
                     s < p - 1 ? g[s % 2] : NULL, s ? g[(s + 1) % 2] : NULL);
    }
    for (kind = 0; kind < 2; kind++) {
        double formula = (double)(p - 1) / (m + p - 1);
        ok &= fabs(sched[kind]->bubble - formula) < 1e-9;
        printf("%s: bubble (p-1)/(m+p-1) = %.3f = the schedule's %.3f (measured %.3f)\n", kind ? "1F1B" : "GPipe",
               formula, sched[kind]->bubble, bubble[kind]);
        printf("%s: activations held at most, per stage:", kind ? "1F1B" : "GPipe");
        for (s = 0; s < p; s++) {
            int expect = kind == 0 ? m : (p - s < m ? p - s : m); /* GPipe: all m; 1F1B: p - s (fewer if m is) */
            printf(" %d", peaks[kind][s]);
            ok &= peaks[kind][s] == expect && sched[kind]->peak_stash[s] == expect;
            ok &= memcmp(grads[kind][s], serial[s].dw, sizeof serial[s].dw) == 0; /* bit for bit */
        }
        printf(kind == 0 ? " = m on every stage\n" : " = min(p - stage, m), at most p\n");
    }
    if (ok) printf("both schedules: every stage's gradients = the serial model's, bit for bit\n");
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    for (kind = 0; kind < 2; kind++) dpar_pipe_schedule_destroy(sched[kind]);
    if (!ok) fprintf(stderr, "FAILED: a schedule differs from its formula or the serial model\n");
    return ok ? 0 : 1;
}
