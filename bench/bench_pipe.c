/* bench_pipe.c - pipeline bubbles, predicted by the schedule and measured by the runner.

   p = 2 and 4 stages of thread ranks, m = 4, 8, 16 micro-batches, GPipe, 1F1B, interleaved
   (v = 2), ZB-H1 (the backward split into B and W of a forward's time each), and the V schedules ZB-V and
   DualPipeV (v = 2, split; DualPipeV needs m >= 2p). The stages are balanced: a
   forward takes 2 ms / v and a backward twice that (the callbacks sleep, so 4 stages share 2 cores without
   competing for them). measured_bubble =
   1 - (time in callbacks over all stages) / (p x the longest stage's run), median of 3 runs.
   Then the same cases with callbacks that compute (bench=pipeline_gemm): a forward is GEMMS / v
   dpar_sgemm calls of 256 x 256 x 256 on the stage's own matrices, a backward twice as many, so the
   stages compete for the cores (and caches) as real ones do; gemm_ms is one GEMM's time on rank 0
   during the run against alone_ms, the same GEMM timed alone before. After each of those, issue 38's summary line
   bench=pipe schedule=S p=P m=M predicted=X measured=Y peak_act=Z: the same case's bubbles (computing stages) and
   peak_act, the most activations any stage stashes, in whole stages' activations (the schedule's peak_stash, largest
   over the stages, divided by v: a chunk's activation is 1/v of a stage's).

   Build: cc -std=c99 -O2 -I. bench/bench_pipe.c -o bench_pipe -pthread -lm
   Run:   ./bench_pipe */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <stdio.h>
#include <stdlib.h>

#define FORWARD_US 2000
#define GEMM_N 256
#define GEMMS 4 /* GEMMs of a forward with v = 1 */

typedef struct { /* a stage's callbacks: sleep (a == NULL) or compute */
    int v;
    float *a, *b, *c;
    double gemm_ns; /* time in GEMMs */
    long gemms;
} work;

static void gemms(work *w, int n)
{
    int k;
    uint64_t t0 = dpar_time_ns();
    for (k = 0; k < n; k++)
        dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, GEMM_N, GEMM_N, GEMM_N, 1.0f, w->a, GEMM_N, w->b, GEMM_N, 0.0f, w->c,
                   GEMM_N);
    w->gemm_ns += (double)(dpar_time_ns() - t0);
    w->gemms += n;
}

static void nap(long us)
{
    struct timespec ts;
    ts.tv_sec = us / 1000000;
    ts.tv_nsec = (us % 1000000) * 1000;
    nanosleep(&ts, NULL);
}

typedef struct {
    dpar_group *g;
    dpar_pipe_schedule *S;
    int compute;
    double measured[3], gemm_ms;
} job;

static dpar_status fwd(void *user, int micro, int chunk, const void *in, void *out)
{
    (void)micro;
    (void)chunk;
    (void)in;
    (void)out;
    if (((work *)user)->a) gemms((work *)user, GEMMS / ((work *)user)->v);
    else nap(FORWARD_US / ((work *)user)->v);
    return DPAR_OK;
}
static dpar_status bwd(void *user, int micro, int chunk, const void *in, const void *g, void *gi)
{
    (void)micro;
    (void)chunk;
    (void)in;
    (void)g;
    (void)gi;
    if (((work *)user)->a) gemms((work *)user, 2 * GEMMS / ((work *)user)->v);
    else nap(2 * FORWARD_US / ((work *)user)->v);
    return DPAR_OK;
}

/* the split backward's halves (ZB-H1, ZB-V, DualPipeV): B and W, a forward's time each */
static dpar_status bwd_input(void *user, int micro, int chunk, const void *in, const void *g, void *gi)
{
    (void)micro, (void)chunk, (void)in, (void)g, (void)gi;
    if (((work *)user)->a) gemms((work *)user, GEMMS / ((work *)user)->v);
    else nap(FORWARD_US / ((work *)user)->v);
    return DPAR_OK;
}
static dpar_status bwd_weight(void *user, int micro, int chunk, const void *in, const void *g)
{
    (void)micro, (void)chunk, (void)in, (void)g;
    if (((work *)user)->a) gemms((work *)user, GEMMS / ((work *)user)->v);
    else nap(FORWARD_US / ((work *)user)->v);
    return DPAR_OK;
}

