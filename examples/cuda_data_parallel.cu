/* cuda_data_parallel.cu - the MLP of examples/data_parallel.c trained data-parallel on GPU workers: cuBLAS GEMMs,
   dpar_cuda's layer kernels, one gradient allreduce per step over the pool's comm (dpar.h's ring on device buffers,
   or NCCL when built with -DDPAR_NCCL -lnccl), then checked against the same training on the CPU.
   Build: nvcc -std=c++14 -O2 -arch=sm_90 -I. examples/cuda_data_parallel.cu -o cuda_data_parallel -lcublas
   Run:   ./cuda_data_parallel           (--workers-per-device 2: several ranks on one GPU; --nccl with -DDPAR_NCCL;
                                          --overlap: each layer's gradients reduced during backward; --bf16)
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
   losses as that example does.

   Overlap (--overlap, a stream-ordered pool): backward makes the gradients of the last layer first. As soon as a
   layer's are written, an event recorded on the compute stream lets a second stream (the comm stream) start that
   layer's allreduce while the compute stream goes on with the layers below, as llm.c and PyTorch's DDP buckets do;
   SGD waits for the comm stream's last allreduce. --ordered keeps one allreduce after backward, stream-ordered.
   --zero 1: ZeRO-1 (DeepSpeed's stage 1): a reduce-scatter gives each worker its block of the averaged gradients,
   each worker steps its block with momentum kept for that block only (1/N of the optimizer state), and an all-gather
   brings every worker the new weights: the same traffic as the allreduce, the same math as the reference.
   --zero 2 | 3: dpar_fsdp on the workers' device memory, each layer (its weights and bias) one unit. Stage 3 keeps
   only each worker's block of every layer's weights, gradients and momentum; a layer's weights are gathered into one
   of two pooled buffers for its forward and again for its backward (the next layer's gather prefetched meanwhile),
   its gradients reduce-scattered as soon as backward has made them. Stage 2 keeps the full weights and shards the
   gradients and the optimizer state. Same math as the reference (SGD without momentum).
   --bf16: the gradients are cast to bf16 before they travel and averaged in bf16 (half the bytes), then cast back
   for SGD on the fp32 weights; the reference rounds the same way (each worker's gradients to bf16, summed in bf16,
   divided once), so the 2e-3 bound stays.
   After training, --timing-steps steps of each kind run on the last batch (learning rate 0): the compute alone, the
   allreduce after backward and (stream-ordered pools) overlapped, printed as step_ms, with
   comm_hidden = (after - overlap) / (after - compute): the share of the allreduce's time that overlap hid.
   Options: --layers 784,1024,1024,10 --batch 256 --steps 30 --lr 0.05 --workers-per-device 1 --nccl --ordered
   --overlap --bf16 --zero 0|1|2|3 --timing-steps 20 --cpu N */
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
    int bf16;               /* --bf16: the gradients travel and are averaged in bf16 (the weights stay fp32) */
    int zero;               /* --zero 1: ZeRO-1, each worker keeps the momentum of its block of the weights only;
                               2, 3: dpar_fsdp's stages on the device */
    size_t fsdp_bytes;      /* --zero 2|3: what worker 0's dpar_fsdp holds (dpar_fsdp_memory) */
    int ordered;            /* the pool is stream-ordered (--ordered, --overlap) */
    int comm_mode;          /* how the training steps reduce their gradients (COMM_AFTER or COMM_OVERLAP) */
    int timing_steps;       /* steps of each mode timed after training (--timing-steps) */
    double step_ms[3];      /* worker 0's milliseconds per step: compute alone, allreduce after, overlapped */
    dpar_cuda_pool *pool;
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

/* how a step's gradients travel (the timing pass after training runs all three) */
enum {
    COMM_NONE,    /* no allreduce at all: the compute alone (timing only; the workers' weights drift apart) */
    COMM_AFTER,   /* one allreduce of every gradient after backward, on the compute stream */
    COMM_OVERLAP, /* each layer's gradients reduced as soon as backward has made them, on a comm stream beside the
                     compute stream, while backward goes on with the layers below (a stream-ordered pool) */
};

