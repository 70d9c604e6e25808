/* tensor_parallel.c - a Megatron MLP block split over tensor-parallel thread ranks, trained against the whole block.
   Build: cc -std=c99 -O2 -I. examples/tensor_parallel.c -o tensor_parallel -pthread -lm
   Run:   ./tensor_parallel            (./tensor_parallel --tp 4, ./tensor_parallel --bitwise)
   Check: ^tensor_parallel: tp=[0-9]+ matches the whole block
   Check: allreduces per step: 2 \(1 forward, 1 backward\)

   Tensor parallelism cuts each weight matrix over tp ranks instead of giving each rank whole layers.
   Megatron-LM's MLP block y = GeLU(x W1 + b1) W2 + b2 is cut so that it needs almost no talking:
   W1 by output columns (DPAR_LINEAR_COLUMN: rank r computes its own slice of the hidden units from
   the whole x, no communication), GeLU elementwise on that slice, then W2 by input rows
   (DPAR_LINEAR_ROW: rank r multiplies its hidden slice by its rows of W2, which gives a partial sum
   of y, and one allreduce adds the partial sums). Backward mirrors it: the row layer gives each rank
   the gradient of its own hidden slice for free, and the column layer needs one allreduce to add up
   the gradient of x (which the layers below would need). The program trains the block on a
   synthetic regression task with tp thread ranks, then trains the whole block (DPAR_LINEAR_FULL, no
   comm) from the same weights, and checks that the two loss curves agree, that the loss fell, and,
   from the comm's counters, that each step cost exactly two allreduces.

   The curves agree to about 1e-7, not to the bit: with tp ranks the row layer's allreduce adds tp partial sums of
   y, each summed over F/tp hidden units, where one thread sums all F in one GEMM; float addition in another order
   rounds differently. --bitwise removes that: every layer is made with desc.leaves = 4 (dpar_linear, 'Leaves'),
   so each sum over a cut dimension is 4 fixed partial products added in one fixed tree, whichever rank computed
   which; the ranks all-gather partials instead of allreducing sums. Then the whole block and tp = 2 and 4 train
   to the same bits, which the program checks (every weight and every step's loss) and times: --bench prints the
   step time of tp = 2 with and without leaves. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define D 16 /* width of the block's input and output */
#define F 64 /* hidden width (4 x D, as in a transformer) */
#define B 64 /* rows of the batch */
#define MAX_STEPS 400
#define LR 0.2f

typedef struct job {
    int tp, whole, steps;                     /* whole: one rank, DPAR_LINEAR_FULL */
    int leaves;                               /* --bitwise: every layer's leaves (0: off) */
    float w1[D * F], b1[F], w2[F * D], b2[D]; /* the starting weights of both runs */
    float x[B * D], t[B * D];                 /* inputs and targets */
    float loss[MAX_STEPS], dx[B * D];         /* the loss curve; the input's gradient at the last step */
    float trained_w1[D * F], trained_b1[F];   /* the weights after training, put together from the ranks' slices */
    float trained_w2[F * D], trained_b2[D];
    double seconds;                            /* rank 0's training time */
    uint64_t allreduce_calls, allreduce_bytes; /* on rank 0, over the whole run */
    dpar_group *group;
} job;

static float uniform(unsigned long long *s, float lo, float hi)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (float)((double)(*s >> 40) / 16777216.0);
}

/* GeLU, tanh form (as in GPT-2), and its derivative */
static float gelu(float v) { return 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v))); }
static float gelu_grad(float v)
{
    float th = tanhf(0.7978845608f * (v + 0.044715f * v * v * v));
    return 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * v * v);
}

