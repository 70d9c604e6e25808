/* bench_cuda.cu - dpar_cuda.h's kernels against the device's own copy bandwidth, in one run.

   For each kernel and size: the median time of 9 launches (CUDA events), as GB/s of the bytes the
   kernel must read and write (fill writes n floats; add reads 2n and writes n; ...), beside a
   device-to-device cudaMemcpy of the same buffer (reads and writes it: 2 x bytes) timed the same way.
   ratio = GBps / memcpy_GBps: 1.0 means the kernel streams memory as fast as the copy engine path.
   The goal (issue 16): ratio >= 0.9 at 64 MiB and above. Without a usable device it says so and
   exits 0.

   Then the allreduce of a GPU pool's comm (f32 sum, in place), the median of 9 calls on every worker
   (host clock, a barrier before each), busbw = bytes / time x 2(N-1)/N as nccl-tests count it:
       bench=allreduce transport=cuda ranks=N bytes=B segment=S us=T busbw_GBps=G   dpar.h's ring on device buffers
       bench=allreduce transport=nccl ranks=N bytes=B us=T busbw_GBps=G      the same pool's NCCL comm (-DDPAR_NCCL)
   on every visible device, one worker each, or 2 workers on one device when there is only one (NCCL runs one
   rank per GPU: then its line has ranks=1). With workers that share a device, busbw is that device's memory (HBM)
   bandwidth, not a link's: nothing crosses NVLink or PCIe. The goal: cuda >= 0.9 of nccl's busbw at 64 MiB and
   above on the same GPUs.

   Each call is timed from the host's call to the end of the worker's stream (cudaStreamSynchronize): a
   stream-ordered call (mode=ordered, dpar_cuda_pool_desc.stream_ordered) returns once queued, a blocking one
   (mode=blocking, the comm before issue 36: a stream synchronisation per ring step) once done. After each pool's
   sizes, the cost of one ring step: t0 = the smallest size's time / 2(N-1).
       bench=cuda_ring_step mode=M ranks=N bytes=B t0_us=T

   Build: nvcc -std=c++14 -O2 -arch=sm_90 -I. bench/bench_cuda.cu -o bench_cuda -lcublas   (+ -DDPAR_NCCL -lnccl)
   Run:   ./bench_cuda [max_mib] [--segment B] [--allreduce-only] [--min-kib K] [--workers 2,4,8]
                       [--modes blocking,ordered]
          max_mib: default 256; one bench= line per kernel and size, then the allreduces from --min-kib (default
          1024) to max_mib MiB, x4 each time, on pools of each --workers count (workers of the one device; default:
          2 on one GPU, else one per GPU) in each mode (default blocking). --segment: the pool comm's segment_bytes
          (default 0: 64 MiB blocking, 4 MiB ordered), printed as segment= in each allreduce line; DPAR_ALGO=ring|
          oneshot chooses the comm's algorithm as for any comm. */
#define DPAR_IMPLEMENTATION
#define DPAR_CUDA_IMPLEMENTATION
#include "dpar_cuda.h"

#include <stdio.h>
#include <stdlib.h>

#define REPS 9

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* what one kernel does to buffers x, y, z of n floats (their 16-bit views for the casts) */
typedef struct {
    const char *name;
    double traffic; /* bytes read + written, in units of n floats */
} kernel;
static const kernel kernels[] = {
    {"fill_f32", 1},          {"scale_f32", 2},       {"axpy_f32", 3},         {"add_f32", 3}, {"reduce_f32_sum", 3},
    {"reduce_bf16_sum", 1.5}, {"cast_f32_bf16", 1.5}, {"relu_forward_f32", 2}, {"sgd_f32", 5}, {"adamw_f32", 7}};