/* one worker's device memory and streams, allocated once */
typedef struct {
    job *j;
    const dpar_cuda_worker *w;
    int b;                         /* samples per step on this worker */
    cudaStream_t s;                /* the compute stream (the worker's own) */
    cudaStream_t cs;               /* the comm stream of COMM_OVERLAP */
    cudaEvent_t layer_ready[MAXL]; /* recorded on s once layer l's gradients are written */
    cudaEvent_t comm_done;         /* recorded on cs after the step's last allreduce */
    float *p, *g, *mom;            /* weights, gradients (np floats each), momentum (np, or its block's with --zero) */
    float *mom_base;               /* the momentum's allocation (mom is off % 4 floats into it) */
    size_t off, len;               /* --zero 1: this worker's block of the weights (dpar_block_range), else 0, np */
    void *g16;                     /* the gradients in bf16 (--bf16): what travels */
    float *act[MAXL + 1], *delta[MAXL + 1];
    float *lossv; /* each sample's loss */
    int *labels;
    dpar_fsdp *fsdp; /* --zero 2|3: the layers' shards (the worker's own weights and gradients are then freed) */
} worker_state;

/* reduce layer l's gradients (weights then bias: one contiguous range) over the workers, averaged; in bf16 when
   asked. COMM_OVERLAP: the comm stream first waits for the compute stream's event, so it reads finished
   gradients, and the call returns at once: backward goes on while the ring runs */
static dpar_status reduce_gradients(worker_state *k, size_t first, size_t count, int comm_mode, int layer)
{
    job *j = k->j;
    void *what = k->g + first;
    dpar_dtype dtype = DPAR_F32;
    if (j->bf16) {
        what = (uint16_t *)k->g16 + first;
        dtype = DPAR_BF16;
        TRY(dpar_cuda_cast(what, DPAR_BF16, k->g + first, DPAR_F32, count, k->s));
    }
    if (comm_mode == COMM_OVERLAP) {
        CU(cudaEventRecord(k->layer_ready[layer], k->s));
        CU(cudaStreamWaitEvent(k->cs, k->layer_ready[layer], 0));
    }
    return dpar_allreduce(k->w->comm, what, what, count, dtype, DPAR_AVG);
}

/* ZeRO-1 (--zero 1), after backward: each worker receives only its block of the averaged gradients (a reduce-scatter:
   half an allreduce's traffic), steps its block of the weights with its block of the momentum (1/N of the optimizer
   state), and the blocks of the new weights are gathered back into every worker's copy (the other half). Both
   collectives are in place, as dpar_zero_step's. In bf16 the gradients travel in bf16 and the block is cast back.
   COMM_NONE (the compute-alone timing): the block's SGD on this worker's own gradients, no collective */
static dpar_status zero_step(worker_state *k, int comm_mode, float lr)
{
    job *j = k->j;
    dpar_comm *comm = k->w->comm;
    float *grads = k->g;
    if (comm_mode == COMM_NONE) return dpar_cuda_sgd_f32(k->p + k->off, k->mom, grads + k->off, k->len, lr, 0, 0, k->s);
    if (j->bf16) {
        uint16_t *grads16 = (uint16_t *)k->g16;
        TRY(dpar_cuda_cast(grads16, DPAR_BF16, grads, DPAR_F32, j->np, k->s));
        TRY(dpar_reduce_scatter(comm, grads16, grads16 + k->off, j->np, DPAR_BF16, DPAR_AVG));
        TRY(dpar_cuda_cast(grads + k->off, DPAR_F32, grads16 + k->off, DPAR_BF16, k->len, k->s));
    } else {
        TRY(dpar_reduce_scatter(comm, grads, grads + k->off, j->np, DPAR_F32, DPAR_AVG));
    }
    TRY(dpar_cuda_sgd_f32(k->p + k->off, k->mom, grads + k->off, k->len, lr, 0.0f, 0.0f, k->s));
    return dpar_allgather(comm, k->p + k->off, k->p, j->np, DPAR_F32);
}

/* layer l's weights, its bias right after them: the worker's copy, or (--zero 2|3) the unit dpar_fsdp gathered */
static dpar_status layer_weights(worker_state *k, int l, float **weights)
{
    if (k->fsdp) return dpar_fsdp_gather(k->fsdp, l, weights);
    *weights = k->p + k->j->woff[l];
    return DPAR_OK;
}
/* where layer l's gradients go: the worker's array, or (--zero 2|3) dpar_fsdp's zeroed unit buffer */
static dpar_status layer_grads(worker_state *k, int l, float **grads)
{
    if (k->fsdp) return dpar_fsdp_grads(k->fsdp, l, grads);
    *grads = k->g + k->j->woff[l];
    return DPAR_OK;
}

