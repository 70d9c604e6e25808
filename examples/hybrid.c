/* hybrid.c - 3D parallelism: data x tensor x pipeline parallel training on a 2 x 2 x 2 mesh of 8 thread ranks.
   Build: cc -std=c99 -O2 -I. examples/hybrid.c -o hybrid -pthread -lm
   Run:   ./hybrid
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
   equal, to rounding, the same model trained on one thread on the whole batch. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DP 2
#define TP 2
#define PP 2
#define D 16  /* width between the blocks */
#define F 32  /* hidden width of a block */
#define GB 32 /* the global batch; a replica's half is LB rows */
#define LB (GB / DP)
#define M 4 /* micro-batches per replica, of ROWS rows */
#define ROWS (LB / M)
#define MAX_STEPS 300
#define LR 0.5f

typedef struct job {
    int steps;
    float w1[PP][D * F], b1[PP][F], w2[PP][F * D], b2[PP][D]; /* the starting model, two blocks */
    float x[GB * D], t[GB * D];
    float loss[MAX_STEPS];
    int coords[DP * TP * PP][3], identical[DP * TP * PP]; /* per world rank: dp, tp, pp; replicas agree */
    double diff[DP * TP * PP], per_step[DP * TP * PP][3]; /* vs one thread; tp, pp, dp messages per step */
    dpar_pipe_schedule *S;
    dpar_group *group;
    struct rank_state *ref; /* the model trained on one thread, a rank_state per block */
} job;

