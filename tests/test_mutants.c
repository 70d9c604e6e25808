/* test_mutants.c - tests written for planted bugs of tests/mutations.txt that no other test caught (make mutate
   runs each mutation against the test its line names). */
#define DPAR_IMPLEMENTATION
#include "dpar.h"
#include "dpar_test.h"
#include "coll_matrix.h"

/* ---- the contract checker compares the calls' sequence numbers ----
   A rank whose count of calls differs from its peers' (here: rank 1's counter moved on by one, as after a call the
   others never saw) must get a mismatch naming both numbers, not a silent pairing of different calls. On thread
   ranks the calls meet by number first; the check that sees the difference is the one on each message
   (dpar__fp_agree), which a planted bug once reduced to coll, count, dtype, op and root. */
typedef struct {
    size_t count;
    dpar_status st[2];
    char msg[2][DPAR__ERROR_TEXT];
} seq_job;
static void seq_rank(world *w, dpar_comm *c, int r)
{
    seq_job *j = (seq_job *)w->user;
    float *x = (float *)calloc(j->count, sizeof(float));
    if (r == 1) c->seq++;
    j->st[r] = dpar_broadcast(c, x, x, j->count, DPAR_F32, 0);
    snprintf(j->msg[r], sizeof j->msg[r], "%s", dpar_last_error());
    free(x);
}
static void test_checker_compares_sequence_numbers(void)
{
    static const size_t counts[2] = {100000, 7};
    int k, r;
    for (k = 0; k < 2; k++) {
        seq_job j;
        dpar_comm_desc d;
        memset(&j, 0, sizeof j);
        memset(&d, 0, sizeof d);
        d.timeout_ms = 2000;
        j.count = counts[k];
        run_world_desc(2, &d, seq_rank, &j, NULL, 0);
        for (r = 0; r < 2; r++)
            CHECK_MSG(j.st[r] != DPAR_OK, "count %zu: rank %d: %s (%s)", j.count, r, dpar_status_string(j.st[r]),
                      j.msg[r]);
        CHECK_MSG(j.st[0] == DPAR_EMISMATCH || j.st[1] == DPAR_EMISMATCH, "count %zu: %s / %s", j.count, j.msg[0],
                  j.msg[1]);
    }
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_checker_compares_sequence_numbers);
    pools_free();
    return dt_summary();
}
