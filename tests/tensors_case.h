/* tensors_case.h - one rank's part of the tensor-form tests (dpar_tensor lists against the flat form and a serial
   reference), shared by test_tensors.c (thread ranks) and test_mpi.c (processes): gradient buckets and ZeRO-1 over
   five separately allocated arrays, dpar_fsdp over units of one, two and three arrays (f32, and 16-bit compute
   against the flat 16-bit form). */
#ifndef DPAR_TEST_TENSORS_CASE_H
#define DPAR_TEST_TENSORS_CASE_H
#include <math.h>

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
        if (form == 1) { /* a flat params array for tensors, a tensor past the list: refused */
            if (dpar_buckets_set_update(b, flat, (dpar_buckets_update_fn)1, NULL) != DPAR_EINVAL ||
                !strstr(dpar_last_error(), "dpar_buckets_set_update_tensors"))
                note(w, "set_update accepted with tensors: %s", dpar_last_error());
            if (dpar_buckets_ready_tensor(b, NT) != DPAR_EINVAL || !strstr(dpar_last_error(), "no tensor 5"))
                note(w, "tensor %d accepted: %s", NT, dpar_last_error());
        }
        expect_ok(w, dpar_buckets_destroy(b), "buckets_destroy", r);
        b = NULL;
    }
    for (k = 0, at = 0; k < NT; at += tn[k], k++) /* the last step: the forms bitwise alike */
        if (memcmp(t[k], flat + at, tn[k] * sizeof(float)))
            note(w, "rank %d: tensor %d is not the flat form's gradients", r, k);
    for (k = 0; k < NT; k++) free(t[k]);
    free(ref), free(flat);
}

/* ---- buckets of tensors that update their params tensors too, with and without direct buckets ---- */
typedef struct {
    float *p[NT], *g[NT];
    size_t start[NT + 1];
    int bad; /* a range given to the update that is not inside one tensor */
} tupd_ctx;
static void tupd(void *user, size_t offset, size_t count) /* SGD without momentum on [offset, offset + count) */
{
    tupd_ctx *u = (tupd_ctx *)user;
    size_t i, o;
    int k = 0;
    while (k < NT && offset >= u->start[k + 1]) k++;
    if (k == NT || count == 0 || offset + count > u->start[k + 1]) {
        u->bad = 1;
        return;
    }
    for (i = 0, o = offset - u->start[k]; i < count; i++) u->p[k][o + i] -= 0.05f * u->g[k][o + i];
}
static float tinit(size_t i);

