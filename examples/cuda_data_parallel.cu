/* cuda_data_parallel.cu - the MLP of examples/data_parallel.c trained data-parallel on GPU workers: cuBLAS GEMMs,
   dpar_cuda's layer kernels, one gradient allreduce per step over the pool's comm (dpar.h's ring on device buffers,
   or NCCL when built with -DDPAR_NCCL -lnccl), then checked against the same training on the CPU.
   Build: nvcc -std=c++14 -O2 -arch=sm_90 -I. examples/cuda_data_parallel.cu -o cuda_data_parallel -lcublas
   Run:   ./cuda_data_parallel           (--workers-per-device 2: several ranks on one GPU; --nccl with -DDPAR_NCCL)
   Check: ^(train samples_per_s=[0-9.]+ final_loss=[0-9.]+|cuda_data_parallel: skipped: no usable CUDA device.*)$

   The data (8192 synthetic samples labelled by a random linear teacher), the initial weights and each worker's
   share of every epoch (dpar_sampler, seed 7) are those of examples/data_parallel.c, so with as many workers as it
   has threads both train the same model on the same batches. Each step: every worker runs forward and backward on
   its batch/N samples, the gradients are averaged (dpar_allreduce, DPAR_AVG) and every worker takes the same SGD
   step (dpar_cuda_sgd_f32) on its copy of the weights.

   The check: a CPU reference trains the same way (dpar_sgemm and the kernels' host references) and the mean losses
   are compared at every step, within 2e-3 relative. Why that bound: the float operations are the same except their
   order in the GEMMs (cuBLAS's blocking against dpar_sgemm's) and CUDA's expf/logf (within 2 ulp of glibc's); each
   gives relative differences near 1e-6 in one step, which SGD at this learning rate carries but does not amplify
   over 30 steps by more than a few hundred times. A wrong gradient, a missing allreduce or a worker that trains on
   the wrong samples moves the loss by far more (by 1e-2 or more within a few steps). The reference itself is
   checked against examples/data_parallel.c by make test: `--cpu N` runs only it, for N workers, and prints the
   losses as that example does. Options: --layers 784,1024,1024,10 --batch 256 --steps 30 --lr 0.05
   --workers-per-device 1 --nccl --cpu N */
#define DPAR_IMPLEMENTATION
#define DPAR_CUDA_IMPLEMENTATION
#include "dpar_cuda.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXL 8
#define MAXW 64

typedef struct {
    int nl, width[MAXL + 1], batch, steps, workers;
    float lr;
    size_t n, woff[MAXL], boff[MAXL], np;
    float *x, *init;        /* the samples (n x width[0]), the initial weights */
    int *y;                 /* labels */
    float loss[MAXW][1024]; /* worker r's mean loss of each step (the mean over workers is computed on device) */
    double seconds;         /* worker 0's time for steps 1.. */
} job;

static uint64_t rng_next(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 11;
}
static float uniform(uint64_t *s) { return (float)((double)rng_next(s) / 9007199254740992.0); }

#define TRY(call)                       \
    do {                                \
        dpar_status st_ = (call);       \
        if (st_ != DPAR_OK) return st_; \
    } while (0)
