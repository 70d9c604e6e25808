/* 03_ring.c - lesson 3 of the guide (docs/guide/03_ring.md): the ring allreduce, step by step.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/03_ring.c -o build/lesson03 -pthread -lm
   Run:   build/lesson03              (build/lesson03 5: five ranks, 2 to 9)
   Check: ^after reduce-scatter: rank r owns the finished chunk \(r\+1\) mod [0-9], equal to the serial sum$
   Check: ^ring = dpar_allreduce = the serial sum, on all [0-9] ranks$
   Check: ^each rank sent 2\(N-1\) = [0-9]+ chunks of 4 bytes = [0-9]+ bytes \(dpar's counters agree\)$

   N ranks each hold a vector of N integers, one chunk each; rank r's chunk c is (c+1) * 10^r, so the
   digits of a sum say which ranks it contains (1111 = all of 4 ranks, 0110 = ranks 1 and 2).
   The ring moves one chunk per rank per step to the next rank: N-1 steps of reduce-scatter (add what
   arrives), then N-1 steps of all-gather (keep what arrives). Written with dpar_sendrecv, then checked
   against dpar_allreduce and a serial sum. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXR 9

static int nranks;
static int32_t held[2 * MAXR][MAXR][MAXR]; /* [moment][rank][chunk]: what each rank holds after each step */
static int32_t by_dpar[MAXR][MAXR];        /* [rank][chunk]: dpar_allreduce's result */
static uint64_t sent[MAXR];                /* bytes each rank sent, by dpar's counters */
static dpar_group *group;

static int mod(int a, int n) { return (a % n + n) % n; }

/* The ring allreduce (sum) of x, one int32 chunk per rank; records x after every step in held[]. */
static dpar_status ring_allreduce(dpar_comm *comm, int32_t *x)
{
    int rank = dpar_comm_rank(comm), n = dpar_comm_size(comm), s, moment = 0;
    int next = mod(rank + 1, n), prev = mod(rank - 1, n);
    int32_t in;
    dpar_status st = DPAR_OK;
    memcpy(held[moment++][rank], x, n * sizeof *x);
    /* Reduce-scatter: at step s, send chunk (rank - s) to the next rank, and add chunk (rank - s - 1) from
       the previous one to ours. The chunk we send is the one we just added to: sums grow as they travel. */
    for (s = 0; s < n - 1 && st == DPAR_OK; s++) {
        st = dpar_sendrecv(comm, &x[mod(rank - s, n)], 1, next, &in, 1, prev, DPAR_I32, 0);
        x[mod(rank - s - 1, n)] += in;
        memcpy(held[moment++][rank], x, n * sizeof *x);
    }
    /* Now chunk (rank + 1) holds the sum over all ranks. All-gather: at step s, send chunk (rank + 1 - s),
       finished, and overwrite chunk (rank - s) with the finished one from the previous rank. */
    for (s = 0; s < n - 1 && st == DPAR_OK; s++) {
        st = dpar_sendrecv(comm, &x[mod(rank + 1 - s, n)], 1, next, &x[mod(rank - s, n)], 1, prev, DPAR_I32, 0);
        memcpy(held[moment++][rank], x, n * sizeof *x);
    }
    return st;
}

static dpar_status rank_main(void *user, int rank, int n)
{
    int32_t x[MAXR], input[MAXR];
    int c, p = 1;
    dpar_comm *comm;
    dpar_comm_stats stats = {0};
    dpar_status st = dpar_group_join(group, rank, &comm);
    (void)user;
    for (c = 0; c < rank; c++) p *= 10;
    for (c = 0; c < n; c++) input[c] = x[c] = (c + 1) * p; /* rank r's chunk c: (c+1) * 10^r */
    if (st == DPAR_OK) st = ring_allreduce(comm, x);
    if (st == DPAR_OK) st = dpar_comm_stats_get(comm, &stats); /* so far: only the ring's messages */
    sent[rank] = stats.by_coll[DPAR_COLL_SEND].bytes_sent;
    if (st == DPAR_OK) st = dpar_allreduce(comm, input, by_dpar[rank], n, DPAR_I32, DPAR_SUM);
    dpar_comm_destroy(comm);
    return st;
}

static void print_moment(const char *title, int m)
{
    int r, c;
    printf("%s\n", title);
    for (r = 0; r < nranks; r++) {
        printf("  rank %d:", r);
        for (c = 0; c < nranks; c++) printf(" %*d", nranks + 1, held[m][r][c]);
        printf("\n");
    }
}

int main(int argc, char **argv)
{
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool;
    int32_t serial[MAXR];
    char title[100];
    int r, c, s, p, ok = 1, owns = 1;
    nranks = argc > 1 ? atoi(argv[1]) : 4;
    if (nranks < 2 || nranks > MAXR) {
        fprintf(stderr, "03_ring: %d ranks: give 2 to %d\n", nranks, MAXR);
        return 2;
    }
    cd.size = pd.num_threads = nranks;
    if (dpar_group_create(&cd, &group) != DPAR_OK || dpar_pool_create(&pd, &pool) != DPAR_OK ||
        dpar_pool_run(pool, rank_main, NULL) != DPAR_OK) {
        fprintf(stderr, "failed: %s\n", dpar_last_error());
        return 1;
    }
    for (c = 0; c < nranks; c++) { /* the reference: the sum of every rank's chunk c, in one loop */
        serial[c] = 0;
        p = 1; /* 10^r */
        for (r = 0; r < nranks; r++) {
            serial[c] += (c + 1) * p;
            p *= 10;
        }
    }

    print_moment("start: rank r holds (c+1) * 10^r in chunk c", 0);
    for (s = 1; s < nranks; s++) {
        snprintf(title, sizeof title, "reduce-scatter step %d: send one chunk to rank+1, add the one received", s);
        print_moment(title, s);
    }
    for (r = 0; r < nranks; r++) owns &= held[nranks - 1][r][(r + 1) % nranks] == serial[(r + 1) % nranks];
    if (owns)
        printf("after reduce-scatter: rank r owns the finished chunk (r+1) mod %d, equal to the serial sum\n", nranks);
    for (s = 1; s < nranks; s++) {
        snprintf(title, sizeof title, "all-gather step %d: send a finished chunk to rank+1, keep the one received", s);
        print_moment(title, nranks - 1 + s);
    }
    for (r = 0; r < nranks; r++)
        for (c = 0; c < nranks; c++) ok &= held[2 * nranks - 2][r][c] == serial[c] && by_dpar[r][c] == serial[c];
    if (ok) printf("ring = dpar_allreduce = the serial sum, on all %d ranks\n", nranks);
    for (r = 0; r < nranks; r++) ok &= sent[r] == (uint64_t)(2 * (nranks - 1) * 4);
    if (ok)
        printf("each rank sent 2(N-1) = %d chunks of 4 bytes = %d bytes (dpar's counters agree)\n", 2 * (nranks - 1),
               8 * (nranks - 1));
    dpar_pool_destroy(pool);
    dpar_group_destroy(group);
    if (!ok || !owns) fprintf(stderr, "FAILED: the ring differs from the reference\n");
    return ok && owns ? 0 : 1;
}
