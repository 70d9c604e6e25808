/* test_dp.c - the data-parallel helpers and checkpoints: the sampler against its promises, gradient
   buckets against a plain allreduce (and, updating the parameters themselves, against the average
   and a full optimizer step), the IDX reader on good, truncated and malformed files, and
   checkpoints round trip, detect damage, and survive a crash between shard and manifest. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <unistd.h>

#include "dpar_test.h"
#include "coll_matrix.h"

/* ---- sampler ---- */
static void test_sampler(void)
{
    int ranks, drop, r;
    for (ranks = 1; ranks <= 5; ranks++)
        for (drop = 0; drop < 2; drop++) {
            size_t n = 103, i, k;
            int *seen = (int *)calloc(n, sizeof(int)), *seen2 = (int *)calloc(n, sizeof(int)), differs = 0, again = 1;
            size_t per = 0;
            for (r = 0; r < ranks; r++) {
                dpar_sampler s, t;
                dpar_sampler_desc sd = {0};
                const size_t *idx, *idx2;
                sd.n = n, sd.ranks = ranks, sd.rank = r, sd.seed = 42, sd.drop_last = drop;
                CHECK(dpar_sampler_init(&s, &sd) == DPAR_OK);
                CHECK(dpar_sampler_init(&t, &sd) == DPAR_OK);
                per = dpar_sampler_epoch(&s, 3, &idx);
                CHECK(per == (drop ? n / (size_t)ranks : (n + (size_t)ranks - 1) / (size_t)ranks));
                for (k = 0; k < per; k++) seen[idx[k]]++;
                /* the same (seed, epoch) gives the same indices; another epoch another order */
                dpar_sampler_epoch(&t, 3, &idx2);
                again &= !memcmp(idx, idx2, per * sizeof(size_t));
                dpar_sampler_epoch(&t, 4, &idx2);
                for (k = 0; k < per; k++) {
                    seen2[idx2[k]]++;
                    differs |= idx2[k] != idx[k];
                }
                dpar_sampler_destroy(&s);
                dpar_sampler_destroy(&t);
            }
            CHECK(again);
            CHECK(differs || per <= 1);
            /* every sample once; without drop_last the tail wraps to the start (at most ranks-1 twice) */
            {
                size_t once = 0, twice = 0, never = 0;
                for (i = 0; i < n; i++) {
                    once += seen[i] == 1;
                    twice += seen[i] == 2;
                    never += seen[i] == 0;
                }
                if (drop) CHECK(once == per * (size_t)ranks && never == n - per * (size_t)ranks && twice == 0);
                else CHECK(never == 0 && twice == per * (size_t)ranks - n);
            }
            free(seen);
            free(seen2);
        }
    {
        dpar_sampler s;
        dpar_sampler_desc sd = {0};
        dt_counting counts = {0, 0};
        sd.seed = 1;
        CHECK(dpar_sampler_init(&s, NULL) == DPAR_EINVAL && s.perm == NULL);
        CHECK(dpar_sampler_init(&s, &sd) == DPAR_EINVAL); /* n = 0 */
        sd.n = 10, sd.ranks = 2, sd.rank = 2;
        CHECK(dpar_sampler_init(&s, &sd) == DPAR_EINVAL);
        sd.n = 2, sd.ranks = 3, sd.rank = 0, sd.drop_last = 1;
        CHECK(dpar_sampler_init(&s, &sd) == DPAR_EINVAL);
        sd.n = 5, sd.ranks = 0, sd.drop_last = 0; /* ranks 0: one rank */
        sd.allocator.alloc = dt_count_alloc, sd.allocator.free = dt_count_free, sd.allocator.user = &counts;
        CHECK(dpar_sampler_init(&s, &sd) == DPAR_OK && s.ranks == 1 && s.per_rank == 5);
        CHECK(dpar_sampler_destroy(&s) == DPAR_OK && s.perm == NULL && counts.allocs == 2 && counts.frees == 2);
        CHECK(dpar_sampler_destroy(&s) == DPAR_OK && dpar_sampler_destroy(NULL) == DPAR_OK);
    }
}

/* ---- buckets: backward marks layers from the last to the first; compare with the serial average ---- */
typedef struct {
    size_t n;
    int errors_case;
    uint64_t overlap[8];
    int nb, direct;
} bucket_job;

/* dpar_buckets_create over comm c for the n gradients at g */
static dpar_status buckets_make(dpar_comm *c, float *g, size_t n, size_t bucket_bytes, dpar_op op, dpar_buckets **b)
{
    dpar_buckets_desc d = {0};
    d.comm = c, d.grads = g, d.count = n, d.bucket_bytes = bucket_bytes, d.op = op;
    return dpar_buckets_create(&d, b);
}

static void bucket_rank(world *w, dpar_comm *c, int r)
{
    bucket_job *j = (bucket_job *)w->user;
    size_t n = j->n, i, layer = n / 5;
    float *g = (float *)malloc(n * sizeof(float)), *ref = (float *)malloc(n * sizeof(float));
    dpar_buckets *b;
    int step;
    expect_ok(w, buckets_make(c, g, n, 64 * 1024, DPAR_AVG, &b), "buckets_create", r);
    if (j->direct) expect_ok(w, dpar_buckets_set_direct(b, 1), "buckets_set_direct", r);
    for (step = 0; step < 3; step++) {
        size_t end = n;
        for (i = 0; i < n; i++) { /* small integers: the sum over ranks is exact in any order, then one division */
            int q;
            float sum = 0;
            g[i] = (float)((r * 31 + (int)i * 7 + step * 3) % 64);
            for (q = 0; q < w->n; q++) sum += (float)((q * 31 + (int)i * 7 + step * 3) % 64);
            ref[i] = sum / (float)w->n;
        }
        while (end > 0) { /* backward: the last layer's gradients are final first */
            size_t start = end > layer ? end - layer : 0;
            usleep(200 + (unsigned)((r * 137 + step * 59 + (int)(end % 97)) % 300)); /* the layer's backward */
            expect_ok(w, dpar_buckets_ready(b, start, end - start), "buckets_ready", r);
            end = start;
        }
        expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r);
        if (memcmp(g, ref, n * sizeof(float)))
            note(w, "step %d rank %d: buckets differ from the serial average", step, r);
    }
    j->overlap[r] = dpar_buckets_overlap_ns(b);
    if (r == 0) j->nb = dpar_buckets_count(b);
    /* mistakes: a range marked twice, outside, or never. The last poisons the group by design (the
       other ranks must not wait for this one), so it runs only in a world of one rank. */
    if (w->n > 1) {
        dpar_buckets_destroy(b);
        free(g);
        free(ref);
        return;
    }
    if (dpar_buckets_ready(b, 0, 10) != DPAR_OK || dpar_buckets_ready(b, 5, 10) != DPAR_EINVAL)
        note(w, "overlap accepted");
    if (!strstr(dpar_last_error(), "already marked")) note(w, "message: %s", dpar_last_error());
    if (dpar_buckets_ready(b, n - 1, 2) != DPAR_EINVAL) note(w, "outside accepted");
    if (dpar_buckets_wait(b) != DPAR_EINVAL || !strstr(dpar_last_error(), "never marked ready"))
        note(w, "unmarked accepted");
    dpar_buckets_destroy(b);
    free(g);
    free(ref);
}

