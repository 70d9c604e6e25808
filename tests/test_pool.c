/* test_pool.c - the runtime (status, log, trace) and the worker pool against serial references.
   Build and run: make test (or: cc -std=c99 -O1 -g -Wall -I. tests/test_pool.c -pthread && ./a.out) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dpar_test.h"
#include "json.h"

static const int thread_counts[] = {1, 2, 3, 4, 8};
#define NCOUNTS ((int)(sizeof thread_counts / sizeof thread_counts[0]))

static dpar_pool *make_pool(int threads)
{
    dpar_pool *p = NULL;
    dpar_pool_desc d;
    memset(&d, 0, sizeof d);
    d.num_threads = threads;
    if (dpar_pool_create(&d, &p) != DPAR_OK) printf("    pool create failed: %s\n", dpar_last_error());
    return p;
}

/* ---- status, errors, log ---- */

static void test_status_strings(void)
{
    static const dpar_status all[] = {DPAR_OK,      DPAR_EINVAL,       DPAR_ENOMEM,    DPAR_EBUSY,    DPAR_ECANCELED,
                                      DPAR_EDEADLK, DPAR_ETIMEDOUT,    DPAR_EMISMATCH, DPAR_EABORTED, DPAR_EIO,
                                      DPAR_ESYSTEM, DPAR_EUNSUPPORTED, DPAR_ERANGE,    DPAR_ESTATE,   DPAR_ECORRUPT,
                                      DPAR_EUSER,   DPAR_EEXIST};
    static const char *names[] = {
        "DPAR_OK",        "DPAR_EINVAL",    "DPAR_ENOMEM",   "DPAR_EBUSY", "DPAR_ECANCELED", "DPAR_EDEADLK",
        "DPAR_ETIMEDOUT", "DPAR_EMISMATCH", "DPAR_EABORTED", "DPAR_EIO",   "DPAR_ESYSTEM",   "DPAR_EUNSUPPORTED",
        "DPAR_ERANGE",    "DPAR_ESTATE",    "DPAR_ECORRUPT", "DPAR_EUSER", "DPAR_EEXIST"};
    size_t i, j;
    for (i = 0; i < sizeof all / sizeof all[0]; i++) {
        const char *s = dpar_status_string(all[i]);
        CHECK_MSG(strstr(s, names[i]) != NULL, "%s does not name %s", s, names[i]);
        CHECK(i == 0 ? all[i] == 0 : all[i] < 0);
        for (j = 0; j < i; j++) CHECK(strcmp(s, dpar_status_string(all[j])) != 0);
    }
    CHECK(strstr(dpar_status_string((dpar_status)-999), "unknown") != NULL);
}

static void *error_in_thread(void *arg)
{
    const char **seen = (const char **)arg;
    *seen = dpar_last_error()[0] ? "nonempty" : "empty";
    dpar_set_error(DPAR_EIO, "thread-local %d", 7);
    return NULL;
}

static void test_last_error_is_per_thread(void)
{
    pthread_t t;
    const char *seen = NULL;
    CHECK(dpar_set_error(DPAR_EUSER, "main says %s", "hello") == DPAR_EUSER);
    pthread_create(&t, NULL, error_in_thread, &seen);
    pthread_join(t, NULL);
    CHECK(seen && !strcmp(seen, "empty"));
    CHECK(!strcmp(dpar_last_error(), "main says hello"));
    /* a message may quote the previous one: "outer: " + the old text, not a garble of both */
    dpar_set_error(DPAR_EIO, "outer (%s): %s", "x", dpar_last_error());
    CHECK(!strcmp(dpar_last_error(), "outer (x): main says hello"));
    dpar_clear_error();
    CHECK(!strcmp(dpar_last_error(), ""));
}

typedef struct {
    int count;
    dpar_log_level last;
    char msg[256];
} log_capture;
static void capture_log(void *user, dpar_log_level level, const char *file, int line, const char *message)
{
    log_capture *c = (log_capture *)user;
    c->count++;
    c->last = level;
    snprintf(c->msg, sizeof c->msg, "%s", message);
    (void)file;
    (void)line;
}

static void test_log_levels_and_callback(void)
{
    log_capture c;
    dpar_log_level saved = dpar_log_get_level();
    memset(&c, 0, sizeof c);
    dpar_log_set_callback(capture_log, &c);
    dpar_log_set_level(DPAR_LOG_WARN);
    dpar_log_message(DPAR_LOG_INFO, __FILE__, __LINE__, "dropped %d", 1);
    CHECK(c.count == 0);
    dpar_log_message(DPAR_LOG_WARN, __FILE__, __LINE__, "kept %d", 2);
    CHECK(c.count == 1 && c.last == DPAR_LOG_WARN && !strcmp(c.msg, "kept 2"));
    dpar_log_set_level(DPAR_LOG_DEBUG);
    dpar_log_message(DPAR_LOG_DEBUG, __FILE__, __LINE__, "debug");
    CHECK(c.count == 2);
    dpar_log_set_level(DPAR_LOG_OFF);
    dpar_log_message(DPAR_LOG_ERROR, __FILE__, __LINE__, "off");
    CHECK(c.count == 2);
    /* a bad DPAR_NUM_THREADS is reported through the log */
    dpar_log_set_level(DPAR_LOG_WARN);
    setenv("DPAR_NUM_THREADS", "lots", 1);
    {
        dpar_pool *p = make_pool(0);
        CHECK(p && dpar_pool_num_threads(p) >= 1);
        CHECK(c.count == 3 && strstr(c.msg, "DPAR_NUM_THREADS") != NULL);
        dpar_pool_destroy(p);
    }
    unsetenv("DPAR_NUM_THREADS");
    dpar_log_set_callback(NULL, NULL);
    dpar_log_set_level(saved);
}

/* ---- create, bad input ---- */

static void test_create_bad_input(void)
{
    dpar_pool *p = (dpar_pool *)&p;
    dpar_pool_desc d;
    dt_counting counts = {0, 0};
    CHECK(dpar_pool_create(NULL, NULL) == DPAR_EINVAL);
    memset(&d, 0, sizeof d);
    d.num_threads = -1;
    CHECK(dpar_pool_create(&d, &p) == DPAR_EINVAL && p == NULL);
    CHECK(strstr(dpar_last_error(), "-1") != NULL);
    d.num_threads = DPAR_MAX_THREADS + 1;
    CHECK(dpar_pool_create(&d, &p) == DPAR_ERANGE && p == NULL);
    d.num_threads = 2;
    d.spin_us = -7;
    CHECK(dpar_pool_create(&d, &p) == DPAR_EINVAL);
    d.spin_us = 0;
    d.allocator.alloc = dt_count_alloc; /* free missing */
    d.allocator.user = &counts;
    CHECK(dpar_pool_create(&d, &p) == DPAR_EINVAL);
    CHECK(counts.allocs == 0);
    CHECK(dpar_pool_destroy(NULL) == DPAR_OK);
    CHECK(dpar_pool_num_threads(NULL) == 0);
    CHECK(dpar_pool_query(NULL, &d) == DPAR_EINVAL);
}

