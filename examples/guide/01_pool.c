/* 01_pool.c - lesson 1 of the guide (docs/guide/01_pool.md): the worker pool that every other lesson runs on.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/01_pool.c -o build/lesson01 -pthread -lm
   Run:   build/lesson01              (build/lesson01 3: three threads)
   Check: ^parallel-for: [0-9]+ squares on [0-9]+ threads equal the serial loop's$
   Check: ^spmd: every thread's total [0-9]+ equals the serial sum$

   Two ways to put threads to work:
   1. a parallel-for: one call hands each thread a block of a loop and waits for all of them;
   2. an SPMD run: every thread runs the same function at once (as every rank of a trainer will), and the
      threads meet at a barrier when one needs what the others wrote. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <stdio.h>
#include <stdlib.h>

#define N 1000000
#define MAX_THREADS 64

static int64_t x[N], y[N];
static int64_t done_by[MAX_THREADS];    /* how many elements each thread squared */
static int64_t partial[MAX_THREADS];    /* SPMD: each thread's sum of its share */
static int64_t total_seen[MAX_THREADS]; /* SPMD: the total each thread computed after the barrier */

/* The body of the parallel-for gets a range [begin, end), not one index: one call per block, so the
   cost of the call is paid once per thread, not once per element. `thread` says who runs it. */
static void square(void *user, int64_t begin, int64_t end, int thread)
{
    int64_t i;
    (void)user;
    for (i = begin; i < end; i++) y[i] = x[i] * x[i];
    done_by[thread] += end - begin; /* only this thread writes its own slot: no race */
}

/* The SPMD function: every thread of the pool runs it at once; `thread` is 0..nthreads-1. */
static dpar_status sum_region(void *user, int thread, int nthreads)
{
    dpar_pool *pool = (dpar_pool *)user;
    dpar_share s;
    int64_t i, mine = 0, total = 0;
    int t;
    /* Phase 1: this thread's share of the loop (the same static split as dpar_pool_for). */
    for (s = dpar_pool_share(pool, N, DPAR_SCHEDULE_STATIC, 0); dpar_share_next(&s);)
        for (i = s.i; i < s.end; i++) mine += y[i];
    partial[thread] = mine;
    /* The barrier: nobody goes on until every thread has arrived here, so every partial[] is written.
       Without it a fast thread would read a slow one's slot before it was filled. */
    dpar_pool_barrier(pool);
    /* Phase 2: every thread reads all partial sums (in thread order, so all get the same total). */
    for (t = 0; t < nthreads; t++) total += partial[t];
    total_seen[thread] = total;
    return DPAR_OK;
}

int main(int argc, char **argv)
{
    dpar_pool_desc desc = {0};
    dpar_pool *pool;
    int64_t i, serial = 0, counted = 0;
    int t, nthreads, ok = 1;
    desc.num_threads = argc > 1 ? atoi(argv[1]) : 4; /* the caller plus num_threads - 1 workers */
    if (desc.num_threads < 1 || desc.num_threads > MAX_THREADS) {
        fprintf(stderr, "01_pool: %d threads: give 1 to %d\n", desc.num_threads, MAX_THREADS);
        return 2;
    }
    if (dpar_pool_create(&desc, &pool) != DPAR_OK) {
        fprintf(stderr, "dpar_pool_create: %s\n", dpar_last_error());
        return 1;
    }
    nthreads = dpar_pool_num_threads(pool);
    for (i = 0; i < N; i++) x[i] = i % 1000;

    /* 1. Parallel-for: square every element, then check against the serial loop. */
    dpar_pool_for(pool, N, square, NULL);
    for (i = 0; i < N; i++) ok &= y[i] == x[i] * x[i];
    for (t = 0; t < nthreads; t++) {
        printf("  thread %d squared %lld elements\n", t, (long long)done_by[t]);
        counted += done_by[t];
    }
    ok &= counted == N; /* every element exactly once */
    if (ok) printf("parallel-for: %d squares on %d threads equal the serial loop's\n", N, nthreads);

    /* 2. SPMD run: a sum split over the threads, combined after a barrier. */
    for (i = 0; i < N; i++) serial += y[i];
    if (dpar_pool_run(pool, sum_region, pool) != DPAR_OK) {
        fprintf(stderr, "dpar_pool_run: %s\n", dpar_last_error());
        return 1;
    }
    for (t = 0; t < nthreads; t++) {
        printf("  thread %d: its share's sum %lld, total after the barrier %lld\n", t, (long long)partial[t],
               (long long)total_seen[t]);
        ok &= total_seen[t] == serial;
    }
    if (ok) printf("spmd: every thread's total %lld equals the serial sum\n", (long long)serial);

    dpar_pool_destroy(pool);
    if (!ok) fprintf(stderr, "FAILED: a result differs from the serial computation\n");
    return ok ? 0 : 1;
}
