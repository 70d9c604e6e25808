/* test_gemm.c - dpar_sgemm (OpenBLAS when built with DPAR_OPENBLAS), the built-in kernel, and one
   GEMM over a pool, against the naive double-accumulating reference over random shapes, every
   transpose, alpha, beta and leading dimension. make test builds it three ways: plain, with
   -DDPAR_OPENBLAS -lopenblas (when found), and with -DDPAR_NO_AVX2 (the portable kernel). */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>

#include "dpar_test.h"

static float frand(void) { return (float)((double)(dt_rand() % 20001) / 10000.0 - 1.0); }

/* Run one case through `fn` and the reference; the error bound of each element is a few float
   ulps of the sum of |terms| (the reference accumulates in double). Also checks that C's padding
   columns are untouched and that beta = 0 ignores NaN in C. */
typedef dpar_status (*gemm_fn)(dpar_trans, dpar_trans, int, int, int, float, const float *, int, const float *, int,
                               float, float *, int);
static dpar_pool *gemm_pool;
static dpar_status pool_gemm(dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha, const float *A, int lda,
                             const float *B, int ldb, float beta, float *C, int ldc)
{
    return dpar_sgemm_pool(gemm_pool, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

static int one_case(gemm_fn fn, dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha, float beta, int pad)
{
    int lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad, i, j, k, bad = 0;
    size_t na, nb, nc;
    float *A, *B, *C, *R;
    if (lda < 1) lda = 1; /* BLAS wants leading dimensions of at least 1 */
    if (ldb < 1) ldb = 1;
    if (ldc < 1) ldc = 1;
    na = (size_t)(ta ? K : M) * (size_t)lda;
    nb = (size_t)(tb ? N : K) * (size_t)ldb;
    nc = (size_t)M * (size_t)ldc;
    A = (float *)malloc((na + 1) * sizeof(float));
    B = (float *)malloc((nb + 1) * sizeof(float));
    C = (float *)malloc((nc + 1) * sizeof(float));
    R = (float *)malloc((nc + 1) * sizeof(float));
    for (i = 0; i < (int)na; i++) A[i] = frand();
    for (i = 0; i < (int)nb; i++) B[i] = frand();
    for (i = 0; i < (int)nc; i++)
        C[i] = R[i] = (i % ldc >= N) ? 12345.0f : (beta == 0.0f && i % 7 == 0 ? NAN : frand());
    if (fn(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) != DPAR_OK) return 1;
    dpar_sgemm_ref(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, R, ldc);
    for (i = 0; i < M && !bad; i++)
        for (j = 0; j < ldc && !bad; j++) {
            float got = C[(size_t)i * ldc + j], want = R[(size_t)i * ldc + j];
            double mag = 0;
            if (j >= N) {
                bad = got != 12345.0f;
                continue;
            }
            for (k = 0; k < K; k++)
                mag += fabs((double)(ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k]) *
                            (double)(tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j]));
            mag = fabs(alpha) * mag + 1.0;
            bad = !(fabs((double)got - (double)want) <= 4e-6 * mag * (1 + K / 64.0));
        }
    if (bad)
        printf("    ta=%d tb=%d M=%d N=%d K=%d alpha=%g beta=%g pad=%d: element (%d, %d) wrong\n", ta, tb, M, N, K,
               alpha, beta, pad, i - 1, j - 1);
    free(A);
    free(B);
    free(C);
    free(R);
    return bad;
}

static int random_cases(gemm_fn fn, int count, int maxdim)
{
    static const float alphas[] = {1.0f, 0.5f, -2.0f, 0.0f}, betas[] = {0.0f, 1.0f, 0.3f};
    int c, fails = 0;
    for (c = 0; c < count; c++) {
        int M = dt_rand_int(maxdim + 1), N = dt_rand_int(maxdim + 1), K = dt_rand_int(maxdim + 1);
        fails += one_case(fn, (dpar_trans)(c & 1), (dpar_trans)((c >> 1) & 1), M, N, K, alphas[dt_rand_int(4)],
                          betas[dt_rand_int(3)], dt_rand_int(3) ? 0 : 1 + dt_rand_int(5));
    }
    return fails;
}

static void test_builtin_matches_reference(void)
{
    int ta, tb;
    CHECK(random_cases(dpar_sgemm_builtin, 400, 40) == 0);
    CHECK(random_cases(dpar_sgemm_builtin, 40, 300) == 0); /* several blocks of KC, MC */
    for (ta = 0; ta < 2; ta++)                             /* across the NC and KC block edges */
        for (tb = 0; tb < 2; tb++)
            CHECK(one_case(dpar_sgemm_builtin, (dpar_trans)ta, (dpar_trans)tb, 13, 2100, 600, 1.0f, 0.5f, 3) == 0);
#if DPAR__AVX2
    printf("    micro-kernel: %s\n", dpar__have_avx2() ? "AVX2 + FMA" : "portable (no AVX2 on this CPU)");
#else
    printf("    micro-kernel: portable\n");
#endif
}

