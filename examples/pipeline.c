/* pipeline.c - an 8-layer MLP cut into pipeline stages on thread ranks, trained with the 1F1B schedule (or
   zero-bubble ZB-H1, ZB-V, DualPipeV, or GPipe).
   Build: cc -std=c99 -O2 -I. examples/pipeline.c -o pipeline -pthread -lm
   Run:   ./pipeline            (./pipeline --stages 2 --micro 16, ./pipeline --schedule zb-h1, --schedule zbv)
   Check: ^stage 0 +\|F0
   Check: ^bubble: predicted 0\.[0-9]+ .*measured [0-9.]+
   Check: ^bubble with the op costs measured here \(mean per op: F [0-9.]+ ms, backward .*\): predicted 0\.[0-9]+$
   Check: ^pipeline: 1F1B p=[0-9]+ m=[0-9]+ matches sequential training.*parameters bitwise equal, OK$

   Pipeline parallelism gives each rank (a stage) a contiguous run of layers; the activations flow
   forward from stage to stage and their gradients flow back. Run naively, one batch at a time, only
   one stage would work at a time. So the batch is cut into m micro-batches and the stages work on
   different micro-batches at once; the gradients of all micro-batches add up before the optimizer
   step, so the result is the same as training on the whole batch. The schedule says in which order
   each stage runs its forwards and backwards: 1F1B (PipeDream-flush) does p - s - 1 forwards on
   stage s to fill the pipe, then alternates one forward with one backward, so a stage never holds
   more than p stashed activations (GPipe holds all m). The idle time at the start and the end is the
   bubble, (p - 1) / (m + p - 1) of the run. dpar builds the schedule as data (printed below), and
   dpar_pipe runs it: it calls this program's forward and backward for each (micro-batch, chunk)
   and moves the activations over the comm. Each stage stashes its own layer inputs per micro-batch
   for the backward. At the end the program trains the same model on one thread, the same
   micro-batches one after another (gradient accumulation), and checks that the pipeline produced the
   same parameters: it does the same arithmetic in the same order, so they agree to the bit. (Against
   whole-batch steps they would agree only to rounding, since float sums in another order differ in
   the last bits, and over hundreds of steps of a deep ReLU network such differences grow.)

   --schedule zb-h1 splits each backward in two, as zero-bubble pipelines do: B, the gradient of the stage's input,
   which the previous stage is waiting for, and W, the gradients of the weights, which nothing needs before the
   optimizer step. B runs as soon as it can; W waits and fills time the stage would otherwise idle (ZB-H1: stage s
   runs each W s backwards later), which brings the bubble from (p - 1) / (m + p - 1) to (p - 1) / (3 m + p - 1)
   when F, B and W take the same time. B keeps each layer's output gradient for W; W makes the same
   dpar_linear_backward calls for the weights as a whole backward, in the same micro-batch order, so the
   parameters are still bitwise those of sequential training.

   --schedule zbv and --schedule dualpipev cut the model into 2p pieces and give each stage two of them, placed as a
   V: stage s holds piece s and piece 2p - 1 - s (dpar_pipe_virtual_stage says which), so the activations go down
   the stages and come back up, the last stage hands its first piece's output to its second piece itself, and the
   loss is on stage 0. Each stage then waits only p - 1 half-stage forwards at the start, and the B's and W's of
   its two pieces fill the rest: the bubble falls to (p - 1) / (6 m + p - 1) with F = B = W (per piece). ZB-V holds
   at most 2p pieces' activations (1F1B's memory), DualPipeV (DeepSeek's order, m >= 2p) 2p + 1.

   The schedule's bubble is predicted with F = B = W (a whole backward 2). The stages time their callbacks, and at
   the end the same schedule is simulated again with the mean times they measured (dpar_pipe_schedule_check with
   the schedule's cost[]): that prediction is what these stages, on this machine, could reach at best. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LAYERS 8
#define IN 8
#define H 128 /* hidden width: every activation crossing a stage boundary is (rows x H) */
#define OUT 4
#define B 64 /* the global batch */
#define MAX_STEPS 200
#define LR 0.05f
static const int dims[LAYERS + 1] = {IN, H, H, H, H, H, H, H, OUT};

