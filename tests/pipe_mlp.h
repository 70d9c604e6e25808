/* pipe_mlp.h - an 8-layer MLP trained two ways, for the pipeline tests (threads and MPI): all at once
   (the sequential reference) and split into p pipeline stages with m micro-batches of the same
   global batch. Layers 8 -> 16 -> ... -> 16 -> 4, ReLU between, mean squared error, SGD. Eight layers: a V schedule
   of 4 stages has 8 virtual stages. */
#ifndef DPAR_TEST_PIPE_MLP_H
#define DPAR_TEST_PIPE_MLP_H

#define PM_LAYERS 8
#define PM_BATCH 16
#define PM_WIDTH 16
#define PM_LR 0.1f
static const int pm_dims[PM_LAYERS + 1] = {8, PM_WIDTH, PM_WIDTH, PM_WIDTH, PM_WIDTH, PM_WIDTH, PM_WIDTH, PM_WIDTH, 4};

typedef struct pm_data {
    float w[PM_LAYERS][PM_WIDTH * PM_WIDTH], b[PM_LAYERS][PM_WIDTH]; /* the starting model */
    float x[PM_BATCH * 8], t[PM_BATCH * 4];
} pm_data;

static void pm_init(pm_data *d)
{
    unsigned long long s = 12345;
    int l, i;
    for (l = 0; l < PM_LAYERS; l++)
        for (i = 0; i < PM_WIDTH * PM_WIDTH; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            d->w[l][i] = (float)((double)(s >> 40) / 16777216.0 - 0.5) * 0.6f;
            if (i < PM_WIDTH) d->b[l][i] = (float)((double)((s >> 20) & 1023) / 1024.0 - 0.5) * 0.1f;
        }
    for (i = 0; i < PM_BATCH * 8; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        d->x[i] = (float)((double)(s >> 40) / 16777216.0 - 0.5) * 2.0f;
    }
    for (i = 0; i < PM_BATCH * 4; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        d->t[i] = (float)((double)(s >> 40) / 16777216.0 - 0.5);
    }
}

/* forward through layers [lo, hi) for `rows` rows: acts[l] is the input of layer l, pre[l] its
   output before the ReLU; returns the output */
static float *pm_forward(dpar_linear *L, int lo, int hi, const float *in, int rows, float (*acts)[PM_BATCH * PM_WIDTH],
                         float (*pre)[PM_BATCH * PM_WIDTH])
{
    int l, i;
    memcpy(acts[lo], in, (size_t)rows * (size_t)pm_dims[lo] * sizeof(float));
    for (l = lo; l < hi; l++) {
        float *out = l + 1 < hi ? acts[l + 1] : pre[l];
        dpar_linear_forward(&L[l], acts[l], pre[l], rows);
        if (l + 1 < hi)
            for (i = 0; i < rows * pm_dims[l + 1]; i++) out[i] = l < PM_LAYERS - 1 && pre[l][i] < 0 ? 0 : pre[l][i];
    }
    /* the stage's output after its last ReLU (none after the model's last layer) */
    if (hi - 1 < PM_LAYERS - 1)
        for (i = 0; i < rows * pm_dims[hi]; i++) pre[hi - 1][i] = pre[hi - 1][i] < 0 ? 0 : pre[hi - 1][i];
    return pre[hi - 1];
}

/* backward through layers [lo, hi): g is the gradient of the stage's output (after its ReLU);
   writes the gradient of its input to dx (NULL: not needed) */
