/* bench_cores.c - what this machine gives 2 threads for compute-bound work, the reference for the
   training benchmark's speed-up (bench/bench_train.sh): no program does better on 2 threads than
   the machine's own cores do on work with nothing to share.

   fma:  a loop of independent FMAs on registers only (AVX2 + FMA on x86, else plain floats), no
         memory, no synchronisation: 2 threads at once against 1. Below 2 when the cores slow down
         together (turbo clocks, a shared power budget, a hypervisor), whatever the program.
   gemm: the GEMMs of one training step of examples/data_parallel.c (784-1024-1024-10) with dpar_sgemm,
         batch 256 on 1 thread against batch 128 on each of 2 threads at once (own buffers): the
         step's compute with no communication and no other work.
   Samples of 1 and 2 threads alternate; each figure is the median of the per-pair ratios.

   Build: cc -std=c99 -O2 -I. bench/bench_cores.c -o bench_cores -pthread -lm
   Run:   ./bench_cores [samples]   (prints bench=cores threads=2 fma_speedup=X gemm_speedup=Y) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <stdio.h>
#include <stdlib.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FMA_AVX2 1
/* 10 independent chains: enough to keep two FMA pipes busy through their latency */
__attribute__((target("avx2,fma"))) static float fma_loop_avx2(long n)
{
    __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f), a[10];
    float out[8];
    long i;
    int k;
    for (k = 0; k < 10; k++) a[k] = _mm256_set1_ps(1.0f + 0.1f * (float)k); /* distinct: not merged */
    for (i = 0; i < n; i++) {
        a[0] = _mm256_fmadd_ps(a[0], m, c), a[1] = _mm256_fmadd_ps(a[1], m, c), a[2] = _mm256_fmadd_ps(a[2], m, c);
        a[3] = _mm256_fmadd_ps(a[3], m, c), a[4] = _mm256_fmadd_ps(a[4], m, c), a[5] = _mm256_fmadd_ps(a[5], m, c);
        a[6] = _mm256_fmadd_ps(a[6], m, c), a[7] = _mm256_fmadd_ps(a[7], m, c), a[8] = _mm256_fmadd_ps(a[8], m, c);
        a[9] = _mm256_fmadd_ps(a[9], m, c);
    }
    for (k = 1; k < 10; k++) a[0] = _mm256_add_ps(a[0], a[k]);
    _mm256_storeu_ps(out, a[0]);
    return out[0];
}
#else
#define FMA_AVX2 0
#endif

static float fma_loop_plain(long n)
{
    float a[10], s = 0;
    long i;
    int k;
    for (k = 0; k < 10; k++) a[k] = 1.0f + 0.1f * (float)k;
    for (i = 0; i < n; i++)
        for (k = 0; k < 10; k++) a[k] = a[k] * 0.9999999f + 1e-7f;
    for (k = 0; k < 10; k++) s += a[k];
    return s;
}

static int use_avx2(void)
{
#if FMA_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static float fma_loop(long n)
{
#if FMA_AVX2
    if (use_avx2()) return fma_loop_avx2(n);
#endif
    return fma_loop_plain(n);
}

/* the step's GEMMs at batch b (as examples/data_parallel.c makes them): forward, input gradients,
   weight gradients in row blocks of one 1 MiB bucket */
typedef struct {
    float *x, *w, *y;
} bufs;
static void step_gemms(const bufs *m, int b)
{
    static const int width[4] = {784, 1024, 1024, 10};
    int l, r0;
    for (l = 0; l < 3; l++) /* forward: (b, in) x (in, out) */
        dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, b, width[l + 1], width[l], 1, m->x, width[l], m->w, width[l + 1], 0,
                   m->y, width[l + 1]);
    for (l = 2; l > 0; l--) /* input gradients: (b, out) x (out, in)^T */
        dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, b, width[l], width[l + 1], 1, m->x, width[l + 1], m->w, width[l + 1], 0,
                   m->y, width[l]);
    for (l = 0; l < 3; l++) { /* weight gradients: (b, in)^T x (b, out), in blocks of rows */
        int rows = (1 << 18) / width[l + 1] < width[l] ? (1 << 18) / width[l + 1] : width[l];
        for (r0 = 0; r0 < width[l]; r0 += rows)
            dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, width[l] - r0 < rows ? width[l] - r0 : rows, width[l + 1], b, 1,
                       m->x + r0, width[l], m->y, width[l + 1], 0, m->w + (size_t)r0 * width[l + 1], width[l + 1]);
    }
}

