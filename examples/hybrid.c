/* hybrid.c - 3D parallelism: data x tensor x pipeline parallel training on a 2 x 2 x 2 mesh of 8 thread ranks.
   Build: cc -std=c99 -O2 -I. examples/hybrid.c -o hybrid -pthread -lm
   Run:   ./hybrid                     (./hybrid --bitwise, ./hybrid --zero 3 [--gather step|micro])
   Check: ^ +7 +1 +1 +1
   Check: ^hybrid: dp=2 tp=2 pp=2, .*replicas bitwise identical, within .* of one-thread training, OK

   The 8 ranks form a mesh (Megatron's order, dpar_mesh_init): world rank = (pp * 2 + dp) * 2 + tp.
   The model is two Megatron MLP blocks (column-parallel, GeLU, row-parallel); pipeline parallelism
   puts block 1 on stage 0 and block 2 on stage 1 (dpar_pipe, 1F1B, over mesh.pp_comm); tensor
   parallelism cuts each block over the 2 ranks of mesh.tp_comm (one allreduce forward, one
   backward); and the pipeline exists twice, one per data-parallel replica, each on its half of
   every batch, so after backward each rank averages its gradients with its twin in the other
   replica (dpar_allreduce over mesh.dp_comm). tp partners talk every micro-batch, pp partners pass
   activations, dp partners meet once per step. At the end the replicas must be bitwise identical
   (the MIN and the MAX of every parameter over the dp comm agree), and every rank's slices must
   equal, to rounding, the same model trained on one thread on the whole batch.

   --bitwise: the same bits for every layout. The global batch is 8 fixed leaves of 4 rows (the
   micro-batches: replica d of dp runs leaves d*8/dp .. (d+1)*8/dp - 1 through its pipeline), each
   leaf's weight gradients kept apart, then added in dpar_tree_reduce's fixed tree: over a replica's
   own leaves on the rank, then across the replicas by the deterministic allreduce (a power-of-two dp
   dividing 8: each replica's leaves are one node of the tree over all 8, and the allreduce finishes
   that tree), divided by 8; every layer has desc.leaves = 8, so each sum over a dimension that tp
   cuts is 8 fixed partial products added in the same tree whatever tp is. It trains every layout
   dp x tp x pp of 8 ranks the model allows (pp 1 or 2 dividing the 2 blocks, tp 1, 2, 4, 8 dividing
   the widths and tp * pp <= 8) and the same leaves on one thread (whole layers, no comm, no
   pipeline), and checks with memcmp that every layout ends with the one thread's weights and had
   its loss at every step; it prints one line per layout and exits 1 on any difference.
   --zero 3: the 2 x 2 x 2 mesh with ZeRO-3 over the data-parallel comm: each rank's tp slice of its
   stage's block is a dpar_fsdp unit sharded over mesh.dp_comm (desc.leaves = 8, the same leaves),
   gathered once per step (--gather step: before the pipeline runs, released after) or per
   micro-batch (--gather micro: before each forward and each backward of the block), its leaves'
   gradients reduce-scattered once per step after the pipeline's last backward, then the sharded
   SGD step. Both gathers (the default runs both) must end bitwise with the one thread's weights;
   each prints what it moved over the dp comm and its time per step. --bitwise --zero 3 runs every
   layout so. --steps N: 2 to 300 (default 300, the bitwise modes 100; 60 with DPAR_TEST_QUICK). */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DP 2 /* the default layout */
#define TP 2
#define PP 2
#define NB 2  /* blocks */
#define D 16  /* width between the blocks */
#define F 32  /* hidden width of a block */
#define GB 32 /* the global batch; a replica's half is LB rows */
#define LB (GB / DP)
#define M 4 /* micro-batches per replica, of ROWS rows */
#define ROWS (LB / M)
#define NLEAF (GB / ROWS) /* the bitwise modes: the batch's leaves (the micro-batches) and each layer's leaves */
#define UNIT (D * F + F + F * D + D) /* a block's parameters at most: its W1, b1, W2, b2 */
#define MAX_STEPS 300
#define LR 0.5f
#define RANKS (DP * TP * PP)

typedef struct result { /* one layout's run, as main compares them */
    float w1[NB][D * F], b1[NB][F], w2[NB][F * D], b2[NB][D];
    float loss[MAX_STEPS];
} result;

typedef struct job {
    int steps, dp, tp, pp, leaves, zero, gather_micro;        /* the layout; leaves: NLEAF or 0; zero: 0 or 3 */
    float w1[NB][D * F], b1[NB][F], w2[NB][F * D], b2[NB][D]; /* the starting model, two blocks */
    float x[GB * D], t[GB * D];
    result *out;                            /* the layout's weights (written by replica 0) and losses */
    int coords[RANKS][3], identical[RANKS]; /* per world rank: dp, tp, pp; replicas agree */
    double diff[RANKS], per_step[RANKS][3]; /* vs one thread; tp, pp, dp messages per step */
    double moved[RANKS][2], step_us[RANKS]; /* per step: bytes sent over the dp comm (gathers, reductions), us */
    dpar_group *group;
    struct rank_state *ref; /* the model trained on one thread */
} job;

