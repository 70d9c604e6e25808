/* dpar_cuda.h - dpar's GPU part: devices, kernels, a GPU worker pool, the communicator on device
   buffers (dpar.h's ring, or NCCL).  v0.3.0

   USE
     Plain C or C++ includes "dpar_cuda.h" for the declarations (it includes dpar.h). Exactly one
     .cu file of the program compiles the implementation with nvcc:

         #define DPAR_IMPLEMENTATION        (unless another file already has it)
         #define DPAR_CUDA_IMPLEMENTATION
         #include "dpar_cuda.h"

         nvcc -O2 -I. my_kernels.cu -c    and link with -lcublas (nvcc links -lcudart by default)

   WHAT IS HERE (v0.3)
     - device count and properties, with CUDA errors mapped to dpar_status and the CUDA call, CUDA's
       error name and its text in dpar_last_error();
     - >>kernels: fill, scale, axpy, add; reduce and divide of F32/BF16/F16 with dpar's ops (bitwise the
       CPU's dpar reductions); casts between f32, bf16 and f16; SGD with momentum and AdamW (the math of
       dpar_zero_step); bias add and its gradient, ReLU forward/backward, softmax cross-entropy forward/backward;
       dpar_cuda_sgemm (row-major over cuBLAS). Each launcher enqueues on the stream given and has a
       naive host reference `..._ref` beside it, which the tests compare with;
     - >>cuda_pool: GPU workers (dpar_cuda_pool_create / _run / _destroy): one host thread per worker,
       each owning a device, a non-blocking stream, a cuBLAS handle and device scratch; several workers
       may share a device; SPMD runs whose CUDA errors (a fault on the worker's stream included) come
       back as the run's status, naming the worker, its device and CUDA's error name; tasks bound to a
       worker (dpar_cuda_task_submit / _wait / _wait_all), dependencies across workers carried by CUDA
       events, failures propagated by dpar's task graph;
     - the pool's comm (worker->comm): dpar.h's whole comm API on device buffers, its ring driven through
       dpar_comm_memory with this header's kernels and peer copies (paths AUTO/PEER/MEMCPY/HOST); a worker
       whose run fails poisons it;
     - >>nccl (DPAR_NCCL): comms whose collectives NCCL runs, with dpar's front end and contract checker:
       over a pool (ncclCommInitAll), across processes and machines (the id broadcast over an MPI comm),
       or over an ncclComm_t of yours.
   HOW THE KERNELS ARE BUILT (and verified without a GPU)
     Each kernel's per-element work is a __host__ __device__ function (dpar_cuda__<kernel>_elem); a
     small functor applies it to element i (`one`) or to W aligned elements loaded as one 16-byte vector
     (`vec`, the same element function per lane; buffers that share their offset from a 16-byte boundary
     take their first elements one by one, then vectors); dpar_cuda__stride(k, thread, threads) is the whole
     grid-stride loop, and the __global__ wrapper only calls it with its global thread index. A host
     test (tests/test_cuda_host.cu) calls the same dpar_cuda__stride for every thread of simulated
     grids and compares with the references. Floating-point steps go through dpar_cuda__fadd/fmul/...:
     on the device the _rn intrinsics, so nvcc cannot fuse a multiply and an add, and the device gives
     the host's bits (expf/logf excepted: CUDA's are within 2 ulp of glibc's, see the softmax kernels;
     and a computed NaN is the GPU's canonical one).
   See docs/cuda.md; examples/cuda_data_parallel.cu is a whole trainer.

   LINKING
     The implementation calls cuBLAS (dpar_cuda_sgemm): link the program with -lcublas (nvcc adds
     -lcudart itself); with DPAR_NCCL also -lnccl.

   OPTIONS
     DPAR_CUDA_IMPLEMENTATION   emit the implementation (nvcc only)
     DPAR_NCCL                  the NCCL comms (nccl.h; link -lnccl); without it those calls return
                                DPAR_EUNSUPPORTED
     DPAR_CUDA_SEGMENT_BYTES    the pool comm's ring segment when dpar_cuda_pool_desc.comm.segment_bytes is
                                0 (default 64 MiB: each segment costs a launch and a stream synchronisation)
     DPAR_CUDA_ORDERED_SEGMENT_BYTES   the same for a stream-ordered pool (default 4 MiB: a launch per segment, no
                                synchronisation, segments overlapping across the workers' streams)

   THREAD SAFETY
     Every function may be called from any thread; kernels run on the stream given.
*/
#ifndef DPAR_CUDA_H_INCLUDED
#define DPAR_CUDA_H_INCLUDED

#include "dpar.h"

#define DPAR_CUDA_VERSION "0.3.0"

#ifdef __cplusplus
extern "C" {
#endif

/* dpar_cuda_device_info: what dpar_cuda_device_query reports about one device. */
typedef struct dpar_cuda_device_info {
    int device;
    char name[256];
    size_t total_bytes; /* global memory */
    int major, minor;   /* compute capability */
    int multiprocessors;
} dpar_cuda_device_info;

/* dpar_cuda_device_count: the number of visible devices.
   Returns:  DPAR_OK (also without a driver or device: *count = 0, the reason in dpar_last_error, so callers can
             skip GPU work); DPAR_EINVAL (NULL count), DPAR_ESYSTEM (another CUDA error, its text in
             dpar_last_error).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_device_count(int *count);

/* dpar_cuda_device_query: the properties of one device.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL info, a device outside 0..count-1), DPAR_ESYSTEM (a CUDA error).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_device_query(int device, dpar_cuda_device_info *info);

/* dpar_cuda_axpy_f32: y[i] += alpha * x[i] for i < n, on device memory, enqueued on `stream`.
   stream:   a cudaStream_t; NULL for the default stream. The call returns at once: synchronise the stream.
   Returns:  DPAR_OK (n = 0 too); DPAR_EINVAL (NULL y or x), DPAR_ESYSTEM (the launch failed).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_axpy_f32(float *y, const float *x, float alpha, size_t n, void *stream);

/* dpar_cuda_axpy_f32_ref: the naive host reference of dpar_cuda_axpy_f32.
   Thread safety: any thread. */
DPAR_API void dpar_cuda_axpy_f32_ref(float *y, const float *x, float alpha, size_t n);

/* >>kernels: the declarations. Every launcher enqueues on `stream` (a cudaStream_t; NULL: the default
   stream) and returns at once; pointers are device memory; n = 0 is DPAR_OK and launches nothing.
   Bits:     the kernels give the references' bits (no fused multiply-add on the device; NaN payloads aside),
             except softmax cross-entropy (CUDA's expf/logf) and sgemm (cuBLAS's order). This assumes nvcc's
             default IEEE mode: -use_fast_math or -ftz=true flushes subnormals and approximates expf.
   Errors:   DPAR_EINVAL (a NULL pointer with n > 0, a value outside its enum, a bad size), DPAR_EUNSUPPORTED (a
             dpar dtype the kernel does not have), DPAR_ESYSTEM (the launch failed: the CUDA call, CUDA's
             error name and text in dpar_last_error).
   Vectors:  a kernel moves 16 bytes at a time (4 floats, 8 bf16/f16; 4 elements of each side of a cast between
             f32 and a 16-bit type) where every buffer it touches is aligned to that, else one element at a
             time; the results are the same.
   References: each `..._ref` is the naive host loop of its kernel, plain C on host memory; the tests compare
             kernel and reference. */

/* dpar_cuda_fill_f32: y[i] = value for i < n.
   Returns:  as the section says.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_fill_f32(float *y, float value, size_t n, void *stream);
DPAR_API void dpar_cuda_fill_f32_ref(float *y, float value, size_t n);

/* dpar_cuda_scale_f32: y[i] *= alpha for i < n.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_scale_f32(float *y, float alpha, size_t n, void *stream);
DPAR_API void dpar_cuda_scale_f32_ref(float *y, float alpha, size_t n);

/* dpar_cuda_add_f32: out[i] = a[i] + b[i] for i < n; out may be a or b.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_add_f32(float *out, const float *a, const float *b, size_t n, void *stream);
DPAR_API void dpar_cuda_add_f32_ref(float *out, const float *a, const float *b, size_t n);

/* dpar_cuda_reduce: out[i] = a[i] op b[i], then / div when op is DPAR_AVG and div > 1: the local step of
   dpar's reductions, on the device.
   dtype:    every dpar_dtype, bitwise what dpar.h's CPU reductions give: 16-bit floats are widened to float,
             combined, and rounded to nearest even; f32 and f64 combine in their own type; integers wrap (sum and
             product) and the average truncates (divided in int or wider: div may be any group size). A NaN result
             is a NaN there too, but its payload may differ, as the GPU's float arithmetic returns one canonical NaN.
   out:      may be a or b.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL pointers, a bad op or dtype), DPAR_ESYSTEM.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_reduce(void *out, const void *a, const void *b, size_t n, dpar_dtype dtype, dpar_op op,
                                      int div, void *stream);
DPAR_API void dpar_cuda_reduce_ref(void *out, const void *a, const void *b, size_t n, dpar_dtype dtype, dpar_op op,
                                   int div);

/* dpar_cuda_divide: out[i] = in[i] / div (div <= 1: a copy); out may be in. Every dpar_dtype, as dpar_cuda_reduce
   (integers: C's truncating division).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_divide(void *out, const void *in, size_t n, dpar_dtype dtype, int div, void *stream);
DPAR_API void dpar_cuda_divide_ref(void *out, const void *in, size_t n, dpar_dtype dtype, int div);

/* dpar_cuda_cast: out[i] = in[i] converted, between DPAR_F32, DPAR_BF16 and DPAR_F16 (any pair; 16-bit to
   16-bit goes through float). Rounding: to nearest even, as dpar_f32_to_bf16 / dpar_f32_to_f16.
   out, in:  must not overlap (unless the same buffer with the same dtype).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_cast(void *out, dpar_dtype out_dtype, const void *in, dpar_dtype in_dtype, size_t n,
                                    void *stream);
DPAR_API void dpar_cuda_cast_ref(void *out, dpar_dtype out_dtype, const void *in, dpar_dtype in_dtype, size_t n);

/* dpar_cuda_sgd_f32: one SGD step with momentum, dpar_zero_step's math:
       g' = g + weight_decay p;  m = momentum m + g';  p -= lr m      (momentum 0: plain SGD; m is still written)
   params, mom: n floats each, updated; grads: n floats.
   Remarks:  every float operation is rounded on its own (no fused multiply-add), so the device gives the
             bits of dpar_zero_step on one rank.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_sgd_f32(float *params, float *mom, const float *grads, size_t n, float lr,
                                       float momentum, float weight_decay, void *stream);
DPAR_API void dpar_cuda_sgd_f32_ref(float *params, float *mom, const float *grads, size_t n, float lr, float momentum,
                                    float weight_decay);

/* dpar_cuda_adamw_f32: one AdamW step, dpar_zero_step's math (step t counts from 1):
       m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g;
       p -= lr ((m / c1) / (sqrt(v / c2) + eps) + weight_decay p),  c1 = 1 - b1^t, c2 = 1 - b2^t (powf, on the host)
   params, m, v: n floats each, updated; grads: n floats.
   Returns:  as the section says; DPAR_EINVAL for step < 1.
   Remarks:  no fused multiply-add, correctly rounded division and square root: the device gives the bits of
             dpar_zero_step on one rank.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_adamw_f32(float *params, float *m, float *v, const float *grads, size_t n, float lr,
                                         float beta1, float beta2, float eps, float weight_decay, long step,
                                         void *stream);
DPAR_API void dpar_cuda_adamw_f32_ref(float *params, float *m, float *v, const float *grads, size_t n, float lr,
                                      float beta1, float beta2, float eps, float weight_decay, long step);

/* dpar_cuda_bias_add_f32: y (rows x cols, row-major) += bias (cols) on every row.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_bias_add_f32(float *y, const float *bias, size_t rows, size_t cols, void *stream);
DPAR_API void dpar_cuda_bias_add_f32_ref(float *y, const float *bias, size_t rows, size_t cols);

/* dpar_cuda_bias_backward_f32: dbias (cols) = the column sums of dy (rows x cols, row-major): the bias gradient.
   Remarks:  one thread per column, rows added in order (as examples/data_parallel.c adds them, so bitwise the
             same); adjacent threads read adjacent columns.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_bias_backward_f32(float *dbias, const float *dy, size_t rows, size_t cols, void *stream);
DPAR_API void dpar_cuda_bias_backward_f32_ref(float *dbias, const float *dy, size_t rows, size_t cols);

/* dpar_cuda_relu_forward_f32 / dpar_cuda_relu_backward_f32: y = x > 0 ? x : 0 (NaN stays NaN; -0 gives +0);
   dx = y > 0 ? dy : 0, y the forward's output (or its input: the same sign). y may be x, dx may be dy.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_relu_forward_f32(float *y, const float *x, size_t n, void *stream);
DPAR_API void dpar_cuda_relu_forward_f32_ref(float *y, const float *x, size_t n);
DPAR_API dpar_status dpar_cuda_relu_backward_f32(float *dx, const float *dy, const float *y, size_t n, void *stream);
DPAR_API void dpar_cuda_relu_backward_f32_ref(float *dx, const float *dy, const float *y, size_t n);

/* dpar_cuda_softmax_xent_forward_f32 / _backward_f32: softmax cross-entropy over rows of `classes` logits, as
   examples/data_parallel.c computes it:
       loss[r] = log(sum_c exp(z[r,c] - max_r)) - (z[r,label[r]] - max_r)                (rows)
       dlogits[r,c] = (exp(z[r,c] - max_r) / sum_r - (c == label[r])) / rows            (rows x classes)
   The mean loss is the mean of loss[]; dlogits is the gradient of that mean.
   labels:   rows ints in 0..classes-1; a row with another label gets NaN (loss and gradient).
   Remarks:  one thread per row (classes is small in the trainers here); expf and logf are CUDA's, within 2 ulp
             of glibc's, so the device matches the reference to a relative 1e-5 (plus 4e-7 absolute), not bitwise.
   Returns:  as the section says; DPAR_EINVAL for classes < 1.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_softmax_xent_forward_f32(float *loss, const float *logits, const int *labels,
                                                        size_t rows, int classes, void *stream);
DPAR_API void dpar_cuda_softmax_xent_forward_f32_ref(float *loss, const float *logits, const int *labels, size_t rows,
                                                     int classes);
DPAR_API dpar_status dpar_cuda_softmax_xent_backward_f32(float *dlogits, const float *logits, const int *labels,
                                                         size_t rows, int classes, void *stream);
DPAR_API void dpar_cuda_softmax_xent_backward_f32_ref(float *dlogits, const float *logits, const int *labels,
                                                      size_t rows, int classes);

/* dpar_cuda_sgemm: dpar_sgemm on device memory through cuBLAS: row-major, C (M x N) = alpha op(A) op(B) + beta C.
   cublas:   a cublasHandle_t (required); its stream is set to `stream`.
   Remarks:  row-major is column-major transposed, so it calls cublasSgemm(B, A) with N and M swapped. The
             reference is dpar_sgemm_ref. cuBLAS may use TF32 only if the handle's math mode allows it (the
             default does not).
   Returns:  DPAR_OK (M, N or K zero too: C = beta C when K = 0); DPAR_EINVAL (as dpar_sgemm, a NULL handle),
             DPAR_ESYSTEM (cuBLAS's status name in dpar_last_error).
   Thread safety: any thread, one handle per thread. */
DPAR_API dpar_status dpar_cuda_sgemm(dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha, const float *A,
                                     int lda, const float *B, int ldb, float beta, float *C, int ldc, void *cublas,
                                     void *stream);

/* ============================================================================================== */
/* >>cuda_pool: GPU workers: one host thread per worker, each owning a device, a stream, cuBLAS    */
/* ============================================================================================== */
/* dpar_cuda_pool: GPU workers. Worker r is a host thread that owns one device, one non-blocking stream,
   one cuBLAS handle (bound to that stream) and optional device scratch memory. Several workers may share
   a device (workers_per_device), so multi-rank code runs on a single GPU.
   Workers:  rank r uses devices[r / workers_per_device] (the devices in the desc's order).
   Errors:   a CUDA error in a run (a failed call, or a kernel fault that sticks to the context) becomes the
             run's status, naming the worker, its device and CUDA's error name.
   Comm:     worker->comm is rank r of a dpar_comm over the pool's workers whose buffers are device memory: every
             call of dpar.h's comm API (collectives, point-to-point, async requests, split, mesh) on pointers from
             cudaMalloc. dpar.h's ring drives it; the reductions and copies run as this header's kernels on the
             worker's comm_stream. A call first waits for the worker's `stream` (the work that wrote its inputs),
             and returns with its results complete; in a stream-ordered pool (desc.stream_ordered) it queues its
             work on the worker's `stream` instead and returns at once, as ncclAllReduce does. It waits for that
             stream only: `stream` is non-blocking, so inputs written on the legacy default stream (or another of
             yours) race with the call unless you order them (cudaStreamWaitEvent). A worker whose run fails
             poisons the comm with its error, so the others return from their calls instead of waiting; the poison
             stays: destroy the pool and make a new one, except after a sticky fault (an illegal address, a
             kernel's trap): the device's CUDA context is then unusable for the rest of the process, which must
             end. Peer access does not cover memory from
             cudaMallocAsync pools (cudaMemPoolSetAccess; docs/cuda.md, 'Collectives on device buffers').
   See:      docs/cuda.md, 'The GPU pool' and 'Collectives on device buffers'. */
typedef struct dpar_cuda_pool dpar_cuda_pool;

/* dpar_cuda_worker: what a worker owns, as its run function sees it. */
typedef struct dpar_cuda_worker {
    int rank, size;       /* this worker, 0..size-1, and the pool's workers */
    int device;           /* the CUDA device it owns (current on its thread during a run) */
    void *stream;         /* its cudaStream_t, non-blocking */
    void *cublas;         /* its cublasHandle_t, bound to the stream */
    void *scratch;        /* scratch_bytes of device memory (NULL when 0) */
    size_t scratch_bytes; /* as in the desc */
    dpar_comm *comm;      /* rank `rank` of the pool's comm over its workers, on device buffers: nccl when the pool
                             has one, else ring */
    void *comm_stream;    /* the cudaStream_t the ring comm's kernels and copies run on (NCCL's calls go on `stream`) */
    dpar_comm *ring;      /* the comm of dpar.h's ring over the workers (see dpar_cuda_path) */
    dpar_comm *nccl;      /* the comm over NCCL (dpar_cuda_pool_desc.nccl), or NULL */
} dpar_cuda_worker;

/* dpar_cuda_path: how the pool's comm moves the bytes of one worker to another. Every path gives the same bits.
     AUTO    PEER between workers of one device or of devices with peer access, MEMCPY between the others
     PEER    kernels read the peer's buffer directly (cudaDeviceCanAccessPeer; peer access is enabled at create);
             dpar_cuda_pool_create fails with DPAR_EUNSUPPORTED where two devices cannot reach each other
     MEMCPY  the peer's bytes are first copied into this worker's memory (cudaMemcpyPeerAsync between devices)
     HOST    every copy goes through this worker's pinned host buffer (device to host, then host to device): for
             devices that cannot reach each other at all, and to test the path on one GPU */
typedef enum dpar_cuda_path {
    DPAR_CUDA_PATH_AUTO = 0,
    DPAR_CUDA_PATH_PEER,
    DPAR_CUDA_PATH_MEMCPY,
    DPAR_CUDA_PATH_HOST
} dpar_cuda_path;

/* dpar_cuda_pool_desc: how to make a GPU pool; a zero field means its default. */
typedef struct dpar_cuda_pool_desc {
    const int *devices;       /* the devices to use, num_devices of them (may repeat); NULL: every visible one */
    int num_devices;          /* with devices: how many; 0 with NULL devices */
    int workers_per_device;   /* 0: 1; 2 or more share each device between ranks */
    size_t scratch_bytes;     /* device scratch per worker (0: none) */
    const char *name;         /* prefix of the trace tracks and the comm's name (copied; default "gpu") */
    dpar_allocator allocator; /* the pool's host memory (zero: malloc/free) */
    dpar_comm_desc comm;      /* the workers' comm: timeout, checks, deterministic, name...; size 0 or the number of
                                 workers, memory zero (the pool's); segment_bytes 0: 64 MiB */
    dpar_cuda_path path;      /* how the ring comm moves bytes between workers (0: AUTO) */
    int nccl;                 /* 1: also make an NCCL comm over the workers (ncclCommInitAll; one worker per device;
                                 the implementation built with DPAR_NCCL), which worker->comm then is */
    int stream_ordered;       /* 1: the ring comm's calls queue their work on the worker's stream (or the one that
                                 dpar_cuda_comm_set_stream names) and return without waiting for the device, the
                                 workers' streams ordered by events, as NCCL's calls are; 0 (the default until this
                                 mode has run on a GPU): each call waits for the worker's stream and returns with its
                                 results complete. docs/cuda.md, 'Stream-ordered calls' */
} dpar_cuda_pool_desc;

/* dpar_cuda_pool_run_fn: the body of a run: worker `worker->rank` of `worker->size`, on its own thread
   with its device current. Return DPAR_OK or an error (dpar_set_error gives it a text). */
typedef dpar_status (*dpar_cuda_pool_run_fn)(void *user, const dpar_cuda_worker *worker);

/* dpar_cuda_pool_create: start the workers: a host thread each, its stream, cuBLAS handle and scratch.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL out, a negative count, devices without num_devices or the reverse, a
             device outside 0..count-1, half an allocator, a bad path or comm desc), DPAR_EUNSUPPORTED (no usable CUDA
             device: CUDA's reason in dpar_last_error; path PEER between devices that cannot reach each other; nccl
             without DPAR_NCCL or with several workers per device), DPAR_ERANGE (more than DPAR_MAX_THREADS
             workers), DPAR_ENOMEM, DPAR_ESYSTEM (a CUDA, cuBLAS or NCCL call failed, or a thread could not start). On
             error *out is NULL.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_pool_create(const dpar_cuda_pool_desc *desc, dpar_cuda_pool **out);

/* dpar_cuda_pool_destroy: wait for the workers' streams, free what they own, join the threads.
   Returns:  DPAR_OK (also for NULL); DPAR_ESYSTEM (a CUDA call failed; everything is freed all the same),
             DPAR_EBUSY (called from one of the pool's workers: nothing is done).
   Thread safety: one thread, with no run of this pool in flight. */
DPAR_API dpar_status dpar_cuda_pool_destroy(dpar_cuda_pool *pool);

/* dpar_cuda_pool_size: the number of workers (0 for NULL).
   Thread safety: any thread. */
DPAR_API int dpar_cuda_pool_size(const dpar_cuda_pool *pool);

/* dpar_cuda_pool_worker: what worker `rank` owns (for work enqueued from outside a run).
   Returns:  DPAR_OK; DPAR_EINVAL (NULL pool or out, rank outside 0..size-1).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_cuda_pool_worker(const dpar_cuda_pool *pool, int rank, dpar_cuda_worker *out);

/* dpar_cuda_comm_set_stream: in a stream-ordered pool, the stream on which worker `rank`'s ring comm queues its work
   (NULL: the worker's own stream, the default). A call comes after the work already queued there and before the
   work queued after it; work on other streams is ordered by the caller's events (cudaEventRecord and
   cudaStreamWaitEvent), as with ncclAllReduce's stream: a comm stream beside the compute stream lets gradients
   travel while backward goes on. The setting lasts until the end of the run (dpar_cuda_pool_run): the run's end
   waits for this stream as for the worker's own (a fault on it is the run's error) and goes back to the worker's
   stream, so a stream destroyed after the run is never used again. The stream must be on the worker's device.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL pool, rank outside 0..size-1, cudaStreamLegacy or cudaStreamPerThread, a
             stream of another device: checked with CUDA 12.8 or later); DPAR_ESTATE (the pool is not stream-ordered).
   Thread safety: worker `rank`'s thread (or one thread acting for it), between its comm calls, none of its
             requests (dpar_iallreduce, buckets) in flight: their work may still be queued on the old stream. */
DPAR_API dpar_status dpar_cuda_comm_set_stream(dpar_cuda_pool *pool, int rank, void *stream);

/* dpar_cuda_comm_sync: wait until worker `rank`'s comm stream has run what is queued on it, within the comm's
   timeout, and report what it found there: a queued kernel or copy that failed, or a stream still running at the
   deadline (a peer's stream it waits for is stuck, or the peer never made its call). Either poisons the comm
   (dpar_comm_fail), so every worker's next call returns the error: ncclCommGetAsyncError and ncclCommAbort in one.
   In a pool that is not stream-ordered, the comm's own stream.
   Returns:  DPAR_OK; DPAR_ESYSTEM (a CUDA error, named with the worker, its device and CUDA's error name),
             DPAR_ETIMEDOUT, DPAR_EINVAL (NULL pool, rank outside 0..size-1).
   Thread safety: worker `rank`'s thread (or one thread acting for it); the calling thread's current device is the
             same after the call as before. */
DPAR_API dpar_status dpar_cuda_comm_sync(dpar_cuda_pool *pool, int rank);

/* dpar_cuda_pool_run: run fn on every worker at once (SPMD), each on its thread with its device current,
   and wait for all, their streams included.
   Returns:  the error of the lowest-numbered failing worker (its text in dpar_last_error): fn's status, or
             DPAR_ESYSTEM when a CUDA error shows after fn (a failed launch or a fault on the worker's stream,
             named with the worker, its device and CUDA's error name); DPAR_EINVAL (NULL pool or fn),
             DPAR_EBUSY (from one of the pool's workers).
   Thread safety: any thread; concurrent callers take turns. */
DPAR_API dpar_status dpar_cuda_pool_run(dpar_cuda_pool *pool, dpar_cuda_pool_run_fn fn, void *user);

/* dpar_cuda_task: a task bound to a worker: its function enqueues work on that worker's stream, after the
   device work of its dependencies, which may be on other workers (carried by CUDA events: the host does not
   wait for the device). Built on the pool's dpar task graph: a task that fails (returns an error, or a CUDA
   error shows after it) cancels every task that depends on it, and waiting on those returns its status.
   Tasks of one worker enqueue one at a time (they share its stream and cuBLAS handle). Handles stay valid until
   dpar_cuda_task_wait_all returns; wait for all tasks before a dpar_cuda_pool_run of the same pool. */
typedef uint64_t dpar_cuda_task;

/* dpar_cuda_task_fn: enqueue the task's work on worker->stream (the worker's device is current). */
typedef dpar_status (*dpar_cuda_task_fn)(void *user, const dpar_cuda_worker *worker);

/* dpar_cuda_task_desc: a task; a zero field means its default. */
typedef struct dpar_cuda_task_desc {
    dpar_cuda_task_fn fn;       /* required */
    void *user;                 /* passed to fn */
    int worker;                 /* the worker whose stream the work goes on, 0..size-1 */
    const dpar_cuda_task *deps; /* tasks whose device work must be done first (num_deps of them) */
    int num_deps;
    const char *name; /* trace event name; not copied (default "task") */
} dpar_cuda_task_desc;

/* dpar_cuda_task_submit: add a task. *out (may be NULL) gets its handle.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL pool or desc or fn, a worker outside 0..size-1, a dependency that is not a
             live task of this pool), DPAR_ENOMEM; the task graph's codes (dpar_task_submit).
   Thread safety: any thread, tasks too. */
DPAR_API dpar_status dpar_cuda_task_submit(dpar_cuda_pool *pool, const dpar_cuda_task_desc *desc, dpar_cuda_task *out);

/* dpar_cuda_task_wait: wait until the task has run on the host and its device work is done.
   Returns:  the task's status (a cancelled task: the failed dependency's); DPAR_ESYSTEM for a CUDA error of its
             device work; DPAR_EINVAL (NULL pool, a handle that is not a live task).
   Thread safety: any thread outside the task itself. */
DPAR_API dpar_status dpar_cuda_task_wait(dpar_cuda_pool *pool, dpar_cuda_task task);

/* dpar_cuda_task_wait_all: wait for every task and every worker's stream, then end the epoch: all handles become
   invalid and their records are freed.
   Returns:  the status of the first task that failed (in submission order), or a CUDA error; DPAR_OK.
   Thread safety: any thread outside the pool's tasks. */
DPAR_API dpar_status dpar_cuda_task_wait_all(dpar_cuda_pool *pool);

/* ============================================================================================== */
/* >>nccl: dpar comms whose collectives NCCL runs (define DPAR_NCCL where the implementation is built; -lnccl) */
/* ============================================================================================== */
/* An NCCL comm is a dpar_comm (dpar_comm_from_ops): the same collectives, dtypes and ops as every comm, on device
   buffers, with dpar's contract checker (each call's fingerprint is allgathered through NCCL first: one small
   ncclAllGather per call; no_check turns it off), counters, trace spans and async requests. Each call is enqueued on
   the comm's stream, after the work already there, and returns when it is done; the wait polls NCCL's errors and the
   comm's timeout (then ncclCommAbort and DPAR_ETIMEDOUT: NCCL does not say which rank is missing). AVG is ncclAvg
   (NCCL 2.10 and later; its float rounding is not dpar's: docs/cuda.md, 'NCCL'), before that NCCL's sum, then
   dpar_cuda_divide by N; reduce_scatter and allgather of counts that N does not divide use
   dpar's uneven blocks (grouped ncclReduce / ncclBroadcast). Point-to-point calls and dpar_comm_split return
   DPAR_EUNSUPPORTED. Without DPAR_NCCL these calls return DPAR_EUNSUPPORTED.
   See:      docs/cuda.md, 'NCCL'. */

/* dpar_cuda_comm_from_nccl: a dpar_comm over an existing ncclComm_t (not owned: destroy the dpar_comm first, then
   your ncclComm_t); calls run on `stream` (a cudaStream_t; NULL: the legacy default stream). After a call that timed
   out or failed in NCCL, the dpar_comm makes no more NCCL calls: abort your ncclComm_t (ncclCommAbort).
   Returns:  DPAR_OK; DPAR_EINVAL (NULL nccl_comm or out, a bad desc), DPAR_EUNSUPPORTED (built without DPAR_NCCL),
             DPAR_ESYSTEM (an NCCL query failed), DPAR_ENOMEM.
   Thread safety: any thread; the comm then belongs to one thread at a time. */
DPAR_API dpar_status dpar_cuda_comm_from_nccl(void *nccl_comm, void *stream, const dpar_comm_desc *desc,
                                              dpar_comm **out);

/* dpar_cuda_nccl_desc: an NCCL comm made by the ranks of a host comm; a zero field means its default. */
typedef struct dpar_cuda_nccl_desc {
    dpar_comm *host;     /* required: a comm on host memory (MPI processes, thread ranks): its rank r makes rank r */
    int device;          /* this rank's CUDA device */
    void *stream;        /* the cudaStream_t the calls run on (give the one your work is on); NULL: a blocking stream
                            the comm makes and owns, which follows work on the legacy default stream */
    dpar_comm_desc comm; /* the new comm's options (name 0: "nccl") */
} dpar_cuda_nccl_desc;

/* dpar_cuda_nccl_create: collective over desc->host: its rank 0 makes an NCCL unique id, broadcasts it over host,
   and every rank joins with ncclCommInitRank on its device (after every rank has said over host that its device is
   ready: a rank that fails before does not leave the others waiting in NCCL). The new comm owns the NCCL comm
   (destroyed with it; aborted instead after a failed or timed-out call). Across machines: make host with
   dpar_comm_from_mpi, one process per GPU, started by mpirun.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL desc, host or out), DPAR_EUNSUPPORTED (built without DPAR_NCCL), DPAR_ESYSTEM
             (a CUDA or NCCL call failed, rank 0's included), host's errors. On error *out is NULL.
   Thread safety: host's thread. */
DPAR_API dpar_status dpar_cuda_nccl_create(const dpar_cuda_nccl_desc *desc, dpar_comm **out);

#ifdef __cplusplus
}
#endif
#endif /* DPAR_CUDA_H_INCLUDED */

