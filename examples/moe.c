/* moe.c - a mixture-of-experts layer with expert parallelism over thread ranks, bitwise equal to one rank.
   Build: cc -std=c99 -O2 -I. examples/moe.c -o moe -pthread -lm
   Run:   ./moe            (./moe --ranks 1,2,4 --experts 8 --k 1 --capacity 0.8; ./moe --gradcheck)
   Check: ^moe ranks=2 experts=4 k=2 .*bitwise equal to 1 rank: yes$
   Check: ^moe ranks=4 experts=4 k=2 .*bitwise equal to 1 rank: yes$
   Check: ^expert 3: tokens [0-9]+ kept [0-9]+ dropped [0-9]+$
   Check: dpar.s counters \(alltoallv calls and bytes\) agree: yes$

   The model: x (T tokens x D) -> u = tanh(x Wd + bd), a dense layer (data-parallel; --no-dense: u = x)
   -> the MoE layer: router probabilities p = softmax(u Wr) (Wr: D x E), each token's top-k experts
   (k = 1 or 2, ties to the lower index), each expert an MLP D -> H -> D with GELU, and the layer's
   output y = sum over the token's kept choices of p_e * expert_e(u). The loss is the mean squared error
   to a fixed teacher target plus Switch Transformer's load-balancing loss alpha * E * sum_e f_e P_e
   (f_e: the fraction of the T * k choices that went to e before capacity, a constant; P_e: the mean of
   p_e over the tokens). Plain SGD on everything, with the full backward pass.

   Expert parallelism with data parallelism: N thread ranks, rank r holds tokens [r T/N, (r+1) T/N)
   and experts [r E/N, (r+1) E/N). Wd, bd and Wr are replicated; their gradients are summed with
   dpar_allreduce. An expert's weights live only on its owner: dpar_alltoallv sends each kept
   (token, expert) row of u to the owner (dispatch), a second one brings the expert outputs back
   (combine), and backward runs the pair in reverse (combine's backward carries p_e dy to the owner,
   where the expert's weight gradients are formed; dispatch's backward brings du home).

   Capacity, the same for any N. cap = ceil(capacity * T * k / E) rows per expert. The choices are
   ranked globally by (slot, rank, token): every top-1 choice before any top-2 choice (GShard's
   priority), and within a slot by token, i.e. rank by rank since ranks hold consecutive tokens. An
   expert keeps its first cap choices in that order; the rest are dropped (their output is 0, and the
   aux loss still counts them in f_e). To apply it every rank needs everyone's counts per (slot,
   expert): one dpar_allgather of k x E ints per rank. From the same counts every rank also computes
   how many rows it receives from each peer, so receive counts are known in advance and the alltoallv
   contract check compares two independent computations (dpar_alltoallv_counts would only copy the
   senders' counts, and could not catch --wrong-count).

   Bitwise equal to one rank. Every sum over tokens runs in an order that does not depend on N:
   (1) rows reach an expert's owner in global token order (each rank sends its rows for expert e in
   token order, and alltoallv places the blocks by source rank), so the owner's GEMMs, the weight
   gradients included (dW = X^T dY, a sum over all of the expert's rows), are the same calls with the
   same operands for every N; (2) the token side works on L = 8 fixed leaves of T/L tokens: every
   GEMM there has T/L rows, and the replicated weights' gradients are summed per leaf, then over the
   leaves with dpar_tree_reduce and a deterministic comm's dpar_allreduce, which finish one fixed tree
   for N = 1, 2, 4, 8 (docs/comm.md, 'Deterministic'); the loss's sums go the same way in double.
   The program trains with N = 1 and then with each N of --ranks from the same start, and compares the
   loss of every step and a CRC32 of all parameters: it exits 1 unless they are equal bit for bit.

   Why an example and not dpar.h: an MoE layer is a model choice (router, gate normalization, capacity
   and drop policy, expert shape), built here from dpar's primitives (dpar_alltoallv, dpar_allgather,
   dpar_sgemm, dpar_allreduce, dpar_tree_reduce), the way llm.c keeps its layers in the trainer.

   --gradcheck compares the backward pass with central differences of the loss (router, dense and
   expert weights, the aux loss on), in float with eps = 1e-3, skipping an entry whose step changes any
   token's choices (the routing is piecewise constant). It passes when |a - n| <= 1e-2 (|a| + |n| + 1e-4)
   for the backward's a and the difference's n: the gradients checked are 4e-6 to 4e-3, the differences
   they show 1.3e-7 at most (float rounding of the loss), so the 1e-4 floor allows 10 times that noise at
   the smallest ones; the planted bugs it catches give 0.53 and 0.87. --wrong-count makes the last
   rank send one row too many to rank 0 in the first dispatch: every rank must fail with
   DPAR_EMISMATCH naming both ranks and both counts (the program then exits 1).
   --trace FILE writes a Chrome trace (spans router, dispatch, experts, combine, backward).

   Over MPI: `mpicc -std=c99 -O2 -DDPAR_MPI -I. examples/moe.c -o moe_mpi -pthread -lm`, then
   `mpirun -np 2 ./moe_mpi` (1, 2, 4 processes; --k, --capacity, --wrong-count as above): each process is
   one rank of a deterministic dpar_comm_from_mpi comm, each first makes the one-rank run on a thread of
   its own, and after training the experts are gathered (dpar_allgather) and the bits compared. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define T 64 /* tokens in the global batch */
#define D 16 /* model width */
#define H 32 /* an expert's hidden width */
#define E_MAX 8
#define K_MAX 2
#define L 8 /* leaves: fixed blocks of T/L tokens, the unit of every token-side GEMM and sum */
#define TB (T / L)
#define MAX_RANKS 8
#define MAX_STEPS 1000
#define PE (D * H + H + H * D + D)        /* one expert: W1 (D x H), b1, W2 (H x D), b2 */
#define REP_MAX (D * D + D + D * E_MAX)   /* replicated: Wd (D x D), bd, Wr (D x E) */
#define OFF_BD (D * D)                    /* where bd starts in the replicated block */
#define OFF_WR (D * D + D)                /* where Wr starts */
#define NPARAM_MAX (REP_MAX + E_MAX * PE) /* the whole model: replicated block, then expert 0, 1, ... */
#define GC_MAX 128                        /* gradient-check entries */
#define ROWS_MAX (K_MAX * T)              /* rows a rank sends, at most */
#define STATS (1 + E_MAX)                 /* per leaf: squared error, then sum of p_e per expert */

