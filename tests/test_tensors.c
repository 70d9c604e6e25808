/* test_tensors.c - the tensor form (dpar_tensor lists: a model's arrays where they live) against the flat form and a
   serial reference: gradient buckets and ZeRO-1 over five separately allocated arrays, and dpar_fsdp (stages 2 and 3)
   over units of separate arrays, must give bitwise what the flat form gives (itself checked against a serial
   reference here, or in test_fsdp.c), on 1 to 4 thread ranks; bad lists are refused with a message naming the tensor.
   Build and run: make build/test_tensors && build/test_tensors   (one test: build/test_tensors buckets) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>

#include "dpar_test.h"
#include "coll_matrix.h"

/* five arrays of uneven sizes; with 64 KiB buckets (16384 floats) some buckets lie inside one array (reduced in
   place) and some span two or more (staged) */
#define NT 5
static const size_t tn[NT] = {20000, 33, 40001, 5, 16391};
static size_t tn_total(void) { return tn[0] + tn[1] + tn[2] + tn[3] + tn[4]; }

/* rank r's gradient i at a step: a multiple of 1/64 below 1 in magnitude, so any sum over ranks is exact and the
   serial reference (sum, then one division) is bitwise what any reduction order gives */
static float tgrad(int r, int step, size_t i) { return (float)((int)((r * 31 + i * 7 + step * 3) % 64) - 32) / 64.0f; }

typedef struct {
    int steps;
    float *flat_out[8]; /* per rank: the flat form's final gradients (buckets) or parameters (ZeRO-1) */
    float *tens_out[8];
    dpar_optim kind;
} tjob;

/* ---- buckets: backward marks the arrays last to first; the flat form, then the tensor form ---- */
static void buckets_rank(world *w, dpar_comm *c, int r)
{
    tjob *j = (tjob *)w->user;
    size_t n = tn_total(), i, at;
    float *flat = (float *)malloc(n * sizeof(float)), *ref = (float *)malloc(n * sizeof(float)), *t[NT];
    dpar_tensor list[NT];
    dpar_buckets_desc d;
    dpar_buckets *b = NULL;
    int k, step, form;
    memset(list, 0, sizeof list);
    for (k = 0; k < NT; k++) {
        t[k] = (float *)malloc(tn[k] * sizeof(float)); /* separately allocated, as a model's gradients are */
        list[k].data = t[k], list[k].count = tn[k];
    }
    for (form = 0; form < 2; form++) {
        memset(&d, 0, sizeof d);
        d.comm = c, d.bucket_bytes = 64 * 1024, d.op = DPAR_AVG;
        if (form == 0) d.grads = flat, d.count = n;
        else d.tensors = list, d.num_tensors = NT;
        expect_ok(w, dpar_buckets_create(&d, &b), "buckets_create", r);
        if (!b) break;
        for (step = 0; step < j->steps; step++) {
            for (i = 0; i < n; i++) {
                int q;
                float sum = 0;
                for (q = 0; q < w->n; q++) sum += tgrad(q, step, i);
                ref[i] = sum / (float)w->n;
                if (form == 0) flat[i] = tgrad(r, step, i);
            }
            for (k = 0, at = 0; form == 1 && k < NT; at += tn[k], k++)
                for (i = 0; i < tn[k]; i++) t[k][i] = tgrad(r, step, at + i);
            for (k = NT - 1, at = n; k >= 0; k--) { /* backward: the last array is final first */
                at -= tn[k];
                if (form == 0) expect_ok(w, dpar_buckets_ready(b, at, tn[k]), "buckets_ready", r);
                else expect_ok(w, dpar_buckets_ready_tensor(b, k), "buckets_ready_tensor", r);
            }
            /* the last array alone first (its buckets may span into the one before), then the step */
            expect_ok(w, dpar_buckets_wait_range(b, n - tn[NT - 1], tn[NT - 1]), "buckets_wait_range", r);
            if (form == 1 && memcmp(t[NT - 1], ref + n - tn[NT - 1], tn[NT - 1] * sizeof(float)))
                note(w, "rank %d step %d: the last tensor is not reduced after wait_range", r, step);
            expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r);
            if (form == 0 && memcmp(flat, ref, n * sizeof(float)))
                note(w, "rank %d step %d: the flat buckets differ from the serial average", r, step);
            for (k = 0, at = 0; form == 1 && k < NT; at += tn[k], k++)
                if (memcmp(t[k], ref + at, tn[k] * sizeof(float)))
                    note(w, "rank %d step %d: tensor %d differs from the serial average", r, step, k);
        }
        if (form == 1) { /* not with tensors (yet): refused on every rank alike, nobody waits */
            if (dpar_buckets_set_update(b, flat, NULL, NULL) != DPAR_EUNSUPPORTED)
                note(w, "set_update accepted with tensors");
            if (dpar_buckets_set_direct(b, 1) != DPAR_EUNSUPPORTED) note(w, "set_direct accepted with tensors");
            if (dpar_buckets_ready_tensor(b, NT) != DPAR_EINVAL || !strstr(dpar_last_error(), "no tensor 5"))
                note(w, "tensor %d accepted: %s", NT, dpar_last_error());
        }
        /* the last step's results, to compare the forms */
        j->flat_out[r] = form == 0 ? flat : j->flat_out[r];
        expect_ok(w, dpar_buckets_destroy(b), "buckets_destroy", r);
        b = NULL;
    }
    j->tens_out[r] = (float *)malloc(n * sizeof(float));
    for (k = 0, at = 0; k < NT; at += tn[k], k++) memcpy(j->tens_out[r] + at, t[k], tn[k] * sizeof(float));
    for (k = 0; k < NT; k++) free(t[k]);
    free(ref);
}

