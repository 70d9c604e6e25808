/* test_comm.c - the communicator over thread ranks: every collective against serial references,
   determinism, counters, the contract checker, timeouts, abort, async requests, split and mesh.
   Build and run: make test   (one test: ./build/test_comm mismatch)
   DPAR_TEST_BIG sets the large count of the matrix (default 1000003; make check uses less). */
static void test_step_hook(void);
#define DPAR_TEST_STEP_HOOK() test_step_hook()
#define DPAR_STREAM_MIN_BYTES 600000 /* streaming stores from N x bytes = 600 KB: the big matrix cases use them */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <sys/mman.h>
#include <unistd.h>

#include "dpar_test.h"
#include "json.h"
#include "coll_matrix.h"
#include "fsdp_case.h"

/* random delays between the steps of the algorithms, switched on by one test */
static int hook_on;
static DPAR__TLS unsigned long long hook_rng = 1;
static DPAR__TLS int hook_sleep_us; /* a slow rank: it sleeps before each of its steps */
static void test_step_hook(void)
{
    if (hook_sleep_us) usleep((unsigned)hook_sleep_us);
    if (!__atomic_load_n(&hook_on, __ATOMIC_RELAXED)) return;
    hook_rng = hook_rng * 6364136223846793005ull + 1442695040888963407ull;
    switch ((hook_rng >> 33) % 4) {
    case 0: break;
    case 1: sched_yield(); break;
    default: usleep((unsigned)((hook_rng >> 40) % 30)); break;
    }
}

static const int Ns[] = {1, 2, 3, 4, 5, 8};
#define NN ((int)(sizeof Ns / sizeof Ns[0]))

static size_t big_count(void)
{
    const char *e = getenv("DPAR_TEST_BIG");
    return e && *e ? (size_t)strtoull(e, NULL, 10) : 1000003;
}

static void test_collectives_matrix(void)
{
    int ni, t, op, q, a;
    size_t big = big_count();
    char *bufs[16];
    for (q = 0; q < 16; q++) bufs[q] = (char *)malloc((big + 64) * 8);
    for (ni = 0; ni < NN; ni++) {
        int N = Ns[ni];
        size_t counts[6];
        int ci;
        counts[0] = 0;
        counts[1] = 1;
        counts[2] = (size_t)(N > 1 ? N - 1 : 2);
        counts[3] = (size_t)N;
        counts[4] = (size_t)N + 1;
        counts[5] = big;
        for (ci = 0; ci < 6; ci++) {
            matrix_case m;
            int fails = 0;
            memset(&m, 0, sizeof m);
            m.count = counts[ci];
            for (q = 0; q < N; q++) {
                m.send[q] = bufs[2 * q];
                m.recv[q] = bufs[2 * q + 1];
            }
            for (t = 0; t < DPAR_DTYPE_COUNT; t++) {
                m.t = (dpar_dtype)t;
                m.root = (int)(counts[ci] % (size_t)N);
                for (op = 0; op < DPAR_OP_COUNT; op++) {
                    /* the big count: every dtype with sum, every op with f32 */
                    if (ci == 5 && op != DPAR_SUM && t != DPAR_F32) continue;
                    m.op = (dpar_op)op;
                    fails += run_world(N, matrix_rank, &m);
                    for (a = DPAR_ALGO_RING; a <= DPAR_ALGO_SLICE; a++) { /* each allreduce algorithm */
                        dpar_comm_desc d;
                        memset(&d, 0, sizeof d);
                        d.algo = a;
                        allreduce_want = (dpar_algo)a;
                        fails += run_world_desc(N, &d, allreduce_rank, &m, NULL, 0);
                    }
                }
                m.op = DPAR_SUM;
                fails += run_world(N, movement_rank, &m);
            }
            CHECK_MSG(fails == 0, "N=%d count=%zu: %d failures", N, counts[ci], fails);
        }
    }
    for (q = 0; q < 16; q++) free(bufs[q]);
}

/* ---- bf16 / f16: conversions and tolerance against an f32 reference ---- */
static void test_half_conversions(void)
{
    CHECK(dpar_f32_to_f16(1.0f) == 0x3c00);
    CHECK(dpar_f32_to_f16(-2.0f) == 0xc000);
    CHECK(dpar_f32_to_f16(65504.0f) == 0x7bff);
    CHECK(dpar_f32_to_f16(65520.0f) == 0x7c00);           /* rounds up to infinity */
    CHECK(dpar_f32_to_f16(5.9604645e-8f) == 0x0001);      /* 2^-24, the smallest subnormal */
    CHECK(dpar_f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00); /* halfway: to even */
    CHECK(dpar_f32_to_f16(1.0f + 3.0f / 2048) == 0x3c02); /* halfway: to even, up */
    CHECK(dpar_f16_to_f32(0x0001) == 5.9604645e-8f);
    CHECK(dpar_f16_to_f32(0x3555) == 0.333251953125f);
    CHECK(dpar_f32_to_bf16(1.0f) == 0x3f80);
    CHECK(dpar_f32_to_bf16(1.0f + 1.0f / 256) == 0x3f80); /* halfway: to even */
    CHECK(dpar_f32_to_bf16(1.0f + 3.0f / 256) == 0x3f82);
    CHECK(dpar_bf16_to_f32(0xc040) == -3.0f);
    CHECK(dpar_f16_to_f32(dpar_f32_to_f16(NAN)) != dpar_f16_to_f32(dpar_f32_to_f16(NAN)));
    CHECK(dpar_bf16_to_f32(dpar_f32_to_bf16(NAN)) != dpar_bf16_to_f32(dpar_f32_to_bf16(NAN)));
    {
        /* every f16 value survives f16 -> f32 -> f16 */
        unsigned h;
        int bad = 0;
        for (h = 0; h < 65536; h++) {
            float f = dpar_f16_to_f32((uint16_t)h);
            if (f == f && dpar_f32_to_f16(f) != h) bad++;
        }
        CHECK(bad == 0);
    }
}

typedef struct {
    size_t n;
    uint16_t *in[8], *out[8];
    dpar_dtype t;
} half_job;
static void half_rank(world *w, dpar_comm *c, int r)
{
    half_job *h = (half_job *)w->user;
    expect_ok(w, dpar_allreduce(c, h->in[r], h->out[r], h->n, h->t, DPAR_SUM), "half allreduce", r);
}

static void test_half_precision_tolerance(void)
{
    int ni, ti, q;
    size_t i, n = 20011;
    for (ti = 0; ti < 2; ti++)
        for (ni = 1; ni < NN; ni++) {
            int N = Ns[ni];
            half_job h;
            double worst = 0, bound = N * (ti == 0 ? 1.0 / 256 : 1.0 / 2048); /* N half-ulps of sum |x| */
            h.n = n;
            h.t = ti == 0 ? DPAR_BF16 : DPAR_F16;
            for (q = 0; q < N; q++) {
                h.in[q] = (uint16_t *)malloc(n * 2);
                h.out[q] = (uint16_t *)malloc(n * 2);
                for (i = 0; i < n; i++) {
                    float v = (float)((double)(dt_rand() % 20001) / 1000.0 - 10.0);
                    h.in[q][i] = h.t == DPAR_BF16 ? dpar_f32_to_bf16(v) : dpar_f32_to_f16(v);
                }
            }
            CHECK(run_world(N, half_rank, &h) == 0);
            for (i = 0; i < n; i++) {
                double ref = 0, mag = 0, got = get(h.out[0], h.t, i);
                for (q = 0; q < N; q++) {
                    double x = get(h.in[q], h.t, i);
                    ref += x;
                    mag += fabs(x);
                }
                for (q = 1; q < N; q++) CHECK(h.out[q][i] == h.out[0][i]); /* same bits everywhere */
                if (mag > 0 && fabs(got - ref) / mag > worst) worst = fabs(got - ref) / mag;
            }
            CHECK_MSG(worst <= bound, "%s N=%d: error %.2e of sum|x| above %.2e", dpar_dtype_name(h.t), N, worst,
                      bound);
            for (q = 0; q < N; q++) {
                free(h.in[q]);
                free(h.out[q]);
            }
        }
}

/* ---- counters: a ring allreduce moves 2(N-1)/N of the buffer per rank ---- */
typedef struct {
    size_t n;
    uint64_t sent[8], received[8], calls[8];
    double busbw[8];
} bytes_job;
static void bytes_rank(world *w, dpar_comm *c, int r)
{
    bytes_job *b = (bytes_job *)w->user;
    float *x = (float *)calloc(b->n, sizeof(float));
    dpar_comm_stats s;
    expect_ok(w, dpar_allreduce(c, x, x, b->n, DPAR_F32, DPAR_SUM), "allreduce", r);
    dpar_comm_stats_get(c, &s);
    b->sent[r] = s.by_coll[DPAR_COLL_ALLREDUCE].bytes_sent;
    b->received[r] = s.by_coll[DPAR_COLL_ALLREDUCE].bytes_received;
    b->calls[r] = s.by_coll[DPAR_COLL_ALLREDUCE].calls;
    b->busbw[r] = s.last_busbw_gbps;
    if (s.last_coll != DPAR_COLL_ALLREDUCE || s.last.bytes_sent != b->sent[r])
        note(w, "last call stats wrong on rank %d", r);
    if (s.last_algo != DPAR_ALGO_RING || s.algo_calls[DPAR_ALGO_RING] != 1 || s.algo_calls[DPAR_ALGO_SLICE] != 0)
        note(w, "rank %d: the counters say %s (%llu ring calls)", r, dpar_algo_name(s.last_algo),
             (unsigned long long)s.algo_calls[DPAR_ALGO_RING]);
    dpar_comm_stats_reset(c);
    dpar_comm_stats_get(c, &s);
    if (s.by_coll[DPAR_COLL_ALLREDUCE].calls != 0) note(w, "reset did not clear rank %d", r);
    free(x);
}

static void test_ring_moves_2_n_minus_1_over_n(void)
{
    int ni, r;
    for (ni = 1; ni < NN; ni++) {
        int N = Ns[ni];
        size_t counts[2];
        int ci;
        counts[0] = (size_t)N * 100000; /* divisible: exactly 2(N-1)/N */
        counts[1] = (size_t)N * 1000 + 3;
        for (ci = 0; ci < 2; ci++) {
            bytes_job b;
            dpar_comm_desc d;
            memset(&b, 0, sizeof b);
            memset(&d, 0, sizeof d);
            d.algo = DPAR_ALGO_RING;
            b.n = counts[ci];
            CHECK(run_world_desc(N, &d, bytes_rank, &b, NULL, 0) == 0);
            for (r = 0; r < N; r++) {
                /* rank r sends every chunk but r+1 in all-gather and but r in reduce-scatter,
                   and receives every chunk but r-1 and but r */
                size_t l0, lm1, lp1;
                uint64_t want_sent, want_recv;
                dpar_block_range(b.n, N, r, NULL, &l0);
                dpar_block_range(b.n, N, (r + N - 1) % N, NULL, &lm1);
                dpar_block_range(b.n, N, (r + 1) % N, NULL, &lp1);
                want_sent = 4 * (uint64_t)((b.n - l0) + (b.n - lp1));
                want_recv = 4 * (uint64_t)((b.n - lm1) + (b.n - l0));
                if (ci == 0) CHECK(want_sent == 4 * (uint64_t)b.n * 2 * (N - 1) / N);
                CHECK_MSG(b.sent[r] == want_sent && b.received[r] == want_recv,
                          "N=%d count=%zu rank %d: sent %llu received %llu, want %llu %llu", N, b.n, r,
                          (unsigned long long)b.sent[r], (unsigned long long)b.received[r],
                          (unsigned long long)want_sent, (unsigned long long)want_recv);
                CHECK(b.calls[r] == 1 && b.busbw[r] > 0);
            }
        }
    }
}

/* ---- determinism ---- */
typedef struct {
    size_t n;
    float *in[8];
    float *out[8];
    int rep;
} det_job;
static void det_rank(world *w, dpar_comm *c, int r)
{
    det_job *d = (det_job *)w->user;
    memset(d->out[r], 0x7f, d->n * sizeof(float)); /* no result of an earlier run survives a skipped store */
    expect_ok(w, dpar_allreduce(c, d->in[r], d->out[r], d->n, DPAR_F32, DPAR_SUM), "allreduce", r);
}

static void random_floats(float *x, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) /* varied magnitudes: sums depend on their order */
        x[i] = (float)((double)(dt_rand() % 2000001) / 1000.0 - 1000.0) * (float)(1 << (dt_rand() % 12));
}

/* the documented order of every allreduce algorithm (dpar_algo): element i of block c is
   x[c+1], then x[c+j] + that for j = 2..N */
static float ring_order_sum(float *const *in, int N, size_t n, size_t i)
{
    int c, j;
    float acc;
    for (c = 0; c < N; c++) {
        size_t off, len;
        dpar_block_range(n, N, c, &off, &len);
        if (i >= off && i < off + len) break;
    }
    acc = in[(c + 1) % N][i];
    for (j = 2; j <= N; j++) acc = in[(c + j) % N][i] + acc;
    return acc;
}

static void test_bitwise_identical_under_random_delays(void)
{
    static const int algos[] = {DPAR_ALGO_RING, DPAR_ALGO_ONESHOT, DPAR_ALGO_SLICE, DPAR_ALGO_AUTO};
    int ni, rep, q, ai, big;
    size_t n, i;
    for (big = 0, ni = 1; ni < NN; ni += big, big = !big) { /* 30011 elements; 250007, with streaming stores */
        int N = Ns[ni], diffs = 0, wrong = 0, reps = big ? 6 : N <= 4 ? 200 : 60;
        n = big ? 250007 : 30011;
        det_job d;
        float *first = (float *)malloc(n * sizeof(float));
        dpar_comm_desc desc;
        memset(&desc, 0, sizeof desc);
        desc.segment_bytes = 4096; /* many segments, many steps to perturb */
        d.n = n;
        for (q = 0; q < N; q++) {
            d.in[q] = (float *)malloc(n * sizeof(float));
            d.out[q] = (float *)malloc(n * sizeof(float));
            random_floats(d.in[q], n);
        }
        __atomic_store_n(&hook_on, 1, __ATOMIC_RELAXED);
        for (ai = 0; ai < 4; ai++) { /* every algorithm: the same bits as the ring's first run */
            desc.algo = algos[ai];
            for (rep = 0; rep < reps / (ai ? 2 : 1); rep++) {
                CHECK(run_world_desc(N, &desc, det_rank, &d, NULL, 0) == 0);
                if (rep == 0 && ai == 0) memcpy(first, d.out[0], n * sizeof(float));
                for (q = 0; q < N; q++) diffs += memcmp(d.out[q], first, n * sizeof(float)) != 0;
            }
        }
        __atomic_store_n(&hook_on, 0, __ATOMIC_RELAXED);
        CHECK_MSG(diffs == 0, "N=%d: %d results differ from the first", N, diffs);
        for (i = 0; i < n; i++) { /* the bits of the documented order */
            float want = ring_order_sum(d.in, N, n, i);
            wrong += memcmp(&want, &first[i], sizeof want) != 0;
        }
        CHECK_MSG(wrong == 0, "N=%d: %d elements differ from the documented order", N, wrong);
        /* and it is right, within float rounding */
        for (i = 0; i < n; i += 97) {
            double ref = 0, mag = 0;
            for (q = 0; q < N; q++) {
                ref += d.in[q][i];
                mag += fabs(d.in[q][i]);
            }
            CHECK(fabs(first[i] - ref) <= mag * N * 1.2e-7);
        }
        for (q = 0; q < N; q++) {
            free(d.in[q]);
            free(d.out[q]);
        }
        free(first);
    }
}

/* deterministic mode: L leaves, rank r owns leaves [r*L/N, (r+1)*L/N) */
#define LEAVES 16
typedef struct {
    size_t n;
    float *leaf[LEAVES];
    float *out[8];
    dpar_op op; /* of the allreduce: DPAR_SUM, or DPAR_AVG (the sum's bits divided by N) */
} leaves_job;
static void leaves_rank(world *w, dpar_comm *c, int r)
{
    leaves_job *j = (leaves_job *)w->user;
    int per = LEAVES / w->n;
    expect_ok(w, dpar_tree_reduce(j->out[r], (const void *const *)(j->leaf + r * per), per, j->n, DPAR_F32, DPAR_SUM),
              "tree_reduce", r);
    expect_ok(w, dpar_allreduce(c, j->out[r], j->out[r], j->n, DPAR_F32, j->op), "det allreduce", r);
}
static void ring_leaves_rank(world *w, dpar_comm *c, int r)
{
    leaves_job *j = (leaves_job *)w->user;
    int per = LEAVES / w->n;
    dpar_tree_reduce(j->out[r], (const void *const *)(j->leaf + r * per), per, j->n, DPAR_F32, DPAR_SUM);
    expect_ok(w, dpar_allreduce(c, j->out[r], j->out[r], j->n, DPAR_F32, DPAR_SUM), "ring allreduce", r);
}

static void test_deterministic_mode_same_bits_for_any_n(void)
{
    static const int dn[] = {1, 2, 4, 8};
    leaves_job j;
    float *one = (float *)malloc(10007 * sizeof(float));
    int k, q, ring_differs = 0;
    dpar_comm_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.deterministic = 1;
    desc.segment_bytes = 8192;
    j.n = 10007;
    j.op = DPAR_SUM;
    for (k = 0; k < LEAVES; k++) {
        j.leaf[k] = (float *)malloc(j.n * sizeof(float));
        random_floats(j.leaf[k], j.n);
    }
    for (q = 0; q < 8; q++) j.out[q] = (float *)malloc(j.n * sizeof(float));
    CHECK(dpar_tree_reduce(one, (const void *const *)j.leaf, LEAVES, j.n, DPAR_F32, DPAR_SUM) == DPAR_OK);
    for (k = 0; k < 4; k++) {
        int N = dn[k];
        CHECK(run_world_desc(N, &desc, leaves_rank, &j, NULL, 0) == 0);
        for (q = 0; q < N; q++) CHECK_MSG(!memcmp(j.out[q], one, j.n * sizeof(float)), "N=%d rank %d differs", N, q);
        __atomic_store_n(&hook_on, 1, __ATOMIC_RELAXED); /* and under random delays */
        CHECK(run_world_desc(N, &desc, leaves_rank, &j, NULL, 0) == 0);
        __atomic_store_n(&hook_on, 0, __ATOMIC_RELAXED);
        for (q = 0; q < N; q++) CHECK(!memcmp(j.out[q], one, j.n * sizeof(float)));
        j.op = DPAR_AVG; /* the same tree, then divided by N (a power of two: exact) */
        CHECK(run_world_desc(N, &desc, leaves_rank, &j, NULL, 0) == 0);
        j.op = DPAR_SUM;
        for (q = 0; q < N; q++) {
            size_t i;
            int bad = 0;
            for (i = 0; i < j.n; i++) bad += j.out[q][i] != one[i] / (float)N;
            CHECK_MSG(bad == 0, "N=%d rank %d: AVG differs from the sum over N in %d elements", N, q, bad);
        }
    }
    /* the test can fail: the plain ring on 4 ranks combines in another order and differs */
    CHECK(run_world(4, ring_leaves_rank, &j) == 0);
    ring_differs = memcmp(j.out[0], one, j.n * sizeof(float)) != 0;
    CHECK(ring_differs);
    /* the tree against a hand-written one */
    {
        size_t i;
        int bad = 0;
        for (i = 0; i < j.n; i++) {
            float l[LEAVES];
            int h;
            for (h = 0; h < LEAVES; h++) l[h] = j.leaf[h][i];
            for (h = 0; h < 8; h++) l[h] = l[2 * h] + l[2 * h + 1];
            for (h = 0; h < 4; h++) l[h] = l[2 * h] + l[2 * h + 1];
            for (h = 0; h < 2; h++) l[h] = l[2 * h] + l[2 * h + 1];
            bad += (float)(l[0] + l[1]) != one[i];
        }
        CHECK(bad == 0);
    }
    /* N that is not a power of two is refused */
    desc.size = 3;
    {
        dpar_group *g;
        CHECK(dpar_group_create(&desc, &g) == DPAR_EUNSUPPORTED);
    }
    for (k = 0; k < LEAVES; k++) free(j.leaf[k]);
    for (q = 0; q < 8; q++) free(j.out[q]);
    free(one);
}

/* ---- 10,000 mixed collectives: every call's every element against its closed form (rank r's input: r + k) ---- */
static void mixed_rank(world *w, dpar_comm *c, int r)
{
    int N = w->n, it, q;
    double buf[64], out[64 * 8];
    for (it = 0; it < 10000; it++) {
        size_t n = (size_t)(it % 37) + 1, k, off, len, per = n % 8;
        int bad = -1;
        for (k = 0; k < 64; k++) buf[k] = r + (double)k;
        for (k = 0; k < 64 * 8; k++) out[k] = -1e9; /* nothing left from the last call can pass */
        switch (it % 7) {
        case 0:
            expect_ok(w, dpar_allreduce(c, buf, out, n, DPAR_F64, DPAR_SUM), "allreduce", r);
            for (k = 0; k < n && bad < 0; k++)
                if (out[k] != N * (N - 1) / 2.0 + (double)N * (double)k) bad = (int)k;
            break;
        case 1:
            expect_ok(w, dpar_broadcast(c, buf, out, n, DPAR_F64, it % N), "broadcast", r);
            for (k = 0; k < n && bad < 0; k++)
                if (out[k] != it % N + (double)k) bad = (int)k;
            break;
        case 2: expect_ok(w, dpar_barrier(c), "barrier", r); break;
        case 3: /* my block of the maximum over ranks: N - 1 + k */
            expect_ok(w, dpar_reduce_scatter(c, buf, out, n, DPAR_F64, DPAR_MAX), "reduce_scatter", r);
            dpar_block_range(n, N, r, &off, &len);
            for (k = 0; k < len && bad < 0; k++)
                if (out[k] != N - 1 + (double)(off + k)) bad = (int)k;
            break;
        case 4: /* n elements from each rank: block q is rank q's buf[0..n) */
            expect_ok(w, dpar_allgather(c, buf, out, n * (size_t)N, DPAR_F64), "allgather", r);
            for (q = 0; q < N && bad < 0; q++)
                for (k = 0; k < n && bad < 0; k++)
                    if (out[(size_t)q * n + k] != q + (double)k) bad = (int)((size_t)q * n + k);
            break;
        case 5: /* block q of mine comes from rank q's block r: q + r per + k */
            expect_ok(w, dpar_alltoall(c, buf, out, per, DPAR_F64), "alltoall", r);
            for (q = 0; q < N && bad < 0; q++)
                for (k = 0; k < per && bad < 0; k++)
                    if (out[(size_t)q * per + k] != q + (double)((size_t)r * per + k)) bad = (int)((size_t)q * per + k);
            break;
        default: /* the minimum at the root: rank 0's, k */
            expect_ok(w, dpar_reduce(c, buf, out, n, DPAR_F64, DPAR_MIN, (it / 7) % N), "reduce", r);
            for (k = 0; k < n && bad < 0 && r == (it / 7) % N; k++)
                if (out[k] != (double)k) bad = (int)k;
            break;
        }
        if (bad >= 0) note(w, "mixed call %d (kind %d, n %zu) on rank %d: element %d wrong", it, it % 7, n, r, bad);
        if (w->failures) return;
    }
}

static void test_10000_mixed_collectives(void)
{
    CHECK(run_world(4, mixed_rank, NULL) == 0);
    CHECK(run_world(8, mixed_rank, NULL) == 0);
}