typedef struct config {
    int experts, k, steps, dense, wrong_count, gradcheck;
    double capacity, alpha, lr;
} config;

typedef struct job {
    config cfg;
    int n;   /* ranks of this run */
    int mpi; /* 1: this process is one rank of an MPI run */
    dpar_group *group;
    float x[T * D], target[T * D];
    float params[NPARAM_MAX];          /* in: the start; out: the end (each rank writes its experts, rank 0 the rest) */
    float rep_end[MAX_RANKS][REP_MAX]; /* each rank's copy of the replicated weights at the end */
    double loss[MAX_STEPS];
    int routed[E_MAX], kept[E_MAX]; /* the last step */
    long dropped;                   /* over all steps */
    dpar_status status[MAX_RANKS];
    uint64_t counted[MAX_RANKS], counted_self[MAX_RANKS]; /* alltoallv bytes each rank sent to others, to itself */
    uint64_t a2a_calls[MAX_RANKS], a2a_bytes[MAX_RANKS];  /* and what dpar's counters say */
    int recv_rows[MAX_RANKS];                             /* the most rows each rank's experts received in a step */
    char error[512];                                      /* rank 0's dpar_last_error() */
    int gc_count, gc_off[GC_MAX], gc_skipped[GC_MAX];
    double gc_ana[GC_MAX], gc_num[GC_MAX];
} job;

typedef struct rank_state {
    job *j;
    dpar_comm *c;
    int r, n, el, e0, tl, t0, leaf0, nleaf, cap; /* experts el from e0; tokens tl from t0; leaves nleaf from leaf0 */
    float rep[REP_MAX], drep[REP_MAX], gleaf[L][REP_MAX];
    float ex[E_MAX][PE], dex[E_MAX][PE];
    float u[T * D], logit[T * E_MAX], p[T * E_MAX], dp[T * E_MAX], y[T * D], du[T * D];
    int choice[T][K_MAX], row[T][K_MAX];                     /* row in the dispatch layout; -1: dropped */
    int mine[K_MAX * E_MAX], cnt[MAX_RANKS * K_MAX * E_MAX]; /* my counts per (slot, expert); everyone's */
    int keptq[MAX_RANKS][E_MAX], first[K_MAX][E_MAX], routed[E_MAX], kept[E_MAX], m[E_MAX];
    size_t sc[MAX_RANKS], sd[MAX_RANKS], rc[MAX_RANKS], rd[MAX_RANKS];
    float sendu[ROWS_MAX * D + D], back[ROWS_MAX * D], dback[ROWS_MAX * D], duback[ROWS_MAX * D];
    float flat[E_MAX * T * D], flat2[E_MAX * T * D];
    float xe[E_MAX][T * D], hpre[E_MAX][T * H], act[E_MAX][T * H], oe[E_MAX][T * D], dh[E_MAX][T * H];
    double stats[L][STATS], total[STATS];
    int step;
    uint64_t counted, counted_self; /* alltoallv bytes sent to other ranks, and to myself */
} rank_state;

static float urand(unsigned long long *s) /* uniform in [-1, 1) */
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 40) / 8388608.0 - 1.0);
}

/* GELU, tanh form (as in GPT-2), and its derivative */
static float gelu(float v) { return 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v))); }
static float gelu_grad(float v)
{
    float th = tanhf(0.7978845608f * (v + 0.044715f * v * v * v));
    return 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * v * v);
}

static int off_experts(int E) { return D * D + D + D * E; } /* expert 0's first parameter in the whole model */

static void span(const char *name, uint64_t begin)
{
    if (dpar_trace_enabled()) dpar_trace_event(name, "moe", begin, dpar_time_ns(), NULL);
}

#define TRY(call)                                \
    do {                                         \
        if ((st = (call)) != DPAR_OK) return st; \
    } while (0)

/* move rows between the layout alltoallv receives (by source rank, then my experts) and one block per expert
   (xe-like arrays, T rows each); to_experts: flat -> per, else per -> flat */
static void repack(rank_state *s, float *flat, float (*per)[T * D], int to_experts)
{
    int q, i;
    for (i = 0; i < s->el; i++) s->m[i] = 0;
    for (q = 0; q < s->n; q++) {
        size_t at = s->rd[q] / D;
        for (i = 0; i < s->el; i++) {
            int c = s->keptq[q][s->e0 + i];
            size_t bytes = (size_t)c * D * sizeof(float);
            if (to_experts) memcpy(per[i] + (size_t)s->m[i] * D, flat + at * D, bytes);
            else memcpy(flat + at * D, per[i] + (size_t)s->m[i] * D, bytes);
            s->m[i] += c;
            at += (size_t)c;
        }
    }
}