static void test_buckets_tensors_equal_flat(void)
{
    int n, r;
    for (n = 1; n <= 4; n++) {
        tjob j;
        memset(&j, 0, sizeof j);
        j.steps = 3;
        CHECK_MSG(run_world(n, buckets_rank, &j) == 0, "N=%d", n);
        for (r = 0; r < n; r++) {
            CHECK_MSG(j.flat_out[r] && j.tens_out[r] && !memcmp(j.flat_out[r], j.tens_out[r], tn_total() * 4),
                      "N=%d rank %d: the tensor form's gradients are not the flat form's", n, r);
            free(j.flat_out[r]), free(j.tens_out[r]);
        }
    }
}

/* the staging room: only the buckets that span arrays; a single array needs none (counted by the allocator) */
static void test_buckets_tensors_stage_only_spanning(void)
{
    dpar_comm_desc cd = {0};
    dpar_group *g = NULL;
    dpar_comm *c = NULL;
    dpar_buckets *b = NULL;
    dpar_buckets_desc d;
    dt_counting flat = {0, 0}, one = {0, 0}, five = {0, 0};
    float *x = (float *)calloc(tn_total(), sizeof(float)), *y[NT];
    dpar_tensor list[NT];
    int k;
    memset(list, 0, sizeof list);
    for (k = 0; k < NT; k++) y[k] = (float *)calloc(tn[k], sizeof(float)), list[k].data = y[k], list[k].count = tn[k];
    cd.size = 1;
    CHECK(dpar_group_create(&cd, &g) == DPAR_OK && dpar_group_join(g, 0, &c) == DPAR_OK);
    memset(&d, 0, sizeof d);
    d.comm = c, d.bucket_bytes = 64 * 1024, d.grads = x, d.count = tn_total();
    d.allocator.alloc = dt_count_alloc, d.allocator.free = dt_count_free, d.allocator.user = &flat;
    CHECK(dpar_buckets_create(&d, &b) == DPAR_OK && dpar_buckets_destroy(b) == DPAR_OK);
    {
        dpar_tensor whole;
        memset(&whole, 0, sizeof whole);
        whole.data = x, whole.count = tn_total();
        d.grads = NULL, d.count = 0, d.tensors = &whole, d.num_tensors = 1, d.allocator.user = &one;
        CHECK(dpar_buckets_create(&d, &b) == DPAR_OK && dpar_buckets_destroy(b) == DPAR_OK);
    }
    d.tensors = list, d.num_tensors = NT, d.allocator.user = &five;
    CHECK(dpar_buckets_create(&d, &b) == DPAR_OK && dpar_buckets_destroy(b) == DPAR_OK);
    /* one array: its list, numbering, bucket places and flags (4 allocations), no staging */
    CHECK_MSG(one.allocs == flat.allocs + 4 && one.frees == one.allocs, "%ld allocations, flat %ld", (long)one.allocs,
              (long)flat.allocs);
    CHECK(five.allocs == flat.allocs + 5 && five.frees == five.allocs); /* and the staging room */
    dpar_comm_destroy(c);
    dpar_group_destroy(g);
    free(x);
    for (k = 0; k < NT; k++) free(y[k]);
}