static void test_create_defaults_and_query(void)
{
    dpar_pool *p;
    dpar_pool_desc used;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    CHECK(dpar_pool_create(NULL, &p) == DPAR_OK);
    CHECK(dpar_pool_query(p, &used) == DPAR_OK);
    CHECK(used.num_threads == (int)cpus);
    CHECK(used.spin_us == 200);
    CHECK(!strcmp(used.name, "pool"));
    CHECK(dpar_pool_thread_index(p) == -1);
    CHECK(dpar_pool_destroy(p) == DPAR_OK);
    setenv("DPAR_NUM_THREADS", "3", 1);
    p = make_pool(0);
    CHECK(dpar_pool_num_threads(p) == 3);
    dpar_pool_destroy(p);
    p = make_pool(5); /* the argument wins over the environment */
    CHECK(dpar_pool_num_threads(p) == 5);
    dpar_pool_destroy(p);
    unsetenv("DPAR_NUM_THREADS");
}

/* ---- parallel-for ---- */

typedef struct {
    int *visits; /* [n] */
    int64_t n;
    int nthreads;
    int bad_thread;
    int64_t *block_begin; /* [nthreads]: static schedule, where each thread started */
    int64_t grain;
    int bad_chunk;
} for_check;

static void visit(void *user, int64_t begin, int64_t end, int thread)
{
    for_check *c = (for_check *)user;
    int64_t i;
    if (thread < 0 || thread >= c->nthreads) __atomic_store_n(&c->bad_thread, 1, __ATOMIC_RELAXED);
    if (c->block_begin) c->block_begin[thread] = begin;
    if (c->grain && (end - begin > c->grain || (end - begin < c->grain && end != c->n) || begin % c->grain))
        __atomic_store_n(&c->bad_chunk, 1, __ATOMIC_RELAXED);
    for (i = begin; i < end; i++) __atomic_fetch_add(&c->visits[i], 1, __ATOMIC_RELAXED);
}

static void test_for_static_visits_each_index_once(void)
{
    int ti, ni, t;
    for (ti = 0; ti < NCOUNTS; ti++) {
        int T = thread_counts[ti];
        dpar_pool *p = make_pool(T);
        int64_t ns[] = {0, 1, 2, T - 1, T, T + 1, 1000, 100003};
        for (ni = 0; ni < (int)(sizeof ns / sizeof ns[0]); ni++) {
            int64_t n = ns[ni], i;
            for_check c;
            int64_t begins[8];
            int ok = 1;
            memset(&c, 0, sizeof c);
            c.n = n;
            c.nthreads = T;
            c.visits = (int *)calloc((size_t)n + 1, sizeof(int));
            for (t = 0; t < 8; t++) begins[t] = -1;
            c.block_begin = begins;
            CHECK(dpar_pool_for(p, n, visit, &c) == DPAR_OK);
            for (i = 0; i < n; i++) ok &= c.visits[i] == 1;
            CHECK_MSG(ok, "T=%d n=%lld: an index was not visited exactly once", T, (long long)n);
            CHECK(!c.bad_thread);
            /* thread t runs block t: [t*(n/T) + min(t, n%T), ...) */
            for (t = 0; t < T && T > 1; t++) {
                int64_t q = n / T, r = n % T, b = t * q + (t < r ? t : r), len = q + (t < r);
                CHECK_MSG(len == 0 ? begins[t] == -1 : begins[t] == b, "T=%d n=%lld thread %d began at %lld, not %lld",
                          T, (long long)n, t, (long long)begins[t], (long long)b);
            }
            free(c.visits);
        }
        dpar_pool_destroy(p);
    }
}

static void test_for_dynamic_visits_each_index_once(void)
{
    int ti, ni, gi;
    for (ti = 0; ti < NCOUNTS; ti++) {
        int T = thread_counts[ti];
        dpar_pool *p = make_pool(T);
        int64_t ns[] = {1, T + 1, 1000, 100003};
        int64_t grains[] = {0, 1, 7, 1000};
        for (ni = 0; ni < 4; ni++)
            for (gi = 0; gi < 4; gi++) {
                int64_t n = ns[ni], i;
                for_check c;
                int ok = 1;
                memset(&c, 0, sizeof c);
                c.n = n;
                c.nthreads = T;
                c.grain = grains[gi];
                c.visits = (int *)calloc((size_t)n, sizeof(int));
                CHECK(dpar_pool_for_dynamic(p, n, grains[gi], visit, &c) == DPAR_OK);
                for (i = 0; i < n; i++) ok &= c.visits[i] == 1;
                CHECK_MSG(ok, "T=%d n=%lld grain=%lld: an index was not visited exactly once", T, (long long)n,
                          (long long)grains[gi]);
                CHECK(!c.bad_thread);
                CHECK_MSG(!c.bad_chunk, "T=%d n=%lld grain=%lld: a chunk had the wrong size", T, (long long)n,
                          (long long)grains[gi]);
                free(c.visits);
            }
        dpar_pool_destroy(p);
    }
}

/* A parallel sum with per-thread partials against the serial sum: what a reduction looks like. */
typedef struct {
    const double *x;
    double partial[8 * 8];
} sum_job;
static void sum_part(void *user, int64_t begin, int64_t end, int thread)
{
    sum_job *j = (sum_job *)user;
    int64_t i;
    double s = 0;
    for (i = begin; i < end; i++) s += j->x[i];
    j->partial[thread * 8] += s; /* one cache line per thread */
}

static void test_for_parallel_sum_matches_serial(void)
{
    int64_t n = 1 << 20, i;
    double *x = (double *)malloc((size_t)n * sizeof *x), serial = 0, par;
    dpar_pool *p = make_pool(4);
    sum_job j;
    int t;
    for (i = 0; i < n; i++) x[i] = (double)(i % 1000) * 0.5; /* exact in double: sums are order-free */
    for (i = 0; i < n; i++) serial += x[i];
    memset(&j, 0, sizeof j);
    j.x = x;
    CHECK(dpar_pool_for(p, n, sum_part, &j) == DPAR_OK);
    for (par = 0, t = 0; t < 4; t++) par += j.partial[t * 8];
    CHECK(par == serial);
    memset(&j, 0, sizeof j);
    j.x = x;
    CHECK(dpar_pool_for_dynamic(p, n, 4096, sum_part, &j) == DPAR_OK);
    for (par = 0, t = 0; t < 4; t++) par += j.partial[t * 8];
    CHECK(par == serial);
    dpar_pool_destroy(p);
    free(x);
}