typedef struct rank_state { /* one rank: its slice of its stage's blocks */
    job *j;
    dpar_mesh mesh;
    int nb, first, m; /* my stage's blocks: first .. first + nb - 1; micro-batches per replica */
    dpar_linear up[NB], down[NB];
    float *own[NB][4]; /* --zero 3: the layers' own w and b, put back before destroy */
    dpar_fsdp *fsdp;   /* --zero 3: one unit per block of my stage, sharded over mesh.dp_comm */
    float xs[NB][NLEAF][ROWS * D], h[NB][NLEAF][ROWS * F], a[NB][NLEAF][ROWS * F], y[NLEAF][ROWS * D];
    float dy[ROWS * D], da[ROWS * F];
    float leaf[NB][NLEAF][UNIT]; /* the bitwise modes: each leaf's gradients of a block, kept apart */
    double loss, leaf_loss[NLEAF];
} rank_state;

static float gelu(float v) { return 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v))); }
static float gelu_grad(float v)
{
    float th = tanhf(0.7978845608f * (v + 0.044715f * v * v * v));
    return 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * v * v);
}

static float urand(unsigned long long *s) /* uniform in [-1, 1) */
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 40) / 8388608.0 - 1.0);
}

/* my replica's rows of the global batch, micro-batch `micro` (a leaf: replica d runs leaves d * m .. d * m + m - 1) */
static size_t first_row(const rank_state *r, int micro)
{
    return ((size_t)r->mesh.dp_rank * (size_t)r->m + (size_t)micro) * ROWS;
}

/* a block's parameters (or gradients) as one flat array: W1, b1, W2, b2 of my slice; returns the count */
static size_t unit_count(const rank_state *r, int b)
{
    const dpar_linear *u = &r->up[b], *d = &r->down[b];
    return (size_t)u->in_local * u->out_local + u->bias_local + (size_t)d->in_local * d->out_local + d->bias_local;
}

/* copy my slice of block b's gradients (grads 1) or parameters (grads 0) into (to 1) or out of (to 0) flat */
static void flat_copy(rank_state *r, int b, float *flat, int grads, int to)
{
    dpar_linear *l[2] = {&r->up[b], &r->down[b]};
    size_t at = 0, n;
    int k, q;
    for (k = 0; k < 2; k++)
        for (q = 0; q < 2; q++) {
            float *p = q ? (grads ? l[k]->db : l[k]->b) : (grads ? l[k]->dw : l[k]->w);
            n = q ? (size_t)l[k]->bias_local : (size_t)l[k]->in_local * l[k]->out_local;
            if (to) memcpy(flat + at, p, n * sizeof(float));
            else memcpy(p, flat + at, n * sizeof(float));
            at += n;
        }
}

/* --zero 3: block b's layers read the gathered unit (views into dpar_fsdp's buffer) until put_back */
static dpar_status gather(rank_state *r, int b)
{
    float *p;
    dpar_status st;
    if ((st = dpar_fsdp_gather(r->fsdp, b, &p)) != DPAR_OK) return st;
    r->up[b].w = p;
    p += r->up[b].in_local * r->up[b].out_local;
    r->up[b].b = p;
    p += r->up[b].bias_local;
    r->down[b].w = p;
    p += r->down[b].in_local * r->down[b].out_local;
    r->down[b].b = p;
    return DPAR_OK;
}
static dpar_status put_back(rank_state *r, int b)
{
    r->up[b].w = r->up[b].b = r->down[b].w = r->down[b].b = NULL; /* a forward without a gather fails */
    return dpar_fsdp_release(r->fsdp, b);
}

static dpar_status fwd(void *user, int micro, int chunk, const void *in, void *out)
{
    rank_state *r = (rank_state *)user;
    int i, b, f, per_micro = r->fsdp && r->j->gather_micro;
    dpar_status st;
    (void)chunk;
    memcpy(r->xs[0][micro], in ? (const float *)in : r->j->x + first_row(r, micro) * D, sizeof r->xs[0][micro]);
    for (b = 0; b < r->nb; b++) { /* my stage's blocks, in order: block b's output is block b + 1's input */
        f = r->up[b].out_local;
        if (per_micro && (st = gather(r, b)) != DPAR_OK) return st;
        if ((st = dpar_linear_forward(&r->up[b], r->xs[b][micro], r->h[b][micro], ROWS)) != DPAR_OK) return st;
        for (i = 0; i < ROWS * f; i++) r->a[b][micro][i] = gelu(r->h[b][micro][i]);
        /* the row layer: a tp allreduce (with leaves: an all-gather of the leaves' partials) */
        st = dpar_linear_forward(&r->down[b], r->a[b][micro], b + 1 < r->nb ? r->xs[b + 1][micro] : r->y[micro], ROWS);
        if (st != DPAR_OK || (per_micro && (st = put_back(r, b)) != DPAR_OK)) return st;
    }
    if (out) memcpy(out, r->y[micro], sizeof r->y[micro]); /* to the next stage */
    else {
        const float *t = r->j->t + first_row(r, micro) * D;
        double sum = 0;
        for (i = 0; i < ROWS * D; i++) sum += (double)(r->y[micro][i] - t[i]) * (r->y[micro][i] - t[i]);
        if (r->j->leaves) r->leaf_loss[micro] = sum / (ROWS * D); /* the leaf's mean */
        else r->loss += sum;
    }
    return DPAR_OK;
}

