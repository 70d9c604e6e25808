/* test_shard.c - shard plans and their scatter/gather/all-gather, the tensor-parallel linear
   layers against the unsharded layer, a finite-difference check of the layer, a Megatron MLP
   trained with tp = 2 against tp = 1, and ZeRO-1 against an unsharded optimizer. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>

#include "dpar_test.h"
#include "coll_matrix.h"

/* dpar_linear_init of a layer with a bias */
static dpar_status linear(dpar_linear *l, dpar_linear_mode mode, int in, int out, dpar_comm *comm)
{
    dpar_linear_desc d = {0};
    d.mode = mode, d.in = in, d.out = out, d.comm = comm;
    return dpar_linear_init(l, &d);
}

static float frand(void) { return (float)((double)(dt_rand() % 20001) / 10000.0 - 1.0); }
static void frandom(float *x, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) x[i] = frand();
}

static double rel_diff(const float *a, const float *b, size_t n)
{
    double worst = 0;
    size_t i;
    for (i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]) / (fabs((double)b[i]) > 1.0 ? fabs((double)b[i]) : 1.0);
        if (d > worst || d != d) worst = d != d ? 1e30 : d;
    }
    return worst;
}

/* ---- shard plans ---- */
static void test_shard_plans_cover_each_element_once(void)
{
    int c;
    for (c = 0; c < 300; c++) {
        size_t rows = (size_t)dt_rand_int(12), cols = (size_t)dt_rand_int(12), total = 0, i, j;
        int parts = 1 + dt_rand_int(9), axis = dt_rand_int(2), r, bad = 0;
        dpar_shard_plan p;
        dpar_shard_plan_desc pd = {0};
        int *seen = (int *)calloc(rows * cols + 1, sizeof(int));
        pd.rows = rows, pd.cols = cols, pd.parts = parts, pd.axis = (dpar_shard_axis)axis;
        CHECK(dpar_shard_plan_init(&p, &pd) == DPAR_OK);
        for (r = 0; r < parts; r++) {
            size_t r0, nr, c0, nc, n = dpar_shard_slice(&p, r, &r0, &nr, &c0, &nc);
            bad |= n != nr * nc || (axis == 0 ? nc != cols : nr != rows);
            for (i = r0; i < r0 + nr; i++)
                for (j = c0; j < c0 + nc; j++) seen[i * cols + j]++;
            total += n;
        }
        for (i = 0; i < rows * cols; i++) bad |= seen[i] != 1;
        CHECK_MSG(!bad && total == rows * cols, "rows %zu cols %zu parts %d axis %d", rows, cols, parts, axis);
        free(seen);
    }
    {
        dpar_shard_plan p;
        dpar_shard_plan_desc pd = {0};
        pd.rows = 3, pd.cols = 3; /* parts 0 */
        CHECK(dpar_shard_plan_init(&p, &pd) == DPAR_EINVAL && p.parts == 0);
        CHECK(dpar_shard_plan_init(&p, NULL) == DPAR_EINVAL);
        pd.parts = 2, pd.axis = (dpar_shard_axis)7;
        CHECK(dpar_shard_plan_init(&p, &pd) == DPAR_EINVAL);
        pd.axis = DPAR_SHARD_ROWS;
        dpar_shard_plan_init(&p, &pd);
        CHECK(dpar_shard_slice(&p, 5, NULL, NULL, NULL, NULL) == 0);
    }
}