/* direct = 1: the same through shared memory (dpar_buckets_set_direct), no messages */
static void test_buckets_match_allreduce(void)
{
    int n, direct;
    for (direct = 0; direct <= 1; direct++)
        for (n = 1; n <= 4; n++) {
            bucket_job j;
            memset(&j, 0, sizeof j);
            j.n = 300007;
            j.direct = direct;
            CHECK(run_world(n, bucket_rank, &j) == 0);
            CHECK(j.nb == (int)((j.n + 16383) / 16384)); /* 64 KiB buckets of floats */
            if (n > 1) CHECK(j.overlap[0] > 0);          /* buckets were in flight during "backward" */
        }
}

/* ---- buckets with an update (ZeRO-1 split of the SGD step): against a full step on the averaged gradients ---- */
typedef struct {
    size_t n;
    int *hits[4];
    float lr;
    float *shared;
    int direct;
} update_job; /* shared: one params for all ranks */
typedef struct {
    float *p, *g, lr;
    int *hits, slow;
} update_state;

static void sgd_block(void *user, size_t offset, size_t count)
{
    update_state *u = (update_state *)user;
    size_t q;
    if (u->slow) usleep(300); /* a rank late with its update: the others' waits must wait for it */
    for (q = offset; q < offset + count; q++) {
        u->p[q] -= u->lr * u->g[q];
        u->hits[q]++;
    }
}

static void update_rank(world *w, dpar_comm *c, int r)
{
    update_job *j = (update_job *)w->user;
    size_t n = j->n, i, layer = n / 5;
    float *g = (float *)malloc(n * sizeof(float)), *rg = (float *)malloc(n * sizeof(float));
    float *p = j->shared ? j->shared : (float *)malloc(n * sizeof(float)), *rp = (float *)malloc(n * sizeof(float));
    update_state u;
    dpar_buckets *b;
    int step;
    u.p = p, u.g = g, u.lr = j->lr, u.hits = j->hits[r], u.slow = r == 1;
    for (i = 0; i < n; i++) rp[i] = (float)(i % 1000) * 0.001f; /* the same start on every rank */
    if (!j->shared) memcpy(p, rp, n * sizeof(float));
    expect_ok(w, buckets_make(c, g, n, 64 * 1024, DPAR_AVG, &b), "buckets_create", r);
    expect_ok(w, dpar_buckets_set_update(b, p, sgd_block, &u), "buckets_set_update", r);
    if (j->direct) {
        expect_ok(w, dpar_buckets_set_direct(b, 1), "buckets_set_direct", r);
        if (dpar_buckets_set_update(b, p, sgd_block, &u) != DPAR_EBUSY) note(w, "set_update accepted with direct on");
    }
    for (step = 0; step < 3; step++) {
        size_t end = n, bs, off, len, per = 16384;
        /* integer gradients: their sums are exact, so any order of reduction gives the same bits */
        for (i = 0; i < n; i++) { /* and the reference: their average, computed here (no collective to wait at) */
            int q, sum = 0;
            for (q = 0; q < w->n; q++) sum += (q * 31 + (int)i * 7 + step * 3) % 64;
            g[i] = (float)((r * 31 + (int)i * 7 + step * 3) % 64);
            rg[i] = (float)sum / (float)w->n;
        }
        for (i = 0; i < n; i++) rp[i] -= j->lr * rg[i]; /* the reference step */
        while (end > 0) {
            size_t start = end > layer ? end - layer : 0;
            if (j->direct && (r + step) % 2) usleep(300); /* ranks out of step: some wait, some poll */
            expect_ok(w, dpar_buckets_ready(b, start, end - start), "buckets_ready", r);
            end = start;
        }
        /* the first "layer" alone: its params have taken the step (the rest may still be on the way) */
        expect_ok(w, dpar_buckets_wait_range(b, 10, layer - 10), "buckets_wait_range", r);
        if (memcmp(p + 10, rp + 10, (layer - 10) * sizeof(float)))
            note(w, "step %d rank %d: wait_range returned early", step, r);
        expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r);
        if (memcmp(p, rp, n * sizeof(float)))
            note(w, "step %d rank %d: params differ from a full step on the averaged gradients", step, r);
        for (bs = 0; bs < n; bs += per) { /* my block of each bucket holds the reduced gradients */
            dpar_block_range(n - bs < per ? n - bs : per, w->n, r, &off, &len);
            if (memcmp(g + bs + off, rg + bs + off, len * sizeof(float)))
                note(w, "rank %d: block at %zu not reduced", r, bs + off);
        }
    }
    if (r == 0 && !j->direct) { /* mistakes */
        if (dpar_buckets_set_update(NULL, p, sgd_block, &u) != DPAR_EINVAL) note(w, "NULL buckets accepted");
        if (dpar_buckets_set_update(b, NULL, sgd_block, &u) != DPAR_EINVAL) note(w, "NULL params accepted");
        if (dpar_buckets_set_update(b, g + 1, sgd_block, &u) != DPAR_EINVAL || !strstr(dpar_last_error(), "overlaps"))
            note(w, "params overlapping the gradients accepted");
    }
    if (w->n == 1) { /* mid-step: refused; then off again: a plain allreduce */
        if (j->direct) expect_ok(w, dpar_buckets_set_direct(b, 0), "buckets_set_direct off", r);
        expect_ok(w, dpar_buckets_ready(b, 0, n), "buckets_ready", r);
        if (dpar_buckets_set_update(b, NULL, NULL, NULL) != DPAR_EBUSY) note(w, "set_update mid-step accepted");
        expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r);
        expect_ok(w, dpar_buckets_set_update(b, NULL, NULL, NULL), "buckets_set_update off", r);
        memcpy(rp, p, n * sizeof(float));
        expect_ok(w, dpar_buckets_ready(b, 0, n), "buckets_ready", r);
        expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r);
        if (memcmp(p, rp, n * sizeof(float))) note(w, "params changed with the update off");
    }
    dpar_buckets_destroy(b);
    if (!j->shared) free(p);
    free(g), free(rg), free(rp);
}

/* each rank its own params, then (shared = 1) one params array for all the thread ranks: every rank
   updates its block in place and the all-gather has nothing to copy; the same result either way.
   Both again with direct buckets (dpar_buckets_set_direct: through shared memory, no messages). */
static void test_buckets_update_split(void)
{
    int n, r, shared, mode;
    size_t i;
    for (mode = 0; mode < 4; mode++)
        for (n = 1; n <= 4; n++) {
            update_job j;
            int bad = 0;
            memset(&j, 0, sizeof j);
            j.n = 300007;
            j.lr = 0.125f;
            shared = mode & 1;
            j.direct = mode >> 1;
            if (shared) {
                j.shared = (float *)malloc(j.n * sizeof(float));
                for (i = 0; i < j.n; i++) j.shared[i] = (float)(i % 1000) * 0.001f;
            }
            for (r = 0; r < n; r++) j.hits[r] = (int *)calloc(j.n, sizeof(int));
            CHECK(run_world(n, update_rank, &j) == 0);
            for (i = 0; i < j.n; i++) { /* every parameter updated by exactly one rank, once a step */
                int h = 0;
                for (r = 0; r < n; r++) h += j.hits[r][i];
                bad += h != 3 + (n == 1); /* one rank also runs a step with the update refused mid-step */
            }
            CHECK(bad == 0);
            if (n == 2) CHECK(j.hits[0][0] == 3 && j.hits[1][0] == 0); /* each rank its own block */
            for (r = 0; r < n; r++) free(j.hits[r]);
            free(j.shared);
        }
}

