/* 17_mixed_precision.c - lesson 17 of the guide (docs/guide/17_mixed_precision.md): mixed precision, loss scaling.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/17_mixed_precision.c -o build/lesson17 -pthread -lm
   Run:   build/lesson17   (build/lesson17 4: grow the loss scale after 4 good steps instead of 6)
   Check: ^step +[0-9]+ +scale +[0-9]+ +SKIPPED: rank 1's f16 gradients hold inf, rank 0's do not; both ranks skip
   Check: ^f16 compute, fp32 master weights: within 0\.0005 of the fp32 run's weights: OK$

   A linear model y = x . w (16 weights) trained by SGD on 2 thread ranks, 16 rows each, for 24 steps. Each rank
   computes in f16: its weights and inputs rounded to f16, the loss multiplied by the loss scale S before backward, the
   gradients stored as f16. Before the step the ranks allreduce a flag, the max of "my gradients hold an inf or NaN":
   when any rank's do, every rank skips the step and halves S; after GROWTH_INTERVAL good steps in a row S doubles.
   Otherwise the gradients are allreduced, divided by S and applied to the fp32 master weights. Checked against the
   same training in fp32 on one thread (one update per step the f16 run did not skip), within a stated tolerance. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WIDTH 16 /* weights */
#define RANKS 2
#define ROWS 16 /* rows per rank; the global batch is RANKS x ROWS */
#define BATCH (RANKS * ROWS)
#define STEPS 30
#define LEARNING_RATE 0.05f
#define FIRST_SCALE 65536.0f /* 2^16, as PyTorch's GradScaler starts */
#define NOISE 0.5f           /* the targets' part that the model cannot fit: the gradients never vanish */
#define OUTLIER_STEP 17      /* the step whose batch holds an outlier */
#define TOLERANCE 0.0005f    /* the largest |w_f16run - w_fp32| allowed at the end */

static float inputs[STEPS][BATCH * WIDTH], targets[STEPS][BATCH]; /* a new batch each step */
static float master[RANKS][WIDTH]; /* each rank's fp32 master weights (they stay identical) */
static int growth_interval = 6;
static int skipped[STEPS]; /* 1: the f16 run skipped that step */
typedef struct step_record {
    float scale;           /* the loss scale the step used */
    float loss;            /* the f16 forward's loss (before the step) */
    int overflowed[RANKS]; /* which ranks' f16 gradients held an inf or NaN */
} step_record;
static step_record record[STEPS];

static float to_f16(float x) /* x rounded to the nearest f16 (inf above 65504) */
{
    return dpar_f16_to_f32(dpar_f32_to_f16(x));
}

/* one rank's f16 forward and backward on its rows: returns the sum of its rows' squared errors / (2 BATCH), and
   fills grad16 with the gradient times scale, each value rounded to f16 as a 16-bit backward would store it */
static float forward_backward_f16(int step, int rank, const float *weights, float scale, float *grad16)
{
    float weights16[WIDTH], grad[WIDTH] = {0};
    float loss = 0;
    int i, j;
    for (j = 0; j < WIDTH; j++) weights16[j] = to_f16(weights[j]);
    for (i = rank * ROWS; i < (rank + 1) * ROWS; i++) {
        const float *x = inputs[step] + i * WIDTH;
        float y = 0;
        float error, scaled_error;
        for (j = 0; j < WIDTH; j++) y += to_f16(x[j]) * weights16[j]; /* f16 inputs, f32 accumulation */
        y = to_f16(y);
        error = y - targets[step][i];
        loss += 0.5f * error * error / BATCH;
        scaled_error = to_f16(scale * error / BATCH); /* d(scale x loss)/dy, stored in f16 */
        for (j = 0; j < WIDTH; j++) grad[j] += scaled_error * to_f16(x[j]);
    }
    for (j = 0; j < WIDTH; j++) grad16[j] = to_f16(grad[j]);
    return loss;
}

static dpar_status rank_main(void *user, int rank, int ranks)
{
    dpar_comm *comm;
    dpar_status st = dpar_group_join((dpar_group *)user, rank, &comm);
    float scale = FIRST_SCALE;
    int good_steps = 0;
    int step, j;
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        float grad[WIDTH], loss;
        int overflow = 0;
        int any_overflow = 0;
        loss = forward_backward_f16(step, rank, master[rank], scale, grad);
        for (j = 0; j < WIDTH; j++) overflow |= !isfinite(grad[j]);
        /* the skip is decided together: a rank that stepped while another skipped would leave the replicas apart */
        st = dpar_allreduce(comm, &overflow, &any_overflow, 1, DPAR_I32, DPAR_MAX);
        if (st == DPAR_OK) st = dpar_allreduce(comm, &loss, &loss, 1, DPAR_F32, DPAR_SUM);
        if (st != DPAR_OK) break;
        if (rank == 0) {
            record[step].scale = scale;
            record[step].loss = loss;
            skipped[step] = any_overflow;
        }
        record[step].overflowed[rank] = overflow;
        if (any_overflow) {
            scale /= 2; /* too large: halve it and try the next batch */
            good_steps = 0;
            continue;
        }
        st = dpar_allreduce(comm, grad, grad, WIDTH, DPAR_F32, DPAR_SUM); /* the f16 values, added in f32 */
        for (j = 0; j < WIDTH; j++) master[rank][j] -= LEARNING_RATE * (grad[j] / scale); /* unscaled, into fp32 */
        good_steps++;
        if (good_steps == growth_interval) { /* no overflow for a while: try a larger scale */
            scale *= 2;
            good_steps = 0;
        }
    }
    dpar_comm_destroy(comm);
    (void)ranks;
    return st;
}