typedef struct {
    size_t rows, cols;
    int axis;
    dpar_dtype t;
    char *full, *shard[8], *back[8];
} scatter_job;
static void scatter_rank(world *w, dpar_comm *c, int r)
{
    scatter_job *j = (scatter_job *)w->user;
    dpar_shard_plan p;
    dpar_shard_plan_desc pd = {0};
    size_t es = dpar_dtype_size(j->t), n, r0, nr, c0, nc, i;
    int root = j->rows % (size_t)w->n;
    pd.rows = j->rows, pd.cols = j->cols, pd.parts = w->n, pd.axis = (dpar_shard_axis)j->axis;
    dpar_shard_plan_init(&p, &pd);
    n = dpar_shard_slice(&p, r, &r0, &nr, &c0, &nc);
    expect_ok(w, dpar_shard_scatter(c, &p, r == root ? j->full : NULL, j->shard[r], j->t, root), "scatter", r);
    for (i = 0; i < nr; i++) /* my shard is my slice of full */
        if (memcmp(j->shard[r] + i * nc * es, j->full + ((r0 + i) * j->cols + c0) * es, nc * es))
            note(w, "scatter rows %zu cols %zu axis %d: rank %d row %zu wrong", j->rows, j->cols, j->axis, r, i);
    memset(j->back[r], 0, j->rows * j->cols * es + 1);
    expect_ok(w, dpar_shard_allgather(c, &p, j->shard[r], j->back[r], j->t), "allgather", r);
    if (memcmp(j->back[r], j->full, j->rows * j->cols * es)) note(w, "allgather: rank %d differs", r);
    memset(j->back[r], 0, j->rows * j->cols * es + 1);
    expect_ok(w, dpar_shard_gather(c, &p, j->shard[r], r == root ? j->back[r] : NULL, j->t, root), "gather", r);
    if (r == root && memcmp(j->back[r], j->full, j->rows * j->cols * es)) note(w, "gather: root differs");
    (void)n;
}

static void test_shard_scatter_gather_allgather(void)
{
    static const int Ns2[] = {1, 2, 3, 4};
    int ni, c, q;
    for (ni = 0; ni < 4; ni++)
        for (c = 0; c < 12; c++) {
            scatter_job j;
            size_t i, bytes;
            int N = Ns2[ni];
            memset(&j, 0, sizeof j);
            /* sometimes fewer rows than ranks */
            j.rows = (size_t)(c % 3 == 0 ? dt_rand_int(N + 1) : 1 + dt_rand_int(40));
            j.cols = (size_t)(1 + dt_rand_int(30));
            j.axis = c % 2;
            j.t = c % 4 == 3 ? DPAR_U8 : (c % 4 == 1 ? DPAR_F64 : DPAR_F32);
            bytes = j.rows * j.cols * dpar_dtype_size(j.t) + 1;
            j.full = (char *)malloc(bytes);
            for (i = 0; i < bytes; i++) j.full[i] = (char)dt_rand();
            for (q = 0; q < N; q++) {
                j.shard[q] = (char *)malloc(bytes);
                j.back[q] = (char *)malloc(bytes);
            }
            CHECK(run_world(N, scatter_rank, &j) == 0);
            for (q = 0; q < N; q++) {
                free(j.shard[q]);
                free(j.back[q]);
            }
            free(j.full);
        }
}

/* ---- tensor-parallel layers against the whole layer ---- */
#define BATCH 7
#define IN 13
#define OUT 10
typedef struct {
    float W[IN * OUT], b[OUT], x[BATCH * IN], dy[BATCH * OUT];
    float y[BATCH * OUT], dx[BATCH * IN], dW[IN * OUT], db[OUT]; /* the whole layer's answers */
    int mode;
} tp_job;

static void tp_rank(world *w, dpar_comm *c, int r)
{
    tp_job *j = (tp_job *)w->user;
    dpar_linear l;
    float x[BATCH * IN], y[BATCH * OUT], dy[BATCH * OUT], dx[BATCH * IN];
    int i, k;
    if (linear(&l, (dpar_linear_mode)j->mode, IN, OUT, c) != DPAR_OK) {
        note(w, "init: %s", dpar_last_error());
        return;
    }
    dpar_linear_set_weights(&l, j->W, j->b);
    /* my input: all of x (column), or my columns of it (row) */
    for (i = 0; i < BATCH; i++)
        for (k = 0; k < l.in_local; k++) x[i * l.in_local + k] = j->x[i * IN + l.in_offset + k];
    expect_ok(w, dpar_linear_forward(&l, x, y, BATCH), "forward", r);
    for (i = 0; i < BATCH; i++)
        for (k = 0; k < l.out_local; k++)
            if (fabs(y[i * l.out_local + k] - j->y[i * OUT + l.out_offset + k]) > 1e-5)
                note(w, "mode %d N=%d rank %d: y[%d][%d] = %g, want %g", j->mode, w->n, r, i, k, y[i * l.out_local + k],
                     j->y[i * OUT + l.out_offset + k]);
    for (i = 0; i < BATCH; i++)
        for (k = 0; k < l.out_local; k++) dy[i * l.out_local + k] = j->dy[i * OUT + l.out_offset + k];
    expect_ok(w, dpar_linear_backward(&l, x, dy, dx, BATCH), "backward", r);
    for (i = 0; i < BATCH; i++)
        for (k = 0; k < l.in_local; k++)
            if (fabs(dx[i * l.in_local + k] - j->dx[i * IN + l.in_offset + k]) > 1e-5)
                note(w, "mode %d N=%d rank %d: dx[%d][%d] wrong", j->mode, w->n, r, i, k);
    for (i = 0; i < l.in_local; i++)
        for (k = 0; k < l.out_local; k++)
            if (fabs(l.dw[i * l.out_local + k] - j->dW[(l.in_offset + i) * OUT + l.out_offset + k]) > 1e-5)
                note(w, "mode %d N=%d rank %d: dW[%d][%d] wrong", j->mode, w->n, r, i, k);
    for (k = 0; k < l.bias_local; k++)
        if (fabs(l.db[k] - j->db[(l.mode == DPAR_LINEAR_COLUMN ? l.out_offset : 0) + k]) > 1e-5)
            note(w, "mode %d rank %d: db[%d] wrong", j->mode, r, k);
    dpar_linear_destroy(&l);
}