/* ---- direct buckets: what is refused, and a rank's mistake ends the others' wait ---- */
static void direct_errors_rank(world *w, dpar_comm *c, int r)
{
    size_t n = 5000;
    float *g = (float *)calloc(n, sizeof(float)), *p = (float *)calloc(n, sizeof(float));
    update_state u;
    dpar_buckets *b;
    dpar_status st;
    int hits[5000];
    memset(hits, 0, sizeof hits);
    u.p = p, u.g = g, u.lr = 0.5f, u.hits = hits;
    expect_ok(w, buckets_make(c, g, n, 1024 * sizeof(float), DPAR_SUM, &b), "buckets_create", r);
    if (dpar_buckets_set_direct(NULL, 1) != DPAR_EINVAL) note(w, "NULL buckets accepted");
    /* rank 0 with an update, the others without: refused on every rank, saying why */
    if (r == 0) expect_ok(w, dpar_buckets_set_update(b, p, sgd_block, &u), "set_update", r);
    st = dpar_buckets_set_direct(b, 1);
    if (st != DPAR_EINVAL || !strstr(dpar_last_error(), "update"))
        note(w, "rank %d: mixed updates: %s", r, dpar_last_error());
    if (r == 0) expect_ok(w, dpar_buckets_set_update(b, NULL, NULL, NULL), "set_update off", r);
    expect_ok(w, dpar_buckets_set_direct(b, 1), "set_direct", r);
    expect_ok(w, dpar_buckets_ready(b, 0, 10), "buckets_ready", r);
    if (dpar_buckets_wait_range(b, 0, 5) != DPAR_EINVAL || !strstr(dpar_last_error(), "not full"))
        note(w, "rank %d: wait_range on a bucket not full: %s", r, dpar_last_error());
    if (dpar_buckets_wait_range(b, n - 1, 2) != DPAR_EINVAL) note(w, "wait_range outside accepted");
    if (dpar_buckets_set_direct(b, 0) != DPAR_EBUSY) note(w, "set_direct mid-step accepted");
    expect_ok(w, dpar_buckets_ready(b, 10, n - 10), "buckets_ready", r);
    expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r); /* everyone is past set_direct's allgather */
    /* rank 1 never marks the rest: its wait says so and poisons the comm, so the others' waits end */
    expect_ok(w, dpar_buckets_ready(b, 0, 10), "buckets_ready", r);
    if (r != 1) expect_ok(w, dpar_buckets_ready(b, 10, n - 10), "buckets_ready", r);
    st = dpar_buckets_wait(b);
    if (st == DPAR_OK) note(w, "rank %d: a step with gradients never marked went through", r);
    if (r == 1 && !strstr(dpar_last_error(), "never marked ready")) note(w, "rank 1: %s", dpar_last_error());
    dpar_buckets_destroy(b);
    free(g), free(p);
}

/* direct buckets of 1024 floats over g */
static dpar_buckets *direct_buckets(world *w, dpar_comm *c, int r, float *g, size_t n, dpar_op op)
{
    dpar_buckets *b = NULL;
    expect_ok(w, buckets_make(c, g, n, 1024 * sizeof(float), op, &b), "buckets_create", r);
    expect_ok(w, dpar_buckets_set_direct(b, 1), "set_direct", r);
    return b;
}

/* a rank that never comes: the others' waits time out, naming it and what it did not do */
static void direct_timeout_rank(world *w, dpar_comm *c, int r)
{
    size_t n = 3000;
    float *g = (float *)calloc(n, sizeof(float));
    dpar_buckets *b;
    dpar_status st;
    b = direct_buckets(w, c, r, g, n, DPAR_AVG);
    if (r == 1) {
        usleep(400 * 1000); /* the others time out meanwhile */
    } else {
        expect_ok(w, dpar_buckets_ready(b, 0, n), "buckets_ready", r);
        st = dpar_buckets_wait(b);
        if (st != DPAR_ETIMEDOUT || !strstr(dpar_last_error(), "waiting for rank 1 to mark its gradients"))
            note(w, "rank %d: %s: %s", r, dpar_status_string(st), dpar_last_error());
    }
    dpar_buckets_destroy(b);
    free(g);
}

/* ranks that disagree: bucket size, op, params shared by some ranks only, one rank mid-step */
static float two_share[4096];
static void direct_disagree_rank(world *w, dpar_comm *c, int r)
{
    size_t n = 4096;
    float *g = (float *)calloc(n, sizeof(float)), *p = (float *)calloc(n, sizeof(float));
    update_state u;
    dpar_buckets *b;
    dpar_status st;
    int k, hits[4096];
    u.p = p, u.g = g, u.lr = 0.5f, u.hits = hits, u.slow = 0;
    for (k = 0; k < (w->user ? 4 : 3); k++) { /* case 3 poisons the comm: a world of its own */
        if (w->user && k < 3) continue;
        size_t per = k == 0 && r == 1 ? 256 : 1024;
        expect_ok(w, buckets_make(c, g, n, per * sizeof(float), k == 1 && r == 1 ? DPAR_AVG : DPAR_SUM, &b), "create",
                  r);
        if (k == 2) expect_ok(w, dpar_buckets_set_update(b, r == 2 ? p : two_share, sgd_block, &u), "set_update", r);
        if (k == 3 && r == 0) expect_ok(w, dpar_buckets_ready(b, 0, 10), "ready", r); /* mid-step on rank 0 only */
        st = dpar_buckets_set_direct(b, 1);
        if (k < 3 && (st != DPAR_EINVAL || !strstr(dpar_last_error(), k < 2 ? "buckets of" : "share")))
            note(w, "case %d rank %d: %s: %s", k, r, dpar_status_string(st), dpar_last_error());
        if (k == 3 && (st == DPAR_OK || (r == 0 && st != DPAR_EBUSY))) /* the others learn it, they do not hang */
            note(w, "mid-step on rank 0: rank %d got %s", r, dpar_status_string(st));
        dpar_buckets_destroy(b);
    }
    free(g), free(p);
}

/* one rank waits early for a range the other fills last, the other for a range the first fills
   first: both must finish (each does its own part of every bucket while it waits) */