typedef struct {
    int what;
    long n;
    int batch;
    bufs m[2];
    double ns[2];
    float sink[2];
} job;

static dpar_status body(void *user, int rank, int nranks)
{
    job *j = (job *)user;
    uint64_t t0 = dpar_time_ns();
    if (j->what == 0) j->sink[rank] = fma_loop(j->n);
    else step_gemms(&j->m[rank], j->batch / nranks);
    j->ns[rank] = (double)(dpar_time_ns() - t0);
    return DPAR_OK;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int samples = argc > 1 ? atoi(argv[1]) : 7, s, w, t, r;
    dpar_pool *pool[3] = {0};
    dpar_pool_desc pd = {0};
    job j = {0};
    double ratio[2][64];
    size_t i;
    if (samples < 1 || samples > 64) return fprintf(stderr, "bench_cores: samples 1 to 64\n"), 2;
    for (t = 1; t <= 2; t++) {
        pd.num_threads = t;
        if (dpar_pool_create(&pd, &pool[t]) != DPAR_OK)
            return fprintf(stderr, "bench_cores: %s\n", dpar_last_error()), 1;
    }
    for (r = 0; r < 2; r++) { /* each thread its own matrices, touched once here */
        j.m[r].x = (float *)malloc(sizeof(float) * 256 * 1024);
        j.m[r].w = (float *)malloc(sizeof(float) * 1024 * 1024);
        j.m[r].y = (float *)malloc(sizeof(float) * 256 * 1024);
        if (!j.m[r].x || !j.m[r].w || !j.m[r].y) return fprintf(stderr, "bench_cores: out of memory\n"), 1;
        for (i = 0; i < 256 * 1024; i++)
            j.m[r].x[i] = (float)(i % 13) / 13.0f - 0.5f, j.m[r].y[i] = (float)(i % 7) / 7.0f;
        for (i = 0; i < 1024 * 1024; i++) j.m[r].w[i] = (float)(i % 11) / 11.0f - 0.5f;
    }
    j.n = 20000000; /* about 0.1 s of FMAs on one core */
    j.batch = 256;
    for (w = 0; w < 2; w++) { /* warm up: caches, packing buffers, clocks */
        j.what = w;
        dpar_pool_run(pool[1], body, &j);
        dpar_pool_run(pool[2], body, &j);
    }
    for (s = 0; s < samples; s++)
        for (w = 0; w < 2; w++) {
            double one, two;
            j.what = w;
            dpar_pool_run(pool[1], body, &j);
            one = j.ns[0];
            dpar_pool_run(pool[2], body, &j);
            two = j.ns[0] > j.ns[1] ? j.ns[0] : j.ns[1]; /* both done */
            /* fma: 2 threads did twice the work; gemm: the same work (the batch split in two) */
            ratio[w][s] = w == 0 ? 2.0 * one / two : one / two;
        }
    for (w = 0; w < 2; w++) qsort(ratio[w], (size_t)samples, sizeof(double), cmp_double);
    printf("bench=cores threads=2 fma_speedup=%.2f gemm_speedup=%.2f (%s FMAs on registers, 2 threads against 1; the "
           "training step's GEMMs, batch 128 on each of 2 threads against 256 on 1; medians of %d pairs)\n",
           ratio[0][samples / 2], ratio[1][samples / 2], use_avx2() ? "AVX2" : "plain", samples);
    for (r = 0; r < 2; r++) free(j.m[r].x), free(j.m[r].w), free(j.m[r].y);
    for (t = 1; t <= 2; t++) dpar_pool_destroy(pool[t]);
    return (int)(j.sink[0] < 0); /* keeps the FMA results alive */
}
