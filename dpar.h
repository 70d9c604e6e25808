/* dpar.h - an embeddable, header-only toolkit for parallel and distributed training.  v0.1.0
   https://github.com/dpar/dpar  (MIT license, at the end of this file)

   WHAT
     Thread worker pools, collectives over thread ranks, tensor sharding and pipeline stages that a
     host application composes into a trainer of its own. C99 + pthreads, no other dependency.

   QUICK START
     In exactly one C (or C++) file of your program, define DPAR_IMPLEMENTATION before the include,
     and include dpar.h before any system header of that file:

         #define DPAR_IMPLEMENTATION
         #include "dpar.h"

     Everywhere else include "dpar.h" alone. Link with -pthread.

         static void square(void *user, int64_t begin, int64_t end, int thread) {
             float *x = (float *)user;
             for (int64_t i = begin; i < end; i++) x[i] = x[i] * x[i];
             (void)thread;
         }
         ...
         dpar_pool *pool;
         dpar_pool_desc desc = {0};              // zero means "the defaults"
         if (dpar_pool_create(&desc, &pool) != DPAR_OK) { puts(dpar_last_error()); return 1; }
         dpar_pool_for(pool, n, square, x);      // static schedule, the caller takes part
         dpar_pool_destroy(pool);

   OPTIONS (define before the include that has DPAR_IMPLEMENTATION; every one has a default)
     DPAR_IMPLEMENTATION   emit the implementation in this translation unit
     DPAR_STATIC           make every function static (two libraries can embed dpar without clashing)
     DPAR_API              override the declaration prefix (default: extern, or static under DPAR_STATIC)
     DPAR_ASSERT(c)        assertion hook for programmer errors (default: assert from <assert.h>)
     DPAR_NO_FUTEX         use a mutex/condition-variable parking lot instead of Linux futexes
     DPAR_SPIN_US          default microseconds a wait spins before it sleeps (default 200)
     DPAR_MAX_THREADS      largest pool accepted by dpar_pool_create (default 1024)

   ENVIRONMENT (code arguments always win over the environment)
     DPAR_NUM_THREADS=N    threads of a pool whose description says 0
     DPAR_TRACE=file.json  write a Chrome trace-event file (open it in Perfetto or chrome://tracing)
     DPAR_LOG=error|warn|info|debug|off   log level (default warn)

   SECTIONS (grep for the tag)            THREAD SAFETY, in short
     >>config    portability, options      status, log, error: any thread; the error text is per thread
     >>status    status codes, errors      trace: any thread; start/stop from one thread at a time
     >>log       log levels and callback   pool: see below; every call says who may make it
     >>trace     Chrome trace-event sink
     >>pool      worker pool: parallel-for, SPMD run, barrier, task graph
     >>impl      the implementation, in the same order

   THE POOL
     A pool of T threads is the calling thread plus T-1 persistent workers. dpar_pool_for and
     dpar_pool_run are fork-join calls: the caller takes part as thread 0 and returns when all T are
     done. Tasks (dpar_task_submit) run on the workers as soon as their dependencies are done; a
     thread outside the pool that waits for tasks runs ready ones meanwhile, so a pool of 1 thread
     still runs its task graph. A task that waits for another runs only that one (when it is ready),
     never unrelated tasks that could end up waiting on it. Waits spin for DPAR_SPIN_US microseconds
     (yielding now and then), then sleep on a futex: an idle pool costs no CPU, and 8 workers on 2
     cores still make progress. Workers that find themselves on the CPU of another thread of the
     pool move away (Linux tends to wake a thread onto its waker's CPU; see docs/pool.md).
     - Nested parallel-for (from inside a worker, a task or a parallel-for body of the same pool) runs
       inline on the calling thread: no deadlock, no oversubscription.
     - A second thread calling dpar_pool_for or dpar_pool_run while the pool is busy waits its turn.
     - dpar_pool_run from inside the same pool returns DPAR_EBUSY (its threads could not all start).
     - A task that fails (returns a negative status) cancels every task that depends on it, directly
       or not; those do not run, and waiting on them returns the failed task's status.
     - Task handles stay valid until dpar_task_wait_all returns; it ends a task epoch and recycles
       the task records, so a long-running program calls it once per step or batch of tasks.
     - dpar_pool_destroy lets running tasks finish, cancels tasks that have not started (and says so
       with DPAR_ECANCELED), and joins the workers. Calling it from a worker returns DPAR_EBUSY.

   TRACE
     dpar_trace_start("t.json") (or DPAR_TRACE=t.json) records pool calls, tasks and, later, the
     collectives and pipeline ops as complete ("X") events, one track per thread. Modules and user code
     add events with dpar_trace_event. The file is valid JSON once dpar_trace_stop has run; with
     DPAR_TRACE, stop runs at exit.
*/
#if defined(DPAR_IMPLEMENTATION) && !defined(DPAR__FEATURES_DEFINED)
#define DPAR__FEATURES_DEFINED
/* >>config: the implementation needs POSIX 2008 and syscall(); these must precede every system
   header of the translation unit, which is why dpar.h asks to be included first there. */
#if (defined(__linux__) || defined(__gnu_linux__)) && !defined(_DEFAULT_SOURCE) && !defined(_GNU_SOURCE)
#define _DEFAULT_SOURCE 1
#endif
#endif

#ifndef DPAR_H_INCLUDED
#define DPAR_H_INCLUDED

#include <stddef.h>
#include <stdint.h>

#define DPAR_VERSION_MAJOR 0
#define DPAR_VERSION_MINOR 1
#define DPAR_VERSION_PATCH 0
#define DPAR_VERSION "0.1.0"

/* ============================================================================================== */
/* >>config                                                                                        */
/* ============================================================================================== */
#ifndef DPAR_API
#ifdef DPAR_STATIC
#if defined(__GNUC__) || defined(__clang__)
#define DPAR_API static __attribute__((unused))
#else
#define DPAR_API static
#endif
#else
#define DPAR_API extern
#endif
#endif

#if defined(__GNUC__) || defined(__clang__)
#define DPAR_PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#define DPAR_PRINTF(fmt_index, first_arg)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ============================================================================================== */
/* >>status: status codes, the error text                                                         */
/* ============================================================================================== */
/* One list makes both the enum and the strings. 0 is success; errors are negative. */
#define DPAR_STATUS_LIST(X)                                                                        \
    X(DPAR_OK, 0, "success")                                                                       \
    X(DPAR_EINVAL, -1, "invalid argument")                                                         \
    X(DPAR_ENOMEM, -2, "out of memory")                                                            \
    X(DPAR_EBUSY, -3, "not allowed from this thread or while the object is busy")                 \
    X(DPAR_ECANCELED, -4, "cancelled")                                                             \
    X(DPAR_EDEADLK, -5, "the call would deadlock")                                                 \
    X(DPAR_ETIMEDOUT, -6, "timed out")                                                             \
    X(DPAR_EMISMATCH, -7, "ranks disagree on a collective call")                                   \
    X(DPAR_EABORTED, -8, "aborted")                                                                \
    X(DPAR_EIO, -9, "input/output error")                                                          \
    X(DPAR_ESYSTEM, -10, "operating system call failed")                                           \
    X(DPAR_EUNSUPPORTED, -11, "not supported")                                                     \
    X(DPAR_ERANGE, -12, "value out of range")                                                      \
    X(DPAR_ESTATE, -13, "object in the wrong state for this call")                                 \
    X(DPAR_ECORRUPT, -14, "data is damaged")                                                       \
    X(DPAR_EUSER, -15, "error raised by user code")

#define DPAR__STATUS_ENUM(name, value, text) name = value,
typedef enum dpar_status { DPAR_STATUS_LIST(DPAR__STATUS_ENUM) } dpar_status;
#undef DPAR__STATUS_ENUM

/* dpar_status_string: a short text for a code, e.g. "invalid argument (DPAR_EINVAL)"; never NULL.
   Thread safety: any thread. */
DPAR_API const char *dpar_status_string(dpar_status status);

/* dpar_last_error: the sentence with context that explains the last error this thread got from
   dpar ("dpar_pool_for: n = -3 is negative"); "" when there is none. Valid until the thread's next
   dpar call that fails. Thread safety: any thread; each thread has its own. */
DPAR_API const char *dpar_last_error(void);

/* dpar_set_error: sets this thread's error text (printf format) and returns `status`, so user
   callbacks can write `return dpar_set_error(DPAR_EUSER, "bad batch %d", i);` and the text reaches
   whoever waits on the task or run. Thread safety: any thread. */
DPAR_API dpar_status dpar_set_error(dpar_status status, const char *fmt, ...) DPAR_PRINTF(2, 3);

/* dpar_clear_error: empties this thread's error text. Thread safety: any thread. */
DPAR_API void dpar_clear_error(void);

/* ============================================================================================== */
/* >>log: levels, callback                                                                        */
/* ============================================================================================== */
typedef enum dpar_log_level {
    DPAR_LOG_OFF = 0,
    DPAR_LOG_ERROR = 1,
    DPAR_LOG_WARN = 2,
    DPAR_LOG_INFO = 3,
    DPAR_LOG_DEBUG = 4
} dpar_log_level;

/* The callback gets the level, the source position in dpar.h and the formatted message. */
typedef void (*dpar_log_fn)(void *user_data, dpar_log_level level, const char *file, int line,
                            const char *message);

/* dpar_log_set_callback: route log messages to `fn` (NULL: back to stderr). The callback may be
   called from any thread at once. Thread safety: any thread. */
DPAR_API void dpar_log_set_callback(dpar_log_fn fn, void *user_data);
/* dpar_log_set_level: messages above `level` are dropped (default: DPAR_LOG, else warn).
   Thread safety: any thread. */
DPAR_API void dpar_log_set_level(dpar_log_level level);
DPAR_API dpar_log_level dpar_log_get_level(void);
/* dpar_log_message: log through dpar's sink (what the DPAR__LOG macro of the implementation uses).
   Thread safety: any thread. */
DPAR_API void dpar_log_message(dpar_log_level level, const char *file, int line, const char *fmt, ...)
    DPAR_PRINTF(4, 5);

/* ============================================================================================== */
/* >>alloc: allocator hook                                                                        */
/* ============================================================================================== */
/* Both functions set, or both NULL for malloc/free. dpar asks for 64-byte aligned blocks by
   over-allocating, so `alloc` only needs malloc's alignment. */
typedef struct dpar_allocator {
    void *(*alloc)(size_t size, void *user_data);
    void (*free)(void *ptr, void *user_data);
    void *user_data;
} dpar_allocator;

/* ============================================================================================== */
/* >>trace: Chrome trace-event JSON                                                               */
/* ============================================================================================== */
/* dpar_trace_start: start writing events to `path` (truncated). Returns DPAR_ESTATE when a trace is
   already running, DPAR_EIO when the file cannot be opened. Thread safety: any thread. */