typedef struct job job;
typedef struct stage { /* one stage: layers [lo[c], hi[c]) of each of its chunks, micro-batches of `rows` rows */
    const job *j;
    int lo[2], hi[2], chunks, m, rows;
    dpar_linear L[LAYERS];
    float *acts, *pre, *g, *gx; /* per micro-batch: each layer's input and its output before the ReLU */
    float *grads;               /* --schedule zb-h1, per micro-batch: each layer's output gradient (B to W) */
    double loss;                /* the last stage: the loss summed over the step's micro-batches */
    double op_ms[3];            /* time in forwards, backwards (or B), W's from the second step on */
    long ops[3];                /* how many */
} stage;

struct job {
    int p, m, steps;
    float w[LAYERS][H * H], b[LAYERS][H]; /* the starting model */
    float x[B * IN], t[B * OUT];
    float loss[MAX_STEPS];
    double bubble_sum;
    dpar_pipe_stats stats;
    dpar_pipe_schedule *S;
    dpar_group *group;
    stage *stages;
};

static float *act(stage *st, int micro, int l) { return st->acts + ((size_t)micro * (LAYERS + 1) + l) * st->rows * H; }
static float *pre(stage *st, int micro, int l) { return st->pre + ((size_t)micro * LAYERS + l) * st->rows * H; }
static float *grad(stage *st, int micro, int l) { return st->grads + ((size_t)micro * LAYERS + l) * st->rows * H; }

/* a stage of `chunks` chunks: chunk c holds layers [lo[c], hi[c]) */
static dpar_status stage_init(stage *st, const job *j, int chunks, const int *lo, const int *hi, int m)
{
    dpar_status rc;
    dpar_linear_desc ld = {0}; /* FULL layers with a bias */
    int l, c;
    memset(st, 0, sizeof *st);
    st->j = j;
    st->chunks = chunks;
    for (c = 0; c < chunks; c++) {
        st->lo[c] = lo[c];
        st->hi[c] = hi[c];
    }
    st->m = m;
    st->rows = B / m;
    st->acts = (float *)calloc((size_t)m * (LAYERS + 1) * st->rows * H, sizeof(float));
    st->grads = (float *)calloc((size_t)m * LAYERS * st->rows * H, sizeof(float));
    st->pre = (float *)calloc((size_t)m * LAYERS * st->rows * H, sizeof(float));
    st->g = (float *)calloc((size_t)st->rows * H * 2, sizeof(float));
    st->gx = st->g + st->rows * H;
    if (!st->acts || !st->pre || !st->g || !st->grads) return dpar_set_error(DPAR_ENOMEM, "stage_init: out of memory");
    for (c = 0; c < chunks; c++)
        for (l = lo[c]; l < hi[c]; l++) {
            ld.in = dims[l], ld.out = dims[l + 1];
            if ((rc = dpar_linear_init(&st->L[l], &ld)) != DPAR_OK) return rc;
            if ((rc = dpar_linear_set_weights(&st->L[l], j->w[l], j->b[l])) != DPAR_OK) return rc;
        }
    return DPAR_OK;
}

static void stage_free(stage *st)
{
    int l, c;
    for (c = 0; c < st->chunks; c++)
        for (l = st->lo[c]; l < st->hi[c]; l++) dpar_linear_destroy(&st->L[l]);
    free(st->acts);
    free(st->grads);
    free(st->pre);
    free(st->g);
}