/* one training step on the batch in act[0] and labels: forward, backward, the gradients' allreduce (comm_mode),
   SGD. Everything is queued on the streams; nothing here waits for the device (--zero 2|3 on a blocking pool: each
   gather and reduce-scatter waits for its own work) */
static dpar_status train_step(worker_state *k, int comm_mode, float lr)
{
    job *j = k->j;
    int L = j->nl, b = k->b, l, C = j->width[j->nl];
    cudaStream_t s = k->s;
    for (l = 0; l < L; l++) { /* act[l+1] = relu(act[l] W_l + b_l); logits last */
        int in = j->width[l], out = j->width[l + 1];
        float *weights;
        TRY(layer_weights(k, l, &weights));
        TRY(dpar_cuda_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, b, out, in, 1.0f, k->act[l], in, weights, out, 0.0f,
                            k->act[l + 1], out, k->w->cublas, s));
        TRY(dpar_cuda_bias_add_f32(k->act[l + 1], weights + (size_t)in * out, (size_t)b, (size_t)out, s));
        if (l + 1 < L) TRY(dpar_cuda_relu_forward_f32(k->act[l + 1], k->act[l + 1], (size_t)b * out, s));
        if (k->fsdp) TRY(dpar_fsdp_release(k->fsdp, l));
    }
    TRY(dpar_cuda_softmax_xent_forward_f32(k->lossv, k->act[L], k->labels, (size_t)b, C, s));
    TRY(dpar_cuda_softmax_xent_backward_f32(k->delta[L], k->act[L], k->labels, (size_t)b, C, s));
    for (l = L - 1; l >= 0; l--) { /* gradients: bias, weights, then the input's (through relu) */
        int in = j->width[l], out = j->width[l + 1];
        float *weights, *grads;
        TRY(layer_weights(k, l, &weights));
        TRY(layer_grads(k, l, &grads));
        TRY(dpar_cuda_bias_backward_f32(grads + (size_t)in * out, k->delta[l + 1], (size_t)b, (size_t)out, s));
        TRY(dpar_cuda_sgemm(DPAR_TRANS, DPAR_NO_TRANS, in, out, b, 1.0f, k->act[l], in, k->delta[l + 1], out, 0.0f,
                            grads, out, k->w->cublas, s));
        if (comm_mode == COMM_OVERLAP)
            TRY(reduce_gradients(k, j->woff[l], j->boff[l] + out - j->woff[l], comm_mode, l));
        if (l > 0) {
            TRY(dpar_cuda_sgemm(DPAR_NO_TRANS, DPAR_TRANS, b, in, out, 1.0f, k->delta[l + 1], out, weights, out, 0.0f,
                                k->delta[l], in, k->w->cublas, s));
            TRY(dpar_cuda_relu_backward_f32(k->delta[l], k->delta[l], k->act[l], (size_t)b * in, s));
        }
        if (k->fsdp) { /* this layer's weights are no longer read; its gradients are reduce-scattered now */
            TRY(dpar_fsdp_release(k->fsdp, l));
            TRY(dpar_fsdp_reduce(k->fsdp, l));
        }
    }
    /* the data-parallel step: average the gradients, then SGD (ZeRO-1: on this worker's block only; ZeRO-2 and 3: the
       gradients were reduce-scattered layer by layer, dpar_fsdp steps every layer's block at its desc's lr) */
    if (k->fsdp) return dpar_fsdp_step(k->fsdp);
    if (j->zero) return zero_step(k, comm_mode, lr);
    if (comm_mode == COMM_AFTER) TRY(reduce_gradients(k, 0, j->np, comm_mode, 0));
    if (comm_mode == COMM_OVERLAP) { /* the optimizer waits for the comm stream's last allreduce */
        CU(cudaEventRecord(k->comm_done, k->cs));
        CU(cudaStreamWaitEvent(s, k->comm_done, 0));
    }
    if (j->bf16 && comm_mode != COMM_NONE) TRY(dpar_cuda_cast(k->g, DPAR_F32, k->g16, DPAR_BF16, j->np, s));
    return dpar_cuda_sgd_f32(k->p, k->mom, k->g, j->np, lr, 0.0f, 0.0f, s);
}