/* ---- ZeRO-1: the flat form and the tensor form on the same gradients; a serial reference ---- */
static void zero_ref(dpar_optim kind, float *p, const float *g, float *m, float *v, size_t n, long t)
{
    size_t i;
    if (kind == DPAR_OPTIM_SGD) {
        for (i = 0; i < n; i++) {
            float gi = g[i] + 0.01f * p[i];
            m[i] = 0.9f * m[i] + gi;
            p[i] -= 0.05f * m[i];
        }
    } else {
        float c1 = 1.0f - powf(0.9f, (float)t), c2 = 1.0f - powf(0.999f, (float)t);
        for (i = 0; i < n; i++) {
            m[i] = 0.9f * m[i] + (1.0f - 0.9f) * g[i];
            v[i] = 0.999f * v[i] + (1.0f - 0.999f) * g[i] * g[i];
            p[i] -= 0.05f * ((m[i] / c1) / (sqrtf(v[i] / c2) + 1e-8f) + 0.01f * p[i]);
        }
    }
}

static float tinit(size_t i) { return (float)((int)(i % 29) - 14) / 16.0f; }

static void zero_rank(world *w, dpar_comm *c, int r)
{
    tjob *j = (tjob *)w->user;
    size_t n = tn_total(), i, at;
    float *fp = (float *)malloc(n * 4), *fg = (float *)malloc(n * 4), *rp = (float *)malloc(n * 4);
    float *rg = (float *)malloc(n * 4), *rm = (float *)calloc(n, 4), *rv = (float *)calloc(n, 4), *tp[NT], *tg[NT];
    dpar_tensor params[NT], grads[NT];
    dpar_zero_desc d;
    dpar_zero *zf = NULL, *zt = NULL;
    int k, step;
    memset(params, 0, sizeof params), memset(grads, 0, sizeof grads);
    for (k = 0, at = 0; k < NT; at += tn[k], k++) {
        tp[k] = (float *)malloc(tn[k] * 4), tg[k] = (float *)malloc(tn[k] * 4);
        params[k].data = tp[k], params[k].count = tn[k], grads[k].data = tg[k], grads[k].count = tn[k];
        for (i = 0; i < tn[k]; i++) tp[k][i] = tinit(at + i);
    }
    for (i = 0; i < n; i++) fp[i] = rp[i] = tinit(i);
    memset(&d, 0, sizeof d);
    d.comm = c, d.kind = j->kind, d.lr = 0.05f, d.momentum = 0.9f, d.weight_decay = 0.01f, d.count = n;
    expect_ok(w, dpar_zero_create(&d, &zf), "zero_create (flat)", r);
    d.count = 0, d.params = params, d.grads = grads, d.num_tensors = NT;
    expect_ok(w, dpar_zero_create(&d, &zt), "zero_create (tensors)", r);
    for (step = 0; step < j->steps && zf && zt; step++) {
        for (i = 0; i < n; i++) {
            int q;
            float sum = 0;
            for (q = 0; q < w->n; q++) sum += tgrad(q, step, i);
            rg[i] = sum / (float)w->n;
            fg[i] = tgrad(r, step, i);
        }
        for (k = 0, at = 0; k < NT; at += tn[k], k++)
            for (i = 0; i < tn[k]; i++) tg[k][i] = tgrad(r, step, at + i);
        zero_ref(j->kind, rp, rg, rm, rv, n, step + 1);
        expect_ok(w, dpar_zero_step(zf, fp, fg), "zero_step (flat)", r);
        expect_ok(w, dpar_zero_step(zt, NULL, NULL), "zero_step (tensors)", r);
        if (memcmp(fp, rp, n * 4)) note(w, "rank %d step %d: the flat form differs from the serial step", r, step);
        for (k = 0, at = 0; k < NT; at += tn[k], k++) {
            if (memcmp(tp[k], fp + at, tn[k] * 4))
                note(w, "rank %d step %d: params tensor %d differs from the flat form", r, step, k);
            for (i = 0; i < tn[k] && step == 0; i++) /* the gradient tensors are left as they were */
                if (tg[k][i] != tgrad(r, step, at + i)) {
                    note(w, "rank %d: gradient tensor %d element %zu changed", r, k, i);
                    break;
                }
        }
    }
    if (zt && (dpar_zero_step(zt, fp, NULL) != DPAR_EINVAL || dpar_zero_step(zf, NULL, NULL) != DPAR_EINVAL))
        note(w, "a half NULL step, or NULL, NULL on the flat form, accepted");
    dpar_zero_destroy(zf), dpar_zero_destroy(zt);
    for (k = 0; k < NT; k++) free(tp[k]), free(tg[k]);
    free(fp), free(fg), free(rp), free(rg), free(rm), free(rv);
}