/* forward of one micro-batch through my layers; `in` NULL: read the batch; `out` NULL: the loss */
static dpar_status stage_forward(void *user, int micro, int chunk, const void *in, void *out)
{
    stage *st = (stage *)user;
    const float *x = in ? (const float *)in : st->j->x + (size_t)micro * st->rows * IN;
    int lo = st->lo[chunk], hi = st->hi[chunk]; /* this chunk's layers */
    int l, i, n = st->rows * dims[hi];
    dpar_status rc;
    memcpy(act(st, micro, lo), x, (size_t)st->rows * dims[lo] * sizeof(float));
    for (l = lo; l < hi; l++) {
        if ((rc = dpar_linear_forward(&st->L[l], act(st, micro, l), pre(st, micro, l), st->rows)) != DPAR_OK) return rc;
        if (l < LAYERS - 1) /* ReLU between layers: the next layer's input */
            for (i = 0; i < st->rows * dims[l + 1]; i++) act(st, micro, l + 1)[i] = fmaxf(pre(st, micro, l)[i], 0.0f);
    }
    if (out) memcpy(out, act(st, micro, hi), (size_t)n * sizeof(float));
    else { /* the last stage: mean squared error against this micro-batch's targets */
        const float *y = pre(st, micro, LAYERS - 1), *t = st->j->t + (size_t)micro * st->rows * OUT;
        for (i = 0; i < n; i++) st->loss += (double)(y[i] - t[i]) * (y[i] - t[i]);
    }
    return DPAR_OK;
}

/* backward of one micro-batch: parameter gradients add up (+=) over the micro-batches */
static dpar_status stage_backward(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    stage *st = (stage *)user;
    int lo = st->lo[chunk], hi = st->hi[chunk];
    int l, i;
    dpar_status rc;
    (void)in; /* the stage stashed every layer's input itself */
    if (grad_out) memcpy(st->g, grad_out, (size_t)st->rows * H * sizeof(float));
    else { /* the last stage: d loss / d y, normalised by the whole batch so micro-batches add up to it */
        const float *y = pre(st, micro, LAYERS - 1), *t = st->j->t + (size_t)micro * st->rows * OUT;
        for (i = 0; i < st->rows * OUT; i++) st->g[i] = 2.0f * (y[i] - t[i]) / (B * OUT);
    }
    for (l = hi - 1; l >= lo; l--) {
        float *dx = l > lo ? st->gx : (float *)grad_in; /* NULL on the first stage: not needed */
        if (l < LAYERS - 1)                             /* through the ReLU after layer l */
            for (i = 0; i < st->rows * dims[l + 1]; i++)
                if (pre(st, micro, l)[i] <= 0) st->g[i] = 0;
        if ((rc = dpar_linear_backward(&st->L[l], act(st, micro, l), st->g, dx, st->rows)) != DPAR_OK) return rc;
        if (l > lo) memcpy(st->g, st->gx, (size_t)st->rows * dims[l] * sizeof(float));
    }
    return DPAR_OK;
}

/* zero bubble's B: the gradient of the stage's input only; each layer's output gradient is kept for W */
static dpar_status stage_backward_input(void *user, int micro, int chunk, const void *in, const void *grad_out,
                                        void *grad_in)
{
    stage *st = (stage *)user;
    int lo = st->lo[chunk], hi = st->hi[chunk];
    int l, i;
    float *g = grad(st, micro, hi - 1);
    (void)in;
    if (grad_out) memcpy(g, grad_out, (size_t)st->rows * H * sizeof(float));
    else { /* the last stage: d loss / d y, as in stage_backward */
        const float *y = pre(st, micro, LAYERS - 1), *t = st->j->t + (size_t)micro * st->rows * OUT;
        for (i = 0; i < st->rows * OUT; i++) g[i] = 2.0f * (y[i] - t[i]) / (B * OUT);
    }
    for (l = hi - 1; l >= lo; l--) {
        float *out_grad = grad(st, micro, l);
        float *dx = l > lo ? grad(st, micro, l - 1) : (float *)grad_in; /* NULL on the first stage */
        if (l < LAYERS - 1)                                             /* through the ReLU after layer l */
            for (i = 0; i < st->rows * dims[l + 1]; i++)
                if (pre(st, micro, l)[i] <= 0) out_grad[i] = 0;
        if (dx) { /* dx = out_grad W^T: the product dpar_linear_backward makes */
            dpar_status rc = dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, st->rows, dims[l], dims[l + 1], 1.0f, out_grad,
                                        dims[l + 1], st->L[l].w, dims[l + 1], 0.0f, dx, dims[l]);
            if (rc != DPAR_OK) return rc;
        }
    }
    return DPAR_OK;
}

