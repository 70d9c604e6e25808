/* bench_gemm.c - GEMM speed, side by side in one run (needs OpenBLAS).

   mode=sharded: one M = N = K = n GEMM cut over the 2 threads of a dpar pool, each part a
   single-threaded OpenBLAS call, against OpenBLAS's own 2-thread cblas_sgemm.
   mode=builtin: dpar's built-in kernel against single-threaded OpenBLAS.
   Each sample times about 40 ms of back-to-back calls (the steady state of a training loop);
   samples of the two sides alternate, 7 of each, with a 150 ms pause before each so that neither
   side's idle threads are still spinning (OpenBLAS's spin about 2^28 cycles after a call). Medians.

   Build: cc -std=c99 -O2 -DDPAR_OPENBLAS -I. bench/bench_gemm.c -o bench_gemm -pthread -lm -lopenblas
   Run:   ./bench_gemm */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define RUNS 7

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double gflops(int n, uint64_t ns) { return 2.0 * n * n * (double)n / (double)ns; }

int main(void)
{
    static const int sizes[] = {512, 1024, 2048};
    dpar_pool *pool;
    dpar_pool_desc pd;
    int si, r, mode;
    size_t i;
    memset(&pd, 0, sizeof pd);
    pd.num_threads = 2;
    if (dpar_pool_create(&pd, &pool) != DPAR_OK) return 1;
    for (mode = 0; mode < 2; mode++)
        for (si = 0; si < 3; si++) {
            int n = sizes[si];
            size_t nn = (size_t)n * n;
            float *A = (float *)malloc(nn * sizeof(float)), *B = (float *)malloc(nn * sizeof(float));
            float *C = (float *)malloc(nn * sizeof(float));
            double d[RUNS], o[RUNS];
            int reps = n <= 512 ? 16 : n <= 1024 ? 4 : 1; /* about 40 ms */
            for (i = 0; i < nn; i++) {
                A[i] = (float)(i % 13) / 13.0f - 0.5f;
                B[i] = (float)(i % 11) / 11.0f - 0.5f;
                C[i] = 0;
            }
            for (r = -1; r < RUNS; r++) { /* run -1 warms up */
                uint64_t t0;
                int k;
                usleep(150000);
                t0 = dpar_time_ns();
                for (k = 0; k < reps; k++) {
                    if (mode == 0)
                        dpar_sgemm_pool(pool, DPAR_NO_TRANS, DPAR_NO_TRANS, n, n, n, 1.0f, A, n, B, n, 0.0f, C, n);
                    else dpar_sgemm_builtin(DPAR_NO_TRANS, DPAR_NO_TRANS, n, n, n, 1.0f, A, n, B, n, 0.0f, C, n);
                }
                if (r >= 0) d[r] = gflops(n, (dpar_time_ns() - t0) / (uint64_t)reps);
                usleep(150000);
                openblas_set_num_threads(mode == 0 ? 2 : 1);
                t0 = dpar_time_ns();
                for (k = 0; k < reps; k++)
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, A, n, B, n, 0.0f, C, n);
                if (r >= 0) o[r] = gflops(n, (dpar_time_ns() - t0) / (uint64_t)reps);
            }
            qsort(d, RUNS, sizeof(double), cmp_double);
            qsort(o, RUNS, sizeof(double), cmp_double);
            printf("bench=gemm mode=%s threads=%d n=%d dpar_gflops=%.1f openblas_gflops=%.1f ratio=%.2f\n",
                   mode == 0 ? "sharded" : "builtin", mode == 0 ? 2 : 1, n, d[RUNS / 2], o[RUNS / 2],
                   d[RUNS / 2] / o[RUNS / 2]);
            fflush(stdout);
            free(A);
            free(B);
            free(C);
        }
    dpar_pool_destroy(pool);
    return 0;
}