typedef struct rank_state { /* one rank: its slice of its stage's block */
    job *j;
    dpar_mesh mesh;
    dpar_linear up, down;
    float xs[M][ROWS * D], h[M][ROWS * F], a[M][ROWS * F], y[M][ROWS * D], dy[ROWS * D], da[ROWS * F];
    double loss;
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

/* my replica's rows of the global batch, micro-batch `micro` */
static size_t first_row(const rank_state *r, int micro) { return (size_t)r->mesh.dp_rank * LB + (size_t)micro * ROWS; }

static dpar_status fwd(void *user, int micro, int chunk, const void *in, void *out)
{
    rank_state *r = (rank_state *)user;
    int i, f = r->up.out_local;
    dpar_status st;
    (void)chunk;
    memcpy(r->xs[micro], in ? (const float *)in : r->j->x + first_row(r, micro) * D, sizeof r->xs[micro]);
    if ((st = dpar_linear_forward(&r->up, r->xs[micro], r->h[micro], ROWS)) != DPAR_OK) return st; /* no comm */
    for (i = 0; i < ROWS * f; i++) r->a[micro][i] = gelu(r->h[micro][i]);
    if ((st = dpar_linear_forward(&r->down, r->a[micro], r->y[micro], ROWS)) != DPAR_OK) return st; /* tp allreduce */
    if (out) memcpy(out, r->y[micro], sizeof r->y[micro]); /* to the next stage */
    else {
        const float *t = r->j->t + first_row(r, micro) * D;
        for (i = 0; i < ROWS * D; i++) r->loss += (double)(r->y[micro][i] - t[i]) * (r->y[micro][i] - t[i]);
    }
    return DPAR_OK;
}

static dpar_status bwd(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    rank_state *r = (rank_state *)user;
    int i, f = r->up.out_local;
    dpar_status st;
    (void)chunk;
    (void)in;
    if (grad_out) memcpy(r->dy, grad_out, sizeof r->dy);
    else { /* the loss: the mean over my replica's half; the dp average makes it the global mean */
        const float *t = r->j->t + first_row(r, micro) * D;
        for (i = 0; i < ROWS * D; i++) r->dy[i] = 2.0f * (r->y[micro][i] - t[i]) / (LB * D);
    }
    if ((st = dpar_linear_backward(&r->down, r->a[micro], r->dy, r->da, ROWS)) != DPAR_OK) return st; /* no comm */
    for (i = 0; i < ROWS * f; i++) r->da[i] *= gelu_grad(r->h[micro][i]);
    /* the gradient of the block's input: a tp allreduce, skipped on stage 0 where nobody needs it */
    return dpar_linear_backward(&r->up, r->xs[micro], r->da, (float *)grad_in, ROWS);
}

/* SGD with the gradient scaled by `scale`, then clear the gradient */
static void sgd(dpar_linear *l, float scale)
{
    int i;
    for (i = 0; i < l->in_local * l->out_local; i++) l->w[i] -= LR * scale * l->dw[i];
    for (i = 0; i < l->bias_local; i++) l->b[i] -= LR * scale * l->db[i];
    dpar_linear_zero_grad(l);
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

#define TRY(call)                                                               \
    do {                                                                        \
        if ((st = (call)) != DPAR_OK) {                                         \
            fprintf(stderr, "rank %d: %s: %s\n", wr, #call, dpar_last_error()); \
            goto done;                                                          \
        }                                                                       \
    } while (0)

static dpar_status train(rank_state *r, dpar_comm *world, int wr)
{
    job *j = r->j;
    dpar_linear *L[2] = {&r->up, &r->down};
    dpar_pipe *pipe = NULL;
    dpar_pipe_desc pd;
    dpar_linear_desc ud = {0}, dd = {0};
    dpar_mesh_desc md = {0};
    dpar_comm_stats s[2];
    dpar_status st = DPAR_OK;
    float lo[D * F], hi[D * F];
    int step, k, n, pp;
    md.world = world, md.dp = DP, md.tp = TP, md.pp = PP;
    TRY(dpar_mesh_init(&r->mesh, &md));
    pp = r->mesh.pp_rank;
    j->coords[wr][0] = r->mesh.dp_rank, j->coords[wr][1] = r->mesh.tp_rank, j->coords[wr][2] = pp;
    ud.mode = DPAR_LINEAR_COLUMN, ud.in = D, ud.out = F, ud.comm = r->mesh.tp_comm;
    dd.mode = DPAR_LINEAR_ROW, dd.in = F, dd.out = D, dd.comm = r->mesh.tp_comm;
    TRY(dpar_linear_init(&r->up, &ud));
    TRY(dpar_linear_init(&r->down, &dd));
    TRY(dpar_linear_set_weights(&r->up, j->w1[pp], j->b1[pp])); /* my stage's block, my tp slice */
    TRY(dpar_linear_set_weights(&r->down, j->w2[pp], j->b2[pp]));
    memset(&pd, 0, sizeof pd);
    pd.schedule = j->S;
    pd.comm = r->mesh.pp_comm;
    pd.act_bytes = ROWS * D * sizeof(float);
    pd.forward = fwd;
    pd.backward = bwd;
    pd.user = r;
    TRY(dpar_pipe_create(&pd, &pipe));
    for (step = 0; step < j->steps; step++) {
        r->loss = 0;
        TRY(dpar_pipe_run(pipe, NULL)); /* my replica's M micro-batches through both stages */
        for (k = 0; k < 2; k++) {       /* data parallelism: average with my twin in the other replica */
            n = L[k]->in_local * L[k]->out_local;
            TRY(dpar_allreduce(r->mesh.dp_comm, L[k]->dw, L[k]->dw, (size_t)n, DPAR_F32, DPAR_AVG));
            TRY(dpar_allreduce(r->mesh.dp_comm, L[k]->db, L[k]->db, (size_t)L[k]->bias_local, DPAR_F32, DPAR_AVG));
            sgd(L[k], 1.0f);
        }
        if (pp == PP - 1) { /* the last stage knows the loss: the mean over both replicas */
            double loss = r->loss / (LB * D);
            TRY(dpar_allreduce(r->mesh.dp_comm, &loss, &loss, 1, DPAR_F64, DPAR_AVG));
            if (r->mesh.dp_rank == 0 && r->mesh.tp_rank == 0) j->loss[step] = (float)loss;
        }
    }
    TRY(dpar_comm_stats_get(r->mesh.tp_comm, &s[0]));
    TRY(dpar_comm_stats_get(r->mesh.dp_comm, &s[1]));
    j->per_step[wr][0] = (double)s[0].by_coll[DPAR_COLL_ALLREDUCE].calls / j->steps;
    for (k = 0; k < j->S->num_ops[pp]; k++) /* the schedule is data: count its sends */
        j->per_step[wr][1] +=
            j->S->ops[pp][k].code == DPAR_PIPE_SEND_ACT || j->S->ops[pp][k].code == DPAR_PIPE_SEND_GRAD;
    j->per_step[wr][2] = (double)s[1].by_coll[DPAR_COLL_ALLREDUCE].calls / j->steps;
    /* the replicas must agree to the bit: the MIN and the MAX over the dp comm are the same number */
    j->identical[wr] = 1;
    for (k = 0; k < 4; k++) {
        const float *p = k < 2 ? L[k]->w : L[k - 2]->b;
        n = k < 2 ? L[k]->in_local * L[k]->out_local : L[k - 2]->bias_local;
        TRY(dpar_allreduce(r->mesh.dp_comm, p, lo, (size_t)n, DPAR_F32, DPAR_MIN));
        TRY(dpar_allreduce(r->mesh.dp_comm, p, hi, (size_t)n, DPAR_F32, DPAR_MAX));
        if (memcmp(lo, hi, (size_t)n * sizeof(float))) j->identical[wr] = 0;
    }
    j->diff[wr] = fmax(slice_diff(&r->up, &j->ref[pp].up), slice_diff(&r->down, &j->ref[pp].down));
done:
    dpar_pipe_destroy(pipe);
    dpar_linear_destroy(&r->up);
    dpar_linear_destroy(&r->down);
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
        mine[0] = world, mine[1] = r->mesh.tp_comm, mine[2] = r->mesh.pp_comm, mine[3] = r->mesh.dp_comm;
        for (k = 0; k < 4 && st != DPAR_OK; k++) /* wake every rank that waits for me, on every comm of mine */
            if (mine[k]) dpar_comm_abort(mine[k]);
        if (r->mesh.tp_comm) dpar_mesh_destroy(&r->mesh);
        dpar_comm_destroy(world);
    } else fprintf(stderr, "rank %d: dpar_group_join: %s\n", wr, dpar_last_error());
    free(r);
    return st;
}

/* the same training on one thread: both blocks whole (DPAR_LINEAR_FULL), both halves of the batch */
static dpar_status reference(job *j, rank_state *r)
{
    float act[ROWS * D], g[ROWS * D];
    dpar_linear_desc ud = {0}, dd = {0}; /* FULL */
    dpar_status st = DPAR_OK;
    int k, step, d, micro;
    ud.in = D, ud.out = F;
    dd.in = F, dd.out = D;
    for (k = 0; k < PP && st == DPAR_OK; k++) {
        r[k].j = j;
        if ((st = dpar_linear_init(&r[k].up, &ud)) == DPAR_OK && (st = dpar_linear_init(&r[k].down, &dd)) == DPAR_OK &&
            (st = dpar_linear_set_weights(&r[k].up, j->w1[k], j->b1[k])) == DPAR_OK)
            st = dpar_linear_set_weights(&r[k].down, j->w2[k], j->b2[k]);
    }
    for (step = 0; step < j->steps && st == DPAR_OK; step++) {
        for (d = 0; d < DP; d++)
            for (micro = 0; micro < M && st == DPAR_OK; micro++) {
                r[0].mesh.dp_rank = r[1].mesh.dp_rank = d; /* which half of the batch */
                if ((st = fwd(&r[0], micro, 0, NULL, act)) == DPAR_OK &&
                    (st = fwd(&r[1], micro, 0, act, NULL)) == DPAR_OK &&
                    (st = bwd(&r[1], micro, 0, act, NULL, g)) == DPAR_OK)
                    st = bwd(&r[0], micro, 0, NULL, g, NULL);
            }
        for (k = 0; k < PP; k++) { /* the gradients of the DP halves added up: their average is 1/DP of it */
            sgd(&r[k].up, 1.0f / DP);
            sgd(&r[k].down, 1.0f / DP);
        }
    }
    return st;
}

int main(void)
{
    static job j;
    static rank_state ref[PP];
    dpar_pool_desc pd;
    dpar_comm_desc cd;
    dpar_pipe_schedule_desc sd = {0};
    dpar_pool *pool = NULL;
    dpar_status st;
    unsigned long long seed = 3;
    float teacher[D * D];
    double worst = 0;
    int i, k, s, ok, same = 1;
    j.steps = getenv("DPAR_TEST_QUICK") ? 60 : MAX_STEPS;
    for (k = 0; k < PP; k++) { /* weights uniform in +-0.5 and +-0.3, biases 0 */
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
    memset(&cd, 0, sizeof cd);
    pd.num_threads = cd.size = DP * TP * PP;
    j.ref = ref;
    sd.kind = DPAR_PIPE_1F1B, sd.p = PP, sd.m = M;
    if ((st = dpar_pipe_schedule_create(&sd, &j.S)) == DPAR_OK && (st = reference(&j, ref)) == DPAR_OK &&
        (st = dpar_pool_create(&pd, &pool)) == DPAR_OK && (st = dpar_group_create(&cd, &j.group)) == DPAR_OK)
        st = dpar_pool_run(pool, rank_main, &j);
    if (st != DPAR_OK) {
        fprintf(stderr, "hybrid: %s\n", dpar_last_error());
        return 1;
    }
    dpar_group_destroy(j.group);
    dpar_pool_destroy(pool);
    dpar_pipe_schedule_destroy(j.S);
    for (k = 0; k < PP; k++) {
        dpar_linear_destroy(&ref[k].up);
        dpar_linear_destroy(&ref[k].down);
    }

    printf("hybrid: %d thread ranks as dp %d x tp %d x pp %d; world rank = (pp * %d + dp) * %d + tp\n", DP * TP * PP,
           DP, TP, PP, DP, TP);
    printf("world  dp  tp  pp   holds                                  per step: tp allreduces, pp sends, "
           "dp allreduces (stage 1: +1, the loss)\n");
    for (i = 0; i < DP * TP * PP; i++) {
        const int *c = j.coords[i];
        printf("%5d %3d %3d %3d   block %d, hidden units %2d-%2d, rows %2d-%2d   %5.0f %5.0f %5.0f\n", i, c[0], c[1],
               c[2], c[2] + 1, c[1] * F / TP, (c[1] + 1) * F / TP - 1, c[0] * LB, (c[0] + 1) * LB - 1, j.per_step[i][0],
               j.per_step[i][1], j.per_step[i][2]);
        same &= j.identical[i];
        worst = fmax(worst, j.diff[i]);
    }
    for (s = 0; s < j.steps; s++)
        if (s % (j.steps / 6) == 0 || s == j.steps - 1) printf("step %3d  loss %.6f\n", s, j.loss[s]);
    ok = same && worst <= 1e-5 && j.loss[j.steps - 1] < 0.5f * j.loss[0];
    printf("hybrid: dp=%d tp=%d pp=%d, %d steps of 1F1B with %d micro-batches per replica: loss %.6f -> %.6f, "
           "replicas %s, within %.1e of one-thread training, %s\n",
           DP, TP, PP, j.steps, M, j.loss[0], j.loss[j.steps - 1], same ? "bitwise identical" : "DIFFER", worst,
           ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
}