static void direct_cross_rank(world *w, dpar_comm *c, int r)
{
    size_t n = 2048, i;
    float *g = (float *)malloc(n * sizeof(float));
    dpar_buckets *b;
    int step;
    b = direct_buckets(w, c, r, g, n, DPAR_SUM);
    for (step = 0; step < 3; step++) {
        for (i = 0; i < n; i++) g[i] = (float)(r + 1);
        if (r == 0) {
            expect_ok(w, dpar_buckets_ready(b, 0, 1024), "ready 0", r);
            expect_ok(w, dpar_buckets_ready(b, 1024, 1024), "ready 1", r);
            expect_ok(w, dpar_buckets_wait_range(b, 1024, 1024), "wait_range 1", r);
        } else {
            usleep(20000); /* rank 0 already waits for bucket 1 */
            expect_ok(w, dpar_buckets_ready(b, 0, 1024), "ready 0", r);
            expect_ok(w, dpar_buckets_wait_range(b, 0, 1024), "wait_range 0", r);
            expect_ok(w, dpar_buckets_ready(b, 1024, 1024), "ready 1", r);
        }
        expect_ok(w, dpar_buckets_wait(b), "wait", r);
        for (i = 0; i < n && g[i] == 3.0f; i++) {}
        if (i < n) note(w, "step %d rank %d: g[%zu] = %g, not 1 + 2", step, r, i, g[i]);
    }
    dpar_buckets_destroy(b);
    free(g);
}

/* a rank that leaves on an error frees its gradients at once: the others must not read them after */
static int left_and_freed;
static void direct_leave_rank(world *w, dpar_comm *c, int r)
{
    size_t n = 2048;
    float *g = (float *)calloc(n, sizeof(float));
    dpar_buckets *b;
    dpar_status st;
    b = direct_buckets(w, c, r, g, n, DPAR_SUM);
    if (r == 1) {
        expect_ok(w, dpar_buckets_ready(b, 0, 1024), "ready", r);
        if (dpar_buckets_wait(b) == DPAR_OK) note(w, "a step with gradients never marked went through"); /* poisons */
        dpar_buckets_destroy(b);
        free(g); /* under ASan, a read of it by rank 0 is a use after free */
        __atomic_store_n(&left_and_freed, 1, __ATOMIC_SEQ_CST);
        return;
    }
    while (!__atomic_load_n(&left_and_freed, __ATOMIC_SEQ_CST)) usleep(1000);
    st = dpar_buckets_ready(b, 0, 1024); /* bucket 0 is full on both: it must not be reduced now */
    if (st == DPAR_OK) note(w, "rank 0 reduced a bucket of a rank that had left");
    dpar_buckets_destroy(b);
    free(g);
}

static void test_buckets_direct_errors(void)
{
    dpar_comm_desc d;
    int n;
    for (n = 2; n <= 3; n++) CHECK(run_world(n, direct_errors_rank, NULL) == 0);
    memset(&d, 0, sizeof d);
    d.timeout_ms = 100;
    CHECK(run_world_desc(2, &d, direct_timeout_rank, NULL, NULL, 0) == 0);
    d.timeout_ms = 5000; /* a hang fails in 5 s, not 30 */
    CHECK(run_world_desc(3, &d, direct_disagree_rank, NULL, NULL, 0) == 0);
    CHECK(run_world_desc(3, &d, direct_disagree_rank, &d, NULL, 0) == 0);
    CHECK(run_world_desc(2, &d, direct_cross_rank, NULL, NULL, 0) == 0);
    CHECK(run_world_desc(2, &d, direct_leave_rank, NULL, NULL, 0) == 0);
}

/* ---- work stealing: every task runs once, done sees them in order on the owner's thread, a stuck
   rank's tasks are taken by the others, a failure ends the list with its message, and GEMM blocks
   come out bitwise as computed serially ---- */
#define ST_TASKS 24
typedef struct {
    int hits[4][ST_TASKS];    /* atomic: how often each task ran */
    int value[4][ST_TASKS];   /* what it computed */
    int seen[4];              /* done: the next index expected */
    int last_started;         /* atomic: rank 1's last task has started (on some thread) */
    int fail_task, fail_done; /* on rank 1: a task / a done index that fails (-1: none) */
    uint64_t taken[4], given[4];
    pthread_t owner[4];
} steal_job;
typedef struct {
    steal_job *j;
    world *w;
    int rank;
} steal_user;

/* dpar_steal_create over comm c for lists of at most max_tasks */
static dpar_status steal_make(dpar_comm *c, int max_tasks, dpar_steal **s)
{
    dpar_steal_desc d = {0};
    d.comm = c, d.max_tasks = max_tasks;
    return dpar_steal_create(&d, s);
}

static int steal_value(int r, int i) { return r * 1000 + i * 7 + 1; }

static dpar_status steal_task(void *user, int i, int by)
{
    steal_user *u = (steal_user *)user;
    steal_job *j = u->j;
    int r = u->rank, k;
    if (r == 1 && i == ST_TASKS - 1) __atomic_store_n(&j->last_started, 1, __ATOMIC_RELEASE);
    if (r == 1 && i == 0) /* the straggler: stuck in its first task until another rank has taken its last */
        for (k = 0; k < 5000 && !__atomic_load_n(&j->last_started, __ATOMIC_ACQUIRE); k++) usleep(1000);
    if (r == 1 && i == j->fail_task) return dpar_set_error(DPAR_EINVAL, "bad task %d", i);
    if (by < 0 || by >= u->w->n) note(u->w, "task %d of rank %d: by = %d", i, r, by);
    j->value[r][i] = steal_value(r, i);
    __atomic_fetch_add(&j->hits[r][i], 1, __ATOMIC_ACQ_REL);
    return DPAR_OK;
}

static dpar_status steal_done(void *user, int i)
{
    steal_user *u = (steal_user *)user;
    steal_job *j = u->j;
    int r = u->rank;
    if (!pthread_equal(pthread_self(), j->owner[r])) note(u->w, "rank %d: done(%d) on another thread", r, i);
    if (i != j->seen[r]) note(u->w, "rank %d: done(%d), expected done(%d)", r, i, j->seen[r]);
    if (j->value[r][i] != steal_value(r, i)) note(u->w, "rank %d: done(%d) before its task ran", r, i);
    j->seen[r] = i + 1;
    if (r == 1 && i == j->fail_done) return dpar_set_error(DPAR_EIO, "done refuses %d", i);
    return DPAR_OK;
}

static void steal_rank(world *w, dpar_comm *c, int r)
{
    steal_job *j = (steal_job *)w->user;
    steal_user u;
    dpar_steal *s = NULL, *s2 = NULL;
    dpar_status st;
    u.j = j, u.w = w, u.rank = r;
    j->owner[r] = pthread_self();
    expect_ok(w, steal_make(c, ST_TASKS, &s), "steal_create", r);
    if (!s) return;
    st = dpar_steal_run(s, ST_TASKS, steal_task, steal_done, &u);
    if (r == 1 && j->fail_task >= 0) { /* the last task fails, on the rank that took it */
        if (st != DPAR_EINVAL || !strstr(dpar_last_error(), "task 23 of rank 1 (run on rank") ||
            !strstr(dpar_last_error(), "bad task 23"))
            note(w, "rank 1: a failing task gave %s: %s", dpar_status_string(st), dpar_last_error());
    } else if (r == 1 && j->fail_done >= 0) {
        if (st != DPAR_EIO || !strstr(dpar_last_error(), "done(3) of rank 1: done refuses 3"))
            note(w, "rank 1: a failing done gave %s: %s", dpar_status_string(st), dpar_last_error());
        if (j->seen[1] != 4) note(w, "rank 1: done went on after failing (it saw %d)", j->seen[1]);
    } else {
        expect_ok(w, st, "steal_run", r);
        if (j->seen[r] != ST_TASKS) note(w, "rank %d: done saw %d of %d tasks", r, j->seen[r], ST_TASKS);
    }
    expect_ok(w, dpar_steal_run(s, r == 0 ? 1 : 0, steal_task, NULL, &u), "a round of rank 0's task 0 again", r);
    if (w->n == 1) { /* refused (and the comm poisoned, so only here) */
        if (dpar_steal_run(s, ST_TASKS + 1, steal_task, NULL, &u) != DPAR_EINVAL ||
            !strstr(dpar_last_error(), "max_tasks"))
            note(w, "a list longer than max_tasks accepted: %s", dpar_last_error());
        if (dpar_steal_run(s, 1, NULL, NULL, &u) != DPAR_EINVAL || !strstr(dpar_last_error(), "task is NULL"))
            note(w, "a NULL task accepted: %s", dpar_last_error());
        if (steal_make(c, 0, &s2) != DPAR_EINVAL || s2) note(w, "max_tasks 0 accepted");
    }
    dpar_steal_counts(s, &j->taken[r], &j->given[r]);
    dpar_steal_destroy(s);
}