static dpar_status stage_main(void *user, int r, int n)
{
    job *j = (job *)user;
    dpar_comm *c;
    dpar_pipe *pp;
    dpar_pipe_desc d;
    dpar_pipe_stats s;
    int k;
    work w;
    (void)n;
    memset(&w, 0, sizeof w);
    w.v = j->S->v;
    if (j->compute) {
        size_t e = (size_t)GEMM_N * GEMM_N;
        w.a = (float *)malloc(3 * e * sizeof(float));
        if (!w.a) return DPAR_ENOMEM;
        w.b = w.a + e, w.c = w.b + e;
        for (k = 0; k < (int)(2 * e); k++) w.a[k] = (float)((k * 7 + r) % 13) / 13.0f;
    }
    if (dpar_group_join(j->g, r, &c) != DPAR_OK) return DPAR_EUSER;
    memset(&d, 0, sizeof d);
    d.schedule = j->S;
    d.comm = c;
    d.act_bytes = 4096;
    d.forward = fwd;
    d.backward = bwd;
    d.backward_input = bwd_input;
    d.backward_weight = bwd_weight;
    d.user = &w;
    dpar_pipe_create(&d, &pp);
    dpar_pipe_run(pp, &s); /* warm up: buffers, threads */
    w.gemm_ns = 0, w.gemms = 0;
    for (k = 0; k < 3; k++) {
        dpar_pipe_run(pp, &s);
        if (r == 0) j->measured[k] = s.measured_bubble;
    }
    if (r == 0 && w.gemms) j->gemm_ms = w.gemm_ns / (double)w.gemms * 1e-6;
    dpar_pipe_destroy(pp);
    dpar_comm_destroy(c);
    free(w.a);
    return DPAR_OK;
}

/* one GEMM's time with nothing else running (the best of 20) */
static double gemm_alone_ms(void)
{
    work w;
    double best = 1e30;
    int k;
    memset(&w, 0, sizeof w);
    w.a = (float *)calloc(3 * (size_t)GEMM_N * GEMM_N, sizeof(float));
    if (!w.a) return 0;
    w.b = w.a + GEMM_N * GEMM_N, w.c = w.b + GEMM_N * GEMM_N;
    for (k = 0; k < 20; k++) {
        w.gemm_ns = 0;
        gemms(&w, 1);
        if (w.gemm_ns < best) best = w.gemm_ns;
    }
    free(w.a);
    return best * 1e-6;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(void)
{
    static const int ps[] = {2, 4}, ms[] = {4, 8, 16};
    static const char *names[] = {"gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"};
    int pi, mi, kind, compute;
    double alone = gemm_alone_ms();
    for (compute = 0; compute < 2; compute++)
        for (pi = 0; pi < 2; pi++) {
            dpar_pool *pool;
            dpar_pool_desc pd;
            memset(&pd, 0, sizeof pd);
            pd.num_threads = ps[pi];
            dpar_pool_create(&pd, &pool);
            for (kind = 0; kind < 6; kind++)
                for (mi = 0; mi < 3; mi++) {
                    job j;
                    dpar_comm_desc cd;
                    dpar_pipe_schedule_desc sd = {0};
                    memset(&j, 0, sizeof j);
                    memset(&cd, 0, sizeof cd);
                    cd.size = ps[pi];
                    j.compute = compute;
                    if (kind == DPAR_PIPE_DUALPIPEV && ms[mi] < 2 * ps[pi]) continue; /* it needs 2p micro-batches */
                    sd.kind = (dpar_pipe_kind)kind, sd.p = ps[pi], sd.m = ms[mi], sd.v = kind == 2 || kind >= 4 ? 2 : 1;
                    if (dpar_pipe_schedule_create(&sd, &j.S) != DPAR_OK || dpar_group_create(&cd, &j.g) != DPAR_OK) {
                        fprintf(stderr, "bench_pipe: %s\n", dpar_last_error());
                        return 1;
                    }
                    dpar_pool_run(pool, stage_main, &j);
                    qsort(j.measured, 3, sizeof(double), cmp_double);
                    if (compute) {
                        int s, peak_stash = 0; /* the most chunk activations any stage stashes */
                        for (s = 0; s < ps[pi]; s++)
                            if (j.S->peak_stash[s] > peak_stash) peak_stash = j.S->peak_stash[s];
                        printf("bench=pipeline_gemm sched=%s p=%d m=%d predicted_bubble=%.3f measured_bubble=%.3f "
                               "gemm_ms=%.3f alone_ms=%.3f\n",
                               names[kind], ps[pi], ms[mi], j.S->bubble, j.measured[1], j.gemm_ms, alone);
                        printf("bench=pipe schedule=%s p=%d m=%d predicted=%.3f measured=%.3f peak_act=%g\n",
                               names[kind], ps[pi], ms[mi], j.S->bubble, j.measured[1], (double)peak_stash / j.S->v);
                    } else
                        printf("bench=pipeline sched=%s p=%d m=%d predicted_bubble=%.3f measured_bubble=%.3f\n",
                               names[kind], ps[pi], ms[mi], j.S->bubble, j.measured[1]);
                    fflush(stdout);
                    dpar_group_destroy(j.g);
                    dpar_pipe_schedule_destroy(j.S);
                }
            dpar_pool_destroy(pool);
        }
    return 0;
}
