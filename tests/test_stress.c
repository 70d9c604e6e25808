/* test_stress.c - 8 thread ranks (on however few cores) running mixed collectives of random kinds, sizes, dtypes and
   ops, every element of every result against a reference computed apart (tests/stress.h); and the steady state
   allocating nothing: after a warm-up, the pool, the comm, the buckets, the pipeline runner and work stealing make
   no allocation per operation (counted through their allocator hooks).
   Iterations: DPAR_STRESS_ITERS (make stress: 100000); default 8000, 1000 under ASan, 200 under TSan. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"
#include "dpar_test.h"
#include "coll_matrix.h"
#include "stress.h"

#if defined(__SANITIZE_THREAD__)
#define STRESS_DEFAULT 200
#elif defined(__SANITIZE_ADDRESS__)
#define STRESS_DEFAULT 1000
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define STRESS_DEFAULT 200
#elif __has_feature(address_sanitizer)
#define STRESS_DEFAULT 1000
#endif
#endif
#ifndef STRESS_DEFAULT
#define STRESS_DEFAULT 8000
#endif
#define ALLOC_ROUNDS (STRESS_DEFAULT >= 1000 ? 20 : 3) /* rounds counted after the warm-up (TSan: few, it is slow) */

static long stress_iters(void)
{
    const char *e = getenv("DPAR_STRESS_ITERS");
    return e && *e ? atol(e) : STRESS_DEFAULT;
}

typedef struct {
    uint64_t seed;
    long iters;
    stress_counts counts[8];
} stress_job;

static void stress_thread_rank(world *w, dpar_comm *c, int r)
{
    stress_job *j = (stress_job *)w->user;
    char *s = (char *)malloc((size_t)STRESS_MAX * 8), *v = (char *)malloc((size_t)STRESS_MAX * 8);
    stress_rank(w, c, r, j->seed, j->iters, s, v, &j->counts[r]);
    free(s);
    free(v);
}

static void test_stress_8_thread_ranks(void)
{
    stress_job j;
    dpar_comm_desc d;
    double t0 = dt_now();
    int k;
    memset(&j, 0, sizeof j);
    memset(&d, 0, sizeof d);
    d.timeout_ms = 20000;
    j.seed = 19;
    j.iters = stress_iters();
    CHECK(run_world_desc(8, &d, stress_thread_rank, &j, NULL, 0) == 0);
    printf("    %ld mixed calls on 8 thread ranks in %.1f s:", j.iters, dt_now() - t0);
    for (k = 0; k < 10; k++) printf(" %s %ld%s", stress_names[k], j.counts[0].calls[k], k < 9 ? "," : "\n");
    for (k = 0; k < 10; k++) CHECK(j.counts[0].calls[k] > 0 || j.iters < 100);
}

/* ---- nothing allocated per operation after a warm-up ---- */
static long alloc_count; /* every allocation through the hooks below, from any thread */
static void *count_alloc(void *user, size_t size)
{
    (void)user;
    __atomic_add_fetch(&alloc_count, 1, __ATOMIC_RELAXED);
    return malloc(size);
}
static void count_free(void *user, void *p)
{
    (void)user;
    free(p);
}
static long allocs(void) { return __atomic_load_n(&alloc_count, __ATOMIC_RELAXED); }

typedef struct {
    dpar_pipe_schedule *schedule;
    long before, after; /* rank 0's reading of the count, between barriers */
    char where[8][160]; /* per rank: the first operation that allocated, by name */
} alloc_job;

static dpar_status pipe_fwd(void *user, int micro, int chunk, const void *in, void *out)
{
    (void)user, (void)chunk;
    if (out) memset(out, micro, 64);
    (void)in;
    return DPAR_OK;
}
static dpar_status pipe_bwd(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    (void)user, (void)micro, (void)chunk, (void)in, (void)grad_out;
    if (grad_in) memset(grad_in, 1, 64);
    return DPAR_OK;
}

static dpar_status steal_task(void *user, int index, int by)
{
    __atomic_add_fetch((long *)user + index, 1, __ATOMIC_RELAXED);
    (void)by;
    return DPAR_OK;
}