/* the mean of every worker's loss of this step, into *out (the host waits for the step here) */
static dpar_status step_loss(worker_state *k, float *hloss, float *dmean, int comm_mode, float *out)
{
    float mean = 0;
    int i;
    cudaStream_t after = comm_mode == COMM_OVERLAP ? k->cs : k->s; /* where the comm's results are */
    CU(cudaMemcpyAsync(hloss, k->lossv, (size_t)k->b * 4, cudaMemcpyDeviceToHost, k->s));
    CU(cudaStreamSynchronize(k->s));
    for (i = 0; i < k->b; i++) mean += hloss[i];
    mean /= (float)k->b;
    /* copied on the stream the allreduce follows: a plain cudaMemcpy from pageable memory may return before the
       bytes reach the device */
    CU(cudaMemcpyAsync(dmean, &mean, 4, cudaMemcpyHostToDevice, k->s));
    if (comm_mode == COMM_OVERLAP) {
        CU(cudaEventRecord(k->layer_ready[0], k->s));
        CU(cudaStreamWaitEvent(k->cs, k->layer_ready[0], 0));
    }
    TRY(dpar_allreduce(k->w->comm, dmean, dmean, 1, DPAR_F32, DPAR_AVG));
    CU(cudaMemcpyAsync(hloss, dmean, 4, cudaMemcpyDeviceToHost, after));
    CU(cudaStreamSynchronize(after));
    *out = hloss[0];
    return DPAR_OK;
}

/* the comm's stream for this mode: the comm stream for COMM_OVERLAP, else the worker's own (stream-ordered pools) */
static dpar_status use_mode(worker_state *k, int comm_mode)
{
    if (!k->j->ordered) return DPAR_OK;
    return dpar_cuda_comm_set_stream(k->j->pool, k->w->rank, comm_mode == COMM_OVERLAP ? (void *)k->cs : NULL);
}

/* milliseconds per step of `steps` steps in comm_mode on the last batch, the workers started together */
static dpar_status time_steps(worker_state *k, int comm_mode, int steps, double *ms)
{
    uint64_t t0;
    int i;
    TRY(use_mode(k, comm_mode));
    TRY(train_step(k, comm_mode, 0.0f)); /* a warm-up step (lr 0: the weights stay as trained) */
    CU(cudaStreamSynchronize(k->s));
    CU(cudaStreamSynchronize(k->cs));
    TRY(dpar_barrier(k->w->comm));
    t0 = dpar_time_ns();
    for (i = 0; i < steps; i++) TRY(train_step(k, comm_mode, 0.0f));
    CU(cudaStreamSynchronize(k->s));
    *ms = (double)(dpar_time_ns() - t0) * 1e-6 / steps;
    return DPAR_OK;
}

