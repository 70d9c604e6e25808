/* test_fsdp.c - ZeRO-2 and ZeRO-3 (dpar_fsdp) against plain data parallelism: the same model, data and optimizer
   on N = 1, 2, 3, 4 thread ranks, with units of uneven sizes (one smaller than N); after every step the parameters
   must be bitwise those of a run that allreduces each unit's gradients (AVG) and applies the optimizer itself.
   Build and run: make test   (one test: ./build/test_fsdp stage3) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>

#include "dpar_test.h"
#include "coll_matrix.h"

#define U 4
#define STEPS 5
static const size_t counts[U] = {1000, 7, 4099, 1};

/* the "model": unit u's forward gives s_u = mean of p * x; its gradient mixes elements of the unit (a wrong or
   stale gather changes it) with this rank's data and the forward's s_u */
static float data_x(int rank, int step, int u, size_t i)
{
    return (float)((rank * 31 + step * 7 + u * 3 + (int)i) % 13) / 13.0f;
}
static float forward(const float *p, int rank, int step, int u)
{
    size_t i;
    float s = 0;
    for (i = 0; i < counts[u]; i++) s += p[i] * data_x(rank, step, u, i);
    return s / (float)counts[u];
}
static void backward(float *g, const float *p, float s, int rank, int step, int u)
{
    size_t i, n = counts[u];
    for (i = 0; i < n; i++) g[i] = (p[i] - data_x(rank, step, u, i)) * 0.5f + 0.25f * p[(i * 7 + 3) % n] + s * 0.1f;
}
static float init(int u, size_t i) { return (float)((int)((u * 17 + i * 5) % 23) - 11) / 11.0f; }

typedef struct {
    int stage;
    dpar_optim kind;
    float *mine[8][U]; /* each rank's final parameters from fsdp */
} fsdp_case;

/* the reference optimizer: dpar_zero_step's math, written out again */
static void ref_step(float *p, float *g, float *m, float *v, size_t n, const fsdp_case *k, long t)
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

static void fsdp_rank(world *w, dpar_comm *c, int r)
{
    fsdp_case *k = (fsdp_case *)w->user;
    dpar_fsdp *f = NULL;
    dpar_fsdp_desc d;
    float *p[U], *g[U], *m[U], *v[U], s[U], *pp, *gg;
    size_t i, bytes = 0, peak = 0;
    int u, step;
    memset(&d, 0, sizeof d);
    d.comm = c, d.stage = k->stage, d.num_units = U, d.unit_counts = counts, d.kind = k->kind, d.lr = 0.05f;
    d.momentum = 0.9f, d.weight_decay = 0.01f;
    expect_ok(w, dpar_fsdp_create(&d, &f), "fsdp_create", r);
    if (!f) return;
    for (u = 0; u < U; u++) {
        p[u] = (float *)malloc(counts[u] * 4), g[u] = (float *)malloc(counts[u] * 4);
        m[u] = (float *)calloc(counts[u], 4), v[u] = (float *)calloc(counts[u], 4);
        for (i = 0; i < counts[u]; i++) p[u][i] = init(u, i);
        expect_ok(w, dpar_fsdp_set_params(f, u, p[u]), "set_params", r);
    }
    for (step = 0; step < STEPS; step++) {
        /* the reference: plain data parallelism, one allreduce per unit */
        for (u = 0; u < U; u++) s[u] = forward(p[u], r, step, u);
        for (u = U - 1; u >= 0; u--) {
            backward(g[u], p[u], s[u], r, step, u);
            expect_ok(w, dpar_allreduce(c, g[u], g[u], counts[u], DPAR_F32, DPAR_AVG), "reference allreduce", r);
        }
        for (u = 0; u < U; u++) ref_step(p[u], g[u], m[u], v[u], counts[u], k, step + 1);
        /* the same step, sharded */
        for (u = 0; u < U; u++) {
            expect_ok(w, dpar_fsdp_gather(f, u, &pp), "gather (forward)", r);
            s[u] = forward(pp, r, step, u);
            expect_ok(w, dpar_fsdp_release(f, u), "release", r);
        }
        for (u = U - 1; u >= 0; u--) {
            expect_ok(w, dpar_fsdp_gather(f, u, &pp), "gather (backward)", r);
            expect_ok(w, dpar_fsdp_grads(f, u, &gg), "grads", r);
            backward(gg, pp, s[u], r, step, u);
            expect_ok(w, dpar_fsdp_reduce(f, u), "reduce", r);
            expect_ok(w, dpar_fsdp_release(f, u), "release", r);
        }
        expect_ok(w, dpar_fsdp_step(f), "step", r);
        for (u = 0; u < U; u++) { /* bitwise the reference's, on every rank */
            float *got = (float *)malloc(counts[u] * 4);
            expect_ok(w, dpar_fsdp_get_params(f, u, got), "get_params", r);
            if (memcmp(got, p[u], counts[u] * 4))
                for (i = 0; i < counts[u]; i++)
                    if (memcmp(&got[i], &p[u][i], 4)) {
                        note(w, "stage %d %s N=%d rank %d step %d unit %d element %zu: %.9g, reference %.9g", k->stage,
                             k->kind ? "adam" : "sgd", w->n, r, step, u, i, got[i], p[u][i]);
                        break;
                    }
            free(got);
        }
    }
    /* memory: the shards (4 + 4 + 4 words) / N, plus the unit buffers, plus stage 2's full parameters */
    expect_ok(w, dpar_fsdp_memory(f, &bytes, &peak), "memory", r);
    {
        size_t total = 0, maxc = 0, words = k->kind == DPAR_OPTIM_ADAM ? 4 : 3, limit;
        for (u = 0; u < U; u++) total += counts[u], maxc = counts[u] > maxc ? counts[u] : maxc;
        limit = (words * 4 * total) / (size_t)w->n + 3 * 4 * maxc + (k->stage == 2 ? 4 * total : 0) + 4 * 4 * U + 2048;
        if (bytes > limit || peak < bytes) note(w, "rank %d: %zu bytes held, limit %zu", r, bytes, limit);
    }
    expect_ok(w, dpar_fsdp_destroy(f), "destroy", r);
    for (u = 0; u < U; u++) free(p[u]), free(g[u]), free(m[u]), free(v[u]);
}