static void test_zero1_tensors_equal_flat(void)
{
    int n, kind;
    for (kind = 0; kind < 2; kind++)
        for (n = 1; n <= 4; n++) {
            tjob j;
            memset(&j, 0, sizeof j);
            j.steps = 3, j.kind = (dpar_optim)kind;
            CHECK_MSG(run_world(n, zero_rank, &j) == 0, "%s N=%d", kind ? "adam" : "sgd", n);
        }
}

/* ---- FSDP: units of several separately allocated arrays (one of a single array: reduced in place) ---- */
#define FU 3
#define FT 6
static const int f_ut[FU] = {2, 1, 3};                     /* tensors per unit */
static const size_t f_tn[FT] = {700, 13, 4099, 3, 1, 250}; /* the tensors' sizes */
static const size_t f_uc[FU] = {713, 4099, 254};           /* the units' */
static float fx(int r, int step, int u, size_t i) { return (float)((r * 31 + step * 7 + u * 3 + (int)i) % 13) / 13.0f; }
/* element i of a unit given as views of its tensors t0.. */
static float *fel(float **v, int t0, size_t i)
{
    int t = t0;
    while (i >= f_tn[t]) i -= f_tn[t++];
    return v[t - t0] + i;
}

typedef struct {
    int stage;
    dpar_optim kind;
} fjob;

