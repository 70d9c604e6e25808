/* dp_record.c - records the trace that docs/img/dp_step.svg draws (make docs-record): a real data-parallel run
   with gradient buckets, traced with dpar_trace_start. 2 thread ranks train a tanh MLP of 6 layers (256 x 256
   weights each, one bucket per layer) for 4 steps; each rank marks its forward, each layer's backward, the wait
   for the buckets and the SGD update with dpar_trace_event. dpar adds the buckets' allreduces on each rank's
   progress thread. docs/gen/svg.c draws the last step.
   Build: cc -std=c99 -O2 -I. docs/gen/dp_record.c -o build/dp_record -pthread -lm
   Run:   build/dp_record docs/img/src/dp_step.trace.json */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define L 6           /* layers, h' = tanh(W h), W of W x W */
#define W 256         /* width */
#define P (L * W * W) /* parameters; layer l's at l * W * W */
#define BATCH 64      /* global batch */
#define RANKS 2
#define STEPS 4

static float x[BATCH * W], target[BATCH * W], init[P];
static float params[RANKS][P], grads[RANKS][P], acts[RANKS][(L + 1) * BATCH * W], deltas[RANKS][2 * BATCH * W];

static void span(const char *name, uint64_t t0, int layer)
{
    char args[32];
    snprintf(args, sizeof args, "\"layer\":%d", layer);
    dpar_trace_event(name, "train", t0, dpar_time_ns(), layer >= 0 ? args : NULL);
}

static void forward(const float *p, float *h, int n) /* h: (L+1, n, W); h[0] holds the input */
{
    int l, b, j, k;
    uint64_t t0 = dpar_time_ns();
    for (l = 0; l < L; l++)
        for (b = 0; b < n; b++)
            for (j = 0; j < W; j++) {
                float a = 0;
                for (k = 0; k < W; k++) a += p[l * W * W + j * W + k] * h[(l * n + b) * W + k];
                h[((l + 1) * n + b) * W + j] = tanhf(a);
            }
    span("forward", t0, -1);
}

/* backward, last layer first; each layer's weight gradient goes to its bucket as soon as it is final */
static dpar_status backward(const float *p, const float *h, const float *y, float *d, float *d2, float *g, int n,
                            dpar_buckets *buckets)
{
    int l, b, j, k, i;
    dpar_status st;
    for (i = 0; i < n * W; i++) d[i] = (h[L * n * W + i] - y[i]) / BATCH * (1 - h[L * n * W + i] * h[L * n * W + i]);
    for (l = L - 1; l >= 0; l--) {
        const float *in = h + l * n * W, *Wl = p + l * W * W;
        float *gl = g + l * W * W, *t;
        uint64_t t0 = dpar_time_ns();
        for (j = 0; j < W; j++)
            for (k = 0; k < W; k++) {
                float s = 0;
                for (b = 0; b < n; b++) s += d[b * W + j] * in[b * W + k];
                gl[j * W + k] = s;
            }
        if ((st = dpar_buckets_ready(buckets, (size_t)l * W * W, W * W)) != DPAR_OK) return st;
        for (b = 0; l > 0 && b < n; b++)
            for (k = 0; k < W; k++) {
                float s = 0;
                for (j = 0; j < W; j++) s += d[b * W + j] * Wl[j * W + k];
                d2[b * W + k] = s * (1 - in[b * W + k] * in[b * W + k]);
            }
        span("backward", t0, l);
        t = d, d = d2, d2 = t;
    }
    return DPAR_OK;
}

static dpar_status rank_main(void *user, int rank, int ranks)
{
    int n = BATCH / ranks, step, i;
    float *p = params[rank], *g = grads[rank], *h = acts[rank], *d = deltas[rank];
    dpar_comm *comm = NULL;
    dpar_buckets *buckets = NULL;
    dpar_buckets_desc bd = {0};
    dpar_status st = dpar_group_join((dpar_group *)user, rank, &comm);
    memcpy(h, x + rank * n * W, n * W * sizeof *h);
    memcpy(p, init, P * sizeof *p);
    bd.comm = comm, bd.grads = g, bd.count = P, bd.op = DPAR_AVG, bd.bucket_bytes = W * W * sizeof(float);
    if (st == DPAR_OK) st = dpar_buckets_create(&bd, &buckets);
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        uint64_t t0 = dpar_time_ns(), t1;
        forward(p, h, n);
        st = backward(p, h, target + rank * n * W, d, d + n * W, g, n, buckets);
        t1 = dpar_time_ns();
        if (st == DPAR_OK) st = dpar_buckets_wait(buckets);
        span("wait", t1, -1);
        t1 = dpar_time_ns();
        for (i = 0; i < P; i++) p[i] -= 0.5f * g[i];
        span("sgd", t1, -1);
        span("step", t0, step); /* "layer" holds the step here */
    }
    dpar_buckets_destroy(buckets);
    dpar_comm_destroy(comm);
    return st;
}

int main(int argc, char **argv)
{
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool = NULL;
    dpar_group *group = NULL;
    dpar_status st;
    int i;
    if (argc != 2) return fprintf(stderr, "usage: dp_record TRACE.json\n"), 2;
    for (i = 0; i < P; i++) init[i] = 0.1f * sinf((float)i);
    for (i = 0; i < BATCH * W; i++) x[i] = cosf((float)i), target[i] = 0.5f * sinf(0.3f * (float)i);
    cd.size = pd.num_threads = RANKS;
    cd.name = "dp";
    st = dpar_trace_start(argv[1]);
    if (st == DPAR_OK) st = dpar_group_create(&cd, &group);
    if (st == DPAR_OK) st = dpar_pool_create(&pd, &pool);
    if (st == DPAR_OK) st = dpar_pool_run(pool, rank_main, group);
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    if (st != DPAR_OK) return fprintf(stderr, "dp_record: %s\n", dpar_last_error()), 1;
    if ((st = dpar_trace_stop()) != DPAR_OK) return fprintf(stderr, "dp_record: %s\n", dpar_last_error()), 1;
    printf("dp_record: %d ranks, %d steps traced to %s\n", RANKS, STEPS, argv[1]);
    return 0;
}
