/* 08_zero.c - lesson 8 of the guide (docs/guide/08_zero.md): ZeRO and sharded data parallelism, memory per rank.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/08_zero.c -o build/lesson08 -pthread -lm
   Run:   build/lesson08              (build/lesson08 8: eight ranks; 1, 2, 4 or 8)
   Check: ^plain data parallelism +[0-9]+ bytes per rank, formula +[0-9]+ = 16 P
   Check: ^ZeRO-3 \(FSDP\) +[0-9]+ bytes per rank, formula +[0-9]+ = 16 P / N \+ 4 \(two largest units\)
   Check: ^every way and rank: memory within 1% of the formula, weights bitwise plain data parallelism's$

   An MLP trained with Adam four ways on N thread ranks: plain data parallelism, ZeRO-1 (dpar_zero), ZeRO-2 and ZeRO-3
   (dpar_fsdp). Each rank's bytes for the model go through a counting allocator (dpar's allocator hook). */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { U = 6, IN = 32, H = 128, OUT = 8, GB = 64, STEPS = 10, MAXR = 8 }; /* layers (units), widths, batch */
enum { P = IN * H + (U - 2) * H * H + H * OUT };                          /* the weights: 70656 */
static const int width[U + 1] = {IN, H, H, H, H, H, OUT}; /* layer u: x (n x in) W (in x out), no bias */
static size_t cnt[U], off[U + 1], held[4][MAXR][2];       /* unit u: cnt[u] weights at off[u]; bytes now, at most */
static float data[GB * IN], target[GB * OUT], init[P], final[4][MAXR][P]; /* final: each rank's weights, each way */
static float acts[MAXR][GB * (IN + (U - 1) * H + OUT)], deltas[MAXR][2][GB * H]; /* activations, gradients */
static void *count_alloc(void *user, size_t size) /* the size goes in a header, for count_free */
{
    size_t *bytes = (size_t *)user; /* bytes[0]: held now; bytes[1]: at most */
    size_t *header = (size_t *)malloc(size + 2 * sizeof(size_t));
    if (!header) return NULL;
    header[0] = size;
    bytes[0] += size;
    if (bytes[0] > bytes[1]) bytes[1] = bytes[0];
    return header + 2;
}
static void count_free(void *user, void *p)
{
    size_t *bytes = (size_t *)user;
    if (!p) return;
    bytes[0] -= ((size_t *)p)[-2];
    free((size_t *)p - 2);
}
static void forward(const float *w, int u, const float *x, float *z, int n) /* z = x W, then tanh but on the last */
{
    int in = width[u];
    int out = width[u + 1];
    int i;
    dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, n, out, in, 1, x, in, w, out, 0, z, out);
    for (i = 0; i < n * out && u < U - 1; i++) z[i] = tanhf(z[i]);
}
static void backward_input(const float *w, int u, const float *x, const float *dz, float *dx, int n) /* reads W */
{
    int in = width[u];
    int out = width[u + 1];
    int i;
    dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, n, in, out, 1, dz, out, w, out, 0, dx, in);
    for (i = 0; i < n * in; i++) dx[i] *= 1 - x[i] * x[i]; /* through the tanh that made x */
}
static void backward_weights(float *g, int u, const float *x, const float *dz, int n) /* dW = x^T dz: reads no W */
{
    int in = width[u];
    int out = width[u + 1];
    dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, in, out, n, 1, x, in, dz, out, 0, g, out);
}
static void adam(float *p, const float *g, float *m, float *v, size_t n, int t) /* dpar_zero_step's math (AdamW) */
{
    float c1 = 1.0f - powf(0.9f, (float)t); /* the bias corrections */
    float c2 = 1.0f - powf(0.999f, (float)t);
    size_t i;
    for (i = 0; i < n; i++) { /* the moments, then the step (no weight decay) */
        m[i] = 0.9f * m[i] + (1.0f - 0.9f) * g[i];
        v[i] = 0.999f * v[i] + (1.0f - 0.999f) * g[i] * g[i];
        p[i] -= 1e-3f * ((m[i] / c1) / (sqrtf(v[i] / c2) + 1e-8f));
    }
}
/* way 0: plain data parallelism; 1: ZeRO-1 (one dpar_zero per layer); 2, 3: ZeRO-2, ZeRO-3 (dpar_fsdp) */
static dpar_status train(dpar_comm *c, int r, int N, int way)
{
    dpar_allocator al = {count_alloc, count_free, held[way][r]};
    size_t a[U + 1] = {0}; /* layer u's input at act + a[u] */
    size_t u;
    int n = GB / N; /* my rows of the batch */
    int step, i;
    int words = way == 0 ? 4 : way == 1 ? 2 : 0; /* the whole model's floats per parameter I hold */
    float *p = words ? (float *)count_alloc(al.user, words * P * sizeof(float)) : NULL; /* the parameters */
    float *g = p ? p + P : NULL; /* their gradients (then, plain: Adam's m and v) */
    float *w;                    /* ZeRO-3: a gathered layer's weights */
    float *gu;                   /* ZeRO-2, 3: a layer's full gradient */
    float *act = acts[r];
    dpar_zero_desc zd = {0};
    dpar_fsdp_desc fd = {0};
    dpar_zero *z[U] = {NULL};
    dpar_fsdp *f = NULL;
    dpar_status st = words && !p ? dpar_set_error(DPAR_ENOMEM, "rank %d: out of memory", r) : DPAR_OK;
    for (u = 0; u < U; u++) a[u + 1] = a[u] + (size_t)n * width[u + 1];
    memcpy(act, data + r * n * IN, n * IN * sizeof(float)); /* my rows of the batch */
    if (p) {
        memcpy(p, init, P * sizeof(float));
        memset(g, 0, (words - 1) * P * sizeof(float));
    }
    zd.comm = c; /* ZeRO-1: a dpar_zero per layer */
    zd.kind = DPAR_OPTIM_ADAM;
    zd.lr = 1e-3f;
    zd.allocator = al;
    fd.comm = c; /* ZeRO-2 or 3: one dpar_fsdp, every layer a unit */
    fd.kind = DPAR_OPTIM_ADAM;
    fd.lr = 1e-3f;
    fd.allocator = al;
    fd.stage = way;
    fd.num_units = U;
    fd.unit_counts = cnt;
    for (u = 0; u < U && way == 1 && st == DPAR_OK; u++) {
        zd.count = cnt[u];
        st = dpar_zero_create(&zd, &z[u]);
    }
    if (way >= 2) st = dpar_fsdp_create(&fd, &f);
    for (u = 0; u < U && f && st == DPAR_OK; u++) st = dpar_fsdp_set_params(f, (int)u, init + off[u]);
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        for (u = 0; u < U && st == DPAR_OK; u++) { /* forward; ZeRO-3 gathers each layer, then lets it go */
            if (f && (st = dpar_fsdp_gather(f, (int)u, &w)) != DPAR_OK) break;
            forward(f ? w : p + off[u], (int)u, act + a[u], act + a[u + 1], n);
            if (f) st = dpar_fsdp_release(f, (int)u);
        }
        for (i = 0; i < n * OUT; i++) deltas[r][0][i] = (act[a[U] + i] - target[r * n * OUT + i]) / (n * OUT);
        for (u = U; u-- > 0 && st == DPAR_OK;) {    /* backward, last layer first */
            float *dz = deltas[r][(U - 1 - u) % 2]; /* the gradient of layer u's output (before its tanh) */
            float *dx = deltas[r][(U - u) % 2];     /* of its input: the layer below's dz */
            if (f && (st = dpar_fsdp_gather(f, (int)u, &w)) != DPAR_OK) break;
            if (u > 0) backward_input(f ? w : p + off[u], (int)u, act + a[u], dz, dx, n);
            if (f && (st = dpar_fsdp_release(f, (int)u)) == DPAR_OK) st = dpar_fsdp_grads(f, (int)u, &gu);
            if (st == DPAR_OK) backward_weights(f ? gu : g + off[u], (int)u, act + a[u], dz, n);
            if (f && st == DPAR_OK) st = dpar_fsdp_reduce(f, (int)u); /* reduce-scatter: my block of the average */
            if (way == 0 && st == DPAR_OK) st = dpar_allreduce(c, g + off[u], g + off[u], cnt[u], DPAR_F32, DPAR_AVG);
            if (way == 1 && st == DPAR_OK) st = dpar_zero_step(z[u], p + off[u], g + off[u]); /* my block, gather */
        }
        if (way == 0 && st == DPAR_OK) adam(p, g, g + P, g + 2 * P, P, step + 1); /* every rank updates all */
        if (f && st == DPAR_OK) st = dpar_fsdp_step(f); /* my block of every layer, then (ZeRO-2) all-gather */
    }
    for (u = 0; u < U && f && st == DPAR_OK; u++) st = dpar_fsdp_get_params(f, (int)u, final[way][r] + off[u]);
    if (p) memcpy(final[way][r], p, P * sizeof(float));
    for (u = 0; u < U; u++) dpar_zero_destroy(z[u]);
    dpar_fsdp_destroy(f);
    count_free(al.user, p);
    return st;
}
static dpar_status rank_main(void *user, int r, int N)
{
    dpar_comm *c;
    dpar_status st = dpar_group_join((dpar_group *)user, r, &c); /* user: the group */
    int way;
    for (way = 0; way < 4 && st == DPAR_OK; way++) st = train(c, r, N, way);
    dpar_comm_destroy(c);
    return st;
}
int main(int argc, char **argv)
{
    static const char *names[4] = {"plain data parallelism", "ZeRO-1", "ZeRO-2", "ZeRO-3 (FSDP)"};
    static const char *how[4] = {"16 P", "8 P + 8 P / N", "4 P + 12 P / N + 4 (the largest unit)",
                                 "16 P / N + 4 (two largest units)"};
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool;
    dpar_group *group;
    size_t big1 = 0, big2 = 0, formula[4], u;
    uint32_t seed = 3;
    int N = argc > 1 ? atoi(argv[1]) : 4; /* ranks */
    int r, way, i;
    int ok = 1;
    if (N < 1 || N > MAXR || GB % N) {
        fprintf(stderr, "08_zero: %d ranks: give 1, 2, 4 or 8 (they must divide the batch of %d)\n", N, GB);
        return 2;
    }
    for (u = 0; u < U; u++) {
        cnt[u] = (size_t)width[u] * width[u + 1];
        off[u + 1] = off[u] + cnt[u];
    }
    for (u = 0; u < U; u++) { /* the two largest units */
        if (cnt[u] > big1) {
            big2 = big1;
            big1 = cnt[u];
        } else if (cnt[u] > big2) {
            big2 = cnt[u];
        }
    }
    for (i = 0; i < P; i++) {
        seed = seed * 1664525u + 1013904223u;
        init[i] = (float)(seed >> 8) / 16777216 * .2f - .1f;
    }
    for (i = 0; i < GB * IN; i++) data[i] = sinf(0.37f * i);
    for (i = 0; i < GB * OUT; i++) target[i] = 0.5f * cosf(0.71f * i);
    cd.size = N;
    pd.num_threads = N;
    if (dpar_group_create(&cd, &group) != DPAR_OK || dpar_pool_create(&pd, &pool) != DPAR_OK ||
        dpar_pool_run(pool, rank_main, group) != DPAR_OK) {
        fprintf(stderr, "08_zero: %s\n", dpar_last_error());
        return 1;
    }
    formula[0] = 16 * P;
    formula[1] = 8 * P + 8 * P / N;
    formula[2] = 4 * P + 12 * P / N + 4 * big1;
    formula[3] = 16 * P / N + 4 * (big1 + big2);
    printf("P = %d weights in %d layers (the largest %zu and %zu), Adam, N = %d ranks\n", P, U, big1, big2, N);
    for (way = 0; way < 4; way++) {
        printf("%-24s %8zu bytes per rank, formula %8zu = %s\n", names[way], held[way][0][1], formula[way], how[way]);
        for (r = 0; r < N; r++) /* within 1% (the blocks of P / N, rounded; bookkeeping); the same bits */
            ok &= fabs((double)held[way][r][1] / formula[way] - 1) < 0.01 && !memcmp(final[way][r], final[0][0], 4 * P);
    }
    ok &= memcmp(final[0][0], init, 4 * P) != 0; /* and they trained */
    if (ok) printf("every way and rank: memory within 1%% of the formula, weights bitwise plain data parallelism's\n");
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    if (!ok) fprintf(stderr, "FAILED: a memory differs from its formula, or weights from plain data parallelism\n");
    return ok ? 0 : 1;
}
