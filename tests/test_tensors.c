/* test_tensors.c - the tensor form (dpar_tensor lists: a model's arrays where they live) against the flat form and a
   serial reference: gradient buckets and ZeRO-1 over five separately allocated arrays, and dpar_fsdp (stages 2 and 3)
   over units of separate arrays, must give bitwise what the flat form gives (itself checked against a serial
   reference here, or in test_fsdp.c), on 1 to 4 thread ranks; bad lists are refused with a message naming the tensor.
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
    RUN(test_buckets_tensors_update_direct);
    RUN(test_zero1_tensors_equal_flat);
    RUN(test_fsdp_tensors_equal_flat);
    pools_free();
    return dt_summary();
}