static void test_tensor_parallel_layers_match_whole_layer(void)
{
    tp_job j;
    dpar_linear whole;
    int n, mode;
    frandom(j.W, IN * OUT);
    frandom(j.b, OUT);
    frandom(j.x, BATCH * IN);
    frandom(j.dy, BATCH * OUT);
    /* the whole layer, and its gradients by the plain formulas */
    CHECK(linear(&whole, DPAR_LINEAR_FULL, IN, OUT, NULL) == DPAR_OK);
    dpar_linear_set_weights(&whole, j.W, j.b);
    CHECK(dpar_linear_forward(&whole, j.x, j.y, BATCH) == DPAR_OK);
    CHECK(dpar_linear_backward(&whole, j.x, j.dy, j.dx, BATCH) == DPAR_OK);
    {
        int i, k, o; /* the formulas by hand: dW = x^T dy, db = colsum dy, dx = dy W^T, y = x W + b */
        double bad = 0;
        for (i = 0; i < IN; i++)
            for (o = 0; o < OUT; o++) {
                double s = 0;
                for (k = 0; k < BATCH; k++) s += (double)j.x[k * IN + i] * j.dy[k * OUT + o];
                bad += fabs(s - whole.dw[i * OUT + o]) > 1e-5;
            }
        for (k = 0; k < BATCH; k++)
            for (o = 0; o < OUT; o++) {
                double s = j.b[o];
                for (i = 0; i < IN; i++) s += (double)j.x[k * IN + i] * j.W[i * OUT + o];
                bad += fabs(s - j.y[k * OUT + o]) > 1e-5;
            }
        CHECK(bad == 0);
    }
    memcpy(j.dW, whole.dw, sizeof j.dW);
    memcpy(j.db, whole.db, sizeof j.db);
    dpar_linear_destroy(&whole);
    for (mode = 1; mode <= 2; mode++)
        for (n = 1; n <= 4; n++) {
            j.mode = mode;
            CHECK_MSG(run_world(n, tp_rank, &j) == 0, "mode %d N=%d", mode, n);
        }
}

/* desc.leaves: COLUMN and ROW layers on 1, 2 and 4 ranks give the bits of a FULL layer with the same leaves (y, dx,
   dW, db, every rank's part), over dimensions the leaves do not divide evenly; and the FULL layer with leaves is
   the plain layer to rounding */
