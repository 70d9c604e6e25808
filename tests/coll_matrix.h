/* coll_matrix.h - the collective matrix of the communicator tests, shared by test_comm.c (thread
   ranks) and test_mpi.c (MPI processes, hybrid): inputs that every reduction order sums exactly,
   their serial reference, and the per-rank bodies that run every collective and check the result. */
#ifndef DPAR_TEST_COLL_MATRIX_H
#define DPAR_TEST_COLL_MATRIX_H
#include <stdarg.h>

/* ---- running N thread ranks ---- */
typedef struct world world;
typedef void (*rank_fn)(world *w, dpar_comm *c, int rank);
struct world {
    int n;
    dpar_group *group;
    rank_fn fn;
    void *user;
    int failures;    /* wrong elements or statuses seen by the ranks */
    char first[256]; /* the first failure */
    pthread_mutex_t lock;
};

static void note(world *w, const char *fmt, ...) DPAR_PRINTF(2, 3);
DT_UNUSED static void note(world *w, const char *fmt, ...)
{
    va_list ap;
    pthread_mutex_lock(&w->lock);
    if (!w->failures++) {
        va_start(ap, fmt);
        vsnprintf(w->first, sizeof w->first, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&w->lock);
}

/* ---- thread ranks: a pool per N (kept), a fresh group per run ---- */
static dpar_pool *pools[9];
DT_UNUSED static dpar_pool *pool_of(int n)
{
    if (!pools[n]) {
        dpar_pool_desc d;
        memset(&d, 0, sizeof d);
        d.num_threads = n;
        dpar_pool_create(&d, &pools[n]);
    }
    return pools[n];
}

DT_UNUSED static dpar_status world_rank(void *user, int rank, int n)
{
    world *w = (world *)user;
    dpar_comm *c = NULL;
    dpar_status st = dpar_group_join(w->group, rank, &c);
    (void)n;
    if (st != DPAR_OK) {
        note(w, "rank %d: group_join: %s", rank, dpar_last_error());
        return st;
    }
    w->fn(w, c, rank);
    dpar_comm_destroy(c);
    return DPAR_OK;
}

/* run fn on n thread ranks of a fresh group; returns the failures the ranks noted */
DT_UNUSED static int run_world_desc(int n, const dpar_comm_desc *desc, rank_fn fn, void *user, char *first,
                                    size_t nfirst)
{
    world w;
    dpar_comm_desc d;
    memset(&w, 0, sizeof w);
    pthread_mutex_init(&w.lock, NULL);
    w.n = n;
    w.fn = fn;
    w.user = user;
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    d.size = n;
    if (dpar_group_create(&d, &w.group) != DPAR_OK) {
        printf("    group_create: %s\n", dpar_last_error());
        return 1;
    }
    dpar_pool_run(pool_of(n), world_rank, &w);
    dpar_group_destroy(w.group);
    pthread_mutex_destroy(&w.lock);
    if (first) snprintf(first, nfirst, "%s", w.first);
    if (w.failures) printf("    N=%d: %d failures, first: %s\n", n, w.failures, w.first);
    return w.failures;
}
DT_UNUSED static int run_world(int n, rank_fn fn, void *user) { return run_world_desc(n, NULL, fn, user, NULL, 0); }
DT_UNUSED static void pools_free(void)
{
    int i;
    for (i = 0; i < 9; i++)
        if (pools[i]) dpar_pool_destroy(pools[i]);
}

/* ---- element access by dtype, through double (exact for the values used) ---- */
DT_UNUSED static double get(const void *p, dpar_dtype t, size_t i)
{
    switch (t) {
    case DPAR_F32: return ((const float *)p)[i];
    case DPAR_F64: return ((const double *)p)[i];
    case DPAR_I32: return ((const int32_t *)p)[i];
    case DPAR_I64: return (double)((const int64_t *)p)[i];
    case DPAR_BF16: return dpar_bf16_to_f32(((const uint16_t *)p)[i]);
    case DPAR_F16: return dpar_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const uint8_t *)p)[i];
    }
}
DT_UNUSED static void put(void *p, dpar_dtype t, size_t i, double v)
{
    switch (t) {
    case DPAR_F32: ((float *)p)[i] = (float)v; break;
    case DPAR_F64: ((double *)p)[i] = v; break;
    case DPAR_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case DPAR_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    case DPAR_BF16: ((uint16_t *)p)[i] = dpar_f32_to_bf16((float)v); break;
    case DPAR_F16: ((uint16_t *)p)[i] = dpar_f32_to_f16((float)v); break;
    default: ((uint8_t *)p)[i] = (uint8_t)(int)v; break;
    }
}