static void count_range(void *user, int64_t begin, int64_t end, int thread)
{
    __atomic_fetch_add((int64_t *)user, end - begin, __ATOMIC_RELAXED);
    (void)thread;
}

static void test_for_huge_n_and_bad_input(void)
{
    dpar_pool *p = make_pool(3);
    int64_t total = 0;
    CHECK(dpar_pool_for(p, INT64_MAX, count_range, &total) == DPAR_OK);
    CHECK(total == INT64_MAX);
    total = 0;
    CHECK(dpar_pool_for_dynamic(p, INT64_MAX, INT64_MAX / 5, count_range, &total) == DPAR_OK);
    CHECK(total == INT64_MAX);
    total = 0;
    CHECK(dpar_pool_for_dynamic(p, INT64_MAX - 1, 0, count_range, &total) == DPAR_OK);
    CHECK(total == INT64_MAX - 1);
    CHECK(dpar_pool_for(p, 0, count_range, &total) == DPAR_OK);
    CHECK(dpar_pool_for(NULL, 10, count_range, &total) == DPAR_EINVAL);
    CHECK(dpar_pool_for(p, 10, NULL, &total) == DPAR_EINVAL);
    CHECK(dpar_pool_for(p, -1, count_range, &total) == DPAR_EINVAL);
    CHECK(strstr(dpar_last_error(), "-1 is negative") != NULL);
    CHECK(dpar_pool_for_dynamic(p, 10, -3, count_range, &total) == DPAR_EINVAL);
    CHECK(dpar_pool_for_dynamic(p, INT64_MIN, 1, count_range, &total) == DPAR_EINVAL);
    CHECK(total == INT64_MAX - 1); /* nothing ran for the bad calls */
    dpar_pool_destroy(p);
}

/* Nested: every outer index runs an inner parallel-for on the same pool, which runs inline. */
typedef struct {
    dpar_pool *pool;
    int64_t inner_total;
    int wrong_thread;
} nest_job;
static void inner_body(void *user, int64_t begin, int64_t end, int thread)
{
    nest_job *j = (nest_job *)user;
    if (thread != dpar_pool_thread_index(j->pool)) __atomic_store_n(&j->wrong_thread, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&j->inner_total, end - begin, __ATOMIC_RELAXED);
}
static void outer_body(void *user, int64_t begin, int64_t end, int thread)
{
    nest_job *j = (nest_job *)user;
    int64_t i;
    if (thread != dpar_pool_thread_index(j->pool)) __atomic_store_n(&j->wrong_thread, 1, __ATOMIC_RELAXED);
    for (i = begin; i < end; i++) {
        dpar_pool_for(j->pool, 100, inner_body, j);
        dpar_pool_for_dynamic(j->pool, 10, 3, inner_body, j);
    }
}

static void test_for_nested_runs_inline(void)
{
    int ti;
    for (ti = 0; ti < NCOUNTS; ti++) {
        nest_job j;
        j.pool = make_pool(thread_counts[ti]);
        j.inner_total = 0;
        j.wrong_thread = 0;
        CHECK(dpar_pool_for(j.pool, 50, outer_body, &j) == DPAR_OK);
        CHECK(j.inner_total == 50 * 110);
        CHECK(!j.wrong_thread);
        dpar_pool_destroy(j.pool);
    }
}

/* Two outside threads share one pool: their calls take turns and both are right. */
typedef struct {
    dpar_pool *pool;
    int ok;
} shared_job;
static void *hammer(void *arg)
{
    shared_job *s = (shared_job *)arg;
    int r;
    s->ok = 1;
    for (r = 0; r < 300; r++) {
        int64_t total = 0;
        dpar_pool_for(s->pool, 1000 + r, count_range, &total);
        if (total != 1000 + r) s->ok = 0;
    }
    return NULL;
}

static void test_for_from_two_outside_threads(void)
{
    pthread_t a, b;
    shared_job ja, jb;
    ja.pool = jb.pool = make_pool(3);
    pthread_create(&a, NULL, hammer, &ja);
    pthread_create(&b, NULL, hammer, &jb);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    CHECK(ja.ok && jb.ok);
    dpar_pool_destroy(ja.pool);
}

/* ---- SPMD run and barrier ---- */

typedef struct {
    dpar_pool *pool;
    int arrived;
    int seen[8];
    int phase_errors;
    int rounds;
    int fail_thread;
    dpar_status nested, destroy_from_worker;
} run_job;

static dpar_status spmd_body(void *user, int thread, int nthreads)
{
    run_job *j = (run_job *)user;
    int r;
    j->seen[thread] = nthreads;
    /* phases: after barrier k every thread must see all T arrivals of phase k */
    for (r = 0; r < j->rounds; r++) {
        __atomic_fetch_add(&j->arrived, 1, __ATOMIC_RELAXED);
        dpar_pool_barrier(j->pool);
        if (__atomic_load_n(&j->arrived, __ATOMIC_RELAXED) < (r + 1) * nthreads)
            __atomic_fetch_add(&j->phase_errors, 1, __ATOMIC_RELAXED);
        dpar_pool_barrier(j->pool);
    }
    if (thread == 1) {
        j->nested = dpar_pool_run(j->pool, spmd_body, j);
        j->destroy_from_worker = dpar_pool_destroy(j->pool);
    }
    if (thread == j->fail_thread || thread == j->fail_thread + 1)
        return dpar_set_error(DPAR_EUSER, "rank %d gave up", thread);
    return DPAR_OK;
}

static void test_run_all_threads_and_barrier(void)
{
    int ti, t;
    for (ti = 0; ti < NCOUNTS; ti++) {
        int T = thread_counts[ti];
        run_job j;
        memset(&j, 0, sizeof j);
        j.pool = make_pool(T);
        j.rounds = 200;
        j.fail_thread = -5;
        CHECK(dpar_pool_run(j.pool, spmd_body, &j) == DPAR_OK);
        for (t = 0; t < T; t++) CHECK(j.seen[t] == T);
        CHECK(j.arrived == 200 * T);
        CHECK_MSG(j.phase_errors == 0, "T=%d: %d barrier phase errors", T, j.phase_errors);
        if (T > 1) {
            CHECK(j.nested == DPAR_EBUSY);
            CHECK(j.destroy_from_worker == DPAR_EBUSY);
        }
        /* errors: the lowest failing thread's status and text */
        if (T >= 3) {
            j.rounds = 1;
            j.arrived = 0;
            j.fail_thread = 1;
            CHECK(dpar_pool_run(j.pool, spmd_body, &j) == DPAR_EUSER);
            CHECK_MSG(strstr(dpar_last_error(), "thread 1") && strstr(dpar_last_error(), "rank 1 gave up"), "%s",
                      dpar_last_error());
        }
        CHECK(dpar_pool_barrier(j.pool) == DPAR_ESTATE); /* not inside a run */
        CHECK(dpar_pool_run(j.pool, NULL, NULL) == DPAR_EINVAL);
        CHECK(dpar_pool_run(NULL, spmd_body, &j) == DPAR_EINVAL);
        CHECK(dpar_pool_destroy(j.pool) == DPAR_OK);
    }
}

