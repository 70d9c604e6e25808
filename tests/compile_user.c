/* compile_user.c: uses dpar.h without the implementation (see compile_impl.c). */
#include "dpar.h"
#include <stdio.h>

int compile_impl_threads(void);

static void body(void *user, int64_t begin, int64_t end, int thread)
{
    (void)thread;
    __atomic_fetch_add((int64_t *)user, end - begin, __ATOMIC_RELAXED);
}

#ifdef __cplusplus
/* the lambda overloads (C++ only): per-range and per-index bodies, a run returning void or a status, and a
   parallel region with a dynamic share and a reduction, against closed forms */
static int lambdas(dpar_pool *p)
{
    int64_t ranged = 0, sum = 0;
    int ran = 0;
    double total = 0;
    if (dpar_pool_for(p, 1000, [&](int64_t b, int64_t e, int) {
            __atomic_fetch_add(&ranged, e - b, __ATOMIC_RELAXED);
        }) != DPAR_OK)
        return 1;
    dpar_pool_for_dynamic(p, 1000, 7, [&](int64_t i) { __atomic_fetch_add(&sum, i, __ATOMIC_RELAXED); });
    if (dpar_pool_run(p, [&](int, int) { __atomic_fetch_add(&ran, 1, __ATOMIC_RELAXED); }) != DPAR_OK) return 1;
    dpar_status st = dpar_pool_run(p, [&](int thread, int num_threads) {
        double part = 0;
        for (dpar_share s = dpar_pool_share(p, 100, DPAR_SCHEDULE_DYNAMIC, 3); dpar_share_next(&s);)
            for (int64_t i = s.i; i < s.end; i++) part += (double)i;
        if (dpar_pool_reduce_f64(p, &part, 1, DPAR_POOL_SUM) != DPAR_OK) return DPAR_EUSER;
        if (thread == num_threads - 1) total = part;
        return thread == 99 ? DPAR_EUSER : DPAR_OK;
    });
    return ranged != 1000 || sum != 999 * 1000 / 2 || ran != dpar_pool_num_threads(p) || total != 4950.0 ||
           st != DPAR_OK;
}
#endif

int main(void)
{
    dpar_pool *p;
    dpar_pool_desc d = {0, 0, 0, NULL, {NULL, NULL, NULL}};
    int64_t n = 0;
    d.num_threads = 2;
    if (dpar_pool_create(&d, &p) != DPAR_OK) return 1;
    dpar_pool_for(p, 1000, body, &n);
#ifdef __cplusplus
    if (lambdas(p)) return 1;
#endif
    dpar_pool_destroy(p);
    if (n != 1000 || compile_impl_threads() < 1) return 1;
    printf("linked: %s\n", DPAR_VERSION);
    return 0;
}
