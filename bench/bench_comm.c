/* bench_comm.c - allreduce over thread ranks against a memory-bandwidth reference, in one run.

   For each size, first the reference: the N threads each make one pass of out[i] = x[i] + y[i]
   over the same number of bytes at the same time. Then N ranks allreduce that many bytes of f32 on
   one comm per algorithm, in the same samples: the automatic choice (mode=auto), each algorithm
   forced (mode=forced: the ring, the ring's state before the algorithms were chosen by size;
   one-shot up to 1 MiB; reduce-by-slice), then the deterministic tree (transport=threads-det).
   Sizes from 64 bytes. After each rank count, bench=allreduce_choice: up to which size one-shot was
   the fastest, where the ring beat reduce-by-slice by 5% or more (0: nowhere), beside the
   thresholds dpar was built with (DPAR_ONESHOT_MAX_BYTES, ...).
   ratio = ref_us / us: 1.0 means the allreduce costs one pass over memory. Medians of 5 samples.
   limit = the ratio the traffic model allows (docs/comm.md, 'Traffic'): the reference's bytes
   through memory per thread over the algorithm's per rank, for buffers larger than the LLC (below
   that size the caches, not the model, decide).

   Last, bench=alltoallv: 2 and 4 ranks, 4 KiB to 4 MiB sent per rank (bytes=), dpar_alltoallv with equal counts
   against dpar_alltoall of the same count on the same comm, alternating samples, medians of 5; ratio =
   alltoall_us / us (1.0: the per-peer counts and their check cost nothing over alltoall; MPI's comparison is
   bench_mpi's).

   Then bench=ops_batch: the contract checker's cost on a comm another library runs (dpar_comm_from_ops; the
   "library" here is a threads comm, as NCCL would be): 8 allreduces of 4 KiB (a step's gradient buckets) with the
   checker per call (one exchange each), batched (dpar_batch_begin/_end: one exchange for the 8) and off, alternating
   samples, medians of 5; check_us_per_call = (per_call - off) / 8, batch_check_us = batched - off.

   Build: cc -std=c99 -O3 -I. bench/bench_comm.c -o bench_comm -pthread
   Run:   ./bench_comm [max_bytes]      (default 256 MiB; prints one bench= line per case, and
          bench=line_roundtrip before and after each rank count: the machine's price of a message) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <stdio.h>
#include <stdlib.h>

#include "line_probe.h"

#define SAMPLES 5

#define COMMS 5 /* auto, ring, oneshot, slice, deterministic */
static const int comm_algo[COMMS] = {DPAR_ALGO_AUTO, DPAR_ALGO_RING, DPAR_ALGO_ONESHOT, DPAR_ALGO_SLICE,
                                     DPAR_ALGO_AUTO};

typedef struct {
    int n;
    size_t bytes;
    int reps;
    float *x[4], *y[4], *out[4];
    dpar_comm *comm[COMMS][4];
    dpar_group *group[COMMS];
    int on[COMMS];                        /* measured at this size */
    double sample_us[1 + COMMS][SAMPLES]; /* [reference, each comm] */
    dpar_algo ran[COMMS];
    dpar_pool *pool;
} bench;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static dpar_status rank_main(void *user, int r, int n)
{
    bench *b = (bench *)user;
    size_t count = b->bytes / sizeof(float), i;
    int s, k, m;
    float *x = b->x[r], *y = b->y[r], *o = b->out[r];
    (void)n;
    for (s = -1; s < SAMPLES; s++) { /* sample -1 warms up */
        uint64_t t0;
        /* reference: one pass of out = x + y on every thread at once */
        dpar_pool_barrier(b->pool);
        t0 = dpar_time_ns();
        for (k = 0; k < b->reps; k++) {
            for (i = 0; i < count; i++) o[i] = x[i] + y[i];
            __asm__ __volatile__("" ::"r"(o) : "memory");
        }
        dpar_pool_barrier(b->pool);
        if (r == 0 && s >= 0) b->sample_us[0][s] = (double)(dpar_time_ns() - t0) / 1e3 / b->reps;
        /* allreduce of the same bytes, on each comm in turn */
        for (m = 0; m < COMMS; m++) {
            dpar_comm *c = b->comm[m][r];
            if (!b->on[m]) continue;
            dpar_barrier(c);
            t0 = dpar_time_ns();
            for (k = 0; k < b->reps; k++) dpar_allreduce(c, x, o, count, DPAR_F32, DPAR_SUM);
            dpar_barrier(c);
            if (r == 0 && s >= 0) b->sample_us[1 + m][s] = (double)(dpar_time_ns() - t0) / 1e3 / b->reps;
            if (r == 0) {
                dpar_comm_stats st;
                dpar_comm_stats_get(c, &st);
                b->ran[m] = st.last_algo;
            }
        }
    }
    return DPAR_OK;
}

