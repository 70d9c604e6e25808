// test_cuda.cu - dpar_cuda.h on a GPU: device queries, and every kernel against its host reference.
// Build and run: nvcc -std=c++14 -O2 -arch=sm_90 -I. -Itests tests/test_cuda.cu -o build/test_cuda -lcublas
//                && ./build/test_cuda      (prints `skipped: no usable CUDA device (<CUDA's reason>)` without one)
// Comparisons are bitwise (any NaN equals any NaN: the GPU makes computed NaNs canonical), except softmax
// cross-entropy (CUDA's expf/logf: relative 1e-5 + 4e-7) and sgemm (cuBLAS's summation order: see test_sgemm).
#define DPAR_IMPLEMENTATION
#define DPAR_CUDA_IMPLEMENTATION
#include "dpar_cuda.h"
#include "dpar_test.h"
#include "coll_matrix.h"
#include "fsdp_case.h"

static int gpus = 0;
static char no_gpu[200]; /* the skip reason, with CUDA's */

#define NEED_GPU()                   \
    do {                             \
        if (gpus == 0) SKIP(no_gpu); \
    } while (0)

static void test_device_query(void)
{
    dpar_cuda_device_info info;
    int n = 0;
    CHECK(dpar_cuda_device_count(&n) == DPAR_OK && n == gpus);
    NEED_GPU();
    CHECK(dpar_cuda_device_query(0, &info) == DPAR_OK);
    CHECK(info.total_bytes > 0 && info.major >= 3 && info.name[0]);
    CHECK(dpar_cuda_device_query(gpus, &info) == DPAR_EINVAL);
    CHECK(dpar_cuda_device_query(0, NULL) == DPAR_EINVAL);
    printf("    device 0: %s, %.1f GiB, sm_%d%d\n", info.name, info.total_bytes / 1073741824.0, info.major, info.minor);
}

/* without a usable device, a launch fails: DPAR_ESYSTEM, naming the launcher, the CUDA call and CUDA's error name */
static void test_launch_error_names_cuda_error(void)
{
    float dummy[4];
    if (gpus > 0) SKIP("needs a machine without a usable CUDA device (the launch must fail)");
    CHECK(dpar_cuda_fill_f32(dummy, 1.0f, 4, NULL) == DPAR_ESYSTEM);
    CHECK_MSG(strstr(dpar_last_error(), "dpar_cuda_fill_f32") && strstr(dpar_last_error(), "kernel launch") &&
                  strstr(dpar_last_error(), "cudaError"),
              "%s", dpar_last_error());
    printf("    %s\n", dpar_last_error());
}

/* ---- helpers: device copies, comparisons ---- */
static void *dev_copy(const void *host, size_t bytes)
{
    void *d = NULL;
    if (cudaMalloc(&d, bytes + 16) != cudaSuccess) return NULL;
    if (host) cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice);
    return d;
}
static void to_host(void *host, const void *dev, size_t bytes)
{
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
}
static int nan_of(const void *p, size_t es, int bf16) /* bf16: 1 bf16, 0 another float, -1 an integer */
{
    if (bf16 < 0 || es == 1) return 0;
    if (es == 8) {
        double d;
        memcpy(&d, p, 8);
        return d != d;
    }
    if (es == 4) {
        float f;
        memcpy(&f, p, 4);
        return f != f;
    } else {
        uint16_t h;
        memcpy(&h, p, 2);
        return bf16 ? (h & 0x7fffu) > 0x7f80u : (h & 0x7fffu) > 0x7c00u;
    }
}
/* elements that differ bitwise (NaN = NaN) */
static size_t count_diff(const void *a, const void *b, size_t n, size_t es, int bf16)
{
    size_t i, bad = 0;
    for (i = 0; i < n; i++) {
        const char *x = (const char *)a + i * es, *y = (const char *)b + i * es;
        bad += memcmp(x, y, es) && !(nan_of(x, es, bf16) && nan_of(y, es, bf16));
    }
    return bad;
}
static float frand(void) { return (float)((double)(dt_rand() % 2000001) / 1000000.0 - 1.0) * 4.0f; }
static void fill_random(float *x, size_t n)
{
    static const uint32_t sp[] = {0x7fc00000u, 0x7f800000u, 0xff800000u, 0x80000000u, 0x00000001u, 0x7f7fffffu};
    size_t i;
    for (i = 0; i < n; i++) {
        if (dt_rand() % 32 == 0) memcpy(&x[i], &sp[dt_rand() % 6], 4);
        else x[i] = frand();
    }
}

static const size_t sizes[] = {1, 5, 1000, 65537, (1u << 20) + 3};
#define NSIZES (sizeof sizes / sizeof sizes[0])

/* a launch reports its own status: an error of an earlier call that its caller handled (here a failed cudaMalloc,
   which CUDA also keeps as the thread's last error) is not the launch's */
static void test_launch_reports_its_own_status(void)
{
    float *d = NULL, got[4] = {0, 0, 0, 0};
    void *huge = NULL;
    NEED_GPU();
    CHECK(cudaMalloc((void **)&d, sizeof got) == cudaSuccess);
    CHECK(cudaMalloc(&huge, (size_t)1 << 62) != cudaSuccess); /* handled here, by its return value */
    CHECK_MSG(dpar_cuda_fill_f32(d, 1.5f, 4, NULL) == DPAR_OK, "%s", dpar_last_error());
    (void)cudaGetLastError();
    to_host(got, d, sizeof got);
    CHECK(got[0] == 1.5f && got[3] == 1.5f);
    cudaFree(d);
}

static void test_axpy_matches_reference(void)
{
    size_t sizes_[] = {1, 255, 256, 257, 1000003}, k, i;
    NEED_GPU();
    for (k = 0; k < sizeof sizes_ / sizeof sizes_[0]; k++) {
        size_t n = sizes_[k];
        float *x = (float *)malloc(n * sizeof(float)), *y = (float *)malloc(n * sizeof(float));
        float *ref = (float *)malloc(n * sizeof(float)), *dx, *dy;
        int bad = 0;
        for (i = 0; i < n; i++) {
            x[i] = (float)(dt_rand() % 1000) / 100.0f;
            y[i] = ref[i] = (float)(dt_rand() % 1000) / 10.0f;
        }
        dx = (float *)dev_copy(x, n * 4);
        dy = (float *)dev_copy(y, n * 4);
        CHECK(dpar_cuda_axpy_f32(dy, dx, 0.5f, n, NULL) == DPAR_OK);
        to_host(y, dy, n * 4);
        dpar_cuda_axpy_f32_ref(ref, x, 0.5f, n);
        for (i = 0; i < n; i++) bad += y[i] != ref[i];
        CHECK_MSG(bad == 0, "n=%zu: %d elements differ", n, bad);
        cudaFree(dx);
        cudaFree(dy);
        free(x);
        free(y);
        free(ref);
    }
}

/* fill, scale, axpy, add, relu forward and backward, bias add; aligned (vectors) and one element off */
static void test_elementwise_kernels(void)
{
    size_t s, off;
    NEED_GPU();
    for (s = 0; s < NSIZES; s++)
        for (off = 0; off < 2; off++) {
            size_t n = sizes[s], B = (n + 16) * 4, cols = 8, rows = n / cols; /* B: room for cols too */
            float *x = (float *)malloc(B), *y = (float *)malloc(B), *r = (float *)malloc(B), *got = (float *)malloc(B);
            float *bias = (float *)malloc(cols * 4);
            float *dx = (float *)dev_copy(NULL, B) + off, *dy = (float *)dev_copy(NULL, B) + off;
            float *dout = (float *)dev_copy(NULL, B) + off, *dbias = (float *)dev_copy(NULL, cols * 4);
            fill_random(x, n);
            fill_random(y, n);
            fill_random(bias, cols);
            cudaMemcpy(dx, x, n * 4, cudaMemcpyHostToDevice);
            cudaMemcpy(dbias, bias, cols * 4, cudaMemcpyHostToDevice);
#define RESET_Y() cudaMemcpy(dy, y, n * 4, cudaMemcpyHostToDevice), memcpy(r, y, n * 4)
#define COMPARE(dev, what)                                                                 \
    do {                                                                                   \
        size_t bad_;                                                                       \
        to_host(got, dev, n * 4);                                                          \
        bad_ = count_diff(got, r, n, 4, 0);                                                \
        CHECK_MSG(bad_ == 0, "%s n=%zu off=%zu: %zu elements differ", what, n, off, bad_); \
    } while (0)
            RESET_Y();
            CHECK(dpar_cuda_fill_f32(dy, -1.25f, n, NULL) == DPAR_OK);
            dpar_cuda_fill_f32_ref(r, -1.25f, n);
            COMPARE(dy, "fill");
            RESET_Y();
            CHECK(dpar_cuda_scale_f32(dy, 0.37f, n, NULL) == DPAR_OK);
            dpar_cuda_scale_f32_ref(r, 0.37f, n);
            COMPARE(dy, "scale");
            RESET_Y();
            CHECK(dpar_cuda_axpy_f32(dy, dx, -0.71f, n, NULL) == DPAR_OK);
            dpar_cuda_axpy_f32_ref(r, x, -0.71f, n);
            COMPARE(dy, "axpy");
            RESET_Y();
            CHECK(dpar_cuda_add_f32(dout, dx, dy, n, NULL) == DPAR_OK);
            dpar_cuda_add_f32_ref(r, x, y, n);
            COMPARE(dout, "add");
            CHECK(dpar_cuda_relu_forward_f32(dout, dx, n, NULL) == DPAR_OK);
            dpar_cuda_relu_forward_f32_ref(r, x, n);
            COMPARE(dout, "relu forward");
            RESET_Y();
            CHECK(dpar_cuda_relu_backward_f32(dy, dy, dx, n, NULL) == DPAR_OK);
            dpar_cuda_relu_backward_f32_ref(r, y, x, n);
            COMPARE(dy, "relu backward");
            RESET_Y();
            CHECK(dpar_cuda_bias_add_f32(dy, dbias, rows, cols, NULL) == DPAR_OK);
            dpar_cuda_bias_add_f32_ref(r, bias, rows, cols);
            COMPARE(dy, "bias add");
            { /* the bias gradient: cols sums of dy (rows x cols) */
                float *dgb = (float *)dev_copy(NULL, cols * 4);
                size_t bad;
                CHECK(dpar_cuda_bias_backward_f32(dgb, dx, rows, cols, NULL) == DPAR_OK);
                dpar_cuda_bias_backward_f32_ref(r, x, rows, cols);
                to_host(got, dgb, cols * 4);
                bad = count_diff(got, r, cols, 4, 0);
                CHECK_MSG(bad == 0, "bias backward rows=%zu: %zu columns differ", rows, bad);
                cudaFree(dgb);
            }
#undef RESET_Y
#undef COMPARE
            cudaFree(dx - off), cudaFree(dy - off), cudaFree(dout - off), cudaFree(dbias);
            free(x), free(y), free(r), free(got), free(bias);
        }
}