static void test_steal(void)
{
    int n, mode, r, i;
    for (mode = 0; mode < 3; mode++) /* all fine; rank 1's last task fails; rank 1's done(3) fails */
        for (n = mode ? 2 : 1; n <= 4; n++) {
            steal_job j;
            uint64_t taken = 0, given = 0;
            memset(&j, 0, sizeof j);
            j.fail_task = mode == 1 ? ST_TASKS - 1 : -1;
            j.fail_done = mode == 2 ? 3 : -1;
            CHECK(run_world(n, steal_rank, &j) == 0);
            for (r = 0; r < n; r++) {
                taken += j.taken[r], given += j.given[r];
                for (i = 0; i < ST_TASKS; i++) {
                    int h = j.hits[r][i] - (r == 0 && i == 0), ok = r != 1 || mode == 0 ? h == 1 : h <= 1;
                    CHECK_MSG(ok, "n=%d mode %d: task %d of rank %d ran %d times", n, mode, i, r, h);
                    if (h) CHECK(j.value[r][i] == steal_value(r, i));
                }
            }
            CHECK_MSG(taken == given, "n=%d: %llu tasks taken, %llu given", n, (unsigned long long)taken,
                      (unsigned long long)given);
            if (n > 1) CHECK_MSG(j.given[1] > 0, "n=%d mode %d: the stuck rank's tasks were not taken", n, mode);
            else CHECK(taken == 0 && given == 0);
        }
}

/* a rank that refuses its round poisons the comm: the others' rounds end with its message; a rank
   that never comes: the others time out, naming it */
static void steal_absent_rank(world *w, dpar_comm *c, int r)
{
    int mode = *(int *)w->user;
    dpar_steal *s = NULL;
    dpar_status st;
    expect_ok(w, steal_make(c, 4, &s), "steal_create", r);
    if (!s) return;
    /* every rank's create is done before rank 1 poisons (the barrier may see the poison too) */
    if (dpar_barrier(c) != DPAR_OK && mode == 1) note(w, "rank %d: barrier: %s", r, dpar_last_error());
    if (r == 1) {
        if (mode == 0 && dpar_steal_run(s, 5, steal_task, NULL, NULL) != DPAR_EINVAL) note(w, "rank 1: n = 5 accepted");
        if (mode == 1) usleep(400 * 1000); /* the others time out meanwhile */
    } else {
        st = dpar_steal_run(s, 0, NULL, NULL, NULL);
        if (mode == 0 && (st != DPAR_EINVAL || !strstr(dpar_last_error(), "n is outside 0 to max_tasks (n = 5")))
            note(w, "rank %d: after rank 1 refused its round: %s: %s", r, dpar_status_string(st), dpar_last_error());
        if (mode == 1 &&
            (st != DPAR_ETIMEDOUT || !strstr(dpar_last_error(), "waiting for rank 1 to start its tasks of round 1")))
            note(w, "rank %d: with rank 1 absent: %s: %s", r, dpar_status_string(st), dpar_last_error());
    }
    dpar_steal_destroy(s);
}

/* a task another rank took that runs past the timeout (it waits, against the rules): its owner returns
   DPAR_ETIMEDOUT naming the task instead of waiting for ever, and the taker sees the poison after it */
typedef struct {
    int slow_done; /* atomic: the slow task has returned (its owner's state must outlive it) */
    int slow_by;   /* who ran it */
} slow_job;
static dpar_status slow_task(void *user, int i, int by)
{
    slow_job *j = (slow_job *)user;
    if (i == 0) usleep(200 * 1000); /* the owner is slow on its first task: rank 1 takes the last one */
    if (i == 1) {
        j->slow_by = by;
        usleep(1200 * 1000);
        __atomic_store_n(&j->slow_done, 1, __ATOMIC_RELEASE);
    }
    return DPAR_OK;
}
static void steal_slow_rank(world *w, dpar_comm *c, int r)
{
    slow_job *j = (slow_job *)w->user;
    dpar_steal *s = NULL;
    dpar_status st;
    uint64_t t0;
    expect_ok(w, steal_make(c, 4, &s), "steal_create", r);
    if (!s) return;
    t0 = dpar_time_ns();
    st = dpar_steal_run(s, r == 0 ? 2 : 0, slow_task, NULL, j);
    if (r == 0) {
        double ms = (double)(dpar_time_ns() - t0) * 1e-6;
        if (st != DPAR_ETIMEDOUT || !strstr(dpar_last_error(), "waiting for its task 1 of round 1"))
            note(w, "rank 0, its task 1 stuck on rank %d: %s: %s", j->slow_by, dpar_status_string(st),
                 dpar_last_error());
        if (ms > 1000) note(w, "rank 0 returned after %.0f ms, not at the 300 ms timeout", ms);
        for (ms = 0; ms < 5000 && !__atomic_load_n(&j->slow_done, __ATOMIC_ACQUIRE); ms += 10) /* the taker runs it */
            usleep(10 * 1000);
        if (!__atomic_load_n(&j->slow_done, __ATOMIC_ACQUIRE)) { /* it never ran: its memory must outlive us */
            note(w, "rank 0: the slow task never finished");
            return;
        }
    } else { /* its round may have ended before it looked: its next call sees the poison */
        if (st == DPAR_OK) st = dpar_barrier(c);
        if (st == DPAR_OK || !strstr(dpar_last_error(), "waiting for its task 1"))
            note(w, "rank 1 after the slow task: %s: %s", dpar_status_string(st), dpar_last_error());
    }
    dpar_steal_destroy(s);
}

static void test_steal_refused_and_absent(void)
{
    dpar_comm_desc d;
    int mode, n;
    memset(&d, 0, sizeof d);
    d.timeout_ms = 100;
    for (mode = 0; mode < 2; mode++)
        for (n = 2; n <= 3; n++) CHECK(run_world_desc(n, &d, steal_absent_rank, &mode, NULL, 0) == 0);
    {
        slow_job j;
        memset(&j, 0, sizeof j);
        d.timeout_ms = 300;
        CHECK(run_world_desc(2, &d, steal_slow_rank, &j, NULL, 0) == 0);
        CHECK(j.slow_by == 1); /* it was taken: the case tested what it says */
    }
}

