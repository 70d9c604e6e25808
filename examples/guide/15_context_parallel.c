/* 15_context_parallel.c - lesson 15 of the guide (docs/guide/15_context_parallel.md): context parallelism.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/15_context_parallel.c -o build/lesson15 -pthread -lm
   Run:   build/lesson15   (build/lesson15 2: two ranks; 1, 2 or 4)
   Check: ^Ulysses: O and LSE bitwise equal to the unsharded attention$
   Check: ^ring attention: O and LSE within 2 \(S \+ cp\) FLT_EPSILON = [0-9.e+-]+ of the unsharded attention
   Check: ^ring attention: \(query chunk, key chunk\) pairs per rank: [0-9 ]+ = 2 cp \+ 1 on every rank

   Causal multi-head attention over a sequence of SEQ tokens, forward only, split over cp thread ranks two ways:
   Ulysses (an all-to-all turns "my tokens, all heads" into "all tokens, my heads", the unsharded attention runs on
   those heads, a second all-to-all turns the output back) and ring attention (each rank keeps its queries; the K/V
   blocks travel around the ring and each is folded into an online softmax), with the zig-zag split that gives every
   rank the same work under the causal mask. Checked against the unsharded attention: Ulysses bit for bit, ring within
   a tolerance (its sums run in another order). */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SEQ 32              /* tokens of the sequence */
#define HEADS 4             /* attention heads */
#define DIM 4               /* each head's width */
#define EMBED (HEADS * DIM) /* a token's row of q (or k, v, o): [head][dim] */
#define MAX_RANKS 4

static float q_all[SEQ * EMBED], k_all[SEQ * EMBED], v_all[SEQ * EMBED]; /* [token][head][dim] */
static float reference_o[SEQ * EMBED], reference_lse[SEQ * HEADS];       /* the unsharded attention's */
static float ulysses_o[SEQ * EMBED], ulysses_lse[SEQ * HEADS];
static float ring_o[SEQ * EMBED], ring_lse[SEQ * HEADS];
static int pairs_computed[MAX_RANKS]; /* ring: the (query chunk, key chunk) blocks each rank computed */

static float score(const float *q, const float *k) /* q . k / sqrt(DIM) */
{
    float sum = 0;
    int d;
    for (d = 0; d < DIM; d++) sum += q[d] * k[d];
    return sum / sqrtf((float)DIM);
}

/* one head over the whole sequence, causal: row i of q (at q + i stride) attends to keys 0..i. Two passes: the row's
   max, then the sum of exp(s - max) and of exp(s - max) v. Writes o (rows at o + i stride) and lse = max + log(sum). */
static void attend(const float *q, const float *k, const float *v, int stride, float *o, float *lse, int lse_stride)
{
    int i, j, d;
    for (i = 0; i < SEQ; i++) {
        float largest = -INFINITY;
        float total = 0;
        float acc[DIM] = {0};
        for (j = 0; j <= i; j++) largest = fmaxf(largest, score(q + i * stride, k + j * stride));
        for (j = 0; j <= i; j++) {
            float weight = expf(score(q + i * stride, k + j * stride) - largest);
            total += weight;
            for (d = 0; d < DIM; d++) acc[d] += weight * v[j * stride + d];
        }
        for (d = 0; d < DIM; d++) o[i * stride + d] = acc[d] / total;
        lse[i * lse_stride] = largest + logf(total);
    }
}

