/* compile_late.c: the implementation included after system headers (issue 21). Under -std=c99/c11 glibc hides
   POSIX (clock_gettime, CLOCK_MONOTONIC) unless a feature macro comes before the first system header; -pthread,
   which dpar needs anyway, defines _REENTRANT, which glibc takes as _POSIX_C_SOURCE=199506L: enough for dpar.h.
   Built by the compile matrix with -pthread; docs/openmp.md, 'Include order'. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#define DPAR_IMPLEMENTATION
#include "dpar.h"

int main(void)
{
    dpar_pool *p;
    if (dpar_pool_create(NULL, &p) != DPAR_OK) return 1;
    printf("late include: %d threads\n", dpar_pool_num_threads(p));
    return dpar_pool_destroy(p) != DPAR_OK;
}
