/* compile_impl.c + compile_user.c: the implementation in one unit, plain includes in another; linked
   together they catch duplicate or missing symbols. Built as C99, C11 and C++ by the compile matrix. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"
#include "dpar.h" /* a second include of both halves is harmless */

int compile_impl_threads(void);
int compile_impl_threads(void)
{
    dpar_pool *p;
    int n;
    if (dpar_pool_create(NULL, &p) != DPAR_OK) return -1;
    n = dpar_pool_num_threads(p);
    dpar_pool_destroy(p);
    return n;
}
