/* first.c - a first dpar program: a parallel-for on a pool, then an allreduce over two thread ranks.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/first.c -o build/first -pthread -lm
   Run:   build/first
   Check: ^2 ranks: the sum of the squares of 0\.\.999 is 332833500, as the serial loop's$
   A pool of 2 threads squares 0..999 in a parallel-for; then the same threads, as 2 ranks of a group, each add half
   of the squares and an allreduce gives both ranks the total. Checked against a serial loop. */
#define DPAR_IMPLEMENTATION /* in exactly one .c file, before the include */
#include "dpar.h"

#include <stdio.h>

#define N 1000
static double squares[N];
static double total;      /* what the allreduce gives rank 0 */
static dpar_group *group; /* where the ranks meet: made before they start */

static void square(void *user, int64_t begin, int64_t end, int thread) /* iterations [begin, end) of the loop */
{
    for (int64_t i = begin; i < end; i++) squares[i] = (double)i * (double)i;
    (void)user;
    (void)thread;
}

static dpar_status rank_main(void *user, int rank, int ranks) /* runs on every thread of the pool, one rank each */
{
    dpar_comm *comm;
    double sum = 0;
    dpar_status st = dpar_group_join(group, rank, &comm);    /* this thread becomes rank `rank` */
    for (int i = rank; i < N; i += ranks) sum += squares[i]; /* this rank's half of the squares */
    if (st == DPAR_OK) st = dpar_allreduce(comm, &sum, &sum, 1, DPAR_F64, DPAR_SUM);
    if (st == DPAR_OK && rank == 0) total = sum;
    dpar_comm_destroy(comm);
    (void)user;
    return st;
}

int main(void)
{
    dpar_pool_desc pool_desc = {0}; /* zero means "the defaults" */
    dpar_comm_desc comm_desc = {0};
    dpar_pool *pool = NULL;
    double serial = 0;
    dpar_status st;
    pool_desc.num_threads = 2;
    st = dpar_pool_create(&pool_desc, &pool);
    if (st == DPAR_OK) st = dpar_pool_for(pool, N, square, NULL); /* the calling thread takes part */
    comm_desc.size = 2;
    comm_desc.pool = pool; /* the group checks that the pool has a thread for each rank */
    if (st == DPAR_OK) st = dpar_group_create(&comm_desc, &group);
    if (st == DPAR_OK) st = dpar_pool_run(pool, rank_main, NULL); /* rank_main on each thread, until all return */
    dpar_group_destroy(group);
    dpar_pool_destroy(pool);
    if (st != DPAR_OK) {
        fprintf(stderr, "first: %s\n", dpar_last_error());
        return 1;
    }
    for (int i = 0; i < N; i++) serial += (double)i * (double)i;
    if (total != serial) {
        fprintf(stderr, "first: the ranks' sum %.0f differs from the serial loop's %.0f\n", total, serial);
        return 1;
    }
    printf("2 ranks: the sum of the squares of 0..%d is %.0f, as the serial loop's\n", N - 1, total);
    return 0;
}
