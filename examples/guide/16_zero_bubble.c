/* 16_zero_bubble.c - lesson 16 of the guide (docs/guide/16_zero_bubble.md): zero-bubble pipelines, recomputation.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/16_zero_bubble.c -o build/lesson16 -pthread -lm
   Run:   build/lesson16   (build/lesson16 2 16: 2 stages, 16 micro-batches; m divides 32)
   Check: ^ZB-H1: bubble \(p-1\)/\(3m\+p-1\) = [0-9.]+ = the schedule's [0-9.]+$
   Check: ^ZB-H1, recompute: +saved 0 0 0 0, recomputed 1 2 3 4 = predicted \(bubble measured [0-9.]+\)$
   Check: ^ZB-H1 and recomputation: every stage's gradients = 1F1B's keeping everything, bit for bit$

   The model of lesson 6: p layers a_out = tanh(a_in W_s), one per stage (thread rank), the batch of 32 rows cut into m
   micro-batches. Four runs of one step: 1F1B and ZB-H1 (the backward split into B, the input's gradient, and W, the
   weights'), each keeping its activations from forward to backward or recomputing them just before the backward. Each
   F, B and W sleeps 2 ms as if it computed (a whole backward, B then W, 4 ms), so the measured idle time is the
   schedule's. Checked: the bubbles against their formulas, the activations held against the runner's prediction, and
   the gradients of all four against each other and against the serial model, bit for bit. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WIDTH 16 /* every layer is WIDTH x WIDTH */
#define BATCH 32 /* rows of the batch */
#define MAX_STAGES 8
#define RUNS 4 /* 0: 1F1B keeping, 1: ZB-H1 keeping, 2: 1F1B recomputing, 3: ZB-H1 recomputing */

typedef struct stage {
    int index;                        /* the stage: its layer is weights[index] */
    dpar_pipe *pipe;                  /* its runner, which holds the saved and recomputed buffers */
    float weight_grad[WIDTH * WIDTH]; /* added up over the micro-batches */
} stage;

static float data[BATCH * WIDTH], target[BATCH * WIDTH], weights[MAX_STAGES][WIDTH * WIDTH];
static int stages, micro_batches, rows; /* rows: of one micro-batch */
static stage pipe_stages[MAX_STAGES];
static float run_grads[RUNS][MAX_STAGES][WIDTH * WIDTH];
static dpar_pipe_stats run_stats[RUNS][MAX_STAGES];
static dpar_pipe_schedule *schedules[2]; /* 1F1B, ZB-H1 */
static const char *const run_names[RUNS] = {"1F1B, keep:", "ZB-H1, keep:", "1F1B, recompute:", "ZB-H1, recompute:"};
static const struct timespec one_unit = {0, 2000000}; /* an F, a B or a W: 2 ms */

static const float *stage_input(int micro, const void *in) /* the previous stage's output, or the data */
{
    return in ? (const float *)in : data + micro * rows * WIDTH;
}

static void layer_forward(int s, const float *x, float *a) /* a = tanh(x W_s), rows x WIDTH */
{
    int i, j, k;
    for (i = 0; i < rows; i++)
        for (j = 0; j < WIDTH; j++) {
            float sum = 0;
            for (k = 0; k < WIDTH; k++) sum += x[i * WIDTH + k] * weights[s][k * WIDTH + j];
            a[i * WIDTH + j] = tanhf(sum);
        }
}

/* dz: the gradient before tanh, from the output's (grad_out; NULL on the last stage: the loss 0.5 |a - t|^2 / BATCH) */
static void output_grad(int micro, const float *a, const float *grad_out, float *dz)
{
    int i;
    for (i = 0; i < rows * WIDTH; i++) {
        float g = grad_out ? grad_out[i] : (a[i] - target[micro * rows * WIDTH + i]) / BATCH;
        dz[i] = g * (1 - a[i] * a[i]);
    }
}

static void input_grad(int s, const float *dz, float *dx) /* dx = dz W_s^T */
{
    int i, j, k;
    for (i = 0; i < rows; i++)
        for (k = 0; k < WIDTH; k++) {
            float sum = 0;
            for (j = 0; j < WIDTH; j++) sum += dz[i * WIDTH + j] * weights[s][k * WIDTH + j];
            dx[i * WIDTH + k] = sum;
        }
}

static void weight_grad(const float *x, const float *dz, float *dw) /* dW += x^T dz */
{
    int i, j, k;
    for (k = 0; k < WIDTH; k++)
        for (j = 0; j < WIDTH; j++)
            for (i = 0; i < rows; i++) dw[k * WIDTH + j] += x[i * WIDTH + k] * dz[i * WIDTH + j];
}

/* the activation the backward needs: kept since the forward (saved), or made again just before the backward */
static float *activation(stage *st)
{
    void *recomputed;
    float *saved = (float *)dpar_pipe_saved(st->pipe, &recomputed);
    return saved ? saved : (float *)recomputed;
}