/* route: top-k choices of my tokens, everyone's counts, the global capacity rule, the dispatch layout */
static dpar_status route(rank_state *s)
{
    const config *cf = &s->j->cfg;
    int E = cf->experts, K = cf->k, t, k, e, q, rows, run[K_MAX][E_MAX];
    dpar_status st;
    memset(s->mine, 0, sizeof s->mine);
    for (t = 0; t < s->tl; t++) {
        const float *p = s->p + t * E;
        for (k = 0; k < K; k++) {
            int best = -1;
            for (e = 0; e < E; e++)
                if ((k == 0 || e != s->choice[t][0]) && (best < 0 || p[e] > p[best])) best = e;
            s->choice[t][k] = best;
            s->mine[k * E_MAX + best]++;
        }
    }
    /* everyone's counts per (slot, expert), in rank order */
    TRY(dpar_allgather(s->c, s->mine, s->cnt, (size_t)s->n * K_MAX * E_MAX, DPAR_I32));
    /* the global order (slot, rank, token): an expert keeps its first cap choices */
    for (e = 0; e < E; e++) {
        int seen = 0; /* choices of e before the current (slot, rank) */
        s->routed[e] = s->kept[e] = 0;
        for (q = 0; q < s->n; q++) s->keptq[q][e] = 0;
        for (k = 0; k < K; k++)
            for (q = 0; q < s->n; q++) {
                int c = s->cnt[(q * K_MAX + k) * E_MAX + e], room = s->cap - seen;
                int take = room <= 0 ? 0 : c < room ? c : room;
                if (q == s->r) s->first[k][e] = seen; /* my tokens' choices of e in slot k come from here */
                s->keptq[q][e] += take;
                s->routed[e] += c;
                s->kept[e] += take;
                seen += c;
            }
    }
    memset(run, 0, sizeof run);
    for (t = 0; t < s->tl; t++)
        for (k = 0; k < K; k++) {
            e = s->choice[t][k];
            s->row[t][k] = s->first[k][e] + run[k][e]++ < s->cap ? 0 : -1; /* kept: a row comes below */
        }
    /* the dispatch layout: by destination rank, then its experts, then my tokens in order */
    rows = 0;
    for (q = 0; q < s->n; q++) {
        s->sd[q] = (size_t)rows * D;
        for (e = q * s->el; e < (q + 1) * s->el; e++)
            for (t = 0; t < s->tl; t++)
                for (k = 0; k < K; k++)
                    if (s->choice[t][k] == e && s->row[t][k] >= 0) {
                        s->row[t][k] = rows;
                        memcpy(s->sendu + (size_t)rows * D, s->u + (size_t)t * D, D * sizeof(float));
                        rows++;
                    }
        s->sc[q] = (size_t)rows * D - s->sd[q];
    }
    /* what I receive: rank q's kept rows for my experts, in the order rank q sends them */
    rows = 0;
    for (q = 0; q < s->n; q++) {
        s->rd[q] = (size_t)rows * D;
        for (e = s->e0; e < s->e0 + s->el; e++) rows += s->keptq[q][e];
        s->rc[q] = (size_t)rows * D - s->rd[q];
    }
    return DPAR_OK;
}

/* the bytes of this step's four alltoallvs: dispatch and combine's backward send sc, combine and dispatch's
   backward send rc */
static void count_traffic(rank_state *s)
{
    int q;
    for (q = 0; q < s->n; q++) {
        uint64_t b = 2 * (uint64_t)(s->sc[q] + s->rc[q]) * sizeof(float);
        if (q == s->r) s->counted_self += b;
        else s->counted += b;
    }
}

/* forward: the loss (the same double on every rank) and a checksum of every token's choices */
static dpar_status forward(rank_state *s, double *loss, int64_t *signature)
{
    const config *cf = &s->j->cfg;
    int E = cf->experts, K = cf->k, l, i, t, k, e, jj;
    const float *wd = s->rep, *bd = s->rep + OFF_BD, *wr = s->rep + OFF_WR;
    const void *leaves[L];
    int64_t sig;
    uint64_t t0 = dpar_time_ns();
    dpar_status st;
    /* dense layer and router, leaf by leaf: u = tanh(x Wd + bd) (TB x D), logits = u Wr (TB x E) */
    for (l = 0; l < s->nleaf; l++) {
        const float *x = s->j->x + (size_t)(s->t0 + l * TB) * D;
        float *u = s->u + (size_t)l * TB * D;
        if (cf->dense) {
            TRY(dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, TB, D, D, 1.0f, x, D, wd, D, 0.0f, u, D));
            for (i = 0; i < TB * D; i++) u[i] = tanhf(u[i] + bd[i % D]);
        } else {
            memcpy(u, x, TB * D * sizeof(float));
        }
        TRY(dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, TB, E, D, 1.0f, u, D, wr, E, 0.0f, s->logit + l * TB * E, E));
    }
    for (t = 0; t < s->tl; t++) { /* softmax, max subtracted */
        const float *z = s->logit + t * E;
        float *p = s->p + t * E, mx = z[0], sum = 0;
        for (e = 1; e < E; e++) mx = z[e] > mx ? z[e] : mx;
        for (e = 0; e < E; e++) sum += p[e] = expf(z[e] - mx);
        for (e = 0; e < E; e++) p[e] /= sum;
    }
    TRY(route(s));
    span("router", t0);

    /* dispatch: each kept row of u to its expert's owner */
    t0 = dpar_time_ns();
    if (cf->wrong_count && s->step == 0 && s->r == s->n - 1) s->sc[0] += D; /* one row too many to rank 0 */
    TRY(dpar_alltoallv(s->c, s->sendu, s->sc, s->sd, s->flat, s->rc, s->rd, DPAR_F32));
    span("dispatch", t0);

    /* my experts, each on all its rows at once, in global token order: (m x D) -> (m x H) -> (m x D) */
    t0 = dpar_time_ns();
    repack(s, s->flat, s->xe, 1);
    for (i = 0; i < s->el; i++) {
        const float *w1 = s->ex[i], *b1 = w1 + D * H, *w2 = b1 + H, *b2 = w2 + H * D;
        int m = s->m[i];
        if (m == 0) continue;
        TRY(dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, m, H, D, 1.0f, s->xe[i], D, w1, H, 0.0f, s->hpre[i], H));
        for (jj = 0; jj < m * H; jj++) {
            s->hpre[i][jj] += b1[jj % H];
            s->act[i][jj] = gelu(s->hpre[i][jj]);
        }
        TRY(dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, m, D, H, 1.0f, s->act[i], H, w2, D, 0.0f, s->oe[i], D));
        for (jj = 0; jj < m * D; jj++) s->oe[i][jj] += b2[jj % D];
    }
    repack(s, s->flat, s->oe, 0);
    span("experts", t0);

    /* combine: the outputs come back in the dispatch layout; y = sum over kept choices of p_e * output */
    t0 = dpar_time_ns();
    TRY(dpar_alltoallv(s->c, s->flat, s->rc, s->rd, s->back, s->sc, s->sd, DPAR_F32));
    for (t = 0; t < s->tl; t++) {
        float *y = s->y + (size_t)t * D;
        memset(y, 0, D * sizeof(float));
        for (k = 0; k < K; k++) {
            int rw = s->row[t][k];
            float g = s->p[t * E + s->choice[t][k]];
            if (rw < 0) continue; /* dropped: contributes 0 */
            for (jj = 0; jj < D; jj++) y[jj] += g * s->back[(size_t)rw * D + jj];
        }
    }
    span("combine", t0);

    /* the loss: per leaf in double, then the fixed tree over leaves and ranks */
    for (l = 0; l < s->nleaf; l++) {
        double *st4 = s->stats[l];
        memset(st4, 0, sizeof s->stats[l]);
        for (t = l * TB; t < (l + 1) * TB; t++) {
            for (jj = 0; jj < D; jj++) {
                double d = (double)s->y[t * D + jj] - s->j->target[(size_t)(s->t0 + t) * D + jj];
                st4[0] += d * d;
            }
            for (e = 0; e < E; e++) st4[1 + e] += s->p[t * E + e];
        }
        leaves[l] = st4;
    }
    TRY(dpar_tree_reduce(s->total, leaves, s->nleaf, STATS, DPAR_F64, DPAR_SUM));
    TRY(dpar_allreduce(s->c, s->total, s->total, STATS, DPAR_F64, DPAR_SUM));
    *loss = s->total[0] / (T * D);
    for (e = 0; e < E; e++) *loss += cf->alpha * E * ((double)s->routed[e] / (T * K)) * (s->total[1 + e] / T);
    if (signature) { /* which experts every token chose: piecewise constant, so a gradient check skips changes */
        sig = 0;
        for (t = 0; t < s->tl; t++)
            for (k = 0; k < K; k++) sig += (int64_t)(s->t0 + t + 1) * (k + 1) * 7919 * (s->choice[t][k] + 1);
        TRY(dpar_allreduce(s->c, &sig, signature, 1, DPAR_I64, DPAR_SUM));
    }
    return DPAR_OK;
}

