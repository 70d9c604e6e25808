/* test_fsdp.c - ZeRO-2 and ZeRO-3 (dpar_fsdp) against plain data parallelism: the same model, data and optimizer
   on N = 1, 2, 3, 4 thread ranks, with units of uneven sizes (one smaller than N); after every step the parameters
   must be bitwise those of a run that allreduces each unit's gradients (AVG) and applies the optimizer itself.
   Build and run: make test   (one test: ./build/test_fsdp stage3) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include "dpar_test.h"
#include "coll_matrix.h"

#include "fsdp_case.h"

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
