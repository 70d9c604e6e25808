// test_cuda.cu - dpar_cuda.h on a GPU: device queries and the axpy kernel against its host reference.
// Build and run: make cuda   (prints `skipped: ...` where no GPU is usable)
#define DPAR_IMPLEMENTATION
#define DPAR_CUDA_IMPLEMENTATION
#include "dpar_cuda.h"
#include "dpar_test.h"

static int gpus = 0;

static void test_device_query(void)
{
    dpar_cuda_device_info info;
    CHECK(dpar_cuda_device_count(&gpus) == DPAR_OK);
    if (gpus == 0) SKIP("no usable CUDA device");
    CHECK(dpar_cuda_device_query(0, &info) == DPAR_OK);
    CHECK(info.total_bytes > 0 && info.major >= 3 && info.name[0]);
    CHECK(dpar_cuda_device_query(gpus, &info) == DPAR_EINVAL);
    CHECK(dpar_cuda_device_query(0, NULL) == DPAR_EINVAL);
    printf("    device 0: %s, %.1f GiB, sm_%d%d\n", info.name, info.total_bytes / 1073741824.0, info.major, info.minor);
}

static void test_axpy_matches_reference(void)
{
    size_t sizes[] = {1, 255, 256, 257, 1000003}, k, i;
    if (gpus == 0) SKIP("no usable CUDA device");
    for (k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k];
        float *x = (float *)malloc(n * sizeof(float)), *y = (float *)malloc(n * sizeof(float));
        float *ref = (float *)malloc(n * sizeof(float)), *dx, *dy;
        int bad = 0;
        for (i = 0; i < n; i++) {
            x[i] = (float)(dt_rand() % 1000) / 100.0f;
            y[i] = ref[i] = (float)(dt_rand() % 1000) / 10.0f;
        }
        cudaMalloc((void **)&dx, n * sizeof(float));
        cudaMalloc((void **)&dy, n * sizeof(float));
        cudaMemcpy(dx, x, n * sizeof(float), cudaMemcpyHostToDevice);
        cudaMemcpy(dy, y, n * sizeof(float), cudaMemcpyHostToDevice);
        CHECK(dpar_cuda_axpy_f32(dy, dx, 0.5f, n, NULL) == DPAR_OK);
        cudaMemcpy(y, dy, n * sizeof(float), cudaMemcpyDeviceToHost);
        dpar_cuda_axpy_f32_ref(ref, x, 0.5f, n);
        for (i = 0; i < n; i++) bad += y[i] != ref[i]; /* one fused or unfused multiply-add each: exact here */
        CHECK_MSG(bad == 0, "n=%zu: %d elements differ", n, bad);
        cudaFree(dx);
        cudaFree(dy);
        free(x);
        free(y);
        free(ref);
    }
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_device_query);
    RUN(test_axpy_matches_reference);
    return dt_summary();
}