#if defined(DPAR_CUDA_IMPLEMENTATION) && !defined(DPAR_CUDA__IMPLEMENTATION_DONE)
#define DPAR_CUDA__IMPLEMENTATION_DONE
#ifndef __CUDACC__
#error "dpar_cuda.h: DPAR_CUDA_IMPLEMENTATION needs nvcc: put it in a .cu file"
#endif
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* a CUDA error: "what: call: cudaErrorX (code): text" */
static dpar_status dpar_cuda__check(cudaError_t e, const char *what, const char *call)
{
    if (e == cudaSuccess) return DPAR_OK;
    return dpar_set_error(DPAR_ESYSTEM, "%s: %s: %s (%d): %s", what, call, cudaGetErrorName(e), (int)e,
                          cudaGetErrorString(e));
}

/* the calling thread's current device, put back when this goes out of scope (calls that may run on any thread) */
struct dpar_cuda__device_kept {
    int before;
    dpar_cuda__device_kept() : before(-1) { cudaGetDevice(&before); }
    ~dpar_cuda__device_kept()
    {
        if (before >= 0) cudaSetDevice(before);
    }
};

extern "C" DPAR_API dpar_status dpar_cuda_device_count(int *count)
{
    cudaError_t e;
    if (!count) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_device_count: count is NULL");
    *count = 0;
    e = cudaGetDeviceCount(count);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorDevicesUnavailable) {
        *count = 0;
        dpar_set_error(DPAR_OK, "dpar_cuda_device_count: no usable device: %s: %s", cudaGetErrorName(e),
                       cudaGetErrorString(e));
        (void)cudaGetLastError(); /* clear the sticky error */
        return DPAR_OK;
    }
    return dpar_cuda__check(e, "dpar_cuda_device_count", "cudaGetDeviceCount");
}

extern "C" DPAR_API dpar_status dpar_cuda_device_query(int device, dpar_cuda_device_info *info)
{
    cudaDeviceProp prop;
    int n = 0;
    dpar_status st;
    if (!info) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_device_query: info is NULL");
    if ((st = dpar_cuda_device_count(&n)) != DPAR_OK) return st;
    if (device < 0 || device >= n)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_device_query: device %d is not in 0..%d", device, n - 1);
    if ((st = dpar_cuda__check(cudaGetDeviceProperties(&prop, device), "dpar_cuda_device_query",
                               "cudaGetDeviceProperties")) != DPAR_OK)
        return st;
    memset(info, 0, sizeof *info);
    info->device = device;
    snprintf(info->name, sizeof info->name, "%s", prop.name);
    info->total_bytes = prop.totalGlobalMem;
    info->major = prop.major;
    info->minor = prop.minor;
    info->multiprocessors = prop.multiProcessorCount;
    return DPAR_OK;
}

/* >>kernels: element functions, the grid-stride loop, the launchers, the references -------------- */
#define DPAR_CUDA__HD __host__ __device__ static inline
#define DPAR_CUDA__TRY(expr)            \
    do {                                \
        dpar_status st_ = (expr);       \
        if (st_ != DPAR_OK) return st_; \
    } while (0)

/* Each float step rounded on its own: on the device the _rn intrinsics, which nvcc never fuses into a
   multiply-add (it would fuse a * b + c), so device and host give the same bits. */