/* backward: the gradients of everything from the last forward: drep (the same on every rank) and my experts' dex */
static dpar_status backward(rank_state *s)
{
    const config *cf = &s->j->cfg;
    int E = cf->experts, K = cf->k, l, i, t, k, e, jj;
    const float *wr = s->rep + OFF_WR;
    const void *leaves[L];
    float aux[E_MAX];
    uint64_t t0 = dpar_time_ns();
    dpar_status st;
    /* d loss / d p_e from the aux loss: alpha E f_e / T for every token */
    for (e = 0; e < E; e++) aux[e] = (float)(cf->alpha * E * ((double)s->routed[e] / (T * K)) / T);
    /* combine's backward: d output = p_e dy goes to the owner; d p_e = dy . output */
    for (t = 0; t < s->tl; t++) {
        float dy[D];
        for (jj = 0; jj < D; jj++)
            dy[jj] = 2.0f * (s->y[t * D + jj] - s->j->target[(size_t)(s->t0 + t) * D + jj]) / (T * D);
        for (e = 0; e < E; e++) s->dp[t * E + e] = aux[e];
        for (k = 0; k < K; k++) {
            int rw = s->row[t][k];
            float g = s->p[t * E + s->choice[t][k]], dot = 0;
            if (rw < 0) continue;
            for (jj = 0; jj < D; jj++) {
                s->dback[(size_t)rw * D + jj] = g * dy[jj];
                dot += dy[jj] * s->back[(size_t)rw * D + jj];
            }
            s->dp[t * E + s->choice[t][k]] += dot;
        }
    }
    TRY(dpar_alltoallv(s->c, s->dback, s->sc, s->sd, s->flat2, s->rc, s->rd, DPAR_F32));
    repack(s, s->flat2, s->oe, 1); /* oe now holds d output, per expert */

    /* my experts' backward, each over all its rows in global token order */
    for (i = 0; i < s->el; i++) {
        float *w1 = s->ex[i], *w2 = w1 + D * H + H;
        float *dw1 = s->dex[i], *db1 = dw1 + D * H, *dw2 = db1 + H, *db2 = dw2 + H * D;
        int m = s->m[i], rr;
        memset(s->dex[i], 0, sizeof s->dex[i]);
        if (m == 0) continue;
        TRY(dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, H, D, m, 1.0f, s->act[i], H, s->oe[i], D, 0.0f, dw2, D));
        for (rr = 0; rr < m; rr++)
            for (jj = 0; jj < D; jj++) db2[jj] += s->oe[i][rr * D + jj];
        TRY(dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, m, H, D, 1.0f, s->oe[i], D, w2, D, 0.0f, s->dh[i], H));
        for (jj = 0; jj < m * H; jj++) s->dh[i][jj] *= gelu_grad(s->hpre[i][jj]);
        TRY(dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, D, H, m, 1.0f, s->xe[i], D, s->dh[i], H, 0.0f, dw1, H));
        for (rr = 0; rr < m; rr++)
            for (jj = 0; jj < H; jj++) db1[jj] += s->dh[i][rr * H + jj];
        TRY(dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, m, D, H, 1.0f, s->dh[i], H, w1, H, 0.0f, s->xe[i], D)); /* d u rows */
    }
    repack(s, s->flat2, s->xe, 0);
    /* dispatch's backward: d u rows come home, in the dispatch layout */
    TRY(dpar_alltoallv(s->c, s->flat2, s->rc, s->rd, s->duback, s->sc, s->sd, DPAR_F32));

    /* softmax's backward: d logit_e = p_e (d p_e - sum_j p_j d p_j) */
    for (t = 0; t < s->tl; t++) {
        float *p = s->p + t * E, *dp = s->dp + t * E, dot = 0;
        for (e = 0; e < E; e++) dot += p[e] * dp[e];
        for (e = 0; e < E; e++) s->logit[t * E + e] = p[e] * (dp[e] - dot); /* logit now holds d logit */
    }
    /* the token side, leaf by leaf: du = d logit Wr^T + the kept choices' rows; the replicated weights' gradients */
    for (l = 0; l < s->nleaf; l++) {
        const float *x = s->j->x + (size_t)(s->t0 + l * TB) * D, *u = s->u + (size_t)l * TB * D;
        float *du = s->du + (size_t)l * TB * D, *dl = s->logit + l * TB * E, *g = s->gleaf[l];
        TRY(dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, TB, D, E, 1.0f, dl, E, wr, E, 0.0f, du, D));
        for (t = l * TB; t < (l + 1) * TB; t++)
            for (k = 0; k < K; k++) {
                int rw = s->row[t][k];
                if (rw < 0) continue;
                for (jj = 0; jj < D; jj++) s->du[t * D + jj] += s->duback[(size_t)rw * D + jj];
            }
        memset(g, 0, sizeof s->gleaf[l]);
        TRY(dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, D, E, TB, 1.0f, u, D, dl, E, 0.0f, g + OFF_WR, E));
        if (cf->dense) { /* dz = du (1 - u^2); dWd = x^T dz; dbd = sum of dz */
            for (jj = 0; jj < TB * D; jj++) du[jj] *= 1.0f - u[jj] * u[jj];
            TRY(dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, D, D, TB, 1.0f, x, D, du, D, 0.0f, g, D));
            for (t = 0; t < TB; t++)
                for (jj = 0; jj < D; jj++) g[OFF_BD + jj] += du[t * D + jj];
        }
        leaves[l] = g;
    }
    TRY(dpar_tree_reduce(s->drep, leaves, s->nleaf, (size_t)off_experts(E), DPAR_F32, DPAR_SUM));
    TRY(dpar_allreduce(s->c, s->drep, s->drep, (size_t)off_experts(E), DPAR_F32, DPAR_SUM));
    span("backward", t0);
    return DPAR_OK;
}