#define CU(call)                                                                                           \
    do {                                                                                                   \
        cudaError_t e_ = (call);                                                                           \
        if (e_ != cudaSuccess) return dpar_set_error(DPAR_ESYSTEM, "%s: %s", #call, cudaGetErrorName(e_)); \
    } while (0)

/* one worker: its weights, gradients, activations and batch in device memory, allocated once */
static dpar_status worker_main(void *user, const dpar_cuda_worker *w)
{
    job *j = (job *)user;
    int L = j->nl, b = j->batch / w->size, l, i, step, C = j->width[j->nl];
    cudaStream_t s = (cudaStream_t)w->stream;
    float *p, *g, *mom, *act[MAXL + 1], *delta[MAXL + 1], *lossv, *hx, *hloss, *dmean, mean;
    int *labels, *hy;
    size_t pos = 0, per, D = (size_t)j->width[0];
    uint64_t epoch = 0, t0 = 0;
    const size_t *mine;
    dpar_sampler sampler;
    dpar_sampler_desc sd;
    CU(cudaMalloc((void **)&p, j->np * 4));
    CU(cudaMalloc((void **)&g, j->np * 4));
    CU(cudaMalloc((void **)&mom, j->np * 4));
    CU(cudaMemsetAsync(mom, 0, j->np * 4, s)); /* cudaMalloc's bytes are garbage: with momentum 0, m = 0 m + g
                                                  still reads them (0 x NaN is NaN) */
    for (l = 0; l <= L; l++) {
        CU(cudaMalloc((void **)&act[l], (size_t)b * j->width[l] * 4));
        CU(cudaMalloc((void **)&delta[l], (size_t)b * j->width[l] * 4));
    }
    CU(cudaMalloc((void **)&lossv, (size_t)b * 4));
    CU(cudaMalloc((void **)&dmean, 4));
    CU(cudaMalloc((void **)&labels, (size_t)b * sizeof(int)));
    CU(cudaMallocHost((void **)&hx, (size_t)b * D * 4));
    CU(cudaMallocHost((void **)&hloss, (size_t)b * 4));
    CU(cudaMallocHost((void **)&hy, (size_t)b * sizeof(int)));
    /* worker 0's initial weights reach every worker through the comm */
    if (w->rank == 0) CU(cudaMemcpyAsync(p, j->init, j->np * 4, cudaMemcpyHostToDevice, s));
    TRY(dpar_broadcast(w->comm, p, p, j->np, DPAR_F32, 0));
    memset(&sd, 0, sizeof sd);
    sd.n = j->n, sd.ranks = w->size, sd.rank = w->rank, sd.seed = 7, sd.drop_last = 1;
    TRY(dpar_sampler_init(&sampler, &sd));
    per = dpar_sampler_epoch(&sampler, 0, &mine);
    for (step = 0; step < j->steps; step++) {
        if (step == 1) t0 = dpar_time_ns(); /* step 0 warms up (cuBLAS, the comm's scratch) */
        if (pos + (size_t)b > per) per = dpar_sampler_epoch(&sampler, ++epoch, &mine), pos = 0;
        for (i = 0; i < b; i++) {
            memcpy(hx + (size_t)i * D, j->x + mine[pos + i] * D, D * 4);
            hy[i] = j->y[mine[pos + i]];
        }
        pos += (size_t)b;
        CU(cudaMemcpyAsync(act[0], hx, (size_t)b * D * 4, cudaMemcpyHostToDevice, s));
        CU(cudaMemcpyAsync(labels, hy, (size_t)b * sizeof(int), cudaMemcpyHostToDevice, s));
        for (l = 0; l < L; l++) { /* act[l+1] = relu(act[l] W_l + b_l); logits last */
            int in = j->width[l], out = j->width[l + 1];
            TRY(dpar_cuda_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, b, out, in, 1.0f, act[l], in, p + j->woff[l], out, 0.0f,
                                act[l + 1], out, w->cublas, s));
            TRY(dpar_cuda_bias_add_f32(act[l + 1], p + j->boff[l], (size_t)b, (size_t)out, s));
            if (l + 1 < L) TRY(dpar_cuda_relu_forward_f32(act[l + 1], act[l + 1], (size_t)b * out, s));
        }
        TRY(dpar_cuda_softmax_xent_forward_f32(lossv, act[L], labels, (size_t)b, C, s));
        TRY(dpar_cuda_softmax_xent_backward_f32(delta[L], act[L], labels, (size_t)b, C, s));
        for (l = L - 1; l >= 0; l--) { /* gradients: bias, weights, then the input's (through relu) */
            int in = j->width[l], out = j->width[l + 1];
            TRY(dpar_cuda_bias_backward_f32(g + j->boff[l], delta[l + 1], (size_t)b, (size_t)out, s));
            TRY(dpar_cuda_sgemm(DPAR_TRANS, DPAR_NO_TRANS, in, out, b, 1.0f, act[l], in, delta[l + 1], out, 0.0f,
                                g + j->woff[l], out, w->cublas, s));
            if (l > 0) {
                TRY(dpar_cuda_sgemm(DPAR_NO_TRANS, DPAR_TRANS, b, in, out, 1.0f, delta[l + 1], out, p + j->woff[l], out,
                                    0.0f, delta[l], in, w->cublas, s));
                TRY(dpar_cuda_relu_backward_f32(delta[l], delta[l], act[l], (size_t)b * in, s));
            }
        }
        /* the data-parallel step: average the gradients (the call waits for the stream's backward), then SGD */
        TRY(dpar_allreduce(w->comm, g, g, j->np, DPAR_F32, DPAR_AVG));
        TRY(dpar_cuda_sgd_f32(p, mom, g, j->np, j->lr, 0.0f, 0.0f, s));
        CU(cudaMemcpyAsync(hloss, lossv, (size_t)b * 4, cudaMemcpyDeviceToHost, s));
        CU(cudaStreamSynchronize(s));
        for (mean = 0, i = 0; i < b; i++) mean += hloss[i];
        mean /= (float)b;
        /* the global batch's loss: the mean over workers (copied on the stream the allreduce waits for: a plain
           cudaMemcpy from pageable memory may return before the bytes reach the device) */
        CU(cudaMemcpyAsync(dmean, &mean, 4, cudaMemcpyHostToDevice, s));
        TRY(dpar_allreduce(w->comm, dmean, dmean, 1, DPAR_F32, DPAR_AVG));
        CU(cudaMemcpy(&j->loss[w->rank][step], dmean, 4, cudaMemcpyDeviceToHost));
    }
    CU(cudaStreamSynchronize(s));
    if (w->rank == 0) j->seconds = (double)(dpar_time_ns() - t0) * 1e-9;
    dpar_sampler_destroy(&sampler);
    for (l = 0; l <= L; l++) cudaFree(act[l]), cudaFree(delta[l]);
    cudaFree(p), cudaFree(g), cudaFree(mom), cudaFree(lossv), cudaFree(dmean), cudaFree(labels);
    cudaFreeHost(hx), cudaFreeHost(hloss), cudaFreeHost(hy);
    return DPAR_OK;
}

