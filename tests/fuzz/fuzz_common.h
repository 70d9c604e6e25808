/* fuzz_common.h - what the libFuzzer targets of tests/fuzz share: a scratch directory of their own and a
   writer of whole files. Each target compiles dpar's implementation into itself, so its internal parsers
   (static functions, the comm's fields) are reachable. Build and run: make fuzz (FUZZ_SECONDS=60). */
#ifndef DPAR_FUZZ_COMMON_H
#define DPAR_FUZZ_COMMON_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* a directory for this process's files, made on the first call, removed at exit */
static char fuzz_dir[256];
static void fuzz_rmdir(void)
{
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", fuzz_dir);
    if (system(cmd) != 0) fprintf(stderr, "fuzz: could not remove %s\n", fuzz_dir);
}
static const char *fuzz_scratch(void)
{
    if (!fuzz_dir[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(fuzz_dir, sizeof fuzz_dir, "%s/dpar_fuzz_XXXXXX", t && *t ? t : "/tmp");
        if (!mkdtemp(fuzz_dir)) {
            perror("fuzz: mkdtemp");
            abort();
        }
        atexit(fuzz_rmdir);
    }
    return fuzz_dir;
}
static void fuzz_write(const char *path, const unsigned char *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        perror(path);
        abort();
    }
}
/* a failed property: print it and abort, which libFuzzer reports as a crash with the input */
#define FUZZ_ASSERT(c, ...)                                               \
    do {                                                                  \
        if (!(c)) {                                                       \
            fprintf(stderr, "fuzz: %s:%d: %s: ", __FILE__, __LINE__, #c); \
            fprintf(stderr, __VA_ARGS__);                                 \
            fprintf(stderr, "\n");                                        \
            abort();                                                      \
        }                                                                 \
    } while (0)
#endif