DPAR_CUDA__HD float dpar_cuda__fadd(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
DPAR_CUDA__HD float dpar_cuda__fsub(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
DPAR_CUDA__HD float dpar_cuda__fmul(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
DPAR_CUDA__HD float dpar_cuda__fdiv(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
DPAR_CUDA__HD float dpar_cuda__fsqrt(float a)
{
#ifdef __CUDA_ARCH__
    return __fsqrt_rn(a);
#else
    return sqrtf(a);
#endif
}
DPAR_CUDA__HD uint32_t dpar_cuda__bits(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}
DPAR_CUDA__HD float dpar_cuda__float(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* ---- bf16 / f16, as dpar.h's dpar_bf16_to_f32 ... dpar_f32_to_f16 (the host test checks every pattern) ---- */
DPAR_CUDA__HD float dpar_cuda__bf16_to_f32(uint16_t h) { return dpar_cuda__float((uint32_t)h << 16); }
DPAR_CUDA__HD uint16_t dpar_cuda__f32_to_bf16(float f)
{
    uint32_t u = dpar_cuda__bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* to nearest even */
    return (uint16_t)(u >> 16);
}
DPAR_CUDA__HD float dpar_cuda__f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        if (m == 0) return dpar_cuda__float(sign);
        e = 113; /* subnormal: normalise */
        while (!(m & 0x400u)) {
            m <<= 1;
            e--;
        }
        return dpar_cuda__float(sign | (e << 23) | ((m & 0x3ffu) << 13));
    }
    if (e == 31) return dpar_cuda__float(sign | 0x7f800000u | (m << 13));
    return dpar_cuda__float(sign | ((e + 112) << 23) | (m << 13));
}
DPAR_CUDA__HD uint16_t dpar_cuda__f32_to_f16(float f)
{
    uint32_t u = dpar_cuda__bits(f), sign = (u >> 16) & 0x8000u, m = u & 0x7fffffu, half, rem;
    int32_t e;
    if (((u >> 23) & 0xffu) == 0xffu) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u : 0u));
    e = (int32_t)((u >> 23) & 0xffu) - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) { /* subnormal or zero */
        uint32_t shift;
        if (e < -10) return (uint16_t)sign;
        m |= 0x800000u;
        shift = (uint32_t)(14 - e);
        half = m >> shift;
        rem = m & ((1u << shift) - 1u);
        if (rem > (1u << (shift - 1)) || (rem == (1u << (shift - 1)) && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    half = sign | ((uint32_t)e << 10) | (m >> 13);
    rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++; /* a carry rounds up into the exponent */
    return (uint16_t)half;
}

/* element types: storage T, widened to float and narrowed back */
struct dpar_cuda__f32 {
    typedef float T;
    DPAR_CUDA__HD float load(float x) { return x; }
    DPAR_CUDA__HD float store(float f) { return f; }
};
struct dpar_cuda__bf16 {
    typedef uint16_t T;
    DPAR_CUDA__HD float load(uint16_t x) { return dpar_cuda__bf16_to_f32(x); }
    DPAR_CUDA__HD uint16_t store(float f) { return dpar_cuda__f32_to_bf16(f); }
};
struct dpar_cuda__f16 {
    typedef uint16_t T;
    DPAR_CUDA__HD float load(uint16_t x) { return dpar_cuda__f16_to_f32(x); }
    DPAR_CUDA__HD uint16_t store(float f) { return dpar_cuda__f32_to_f16(f); }
};

/* ---- the element functions: one per kernel ---- */
DPAR_CUDA__HD float dpar_cuda__scale_elem(float y, float alpha) { return dpar_cuda__fmul(alpha, y); }
DPAR_CUDA__HD float dpar_cuda__axpy_elem(float y, float x, float alpha)
{
    return dpar_cuda__fadd(y, dpar_cuda__fmul(alpha, x));
}
DPAR_CUDA__HD float dpar_cuda__add_elem(float a, float b) { return dpar_cuda__fadd(a, b); }
/* dpar.h's dpar__apply_f32: the op in float (AVG: (x + y) / div when div > 1) */
DPAR_CUDA__HD float dpar_cuda__reduce_elem(float x, float y, int op, int div)
{
    switch (op) {
    case DPAR_SUM: return dpar_cuda__fadd(x, y);
    case DPAR_AVG: return div > 1 ? dpar_cuda__fdiv(dpar_cuda__fadd(x, y), (float)div) : dpar_cuda__fadd(x, y);
    case DPAR_MIN: return y < x ? y : x;
    case DPAR_MAX: return y > x ? y : x;
    default: return dpar_cuda__fmul(x, y);
    }
}
DPAR_CUDA__HD float dpar_cuda__divide_elem(float x, int div) { return dpar_cuda__fdiv(x, (float)div); }
/* f64, as dpar.h's loops on doubles (each step rounded on its own) */
DPAR_CUDA__HD double dpar_cuda__dop(double x, double y, int which) /* 0: x + y, 1: x * y, 2: x / y */
{
#ifdef __CUDA_ARCH__
    return which == 0 ? __dadd_rn(x, y) : which == 1 ? __dmul_rn(x, y) : __ddiv_rn(x, y);
#else
    return which == 0 ? x + y : which == 1 ? x * y : x / y;
#endif
}
DPAR_CUDA__HD double dpar_cuda__reduce_f64_elem(double x, double y, int op, int div)
{
    switch (op) {
    case DPAR_SUM: return dpar_cuda__dop(x, y, 0);
    case DPAR_AVG: return div > 1 ? dpar_cuda__dop(dpar_cuda__dop(x, y, 0), (double)div, 2) : dpar_cuda__dop(x, y, 0);
    case DPAR_MIN: return y < x ? y : x;
    case DPAR_MAX: return y > x ? y : x;
    default: return dpar_cuda__dop(x, y, 1);
    }
}
/* integers, as dpar.h's: the sum and product wrap (computed on U, the unsigned type of T's width or wider), the
   average divides the wrapped sum, truncating. The division is in T promoted (int, or int64_t for I64), never in T:
   div as a u8 is 0 for 256 ranks and wraps above */
template <class T, class U> DPAR_CUDA__HD T dpar_cuda__reduce_int_elem(T x, T y, int op, int div)
{
    switch (op) {
    case DPAR_SUM: return (T)((U)x + (U)y);
    case DPAR_AVG: return div > 1 ? (T)((T)((U)x + (U)y) / div) : (T)((U)x + (U)y);
    case DPAR_MIN: return y < x ? y : x;
    case DPAR_MAX: return y > x ? y : x;
    default: return (T)((U)x * (U)y);
    }
}
DPAR_CUDA__HD double dpar_cuda__divide_native_elem(double x, int div) { return dpar_cuda__dop(x, (double)div, 2); }
template <class T> DPAR_CUDA__HD T dpar_cuda__divide_native_elem(T x, int div) { return (T)(x / div); }
DPAR_CUDA__HD void dpar_cuda__sgd_elem(float *p, float *m, float g, float lr, float mu, float wd)
{
    float gi = dpar_cuda__fadd(g, dpar_cuda__fmul(wd, *p));
    *m = dpar_cuda__fadd(dpar_cuda__fmul(mu, *m), gi);
    *p = dpar_cuda__fsub(*p, dpar_cuda__fmul(lr, *m));
}
/* c1, c2: the bias corrections 1 - b1^t, 1 - b2^t */
DPAR_CUDA__HD void dpar_cuda__adamw_elem(float *p, float *m, float *v, float g, float lr, float b1, float b2, float eps,
                                         float wd, float c1, float c2)
{
    float mh, vh;
    *m = dpar_cuda__fadd(dpar_cuda__fmul(b1, *m), dpar_cuda__fmul(dpar_cuda__fsub(1.0f, b1), g));
    *v = dpar_cuda__fadd(dpar_cuda__fmul(b2, *v), dpar_cuda__fmul(dpar_cuda__fmul(dpar_cuda__fsub(1.0f, b2), g), g));
    mh = dpar_cuda__fdiv(*m, c1);
    vh = dpar_cuda__fadd(dpar_cuda__fsqrt(dpar_cuda__fdiv(*v, c2)), eps);
    *p = dpar_cuda__fsub(*p, dpar_cuda__fmul(lr, dpar_cuda__fadd(dpar_cuda__fdiv(mh, vh), dpar_cuda__fmul(wd, *p))));
}
/* column c of dy (rows x cols): its sum, rows in order */
DPAR_CUDA__HD float dpar_cuda__bias_backward_elem(const float *dy, size_t rows, size_t cols, size_t c)
{
    float sum = 0.0f;
    size_t r;
    for (r = 0; r < rows; r++) sum = dpar_cuda__fadd(sum, dy[r * cols + c]);
    return sum;
}
DPAR_CUDA__HD float dpar_cuda__relu_elem(float x) { return !(x <= 0.0f) ? x : 0.0f; }
DPAR_CUDA__HD float dpar_cuda__relu_backward_elem(float dy, float y) { return y > 0.0f ? dy : 0.0f; }
/* one row of softmax cross-entropy: z (classes); the loss, or NaN for a label out of range */
DPAR_CUDA__HD float dpar_cuda__xent_forward_elem(const float *z, int label, int classes)
{
    float mx = z[0], sum = 0.0f;
    int c;
    if (label < 0 || label >= classes) return dpar_cuda__float(0x7fc00000u);
    for (c = 1; c < classes; c++) mx = z[c] > mx ? z[c] : mx;
    for (c = 0; c < classes; c++) sum = dpar_cuda__fadd(sum, expf(dpar_cuda__fsub(z[c], mx)));
    return dpar_cuda__fsub(logf(sum), dpar_cuda__fsub(z[label], mx));
}
/* d (classes) = (softmax(z) - onehot(label)) / rows */
DPAR_CUDA__HD void dpar_cuda__xent_backward_elem(float *d, const float *z, int label, int classes, float rows)
{
    float mx = z[0], sum = 0.0f;
    int c, bad = label < 0 || label >= classes;
    for (c = 1; c < classes; c++) mx = z[c] > mx ? z[c] : mx;
    for (c = 0; c < classes; c++) sum = dpar_cuda__fadd(sum, (d[c] = expf(dpar_cuda__fsub(z[c], mx))));
    for (c = 0; c < classes; c++) {
        float s = dpar_cuda__fdiv(d[c], sum);
        d[c] =
            bad ? dpar_cuda__float(0x7fc00000u) : dpar_cuda__fdiv(dpar_cuda__fsub(s, c == label ? 1.0f : 0.0f), rows);
    }
}

/* ---- the grid-stride loop, written once ----
   A kernel object k has W (lanes of a vector: 16 bytes of its widest type), n (elements), head (elements taken
   one by one before the first vector), nvec (groups of W elements taken as vectors, from element head), one(i)
   and vec(g) (elements head + W g .. head + W g + W - 1, the same element function per lane). Thread `thread`
   of `threads` takes groups thread, thread + threads, ..., then the scalar elements the same way: the head
   (0 .. head - 1), then the tail (head + W nvec .. n - 1). Where every buffer is the same number of elements
   past a vector boundary (ring chunks of one message from dpar_block_range are), head is that distance to the
   next boundary and the middle runs as vectors; where they differ, nvec is 0 and all runs as scalars. */
template <class T, int W> struct alignas(W * sizeof(T)) dpar_cuda__vec {
    T e[W];
};
template <class K> __host__ __device__ inline void dpar_cuda__stride(const K &k, size_t thread, size_t threads)
{
    size_t i, middle = K::W * k.nvec;
    for (i = thread; i < k.nvec; i += threads) k.vec(i);
    for (i = thread; i < k.n - middle; i += threads) k.one(i < k.head ? i : i + middle);
}
template <class K> __global__ void dpar_cuda__kernel(K k)
{
    dpar_cuda__stride(k, (size_t)blockIdx.x * blockDim.x + threadIdx.x, (size_t)gridDim.x * blockDim.x);
}

static int dpar_cuda__aligned(const void *p, size_t bytes) { return (uintptr_t)p % bytes == 0; }

/* the elements of size es before p's next boundary of W elements, or (size_t)-1 where p is not even aligned to
   its element */
static size_t dpar_cuda__lead(const void *p, size_t es, size_t W)
{
    size_t vb = es * W, m = (size_t)((uintptr_t)p % vb);
    return m % es ? (size_t)-1 : (vb - m) % vb / es;
}
/* head and nvec of n elements whose buffers lie lead0..lead3 elements before their next vector boundaries: vectors
   in the middle where all agree (pass an agreeing lead for an unused buffer), else scalars only */
template <class K> static void dpar_cuda__split(K &k, size_t n, size_t lead0, size_t lead1, size_t lead2, size_t lead3)
{
    size_t head = lead0 < n ? lead0 : n;
    k.n = n;
    k.head = 0;
    k.nvec = 0;
    if (lead0 == (size_t)-1 || lead1 != lead0 || lead2 != lead0 || lead3 != lead0) return;
    k.head = head;
    k.nvec = (n - head) / K::W;
}

/* y = f(y) or y = f(x): a map over one input */
template <class F, class TO, class TI> struct dpar_cuda__map1 {
    enum { W = 16 / (sizeof(TO) > sizeof(TI) ? sizeof(TO) : sizeof(TI)) }; /* lanes: 16-byte loads */
    TO *out;
    const TI *in;
    size_t n, head, nvec;
    F f;
    __host__ __device__ void one(size_t i) const { out[i] = f(in[i]); }
    __host__ __device__ void vec(size_t g) const
    {
        dpar_cuda__vec<TI, W> x = ((const dpar_cuda__vec<TI, W> *)(in + head))[g];
        dpar_cuda__vec<TO, W> y;
        for (int l = 0; l < W; l++) y.e[l] = f(x.e[l]);
        ((dpar_cuda__vec<TO, W> *)(out + head))[g] = y;
    }
};
template <class F, class TO, class TI>
static dpar_cuda__map1<F, TO, TI> dpar_cuda__make_map1(TO *out, const TI *in, size_t n, F f)
{
    dpar_cuda__map1<F, TO, TI> k;
    const size_t W = dpar_cuda__map1<F, TO, TI>::W, lead = dpar_cuda__lead(out, sizeof(TO), W);
    k.out = out, k.in = in, k.f = f;
    dpar_cuda__split(k, n, lead, dpar_cuda__lead(in, sizeof(TI), W), lead, lead);
    return k;
}

/* out = f(a, b): a map over two inputs */
template <class F, class T> struct dpar_cuda__map2 {
    enum { W = 16 / sizeof(T) }; /* lanes: 16-byte loads */
    T *out;
    const T *a, *b;
    size_t n, head, nvec;
    F f;
    __host__ __device__ void one(size_t i) const { out[i] = f(a[i], b[i]); }
    __host__ __device__ void vec(size_t g) const
    {
        dpar_cuda__vec<T, W> x = ((const dpar_cuda__vec<T, W> *)(a + head))[g];
        dpar_cuda__vec<T, W> y = ((const dpar_cuda__vec<T, W> *)(b + head))[g];
        for (int l = 0; l < W; l++) x.e[l] = f(x.e[l], y.e[l]);
        ((dpar_cuda__vec<T, W> *)(out + head))[g] = x;
    }
};
template <class F, class T>
static dpar_cuda__map2<F, T> dpar_cuda__make_map2(T *out, const T *a, const T *b, size_t n, F f)
{
    dpar_cuda__map2<F, T> k;
    const size_t W = dpar_cuda__map2<F, T>::W, lead = dpar_cuda__lead(out, sizeof(T), W);
    k.out = out, k.a = a, k.b = b, k.f = f;
    dpar_cuda__split(k, n, lead, dpar_cuda__lead(a, sizeof(T), W), dpar_cuda__lead(b, sizeof(T), W), lead);
    return k;
}

/* the functions the maps apply: an element function with its parameters */
struct dpar_cuda__fill_f {
    float value;
    __host__ __device__ float operator()(float) const { return value; }
};
struct dpar_cuda__scale_f {
    float alpha;
    __host__ __device__ float operator()(float y) const { return dpar_cuda__scale_elem(y, alpha); }
};
struct dpar_cuda__axpy_f {
    float alpha;
    __host__ __device__ float operator()(float y, float x) const { return dpar_cuda__axpy_elem(y, x, alpha); }
};
struct dpar_cuda__add_f {
    __host__ __device__ float operator()(float a, float b) const { return dpar_cuda__add_elem(a, b); }
};
template <class D> struct dpar_cuda__reduce_f {
    int op, div;
    __host__ __device__ typename D::T operator()(typename D::T x, typename D::T y) const
    {
        return D::store(dpar_cuda__reduce_elem(D::load(x), D::load(y), op, div));
    }
};
template <class D> struct dpar_cuda__divide_f {
    int div;
    __host__ __device__ typename D::T operator()(typename D::T x) const
    {
        return D::store(dpar_cuda__divide_elem(D::load(x), div));
    }
};
/* the other dtypes: their own type, no widening */
template <class T, class U> struct dpar_cuda__reduce_int_f {
    int op, div;
    __host__ __device__ T operator()(T x, T y) const { return dpar_cuda__reduce_int_elem<T, U>(x, y, op, div); }
};
struct dpar_cuda__reduce_f64_f {
    int op, div;
    __host__ __device__ double operator()(double x, double y) const
    {
        return dpar_cuda__reduce_f64_elem(x, y, op, div);
    }
};
template <class T> struct dpar_cuda__divide_native_f {
    int div;
    __host__ __device__ T operator()(T x) const { return dpar_cuda__divide_native_elem(x, div); }
};
/* the one-shot allreduce's combine (dpar_comm_memory.combine): element lo + i of a count-element allreduce over
   `ranks` inputs in the ring's order (dpar_algo's "Results": acc = in[c+1], then acc = in[c+j] op acc for
   j = 2..ranks, c the element's block of dpar_block_range), each step the reduce kernel's function, so the bits
   are the ring's; `last` is the final step's (AVG divides there). One thread per element, no vectors: one launch
   where the reduce callbacks took ranks (ranks - 1) */
template <class F, class T> struct dpar_cuda__combine_k {
    enum { W = 1 };
    T *out;
    const T *in[DPAR_COMBINE_MAX_RANKS];
    size_t n, head, nvec, lo, base, rem; /* base, rem: count / ranks, count % ranks (the first rem blocks are longer) */
    int ranks;
    F step, last;
    __host__ __device__ void one(size_t i) const
    {
        size_t e = lo + i, big = rem * (base + 1);
        int c = (int)(e < big ? e / (base + 1) : rem + (e - big) / base), j;
        T acc = in[(c + 1) % ranks][i];
        for (j = 2; j <= ranks; j++) acc = (j == ranks ? last : step)(in[(c + j) % ranks][i], acc);
        out[i] = acc;
    }
    __host__ __device__ void vec(size_t) const {}
};
template <class F, class T>
static dpar_cuda__combine_k<F, T> dpar_cuda__make_combine(void *out, const void *const *in, int ranks, size_t lo,
                                                          size_t n, size_t count, int op)
{
    dpar_cuda__combine_k<F, T> k;
    int q;
    k.out = (T *)out;
    for (q = 0; q < DPAR_COMBINE_MAX_RANKS; q++) k.in[q] = q < ranks ? (const T *)in[q] : (const T *)0;
    k.n = n, k.head = 0, k.nvec = 0, k.lo = lo, k.base = count / (size_t)ranks, k.rem = count % (size_t)ranks;
    k.ranks = ranks;
    k.step.op = op, k.step.div = 0;
    k.last.op = op, k.last.div = op == DPAR_AVG ? ranks : 0;
    return k;
}
template <class DO, class DI> struct dpar_cuda__cast_f {
    __host__ __device__ typename DO::T operator()(typename DI::T x) const { return DO::store(DI::load(x)); }
};
struct dpar_cuda__relu_f {
    __host__ __device__ float operator()(float x) const { return dpar_cuda__relu_elem(x); }
};
struct dpar_cuda__relu_backward_f {
    __host__ __device__ float operator()(float dy, float y) const { return dpar_cuda__relu_backward_elem(dy, y); }
};

/* the optimizers: several outputs per element */
struct dpar_cuda__sgd_k {
    enum { W = 4 };
    float *p, *m;
    const float *g;
    size_t n, head, nvec;
    float lr, mu, wd;
    __host__ __device__ void one(size_t i) const { dpar_cuda__sgd_elem(p + i, m + i, g[i], lr, mu, wd); }
    __host__ __device__ void vec(size_t j) const
    {
        dpar_cuda__vec<float, 4> *pv4 = (dpar_cuda__vec<float, 4> *)(p + head),
                                 *mv4 = (dpar_cuda__vec<float, 4> *)(m + head);
        dpar_cuda__vec<float, 4> pv = pv4[j], mv = mv4[j];
        dpar_cuda__vec<float, 4> gv = ((const dpar_cuda__vec<float, 4> *)(g + head))[j];
        for (int l = 0; l < 4; l++) dpar_cuda__sgd_elem(&pv.e[l], &mv.e[l], gv.e[l], lr, mu, wd);
        pv4[j] = pv;
        mv4[j] = mv;
    }
};
static dpar_cuda__sgd_k dpar_cuda__make_sgd(float *p, float *m, const float *g, size_t n, float lr, float mu, float wd)
{
    dpar_cuda__sgd_k k;
    size_t lead = dpar_cuda__lead(p, 4, 4);
    k.p = p, k.m = m, k.g = g, k.lr = lr, k.mu = mu, k.wd = wd;
    dpar_cuda__split(k, n, lead, dpar_cuda__lead(m, 4, 4), dpar_cuda__lead(g, 4, 4), lead);
    return k;
}
struct dpar_cuda__adamw_k {
    enum { W = 4 };
    float *p, *m, *v;
    const float *g;
    size_t n, head, nvec;
    float lr, b1, b2, eps, wd, c1, c2;
    __host__ __device__ void one(size_t i) const
    {
        dpar_cuda__adamw_elem(p + i, m + i, v + i, g[i], lr, b1, b2, eps, wd, c1, c2);
    }
    __host__ __device__ void vec(size_t j) const
    {
        dpar_cuda__vec<float, 4> *pv4 = (dpar_cuda__vec<float, 4> *)(p + head),
                                 *mv4 = (dpar_cuda__vec<float, 4> *)(m + head);
        dpar_cuda__vec<float, 4> *vv4 = (dpar_cuda__vec<float, 4> *)(v + head);
        dpar_cuda__vec<float, 4> pv = pv4[j], mv = mv4[j], vv = vv4[j];
        dpar_cuda__vec<float, 4> gv = ((const dpar_cuda__vec<float, 4> *)(g + head))[j];
        for (int l = 0; l < 4; l++)
            dpar_cuda__adamw_elem(&pv.e[l], &mv.e[l], &vv.e[l], gv.e[l], lr, b1, b2, eps, wd, c1, c2);
        pv4[j] = pv;
        mv4[j] = mv;
        vv4[j] = vv;
    }
};
static dpar_cuda__adamw_k dpar_cuda__make_adamw(float *p, float *m, float *v, const float *g, size_t n, float lr,
                                                float b1, float b2, float eps, float wd, long step)
{
    dpar_cuda__adamw_k k;
    size_t lead = dpar_cuda__lead(p, 4, 4);
    k.p = p, k.m = m, k.v = v, k.g = g, k.lr = lr, k.b1 = b1, k.b2 = b2, k.eps = eps, k.wd = wd;
    k.c1 = 1.0f - powf(b1, (float)step); /* on the host, as dpar_zero_step */
    k.c2 = 1.0f - powf(b2, (float)step);
    dpar_cuda__split(k, n, lead, dpar_cuda__lead(m, 4, 4), dpar_cuda__lead(v, 4, 4), dpar_cuda__lead(g, 4, 4));
    return k;
}

/* y (rows x cols) += bias (cols): element i is column i % cols; vectors need cols % 4 == 0 */
struct dpar_cuda__bias_k {
    enum { W = 4 };
    float *y;
    const float *bias;
    size_t n, head, nvec, cols; /* head: 0 (a vector must not straddle two rows) */
    __host__ __device__ void one(size_t i) const { y[i] = dpar_cuda__add_elem(y[i], bias[i % cols]); }
    __host__ __device__ void vec(size_t j) const
    {
        dpar_cuda__vec<float, 4> yv = ((dpar_cuda__vec<float, 4> *)y)[j];
        size_t c = (4 * j) % cols;
        for (int l = 0; l < 4; l++) yv.e[l] = dpar_cuda__add_elem(yv.e[l], bias[c + l]);
        ((dpar_cuda__vec<float, 4> *)y)[j] = yv;
    }
};
static dpar_cuda__bias_k dpar_cuda__make_bias(float *y, const float *bias, size_t rows, size_t cols)
{
    dpar_cuda__bias_k k;
    k.y = y, k.bias = bias, k.n = rows * cols, k.cols = cols, k.head = 0;
    k.nvec = cols % 4 == 0 && dpar_cuda__aligned(y, 16) ? k.n / 4 : 0;
    return k;
}

/* the bias gradient: one column per element; no vectors */
struct dpar_cuda__bias_backward_k {
    enum { W = 4 };
    float *dbias;
    const float *dy;
    size_t n, head, nvec, rows; /* n: cols */
    __host__ __device__ void one(size_t c) const { dbias[c] = dpar_cuda__bias_backward_elem(dy, rows, n, c); }
    __host__ __device__ void vec(size_t) const {}
};
static dpar_cuda__bias_backward_k dpar_cuda__make_bias_backward(float *dbias, const float *dy, size_t rows, size_t cols)
{
    dpar_cuda__bias_backward_k k;
    k.dbias = dbias, k.dy = dy, k.n = cols, k.head = 0, k.nvec = 0, k.rows = rows;
    return k;
}

/* softmax cross-entropy: one row per element; no vectors */
struct dpar_cuda__xent_k {
    enum { W = 4 };
    float *out; /* forward: loss (rows); backward: dlogits (rows x classes) */
    const float *z;
    const int *labels;
    size_t n, head, nvec; /* n: rows */
    int classes, backward;
    __host__ __device__ void one(size_t r) const
    {
        const float *zr = z + r * (size_t)classes;
        if (backward) dpar_cuda__xent_backward_elem(out + r * (size_t)classes, zr, labels[r], classes, (float)n);
        else out[r] = dpar_cuda__xent_forward_elem(zr, labels[r], classes);
    }
    __host__ __device__ void vec(size_t) const {}
};
static dpar_cuda__xent_k dpar_cuda__make_xent(float *out, const float *z, const int *labels, size_t rows, int classes,
                                              int backward)
{
    dpar_cuda__xent_k k;
    k.out = out, k.z = z, k.labels = labels, k.n = rows, k.head = 0, k.nvec = 0, k.classes = classes;
    k.backward = backward;
    return k;
}

/* ---- the launchers ---- */
#define DPAR_CUDA__THREADS 256
#define DPAR_CUDA__MAX_BLOCKS (65535u * 8)

/* the launch's blocks of DPAR_CUDA__THREADS: one thread per vector group and per tail element, capped (the
   grid-stride loop takes the rest); 0 when there is no work */
template <class K> static unsigned dpar_cuda__blocks(const K &k)
{
    size_t work = k.nvec + (k.n - K::W * k.nvec), blocks = (work + DPAR_CUDA__THREADS - 1) / DPAR_CUDA__THREADS;
    return (unsigned)(blocks > DPAR_CUDA__MAX_BLOCKS ? DPAR_CUDA__MAX_BLOCKS : blocks);
}

/* cudaLaunchKernel returns this launch's own status (cudaGetLastError after <<<>>> would also return an earlier
   error of this thread that its caller had already handled); a failed launch's error is then cleared from the
   thread's last error, as it is reported here */
template <class K> static dpar_status dpar_cuda__launch(const K &k, void *stream, const char *what)
{
    unsigned blocks = dpar_cuda__blocks(k);
    K arg = k;
    void *args[1] = {&arg};
    cudaError_t e;
    if (blocks == 0) return DPAR_OK;
    e = cudaLaunchKernel(dpar_cuda__kernel<K>, dim3(blocks), dim3(DPAR_CUDA__THREADS), args, 0, (cudaStream_t)stream);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return dpar_cuda__check(e, what, "kernel launch (cudaLaunchKernel)");
}

static dpar_status dpar_cuda__null(const char *what, size_t n, const void *a, const void *b, const void *c,
                                   const void *d)
{
    if (n && (!a || !b || !c || !d)) return dpar_set_error(DPAR_EINVAL, "%s: a pointer is NULL (n = %zu)", what, n);
    return DPAR_OK;
}

/* DPAR_OK for the device's dtypes; EINVAL for a value outside dpar_dtype; EUNSUPPORTED for the others */
static dpar_status dpar_cuda__dtype(const char *what, dpar_dtype t)
{
    if (t == DPAR_F32 || t == DPAR_BF16 || t == DPAR_F16) return DPAR_OK;
    if ((unsigned)t >= DPAR_DTYPE_COUNT)
        return dpar_set_error(DPAR_EINVAL, "%s: dtype %d is not a dpar_dtype", what, (int)t);
    return dpar_set_error(DPAR_EUNSUPPORTED, "%s: dtype %s is not on the device (f32, bf16, f16)", what,
                          dpar_dtype_name(t));
}

extern "C" DPAR_API dpar_status dpar_cuda_fill_f32(float *y, float value, size_t n, void *stream)
{
    dpar_cuda__fill_f f = {value};
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_fill_f32", n, y, y, y, y));
    return dpar_cuda__launch(dpar_cuda__make_map1(y, (const float *)y, n, f), stream, "dpar_cuda_fill_f32");
}

extern "C" DPAR_API dpar_status dpar_cuda_scale_f32(float *y, float alpha, size_t n, void *stream)
{
    dpar_cuda__scale_f f = {alpha};
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_scale_f32", n, y, y, y, y));
    return dpar_cuda__launch(dpar_cuda__make_map1(y, (const float *)y, n, f), stream, "dpar_cuda_scale_f32");
}

extern "C" DPAR_API dpar_status dpar_cuda_axpy_f32(float *y, const float *x, float alpha, size_t n, void *stream)
{
    dpar_cuda__axpy_f f = {alpha};
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_axpy_f32", n, y, x, x, x));
    return dpar_cuda__launch(dpar_cuda__make_map2(y, (const float *)y, x, n, f), stream, "dpar_cuda_axpy_f32");
}

extern "C" DPAR_API dpar_status dpar_cuda_add_f32(float *out, const float *a, const float *b, size_t n, void *stream)
{
    dpar_cuda__add_f f;
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_add_f32", n, out, a, b, b));
    return dpar_cuda__launch(dpar_cuda__make_map2(out, a, b, n, f), stream, "dpar_cuda_add_f32");
}

template <class D>
static dpar_status dpar_cuda__reduce_t(void *out, const void *a, const void *b, size_t n, int op, int div, void *stream)
{
    typedef typename D::T T;
    dpar_cuda__reduce_f<D> f;
    f.op = op, f.div = div;
    return dpar_cuda__launch(dpar_cuda__make_map2((T *)out, (const T *)a, (const T *)b, n, f), stream,
                             "dpar_cuda_reduce");
}

template <class F, class T>
static dpar_status dpar_cuda__reduce_n(void *out, const void *a, const void *b, size_t n, int op, int div, void *stream)
{
    F f;
    f.op = op, f.div = div;
    return dpar_cuda__launch(dpar_cuda__make_map2((T *)out, (const T *)a, (const T *)b, n, f), stream,
                             "dpar_cuda_reduce");
}

extern "C" DPAR_API dpar_status dpar_cuda_reduce(void *out, const void *a, const void *b, size_t n, dpar_dtype dtype,
                                                 dpar_op op, int div, void *stream)
{
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_reduce", n, out, a, b, b));
    if ((unsigned)dtype >= DPAR_DTYPE_COUNT)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_reduce: dtype %d is not a dpar_dtype", (int)dtype);
    if ((unsigned)op >= DPAR_OP_COUNT)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_reduce: op %d is not a dpar_op", (int)op);
    switch (dtype) {
    case DPAR_F32: return dpar_cuda__reduce_t<dpar_cuda__f32>(out, a, b, n, op, div, stream);
    case DPAR_BF16: return dpar_cuda__reduce_t<dpar_cuda__bf16>(out, a, b, n, op, div, stream);
    case DPAR_F16: return dpar_cuda__reduce_t<dpar_cuda__f16>(out, a, b, n, op, div, stream);
    case DPAR_F64: return dpar_cuda__reduce_n<dpar_cuda__reduce_f64_f, double>(out, a, b, n, op, div, stream);
    case DPAR_I32:
        return dpar_cuda__reduce_n<dpar_cuda__reduce_int_f<int32_t, uint32_t>, int32_t>(out, a, b, n, op, div, stream);
    case DPAR_I64:
        return dpar_cuda__reduce_n<dpar_cuda__reduce_int_f<int64_t, uint64_t>, int64_t>(out, a, b, n, op, div, stream);
    default:
        return dpar_cuda__reduce_n<dpar_cuda__reduce_int_f<uint8_t, uint32_t>, uint8_t>(out, a, b, n, op, div, stream);
    }
}

template <class F, class T>
static dpar_status dpar_cuda__combine_n(void *out, const void *const *in, int ranks, size_t lo, size_t n, size_t count,
                                        int op, void *stream)
{
    return dpar_cuda__launch(dpar_cuda__make_combine<F, T>(out, in, ranks, lo, n, count, op), stream,
                             "dpar_cuda__combine");
}
/* the one-shot's combine, one launch (dpar_comm_memory.combine; checked by dpar.h's caller: 2 <= ranks <= 64, a
   dtype and op of dpar's, lo + n <= count) */
static dpar_status dpar_cuda__combine(void *out, const void *const *in, int ranks, size_t lo, size_t n, size_t count,
                                      dpar_dtype dtype, dpar_op op, void *stream)
{
    int o = (int)op;
    if (ranks < 2 || ranks > DPAR_COMBINE_MAX_RANKS || lo + n > count || (unsigned)dtype >= DPAR_DTYPE_COUNT ||
        (unsigned)op >= DPAR_OP_COUNT)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda__combine: %d ranks, elements %zu + %zu of %zu, dtype %d, op %d",
                              ranks, lo, n, count, (int)dtype, o);
    switch (dtype) {
    case DPAR_F32:
        return dpar_cuda__combine_n<dpar_cuda__reduce_f<dpar_cuda__f32>, float>(out, in, ranks, lo, n, count, o,
                                                                                stream);
    case DPAR_BF16:
        return dpar_cuda__combine_n<dpar_cuda__reduce_f<dpar_cuda__bf16>, uint16_t>(out, in, ranks, lo, n, count, o,
                                                                                    stream);
    case DPAR_F16:
        return dpar_cuda__combine_n<dpar_cuda__reduce_f<dpar_cuda__f16>, uint16_t>(out, in, ranks, lo, n, count, o,
                                                                                   stream);
    case DPAR_F64:
        return dpar_cuda__combine_n<dpar_cuda__reduce_f64_f, double>(out, in, ranks, lo, n, count, o, stream);
    case DPAR_I32:
        return dpar_cuda__combine_n<dpar_cuda__reduce_int_f<int32_t, uint32_t>, int32_t>(out, in, ranks, lo, n, count,
                                                                                         o, stream);
    case DPAR_I64:
        return dpar_cuda__combine_n<dpar_cuda__reduce_int_f<int64_t, uint64_t>, int64_t>(out, in, ranks, lo, n, count,
                                                                                         o, stream);
    default:
        return dpar_cuda__combine_n<dpar_cuda__reduce_int_f<uint8_t, uint32_t>, uint8_t>(out, in, ranks, lo, n, count,
                                                                                         o, stream);
    }
}

template <class D> static dpar_status dpar_cuda__divide_t(void *out, const void *in, size_t n, int div, void *stream)
{
    typedef typename D::T T;
    dpar_cuda__divide_f<D> f;
    f.div = div;
    return dpar_cuda__launch(dpar_cuda__make_map1((T *)out, (const T *)in, n, f), stream, "dpar_cuda_divide");
}

template <class T> static dpar_status dpar_cuda__divide_n(void *out, const void *in, size_t n, int div, void *stream)
{
    dpar_cuda__divide_native_f<T> f;
    f.div = div;
    return dpar_cuda__launch(dpar_cuda__make_map1((T *)out, (const T *)in, n, f), stream, "dpar_cuda_divide");
}

extern "C" DPAR_API dpar_status dpar_cuda_divide(void *out, const void *in, size_t n, dpar_dtype dtype, int div,
                                                 void *stream)
{
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_divide", n, out, in, in, in));
    if ((unsigned)dtype >= DPAR_DTYPE_COUNT)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_divide: dtype %d is not a dpar_dtype", (int)dtype);
    if (n == 0) return DPAR_OK;
    if (div <= 1) {
        if (out == in) return DPAR_OK;
        return dpar_cuda__check(
            cudaMemcpyAsync(out, in, n * dpar_dtype_size(dtype), cudaMemcpyDeviceToDevice, (cudaStream_t)stream),
            "dpar_cuda_divide", "cudaMemcpyAsync");
    }
    switch (dtype) {
    case DPAR_F32: return dpar_cuda__divide_t<dpar_cuda__f32>(out, in, n, div, stream);
    case DPAR_BF16: return dpar_cuda__divide_t<dpar_cuda__bf16>(out, in, n, div, stream);
    case DPAR_F16: return dpar_cuda__divide_t<dpar_cuda__f16>(out, in, n, div, stream);
    case DPAR_F64: return dpar_cuda__divide_n<double>(out, in, n, div, stream);
    case DPAR_I32: return dpar_cuda__divide_n<int32_t>(out, in, n, div, stream);
    case DPAR_I64: return dpar_cuda__divide_n<int64_t>(out, in, n, div, stream);
    default: return dpar_cuda__divide_n<uint8_t>(out, in, n, div, stream);
    }
}

template <class DO, class DI> static dpar_status dpar_cuda__cast_t(void *out, const void *in, size_t n, void *stream)
{
    dpar_cuda__cast_f<DO, DI> f;
    return dpar_cuda__launch(dpar_cuda__make_map1((typename DO::T *)out, (const typename DI::T *)in, n, f), stream,
                             "dpar_cuda_cast");
}
template <class DO>
static dpar_status dpar_cuda__cast_in(void *out, const void *in, dpar_dtype in_dtype, size_t n, void *stream)
{
    if (in_dtype == DPAR_F32) return dpar_cuda__cast_t<DO, dpar_cuda__f32>(out, in, n, stream);
    if (in_dtype == DPAR_BF16) return dpar_cuda__cast_t<DO, dpar_cuda__bf16>(out, in, n, stream);
    return dpar_cuda__cast_t<DO, dpar_cuda__f16>(out, in, n, stream);
}

extern "C" DPAR_API dpar_status dpar_cuda_cast(void *out, dpar_dtype out_dtype, const void *in, dpar_dtype in_dtype,
                                               size_t n, void *stream)
{
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_cast", n, out, in, in, in));
    DPAR_CUDA__TRY(dpar_cuda__dtype("dpar_cuda_cast", out_dtype));
    DPAR_CUDA__TRY(dpar_cuda__dtype("dpar_cuda_cast", in_dtype));
    if (out_dtype == DPAR_F32) return dpar_cuda__cast_in<dpar_cuda__f32>(out, in, in_dtype, n, stream);
    if (out_dtype == DPAR_BF16) return dpar_cuda__cast_in<dpar_cuda__bf16>(out, in, in_dtype, n, stream);
    return dpar_cuda__cast_in<dpar_cuda__f16>(out, in, in_dtype, n, stream);
}

extern "C" DPAR_API dpar_status dpar_cuda_sgd_f32(float *params, float *mom, const float *grads, size_t n, float lr,
                                                  float momentum, float weight_decay, void *stream)
{
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_sgd_f32", n, params, mom, grads, grads));
    return dpar_cuda__launch(dpar_cuda__make_sgd(params, mom, grads, n, lr, momentum, weight_decay), stream,
                             "dpar_cuda_sgd_f32");
}

extern "C" DPAR_API dpar_status dpar_cuda_adamw_f32(float *params, float *m, float *v, const float *grads, size_t n,
                                                    float lr, float beta1, float beta2, float eps, float weight_decay,
                                                    long step, void *stream)
{
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_adamw_f32", n, params, m, v, grads));
    if (step < 1) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_adamw_f32: step %ld (counts from 1)", step);
    return dpar_cuda__launch(dpar_cuda__make_adamw(params, m, v, grads, n, lr, beta1, beta2, eps, weight_decay, step),
                             stream, "dpar_cuda_adamw_f32");
}

extern "C" DPAR_API dpar_status dpar_cuda_bias_add_f32(float *y, const float *bias, size_t rows, size_t cols,
                                                       void *stream)
{
    if (cols && rows > (size_t)-1 / cols)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_bias_add_f32: rows x cols overflows");
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_bias_add_f32", rows * cols, y, bias, bias, bias));
    return dpar_cuda__launch(dpar_cuda__make_bias(y, bias, rows, cols), stream, "dpar_cuda_bias_add_f32");
}

extern "C" DPAR_API dpar_status dpar_cuda_bias_backward_f32(float *dbias, const float *dy, size_t rows, size_t cols,
                                                            void *stream)
{
    if (cols && rows > (size_t)-1 / cols)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_bias_backward_f32: rows x cols overflows");
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_bias_backward_f32", cols, dbias, dbias, dbias, dbias));
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_bias_backward_f32", rows * cols, dy, dy, dy, dy));
    return dpar_cuda__launch(dpar_cuda__make_bias_backward(dbias, dy, rows, cols), stream,
                             "dpar_cuda_bias_backward_f32");
}

extern "C" DPAR_API dpar_status dpar_cuda_relu_forward_f32(float *y, const float *x, size_t n, void *stream)
{
    dpar_cuda__relu_f f;
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_relu_forward_f32", n, y, x, x, x));
    return dpar_cuda__launch(dpar_cuda__make_map1(y, x, n, f), stream, "dpar_cuda_relu_forward_f32");
}

extern "C" DPAR_API dpar_status dpar_cuda_relu_backward_f32(float *dx, const float *dy, const float *y, size_t n,
                                                            void *stream)
{
    dpar_cuda__relu_backward_f f;
    DPAR_CUDA__TRY(dpar_cuda__null("dpar_cuda_relu_backward_f32", n, dx, dy, y, y));
    return dpar_cuda__launch(dpar_cuda__make_map2(dx, dy, y, n, f), stream, "dpar_cuda_relu_backward_f32");
}

static dpar_status dpar_cuda__xent(const char *what, float *out, const float *z, const int *labels, size_t rows,
                                   int classes, int backward, void *stream)
{
    if (classes < 1) return dpar_set_error(DPAR_EINVAL, "%s: classes = %d (must be >= 1)", what, classes);
    DPAR_CUDA__TRY(dpar_cuda__null(what, rows, out, z, labels, labels));
    return dpar_cuda__launch(dpar_cuda__make_xent(out, z, labels, rows, classes, backward), stream, what);
}
extern "C" DPAR_API dpar_status dpar_cuda_softmax_xent_forward_f32(float *loss, const float *logits, const int *labels,
                                                                   size_t rows, int classes, void *stream)
{
    return dpar_cuda__xent("dpar_cuda_softmax_xent_forward_f32", loss, logits, labels, rows, classes, 0, stream);
}
extern "C" DPAR_API dpar_status dpar_cuda_softmax_xent_backward_f32(float *dlogits, const float *logits,
                                                                    const int *labels, size_t rows, int classes,
                                                                    void *stream)
{
    return dpar_cuda__xent("dpar_cuda_softmax_xent_backward_f32", dlogits, logits, labels, rows, classes, 1, stream);
}

extern "C" DPAR_API dpar_status dpar_cuda_sgemm(dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha,
                                                const float *A, int lda, const float *B, int ldb, float beta, float *C,
                                                int ldc, void *cublas, void *stream)
{
    cublasStatus_t s;
    int ra = ta ? M : K, rb = tb ? K : N; /* the row lengths of A and B as stored */
    if ((unsigned)ta > 1 || (unsigned)tb > 1) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_sgemm: bad trans");
    if (M < 0 || N < 0 || K < 0) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_sgemm: negative size %dx%dx%d", M, N, K);
    if (!cublas) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_sgemm: the cuBLAS handle is NULL");
    if (lda < (ra > 1 ? ra : 1) || ldb < (rb > 1 ? rb : 1) || ldc < (N > 1 ? N : 1))
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_sgemm: leading dimensions %d, %d, %d too small", lda, ldb, ldc);
    if (M == 0 || N == 0) return DPAR_OK;
    if (!C || (K && (!A || !B))) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_sgemm: a matrix is NULL");
    s = cublasSetStream((cublasHandle_t)cublas, (cudaStream_t)stream);
    if (s != CUBLAS_STATUS_SUCCESS)
        return dpar_set_error(DPAR_ESYSTEM, "dpar_cuda_sgemm: cublasSetStream: %s: %s", cublasGetStatusName(s),
                              cublasGetStatusString(s));
    /* row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B first, N and M swapped */
    s = cublasSgemm((cublasHandle_t)cublas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                    &alpha, B, ldb, A, lda, &beta, C, ldc);
    if (s != CUBLAS_STATUS_SUCCESS)
        return dpar_set_error(DPAR_ESYSTEM, "dpar_cuda_sgemm: cublasSgemm: %s: %s", cublasGetStatusName(s),
                              cublasGetStatusString(s));
    return DPAR_OK;
}

/* ---- the references: naive host loops, written apart from the element functions ---- */
extern "C" DPAR_API void dpar_cuda_fill_f32_ref(float *y, float value, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) y[i] = value;
}

extern "C" DPAR_API void dpar_cuda_scale_f32_ref(float *y, float alpha, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) y[i] = alpha * y[i];
}

