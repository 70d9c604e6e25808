/* bench_comm.c - allreduce over thread ranks against a memory-bandwidth reference, in one run.

   For each size, first the reference: the N threads each make one pass of out[i] = x[i] + y[i]
   over the same number of bytes at the same time. Then N ranks allreduce that many bytes of f32
   (ring, then the deterministic tree). ratio = ref_us / us: 1.0 means the allreduce costs one
   pass over memory. Medians of 5 samples.

   Build: cc -std=c99 -O2 -I. bench/bench_comm.c -o bench_comm -pthread
   Run:   ./bench_comm [max_bytes]      (default 256 MiB; prints one bench= line per case) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <stdio.h>
#include <stdlib.h>

#define SAMPLES 5

typedef struct {
    int n, det;
    size_t bytes;
    int reps;
    float *x[4], *y[4], *out[4];
    dpar_comm *comm[4];
    double sample_us[2][SAMPLES]; /* [reference, allreduce] */
    dpar_pool *pool;
} bench;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static dpar_status rank_main(void *user, int r, int n)
{
    bench *b = (bench *)user;
    size_t count = b->bytes / sizeof(float), i;
    int s, k;
    float *x = b->x[r], *y = b->y[r], *o = b->out[r];
    dpar_comm *c = b->comm[r];
    (void)n;
    for (s = -1; s < SAMPLES; s++) { /* sample -1 warms up */
        uint64_t t0;
        /* reference: one pass of out = x + y on every thread at once */
        dpar_pool_barrier(b->pool);
        t0 = dpar_time_ns();
        for (k = 0; k < b->reps; k++) {
            for (i = 0; i < count; i++) o[i] = x[i] + y[i];
            __asm__ __volatile__("" ::"r"(o) : "memory");
        }
        dpar_pool_barrier(b->pool);
        if (r == 0 && s >= 0) b->sample_us[0][s] = (double)(dpar_time_ns() - t0) / 1e3 / b->reps;
        /* allreduce of the same bytes */
        dpar_barrier(c);
        t0 = dpar_time_ns();
        for (k = 0; k < b->reps; k++) dpar_allreduce(c, x, o, count, DPAR_F32, DPAR_SUM);
        dpar_barrier(c);
        if (r == 0 && s >= 0) b->sample_us[1][s] = (double)(dpar_time_ns() - t0) / 1e3 / b->reps;
    }
    return DPAR_OK;
}

static dpar_status join(void *user, int r, int n)
{
    bench *b = (bench *)user;
    dpar_group *g = *(dpar_group **)((char *)user + sizeof(bench));
    (void)n;
    return dpar_group_join(g, r, &b->comm[r]);
}
static dpar_status leave(void *user, int r, int n)
{
    (void)n;
    return dpar_comm_destroy(((bench *)user)->comm[r]);
}
static dpar_status touch(void *user, int r, int n)
{
    bench *b = (bench *)user;
    size_t count = b->bytes / sizeof(float), i;
    (void)n;
    for (i = 0; i < count; i++) { /* first touch on the thread that uses it */
        b->x[r][i] = (float)(i % 7);
        b->y[r][i] = 1.0f;
        b->out[r][i] = 0.0f;
    }
    return DPAR_OK;
}

int main(int argc, char **argv)
{
    size_t max_bytes = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : (size_t)256 << 20, bytes;
    int ni, det, r;
    static const int ranks[] = {2, 4};
    for (ni = 0; ni < 2; ni++) {
        int n = ranks[ni];
        struct {
            bench b;
            dpar_group *g;
        } w;
        dpar_pool_desc pd;
        memset(&w, 0, sizeof w);
        memset(&pd, 0, sizeof pd);
        pd.num_threads = n;
        if (dpar_pool_create(&pd, &w.b.pool) != DPAR_OK) return 1;
        w.b.n = n;
        for (r = 0; r < n; r++) {
            w.b.x[r] = (float *)malloc(max_bytes);
            w.b.y[r] = (float *)malloc(max_bytes);
            w.b.out[r] = (float *)malloc(max_bytes);
            if (!w.b.x[r] || !w.b.y[r] || !w.b.out[r]) {
                fprintf(stderr, "bench_comm: out of memory\n");
                return 1;
            }
        }
        w.b.bytes = max_bytes;
        dpar_pool_run(w.b.pool, touch, &w.b);
        for (det = 0; det < 2; det++) {
            dpar_comm_desc d;
            memset(&d, 0, sizeof d);
            d.size = n;
            d.deterministic = det;
            if (dpar_group_create(&d, &w.g) != DPAR_OK) return 1;
            dpar_pool_run(w.b.pool, join, &w);
            for (bytes = 4096; bytes <= max_bytes; bytes *= 4) {
                double ref, us, busbw;
                w.b.bytes = bytes;
                w.b.reps = bytes <= 65536 ? 2000 : bytes <= (1u << 20) ? 200 : bytes <= (16u << 20) ? 10 : 2;
                dpar_pool_run(w.b.pool, rank_main, &w.b);
                qsort(w.b.sample_us[0], SAMPLES, sizeof(double), cmp_double);
                qsort(w.b.sample_us[1], SAMPLES, sizeof(double), cmp_double);
                ref = w.b.sample_us[0][SAMPLES / 2];
                us = w.b.sample_us[1][SAMPLES / 2];
                busbw = (double)bytes / (us * 1e3) * 2.0 * (n - 1) / n;
                printf(
                    "bench=allreduce transport=%s ranks=%d bytes=%zu us=%.2f busbw_GBps=%.2f ref_us=%.2f ratio=%.2f\n",
                    det ? "threads-det" : "threads", n, bytes, us, busbw, ref, ref / us);
                fflush(stdout);
            }
            dpar_pool_run(w.b.pool, leave, &w.b);
            dpar_group_destroy(w.g);
        }
        for (r = 0; r < n; r++) {
            free(w.b.x[r]);
            free(w.b.y[r]);
            free(w.b.out[r]);
        }
        dpar_pool_destroy(w.b.pool);
    }
    return 0;
}
