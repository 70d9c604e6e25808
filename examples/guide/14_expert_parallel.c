/* 14_expert_parallel.c - lesson 14 of the guide (docs/guide/14_expert_parallel.md): expert parallelism.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/14_expert_parallel.c -o build/lesson14 -pthread -lm
   Run:   build/lesson14   (build/lesson14 4: four ranks; build/lesson14 2 --wrong-count: a count the checker catches)
   Check: ^dispatch and combine on 2 ranks: every token's output = the one-rank reference, bit for bit$
   Check: ^expert 3 on rank 1: [0-9]+ choices, [0-9]+ kept, [0-9]+ dropped$

   One mixture-of-experts layer, forward only: a router picks each token's top-2 experts by softmax probability p,
   an expert takes at most CAPACITY rows (the others are dropped), and the token's output is the sum of p_e times
   expert e's output. Rank r holds tokens r T/N .. and experts r E/N ..: a dpar_alltoallv sends each kept row to its
   expert's rank (dispatch), a second brings the outputs back (combine). Checked against the same layer on one rank. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOKENS 16
#define WIDTH 4    /* a token is a row of WIDTH floats */
#define EXPERTS 4  /* expert e: out = tanh(in W_e), W_e WIDTH x WIDTH */
#define TOP_K 2    /* each token goes to its 2 most probable experts */
#define CAPACITY 6 /* rows an expert takes: ceil(0.75 x TOKENS x TOP_K / EXPERTS) */
#define MAX_RANKS 4

static float tokens[TOKENS * WIDTH], router[WIDTH * EXPERTS], expert_weights[EXPERTS][WIDTH * WIDTH];
typedef struct routing { /* what the router decided for every token */
    int expert[TOKENS][TOP_K];
    float prob[TOKENS][TOP_K];
    int kept[TOKENS][TOP_K];
} routing;
static routing reference, parallel; /* one rank's; the ranks' (each writes its own tokens) */
static float reference_out[TOKENS * WIDTH], parallel_out[TOKENS * WIDTH];
static int rows_sent[MAX_RANKS][MAX_RANKS]; /* rows_sent[r][q]: rows rank r dispatched to rank q */
static int wrong_count;                     /* 1: the last rank claims one row too many to rank 0 */
static char rank0_error[512];

static float uniform(unsigned *seed) /* in [-1, 1), the same numbers on every system */
{
    *seed = *seed * 1664525u + 1013904223u;
    return (float)(*seed >> 8) * (2.0f / 16777216) - 1;
}

/* softmax over the experts, then the TOP_K most probable (ties: the lower index) */
static void route(int token, routing *out)
{
    float logits[EXPERTS], probs[EXPERTS], largest;
    float total = 0;
    int e, slot, k;
    for (e = 0; e < EXPERTS; e++) {
        logits[e] = 0;
        for (k = 0; k < WIDTH; k++) logits[e] += tokens[token * WIDTH + k] * router[k * EXPERTS + e];
    }
    largest = logits[0];
    for (e = 1; e < EXPERTS; e++) largest = logits[e] > largest ? logits[e] : largest;
    for (e = 0; e < EXPERTS; e++) {
        probs[e] = expf(logits[e] - largest);
        total += probs[e];
    }
    for (slot = 0; slot < TOP_K; slot++) {
        int best = -1;
        for (e = 0; e < EXPERTS; e++)
            if ((slot == 0 || e != out->expert[token][0]) && (best < 0 || probs[e] > probs[best])) best = e;
        out->expert[token][slot] = best;
        out->prob[token][slot] = probs[best] / total;
    }
}

/* how many choices of expert e come before rank q's choices in slot `slot`: choices are ranked by slot, then by
   rank (ranks hold consecutive tokens, so this is token order), and an expert keeps its first CAPACITY */
static int choices_before(int all_counts[][TOP_K][EXPERTS], int ranks, int q, int slot, int e)
{
    int before = 0;
    int earlier_slot, r;
    for (earlier_slot = 0; earlier_slot < slot; earlier_slot++)
        for (r = 0; r < ranks; r++) before += all_counts[r][earlier_slot][e];
    for (r = 0; r < q; r++) before += all_counts[r][slot][e];
    return before;
}

static void expert_forward(int e, const float *in, float *out) /* one row: out = tanh(in W_e) */
{
    int i, k;
    for (i = 0; i < WIDTH; i++) {
        float sum = 0;
        for (k = 0; k < WIDTH; k++) sum += in[k] * expert_weights[e][k * WIDTH + i];
        out[i] = tanhf(sum);
    }
}