#define TRY(call)                                                                        \
    do {                                                                                 \
        if ((st = (call)) != DPAR_OK) {                                                  \
            fprintf(stderr, "rank %d: %s failed: %s\n", rank, #call, dpar_last_error()); \
            goto done;                                                                   \
        }                                                                                \
    } while (0)

/* one rank's training: its column slice of W1 and row slice of W2 */
static dpar_status train_rank(job *j, dpar_comm *c, int rank)
{
    static const dpar_linear_mode modes[2][2] = {{DPAR_LINEAR_COLUMN, DPAR_LINEAR_ROW},
                                                 {DPAR_LINEAR_FULL, DPAR_LINEAR_FULL}};
    float h[B * F], a[B * F], da[B * F], y[B * D], dy[B * D], dx[B * D];
    dpar_linear up, down;
    dpar_linear_desc ud = {0}, dd = {0};
    dpar_comm_stats stats;
    dpar_status st = DPAR_OK;
    int step, i, f;
    memset(&up, 0, sizeof up);
    memset(&down, 0, sizeof down);
    uint64_t start = dpar_time_ns();
    ud.mode = modes[j->whole][0], ud.in = D, ud.out = F, ud.comm = c;
    dd.mode = modes[j->whole][1], dd.in = F, dd.out = D, dd.comm = c;
    ud.leaves = j->leaves;
    dd.leaves = j->leaves;
    TRY(dpar_linear_init(&up, &ud));                 /* W1 (D x F/tp): my hidden units */
    TRY(dpar_linear_init(&down, &dd));               /* W2 (F/tp x D): their rows */
    TRY(dpar_linear_set_weights(&up, j->w1, j->b1)); /* each rank keeps its slice */
    TRY(dpar_linear_set_weights(&down, j->w2, j->b2));
    f = up.out_local; /* my hidden units */
    for (step = 0; step < j->steps; step++) {
        double loss = 0;
        TRY(dpar_linear_forward(&up, j->x, h, B)); /* (B x f): no communication */
        for (i = 0; i < B * f; i++) a[i] = gelu(h[i]);
        TRY(dpar_linear_forward(&down, a, y, B)); /* (B x D): allreduce #1 adds the partial sums */
        for (i = 0; i < B * D; i++) {             /* every rank has all of y: the loss is the same everywhere */
            float e = y[i] - j->t[i];
            loss += (double)e * e;
            dy[i] = 2.0f * e / (B * D);
        }
        if (rank == 0) j->loss[step] = (float)(loss / (B * D));
        dpar_linear_zero_grad(&up);
        dpar_linear_zero_grad(&down);
        TRY(dpar_linear_backward(&down, a, dy, da, B)); /* da (B x f): my slice, no communication */
        for (i = 0; i < B * f; i++) da[i] *= gelu_grad(h[i]);
        TRY(dpar_linear_backward(&up, j->x, da, dx, B)); /* dx (B x D): allreduce #2 */
        for (i = 0; i < up.in_local * up.out_local; i++) up.w[i] -= LR * up.dw[i];
        for (i = 0; i < up.bias_local; i++) up.b[i] -= LR * up.db[i];
        for (i = 0; i < down.in_local * down.out_local; i++) down.w[i] -= LR * down.dw[i];
        for (i = 0; i < down.bias_local; i++) down.b[i] -= LR * down.db[i]; /* the same on every rank */
    }
    /* this rank's slices into the whole trained weights: W1's columns, b1's entries, W2's rows (b2: whole) */
    for (i = 0; i < D; i++) {
        float *row_of_w1 = j->trained_w1 + (size_t)i * F + up.out_offset;
        memcpy(row_of_w1, up.w + (size_t)i * up.out_local, (size_t)up.out_local * sizeof(float));
    }
    memcpy(j->trained_b1 + up.out_offset, up.b, (size_t)up.out_local * sizeof(float));
    memcpy(j->trained_w2 + (size_t)down.in_offset * D, down.w, (size_t)down.in_local * D * sizeof(float));
    if (rank == 0) memcpy(j->trained_b2, down.b, sizeof j->trained_b2);
    if (rank == 0) {
        j->seconds = (double)(dpar_time_ns() - start) * 1e-9;
        memcpy(j->dx, dx, sizeof dx);
        if (c) {
            TRY(dpar_comm_stats_get(c, &stats));
            j->allreduce_calls = stats.by_coll[DPAR_COLL_ALLREDUCE].calls;
            j->allreduce_bytes =
                stats.by_coll[DPAR_COLL_ALLREDUCE].bytes_sent + stats.by_coll[DPAR_COLL_ALLREDUCE].bytes_received;
        }
    }
done:
    dpar_linear_destroy(&up);
    dpar_linear_destroy(&down);
    return st;
}

static dpar_status rank_main(void *user, int rank, int n)
{
    job *j = (job *)user;
    dpar_comm *c = NULL;
    dpar_status st;
    (void)n;
    if (!j->whole && (st = dpar_group_join(j->group, rank, &c)) != DPAR_OK) {
        fprintf(stderr, "rank %d: dpar_group_join: %s\n", rank, dpar_last_error());
        return st;
    }
    st = train_rank(j, c, rank);
    if (c) {
        if (st != DPAR_OK) dpar_comm_abort(c); /* wake the other ranks instead of letting them time out */
        dpar_comm_destroy(c);
    }
    return st;
}

/* train with tp thread ranks (or the whole block on one thread) */
static int train(job *j, int tp, int whole)
{
    dpar_pool_desc pd;
    dpar_comm_desc cd;
    dpar_pool *pool = NULL;
    dpar_status st;
    memset(&pd, 0, sizeof pd);
    memset(&cd, 0, sizeof cd);
    j->tp = pd.num_threads = cd.size = tp;
    j->whole = whole;
    j->group = NULL;
    if ((st = dpar_pool_create(&pd, &pool)) == DPAR_OK && (st = dpar_group_create(&cd, &j->group)) == DPAR_OK)
        st = dpar_pool_run(pool, rank_main, j);
    if (st != DPAR_OK) fprintf(stderr, "tensor_parallel: %s\n", dpar_last_error());
    if (j->group) dpar_group_destroy(j->group);
    if (pool) dpar_pool_destroy(pool);
    return st == DPAR_OK;
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

/* --bitwise: the whole block and tp = 2 and 4, every layer with 4 leaves: the same bits, or exit 1 */
static int bitwise(job *j, int bench)
{
    static job whole;
    static const int tps[] = {2, 4};
    int k, s, all_equal = 1;
    double plain_seconds = 0;
    whole = *j;
    whole.leaves = 4;
    if (!train(&whole, 1, 1)) return 1;
    for (k = 0; k < 2; k++) {
        int same_weights, same_loss = 1, same_dx;
        j->leaves = 4;
        if (!train(j, tps[k], 0)) return 1;
        for (s = 0; s < j->steps; s++) same_loss &= memcmp(&j->loss[s], &whole.loss[s], sizeof(float)) == 0;
        same_weights = !memcmp(j->trained_w1, whole.trained_w1, sizeof whole.trained_w1) &&
                       !memcmp(j->trained_b1, whole.trained_b1, sizeof whole.trained_b1) &&
                       !memcmp(j->trained_w2, whole.trained_w2, sizeof whole.trained_w2) &&
                       !memcmp(j->trained_b2, whole.trained_b2, sizeof whole.trained_b2);
        same_dx = !memcmp(j->dx, whole.dx, sizeof whole.dx);
        printf("tensor_parallel --bitwise: tp=%d, 4 leaves, against the whole block: losses of %d steps %s, trained "
               "weights %s, input gradient %s\n",
               tps[k], j->steps, same_loss ? "bitwise equal" : "DIFFERENT",
               same_weights ? "bitwise equal" : "DIFFERENT", same_dx ? "bitwise equal" : "DIFFERENT");
        all_equal &= same_loss && same_weights && same_dx;
    }
    if (bench) { /* the price of the leaves: tp = 2, the same steps with and without them */
        double leaves_seconds;
        j->leaves = 0;
        if (!train(j, 2, 0)) return 1;
        plain_seconds = j->seconds;
        j->leaves = 4;
        if (!train(j, 2, 0)) return 1;
        leaves_seconds = j->seconds;
        printf("bench=tp_bitwise tp=2 leaves=4 steps=%d step_us=%.1f plain_step_us=%.1f cost=%.2f\n", j->steps,
               leaves_seconds * 1e6 / j->steps, plain_seconds * 1e6 / j->steps, leaves_seconds / plain_seconds);
    }
    printf("tensor_parallel --bitwise: the whole block, tp=2 and tp=4 %s\n",
           all_equal ? "train to the same bits: OK" : "DIFFER: FAILED");
    return all_equal ? 0 : 1;
}

int main(int argc, char **argv)
{
    static job j;
    float loss_tp[MAX_STEPS], dx_tp[B * D], teacher[D * D];
    double worst = 0, dx_diff;
    uint64_t calls, bytes;
    unsigned long long seed = 1;
    int tp = 2, i, k, s, ok, bitwise_check = 0, bench = 0;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tp") && i + 1 < argc) tp = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--bitwise")) bitwise_check = 1;
        else if (!strcmp(argv[i], "--bench")) bench = bitwise_check = 1;
        else {
            fprintf(stderr, "usage: %s [--tp N] [--bitwise] [--bench]\n", argv[0]);
            return 2;
        }
    }
    if (tp < 1 || tp > F) {
        fprintf(stderr, "tensor_parallel: --tp must be 1..%d\n", F);
        return 2;
    }
    j.steps = getenv("DPAR_TEST_QUICK") ? 100 : MAX_STEPS;

    /* the task: t = sin(x A), a smooth function of x; the weights: uniform, scaled by 1/sqrt(fan-in) */
    for (i = 0; i < D * D; i++) teacher[i] = uniform(&seed, -1, 1);
    for (i = 0; i < B * D; i++) j.x[i] = uniform(&seed, -1, 1);
    for (i = 0; i < B; i++)
        for (k = 0; k < D; k++) {
            float z = 0;
            for (s = 0; s < D; s++) z += j.x[i * D + s] * teacher[s * D + k];
            j.t[i * D + k] = sinf(0.5f * z);
        }
    for (i = 0; i < D * F; i++) j.w1[i] = uniform(&seed, -1, 1) * 0.25f;  /* 1/sqrt(16) */
    for (i = 0; i < F * D; i++) j.w2[i] = uniform(&seed, -1, 1) * 0.125f; /* 1/sqrt(64) */
    for (i = 0; i < F; i++) j.b1[i] = uniform(&seed, -0.1f, 0.1f);
    for (i = 0; i < D; i++) j.b2[i] = 0;

    printf("tensor_parallel: Megatron MLP block %d -> %d -> %d (column-parallel, GeLU, row-parallel), batch %d, "
           "%d steps of SGD\n",
           D, F, D, B, j.steps);
    if (bitwise_check) return bitwise(&j, bench);
    if (!train(&j, tp, 0)) return 1;
    memcpy(loss_tp, j.loss, sizeof loss_tp);
    memcpy(dx_tp, j.dx, sizeof dx_tp);
    calls = j.allreduce_calls;
    bytes = j.allreduce_bytes;
    if (!train(&j, 1, 1)) return 1; /* the reference: the whole block, one thread, no comm */

    printf("step  loss tp=%-2d    loss whole    relative difference\n", tp);
    for (s = 0; s < j.steps; s++) {
        double d = fabs((double)loss_tp[s] - j.loss[s]) / j.loss[s];
        if (d > worst) worst = d;
        if (s % (j.steps / 8) == 0 || s == j.steps - 1)
            printf("%4d  %.6f      %.6f      %.1e\n", s, loss_tp[s], j.loss[s], d);
    }
    dx_diff = rel_diff(dx_tp, j.dx, B * D);
    printf("allreduces per step: %g (1 forward, 1 backward); rank 0 sent + received %.0f bytes "
           "per step (y and dx are %d x %d floats each)\n",
           (double)calls / j.steps, (double)bytes / j.steps, B, D);
    ok = worst <= 1e-5 && dx_diff <= 1e-5 && j.loss[j.steps - 1] < 0.5f * j.loss[0] && calls == 2u * (uint64_t)j.steps;
    printf("tensor_parallel: tp=%d %s the whole block: loss %.6f -> %.6f, curves within %.1e, input gradient within "
           "%.1e, %s\n",
           tp, ok ? "matches" : "DOES NOT MATCH", loss_tp[0], loss_tp[j.steps - 1], worst, dx_diff,
           ok ? "OK" : "FAILED");
    if (j.loss[j.steps - 1] >= 0.5f * j.loss[0]) fprintf(stderr, "tensor_parallel: the loss did not halve\n");
    if (calls != 2u * (uint64_t)j.steps)
        fprintf(stderr, "tensor_parallel: %llu allreduces in %d steps, expected 2 per step\n",
                (unsigned long long)calls, j.steps);
    return ok ? 0 : 1;
}
