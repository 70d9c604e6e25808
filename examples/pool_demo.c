/* pool_demo.c - dpar's worker pool doing real work three ways, checked against serial runs.

   Build: cc -std=c99 -O2 -I. examples/pool_demo.c -o pool_demo -pthread -lm
   Run:   ./pool_demo            (DPAR_NUM_THREADS=4 ./pool_demo, DPAR_TRACE=pool.json ./pool_demo)
   Check: image equals the serial one
   Check: serial sum agrees

   1. parallel-for, dynamic schedule: render a Mandelbrot set (rows of very different cost).
   2. task graph: per-block statistics of the image, then a reduction that depends on all of them.
   3. SPMD run: every thread normalises its share of the image, meeting at a barrier. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <stdio.h>
#include <stdlib.h>

#define W 1024
#define H 768
#define MAX_ITER 500
#define BLOCKS 16

static unsigned short image[H][W], serial_image[H][W];

static void render_rows(void *user, int64_t begin, int64_t end, int thread)
{
    unsigned short(*img)[W] = (unsigned short(*)[W])user;
    int64_t y;
    (void)thread;
    for (y = begin; y < end; y++) {
        int x;
        for (x = 0; x < W; x++) {
            double cr = -2.2 + 3.0 * x / W, ci = -1.2 + 2.4 * (double)y / H, zr = 0, zi = 0;
            int it = 0;
            while (it < MAX_ITER && zr * zr + zi * zi < 4.0) {
                double t = zr * zr - zi * zi + cr;
                zi = 2 * zr * zi + ci;
                zr = t;
                it++;
            }
            img[y][x] = (unsigned short)it;
        }
    }
}

typedef struct {
    int block;
    unsigned long long sum;
    unsigned max;
} block_stats;
static block_stats stats[BLOCKS];
static unsigned long long total_sum;
static unsigned total_max;

static dpar_status block_task(void *user)
{
    block_stats *s = (block_stats *)user;
    int y, x;
    for (y = s->block * (H / BLOCKS); y < (s->block + 1) * (H / BLOCKS); y++)
        for (x = 0; x < W; x++) {
            s->sum += image[y][x];
            if (image[y][x] > s->max) s->max = image[y][x];
        }
    return DPAR_OK;
}

static dpar_status reduce_task(void *user)
{
    int b;
    (void)user;
    for (b = 0; b < BLOCKS; b++) {
        total_sum += stats[b].sum;
        if (stats[b].max > total_max) total_max = stats[b].max;
    }
    return DPAR_OK;
}

static float normalised[H][W];
typedef struct {
    dpar_pool *pool;
    double partial[64];
    double mean;
} norm_job;

static dpar_status normalise(void *user, int thread, int nthreads)
{
    norm_job *j = (norm_job *)user;
    int y0 = H * thread / nthreads, y1 = H * (thread + 1) / nthreads, y, x, t;
    double s = 0;
    for (y = y0; y < y1; y++)
        for (x = 0; x < W; x++) s += image[y][x];
    j->partial[thread] = s;
    dpar_pool_barrier(j->pool); /* every partial sum is in */
    if (thread == 0) {
        double all = 0;
        for (t = 0; t < nthreads; t++) all += j->partial[t];
        j->mean = all / ((double)W * H);
    }
    dpar_pool_barrier(j->pool); /* the mean is in */
    for (y = y0; y < y1; y++)
        for (x = 0; x < W; x++) normalised[y][x] = (float)(image[y][x] / j->mean);
    return DPAR_OK;
}

int main(void)
{
    dpar_pool *pool;
    dpar_task blocks[BLOCKS], reduce;
    dpar_task_desc d;
    norm_job nj;
    uint64_t t0, t_serial, t_par;
    unsigned long long check = 0;
    int b, y, x, same = 1;

    if (dpar_pool_create(NULL, &pool) != DPAR_OK) {
        fprintf(stderr, "pool_demo: %s\n", dpar_last_error());
        return 1;
    }
    printf("dpar %s pool demo: %d threads (the caller and %d workers)\n", DPAR_VERSION, dpar_pool_num_threads(pool),
           dpar_pool_num_threads(pool) - 1);

    /* 1. parallel-for */
    t0 = dpar_time_ns();
    render_rows(serial_image, 0, H, 0);
    t_serial = dpar_time_ns() - t0;
    t0 = dpar_time_ns();
    dpar_pool_for_dynamic(pool, H, 4, render_rows, image);
    t_par = dpar_time_ns() - t0;
    for (y = 0; y < H; y++)
        for (x = 0; x < W; x++) same &= image[y][x] == serial_image[y][x];
    printf("1. parallel-for: rendered a %dx%d Mandelbrot set in %.1f ms (serial %.1f ms, %.2fx); "
           "image %s the serial one\n",
           W, H, t_par / 1e6, t_serial / 1e6, (double)t_serial / (double)t_par, same ? "equals" : "DIFFERS FROM");

    /* 2. task graph */
    memset(&d, 0, sizeof d);
    for (b = 0; b < BLOCKS; b++) {
        stats[b].block = b;
        d.fn = block_task;
        d.user = &stats[b];
        d.name = "block stats";
        dpar_task_submit(pool, &d, &blocks[b]);
    }
    d.fn = reduce_task;
    d.user = NULL;
    d.deps = blocks;
    d.num_deps = BLOCKS;
    d.name = "reduce";
    dpar_task_submit(pool, &d, &reduce);
    if (dpar_task_wait_all(pool) != DPAR_OK) fprintf(stderr, "pool_demo: %s\n", dpar_last_error());
    for (y = 0; y < H; y++)
        for (x = 0; x < W; x++) check += serial_image[y][x];
    printf("2. task graph: %d block tasks then 1 reduction: %llu iterations in all, deepest point %u "
           "(serial sum %s)\n",
           BLOCKS, total_sum, total_max, check == total_sum ? "agrees" : "DISAGREES");

    /* 3. SPMD run */
    memset(&nj, 0, sizeof nj);
    nj.pool = pool;
    dpar_pool_run(pool, normalise, &nj);
    printf("3. SPMD run: %d threads normalised their rows by the global mean %.3f (expected %.3f)\n",
           dpar_pool_num_threads(pool), nj.mean, (double)check / ((double)W * H));

    dpar_pool_destroy(pool);
    return same && check == total_sum ? 0 : 1;
}
