/* 12_performance.c - lesson 12 of the guide (docs/guide/12_performance.md): busbw, a trace, a straggler, a bubble.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/12_performance.c -o build/lesson12 -pthread -lm
   Run:   build/lesson12
   Check: ^busbw = algbw x 2\(N-1\)/N = bytes sent per rank / time, at every size; dpar's own busbw agrees$
   Check: ^the trace and the counters both name rank 2, the slowed rank$
   Check: ^trace build/lesson12_trace.json: [0-9]+ events; [0-9]+ F and [0-9]+ B spans; each stage's busy time = the

   Four thread ranks. 1: ring allreduces of a few sizes, timed by dpar's counters, the bandwidths computed as
   nccl-tests does. 2: with a trace on (dpar_trace_start), a few steps in which rank 2 computes longer than the
   others; the trace file is read back (with the project's JSON reader, tests/json.h) to find who waited for
   whom. 3: a GPipe pipeline on the same ranks, its bubble read from the trace. Times vary from run to run: the
   checks are on counts, bytes and formulas. The trace is written under build/, where the lesson is built. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"
#include "tests/json.h" /* jv_parse, jv_get: a small JSON reader */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N 4          /* ranks */
#define MAXC 1048576 /* floats in the largest allreduce (4 MiB) */
#define ITERS 5      /* timed calls per size */
#define SLOW 2       /* the straggler */
#define STEPS 4      /* steps of part 2 */
#define M 4          /* micro-batches of part 3 */
#define TRACE "build/lesson12_trace.json"
static const size_t sizes[3] = {4096, 262144, 4194304}; /* bytes */
static float x[N][MAXC], y[N][MAXC];
static dpar_comm_stats ring[3][N];   /* part 1: every rank's counters after each size */
static dpar_comm_stats part2[N];     /* part 2: each rank's counters */
static dpar_pipe_stats pstats[N];    /* part 3 */
static dpar_pipe_schedule *schedule; /* GPipe, N stages, M micro-batches */
static dpar_group *group;
static int wrong_sums[N]; /* part 1: the wrong sums rank r saw */

/* what the trace says, per rank */
typedef struct {
    int events;               /* every event of a rank's track */
    double allreduce_ns[N];   /* part 2: time inside the gradient allreduces (count 4096) */
    uint64_t pipe_busy_ns[N]; /* part 3: the F and B spans added up */
    int forward_spans;
    int backward_spans;
} trace_sums;

static void sleep_ms(int ms)
{
    struct timespec t = {0, ms * 1000000L};
    nanosleep(&t, NULL);
}

static dpar_status forward(void *user, int micro, int chunk, const void *in, void *out)
{
    (void)user;
    (void)micro;
    (void)chunk;
    (void)in;
    (void)out;
    sleep_ms(2);
    return DPAR_OK;
}

static dpar_status backward(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    (void)user;
    (void)micro;
    (void)chunk;
    (void)in;
    (void)grad_out;
    (void)grad_in;
    sleep_ms(4);
    return DPAR_OK;
}