#define LV_IN 37
#define LV_OUT 23
#define LV_BATCH 9
typedef struct {
    int mode, leaves;
    float W[LV_IN * LV_OUT], b[LV_OUT], x[LV_BATCH * LV_IN], dy[LV_BATCH * LV_OUT];
    float y[LV_BATCH * LV_OUT], dx[LV_BATCH * LV_IN], dW[LV_IN * LV_OUT], db[LV_OUT]; /* the FULL layer's */
    int bad[4];
} lv_job;
static void lv_rank(world *w, dpar_comm *c, int r)
{
    lv_job *j = (lv_job *)w->user;
    dpar_linear l;
    dpar_linear_desc d = {0};
    float y[LV_BATCH * LV_OUT], dx[LV_BATCH * LV_IN], xin[LV_BATCH * LV_IN], dyin[LV_BATCH * LV_OUT];
    int i, k, bad = 0;
    d.mode = (dpar_linear_mode)j->mode, d.in = LV_IN, d.out = LV_OUT, d.comm = c, d.leaves = j->leaves;
    expect_ok(w, dpar_linear_init(&l, &d), "linear_init", r);
    dpar_linear_set_weights(&l, j->W, j->b);
    /* ROW takes my columns of x; COLUMN my columns of dy */
    for (k = 0; k < LV_BATCH; k++) {
        memcpy(xin + k * l.in_local, j->x + k * LV_IN + l.in_offset, (size_t)l.in_local * sizeof(float));
        memcpy(dyin + k * l.out_local, j->dy + k * LV_OUT + l.out_offset, (size_t)l.out_local * sizeof(float));
    }
    expect_ok(w, dpar_linear_forward(&l, xin, y, LV_BATCH), "forward", r);
    expect_ok(w, dpar_linear_backward(&l, xin, dyin, dx, LV_BATCH), "backward", r);
    for (k = 0; k < LV_BATCH; k++) {
        bad += memcmp(y + k * l.out_local, j->y + k * LV_OUT + l.out_offset, (size_t)l.out_local * sizeof(float)) != 0;
        bad += memcmp(dx + k * l.in_local, j->dx + k * LV_IN + l.in_offset, (size_t)l.in_local * sizeof(float)) != 0;
    }
    for (i = 0; i < l.in_local; i++)
        bad += memcmp(l.dw + i * l.out_local, j->dW + (l.in_offset + i) * LV_OUT + l.out_offset,
                      (size_t)l.out_local * sizeof(float)) != 0;
    bad += memcmp(l.db, j->db + (j->mode == DPAR_LINEAR_COLUMN ? l.out_offset : 0),
                  (size_t)l.bias_local * sizeof(float)) != 0;
    j->bad[r] = bad;
    dpar_linear_destroy(&l);
}
static void lv_refused(world *w, dpar_comm *c, int r)
{
    dpar_linear l;
    dpar_linear_desc d = {0};
    d.mode = DPAR_LINEAR_ROW, d.in = LV_IN, d.out = LV_OUT, d.comm = c, d.leaves = 4;
    if (dpar_linear_init(&l, &d) != DPAR_EINVAL || !strstr(dpar_last_error(), "a multiple of the tp ranks (3)"))
        note(w, "rank %d: 4 leaves on 3 ranks: %s", r, dpar_last_error());
}
static void test_leaves_same_bits_for_any_tp(void)
{
    lv_job *j = (lv_job *)calloc(1, sizeof *j);
    static const int leaves[] = {4, 8};
    int li, mode, n, r;
    frandom(j->W, LV_IN * LV_OUT);
    frandom(j->b, LV_OUT);
    frandom(j->x, LV_BATCH * LV_IN);
    frandom(j->dy, LV_BATCH * LV_OUT);
    for (li = 0; li < 2; li++) {
        dpar_linear full, plain;
        dpar_linear_desc d = {0};
        float py[LV_BATCH * LV_OUT], pdx[LV_BATCH * LV_IN];
        d.in = LV_IN, d.out = LV_OUT, d.leaves = leaves[li];
        CHECK(dpar_linear_init(&full, &d) == DPAR_OK);
        d.leaves = 0;
        CHECK(dpar_linear_init(&plain, &d) == DPAR_OK);
        dpar_linear_set_weights(&full, j->W, j->b);
        dpar_linear_set_weights(&plain, j->W, j->b);
        CHECK(dpar_linear_forward(&full, j->x, j->y, LV_BATCH) == DPAR_OK);
        CHECK(dpar_linear_backward(&full, j->x, j->dy, j->dx, LV_BATCH) == DPAR_OK);
        CHECK(dpar_linear_forward(&plain, j->x, py, LV_BATCH) == DPAR_OK);
        CHECK(dpar_linear_backward(&plain, j->x, j->dy, pdx, LV_BATCH) == DPAR_OK);
        CHECK_MSG(rel_diff(j->y, py, LV_BATCH * LV_OUT) < 1e-6 && rel_diff(j->dx, pdx, LV_BATCH * LV_IN) < 1e-6,
                  "%d leaves: y %.1e, dx %.1e from the plain layer", leaves[li], rel_diff(j->y, py, LV_BATCH * LV_OUT),
                  rel_diff(j->dx, pdx, LV_BATCH * LV_IN));
        memcpy(j->dW, full.dw, sizeof j->dW);
        memcpy(j->db, full.db, sizeof j->db);
        dpar_linear_destroy(&full);
        dpar_linear_destroy(&plain);
        j->leaves = leaves[li];
        for (mode = DPAR_LINEAR_COLUMN; mode <= DPAR_LINEAR_ROW; mode++)
            for (n = 1; n <= 4; n *= 2) {
                j->mode = mode;
                memset(j->bad, 0, sizeof j->bad);
                CHECK_MSG(run_world(n, lv_rank, j) == 0, "mode %d N=%d", mode, n);
                for (r = 0; r < n; r++)
                    CHECK_MSG(j->bad[r] == 0,
                              "%s, %d leaves, tp=%d, rank %d: %d rows or arrays differ from FULL's bits",
                              mode == DPAR_LINEAR_COLUMN ? "COLUMN" : "ROW", leaves[li], n, r, j->bad[r]);
            }
    }
    CHECK(run_world(3, lv_refused, NULL) == 0); /* the leaves must divide among the ranks */
    free(j);
}