static dpar_status forward(void *user, int micro, int chunk, const void *in, void *out)
{
    stage *st = (stage *)user;
    float scratch[BATCH * WIDTH];
    float *a = activation(st);
    if (a == NULL) a = scratch; /* recomputation's first pass: keep nothing */
    layer_forward(st->index, stage_input(micro, in), a);
    /* to the next stage; out is NULL on the last stage, and in the forward the runner runs again */
    if (out) memcpy(out, a, sizeof(float) * rows * WIDTH);
    nanosleep(&one_unit, NULL);
    (void)chunk;
    return DPAR_OK;
}

/* B: the gradient of the input, which the previous stage waits for; no weight gradient */
static dpar_status backward_input(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    stage *st = (stage *)user;
    float dz[BATCH * WIDTH];
    output_grad(micro, activation(st), (const float *)grad_out, dz);
    if (grad_in) input_grad(st->index, dz, (float *)grad_in); /* NULL on the first stage */
    nanosleep(&one_unit, NULL);
    (void)chunk;
    (void)in;
    return DPAR_OK;
}

/* W: the weights' gradient, which nothing needs before the optimizer step; dz is made again from what B had */
static dpar_status backward_weight(void *user, int micro, int chunk, const void *in, const void *grad_out)
{
    stage *st = (stage *)user;
    float dz[BATCH * WIDTH];
    output_grad(micro, activation(st), (const float *)grad_out, dz);
    weight_grad(stage_input(micro, in), dz, st->weight_grad);
    nanosleep(&one_unit, NULL);
    (void)chunk;
    return DPAR_OK;
}

/* 1F1B's whole backward: B, then W */
static dpar_status backward(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    dpar_status st = backward_input(user, micro, chunk, in, grad_out, grad_in);
    if (st != DPAR_OK) return st;
    return backward_weight(user, micro, chunk, in, grad_out);
}

static dpar_status rank_main(void *user, int s, int p)
{
    dpar_comm *comm;
    dpar_status st = dpar_group_join((dpar_group *)user, s, &comm);
    int run;
    for (run = 0; run < RUNS && st == DPAR_OK; run++) {
        int recompute = run >= 2;
        dpar_pipe_desc desc = {0};
        desc.schedule = schedules[run % 2];
        desc.comm = comm;
        desc.act_bytes = sizeof(float) * rows * WIDTH;
        desc.forward = forward;
        desc.backward = backward;
        desc.backward_input = backward_input;
        desc.backward_weight = backward_weight;
        desc.saved_bytes = recompute ? 0 : desc.act_bytes;     /* keep: the layer's output, until its backward */
        desc.recompute_bytes = recompute ? desc.act_bytes : 0; /* recompute: only from the second forward on */
        desc.user = &pipe_stages[s];
        memset(&pipe_stages[s], 0, sizeof pipe_stages[s]);
        pipe_stages[s].index = s;
        st = dpar_pipe_create(&desc, &pipe_stages[s].pipe);
        if (st == DPAR_OK) st = dpar_pipe_run(pipe_stages[s].pipe, &run_stats[run][s]);
        memcpy(run_grads[run][s], pipe_stages[s].weight_grad, sizeof run_grads[run][s]);
        dpar_pipe_destroy(pipe_stages[s].pipe);
    }
    dpar_comm_destroy(comm);
    (void)p;
    return st;
}

