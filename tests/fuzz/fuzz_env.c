/* fuzz_env.c - libFuzzer target of the environment-variable parsers: byte 0 picks the variable, the rest (up to
   the first NUL, at most 63 bytes) is its value.
     0 DPAR_NUM_THREADS  setenv + dpar_pool_create with num_threads 0: the pool's size is the value when it is a
                         whole number in 1..DPAR_MAX_THREADS (built with 64 here), else the online CPUs
     1 DPAR_TIMEOUT_MS   setenv + dpar_group_create and _join with timeout_ms 0: when the value is a whole number
                         from -1 up (-1 and 0: none) that the timeout can hold, the comm's timeout is it in ms
                         (empty: 30000); else creation fails with DPAR_EINVAL naming DPAR_TIMEOUT_MS
     2 DPAR_LOG          the parser DPAR_LOG goes through (read once per process by dpar_log_get_level, so
                         called directly): the level the name says, warn for anything else; and setenv +
                         dpar_group_create: DPAR_EINVAL naming DPAR_LOG exactly when the value names no level
     3 DPAR_TRACE        setenv + the start-up hook a pool runs, with the value as a file name in the scratch
                         directory ('/' becomes '_'), the value also as a thread and event name: the file is
                         JSON (tests/json.h's strict reader); a name the file system refuses: the hook's status
                         is an error and its text names DPAR_TRACE
   Each case unsets its variable after it: the next input's creation sees only its own.
     4 DPAR_FAULT        dpar_fault_set(value) (the parser DPAR_FAULT goes through): OK or DPAR_EINVAL with a
                         text that quotes the spec; OK exactly when the reference below accepts it, wherever the
                         reference is sure (it leaves out spaces, empty faults and repeated keys); then cleared
   The reference for the numbers is a parser written here, digits only (an optional sign; strtol's leading
   spaces accepted as dpar accepts them). */
#define DPAR_MAX_THREADS 64
#define DPAR_IMPLEMENTATION
#include "dpar.h"
#include "fuzz_common.h"
#include "json.h"
#include <ctype.h>
#include <limits.h>

static void quiet(void *user, dpar_log_level level, const char *file, int line, const char *msg)
{
    (void)user, (void)level, (void)file, (void)line, (void)msg;
}

/* 1 and *out when s is [spaces][+-]digits whose value lies in [lo, hi] */
static int whole_number(const char *s, long long lo, long long hi, long long *out)
{
    int neg = 0, digits = 0;
    long long v = 0;
    while (*s && isspace((unsigned char)*s)) s++;
    if (*s == '+' || *s == '-') neg = *s++ == '-';
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return 0;
        if (v > 100000000000000000LL) return 0; /* far beyond every limit here */
        v = v * 10 + (*s - '0');
        digits++;
    }
    if (!digits) return 0;
    *out = neg ? -v : v;
    return *out >= lo && *out <= hi;
}