/* ---- tasks ---- */

static dpar_status bump_task(void *user)
{
    __atomic_fetch_add((int *)user, 1, __ATOMIC_RELAXED);
    return DPAR_OK;
}

static void test_tasks_100k_tiny(void)
{
    int ti;
    for (ti = 1; ti < NCOUNTS; ti += 2) { /* 2 and 8 threads */
        dpar_pool *p = make_pool(thread_counts[ti]);
        int count = 0, i;
        dpar_task_desc d;
        memset(&d, 0, sizeof d);
        d.fn = bump_task;
        d.user = &count;
        for (i = 0; i < 100000; i++)
            if (dpar_task_submit(p, &d, NULL) != DPAR_OK) break;
        CHECK(i == 100000);
        CHECK(dpar_task_wait_all(p) == DPAR_OK);
        CHECK(count == 100000);
        dpar_pool_destroy(p);
    }
}

/* A DAG node: value = id + sum of its dependencies' values (mod 2^61); checks it never runs early. */
typedef struct dag dag;
typedef struct {
    dag *g;
    int id;
} dag_node;
struct dag {
    int n;
    int *ndeps, **deps;
    unsigned long long *value;
    int *done;
    int early;
    int ran;
    int fail_node;
    dag_node *nodes;
};

static dpar_status dag_task(void *user)
{
    dag_node *nd = (dag_node *)user;
    dag *g = nd->g;
    unsigned long long v = (unsigned long long)nd->id;
    int k;
    for (k = 0; k < g->ndeps[nd->id]; k++) {
        int d = g->deps[nd->id][k];
        if (!__atomic_load_n(&g->done[d], __ATOMIC_ACQUIRE)) __atomic_store_n(&g->early, 1, __ATOMIC_RELAXED);
        v = (v + g->value[d] * 3u) & ((1ull << 61) - 1);
    }
    g->value[nd->id] = v;
    __atomic_fetch_add(&g->ran, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&g->done[nd->id], 1, __ATOMIC_RELEASE);
    if (nd->id == g->fail_node) return dpar_set_error(DPAR_EUSER, "node %d refuses", nd->id);
    return DPAR_OK;
}

/* shape 0: random (up to 4 deps among all earlier), 1: a chain, 2: layers of 100 fully fed by the
   previous layer's first 10, 3: one root feeding all, all feeding one sink */
static dag *dag_make(int n, int shape)
{
    dag *g = (dag *)calloc(1, sizeof *g);
    int i, k;
    g->n = n;
    g->ndeps = (int *)calloc((size_t)n, sizeof(int));
    g->deps = (int **)calloc((size_t)n, sizeof(int *));
    g->value = (unsigned long long *)calloc((size_t)n, sizeof(unsigned long long));
    g->done = (int *)calloc((size_t)n, sizeof(int));
    g->nodes = (dag_node *)calloc((size_t)n, sizeof(dag_node));
    g->fail_node = -1;
    for (i = 0; i < n; i++) {
        int want = 0;
        g->nodes[i].g = g;
        g->nodes[i].id = i;
        g->deps[i] = (int *)calloc(shape == 3 && i == n - 1 ? (size_t)n : 16, sizeof(int));
        if (shape == 0 && i > 0) {
            want = dt_rand_int(5);
            for (k = 0; k < want; k++) g->deps[i][g->ndeps[i]++] = dt_rand_int(i);
        } else if (shape == 1 && i > 0) {
            g->deps[i][g->ndeps[i]++] = i - 1;
        } else if (shape == 2 && i >= 100) {
            int layer0 = (i / 100 - 1) * 100;
            for (k = 0; k < 10; k++) g->deps[i][g->ndeps[i]++] = layer0 + k;
        } else if (shape == 3 && i > 0) {
            if (i < n - 1) g->deps[i][g->ndeps[i]++] = 0;
            else
                for (k = 1; k < n - 1; k++) g->deps[i][g->ndeps[i]++] = k;
        }
    }
    return g;
}

static void dag_free(dag *g)
{
    int i;
    for (i = 0; i < g->n; i++) free(g->deps[i]);
    free(g->ndeps);
    free(g->deps);
    free(g->value);
    free(g->done);
    free(g->nodes);
    free(g);
}

/* Submit the DAG in id order; returns handles. */
static dpar_task *dag_submit(dpar_pool *p, dag *g)
{
    dpar_task *h = (dpar_task *)calloc((size_t)g->n, sizeof *h), deps[16384];
    int i, k;
    for (i = 0; i < g->n; i++) {
        dpar_task_desc d;
        memset(&d, 0, sizeof d);
        for (k = 0; k < g->ndeps[i]; k++) deps[k] = h[g->deps[i][k]];
        d.fn = dag_task;
        d.user = &g->nodes[i];
        d.deps = deps;
        d.num_deps = g->ndeps[i];
        d.name = "dag node";
        if (dpar_task_submit(p, &d, &h[i]) != DPAR_OK) printf("    submit failed: %s\n", dpar_last_error());
    }
    return h;
}

static unsigned long long dag_serial_value(dag *g, int node, unsigned long long *memo)
{
    int i, k;
    for (i = 0; i <= node; i++) {
        unsigned long long v = (unsigned long long)i;
        for (k = 0; k < g->ndeps[i]; k++) v = (v + memo[g->deps[i][k]] * 3u) & ((1ull << 61) - 1);
        memo[i] = v;
    }
    return memo[node];
}