int main(int argc, char **argv)
{
    static float serial_acts[MAX_STAGES][BATCH * WIDTH], serial_grads[MAX_STAGES][WIDTH * WIDTH];
    float grad_out[BATCH * WIDTH], grad_in[BATCH * WIDTH], dz[BATCH * WIDTH];
    char timeline[8192];
    dpar_comm_desc comm_desc = {0};
    dpar_pool_desc pool_desc = {0};
    dpar_pool *pool = NULL;
    dpar_group *group = NULL;
    dpar_status st;
    int i, s, run, micro, ok = 1;
    stages = argc > 1 ? atoi(argv[1]) : 4;
    micro_batches = argc > 2 ? atoi(argv[2]) : 8;
    if (stages < 1 || stages > MAX_STAGES || micro_batches < 1 || micro_batches > BATCH || BATCH % micro_batches) {
        fprintf(stderr, "usage: %s [stages 1..%d] [micro-batches dividing %d]\n", argv[0], MAX_STAGES, BATCH);
        return 2;
    }
    rows = BATCH / micro_batches;
    for (i = 0; i < BATCH * WIDTH; i++) data[i] = sinf(0.37f * i);
    for (i = 0; i < BATCH * WIDTH; i++) target[i] = 0.5f * cosf(0.11f * i);
    for (s = 0; s < MAX_STAGES; s++)
        for (i = 0; i < WIDTH * WIDTH; i++) weights[s][i] = 0.4f * sinf(1.7f * (s * WIDTH * WIDTH + i));
    for (i = 0; i < 2; i++) {
        dpar_pipe_schedule_desc schedule_desc = {0};
        schedule_desc.kind = i == 0 ? DPAR_PIPE_1F1B : DPAR_PIPE_ZB_H1;
        schedule_desc.p = stages;
        schedule_desc.m = micro_batches;
        if (dpar_pipe_schedule_create(&schedule_desc, &schedules[i]) != DPAR_OK) {
            fprintf(stderr, "%s\n", dpar_last_error());
            return 1;
        }
        dpar_pipe_schedule_format(schedules[i], timeline, sizeof timeline); /* F, B, W: one unit each; . idle */
        printf("%s", timeline);
    }
    comm_desc.size = stages;
    pool_desc.num_threads = stages;
    st = dpar_group_create(&comm_desc, &group);
    if (st == DPAR_OK) st = dpar_pool_create(&pool_desc, &pool);
    if (st == DPAR_OK) st = dpar_pool_run(pool, rank_main, group);
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    if (st != DPAR_OK) {
        fprintf(stderr, "failed: %s\n", dpar_last_error());
        return 1;
    }
    /* the serial model: the layers one after the other on this thread, micro-batch after micro-batch */
    for (micro = 0; micro < micro_batches; micro++) {
        for (s = 0; s < stages; s++)
            layer_forward(s, s > 0 ? serial_acts[s - 1] : data + micro * rows * WIDTH, serial_acts[s]);
        for (s = stages - 1; s >= 0; s--) {
            output_grad(micro, serial_acts[s], s < stages - 1 ? grad_out : NULL, dz);
            weight_grad(s > 0 ? serial_acts[s - 1] : data + micro * rows * WIDTH, dz, serial_grads[s]);
            input_grad(s, dz, grad_in);
            memcpy(grad_out, grad_in, sizeof grad_out);
        }
    }
    for (i = 0; i < 2; i++) { /* ZB-H1's formula needs m >= p: with fewer micro-batches B and W cannot fill the pipe */
        double formula = (double)(stages - 1) / ((i == 0 ? 1 : 3) * micro_batches + stages - 1);
        int formula_holds = i == 0 || micro_batches >= stages;
        int matches = fabs(schedules[i]->bubble - formula) < 1e-9;
        const char *relation = "=";
        if (!formula_holds) relation = "(m < p) below";
        else if (!matches) relation = "DIFFERS from";
        if (formula_holds) ok &= matches;
        printf("%s: bubble (p-1)/(%sm+p-1) = %.3f %s the schedule's %.3f\n", i == 0 ? "1F1B" : "ZB-H1",
               i == 0 ? "" : "3", formula, relation, schedules[i]->bubble);
    }
    for (run = 0; run < RUNS; run++) {
        int recompute = run >= 2;
        int as_predicted = 1;
        printf("%-18s saved", run_names[run]);
        for (s = 0; s < stages; s++) {
            const dpar_pipe_stats *stats = &run_stats[run][s];
            int zb_stage_recomputed = s + 1 < micro_batches ? s + 1 : micro_batches; /* W comes s B's after its B */
            int want_saved = recompute ? 0 : schedules[run % 2]->peak_stash[s];      /* forward to the end of W */
            int want_recomputed = !recompute ? 0 : run % 2 == 0 ? 1 : zb_stage_recomputed;
            printf(" %d", stats->peak_saved);
            as_predicted &= stats->peak_saved == want_saved && stats->predicted_saved == want_saved;
            as_predicted &= stats->peak_recomputed == want_recomputed && stats->predicted_recomputed == want_recomputed;
            ok &= memcmp(run_grads[run][s], run_grads[0][s], sizeof run_grads[0][s]) == 0;
            ok &= memcmp(run_grads[0][s], serial_grads[s], sizeof serial_grads[s]) == 0;
        }
        printf(", recomputed");
        for (s = 0; s < stages; s++) printf(" %d", run_stats[run][s].peak_recomputed);
        printf(" %s (bubble measured %.3f)\n", as_predicted ? "= predicted" : "NOT as predicted",
               run_stats[run][0].measured_bubble);
        ok &= as_predicted;
    }
    for (i = 0; i < 2; i++) dpar_pipe_schedule_destroy(schedules[i]);
    if (!ok) {
        fprintf(stderr, "FAILED: a bubble, an activation count or a gradient differs from what it must be\n");
        return 1;
    }
    printf("1F1B, keep: every stage's gradients = the serial model's, bit for bit\n");
    printf("ZB-H1 and recomputation: every stage's gradients = 1F1B's keeping everything, bit for bit\n");
    return 0;
}