/* reduce and divide, every dtype and op, against the references (which the host test ties to dpar__reduce) */
static void test_reduce_and_divide(void)
{
    static const dpar_dtype ts[] = {DPAR_F32, DPAR_BF16, DPAR_F16, DPAR_F64, DPAR_I32, DPAR_I64, DPAR_U8};
    static const int divs[] = {0, 3, 8};
    size_t n = 65537 + 3, i;
    int t, op, d;
    NEED_GPU();
    for (t = 0; t < 7; t++) {
        size_t es = dpar_dtype_size(ts[t]);
        int bf16 = ts[t] == DPAR_BF16 ? 1 : ts[t] == DPAR_I32 || ts[t] == DPAR_I64 || ts[t] == DPAR_U8 ? -1 : 0;
        char *a = (char *)malloc(n * es), *b = (char *)malloc(n * es), *r = (char *)malloc(n * es),
             *got = (char *)malloc(n * es);
        char *da = (char *)dev_copy(NULL, n * es), *db = (char *)dev_copy(NULL, n * es),
             *dout = (char *)dev_copy(NULL, n * es);
        if (ts[t] == DPAR_F32) {
            fill_random((float *)a, n); /* with NaN, infinities, -0, subnormals */
            fill_random((float *)b, n);
        } else if (es != 2) { /* f64 and the integers: random bits (f64: NaNs and infinities among them) */
            for (i = 0; i < n * es; i++) a[i] = (char)dt_rand(), b[i] = (char)dt_rand();
        } else {
            for (i = 0; i < n; i++)
                ((uint16_t *)a)[i] = (uint16_t)(i & 0xffff), ((uint16_t *)b)[i] = (uint16_t)dt_rand();
        }
        cudaMemcpy(da, a, n * es, cudaMemcpyHostToDevice);
        cudaMemcpy(db, b, n * es, cudaMemcpyHostToDevice);
        for (op = 0; op < DPAR_OP_COUNT; op++)
            for (d = 0; d < 3; d++) {
                size_t bad;
                CHECK(dpar_cuda_reduce(dout, da, db, n, ts[t], (dpar_op)op, divs[d], NULL) == DPAR_OK);
                dpar_cuda_reduce_ref(r, a, b, n, ts[t], (dpar_op)op, divs[d]);
                to_host(got, dout, n * es);
                bad = count_diff(got, r, n, es, bf16);
                CHECK_MSG(bad == 0, "reduce %s %s div %d: %zu differ", dpar_dtype_name(ts[t]),
                          dpar_op_name((dpar_op)op), divs[d], bad);
                /* misaligned by one element: the scalar path */
                CHECK(dpar_cuda_reduce(dout + es, da + es, db + es, n - 1, ts[t], (dpar_op)op, divs[d], NULL) ==
                      DPAR_OK);
                dpar_cuda_reduce_ref(r, a + es, b + es, n - 1, ts[t], (dpar_op)op, divs[d]);
                to_host(got, dout + es, (n - 1) * es);
                bad = count_diff(got, r, n - 1, es, bf16);
                CHECK_MSG(bad == 0, "reduce (off by one) %s %s: %zu differ", dpar_dtype_name(ts[t]),
                          dpar_op_name((dpar_op)op), bad);
                /* only out misaligned: every pointer's alignment must be checked (a missed one faults here) */
                CHECK(dpar_cuda_reduce(dout + es, da, db, n - 1, ts[t], (dpar_op)op, divs[d], NULL) == DPAR_OK);
                dpar_cuda_reduce_ref(r, a, b, n - 1, ts[t], (dpar_op)op, divs[d]);
                to_host(got, dout + es, (n - 1) * es);
                bad = count_diff(got, r, n - 1, es, bf16);
                CHECK_MSG(bad == 0, "reduce (out off by one) %s %s: %zu differ", dpar_dtype_name(ts[t]),
                          dpar_op_name((dpar_op)op), bad);
            }
        for (d = 0; d < 3; d++) {
            size_t bad;
            CHECK(dpar_cuda_divide(dout, da, n, ts[t], divs[d], NULL) == DPAR_OK);
            dpar_cuda_divide_ref(r, a, n, ts[t], divs[d]);
            to_host(got, dout, n * es);
            bad = count_diff(got, r, n, es, bf16);
            CHECK_MSG(bad == 0, "divide %s div %d: %zu differ", dpar_dtype_name(ts[t]), divs[d], bad);
        }
        cudaFree(da), cudaFree(db), cudaFree(dout);
        free(a), free(b), free(r), free(got);
    }
}

/* the integer average for any group size: u8 over every pair (a, b) is ((a + b) mod 256) / div, 0 for every pair
   once div >= 256 (the divisor was once (uint8_t)div: 0 for 256 ranks, 44 for 300); the device against that formula
   and the reference, on the vector path and one element off; dpar_cuda_divide too */
static void test_integer_average_any_group_size(void)
{
    static const int divs[] = {255, 256, 257, 300, 1000, 1 << 20};
    size_t n = 65536, i, d;
    uint8_t *a, *b, *want, *ref, *got, *da, *db, *dout;
    NEED_GPU();
    a = (uint8_t *)malloc(n), b = (uint8_t *)malloc(n), want = (uint8_t *)malloc(n), ref = (uint8_t *)malloc(n);
    got = (uint8_t *)malloc(n);
    for (i = 0; i < n; i++) a[i] = (uint8_t)(i >> 8), b[i] = (uint8_t)i;
    da = (uint8_t *)dev_copy(a, n), db = (uint8_t *)dev_copy(b, n), dout = (uint8_t *)dev_copy(NULL, n);
    for (d = 0; d < sizeof divs / sizeof divs[0]; d++) {
        size_t off;
        for (i = 0; i < n; i++) want[i] = (uint8_t)(((unsigned)a[i] + b[i]) % 256u / (unsigned)divs[d]);
        dpar_cuda_reduce_ref(ref, a, b, n, DPAR_U8, DPAR_AVG, divs[d]);
        CHECK_MSG(memcmp(ref, want, n) == 0, "reference, u8 avg div %d", divs[d]);
        for (off = 0; off < 2; off++) { /* 0: 16-byte vectors; 1: one element off, the scalar path */
            CHECK(dpar_cuda_reduce(dout + off, da + off, db + off, n - off, DPAR_U8, DPAR_AVG, divs[d], NULL) ==
                  DPAR_OK);
            to_host(got, dout + off, n - off);
            CHECK_MSG(memcmp(got, want + off, n - off) == 0, "u8 avg div %d off %zu: %zu differ", divs[d], off,
                      count_diff(got, want + off, n - off, 1, -1));
        }
        for (i = 0; i < n; i++) want[i] = (uint8_t)(a[i] / (unsigned)divs[d]);
        CHECK(dpar_cuda_divide(dout, da, n, DPAR_U8, divs[d], NULL) == DPAR_OK);
        to_host(got, dout, n);
        CHECK_MSG(memcmp(got, want, n) == 0, "u8 divide div %d", divs[d]);
    }
    cudaFree(da), cudaFree(db), cudaFree(dout);
    free(a), free(b), free(want), free(ref), free(got);
}

/* casts between f32, bf16 and f16: every 16-bit pattern; floats around every bf16 pattern */
static void test_casts(void)
{
    static const dpar_dtype ts[] = {DPAR_F32, DPAR_BF16, DPAR_F16};
    size_t n = 65536 * 4, i;
    int a, b;
    NEED_GPU();
    for (a = 0; a < 3; a++)
        for (b = 0; b < 3; b++) {
            size_t ei = dpar_dtype_size(ts[a]), eo = dpar_dtype_size(ts[b]), bad;
            char *in = (char *)malloc(n * ei), *r = (char *)malloc(n * eo), *got = (char *)malloc(n * eo);
            char *din = (char *)dev_copy(NULL, n * ei), *dout = (char *)dev_copy(NULL, n * eo);
            for (i = 0; i < n; i++) {
                if (ei == 4) {
                    uint32_t u = (uint32_t)(i % 65536) << 16 | (uint32_t)(i / 65536 == 0 ? 0x8000 : dt_rand() & 0xffff);
                    memcpy(in + i * 4, &u, 4);
                } else {
                    ((uint16_t *)in)[i] = (uint16_t)i;
                }
            }
            cudaMemcpy(din, in, n * ei, cudaMemcpyHostToDevice);
            CHECK(dpar_cuda_cast(dout, ts[b], din, ts[a], n, NULL) == DPAR_OK);
            dpar_cuda_cast_ref(r, ts[b], in, ts[a], n);
            to_host(got, dout, n * eo);
            bad = count_diff(got, r, n, eo, ts[b] == DPAR_BF16);
            CHECK_MSG(bad == 0, "cast %s -> %s: %zu differ", dpar_dtype_name(ts[a]), dpar_dtype_name(ts[b]), bad);
            cudaFree(din), cudaFree(dout);
            free(in), free(r), free(got);
        }
}

/* SGD with momentum and AdamW: three steps, bitwise (no fused multiply-add, IEEE division and square root) */
static void test_optimizers(void)
{
    size_t n = 65537, B = n * 4, bad;
    int adam, step;
    NEED_GPU();
    for (adam = 0; adam < 2; adam++) {
        float *p = (float *)malloc(B), *m = (float *)calloc(n, 4), *v = (float *)calloc(n, 4), *g = (float *)malloc(B);
        float *got = (float *)malloc(B);
        float *dp, *dm, *dv, *dg;
        fill_random(p, n);
        dp = (float *)dev_copy(p, B), dm = (float *)dev_copy(m, B), dv = (float *)dev_copy(v, B),
        dg = (float *)dev_copy(NULL, B);
        for (step = 1; step <= 3; step++) {
            size_t i;
            for (i = 0; i < n; i++) g[i] = frand();
            cudaMemcpy(dg, g, B, cudaMemcpyHostToDevice);
            if (adam) {
                CHECK(dpar_cuda_adamw_f32(dp, dm, dv, dg, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step, NULL) == DPAR_OK);
                dpar_cuda_adamw_f32_ref(p, m, v, g, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step);
            } else {
                CHECK(dpar_cuda_sgd_f32(dp, dm, dg, n, 0.05f, 0.9f, 1e-4f, NULL) == DPAR_OK);
                dpar_cuda_sgd_f32_ref(p, m, g, n, 0.05f, 0.9f, 1e-4f);
            }
            to_host(got, dp, B);
            bad = count_diff(got, p, n, 4, 0);
            CHECK_MSG(bad == 0, "%s step %d: %zu parameters differ", adam ? "adamw" : "sgd", step, bad);
            to_host(got, dm, B);
            bad = count_diff(got, m, n, 4, 0);
            CHECK_MSG(bad == 0, "%s step %d: %zu moments differ", adam ? "adamw" : "sgd", step, bad);
        }
        cudaFree(dp), cudaFree(dm), cudaFree(dv), cudaFree(dg);
        free(p), free(m), free(v), free(g), free(got);
    }
}

