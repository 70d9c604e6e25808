/* 18_accumulation_clipping.c - lesson 18 of the guide (docs/guide/18_accumulation_clipping.md): gradient accumulation
   and global-norm clipping when each rank holds only a shard of the gradients.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/18_accumulation_clipping.c -o build/lesson18 -pthread -lm
   Run:   build/lesson18   (build/lesson18 2: accumulate 2 micro-batches per step instead of 4)
   Check: ^sharded over 4 ranks, clipped by the global norm: every step's parameters = the unsharded run's, bit for bit$
   Check: ^clipped shard by shard instead: the parameters differ from the unsharded run's after step 0 \(as they must\)$

   A linear model y = x . w + b (10 parameters) trained by SGD, ZeRO style on 4 thread ranks: every rank holds the
   whole parameters for the forward, but after backward it keeps only its shard of the gradients (dpar_reduce_scatter),
   clips, updates its shard of the parameters and all-gathers them. Each step every rank accumulates k micro-batches of
   8 rows before the one reduce-scatter; the gradients are then clipped to an L2 norm of at most MAX_NORM. The norm is
   of the whole gradient, which no rank holds: each rank sums the squares of its shard and one allreduce adds the
   ranks' sums. Checked against the same training on one thread holding everything (the unsharded run), bit for bit:
   the comm is deterministic, so its sums follow a fixed tree that the unsharded run repeats with dpar_tree_reduce. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WIDTH 9            /* inputs per row */
#define PARAMS (WIDTH + 1) /* the weights and the bias: cut 3 3 2 2 over 4 ranks */
#define RANKS 4            /* a power of two: the deterministic mode's tree */
#define MICRO_ROWS 8       /* rows of a micro-batch */
#define MAX_MICRO 8        /* micro-batches per rank per step, at most */
#define STEPS 6
#define LEARNING_RATE 0.4f
#define MAX_NORM 1.0f

static int micro_batches = 4;                  /* k: accumulated per rank per step */
static float sharded_params[2][STEPS][PARAMS]; /* after each step: [0] clipped by the global norm, [1] per shard */
static float shard_squares[STEPS][RANKS];      /* each rank's sum of squares of its gradient shard */
static float global_norms[STEPS];

static float input(int step, int micro, int row, int j) /* micro: 0 .. RANKS k - 1, the global batch's */
{
    int n = ((step * RANKS * MAX_MICRO + micro) * MICRO_ROWS + row) * WIDTH + j;
    return sinf(0.61f * (float)n + 0.3f);
}

static float target(int step, int micro, int row)
{
    float t = 0.5f;
    int j;
    for (j = 0; j < WIDTH; j++) t += (float)(j % 3 + 1) * input(step, micro, row, j);
    return t;
}

/* the gradient of one micro-batch's loss, the mean over its rows of (y - t)^2 / 2: grad[0..WIDTH-1] the weights',
   grad[WIDTH] the bias' */
static void micro_batch_gradient(int step, int micro, const float *params, float *grad)
{
    int row, j;
    memset(grad, 0, sizeof(float) * PARAMS);
    for (row = 0; row < MICRO_ROWS; row++) {
        float y = params[WIDTH];
        float error;
        for (j = 0; j < WIDTH; j++) y += params[j] * input(step, micro, row, j);
        error = (y - target(step, micro, row)) / MICRO_ROWS;
        for (j = 0; j < WIDTH; j++) grad[j] += error * input(step, micro, row, j);
        grad[WIDTH] += error;
    }
}

/* the gradient of a rank's k micro-batches, added up in order (accumulation: one backward after another) */
static void accumulate(int step, int rank, const float *params, float *accumulated)
{
    float grad[PARAMS];
    int micro, j;
    memset(accumulated, 0, sizeof(float) * PARAMS);
    for (micro = 0; micro < micro_batches; micro++) {
        micro_batch_gradient(step, rank * micro_batches + micro, params, grad);
        for (j = 0; j < PARAMS; j++) accumulated[j] += grad[j];
    }
}

static float sum_of_squares(const float *x, size_t n)
{
    float sum = 0;
    size_t i;
    for (i = 0; i < n; i++) sum += x[i] * x[i];
    return sum;
}

static float clip_coefficient(float norm) /* what the gradient is multiplied by: at most 1 */
{
    return norm > MAX_NORM ? MAX_NORM / norm : 1.0f;
}

static dpar_status rank_main(void *user, int rank, int ranks)
{
    dpar_comm *comm;
    dpar_status st = dpar_group_join((dpar_group *)user, rank, &comm);
    int per_shard;
    size_t offset, length, j;
    dpar_block_range(PARAMS, ranks, rank, &offset, &length); /* this rank's shard: [offset, offset + length) */
    for (per_shard = 0; per_shard < 2 && st == DPAR_OK; per_shard++) {
        float params[PARAMS] = {0}; /* every rank's whole copy, all-gathered after each step */
        int step;
        for (step = 0; step < STEPS && st == DPAR_OK; step++) {
            float accumulated[PARAMS];
            float *shard = accumulated + offset; /* in place: my block of the sum lands here */
            float squares, total_squares, norm, coefficient;
            accumulate(step, rank, params, accumulated);
            st = dpar_reduce_scatter(comm, accumulated, shard, PARAMS, DPAR_F32, DPAR_SUM);
            if (st != DPAR_OK) break;
            for (j = 0; j < length; j++) shard[j] /= (float)(ranks * micro_batches); /* the mean over micro-batches */
            squares = sum_of_squares(shard, length);
            st = dpar_allreduce(comm, &squares, &total_squares, 1, DPAR_F32, DPAR_SUM);
            if (st != DPAR_OK) break;
            norm = sqrtf(total_squares);          /* the norm of the whole gradient */
            if (per_shard) norm = sqrtf(squares); /* WRONG, on purpose: the norm of this rank's shard alone */
            coefficient = clip_coefficient(norm);
            for (j = 0; j < length; j++) params[offset + j] -= LEARNING_RATE * coefficient * shard[j];
            st = dpar_allgather(comm, params + offset, params, PARAMS, DPAR_F32); /* in place: my block of params */
            if (rank == 0) memcpy(sharded_params[per_shard][step], params, sizeof params);
            if (!per_shard) shard_squares[step][rank] = squares;
            if (!per_shard && rank == 0) global_norms[step] = norm;
        }
    }
    dpar_comm_destroy(comm);
    return st;
}

