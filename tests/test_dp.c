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
                const size_t *idx, *idx2;
                CHECK(dpar_sampler_init(&s, n, ranks, r, 42, drop, NULL) == DPAR_OK);
                CHECK(dpar_sampler_init(&t, n, ranks, r, 42, drop, NULL) == DPAR_OK);
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
                dpar_sampler_free(&s);
                dpar_sampler_free(&t);
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
        CHECK(dpar_sampler_init(&s, 0, 1, 0, 1, 0, NULL) == DPAR_EINVAL);
        CHECK(dpar_sampler_init(&s, 10, 2, 2, 1, 0, NULL) == DPAR_EINVAL);
        CHECK(dpar_sampler_init(&s, 2, 3, 0, 1, 1, NULL) == DPAR_EINVAL);
    }
}

/* ---- buckets: backward marks layers from the last to the first; compare with one allreduce ---- */
typedef struct { size_t n; int errors_case; uint64_t overlap[8]; int nb, direct; } bucket_job;

static void bucket_rank(world *w, dpar_comm *c, int r)
{
    bucket_job *j = (bucket_job *)w->user;
    size_t n = j->n, i, layer = n / 5;
    float *g = (float *)malloc(n * sizeof(float)), *ref = (float *)malloc(n * sizeof(float));
    dpar_buckets *b;
    int step;
    expect_ok(w, dpar_buckets_create(c, g, n, 64 * 1024, DPAR_AVG, &b), "buckets_create", r);
    if (j->direct) expect_ok(w, dpar_buckets_set_direct(b, 1), "buckets_set_direct", r);
    for (step = 0; step < 3; step++) {
        size_t end = n;
        for (i = 0; i < n; i++) g[i] = ref[i] = (float)((r * 31 + (int)i * 7 + step * 3) % 64);
        while (end > 0) { /* backward: the last layer's gradients are final first */
            size_t start = end > layer ? end - layer : 0;
            usleep(200 + (unsigned)((r * 137 + step * 59 + (int)(end % 97)) % 300)); /* the layer's backward */
            expect_ok(w, dpar_buckets_ready(b, start, end - start), "buckets_ready", r);
            end = start;
        }
        expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r);
        expect_ok(w, dpar_allreduce(c, ref, ref, n, DPAR_F32, DPAR_AVG), "allreduce", r);
        if (memcmp(g, ref, n * sizeof(float))) note(w, "step %d rank %d: buckets differ from one allreduce", step, r);
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
    if (dpar_buckets_ready(b, 0, 10) != DPAR_OK || dpar_buckets_ready(b, 5, 10) != DPAR_EINVAL) note(w, "overlap accepted");
    if (!strstr(dpar_last_error(), "already marked")) note(w, "message: %s", dpar_last_error());
    if (dpar_buckets_ready(b, n - 1, 2) != DPAR_EINVAL) note(w, "outside accepted");
    if (dpar_buckets_wait(b) != DPAR_EINVAL || !strstr(dpar_last_error(), "never marked ready")) note(w, "unmarked accepted");
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
typedef struct { size_t n; int *hits[4]; float lr; float *shared; int direct; } update_job; /* shared: one params for all ranks */
typedef struct { float *p, *g, lr; int *hits, slow; } update_state;

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
    expect_ok(w, dpar_buckets_create(c, g, n, 64 * 1024, DPAR_AVG, &b), "buckets_create", r);
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
        if (memcmp(p + 10, rp + 10, (layer - 10) * sizeof(float))) note(w, "step %d rank %d: wait_range returned early", step, r);
        expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r);
        if (memcmp(p, rp, n * sizeof(float))) note(w, "step %d rank %d: params differ from a full step on the averaged gradients", step, r);
        for (bs = 0; bs < n; bs += per) { /* my block of each bucket holds the reduced gradients */
            dpar_block_range(n - bs < per ? n - bs : per, w->n, r, &off, &len);
            if (memcmp(g + bs + off, rg + bs + off, len * sizeof(float))) note(w, "rank %d: block at %zu not reduced", r, bs + off);
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
    expect_ok(w, dpar_buckets_create(c, g, n, 1024 * sizeof(float), DPAR_SUM, &b), "buckets_create", r);
    if (dpar_buckets_set_direct(NULL, 1) != DPAR_EINVAL) note(w, "NULL buckets accepted");
    /* rank 0 with an update, the others without: refused on every rank, saying why */
    if (r == 0) expect_ok(w, dpar_buckets_set_update(b, p, sgd_block, &u), "set_update", r);
    st = dpar_buckets_set_direct(b, 1);
    if (st != DPAR_EINVAL || !strstr(dpar_last_error(), "update")) note(w, "rank %d: mixed updates: %s", r, dpar_last_error());
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
    expect_ok(w, dpar_buckets_create(c, g, n, 1024 * sizeof(float), op, &b), "buckets_create", r);
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
        expect_ok(w, dpar_buckets_create(c, g, n, per * sizeof(float), k == 1 && r == 1 ? DPAR_AVG : DPAR_SUM, &b), "create", r);
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
    CHECK(dpar_idx_load(path, 1.0f / 255, NULL, &idx) == DPAR_OK);
    CHECK(idx.ndims == 3 && idx.dims[0] == 2 && idx.dims[2] == 4 && idx.count == 24);
    CHECK(idx.data[23] == 230.0f * (1.0f / 255));
    dpar_idx_free(&idx);
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
    CHECK(dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_OK);
    CHECK(idx.count == 3 && idx.data[0] == -1.0f && idx.data[2] == 2.0f);
    dpar_idx_free(&idx);
    /* malformed: each gives its own clear error, never a crash */
    write_bytes(path, buf, 8 + 11); /* one byte short */
    CHECK(dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_ECORRUPT && strstr(dpar_last_error(), "truncated"));
    write_bytes(path, buf, 6); /* inside the header */
    CHECK(dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_ECORRUPT && strstr(dpar_last_error(), "inside its header"));
    write_bytes(path, buf, 3);
    CHECK(dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_ECORRUPT && strstr(dpar_last_error(), "too short"));
    write_bytes(path, buf, 0);
    CHECK(dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_ECORRUPT);
    buf[20 + 0] = 0;
    {
        unsigned char extra[8 + 12 + 1];
        memcpy(extra, buf, 20);
        extra[20] = 9;
        write_bytes(path, extra, 21);
        CHECK(dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_ECORRUPT && strstr(dpar_last_error(), "extra bytes"));
    }
    buf[0] = 'P';
    write_bytes(path, buf, 20);
    CHECK(dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_ECORRUPT && strstr(dpar_last_error(), "not an IDX file"));
    buf[0] = 0;
    buf[2] = 0x0B; /* i16: not supported */
    write_bytes(path, buf, 20);
    CHECK(dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_EUNSUPPORTED);
    buf[2] = 0x08;
    buf[3] = 0; /* no dimensions */
    write_bytes(path, buf, 20);
    CHECK(dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_ECORRUPT);
    buf[3] = 2; /* dimensions whose product overflows */
    put_be32(buf + 4, 0xffffffffu);
    put_be32(buf + 8, 0xffffffffu);
    write_bytes(path, buf, 20);
    CHECK(dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_ECORRUPT);
    remove(path);
    CHECK(dpar_idx_load("/nonexistent/x.idx", 1.0f, NULL, &idx) == DPAR_EIO);
    /* random garbage of every length: never a crash */
    for (i = 0; i < 200; i++) {
        unsigned char g[64];
        size_t k, len = (size_t)dt_rand_int(64);
        for (k = 0; k < len; k++) g[k] = (unsigned char)dt_rand();
        if (len > 3) g[0] = g[1] = 0;
        write_bytes(path, g, len);
        if (dpar_idx_load(path, 1.0f, NULL, &idx) == DPAR_OK) dpar_idx_free(&idx);
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
    CHECK(dpar_checkpoint_load(NULL, path, in, 2) == DPAR_EIO && strstr(dpar_last_error(), "no checkpoint at"));
    CHECK(dpar_checkpoint_save(NULL, path, items, 2) == DPAR_OK);
    CHECK(dpar_checkpoint_load(NULL, path, in, 2) == DPAR_OK && !memcmp(back, params, sizeof back) && step2 == 7);
    /* a second save: generation 2 replaces 1, whose shard is removed */
    step = 8;
    CHECK(dpar_checkpoint_save(NULL, path, items, 2) == DPAR_OK);
    snprintf(shard, sizeof shard, "%s.g1.r0", path);
    CHECK(access(shard, F_OK) != 0);
    CHECK(dpar_checkpoint_load(NULL, path, in, 2) == DPAR_OK && step2 == 8);
    /* a crash after the new shard but before the manifest: the previous checkpoint still loads */
    snprintf(shard, sizeof shard, "%s.g3.r0", path);
    f = fopen(shard, "wb");
    fputs("half a shard", f);
    fclose(f);
    CHECK(dpar_checkpoint_load(NULL, path, in, 2) == DPAR_OK && step2 == 8);
    remove(shard);
    /* damage: one flipped byte in the shard */
    snprintf(shard, sizeof shard, "%s.g2.r0", path);
    f = fopen(shard, "r+b");
    fseek(f, 200, SEEK_SET);
    fputc(0x55, f);
    fclose(f);
    step2 = -1;
    CHECK(dpar_checkpoint_load(NULL, path, in, 2) == DPAR_ECORRUPT && strstr(dpar_last_error(), "is damaged"));
    CHECK(step2 == -1); /* nothing was loaded */
    /* a truncated manifest */
    CHECK(dpar_checkpoint_save(NULL, path, items, 2) == DPAR_OK);
    CHECK(truncate(path, 10) == 0);
    CHECK(dpar_checkpoint_load(NULL, path, in, 2) == DPAR_ECORRUPT);
    /* the program asks for other items than were saved */
    CHECK(dpar_checkpoint_save(NULL, path, items, 2) == DPAR_OK);
    in[1].name = "epoch";
    CHECK(dpar_checkpoint_load(NULL, path, in, 2) == DPAR_ECORRUPT && strstr(dpar_last_error(), "asks for 'epoch'"));
    in[1].name = "step";
    in[0].bytes = 400;
    CHECK(dpar_checkpoint_load(NULL, path, in, 2) == DPAR_ECORRUPT && strstr(dpar_last_error(), "asks for 400"));
    CHECK(dpar_checkpoint_load(NULL, path, in, 1) == DPAR_ECORRUPT);
    items[1].name = "params";
    CHECK(dpar_checkpoint_save(NULL, path, items, 2) == DPAR_EINVAL); /* two items of one name */
    {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        CHECK(system(cmd) == 0);
    }
    CHECK(dpar_crc32(0, "123456789", 9) == 0xCBF43926u); /* the standard check value */
}

typedef struct { char path[256]; } ckpt_job;
static void ckpt_rank(world *w, dpar_comm *c, int r)
{
    ckpt_job *j = (ckpt_job *)w->user;
    float mine[100 + 8], back[100 + 8];
    size_t n = 100 + (size_t)r; /* every rank its own shard size */
    dpar_ckpt_item it, in;
    int i;
    for (i = 0; i < (int)n; i++) mine[i] = (float)(r * 1000 + i);
    it.name = "shard";
    it.data = mine;
    it.bytes = n * sizeof(float);
    in = it;
    in.data = back;
    expect_ok(w, dpar_checkpoint_save(c, j->path, &it, 1), "save", r);
    memset(back, 0, sizeof back);
    expect_ok(w, dpar_checkpoint_load(c, j->path, &in, 1), "load", r);
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
    if (dpar_checkpoint_load(c, j->path, &in, 1) != DPAR_ECORRUPT) note(w, "rank %d did not see the damage", r);
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
            in.name = "shard", in.data = back, in.bytes = sizeof back;
            CHECK(dpar_checkpoint_load(NULL, j.path, &in, 1) == DPAR_ECORRUPT && strstr(dpar_last_error(), "shards, this job 1 ranks"));
        }
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        CHECK(system(cmd) == 0);
    }
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_sampler);
    RUN(test_buckets_match_allreduce);
    RUN(test_buckets_update_split);
    RUN(test_buckets_direct_errors);
    RUN(test_idx_reader);
    RUN(test_checkpoint_single);
    RUN(test_checkpoint_over_ranks);
    pools_free();
    return dt_summary();
}
