/* fsdp_case.h - one rank's part of the dpar_fsdp equivalence test, shared by test_fsdp.c (thread ranks) and
   test_mpi.c (processes): the same model, data and optimizer trained with dpar_fsdp and with plain data
   parallelism (one allreduce per unit), the parameters compared bitwise after every step. */
#ifndef DPAR_TEST_FSDP_CASE_H
#define DPAR_TEST_FSDP_CASE_H
#include <math.h>

#define FC_U 4
#define FC_STEPS 5
static const size_t fc_counts[FC_U] = {1000, 7, 4099, 1};

/* the "model": unit u's forward gives s_u = mean of p * x; its gradient mixes elements of the unit (a wrong or
   stale gather changes it) with this rank's data and the forward's s_u */
static float fc_x(int rank, int step, int u, size_t i)
{
    return (float)((rank * 31 + step * 7 + u * 3 + (int)i) % 13) / 13.0f;
}
static float fc_forward(const float *p, int rank, int step, int u)
{
    size_t i;
    float s = 0;
    for (i = 0; i < fc_counts[u]; i++) s += p[i] * fc_x(rank, step, u, i);
    return s / (float)fc_counts[u];
}
static void fc_backward(float *g, const float *p, float s, int rank, int step, int u)
{
    size_t i, n = fc_counts[u];
    for (i = 0; i < n; i++) g[i] = (p[i] - fc_x(rank, step, u, i)) * 0.5f + 0.25f * p[(i * 7 + 3) % n] + s * 0.1f;
}
static float fc_init(int u, size_t i) { return (float)((int)((u * 17 + i * 5) % 23) - 11) / 11.0f; }

typedef struct {
    int stage;
    dpar_optim kind;
    int release_first;    /* backward: release the unit's parameters before taking its gradients (two buffers) */
    float *mine[8][FC_U]; /* each rank's final parameters from fsdp */
} fsdp_case;

/* one training step of dpar_fsdp f on rank r: every unit gathered for forward and backward, its gradients
   reduced, the step taken (errors noted in w) */
DT_UNUSED static void fc_fsdp_train_step(world *w, dpar_fsdp *f, int r, int step)
{
    float s[FC_U], *pp, *gg;
    int u;
    for (u = 0; u < FC_U; u++) {
        expect_ok(w, dpar_fsdp_gather(f, u, &pp), "gather", r);
        s[u] = fc_forward(pp, r, step, u);
        expect_ok(w, dpar_fsdp_release(f, u), "release", r);
    }
    for (u = FC_U - 1; u >= 0; u--) {
        expect_ok(w, dpar_fsdp_gather(f, u, &pp), "gather", r);
        expect_ok(w, dpar_fsdp_grads(f, u, &gg), "grads", r);
        fc_backward(gg, pp, s[u], r, step, u);
        expect_ok(w, dpar_fsdp_reduce(f, u), "reduce", r);
        expect_ok(w, dpar_fsdp_release(f, u), "release", r);
    }
    expect_ok(w, dpar_fsdp_step(f), "step", r);
}