static dpar_status rank_main(void *user, int r, int n)
{
    dpar_comm *c;
    dpar_pipe *pipe = NULL;
    dpar_pipe_desc pd = {.schedule = schedule, .act_bytes = 64, .forward = forward, .backward = backward};
    size_t k, i;
    int step;
    dpar_status st = dpar_group_join(group, r, &c);
    (void)user;
    for (k = 0; k < 3 && st == DPAR_OK; k++) { /* part 1: x[i] = (r + 1) (i % 7 + 1): sums are exact */
        size_t count = sizes[k] / sizeof(float);
        for (i = 0; i < count; i++) x[r][i] = (float)((r + 1) * (i % 7 + 1));
        st = dpar_allreduce(c, x[r], y[r], count, DPAR_F32, DPAR_SUM); /* a warm-up call, not timed */
        if (st == DPAR_OK) st = dpar_comm_stats_reset(c);
        for (step = 0; step < ITERS && st == DPAR_OK; step++)
            st = dpar_allreduce(c, x[r], y[r], count, DPAR_F32, DPAR_SUM);
        for (i = 0; i < count; i++) wrong_sums[r] += y[r][i] != (float)(n * (n + 1) / 2 * (i % 7 + 1));
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
    if (st == DPAR_OK) st = dpar_pipe_create(&pd, &pipe);
    if (st == DPAR_OK) st = dpar_pipe_run(pipe, &pstats[r]);
    dpar_pipe_destroy(pipe);
    dpar_comm_destroy(c);
    return st;
}

/* part 1's table; 1 when every size passes its checks */
static int print_bandwidths(void)
{
    double factor = 2.0 * (N - 1) / N;
    int ok = 1;
    int k, r;
    printf("ring allreduce of f32 on %d thread ranks, %d calls a size (the slowest rank's mean time):\n", N, ITERS);
    for (k = 0; k < 3; k++) {
        double t = 0, algbw, busbw;
        uint64_t sent;
        for (r = 0; r < N; r++) {
            const dpar_comm_counters *a = &ring[k][r].by_coll[DPAR_COLL_ALLREDUCE];
            if (a->time_ns > t) t = (double)a->time_ns;
            ok &=
                !wrong_sums[r] && a->calls == ITERS && a->bytes_sent == ITERS * sizes[k] * 2 * (N - 1) / N; /* exact */
            ok &= ring[k][r].last_busbw_gbps == (double)sizes[k] / (double)ring[k][r].last.time_ns * factor;
        }
        t /= ITERS;                                                        /* ns a call */
        algbw = sizes[k] / t;                                              /* bytes per ns = GB/s */
        busbw = algbw * factor;                                            /* NCCL's definition */
        sent = ring[k][0].by_coll[DPAR_COLL_ALLREDUCE].bytes_sent / ITERS; /* what one rank put on its link */
        ok &= fabs(busbw - sent / t) <= 1e-9 * busbw;
        printf("  %7zu bytes: %7.1f us a call, algbw %.3f GB/s, busbw %.3f GB/s, %7llu bytes sent per rank\n", sizes[k],
               t / 1e3, algbw, busbw, (unsigned long long)sent);
    }
    if (ok) puts("busbw = algbw x 2(N-1)/N = bytes sent per rank / time, at every size; dpar's own busbw agrees");
    return ok;
}

/* the whole trace file in memory, parsed; NULL when it cannot be read or is not JSON */
static jv *read_trace(const char *path)
{
    FILE *f = fopen(path, "rb");
    long size;
    char *text;
    jv *doc = NULL;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    size = ftell(f);
    rewind(f);
    text = malloc((size_t)size + 1);
    if (text && fread(text, 1, (size_t)size, f) == (size_t)size) {
        text[size] = '\0';
        doc = jv_parse(text);
    }
    free(text);
    fclose(f);
    return doc;
}

/* Adds up the trace's spans per rank. Each rank's comm has a track (tid) named "comm rank R" by a thread_name
   event; the pipeline's spans F0..F3 and B0..B3 are on the same track. "dur" is in microseconds with three
   decimals, exact nanoseconds. */
static int sum_trace(const jv *doc, trace_sums *sums)
{
    int rank_of_track[64];
    const jv *event;
    const jv *events = jv_get(doc, "traceEvents");
    int t;
    for (t = 0; t < 64; t++) rank_of_track[t] = -1;
    if (!events || events->type != JV_ARR) return 0;
    for (event = events->child; event; event = event->next) {
        const jv *name = jv_get(event, "name");
        const jv *tid = jv_get(event, "tid");
        const jv *args = jv_get(event, "args");
        const jv *dur = jv_get(event, "dur");
        const jv *cat = jv_get(event, "cat");
        const jv *count = jv_get(args, "count");
        const jv *track_name = jv_get(args, "name");
        int track, rank;
        if (!name || name->type != JV_STR || !tid || tid->type != JV_NUM) continue;
        track = (int)tid->num;
        if (track < 0 || track >= 64) continue;
        sums->events++;
        if (!strcmp(name->str, "thread_name") && track_name && track_name->type == JV_STR &&
            sscanf(track_name->str, "comm rank %d", &rank) == 1)
            rank_of_track[track] = rank; /* before the track's first span */
        rank = rank_of_track[track];
        if (rank < 0 || rank >= N || !dur || dur->type != JV_NUM) continue;
        if (!strcmp(name->str, "allreduce") && count && count->num == 4096) sums->allreduce_ns[rank] += dur->num * 1e3;
        if (cat && cat->type == JV_STR && !strcmp(cat->str, "pipe") && (name->str[0] == 'F' || name->str[0] == 'B')) {
            sums->pipe_busy_ns[rank] += (uint64_t)llround(dur->num * 1e3);
            if (name->str[0] == 'F') sums->forward_spans++;
            else sums->backward_spans++;
        }
    }
    return 1;
}

int main(void)
{
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pipe_schedule_desc sd = {.kind = DPAR_PIPE_GPIPE, .p = N, .m = M};
    dpar_pool *pool = NULL;
    trace_sums sums = {0};
    double busy_total = 0;
    double bubble;
    uint64_t least_wait = UINT64_MAX;
    int slowest_by_trace = 0;
    int slowest_by_counters = 0;
    int ok, r;
    jv *doc;
    cd.size = N;
    pd.num_threads = N;
    cd.algo = DPAR_ALGO_RING; /* the ring at every size (dpar's own choice varies with size; lesson 3's algorithm) */
    if (dpar_pipe_schedule_create(&sd, &schedule) || dpar_group_create(&cd, &group) || dpar_pool_create(&pd, &pool) ||
        dpar_trace_start(TRACE) || dpar_pool_run(pool, rank_main, NULL) || dpar_trace_stop()) {
        fprintf(stderr, "12_performance: %s\n", dpar_last_error());
        return 1;
    }
    ok = print_bandwidths();
    doc = read_trace(TRACE);
    if (!doc || !sum_trace(doc, &sums)) {
        fprintf(stderr, "12_performance: cannot read the trace %s\n", TRACE);
        return 1;
    }
    jv_free(doc);
    printf("straggler: rank %d computes 25 ms a step, the others 5 ms; time in %d gradient allreduces:\n", SLOW, STEPS);
    for (r = 0; r < N; r++) {
        uint64_t waited = part2[r].by_coll[DPAR_COLL_ALLREDUCE].time_ns;
        printf("  rank %d: %6.1f ms in the trace, %6.1f ms by its counters%s\n", r, sums.allreduce_ns[r] / 1e6,
               waited / 1e6, r == SLOW ? "  <- it waits least: the others wait for it" : "");
        if (sums.allreduce_ns[r] < sums.allreduce_ns[slowest_by_trace]) slowest_by_trace = r;
        if (waited < least_wait) {
            least_wait = waited;
            slowest_by_counters = r;
        }
        ok &= sums.pipe_busy_ns[r] == pstats[r].busy_ns; /* the runner's busy time, from the same clock readings */
        busy_total += sums.pipe_busy_ns[r];
    }
    if ((ok &= slowest_by_trace == SLOW && slowest_by_counters == SLOW))
        printf("the trace and the counters both name rank %d, the slowed rank\n", SLOW);
    bubble = 1 - busy_total / (N * (double)pstats[0].run_ns); /* idle time over p x the makespan */
    ok &= fabs(schedule->bubble - (double)(N - 1) / (M + N - 1)) < 1e-12;
    ok &= fabs(bubble - pstats[0].measured_bubble) < 1e-12;
    printf("pipeline, GPipe, %d stages, %d micro-batches, forward 2 ms, backward 4 ms: bubble %.3f predicted = "
           "(p-1)/(m+p-1), measured %.3f\n",
           N, M, schedule->bubble, bubble);
    if ((ok &= sums.events > 0 && sums.forward_spans == N * M && sums.backward_spans == N * M))
        printf("trace %s: %d events; %d F and %d B spans; each stage's busy time = the runner's\n", TRACE, sums.events,
               sums.forward_spans, sums.backward_spans);
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    dpar_pipe_schedule_destroy(schedule);
    if (!ok) fprintf(stderr, "FAILED: a check failed\n");
    return ok ? 0 : 1;
}