static dpar_status rank_main(void *user, int rank, int ranks)
{
    int local_tokens = TOKENS / ranks;
    int first_token = rank * local_tokens;
    int last_token = first_token + local_tokens;
    int experts_per_rank = EXPERTS / ranks; /* rank q owns experts q experts_per_rank .. */
    int my_first_expert = rank * experts_per_rank;
    int my_counts[TOP_K][EXPERTS] = {{0}};
    int all_counts[MAX_RANKS][TOP_K][EXPERTS];
    int place[TOP_K][EXPERTS];                 /* the place of my next choice of e in its slot */
    int rows_from[MAX_RANKS][EXPERTS] = {{0}}; /* the rows rank q sends to my expert e */
    int row_of[TOKENS][TOP_K];                 /* where a token's choice sits in the dispatch (-1: dropped) */
    float send_buf[(TOKENS * TOP_K + 1) * WIDTH], recv_buf[TOKENS * TOP_K * WIDTH];
    float expert_out[TOKENS * TOP_K * WIDTH], back_buf[TOKENS * TOP_K * WIDTH];
    size_t sendcounts[MAX_RANKS], recvcounts[MAX_RANKS];
    int t, slot, e, q, i, row;
    dpar_comm *comm;
    dpar_status st = dpar_group_join((dpar_group *)user, rank, &comm);
    if (st != DPAR_OK) return st;
    /* 1. route my tokens, and count my choices per (slot, expert) */
    for (t = first_token; t < last_token; t++) {
        route(t, &parallel);
        for (slot = 0; slot < TOP_K; slot++) my_counts[slot][parallel.expert[t][slot]]++;
    }
    /* 2. capacity is global: every rank needs every rank's counts */
    st = dpar_allgather(comm, my_counts, all_counts, (size_t)ranks * TOP_K * EXPERTS, DPAR_I32);
    for (slot = 0; slot < TOP_K; slot++)
        for (e = 0; e < EXPERTS; e++) place[slot][e] = choices_before(all_counts, ranks, rank, slot, e);
    for (slot = 0; slot < TOP_K; slot++)
        for (t = first_token; t < last_token; t++) {
            e = parallel.expert[t][slot];
            parallel.kept[t][slot] = place[slot][e] < CAPACITY;
            place[slot][e]++;
        }
    /* 3. the dispatch layout: by destination rank, then its experts, then my tokens in order */
    row = 0;
    for (q = 0; q < ranks; q++) {
        int first_row = row;
        for (e = q * experts_per_rank; e < (q + 1) * experts_per_rank; e++)
            for (t = first_token; t < last_token; t++)
                for (slot = 0; slot < TOP_K; slot++) {
                    if (parallel.expert[t][slot] != e) continue;
                    row_of[t][slot] = -1;
                    if (!parallel.kept[t][slot]) continue;
                    row_of[t][slot] = row;
                    memcpy(send_buf + row * WIDTH, tokens + t * WIDTH, sizeof(float) * WIDTH);
                    row++;
                }
        sendcounts[q] = (size_t)(row - first_row) * WIDTH;
        rows_sent[rank][q] = row - first_row;
    }
    /* what rank q sends me: computed here from the counts, not asked from q (the checker compares the two) */
    for (q = 0; q < ranks; q++) {
        recvcounts[q] = 0;
        for (e = my_first_expert; e < my_first_expert + experts_per_rank; e++) {
            for (slot = 0; slot < TOP_K; slot++) {
                int room = CAPACITY - choices_before(all_counts, ranks, q, slot, e);
                int count = all_counts[q][slot][e];
                if (room > 0) rows_from[q][e] += count < room ? count : room;
            }
            recvcounts[q] += (size_t)rows_from[q][e] * WIDTH;
        }
    }
    if (wrong_count && rank == ranks - 1) sendcounts[0] += WIDTH; /* the bug: one row more than rank 0 expects */
    /* 4. dispatch: every kept row to its expert's rank */
    if (st == DPAR_OK) st = dpar_alltoallv(comm, send_buf, sendcounts, NULL, recv_buf, recvcounts, NULL, DPAR_F32);
    /* 5. my experts on the rows they received: rank after rank, expert by expert within a rank's block */
    row = 0;
    for (q = 0; q < ranks && st == DPAR_OK; q++)
        for (e = my_first_expert; e < my_first_expert + experts_per_rank; e++)
            for (i = 0; i < rows_from[q][e]; i++) {
                expert_forward(e, recv_buf + row * WIDTH, expert_out + row * WIDTH);
                row++;
            }
    /* 6. combine: the outputs back to the tokens' ranks, the dispatch with the counts swapped */
    if (st == DPAR_OK) st = dpar_alltoallv(comm, expert_out, recvcounts, NULL, back_buf, sendcounts, NULL, DPAR_F32);
    /* 7. a token's output: p_e x expert e's output, added over its kept choices in slot order */
    for (t = first_token; t < last_token && st == DPAR_OK; t++)
        for (slot = 0; slot < TOP_K; slot++) {
            row = row_of[t][slot];
            if (row < 0) continue;
            for (i = 0; i < WIDTH; i++)
                parallel_out[t * WIDTH + i] += parallel.prob[t][slot] * back_buf[row * WIDTH + i];
        }
    if (st != DPAR_OK && rank == 0) snprintf(rank0_error, sizeof rank0_error, "%s", dpar_last_error());
    dpar_comm_destroy(comm);
    return st;
}