/* one round of every operation; `where` gets the name of the first one that allocated (when watching) */
static void alloc_round(world *w, dpar_comm *c, int r, dpar_buckets *b, float *g, dpar_pipe *pipe, dpar_steal *steal,
                        long *ran, float *x, float *y, char *where)
{
    static const size_t sizes[3] = {100, 5000, 300000};
    size_t k;
    int N = w->n, i;
    long a0;
    dpar_request *req;
#define ALLOC_STEP(name, call)                                                                           \
    do {                                                                                                 \
        a0 = allocs();                                                                                   \
        expect_ok(w, (call), name, r);                                                                   \
        if (where && !where[0] && allocs() != a0) snprintf(where, 160, "%s (%ld)", name, allocs() - a0); \
    } while (0)
    for (k = 0; k < 3; k++) {
        ALLOC_STEP("allreduce", dpar_allreduce(c, x, y, sizes[k], DPAR_F32, DPAR_SUM));
        ALLOC_STEP("allreduce in place", dpar_allreduce(c, x, x, sizes[k], DPAR_BF16, DPAR_MAX));
        ALLOC_STEP("reduce", dpar_reduce(c, x, y, sizes[k], DPAR_F32, DPAR_SUM, (int)k % N));
        ALLOC_STEP("broadcast", dpar_broadcast(c, x, y, sizes[k], DPAR_F32, (int)k % N));
        ALLOC_STEP("allgather", dpar_allgather(c, x, y, sizes[k], DPAR_F32));
        ALLOC_STEP("reduce_scatter", dpar_reduce_scatter(c, x, y, sizes[k], DPAR_F32, DPAR_AVG));
        ALLOC_STEP("alltoall", dpar_alltoall(c, x, y, sizes[k] / (size_t)N, DPAR_F32));
        ALLOC_STEP("sendrecv", dpar_sendrecv(c, x, sizes[k], (r + 1) % N, y, sizes[k], (r + N - 1) % N, DPAR_F32, 3));
        req = NULL;
        a0 = allocs();
        expect_ok(w, dpar_iallreduce(c, x, y, sizes[k], DPAR_F32, DPAR_SUM, &req), "iallreduce", r);
        if (req) expect_ok(w, dpar_request_wait(req), "iallreduce wait", r);
        if (where && !where[0] && allocs() != a0) snprintf(where, 160, "iallreduce (%ld)", allocs() - a0);
    }
    ALLOC_STEP("barrier", dpar_barrier(c));
    a0 = allocs();
    for (i = 0; i < 4; i++) expect_ok(w, dpar_buckets_ready(b, (size_t)(3 - i) * 25000, 25000), "buckets_ready", r);
    expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r);
    if (where && !where[0] && allocs() != a0) snprintf(where, 160, "buckets step (%ld)", allocs() - a0);
    (void)g;
    ALLOC_STEP("pipe run", dpar_pipe_run(pipe, NULL));
    ALLOC_STEP("steal run", dpar_steal_run(steal, 16 + 8 * r, steal_task, NULL, ran));
#undef ALLOC_STEP
}

static void alloc_rank(world *w, dpar_comm *c, int r)
{
    alloc_job *j = (alloc_job *)w->user;
    float *x = (float *)calloc(300000, sizeof(float)), *y = (float *)calloc(300000, sizeof(float));
    float *g = (float *)calloc(100000, sizeof(float));
    dpar_buckets *b = NULL;
    dpar_pipe *pipe = NULL;
    dpar_steal *steal = NULL;
    dpar_buckets_desc bd;
    dpar_pipe_desc pd;
    dpar_steal_desc sd;
    long ran[64];
    int round, k;
    memset(&bd, 0, sizeof bd);
    bd.comm = c, bd.grads = g, bd.count = 100000, bd.bucket_bytes = 64 << 10, bd.op = DPAR_AVG;
    bd.allocator.alloc = count_alloc, bd.allocator.free = count_free;
    expect_ok(w, dpar_buckets_create(&bd, &b), "buckets_create", r);
    memset(&pd, 0, sizeof pd);
    pd.schedule = j->schedule, pd.comm = c, pd.act_bytes = 64, pd.forward = pipe_fwd, pd.backward = pipe_bwd;
    pd.allocator = bd.allocator;
    expect_ok(w, dpar_pipe_create(&pd, &pipe), "pipe_create", r);
    memset(&sd, 0, sizeof sd);
    sd.comm = c, sd.max_tasks = 64, sd.allocator = bd.allocator;
    expect_ok(w, dpar_steal_create(&sd, &steal), "steal_create", r);
    memset(ran, 0, sizeof ran);
    if (!b || !pipe || !steal) goto out;
    for (round = 0; round < 3; round++) alloc_round(w, c, r, b, g, pipe, steal, ran, x, y, NULL); /* warm-up */
    expect_ok(w, dpar_barrier(c), "barrier", r);
    if (r == 0) j->before = allocs();
    expect_ok(w, dpar_barrier(c), "barrier", r);
    for (round = 0; round < ALLOC_ROUNDS; round++) alloc_round(w, c, r, b, g, pipe, steal, ran, x, y, j->where[r]);
    expect_ok(w, dpar_barrier(c), "barrier", r);
    if (r == 0) j->after = allocs();
    expect_ok(w, dpar_barrier(c), "barrier", r);
    for (k = 0; k < 16 + 8 * r; k++) /* every task of every round ran once, wherever it ran */
        if (__atomic_load_n(&ran[k], __ATOMIC_RELAXED) != 3 + ALLOC_ROUNDS)
            note(w, "rank %d: steal task %d ran %ld times", r, k, ran[k]);
out:
    dpar_steal_destroy(steal);
    dpar_pipe_destroy(pipe);
    dpar_buckets_destroy(b);
    free(x), free(y), free(g);
}