static void buckets_update_rank(world *w, dpar_comm *c, int r)
{
    tjob *j = (tjob *)w->user;
    size_t n = tn_total(), i, at;
    float *rp = (float *)malloc(n * sizeof(float)), *ref = (float *)malloc(n * sizeof(float));
    dpar_tensor gl[NT], pl[NT];
    dpar_buckets_desc d;
    dpar_buckets *b = NULL;
    tupd_ctx u;
    dpar_status st;
    int k, step, direct;
    memset(gl, 0, sizeof gl), memset(pl, 0, sizeof pl), memset(&u, 0, sizeof u);
    for (k = 0; k < NT; k++) {
        u.g[k] = (float *)malloc(tn[k] * sizeof(float)), u.p[k] = (float *)malloc(tn[k] * sizeof(float));
        gl[k].data = u.g[k], gl[k].count = tn[k], pl[k].data = u.p[k], pl[k].count = tn[k];
        u.start[k + 1] = u.start[k] + tn[k];
    }
    for (direct = 0; direct < 2; direct++) {
        memset(&d, 0, sizeof d);
        d.comm = c, d.bucket_bytes = 64 * 1024, d.op = DPAR_AVG, d.tensors = gl, d.num_tensors = NT;
        expect_ok(w, dpar_buckets_create(&d, &b), "buckets_create", r);
        if (!b) break;
        if (direct == 0) { /* bad lists: a count that differs, params over a gradient */
            pl[1].count = 34;
            if (dpar_buckets_set_update_tensors(b, pl, tupd, &u) != DPAR_EINVAL ||
                !strstr(dpar_last_error(), "params tensor 1 has 34"))
                note(w, "a params tensor of another count accepted: %s", dpar_last_error());
            pl[1].count = 33, pl[1].data = u.g[2] + 7;
            if (dpar_buckets_set_update_tensors(b, pl, tupd, &u) != DPAR_EINVAL ||
                !strstr(dpar_last_error(), "params tensor 1 overlaps gradient tensor 2"))
                note(w, "params over a gradient accepted: %s", dpar_last_error());
            pl[1].data = u.p[1];
        }
        expect_ok(w, dpar_buckets_set_update_tensors(b, pl, tupd, &u), "buckets_set_update_tensors", r);
        if (direct && (st = dpar_buckets_set_direct(b, 1)) != DPAR_OK) { /* MPI: no direct buckets */
            if (st != DPAR_EUNSUPPORTED) expect_ok(w, st, "buckets_set_direct", r);
            expect_ok(w, dpar_buckets_destroy(b), "buckets_destroy", r);
            break;
        }
        for (k = 0, at = 0; k < NT; at += tn[k], k++)
            for (i = 0; i < tn[k]; i++) u.p[k][i] = rp[at + i] = tinit(at + i);
        for (step = 0; step < j->steps; step++) {
            for (i = 0; i < n; i++) { /* the serial reference: the average (exact), then the same SGD */
                int q;
                float sum = 0;
                for (q = 0; q < w->n; q++) sum += tgrad(q, step, i);
                ref[i] = sum / (float)w->n;
                rp[i] -= 0.05f * ref[i];
            }
            for (k = 0, at = 0; k < NT; at += tn[k], k++)
                for (i = 0; i < tn[k]; i++) u.g[k][i] = tgrad(r, step, at + i);
            for (k = NT - 1; k >= 0; k--) expect_ok(w, dpar_buckets_ready_tensor(b, k), "buckets_ready_tensor", r);
            expect_ok(w, dpar_buckets_wait_range(b, n - tn[NT - 1], tn[NT - 1]), "buckets_wait_range", r);
            if (memcmp(u.p[NT - 1], rp + n - tn[NT - 1], tn[NT - 1] * sizeof(float)))
                note(w, "rank %d step %d direct %d: the last params tensor is not updated after wait_range", r, step,
                     direct);
            expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r);
            for (k = 0, at = 0; k < NT; at += tn[k], k++)
                if (memcmp(u.p[k], rp + at, tn[k] * sizeof(float)))
                    note(w, "rank %d step %d direct %d: params tensor %d differs from the serial SGD", r, step, direct,
                         k);
        }
        if (u.bad) note(w, "rank %d: the update got a range across tensors", r);
        expect_ok(w, dpar_buckets_destroy(b), "buckets_destroy", r);
        b = NULL;
    }
    for (k = 0; k < NT; k++) free(u.g[k]), free(u.p[k]);
    free(rp), free(ref);
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

/* ---- FSDP with 16-bit compute: the model's bf16/f16 arrays as tensors against the flat 16-bit form ---- */
typedef struct {
    int stage;
    dpar_dtype compute, reduce;
    dpar_optim kind;
    float loss_scale; /* 0: the default (f16: 65536, dynamic) */
    int inject;       /* the step at which the last rank's first gradient of unit 0 is inf (-1: none) */
} f16job;
static float w16(uint16_t h, dpar_dtype t) { return t == DPAR_BF16 ? dpar_bf16_to_f32(h) : dpar_f16_to_f32(h); }
static uint16_t n16(float x, dpar_dtype t) { return t == DPAR_BF16 ? dpar_f32_to_bf16(x) : dpar_f32_to_f16(x); }
static uint16_t *hel(uint16_t **v, int t0, size_t i) /* element i of a unit given as views of its tensors t0.. */
{
    int t = t0;
    while (i >= f_tn[t]) i -= f_tn[t++];
    return v[t - t0] + i;
}

/* the same training as fsdp_tensor_rank in 16 bits: flat (gather16 / grads16) and tensor form (gather16_tensors, the
   model's 16-bit gradient arrays), step by step; the forward's sums, the loss scale, the skipped steps and the final
   master weights and 16-bit copies must agree bitwise */
