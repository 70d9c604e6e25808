/* dpar_test.h - the small test runner of dpar's suite.

   A test is a `static void name(void)` that calls CHECK(...) and may SKIP("reason"). main() lists
   them with RUN(name) and returns dt_summary(), which prints `N passed, N failed[, N skipped]` and
   gives the exit status. A name given on the command line runs only the tests containing it; -name leaves out
   the tests containing name. */
#ifndef DPAR_TEST_H
#define DPAR_TEST_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__GNUC__) || defined(__clang__)
#define DT_UNUSED __attribute__((unused))
#else
#define DT_UNUSED
#endif

static int dt_passed, dt_failed, dt_skipped, dt_test_failed, dt_test_skipped, dt_argc;
static char **dt_argv;
static char dt_skip_reason[256];

static void dt_fail(const char *file, int line, const char *what)
{
    if (dt_test_failed < 5) printf("    %s:%d: check failed: %s\n", file, line, what);
    dt_test_failed++;
    fflush(stdout);
}

#define CHECK(cond)                                      \
    do {                                                 \
        if (!(cond)) dt_fail(__FILE__, __LINE__, #cond); \
    } while (0)
/* CHECK_MSG: a failed check that also prints a formatted detail */
#define CHECK_MSG(cond, ...)                    \
    do {                                        \
        if (!(cond)) {                          \
            dt_fail(__FILE__, __LINE__, #cond); \
            if (dt_test_failed <= 5) {          \
                printf("      ");               \
                printf(__VA_ARGS__);            \
                printf("\n");                   \
            }                                   \
        }                                       \
    } while (0)
#define SKIP(reason)                                                   \
    do {                                                               \
        snprintf(dt_skip_reason, sizeof dt_skip_reason, "%s", reason); \
        dt_test_skipped = 1;                                           \
        return;                                                        \
    } while (0)

static double dt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

DT_UNUSED static void dt_run(const char *name, void (*fn)(void))
{
    double t0;
    int i, selected = 1, excluded = 0;
    for (i = 1; i < dt_argc; i++) /* any name given: only the tests it names */
        if (dt_argv[i][0] != '-') selected = 0;
    for (i = 1; i < dt_argc; i++) {
        if (dt_argv[i][0] == '-' && dt_argv[i][1] && strstr(name, dt_argv[i] + 1)) excluded = 1;
        if (dt_argv[i][0] != '-' && strstr(name, dt_argv[i])) selected = 1;
    }
    if (!selected || excluded) return;
    dt_test_failed = 0;
    dt_test_skipped = 0;
    printf("  %s ...\n", name);
    fflush(stdout);
    t0 = dt_now();
    fn();
    if (dt_test_failed) {
        dt_failed++;
        printf("FAIL %s (%d failed checks)\n", name, dt_test_failed);
    } else if (dt_test_skipped) {
        dt_skipped++;
        printf("skip %s: skipped: %s\n", name, dt_skip_reason);
    } else {
        dt_passed++;
        printf("ok   %s (%.0f ms)\n", name, 1e3 * (dt_now() - t0));
    }
    fflush(stdout);
}

#define DT_MAIN_BEGIN(argc, argv) \
    dt_argc = (argc);             \
    dt_argv = (argv)
#define RUN(fn) dt_run(#fn, fn)

DT_UNUSED static int dt_summary(void)
{
    if (dt_skipped) printf("%d passed, %d failed, %d skipped\n", dt_passed, dt_failed, dt_skipped);
    else printf("%d passed, %d failed\n", dt_passed, dt_failed);
    return dt_failed ? 1 : 0;
}

/* A small xorshift generator, so tests are reproducible from a seed. */
static unsigned long long dt_rng_state = 88172645463325252ull;
DT_UNUSED static unsigned long long dt_rand(void)
{
    dt_rng_state ^= dt_rng_state << 13;
    dt_rng_state ^= dt_rng_state >> 7;
    dt_rng_state ^= dt_rng_state << 17;
    return dt_rng_state;
}
DT_UNUSED static int dt_rand_int(int n) { return (int)(dt_rand() % (unsigned long long)n); }

/* A counting allocator: every test that creates objects with it checks that allocations equal frees. */
typedef struct dt_counting {
    long allocs, frees;
} dt_counting;
DT_UNUSED static void *dt_count_alloc(void *user, size_t size)
{
    __atomic_fetch_add(&((dt_counting *)user)->allocs, 1, __ATOMIC_RELAXED);
    return malloc(size);
}
DT_UNUSED static void dt_count_free(void *user, void *p)
{
    __atomic_fetch_add(&((dt_counting *)user)->frees, 1, __ATOMIC_RELAXED);
    free(p);
}
#endif