/* softmax cross-entropy: CUDA's expf/logf are within 2 ulp of glibc's: relative 1e-5, plus 4e-7 absolute for the
   loss (near 0 it is the log of a sum near 1, whose last bit can move: ulp(1) = 1.2e-7) and 1e-7 for the gradient */
static void test_softmax_xent(void)
{
    static const int classess[] = {1, 10, 100};
    size_t rows = 4099, r, i;
    int c;
    NEED_GPU();
    for (c = 0; c < 3; c++) {
        size_t C = (size_t)classess[c], bad = 0;
        float *z = (float *)malloc(rows * C * 4), *l = (float *)malloc(rows * 4), *d = (float *)malloc(rows * C * 4);
        float *gl = (float *)malloc(rows * 4), *gd = (float *)malloc(rows * C * 4), *dz, *dl, *dd;
        int *lab = (int *)malloc(rows * sizeof(int)), *dlab;
        for (i = 0; i < rows * C; i++) z[i] = frand() * 8;
        for (r = 0; r < rows; r++) lab[r] = r == 7 ? (int)C : (int)(dt_rand() % C);
        dz = (float *)dev_copy(z, rows * C * 4), dl = (float *)dev_copy(NULL, rows * 4),
        dd = (float *)dev_copy(NULL, rows * C * 4);
        dlab = (int *)dev_copy(lab, rows * sizeof(int));
        CHECK(dpar_cuda_softmax_xent_forward_f32(dl, dz, dlab, rows, (int)C, NULL) == DPAR_OK);
        CHECK(dpar_cuda_softmax_xent_backward_f32(dd, dz, dlab, rows, (int)C, NULL) == DPAR_OK);
        dpar_cuda_softmax_xent_forward_f32_ref(l, z, lab, rows, (int)C);
        dpar_cuda_softmax_xent_backward_f32_ref(d, z, lab, rows, (int)C);
        to_host(gl, dl, rows * 4);
        to_host(gd, dd, rows * C * 4);
        for (r = 0; r < rows; r++)
            bad += !(isnan(l[r]) ? isnan(gl[r]) : fabsf(gl[r] - l[r]) <= 1e-5f * fabsf(l[r]) + 4e-7f);
        for (i = 0; i < rows * C; i++)
            bad += !(isnan(d[i]) ? isnan(gd[i]) : fabsf(gd[i] - d[i]) <= 1e-5f * fabsf(d[i]) + 1e-7f);
        CHECK_MSG(bad == 0, "classes %zu: %zu values outside the tolerance", C, bad);
        cudaFree(dz), cudaFree(dl), cudaFree(dd), cudaFree(dlab);
        free(z), free(l), free(d), free(gl), free(gd), free(lab);
    }
}

/* dpar_cuda_sgemm against dpar_sgemm_ref (double accumulation): every trans pair, beta 0 and not. Tolerance:
   float accumulation of K products of |a| |b| <= 16: 1e-5 * K * 16 absolute */
static void test_sgemm(void)
{
    static const int shapes[][3] = {{1, 1, 1}, {33, 17, 9}, {128, 64, 256}, {7, 300, 5}};
    cublasHandle_t h;
    int s, ta, tb;
    NEED_GPU();
    CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
    for (s = 0; s < 4; s++)
        for (ta = 0; ta < 2; ta++)
            for (tb = 0; tb < 2; tb++) {
                int M = shapes[s][0], N = shapes[s][1], K = shapes[s][2], lda = (ta ? M : K) + 1,
                    ldb = (tb ? K : N) + 2;
                int ldc = N + 3, bad = 0;
                size_t sa = (size_t)(ta ? K : M) * lda, sb = (size_t)(tb ? N : K) * ldb, sc = (size_t)M * ldc, i;
                float *A = (float *)malloc(sa * 4), *Bm = (float *)malloc(sb * 4), *C = (float *)malloc(sc * 4);
                float *R = (float *)malloc(sc * 4), *dA, *dB, *dC;
                for (i = 0; i < sa; i++) A[i] = frand();
                for (i = 0; i < sb; i++) Bm[i] = frand();
                for (i = 0; i < sc; i++) C[i] = R[i] = frand();
                dA = (float *)dev_copy(A, sa * 4), dB = (float *)dev_copy(Bm, sb * 4),
                dC = (float *)dev_copy(C, sc * 4);
                CHECK(dpar_cuda_sgemm((dpar_trans)ta, (dpar_trans)tb, M, N, K, 1.5f, dA, lda, dB, ldb, 0.5f, dC, ldc, h,
                                      NULL) == DPAR_OK);
                dpar_sgemm_ref((dpar_trans)ta, (dpar_trans)tb, M, N, K, 1.5f, A, lda, Bm, ldb, 0.5f, R, ldc);
                to_host(C, dC, sc * 4);
                for (i = 0; i < (size_t)M; i++)
                    for (int j = 0; j < N; j++)
                        bad += !(fabsf(C[i * ldc + j] - R[i * ldc + j]) <= 1e-5f * 16 * K + 1e-5f);
                CHECK_MSG(bad == 0, "sgemm %dx%dx%d ta %d tb %d: %d elements outside the tolerance", M, N, K, ta, tb,
                          bad);
                cudaFree(dA), cudaFree(dB), cudaFree(dC);
                free(A), free(Bm), free(C), free(R);
            }
    cublasDestroy(h);
}