/* GEMM blocks as tasks, the example's use: C_r = A_r^T D_r in blocks of 16 rows, rank 1 slow; the
   result is bitwise the one of the same calls made one after the other */
#define SG_M 200
#define SG_N 96
#define SG_K 64
#define SG_TASKS ((SG_M + 15) / 16)
typedef struct {
    float *A[4], *D[4], *C[4];
    uint64_t given[4];
} gemm_steal_job;
typedef struct {
    gemm_steal_job *j;
    int rank;
} gemm_steal_user;

static dpar_status gemm_block(float *A, float *D, float *C, int i)
{
    int r0 = 16 * i, nr = SG_M - r0 < 16 ? SG_M - r0 : 16;
    return dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, nr, SG_N, SG_K, 1.0f, A + r0, SG_M, D, SG_N, 0.0f,
                      C + (size_t)r0 * SG_N, SG_N);
}

static dpar_status gemm_steal_task(void *user, int i, int by)
{
    gemm_steal_user *u = (gemm_steal_user *)user;
    if (u->rank == 1) usleep(2000); /* a slow rank */
    (void)by;
    return gemm_block(u->j->A[u->rank], u->j->D[u->rank], u->j->C[u->rank], i);
}

static void gemm_steal_rank(world *w, dpar_comm *c, int r)
{
    gemm_steal_job *j = (gemm_steal_job *)w->user;
    gemm_steal_user u;
    dpar_steal *s = NULL;
    u.j = j, u.rank = r;
    expect_ok(w, steal_make(c, SG_TASKS, &s), "steal_create", r);
    if (!s) return;
    expect_ok(w, dpar_steal_run(s, SG_TASKS, gemm_steal_task, NULL, &u), "steal_run", r);
    dpar_steal_counts(s, NULL, &j->given[r]);
    dpar_steal_destroy(s);
}

static void test_steal_gemm_bitwise(void)
{
    int n, r, i;
    uint64_t seed = 5;
    gemm_steal_job j;
    float *ref = (float *)malloc(sizeof(float) * SG_M * SG_N);
    memset(&j, 0, sizeof j);
    for (r = 0; r < 4; r++) {
        j.A[r] = (float *)malloc(sizeof(float) * SG_K * SG_M);
        j.D[r] = (float *)malloc(sizeof(float) * SG_K * SG_N);
        j.C[r] = (float *)malloc(sizeof(float) * SG_M * SG_N);
        for (i = 0; i < SG_K * SG_M; i++)
            j.A[r][i] =
                (float)((seed = seed * 6364136223846793005ull + 1442695040888963407ull) >> 40) / 8388608.0f - 1.0f;
        for (i = 0; i < SG_K * SG_N; i++)
            j.D[r][i] =
                (float)((seed = seed * 6364136223846793005ull + 1442695040888963407ull) >> 40) / 8388608.0f - 1.0f;
    }
    for (n = 1; n <= 4; n++) {
        for (r = 0; r < 4; r++) memset(j.C[r], 0xff, sizeof(float) * SG_M * SG_N); /* NaN: nothing left from before */
        CHECK(run_world(n, gemm_steal_rank, &j) == 0);
        for (r = 0; r < n; r++) {
            for (i = 0; i < SG_TASKS; i++) CHECK(gemm_block(j.A[r], j.D[r], ref, i) == DPAR_OK);
            CHECK_MSG(!memcmp(ref, j.C[r], sizeof(float) * SG_M * SG_N),
                      "n=%d: rank %d's blocks differ from the serial "
                      "calls (%llu of its %d tasks run by other ranks)",
                      n, r, (unsigned long long)j.given[r], SG_TASKS);
        }
    }
    for (r = 0; r < 4; r++) free(j.A[r]), free(j.D[r]), free(j.C[r]);
    free(ref);
}

/* ---- IDX ---- */
static void put_be32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static void write_bytes(const char *path, const unsigned char *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (n) fwrite(b, 1, n, f);
    fclose(f);
}

static void test_idx_reader(void)
{
    char path[] = "/tmp/dpar_idx_XXXXXX";
    unsigned char buf[4 + 12 + 2 * 3 * 4 * 4];
    dpar_idx idx;
    dpar_idx_desc id = {0}; /* scale 0: 1 */
    int fd = mkstemp(path), i;
    float v;
    uint32_t u;
    close(fd);
    /* u8, 3 dims: 2 x 3 x 4 */
    buf[0] = buf[1] = 0;
    buf[2] = 0x08;
    buf[3] = 3;
    put_be32(buf + 4, 2);
    put_be32(buf + 8, 3);
    put_be32(buf + 12, 4);
    for (i = 0; i < 24; i++) buf[16 + i] = (unsigned char)(i * 10);
    write_bytes(path, buf, 16 + 24);
    id.path = path, id.scale = 1.0f / 255;
    CHECK(dpar_idx_init(&idx, &id) == DPAR_OK);
    CHECK(idx.ndims == 3 && idx.dims[0] == 2 && idx.dims[2] == 4 && idx.count == 24);
    CHECK(idx.data[23] == 230.0f * (1.0f / 255));
    CHECK(dpar_idx_destroy(&idx) == DPAR_OK && idx.data == NULL && idx.count == 0);
    CHECK(dpar_idx_destroy(&idx) == DPAR_OK && dpar_idx_destroy(NULL) == DPAR_OK);
    id.scale = 0;
    /* f32, 1 dim */
    buf[2] = 0x0D;
    buf[3] = 1;
    put_be32(buf + 4, 3);
    for (i = 0; i < 3; i++) {
        v = 1.5f * (float)i - 1;
        memcpy(&u, &v, 4);
        put_be32(buf + 8 + 4 * i, u);
    }
    write_bytes(path, buf, 8 + 12);
    CHECK(dpar_idx_init(&idx, &id) == DPAR_OK);
    CHECK(idx.count == 3 && idx.data[0] == -1.0f && idx.data[2] == 2.0f);
    dpar_idx_destroy(&idx);
    /* malformed: each gives its own clear error, never a crash */
    write_bytes(path, buf, 8 + 11); /* one byte short */
    CHECK(dpar_idx_init(&idx, &id) == DPAR_ECORRUPT && strstr(dpar_last_error(), "truncated"));
    write_bytes(path, buf, 6); /* inside the header */
    CHECK(dpar_idx_init(&idx, &id) == DPAR_ECORRUPT && strstr(dpar_last_error(), "inside its header"));
    write_bytes(path, buf, 3);
    CHECK(dpar_idx_init(&idx, &id) == DPAR_ECORRUPT && strstr(dpar_last_error(), "too short"));
    write_bytes(path, buf, 0);
    CHECK(dpar_idx_init(&idx, &id) == DPAR_ECORRUPT);
    buf[20 + 0] = 0;
    {
        unsigned char extra[8 + 12 + 1];
        memcpy(extra, buf, 20);
        extra[20] = 9;
        write_bytes(path, extra, 21);
        CHECK(dpar_idx_init(&idx, &id) == DPAR_ECORRUPT && strstr(dpar_last_error(), "extra bytes"));
    }
    buf[0] = 'P';
    write_bytes(path, buf, 20);
    CHECK(dpar_idx_init(&idx, &id) == DPAR_ECORRUPT && strstr(dpar_last_error(), "not an IDX file"));
    buf[0] = 0;
    buf[2] = 0x0B; /* i16: not supported */
    write_bytes(path, buf, 20);
    CHECK(dpar_idx_init(&idx, &id) == DPAR_EUNSUPPORTED);
    buf[2] = 0x08;
    buf[3] = 0; /* no dimensions */
    write_bytes(path, buf, 20);
    CHECK(dpar_idx_init(&idx, &id) == DPAR_ECORRUPT);
    buf[3] = 2; /* dimensions whose product overflows */
    put_be32(buf + 4, 0xffffffffu);
    put_be32(buf + 8, 0xffffffffu);
    write_bytes(path, buf, 20);
    CHECK(dpar_idx_init(&idx, &id) == DPAR_ECORRUPT);
    remove(path);
    id.path = "/nonexistent/x.idx";
    CHECK(dpar_idx_init(&idx, &id) == DPAR_EIO && idx.ndims == 0);
    CHECK(dpar_idx_init(&idx, NULL) == DPAR_EINVAL);
    id.path = path;
    /* random garbage of every length: never a crash */
    for (i = 0; i < 200; i++) {
        unsigned char g[64];
        size_t k, len = (size_t)dt_rand_int(64);
        for (k = 0; k < len; k++) g[k] = (unsigned char)dt_rand();
        if (len > 3) g[0] = g[1] = 0;
        write_bytes(path, g, len);
        if (dpar_idx_init(&idx, &id) == DPAR_OK) dpar_idx_destroy(&idx);
    }
    remove(path);
}