static void sgd(rank_state *s)
{
    float lr = (float)s->j->cfg.lr;
    int i, jj, nrep = off_experts(s->j->cfg.experts);
    for (i = 0; i < nrep; i++) s->rep[i] -= lr * s->drep[i];
    for (i = 0; i < s->el; i++)
        for (jj = 0; jj < PE; jj++) s->ex[i][jj] -= lr * s->dex[i][jj];
}

/* the gradient check: the same list of entries on every rank; a replicated entry is moved on every rank, an
   expert's on its owner only; the loss of each forward is global */
static dpar_status gradcheck(rank_state *s)
{
    job *j = s->j;
    int E = j->cfg.experts, nrep = off_experts(E), g;
    int64_t sig0, sigp, sigm;
    double lp, lm, l0;
    dpar_status st;
    TRY(forward(s, &l0, &sig0));
    TRY(backward(s));
    for (g = 0; g < E && s->r == 0; g++) j->dropped += s->routed[g] - s->kept[g];
    for (g = 0; g < j->gc_count; g++) {
        int o = j->gc_off[g], e = o < nrep ? -1 : (o - nrep) / PE, mine = e < 0 || (e >= s->e0 && e < s->e0 + s->el);
        float *w = e < 0 ? &s->rep[o] : mine ? &s->ex[e - s->e0][(o - nrep) % PE] : NULL;
        float keep = w ? *w : 0, up = 0, down = 0, eps = 1e-3f;
        if (w) { /* the step the float really took */
            *w = keep + eps;
            up = *w - keep;
        }
        TRY(forward(s, &lp, &sigp));
        if (w) {
            *w = keep - eps;
            down = *w - keep;
        }
        TRY(forward(s, &lm, &sigm));
        if (w) *w = keep;
        if (w && (e >= 0 || s->r == 0)) {
            j->gc_ana[g] = e < 0 ? s->drep[o] : s->dex[e - s->e0][(o - nrep) % PE];
            j->gc_num[g] = (lp - lm) / ((double)up - down);
            j->gc_skipped[g] = sigp != sig0 || sigm != sig0;
        }
    }
    return DPAR_OK;
}

static dpar_status train_rank(rank_state *s)
{
    job *j = s->j;
    const config *cf = &j->cfg;
    int E = cf->experts, nrep = off_experts(E), i, e;
    double loss;
    dpar_comm_stats stats;
    dpar_status st;
    s->el = E / s->n;
    s->e0 = s->r * s->el;
    s->tl = T / s->n;
    s->t0 = s->r * s->tl;
    s->nleaf = L / s->n;
    s->leaf0 = s->r * s->nleaf;
    s->cap = (int)ceil(cf->capacity * T * cf->k / E);
    memcpy(s->rep, j->params, (size_t)nrep * sizeof(float));
    for (i = 0; i < s->el; i++) memcpy(s->ex[i], j->params + nrep + (size_t)(s->e0 + i) * PE, sizeof s->ex[i]);
    if (cf->gradcheck) return gradcheck(s);
    for (s->step = 0; s->step < cf->steps; s->step++) {
        TRY(forward(s, &loss, NULL));
        TRY(backward(s));
        sgd(s);
        count_traffic(s);
        for (i = 0, e = 0; i < s->n; i++) e += (int)(s->rc[i] / D); /* the rows my experts received */
        if (e > j->recv_rows[s->r]) j->recv_rows[s->r] = e;
        if (s->r == 0) {
            j->loss[s->step] = loss;
            for (e = 0; e < E; e++) j->dropped += s->routed[e] - s->kept[e];
        }
    }
    if (s->r == 0) {
        memcpy(j->params, s->rep, (size_t)nrep * sizeof(float));
        memcpy(j->routed, s->routed, sizeof j->routed);
        memcpy(j->kept, s->kept, sizeof j->kept);
    }
    memcpy(j->rep_end[s->r], s->rep, (size_t)nrep * sizeof(float));
    TRY(dpar_comm_stats_get(s->c, &stats));
    j->a2a_calls[s->r] = stats.by_coll[DPAR_COLL_ALLTOALLV].calls;
    j->a2a_bytes[s->r] = stats.by_coll[DPAR_COLL_ALLTOALLV].bytes_sent;
    j->counted[s->r] = s->counted;
    j->counted_self[s->r] = s->counted_self;
    for (i = 0; i < s->el; i++) memcpy(j->params + nrep + (size_t)(s->e0 + i) * PE, s->ex[i], sizeof s->ex[i]);
    return DPAR_OK;
}

/* one rank's run on its comm: a thread rank or an MPI process alike */
static dpar_status rank_run(job *j, dpar_comm *c, int rank, int n)
{
    rank_state *s = (rank_state *)calloc(1, sizeof *s);
    dpar_status st;
    if (!s) return DPAR_ENOMEM;
    s->j = j;
    s->r = rank;
    s->n = n;
    s->c = c;
    st = train_rank(s);
    j->status[rank] = st;
    if (st != DPAR_OK && (rank == 0 || j->mpi)) snprintf(j->error, sizeof j->error, "%s", dpar_last_error());
    if (st != DPAR_OK) dpar_comm_abort(c); /* wake the other ranks instead of letting them time out */
    free(s);
    return st;
}