DPAR_API dpar_status dpar_trace_start(const char *path);
/* dpar_trace_stop: close the JSON and the file. DPAR_ESTATE when no trace runs. Events that other
   threads emit after this are dropped. Thread safety: any thread. */
DPAR_API dpar_status dpar_trace_stop(void);
/* dpar_trace_enabled: 1 while a trace is running. A relaxed load: cheap enough for hot paths. */
DPAR_API int dpar_trace_enabled(void);
/* dpar_time_ns: monotonic clock in nanoseconds, the time base of the trace. */
DPAR_API uint64_t dpar_time_ns(void);
/* dpar_trace_event: one complete event [begin_ns, end_ns) on the calling thread's track. `cat` may
   be NULL; `args_json` is NULL or the inside of a JSON object ("\"bytes\":4096"). Events that
   began before the trace started are dropped. Thread safety: any thread. */
DPAR_API void dpar_trace_event(const char *name, const char *cat, uint64_t begin_ns, uint64_t end_ns,
                               const char *args_json);
/* dpar_trace_set_thread_name: name the calling thread's track ("rank 3"). Thread safety: any thread,
   for itself. */
DPAR_API void dpar_trace_set_thread_name(const char *name);

/* ============================================================================================== */
/* >>pool: worker pool, parallel-for, SPMD run, barrier, task graph                               */
/* ============================================================================================== */
typedef struct dpar_pool dpar_pool;

typedef struct dpar_pool_desc {
    int num_threads;  /* threads taking part, the caller included; 0: DPAR_NUM_THREADS, else the
                         online CPUs. Negative: DPAR_EINVAL; above DPAR_MAX_THREADS: DPAR_ERANGE */
    int pin_threads;  /* 1: pin worker i (1..T-1) to CPU i mod CPUs; the caller is left as it is */
    int spin_us;      /* microseconds a wait spins before sleeping; 0: DPAR_SPIN_US; -1: no spin */
    const char *name; /* prefix of the trace tracks (copied; default "pool") */
    dpar_allocator allocator;
} dpar_pool_desc;

/* dpar_pool_create: start a pool. `desc` may be NULL (all defaults). On error *out is NULL.
   Returns DPAR_EINVAL (NULL out, negative counts, half an allocator), DPAR_ERANGE (too many threads),
   DPAR_ENOMEM, DPAR_ESYSTEM (a thread could not start). Thread safety: any thread. */
DPAR_API dpar_status dpar_pool_create(const dpar_pool_desc *desc, dpar_pool **out);

/* dpar_pool_destroy: finish running tasks, cancel those not started, join the workers, free.
   Returns DPAR_OK, or DPAR_ECANCELED when tasks were cancelled (the pool is freed either way);
   DPAR_EBUSY (pool kept) when called from one of the pool's own threads; DPAR_EINVAL for NULL.
   Thread safety: one thread, with no other call on this pool in flight or to come. */
DPAR_API dpar_status dpar_pool_destroy(dpar_pool *pool);

/* dpar_pool_query: the values really used (num_threads resolved, spin_us resolved).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_pool_query(const dpar_pool *pool, dpar_pool_desc *used);

/* dpar_pool_num_threads: T, or 0 for NULL. dpar_pool_thread_index: the calling thread's index in
   this pool (0 for the caller during a fork-join call), or -1 if it is not taking part.
   Thread safety: any thread. */
DPAR_API int dpar_pool_num_threads(const dpar_pool *pool);
DPAR_API int dpar_pool_thread_index(const dpar_pool *pool);

/* The body of a parallel-for: handle [begin, end). `thread` is the index (0..T-1) of the thread
   running it, for per-thread scratch. */
typedef void (*dpar_for_fn)(void *user, int64_t begin, int64_t end, int thread);

/* dpar_pool_for: static schedule; thread t handles the t-th of T near-equal contiguous blocks.
   dpar_pool_for_dynamic: chunks of `grain` iterations (0: about n / (16 T)) handed out in order to
   whichever thread is free. Both: n = 0 returns at once; n < 0 or NULL pool/fn is DPAR_EINVAL; the
   whole int64 range works without overflow. From one of the pool's own threads the loop runs inline.
   Thread safety: any thread; concurrent callers from outside take turns. */
DPAR_API dpar_status dpar_pool_for(dpar_pool *pool, int64_t n, dpar_for_fn fn, void *user);
DPAR_API dpar_status dpar_pool_for_dynamic(dpar_pool *pool, int64_t n, int64_t grain, dpar_for_fn fn,
                                           void *user);

/* The body of an SPMD run: thread `thread` of `num_threads`. Return DPAR_OK or an error. */
typedef dpar_status (*dpar_run_fn)(void *user, int thread, int num_threads);

/* dpar_pool_run: run fn on all T threads at once (the caller is thread 0) and wait for all. Returns
   the error of the lowest-numbered failing thread, its text in dpar_last_error. DPAR_EBUSY from one
   of the pool's own threads. This is how a thread-rank trainer starts.
   Thread safety: any thread; concurrent callers from outside take turns. */
DPAR_API dpar_status dpar_pool_run(dpar_pool *pool, dpar_run_fn fn, void *user);

/* dpar_pool_barrier: inside dpar_pool_run, wait until all T threads have called it. DPAR_ESTATE
   outside a run or from a thread not in it. Thread safety: the threads of the current run. */
DPAR_API dpar_status dpar_pool_barrier(dpar_pool *pool);

/* Tasks. A handle is never 0; it stays valid until dpar_task_wait_all returns. */
typedef uint64_t dpar_task;
typedef dpar_status (*dpar_task_fn)(void *user);

typedef struct dpar_task_desc {
    dpar_task_fn fn;         /* required */
    void *user;              /* passed to fn */
    const dpar_task *deps;   /* tasks that must finish first (num_deps of them); may repeat */
    int num_deps;
    const char *name;        /* trace event name; not copied, must outlive the task (default "task") */
} dpar_task_desc;

typedef enum dpar_task_state {
    DPAR_TASK_PENDING = 0,   /* waiting for dependencies, queued or running */
    DPAR_TASK_DONE = 1,      /* ran and returned DPAR_OK */
    DPAR_TASK_FAILED = 2,    /* ran and returned an error */
    DPAR_TASK_CANCELLED = 3  /* never ran: a dependency failed or the pool was destroyed */
} dpar_task_state;

/* dpar_task_submit: add a task. *out (may be NULL) gets its handle. A dependency that already failed
   cancels the task at once. DPAR_EINVAL for a bad description or a handle that is not a live task of
   this pool; DPAR_ECANCELED while the pool is being destroyed. Thread safety: any thread, tasks too. */
DPAR_API dpar_status dpar_task_submit(dpar_pool *pool, const dpar_task_desc *desc, dpar_task *out);

/* dpar_task_wait: wait for one task; a thread outside any task runs ready tasks meanwhile, a task
   runs only the awaited one (once it is ready). Returns its status (the
   failed dependency's status for a cancelled task, with the story in dpar_last_error). From inside a
   task, waiting on itself or on a task that depends on it returns DPAR_EDEADLK.
   Thread safety: any thread, tasks too. */
DPAR_API dpar_status dpar_task_wait(dpar_pool *pool, dpar_task task);

/* dpar_task_state_of: the state of a live task (DPAR_TASK_PENDING for a bad handle, with
   dpar_last_error set). Thread safety: any thread. */
DPAR_API dpar_task_state dpar_task_state_of(dpar_pool *pool, dpar_task task);

/* dpar_task_wait_all: wait for every task submitted so far (helping), then end the epoch: all
   handles become invalid and the records are reused. Returns the status of the first task that
   failed (in submission order), or DPAR_OK. DPAR_EBUSY from the pool's own threads.
   Thread safety: any thread outside the pool; tasks submitted meanwhile by others are waited for too. */
DPAR_API dpar_status dpar_task_wait_all(dpar_pool *pool);

#ifdef __cplusplus
}
#endif
#endif /* DPAR_H_INCLUDED */

/* ============================================================================================== */
/* >>impl                                                                                          */
/* ============================================================================================== */
#if defined(DPAR_IMPLEMENTATION) && !defined(DPAR__IMPLEMENTATION_DONE)
#define DPAR__IMPLEMENTATION_DONE

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__) && !defined(DPAR_NO_FUTEX)
#include <linux/futex.h>
#include <sys/syscall.h>
#define DPAR__FUTEX 1
#else
#define DPAR__FUTEX 0
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#endif
#if !defined(CLOCK_MONOTONIC)
#error "dpar.h: CLOCK_MONOTONIC is missing: include dpar.h before any system header in the file that defines DPAR_IMPLEMENTATION, or compile with -D_DEFAULT_SOURCE"
#endif

#ifndef DPAR_ASSERT
#include <assert.h>
#define DPAR_ASSERT(c) assert(c)
#endif
#ifndef DPAR_SPIN_US
#define DPAR_SPIN_US 200
#endif
#ifndef DPAR_MAX_THREADS
#define DPAR_MAX_THREADS 1024
#endif
#if DPAR_MAX_THREADS < 1
#error "dpar.h: DPAR_MAX_THREADS must be at least 1"
#endif

#if defined(__cplusplus)
#define DPAR__TLS thread_local
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#define DPAR__TLS _Thread_local
#elif defined(__GNUC__) || defined(__clang__)
#define DPAR__TLS __thread
#else
#error "dpar.h: needs thread-local storage (C11, C++11, or GCC/Clang's __thread)"
#endif

#if defined(__GNUC__) || defined(__clang__)
#define DPAR__PRIVATE static __attribute__((unused))
#else
#define DPAR__PRIVATE static
#endif

#if defined(__linux__)
#define DPAR__LINUX 1
#if !defined(__cplusplus)
/* syscall() and sched_getcpu() are declared only under _DEFAULT_SOURCE / _GNU_SOURCE; matching
   declarations keep -std=c99 builds working (C++ compilers on Linux define _GNU_SOURCE). */
extern long syscall(long number, ...);
extern int sched_getcpu(void);
#endif
#else
#define DPAR__LINUX 0
#endif

/* Atomics: the GCC/Clang builtins, which work the same in C99, C11 and C++ and which TSan knows. */
#define DPAR__LOAD(p, mo) __atomic_load_n((p), (mo))
#define DPAR__STORE(p, v, mo) __atomic_store_n((p), (v), (mo))
#define DPAR__ADD(p, v, mo) __atomic_fetch_add((p), (v), (mo))
#define DPAR__SUB(p, v, mo) __atomic_fetch_sub((p), (v), (mo))
#define DPAR__RELAXED __ATOMIC_RELAXED
#define DPAR__ACQUIRE __ATOMIC_ACQUIRE
#define DPAR__RELEASE __ATOMIC_RELEASE
#define DPAR__ACQ_REL __ATOMIC_ACQ_REL
#define DPAR__SEQ_CST __ATOMIC_SEQ_CST
#define DPAR__CACHE_LINE 64