/* the same layer on one rank: route every token, keep each expert's first CAPACITY choices (slot, then token) */
static void reference_layer(void)
{
    int taken[EXPERTS] = {0};
    float out[WIDTH];
    int t, slot, e, i;
    for (t = 0; t < TOKENS; t++) route(t, &reference);
    for (slot = 0; slot < TOP_K; slot++)
        for (t = 0; t < TOKENS; t++) {
            e = reference.expert[t][slot];
            reference.kept[t][slot] = taken[e] < CAPACITY;
            taken[e]++;
        }
    for (t = 0; t < TOKENS; t++)
        for (slot = 0; slot < TOP_K; slot++) {
            if (!reference.kept[t][slot]) continue;
            expert_forward(reference.expert[t][slot], tokens + t * WIDTH, out);
            for (i = 0; i < WIDTH; i++) reference_out[t * WIDTH + i] += reference.prob[t][slot] * out[i];
        }
}

int main(int argc, char **argv)
{
    int ranks = argc > 1 ? atoi(argv[1]) : 2;
    unsigned seed = 14;
    int choices[EXPERTS] = {0};
    int kept[EXPERTS] = {0};
    int t, slot, e, r, q, i;
    dpar_comm_desc comm_desc = {0};
    dpar_pool_desc pool_desc = {0};
    dpar_pool *pool = NULL;
    dpar_group *group = NULL;
    dpar_status st;
    wrong_count = argc > 2 && strcmp(argv[2], "--wrong-count") == 0;
    if (ranks != 1 && ranks != 2 && ranks != 4) {
        fprintf(stderr, "usage: %s [ranks: 1, 2 or 4] [--wrong-count]\n", argv[0]);
        return 2;
    }
    for (i = 0; i < TOKENS * WIDTH; i++) tokens[i] = uniform(&seed);
    for (i = 0; i < WIDTH * EXPERTS; i++) router[i] = 2 * uniform(&seed);
    for (e = 0; e < EXPERTS; e++)
        for (i = 0; i < WIDTH * WIDTH; i++) expert_weights[e][i] = uniform(&seed);
    reference_layer();
    printf("%d tokens, %d per rank on %d ranks; %d experts, %d per rank; top-%d routing; capacity %d rows per expert\n",
           TOKENS, TOKENS / ranks, ranks, EXPERTS, EXPERTS / ranks, TOP_K, CAPACITY);
    if (wrong_count) printf("rank %d claims one row too many to rank 0 in the dispatch\n", ranks - 1);
    fflush(stdout); /* before the error on stderr */
    comm_desc.size = ranks;
    pool_desc.num_threads = ranks;
    st = dpar_group_create(&comm_desc, &group);
    if (st == DPAR_OK) st = dpar_pool_create(&pool_desc, &pool);
    if (st == DPAR_OK) st = dpar_pool_run(pool, rank_main, group);
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    if (st != DPAR_OK) {
        fprintf(stderr, "lesson14: %s on every rank: %s\n", dpar_status_string(st), rank0_error);
        return 1;
    }
    for (t = 0; t < TOKENS; t++) {
        printf("token %2d on rank %d:", t, t / (TOKENS / ranks));
        for (slot = 0; slot < TOP_K; slot++) {
            e = parallel.expert[t][slot];
            choices[e]++;
            kept[e] += parallel.kept[t][slot];
            printf("%s expert %d (p %.2f) %s", slot ? "," : "", e, parallel.prob[t][slot],
                   parallel.kept[t][slot] ? "kept" : "dropped");
        }
        printf("\n");
    }
    for (e = 0; e < EXPERTS; e++)
        printf("expert %d on rank %d: %d choices, %d kept, %d dropped\n", e, e / (EXPERTS / ranks), choices[e], kept[e],
               choices[e] - kept[e]);
    for (r = 0; r < ranks; r++) {
        printf("rank %d dispatches", r);
        for (q = 0; q < ranks; q++) printf("%s %d rows to rank %d", q ? "," : "", rows_sent[r][q], q);
        printf("; the combine sends them back\n");
    }
    if (memcmp(&parallel, &reference, sizeof reference) != 0 ||
        memcmp(parallel_out, reference_out, sizeof reference_out) != 0) {
        fprintf(stderr, "FAILED: the ranks' routing or outputs differ from the one-rank reference\n");
        return 1;
    }
    printf("dispatch and combine on %d ranks: every token's output = the one-rank reference, bit for bit\n", ranks);
    return 0;
}