extern "C" DPAR_API void dpar_cuda_axpy_f32_ref(float *y, const float *x, float alpha, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) y[i] += alpha * x[i];
}

extern "C" DPAR_API void dpar_cuda_add_f32_ref(float *out, const float *a, const float *b, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) out[i] = a[i] + b[i];
}

/* a 16-bit or f32 element of a buffer, widened; and stored back narrowed (dpar.h's conversions) */
static float dpar_cuda__ref_get(const void *p, dpar_dtype t, size_t i)
{
    if (t == DPAR_F32) return ((const float *)p)[i];
    if (t == DPAR_BF16) return dpar_bf16_to_f32(((const uint16_t *)p)[i]);
    return dpar_f16_to_f32(((const uint16_t *)p)[i]);
}
static void dpar_cuda__ref_put(void *p, dpar_dtype t, size_t i, float f)
{
    if (t == DPAR_F32) ((float *)p)[i] = f;
    else if (t == DPAR_BF16) ((uint16_t *)p)[i] = dpar_f32_to_bf16(f);
    else ((uint16_t *)p)[i] = dpar_f32_to_f16(f);
}

/* the other dtypes: the naive loop on each type (integers wrap through their unsigned type; u8 through unsigned; the
   average divides in T promoted, never by (T)div) */
#define DPAR_CUDA__REF_RED(T, U)                                    \
    for (i = 0; i < n; i++) {                                       \
        T x = ((const T *)a)[i], y = ((const T *)b)[i], r;          \
        if (op == DPAR_SUM || op == DPAR_AVG) r = (T)((U)x + (U)y); \
        else if (op == DPAR_MIN) r = y < x ? y : x;                 \
        else if (op == DPAR_MAX) r = y > x ? y : x;                 \
        else r = (T)((U)x * (U)y);                                  \
        if (op == DPAR_AVG && div > 1) r = (T)(r / div);            \
        ((T *)out)[i] = r;                                          \
    }
extern "C" DPAR_API void dpar_cuda_reduce_ref(void *out, const void *a, const void *b, size_t n, dpar_dtype dtype,
                                              dpar_op op, int div)
{
    size_t i;
    if (dtype == DPAR_I32) {
        DPAR_CUDA__REF_RED(int32_t, uint32_t)
        return;
    }
    if (dtype == DPAR_I64) {
        DPAR_CUDA__REF_RED(int64_t, uint64_t)
        return;
    }
    if (dtype == DPAR_U8) {
        DPAR_CUDA__REF_RED(uint8_t, unsigned)
        return;
    }
    if (dtype == DPAR_F64) {
        for (i = 0; i < n; i++) {
            double x = ((const double *)a)[i], y = ((const double *)b)[i], r;
            if (op == DPAR_SUM || op == DPAR_AVG) r = x + y;
            else if (op == DPAR_MIN) r = y < x ? y : x;
            else if (op == DPAR_MAX) r = y > x ? y : x;
            else r = x * y;
            ((double *)out)[i] = op == DPAR_AVG && div > 1 ? r / div : r;
        }
        return;
    }
    for (i = 0; i < n; i++) {
        float x = dpar_cuda__ref_get(a, dtype, i), y = dpar_cuda__ref_get(b, dtype, i), r;
        if (op == DPAR_SUM) r = x + y;
        else if (op == DPAR_AVG && div > 1) r = (x + y) / (float)div;
        else if (op == DPAR_AVG) r = x + y;
        else if (op == DPAR_MIN) r = y < x ? y : x; /* NaN: as dpar.h, the first operand unless y is smaller */
        else if (op == DPAR_MAX) r = y > x ? y : x;
        else r = x * y;
        dpar_cuda__ref_put(out, dtype, i, r);
    }
}

extern "C" DPAR_API void dpar_cuda_divide_ref(void *out, const void *in, size_t n, dpar_dtype dtype, int div)
{
    size_t i;
    for (i = 0; i < n && div > 1; i++) {
        if (dtype == DPAR_F64) ((double *)out)[i] = ((const double *)in)[i] / div;
        else if (dtype == DPAR_I32) ((int32_t *)out)[i] = ((const int32_t *)in)[i] / div;
        else if (dtype == DPAR_I64) ((int64_t *)out)[i] = ((const int64_t *)in)[i] / div;
        else if (dtype == DPAR_U8) ((uint8_t *)out)[i] = (uint8_t)(((const uint8_t *)in)[i] / div);
    }
    if (dtype == DPAR_F64 || dtype == DPAR_I32 || dtype == DPAR_I64 || dtype == DPAR_U8) {
        if (div <= 1 && out != in) memmove(out, in, n * dpar_dtype_size(dtype));
        return;
    }
    for (i = 0; i < n; i++) {
        float x = dpar_cuda__ref_get(in, dtype, i);
        dpar_cuda__ref_put(out, dtype, i, div > 1 ? x / (float)div : x);
    }
}

extern "C" DPAR_API void dpar_cuda_cast_ref(void *out, dpar_dtype out_dtype, const void *in, dpar_dtype in_dtype,
                                            size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) dpar_cuda__ref_put(out, out_dtype, i, dpar_cuda__ref_get(in, in_dtype, i));
}

extern "C" DPAR_API void dpar_cuda_sgd_f32_ref(float *params, float *mom, const float *grads, size_t n, float lr,
                                               float momentum, float weight_decay)
{
    size_t i;
    for (i = 0; i < n; i++) {
        float g = grads[i] + weight_decay * params[i];
        mom[i] = momentum * mom[i] + g;
        params[i] -= lr * mom[i];
    }
}

extern "C" DPAR_API void dpar_cuda_adamw_f32_ref(float *params, float *m, float *v, const float *grads, size_t n,
                                                 float lr, float beta1, float beta2, float eps, float weight_decay,
                                                 long step)
{
    float c1 = 1.0f - powf(beta1, (float)step), c2 = 1.0f - powf(beta2, (float)step);
    size_t i;
    for (i = 0; i < n; i++) {
        m[i] = beta1 * m[i] + (1.0f - beta1) * grads[i];
        v[i] = beta2 * v[i] + (1.0f - beta2) * grads[i] * grads[i];
        params[i] -= lr * ((m[i] / c1) / (sqrtf(v[i] / c2) + eps) + weight_decay * params[i]);
    }
}

extern "C" DPAR_API void dpar_cuda_bias_add_f32_ref(float *y, const float *bias, size_t rows, size_t cols)
{
    size_t r, c;
    for (r = 0; r < rows; r++)
        for (c = 0; c < cols; c++) y[r * cols + c] += bias[c];
}

extern "C" DPAR_API void dpar_cuda_bias_backward_f32_ref(float *dbias, const float *dy, size_t rows, size_t cols)
{
    size_t r, c;
    for (c = 0; c < cols; c++) dbias[c] = 0;
    for (r = 0; r < rows; r++)
        for (c = 0; c < cols; c++) dbias[c] += dy[r * cols + c];
}

extern "C" DPAR_API void dpar_cuda_relu_forward_f32_ref(float *y, const float *x, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        if (isnan(x[i])) y[i] = x[i];
        else y[i] = x[i] > 0 ? x[i] : 0.0f;
    }
}

extern "C" DPAR_API void dpar_cuda_relu_backward_f32_ref(float *dx, const float *dy, const float *y, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) dx[i] = y[i] > 0 ? dy[i] : 0.0f;
}

extern "C" DPAR_API void dpar_cuda_softmax_xent_forward_f32_ref(float *loss, const float *logits, const int *labels,
                                                                size_t rows, int classes)
{
    size_t r;
    int c;
    for (r = 0; r < rows; r++) {
        const float *z = logits + r * (size_t)classes;
        float mx = z[0], sum = 0;
        if (labels[r] < 0 || labels[r] >= classes) {
            loss[r] = NAN;
            continue;
        }
        for (c = 1; c < classes; c++) mx = z[c] > mx ? z[c] : mx;
        for (c = 0; c < classes; c++) sum += expf(z[c] - mx);
        loss[r] = logf(sum) - (z[labels[r]] - mx);
    }
}

extern "C" DPAR_API void dpar_cuda_softmax_xent_backward_f32_ref(float *dlogits, const float *logits, const int *labels,
                                                                 size_t rows, int classes)
{
    size_t r;
    int c;
    for (r = 0; r < rows; r++) {
        const float *z = logits + r * (size_t)classes;
        float *d = dlogits + r * (size_t)classes, mx = z[0], sum = 0;
        for (c = 1; c < classes; c++) mx = z[c] > mx ? z[c] : mx;
        for (c = 0; c < classes; c++) sum += (d[c] = expf(z[c] - mx));
        for (c = 0; c < classes; c++) {
            if (labels[r] < 0 || labels[r] >= classes) d[c] = NAN;
            else d[c] = (d[c] / sum - (c == labels[r])) / (float)rows;
        }
    }
}
/* >>nccl: dpar comms whose collectives NCCL runs (DPAR_NCCL) ------------------------------------------ */
#ifdef DPAR_NCCL
#include <nccl.h>
#include <sched.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h> /* the wait's timer slack */
#endif

/* the NCCL comms of one pool share a fate: a worker whose run fails sets it, and every other worker's comm, at its
   next look (each poll of a wait, the start of a call), aborts itself and returns that worker's error. NCCL alone
   would keep them waiting for the failed worker until their deadline. */