/* v rounded to the dtype */
DT_UNUSED static double get_rounded(double v, dpar_dtype t)
{
    char b[8];
    put(b, t, 0, v);
    return get(b, t, 0);
}

/* Inputs are small integers, so every reduction order gives the same, exact result and the
   reference can be computed in any order: integers in [-8, 8] (u8: [0, 15]); for prod, one of
   {-2, -1, 1, 2} (u8: {1, 2, 3}). */
DT_UNUSED static double input(int q, size_t i, dpar_dtype t, dpar_op op)
{
    if (op == DPAR_PROD) {
        static const double s[4] = {-2, -1, 1, 2}, u[4] = {1, 2, 3, 1};
        return t == DPAR_U8 ? u[(q * 3 + i) % 4] : s[(q * 3 + i) % 4];
    }
    if (t == DPAR_U8) return (double)((q * 7 + i * 13) % 16);
    return (double)((int)((q * 7 + i * 13) % 17) - 8);
}

/* The reference of element i over N ranks, in the dtype's own arithmetic (wrapping for u8). */
DT_UNUSED static double reference(int N, size_t i, dpar_dtype t, dpar_op op)
{
    double acc = input(0, i, t, op);
    int q;
    for (q = 1; q < N; q++) {
        double v = input(q, i, t, op);
        switch (op) {
        case DPAR_SUM:
        case DPAR_AVG: acc += v; break;
        case DPAR_MIN: acc = v < acc ? v : acc; break;
        case DPAR_MAX: acc = v > acc ? v : acc; break;
        default: acc *= v; break;
        }
    }
    if (t == DPAR_U8) acc = (double)((long long)acc & 255);
    if (op == DPAR_AVG) {
        if (t == DPAR_I32 || t == DPAR_I64 || t == DPAR_U8) acc = (double)((long long)acc / N);
        else if (t == DPAR_F32 || t == DPAR_BF16 || t == DPAR_F16) acc = (double)((float)acc / (float)N);
        else acc = acc / N;
    }
    return get_rounded(acc, t);
}

/* ---- the matrix ---- */
typedef struct {
    size_t count;
    dpar_dtype t;
    dpar_op op;
    char *send[8], *recv[8]; /* per rank, count * 8 bytes each */
    int root;
    /* buffers in "device memory" (test_comm's dpar_comm_memory test): called on every input before a call and on
       every output after it, it turns host bytes into the device's form and back (NULL: host memory) */
    void (*device)(void *buf, size_t bytes);
} matrix_case;

/* host bytes to the case's device form and back (nothing for host memory) */
DT_UNUSED static void dev(const matrix_case *m, void *buf, size_t bytes)
{
    if (m->device && bytes) m->device(buf, bytes);
}

DT_UNUSED static void fill(char *buf, int q, size_t begin, size_t end, dpar_dtype t, dpar_op op)
{
    size_t i;
    for (i = begin; i < end; i++) put(buf, t, i, input(q, i, t, op));
}

DT_UNUSED static void check_range(world *w, const char *what, int rank, const char *buf, size_t begin, size_t end,
                                  const matrix_case *m, size_t base)
{
    size_t i;
    for (i = begin; i < end; i++) {
        double want = reference(w->n, base + i, m->t, m->op), got = get(buf, m->t, i);
        if (got != want && !(got != got && want != want)) {
            note(w, "%s N=%d count=%zu %s %s rank %d element %zu: got %g, want %g", what, w->n, m->count,
                 dpar_dtype_name(m->t), dpar_op_name(m->op), rank, base + i, got, want);
            return;
        }
    }
}

DT_UNUSED static void expect_ok(world *w, dpar_status st, const char *what, int rank)
{
    if (st != DPAR_OK) note(w, "%s on rank %d: %s: %s", what, rank, dpar_status_string(st), dpar_last_error());
}