/* the reference: fp32 throughout, one thread, the whole batch; one update per step the f16 run did not skip */
static float reference_loss_and_step(int step, float *weights, int apply)
{
    float grad[WIDTH] = {0};
    float loss = 0;
    int i, j;
    for (i = 0; i < BATCH; i++) {
        float y = 0;
        float error;
        for (j = 0; j < WIDTH; j++) y += inputs[step][i * WIDTH + j] * weights[j];
        error = y - targets[step][i];
        loss += 0.5f * error * error / BATCH;
        for (j = 0; j < WIDTH; j++) grad[j] += error / BATCH * inputs[step][i * WIDTH + j];
    }
    if (apply)
        for (j = 0; j < WIDTH; j++) weights[j] -= LEARNING_RATE * grad[j];
    return loss;
}

int main(int argc, char **argv)
{
    float reference[WIDTH] = {0};
    float largest_difference = 0;
    dpar_comm_desc comm_desc = {0};
    dpar_pool_desc pool_desc = {0};
    dpar_pool *pool = NULL;
    dpar_group *group = NULL;
    dpar_status st;
    int i, j, step, ok = 1;
    if (argc > 1) growth_interval = atoi(argv[1]);
    if (growth_interval < 1) {
        fprintf(stderr, "usage: %s [steps before the scale grows, >= 1]\n", argv[0]);
        return 2;
    }
    for (step = 0; step < STEPS; step++)
        for (i = 0; i < BATCH; i++) {
            float row_size =
                i >= ROWS ? 4.0f : 1.0f; /* rank 1's rows are 4 times larger: its gradients overflow first */
            float *x = inputs[step] + i * WIDTH;
            float target = NOISE * sinf(2.3f * (float)(step * BATCH + i)); /* what no weights can fit */
            for (j = 0; j < WIDTH; j++) x[j] = row_size * sinf(0.37f * (float)((step * BATCH + i) * WIDTH + j) + 0.5f);
            for (j = 0; j < WIDTH; j++) target += x[j] * 0.25f * cosf(0.9f * (float)j);
            if (step == OUTLIER_STEP && i == ROWS) target += 30.0f; /* one row of rank 1's batch: a wrong label */
            targets[step][i] = target;
        }
    pool_desc.num_threads = RANKS;
    st = dpar_pool_create(&pool_desc, &pool);
    comm_desc.size = RANKS;
    comm_desc.pool = pool;
    if (st == DPAR_OK) st = dpar_group_create(&comm_desc, &group);
    if (st == DPAR_OK) st = dpar_pool_run(pool, rank_main, group);
    dpar_group_destroy(group);
    dpar_pool_destroy(pool);
    if (st != DPAR_OK) {
        fprintf(stderr, "failed: %s\n", dpar_last_error());
        return 1;
    }
    printf("f16 compute on %d ranks, fp32 master weights; loss scale from %.0f, halved on overflow, doubled after %d "
           "good steps\n",
           RANKS, FIRST_SCALE, growth_interval);
    for (step = 0; step < STEPS; step++) {
        float reference_loss = reference_loss_and_step(step, reference, !skipped[step]);
        if (skipped[step]) {
            const int *overflowed = record[step].overflowed;
            printf("step %2d  scale %5.0f  SKIPPED: ", step, record[step].scale);
            if (overflowed[0] && overflowed[1]) printf("both ranks' f16 gradients hold inf; both skip\n");
            else
                printf("rank %d's f16 gradients hold inf, rank %d's do not; both ranks skip\n", overflowed[1] ? 1 : 0,
                       overflowed[1] ? 0 : 1);
            continue;
        }
        printf("step %2d  scale %5.0f  loss %.5f  (fp32 %.5f)\n", step, record[step].scale, record[step].loss,
               reference_loss);
    }
    for (j = 0; j < WIDTH; j++) {
        float difference = fabsf(master[0][j] - reference[j]);
        if (difference > largest_difference) largest_difference = difference;
        ok &= master[0][j] == master[1][j]; /* the replicas: the same updates, so the same bits */
    }
    ok &= largest_difference <= TOLERANCE;
    /* why the scale: a small gradient value in f16 and in bf16 */
    printf("why the scale: 2e-08 in f16 is %g; times %.0f it is %g, %.4g once divided back; in bf16 it is %.4g\n",
           to_f16(2e-8f), FIRST_SCALE, to_f16(2e-8f * FIRST_SCALE), to_f16(2e-8f * FIRST_SCALE) / FIRST_SCALE,
           dpar_bf16_to_f32(dpar_f32_to_bf16(2e-8f)));
    printf("the 2 replicas' master weights: %s\n", master[0][0] == master[1][0] && ok ? "bit for bit the same" : "?");
    if (!ok) {
        fprintf(stderr, "FAILED: the weights differ from the fp32 run's by %g (tolerance %g) or the replicas differ\n",
                largest_difference, TOLERANCE);
        return 1;
    }
    printf("the largest difference from the fp32 run's weights: measured %.6f\n", largest_difference);
    printf("f16 compute, fp32 master weights: within %g of the fp32 run's weights: OK\n", TOLERANCE);
    return 0;
}