/* finite differences: L = sum(y * R); dL/dW and dL/db and dL/dx against the layer's backward */
typedef struct {
    dpar_linear *l;
    const float *x, *R;
    float *y;
} fd_loss;
static double fd_eval(const fd_loss *f)
{
    double out = 0;
    int q;
    dpar_linear_forward(f->l, f->x, f->y, BATCH);
    for (q = 0; q < BATCH * OUT; q++) out += (double)f->y[q] * f->R[q];
    return out;
}
/* central differences of L in every `stride`-th element of v against grad: how many differ */
static int fd_count_bad(const fd_loss *f, float *v, const float *grad, int n, int stride)
{
    const double h = 1e-2;
    int i, bad = 0;
    for (i = 0; i < n; i += stride) {
        double lp, lm, num;
        float keep = v[i];
        v[i] = keep + (float)h;
        lp = fd_eval(f);
        v[i] = keep - (float)h;
        lm = fd_eval(f);
        v[i] = keep;
        num = (lp - lm) / (2 * h);
        bad += fabs(num - grad[i]) > 1e-3 * (1 + fabs(num));
    }
    return bad;
}

static void test_layer_gradient_by_finite_differences(void)
{
    dpar_linear l;
    float x[BATCH * IN], R[BATCH * OUT], y[BATCH * OUT], dx[BATCH * IN];
    fd_loss f;
    int bad;
    frandom(x, BATCH * IN);
    frandom(R, BATCH * OUT);
    CHECK(linear(&l, DPAR_LINEAR_FULL, IN, OUT, NULL) == DPAR_OK);
    frandom(l.w, IN * OUT);
    frandom(l.b, OUT);
    CHECK(dpar_linear_forward(&l, x, y, BATCH) == DPAR_OK);
    CHECK(dpar_linear_backward(&l, x, R, dx, BATCH) == DPAR_OK); /* dy = dL/dy = R */
    f.l = &l, f.x = x, f.R = R, f.y = y;
    bad = fd_count_bad(&f, l.w, l.dw, IN * OUT, 3) + fd_count_bad(&f, l.b, l.db, OUT, 1) +
          fd_count_bad(&f, x, dx, BATCH * IN, 2);
    CHECK_MSG(bad == 0, "%d gradients differ from finite differences", bad);
    { /* a second backward adds to dW and db (gradient accumulation); dpar_linear_zero_grad clears them */
        float dw1[IN * OUT], db1[OUT];
        int i, wrong = 0;
        memcpy(dw1, l.dw, sizeof dw1);
        memcpy(db1, l.db, sizeof db1);
        CHECK(dpar_linear_backward(&l, x, R, NULL, BATCH) == DPAR_OK);
        for (i = 0; i < IN * OUT; i++) wrong += !(fabsf(l.dw[i] - 2.0f * dw1[i]) <= 1e-6f * (1.0f + fabsf(dw1[i])));
        for (i = 0; i < OUT; i++) wrong += !(fabsf(l.db[i] - 2.0f * db1[i]) <= 1e-6f * (1.0f + fabsf(db1[i])));
        dpar_linear_zero_grad(&l);
        for (i = 0; i < IN * OUT; i++) wrong += l.dw[i] != 0.0f;
        for (i = 0; i < OUT; i++) wrong += l.db[i] != 0.0f;
        CHECK_MSG(wrong == 0, "%d gradients not accumulated over two backward calls, or not cleared", wrong);
    }
    dpar_linear_destroy(&l);
}