/* Ulysses: all-to-all from (my tokens, all heads) to (all tokens, my heads), attention, and back */
static dpar_status ulysses(dpar_comm *comm, int rank, int cp)
{
    int tokens = SEQ / cp;            /* mine, before and after */
    int heads = HEADS / cp;           /* mine, in the middle */
    int block = tokens * heads * DIM; /* floats from each rank to each rank */
    const float *inputs[3] = {q_all, k_all, v_all};
    static float packed[MAX_RANKS][SEQ * EMBED], by_head[MAX_RANKS][3][SEQ * EMBED];
    static float o_by_head[MAX_RANKS][SEQ * EMBED], lse_by_head[MAX_RANKS][SEQ * HEADS];
    static float o_back[MAX_RANKS][SEQ * EMBED], lse_back[MAX_RANKS][SEQ * HEADS];
    int which, to, from, t, h;
    dpar_status st = DPAR_OK;
    for (which = 0; which < 3 && st == DPAR_OK; which++) { /* q, k, v: to rank `to` my tokens' rows of its heads */
        for (to = 0; to < cp; to++)
            for (t = 0; t < tokens; t++)
                for (h = 0; h < heads; h++)
                    memcpy(&packed[rank][to * block + (t * heads + h) * DIM],
                           &inputs[which][(rank * tokens + t) * EMBED + (to * heads + h) * DIM], sizeof(float) * DIM);
        st = dpar_alltoall(comm, packed[rank], by_head[rank][which], block, DPAR_F32);
    }
    /* block `from` holds rank from's tokens: the whole sequence in order, my heads: [token][my head][dim] */
    for (h = 0; h < heads && st == DPAR_OK; h++)
        attend(by_head[rank][0] + h * DIM, by_head[rank][1] + h * DIM, by_head[rank][2] + h * DIM, heads * DIM,
               o_by_head[rank] + h * DIM, lse_by_head[rank] + h, heads);
    /* back: rank `to` gets its tokens' rows, which are block `to` of o_by_head already */
    if (st == DPAR_OK) st = dpar_alltoall(comm, o_by_head[rank], o_back[rank], block, DPAR_F32);
    if (st == DPAR_OK) st = dpar_alltoall(comm, lse_by_head[rank], lse_back[rank], tokens * heads, DPAR_F32);
    for (from = 0; from < cp && st == DPAR_OK; from++) /* block `from`: my tokens, rank from's heads */
        for (t = 0; t < tokens; t++)
            for (h = 0; h < heads; h++) {
                int token = rank * tokens + t;
                int head = from * heads + h;
                memcpy(&ulysses_o[token * EMBED + head * DIM], &o_back[rank][from * block + (t * heads + h) * DIM],
                       sizeof(float) * DIM);
                ulysses_lse[token * HEADS + head] = lse_back[rank][from * tokens * heads + t * heads + h];
            }
    return st;
}

/* the zig-zag split: 2 cp chunks, rank r holds chunks r and 2 cp - 1 - r (its queries, and its K/V at the start) */
static int chunk_of(int rank, int cp, int which) { return which == 0 ? rank : 2 * cp - 1 - rank; }

/* the blocks a rank holding query chunks a and b computes: key chunks 0..a and 0..b (later ones are masked) */
static int pairs_of(int a, int b) { return (a + 1) + (b + 1); }

typedef struct online_softmax { /* per (query row, head): the running max, sum of exp(s - max), sum of exp(s - max) v */
    float max[SEQ * HEADS], sum[SEQ * HEADS], acc[SEQ * EMBED];
} online_softmax;

/* fold the keys of chunk kc (rows of kv_k, kv_v) into the running softmax of the queries of chunk qc */
static void fold_block(online_softmax *state, int qc, int kc, int chunk, const float *kv_k, const float *kv_v)
{
    int i, j, h, d;
    for (i = qc * chunk; i < (qc + 1) * chunk; i++)
        for (h = 0; h < HEADS; h++) {
            float block_max = -INFINITY;
            float new_max, rescale;
            int row = i * HEADS + h;
            int last_key = kc < qc ? (kc + 1) * chunk - 1 : i; /* the causal mask: keys up to i */
            for (j = kc * chunk; j <= last_key; j++)
                block_max =
                    fmaxf(block_max, score(q_all + i * EMBED + h * DIM, kv_k + (j - kc * chunk) * EMBED + h * DIM));
            new_max = fmaxf(state->max[row], block_max);
            rescale = expf(state->max[row] - new_max); /* what was summed under the old max */
            state->sum[row] *= rescale;
            for (d = 0; d < DIM; d++) state->acc[i * EMBED + h * DIM + d] *= rescale;
            for (j = kc * chunk; j <= last_key; j++) {
                const float *key_row = kv_k + (j - kc * chunk) * EMBED + h * DIM;
                float weight = expf(score(q_all + i * EMBED + h * DIM, key_row) - new_max);
                state->sum[row] += weight;
                for (d = 0; d < DIM; d++)
                    state->acc[i * EMBED + h * DIM + d] += weight * kv_v[(j - kc * chunk) * EMBED + h * DIM + d];
            }
            state->max[row] = new_max;
        }
}