static void fsdp_tensor_rank(world *w, dpar_comm *c, int r)
{
    fjob *j = (fjob *)w->user;
    dpar_fsdp *ff = NULL, *ft = NULL;
    dpar_fsdp_desc d;
    dpar_tensor params[FT], grads[FT];
    float *tp[FT], *tg[FT], *pp, *gg, *views[FT], *flatv[1], s[FU], *a = (float *)malloc(4099 * 4),
                                                                    *b = (float *)malloc(4099 * 4);
    size_t i;
    int u, k, t0, step, form;
    memset(params, 0, sizeof params), memset(grads, 0, sizeof grads);
    for (k = 0; k < FT; k++) {
        tp[k] = (float *)malloc(f_tn[k] * 4), tg[k] = (float *)malloc(f_tn[k] * 4);
        params[k].data = tp[k], params[k].count = f_tn[k], grads[k].data = tg[k], grads[k].count = f_tn[k];
    }
    for (u = 0, t0 = 0; u < FU; t0 += f_ut[u], u++) /* the initial values: in the arrays, and flat for set_params */
        for (i = 0; i < f_uc[u]; i++) *fel(tp + t0, t0, i) = (float)((int)((u * 17 + i * 5) % 23) - 11) / 11.0f;
    memset(&d, 0, sizeof d);
    d.comm = c, d.stage = j->stage, d.num_units = FU, d.unit_counts = f_uc, d.kind = j->kind, d.lr = 0.05f;
    d.momentum = 0.9f, d.weight_decay = 0.01f;
    expect_ok(w, dpar_fsdp_create(&d, &ff), "fsdp_create (flat)", r);
    d.unit_counts = NULL, d.params = params, d.grads = grads, d.unit_tensors = f_ut;
    expect_ok(w, dpar_fsdp_create(&d, &ft), "fsdp_create (tensors)", r);
    if (!ff || !ft) return;
    for (u = 0, t0 = 0; u < FU; t0 += f_ut[u], u++) {
        for (i = 0; i < f_uc[u]; i++) a[i] = *fel(tp + t0, t0, i);
        expect_ok(w, dpar_fsdp_set_params(ff, u, a), "set_params", r);
    }
    if (j->stage == 2 && r == 0 &&
        (dpar_fsdp_gather(ft, 0, &pp) != DPAR_EINVAL || !strstr(dpar_last_error(), "2 tensors")))
        note(w, "a flat gather of a unit of two arrays at stage 2 accepted");
    if (r == 0 && (dpar_fsdp_grads(ft, 0, &gg) != DPAR_EINVAL || !strstr(dpar_last_error(), "grads tensors")))
        note(w, "dpar_fsdp_grads accepted with grads tensors");
    for (step = 0; step < 4; step++)
        for (form = 0; form < 2; form++) { /* the same step, flat then with tensors */
            dpar_fsdp *f = form ? ft : ff;
            for (u = 0, t0 = 0; u < FU; t0 += f_ut[u], u++) { /* forward: s_u = mean of p x */
                float acc = 0;
                if (form) expect_ok(w, dpar_fsdp_gather_tensors(f, u, views), "gather_tensors", r);
                else expect_ok(w, dpar_fsdp_gather(f, u, flatv), "gather", r);
                for (i = 0; i < f_uc[u]; i++) acc += (form ? *fel(views, t0, i) : flatv[0][i]) * fx(r, step, u, i);
                s[u] = acc / (float)f_uc[u];
                expect_ok(w, dpar_fsdp_release(f, u), "release", r);
            }
            for (u = FU - 1, t0 = FT; u >= 0; u--) { /* backward */
                size_t n = f_uc[u];
                t0 -= f_ut[u];
                if (form) expect_ok(w, dpar_fsdp_gather_tensors(f, u, views), "gather_tensors", r);
                else expect_ok(w, dpar_fsdp_gather(f, u, flatv), "gather", r);
                for (i = 0; i < n; i++) a[i] = form ? *fel(views, t0, i) : flatv[0][i];
                for (i = 0; i < n; i++)
                    b[i] = (a[i] - fx(r, step, u, i)) * 0.5f + 0.25f * a[(i * 7 + 3) % n] + s[u] * 0.1f;
                if (form) {
                    for (i = 0; i < n; i++) *fel(tg + t0, t0, i) = b[i]; /* backward writes the model's arrays */
                    expect_ok(w, dpar_fsdp_release(f, u), "release", r);
                } else {
                    expect_ok(w, dpar_fsdp_grads(f, u, &gg), "grads", r);
                    memcpy(gg, b, n * 4);
                }
                expect_ok(w, dpar_fsdp_reduce(f, u), "reduce", r);
                if (!form) expect_ok(w, dpar_fsdp_release(f, u), "release", r);
            }
            expect_ok(w, dpar_fsdp_step(f), "step", r);
        }
    for (u = 0, t0 = 0; u < FU; t0 += f_ut[u], u++) { /* bitwise the flat form's; stage 2: in the arrays too */
        expect_ok(w, dpar_fsdp_get_params(ff, u, a), "get_params (flat)", r);
        expect_ok(w, dpar_fsdp_get_params(ft, u, b), "get_params (tensors)", r);
        if (memcmp(a, b, f_uc[u] * 4))
            note(w, "stage %d N=%d rank %d unit %d: tensors differ from flat", j->stage, w->n, r, u);
        for (i = 0; j->stage == 2 && i < f_uc[u]; i++)
            if (memcmp(fel(tp + t0, t0, i), a + i, 4)) {
                note(w, "stage 2 N=%d rank %d unit %d element %zu: the array is not the parameters", w->n, r, u, i);
                break;
            }
    }
    {
        size_t bf = 0, bt = 0, total = f_uc[0] + f_uc[1] + f_uc[2];
        dpar_fsdp_memory(ff, &bf, NULL), dpar_fsdp_memory(ft, &bt, NULL);
        /* stage 2: no full copy of its own (4 total), a master shard instead (4 total / N), the lists */
        if (j->stage == 2 && bt > bf - 4 * total + 4 * (total / (size_t)w->n + FU) + 512)
            note(w, "stage 2 with tensors holds %zu bytes, flat %zu", bt, bf);
    }
    dpar_fsdp_destroy(ff), dpar_fsdp_destroy(ft);
    for (k = 0; k < FT; k++) free(tp[k]), free(tg[k]);
    free(a), free(b);
}