static dpar_status bwd(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    rank_state *r = (rank_state *)user;
    int i, b, f, leaves = r->j->leaves, per_micro = r->fsdp && r->j->gather_micro;
    dpar_status st;
    (void)chunk;
    (void)in;
    if (grad_out) memcpy(r->dy, grad_out, sizeof r->dy);
    else { /* the loss. Default: the mean over my replica's half, the dp average makes it the global mean.
              Leaves: the leaf's mean, the average over the leaves makes it the global mean. */
        const float *t = r->j->t + first_row(r, micro) * D;
        int norm = leaves ? ROWS * D : LB * D;
        for (i = 0; i < ROWS * D; i++) r->dy[i] = 2.0f * (r->y[micro][i] - t[i]) / norm;
    }
    for (b = r->nb - 1; b >= 0; b--) {
        f = r->up[b].out_local;
        if (leaves) { /* this leaf's gradients alone: from zero, then kept apart */
            dpar_linear_zero_grad(&r->up[b]);
            dpar_linear_zero_grad(&r->down[b]);
        }
        if (per_micro && (st = gather(r, b)) != DPAR_OK) return st;
        if ((st = dpar_linear_backward(&r->down[b], r->a[b][micro], r->dy, r->da, ROWS)) != DPAR_OK) return st;
        for (i = 0; i < ROWS * f; i++) r->da[i] *= gelu_grad(r->h[b][micro][i]);
        /* the gradient of the block's input: a tp allreduce (leaves: an all-gather), skipped on stage 0 where nobody
           needs it; between two blocks of my stage it is the next dy */
        st = dpar_linear_backward(&r->up[b], r->xs[b][micro], r->da, b > 0 ? r->dy : (float *)grad_in, ROWS);
        if (st != DPAR_OK || (per_micro && (st = put_back(r, b)) != DPAR_OK)) return st;
        if (leaves) flat_copy(r, b, r->leaf[b][micro], 1, 1);
    }
    return DPAR_OK;
}

/* SGD with the gradient scaled by `scale`, then clear the gradient */
static void sgd(dpar_linear *l, float scale)
{
    int i;
    for (i = 0; i < l->in_local * l->out_local; i++) l->w[i] -= LR * scale * l->dw[i];
    for (i = 0; i < l->bias_local; i++) l->b[i] -= LR * scale * l->db[i];
    dpar_linear_zero_grad(l);
}

/* the bitwise modes: block b's gradient = its leaves' gradients added in the fixed tree over all NLEAF leaves (my m
   leaves here, the replicas' subtrees by the deterministic allreduce over dp: NULL on one thread), divided by NLEAF,
   as dpar_tree_reduce's DPAR_AVG over all of them does (and dpar_fsdp's leaves) */
static dpar_status leaf_grads(rank_state *r, int b, dpar_comm *dp)
{
    const void *parts[NLEAF];
    float sum[UNIT];
    size_t n = unit_count(r, b), i;
    int k;
    dpar_status st;
    for (k = 0; k < r->m; k++) parts[k] = r->leaf[b][k];
    if ((st = dpar_tree_reduce(sum, parts, r->m, n, DPAR_F32, DPAR_SUM)) != DPAR_OK) return st;
    if (dp && (st = dpar_allreduce(dp, sum, sum, n, DPAR_F32, DPAR_SUM)) != DPAR_OK) return st;
    for (i = 0; i < n; i++) sum[i] = sum[i] / (float)NLEAF;
    flat_copy(r, b, sum, 1, 0);
    return DPAR_OK;
}

/* the loss of a step with leaves: the leaves' means in the same tree, over NLEAF */
static dpar_status leaf_loss(rank_state *r, dpar_comm *dp, double *loss)
{
    const void *parts[NLEAF];
    int k;
    dpar_status st;
    for (k = 0; k < r->m; k++) parts[k] = &r->leaf_loss[k];
    if ((st = dpar_tree_reduce(loss, parts, r->m, 1, DPAR_F64, DPAR_SUM)) != DPAR_OK) return st;
    if (dp && (st = dpar_allreduce(dp, loss, loss, 1, DPAR_F64, DPAR_SUM)) != DPAR_OK) return st;
    *loss /= NLEAF;
    return DPAR_OK;
}

/* my slice of a layer against the whole layer: max |difference| / max |whole| */
static double slice_diff(const dpar_linear *l, const dpar_linear *whole_layer)
{
    const float *w = whole_layer->w, *b = whole_layer->b;
    double num = 0, den = 0, e;
    int i, c;
    for (i = 0; i < l->in_local; i++)
        for (c = 0; c < l->out_local; c++) {
            float whole = w[(size_t)(l->in_offset + i) * l->out + l->out_offset + c];
            if ((e = fabs((double)l->w[i * l->out_local + c] - whole)) > num) num = e;
            if (fabs((double)whole) > den) den = fabs((double)whole);
        }
    for (c = 0; c < l->bias_local; c++)
        if ((e = fabs((double)l->b[c] - b[(l->mode == DPAR_LINEAR_COLUMN ? l->out_offset : 0) + c])) > num) num = e;
    return num / den;
}