/* the reference optimizer: dpar_zero_step's math, written out again */
static void fc_ref_step(float *p, float *g, float *m, float *v, size_t n, const fsdp_case *k, long t)
{
    size_t i;
    if (k->kind == DPAR_OPTIM_SGD) {
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

DT_UNUSED static void fsdp_rank(world *w, dpar_comm *c, int r)
{
    fsdp_case *k = (fsdp_case *)w->user;
    dpar_fsdp *f = NULL;
    dpar_fsdp_desc d;
    float *p[FC_U], *g[FC_U], *m[FC_U], *v[FC_U], s[FC_U], *pp, *gg, *early = (float *)malloc(4099 * 4);
    size_t i, bytes = 0, peak = 0;
    int u, step;
    memset(&d, 0, sizeof d);
    d.comm = c, d.stage = k->stage, d.num_units = FC_U, d.unit_counts = fc_counts, d.kind = k->kind, d.lr = 0.05f;
    d.momentum = 0.9f, d.weight_decay = 0.01f;
    expect_ok(w, dpar_fsdp_create(&d, &f), "fsdp_create", r);
    if (!f) return;
    for (u = 0; u < FC_U; u++) {
        p[u] = (float *)malloc(fc_counts[u] * 4), g[u] = (float *)malloc(fc_counts[u] * 4);
        m[u] = (float *)calloc(fc_counts[u], 4), v[u] = (float *)calloc(fc_counts[u], 4);
        for (i = 0; i < fc_counts[u]; i++) p[u][i] = fc_init(u, i);
        expect_ok(w, dpar_fsdp_set_params(f, u, p[u]), "set_params", r);
    }
    for (step = 0; step < FC_STEPS; step++) {
        /* the reference: plain data parallelism, one allreduce per unit */
        for (u = 0; u < FC_U; u++) s[u] = fc_forward(p[u], r, step, u);
        for (u = FC_U - 1; u >= 0; u--) {
            fc_backward(g[u], p[u], s[u], r, step, u);
            expect_ok(w, dpar_allreduce(c, g[u], g[u], fc_counts[u], DPAR_F32, DPAR_AVG), "reference allreduce", r);
        }
        for (u = 0; u < FC_U; u++) fc_ref_step(p[u], g[u], m[u], v[u], fc_counts[u], k, step + 1);
        /* the same step, sharded */
        for (u = 0; u < FC_U; u++) {
            expect_ok(w, dpar_fsdp_gather(f, u, &pp), "gather (forward)", r);
            s[u] = fc_forward(pp, r, step, u);
            expect_ok(w, dpar_fsdp_release(f, u), "release", r);
        }
        for (u = FC_U - 1; u >= 0; u--) {
            expect_ok(w, dpar_fsdp_gather(f, u, &pp), "gather (backward)", r);
            if (k->release_first) { /* what reads the parameters first (here: all of it), then the gradients */
                fc_backward(early, pp, s[u], r, step, u);
                expect_ok(w, dpar_fsdp_release(f, u), "release", r);
                expect_ok(w, dpar_fsdp_grads(f, u, &gg), "grads", r);
                memcpy(gg, early, fc_counts[u] * 4);
                expect_ok(w, dpar_fsdp_reduce(f, u), "reduce", r);
            } else {
                expect_ok(w, dpar_fsdp_grads(f, u, &gg), "grads", r);
                fc_backward(gg, pp, s[u], r, step, u);
                expect_ok(w, dpar_fsdp_reduce(f, u), "reduce", r);
                expect_ok(w, dpar_fsdp_release(f, u), "release", r);
            }
        }
        expect_ok(w, dpar_fsdp_step(f), "step", r);
        for (u = 0; u < FC_U; u++) { /* bitwise the reference's, on every rank */
            float *got = (float *)malloc(fc_counts[u] * 4);
            expect_ok(w, dpar_fsdp_get_params(f, u, got), "get_params", r);
            if (memcmp(got, p[u], fc_counts[u] * 4))
                for (i = 0; i < fc_counts[u]; i++)
                    if (memcmp(&got[i], &p[u][i], 4)) {
                        note(w, "stage %d %s N=%d rank %d step %d unit %d element %zu: %.9g, reference %.9g", k->stage,
                             k->kind ? "adam" : "sgd", w->n, r, step, u, i, got[i], p[u][i]);
                        break;
                    }
            free(got);
        }
    }
    /* memory: the shards (4 + 4 + 4 words) / N, plus the unit buffers (three; two at stage 3 when the parameters are
       released before the gradients are taken), plus stage 2's full parameters */
    expect_ok(w, dpar_fsdp_memory(f, &bytes, &peak), "memory", r);
    {
        size_t total = 0, maxc = 0, second = 0, words = k->kind == DPAR_OPTIM_ADAM ? 4 : 3, limit;
        for (u = 0; u < FC_U; u++) {
            total += fc_counts[u];
            if (fc_counts[u] > maxc) second = maxc, maxc = fc_counts[u];
            else if (fc_counts[u] > second) second = fc_counts[u];
        }
        /* stage 3: one arena of the two largest units, and a third buffer when the gradients come before the
           release; stage 2: the full parameters and one gradient buffer */
        limit = (words * 4 * total) / (size_t)w->n + 4 * FC_U * 8 + 2048 +
                (k->stage == 3 ? 4 * (maxc + second) + (k->release_first ? 0 : 4 * maxc) : 4 * total + 4 * maxc);
        if (bytes > limit || peak < bytes) note(w, "rank %d: %zu bytes held, limit %zu", r, bytes, limit);
    }
    expect_ok(w, dpar_fsdp_destroy(f), "destroy", r);
    for (u = 0; u < FC_U; u++) free(p[u]), free(g[u]), free(m[u]), free(v[u]);
    free(early);
}

#endif