static void pm_backward(dpar_linear *L, int lo, int hi, const float *g_in, float *dx, int rows,
                        float (*acts)[PM_BATCH * PM_WIDTH], float (*pre_relu)[PM_BATCH * PM_WIDTH])
{
    float g[PM_BATCH * PM_WIDTH], gx[PM_BATCH * PM_WIDTH];
    int l, i;
    memcpy(g, g_in, (size_t)rows * (size_t)pm_dims[hi] * sizeof(float));
    for (l = hi - 1; l >= lo; l--) {
        if (l < PM_LAYERS - 1) /* through the ReLU after layer l */
            for (i = 0; i < rows * pm_dims[l + 1]; i++)
                if (pre_relu[l][i] <= 0) g[i] = 0;
        dpar_linear_backward(&L[l], acts[l], g, (l > lo || dx) ? gx : NULL, rows);
        if (l > lo) memcpy(g, gx, (size_t)rows * (size_t)pm_dims[l] * sizeof(float));
        else if (dx) memcpy(dx, gx, (size_t)rows * (size_t)pm_dims[l] * sizeof(float));
    }
}

/* the backward split in two (zero-bubble schedules). B: the gradient of the stage's input, keeping each layer's
   output gradient (after its ReLU's mask) in gl for W; no parameter gradient. W: the parameter gradients from the
   inputs and the kept gradients, the same calls a whole backward makes (so the sums are the same bits) */
static void pm_backward_input(dpar_linear *L, int lo, int hi, const float *g_in, float *dx, int rows,
                              float (*acts)[PM_BATCH * PM_WIDTH], float (*pre_relu)[PM_BATCH * PM_WIDTH],
                              float (*gl)[PM_BATCH * PM_WIDTH])
{
    int l, i;
    memcpy(gl[hi - 1], g_in, (size_t)rows * (size_t)pm_dims[hi] * sizeof(float));
    for (l = hi - 1; l >= lo; l--) {
        float *g = gl[l];
        if (l < PM_LAYERS - 1)
            for (i = 0; i < rows * pm_dims[l + 1]; i++)
                if (pre_relu[l][i] <= 0) g[i] = 0;
        if (l > lo || dx) /* dx (rows, in) = g (rows, out) W^T, as dpar_linear_backward computes it */
            dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, rows, L[l].in, L[l].out, 1.0f, g, L[l].out, L[l].w, L[l].out, 0.0f,
                       l > lo ? gl[l - 1] : dx, L[l].in);
    }
    (void)acts;
}
static void pm_backward_weight(dpar_linear *L, int lo, int hi, int rows, float (*acts)[PM_BATCH * PM_WIDTH],
                               float (*gl)[PM_BATCH * PM_WIDTH])
{
    int l;
    for (l = hi - 1; l >= lo; l--) dpar_linear_backward(&L[l], acts[l], gl[l], NULL, rows);
}

static void pm_layers(dpar_linear *L, const pm_data *d, int lo, int hi)
{
    int l;
    dpar_linear_desc ld = {0};
    for (l = lo; l < hi; l++) {
        ld.in = pm_dims[l], ld.out = pm_dims[l + 1];
        dpar_linear_init(&L[l], &ld);
        dpar_linear_set_weights(&L[l], d->w[l], d->b[l]);
    }
}

static void pm_sgd(dpar_linear *L, int lo, int hi)
{
    int l, i;
    for (l = lo; l < hi; l++) {
        for (i = 0; i < L[l].in * L[l].out; i++) L[l].w[i] -= PM_LR * L[l].dw[i];
        for (i = 0; i < L[l].out; i++) L[l].b[i] -= PM_LR * L[l].db[i];
        dpar_linear_zero_grad(&L[l]);
    }
}

/* the sequential reference: `steps` steps on the whole batch; L gets the trained model */
static void pm_train_sequential(dpar_linear *L, const pm_data *d, int steps)
{
    static float acts[PM_LAYERS + 1][PM_BATCH * PM_WIDTH], pre[PM_LAYERS][PM_BATCH * PM_WIDTH];
    float dy[PM_BATCH * 4], *y;
    int s, i;
    pm_layers(L, d, 0, PM_LAYERS);
    for (s = 0; s < steps; s++) {
        y = pm_forward(L, 0, PM_LAYERS, d->x, PM_BATCH, acts, pre);
        for (i = 0; i < PM_BATCH * 4; i++) dy[i] = 2.0f * (y[i] - d->t[i]) / (PM_BATCH * 4);
        pm_backward(L, 0, PM_LAYERS, dy, NULL, PM_BATCH, acts, pre);
        pm_sgd(L, 0, PM_LAYERS);
    }
}