static void dpar__cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield");
#endif
}

/* >>status ------------------------------------------------------------------------------------- */
#define DPAR__ERROR_TEXT 512
static DPAR__TLS char dpar__tls_error[DPAR__ERROR_TEXT];

DPAR_API const char *dpar_status_string(dpar_status status)
{
    switch (status) {
#define DPAR__STATUS_CASE(name, value, text) \
    case name:                               \
        return text " (" #name ")";
        DPAR_STATUS_LIST(DPAR__STATUS_CASE)
#undef DPAR__STATUS_CASE
    }
    return "unknown status (not a dpar_status)";
}

DPAR_API const char *dpar_last_error(void) { return dpar__tls_error; }

DPAR_API void dpar_clear_error(void) { dpar__tls_error[0] = 0; }

static dpar_status dpar__verror(dpar_status status, const char *fmt, va_list ap)
{
    vsnprintf(dpar__tls_error, sizeof dpar__tls_error, fmt, ap);
    return status;
}

DPAR_API dpar_status dpar_set_error(dpar_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    dpar__verror(status, fmt, ap);
    va_end(ap);
    return status;
}

/* dpar__err: set the error text and return the code, in one line at every failure site. */
#define dpar__err dpar_set_error

/* >>log ---------------------------------------------------------------------------------------- */
static pthread_mutex_t dpar__log_mutex = PTHREAD_MUTEX_INITIALIZER;
static dpar_log_fn dpar__log_fn = NULL;
static void *dpar__log_user = NULL;
static int dpar__log_level = -1; /* -1: not read from DPAR_LOG yet */

static int dpar__log_level_from_env(void)
{
    const char *s = getenv("DPAR_LOG");
    if (!s || !*s) return DPAR_LOG_WARN;
    if (!strcmp(s, "off") || !strcmp(s, "none")) return DPAR_LOG_OFF;
    if (!strcmp(s, "error")) return DPAR_LOG_ERROR;
    if (!strcmp(s, "warn") || !strcmp(s, "warning")) return DPAR_LOG_WARN;
    if (!strcmp(s, "info")) return DPAR_LOG_INFO;
    if (!strcmp(s, "debug")) return DPAR_LOG_DEBUG;
    fprintf(stderr, "dpar: DPAR_LOG=%s is not one of off, error, warn, info, debug; using warn\n", s);
    return DPAR_LOG_WARN;
}

DPAR_API dpar_log_level dpar_log_get_level(void)
{
    int level = DPAR__LOAD(&dpar__log_level, DPAR__RELAXED);
    if (level < 0) {
        int expected = -1;
        level = dpar__log_level_from_env();
        if (!__atomic_compare_exchange_n(&dpar__log_level, &expected, level, 0, DPAR__RELAXED, DPAR__RELAXED))
            level = expected;
    }
    return (dpar_log_level)level;
}

DPAR_API void dpar_log_set_level(dpar_log_level level)
{
    int l = (int)level;
    if (l < DPAR_LOG_OFF) l = DPAR_LOG_OFF;
    if (l > DPAR_LOG_DEBUG) l = DPAR_LOG_DEBUG;
    DPAR__STORE(&dpar__log_level, l, DPAR__RELAXED);
}

DPAR_API void dpar_log_set_callback(dpar_log_fn fn, void *user_data)
{
    pthread_mutex_lock(&dpar__log_mutex);
    dpar__log_fn = fn;
    dpar__log_user = user_data;
    pthread_mutex_unlock(&dpar__log_mutex);
}

DPAR_API void dpar_log_message(dpar_log_level level, const char *file, int line, const char *fmt, ...)
{
    static const char *const names[] = {"off", "error", "warn", "info", "debug"};
    char msg[1024];
    va_list ap;
    if (level <= DPAR_LOG_OFF || level > dpar_log_get_level()) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&dpar__log_mutex);
    if (dpar__log_fn)
        dpar__log_fn(dpar__log_user, level, file, line, msg);
    else
        fprintf(stderr, "dpar %s: %s\n", names[level], msg);
    pthread_mutex_unlock(&dpar__log_mutex);
}

#define DPAR__LOG(level, ...) dpar_log_message((level), __FILE__, __LINE__, __VA_ARGS__)

/* >>alloc -------------------------------------------------------------------------------------- */
/* 64-byte aligned blocks from the user's allocator: the raw pointer sits just before the block. */
static void *dpar__alloc(const dpar_allocator *a, size_t size)
{
    size_t total;
    unsigned char *raw, *p;
    if (size > SIZE_MAX - DPAR__CACHE_LINE - sizeof(void *)) return NULL;
    total = size + DPAR__CACHE_LINE + sizeof(void *);
    raw = (unsigned char *)(a && a->alloc ? a->alloc(total, a->user_data) : malloc(total));
    if (!raw) return NULL;
    p = (unsigned char *)(((uintptr_t)raw + sizeof(void *) + DPAR__CACHE_LINE - 1) &
                          ~(uintptr_t)(DPAR__CACHE_LINE - 1));
    memcpy(p - sizeof(void *), &raw, sizeof raw);
    return p;
}

static void *dpar__calloc(const dpar_allocator *a, size_t count, size_t size)
{
    void *p;
    if (size && count > SIZE_MAX / size) return NULL;
    p = dpar__alloc(a, count * size);
    if (p) memset(p, 0, count * size);
    return p;
}

static void dpar__free(const dpar_allocator *a, void *p)
{
    void *raw;
    if (!p) return;
    memcpy(&raw, (unsigned char *)p - sizeof(void *), sizeof raw);
    if (a && a->free)
        a->free(raw, a->user_data);
    else
        free(raw);
}

static dpar_status dpar__check_allocator(const char *fn, const dpar_allocator *a)
{
    if ((a->alloc == NULL) != (a->free == NULL))
        return dpar__err(DPAR_EINVAL, "%s: the allocator sets only one of alloc and free; set both or neither", fn);
    return DPAR_OK;
}

/* >>time, waits -------------------------------------------------------------------------------- */
DPAR_API uint64_t dpar_time_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int dpar__online_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > 65536 ? 65536 : (int)n);
}

#if DPAR__FUTEX
static void dpar__park(uint32_t *word, uint32_t val, uint64_t timeout_ns)
{
    struct timespec ts, *tsp = NULL;
    if (timeout_ns) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000u);
        ts.tv_nsec = (long)(timeout_ns % 1000000000u);
        tsp = &ts;
    }
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, val, tsp, NULL, 0);
}
static void dpar__unpark(uint32_t *word, int count)
{
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
}
#else
/* A parking lot: addresses hash onto mutex/condition-variable buckets. */
#define DPAR__LOT_SIZE 64
static struct dpar__lot_bucket {
    pthread_mutex_t mutex;
    pthread_cond_t cond;
} dpar__lot[DPAR__LOT_SIZE];
static pthread_once_t dpar__lot_once = PTHREAD_ONCE_INIT;
static void dpar__lot_init(void)
{
    int i;
    for (i = 0; i < DPAR__LOT_SIZE; i++) {
        pthread_mutex_init(&dpar__lot[i].mutex, NULL);
        pthread_cond_init(&dpar__lot[i].cond, NULL);
    }
}
static struct dpar__lot_bucket *dpar__lot_of(uint32_t *word)
{
    pthread_once(&dpar__lot_once, dpar__lot_init);
    return &dpar__lot[((uintptr_t)word >> 6) % DPAR__LOT_SIZE];
}
static void dpar__park(uint32_t *word, uint32_t val, uint64_t timeout_ns)
{
    struct dpar__lot_bucket *b = dpar__lot_of(word);
    pthread_mutex_lock(&b->mutex);
    if (DPAR__LOAD(word, DPAR__SEQ_CST) == val) {
        if (timeout_ns) {
            struct timespec ts;
            uint64_t t;
            clock_gettime(CLOCK_REALTIME, &ts);
            t = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec + timeout_ns;
            ts.tv_sec = (time_t)(t / 1000000000u);
            ts.tv_nsec = (long)(t % 1000000000u);
            pthread_cond_timedwait(&b->cond, &b->mutex, &ts);
        } else {
            pthread_cond_wait(&b->cond, &b->mutex);
        }
    }
    pthread_mutex_unlock(&b->mutex);
}
static void dpar__unpark(uint32_t *word, int count)
{
    struct dpar__lot_bucket *b = dpar__lot_of(word);
    (void)count; /* buckets are shared: wake everyone, they re-check their own word */
    pthread_mutex_lock(&b->mutex);
    pthread_cond_broadcast(&b->cond);
    pthread_mutex_unlock(&b->mutex);
}
#endif

/* A wait word: a 32-bit value that changes when the waited-for thing happens, and a count of the
   threads asleep on it, so that a waker makes a system call only when someone sleeps. Both sides
   use sequentially consistent order: either the waker sees the sleeper, or the sleeper sees the
   change (Dekker). */
typedef struct dpar__spin {
    uint64_t spin_ns; /* spin this long before sleeping */
    int yield;        /* oversubscribed: yield at every poll */
} dpar__spin;
#define DPAR__YIELD_NS 20000u

/* dpar__wait_while: block while *word == val. Returns DPAR_OK once it differs, DPAR_ETIMEDOUT when
   deadline_ns (absolute, 0: none) passes first. */
static dpar_status dpar__wait_while(uint32_t *word, uint32_t val, uint32_t *sleepers, dpar__spin spin,
                                    uint64_t deadline_ns)
{
    uint64_t t_end;
    unsigned i;
    if (DPAR__LOAD(word, DPAR__ACQUIRE) != val) return DPAR_OK;
    if (spin.spin_ns) {
        /* Poll with pause; after DPAR__YIELD_NS without progress, yield now and then, so that a
           thread we wait for that shares our CPU gets to run (oversubscribed pools yield always). */
        uint64_t now = dpar_time_ns(), t_yield = now + (spin.yield ? 0 : DPAR__YIELD_NS);
        t_end = now + spin.spin_ns;
        for (i = 1;; i++) {
            dpar__cpu_relax();
            if (DPAR__LOAD(word, DPAR__ACQUIRE) != val) return DPAR_OK;
            if ((i & 15) != 0) continue;
            now = dpar_time_ns();
            if (now >= t_end) break;
            if (now >= t_yield) {
                sched_yield();
                t_yield = now + (spin.yield ? 0 : DPAR__YIELD_NS);
                if (DPAR__LOAD(word, DPAR__ACQUIRE) != val) return DPAR_OK;
            }
        }
    }
    DPAR__ADD(sleepers, 1, DPAR__SEQ_CST);
    while (DPAR__LOAD(word, DPAR__SEQ_CST) == val) {
        uint64_t timeout = 0;
        if (deadline_ns) {
            uint64_t now = dpar_time_ns();
            if (now >= deadline_ns) {
                DPAR__SUB(sleepers, 1, DPAR__SEQ_CST);
                return DPAR_ETIMEDOUT;
            }
            timeout = deadline_ns - now;
        }
        dpar__park(word, val, timeout);
    }
    DPAR__SUB(sleepers, 1, DPAR__SEQ_CST); /* the seq_cst load that saw the change acquired it */
    return DPAR_OK;
}