/* ring attention: my two chunks' queries stay; the K/V of two chunks travels to rank + 1, cp - 1 hops */
static dpar_status ring(dpar_comm *comm, int rank, int cp)
{
    static online_softmax states[MAX_RANKS];
    static float kv[MAX_RANKS][2][2 * 2 * SEQ * EMBED]; /* the block held and the one arriving: K then V, 2 chunks */
    online_softmax *state = &states[rank];
    int chunk = SEQ / (2 * cp);
    int rows = 2 * chunk * EMBED; /* floats of K (or V) of two chunks */
    int held = 0, hop, mine, theirs, i, h, d;
    dpar_status st = DPAR_OK;
    for (i = 0; i < SEQ * HEADS; i++) {
        state->max[i] = -INFINITY;
        state->sum[i] = 0;
    }
    memset(state->acc, 0, sizeof state->acc);
    for (theirs = 0; theirs < 2; theirs++) { /* my own K/V: chunk `theirs` at rows theirs * chunk */
        int c = chunk_of(rank, cp, theirs);
        memcpy(kv[rank][0] + theirs * chunk * EMBED, k_all + c * chunk * EMBED, sizeof(float) * chunk * EMBED);
        memcpy(kv[rank][0] + rows + theirs * chunk * EMBED, v_all + c * chunk * EMBED, sizeof(float) * chunk * EMBED);
    }
    for (hop = 0; hop < cp && st == DPAR_OK; hop++) {
        int owner = (rank - hop + cp) % cp; /* whose K/V I hold now */
        for (mine = 0; mine < 2; mine++)
            for (theirs = 0; theirs < 2; theirs++) {
                int qc = chunk_of(rank, cp, mine);
                int kc = chunk_of(owner, cp, theirs);
                if (kc > qc) continue; /* all in the future of every query: masked, not computed */
                fold_block(state, qc, kc, chunk, kv[rank][held] + theirs * chunk * EMBED,
                           kv[rank][held] + rows + theirs * chunk * EMBED);
                pairs_computed[rank]++;
            }
        if (hop < cp - 1) { /* pass what I hold to rank + 1, take rank - 1's */
            st = dpar_sendrecv(comm, kv[rank][held], 2 * rows, (rank + 1) % cp, kv[rank][1 - held], 2 * rows,
                               (rank - 1 + cp) % cp, DPAR_F32, 0);
            held = 1 - held;
        }
    }
    for (mine = 0; mine < 2; mine++) /* O = acc / sum, LSE = max + log(sum) */
        for (i = chunk_of(rank, cp, mine) * chunk; i < (chunk_of(rank, cp, mine) + 1) * chunk; i++)
            for (h = 0; h < HEADS; h++) {
                for (d = 0; d < DIM; d++)
                    ring_o[i * EMBED + h * DIM + d] = state->acc[i * EMBED + h * DIM + d] / state->sum[i * HEADS + h];
                ring_lse[i * HEADS + h] = state->max[i * HEADS + h] + logf(state->sum[i * HEADS + h]);
            }
    return st;
}

static dpar_status rank_main(void *user, int rank, int cp)
{
    dpar_comm *comm;
    dpar_status st = dpar_group_join((dpar_group *)user, rank, &comm);
    if (st == DPAR_OK) st = ulysses(comm, rank, cp);
    if (st == DPAR_OK) st = ring(comm, rank, cp);
    dpar_comm_destroy(comm);
    return st;
}

static double largest_relative_error(const float *got, const float *want, int n) /* relative to want's largest */
{
    double largest = 0;
    double worst = 0;
    int i;
    for (i = 0; i < n; i++) largest = fmax(largest, fabs(want[i]));
    for (i = 0; i < n; i++) worst = fmax(worst, fabs((double)got[i] - want[i]) / largest);
    return worst;
}