static dpar_status rank_main(void *user, int rank, int n)
{
    job *j = (job *)user;
    dpar_comm *c = NULL;
    dpar_status st;
    char name[32];
    sprintf(name, "rank %d", rank);
    dpar_trace_set_thread_name(name);
    if ((st = dpar_group_join(j->group, rank, &c)) != DPAR_OK) return j->status[rank] = st;
    st = rank_run(j, c, rank, n);
    dpar_comm_destroy(c);
    return st;
}

/* one run with n thread ranks on a deterministic comm; the model starts from `start` */
static dpar_status run(job *j, int n, const float *start)
{
    dpar_pool_desc pd;
    dpar_comm_desc cd;
    dpar_pool *pool = NULL;
    dpar_status st;
    memset(&pd, 0, sizeof pd);
    memset(&cd, 0, sizeof cd);
    j->n = pd.num_threads = cd.size = n;
    cd.deterministic = 1; /* allreduce in the fixed tree that dpar_tree_reduce starts */
    cd.name = "moe";
    j->group = NULL;
    j->dropped = 0;
    memcpy(j->params, start, sizeof j->params);
    memset(j->status, 0, sizeof j->status);
    memset(j->recv_rows, 0, sizeof j->recv_rows);
    if ((st = dpar_pool_create(&pd, &pool)) == DPAR_OK && (st = dpar_group_create(&cd, &j->group)) == DPAR_OK)
        st = dpar_pool_run(pool, rank_main, j);
    if (st != DPAR_OK && !j->error[0]) snprintf(j->error, sizeof j->error, "%s", dpar_last_error());
    if (j->group) dpar_group_destroy(j->group);
    if (pool) dpar_pool_destroy(pool);
    return st;
}

static int usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [--ranks 1,2,4] [--experts 4|8] [--k 1|2] [--capacity CF] [--steps S] [--alpha A] [--lr LR]\n"
            "          [--no-dense] [--gradcheck] [--wrong-count] [--trace FILE]\n",
            argv0);
    return 2;
}

#ifdef DPAR_MPI
/* one rank per MPI process (mpirun -np N, with -DDPAR_MPI): the same training on dpar_comm_from_mpi's comm, against
   the one-rank run that every process makes on a thread of its own first */