static dpar_status join(void *user, int r, int n)
{
    bench *b = (bench *)user;
    int m;
    dpar_status st = DPAR_OK;
    (void)n;
    for (m = 0; m < COMMS && st == DPAR_OK; m++) st = dpar_group_join(b->group[m], r, &b->comm[m][r]);
    return st;
}
static dpar_status leave(void *user, int r, int n)
{
    bench *b = (bench *)user;
    int m;
    (void)n;
    for (m = 0; m < COMMS; m++) dpar_comm_destroy(b->comm[m][r]);
    return DPAR_OK;
}
static dpar_status touch(void *user, int r, int n)
{
    bench *b = (bench *)user;
    size_t count = b->bytes / sizeof(float), i;
    (void)n;
    for (i = 0; i < count; i++) { /* first touch on the thread that uses it */
        b->x[r][i] = (float)(i % 7);
        b->y[r][i] = 1.0f;
        b->out[r][i] = 0.0f;
    }
    return DPAR_OK;
}

/* The machine's own cost of a message (bench/line_probe.h) between the pool's threads 0 and 1, where the
   ranks run: a small allreduce cannot take less than about one round trip, so make bench prints it before
   and after each rank count, to read the small sizes' figures against. */
#define PROBE_TRIPS 100000
static struct {
    int ball[16]; /* a line of its own (64 bytes) */
    int back[16];
    int base; /* the values of the previous probe end here */
    double ns;
} probe;
static dpar_status roundtrip(void *user, int r, int n)
{
    bench *b = (bench *)user;
    int base = probe.base; /* read before the barrier: rank 0 moves it after the second */
    (void)n;
    dpar_pool_barrier(b->pool);
    if (r < 2) {
        double ns = line_pingpong(probe.ball, probe.back, r, base, PROBE_TRIPS);
        if (r == 0) probe.ns = ns;
    }
    dpar_pool_barrier(b->pool);
    if (r == 0) probe.base = base + PROBE_TRIPS;
    return DPAR_OK;
}
static void print_roundtrip(bench *b, const char *when)
{
    dpar_pool_run(b->pool, roundtrip, b);
    printf("bench=line_roundtrip threads=%d when=%s ns=%.1f\n", b->n, when, probe.ns);
    fflush(stdout);
}

/* The traffic model (docs/comm.md, 'Traffic'): bytes through memory per rank, in units of the
   message, reads + writes + the read of every ordinary store to a line not cached (write-allocate).
   The reference out = x + y: 2 + 1 + 1 = 4. */
static double traffic(dpar_algo a, int n, int stream)
{
    double f = (double)(n - 1) / n;
    switch (a) {
    case DPAR_ALGO_SLICE: /* read all N of my block and N-1 blocks; write 1 */
        return (1.0 + f) + 1.0 + (stream ? 0.0 : 1.0);
    case DPAR_ALGO_ONESHOT: /* my input, then every copy; write the staging copy (cached) and recv */
        return (1.0 + n) + 1.0 + 1.0;
    default: /* ring and tree: read 3(N-1)/N, write 2(N-1)/N */ return 3.0 * f + 2.0 * f + 2.0 * f;
    }
}