/* ---- one pipeline stage: layers [lo, hi) of the model, micro-batches of PM_BATCH / m rows ---- */
typedef struct pm_stage {
    const pm_data *d;
    const dpar_pipe_schedule *S;       /* where (stage, chunk) sits in the model (NULL: chunk * p + stage) */
    int stage, p, m, v, rows, fail_at; /* fail_at: the forward of this micro-batch fails (-1: none) */
    int lo, hi;                        /* the layers of chunk 0; chunk c: pm_range */
    dpar_linear L[PM_LAYERS];
    float acts[64][PM_LAYERS + 1][PM_BATCH * PM_WIDTH]; /* per (micro-batch, chunk): layer inputs */
    float pre[64][PM_LAYERS][PM_BATCH * PM_WIDTH];      /* and outputs */
    float gl[64][PM_LAYERS][PM_BATCH * PM_WIDTH];       /* split backward: each layer's output gradient, B to W */
} pm_stage;

/* the layers of (stage, chunk): its virtual stage of p * v (dpar_pipe_virtual_stage: interleaved or V) */
static void pm_range(const pm_stage *st, int chunk, int *lo, int *hi)
{
    int vs = st->S ? dpar_pipe_virtual_stage(st->S, st->stage, chunk) : chunk * st->p + st->stage, n = st->p * st->v;
    *lo = vs * PM_LAYERS / n;
    *hi = (vs + 1) * PM_LAYERS / n;
}

static dpar_status pm_stage_forward(void *user, int micro, int chunk, const void *in, void *out)
{
    pm_stage *st = (pm_stage *)user;
    const float *x = in ? (const float *)in : st->d->x + (size_t)micro * st->rows * 8;
    float *y;
    int lo, hi, u = micro * st->v + chunk;
    if (micro == st->fail_at) return dpar_set_error(DPAR_EUSER, "stage %d cannot do micro-batch %d", st->stage, micro);
    pm_range(st, chunk, &lo, &hi);
    y = pm_forward(st->L, lo, hi, x, st->rows, st->acts[u], st->pre[u]);
    if (out) memcpy(out, y, (size_t)st->rows * PM_WIDTH * sizeof(float));
    return DPAR_OK;
}

static dpar_status pm_stage_backward(void *user, int micro, int chunk, const void *in, const void *grad_out,
                                     void *grad_in)
{
    pm_stage *st = (pm_stage *)user;
    float dy[PM_BATCH * 4];
    int lo, hi, u = micro * st->v + chunk;
    (void)in; /* the stage stashed what it needs itself */
    pm_range(st, chunk, &lo, &hi);
    if (!grad_out) { /* the last stage: the loss's gradient, normalised by the whole batch */
        const float *y = st->pre[u][PM_LAYERS - 1], *t = st->d->t + (size_t)micro * st->rows * 4;
        int i;
        for (i = 0; i < st->rows * 4; i++) dy[i] = 2.0f * (y[i] - t[i]) / (PM_BATCH * 4);
        grad_out = dy;
    }
    pm_backward(st->L, lo, hi, (const float *)grad_out, (float *)grad_in, st->rows, st->acts[u], st->pre[u]);
    return DPAR_OK;
}

