/* omp_port.c - one small model's training step written twice: with OpenMP pragmas, and with dpar's pool in the
   same shape (one dpar_pool_run per step, a share per loop), checked bit for bit against each other.

   Build: cc -std=c99 -O2 -fopenmp -I. examples/omp_port.c -o omp_port -pthread -lm
   Run:   ./omp_port            (./omp_port --threads 3 --steps 10; ./omp_port --bench for the timing line)
   Check: bitwise equal

   The model: tokens (B,T) -> embedding + position (B,T,C) -> linear (B,T,H) -> GELU -> linear (B,T,V) -> softmax
   cross-entropy, then the backward pass and an SGD update: 13 loops, 6 of them collapsed (one collapse(3)), with
   static, dynamic and guided schedules, a reduction and three nowaits. step_omp() is the OpenMP port and
   step_region() the dpar port of the same loops: each `#pragma omp for` became a share line, the loop header
   reads its start and end (same index type; the headers of a collapsed nest become one), and the implicit
   barrier became dpar_pool_barrier (none for nowait, nor before the end of the region). The bodies are identical,
   so the results are bitwise identical. Where OpenMP has schedule(static), the port takes DPAR_SCHEDULE_STEAL:
   the same blocks, but a thread done with its own takes the back half of what a slower thread has left (libgomp
   has no such schedule), so a thread whose core another job takes for a while no longer holds up the barrier
   (docs/openmp.md, 'Speed'). The loss is a reduction, which OpenMP adds in an unspecified order and dpar in
   thread order; its loop keeps DPAR_SCHEDULE_STATIC, which gives both the same per-thread partial sums, and at 2
   threads (the default) the two orders give the same bits (a + b = b + a); the other results depend neither on
   the thread count nor on which thread runs an iteration. The lines each loop cost are counted in the note at
   the end; docs/openmp.md lists every construct. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define B 8   /* sequences */
#define T 64  /* tokens per sequence */
#define C 64  /* embedding width */
#define H 128 /* hidden width */
#define V 128 /* vocabulary */
#define BT (B * T)

/* parameters and their gradients, each one contiguous block */
enum { WTE = 0, WPE = WTE + V * C, W1 = WPE + T * C, B1 = W1 + H * C, W2 = B1 + H, B2 = W2 + V * H, NPARAM = B2 + V };

typedef struct Model {
    float *param, *grad;     /* (NPARAM) each */
    int *tok, *target;       /* (B,T) */
    float *x, *dx;           /* (B,T,C) */
    float *h, *a, *da, *dh;  /* (B,T,H) */
    float *logits, *dlogits; /* (B,T,V) */
    double loss;
    dpar_pool *pool;
    int threads;
} Model;

static float gelu(float x) { return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x))); }
static float gelu_grad(float x)
{
    float u = 0.7978845608f * (x + 0.044715f * x * x * x), t = tanhf(u);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x);
}

#define LR 2.0f

/* ---- the OpenMP port ---- */
static void step_omp(Model *m)
{
    float *p = m->param, *g = m->grad;
    double loss = 0;
#pragma omp parallel num_threads(m->threads)
    {
#pragma omp for collapse(3) /* 1. embedding: x = wte[tok] + wpe */
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++)
                for (int c = 0; c < C; c++)
                    m->x[(b * T + t) * C + c] = p[WTE + m->tok[b * T + t] * C + c] + p[WPE + t * C + c];
#pragma omp for collapse(2) /* 2. h = x W1^T + b1 */
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                const float *x = m->x + (b * T + t) * C;
                for (int o = 0; o < H; o++) {
                    float acc = p[B1 + o];
                    for (int c = 0; c < C; c++) acc += x[c] * p[W1 + o * C + c];
                    m->h[(b * T + t) * H + o] = acc;
                }
            }
#pragma omp for /* 3. a = gelu(h) */
        for (int i = 0; i < BT * H; i++) m->a[i] = gelu(m->h[i]);
#pragma omp for collapse(2) /* 4. logits = a W2^T + b2 */
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                const float *a = m->a + (b * T + t) * H;
                for (int v = 0; v < V; v++) {
                    float acc = p[B2 + v];
                    for (int k = 0; k < H; k++) acc += a[k] * p[W2 + v * H + k];
                    m->logits[(b * T + t) * V + v] = acc;
                }
            }
