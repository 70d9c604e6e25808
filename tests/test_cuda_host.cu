// test_cuda_host.cu - dpar_cuda.h's kernels verified on the host, without a GPU: each kernel's grid-stride loop
// (dpar_cuda__stride, the very code its __global__ wrapper runs) is driven for every thread of simulated grids
// (1 block of 1 thread, 1 block of 256, the launcher's own grid with its ragged last block, more threads than
// elements, an odd shape) over n = 0, 1, 3, 4, 5, 1000, 1023, 65537, on aligned buffers (the vector path) and
// buffers one element off (the scalar path), and compared bit for bit with the naive references and with dpar.h's
// own CPU code (dpar__reduce, dpar__divide, the bf16/f16 conversions, dpar_zero_step). No device call is made.
// Build and run: nvcc -std=c++14 -O2 -arch=sm_90 -I. -Itests tests/test_cuda_host.cu -o build/test_cuda_host -lcublas
//                && ./build/test_cuda_host
#define DPAR_IMPLEMENTATION
#define DPAR_CUDA_IMPLEMENTATION
#include "dpar_cuda.h"
#include "dpar_test.h"

static const size_t sizes[] = {0, 1, 3, 4, 5, 1000, 1023, 65537};
#define NSIZES (sizeof sizes / sizeof sizes[0])
#define GUARD 8 /* elements before and after each buffer, checked untouched */

typedef struct grid {
    unsigned blocks, threads;
} grid;

/* the grids a kernel object is run on: fixed shapes, the launcher's own, and more threads than work */
static int grids_for(size_t work, unsigned launcher_blocks, grid *g)
{
    int k = 0;
    g[k].blocks = 1, g[k++].threads = 1;
    g[k].blocks = 1, g[k++].threads = 256;
    g[k].blocks = launcher_blocks ? launcher_blocks : 1, g[k++].threads = DPAR_CUDA__THREADS;
    g[k].blocks = (unsigned)(work / 64 + 3), g[k++].threads = 64; /* gridDim * blockDim > work */
    g[k].blocks = 7, g[k++].threads = 33;
    return k;
}

/* a kernel object's vector lanes */
template <class K> static size_t lanes(const K &) { return (size_t)K::W; }

/* the split of n elements whose buffers all lie `off` elements past a 16-byte boundary: the elements up to the
   next vector boundary one by one (head), then vectors, then the tail */
template <class K> static int split_ok(const K &k, size_t n, size_t off)
{
    size_t head = (lanes(k) - off % lanes(k)) % lanes(k);
    if (head > n) head = n;
    return k.head == head && k.nvec == (n - head) / lanes(k);
}

/* every thread of the grid, in turn, runs the wrapper's loop */
template <class K> static void emulate(const K &k, grid g)
{
    size_t total = (size_t)g.blocks * g.threads, t;
    for (t = 0; t < total; t++) dpar_cuda__stride(k, t, total);
}

static float frand(void) { return (float)((double)(dt_rand() % 2000001) / 1000000.0 - 1.0) * 4.0f; }
static float special(int i) /* values the arithmetic must carry through */
{
    static const uint32_t bits[] = {0x7fc00000u, 0xffc00001u, 0x7f800000u, 0xff800000u, 0x80000000u, 0x00000001u,
                                    0x807fffffu, 0x7f7fffffu, 0x3f808000u, 0x3f818000u, 0x477ff000u, 0x33000001u};
    float f;
    memcpy(&f, &bits[i % (int)(sizeof bits / sizeof bits[0])], sizeof f);
    return f;
}
static void fill_random(float *x, size_t n, int specials)
{
    size_t i;
    for (i = 0; i < n; i++) x[i] = specials && dt_rand() % 16 == 0 ? special((int)(dt_rand() % 64)) : frand();
}

/* element kinds: how outputs are compared */
enum { F32 = 4, BF16 = 2, F16 = 3, F64 = 8, I32 = 40, I64 = 80, U8 = 1 }; /* F32, F64, U8: their size */
static size_t kind_size(int kind)
{
    return kind == F32 || kind == I32 ? 4 : kind == F64 || kind == I64 ? 8 : kind == U8 ? 1 : 2;
}
static int kind_of(dpar_dtype t) { return t == DPAR_F32 ? F32 : t == DPAR_BF16 ? BF16 : F16; }
static int is_nan(const void *p, int kind)
{
    float f;
    double d;
    uint16_t h;
    if (kind == I32 || kind == I64 || kind == U8) return 0;
    if (kind == F64) return memcpy(&d, p, 8), d != d;
    if (kind == F32) return memcpy(&f, p, 4), f != f;
    memcpy(&h, p, 2);
    return kind == BF16 ? (h & 0x7fffu) > 0x7f80u : (h & 0x7fffu) > 0x7c00u;
}
/* a buffer with GUARD canary elements on each side, `off` elements past a 16-byte boundary */
typedef struct buf {
    unsigned char *base;
    size_t bytes, es, n, off;
    int kind;
    void *p;
} buf;
static buf buf_make(size_t n, int kind, size_t off)
{
    buf b;
    size_t es = kind_size(kind);
    b.es = es, b.n = n, b.off = off, b.kind = kind;
    size_t pad = (GUARD * es + 15) / 16 * 16; /* the guard, then a 16-byte boundary (malloc's are 16-aligned) */
    b.bytes = pad + (n + GUARD + off) * es;
    b.base = (unsigned char *)malloc(b.bytes + 16);
    memset(b.base, 0xA5, b.bytes + 16);
    b.p = b.base + pad + off * es;
    return b;
}
static int buf_guard_ok(const buf *b)
{
    const unsigned char *p = (const unsigned char *)b->p;
    size_t i;
    for (i = 1; i <= GUARD * b->es; i++)
        if (p[-(ptrdiff_t)i] != 0xA5) return 0;
    for (i = 0; i < GUARD * b->es; i++)
        if (p[b->n * b->es + i] != 0xA5) return 0;
    return 1;
}
static void buf_free(buf *b) { free(b->base); }

/* the first element where two buffers differ, or -1: bitwise, except that any NaN equals any NaN (a payload
   depends on operand order, which the compiler may swap, and the GPU makes every NaN it computes canonical) */
static long first_diff(const void *a, const void *b, size_t n, int kind)
{
    size_t i, es = kind_size(kind);
    for (i = 0; i < n; i++) {
        const char *x = (const char *)a + i * es, *y = (const char *)b + i * es;
        if (memcmp(x, y, es) && !(is_nan(x, kind) && is_nan(y, kind))) return (long)i;
    }
    return -1;
}

/* run one kernel object on every grid: `setup` restores the inputs before each run, `expect` is the reference
   output (bytes at out), compared bitwise; outputs' guards must stay intact */
