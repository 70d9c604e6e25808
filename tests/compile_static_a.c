/* compile_static_a.c + compile_static_b.c: two units that each embed a private (DPAR_STATIC) copy of
   dpar link into one program without clashing, as two libraries embedding dpar would. */
#define DPAR_STATIC
#define DPAR_IMPLEMENTATION
#include "dpar.h"

int static_b_threads(void);

int main(void)
{
    dpar_pool *p;
    int a;
    if (dpar_pool_create(NULL, &p) != DPAR_OK) return 1;
    a = dpar_pool_num_threads(p);
    dpar_pool_destroy(p);
    return a >= 1 && static_b_threads() == a ? 0 : 1;
}