DT_UNUSED static void matrix_rank(world *w, dpar_comm *c, int r)
{
    matrix_case *m = (matrix_case *)w->user;
    size_t es = dpar_dtype_size(m->t), n = m->count, off, len;
    char *s = m->send[r], *v = m->recv[r];
    int N = w->n;
    dpar_block_range(n, N, r, &off, &len);

    /* allreduce, out of place and in place */
    fill(s, r, 0, n, m->t, m->op);
    dev(m, s, n * es);
    memset(v, 0x5a, n * es);
    expect_ok(w, dpar_allreduce(c, s, v, n, m->t, m->op), "allreduce", r);
    dev(m, v, n * es);
    check_range(w, "allreduce", r, v, 0, n, m, 0);
    expect_ok(w, dpar_allreduce(c, s, s, n, m->t, m->op), "allreduce in place", r);
    dev(m, s, n * es);
    check_range(w, "allreduce in place", r, s, 0, n, m, 0);

    /* reduce to a root */
    fill(s, r, 0, n, m->t, m->op);
    dev(m, s, n * es);
    if (r == m->root) memset(v, 0x5a, n * es);
    expect_ok(w, dpar_reduce(c, s, r == m->root ? v : NULL, n, m->t, m->op, m->root), "reduce", r);
    if (r == m->root) dev(m, v, n * es);
    if (r == m->root) check_range(w, "reduce", r, v, 0, n, m, 0);

    /* reduce-scatter: this rank's block; then in place (recv = my block of send) */
    memset(v, 0x5a, len * es + 1);
    expect_ok(w, dpar_reduce_scatter(c, s, v, n, m->t, m->op), "reduce_scatter", r);
    dev(m, v, len * es);
    check_range(w, "reduce_scatter", r, v, 0, len, m, off);
    expect_ok(w, dpar_reduce_scatter(c, s, s + off * es, n, m->t, m->op), "reduce_scatter in place", r);
    dev(m, s + off * es, len * es);
    check_range(w, "reduce_scatter in place", r, s + off * es, 0, len, m, off);
}

/* allreduce alone, out of place and in place, on a comm whose desc names the algorithm (want: the
   algorithm the counters must show, DPAR_ALGO_AUTO: any) */
DT_UNUSED static dpar_algo allreduce_want;
DT_UNUSED static void allreduce_rank(world *w, dpar_comm *c, int r)
{
    matrix_case *m = (matrix_case *)w->user;
    size_t es = dpar_dtype_size(m->t), n = m->count;
    char *s = m->send[r], *v = m->recv[r];
    dpar_comm_stats st;
    int k;
    for (k = 0; k < 2; k++) { /* out of place, then in place */
        fill(s, r, 0, n, m->t, m->op);
        memset(v, 0x5a, n * es);
        expect_ok(w, dpar_allreduce(c, s, k ? s : v, n, m->t, m->op), k ? "allreduce in place" : "allreduce", r);
        check_range(w, k ? "allreduce in place" : "allreduce", r, k ? s : v, 0, n, m, 0);
        dpar_comm_stats_get(c, &st);
        if (w->n > 1 && n && allreduce_want != DPAR_ALGO_AUTO && st.last_algo != allreduce_want)
            note(w, "allreduce N=%d count=%zu ran %s, not %s", w->n, n, dpar_algo_name(st.last_algo),
                 dpar_algo_name(allreduce_want));
    }
}

/* ---- alltoallv: a serial reference of who sends what to whom ---- */
/* the elements rank `from` sends to rank `to` in a case of count n: 0..per, some zero, and rank n % N sends nothing
   at all (per = n / N, at least 1 when n > 0: the blocks of all peers fit N * per, as alltoall's) */
DT_UNUSED static size_t v_count(int from, int to, size_t n, int N)
{
    size_t per = n / (size_t)N ? n / (size_t)N : (n ? 1 : 0);
    if (from == (int)(n % (size_t)N)) return 0;
    return ((size_t)from * 7 + (size_t)to * 3 + n) % (per + 1);
}
/* displacements of counts[0..N-1]: packed in rank order, or (rev) packed in reverse rank order */
DT_UNUSED static void v_displs(const size_t *counts, int N, int rev, size_t *displs)
{
    size_t at = 0;
    int k;
    for (k = 0; k < N; k++) {
        int q = rev ? N - 1 - k : k;
        displs[q] = at;
        at += counts[q];
    }
}
/* alltoallv: random-looking counts with zeros and a rank that sends nothing, both layouts (NULL = packed, and
   reversed), against the serial reference: the block from q lands at rdispls[q] holding q's elements for r; the
   count helper gives back the reference's counts; the async form with its arrays freed before the wait */