static void test_tasks_random_dags_10k(void)
{
    int shape, ti;
    for (ti = 0; ti < NCOUNTS; ti++)
        for (shape = 0; shape < 4; shape++) {
            int n = shape == 3 ? 3000 : 10000, i, ok = 1;
            dag *g = dag_make(n, shape);
            dpar_pool *p = make_pool(thread_counts[ti]);
            unsigned long long *memo = (unsigned long long *)calloc((size_t)n, sizeof *memo);
            dpar_task *h = dag_submit(p, g);
            CHECK(dpar_task_wait(p, h[n - 1]) == DPAR_OK);
            CHECK(dpar_task_wait_all(p) == DPAR_OK);
            CHECK(g->ran == n);
            CHECK(!g->early);
            dag_serial_value(g, n - 1, memo);
            for (i = 0; i < n; i++) ok &= memo[i] == g->value[i];
            CHECK_MSG(ok, "T=%d shape %d: values differ from the serial evaluation", thread_counts[ti], shape);
            dpar_pool_destroy(p);
            free(h);
            free(memo);
            dag_free(g);
        }
}

static int reaches(dag *g, int from, int to) /* does `to` depend on `from`, transitively? */
{
    int k;
    if (from == to) return 1;
    for (k = 0; k < g->ndeps[to]; k++)
        if (g->deps[to][k] >= from && reaches(g, from, g->deps[to][k])) return 1;
    return 0;
}

static void test_tasks_failure_cancels_dependents(void)
{
    int ti;
    for (ti = 0; ti < NCOUNTS; ti++) {
        int n = 400, i, wrong = 0, cancelled = 0;
        dag *g = dag_make(n, 0);
        dpar_pool *p = make_pool(thread_counts[ti]);
        dpar_task *h, late;
        dpar_task_desc d;
        g->fail_node = 50;
        h = dag_submit(p, g);
        CHECK(dpar_task_wait(p, h[50]) == DPAR_EUSER);
        CHECK(strstr(dpar_last_error(), "node 50 refuses") != NULL);
        for (i = 0; i < n; i++) {
            int dep = i != 50 && reaches(g, 50, i);
            dpar_status st = dpar_task_wait(p, h[i]);
            dpar_task_state s = dpar_task_state_of(p, h[i]);
            if (dep) {
                cancelled++;
                wrong += st != DPAR_EUSER || s != DPAR_TASK_CANCELLED || g->done[i];
                if (cancelled == 1)
                    CHECK_MSG(strstr(dpar_last_error(),
                                     "was cancelled: its dependency task 51 (dag node) failed: node 50 refuses"),
                              "%s", dpar_last_error());
            } else if (i == 50) {
                wrong += s != DPAR_TASK_FAILED;
            } else {
                wrong += st != DPAR_OK || s != DPAR_TASK_DONE || !g->done[i];
            }
        }
        CHECK_MSG(wrong == 0, "T=%d: %d tasks in the wrong state", thread_counts[ti], wrong);
        CHECK(cancelled > 0);
        /* a new task on a failed dependency is cancelled at once */
        memset(&d, 0, sizeof d);
        d.fn = dag_task;
        d.user = &g->nodes[0];
        d.deps = &h[50];
        d.num_deps = 1;
        CHECK(dpar_task_submit(p, &d, &late) == DPAR_OK);
        CHECK(dpar_task_state_of(p, late) == DPAR_TASK_CANCELLED);
        CHECK(dpar_task_wait_all(p) == DPAR_EUSER);
        CHECK_MSG(strstr(dpar_last_error(), "1 of") && strstr(dpar_last_error(), "node 50 refuses"), "%s",
                  dpar_last_error());
        /* the epoch ended: old handles are refused, new work runs */
        CHECK(dpar_task_wait(p, h[0]) == DPAR_EINVAL);
        CHECK(dpar_task_submit(p, &d, NULL) == DPAR_EINVAL);
        CHECK(dpar_task_wait_all(p) == DPAR_OK);
        dpar_pool_destroy(p);
        free(h);
        dag_free(g);
    }
}

/* A task that submits children and waits for them, inside the pool. */
typedef struct {
    dpar_pool *pool;
    int count;
    dpar_status child_wait;
    dpar_status self_wait, cycle_wait;
} spawn_job;
static dpar_status spawner(void *user)
{
    spawn_job *j = (spawn_job *)user;
    dpar_task kids[16];
    dpar_task_desc d;
    int i;
    memset(&d, 0, sizeof d);
    d.fn = bump_task;
    d.user = &j->count;
    for (i = 0; i < 16; i++)
        if (dpar_task_submit(j->pool, &d, &kids[i]) != DPAR_OK) return DPAR_EUSER;
    for (i = 0; i < 16; i++) {
        dpar_status st = dpar_task_wait(j->pool, kids[i]);
        if (st != DPAR_OK) j->child_wait = st;
    }
    return DPAR_OK;
}

static dpar_task current_self;
static dpar_status self_waiter(void *user)
{
    spawn_job *j = (spawn_job *)user;
    dpar_task child;
    dpar_task_desc d;
    j->self_wait = dpar_task_wait(j->pool, current_self);
    /* a child that depends on this task cannot finish first */
    memset(&d, 0, sizeof d);
    d.fn = bump_task;
    d.user = &j->count;
    d.deps = &current_self;
    d.num_deps = 1;
    dpar_task_submit(j->pool, &d, &child);
    j->cycle_wait = dpar_task_wait(j->pool, child);
    return DPAR_OK;
}

static void test_tasks_submit_and_wait_from_tasks(void)
{
    int ti;
    for (ti = 0; ti < NCOUNTS; ti++) {
        spawn_job j;
        dpar_task_desc d;
        dpar_task t;
        int i;
        memset(&j, 0, sizeof j);
        j.pool = make_pool(thread_counts[ti]);
        memset(&d, 0, sizeof d);
        d.fn = spawner;
        d.user = &j;
        for (i = 0; i < 20; i++) CHECK(dpar_task_submit(j.pool, &d, &t) == DPAR_OK);
        CHECK(dpar_task_wait_all(j.pool) == DPAR_OK);
        CHECK(j.count == 20 * 16);
        CHECK(j.child_wait == DPAR_OK);
        d.fn = self_waiter;
        CHECK(dpar_task_submit(j.pool, &d, &current_self) == DPAR_OK);
        CHECK(dpar_task_wait(j.pool, current_self) == DPAR_OK);
        CHECK(j.self_wait == DPAR_EDEADLK);
        CHECK(j.cycle_wait == DPAR_EDEADLK);
        CHECK(dpar_task_wait_all(j.pool) == DPAR_OK);
        CHECK(j.count == 20 * 16 + 1);
        dpar_pool_destroy(j.pool);
    }
}