typedef struct dpar_cuda__nc_fate {
    pthread_mutex_t lock;
    dpar_status status; /* DPAR_OK, or the first failing worker's error */
    int rank;           /* that worker */
    char msg[512];      /* its text */
} dpar_cuda__nc_fate;

typedef struct dpar_cuda__nc {
    ncclComm_t nc;
    cudaStream_t stream;
    int own_comm, own_stream, aborted; /* aborted: a call failed or timed out; no more calls go to NCCL */
    dpar_cuda__nc_fate *fate;          /* the pool's (dpar_cuda_pool_desc.nccl), else NULL */
    int device, rank, size;
    void *scratch; /* device memory: the checker's exchange, the barrier's word, an in-place alltoall's copy */
    size_t scratch_bytes;
    cudaEvent_t done; /* recorded after a call's work: its wait polls this, not the whole stream (NULL: the stream) */
} dpar_cuda__nc;

static dpar_status dpar_cuda__nccl_check(ncclResult_t r, const dpar_cuda__nc *k, const char *call)
{
    if (r == ncclSuccess) return DPAR_OK;
    return dpar_set_error(DPAR_ESYSTEM, "%s (NCCL rank %d of %d, device %d): %s (%d)%s%s", call, k ? k->rank : -1,
                          k ? k->size : 0, k ? k->device : -1, ncclGetErrorString(r), (int)r,
                          ncclGetLastError(k ? k->nc : NULL) ? ": " : "", ncclGetLastError(k ? k->nc : NULL));
}
static int dpar_cuda__nccl_type(dpar_dtype t, ncclDataType_t *out)
{
    switch (t) {
    case DPAR_F32: *out = ncclFloat32; return 1;
    case DPAR_F64: *out = ncclFloat64; return 1;
    case DPAR_I32: *out = ncclInt32; return 1;
    case DPAR_I64: *out = ncclInt64; return 1;
    case DPAR_U8: *out = ncclUint8; return 1;
    case DPAR_F16: *out = ncclFloat16; return 1;
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21000
    case DPAR_BF16: *out = ncclBfloat16; return 1;
#endif
    default: return 0;
    }
}
/* AVG: NCCL's ncclAvg where NCCL has it (2.10 and later): one pass, no dpar_cuda_divide over the result. Floats:
   NCCL multiplies each rank's input by 1/N rounded to the dtype, then sums (dpar divides the sum once; the bits differ
   unless N is a power of two, and in bf16/f16 1/N itself is rounded to 16 bits); integers: the wrapped sum divided
   once, truncating, as dpar does. dpar's sum-then-divide is kept only for older NCCL: a deterministic comm would keep
   it too, but no NCCL comm is one (dpar_comm_from_ops refuses deterministic) */
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21000
#define DPAR_CUDA__NCCL_AVG 1
#else
#define DPAR_CUDA__NCCL_AVG 0
#endif
static ncclRedOp_t dpar_cuda__nccl_op(dpar_op op)
{
#if DPAR_CUDA__NCCL_AVG
    if (op == DPAR_AVG) return ncclAvg;
#endif
    return op == DPAR_PROD ? ncclProd : op == DPAR_MIN ? ncclMin : op == DPAR_MAX ? ncclMax : ncclSum;
}
/* an average NCCL summed: divide it by N on the stream after */
static int dpar_cuda__nc_divides(dpar_op op) { return op == DPAR_AVG && !DPAR_CUDA__NCCL_AVG; }

static dpar_status dpar_cuda__nc_scratch(dpar_cuda__nc *k, size_t bytes)
{
    cudaError_t e;
    if (bytes <= k->scratch_bytes) return DPAR_OK;
    if (k->scratch) cudaFree(k->scratch);
    k->scratch = NULL;
    k->scratch_bytes = 0;
    if ((e = cudaMalloc(&k->scratch, bytes)) != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: a later launch must not see it */
        k->scratch = NULL;
        return dpar_set_error(DPAR_ENOMEM, "NCCL comm (device %d): cudaMalloc of %zu bytes: %s", k->device, bytes,
                              cudaGetErrorName(e));
    }
    k->scratch_bytes = bytes;
    return DPAR_OK;
}

/* a failed or timed-out comm: no more calls; an owned NCCL comm is aborted (its work in flight ends), one of the
   caller's is left to the caller, who must abort it (ncclCommAbort frees it) */
static void dpar_cuda__nc_fate_set(dpar_cuda__nc_fate *f, dpar_status why, int rank, const char *msg);
/* why: the failure, its text already set (dpar_set_error); returned */
static dpar_status dpar_cuda__nc_abort(dpar_cuda__nc *k, dpar_status why)
{
    if (k->own_comm && !k->aborted) ncclCommAbort(k->nc);
    k->aborted = 1;
    /* the pool's other comms abort too (at their next look), returning this failure and its text: one of theirs may
       be in a call with this one, and ncclCommDestroy would wait for it */
    if (k->fate) dpar_cuda__nc_fate_set(k->fate, why, k->rank, dpar_last_error());
    return why;
}

/* the pool's failure, or DPAR_OK (also without a pool); the failed worker in *rank, its text in msg (may be NULL) */
static dpar_status dpar_cuda__nc_fate_get(dpar_cuda__nc_fate *f, int *rank, char *msg, size_t cap)
{
    dpar_status st;
    if (!f) return DPAR_OK;
    pthread_mutex_lock(&f->lock);
    st = f->status, *rank = f->rank;
    if (st != DPAR_OK && msg) snprintf(msg, cap, "%s", f->msg);
    pthread_mutex_unlock(&f->lock);
    return st;
}
/* the fate of the comm's pool: when another worker has failed, this comm aborts (its work in flight, waiting for that
   worker, ends) and returns that worker's error */
static dpar_status dpar_cuda__nc_fated(dpar_cuda__nc *k)
{
    char msg[512];
    int rank = -1;
    dpar_status st = dpar_cuda__nc_fate_get(k->fate, &rank, msg, sizeof msg);
    if (st == DPAR_OK) return DPAR_OK;
    dpar_cuda__nc_abort(k, st); /* the pool's fate is set already: it stays the first failure's */
    return dpar_set_error(st, "NCCL rank %d (device %d): aborted, as worker %d of the pool failed: %s", k->rank,
                          k->device, rank, msg);
}
static void dpar_cuda__nc_fate_set(dpar_cuda__nc_fate *f, dpar_status why, int rank, const char *msg)
{
    pthread_mutex_lock(&f->lock);
    if (f->status == DPAR_OK) { /* the first failure wins */
        f->status = why, f->rank = rank;
        snprintf(f->msg, sizeof f->msg, "%s", msg);
    }
    pthread_mutex_unlock(&f->lock);
}

/* wait for the stream without blocking in CUDA: NCCL's own errors and the deadline are seen while waiting. The wait
   notices completion within some 25 us: it yields for the first 50 us, then sleeps 20 us at a time (a wake-up every
   20 us, not a spinning core). Linux adds a thread's timer slack (50 us by default) to every sleep, so the slack is
   1 us while this wait sleeps, and the caller's is put back after. */
#define DPAR_CUDA__NC_SPIN_NS 50000u
#define DPAR_CUDA__NC_SLEEP_NS 20000L
static dpar_status dpar_cuda__nc_wait_loop(dpar_cuda__nc *k, uint64_t deadline, const char *what, int *slack)
{
    uint64_t t0 = dpar_time_ns();
    for (;;) {
        cudaError_t e = k->done ? cudaEventQuery(k->done) : cudaStreamQuery(k->stream);
        ncclResult_t ar = ncclSuccess;
        if (e == cudaSuccess) return DPAR_OK;
        if (e != cudaErrorNotReady) /* the queued NCCL work may still wait for the peers: the comm ends */
            return dpar_cuda__nc_abort(k, dpar_set_error(DPAR_ESYSTEM, "%s (NCCL rank %d, device %d): %s (%d): %s",
                                                         what, k->rank, k->device, cudaGetErrorName(e), (int)e,
                                                         cudaGetErrorString(e)));
        if (ncclCommGetAsyncError(k->nc, &ar) == ncclSuccess && ar != ncclSuccess && ar != ncclInProgress)
            /* the comm cannot go on; the stream's work ends with it */
            return dpar_cuda__nc_abort(k, dpar_cuda__nccl_check(ar, k, what));
        DPAR_CUDA__TRY(dpar_cuda__nc_fated(k)); /* another worker of the pool failed */
        if (deadline && dpar_time_ns() >= deadline) {
            return dpar_cuda__nc_abort(
                k, dpar_set_error(DPAR_ETIMEDOUT,
                                  "NCCL rank %d of %d (device %d) timed out after %llu ms in %s; NCCL does not say "
                                  "which rank is missing; %s",
                                  k->rank, k->size, k->device, (unsigned long long)((dpar_time_ns() - t0) / 1000000u),
                                  what,
                                  k->own_comm ? "the NCCL comm is aborted"
                                              : "abort your NCCL comm (ncclCommAbort), then destroy this dpar_comm"));
        }
        if (dpar_time_ns() - t0 < DPAR_CUDA__NC_SPIN_NS) {
            sched_yield();
        } else {
            struct timespec ts = {0, DPAR_CUDA__NC_SLEEP_NS};
#ifdef __linux__
            if (*slack < 0) { /* the first sleep: 1 us of slack (0: nothing to put back) */
                *slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
                if (*slack > 1000) prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
                else *slack = 0;
            }
#endif
            nanosleep(&ts, NULL);
        }
    }
}
static dpar_status dpar_cuda__nc_wait(dpar_cuda__nc *k, uint64_t deadline, const char *what)
{
    int slack = -1; /* the caller's timer slack, once this wait has lowered it */
    dpar_status st;
    /* an event after this call's work: later work that other threads queue on the stream (the legacy stream of a
       dpar_cuda_comm_from_nccl comm, a worker's other tasks) is not waited for */
    if (!k->done && cudaEventCreateWithFlags(&k->done, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        k->done = NULL;
    }
    if (k->done && cudaEventRecord(k->done, k->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        cudaEventDestroy(k->done);
        k->done = NULL;
    }
    st = dpar_cuda__nc_wait_loop(k, deadline, what, &slack);
#ifdef __linux__
    if (slack > 1000) prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
#endif
    return st;
}

static dpar_status dpar_cuda__nc_dead(dpar_cuda__nc *k)
{
    DPAR_CUDA__TRY(dpar_cuda__nc_fated(k));
    return k->aborted ? dpar_set_error(DPAR_EABORTED,
                                       "NCCL rank %d (device %d): the NCCL comm was aborted by an earlier "
                                       "error or timeout",
                                       k->rank, k->device)
                      : DPAR_OK;
}

static dpar_status dpar_cuda__nc_exchange_on(void *user, const void *mine, void *all, size_t bytes, uint64_t deadline)
{
    dpar_cuda__nc *k = (dpar_cuda__nc *)user;
    char *in, *out;
    cudaError_t e;
    DPAR_CUDA__TRY(dpar_cuda__nc_dead(k));
    cudaSetDevice(k->device);
    { /* the peers' allgathers wait for this rank's: a failure from here on ends the comm */
        dpar_status st = dpar_cuda__nc_scratch(k, (size_t)(k->size + 1) * bytes);
        if (st != DPAR_OK) return dpar_cuda__nc_abort(k, st);
    }
    in = (char *)k->scratch + (size_t)k->size * bytes;
    out = (char *)k->scratch;
    if ((e = cudaMemcpyAsync(in, mine, bytes, cudaMemcpyHostToDevice, k->stream)) != cudaSuccess)
        return dpar_cuda__nc_abort(k, dpar_cuda__check(e, "the NCCL comm's contract check", "cudaMemcpyAsync"));
    {
        dpar_status st = dpar_cuda__nccl_check(ncclAllGather(in, out, bytes, ncclUint8, k->nc, k->stream), k,
                                               "ncclAllGather (the contract check)");
        if (st != DPAR_OK) return dpar_cuda__nc_abort(k, st);
    }
    DPAR_CUDA__TRY(dpar_cuda__nc_wait(k, deadline, "the contract check's allgather"));
    return dpar_cuda__check(cudaMemcpy(all, out, (size_t)k->size * bytes, cudaMemcpyDeviceToHost),
                            "the NCCL comm's contract check", "cudaMemcpy");
}

/* the division after a sum where NCCL has no average (integers; NCCL before 2.10): on the stream after the call */
static dpar_status dpar_cuda__nc_divide_after(dpar_cuda__nc *k, const dpar_comm_call *c)
{
    size_t o, l;
    if (!dpar_cuda__nc_divides(c->op) || c->count == 0) return DPAR_OK;
    switch (c->coll) {
    case DPAR_COLL_REDUCE:
        return k->rank == c->root ? dpar_cuda_divide(c->recv, c->recv, c->count, c->dtype, k->size, k->stream)
                                  : DPAR_OK;
    case DPAR_COLL_ALLREDUCE: return dpar_cuda_divide(c->recv, c->recv, c->count, c->dtype, k->size, k->stream);
    case DPAR_COLL_REDUCE_SCATTER:
        dpar_block_range(c->count, k->size, k->rank, &o, &l);
        return l ? dpar_cuda_divide(c->recv, c->recv, l, c->dtype, k->size, k->stream) : DPAR_OK;
    default: return DPAR_OK;
    }
}
/* whether the call needs the comm's scratch (two of them cannot share one NCCL group) */
static int dpar_cuda__nc_uses_scratch(const dpar_comm_call *c)
{
    return c->coll == DPAR_COLL_BARRIER || (c->coll == DPAR_COLL_ALLTOALL && c->send == c->recv && c->count);
}
/* enqueue one call's NCCL operations on the comm's stream (inside the caller's group, if any); the division of an
   average is the caller's (dpar_cuda__nc_divide_after: a kernel launched inside a group would run before it) */
static dpar_status dpar_cuda__nc_enqueue(dpar_cuda__nc *k, const dpar_comm_call *c, int *queued)
{
    ncclDataType_t nt = ncclUint8;
    ncclRedOp_t op = dpar_cuda__nccl_op(c->op);
    size_t es = dpar_dtype_size(c->dtype), N = (size_t)k->size, o, l, q;
    const char *send = (const char *)c->send;
    char *recv = (char *)c->recv;
    ncclResult_t r = ncclSuccess;
    char what[64];
    DPAR_CUDA__TRY(dpar_cuda__nc_dead(k));
    snprintf(what, sizeof what, "%s #%llu", dpar_coll_name(c->coll), (unsigned long long)c->seq);
    if (c->coll != DPAR_COLL_BARRIER && !dpar_cuda__nccl_type(c->dtype, &nt))
        return dpar_set_error(DPAR_EUNSUPPORTED, "NCCL comm: dtype %s is not in this NCCL", dpar_dtype_name(c->dtype));
    if (c->coll != DPAR_COLL_BARRIER && c->count == 0) return DPAR_OK;
    cudaSetDevice(k->device);
    *queued = 1; /* from here, a failure leaves this rank's part of the collective undone or half queued */
    switch (c->coll) {
    case DPAR_COLL_BARRIER:
        DPAR_CUDA__TRY(dpar_cuda__nc_scratch(k, 16));
        r = ncclAllReduce(k->scratch, k->scratch, 1, ncclInt32, ncclSum, k->nc, k->stream);
        break;
    case DPAR_COLL_BROADCAST:
        r = ncclBroadcast(k->rank == c->root ? send : recv, recv, c->count, nt, c->root, k->nc, k->stream);
        break;
    case DPAR_COLL_REDUCE:
        r = ncclReduce(send, k->rank == c->root ? recv : (void *)send, c->count, nt, op, c->root, k->nc, k->stream);
        break;
    case DPAR_COLL_ALLREDUCE: r = ncclAllReduce(send, recv, c->count, nt, op, k->nc, k->stream); break;
    case DPAR_COLL_REDUCE_SCATTER:
        dpar_block_range(c->count, k->size, k->rank, &o, &l);
        if (c->count % N == 0) {
            r = ncclReduceScatter(send, recv, c->count / N, nt, op, k->nc, k->stream);
        } else { /* dpar's uneven blocks: one reduce per block, rooted at its owner */
            ncclGroupStart();
            for (q = 0; q < N && r == ncclSuccess; q++) {
                size_t qo, ql;
                dpar_block_range(c->count, k->size, (int)q, &qo, &ql);
                if (ql)
                    r = ncclReduce(send + qo * es, (int)q == k->rank ? recv : (void *)(send + qo * es), ql, nt, op,
                                   (int)q, k->nc, k->stream);
            }
            {
                ncclResult_t ge = ncclGroupEnd();
                if (r == ncclSuccess) r = ge;
            }
        }
        break;
    case DPAR_COLL_ALLGATHER:
        if (c->count % N == 0) {
            r = ncclAllGather(send, recv, c->count / N, nt, k->nc, k->stream);
        } else { /* uneven blocks: each owner broadcasts its block */
            ncclGroupStart();
            for (q = 0; q < N && r == ncclSuccess; q++) {
                size_t qo, ql;
                dpar_block_range(c->count, k->size, (int)q, &qo, &ql);
                if (ql)
                    r = ncclBroadcast((int)q == k->rank ? send : recv + qo * es, recv + qo * es, ql, nt, (int)q, k->nc,
                                      k->stream);
            }
            {
                ncclResult_t ge = ncclGroupEnd();
                if (r == ncclSuccess) r = ge;
            }
        }
        break;
    case DPAR_COLL_ALLTOALL: {
        size_t block = c->count * es;
        if (send == recv) { /* in place: the blocks I send would be overwritten as others arrive */
            cudaError_t e;
            DPAR_CUDA__TRY(dpar_cuda__nc_scratch(k, N * block));
            if ((e = cudaMemcpyAsync(k->scratch, send, N * block, cudaMemcpyDeviceToDevice, k->stream)) != cudaSuccess)
                return dpar_cuda__check(e, "NCCL alltoall in place", "cudaMemcpyAsync");
            send = (const char *)k->scratch;
        }
        ncclGroupStart();
        for (q = 0; q < N && r == ncclSuccess; q++) {
            r = ncclSend(send + q * block, c->count, nt, (int)q, k->nc, k->stream);
            if (r == ncclSuccess) r = ncclRecv(recv + q * block, c->count, nt, (int)q, k->nc, k->stream);
        }
        {
            ncclResult_t ge = ncclGroupEnd();
            if (r == ncclSuccess) r = ge;
        }
        break;
    }
    case DPAR_COLL_ALLTOALLV: /* one group of a send and a receive per peer with something to move (self too) */
        ncclGroupStart();
        for (q = 0; q < N && r == ncclSuccess; q++) {
            if (c->sendcounts[q])
                r = ncclSend(send + c->sdispls[q] * es, c->sendcounts[q], nt, (int)q, k->nc, k->stream);
            if (r == ncclSuccess && c->recvcounts[q])
                r = ncclRecv(recv + c->rdispls[q] * es, c->recvcounts[q], nt, (int)q, k->nc, k->stream);
        }
        {
            ncclResult_t ge = ncclGroupEnd();
            if (r == ncclSuccess) r = ge;
        }
        break;
    default: return dpar_set_error(DPAR_EINVAL, "NCCL comm: call %d", (int)c->coll);
    }
    return r != ncclSuccess ? dpar_cuda__nccl_check(r, k, what) : DPAR_OK;
}
/* a call that failed after its rank's part was (partly) queued: the comm is aborted, so that its queued operations
   end (they would wait for peers that are not coming) and the peers' calls fail instead of waiting */
static dpar_status dpar_cuda__nc_failed(dpar_cuda__nc *k, dpar_status st, int queued)
{
    return st != DPAR_OK && queued ? dpar_cuda__nc_abort(k, st) : st;
}
static dpar_status dpar_cuda__nc_run_on(void *user, const dpar_comm_call *c)
{
    dpar_cuda__nc *k = (dpar_cuda__nc *)user;
    char what[64];
    int queued = 0;
    dpar_status st;
    snprintf(what, sizeof what, "%s #%llu", dpar_coll_name(c->coll), (unsigned long long)c->seq);
    st = dpar_cuda__nc_enqueue(k, c, &queued);
    if (st == DPAR_OK) st = dpar_cuda__nc_divide_after(k, c);
    DPAR_CUDA__TRY(dpar_cuda__nc_failed(k, st, queued));
    if (c->coll != DPAR_COLL_BARRIER && c->count == 0) return DPAR_OK;
    return dpar_cuda__nc_wait(k, c->deadline_ns, what);
}
/* a batch (dpar_batch_end): every call's operations in one NCCL group, the averages' divisions after it, one wait;
   call by call when two of them would share the scratch, or when an in-place alltoall follows another call (its
   copy to the scratch is queued at once, before the group's earlier operations that it must follow) */
static dpar_status dpar_cuda__nc_run_group_on(void *user, const dpar_comm_call *calls, int n)
{
    dpar_cuda__nc *k = (dpar_cuda__nc *)user;
    ncclResult_t r;
    dpar_status st = DPAR_OK;
    char what[96];
    int i, scratch = 0, queued = 0;
    for (i = 0; i < n; i++) {
        scratch += dpar_cuda__nc_uses_scratch(&calls[i]);
        if (i > 0 && calls[i].coll == DPAR_COLL_ALLTOALL && calls[i].send == calls[i].recv && calls[i].count)
            scratch = 2; /* its copy would run before the calls queued ahead of it in the group */
    }
    if (n == 1 || scratch > 1) {
        for (i = 0; i < n && st == DPAR_OK; i++) st = dpar_cuda__nc_run_on(user, &calls[i]);
        return st;
    }
    DPAR_CUDA__TRY(dpar_cuda__nc_dead(k));
    cudaSetDevice(k->device);
    ncclGroupStart();
    for (i = 0; i < n && st == DPAR_OK; i++) st = dpar_cuda__nc_enqueue(k, &calls[i], &queued);
    r = ncclGroupEnd(); /* launches what the group holds, also after a failure */
    snprintf(what, sizeof what, "a batch of %d calls (%s #%llu ...)", n, dpar_coll_name(calls[0].coll),
             (unsigned long long)calls[0].seq);
    if (st == DPAR_OK && r != ncclSuccess) st = dpar_cuda__nccl_check(r, k, what), queued = 1;
    for (i = 0; i < n && st == DPAR_OK; i++) st = dpar_cuda__nc_divide_after(k, &calls[i]);
    DPAR_CUDA__TRY(dpar_cuda__nc_failed(k, st, queued));
    return dpar_cuda__nc_wait(k, calls[n - 1].deadline_ns, what);
}

/* the calling thread's current device is the same after a call as before */
static dpar_status dpar_cuda__nc_exchange(void *user, const void *mine, void *all, size_t bytes, uint64_t deadline)
{
    dpar_cuda__device_kept kept;
    return dpar_cuda__nc_exchange_on(user, mine, all, bytes, deadline);
}
static dpar_status dpar_cuda__nc_run(void *user, const dpar_comm_call *c)
{
    dpar_cuda__device_kept kept;
    return dpar_cuda__nc_run_on(user, c);
}
static dpar_status dpar_cuda__nc_run_group(void *user, const dpar_comm_call *calls, int n)
{
    dpar_cuda__device_kept kept;
    return dpar_cuda__nc_run_group_on(user, calls, n);
}

static void dpar_cuda__nc_destroy(void *user)
{
    dpar_cuda__nc *k = (dpar_cuda__nc *)user;
    int before = -1;
    cudaGetDevice(&before);
    cudaSetDevice(k->device);
    if (k->own_comm && !k->aborted) { /* aborted ones are freed already */
        int rank;
        if (dpar_cuda__nc_fate_get(k->fate, &rank, NULL, 0) != DPAR_OK)
            ncclCommAbort(k->nc); /* the pool failed: the other ranks' comms may be aborted; never wait for them */
        else ncclCommDestroy(k->nc);
    }
    if (k->own_stream) cudaStreamDestroy(k->stream);
    if (k->scratch) cudaFree(k->scratch);
    if (k->done) cudaEventDestroy(k->done);
    if (before >= 0) cudaSetDevice(before);
    free(k);
}

/* the comm's memory for dpar_zero and dpar_fsdp (dpar_comm_from_ops's desc.memory): the comm's device, every op on
   its stream and finished before it returns, as its NCCL calls are */
static dpar_status dpar_cuda__nm_done(const dpar_cuda__nc *k, cudaError_t e, int before, const char *what)
{
    if (e == cudaSuccess) e = cudaStreamSynchronize(k->stream);
    if (before >= 0) cudaSetDevice(before);
    if (e == cudaSuccess) return DPAR_OK;
    (void)cudaGetLastError();
    return dpar_set_error(DPAR_ESYSTEM, "%s on NCCL rank %d's device %d: %s", what, k->rank, k->device,
                          cudaGetErrorName(e));
}
static int dpar_cuda__nm_enter(const dpar_cuda__nc *k)
{
    int before = -1;
    cudaGetDevice(&before);
    cudaSetDevice(k->device);
    return before;
}
static void *dpar_cuda__nm_alloc(void *user, int worker, size_t bytes)
{
    const dpar_cuda__nc *k = (const dpar_cuda__nc *)user;
    void *p = NULL;
    int before = dpar_cuda__nm_enter(k);
    (void)worker;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) (void)cudaGetLastError(), p = NULL;
    if (before >= 0) cudaSetDevice(before);
    return p;
}
static void dpar_cuda__nm_free(void *user, int worker, void *p)
{
    const dpar_cuda__nc *k = (const dpar_cuda__nc *)user;
    int before = dpar_cuda__nm_enter(k);
    (void)worker;
    cudaStreamSynchronize(k->stream);
    cudaFree(p);
    if (before >= 0) cudaSetDevice(before);
}
static dpar_status dpar_cuda__nm_copy(void *user, int worker, void *dst, const void *src, size_t bytes)
{
    const dpar_cuda__nc *k = (const dpar_cuda__nc *)user;
    int before = dpar_cuda__nm_enter(k);
    (void)worker;
    return dpar_cuda__nm_done(k, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, k->stream), before,
                              "cudaMemcpyAsync (dpar_zero, dpar_fsdp)");
}
static dpar_status dpar_cuda__nm_to_host(void *user, int worker, void *host, const void *dev, size_t bytes)
{
    return dpar_cuda__nm_copy(user, worker, host, dev, bytes); /* cudaMemcpyDefault, waited for */
}
static dpar_status dpar_cuda__nm_from_host(void *user, int worker, void *dev, const void *host, size_t bytes)
{
    return dpar_cuda__nm_copy(user, worker, dev, host, bytes);
}
static dpar_status dpar_cuda__nm_clear(void *user, int worker, void *p, size_t bytes)
{
    const dpar_cuda__nc *k = (const dpar_cuda__nc *)user;
    int before = dpar_cuda__nm_enter(k);
    (void)worker;
    return dpar_cuda__nm_done(k, cudaMemsetAsync(p, 0, bytes, k->stream), before, "cudaMemsetAsync (dpar_fsdp)");
}
/* a kernel's status (its launch's text) or the stream's after it */
static dpar_status dpar_cuda__nm_kernel(const dpar_cuda__nc *k, dpar_status st, int before, const char *what)
{
    if (st != DPAR_OK) {
        if (before >= 0) cudaSetDevice(before);
        return st;
    }
    return dpar_cuda__nm_done(k, cudaSuccess, before, what);
}
static dpar_status dpar_cuda__nm_reduce(void *user, int worker, void *out, const void *a, const void *b, size_t n,
                                        dpar_dtype t, dpar_op op, int div)
{
    const dpar_cuda__nc *k = (const dpar_cuda__nc *)user;
    int before = dpar_cuda__nm_enter(k);
    (void)worker;
    return dpar_cuda__nm_kernel(k, dpar_cuda_reduce(out, a, b, n, t, op, div, k->stream), before, "dpar_cuda_reduce");
}
static dpar_status dpar_cuda__nm_divide(void *user, int worker, void *out, const void *in, size_t n, dpar_dtype t,
                                        int div)
{
    const dpar_cuda__nc *k = (const dpar_cuda__nc *)user;
    int before = dpar_cuda__nm_enter(k);
    (void)worker;
    return dpar_cuda__nm_kernel(k, dpar_cuda_divide(out, in, n, t, div, k->stream), before, "dpar_cuda_divide");
}
static dpar_status dpar_cuda__nm_update(void *user, int worker, const dpar_optim_update *u)
{
    const dpar_cuda__nc *k = (const dpar_cuda__nc *)user;
    int before = dpar_cuda__nm_enter(k);
    dpar_status st =
        u->kind == DPAR_OPTIM_SGD
            ? dpar_cuda_sgd_f32(u->params, u->m, u->grads, u->n, u->lr, u->momentum, u->weight_decay, k->stream)
            : dpar_cuda_adamw_f32(u->params, u->m, u->v, u->grads, u->n, u->lr, u->beta1, u->beta2, u->eps,
                                  u->weight_decay, u->step, k->stream);
    (void)worker;
    return dpar_cuda__nm_kernel(k, st, before, "an optimizer step (dpar_zero, dpar_fsdp)");
}