/* ---- checkpoints ---- */
static void test_checkpoint_single(void)
{
    char dir[] = "/tmp/dpar_ckpt_XXXXXX", path[256], shard[300];
    float params[1000], back[1000];
    int64_t step = 7, step2 = 0;
    dpar_ckpt_item items[2], in[2];
    int i;
    FILE *f;
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/model", dir);
    for (i = 0; i < 1000; i++) params[i] = (float)i * 0.5f;
    memset(items, 0, sizeof items); /* no shard plan: each item this rank's own */
    items[0].name = "params";
    items[0].data = params;
    items[0].bytes = sizeof params;
    items[1].name = "step";
    items[1].data = &step;
    items[1].bytes = sizeof step;
    in[0] = items[0];
    in[0].data = back;
    in[1] = items[1];
    in[1].data = &step2;
    CHECK(dpar_ckpt_load(NULL, path, in, 2) == DPAR_EIO && strstr(dpar_last_error(), "no checkpoint at"));
    CHECK(dpar_ckpt_save(NULL, path, items, 2) == DPAR_OK);
    CHECK(dpar_ckpt_load(NULL, path, in, 2) == DPAR_OK && !memcmp(back, params, sizeof back) && step2 == 7);
    /* a second save: generation 2 replaces 1, whose shard is removed */
    step = 8;
    CHECK(dpar_ckpt_save(NULL, path, items, 2) == DPAR_OK);
    snprintf(shard, sizeof shard, "%s.g1.r0", path);
    CHECK(access(shard, F_OK) != 0);
    CHECK(dpar_ckpt_load(NULL, path, in, 2) == DPAR_OK && step2 == 8);
    /* a crash after the new shard but before the manifest: the previous checkpoint still loads */
    snprintf(shard, sizeof shard, "%s.g3.r0", path);
    f = fopen(shard, "wb");
    fputs("half a shard", f);
    fclose(f);
    CHECK(dpar_ckpt_load(NULL, path, in, 2) == DPAR_OK && step2 == 8);
    remove(shard);
    /* damage: one flipped byte in the shard */
    snprintf(shard, sizeof shard, "%s.g2.r0", path);
    f = fopen(shard, "r+b");
    fseek(f, 200, SEEK_SET);
    fputc(0x55, f);
    fclose(f);
    step2 = -1;
    CHECK(dpar_ckpt_load(NULL, path, in, 2) == DPAR_ECORRUPT && strstr(dpar_last_error(), "the manifest says"));
    CHECK(step2 == -1); /* nothing was loaded */
    { /* the same damage, with the manifest rewritten to the damaged shard's size and CRC: each item's own CRC
         catches it (the two checks stand on their own) */
        unsigned char man[64], sh[4096];
        size_t mn, sn;
        uint32_t crc;
        int k;
        FILE *fm = fopen(path, "rb"), *fs = fopen(shard, "rb");
        mn = fread(man, 1, sizeof man, fm);
        sn = fread(sh, 1, sizeof sh, fs);
        fclose(fm), fclose(fs);
        CHECK(mn == 20 + 12 + 4 + 4 && sn < sizeof sh); /* one rank: magic, nranks, generation, (size, crc), no
                                                           planned tensor, crc */
        crc = dpar_crc32(0, sh, sn);
        for (k = 0; k < 4; k++) man[28 + k] = (unsigned char)(crc >> (8 * k)); /* little-endian, as dpar writes */
        crc = dpar_crc32(0, man, mn - 4);
        for (k = 0; k < 4; k++) man[mn - 4 + k] = (unsigned char)(crc >> (8 * k));
        fm = fopen(path, "wb");
        fwrite(man, 1, mn, fm);
        fclose(fm);
        CHECK(dpar_ckpt_load(NULL, path, in, 2) == DPAR_ECORRUPT && strstr(dpar_last_error(), "(CRC mismatch)"));
        CHECK(step2 == -1);
    }
    /* a truncated manifest */
    CHECK(dpar_ckpt_save(NULL, path, items, 2) == DPAR_OK);
    CHECK(truncate(path, 10) == 0);
    CHECK(dpar_ckpt_load(NULL, path, in, 2) == DPAR_ECORRUPT);
    /* a flipped byte inside the manifest (in its record of the shard's CRC): the manifest's own CRC names it, not
       the shard (which is whole) */
    CHECK(dpar_ckpt_save(NULL, path, items, 2) == DPAR_OK);
    {
        long len;
        int byte;
        f = fopen(path, "r+b");
        fseek(f, 0, SEEK_END);
        len = ftell(f);
        fseek(f, len - 9, SEEK_SET); /* before the CRC: the tensor count (4 bytes), then the shard's CRC record */
        byte = fgetc(f);
        fseek(f, len - 9, SEEK_SET);
        fputc(byte ^ 0x20, f);
        fclose(f);
        CHECK(dpar_ckpt_load(NULL, path, in, 2) == DPAR_ECORRUPT &&
              strstr(dpar_last_error(), "the checkpoint manifest"));
        remove(path); /* the next save starts a new series */
    }
    /* the program asks for other items than were saved */
    CHECK(dpar_ckpt_save(NULL, path, items, 2) == DPAR_OK);
    in[1].name = "epoch";
    CHECK(dpar_ckpt_load(NULL, path, in, 2) == DPAR_ECORRUPT && strstr(dpar_last_error(), "asks for 'epoch'"));
    in[1].name = "step";
    in[0].bytes = 400;
    CHECK(dpar_ckpt_load(NULL, path, in, 2) == DPAR_ECORRUPT && strstr(dpar_last_error(), "asks for 400"));
    in[0].bytes = sizeof back;
    memset(back, 0, sizeof back);
    CHECK(dpar_ckpt_load(NULL, path, in, 1) == DPAR_OK && !memcmp(back, params, sizeof back)); /* a subset */
    items[1].name = "params";
    CHECK(dpar_ckpt_save(NULL, path, items, 2) == DPAR_EINVAL); /* two items of one name */
    {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        CHECK(system(cmd) == 0);
    }
    CHECK(dpar_crc32(0, "123456789", 9) == 0xCBF43926u); /* the standard check value */
}

