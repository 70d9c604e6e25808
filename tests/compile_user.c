/* compile_user.c: uses dpar.h without the implementation (see compile_impl.c). */
#include "dpar.h"
#include <stdio.h>

int compile_impl_threads(void);

static void body(void *user, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    __atomic_fetch_add((int64_t *)user, end - begin, __ATOMIC_RELAXED);
}

int main(void)
{
    dpar_pool *p;
    dpar_pool_desc d = {0, 0, 0, NULL, {NULL, NULL, NULL}};
    int64_t n = 0;
    d.num_threads = 2;
    if (dpar_pool_create(&d, &p) != DPAR_OK) return 1;
    dpar_pool_for(p, 1000, body, &n);
    dpar_pool_destroy(p);
    if (n != 1000 || compile_impl_threads() < 1) return 1;
    printf("linked: %s\n", DPAR_VERSION);
    return 0;
}