static dpar_status dpar_cuda__nccl_wrap(ncclComm_t nc, cudaStream_t stream, int own_comm, int own_stream,
                                        dpar_cuda__nc_fate *fate, const dpar_comm_desc *desc, dpar_comm **out)
{
    dpar_cuda__nc *k = (dpar_cuda__nc *)calloc(1, sizeof *k);
    dpar_comm_ops ops;
    dpar_comm_desc d;
    dpar_status st;
    if (!k) return dpar_set_error(DPAR_ENOMEM, "dpar_cuda_comm_from_nccl: out of memory");
    k->nc = nc;
    k->stream = stream;
    k->fate = fate;
    if ((st = dpar_cuda__nccl_check(ncclCommCount(nc, &k->size), k, "ncclCommCount")) != DPAR_OK ||
        (st = dpar_cuda__nccl_check(ncclCommUserRank(nc, &k->rank), k, "ncclCommUserRank")) != DPAR_OK ||
        (st = dpar_cuda__nccl_check(ncclCommCuDevice(nc, &k->device), k, "ncclCommCuDevice")) != DPAR_OK) {
        free(k);
        return st;
    }
    memset(&ops, 0, sizeof ops);
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (!d.name || !*d.name) d.name = "nccl";
    ops.user = k;
    ops.rank = k->rank;
    ops.size = k->size;
    ops.run = dpar_cuda__nc_run;
    ops.exchange = dpar_cuda__nc_exchange;
    ops.destroy = dpar_cuda__nc_destroy;
    ops.run_group = dpar_cuda__nc_run_group;
    memset(&d.memory, 0, sizeof d.memory); /* the buffers are this device's: dpar_zero and dpar_fsdp step there */
    d.memory.user = k;
    d.memory.reduce = dpar_cuda__nm_reduce;
    d.memory.divide = dpar_cuda__nm_divide;
    d.memory.copy = dpar_cuda__nm_copy;
    d.memory.alloc = dpar_cuda__nm_alloc;
    d.memory.free = dpar_cuda__nm_free;
    d.memory.clear = dpar_cuda__nm_clear;
    d.memory.update = dpar_cuda__nm_update;
    d.memory.to_host = dpar_cuda__nm_to_host;
    d.memory.from_host = dpar_cuda__nm_from_host;
    if ((st = dpar_comm_from_ops(&ops, &d, out)) != DPAR_OK) {
        free(k);
        return st;
    }
    k->own_comm = own_comm; /* only now: on failure the caller still owns them */
    k->own_stream = own_stream;
    return DPAR_OK;
}
#endif /* DPAR_NCCL */

extern "C" DPAR_API dpar_status dpar_cuda_comm_from_nccl(void *nccl_comm, void *stream, const dpar_comm_desc *desc,
                                                         dpar_comm **out)
{
    if (!out) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_comm_from_nccl: out is NULL");
    *out = NULL;
    if (!nccl_comm) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_comm_from_nccl: nccl_comm is NULL");
#ifdef DPAR_NCCL
    return dpar_cuda__nccl_wrap((ncclComm_t)nccl_comm, (cudaStream_t)stream, 0, 0, NULL, desc, out);
#else
    (void)stream, (void)desc;
    return dpar_set_error(DPAR_EUNSUPPORTED, "dpar_cuda_comm_from_nccl: dpar_cuda.h's implementation was built "
                                             "without DPAR_NCCL (define it and link -lnccl)");
#endif
}

extern "C" DPAR_API dpar_status dpar_cuda_nccl_create(const dpar_cuda_nccl_desc *desc, dpar_comm **out)
{
    if (!out) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_nccl_create: out is NULL");
    *out = NULL;
    if (!desc || !desc->host) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_nccl_create: desc or desc->host is NULL");
#ifdef DPAR_NCCL
    {
        /* rank 0's status and id travel together: a failure there ends every rank's call */
        struct {
            int32_t status;
            ncclUniqueId id;
        } msg;
        int rank = dpar_comm_rank(desc->host), size = dpar_comm_size(desc->host), before = -1;
        int32_t failed = 0, any = 0;
        ncclComm_t nc = NULL;
        cudaStream_t s = (cudaStream_t)desc->stream;
        dpar_status st;
        cudaError_t e;
        memset(&msg, 0, sizeof msg);
        if (rank == 0) {
            ncclResult_t r = ncclGetUniqueId(&msg.id);
            msg.status = r == ncclSuccess ? 0 : (int32_t)DPAR_ESYSTEM;
            if (r != ncclSuccess) dpar_cuda__nccl_check(r, NULL, "ncclGetUniqueId");
        }
        if ((st = dpar_broadcast(desc->host, &msg, &msg, sizeof msg, DPAR_U8, 0)) != DPAR_OK) return st;
        if (msg.status)
            return rank == 0 ? (dpar_status)msg.status
                             : dpar_set_error((dpar_status)msg.status, "dpar_cuda_nccl_create: rank 0 could not make "
                                                                       "an NCCL id");
        cudaGetDevice(&before);
        /* this rank's device and stream, then every rank agrees before ncclCommInitRank, which would wait forever
           for a rank that gave up. A stream made here is a blocking one: it follows the legacy default stream */
        e = cudaSetDevice(desc->device);
        if (e == cudaSuccess && !s) e = cudaStreamCreate(&s);
        failed = e != cudaSuccess;
        if (failed) dpar_cuda__check(e, "dpar_cuda_nccl_create", "cudaSetDevice / cudaStreamCreate");
        if ((st = dpar_allreduce(desc->host, &failed, &any, 1, DPAR_I32, DPAR_MAX)) == DPAR_OK && any && !failed)
            st = dpar_set_error(DPAR_ESYSTEM, "dpar_cuda_nccl_create: another rank could not set up its device");
        else if (st == DPAR_OK && failed) st = DPAR_ESYSTEM;
        if (st == DPAR_OK)
            st = dpar_cuda__nccl_check(ncclCommInitRank(&nc, size, msg.id, rank), NULL, "ncclCommInitRank");
        if (st == DPAR_OK) st = dpar_cuda__nccl_wrap(nc, s, 1, !desc->stream, NULL, &desc->comm, out);
        if (st != DPAR_OK) {
            if (nc) ncclCommAbort(nc); /* never waits for the other ranks, as destroy would */
            if (!desc->stream && s) cudaStreamDestroy(s);
        }
        if (before >= 0) cudaSetDevice(before);
        return st;
    }
#else
    return dpar_set_error(DPAR_EUNSUPPORTED, "dpar_cuda_nccl_create: dpar_cuda.h's implementation was built without "
                                             "DPAR_NCCL (define it and link -lnccl)");
#endif
}

/* >>cuda_pool: the GPU workers ---------------------------------------------------------------------- */
/* the allocator hook without dpar.h's private helpers (its implementation may be in another file) */
static void *dpar_cuda__calloc(const dpar_allocator *a, size_t n, size_t size)
{
    void *p = a->alloc ? a->alloc(a->user, n * size) : malloc(n * size);
    if (p) memset(p, 0, n * size);
    return p;
}
static void dpar_cuda__free(const dpar_allocator *a, void *p)
{
    if (!p) return;
    if (a->free) a->free(a->user, p);
    else free(p);
}

typedef struct dpar_cuda__task dpar_cuda__task;
struct dpar_cuda_pool {
    dpar_pool *threads; /* T host threads: the caller is worker 0 during a run */
    int n;
    dpar_cuda_worker *w; /* [n] */
    dpar_allocator allocator;
    char name[32];
    /* the tasks of this epoch: handle h is tasks[h - 1] */
    pthread_mutex_t tlock;
    pthread_mutex_t *wlocks; /* [n]: one task of a worker enqueues at a time (its cuBLAS handle is not shared) */
    dpar_cuda__task **tasks;
    size_t ntasks, captasks;
    /* the comm over the workers */
    dpar_group *group;
    dpar_cuda_path path;
    unsigned char *peer;     /* [n * n]: worker i's kernels may read worker j's memory */
    pthread_mutex_t *blocks; /* [n]: a worker's bounce buffer is used by one copy at a time */
    void **bounce;           /* [n]: pinned host memory of the HOST path (made on first use) */
    /* stream-ordered (desc.stream_ordered): worker i's tickets are a ring of DPAR_CUDA__EVENTS events; a ticket's
       event is recorded again only once its point has run (cudaEventSynchronize), so a wait that finds its event
       holding a later ticket has nothing left to wait for (waiting on the later point could deadlock two streams) */
    int stream_ordered;
    int timeout_ms;           /* dpar_cuda_comm_sync's deadline (-1: none) */
    void **order;             /* [n]: where worker i's comm queues its work (NULL: its stream) */
    cudaEvent_t *ev;          /* [n * DPAR_CUDA__EVENTS] */
    uint64_t *ev_ticket;      /* [n * DPAR_CUDA__EVENTS]: the ticket the event holds (0: never recorded) */
    uint64_t *ev_seq;         /* [n]: worker i's last ticket */
    pthread_mutex_t *ev_lock; /* [n]: a record of worker i's against a wait on its events */
#ifdef DPAR_NCCL
    dpar_cuda__nc_fate *fate; /* the NCCL comms' shared failure (desc.nccl), else NULL */
#endif
};
#define DPAR_CUDA__EVENTS 64
#define DPAR_CUDA__BOUNCE ((size_t)4 << 20) /* the HOST path's pinned buffer per worker */
/* each segment of the ring costs a launch and a stream synchronisation (some 15 us under a VM): on an H200, 2 workers
   on one device, a 256 MiB allreduce took 3863 us with 1 MiB segments, 1172 with 4 MiB, 536 with 16 MiB, 367 with
   64 MiB; 16 MiB messages 66 us with 4 MiB, 42 with 16 or 64 MiB (docs/cuda.md, 'Speed') */
/* a stream-ordered pool's ring pays a launch per segment, no synchronisation, and its segments overlap across the
   workers' streams: smaller ones pipeline (4 MiB: not yet measured on a GPU; docs/cuda.md, 'Stream-ordered calls') */
#ifndef DPAR_CUDA_ORDERED_SEGMENT_BYTES
#define DPAR_CUDA_ORDERED_SEGMENT_BYTES ((size_t)4 << 20)
#endif
#ifndef DPAR_CUDA_SEGMENT_BYTES
#define DPAR_CUDA_SEGMENT_BYTES ((size_t)64 << 20)
#endif

/* a host wait's deadline within the pool's comm timeout (0: none) */
static uint64_t dpar_cuda__deadline(const dpar_cuda_pool *p)
{
    return p->timeout_ms < 0 ? 0 : dpar_time_ns() + (uint64_t)p->timeout_ms * 1000000u;
}
/* wait for an event (ev NULL: a stream) without spinning a core, 20 us naps, until it has run or failed, or the
   deadline has passed (then cudaErrorNotReady) */
static cudaError_t dpar_cuda__poll(cudaEvent_t ev, cudaStream_t s, uint64_t deadline)
{
    cudaError_t e;
    while ((e = ev ? cudaEventQuery(ev) : cudaStreamQuery(s)) == cudaErrorNotReady) {
        struct timespec nap = {0, 20000};
        if (deadline && dpar_time_ns() >= deadline) break;
        nanosleep(&nap, NULL);
    }
    return e;
}

/* a CUDA error of worker w: "what (worker r, device d): cudaErrorX (code): text" */
static dpar_status dpar_cuda__worker_error(const dpar_cuda_worker *w, cudaError_t e, const char *what)
{
    return dpar_set_error(DPAR_ESYSTEM, "%s (worker %d, device %d): %s (%d): %s", what, w->rank, w->device,
                          cudaGetErrorName(e), (int)e, cudaGetErrorString(e));
}