/* alltoallv with equal counts against alltoall (one pool run per size) */
typedef struct {
    dpar_group *g;
    dpar_comm *c[4];
    float *x[4], *y[4];
    size_t per;
    int reps;
    double us[2][SAMPLES]; /* [alltoallv, alltoall] */
} v_bench;
static dpar_status v_join(void *user, int r, int n)
{
    v_bench *v = (v_bench *)user;
    (void)n;
    return dpar_group_join(v->g, r, &v->c[r]);
}
static dpar_status v_rank(void *user, int r, int n)
{
    v_bench *v = (v_bench *)user;
    size_t counts[4];
    int s, j, k;
    for (k = 0; k < n; k++) counts[k] = v->per;
    for (s = -1; s < SAMPLES; s++)
        for (j = 0; j < 2; j++) {
            int plain = (j + s + 2) % 2; /* which goes first alternates */
            uint64_t t0;
            dpar_barrier(v->c[r]);
            t0 = dpar_time_ns();
            for (k = 0; k < v->reps; k++) {
                if (plain) dpar_alltoall(v->c[r], v->x[r], v->y[r], v->per, DPAR_F32);
                else dpar_alltoallv(v->c[r], v->x[r], counts, NULL, v->y[r], counts, NULL, DPAR_F32);
            }
            dpar_barrier(v->c[r]);
            if (r == 0 && s >= 0) v->us[plain][s] = (double)(dpar_time_ns() - t0) / 1e3 / v->reps;
        }
    return DPAR_OK;
}
static void bench_alltoallv(void)
{
    static const int ranks[] = {2, 4};
    int ni, r;
    for (ni = 0; ni < 2; ni++) {
        int n = ranks[ni];
        size_t bytes, most = (size_t)4 << 20;
        v_bench v;
        dpar_pool *pool = NULL;
        dpar_pool_desc pd;
        dpar_comm_desc d;
        memset(&v, 0, sizeof v);
        memset(&pd, 0, sizeof pd);
        memset(&d, 0, sizeof d);
        pd.num_threads = n;
        d.size = n;
        if (dpar_pool_create(&pd, &pool) != DPAR_OK || dpar_group_create(&d, &v.g) != DPAR_OK) return;
        for (r = 0; r < n; r++) {
            v.x[r] = (float *)calloc(1, most);
            v.y[r] = (float *)calloc(1, most);
        }
        if (dpar_pool_run(pool, v_join, &v) != DPAR_OK) return;
        for (bytes = 4096; bytes <= most; bytes *= 4) {
            v.per = bytes / sizeof(float) / (size_t)n;
            v.reps = bytes <= 65536 ? 1000 : bytes <= (1u << 20) ? 50 : 10;
            dpar_pool_run(pool, v_rank, &v);
            qsort(v.us[0], SAMPLES, sizeof(double), cmp_double);
            qsort(v.us[1], SAMPLES, sizeof(double), cmp_double);
            printf("bench=alltoallv transport=threads ranks=%d bytes=%zu us=%.2f alltoall_us=%.2f ratio=%.2f\n", n,
                   v.per * (size_t)n * sizeof(float), v.us[0][SAMPLES / 2], v.us[1][SAMPLES / 2],
                   v.us[1][SAMPLES / 2] / v.us[0][SAMPLES / 2]);
            fflush(stdout);
        }
        for (r = 0; r < n; r++) {
            dpar_comm_destroy(v.c[r]);
            free(v.x[r]);
            free(v.y[r]);
        }
        dpar_group_destroy(v.g);
        dpar_pool_destroy(pool);
    }
}