DT_UNUSED static void alltoallv_rank(world *w, dpar_comm *c, int r, const matrix_case *m)
{
    size_t es = dpar_dtype_size(m->t), n = m->count, sc[8], sd[8], rc[8], rd[8], got[8], i, send_n = 0, recv_n = 0;
    char *s = m->send[r], *v = m->recv[r];
    int N = w->n, q, bad = 0, k;
    if (N > 8) return;
    for (q = 0; q < N; q++) {
        sc[q] = v_count(r, q, n, N);
        rc[q] = v_count(q, r, n, N);
        send_n += sc[q];
        recv_n += rc[q];
    }
    v_displs(sc, N, r & 1, sd);
    v_displs(rc, N, !(r & 1), rd);
    for (k = 0; k < 3 && !bad; k++) {   /* 0: blocking, 1: async, 2: blocking once more (the request's arrays kept) */
        if (m->device) m->device(s, 0); /* a stream-ordered device: its peers' reads of s are done (0 bytes: a sync) */
        for (q = 0; q < N; q++) fill(s + sd[q] * es, r * 100 + q, 0, sc[q], m->t, DPAR_SUM);
        dev(m, s, send_n * es);
        memset(v, 0x5a, recv_n * es);
        if (k == 1) {
            dpar_request *req = NULL;
            size_t *a = (size_t *)malloc(4 * 8 * sizeof(size_t));
            memcpy(a, sc, sizeof sc), memcpy(a + 8, rc, sizeof rc), memcpy(a + 16, rd, sizeof rd);
            expect_ok(w, dpar_ialltoallv(c, s, a, (r & 1) ? sd : NULL, v, a + 8, (r & 1) ? NULL : a + 16, m->t, &req),
                      "ialltoallv", r);
            memset(a, 0xff, 4 * 8 * sizeof(size_t)); /* the request must have its own copy */
            free(a);
            if (req) expect_ok(w, dpar_request_wait(req), "ialltoallv wait", r);
        } else {
            expect_ok(w, dpar_alltoallv(c, s, sc, (r & 1) ? sd : NULL, v, rc, (r & 1) ? NULL : rd, m->t), "alltoallv",
                      r);
        }
        dev(m, v, recv_n * es);
        for (q = 0; q < N && !bad; q++)
            for (i = 0; i < rc[q] && !bad; i++)
                bad = get(v + rd[q] * es, m->t, i) != input(q * 100 + r, i, m->t, DPAR_SUM);
        if (bad)
            note(w, "alltoallv%s N=%d n=%zu %s: rank %d, the block from rank %d wrong at %zu", k == 1 ? " (async)" : "",
                 N, n, dpar_dtype_name(m->t), r, q - 1, i - 1);
    }
    memset(got, 0xee, sizeof got);
    expect_ok(w, dpar_alltoallv_counts(c, sc, got), "alltoallv_counts", r);
    for (q = 0; q < N; q++)
        if (got[q] != rc[q]) {
            note(w, "alltoallv_counts N=%d n=%zu: rank %d got %zu from rank %d, want %zu", N, n, r, got[q], q, rc[q]);
            break;
        }
}