static dpar_status dpar_cuda__worker_start_on(void *user, int t, int n)
{
    dpar_cuda_pool *p = (dpar_cuda_pool *)user;
    dpar_cuda_worker *w = &p->w[t];
    cudaStream_t s = NULL;
    cublasHandle_t h = NULL;
    cudaError_t e;
    cublasStatus_t b;
    (void)n;
    if ((e = cudaSetDevice(w->device)) != cudaSuccess) return dpar_cuda__worker_error(w, e, "cudaSetDevice");
    if ((e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) != cudaSuccess)
        return dpar_cuda__worker_error(w, e, "cudaStreamCreateWithFlags");
    w->stream = s;
    if ((b = cublasCreate(&h)) != CUBLAS_STATUS_SUCCESS)
        return dpar_set_error(DPAR_ESYSTEM, "cublasCreate (worker %d, device %d): %s", t, w->device,
                              cublasGetStatusName(b));
    w->cublas = h;
    if ((b = cublasSetStream(h, s)) != CUBLAS_STATUS_SUCCESS)
        return dpar_set_error(DPAR_ESYSTEM, "cublasSetStream (worker %d, device %d): %s", t, w->device,
                              cublasGetStatusName(b));
    if (w->scratch_bytes && (e = cudaMalloc(&w->scratch, w->scratch_bytes)) != cudaSuccess) {
        w->scratch = NULL;
        return dpar_cuda__worker_error(w, e, "cudaMalloc of the scratch");
    }
    if ((e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) != cudaSuccess)
        return dpar_cuda__worker_error(w, e, "cudaStreamCreateWithFlags (the comm's stream)");
    w->comm_stream = s;
    if (p->stream_ordered) {
        int k;
        for (k = 0; k < DPAR_CUDA__EVENTS; k++)
            if ((e = cudaEventCreateWithFlags(&p->ev[(size_t)t * DPAR_CUDA__EVENTS + k], cudaEventDisableTiming)) !=
                cudaSuccess) {
                p->ev[(size_t)t * DPAR_CUDA__EVENTS + k] = NULL;
                return dpar_cuda__worker_error(w, e, "cudaEventCreateWithFlags (the comm's tickets)");
            }
    }
    {
        int q;
        for (q = 0; q < p->n; q++) { /* read the devices this worker may read directly */
            int other = p->w[q].device;
            if (other == w->device || !p->peer[(size_t)t * (size_t)p->n + (size_t)q]) continue;
            e = cudaDeviceEnablePeerAccess(other, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError(); /* another worker of this device */
            else if (e != cudaSuccess) return dpar_cuda__worker_error(w, e, "cudaDeviceEnablePeerAccess");
        }
    }
    DPAR_CUDA__TRY(dpar_group_join(p->group, t, &w->ring));
    w->comm = w->ring;
    return DPAR_OK;
}

/* frees what worker t owns; the first error is returned, everything is freed all the same */
static dpar_status dpar_cuda__worker_stop_on(void *user, int t, int n)
{
    dpar_cuda_pool *p = (dpar_cuda_pool *)user;
    dpar_cuda_worker *w = &p->w[t];
    dpar_status st = DPAR_OK;
    cudaError_t e;
    (void)n;
    /* a failure is reported, and everything is freed all the same */
    if ((e = cudaSetDevice(w->device)) != cudaSuccess) st = dpar_cuda__worker_error(w, e, "cudaSetDevice");
    dpar_comm_destroy(w->nccl); /* and its NCCL comm (aborted if the pool failed: nothing of it waits any more) */
    w->nccl = NULL;
    /* the streams finish before the ring's memory goes (its scratch, through the pool's free callback) */
    if (w->stream && (e = cudaStreamSynchronize((cudaStream_t)w->stream)) != cudaSuccess && st == DPAR_OK)
        st = dpar_cuda__worker_error(w, e, "cudaStreamSynchronize");
    if (w->comm_stream && cudaStreamSynchronize((cudaStream_t)w->comm_stream) != cudaSuccess) (void)cudaGetLastError();
    dpar_comm_destroy(w->ring);
    w->comm = w->ring = NULL;
    if (w->comm_stream) cudaStreamDestroy((cudaStream_t)w->comm_stream);
    w->comm_stream = NULL;
    if (p->ev) {
        int k;
        for (k = 0; k < DPAR_CUDA__EVENTS; k++) {
            cudaEvent_t *ev = &p->ev[(size_t)t * DPAR_CUDA__EVENTS + k];
            if (*ev) cudaEventDestroy(*ev);
            *ev = NULL;
        }
    }
    if (p->bounce && p->bounce[t]) cudaFreeHost(p->bounce[t]);
    if (p->bounce) p->bounce[t] = NULL;
    if (w->cublas) cublasDestroy((cublasHandle_t)w->cublas);
    if (w->scratch) cudaFree(w->scratch);
    if (w->stream) cudaStreamDestroy((cudaStream_t)w->stream);
    w->cublas = w->scratch = w->stream = NULL;
    return st;
}

/* worker 0 is the caller's thread: its current device is the same after as before */
static dpar_status dpar_cuda__on_worker(dpar_status (*fn)(void *, int, int), void *user, int t, int n)
{
    int before = -1;
    dpar_status st;
    if (t == 0) cudaGetDevice(&before);
    st = fn(user, t, n);
    if (before >= 0) cudaSetDevice(before);
    return st;
}
static dpar_status dpar_cuda__worker_start(void *user, int t, int n)
{
    return dpar_cuda__on_worker(dpar_cuda__worker_start_on, user, t, n);
}
static dpar_status dpar_cuda__worker_stop(void *user, int t, int n)
{
    return dpar_cuda__on_worker(dpar_cuda__worker_stop_on, user, t, n);
}

static void dpar_cuda__tasks_free(dpar_cuda_pool *p);
static void dpar_cuda__pool_free(dpar_cuda_pool *p)
{
    dpar_allocator a = p->allocator;
    int i;
    dpar_cuda__tasks_free(p);
    pthread_mutex_destroy(&p->tlock);
    if (p->threads) {
        dpar_pool_run(p->threads, dpar_cuda__worker_stop, p);
        dpar_pool_destroy(p->threads);
    }
#ifdef DPAR_NCCL
    if (p->fate) { /* after the workers' NCCL comms, which read it */
        pthread_mutex_destroy(&p->fate->lock);
        dpar_cuda__free(&a, p->fate);
    }
#endif
    if (p->wlocks) {
        for (i = 0; i < p->n; i++) pthread_mutex_destroy(&p->wlocks[i]);
        dpar_cuda__free(&a, p->wlocks);
    }
    if (p->blocks) {
        for (i = 0; i < p->n; i++) pthread_mutex_destroy(&p->blocks[i]);
        dpar_cuda__free(&a, p->blocks);
    }
    dpar_group_destroy(p->group);
    if (p->ev_lock) {
        for (i = 0; i < p->n; i++) pthread_mutex_destroy(&p->ev_lock[i]);
        dpar_cuda__free(&a, p->ev_lock);
    }
    dpar_cuda__free(&a, p->order);
    dpar_cuda__free(&a, p->ev);
    dpar_cuda__free(&a, p->ev_ticket);
    dpar_cuda__free(&a, p->ev_seq);
    dpar_cuda__free(&a, p->bounce);
    dpar_cuda__free(&a, p->peer);
    dpar_cuda__free(&a, p->w);
    dpar_cuda__free(&a, p);
}

/* ---- the comm's callbacks (dpar_comm_memory): the worker's device current, kernels on its comm stream, each
   finished before it returns; in a stream-ordered pool, queued on the worker's order stream and left to run ---- */
/* where worker w's comm work goes */
static cudaStream_t dpar_cuda__c_stream(const dpar_cuda_pool *p, const dpar_cuda_worker *w)
{
    if (!p->stream_ordered) return (cudaStream_t)w->comm_stream;
    return (cudaStream_t)(p->order[w->rank] ? p->order[w->rank] : w->stream);
}
static dpar_status dpar_cuda__c_sync(const dpar_cuda_worker *w, dpar_status st, const char *what)
{
    cudaError_t e;
    if (st != DPAR_OK) return st;               /* a launch that failed: its text names the kernel and CUDA's error */
    if (w->comm_stream == NULL) return DPAR_OK; /* never: a started worker has its comm stream */
    e = cudaStreamSynchronize((cudaStream_t)w->comm_stream);
    return e == cudaSuccess ? DPAR_OK : dpar_cuda__worker_error(w, e, what);
}
/* after a launch or copy: host-blocking pools wait for it, stream-ordered ones leave it queued */
static dpar_status dpar_cuda__c_done(const dpar_cuda_pool *p, const dpar_cuda_worker *w, dpar_status st,
                                     const char *what)
{
    return p->stream_ordered ? st : dpar_cuda__c_sync(w, st, what);
}
static const dpar_cuda_worker *dpar_cuda__c_worker(void *user, int worker)
{
    const dpar_cuda_worker *w = &((dpar_cuda_pool *)user)->w[worker];
    cudaSetDevice(w->device); /* a progress thread acting for the worker has no device of its own */
    return w;
}
/* stream-ordered: a ticket, the point of worker's order stream after everything queued on it so far */
static dpar_status dpar_cuda__c_record(void *user, int worker, uint64_t *ticket)
{
    dpar_cuda_pool *p = (dpar_cuda_pool *)user;
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    uint64_t seq, old;
    size_t k;
    cudaError_t e = cudaSuccess;
    pthread_mutex_lock(&p->ev_lock[worker]);
    seq = ++p->ev_seq[worker];
    k = (size_t)worker * DPAR_CUDA__EVENTS + (size_t)(seq % DPAR_CUDA__EVENTS);
    old = p->ev_ticket[k];
    pthread_mutex_unlock(&p->ev_lock[worker]);
    /* its old point has run before the event moves on: a late wait has none left. Waited for outside the lock, so
       the peers' waits on this worker's other events go on meanwhile (only this worker's thread records its events,
       and the event still holds its old point for a peer that waits on it now); polled with the comm's deadline,
       no core spun (the host is 64 tickets ahead of this stream: its latency is not the call's) */
    if (old && (e = dpar_cuda__poll(p->ev[k], NULL, dpar_cuda__deadline(p))) == cudaErrorNotReady) {
        *ticket = 0;
        return dpar_set_error(DPAR_ETIMEDOUT,
                              "worker %d (device %d): its comm stream has not reached ticket %llu after %d ms: a "
                              "peer's stream it waits for is stuck",
                              worker, w->device, (unsigned long long)old, p->timeout_ms);
    }
    pthread_mutex_lock(&p->ev_lock[worker]);
    if (e == cudaSuccess) e = cudaEventRecord(p->ev[k], dpar_cuda__c_stream(p, w));
    if (e == cudaSuccess) p->ev_ticket[k] = seq;
    pthread_mutex_unlock(&p->ev_lock[worker]);
    *ticket = seq;
    return e == cudaSuccess ? DPAR_OK : dpar_cuda__worker_error(w, e, "cudaEventRecord (a comm ticket)");
}
/* stream-ordered: worker's order stream waits for peer's ticket */
static dpar_status dpar_cuda__c_wait(void *user, int worker, int peer, uint64_t ticket)
{
    dpar_cuda_pool *p = (dpar_cuda_pool *)user;
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    size_t k = (size_t)peer * DPAR_CUDA__EVENTS + (size_t)(ticket % DPAR_CUDA__EVENTS);
    cudaError_t e = cudaSuccess;
    pthread_mutex_lock(&p->ev_lock[peer]);
    if (p->ev_ticket[k] == ticket) e = cudaStreamWaitEvent(dpar_cuda__c_stream(p, w), p->ev[k], 0);
    pthread_mutex_unlock(&p->ev_lock[peer]); /* else: recorded again, so ticket's point has run */
    return e == cudaSuccess ? DPAR_OK : dpar_cuda__worker_error(w, e, "cudaStreamWaitEvent (a peer's comm ticket)");
}
static dpar_status dpar_cuda__c_enter(void *user, int worker)
{
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    cudaError_t e;
    if (((dpar_cuda_pool *)user)->stream_ordered) return DPAR_OK; /* the work queues behind the inputs' writes */
    e = cudaStreamSynchronize((cudaStream_t)w->stream);
    return e == cudaSuccess ? DPAR_OK
                            : dpar_cuda__worker_error(w, e, "a comm call waiting for the worker's stream (its inputs)");
}
static dpar_status dpar_cuda__c_reduce(void *user, int worker, void *out, const void *a, const void *b, size_t n,
                                       dpar_dtype t, dpar_op op, int div)
{
    const dpar_cuda_pool *p = (const dpar_cuda_pool *)user;
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    return dpar_cuda__c_done(p, w, dpar_cuda_reduce(out, a, b, n, t, op, div, dpar_cuda__c_stream(p, w)),
                             "dpar_cuda_reduce");
}
static dpar_status dpar_cuda__c_combine(void *user, int worker, void *out, const void *const *in, int ranks, size_t lo,
                                        size_t n, size_t count, dpar_dtype t, dpar_op op)
{
    const dpar_cuda_pool *p = (const dpar_cuda_pool *)user;
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    return dpar_cuda__c_done(p, w, dpar_cuda__combine(out, in, ranks, lo, n, count, t, op, dpar_cuda__c_stream(p, w)),
                             "dpar_cuda__combine");
}
static dpar_status dpar_cuda__c_divide(void *user, int worker, void *out, const void *in, size_t n, dpar_dtype t,
                                       int div)
{
    const dpar_cuda_pool *p = (const dpar_cuda_pool *)user;
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    return dpar_cuda__c_done(p, w, dpar_cuda_divide(out, in, n, t, div, dpar_cuda__c_stream(p, w)), "dpar_cuda_divide");
}
/* the device a pointer's memory is on, or -1 (host memory) */
static int dpar_cuda__device_of(const void *ptr)
{
    cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, ptr) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged ? at.device : -1;
}
static dpar_status dpar_cuda__c_copy(void *user, int worker, void *dst, const void *src, size_t bytes)
{
    dpar_cuda_pool *p = (dpar_cuda_pool *)user;
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    cudaStream_t s = dpar_cuda__c_stream(p, w);
    cudaError_t e = cudaSuccess;
    if (p->path == DPAR_CUDA_PATH_HOST) { /* through this worker's pinned buffer, 4 MiB at a time */
        size_t o;
        pthread_mutex_lock(&p->blocks[worker]);
        if (!p->bounce[worker] &&
            (e = cudaHostAlloc(&p->bounce[worker], DPAR_CUDA__BOUNCE, cudaHostAllocPortable)) != cudaSuccess) {
            (void)cudaGetLastError();
            p->bounce[worker] = NULL;
        }
        for (o = 0; o < bytes && e == cudaSuccess; o += DPAR_CUDA__BOUNCE) {
            size_t l = bytes - o < DPAR_CUDA__BOUNCE ? bytes - o : DPAR_CUDA__BOUNCE;
            e = cudaMemcpyAsync(p->bounce[worker], (const char *)src + o, l, cudaMemcpyDefault, s);
            if (e == cudaSuccess) e = cudaMemcpyAsync((char *)dst + o, p->bounce[worker], l, cudaMemcpyDefault, s);
            if (e == cudaSuccess) e = cudaStreamSynchronize(s); /* the buffer is reused by the next piece */
        }
        pthread_mutex_unlock(&p->blocks[worker]);
        return e == cudaSuccess ? DPAR_OK : dpar_cuda__worker_error(w, e, "a comm copy through pinned host memory");
    }
    if (p->path == DPAR_CUDA_PATH_MEMCPY) {
        int sd = dpar_cuda__device_of(src), dd = dpar_cuda__device_of(dst);
        if (sd >= 0 && dd >= 0 && sd != dd) {
            e = cudaMemcpyPeerAsync(dst, dd, src, sd, bytes, s);
            return dpar_cuda__c_done(p, w,
                                     e == cudaSuccess ? DPAR_OK : dpar_cuda__worker_error(w, e, "cudaMemcpyPeerAsync"),
                                     "cudaMemcpyPeerAsync");
        }
    }
    e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s); /* unified addressing: any two devices */
    return dpar_cuda__c_done(p, w, e == cudaSuccess ? DPAR_OK : dpar_cuda__worker_error(w, e, "cudaMemcpyAsync"),
                             "cudaMemcpyAsync in a comm call");
}
/* dpar_zero's and dpar_fsdp's: zeros, and the optimizer's step (the kernels that give the host's bits) */
static dpar_status dpar_cuda__c_clear(void *user, int worker, void *ptr, size_t bytes)
{
    const dpar_cuda_pool *p = (const dpar_cuda_pool *)user;
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    cudaError_t e = cudaMemsetAsync(ptr, 0, bytes, dpar_cuda__c_stream(p, w));
    return dpar_cuda__c_done(p, w, e == cudaSuccess ? DPAR_OK : dpar_cuda__worker_error(w, e, "cudaMemsetAsync"),
                             "cudaMemsetAsync (dpar_zero, dpar_fsdp)");
}
static dpar_status dpar_cuda__c_update(void *user, int worker, const dpar_optim_update *u)
{
    const dpar_cuda_pool *p = (const dpar_cuda_pool *)user;
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    cudaStream_t s = dpar_cuda__c_stream(p, w);
    dpar_status st = u->kind == DPAR_OPTIM_SGD
                         ? dpar_cuda_sgd_f32(u->params, u->m, u->grads, u->n, u->lr, u->momentum, u->weight_decay, s)
                         : dpar_cuda_adamw_f32(u->params, u->m, u->v, u->grads, u->n, u->lr, u->beta1, u->beta2, u->eps,
                                               u->weight_decay, u->step, s);
    return dpar_cuda__c_done(p, w, st, "an optimizer step (dpar_zero, dpar_fsdp)");
}
/* checkpoints of dpar_zero / dpar_fsdp state: device memory to host memory and back, waited for (the host reads the
   copy, or frees its source, next) */
static dpar_status dpar_cuda__c_host_copy(void *user, int worker, void *dst, const void *src, size_t bytes,
                                          const char *what)
{
    const dpar_cuda_pool *p = (const dpar_cuda_pool *)user;
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    cudaStream_t s = dpar_cuda__c_stream(p, w);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    return e == cudaSuccess ? DPAR_OK : dpar_cuda__worker_error(w, e, what);
}
static dpar_status dpar_cuda__c_to_host(void *user, int worker, void *host, const void *dev, size_t bytes)
{
    return dpar_cuda__c_host_copy(user, worker, host, dev, bytes, "cudaMemcpyAsync to host (a checkpoint)");
}
static dpar_status dpar_cuda__c_from_host(void *user, int worker, void *dev, const void *host, size_t bytes)
{
    return dpar_cuda__c_host_copy(user, worker, dev, host, bytes, "cudaMemcpyAsync from host (a checkpoint)");
}
static int dpar_cuda__c_peer_access(void *user, int worker, int peer)
{
    dpar_cuda_pool *p = (dpar_cuda_pool *)user;
    if (p->path == DPAR_CUDA_PATH_MEMCPY || p->path == DPAR_CUDA_PATH_HOST) return worker == peer;
    return p->peer[(size_t)worker * (size_t)p->n + (size_t)peer];
}
static void *dpar_cuda__c_alloc(void *user, int worker, size_t bytes)
{
    void *d = NULL;
    dpar_cuda__c_worker(user, worker);
    if (cudaMalloc(&d, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return d;
}
static void dpar_cuda__c_free(void *user, int worker, void *ptr)
{
    const dpar_cuda_pool *p = (const dpar_cuda_pool *)user;
    const dpar_cuda_worker *w = dpar_cuda__c_worker(user, worker);
    /* stream-ordered: work queued on the comm stream may still use it (and the peers' reads of it are behind that
       stream); cudaFree's own synchronisation is not promised by CUDA */
    if (ptr && p->stream_ordered && cudaStreamSynchronize(dpar_cuda__c_stream(p, w)) != cudaSuccess)
        (void)cudaGetLastError(); /* the fault is reported by the call or the run that met it */
    cudaFree(ptr);
}

#ifdef DPAR_NCCL
/* one NCCL comm per worker (ncclCommInitAll), each wrapped on its worker's comm stream and owned by it */
static dpar_status dpar_cuda__pool_nccl(dpar_cuda_pool *p, const dpar_comm_desc *cd)
{
    ncclComm_t *ncs = (ncclComm_t *)dpar_cuda__calloc(&p->allocator, (size_t)p->n, sizeof *ncs);
    int *devs = (int *)dpar_cuda__calloc(&p->allocator, (size_t)p->n, sizeof *devs);
    dpar_comm_desc d = *cd;
    dpar_status st = DPAR_OK;
    int i;
    p->fate = (dpar_cuda__nc_fate *)dpar_cuda__calloc(&p->allocator, 1, sizeof *p->fate);
    if (p->fate) pthread_mutex_init(&p->fate->lock, NULL);
    if (!ncs || !devs || !p->fate) st = dpar_set_error(DPAR_ENOMEM, "out of memory");
    for (i = 0; st == DPAR_OK && i < p->n; i++) devs[i] = p->w[i].device;
    if (st == DPAR_OK) st = dpar_cuda__nccl_check(ncclCommInitAll(ncs, p->n, devs), NULL, "ncclCommInitAll");
    d.size = 0;
    if (!d.name || !*d.name) d.name = "nccl";
    for (i = 0; st == DPAR_OK && i < p->n; i++) {
        /* on the worker's own stream: each call follows the work already enqueued there (backward) */
        st = dpar_cuda__nccl_wrap(ncs[i], (cudaStream_t)p->w[i].stream, 1, 0, p->fate, &d, &p->w[i].nccl);
        if (st == DPAR_OK) p->w[i].comm = p->w[i].nccl, ncs[i] = NULL;
    }
    for (i = 0; ncs && i < p->n; i++)      /* those not wrapped (after a failure) */
        if (ncs[i]) ncclCommAbort(ncs[i]); /* abort never waits for the other ranks */
    if (st != DPAR_OK && p->fate)          /* the wrapped ones are aborted too when the pool is freed, not destroyed */
        dpar_cuda__nc_fate_set(p->fate, st, -1, "the pool's NCCL comms could not all be made");
    dpar_cuda__free(&p->allocator, ncs);
    dpar_cuda__free(&p->allocator, devs);
    return st;
}
#endif

extern "C" DPAR_API dpar_status dpar_cuda_pool_create(const dpar_cuda_pool_desc *desc, dpar_cuda_pool **out)
{
    dpar_cuda_pool_desc d;
    dpar_cuda_pool *p;
    dpar_pool_desc pd;
    int count = 0, per, ndev, i;
    dpar_status st;
    if (!out) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_pool_create: out is NULL");
    *out = NULL;
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    if (d.num_devices < 0 || d.workers_per_device < 0 || (!d.devices) != (d.num_devices == 0))
        return dpar_set_error(DPAR_EINVAL,
                              "dpar_cuda_pool_create: devices %s with num_devices = %d, "
                              "workers_per_device = %d",
                              d.devices ? "given" : "NULL", d.num_devices, d.workers_per_device);
    if (!d.allocator.alloc != !d.allocator.free)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_pool_create: the allocator sets only one of alloc and free; set "
                                           "both or neither");
    if ((st = dpar_cuda_device_count(&count)) != DPAR_OK) return st;
    if (count == 0)
        return dpar_set_error(DPAR_EUNSUPPORTED, "dpar_cuda_pool_create: no usable CUDA device (%s)",
                              dpar_last_error());
    ndev = d.devices ? d.num_devices : count;
    for (i = 0; d.devices && i < ndev; i++)
        if (d.devices[i] < 0 || d.devices[i] >= count)
            return dpar_set_error(DPAR_EINVAL, "dpar_cuda_pool_create: devices[%d] = %d is not in 0..%d", i,
                                  d.devices[i], count - 1);
    per = d.workers_per_device ? d.workers_per_device : 1;
    if ((long long)ndev * per > DPAR_MAX_THREADS)
        return dpar_set_error(DPAR_ERANGE,
                              "dpar_cuda_pool_create: %d devices x %d workers is above DPAR_MAX_THREADS "
                              "(%d)",
                              ndev, per, DPAR_MAX_THREADS);
#ifndef DPAR_NCCL
    if (d.nccl)
        return dpar_set_error(DPAR_EUNSUPPORTED,
                              "dpar_cuda_pool_create: nccl = 1, but dpar_cuda.h's implementation was "
                              "built without DPAR_NCCL (define it and link -lnccl)");
#endif
    if (d.nccl && per > 1)
        return dpar_set_error(DPAR_EUNSUPPORTED,
                              "dpar_cuda_pool_create: nccl = 1 with %d workers per device (NCCL "
                              "runs one rank per GPU)",
                              per);
    for (i = 0; d.nccl && d.devices && i < d.num_devices; i++) {
        int q;
        for (q = 0; q < i; q++)
            if (d.devices[q] == d.devices[i])
                return dpar_set_error(DPAR_EUNSUPPORTED,
                                      "dpar_cuda_pool_create: nccl = 1 with device %d listed twice (NCCL runs one "
                                      "rank per GPU)",
                                      d.devices[i]);
    }
    if ((unsigned)d.path > DPAR_CUDA_PATH_HOST || (d.comm.size && d.comm.size != ndev * per) || d.comm.memory.reduce ||
        d.comm.memory.alloc)
        return dpar_set_error(DPAR_EINVAL,
                              "dpar_cuda_pool_create: path %d, comm.size %d for %d workers, comm.memory %s (the "
                              "pool sets it)",
                              (int)d.path, d.comm.size, ndev * per, d.comm.memory.reduce ? "set" : "zero");
    p = (dpar_cuda_pool *)dpar_cuda__calloc(&d.allocator, 1, sizeof *p);
    if (!p) return dpar_set_error(DPAR_ENOMEM, "dpar_cuda_pool_create: out of memory");
    p->allocator = d.allocator;
    pthread_mutex_init(&p->tlock, NULL);
    p->n = ndev * per;
    p->path = d.path;
    p->stream_ordered = d.stream_ordered != 0;
    p->timeout_ms = d.comm.timeout_ms ? d.comm.timeout_ms : DPAR_TIMEOUT_MS_DEFAULT;
    snprintf(p->name, sizeof p->name, "%s", d.name && *d.name ? d.name : "gpu");
    p->w = (dpar_cuda_worker *)dpar_cuda__calloc(&d.allocator, (size_t)p->n, sizeof *p->w);
    p->wlocks = (pthread_mutex_t *)dpar_cuda__calloc(&d.allocator, (size_t)p->n, sizeof *p->wlocks);
    p->blocks = (pthread_mutex_t *)dpar_cuda__calloc(&d.allocator, (size_t)p->n, sizeof *p->blocks);
    p->bounce = (void **)dpar_cuda__calloc(&d.allocator, (size_t)p->n, sizeof *p->bounce);
    p->peer = (unsigned char *)dpar_cuda__calloc(&d.allocator, (size_t)p->n * (size_t)p->n, 1);
    if (p->wlocks)
        for (i = 0; i < p->n; i++) pthread_mutex_init(&p->wlocks[i], NULL);
    if (p->blocks)
        for (i = 0; i < p->n; i++) pthread_mutex_init(&p->blocks[i], NULL);
    if (p->stream_ordered) {
        p->order = (void **)dpar_cuda__calloc(&d.allocator, (size_t)p->n, sizeof *p->order);
        p->ev = (cudaEvent_t *)dpar_cuda__calloc(&d.allocator, (size_t)p->n * DPAR_CUDA__EVENTS, sizeof *p->ev);
        p->ev_ticket =
            (uint64_t *)dpar_cuda__calloc(&d.allocator, (size_t)p->n * DPAR_CUDA__EVENTS, sizeof *p->ev_ticket);
        p->ev_seq = (uint64_t *)dpar_cuda__calloc(&d.allocator, (size_t)p->n, sizeof *p->ev_seq);
        p->ev_lock = (pthread_mutex_t *)dpar_cuda__calloc(&d.allocator, (size_t)p->n, sizeof *p->ev_lock);
        if (p->ev_lock)
            for (i = 0; i < p->n; i++) pthread_mutex_init(&p->ev_lock[i], NULL);
    }
    if (!p->w || !p->wlocks || !p->blocks || !p->bounce || !p->peer ||
        (p->stream_ordered && (!p->order || !p->ev || !p->ev_ticket || !p->ev_seq || !p->ev_lock))) {
        dpar_cuda__pool_free(p);
        return dpar_set_error(DPAR_ENOMEM, "dpar_cuda_pool_create: out of memory");
    }
    for (i = 0; i < p->n; i++) {
        p->w[i].rank = i;
        p->w[i].size = p->n;
        p->w[i].device = d.devices ? d.devices[i / per] : i / per;
        p->w[i].scratch_bytes = d.scratch_bytes;
    }
    for (i = 0; i < p->n * p->n; i++) { /* who may read whom: one device, or peer access */
        int a = p->w[i / p->n].device, b = p->w[i % p->n].device, can = a == b;
        if (!can && cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess) can = 0;
        p->peer[i] = (unsigned char)(can != 0);
        if (!can && p->path == DPAR_CUDA_PATH_PEER) {
            dpar_cuda__pool_free(p);
            return dpar_set_error(DPAR_EUNSUPPORTED,
                                  "dpar_cuda_pool_create: path PEER, but device %d cannot read device %d's memory "
                                  "(cudaDeviceCanAccessPeer): use AUTO, MEMCPY or HOST",
                                  a, b);
        }
    }
    {
        dpar_comm_desc cd = d.comm;
        cd.size = p->n;
        cd.name = cd.name && *cd.name ? cd.name : p->name;
        if (!cd.segment_bytes)
            cd.segment_bytes =
                p->stream_ordered ? (size_t)DPAR_CUDA_ORDERED_SEGMENT_BYTES : (size_t)DPAR_CUDA_SEGMENT_BYTES;
        cd.memory.user = p;
        cd.memory.enter = dpar_cuda__c_enter;
        cd.memory.reduce = dpar_cuda__c_reduce;
        cd.memory.divide = dpar_cuda__c_divide;
        cd.memory.copy = dpar_cuda__c_copy;
        cd.memory.peer_access = dpar_cuda__c_peer_access;
        cd.memory.alloc = dpar_cuda__c_alloc;
        cd.memory.free = dpar_cuda__c_free;
        cd.memory.clear = dpar_cuda__c_clear;
        cd.memory.update = dpar_cuda__c_update;
        cd.memory.to_host = dpar_cuda__c_to_host;
        cd.memory.from_host = dpar_cuda__c_from_host;
        cd.memory.combine = dpar_cuda__c_combine;
        if (p->stream_ordered) {
            cd.memory.record = dpar_cuda__c_record;
            cd.memory.wait = dpar_cuda__c_wait;
        }
        if (!cd.allocator.alloc) cd.allocator = d.allocator;
        if ((st = dpar_group_create(&cd, &p->group)) != DPAR_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", dpar_last_error());
            dpar_cuda__pool_free(p);
            return dpar_set_error(st, "dpar_cuda_pool_create: the comm: %s", msg);
        }
    }
    memset(&pd, 0, sizeof pd);
    pd.num_threads = p->n;
    pd.name = p->name;
    pd.allocator = d.allocator;
    if ((st = dpar_pool_create(&pd, &p->threads)) != DPAR_OK ||
        (st = dpar_pool_run(p->threads, dpar_cuda__worker_start, p)) != DPAR_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", dpar_last_error());
        dpar_cuda__pool_free(p);
        return dpar_set_error(st, "dpar_cuda_pool_create: %s", msg);
    }
    { /* the deadline the comm really uses (comm.timeout_ms 0: DPAR_TIMEOUT_MS or the default) */
        dpar_comm_desc used;
        if (p->w[0].ring && dpar_comm_query(p->w[0].ring, &used) == DPAR_OK) p->timeout_ms = used.timeout_ms;
    }
#ifdef DPAR_NCCL
    if (d.nccl && (st = dpar_cuda__pool_nccl(p, &d.comm)) != DPAR_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", dpar_last_error());
        dpar_cuda__pool_free(p);
        return dpar_set_error(st, "dpar_cuda_pool_create: the NCCL comm: %s", msg);
    }
#endif
    *out = p;
    return DPAR_OK;
}

extern "C" DPAR_API dpar_status dpar_cuda_pool_destroy(dpar_cuda_pool *pool)
{
    dpar_status st;
    if (!pool) return DPAR_OK;
    if (dpar_pool_thread_index(pool->threads) >= 0)
        return dpar_set_error(DPAR_EBUSY, "dpar_cuda_pool_destroy: called from one of the pool's workers");
    dpar_cuda_task_wait_all(pool); /* the tasks' records and events go first; their errors were the waiters' */
    st = dpar_pool_run(pool->threads, dpar_cuda__worker_stop, pool);
    dpar_pool_destroy(pool->threads);
    pool->threads = NULL;
    dpar_cuda__pool_free(pool);
    return st;
}

extern "C" DPAR_API int dpar_cuda_pool_size(const dpar_cuda_pool *pool) { return pool ? pool->n : 0; }

extern "C" DPAR_API dpar_status dpar_cuda_pool_worker(const dpar_cuda_pool *pool, int rank, dpar_cuda_worker *out)
{
    if (!pool || !out) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_pool_worker: pool or out is NULL");
    if (rank < 0 || rank >= pool->n)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_pool_worker: rank %d is not in 0..%d", rank, pool->n - 1);
    *out = pool->w[rank];
    return DPAR_OK;
}

extern "C" DPAR_API dpar_status dpar_cuda_comm_set_stream(dpar_cuda_pool *pool, int rank, void *stream)
{
    if (!pool) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_comm_set_stream: pool is NULL");
    if (rank < 0 || rank >= pool->n)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_comm_set_stream: rank %d is not in 0..%d", rank, pool->n - 1);
    if (!pool->stream_ordered)
        return dpar_set_error(DPAR_ESTATE, "dpar_cuda_comm_set_stream: the pool is not stream-ordered (its calls wait "
                                           "for the device: dpar_cuda_pool_desc.stream_ordered)");
    if ((cudaStream_t)stream == cudaStreamLegacy || (cudaStream_t)stream == cudaStreamPerThread)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_comm_set_stream: cudaStreamLegacy and cudaStreamPerThread are "
                                           "not one stream of the worker's (the per-thread one differs on a "
                                           "progress thread): name a stream made with cudaStreamCreate");
#if CUDART_VERSION >= 12080
    if (stream) {
        int dev = -1;
        cudaError_t e = cudaStreamGetDevice((cudaStream_t)stream, &dev);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return dpar_set_error(DPAR_EINVAL, "dpar_cuda_comm_set_stream: cudaStreamGetDevice: %s",
                                  cudaGetErrorName(e));
        }
        if (dev != pool->w[rank].device)
            return dpar_set_error(DPAR_EINVAL,
                                  "dpar_cuda_comm_set_stream: the stream is on device %d, worker %d on device %d "
                                  "(its events are recorded on the worker's)",
                                  dev, rank, pool->w[rank].device);
    }