/* one worker: its weights, gradients, activations and batch in device memory, allocated once */
static dpar_status worker_main(void *user, const dpar_cuda_worker *w)
{
    job *j = (job *)user;
    worker_state state, *k = &state;
    int L = j->nl, l, i, step;
    float *hx, *hloss, *dmean;
    int *hy;
    size_t pos = 0, per, D = (size_t)j->width[0];
    uint64_t epoch = 0, t0 = 0;
    const size_t *mine;
    dpar_sampler sampler;
    dpar_sampler_desc sd;
    memset(k, 0, sizeof *k);
    k->j = j;
    k->w = w;
    k->b = j->batch / w->size;
    k->s = (cudaStream_t)w->stream;
    CU(cudaStreamCreateWithFlags(&k->cs, cudaStreamNonBlocking));
    for (l = 0; l < L; l++) CU(cudaEventCreateWithFlags(&k->layer_ready[l], cudaEventDisableTiming));
    CU(cudaEventCreateWithFlags(&k->comm_done, cudaEventDisableTiming));
    CU(cudaMalloc((void **)&k->p, j->np * 4));
    CU(cudaMalloc((void **)&k->g, j->np * 4));
    CU(cudaMalloc((void **)&k->g16, j->np * 2));
    k->off = 0;
    k->len = j->np;
    if (j->zero) dpar_block_range(j->np, w->size, w->rank, &k->off, &k->len);
    /* the momentum starts as many floats past a 16-byte boundary as the block's weights and gradients do, so SGD on
       the block runs with vector loads (dpar_cuda's kernels take vectors where every buffer has the same offset) */
    CU(cudaMalloc((void **)&k->mom_base, (k->len + 4) * 4));
    k->mom = k->mom_base + k->off % 4;
    CU(cudaMemsetAsync(k->mom, 0, k->len * 4, k->s)); /* cudaMalloc's bytes are garbage: with momentum 0,
                                                        m = 0 m + g still reads them (0 x NaN is NaN) */
    for (l = 0; l <= L; l++) {
        CU(cudaMalloc((void **)&k->act[l], (size_t)k->b * j->width[l] * 4));
        CU(cudaMalloc((void **)&k->delta[l], (size_t)k->b * j->width[l] * 4));
    }
    CU(cudaMalloc((void **)&k->lossv, (size_t)k->b * 4));
    CU(cudaMalloc((void **)&dmean, 4));
    CU(cudaMalloc((void **)&k->labels, (size_t)k->b * sizeof(int)));
    CU(cudaMallocHost((void **)&hx, (size_t)k->b * D * 4));
    CU(cudaMallocHost((void **)&hloss, (size_t)k->b * 4));
    CU(cudaMallocHost((void **)&hy, (size_t)k->b * sizeof(int)));
    /* worker 0's initial weights reach every worker through the comm */
    if (w->rank == 0) CU(cudaMemcpyAsync(k->p, j->init, j->np * 4, cudaMemcpyHostToDevice, k->s));
    TRY(dpar_broadcast(w->comm, k->p, k->p, j->np, DPAR_F32, 0));
    TRY(use_mode(k, j->comm_mode));
    if (j->zero >= 2) { /* each layer a unit; its full weights copied in from the broadcast copy, then freed */
        dpar_fsdp_desc fd;
        size_t units[MAXL];
        for (l = 0; l < L; l++) units[l] = j->boff[l] + (size_t)j->width[l + 1] - j->woff[l];
        memset(&fd, 0, sizeof fd);
        fd.comm = w->comm;
        fd.stage = j->zero;
        fd.num_units = L;
        fd.unit_counts = units;
        fd.kind = DPAR_OPTIM_SGD;
        fd.lr = j->lr;
        TRY(dpar_fsdp_create(&fd, &k->fsdp));
        for (l = 0; l < L; l++) TRY(dpar_fsdp_set_params(k->fsdp, l, k->p + j->woff[l]));
        CU(cudaStreamSynchronize(k->s));
        cudaFree(k->p), cudaFree(k->g), cudaFree(k->g16), cudaFree(k->mom_base);
        k->p = k->g = k->mom_base = k->mom = NULL;
        k->g16 = NULL;
        if (w->rank == 0) TRY(dpar_fsdp_memory(k->fsdp, &j->fsdp_bytes, NULL));
    }
    memset(&sd, 0, sizeof sd);
    sd.n = j->n, sd.ranks = w->size, sd.rank = w->rank, sd.seed = 7, sd.drop_last = 1;
    TRY(dpar_sampler_init(&sampler, &sd));
    per = dpar_sampler_epoch(&sampler, 0, &mine);
    for (step = 0; step < j->steps; step++) {
        if (step == 1) t0 = dpar_time_ns(); /* step 0 warms up (cuBLAS, the comm's scratch) */
        if (pos + (size_t)k->b > per) per = dpar_sampler_epoch(&sampler, ++epoch, &mine), pos = 0;
        for (i = 0; i < k->b; i++) {
            memcpy(hx + (size_t)i * D, j->x + mine[pos + i] * D, D * 4);
            hy[i] = j->y[mine[pos + i]];
        }
        pos += (size_t)k->b;
        CU(cudaMemcpyAsync(k->act[0], hx, (size_t)k->b * D * 4, cudaMemcpyHostToDevice, k->s));
        CU(cudaMemcpyAsync(k->labels, hy, (size_t)k->b * sizeof(int), cudaMemcpyHostToDevice, k->s));
        TRY(train_step(k, j->comm_mode, j->lr));
        TRY(step_loss(k, hloss, dmean, j->comm_mode, &j->loss[w->rank][step]));
    }
    CU(cudaStreamSynchronize(k->s));
    if (w->rank == 0) j->seconds = (double)(dpar_time_ns() - t0) * 1e-9;
    if (j->timing_steps > 0) { /* the same step without the allreduce, with it after backward, and overlapped */
        double ms[3] = {0, 0, 0};
        if (!k->fsdp) TRY(time_steps(k, COMM_NONE, j->timing_steps, &ms[COMM_NONE])); /* dpar_fsdp always gathers */
        TRY(time_steps(k, COMM_AFTER, j->timing_steps, &ms[COMM_AFTER]));
        if (j->ordered && !j->zero) TRY(time_steps(k, COMM_OVERLAP, j->timing_steps, &ms[COMM_OVERLAP]));
        if (w->rank == 0) memcpy(j->step_ms, ms, sizeof ms);
    }
    CU(cudaStreamSynchronize(k->cs));
    TRY(use_mode(k, COMM_AFTER)); /* the comm back on the worker's stream before k->cs goes */
    TRY(dpar_fsdp_destroy(k->fsdp));
    dpar_sampler_destroy(&sampler);
    for (l = 0; l <= L; l++) cudaFree(k->act[l]), cudaFree(k->delta[l]);
    cudaFree(k->p), cudaFree(k->g), cudaFree(k->g16), cudaFree(k->mom_base), cudaFree(k->lossv), cudaFree(dmean);
    cudaFree(k->labels);
    cudaFreeHost(hx), cudaFreeHost(hloss), cudaFreeHost(hy);
    for (l = 0; l < L; l++) cudaEventDestroy(k->layer_ready[l]);
    cudaEventDestroy(k->comm_done);
    cudaStreamDestroy(k->cs);
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
    uint16_t *g16 = (uint16_t *)malloc(j->np * 2), *sum16 = (uint16_t *)malloc(j->np * 2);
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
            if (j->bf16) { /* as the ring in bf16: each worker's gradients rounded, summed in bf16 (here in rank
                              order; the ring's order differs from 3 workers on: an ulp of bf16 on some sums) */
                dpar_cuda_cast_ref(g16, DPAR_BF16, g, DPAR_F32, j->np);
                if (r == 0) memcpy(sum16, g16, j->np * 2);
                else dpar_cuda_reduce_ref(sum16, sum16, g16, j->np, DPAR_BF16, DPAR_SUM, 0);
            } else {
                for (q = 0; q < j->np; q++) sum[q] += g[q];
            }
            for (i = 0; i < b; i++) m += lossv[i];
            mean += m / (float)b;
        }
        if (j->bf16) { /* the average in bf16 (the sum divided once, rounded), then back to fp32 for SGD */
            dpar_cuda_divide_ref(sum16, sum16, j->np, DPAR_BF16, N);
            dpar_cuda_cast_ref(sum, DPAR_F32, sum16, DPAR_BF16, j->np);
        } else {
            for (q = 0; q < j->np; q++) sum[q] /= (float)N;
        }
        dpar_cuda_sgd_f32_ref(p, mom, sum, j->np, j->lr, 0.0f, 0.0f);
        ref[step] = mean / (float)N;
    }
    for (r = 0; r < N; r++) dpar_sampler_destroy(&smp[r]);
    for (l = 0; l <= L; l++) free(act[l]), free(delta[l]);
    free(p), free(g), free(sum), free(lossv), free(mom), free(labels), free(g16), free(sum16);
    return 1;
}

