/* compile_static_b.c: the second private copy (see compile_static_a.c). */
#define DPAR_STATIC
#define DPAR_IMPLEMENTATION
#include "dpar.h"

int static_b_threads(void);
int static_b_threads(void)
{
    dpar_pool *p;
    int n;
    if (dpar_pool_create(NULL, &p) != DPAR_OK) return -1;
    n = dpar_pool_num_threads(p);
    dpar_pool_destroy(p);
    return n;
}