static dpar_status launch(int k, float *x, float *y, float *z, float *w, size_t n)
{
    switch (k) {
    case 0: return dpar_cuda_fill_f32(x, 1.0f, n, NULL);
    case 1: return dpar_cuda_scale_f32(x, 0.5f, n, NULL);
    case 2: return dpar_cuda_axpy_f32(y, x, 0.5f, n, NULL);
    case 3: return dpar_cuda_add_f32(z, x, y, n, NULL);
    case 4: return dpar_cuda_reduce(z, x, y, n, DPAR_F32, DPAR_SUM, 0, NULL);
    case 5: return dpar_cuda_reduce(z, x, y, n, DPAR_BF16, DPAR_SUM, 0, NULL); /* n bf16: half the bytes */
    case 6: return dpar_cuda_cast(y, DPAR_BF16, x, DPAR_F32, n, NULL);
    case 7: return dpar_cuda_relu_forward_f32(y, x, n, NULL);
    case 8: return dpar_cuda_sgd_f32(x, y, z, n, 0.01f, 0.9f, 0.0f, NULL);
    default: return dpar_cuda_adamw_f32(x, y, z, w, n, 0.001f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, NULL);
    }
}

/* median milliseconds of REPS runs of kernel k, or of a copy (k < 0) */
static float time_ms(int k, float *x, float *y, float *z, float *w, size_t n)
{
    cudaEvent_t a, b;
    float ms[REPS];
    int r;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (r = -1; r < REPS; r++) { /* r = -1: warm-up */
        cudaEventRecord(a, NULL);
        if (k < 0) cudaMemcpyAsync(y, x, n * sizeof(float), cudaMemcpyDeviceToDevice, NULL);
        else if (launch(k, x, y, z, w, n) != DPAR_OK) {
            printf("bench_cuda: %s\n", dpar_last_error());
            exit(1);
        }
        cudaEventRecord(b, NULL);
        cudaEventSynchronize(b);
        if (r >= 0) cudaEventElapsedTime(&ms[r], a, b);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    qsort(ms, REPS, sizeof ms[0], cmp_float);
    return ms[REPS / 2];
}

/* ---- the allreduce of a pool's comm ---- */
typedef struct {
    size_t max_bytes;
    size_t segment; /* the segment rank 0's comm uses (dpar_comm_query) */
    int nccl;
    double us[64][REPS];
    float *buf[64];
} ar_job;
static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static dpar_status ar_alloc(void *user, const dpar_cuda_worker *w)
{
    ar_job *j = (ar_job *)user;
    dpar_comm_desc used;
    if (w->rank == 0 && dpar_comm_query(w->comm, &used) == DPAR_OK) j->segment = used.segment_bytes;
    if (cudaMalloc((void **)&j->buf[w->rank], j->max_bytes) != cudaSuccess)
        return dpar_set_error(DPAR_ENOMEM, "cudaMalloc");
    /* on the worker's stream, finished: the legacy stream's memset would race the comm's streams */
    return cudaMemsetAsync(j->buf[w->rank], 0, j->max_bytes, (cudaStream_t)w->stream) == cudaSuccess &&
                   cudaStreamSynchronize((cudaStream_t)w->stream) == cudaSuccess
               ? DPAR_OK
               : dpar_set_error(DPAR_ESYSTEM, "memset");
}
static size_t ar_bytes;
static dpar_status ar_time(void *user, const dpar_cuda_worker *w)
{
    ar_job *j = (ar_job *)user;
    dpar_comm *c = j->nccl ? w->nccl : w->ring;
    cudaStream_t s = (cudaStream_t)w->stream;
    int rep;
    DPAR_CUDA__TRY(dpar_allreduce(c, j->buf[w->rank], j->buf[w->rank], ar_bytes / 4, DPAR_F32, DPAR_SUM)); /* warm */
    if (cudaStreamSynchronize(s) != cudaSuccess) return dpar_set_error(DPAR_ESYSTEM, "cudaStreamSynchronize");
    for (rep = 0; rep < REPS; rep++) {
        uint64_t t0;
        DPAR_CUDA__TRY(dpar_barrier(w->ring));
        t0 = dpar_time_ns();
        DPAR_CUDA__TRY(dpar_allreduce(c, j->buf[w->rank], j->buf[w->rank], ar_bytes / 4, DPAR_F32, DPAR_SUM));
        /* a stream-ordered call returns once queued: the time is the call's and its stream's, in both modes */
        if (cudaStreamSynchronize(s) != cudaSuccess) return dpar_set_error(DPAR_ESYSTEM, "cudaStreamSynchronize");
        j->us[w->rank][rep] = (double)(dpar_time_ns() - t0) / 1e3;
    }
    return DPAR_OK;
}
static dpar_status ar_free(void *user, const dpar_cuda_worker *w)
{
    cudaFree(((ar_job *)user)->buf[w->rank]);
    return DPAR_OK;
}
/* the allreduce from min_bytes to max_mib MiB (x4 each time) on a pool of `workers` workers (0: one per device, or
   2 on one device), blocking or stream-ordered; prints one line per size, then the ring step's cost t0 */
static void bench_allreduce(size_t min_bytes, size_t max_mib, int gpus, int nccl, size_t segment, int workers,
                            int ordered)
{
    dpar_cuda_pool_desc d;
    dpar_cuda_pool *p = NULL;
    ar_job *j = (ar_job *)calloc(1, sizeof *j);
    const char *mode = ordered ? "ordered" : "blocking";
    double small_us = 0;
    int N;
    memset(&d, 0, sizeof d);
    if (workers > 0 && gpus == 1) d.workers_per_device = workers;
    else if (gpus == 1 && !nccl) d.workers_per_device = 2;
    d.nccl = nccl;
    d.stream_ordered = ordered;
    d.comm.no_check = 1; /* nccl-tests' conditions: the call alone */
    d.comm.segment_bytes = segment;
    if (dpar_cuda_pool_create(&d, &p) != DPAR_OK) {
        printf("bench=allreduce transport=%s mode=%s skipped: %s\n", nccl ? "nccl" : "cuda", mode, dpar_last_error());
        free(j);
        return;
    }
    N = dpar_cuda_pool_size(p);
    j->max_bytes = max_mib << 20;
    j->nccl = nccl;
    if (dpar_cuda_pool_run(p, ar_alloc, j) == DPAR_OK)
        for (ar_bytes = min_bytes; ar_bytes <= j->max_bytes; ar_bytes *= 4) {
            double med = 0;
            int r;
            if (dpar_cuda_pool_run(p, ar_time, j) != DPAR_OK) {
                printf("bench=allreduce transport=%s mode=%s failed: %s\n", nccl ? "nccl" : "cuda", mode,
                       dpar_last_error());
                break;
            }
            for (r = 0; r < N; r++) { /* the slowest worker's median */
                qsort(j->us[r], REPS, sizeof(double), cmp_double);
                if (j->us[r][REPS / 2] > med) med = j->us[r][REPS / 2];
            }
            if (ar_bytes == min_bytes) small_us = med;
            printf("bench=allreduce transport=%s ranks=%d bytes=%zu us=%.1f busbw_GBps=%.1f", nccl ? "nccl" : "cuda", N,
                   ar_bytes, med, (double)ar_bytes / (med * 1e3) * (N > 1 ? 2.0 * (N - 1) / N : 1.0));
            if (nccl) printf("\n");
            else printf(" mode=%s segment=%zu\n", mode, j->segment);
        }
    if (!nccl && N > 1 && small_us > 0) /* the ring's 2(N-1) steps at the smallest size: the cost of one step */
        printf("bench=cuda_ring_step mode=%s ranks=%d bytes=%zu t0_us=%.2f\n", mode, N, min_bytes,
               small_us / (2.0 * (N - 1)));
    dpar_cuda_pool_run(p, ar_free, j);
    dpar_cuda_pool_destroy(p);
    free(j);
}

int main(int argc, char **argv)
{
    size_t max_mib = 256, min_kib = 1024, segment = 0, mib, n, i;
    int gpus = 0, k, a, kernels_too = 1, workers[8] = {0}, nworkers = 1, modes = 1; /* modes: 1 blocking, 2 ordered */
    float *x, *y, *z, *w;
    for (a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--segment") && a + 1 < argc) segment = (size_t)atol(argv[++a]);
        else if (!strcmp(argv[a], "--allreduce-only")) kernels_too = 0;
        else if (!strcmp(argv[a], "--min-kib") && a + 1 < argc && atol(argv[a + 1]) > 0)
            min_kib = (size_t)atol(argv[++a]);
        else if (!strcmp(argv[a], "--workers") && a + 1 < argc) { /* a list: 2,4,8 */ const char *p = argv[++a];
            char *end;
            for (nworkers = 0;;) {
                long v = strtol(p, &end, 10);
                if (end == p || v < 1 || v > 64 || nworkers == 8 || (*end && *end != ',')) {
                    fprintf(stderr, "bench_cuda: --workers wants 1 to 8 counts of 1 to 64, like 2,4,8\n");
                    return 2;
                }
                workers[nworkers++] = (int)v;
                if (!*end) break;
                p = end + 1;
            }
        } else if (!strcmp(argv[a], "--modes") && a + 1 < argc) {
            const char *m = argv[++a];
            modes = !strcmp(m, "blocking") ? 1 : !strcmp(m, "ordered") ? 2 : !strcmp(m, "blocking,ordered") ? 3 : 0;
            if (!modes) {
                fprintf(stderr, "bench_cuda: --modes wants blocking, ordered or blocking,ordered\n");
                return 2;
            }
        } else if (atol(argv[a]) > 0) max_mib = (size_t)atol(argv[a]);
        else {
            fprintf(stderr,
                    "usage: %s [max_mib] [--segment BYTES] [--allreduce-only] [--min-kib 1024] [--workers 2,4,8] "
                    "[--modes blocking,ordered]\n",
                    argv[0]);
            return 2;
        }
    }
    if (dpar_cuda_device_count(&gpus) != DPAR_OK || gpus == 0) {
        printf("bench_cuda: skipped: no usable CUDA device (%s)\n", dpar_last_error());
        return 0;
    }
    n = max_mib << 18; /* floats */
    if (cudaMalloc((void **)&x, n * 4) != cudaSuccess || cudaMalloc((void **)&y, n * 4) != cudaSuccess ||
        cudaMalloc((void **)&z, n * 4) != cudaSuccess || cudaMalloc((void **)&w, n * 4) != cudaSuccess) {
        printf("bench_cuda: cannot allocate 4 x %zu MiB\n", max_mib);
        return 1;
    }
    for (i = 0; i < 4; i++) cudaMemset(i == 0 ? x : i == 1 ? y : i == 2 ? z : w, 0, n * 4);
    for (mib = 1; kernels_too && mib <= max_mib; mib *= 4) {
        size_t count = mib << 18;
        double bytes = (double)count * 4, copy = 2 * bytes / (time_ms(-1, x, y, z, w, count) * 1e6);
        for (k = 0; k < (int)(sizeof kernels / sizeof kernels[0]); k++) {
            double gbps = kernels[k].traffic * bytes / (time_ms(k, x, y, z, w, count) * 1e6);
            printf("bench=cuda_kernel name=%s bytes=%.0f GBps=%.1f memcpy_GBps=%.1f ratio=%.2f\n", kernels[k].name,
                   bytes, gbps, copy, gbps / copy);
        }
    }
    cudaFree(x), cudaFree(y), cudaFree(z), cudaFree(w);
    for (k = 0; k < nworkers; k++) {
        if (modes & 1) bench_allreduce(min_kib << 10, max_mib, gpus, 0, segment, workers[k], 0);
        if (modes & 2) bench_allreduce(min_kib << 10, max_mib, gpus, 0, segment, workers[k], 1);
    }
#ifdef DPAR_NCCL
    bench_allreduce(min_kib << 10, max_mib, gpus, 1, segment, 0, 0);
#else
    printf("bench=allreduce transport=nccl skipped: built without DPAR_NCCL\n");
#endif
    return 0;
}