/* zero bubble's W: the weights' gradients from the kept inputs and output gradients (+= over micro-batches) */
static dpar_status stage_backward_weight(void *user, int micro, int chunk, const void *in, const void *grad_out)
{
    stage *st = (stage *)user;
    int lo = st->lo[chunk], hi = st->hi[chunk];
    int l;
    (void)in;
    (void)grad_out; /* B kept what W needs */
    for (l = hi - 1; l >= lo; l--) {
        dpar_status rc = dpar_linear_backward(&st->L[l], act(st, micro, l), grad(st, micro, l), NULL, st->rows);
        if (rc != DPAR_OK) return rc;
    }
    return DPAR_OK;
}

/* the callbacks the runner calls: the ones above, each timed (its kind's total time and count), so that the
   schedule's bubble can be predicted again with the op costs these stages really have */
static void count_op(stage *st, int kind, uint64_t start)
{
    st->op_ms[kind] += (double)(dpar_time_ns() - start) * 1e-6;
    st->ops[kind]++;
}
static dpar_status timed_forward(void *user, int micro, int chunk, const void *in, void *out)
{
    uint64_t start = dpar_time_ns();
    dpar_status rc = stage_forward(user, micro, chunk, in, out);
    count_op((stage *)user, 0, start);
    return rc;
}
static dpar_status timed_backward(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    uint64_t start = dpar_time_ns();
    dpar_status rc = stage_backward(user, micro, chunk, in, grad_out, grad_in);
    count_op((stage *)user, 1, start);
    return rc;
}
static dpar_status timed_backward_input(void *user, int micro, int chunk, const void *in, const void *grad_out,
                                        void *grad_in)
{
    uint64_t start = dpar_time_ns();
    dpar_status rc = stage_backward_input(user, micro, chunk, in, grad_out, grad_in);
    count_op((stage *)user, 1, start);
    return rc;
}
static dpar_status timed_backward_weight(void *user, int micro, int chunk, const void *in, const void *grad_out)
{
    uint64_t start = dpar_time_ns();
    dpar_status rc = stage_backward_weight(user, micro, chunk, in, grad_out);
    count_op((stage *)user, 2, start);
    return rc;
}

static void stage_sgd(stage *st)
{
    int l, i, c;
    for (c = 0; c < st->chunks; c++)
        for (l = st->lo[c]; l < st->hi[c]; l++) {
            for (i = 0; i < dims[l] * dims[l + 1]; i++) st->L[l].w[i] -= LR * st->L[l].dw[i];
            for (i = 0; i < dims[l + 1]; i++) st->L[l].b[i] -= LR * st->L[l].db[i];
            dpar_linear_zero_grad(&st->L[l]);
        }
}