/* dpar__wake: call after changing *word (with a seq_cst or release+fence store). */
static void dpar__wake(uint32_t *word, uint32_t *sleepers, int count)
{
    if (DPAR__LOAD(sleepers, DPAR__SEQ_CST) > 0) dpar__unpark(word, count);
}

/* dpar__bump: change the word and wake its sleepers. */
static void dpar__bump(uint32_t *word, uint32_t *sleepers, int count)
{
    DPAR__ADD(word, 1, DPAR__SEQ_CST);
    dpar__wake(word, sleepers, count);
}

static dpar__spin dpar__spin_make(int spin_us, int threads)
{
    dpar__spin s;
    s.spin_ns = spin_us > 0 ? (uint64_t)spin_us * 1000u : 0;
    s.yield = threads > dpar__online_cpus();
    return s;
}

/* >>trace -------------------------------------------------------------------------------------- */
static pthread_mutex_t dpar__trace_mutex = PTHREAD_MUTEX_INITIALIZER;
static FILE *dpar__trace_file = NULL;
static int dpar__trace_on = 0;          /* read relaxed on hot paths */
static uint64_t dpar__trace_t0 = 0;
static uint32_t dpar__trace_session = 0; /* bumped by every start; threads re-emit their names */
static int dpar__trace_events = 0;
static int dpar__trace_next_track = 0;
static int dpar__trace_env_checked = 0;
static int dpar__pool_next_id = 0;      /* names pools' tracks */

static DPAR__TLS int dpar__tls_track = 0;
static DPAR__TLS uint32_t dpar__tls_track_session = 0;
static DPAR__TLS char dpar__tls_track_name[64];

DPAR_API int dpar_trace_enabled(void) { return DPAR__LOAD(&dpar__trace_on, DPAR__RELAXED); }

static void dpar__json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void dpar__trace_sep(void)
{
    if (dpar__trace_events++) fputs(",\n", dpar__trace_file);
}