/* ---- a Megatron MLP block: column-parallel, ReLU, row-parallel; MSE; 50 steps of SGD ---- */
#define MB 16
#define MIN 12
#define MHID 22
#define MOUT 6
#define MSTEPS 50
typedef struct {
    float W1[MIN * MHID], b1[MHID], W2[MHID * MOUT], b2[MOUT], x[MB * MIN], t[MB * MOUT];
    float loss[MSTEPS];
} mlp_job;

static void mlp_rank(world *w, dpar_comm *c, int r)
{
    mlp_job *j = (mlp_job *)w->user;
    dpar_linear l1, l2;
    float h[MB * MHID], a[MB * MHID], y[MB * MOUT], dy[MB * MOUT], da[MB * MHID];
    int step, i;
    linear(&l1, DPAR_LINEAR_COLUMN, MIN, MHID, c);
    linear(&l2, DPAR_LINEAR_ROW, MHID, MOUT, c);
    dpar_linear_set_weights(&l1, j->W1, j->b1);
    dpar_linear_set_weights(&l2, j->W2, j->b2);
    for (step = 0; step < MSTEPS; step++) {
        double loss = 0;
        int n1 = MB * l1.out_local;
        expect_ok(w, dpar_linear_forward(&l1, j->x, h, MB), "forward 1", r); /* (MB, hidden/tp) */
        for (i = 0; i < n1; i++) a[i] = h[i] > 0 ? h[i] : 0;                 /* ReLU on the shard */
        expect_ok(w, dpar_linear_forward(&l2, a, y, MB), "forward 2", r);    /* (MB, out): allreduced */
        for (i = 0; i < MB * MOUT; i++) {
            float e = y[i] - j->t[i];
            loss += (double)e * e;
            dy[i] = 2.0f * e / (MB * MOUT);
        }
        if (r == 0) j->loss[step] = (float)(loss / (MB * MOUT));
        dpar_linear_zero_grad(&l1);
        dpar_linear_zero_grad(&l2);
        expect_ok(w, dpar_linear_backward(&l2, a, dy, da, MB), "backward 2", r); /* da: my columns */
        for (i = 0; i < n1; i++) da[i] = h[i] > 0 ? da[i] : 0;
        expect_ok(w, dpar_linear_backward(&l1, j->x, da, NULL, MB), "backward 1", r);
        for (i = 0; i < l1.in_local * l1.out_local; i++) l1.w[i] -= 0.1f * l1.dw[i];
        for (i = 0; i < l1.bias_local; i++) l1.b[i] -= 0.1f * l1.db[i];
        for (i = 0; i < l2.in_local * l2.out_local; i++) l2.w[i] -= 0.1f * l2.dw[i];
        for (i = 0; i < l2.bias_local; i++) l2.b[i] -= 0.1f * l2.db[i];
    }
    dpar_linear_destroy(&l1);
    dpar_linear_destroy(&l2);
}