/* the unsharded run: one thread, the whole gradient; its two sums in the deterministic comm's tree order */
static void unsharded_step(int step, float *params, float *norm_out)
{
    float accumulated[RANKS][PARAMS], gradient[PARAMS], block_squares[RANKS];
    const void *leaves[RANKS];
    float total_squares, coefficient;
    size_t offset, length;
    int rank, j;
    for (rank = 0; rank < RANKS; rank++) { /* the global batch, in the ranks' groups of k micro-batches */
        accumulate(step, rank, params, accumulated[rank]);
        leaves[rank] = accumulated[rank];
    }
    dpar_tree_reduce(gradient, leaves, RANKS, PARAMS, DPAR_F32, DPAR_SUM);
    for (j = 0; j < PARAMS; j++) gradient[j] /= (float)(RANKS * micro_batches);
    for (rank = 0; rank < RANKS; rank++) { /* the squares block by block, the blocks added in the same tree */
        dpar_block_range(PARAMS, RANKS, rank, &offset, &length);
        block_squares[rank] = sum_of_squares(gradient + offset, length);
        leaves[rank] = &block_squares[rank];
    }
    dpar_tree_reduce(&total_squares, leaves, RANKS, 1, DPAR_F32, DPAR_SUM);
    *norm_out = sqrtf(total_squares);
    coefficient = clip_coefficient(*norm_out);
    for (j = 0; j < PARAMS; j++) params[j] -= LEARNING_RATE * coefficient * gradient[j];
}

int main(int argc, char **argv)
{
    float params[PARAMS] = {0};
    dpar_comm_desc comm_desc = {0};
    dpar_pool_desc pool_desc = {0};
    dpar_pool *pool = NULL;
    dpar_group *group = NULL;
    dpar_status st;
    int step, rank, first_wrong_step = -1, ok = 1;
    if (argc > 1) micro_batches = atoi(argv[1]);
    if (micro_batches < 1 || micro_batches > MAX_MICRO) {
        fprintf(stderr, "usage: %s [micro-batches per rank per step, 1..%d]\n", argv[0], MAX_MICRO);
        return 2;
    }
    pool_desc.num_threads = RANKS;
    st = dpar_pool_create(&pool_desc, &pool);
    comm_desc.size = RANKS;
    comm_desc.pool = pool;
    comm_desc.deterministic = 1; /* sums in a fixed tree, whatever the timing: what makes bit for bit possible */
    if (st == DPAR_OK) st = dpar_group_create(&comm_desc, &group);
    if (st == DPAR_OK) st = dpar_pool_run(pool, rank_main, group);
    dpar_group_destroy(group);
    dpar_pool_destroy(pool);
    if (st != DPAR_OK) {
        fprintf(stderr, "failed: %s\n", dpar_last_error());
        return 1;
    }
    printf("%d ranks x %d micro-batches of %d rows per step (a global batch of %d rows); clip to norm %.1f\n", RANKS,
           micro_batches, MICRO_ROWS, RANKS * micro_batches * MICRO_ROWS, MAX_NORM);
    for (step = 0; step < STEPS; step++) {
        float norm;
        unsharded_step(step, params, &norm);
        printf("step %d: shards' squares", step);
        for (rank = 0; rank < RANKS; rank++) printf(" %.3g", shard_squares[step][rank]);
        printf("; global norm %.4f (unsharded %.4f): %s\n", global_norms[step], norm,
               norm > MAX_NORM ? "clipped" : "not clipped");
        ok &= global_norms[step] == norm;
        ok &= memcmp(sharded_params[0][step], params, sizeof params) == 0;
        if (first_wrong_step < 0 && memcmp(sharded_params[1][step], params, sizeof params) != 0)
            first_wrong_step = step;
    }
    printf("clipping shard by shard at step 0: each shard's own norm");
    for (rank = 0; rank < RANKS; rank++) printf(" %.4f", sqrtf(shard_squares[0][rank]));
    printf(", so coefficients");
    for (rank = 0; rank < RANKS; rank++) printf(" %.3f", clip_coefficient(sqrtf(shard_squares[0][rank])));
    printf(" instead of %.3f for all\n", clip_coefficient(global_norms[0]));
    printf("parameters:");
    for (rank = 0; rank < PARAMS; rank++) printf(" %.4f", params[rank]);
    printf("\n");
    if (!ok || first_wrong_step != 0) {
        fprintf(stderr, "FAILED: the sharded run differs from the unsharded one, or clipping per shard does not\n");
        return 1;
    }
    printf("sharded over %d ranks, clipped by the global norm: every step's parameters = the unsharded run's, bit for "
           "bit\n",
           RANKS);
    printf("clipped shard by shard instead: the parameters differ from the unsharded run's after step %d (as they "
           "must)\n",
           first_wrong_step);
    return 0;
}