static int usage(const char *why)
{
    fprintf(stderr,
            "cuda_data_parallel: %s\nusage: cuda_data_parallel [--layers 784,1024,1024,10] [--batch 256] [--steps 30] "
            "[--lr 0.05] [--workers-per-device 1] [--nccl] [--ordered] [--overlap] [--bf16] [--zero 0|1|2|3] "
            "[--timing-steps 20]\n",
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
    j.comm_mode = COMM_AFTER;
    j.timing_steps = 20;
    for (a = 1; a < argc; a++) {
        const char *o = argv[a], *v = a + 1 < argc ? argv[a + 1] : NULL;
        if (!strcmp(o, "--nccl")) {
            nccl = 1;
            continue;
        }
        if (!strcmp(o, "--ordered")) {
            j.ordered = 1;
            continue;
        }
        if (!strcmp(o, "--overlap")) {
            j.ordered = 1;
            j.comm_mode = COMM_OVERLAP;
            continue;
        }
        if (!strcmp(o, "--bf16")) {
            j.bf16 = 1;
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
        else if (!strcmp(o, "--timing-steps")) j.timing_steps = atoi(v);
        else if (!strcmp(o, "--zero")) j.zero = atoi(v);
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
    if (j.timing_steps < 0 || j.timing_steps > 10000) return usage("--timing-steps wants 0..10000");
    if (j.zero < 0 || j.zero > 3) return usage("--zero wants 0, 1, 2 or 3");
    if (j.zero == 1 && j.comm_mode == COMM_OVERLAP)
        return usage("--zero 1 and --overlap: ZeRO-1's reduce-scatter is one call after backward (a layer's gradients "
                     "are not one worker's block)");
    if (j.zero >= 2 && (j.comm_mode == COMM_OVERLAP || j.bf16))
        return usage("--zero 2|3 with --overlap or --bf16: dpar_fsdp on the device reduces each layer as backward "
                     "makes it already, in fp32 (use --ordered for a stream-ordered pool)");
    if (nccl && j.ordered)
        return usage("--ordered and --overlap are the device ring's (an NCCL comm's calls go on the worker's stream)");
    if (!cpu && (dpar_cuda_device_count(&gpus) != DPAR_OK || gpus == 0)) {
        printf("cuda_data_parallel: skipped: no usable CUDA device (%s)\n", dpar_last_error());
        return 0;
    }
    pd.workers_per_device = per_device;
    pd.nccl = nccl;
    pd.stream_ordered = j.ordered;
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
    printf("gradients: %s, %s%s\n", j.bf16 ? "bf16 (fp32 weights)" : "fp32",
           j.comm_mode == COMM_OVERLAP ? "each layer's reduced on a comm stream during backward (--overlap)"
           : j.zero >= 2               ? "dpar_fsdp (each layer's gathered for forward and backward, its gradients "
                                         "reduce-scattered as backward makes them)"
           : j.zero                    ? "ZeRO-1 (a reduce-scatter, SGD on each worker's block, an all-gather)"
                                       : "one allreduce after backward",
           j.ordered ? ", stream-ordered pool" : "");
    if (j.zero == 1) {
        size_t block_offset, block_floats;
        dpar_block_range(j.np, j.workers, 0, &block_offset, &block_floats);
        printf("zero 1: worker 0 keeps the momentum of %zu of the %zu weights (%.1f MiB instead of %.1f)\n",
               block_floats, j.np, block_floats * 4.0 / 1048576.0, j.np * 4.0 / 1048576.0);
    }
    j.pool = pool;
    if (dpar_cuda_pool_run(pool, worker_main, &j) != DPAR_OK)
        return fprintf(stderr, "cuda_data_parallel: %s\n", dpar_last_error()), 1;
    dpar_cuda_pool_destroy(pool);
    if (j.zero >= 2) /* without it: fp32 weights, gradients and momentum, 12 bytes a parameter */
        printf("zero %d: worker 0's dpar_fsdp holds %.1f MiB (dpar_fsdp_memory) instead of %.1f MiB of weights, "
               "gradients and momentum\n",
               j.zero, j.fsdp_bytes / 1048576.0, j.np * 12.0 / 1048576.0);
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
    if (j.timing_steps > 0) { /* comm_hidden: the share of the allreduce's time that overlap took off the step */
        double alone = j.step_ms[COMM_NONE], after = j.step_ms[COMM_AFTER], overlap = j.step_ms[COMM_OVERLAP];
        int overlapped = j.ordered && !j.zero; /* ZeRO-1's steps are not overlapped */
        if (j.zero >= 2) printf("step_ms fsdp%d=%.3f", j.zero, after);
        else printf("step_ms compute=%.3f %s=%.3f", alone, j.zero ? "zero1_after" : "allreduce_after", after);
        if (overlapped && after - alone > 0.01 * alone)
            printf(" overlap=%.3f comm_hidden=%.2f", overlap, (after - overlap) / (after - alone));
        else if (overlapped)
            printf(" overlap=%.3f comm_hidden=n/a (the allreduce added under 1%% to the step)", overlap);
        printf("  (%d steps each on the last batch)\n", j.timing_steps);
    }
    printf("train samples_per_s=%.1f final_loss=%.4f\n",
           j.steps > 1 ? (double)j.batch * (j.steps - 1) / j.seconds : 0.0, j.loss[0][j.steps - 1]);
    free(j.x), free(j.y), free(j.init), free(teacher);
    return bad < 0 && j.loss[0][j.steps - 1] < j.loss[0][0] ? 0 : 1;
}