static void test_tasks_bad_input(void)
{
    dpar_pool *p = make_pool(2);
    dpar_task_desc d;
    dpar_task t = 123, bogus = ((dpar_task)77 << 32) | 5;
    memset(&d, 0, sizeof d);
    CHECK(dpar_task_submit(NULL, &d, &t) == DPAR_EINVAL && t == 0);
    CHECK(dpar_task_submit(p, NULL, &t) == DPAR_EINVAL);
    CHECK(dpar_task_submit(p, &d, &t) == DPAR_EINVAL); /* no fn */
    d.fn = bump_task;
    d.num_deps = -1;
    CHECK(dpar_task_submit(p, &d, &t) == DPAR_EINVAL);
    d.num_deps = 2;
    CHECK(dpar_task_submit(p, &d, &t) == DPAR_EINVAL); /* deps NULL */
    d.deps = &bogus;
    d.num_deps = 1;
    CHECK(dpar_task_submit(p, &d, &t) == DPAR_EINVAL);
    CHECK(strstr(dpar_last_error(), "not a live task") != NULL);
    CHECK(dpar_task_wait(p, 0) == DPAR_EINVAL);
    CHECK(dpar_task_wait(p, bogus) == DPAR_EINVAL);
    CHECK(dpar_task_wait(NULL, bogus) == DPAR_EINVAL);
    CHECK(dpar_task_wait_all(NULL) == DPAR_EINVAL);
    CHECK(dpar_task_state_of(p, bogus) == DPAR_TASK_PENDING && strstr(dpar_last_error(), "not a live task"));
    CHECK(dpar_task_wait_all(p) == DPAR_OK);
    dpar_pool_destroy(p);
}

/* ---- destroy with work pending ---- */

typedef struct {
    int gate;
    int ran_after;
    int started;
} gate_job;
static dpar_status wait_gate(void *user)
{
    gate_job *g = (gate_job *)user;
    __atomic_store_n(&g->started, 1, __ATOMIC_RELEASE);
    while (!__atomic_load_n(&g->gate, __ATOMIC_ACQUIRE)) usleep(1000);
    return DPAR_OK;
}
static dpar_status mark_ran(void *user)
{
    __atomic_fetch_add(&((gate_job *)user)->ran_after, 1, __ATOMIC_RELAXED);
    return DPAR_OK;
}
static void *open_gate_later(void *arg)
{
    usleep(50000);
    __atomic_store_n(&((gate_job *)arg)->gate, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void test_destroy_cancels_pending_tasks(void)
{
    dt_counting counts = {0, 0};
    dpar_pool *p;
    dpar_pool_desc pd;
    dpar_task_desc d;
    dpar_task first;
    gate_job g;
    pthread_t opener;
    int i;
    memset(&g, 0, sizeof g);
    memset(&pd, 0, sizeof pd);
    pd.num_threads = 2;
    pd.allocator.alloc = dt_count_alloc;
    pd.allocator.free = dt_count_free;
    pd.allocator.user = &counts;
    CHECK(dpar_pool_create(&pd, &p) == DPAR_OK);
    memset(&d, 0, sizeof d);
    d.fn = wait_gate;
    d.user = &g;
    CHECK(dpar_task_submit(p, &d, &first) == DPAR_OK);
    while (!__atomic_load_n(&g.started, __ATOMIC_ACQUIRE)) usleep(100); /* the worker holds it */
    d.fn = mark_ran;
    d.deps = &first;
    d.num_deps = 1;
    for (i = 0; i < 5000; i++) CHECK(dpar_task_submit(p, &d, NULL) == DPAR_OK); /* chunks grow */
    pthread_create(&opener, NULL, open_gate_later, &g);
    CHECK(dpar_pool_destroy(p) == DPAR_ECANCELED); /* waits for the running task, cancels the rest */
    CHECK(strstr(dpar_last_error(), "5000 tasks") != NULL);
    pthread_join(opener, NULL);
    CHECK(g.ran_after == 0);
    CHECK(counts.allocs > 3 && counts.allocs == counts.frees);
}

/* ---- oversubscription, idle cost ---- */

typedef struct {
    dpar_pool *pool;
    int64_t sum;
    int count;
} stress_job;
static dpar_status stress_rank(void *user, int thread, int nthreads)
{
    stress_job *j = (stress_job *)user;
    int r;
    for (r = 0; r < 50; r++) {
        __atomic_fetch_add(&j->sum, thread + 1, __ATOMIC_RELAXED);
        dpar_pool_barrier(j->pool);
    }
    (void)nthreads;
    return DPAR_OK;
}

static void test_eight_threads_on_two_cores(void)
{
    stress_job j;
    dpar_task_desc d;
    int r;
    int64_t want = 0;
    memset(&j, 0, sizeof j);
    j.pool = make_pool(8);
    memset(&d, 0, sizeof d);
    d.fn = bump_task;
    d.user = &j.count;
    for (r = 0; r < 500; r++) {
        int64_t total = 0;
        dpar_task_submit(j.pool, &d, NULL);
        dpar_pool_for(j.pool, 10007, count_range, &total);
        if (total != 10007) break;
        dpar_pool_for_dynamic(j.pool, 10007, 13, count_range, &total);
        if (total != 2 * 10007) break;
        if (r % 25 == 0) {
            CHECK(dpar_pool_run(j.pool, stress_rank, &j) == DPAR_OK);
            want += 50 * 36;
        }
    }
    CHECK(r == 500);
    CHECK(dpar_task_wait_all(j.pool) == DPAR_OK);
    CHECK(j.count == 500);
    CHECK(j.sum == want);
    dpar_pool_destroy(j.pool);
}

static double cpu_seconds(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)u.ru_utime.tv_sec + 1e-6 * (double)u.ru_utime.tv_usec + (double)u.ru_stime.tv_sec +
           1e-6 * (double)u.ru_stime.tv_usec;
}

static void test_idle_pool_uses_no_cpu(void)
{
    dpar_pool *p = make_pool(4);
    int64_t total = 0;
    double c0, c1, w0, w1;
    dpar_pool_for(p, 1000, count_range, &total); /* wake everyone once */
    c0 = cpu_seconds();
    w0 = dt_now();
    usleep(1000000);
    c1 = cpu_seconds();
    w1 = dt_now();
    CHECK_MSG(c1 - c0 < 0.05 * (w1 - w0), "idle pool used %.1f ms of CPU in %.0f ms", 1e3 * (c1 - c0), 1e3 * (w1 - w0));
    printf("    idle 4-thread pool: %.2f ms CPU over %.0f ms\n", 1e3 * (c1 - c0), 1e3 * (w1 - w0));
    dpar_pool_destroy(p);
}

/* ---- pinning ---- */

typedef struct {
    int cpus;
    int wrong;
} pin_job;
static dpar_status check_affinity(void *user, int thread, int nthreads)
{
    pin_job *j = (pin_job *)user;
    unsigned long mask[16];
    long n;
    int cpu, count = 0, which = -1;
    (void)nthreads;
    if (thread == 0) return DPAR_OK; /* the caller is not pinned */
    memset(mask, 0, sizeof mask);
    n = syscall(SYS_sched_getaffinity, 0, sizeof mask, mask);
    if (n <= 0) return DPAR_OK;
    for (cpu = 0; cpu < (int)(8 * sizeof mask); cpu++)
        if (mask[cpu / (8 * sizeof(unsigned long))] >> (cpu % (8 * sizeof(unsigned long))) & 1) {
            count++;
            which = cpu;
        }
    if (count != 1 || which != thread % j->cpus) __atomic_fetch_add(&j->wrong, 1, __ATOMIC_RELAXED);
    return DPAR_OK;
}

static void test_pinning(void)
{
    dpar_pool *p;
    dpar_pool_desc d;
    pin_job j;
    memset(&d, 0, sizeof d);
    d.num_threads = 3;
    d.pin_threads = 1;
    CHECK(dpar_pool_create(&d, &p) == DPAR_OK);
    j.cpus = (int)sysconf(_SC_NPROCESSORS_ONLN);
    j.wrong = 0;
    CHECK(dpar_pool_run(p, check_affinity, &j) == DPAR_OK);
    CHECK(j.wrong == 0);
    dpar_pool_destroy(p);
}

/* ---- allocator ---- */

static void test_counting_allocator_balances(void)
{
    dt_counting counts = {0, 0};
    dpar_pool *p;
    dpar_pool_desc pd;
    dag *g = dag_make(5000, 0);
    dpar_task *h;
    memset(&pd, 0, sizeof pd);
    pd.num_threads = 3;
    pd.allocator.alloc = dt_count_alloc;
    pd.allocator.free = dt_count_free;
    pd.allocator.user = &counts;
    CHECK(dpar_pool_create(&pd, &p) == DPAR_OK);
    g->fail_node = 10; /* failure texts are allocated too */
    h = dag_submit(p, g);
    CHECK(dpar_task_wait_all(p) == DPAR_EUSER);
    free(h);
    g->fail_node = -1;
    memset(g->done, 0, 5000 * sizeof(int));
    h = dag_submit(p, g); /* the second epoch reuses the slab */
    {
        long before = counts.allocs;
        CHECK(dpar_task_wait_all(p) == DPAR_OK);
        CHECK(counts.allocs == before);
    }
    CHECK(dpar_pool_destroy(p) == DPAR_OK);
    CHECK(counts.allocs > 0 && counts.allocs == counts.frees);
    free(h);
    dag_free(g);
}

/* ---- trace ---- */

typedef struct {
    double ts, end;
    int tid;
    const char *name;
} span;
static int span_cmp(const void *a, const void *b)
{
    const span *x = (const span *)a, *y = (const span *)b;
    if (x->tid != y->tid) return x->tid - y->tid;
    if (x->ts != y->ts) return x->ts < y->ts ? -1 : 1;
    return x->end > y->end ? -1 : (x->end < y->end); /* the longer (parent) first */
}

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    long n;
    char *s;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    s = (char *)malloc((size_t)n + 1);
    if (fread(s, 1, (size_t)n, f) != (size_t)n) n = 0;
    s[n] = 0;
    fclose(f);
    return s;
}

