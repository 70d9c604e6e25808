/* dpar_cuda.h - dpar's GPU part: devices, kernels, and (to come) a GPU worker pool and an NCCL
   transport for the communicator.  v0.1.0 (skeleton)

   USE
     Plain C or C++ includes "dpar_cuda.h" for the declarations (it includes dpar.h). Exactly one
     .cu file of the program compiles the implementation with nvcc:

         #define DPAR_IMPLEMENTATION        (unless another file already has it)
         #define DPAR_CUDA_IMPLEMENTATION
         #include "dpar_cuda.h"

         nvcc -O2 -I. my_kernels.cu -c    and link with -lcudart (nvcc links it by default)

   WHAT IS HERE (v0.1, a skeleton that exercises the build path)
     - device count and properties, with CUDA errors mapped to dpar_status and the CUDA error text in
       dpar_last_error();
     - one kernel, axpy, beside its naive host reference (tests compare the two).
   WHAT COMES (the CUDA issue): a GPU pool (one host thread per device, each with a stream and a
   cuBLAS handle), the kernels trainers need around collectives (scale, SGD/Adam updates, casts),
   and a transport for device buffers: NCCL under DPAR_NCCL, else a ring over peer copies.

   OPTIONS
     DPAR_CUDA_IMPLEMENTATION   emit the implementation (nvcc only)

   THREAD SAFETY
     Every function may be called from any thread; kernels run on the stream given.
*/
#ifndef DPAR_CUDA_H_INCLUDED
#define DPAR_CUDA_H_INCLUDED

#include "dpar.h"

#define DPAR_CUDA_VERSION "0.1.0"

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

#ifdef __cplusplus
}
#endif
#endif /* DPAR_CUDA_H_INCLUDED */

#if defined(DPAR_CUDA_IMPLEMENTATION) && !defined(DPAR_CUDA__IMPLEMENTATION_DONE)
#define DPAR_CUDA__IMPLEMENTATION_DONE
#ifndef __CUDACC__
#error "dpar_cuda.h: DPAR_CUDA_IMPLEMENTATION needs nvcc: put it in a .cu file"
#endif
#include <cuda_runtime.h>
#include <string.h>

static dpar_status dpar_cuda__check(cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return DPAR_OK;
    return dpar_set_error(DPAR_ESYSTEM, "%s: CUDA error %d: %s", what, (int)e, cudaGetErrorString(e));
}

extern "C" DPAR_API dpar_status dpar_cuda_device_count(int *count)
{
    cudaError_t e;
    if (!count) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_device_count: count is NULL");
    *count = 0;
    e = cudaGetDeviceCount(count);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
        *count = 0;
        dpar_set_error(DPAR_OK, "dpar_cuda_device_count: no usable device: %s", cudaGetErrorString(e));
        (void)cudaGetLastError(); /* clear the sticky error */
        return DPAR_OK;
    }
    return dpar_cuda__check(e, "dpar_cuda_device_count");
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
    if ((st = dpar_cuda__check(cudaGetDeviceProperties(&prop, device), "dpar_cuda_device_query")) != DPAR_OK) return st;
    memset(info, 0, sizeof *info);
    info->device = device;
    strncpy(info->name, prop.name, sizeof info->name - 1);
    info->total_bytes = prop.totalGlobalMem;
    info->major = prop.major;
    info->minor = prop.minor;
    info->multiprocessors = prop.multiProcessorCount;
    return DPAR_OK;
}

/* y (n) += alpha * x (n): a grid-stride loop */
__global__ void dpar_cuda__axpy_kernel(float *y, const float *x, float alpha, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
    for (; i < n; i += step) y[i] += alpha * x[i];
}

extern "C" DPAR_API dpar_status dpar_cuda_axpy_f32(float *y, const float *x, float alpha, size_t n, void *stream)
{
    size_t blocks;
    if (n == 0) return DPAR_OK;
    if (!y || !x) return dpar_set_error(DPAR_EINVAL, "dpar_cuda_axpy_f32: y or x is NULL");
    blocks = (n + 255) / 256;
    if (blocks > 65535u * 8) blocks = 65535u * 8;
    dpar_cuda__axpy_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(y, x, alpha, n);
    return dpar_cuda__check(cudaGetLastError(), "dpar_cuda_axpy_f32");
}

extern "C" DPAR_API void dpar_cuda_axpy_f32_ref(float *y, const float *x, float alpha, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) y[i] += alpha * x[i];
}
#endif /* DPAR_CUDA_IMPLEMENTATION */
