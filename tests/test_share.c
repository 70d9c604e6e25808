/* test_share.c - the parallel-region form of the pool (issue 21): shares of 1-, 2- and 3-D ranges with static,
   dynamic, guided and steal schedules, reductions across a run's threads, and a comm that lives across runs. Checked
   against serial references and closed forms.
   Build and run: make test (or: cc -std=c99 -O1 -g -Wall -I. -Itests tests/test_share.c -pthread -lm && ./a.out) */
/* DPAR_ASSERT, the hook for programmer errors: counted while a test expects them (a schedule that is not one of
   the four), fatal otherwise */
static int asserts_expected, asserts_seen; /* atomics */
static void count_assert(int ok, const char *what, const char *file, int line);
#define DPAR_ASSERT(c) count_assert(!!(c), #c, __FILE__, __LINE__)
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <pthread.h>
#include <time.h>

#include "dpar_test.h"

static void count_assert(int ok, const char *what, const char *file, int line)
{
    if (ok) return;
    if (__atomic_load_n(&asserts_expected, __ATOMIC_RELAXED)) {
        __atomic_add_fetch(&asserts_seen, 1, __ATOMIC_RELAXED);
        return;
    }
    fprintf(stderr, "%s:%d: DPAR_ASSERT failed: %s\n", file, line, what);
    abort();
}

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

/* ---- static shares split as dpar_pool_for does ---- */

typedef struct owners {
    dpar_pool *pool;
    int64_t n;
    int *by_for, *by_share, *count;
} owners;

static void own_for(void *user, int64_t begin, int64_t end, int thread)
{
    owners *o = (owners *)user;
    for (; begin < end; begin++) o->by_for[begin] = thread;
}

static dpar_status own_share(void *user, int thread, int nthreads)
{
    owners *o = (owners *)user;
    (void)nthreads;
    for (dpar_share s = dpar_pool_share(o->pool, o->n, DPAR_SCHEDULE_STATIC, 0); dpar_share_next(&s);)
        for (int64_t i = s.i; i < s.end; i++) {
            o->by_share[i] = thread;
            __atomic_fetch_add(&o->count[i], 1, __ATOMIC_RELAXED);
        }
    return DPAR_OK;
}

static void test_static_share_is_pool_for_split(void)
{
    static const int64_t sizes[] = {0, 1, 2, 3, 7, 8, 9, 1000, 1001};
    int c, k;
    for (c = 0; c < NCOUNTS; c++) {
        dpar_pool *pool = make_pool(thread_counts[c]);
        for (k = 0; k < (int)(sizeof sizes / sizeof sizes[0]); k++) {
            owners o;
            int64_t i, bad = 0;
            o.pool = pool;
            o.n = sizes[k];
            o.by_for = (int *)calloc((size_t)o.n + 1, sizeof(int));
            o.by_share = (int *)calloc((size_t)o.n + 1, sizeof(int));
            o.count = (int *)calloc((size_t)o.n + 1, sizeof(int));
            CHECK(dpar_pool_for(pool, o.n, own_for, &o) == DPAR_OK);
            CHECK(dpar_pool_run(pool, own_share, &o) == DPAR_OK);
            for (i = 0; i < o.n; i++) bad += o.by_for[i] != o.by_share[i] || o.count[i] != 1;
            CHECK_MSG(bad == 0, "T=%d n=%lld: %lld indices differ from dpar_pool_for's split", thread_counts[c],
                      (long long)o.n, (long long)bad);
            { /* and both are the documented split: T blocks in thread order, the first n % T one longer */
                int64_t T = thread_counts[c], q = o.n / T, r = o.n % T, t, at = 0;
                for (t = 0; t < T; t++) {
                    int64_t len = q + (t < r);
                    for (i = at; i < at + len; i++) bad += o.by_share[i] != t;
                    at += len;
                }
            }
            CHECK_MSG(bad == 0, "T=%d n=%lld: %lld indices outside the closed-form split (t q + min(t, r) on)",
                      thread_counts[c], (long long)o.n, (long long)bad);
            free(o.by_for);
            free(o.by_share);
            free(o.count);
        }
        dpar_pool_destroy(pool);
    }
}

/* ---- every schedule, many loops in a row, with and without barriers ---- */

#define LOOPS 60
typedef struct many {
    dpar_pool *pool;
    int *count; /* [LOOPS][N] */
    int64_t n[LOOPS];
    int sched[LOOPS], barrier[LOOPS];
    int64_t grain[LOOPS];
} many;
#define MANY_N 3000

static dpar_status many_loops(void *user, int thread, int nthreads)
{
    many *m = (many *)user;
    int l;
    (void)thread;
    (void)nthreads;
    for (l = 0; l < LOOPS; l++) {
        int *count = m->count + (size_t)l * MANY_N;
        for (dpar_share s = dpar_pool_share(m->pool, m->n[l], (dpar_schedule)m->sched[l], m->grain[l]);
             dpar_share_next(&s);)
            for (int64_t i = s.i; i < s.end; i++) __atomic_fetch_add(&count[i], 1, __ATOMIC_RELAXED);
        if (m->barrier[l] && dpar_pool_barrier(m->pool) != DPAR_OK) return DPAR_EUSER;
    }
    return DPAR_OK;
}