static dpar_status rank_main(void *user, int rank, int n)
{
    job *j = (job *)user;
    stage *st = &j->stages[rank];
    dpar_comm *c = NULL;
    dpar_pipe *pipe = NULL;
    dpar_pipe_desc pd;
    dpar_pipe_stats ps;
    dpar_status rc;
    int step, chunk, lo[2], hi[2];
    int pieces = n * j->S->v; /* the model in p v pieces (virtual stages) of LAYERS / (p v) layers */
    int has_loss = dpar_pipe_virtual_stage(j->S, rank, j->S->v - 1) == pieces - 1; /* the last piece is mine */
    if ((rc = dpar_group_join(j->group, rank, &c)) != DPAR_OK) {
        fprintf(stderr, "stage %d: dpar_group_join: %s\n", rank, dpar_last_error());
        return rc;
    }
    for (chunk = 0; chunk < j->S->v; chunk++) { /* which piece each of my chunks is */
        int piece = dpar_pipe_virtual_stage(j->S, rank, chunk);
        lo[chunk] = piece * LAYERS / pieces;
        hi[chunk] = (piece + 1) * LAYERS / pieces;
    }
    rc = stage_init(st, j, j->S->v, lo, hi, j->m);
    memset(&pd, 0, sizeof pd);
    pd.schedule = j->S;
    pd.comm = c;
    pd.act_bytes = (size_t)st->rows * H * sizeof(float);
    pd.forward = timed_forward;
    pd.backward = timed_backward;
    pd.backward_input = timed_backward_input;
    pd.backward_weight = timed_backward_weight;
    pd.user = st;
    if (rc == DPAR_OK) rc = dpar_pipe_create(&pd, &pipe);
    for (step = 0; step < j->steps && rc == DPAR_OK; step++) {
        st->loss = 0;
        if (step == 1) { /* the op costs from the second step on: the first one also allocates the buffers */
            memset(st->op_ms, 0, sizeof st->op_ms);
            memset(st->ops, 0, sizeof st->ops);
        }
        if ((rc = dpar_pipe_run(pipe, &ps)) != DPAR_OK) break; /* every op of this stage, in order */
        stage_sgd(st);                                         /* all m micro-batches have added up */
        if (has_loss) j->loss[step] = (float)(st->loss / (B * OUT));
        if (rank == 0 && step > 0) j->bubble_sum += ps.measured_bubble; /* step 0 warms the buffers up */
        if (rank == 0) j->stats = ps;
    }
    if (rc != DPAR_OK) {
        fprintf(stderr, "stage %d: %s\n", rank, dpar_last_error());
        dpar_comm_abort(c);
    }
    dpar_pipe_destroy(pipe);
    dpar_comm_destroy(c);
    return rc;
}

static double rel_diff(const float *a, const float *b, int n) /* max |a - b| / max |b| */
{
    double num = 0, den = 0;
    int i;
    for (i = 0; i < n; i++) {
        if (fabs((double)a[i] - b[i]) > num) num = fabs((double)a[i] - b[i]);
        if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
    }
    return den > 0 ? num / den : num;
}