/* the split backward's two halves (zero-bubble schedules) */
static dpar_status pm_stage_backward_input(void *user, int micro, int chunk, const void *in, const void *grad_out,
                                           void *grad_in)
{
    pm_stage *st = (pm_stage *)user;
    float dy[PM_BATCH * 4];
    int lo, hi, u = micro * st->v + chunk;
    (void)in;
    pm_range(st, chunk, &lo, &hi);
    if (!grad_out) {
        const float *y = st->pre[u][PM_LAYERS - 1], *t = st->d->t + (size_t)micro * st->rows * 4;
        int i;
        for (i = 0; i < st->rows * 4; i++) dy[i] = 2.0f * (y[i] - t[i]) / (PM_BATCH * 4);
        grad_out = dy;
    }
    pm_backward_input(st->L, lo, hi, (const float *)grad_out, (float *)grad_in, st->rows, st->acts[u], st->pre[u],
                      st->gl[u]);
    return DPAR_OK;
}
static dpar_status pm_stage_backward_weight(void *user, int micro, int chunk, const void *in, const void *grad_out)
{
    pm_stage *st = (pm_stage *)user;
    int lo, hi, u = micro * st->v + chunk;
    (void)in, (void)grad_out; /* B kept what W needs */
    pm_range(st, chunk, &lo, &hi);
    pm_backward_weight(st->L, lo, hi, st->rows, st->acts[u], st->gl[u]);
    return DPAR_OK;
}

/* train `steps` steps as stage `stage` of a p-stage pipeline over comm; returns the status */
static dpar_status pm_train_stage(pm_stage *st, dpar_comm *comm, dpar_pipe_schedule *S, int steps,
                                  dpar_pipe_stats *stats)
{
    dpar_pipe_desc pd;
    dpar_pipe *pp;
    dpar_status rc = DPAR_OK;
    int s, c, lo, hi;
    st->S = S;
    st->p = S->p;
    st->m = S->m;
    st->v = S->v;
    st->stage = dpar_comm_rank(comm);
    pm_range(st, 0, &st->lo, &st->hi);
    st->rows = PM_BATCH / st->m;
    for (c = 0; c < st->v; c++) {
        pm_range(st, c, &lo, &hi);
        pm_layers(st->L, st->d, lo, hi);
    }
    memset(&pd, 0, sizeof pd);
    pd.schedule = S;
    pd.comm = comm;
    pd.act_bytes = (size_t)st->rows * PM_WIDTH * sizeof(float);
    pd.forward = pm_stage_forward;
    pd.backward = pm_stage_backward;
    pd.backward_input = pm_stage_backward_input;
    pd.backward_weight = pm_stage_backward_weight;
    pd.user = st;
    if ((rc = dpar_pipe_create(&pd, &pp)) != DPAR_OK) return rc;
    for (s = 0; s < steps && rc == DPAR_OK; s++) {
        rc = dpar_pipe_run(pp, stats);
        for (c = 0; c < st->v && rc == DPAR_OK; c++) {
            pm_range(st, c, &lo, &hi);
            pm_sgd(st->L, lo, hi);
        }
    }
    dpar_pipe_destroy(pp);
    return rc;
}

/* the stage's layers against the sequential model: the largest relative difference */
static double pm_compare(const pm_stage *st, const dpar_linear *ref)
{
    double worst = 0;
    int l, i, c, lo, hi;
    for (c = 0; c < st->v; c++)
        for (pm_range(st, c, &lo, &hi), l = lo; l < hi; l++) {
            for (i = 0; i < ref[l].in * ref[l].out; i++) {
                double a = st->L[l].w[i], b = ref[l].w[i], d = fabs(a - b) / (fabs(b) > 1e-3 ? fabs(b) : 1e-3);
                if (d > worst) worst = d;
            }
            for (i = 0; i < ref[l].out; i++) {
                double a = st->L[l].b[i], b = ref[l].b[i], d = fabs(a - b) / (fabs(b) > 1e-3 ? fabs(b) : 1e-3);
                if (d > worst) worst = d;
            }
        }
    return worst;
}

/* free the stage's layers */
static void pm_stage_free(pm_stage *st)
{
    int c, l, lo, hi;
    for (c = 0; c < st->v; c++)
        for (pm_range(st, c, &lo, &hi), l = lo; l < hi; l++) dpar_linear_destroy(&st->L[l]);
}
#endif
