/* zero.c - ZeRO-1: data-parallel Adam with the optimizer state cut over the ranks, next to plain Adam.
   Build: cc -std=c99 -O2 -I. examples/zero.c -o zero -pthread -lm
   Run:   ./zero            (./zero --ranks 3)
   Check: ^ +0  \[0, [0-9]+\) +[0-9]+ bytes
   Check: ^zero: [0-9]+ ranks, Adam state [0-9]+ bytes per rank instead of [0-9]+ .*replicas bitwise identical
   Check: the model bitwise equal to plain Adam.s, OK$

   In plain data parallelism every rank holds the whole model, its gradient and the whole optimizer
   state; for Adam that state (the two moments m and v) is twice the model. ZeRO stage 1 (DeepSpeed)
   notices that a rank needs the state only for the parameters it updates, and that any rank may
   update any block as long as everyone gets the result. So each step reduce-scatters the gradients
   (rank r receives the average of block r only), updates block r of the parameters with block r of
   the state, and all-gathers the parameters. The traffic is that of one allreduce (which is a
   reduce-scatter followed by an all-gather) and the state per rank is 1/N. Here N thread ranks train
   a 2-layer MLP, each on its own shard of the data, with dpar_zero_step on the layers' own arrays (W1,
   b1, W2, b2 and their gradients, listed as dpar_tensor: nothing repacked; dpar_zero copies through one
   staging array of its own), then train it again with plain data-parallel Adam (one flat array:
   allreduce of the gradients, every rank updating everything), and check: the state is 1/N, the loss
   fell, the replicas are identical, and both runs end with the same model (bitwise here: a ring
   allreduce is a reduce-scatter plus an all-gather, so each rank's block of the average has the same
   bits). */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define IN 16
#define HID 64
#define OUT 4
#define PER 64 /* samples per rank */
#define NPARAMS (IN * HID + HID + HID * OUT + OUT)
#define MAX_RANKS 16
#define MAX_STEPS 200
#define LR 0.01f
#define WD 0.01f

typedef struct job {
    int ranks, steps;
    float init[NPARAMS];      /* the starting model, flattened */
    float final[2][NPARAMS];  /* rank 0's model after ZeRO [0] and plain Adam [1] */
    float loss[2][MAX_STEPS]; /* the loss over all ranks' data */
    size_t state[MAX_RANKS], off[MAX_RANKS], len[MAX_RANKS];
    int identical[MAX_RANKS];
    dpar_group *group;
} job;

/* the flat vector is [W1 | b1 | W2 | b2]; copy the layers' parameters (or gradients) in or out (plain Adam's) */
static void flat_copy(dpar_linear *L, float *flat, int grads, int to_flat)
{
    float *part[4];
    size_t size[4] = {IN * HID, HID, HID * OUT, OUT}, at = 0;
    int k;
    part[0] = grads ? L[0].dw : L[0].w;
    part[1] = grads ? L[0].db : L[0].b;
    part[2] = grads ? L[1].dw : L[1].w;
    part[3] = grads ? L[1].db : L[1].b;
    for (k = 0; k < 4; at += size[k], k++)
        if (to_flat) memcpy(flat + at, part[k], size[k] * sizeof(float));
        else memcpy(part[k], flat + at, size[k] * sizeof(float));
}

/* the data of rank r: x uniform in [-1, 1], t = a smooth function of x, the same for every rank */
static void make_shard(int r, float *x, float *t)
{
    unsigned long long s = 1000 + (unsigned long long)r;
    int i, k;
    for (i = 0; i < PER * IN; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(s >> 40) / 8388608.0 - 1.0);
    }
    for (i = 0; i < PER; i++)
        for (k = 0; k < OUT; k++) t[i * OUT + k] = sinf(2.0f * x[i * IN + k]) * cosf(x[i * IN + k + OUT]);
}

/* plain Adam (AdamW) over all n parameters, the formula dpar_zero_step applies to its block */
static void adam(float *p, const float *g, float *m, float *v, size_t n, long step)
{
    float c1 = 1.0f - powf(0.9f, (float)step), c2 = 1.0f - powf(0.999f, (float)step);
    size_t i;
    for (i = 0; i < n; i++) {
        m[i] = 0.9f * m[i] + (1.0f - 0.9f) * g[i]; /* (1 - beta) in float, as dpar computes it */
        v[i] = 0.999f * v[i] + (1.0f - 0.999f) * g[i] * g[i];
        p[i] -= LR * ((m[i] / c1) / (sqrtf(v[i] / c2) + 1e-8f) + WD * p[i]);
    }
}

