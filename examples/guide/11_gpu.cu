/* 11_gpu.cu - lesson 11 of the guide (docs/guide/11_gpu.md): a data-parallel step on GPU workers (dpar_cuda.h).
   Build: mkdir -p build && nvcc -std=c++14 -O2 -arch=sm_90 -I. examples/guide/11_gpu.cu -o build/lesson11 -lcublas
   Run:   build/lesson11   (build/lesson11 4: four workers per GPU; build/lesson11 2 ordered: stream-ordered calls)
   Check: ^(every worker's weights = the host reference, bit for bit|11_gpu: skipped: no usable CUDA device.*)$

   Each worker of a dpar_cuda pool is a host thread that owns a GPU (or a share of one), a stream and device memory.
   A step: the worker's gradient lands in device memory (made on the host here, as if its backward had written
   it), one dpar_allreduce averages it over the workers on device buffers, and dpar_cuda_sgd_f32 updates the
   worker's copy of the weights. Checked on the host: the average against a serial mean, the update bit for bit
   against the kernel's host reference. Without a usable GPU it says `skipped` and why, and exits 0. */
#define DPAR_IMPLEMENTATION
#define DPAR_CUDA_IMPLEMENTATION
#include "dpar_cuda.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define P 16384 /* parameters */
#define STEPS 3
#define MAXW 16 /* workers at most */
#define LR 0.1f
#define MOMENTUM 0.9f
static float init[P], grads[STEPS][MAXW][P]; /* the initial weights; each step's gradient of each worker */
static float averaged[STEPS][MAXW][P];       /* what each worker's allreduce gave, copied back for the check */
static float final_w[MAXW][P];               /* each worker's weights after the last step */

/* One worker, on its own host thread with its device current. Device pointers are used like host ones. */
static dpar_status worker_main(void *user, const dpar_cuda_worker *wk)
{
    cudaStream_t stream = (cudaStream_t)wk->stream;
    size_t bytes = P * sizeof(float);
    float *w = NULL, *g, *mom;
    dpar_status st = DPAR_OK;
    int step;
    if (cudaMalloc((void **)&w, 3 * bytes) != cudaSuccess) return dpar_set_error(DPAR_ENOMEM, "cudaMalloc failed");
    g = w + P;
    mom = g + P;
    cudaMemcpyAsync(w, init, bytes, cudaMemcpyHostToDevice, stream); /* the same weights on every worker */
    cudaMemsetAsync(mom, 0, bytes, stream);
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        cudaMemcpyAsync(g, grads[step][wk->rank], bytes, cudaMemcpyHostToDevice, stream); /* "backward" */
        /* the call waits for the worker's stream (the work that wrote g) and returns with g averaged; in a
           stream-ordered pool it queues the averaging on the stream, between the copy and the update, and returns */
        st = dpar_allreduce(wk->comm, g, g, P, DPAR_F32, DPAR_AVG);
        if (st == DPAR_OK) st = dpar_cuda_sgd_f32(w, mom, g, P, LR, MOMENTUM, 0, stream);
        cudaMemcpyAsync(averaged[step][wk->rank], g, bytes, cudaMemcpyDeviceToHost, stream);
    }
    cudaMemcpyAsync(final_w[wk->rank], w, bytes, cudaMemcpyDeviceToHost, stream);
    cudaError_t e = cudaStreamSynchronize(stream); /* the copies back are done; a CUDA error shows here */
    if (e != cudaSuccess && st == DPAR_OK)
        st = dpar_set_error(DPAR_ESYSTEM, "worker %d: %s", wk->rank, cudaGetErrorName(e));
    cudaFree(w);
    (void)user;
    return st;
}

int main(int argc, char **argv)
{
    static float ref[P], mom[P];
    dpar_cuda_pool_desc pd;
    dpar_cuda_pool *pool = NULL;
    dpar_cuda_device_info info;
    int gpus = 0, n, r, s, i, ok = 1;
    double diff = 0;
    memset(&pd, 0, sizeof pd);
    pd.workers_per_device = argc > 1 ? atoi(argv[1]) : 2; /* 2: two ranks even on a machine with one GPU */
    pd.stream_ordered = argc > 2 && strcmp(argv[2], "ordered") == 0;
    if (dpar_cuda_device_count(&gpus) != DPAR_OK || gpus == 0) {
        printf("11_gpu: skipped: no usable CUDA device (%s)\n", dpar_last_error());
        return 0;
    }
    if (pd.workers_per_device < 1 || gpus * pd.workers_per_device > MAXW) {
        fprintf(stderr, "11_gpu: %d workers per GPU on %d GPUs: give 1 or more, at most %d workers in all\n",
                pd.workers_per_device, gpus, MAXW);
        return 2;
    }
    for (i = 0; i < P; i++) init[i] = sinf(0.01f * i); /* weights, and gradients that differ per worker and step */
    for (s = 0; s < STEPS; s++)
        for (r = 0; r < MAXW; r++)
            for (i = 0; i < P; i++) grads[s][r][i] = cosf(0.001f * i * (r + 1) + s);
    if (dpar_cuda_pool_create(&pd, &pool) != DPAR_OK || dpar_cuda_device_query(0, &info) != DPAR_OK ||
        dpar_cuda_pool_run(pool, worker_main, NULL) != DPAR_OK) {
        fprintf(stderr, "11_gpu: %s\n", dpar_last_error());
        return 1;
    }
    n = dpar_cuda_pool_size(pool);
    printf("workers: %d on %d GPU%s (device 0: %s, sm_%d%d)\n", n, gpus, gpus > 1 ? "s" : "", info.name, info.major,
           info.minor);
    if (pd.stream_ordered) printf("calls: stream-ordered (queued on each worker's stream, no host wait)\n");
    memcpy(ref, init, sizeof ref);
    for (s = 0; s < STEPS; s++) {
        for (i = 0; i < P; i++) { /* the serial mean of the workers' gradients, in double */
            double mean = 0;
            for (r = 0; r < n; r++) mean += grads[s][r][i];
            diff = fmax(diff, fabs(averaged[s][0][i] - mean / n)); /* a NaN fails the bitwise check below */
        }
        for (r = 1; r < n; r++) ok &= memcmp(averaged[s][r], averaged[s][0], sizeof ref) == 0;
        dpar_cuda_sgd_f32_ref(ref, mom, averaged[s][0], P, LR, MOMENTUM, 0); /* the kernel's host reference */
    }
    ok &= diff < 1e-5;
    if (ok)
        printf("allreduce on device memory: every worker got the same average, within %.1e < 1e-5 of the serial mean\n",
               diff);
    for (r = 0; r < n; r++) ok &= memcmp(final_w[r], ref, sizeof ref) == 0;
    if (ok) printf("every worker's weights = the host reference, bit for bit (%d steps of dpar_cuda_sgd_f32)\n", STEPS);
    else fprintf(stderr, "FAILED: a worker differs from the host reference\n");
    dpar_cuda_pool_destroy(pool);
    return ok ? 0 : 1;
}