static int main_mpi(job *j, const float *start)
{
    const config *cf = &j->cfg;
    static float lo[REP_MAX], hi[REP_MAX];
    static double ref_loss[MAX_STEPS];
    int rank, n, nrep = off_experts(cf->experts), ok, every;
    uint32_t ref_crc = 0, crc;
    long ref_dropped = 0;
    dpar_comm_desc cd;
    dpar_comm *c = NULL;
    dpar_status st;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (n > MAX_RANKS || (n & (n - 1)) || cf->experts % n || cf->gradcheck) {
        if (rank == 0)
            fprintf(stderr,
                    "moe: over MPI the processes must be a power of two up to %d that divides the experts "
                    "(%d); --gradcheck runs on thread ranks\n",
                    MAX_RANKS, cf->experts);
        return 2;
    }
    if (!cf->wrong_count) { /* the reference: this process alone, one thread rank */
        if (run(j, 1, start) != DPAR_OK) {
            fprintf(stderr, "moe: process %d, 1 rank: %s\n", rank, j->error);
            return 1;
        }
        memcpy(ref_loss, j->loss, sizeof ref_loss);
        ref_crc = dpar_crc32(0, j->params, (size_t)(nrep + cf->experts * PE) * sizeof(float));
        ref_dropped = j->dropped;
    }
    memcpy(j->params, start, sizeof j->params);
    memset(j->status, 0, sizeof j->status);
    j->dropped = 0;
    j->mpi = 1;
    j->n = n;
    memset(&cd, 0, sizeof cd);
    cd.deterministic = 1;
    cd.name = "moe";
    if ((st = dpar_comm_from_mpi(MPI_COMM_WORLD, &cd, &c)) == DPAR_OK) st = rank_run(j, c, rank, n);
    if (cf->wrong_count) {
        int mine = st == DPAR_EMISMATCH;
        MPI_Allreduce(&mine, &every, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        if (rank == 0) {
            printf("moe ranks=%d (MPI processes) --wrong-count: rank %d sends one row too many to rank 0 in the first "
                   "dispatch\n",
                   n, n - 1);
            printf("moe: %s on %s process: %s\n", dpar_status_string(st), every ? "every" : "NOT every", j->error);
        }
        dpar_comm_destroy(c);
        return 1; /* the run failed, as it must */
    }
    if (st == DPAR_OK) { /* my copy of the replicated weights; every process's experts (mine are at my block) */
        memcpy(j->params, j->rep_end[rank], (size_t)nrep * sizeof(float));
        st = dpar_allgather(c, j->params + nrep + (size_t)rank * (cf->experts / n) * PE, j->params + nrep,
                            (size_t)cf->experts * PE, DPAR_F32);
    }
    if (st == DPAR_OK) st = dpar_allreduce(c, j->params, lo, (size_t)nrep, DPAR_F32, DPAR_MIN);
    if (st == DPAR_OK) st = dpar_allreduce(c, j->params, hi, (size_t)nrep, DPAR_F32, DPAR_MAX);
    if (st != DPAR_OK) fprintf(stderr, "moe: process %d: %s\n", rank, j->error[0] ? j->error : dpar_last_error());
    crc = dpar_crc32(0, j->params, (size_t)(nrep + cf->experts * PE) * sizeof(float));
    ok = st == DPAR_OK && !memcmp(lo, hi, (size_t)nrep * sizeof(float)) && crc == ref_crc; /* replicas agree */
    if (rank == 0) /* rank 0 kept the loss of every step and the dropped count */
        ok &= !memcmp(ref_loss, j->loss, (size_t)cf->steps * sizeof(double)) && j->dropped == ref_dropped;
    MPI_Allreduce(&ok, &every, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank == 0 && st == DPAR_OK)
        printf("moe ranks=%d (MPI processes) experts=%d k=%d steps=%d loss=%.9g params_crc=%08x dropped=%ld bitwise "
               "equal to 1 rank: %s\n",
               n, cf->experts, cf->k, cf->steps, j->loss[cf->steps - 1], (unsigned)crc, j->dropped,
               every ? "yes" : "NO");
    dpar_comm_destroy(c);
    return every ? 0 : 1;
}
#endif

static int moe_main(int argc, char **argv)
{
    static job j;
    static float start[NPARAM_MAX];
    double ref_loss[MAX_STEPS];
    int ranks[8], nranks = 0, i, e, all_equal = 1, nrep;
    unsigned long long seed = 7;
    const char *trace = NULL, *list = "1,2,4";
    uint32_t ref_crc = 0;
    long ref_dropped = 0;
    int ref_routed[E_MAX], ref_kept[E_MAX];
    config *cf = &j.cfg;
    cf->experts = 4;
    cf->k = 2;
    cf->steps = 200;
    cf->dense = 1;
    cf->capacity = 1.0;
    cf->alpha = 0.01;
    cf->lr = 2.0;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--ranks") && v) {
            list = v;
            i++;
        } else if (!strcmp(a, "--experts") && v) {
            cf->experts = atoi(v);
            i++;
        } else if (!strcmp(a, "--k") && v) {
            cf->k = atoi(v);
            i++;
        } else if (!strcmp(a, "--capacity") && v) {
            cf->capacity = atof(v);
            i++;
        } else if (!strcmp(a, "--steps") && v) {
            cf->steps = atoi(v);
            i++;
        } else if (!strcmp(a, "--alpha") && v) {
            cf->alpha = atof(v);
            i++;
        } else if (!strcmp(a, "--lr") && v) {
            cf->lr = atof(v);
            i++;
        } else if (!strcmp(a, "--trace") && v) {
            trace = v;
            i++;
        } else if (!strcmp(a, "--no-dense")) cf->dense = 0;
        else if (!strcmp(a, "--gradcheck")) cf->gradcheck = 1;
        else if (!strcmp(a, "--wrong-count")) cf->wrong_count = 1;
        else return usage(argv[0]);
    }
    for (const char *p = list; *p && nranks < 8;) {
        ranks[nranks++] = atoi(p);
        while (*p && *p != ',') p++;
        if (*p == ',') p++;
    }
    if (cf->experts < 1 || cf->experts > E_MAX || (cf->k != 1 && cf->k != 2) || cf->k > cf->experts || cf->steps < 1 ||
        cf->steps > MAX_STEPS || !(cf->capacity > 0) || nranks == 0) {
        fprintf(stderr, "moe: experts 1..%d, k 1 or 2 (at most the experts), steps 1..%d, capacity > 0\n", E_MAX,
                MAX_STEPS);
        return usage(argv[0]);
    }
    for (i = 0; i < nranks; i++)
        if (ranks[i] < 1 || ranks[i] > MAX_RANKS || (ranks[i] & (ranks[i] - 1)) || cf->experts % ranks[i]) {
            fprintf(stderr, "moe: --ranks: each N must be a power of two up to %d that divides the experts (%d)\n",
                    MAX_RANKS, cf->experts);
            return 2;
        }
    nrep = off_experts(cf->experts);

    /* the data: x uniform; the target t = sin(x A) for a fixed teacher A; the weights uniform / sqrt(fan-in) */
    {
        float teacher[D * D];
        int k, q;
        for (i = 0; i < D * D; i++) teacher[i] = urand(&seed);
        for (i = 0; i < T * D; i++) j.x[i] = urand(&seed);
        for (i = 0; i < T; i++)
            for (k = 0; k < D; k++) {
                float z = 0;
                for (q = 0; q < D; q++) z += j.x[i * D + q] * teacher[q * D + k];
                j.target[i * D + k] = sinf(0.5f * z);
            }
        for (i = 0; i < D * D; i++) start[i] = urand(&seed) * 0.25f; /* Wd: 1/sqrt(16) */
        for (i = 0; i < D; i++) start[OFF_BD + i] = urand(&seed) * 0.1f;
        for (i = 0; i < D * cf->experts; i++) start[OFF_WR + i] = urand(&seed) * 0.5f; /* Wr: spread the routing */
        for (e = 0; e < cf->experts; e++) {
            float *w = start + nrep + (size_t)e * PE;
            for (i = 0; i < D * H; i++) w[i] = urand(&seed) * 0.25f;                   /* W1 */
            for (i = 0; i < H; i++) w[D * H + i] = urand(&seed) * 0.1f;                /* b1 */
            for (i = 0; i < H * D; i++) w[D * H + H + i] = urand(&seed) * 0.17677670f; /* W2: 1/sqrt(32) */
            for (i = 0; i < D; i++) w[D * H + H + H * D + i] = 0;                      /* b2 */
        }
    }
#ifdef DPAR_MPI
    return main_mpi(&j, start); /* --ranks and --trace are for thread ranks */