int main(int argc, char **argv)
{
    static job j;
    stage ref;
    dpar_pool_desc pd;
    dpar_comm_desc cd;
    dpar_pipe_schedule_desc sd = {0};
    dpar_pool *pool = NULL;
    dpar_status rc;
    char *text, how[64];
    size_t len;
    double worst = 0, seq_loss = 0, d;
    int i, k, l, r, s, ok, cpus, c, whole_lo = 0, whole_hi = LAYERS;
    unsigned long long seed = 7;
    const char *schedule_name = "1F1B";
    dpar_pipe_kind kind = DPAR_PIPE_1F1B;
    j.p = 4;
    j.m = 8;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--stages") && i + 1 < argc) j.p = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--micro") && i + 1 < argc) j.m = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--schedule") && i + 1 < argc) {
            const char *name = argv[++i];
            if (!strcmp(name, "1f1b")) {
                kind = DPAR_PIPE_1F1B;
                schedule_name = "1F1B";
            } else if (!strcmp(name, "zb-h1")) {
                kind = DPAR_PIPE_ZB_H1;
                schedule_name = "ZB-H1";
            } else if (!strcmp(name, "zbv")) {
                kind = DPAR_PIPE_ZBV;
                schedule_name = "ZB-V";
            } else if (!strcmp(name, "dualpipev")) {
                kind = DPAR_PIPE_DUALPIPEV;
                schedule_name = "DualPipeV";
            } else if (!strcmp(name, "gpipe")) {
                kind = DPAR_PIPE_GPIPE;
                schedule_name = "GPipe";
            } else {
                fprintf(stderr, "pipeline: --schedule '%s': it takes 1f1b, zb-h1, zbv, dualpipev or gpipe\n", name);
                return 2;
            }
        } else {
            fprintf(stderr, "usage: %s [--stages P] [--micro M] [--schedule 1f1b|zb-h1|zbv|dualpipev|gpipe]\n",
                    argv[0]);
            return 2;
        }
    }
    if (j.p < 1 || j.p > LAYERS || j.m < 1 || j.m > B || B % j.m) {
        fprintf(stderr, "pipeline: --stages must be 1..%d and --micro divide the batch of %d\n", LAYERS, B);
        return 2;
    }
    if ((kind == DPAR_PIPE_ZBV || kind == DPAR_PIPE_DUALPIPEV) && 2 * j.p > LAYERS) {
        fprintf(stderr, "pipeline: a V schedule cuts the %d layers into 2p pieces: --stages 1..%d\n", LAYERS,
                LAYERS / 2);
        return 2;
    }
    j.steps = getenv("DPAR_TEST_QUICK") ? 40 : MAX_STEPS;

    /* the model (uniform, scaled by sqrt(6 / fan-in)) and the task: t = sin(3 x_k) x_{k+4} */
    for (l = 0; l < LAYERS; l++)
        for (i = 0; i < dims[l] * dims[l + 1]; i++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            j.w[l][i] = (float)(((double)(seed >> 40) / 16777216.0 * 2 - 1) * sqrt(6.0 / dims[l]));
        }
    for (i = 0; i < B * IN; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        j.x[i] = (float)((double)(seed >> 40) / 16777216.0 * 2 - 1);
    }
    for (i = 0; i < B; i++)
        for (k = 0; k < OUT; k++) j.t[i * OUT + k] = sinf(3.0f * j.x[i * IN + k]) * j.x[i * IN + k + 4];

    sd.kind = kind, sd.p = j.p, sd.m = j.m;
    if ((rc = dpar_pipe_schedule_create(&sd, &j.S)) != DPAR_OK) {
        fprintf(stderr, "pipeline: %s\n", dpar_last_error());
        return 1;
    }
    len = dpar_pipe_schedule_format(j.S, NULL, 0) + 1; /* like snprintf: first ask for the length */
    if ((text = (char *)malloc(len)) != NULL) {
        dpar_pipe_schedule_format(j.S, text, len);
        printf("pipeline: %d layers on %d stages, batch %d in %d micro-batches of %d rows; the schedule "
               "(F = forward, B = backward%s, . = idle):\n%s",
               LAYERS, j.p, B, j.m, B / j.m, kind >= DPAR_PIPE_ZB_H1 ? " (its input half), W = weight gradients" : "",
               text);
        if (j.S->v == 2)
            printf("(a and b: each stage's two chunks; stage s holds pieces %s of the model's %d)\n",
                   kind == DPAR_PIPE_INTERLEAVED ? "s and p + s" : "s and 2p - 1 - s", 2 * j.p);
        free(text);
    }

    /* the pipeline: one thread rank per stage */
    j.stages = (stage *)calloc((size_t)j.p, sizeof(stage));
    memset(&pd, 0, sizeof pd);
    memset(&cd, 0, sizeof cd);
    pd.num_threads = cd.size = j.p;
    if (!j.stages) rc = dpar_set_error(DPAR_ENOMEM, "out of memory");
    else if ((rc = dpar_pool_create(&pd, &pool)) == DPAR_OK && (rc = dpar_group_create(&cd, &j.group)) == DPAR_OK)
        rc = dpar_pool_run(pool, rank_main, &j);
    if (rc != DPAR_OK) {
        fprintf(stderr, "pipeline: %s\n", dpar_last_error());
        return 1;
    }
    dpar_group_destroy(j.group);
    dpar_pool_destroy(pool);

    /* the reference: the whole model on this thread, the same micro-batches one after another
       (gradient accumulation): the same arithmetic in the same order, without the overlap */
    if ((rc = stage_init(&ref, &j, 1, &whole_lo, &whole_hi, j.m)) != DPAR_OK) {
        fprintf(stderr, "pipeline: %s\n", dpar_last_error());
        return 1;
    }
    for (s = 0; s < j.steps; s++) {
        ref.loss = 0;
        for (k = 0; k < j.m && rc == DPAR_OK; k++) rc = stage_forward(&ref, k, 0, NULL, NULL);
        for (k = 0; k < j.m && rc == DPAR_OK; k++) rc = stage_backward(&ref, k, 0, NULL, NULL, NULL);
        if (rc != DPAR_OK) {
            fprintf(stderr, "pipeline: %s\n", dpar_last_error());
            return 1;
        }
        stage_sgd(&ref);
        seq_loss = ref.loss / (B * OUT);
        if (s % (j.steps / 5) == 0 || s == j.steps - 1) printf("step %3d  loss %.6f\n", s, j.loss[s]);
    }
    for (r = 0; r < j.p; r++) {
        stage *st = &j.stages[r];
        for (c = 0; c < st->chunks; c++)
            for (l = st->lo[c]; l < st->hi[c]; l++) {
                if ((d = rel_diff(st->L[l].w, ref.L[l].w, dims[l] * dims[l + 1])) > worst) worst = d;
                if ((d = rel_diff(st->L[l].b, ref.L[l].b, dims[l + 1])) > worst) worst = d;
            }
        stage_free(st);
    }
    stage_free(&ref);
    cpus = (int)sysconf(_SC_NPROCESSORS_ONLN);
    printf("bubble: predicted %.3f (the schedule, simulated), measured %.3f (mean of %d steps): the measured one "
           "also counts the stages' messages",
           j.stats.predicted_bubble, j.steps > 1 ? j.bubble_sum / (j.steps - 1) : 0.0, j.steps - 1);
    if (cpus > 0 && cpus < j.p)
        printf(", and with %d stages on %d CPUs at most %d compute at once (at least %.3f idle)", j.p, cpus, cpus,
               1.0 - (double)cpus / j.p);
    printf("\n");
    { /* the same schedule simulated again with the op costs these stages measured (the mean per op over them) */
        double total_ms[3] = {0, 0, 0};
        long count[3] = {0, 0, 0};
        double forward_ms, backward_ms, weight_ms;
        int split;
        for (r = 0; r < j.p; r++)
            for (k = 0; k < 3; k++) {
                total_ms[k] += j.stages[r].op_ms[k];
                count[k] += j.stages[r].ops[k];
            }
        split = count[2] > 0; /* B and W apart, or whole backwards */
        forward_ms = count[0] ? total_ms[0] / count[0] : 0;
        backward_ms = count[1] ? total_ms[1] / count[1] : 0;
        weight_ms = split ? total_ms[2] / count[2] : 0;
        j.S->cost[0] = forward_ms;
        j.S->cost[1] = split ? backward_ms : backward_ms / 2; /* the simulation runs a whole backward as B + W */
        j.S->cost[2] = split ? weight_ms : backward_ms / 2;
        if (forward_ms > 0 && backward_ms > 0 && dpar_pipe_schedule_check(j.S) == DPAR_OK) {
            printf("bubble with the op costs measured here (mean per op: F %.3f ms, %s %.3f ms", forward_ms,
                   split ? "B" : "backward", backward_ms);
            if (split) printf(", W %.3f ms", weight_ms);
            printf("): predicted %.3f\n", j.S->bubble);
        }
    }
    snprintf(how, sizeof how, worst == 0 ? "bitwise equal" : "within %.1e (relative)", worst);
    ok = worst == 0 && j.loss[j.steps - 1] < 0.5f * j.loss[0]; /* the gate is what the line claims: bitwise */
    printf("pipeline: %s p=%d m=%d %s sequential training: loss %.6f -> %.6f (sequential %.6f), parameters "
           "%s, %s\n",
           schedule_name, j.p, j.m, ok ? "matches" : "DOES NOT MATCH", j.loss[0], j.loss[j.steps - 1], seq_loss, how,
           ok ? "OK" : "FAILED");
    free(j.stages);
    dpar_pipe_schedule_destroy(j.S);
    return ok ? 0 : 1;
}