/* write my slice of a layer into the whole one (w: in x out); a row layer's bias, whole on every tp rank, when
   with_bias */
static void slice_out(const dpar_linear *l, float *w, float *b, int with_bias)
{
    int i;
    for (i = 0; i < l->in_local; i++)
        memcpy(w + (size_t)(l->in_offset + i) * l->out + l->out_offset, l->w + (size_t)i * l->out_local,
               (size_t)l->out_local * sizeof(float));
    if (l->mode != DPAR_LINEAR_ROW || with_bias)
        memcpy(b + (l->mode == DPAR_LINEAR_COLUMN ? l->out_offset : 0), l->b, (size_t)l->bias_local * sizeof(float));
}

#define TRY(call)                                                               \
    do {                                                                        \
        if ((st = (call)) != DPAR_OK) {                                         \
            fprintf(stderr, "rank %d: %s: %s\n", wr, #call, dpar_last_error()); \
            goto done;                                                          \
        }                                                                       \
    } while (0)

/* --zero 3: my stage's blocks as dpar_fsdp units over the dp comm, the leaves of the bitwise mode */
static dpar_status zero_create(rank_state *r, int wr)
{
    size_t counts[NB];
    dpar_fsdp_desc fd;
    dpar_status st = DPAR_OK;
    float flat[UNIT];
    int b, first = 0, count = 0;
    memset(&fd, 0, sizeof fd);
    for (b = 0; b < r->nb; b++) counts[b] = unit_count(r, b);
    fd.comm = r->mesh.dp_comm;
    fd.stage = 3;
    fd.num_units = r->nb;
    fd.unit_counts = counts;
    fd.kind = DPAR_OPTIM_SGD;
    fd.lr = LR;
    fd.leaves = NLEAF;
    TRY(dpar_fsdp_create(&fd, &r->fsdp));
    TRY(dpar_fsdp_leaves(r->fsdp, &first, &count));
    if (first != r->mesh.dp_rank * r->m || count != r->m)
        TRY(dpar_set_error(DPAR_EINVAL, "dpar_fsdp gives leaves %d..%d, the pipeline runs %d..%d", first,
                           first + count - 1, r->mesh.dp_rank * r->m, (r->mesh.dp_rank + 1) * r->m - 1));
    for (b = 0; b < r->nb; b++) { /* the same values on every replica: each keeps its shard */
        flat_copy(r, b, flat, 0, 1);
        TRY(dpar_fsdp_set_params(r->fsdp, b, flat));
        r->own[b][0] = r->up[b].w;
        r->own[b][1] = r->up[b].b;
        r->own[b][2] = r->down[b].w;
        r->own[b][3] = r->down[b].b;
        r->up[b].w = r->up[b].b = r->down[b].w = r->down[b].b = NULL;
    }
done:
    return st;
}

/* --zero 3: after the pipeline's last backward, each unit's leaves reduce-scattered, then the sharded step */
static dpar_status zero_step(rank_state *r, int wr)
{
    float *g;
    size_t n;
    int b, k;
    dpar_status st = DPAR_OK;
    for (b = 0; b < r->nb; b++) {
        n = unit_count(r, b);
        TRY(dpar_fsdp_grads(r->fsdp, b, &g)); /* my leaves' arrays, one after another */
        for (k = 0; k < r->m; k++) memcpy(g + (size_t)k * n, r->leaf[b][k], n * sizeof(float));
        TRY(dpar_fsdp_reduce(r->fsdp, b));
    }
    TRY(dpar_fsdp_step(r->fsdp));
done:
    return st;
}

static dpar_status train(rank_state *r, dpar_comm *world, int wr)
{
    job *j = r->j;
    dpar_pipe *pipe = NULL;
    dpar_pipe_schedule *S = NULL;
    dpar_pipe_schedule_desc sd = {0};
    dpar_pipe_desc pd;
    dpar_linear_desc ud = {0}, dd = {0};
    dpar_mesh_desc md = {0};
    dpar_comm_stats s[2];
    dpar_status st = DPAR_OK;
    float lo[D * F], hi[D * F], flat[UNIT];
    uint64_t t0 = 0;
    int step, k, b, n, pp, last;
    md.world = world;
    md.dp = j->dp;
    md.tp = j->tp;
    md.pp = j->pp;
    TRY(dpar_mesh_init(&r->mesh, &md));
    pp = r->mesh.pp_rank;
    last = pp == j->pp - 1;
    r->nb = NB / j->pp;
    r->first = pp * r->nb;
    r->m = j->leaves ? NLEAF / j->dp : M;
    j->coords[wr][0] = r->mesh.dp_rank;
    j->coords[wr][1] = r->mesh.tp_rank;
    j->coords[wr][2] = pp;
    ud.mode = DPAR_LINEAR_COLUMN;
    ud.in = D;
    ud.out = F;
    ud.comm = r->mesh.tp_comm;
    ud.leaves = j->leaves;
    dd.mode = DPAR_LINEAR_ROW;
    dd.in = F;
    dd.out = D;
    dd.comm = r->mesh.tp_comm;
    dd.leaves = j->leaves;
    for (b = 0; b < r->nb; b++) {
        TRY(dpar_linear_init(&r->up[b], &ud));
        TRY(dpar_linear_init(&r->down[b], &dd));
        TRY(dpar_linear_set_weights(&r->up[b], j->w1[r->first + b], j->b1[r->first + b])); /* my tp slice */
        TRY(dpar_linear_set_weights(&r->down[b], j->w2[r->first + b], j->b2[r->first + b]));
    }
    if (j->zero) TRY(zero_create(r, wr));
    sd.kind = DPAR_PIPE_1F1B;
    sd.p = j->pp;
    sd.m = r->m;
    TRY(dpar_pipe_schedule_create(&sd, &S));
    memset(&pd, 0, sizeof pd);
    pd.schedule = S;
    pd.comm = r->mesh.pp_comm;
    pd.act_bytes = ROWS * D * sizeof(float);
    pd.forward = fwd;
    pd.backward = bwd;
    pd.user = r;
    TRY(dpar_pipe_create(&pd, &pipe));
    TRY(dpar_comm_stats_reset(r->mesh.dp_comm));
    for (step = 0; step < j->steps; step++) {
        if (step == 1) t0 = dpar_time_ns(); /* the first step allocates the runner's buffers */
        r->loss = 0;
        if (r->fsdp && !j->gather_micro)
            for (b = 0; b < r->nb; b++) TRY(gather(r, b)); /* once per step: every micro-batch reads them */
        TRY(dpar_pipe_run(pipe, NULL));                    /* my replica's micro-batches through all stages */
        if (r->fsdp && !j->gather_micro)
            for (b = 0; b < r->nb; b++) TRY(put_back(r, b));
        if (r->fsdp) TRY(zero_step(r, wr));
        for (b = 0; b < r->nb && !r->fsdp; b++) {
            dpar_linear *L[2] = {&r->up[b], &r->down[b]};
            if (j->leaves) { /* the leaves' tree, finished across the replicas by the deterministic allreduce */
                TRY(leaf_grads(r, b, r->mesh.dp_comm));
                sgd(L[0], 1.0f);
                sgd(L[1], 1.0f);
                continue;
            }
            for (k = 0; k < 2; k++) { /* data parallelism: average with my twin in the other replica */
                n = L[k]->in_local * L[k]->out_local;
                TRY(dpar_allreduce(r->mesh.dp_comm, L[k]->dw, L[k]->dw, (size_t)n, DPAR_F32, DPAR_AVG));
                TRY(dpar_allreduce(r->mesh.dp_comm, L[k]->db, L[k]->db, (size_t)L[k]->bias_local, DPAR_F32, DPAR_AVG));
                sgd(L[k], 1.0f);
            }
        }
        if (last) { /* the last stage knows the loss: the mean over all replicas */
            double loss = r->loss / (LB * D);
            if (j->leaves) TRY(leaf_loss(r, r->mesh.dp_comm, &loss));
            else TRY(dpar_allreduce(r->mesh.dp_comm, &loss, &loss, 1, DPAR_F64, DPAR_AVG));
            if (r->mesh.dp_rank == 0 && r->mesh.tp_rank == 0) j->out->loss[step] = (float)loss;
        }
    }
    if (j->steps > 1) j->step_us[wr] = (double)(dpar_time_ns() - t0) / 1e3 / (j->steps - 1);
    TRY(dpar_comm_stats_get(r->mesh.tp_comm, &s[0]));
    TRY(dpar_comm_stats_get(r->mesh.dp_comm, &s[1]));
    j->moved[wr][0] = (double)s[1].by_coll[DPAR_COLL_ALLGATHER].bytes_sent / j->steps;
    j->moved[wr][1] = /* the leaves' reduce-scatter is an alltoall of their subtrees' blocks */
        (double)(s[1].by_coll[DPAR_COLL_ALLTOALL].bytes_sent + s[1].by_coll[DPAR_COLL_REDUCE_SCATTER].bytes_sent) /
        j->steps;
    j->per_step[wr][0] = (double)s[0].by_coll[DPAR_COLL_ALLREDUCE].calls / j->steps;
    for (k = 0; k < S->num_ops[pp]; k++) /* the schedule is data: count its sends */
        j->per_step[wr][1] += S->ops[pp][k].code == DPAR_PIPE_SEND_ACT || S->ops[pp][k].code == DPAR_PIPE_SEND_GRAD;
    j->per_step[wr][2] = (double)s[1].by_coll[DPAR_COLL_ALLREDUCE].calls / j->steps;
    for (b = 0; b < r->nb && r->fsdp; b++) { /* ZeRO-3: the whole unit back, into the layers' own arrays */
        r->up[b].w = r->own[b][0], r->up[b].b = r->own[b][1], r->down[b].w = r->own[b][2], r->down[b].b = r->own[b][3];
        TRY(dpar_fsdp_get_params(r->fsdp, b, flat));
        flat_copy(r, b, flat, 0, 0);
    }
    /* the replicas must agree to the bit: the MIN and the MAX over the dp comm are the same number (and over the tp
       comm for the row layer's bias, whole on every tp rank) */
    j->identical[wr] = 1;
    for (b = 0; b < r->nb; b++)
        for (k = 0; k < 5; k++) {
            const float *p = k < 2 ? (k ? r->down[b].w : r->up[b].w) : (k >= 3 ? r->down[b].b : r->up[b].b);
            const dpar_linear *l = k % 2 || k == 4 ? &r->down[b] : &r->up[b];
            dpar_comm *c = k == 4 ? r->mesh.tp_comm : r->mesh.dp_comm;
            n = k < 2 ? l->in_local * l->out_local : l->bias_local;
            TRY(dpar_allreduce(c, p, lo, (size_t)n, DPAR_F32, DPAR_MIN));
            TRY(dpar_allreduce(c, p, hi, (size_t)n, DPAR_F32, DPAR_MAX));
            if (memcmp(lo, hi, (size_t)n * sizeof(float))) j->identical[wr] = 0;
        }
    for (b = 0; b < r->nb; b++) {
        int blk = r->first + b;
        j->diff[wr] = fmax(j->diff[wr],
                           fmax(slice_diff(&r->up[b], &j->ref->up[blk]), slice_diff(&r->down[b], &j->ref->down[blk])));
        if (r->mesh.dp_rank == 0) { /* replica 0's slices make the whole model (the replicas are checked equal) */
            slice_out(&r->up[b], j->out->w1[blk], j->out->b1[blk], 1);
            slice_out(&r->down[b], j->out->w2[blk], j->out->b2[blk], r->mesh.tp_rank == 0);
        }
    }
done:
    for (b = 0; b < r->nb && r->fsdp && r->own[b][0]; b++) /* the layers' own arrays back, for destroy */
        r->up[b].w = r->own[b][0], r->up[b].b = r->own[b][1], r->down[b].w = r->own[b][2], r->down[b].b = r->own[b][3];
    if (r->fsdp) dpar_fsdp_destroy(r->fsdp);
    dpar_pipe_destroy(pipe);
    dpar_pipe_schedule_destroy(S);
    for (b = 0; b < NB; b++) {
        dpar_linear_destroy(&r->up[b]);
        dpar_linear_destroy(&r->down[b]);
    }
    return st;
}

static dpar_status rank_main(void *user, int wr, int n)
{
    rank_state *r = (rank_state *)calloc(1, sizeof *r);
    dpar_comm *world = NULL;
    dpar_status st;
    int k;
    (void)n;
    if (!r) return dpar_set_error(DPAR_ENOMEM, "rank %d: out of memory", wr);
    r->j = (job *)user;
    if ((st = dpar_group_join(r->j->group, wr, &world)) == DPAR_OK) {
        dpar_comm *mine[4];
        st = train(r, world, wr);
        mine[0] = world;
        mine[1] = r->mesh.tp_comm;
        mine[2] = r->mesh.pp_comm;
        mine[3] = r->mesh.dp_comm;
        for (k = 0; k < 4 && st != DPAR_OK; k++) /* wake every rank that waits for me, on every comm of mine */
            if (mine[k]) dpar_comm_abort(mine[k]);
        if (r->mesh.tp_comm) dpar_mesh_destroy(&r->mesh);
        dpar_comm_destroy(world);
    } else fprintf(stderr, "rank %d: dpar_group_join: %s\n", wr, dpar_last_error());
    free(r);
    return st;
}

/* the same training on one thread: both blocks whole (DPAR_LINEAR_FULL, with the layers' leaves in the bitwise
   modes), the whole batch as the 8 micro-batches (leaves) one after another, no pipeline, no comm */
static dpar_status reference(job *j, rank_state *r)
{
    dpar_linear_desc ud = {0}, dd = {0}; /* FULL */
    dpar_status st = DPAR_OK;
    int b, step, leaf;
    ud.in = D;
    ud.out = F;
    ud.leaves = j->leaves;
    dd.in = F;
    dd.out = D;
    dd.leaves = j->leaves;
    r->j = j; /* replica 0 of one: its micro-batch i is leaf i */
    r->nb = NB;
    r->m = NLEAF;
    for (b = 0; b < NB && st == DPAR_OK; b++)
        if ((st = dpar_linear_init(&r->up[b], &ud)) == DPAR_OK &&
            (st = dpar_linear_init(&r->down[b], &dd)) == DPAR_OK &&
            (st = dpar_linear_set_weights(&r->up[b], j->w1[b], j->b1[b])) == DPAR_OK)
            st = dpar_linear_set_weights(&r->down[b], j->w2[b], j->b2[b]);
    for (step = 0; step < j->steps && st == DPAR_OK; step++) {
        r->loss = 0;
        for (leaf = 0; leaf < NLEAF && st == DPAR_OK; leaf++)
            if ((st = fwd(r, leaf, 0, NULL, NULL)) == DPAR_OK) st = bwd(r, leaf, 0, NULL, NULL, NULL);
        for (b = 0; b < NB && st == DPAR_OK; b++) {
            if (j->leaves && (st = leaf_grads(r, b, NULL)) != DPAR_OK) break;
            /* default: the gradients of the DP halves added up: their average is 1/DP of it */
            sgd(&r->up[b], j->leaves ? 1.0f : 1.0f / DP);
            sgd(&r->down[b], j->leaves ? 1.0f : 1.0f / DP);
        }
        if (j->leaves && st == DPAR_OK) {
            double loss;
            if ((st = leaf_loss(r, NULL, &loss)) == DPAR_OK) j->out->loss[step] = (float)loss;
        }
    }
    for (b = 0; b < NB && st == DPAR_OK; b++) {
        slice_out(&r->up[b], j->out->w1[b], j->out->b1[b], 1);
        slice_out(&r->down[b], j->out->w2[b], j->out->b2[b], 1);
    }
    return st;
}

static void reference_destroy(rank_state *r)
{
    int b;
    for (b = 0; b < NB; b++) {
        dpar_linear_destroy(&r->up[b]);
        dpar_linear_destroy(&r->down[b]);
    }
}

/* one run of the 8 ranks in the job's layout */
static dpar_status run_layout(job *j, dpar_pool *pool)
{
    dpar_comm_desc cd;
    dpar_status st;
    memset(&cd, 0, sizeof cd);
    cd.size = RANKS;
    cd.deterministic = j->leaves != 0; /* allreduce in dpar_tree_reduce's tree: the leaves' sums independent of dp */
    memset(j->coords, 0, sizeof j->coords);
    memset(j->diff, 0, sizeof j->diff);
    memset(j->per_step, 0, sizeof j->per_step);
    memset(j->moved, 0, sizeof j->moved);
    if ((st = dpar_group_create(&cd, &j->group)) != DPAR_OK) return st;
    st = dpar_pool_run(pool, rank_main, j);
    dpar_group_destroy(j->group);
    j->group = NULL;
    return st;
}

static int usage(const char *why)
{
    fprintf(stderr, "hybrid: %s\nusage: hybrid [--bitwise] [--zero 3 [--gather step|micro]] [--steps N]\n", why);
    return 2;
}

/* the default mode: the 2 x 2 x 2 mesh against one thread, to rounding (no leaves) */
static int run_default(job *j, dpar_pool *pool)
{
    static rank_state ref;
    static result ref_out, out;
    double worst = 0;
    int i, s, ok, same = 1;
    dpar_status st;
    j->dp = DP;
    j->tp = TP;
    j->pp = PP;
    j->ref = &ref;
    j->out = &ref_out;
    if ((st = reference(j, &ref)) == DPAR_OK) {
        j->out = &out;
        st = run_layout(j, pool);
    }
    reference_destroy(&ref);
    if (st != DPAR_OK) {
        fprintf(stderr, "hybrid: %s\n", dpar_last_error());
        return 1;
    }
    printf("hybrid: %d thread ranks as dp %d x tp %d x pp %d; world rank = (pp * %d + dp) * %d + tp\n", RANKS, DP, TP,
           PP, DP, TP);
    printf("world  dp  tp  pp   holds                                  per step: tp allreduces, pp sends, "
           "dp allreduces (stage 1: +1, the loss)\n");
    for (i = 0; i < RANKS; i++) {
        const int *c = j->coords[i];
        printf("%5d %3d %3d %3d   block %d, hidden units %2d-%2d, rows %2d-%2d   %5.0f %5.0f %5.0f\n", i, c[0], c[1],
               c[2], c[2] + 1, c[1] * F / TP, (c[1] + 1) * F / TP - 1, c[0] * LB, (c[0] + 1) * LB - 1,
               j->per_step[i][0], j->per_step[i][1], j->per_step[i][2]);
        same &= j->identical[i];
        worst = fmax(worst, j->diff[i]);
    }
    for (s = 0; s < j->steps; s++)
        if (s % (j->steps / 6) == 0 || s == j->steps - 1) printf("step %3d  loss %.6f\n", s, out.loss[s]);
    ok = same && worst <= 1e-5 && out.loss[j->steps - 1] < 0.5f * out.loss[0];
    printf("hybrid: dp=%d tp=%d pp=%d, %d steps of 1F1B with %d micro-batches per replica: loss %.6f -> %.6f, "
           "replicas %s, within %.1e of one-thread training, %s\n",
           DP, TP, PP, j->steps, M, out.loss[0], out.loss[j->steps - 1], same ? "bitwise identical" : "DIFFER", worst,
           ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
}

/* --bitwise and --zero 3: layouts of 8 ranks with the leaves, each compared with one thread by memcmp */
static int run_leaves(job *j, dpar_pool *pool, int all_layouts, int gathers)
{
    static rank_state ref;
    static result ref_out, out;
    int layouts[8][3], nl = 0, tp, pp, i, g, k, bad = 0, runs = 0;
    dpar_status st;
    j->leaves = NLEAF;
    j->ref = &ref;
    j->out = &ref_out;
    for (pp = 1; pp <= NB; pp++) /* pp divides the blocks, tp divides the widths and the leaves, dp = 8 / (tp pp) */
        for (tp = 1; tp * pp <= RANKS; tp *= 2)
            if (NB % pp == 0 && F % tp == 0 && D % tp == 0 && NLEAF % tp == 0 &&
                (all_layouts || (tp == TP && pp == PP))) {
                layouts[nl][0] = RANKS / (tp * pp);
                layouts[nl][1] = tp;
                layouts[nl][2] = pp;
                nl++;
            }
    if ((st = reference(j, &ref)) != DPAR_OK) {
        reference_destroy(&ref);
        fprintf(stderr, "hybrid: %s\n", dpar_last_error());
        return 1;
    }
    printf("hybrid %s: %d leaves of %d rows, %d steps; one thread: loss %.6f -> %.6f\n",
           j->zero ? "--zero 3" : "--bitwise", NLEAF, ROWS, j->steps, ref_out.loss[0], ref_out.loss[j->steps - 1]);
    for (i = 0; i < nl; i++)
        for (g = 0; g < 2; g++) {
            int same_w, same_loss, same_rep = 1;
            double us = 0, moved[2] = {0, 0};
            if (!(gathers & (1 << g))) continue;
            j->dp = layouts[i][0];
            j->tp = layouts[i][1];
            j->pp = layouts[i][2];
            j->gather_micro = g;
            memset(&out, 0, sizeof out);
            j->out = &out;
            if ((st = run_layout(j, pool)) != DPAR_OK) {
                fprintf(stderr, "hybrid: dp=%d tp=%d pp=%d: %s\n", j->dp, j->tp, j->pp, dpar_last_error());
                bad = 1;
                continue;
            }
            runs++;
            for (k = 0; k < RANKS; k++) {
                same_rep &= j->identical[k];
                us = fmax(us, j->step_us[k]);
                moved[0] += j->moved[k][0] / RANKS;
                moved[1] += j->moved[k][1] / RANKS;
            }
            same_w = !memcmp(out.w1, ref_out.w1, sizeof out.w1) && !memcmp(out.b1, ref_out.b1, sizeof out.b1) &&
                     !memcmp(out.w2, ref_out.w2, sizeof out.w2) && !memcmp(out.b2, ref_out.b2, sizeof out.b2);
            same_loss = !memcmp(out.loss, ref_out.loss, (size_t)j->steps * sizeof(float));
            bad |= !same_w || !same_loss || !same_rep;
            printf("hybrid %s: dp=%d tp=%d pp=%d%s, %d micro-batch%s per replica: weights %s, losses of %d steps %s, "
                   "replicas %s",
                   j->zero ? "--zero 3" : "--bitwise", j->dp, j->tp, j->pp,
                   j->zero ? (g ? " gather=micro" : " gather=step") : "", NLEAF / j->dp, j->dp < NLEAF ? "es" : "",
                   same_w ? "bitwise equal" : "DIFFER", j->steps, same_loss ? "bitwise equal" : "DIFFER",
                   same_rep ? "identical" : "DIFFER");
            printf("; per step %.0f us", us);
            if (j->zero) printf(", per rank %.0f bytes gathered, %.0f reduced", moved[0], moved[1]);
            printf("\n");
        }
    reference_destroy(&ref);
    printf("hybrid %s: %d run%s of 8 ranks against one thread: %s\n", j->zero ? "--zero 3" : "--bitwise", runs,
           runs == 1 ? "" : "s", bad ? "FAILED" : "the same bits, OK");
    return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
    static job j;
    dpar_pool_desc pd;
    dpar_pool *pool = NULL;
    unsigned long long seed = 3;
    float teacher[D * D];
    int i, k, s, rc, bitwise = 0, gathers = 3, steps = 0;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--bitwise")) bitwise = 1;
        else if (!strcmp(argv[i], "--zero") && i + 1 < argc) {
            if (strcmp(argv[++i], "3")) return usage("--zero: 3 (ZeRO-3, dpar_fsdp over the dp comm)");
            j.zero = 3;
        } else if (!strcmp(argv[i], "--gather") && i + 1 < argc) {
            i++;
            gathers = !strcmp(argv[i], "step") ? 1 : !strcmp(argv[i], "micro") ? 2 : 0;
            if (!gathers) return usage("--gather: step or micro");
        } else if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
            steps = atoi(argv[++i]);
            if (steps < 2 || steps > MAX_STEPS) return usage("--steps: 2 to 300");
        } else return usage(argv[i]);
    }
    j.steps = steps ? steps : getenv("DPAR_TEST_QUICK") ? 60 : bitwise || j.zero ? 100 : MAX_STEPS;
    for (k = 0; k < NB; k++) { /* weights uniform in +-0.5 and +-0.3, biases 0 */
        for (i = 0; i < D * F; i++) j.w1[k][i] = urand(&seed) * 0.5f;
        for (i = 0; i < F * D; i++) j.w2[k][i] = urand(&seed) * 0.3f;
    }
    for (i = 0; i < GB * D; i++) j.x[i] = urand(&seed);
    for (i = 0; i < D * D; i++) teacher[i] = urand(&seed) * 0.5f;
    for (i = 0; i < GB; i++) /* the task: t = sin(x A) for a fixed random A */
        for (k = 0; k < D; k++) {
            float z = 0;
            for (s = 0; s < D; s++) z += j.x[i * D + s] * teacher[s * D + k];
            j.t[i * D + k] = sinf(z);
        }
    memset(&pd, 0, sizeof pd);
    pd.num_threads = RANKS;
    if (dpar_pool_create(&pd, &pool) != DPAR_OK) {
        fprintf(stderr, "hybrid: %s\n", dpar_last_error());
        return 1;
    }
    rc = bitwise || j.zero ? run_leaves(&j, pool, bitwise, j.zero ? gathers : 1) : run_default(&j, pool);
    dpar_pool_destroy(pool);
    return rc;
}