/* ---- point-to-point ---- */
static void p2p_rank(world *w, dpar_comm *c, int r)
{
    int N = w->n, i;
    int32_t token[100], back[100];
    for (i = 0; i < 100; i++) token[i] = r * 1000 + i;
    /* a ring of sendrecv */
    expect_ok(w, dpar_sendrecv(c, token, 100, (r + 1) % N, back, 100, (r + N - 1) % N, DPAR_I32, 7), "sendrecv", r);
    if (back[5] != ((r + N - 1) % N) * 1000 + 5) note(w, "sendrecv rank %d got %d", r, back[5]);
    /* to oneself through sendrecv */
    expect_ok(w, dpar_sendrecv(c, token, 100, r, back, 100, r, DPAR_I32, 1), "self sendrecv", r);
    if (back[99] != r * 1000 + 99) note(w, "self sendrecv wrong on rank %d", r);
    if (dpar_send(c, token, 1, DPAR_I32, r, 0) != DPAR_EDEADLK) note(w, "send to self not refused on rank %d", r);
    /* even ranks send to the next odd one, in order, many messages */
    if (N >= 2 && r % 2 == 0 && r + 1 < N) {
        for (i = 0; i < 50; i++) {
            token[0] = i;
            expect_ok(w, dpar_send(c, token, 1 + (size_t)i, DPAR_I32, r + 1, i), "send", r);
        }
    } else if (N >= 2 && r % 2 == 1) {
        for (i = 0; i < 50; i++) {
            expect_ok(w, dpar_recv(c, back, 1 + (size_t)i, DPAR_I32, r - 1, i), "recv", r);
            if (back[0] != i) note(w, "recv %d out of order on rank %d", i, r);
        }
    }
}

static void test_point_to_point(void)
{
    int ni;
    for (ni = 0; ni < NN; ni++) CHECK(run_world(Ns[ni], p2p_rank, NULL) == 0);
}

/* ---- the contract checker ---- */
typedef struct {
    int kind;
    dpar_status st[8];
    char msg[8][DPAR__ERROR_TEXT];
    double seconds[8];
} mismatch_job;

static void mismatch_rank(world *w, dpar_comm *c, int r)
{
    mismatch_job *m = (mismatch_job *)w->user;
    float x[2048], y[2048];
    uint64_t t0 = dpar_time_ns();
    dpar_status st = DPAR_OK;
    memset(x, 0, sizeof x);
    switch (m->kind) {
    case 0: /* count */ st = dpar_allreduce(c, x, y, r == 2 ? 1000 : 1024, DPAR_F32, DPAR_SUM); break;
    case 1: /* dtype */ st = dpar_allreduce(c, x, y, 100, r == 1 ? DPAR_I32 : DPAR_F32, DPAR_SUM); break;
    case 2: /* op */ st = dpar_allreduce(c, x, y, 100, DPAR_F32, r == 1 ? DPAR_MAX : DPAR_SUM); break;
    case 3: /* root */ st = dpar_broadcast(c, x, y, 100, DPAR_F32, r == 2 ? 1 : 0); break;
    case 4: /* kind */ st = r == 1 ? dpar_barrier(c) : dpar_allreduce(c, x, y, 100, DPAR_F32, DPAR_SUM); break;
    case 5: /* order: rank 0 skips a call */
        if (r != 0) st = dpar_barrier(c);
        if (st == DPAR_OK) st = dpar_allreduce(c, x, y, 100, DPAR_F32, DPAR_SUM);
        break;
    case 6: /* point-to-point count */
        if (r == 0) st = dpar_send(c, x, 10, DPAR_F32, 1, 3);
        if (r == 1) st = dpar_recv(c, y, 12, DPAR_F32, 0, 3);
        if (r == 2) st = dpar_barrier(c);
        break;
    case 7: /* point-to-point tag */
        if (r == 0) st = dpar_send(c, x, 10, DPAR_F32, 1, 3);
        if (r == 1) st = dpar_recv(c, y, 10, DPAR_F32, 0, 4);
        if (r == 2) st = dpar_barrier(c);
        break;
    case 8: /* a missing rank: rank 2 is busy elsewhere past the timeout */
        if (r != 2) st = dpar_allreduce(c, x, y, 100, DPAR_F32, DPAR_SUM);
        else usleep(600000);
        break;
    case 9: /* abort from another thread while ranks wait for a missing one */
        if (r == 0) {
            usleep(100000);
            st = dpar_comm_abort(c);
        } else {
            st = dpar_allreduce(c, x, y, 100, DPAR_F32, DPAR_SUM);
        }
        break;
    default: /* bad argument on one rank: the others do not hang */
        st = dpar_allreduce(c, x, y, 100, r == 1 ? (dpar_dtype)99 : DPAR_F32, DPAR_SUM);
        break;
    }
    m->st[r] = st;
    snprintf(m->msg[r], sizeof m->msg[r], "%s", st == DPAR_OK ? "" : dpar_last_error());
    m->seconds[r] = (double)(dpar_time_ns() - t0) * 1e-9;
    /* the group stays poisoned */
    if (st != DPAR_OK && m->kind != 8 && dpar_barrier(c) != st) note(w, "rank %d: not poisoned after an error", r);
}

static dpar_comm_desc fas_desc(int n, int peer_access);
static void fas_stop(void);
/* every mismatch kind on 3 ranks, host memory or (async) the fake asynchronous device's stream-ordered memory */
static void mismatch_kinds(int async)
{
    static const struct {
        dpar_status st;
        const char *a, *b;
    } want[] = {
        {DPAR_EMISMATCH, "called allreduce(count=1000, dtype=f32, op=sum) #1 at tests/test_comm.c",
         "called allreduce(count=1024, dtype=f32, op=sum) #1 at tests/test_comm.c"},
        {DPAR_EMISMATCH, "dtype=i32", "dtype=f32"},
        {DPAR_EMISMATCH, "op=max", "op=sum"},
        {DPAR_EMISMATCH, "broadcast(count=100, dtype=f32, root=1)", "root=0"},
        {DPAR_EMISMATCH, "barrier() #1", "allreduce(count=100"},
        {DPAR_EMISMATCH, "barrier() #1", "allreduce(count=100, dtype=f32, op=sum) #1"},
        {DPAR_EMISMATCH, "recv(count=12, dtype=f32, tag=3)", "send(count=10, dtype=f32, tag=3)"},
        {DPAR_EMISMATCH, "recv(count=10, dtype=f32, tag=4)", "send(count=10, dtype=f32, tag=3)"},
        {DPAR_ETIMEDOUT, "timed out after 300 ms in allreduce",
         "rank 2 never arrived (it has made no collective call)"},
        {DPAR_EABORTED, "aborted by dpar_comm_abort", "rank 0"},
        {DPAR_EINVAL, "dtype 99 is not a dpar_dtype", "dpar_allreduce"},
    };
    int kind, r;
    for (kind = 0; kind < (int)(sizeof want / sizeof want[0]); kind++) {
        mismatch_job m;
        dpar_comm_desc d;
        memset(&m, 0, sizeof m);
        memset(&d, 0, sizeof d);
        if (async) d = fas_desc(3, 1);
        m.kind = kind;
        d.timeout_ms = kind == 8 ? 300 : 5000;
        d.name = kind == 0 || kind == 8 ? "grid" : NULL; /* a named comm says its name; the default does not */
        run_world_desc(3, &d, mismatch_rank, &m, NULL, 0);
        if (async) fas_stop();
        for (r = 0; r < 3; r++) {
            if (kind == 8 && r == 2) continue;
            if (kind == 9 && r == 0) continue;
            CHECK_MSG(m.st[r] == want[kind].st, "kind %d rank %d: %s, want %s (%s)", kind, r,
                      dpar_status_string(m.st[r]), dpar_status_string(want[kind].st), m.msg[r]);
            CHECK_MSG(strstr(m.msg[r], want[kind].a) && strstr(m.msg[r], want[kind].b), "kind %d rank %d: '%s'", kind,
                      r, m.msg[r]);
            CHECK_MSG(m.seconds[r] < (kind == 8 ? 2.0 : 1.5), "kind %d rank %d took %.2f s", kind, r, m.seconds[r]);
            if (kind == 0 || kind == 8)
                CHECK_MSG(strstr(m.msg[r], " on grid"), "kind %d rank %d: '%s'", kind, r, m.msg[r]);
            else CHECK_MSG(!strstr(m.msg[r], " on comm"), "kind %d rank %d: '%s'", kind, r, m.msg[r]);
        }
        if (kind == 0 && !async) printf("    e.g. %s\n", m.msg[0]);
        if (kind == 8 && !async) printf("    e.g. %s\n", m.msg[0]);
    }
}
static void test_mismatches_are_caught_on_every_rank(void) { mismatch_kinds(0); }

/* the timeout message's other stories: a rank whose last call was an earlier collective, a rank that never
   joined, a rank that has left */
typedef struct {
    int story, done;
    dpar_status st[3];
    char msg[3][512];
} late_job;
static void late_rank(world *w, dpar_comm *c, int r)
{
    late_job *j = (late_job *)w->user;
    float x[8] = {0};
    (void)w;
    if (r == 2) {
        if (j->story == 0) { /* one barrier, then it stays, silent, until the others gave up */
            expect_ok(w, dpar_barrier(c), "barrier", r);
            while (__atomic_load_n(&j->done, __ATOMIC_ACQUIRE) < 2) usleep(1000);
        }
        return; /* story 2: it leaves at once (world_rank destroys its comm) */
    }
    if (j->story == 0) expect_ok(w, dpar_barrier(c), "barrier", r);
    if (j->story == 2) usleep(50000); /* rank 2 has left by now */
    j->st[r] = dpar_allreduce(c, x, x, 8, DPAR_F32, DPAR_SUM);
    snprintf(j->msg[r], sizeof j->msg[r], "%s", dpar_last_error());
    __atomic_add_fetch(&j->done, 1, __ATOMIC_RELEASE);
}
typedef struct {
    late_job j;
    dpar_group *g;
} late_world;
static dpar_status late_join(void *user, int rank, int n) /* story 1: only ranks 0 and 1 of 3 join */
{
    late_job *j = &((late_world *)user)->j;
    dpar_group *g = ((late_world *)user)->g;
    dpar_comm *c = NULL;
    float x[8] = {0};
    (void)n;
    if (dpar_group_join(g, rank, &c) != DPAR_OK) return DPAR_EINVAL;
    j->st[rank] = dpar_allreduce(c, x, x, 8, DPAR_F32, DPAR_SUM);
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", dpar_last_error());
    dpar_comm_destroy(c);
    return DPAR_OK;
}
/* a group of more ranks than the pool that runs them has threads: refused at dpar_group_create when the desc names
   the pool; without it, the timeout's story says why the missing rank never joined. Ranks joined from two pools
   (a 4-rank group on two pools of 2 threads) are no mistake: no hint then */
static dpar_group *sp_group;
static dpar_status sp_rank(void *user, int rank, int n)
{
    dpar_comm *c = NULL;
    dpar_status st = dpar_group_join(sp_group, rank + *(int *)user, &c);
    (void)n;
    if (st == DPAR_OK) st = dpar_barrier(c);
    dpar_comm_destroy(c);
    return st;
}
static void test_group_larger_than_its_pool(void)
{
    dpar_comm_desc cd;
    dpar_pool_desc pd;
    dpar_pool *pool = NULL;
    dpar_group *g = NULL;
    int zero = 0;
    dpar_status st;
    memset(&cd, 0, sizeof cd);
    memset(&pd, 0, sizeof pd);
    pd.num_threads = 1;
    CHECK(dpar_pool_create(&pd, &pool) == DPAR_OK);
    cd.size = 2;
    cd.pool = pool;
    CHECK(dpar_group_create(&cd, &g) == DPAR_EINVAL && g == NULL);
    CHECK_MSG(strstr(dpar_last_error(), "a group of 2 ranks on pool pool") &&
                  strstr(dpar_last_error(), "of 1 threads: dpar_pool_run runs one rank per thread, so ranks 1..1 "
                                            "could never join (make the pool with num_threads = 2)"),
              "%s", dpar_last_error());
    cd.pool = NULL; /* without the pool in the desc: the timeout says it */
    cd.timeout_ms = 300;
    CHECK(dpar_group_create(&cd, &sp_group) == DPAR_OK);
    st = dpar_pool_run(pool, sp_rank, &zero);
    CHECK_MSG(st == DPAR_ETIMEDOUT && strstr(dpar_last_error(), "rank 1 never joined (no dpar_group_join): pool") &&
                  strstr(dpar_last_error(), " has 1 threads for 2 ranks, one rank per thread: num_threads = 2"),
              "%s: %s", dpar_status_string(st), dpar_last_error());
    printf("    e.g. %s\n", dpar_last_error());
    dpar_group_destroy(sp_group);
    dpar_pool_destroy(pool);
    /* a pool as large as the group, named in the desc: fine */
    pd.num_threads = 2;
    cd.timeout_ms = 0;
    CHECK(dpar_pool_create(&pd, &pool) == DPAR_OK);
    cd.pool = pool;
    CHECK(dpar_group_create(&cd, &sp_group) == DPAR_OK);
    CHECK(dpar_pool_run(pool, sp_rank, &zero) == DPAR_OK);
    dpar_group_destroy(sp_group);
    dpar_pool_destroy(pool);
}

static void test_timeout_names_each_story(void)
{
    static const char *want[3] = {"rank 2 never arrived (its last call: barrier #1 at tests/test_comm.c",
                                  "rank 2 never joined (no dpar_group_join)", "rank 2 has left (dpar_comm_destroy)"};
    int story, r;
    for (story = 0; story < 3; story++) {
        late_world k;
        dpar_comm_desc d;
        memset(&k, 0, sizeof k);
        memset(&d, 0, sizeof d);
        k.j.story = story;
        d.timeout_ms = 300;
        if (story == 1) {
            d.size = 3;
            CHECK(dpar_group_create(&d, &k.g) == DPAR_OK);
            CHECK(dpar_pool_run(pool_of(2), late_join, &k) == DPAR_OK);
            dpar_group_destroy(k.g);
        } else {
            run_world_desc(3, &d, late_rank, &k.j, NULL, 0);
        }
        for (r = 0; r < 2; r++)
            CHECK_MSG(k.j.st[r] == DPAR_ETIMEDOUT && strstr(k.j.msg[r], want[story]), "story %d rank %d: %s: '%s'",
                      story, r, dpar_status_string(k.j.st[r]), k.j.msg[r]);
    }
}

/* The same stories once the ranks meet through shared memory (one-shot, reduce-by-slice): a warm-up
   allreduce sets the shared block up, then the calls disagree. */
static void algo_mismatch_rank(world *w, dpar_comm *c, int r)
{
    mismatch_job *m = (mismatch_job *)w->user;
    static float x[3][20000], y[3][20000];
    uint64_t t0;
    dpar_status st = dpar_allreduce(c, x[r], y[r], 100, DPAR_F32, DPAR_SUM);
    if (st != DPAR_OK) note(w, "warm-up on rank %d: %s", r, dpar_last_error());
    t0 = dpar_time_ns();
    switch (m->kind) {
    case 0: /* count, both one-shot */
        st = dpar_allreduce(c, x[r], y[r], r == 2 ? 100 : 101, DPAR_F32, DPAR_SUM);
        break;
    case 1: /* count: one-shot against slice */
        st = dpar_allreduce(c, x[r], y[r], r == 1 ? 100 : 20000, DPAR_F32, DPAR_SUM);
        break;
    case 2: /* op, both slice */
        st = dpar_allreduce(c, x[r], y[r], 5000, DPAR_F32, r == 1 ? DPAR_MAX : DPAR_SUM);
        break;
    case 3: /* kind: a barrier (on the ring) against a one-shot allreduce */
        st = r == 1 ? dpar_barrier(c) : dpar_allreduce(c, x[r], y[r], 100, DPAR_F32, DPAR_SUM);
        break;
    case 4: /* a missing rank */
        if (r != 2) st = dpar_allreduce(c, x[r], y[r], 5000, DPAR_F32, DPAR_SUM);
        else usleep(600000);
        break;
    case 5: /* abort while two ranks wait in a slice meeting */
        if (r == 0) {
            usleep(100000);
            st = dpar_comm_abort(c);
        } else {
            st = dpar_allreduce(c, x[r], y[r], 5000, DPAR_F32, DPAR_SUM);
        }
        break;
    case 6: /* count, both a few bytes (8 and 12): one-shot's smallest messages */
        st = dpar_allreduce(c, x[r], y[r], r == 2 ? 2 : 3, DPAR_F32, DPAR_SUM);
        break;
    case 7: /* op, 16 bytes each */
        st = dpar_allreduce(c, x[r], y[r], 4, DPAR_F32, r == 1 ? DPAR_MAX : DPAR_SUM);
        break;
    default: /* count: 32 bytes against 36 */
        st = dpar_allreduce(c, x[r], y[r], r == 1 ? 8 : 9, DPAR_F32, DPAR_SUM);
        break;
    }
    m->st[r] = st;
    snprintf(m->msg[r], sizeof m->msg[r], "%s", st == DPAR_OK ? "" : dpar_last_error());
    m->seconds[r] = (double)(dpar_time_ns() - t0) * 1e-9;
}

static void test_algo_mismatches_are_caught_on_every_rank(void)
{
    static const struct {
        dpar_status st;
        const char *a, *b;
    } want[] = {
        {DPAR_EMISMATCH, "allreduce(count=100, dtype=f32, op=sum) #2", "allreduce(count=101, dtype=f32, op=sum) #2"},
        {DPAR_EMISMATCH, "allreduce(count=100, dtype=f32, op=sum) #2", "allreduce(count=20000, dtype=f32, op=sum) #2"},
        {DPAR_EMISMATCH, "op=max) #2", "op=sum) #2"},
        {DPAR_EMISMATCH, "barrier() #2", "allreduce(count=100, dtype=f32, op=sum) #2"},
        {DPAR_ETIMEDOUT, "timed out after 300 ms in allreduce(count=5000, dtype=f32, op=sum) #2",
         "rank 2 never arrived (its last call: allreduce #1"},
        {DPAR_EABORTED, "aborted by dpar_comm_abort", "rank 0"},
        {DPAR_EMISMATCH, "allreduce(count=2, dtype=f32, op=sum) #2", "allreduce(count=3, dtype=f32, op=sum) #2"},
        {DPAR_EMISMATCH, "count=4, dtype=f32, op=max) #2", "count=4, dtype=f32, op=sum) #2"},
        {DPAR_EMISMATCH, "allreduce(count=8, dtype=f32, op=sum) #2", "allreduce(count=9, dtype=f32, op=sum) #2"},
    };
    int kind, r;
    for (kind = 0; kind < (int)(sizeof want / sizeof want[0]); kind++) {
        mismatch_job m;
        dpar_comm_desc d;
        memset(&m, 0, sizeof m);
        memset(&d, 0, sizeof d);
        m.kind = kind;
        d.timeout_ms = kind == 4 ? 300 : 5000;
        run_world_desc(3, &d, algo_mismatch_rank, &m, NULL, 0);
        for (r = 0; r < 3; r++) {
            if ((kind == 4 && r == 2) || (kind == 5 && r == 0)) continue;
            CHECK_MSG(m.st[r] == want[kind].st, "kind %d rank %d: %s, want %s (%s)", kind, r,
                      dpar_status_string(m.st[r]), dpar_status_string(want[kind].st), m.msg[r]);
            CHECK_MSG(strstr(m.msg[r], want[kind].a) && strstr(m.msg[r], want[kind].b), "kind %d rank %d: '%s'", kind,
                      r, m.msg[r]);
            CHECK_MSG(m.seconds[r] < (kind == 4 ? 2.0 : 1.5), "kind %d rank %d took %.2f s", kind, r, m.seconds[r]);
        }
        if (kind == 1 || kind == 4 || kind == 6) printf("    e.g. %s\n", m.msg[0]);
    }
}

/* ---- which algorithm runs: by size, the desc, DPAR_ALGO ---- */
typedef struct {
    size_t n;
    dpar_algo ran[8], asked[8];
} choice_job;
static void choice_rank(world *w, dpar_comm *c, int r)
{
    choice_job *j = (choice_job *)w->user;
    float *x = (float *)calloc(j->n, sizeof(float));
    dpar_comm_stats s;
    dpar_comm_desc used;
    expect_ok(w, dpar_allreduce(c, x, x, j->n, DPAR_F32, DPAR_SUM), "allreduce", r);
    dpar_comm_stats_get(c, &s);
    dpar_comm_query(c, &used);
    j->ran[r] = s.last_algo;
    j->asked[r] = (dpar_algo)used.algo;
    if (s.algo_calls[s.last_algo] != 1)
        note(w, "rank %d: algo_calls[%s] = %llu", r, dpar_algo_name(s.last_algo),
             (unsigned long long)s.algo_calls[s.last_algo]);
    free(x);
}

static void test_algo_chosen_by_size_desc_and_environment(void)
{
    static const struct {
        size_t n;
        int algo, det;
        const char *env;
        dpar_algo ran, asked;
    } cases[] = {
        {100, 0, 0, NULL, DPAR_ALGO_ONESHOT, DPAR_ALGO_AUTO},  /* 400 bytes */
        {100000, 0, 0, NULL, DPAR_ALGO_SLICE, DPAR_ALGO_AUTO}, /* 400 KB */
        {100000, 0, 0, "oneshot", DPAR_ALGO_ONESHOT, DPAR_ALGO_ONESHOT},
        {100, 0, 0, "ring", DPAR_ALGO_RING, DPAR_ALGO_RING},
        {100, 0, 0, "slice", DPAR_ALGO_SLICE, DPAR_ALGO_SLICE},
        {100, 0, 0, "bogus", DPAR_ALGO_ONESHOT, DPAR_ALGO_AUTO},             /* a warning, then by size */
        {100, DPAR_ALGO_RING, 0, "oneshot", DPAR_ALGO_RING, DPAR_ALGO_RING}, /* the desc wins */
        {100, DPAR_ALGO_SLICE, 1, NULL, DPAR_ALGO_TREE, DPAR_ALGO_SLICE},    /* deterministic: the tree */
    };
    int k, r;
    dpar_comm_desc d;
    dpar_group *g = NULL;
    dpar_log_level keep = dpar_log_get_level();
    memset(&d, 0, sizeof d);
    d.size = 2;
    d.algo = 7;
    CHECK(dpar_group_create(&d, &g) == DPAR_EINVAL && g == NULL);
    d.algo = -1;
    CHECK(dpar_group_create(&d, &g) == DPAR_EINVAL && g == NULL);
    dpar_log_set_level(DPAR_LOG_ERROR); /* the bogus value's warning */
    for (k = 0; k < (int)(sizeof cases / sizeof cases[0]); k++) {
        choice_job j;
        memset(&j, 0, sizeof j);
        memset(&d, 0, sizeof d);
        j.n = cases[k].n;
        d.algo = cases[k].algo;
        d.deterministic = cases[k].det;
        if (cases[k].env) setenv("DPAR_ALGO", cases[k].env, 1);
        CHECK(run_world_desc(2, &d, choice_rank, &j, NULL, 0) == 0);
        unsetenv("DPAR_ALGO");
        for (r = 0; r < 2; r++)
            CHECK_MSG(j.ran[r] == cases[k].ran && j.asked[r] == cases[k].asked, "case %d rank %d: ran %s asked %s", k,
                      r, dpar_algo_name(j.ran[r]), dpar_algo_name(j.asked[r]));
    }
    dpar_log_set_level(keep);
    CHECK(!strcmp(dpar_algo_name(DPAR_ALGO_SLICE), "slice") && !strcmp(dpar_algo_name((dpar_algo)99), "?"));
}

/* reduce-by-slice into one recv that every rank shares: each rank writes its block, and nobody copies
   a block onto itself */
typedef struct {
    size_t n;
    float *in[4], *shared;
} shared_job;
static void shared_recv_rank(world *w, dpar_comm *c, int r)
{
    shared_job *j = (shared_job *)w->user;
    expect_ok(w, dpar_allreduce(c, j->in[r], j->shared, j->n, DPAR_F32, DPAR_SUM), "allreduce", r);
}
static void test_slice_into_one_shared_recv(void)
{
    shared_job j;
    dpar_comm_desc d;
    size_t i;
    int q, bad = 0;
    memset(&d, 0, sizeof d);
    d.algo = DPAR_ALGO_SLICE;
    j.n = 100003;
    j.shared = (float *)malloc(j.n * sizeof(float));
    for (q = 0; q < 4; q++) {
        j.in[q] = (float *)malloc(j.n * sizeof(float));
        for (i = 0; i < j.n; i++) j.in[q][i] = (float)(q + (int)(i % 13));
    }
    CHECK(run_world_desc(4, &d, shared_recv_rank, &j, NULL, 0) == 0);
    for (i = 0; i < j.n; i++) bad += j.shared[i] != (float)(6 + 4 * (int)(i % 13));
    CHECK(bad == 0);
    for (q = 0; q < 4; q++) free(j.in[q]);
    free(j.shared);
}