#pragma omp for reduction(+ : loss) /* 5. softmax, cross-entropy, dlogits */
        for (int r = 0; r < BT; r++) {
            float *l = m->logits + r * V, *d = m->dlogits + r * V, mx = l[0], sum = 0;
            for (int v = 1; v < V; v++) mx = l[v] > mx ? l[v] : mx;
            for (int v = 0; v < V; v++) sum += d[v] = expf(l[v] - mx);
            for (int v = 0; v < V; v++) d[v] = (d[v] / sum - (v == m->target[r])) / (float)BT;
            loss += (double)(logf(sum) + mx - l[m->target[r]]);
        }
#pragma omp for schedule(dynamic, 4) nowait /* 6. dW2, db2 */
        for (int v = 0; v < V; v++) {
            float db = 0;
            for (int k = 0; k < H; k++) g[W2 + v * H + k] = 0;
            for (int r = 0; r < BT; r++) {
                float d = m->dlogits[r * V + v];
                db += d;
                for (int k = 0; k < H; k++) g[W2 + v * H + k] += d * m->a[r * H + k];
            }
            g[B2 + v] = db;
        }
#pragma omp for collapse(2) /* 7. da = dlogits W2 */
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                float *da = m->da + (b * T + t) * H;
                for (int k = 0; k < H; k++) da[k] = 0;
                for (int v = 0; v < V; v++) {
                    float d = m->dlogits[(b * T + t) * V + v];
                    for (int k = 0; k < H; k++) da[k] += d * p[W2 + v * H + k];
                }
            }
#pragma omp for /* 8. dh = da gelu'(h) */
        for (int i = 0; i < BT * H; i++) m->dh[i] = m->da[i] * gelu_grad(m->h[i]);
#pragma omp for schedule(guided) nowait /* 9. dW1, db1 */
        for (int o = 0; o < H; o++) {
            float db = 0;
            for (int c = 0; c < C; c++) g[W1 + o * C + c] = 0;
            for (int r = 0; r < BT; r++) {
                float d = m->dh[r * H + o];
                db += d;
                for (int c = 0; c < C; c++) g[W1 + o * C + c] += d * m->x[r * C + c];
            }
            g[B1 + o] = db;
        }
#pragma omp for collapse(2) /* 10. dx = dh W1 */
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                float *dx = m->dx + (b * T + t) * C;
                for (int c = 0; c < C; c++) dx[c] = 0;
                for (int o = 0; o < H; o++) {
                    float d = m->dh[(b * T + t) * H + o];
                    for (int c = 0; c < C; c++) dx[c] += d * p[W1 + o * C + c];
                }
            }
#pragma omp for collapse(2) nowait /* 11. dwpe = sum over b of dx */
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++) {
                float acc = 0;
                for (int b = 0; b < B; b++) acc += m->dx[(b * T + t) * C + c];
                g[WPE + t * C + c] = acc;
            }
#pragma omp for schedule(dynamic) /* 12. dwte: each token's rows of dx */
        for (int v = 0; v < V; v++) {
            float *dw = g + WTE + v * C;
            for (int c = 0; c < C; c++) dw[c] = 0;
            for (int r = 0; r < BT; r++)
                if (m->tok[r] == v)
                    for (int c = 0; c < C; c++) dw[c] += m->dx[r * C + c];
        }
#pragma omp for /* 13. SGD */
        for (int i = 0; i < NPARAM; i++) p[i] -= LR * g[i];
    }
    m->loss = loss / BT;
}