typedef struct {
    char path[256];
} ckpt_job;
static void ckpt_rank(world *w, dpar_comm *c, int r)
{
    ckpt_job *j = (ckpt_job *)w->user;
    float mine[100 + 8], back[100 + 8];
    size_t n = 100 + (size_t)r; /* every rank its own shard size */
    dpar_ckpt_item it, in;
    int i;
    for (i = 0; i < (int)n; i++) mine[i] = (float)(r * 1000 + i);
    it = dpar_ckpt_own("shard", mine, n * sizeof(float));
    in = it;
    in.data = back;
    expect_ok(w, dpar_ckpt_save(c, j->path, &it, 1), "save", r);
    memset(back, 0, sizeof back);
    expect_ok(w, dpar_ckpt_load(c, j->path, &in, 1), "load", r);
    if (memcmp(back, mine, n * sizeof(float))) note(w, "rank %d loaded another shard", r);
    /* damage on one rank's shard: every rank fails */
    dpar_barrier(c);
    if (r == w->n - 1) {
        char shard[300];
        FILE *f;
        snprintf(shard, sizeof shard, "%s.g1.r%d", j->path, r);
        f = fopen(shard, "r+b");
        fseek(f, -1, SEEK_END);
        fputc(0x33, f);
        fclose(f);
    }
    dpar_barrier(c);
    if (dpar_ckpt_load(c, j->path, &in, 1) != DPAR_ECORRUPT) note(w, "rank %d did not see the damage", r);
}

static void test_checkpoint_over_ranks(void)
{
    int n;
    for (n = 1; n <= 4; n++) {
        ckpt_job j;
        char dir[] = "/tmp/dpar_ckpt_XXXXXX", cmd[300];
        CHECK(mkdtemp(dir) != NULL);
        snprintf(j.path, sizeof j.path, "%s/run", dir);
        CHECK(run_world(n, ckpt_rank, &j) == 0);
        if (n > 1) { /* a checkpoint of n ranks does not load into one */
            float back[100];
            dpar_ckpt_item in;
            in = dpar_ckpt_own("shard", back, sizeof back);
            CHECK(dpar_ckpt_load(NULL, j.path, &in, 1) == DPAR_ECORRUPT &&
                  strstr(dpar_last_error(), "shards, this job 1 ranks"));
        }
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        CHECK(system(cmd) == 0);
    }
}

/* dpar_ckpt_check: what a run learns before its first step, each case against the file system as the test made it */
static void test_checkpoint_check(void)
{
    char dir[] = "/tmp/dpar_ckchk_XXXXXX", path[256], other[256], missing[256], slashed[256];
    float params[16] = {1, 2, 3};
    dpar_ckpt_item item = dpar_ckpt_replica("params", params, sizeof params);
    FILE *f;
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/run.ckpt", dir);
    snprintf(other, sizeof other, "%s/notes.txt", dir);
    snprintf(missing, sizeof missing, "%s/no/such/dir/run.ckpt", dir);
    snprintf(slashed, sizeof slashed, "%s/", dir);
    /* nothing there yet: a fresh run is fine, a resume is not */
    CHECK(dpar_ckpt_check(path, 0) == DPAR_OK);
    CHECK(dpar_ckpt_check(path, DPAR_CKPT_OVERWRITE) == DPAR_OK);
    CHECK(dpar_ckpt_check(path, DPAR_CKPT_RESUME) == DPAR_EIO);
    CHECK(strstr(dpar_last_error(), "no checkpoint at") != NULL);
    /* a checkpoint there: a fresh run must not replace it unasked */
    CHECK(dpar_ckpt_save(NULL, path, &item, 1) == DPAR_OK);
    CHECK(dpar_ckpt_check(path, 0) == DPAR_EEXIST);
    CHECK_MSG(strstr(dpar_last_error(), "a checkpoint exists at") && strstr(dpar_last_error(), path), "%s",
              dpar_last_error());
    CHECK(dpar_ckpt_check(path, DPAR_CKPT_RESUME) == DPAR_OK);
    CHECK(dpar_ckpt_check(path, DPAR_CKPT_OVERWRITE) == DPAR_OK);
    /* a file that is not a checkpoint: not replaced unasked, not resumed from */
    f = fopen(other, "w");
    CHECK(f != NULL);
    if (f) fputs("my notes\n", f), fclose(f);
    CHECK(dpar_ckpt_check(other, 0) == DPAR_EEXIST);
    CHECK(strstr(dpar_last_error(), "is not a dpar checkpoint") != NULL);
    CHECK(dpar_ckpt_check(other, DPAR_CKPT_RESUME) == DPAR_EIO);
    /* paths that cannot take a checkpoint, whatever the flags */
    CHECK(dpar_ckpt_check(dir, DPAR_CKPT_OVERWRITE) == DPAR_EINVAL);
    CHECK(strstr(dpar_last_error(), "is a directory") != NULL);
    CHECK(dpar_ckpt_check(slashed, 0) == DPAR_EINVAL);
    CHECK(dpar_ckpt_check(missing, 0) == DPAR_EIO);
    CHECK(strstr(dpar_last_error(), "does not exist") != NULL);
    CHECK(dpar_ckpt_check("/proc/dpar_ckpt_check_test", 0) == DPAR_EIO); /* no file can be made there, even by root */
    CHECK(dpar_ckpt_check(NULL, 0) == DPAR_EINVAL);
    CHECK(dpar_ckpt_check("", 0) == DPAR_EINVAL);
    CHECK(dpar_ckpt_check(path, DPAR_CKPT_RESUME | DPAR_CKPT_OVERWRITE) == DPAR_EINVAL);
    /* the probe it writes is gone: the directory holds the checkpoint's two files and the notes */
    {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "test $(ls -A '%s' | wc -l) = 3", dir);
        CHECK(system(cmd) == 0);
    }
    remove(other);
    remove(path);
    {
        char shard[300];
        snprintf(shard, sizeof shard, "%s.g1.r0", path);
        remove(shard);
    }
    rmdir(dir);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_sampler);
    RUN(test_buckets_match_allreduce);
    RUN(test_buckets_update_split);
    RUN(test_buckets_direct_errors);
    RUN(test_steal);
    RUN(test_steal_refused_and_absent);
    RUN(test_steal_gemm_bitwise);
    RUN(test_idx_reader);
    RUN(test_checkpoint_single);
    RUN(test_checkpoint_over_ranks);
    RUN(test_checkpoint_check);
    pools_free();
    return dt_summary();
}