/* the CPU reference: the same steps, worker by worker on the host (dpar_sgemm and the kernels' host references);
   the mean loss of each step into ref[] */
static int reference(job *j, float *ref)
{
    int L = j->nl, N = j->workers, b = j->batch / N, l, i, r, step, C = j->width[L];
    size_t D = (size_t)j->width[0], q, pos[MAXW] = {0}, per[MAXW];
    uint64_t epoch[MAXW] = {0};
    const size_t *mine[MAXW];
    dpar_sampler smp[MAXW];
    float *p = (float *)malloc(j->np * 4), *g = (float *)malloc(j->np * 4), *sum = (float *)malloc(j->np * 4);
    float *act[MAXL + 1], *delta[MAXL + 1], *lossv = (float *)malloc((size_t)b * 4), *mom = (float *)calloc(j->np, 4);
    int *labels = (int *)malloc((size_t)b * sizeof(int));
    memcpy(p, j->init, j->np * 4);
    for (l = 0; l <= L; l++) {
        act[l] = (float *)malloc((size_t)b * j->width[l] * 4);
        delta[l] = (float *)malloc((size_t)b * j->width[l] * 4);
    }
    for (r = 0; r < N; r++) {
        dpar_sampler_desc sd;
        memset(&sd, 0, sizeof sd);
        sd.n = j->n, sd.ranks = N, sd.rank = r, sd.seed = 7, sd.drop_last = 1;
        if (dpar_sampler_init(&smp[r], &sd) != DPAR_OK) return 0;
        per[r] = dpar_sampler_epoch(&smp[r], 0, &mine[r]);
    }
    for (step = 0; step < j->steps; step++) {
        float mean = 0;
        memset(sum, 0, j->np * 4);
        for (r = 0; r < N; r++) {
            float m = 0;
            if (pos[r] + (size_t)b > per[r]) per[r] = dpar_sampler_epoch(&smp[r], ++epoch[r], &mine[r]), pos[r] = 0;
            for (i = 0; i < b; i++) {
                memcpy(act[0] + (size_t)i * D, j->x + mine[r][pos[r] + i] * D, D * 4);
                labels[i] = j->y[mine[r][pos[r] + i]];
            }
            pos[r] += (size_t)b;
            for (l = 0; l < L; l++) {
                int in = j->width[l], out = j->width[l + 1];
                dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, b, out, in, 1.0f, act[l], in, p + j->woff[l], out, 0.0f,
                           act[l + 1], out);
                dpar_cuda_bias_add_f32_ref(act[l + 1], p + j->boff[l], (size_t)b, (size_t)out);
                if (l + 1 < L) dpar_cuda_relu_forward_f32_ref(act[l + 1], act[l + 1], (size_t)b * out);
            }
            dpar_cuda_softmax_xent_forward_f32_ref(lossv, act[L], labels, (size_t)b, C);
            dpar_cuda_softmax_xent_backward_f32_ref(delta[L], act[L], labels, (size_t)b, C);
            for (l = L - 1; l >= 0; l--) {
                int in = j->width[l], out = j->width[l + 1];
                dpar_cuda_bias_backward_f32_ref(g + j->boff[l], delta[l + 1], (size_t)b, (size_t)out);
                dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, in, out, b, 1.0f, act[l], in, delta[l + 1], out, 0.0f,
                           g + j->woff[l], out);
                if (l > 0) {
                    dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, b, in, out, 1.0f, delta[l + 1], out, p + j->woff[l], out,
                               0.0f, delta[l], in);
                    dpar_cuda_relu_backward_f32_ref(delta[l], delta[l], act[l], (size_t)b * in);
                }
            }
            for (q = 0; q < j->np; q++) sum[q] += g[q];
            for (i = 0; i < b; i++) m += lossv[i];
            mean += m / (float)b;
        }
        for (q = 0; q < j->np; q++) sum[q] /= (float)N;
        dpar_cuda_sgd_f32_ref(p, mom, sum, j->np, j->lr, 0.0f, 0.0f);
        ref[step] = mean / (float)N;
    }
    for (r = 0; r < N; r++) dpar_sampler_destroy(&smp[r]);
    for (l = 0; l <= L; l++) free(act[l]), free(delta[l]);
    free(p), free(g), free(sum), free(lossv), free(mom), free(labels);
    return 1;
}