/* ---- the dpar port: the same loops in one dpar_pool_run ---- */
static dpar_status step_region(void *user, int thread, int nthreads)
{
    Model *m = (Model *)user;
    dpar_pool *pool = m->pool;
    float *p = m->param, *g = m->grad;
    double loss = 0;
    (void)nthreads;
    for (dpar_share s = dpar_pool_share_3d(pool, B, T, C, DPAR_SCHEDULE_STEAL, 0); dpar_share_next(&s);)
        for (int b = s.i, t = s.j, c = s.k; c < s.end; c++)
            m->x[(b * T + t) * C + c] = p[WTE + m->tok[b * T + t] * C + c] + p[WPE + t * C + c];
    dpar_pool_barrier(pool);
    for (dpar_share s = dpar_pool_share_2d(pool, B, T, DPAR_SCHEDULE_STEAL, 0); dpar_share_next(&s);)
        for (int b = s.i, t = s.j; t < s.end; t++) {
            const float *x = m->x + (b * T + t) * C;
            for (int o = 0; o < H; o++) {
                float acc = p[B1 + o];
                for (int c = 0; c < C; c++) acc += x[c] * p[W1 + o * C + c];
                m->h[(b * T + t) * H + o] = acc;
            }
        }
    dpar_pool_barrier(pool);
    for (dpar_share s = dpar_pool_share(pool, BT * H, DPAR_SCHEDULE_STEAL, 0); dpar_share_next(&s);)
        for (int i = s.i; i < s.end; i++) m->a[i] = gelu(m->h[i]);
    dpar_pool_barrier(pool);
    for (dpar_share s = dpar_pool_share_2d(pool, B, T, DPAR_SCHEDULE_STEAL, 0); dpar_share_next(&s);)
        for (int b = s.i, t = s.j; t < s.end; t++) {
            const float *a = m->a + (b * T + t) * H;
            for (int v = 0; v < V; v++) {
                float acc = p[B2 + v];
                for (int k = 0; k < H; k++) acc += a[k] * p[W2 + v * H + k];
                m->logits[(b * T + t) * V + v] = acc;
            }
        }
    dpar_pool_barrier(pool);
    for (dpar_share s = dpar_pool_share(pool, BT, DPAR_SCHEDULE_STATIC, 0); dpar_share_next(&s);)
        for (int r = s.i; r < s.end; r++) {
            float *l = m->logits + r * V, *d = m->dlogits + r * V, mx = l[0], sum = 0;
            for (int v = 1; v < V; v++) mx = l[v] > mx ? l[v] : mx;
            for (int v = 0; v < V; v++) sum += d[v] = expf(l[v] - mx);
            for (int v = 0; v < V; v++) d[v] = (d[v] / sum - (v == m->target[r])) / (float)BT;
            loss += (double)(logf(sum) + mx - l[m->target[r]]);
        }
    dpar_pool_reduce_f64(pool, &loss, 1, DPAR_POOL_SUM);
    for (dpar_share s = dpar_pool_share(pool, V, DPAR_SCHEDULE_DYNAMIC, 4); dpar_share_next(&s);)
        for (int v = s.i; v < s.end; v++) {
            float db = 0;
            for (int k = 0; k < H; k++) g[W2 + v * H + k] = 0;
            for (int r = 0; r < BT; r++) {
                float d = m->dlogits[r * V + v];
                db += d;
                for (int k = 0; k < H; k++) g[W2 + v * H + k] += d * m->a[r * H + k];
            }
            g[B2 + v] = db;
        }
    for (dpar_share s = dpar_pool_share_2d(pool, B, T, DPAR_SCHEDULE_STEAL, 0); dpar_share_next(&s);)
        for (int b = s.i, t = s.j; t < s.end; t++) {
            float *da = m->da + (b * T + t) * H;
            for (int k = 0; k < H; k++) da[k] = 0;
            for (int v = 0; v < V; v++) {
                float d = m->dlogits[(b * T + t) * V + v];
                for (int k = 0; k < H; k++) da[k] += d * p[W2 + v * H + k];
            }
        }
    dpar_pool_barrier(pool);
    for (dpar_share s = dpar_pool_share(pool, BT * H, DPAR_SCHEDULE_STEAL, 0); dpar_share_next(&s);)
        for (int i = s.i; i < s.end; i++) m->dh[i] = m->da[i] * gelu_grad(m->h[i]);
    dpar_pool_barrier(pool);
    for (dpar_share s = dpar_pool_share(pool, H, DPAR_SCHEDULE_GUIDED, 0); dpar_share_next(&s);)
        for (int o = s.i; o < s.end; o++) {
            float db = 0;
            for (int c = 0; c < C; c++) g[W1 + o * C + c] = 0;
            for (int r = 0; r < BT; r++) {
                float d = m->dh[r * H + o];
                db += d;
                for (int c = 0; c < C; c++) g[W1 + o * C + c] += d * m->x[r * C + c];
            }
            g[B1 + o] = db;
        }
    for (dpar_share s = dpar_pool_share_2d(pool, B, T, DPAR_SCHEDULE_STEAL, 0); dpar_share_next(&s);)
        for (int b = s.i, t = s.j; t < s.end; t++) {
            float *dx = m->dx + (b * T + t) * C;
            for (int c = 0; c < C; c++) dx[c] = 0;
            for (int o = 0; o < H; o++) {
                float d = m->dh[(b * T + t) * H + o];
                for (int c = 0; c < C; c++) dx[c] += d * p[W1 + o * C + c];
            }
        }
    dpar_pool_barrier(pool);
    for (dpar_share s = dpar_pool_share_2d(pool, T, C, DPAR_SCHEDULE_STEAL, 0); dpar_share_next(&s);)
        for (int t = s.i, c = s.j; c < s.end; c++) {
            float acc = 0;
            for (int b = 0; b < B; b++) acc += m->dx[(b * T + t) * C + c];
            g[WPE + t * C + c] = acc;
        }
    for (dpar_share s = dpar_pool_share(pool, V, DPAR_SCHEDULE_DYNAMIC, 1); dpar_share_next(&s);)
        for (int v = s.i; v < s.end; v++) {
            float *dw = g + WTE + v * C;
            for (int c = 0; c < C; c++) dw[c] = 0;
            for (int r = 0; r < BT; r++)
                if (m->tok[r] == v)
                    for (int c = 0; c < C; c++) dw[c] += m->dx[r * C + c];
        }
    dpar_pool_barrier(pool);
    for (dpar_share s = dpar_pool_share(pool, NPARAM, DPAR_SCHEDULE_STEAL, 0); dpar_share_next(&s);)
        for (int i = s.i; i < s.end; i++) p[i] -= LR * g[i];
    if (thread == 0) m->loss = loss / BT;
    return DPAR_OK;
}