/* the reference reading of a DPAR_FAULT spec: 1 valid, 0 invalid, -1 not sure (a form the grammar leaves open) */
static int fault_ref(const char *spec)
{
    static const char *const ops[] = {"any",       "barrier",   "broadcast", "reduce", "reduce_scatter",
                                      "allgather", "allreduce", "alltoall",  "send",   "recv",
                                      "bucket",    "stage",     "steal",     "task"};
    char buf[64], *fault, *save1 = NULL;
    int faults = 0;
    long long v;
    size_t i;
    if (!*spec) return 1;
    for (i = 0; spec[i]; i++)
        if (isspace((unsigned char)spec[i])) return -1; /* the numbers' reader here skips spaces; dpar's must not */
    if (strlen(spec) >= sizeof buf || strstr(spec, ";;") || spec[0] == ';' || spec[strlen(spec) - 1] == ';' ||
        strstr(spec, ",,") || spec[0] == ',')
        return -1;
    strcpy(buf, spec);
    for (fault = strtok_r(buf, ";", &save1); fault; fault = strtok_r(NULL, ";", &save1)) {
        char *field, *save2 = NULL;
        int seen[5] = {0, 0, 0, 0, 0};
        if (fault[0] == ',' || fault[strlen(fault) - 1] == ',') return -1; /* an empty field */
        if (++faults > 16) return 0;
        for (field = strtok_r(fault, ",", &save2); field; field = strtok_r(NULL, ",", &save2)) {
            char *eq = strchr(field, '=');
            int key;
            if (!eq) return 0;
            *eq++ = 0;
            key = !strcmp(field, "kind")   ? 0
                  : !strcmp(field, "rank") ? 1
                  : !strcmp(field, "op")   ? 2
                  : !strcmp(field, "at")   ? 3
                  : !strcmp(field, "comm") ? 4
                                           : -2;
            if (key < 0) return 0;
            if (seen[key]++) return -1;
            if (key == 0) {
                if (!strcmp(eq, "vanish") || !strcmp(eq, "fail")) continue;
                if (strncmp(eq, "delay:", 6)) return 0;
                if (eq[6] == '+' || eq[6] == '-') return -1;
                if (!whole_number(eq + 6, 0, 3600000, &v)) return 0;
            } else if (key == 1) {
                if (*eq == '+' || *eq == '-') return -1;
                if (!whole_number(eq, 0, INT_MAX, &v)) return 0;
            } else if (key == 2) {
                for (i = 0; i < sizeof ops / sizeof ops[0] && strcmp(eq, ops[i]); i++) continue;
                if (i == sizeof ops / sizeof ops[0]) return 0;
            } else if (key == 3) {
                if (*eq == '+' || *eq == '-') return -1;
                if (!whole_number(eq, 1, INT_MAX, &v)) return 0;
            } else if (!*eq || strlen(eq) > 31) {
                return 0; /* comm: 1..31 characters */
            }
        }
        if (!seen[0]) return 0; /* kind is required */
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    char value[64], path[512];
    size_t k;
    long long want;
    if (n < 1) return 0;
    for (k = 0; k + 1 < n && k < sizeof value - 1 && data[k + 1]; k++) value[k] = (char)data[k + 1];
    value[k] = 0;
    dpar_log_set_callback(quiet, NULL);
    switch (data[0] % 5) {
    case 0: {
        dpar_pool *pool;
        dpar_pool_desc d;
        int expect;
        memset(&d, 0, sizeof d);
        setenv("DPAR_NUM_THREADS", value, 1);
        FUZZ_ASSERT(dpar_pool_create(&d, &pool) == DPAR_OK, "%s", dpar_last_error());
        expect = whole_number(value, 1, DPAR_MAX_THREADS, &want) ? (int)want : dpar__online_cpus();
        if (expect > DPAR_MAX_THREADS) expect = DPAR_MAX_THREADS;
        FUZZ_ASSERT(dpar_pool_num_threads(pool) == expect, "DPAR_NUM_THREADS='%s': %d threads, expected %d", value,
                    dpar_pool_num_threads(pool), expect);
        dpar_pool_destroy(pool);
        break;
    }
    case 1: {
        dpar_group *g;
        dpar_comm *c;
        dpar_comm_desc d;
        uint64_t expect;
        memset(&d, 0, sizeof d);
        d.size = 1;
        setenv("DPAR_TIMEOUT_MS", value, 1);
        if (*value && !whole_number(value, -1, (long long)(UINT64_MAX / 1000000u), &want)) {
            dpar_status st = dpar_group_create(&d, &g);
            FUZZ_ASSERT(st == DPAR_EINVAL && strstr(dpar_last_error(), "DPAR_TIMEOUT_MS=\""),
                        "DPAR_TIMEOUT_MS='%s' is malformed: %s, %s", value, dpar_status_string(st), dpar_last_error());
            unsetenv("DPAR_TIMEOUT_MS");
            break;
        }
        FUZZ_ASSERT(dpar_group_create(&d, &g) == DPAR_OK, "DPAR_TIMEOUT_MS='%s': %s", value, dpar_last_error());
        FUZZ_ASSERT(dpar_group_join(g, 0, &c) == DPAR_OK, "%s", dpar_last_error());
        expect = !*value ? (uint64_t)DPAR_TIMEOUT_MS_DEFAULT * 1000000u : want > 0 ? (uint64_t)want * 1000000u : 0;
        FUZZ_ASSERT(c->timeout_ns == expect, "DPAR_TIMEOUT_MS='%s': %llu ns, expected %llu", value,
                    (unsigned long long)c->timeout_ns, (unsigned long long)expect);
        dpar_comm_destroy(c);
        dpar_group_destroy(g);
        unsetenv("DPAR_TIMEOUT_MS");
        break;
    }
    case 2: {
        static const char *names[] = {"off", "none", "error", "warn", "warning", "info", "debug"};
        static const int levels[] = {DPAR_LOG_OFF,  DPAR_LOG_OFF,  DPAR_LOG_ERROR, DPAR_LOG_WARN,
                                     DPAR_LOG_WARN, DPAR_LOG_INFO, DPAR_LOG_DEBUG};
        int expect = DPAR_LOG_WARN, got, named = !*value;
        dpar_group *g = NULL;
        dpar_comm_desc d;
        dpar_status st;
        for (k = 0; k < 7; k++)
            if (!strcmp(value, names[k])) expect = levels[k], named = 1;
        setenv("DPAR_LOG", value, 1);
        got = dpar__log_level_from_env();
        FUZZ_ASSERT(got == expect, "DPAR_LOG='%s': level %d, expected %d", value, got, expect);
        memset(&d, 0, sizeof d);
        d.size = 1;
        st = dpar_group_create(&d, &g);
        FUZZ_ASSERT(named ? st == DPAR_OK : st == DPAR_EINVAL && strstr(dpar_last_error(), "DPAR_LOG=\""),
                    "DPAR_LOG='%s': %s, %s", value, dpar_status_string(st), dpar_last_error());
        dpar_group_destroy(g);
        unsetenv("DPAR_LOG");
        break;
    }
    case 4: {
        dpar_status st = dpar_fault_set(value);
        int ref = fault_ref(value);
        FUZZ_ASSERT(st == DPAR_OK || st == DPAR_EINVAL, "DPAR_FAULT='%s': %s", value, dpar_status_string(st));
        if (st == DPAR_EINVAL)
            FUZZ_ASSERT(strstr(dpar_last_error(), "DPAR_FAULT") || strstr(dpar_last_error(), "fault"),
                        "DPAR_FAULT='%s': the error does not say what: %s", value, dpar_last_error());
        if (ref >= 0)
            FUZZ_ASSERT((st == DPAR_OK) == (ref == 1), "DPAR_FAULT='%s': %s, the reference says %s (%s)", value,
                        dpar_status_string(st), ref ? "valid" : "invalid", dpar_last_error());
        FUZZ_ASSERT(dpar_fault_set(NULL) == DPAR_OK, "clearing: %s", dpar_last_error());
        break;
    }
    case 3: {
        char name[64];
        FILE *f;
        long size;
        char *text;
        jv *doc;
        for (k = 0; value[k]; k++) name[k] = value[k] == '/' ? '_' : value[k];
        name[k] = 0;
        snprintf(path, sizeof path, "%s/t%s", fuzz_scratch(), name);
        setenv("DPAR_TRACE", path, 1);
        dpar__trace_env_checked = 0; /* the hook runs once per process: once per input here */
        if (dpar__trace_from_env() != DPAR_OK || !dpar_trace_enabled()) { /* a name the file system refuses */
            FUZZ_ASSERT(!dpar_trace_enabled() && dpar__trace_from_env() != DPAR_OK &&
                            strstr(dpar__trace_env_bad, "DPAR_TRACE=\""),
                        "DPAR_TRACE='%s': no trace, but no error either ('%s')", path, dpar__trace_env_bad);
            dpar__trace_env_checked = 0, unsetenv("DPAR_TRACE");
            dpar__trace_from_env(); /* the next input's pools see no DPAR_TRACE failure */
            break;
        }
        unsetenv("DPAR_TRACE");
        dpar_trace_set_thread_name(value);
        dpar_trace_event(value, value, dpar_time_ns(), dpar_time_ns() + 1, NULL);
        FUZZ_ASSERT(dpar_trace_stop() == DPAR_OK, "%s", dpar_last_error());
        f = fopen(path, "rb");
        FUZZ_ASSERT(f != NULL, "no trace file '%s'", path);
        fseek(f, 0, SEEK_END);
        size = ftell(f);
        fseek(f, 0, SEEK_SET);
        text = (char *)calloc((size_t)size + 1, 1);
        FUZZ_ASSERT(fread(text, 1, (size_t)size, f) == (size_t)size, "read");
        fclose(f);
        doc = jv_parse(text);
        FUZZ_ASSERT(doc != NULL, "the trace of name '%s' is not JSON:\n%s", value, text);
        jv_free(doc);
        free(text);
        remove(path);
        break;
    }
    }
    return 0;
}
