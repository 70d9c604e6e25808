/* 12_performance.c - lesson 12 of the guide (docs/guide/12_performance.md): busbw, a trace, a straggler, a bubble.
   Build: cc -std=c99 -O2 -I. examples/guide/12_performance.c -o 12_performance -pthread -lm
   Run:   ./12_performance
   Check: ^busbw = algbw x 2\(N-1\)/N = bytes sent per rank / time, at every size; dpar's own busbw agrees$
   Check: ^the trace and the counters both name rank 2, the slowed rank$
   Check: ^trace 12_performance.json: [0-9]+ events; [0-9]+ F and [0-9]+ B spans; each stage's busy time = the runner's$

   Four thread ranks. 1: ring allreduces of a few sizes, timed by dpar's counters, the bandwidths computed as
   nccl-tests does. 2: with a trace on (dpar_trace_start), a few steps in which rank 2 computes longer than the
   others; the trace file is read back to find who waited for whom. 3: a GPipe pipeline on the same ranks, its
   bubble read from the trace. Times vary from run to run: the checks are on counts, bytes and formulas. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define N 4          /* ranks */
#define MAXC 1048576 /* floats in the largest allreduce (4 MiB) */
#define ITERS 5      /* timed calls per size */
#define SLOW 2       /* the straggler */
#define STEPS 4      /* steps of part 2 */
#define M 4          /* micro-batches of part 3 */
#define TRACE "12_performance.json"
static const size_t sizes[3] = {4096, 262144, 4194304}; /* bytes */
static float x[N][MAXC], y[N][MAXC];
static dpar_comm_stats ring[3][N];   /* part 1: every rank's counters after each size */
static dpar_comm_stats part2[N];     /* part 2: each rank's counters */
static dpar_pipe_stats pstats[N];    /* part 3 */
static dpar_pipe_schedule *schedule; /* GPipe, N stages, M micro-batches */
static dpar_group *group;
static int ok = 1, bad[N]; /* bad[r]: wrong sums rank r saw */
static void sleep_ms(int ms) { nanosleep(&(struct timespec){0, ms * 1000000L}, NULL); }
static dpar_status forward(void *user, int micro, int chunk, const void *in, void *out)
{
    return (void)user, (void)micro, (void)chunk, (void)in, (void)out, sleep_ms(2), DPAR_OK;
}
static dpar_status backward(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    return (void)user, (void)micro, (void)chunk, (void)in, (void)grad_out, (void)grad_in, sleep_ms(4), DPAR_OK;
}
static dpar_status rank_main(void *user, int r, int n)
{
    dpar_comm *c;
    dpar_pipe *pipe = NULL;
    dpar_pipe_desc pd = {.schedule = schedule, .act_bytes = 64, .forward = forward, .backward = backward};
    size_t k, i, count;
    int step;
    dpar_status st = dpar_group_join(group, r, &c);
    for (k = 0; k < 3 && st == DPAR_OK; k++) { /* part 1: x[i] = (r + 1) (i % 7 + 1): sums are exact */
        for (count = sizes[k] / sizeof(float), i = 0; i < count; i++) x[r][i] = (float)((r + 1) * (i % 7 + 1));
        st = dpar_allreduce(c, x[r], y[r], count, DPAR_F32, DPAR_SUM); /* a warm-up call, not timed */
        if (st == DPAR_OK) st = dpar_comm_stats_reset(c);
        for (step = 0; step < ITERS && st == DPAR_OK; step++)
            st = dpar_allreduce(c, x[r], y[r], count, DPAR_F32, DPAR_SUM);
        for (i = 0; i < count; i++) bad[r] += y[r][i] != (float)(n * (n + 1) / 2 * (i % 7 + 1));
        if (st == DPAR_OK) st = dpar_comm_stats_get(c, &ring[k][r]);
    }
    if (st == DPAR_OK) st = dpar_comm_stats_reset(c); /* part 2 */
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        uint64_t t0 = dpar_time_ns();
        sleep_ms(r == SLOW ? 25 : 5); /* "forward and backward": rank SLOW takes 20 ms longer */
        dpar_trace_event("compute", "model", t0, dpar_time_ns(), NULL);
        st = dpar_allreduce(c, x[r], y[r], 4096, DPAR_F32, DPAR_SUM); /* the gradients: a span of count 4096 */
    }
    if (st == DPAR_OK) st = dpar_comm_stats_get(c, &part2[r]);
    pd.comm = c; /* part 3 */
    if (st == DPAR_OK && (st = dpar_pipe_create(&pd, &pipe)) == DPAR_OK) st = dpar_pipe_run(pipe, &pstats[r]);
    dpar_pipe_destroy(pipe);
    dpar_comm_destroy(c);
    return (void)user, st;
}
int main(void)
{
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pipe_schedule_desc sd = {.kind = DPAR_PIPE_GPIPE, .p = N, .m = M};
    dpar_pool *pool = NULL;
    double factor = 2.0 * (N - 1) / N, t, algbw, busbw, wt[N] = {0}, total = 0, bubble;
    uint64_t bt[N] = {0}, sent, least = UINT64_MAX;
    unsigned long long us, frac;
    int k, r, tid, rank, of[64] = {0}, events = 0, spans[2] = {0, 0}, slow_trace = 0, slow_count = 0;
    char line[1024], *p;
    FILE *f;
    cd.size = pd.num_threads = N;
    cd.algo = DPAR_ALGO_RING; /* the ring at every size (dpar's own choice varies with size; lesson 3's algorithm) */
    if (dpar_pipe_schedule_create(&sd, &schedule) || dpar_group_create(&cd, &group) || dpar_pool_create(&pd, &pool) ||
        dpar_trace_start(TRACE) || dpar_pool_run(pool, rank_main, NULL) || dpar_trace_stop())
        return fprintf(stderr, "12_performance: %s\n", dpar_last_error()), 1;
    printf("ring allreduce of f32 on %d thread ranks, %d calls a size (the slowest rank's mean time):\n", N, ITERS);
    printf("     bytes   time_us  algbw_GBps  busbw_GBps  bytes_sent_per_rank\n");
    for (k = 0; k < 3; k++) {
        for (t = 0, r = 0; r < N; r++) {
            const dpar_comm_counters *a = &ring[k][r].by_coll[DPAR_COLL_ALLREDUCE];
            t = a->time_ns > t ? (double)a->time_ns : t;
            ok &= !bad[r] && a->calls == ITERS && a->bytes_sent == ITERS * sizes[k] * 2 * (N - 1) / N; /* exact */
            ok &= ring[k][r].last_busbw_gbps == (double)sizes[k] / (double)ring[k][r].last.time_ns * factor;
        }
        t /= ITERS;                                                        /* ns a call */
        algbw = sizes[k] / t;                                              /* bytes per ns = GB/s */
        busbw = algbw * factor;                                            /* NCCL's definition */
        sent = ring[k][0].by_coll[DPAR_COLL_ALLREDUCE].bytes_sent / ITERS; /* what one rank put on its link */
        ok &= fabs(busbw - sent / t) <= 1e-9 * busbw;
        printf("%10zu %9.1f %11.3f %11.3f %20llu\n", sizes[k], t / 1e3, algbw, busbw, (unsigned long long)sent);
    }
    if (ok) puts("busbw = algbw x 2(N-1)/N = bytes sent per rank / time, at every size; dpar's own busbw agrees");
    for (f = fopen(TRACE, "r"); f && fgets(line, sizeof line, f);) { /* one event a line */
        if (!(p = strstr(line, "\"tid\":")) || sscanf(p, "\"tid\":%d", &tid) != 1 || tid < 0 || tid >= 64) continue;
        events++;
        if (strstr(line, "\"thread_name\"") && (p = strstr(line, " rank ")) && sscanf(p, " rank %d", &rank) == 1)
            of[tid] = 1 + rank; /* of[track] = 1 + rank, from the track's name ("comm rank 2"), before its events */
        if (!(p = strstr(line, "\"dur\":")) || sscanf(p, "\"dur\":%llu.%llu", &us, &frac) != 2 ||
            (r = of[tid] - 1) < 0 || r >= N)
            continue; /* an event of rank r, "dur" in microseconds with 3 decimals: exact nanoseconds */
        if (strstr(line, "\"name\":\"allreduce\"") && strstr(line, "\"count\":4096,")) wt[r] += us * 1e3 + frac;
        if (strstr(line, "\"cat\":\"pipe\"") && (line[9] == 'F' || line[9] == 'B')) { /* {"name":"F3",... */
            bt[r] += us * 1000 + frac;
            spans[line[9] == 'B']++;
        }
    }
    if (f) fclose(f);
    printf("straggler: rank %d computes 25 ms a step, the others 5 ms; time in %d gradient allreduces:\n", SLOW, STEPS);
    for (r = 0; r < N; r++) {
        uint64_t waited = part2[r].by_coll[DPAR_COLL_ALLREDUCE].time_ns;
        printf("  rank %d: %6.1f ms in the trace, %6.1f ms by its counters%s\n", r, wt[r] / 1e6, waited / 1e6,
               r == SLOW ? "  <- it waits least: the others wait for it" : "");
        slow_trace = wt[r] < wt[slow_trace] ? r : slow_trace;
        if (waited < least) least = waited, slow_count = r;
        ok &= bt[r] == pstats[r].busy_ns; /* the runner's busy time, from the same clock readings */
        total += bt[r];
    }
    if ((ok &= slow_trace == SLOW && slow_count == SLOW))
        printf("the trace and the counters both name rank %d, the slowed rank\n", SLOW);
    bubble = 1 - total / (N * (double)pstats[0].run_ns); /* idle time over p x the makespan */
    ok &= fabs(schedule->bubble - (double)(N - 1) / (M + N - 1)) < 1e-12 &&
          fabs(bubble - pstats[0].measured_bubble) < 1e-12;
    printf("pipeline, GPipe, %d stages, %d micro-batches, forward 2 ms, backward 4 ms: bubble %.3f predicted = "
           "(p-1)/(m+p-1), %.3f measured\n",
           N, M, schedule->bubble, bubble);
    if ((ok &= events > 0 && spans[0] == N * M && spans[1] == N * M))
        printf("trace %s: %d events; %d F and %d B spans; each stage's busy time = the runner's\n", TRACE, events,
               spans[0], spans[1]);
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    dpar_pipe_schedule_destroy(schedule);
    if (!ok) fprintf(stderr, "FAILED: a check failed\n");
    return ok ? 0 : 1;
}