static void step_dpar(Model *m) { dpar_pool_run(m->pool, step_region, m); }

/* ---- the same start, both ways, compared bit for bit ---- */
static uint32_t rng_state = 12345;
static float rnd(void)
{
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)(rng_state >> 8) / 16777216.0f - 0.5f;
}

/* each array its own allocation, as in a real trainer (one struct of arrays lets the compiler address one array
   relative to another, which changed the speed of two loops on this machine: docs/openmp.md, 'Speed') */
static int init(Model *m)
{
    int i;
    m->param = (float *)calloc(NPARAM, sizeof(float));
    m->grad = (float *)calloc(NPARAM, sizeof(float));
    m->tok = (int *)calloc(BT, sizeof(int));
    m->target = (int *)calloc(BT, sizeof(int));
    m->x = (float *)calloc(BT * C, sizeof(float));
    m->dx = (float *)calloc(BT * C, sizeof(float));
    m->h = (float *)calloc(BT * H, sizeof(float));
    m->a = (float *)calloc(BT * H, sizeof(float));
    m->da = (float *)calloc(BT * H, sizeof(float));
    m->dh = (float *)calloc(BT * H, sizeof(float));
    m->logits = (float *)calloc(BT * V, sizeof(float));
    m->dlogits = (float *)calloc(BT * V, sizeof(float));
    if (!m->param || !m->grad || !m->tok || !m->target || !m->x || !m->dx || !m->h || !m->a || !m->da || !m->dh ||
        !m->logits || !m->dlogits)
        return 0;
    rng_state = 12345;
    for (i = 0; i < NPARAM; i++) m->param[i] = 0.2f * rnd();
    for (i = 0; i < BT; i++) m->tok[i] = (int)((rnd() + 0.5f) * V) % V;
    for (i = 0; i < BT; i++) m->target[i] = (m->tok[i] * 7 + i % T) % V; /* learnable from token and position */
    return 1;
}

static void release(Model *m)
{
    free(m->param), free(m->grad), free(m->tok), free(m->target), free(m->x), free(m->dx);
    free(m->h), free(m->a), free(m->da), free(m->dh), free(m->logits), free(m->dlogits);
    free(m);
}

static double now_ms(void) { return (double)dpar_time_ns() * 1e-6; }

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void settle(void) { usleep(30000); /* the other runtime's threads stop spinning and sleep */ }

int main(int argc, char **argv)
{
    int threads = 2, steps = getenv("DPAR_TEST_QUICK") ? 3 : 10, bench = 0, i, k, same = 1;
    Model *mo, *md;
    dpar_pool_desc desc;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--bench")) bench = 1;
        else {
            fprintf(stderr, "usage: %s [--threads N] [--steps S] [--bench]\n", argv[0]);
            return 2;
        }
    }
#ifndef _OPENMP
    printf("skipped: built without -fopenmp: no OpenMP version to compare with\n");
    return 0;