static void run_cases(int stage)
{
    static const int ns[] = {1, 2, 3, 4};
    int ni, kind;
    for (kind = 0; kind < 2; kind++)
        for (ni = 0; ni < 4; ni++) {
            fsdp_case k;
            memset(&k, 0, sizeof k);
            k.stage = stage;
            k.kind = (dpar_optim)kind;
            CHECK_MSG(run_world(ns[ni], fsdp_rank, &k) == 0, "stage %d %s N=%d", stage, kind ? "adam" : "sgd", ns[ni]);
        }
}
static void test_stage2_equals_plain_data_parallel(void) { run_cases(2); }
static void test_stage3_equals_plain_data_parallel(void) { run_cases(3); }

static void test_bad_use(void)
{
    dpar_fsdp *f = (dpar_fsdp *)1;
    dpar_fsdp_desc d;
    dpar_comm_desc cd;
    dpar_group *g = NULL;
    dpar_comm *c = NULL;
    float *pp = NULL, *gg = NULL;
    size_t two[2] = {5, 9};
    memset(&d, 0, sizeof d);
    CHECK(dpar_fsdp_create(&d, &f) == DPAR_EINVAL && f == NULL);
    memset(&cd, 0, sizeof cd);
    cd.size = 1;
    CHECK(dpar_group_create(&cd, &g) == DPAR_OK && dpar_group_join(g, 0, &c) == DPAR_OK);
    d.comm = c, d.num_units = 2, d.unit_counts = two, d.lr = 0.1f, d.stage = 4;
    CHECK(dpar_fsdp_create(&d, &f) == DPAR_EINVAL);
    d.stage = 3;
    CHECK(dpar_fsdp_create(&d, &f) == DPAR_OK && f);
    CHECK(dpar_fsdp_gather(f, 2, &pp) == DPAR_EINVAL);
    CHECK(dpar_fsdp_release(f, 0) == DPAR_EINVAL); /* not gathered */
    CHECK(dpar_fsdp_reduce(f, 0) == DPAR_EINVAL);  /* no gradients taken */
    CHECK(dpar_fsdp_grads(f, 0, &gg) == DPAR_OK && dpar_fsdp_grads(f, 1, &gg) == DPAR_EBUSY);
    CHECK(dpar_fsdp_step(f) == DPAR_EBUSY);
    CHECK(dpar_fsdp_reduce(f, 0) == DPAR_OK && dpar_fsdp_step(f) == DPAR_OK);
    CHECK(dpar_fsdp_destroy(f) == DPAR_OK && dpar_fsdp_destroy(NULL) == DPAR_OK);
    dpar_comm_destroy(c);
    dpar_group_destroy(g);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_bad_use);
    RUN(test_stage2_equals_plain_data_parallel);
    RUN(test_stage3_equals_plain_data_parallel);
    pools_free();
    return dt_summary();
}