/* ---- the GPU pool ---- */
static void test_pool_refuses_bad_descs(void) /* runs without a device: the desc is checked first */
{
    dpar_cuda_pool *p = (dpar_cuda_pool *)1;
    dpar_cuda_pool_desc d;
    int dev = 0;
    memset(&d, 0, sizeof d);
    d.num_devices = 1; /* without devices */
    CHECK(dpar_cuda_pool_create(&d, &p) == DPAR_EINVAL && p == NULL);
    d.num_devices = 0;
    d.devices = &dev; /* without num_devices */
    CHECK(dpar_cuda_pool_create(&d, &p) == DPAR_EINVAL);
    d.devices = NULL;
    d.workers_per_device = -1;
    CHECK(dpar_cuda_pool_create(&d, &p) == DPAR_EINVAL);
    d.workers_per_device = 0;
    d.allocator.alloc = dt_count_alloc; /* half an allocator */
    CHECK(dpar_cuda_pool_create(&d, &p) == DPAR_EINVAL);
    CHECK(dpar_cuda_pool_create(NULL, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_pool_destroy(NULL) == DPAR_OK && dpar_cuda_pool_size(NULL) == 0);
    if (gpus == 0) { /* and without a device: DPAR_EUNSUPPORTED, CUDA's reason in the text */
        CHECK(dpar_cuda_pool_create(NULL, &p) == DPAR_EUNSUPPORTED && p == NULL);
        CHECK_MSG(strstr(dpar_last_error(), "no usable CUDA device") != NULL, "%s", dpar_last_error());
    }
}

typedef struct {
    int rank[8], size[8], device[8], fail_rank, bad_launch_rank;
    float got[8];
} pool_job;
static __global__ void no_op_kernel(void) {}
static dpar_status pool_body(void *user, const dpar_cuda_worker *w)
{
    pool_job *j = (pool_job *)user;
    int dev = -1;
    float v = 0.0f;
    cudaGetDevice(&dev);
    j->rank[w->rank] = w->rank;
    j->size[w->rank] = w->size;
    j->device[w->rank] = dev;
    if (w->rank == j->fail_rank) return dpar_set_error(DPAR_EUSER, "worker %d says no", w->rank);
    if (w->rank == j->bad_launch_rank) { /* a failed launch that fn does not look at: the run must */
        no_op_kernel<<<1, 4096, 0, (cudaStream_t)w->stream>>>(); /* 4096 threads: more than a block may have */
        return DPAR_OK;
    }
    /* the worker's own stream and scratch: fill, then read back */
    if (dpar_cuda_fill_f32((float *)w->scratch, (float)(w->rank + 1), 256, w->stream) != DPAR_OK) return DPAR_ESYSTEM;
    if (cudaMemcpyAsync(&v, (float *)w->scratch + 255, sizeof v, cudaMemcpyDeviceToHost, (cudaStream_t)w->stream) !=
            cudaSuccess ||
        cudaStreamSynchronize((cudaStream_t)w->stream) != cudaSuccess)
        return dpar_set_error(DPAR_ESYSTEM, "worker %d: copy back failed", w->rank);
    j->got[w->rank] = v;
    return DPAR_OK;
}

static void test_pool_runs_every_worker(void)
{
    dpar_cuda_pool_desc d;
    dpar_cuda_pool *p = NULL;
    pool_job j;
    int r, n, dev0 = 0;
    char want[64];
    NEED_GPU();
    memset(&d, 0, sizeof d);
    d.devices = &dev0; /* device 0 ... */
    d.num_devices = 1;
    d.workers_per_device = 2; /* ... shared by two ranks: multi-rank code on one GPU */
    d.scratch_bytes = 256 * sizeof(float);
    CHECK(dpar_cuda_pool_create(&d, &p) == DPAR_OK && p);
    if (!p) return;
    n = dpar_cuda_pool_size(p);
    CHECK(n == 2);
    memset(&j, 0, sizeof j);
    j.fail_rank = j.bad_launch_rank = -1;
    CHECK(dpar_cuda_pool_run(p, pool_body, &j) == DPAR_OK);
    for (r = 0; r < n && r < 8; r++)
        CHECK_MSG(j.rank[r] == r && j.size[r] == n && j.device[r] == 0 && j.got[r] == (float)(r + 1),
                  "worker %d: rank %d size %d device %d value %g", r, j.rank[r], j.size[r], j.device[r], j.got[r]);
    j.fail_rank = n - 1; /* a failing worker's status and text reach the caller */
    CHECK(dpar_cuda_pool_run(p, pool_body, &j) == DPAR_EUSER && strstr(dpar_last_error(), "says no"));
    j.fail_rank = -1;
    /* a CUDA error after fn: DPAR_ESYSTEM naming the worker and the error CUDA gives for that launch here (CUDA
       13.0 on an H200 said cudaErrorInvalidValue, where this test used to expect cudaErrorInvalidConfiguration) */
    no_op_kernel<<<1, 4096>>>();
    snprintf(want, sizeof want, "%s", cudaGetErrorName(cudaGetLastError()));
    CHECK_MSG(strcmp(want, "cudaSuccess") != 0, "a launch of 4096 threads per block succeeded");
    j.bad_launch_rank = n - 1;
    CHECK_MSG(dpar_cuda_pool_run(p, pool_body, &j) == DPAR_ESYSTEM && strstr(dpar_last_error(), want) &&
                  strstr(dpar_last_error(), "worker 1"),
              "want %s: %s", want, dpar_last_error());
    j.bad_launch_rank = -1; /* not sticky: the pool works on */
    CHECK(dpar_cuda_pool_run(p, pool_body, &j) == DPAR_OK);
    CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
}

/* ---- tasks bound to workers: dependencies across workers through CUDA events ---- */
typedef struct {
    float *buf[2];
    size_t n;
} chain_job;
static dpar_status fill_task(void *user, const dpar_cuda_worker *w) /* worker 0: buf0 = 2 */
{
    chain_job *j = (chain_job *)user;
    return dpar_cuda_fill_f32(j->buf[0], 2.0f, j->n, w->stream);
}
static dpar_status axpy_task(void *user, const dpar_cuda_worker *w) /* worker 1: buf1 += 3 buf0 */
{
    chain_job *j = (chain_job *)user;
    return dpar_cuda_axpy_f32(j->buf[1], j->buf[0], 3.0f, j->n, w->stream);
}
static dpar_status failing_task(void *user, const dpar_cuda_worker *w)
{
    (void)user;
    return dpar_set_error(DPAR_EUSER, "task on worker %d says no", w->rank);
}

/* ---- the pool's comm: dpar.h's collectives on device buffers, every path ---- */
typedef struct comm_job {
    size_t n;
    int no_p2p;              /* an NCCL comm: point-to-point is NCCL's own */
    dpar_comm **comms;       /* per worker, instead of worker->comm (NULL: worker->comm) */
    int fail_rank;           /* this worker fails its run instead of calling the collective (-1: none) */
    dpar_cuda_pool *ordered; /* a stream-ordered pool: each call is followed by dpar_cuda_comm_sync (NULL: none) */
    dpar_status st[64];
    double seconds[64];
    char first[64][600]; /* the first wrong result or error of worker r */
} comm_job;

static float cin(int q, size_t i) { return (float)((int)((q * 7 + i * 13) % 17) - 8); } /* sums are exact */
/* alltoallv's elements from worker r to worker q: 0 to 1.5 per, some pairs (and some ranks to themselves) none */
static size_t vcount(int r, int q, size_t per) { return (size_t)((r * 3 + q) % 4) * per / 2; }

#define COMM_TRY(what, call)                                                              \
    do {                                                                                  \
        dpar_status st_ = (call);                                                         \
        if (st_ == DPAR_OK && j->ordered) st_ = dpar_cuda_comm_sync(j->ordered, r);       \
        if (st_ != DPAR_OK && !j->first[r][0])                                            \
            snprintf(j->first[r], sizeof j->first[r], "%s: %s", what, dpar_last_error()); \
    } while (0)
#define COMM_EXPECT(what, cond, i)                                                           \
    do {                                                                                     \
        if (!(cond) && !j->first[r][0])                                                      \
            snprintf(j->first[r], sizeof j->first[r], "%s: element %zu", what, (size_t)(i)); \
    } while (0)

static dpar_status comm_body(void *user, const dpar_cuda_worker *w)
{
    comm_job *j = (comm_job *)user;
    int r = w->rank, N = w->size, q;
    dpar_comm *comm = j->comms ? j->comms[r] : w->comm;
    size_t n = j->n, i, off, len, per = n / (size_t)N ? n / (size_t)N : 1;
    size_t big = n * (size_t)N + (size_t)N;
    cudaStream_t s = (cudaStream_t)w->stream;
    float *h = (float *)malloc(big * 4), *got = (float *)malloc(big * 4), *dx = NULL, *dy = NULL;
    dpar_request *req = NULL;
    uint16_t *hb = (uint16_t *)malloc(n * 2);
    int32_t *hi = (int32_t *)malloc(n * 4);
    if (cudaMalloc(&dx, big * 4) != cudaSuccess || cudaMalloc(&dy, big * 4) != cudaSuccess) {
        free(h), free(got), free(hb), free(hi);
        return dpar_set_error(DPAR_ENOMEM, "cudaMalloc");
    }
    dpar_block_range(n, N, r, &off, &len);
    /* allreduce, out of place: the input goes in on the worker's stream, which the call waits for */
    for (i = 0; i < n; i++) h[i] = cin(r, i);
    cudaMemcpyAsync(dx, h, n * 4, cudaMemcpyHostToDevice, s);
    COMM_TRY("allreduce", dpar_allreduce(comm, dx, dy, n, DPAR_F32, DPAR_SUM));
    cudaMemcpy(got, dy, n * 4, cudaMemcpyDeviceToHost);
    for (i = 0; i < n; i++) {
        float want = 0;
        for (q = 0; q < N; q++) want += cin(q, i);
        COMM_EXPECT("allreduce sum", got[i] == want, i);
    }
    /* in place, average: dpar's rule divides the sum once (bitwise); NCCL's ncclAvg (no_p2p: an NCCL comm) scales
       each input by 1/N first, the same bits only where N is a power of two (docs/cuda.md, 'NCCL') */
    COMM_TRY("allreduce avg", dpar_allreduce(comm, dx, dx, n, DPAR_F32, DPAR_AVG));
    cudaMemcpy(got, dx, n * 4, cudaMemcpyDeviceToHost);
    for (i = 0; i < n; i++) {
        float want = 0;
        for (q = 0; q < N; q++) want += cin(q, i);
        want /= (float)N;
        if (j->no_p2p && (N & (N - 1)))
            COMM_EXPECT("allreduce avg in place (ncclAvg)", fabsf(got[i] - want) <= 1e-6f * (fabsf(want) + 1.0f), i);
        else COMM_EXPECT("allreduce avg in place", got[i] == want, i);
    }
    /* reduce-scatter (max) and all-gather */
    cudaMemcpyAsync(dx, h, n * 4, cudaMemcpyHostToDevice, s); /* on the stream the call waits for */
    COMM_TRY("reduce_scatter", dpar_reduce_scatter(comm, dx, dy, n, DPAR_F32, DPAR_MAX));
    cudaMemcpy(got, dy, len * 4, cudaMemcpyDeviceToHost);
    for (i = 0; i < len; i++) {
        float want = cin(0, off + i);
        for (q = 1; q < N; q++) want = cin(q, off + i) > want ? cin(q, off + i) : want;
        COMM_EXPECT("reduce_scatter max", got[i] == want, off + i);
    }
    COMM_TRY("allgather", dpar_allgather(comm, dx + off, dy, n, DPAR_F32));
    cudaMemcpy(got, dy, n * 4, cudaMemcpyDeviceToHost);
    for (q = 0; q < N; q++) {
        size_t qo, ql;
        dpar_block_range(n, N, q, &qo, &ql);
        for (i = qo; i < qo + ql; i++) COMM_EXPECT("allgather", got[i] == cin(q, i), i);
    }
    /* broadcast from the last worker, reduce (sum) to worker 0 */
    COMM_TRY("broadcast", dpar_broadcast(comm, dx, dy, n, DPAR_F32, N - 1));
    cudaMemcpy(got, dy, n * 4, cudaMemcpyDeviceToHost);
    for (i = 0; i < n; i++) COMM_EXPECT("broadcast", got[i] == cin(N - 1, i), i);
    COMM_TRY("reduce", dpar_reduce(comm, dx, r == 0 ? dy : NULL, n, DPAR_F32, DPAR_SUM, 0));
    if (r == 0) {
        cudaMemcpy(got, dy, n * 4, cudaMemcpyDeviceToHost);
        for (i = 0; i < n; i++) {
            float want = 0;
            for (q = 0; q < N; q++) want += cin(q, i);
            COMM_EXPECT("reduce", got[i] == want, i);
        }
    }
    /* alltoall: block q of mine goes to worker q */
    for (q = 0; q < N; q++)
        for (i = 0; i < per; i++) h[(size_t)q * per + i] = cin(r * 100 + q, i);
    cudaMemcpyAsync(dx, h, (size_t)N * per * 4, cudaMemcpyHostToDevice, s); /* on the stream the call waits for */
    COMM_TRY("alltoall", dpar_alltoall(comm, dx, dy, per, DPAR_F32));
    cudaMemcpy(got, dy, (size_t)N * per * 4, cudaMemcpyDeviceToHost);
    for (q = 0; q < N; q++)
        for (i = 0; i < per; i++) COMM_EXPECT("alltoall", got[(size_t)q * per + i] == cin(q * 100 + r, i), i);
    /* alltoallv: worker r sends vcount(r, q) elements to worker q (some pairs none), packed; the receive counts come
       from dpar_alltoallv_counts and are checked against the same formula */
    {
        size_t sc[64], rc[64], at = 0;
        for (q = 0; q < N; q++) sc[q] = vcount(r, q, per);
        for (q = 0; q < N; q++)
            for (i = 0; i < sc[q]; i++) h[at++] = cin(r * 100 + q, i);
        cudaMemcpyAsync(dx, h, at * 4, cudaMemcpyHostToDevice, s); /* on the stream the call waits for */
        COMM_TRY("alltoallv_counts", dpar_alltoallv_counts(comm, sc, rc));
        for (q = 0; q < N; q++) COMM_EXPECT("alltoallv_counts", rc[q] == vcount(q, r, per), q);
        if (!j->first[r][0]) {
            COMM_TRY("alltoallv", dpar_alltoallv(comm, dx, sc, NULL, dy, rc, NULL, DPAR_F32));
            for (at = 0, q = 0; q < N; q++) at += rc[q];
            cudaMemcpy(got, dy, at * 4, cudaMemcpyDeviceToHost);
            for (at = 0, q = 0; q < N; q++)
                for (i = 0; i < rc[q]; i++, at++) COMM_EXPECT("alltoallv", got[at] == cin(q * 100 + r, i), at);
        }
    }
    /* point to point around the ring */
    for (i = 0; i < n; i++) h[i] = cin(r + 50, i);
    cudaMemcpyAsync(dx, h, n * 4, cudaMemcpyHostToDevice, s); /* on the stream the call waits for */
    if (!j->no_p2p) {
        COMM_TRY("sendrecv", dpar_sendrecv(comm, dx, n, (r + 1) % N, dy, n, (r + N - 1) % N, DPAR_F32, 7));
        cudaMemcpy(got, dy, n * 4, cudaMemcpyDeviceToHost);
        for (i = 0; i < n; i++) COMM_EXPECT("sendrecv", got[i] == cin((r + N - 1) % N + 50, i), i);
    } else if (N > 1 && dpar_send(comm, dx, n, DPAR_F32, (r + 1) % N, 7) != DPAR_EUNSUPPORTED && !j->first[r][0]) {
        snprintf(j->first[r], sizeof j->first[r], "send on an NCCL comm was not refused");
    }
    /* an async request; bf16 and i32 */
    COMM_TRY("iallreduce", dpar_iallreduce(comm, dx, dy, n, DPAR_F32, DPAR_SUM, &req));
    COMM_TRY("request_wait", dpar_request_wait(req));
    cudaMemcpy(got, dy, n * 4, cudaMemcpyDeviceToHost);
    for (i = 0; i < n; i++) {
        float want = 0;
        for (q = 0; q < N; q++) want += cin(q + 50, i);
        COMM_EXPECT("iallreduce", got[i] == want, i);
    }
    for (i = 0; i < n; i++) hb[i] = dpar_f32_to_bf16(cin(r, i)), hi[i] = (int32_t)cin(r, i) * 1000003;
    cudaMemcpyAsync(dx, hb, n * 2, cudaMemcpyHostToDevice, s); /* on the stream the call waits for */
    COMM_TRY("allreduce bf16", dpar_allreduce(comm, dx, dx, n, DPAR_BF16, DPAR_SUM));
    cudaMemcpy(hb, dx, n * 2, cudaMemcpyDeviceToHost);
    for (i = 0; i < n; i++) {
        float want = 0;
        for (q = 0; q < N; q++) want += cin(q, i);
        COMM_EXPECT("allreduce bf16", dpar_bf16_to_f32(hb[i]) == want, i);
    }
    cudaMemcpyAsync(dx, hi, n * 4, cudaMemcpyHostToDevice, s); /* on the stream the call waits for */
    COMM_TRY("allreduce i32", dpar_allreduce(comm, dx, dy, n, DPAR_I32, DPAR_MIN));
    cudaMemcpy(hi, dy, n * 4, cudaMemcpyDeviceToHost);
    for (i = 0; i < n; i++) {
        int32_t want = (int32_t)cin(0, i) * 1000003;
        for (q = 1; q < N; q++) want = (int32_t)cin(q, i) * 1000003 < want ? (int32_t)cin(q, i) * 1000003 : want;
        COMM_EXPECT("allreduce i32 min", hi[i] == want, i);
    }
    cudaFree(dx), cudaFree(dy);
    free(h), free(got), free(hb), free(hi);
    return DPAR_OK;
}

static void test_pool_comm_collectives(void)
{
    static const dpar_cuda_path paths[] = {DPAR_CUDA_PATH_AUTO, DPAR_CUDA_PATH_PEER, DPAR_CUDA_PATH_MEMCPY,
                                           DPAR_CUDA_PATH_HOST};
    static const char *names[] = {"auto", "peer", "memcpy", "host"};
    /* 12 MiB: one segment of the default size, then several 1 MiB segments per chunk */
    static const size_t ns[] = {5, ((size_t)3 << 20) + 7, ((size_t)3 << 20) + 7}, segs[] = {0, 0, (size_t)1 << 20};
    int pi, ni, layout;
    NEED_GPU();
    for (layout = 0; layout < 2; layout++) /* 3 workers on device 0; then 2 on every device */
        for (pi = 0; pi < 4; pi++)
            for (ni = 0; ni < 3; ni++) {
                dpar_cuda_pool_desc d;
                dpar_cuda_pool *p = NULL;
                int dev0 = 0, r;
                comm_job *j = (comm_job *)calloc(1, sizeof *j);
                memset(&d, 0, sizeof d);
                if (layout == 0) d.devices = &dev0, d.num_devices = 1, d.workers_per_device = 3;
                else d.workers_per_device = 2;
                d.path = paths[pi];
                d.comm.timeout_ms = 20000;
                d.comm.segment_bytes = segs[ni];
                if (dpar_cuda_pool_create(&d, &p) != DPAR_OK) {
                    CHECK_MSG(paths[pi] == DPAR_CUDA_PATH_PEER && strstr(dpar_last_error(), "cannot read"), "%s",
                              dpar_last_error());
                    free(j);
                    continue;
                }
                j->n = ns[ni];
                j->fail_rank = -1;
                CHECK_MSG(dpar_cuda_pool_run(p, comm_body, j) == DPAR_OK, "%s", dpar_last_error());
                for (r = 0; r < dpar_cuda_pool_size(p); r++)
                    CHECK_MSG(!j->first[r][0], "layout %d path %s n=%zu segment %zu worker %d: %s", layout, names[pi],
                              ns[ni], segs[ni], r, j->first[r]);
                CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
                free(j);
            }
}

/* stream-ordered pools: the same collectives, each call queued on the worker's stream and its results read once
   dpar_cuda_comm_sync has waited for that stream; every path, one device and every device */
static void test_pool_comm_stream_ordered(void)
{
    static const dpar_cuda_path paths[] = {DPAR_CUDA_PATH_AUTO, DPAR_CUDA_PATH_MEMCPY, DPAR_CUDA_PATH_HOST};
    static const size_t ns[] = {5, ((size_t)3 << 20) + 7, ((size_t)3 << 20) + 7}, segs[] = {0, 0, (size_t)1 << 20};
    int pi, ni, layout;
    NEED_GPU();
    for (layout = 0; layout < 2; layout++)
        for (pi = 0; pi < 3; pi++)
            for (ni = 0; ni < 3; ni++) {
                dpar_cuda_pool_desc d;
                dpar_cuda_pool *p = NULL;
                int dev0 = 0, r;
                comm_job *j = (comm_job *)calloc(1, sizeof *j);
                memset(&d, 0, sizeof d);
                if (layout == 0) d.devices = &dev0, d.num_devices = 1, d.workers_per_device = 4;
                else d.workers_per_device = 2;
                d.path = paths[pi];
                d.stream_ordered = 1;
                d.comm.timeout_ms = 20000;
                d.comm.segment_bytes = segs[ni];
                CHECK_MSG(dpar_cuda_pool_create(&d, &p) == DPAR_OK, "%s", dpar_last_error());
                if (!p) {
                    free(j);
                    continue;
                }
                j->n = ns[ni];
                j->fail_rank = -1;
                j->ordered = p;
                CHECK_MSG(dpar_cuda_pool_run(p, comm_body, j) == DPAR_OK, "%s", dpar_last_error());
                for (r = 0; r < dpar_cuda_pool_size(p); r++)
                    CHECK_MSG(!j->first[r][0], "stream-ordered layout %d path %d n=%zu segment %zu worker %d: %s",
                              layout, (int)paths[pi], ns[ni], segs[ni], r, j->first[r]);
                CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
                free(j);
            }
}

/* the host does not wait for the device: a 100 ms kernel queued first on each worker's stream, then an allreduce
   of 16 MiB that returns in much less, and is right once the stream has run */
__global__ static void spin_ns(unsigned long long ns)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
typedef struct {
    dpar_cuda_pool *pool;
    double call_s[64];
    char first[64][600];
} ordered_job;
static dpar_status ordered_body(void *user, const dpar_cuda_worker *w)
{
    ordered_job *j = (ordered_job *)user;
    const size_t n = (size_t)4 << 20;
    float *h = (float *)malloc(n * 4), *dx = NULL;
    size_t i;
    double t0;
    dpar_status st;
    if (!h || cudaMalloc(&dx, n * 4) != cudaSuccess) return dpar_set_error(DPAR_ENOMEM, "cudaMalloc");
    for (i = 0; i < n; i++) h[i] = cin(w->rank, i);
    cudaMemcpyAsync(dx, h, n * 4, cudaMemcpyHostToDevice, (cudaStream_t)w->stream); /* ahead of the comm's work */
    spin_ns<<<1, 1, 0, (cudaStream_t)w->stream>>>(100000000ull);
    t0 = dt_now();
    st = dpar_allreduce(w->comm, dx, dx, n, DPAR_F32, DPAR_SUM);
    j->call_s[w->rank] = dt_now() - t0;
    if (st == DPAR_OK) st = dpar_cuda_comm_sync(j->pool, w->rank);
    if (st == DPAR_OK) cudaMemcpy(h, dx, n * 4, cudaMemcpyDeviceToHost);
    for (i = 0; st == DPAR_OK && i < n; i++) {
        float want = 0;
        int q;
        for (q = 0; q < w->size; q++) want += cin(q, i);
        if (h[i] != want) {
            snprintf(j->first[w->rank], sizeof j->first[w->rank], "element %zu: %g, want %g", i, h[i], want);
            break;
        }
    }
    if (st != DPAR_OK) snprintf(j->first[w->rank], sizeof j->first[w->rank], "%s", dpar_last_error());
    cudaFree(dx);
    free(h);
    return st;
}
static void test_pool_comm_stream_ordered_does_not_wait(void)
{
    dpar_cuda_pool_desc d;
    dpar_cuda_pool *p = NULL;
    ordered_job *j = (ordered_job *)calloc(1, sizeof *j);
    int dev0 = 0, r;
    NEED_GPU();
    memset(&d, 0, sizeof d);
    d.devices = &dev0, d.num_devices = 1, d.workers_per_device = 2;
    d.stream_ordered = 1;
    d.comm.timeout_ms = 20000;
    CHECK_MSG(dpar_cuda_pool_create(&d, &p) == DPAR_OK, "%s", dpar_last_error());
    if (p) {
        j->pool = p;
        CHECK_MSG(dpar_cuda_pool_run(p, ordered_body, j) == DPAR_OK, "%s", dpar_last_error());
        for (r = 0; r < 2; r++) {
            CHECK_MSG(!j->first[r][0], "worker %d: %s", r, j->first[r]);
            CHECK_MSG(j->call_s[r] < 0.05, "worker %d: the call took %.1f ms behind a 100 ms kernel", r,
                      j->call_s[r] * 1e3);
        }
        printf("    stream-ordered allreduce of 16 MiB behind a 100 ms kernel: the calls returned after %.2f and %.2f "
               "ms\n",
               j->call_s[0] * 1e3, j->call_s[1] * 1e3);
        CHECK(dpar_cuda_comm_set_stream(p, 5, NULL) == DPAR_EINVAL);
        CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
    }
    free(j);
}

/* dpar_cuda_comm_sync's deadline is the comm's: comm.timeout_ms 0 reads DPAR_TIMEOUT_MS as the comm does */
typedef struct env_deadline_job {
    dpar_cuda_pool *pool;
    dpar_status st;
    char text[600];
} env_deadline_job;
static dpar_status env_deadline_body(void *user, const dpar_cuda_worker *w)
{
    env_deadline_job *j = (env_deadline_job *)user;
    spin_ns<<<1, 1, 0, (cudaStream_t)w->stream>>>(1000000000ull); /* 1 s on the comm's stream */
    j->st = dpar_cuda_comm_sync(j->pool, w->rank);
    snprintf(j->text, sizeof j->text, "%s", j->st == DPAR_OK ? "returned DPAR_OK" : dpar_last_error());
    return DPAR_OK;
}
static void test_pool_comm_sync_deadline_from_the_environment(void)
{
    dpar_cuda_pool_desc d;
    env_deadline_job j;
    int dev0 = 0;
    NEED_GPU();
    memset(&d, 0, sizeof d);
    memset(&j, 0, sizeof j);
    d.devices = &dev0, d.num_devices = 1, d.workers_per_device = 1;
    d.stream_ordered = 1; /* comm.timeout_ms 0: the environment's */
    setenv("DPAR_TIMEOUT_MS", "150", 1);
    CHECK_MSG(dpar_cuda_pool_create(&d, &j.pool) == DPAR_OK, "%s", dpar_last_error());
    unsetenv("DPAR_TIMEOUT_MS");
    if (j.pool) {
        dpar_cuda_pool_run(j.pool, env_deadline_body, &j); /* the comm is poisoned by the deadline: its error */
        CHECK_MSG(j.st == DPAR_ETIMEDOUT && strstr(j.text, "after 150 ms"), "status %d: %s", (int)j.st, j.text);
        dpar_cuda_pool_destroy(j.pool);
    }
}

/* a worker that fails: the others' collectives return its error at once, not after the timeout */
static dpar_status fail_body(void *user, const dpar_cuda_worker *w)
{
    comm_job *j = (comm_job *)user;
    float *dx = NULL;
    double t0 = dt_now();
    int i;
    if (w->rank == j->fail_rank) return dpar_set_error(DPAR_EUSER, "worker %d ran out of patience", w->rank);
    cudaMalloc(&dx, 1024 * 4);
    cudaMemsetAsync(dx, 0, 1024 * 4, (cudaStream_t)w->stream); /* the legacy stream would race the comm's */
    for (i = 0; i < 3; i++)
        if ((j->st[w->rank] = dpar_allreduce(w->comm, dx, dx, 1024, DPAR_F32, DPAR_SUM)) != DPAR_OK) break;
    snprintf(j->first[w->rank], sizeof j->first[w->rank], "%s", dpar_last_error());
    j->seconds[w->rank] = dt_now() - t0;
    cudaFree(dx);
    return j->st[w->rank];
}
static void test_pool_comm_failure_reaches_every_worker(void)
{
    dpar_cuda_pool_desc d;
    dpar_cuda_pool *p = NULL;
    int dev0 = 0, r;
    comm_job *j = (comm_job *)calloc(1, sizeof *j);
    NEED_GPU();
    memset(&d, 0, sizeof d);
    d.devices = &dev0, d.num_devices = 1, d.workers_per_device = 3;
    d.comm.timeout_ms = 20000;
    CHECK(dpar_cuda_pool_create(&d, &p) == DPAR_OK);
    j->fail_rank = 1;
    CHECK(dpar_cuda_pool_run(p, fail_body, j) == DPAR_EUSER);
    for (r = 0; r < 3; r++) {
        if (r == 1) continue;
        CHECK_MSG(j->st[r] == DPAR_EUSER && j->seconds[r] < 5.0 && strstr(j->first[r], "ran out of patience"),
                  "worker %d: %s after %.2f s: %s", r, dpar_status_string(j->st[r]), j->seconds[r], j->first[r]);
    }
    CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
    free(j);
}

/* ---- NCCL: the same collectives through NCCL (DPAR_NCCL builds: gpu.sh's test_cuda_nccl) ---- */
/* ---- dpar_zero and dpar_fsdp on the pool's device memory: the same training as on host thread ranks, the
   parameters after FC_STEPS steps bitwise equal (the optimizer kernels round every operation on its own). The
   gradients come from the host (fsdp_case.h's model), computed from the gathered parameters read back. Both save
   a checkpoint after step GOPT_CK, make the object again over zeroed parameters and load it (the device: through
   to_host and from_host). ---- */
typedef struct {
    int stage; /* 1: dpar_zero; 2, 3: dpar_fsdp */
    dpar_optim kind;
    dpar_cuda_pool *ordered; /* a stream-ordered pool: the host reads after dpar_cuda_comm_sync */
    float *out[2][4][FC_U];  /* [0]: host ranks, [1]: the pool's workers */
    char first[4][600];
    char ckpt[2][300]; /* the host ranks' checkpoint, the workers' */
} gopt_job;
enum { GOPT_CK = 3 };
typedef struct {
    gopt_job *j;
    int device, rank;
    cudaStream_t stream;
} gopt_ctx;
static void gopt_in(const gopt_ctx *x, void *dst, const void *src, size_t bytes)
{
    if (!x->device) {
        memcpy(dst, src, bytes);
        return;
    }
    cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, x->stream); /* behind what the stream has queued */
    cudaStreamSynchronize(x->stream);                                    /* src is reused */
}
static void gopt_out(const gopt_ctx *x, void *dst, const void *src, size_t bytes)
{
    if (!x->device) {
        memcpy(dst, src, bytes);
        return;
    }
    if (x->j->ordered) dpar_cuda_comm_sync(x->j->ordered, x->rank);
    cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
}
#define GOPT_TRY(call)                                                                                       \
    do {                                                                                                     \
        if ((st = (call)) != DPAR_OK) {                                                                      \
            snprintf(x->j->first[x->rank], sizeof x->j->first[x->rank], "%s: %s", #call, dpar_last_error()); \
            goto done;                                                                                       \
        }                                                                                                    \
    } while (0)
static dpar_status gopt_train(const gopt_ctx *x, dpar_comm *c)
{
    gopt_job *j = x->j;
    size_t total = 0, i, at[FC_U + 1];
    float *host, *hgrad, *dev = NULL, *dgrad = NULL, s[FC_U], *pp, *gg;
    dpar_zero *z = NULL;
    dpar_fsdp *f = NULL;
    dpar_status st = DPAR_OK;
    int u, step, r = x->rank;
    for (u = 0; u < FC_U; u++) at[u] = total, total += fc_counts[u];
    host = (float *)malloc(total * 4), hgrad = (float *)malloc(total * 4);
    if (x->device) cudaMalloc(&dev, total * 4), cudaMalloc(&dgrad, total * 4);
    else dev = (float *)malloc(total * 4), dgrad = (float *)malloc(total * 4);
    for (u = 0; u < FC_U; u++)
        for (i = 0; i < fc_counts[u]; i++) host[at[u] + i] = fc_init(u, i);
    gopt_in(x, dev, host, total * 4);
    if (j->stage == 1) {
        dpar_zero_desc d;
        memset(&d, 0, sizeof d);
        d.comm = c, d.count = total, d.kind = j->kind, d.lr = 0.05f, d.momentum = 0.9f, d.weight_decay = 0.01f;
        GOPT_TRY(dpar_zero_create(&d, &z));
        for (step = 0; step < FC_STEPS; step++) {
            if (step == GOPT_CK) {
                GOPT_TRY(dpar_ckpt_save_zero(z, dev, j->ckpt[x->device], NULL, NULL, 0));
                dpar_zero_destroy(z);
                z = NULL;
                memset(host, 0, total * 4);
                gopt_in(x, dev, host, total * 4);
                GOPT_TRY(dpar_zero_create(&d, &z));
                GOPT_TRY(dpar_ckpt_load_zero(z, dev, j->ckpt[x->device], NULL, NULL, 0));
            }
            gopt_out(x, host, dev, total * 4);
            for (u = 0; u < FC_U; u++) {
                s[u] = fc_forward(host + at[u], r, step, u);
                fc_backward(hgrad + at[u], host + at[u], s[u], r, step, u);
            }
            gopt_in(x, dgrad, hgrad, total * 4);
            GOPT_TRY(dpar_zero_step(z, dev, dgrad));
        }
    } else {
        dpar_fsdp_desc d;
        memset(&d, 0, sizeof d);
        d.comm = c, d.stage = j->stage, d.num_units = FC_U, d.unit_counts = fc_counts, d.kind = j->kind;
        d.lr = 0.05f, d.momentum = 0.9f, d.weight_decay = 0.01f;
        GOPT_TRY(dpar_fsdp_create(&d, &f));
        for (u = 0; u < FC_U; u++) GOPT_TRY(dpar_fsdp_set_params(f, u, dev + at[u]));
        for (step = 0; step < FC_STEPS; step++) {
            if (step == GOPT_CK) {
                GOPT_TRY(dpar_ckpt_save_fsdp(f, j->ckpt[x->device], NULL, NULL, 0));
                dpar_fsdp_destroy(f);
                f = NULL;
                memset(host, 0, total * 4);
                gopt_in(x, dev, host, total * 4);
                GOPT_TRY(dpar_fsdp_create(&d, &f));
                for (u = 0; u < FC_U; u++) GOPT_TRY(dpar_fsdp_set_params(f, u, dev + at[u]));
                GOPT_TRY(dpar_ckpt_load_fsdp(f, j->ckpt[x->device], NULL, NULL, 0));
            }
            for (u = 0; u < FC_U; u++) {
                GOPT_TRY(dpar_fsdp_gather(f, u, &pp));
                gopt_out(x, host, pp, fc_counts[u] * 4);
                s[u] = fc_forward(host, r, step, u);
                GOPT_TRY(dpar_fsdp_release(f, u));
            }
            for (u = FC_U - 1; u >= 0; u--) {
                if (step == 2 && u == 1) continue; /* a unit without gradients this step */
                GOPT_TRY(dpar_fsdp_gather(f, u, &pp));
                gopt_out(x, host, pp, fc_counts[u] * 4);
                fc_backward(hgrad, host, s[u], r, step, u);
                GOPT_TRY(dpar_fsdp_release(f, u));
                GOPT_TRY(dpar_fsdp_grads(f, u, &gg));
                gopt_in(x, gg, hgrad, fc_counts[u] * 4);
                GOPT_TRY(dpar_fsdp_reduce(f, u));
            }
            GOPT_TRY(dpar_fsdp_step(f));
        }
        for (u = 0; u < FC_U; u++) GOPT_TRY(dpar_fsdp_get_params(f, u, dev + at[u]));
    }
    gopt_out(x, host, dev, total * 4);
    for (u = 0; u < FC_U; u++) memcpy(j->out[x->device][r][u], host + at[u], fc_counts[u] * 4);
done:
    dpar_zero_destroy(z);
    dpar_fsdp_destroy(f);
    if (x->device) cudaFree(dev), cudaFree(dgrad);
    else free(dev), free(dgrad);
    free(host), free(hgrad);
    return st;
}
static void gopt_host_rank(world *w, dpar_comm *c, int r)
{
    gopt_ctx x = {(gopt_job *)w->user, 0, r, NULL};
    if (gopt_train(&x, c) != DPAR_OK) note(w, "host rank %d: %s", r, x.j->first[r]);
}
static dpar_status gopt_body(void *user, const dpar_cuda_worker *w)
{
    gopt_ctx x = {(gopt_job *)user, 1, w->rank, (cudaStream_t)w->stream};
    return gopt_train(&x, w->comm);
}
/* one case: the pool made from d trains as host thread ranks of its size do */
static void gopt_case(dpar_cuda_pool_desc *d, int stage, int kind, const char *what)
{
    dpar_cuda_pool *p = NULL;
    gopt_job *j = (gopt_job *)calloc(1, sizeof *j);
    int r, u, k, n;
    char dir[] = "/tmp/dpar_gpuckpt_XXXXXX", cmd[400];
    CHECK_MSG(dpar_cuda_pool_create(d, &p) == DPAR_OK, "%s", dpar_last_error());
    if (!p || !mkdtemp(dir)) {
        dpar_cuda_pool_destroy(p);
        free(j);
        return;
    }
    for (k = 0; k < 2; k++) snprintf(j->ckpt[k], sizeof j->ckpt[k], "%s/%s", dir, k ? "workers" : "host");
    n = dpar_cuda_pool_size(p);
    for (k = 0; k < 2; k++)
        for (r = 0; r < 4; r++)
            for (u = 0; u < FC_U; u++) j->out[k][r][u] = (float *)calloc(fc_counts[u], 4);
    j->stage = stage, j->kind = (dpar_optim)kind;
    j->ordered = d->stream_ordered ? p : NULL;
    CHECK(n <= 4 && run_world(n, gopt_host_rank, j) == 0);
    CHECK_MSG(dpar_cuda_pool_run(p, gopt_body, j) == DPAR_OK, "%s %s", dpar_last_error(), j->first[0]);
    for (r = 0; r < n && r < 4; r++)
        for (u = 0; u < FC_U; u++)
            CHECK_MSG(!memcmp(j->out[0][r][u], j->out[1][r][u], fc_counts[u] * 4),
                      "%s of %d, %s %s, worker %d unit %d: not the host's bits", what, n,
                      stage == 1   ? "zero-1"
                      : stage == 2 ? "fsdp stage 2"
                                   : "fsdp stage 3",
                      kind ? "adam" : "sgd", r, u);
    CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
    for (k = 0; k < 2; k++)
        for (r = 0; r < 4; r++)
            for (u = 0; u < FC_U; u++) free(j->out[k][r][u]);
    free(j);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}
static void test_pool_zero_and_fsdp_bitwise_host(void)
{
    int ordered, stage, kind, ni;
    NEED_GPU();
    for (ordered = 0; ordered < 2; ordered++)
        for (ni = 2; ni <= 4; ni += 2)
            for (stage = 1; stage <= 3; stage++)
                for (kind = 0; kind < 2; kind++) {
                    dpar_cuda_pool_desc d;
                    int dev0 = 0;
                    memset(&d, 0, sizeof d);
                    d.devices = &dev0, d.num_devices = 1, d.workers_per_device = ni;
                    d.stream_ordered = ordered;
                    d.comm.timeout_ms = 20000;
                    gopt_case(&d, stage, kind, ordered ? "stream-ordered pool" : "blocking pool");
                }
}
#ifdef DPAR_NCCL
/* the same over NCCL comms (one worker per device): dpar_zero and dpar_fsdp through the comm's desc.memory */
static void test_nccl_zero_and_fsdp_bitwise_host(void)
{
    int stage, kind;
    NEED_GPU();
    for (stage = 1; stage <= 3; stage++)
        for (kind = 0; kind < 2; kind++) {
            dpar_cuda_pool_desc d;
            memset(&d, 0, sizeof d);
            d.nccl = 1;
            d.comm.timeout_ms = 20000;
            gopt_case(&d, stage, kind, "NCCL pool");
        }
}

/* a batch over NCCL: an f32 sum, an i32 average (summed by NCCL, divided after the group) and an uneven
   reduce-scatter (a group inside the group) in one ncclGroupStart/End, right once dpar_batch_end returns */
static dpar_status nccl_batch_body(void *user, const dpar_cuda_worker *w)
{
    char *first = (char *)user + 600 * (size_t)w->rank;
    const size_t n = 1001;
    float *hf = (float *)malloc(n * 4), *df = NULL, *dr = NULL;
    int32_t *hi = (int32_t *)malloc(n * 4), *di = NULL;
    size_t i, off, len;
    int N = w->size, q;
    dpar_status st;
    cudaMalloc(&df, n * 4), cudaMalloc(&di, n * 4), cudaMalloc(&dr, n * 4);
    for (i = 0; i < n; i++) hf[i] = (float)(w->rank + 1) * (float)(i % 5), hi[i] = (int32_t)(w->rank * 7 + (int)i);
    /* on the worker's stream: a copy on the legacy stream would race the NCCL stream's work */
    cudaMemcpyAsync(df, hf, n * 4, cudaMemcpyHostToDevice, (cudaStream_t)w->stream);
    cudaMemcpyAsync(di, hi, n * 4, cudaMemcpyHostToDevice, (cudaStream_t)w->stream);
    cudaMemcpyAsync(dr, hf, n * 4, cudaMemcpyHostToDevice, (cudaStream_t)w->stream);
    cudaStreamSynchronize((cudaStream_t)w->stream);
    dpar_block_range(n, N, w->rank, &off, &len);
    st = dpar_batch_begin(w->comm);
    if (st == DPAR_OK) st = dpar_allreduce(w->comm, df, df, n, DPAR_F32, DPAR_SUM);
    if (st == DPAR_OK) st = dpar_allreduce(w->comm, di, di, n, DPAR_I32, DPAR_AVG);
    if (st == DPAR_OK) st = dpar_reduce_scatter(w->comm, dr, dr + off, n, DPAR_F32, DPAR_SUM);
    if (st == DPAR_OK) st = dpar_batch_end(w->comm);
    if (st != DPAR_OK) {
        snprintf(first, 600, "%s", dpar_last_error());
    } else {
        float *rf = (float *)malloc(n * 4), *rr = (float *)malloc(n * 4);
        int32_t *ri = (int32_t *)malloc(n * 4);
        cudaMemcpy(rf, df, n * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(ri, di, n * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(rr, dr, n * 4, cudaMemcpyDeviceToHost);
        for (i = 0; i < n; i++) {
            float sf = 0;
            int64_t si = 0;
            for (q = 0; q < N; q++) sf += (float)(q + 1) * (float)(i % 5), si += q * 7 + (int)i;
            if (rf[i] != sf || ri[i] != (int32_t)(si / N) || (i >= off && i < off + len && rr[i] != sf)) {
                snprintf(first, 600, "element %zu: %g %d %g, want %g %d %g", i, rf[i], ri[i], rr[i], sf, (int)(si / N),
                         sf);
                break;
            }
        }
        free(rf), free(ri), free(rr);
    }
    cudaFree(df), cudaFree(di), cudaFree(dr);
    free(hf), free(hi);
    return st;
}
static void test_nccl_batch(void)
{
    dpar_cuda_pool_desc d;
    dpar_cuda_pool *p = NULL;
    char *first = (char *)calloc(64, 600);
    int r;
    NEED_GPU();
    memset(&d, 0, sizeof d);
    d.nccl = 1;
    d.comm.timeout_ms = 20000;
    CHECK_MSG(dpar_cuda_pool_create(&d, &p) == DPAR_OK, "%s", dpar_last_error());
    if (p) {
        CHECK_MSG(dpar_cuda_pool_run(p, nccl_batch_body, first) == DPAR_OK, "%s", dpar_last_error());
        for (r = 0; r < dpar_cuda_pool_size(p); r++) CHECK_MSG(!first[600 * r], "worker %d: %s", r, first + 600 * r);
        CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
    }
    free(first);
}
#endif

static void test_nccl_without_a_device(void) /* argument checks and the build's answer, no device needed */
{
    dpar_comm *c = (dpar_comm *)1;
    dpar_cuda_nccl_desc d;
    memset(&d, 0, sizeof d);
    CHECK(dpar_cuda_comm_from_nccl(NULL, NULL, NULL, &c) == DPAR_EINVAL && c == NULL);
    CHECK(dpar_cuda_nccl_create(&d, &c) == DPAR_EINVAL && c == NULL);
#ifndef DPAR_NCCL
    CHECK(dpar_cuda_comm_from_nccl(&d, NULL, NULL, &c) == DPAR_EUNSUPPORTED && strstr(dpar_last_error(), "DPAR_NCCL"));
#endif
}

#ifdef DPAR_NCCL
static void test_nccl_pool_collectives(void)
{
    dpar_cuda_pool_desc d;
    dpar_cuda_pool *p = NULL;
    int ni, r;
    static const size_t ns[] = {5, ((size_t)3 << 20) + 7};
    NEED_GPU();
    for (ni = 0; ni < 2; ni++) {
        comm_job *j = (comm_job *)calloc(1, sizeof *j);
        memset(&d, 0, sizeof d);
        d.nccl = 1;
        d.comm.timeout_ms = 20000;
        CHECK_MSG(dpar_cuda_pool_create(&d, &p) == DPAR_OK, "%s", dpar_last_error());
        if (!p) return;
        j->n = ns[ni];
        j->no_p2p = 1;
        CHECK_MSG(dpar_cuda_pool_run(p, comm_body, j) == DPAR_OK, "%s", dpar_last_error());
        for (r = 0; r < dpar_cuda_pool_size(p); r++) CHECK_MSG(!j->first[r][0], "worker %d: %s", r, j->first[r]);
        CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
        free(j);
    }
    d.workers_per_device = 2;
    CHECK(dpar_cuda_pool_create(&d, &p) == DPAR_EUNSUPPORTED);
}

/* dpar_cuda_nccl_create over a host comm of thread ranks (one per device, as MPI processes would be) */
typedef struct {
    dpar_group *host;
    dpar_comm *comms[64];
    dpar_status st[64];
} nccl_make_job;
static dpar_status nccl_make_body(void *user, const dpar_cuda_worker *w)
{
    nccl_make_job *m = (nccl_make_job *)user;
    dpar_comm *host = NULL;
    dpar_cuda_nccl_desc d;
    if ((m->st[w->rank] = dpar_group_join(m->host, w->rank, &host)) != DPAR_OK) return m->st[w->rank];
    memset(&d, 0, sizeof d);
    d.host = host;
    d.device = w->device;
    d.stream = w->stream; /* the calls follow the worker's own work */
    d.comm.name = "made";
    m->st[w->rank] = dpar_cuda_nccl_create(&d, &m->comms[w->rank]);
    dpar_comm_destroy(host);
    return m->st[w->rank];
}
static dpar_status nccl_free_body(void *user, const dpar_cuda_worker *w)
{
    nccl_make_job *m = (nccl_make_job *)user;
    return dpar_comm_destroy(m->comms[w->rank]);
}
static void test_nccl_create_over_a_host_comm(void)
{
    dpar_cuda_pool_desc d;
    dpar_cuda_pool *p = NULL;
    dpar_comm_desc hd;
    nccl_make_job *m = (nccl_make_job *)calloc(1, sizeof *m);
    comm_job *j = (comm_job *)calloc(1, sizeof *j);
    int r;
    NEED_GPU();
    memset(&d, 0, sizeof d);
    CHECK(dpar_cuda_pool_create(&d, &p) == DPAR_OK);
    memset(&hd, 0, sizeof hd);
    hd.size = dpar_cuda_pool_size(p);
    CHECK(dpar_group_create(&hd, &m->host) == DPAR_OK);
    CHECK_MSG(dpar_cuda_pool_run(p, nccl_make_body, m) == DPAR_OK, "%s", dpar_last_error());
    j->n = 100003;
    j->no_p2p = 1;
    j->comms = m->comms;
    CHECK_MSG(dpar_cuda_pool_run(p, comm_body, j) == DPAR_OK, "%s", dpar_last_error());
    for (r = 0; r < dpar_cuda_pool_size(p); r++) CHECK_MSG(!j->first[r][0], "worker %d: %s", r, j->first[r]);
    CHECK(dpar_cuda_pool_run(p, nccl_free_body, m) == DPAR_OK);
    dpar_group_destroy(m->host);
    CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
    free(m), free(j);
}

/* a failing worker reaches the others' NCCL comms at once (the pool's NCCL comms share its failure), not at their
   deadline (20 s here): one worker per GPU, so it needs two GPUs or more */
static void test_nccl_failure_reaches_every_worker(void)
{
    dpar_cuda_pool_desc d;
    dpar_cuda_pool *p = NULL;
    comm_job *j;
    int r, n;
    NEED_GPU();
    if (gpus < 2) SKIP("needs two GPUs or more (NCCL takes one worker per GPU)");
    j = (comm_job *)calloc(1, sizeof *j);
    memset(&d, 0, sizeof d);
    d.nccl = 1;
    d.comm.timeout_ms = 20000;
    CHECK_MSG(dpar_cuda_pool_create(&d, &p) == DPAR_OK, "%s", dpar_last_error());
    if (!p) {
        free(j);
        return;
    }
    n = dpar_cuda_pool_size(p);
    j->fail_rank = 1;
    CHECK(dpar_cuda_pool_run(p, fail_body, j) == DPAR_EUSER);
    for (r = 0; r < n && r < 64; r++) {
        if (r == 1) continue;
        CHECK_MSG(j->st[r] == DPAR_EUSER && j->seconds[r] < 5.0 && strstr(j->first[r], "ran out of patience") &&
                      strstr(j->first[r], "worker 1"),
                  "worker %d: %s after %.2f s: %s", r, dpar_status_string(j->st[r]), j->seconds[r], j->first[r]);
    }
    j->fail_rank = -1; /* the failure stays: the next run's calls return it at once */
    CHECK(dpar_cuda_pool_run(p, fail_body, j) == DPAR_EUSER && strstr(dpar_last_error(), "ran out of patience"));
    CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
    free(j);
}

/* the NCCL wait notices the end of its call within tens of microseconds: a kernel of 2 ms ahead of a 1-float
   allreduce on the comm's stream (1 rank, no checker), and the call's time past 2 ms is the wait's overshoot plus a
   launch; the back-off it replaced (sleeps doubling to 1.3 ms) was 0.4-1.2 ms late. The bound is loose (a VM's
   timers); the figure is printed */
static __global__ void busy_kernel(unsigned long long ns)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    while (t - t0 < ns);
}
static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}
static void test_nccl_wait_notices_completion(void)
{
    ncclComm_t nc = NULL;
    cudaStream_t s = NULL;
    dpar_comm *c = NULL;
    dpar_comm_desc cd;
    float *x = NULL;
    uint64_t over[9];
    int dev = 0, i;
    NEED_GPU();
    memset(&cd, 0, sizeof cd);
    cd.no_check = 1; /* the checker's exchange would wait once more */
    CHECK(cudaSetDevice(0) == cudaSuccess && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    CHECK(cudaMalloc((void **)&x, sizeof *x) == cudaSuccess && cudaMemset(x, 0, sizeof *x) == cudaSuccess);
    CHECK(ncclCommInitAll(&nc, 1, &dev) == ncclSuccess);
    CHECK_MSG(dpar_cuda_comm_from_nccl(nc, s, &cd, &c) == DPAR_OK, "%s", dpar_last_error());
    if (!c) return;
    CHECK(dpar_allreduce(c, x, x, 1, DPAR_F32, DPAR_SUM) == DPAR_OK); /* warm-up */
    for (i = 0; i < 9; i++) {
        uint64_t t0 = dpar_time_ns(), t;
        busy_kernel<<<1, 1, 0, s>>>(2000000ull);
        CHECK_MSG(dpar_allreduce(c, x, x, 1, DPAR_F32, DPAR_SUM) == DPAR_OK, "%s", dpar_last_error());
        t = dpar_time_ns() - t0;
        over[i] = t > 2000000u ? t - 2000000u : 0;
    }
    qsort(over, 9, sizeof over[0], cmp_u64);
    printf("    NCCL wait: %.1f us past a 2 ms kernel (median of 9; min %.1f, max %.1f)\n", over[4] / 1e3,
           over[0] / 1e3, over[8] / 1e3);
    CHECK_MSG(over[4] < 200000u, "the wait noticed the end %.1f us late (median)", over[4] / 1e3);
    dpar_comm_destroy(c);
    ncclCommDestroy(nc);
    cudaStreamDestroy(s);
    cudaFree(x);
}
#endif

static void test_tasks_without_a_pool(void) /* runs without a device */
{
    dpar_cuda_task_desc d;
    dpar_cuda_task t = 7;
    memset(&d, 0, sizeof d);
    d.fn = fill_task;
    CHECK(dpar_cuda_task_submit(NULL, &d, &t) == DPAR_EINVAL && t == 0);
    CHECK(dpar_cuda_task_wait(NULL, 1) == DPAR_EINVAL);
    CHECK(dpar_cuda_task_wait_all(NULL) == DPAR_EINVAL);
}

static void test_tasks_across_workers(void)
{
    dpar_cuda_pool_desc pd;
    dpar_cuda_pool *p = NULL;
    dpar_cuda_task_desc d;
    dpar_cuda_task a = 0, b = 0, c = 0, e = 0;
    chain_job j;
    float *host;
    size_t i, bad = 0;
    int dev0 = 0;
    NEED_GPU();
    memset(&pd, 0, sizeof pd);
    pd.devices = &dev0, pd.num_devices = 1, pd.workers_per_device = 2;
    CHECK(dpar_cuda_pool_create(&pd, &p) == DPAR_OK && p);
    if (!p) return;
    j.n = (size_t)1 << 24; /* long enough that worker 1 would read buf0 early without the event */
    cudaMalloc((void **)&j.buf[0], j.n * 4);
    cudaMalloc((void **)&j.buf[1], j.n * 4);
    cudaMemset(j.buf[0], 0, j.n * 4);
    cudaMemset(j.buf[1], 0, j.n * 4);
    cudaDeviceSynchronize();
    memset(&d, 0, sizeof d);
    d.fn = fill_task, d.user = &j, d.worker = 0;
    CHECK(dpar_cuda_task_submit(p, &d, &a) == DPAR_OK && a != 0);
    d.fn = axpy_task, d.worker = 1, d.deps = &a, d.num_deps = 1;
    CHECK(dpar_cuda_task_submit(p, &d, &b) == DPAR_OK);
    d.fn = failing_task, d.worker = 0, d.deps = NULL, d.num_deps = 0;
    CHECK(dpar_cuda_task_submit(p, &d, &c) == DPAR_OK);
    d.fn = fill_task, d.worker = 1, d.deps = &c, d.num_deps = 1; /* cancelled: its dependency fails */
    CHECK(dpar_cuda_task_submit(p, &d, &e) == DPAR_OK);
    CHECK(dpar_cuda_task_wait(p, b) == DPAR_OK);
    CHECK(dpar_cuda_task_wait(p, c) == DPAR_EUSER && strstr(dpar_last_error(), "says no"));
    CHECK(dpar_cuda_task_wait(p, e) == DPAR_EUSER); /* cancelled: the failed dependency's status */
    CHECK(dpar_cuda_task_wait_all(p) == DPAR_EUSER);
    CHECK(dpar_cuda_task_wait(p, b) == DPAR_EINVAL); /* the epoch is over */
    host = (float *)malloc(j.n * 4);
    cudaMemcpy(host, j.buf[1], j.n * 4, cudaMemcpyDeviceToHost);
    for (i = 0; i < j.n; i++) bad += host[i] != 6.0f; /* 0 + 3 x 2, every element: b waited for a */
    CHECK_MSG(bad == 0, "%zu of %zu elements are not 6", bad, j.n);
    free(host);
    cudaFree(j.buf[0]), cudaFree(j.buf[1]);
    CHECK(dpar_cuda_pool_destroy(p) == DPAR_OK);
}

int main(int argc, char **argv)
{
    cudaError_t e;
    DT_MAIN_BEGIN(argc, argv);
    e = cudaGetDeviceCount(&gpus);
    if (e != cudaSuccess) {
        gpus = 0;
        snprintf(no_gpu, sizeof no_gpu, "no usable CUDA device (%s: %s)", cudaGetErrorName(e), cudaGetErrorString(e));
        (void)cudaGetLastError();
    } else if (gpus == 0) {
        snprintf(no_gpu, sizeof no_gpu, "no usable CUDA device (cudaGetDeviceCount found none)");
    }
    RUN(test_device_query);
    RUN(test_launch_error_names_cuda_error);
    RUN(test_launch_reports_its_own_status);
    RUN(test_axpy_matches_reference);
    RUN(test_elementwise_kernels);
    RUN(test_reduce_and_divide);
    RUN(test_integer_average_any_group_size);
    RUN(test_casts);
    RUN(test_optimizers);
    RUN(test_softmax_xent);
    RUN(test_sgemm);
    RUN(test_pool_refuses_bad_descs);
    RUN(test_pool_runs_every_worker);
    RUN(test_tasks_without_a_pool);
    RUN(test_tasks_across_workers);
    RUN(test_pool_comm_collectives);
    RUN(test_pool_comm_failure_reaches_every_worker);
    RUN(test_pool_comm_stream_ordered);
    RUN(test_pool_comm_stream_ordered_does_not_wait);
    RUN(test_pool_comm_sync_deadline_from_the_environment);
    RUN(test_pool_zero_and_fsdp_bitwise_host);
    RUN(test_nccl_without_a_device);
#ifdef DPAR_NCCL
    RUN(test_nccl_pool_collectives);
    RUN(test_nccl_create_over_a_host_comm);
    RUN(test_nccl_failure_reaches_every_worker);
    RUN(test_nccl_wait_notices_completion);
    RUN(test_nccl_zero_and_fsdp_bitwise_host);
    RUN(test_nccl_batch);
#endif
    return dt_summary();
}