/* ---- async ---- */
typedef struct {
    size_t n;
} async_job;
static void async_rank(world *w, dpar_comm *c, int r)
{
    async_job *a = (async_job *)w->user;
    size_t n = a->n, i, off, len;
    int N = w->n, k, done = 0, polls = 0;
    float *g[4], *o[4], *rs, *ag;
    dpar_request *req[6];
    for (k = 0; k < 4; k++) {
        g[k] = (float *)malloc(n * sizeof(float));
        o[k] = (float *)malloc(n * sizeof(float));
        for (i = 0; i < n; i++) g[k][i] = (float)(r + k + (int)(i % 5));
    }
    dpar_block_range(n, N, r, &off, &len);
    rs = (float *)malloc((len + 1) * sizeof(float));
    ag = (float *)malloc(n * sizeof(float));
    for (k = 0; k < 4; k++)
        expect_ok(w, dpar_iallreduce(c, g[k], o[k], n, DPAR_F32, DPAR_SUM, &req[k]), "iallreduce", r);
    expect_ok(w, dpar_ireduce_scatter(c, g[0], rs, n, DPAR_F32, DPAR_MAX, &req[4]), "ireduce_scatter", r);
    for (i = 0; i < len; i++) ag[off + i] = (float)(r * 10);
    expect_ok(w, dpar_iallgather(c, ag + off, ag, n, DPAR_F32, &req[5]), "iallgather", r);
    /* overlap: "compute" while they run, then test until the last is done */
    while (!done) {
        expect_ok(w, dpar_request_test(req[5], &done), "request_test", r);
        polls++;
        if (!done) usleep(50);
    }
    for (k = 0; k < 5; k++) expect_ok(w, dpar_request_wait(req[k]), "request_wait", r);
    for (k = 0; k < 4; k++)
        for (i = 0; i < n; i += 101) {
            float want = (float)(N * (N - 1) / 2 + N * (k + (int)(i % 5)));
            if (o[k][i] != want) note(w, "iallreduce %d rank %d element %zu: %g != %g", k, r, i, o[k][i], want);
        }
    for (i = 0; i < len; i++)
        if (rs[i] != (float)(N - 1 + (int)((off + i) % 5))) note(w, "ireduce_scatter rank %d wrong", r);
    for (i = 0; i < n; i++) {
        int q;
        for (q = 0; q < N; q++) {
            size_t qo, ql;
            dpar_block_range(n, N, q, &qo, &ql);
            if (i >= qo && i < qo + ql && ag[i] != (float)(q * 10)) note(w, "iallgather rank %d wrong at %zu", r, i);
        }
    }
    /* a blocking call after async ones keeps the order */
    expect_ok(w, dpar_iallreduce(c, g[1], o[1], n, DPAR_F32, DPAR_SUM, &req[0]), "iallreduce", r);
    expect_ok(w, dpar_allreduce(c, g[2], o[2], n, DPAR_F32, DPAR_SUM), "allreduce after async", r);
    expect_ok(w, dpar_request_wait(req[0]), "request_wait", r);
    for (k = 0; k < 4; k++) {
        free(g[k]);
        free(o[k]);
    }
    free(rs);
    free(ag);
}

static void test_async_requests(void)
{
    int ni;
    async_job a;
    for (ni = 0; ni < NN; ni++) {
        a.n = 100003;
        CHECK(run_world(Ns[ni], async_rank, &a) == 0);
    }
}

/* ---- split and mesh ---- */
static void split_rank(world *w, dpar_comm *c, int r)
{
    dpar_comm *half = NULL, *none = NULL;
    int64_t sum = r, want = 0;
    int q;
    expect_ok(w, dpar_comm_split(c, r % 2, -r, &half), "split", r); /* key -r: reversed order */
    if (!half) return;
    for (q = 0; q < w->n; q++)
        if (q % 2 == r % 2) want += q;
    expect_ok(w, dpar_allreduce(half, &sum, &sum, 1, DPAR_I64, DPAR_SUM), "allreduce on split", r);
    if (sum != want) note(w, "split sum on rank %d: %lld != %lld", r, (long long)sum, (long long)want);
    {
        int members = (w->n - r % 2 + 1) / 2, pos = 0;
        for (q = r + 2; q < w->n; q += 2) pos++; /* ranks of my color with a smaller key (-q < -r) */
        if (dpar_comm_size(half) != members || dpar_comm_rank(half) != pos)
            note(w, "split rank %d: size %d rank %d, want %d %d", r, dpar_comm_size(half), dpar_comm_rank(half),
                 members, pos);
    }
    expect_ok(w, dpar_comm_split(c, r == 0 ? 0 : -1, 0, &none), "split with negative color", r);
    if ((r == 0) != (none != NULL)) note(w, "negative color gave a comm on rank %d", r);
    if (none) {
        expect_ok(w, dpar_barrier(none), "barrier of one", r);
        dpar_comm_destroy(none);
    }
    dpar_comm_destroy(half);
}

static void mesh_rank(world *w, dpar_comm *c, int r)
{
    dpar_mesh m;
    dpar_mesh_desc md = {0};
    int64_t v = r, s;
    md.world = c, md.tp = 2, md.pp = 2; /* dp 0: 8 / (2 x 2) */
    expect_ok(w, dpar_mesh_init(&m, &md), "mesh", r);
    if (m.dp != 2) note(w, "mesh dp %d, not 8 / (2 x 2)", m.dp);
    if (m.tp_rank != r % 2 || m.dp_rank != (r / 2) % 2 || m.pp_rank != r / 4)
        note(w, "mesh coordinates of %d: dp %d tp %d pp %d", r, m.dp_rank, m.tp_rank, m.pp_rank);
    if (dpar_comm_rank(m.tp_comm) != m.tp_rank || dpar_comm_rank(m.dp_comm) != m.dp_rank ||
        dpar_comm_rank(m.pp_comm) != m.pp_rank || dpar_comm_size(m.tp_comm) != 2)
        note(w, "mesh comm ranks of %d", r);
    { /* named after the world, so that their messages and trace tracks tell them apart */
        dpar_comm_desc dw, dd, dt, dpp;
        dpar_comm_query(c, &dw), dpar_comm_query(m.dp_comm, &dd), dpar_comm_query(m.tp_comm, &dt);
        dpar_comm_query(m.pp_comm, &dpp);
        if (strcmp(dw.name, "comm") || strcmp(dd.name, "comm.dp") || strcmp(dt.name, "comm.tp") ||
            strcmp(dpp.name, "comm.pp"))
            note(w, "mesh comm names on %d: %s %s %s %s", r, dw.name, dd.name, dt.name, dpp.name);
    }
    /* tp partners differ in bit 0, dp in bit 1, pp in bit 2 of the world rank */
    s = v;
    expect_ok(w, dpar_allreduce(m.tp_comm, &s, &s, 1, DPAR_I64, DPAR_SUM), "tp allreduce", r);
    if (s != 2 * (r & ~1) + 1) note(w, "tp sum on %d: %lld", r, (long long)s);
    s = v;
    expect_ok(w, dpar_allreduce(m.dp_comm, &s, &s, 1, DPAR_I64, DPAR_SUM), "dp allreduce", r);
    if (s != 2 * (r & ~2) + 2) note(w, "dp sum on %d: %lld", r, (long long)s);
    s = v;
    expect_ok(w, dpar_allreduce(m.pp_comm, &s, &s, 1, DPAR_I64, DPAR_SUM), "pp allreduce", r);
    if (s != 2 * (r & ~4) + 4) note(w, "pp sum on %d: %lld", r, (long long)s);
    if (dpar_mesh_destroy(&m) != DPAR_OK || m.dp_comm || dpar_mesh_destroy(&m) != DPAR_OK) note(w, "mesh destroy");
    md.dp = 3, md.tp = 1, md.pp = 1;
    if (dpar_mesh_init(&m, &md) != DPAR_EINVAL || m.dp_comm) note(w, "a mesh of the wrong size was accepted");
}

/* a comm of one rank runs its async requests at once, on the caller: no progress thread */
static int count_threads(void)
{
    int n = -1;
#ifdef __linux__
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "Threads:", 8)) n = atoi(line + 8);
    if (f) fclose(f);
#endif
    return n;
}

static void test_async_on_one_rank_runs_inline(void)
{
    dpar_comm_desc d;
    dpar_group *g;
    dpar_comm *c;
    dpar_request *req;
    float x[5] = {1, 2, 3, 4, 5}, y[5];
    int before, done = 0, i;
    if (count_threads() < 0) {
        printf("    skipped: no /proc/self/status thread count here\n");
        return;
    }
    memset(&d, 0, sizeof d);
    d.size = 1;
    CHECK(dpar_group_create(&d, &g) == DPAR_OK);
    CHECK(dpar_group_join(g, 0, &c) == DPAR_OK);
    before = count_threads();
    CHECK(dpar_iallreduce(c, x, y, 5, DPAR_F32, DPAR_SUM, &req) == DPAR_OK);
    CHECK(dpar_request_test(req, &done) == DPAR_OK && done == 1); /* finished before it was asked */
    for (i = 0; i < 5; i++) CHECK(y[i] == x[i]);
    CHECK_MSG(count_threads() == before, "%d threads before the request, %d after", before, count_threads());
    CHECK(dpar_comm_destroy(c) == DPAR_OK);
    dpar_group_destroy(g);
}

static void test_split_and_mesh(void)
{
    int ni;
    for (ni = 0; ni < NN; ni++) CHECK(run_world(Ns[ni], split_rank, NULL) == 0);
    CHECK(run_world(8, mesh_rank, NULL) == 0);
}

/* an integer average divides the wrapped sum by the rank count as a wide integer: (T)div was 0 for u8 on 256 ranks
   (a division by zero) and wrapped above it (300 ranks divided by 44) */
static void test_integer_average_any_group_size(void)
{
    static const int divs[] = {2, 3, 255, 256, 300, 1 << 20, 1 << 30};
    uint8_t a8[256], b8[256], o8[256];
    int32_t a32[4] = {INT32_MAX, INT32_MIN, -7, 1000000007}, b32[4] = {1, -1, 3, 1000000007}, o32[4];
    int64_t a64[3] = {INT64_MAX, -5, (int64_t)1 << 40}, b64[3] = {1, -6, (int64_t)1 << 40}, o64[3];
    int k, i;
    for (i = 0; i < 256; i++) a8[i] = (uint8_t)i, b8[i] = (uint8_t)(255 - i / 2);
    for (k = 0; k < (int)(sizeof divs / sizeof divs[0]); k++) {
        int d = divs[k];
        dpar__reduce(o8, a8, b8, 256, DPAR_U8, DPAR_AVG, d);
        for (i = 0; i < 256; i++)
            CHECK_MSG(o8[i] == (uint8_t)(((a8[i] + b8[i]) & 255) / d), "u8 %d + %d over %d: %d", a8[i], b8[i], d,
                      o8[i]);
        dpar__reduce(o32, a32, b32, 4, DPAR_I32, DPAR_AVG, d);
        for (i = 0; i < 4; i++)
            CHECK_MSG(o32[i] == (int32_t)((int64_t)(int32_t)((uint32_t)a32[i] + (uint32_t)b32[i]) / d), "i32 over %d",
                      d);
        dpar__reduce(o64, a64, b64, 3, DPAR_I64, DPAR_AVG, d);
        for (i = 0; i < 3; i++)
            CHECK_MSG(o64[i] == (int64_t)((uint64_t)a64[i] + (uint64_t)b64[i]) / d, "i64 over %d", d);
    }
}

/* ---- dpar_comm_memory: buffers the host must not touch ---- */
/* A fake device: its memory holds every byte XORed with a key of the byte's address, so bytes that dpar copied
   or combined on the host itself (instead of through the callbacks) come out wrong. The callbacks decode,
   compute as the reference does (small integers: exact in any order), and encode at the destination. */
typedef struct {
    int peer_access; /* what peer_access answers: 0, 1, or 2: 1 where worker + peer is even (some peers each) */
    int fail_worker; /* this worker's reduce number fail_at fails (-1: none) */
    long fail_at;
    long reduces, copies, enters, staged, allocs, frees, combines; /* atomics */
    size_t biggest;                                                /* the largest allocation (atomic) */
    int bad_worker;                                                /* a callback saw a worker outside 0..size-1 */
    int size;
    const char *own[8]; /* worker q's buffers: [own[q], own[q] + own_bytes) */
    size_t own_bytes;
    int peer_read;           /* reduce read another worker's buffer though peer_access said no */
    int fail_host_worker;    /* this worker's to_host fails (-1: none) */
    int fail_from_worker;    /* this worker's from_host fails (-1: none) */
    int fail_combine_worker; /* this worker's combines fail (-1: none) */
} fake_dev;
static fake_dev fdev;

/* dpar's own allocations on the fake device (scratch, staging, ZeRO and FSDP state) are address ranges the host
   cannot touch (PROT_NONE), their bytes in a second allocation that only the callbacks reach (fake_at): a host
   memcpy or loop over device memory crashes instead of passing unseen. The tests' own buffers are host memory that
   they encode (fake_code), used as they are. */
typedef struct {
    char *dev, *back;
    size_t bytes;
} fake_range;
static fake_range fake_ranges[512];
static int fake_nranges;
static pthread_mutex_t fake_ranges_lock = PTHREAD_MUTEX_INITIALIZER;
static const void *fake_at(const void *p) /* where a device address's bytes are */
{
    const char *c = (const char *)p, *at = c;
    int i;
    pthread_mutex_lock(&fake_ranges_lock);
    for (i = 0; i < fake_nranges; i++)
        if (c >= fake_ranges[i].dev && c < fake_ranges[i].dev + fake_ranges[i].bytes) {
            at = fake_ranges[i].back + (c - fake_ranges[i].dev);
            break;
        }
    pthread_mutex_unlock(&fake_ranges_lock);
    return at;
}
static unsigned char fake_key(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    return (unsigned char)((a * 2654435761u) >> 11);
}
static void fake_code(void *buf, size_t bytes) /* host bytes <-> device bytes (XOR: its own inverse) */
{
    unsigned char *b = (unsigned char *)buf;
    size_t i;
    for (i = 0; i < bytes; i++) b[i] ^= fake_key(b + i);
}
static void fake_worker(int worker)
{
    if (worker < 0 || worker >= fdev.size) __atomic_store_n(&fdev.bad_worker, 1, __ATOMIC_RELAXED);
}
/* n elements at p, decoded into a fresh host copy */
static void *fake_read(const void *p, size_t bytes)
{
    unsigned char *h = (unsigned char *)malloc(bytes ? bytes : 1);
    const unsigned char *d = (const unsigned char *)fake_at(p);
    size_t i;
    for (i = 0; i < bytes; i++) h[i] = d[i] ^ fake_key(d + i);
    return h;
}
static void fake_write(void *p, const void *h, size_t bytes)
{
    unsigned char *d = (unsigned char *)(uintptr_t)fake_at(p);
    size_t i;
    for (i = 0; i < bytes; i++) d[i] = ((const unsigned char *)h)[i] ^ fake_key(d + i);
}
static double fake_avg(double v, dpar_dtype t, int div)
{
    if (t == DPAR_I32 || t == DPAR_I64 || t == DPAR_U8) return (double)((long long)v / div);
    if (t == DPAR_F64) return v / div;
    return (double)((float)v / (float)div);
}
/* one step of a reduce on decoded values: x op y, then / div for AVG */
static double fake_op(double x, double y, dpar_dtype t, dpar_op op, int div)
{
    double z;
    switch (op) {
    case DPAR_SUM:
    case DPAR_AVG: z = x + y; break;
    case DPAR_MIN: z = y < x ? y : x; break;
    case DPAR_MAX: z = y > x ? y : x; break;
    default: z = x * y; break;
    }
    if (t == DPAR_U8) z = (double)((long long)z & 255);
    if (op == DPAR_AVG && div > 1) z = fake_avg(z, t, div);
    return z;
}
static int fake_can_read(int worker, int peer)
{
    return worker == peer || fdev.peer_access == 1 || (fdev.peer_access == 2 && (worker + peer) % 2 == 0);
}
/* a worker may read its own and its staged bytes, and those of the peers it can read: p (bytes long) must be in no
   other peer's */
