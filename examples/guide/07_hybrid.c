/* 07_hybrid.c - lesson 7 of the guide (docs/guide/07_hybrid.md): hybrid parallelism on a dp x tp x pp mesh.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/07_hybrid.c -o build/lesson07 -pthread -lm
   Run:   build/lesson07
   Check: ^mesh: every rank's coordinates and groups = Megatron's order, world = \(pp \* 2 \+ dp\) \* 2 \+ tp$
   Check: ^replicas: the 2 data-parallel copies of every slice are identical bit for bit$
   Check: ^the slices = the serial model's weights after [0-9]+ steps \(max difference [0-9.e+-]+\); loss

   8 thread ranks: 2 pipeline stages (block s on stage s), each block cut over 2 tensor-parallel ranks (dpar_linear,
   lesson 5), all of it twice, one copy per half of the batch (lesson 2); dpar_mesh_init makes the three comms. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

enum { DP = 2, TP = 2, PP = 2, N = DP * TP * PP };         /* the mesh: 8 thread ranks */
enum { D = 8, F = 16, GB = 16, LB = GB / DP, STEPS = 50 }; /* widths; the global batch, a replica's share of it */
#define LR 0.5f
#define DO(call) st = st == DPAR_OK ? (call) : st /* make the call unless something failed already */
typedef struct block { /* one stage's block: x W1, tanh, W2; its input and hidden units kept for backward */
    dpar_linear up;    /* x W1: column-parallel over tp (or whole, in the serial model) */
    dpar_linear down;  /* a W2: row-parallel over tp */
    const float *x;    /* its input (kept until backward) */
    float a[GB * F];
} block;
static float data[GB * D], target[GB * D], W1[PP * D * F], W2[PP * F * D], loss[STEPS]; /* loss: the serial model's */
static float got1[DP][PP][D * F], got2[DP][PP][F * D]; /* each replica's blocks, put together from the ranks' slices */
static block ref[PP];                                  /* the serial model */
static int where[N][3], group_of[N][3][N]; /* per world rank: dp, tp, pp; the world ranks of its dp, tp, pp comms */
static dpar_group *world_group;
static uint32_t seed = 7;
static float uniform(void) { return (float)((seed = seed * 1664525u + 1013904223u) >> 8) * (2.0f / 16777216) - 1; }
static dpar_status block_init(block *b, int stage, dpar_comm *tp, dpar_linear_mode up, dpar_linear_mode down)
{
    dpar_linear_desc up_desc = {0};
    dpar_linear_desc down_desc = {0};
    dpar_status st = DPAR_OK;
    up_desc.in = D;
    up_desc.out = F;
    up_desc.no_bias = 1;
    up_desc.comm = tp;
    up_desc.mode = up;
    down_desc.in = F;
    down_desc.out = D;
    down_desc.no_bias = 1;
    down_desc.comm = tp;
    down_desc.mode = down;
    DO(dpar_linear_init(&b->up, &up_desc));
    DO(dpar_linear_init(&b->down, &down_desc));
    /* each layer takes its slice of the whole matrix: columns for COLUMN, rows for ROW, all of it for FULL */
    DO(dpar_linear_set_weights(&b->up, W1 + stage * D * F, NULL));
    DO(dpar_linear_set_weights(&b->down, W2 + stage * F * D, NULL));
    return st;
}
static dpar_status block_forward(block *b, const float *x, float *y, int rows)
{
    dpar_status st;
    int i;
    b->x = x;                                        /* kept for backward */
    st = dpar_linear_forward(&b->up, x, b->a, rows); /* column layer: no communication */
    for (i = 0; i < rows * b->up.out_local; i++) b->a[i] = tanhf(b->a[i]);
    return st == DPAR_OK ? dpar_linear_forward(&b->down, b->a, y, rows) : st; /* row layer: allreduce over tp */
}
static dpar_status block_backward(block *b, const float *dy, float *dx, int rows) /* dx NULL: not needed */
{
    float da[GB * F];
    dpar_status st = dpar_linear_backward(&b->down, b->a, dy, da, rows); /* no communication */
    int i;
    for (i = 0; i < rows * b->up.out_local; i++) da[i] *= 1 - b->a[i] * b->a[i];
    return st == DPAR_OK ? dpar_linear_backward(&b->up, b->x, da, dx, rows) : st; /* dx: allreduce over tp */
}
static void sgd(block *b) /* up.w (D x f) and down.w (f x D) hold as many weights */
{
    int i;
    for (i = 0; i < D * b->up.out_local; i++) {
        b->up.w[i] -= LR * b->up.dw[i];
        b->down.w[i] -= LR * b->down.dw[i];
    }
    dpar_linear_zero_grad(&b->up);
    dpar_linear_zero_grad(&b->down);
}
static dpar_status rank_main(void *user, int w, int n)
{
    dpar_comm *world = NULL;
    dpar_comm *mine[3];
    dpar_mesh mesh = {0};
    dpar_mesh_desc md = {0};
    block blk = {0};
    block *b = &blk;
    float act[LB * D];  /* stage 1: stage 0's output */
    float grad[LB * D]; /* the gradient of this stage's output */
    float y[LB * D];    /* this stage's output */
    float dx[LB * D];   /* stage 1: the gradient of its input, for stage 0 */
    float *up_whole, *down_whole;
    int step, i, k, stage, hidden, first_hidden;
    dpar_status st = dpar_group_join(world_group, w, &world);
    md.world = world;
    md.dp = DP;
    md.tp = TP;
    md.pp = PP;
    DO(dpar_mesh_init(&mesh, &md)); /* the world split into my dp, tp and pp comms */
    stage = mesh.pp_rank;
    where[w][0] = mesh.dp_rank;
    where[w][1] = mesh.tp_rank;
    where[w][2] = mesh.pp_rank;
    mine[0] = mesh.dp_comm;
    mine[1] = mesh.tp_comm;
    mine[2] = mesh.pp_comm;
    for (i = 0; i < 3; i++) DO(dpar_allgather(mine[i], &w, group_of[w][i], 2, DPAR_I32)); /* 2: the total count */
    DO(block_init(b, stage, mesh.tp_comm, DPAR_LINEAR_COLUMN, DPAR_LINEAR_ROW)); /* my stage's block, my tp slice */
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        const float *x = data + mesh.dp_rank * LB * D;                             /* my replica's rows */
        const float *t = target + mesh.dp_rank * LB * D;                           /* and their targets */
        if (stage == 1) DO(dpar_recv(mesh.pp_comm, act, LB * D, DPAR_F32, 0, 0));  /* pp: stage 0's output */
        DO(block_forward(b, stage == 0 ? x : act, y, LB));                         /* tp: one allreduce */
        if (stage == 0) DO(dpar_send(mesh.pp_comm, y, LB * D, DPAR_F32, 1, 0));    /* pp: on to stage 1 */
        if (stage == 0) DO(dpar_recv(mesh.pp_comm, grad, LB * D, DPAR_F32, 1, 1)); /* pp: its gradient */
        for (i = 0; i < LB * D && stage == 1; i++) grad[i] = (y[i] - t[i]) / LB;   /* the loss's gradient */
        DO(block_backward(b, grad, stage == 1 ? dx : NULL, LB));                   /* tp: one allreduce on stage 1 */
        if (stage == 1) DO(dpar_send(mesh.pp_comm, dx, LB * D, DPAR_F32, 0, 1));   /* pp: back to stage 0 */
        DO(dpar_allreduce(mesh.dp_comm, b->up.dw, b->up.dw, D * b->up.out_local, DPAR_F32, DPAR_AVG)); /* dp */
        DO(dpar_allreduce(mesh.dp_comm, b->down.dw, b->down.dw, b->down.in_local * D, DPAR_F32, DPAR_AVG));
        sgd(b);
    }
    hidden = b->up.out_local; /* my hidden units: first_hidden .. first_hidden + hidden - 1 */
    first_hidden = b->up.out_offset;
    up_whole = got1[mesh.dp_rank][stage]; /* my replica's whole matrices */
    down_whole = got2[mesh.dp_rank][stage];
    for (i = 0; i < D && st == DPAR_OK; i++) /* my slices into them */
        for (k = 0; k < hidden; k++) {
            up_whole[i * F + first_hidden + k] = b->up.w[i * hidden + k];
            down_whole[(first_hidden + k) * D + i] = b->down.w[k * D + i];
        }
    dpar_linear_destroy(&b->up);
    dpar_linear_destroy(&b->down);
    dpar_mesh_destroy(&mesh);
    dpar_comm_destroy(world);
    (void)user;
    (void)n;
    return st;
}
static double worst(double d, double e) { return e <= d ? d : e; } /* a NaN counts as the worst */
int main(void)
{
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool;
    float act[GB * D];  /* block 0's output */
    float grad[GB * D]; /* the loss's gradient */
    float y[GB * D];    /* block 1's output */
    float dx[GB * D];   /* the gradient of block 1's input */
    double diff = 0;
    int i, k, w, s, step, same;
    int ok = 1;
    for (i = 0; i < GB * D; i++) {
        data[i] = uniform();
        target[i] = 0.5f * uniform();
    }
    for (i = 0; i < PP * D * F; i++) {
        W1[i] = 0.5f * uniform();
        W2[i] = 0.5f * uniform();
    }
    cd.size = N;
    pd.num_threads = N;
    if (dpar_group_create(&cd, &world_group) != DPAR_OK || dpar_pool_create(&pd, &pool) != DPAR_OK ||
        dpar_pool_run(pool, rank_main, NULL) != DPAR_OK) {
        fprintf(stderr, "07_hybrid: %s\n", dpar_last_error());
        return 1;
    }
    for (s = 0; s < PP; s++) ok &= block_init(&ref[s], s, NULL, DPAR_LINEAR_FULL, DPAR_LINEAR_FULL) == DPAR_OK;
    for (step = 0; step < STEPS && ok; step++) { /* the serial model: both blocks whole, the whole batch */
        ok &= block_forward(&ref[0], data, act, GB) == DPAR_OK && block_forward(&ref[1], act, y, GB) == DPAR_OK;
        loss[step] = 0;
        for (i = 0; i < GB * D; i++) { /* 0.5 |y - t|^2 / GB and its gradient */
            grad[i] = (y[i] - target[i]) / GB;
            loss[step] += 0.5f * grad[i] * (y[i] - target[i]);
        }
        ok &= block_backward(&ref[1], grad, dx, GB) == DPAR_OK && block_backward(&ref[0], dx, NULL, GB) == DPAR_OK;
        sgd(&ref[0]);
        sgd(&ref[1]);
    }
    printf("world  dp tp pp   dp comm  tp comm  pp comm   block  hidden units  batch rows\n");
    for (w = 0; w < N; w++) {
        const int *c = where[w];       /* its coordinates: dp, tp, pp */
        const int *g = group_of[w][0]; /* the world ranks of its dp comm */
        const int *t = group_of[w][1]; /* of its tp comm */
        const int *p = group_of[w][2]; /* of its pp comm */
        printf("%5d  %2d %2d %2d   {%d, %d}   {%d, %d}   {%d, %d}   %5d  %7d-%-6d %4d-%d\n", w, c[0], c[1], c[2], g[0],
               g[1], t[0], t[1], p[0], p[1], c[2], c[1] * F / TP, (c[1] + 1) * F / TP - 1, c[0] * LB,
               c[0] * LB + LB - 1);
        ok &= w == (c[2] * DP + c[0]) * TP + c[1]; /* Megatron's order: tp neighbours, then dp, pp outermost */
        for (k = 0; k < 2; k++) /* the members of my dp, tp and pp comms: my coordinates with one of them varied */
            ok &= g[k] == (c[2] * DP + k) * TP + c[1] && t[k] == (c[2] * DP + c[0]) * TP + k &&
                  p[k] == (k * DP + c[0]) * TP + c[1];
    }
    same = !memcmp(got1[0], got1[1], sizeof got1[0]) && !memcmp(got2[0], got2[1], sizeof got2[0]); /* dp copies */
    for (s = 0; s < PP; s++)
        for (i = 0; i < D * F; i++)
            diff = worst(worst(diff, fabs(got1[0][s][i] - ref[s].up.w[i])), fabs(got2[0][s][i] - ref[s].down.w[i]));
    if (ok) printf("mesh: every rank's coordinates and groups = Megatron's order, world = (pp * 2 + dp) * 2 + tp\n");
    if ((ok &= same) != 0) printf("replicas: the 2 data-parallel copies of every slice are identical bit for bit\n");
    if ((ok &= diff <= 1e-5 && loss[STEPS - 1] < 0.5f * loss[0]) != 0)
        printf("the slices = the serial model's weights after %d steps (max difference %.1e); loss %.5f -> %.5f\n",
               STEPS, diff, loss[0], loss[STEPS - 1]);
    for (s = 0; s < PP; s++) {
        dpar_linear_destroy(&ref[s].up);
        dpar_linear_destroy(&ref[s].down);
    }
    dpar_pool_destroy(pool);
    dpar_group_destroy(world_group);
    if (!ok) fprintf(stderr, "FAILED: a rank's mesh or slices differ from the formula or the serial model\n");
    return ok ? 0 : 1;
}