static void test_sgemm_matches_reference(void)
{
#ifdef DPAR_OPENBLAS
    printf("    dpar_sgemm is OpenBLAS's cblas_sgemm\n");
#else
    printf("    dpar_sgemm is the built-in kernel\n");
#endif
    CHECK(random_cases(dpar_sgemm, 400, 40) == 0);
    CHECK(random_cases(dpar_sgemm, 30, 300) == 0);
}

static void test_pool_gemm_matches_reference(void)
{
    int t;
    for (t = 1; t <= 3; t++) {
        dpar_pool_desc d;
        memset(&d, 0, sizeof d);
        d.num_threads = t;
        CHECK(dpar_pool_create(&d, &gemm_pool) == DPAR_OK);
        CHECK(random_cases(pool_gemm, 60, 200) == 0);
        /* wide: cut by columns */
        CHECK(one_case(pool_gemm, DPAR_NO_TRANS, DPAR_TRANS, 4, 900, 70, 1.0f, 0.0f, 1) == 0);
        CHECK(one_case(pool_gemm, DPAR_TRANS, DPAR_NO_TRANS, 500, 30, 90, -1.0f, 1.0f, 0) == 0); /* tall: by rows */
        dpar_pool_destroy(gemm_pool);
    }
}

#ifdef DPAR_OPENBLAS
static dpar_status openblas_threads_in_pool(void *user, int t, int n)
{
    float a[4] = {1, 2, 3, 4}, c[4];
    (void)n;
    dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, 2, 2, 2, 1.0f, a, 2, a, 2, 0.0f, c, 2);
    if (t == 0) *(int *)user = openblas_get_num_threads();
    return DPAR_OK;
}
#endif

static void test_openblas_is_single_threaded_in_pools(void)
{
#ifdef DPAR_OPENBLAS
    dpar_pool *p;
    dpar_pool_desc d;
    int seen = -1;
    memset(&d, 0, sizeof d);
    d.num_threads = 2;
    openblas_set_num_threads(2);
    CHECK(dpar_pool_create(&d, &p) == DPAR_OK);
    CHECK(dpar_pool_run(p, openblas_threads_in_pool, &seen) == DPAR_OK);
    CHECK_MSG(seen == 1, "OpenBLAS had %d threads inside the pool", seen);
    dpar_pool_destroy(p);
#else
    SKIP("built without DPAR_OPENBLAS");
#endif
}

static void test_bad_input(void)
{
    float a[4] = {0}, c[4];
    CHECK(dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, -1, 2, 2, 1.0f, a, 2, a, 2, 0.0f, c, 2) == DPAR_EINVAL);
    CHECK(dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, 2, 2, 2, 1.0f, a, 1, a, 2, 0.0f, c, 2) == DPAR_EINVAL);
    CHECK(strstr(dpar_last_error(), "lda = 1") != NULL);
    CHECK(dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, 3, 2, 2, 1.0f, a, 2, a, 2, 0.0f, c, 2) == DPAR_EINVAL); /* lda < M */
    CHECK(dpar_sgemm_builtin(DPAR_NO_TRANS, DPAR_NO_TRANS, 2, 2, 2, 1.0f, a, 2, a, 2, 0.0f, c, 1) == DPAR_EINVAL);
    CHECK(dpar_sgemm_builtin((dpar_trans)5, DPAR_NO_TRANS, 2, 2, 2, 1.0f, a, 2, a, 2, 0.0f, c, 2) == DPAR_EINVAL);
    CHECK(dpar_sgemm_builtin(DPAR_NO_TRANS, DPAR_NO_TRANS, 2, 2, 2, 1.0f, NULL, 2, a, 2, 0.0f, c, 2) == DPAR_EINVAL);
    CHECK(dpar_sgemm_builtin(DPAR_NO_TRANS, DPAR_NO_TRANS, 0, 0, 0, 1.0f, NULL, 1, NULL, 1, 0.0f, NULL, 1) == DPAR_OK);
    CHECK(dpar_sgemm_pool(NULL, DPAR_NO_TRANS, DPAR_NO_TRANS, 2, 2, 2, 1.0f, a, 2, a, 2, 0.0f, c, 2) == DPAR_EINVAL);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_bad_input);
    RUN(test_builtin_matches_reference);
    RUN(test_sgemm_matches_reference);
    RUN(test_pool_gemm_matches_reference);
    RUN(test_openblas_is_single_threaded_in_pools);
    return dt_summary();
}