static void fsdp16_tensor_rank(world *w, dpar_comm *c, int r)
{
    f16job *j = (f16job *)w->user;
    dpar_dtype ct = j->compute;
    dpar_fsdp *ff = NULL, *ft = NULL;
    dpar_fsdp_desc d;
    dpar_tensor params[FT], grads[FT];
    uint16_t *tp[FT], *tg[FT], *views[FT], *hp = NULL, *hg = NULL;
    float *a = (float *)malloc(4099 * 4), *b = (float *)malloc(4099 * 4), *init[FU], s[2][FU], scale[2];
    float *fv[1];
    long skipped[2];
    size_t i, moved = 0;
    int u, k, t0, step, form;
    memset(params, 0, sizeof params), memset(grads, 0, sizeof grads);
    for (k = 0; k < FT; k++) {
        tp[k] = (uint16_t *)malloc(f_tn[k] * 2), tg[k] = (uint16_t *)malloc(f_tn[k] * 2);
        params[k].data = tp[k], params[k].count = f_tn[k], params[k].dtype = ct;
        grads[k].data = tg[k], grads[k].count = f_tn[k], grads[k].dtype = ct;
    }
    for (u = 0, t0 = 0; u < FU; t0 += f_ut[u], u++) { /* the initial values: 16-bit in the arrays, widened for flat */
        init[u] = (float *)malloc(f_uc[u] * 4);
        for (i = 0; i < f_uc[u]; i++) {
            *hel(tp + t0, t0, i) = n16((float)((int)((u * 17 + i * 5) % 23) - 11) / 11.0f + 0.001f * (float)i, ct);
            init[u][i] = w16(*hel(tp + t0, t0, i), ct);
        }
    }
    memset(&d, 0, sizeof d);
    d.comm = c, d.stage = j->stage, d.num_units = FU, d.unit_counts = f_uc, d.kind = j->kind, d.lr = 0.05f;
    d.momentum = 0.9f, d.weight_decay = 0.01f, d.compute = ct, d.reduce_dtype = j->reduce;
    d.loss_scale = j->loss_scale, d.static_loss_scale = j->loss_scale > 0;
    expect_ok(w, dpar_fsdp_create(&d, &ff), "fsdp_create (flat 16-bit)", r);
    d.unit_counts = NULL, d.params = params, d.grads = grads, d.unit_tensors = f_ut;
    expect_ok(w, dpar_fsdp_create(&d, &ft), "fsdp_create (16-bit tensors)", r);
    if (ff && ft) {
        for (u = 0; u < FU; u++) expect_ok(w, dpar_fsdp_set_params(ff, u, init[u]), "set_params", r);
        if (j->stage == 2 && r == 0 &&
            (dpar_fsdp_gather16(ft, 0, &hp) != DPAR_EINVAL || !strstr(dpar_last_error(), "2 tensors")))
            note(w, "a flat gather16 of a unit of two arrays at stage 2 accepted");
        if (r == 0 && (dpar_fsdp_grads16(ft, 0, &hg) != DPAR_EINVAL || !strstr(dpar_last_error(), "grads tensors")))
            note(w, "dpar_fsdp_grads16 accepted with grads tensors");
        if (r == 0 && (dpar_fsdp_gather_tensors(ft, 0, fv) != DPAR_EINVAL || !strstr(dpar_last_error(), "16-bit")))
            note(w, "dpar_fsdp_gather_tensors (f32) accepted with 16-bit compute");
    }
    for (step = 0; step < 5 && ff && ft; step++)
        for (form = 0; form < 2; form++) { /* the same step, flat then with tensors */
            dpar_fsdp *f = form ? ft : ff;
            dpar_fsdp_scale(f, &scale[form], &skipped[form]);
            if (form && (scale[0] != scale[1] || skipped[0] != skipped[1]))
                note(w, "step %d rank %d: loss scale %g, %ld skipped; flat %g, %ld", step, r, (double)scale[1],
                     skipped[1], (double)scale[0], skipped[0]);
            for (u = 0, t0 = 0; u < FU; t0 += f_ut[u], u++) { /* forward: s_u = mean of p x */
                float acc = 0;
                if (form) expect_ok(w, dpar_fsdp_gather16_tensors(f, u, views), "gather16_tensors", r);
                else expect_ok(w, dpar_fsdp_gather16(f, u, &hp), "gather16", r);
                for (i = 0; i < f_uc[u]; i++) acc += w16(form ? *hel(views, t0, i) : hp[i], ct) * fx(r, step, u, i);
                s[form][u] = acc / (float)f_uc[u];
                if (form && memcmp(&s[0][u], &s[1][u], 4))
                    note(w, "step %d rank %d unit %d: forward %g, flat %g", step, r, u, (double)s[1][u],
                         (double)s[0][u]);
                expect_ok(w, dpar_fsdp_release(f, u), "release", r);
            }
            for (u = FU - 1, t0 = FT; u >= 0; u--) { /* backward: the 16-bit gradients of the scaled loss */
                size_t n = f_uc[u];
                t0 -= f_ut[u];
                if (form) expect_ok(w, dpar_fsdp_gather16_tensors(f, u, views), "gather16_tensors", r);
                else expect_ok(w, dpar_fsdp_gather16(f, u, &hp), "gather16", r);
                for (i = 0; i < n; i++) a[i] = w16(form ? *hel(views, t0, i) : hp[i], ct);
                for (i = 0; i < n; i++)
                    b[i] = (a[i] - fx(r, step, u, i)) * 0.5f + 0.25f * a[(i * 7 + 3) % n] + s[form][u] * 0.1f;
                if (step == j->inject && r == w->n - 1 && u == 0) b[0] = INFINITY;
                /* flat: release, then the gradients in the released buffer. Tensors reduced in f32: reduce, then
                   release (widened from the arrays: no unit buffer needed); in the compute type: release, reduce */
                if (form) {
                    for (i = 0; i < n; i++) *hel(tg + t0, t0, i) = n16(b[i] * scale[form], ct);
                    if (j->reduce == DPAR_F32) expect_ok(w, dpar_fsdp_reduce(f, u), "reduce", r);
                    expect_ok(w, dpar_fsdp_release(f, u), "release", r);
                    if (j->reduce != DPAR_F32) expect_ok(w, dpar_fsdp_reduce(f, u), "reduce", r);
                } else {
                    expect_ok(w, dpar_fsdp_release(f, u), "release", r);
                    expect_ok(w, dpar_fsdp_grads16(f, u, &hg), "grads16", r);
                    for (i = 0; hg && i < n; i++) hg[i] = n16(b[i] * scale[form], ct);
                    expect_ok(w, dpar_fsdp_reduce(f, u), "reduce", r);
                }
            }
            expect_ok(w, dpar_fsdp_step(f), "step", r);
        }
    for (u = 0, t0 = 0; u < FU && ff && ft; t0 += f_ut[u], u++) { /* the master weights and the 16-bit copies */
        expect_ok(w, dpar_fsdp_get_params(ff, u, a), "get_params (flat)", r);
        expect_ok(w, dpar_fsdp_get_params(ft, u, b), "get_params (tensors)", r);
        if (memcmp(a, b, f_uc[u] * 4))
            note(w, "%s stage %d N=%d rank %d unit %d: tensors differ from flat", dpar_dtype_name(ct), j->stage, w->n,
                 r, u);
        for (i = 0; i < f_uc[u]; i++) moved += a[i] != init[u][i];
        expect_ok(w, dpar_fsdp_gather16(ff, u, &hp), "gather16", r);
        expect_ok(w, dpar_fsdp_gather16_tensors(ft, u, views), "gather16_tensors", r);
        for (i = 0; hp && i < f_uc[u]; i++)
            if (*hel(views, t0, i) != hp[i] || hp[i] != n16(a[i], ct)) {
                note(w, "%s stage %d rank %d unit %d element %zu: 16-bit copy %04x, flat %04x, master rounded %04x",
                     dpar_dtype_name(ct), j->stage, r, u, i, *hel(views, t0, i), hp[i], n16(a[i], ct));
                break;
            }
        for (k = 0; j->stage == 2 && k < f_ut[u]; k++) /* stage 2: the views are the model's own arrays */
            if (views[k] != tp[t0 + k]) note(w, "stage 2 rank %d: view %d of unit %d is not the array", r, k, u);
        expect_ok(w, dpar_fsdp_release(ff, u), "release", r);
        expect_ok(w, dpar_fsdp_release(ft, u), "release", r);
    }
    if (ff && ft && moved < (f_uc[0] + f_uc[1] + f_uc[2]) / 2) note(w, "rank %d: only %zu parameters moved", r, moved);
    if (ff && ft) { /* memory: stage 2 holds no 16-bit full copy (2 bytes a parameter less); stage 3 the flat form's
                       (no third buffer, though the tensors were reduced before the release); both plus the lists */
        size_t bf = 0, bt = 0, total = f_uc[0] + f_uc[1] + f_uc[2];
        dpar_fsdp_memory(ff, &bf, NULL), dpar_fsdp_memory(ft, &bt, NULL);
        if (bt + (j->stage == 2 ? 2 * total : 0) > bf + 512)
            note(w, "%s stage %d: the tensor form holds %zu bytes, the flat form %zu", dpar_dtype_name(ct), j->stage,
                 bt, bf);
    }
    dpar_fsdp_scale(ft, NULL, &skipped[1]);
    if (ft && j->inject >= 0 && skipped[1] < 1) note(w, "rank %d: the step with an inf was not skipped", r);
    dpar_fsdp_destroy(ff), dpar_fsdp_destroy(ft);
    for (k = 0; k < FT; k++) free(tp[k]), free(tg[k]);
    for (u = 0; u < FU; u++) free(init[u]);
    free(a), free(b);
}

#endif