static void test_fsdp_tensors_equal_flat(void)
{
    int n, stage, kind;
    for (stage = 2; stage <= 3; stage++)
        for (kind = 0; kind < 2; kind++)
            for (n = 1; n <= 4; n++) {
                fjob j;
                j.stage = stage, j.kind = (dpar_optim)kind;
                CHECK_MSG(run_world(n, fsdp_tensor_rank, &j) == 0, "stage %d %s N=%d", stage, kind ? "adam" : "sgd", n);
            }
}

/* ---- bad lists: refused at create, with the tensor named ---- */
static void test_bad_lists(void)
{
    dpar_comm_desc cd = {0};
    dpar_group *g = NULL;
    dpar_comm *c = NULL;
    dpar_buckets *b = (dpar_buckets *)1;
    dpar_buckets_desc bd;
    dpar_zero *z = (dpar_zero *)1;
    dpar_zero_desc zd;
    float a[100], p[10], q[10];
    dpar_tensor t[2], u[2];
    cd.size = 1;
    CHECK(dpar_group_create(&cd, &g) == DPAR_OK && dpar_group_join(g, 0, &c) == DPAR_OK);
    memset(t, 0, sizeof t), memset(u, 0, sizeof u);
    memset(&bd, 0, sizeof bd);
    bd.comm = c, bd.tensors = t, bd.num_tensors = 2;
    t[0].data = a, t[0].count = 10, t[1].data = NULL, t[1].count = 10;
    CHECK(dpar_buckets_create(&bd, &b) == DPAR_EINVAL && b == NULL &&
          strstr(dpar_last_error(), "tensor 1: data is NULL"));
    t[1].data = a + 50, t[1].count = 0;
    CHECK(dpar_buckets_create(&bd, &b) == DPAR_EINVAL && strstr(dpar_last_error(), "tensor 1: count is 0"));
    t[1].count = 10, t[1].dtype = DPAR_BF16;
    CHECK(dpar_buckets_create(&bd, &b) == DPAR_EINVAL && strstr(dpar_last_error(), "tensor 1 is bf16"));
    t[1].dtype = DPAR_F32, t[1].data = a + 5; /* [5, 15) over [0, 10) */
    CHECK(dpar_buckets_create(&bd, &b) == DPAR_EINVAL && strstr(dpar_last_error(), "tensors 0 and 1 overlap"));
    t[1].data = a + 10; /* adjacent: fine */
    bd.grads = a + 50;
    CHECK(dpar_buckets_create(&bd, &b) == DPAR_EINVAL && strstr(dpar_last_error(), "must be NULL"));
    bd.grads = NULL, bd.count = 21;
    CHECK(dpar_buckets_create(&bd, &b) == DPAR_EINVAL && strstr(dpar_last_error(), "0 or their total"));
    bd.count = 20;
    CHECK(dpar_buckets_create(&bd, &b) == DPAR_OK && b && dpar_buckets_destroy(b) == DPAR_OK);
    bd.num_tensors = 0;
    CHECK(dpar_buckets_create(&bd, &b) == DPAR_EINVAL); /* a list of none */
    bd.num_tensors = -1;
    CHECK(dpar_buckets_create(&bd, &b) == DPAR_EINVAL);
    bd.tensors = NULL, bd.num_tensors = 2;
    CHECK(dpar_buckets_create(&bd, &b) == DPAR_EINVAL);

    memset(&zd, 0, sizeof zd);
    zd.comm = c, zd.lr = 0.1f, zd.params = t, zd.grads = u, zd.num_tensors = 2;
    t[0].data = p, t[0].count = 10, t[1].data = a, t[1].count = 20;
    u[0].data = q, u[0].count = 10, u[1].data = a + 20, u[1].count = 19;
    CHECK(dpar_zero_create(&zd, &z) == DPAR_EINVAL && z == NULL && strstr(dpar_last_error(), "grads tensor 1 has 19"));
    u[1].count = 20, u[1].data = a + 10; /* a gradient over a parameter */
    CHECK(dpar_zero_create(&zd, &z) == DPAR_EINVAL &&
          strstr(dpar_last_error(), "grads tensor 1 overlaps params tensor 1"));
    u[1].data = a + 20, u[0].dtype = DPAR_F16;
    CHECK(dpar_zero_create(&zd, &z) == DPAR_EINVAL && strstr(dpar_last_error(), "grads tensor 0 is f16"));
    u[0].dtype = DPAR_F32, zd.grads = NULL;
    CHECK(dpar_zero_create(&zd, &z) == DPAR_EINVAL); /* params without grads */
    zd.grads = u, zd.count = 31;
    CHECK(dpar_zero_create(&zd, &z) == DPAR_EINVAL && strstr(dpar_last_error(), "the tensors hold 30"));
    zd.count = 0;
    CHECK(dpar_zero_create(&zd, &z) == DPAR_OK && z && dpar_zero_destroy(z) == DPAR_OK);
    {
        dpar_fsdp *f = (dpar_fsdp *)1;
        dpar_fsdp_desc fd;
        int ut[2] = {1, 1};
        size_t uc[2] = {10, 21};
        memset(&fd, 0, sizeof fd);
        fd.comm = c, fd.lr = 0.1f, fd.num_units = 2, fd.params = t, fd.grads = u, fd.unit_tensors = ut;
        u[1].count = 19;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL && f == NULL &&
              strstr(dpar_last_error(), "grads tensor 1 has 19"));
        u[1].count = 20, u[1].data = a + 10; /* a gradient over a parameter */
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL &&
              strstr(dpar_last_error(), "grads tensor 1 overlaps params tensor 1"));
        u[1].data = a + 20, t[0].data = NULL;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL && strstr(dpar_last_error(), "params tensor 0: data is NULL"));
        t[0].data = p, ut[1] = 0;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL && strstr(dpar_last_error(), "unit 1 has 0 tensors"));
        ut[1] = 1, fd.unit_counts = uc;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL && strstr(dpar_last_error(), "unit_counts says 21"));
        fd.unit_counts = NULL, fd.compute = DPAR_BF16;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL && strstr(dpar_last_error(), "f32 compute"));
        fd.compute = DPAR_F32, fd.unit_tensors = NULL;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL); /* params without unit_tensors */
        fd.unit_tensors = ut;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_OK && f && dpar_fsdp_destroy(f) == DPAR_OK);
    }
    dpar_comm_destroy(c);
    dpar_group_destroy(g);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_bad_lists);
    RUN(test_buckets_tensors_stage_only_spanning);
    RUN(test_buckets_tensors_equal_flat);
    RUN(test_zero1_tensors_equal_flat);
    RUN(test_fsdp_tensors_equal_flat);
    pools_free();
    return dt_summary();
}