static dpar_status nop_task(void *user)
{
    (void)user;
    return DPAR_OK;
}
static void add_one(void *user, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    for (; begin < end; begin++) __atomic_add_fetch((long *)user, 1, __ATOMIC_RELAXED);
}

static void test_no_allocation_per_operation(void)
{
    alloc_job j;
    dpar_comm_desc d;
    dpar_pipe_schedule_desc sd;
    dpar_pool_desc pd;
    dpar_pool *pool;
    long before = 0, sum = 0;
    int k, round;
    memset(&j, 0, sizeof j);
    memset(&sd, 0, sizeof sd);
    sd.kind = DPAR_PIPE_1F1B, sd.p = 4, sd.m = 8;
    CHECK(dpar_pipe_schedule_create(&sd, &j.schedule) == DPAR_OK);
    memset(&d, 0, sizeof d);
    d.timeout_ms = 20000;
    d.allocator.alloc = count_alloc, d.allocator.free = count_free;
    CHECK(run_world_desc(4, &d, alloc_rank, &j, NULL, 0) == 0);
    for (k = 0; k < 4; k++)
        CHECK_MSG(!j.where[k][0], "rank %d saw allocations (any rank's) during its %s after the warm-up", k,
                  j.where[k]);
    CHECK_MSG(j.after == j.before, "%ld allocations in %d rounds after the warm-up", j.after - j.before, ALLOC_ROUNDS);
    CHECK(j.before > 0); /* the hook does count: creating them allocated */
    dpar_pipe_schedule_destroy(j.schedule);

    /* the pool: parallel-for, SPMD runs and task epochs */
    memset(&pd, 0, sizeof pd);
    pd.num_threads = 4;
    pd.allocator.alloc = count_alloc, pd.allocator.free = count_free;
    CHECK(dpar_pool_create(&pd, &pool) == DPAR_OK);
    for (round = 0; round < 3 + ALLOC_ROUNDS; round++) {
        dpar_task_desc td;
        dpar_task t[8];
        if (round == 3) before = allocs(); /* after three warm-up rounds */
        CHECK(dpar_pool_for(pool, 1000, add_one, &sum) == DPAR_OK);
        memset(&td, 0, sizeof td);
        td.fn = nop_task;
        for (k = 0; k < 8; k++) {
            td.deps = k ? &t[k - 1] : NULL, td.num_deps = k ? 1 : 0;
            CHECK(dpar_task_submit(pool, &td, &t[k]) == DPAR_OK);
        }
        CHECK(dpar_task_wait_all(pool) == DPAR_OK);
    }
    CHECK_MSG(allocs() == before, "the pool: %ld allocations in %d rounds after the warm-up", allocs() - before,
              ALLOC_ROUNDS);
    CHECK(sum == (3 + ALLOC_ROUNDS) * 1000);
    dpar_pool_destroy(pool);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_stress_8_thread_ranks);
    RUN(test_no_allocation_per_operation);
    pools_free();
    return dt_summary();
}