#else
    if (threads < 1 || steps < 1) {
        fprintf(stderr, "omp_port: --threads and --steps must be at least 1\n");
        return 2;
    }
    omp_set_dynamic(0);
    mo = (Model *)calloc(1, sizeof *mo);
    md = (Model *)calloc(1, sizeof *md);
    memset(&desc, 0, sizeof desc);
    desc.num_threads = threads;
    if (!mo || !md || dpar_pool_create(&desc, &md->pool) != DPAR_OK) {
        fprintf(stderr, "omp_port: %s\n", md ? dpar_last_error() : "out of memory");
        return 1;
    }
    mo->threads = md->threads = threads;
    if (!init(mo) || !init(md)) {
        fprintf(stderr, "omp_port: out of memory\n");
        return 1;
    }
    for (k = 0; k < steps; k++) {
        step_omp(mo);
        step_dpar(md);
        same &= memcmp(&mo->loss, &md->loss, sizeof mo->loss) == 0;
        if (k % (steps > 5 ? steps / 5 : 1) == 0 || k == steps - 1)
            printf("step %2d  loss omp %.9f  dpar %.9f\n", k, mo->loss, md->loss);
    }
    same &=
        !memcmp(mo->param, md->param, NPARAM * sizeof(float)) && !memcmp(mo->grad, md->grad, NPARAM * sizeof(float));
    same &= !memcmp(mo->logits, md->logits, BT * V * sizeof(float)) && !memcmp(mo->dx, md->dx, BT * C * sizeof(float));
    printf("%s after %d steps on %d threads: losses, parameters, gradients, logits and dx\n",
           same ? "bitwise equal" : "DIFFERENT", steps, threads);
    if (bench) { /* medians of paired samples, each runtime idle before its sample, which goes first alternating */
        /* Both runtimes step the same model (md): the two hold the same bits here (checked above), so each goes on
           with the other's training, and where the arrays lie in memory, which moves a step's time by a few
           percent on its own (docs/openmp.md, 'Where the arrays lie'), is the same for both. */
        enum { SAMPLES = 41, REPS = 5, CI_LO = 13, CI_HI = 27 }; /* CI_*: below */
        double td[SAMPLES], to[SAMPLES], pr[SAMPLES], t0;
        int side;
        for (k = 0; k < 3; k++) step_omp(md), step_dpar(md);
        for (k = 0; k < SAMPLES; k++)
            for (side = 0; side < 2; side++) {
                int omp = side != (k & 1); /* dpar first in even pairs, OpenMP first in odd ones */
                settle();
                t0 = now_ms();
                for (i = 0; i < REPS; i++) {
                    if (omp) step_omp(md);
                    else step_dpar(md);
                }
                (omp ? to : td)[k] = (now_ms() - t0) / REPS;
            }
        for (k = 0; k < SAMPLES; k++) pr[k] = td[k] / to[k]; /* the two samples of a pair ran back to back */
        qsort(td, SAMPLES, sizeof td[0], cmp_double);
        qsort(to, SAMPLES, sizeof to[0], cmp_double);
        qsort(pr, SAMPLES, sizeof pr[0], cmp_double);
        /* paired: the median of the pairs' ratios; paired_lo..paired_hi: its 97% confidence interval, the 14th and
           28th of the 41 sorted ratios (distribution-free: the chance that the true median lies outside is
           2 P(Binomial(41, 1/2) <= 13) = 0.028). An interval that holds 1.00 means the two are not told apart. */
        printf("bench=omp_port threads=%d dpar_ms=%.3f omp_ms=%.3f ratio=%.2f paired=%.3f paired_lo=%.3f "
               "paired_hi=%.3f\n",
               threads, td[SAMPLES / 2], to[SAMPLES / 2], td[SAMPLES / 2] / to[SAMPLES / 2], pr[SAMPLES / 2], pr[CI_LO],
               pr[CI_HI]);
    }
    dpar_pool_destroy(md->pool);
    release(mo);
    release(md);
    return same ? 0 : 1;
#endif
}

/* Lines per ported loop, the dpar loop against the plain serial loop (the OpenMP loop without its pragma),
   counted by difflib over whitespace-stripped lines:

     loop                                     plain  dpar  removed  added  net
      1 embedding, collapse(3)                    4     4        3      3   +0
      2 h = x W1^T + b1, collapse(2)              9    10        2      3   +1
      3 a = gelu(h)                               1     3        1      3   +2
      4 logits = a W2^T + b2, collapse(2)         9    10        2      3   +1
      5 softmax, cross-entropy (reduction)        7     9        1      3   +2
      6 dW2, db2 (dynamic, nowait)               10    11        1      2   +1
      7 da = dlogits W2, collapse(2)              9    10        2      3   +1
      8 dh = da gelu'(h)                          1     3        1      3   +2
      9 dW1, db1 (guided, nowait)                10    11        1      2   +1
     10 dx = dh W1, collapse(2)                   9    10        2      3   +1
     11 dwpe, collapse(2), nowait                 6     6        2      2   +0
     12 dwte (dynamic)                            7     9        1      3   +2
     13 SGD (end of region: no barrier)           1     2        1      2   +1

   So no loop costs more than 3 lines (share, loop header, barrier) and none more than 2 beyond the plain loop; the
   OpenMP port costs 1 (the pragma). Once per pass: the region function's signature, `Model *m = user`, the pool,
   and `if (thread == 0) m->loss = ...`, against `#pragma omp parallel` and its braces. */