static int usage(const char *why)
{
    fprintf(stderr,
            "cuda_data_parallel: %s\nusage: cuda_data_parallel [--layers 784,1024,1024,10] [--batch 256] [--steps 30] "
            "[--lr 0.05] [--workers-per-device 1] [--nccl]\n",
            why);
    return 2;
}

int main(int argc, char **argv)
{
    static job j;
    static float ref[1024];
    const char *layers = "784,1024,1024,10";
    dpar_cuda_pool_desc pd;
    dpar_cuda_pool *pool = NULL;
    uint64_t s = 99, t = 12345;
    int a, l, k, c, per_device = 1, nccl = 0, gpus = 0, bad = -1, cpu = 0;
    float *teacher;
    memset(&pd, 0, sizeof pd);
    j.batch = 256, j.steps = getenv("DPAR_TEST_QUICK") ? 12 : 30, j.lr = 0.05f;
    for (a = 1; a < argc; a++) {
        const char *o = argv[a], *v = a + 1 < argc ? argv[a + 1] : NULL;
        if (!strcmp(o, "--nccl")) {
            nccl = 1;
            continue;
        }
        if (!v) return usage("an option without its value");
        a++;
        if (!strcmp(o, "--layers")) layers = v;
        else if (!strcmp(o, "--batch")) j.batch = atoi(v);
        else if (!strcmp(o, "--steps")) j.steps = atoi(v);
        else if (!strcmp(o, "--lr")) j.lr = (float)atof(v);
        else if (!strcmp(o, "--workers-per-device")) per_device = atoi(v);
        else if (!strcmp(o, "--cpu")) cpu = atoi(v);
        else return usage("unknown option");
    }
    for (const char *p = layers; j.nl <= MAXL; j.nl++) {
        j.width[j.nl] = atoi(p);
        if (j.width[j.nl] < 1) return usage("--layers wants positive widths, like 784,1024,1024,10");
        if (!(p = strchr(p, ','))) break;
        p++;
    }
    if (j.nl < 1 || j.nl > MAXL || j.steps < 1 || j.steps > 1024 || !(j.lr > 0) || per_device < 1)
        return usage("2 to 9 widths, --steps 1..1024, --lr > 0, --workers-per-device >= 1");
    if (!cpu && (dpar_cuda_device_count(&gpus) != DPAR_OK || gpus == 0)) {
        printf("cuda_data_parallel: skipped: no usable CUDA device (%s)\n", dpar_last_error());
        return 0;
    }
    pd.workers_per_device = per_device;
    pd.nccl = nccl;
    if (!cpu && dpar_cuda_pool_create(&pd, &pool) != DPAR_OK)
        return fprintf(stderr, "cuda_data_parallel: %s\n", dpar_last_error()), 1;
    j.workers = cpu ? cpu : dpar_cuda_pool_size(pool);
    if (j.workers > MAXW || j.batch % j.workers) return usage("--batch must be a multiple of the workers (at most 64)");
    /* the data and initial weights of examples/data_parallel.c */
    j.n = 8192;
    j.x = (float *)malloc(sizeof(float) * j.n * j.width[0]);
    j.y = (int *)malloc(sizeof(int) * j.n);
    teacher = (float *)malloc(sizeof(float) * j.width[0] * j.width[j.nl]);
    for (k = 0; k < j.width[0] * j.width[j.nl]; k++) teacher[k] = uniform(&t) - 0.5f;
    for (size_t i = 0; i < j.n; i++) {
        float best = -1e30f, *xi = j.x + i * j.width[0];
        for (k = 0; k < j.width[0]; k++) xi[k] = uniform(&t);
        for (c = 0; c < j.width[j.nl]; c++) {
            float z = 0;
            for (k = 0; k < j.width[0]; k++) z += teacher[c * j.width[0] + k] * (xi[k] - 0.5f);
            if (z > best) best = z, j.y[i] = c;
        }
    }
    for (l = 0; l < j.nl; l++) {
        j.woff[l] = j.np;
        j.boff[l] = j.np + (size_t)j.width[l] * j.width[l + 1];
        j.np = j.boff[l] + j.width[l + 1];
    }
    j.init = (float *)calloc(j.np, sizeof(float));
    for (l = 0; l < j.nl; l++)
        for (size_t q = 0; q < (size_t)j.width[l] * j.width[l + 1]; q++)
            j.init[j.woff[l] + q] = (2 * uniform(&s) - 1) * sqrtf(6.0f / (float)j.width[l]);
    if (cpu) { /* the reference alone, printed as examples/data_parallel.c prints its steps */
        if (!reference(&j, ref)) return fprintf(stderr, "cuda_data_parallel: the reference failed\n"), 1;
        for (k = 0; k < j.steps; k++)
            if (k == 0 || k == j.steps - 1 || (j.steps >= 5 && (k + 1) % (j.steps / 5) == 0))
                printf("step %4d  loss %.4f\n", k + 1, ref[k]);
        free(j.x), free(j.y), free(j.init), free(teacher);
        return 0;
    }
    printf("cuda_data_parallel: layers %s (%zu parameters), %d GPU workers on %d device(s) x %d samples per step, "
           "gradients over %s\n",
           layers, j.np, j.workers, gpus, j.batch / j.workers, nccl ? "NCCL" : "dpar's ring on device buffers");
    if (dpar_cuda_pool_run(pool, worker_main, &j) != DPAR_OK)
        return fprintf(stderr, "cuda_data_parallel: %s\n", dpar_last_error()), 1;
    dpar_cuda_pool_destroy(pool);
    if (!reference(&j, ref)) return fprintf(stderr, "cuda_data_parallel: the reference failed\n"), 1;
    for (k = 0; k < j.steps; k++) {
        float gpu = j.loss[0][k], d = fabsf(gpu - ref[k]);
        if (k == 0 || k == j.steps - 1 || (k + 1) % 5 == 0)
            printf("step %4d  loss %.5f  (CPU %.5f)\n", k + 1, gpu, ref[k]);
        if (!(d <= 2e-3f * (fabsf(ref[k]) > 1 ? fabsf(ref[k]) : 1)) && bad < 0) bad = k;
    }
    if (bad >= 0)
        printf("the GPU's loss at step %d, %.6f, is not within 2e-3 of the CPU's %.6f: WRONG\n", bad + 1,
               j.loss[0][bad], ref[bad]);
    else
        printf("loss within 2e-3 (relative) of the CPU reference at each of %d steps; %.4f -> %.4f\n", j.steps,
               j.loss[0][0], j.loss[0][j.steps - 1]);
    printf("train samples_per_s=%.1f final_loss=%.4f\n",
           j.steps > 1 ? (double)j.batch * (j.steps - 1) / j.seconds : 0.0, j.loss[0][j.steps - 1]);
    free(j.x), free(j.y), free(j.init), free(teacher);
    return bad < 0 && j.loss[0][j.steps - 1] < j.loss[0][0] ? 0 : 1;
}
