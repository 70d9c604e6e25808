/* kill_mpi.c - tests/kill.sh's MPI case: every process loops allreduces on a dpar comm (timeout 3 s); process 1
   kills itself with SIGKILL after 50 calls. A survivor prints the error dpar gives it ("kill_mpi: rank R: <error>")
   and exits 3; what else happens is Open MPI's: see tests/kill.sh.
   Build: mpicc -std=c99 -O2 -I. tests/kill_mpi.c -o kill_mpi -pthread -lm */
#define DPAR_MPI
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <signal.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    int provided, me, i;
    dpar_comm *c;
    dpar_comm_desc d;
    float x[256];
    dpar_status st = DPAR_OK;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    memset(&d, 0, sizeof d);
    d.timeout_ms = 3000;
    if (dpar_comm_from_mpi(MPI_COMM_WORLD, &d, &c) != DPAR_OK) return printf("kill_mpi: %s\n", dpar_last_error()), 2;
    for (i = 0; i < 1000000 && st == DPAR_OK; i++) {
        if (me == 1 && i == 50) raise(SIGKILL);
        memset(x, 0, sizeof x);
        st = dpar_allreduce(c, x, x, 256, DPAR_F32, DPAR_SUM);
    }
    printf("kill_mpi: rank %d: %s after %d calls: %s\n", me, dpar_status_string(st), i, dpar_last_error());
    fflush(stdout);
    _exit(3); /* MPI_Finalize would wait for the dead process */
}