#endif
    pool->order[rank] = stream;
    return DPAR_OK;
}

static dpar_status dpar_cuda__comm_sync_on(dpar_cuda_pool *pool, int rank)
{
    const dpar_cuda_worker *w;
    cudaStream_t s;
    cudaError_t e;
    char msg[512];
    if (!pool) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_comm_sync: pool is NULL");
    if (rank < 0 || rank >= pool->n)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_comm_sync: rank %d is not in 0..%d", rank, pool->n - 1);
    w = dpar_cuda__c_worker(pool, rank);
    s = dpar_cuda__c_stream(pool, w);
    e = dpar_cuda__poll(NULL, s, dpar_cuda__deadline(pool)); /* noticed within ~20 us; no core spun */
    if (e == cudaErrorNotReady) {
        snprintf(msg, sizeof msg,
                 "worker %d (device %d): its comm stream still runs after %d ms: a peer's stream it waits for is "
                 "stuck, or the peer never made its call",
                 rank, w->device, pool->timeout_ms);
        dpar_comm_fail(w->ring, DPAR_ETIMEDOUT, msg);
        return dpar_set_error(DPAR_ETIMEDOUT, "dpar_cuda_comm_sync: %s", msg);
    }
    if (e == cudaSuccess) return DPAR_OK;
    dpar_cuda__worker_error(w, e, "a queued comm kernel or copy");
    snprintf(msg, sizeof msg, "%s", dpar_last_error());
    dpar_comm_fail(w->ring, DPAR_ESYSTEM, msg);
    return dpar_set_error(DPAR_ESYSTEM, "dpar_cuda_comm_sync: %s", msg);
}
/* the calling thread's current device is the same after as before (it may be no worker's thread) */
extern "C" DPAR_API dpar_status dpar_cuda_comm_sync(dpar_cuda_pool *pool, int rank)
{
    dpar_cuda__device_kept kept;
    return dpar_cuda__comm_sync_on(pool, rank);
}

typedef struct dpar_cuda__run {
    dpar_cuda_pool *pool;
    dpar_cuda_pool_run_fn fn;
    void *user;
} dpar_cuda__run;

/* a worker's run failed with st (its text in dpar_last_error): the others must not wait for it in a collective */
static void dpar_cuda__run_failed(dpar_cuda__run *r, const dpar_cuda_worker *w, dpar_status st)
{
    char msg[512];
    if (!w->comm) return;
    snprintf(msg, sizeof msg, "%s", dpar_last_error());
    dpar_comm_fail(w->ring, st, msg); /* the ring's ranks return at once */
#ifdef DPAR_NCCL
    if (w->nccl) { /* an NCCL comm's poison is this worker's own: the pool's fate reaches the others */
        dpar_comm_fail(w->nccl, st, msg);
        dpar_cuda__nc_fate_set(r->pool->fate, st, w->rank, msg);
    }
#else
    (void)r;
#endif
    dpar_set_error(st, "%s", msg); /* this worker's own error stays its text */
}
/* one worker's part of a run: its device current, fn, then its stream: a fault shows here */
static dpar_status dpar_cuda__worker_run_on(void *user, int t, int n)
{
    dpar_cuda__run *r = (dpar_cuda__run *)user;
    const dpar_cuda_worker *w = &r->pool->w[t];
    dpar_status st;
    cudaError_t e;
    (void)n;
    uint64_t t0 = dpar_time_ns();
    if ((e = cudaSetDevice(w->device)) != cudaSuccess) return dpar_cuda__worker_error(w, e, "cudaSetDevice");
    st = r->fn(r->user, w);
    if (st != DPAR_OK) dpar_cuda__run_failed(r, w, st); /* before the waits below: the peers stop now */
    e = cudaStreamSynchronize((cudaStream_t)w->stream);
    if (r->pool->order && r->pool->order[t]) { /* the comm stream the run named: waited for, then forgotten */
        cudaError_t oe = cudaStreamSynchronize((cudaStream_t)r->pool->order[t]);
        if (e == cudaSuccess) e = oe;
        r->pool->order[t] = NULL;
    }
    if (dpar_trace_enabled()) { /* the worker's part of the run, its stream's work included */
        char args[96];
        snprintf(args, sizeof args, "\"worker\":%d,\"device\":%d,\"status\":%d", w->rank, w->device, (int)st);
        dpar_trace_event("cuda_pool_run", "gpu", t0, dpar_time_ns(), args);
    }
    {
        cudaError_t last = cudaGetLastError(); /* read either way: a stale error must not reach a later launch */
        if (e == cudaSuccess) e = last;
    }
    if (st == DPAR_OK && e != cudaSuccess) {
        st = dpar_cuda__worker_error(w, e, "a CUDA call or kernel of the run (seen at the end of it)");
        dpar_cuda__run_failed(r, w, st);
    }
    return st;
}
static dpar_status dpar_cuda__worker_run(void *user, int t, int n)
{
    return dpar_cuda__on_worker(dpar_cuda__worker_run_on, user, t, n);
}

extern "C" DPAR_API dpar_status dpar_cuda_pool_run(dpar_cuda_pool *pool, dpar_cuda_pool_run_fn fn, void *user)
{
    dpar_cuda__run r;
    if (!pool || !fn) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_pool_run: pool or fn is NULL");
    r.pool = pool;
    r.fn = fn;
    r.user = user;
    return dpar_pool_run(pool->threads, dpar_cuda__worker_run, &r);
}

/* ---- tasks bound to workers ---- */
struct dpar_cuda__task {
    dpar_cuda_pool *pool;
    dpar_cuda_task_fn fn;
    void *user;
    int worker;
    const char *name;  /* the desc's (not copied, as dpar_task_desc's) */
    dpar_task host;    /* the task of the pool's graph that runs fn */
    cudaEvent_t event; /* recorded on the worker's stream after fn's work; made on the worker's device */
    int ndeps;
    dpar_cuda__task **deps; /* [ndeps] */
};

/* the record of a live handle, or NULL (the lock held) */
static dpar_cuda__task *dpar_cuda__task_of(dpar_cuda_pool *p, dpar_cuda_task h)
{
    return h >= 1 && h <= p->ntasks ? p->tasks[h - 1] : NULL;
}

static dpar_status dpar_cuda__task_main_on(void *user, int t, int n)
{
    dpar_cuda__task *k = (dpar_cuda__task *)user;
    const dpar_cuda_worker *w = &k->pool->w[k->worker];
    cudaStream_t s = (cudaStream_t)w->stream;
    dpar_status st;
    cudaError_t e;
    int i;
    (void)t, (void)n;
    if ((e = cudaSetDevice(w->device)) != cudaSuccess) return dpar_cuda__worker_error(w, e, "cudaSetDevice");
    for (i = 0; i < k->ndeps; i++) /* the same worker's stream keeps the order by itself */
        if (k->deps[i]->worker != k->worker && (e = cudaStreamWaitEvent(s, k->deps[i]->event, 0)) != cudaSuccess)
            return dpar_cuda__worker_error(w, e, "cudaStreamWaitEvent on a dependency's event");
    uint64_t t0 = dpar_time_ns();
    pthread_mutex_lock(&k->pool->wlocks[k->worker]);
    st = k->fn(k->user, w);
    if (dpar_trace_enabled()) { /* the host's enqueueing (the device work runs after, on the stream) */
        char args[64];
        snprintf(args, sizeof args, "\"worker\":%d,\"device\":%d", k->worker, w->device);
        dpar_trace_event(k->name ? k->name : "cuda_task", "gpu", t0, dpar_time_ns(), args);
    }
    e = cudaEventCreateWithFlags(&k->event, cudaEventDisableTiming);
    if (e != cudaSuccess) k->event = NULL;
    else e = cudaEventRecord(k->event, s);
    pthread_mutex_unlock(&k->pool->wlocks[k->worker]);
    if (!k->event) return dpar_cuda__worker_error(w, e, "cudaEventCreateWithFlags");
    if (e == cudaSuccess) e = cudaGetLastError();
    if (st == DPAR_OK && e != cudaSuccess) st = dpar_cuda__worker_error(w, e, "a CUDA call or kernel of the task");
    return st;
}
/* a task runs on whichever thread is free, the waiting one included: its current device is restored */
static dpar_status dpar_cuda__task_main(void *user)
{
    int before = -1;
    dpar_status st;
    cudaGetDevice(&before);
    st = dpar_cuda__task_main_on(user, 0, 1);
    if (before >= 0) cudaSetDevice(before);
    return st;
}

extern "C" DPAR_API dpar_status dpar_cuda_task_submit(dpar_cuda_pool *pool, const dpar_cuda_task_desc *desc,
                                                      dpar_cuda_task *out)
{
    dpar_cuda__task *k;
    dpar_task_desc td;
    dpar_task small[16], *hdeps = small;
    dpar_status st = DPAR_OK;
    int i;
    if (out) *out = 0;
    if (!pool || !desc || !desc->fn)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_task_submit: pool, desc or desc->fn is NULL");
    if (desc->worker < 0 || desc->worker >= pool->n || desc->num_deps < 0 || (desc->num_deps && !desc->deps))
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_task_submit: worker %d (0..%d), %d deps%s", desc->worker,
                              pool->n - 1, desc->num_deps, desc->num_deps && !desc->deps ? " but deps is NULL" : "");
    k = (dpar_cuda__task *)dpar_cuda__calloc(&pool->allocator, 1, sizeof *k);
    if (k && desc->num_deps)
        k->deps = (dpar_cuda__task **)dpar_cuda__calloc(&pool->allocator, (size_t)desc->num_deps, sizeof *k->deps);
    if (desc->num_deps > 16)
        hdeps = (dpar_task *)dpar_cuda__calloc(&pool->allocator, (size_t)desc->num_deps, sizeof *hdeps);
    if (!k || (desc->num_deps && !k->deps) || !hdeps) {
        if (k) dpar_cuda__free(&pool->allocator, k->deps);
        dpar_cuda__free(&pool->allocator, k);
        if (hdeps != small) dpar_cuda__free(&pool->allocator, hdeps);
        return dpar_set_error(DPAR_ENOMEM, "dpar_cuda_task_submit: out of memory");
    }
    k->pool = pool;
    k->fn = desc->fn;
    k->user = desc->user;
    k->worker = desc->worker;
    k->name = desc->name;
    k->ndeps = desc->num_deps;
    pthread_mutex_lock(&pool->tlock);
    for (i = 0; i < desc->num_deps && st == DPAR_OK; i++) {
        k->deps[i] = dpar_cuda__task_of(pool, desc->deps[i]);
        if (!k->deps[i])
            st = dpar_set_error(DPAR_EINVAL, "dpar_cuda_task_submit: deps[%d] = %llu is not a live task of this pool",
                                i, (unsigned long long)desc->deps[i]);
        else hdeps[i] = k->deps[i]->host;
    }
    if (st == DPAR_OK && pool->ntasks == pool->captasks) { /* room for its handle */
        size_t cap = pool->captasks ? 2 * pool->captasks : 64;
        dpar_cuda__task **t = (dpar_cuda__task **)dpar_cuda__calloc(&pool->allocator, cap, sizeof *t);
        if (!t) st = dpar_set_error(DPAR_ENOMEM, "dpar_cuda_task_submit: out of memory");
        else {
            if (pool->ntasks) memcpy(t, pool->tasks, pool->ntasks * sizeof *t);
            dpar_cuda__free(&pool->allocator, pool->tasks);
            pool->tasks = t;
            pool->captasks = cap;
        }
    }
    if (st == DPAR_OK) {
        memset(&td, 0, sizeof td);
        td.fn = dpar_cuda__task_main;
        td.user = k;
        td.deps = hdeps;
        td.num_deps = desc->num_deps;
        td.name = desc->name;
        st = dpar_task_submit(pool->threads, &td, &k->host);
    }
    if (st == DPAR_OK) {
        pool->tasks[pool->ntasks++] = k;
        if (out) *out = pool->ntasks;
    }
    pthread_mutex_unlock(&pool->tlock);
    if (hdeps != small) dpar_cuda__free(&pool->allocator, hdeps);
    if (st != DPAR_OK) {
        dpar_cuda__free(&pool->allocator, k->deps);
        dpar_cuda__free(&pool->allocator, k);
    }
    return st;
}

extern "C" DPAR_API dpar_status dpar_cuda_task_wait(dpar_cuda_pool *pool, dpar_cuda_task task)
{
    dpar_cuda__task *k;
    dpar_status st;
    cudaError_t e;
    int before = -1;
    if (!pool) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_task_wait: pool is NULL");
    pthread_mutex_lock(&pool->tlock);
    k = dpar_cuda__task_of(pool, task);
    pthread_mutex_unlock(&pool->tlock);
    if (!k)
        return dpar_set_error(DPAR_EINVAL, "dpar_cuda_task_wait: %llu is not a live task", (unsigned long long)task);
    if ((st = dpar_task_wait(pool->threads, k->host)) != DPAR_OK) return st;
    cudaGetDevice(&before);
    cudaSetDevice(pool->w[k->worker].device);
    e = cudaEventSynchronize(k->event);
    if (before >= 0) cudaSetDevice(before);
    return e == cudaSuccess ? DPAR_OK : dpar_cuda__worker_error(&pool->w[k->worker], e, "the device work of a task");
}

/* the records of the epoch (no task runs any more) */
static void dpar_cuda__tasks_free(dpar_cuda_pool *p)
{
    size_t i;
    for (i = 0; i < p->ntasks; i++) {
        if (p->tasks[i]->event) cudaEventDestroy(p->tasks[i]->event);
        dpar_cuda__free(&p->allocator, p->tasks[i]->deps);
        dpar_cuda__free(&p->allocator, p->tasks[i]);
    }
    dpar_cuda__free(&p->allocator, p->tasks);
    p->tasks = NULL;
    p->ntasks = p->captasks = 0;
}

extern "C" DPAR_API dpar_status dpar_cuda_task_wait_all(dpar_cuda_pool *pool)
{
    dpar_status st, sync = DPAR_OK;
    int i, before = -1;
    if (!pool) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_task_wait_all: pool is NULL");
    st = dpar_task_wait_all(pool->threads);
    cudaGetDevice(&before);
    for (i = 0; i < pool->n; i++) { /* every stream: the device work of every task */
        const dpar_cuda_worker *w = &pool->w[i];
        cudaError_t e = cudaSetDevice(w->device);
        if (e == cudaSuccess) e = cudaStreamSynchronize((cudaStream_t)w->stream);
        if (e != cudaSuccess && sync == DPAR_OK) sync = dpar_cuda__worker_error(w, e, "the device work of the tasks");
    }
    if (before >= 0) cudaSetDevice(before);
    pthread_mutex_lock(&pool->tlock);
    dpar_cuda__tasks_free(pool);
    pthread_mutex_unlock(&pool->tlock);
    return st != DPAR_OK ? st : sync;
}

#endif /* DPAR_CUDA_IMPLEMENTATION */