static void test_every_schedule_visits_each_index_once(void)
{
    int c, l, rep;
    uint64_t seed = 12345;
    for (c = 0; c < NCOUNTS; c++) {
        dpar_pool *pool = make_pool(thread_counts[c]);
        many *m = (many *)calloc(1, sizeof *m);
        m->pool = pool;
        m->count = (int *)calloc((size_t)LOOPS * MANY_N, sizeof(int));
        for (rep = 0; rep < 20; rep++) {
            int64_t bad = 0, i;
            for (l = 0; l < LOOPS; l++) {
                seed = seed * 6364136223846793005u + 1442695040888963407u;
                m->n[l] = (int64_t)((seed >> 33) % MANY_N);
                if (l % 7 == 0) m->n[l] = l % 2; /* 0 and 1 */
                m->sched[l] = (int)((seed >> 20) % 4);
                m->grain[l] = (seed >> 40) % 3 == 0 ? 0 : (int64_t)((seed >> 45) % 40);
                m->barrier[l] = (seed >> 50) % 4 == 0; /* mostly nowait: threads run ahead into later loops */
            }
            memset(m->count, 0, (size_t)LOOPS * MANY_N * sizeof(int));
            CHECK(dpar_pool_run(pool, many_loops, m) == DPAR_OK);
            for (l = 0; l < LOOPS; l++)
                for (i = 0; i < MANY_N; i++) bad += m->count[(size_t)l * MANY_N + (size_t)i] != (i < m->n[l]);
            CHECK_MSG(bad == 0, "T=%d rep %d: %lld indices visited not exactly once", thread_counts[c], rep,
                      (long long)bad);
        }
        free(m->count);
        free(m);
        dpar_pool_destroy(pool);
    }
}

/* ---- chunk sizes: dynamic = grain, guided = ceil(remaining / T) but never below grain ---- */

typedef struct chunks {
    dpar_pool *pool;
    int64_t n, grain;
    dpar_schedule sched;
    int64_t *size_at; /* [n]: the chunk length starting there, else 0 */
} chunks;

static dpar_status record_chunks(void *user, int thread, int nthreads)
{
    chunks *c = (chunks *)user;
    (void)thread;
    (void)nthreads;
    for (dpar_share s = dpar_pool_share(c->pool, c->n, c->sched, c->grain); dpar_share_next(&s);)
        c->size_at[s.i] = s.end - s.i;
    return DPAR_OK;
}

static dpar_status record_owner(void *user, int thread, int nthreads)
{
    chunks *c = (chunks *)user;
    (void)nthreads;
    for (dpar_share s = dpar_pool_share(c->pool, c->n, c->sched, c->grain); dpar_share_next(&s);)
        for (int64_t i = s.i; i < s.end; i++) c->size_at[i] = thread + 1;
    return DPAR_OK;
}

static void test_chunk_sizes_of_each_schedule(void)
{
    int k;
    for (k = 1; k < NCOUNTS; k++) {
        int T = thread_counts[k];
        dpar_pool *pool = make_pool(T);
        chunks c;
        int64_t i, remaining, want, bad = 0;
        c.pool = pool;
        c.n = 10007;
        c.size_at = (int64_t *)calloc((size_t)c.n, sizeof(int64_t));
        /* guided, grain 16: walking the range in order, each chunk is ceil(remaining / T), at least 16 */
        c.sched = DPAR_SCHEDULE_GUIDED;
        c.grain = 16;
        CHECK(dpar_pool_run(pool, record_chunks, &c) == DPAR_OK);
        for (i = 0; i < c.n; i += c.size_at[i]) {
            remaining = c.n - i;
            want = (remaining + T - 1) / T;
            if (want < 16) want = 16;
            if (want > remaining) want = remaining;
            if (c.size_at[i] != want) bad++;
            if (c.size_at[i] <= 0) break;
        }
        CHECK_MSG(bad == 0 && i == c.n, "T=%d guided: %lld chunks of the wrong size", T, (long long)bad);
        /* dynamic, grain 0: chunks of n / (16 T), as dpar_pool_for_dynamic */
        memset(c.size_at, 0, (size_t)c.n * sizeof(int64_t));
        c.sched = DPAR_SCHEDULE_DYNAMIC;
        c.grain = 0;
        CHECK(dpar_pool_run(pool, record_chunks, &c) == DPAR_OK);
        want = c.n / (16 * T);
        for (bad = 0, i = 0; i < c.n; i += c.size_at[i]) {
            if (c.size_at[i] != (c.n - i < want ? c.n - i : want)) bad++;
            if (c.size_at[i] <= 0) break;
        }
        CHECK_MSG(bad == 0 && i == c.n, "T=%d dynamic: %lld chunks of the wrong size", T, (long long)bad);
        /* static, grain 5: chunk m (iterations 5m .. 5m + 4) goes to thread m mod T, as schedule(static, 5) */
        c.sched = DPAR_SCHEDULE_STATIC;
        c.grain = 5;
        memset(c.size_at, 0, (size_t)c.n * sizeof(int64_t));
        CHECK(dpar_pool_run(pool, record_owner, &c) == DPAR_OK);
        for (bad = 0, i = 0; i < c.n; i++) bad += c.size_at[i] != (i / 5) % T + 1;
        CHECK_MSG(bad == 0, "T=%d static, grain 5: %lld iterations on the wrong thread", T, (long long)bad);
        free(c.size_at);
        dpar_pool_destroy(pool);
    }
}

