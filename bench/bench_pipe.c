/* bench_pipe.c - pipeline bubbles, predicted by the schedule and measured by the runner.

   p = 2 and 4 stages of thread ranks, m = 4, 8, 16 micro-batches, GPipe, 1F1B and interleaved
   (v = 2). The stages are balanced: a forward takes 2 ms / v and a backward twice that (the
   callbacks sleep, so 4 stages share 2 cores without competing for them). measured_bubble =
   1 - (time in callbacks over all stages) / (p x the longest stage's run), median of 3 runs.

   Build: cc -std=c99 -O2 -I. bench/bench_pipe.c -o bench_pipe -pthread -lm
   Run:   ./bench_pipe */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <stdio.h>
#include <stdlib.h>

#define FORWARD_US 2000

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
    double measured[3];
} job;

static dpar_status fwd(void *user, int micro, int chunk, const void *in, void *out)
{
    (void)micro;
    (void)chunk;
    (void)in;
    (void)out;
    nap(FORWARD_US / *(int *)user);
    return DPAR_OK;
}
static dpar_status bwd(void *user, int micro, int chunk, const void *in, const void *g, void *gi)
{
    (void)micro;
    (void)chunk;
    (void)in;
    (void)g;
    (void)gi;
    nap(2 * FORWARD_US / *(int *)user);
    return DPAR_OK;
}

static dpar_status stage_main(void *user, int r, int n)
{
    job *j = (job *)user;
    dpar_comm *c;
    dpar_pipe *pp;
    dpar_pipe_desc d;
    dpar_pipe_stats s;
    int k, v = j->S->v;
    (void)n;
    if (dpar_group_join(j->g, r, &c) != DPAR_OK) return DPAR_EUSER;
    memset(&d, 0, sizeof d);
    d.schedule = j->S;
    d.comm = c;
    d.act_bytes = 4096;
    d.forward = fwd;
    d.backward = bwd;
    d.user = &v;
    dpar_pipe_create(&d, &pp);
    dpar_pipe_run(pp, &s); /* warm up: buffers, threads */
    for (k = 0; k < 3; k++) {
        dpar_pipe_run(pp, &s);
        if (r == 0) j->measured[k] = s.measured_bubble;
    }
    dpar_pipe_destroy(pp);
    dpar_comm_destroy(c);
    return DPAR_OK;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(void)
{
    static const int ps[] = {2, 4}, ms[] = {4, 8, 16};
    static const char *names[] = {"gpipe", "1f1b", "interleaved"};
    int pi, mi, kind;
    for (pi = 0; pi < 2; pi++) {
        dpar_pool *pool;
        dpar_pool_desc pd;
        memset(&pd, 0, sizeof pd);
        pd.num_threads = ps[pi];
        dpar_pool_create(&pd, &pool);
        for (kind = 0; kind < 3; kind++)
            for (mi = 0; mi < 3; mi++) {
                job j;
                dpar_comm_desc cd;
                dpar_pipe_schedule_desc sd = {0};
                memset(&j, 0, sizeof j);
                memset(&cd, 0, sizeof cd);
                cd.size = ps[pi];
                sd.kind = (dpar_pipe_kind)kind, sd.p = ps[pi], sd.m = ms[mi], sd.v = kind == 2 ? 2 : 1;
                if (dpar_pipe_schedule_create(&sd, &j.S) != DPAR_OK || dpar_group_create(&cd, &j.g) != DPAR_OK) {
                    fprintf(stderr, "bench_pipe: %s\n", dpar_last_error());
                    return 1;
                }
                dpar_pool_run(pool, stage_main, &j);
                qsort(j.measured, 3, sizeof(double), cmp_double);
                printf("bench=pipeline sched=%s p=%d m=%d predicted_bubble=%.3f measured_bubble=%.3f\n", names[kind],
                       ps[pi], ms[mi], j.S->bubble, j.measured[1]);
                fflush(stdout);
                dpar_group_destroy(j.g);
                dpar_pipe_schedule_destroy(j.S);
            }
        dpar_pool_destroy(pool);
    }
    return 0;
}
