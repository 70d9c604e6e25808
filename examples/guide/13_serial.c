/* 13_serial.c - lesson 13 of the guide (docs/guide/13_porting.md): the single-threaded trainer we port.
   Build: mkdir -p build && cc -std=c99 -O2 examples/guide/13_serial.c -o build/lesson13_serial -lm
   Run:   build/lesson13_serial
   Check: ^loss [0-9.]+ \(first step\) -> [0-9.]+ \(last step\): falls$
   Check: ^weights = the ones that made the data: max difference [0-9.e+-]+ < 0.05$

   A trainer as many are written: rand() for the data and for each batch, a static scratch buffer in the
   gradient, globals everywhere. It fits y = w . x + b to noisy samples of a known line. Nothing here knows
   about dpar; 13_porting.c is this file made data-parallel, and the lesson walks through the changes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define D 8        /* inputs */
#define NDATA 4096 /* samples */
#define BATCH 64   /* samples per step */
#define STEPS 300
#define LR 0.1f
static float data_x[NDATA][D], data_y[NDATA], w[D + 1]; /* w[D] is the bias */

static float uniform(void) { return 2.0f * (float)rand() / (float)RAND_MAX - 1; }

/* Writes into grad (D + 1 floats) the gradient of the batch's mean squared error and returns
   the loss. The errors of forward are kept for backward in a static buffer, as one thread may. */
static float gradient(const int *batch, float *grad)
{
    static float err[BATCH];
    float loss = 0;
    int j, k;
    for (j = 0; j < BATCH; j++) { /* forward */
        const float *x = data_x[batch[j]];
        float out = w[D];
        for (k = 0; k < D; k++) out += w[k] * x[k];
        err[j] = out - data_y[batch[j]];
        loss += 0.5f * err[j] * err[j] / BATCH;
    }
    memset(grad, 0, (D + 1) * sizeof(float));
    for (j = 0; j < BATCH; j++) { /* backward */
        for (k = 0; k < D; k++) grad[k] += err[j] * data_x[batch[j]][k] / BATCH;
        grad[D] += err[j] / BATCH;
    }
    return loss;
}

int main(void)
{
    float truth[D + 1], grad[D + 1], loss = 0, first = 0, diff = 0;
    int batch[BATCH], i, j, k, step;
    srand(1);
    for (k = 0; k <= D; k++) truth[k] = uniform(); /* the line that makes the data */
    for (i = 0; i < NDATA; i++) {
        data_y[i] = truth[D] + 0.01f * uniform(); /* plus a little noise */
        for (k = 0; k < D; k++) {
            data_x[i][k] = uniform();
            data_y[i] += truth[k] * data_x[i][k];
        }
    }
    for (step = 0; step < STEPS; step++) {
        for (j = 0; j < BATCH; j++) batch[j] = rand() % NDATA; /* this step's samples */
        loss = gradient(batch, grad);
        if (step == 0) first = loss;
        for (k = 0; k <= D; k++) w[k] -= LR * grad[k];
    }
    for (k = 0; k <= D; k++)
        if (!(fabsf(w[k] - truth[k]) <= diff)) diff = fabsf(w[k] - truth[k]);
    printf("loss %.5f (first step) -> %.5f (last step): %s\n", first, loss, loss < 0.01f * first ? "falls" : "FAILED");
    printf("weights = the ones that made the data: max difference %.4f %s 0.05\n", diff, diff < 0.05f ? "<" : ">=");
    return loss < 0.01f * first && diff < 0.05f ? 0 : 1;
}