/* ---- steal: static blocks, the back half of the fullest taken by a thread that is done ---- */

static void sleep_ms(int ms)
{
    struct timespec q;
    q.tv_sec = ms / 1000;
    q.tv_nsec = (long)(ms % 1000) * 1000000L;
    nanosleep(&q, NULL);
}

typedef struct stealer {
    dpar_pool *pool;
    int64_t n0, n1, grain;
    int slow;                    /* this thread begins the share, then waits until the others have left it (10 s at */
    int slow_began, others_left; /* most) before it looks for its first piece; the others begin after it */
    int *count, *owner;          /* [n0 * n1] */
    int64_t longest, bad_piece;  /* the longest piece (in iterations of the collapsed range); pieces out of range */
    int64_t end0, first_taken;   /* thread 0's block ends at end0; the start of its first piece past it (or -1) */
} stealer;

static dpar_status steal_body(void *user, int thread, int nthreads)
{
    stealer *st = (stealer *)user;
    dpar_share s;
    (void)nthreads;
    while (thread != st->slow && !__atomic_load_n(&st->slow_began, __ATOMIC_ACQUIRE)) sleep_ms(1);
    s = st->n1 > 1 ? dpar_pool_share_2d(st->pool, st->n0, st->n1, DPAR_SCHEDULE_STEAL, st->grain)
                   : dpar_pool_share(st->pool, st->n0, DPAR_SCHEDULE_STEAL, st->grain);
    if (thread == st->slow) {
        int waited;
        __atomic_store_n(&st->slow_began, 1, __ATOMIC_RELEASE);
        for (waited = 0; waited < 10000 && __atomic_load_n(&st->others_left, __ATOMIC_ACQUIRE) < nthreads - 1; waited++)
            sleep_ms(1);
    }
    while (dpar_share_next(&s)) {
        int64_t i = st->n1 > 1 ? s.i : 0, j = st->n1 > 1 ? s.j : s.i, len = s.end - j, longest;
        if (i < 0 || i >= st->n0 || j < 0 || s.end > (st->n1 > 1 ? st->n1 : st->n0) || len <= 0) {
            __atomic_fetch_add(&st->bad_piece, 1, __ATOMIC_RELAXED);
            continue;
        }
        if (thread == 0 && i * st->n1 + j >= st->end0 && st->first_taken < 0) st->first_taken = i * st->n1 + j;
        for (; j < s.end; j++) {
            __atomic_fetch_add(&st->count[i * st->n1 + j], 1, __ATOMIC_RELAXED);
            st->owner[i * st->n1 + j] = thread;
        }
        longest = __atomic_load_n(&st->longest, __ATOMIC_RELAXED);
        while (len > longest &&
               !__atomic_compare_exchange_n(&st->longest, &longest, len, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    }
    if (thread != st->slow) __atomic_fetch_add(&st->others_left, 1, __ATOMIC_RELEASE);
    return DPAR_OK;
}

/* One thread begins the share and then waits until the others have left it: they finish their blocks and take
   its block, the back half of what is left at a time, until none is left. Every index runs once; the slow
   thread's whole block runs on others; with 2 threads, thread 0's first piece past its own block begins at the
   slow block's back half (hi - ceil(len / 2)); no piece is longer than the grain (default: a sixteenth of a
   block). No timing: the slow thread waits for the others, not for a clock. */
static void test_steal_evens_out_a_slow_thread(void)
{
    static const int64_t shapes[][3] = {{2000, 1, 0}, {2000, 1, 7}, {37, 61, 0}, {37, 61, 5}, {5, 1, 0}};
    int c, k;
    for (c = 1; c < NCOUNTS; c++) {
        int T = thread_counts[c];
        dpar_pool *pool = make_pool(T);
        for (k = 0; k < (int)(sizeof shapes / sizeof shapes[0]); k++) {
            stealer st;
            int64_t total = shapes[k][0] * shapes[k][1], q = total / T, r = total % T, i, bad = 0, want_longest;
            int64_t slow_lo = (T - 1) * q + (T - 1 < r ? T - 1 : r), slow_hi = slow_lo + q + (T - 1 < r ? 1 : 0);
            int64_t taken = 0, half = slow_hi - (slow_hi - slow_lo + 1) / 2;
            memset(&st, 0, sizeof st);
            st.pool = pool;
            st.n0 = shapes[k][0];
            st.n1 = shapes[k][1];
            st.grain = shapes[k][2];
            st.slow = T - 1;
            st.end0 = q + (r > 0);
            st.first_taken = -1;
            st.count = (int *)calloc((size_t)total, sizeof(int));
            st.owner = (int *)calloc((size_t)total, sizeof(int));
            CHECK(dpar_pool_run(pool, steal_body, &st) == DPAR_OK);
            for (i = 0; i < total; i++) bad += st.count[i] != 1;
            for (i = slow_lo; i < slow_hi; i++) taken += st.owner[i] != T - 1;
            want_longest = st.grain ? st.grain : total / T / 16;
            if (want_longest < 1) want_longest = 1;
            if (st.n1 > 1 && want_longest > st.n1) want_longest = st.n1; /* a piece ends with its row */
            CHECK_MSG(bad == 0 && st.bad_piece == 0,
                      "T=%d %lldx%lld grain %lld: %lld indices not run once, %lld bad pieces", T, (long long)st.n0,
                      (long long)st.n1, (long long)st.grain, (long long)bad, (long long)st.bad_piece);
            CHECK_MSG(taken == slow_hi - slow_lo, "T=%d %lldx%lld: others ran %lld of the slow thread's %lld", T,
                      (long long)st.n0, (long long)st.n1, (long long)taken, (long long)(slow_hi - slow_lo));
            CHECK_MSG(
                T > 2 || st.first_taken == half,
                "T=2 %lldx%lld: thread 0's first piece of the slow block begins at %lld, not at its back half %lld",
                (long long)st.n0, (long long)st.n1, (long long)st.first_taken, (long long)half);
            CHECK_MSG(st.longest <= want_longest,
                      "T=%d %lldx%lld grain %lld: a piece of %lld iterations (at most %lld)", T, (long long)st.n0,
                      (long long)st.n1, (long long)st.grain, (long long)st.longest, (long long)want_longest);
            free(st.count);
            free(st.owner);
        }
        dpar_pool_destroy(pool);
    }
}

/* A range of 2^19 iterations or more goes in units of several iterations (the word holds 20-bit bounds): every
   index still runs once, the slow thread's units all run on the other two, and the last unit stops at the end. */
static void test_steal_large_range(void)
{
    static const int64_t sizes[] = {(INT64_C(1) << 19) - 1, INT64_C(1) << 19, (INT64_C(1) << 21) - 1, 3000001};
    int k;
    dpar_pool *pool = make_pool(3);
    for (k = 0; k < (int)(sizeof sizes / sizeof sizes[0]); k++) {
        stealer st;
        int64_t i, bad = 0, by_slow = 0;
        memset(&st, 0, sizeof st);
        st.pool = pool;
        st.n0 = sizes[k];
        st.n1 = 1;
        st.slow = 2;
        st.count = (int *)calloc((size_t)st.n0, sizeof(int));
        st.owner = (int *)calloc((size_t)st.n0, sizeof(int));
        CHECK(dpar_pool_run(pool, steal_body, &st) == DPAR_OK);
        for (i = 0; i < st.n0; i++) bad += st.count[i] != 1;
        for (i = 0; i < st.n0; i++) by_slow += st.owner[i] == 2;
        CHECK_MSG(bad == 0 && st.bad_piece == 0, "n=%lld: %lld indices not run once, %lld bad pieces", (long long)st.n0,
                  (long long)bad, (long long)st.bad_piece);
        CHECK_MSG(by_slow == 0, "n=%lld: the slow thread ran %lld iterations: the others left some of its units",
                  (long long)st.n0, (long long)by_slow);
        free(st.count);
        free(st.owner);
    }
    dpar_pool_destroy(pool);
}

/* Units a thread left in its word (it left the loop early) belong to that share: phase 1, in the next run the slow
   thread has not begun its share when the others look for work, and they must not take the old run's units;
   phase 2, in one run, the others go on to the next share while the slow thread, which left the earlier one after
   one piece, has not begun it, and they must not take the earlier share's units either. */
typedef struct leftover {
    dpar_pool *pool;
    int phase, slow_ms, done_first, slow_left;
    int64_t out_of_range, count[10];
} leftover;

static void leftover_second_share(leftover *lf)
{
    for (dpar_share s = dpar_pool_share(lf->pool, 10, DPAR_SCHEDULE_STEAL, 1); dpar_share_next(&s);) {
        if (s.i < 0 || s.end > 10 || s.end <= s.i) { /* a piece of another share */
            __atomic_fetch_add(&lf->out_of_range, 1, __ATOMIC_RELAXED);
            continue;
        }
        for (int64_t i = s.i; i < s.end; i++) __atomic_fetch_add(&lf->count[i], 1, __ATOMIC_RELAXED);
    }
}

static dpar_status leftover_body(void *user, int thread, int nthreads)
{
    leftover *lf = (leftover *)user;
    (void)nthreads;
    if (lf->phase == 0) { /* each thread takes one piece of a large share and leaves */
        dpar_share s = dpar_pool_share(lf->pool, 100000, DPAR_SCHEDULE_STEAL, 1);
        (void)dpar_share_next(&s);
        return DPAR_OK;
    }
    if (lf->phase == 2) {
        dpar_share s;
        if (thread == nthreads - 1) { /* begins the first share after the others have left it, takes one piece */
            while (__atomic_load_n(&lf->done_first, __ATOMIC_ACQUIRE) < nthreads - 1) sleep_ms(1);
            s = dpar_pool_share(lf->pool, 100000, DPAR_SCHEDULE_STEAL, 1);
            (void)dpar_share_next(&s);
            __atomic_store_n(&lf->slow_left, 1, __ATOMIC_RELEASE);
        } else {
            for (s = dpar_pool_share(lf->pool, 100000, DPAR_SCHEDULE_STEAL, 1); dpar_share_next(&s);) {}
            __atomic_fetch_add(&lf->done_first, 1, __ATOMIC_RELEASE);
            while (!__atomic_load_n(&lf->slow_left, __ATOMIC_ACQUIRE)) sleep_ms(1);
        }
    }
    if (thread == nthreads - 1) sleep_ms(lf->slow_ms);
    leftover_second_share(lf);
    return DPAR_OK;
}

static void test_steal_leaves_nothing_to_the_next_run(void)
{
    int c, i;
    for (c = 1; c < NCOUNTS; c++) {
        leftover lf;
        int64_t bad = 0;
        memset(&lf, 0, sizeof lf);
        lf.pool = make_pool(thread_counts[c]);
        lf.slow_ms = 20;
        CHECK(dpar_pool_run(lf.pool, leftover_body, &lf) == DPAR_OK);
        lf.phase = 1;
        CHECK(dpar_pool_run(lf.pool, leftover_body, &lf) == DPAR_OK);
        for (i = 0; i < 10; i++) bad += lf.count[i] != 1;
        CHECK_MSG(lf.out_of_range == 0 && bad == 0,
                  "T=%d: %lld pieces of the earlier run's share, %lld of 10 not run once", thread_counts[c],
                  (long long)lf.out_of_range, (long long)bad);
        lf.phase = 2;
        memset(lf.count, 0, sizeof lf.count);
        CHECK(dpar_pool_run(lf.pool, leftover_body, &lf) == DPAR_OK);
        for (bad = 0, i = 0; i < 10; i++) bad += lf.count[i] != 1;
        CHECK_MSG(lf.out_of_range == 0 && bad == 0,
                  "T=%d: %lld pieces of the earlier share of the run, %lld of 10 not run once", thread_counts[c],
                  (long long)lf.out_of_range, (long long)bad);
        dpar_pool_destroy(lf.pool);
    }
}

/* ---- collapsed ranges: start indices, pieces along the last dimension ---- */

typedef struct grid {
    dpar_pool *pool;
    int64_t n0, n1, n2;
    int dims, sched;
    int64_t grain;
    int *count, *owner;
    int64_t bad_piece;
} grid;

static dpar_status visit_grid(void *user, int thread, int nthreads)
{
    grid *g = (grid *)user;
    (void)nthreads;
    if (g->dims == 2) {
        for (dpar_share s = dpar_pool_share_2d(g->pool, g->n0, g->n1, (dpar_schedule)g->sched, g->grain);
             dpar_share_next(&s);) {
            if (s.i < 0 || s.i >= g->n0 || s.j < 0 || s.end > g->n1 || s.j >= s.end)
                __atomic_fetch_add(&g->bad_piece, 1, __ATOMIC_RELAXED);
            for (int64_t a = s.i, b = s.j; b < s.end; b++) {
                __atomic_fetch_add(&g->count[a * g->n1 + b], 1, __ATOMIC_RELAXED);
                g->owner[a * g->n1 + b] = thread;
            }
        }
    } else {
        for (dpar_share s = dpar_pool_share_3d(g->pool, g->n0, g->n1, g->n2, (dpar_schedule)g->sched, g->grain);
             dpar_share_next(&s);) {
            if (s.i < 0 || s.i >= g->n0 || s.j < 0 || s.j >= g->n1 || s.k < 0 || s.end > g->n2 || s.k >= s.end)
                __atomic_fetch_add(&g->bad_piece, 1, __ATOMIC_RELAXED);
            for (int64_t a = s.i, b = s.j, c = s.k; c < s.end; c++) {
                __atomic_fetch_add(&g->count[(a * g->n1 + b) * g->n2 + c], 1, __ATOMIC_RELAXED);
                g->owner[(a * g->n1 + b) * g->n2 + c] = thread;
            }
        }
    }
    return DPAR_OK;
}

static void test_collapsed_2d_and_3d(void)
{
    static const int64_t shapes[][3] = {{1, 1, 1},  {3, 5, 7}, {7, 1, 3}, {1, 100, 1}, {100, 1, 1}, {2, 3, 1},
                                        {17, 9, 4}, {0, 5, 5}, {5, 0, 5}, {5, 5, 0},   {64, 33, 2}};
    int c, k, dims, sched;
    for (c = 0; c < NCOUNTS; c++) {
        int T = thread_counts[c];
        dpar_pool *pool = make_pool(T);
        for (k = 0; k < (int)(sizeof shapes / sizeof shapes[0]); k++)
            for (dims = 2; dims <= 3; dims++)
                for (sched = 0; sched < 4; sched++) {
                    grid g;
                    int64_t total, i, bad = 0;
                    memset(&g, 0, sizeof g);
                    g.pool = pool;
                    g.n0 = shapes[k][0];
                    g.n1 = shapes[k][1];
                    g.n2 = dims == 3 ? shapes[k][2] : 1;
                    g.dims = dims;
                    g.sched = sched;
                    g.grain = sched == 0 ? 0 : 3;
                    total = g.n0 > 0 && g.n1 > 0 && g.n2 > 0 ? g.n0 * g.n1 * g.n2 : 0;
                    g.count = (int *)calloc((size_t)total + 1, sizeof(int));
                    g.owner = (int *)calloc((size_t)total + 1, sizeof(int));
                    CHECK(dpar_pool_run(pool, visit_grid, &g) == DPAR_OK);
                    for (i = 0; i < total; i++) {
                        bad += g.count[i] != 1;
                        if (sched == 0) { /* static: the owner of flat index i is dpar_pool_for's */
                            int64_t q = total / T, r = total % T,
                                    t = i < r * (q + 1) ? i / (q + 1) : r + (i - r * (q + 1)) / (q ? q : 1);
                            bad += g.owner[i] != t;
                        }
                    }
                    CHECK_MSG(bad == 0 && g.bad_piece == 0,
                              "T=%d %dD %lldx%lldx%lld schedule %d: %lld wrong indices, %lld bad pieces", T, dims,
                              (long long)g.n0, (long long)g.n1, (long long)g.n2, sched, (long long)bad,
                              (long long)g.bad_piece);
                    free(g.count);
                    free(g.owner);
                }
        dpar_pool_destroy(pool);
    }
}

/* inside a dpar_pool_for body (on a thread of the pool, but not in a run of it) or in another pool's run: a team
   of one for every schedule, and a reduction leaves the value alone */
typedef struct outside {
    dpar_pool *pool; /* the pool whose shares are taken */
    int wrong;
} outside;

static void take_whole_shares(outside *o, int thread)
{
    int sched;
    double v = 1.5 + thread;
    for (sched = 0; sched < 4; sched++) {
        dpar_share s = dpar_pool_share(o->pool, 10, (dpar_schedule)sched, 3);
        if (!dpar_share_next(&s) || s.i != 0 || s.end != 10 || dpar_share_next(&s))
            __atomic_fetch_add(&o->wrong, 1, __ATOMIC_RELAXED);
    }
    if (dpar_pool_reduce_f64(o->pool, &v, 1, DPAR_POOL_SUM) != DPAR_OK || v != 1.5 + thread)
        __atomic_fetch_add(&o->wrong, 1, __ATOMIC_RELAXED);
}

static void outside_in_for(void *user, int64_t begin, int64_t end, int thread)
{
    for (; begin < end; begin++) take_whole_shares((outside *)user, thread);
}

static dpar_status outside_in_other_run(void *user, int thread, int nthreads)
{
    (void)nthreads;
    take_whole_shares((outside *)user, thread);
    return DPAR_OK;
}

static void test_outside_a_run_is_a_team_of_one(void)
{
    dpar_pool *pool = make_pool(4);
    dpar_share s;
    int pieces = 0;
    double v = 2.5;
    /* NULL pool and outside a run: the whole range, in one piece per row */
    s = dpar_pool_share(NULL, 10, DPAR_SCHEDULE_DYNAMIC, 3);
    CHECK(dpar_share_next(&s) && s.i == 0 && s.end == 10);
    CHECK(!dpar_share_next(&s));
    for (s = dpar_pool_share_2d(pool, 3, 4, DPAR_SCHEDULE_GUIDED, 0); dpar_share_next(&s); pieces++)
        CHECK(s.i == pieces && s.j == 0 && s.end == 4);
    CHECK(pieces == 3);
    s = dpar_pool_share_3d(pool, 2, -1, 4, DPAR_SCHEDULE_STATIC, 0);
    CHECK(!dpar_share_next(&s));
    CHECK(dpar_pool_reduce_f64(pool, &v, 1, DPAR_POOL_SUM) == DPAR_OK && v == 2.5);
    CHECK(dpar_pool_reduce_f64(NULL, &v, 1, DPAR_POOL_MAX) == DPAR_OK && v == 2.5);
    {
        dpar_pool *other = make_pool(3);
        outside o;
        o.pool = pool;
        o.wrong = 0;
        CHECK(dpar_pool_for(pool, 8, outside_in_for, &o) == DPAR_OK);
        CHECK_MSG(o.wrong == 0, "inside dpar_pool_for: %d shares or reductions not a team of one", o.wrong);
        o.wrong = 0;
        CHECK(dpar_pool_run(other, outside_in_other_run, &o) == DPAR_OK);
        CHECK_MSG(o.wrong == 0, "in another pool's run: %d shares or reductions not a team of one", o.wrong);
        dpar_pool_destroy(other);
    }
    dpar_pool_destroy(pool);
}

/* ---- a schedule that is not one of the four: a programmer error, caught by DPAR_ASSERT ---- */

typedef struct bad_schedule {
    dpar_pool *pool;
    int seen[4][10]; /* times each index of each share ran (atomics) */
} bad_schedule;

static const int bad_schedules[4] = {4, 7, -1, 1 << 30};

static void take_bad_shares(bad_schedule *b)
{
    int k;
    for (k = 0; k < 4; k++) {
        dpar_share s;
        for (s = dpar_pool_share(b->pool, 10, (dpar_schedule)bad_schedules[k], 0); dpar_share_next(&s);)
            for (; s.i < s.end; s.i++) __atomic_add_fetch(&b->seen[k][s.i], 1, __ATOMIC_RELAXED);
    }
}

static dpar_status run_bad_shares(void *user, int thread, int nthreads)
{
    (void)thread, (void)nthreads;
    take_bad_shares((bad_schedule *)user);
    return DPAR_OK;
}

/* Each share with a bad schedule fails DPAR_ASSERT once on each thread that begins it (4 shares: 4 T failures);
   with the assertion off (NDEBUG) the range still runs once in all (as a dynamic share), nothing lost. */
static void test_bad_schedule_is_a_contract_failure(void)
{
    int c, k, i, wrong = 0;
    for (c = 0; c < NCOUNTS; c++) {
        bad_schedule b;
        int T = thread_counts[c];
        memset(&b, 0, sizeof b);
        b.pool = make_pool(T);
        __atomic_store_n(&asserts_seen, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&asserts_expected, 1, __ATOMIC_RELAXED);
        CHECK(dpar_pool_run(b.pool, run_bad_shares, &b) == DPAR_OK);
        __atomic_store_n(&asserts_expected, 0, __ATOMIC_RELAXED);
        CHECK_MSG(asserts_seen == 4 * T, "%d threads: %d DPAR_ASSERT failures, expected %d", T, asserts_seen, 4 * T);
        for (k = 0; k < 4; k++)
            for (i = 0; i < 10; i++) wrong += b.seen[k][i] != 1;
        dpar_pool_destroy(b.pool);
    }
    CHECK_MSG(wrong == 0, "%d indices not run exactly once", wrong);
    { /* outside a run: a team of one, checked alike */
        bad_schedule b;
        memset(&b, 0, sizeof b);
        __atomic_store_n(&asserts_seen, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&asserts_expected, 1, __ATOMIC_RELAXED);
        take_bad_shares(&b);
        __atomic_store_n(&asserts_expected, 0, __ATOMIC_RELAXED);
        CHECK(asserts_seen == 4);
        for (k = 0; k < 4; k++)
            for (i = 0; i < 10; i++) CHECK(b.seen[k][i] == 1);
    }
}

/* ---- reductions ---- */

#define RED_ITERS 300
#define RED_COUNT 5
typedef struct red {
    dpar_pool *pool;
    int bad_op_status, range_status;
    int64_t wrong; /* results that differ from the serial reference */
} red;

/* the value thread t contributes to element e in iteration it: magnitudes far apart, so the float sum
   depends on the order */
static double red_value(int it, int t, int e)
{
    return ldexp(1.0 + 0.37 * t + 0.11 * e, ((it * 7 + t * 13 + e) % 50) - 25) * ((t + e) % 3 == 1 ? -1 : 1);
}

static dpar_status reduce_body(void *user, int thread, int nthreads)
{
    red *r = (red *)user;
    int it, e, t;
    for (it = 0; it < RED_ITERS; it++) {
        float f[RED_COUNT], fref[RED_COUNT];
        double d[RED_COUNT], dref[RED_COUNT];
        int64_t x[RED_COUNT], xref[RED_COUNT];
        dpar_pool_op op = (dpar_pool_op)(it % 3);
        for (e = 0; e < RED_COUNT; e++) {
            f[e] = (float)red_value(it, thread, e);
            d[e] = red_value(it, thread, e) * 3.0;
            x[e] = (int64_t)(red_value(it, thread, e) * 1e6);
            /* the serial reference, in thread order */
            for (t = 0; t < nthreads; t++) {
                float fv = (float)red_value(it, t, e);
                double dv = red_value(it, t, e) * 3.0;
                int64_t xv = (int64_t)(red_value(it, t, e) * 1e6);
                if (t == 0) {
                    fref[e] = fv;
                    dref[e] = dv;
                    xref[e] = xv;
                } else if (op == DPAR_POOL_SUM) {
                    fref[e] += fv;
                    dref[e] += dv;
                    xref[e] += xv;
                } else if (op == DPAR_POOL_MAX) {
                    fref[e] = fv > fref[e] ? fv : fref[e];
                    dref[e] = dv > dref[e] ? dv : dref[e];
                    xref[e] = xv > xref[e] ? xv : xref[e];
                } else {
                    fref[e] = fv < fref[e] ? fv : fref[e];
                    dref[e] = dv < dref[e] ? dv : dref[e];
                    xref[e] = xv < xref[e] ? xv : xref[e];
                }
            }
        }
        /* back to back, no barrier between them: the buffers alternate */
        if (dpar_pool_reduce_f32(r->pool, f, it % 2 ? 1 : RED_COUNT, op) != DPAR_OK) return DPAR_EUSER;
        if (dpar_pool_reduce_f64(r->pool, d, RED_COUNT, op) != DPAR_OK) return DPAR_EUSER;
        if (dpar_pool_reduce_i64(r->pool, x, RED_COUNT, op) != DPAR_OK) return DPAR_EUSER;
        for (e = 0; e < RED_COUNT; e++) {
            int wrong = memcmp(&d[e], &dref[e], sizeof d[e]) != 0 || x[e] != xref[e];
            if (e < (it % 2 ? 1 : RED_COUNT)) wrong |= memcmp(&f[e], &fref[e], sizeof f[e]) != 0;
            if (wrong) __atomic_fetch_add(&r->wrong, 1, __ATOMIC_RELAXED);
        }
    }
    /* errors come alike on every thread, without a wait */
    {
        double big[DPAR_POOL_REDUCE_MAX + 1] = {0};
        if (thread == 0) {
            r->range_status = dpar_pool_reduce_f64(r->pool, big, DPAR_POOL_REDUCE_MAX + 1, DPAR_POOL_SUM);
            r->bad_op_status = dpar_pool_reduce_f64(r->pool, big, 1, (dpar_pool_op)7);
        }
        /* the largest count works */
        for (e = 0; e < DPAR_POOL_REDUCE_MAX; e++) big[e] = thread + e;
        if (dpar_pool_reduce_f64(r->pool, big, DPAR_POOL_REDUCE_MAX, DPAR_POOL_SUM) != DPAR_OK) return DPAR_EUSER;
        for (e = 0; e < DPAR_POOL_REDUCE_MAX; e++)
            if (big[e] != (double)nthreads * (nthreads - 1) / 2 + (double)nthreads * e)
                __atomic_fetch_add(&r->wrong, 1, __ATOMIC_RELAXED);
    }
    return DPAR_OK;
}

static void test_reduce_in_thread_order_on_every_thread(void)
{
    int c;
    for (c = 0; c < NCOUNTS; c++) {
        red r;
        memset(&r, 0, sizeof r);
        r.pool = make_pool(thread_counts[c]);
        CHECK(dpar_pool_run(r.pool, reduce_body, &r) == DPAR_OK);
        CHECK_MSG(r.wrong == 0, "T=%d: %lld reduced elements differ from the serial reference in thread order",
                  thread_counts[c], (long long)r.wrong);
        CHECK(r.range_status == DPAR_ERANGE);
        CHECK(r.bad_op_status == DPAR_EINVAL);
        dpar_pool_destroy(r.pool);
    }
}

/* ---- a comm made in one run, used in later runs (one from another outside thread), destroyed in another ---- */

#define COMM_T 4
typedef struct across {
    dpar_pool *pool;
    dpar_group *group;
    dpar_comm *comm[COMM_T];
    int phase;
    int64_t wrong;
} across;

static dpar_status across_body(void *user, int thread, int nthreads)
{
    across *a = (across *)user;
    float v[3];
    int e;
    (void)nthreads;
    if (a->phase == 0) return dpar_group_join(a->group, thread, &a->comm[thread]);
    for (e = 0; e < 3; e++) v[e] = (float)(thread + 1) * (float)(e + a->phase);
    if (dpar_allreduce(a->comm[thread], v, v, 3, DPAR_F32, DPAR_SUM) != DPAR_OK)
        return dpar_set_error(DPAR_EUSER, "%s", dpar_last_error());
    for (e = 0; e < 3; e++) /* sum over t of (t + 1)(e + phase) = T(T + 1)/2 (e + phase) */
        if (v[e] != (float)(COMM_T * (COMM_T + 1) / 2 * (e + a->phase)))
            __atomic_fetch_add(&a->wrong, 1, __ATOMIC_RELAXED);
    if (a->phase == 3) {
        dpar_status st = dpar_comm_destroy(a->comm[thread]);
        a->comm[thread] = NULL;
        return st;
    }
    return DPAR_OK;
}

static void *across_from_thread(void *arg)
{
    across *a = (across *)arg;
    a->phase = 2;
    if (dpar_pool_run(a->pool, across_body, a) != DPAR_OK) __atomic_fetch_add(&a->wrong, 100, __ATOMIC_RELAXED);
    return NULL;
}

static void test_comm_lives_across_runs(void)
{
    across a;
    dpar_comm_desc d;
    pthread_t other;
    memset(&a, 0, sizeof a);
    memset(&d, 0, sizeof d);
    d.size = COMM_T;
    a.pool = make_pool(COMM_T);
    CHECK(dpar_group_create(&d, &a.group) == DPAR_OK);
    a.phase = 0; /* run 1: every thread joins */
    CHECK(dpar_pool_run(a.pool, across_body, &a) == DPAR_OK);
    a.phase = 1; /* run 2: a collective */
    CHECK(dpar_pool_run(a.pool, across_body, &a) == DPAR_OK);
    /* run 3 from another outside thread: rank 0's comm now runs on a different OS thread */
    CHECK(pthread_create(&other, NULL, across_from_thread, &a) == 0);
    pthread_join(other, NULL);
    a.phase = 3; /* run 4: a collective, then every rank destroys its comm */
    CHECK_MSG(dpar_pool_run(a.pool, across_body, &a) == DPAR_OK, "%s", dpar_last_error());
    CHECK(a.wrong == 0);
    CHECK(a.comm[0] == NULL && a.comm[COMM_T - 1] == NULL);
    CHECK(dpar_group_destroy(a.group) == DPAR_OK);
    dpar_pool_destroy(a.pool);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_static_share_is_pool_for_split);
    RUN(test_every_schedule_visits_each_index_once);
    RUN(test_chunk_sizes_of_each_schedule);
    RUN(test_steal_evens_out_a_slow_thread);
    RUN(test_steal_large_range);
    RUN(test_steal_leaves_nothing_to_the_next_run);
    RUN(test_collapsed_2d_and_3d);
    RUN(test_outside_a_run_is_a_team_of_one);
    RUN(test_bad_schedule_is_a_contract_failure);
    RUN(test_reduce_in_thread_order_on_every_thread);
    RUN(test_comm_lives_across_runs);
    return dt_summary();
}