static void fake_check_read(int worker, const void *p, size_t bytes)
{
    int q;
    for (q = 0; q < 8 && bytes; q++) {
        const char *o = fdev.own[q];
        if (!fake_can_read(worker, q) && o && (const char *)p >= o && (const char *)p < o + fdev.own_bytes)
            __atomic_store_n(&fdev.peer_read, 1, __ATOMIC_RELAXED);
    }
}
static dpar_status fake_reduce(void *user, int worker, void *out, const void *a, const void *b, size_t n, dpar_dtype t,
                               dpar_op op, int div)
{
    size_t es = dpar_dtype_size(t), i;
    void *ha, *hb;
    long k = __atomic_add_fetch(&fdev.reduces, 1, __ATOMIC_RELAXED);
    (void)user;
    fake_worker(worker);
    if (worker == fdev.fail_worker && k >= fdev.fail_at)
        return dpar_set_error(DPAR_ESYSTEM, "fake device fault on worker %d", worker);
    fake_check_read(worker, a, n * es);
    fake_check_read(worker, b, n * es);
    ha = fake_read(a, n * es);
    hb = fake_read(b, n * es);
    for (i = 0; i < n; i++) put(ha, t, i, fake_op(get(ha, t, i), get(hb, t, i), t, op, div));
    fake_write(out, ha, n * es);
    free(ha);
    free(hb);
    return DPAR_OK;
}
/* the one-shot's combine, element by element in the ring's order (dpar_algo's "Results"), from decoded copies */
static dpar_status fake_combine(void *user, int worker, void *out, const void *const *in, int ranks, size_t lo,
                                size_t n, size_t count, dpar_dtype t, dpar_op op)
{
    size_t es = dpar_dtype_size(t), i, base = count / (size_t)ranks, rem = count % (size_t)ranks;
    void *h[8], *acc = malloc(n * es + 1);
    int q;
    (void)user;
    fake_worker(worker);
    __atomic_add_fetch(&fdev.combines, 1, __ATOMIC_RELAXED);
    if (worker == fdev.fail_combine_worker) {
        free(acc);
        return dpar_set_error(DPAR_ESYSTEM, "fake device: combine failed on worker %d", worker);
    }
    /* ranks: the comm's (a split comm's fewer) */
    if (ranks < 2 || ranks > fdev.size || ranks > 8 || lo + n > count)
        __atomic_store_n(&fdev.bad_worker, 1, __ATOMIC_RELAXED);
    for (q = 0; q < ranks && q < 8; q++) {
        if ((const char *)in[q] < (const char *)out + n * es && (const char *)out < (const char *)in[q] + n * es)
            __atomic_store_n(&fdev.bad_worker, 1, __ATOMIC_RELAXED); /* out overlaps an input */
        fake_check_read(worker, in[q], n * es);
        h[q] = fake_read(in[q], n * es);
    }
    for (i = 0; i < n && ranks <= 8; i++) {
        size_t e = lo + i; /* its block c: the first rem blocks hold base + 1 elements */
        int c = (int)(e < rem * (base + 1) ? e / (base + 1) : rem + (e - rem * (base + 1)) / base), j;
        double z = get(h[(c + 1) % ranks], t, i);
        for (j = 2; j <= ranks; j++) z = fake_op(get(h[(c + j) % ranks], t, i), z, t, op, j == ranks ? ranks : 0);
        put(acc, t, i, z);
    }
    fake_write(out, acc, n * es);
    for (q = 0; q < ranks && q < 8; q++) free(h[q]);
    free(acc);
    return DPAR_OK;
}
static dpar_status fake_divide(void *user, int worker, void *out, const void *in, size_t n, dpar_dtype t, int div)
{
    size_t es = dpar_dtype_size(t), i;
    void *h = fake_read(in, n * es);
    (void)user;
    fake_worker(worker);
    for (i = 0; i < n && div > 1; i++) put(h, t, i, fake_avg(get(h, t, i), t, div));
    fake_write(out, h, n * es);
    free(h);
    return DPAR_OK;
}
static dpar_status fake_copy(void *user, int worker, void *dst, const void *src, size_t bytes)
{
    void *h = fake_read(src, bytes);
    (void)user;
    fake_worker(worker);
    __atomic_add_fetch(&fdev.copies, 1, __ATOMIC_RELAXED);
    fake_write(dst, h, bytes);
    free(h);
    return DPAR_OK;
}
static dpar_status fake_enter(void *user, int worker)
{
    (void)user;
    fake_worker(worker);
    __atomic_add_fetch(&fdev.enters, 1, __ATOMIC_RELAXED);
    return DPAR_OK;
}
static int fake_peer_access(void *user, int worker, int peer)
{
    (void)user;
    fake_worker(worker);
    fake_worker(peer);
    if (!fake_can_read(worker, peer)) __atomic_add_fetch(&fdev.staged, 1, __ATOMIC_RELAXED);
    return fake_can_read(worker, peer);
}
static void *fake_alloc(void *user, int worker, size_t bytes)
{
    (void)user;
    fake_worker(worker);
    size_t seen = __atomic_load_n(&fdev.biggest, __ATOMIC_RELAXED);
    __atomic_add_fetch(&fdev.allocs, 1, __ATOMIC_RELAXED);
    while (bytes > seen &&
           !__atomic_compare_exchange_n(&fdev.biggest, &seen, bytes, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    {
        fake_range r;
        void *dev = mmap(NULL, bytes ? bytes : 1, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        r.dev = dev == MAP_FAILED ? NULL : (char *)dev;
        r.back = (char *)malloc(bytes ? bytes : 1);
        r.bytes = bytes ? bytes : 1;
        pthread_mutex_lock(&fake_ranges_lock);
        if (!r.dev || !r.back || fake_nranges == (int)(sizeof fake_ranges / sizeof fake_ranges[0])) {
            pthread_mutex_unlock(&fake_ranges_lock);
            if (r.dev) munmap(r.dev, r.bytes);
            free(r.back);
            return NULL;
        }
        fake_ranges[fake_nranges++] = r;
        pthread_mutex_unlock(&fake_ranges_lock);
        return r.dev;
    }
}
static void fake_free(void *user, int worker, void *p)
{
    (void)user;
    fake_worker(worker);
    __atomic_add_fetch(&fdev.frees, 1, __ATOMIC_RELAXED);
    if (p) {
        int i;
        pthread_mutex_lock(&fake_ranges_lock);
        for (i = 0; i < fake_nranges; i++)
            if (fake_ranges[i].dev == (char *)p) {
                munmap(fake_ranges[i].dev, fake_ranges[i].bytes);
                free(fake_ranges[i].back);
                fake_ranges[i] = fake_ranges[--fake_nranges];
                break;
            }
        pthread_mutex_unlock(&fake_ranges_lock);
    }
}
/* dpar_zero's and dpar_fsdp's callbacks: zeros, and the optimizer's step on decoded copies (the host's math) */
static dpar_status fake_clear(void *user, int worker, void *p, size_t bytes)
{
    void *zeros = calloc(bytes ? bytes : 1, 1);
    (void)user;
    fake_worker(worker);
    fake_write(p, zeros, bytes);
    free(zeros);
    return DPAR_OK;
}
static dpar_status fake_update(void *user, int worker, const dpar_optim_update *u)
{
    dpar_optim_update h = *u;
    size_t bytes = u->n * sizeof(float);
    (void)user;
    fake_worker(worker);
    h.params = (float *)fake_read(u->params, bytes);
    h.m = (float *)fake_read(u->m, bytes);
    h.v = u->v ? (float *)fake_read(u->v, bytes) : NULL;
    h.grads = (const float *)fake_read(u->grads, bytes);
    dpar__optim_apply(&h);
    fake_write(u->params, h.params, bytes);
    fake_write(u->m, h.m, bytes);
    if (u->v) fake_write(u->v, h.v, bytes);
    free(h.params), free(h.m), free(h.v), free((void *)h.grads);
    return DPAR_OK;
}
/* checkpoints: device bytes to host memory (decoded) and back (encoded) */
static dpar_status fake_to_host(void *user, int worker, void *host, const void *dev, size_t bytes)
{
    void *h;
    (void)user;
    fake_worker(worker);
    if (worker == fdev.fail_host_worker) return dpar_set_error(DPAR_ESYSTEM, "fake device: to_host failed");
    h = fake_read(dev, bytes);
    memcpy(host, h, bytes);
    free(h);
    return DPAR_OK;
}
static dpar_status fake_from_host(void *user, int worker, void *dev, const void *host, size_t bytes)
{
    (void)user;
    fake_worker(worker);
    if (worker == fdev.fail_from_worker) return dpar_set_error(DPAR_ESYSTEM, "fake device: from_host failed");
    fake_write(dev, host, bytes);
    return DPAR_OK;
}
static dpar_comm_desc fake_desc(int n, int peer_access)
{
    dpar_comm_desc d;
    memset(&d, 0, sizeof d);
    memset(&fdev, 0, sizeof fdev);
    fdev.peer_access = peer_access;
    fdev.fail_worker = -1;
    fdev.fail_host_worker = -1;
    fdev.fail_from_worker = -1;
    fdev.fail_combine_worker = -1;
    fdev.size = n;
    d.size = n;
    d.segment_bytes = 4096; /* several segments per chunk at the larger counts */
    d.memory.reduce = fake_reduce;
    d.memory.divide = fake_divide;
    d.memory.copy = fake_copy;
    d.memory.enter = fake_enter;
    d.memory.peer_access = fake_peer_access;
    d.memory.alloc = fake_alloc;
    d.memory.free = fake_free;
    d.memory.clear = fake_clear;
    d.memory.update = fake_update;
    d.memory.to_host = fake_to_host;
    d.memory.from_host = fake_from_host;
    return d;
}

/* every collective and every dtype and op, on buffers only the callbacks may touch, with peers readable
   directly and through staging */
static void test_memory_callbacks_matrix(void)
{
    static const int ns[] = {1, 2, 3, 4};
    char *bufs[8];
    int ni, pa, q, t, op, ci;
    char *block = (char *)malloc(8 * 5000 * 8);
    for (q = 0; q < 8; q++) bufs[q] = block + (size_t)q * 5000 * 8;
    for (pa = 1; pa >= 0; pa--)
        for (ni = 0; ni < 4; ni++) {
            int N = ns[ni], fails = 0;
            size_t counts[4];
            dpar_comm_desc d = fake_desc(N, pa);
            if (pa) d.memory.combine = fake_combine; /* direct reads with combine here; the async matrix: staged */
            for (q = 0; q < N; q++) fdev.own[q] = bufs[2 * q]; /* send and recv of worker q: one block */
            fdev.own_bytes = 2 * 5000 * 8;
            counts[0] = 0;
            counts[1] = 1;
            counts[2] = (size_t)N + 1;
            counts[3] = 5000;
            for (ci = 0; ci < 4; ci++) {
                matrix_case m;
                memset(&m, 0, sizeof m);
                m.count = counts[ci];
                m.device = fake_code;
                for (q = 0; q < N; q++) {
                    m.send[q] = bufs[2 * q];
                    m.recv[q] = bufs[2 * q + 1];
                }
                for (t = 0; t < DPAR_DTYPE_COUNT; t++) {
                    m.t = (dpar_dtype)t;
                    m.root = (int)(counts[ci] % (size_t)N);
                    for (op = 0; op < DPAR_OP_COUNT; op++) {
                        m.op = (dpar_op)op;
                        fails += run_world_desc(N, &d, matrix_rank, &m, NULL, 0);
                    }
                    m.op = DPAR_SUM;
                    fails += run_world_desc(N, &d, movement_rank, &m, NULL, 0);
                }
            }
            CHECK_MSG(fails == 0, "N=%d peer_access=%d: %d failures", N, pa, fails);
            CHECK(!fdev.bad_worker);
            CHECK(!fdev.peer_read);
            CHECK(fdev.enters > 0);
            CHECK(N == 1 || fdev.reduces > 0);
            CHECK(N == 1 || fdev.copies > 0);
            CHECK_MSG(N == 1 || (pa ? fdev.combines > 0 : fdev.combines == 0), "N=%d peer_access=%d combines=%ld", N,
                      pa, fdev.combines);
            CHECK_MSG(N == 1 || (pa ? fdev.staged == 0 : fdev.staged > 0), "N=%d peer_access=%d staged=%ld", N, pa,
                      fdev.staged);
            CHECK_MSG(fdev.allocs == fdev.frees, "%ld allocations, %ld frees", fdev.allocs, fdev.frees);
        }
    free(block);
}

/* a callback fails on one worker: every rank returns its error, with its text, at once */
typedef struct {
    dpar_status st[4];
    char msg[4][512];
    double seconds[4];
    int mode; /* 0: a failing reduce on worker 1; 1: rank 2 calls dpar_comm_fail instead of the collective */
} mem_fail_job;
static mem_fail_job mem_fail;
static void mem_fail_rank(world *w, dpar_comm *c, int r)
{
    float *x = (float *)calloc(8192, sizeof(float)); /* 32 KiB: the ring (one-shot up to 16 KiB) */
    double t0 = dt_now();
    int i;
    (void)w;
    for (i = 0; i < 3 && mem_fail.st[r] == DPAR_OK; i++) {
        if (mem_fail.mode == 1 && r == 2 && i == 1) {
            dpar_comm_fail(c, DPAR_ESYSTEM, "device 2 was lost");
            mem_fail.st[r] = DPAR_ESYSTEM;
            break;
        }
        mem_fail.st[r] = dpar_allreduce(c, x, x, 8192, DPAR_F32, DPAR_SUM);
    }
    snprintf(mem_fail.msg[r], sizeof mem_fail.msg[r], "%s", dpar_last_error());
    mem_fail.seconds[r] = dt_now() - t0;
    free(x);
}
static void test_memory_callback_failure_reaches_every_rank(void)
{
    int mode, r;
    for (mode = 0; mode < 2; mode++) {
        dpar_comm_desc d = fake_desc(4, 1);
        memset(&mem_fail, 0, sizeof mem_fail);
        mem_fail.mode = mode;
        d.timeout_ms = 10000;
        if (mode == 0) {
            fdev.fail_worker = 1;
            fdev.fail_at = 10; /* some reduces in: the failure comes mid-collective */
        }
        run_world_desc(4, &d, mem_fail_rank, NULL, NULL, 0);
        for (r = 0; r < 4; r++) {
            const char *want = mode == 0 ? "fake device fault on worker 1" : "rank 2 failed: device 2 was lost";
            CHECK_MSG(mem_fail.st[r] == DPAR_ESYSTEM && mem_fail.seconds[r] < 5.0, "mode %d rank %d: %s after %.2f s",
                      mode, r, dpar_status_string(mem_fail.st[r]), mem_fail.seconds[r]);
            if (r != 2 || mode == 0)
                CHECK_MSG(strstr(mem_fail.msg[r], want) != NULL, "mode %d rank %d: '%s' does not say '%s'", mode, r,
                          mem_fail.msg[r], want);
        }
        if (mode == 0)
            CHECK_MSG(strstr(mem_fail.msg[0], "rank 1") != NULL, "'%s' does not name rank 1", mem_fail.msg[0]);
    }
}

/* one-shot on device memory moves the message in one piece: a copy callback per peer, not one per 2 KiB (each
   callback is a launch and a wait on a GPU: 512 of them made a 1 MiB allreduce take 7.2 ms on an H200) */
enum { MEM_ONESHOT_N = 16384 }; /* 64 KiB: 32 pieces of the MPI transport's size */
static void mem_oneshot_rank(world *w, dpar_comm *c, int r)
{
    enum { n = MEM_ONESHOT_N };
    float *x = (float *)w->user + (size_t)r * n; /* fdev.own[r]: the fake checks who reads it */
    int i;
    for (i = 0; i < n; i++) x[i] = (float)(r * 3 + i % 7);
    fake_code(x, n * sizeof(float));
    expect_ok(w, dpar_allreduce(c, x, x, n, DPAR_F32, DPAR_SUM), "allreduce", r);
    fake_code(x, n * sizeof(float));
    for (i = 0; i < n; i++) {
        double want = 3.0 * w->n * (w->n - 1) / 2 + (double)w->n * (i % 7); /* the sum of r * 3 + i % 7 over r */
        if (x[i] != (float)want) {
            note(w, "rank %d element %d: %g, want %g", r, i, x[i], want);
            break;
        }
    }
}
/* a small reduce on 3 ranks: the middle rank's scratch holds the message, not 4 segments (64 MiB ones on a GPU) */
static void mem_small_reduce_rank(world *w, dpar_comm *c, int r)
{
    float x[4] = {1, 2, 3, 4}, y[4] = {0, 0, 0, 0};
    int i;
    fake_code(x, sizeof x);
    expect_ok(w, dpar_reduce(c, x, y, 4, DPAR_F32, DPAR_SUM, 0), "reduce", r);
    fake_code(y, sizeof y);
    for (i = 0; r == 0 && i < 4; i++)
        if (y[i] != 3.0f * (float)(i + 1)) note(w, "element %d: %g, want %g", i, y[i], 3.0 * (i + 1));
}
static void test_memory_callbacks_small_scratch(void)
{
    dpar_comm_desc d = fake_desc(3, 1);
    d.segment_bytes = (size_t)1 << 20;
    CHECK(run_world_desc(3, &d, mem_small_reduce_rank, NULL, NULL, 0) == 0);
    CHECK_MSG(fdev.biggest < 4096, "an allocation of %zu bytes for a reduce of 16", fdev.biggest);
}
/* N ranks, peers readable or not, with memory.combine or without: per rank, the copies and reduces (launches on a
   GPU, each with a synchronisation in a host-blocking pool) are counted against what the one-shot needs */
static void test_memory_callbacks_oneshot_in_one_piece(void)
{
    static const int ns[] = {2, 4, 8};
    float *block = (float *)malloc(8 * MEM_ONESHOT_N * sizeof(float));
    int ni, pa, with, q;
    for (ni = 0; ni < 3; ni++)
        for (pa = 0; pa < 3; pa++) /* peers readable: none, all, those of the same parity */
            for (with = 0; with < 2; with++) {
                int N = ns[ni];
                long want_copies, want_reduces, want_combines, unreadable = 0;
                dpar_comm_desc d = fake_desc(N, pa);
                d.algo = DPAR_ALGO_ONESHOT;
                if (with) d.memory.combine = fake_combine;
                for (q = 0; q < N; q++) fdev.own[q] = (const char *)(block + (size_t)q * MEM_ONESHOT_N);
                fdev.own_bytes = MEM_ONESHOT_N * sizeof(float);
                for (q = 0; q < N * N; q++) unreadable += !fake_can_read(q / N, q % N);
                CHECK_MSG(run_world_desc(N, &d, mem_oneshot_rank, block, NULL, 0) == 0,
                          "N=%d peer_access=%d combine=%d", N, pa, with);
                /* per rank: the in-place input into scratch, and each peer's message that it cannot read where it
                   is. The combine: one call, or a reduce per step of the ring's order (N blocks, N - 1 steps) */
                want_copies = (long)N + unreadable;
                want_reduces = with ? 0 : (long)N * N * (N - 1);
                want_combines = with ? N : 0;
                CHECK_MSG(fdev.copies == want_copies && fdev.reduces == want_reduces && fdev.combines == want_combines,
                          "N=%d peer_access=%d combine=%d: %ld copies, %ld reduces, %ld combines (want %ld, %ld, %ld)",
                          N, pa, with, fdev.copies, fdev.reduces, fdev.combines, want_copies, want_reduces,
                          want_combines);
                CHECK(!fdev.bad_worker && !fdev.peer_read);
            }
    free(block);
}

/* a failing combine (a kernel's launch or fault) on worker 1: every rank returns its error with its text, at once,
   on the blocking fake and the stream-ordered one (there the fault surfaces at worker 1's next callback) */
static void fas_sync(int worker);
static dpar_status fas_combine(void *user, int worker, void *out, const void *const *in, int ranks, size_t lo, size_t n,
                               size_t count, dpar_dtype t, dpar_op op);
static int mem_combine_async;
static void mem_combine_fail_rank(world *w, dpar_comm *c, int r)
{
    float *x = (float *)w->user + (size_t)r * 1000;
    double t0 = dt_now();
    int i;
    for (i = 0; i < 20 && mem_fail.st[r] == DPAR_OK; i++) {
        mem_fail.st[r] = dpar_allreduce(c, x, x, 1000, DPAR_F32, DPAR_SUM); /* 4 KB: the one-shot */
        if (mem_combine_async) fas_sync(r);
    }
    snprintf(mem_fail.msg[r], sizeof mem_fail.msg[r], "%s", dpar_last_error());
    mem_fail.seconds[r] = dt_now() - t0;
}
static void test_memory_combine_failure_reaches_every_rank(void)
{
    int async, r;
    for (async = 0; async < 2; async++) {
        float *x = (float *)calloc(4 * 1000, sizeof(float));
        dpar_comm_desc d = async ? fas_desc(4, 1) : fake_desc(4, 1);
        memset(&mem_fail, 0, sizeof mem_fail);
        mem_combine_async = async;
        d.memory.combine = async ? fas_combine : fake_combine;
        d.timeout_ms = 10000;
        fdev.fail_combine_worker = 1;
        fake_code(x, 4 * 1000 * sizeof(float));
        run_world_desc(4, &d, mem_combine_fail_rank, x, NULL, 0);
        if (async) fas_stop();
        free(x);
        for (r = 0; r < 4; r++) {
            CHECK_MSG(mem_fail.st[r] == DPAR_ESYSTEM && mem_fail.seconds[r] < 5.0, "async %d rank %d: %s after %.2f s",
                      async, r, dpar_status_string(mem_fail.st[r]), mem_fail.seconds[r]);
            CHECK_MSG(strstr(mem_fail.msg[r], "fake device: combine failed on worker 1") != NULL,
                      "async %d rank %d: '%s'", async, r, mem_fail.msg[r]);
        }
        CHECK(fdev.allocs == fdev.frees && !fdev.bad_worker);
    }
}

/* split comms keep each thread's worker; shared-memory speed-ups are refused; bad memory descs are refused */
static void mem_split_rank(world *w, dpar_comm *c, int r)
{
    dpar_comm *sub = NULL;
    float x[6000]; /* 24 KB: the ring (smaller ones go one-shot, which stages nothing) */
    int i, sr, sn;
    dpar_steal *st = NULL;
    dpar_steal_desc sd;
    for (i = 0; i < 6000; i++) x[i] = (float)(r + i);
    fake_code(x, sizeof x);
    expect_ok(w, dpar_comm_split(c, r % 2, -r, &sub), "split", r);
    if (!sub) return;
    sr = dpar_comm_rank(sub);
    sn = dpar_comm_size(sub);
    if (sr != (sn - 1) - r / 2) note(w, "rank %d: sub rank %d (keys reverse the order)", r, sr);
    expect_ok(w, dpar_allreduce(sub, x, x, 6000, DPAR_F32, DPAR_SUM), "sub allreduce", r);
    fake_code(x, sizeof x);
    for (i = 0; i < 6000; i++) {
        float want = 0;
        int q;
        for (q = r % 2; q < w->n; q += 2) want += (float)(q + i);
        if (x[i] != want) {
            note(w, "rank %d element %d: %g, want %g", r, i, x[i], want);
            break;
        }
    }
    memset(&sd, 0, sizeof sd);
    sd.comm = sub;
    sd.max_tasks = 4;
    if (dpar_steal_create(&sd, &st) != DPAR_EUNSUPPORTED) note(w, "rank %d: steal on device memory accepted", r);
    dpar_steal_destroy(st);
    dpar_comm_destroy(sub);
}
static void test_memory_callbacks_split_and_refusals(void)
{
    dpar_comm_desc d = fake_desc(4, 0);
    dpar_group *g = NULL;
    CHECK(run_world_desc(4, &d, mem_split_rank, NULL, NULL, 0) == 0);
    CHECK(!fdev.bad_worker);
    CHECK(fdev.staged > 0);
    d.memory.free = NULL; /* four of five */
    CHECK(dpar_group_create(&d, &g) == DPAR_EINVAL && g == NULL);
    CHECK(strstr(dpar_last_error(), "all or none") != NULL);
    memset(&d.memory, 0, sizeof d.memory);
    d.memory.peer_access = fake_peer_access;
    CHECK(dpar_group_create(&d, &g) == DPAR_EINVAL && g == NULL);
    memset(&d.memory, 0, sizeof d.memory);
    d.memory.combine = fake_combine; /* a combine without the memory it combines */
    CHECK(dpar_group_create(&d, &g) == DPAR_EINVAL && g == NULL);
    CHECK(strstr(dpar_last_error(), "memory.combine without the memory callbacks") != NULL);
    CHECK(dpar_comm_fail(NULL, DPAR_ESYSTEM, "x") == DPAR_EINVAL);
    { /* why = DPAR_OK is refused, and the comm stays usable */
        dpar_comm_desc one;
        dpar_group *g1 = NULL;
        dpar_comm *c1 = NULL;
        memset(&one, 0, sizeof one);
        one.size = 1;
        CHECK(dpar_group_create(&one, &g1) == DPAR_OK && dpar_group_join(g1, 0, &c1) == DPAR_OK);
        CHECK(dpar_comm_fail(c1, DPAR_OK, "x") == DPAR_EINVAL && dpar_barrier(c1) == DPAR_OK);
        CHECK(dpar_comm_fail(c1, DPAR_ESYSTEM, "lost") == DPAR_ESYSTEM && dpar_barrier(c1) == DPAR_ESYSTEM);
        dpar_comm_destroy(c1);
        dpar_group_destroy(g1);
    }
}

/* ---- stream-ordered memory: a fake asynchronous device ----
   The fake device above, made asynchronous as a GPU is: each worker has a stream, a thread that runs the work
   queued on it later, in order, after a random pause of up to 60 us (a quarter of the ops), so that a step that
   reads before a peer's stream has written, or writes before a peer's stream has read, comes out wrong (the
   memory is still XOR-keyed: nothing but the callbacks may touch it). reduce, divide and copy queue their work and
   return; record returns a ticket (the stream's op count so far, + 1); wait queues an op that blocks the stream
   until the peer's stream has run up to the ticket. An op that fails (fdev.fail_worker) fails on the stream; the
   worker's next callback returns the error, as CUDA reports a kernel's fault at a later call. */
enum { FAS_REDUCE, FAS_DIVIDE, FAS_COPY, FAS_WAIT, FAS_CLEAR, FAS_UPDATE, FAS_COMBINE };
typedef struct {
    int kind, div, peer;
    dpar_optim_update u; /* FAS_UPDATE's */
    void *out;
    const void *a, *b;
    const void *in[8]; /* FAS_COMBINE's inputs (div holds their count) */
    size_t n, lo, count;
    dpar_dtype t;
    dpar_op op;
    uint64_t ticket;
} fas_op;
typedef struct {
    fas_op q[256]; /* a ring: queued - done ops, at most 256 (the callback waits for room) */
    uint64_t queued, done;
    dpar_status error; /* an op failed: the next callback returns it */
    char error_msg[600];
    uint64_t rng;
    pthread_t thread;
} fas_stream;
static struct {
    fas_stream s[8];
    int n, stop, hold; /* hold: the streams run nothing (a device busy with earlier work) */
    long records, waits, queued_ops;
    pthread_mutex_t lock;
    pthread_cond_t cond; /* any change: an op queued or done, stop */
} fas;

static void *fas_main(void *arg)
{
    fas_stream *s = (fas_stream *)arg;
    int worker = (int)(s - fas.s);
    for (;;) {
        fas_op op;
        uint64_t r;
        dpar_status st = DPAR_OK;
        pthread_mutex_lock(&fas.lock);
        while ((s->done == s->queued || fas.hold) && !fas.stop) pthread_cond_wait(&fas.cond, &fas.lock);
        if (s->done == s->queued) {
            pthread_mutex_unlock(&fas.lock);
            return NULL;
        }
        op = s->q[s->done % 256];
        pthread_mutex_unlock(&fas.lock);
        s->rng = s->rng * 6364136223846793005ull + 1442695040888963407ull;
        r = s->rng >> 33;
        if (r % 4 == 0) {
            struct timespec pause = {0, (long)(r / 4 % 60) * 1000};
            nanosleep(&pause, NULL);
        }
        if (op.kind == FAS_WAIT) {
            pthread_mutex_lock(&fas.lock);
            while (fas.s[op.peer].done + 1 < op.ticket) pthread_cond_wait(&fas.cond, &fas.lock);
            pthread_mutex_unlock(&fas.lock);
        } else if (op.kind == FAS_REDUCE) st = fake_reduce(NULL, worker, op.out, op.a, op.b, op.n, op.t, op.op, op.div);
        else if (op.kind == FAS_DIVIDE) st = fake_divide(NULL, worker, op.out, op.a, op.n, op.t, op.div);
        else if (op.kind == FAS_CLEAR) st = fake_clear(NULL, worker, op.out, op.n);
        else if (op.kind == FAS_UPDATE) st = fake_update(NULL, worker, &op.u);
        else if (op.kind == FAS_COMBINE)
            st = fake_combine(NULL, worker, op.out, op.in, op.div, op.lo, op.n, op.count, op.t, op.op);
        else st = fake_copy(NULL, worker, op.out, op.a, op.n);
        pthread_mutex_lock(&fas.lock);
        if (st != DPAR_OK && s->error == DPAR_OK) {
            s->error = st;
            snprintf(s->error_msg, sizeof s->error_msg, "%s", dpar_last_error());
        }
        s->done++;
        pthread_cond_broadcast(&fas.cond);
        pthread_mutex_unlock(&fas.lock);
    }
}

/* the stream's earlier failure, as the next callback reports it */
static dpar_status fas_error(int worker)
{
    dpar_status st;
    pthread_mutex_lock(&fas.lock);
    st = fas.s[worker].error;
    pthread_mutex_unlock(&fas.lock);
    return st == DPAR_OK ? st : dpar_set_error(st, "%s (an earlier op on the stream)", fas.s[worker].error_msg);
}
static dpar_status fas_queue(int worker, const fas_op *op)
{
    fas_stream *s = &fas.s[worker];
    dpar_status st = fas_error(worker);
    if (st != DPAR_OK) return st;
    pthread_mutex_lock(&fas.lock);
    while (s->queued - s->done >= 256) pthread_cond_wait(&fas.cond, &fas.lock);
    s->q[s->queued % 256] = *op;
    s->queued++;
    fas.queued_ops++;
    pthread_cond_broadcast(&fas.cond);
    pthread_mutex_unlock(&fas.lock);
    return DPAR_OK;
}
static dpar_status fas_reduce(void *user, int worker, void *out, const void *a, const void *b, size_t n, dpar_dtype t,
                              dpar_op op, int div)
{
    fas_op o;
    (void)user;
    memset(&o, 0, sizeof o);
    o.kind = FAS_REDUCE, o.out = out, o.a = a, o.b = b, o.n = n, o.t = t, o.op = op, o.div = div;
    return fas_queue(worker, &o);
}
/* the inputs' pointers are copied into the queued op (as a kernel launch copies its parameters) */
static dpar_status fas_combine(void *user, int worker, void *out, const void *const *in, int ranks, size_t lo, size_t n,
                               size_t count, dpar_dtype t, dpar_op op)
{
    fas_op o;
    int q;
    (void)user;
    memset(&o, 0, sizeof o);
    o.kind = FAS_COMBINE, o.out = out, o.div = ranks, o.lo = lo, o.n = n, o.count = count, o.t = t, o.op = op;
    for (q = 0; q < ranks && q < 8; q++) o.in[q] = in[q];
    if (ranks > 8) __atomic_store_n(&fdev.bad_worker, 1, __ATOMIC_RELAXED);
    return fas_queue(worker, &o);
}
static dpar_status fas_divide(void *user, int worker, void *out, const void *in, size_t n, dpar_dtype t, int div)
{
    fas_op o;
    (void)user;
    memset(&o, 0, sizeof o);
    o.kind = FAS_DIVIDE, o.out = out, o.a = in, o.n = n, o.t = t, o.div = div;
    return fas_queue(worker, &o);
}
static dpar_status fas_copy(void *user, int worker, void *dst, const void *src, size_t bytes)
{
    fas_op o;
    (void)user;
    memset(&o, 0, sizeof o);
    o.kind = FAS_COPY, o.out = dst, o.a = src, o.n = bytes;
    return fas_queue(worker, &o);
}
static dpar_status fas_clear(void *user, int worker, void *p, size_t bytes)
{
    fas_op o;
    (void)user;
    memset(&o, 0, sizeof o);
    o.kind = FAS_CLEAR, o.out = p, o.n = bytes;
    return fas_queue(worker, &o);
}
static dpar_status fas_update(void *user, int worker, const dpar_optim_update *u)
{
    fas_op o;
    (void)user;
    memset(&o, 0, sizeof o);
    o.kind = FAS_UPDATE, o.u = *u;
    return fas_queue(worker, &o);
}
static dpar_status fas_record(void *user, int worker, uint64_t *ticket)
{
    dpar_status st = fas_error(worker);
    (void)user;
    if (st != DPAR_OK) return st;
    pthread_mutex_lock(&fas.lock);
    *ticket = fas.s[worker].queued + 1;
    fas.records++;
    pthread_mutex_unlock(&fas.lock);
    return DPAR_OK;
}
static dpar_status fas_wait(void *user, int worker, int peer, uint64_t ticket)
{
    fas_op o;
    (void)user;
    memset(&o, 0, sizeof o);
    o.kind = FAS_WAIT, o.peer = peer, o.ticket = ticket;
    if (peer < 0 || peer >= fas.n || ticket == 0) __atomic_store_n(&fdev.bad_worker, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&fas.lock);
    fas.waits++;
    pthread_mutex_unlock(&fas.lock);
    return fas_queue(worker, &o);
}
/* the host waits for the worker's stream (cudaStreamSynchronize) */
static void fas_sync(int worker)
{
    pthread_mutex_lock(&fas.lock);
    while (fas.s[worker].done < fas.s[worker].queued) pthread_cond_wait(&fas.cond, &fas.lock);
    pthread_mutex_unlock(&fas.lock);
}
/* checkpoints: after the stream's queued work, at once (as cudaMemcpy from or to pageable host memory) */
static dpar_status fas_to_host(void *user, int worker, void *host, const void *dev, size_t bytes)
{
    dpar_status st = fas_error(worker);
    if (st != DPAR_OK) return st;
    fas_sync(worker);
    return fake_to_host(user, worker, host, dev, bytes);
}
static dpar_status fas_from_host(void *user, int worker, void *dev, const void *host, size_t bytes)
{
    dpar_status st = fas_error(worker);
    if (st != DPAR_OK) return st;
    fas_sync(worker);
    return fake_from_host(user, worker, dev, host, bytes);
}
/* freeing device memory waits for the stream first, as cudaFree does */
static void fas_free(void *user, int worker, void *p)
{
    fas_sync(worker);
    fake_free(user, worker, p);
}
/* the matrix's host <-> device conversion: the host may touch a worker's buffer once that worker's stream is done
   (its own stream only: the peers' reads of it must be behind that stream already) */
static void fas_code(void *buf, size_t bytes)
{
    int q, owner = -1;
    for (q = 0; q < fas.n; q++)
        if (fdev.own[q] && (const char *)buf >= fdev.own[q] && (const char *)buf < fdev.own[q] + fdev.own_bytes)
            owner = q;
    if (owner >= 0) fas_sync(owner);
    else
        for (q = 0; q < fas.n; q++) fas_sync(q);
    fake_code(buf, bytes);
}
static dpar_comm_desc fas_desc(int n, int peer_access)
{
    dpar_comm_desc d = fake_desc(n, peer_access);
    int q;
    memset(&fas, 0, sizeof fas);
    pthread_mutex_init(&fas.lock, NULL);
    pthread_cond_init(&fas.cond, NULL);
    fas.n = n;
    for (q = 0; q < n; q++) {
        fas.s[q].rng = 0x9e3779b97f4a7c15ull * (uint64_t)(q + 1);
        pthread_create(&fas.s[q].thread, NULL, fas_main, &fas.s[q]);
    }
    d.memory.reduce = fas_reduce;
    d.memory.divide = fas_divide;
    d.memory.copy = fas_copy;
    d.memory.free = fas_free;
    d.memory.record = fas_record;
    d.memory.wait = fas_wait;
    d.memory.clear = fas_clear;
    d.memory.update = fas_update;
    d.memory.to_host = fas_to_host;
    d.memory.from_host = fas_from_host;
    return d;
}
static void fas_stop(void)
{
    int q;
    pthread_mutex_lock(&fas.lock);
    fas.stop = 1;
    pthread_cond_broadcast(&fas.cond);
    pthread_mutex_unlock(&fas.lock);
    for (q = 0; q < fas.n; q++) pthread_join(fas.s[q].thread, NULL);
    pthread_mutex_destroy(&fas.lock);
    pthread_cond_destroy(&fas.cond);
}

/* every collective, dtype and op over the asynchronous device, peers read directly and through staging: the
   results as the serial reference's, with the host never waiting inside a call (the streams run behind it) */
static void test_memory_async_matrix(void)
{
    static const int ns[] = {2, 3, 4};
    static const dpar_algo algos[] = {DPAR_ALGO_AUTO, DPAR_ALGO_RING, DPAR_ALGO_ONESHOT};
    char *bufs[8];
    int ni, pa, q, t, op, ci, ai;
    char *block = (char *)malloc(8 * 5000 * 8);
    for (q = 0; q < 8; q++) bufs[q] = block + (size_t)q * 5000 * 8;
    for (pa = 1; pa >= 0; pa--)
        for (ni = 0; ni < 3; ni++)
            for (ai = 0; ai < 3; ai++) {
                int N = ns[ni], fails = 0;
                size_t counts[3];
                dpar_comm_desc d = fas_desc(N, pa);
                d.algo = algos[ai];
                if (!pa) d.memory.combine = fas_combine; /* staged reads with combine here; the other matrix: direct */
                for (q = 0; q < N; q++) fdev.own[q] = bufs[2 * q]; /* send and recv of worker q: one block */
                fdev.own_bytes = 2 * 5000 * 8;
                counts[0] = 1;
                counts[1] = (size_t)N + 1;
                counts[2] = 5000;
                for (ci = 0; ci < 3; ci++) {
                    matrix_case m;
                    memset(&m, 0, sizeof m);
                    m.count = counts[ci];
                    m.device = fas_code;
                    for (q = 0; q < N; q++) {
                        m.send[q] = bufs[2 * q];
                        m.recv[q] = bufs[2 * q + 1];
                    }
                    for (t = 0; t < DPAR_DTYPE_COUNT; t++) {
                        m.t = (dpar_dtype)t;
                        m.root = (int)(counts[ci] % (size_t)N);
                        for (op = 0; op < DPAR_OP_COUNT; op += ci == 2 ? 1 : 2) {
                            m.op = (dpar_op)op;
                            fails += run_world_desc(N, &d, matrix_rank, &m, NULL, 0);
                        }
                        m.op = DPAR_SUM;
                        fails += run_world_desc(N, &d, movement_rank, &m, NULL, 0);
                    }
                }
                fas_stop();
                CHECK_MSG(fails == 0, "N=%d peer_access=%d algo=%s: %d failures", N, pa, dpar_algo_name(algos[ai]),
                          fails);
                CHECK(!fdev.bad_worker);
                CHECK(!fdev.peer_read);
                CHECK(fas.records > 0 && fas.waits > 0 && fas.queued_ops > 0);
                CHECK_MSG(algos[ai] == DPAR_ALGO_RING || (pa ? fdev.combines == 0 : fdev.combines > 0),
                          "N=%d peer_access=%d algo=%s: combines=%ld", N, pa, dpar_algo_name(algos[ai]), fdev.combines);
                CHECK_MSG(fdev.allocs == fdev.frees, "%ld allocations, %ld frees", fdev.allocs, fdev.frees);
            }
    free(block);
}

/* the host does not wait for the device inside a call: every stream is held (runs nothing) for 1 s; each rank's
   allreduce must return within it, its stream having run nothing yet, and the results are right once it has */
static void async_host_rank(world *w, dpar_comm *c, int r)
{
    enum { n = 12000 }; /* 48 KB: the ring, a few segments per chunk */
    float *x = (float *)w->user + (size_t)r * n;
    uint64_t ran;
    int i, held;
    for (i = 0; i < n; i++) x[i] = (float)(r + 1) * (float)(i % 13);
    fake_code(x, n * sizeof(float));
    expect_ok(w, dpar_allreduce(c, x, x, n, DPAR_F32, DPAR_SUM), "allreduce", r);
    pthread_mutex_lock(&fas.lock);
    ran = fas.s[r].done;
    held = fas.hold;
    pthread_mutex_unlock(&fas.lock);
    if (!held || ran != 0)
        note(w, "rank %d: the call returned %s, its stream having run %llu ops", r,
             held ? "while the streams were held" : "after the streams' hold (1 s)", (unsigned long long)ran);
    fas_sync(r);
    fake_code(x, n * sizeof(float));
    for (i = 0; i < n; i++)
        if (x[i] != (float)(w->n * (w->n + 1) / 2) * (float)(i % 13)) {
            note(w, "rank %d element %d: %g, want %g", r, i, x[i], (double)(w->n * (w->n + 1) / 2) * (i % 13));
            break;
        }
}
static void *fas_release_hold(void *arg)
{
    struct timespec hold = {1, 0};
    (void)arg;
    nanosleep(&hold, NULL);
    pthread_mutex_lock(&fas.lock);
    fas.hold = 0;
    pthread_cond_broadcast(&fas.cond);
    pthread_mutex_unlock(&fas.lock);
    return NULL;
}
static void test_memory_async_host_does_not_wait(void)
{
    enum { N = 3, n = 12000 };
    float *x = (float *)malloc(sizeof(float) * N * n);
    dpar_comm_desc d = fas_desc(N, 1);
    pthread_t timer;
    dpar_group *g = NULL;
    { /* record and wait go together */
        dpar_comm_desc half = d;
        half.memory.wait = NULL;
        CHECK(dpar_group_create(&half, &g) == DPAR_EINVAL && g == NULL);
        CHECK(strstr(dpar_last_error(), "go together") != NULL);
        half = d;
        memset(&half.memory, 0, sizeof half.memory);
        half.memory.record = fas_record;
        half.memory.wait = fas_wait;
        CHECK(dpar_group_create(&half, &g) == DPAR_EINVAL && g == NULL);
    }
    d.algo = DPAR_ALGO_RING;
    d.timeout_ms = 20000;
    pthread_mutex_lock(&fas.lock);
    fas.hold = 1;
    pthread_mutex_unlock(&fas.lock);
    pthread_create(&timer, NULL, fas_release_hold, NULL);
    CHECK(run_world_desc(N, &d, async_host_rank, x, NULL, 0) == 0);
    pthread_join(timer, NULL);
    CHECK(fas.queued_ops > 0 && fas.waits > 0);
    fas_stop();
    free(x);
}

/* a queued op fails on worker 1's stream (a kernel's fault, found later): that worker's next callback returns it,
   and every rank's call returns it with its text, at once. Each step ends as a training step does, with the host
   waiting for its stream. After an error a peer's stream may still read a rank's buffer (the calls gave up on the
   host): the buffers are freed once every stream has run out (fas_stop), as a program would synchronise every
   worker's stream before freeing. */
static void async_fail_rank(world *w, dpar_comm *c, int r)
{
    float *x = (float *)w->user + (size_t)r * 8192;
    double t0 = dt_now();
    int i;
    for (i = 0; i < 50 && mem_fail.st[r] == DPAR_OK; i++) {
        mem_fail.st[r] = dpar_allreduce(c, x, x, 8192, DPAR_F32, DPAR_SUM);
        fas_sync(r);
    }
    snprintf(mem_fail.msg[r], sizeof mem_fail.msg[r], "%s", dpar_last_error());
    mem_fail.seconds[r] = dt_now() - t0;
}
static void test_memory_async_failure_reaches_every_rank(void)
{
    dpar_comm_desc d = fas_desc(4, 1);
    float *x = (float *)calloc(4 * 8192, sizeof(float));
    int r;
    memset(&mem_fail, 0, sizeof mem_fail);
    d.timeout_ms = 10000;
    fdev.fail_worker = 1;
    fdev.fail_at = 30;
    fake_code(x, 4 * 8192 * sizeof(float));
    run_world_desc(4, &d, async_fail_rank, x, NULL, 0);
    fas_stop();
    free(x);
    for (r = 0; r < 4; r++) {
        CHECK_MSG(mem_fail.st[r] == DPAR_ESYSTEM && mem_fail.seconds[r] < 5.0, "rank %d: %s after %.2f s", r,
                  dpar_status_string(mem_fail.st[r]), mem_fail.seconds[r]);
        CHECK_MSG(strstr(mem_fail.msg[r], "fake device fault on worker 1") != NULL, "rank %d: '%s'", r,
                  mem_fail.msg[r]);
    }
    CHECK_MSG(strstr(mem_fail.msg[0], "rank 1") != NULL, "'%s' does not name rank 1", mem_fail.msg[0]);
}

/* the rest of part 1's calls over the asynchronous device: two requests in flight at once (their progress thread
   queues on the worker's stream), gradient buckets, send/recv around the ring, and a split comm's allreduce; the
   results as closed formulas, read once the owner's stream has run */
enum { AM_A = 9000, AM_B = 100, AM_G = 20000, AM_S = 1000, AM_X = 4000 }; /* floats per rank of each part */
#define AM_FLOATS (AM_A + AM_B + AM_G + 2 * AM_S + AM_X)
static void async_more_rank(world *w, dpar_comm *c, int r)
{
    float *a = (float *)w->user + (size_t)r * AM_FLOATS, *b = a + AM_A, *g = b + AM_B, *s = g + AM_G, *v = s + AM_S;
    float *x = v + AM_S;
    int N = w->n, i, q;
    dpar_request *ra = NULL, *rb = NULL;
    dpar_buckets *bk = NULL;
    dpar_buckets_desc bd;
    dpar_comm *sub = NULL;
    for (i = 0; i < AM_A; i++) a[i] = (float)(r + 1) * (float)(i % 11);
    for (i = 0; i < AM_B; i++) b[i] = (float)(r * 100 + i);
    for (i = 0; i < AM_G; i++) g[i] = (float)((r + i) % 7);
    for (i = 0; i < AM_S; i++) s[i] = (float)(r * 1000 + i);
    for (i = 0; i < AM_X; i++) x[i] = (float)(r + i);
    fas_code(a, (size_t)AM_FLOATS * sizeof(float)); /* every part into the device's form */
    /* the ring (36 KB) and the one-shot (400 B), both in flight */
    expect_ok(w, dpar_iallreduce(c, a, a, AM_A, DPAR_F32, DPAR_SUM, &ra), "iallreduce (ring)", r);
    expect_ok(w, dpar_iallreduce(c, b, b, AM_B, DPAR_F32, DPAR_SUM, &rb), "iallreduce (one-shot)", r);
    expect_ok(w, ra ? dpar_request_wait(ra) : DPAR_EINVAL, "request_wait (ring)", r);
    expect_ok(w, rb ? dpar_request_wait(rb) : DPAR_EINVAL, "request_wait (one-shot)", r);
    /* buckets of 16 KiB, marked ready from the end as backward would */
    memset(&bd, 0, sizeof bd);
    bd.comm = c, bd.grads = g, bd.count = AM_G, bd.bucket_bytes = 16384, bd.op = DPAR_SUM;
    expect_ok(w, dpar_buckets_create(&bd, &bk), "buckets_create", r);
    for (q = 3; q >= 0 && bk; q--) expect_ok(w, dpar_buckets_ready(bk, (size_t)q * 5000, 5000), "buckets_ready", r);
    if (bk) expect_ok(w, dpar_buckets_wait(bk), "buckets_wait", r);
    dpar_buckets_destroy(bk);
    /* send to the next rank, receive from the previous one */
    expect_ok(w, dpar_sendrecv(c, s, AM_S, (r + 1) % N, v, AM_S, (r + N - 1) % N, DPAR_F32, 7), "sendrecv", r);
    /* a split by parity: the sub comm keeps each thread's worker (16 KB: its one-shot, with combine) */
    expect_ok(w, dpar_comm_split(c, r % 2, r, &sub), "split", r);
    if (sub) expect_ok(w, dpar_allreduce(sub, x, x, AM_X, DPAR_F32, DPAR_SUM), "sub allreduce", r);
    dpar_comm_destroy(sub);
    fas_code(a, (size_t)AM_FLOATS * sizeof(float)); /* waits for this rank's stream */
    for (i = 0; i < AM_A; i++)
        if (a[i] != (float)(N * (N + 1) / 2) * (float)(i % 11)) {
            note(w, "rank %d iallreduce (ring) element %d: %g", r, i, a[i]);
            break;
        }
    for (i = 0; i < AM_B; i++)
        if (b[i] != (float)(100 * N * (N - 1) / 2 + N * i)) {
            note(w, "rank %d iallreduce (one-shot) element %d: %g", r, i, b[i]);
            break;
        }
    for (i = 0; i < AM_G; i++) {
        float want = 0;
        for (q = 0; q < N; q++) want += (float)((q + i) % 7);
        if (g[i] != want) {
            note(w, "rank %d bucket element %d: %g, want %g", r, i, g[i], want);
            break;
        }
    }
    for (i = 0; i < AM_S; i++)
        if (v[i] != (float)(((r + N - 1) % N) * 1000 + i)) {
            note(w, "rank %d recv element %d: %g", r, i, v[i]);
            break;
        }
    for (i = 0; i < AM_X; i++) {
        float want = 0;
        for (q = r % 2; q < N; q += 2) want += (float)(q + i);
        if (x[i] != want) {
            note(w, "rank %d sub allreduce element %d: %g, want %g", r, i, x[i], want);
            break;
        }
    }
}
static void test_memory_async_requests_buckets_p2p_split(void)
{
    int pa, N;
    for (pa = 2; pa >= 0; pa--) /* peers readable: those of the same parity, all, none */
        for (N = 3; N <= 4; N++) {
            float *block = (float *)calloc((size_t)N * AM_FLOATS, sizeof(float));
            dpar_comm_desc d = fas_desc(N, pa);
            int q;
            d.memory.combine = pa ? fas_combine : NULL;
            for (q = 0; q < N; q++) fdev.own[q] = (const char *)(block + (size_t)q * AM_FLOATS);
            fdev.own_bytes = (size_t)AM_FLOATS * sizeof(float);
            CHECK_MSG(run_world_desc(N, &d, async_more_rank, block, NULL, 0) == 0, "N=%d peer_access=%d", N, pa);
            fas_stop();
            CHECK(!fdev.bad_worker && !fdev.peer_read);
            CHECK(fas.records > 0 && fas.waits > 0);
            CHECK_MSG(fdev.allocs == fdev.frees, "%ld allocations, %ld frees", fdev.allocs, fdev.frees);
            free(block);
        }
}

/* the contract checker, the timeout naming the missing rank, abort and a bad argument, on stream-ordered memory:
   the same errors, texts and times as on host memory */
static void test_memory_async_mismatches_and_timeouts(void) { mismatch_kinds(1); }

/* ---- dpar_comm_from_ops: a comm whose collectives another library runs; the "library" here is an inner
   threads comm, so the whole matrix can check it against the serial references ---- */
typedef struct {
    dpar_comm *inner;
    long runs, exchanges, groups; /* groups: run_group calls (their calls count as runs too) */
    uint64_t fail_at;             /* run of this collective number fails (0: none) */
    int destroyed;
    int device; /* the inner comm's buffers are the fake device's: the exchange stages through its memory, as an
                   NCCL library's does through the GPU's */
} lib_rank;
static dpar_status lib_run(void *user, const dpar_comm_call *k)
{
    lib_rank *l = (lib_rank *)user;
    l->runs++;
    if (k->seq == l->fail_at)
        return dpar_set_error(DPAR_ESYSTEM, "the library broke in call #%llu", (unsigned long long)k->seq);
    switch (k->coll) {
    case DPAR_COLL_BARRIER: return dpar_barrier(l->inner);
    case DPAR_COLL_BROADCAST: return dpar_broadcast(l->inner, k->send, k->recv, k->count, k->dtype, k->root);
    case DPAR_COLL_REDUCE: return dpar_reduce(l->inner, k->send, k->recv, k->count, k->dtype, k->op, k->root);
    case DPAR_COLL_REDUCE_SCATTER: return dpar_reduce_scatter(l->inner, k->send, k->recv, k->count, k->dtype, k->op);
    case DPAR_COLL_ALLGATHER: return dpar_allgather(l->inner, k->send, k->recv, k->count, k->dtype);
    case DPAR_COLL_ALLREDUCE: return dpar_allreduce(l->inner, k->send, k->recv, k->count, k->dtype, k->op);
    case DPAR_COLL_ALLTOALL: return dpar_alltoall(l->inner, k->send, k->recv, k->count, k->dtype);
    case DPAR_COLL_ALLTOALLV:
        return dpar_alltoallv(l->inner, k->send, k->sendcounts, k->sdispls, k->recv, k->recvcounts, k->rdispls,
                              k->dtype);
    default: return dpar_set_error(DPAR_EINVAL, "lib_run: call %d", (int)k->coll);
    }
}
static dpar_status lib_exchange(void *user, const void *mine, void *all, size_t bytes, uint64_t deadline_ns)
{
    lib_rank *l = (lib_rank *)user;
    size_t N = (size_t)dpar_comm_size(l->inner);
    char *dmine, *dall, *decoded;
    dpar_status st;
    (void)deadline_ns;
    l->exchanges++;
    if (!l->device) return dpar_allgather(l->inner, mine, all, bytes * N, DPAR_U8);
    dmine = (char *)malloc(bytes + 1), dall = (char *)malloc(N * bytes + 1);
    memcpy(dmine, mine, bytes);
    fake_code(dmine, bytes);
    st = dpar_allgather(l->inner, dmine, dall, bytes * N, DPAR_U8);
    decoded = (char *)fake_read(dall, N * bytes);
    if (st == DPAR_OK) memcpy(all, decoded, N * bytes);
    free(dmine), free(dall), free(decoded);
    return st;
}
static void lib_destroy(void *user) { ((lib_rank *)user)->destroyed = 1; }
/* the library's comm over inner with desc d (name "lib"); run_group: the batch callback, or NULL */
static dpar_comm *lib_comm_with(lib_rank *l, dpar_comm *inner, dpar_comm_desc d,
                                dpar_status (*run_group)(void *, const dpar_comm_call *, int))
{
    dpar_comm_ops ops;
    dpar_comm *c = NULL;
    memset(l, 0, sizeof *l);
    memset(&ops, 0, sizeof ops);
    l->inner = inner;
    ops.user = l;
    ops.rank = dpar_comm_rank(inner);
    ops.size = dpar_comm_size(inner);
    ops.run = lib_run;
    ops.exchange = lib_exchange;
    ops.destroy = lib_destroy;
    ops.run_group = run_group;
    d.name = "lib";
    return dpar_comm_from_ops(&ops, &d, &c) == DPAR_OK ? c : NULL;
}
static dpar_comm *lib_comm(lib_rank *l, dpar_comm *inner, int no_check)
{
    dpar_comm_desc d;
    memset(&d, 0, sizeof d);
    d.no_check = no_check;
    return lib_comm_with(l, inner, d, NULL);
}
static void ops_matrix_rank(world *w, dpar_comm *inner, int r)
{
    lib_rank l;
    dpar_comm *c = lib_comm(&l, inner, 0);
    dpar_comm_stats st;
    if (!c) {
        note(w, "rank %d: dpar_comm_from_ops: %s", r, dpar_last_error());
        return;
    }
    movement_rank(w, c, r);
    matrix_rank(w, c, r);
    if (dpar_comm_stats_get(c, &st) != DPAR_OK || st.by_coll[DPAR_COLL_ALLREDUCE].calls != 2)
        note(w, "rank %d: %llu allreduce calls counted", r, (unsigned long long)st.by_coll[DPAR_COLL_ALLREDUCE].calls);
    /* one exchange per run, but two for each of movement_rank's 3 alltoallv (the counts too) and two for its count
       helper (an alltoall of host words through the exchange, no run) */
    if (l.runs < 10 || l.exchanges != l.runs + 3 + 2)
        note(w, "rank %d: %ld runs, %ld exchanges", r, l.runs, l.exchanges);
    dpar_comm_destroy(c);
    if (!l.destroyed) note(w, "rank %d: ops.destroy not called", r);
}
static void test_ops_comm_runs_the_matrix(void)
{
    int ni, t;
    char *bufs[16];
    for (t = 0; t < 16; t++) bufs[t] = (char *)malloc(2000 * 8);
    for (ni = 0; ni < 5; ni++) { /* N = 1 too: the library gets every call */
        int N = Ns[ni], fails = 0, q;
        for (t = 0; t < DPAR_DTYPE_COUNT; t++) {
            matrix_case m;
            memset(&m, 0, sizeof m);
            m.count = 1999;
            m.t = (dpar_dtype)t;
            m.op = t == DPAR_U8 ? DPAR_MAX : DPAR_SUM;
            m.root = N - 1;
            for (q = 0; q < N; q++) m.send[q] = bufs[2 * q], m.recv[q] = bufs[2 * q + 1];
            fails += run_world(N, ops_matrix_rank, &m);
        }
        CHECK_MSG(fails == 0, "N=%d: %d failures", N, fails);
    }
    for (t = 0; t < 16; t++) free(bufs[t]);
}

/* the contract check through the library: a rank in another collective fails every rank, naming both;
   a failed run returns its text and poisons this rank's comm; point-to-point and split are refused */
static void ops_errors_rank(world *w, dpar_comm *inner, int r)
{
    lib_rank l;
    dpar_comm *c = lib_comm(&l, inner, 0), *sub = NULL;
    float x[64];
    dpar_status st;
    memset(x, 0, sizeof x);
    if (!c) return;
    st = r == 1 ? dpar_broadcast(c, x, x, 64, DPAR_F32, 0) : dpar_allreduce(c, x, x, 64, DPAR_F32, DPAR_SUM);
    if (st != DPAR_EMISMATCH || !strstr(dpar_last_error(), "broadcast") || !strstr(dpar_last_error(), "allreduce"))
        note(w, "rank %d: mismatch gave %s: %s", r, dpar_status_string(st), dpar_last_error());
    dpar_comm_destroy(c);
    c = lib_comm(&l, inner, 1);
    l.fail_at = 2;
    if ((st = dpar_allreduce(c, x, x, 64, DPAR_F32, DPAR_SUM)) != DPAR_OK) note(w, "rank %d: %s", r, dpar_last_error());
    st = dpar_allreduce(c, x, x, 64, DPAR_F32, DPAR_SUM);
    if (st != DPAR_ESYSTEM || !strstr(dpar_last_error(), "the library broke in call #2"))
        note(w, "rank %d: a failed run gave %s: %s", r, dpar_status_string(st), dpar_last_error());
    if (dpar_allreduce(c, x, x, 64, DPAR_F32, DPAR_SUM) != DPAR_ESYSTEM || l.runs != 2)
        note(w, "rank %d: the poison did not stay (%ld runs)", r, l.runs);
    dpar_comm_destroy(c);
    c = lib_comm(&l, inner, 1);
    if (dpar_send(c, x, 4, DPAR_F32, (r + 1) % w->n, 0) != DPAR_EUNSUPPORTED) note(w, "rank %d: send accepted", r);
    if (dpar_comm_split(c, 0, r, &sub) != DPAR_EUNSUPPORTED || sub) note(w, "rank %d: split accepted", r);
    dpar_comm_destroy(c);
}
static void test_ops_comm_errors(void)
{
    dpar_comm_ops ops;
    dpar_comm *c = NULL;
    dpar_comm_desc d;
    memset(&d, 0, sizeof d);
    d.no_check = 1; /* the library checks nothing itself (as NCCL): the mismatch is dpar's to catch */
    d.timeout_ms = 3000;
    CHECK(run_world_desc(3, &d, ops_errors_rank, NULL, NULL, 0) == 0);
    memset(&ops, 0, sizeof ops);
    memset(&d, 0, sizeof d);
    ops.run = lib_run;
    ops.size = 2;
    ops.rank = 0;
    CHECK(dpar_comm_from_ops(&ops, NULL, &c) == DPAR_EINVAL && !c); /* no exchange, checker on */
    d.no_check = 1;
    ops.rank = 2;
    CHECK(dpar_comm_from_ops(&ops, &d, &c) == DPAR_EINVAL && !c); /* rank outside 0..size-1 */
    ops.rank = 1;
    d.deterministic = 1;
    CHECK(dpar_comm_from_ops(&ops, &d, &c) == DPAR_EINVAL && !c);
    d.deterministic = 0;
    d.memory.reduce = fake_reduce; /* one of the seven memory callbacks */
    CHECK(dpar_comm_from_ops(&ops, &d, &c) == DPAR_EINVAL && !c && strstr(dpar_last_error(), "1 of 7"));
    d.memory = fake_desc(2, 1).memory; /* the seven, with to_host but not from_host */
    d.memory.enter = NULL, d.memory.peer_access = NULL, d.memory.from_host = NULL;
    CHECK(dpar_comm_from_ops(&ops, &d, &c) == DPAR_EINVAL && !c && strstr(dpar_last_error(), "go together"));
    memset(&d.memory, 0, sizeof d.memory);
    d.memory.combine = fake_combine; /* dpar's one-shot never runs there: the library runs the collectives */
    CHECK(dpar_comm_from_ops(&ops, &d, &c) == DPAR_EINVAL && !c && strstr(dpar_last_error(), "combine"));
    memset(&d.memory, 0, sizeof d.memory);
    CHECK(dpar_comm_from_ops(&ops, &d, &c) == DPAR_OK && c);
    CHECK(dpar_comm_destroy(c) == DPAR_OK);
}

/* ---- dpar_zero and dpar_fsdp on device memory: the same training on host memory, the fake blocking device and the
   fake stream-ordered one; the parameters after FC_STEPS steps bitwise equal. The host may touch a device buffer
   (here: to compute a unit's gradients from its parameters) only after its worker's stream is done. */
typedef struct {
    int device; /* 0: host memory; 1: the fake device; 2: the fake stream-ordered device; 3: the fake device under
                   a comm another library runs (dpar_comm_from_ops, desc.memory the fake's callbacks) */
    int stage;  /* 1: dpar_zero; 2, 3: dpar_fsdp */
    dpar_optim kind;
    float *out[4][FC_U]; /* each rank's parameters after the steps, host memory */
    /* a checkpoint after step DEVOPT_CK (ckpt_save non-NULL): saved there, the object made again over scribbled
       parameters, and loaded from ckpt_load (another run's: the same state, if both are right) */
    const char *ckpt_save, *ckpt_load;
} devopt_job;
enum { DEVOPT_CK = 3 };
/* host bytes into device memory and back (host memory: a copy) */
static void devopt_in(const devopt_job *j, int r, void *dev, const void *host, size_t bytes)
{
    if (j->device == 2) fas_sync(r);             /* what the stream queued on the buffer (a clear) has run */
    if (j->device) fake_write(dev, host, bytes); /* encoded where the device keeps the bytes */
    else memcpy(dev, host, bytes);
}
static void devopt_out(const devopt_job *j, int r, void *host, const void *dev, size_t bytes)
{
    void *decoded;
    if (j->device == 2) fas_sync(r);
    if (!j->device) {
        memcpy(host, dev, bytes);
        return;
    }
    decoded = fake_read(dev, bytes); /* the key is the device address's */
    memcpy(host, decoded, bytes);
    free(decoded);
}
static void devopt_train(world *w, dpar_comm *c, int r);
static void devopt_rank(world *w, dpar_comm *inner, int r)
{
    devopt_job *j = (devopt_job *)w->user;
    lib_rank l;
    dpar_comm *c = NULL;
    dpar_comm_desc d;
    if (j->device != 3) {
        devopt_train(w, inner, r);
        return;
    }
    memset(&d, 0, sizeof d);
    d.memory.reduce = fake_reduce, d.memory.divide = fake_divide, d.memory.copy = fake_copy;
    d.memory.alloc = fake_alloc, d.memory.free = fake_free, d.memory.clear = fake_clear, d.memory.update = fake_update;
    d.memory.to_host = fake_to_host, d.memory.from_host = fake_from_host;
    d.no_check = 1;
    if (!(c = lib_comm_with(&l, inner, d, NULL))) {
        note(w, "rank %d: from_ops with memory: %s", r, dpar_last_error());
        return;
    }
    l.device = 1;
    devopt_train(w, c, r);
    if (l.runs < 3) note(w, "rank %d: the library ran %ld collectives", r, l.runs);
    dpar_comm_destroy(c);
}
static void devopt_train(world *w, dpar_comm *c, int r)
{
    devopt_job *j = (devopt_job *)w->user;
    size_t total = 0, i, at[FC_U + 1];
    float *host = NULL, *hgrad = NULL, *dev = NULL, *dgrad = NULL, s[FC_U];
    int u, step;
    for (u = 0; u < FC_U; u++) at[u] = total, total += fc_counts[u];
    at[FC_U] = total;
    host = (float *)malloc(total * 4), hgrad = (float *)malloc(total * 4);
    dev = (float *)malloc(total * 4), dgrad = (float *)malloc(total * 4); /* "device memory" */
    for (u = 0; u < FC_U; u++)
        for (i = 0; i < fc_counts[u]; i++) host[at[u] + i] = fc_init(u, i);
    devopt_in(j, r, dev, host, total * 4);
    if (j->stage == 1) { /* ZeRO-1 on the flat array: gradients from the parameters, reduce-scatter, step, gather */
        dpar_zero *z = NULL;
        dpar_zero_desc d;
        memset(&d, 0, sizeof d);
        d.comm = c, d.count = total, d.kind = j->kind, d.lr = 0.05f, d.momentum = 0.9f, d.weight_decay = 0.01f;
        expect_ok(w, dpar_zero_create(&d, &z), "zero_create", r);
        for (step = 0; z && step < FC_STEPS; step++) {
            if (step == DEVOPT_CK && j->ckpt_save) {
                expect_ok(w, dpar_ckpt_save_zero(z, dev, j->ckpt_save, NULL, NULL, 0), "save_zero", r);
                expect_ok(w, dpar_zero_destroy(z), "zero_destroy", r);
                z = NULL;
                memset(host, 0, total * 4);
                devopt_in(j, r, dev, host, total * 4);
                expect_ok(w, dpar_zero_create(&d, &z), "zero_create", r);
                if (!z) break;
                expect_ok(w, dpar_ckpt_load_zero(z, dev, j->ckpt_load, NULL, NULL, 0), "load_zero", r);
            }
            devopt_out(j, r, host, dev, total * 4);
            for (u = 0; u < FC_U; u++) {
                s[u] = fc_forward(host + at[u], r, step, u);
                fc_backward(hgrad + at[u], host + at[u], s[u], r, step, u);
            }
            devopt_in(j, r, dgrad, hgrad, total * 4);
            expect_ok(w, dpar_zero_step(z, dev, dgrad), "zero_step", r);
        }
        expect_ok(w, dpar_zero_destroy(z), "zero_destroy", r);
    } else { /* FSDP: each unit gathered for forward and backward, its gradients reduced, the step */
        dpar_fsdp *f = NULL;
        dpar_fsdp_desc d;
        float *pp, *gg;
        memset(&d, 0, sizeof d);
        d.comm = c, d.stage = j->stage, d.num_units = FC_U, d.unit_counts = fc_counts, d.kind = j->kind;
        d.lr = 0.05f, d.momentum = 0.9f, d.weight_decay = 0.01f;
        expect_ok(w, dpar_fsdp_create(&d, &f), "fsdp_create", r);
        for (u = 0; f && u < FC_U; u++) expect_ok(w, dpar_fsdp_set_params(f, u, dev + at[u]), "set_params", r);
        for (step = 0; f && step < FC_STEPS; step++) {
            if (step == DEVOPT_CK && j->ckpt_save) {
                expect_ok(w, dpar_ckpt_save_fsdp(f, j->ckpt_save, NULL, NULL, 0), "save_fsdp", r);
                expect_ok(w, dpar_fsdp_destroy(f), "fsdp_destroy", r);
                f = NULL;
                memset(host, 0, total * 4);
                devopt_in(j, r, dev, host, total * 4);
                expect_ok(w, dpar_fsdp_create(&d, &f), "fsdp_create", r);
                if (!f) break;
                for (u = 0; u < FC_U; u++) expect_ok(w, dpar_fsdp_set_params(f, u, dev + at[u]), "set_params", r);
                expect_ok(w, dpar_ckpt_load_fsdp(f, j->ckpt_load, NULL, NULL, 0), "load_fsdp", r);
            }
            for (u = 0; u < FC_U; u++) {
                expect_ok(w, dpar_fsdp_gather(f, u, &pp), "gather", r);
                devopt_out(j, r, host, pp, fc_counts[u] * 4);
                s[u] = fc_forward(host, r, step, u);
                expect_ok(w, dpar_fsdp_release(f, u), "release", r);
            }
            for (u = FC_U - 1; u >= 0; u--) {
                if (step == 2 && u == 1) continue; /* a unit without gradients this step: its shard's are zero */
                expect_ok(w, dpar_fsdp_gather(f, u, &pp), "gather", r);
                devopt_out(j, r, host, pp, fc_counts[u] * 4);
                fc_backward(hgrad, host, s[u], r, step, u);
                expect_ok(w, dpar_fsdp_release(f, u), "release", r);
                expect_ok(w, dpar_fsdp_grads(f, u, &gg), "grads", r);
                devopt_in(j, r, gg, hgrad, fc_counts[u] * 4);
                expect_ok(w, dpar_fsdp_reduce(f, u), "reduce", r);
            }
            expect_ok(w, dpar_fsdp_step(f), "step", r);
        }
        for (u = 0; f && u < FC_U; u++) expect_ok(w, dpar_fsdp_get_params(f, u, dev + at[u]), "get_params", r);
        expect_ok(w, dpar_fsdp_destroy(f), "fsdp_destroy", r);
    }
    devopt_out(j, r, host, dev, total * 4);
    for (u = 0; u < FC_U; u++) memcpy(j->out[r][u], host + at[u], fc_counts[u] * 4);
    free(host), free(hgrad), free(dev), free(dgrad);
}
static void test_zero_and_fsdp_on_device_memory(void)
{
    static const int ns[] = {1, 3, 4};
    devopt_job job[4], ck;
    int ni, stage, kind, dv, r, u;
    char dir[] = "/tmp/dpar_devckpt_XXXXXX", paths[4][300], cmd[400];
    CHECK(mkdtemp(dir) != NULL);
    for (dv = 0; dv < 4; dv++) snprintf(paths[dv], sizeof paths[dv], "%s/dev%d", dir, dv);
    for (r = 0; r < 4; r++)
        for (u = 0; u < FC_U; u++) ck.out[r][u] = (float *)malloc(fc_counts[u] * 4);
    for (dv = 0; dv < 4; dv++)
        for (r = 0; r < 4; r++)
            for (u = 0; u < FC_U; u++) job[dv].out[r][u] = (float *)malloc(fc_counts[u] * 4);
    for (ni = 0; ni < 3; ni++)
        for (stage = 1; stage <= 3; stage++)
            for (kind = 0; kind < 2; kind++) {
                int N = ns[ni];
                for (dv = 0; dv < 4; dv++) {
                    dpar_comm_desc d;
                    if (dv == 0) memset(&d, 0, sizeof d);
                    else d = dv == 2 ? fas_desc(N, 1) : fake_desc(N, 1);
                    job[dv].device = dv, job[dv].stage = stage, job[dv].kind = (dpar_optim)kind;
                    job[dv].ckpt_save = job[dv].ckpt_load = NULL;
                    CHECK_MSG(run_world_desc(N, &d, devopt_rank, &job[dv], NULL, 0) == 0, "N=%d stage %d %s device %d",
                              N, stage, kind ? "adam" : "sgd", dv);
                    if (dv == 2) fas_stop();
                    if (dv) CHECK_MSG(fdev.allocs == fdev.frees, "%ld allocations, %ld frees", fdev.allocs, fdev.frees);
                    if (dv) CHECK(!fdev.bad_worker);
                    for (r = 0; dv && r < N; r++)
                        for (u = 0; u < FC_U; u++)
                            CHECK_MSG(memcmp(job[dv].out[r][u], job[0].out[r][u], fc_counts[u] * 4) == 0,
                                      "N=%d stage %d %s device %d rank %d unit %d: not the host's bits", N, stage,
                                      kind ? "adam" : "sgd", dv, r, u);
                }
                /* checkpointed mid-way: device d saves to its file and loads device d - 1's (the host's own), so
                   host -> fake -> stream-ordered fake -> library comm; bitwise the training without a checkpoint */
                for (dv = 0; N == 3 && dv < 4; dv++) {
                    dpar_comm_desc d;
                    if (dv == 0) memset(&d, 0, sizeof d);
                    else d = dv == 2 ? fas_desc(N, 1) : fake_desc(N, 1);
                    ck.device = dv, ck.stage = stage, ck.kind = (dpar_optim)kind;
                    ck.ckpt_save = paths[dv], ck.ckpt_load = paths[dv ? dv - 1 : 0];
                    CHECK_MSG(run_world_desc(N, &d, devopt_rank, &ck, NULL, 0) == 0,
                              "checkpointed: N=%d stage %d %s device %d", N, stage, kind ? "adam" : "sgd", dv);
                    if (dv == 2) fas_stop();
                    if (dv) CHECK_MSG(fdev.allocs == fdev.frees, "%ld allocations, %ld frees", fdev.allocs, fdev.frees);
                    for (r = 0; r < N; r++)
                        for (u = 0; u < FC_U; u++)
                            CHECK_MSG(memcmp(ck.out[r][u], job[0].out[r][u], fc_counts[u] * 4) == 0,
                                      "checkpointed: N=%d stage %d %s device %d rank %d unit %d: not the bits of "
                                      "training without one",
                                      N, stage, kind ? "adam" : "sgd", dv, r, u);
                }
            }
    for (dv = 0; dv < 4; dv++)
        for (r = 0; r < 4; r++)
            for (u = 0; u < FC_U; u++) free(job[dv].out[r][u]), free(dv ? NULL : ck.out[r][u]);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

/* on device memory, what the device path lacks is refused, naming it; callbacks missing: refused too */
typedef struct {
    int missing; /* 0: the create refusals; 1: no clear/update; 2: no to_host/from_host; 3: to_host fails */
    char path[300];
} devref_job;
static void devopt_refusals_rank(world *w, dpar_comm *c, int r)
{
    float x[8];
    size_t one = 8;
    dpar_tensor t = {x, 8, DPAR_F32};
    dpar_zero_desc zd;
    dpar_fsdp_desc fd;
    dpar_zero *z = NULL;
    dpar_fsdp *f = NULL;
    const devref_job *j = (const devref_job *)w->user;
    int missing = j->missing;
    memset(&zd, 0, sizeof zd);
    zd.comm = c, zd.count = 8, zd.lr = 0.1f;
    memset(&fd, 0, sizeof fd);
    fd.comm = c, fd.num_units = 1, fd.unit_counts = &one, fd.lr = 0.1f;
    if (missing == 1) {
        if (dpar_zero_create(&zd, &z) != DPAR_EUNSUPPORTED || !strstr(dpar_last_error(), "no clear and update"))
            note(w, "rank %d: zero without update: %s", r, dpar_last_error());
        if (dpar_fsdp_create(&fd, &f) != DPAR_EUNSUPPORTED || !strstr(dpar_last_error(), "no clear and update"))
            note(w, "rank %d: fsdp without update: %s", r, dpar_last_error());
        return;
    }
    zd.params = &t, zd.grads = &t, zd.num_tensors = 1, zd.count = 0;
    if (dpar_zero_create(&zd, &z) != DPAR_EUNSUPPORTED || !strstr(dpar_last_error(), "the tensor form"))
        note(w, "rank %d: zero's tensor form: %s", r, dpar_last_error());
    fd.compute = DPAR_BF16;
    if (dpar_fsdp_create(&fd, &f) != DPAR_EUNSUPPORTED || !strstr(dpar_last_error(), "16-bit compute"))
        note(w, "rank %d: fsdp bf16: %s", r, dpar_last_error());
    fd.compute = DPAR_F32, fd.leaves = 4;
    if (dpar_fsdp_create(&fd, &f) != DPAR_EUNSUPPORTED || !strstr(dpar_last_error(), "leaves"))
        note(w, "rank %d: fsdp leaves: %s", r, dpar_last_error());
    fd.leaves = 0, fd.loss_scale = 8.0f;
    if (dpar_fsdp_create(&fd, &f) != DPAR_EUNSUPPORTED || !strstr(dpar_last_error(), "a loss scale"))
        note(w, "rank %d: fsdp loss scale: %s", r, dpar_last_error());
    fd.loss_scale = 0;
    expect_ok(w, dpar_fsdp_create(&fd, &f), "fsdp_create", r);
    zd.params = zd.grads = NULL, zd.num_tensors = 0, zd.count = 8;
    expect_ok(w, dpar_zero_create(&zd, &z), "zero_create", r);
    if (missing == 2) { /* no to_host / from_host: no checkpoints */
        if (f && (dpar_ckpt_save_fsdp(f, "/nonexistent/x", NULL, NULL, 0) != DPAR_EUNSUPPORTED ||
                  !strstr(dpar_last_error(), "no to_host and from_host")))
            note(w, "rank %d: a checkpoint of device shards: %s", r, dpar_last_error());
        if (z && (dpar_ckpt_load_zero(z, x, "/nonexistent/x", NULL, NULL, 0) != DPAR_EUNSUPPORTED ||
                  !strstr(dpar_last_error(), "no to_host and from_host")))
            note(w, "rank %d: a checkpoint of device state: %s", r, dpar_last_error());
    }
    if (missing == 3 && z) { /* worker 1's copy to host fails: every rank returns an error, none hangs */
        dpar_status st = dpar_ckpt_save_zero(z, x, j->path, NULL, NULL, 0);
        if (st == DPAR_OK || (r == 1 && (st != DPAR_ESYSTEM || !strstr(dpar_last_error(), "to_host failed"))))
            note(w, "rank %d: a failed copy to host gave %s: %s", r, dpar_status_string(st), dpar_last_error());
    }
    dpar_fsdp_destroy(f);
    dpar_zero_destroy(z);
}
static void test_zero_and_fsdp_on_device_refusals(void)
{
    devref_job job;
    dpar_group *g = NULL;
    dpar_comm_desc d;
    char dir[] = "/tmp/dpar_devckpt_XXXXXX", cmd[400];
    CHECK(mkdtemp(dir) != NULL);
    snprintf(job.path, sizeof job.path, "%s/x", dir);
    for (job.missing = 0; job.missing < 4; job.missing++) {
        d = fake_desc(2, 1);
        if (job.missing == 1) d.memory.clear = NULL, d.memory.update = NULL;
        if (job.missing == 2) d.memory.to_host = NULL, d.memory.from_host = NULL;
        if (job.missing == 3) fdev.fail_host_worker = 1;
        CHECK_MSG(run_world_desc(2, &d, devopt_refusals_rank, &job, NULL, 0) == 0, "case %d", job.missing);
        CHECK_MSG(fdev.allocs == fdev.frees, "%ld allocations, %ld frees", fdev.allocs, fdev.frees);
    }
    d = fake_desc(2, 1);
    d.memory.update = NULL; /* one of the pair */
    CHECK(dpar_group_create(&d, &g) == DPAR_EINVAL && g == NULL && strstr(dpar_last_error(), "update is missing"));
    d = fake_desc(2, 1);
    d.memory.from_host = NULL;
    CHECK(dpar_group_create(&d, &g) == DPAR_EINVAL && g == NULL && strstr(dpar_last_error(), "from_host is missing"));
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

/* a checkpoint whose staging fails on one rank (to_host in a save, from_host in a load): every rank returns an
   error at once, on a threads comm and on a library's comm (whose poison is the rank's own), the failing rank with
   its callback's text; the checkpoint's agreement tells the others */
typedef struct {
    int lib;     /* 1: a library's comm (dpar_comm_from_ops) over the threads comm, the fake device's callbacks */
    int failing; /* 0: save both checkpoints (nothing fails); 1: saves with to_host failing; 2: loads with from_host */
    char zpath[300], fpath[300];
    dpar_status st[3][2]; /* per rank: zero's status, fsdp's */
    char text[3][2][600];
    double seconds[3];
} devfail_job;
static void devfail_rank(world *w, dpar_comm *inner, int r)
{
    devfail_job *j = (devfail_job *)w->user;
    float params[8];
    size_t one = 8;
    int i;
    lib_rank l;
    dpar_comm *c = inner;
    dpar_zero_desc zd;
    dpar_fsdp_desc fd;
    dpar_zero *z = NULL;
    dpar_fsdp *f = NULL;
    double t0;
    if (j->lib) {
        dpar_comm_desc d;
        memset(&d, 0, sizeof d);
        d.memory.reduce = fake_reduce, d.memory.divide = fake_divide, d.memory.copy = fake_copy;
        d.memory.alloc = fake_alloc, d.memory.free = fake_free;
        d.memory.clear = fake_clear, d.memory.update = fake_update;
        d.memory.to_host = fake_to_host, d.memory.from_host = fake_from_host;
        d.no_check = 1;
        d.timeout_ms = 20000;
        if (!(c = lib_comm_with(&l, inner, d, NULL))) {
            note(w, "rank %d: from_ops with memory: %s", r, dpar_last_error());
            return;
        }
        l.device = 1;
    }
    for (i = 0; i < 8; i++) params[i] = (float)(i + r);
    fake_code(params, sizeof params); /* the test's "device" buffer */
    memset(&zd, 0, sizeof zd);
    zd.comm = c, zd.count = 8, zd.lr = 0.1f;
    memset(&fd, 0, sizeof fd);
    fd.comm = c, fd.num_units = 1, fd.unit_counts = &one, fd.lr = 0.1f, fd.stage = 2;
    expect_ok(w, dpar_zero_create(&zd, &z), "zero_create", r);
    expect_ok(w, dpar_fsdp_create(&fd, &f), "fsdp_create", r);
    t0 = dt_now();
    if (z && f && j->failing < 2) {
        j->st[r][0] = dpar_ckpt_save_zero(z, params, j->zpath, NULL, NULL, 0);
        snprintf(j->text[r][0], sizeof j->text[r][0], "%s", dpar_last_error());
        j->st[r][1] = dpar_ckpt_save_fsdp(f, j->fpath, NULL, NULL, 0);
        snprintf(j->text[r][1], sizeof j->text[r][1], "%s", dpar_last_error());
    } else if (z && f) {
        j->st[r][0] = dpar_ckpt_load_zero(z, params, j->zpath, NULL, NULL, 0);
        snprintf(j->text[r][0], sizeof j->text[r][0], "%s", dpar_last_error());
        j->st[r][1] = dpar_ckpt_load_fsdp(f, j->fpath, NULL, NULL, 0); /* stage 2: its publish follows */
        snprintf(j->text[r][1], sizeof j->text[r][1], "%s", dpar_last_error());
    }
    j->seconds[r] = dt_now() - t0;
    dpar_fsdp_destroy(f);
    dpar_zero_destroy(z);
    if (c != inner) dpar_comm_destroy(c);
}
static void test_device_checkpoint_failure_reaches_every_rank(void)
{
    devfail_job job;
    char dir[] = "/tmp/dpar_devfail_XXXXXX", cmd[400];
    int r, k;
    CHECK(mkdtemp(dir) != NULL);
    for (job.lib = 0; job.lib < 2; job.lib++)
        for (job.failing = 0; job.failing < 3; job.failing++) {
            dpar_comm_desc d = fake_desc(3, 1);
            const char *want = job.failing == 1 ? "to_host failed" : "from_host failed";
            memset(job.st, 0, sizeof job.st);
            snprintf(job.zpath, sizeof job.zpath, "%s/zero%d", dir, job.lib);
            snprintf(job.fpath, sizeof job.fpath, "%s/fsdp%d", dir, job.lib);
            d.timeout_ms = 20000;
            if (job.failing == 1) fdev.fail_host_worker = 1;
            if (job.failing == 2) fdev.fail_from_worker = 1;
            CHECK_MSG(run_world_desc(3, &d, devfail_rank, &job, NULL, 0) == 0, "lib %d failing %d", job.lib,
                      job.failing);
            for (r = 0; r < 3; r++)
                for (k = 0; k < 2; k++) {
                    if (job.failing == 0) {
                        CHECK_MSG(job.st[r][k] == DPAR_OK, "lib %d rank %d %s: %s", job.lib, r, k ? "fsdp" : "zero",
                                  job.text[r][k]);
                        continue;
                    }
                    CHECK_MSG(job.st[r][k] == DPAR_ESYSTEM && (r != 1 || strstr(job.text[r][k], want)) &&
                                  (r == 1 || strstr(job.text[r][k], "another rank failed")),
                              "lib %d failing %d rank %d %s: %s: %s", job.lib, job.failing, r, k ? "fsdp" : "zero",
                              dpar_status_string(job.st[r][k]), job.text[r][k]);
                }
            for (r = 0; r < 3; r++)
                CHECK_MSG(job.seconds[r] < 5.0, "lib %d failing %d rank %d: %.1f s (a rank waited for its deadline)",
                          job.lib, job.failing, r, job.seconds[r]);
            CHECK_MSG(fdev.allocs == fdev.frees, "%ld allocations, %ld frees", fdev.allocs, fdev.frees);
        }
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

/* a library's comm made without an exchange (no_check): dpar's host words (dpar_alltoallv_counts, a checkpoint's
   own agreement and manifest) run through ops.run when its buffers are host memory, and are refused on every rank
   (DPAR_EUNSUPPORTED) when they are the device's */
static void noexch_rank(world *w, dpar_comm *inner, int r)
{
    const char *path = (const char *)w->user;
    int device;
    for (device = 0; device < 2; device++) {
        dpar_comm_ops ops;
        dpar_comm_desc d;
        dpar_comm *c = NULL;
        lib_rank l;
        size_t send[3], recv[3], q;
        int64_t step = 7 + r, back = 0;
        dpar_ckpt_item item = dpar_ckpt_replica("step", &step, sizeof step);
        dpar_status st;
        memset(&l, 0, sizeof l);
        memset(&ops, 0, sizeof ops);
        l.inner = inner;
        ops.user = &l, ops.rank = r, ops.size = dpar_comm_size(inner), ops.run = lib_run; /* no exchange */
        memset(&d, 0, sizeof d);
        d.no_check = 1;
        if (device) {
            d.memory.reduce = fake_reduce, d.memory.divide = fake_divide, d.memory.copy = fake_copy;
            d.memory.alloc = fake_alloc, d.memory.free = fake_free;
            d.memory.clear = fake_clear, d.memory.update = fake_update;
        }
        if (dpar_comm_from_ops(&ops, &d, &c) != DPAR_OK) {
            note(w, "rank %d device %d: from_ops: %s", r, device, dpar_last_error());
            return;
        }
        for (q = 0; q < 3; q++) send[q] = (size_t)(10 * r) + q, recv[q] = 0;
        st = dpar_alltoallv_counts(c, send, recv);
        if (device && (st != DPAR_EUNSUPPORTED || !strstr(dpar_last_error(), "needs ops.exchange")))
            note(w, "rank %d: counts on device memory without an exchange: %s", r, dpar_last_error());
        for (q = 0; !device && q < 3; q++)
            if (st != DPAR_OK || recv[q] != 10 * q + (size_t)r)
                note(w, "rank %d: counts without an exchange: %s, recv[%zu] = %zu", r, dpar_status_string(st), q,
                     recv[q]);
        if (!device) { /* rank 0's step is the replica's: every rank loads 7 */
            st = dpar_ckpt_save(c, path, &item, 1);
            item.data = &back;
            if (st == DPAR_OK) st = dpar_ckpt_load(c, path, &item, 1);
            if (st != DPAR_OK || back != 7)
                note(w, "rank %d: a checkpoint without an exchange: %s, step %lld", r, dpar_last_error(),
                     (long long)back);
        }
        dpar_comm_destroy(c);
    }
}
static void test_ops_comm_without_exchange_host_words(void)
{
    char dir[] = "/tmp/dpar_noexch_XXXXXX", path[300], cmd[400];
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/ck", dir);
    fake_desc(3, 1); /* the fake device's counters for its callbacks */
    CHECK(run_world(3, noexch_rank, path) == 0);
    CHECK_MSG(fdev.allocs == fdev.frees, "%ld allocations, %ld frees", fdev.allocs, fdev.frees);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

/* ---- batches (dpar_batch_begin/_end): on a library's comm the calls are recorded, checked with one exchange and
   handed over together (run_group); nothing is written before dpar_batch_end; a difference is named on every
   rank; on a threads comm the same program runs call by call ---- */
static dpar_status lib_run_group(void *user, const dpar_comm_call *calls, int n)
{
    lib_rank *l = (lib_rank *)user;
    int i;
    l->groups++;
    for (i = 0; i < n; i++) DPAR__TRY(lib_run(user, &calls[i]));
    return DPAR_OK;
}
enum { BATCH_N = 1001 };
typedef struct {
    int mode; /* 0: run_group; 1: no run_group (call by call); 2: rank 1 broadcasts at call 2; 3: rank 2's batch
                 is a call shorter; 4: the inner threads comm itself */
} batch_job;
static void batch_rank(world *w, dpar_comm *inner, int r)
{
    batch_job *j = (batch_job *)w->user;
    lib_rank l;
    dpar_comm *c = inner;
    dpar_comm_desc d;
    float *a = (float *)malloc(BATCH_N * 4), *b = (float *)malloc(BATCH_N * 4), *g = (float *)malloc(BATCH_N * 4);
    float *e = (float *)malloc(BATCH_N * 4);
    size_t off, len, i;
    int N = w->n, q;
    dpar_status st;
    memset(&l, 0, sizeof l);
    if (j->mode != 4) { /* the library over the inner comm, the checker on */
        memset(&d, 0, sizeof d);
        if (!(c = lib_comm_with(&l, inner, d, j->mode != 1 ? lib_run_group : NULL))) {
            note(w, "rank %d: from_ops: %s", r, dpar_last_error());
            return;
        }
    }
    for (i = 0; i < BATCH_N; i++) a[i] = (float)(r + 1) * (float)(i % 7), b[i] = (float)(i + r), e[i] = (float)(r * 2);
    dpar_block_range(BATCH_N, N, r, &off, &len);
    for (i = 0; i < len; i++) g[off + i] = (float)(r * 1000) + (float)i;
    expect_ok(w, dpar_batch_begin(c), "batch_begin", r);
    if (dpar_batch_begin(c) != DPAR_EINVAL) note(w, "rank %d: a nested batch accepted", r);
    expect_ok(w, dpar_allreduce(c, a, a, BATCH_N, DPAR_F32, DPAR_SUM), "allreduce", r);
    if (j->mode < 4 && a[1] != (float)(r + 1)) note(w, "rank %d: the batched allreduce wrote before the end", r);
    expect_ok(w,
              j->mode == 2 && r == 1 ? dpar_broadcast(c, b, b, BATCH_N, DPAR_F32, 0)
                                     : dpar_allreduce(c, b, b, BATCH_N, DPAR_F32, DPAR_MAX),
              "second call", r);
    expect_ok(w, dpar_allgather(c, g + off, g, BATCH_N, DPAR_F32), "allgather", r);
    if (j->mode != 3 || r != 2) expect_ok(w, dpar_allreduce(c, e, e, BATCH_N, DPAR_F32, DPAR_AVG), "avg", r);
    {
        dpar_request *req = NULL;
        if (dpar_iallreduce(c, e, e, 1, DPAR_F32, DPAR_SUM, &req) != DPAR_EINVAL || req)
            note(w, "rank %d: an async call inside a batch accepted", r);
    }
    if (j->mode < 4) {
        size_t counts[8] = {0};
        if (dpar_alltoallv(c, a, counts, NULL, b, counts, NULL, DPAR_F32) != DPAR_EUNSUPPORTED)
            note(w, "rank %d: alltoallv inside a library's batch: %s", r, dpar_last_error());
    }
    st = dpar_batch_end(c);
    if (j->mode == 2 || j->mode == 3) {
        const char *want = j->mode == 2 ? "broadcast" : "its batch ended after 3 calls";
        if (st != DPAR_EMISMATCH || !strstr(dpar_last_error(), want) || !strstr(dpar_last_error(), "in a batch"))
            note(w, "rank %d: mode %d gave %s: %s", r, j->mode, dpar_status_string(st), dpar_last_error());
    } else {
        expect_ok(w, st, "batch_end", r);
        for (i = 0; i < BATCH_N; i++) {
            float sa = 0, want_g;
            int owner = 0;
            size_t qo = 0, ql = 0;
            for (q = 0; q < N; q++) sa += (float)(q + 1) * (float)(i % 7);
            for (q = 0; q < N; q++) {
                dpar_block_range(BATCH_N, N, q, &qo, &ql);
                if (i >= qo && i < qo + ql) {
                    owner = q;
                    break;
                }
            }
            want_g = (float)(owner * 1000) + (float)(i - qo);
            if (a[i] != sa || b[i] != (float)(i + N - 1) || g[i] != want_g || e[i] != (float)(N - 1)) {
                note(w, "rank %d mode %d element %zu: %g %g %g %g, want %g %g %g %g", r, j->mode, i, a[i], b[i], g[i],
                     e[i], sa, (double)(i + N - 1), want_g, (double)(N - 1));
                break;
            }
        }
        if (j->mode < 4 && (l.exchanges != 1 || l.runs != 4 || l.groups != (j->mode == 0)))
            note(w, "rank %d mode %d: %ld exchanges, %ld runs, %ld groups (want 1, 4, %d)", r, j->mode, l.exchanges,
                 l.runs, l.groups, j->mode == 0);
        if (j->mode < 4) { /* the next batch: the same again, its room kept */
            expect_ok(w, dpar_batch_begin(c), "batch_begin", r);
            expect_ok(w, dpar_allreduce(c, e, e, BATCH_N, DPAR_F32, DPAR_SUM), "allreduce", r);
            expect_ok(w, dpar_batch_end(c), "batch_end", r);
            if (e[0] != (float)(N * (N - 1)) || l.exchanges != 2) note(w, "rank %d: the second batch", r);
        }
    }
    if (dpar_batch_end(c) != DPAR_EINVAL) note(w, "rank %d: an end without a batch accepted", r);
    if (c != inner) dpar_comm_destroy(c);
    free(a), free(b), free(g), free(e);
}
static void test_batches(void)
{
    batch_job j;
    int ni;
    for (ni = 0; ni < 5; ni++)
        for (j.mode = 0; j.mode < 5; j.mode++) {
            int N = Ns[ni];
            if ((j.mode == 2 || j.mode == 3) && N < 3) continue;
            CHECK_MSG(run_world(N, batch_rank, &j) == 0, "N=%d mode %d", N, j.mode);
        }
    CHECK(dpar_batch_begin(NULL) == DPAR_EINVAL && dpar_batch_end(NULL) == DPAR_EINVAL);
}

/* ---- alltoallv: random counts, the count check, bad input, timeouts ---- */
/* the elements `from` sends to `to` in round `seed`: 0..max, about a third of them 0; rank `quiet` sends nothing */
static size_t rv_count(unsigned seed, int from, int to, size_t max, int quiet)
{
    unsigned long long h = (unsigned long long)seed * 0x9e3779b97f4a7c15ull + (unsigned long long)from * 1000003u +
                           (unsigned long long)to * 7919u;
    h ^= h >> 29, h *= 0xbf58476d1ce4e5b9ull, h ^= h >> 32;
    if (from == quiet || h % 3 == 0) return 0;
    return (size_t)(h >> 8) % (max + 1);
}
typedef struct {
    unsigned seeds;
    size_t max;
    dpar_dtype t;
    char *buf[8]; /* per rank: send at 0, recv at half */
    size_t half;
} rv_job;
/* every round: counts from rv_count, displacements with gaps in a shuffled rank order (recv) and packed (send);
   the receiver's reference is computed serially from the sender's formula, and what lies between blocks is
   untouched */
static void rv_rank(world *w, dpar_comm *c, int r)
{
    rv_job *j = (rv_job *)w->user;
    size_t es = dpar_dtype_size(j->t), sc[8], rc[8], rd[8], i, at;
    char *s = j->buf[r], *v = j->buf[r] + j->half * es;
    int N = w->n, q, k;
    unsigned seed;
    for (seed = 1; seed <= j->seeds; seed++) {
        int quiet = (int)(seed % (unsigned)(N + 1)) - 1; /* -1: nobody is quiet this round */
        size_t got[8];
        for (q = 0; q < N; q++)
            sc[q] = rv_count(seed, r, q, j->max, quiet), rc[q] = rv_count(seed, q, r, j->max, quiet);
        expect_ok(w, dpar_alltoallv_counts(c, sc, got), "alltoallv_counts", r);
        for (q = 0; q < N; q++)
            if (got[q] != rc[q])
                note(w, "seed %u: rank %d: the helper says %zu from %d, want %zu", seed, r, got[q], q, rc[q]);
        for (at = 0, k = 0; k < N; k++) { /* recv: ranks in the order (5 k + seed) % N, with a gap of 2 after each */
            q = (int)(((unsigned)k * 5u + seed) % (unsigned)N);
            rd[q] = at;
            at += rc[q] + 2;
        }
        for (q = 0; q < N; q++) /* 5 is prime to every N of Ns but 5: there the plain order */
            if (N == 5) rd[q] = (size_t)q * (j->max + 2);
        for (q = 0, at = 0; q < N; q++) {
            fill(s + at * es, r * 100 + q + (int)seed, 0, sc[q], j->t, DPAR_SUM);
            at += sc[q];
        }
        memset(v, 0x5a, j->half * es);
        expect_ok(w, dpar_alltoallv(c, s, sc, NULL, v, rc, rd, j->t), "alltoallv", r);
        for (q = 0; q < N; q++)
            for (i = 0; i < rc[q]; i++)
                if (get(v + rd[q] * es, j->t, i) != input(q * 100 + r + (int)seed, i, j->t, DPAR_SUM)) {
                    note(w, "seed %u N=%d %s: rank %d, element %zu from rank %d wrong", seed, N, dpar_dtype_name(j->t),
                         r, i, q);
                    return;
                }
        for (q = 0; q < N; q++) /* the gaps: untouched */
            if (N != 5 && (unsigned char)v[(rd[q] + rc[q]) * es] != 0x5a) {
                note(w, "seed %u: rank %d: the byte after the block from %d was written", seed, r, q);
                return;
            }
    }
}
static void test_alltoallv_random_counts_every_dtype(void)
{
    int ni, t;
    rv_job j;
    memset(&j, 0, sizeof j);
    j.half = 8 * (300 + 2);
    for (t = 0; t < 8; t++) j.buf[t] = (char *)malloc(2 * j.half * 8);
    for (ni = 0; ni < NN; ni++)
        for (t = 0; t < DPAR_DTYPE_COUNT; t++) {
            int N = Ns[ni], fails;
            j.t = (dpar_dtype)t;
            j.seeds = 12;
            j.max = t == DPAR_F32 ? 300 : 40;
            fails = run_world(N, rv_rank, &j);
            if (t == DPAR_F32 && !(N & (N - 1))) { /* the deterministic mode and small segments change nothing */
                dpar_comm_desc d;
                memset(&d, 0, sizeof d);
                d.deterministic = 1;
                d.segment_bytes = 64;
                fails += run_world_desc(N, &d, rv_rank, &j, NULL, 0);
            }
            CHECK_MSG(fails == 0, "N=%d %s: %d failures", N, dpar_dtype_name(j.t), fails);
        }
    for (t = 0; t < 8; t++) free(j.buf[t]);
}

/* a count that one pair disagrees on fails every rank, naming both ranks, both counts and both call sites; also on a
   rank that disagrees with itself, through the async form, on the fake device, and through a library's comm */
typedef struct {
    int kind; /* 0: rank 0 sends 5 to rank 2, which expects 4; 1: rank 1 with itself; 2: kind 0 async; 3: no_check;
                 4: rank 3 sends 5 to rank 2, a slow rank that sees it in its last round, when ranks 0 and 1 have
                 finished their exchanges: only the closing dissemination keeps them from returning DPAR_OK */
    dpar_status st[4];
    char msg[4][DPAR__ERROR_TEXT];
    double seconds[4];
    int line[4]; /* each rank's call site */
} vm_job;
static vm_job vm;
static void vm_call(world *w, dpar_comm *c, int r)
{
    float x[64], y[64];
    size_t sc[4], rc[4];
    int q;
    double t0 = dt_now();
    (void)w;
    memset(x, 0, sizeof x);
    for (q = 0; q < 4; q++) sc[q] = rc[q] = 3;
    if (vm.kind != 1 && vm.kind != 4 && r == 0) sc[2] = 5;
    if (vm.kind != 1 && vm.kind != 4 && r == 2) rc[0] = 4;
    if (vm.kind == 4 && r == 3) sc[2] = 5;
    if (vm.kind == 4 && r == 2) rc[3] = 4, hook_sleep_us = 20000;
    if (vm.kind == 1 && r == 1) rc[1] = 2;
    (void)dpar_barrier(c); /* so the alltoallv is #2 (a rank that disagrees with itself may poison it) */
    if (vm.kind == 2) {
        dpar_request *req = NULL;
        vm.st[r] = dpar_ialltoallv(c, x, sc, NULL, y, rc, NULL, DPAR_F32, &req);
        if (vm.st[r] == DPAR_OK) vm.st[r] = dpar_request_wait(req);
    } else if (r == 2) {
        vm.line[r] = __LINE__ + 1;
        vm.st[r] = dpar_alltoallv(c, x, sc, NULL, y, rc, NULL, DPAR_F32);
    } else {
        vm.line[r] = __LINE__ + 1;
        vm.st[r] = dpar_alltoallv(c, x, sc, NULL, y, rc, NULL, DPAR_F32);
    }
    hook_sleep_us = 0;
    snprintf(vm.msg[r], sizeof vm.msg[r], "%s", dpar_last_error());
    vm.seconds[r] = dt_now() - t0;
}
static void vm_lib_rank(world *w, dpar_comm *inner, int r)
{
    lib_rank l;
    dpar_comm *c = lib_comm(&l, inner, 0);
    if (!c) return;
    vm_call(w, c, r);
    if (l.runs != 1) note(w, "rank %d: the library ran %ld calls (the barrier alone)", r, l.runs);
    dpar_comm_destroy(c);
}
static void test_alltoallv_mismatch_names_both_sides(void)
{
    int kind, r, how;
    for (how = 0; how < 3; how++) /* thread ranks, the fake device, a library's comm */
        for (kind = 0; kind < 5; kind++) {
            dpar_comm_desc d;
            char a[160], b[160];
            if (how == 2 && kind > 1) continue;
            if (how == 1) d = fake_desc(4, 1);
            else memset(&d, 0, sizeof d);
            memset(&vm, 0, sizeof vm);
            vm.kind = kind;
            d.timeout_ms = 5000;
            d.no_check = kind == 3;
            if (how == 2) {
                dpar_comm_desc inner;
                memset(&inner, 0, sizeof inner);
                inner.timeout_ms = 5000;
                run_world_desc(4, &inner, vm_lib_rank, NULL, NULL, 0);
            } else {
                run_world_desc(4, &d, vm_call, NULL, NULL, 0);
            }
            if (kind == 1) {
                snprintf(a, sizeof a, "rank 1 sends 3 elements to rank 1 in alltoallv #2 at tests/test_comm.c:%d",
                         vm.line[1]);
                snprintf(b, sizeof b, "but rank 1 expects 2 from rank 1 (alltoallv #2 at tests/test_comm.c:%d)",
                         vm.line[1]);
            } else if (kind == 3) { /* no check: the bytes still differ, caught by rank 2 (no promise for the rest) */
                snprintf(a, sizeof a, "rank 0 offered 20 bytes where rank 2 expected 16");
                snprintf(b, sizeof b, "alltoallv(dtype=f32)");
            } else if (kind == 4) {
                snprintf(a, sizeof a, "rank 3 sends 5 elements to rank 2 in alltoallv #2 at tests/test_comm.c:%d",
                         vm.line[3]);
                snprintf(b, sizeof b, "but rank 2 expects 4 from rank 3 (alltoallv #2 at tests/test_comm.c:%d)",
                         vm.line[2]);
            } else {
                snprintf(a, sizeof a, "rank 0 sends 5 elements to rank 2 in alltoallv #2 at tests/test_comm.c:%d",
                         kind == 2 ? 0 : vm.line[0]);
                snprintf(b, sizeof b, "but rank 2 expects 4 from rank 0 (alltoallv #2 at tests/test_comm.c:%d)",
                         kind == 2 ? 0 : vm.line[2]);
                if (kind == 2) a[strlen(a) - 1] = 0, b[strlen(b) - 2] = 0; /* the async call's line: one for all */
            }
            for (r = 0; r < 4; r++) {
                if (kind == 3 && r != 2) {
                    CHECK_MSG(vm.seconds[r] < 2.0, "how %d kind %d rank %d took %.2f s", how, kind, r, vm.seconds[r]);
                    continue;
                }
                CHECK_MSG(vm.st[r] == DPAR_EMISMATCH, "how %d kind %d rank %d: %s (%s)", how, kind, r,
                          dpar_status_string(vm.st[r]), vm.msg[r]);
                CHECK_MSG(strstr(vm.msg[r], a) && strstr(vm.msg[r], b), "how %d kind %d rank %d: '%s'", how, kind, r,
                          vm.msg[r]);
                CHECK_MSG(vm.seconds[r] < 2.0, "how %d kind %d rank %d took %.2f s", how, kind, r, vm.seconds[r]);
            }
            if (how == 0 && kind == 0) printf("    e.g. %s\n", vm.msg[1]);
        }
}

/* two ranks: one round, each message carrying both directions of the pair (no closing dissemination), so a
   mismatch in either direction must still fail both ranks with the sentence naming the sender and the receiver
   of the pair that disagrees */
static struct {
    int dir;
    dpar_status st[2];
    char msg[2][DPAR__ERROR_TEXT];
    int line[2]; /* each rank's own: the call's line (one shared word written by both would be a race) */
} v2;
static void v2_rank(world *w, dpar_comm *c, int r)
{
    float x[8], y[8];
    size_t sc[2] = {1, 1}, rc[2] = {1, 1};
    (void)w;
    memset(x, 0, sizeof x);
    if (v2.dir == 0 && r == 0) sc[1] = 5; /* rank 0 sends 5 to rank 1, which expects 4 */
    if (v2.dir == 0 && r == 1) rc[0] = 4;
    if (v2.dir == 1 && r == 1) sc[0] = 3; /* rank 1 sends 3 to rank 0, which expects 2 */
    if (v2.dir == 1 && r == 0) rc[1] = 2;
    (void)dpar_barrier(c);
    v2.line[r] = __LINE__ + 1;
    v2.st[r] = dpar_alltoallv(c, x, sc, NULL, y, rc, NULL, DPAR_F32);
    snprintf(v2.msg[r], sizeof v2.msg[r], "%s", dpar_last_error());
}
static void test_alltoallv_two_ranks_one_round(void)
{
    int dir, r;
    for (dir = 0; dir < 2; dir++) {
        char a[200];
        dpar_comm_desc d;
        memset(&d, 0, sizeof d);
        memset(&v2, 0, sizeof v2);
        v2.dir = dir;
        d.timeout_ms = 5000;
        run_world_desc(2, &d, v2_rank, NULL, NULL, 0);
        snprintf(a, sizeof a,
                 dir == 0 ? "rank 0 sends 5 elements to rank 1 in alltoallv #2 at tests/test_comm.c:%d but rank 1 "
                            "expects 4 from rank 0 (alltoallv #2 at tests/test_comm.c:%d)"
                          : "rank 1 sends 3 elements to rank 0 in alltoallv #2 at tests/test_comm.c:%d but rank 0 "
                            "expects 2 from rank 1 (alltoallv #2 at tests/test_comm.c:%d)",
                 v2.line[0], v2.line[1]);
        for (r = 0; r < 2; r++)
            CHECK_MSG(v2.st[r] == DPAR_EMISMATCH && strstr(v2.msg[r], a), "direction %d rank %d: %s: '%s'", dir, r,
                      dpar_status_string(v2.st[r]), v2.msg[r]);
    }
}

/* a rank that never comes to the alltoallv is named by the others' timeout */
static int vt_done;
static void vt_rank(world *w, dpar_comm *c, int r)
{
    float x[16], y[16];
    size_t sc[3] = {1, 2, 3}, rc[3];
    dpar_status st;
    int q;
    memset(x, 0, sizeof x);
    for (q = 0; q < 3; q++) rc[q] = (size_t)r + 1;
    if (r == 2) { /* it stays (silent) until the others gave up */
        while (__atomic_load_n(&vt_done, __ATOMIC_ACQUIRE) < 2) usleep(1000);
        return;
    }
    st = dpar_alltoallv(c, x, sc, NULL, y, rc, NULL, DPAR_F32);
    __atomic_add_fetch(&vt_done, 1, __ATOMIC_RELEASE);
    if (st != DPAR_ETIMEDOUT || !strstr(dpar_last_error(), "in alltoallv(dtype=f32) #1") ||
        !strstr(dpar_last_error(), "rank 2 never arrived"))
        note(w, "rank %d: %s: %s", r, dpar_status_string(st), dpar_last_error());
}
static void test_alltoallv_timeout_names_the_absent_rank(void)
{
    dpar_comm_desc d;
    memset(&d, 0, sizeof d);
    d.timeout_ms = 200;
    CHECK(run_world_desc(3, &d, vt_rank, NULL, NULL, 0) == 0);
}

/* bad arguments: each a clear EINVAL (and, as for every collective, the group is poisoned: a fresh one each) */
static dpar_status vb_status;
static char vb_msg[DPAR__ERROR_TEXT];
static int vb_case;
static void vb_rank(world *w, dpar_comm *c, int r)
{
    float x[64], y[64];
    size_t sc[2] = {2, 2}, rc[2] = {2, 2}, rd[2] = {0, 2}, big[2] = {SIZE_MAX / 2, 1}, ovl[2] = {0, 1};
    size_t rev[2] = {3, 0}, revo[2] = {1, 0}, huge[2] = {SIZE_MAX - 1, 0};
    dpar_request *req = NULL;
    dpar_status st = DPAR_OK;
    (void)w;
    memset(x, 0, sizeof x);
    if (r != 0) return;
    switch (vb_case) {
    case 0: st = dpar_alltoallv(c, x, NULL, NULL, y, rc, NULL, DPAR_F32); break;
    case 1: st = dpar_alltoallv(c, x, sc, NULL, y, NULL, NULL, DPAR_F32); break;
    case 2: st = dpar_alltoallv(c, x, big, NULL, y, rc, NULL, DPAR_F32); break;
    case 3: st = dpar_alltoallv(c, x, sc, huge, y, rc, NULL, DPAR_U8); break;
    case 4: st = dpar_alltoallv(c, x, sc, NULL, y, rc, ovl, DPAR_F32); break;  /* in rank order, overlapping */
    case 5: st = dpar_alltoallv(c, x, sc, NULL, y, rc, revo, DPAR_F32); break; /* out of order, overlapping */
    case 6: st = dpar_alltoallv(c, x, sc, NULL, x, rc, NULL, DPAR_F32); break; /* in place */
    case 7: st = dpar_alltoallv(c, x, sc, NULL, x + 3, rc, NULL, DPAR_F32); break;
    case 8: st = dpar_alltoallv(c, NULL, sc, NULL, y, rc, NULL, DPAR_F32); break;
    case 9: st = dpar_alltoallv(c, x, sc, NULL, y, rc, rd, (dpar_dtype)42); break;
    case 10: st = dpar_ialltoallv(c, x, sc, NULL, y, rc, NULL, DPAR_F32, NULL); break;
    case 11: st = dpar_alltoallv_counts(c, sc, sc); break;
    case 12: st = dpar_alltoallv_counts(c, NULL, rc); break;
    default: st = dpar_alltoallv(c, x, sc, NULL, y, rc, rev, DPAR_F32); break; /* out of order, apart: fine */
    }
    if (vb_case > 12 && st == DPAR_OK) st = dpar_alltoallv(c, x, sc, NULL, y, rc, rev, DPAR_F32);
    vb_status = st;
    snprintf(vb_msg, sizeof vb_msg, "%s", dpar_last_error());
    (void)req;
}
static void test_alltoallv_bad_input(void)
{
    static const char *want[] = {"sendcounts is NULL",
                                 "recvcounts is NULL",
                                 "the block of rank 0 overflows (send 9223372036854775807 elements",
                                 "the block of rank 0 overflows (send 2 elements at 18446744073709551614",
                                 "the recv blocks of ranks 0 and 1 overlap",
                                 "the recv blocks of ranks 0 and 1 overlap",
                                 "send and recv overlap (alltoallv is not in place",
                                 "send and recv overlap",
                                 "send is NULL with 4 elements to send",
                                 "dtype 42 is not a dpar_dtype",
                                 "req is NULL",
                                 "sendcounts == recvcounts (not in place)",
                                 "a buffer is NULL"};
    int k;
    for (k = 0; k <= 13; k++) {
        vb_case = k;
        vb_status = DPAR_OK;
        vb_msg[0] = 0;
        run_world(k == 13 ? 1 : 2, vb_rank, NULL);
        if (k == 13) {
            CHECK_MSG(vb_status == DPAR_OK, "case %d: %s", k, vb_msg);
            continue;
        }
        if (sizeof(size_t) < 8 && (k == 2 || k == 3)) continue; /* the numbers above are 64-bit ones */
        CHECK_MSG(vb_status == DPAR_EINVAL && strstr(vb_msg, want[k]), "case %d: %s: '%s'", k,
                  dpar_status_string(vb_status), vb_msg);
    }
}

/* the counters count alltoallv apart, with the bytes this rank sent and received; the trace names it */
static void vs_rank(world *w, dpar_comm *c, int r)
{
    float x[16], y[16];
    size_t sc[2], rc[2];
    dpar_comm_stats st;
    memset(x, 0, sizeof x);
    sc[0] = 1, sc[1] = 2 + (size_t)r; /* rank 0 sends 1 + 2, rank 1 sends 1 + 3 */
    rc[0] = r ? 2 : 1, rc[1] = r ? 3 : 1;
    expect_ok(w, dpar_alltoallv(c, x, sc, NULL, y, rc, NULL, DPAR_F32), "alltoallv", r);
    dpar_comm_stats_get(c, &st);
    if (st.by_coll[DPAR_COLL_ALLTOALLV].calls != 1 || st.by_coll[DPAR_COLL_ALLTOALL].calls != 0 ||
        st.by_coll[DPAR_COLL_ALLTOALLV].bytes_sent != 4 * sc[1 - r] ||
        st.by_coll[DPAR_COLL_ALLTOALLV].bytes_received != 4 * rc[1 - r] || st.last_coll != DPAR_COLL_ALLTOALLV)
        note(w, "rank %d: %llu calls, %llu bytes sent, %llu received", r,
             (unsigned long long)st.by_coll[DPAR_COLL_ALLTOALLV].calls,
             (unsigned long long)st.by_coll[DPAR_COLL_ALLTOALLV].bytes_sent,
             (unsigned long long)st.by_coll[DPAR_COLL_ALLTOALLV].bytes_received);
}
static void test_alltoallv_counters(void)
{
    CHECK(run_world(2, vs_rank, NULL) == 0);
    CHECK(strcmp(dpar_coll_name(DPAR_COLL_ALLTOALLV), "alltoallv") == 0);
    CHECK(strcmp(dpar_coll_name(DPAR_COLL_SPLIT), "split") == 0 && DPAR_COLL_SPLIT == 9);
}

/* ---- bad input, creation ---- */
static void bad_rank(world *w, dpar_comm *c, int r)
{
    float x[8];
    memset(x, 0, sizeof x);
    if (r != 0) return;
    if (dpar_allreduce(c, x, x, 8, DPAR_F32, (dpar_op)7) != DPAR_EINVAL) note(w, "bad op accepted");
    if (dpar_allreduce(c, NULL, x, 8, DPAR_F32, DPAR_SUM) != DPAR_EINVAL) note(w, "NULL send accepted");
    if (dpar_allreduce(c, x, x + 1, 4, DPAR_F32, DPAR_SUM) != DPAR_EINVAL) note(w, "overlap accepted");
    if (dpar_broadcast(c, x, x, 8, DPAR_F32, 5) != DPAR_EINVAL) note(w, "bad root accepted");
    if (dpar_allreduce(c, x, x, SIZE_MAX / 2, DPAR_F32, DPAR_SUM) != DPAR_EINVAL) note(w, "huge count accepted");
    if (dpar_send(c, x, 8, DPAR_F32, 9, 0) != DPAR_EINVAL) note(w, "bad peer accepted");
    if (dpar_iallreduce(c, x, x, 8, DPAR_F32, DPAR_SUM, NULL) != DPAR_EINVAL) note(w, "NULL req accepted");
}

/* A split whose scratch memory runs out on one rank: every rank returns at once, none waits for it. */
typedef struct {
    pthread_t victim;
    int armed;
    dpar_status st[4];
    double seconds[4];
} split_oom_job;
static split_oom_job split_oom;
static void *split_oom_alloc(void *user, size_t size)
{
    split_oom_job *j = (split_oom_job *)user;
    if (__atomic_load_n(&j->armed, __ATOMIC_ACQUIRE) && pthread_equal(pthread_self(), j->victim)) {
        __atomic_store_n(&j->armed, 0, __ATOMIC_RELEASE);
        return NULL;
    }
    return malloc(size);
}
static void split_oom_free(void *user, void *p)
{
    (void)user;
    free(p);
}
static void split_oom_rank(world *w, dpar_comm *c, int r)
{
    dpar_comm *sub = NULL;
    double t0;
    (void)w;
    if (r == 1) {
        split_oom.victim = pthread_self();
        __atomic_store_n(&split_oom.armed, 1, __ATOMIC_RELEASE); /* its next allocation: the split's scratch */
    }
    t0 = dt_now();
    split_oom.st[r] = dpar_comm_split(c, 0, r, &sub);
    split_oom.seconds[r] = dt_now() - t0;
    if (sub) dpar_comm_destroy(sub);
}
static void test_split_out_of_memory_on_one_rank(void)
{
    dpar_comm_desc d;
    int r;
    memset(&d, 0, sizeof d);
    memset(&split_oom, 0, sizeof split_oom);
    d.timeout_ms = 10000;
    d.allocator.alloc = split_oom_alloc;
    d.allocator.free = split_oom_free;
    d.allocator.user = &split_oom;
    run_world_desc(4, &d, split_oom_rank, NULL, NULL, 0);
    for (r = 0; r < 4; r++)
        CHECK_MSG(split_oom.st[r] == DPAR_ENOMEM && split_oom.seconds[r] < 2.0, "rank %d: %s after %.2f s", r,
                  dpar_status_string(split_oom.st[r]), split_oom.seconds[r]);
}

static void test_bad_input(void)
{
    dpar_group *g;
    dpar_comm_desc d;
    dpar_comm *c = (dpar_comm *)&d;
    memset(&d, 0, sizeof d);
    CHECK(dpar_group_create(NULL, &g) == DPAR_EINVAL);
    CHECK(dpar_group_create(&d, &g) == DPAR_EINVAL); /* size 0 */
    d.size = -2;
    CHECK(dpar_group_create(&d, &g) == DPAR_EINVAL);
    d.size = DPAR_MAX_THREADS + 1;
    CHECK(dpar_group_create(&d, &g) == DPAR_ERANGE);
    d.size = 2;
    d.timeout_ms = -5;
    CHECK(dpar_group_create(&d, &g) == DPAR_EINVAL);
    d.timeout_ms = 0;
    CHECK(dpar_group_create(&d, &g) == DPAR_OK);
    CHECK(dpar_group_join(g, 2, &c) == DPAR_EINVAL && c == NULL);
    CHECK(dpar_group_join(NULL, 0, &c) == DPAR_EINVAL);
    CHECK(dpar_group_join(g, 0, &c) == DPAR_OK);
    {
        dpar_comm *again;
        dpar_comm_desc used;
        CHECK(dpar_group_join(g, 0, &again) == DPAR_EBUSY);
        CHECK(dpar_comm_query(c, &used) == DPAR_OK && used.timeout_ms == 30000 && used.segment_bytes == 128 * 1024);
    }
    /* DPAR_TIMEOUT_MS applies when the description says 0; the description wins otherwise */
    {
        dpar_group *g2 = NULL;
        dpar_comm *c2 = NULL;
        dpar_comm_desc used, d2;
        memset(&d2, 0, sizeof d2);
        d2.size = 1;
        setenv("DPAR_TIMEOUT_MS", "1234", 1);
        CHECK(dpar_group_create(&d2, &g2) == DPAR_OK && dpar_group_join(g2, 0, &c2) == DPAR_OK);
        CHECK(dpar_comm_query(c2, &used) == DPAR_OK && used.timeout_ms == 1234);
        dpar_comm_destroy(c2);
        dpar_group_destroy(g2);
        d2.timeout_ms = 77;
        CHECK(dpar_group_create(&d2, &g2) == DPAR_OK && dpar_group_join(g2, 0, &c2) == DPAR_OK);
        CHECK(dpar_comm_query(c2, &used) == DPAR_OK && used.timeout_ms == 77);
        dpar_comm_destroy(c2);
        dpar_group_destroy(g2);
        unsetenv("DPAR_TIMEOUT_MS");
    }
    CHECK(dpar_allreduce(NULL, NULL, NULL, 0, DPAR_F32, DPAR_SUM) == DPAR_EINVAL);
    CHECK(dpar_comm_rank(NULL) == -1 && dpar_comm_size(NULL) == 0);
    dpar_comm_destroy(c);
    dpar_group_destroy(g);
    CHECK(run_world(2, bad_rank, NULL) == 0);
    {
        size_t off, len, total = 0;
        int p, i;
        for (p = 1; p <= 9; p++)
            for (i = 0, total = 0; i < p; i++) {
                dpar_block_range(100, p, i, &off, &len);
                CHECK(off == total && (len == 100 / (size_t)p || len == 100 / (size_t)p + 1));
                total += len;
                if (i == p - 1) CHECK(total == 100);
            }
        dpar_block_range(5, 0, 0, &off, &len);
        CHECK(off == 0 && len == 0);
    }
}

/* ---- trace and timeout environment ---- */
static void trace_rank(world *w, dpar_comm *c, int r)
{
    float x[1000];
    memset(x, 0, sizeof x);
    expect_ok(w, dpar_allreduce(c, x, x, 1000, DPAR_F32, DPAR_SUM), "allreduce", r);
    expect_ok(w, dpar_barrier(c), "barrier", r);
}

static void test_trace_has_collectives_with_bytes(void)
{
    char path[] = "/tmp/dpar_comm_trace_XXXXXX", *text;
    int fd = mkstemp(path), found = 0;
    FILE *f;
    long n;
    jv *doc, *ev;
    close(fd);
    CHECK(dpar_trace_start(path) == DPAR_OK);
    CHECK(run_world(4, trace_rank, NULL) == 0);
    CHECK(dpar_trace_stop() == DPAR_OK);
    f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    text = (char *)malloc((size_t)n + 1);
    n = (long)fread(text, 1, (size_t)n, f);
    text[n] = 0;
    fclose(f);
    doc = jv_parse(text);
    CHECK(doc != NULL);
    for (ev = jv_get(doc, "traceEvents") ? jv_get(doc, "traceEvents")->child : NULL; ev; ev = ev->next) {
        jv *name = jv_get(ev, "name"), *args = jv_get(ev, "args");
        if (name && name->type == JV_STR && !strcmp(name->str, "allreduce")) {
            jv *bytes = jv_get(args, "bytes"), *bw = jv_get(args, "busbw_GBps"), *algo = jv_get(args, "algo");
            CHECK(bytes && bytes->num == 4000 && bw);
            CHECK(algo && algo->type == JV_STR && !strcmp(algo->str, "oneshot")); /* 4000 bytes, 4 ranks */
            found++;
        }
    }
    CHECK(found == 4); /* one per rank */
    CHECK(strstr(text, "\"comm rank 3\"") != NULL);
    jv_free(doc);
    free(text);
    remove(path);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_half_conversions);
    RUN(test_bad_input);
    RUN(test_point_to_point);
    RUN(test_collectives_matrix);
    RUN(test_half_precision_tolerance);
    RUN(test_ring_moves_2_n_minus_1_over_n);
    RUN(test_bitwise_identical_under_random_delays);
    RUN(test_deterministic_mode_same_bits_for_any_n);
    RUN(test_10000_mixed_collectives);
    RUN(test_mismatches_are_caught_on_every_rank);
    RUN(test_timeout_names_each_story);
    RUN(test_group_larger_than_its_pool);
    RUN(test_algo_mismatches_are_caught_on_every_rank);
    RUN(test_algo_chosen_by_size_desc_and_environment);
    RUN(test_slice_into_one_shared_recv);
    RUN(test_async_requests);
    RUN(test_async_on_one_rank_runs_inline);
    RUN(test_split_and_mesh);
    RUN(test_split_out_of_memory_on_one_rank);
    RUN(test_integer_average_any_group_size);
    RUN(test_memory_callbacks_matrix);
    RUN(test_memory_callback_failure_reaches_every_rank);
    RUN(test_memory_callbacks_split_and_refusals);
    RUN(test_memory_callbacks_oneshot_in_one_piece);
    RUN(test_memory_combine_failure_reaches_every_rank);
    RUN(test_memory_callbacks_small_scratch);
    RUN(test_memory_async_matrix);
    RUN(test_memory_async_host_does_not_wait);
    RUN(test_memory_async_failure_reaches_every_rank);
    RUN(test_memory_async_requests_buckets_p2p_split);
    RUN(test_memory_async_mismatches_and_timeouts);
    RUN(test_zero_and_fsdp_on_device_memory);
    RUN(test_zero_and_fsdp_on_device_refusals);
    RUN(test_device_checkpoint_failure_reaches_every_rank);
    RUN(test_ops_comm_without_exchange_host_words);
    RUN(test_ops_comm_runs_the_matrix);
    RUN(test_ops_comm_errors);
    RUN(test_batches);
    RUN(test_alltoallv_random_counts_every_dtype);
    RUN(test_alltoallv_mismatch_names_both_sides);
    RUN(test_alltoallv_two_ranks_one_round);
    RUN(test_alltoallv_timeout_names_the_absent_rank);
    RUN(test_alltoallv_bad_input);
    RUN(test_alltoallv_counters);
    RUN(test_trace_has_collectives_with_bytes);
    pools_free();
    return dt_summary();
}