/* the checker on a library's comm: per call, batched, off */
enum { OB_CALLS = 8, OB_FLOATS = 1024 };
typedef struct {
    dpar_group *g;
    dpar_comm *inner[4], *c[2][4]; /* [checked, unchecked] library comms over the inner threads comm */
    float *x[4];
    int reps;
    double us[3][SAMPLES]; /* [per call, batched, off] */
} ob_bench;
static dpar_status ob_run(void *user, const dpar_comm_call *k)
{
    return dpar_allreduce((dpar_comm *)user, k->send, k->recv, k->count, k->dtype, k->op);
}
static dpar_status ob_exchange(void *user, const void *mine, void *all, size_t bytes, uint64_t deadline_ns)
{
    dpar_comm *inner = (dpar_comm *)user;
    (void)deadline_ns;
    return dpar_allgather(inner, mine, all, bytes * (size_t)dpar_comm_size(inner), DPAR_U8);
}
static dpar_status ob_join(void *user, int r, int n)
{
    ob_bench *o = (ob_bench *)user;
    dpar_comm_ops ops;
    dpar_comm_desc d;
    int k;
    DPAR__TRY(dpar_group_join(o->g, r, &o->inner[r]));
    memset(&ops, 0, sizeof ops);
    ops.user = o->inner[r], ops.rank = r, ops.size = n, ops.run = ob_run, ops.exchange = ob_exchange;
    for (k = 0; k < 2; k++) {
        memset(&d, 0, sizeof d);
        d.no_check = k;
        DPAR__TRY(dpar_comm_from_ops(&ops, &d, &o->c[k][r]));
    }
    return DPAR_OK;
}
static dpar_status ob_rank(void *user, int r, int n)
{
    ob_bench *o = (ob_bench *)user;
    int s, j, k, i;
    (void)n;
    for (s = -1; s < SAMPLES; s++)
        for (j = 0; j < 3; j++) {
            int mode = (j + s + 3) % 3; /* which goes first rotates */
            dpar_comm *c = o->c[mode == 2][r];
            uint64_t t0;
            dpar_barrier(o->inner[r]);
            t0 = dpar_time_ns();
            for (i = 0; i < o->reps; i++) {
                if (mode == 1) dpar_batch_begin(c);
                for (k = 0; k < OB_CALLS; k++)
                    dpar_allreduce(c, o->x[r] + k * OB_FLOATS, o->x[r] + k * OB_FLOATS, OB_FLOATS, DPAR_F32, DPAR_SUM);
                if (mode == 1) dpar_batch_end(c);
            }
            dpar_barrier(o->inner[r]);
            if (r == 0 && s >= 0) o->us[mode][s] = (double)(dpar_time_ns() - t0) / 1e3 / o->reps;
        }
    return DPAR_OK;
}
static void bench_ops_batch(void)
{
    static const int ranks[] = {2, 4};
    int ni, r, k;
    for (ni = 0; ni < 2; ni++) {
        int n = ranks[ni];
        ob_bench o;
        dpar_pool *pool = NULL;
        dpar_pool_desc pd;
        dpar_comm_desc d;
        double m[3];
        memset(&o, 0, sizeof o);
        memset(&pd, 0, sizeof pd);
        memset(&d, 0, sizeof d);
        pd.num_threads = n;
        d.size = n;
        if (dpar_pool_create(&pd, &pool) != DPAR_OK || dpar_group_create(&d, &o.g) != DPAR_OK) return;
        for (r = 0; r < n; r++) o.x[r] = (float *)calloc(OB_CALLS * OB_FLOATS, sizeof(float));
        if (dpar_pool_run(pool, ob_join, &o) != DPAR_OK) return;
        o.reps = 300;
        dpar_pool_run(pool, ob_rank, &o);
        for (k = 0; k < 3; k++) {
            qsort(o.us[k], SAMPLES, sizeof(double), cmp_double);
            m[k] = o.us[k][SAMPLES / 2];
        }
        printf("bench=ops_batch ranks=%d calls=%d bytes=%d per_call_us=%.2f batched_us=%.2f unchecked_us=%.2f "
               "check_us_per_call=%.2f batch_check_us=%.2f\n",
               n, OB_CALLS, OB_FLOATS * 4, m[0], m[1], m[2], (m[0] - m[2]) / OB_CALLS, m[1] - m[2]);
        fflush(stdout);
        for (r = 0; r < n; r++) {
            dpar_comm_destroy(o.c[0][r]);
            dpar_comm_destroy(o.c[1][r]);
            dpar_comm_destroy(o.inner[r]);
            free(o.x[r]);
        }
        dpar_group_destroy(o.g);
        dpar_pool_destroy(pool);
    }
}