DPAR_API dpar_status dpar_trace_start(const char *path)
{
    FILE *f;
    if (!path || !*path) return dpar__err(DPAR_EINVAL, "dpar_trace_start: path is NULL or empty");
    pthread_mutex_lock(&dpar__trace_mutex);
    if (dpar__trace_file) {
        pthread_mutex_unlock(&dpar__trace_mutex);
        return dpar__err(DPAR_ESTATE, "dpar_trace_start: a trace is already being written");
    }
    f = fopen(path, "w");
    if (!f) {
        int e = errno;
        pthread_mutex_unlock(&dpar__trace_mutex);
        return dpar__err(DPAR_EIO, "dpar_trace_start: cannot open '%s': %s", path, strerror(e));
    }
    dpar__trace_file = f;
    dpar__trace_events = 0;
    dpar__trace_t0 = dpar_time_ns();
    dpar__trace_session++;
    fputs("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n", f);
    DPAR__STORE(&dpar__trace_on, 1, DPAR__RELAXED);
    pthread_mutex_unlock(&dpar__trace_mutex);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_trace_stop(void)
{
    int bad;
    pthread_mutex_lock(&dpar__trace_mutex);
    if (!dpar__trace_file) {
        pthread_mutex_unlock(&dpar__trace_mutex);
        return dpar__err(DPAR_ESTATE, "dpar_trace_stop: no trace is running");
    }
    DPAR__STORE(&dpar__trace_on, 0, DPAR__RELAXED);
    fputs("\n]}\n", dpar__trace_file);
    bad = ferror(dpar__trace_file);
    bad |= fclose(dpar__trace_file);
    dpar__trace_file = NULL;
    pthread_mutex_unlock(&dpar__trace_mutex);
    return bad ? dpar__err(DPAR_EIO, "dpar_trace_stop: writing the trace file failed") : DPAR_OK;
}

static void dpar__trace_stop_at_exit(void) { (void)dpar_trace_stop(); }

/* DPAR_TRACE=file.json starts a trace the first time a pool (or comm) is created. */
static void dpar__trace_from_env(void)
{
    const char *path;
    if (DPAR__LOAD(&dpar__trace_env_checked, DPAR__ACQUIRE)) return;
    if (DPAR__ADD(&dpar__trace_env_checked, 1, DPAR__ACQ_REL) != 0) return;
    path = getenv("DPAR_TRACE");
    if (!path || !*path) return;
    if (dpar_trace_start(path) == DPAR_OK)
        atexit(dpar__trace_stop_at_exit);
    else
        DPAR__LOG(DPAR_LOG_WARN, "DPAR_TRACE: %s", dpar_last_error());
}

DPAR_API void dpar_trace_set_thread_name(const char *name)
{
    size_t n = name ? strlen(name) : 0;
    if (n >= sizeof dpar__tls_track_name) n = sizeof dpar__tls_track_name - 1;
    memcpy(dpar__tls_track_name, name ? name : "", n);
    dpar__tls_track_name[n] = 0;
    dpar__tls_track_session = 0; /* emit the (new) name with the next event */
}

/* Called with the trace mutex held: the thread's track id, and its name once per trace. */
static int dpar__trace_track_locked(void)
{
    if (!dpar__tls_track) dpar__tls_track = ++dpar__trace_next_track;
    if (dpar__tls_track_session != dpar__trace_session) {
        dpar__tls_track_session = dpar__trace_session;
        dpar__trace_sep();
        fprintf(dpar__trace_file, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%ld,\"tid\":%d,\"args\":{\"name\":",
                (long)getpid(), dpar__tls_track);
        if (dpar__tls_track_name[0])
            dpar__json_string(dpar__trace_file, dpar__tls_track_name);
        else
            fprintf(dpar__trace_file, "\"thread %d\"", dpar__tls_track);
        fputs("}}", dpar__trace_file);
    }
    return dpar__tls_track;
}

DPAR_API void dpar_trace_event(const char *name, const char *cat, uint64_t begin_ns, uint64_t end_ns,
                               const char *args_json)
{
    uint64_t ts, dur;
    int tid;
    if (!dpar_trace_enabled()) return;
    pthread_mutex_lock(&dpar__trace_mutex);
    if (!dpar__trace_file || begin_ns < dpar__trace_t0) {
        pthread_mutex_unlock(&dpar__trace_mutex);
        return;
    }
    tid = dpar__trace_track_locked();
    ts = begin_ns - dpar__trace_t0;
    dur = end_ns > begin_ns ? end_ns - begin_ns : 0;
    dpar__trace_sep();
    fputs("{\"name\":", dpar__trace_file);
    dpar__json_string(dpar__trace_file, name ? name : "event");
    fputs(",\"cat\":", dpar__trace_file);
    dpar__json_string(dpar__trace_file, cat ? cat : "dpar");
    /* integer nanoseconds printed as microseconds with three decimals: exact, so nesting survives */
    fprintf(dpar__trace_file, ",\"ph\":\"X\",\"ts\":%llu.%03u,\"dur\":%llu.%03u,\"pid\":%ld,\"tid\":%d",
            (unsigned long long)(ts / 1000u), (unsigned)(ts % 1000u), (unsigned long long)(dur / 1000u),
            (unsigned)(dur % 1000u), (long)getpid(), tid);
    if (args_json && *args_json) fprintf(dpar__trace_file, ",\"args\":{%s}", args_json);
    fputc('}', dpar__trace_file);
    pthread_mutex_unlock(&dpar__trace_mutex);
}

/* >>pool --------------------------------------------------------------------------------------- */
enum { DPAR__JOB_FOR_STATIC, DPAR__JOB_FOR_DYNAMIC, DPAR__JOB_RUN };
enum { DPAR__TASK_PENDING, DPAR__TASK_READY, DPAR__TASK_RUNNING, DPAR__TASK_DONE, DPAR__TASK_FAILED,
       DPAR__TASK_CANCELLED };

#define DPAR__TASK_CHUNK 1024u  /* records per slab chunk */
#define DPAR__EDGE_CHUNK 4096u  /* dependency edges per slab chunk */
#define DPAR__NONE 0xffffffffu

typedef struct dpar__task_rec {
    dpar_task_fn fn;
    void *user;
    const char *name;
    int state;
    dpar_status status;   /* the status waiters get (the root failure's for a cancelled task) */
    uint32_t unresolved;  /* dependencies not finished */
    uint32_t dependents;  /* first edge of the list of tasks waiting for this one */
    uint32_t next, prev;  /* ready-queue links; next is also the work-list link */
    uint32_t root;        /* the failed task that cancelled this one (itself when it failed) */
    uint32_t mark;        /* deadlock search stamp */
    char *message;        /* failure text (failed tasks only) */
} dpar__task_rec;

typedef struct dpar__edge {
    uint32_t to, next;
} dpar__edge;

typedef struct dpar__thread {
    dpar_pool *pool;
    int index;
    uint32_t seen_fork;            /* last fork generation this worker ran its part of */
    dpar_status run_status;        /* dpar_pool_run result of this thread */
    char run_error[256];
    pthread_t handle;
    int cpu;                       /* the CPU it last ran on, or -1 (see dpar__unshare) */
    uint64_t moved_ns;             /* when it last moved */
    char pad[DPAR__CACHE_LINE];
} dpar__thread;

struct dpar_pool {
    dpar_allocator allocator;
    int nthreads, pin, spin_us, id, started;
    int unshare;                   /* workers move off a CPU another thread of the pool is on */
    dpar__spin spin;
    char name[32];
    dpar__thread *threads;         /* [nthreads]; [0] stands for the caller of fork-join calls */
    pthread_mutex_t fork_lock;     /* outside callers of fork-join calls take turns */

    /* fork-join: written by the caller before fork_gen is bumped, read by workers after */
    uint32_t fork_gen;
    uint32_t wake_seq;             /* bumped on every new work: fork, ready task, shutdown */
    uint32_t wake_sleepers;
    int job_kind;
    int64_t job_n, job_grain, job_chunks;
    dpar_for_fn job_for;
    dpar_run_fn job_run;
    void *job_user;
    int in_run;
    int shutdown;
    char pad0[DPAR__CACHE_LINE];

    uint32_t join_pending;         /* workers not done with the current fork */
    uint32_t join_sleepers;
    char pad1[DPAR__CACHE_LINE];
    uint64_t next_chunk;           /* dynamic schedule: next chunk to hand out */
    char pad2[DPAR__CACHE_LINE];
    uint32_t bar_count, bar_gen, bar_sleepers;
    char pad3[DPAR__CACHE_LINE];

    /* tasks: every field below is guarded by task_lock except the atomics noted */
    pthread_mutex_t task_lock;
    uint32_t ready_count;          /* atomic: tasks in the ready queue */
    uint32_t done_seq;             /* atomic: bumped when tasks finish (and on forks, shutdown) */
    uint32_t done_sleepers;
    uint32_t epoch;                /* handles carry it; wait_all bumps it */
    uint32_t ntasks, nedges, unfinished;
    uint32_t ready_head, ready_tail;
    uint32_t mark_stamp;
    void **task_chunks;            /* chunks of DPAR__TASK_CHUNK records */
    uint32_t task_chunk_cap;
    void **edge_chunks;            /* chunks of DPAR__EDGE_CHUNK edges */
    uint32_t edge_chunk_cap;
    uint32_t *search_stack;        /* deadlock search scratch */
    uint32_t search_cap;
};

/* The thread's place in a pool: set for workers for life, for the caller during fork-join calls. */
static DPAR__TLS dpar_pool *dpar__tls_pool = NULL;
static DPAR__TLS int dpar__tls_index = -1;

static int dpar__in_pool(const dpar_pool *pool) { return pool && dpar__tls_pool == pool; }

static dpar__task_rec *dpar__rec(dpar_pool *p, uint32_t i)
{
    return (dpar__task_rec *)p->task_chunks[i / DPAR__TASK_CHUNK] + i % DPAR__TASK_CHUNK;
}
static dpar__edge *dpar__edge_at(dpar_pool *p, uint32_t i)
{
    return (dpar__edge *)p->edge_chunks[i / DPAR__EDGE_CHUNK] + i % DPAR__EDGE_CHUNK;
}

static void dpar__trace_span(const char *name, const char *cat, uint64_t t0, const char *fmt, ...)
    DPAR_PRINTF(4, 5);
static void dpar__trace_span(const char *name, const char *cat, uint64_t t0, const char *fmt, ...)
{
    char args[256];
    uint64_t t1 = dpar_time_ns();
    va_list ap;
    args[0] = 0;
    if (fmt) {
        va_start(ap, fmt);
        vsnprintf(args, sizeof args, fmt, ap);
        va_end(ap);
    }
    dpar_trace_event(name, cat, t0, t1, args);
}

/* ---- fork-join ---- */

/* Thread `index` runs its part of the current fork. */
static void dpar__fork_part(dpar_pool *p, int index)
{
    uint64_t t0 = dpar_trace_enabled() ? dpar_time_ns() : 0;
    if (p->job_kind == DPAR__JOB_FOR_STATIC) {
        /* block t of T: [t*q + min(t, r), ...): no product that can overflow */
        int64_t T = p->nthreads, q = p->job_n / T, r = p->job_n % T;
        int64_t begin = index * q + (index < r ? index : r);
        int64_t end = begin + q + (index < r ? 1 : 0);
        if (end > begin) p->job_for(p->job_user, begin, end, index);
    } else if (p->job_kind == DPAR__JOB_FOR_DYNAMIC) {
        for (;;) {
            uint64_t c = DPAR__ADD(&p->next_chunk, 1, DPAR__RELAXED);
            int64_t begin, end;
            if (c >= (uint64_t)p->job_chunks) break;
            begin = (int64_t)c * p->job_grain;
            end = p->job_n - begin < p->job_grain ? p->job_n : begin + p->job_grain;
            p->job_for(p->job_user, begin, end, index);
        }
    } else {
        dpar__thread *t = &p->threads[index];
        dpar_clear_error();
        t->run_status = p->job_run(p->job_user, index, p->nthreads);
        if (t->run_status != DPAR_OK) {
            size_t n = strlen(dpar__tls_error);
            if (n >= sizeof t->run_error) n = sizeof t->run_error - 1;
            memcpy(t->run_error, dpar__tls_error, n);
            t->run_error[n] = 0;
        }
    }
    if (t0) dpar__trace_span(p->job_kind == DPAR__JOB_RUN ? "run" : "for part", "pool", t0, "\"thread\":%d", index);
}

/* Where threads run. When a sleeping thread is woken, Linux often puts it on the waker's CPU even
   though another CPU is idle, and a spinning waker is not preempted for it (EEVDF), so the two take
   turns on one CPU: a 0.4 us fork-join becomes 5-100 us. Every thread of a fork-join call notes its
   CPU (sched_getcpu: a few ns); a worker that finds another thread of the pool on its CPU moves
   itself to a CPU none of them uses, by narrowing and then restoring its affinity mask. Only for
   pools no bigger than the machine, never for pinned pools, at most once a millisecond. */
static void dpar__cpu_note(dpar__thread *t)
{
#if DPAR__LINUX
    int c = sched_getcpu();
    if (c != DPAR__LOAD(&t->cpu, DPAR__RELAXED)) DPAR__STORE(&t->cpu, c, DPAR__RELAXED);
#else
    (void)t;
#endif
}

static void dpar__unshare(dpar_pool *p, dpar__thread *t)
{
#if DPAR__LINUX
    enum { WORDS = 1024 / (8 * sizeof(unsigned long)), BITS = 8 * sizeof(unsigned long) };
    unsigned long allowed[WORDS], mask[WORDS];
    int me, j, clash = 0, any = 0;
    uint64_t now;
    dpar__cpu_note(t);
    if (!p->unshare) return;
    me = t->cpu;
    for (j = 0; j < p->nthreads; j++)
        if (j != t->index && DPAR__LOAD(&p->threads[j].cpu, DPAR__RELAXED) == me) clash = 1;
    if (!clash || me < 0 || me >= 1024) return;
    now = dpar_time_ns();
    if (now - t->moved_ns < 1000000u) return;
    t->moved_ns = now;
    memset(allowed, 0, sizeof allowed);
    if (syscall(SYS_sched_getaffinity, 0, sizeof allowed, allowed) <= 0) return;
    memcpy(mask, allowed, sizeof mask);
    for (j = 0; j < p->nthreads; j++) {
        int c = j == t->index ? me : DPAR__LOAD(&p->threads[j].cpu, DPAR__RELAXED);
        if (c >= 0 && c < 1024) mask[c / BITS] &= ~(1ul << (c % BITS));
    }
    for (j = 0; j < WORDS; j++) any |= mask[j] != 0;
    if (!any) return; /* every allowed CPU is taken: stay */
    if (syscall(SYS_sched_setaffinity, 0, sizeof mask, mask) == 0) /* the kernel moves us now */
        syscall(SYS_sched_setaffinity, 0, sizeof allowed, allowed);
    dpar__cpu_note(t);
#else
    (void)p;
    (void)t;
#endif
}

/* A worker takes part in a fork it has not seen yet. Returns 1 if it did. */
static int dpar__fork_poll(dpar_pool *p, dpar__thread *t)
{
    uint32_t gen = DPAR__LOAD(&p->fork_gen, DPAR__ACQUIRE);
    if (gen == t->seen_fork) return 0;
    t->seen_fork = gen;
    dpar__fork_part(p, t->index);
    dpar__unshare(p, t);
    if (DPAR__SUB(&p->join_pending, 1, DPAR__SEQ_CST) == 1) dpar__wake(&p->join_pending, &p->join_sleepers, 1);
    return 1;
}

/* Run one fork-join job: the caller publishes it, takes part as thread 0, and waits. The caller
   holds fork_lock, so jobs never overlap and every worker sees every generation. */
static void dpar__fork(dpar_pool *p)
{
    dpar_pool *saved_pool = dpar__tls_pool;
    int saved_index = dpar__tls_index;
    uint32_t left;
    dpar__cpu_note(&p->threads[0]);
    DPAR__STORE(&p->join_pending, (uint32_t)(p->nthreads - 1), DPAR__RELAXED);
    DPAR__STORE(&p->next_chunk, 0, DPAR__RELAXED);
    DPAR__ADD(&p->fork_gen, 1, DPAR__RELEASE);
    dpar__bump(&p->wake_seq, &p->wake_sleepers, INT_MAX);
    dpar__bump(&p->done_seq, &p->done_sleepers, INT_MAX); /* workers waiting inside tasks serve forks */
    dpar__tls_pool = p;
    dpar__tls_index = 0;
    dpar__fork_part(p, 0);
    dpar__tls_pool = saved_pool;
    dpar__tls_index = saved_index;
    while ((left = DPAR__LOAD(&p->join_pending, DPAR__ACQUIRE)) != 0)
        dpar__wait_while(&p->join_pending, left, &p->join_sleepers, p->spin, 0);
}

static dpar_status dpar__for(dpar_pool *pool, int64_t n, int64_t grain, int dynamic, dpar_for_fn fn,
                             void *user, const char *api)
{
    uint64_t t0;
    if (!pool) return dpar__err(DPAR_EINVAL, "%s: pool is NULL", api);
    if (!fn) return dpar__err(DPAR_EINVAL, "%s: fn is NULL", api);
    if (n < 0) return dpar__err(DPAR_EINVAL, "%s: n = %lld is negative", api, (long long)n);
    if (grain < 0) return dpar__err(DPAR_EINVAL, "%s: grain = %lld is negative", api, (long long)grain);
    if (n == 0) return DPAR_OK;
    if (dynamic && grain == 0) grain = n / ((int64_t)pool->nthreads * 16);
    if (dynamic && grain < 1) grain = 1;
    if (dpar__in_pool(pool)) { /* nested: inline on this thread, still in chunks of `grain` */
        int64_t begin = 0, step = dynamic ? grain : n;
        while (n - begin > step) {
            fn(user, begin, begin + step, dpar__tls_index);
            begin += step;
        }
        fn(user, begin, n, dpar__tls_index);
        return DPAR_OK;
    }
    t0 = dpar_trace_enabled() ? dpar_time_ns() : 0;
    pthread_mutex_lock(&pool->fork_lock);
    pool->job_kind = dynamic ? DPAR__JOB_FOR_DYNAMIC : DPAR__JOB_FOR_STATIC;
    pool->job_n = n;
    pool->job_grain = grain;
    pool->job_chunks = dynamic ? n / grain + (n % grain != 0) : 0;
    pool->job_for = fn;
    pool->job_user = user;
    dpar__fork(pool);
    pthread_mutex_unlock(&pool->fork_lock);
    if (t0)
        dpar__trace_span("parallel_for", "pool", t0, "\"n\":%lld,\"threads\":%d,\"schedule\":\"%s\"", (long long)n,
                         pool->nthreads, dynamic ? "dynamic" : "static");
    return DPAR_OK;
}

DPAR_API dpar_status dpar_pool_for(dpar_pool *pool, int64_t n, dpar_for_fn fn, void *user)
{
    return dpar__for(pool, n, 0, 0, fn, user, "dpar_pool_for");
}

DPAR_API dpar_status dpar_pool_for_dynamic(dpar_pool *pool, int64_t n, int64_t grain, dpar_for_fn fn,
                                           void *user)
{
    return dpar__for(pool, n, grain, 1, fn, user, "dpar_pool_for_dynamic");
}

DPAR_API dpar_status dpar_pool_run(dpar_pool *pool, dpar_run_fn fn, void *user)
{
    int i;
    uint64_t t0;
    dpar_status st = DPAR_OK;
    if (!pool) return dpar__err(DPAR_EINVAL, "dpar_pool_run: pool is NULL");
    if (!fn) return dpar__err(DPAR_EINVAL, "dpar_pool_run: fn is NULL");
    if (dpar__in_pool(pool))
        return dpar__err(DPAR_EBUSY, "dpar_pool_run: called from thread %d of the same pool; an SPMD run "
                                     "needs every thread of the pool at once, so it cannot nest",
                         dpar__tls_index);
    t0 = dpar_trace_enabled() ? dpar_time_ns() : 0;
    pthread_mutex_lock(&pool->fork_lock);
    pool->job_kind = DPAR__JOB_RUN;
    pool->job_run = fn;
    pool->job_user = user;
    DPAR__STORE(&pool->in_run, 1, DPAR__RELAXED);
    dpar__fork(pool);
    DPAR__STORE(&pool->in_run, 0, DPAR__RELAXED);
    for (i = 0; i < pool->nthreads; i++) {
        if (pool->threads[i].run_status != DPAR_OK) {
            st = dpar__err(pool->threads[i].run_status, "dpar_pool_run: thread %d of %d failed: %s", i,
                           pool->nthreads, pool->threads[i].run_error);
            break;
        }
    }
    pthread_mutex_unlock(&pool->fork_lock);
    if (t0) dpar__trace_span("pool_run", "pool", t0, "\"threads\":%d", pool->nthreads);
    return st;
}

DPAR_API dpar_status dpar_pool_barrier(dpar_pool *pool)
{
    dpar__thread *self;
    uint32_t gen;
    if (!pool) return dpar__err(DPAR_EINVAL, "dpar_pool_barrier: pool is NULL");
    if (!dpar__in_pool(pool) || !DPAR__LOAD(&pool->in_run, DPAR__RELAXED))
        return dpar__err(DPAR_ESTATE, "dpar_pool_barrier: the calling thread is not inside dpar_pool_run of this pool");
    if (pool->nthreads == 1) return DPAR_OK;
    self = &pool->threads[dpar__tls_index];
    gen = DPAR__LOAD(&pool->bar_gen, DPAR__ACQUIRE);
    if (DPAR__ADD(&pool->bar_count, 1, DPAR__ACQ_REL) + 1 == (uint32_t)pool->nthreads) {
        DPAR__STORE(&pool->bar_count, 0, DPAR__RELAXED);
        dpar__bump(&pool->bar_gen, &pool->bar_sleepers, INT_MAX);
    } else {
        dpar__wait_while(&pool->bar_gen, gen, &pool->bar_sleepers, pool->spin, 0);
    }
    if (self->index > 0)
        dpar__unshare(pool, self);
    else
        dpar__cpu_note(self);
    return DPAR_OK;
}

/* ---- tasks ---- */
/* Records and edges live in chunked slabs reused across epochs: no allocation per task once warm. A
   thread that runs a task pushes a frame, so a wait can tell which tasks sit below it on its stack. */
typedef struct dpar__frame {
    dpar_pool *pool;
    uint32_t task;
    struct dpar__frame *up;
} dpar__frame;
static DPAR__TLS dpar__frame *dpar__tls_frame = NULL;

static dpar_task dpar__handle(dpar_pool *p, uint32_t index) { return ((uint64_t)p->epoch << 32) | (uint64_t)(index + 1); }

/* Record index of a live handle, or DPAR__NONE. Called with task_lock held. */
static uint32_t dpar__task_index(dpar_pool *p, dpar_task h)
{
    uint32_t epoch = (uint32_t)(h >> 32), low = (uint32_t)h;
    if (low == 0 || epoch != p->epoch || low - 1 >= p->ntasks) return DPAR__NONE;
    return low - 1;
}

static int dpar__finished(int state) { return state >= DPAR__TASK_DONE; }

/* The ready queue is a doubly linked FIFO, so a waiter can take the very task it waits for. */
static void dpar__ready_push(dpar_pool *p, uint32_t i)
{
    dpar__task_rec *r = dpar__rec(p, i);
    r->state = DPAR__TASK_READY;
    r->next = DPAR__NONE;
    r->prev = p->ready_tail;
    if (p->ready_tail == DPAR__NONE)
        p->ready_head = i;
    else
        dpar__rec(p, p->ready_tail)->next = i;
    p->ready_tail = i;
    DPAR__ADD(&p->ready_count, 1, DPAR__RELEASE);
}

static void dpar__ready_take(dpar_pool *p, uint32_t i)
{
    dpar__task_rec *r = dpar__rec(p, i);
    if (r->prev == DPAR__NONE) p->ready_head = r->next; else dpar__rec(p, r->prev)->next = r->next;
    if (r->next == DPAR__NONE) p->ready_tail = r->prev; else dpar__rec(p, r->next)->prev = r->prev;
    r->state = DPAR__TASK_RUNNING;
    DPAR__SUB(&p->ready_count, 1, DPAR__RELAXED);
}

/* Finish task i (done, failed or cancelled): release its dependents, or cancel them and theirs when
   it did not succeed. Called with task_lock held. Returns the number of tasks made ready. */
static int dpar__task_finish_locked(dpar_pool *p, uint32_t i)
{
    uint32_t work = i, e;
    int woke = 0;
    dpar__rec(p, i)->next = DPAR__NONE;
    while (work != DPAR__NONE) { /* a stack of finished tasks whose dependents need a visit */
        dpar__task_rec *r = dpar__rec(p, work);
        work = r->next;
        p->unfinished--;
        for (e = r->dependents; e != DPAR__NONE; e = dpar__edge_at(p, e)->next) {
            uint32_t di = dpar__edge_at(p, e)->to;
            dpar__task_rec *d = dpar__rec(p, di);
            if (d->state != DPAR__TASK_PENDING) continue; /* already cancelled by another dependency */
            if (r->state == DPAR__TASK_DONE) {
                if (--d->unresolved == 0) {
                    dpar__ready_push(p, di);
                    woke++;
                }
            } else {
                d->state = DPAR__TASK_CANCELLED;
                d->status = r->status;
                d->root = r->root;
                d->next = work;
                work = di;
            }
        }
    }
    return woke;
}

static void dpar__task_notify(dpar_pool *p, int woke)
{
    dpar__bump(&p->done_seq, &p->done_sleepers, INT_MAX);
    if (woke) dpar__bump(&p->wake_seq, &p->wake_sleepers, woke);
}

/* Run task i, which the caller has just taken from the ready queue (task_lock held; released here). */
static void dpar__task_execute(dpar_pool *p, uint32_t i)
{
    dpar__task_rec *r = dpar__rec(p, i);
    dpar_task_fn fn = r->fn;
    void *user = r->user;
    const char *name = r->name;
    dpar__frame frame;
    dpar_status st;
    int woke;
    uint64_t t0;
    pthread_mutex_unlock(&p->task_lock);

    t0 = dpar_trace_enabled() ? dpar_time_ns() : 0;
    frame.pool = p;
    frame.task = i;
    frame.up = dpar__tls_frame;
    dpar__tls_frame = &frame;
    dpar_clear_error();
    st = fn(user);
    dpar__tls_frame = frame.up;
    if (t0) dpar__trace_span(name ? name : "task", "task", t0, "\"task\":%u,\"status\":%d", i + 1, (int)st);

    pthread_mutex_lock(&p->task_lock);
    r = dpar__rec(p, i);
    r->status = st;
    r->root = i;
    if (st == DPAR_OK) {
        r->state = DPAR__TASK_DONE;
    } else {
        size_t n = strlen(dpar__tls_error);
        r->state = DPAR__TASK_FAILED;
        r->message = (char *)dpar__alloc(&p->allocator, n + 1);
        if (r->message) memcpy(r->message, dpar__tls_error, n + 1);
    }
    woke = dpar__task_finish_locked(p, i);
    pthread_mutex_unlock(&p->task_lock);
    dpar__task_notify(p, woke);
}

/* Pop the oldest ready task and run it on this thread. Returns 1 if one ran. */
static int dpar__task_run_one(dpar_pool *p)
{
    uint32_t i;
    if (DPAR__LOAD(&p->ready_count, DPAR__ACQUIRE) == 0) return 0;
    pthread_mutex_lock(&p->task_lock);
    i = p->ready_head;
    if (i == DPAR__NONE) {
        pthread_mutex_unlock(&p->task_lock);
        return 0;
    }
    dpar__ready_take(p, i);
    dpar__task_execute(p, i);
    return 1;
}

/* The error a waiter gets for finished task i. Called with task_lock held. */
static dpar_status dpar__task_result_locked(dpar_pool *p, uint32_t i)
{
    dpar__task_rec *r = dpar__rec(p, i), *root;
    const char *name = r->name ? r->name : "task";
    if (r->state == DPAR__TASK_DONE) return DPAR_OK;
    root = dpar__rec(p, r->root);
    if (r->state == DPAR__TASK_FAILED)
        return dpar__err(r->status, "task %u (%s) failed: %s", i + 1, name,
                         r->message && r->message[0] ? r->message : dpar_status_string(r->status));
    if (r->root == i)
        return dpar__err(r->status, "task %u (%s) was cancelled: the pool was destroyed before it ran", i + 1, name);
    return dpar__err(r->status, "task %u (%s) was cancelled: its dependency task %u (%s) failed: %s", i + 1, name,
                     r->root + 1, root->name ? root->name : "task",
                     root->message && root->message[0] ? root->message : dpar_status_string(root->status));
}

/* Make room in a chunk table for chunk index `chunk`, allocating the chunks up to it. */
static dpar_status dpar__slab_reserve(dpar_pool *p, void ***table, uint32_t *cap, uint32_t chunk, size_t chunk_bytes)
{
    uint32_t k;
    if (chunk >= *cap) {
        uint32_t n = *cap ? *cap : 16;
        void **t;
        while (n <= chunk) n *= 2;
        t = (void **)dpar__calloc(&p->allocator, n, sizeof *t);
        if (!t) return dpar__err(DPAR_ENOMEM, "dpar_task_submit: out of memory");
        if (*table) memcpy(t, *table, *cap * sizeof *t);
        dpar__free(&p->allocator, *table);
        *table = t;
        *cap = n;
    }
    for (k = 0; k <= chunk; k++)
        if (!(*table)[k] && !((*table)[k] = dpar__alloc(&p->allocator, chunk_bytes)))
            return dpar__err(DPAR_ENOMEM, "dpar_task_submit: out of memory");
    return DPAR_OK;
}

DPAR_API dpar_status dpar_task_submit(dpar_pool *pool, const dpar_task_desc *desc, dpar_task *out)
{
    uint32_t i, k;
    dpar__task_rec *r;
    int cancelled_by = -1, woke = 0;
    dpar_status st;
    if (out) *out = 0;
    if (!pool) return dpar__err(DPAR_EINVAL, "dpar_task_submit: pool is NULL");
    if (!desc) return dpar__err(DPAR_EINVAL, "dpar_task_submit: desc is NULL");
    if (!desc->fn) return dpar__err(DPAR_EINVAL, "dpar_task_submit: desc->fn is NULL");
    if (desc->num_deps < 0) return dpar__err(DPAR_EINVAL, "dpar_task_submit: num_deps = %d is negative", desc->num_deps);
    if (desc->num_deps > 0 && !desc->deps)
        return dpar__err(DPAR_EINVAL, "dpar_task_submit: num_deps = %d but deps is NULL", desc->num_deps);
    pthread_mutex_lock(&pool->task_lock);
    if (pool->shutdown) {
        pthread_mutex_unlock(&pool->task_lock);
        return dpar__err(DPAR_ECANCELED, "dpar_task_submit: the pool is being destroyed");
    }
    for (k = 0; k < (uint32_t)desc->num_deps; k++) {
        uint32_t d = dpar__task_index(pool, desc->deps[k]);
        int s;
        if (d == DPAR__NONE) {
            pthread_mutex_unlock(&pool->task_lock);
            return dpar__err(DPAR_EINVAL, "dpar_task_submit: deps[%u] = 0x%llx is not a live task of this pool "
                                          "(never submitted, or ended by dpar_task_wait_all)",
                             k, (unsigned long long)desc->deps[k]);
        }
        s = dpar__rec(pool, d)->state;
        if (cancelled_by < 0 && (s == DPAR__TASK_FAILED || s == DPAR__TASK_CANCELLED)) cancelled_by = (int)d;
    }
    if (pool->ntasks >= 0x7fffffffu || (uint64_t)pool->nedges + (uint64_t)desc->num_deps >= 0x7fffffffu)
        st = dpar__err(DPAR_ERANGE, "dpar_task_submit: more than 2^31 tasks or dependencies in one epoch; call "
                                    "dpar_task_wait_all to end the epoch");
    else
        st = dpar__slab_reserve(pool, &pool->task_chunks, &pool->task_chunk_cap, pool->ntasks / DPAR__TASK_CHUNK,
                                DPAR__TASK_CHUNK * sizeof(dpar__task_rec));
    if (st == DPAR_OK && desc->num_deps > 0)
        st = dpar__slab_reserve(pool, &pool->edge_chunks, &pool->edge_chunk_cap,
                                (pool->nedges + (uint32_t)desc->num_deps - 1) / DPAR__EDGE_CHUNK,
                                DPAR__EDGE_CHUNK * sizeof(dpar__edge));
    if (st != DPAR_OK) {
        pthread_mutex_unlock(&pool->task_lock);
        return st;
    }
    i = pool->ntasks++;
    pool->unfinished++;
    r = dpar__rec(pool, i);
    memset(r, 0, sizeof *r);
    r->fn = desc->fn;
    r->user = desc->user;
    r->name = desc->name;
    r->dependents = r->next = r->prev = DPAR__NONE;
    r->root = i;
    r->state = DPAR__TASK_PENDING;
    if (cancelled_by >= 0) {
        dpar__task_rec *c = dpar__rec(pool, (uint32_t)cancelled_by);
        r->state = DPAR__TASK_CANCELLED;
        r->status = c->status;
        r->root = c->root;
        dpar__task_finish_locked(pool, i); /* no dependents yet: nothing becomes ready */
    } else {
        for (k = 0; k < (uint32_t)desc->num_deps; k++) {
            dpar__task_rec *dr = dpar__rec(pool, dpar__task_index(pool, desc->deps[k]));
            dpar__edge *edge;
            if (dr->state == DPAR__TASK_DONE) continue;
            edge = dpar__edge_at(pool, pool->nedges);
            edge->to = i;
            edge->next = dr->dependents;
            dr->dependents = pool->nedges++;
            r->unresolved++;
        }
        if (r->unresolved == 0) {
            dpar__ready_push(pool, i);
            woke = 1;
        }
    }
    if (out) *out = dpar__handle(pool, i);
    pthread_mutex_unlock(&pool->task_lock);
    if (cancelled_by >= 0)
        dpar__task_notify(pool, 0);
    else if (woke)
        dpar__bump(&pool->wake_seq, &pool->wake_sleepers, 1);
    return DPAR_OK;
}

/* Can `target` not finish before `from` does, i.e. is it `from` or reachable from it along dependents
   edges? Called with task_lock held. */
static int dpar__task_reaches(dpar_pool *p, uint32_t from, uint32_t target)
{
    uint32_t top = 0, stamp = ++p->mark_stamp, e;
    if (p->search_cap < p->ntasks) {
        uint32_t *s = (uint32_t *)dpar__alloc(&p->allocator, (size_t)p->ntasks * sizeof *s);
        if (!s) return from == target; /* cannot search further */
        dpar__free(&p->allocator, p->search_stack);
        p->search_stack = s;
        p->search_cap = p->ntasks;
    }
    p->search_stack[top++] = from;
    dpar__rec(p, from)->mark = stamp;
    while (top) {
        uint32_t cur = p->search_stack[--top];
        if (cur == target) return 1;
        for (e = dpar__rec(p, cur)->dependents; e != DPAR__NONE; e = dpar__edge_at(p, e)->next) {
            uint32_t d = dpar__edge_at(p, e)->to;
            dpar__task_rec *dr = dpar__rec(p, d);
            if (dr->mark == stamp || dpar__finished(dr->state)) continue;
            dr->mark = stamp;
            p->search_stack[top++] = d;
        }
    }
    return 0;
}

/* Wait until task `target` (or, for DPAR__NONE, every task) has finished. A thread outside any task
   runs whatever is ready meanwhile. A thread inside a task runs only the task it waits for, once that
   is ready: running unrelated tasks on top of a waiting one could make it wait on itself. Workers
   also serve fork-join calls while they wait. */
static void dpar__task_wait_for(dpar_pool *p, uint32_t target)
{
    dpar__thread *self = dpar__in_pool(p) && dpar__tls_index > 0 ? &p->threads[dpar__tls_index] : NULL;
    int in_task = dpar__tls_frame != NULL;
    for (;;) {
        uint32_t seq = DPAR__LOAD(&p->done_seq, DPAR__ACQUIRE);
        int state;
        pthread_mutex_lock(&p->task_lock);
        if (target == DPAR__NONE) {
            if (p->unfinished == 0) {
                pthread_mutex_unlock(&p->task_lock);
                return;
            }
        } else {
            state = dpar__rec(p, target)->state;
            if (dpar__finished(state)) {
                pthread_mutex_unlock(&p->task_lock);
                return;
            }
            if (state == DPAR__TASK_READY) {
                dpar__ready_take(p, target);
                dpar__task_execute(p, target); /* unlocks */
                continue;
            }
        }
        pthread_mutex_unlock(&p->task_lock);
        if (self && dpar__fork_poll(p, self)) continue;
        if (!in_task && dpar__task_run_one(p)) continue;
        dpar__wait_while(&p->done_seq, seq, &p->done_sleepers, p->spin, 0);
    }
}

DPAR_API dpar_status dpar_task_wait(dpar_pool *pool, dpar_task task)
{
    uint32_t i;
    dpar__frame *f;
    dpar_status st;
    if (!pool) return dpar__err(DPAR_EINVAL, "dpar_task_wait: pool is NULL");
    pthread_mutex_lock(&pool->task_lock);
    i = dpar__task_index(pool, task);
    if (i == DPAR__NONE) {
        pthread_mutex_unlock(&pool->task_lock);
        return dpar__err(DPAR_EINVAL, "dpar_task_wait: 0x%llx is not a live task of this pool (never submitted, "
                                      "or ended by dpar_task_wait_all)", (unsigned long long)task);
    }
    /* Every task running lower on this thread's stack can only finish after this wait returns. */
    for (f = dpar__tls_frame; f && !dpar__finished(dpar__rec(pool, i)->state); f = f->up) {
        if (f->pool == pool && dpar__task_reaches(pool, f->task, i)) {
            uint32_t self = dpar__tls_frame->task;
            pthread_mutex_unlock(&pool->task_lock);
            if (i == self) return dpar__err(DPAR_EDEADLK, "dpar_task_wait: task %u waits for itself", self + 1);
            return dpar__err(DPAR_EDEADLK, "dpar_task_wait: task %u waits for task %u, which cannot finish before "
                                           "task %u does", self + 1, i + 1, f->task + 1);
        }
    }
    pthread_mutex_unlock(&pool->task_lock);
    dpar__task_wait_for(pool, i);
    pthread_mutex_lock(&pool->task_lock);
    st = dpar__task_result_locked(pool, i);
    pthread_mutex_unlock(&pool->task_lock);
    return st;
}

DPAR_API dpar_task_state dpar_task_state_of(dpar_pool *pool, dpar_task task)
{
    uint32_t i;
    int s;
    if (!pool) {
        dpar__err(DPAR_EINVAL, "dpar_task_state_of: pool is NULL");
        return DPAR_TASK_PENDING;
    }
    pthread_mutex_lock(&pool->task_lock);
    i = dpar__task_index(pool, task);
    s = i == DPAR__NONE ? DPAR__TASK_PENDING : dpar__rec(pool, i)->state;
    pthread_mutex_unlock(&pool->task_lock);
    if (i == DPAR__NONE) dpar__err(DPAR_EINVAL, "dpar_task_state_of: 0x%llx is not a live task", (unsigned long long)task);
    switch (s) {
    case DPAR__TASK_DONE: return DPAR_TASK_DONE;
    case DPAR__TASK_FAILED: return DPAR_TASK_FAILED;
    case DPAR__TASK_CANCELLED: return DPAR_TASK_CANCELLED;
    default: return DPAR_TASK_PENDING;
    }
}

DPAR_API dpar_status dpar_task_wait_all(dpar_pool *pool)
{
    dpar_status st = DPAR_OK;
    uint32_t i, failed = 0, cancelled = 0, first = DPAR__NONE;
    if (!pool) return dpar__err(DPAR_EINVAL, "dpar_task_wait_all: pool is NULL");
    if (dpar__in_pool(pool) || dpar__tls_frame)
        return dpar__err(DPAR_EBUSY, "dpar_task_wait_all: called from inside the pool (thread %d) or a task; it "
                                     "would wait for itself (wait on single tasks there)", dpar__tls_index);
    for (;;) {
        dpar__task_wait_for(pool, DPAR__NONE);
        pthread_mutex_lock(&pool->task_lock);
        if (pool->unfinished == 0) break; /* else another thread submitted meanwhile */
        pthread_mutex_unlock(&pool->task_lock);
    }
    for (i = 0; i < pool->ntasks; i++) {
        dpar__task_rec *r = dpar__rec(pool, i);
        if (r->state == DPAR__TASK_FAILED) {
            failed++;
            if (first == DPAR__NONE) first = i;
        } else if (r->state == DPAR__TASK_CANCELLED) {
            cancelled++;
        }
    }
    if (first != DPAR__NONE) {
        dpar__task_rec *r = dpar__rec(pool, first);
        st = dpar__err(r->status, "dpar_task_wait_all: %u of %u tasks failed and %u were cancelled; the first, task %u "
                                  "(%s), failed: %s", failed, pool->ntasks, cancelled, first + 1, r->name ? r->name : "task",
                       r->message && r->message[0] ? r->message : dpar_status_string(r->status));
    }
    /* end the epoch: free failure texts, recycle the records */
    for (i = 0; i < pool->ntasks; i++) {
        dpar__task_rec *r = dpar__rec(pool, i);
        dpar__free(&pool->allocator, r->message);
        r->message = NULL;
    }
    pool->ntasks = pool->nedges = 0;
    pool->epoch++;
    pthread_mutex_unlock(&pool->task_lock);
    return st;
}

/* ---- workers, create, destroy ---- */

static void dpar__pin_self(int cpu)
{
#if defined(__linux__)
    unsigned long mask[1024 / (8 * sizeof(unsigned long))];
    memset(mask, 0, sizeof mask);
    cpu %= (int)(8 * sizeof mask);
    mask[cpu / (8 * sizeof(unsigned long))] |= 1ul << (cpu % (8 * sizeof(unsigned long)));
    if (syscall(SYS_sched_setaffinity, 0, sizeof mask, mask) != 0)
        DPAR__LOG(DPAR_LOG_WARN, "pin_threads: cannot pin a worker to CPU %d", cpu);
#else
    (void)cpu;
#endif
}

static void *dpar__worker_main(void *arg)
{
    dpar__thread *t = (dpar__thread *)arg;
    dpar_pool *p = t->pool;
    char name[64];
    dpar__tls_pool = p;
    dpar__tls_index = t->index;
    snprintf(name, sizeof name, "%s%d thread %d", p->name, p->id, t->index);
    dpar_trace_set_thread_name(name);
    if (p->pin) dpar__pin_self(t->index % dpar__online_cpus());
    for (;;) {
        uint32_t wake = DPAR__LOAD(&p->wake_seq, DPAR__ACQUIRE);
        if (dpar__fork_poll(p, t)) continue;
        if (dpar__task_run_one(p)) continue;
        if (DPAR__LOAD(&p->shutdown, DPAR__ACQUIRE)) break;
        dpar__wait_while(&p->wake_seq, wake, &p->wake_sleepers, p->spin, 0);
    }
    return NULL;
}

static void dpar__pool_free(dpar_pool *p)
{
    dpar_allocator a = p->allocator;
    uint32_t i;
    for (i = 0; i < p->task_chunk_cap; i++) dpar__free(&a, p->task_chunks[i]);
    for (i = 0; i < p->edge_chunk_cap; i++) dpar__free(&a, p->edge_chunks[i]);
    dpar__free(&a, p->task_chunks);
    dpar__free(&a, p->edge_chunks);
    dpar__free(&a, p->search_stack);
    dpar__free(&a, p->threads);
    pthread_mutex_destroy(&p->fork_lock);
    pthread_mutex_destroy(&p->task_lock);
    dpar__free(&a, p);
}

/* Stop the workers: running tasks finish, the rest are cancelled. Returns how many were cancelled. */
static uint32_t dpar__pool_stop(dpar_pool *p)
{
    uint32_t i, cancelled = 0;
    int k;
    pthread_mutex_lock(&p->task_lock);
    DPAR__STORE(&p->shutdown, 1, DPAR__RELEASE);
    for (i = 0; i < p->ntasks; i++) {
        dpar__task_rec *r = dpar__rec(p, i);
        if (r->state == DPAR__TASK_PENDING || r->state == DPAR__TASK_READY) {
            r->state = DPAR__TASK_CANCELLED;
            r->status = DPAR_ECANCELED;
            r->root = i;
            p->unfinished--;
            cancelled++;
        }
    }
    p->ready_head = p->ready_tail = DPAR__NONE;
    DPAR__STORE(&p->ready_count, 0, DPAR__RELAXED);
    pthread_mutex_unlock(&p->task_lock);
    dpar__bump(&p->wake_seq, &p->wake_sleepers, INT_MAX);
    dpar__bump(&p->done_seq, &p->done_sleepers, INT_MAX);
    for (k = 1; k < p->started; k++) pthread_join(p->threads[k].handle, NULL);
    return cancelled;
}

DPAR_API dpar_status dpar_pool_create(const dpar_pool_desc *desc, dpar_pool **out)
{
    dpar_pool_desc d;
    dpar_pool *p;
    int n, i;
    dpar_status st;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_pool_create: out is NULL");
    *out = NULL;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if ((st = dpar__check_allocator("dpar_pool_create", &d.allocator)) != DPAR_OK) return st;
    if (d.num_threads < 0)
        return dpar__err(DPAR_EINVAL, "dpar_pool_create: num_threads = %d is negative (0 means the default)", d.num_threads);
    if (d.num_threads > DPAR_MAX_THREADS)
        return dpar__err(DPAR_ERANGE, "dpar_pool_create: num_threads = %d is above DPAR_MAX_THREADS (%d)", d.num_threads,
                         DPAR_MAX_THREADS);
    if (d.spin_us < -1)
        return dpar__err(DPAR_EINVAL, "dpar_pool_create: spin_us = %d (use -1 for no spinning, 0 for the default)", d.spin_us);
    dpar__trace_from_env();
    n = d.num_threads;
    if (n == 0) {
        const char *env = getenv("DPAR_NUM_THREADS");
        if (env && *env) {
            char *end;
            long v = strtol(env, &end, 10);
            if (*end || v < 1 || v > DPAR_MAX_THREADS)
                DPAR__LOG(DPAR_LOG_WARN, "DPAR_NUM_THREADS=%s is not a thread count in 1..%d; using the online CPUs",
                          env, DPAR_MAX_THREADS);
            else
                n = (int)v;
        }
        if (n == 0) n = dpar__online_cpus();
        if (n > DPAR_MAX_THREADS) n = DPAR_MAX_THREADS;
    }
    p = (dpar_pool *)dpar__calloc(&d.allocator, 1, sizeof *p);
    if (!p) return dpar__err(DPAR_ENOMEM, "dpar_pool_create: out of memory");
    p->allocator = d.allocator;
    p->nthreads = n;
    p->pin = d.pin_threads != 0;
    p->spin_us = d.spin_us == 0 ? DPAR_SPIN_US : (d.spin_us < 0 ? 0 : d.spin_us);
    p->spin = dpar__spin_make(p->spin_us, n);
    p->id = DPAR__ADD(&dpar__pool_next_id, 1, DPAR__RELAXED);
    snprintf(p->name, sizeof p->name, "%s", d.name && *d.name ? d.name : "pool");
    p->ready_head = p->ready_tail = DPAR__NONE;
    p->epoch = 1;
    pthread_mutex_init(&p->fork_lock, NULL);
    pthread_mutex_init(&p->task_lock, NULL);
    p->threads = (dpar__thread *)dpar__calloc(&p->allocator, (size_t)n, sizeof(dpar__thread));
    if (!p->threads) {
        dpar__pool_free(p);
        return dpar__err(DPAR_ENOMEM, "dpar_pool_create: out of memory");
    }
    p->started = 1;
    for (i = 0; i < n; i++) {
        p->threads[i].pool = p;
        p->threads[i].index = i;
        p->threads[i].cpu = -1;
    }
    p->unshare = !p->pin && n > 1 && n <= dpar__online_cpus();
    for (i = 1; i < n; i++) {
        int e = pthread_create(&p->threads[i].handle, NULL, dpar__worker_main, &p->threads[i]);
        if (e != 0) {
            dpar__pool_stop(p);
            dpar__pool_free(p);
            return dpar__err(DPAR_ESYSTEM, "dpar_pool_create: cannot start thread %d of %d: %s", i, n, strerror(e));
        }
        p->started = i + 1;
    }
    *out = p;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_pool_destroy(dpar_pool *pool)
{
    uint32_t cancelled;
    if (!pool) return dpar__err(DPAR_EINVAL, "dpar_pool_destroy: pool is NULL");
    if (dpar__in_pool(pool))
        return dpar__err(DPAR_EBUSY, "dpar_pool_destroy: called from thread %d of the pool itself; the pool is kept",
                         dpar__tls_index);
    pthread_mutex_lock(&pool->fork_lock); /* let a fork-join call of another thread end first */
    pthread_mutex_unlock(&pool->fork_lock);
    cancelled = dpar__pool_stop(pool);
    dpar__pool_free(pool);
    if (cancelled)
        return dpar__err(DPAR_ECANCELED, "dpar_pool_destroy: %u tasks had not started and were cancelled; the pool "
                                         "is destroyed (call dpar_task_wait_all first to run them)", cancelled);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_pool_query(const dpar_pool *pool, dpar_pool_desc *used)
{
    if (!pool || !used) return dpar__err(DPAR_EINVAL, "dpar_pool_query: pool or used is NULL");
    memset(used, 0, sizeof *used);
    used->num_threads = pool->nthreads;
    used->pin_threads = pool->pin;
    used->spin_us = pool->spin_us == 0 ? -1 : pool->spin_us;
    used->name = pool->name;
    used->allocator = pool->allocator;
    return DPAR_OK;
}

DPAR_API int dpar_pool_num_threads(const dpar_pool *pool) { return pool ? pool->nthreads : 0; }

DPAR_API int dpar_pool_thread_index(const dpar_pool *pool) { return dpar__in_pool(pool) ? dpar__tls_index : -1; }

#endif /* DPAR_IMPLEMENTATION */

/*
   LICENSE (MIT)
   Copyright (c) 2026 the dpar authors

   Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
   associated documentation files (the "Software"), to deal in the Software without restriction,
   including without limitation the rights to use, copy, modify, merge, publish, distribute,
   sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
   furnished to do so, subject to the following conditions:

   The above copyright notice and this permission notice shall be included in all copies or
   substantial portions of the Software.

   THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT
   NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
   NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM,
   DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT
   OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
*/
