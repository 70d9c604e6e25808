/* bench_pool.c - per-call overhead of dpar's parallel-for and barrier next to OpenMP's, measured in the
   same run with the EPCC syncbench method: many repetitions of a tiny fixed work item (delay), minus
   the time the work item takes serially. Medians of interleaved samples, each side idle before the
   other's sample, so spinning threads of one runtime do not slow the other.

   Build: cc -std=c99 -O2 -fopenmp -I. bench/bench_pool.c -o bench_pool -pthread
   Run:   ./bench_pool            (prints one line per figure, e.g.
          bench=pool_for threads=2 dpar_us=0.41 omp_us=0.52 ratio=0.79) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define SAMPLES 15
#ifndef SETTLE_US
#define SETTLE_US 30000
#endif
static int delay_length = 1;

static void delay(int n)
{
    int i;
    float a = 0;
    for (i = 0; i < n; i++) {
        a += (float)i;
        __asm__ __volatile__("" : "+r"(a)); /* keep the loop */
    }
}

static double now_us(void) { return (double)dpar_time_ns() * 1e-3; }

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

/* the serial time of one delay, in us */
static double reference_us(int reps)
{
    double s[SAMPLES];
    int k, j;
    for (k = 0; k < SAMPLES; k++) {
        double t0 = now_us();
        for (j = 0; j < reps; j++) delay(delay_length);
        s[k] = (now_us() - t0) / reps;
    }
    return median(s, SAMPLES);
}

static void for_body(void *user, int64_t begin, int64_t end, int thread)
{
    int64_t i;
    for (i = begin; i < end; i++) delay(delay_length);
    (void)user;
    (void)thread;
}

typedef struct {
    dpar_pool *pool;
    int reps;
} barrier_job;
static dpar_status barrier_body(void *user, int thread, int nthreads)
{
    barrier_job *b = (barrier_job *)user;
    int j;
    for (j = 0; j < b->reps; j++) {
        delay(delay_length);
        dpar_pool_barrier(b->pool);
    }
    (void)thread;
    (void)nthreads;
    return DPAR_OK;
}

static double bench_for_sample(dpar_pool *pool, int threads, int reps)
{
    double t0 = now_us();
    int j;
    for (j = 0; j < reps; j++) dpar_pool_for(pool, threads, for_body, NULL);
    return (now_us() - t0) / reps;
}

static double omp_for_sample(int threads, int reps)
{
    double t0 = now_us();
    int j;
    for (j = 0; j < reps; j++) {
        int i;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (i = 0; i < threads; i++) delay(delay_length);
    }
    return (now_us() - t0) / reps;
}

static double bench_barrier_sample(dpar_pool *pool, int reps)
{
    barrier_job b;
    double t0;
    b.pool = pool;
    b.reps = reps;
    t0 = now_us();
    dpar_pool_run(pool, barrier_body, &b);
    return (now_us() - t0) / reps;
}

static double omp_barrier_sample(int threads, int reps)
{
    double t0 = now_us();
#pragma omp parallel num_threads(threads)
    {
        int j;
        for (j = 0; j < reps; j++) {
            delay(delay_length);
#pragma omp barrier
        }
    }
    return (now_us() - t0) / reps;
}

static void settle(void) { usleep(SETTLE_US); } /* both runtimes' spinners go to sleep */

int main(void)
{
    int ti, k, reps = 4000;
    int thread_counts[] = {2, 4};
    double ref;
    /* EPCC: a delay of about 0.1 us */
    for (delay_length = 1;; delay_length *= 2) {
        double t0 = now_us();
        delay(delay_length * 1000);
        if ((now_us() - t0) / 1000 >= 0.1) break;
    }
    ref = reference_us(100000);
    for (ti = 0; ti < 2; ti++) {
        int T = thread_counts[ti];
        dpar_pool *pool;
        dpar_pool_desc d;
        double dfor[SAMPLES], ofor[SAMPLES], dbar[SAMPLES], obar[SAMPLES], x, y;
        memset(&d, 0, sizeof d);
        d.num_threads = T;
        if (dpar_pool_create(&d, &pool) != DPAR_OK) {
            fprintf(stderr, "bench_pool: %s\n", dpar_last_error());
            return 1;
        }
        bench_for_sample(pool, T, reps); /* warm up both */
        omp_for_sample(T, reps);
        for (k = 0; k < SAMPLES; k++) {
            settle();
            dfor[k] = bench_for_sample(pool, T, reps) - ref;
            settle();
            ofor[k] = omp_for_sample(T, reps) - ref;
            settle();
            dbar[k] = bench_barrier_sample(pool, reps) - ref;
            settle();
            obar[k] = omp_barrier_sample(T, reps) - ref;
        }
        x = median(dfor, SAMPLES);
        y = median(ofor, SAMPLES);
        printf("bench=pool_for threads=%d dpar_us=%.3f omp_us=%.3f ratio=%.2f\n", T, x, y, x / y);
        x = median(dbar, SAMPLES);
        y = median(obar, SAMPLES);
        printf("bench=pool_barrier threads=%d dpar_us=%.3f omp_us=%.3f ratio=%.2f\n", T, x, y, x / y);
        fflush(stdout);
        dpar_pool_destroy(pool);
    }
    return 0;
}