static void test_megatron_mlp_tp2_matches_tp1(void)
{
    mlp_job j;
    float tp1[MSTEPS];
    int s;
    double worst = 0;
    frandom(j.W1, MIN * MHID);
    frandom(j.b1, MHID);
    frandom(j.W2, MHID * MOUT);
    frandom(j.b2, MOUT);
    frandom(j.x, MB * MIN);
    frandom(j.t, MB * MOUT);
    CHECK(run_world(1, mlp_rank, &j) == 0);
    memcpy(tp1, j.loss, sizeof tp1);
    CHECK(run_world(2, mlp_rank, &j) == 0);
    for (s = 0; s < MSTEPS; s++) {
        double d = fabs((double)j.loss[s] - tp1[s]) / tp1[s];
        if (d > worst) worst = d;
    }
    CHECK_MSG(worst <= 1e-5, "tp=2 loss differs from tp=1 by %.2e (relative)", worst);
    CHECK_MSG(tp1[MSTEPS - 1] < 0.6f * tp1[0], "the loss did not fall: %g -> %g", tp1[0], tp1[MSTEPS - 1]);
    printf("    loss %.4f -> %.4f, tp=2 within %.1e of tp=1\n", tp1[0], tp1[MSTEPS - 1], worst);
}

/* ---- ZeRO-1 against an unsharded optimizer ---- */
#define ZN 1001
#define ZSTEPS 50
typedef struct {
    dpar_optim kind;
    float params[8][ZN];
    size_t state_bytes[8];
} zero_job;

/* the gradient rank r sees at a step: depends on the parameters, the rank and the step */
static float zgrad(const float *p, int i, int r, int step)
{
    return 0.3f * p[i] + 0.01f * (float)(((i * 7 + r * 13 + step * 5) % 23) - 11);
}

static void zero_rank(world *w, dpar_comm *c, int r)
{
    zero_job *j = (zero_job *)w->user;
    dpar_zero_desc d;
    dpar_zero *z;
    float g[ZN];
    int i, s;
    memset(&d, 0, sizeof d);
    d.kind = j->kind;
    d.lr = j->kind == DPAR_OPTIM_SGD ? 0.05f : 0.01f;
    d.momentum = 0.9f;
    d.weight_decay = 0.01f;
    d.comm = c, d.count = ZN;
    if (dpar_zero_create(&d, &z) != DPAR_OK) {
        note(w, "zero_create: %s", dpar_last_error());
        return;
    }
    for (i = 0; i < ZN; i++) j->params[r][i] = (float)((i % 17) - 8) / 8.0f;
    for (s = 0; s < ZSTEPS; s++) {
        for (i = 0; i < ZN; i++) g[i] = zgrad(j->params[r], i, r, s);
        expect_ok(w, dpar_zero_step(z, j->params[r], g), "zero_step", r);
    }
    j->state_bytes[r] = dpar_zero_state_bytes(z);
    dpar_zero_destroy(z);
}

static void reference_optimizer(dpar_optim kind, int N, float *p)
{
    float m[ZN], v[ZN];
    int i, s, r;
    float lr = kind == DPAR_OPTIM_SGD ? 0.05f : 0.01f;
    memset(m, 0, sizeof m);
    memset(v, 0, sizeof v);
    for (i = 0; i < ZN; i++) p[i] = (float)((i % 17) - 8) / 8.0f;
    for (s = 0; s < ZSTEPS; s++) {
        float g[ZN];
        for (i = 0; i < ZN; i++) { /* the average over ranks, in double */
            double acc = 0;
            for (r = 0; r < N; r++) acc += zgrad(p, i, r, s);
            g[i] = (float)(acc / N);
        }
        for (i = 0; i < ZN; i++) {
            if (kind == DPAR_OPTIM_SGD) {
                m[i] = 0.9f * m[i] + (g[i] + 0.01f * p[i]);
                p[i] -= lr * m[i];
            } else {
                double c1 = 1 - pow(0.9, s + 1), c2 = 1 - pow(0.999, s + 1);
                m[i] = 0.9f * m[i] + 0.1f * g[i];
                v[i] = 0.999f * v[i] + 0.001f * g[i] * g[i];
                p[i] -= lr * (float)((m[i] / c1) / (sqrt(v[i] / c2) + 1e-8) + 0.01 * p[i]);
            }
        }
    }
}