int main(int argc, char **argv)
{
    int cp = argc > 1 ? atoi(argv[1]) : 4;
    unsigned seed = 15;
    dpar_comm_desc comm_desc = {0};
    dpar_pool_desc pool_desc = {0};
    dpar_pool *pool = NULL;
    dpar_group *group = NULL;
    dpar_status st;
    double tolerance = 2.0 * (SEQ + cp) * FLT_EPSILON;
    double ring_error;
    int i, h, r;
    int ok = 1;
    int balanced = 1;
    int ulysses_exact;
    if (cp != 1 && cp != 2 && cp != 4) {
        fprintf(stderr, "usage: %s [ranks: 1, 2 or 4]\n", argv[0]);
        return 2;
    }
    for (i = 0; i < SEQ * EMBED; i++) {
        seed = seed * 1664525u + 1013904223u;
        q_all[i] = (float)(seed >> 8) / 16777216.0f - 0.5f;
        k_all[i] = sinf(0.7f * i);
        v_all[i] = cosf(0.3f * i);
    }
    for (h = 0; h < HEADS; h++) /* the unsharded attention, head by head */
        attend(q_all + h * DIM, k_all + h * DIM, v_all + h * DIM, EMBED, reference_o + h * DIM, reference_lse + h,
               HEADS);
    comm_desc.size = cp;
    pool_desc.num_threads = cp;
    st = dpar_group_create(&comm_desc, &group);
    if (st == DPAR_OK) st = dpar_pool_create(&pool_desc, &pool);
    if (st == DPAR_OK) st = dpar_pool_run(pool, rank_main, group);
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    if (st != DPAR_OK) {
        fprintf(stderr, "failed: %s\n", dpar_last_error());
        return 1;
    }
    printf("causal attention: %d tokens, %d heads of %d; cp = %d ranks, %d tokens each\n", SEQ, HEADS, DIM, cp,
           SEQ / cp);
    printf("zig-zag: %d chunks of %d tokens;", 2 * cp, SEQ / (2 * cp));
    for (r = 0; r < cp; r++)
        printf("%s rank %d holds chunks %d and %d", r ? "," : "", r, chunk_of(r, cp, 0), chunk_of(r, cp, 1));
    printf("\nring attention: (query chunk, key chunk) pairs per rank:");
    for (r = 0; r < cp; r++) {
        printf(" %d", pairs_computed[r]);
        balanced &= pairs_computed[r] == pairs_of(chunk_of(r, cp, 0), chunk_of(r, cp, 1));
        balanced &= pairs_computed[r] == 2 * cp + 1;
    }
    printf(" %s (contiguous shards:", balanced ? "= 2 cp + 1 on every rank" : "UNBALANCED, not 2 cp + 1 each");
    for (r = 0; r < cp; r++) printf(" %d", pairs_of(2 * r, 2 * r + 1)); /* rank r: chunks 2r and 2r + 1 */
    printf(")\n");
    ulysses_exact = memcmp(ulysses_o, reference_o, sizeof reference_o) == 0;
    ulysses_exact &= memcmp(ulysses_lse, reference_lse, sizeof reference_lse) == 0;
    ok &= ulysses_exact;
    printf("Ulysses: O and LSE %s the unsharded attention\n", ulysses_exact ? "bitwise equal to" : "DIFFER from");
    ring_error = fmax(largest_relative_error(ring_o, reference_o, SEQ * EMBED),
                      largest_relative_error(ring_lse, reference_lse, SEQ * HEADS));
    ok &= balanced;
    ok &= ring_error <= tolerance;
    printf("ring attention: O and LSE %s 2 (S + cp) FLT_EPSILON = %.1e of the unsharded attention, relative "
           "(largest %.1e; bitwise: %s)\n",
           ring_error <= tolerance ? "within" : "NOT within", tolerance, ring_error,
           memcmp(ring_o, reference_o, sizeof ring_o) == 0 && memcmp(ring_lse, reference_lse, sizeof ring_lse) == 0
               ? "yes"
               : "no");
    if (!ok) {
        fprintf(stderr, "FAILED: a result differs from the unsharded attention, or the ranks' work is unbalanced\n");
        return 1;
    }
    return 0;
}