int main(int argc, char **argv)
{
    size_t max_bytes = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : (size_t)256 << 20, bytes;
    int ni, r, m;
    static const int ranks[] = {2, 4};
    for (ni = 0; ni < 2; ni++) {
        int n = ranks[ni];
        bench b;
        dpar_pool_desc pd;
        memset(&b, 0, sizeof b);
        memset(&pd, 0, sizeof pd);
        pd.num_threads = n;
        if (dpar_pool_create(&pd, &b.pool) != DPAR_OK) return 1;
        b.n = n;
        for (r = 0; r < n; r++) {
            b.x[r] = (float *)malloc(max_bytes);
            b.y[r] = (float *)malloc(max_bytes);
            b.out[r] = (float *)malloc(max_bytes);
            if (!b.x[r] || !b.y[r] || !b.out[r]) {
                fprintf(stderr, "bench_comm: out of memory\n");
                return 1;
            }
        }
        b.bytes = max_bytes;
        dpar_pool_run(b.pool, touch, &b);
        for (m = 0; m < COMMS; m++) {
            dpar_comm_desc d;
            memset(&d, 0, sizeof d);
            d.size = n;
            d.algo = comm_algo[m];
            d.deterministic = m == COMMS - 1;
            if (dpar_group_create(&d, &b.group[m]) != DPAR_OK) return 1;
        }
        if (dpar_pool_run(b.pool, join, &b) != DPAR_OK) return 1;
        print_roundtrip(&b, "before");
        int ns = 0, k;
        size_t sizes[32];
        double forced[32][COMMS]; /* us of each comm at each size */
        for (bytes = 64; bytes <= max_bytes && ns < 32; bytes *= 4, ns++) {
            double ref;
            b.bytes = bytes;
            b.reps = bytes <= 65536 ? 2000 : bytes <= (1u << 20) ? 200 : bytes <= (16u << 20) ? 10 : 2;
            for (m = 0; m < COMMS; m++) {
                b.on[m] = comm_algo[m] != DPAR_ALGO_ONESHOT || bytes <= (1u << 20);
                forced[ns][m] = 1e300; /* not measured */
            }
            dpar_pool_run(b.pool, rank_main, &b);
            qsort(b.sample_us[0], SAMPLES, sizeof(double), cmp_double);
            ref = b.sample_us[0][SAMPLES / 2];
            for (m = 0; m < COMMS; m++) {
                double us, busbw;
                /* streaming stores where dpar makes them: destinations of all ranks beyond the LLC */
                int stream = (double)bytes * n >= 32.0 * 1024 * 1024 && b.ran[m] == DPAR_ALGO_SLICE;
                if (!b.on[m]) continue;
                qsort(b.sample_us[1 + m], SAMPLES, sizeof(double), cmp_double);
                us = b.sample_us[1 + m][SAMPLES / 2];
                sizes[ns] = bytes;
                forced[ns][m] = us;
                busbw = (double)bytes / (us * 1e3) * 2.0 * (n - 1) / n;
                printf("bench=allreduce transport=%s ranks=%d bytes=%zu algo=%s mode=%s us=%.2f busbw_GBps=%.2f "
                       "ref_us=%.2f ratio=%.2f limit=%.2f\n",
                       m == COMMS - 1 ? "threads-det" : "threads", n, bytes, dpar_algo_name(b.ran[m]),
                       comm_algo[m] == DPAR_ALGO_AUTO ? "auto" : "forced", us, busbw, ref, ref / us,
                       4.0 / traffic(b.ran[m], n, stream));
            }
            fflush(stdout);
        }
        { /* the thresholds this run measured, beside the ones dpar was built with (the forced lines) */
            size_t oneshot_max = 0, ring_from = 0, ring_to = 0;
            for (k = 0; k < ns && forced[k][2] < forced[k][1] && forced[k][2] < forced[k][3]; k++)
                oneshot_max = sizes[k];
            for (k = 0; k < ns; k++) /* the ring ahead of reduce-by-slice by 5% or more */
                if (sizes[k] > oneshot_max && forced[k][1] < 0.95 * forced[k][3]) {
                    if (!ring_from) ring_from = sizes[k];
                    ring_to = sizes[k];
                }
            printf("bench=allreduce_choice transport=threads ranks=%d oneshot_fastest_to=%zu ring_fastest_from=%zu "
                   "ring_fastest_to=%zu built_oneshot_max=%d built_slice_min=%d built_ring_min=%d\n",
                   n, oneshot_max, ring_from, ring_to, DPAR_ONESHOT_MAX_BYTES, DPAR_SLICE_MIN_BYTES,
                   (int)DPAR_RING_MIN_BYTES);
            fflush(stdout);
        }
        print_roundtrip(&b, "after");
        dpar_pool_run(b.pool, leave, &b);
        for (m = 0; m < COMMS; m++) dpar_group_destroy(b.group[m]);
        for (r = 0; r < n; r++) {
            free(b.x[r]);
            free(b.y[r]);
            free(b.out[r]);
        }
        dpar_pool_destroy(b.pool);
    }
    bench_alltoallv();
    bench_ops_batch();
    return 0;
}