#define TRY(call)                                                              \
    do {                                                                       \
        if ((st = (call)) != DPAR_OK) {                                        \
            fprintf(stderr, "rank %d: %s: %s\n", r, #call, dpar_last_error()); \
            goto done;                                                         \
        }                                                                      \
    } while (0)

/* train with ZeRO-1 (sharded = 1) or plain data-parallel Adam (0) from the same start */
static dpar_status train(job *j, dpar_comm *c, int r, int sharded)
{
    float x[PER * IN], t[PER * OUT], h[PER * HID], a[PER * HID], y[PER * OUT], dy[PER * OUT], da[PER * HID];
    float params[NPARAMS], grads[NPARAMS], lo[NPARAMS], hi[NPARAMS], *m = NULL, *v = NULL;
    dpar_linear L[2];
    dpar_tensor pt[4], gt[4]; /* ZeRO-1's view of the model: the layers' arrays where they are */
    dpar_zero *z = NULL;
    dpar_zero_desc zd;
    dpar_linear_desc ld = {0}; /* FULL layers with a bias */
    dpar_status st = DPAR_OK;
    double loss;
    int step, i;
    memset(L, 0, sizeof L);
    make_shard(r, x, t);
    memcpy(params, j->init, sizeof params);
    ld.in = IN, ld.out = HID;
    TRY(dpar_linear_init(&L[0], &ld));
    ld.in = HID, ld.out = OUT;
    TRY(dpar_linear_init(&L[1], &ld));
    memset(&zd, 0, sizeof zd);
    zd.kind = DPAR_OPTIM_ADAM;
    zd.lr = LR;
    zd.weight_decay = WD;
    zd.comm = c;
    flat_copy(L, params, 0, 0); /* the starting model into the layers */
    if (sharded) {
        float *arr[4] = {L[0].w, L[0].b, L[1].w, L[1].b}, *grr[4] = {L[0].dw, L[0].db, L[1].dw, L[1].db};
        size_t size[4] = {IN * HID, HID, HID * OUT, OUT};
        for (i = 0; i < 4; i++) {
            pt[i].data = arr[i], pt[i].count = size[i], pt[i].dtype = DPAR_F32;
            gt[i].data = grr[i], gt[i].count = size[i], gt[i].dtype = DPAR_F32;
        }
        zd.params = pt, zd.grads = gt, zd.num_tensors = 4; /* count 0: their total */
        TRY(dpar_zero_create(&zd, &z));
        dpar_zero_shard(z, &j->off[r], &j->len[r]);
        j->state[r] = dpar_zero_state_bytes(z);
    } else if (!(m = (float *)calloc(2 * NPARAMS, sizeof(float)))) {
        st = dpar_set_error(DPAR_ENOMEM, "rank %d: out of memory", r);
        goto done;
    } else v = m + NPARAMS;
    for (step = 0; step < j->steps; step++) {
        if (!sharded) flat_copy(L, params, 0, 0); /* plain Adam's model into the layers (ZeRO-1 updates them) */
        TRY(dpar_linear_forward(&L[0], x, h, PER));
        for (i = 0; i < PER * HID; i++) a[i] = h[i] > 0 ? h[i] : 0;
        TRY(dpar_linear_forward(&L[1], a, y, PER));
        for (loss = 0, i = 0; i < PER * OUT; i++) {
            loss += (double)(y[i] - t[i]) * (y[i] - t[i]);
            dy[i] = 2.0f * (y[i] - t[i]) / (PER * OUT);
        }
        loss /= PER * OUT;
        dpar_linear_zero_grad(&L[0]);
        dpar_linear_zero_grad(&L[1]);
        TRY(dpar_linear_backward(&L[1], a, dy, da, PER));
        for (i = 0; i < PER * HID; i++) da[i] = h[i] > 0 ? da[i] : 0;
        TRY(dpar_linear_backward(&L[0], x, da, NULL, PER));
        if (sharded) TRY(dpar_zero_step(z, NULL, NULL)); /* the layers' arrays: reduce-scatter, Adam, all-gather */
        else {
            flat_copy(L, grads, 1, 1); /* this rank's gradient, flattened */
            TRY(dpar_allreduce(c, grads, grads, NPARAMS, DPAR_F32, DPAR_AVG));
            adam(params, grads, m, v, NPARAMS, step + 1); /* every rank updates everything */
        }
        TRY(dpar_allreduce(c, &loss, &loss, 1, DPAR_F64, DPAR_AVG)); /* the loss over all the data */
        if (r == 0) j->loss[!sharded][step] = (float)loss;
    }
    if (sharded) flat_copy(L, params, 0, 1); /* the layers' model, flattened to compare */
    /* the replicas must be identical: the MIN and the MAX over the ranks are the same bits */
    TRY(dpar_allreduce(c, params, lo, NPARAMS, DPAR_F32, DPAR_MIN));
    TRY(dpar_allreduce(c, params, hi, NPARAMS, DPAR_F32, DPAR_MAX));
    j->identical[r] = (sharded || j->identical[r]) && !memcmp(lo, hi, sizeof lo); /* both runs */
    if (r == 0) memcpy(j->final[!sharded], params, sizeof params);
done:
    if (z) dpar_zero_destroy(z);
    free(m);
    dpar_linear_destroy(&L[0]);
    dpar_linear_destroy(&L[1]);
    return st;
}

static dpar_status rank_main(void *user, int r, int n)
{
    job *j = (job *)user;
    dpar_comm *c;
    dpar_status st;
    (void)n;
    if ((st = dpar_group_join(j->group, r, &c)) != DPAR_OK) {
        fprintf(stderr, "rank %d: dpar_group_join: %s\n", r, dpar_last_error());
        return st;
    }
    if ((st = train(j, c, r, 1)) == DPAR_OK) st = train(j, c, r, 0);
    if (st != DPAR_OK) dpar_comm_abort(c); /* wake the other ranks instead of letting them time out */
    dpar_comm_destroy(c);
    return st;
}

int main(int argc, char **argv)
{
    static job j;
    dpar_pool_desc pd;
    dpar_comm_desc cd;
    dpar_pool *pool = NULL;
    dpar_status st;
    size_t unsharded = 2 * NPARAMS * sizeof(float), total = 0;
    double num = 0, den = 0, diff;
    char how[64];
    unsigned long long s = 5;
    int i, r, ok = 1, same = 1;
    j.ranks = 4;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ranks") && i + 1 < argc) j.ranks = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--ranks N]\n", argv[0]);
            return 2;
        }
    }
    if (j.ranks < 1 || j.ranks > MAX_RANKS) {
        fprintf(stderr, "zero: --ranks must be 1..%d\n", MAX_RANKS);
        return 2;
    }
    j.steps = getenv("DPAR_TEST_QUICK") ? 60 : MAX_STEPS;
    for (i = 0; i < NPARAMS; i++) { /* uniform in +-0.3, biases included */
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        j.init[i] = (float)((double)(s >> 40) / 8388608.0 - 1.0) * 0.3f;
    }
    memset(&pd, 0, sizeof pd);
    memset(&cd, 0, sizeof cd);
    pd.num_threads = cd.size = j.ranks;
    if ((st = dpar_pool_create(&pd, &pool)) == DPAR_OK && (st = dpar_group_create(&cd, &j.group)) == DPAR_OK)
        st = dpar_pool_run(pool, rank_main, &j);
    if (st != DPAR_OK) {
        fprintf(stderr, "zero: %s\n", dpar_last_error());
        return 1;
    }
    dpar_group_destroy(j.group);
    dpar_pool_destroy(pool);

    printf("zero: a %d -> %d -> %d MLP, %d parameters, Adam on %d data-parallel ranks, %d samples each\n", IN, HID, OUT,
           NPARAMS, j.ranks, PER);
    printf("rank  its block of the parameters   Adam state (m, v)   unsharded Adam   fraction\n");
    for (r = 0; r < j.ranks; r++) {
        printf("%4d  [%zu, %zu)%*s%8zu bytes   %8zu bytes   %.3f\n", r, j.off[r], j.off[r] + j.len[r],
               (int)(22 - snprintf(NULL, 0, "[%zu, %zu)", j.off[r], j.off[r] + j.len[r])), "", j.state[r], unsharded,
               (double)j.state[r] / unsharded);
        ok &= j.state[r] == 2 * j.len[r] * sizeof(float); /* exactly the state of my block */
        total += j.state[r];
        same &= j.identical[r];
    }
    ok &= total == unsharded; /* the blocks cover every parameter once */
    for (i = 0; i < j.steps; i++)
        if (i % (j.steps / 5) == 0 || i == j.steps - 1)
            printf("step %3d  loss ZeRO-1 %.6f  plain Adam %.6f\n", i, j.loss[0][i], j.loss[1][i]);
    for (i = 0; i < NPARAMS; i++) { /* the two runs: max |difference| / max |parameter| */
        num = fmax(num, fabs((double)j.final[0][i] - j.final[1][i]));
        den = fmax(den, fabs((double)j.final[1][i]));
    }
    diff = num / den;
    snprintf(how, sizeof how, diff == 0 ? "bitwise equal to" : "within %.1e of", diff);
    ok &= same && diff == 0 && j.loss[0][j.steps - 1] < 0.5f * j.loss[0][0]; /* the gate: bitwise, as claimed */
    printf("zero: %d ranks, Adam state %zu bytes per rank instead of %zu (%.3f, 1/N = %.3f), loss %.6f -> %.6f, "
           "replicas %s, the model %s plain Adam's, %s\n",
           j.ranks, j.state[0], unsharded, (double)j.state[0] / unsharded, 1.0 / j.ranks, j.loss[0][0],
           j.loss[0][j.steps - 1], same ? "bitwise identical" : "DIFFER", how, ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
}