#define RUN_GRIDS(K, SETUP, OUTS, NOUT, EXPECT, WHAT)                                                                  \
    do {                                                                                                               \
        grid g_[8];                                                                                                    \
        int ng_ = grids_for((K).nvec + ((K).n - lanes(K) * (K).nvec), dpar_cuda__blocks(K), g_), gi_, o_;              \
        for (gi_ = 0; gi_ < ng_; gi_++) {                                                                              \
            SETUP;                                                                                                     \
            emulate((K), g_[gi_]);                                                                                     \
            for (o_ = 0; o_ < (NOUT); o_++) {                                                                          \
                long d_ = first_diff((OUTS)[o_]->p, (EXPECT)[o_], (OUTS)[o_]->n, (OUTS)[o_]->kind);                    \
                CHECK_MSG(d_ < 0 && buf_guard_ok((OUTS)[o_]),                                                          \
                          "%s: n=%zu off=%zu grid %ux%u nvec=%zu: output %d differs at %ld or its guard is hit", WHAT, \
                          (OUTS)[o_]->n, (OUTS)[o_]->off, g_[gi_].blocks, g_[gi_].threads, (K).nvec, o_, d_);          \
            }                                                                                                          \
        }                                                                                                              \
    } while (0)

/* ---- the conversions: every 16-bit pattern, and float inputs around every rounding boundary ---- */
static void test_bf16_f16_every_pattern(void)
{
    uint32_t h, bad = 0, lo;
    static const uint32_t lows[] = {0, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
    for (h = 0; h < 65536; h++) {
        float a = dpar_cuda__bf16_to_f32((uint16_t)h), b = dpar_bf16_to_f32((uint16_t)h);
        bad += memcmp(&a, &b, 4) != 0;
        a = dpar_cuda__f16_to_f32((uint16_t)h), b = dpar_f16_to_f32((uint16_t)h);
        bad += memcmp(&a, &b, 4) != 0;
        /* narrowing: the widened pattern itself, and the float bits around its rounding boundaries */
        bad += dpar_cuda__f32_to_bf16(dpar_bf16_to_f32((uint16_t)h)) != dpar_f32_to_bf16(dpar_bf16_to_f32((uint16_t)h));
        bad += dpar_cuda__f32_to_f16(dpar_f16_to_f32((uint16_t)h)) != dpar_f32_to_f16(dpar_f16_to_f32((uint16_t)h));
        for (lo = 0; lo < sizeof lows / sizeof lows[0]; lo++) {
            float f = dpar_cuda__float((h << 16) | lows[lo]);
            bad += dpar_cuda__f32_to_bf16(f) != dpar_f32_to_bf16(f);
            bad += dpar_cuda__f32_to_f16(f) != dpar_f32_to_f16(f);
        }
        if ((h & 0x7fffu) < 0x7c00u) { /* f16: the midpoint to the next pattern, and its neighbours */
            float x = dpar_f16_to_f32((uint16_t)h), y = dpar_f16_to_f32((uint16_t)(h + 1)), mid = (x + y) / 2;
            uint32_t m = dpar_cuda__bits(mid);
            int k;
            for (k = -2; k <= 2; k++) {
                float f = dpar_cuda__float(m + (uint32_t)k);
                bad += dpar_cuda__f32_to_f16(f) != dpar_f32_to_f16(f);
            }
        }
    }
    for (h = 0; h < 1u << 21; h++) { /* random float bits */
        float f = dpar_cuda__float((uint32_t)dt_rand());
        bad += dpar_cuda__f32_to_bf16(f) != dpar_f32_to_bf16(f);
        bad += dpar_cuda__f32_to_f16(f) != dpar_f32_to_f16(f);
    }
    CHECK_MSG(bad == 0, "%u conversions differ from dpar.h's", bad);
    /* rounding to nearest even, spot checks independent of both implementations */
    CHECK(dpar_cuda__f32_to_bf16(dpar_cuda__float(0x3f808000u)) == 0x3f80); /* tie, even below */
    CHECK(dpar_cuda__f32_to_bf16(dpar_cuda__float(0x3f818000u)) == 0x3f82); /* tie, even above */
    CHECK(dpar_cuda__f32_to_bf16(dpar_cuda__float(0x3f808001u)) == 0x3f81);
    CHECK(dpar_cuda__f32_to_f16(65520.0f) == 0x7c00 && dpar_cuda__f32_to_f16(65519.0f) == 0x7bff);
    CHECK(dpar_cuda__f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00 && dpar_cuda__f32_to_f16(1.0f + 3.0f / 2048) == 0x3c02);
    CHECK((dpar_cuda__f32_to_bf16(dpar_cuda__float(0x7f800001u)) & 0x7fc0) == 0x7fc0); /* sNaN -> quiet */
}

/* the cast kernel over every 16-bit pattern, and over floats, for every pair of f32 / bf16 / f16 */
static void test_cast_kernel(void)
{
    static const dpar_dtype ts[] = {DPAR_F32, DPAR_BF16, DPAR_F16};
    size_t n = 65536 + 5, i, off;
    int a, b;
    for (a = 0; a < 3; a++)
        for (b = 0; b < 3; b++)
            for (off = 0; off < 2; off++) {
                dpar_dtype ti = ts[a], to = ts[b];
                size_t ei = dpar_dtype_size(ti), eo = dpar_dtype_size(to);
                buf in = buf_make(n, kind_of(ti), off), out = buf_make(n, kind_of(to), off), *outs[1] = {&out};
                void *expect = malloc(n * eo);
                const void *exps[1] = {expect};
                char what[64];
                for (i = 0; i < n; i++) {
                    if (ti == DPAR_F32)
                        ((float *)in.p)[i] =
                            i < 65536 ? dpar_cuda__float((uint32_t)i << 16 | (uint32_t)(dt_rand() & 0xffff)) : frand();
                    else ((uint16_t *)in.p)[i] = (uint16_t)i;
                }
                dpar_cuda_cast_ref(expect, to, in.p, ti, n);
                snprintf(what, sizeof what, "cast %s -> %s", dpar_dtype_name(ti), dpar_dtype_name(to));
#define CAST_CASE(DO, DI)                                                                                   \
    if (to == (DO##_t) && ti == (DI##_t)) {                                                                 \
        dpar_cuda__cast_f<dpar_cuda__##DO, dpar_cuda__##DI> f;                                              \
        auto k = dpar_cuda__make_map1((dpar_cuda__##DO::T *)out.p, (const dpar_cuda__##DI::T *)in.p, n, f); \
        CHECK(split_ok(k, n, off));                                                                         \
        RUN_GRIDS(k, memset(out.p, 0xEE, n *eo), outs, 1, exps, what);                                      \
    }
                {
                    const dpar_dtype f32_t = DPAR_F32, bf16_t = DPAR_BF16, f16_t = DPAR_F16;
                    CAST_CASE(f32, f32)
                    CAST_CASE(f32, bf16)
                    CAST_CASE(f32, f16)
                    CAST_CASE(bf16, f32)
                    CAST_CASE(bf16, bf16)
                    CAST_CASE(bf16, f16)
                    CAST_CASE(f16, f32)
                    CAST_CASE(f16, bf16)
                    CAST_CASE(f16, f16)
                }
#undef CAST_CASE
                free(expect);
                buf_free(&in);
                buf_free(&out);
            }
}

/* ---- reduce and divide: element function, reference and dpar.h's CPU loops, bit for bit ---- */
template <class D> static void reduce_case(dpar_dtype t, int op, int div, size_t n, size_t off, int in_place)
{
    typedef typename D::T T;
    size_t es = sizeof(T), i;
    buf a = buf_make(n, kind_of(t), off), b = buf_make(n, kind_of(t), off), out = buf_make(n, kind_of(t), off);
    buf *outs[1] = {in_place ? &a : &out};
    T *a0 = (T *)calloc(n + 1, es), *expect = (T *)malloc(n * es + 1), *cpu = (T *)malloc(n * es + 1);
    const void *exps[1] = {expect};
    char what[96];
    dpar_cuda__reduce_f<D> f;
    for (i = 0; i < n; i++) {
        float x = dt_rand() % 16 == 0 ? special((int)(dt_rand() % 64)) : frand();
        float y = dt_rand() % 16 == 0 ? special((int)(dt_rand() % 64)) : frand();
        if (t == DPAR_F32) ((float *)a0)[i] = x, ((float *)b.p)[i] = y;
        else
            a0[i] = (T)(dt_rand() & 0xffff),
            ((T *)b.p)[i] = (T)(t == DPAR_BF16 ? dpar_f32_to_bf16(y) : dpar_f32_to_f16(y));
    }
    dpar_cuda_reduce_ref(expect, a0, b.p, n, t, (dpar_op)op, div);
    dpar__reduce(cpu, a0, b.p, n, t, (dpar_op)op, div);
    CHECK_MSG(first_diff(expect, cpu, n, kind_of(t)) < 0, "reference and dpar__reduce differ: %s %s div %d n=%zu",
              dpar_dtype_name(t), dpar_op_name((dpar_op)op), div, n);
    f.op = op, f.div = div;
    snprintf(what, sizeof what, "reduce %s %s div %d%s", dpar_dtype_name(t), dpar_op_name((dpar_op)op), div,
             in_place ? " in place" : "");
    {
        auto k = dpar_cuda__make_map2((T *)outs[0]->p, (const T *)a.p, (const T *)b.p, n, f);
        CHECK(split_ok(k, n, off));
        RUN_GRIDS(k, memcpy(a.p, a0, n * es), outs, 1, exps, what);
    }
    free(a0), free(expect), free(cpu);
    buf_free(&a), buf_free(&b), buf_free(&out);
}

static void test_reduce_kernel(void)
{
    static const int divs[] = {0, 1, 2, 3, 8};
    size_t s, off;
    int op, d;
    for (s = 0; s < NSIZES; s++)
        for (off = 0; off < 4; off++) /* off 1-3: the head's length differs, and bf16's 8 lanes leave 5-7 */
            for (op = 0; op < DPAR_OP_COUNT; op++)
                for (d = 0; d < 5; d++) {
                    if (op != DPAR_AVG && d > 1) continue;           /* div only matters to AVG */
                    if (sizes[s] > 1023 && (d % 2 || off)) continue; /* the big size: fewer combinations */
                    reduce_case<dpar_cuda__f32>(DPAR_F32, op, divs[d], sizes[s], off, d == 0);
                    reduce_case<dpar_cuda__bf16>(DPAR_BF16, op, divs[d], sizes[s], off, d == 0);
                    reduce_case<dpar_cuda__f16>(DPAR_F16, op, divs[d], sizes[s], off, d == 0);
                }
}

template <class D> static void divide_case(dpar_dtype t, int div, size_t n, size_t off)
{
    typedef typename D::T T;
    size_t es = sizeof(T), i;
    buf in = buf_make(n, kind_of(t), off), out = buf_make(n, kind_of(t), off), *outs[1] = {&out};
    T *expect = (T *)malloc(n * es + 1), *cpu = (T *)malloc(n * es + 1);
    const void *exps[1] = {expect};
    dpar_cuda__divide_f<D> f;
    for (i = 0; i < n; i++) {
        if (t == DPAR_F32) ((float *)in.p)[i] = dt_rand() % 16 == 0 ? special((int)(dt_rand() % 64)) : frand();
        else ((T *)in.p)[i] = (T)(dt_rand() & 0xffff);
    }
    dpar_cuda_divide_ref(expect, in.p, n, t, div);
    dpar__divide(cpu, in.p, n, t, div);
    CHECK_MSG(first_diff(expect, cpu, n, kind_of(t)) < 0, "reference and dpar__divide differ: %s div %d",
              dpar_dtype_name(t), div);
    f.div = div;
    {
        auto k = dpar_cuda__make_map1((T *)out.p, (const T *)in.p, n, f);
        CHECK(split_ok(k, n, off));
        RUN_GRIDS(k, memset(out.p, 0xEE, n * es), outs, 1, exps, "divide");
    }
    free(expect), free(cpu);
    buf_free(&in), buf_free(&out);
}

/* the other dtypes (f64, i32, i64, u8): their own arithmetic, integers wrapping; reference and dpar.h's loops
   bit for bit, the simulated grids too */
static uint64_t rand64(void) { return ((uint64_t)dt_rand() << 32) ^ (uint64_t)dt_rand(); }
template <class F, class T> static void native_case(dpar_dtype t, int kind, int op, int div, size_t n, size_t off)
{
    size_t i;
    buf a = buf_make(n, kind, off), b = buf_make(n, kind, off), out = buf_make(n, kind, off), *outs[1] = {&out};
    T *expect = (T *)malloc(n * sizeof(T) + 1), *cpu = (T *)malloc(n * sizeof(T) + 1);
    const void *exps[1] = {expect};
    char what[96];
    for (i = 0; i < n; i++) {
        T x, y;
        if (t == DPAR_F64) {
            double u = (double)frand() * 1e3 + (double)dt_rand() / 3.0, v = (double)frand() / 7.0;
            if (dt_rand() % 16 == 0) u = (double)special((int)(dt_rand() % 64)); /* inf, NaN, -0 ... as doubles */
            memcpy(&x, &u, sizeof x), memcpy(&y, &v, sizeof y);
        } else {
            uint64_t r = rand64(), q = rand64();
            if (dt_rand() % 4 == 0) r |= (uint64_t)1 << (8 * sizeof(T) - 1); /* negative, or above 127: wraps */
            memcpy(&x, &r, sizeof x), memcpy(&y, &q, sizeof y);
        }
        ((T *)a.p)[i] = x, ((T *)b.p)[i] = y;
    }
    if (div >= 0) {
        dpar_cuda_reduce_ref(expect, a.p, b.p, n, t, (dpar_op)op, div);
        dpar__reduce(cpu, a.p, b.p, n, t, (dpar_op)op, div);
    } else {
        dpar_cuda_divide_ref(expect, a.p, n, t, -div);
        dpar__divide(cpu, a.p, n, t, -div);
    }
    snprintf(what, sizeof what, "%s %s %s div %d", div >= 0 ? "reduce" : "divide", dpar_dtype_name(t),
             dpar_op_name((dpar_op)op), div);
    CHECK_MSG(first_diff(expect, cpu, n, kind) < 0, "reference and dpar.h differ: %s n=%zu", what, n);
    free(cpu);
    if (div >= 0) {
        F g; /* the launcher's functor */
        g.op = op, g.div = div;
        auto k = dpar_cuda__make_map2((T *)out.p, (const T *)a.p, (const T *)b.p, n, g);
        CHECK(split_ok(k, n, off));
        RUN_GRIDS(k, memset(out.p, 0xEE, n * sizeof(T)), outs, 1, exps, what);
    } else {
        dpar_cuda__divide_native_f<T> g;
        g.div = -div;
        auto k = dpar_cuda__make_map1((T *)out.p, (const T *)a.p, n, g);
        CHECK(split_ok(k, n, off));
        RUN_GRIDS(k, memset(out.p, 0xEE, n * sizeof(T)), outs, 1, exps, what);
    }
    free(expect);
    buf_free(&a), buf_free(&b), buf_free(&out);
}

/* buffers at different distances from a vector boundary: no vectors (each would straddle a boundary in some
   buffer), every element one by one, the results the reference's; a shared distance: a head, then vectors */
static void test_unshared_offsets_run_scalar(void)
{
    static const size_t ns[] = {1, 5, 1000, 1023};
    size_t s, oa, ob;
    for (s = 0; s < 4; s++)
        for (oa = 0; oa < 4; oa++)
            for (ob = 0; ob < 4; ob++) {
                size_t n = ns[s];
                buf a = buf_make(n, F32, oa), b = buf_make(n, F32, ob), out = buf_make(n, F32, oa), *outs[1] = {&out};
                float *expect = (float *)malloc(n * 4);
                const void *exps[1] = {expect};
                dpar_cuda__reduce_f<dpar_cuda__f32> f;
                fill_random((float *)a.p, n, 1);
                fill_random((float *)b.p, n, 1);
                dpar_cuda_reduce_ref(expect, a.p, b.p, n, DPAR_F32, DPAR_SUM, 0);
                f.op = DPAR_SUM, f.div = 0;
                {
                    auto k = dpar_cuda__make_map2((float *)out.p, (const float *)a.p, (const float *)b.p, n, f);
                    if (oa == ob) CHECK(split_ok(k, n, oa));
                    else CHECK(k.head == 0 && k.nvec == 0);
                    RUN_GRIDS(k, memset(out.p, 0xEE, n * 4), outs, 1, exps, "reduce f32, unshared offsets");
                }
                free(expect);
                buf_free(&a), buf_free(&b), buf_free(&out);
            }
    { /* a pointer not aligned to its element: scalars */
        float *raw = (float *)malloc(64);
        size_t lead = dpar_cuda__lead((char *)raw + 2, 4, 4);
        CHECK(lead == (size_t)-1);
        free(raw);
    }
}

static void test_reduce_and_divide_other_dtypes(void)
{
    static const int divs[] = {0, 1, 2, 3, 8};
    size_t s, off;
    int op, d;
    for (s = 0; s < NSIZES; s++)
        for (off = 0; off < 4; off++) /* off 1-3: the head's length differs, and bf16's 8 lanes leave 5-7 */
            for (op = 0; op < DPAR_OP_COUNT; op++)
                for (d = 0; d < 5; d++) {
                    if (op != DPAR_AVG && d > 1) continue;
                    if (sizes[s] > 1023 && (d % 2 || off)) continue;
                    native_case<dpar_cuda__reduce_f64_f, double>(DPAR_F64, F64, op, divs[d], sizes[s], off);
                    native_case<dpar_cuda__reduce_int_f<int32_t, uint32_t>, int32_t>(DPAR_I32, I32, op, divs[d],
                                                                                     sizes[s], off);
                    native_case<dpar_cuda__reduce_int_f<int64_t, uint64_t>, int64_t>(DPAR_I64, I64, op, divs[d],
                                                                                     sizes[s], off);
                    native_case<dpar_cuda__reduce_int_f<uint8_t, uint32_t>, uint8_t>(DPAR_U8, U8, op, divs[d], sizes[s],
                                                                                     off);
                    if (op == DPAR_SUM && d > 0) { /* divide: every div once */
                        native_case<dpar_cuda__reduce_f64_f, double>(DPAR_F64, F64, op, -divs[d], sizes[s], off);
                        native_case<dpar_cuda__reduce_int_f<int32_t, uint32_t>, int32_t>(DPAR_I32, I32, op, -divs[d],
                                                                                         sizes[s], off);
                        native_case<dpar_cuda__reduce_int_f<int64_t, uint64_t>, int64_t>(DPAR_I64, I64, op, -divs[d],
                                                                                         sizes[s], off);
                        native_case<dpar_cuda__reduce_int_f<uint8_t, uint32_t>, uint8_t>(DPAR_U8, U8, op, -divs[d],
                                                                                         sizes[s], off);
                    }
                }
}

/* the integer average for any group size, against a closed formula in wide arithmetic: u8 over every pair (a, b)
   is ((a + b) mod 256) / div, so 0 for every pair once div >= 256; i32 and i64 wrap their sum the same way. The
   divisor was once (T)div: (uint8_t)256 is 0 (a division by zero: SIGFPE here, garbage on a GPU), (uint8_t)300 is 44.
   The reference and the element function over the simulated grids; not dpar.h's dpar__reduce, which still divides
   by (T)div. */
template <class T, class U> static void int_average_case(dpar_dtype t, int kind, size_t n, int div)
{
    size_t i;
    buf a = buf_make(n, kind, 0), b = buf_make(n, kind, 0), out = buf_make(n, kind, 0), *outs[1] = {&out};
    T *expect = (T *)malloc(n * sizeof(T) + 1), *ref = (T *)malloc(n * sizeof(T) + 1);
    const void *exps[1] = {expect};
    dpar_cuda__reduce_int_f<T, U> f;
    char what[96];
    for (i = 0; i < n; i++) {
        T x, y;
        if (t == DPAR_U8) { /* every pair of bytes */
            x = (T)(i >> 8), y = (T)i;
            expect[i] = (T)(((unsigned)x + (unsigned)y) % 256u / (unsigned)div);
        } else {
            uint64_t r = rand64(), q = rand64();
            memcpy(&x, &r, sizeof x), memcpy(&y, &q, sizeof y);
            expect[i] = (T)((long long)(T)((U)x + (U)y) / (long long)div); /* C's division truncates toward 0 */
        }
        ((T *)a.p)[i] = x, ((T *)b.p)[i] = y;
    }
    snprintf(what, sizeof what, "avg %s div %d", dpar_dtype_name(t), div);
    dpar_cuda_reduce_ref(ref, a.p, b.p, n, t, DPAR_AVG, div);
    CHECK_MSG(first_diff(ref, expect, n, kind) < 0, "%s: the reference is not ((a + b) wrapped) / div", what);
    if (t == DPAR_U8 && div >= 256) { /* 256 ranks or more: every u8 average is 0 */
        size_t nonzero = 0;
        for (i = 0; i < n; i++) nonzero += expect[i] != 0;
        CHECK_MSG(nonzero == 0, "%s: %zu averages are not 0", what, nonzero);
    }
    f.op = DPAR_AVG, f.div = div;
    {
        auto k = dpar_cuda__make_map2((T *)out.p, (const T *)a.p, (const T *)b.p, n, f);
        RUN_GRIDS(k, memset(out.p, 0xEE, n * sizeof(T)), outs, 1, exps, what);
    }
    free(expect), free(ref);
    buf_free(&a), buf_free(&b), buf_free(&out);
}

static void test_integer_average_any_group_size(void)
{
    static const int divs[] = {2, 255, 256, 257, 300, 512, 1000, 65536, 1 << 30};
    size_t d;
    for (d = 0; d < sizeof divs / sizeof divs[0]; d++) {
        int_average_case<uint8_t, uint32_t>(DPAR_U8, U8, 65536, divs[d]);
        int_average_case<int32_t, uint32_t>(DPAR_I32, I32, 4099, divs[d]);
        int_average_case<int64_t, uint64_t>(DPAR_I64, I64, 4099, divs[d]);
    }
}

/* ---- the one-shot's combine: bitwise dpar.h's ring ----
   N thread ranks run dpar_allreduce with the ring (host memory, dpar.h's own loops) on random inputs (floats with
   NaN, infinities and -0 among them, so an operand swapped in min or max shows); the combine kernel, over the
   simulated grids, reads the ranks' inputs and must give the ring's bits, for the whole message and for a window
   of it (lo > 0: its blocks start mid-way) */
typedef struct ring_rank {
    dpar_group *group;
    int rank;
    void *data;
    size_t count;
    dpar_dtype t;
    dpar_op op;
    dpar_status st;
} ring_rank;
static void *ring_rank_main(void *arg)
{
    ring_rank *a = (ring_rank *)arg;
    dpar_comm *c = NULL;
    a->st = dpar_group_join(a->group, a->rank, &c);
    if (a->st == DPAR_OK) a->st = dpar_allreduce(c, a->data, a->data, a->count, a->t, a->op);
    dpar_comm_destroy(c);
    return NULL;
}
template <class F, class T> static void combine_case(dpar_dtype t, int kind, int N, size_t count, int op)
{
    size_t es = sizeof(T), i, windows[2][2];
    void *inputs[8], *ring[8];
    ring_rank ranks[8];
    pthread_t threads[8];
    dpar_comm_desc d;
    dpar_group *g = NULL;
    int q, wi;
    memset(&d, 0, sizeof d);
    d.size = N;
    d.algo = DPAR_ALGO_RING;
    CHECK(dpar_group_create(&d, &g) == DPAR_OK);
    if (!g) return;
    for (q = 0; q < N; q++) {
        inputs[q] = malloc(count * es + 1);
        ring[q] = malloc(count * es + 1);
        for (i = 0; i < count; i++) {
            T x;
            if (t == DPAR_F32 || t == DPAR_BF16 || t == DPAR_F16) {
                float f = dt_rand() % 16 == 0 ? special((int)(dt_rand() % 64)) : frand();
                uint16_t h = t == DPAR_BF16 ? dpar_f32_to_bf16(f) : dpar_f32_to_f16(f);
                if (t == DPAR_F32) memcpy(&x, &f, sizeof x);
                else memcpy(&x, &h, sizeof x);
            } else if (t == DPAR_F64) {
                double u = dt_rand() % 16 == 0 ? (double)special((int)(dt_rand() % 64)) : (double)frand() / 3.0;
                memcpy(&x, &u, sizeof x);
            } else {
                uint64_t r = rand64();
                memcpy(&x, &r, sizeof x);
            }
            ((T *)inputs[q])[i] = x;
        }
        memcpy(ring[q], inputs[q], count * es);
        ranks[q].group = g, ranks[q].rank = q, ranks[q].data = ring[q], ranks[q].count = count;
        ranks[q].t = t, ranks[q].op = (dpar_op)op, ranks[q].st = DPAR_EINVAL;
    }
    for (q = 0; q < N; q++) pthread_create(&threads[q], NULL, ring_rank_main, &ranks[q]);
    for (q = 0; q < N; q++) pthread_join(threads[q], NULL);
    for (q = 0; q < N; q++) CHECK_MSG(ranks[q].st == DPAR_OK, "the ring on rank %d: %s", q, dpar_last_error());
    windows[0][0] = 0, windows[0][1] = count;                                 /* the whole message */
    windows[1][0] = count / 3, windows[1][1] = count - count / 3 - count / 5; /* a window: lo, n */
    for (wi = 0; wi < 2; wi++) {
        size_t lo = windows[wi][0], n = windows[wi][1];
        const void *in[8];
        buf out = buf_make(n, kind, 0), *outs[1] = {&out};
        const void *exps[1] = {(const char *)ring[0] + lo * es};
        char what[96];
        for (q = 0; q < N; q++) in[q] = (const char *)inputs[q] + lo * es;
        snprintf(what, sizeof what, "combine %s %s N=%d count=%zu lo=%zu", dpar_dtype_name(t),
                 dpar_op_name((dpar_op)op), N, count, lo);
        auto k = dpar_cuda__make_combine<F, T>(out.p, in, N, lo, n, count, op);
        RUN_GRIDS(k, memset(out.p, 0xEE, n * es), outs, 1, exps, what);
        buf_free(&out);
    }
    for (q = 0; q < N; q++) free(inputs[q]), free(ring[q]);
    dpar_group_destroy(g);
}
static void test_combine_kernel_gives_the_rings_bits(void)
{
    static const int ns[] = {2, 3, 4, 5, 8};
    int ni, op, ci;
    for (ni = 0; ni < 5; ni++) {
        int N = ns[ni];
        size_t counts[4] = {1, (size_t)N + 1, 1000, 1023};
        for (ci = 0; ci < 4; ci++)
            for (op = 0; op < DPAR_OP_COUNT; op++) {
                size_t n = counts[ci];
                combine_case<dpar_cuda__reduce_f<dpar_cuda__f32>, float>(DPAR_F32, F32, N, n, op);
                combine_case<dpar_cuda__reduce_f<dpar_cuda__bf16>, uint16_t>(DPAR_BF16, BF16, N, n, op);
                combine_case<dpar_cuda__reduce_f<dpar_cuda__f16>, uint16_t>(DPAR_F16, F16, N, n, op);
                combine_case<dpar_cuda__reduce_f64_f, double>(DPAR_F64, F64, N, n, op);
                combine_case<dpar_cuda__reduce_int_f<int32_t, uint32_t>, int32_t>(DPAR_I32, I32, N, n, op);
                combine_case<dpar_cuda__reduce_int_f<int64_t, uint64_t>, int64_t>(DPAR_I64, I64, N, n, op);
                combine_case<dpar_cuda__reduce_int_f<uint8_t, uint32_t>, uint8_t>(DPAR_U8, U8, N, n, op);
            }
    }
}

static void test_divide_kernel(void)
{
    static const int divs[] = {2, 3, 7, 64};
    size_t s, off;
    int d;
    for (s = 0; s < NSIZES; s++)
        for (off = 0; off < 2; off++)
            for (d = 0; d < 4; d++) {
                divide_case<dpar_cuda__f32>(DPAR_F32, divs[d], sizes[s], off);
                divide_case<dpar_cuda__bf16>(DPAR_BF16, divs[d], sizes[s], off);
                divide_case<dpar_cuda__f16>(DPAR_F16, divs[d], sizes[s], off);
            }
}

/* ---- fill, scale, axpy, add, relu ---- */
static void test_elementwise_kernels(void)
{
    size_t s, off;
    for (s = 0; s < NSIZES; s++)
        for (off = 0; off < 2; off++) {
            size_t n = sizes[s], e = sizeof(float);
            buf x = buf_make(n, e, off), y = buf_make(n, e, off), out = buf_make(n, e, off);
            float *x0 = (float *)malloc(n * e + 4), *y0 = (float *)malloc(n * e + 4),
                  *expect = (float *)malloc(n * e + 4);
            buf *outs_y[1] = {&y}, *outs_o[1] = {&out};
            const void *exps[1] = {expect};
            fill_random(x0, n, 1);
            fill_random(y0, n, 1);
            memcpy(x.p, x0, n * e);
            { /* fill */
                dpar_cuda__fill_f f = {2.5f};
                auto k = dpar_cuda__make_map1((float *)y.p, (const float *)y.p, n, f);
                dpar_cuda_fill_f32_ref(expect, 2.5f, n);
                CHECK(split_ok(k, n, off));
                RUN_GRIDS(k, memcpy(y.p, y0, n * e), outs_y, 1, exps, "fill");
            }
            { /* scale, in place */
                dpar_cuda__scale_f f = {-0.37f};
                auto k = dpar_cuda__make_map1((float *)y.p, (const float *)y.p, n, f);
                memcpy(expect, y0, n * e);
                dpar_cuda_scale_f32_ref(expect, -0.37f, n);
                RUN_GRIDS(k, memcpy(y.p, y0, n * e), outs_y, 1, exps, "scale");
            }
            { /* axpy, in place */
                dpar_cuda__axpy_f f = {0.71f};
                auto k = dpar_cuda__make_map2((float *)y.p, (const float *)y.p, (const float *)x.p, n, f);
                memcpy(expect, y0, n * e);
                dpar_cuda_axpy_f32_ref(expect, x0, 0.71f, n);
                RUN_GRIDS(k, memcpy(y.p, y0, n * e), outs_y, 1, exps, "axpy");
            }
            { /* add, out of place */
                dpar_cuda__add_f f;
                auto k = dpar_cuda__make_map2((float *)out.p, (const float *)x.p, (const float *)y.p, n, f);
                dpar_cuda_add_f32_ref(expect, x0, y0, n);
                RUN_GRIDS(k, (memcpy(y.p, y0, n * e), memset(out.p, 0xEE, n * e)), outs_o, 1, exps, "add");
            }
            { /* relu forward */
                dpar_cuda__relu_f f;
                auto k = dpar_cuda__make_map1((float *)out.p, (const float *)x.p, n, f);
                dpar_cuda_relu_forward_f32_ref(expect, x0, n);
                RUN_GRIDS(k, memset(out.p, 0xEE, n * e), outs_o, 1, exps, "relu forward");
            }
            { /* relu backward, in place on dy */
                dpar_cuda__relu_backward_f f;
                auto k = dpar_cuda__make_map2((float *)y.p, (const float *)y.p, (const float *)x.p, n, f);
                dpar_cuda_relu_backward_f32_ref(expect, y0, x0, n);
                RUN_GRIDS(k, memcpy(y.p, y0, n * e), outs_y, 1, exps, "relu backward");
            }
            free(x0), free(y0), free(expect);
            buf_free(&x), buf_free(&y), buf_free(&out);
        }
    /* relu's edges, by hand */
    CHECK(dpar_cuda__relu_elem(-0.0f) == 0.0f && !signbit(dpar_cuda__relu_elem(-0.0f)));
    CHECK(isnan(dpar_cuda__relu_elem(NAN)) && dpar_cuda__relu_elem(-3.0f) == 0.0f &&
          dpar_cuda__relu_elem(2.0f) == 2.0f);
}

/* ---- bias add: every column count against the vector path's cols % 4 rule ---- */
static void test_bias_add_kernel(void)
{
    static const size_t colss[] = {1, 3, 4, 8, 33};
    size_t s, c, off;
    for (s = 0; s < NSIZES; s++)
        for (c = 0; c < 5; c++)
            for (off = 0; off < 2; off++) {
                size_t rows = sizes[s] > 4096 ? sizes[s] / colss[c] : sizes[s], cols = colss[c], n = rows * cols;
                buf y = buf_make(n, 4, off), *outs[1] = {&y};
                float *y0 = (float *)malloc(n * 4 + 4), *expect = (float *)malloc(n * 4 + 4),
                      *bias = (float *)malloc(cols * 4);
                const void *exps[1] = {expect};
                fill_random(y0, n, 0);
                fill_random(bias, cols, 0);
                memcpy(expect, y0, n * 4);
                dpar_cuda_bias_add_f32_ref(expect, bias, rows, cols);
                {
                    auto k = dpar_cuda__make_bias((float *)y.p, bias, rows, cols);
                    CHECK(off || cols % 4 || k.nvec == n / lanes(k));
                    RUN_GRIDS(k, memcpy(y.p, y0, n * 4), outs, 1, exps, "bias add");
                }
                free(y0), free(expect), free(bias);
                buf_free(&y);
            }
}

/* ---- the bias gradient: column sums, rows in order (as examples/data_parallel.c) ---- */
static void test_bias_backward_kernel(void)
{
    static const size_t colss[] = {1, 3, 10, 257};
    size_t s, c;
    for (s = 0; s < NSIZES; s++)
        for (c = 0; c < 4; c++) {
            size_t cols = colss[c], rows = sizes[s] > 4096 ? sizes[s] / cols : sizes[s], i, r;
            buf db = buf_make(cols, F32, 1), *outs[1] = {&db};
            float *dy = (float *)malloc(rows * cols * 4 + 4), *expect = (float *)malloc(cols * 4), *example;
            const void *exps[1] = {expect};
            fill_random(dy, rows * cols, 0);
            dpar_cuda_bias_backward_f32_ref(expect, dy, rows, cols);
            example = (float *)calloc(cols, 4); /* the example's loop, verbatim in shape */
            for (r = 0; r < rows; r++)
                for (i = 0; i < cols; i++) example[i] += dy[r * cols + i];
            CHECK(first_diff(example, expect, cols, F32) < 0);
            {
                auto k = dpar_cuda__make_bias_backward((float *)db.p, dy, rows, cols);
                RUN_GRIDS(k, memset(db.p, 0xEE, cols * 4), outs, 1, exps, "bias backward");
            }
            free(dy), free(expect), free(example);
            buf_free(&db);
        }
}

/* ---- the optimizers: kernel, reference and dpar_zero_step on one rank, three steps, bit for bit ---- */
static void optim_case(int adam, size_t n, size_t off)
{
    const float lr = 0.05f, mu = 0.9f, wd = 0.01f, b1 = 0.85f, b2 = 0.995f, eps = 1e-6f;
    buf p = buf_make(n, 4, off), m = buf_make(n, 4, off), v = buf_make(n, 4, off), g = buf_make(n, 4, off);
    buf *outs[3] = {&p, &m, &v};
    size_t bytes = n * 4 + 4;
    float *zp = (float *)malloc(bytes), *zg = (float *)malloc(bytes), *gr = (float *)malloc(bytes);
    float *rp = (float *)malloc(bytes), *rm = (float *)calloc(n + 1, 4), *rv = (float *)calloc(n + 1, 4);
    float *sp = (float *)malloc(bytes), *sm = (float *)malloc(bytes), *sv = (float *)malloc(bytes); /* before */
    const void *exps[3] = {rp, rm, rv};
    dpar_group *grp = NULL;
    dpar_comm *comm = NULL;
    dpar_zero *zero = NULL;
    dpar_comm_desc cd;
    dpar_zero_desc zd;
    long step;
    fill_random(rp, n, 0);
    memcpy(zp, rp, n * 4);
    memset(&cd, 0, sizeof cd);
    cd.size = 1;
    CHECK(dpar_group_create(&cd, &grp) == DPAR_OK && dpar_group_join(grp, 0, &comm) == DPAR_OK);
    memset(&zd, 0, sizeof zd);
    zd.comm = comm, zd.count = n, zd.kind = adam ? DPAR_OPTIM_ADAM : DPAR_OPTIM_SGD, zd.lr = lr;
    zd.momentum = mu, zd.beta1 = b1, zd.beta2 = b2, zd.eps = eps, zd.weight_decay = wd;
    CHECK(dpar_zero_create(&zd, &zero) == DPAR_OK);
    for (step = 1; step <= 3; step++) {
        char what[64];
        fill_random(gr, n, 0);
        memcpy(g.p, gr, n * 4);
        memcpy(zg, gr, n * 4);
        memcpy(sp, rp, n * 4), memcpy(sm, rm, n * 4), memcpy(sv, rv, n * 4);
        CHECK(dpar_zero_step(zero, zp, zg) == DPAR_OK);
        if (adam) dpar_cuda_adamw_f32_ref(rp, rm, rv, gr, n, lr, b1, b2, eps, wd, step);
        else dpar_cuda_sgd_f32_ref(rp, rm, gr, n, lr, mu, wd);
        CHECK_MSG(first_diff(rp, zp, n, F32) < 0, "%s step %ld n=%zu: the reference differs from dpar_zero_step",
                  adam ? "adamw" : "sgd", step, n);
        snprintf(what, sizeof what, "%s step %ld", adam ? "adamw" : "sgd", step);
        /* the kernel, on every grid, from the state before this step */
        if (adam) {
            auto k = dpar_cuda__make_adamw((float *)p.p, (float *)m.p, (float *)v.p, (const float *)g.p, n, lr, b1, b2,
                                           eps, wd, step);
            CHECK(split_ok(k, n, off));
            RUN_GRIDS(k, (memcpy(p.p, sp, n * 4), memcpy(m.p, sm, n * 4), memcpy(v.p, sv, n * 4)), outs, 3, exps, what);
        } else {
            auto k = dpar_cuda__make_sgd((float *)p.p, (float *)m.p, (const float *)g.p, n, lr, mu, wd);
            CHECK(split_ok(k, n, off));
            RUN_GRIDS(k, (memcpy(p.p, sp, n * 4), memcpy(m.p, sm, n * 4)), outs, 2, exps, what);
        }
    }
    dpar_zero_destroy(zero);
    dpar_comm_destroy(comm);
    dpar_group_destroy(grp);
    free(zp), free(zg), free(gr), free(rp), free(rm), free(rv), free(sp), free(sm), free(sv);
    buf_free(&p), buf_free(&m), buf_free(&v), buf_free(&g);
}

static void test_sgd_kernel(void)
{
    size_t s, off;
    for (s = 0; s < NSIZES; s++)
        for (off = 0; off < 4; off++) optim_case(0, sizes[s], off);
}

static void test_adamw_kernel(void)
{
    size_t s, off;
    for (s = 0; s < NSIZES; s++)
        for (off = 0; off < 4; off++) optim_case(1, sizes[s], off);
}

/* ---- softmax cross-entropy: one row per element; a few labels out of range give NaN rows ---- */
static void test_softmax_xent_kernels(void)
{
    static const int classess[] = {1, 3, 10, 33};
    size_t s;
    int c;
    for (s = 0; s < NSIZES; s++)
        for (c = 0; c < 4; c++) {
            size_t rows = sizes[s] > 4096 && classess[c] > 3 ? sizes[s] / 16 : sizes[s], C = (size_t)classess[c], r;
            buf loss = buf_make(rows, 4, 0), d = buf_make(rows * C, 4, 1), *outs_l[1] = {&loss}, *outs_d[1] = {&d};
            float *z = (float *)malloc(rows * C * 4 + 4), *el = (float *)malloc(rows * 4 + 4);
            float *ed = (float *)malloc(rows * C * 4 + 4);
            int *labels = (int *)malloc(rows * sizeof(int) + 4);
            const void *exps_l[1] = {el}, *exps_d[1] = {ed};
            fill_random(z, rows * C, 0);
            for (r = 0; r < rows * C; r++) z[r] *= 8.0f; /* logits up to +-32: the max subtraction matters */
            for (r = 0; r < rows; r++)
                labels[r] = dt_rand() % 97 == 0 ? (dt_rand() % 2 ? -1 : (int)C) : (int)(dt_rand() % C);
            dpar_cuda_softmax_xent_forward_f32_ref(el, z, labels, rows, (int)C);
            dpar_cuda_softmax_xent_backward_f32_ref(ed, z, labels, rows, (int)C);
            {
                auto k = dpar_cuda__make_xent((float *)loss.p, z, labels, rows, (int)C, 0);
                RUN_GRIDS(k, memset(loss.p, 0xEE, rows * 4), outs_l, 1, exps_l, "softmax xent forward");
            }
            {
                auto k = dpar_cuda__make_xent((float *)d.p, z, labels, rows, (int)C, 1);
                RUN_GRIDS(k, memset(d.p, 0xEE, rows * C * 4), outs_d, 1, exps_d, "softmax xent backward");
            }
            if (rows > 0 && C > 1) { /* the gradient of each valid row sums to ~0; its loss is >= 0 */
                for (r = 0; r < rows; r++) {
                    double sum = 0;
                    size_t q;
                    if (labels[r] < 0 || labels[r] >= (int)C) {
                        CHECK(isnan(el[r]) && isnan(ed[r * C]));
                        continue;
                    }
                    for (q = 0; q < C; q++) sum += ed[r * C + q];
                    CHECK_MSG(fabs(sum) < 1e-6 && el[r] >= 0, "row %zu: gradient sum %g, loss %g", r, sum,
                              (double)el[r]);
                    if (fabs(sum) >= 1e-6) break;
                }
            }
            free(z), free(el), free(ed), free(labels);
            buf_free(&loss), buf_free(&d);
        }
}

/* ---- the launchers' argument checks (they return before any CUDA call) ---- */
static void test_launchers_refuse_bad_arguments(void)
{
    float f = 0;
    uint16_t h = 0;
    int lab = 0;
    void *handle = &f;                                      /* never used: the checks come first */
    CHECK(dpar_cuda_fill_f32(NULL, 1, 0, NULL) == DPAR_OK); /* n = 0: nothing to do, no launch */
    CHECK(dpar_cuda_fill_f32(NULL, 1, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_scale_f32(NULL, 1, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_axpy_f32(&f, NULL, 1, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_add_f32(&f, &f, NULL, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_reduce(&f, &f, NULL, 3, DPAR_F32, DPAR_SUM, 0, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_reduce(&f, &f, &f, 3, (dpar_dtype)99, DPAR_SUM, 0, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_reduce(&f, &f, &f, 3, DPAR_F32, (dpar_op)7, 0, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_divide(&h, NULL, 3, DPAR_BF16, 2, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_divide(&h, &h, 3, (dpar_dtype)-1, 2, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_divide(&h, &h, 3, DPAR_BF16, 1, NULL) == DPAR_OK); /* in place, div 1: nothing to do */
    CHECK(dpar_cuda_cast(&h, DPAR_BF16, NULL, DPAR_F32, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_cast(&h, DPAR_U8, &f, DPAR_F32, 3, NULL) == DPAR_EUNSUPPORTED);
    CHECK(strstr(dpar_last_error(), "u8") != NULL);
    CHECK(dpar_cuda_sgd_f32(&f, NULL, &f, 3, 0.1f, 0.9f, 0, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_adamw_f32(&f, &f, &f, NULL, 3, 0.1f, 0.9f, 0.99f, 1e-8f, 0, 1, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_adamw_f32(&f, &f, &f, &f, 3, 0.1f, 0.9f, 0.99f, 1e-8f, 0, 0, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_bias_add_f32(&f, NULL, 2, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_bias_add_f32(&f, &f, (size_t)-1, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_bias_backward_f32(NULL, &f, 2, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_bias_backward_f32(&f, NULL, 2, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_relu_forward_f32(NULL, &f, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_relu_backward_f32(&f, &f, NULL, 3, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_softmax_xent_forward_f32(&f, &f, NULL, 3, 10, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_softmax_xent_backward_f32(&f, &f, &lab, 3, 0, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, 2, 2, 2, 1, &f, 2, &f, 2, 0, &f, 2, NULL, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, 2, 2, 2, 1, &f, 1, &f, 2, 0, &f, 2, handle, NULL) ==
          DPAR_EINVAL);
    CHECK(dpar_cuda_sgemm(DPAR_TRANS, DPAR_NO_TRANS, 3, 2, 2, 1, &f, 2, &f, 2, 0, &f, 2, handle, NULL) == DPAR_EINVAL);
    CHECK(dpar_cuda_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, 2, 2, 2, 1, NULL, 2, &f, 2, 0, &f, 2, handle, NULL) ==
          DPAR_EINVAL);
    CHECK(dpar_cuda_sgemm((dpar_trans)2, DPAR_NO_TRANS, 2, 2, 2, 1, &f, 2, &f, 2, 0, &f, 2, handle, NULL) ==
          DPAR_EINVAL);
    CHECK(dpar_cuda_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, 0, 2, 2, 1, NULL, 2, NULL, 2, 0, NULL, 2, handle, NULL) ==
          DPAR_OK);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_bf16_f16_every_pattern);
    RUN(test_cast_kernel);
    RUN(test_reduce_kernel);
    RUN(test_unshared_offsets_run_scalar);
    RUN(test_divide_kernel);
    RUN(test_reduce_and_divide_other_dtypes);
    RUN(test_integer_average_any_group_size);
    RUN(test_combine_kernel_gives_the_rings_bits);
    RUN(test_elementwise_kernels);
    RUN(test_bias_add_kernel);
    RUN(test_bias_backward_kernel);
    RUN(test_sgd_kernel);
    RUN(test_adamw_kernel);
    RUN(test_softmax_xent_kernels);
    RUN(test_launchers_refuse_bad_arguments);
    return dt_summary();
}