#endif
    if (trace && dpar_trace_start(trace) != DPAR_OK) {
        fprintf(stderr, "moe: --trace %s: %s\n", trace, dpar_last_error());
        return 1;
    }

    if (cf->wrong_count) { /* the contract checker's demonstration: the largest N of --ranks */
        int n = ranks[nranks - 1], r, all = 1;
        dpar_status st;
        if (n < 2) {
            fprintf(stderr, "moe: --wrong-count needs a run with 2 or more ranks (--ranks 2)\n");
            return 2;
        }
        st = run(&j, n, start);
        for (r = 0; r < n; r++) all &= j.status[r] == DPAR_EMISMATCH;
        printf("moe ranks=%d --wrong-count: rank %d sends one row too many to rank 0 in the first dispatch\n", n,
               n - 1);
        printf("moe: %s on %s rank: %s\n", dpar_status_string(st), all ? "every" : "NOT every", j.error);
        if (trace) dpar_trace_stop();
        return 1; /* the run failed, as it must */
    }

    if (cf->gradcheck) { /* every entry of bd and of b1, b2 of each expert; strided entries of the matrices */
        int n = ranks[nranks - 1], bad = 0, checked = 0;
        double worst = 0;
        j.gc_count = 0;
        for (i = 0; i < D * D && cf->dense; i += 37) j.gc_off[j.gc_count++] = i;
        for (i = 0; i < D && cf->dense; i += 3) j.gc_off[j.gc_count++] = OFF_BD + i;
        for (i = 0; i < D * cf->experts; i += 5) j.gc_off[j.gc_count++] = OFF_WR + i;
        for (e = 0; e < cf->experts; e++) {
            int o = nrep + e * PE;
            j.gc_off[j.gc_count++] = o + 5 * H + 3;                 /* W1 */
            j.gc_off[j.gc_count++] = o + D * H + 7;                 /* b1 */
            j.gc_off[j.gc_count++] = o + D * H + H + 11 * D + 2;    /* W2 */
            j.gc_off[j.gc_count++] = o + D * H + H + H * D + e % D; /* b2 */
        }
        if (run(&j, n, start) != DPAR_OK) {
            fprintf(stderr, "moe: %s\n", j.error);
            return 1;
        }
        for (i = 0; i < j.gc_count; i++) {
            double a = j.gc_ana[i], nu = j.gc_num[i], err = fabs(a - nu) / (fabs(a) + fabs(nu) + 1e-4);
            if (j.gc_skipped[i]) continue;
            checked++;
            if (err > worst) worst = err;
            if (err > 1e-2) {
                bad++;
                printf("gradcheck: parameter %d: backward %.6e, central difference %.6e\n", j.gc_off[i], a, nu);
            }
        }
        printf("moe gradcheck ranks=%d experts=%d k=%d alpha=%g capacity=%g dropped=%ld: %d entries checked (%d "
               "skipped: the routing changed), worst relative difference %.2e: %s\n",
               n, cf->experts, cf->k, cf->alpha, cf->capacity, j.dropped, checked, j.gc_count - checked, worst,
               bad ? "FAILED" : "OK");
        if (trace) dpar_trace_stop();
        return bad || checked < j.gc_count / 2 ? 1 : 0;
    }

    /* the reference: one rank; then each N of --ranks from the same start */
    if (run(&j, 1, start) != DPAR_OK) {
        fprintf(stderr, "moe: 1 rank: %s\n", j.error);
        return 1;
    }
    memcpy(ref_loss, j.loss, sizeof ref_loss);
    ref_crc = dpar_crc32(0, j.params, (size_t)(nrep + cf->experts * PE) * sizeof(float));
    ref_dropped = j.dropped;
    memcpy(ref_routed, j.routed, sizeof ref_routed);
    memcpy(ref_kept, j.kept, sizeof ref_kept);
    printf("moe: T=%d tokens of width %d, %d experts (MLP %d -> %d -> %d, GELU), top-%d, capacity %d rows per "
           "expert (factor %g), aux loss alpha %g, %s, %d steps of SGD\n",
           T, D, cf->experts, D, H, D, cf->k, (int)ceil(cf->capacity * T * cf->k / cf->experts), cf->capacity,
           cf->alpha, cf->dense ? "a data-parallel dense layer before it" : "no dense layer", cf->steps);
    printf("moe ranks=1 experts=%d k=%d steps=%d loss=%.9g (first %.9g) params_crc=%08x dropped=%ld (reference)\n",
           cf->experts, cf->k, cf->steps, ref_loss[cf->steps - 1], ref_loss[0], (unsigned)ref_crc, ref_dropped);
    for (i = 0; i < nranks; i++) {
        int n = ranks[i], r, same;
        uint32_t crc;
        if (n == 1) continue;
        if (run(&j, n, start) != DPAR_OK) {
            fprintf(stderr, "moe: %d ranks: %s\n", n, j.error);
            return 1;
        }
        crc = dpar_crc32(0, j.params, (size_t)(nrep + cf->experts * PE) * sizeof(float));
        same = crc == ref_crc && !memcmp(ref_loss, j.loss, (size_t)cf->steps * sizeof(double)) &&
               j.dropped == ref_dropped && !memcmp(ref_routed, j.routed, sizeof ref_routed) &&
               !memcmp(ref_kept, j.kept, sizeof ref_kept);
        for (r = 1; r < n; r++) same &= !memcmp(j.rep_end[r], j.rep_end[0], (size_t)nrep * sizeof(float));
        printf("moe ranks=%d experts=%d k=%d steps=%d loss=%.9g params_crc=%08x dropped=%ld bitwise equal to 1 "
               "rank: %s\n",
               n, cf->experts, cf->k, cf->steps, j.loss[cf->steps - 1], (unsigned)crc, j.dropped, same ? "yes" : "NO");
        all_equal &= same;
        if (i == nranks - 1) { /* the traffic of the last run: what dpar counted against what the example sent */
            int counters_agree = 1;
            double mean = 0;
            printf("traffic ranks=%d: the four alltoallvs of a step (dispatch, combine, and their backward), bytes "
                   "each rank sent to other ranks per step (+ to itself):\n",
                   n);
            for (r = 0; r < n; r++) {
                printf("  rank %d: %.0f (+ %.0f), its experts received up to %d rows\n", r,
                       (double)j.counted[r] / cf->steps, (double)j.counted_self[r] / cf->steps, j.recv_rows[r]);
                mean += (double)j.counted[r] / cf->steps / n;
                counters_agree &= j.a2a_calls[r] == 4u * (uint64_t)cf->steps &&
                                  j.a2a_bytes[r] == j.counted[r]; /* bytes_sent: to other ranks */
            }
            printf("  mean %.0f; 4 k (T/N) D sizeof(float) x (N-1)/N = %.0f; dpar's counters (alltoallv calls and "
                   "bytes) agree: %s\n",
                   mean, 4.0 * cf->k * (T / n) * D * sizeof(float) * (n - 1) / n, counters_agree ? "yes" : "NO");
        }
    }
    printf("tokens per expert at the last step (the same for every N):\n");
    for (e = 0; e < cf->experts; e++)
        printf("expert %d: tokens %d kept %d dropped %d\n", e, ref_routed[e], ref_kept[e], ref_routed[e] - ref_kept[e]);
    printf("dropped over all %d steps: %ld of %d choices\n", cf->steps, ref_dropped, cf->steps * T * cf->k);
    if (trace && dpar_trace_stop() != DPAR_OK) fprintf(stderr, "moe: --trace: %s\n", dpar_last_error());
    if (!(ref_loss[cf->steps - 1] < ref_loss[0])) {
        fprintf(stderr, "moe: the loss did not fall\n");
        return 1;
    }
    return all_equal ? 0 : 1;
}

int main(int argc, char **argv)
{
#ifdef DPAR_MPI
    int rc;
    MPI_Init(&argc, &argv);
    rc = moe_main(argc, argv);
    MPI_Finalize();
    return rc;
#else
    return moe_main(argc, argv);
#endif
}