static dpar_status traced_rank(void *user, int thread, int nthreads)
{
    uint64_t t0 = dpar_time_ns();
    dpar_pool_barrier((dpar_pool *)user);
    dpar_trace_event("user span \"quoted\"", "user", t0, dpar_time_ns(), "\"thread\":1");
    (void)thread;
    (void)nthreads;
    return DPAR_OK;
}

/* dpar_time_ns: the TSC scaled against CLOCK_MONOTONIC where it qualifies, else CLOCK_MONOTONIC itself. From a
   fresh calibration: no reading below a CLOCK_MONOTONIC one taken just before it (until 2 ms after the switch: the
   switch steps forward by the calibration reading's width and 1 us) and none below the one before; then over
   200 ms its steps agree with CLOCK_MONOTONIC's within 0.1% (the scale is within 50 ppm by construction); then
   4 threads for 200 ms: no reading below one another thread took before it (rdtsc fenced). */
static uint64_t clock_max;
static long clock_early[4];
static void *clock_thread(void *arg)
{
    long id = (long)arg;
    uint64_t end = dpar_time_ns() + 200000000u;
    for (;;) {
        uint64_t seen = __atomic_load_n(&clock_max, __ATOMIC_ACQUIRE), v = dpar_time_ns();
        if (v < seen) clock_early[id]++;
        if (v >= end) break;
        while (v > seen && !__atomic_compare_exchange_n(&clock_max, &seen, v, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {}
    }
    return NULL;
}
static void test_clock_tracks_monotonic(void)
{
    uint64_t m, d, last = 0, start, m0, d0, m1, d1;
    uint64_t ready_at = 0;
    long below = 0, backwards = 0, early = 0;
    pthread_t th[4];
    int i, tsc = 0;
#if DPAR__TSC
    DPAR__STORE(&dpar__tsc_state, DPAR__TSC_UNSEEN, DPAR__SEQ_CST); /* calibrate again, from now */
#endif
    start = dpar__monotonic_ns();
    for (;;) {
        m = dpar__monotonic_ns();
        d = dpar_time_ns();
        if (d < last) backwards++;
        last = d;
#if DPAR__TSC
        if (!ready_at && DPAR__LOAD(&dpar__tsc_state, DPAR__ACQUIRE) == DPAR__TSC_READY) ready_at = m, tsc = 1;
        if (DPAR__LOAD(&dpar__tsc_state, DPAR__ACQUIRE) == DPAR__TSC_OFF) break;
#endif
        if (d < m && (!ready_at || m - ready_at < 2000000u)) below++;
        if ((ready_at && m - ready_at > 2000000u) || m - start > 500000000u) break;
    }
    printf("    clock: %s\n", tsc ? "the TSC, scaled" : "CLOCK_MONOTONIC (no qualifying TSC here)");
    CHECK_MSG(below == 0, "%ld readings below CLOCK_MONOTONIC's just before them", below);
    CHECK_MSG(backwards == 0, "%ld readings below the one before", backwards);
    m0 = dpar__monotonic_ns();
    d0 = dpar_time_ns();
    {
        struct timespec q = {0, 200000000};
        nanosleep(&q, NULL);
    }
    m1 = dpar__monotonic_ns();
    d1 = dpar_time_ns();
    CHECK_MSG((d1 - d0 > m1 - m0 ? d1 - d0 - (m1 - m0) : m1 - m0 - (d1 - d0)) <= (m1 - m0) / 1000u,
              "200 ms: dpar_time_ns moved %llu ns, CLOCK_MONOTONIC %llu ns", (unsigned long long)(d1 - d0),
              (unsigned long long)(m1 - m0));
    clock_max = 0;
    for (i = 0; i < 4; i++) CHECK(pthread_create(&th[i], NULL, clock_thread, (void *)(long)i) == 0);
    for (i = 0; i < 4; i++) pthread_join(th[i], NULL);
    for (i = 0; i < 4; i++) early += clock_early[i];
    CHECK_MSG(early == 0, "%ld readings below one another thread had taken before", early);
}

static void test_trace_file_is_well_formed_and_nested(void)
{
    char path[] = "/tmp/dpar_trace_XXXXXX";
    int fd = mkstemp(path), i, nspans = 0, tracks = 0, fors = 0, tasks = 0, named = 0, overlap = 0, main_named = 0;
    dpar_pool *p = make_pool(4);
    int64_t total = 0;
    char *text;
    jv *doc, *ev, *events;
    span *spans;
    dpar_task_desc d;
    int count = 0;
    close(fd);
    CHECK(dpar_trace_start(path) == DPAR_OK);
    CHECK(dpar_trace_start(path) == DPAR_ESTATE);
    CHECK(dpar_trace_enabled());
    for (i = 0; i < 20; i++) dpar_pool_for(p, 100000, count_range, &total);
    dpar_pool_for_dynamic(p, 100000, 100, count_range, &total);
    memset(&d, 0, sizeof d);
    d.fn = bump_task;
    d.user = &count;
    d.name = "tiny";
    for (i = 0; i < 200; i++) dpar_task_submit(p, &d, NULL);
    dpar_task_wait_all(p);
    dpar_pool_run(p, traced_rank, p);
    CHECK(dpar_trace_stop() == DPAR_OK);
    CHECK(dpar_trace_stop() == DPAR_ESTATE);
    CHECK(!dpar_trace_enabled());
    dpar_pool_for(p, 10, count_range, &total); /* after stop: nothing written, no crash */
    dpar_pool_destroy(p);
    CHECK(dpar_trace_start("/nonexistent-dir/x.json") == DPAR_EIO);

    text = read_file(path);
    CHECK(text != NULL);
    doc = text ? jv_parse(text) : NULL;
    CHECK_MSG(doc != NULL, "trace file is not valid JSON");
    events = jv_get(doc, "traceEvents");
    CHECK(events && events->type == JV_ARR);
    for (ev = events ? events->child : NULL; ev; ev = ev->next) nspans++;
    spans = (span *)calloc((size_t)nspans + 1, sizeof *spans);
    nspans = 0;
    for (ev = events ? events->child : NULL; ev; ev = ev->next) {
        jv *ph = jv_get(ev, "ph"), *name = jv_get(ev, "name"), *tid = jv_get(ev, "tid"), *pid = jv_get(ev, "pid");
        CHECK(ph && ph->type == JV_STR && name && name->type == JV_STR && tid && tid->type == JV_NUM && pid);
        if (!ph || !name || !tid) continue;
        if (!strcmp(ph->str, "M")) {
            jv *args = jv_get(ev, "args");
            jv *track = jv_get(args, "name");
            CHECK(!strcmp(name->str, "thread_name") && track);
            /* an unnamed track is "main thread" (this test's) or "user thread N", never "thread N" */
            if (track && track->type == JV_STR) {
                CHECK_MSG(strncmp(track->str, "thread ", 7) != 0, "a track named '%s'", track->str);
                main_named += !strcmp(track->str, "main thread");
            }
            named++;
            continue;
        }
        CHECK(!strcmp(ph->str, "X"));
        {
            jv *ts = jv_get(ev, "ts"), *dur = jv_get(ev, "dur");
            CHECK(ts && dur && ts->type == JV_NUM && dur->type == JV_NUM && ts->num >= 0 && dur->num >= 0);
            if (!ts || !dur) continue;
            spans[nspans].ts = ts->num;
            spans[nspans].end = ts->num + dur->num;
            spans[nspans].tid = (int)tid->num;
            spans[nspans].name = name->str;
            fors += !strcmp(name->str, "parallel_for");
            tasks += !strcmp(name->str, "tiny");
            nspans++;
        }
    }
    CHECK(fors == 21);
    CHECK(tasks == 200);
    /* per track: intervals nest or are disjoint (round to the printed nanosecond) */
    qsort(spans, (size_t)nspans, sizeof *spans, span_cmp);
    for (i = 0; i < nspans; i++) {
        int k;
        if (i == 0 || spans[i].tid != spans[i - 1].tid) tracks++;
        for (k = i - 1; k >= 0 && spans[k].tid == spans[i].tid; k--) {
            if (spans[k].end <= spans[i].ts + 1e-4) continue;  /* disjoint, earlier */
            if (spans[i].end > spans[k].end + 1e-4) overlap++; /* starts inside, ends outside */
            break;
        }
    }
    CHECK_MSG(overlap == 0, "%d spans overlap without nesting", overlap);
    CHECK_MSG(tracks >= 4, "%d tracks, expected one per thread (4)", tracks);
    CHECK(named >= tracks);
    CHECK_MSG(main_named == 1, "%d tracks named main thread (the test runs on the main thread)", main_named);
    CHECK(strstr(text ? text : "", "user span \\\"quoted\\\"") != NULL);
    free(spans);
    jv_free(doc);
    free(text);
    remove(path);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_status_strings);
    RUN(test_last_error_is_per_thread);
    RUN(test_log_levels_and_callback);
    RUN(test_create_bad_input);
    RUN(test_create_defaults_and_query);
    RUN(test_for_static_visits_each_index_once);
    RUN(test_for_dynamic_visits_each_index_once);
    RUN(test_for_parallel_sum_matches_serial);
    RUN(test_for_huge_n_and_bad_input);
    RUN(test_for_nested_runs_inline);
    RUN(test_for_from_two_outside_threads);
    RUN(test_run_all_threads_and_barrier);
    RUN(test_tasks_100k_tiny);
    RUN(test_tasks_random_dags_10k);
    RUN(test_tasks_failure_cancels_dependents);
    RUN(test_tasks_submit_and_wait_from_tasks);
    RUN(test_tasks_bad_input);
    RUN(test_destroy_cancels_pending_tasks);
    RUN(test_eight_threads_on_two_cores);
    RUN(test_idle_pool_uses_no_cpu);
    RUN(test_pinning);
    RUN(test_counting_allocator_balances);
    RUN(test_clock_tracks_monotonic);
    RUN(test_trace_file_is_well_formed_and_nested);
    return dt_summary();
}