static void test_zero1_matches_unsharded_optimizer(void)
{
    int kind, n, r;
    for (kind = 0; kind < 2; kind++)
        for (n = 1; n <= 4; n++) {
            zero_job j;
            float ref[ZN];
            size_t total = 0, per, state_total = (size_t)ZN * 4 * (kind == DPAR_OPTIM_ADAM ? 2 : 1);
            memset(&j, 0, sizeof j);
            j.kind = (dpar_optim)kind;
            CHECK(run_world(n, zero_rank, &j) == 0);
            reference_optimizer(j.kind, n, ref);
            for (r = 0; r < n; r++) {
                CHECK_MSG(rel_diff(j.params[r], ref, ZN) <= 1e-6, "%s N=%d rank %d: %.2e from the unsharded optimizer",
                          kind ? "adam" : "sgd", n, r, rel_diff(j.params[r], ref, ZN));
                CHECK(!memcmp(j.params[r], j.params[0], sizeof ref)); /* replicas identical */
                per = (size_t)(ZN / n + (r < ZN % n)) * 4 * (kind == DPAR_OPTIM_ADAM ? 2 : 1);
                CHECK(j.state_bytes[r] == per); /* 1/N of the state, plus rounding */
                total += j.state_bytes[r];
            }
            CHECK(total == state_total);
            if (n == 4)
                printf("    %s: state %zu bytes in all, %zu per rank on 4 ranks\n", kind ? "adam" : "sgd", state_total,
                       j.state_bytes[0]);
        }
}

static void test_bad_input(void)
{
    dpar_linear l;
    dpar_zero *z;
    dpar_zero_desc d;
    CHECK(linear(&l, DPAR_LINEAR_COLUMN, 4, 4, NULL) == DPAR_EINVAL);
    CHECK(linear(&l, DPAR_LINEAR_FULL, 0, 4, NULL) == DPAR_EINVAL);
    CHECK(linear(NULL, DPAR_LINEAR_FULL, 4, 4, NULL) == DPAR_EINVAL);
    CHECK(dpar_linear_init(&l, NULL) == DPAR_EINVAL && l.w == NULL);
    {
        dpar_linear_desc ld = {0};
        dpar_pool *pool = NULL;
        dpar_pool_desc pd = {0};
        ld.in = 3, ld.out = 2, ld.leaves = -1;
        CHECK(dpar_linear_init(&l, &ld) == DPAR_EINVAL && strstr(dpar_last_error(), "leaves = -1"));
        ld.leaves = 5000;
        CHECK(dpar_linear_init(&l, &ld) == DPAR_EINVAL);
        pd.num_threads = 1;
        CHECK(dpar_pool_create(&pd, &pool) == DPAR_OK);
        ld.leaves = 2, ld.pool = pool; /* the bitwise mode runs the built-in GEMM on the calling thread */
        CHECK(dpar_linear_init(&l, &ld) == DPAR_EINVAL && strstr(dpar_last_error(), "no pool"));
        dpar_pool_destroy(pool);
    }
    {
        dpar_linear_desc ld = {0};
        dt_counting counts = {0, 0};
        ld.in = 3, ld.out = 2, ld.no_bias = 1; /* mode 0: FULL */
        ld.allocator.alloc = dt_count_alloc, ld.allocator.free = dt_count_free, ld.allocator.user = &counts;
        CHECK(dpar_linear_init(&l, &ld) == DPAR_OK && l.mode == DPAR_LINEAR_FULL && l.b == NULL && l.bias_local == 0);
        CHECK(dpar_linear_destroy(&l) == DPAR_OK && l.w == NULL && counts.allocs == counts.frees);
        CHECK(dpar_linear_destroy(&l) == DPAR_OK && dpar_linear_destroy(NULL) == DPAR_OK);
    }
    memset(&d, 0, sizeof d);
    d.count = 10, d.lr = 0.1f;
    CHECK(dpar_zero_create(&d, &z) == DPAR_EINVAL && z == NULL); /* no comm */
    CHECK(dpar_zero_create(NULL, &z) == DPAR_EINVAL && z == NULL);
    CHECK(dpar_zero_destroy(NULL) == DPAR_OK);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_bad_input);
    RUN(test_shard_plans_cover_each_element_once);
    RUN(test_shard_scatter_gather_allgather);
    RUN(test_tensor_parallel_layers_match_whole_layer);
    RUN(test_leaves_same_bits_for_any_tp);
    RUN(test_layer_gradient_by_finite_differences);
    RUN(test_megatron_mlp_tp2_matches_tp1);
    RUN(test_zero1_matches_unsharded_optimizer);
    pools_free();
    return dt_summary();
}
