/* test_tensors.c - the tensor form (dpar_tensor lists: a model's arrays where they live) against the flat form and a
   serial reference: gradient buckets and ZeRO-1 over five separately allocated arrays, and dpar_fsdp (stages 2 and 3)
   over units of separate arrays (f32, and the model's bf16/f16 arrays with 16-bit compute), must give bitwise what the
   flat form gives (itself checked against a serial reference here, or in test_fsdp.c), on 1 to 4 thread ranks; a
   stage-2 fsdp of tensors resumes from a checkpoint into its arrays; bad lists are refused with a message naming the
   tensor.
   Build and run: make build/test_tensors && build/test_tensors   (one test: build/test_tensors buckets) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include "dpar_test.h"
#include "coll_matrix.h"

#include "tensors_case.h"

static void test_buckets_tensors_equal_flat(void)
{
    int n;
    for (n = 1; n <= 4; n++) {
        tjob j;
        memset(&j, 0, sizeof j);
        j.steps = 3;
        CHECK_MSG(run_world(n, buckets_rank, &j) == 0, "N=%d", n);
    }
}

/* buckets of tensors updating params tensors (set_update_tensors), with and without direct buckets */
static void test_buckets_tensors_update_direct(void)
{
    int n;
    for (n = 1; n <= 4; n++) {
        tjob j;
        memset(&j, 0, sizeof j);
        j.steps = 3;
        CHECK_MSG(run_world(n, buckets_update_rank, &j) == 0, "N=%d", n);
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

/* 16-bit compute: the model's bf16/f16 arrays as tensors, bitwise the flat 16-bit form; reduced in f32 or in the
   compute type, an inf skipped together by both (f16's dynamic scale), SGD and AdamW */
static void test_fsdp16_tensors_equal_flat(void)
{
    static const struct {
        dpar_dtype compute, reduce;
        int kind;
        float scale;
        int inject;
    } cs[4] = {{DPAR_BF16, DPAR_F32, 0, 0, -1},
               {DPAR_BF16, DPAR_BF16, 1, 0, -1},
               {DPAR_F16, DPAR_F32, 1, 0, 2},
               {DPAR_F16, DPAR_F16, 0, 1024, -1}};
    int n, stage, ci;
    for (stage = 2; stage <= 3; stage++)
        for (ci = 0; ci < 4; ci++)
            for (n = 1; n <= 4; n++) {
                f16job j;
                j.stage = stage, j.compute = cs[ci].compute, j.reduce = cs[ci].reduce, j.kind = (dpar_optim)cs[ci].kind;
                j.loss_scale = cs[ci].scale, j.inject = cs[ci].inject;
                CHECK_MSG(run_world(n, fsdp16_tensor_rank, &j) == 0, "stage %d compute %s reduce %s N=%d", stage,
                          dpar_dtype_name(j.compute), dpar_dtype_name(j.reduce), n);
            }
}

/* a stage-2 fsdp of tensors saved after a step and loaded into another one: the loaded object's arrays (its full
   parameters, f32 or bf16) become the saved one's, bitwise */
typedef struct {
    char path[256];
    dpar_dtype ct;
} ckjob;
static void ck_rank(world *w, dpar_comm *c, int r)
{
    ckjob *j = (ckjob *)w->user;
    size_t es = dpar_dtype_size(j->ct), i;
    dpar_fsdp *f[2] = {NULL, NULL};
    dpar_fsdp_desc d;
    dpar_tensor params[2][FT], grads[FT];
    unsigned char *mem[2][FT], *gm[FT];
    int k, u, o;
    memset(params, 0, sizeof params), memset(grads, 0, sizeof grads);
    for (k = 0; k < FT; k++) {
        gm[k] = (unsigned char *)malloc(f_tn[k] * es);
        grads[k].data = gm[k], grads[k].count = f_tn[k], grads[k].dtype = j->ct;
        for (o = 0; o < 2; o++) {
            mem[o][k] = (unsigned char *)malloc(f_tn[k] * es);
            params[o][k].data = mem[o][k], params[o][k].count = f_tn[k], params[o][k].dtype = j->ct;
            for (i = 0; i < f_tn[k]; i++) { /* the second object starts elsewhere */
                float x = (float)((int)((i * 5 + (size_t)k) % 23) - 11) / (o ? 7.0f : 11.0f);
                uint16_t h = dpar_f32_to_bf16(x);
                if (j->ct == DPAR_F32) memcpy(mem[o][k] + i * 4, &x, 4);
                else memcpy(mem[o][k] + i * 2, &h, 2);
            }
        }
        for (i = 0; i < f_tn[k]; i++) { /* every rank's gradient: 0.25 (r + 1) */
            float x = 0.25f * (float)(r + 1);
            uint16_t h = dpar_f32_to_bf16(x);
            if (j->ct == DPAR_F32) memcpy(gm[k] + i * 4, &x, 4);
            else memcpy(gm[k] + i * 2, &h, 2);
        }
    }
    memset(&d, 0, sizeof d);
    d.comm = c, d.stage = 2, d.num_units = FU, d.kind = DPAR_OPTIM_ADAM, d.lr = 0.05f, d.compute = j->ct;
    d.unit_tensors = f_ut, d.params = params[0], d.grads = grads;
    expect_ok(w, dpar_fsdp_create(&d, &f[0]), "fsdp_create", r);
    d.params = params[1];
    expect_ok(w, dpar_fsdp_create(&d, &f[1]), "fsdp_create (the second)", r);
    if (f[0] && f[1]) {
        for (u = FU - 1; u >= 0; u--) expect_ok(w, dpar_fsdp_reduce(f[0], u), "reduce", r);
        expect_ok(w, dpar_fsdp_step(f[0]), "step", r);
        expect_ok(w, dpar_ckpt_save_fsdp(f[0], j->path, NULL, NULL, 0), "save_fsdp", r);
        expect_ok(w, dpar_ckpt_load_fsdp(f[1], j->path, NULL, NULL, 0), "load_fsdp", r);
        for (k = 0; k < FT; k++)
            if (memcmp(mem[0][k], mem[1][k], f_tn[k] * es))
                note(w, "%s rank %d: params tensor %d after the load is not the saved one's", dpar_dtype_name(j->ct), r,
                     k);
    }
    dpar_fsdp_destroy(f[0]), dpar_fsdp_destroy(f[1]);
    for (k = 0; k < FT; k++) free(mem[0][k]), free(mem[1][k]), free(gm[k]);
}
static void test_fsdp_tensors_stage2_resume(void)
{
    int n, t;
    for (t = 0; t < 2; t++)
        for (n = 1; n <= 3; n++) {
            ckjob j;
            char dir[] = "/tmp/dpar_tensors_XXXXXX", cmd[300];
            CHECK(mkdtemp(dir) != NULL);
            snprintf(j.path, sizeof j.path, "%s/fsdp", dir);
            j.ct = t ? DPAR_BF16 : DPAR_F32;
            CHECK_MSG(run_world(n, ck_rank, &j) == 0, "%s N=%d", dpar_dtype_name(j.ct), n);
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
            CHECK(system(cmd) == 0);
        }
}

/* stage 2, 16-bit: dpar_fsdp_set_params writes the master weights in f32 and the arrays rounded (f16 and bf16) */
static void test_fsdp16_tensors_set_params(void)
{
    dpar_comm_desc cd = {0};
    dpar_group *g = NULL;
    dpar_comm *c = NULL;
    int ut[1] = {2}, k, i;
    cd.size = 1;
    CHECK(dpar_group_create(&cd, &g) == DPAR_OK && dpar_group_join(g, 0, &c) == DPAR_OK);
    for (k = 0; k < 2; k++) {
        dpar_dtype ct = k ? DPAR_F16 : DPAR_BF16;
        dpar_fsdp *f = NULL;
        dpar_fsdp_desc fd;
        dpar_tensor t[2];
        uint16_t h0[7], h1[5];
        float full[12], back[12];
        memset(&fd, 0, sizeof fd), memset(t, 0, sizeof t), memset(h0, 0, sizeof h0), memset(h1, 0, sizeof h1);
        t[0].data = h0, t[0].count = 7, t[1].data = h1, t[1].count = 5, t[0].dtype = t[1].dtype = ct;
        fd.comm = c, fd.stage = 2, fd.lr = 0.1f, fd.num_units = 1, fd.params = t, fd.unit_tensors = ut, fd.compute = ct;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_OK && f);
        for (i = 0; i < 12; i++) full[i] = 1.0f + (float)i / 3.0f; /* not exact in 16 bits */
        CHECK(f && dpar_fsdp_set_params(f, 0, full) == DPAR_OK && dpar_fsdp_get_params(f, 0, back) == DPAR_OK);
        CHECK(memcmp(full, back, sizeof full) == 0); /* the master weights: f32 */
        for (i = 0; i < 12; i++) {
            uint16_t want = k ? dpar_f32_to_f16(full[i]) : dpar_f32_to_bf16(full[i]);
            CHECK_MSG((i < 7 ? h0[i] : h1[i - 7]) == want, "%s element %d", dpar_dtype_name(ct), i);
        }
        dpar_fsdp_destroy(f);
    }
    dpar_comm_destroy(c);
    dpar_group_destroy(g);
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
        fd.unit_counts = NULL, fd.compute = DPAR_BF16; /* 16-bit compute: the tensors in the compute type */
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL &&
              strstr(dpar_last_error(), "params tensor 0 is f32; this object works in bf16"));
        fd.compute = DPAR_F32, fd.unit_tensors = NULL;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL); /* params without unit_tensors */
        fd.unit_tensors = ut;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_OK && f && dpar_fsdp_destroy(f) == DPAR_OK);
    }
    { /* 16-bit compute: lists of the compute type, a mix refused naming the tensor; 2-byte elements */
        dpar_fsdp *f = (dpar_fsdp *)1;
        dpar_fsdp_desc fd;
        uint16_t h[60];
        int ut[2] = {1, 1};
        memset(&fd, 0, sizeof fd);
        memset(t, 0, sizeof t), memset(u, 0, sizeof u);
        fd.comm = c, fd.lr = 0.1f, fd.num_units = 2, fd.params = t, fd.grads = u, fd.unit_tensors = ut;
        fd.compute = DPAR_BF16, fd.reduce_dtype = DPAR_BF16;
        t[0].data = h, t[0].count = 10, t[1].data = h + 30, t[1].count = 20; /* adjacent in 2-byte elements */
        u[0].data = h + 10, u[0].count = 10, u[1].data = h + 50, u[1].count = 20;
        t[0].dtype = t[1].dtype = u[0].dtype = u[1].dtype = DPAR_BF16;
        u[1].count = 10, t[1].count = 10, u[1].data = h + 40;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_OK && f && dpar_fsdp_destroy(f) == DPAR_OK);
        t[1].dtype = DPAR_F32; /* a mix */
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL && f == NULL &&
              strstr(dpar_last_error(), "params tensor 1 is f32; this object works in bf16"));
        t[1].dtype = DPAR_BF16, u[0].dtype = DPAR_F16;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL && strstr(dpar_last_error(), "grads tensor 0 is f16"));
        u[0].dtype = DPAR_BF16, u[1].data = h + 35; /* a gradient over a parameter, in 2-byte elements */
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL &&
              strstr(dpar_last_error(), "grads tensor 1 overlaps params tensor 1"));
        u[1].data = h + 5, u[1].count = 5, t[1].count = 5, t[0].count = 5; /* two gradient tensors overlapping */
        u[0].data = h + 7;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL && strstr(dpar_last_error(), "grads tensors 0 and 1 overlap"));
        u[0].data = h + 10, u[1].data = h + 15, fd.compute = DPAR_F16; /* f16 compute: bf16 tensors refused */
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL && strstr(dpar_last_error(), "reduce_dtype bf16"));
        fd.reduce_dtype = DPAR_F32;
        CHECK(dpar_fsdp_create(&fd, &f) == DPAR_EINVAL &&
              strstr(dpar_last_error(), "params tensor 0 is bf16; this object works in f16"));
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
    RUN(test_buckets_tensors_update_direct);
    RUN(test_zero1_tensors_equal_flat);
    RUN(test_fsdp_tensors_equal_flat);
    RUN(test_fsdp16_tensors_equal_flat);
    RUN(test_fsdp_tensors_stage2_resume);
    RUN(test_fsdp16_tensors_set_params);
    pools_free();
    return dt_summary();
}