/* broadcast, allgather, alltoall: the values must arrive unchanged */
DT_UNUSED static void movement_rank(world *w, dpar_comm *c, int r)
{
    matrix_case *m = (matrix_case *)w->user;
    size_t es = dpar_dtype_size(m->t), n = m->count, off, len, i, per;
    char *s = m->send[r], *v = m->recv[r];
    int N = w->n, q, bad = 0;
    dpar_block_range(n, N, r, &off, &len);
    /* broadcast from root: recv = root's input */
    if (r == m->root) fill(s, r, 0, n, m->t, DPAR_SUM);
    if (r == m->root) dev(m, s, n * es);
    memset(v, 0x5a, n * es);
    expect_ok(w, dpar_broadcast(c, s, v, n, m->t, m->root), "broadcast", r);
    dev(m, v, n * es);
    for (i = 0; i < n && !bad; i++) bad = get(v, m->t, i) != input(m->root, i, m->t, DPAR_SUM);
    if (bad)
        note(w, "broadcast N=%d count=%zu %s root %d: rank %d element %zu wrong", N, n, dpar_dtype_name(m->t), m->root,
             r, i - 1);
    /* in place on every rank; the others' buffers hold garbage first (not the last call's answer, which a
       broadcast that never wrote them would leave looking right) */
    if (r == m->root) fill(v, r, 0, n, m->t, DPAR_SUM);
    else memset(v, 0x5a, n * es);
    if (r == m->root) dev(m, v, n * es);
    expect_ok(w, dpar_broadcast(c, v, v, n, m->t, m->root), "broadcast in place", r);
    dev(m, v, n * es);
    for (i = 0; i < n && !bad; i++) bad = get(v, m->t, i) != input(m->root, i, m->t, DPAR_SUM);
    if (bad) note(w, "broadcast in place N=%d count=%zu: rank %d element %zu wrong", N, n, r, i - 1);
    /* allgather: block q of recv = rank q's input over block q */
    fill(s, r, off, off + len, m->t, DPAR_SUM);
    dev(m, s + off * es, len * es);
    memset(v, 0x5a, n * es);
    expect_ok(w, dpar_allgather(c, s + off * es, v, n, m->t), "allgather", r);
    dev(m, v, n * es);
    for (q = 0; q < N && !bad; q++) {
        size_t qo, ql;
        dpar_block_range(n, N, q, &qo, &ql);
        for (i = qo; i < qo + ql && !bad; i++) bad = get(v, m->t, i) != input(q, i, m->t, DPAR_SUM);
    }
    if (bad) note(w, "allgather N=%d count=%zu %s: rank %d wrong", N, n, dpar_dtype_name(m->t), r);
    /* in place: my block already sits in recv */
    memset(v, 0x5a, n * es);
    fill(v, r, off, off + len, m->t, DPAR_SUM);
    dev(m, v + off * es, len * es);
    expect_ok(w, dpar_allgather(c, v + off * es, v, n, m->t), "allgather in place", r);
    dev(m, v, n * es);
    for (q = 0; q < N && !bad; q++) {
        size_t qo, ql;
        dpar_block_range(n, N, q, &qo, &ql);
        for (i = qo; i < qo + ql && !bad; i++) bad = get(v, m->t, i) != input(q, i, m->t, DPAR_SUM);
    }
    if (bad) note(w, "allgather in place N=%d count=%zu: rank %d wrong", N, n, r);
    /* alltoall with count/N (at least 1) per peer: block q of recv = rank q's block r */
    per = n / (size_t)N ? n / (size_t)N : (n ? 1 : 0);
    for (q = 0; q < N; q++) fill(s + (size_t)q * per * es, r * 100 + q, 0, per, m->t, DPAR_SUM);
    dev(m, s, (size_t)N * per * es);
    expect_ok(w, dpar_alltoall(c, s, v, per, m->t), "alltoall", r);
    dev(m, v, (size_t)N * per * es);
    for (q = 0; q < N && !bad; q++)
        for (i = 0; i < per && !bad; i++)
            bad = get(v + (size_t)q * per * es, m->t, i) != input(q * 100 + r, i, m->t, DPAR_SUM);
    if (bad) note(w, "alltoall N=%d per=%zu %s: rank %d wrong", N, per, dpar_dtype_name(m->t), r);
    expect_ok(w, dpar_alltoall(c, s, s, per, m->t), "alltoall in place", r);
    dev(m, s, (size_t)N * per * es);
    for (q = 0; q < N && !bad; q++)
        for (i = 0; i < per && !bad; i++)
            bad = get(s + (size_t)q * per * es, m->t, i) != input(q * 100 + r, i, m->t, DPAR_SUM);
    if (bad) note(w, "alltoall in place N=%d per=%zu: rank %d wrong", N, per, r);
    alltoallv_rank(w, c, r, m);
    expect_ok(w, dpar_barrier(c), "barrier", r);
}

#endif
