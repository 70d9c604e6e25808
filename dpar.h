/* dpar.h - an embeddable, header-only toolkit for parallel and distributed training.  v0.1.0
   https://github.com/dpar/dpar  (MIT license, at the end of this file)

   WHAT
     Thread worker pools, collectives over thread ranks, tensor sharding and pipeline stages that a
     host application composes into a trainer of its own. C99 + pthreads, no other dependency.

   QUICK START
     In exactly one C (or C++) file of your program, define DPAR_IMPLEMENTATION before the include
     (compile with -pthread; under a strict -std=c99 without it, include dpar.h before any system header
     of that file, docs/openmp.md says why):

         #define DPAR_IMPLEMENTATION
         #include "dpar.h"

     Everywhere else include "dpar.h" alone. Link with -pthread -lm. The rest of a whole program:

         static void square(void *user, int64_t begin, int64_t end, int thread) {
             float *x = (float *)user;
             for (int64_t i = begin; i < end; i++) x[i] = x[i] * x[i];
             (void)thread;
         }
         int main(void) {
             static float x[1 << 20];
             dpar_pool *pool;
             dpar_pool_desc desc = {0};              // zero means "the defaults"
             if (dpar_pool_create(&desc, &pool) != DPAR_OK) { puts(dpar_last_error()); return 1; }
             dpar_pool_for(pool, 1 << 20, square, x); // static schedule, the caller takes part
             return dpar_pool_destroy(pool);
         }

     Learn by running: docs/guide/README.md, one short program per lesson. Reference: the page in docs/ of
     each part (pool, comm, mpi, data_parallel, model_parallel, pipeline, ...; README.md lists them) and the
     comment above every declaration.

   API RULES (every public type and call keeps them)
     Create     dpar_x_create(const dpar_x_desc *desc, dpar_x **out) when dpar allocates the object;
                dpar_x_init(dpar_x *x, const dpar_x_desc *desc) when the struct is yours (a layer, a mesh, a sampler,
                an IDX file, a shard plan). Every input is in the desc, its comm or pool included; zero fields (or a
                NULL desc) mean the defaults, except fields marked required. On error *out is NULL, or *x zeroed. A
                comm is made from what it belongs to: dpar_group_join, dpar_group_join_mpi, dpar_comm_split,
                dpar_comm_from_mpi. The exception: dpar_group_create takes the desc of its comms, dpar_comm_desc.
     Destroy    dpar_status dpar_x_destroy(dpar_x *x) undoes either (a shard plan holds nothing and has none); NULL or
                a zeroed struct is a no-op (DPAR_OK); everything is released unless it returns DPAR_EBUSY.
     Memory     only the desc's `dpar_allocator allocator` field (zero: malloc/free), kept until destroy; a comm uses
                its group's or parent's; a call's scratch memory comes from the object it is called on.
     Callbacks  each a typedef dpar_thing[_role]_fn (dpar_pool_for_fn, dpar_steal_done_fn) whose first parameter is
                `void *user`: the pointer passed right after the function, or the `user` field beside it in a desc.
     Names      dpar_thing_verb, one spelling per thing: checkpoints are dpar_ckpt_* (dpar_ckpt_save, _load).
     Exceptions the collectives and point-to-point calls keep MPI's names (dpar_allreduce(comm, ...)); the error
                calls are dpar_last_error, dpar_set_error, dpar_clear_error; dpar_sgemm* keep BLAS's; queries are
                named after what they return (dpar_comm_rank, dpar_zero_shard); a request is released by
                dpar_request_wait (or _test once done), not destroyed; dpar_sgemm's per-thread packing buffers come
                from posix_memalign (there is no object to take an allocator from); dpar_steal_run passes `user`
                after both of its functions.

   OPTIONS (define before the include that has DPAR_IMPLEMENTATION; every one has a default)
     DPAR_IMPLEMENTATION   emit the implementation in this translation unit
     DPAR_STATIC           make every function static (two libraries can embed dpar without clashing)
     DPAR_API              override the declaration prefix (default: extern, or static under DPAR_STATIC)
     DPAR_ASSERT(c)        assertion hook for programmer errors (default: assert from <assert.h>)
     DPAR_NO_FUTEX         use a mutex/condition-variable parking lot instead of Linux futexes
     DPAR_NO_TSC           dpar_time_ns is CLOCK_MONOTONIC (otherwise the scaled TSC where it qualifies)
     DPAR_MPI              the MPI transport: dpar_comm_from_mpi, dpar_group_join_mpi (mpi.h)
     DPAR_OPENBLAS         dpar_sgemm calls OpenBLAS's cblas_sgemm (link -lopenblas)
     DPAR_NO_AVX2          leave out the AVX2 + FMA GEMM kernel (x86; chosen at run time otherwise)
     DPAR_SPIN_US          default microseconds a wait spins before it sleeps (default 200)
     DPAR_ONESHOT_MAX_BYTES  thread ranks: allreduce one-shot up to this many bytes, twice that on more
                           than 2 ranks (default 2048)
     DPAR_SLICE_MIN_BYTES  thread ranks: allreduce by slice above the one-shot size from this many bytes
                           (default 2048: no size is left to the ring; raise it to give the ring a range)
     DPAR_RING_MIN_BYTES   thread ranks, 2 of them: the ring from this many bytes (default 2 MiB) until
                           streaming stores apply (then by slice again)
     DPAR_SHM_ONESHOT_MAX_BYTES  MPI, all processes on one node: allreduce one-shot through a block they
                           share up to this many bytes (default 65536)
     DPAR_SHM_TWO_MAX_BYTES  the same for a comm of two processes (default 16 MiB, in pieces of 256 KiB)
     DPAR_MSG_ONESHOT_MAX_BYTES  MPI otherwise: allreduce one-shot over messages up to this many bytes
                           (default 16384)
     DPAR_MPI_SEGMENT_BYTES  MPI: the ring's segment when dpar_comm_desc.segment_bytes is 0 (default
                           1 MiB; each segment is an MPI message, and 128 KiB ones measured 7-30% slower)
     DPAR_STREAM_MIN_BYTES streaming stores when N x bytes reaches this (default 0: the LLC's size)
     DPAR_NO_STREAM        no streaming (non-temporal) stores: ordinary stores everywhere
     DPAR_MAX_THREADS      largest pool or thread group (default 1024)
     DPAR_TIMEOUT_MS_DEFAULT  blocking comm calls give up after this (default 30000)

   ENVIRONMENT (code arguments always win over the environment)
     DPAR_NUM_THREADS=N    threads of a pool whose description says 0
     DPAR_TRACE=file.json  write a Chrome trace-event file (open it in Perfetto or chrome://tracing)
     DPAR_TIMEOUT_MS=N     timeout of blocking comm calls whose description says 0 (-1: none)
     DPAR_ALGO=ring|oneshot|slice|auto  allreduce algorithm of comms whose description says 0 (dpar_algo)
     DPAR_MPI_SHM=0        MPI comms made now: no block shared by the node's processes (one-shot over messages)
     DPAR_LOG=error|warn|info|debug|off   log level (default warn)
     DPAR_CLOCK=monotonic  dpar_time_ns is CLOCK_MONOTONIC, not the scaled TSC (read at its first call)
     DPAR_FAULT=spec       inject faults, for tests: "rank=1,op=allreduce,at=5,kind=delay:200;..." delays, fails or
                           silences a rank at its N-th operation of a kind (dpar_fault_set; docs/reliability.md);
                           malformed: pool and group creation (and a comm's calls) fail with DPAR_EINVAL
     Malformed DPAR_TIMEOUT_MS or DPAR_LOG, or a DPAR_TRACE file that cannot be created: pool and comm creation
     fail the same way, naming the variable and quoting its value (docs/runtime.md, 'Malformed environment')

   SECTIONS (grep for the tag). Declarations come first, then under DPAR_IMPLEMENTATION the code in
   the same order; (impl) marks a section that has no declarations. "base" is config, status, log,
   alloc, time, trace and fault, which every later section may use; a section uses only those above it
   (>>comm waits for >>async's requests and the MPI transport's table names >>hybrid's native
   collectives, both through a declaration ahead).
     tag          holds                                                            uses
     >>config     options, portability; (impl) system headers, atomics, TLS        -
     >>status     status codes, the per-thread error text                          config
     >>log        log levels, the callback                                         config
     >>alloc      the allocator hook                                               config
     >>time       (impl) the clock, waits that spin then sleep, CPU placement      config
     >>trace      the Chrome trace-event sink                                      status, log, time
     >>fault      fault injection (DPAR_FAULT): the parser, each comm's schedule   status, log, alloc, time
     >>pool       the pool: parallel-for, SPMD run, barrier; task declarations     base
     >>task       (impl) the task graph                                            base, pool
     >>workers    (impl) worker threads, pool create and destroy                   base, pool, task
     >>dtype      element types, ops, call kinds, block ranges, bf16/f16, reductions  status
     >>transport  (impl) the transport interface and the comm object               base, dtype
     >>ring       (impl) the collective algorithms, once for every transport       dtype, transport
     >>algo       (impl) one-shot and reduce-by-slice allreduce, streaming stores  base, dtype, transport, ring
     >>comm       the communicator API; (impl) its front end                       base, transport, ring, algo
     >>async      (impl) asynchronous requests, the progress thread                base, transport, comm
     >>threads    (impl) the threads transport: zero-copy channels, doorbells      base, transport, ring, comm
     >>ops        (impl) comms whose collectives another library runs (NCCL)        base, transport, comm
     >>gemm       dpar_sgemm (OpenBLAS or built in), one GEMM over a pool          base, pool
     >>shard      shard plans: scatter, gather, all-gather of blocks               base, comm
     >>tp         tensor-parallel linear layers (Megatron)                         base, pool, gemm, shard
     >>zero       ZeRO-1: sharded optimizer state; dpar_tensor lists               base, comm
     >>fsdp       ZeRO-2 and ZeRO-3 (FSDP): sharded by unit, prefetched gathers     base, comm, zero
     >>pipe       pipeline schedules as checked data, the stage runner             base, comm
     >>dp         data-parallel helpers: sampler, gradient buckets                 base, transport, comm, async
     >>steal      work stealing between thread ranks                               base, transport, comm
     >>idx        IDX data files                                                   base
     >>ckpt       checkpoints: shard plans that reshard, CRC-checked, atomic       base, comm, shard, zero, fsdp
     >>mpi        the MPI transport (DPAR_MPI)                                     base, transport, ring, comm
     >>hybrid     MPI's own collectives, the processes x threads comm              mpi, comm, threads' API
     >>impl       where the implementation starts

   THREAD SAFETY, in short: status, log, error: any thread (the error text is per thread); trace:
   any thread, start/stop from one thread at a time; pool: every call says who may make it; comm: a
   comm belongs to its rank's thread, abort and the queries may come from any thread.

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
     - Inside one dpar_pool_run, dpar_pool_share (_2d, _3d) gives each thread its share of a loop (static,
       dynamic or guided, as OpenMP's `for` in a parallel region) and dpar_pool_reduce_* combines a value
       across the threads: docs/openmp.md.
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

   THE COMMUNICATOR
     N ranks that are threads meet at a dpar_group; each rank's thread makes its dpar_comm and calls
     the collectives (comm first, then MPI/NCCL's names and order). The ring algorithms read straight
     out of the neighbour's buffer (zero-copy) and stream in segments. Every call carries a
     fingerprint (sequence, op, dtype, count, root, file:line): ranks that disagree get
     DPAR_EMISMATCH naming both sides; a rank that never arrives gives DPAR_ETIMEDOUT after 30 s
     naming it; dpar_comm_abort wakes everyone with DPAR_EABORTED. Results are bitwise identical on
     every rank and run; the deterministic mode makes them independent of N too. docs/comm.md.

         dpar_comm_desc d = {0};  d.size = 4;
         dpar_group *g;  dpar_group_create(&d, &g);
         // on thread r (e.g. inside dpar_pool_run):
         dpar_comm *c;  dpar_group_join(g, r, &c);
         dpar_allreduce(c, grad, grad, n, DPAR_F32, DPAR_AVG);

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
#ifdef DPAR_MPI
#include <mpi.h>
#endif

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
/* dpar_status: one list makes both the enum and the strings. 0 is success; errors are negative.
   See:      docs/runtime.md, 'Status codes and error text'. */
#define DPAR_STATUS_LIST(X)                                                       \
    X(DPAR_OK, 0, "success")                                                      \
    X(DPAR_EINVAL, -1, "invalid argument")                                        \
    X(DPAR_ENOMEM, -2, "out of memory")                                           \
    X(DPAR_EBUSY, -3, "not allowed from this thread or while the object is busy") \
    X(DPAR_ECANCELED, -4, "cancelled")                                            \
    X(DPAR_EDEADLK, -5, "the call would deadlock")                                \
    X(DPAR_ETIMEDOUT, -6, "timed out")                                            \
    X(DPAR_EMISMATCH, -7, "ranks disagree on a collective call")                  \
    X(DPAR_EABORTED, -8, "aborted")                                               \
    X(DPAR_EIO, -9, "input/output error")                                         \
    X(DPAR_ESYSTEM, -10, "operating system call failed")                          \
    X(DPAR_EUNSUPPORTED, -11, "not supported")                                    \
    X(DPAR_ERANGE, -12, "value out of range")                                     \
    X(DPAR_ESTATE, -13, "object in the wrong state for this call")                \
    X(DPAR_ECORRUPT, -14, "data is damaged")                                      \
    X(DPAR_EUSER, -15, "error raised by user code")                               \
    X(DPAR_EEXIST, -16, "already exists")

#define DPAR__STATUS_ENUM(name, value, text) name = value,
typedef enum dpar_status { DPAR_STATUS_LIST(DPAR__STATUS_ENUM) } dpar_status;
#undef DPAR__STATUS_ENUM

/* dpar_status_string: a short text naming a code, e.g. "invalid argument (DPAR_EINVAL)".
   Returns:  a static string, never NULL ("unknown status (not a dpar_status)" for any other value).
   Thread safety: any thread. */
DPAR_API const char *dpar_status_string(dpar_status status);

/* dpar_last_error: the sentence with context that explains the last error this thread got from dpar.
   Returns:  e.g. "dpar_pool_for: n = -3 is negative"; "" when there is none. Valid until the thread's next
             dpar call that fails.
   Thread safety: any thread; each thread has its own. */
DPAR_API const char *dpar_last_error(void);

/* dpar_set_error: set this thread's error text (printf format) and return `status`.
   fmt, ...: the arguments may include dpar_last_error() itself, to wrap the previous message in context.
   Returns:  `status`, so a user callback can `return dpar_set_error(DPAR_EUSER, "bad batch %d", i);` and the
             text reaches whoever waits on the task or run.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_set_error(dpar_status status, const char *fmt, ...) DPAR_PRINTF(2, 3);

/* dpar_clear_error: empty this thread's error text.
   Thread safety: any thread. */
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

/* dpar_log_fn: a log sink; it gets the level, the source position in dpar.h and the formatted message.
   See:      docs/runtime.md, 'Log'. */
typedef void (*dpar_log_fn)(void *user, dpar_log_level level, const char *file, int line, const char *message);

/* dpar_log_set_callback: route log messages to `fn`.
   fn:       NULL: back to stderr. It may be called from any thread, from several at once.
   user:     passed to fn as its first argument.
   Thread safety: any thread. */
DPAR_API void dpar_log_set_callback(dpar_log_fn fn, void *user);
/* dpar_log_set_level / dpar_log_get_level: set or read the level above which messages are dropped.
   level:    the default is the DPAR_LOG environment variable, else DPAR_LOG_WARN; this call wins over DPAR_LOG.
   Thread safety: any thread. */
DPAR_API void dpar_log_set_level(dpar_log_level level);
DPAR_API dpar_log_level dpar_log_get_level(void);
/* dpar_log_message: log a printf-formatted message through dpar's sink, as dpar's own messages are.
   file, line: the source position passed to the callback (the implementation's DPAR__LOG macro passes its own).
   Thread safety: any thread. */
DPAR_API void dpar_log_message(dpar_log_level level, const char *file, int line, const char *fmt, ...)
    DPAR_PRINTF(4, 5);

/* ============================================================================================== */
/* >>alloc: allocator hook                                                                        */
/* ============================================================================================== */
/* dpar_allocator_alloc_fn / dpar_allocator_free_fn: allocate `size` bytes (NULL when out of memory) / free
   what alloc returned. user: the allocator's `user` field. */
typedef void *(*dpar_allocator_alloc_fn)(void *user, size_t size);
typedef void (*dpar_allocator_free_fn)(void *user, void *ptr);

/* dpar_allocator: the allocation hook of the description structs (their `allocator` field).
   alloc, free: both set, or both NULL for malloc/free. `alloc` needs only malloc's alignment: dpar
             over-allocates for the 64-byte aligned blocks it wants.
   See:      docs/runtime.md, 'Allocator and assert hooks'. */
typedef struct dpar_allocator {
    dpar_allocator_alloc_fn alloc;
    dpar_allocator_free_fn free;
    void *user;
} dpar_allocator;

/* ============================================================================================== */
/* >>trace: Chrome trace-event JSON                                                               */
/* ============================================================================================== */
/* dpar_trace_start: start writing Chrome trace-event JSON to `path` (the file is truncated).
   Returns:  DPAR_OK; DPAR_EINVAL (path NULL or empty), DPAR_ESTATE (a trace is already running), DPAR_EIO
             (the file cannot be opened).
   Thread safety: any thread.
   See:      docs/runtime.md, 'Trace'. */
DPAR_API dpar_status dpar_trace_start(const char *path);
/* dpar_trace_stop: close the JSON and the file.
   Returns:  DPAR_OK; DPAR_ESTATE (no trace runs), DPAR_EIO (writing the file failed).
   Thread safety: any thread; events that other threads emit after it are dropped. */
DPAR_API dpar_status dpar_trace_stop(void);
/* dpar_trace_enabled: 1 while a trace is running, else 0.
   Thread safety: any thread; a relaxed load, cheap enough for hot paths. */
DPAR_API int dpar_trace_enabled(void);
/* dpar_time_ns: a monotonic clock in nanoseconds, the time base of the trace, the timeouts and the counters.
   On x86-64 Linux with an invariant TSC that the kernel keeps time by (clocksource tsc or kvm-clock) it is the
   TSC scaled against CLOCK_MONOTONIC (measured over the first 20 ms of use; CLOCK_MONOTONIC until then): about
   twice as cheap, within some ppm of CLOCK_MONOTONIC's rate, not slewed by NTP. Elsewhere, or with DPAR_NO_TSC
   or DPAR_CLOCK=monotonic, CLOCK_MONOTONIC. A reading is never below one this thread or (through memory) another
   took before.
   Thread safety: any thread. */
DPAR_API uint64_t dpar_time_ns(void);
/* dpar_trace_event: record one complete event [begin_ns, end_ns) on the calling thread's track.
   begin_ns, end_ns: dpar_time_ns() values; an event that began before the trace started is dropped.
   cat:      the category; may be NULL.
   args_json: NULL or the inside of a JSON object ("\"bytes\":4096").
   Thread safety: any thread. */
DPAR_API void dpar_trace_event(const char *name, const char *cat, uint64_t begin_ns, uint64_t end_ns,
                               const char *args_json);
/* dpar_trace_set_thread_name: name the calling thread's track ("rank 3").
   Thread safety: any thread, for itself. */
DPAR_API void dpar_trace_set_thread_name(const char *name);

/* ============================================================================================== */
/* >>fault: fault injection (DPAR_FAULT)                                                          */
/* ============================================================================================== */
/* dpar_fault_set: schedule faults for the comms (dpar_group_join, a split, ...) and pools made after this call (a
   test's tool: a slow, dead or failing rank, on purpose). Wins over the DPAR_FAULT environment variable, which
   gives the same text.
   spec:     NULL or "": no fault. Else faults separated by ';', each fields separated by ',':
               kind=delay:MS | vanish | fail    (required) what happens
               rank=R                           the comm rank it happens on (default: every rank)
               op=KIND                          which operations count (default any): barrier, broadcast, reduce,
                                                reduce_scatter, allgather, allreduce, alltoall, alltoallv, send,
                                                recv (of dpar_send/recv/sendrecv and the pipeline's messages),
                                                bucket (a dpar_buckets update callback), stage (a pipeline forward
                                                or backward callback), steal (a dpar_steal_run round), task (a pool
                                                task; no rank= then: a pool has none)
               at=N                             the N-th such operation of that rank on each comm (of the pool,
                                                for tasks), counted from 1 (default 1)
               comm=NAME                        only comms of that name (dpar_comm_desc.name; a split's "name.suffix")
             e.g. "rank=1,op=allreduce,at=5,kind=delay:200;rank=2,op=send,at=3,kind=fail".
             delay:MS  the operation waits MS milliseconds (0..3600000) first, then runs as usual.
             fail      the operation fails with DPAR_EIO and poisons the comm with `<comm> rank R: injected fault
                       (DPAR_FAULT "<fault>"): its <op> #N failed`, so every rank returns an error naming rank R and
                       the op. A callback (bucket, stage, task) is not called, and the call fails with DPAR_EUSER
                       (a task: `pool <name>: injected fault (...): task T (<name>) (the pool's task #N to run)
                       failed`, which cancels the tasks that depend on it).
             vanish    the rank stops taking part: the operation and every later one of that rank on that comm
                       return DPAR_ECANCELED at once ("<comm> rank R has vanished ...") without touching the comm,
                       as a dead rank would: the others time out (the comm's timeout), and their error names rank
                       R and the call they wait in. Keep the rank's buffers and comm until the others have
                       returned (a peer may still read what it posted before). With no timeout they wait for ever.
   Returns:  DPAR_OK; DPAR_EINVAL (a malformed spec: the text quotes the bad part; the schedule is left as it
             was). A malformed DPAR_FAULT makes every dpar_pool_create and dpar_group_create, and every
             operation of a comm made otherwise (MPI, ops), fail with DPAR_EINVAL quoting it.
   Remarks:  costs one predictable branch per operation when no fault is scheduled. Up to 16 faults.
   Thread safety: any thread; comms and pools made before it keep the schedule they were made with.
   See:      docs/runtime.md, 'Fault injection'; docs/reliability.md. */
DPAR_API dpar_status dpar_fault_set(const char *spec);

/* ============================================================================================== */
/* >>pool: worker pool, parallel-for, SPMD run, barrier, task graph                               */
/* ============================================================================================== */
typedef struct dpar_pool dpar_pool;

/* dpar_pool_desc: how to make a pool; a zero field means its default. */
typedef struct dpar_pool_desc {
    int num_threads;          /* threads taking part, the caller included; 0: DPAR_NUM_THREADS, else the
                         online CPUs. Negative: DPAR_EINVAL; above DPAR_MAX_THREADS: DPAR_ERANGE */
    int pin_threads;          /* 1: pin worker i (1..T-1) to CPU i mod CPUs; the caller is left as it is */
    int spin_us;              /* microseconds a wait spins before sleeping; 0: DPAR_SPIN_US; -1: no spin */
    const char *name;         /* prefix of the trace tracks (copied; default "pool") */
    dpar_allocator allocator; /* the pool's memory, task records included (zero: malloc/free) */
} dpar_pool_desc;

/* dpar_pool_create: start a pool of T threads: the caller plus T - 1 workers.
   desc:     NULL or zero fields: the defaults (see dpar_pool_desc).
   Returns:  DPAR_OK; DPAR_EINVAL (NULL out, negative counts, half an allocator), DPAR_ERANGE (more than
             DPAR_MAX_THREADS), DPAR_ENOMEM, DPAR_ESYSTEM (a thread could not start). On error *out is NULL.
   Thread safety: any thread.
   See:      docs/pool.md. */
DPAR_API dpar_status dpar_pool_create(const dpar_pool_desc *desc, dpar_pool **out);

/* dpar_pool_destroy: finish running tasks, cancel those not started, join the workers and free the pool.
   Returns:  DPAR_OK (also for NULL); DPAR_ECANCELED (tasks were cancelled; the pool is freed either way),
             DPAR_EBUSY (called from one of the pool's own threads; the pool is kept).
   Thread safety: one thread, with no other call on this pool in flight or to come. */
DPAR_API dpar_status dpar_pool_destroy(dpar_pool *pool);

/* dpar_pool_query: the values really used, num_threads and spin_us resolved.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL pool or used).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_pool_query(const dpar_pool *pool, dpar_pool_desc *used);

/* dpar_pool_num_threads / dpar_pool_thread_index: the pool's thread count T; the calling thread's index in it.
   Returns:  num_threads: T, or 0 for NULL. thread_index: 0..T-1 (0 for the caller during a fork-join call),
             or -1 when the calling thread is not taking part.
   Thread safety: any thread. */
DPAR_API int dpar_pool_num_threads(const dpar_pool *pool);
DPAR_API int dpar_pool_thread_index(const dpar_pool *pool);

/* dpar_pool_for_fn: the body of a parallel-for: handle iterations [begin, end).
   thread:   the index (0..T-1) of the thread running it, for per-thread scratch. */
typedef void (*dpar_pool_for_fn)(void *user, int64_t begin, int64_t end, int thread);

/* dpar_pool_for / dpar_pool_for_dynamic: run fn over iterations [0, n) on the pool's threads and wait for it.
   Schedule: dpar_pool_for: static, thread t handles the t-th of T near-equal contiguous blocks.
             dpar_pool_for_dynamic: chunks of `grain` iterations (0: about n / (16 T)), handed out in order
             to whichever thread is free.
   n:        0 returns at once; the whole int64 range works without overflow.
   Returns:  DPAR_OK; DPAR_EINVAL (n or grain negative, NULL pool or fn).
   Thread safety: any thread; concurrent callers from outside take turns; from one of the pool's own threads
             the loop runs inline (in chunks of `grain`).
   See:      docs/pool.md, 'Parallel-for'. */
DPAR_API dpar_status dpar_pool_for(dpar_pool *pool, int64_t n, dpar_pool_for_fn fn, void *user);
DPAR_API dpar_status dpar_pool_for_dynamic(dpar_pool *pool, int64_t n, int64_t grain, dpar_pool_for_fn fn, void *user);

/* dpar_pool_run_fn: the body of an SPMD run, on thread `thread` of `num_threads`.
   Returns:  DPAR_OK or an error (dpar_set_error gives it its text). */
typedef dpar_status (*dpar_pool_run_fn)(void *user, int thread, int num_threads);

/* dpar_pool_run: run fn on all T threads at once and wait for all of them (how a thread-rank trainer starts).
   fn:       called on every thread; the caller is thread 0.
   Returns:  DPAR_OK; the error of the lowest-numbered failing thread, with its text in dpar_last_error;
             DPAR_EBUSY from one of the pool's own threads; DPAR_EINVAL (NULL pool or fn).
   Thread safety: any thread; concurrent callers from outside take turns.
   See:      docs/pool.md, 'SPMD run and barrier'. */
DPAR_API dpar_status dpar_pool_run(dpar_pool *pool, dpar_pool_run_fn fn, void *user);

/* dpar_pool_barrier: inside dpar_pool_run, wait until all T threads have called it.
   Returns:  DPAR_OK; DPAR_ESTATE (outside a run, or from a thread not in it), DPAR_EINVAL (NULL pool).
   Thread safety: the threads of the current run. */
DPAR_API dpar_status dpar_pool_barrier(dpar_pool *pool);

/* The parallel-region form (OpenMP's `#pragma omp parallel` with `#pragma omp for` inside): one dpar_pool_run
   runs a whole pass, and each loop inside it takes this thread's share of its range, then a barrier or none:

       for (dpar_share s = dpar_pool_share(pool, n, DPAR_SCHEDULE_DYNAMIC, 0); dpar_share_next(&s);)
           for (int64_t i = s.i; i < s.end; i++) y[i] = f(x[i]);
       dpar_pool_barrier(pool);                       // leave it out for OpenMP's nowait

   Collapsed ranges come back as start indices, one piece per run along the last dimension:

       for (dpar_share s = dpar_pool_share_2d(pool, B, T, DPAR_SCHEDULE_STATIC, 0); dpar_share_next(&s);)
           for (int64_t b = s.i, t = s.j; t < s.end; t++) out[b * T + t] = ...;

   See:      docs/openmp.md. */

/* dpar_schedule: how the iterations of a share are split among the threads of a run.
   DPAR_SCHEDULE_STATIC   grain 0: thread t gets the t-th of T near-equal contiguous blocks, as dpar_pool_for does
                          (and OpenMP's schedule(static)); grain g: chunks of g handed round-robin (static, g)
   DPAR_SCHEDULE_DYNAMIC  chunks of grain iterations in order to whichever thread asks (grain 0: n / (16 T), at
                          least 1), as dpar_pool_for_dynamic; one atomic compare-and-swap per chunk, no lock
   DPAR_SCHEDULE_GUIDED   chunks of ceil(remaining / T) iterations, never below grain (0: 1), as OpenMP's guided
   DPAR_SCHEDULE_STEAL    static blocks that even out: thread t starts on the t-th of T near-equal blocks and runs it
                          from the front in chunks of grain (0: a sixteenth of the block); a thread done with its
                          own takes the back half of what is left of the block with the most left, and so on. As
                          fast as static when the threads keep pace, as balanced as dynamic when one falls behind
                          (another job on its core, a slower loop before a nowait). One compare-and-swap per chunk
                          on the thread's own word. Which thread runs an iteration is not fixed: for loops whose
                          result does not depend on it (not a reduction's partial sums). */
typedef enum dpar_schedule {
    DPAR_SCHEDULE_STATIC = 0,
    DPAR_SCHEDULE_DYNAMIC = 1,
    DPAR_SCHEDULE_GUIDED = 2,
    DPAR_SCHEDULE_STEAL = 3
} dpar_schedule;

/* dpar_share: this thread's share of a 1-, 2- or 3-dimensional range, read one piece at a time by dpar_share_next.
   A piece runs along the last dimension: (i) .. (end - 1) for 1-D, (i, j) .. (i, end - 1) for 2-D, (i, j, k) ..
   (i, j, end - 1) for 3-D. Only i, j, k and end are to be read; the rest belongs to dpar_share_next. */
typedef struct dpar_share {
    int64_t i, j, k; /* where the current piece starts */
    int64_t end;     /* where it ends along the last dimension (exclusive) */
    struct {
        dpar_pool *pool;
        int64_t n1, n2, total, unit, grain, pos, stop, next;
        int dims, schedule, thread, nthreads;
        uint32_t tag;
    } dpar__state;
} dpar_share;

/* dpar_pool_share / _2d / _3d: begin this thread's share of the iterations [0, n) (of n0 x n1 or n0 x n1 x n2,
   row-major, collapsed into one range as OpenMP's collapse(2) and collapse(3) do).
   pool:     the pool whose dpar_pool_run is running on this thread; NULL, or a thread not inside a run of it, is a
             team of one that gets the whole range (as OpenMP's orphaned `omp for`).
   schedule: one of the four dpar_schedule values; any other is a programmer error (DPAR_ASSERT; with the check
             compiled out, the range runs once all the same, as a dynamic share).
   grain:    see dpar_schedule; it counts iterations of the collapsed range. Negative: 0.
   Returns:  the share; a range with a dimension of 0 or less is empty. The collapsed size must fit in int64_t
             (DPAR_ASSERT).
   Remarks:  every thread of the run must take the same sequence of dynamic, guided and steal shares (as every
             thread meets every `omp for`); a thread may run ahead into later shares without a barrier (nowait): a
             dynamic share is handed out from one shared word tagged with the share's number, a steal share from
             one word per thread tagged alike, so no share waits for another. The tag has 24 bits: no thread may
             begin 2^23 (8,388,608) or more such shares more than another thread of the run has (a barrier brings
             them level), or the one behind takes chunks of the wrong share. A thread that leaves a steal share's
             loop early leaves the rest of its block to the others, which take it only while they are in that
             share. No allocation, no lock. Static shares give each thread the same iterations as dpar_pool_for does.
   Thread safety: the threads of the current run, each with its own dpar_share.
   See:      docs/openmp.md. */
DPAR_API dpar_share dpar_pool_share(dpar_pool *pool, int64_t n, dpar_schedule schedule, int64_t grain);
DPAR_API dpar_share dpar_pool_share_2d(dpar_pool *pool, int64_t n0, int64_t n1, dpar_schedule schedule, int64_t grain);
DPAR_API dpar_share dpar_pool_share_3d(dpar_pool *pool, int64_t n0, int64_t n1, int64_t n2, dpar_schedule schedule,
                                       int64_t grain);

/* dpar_share_next: move to the next piece of the share.
   Returns:  1 with share->i, j, k and end set to the piece; 0 when the share is done.
   Thread safety: the thread that began the share. */
DPAR_API int dpar_share_next(dpar_share *share);

/* dpar_pool_op: the reductions of dpar_pool_reduce_*. */
typedef enum dpar_pool_op { DPAR_POOL_SUM = 0, DPAR_POOL_MAX = 1, DPAR_POOL_MIN = 2 } dpar_pool_op;

/* DPAR_POOL_REDUCE_MAX: the most elements one dpar_pool_reduce_* call combines. */
#define DPAR_POOL_REDUCE_MAX 64

/* dpar_pool_reduce_f32 / _f64 / _i64: combine inout[0..count) of every thread of the run, element by element, and
   give every thread the result (OpenMP's reduction clause, as one call after the loop).
   op:       DPAR_POOL_SUM, DPAR_POOL_MAX or DPAR_POOL_MIN.
   Returns:  DPAR_OK; DPAR_EINVAL (count negative, NULL inout with count > 0, a bad op), DPAR_ERANGE (count above
             DPAR_POOL_REDUCE_MAX). NULL pool or a thread outside a run: a team of one, inout unchanged.
   Remarks:  the result is ((v0 op v1) op v2) ... in thread order, the same bits on every thread and in every run with
             the same thread count. Every thread of the run must call it with the same count, type and op (it waits for
             all of them, as a barrier does); a failed check fails on every thread alike. MAX and MIN compare with C's
             `>` and `<` (a NaN is kept only if it comes first). No allocation: each thread has room for
             DPAR_POOL_REDUCE_MAX elements of 8 bytes, twice, so one barrier per call suffices.
   Thread safety: the threads of the current run. */
DPAR_API dpar_status dpar_pool_reduce_f32(dpar_pool *pool, float *inout, int count, dpar_pool_op op);
DPAR_API dpar_status dpar_pool_reduce_f64(dpar_pool *pool, double *inout, int count, dpar_pool_op op);
DPAR_API dpar_status dpar_pool_reduce_i64(dpar_pool *pool, int64_t *inout, int count, dpar_pool_op op);

/* dpar_task: a task's handle; never 0, valid until dpar_task_wait_all returns.
   dpar_task_fn: a task's body; returns DPAR_OK or an error, which cancels every task that depends on it.
   See:      docs/pool.md, 'Task graph'. */
typedef uint64_t dpar_task;
typedef dpar_status (*dpar_task_fn)(void *user);

typedef struct dpar_task_desc {
    dpar_task_fn fn;       /* required */
    void *user;            /* passed to fn */
    const dpar_task *deps; /* tasks that must finish first (num_deps of them); may repeat */
    int num_deps;
    const char *name; /* trace event name; not copied, must outlive the task (default "task") */
} dpar_task_desc;

typedef enum dpar_task_state {
    DPAR_TASK_PENDING = 0,  /* waiting for dependencies, queued or running */
    DPAR_TASK_DONE = 1,     /* ran and returned DPAR_OK */
    DPAR_TASK_FAILED = 2,   /* ran and returned an error */
    DPAR_TASK_CANCELLED = 3 /* never ran: a dependency failed or the pool was destroyed */
} dpar_task_state;

/* dpar_task_submit: add a task; it runs once all its dependencies are done.
   desc:     a dependency that already failed cancels the task at once.
   out:      NULL, or where the task's handle goes.
   Returns:  DPAR_OK; DPAR_EINVAL (a bad description, or a dependency that is not a live task of this pool),
             DPAR_ECANCELED (the pool is being destroyed), DPAR_ERANGE (2^31 tasks or dependencies in one
             epoch), DPAR_ENOMEM.
   Thread safety: any thread, tasks too. */
DPAR_API dpar_status dpar_task_submit(dpar_pool *pool, const dpar_task_desc *desc, dpar_task *out);

/* dpar_task_wait: wait for one task.
   Returns:  the task's status; for a cancelled task the failed dependency's, with the story in
             dpar_last_error. DPAR_EDEADLK from inside a task that waits on itself or on a task that depends
             on it; DPAR_EINVAL (NULL pool, or not a live task of this pool).
   Remarks:  while it waits, a thread outside any task runs ready tasks; a task runs only the awaited one (once
             it is ready).
   Thread safety: any thread, tasks too. */
DPAR_API dpar_status dpar_task_wait(dpar_pool *pool, dpar_task task);

/* dpar_task_state_of: the state of a live task.
   Returns:  its state; DPAR_TASK_PENDING for a bad handle, with dpar_last_error set.
   Thread safety: any thread. */
DPAR_API dpar_task_state dpar_task_state_of(dpar_pool *pool, dpar_task task);

/* dpar_task_wait_all: wait for every task submitted so far, running ready tasks meanwhile, then end the epoch.
   Returns:  DPAR_OK, or the status of the first task that failed (in submission order); DPAR_EBUSY from the
             pool's own threads or a task; DPAR_EINVAL (NULL pool).
   Remarks:  ending the epoch makes every handle invalid and reuses the task records.
   Thread safety: any thread outside the pool; tasks submitted meanwhile by others are waited for too. */
DPAR_API dpar_status dpar_task_wait_all(dpar_pool *pool);

#ifdef __cplusplus
} /* extern "C": the lambda overloads are C++ templates */

/* C++ overloads that take a lambda (or any callable) instead of a function and its user pointer; header-only, the
   callable is passed by address (no copy, no allocation), through a captureless trampoline.
     dpar_pool_for(pool, n, f), dpar_pool_for_dynamic(pool, n, grain, f): f(int64_t begin, int64_t end, int thread)
             or f(int64_t i), called for each index;
     dpar_pool_run(pool, f): f(int thread, int num_threads), returning dpar_status or void (void: DPAR_OK).
   Returns and thread safety: as the C calls. */
template <class T> struct dpar__noref {
    typedef T type;
};
template <class T> struct dpar__noref<T &> {
    typedef T type;
};
template <class F>
inline auto dpar__call_range(F &f, int64_t begin, int64_t end, int thread, int)
    -> decltype(f(begin, end, thread), void())
{
    f(begin, end, thread);
}
template <class F> inline void dpar__call_range(F &f, int64_t begin, int64_t end, int, long)
{
    for (; begin < end; begin++) f(begin);
}
template <class F>
inline auto dpar__call_run(F &f, int thread, int num_threads, int)
    -> decltype(static_cast<dpar_status>(f(thread, num_threads)))
{
    return static_cast<dpar_status>(f(thread, num_threads));
}
template <class F> inline dpar_status dpar__call_run(F &f, int thread, int num_threads, long)
{
    f(thread, num_threads);
    return DPAR_OK;
}
template <class F> inline void dpar__range_trampoline(void *user, int64_t begin, int64_t end, int thread)
{
    dpar__call_range(*static_cast<F *>(user), begin, end, thread, 0);
}
template <class F> inline dpar_status dpar__run_trampoline(void *user, int thread, int num_threads)
{
    return dpar__call_run(*static_cast<F *>(user), thread, num_threads, 0);
}
template <class F> inline dpar_status dpar_pool_for(dpar_pool *pool, int64_t n, F &&f)
{
    typedef typename dpar__noref<F>::type G;
    return dpar_pool_for(pool, n, &dpar__range_trampoline<G>, const_cast<void *>(static_cast<const void *>(&f)));
}
template <class F> inline dpar_status dpar_pool_for_dynamic(dpar_pool *pool, int64_t n, int64_t grain, F &&f)
{
    typedef typename dpar__noref<F>::type G;
    return dpar_pool_for_dynamic(pool, n, grain, &dpar__range_trampoline<G>,
                                 const_cast<void *>(static_cast<const void *>(&f)));
}
template <class F> inline dpar_status dpar_pool_run(dpar_pool *pool, F &&f)
{
    typedef typename dpar__noref<F>::type G;
    return dpar_pool_run(pool, &dpar__run_trampoline<G>, const_cast<void *>(static_cast<const void *>(&f)));
}

extern "C" {
#endif

/* ============================================================================================== */
/* >>dtype: element types, ops, call kinds, block ranges, bf16/f16, the fixed tree               */
/* ============================================================================================== */
typedef enum dpar_dtype {
    DPAR_F32 = 0,
    DPAR_F64 = 1,
    DPAR_I32 = 2,
    DPAR_I64 = 3,
    DPAR_BF16 = 4, /* stored as uint16_t; reduced in float, rounded to nearest even */
    DPAR_F16 = 5,  /* IEEE half, stored as uint16_t; reduced in float */
    DPAR_U8 = 6,   /* bytes; reductions wrap */
    DPAR_DTYPE_COUNT = 7
} dpar_dtype;

typedef enum dpar_op {
    DPAR_SUM = 0,
    DPAR_AVG = 1, /* the sum divided by N (integer division for integer types) */
    DPAR_MIN = 2,
    DPAR_MAX = 3,
    DPAR_PROD = 4,
    DPAR_OP_COUNT = 5
} dpar_op;

/* dpar_coll: the calls the counters and the contract checker know. */
typedef enum dpar_coll {
    DPAR_COLL_SEND = 0,
    DPAR_COLL_RECV,
    DPAR_COLL_BARRIER,
    DPAR_COLL_BROADCAST,
    DPAR_COLL_REDUCE,
    DPAR_COLL_REDUCE_SCATTER,
    DPAR_COLL_ALLGATHER,
    DPAR_COLL_ALLREDUCE,
    DPAR_COLL_ALLTOALL,
    DPAR_COLL_SPLIT,
    DPAR_COLL_ALLTOALLV, /* after split: the values before it stay what they were */
    DPAR_COLL_COUNT
} dpar_coll;

/* dpar_dtype_size / dpar_dtype_name / dpar_op_name / dpar_coll_name: an element's size; the enums' names.
   Returns:  size: bytes per element, 0 for a bad dtype. The names: "f32", "sum", "allreduce"; "?" when out
             of range.
   Thread safety: any thread. */
DPAR_API size_t dpar_dtype_size(dpar_dtype dtype);
DPAR_API const char *dpar_dtype_name(dpar_dtype dtype);
DPAR_API const char *dpar_op_name(dpar_op op);
DPAR_API const char *dpar_coll_name(dpar_coll coll);

/* dpar_block_range: block `index` of `count` elements cut into `parts` near-equal contiguous blocks.
   offset, length: the block's first element and its length. The first count % parts blocks are one longer.
   Remarks:  the partition of reduce_scatter, allgather and the ring.
   Thread safety: any thread. */
DPAR_API void dpar_block_range(size_t count, int parts, int index, size_t *offset, size_t *length);

/* dpar_bf16_to_f32 / dpar_f32_to_bf16 / dpar_f16_to_f32 / dpar_f32_to_f16: the conversions the reductions use.
   Rounding: to 16 bits, to nearest even.
   Thread safety: any thread. */
DPAR_API float dpar_bf16_to_f32(uint16_t h);
DPAR_API uint16_t dpar_f32_to_bf16(float f);
DPAR_API float dpar_f16_to_f32(uint16_t h);
DPAR_API uint16_t dpar_f32_to_f16(float f);

/* dpar_tree_reduce: out = the leaves combined in the fixed binary tree of the deterministic mode.
   Tree:     tree(lo, hi) = tree(lo, mid) op tree(mid, hi), mid = lo + (hi - lo) / 2. A rank that owns leaves
             [r*L/N, (r+1)*L/N) calls it on them, then a deterministic allreduce with DPAR_SUM finishes the
             same tree.
   out:      may be one of the leaves.
   Returns:  DPAR_OK; DPAR_EINVAL (bad dtype or op, no leaves, a NULL out or leaf).
   Thread safety: any thread.
   See:      docs/comm.md, 'Determinism'. */
DPAR_API dpar_status dpar_tree_reduce(void *out, const void *const *leaves, int num_leaves, size_t count,
                                      dpar_dtype dtype, dpar_op op);

/* ============================================================================================== */
/* >>comm: communicator, point-to-point, collectives, async requests, split and mesh              */
/* ============================================================================================== */
/* dpar_comm: one rank of a group of N ranks; every call below works the same on every transport.
   Transports: thread ranks of one process meet at a dpar_group; other transports (MPI, NCCL) make comms of
             their own.
   Calls:    collectives take the comm first, then MPI/NCCL's names and order.
   Contract: every rank of a comm calls the same collectives in the same order with the same count, dtype,
             op and root. dpar checks it (unless no_check): a disagreement returns DPAR_EMISMATCH on every
             rank, with a message naming both sides and their source lines.
   Timeout:  every blocking call gives up after the comm's timeout (30 s by default) with DPAR_ETIMEDOUT,
             naming the ranks that never arrived.
   Poison:   after either error, or dpar_comm_abort, every call on the group returns that error: destroy the
             group and start again (as with NCCL's ncclCommAbort).
   Counts:   elements. For reduce_scatter and allgather `count` is the TOTAL count; rank r owns block r of
             dpar_block_range(count, N, r, ...), so any count works (0, less than N, not divisible by N).
   Results:  bitwise identical on every rank and from run to run: the order in which the inputs of each
             element are combined depends only on N. With `deterministic`, allreduce combines them in the
             fixed binary tree that dpar_tree_reduce also follows: a sum over L leaves has the same bits for
             N = 1, 2, 4, 8 ranks; reduce_scatter too (it runs that allreduce and keeps its block: twice the
             bytes of the ring's), so ZeRO and FSDP give the bits of the deterministic allreduce.
   See:      docs/comm.md ('The calls', 'The contract checker', 'Determinism'). */

typedef struct dpar_group dpar_group;
typedef struct dpar_comm dpar_comm;
typedef struct dpar_request dpar_request;

/* dpar_comm_memory: callbacks for a thread group whose ranks keep the buffers of their comm calls where the host
   cannot read them (GPU memory: dpar_cuda.h fills one for its workers). dpar still runs everything else on the ranks'
   threads (the algorithms and their segments, the contract checker, timeouts, poison, counters, trace); these
   callbacks do everything that reads or writes the buffers' bytes.
   worker:   the rank the calling thread's comm joined its group with (dpar_group_join); a comm split from it keeps it.
   Calls:    each runs on a thread acting for `worker` (its own, or its progress thread for an async request) and
             returns once its result is complete and readable by every other rank. On failure it returns the status
             with a text set by dpar_set_error; dpar then poisons the group with that text, so every rank returns.
     enter(user, worker)                 a comm call of this rank starts: make its inputs ready (optional)
     reduce(user, worker, out, a, b, n, dtype, op, div)  out = a op b elementwise, then / div when op is DPAR_AVG
                                         and div > 1 (dpar's rounding); a or b may be a peer's buffer; out may be a or b
     divide(user, worker, out, in, n, dtype, div)        out = in / div (div <= 1: a copy); out may be in
     copy(user, worker, dst, src, bytes) dst = src, either on any rank; no overlap
     peer_access(user, worker, peer)     1: reduce may read peer's buffers directly; 0: dpar first copies them into
                                         this rank's staging memory with copy (optional; NULL: 1)
     alloc(user, worker, bytes), free(user, worker, p)   this rank's scratch and staging memory, kept until the comm
                                         is destroyed (grown on demand: no allocation per call once warm)
   Stream-ordered (record and wait set, both or neither): reduce, divide and copy may return as soon as their work
             is queued on the worker's stream (a CUDA stream: in order, later), as NCCL does; dpar then orders the
             streams with events instead of the host waiting for each step:
     record(user, worker, &ticket)       a point in the worker's stream after everything queued so far (a CUDA event
                                         recorded there); ticket, nonzero, names it. Called before each offer of a
                                         buffer to a peer (its bytes are written once the ticket's point is reached)
                                         and each time this rank is done reading a peer's buffer (its "read done")
     wait(user, worker, peer, ticket)    the worker's stream waits for peer's ticket (cudaStreamWaitEvent): before
                                         this rank reads an offer, and before it writes again into a buffer that a
                                         peer's stream read (the peer's "read done", seen when dpar waits for it).
                                         A later ticket of the same stream may stand in for an earlier one.
             A comm call then returns with its work queued: the results are the stream's, like ncclAllReduce's; every
             peer's reads of this rank's buffers are behind this rank's stream too, so synchronising it (or an event
             after the call) is all a caller needs before the host or another stream touches the buffers. Errors
             that the callbacks see later (a queued kernel that failed) come back from the next callback.
   For dpar_zero and dpar_fsdp on such a comm (optional; without them they return DPAR_EUNSUPPORTED), queued on the
             worker's stream like the others when the memory is stream-ordered:
     clear(user, worker, p, bytes)       p's bytes = 0 (cudaMemsetAsync)
     update(user, worker, u)             one optimizer step on u->n elements of this rank's memory, the math that
                                         dpar_optim_update states, every operation rounded on its own
   For their checkpoints (optional, both or neither; without them dpar_ckpt_save_zero / _fsdp and the loads return
             DPAR_EUNSUPPORTED on such a comm), each returning once the bytes are where they go:
     to_host(user, worker, host, dev, bytes)    host = dev, after the worker's queued work (cudaMemcpy D2H)
     from_host(user, worker, dev, host, bytes)  dev = host, after the worker's queued work (cudaMemcpy H2D)
   For the one-shot allreduce (optional; without it dpar combines with reduce: N(N-1) calls, a launch each):
     combine(user, worker, out, in, ranks, lo, n, count, dtype, op)   out[i] for i < n = element lo + i of a
                                         count-element allreduce over ranks inputs (in[q]: rank q's, from element
                                         lo; host array, read before the call returns), combined in the ring's order
                                         (dpar_algo's "Results": acc = in[c+1], then acc = in[c+j] op acc for
                                         j = 2..ranks, each step as reduce's; AVG divides by ranks at the last step).
                                         out is none of the inputs; ranks <= DPAR_COMBINE_MAX_RANKS (more: reduce)
   Required: reduce, divide, copy, alloc and free, all or none (none: host memory, the default).
   Remarks:  such a group has none of the shared-memory speed-ups (direct buckets and dpar_steal return
             DPAR_EUNSUPPORTED on it), and only thread groups take one (MPI comms return DPAR_EUNSUPPORTED). dpar's
             layers that compute on the host (dpar_linear, the pipeline runner, shard plans, checkpoints) are for
             host buffers; dpar_zero and dpar_fsdp compute through clear and update (their f32 flat forms) and
             checkpoint through to_host and from_host.
   See:      docs/comm.md, 'Buffers in device memory'; docs/cuda.md. */
typedef struct dpar_optim_update dpar_optim_update;
typedef struct dpar_comm_memory {
    void *user;
    dpar_status (*enter)(void *user, int worker);
    dpar_status (*reduce)(void *user, int worker, void *out, const void *a, const void *b, size_t n, dpar_dtype dtype,
                          dpar_op op, int div);
    dpar_status (*divide)(void *user, int worker, void *out, const void *in, size_t n, dpar_dtype dtype, int div);
    dpar_status (*copy)(void *user, int worker, void *dst, const void *src, size_t bytes);
    int (*peer_access)(void *user, int worker, int peer);
    void *(*alloc)(void *user, int worker, size_t bytes);
    void (*free)(void *user, int worker, void *p);
    dpar_status (*record)(void *user, int worker, uint64_t *ticket); /* stream-ordered: both or neither */
    dpar_status (*wait)(void *user, int worker, int peer, uint64_t ticket);
    dpar_status (*clear)(void *user, int worker, void *p, size_t bytes); /* dpar_zero, dpar_fsdp: both or neither */
    dpar_status (*update)(void *user, int worker, const dpar_optim_update *u);
    dpar_status (*to_host)(void *user, int worker, void *host, const void *dev, size_t bytes); /* both or neither */
    dpar_status (*from_host)(void *user, int worker, void *dev, const void *host, size_t bytes);
    dpar_status (*combine)(void *user, int worker, void *out, const void *const *in, int ranks, size_t lo, size_t n,
                           size_t count, dpar_dtype dtype, dpar_op op); /* optional: one-shot's combine */
} dpar_comm_memory;
/* the most inputs dpar_comm_memory.combine is given (a kernel's parameters hold their pointers) */
#define DPAR_COMBINE_MAX_RANKS 64
/* dpar_algo: the allreduce algorithms (dpar_comm_desc.algo, DPAR_ALGO=ring|oneshot|slice, the counters and trace).
   AUTO     by size and rank count: thread ranks one-shot up to DPAR_ONESHOT_MAX_BYTES (twice that on more
            than 2 ranks), reduce-by-slice
            from DPAR_SLICE_MIN_BYTES, the ring between, and on 2 ranks the ring from DPAR_RING_MIN_BYTES
            until streaming stores apply; MPI: all processes on one node, one-shot through the block they
            share up to DPAR_SHM_ONESHOT_MAX_BYTES (on 2 processes up to DPAR_SHM_TWO_MAX_BYTES, 16 MiB),
            else one-shot over messages up to DPAR_MSG_ONESHOT_MAX_BYTES; the ring above (or MPI's own with
            dpar_comm_desc.native)
   RING     reduce-scatter then all-gather around the ring, 2(N-1) steps (every transport)
   ONESHOT  one step instead of 2(N-1), for small messages. Thread ranks: each rank copies its input to
            memory the ranks share, then reduces the whole message reading every rank's copy. Other
            transports: each rank sends its input to every other and reduces what it receives.
   SLICE    thread ranks (elsewhere the ring): rank r reduces block r reading all N inputs where they are,
            then every rank copies the other blocks from their owners' recv: three meetings, less memory
            traffic than the ring for N > 2; streaming stores for destinations larger than the LLC
   TREE     the deterministic mode's (dpar_comm_desc.deterministic; not chosen by algo)
   NATIVE   the transport's own collective (MPI's, dpar_comm_desc.native)
   Results: every algorithm combines the inputs of element i in the ring's order, so all give the same bits:
            for i in block c of dpar_block_range(count, N, c), acc = x[c+1], then acc = x[c+j] op acc for
            j = 2..N (ranks mod N; AVG divides at the last step). The tree keeps its own, N-independent order.
   See:     docs/comm.md, 'Algorithms'. */
typedef enum dpar_algo {
    DPAR_ALGO_AUTO = 0,
    DPAR_ALGO_RING = 1,
    DPAR_ALGO_ONESHOT = 2,
    DPAR_ALGO_SLICE = 3,
    DPAR_ALGO_TREE = 4,
    DPAR_ALGO_NATIVE = 5,
    DPAR_ALGO_COUNT = 6
} dpar_algo;

/* dpar_algo_name: "auto", "ring", "oneshot", "slice", "tree", "native"; "?" when out of range.
   Thread safety: any thread. */
DPAR_API const char *dpar_algo_name(dpar_algo algo);

/* dpar_comm_desc: how to make a group (and its comms); a zero field means its default. */
typedef struct dpar_comm_desc {
    int size;                 /* ranks in the group (threads transport; required, 1..DPAR_MAX_THREADS) */
    int timeout_ms;           /* blocking calls give up after this; 0: DPAR_TIMEOUT_MS (environment), else
                             DPAR_TIMEOUT_MS_DEFAULT (30000); -1: never */
    int no_check;             /* 1: skip the contract checker's fingerprints */
    int deterministic;        /* 1: allreduce in the fixed tree order (N must be a power of two) */
    size_t segment_bytes;     /* pipeline segment of the ring algorithms (0: 128 KiB; MPI: 1 MiB) */
    int spin_us;              /* waits spin this long before sleeping; 0: DPAR_SPIN_US, -1: no spin */
    const char *name;         /* trace and error prefix (copied; default "comm") */
    int native;               /* MPI: use MPI's own collectives for the dtypes MPI has (not bf16/f16) */
    int algo;                 /* allreduce algorithm (dpar_algo); 0: DPAR_ALGO (environment), else by size */
    dpar_allocator allocator; /* the group's and its comms' memory (zero: malloc/free) */
    dpar_comm_memory memory;  /* thread groups: where the ranks' buffers live (zero: host memory) */
    dpar_pool *pool;          /* thread groups, optional: the pool whose threads join the ranks (dpar_pool_run runs
                                 one rank per thread): dpar_group_create refuses one with fewer threads than ranks */
} dpar_comm_desc;

/* dpar_group_create: make the meeting point of `desc->size` thread ranks; each rank's thread then joins it.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL desc or out, size < 1, timeout_ms or spin_us below -1, algo not
             auto, ring, oneshot or slice, half an allocator, a desc.pool with fewer threads than size: its ranks
             could never all join), DPAR_ERANGE (size above DPAR_MAX_THREADS),
             DPAR_EUNSUPPORTED (deterministic with a size that is not a power of two), DPAR_ENOMEM.
   Remarks:  the group lives until it is destroyed and its last comm is destroyed.
   Thread safety: any thread.
   See:      docs/comm.md, 'Thread ranks: a whole program'. */
DPAR_API dpar_status dpar_group_create(const dpar_comm_desc *desc, dpar_group **out);
/* dpar_group_destroy: drop the creator's reference.
   Returns:  DPAR_OK (also for NULL).
   Thread safety: any thread, once. */
DPAR_API dpar_status dpar_group_destroy(dpar_group *group);

/* dpar_group_join: make the comm of rank `rank` of `group`.
   Remarks:  it returns at once; the first collective meets the others.
   rank:     0..size-1, each rank once, from the thread that will use it.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL group or out, rank out of range), DPAR_EBUSY (the rank has already
             joined), DPAR_ENOMEM. On error *out is NULL.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_group_join(dpar_group *group, int rank, dpar_comm **out);
/* dpar_comm_destroy: leave the group, after waiting for this rank's async requests (not collective). A
   poisoned comm over MPI keeps its MPI communicator, unused, until MPI_Finalize: messages of the calls
   it gave up on may be in flight, and a freed communicator's context id goes to the next one made.
   Returns:  DPAR_OK (also for NULL).
   Thread safety: the comm's thread, with nothing of this comm in flight. */
DPAR_API dpar_status dpar_comm_destroy(dpar_comm *comm);
/* dpar_comm_rank / dpar_comm_size: this rank's index in the comm; the number of ranks N.
   Returns:  rank: 0..N-1, -1 for NULL. size: N, 0 for NULL.
   Thread safety: any thread. */
DPAR_API int dpar_comm_rank(const dpar_comm *comm);
DPAR_API int dpar_comm_size(const dpar_comm *comm);
/* dpar_comm_query: the options really used.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL comm or used).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_comm_query(const dpar_comm *comm, dpar_comm_desc *used);
/* dpar_comm_abort: poison the group: every rank's blocking call returns DPAR_EABORTED, now and later.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL comm).
   Thread safety: any thread, also one that is not a rank. */
DPAR_API dpar_status dpar_comm_abort(dpar_comm *comm);
/* dpar_comm_fail: a rank failed on its own (a device fault, bad data): poison the group with `why` and `msg`, so every
   rank's blocking call returns `why` with msg (prefixed by this rank's name), now and later, instead of waiting for it.
   Returns:  the group's poison: `why`, or an earlier poison, which wins; DPAR_EINVAL (NULL comm, why DPAR_OK).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_comm_fail(dpar_comm *comm, dpar_status why, const char *msg);

/* dpar_comm_ops: a comm whose collectives another library carries out (dpar_cuda.h's NCCL comm). dpar keeps the
   front end: argument checks, the contract checker (each call's fingerprint allgathered through `exchange` and
   compared on every rank before `run`), the sequence numbers, counters, trace spans, async requests and poison.
     run(user, call)          carry out one collective (never point-to-point), every rank's in the same order;
                              return its status (its text by dpar_set_error) by call->deadline_ns (0: none)
     exchange(user, mine, all, bytes, deadline_ns)   an allgather of `bytes` host bytes per rank into `all`
                              (rank q's at all + q * bytes); required unless desc->no_check
     destroy(user)            the comm is destroyed (may be NULL)
     run_group(user, calls, n)   optional: carry out a batch's n calls together (NCCL: one ncclGroupStart/End),
                              in order; return the first failure (dpar_batch_end). NULL: run, call by call
   Remarks:  on such a comm point-to-point calls and dpar_comm_split return DPAR_EUNSUPPORTED, and run receives every
             collective, also on one rank. Poison is this rank's alone: other ranks learn of a failure from the
             library (or their deadline).
   See:      docs/comm.md, 'Comms run by another library'. */
typedef struct dpar_comm_call {
    dpar_coll coll; /* DPAR_COLL_BARRIER ... DPAR_COLL_ALLTOALL, DPAR_COLL_ALLTOALLV */
    const void *send;
    void *recv;
    size_t count; /* as the collective's own (total for reduce_scatter and allgather, per peer for alltoall);
                     alltoallv: the elements this rank sends plus those it receives (0: nothing to do here) */
    dpar_dtype dtype;
    dpar_op op;
    int root;
    uint64_t seq;         /* this comm's collective number, from 1 */
    uint64_t deadline_ns; /* absolute dpar_time_ns() by which to give up; 0: never */
    const char *file;     /* the caller's source line */
    int line;
    /* alltoallv: N entries each, in elements; the displacements as resolved (never NULL); host memory, valid
       during run. Checked already: what rank i sends to j is what j receives from i. Other calls: NULL. */
    const size_t *sendcounts, *sdispls, *recvcounts, *rdispls;
} dpar_comm_call;
typedef struct dpar_comm_ops {
    void *user;
    int rank, size; /* required: this rank, the number of ranks */
    dpar_status (*run)(void *user, const dpar_comm_call *call);
    dpar_status (*exchange)(void *user, const void *mine, void *all, size_t bytes, uint64_t deadline_ns);
    void (*destroy)(void *user);
    dpar_status (*run_group)(void *user, const dpar_comm_call *calls, int n);
} dpar_comm_ops;
/* dpar_comm_from_ops: make this rank's comm over ops (copied).
   desc->memory: where the library's buffers are, when the host cannot read them (NCCL's: device memory): reduce,
             divide, copy, alloc, free, clear and update, all or none, no record, wait or peer_access; to_host and
             from_host with them for checkpoints (optional). The collectives are the library's; only dpar_zero and
             dpar_fsdp use them, for their own buffers, steps and checkpoints.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL ops or out, no run, no exchange with the checker on, rank outside 0..size-1, a
             desc deterministic (the library decides the order), memory callbacks incomplete), DPAR_ENOMEM. On error
             *out is NULL and ops->destroy has not been called.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_comm_from_ops(const dpar_comm_ops *ops, const dpar_comm_desc *desc, dpar_comm **out);

/* dpar_batch_begin / dpar_batch_end: the collectives this rank calls on comm between them are one batch, as between
   ncclGroupStart and ncclGroupEnd. On a comm another library runs (dpar_comm_from_ops: NCCL) each call only checks
   its arguments and is recorded; dpar_batch_end checks the whole batch with one exchange (the calls' count and a
   hash of their fingerprints; only when they differ, one exchange per call up to the first difference, to name it)
   and hands the calls to the library together (ops.run_group: one NCCL group). On other comms each call runs when
   it is made, as always, so a program written for the batch works on every comm.
   Rules:    a batched call's buffers are not to be read or written until dpar_batch_end has returned; every rank
             batches the same calls in the same order; inside a batch: no async call (dpar_i..., DPAR_EINVAL), no
             nested batch, and on a library's comm no alltoallv (DPAR_EUNSUPPORTED).
   Returns:  begin: DPAR_OK; DPAR_EINVAL (NULL comm, a batch open already). end: DPAR_OK; DPAR_EINVAL (no batch open);
             DPAR_EMISMATCH (every rank: the first call where two ranks' batches differ, naming both, or a rank whose
             batch ended sooner); the library's and the comm's errors. After an error the batch is closed.
   Thread safety: the comm's thread.
   See:      docs/comm.md, 'Batches'. */
DPAR_API dpar_status dpar_batch_begin(dpar_comm *comm);
DPAR_API dpar_status dpar_batch_end(dpar_comm *comm);

/* dpar_send / dpar_recv / dpar_sendrecv: point-to-point messages, which arrive in order between two ranks.
   Macros:   the names below; they call these _at functions with the caller's file and line.
   count, tag: the receiver's must equal the sender's (checked).
   Returns:  DPAR_OK; DPAR_EMISMATCH (count or tag differ), DPAR_EDEADLK (a send to oneself: use
             dpar_sendrecv); the comm's errors (see dpar_comm).
   Remarks:  dpar_send is synchronous: it returns when the receiver has the data.
   Thread safety: the comm's thread. */
DPAR_API dpar_status dpar_send_at(dpar_comm *comm, const void *buf, size_t count, dpar_dtype dtype, int peer, int tag,
                                  const char *file, int line);
DPAR_API dpar_status dpar_recv_at(dpar_comm *comm, void *buf, size_t count, dpar_dtype dtype, int peer, int tag,
                                  const char *file, int line);
DPAR_API dpar_status dpar_sendrecv_at(dpar_comm *comm, const void *sendbuf, size_t sendcount, int dst, void *recvbuf,
                                      size_t recvcount, int src, dpar_dtype dtype, int tag, const char *file, int line);

/* dpar_barrier, _broadcast, _reduce, _reduce_scatter, _allgather, _allreduce, _alltoall: the collectives.
   Macros:   the names below; they call these _at functions with the caller's file and line.
   send, recv: `send == recv` is in place; other overlaps are DPAR_EINVAL. broadcast: root's send goes to
             every recv. reduce: the result lands in root's recv (others' recv may be NULL). alltoall: `count`
             elements from each rank to each rank (send and recv hold N * count).
   Returns:  DPAR_OK; DPAR_EINVAL (bad arguments, buffers that overlap); the comm's errors (see dpar_comm).
   Thread safety: the comm's thread. On a comm with pending async requests a blocking call first waits for
             them, so the order of calls is kept.
   See:      docs/comm.md, 'The calls'. */
DPAR_API dpar_status dpar_barrier_at(dpar_comm *comm, const char *file, int line);
DPAR_API dpar_status dpar_broadcast_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                       int root, const char *file, int line);
DPAR_API dpar_status dpar_reduce_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                    dpar_op op, int root, const char *file, int line);
DPAR_API dpar_status dpar_reduce_scatter_at(dpar_comm *comm, const void *send, void *recv, size_t count,
                                            dpar_dtype dtype, dpar_op op, const char *file, int line);
DPAR_API dpar_status dpar_allgather_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                       const char *file, int line);
DPAR_API dpar_status dpar_allreduce_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                       dpar_op op, const char *file, int line);
DPAR_API dpar_status dpar_alltoall_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                      const char *file, int line);

/* dpar_alltoallv / dpar_ialltoallv / dpar_alltoallv_counts: all-to-all with a count per peer (MPI_Alltoallv).
   Macros:   the names below; they call these _at functions with the caller's file and line.
   sendcounts[q], sdispls[q]: rank q gets sendcounts[q] elements from send + sdispls[q] (elements);
   recvcounts[q], rdispls[q]: what rank q sends lands at recv + rdispls[q]. Arrays of N entries, host memory.
             sdispls / rdispls NULL: packed, each the sum of the counts before it. Send blocks may overlap; recv
             blocks may not. Not in place: send and recv must not overlap (DPAR_EINVAL).
   Checked:  what rank i sends to j must be what j expects from i; else every rank returns DPAR_EMISMATCH with
             "rank i sends 5 elements to rank j in alltoallv #3 at a.c:10 but rank j expects 4 from rank i
             (alltoallv #3 at a.c:12)". No all-gather: each message carries its pair's count, checked by the
             receiver before it reads, then a dissemination (log2 N empty rounds) so no rank returns before all
             have checked (with no_check a byte mismatch is still caught, without the dissemination).
   counts:   dpar_alltoallv_counts gives recvcounts[q] = rank q's sendcounts[this rank] (an alltoall of one size_t
             per peer in host memory, counted as an alltoall), for callers that know only what they send.
   ialltoallv: as dpar_iallreduce; the four arrays are copied at the call (the caller may free them at once),
             send and recv belong to dpar until the request finishes.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL counts, a NULL buffer where a count is not 0, a count or displacement
             whose bytes overflow size_t, recv blocks that overlap, send and recv that overlap, sendcounts ==
             recvcounts for _counts); DPAR_EMISMATCH; the comm's errors (see dpar_comm).
   Remarks:  every dtype; thread ranks copy straight from the sender's buffer; MPI comms with native use
             MPI_Alltoallv (dtypes MPI has, every rank's counts and displacements fit an int; else the pairwise
             rounds);
             processes of one node meet in their shared block (the counts checked there), where parts larger
             than its staging buffers go in one MPI_Ialltoallv of bytes.
   Thread safety: the comm's thread; collective.
   See:      docs/comm.md, 'Alltoallv'. */
DPAR_API dpar_status dpar_alltoallv_at(dpar_comm *comm, const void *send, const size_t *sendcounts,
                                       const size_t *sdispls, void *recv, const size_t *recvcounts,
                                       const size_t *rdispls, dpar_dtype dtype, const char *file, int line);
DPAR_API dpar_status dpar_ialltoallv_at(dpar_comm *comm, const void *send, const size_t *sendcounts,
                                        const size_t *sdispls, void *recv, const size_t *recvcounts,
                                        const size_t *rdispls, dpar_dtype dtype, dpar_request **req, const char *file,
                                        int line);
DPAR_API dpar_status dpar_alltoallv_counts_at(dpar_comm *comm, const size_t *sendcounts, size_t *recvcounts,
                                              const char *file, int line);

/* dpar_iallreduce / dpar_ireduce_scatter / dpar_iallgather: start an asynchronous collective.
   Macros:   the names below; they call these _at functions with the caller's file and line.
   req:      set at once; finish it with dpar_request_wait or dpar_request_test.
   send, recv: they belong to dpar until dpar_request_wait returns, or dpar_request_test says done.
   Returns:  DPAR_OK (the collective's own status comes from dpar_request_wait / _test); DPAR_EINVAL (NULL req,
             bad arguments, buffers that overlap), DPAR_EUNSUPPORTED (an MPI comm without MPI_THREAD_MULTIPLE),
             DPAR_ENOMEM, DPAR_ESYSTEM (the progress thread could not start); the comm's errors (see dpar_comm).
   Remarks:  requests of one comm run in the order they were made, on a progress thread of the rank; on a comm
             of one rank, at once, on the calling thread (no thread is started).
   Thread safety: the comm's thread.
   See:      docs/comm.md, 'Async'. */
DPAR_API dpar_status dpar_iallreduce_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                        dpar_op op, dpar_request **req, const char *file, int line);
DPAR_API dpar_status dpar_ireduce_scatter_at(dpar_comm *comm, const void *send, void *recv, size_t count,
                                             dpar_dtype dtype, dpar_op op, dpar_request **req, const char *file,
                                             int line);
DPAR_API dpar_status dpar_iallgather_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                        dpar_request **req, const char *file, int line);
/* dpar_request_wait / dpar_request_test: wait for a request / ask whether it has finished.
   Returns:  wait: the request's status, and the request is released. test: once finished, *done = 1 and
             the same as wait (the request is released); else *done = 0 and DPAR_OK. Both: DPAR_EINVAL for
             a NULL argument.
   Thread safety: the thread that made the request. */
DPAR_API dpar_status dpar_request_wait(dpar_request *req);
DPAR_API dpar_status dpar_request_test(dpar_request *req, int *done);

/* The calls with the caller's file and line, for the contract checker's messages (documented above). */
#define dpar_send(comm, buf, count, dtype, peer, tag) \
    dpar_send_at(comm, buf, count, dtype, peer, tag, __FILE__, __LINE__)
#define dpar_recv(comm, buf, count, dtype, peer, tag) \
    dpar_recv_at(comm, buf, count, dtype, peer, tag, __FILE__, __LINE__)
#define dpar_sendrecv(comm, sendbuf, sendcount, dst, recvbuf, recvcount, src, dtype, tag) \
    dpar_sendrecv_at(comm, sendbuf, sendcount, dst, recvbuf, recvcount, src, dtype, tag, __FILE__, __LINE__)
#define dpar_barrier(comm) dpar_barrier_at(comm, __FILE__, __LINE__)
#define dpar_broadcast(comm, send, recv, count, dtype, root) \
    dpar_broadcast_at(comm, send, recv, count, dtype, root, __FILE__, __LINE__)
#define dpar_reduce(comm, send, recv, count, dtype, op, root) \
    dpar_reduce_at(comm, send, recv, count, dtype, op, root, __FILE__, __LINE__)
#define dpar_reduce_scatter(comm, send, recv, count, dtype, op) \
    dpar_reduce_scatter_at(comm, send, recv, count, dtype, op, __FILE__, __LINE__)
#define dpar_allgather(comm, send, recv, count, dtype) \
    dpar_allgather_at(comm, send, recv, count, dtype, __FILE__, __LINE__)
#define dpar_allreduce(comm, send, recv, count, dtype, op) \
    dpar_allreduce_at(comm, send, recv, count, dtype, op, __FILE__, __LINE__)
#define dpar_alltoall(comm, send, recv, count, dtype) \
    dpar_alltoall_at(comm, send, recv, count, dtype, __FILE__, __LINE__)
#define dpar_alltoallv(comm, send, sendcounts, sdispls, recv, recvcounts, rdispls, dtype) \
    dpar_alltoallv_at(comm, send, sendcounts, sdispls, recv, recvcounts, rdispls, dtype, __FILE__, __LINE__)
#define dpar_ialltoallv(comm, send, sendcounts, sdispls, recv, recvcounts, rdispls, dtype, req) \
    dpar_ialltoallv_at(comm, send, sendcounts, sdispls, recv, recvcounts, rdispls, dtype, req, __FILE__, __LINE__)
#define dpar_alltoallv_counts(comm, sendcounts, recvcounts) \
    dpar_alltoallv_counts_at(comm, sendcounts, recvcounts, __FILE__, __LINE__)
#define dpar_iallreduce(comm, send, recv, count, dtype, op, req) \
    dpar_iallreduce_at(comm, send, recv, count, dtype, op, req, __FILE__, __LINE__)
#define dpar_ireduce_scatter(comm, send, recv, count, dtype, op, req) \
    dpar_ireduce_scatter_at(comm, send, recv, count, dtype, op, req, __FILE__, __LINE__)
#define dpar_iallgather(comm, send, recv, count, dtype, req) \
    dpar_iallgather_at(comm, send, recv, count, dtype, req, __FILE__, __LINE__)

/* dpar_comm_split: like MPI_Comm_split: ranks with the same color form a new comm, ordered by key then old rank.
   color:    negative: *out = NULL.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL comm or out), DPAR_EUNSUPPORTED (a hybrid comm); the comm's errors
             (see dpar_comm).
   Thread safety: the comm's thread; collective. */
DPAR_API dpar_status dpar_comm_split(dpar_comm *comm, int color, int key, dpar_comm **out);

/* dpar_mesh_init / dpar_mesh_destroy: make / free the dp, tp and pp sub-comms of a dp x tp x pp mesh.
   world:    N = dp * tp * pp ranks, in Megatron's order: tensor-parallel ranks are neighbours, then
             data-parallel, pipeline outermost: world = (pp_rank * dp + dp_rank) * tp + tp_rank.
   Remarks:  the sub-comms are named after the world ("comm.dp", "comm.tp", "comm.pp" for a world named
             "comm"), in their messages and trace tracks; they use the world's allocator.
   Returns:  init: DPAR_OK; DPAR_EINVAL (NULL mesh, desc or world, dp * tp * pp not the world's size); the comm's
             errors; on error *mesh is zeroed. destroy: DPAR_OK (also for NULL or a zeroed mesh); the first error
             of the sub-comms' destroy; it zeroes *mesh.
   Thread safety: the comm's thread; init is collective over `world`.
   See:      docs/comm.md, 'Split and mesh'. */
typedef struct dpar_mesh {
    int dp, tp, pp;
    int dp_rank, tp_rank, pp_rank;
    dpar_comm *dp_comm, *tp_comm, *pp_comm;
} dpar_mesh;
/* dpar_mesh_desc: the mesh's shape; a zero field means its default. */
typedef struct dpar_mesh_desc {
    dpar_comm *world; /* required: N = dp * tp * pp ranks */
    int dp, tp, pp;   /* tp, pp 0: 1; dp 0: N / (tp * pp) */
} dpar_mesh_desc;
DPAR_API dpar_status dpar_mesh_init(dpar_mesh *mesh, const dpar_mesh_desc *desc);
DPAR_API dpar_status dpar_mesh_destroy(dpar_mesh *mesh);

/* dpar_comm_stats_get / dpar_comm_stats_reset: read / clear this rank's counters: calls, bytes, time, per call.
   busbw:    as nccl-tests: algbw = bytes / time with bytes = count * element size (the total count for
             reduce_scatter and allgather, count * N for alltoall, the elements this rank sends for alltoallv);
             busbw = algbw * 2(N-1)/N for allreduce, (N-1)/N for reduce_scatter, allgather, alltoall and
             alltoallv, 1 otherwise. algo_calls / last_algo: which allreduce algorithm ran (dpar_algo; one-shot
             and slice count as sent the bytes of this rank the others read, as received those it read of
             theirs).
   Returns:  DPAR_OK; DPAR_EINVAL (NULL comm or out).
   Thread safety: get: any thread (relaxed reads); reset: the comm's thread (it waits for the comm's requests and
             clears the counters with plain stores).
   See:      docs/comm.md, 'Counters and trace'. */
typedef struct dpar_comm_counters {
    uint64_t calls, bytes_sent, bytes_received, time_ns;
} dpar_comm_counters;
typedef struct dpar_comm_stats {
    dpar_comm_counters by_coll[DPAR_COLL_COUNT];
    dpar_coll last_coll;
    dpar_comm_counters last; /* the last call alone */
    double last_busbw_gbps;
    uint64_t algo_calls[DPAR_ALGO_COUNT]; /* allreduce calls by the algorithm that ran them */
    dpar_algo last_algo;                  /* of the last allreduce */
} dpar_comm_stats;
DPAR_API dpar_status dpar_comm_stats_get(const dpar_comm *comm, dpar_comm_stats *out);
DPAR_API dpar_status dpar_comm_stats_reset(dpar_comm *comm);

/* ============================================================================================== */
/* >>gemm: single-precision matrix multiply                                                       */
/* ============================================================================================== */
/* The GEMM calls: row-major, as CBLAS with CblasRowMajor: C (M x N) = alpha op(A) (M x K) op(B) (K x N) + beta C.
   ta, tb:   op(X) = X (DPAR_NO_TRANS) or its transpose (DPAR_TRANS).
   lda, ldb, ldc: row strides, in elements.
   beta:     0 ignores C's old contents (NaN included).
   See:      docs/model_parallel.md, 'GEMM'. */
typedef enum dpar_trans { DPAR_NO_TRANS = 0, DPAR_TRANS = 1 } dpar_trans;

/* dpar_sgemm: the fast path: OpenBLAS's cblas_sgemm under DPAR_OPENBLAS, else the built-in kernel.
   Returns:  DPAR_OK; DPAR_EINVAL (a bad trans, negative sizes, leading dimensions too small, NULL matrices),
             DPAR_ENOMEM (the built-in kernel's packing buffers, once per thread).
   Remarks:  under DPAR_OPENBLAS, called from a pool thread, it first sets OpenBLAS to one thread; OpenBLAS
             0.3 has only a process-wide setting, so call openblas_set_num_threads(n) again before using
             OpenBLAS's own threads outside the pool.
   Thread safety: any thread.
   See:      docs/model_parallel.md, 'GEMM' (Threads). */
DPAR_API dpar_status dpar_sgemm(dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha, const float *A, int lda,
                                const float *B, int ldb, float beta, float *C, int ldc);
/* dpar_sgemm_builtin: the built-in blocked kernel, always available (tests compare both paths).
   Returns:  as dpar_sgemm.
   Thread safety: any thread (packing buffers are per thread). */
DPAR_API dpar_status dpar_sgemm_builtin(dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha, const float *A,
                                        int lda, const float *B, int ldb, float beta, float *C, int ldc);
/* dpar_sgemm_pool: one GEMM cut over the threads of a pool, each part a single-threaded dpar_sgemm.
   Remarks:  cut by rows of C, or by columns when C is wide.
   Returns:  as dpar_sgemm; DPAR_EINVAL for a NULL pool.
   Thread safety: as dpar_pool_for. */
DPAR_API dpar_status dpar_sgemm_pool(dpar_pool *pool, dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha,
                                     const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);
/* dpar_sgemm_ref: the naive triple loop, accumulating in double: the reference of the tests.
   Thread safety: any thread. */
DPAR_API void dpar_sgemm_ref(dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha, const float *A, int lda,
                             const float *B, int ldb, float beta, float *C, int ldc);

/* ============================================================================================== */
/* >>shard: shard plans: scatter, gather, all-gather of row or column blocks                     */
/* ============================================================================================== */
/* dpar_shard_plan: how a rows x cols row-major tensor is cut over `parts` ranks, by rows or by columns.
   Blocks:   the near-equal blocks of dpar_block_range (uneven where the size does not divide).
   Shards:   rank r's shard is stored contiguously, row-major: nrows x ncols of its slice.
   See:      docs/model_parallel.md, 'Shard plans'. */
typedef enum dpar_shard_axis { DPAR_SHARD_ROWS = 0, DPAR_SHARD_COLS = 1 } dpar_shard_axis;

typedef struct dpar_shard_plan {
    size_t rows, cols;
    int parts;
    dpar_shard_axis axis;
} dpar_shard_plan;

/* dpar_shard_plan_desc: the tensor and the cut; a zero field means its default. */
typedef struct dpar_shard_plan_desc {
    size_t rows, cols;    /* the whole tensor, row-major (0 is allowed) */
    int parts;            /* required: the ranks, >= 1 */
    dpar_shard_axis axis; /* default DPAR_SHARD_ROWS */
} dpar_shard_plan_desc;
/* dpar_shard_plan_init: fill in a plan, checked.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL plan or desc, parts < 1, a bad axis, rows x cols too large for size_t). On
             error *plan is zeroed.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_shard_plan_init(dpar_shard_plan *plan, const dpar_shard_plan_desc *desc);
/* dpar_shard_slice: the slice `rank` owns: rows [row0, row0 + nrows), cols [col0, col0 + ncols).
   Returns:  the element count of the shard; 0 for a bad rank.
   Thread safety: any thread. */
DPAR_API size_t dpar_shard_slice(const dpar_shard_plan *plan, int rank, size_t *row0, size_t *nrows, size_t *col0,
                                 size_t *ncols);
/* dpar_shard_scatter / dpar_shard_gather / dpar_shard_allgather: move a tensor between whole and shards.
   comm:     plan->parts ranks.
   scatter:  root's full tensor to every rank's shard.
   gather:   the shards into root's full tensor (others' full may be NULL).
   allgather: the shards into everyone's full tensor.
   Returns:  DPAR_OK; DPAR_EINVAL (a comm not of plan->parts ranks, NULL comm, plan or buffer, a bad dtype or
             root); DPAR_ENOMEM; the comm's errors.
   Thread safety: the comm's thread; collective. */
DPAR_API dpar_status dpar_shard_scatter(dpar_comm *comm, const dpar_shard_plan *plan, const void *full, void *shard,
                                        dpar_dtype dtype, int root);
DPAR_API dpar_status dpar_shard_gather(dpar_comm *comm, const dpar_shard_plan *plan, const void *shard, void *full,
                                       dpar_dtype dtype, int root);
DPAR_API dpar_status dpar_shard_allgather(dpar_comm *comm, const dpar_shard_plan *plan, const void *shard, void *full,
                                          dpar_dtype dtype);

/* ============================================================================================== */
/* >>tp: tensor-parallel linear layers (column and row parallel, Megatron-LM)                    */
/* ============================================================================================== */
/* dpar_linear: one rank's part of a linear layer y = x W + b, W (in x out), b (out), `batch` rows of x.
   FULL:     the whole layer, no comm.
   COLUMN:   Megatron's column-parallel: W and b cut by output columns; x (batch x in) is the same on every
             rank, y (batch x out_local) is this rank's columns; backward allreduces dx.
   ROW:      row-parallel: W cut by input rows; x (batch x in_local) is this rank's columns of the input (what
             a COLUMN layer and an elementwise activation produce); forward allreduces y (batch x out), then
             adds b (whole on every rank).
   Gradients: accumulate (+=) until dpar_linear_zero_grad, so micro-batches add up.
   Leaves:   desc.leaves = L: the same bits for any tp dividing L. Every sum over a cut dimension (the forward's
             over `in`, the input gradient's over `out`) becomes L partial products, one per fixed leaf of that
             dimension (dpar_block_range(dim, L, q)), added in dpar_tree_reduce's fixed tree; a parallel layer's
             rank owns whole leaves (block `rank` of dpar_block_range(L, tp, ...)) and the ranks all-gather their
             partials instead of allreducing the sum. Every GEMM is dpar_sgemm_builtin's (not OpenBLAS, not the
             pool's), whose sums do not depend on how C is cut. FULL layers with the same L give the same bits.
   See:      docs/model_parallel.md, 'Tensor-parallel linear layers (Megatron-LM)'. */
typedef enum dpar_linear_mode { DPAR_LINEAR_FULL = 0, DPAR_LINEAR_COLUMN = 1, DPAR_LINEAR_ROW = 2 } dpar_linear_mode;

typedef struct dpar_linear {
    dpar_linear_mode mode;
    int in, out;               /* the whole layer */
    int in_local, out_local;   /* this rank's W is (in_local x out_local), row-major */
    int in_offset, out_offset; /* where it sits in the whole W */
    int bias_local;            /* floats in b and db (0: no bias) */
    float *w, *b, *dw, *db;    /* parameters and their gradients */
    dpar_comm *comm;           /* the tensor-parallel comm (NULL for FULL) */
    dpar_pool *pool;           /* optional: GEMMs cut over this pool's threads */
    dpar_allocator allocator;
    int leaves;     /* desc.leaves (0: off) */
    float *scratch; /* leaves: the partial products (L x batch x max(in, out)), grown as batch needs */
    size_t scratch_floats;
} dpar_linear;

/* dpar_linear_desc: how to set up a layer; a zero field means its default. */
typedef struct dpar_linear_desc {
    dpar_linear_mode mode;    /* default DPAR_LINEAR_FULL */
    int in, out;              /* required, >= 1: the whole layer, W is (in x out) */
    int no_bias;              /* 1: no b and db (default: a bias, cut with the columns for COLUMN) */
    dpar_comm *comm;          /* the tp ranks: required for COLUMN and ROW, ignored for FULL */
    dpar_pool *pool;          /* optional: the GEMMs are cut over its threads (not with leaves) */
    dpar_allocator allocator; /* the parameters' and gradients' memory (zero: malloc/free) */
    int leaves;               /* above 0: the same bits for any tp that divides it (see dpar_linear, Leaves) */
} dpar_linear_desc;
/* dpar_linear_init: set up this rank's part of a layer; its parameters (zero) and gradients are allocated.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL layer or desc, a bad mode, in or out < 1, COLUMN or ROW without comm,
             half an allocator, leaves outside 0..4096 or not a multiple of the comm's size, leaves with a pool),
             DPAR_ENOMEM. On error *layer is zeroed.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_linear_init(dpar_linear *layer, const dpar_linear_desc *desc);
/* dpar_linear_set_weights: take this rank's slice of the whole W (in x out) and b (out).
   b_full:   may be NULL.
   Returns:  DPAR_OK; DPAR_EINVAL (an uninitialised layer, NULL w_full).
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_linear_set_weights(dpar_linear *layer, const float *w_full, const float *b_full);
/* dpar_linear_forward: y = x W + b, as the layer's mode says (see dpar_linear).
   Returns:  DPAR_OK; DPAR_EINVAL (a bad argument); for ROW the comm's errors.
   Thread safety: the rank's thread; collective over comm for ROW. */
DPAR_API dpar_status dpar_linear_forward(dpar_linear *layer, const float *x, float *y, int batch);
/* dpar_linear_backward: given dy, dw += x^T dy, db += column sums of dy, dx = dy W^T.
   dx:       may be NULL when it is not needed, on every rank alike.
   Returns:  DPAR_OK; DPAR_EINVAL (a bad argument); for COLUMN with dx the comm's errors.
   Thread safety: the rank's thread; collective over comm for COLUMN with dx. */
DPAR_API dpar_status dpar_linear_backward(dpar_linear *layer, const float *x, const float *dy, float *dx, int batch);
/* dpar_linear_zero_grad / dpar_linear_destroy: zero dw and db / free what dpar_linear_init allocated.
   Returns:  destroy: DPAR_OK (also for NULL or a zeroed layer); it zeroes *layer.
   Thread safety: the rank's thread. */
DPAR_API void dpar_linear_zero_grad(dpar_linear *layer);
DPAR_API dpar_status dpar_linear_destroy(dpar_linear *layer);

/* ============================================================================================== */
/* >>zero: ZeRO-1: the optimizer state sharded over the data-parallel ranks                      */
/* ============================================================================================== */
/* dpar_zero: ZeRO stage 1 (DeepSpeed): the optimizer state cut over the data-parallel ranks.
   Step:     reduce-scatter the gradients (the average over ranks), update this rank's block of the parameters
             with its block of the state, all-gather the parameters.
   Device:   on a comm whose buffers are device memory (a dpar_cuda pool's worker: dpar_comm_memory with clear and
             update), params and grads are device memory, the state is allocated there too and every step runs on
             the device (its stream, when the pool is stream-ordered); the flat form only (the tensor form:
             DPAR_EUNSUPPORTED); checkpoints staged through host memory (dpar_comm_memory.to_host / from_host).
             Bitwise the host's training.
   See:      docs/model_parallel.md, 'ZeRO-1 (DeepSpeed)'; docs/cuda.md, 'ZeRO and FSDP on device memory'. */
typedef enum dpar_optim { DPAR_OPTIM_SGD = 0, DPAR_OPTIM_ADAM = 1 } dpar_optim;

/* dpar_optim_update: one optimizer step on n elements, the math of dpar_zero and dpar_fsdp (dpar_comm_memory.update
   computes it on device memory):
     SGD:   g' = g + weight_decay p;  m = momentum m + g';  p -= lr m
     ADAM:  m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g g;
            p -= lr ((m / c1) / (sqrt(v / c2) + eps) + weight_decay p),  c1 = 1 - beta1^step, c2 = 1 - beta2^step
            (powf on the host, in float: a device computes c1 and c2 the same way, or gets other bits)
   Each operation is rounded on its own (no fused multiply-add), so a device gives the host's bits. */
struct dpar_optim_update {
    dpar_optim kind;
    float lr, momentum, beta1, beta2, eps, weight_decay;
    long step;         /* counts from 1 */
    float *params, *m; /* n floats each, updated; m: SGD's momentum, Adam's first moment */
    float *v;          /* Adam's second moment (SGD: NULL) */
    const float *grads;
    size_t n;
};

/* dpar_tensor: one array of a model where it lives (a weight matrix, a bias, their gradients), for the objects that
   take a list of them instead of one flat array (dpar_zero_desc, dpar_fsdp_desc, dpar_buckets_desc), as PyTorch DDP
   registers a model's parameters. The list numbers the elements one after the other: tensor 0's, then tensor 1's...;
   that numbering is the flat form's, so a list and a flat array of the same values train bitwise alike.
   Rules:    data not NULL, count >= 1, dtype the one the object works in (DPAR_F32 = 0), no two tensors of a list
             overlapping; the object keeps the pointers (not the data) until it is destroyed (dpar_fsdp at stage 3
             reads its params at create only).
   See:      docs/data_parallel.md, 'Gradients where they live'; docs/model_parallel.md (ZeRO-1, FSDP). */
typedef struct dpar_tensor {
    void *data;
    size_t count;
    dpar_dtype dtype; /* 0: DPAR_F32 */
} dpar_tensor;

/* dpar_zero_desc: how to make a ZeRO-1 optimizer; a zero field means its default. */
typedef struct dpar_zero_desc {
    dpar_comm *comm;          /* required: the data-parallel ranks the state is cut over */
    size_t count;             /* the parameters, the same on every rank (0: none) */
    dpar_optim kind;          /* default DPAR_OPTIM_SGD */
    float lr;                 /* required, > 0 */
    float momentum;           /* SGD: v = momentum v + g; p -= lr v (0: plain SGD) */
    float beta1, beta2;       /* Adam (AdamW); 0: 0.9 and 0.999 */
    float eps;                /* Adam; 0: 1e-8 */
    float weight_decay;       /* SGD: added to the gradient; Adam: decoupled (AdamW); 0: none */
    dpar_allocator allocator; /* the optimizer state's memory (zero: malloc/free) */
    /* the tensor form (instead of flat arrays): the model's parameters and gradients where they live, f32, grads[i]
       of params[i]'s count; count is then their total (or 0). dpar_zero_step(zero, NULL, NULL) steps on them */
    const dpar_tensor *params, *grads;
    int num_tensors;
} dpar_zero_desc;

typedef struct dpar_zero dpar_zero;

/* dpar_zero_create: a ZeRO-1 optimizer for the desc's `count` parameters over the ranks of its comm.
   Remarks:  the tensor form allocates one staging array of `count` floats at create (the collectives need the
             gradients, then the parameters, contiguous): 4 bytes per parameter on top of the state.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL desc, comm or out, a bad kind, lr not positive, half an allocator; a bad
             tensor list: NULL, a NULL data, a zero count, a dtype other than f32, two tensors overlapping, a gradient
             whose count is not its parameter's, count not their total), DPAR_ENOMEM. On error *out is NULL.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_zero_create(const dpar_zero_desc *desc, dpar_zero **out);
/* dpar_zero_step: one optimizer step.
   params:   count floats, the same on every rank; updated in place. NULL (with grads NULL): the desc's tensors.
   grads:    count floats, this rank's gradient; its own block is overwritten by the averaged gradient (the tensor
             form leaves the gradient tensors as they are: it reduces in its staging array).
   Returns:  DPAR_OK; DPAR_EINVAL (a NULL pointer without tensors); the comm's errors.
   Thread safety: the rank's thread; collective. */
DPAR_API dpar_status dpar_zero_step(dpar_zero *zero, float *params, float *grads);
/* dpar_zero_state_bytes / dpar_zero_shard: the bytes of optimizer state this rank holds / its block.
   offset, length: this rank's block of the parameters; either may be NULL.
   Returns:  state_bytes: 0 for NULL.
   Thread safety: any thread. */
DPAR_API size_t dpar_zero_state_bytes(const dpar_zero *zero);
DPAR_API void dpar_zero_shard(const dpar_zero *zero, size_t *offset, size_t *length);
/* dpar_zero_destroy: free the optimizer and its state.
   Returns:  DPAR_OK (also for NULL).
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_zero_destroy(dpar_zero *zero);

/* ============================================================================================== */
/* >>fsdp: ZeRO-2 and ZeRO-3 (FSDP): gradients, optimizer state and parameters sharded by unit    */
/* ============================================================================================== */
/* dpar_fsdp: sharded data parallelism over the ranks of a comm (DeepSpeed ZeRO-2/3, PyTorch FSDP). The model is a
   list of units (a layer or a group of layers), each a flat array of float parameters; rank r keeps block r
   (dpar_block_range) of every unit's parameters, gradients and optimizer state.
   Stage 2:  every rank keeps the full parameters too; a unit's gradients are reduce-scattered as soon as its backward
             is done (dpar_fsdp_reduce), so only one unit's full gradients exist at a time; the step updates the
             shards and all-gathers the parameters.
   Stage 3:  only the shards are kept. dpar_fsdp_gather all-gathers a unit's parameters into one of two pooled
             buffers and starts gathering the next unit (in the direction of the calls: forward up, backward down)
             into the other, so the gather overlaps the unit's compute; dpar_fsdp_release gives the buffer back.
   Per step: forward: for each unit gather, compute, release; backward, last unit first: gather, compute what reads the
             parameters (the input's gradient), release, dpar_fsdp_grads (a zeroed full-size gradient buffer: at stage 3
             the released unit's own), compute the parameters' gradients, dpar_fsdp_reduce; then dpar_fsdp_step. A
             backward that reads the parameters and writes the gradients together takes the gradients before the
             release (gather, grads, compute, reduce, release): it costs a third unit-sized buffer. The pointers your
             code gets are plain full-size arrays.
   Results:  the reduce-scatter of a unit's gradients adds in the order of dpar_allreduce of the same count, so
             training ends bitwise identical to plain data parallelism that allreduces each unit's gradients (AVG) and
             applies the same optimizer (dpar_zero_step's math), for any number of ranks (tests/test_fsdp.c).
   Memory:   stage 3: (4 + 4 + 4 k) x params / N bytes (parameter, gradient and k optimizer words per parameter: SGD
             k = 1, Adam k = 2) plus one arena of the two largest units for the two pooled buffers (one at each end:
             any two different units fit), which the gradients share when the unit is released before they are
             taken (else a buffer of the largest unit, allocated at the first need and kept); stage 2 keeps 4 x
             params of full parameters instead of the parameter shard, and one gradient buffer of the largest unit.
             16-bit compute with an f32 reduction adds an f32 buffer of the largest unit. dpar_fsdp_memory reports
             what is held.
   Tensors:  a model of separate arrays lists them (desc.params, .grads, .unit_tensors; dpar_fsdp_gather_tensors, with
             16-bit compute dpar_fsdp_gather16_tensors and arrays of that type): no repacking, bitwise the flat form.
   Leaves:   desc.leaves = L: each rank computes the gradients of its fixed leaves (parts of the global batch) apart,
             and the reduction sums the L leaves in one fixed tree, whichever rank holds which: training ends bitwise
             the same on 1, 2, 3 or any number of ranks up to L (elastic restarts included). Each rank sums the
             subtrees inside its leaves (M at most on a rank: 1 when N is a power of two dividing L, 3 for 12 leaves
             on 3 ranks, about 2 log2 L at worst); one alltoall moves M times the bytes of the reduce-scatter, and a
             rank holds its leaves' gradients and 2 M more unit-sized buffers.
   Device:   on a comm whose buffers are device memory (dpar_comm_memory with clear and update: a dpar_cuda pool's
             worker), the shards, the unit buffers and what gather and grads return are device memory, and
             set_params / get_params take device memory; stages 2 and 3 in f32, flat units, no leaves, no loss scale
             (the rest returns DPAR_EUNSUPPORTED at create); checkpoints staged through host memory (to_host /
             from_host). Gradients are not checked for inf/NaN
             there (f32 at scale 1 skips no step), so a step costs no host round trip. Bitwise the host's training.
   See:      docs/model_parallel.md, 'ZeRO-2 and ZeRO-3 (FSDP)'; docs/cuda.md, 'ZeRO and FSDP on device memory'. */
typedef struct dpar_fsdp dpar_fsdp;

/* dpar_fsdp_desc: how to make a sharded model; a zero field means its default. */
typedef struct dpar_fsdp_desc {
    dpar_comm *comm;                                 /* required: the data-parallel ranks */
    int stage;                                       /* 2 or 3 (0: 3) */
    int num_units;                                   /* required, >= 1 */
    const size_t *unit_counts;                       /* required: each unit's parameters (copied) */
    dpar_optim kind;                                 /* the optimizer, as dpar_zero_desc: default DPAR_OPTIM_SGD */
    float lr;                                        /* required, > 0 */
    float momentum, beta1, beta2, eps, weight_decay; /* as dpar_zero_desc */
    dpar_allocator allocator;                        /* every byte the object holds (zero: malloc/free) */
    /* mixed precision: fp32 master weights and optimizer state in the shards; the parameters and gradients your
       code sees in `compute` (DPAR_BF16 or DPAR_F16: use dpar_fsdp_gather16 / _grads16) */
    dpar_dtype compute;      /* DPAR_F32 (0), DPAR_BF16, DPAR_F16 */
    dpar_dtype reduce_dtype; /* the gradients' reduction: DPAR_F32 (0; a 16-bit gradient widened first) or `compute`
                                (half the bytes; each of the N - 1 adds rounds to it: relative error up to about
                                (N - 1) 2^-8 for bf16, (N - 1) 2^-11 for f16) */
    float loss_scale;        /* the factor your loss is multiplied by before backward (the gradients are divided by
                                it); 0: 1, or 65536 with compute f16 */
    int static_loss_scale;   /* 1: never change it. Else, with compute f16, it is dynamic: halved when a step is
                                skipped, doubled after 1000 steps without one */
    /* the tensor form: the model's arrays, unit u being the next unit_tensors[u] of the lists (then unit_counts may
       be NULL; given, it must agree), every tensor of both lists in the compute type (f32, or with 16-bit compute
       the model's bf16/f16 arrays: dtype = compute). params: their values at create are the initial parameters
       (dpar_fsdp_set_params not needed; 16-bit ones widened exactly into the fp32 master shards); stage 2 keeps the
       full parameters in them (all-gathered into after each step, 16-bit: the master weights rounded: no copy of its
       own), stage 3 reads them at create only. grads (optional): where backward writes each unit's gradients (16-bit:
       times the loss scale, as into dpar_fsdp_grads16); dpar_fsdp_reduce reads them there (a unit of one tensor
       reduced in the compute type: in place, this rank's block overwritten by the average; 16-bit reduced in f32:
       widened straight from the tensors; else through the unit buffer dpar_fsdp_grads would have given), and
       dpar_fsdp_grads / _grads16 are refused. dpar_fsdp_gather_tensors (16-bit: dpar_fsdp_gather16_tensors) gives
       the unit's parameters tensor by tensor */
    const dpar_tensor *params, *grads;
    const int *unit_tensors;
    /* the deterministic mode (f32 compute, not with grads tensors): the global batch is `leaves` fixed leaves (>= the
       number of ranks), rank r computing leaves dpar_fsdp_leaves gives it, each one's gradients apart (dpar_fsdp_grads
       gives room for all of its leaves); dpar_fsdp_reduce gives every rank its block of the leaves summed in the fixed
       tree of dpar_tree_reduce, over `leaves`: bitwise the same for ANY number of ranks (a run resumed on another
       number continues bitwise). 0: off */
    int leaves;
} dpar_fsdp_desc;

/* dpar_fsdp_create: make this rank's part of a sharded model; its parameters start at zero (dpar_fsdp_set_params), or
   at the desc's params tensors.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL desc, comm, unit_counts or out, num_units < 1, a stage other than 2 or 3, a bad
             kind, lr not positive, half an allocator; the tensor form: a bad list (a NULL data, a zero count, a dtype
             other than the compute type, overlapping tensors, a gradient whose count is not its parameter's), a unit
             of no tensor, unit_counts that disagree), DPAR_ENOMEM. On error *out is NULL.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_fsdp_create(const dpar_fsdp_desc *desc, dpar_fsdp **out);
/* dpar_fsdp_set_params / dpar_fsdp_get_params: copy a unit's full parameters in (every rank passes the same values:
   each keeps its part) / out (collective: the shards are all-gathered into `full`). On device memory (see
   dpar_fsdp) `full` is device memory.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL fsdp or full, a unit out of range, a gather in flight); get: the comm's errors.
   Thread safety: the rank's thread; get is collective. */
DPAR_API dpar_status dpar_fsdp_set_params(dpar_fsdp *fsdp, int unit, const float *full);
DPAR_API dpar_status dpar_fsdp_get_params(dpar_fsdp *fsdp, int unit, float *full);
/* dpar_fsdp_gather: the unit's full parameters in *params, valid until dpar_fsdp_release of the unit.
   Remarks:  stage 3: collective; it waits for the prefetched gather when it is this unit's, else all-gathers now,
             then starts gathering the next unit (comms without async requests: no prefetch). Stage 2: the kept copy.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL arguments, a unit out of range), DPAR_EBUSY (two units already held); the
             comm's errors.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_fsdp_gather(dpar_fsdp *fsdp, int unit, float **params);
/* dpar_fsdp_gather_tensors: dpar_fsdp_gather, the unit's parameters given tensor by tensor: views[i] is the unit's
   tensor i (the desc's unit_tensors[unit] of them; without the tensor form, one: the whole unit). At stage 2 with the
   tensor form they are the desc's own arrays; else they point into the gathered buffer. Release as after gather.
   Returns:  as dpar_fsdp_gather.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_fsdp_gather_tensors(dpar_fsdp *fsdp, int unit, float **views);
/* dpar_fsdp_gather16 / dpar_fsdp_grads16 / dpar_fsdp_gather16_tensors: the same with 16-bit compute (desc->compute
   DPAR_BF16 or DPAR_F16: bf16 or IEEE half bits, as dpar_f32_to_bf16 / dpar_f32_to_f16 round; the fp32 master weights
   rounded). The f32 calls refuse a 16-bit fsdp and the reverse.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_fsdp_gather16(dpar_fsdp *fsdp, int unit, uint16_t **params);
DPAR_API dpar_status dpar_fsdp_grads16(dpar_fsdp *fsdp, int unit, uint16_t **grads);
DPAR_API dpar_status dpar_fsdp_gather16_tensors(dpar_fsdp *fsdp, int unit, uint16_t **views);
/* dpar_fsdp_release: the unit's gathered parameters are no longer used (stage 2: nothing to do).
   Returns:  DPAR_OK; DPAR_EINVAL (the unit is not held).
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_fsdp_release(dpar_fsdp *fsdp, int unit);
/* dpar_fsdp_grads: a zeroed full-size gradient buffer for the unit, valid until dpar_fsdp_reduce of the unit (refused
   with the tensor form's grads, as dpar_fsdp_grads16: backward writes those).
   Remarks:  stage 3: a pooled buffer that no unit holds and that fits beside the other (after dpar_fsdp_release of
             this unit: its place), so the gradients cost no memory of their own; else (taken before the release) a
             third buffer of the largest unit, allocated on that first need and kept until destroy. With desc.leaves:
             one array per leaf of this rank (dpar_fsdp_leaves), in a buffer of their own made at create.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL arguments, a unit out of range), DPAR_EBUSY (another unit's gradients are not
             reduced yet), DPAR_ENOMEM (the third buffer).
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_fsdp_grads(dpar_fsdp *fsdp, int unit, float **grads);
/* dpar_fsdp_leaves: the leaves this rank computes (desc.leaves: leaves first .. first + count - 1, block `rank` of
   dpar_block_range(leaves, N, ...)); with desc.leaves, dpar_fsdp_grads gives `count` zeroed gradient arrays of the
   unit one after another: leaf first + j's at grads + j * (the unit's count). Without leaves: first 0, count 1.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL fsdp).
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_fsdp_leaves(const dpar_fsdp *fsdp, int *first, int *count);
/* dpar_fsdp_reduce: reduce-scatter the unit's gradients (the average over ranks; with desc.leaves the average over
   the leaves, summed in their fixed tree) and add this rank's block to its gradient shard; the gradient buffer goes
   back to the pool (a pooled one is free for the next gather).
   Returns:  DPAR_OK; DPAR_EINVAL (the unit's gradients were not taken with dpar_fsdp_grads); the comm's errors.
   Thread safety: the rank's thread; collective. */
DPAR_API dpar_status dpar_fsdp_reduce(dpar_fsdp *fsdp, int unit);
/* dpar_fsdp_step: the optimizer on this rank's shards (dpar_zero_step's math), the gradient shards zeroed after;
   stage 2: the parameters all-gathered into every rank's full copy. When a gradient of any rank is inf or NaN (after
   the loss scale is divided out) every rank skips the step together (one allreduce of a flag), and a dynamic loss
   scale is halved.
   Returns:  DPAR_OK; DPAR_EBUSY (a unit is still held, or gradients not reduced); the comm's errors.
   Thread safety: the rank's thread; collective. */
DPAR_API dpar_status dpar_fsdp_step(dpar_fsdp *fsdp);
/* dpar_fsdp_scale: the loss scale to multiply the next step's loss by, and the steps skipped so far (either may be
   NULL).
   Returns:  DPAR_OK; DPAR_EINVAL (NULL fsdp).
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_fsdp_scale(const dpar_fsdp *fsdp, float *loss_scale, long *skipped);
/* dpar_fsdp_memory: the bytes this rank's object holds now and at most so far (through its allocator).
   Returns:  DPAR_OK; DPAR_EINVAL (NULL fsdp).
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_fsdp_memory(const dpar_fsdp *fsdp, size_t *bytes, size_t *peak);
/* dpar_fsdp_destroy: free everything (waits for a prefetch in flight).
   Returns:  DPAR_OK (also for NULL); the prefetch's error.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_fsdp_destroy(dpar_fsdp *fsdp);

/* ============================================================================================== */
/* >>pipe: pipeline parallelism: schedules as checked data, the stage runner                      */
/* ============================================================================================== */
/* dpar_pipe_schedule: every stage's ordered list of ops for m micro-batches of a p-stage pipeline.
   Ops:      forward and backward of (micro-batch, chunk), and the sends and receives of activations and
             gradients. The schedule is plain data: print it, check it, edit it, run it.
   GPIPE:    all forwards, then all backwards.
   1F1B:     PipeDream-flush: p - s - 1 warm-up forwards on stage s, then one forward one backward, then the
             remaining backwards, so at most p activations are stashed.
   INTERLEAVED: Megatron's: every stage holds v model chunks (virtual stage chunk * p + stage); needs m a
             multiple of p.
   ZB_H1:    zero bubble (Qi et al., 2023, ZB-H1): the backward split into B (the input's gradient, which the
             previous stage waits for) and W (the weights' gradients, which nothing needs before the optimizer
             step); 1F1B's order of forwards and B's, stage s doing each W s backwards late, so that later stages'
             W's fill 1F1B's cool-down bubbles. At most p stashes on every stage (1F1B's most); with F = B = W the
             bubble is (p - 1) / (3 m + p - 1), a third of 1F1B's idle time.
   ZBV:      zero bubble in a V (Qi et al., 2024, ZB-V): two chunks per stage (v = 2) placed as a V, stage s holding
             virtual stages s and 2p - 1 - s, so the first and the last (the loss) are both on stage 0 and the turn
             is a local hand-off on stage p - 1; split backward; at most 2p chunk stashes (1F1B's activation
             memory: a chunk is half a stage). Of two orders, the one that simulates shorter on the desc's op costs:
             DUALPIPEV's with each pair's backward first (m >= 2p), and a greedy list scheduler's (B first, then F
             under 2p stashes, then W). With F = B = W and m >= 2p the bubble is (p - 1) / (6 m + p - 1), the least
             a flushed step of half-stage chunks can have.
   DUALPIPEV: DeepSeek's DualPipeV order (the V of ZBV, v = 2, m >= 2p): warm-up forwards of chunk 0, then
             chunk-0 forwards paired with chunk-1 backwards and chunk-1 forwards with chunk-0 backwards, some W's
             deferred (its zero-bubble steps). dpar runs a pair's two ops one after the other: the overlap of one
             micro-batch's forward with another's backward, which hides DeepSeek's expert all-to-all on a GPU, is
             not in a CPU stage runner.
   See:      docs/pipeline.md, 'Schedules are data' (the bubble of each kind) and 'V schedules'. */
typedef enum dpar_pipe_kind {
    DPAR_PIPE_GPIPE = 0,
    DPAR_PIPE_1F1B = 1,
    DPAR_PIPE_INTERLEAVED = 2,
    DPAR_PIPE_ZB_H1 = 3,
    DPAR_PIPE_ZBV = 4,
    DPAR_PIPE_DUALPIPEV = 5
} dpar_pipe_kind;

typedef enum dpar_pipe_opcode {
    DPAR_PIPE_FORWARD = 0,
    DPAR_PIPE_BACKWARD = 1,
    DPAR_PIPE_SEND_ACT = 2,       /* this stage's output activation to the next virtual stage */
    DPAR_PIPE_RECV_ACT = 3,       /* the previous virtual stage's activation */
    DPAR_PIPE_SEND_GRAD = 4,      /* the gradient of this stage's input, back to the previous one */
    DPAR_PIPE_RECV_GRAD = 5,      /* the gradient of this stage's output, from the next one */
    DPAR_PIPE_BACKWARD_INPUT = 6, /* B: the backward's first half, the gradient of the input (split backward) */
    DPAR_PIPE_BACKWARD_WEIGHT = 7 /* W: its second half, the weights' gradients, after B of the same unit */
} dpar_pipe_opcode;

typedef struct dpar_pipe_op {
    int code;  /* dpar_pipe_opcode */
    int micro; /* micro-batch, 0..m-1 */
    int chunk; /* model chunk on this stage, 0..v-1 */
} dpar_pipe_op;

typedef struct dpar_pipe_schedule {
    int p, m, v;
    dpar_pipe_kind kind;
    int *num_ops;       /* [p] */
    dpar_pipe_op **ops; /* [p][num_ops[s]] */
    double bubble;      /* predicted: idle over makespan, simulated with the op costs below */
    int *peak_stash;    /* [p]: most activations held between a forward and its backward (its W when split) */
    dpar_allocator allocator;
    double cost[3]; /* the simulation's time of a forward, a B and a W (a whole backward: B + W); 0: 1 each */
} dpar_pipe_schedule;

/* dpar_pipe_schedule_desc: which schedule to make; a zero field means its default. */
typedef struct dpar_pipe_schedule_desc {
    dpar_pipe_kind kind;      /* default DPAR_PIPE_GPIPE */
    int p;                    /* required: stages, 1..4096 */
    int m;                    /* required: micro-batches, 1..65535; INTERLEAVED: a multiple of p, at least p */
    int v;                    /* model chunks per stage; 0: 1 (ZBV, DUALPIPEV: 2, the only value); above 1
                                 with INTERLEAVED (1..64) */
    dpar_allocator allocator; /* the schedule's memory (zero: malloc/free) */
    double cost_forward;      /* the op costs the schedule is made and simulated with (any unit, measured per stage */
    double cost_input_grad;   /* as bench_pipe does); 0: 1 each, so a whole backward is twice a forward */
    double cost_weight_grad;
} dpar_pipe_schedule_desc;
/* dpar_pipe_schedule_create: make the schedule of the desc's `kind`, already checked.
   Returns:  DPAR_OK; DPAR_EINVAL naming what is wrong (NULL desc or out, p outside 1..4096, m outside 1..65535, a
             bad kind or v, interleaved with m not a multiple of p, DUALPIPEV with m below 2p, half an allocator, a
             cost negative, above 1e9 or not a number, ...); DPAR_ENOMEM. On error *out is NULL.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_pipe_schedule_create(const dpar_pipe_schedule_desc *desc, dpar_pipe_schedule **out);
/* dpar_pipe_schedule_check: prove a schedule safe before it runs; it also recomputes bubble and peak_stash.
   Rules:    each forward and backward exactly once (a backward: BACKWARD, or B and then W), every backward after
             its forward, every receive before the compute that needs it (W needs B of its unit, nothing else
             needs W) and every send after the compute that makes it, sends and receives
             between neighbouring stages in the same order, and no deadlock (a simulation with the
             transport's semantics: sends do not block until 4 messages wait on a channel).
   Returns:  DPAR_OK; DPAR_EINVAL with the rule it breaks (or a NULL schedule); DPAR_ENOMEM.
   Thread safety: any thread (it writes bubble and peak_stash).
   See:      docs/pipeline.md, 'The checker'. */
DPAR_API dpar_status dpar_pipe_schedule_check(dpar_pipe_schedule *schedule);
/* dpar_pipe_schedule_format: write the schedule as a text timeline.
   buf:      one line per stage: each op as many cells as its cost (rounded; at least 1): F, B (a whole backward, or
             its input half), W, idle '.'. A schedule that dpar_pipe_schedule_check
             refuses gets its header line and "(cannot lay it out: <the checker's message>)".
   Returns:  like snprintf: the length it needs.
   Thread safety: any thread. */
DPAR_API size_t dpar_pipe_schedule_format(const dpar_pipe_schedule *schedule, char *buf, size_t size);
/* dpar_pipe_virtual_stage: which part of the model (stage, chunk) runs: its virtual stage, 0..p v - 1, in the
   model's order. Interleaved (and v = 1): chunk * p + stage. V schedules (ZBV, DUALPIPEV): stage on chunk 0,
   2p - 1 - stage on chunk 1.
   Returns:  the virtual stage; -1 for a NULL schedule or a stage or chunk outside it.
   Thread safety: any thread. */
DPAR_API int dpar_pipe_virtual_stage(const dpar_pipe_schedule *schedule, int stage, int chunk);
/* dpar_pipe_schedule_destroy: free a schedule made by dpar_pipe_schedule_create.
   Returns:  DPAR_OK (also for NULL).
   Thread safety: any thread, once no runner uses it. */
DPAR_API dpar_status dpar_pipe_schedule_destroy(dpar_pipe_schedule *schedule);

/* dpar_pipe_forward_fn / dpar_pipe_backward_fn: the stage's callbacks, per (micro-batch, chunk).
   forward:  `in` is the activation from the previous virtual stage (NULL on the first: read the micro-batch
             yourself); write yours to `out` (NULL on the last: compute the loss).
   backward: `in` is the same activation again, `grad_out` the gradient of your output (NULL on the last: from
             the loss); write the gradient of your input to `grad_in` (NULL on the first). Accumulate
             parameter gradients (+=) across micro-batches.
   Split:    schedules with B and W ops (ZB_H1, ZBV, DUALPIPEV) call backward_input for B (the same arguments as
             backward; write grad_in, keep what W needs, leave the parameter gradients alone) and backward_weight
             for W (`in` and `grad_out` as B had them; accumulate the parameter gradients). W runs after B of the
             same (micro-batch, chunk); dpar's schedules run the W's of each chunk in micro-batch order, as their
             whole backwards, so the gradient sums come out in the same order (bitwise the same).
   Chunks:   which layers (stage, chunk) runs: dpar_pipe_virtual_stage (interleaved and V schedules differ).
   Buffers:  activations and gradients are act_bytes each.
   Returns:  DPAR_OK or an error (dpar_set_error). */
typedef dpar_status (*dpar_pipe_forward_fn)(void *user, int micro, int chunk, const void *in, void *out);
typedef dpar_status (*dpar_pipe_backward_fn)(void *user, int micro, int chunk, const void *in, const void *grad_out,
                                             void *grad_in);
typedef dpar_status (*dpar_pipe_weight_fn)(void *user, int micro, int chunk, const void *in, const void *grad_out);

/* dpar_pipe_desc: how to make a stage's runner; a zero field means its default. */
typedef struct dpar_pipe_desc {
    dpar_pipe_schedule *schedule;   /* required; not copied, must outlive the runner */
    dpar_comm *comm;                /* required: the pipeline comm: its rank is the stage, its size p */
    size_t act_bytes;               /* an activation (or its gradient) crossing a stage boundary (0: nothing sent) */
    dpar_pipe_forward_fn forward;   /* required */
    dpar_pipe_backward_fn backward; /* required where the schedule has BACKWARD ops */
    void *user;                     /* passed to forward and backward */
    dpar_allocator allocator;       /* the runner's buffers (zero: malloc/free) */
    dpar_pipe_backward_fn backward_input; /* B: required where the schedule has BACKWARD_INPUT ops */
    dpar_pipe_weight_fn backward_weight;  /* W: required where it has BACKWARD_WEIGHT ops */
    size_t saved_bytes;     /* per (micro-batch, chunk): what a forward keeps for its backward (dpar_pipe_saved) */
    size_t recompute_bytes; /* above 0: activation recomputation: the forward runs again just before the backward,
                               keeping this much for it alone (dpar_pipe_saved's *recomputed) */
} dpar_pipe_desc;

typedef struct dpar_pipe dpar_pipe;

typedef struct dpar_pipe_stats {
    double predicted_bubble;  /* the schedule's */
    double measured_bubble;   /* 1 - (time in callbacks over all stages) / (p x the longest stage's run) */
    uint64_t busy_ns;         /* this stage's time in callbacks */
    uint64_t run_ns;          /* the longest stage's run */
    int buffers;              /* activation/gradient buffers this stage has (stable after the first run) */
    int predicted_saved;      /* most saved_bytes buffers this stage holds at once, from its ops (exact) */
    int peak_saved;           /* ... as this run held them */
    int predicted_recomputed; /* most recompute_bytes buffers at once (0 without recomputation) */
    int peak_recomputed;
} dpar_pipe_stats;

/* dpar_pipe_create: make the runner of this stage.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL out, a desc without schedule, comm or forward, without the backward
             callbacks the schedule's ops call, half an allocator, a comm whose size is not the schedule's p),
             DPAR_ENOMEM.
   Thread safety: the stage's thread.
   See:      docs/pipeline.md, 'The stage runner'. */
DPAR_API dpar_status dpar_pipe_create(const dpar_pipe_desc *desc, dpar_pipe **out);
/* dpar_pipe_run: one step: this stage's ops, in order, over the comm's point-to-point calls.
   stats:    may be NULL.
   Returns:  the same status on every stage (the run ends with an agreement): DPAR_OK; a callback's error
             (it poisons the comm, so no stage waits); DPAR_EINVAL (NULL pipe); DPAR_ENOMEM (a buffer, during
             the first runs); the comm's errors.
   Thread safety: the stage's thread; collective over the comm. */
DPAR_API dpar_status dpar_pipe_run(dpar_pipe *pipe, dpar_pipe_stats *stats);
/* dpar_pipe_saved: inside a forward, backward, B or W: the current (micro-batch, chunk)'s buffers, from the runner's
   allocator and reused from step to step. Returns the saved buffer (desc.saved_bytes; NULL when 0), which a forward
   fills and which stays until the unit's backward (its W when split) has returned. With desc.recompute_bytes,
   *recomputed (may be NULL) is NULL in the forward of the step's first pass and a buffer of recompute_bytes in
   the forward the runner runs again just before the backward (`out` is NULL there: nothing is sent, and a last
   stage must not count its loss twice), in that backward and in its W: keep in it what only the backward needs.
   Full recomputation: saved_bytes 0; selective: the costly ops' outputs in saved, the rest recomputed.
   Returns:  the saved buffer or NULL (also outside a callback, or for a NULL pipe).
   Thread safety: the stage's thread, inside the runner's callbacks.
   See:      docs/pipeline.md, 'Activation recomputation'. */
DPAR_API void *dpar_pipe_saved(dpar_pipe *pipe, void **recomputed);
/* dpar_pipe_destroy: free the runner.
   Returns:  DPAR_OK (also for NULL).
   Thread safety: the stage's thread. */
DPAR_API dpar_status dpar_pipe_destroy(dpar_pipe *pipe);

/* ============================================================================================== */
/* >>dp: data-parallel helpers: the sampler, gradient buckets                                     */
/* ============================================================================================== */
/* dpar_sampler: rank r's share of each epoch: positions r, r + ranks, r + 2 ranks... of a shuffle of 0..n-1.
   Shuffle:  anew each epoch from (seed, epoch), the same permutation on every rank; integer arithmetic only,
             so the same indices on every machine.
   Count:    the same on every rank, so the ranks stay in step: ceil(n / ranks), wrapping around to the
             permutation's start (or floor(n / ranks), dropping the rest, with drop_last).
   See:      docs/data_parallel.md, 'The sampler: each rank its share of each epoch'. */
typedef struct dpar_sampler {
    size_t n, per_rank;
    int ranks, rank, drop_last;
    uint64_t seed;
    size_t *perm; /* n, the current epoch's permutation */
    size_t *mine; /* per_rank, this rank's indices */
    dpar_allocator allocator;
    size_t start; /* the epoch's samples consumed (by all ranks) before the current list: dpar_sampler_resume */
} dpar_sampler;

/* dpar_sampler_desc: how to set up a sampler; a zero field means its default. */
typedef struct dpar_sampler_desc {
    size_t n;  /* required: the number of samples, >= 1 */
    int ranks; /* the data-parallel ranks; 0: 1 */
    int rank;  /* this rank, 0..ranks-1 */
    uint64_t seed;
    int drop_last;            /* 1: floor(n / ranks) each, the rest dropped (default: ceil, wrapping around) */
    dpar_allocator allocator; /* where perm and mine come from (zero: malloc/free) */
} dpar_sampler_desc;
/* dpar_sampler_init: set up the sampler of `rank` of `ranks` over n samples, as the desc says.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL s or desc, n = 0, ranks < 0, a rank outside 0..ranks-1, drop_last with
             fewer samples than ranks, half an allocator), DPAR_ENOMEM. On error *s is zeroed.
   Thread safety: the owner's thread. */
DPAR_API dpar_status dpar_sampler_init(dpar_sampler *s, const dpar_sampler_desc *desc);
/* dpar_sampler_epoch: this rank's samples for `epoch`.
   indices:  set to the samples' indices, valid until the next call.
   Returns:  how many (s->per_rank).
   Thread safety: the owner's thread. */
DPAR_API size_t dpar_sampler_epoch(dpar_sampler *s, uint64_t epoch, const size_t **indices);
/* dpar_sampler_resume / dpar_sampler_consumed: the position in an epoch, for checkpoints and elastic restarts.
   Position: the number of the epoch's samples all ranks together have consumed, `consumed`: positions 0..consumed-1
             of the epoch's permutation. It does not depend on the rank count, so a run saved on 4 ranks resumes on 3
             neither repeating nor skipping a sample: save dpar_sampler_consumed (a dpar_ckpt_replica item beside the
             epoch), and on resume call dpar_sampler_resume with it.
   resume:   this rank's share of the rest of the epoch: positions consumed + rank, consumed + rank + ranks, ...; as
             many on every rank (ceil((n - consumed) / ranks) wrapping around to the permutation's start, or floor
             with drop_last); 0 when consumed >= n. dpar_sampler_epoch(s, e, ix) is dpar_sampler_resume(s, e, 0, ix).
   consumed: the position after every rank has taken `taken` samples of its current list: min(n, start + taken x
             ranks).
   Thread safety: the owner's thread. */
DPAR_API size_t dpar_sampler_resume(dpar_sampler *s, uint64_t epoch, size_t consumed, const size_t **indices);
DPAR_API size_t dpar_sampler_consumed(const dpar_sampler *s, size_t taken);
/* dpar_sampler_destroy: free the sampler's arrays and zero *s.
   Returns:  DPAR_OK (also for NULL or a zeroed sampler).
   Thread safety: the owner's thread. */
DPAR_API dpar_status dpar_sampler_destroy(dpar_sampler *s);

/* dpar_buckets: gradient buckets: a flat float array of gradients, each bucket allreduced as soon as it is final.
   Step:     during backward, say which gradients are final with dpar_buckets_ready (in any order and any
             pieces); a bucket whose every element is final is allreduced at once, on the comm's progress
             thread, while backward goes on with the layers below. After dpar_buckets_wait every rank holds
             the reduced gradients.
   Order:    the ranks must finish buckets in the same order (they do when they run the same backward; the
             contract checker catches it otherwise).
   MPI:      needs async requests (MPI_THREAD_MULTIPLE).
   See:      docs/data_parallel.md, 'Gradient buckets: communication behind backward'. */
typedef struct dpar_buckets dpar_buckets;
/* dpar_buckets_desc: how to make gradient buckets; a zero field means its default. */
typedef struct dpar_buckets_desc {
    dpar_comm *comm; /* required: the data-parallel comm the buckets are reduced over */
    float *grads;    /* the flat gradients, count floats (required when count > 0) */
    size_t count;
    /* or the tensor form: the gradients where they live (f32; grads NULL, count 0 or their total). A bucket that
       lies inside one tensor is reduced there; one that spans tensors is copied into a staging array made at
       create (at most the total), reduced, and copied back when it is waited for */
    const dpar_tensor *tensors;
    int num_tensors;
    size_t bucket_bytes;      /* the size of a bucket, about; 0: 4 MiB */
    dpar_op op;               /* default DPAR_SUM; usually DPAR_AVG */
    dpar_allocator allocator; /* the buckets' own memory (zero: malloc/free, not the comm's) */
} dpar_buckets_desc;
/* dpar_buckets_create: cut the desc's `count` gradients at `grads` (or its tensors, numbered one after the other)
   into buckets reduced over its comm with `op`.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL desc, comm or out, NULL grads with count > 0, a bad op, half an allocator; a
             bad tensor list: a NULL data, a zero count, a dtype other than f32, two tensors overlapping, grads given
             too, count not their total), DPAR_ENOMEM. On error *out is NULL.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_buckets_create(const dpar_buckets_desc *desc, dpar_buckets **out);
/* dpar_buckets_ready: grads[offset, offset + count) are final for this step; full buckets start at once.
   Returns:  DPAR_OK; DPAR_EINVAL (a range outside the array, or marked twice in one step), DPAR_ENOMEM; the
             comm's errors.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_buckets_ready(dpar_buckets *b, size_t offset, size_t count);
/* dpar_buckets_ready_tensor: the tensor form's tensor `index` is final for this step (dpar_buckets_ready of its
   elements in the numbering).
   Returns:  as dpar_buckets_ready; DPAR_EINVAL (no tensor `index`).
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_buckets_ready_tensor(dpar_buckets *b, int index);
/* dpar_buckets_wait: wait for every bucket and end the step; the next dpar_buckets_ready starts the next one.
   Returns:  DPAR_OK; DPAR_EINVAL naming the range when some gradients were never marked (then nothing is
             reduced); the comm's errors.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_buckets_wait(dpar_buckets *b);
/* dpar_buckets_wait_range: wait only for the buckets that hold [offset, offset + count), without ending the step.
   Remarks:  on return those gradients are reduced (with an update: those params updated, on every rank).
             dpar_buckets_wait must still end the step, before the next step's first dpar_buckets_ready.
   Returns:  DPAR_OK; DPAR_EINVAL (the range is outside the gradients, or a bucket holding it is not full yet:
             it would never finish); the comm's errors.
   Thread safety: the rank's thread.
   See:      docs/data_parallel.md, 'Gradient buckets' (the next forward overlapping the last buckets). */
DPAR_API dpar_status dpar_buckets_wait_range(dpar_buckets *b, size_t offset, size_t count);
/* dpar_buckets_update_fn: the optimizer step of dpar_buckets_set_update on params[offset, offset + count). */
typedef void (*dpar_buckets_update_fn)(void *user, size_t offset, size_t count);
/* dpar_buckets_set_update: the buckets update the parameters too, ZeRO-1 style: each rank makes 1/N of the step.
   update:   NULL: off. Else a full bucket is reduce-scattered instead of allreduced; update(user, offset, count)
             applies the optimizer to params[offset, offset + count) (and to its own state for that range) from
             grads[offset, offset + count), reduced, for this rank's block of the bucket; then the bucket's
             params are all-gathered. It runs on the comm's progress thread (on a comm of one rank: in
             dpar_buckets_ready), beside the rank's thread: it must touch only its range.
   params:   count floats, not overlapping grads. Thread ranks may share one array (the same pointer on every
             rank): each updates its block in place and the all-gather copies nothing (the ranks still meet).
   Results:  after dpar_buckets_wait every rank holds the same updated params; grads are reduced only in this
             rank's blocks.
   Marking:  a parameter may change as soon as its gradient is marked ready: mark a layer ready only once
             backward no longer reads its weights (compute its input gradient first).
   Returns:  DPAR_OK; DPAR_EBUSY (gradients of this step are marked: call it between steps; or direct buckets
             are on), DPAR_EINVAL (NULL b, NULL params with an update, params overlapping grads, the tensor form:
             dpar_buckets_set_update_tensors).
   Thread safety: the rank's thread.
   See:      docs/data_parallel.md, 'Buckets that update the parameters too'. */
DPAR_API dpar_status dpar_buckets_set_update(dpar_buckets *b, float *params, dpar_buckets_update_fn update, void *user);
/* dpar_buckets_set_update_tensors: dpar_buckets_set_update for the tensor form: params is a list of as many tensors
   as the gradients', each the count of its gradient (f32, no overlaps), and update(user, offset, count) gets a range
   of the numbering that lies inside one tensor i (offset - the start of tensor i is the element in it), the reduced
   gradients in the gradient tensor there and the parameters in the params tensor. A bucket that spans tensors
   goes through staging arrays (both made here, at most the total each): its parameters are back in their tensors
   when the bucket is waited for. Each rank's params tensors are its own (not shared between thread ranks).
   Returns:  as dpar_buckets_set_update; DPAR_EINVAL (not the tensor form, a bad params list), DPAR_ENOMEM.
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_buckets_set_update_tensors(dpar_buckets *b, const dpar_tensor *params,
                                                     dpar_buckets_update_fn update, void *user);
/* dpar_buckets_set_direct: reduce the buckets of thread ranks through shared memory, on the ranks' own threads.
   on:       1: instead of the progress thread, each rank reduces its own block of every full bucket (reading
             the other ranks' gradients where they lie) and runs the update on it; 0: off.
   Contract: a rank does its share only inside dpar_buckets_ready, _wait and _wait_range, and never waits
             before the two waits, where it goes on doing its share of every bucket: call the waits at the same
             points, relative to the comm's other collectives, on every rank.
   Memory:   after dpar_buckets_wait and dpar_buckets_destroy, whatever they return, no other rank reads this
             rank's memory.
   Results:  as without it (the reduction order may differ); not counted in dpar_comm_stats, not seen by the
             contract checker.
   Tensors:  with the tensor form, each rank reads the others' buckets where they lie (in a tensor, or a spanning
             bucket's staging array, copied in when the bucket is full and out when it is waited for).
   Returns:  DPAR_OK; DPAR_EUNSUPPORTED (an MPI comm); DPAR_EINVAL on every rank when their counts, bucket sizes,
             ops, updates or sharing differ (tensor-form params: never shared); DPAR_EBUSY mid-step (turning on:
             then the comm is poisoned, the others do not wait); DPAR_ENOMEM.
   Thread safety: the rank's thread; collective: every rank calls it with the same `on`, between steps, after
             dpar_buckets_set_update (DPAR_EBUSY while direct is on); params are shared by all ranks or none.
   See:      docs/data_parallel.md, 'Direct buckets' (how it works, and when it beats the progress thread). */
DPAR_API dpar_status dpar_buckets_set_direct(dpar_buckets *b, int on);
/* dpar_buckets_count / dpar_buckets_overlap_ns: the number of buckets / the last step's overlap.
   Returns:  overlap_ns: how long, in the last step, buckets were in flight before dpar_buckets_wait was
             called (the communication hidden behind backward). Both: 0 for NULL.
   Thread safety: the rank's thread. */
DPAR_API int dpar_buckets_count(const dpar_buckets *b);
DPAR_API uint64_t dpar_buckets_overlap_ns(const dpar_buckets *b);
/* dpar_buckets_destroy: wait for the buckets in flight, turn direct buckets off, free.
   Returns:  DPAR_OK (also for NULL); the first error of a bucket that was still in flight (freed all the same).
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_buckets_destroy(dpar_buckets *b);

/* ============================================================================================== */
/* >>steal: work stealing between thread ranks                                                   */
/* ============================================================================================== */
/* dpar_steal: work stealing between thread ranks (>>steal): a straggler's work finished by the ranks ahead of it.
   Round:    every rank calls dpar_steal_run with its work as a list of tasks and runs them from the front; a
             rank that has run out of its own takes tasks from the back of the list with the most left, and
             runs them with their owner's task and user pointer (thread ranks share memory).
   done:     the owner's done sees each of its tasks in order, on the owner's thread, as soon as it has run
             wherever it ran: the place to mark gradients ready (dpar_buckets_ready).
   Results:  when a task's result does not depend on the thread that runs it (dpar_sgemm's does not), bitwise
             the same however the tasks were shared.
   See:      docs/data_parallel.md, 'Work stealing' (why: the pace of the slowest rank). */
typedef struct dpar_steal dpar_steal;
/* dpar_steal_desc: how to make a rank's work-stealing state; a zero field means its default. */
typedef struct dpar_steal_desc {
    dpar_comm *comm;          /* required: a comm of thread ranks */
    int max_tasks;            /* required: the longest list this rank will run, 1 to 1048575 */
    dpar_allocator allocator; /* this rank's memory (zero: malloc/free, not the comm's) */
} dpar_steal_desc;
/* dpar_steal_create: make this rank's work-stealing state.
   Remarks:  on a comm of one rank nothing is shared and the rounds cost nothing.
   Returns:  DPAR_OK; DPAR_EUNSUPPORTED (on every rank) on an MPI or hybrid comm; DPAR_EINVAL (NULL desc, comm or
             out; max_tasks out of range or half an allocator, which poisons the comm); DPAR_ENOMEM. On error *out
             is NULL.
   Thread safety: the rank's thread; collective over a comm of thread ranks. */
DPAR_API dpar_status dpar_steal_create(const dpar_steal_desc *desc, dpar_steal **out);
/* dpar_steal_task_fn / dpar_steal_done_fn: a task of dpar_steal_run, run by rank `by`; the owner's note that
   task `index` has run. Returns: DPAR_OK or an error (dpar_set_error). */
typedef dpar_status (*dpar_steal_task_fn)(void *user, int index, int by);
typedef dpar_status (*dpar_steal_done_fn)(void *user, int index);
/* dpar_steal_run: one round: run this rank's tasks 0..n-1, helped by the ranks ahead, and help the others.
   task:     task(user, i, by) for each i; by = the rank whose thread runs it (for per-thread scratch and
             timers). It must not wait for other ranks (no collectives in it) and must touch only its own part
             of the owner's memory: it runs beside the owner's other tasks.
   done:     may be NULL; done(user, i) runs on this thread, in order of i, once tasks 0..i have all run.
   Remarks:  while others run its last tasks, and after, this rank runs tasks of the others' lists of the same
             round. It returns once each of its own tasks has run and been seen by done, and every rank has
             posted its list of the round and none has a task left to take (a rank's last tasks may still be
             running on their takers).
   Returns:  DPAR_OK; the first failure of a task or done, with the message of the thread it failed on (it
             ends the list: no more of its tasks start, those running finish); DPAR_ETIMEDOUT naming a rank
             that never posted its list, or naming a task of this rank that another rank took and that is
             still running at the comm's timeout (the comm is poisoned; keep this state and the task's memory
             until the taker has returned from it); the comm's poison; DPAR_EINVAL (n outside 0..max_tasks, a NULL task
             with n > 0), which poisons the comm so that the others do not wait.
   Thread safety: the rank's thread, once per round on every rank (collective; n may differ, 0 too); task on
             any rank's thread, done on this one. */
DPAR_API dpar_status dpar_steal_run(dpar_steal *s, int n, dpar_steal_task_fn task, dpar_steal_done_fn done, void *user);
/* dpar_steal_counts: since dpar_steal_create, the tasks this rank took and gave.
   taken:    tasks of other ranks this rank has run; may be NULL.
   given:    tasks of this rank that other ranks have run; may be NULL.
   Thread safety: the rank's thread. */
DPAR_API void dpar_steal_counts(const dpar_steal *s, uint64_t *taken, uint64_t *given);
/* dpar_steal_destroy: free this rank's state, after its last dpar_steal_run (other ranks may still be in theirs).
   Returns:  DPAR_OK (also for NULL).
   Thread safety: the rank's thread. */
DPAR_API dpar_status dpar_steal_destroy(dpar_steal *s);

/* ============================================================================================== */
/* >>idx: IDX data files (the MNIST format)                                                      */
/* ============================================================================================== */
/* dpar_idx: an IDX file (the MNIST format) loaded as floats.
   Format:   big-endian magic 0x0000TTDD (TT the type, DD the dimensions), then one big-endian u32 size per
             dimension, then the data.
   See:      docs/data_parallel.md, 'IDX files (MNIST)'. */
typedef struct dpar_idx {
    int ndims;
    uint32_t dims[8];
    size_t count; /* product of dims */
    float *data;
    dpar_allocator allocator;
} dpar_idx;
/* dpar_idx_desc: which IDX file to load, and how; a zero field means its default. */
typedef struct dpar_idx_desc {
    const char *path;         /* required */
    float scale;              /* u8 files: each byte times scale (e.g. 1.0f / 255); 0: 1. f32 files: unused */
    dpar_allocator allocator; /* where idx->data comes from (zero: malloc/free) */
} dpar_idx_desc;
/* dpar_idx_init: read an IDX file of u8 (type 0x08) or f32 (0x0D) into floats, checking every size against the file.
   Returns:  DPAR_OK; DPAR_ECORRUPT with what is wrong for a truncated or malformed file (never a crash),
             DPAR_EUNSUPPORTED (another element type), DPAR_EIO (the file cannot be opened or sized),
             DPAR_EINVAL (NULL idx, desc or path, half an allocator), DPAR_ENOMEM. On error *idx is zeroed.
   Remarks:  free idx->data with dpar_idx_destroy.
   Thread safety: any thread. */
DPAR_API dpar_status dpar_idx_init(dpar_idx *idx, const dpar_idx_desc *desc);
/* dpar_idx_destroy: free idx->data and zero *idx.
   Returns:  DPAR_OK (also for NULL or a zeroed dpar_idx).
   Thread safety: any thread. */
DPAR_API dpar_status dpar_idx_destroy(dpar_idx *idx);

/* ============================================================================================== */
/* >>ckpt: checkpoints                                                                            */
/* ============================================================================================== */
/* dpar_ckpt_item: one named item of a checkpoint (parameters, optimizer state, the step counter...).
   Files:    each rank writes its items to `path.g<generation>.r<rank>`; then rank 0 writes the manifest `path`, which
             names the generation, every shard's size and CRC-32 and every planned tensor's blocks: the manifest is
             the commit point. Old generations are removed once the new manifest is in place.
   Plans:    an item with a shard plan (elem > 0) is this rank's block of a global rows x cols tensor (row-major; a
             vector is 1 x n): rows [row0, row0 + nrows) x columns [col0, col0 + ncols), held row-major in data, bytes =
             nrows x ncols x elem. A block held by several ranks (a replica: dp copies, or the whole tensor on every
             rank) is written once. Such an item loads into ANY layout and world size: the loader reads what it asks
             for out of whichever shards hold it, bitwise. The blocks of all ranks must tile the tensor (no overlap, no
             hole). Fill a plan with dpar_ckpt_replica / _flat / _block / _shard below.
   Without:  an item without a plan (elem 0: a zeroed item, or dpar_ckpt_own) is this rank's own; it loads only into
             the same rank of the same world size (checkpoints written before plans existed load this way).
   Zero it:  fields added later are zero in an item made by the constructors below or zeroed first
             (dpar_ckpt_item it = {0}); a plan that does not add up to `bytes` is refused (DPAR_EINVAL).
   Disk:     a planned item may be read out of other ranks' shards (another layout; a replica, written once by its
             first holder): every rank must then see the checkpoint's directory (a shared file system). Items
             without a plan are read from the rank's own shard only.
   Crashes:  every file is written to a temporary name, fsynced and renamed, so a crash at any moment leaves
             the previous checkpoint whole.
   Loading:  checks the manifest, the shards, every item's name, size and CRC: a damaged or mismatched file is
             DPAR_ECORRUPT naming what is wrong, never a silent wrong load.
   See:      docs/data_parallel.md, 'Checkpoints'. */
typedef struct dpar_ckpt_item {
    const char *name; /* at most 63 characters */
    void *data;
    size_t bytes;
    size_t elem;        /* the shard plan: bytes of an element (0: no plan, this rank's own item) */
    size_t rows, cols;  /* the global tensor: rows x cols elements */
    size_t row0, nrows; /* this rank's block: rows [row0, row0 + nrows) */
    size_t col0, ncols; /* and columns [col0, col0 + ncols) */
} dpar_ckpt_item;

/* dpar_ckpt_own / _replica / _flat / _block / _shard: an item, its plan filled in.
   own:      this rank's own bytes, no plan (a random generator's state...).
   replica:  the same bytes on every rank (the step, the sampler's position, unsharded weights): stored once, loads
             into any layout.
   flat:     elements [offset, offset + count) of a vector of `total` (a ZeRO shard: dpar_block_range's block).
   block:    rows [row0, row0 + nrows) x columns [col0, col0 + ncols) of a rows x cols tensor.
   shard:    rank `rank`'s block of a dpar_shard_plan (tensor parallelism: dpar_shard_slice's rows or columns).
   Thread safety: any thread. */
DPAR_API dpar_ckpt_item dpar_ckpt_own(const char *name, void *data, size_t bytes);
DPAR_API dpar_ckpt_item dpar_ckpt_replica(const char *name, void *data, size_t bytes);
DPAR_API dpar_ckpt_item dpar_ckpt_flat(const char *name, void *data, size_t elem, size_t total, size_t offset,
                                       size_t count);
DPAR_API dpar_ckpt_item dpar_ckpt_block(const char *name, void *data, size_t elem, size_t rows, size_t cols,
                                        size_t row0, size_t nrows, size_t col0, size_t ncols);
DPAR_API dpar_ckpt_item dpar_ckpt_shard(const char *name, void *data, size_t elem, const dpar_shard_plan *plan,
                                        int rank);

/* dpar_ckpt_save / dpar_ckpt_load: write this rank's items as a checkpoint / fill them back from one.
   comm:     NULL: one process, one rank.
   items:    this rank's own items (ranks may hold different tensors: pipeline stages). Load asks for any of the saved
             items by name (a subset is fine), in any layout for planned ones.
   Returns:  DPAR_OK; DPAR_EINVAL (path NULL or empty; bad items: names of 1..63 characters, unique, data for every
             byte count, a plan outside its tensor or not of `bytes`; save: ranks whose blocks of a tensor disagree
             on its shape, overlap or leave a hole); load: DPAR_EIO (no checkpoint at path; the message says so),
             DPAR_ECORRUPT (see dpar_ckpt_item; a layout the checkpoint cannot fill: the message names the tensor and
             the reason: not in the checkpoint, another shape or element size, an item without a plan asked in another
             world size); DPAR_ENOMEM; the comm's errors. When one rank fails to write or read, every rank returns an
             error (the others' message says another rank failed). A load that fails on a damaged shard may have
             filled some items already.
   Thread safety: the rank's thread; collective over comm. */
DPAR_API dpar_status dpar_ckpt_save(dpar_comm *comm, const char *path, const dpar_ckpt_item *items, int count);
DPAR_API dpar_status dpar_ckpt_load(dpar_comm *comm, const char *path, const dpar_ckpt_item *items, int count);
/* dpar_ckpt_save_zero / _load_zero, dpar_ckpt_save_fsdp / _load_fsdp: a ZeRO-1 optimizer or an FSDP model, with the
   caller's extra items (the sampler's position, the step...), in one call, over the object's comm. Each planned
   item is named `prefix` + what it is (prefix NULL: "zero." or "fsdp."): zero: "params" (each rank writes its block;
   a load fills them all), "m" and "v" (the optimizer state's flat shards) and "step"; fsdp: per unit u "u<u>.param"
   (the fp32 master weights) and "u<u>.m", "u<u>.v" (the optimizer's), flat shards of the unit, and "state" (the
   step and the loss scale). They load into a
   zero / fsdp of another rank count (the same units, kind and element counts): bitwise the same parameters and
   state, as if trained there. Load needs no unit held (dpar_fsdp_release every gathered one first).
   Device:   state in device memory (dpar_comm_memory) is staged through host memory: its to_host and from_host
             callbacks copy this rank's shards (a load: and zero's whole params) to a host buffer of that size made
             for the call; without them, DPAR_EUNSUPPORTED. A copy that fails on one rank (or its buffer) makes every
             rank return an error, the failing rank the callback's (an agreement, also on a library's comm; the comm
             is not poisoned). The file is the same as host memory's: a checkpoint saved on a GPU loads on host ranks
             and back.
   params:   zero: the `count` parameters of dpar_zero_step, the same on every rank (device memory on such a comm).
   Returns:  as dpar_ckpt_save / _load; DPAR_EINVAL (NULL object or params, a prefix too long, a unit gathered or
             its gradients not reduced); DPAR_EUNSUPPORTED (device memory without to_host / from_host).
   Thread safety: the rank's thread; collective over the object's comm. */
DPAR_API dpar_status dpar_ckpt_save_zero(dpar_zero *zero, float *params, const char *path, const char *prefix,
                                         const dpar_ckpt_item *extra, int count);
DPAR_API dpar_status dpar_ckpt_load_zero(dpar_zero *zero, float *params, const char *path, const char *prefix,
                                         const dpar_ckpt_item *extra, int count);
DPAR_API dpar_status dpar_ckpt_save_fsdp(dpar_fsdp *fsdp, const char *path, const char *prefix,
                                         const dpar_ckpt_item *extra, int count);
DPAR_API dpar_status dpar_ckpt_load_fsdp(dpar_fsdp *fsdp, const char *path, const char *prefix,
                                         const dpar_ckpt_item *extra, int count);
/* dpar_ckpt_check: before a run's first step, that `path` can take the checkpoint the run will save, and that a
   fresh run does not replace one by accident (found after the whole run, a bad path loses the run; found never,
   a fresh run replaces the checkpoint of a long one).
   flags:    0: a fresh run (path must hold no checkpoint); DPAR_CKPT_RESUME: the run continues from the
             checkpoint at path (it must be there); DPAR_CKPT_OVERWRITE: a fresh run that may replace the checkpoint
             at path (any file there: dpar_ckpt_save replaces it).
   Returns:  DPAR_OK; DPAR_EINVAL (path NULL or empty, ending in '/' or naming a directory; flags not one of the
             three); DPAR_EIO (path's directory missing or not writable; RESUME and nothing at path);
             DPAR_EEXIST (a fresh run over a file at path: the message says whether it is a checkpoint; the
             caller adds how to resume or overwrite in its own words). The message names the path.
   Remarks:  it reads the file system only, no comm: call it on every rank that will write (each rank writes its
             shard beside path) or, with a shared file system, on one rank and broadcast the result.
   Thread safety: any thread. */
#define DPAR_CKPT_RESUME 1
#define DPAR_CKPT_OVERWRITE 2
DPAR_API dpar_status dpar_ckpt_check(const char *path, int flags);
/* dpar_crc32: the CRC-32 of zlib and PNG (polynomial 0xEDB88320).
   crc:      the CRC so far, to continue from (start with 0).
   Thread safety: any thread. */
DPAR_API uint32_t dpar_crc32(uint32_t crc, const void *data, size_t bytes);

/* >>mpi: the communicator over MPI (define DPAR_MPI before the include; build with mpicc) */
#ifdef DPAR_MPI
/* dpar_comm_from_mpi: make a comm on the processes of `mpi_comm`; every call of the comm API works on it.
   mpi_comm: dpar works on a duplicate, so its messages never meet the program's. MPI must be initialised.
   desc:     may be NULL; its size is ignored.
   Remarks:  async requests need MPI_THREAD_MULTIPLE.
   Returns:  DPAR_OK; DPAR_EINVAL (NULL out, MPI_COMM_NULL, bad timeout_ms or spin_us, half an allocator; a
             malformed DPAR_FAULT, DPAR_TIMEOUT_MS, DPAR_LOG or DPAR_TRACE on any process: every process fails,
             the others naming that process), DPAR_ESTATE (MPI is not initialised), DPAR_EUNSUPPORTED
             (deterministic on a number of processes that is not a power of two), DPAR_ESYSTEM (MPI_Comm_dup
             failed), DPAR_ENOMEM.
   Thread safety: the rank's thread; collective over mpi_comm.
   See:      docs/mpi.md. */
DPAR_API dpar_status dpar_comm_from_mpi(MPI_Comm mpi_comm, const dpar_comm_desc *desc, dpar_comm **out);

/* ============================================================================================== */
/* >>hybrid: one comm over processes x threads (DPAR_MPI)                                        */
/* ============================================================================================== */
/* dpar_group_join_mpi: join `local` as `local_rank` and the processes of `mpi_comm`: the hybrid comm.
   Ranks:    (process, thread) pairs, world rank = process * T + thread.
   local:    the group where the T = local->size threads of every process meet (the same T everywhere).
   local_rank: the calling thread's index, 0..T-1.
   Remarks:  allreduce is hierarchical (threads through shared memory, one leader per process over MPI); the
             other calls go over MPI.
   Returns:  DPAR_OK; DPAR_EUNSUPPORTED (MPI gives less than MPI_THREAD_MULTIPLE, naming the level; deterministic
             on a size that is not a power of two), DPAR_EINVAL (NULL out or local, local_rank out of range,
             processes with different T), DPAR_EBUSY (local_rank has already joined), DPAR_ESTATE (MPI is not
             initialised), DPAR_ESYSTEM (MPI_Comm_dup failed), DPAR_ENOMEM. Every thread of a process returns
             thread 0's code when thread 0's part fails. On error *out is NULL.
   Thread safety: the thread of that rank; collective over the threads and the processes of `mpi_comm`.
   See:      docs/mpi.md, 'Processes x threads: the hybrid comm'. */
DPAR_API dpar_status dpar_group_join_mpi(dpar_group *local, int local_rank, MPI_Comm mpi_comm, dpar_comm **out);
#endif

#ifdef __cplusplus
}
#endif
#endif /* DPAR_H_INCLUDED */

/* ============================================================================================== */
/* >>impl                                                                                          */
/* ============================================================================================== */
#if defined(DPAR_IMPLEMENTATION) && !defined(DPAR__IMPLEMENTATION_DONE)
#define DPAR__IMPLEMENTATION_DONE

/* >>config: system headers, option defaults, thread-local storage, atomics ---------------------- */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h> /* dpar_ckpt_check */
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
#ifdef DPAR_OPENBLAS
#include <cblas.h>
#endif
#ifdef DPAR_MPI
#include <sys/mman.h> /* the block the processes of a node share (>>mpi) */
#endif
#if !defined(CLOCK_MONOTONIC)
#error "dpar.h: CLOCK_MONOTONIC is missing: include dpar.h before system headers, or compile with -D_DEFAULT_SOURCE"
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

/* >>status: the error text, status strings ------------------------------------------------------ */
/* return the status of a call that failed, as it is */
#define DPAR__TRY(expr)                 \
    do {                                \
        dpar_status st_ = (expr);       \
        if (st_ != DPAR_OK) return st_; \
    } while (0)

#define DPAR__ERROR_TEXT 512
static DPAR__TLS char dpar__tls_error[DPAR__ERROR_TEXT];

DPAR_API const char *dpar_status_string(dpar_status status)
{
    switch (status) {
#define DPAR__STATUS_CASE(name, value, text) \
    case name: return text " (" #name ")";
        DPAR_STATUS_LIST(DPAR__STATUS_CASE)
#undef DPAR__STATUS_CASE
    }
    return "unknown status (not a dpar_status)";
}

DPAR_API const char *dpar_last_error(void) { return dpar__tls_error; }

DPAR_API void dpar_clear_error(void) { dpar__tls_error[0] = 0; }

/* formatted aside first: a message may quote the previous one (dpar_last_error() as an argument) */
static dpar_status dpar__verror(dpar_status status, const char *fmt, va_list ap)
{
    char text[DPAR__ERROR_TEXT];
    vsnprintf(text, sizeof text, fmt, ap);
    memcpy(dpar__tls_error, text, strlen(text) + 1);
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

/* >>log: the sink, levels, DPAR_LOG ------------------------------------------------------------- */
static pthread_mutex_t dpar__log_mutex = PTHREAD_MUTEX_INITIALIZER;
static dpar_log_fn dpar__log_fn = NULL;
static void *dpar__log_user = NULL;
static int dpar__log_level = -1; /* -1: not read from DPAR_LOG yet */

/* the level DPAR_LOG's value names; -1 for none (pool and comm creation then fail: dpar__env_check) */
static int dpar__log_level_of(const char *s)
{
    if (!strcmp(s, "off") || !strcmp(s, "none")) return DPAR_LOG_OFF;
    if (!strcmp(s, "error")) return DPAR_LOG_ERROR;
    if (!strcmp(s, "warn") || !strcmp(s, "warning")) return DPAR_LOG_WARN;
    if (!strcmp(s, "info")) return DPAR_LOG_INFO;
    if (!strcmp(s, "debug")) return DPAR_LOG_DEBUG;
    return -1;
}
static int dpar__log_level_from_env(void)
{
    const char *s = getenv("DPAR_LOG");
    int level = s && *s ? dpar__log_level_of(s) : DPAR_LOG_WARN;
    if (level >= 0) return level;
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

DPAR_API void dpar_log_set_callback(dpar_log_fn fn, void *user)
{
    pthread_mutex_lock(&dpar__log_mutex);
    dpar__log_fn = fn;
    dpar__log_user = user;
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
    if (dpar__log_fn) dpar__log_fn(dpar__log_user, level, file, line, msg);
    else fprintf(stderr, "dpar %s: %s\n", names[level], msg);
    pthread_mutex_unlock(&dpar__log_mutex);
}

#define DPAR__LOG(level, ...) dpar_log_message((level), __FILE__, __LINE__, __VA_ARGS__)

/* >>alloc: the allocator hook, aligned blocks --------------------------------------------------- */
/* 64-byte aligned blocks from the user's allocator: the raw pointer sits just before the block. */
static void *dpar__alloc(const dpar_allocator *a, size_t size)
{
    size_t total;
    unsigned char *raw, *p;
    if (size > SIZE_MAX - DPAR__CACHE_LINE - sizeof(void *)) return NULL;
    total = size + DPAR__CACHE_LINE + sizeof(void *);
    raw = (unsigned char *)(a && a->alloc ? a->alloc(a->user, total) : malloc(total));
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
    if (a && a->free) a->free(a->user, raw);
    else free(raw);
}

static dpar_status dpar__check_allocator(const char *fn, const dpar_allocator *a)
{
    if ((a->alloc == NULL) != (a->free == NULL))
        return dpar__err(DPAR_EINVAL, "%s: the allocator sets only one of alloc and free; set both or neither", fn);
    return DPAR_OK;
}

/* >>time: the clock; waits that spin, then sleep on a futex; CPU placement ---------------------- */
static uint64_t dpar__monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The clock every call reads twice (its deadline and its counters) and every wait reads as it spins. On
   x86-64 Linux with an invariant time-stamp counter, and a kernel that keeps time by it (clocksource tsc,
   or kvm-clock, which scales the host's TSC), it is the TSC scaled to nanoseconds: rdtsc costs about 10 ns
   (20 fenced) where clock_gettime cost 25 on the development VM (47% of a 4-byte allreduce on one rank). The
   scale is measured against CLOCK_MONOTONIC between the first call and the first call at least 20 ms
   later (each end the narrowest of 5 readings); until then, and where the TSC does not qualify, the clock
   is CLOCK_MONOTONIC. DPAR_NO_TSC (compile time) or DPAR_CLOCK=monotonic (at the first call) keep
   CLOCK_MONOTONIC. Ticking with the TSC, it drifts from CLOCK_MONOTONIC by the measured scale's error
   (some ppm) and does not follow NTP's slewing. dpar_time_ns fences its rdtsc, so a reading is never below
   one another thread took before (through memory); the library's own durations and deadlines read without
   the fence (dpar__now_ns). */
#if defined(__x86_64__) && defined(__linux__) && !defined(DPAR_NO_TSC)
#define DPAR__TSC 1
#else
#define DPAR__TSC 0
#endif
#if DPAR__TSC
enum { DPAR__TSC_UNSEEN, DPAR__TSC_FIRST, DPAR__TSC_BUSY, DPAR__TSC_READY, DPAR__TSC_OFF };
#define DPAR__TSC_BASELINE_NS 20000000u /* the calibration's baseline */
static int dpar__tsc_state;             /* DPAR__TSC_*: READY is stored (release) after the scale below */
static uint64_t dpar__tsc_t1, dpar__tsc_n1, dpar__tsc_w1;   /* the first reading: ticks, ns, width */
static uint64_t dpar__tsc_t0, dpar__tsc_n0, dpar__tsc_mult; /* ns = n0 + (ticks - t0) x mult / 2^32 */

/* rdtsc may read the counter before earlier loads complete: 10 ns a call here, but a reading taken after another
   thread's (seen through memory) could be up to 0.2 us smaller; lfence first orders it (20 ns) */
static uint64_t dpar__rdtsc(void)
{
    uint32_t lo, hi;
    __asm__ __volatile__("rdtsc" : "=a"(lo), "=d"(hi));
    return ((uint64_t)hi << 32) | lo;
}
static uint64_t dpar__rdtsc_ordered(void)
{
    uint32_t lo, hi;
    __asm__ __volatile__("lfence\n\trdtsc" : "=a"(lo), "=d"(hi)::"memory");
    return ((uint64_t)hi << 32) | lo;
}
/* a (ticks, ns) reading: the narrowest of 5 rdtsc / clock_gettime / rdtsc; *width: its width in ticks */
static uint64_t dpar__tsc_reading(uint64_t *ns, uint64_t *width)
{
    uint64_t t = 0, w = UINT64_MAX;
    int i;
    for (i = 0; i < 5; i++) {
        uint64_t a = dpar__rdtsc_ordered(), n = dpar__monotonic_ns(), b = dpar__rdtsc_ordered();
        if (b >= a && b - a < w) w = b - a, t = a + (b - a) / 2, *ns = n;
    }
    *width = w;
    return t;
}
/* an invariant TSC (CPUID 0x80000007, EDX bit 8) that the kernel keeps time by, and no DPAR_CLOCK=monotonic */
static int dpar__tsc_qualifies(void)
{
    uint32_t r[4]; /* eax, ebx, ecx, edx */
    char src[32] = {0};
    const char *env = getenv("DPAR_CLOCK");
    FILE *f;
    if (env && *env && strcmp(env, "tsc") != 0) {
        if (strcmp(env, "monotonic") != 0) DPAR__LOG(DPAR_LOG_WARN, "DPAR_CLOCK=%s is not tsc or monotonic", env);
        return 0;
    }
    __asm__ __volatile__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(0x80000000u), "c"(0u));
    if (r[0] < 0x80000007u) return 0;
    __asm__ __volatile__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(0x80000007u), "c"(0u));
    if (!(r[3] & (1u << 8))) return 0;
    if (!(f = fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r"))) return 0;
    if (!fgets(src, sizeof src, f)) src[0] = 0;
    fclose(f);
    return !strcmp(src, "tsc\n") || !strcmp(src, "kvm-clock\n");
}
/* before the scale is known: CLOCK_MONOTONIC, and the calibration's two readings */
static uint64_t dpar__tsc_slow(int s)
{
    uint64_t now = dpar__monotonic_ns(), w, n2 = 0, t2, ticks, ns, mult;
    int busy = DPAR__TSC_UNSEEN;
    if (s == DPAR__TSC_UNSEEN) {
        if (__atomic_compare_exchange_n(&dpar__tsc_state, &busy, DPAR__TSC_BUSY, 0, DPAR__ACQ_REL, DPAR__RELAXED)) {
            if (!dpar__tsc_qualifies()) {
                DPAR__STORE(&dpar__tsc_state, DPAR__TSC_OFF, DPAR__RELEASE);
            } else {
                dpar__tsc_t1 = dpar__tsc_reading(&n2, &dpar__tsc_w1);
                DPAR__STORE(&dpar__tsc_n1, n2, DPAR__RELAXED); /* others read it to know when to calibrate */
                DPAR__STORE(&dpar__tsc_state, DPAR__TSC_FIRST, DPAR__RELEASE);
            }
        }
        return now;
    }
    busy = DPAR__TSC_FIRST;
    if (s != DPAR__TSC_FIRST || now - DPAR__LOAD(&dpar__tsc_n1, DPAR__RELAXED) < DPAR__TSC_BASELINE_NS ||
        !__atomic_compare_exchange_n(&dpar__tsc_state, &busy, DPAR__TSC_BUSY, 0, DPAR__ACQ_REL, DPAR__RELAXED))
        return now;
    t2 = dpar__tsc_reading(&n2, &w);
    ticks = t2 - dpar__tsc_t1;
    ns = n2 - DPAR__LOAD(&dpar__tsc_n1, DPAR__RELAXED);
    /* a long baseline (the second call came late) would overflow ns x 2^32, wide readings (preempted between
       their reads) would spoil the scale by more than 50 ppm: start again from this reading */
    if (t2 <= dpar__tsc_t1 || ns >= ((uint64_t)1 << 31) || w + dpar__tsc_w1 > ticks / 10000u) {
        dpar__tsc_t1 = t2, dpar__tsc_w1 = w;
        DPAR__STORE(&dpar__tsc_n1, n2, DPAR__RELAXED);
        DPAR__STORE(&dpar__tsc_state, DPAR__TSC_FIRST, DPAR__RELEASE);
        return now;
    }
    mult = (ns << 32) / ticks;
    if (mult >= ((uint64_t)1 << 32) || mult < ((uint64_t)1 << 32) / 20u) { /* outside 1 to 20 GHz */
        DPAR__STORE(&dpar__tsc_state, DPAR__TSC_OFF, DPAR__RELEASE);
        return now;
    }
    dpar__tsc_t0 = t2;
    dpar__tsc_mult = mult;
    /* a step forward by the reading's width and 1 us: no thread's next reading is below a CLOCK_MONOTONIC
       one it took before the switch */
    dpar__tsc_n0 = n2 + ((w * mult) >> 32) + 1000u;
    DPAR__STORE(&dpar__tsc_state, DPAR__TSC_READY, DPAR__RELEASE);
    return now;
}
static uint64_t dpar__tsc_ns(uint64_t ticks)
{
    uint64_t d = ticks - dpar__tsc_t0, m = dpar__tsc_mult;
    if ((int64_t)d < 0) d = 0; /* a reading a little before the calibration's (another CPU's, or unordered) */
    return dpar__tsc_n0 + (d >> 32) * m + (((d & 0xffffffffu) * m) >> 32);
}
#endif

/* the clock: fenced (dpar_time_ns), or not (dpar__now_ns: the library's own durations, deadlines and spin budgets,
   where a reading up to 0.2 us early against another thread's does not matter; 10 ns instead of 20 here) */
static uint64_t dpar__clock_ns(int fenced)
{
#if DPAR__TSC
    int s = DPAR__LOAD(&dpar__tsc_state, DPAR__ACQUIRE);
    if (s == DPAR__TSC_READY) return dpar__tsc_ns(fenced ? dpar__rdtsc_ordered() : dpar__rdtsc());
    return dpar__tsc_slow(s);
#else
    (void)fenced;
    return dpar__monotonic_ns();
#endif
}
DPAR_API uint64_t dpar_time_ns(void) { return dpar__clock_ns(1); }
static uint64_t dpar__now_ns(void) { return dpar__clock_ns(0); }
/* nanoseconds since t0 (a dpar__now_ns reading), never below 0 (a thread moved to a CPU whose counter is behind) */
static uint64_t dpar__since(uint64_t t0)
{
    uint64_t now = dpar__now_ns();
    return now > t0 ? now - t0 : 0;
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
                                    uint64_t deadline_ns, int *parked)
{
    uint64_t t_end;
    unsigned i;
    if (DPAR__LOAD(word, DPAR__ACQUIRE) != val) return DPAR_OK;
    if (spin.spin_ns) {
        /* Poll with pause; after DPAR__YIELD_NS without progress, yield now and then, so that a
           thread we wait for that shares our CPU gets to run (oversubscribed pools yield always). */
        uint64_t now = dpar__now_ns(), t_yield = now + (spin.yield ? 0 : DPAR__YIELD_NS);
        t_end = now + spin.spin_ns;
        for (i = 1;; i++) {
            dpar__cpu_relax();
            if (DPAR__LOAD(word, DPAR__ACQUIRE) != val) return DPAR_OK;
            if ((i & 15) != 0) continue;
            now = dpar__now_ns();
            if (now >= t_end) break;
            if (now >= t_yield) {
                sched_yield();
                t_yield = now + (spin.yield ? 0 : DPAR__YIELD_NS);
                if (DPAR__LOAD(word, DPAR__ACQUIRE) != val) return DPAR_OK;
            }
        }
    }
    if (parked) *parked = 1;
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

/* >>trace: the Chrome trace-event sink ---------------------------------------------------------- */
static pthread_mutex_t dpar__trace_mutex = PTHREAD_MUTEX_INITIALIZER;
static FILE *dpar__trace_file = NULL;
static int dpar__trace_on = 0; /* read relaxed on hot paths */
static uint64_t dpar__trace_t0 = 0;
static uint32_t dpar__trace_session = 0; /* bumped by every start; threads re-emit their names */
static int dpar__trace_events = 0;
static int dpar__trace_next_track = 0;
static int dpar__trace_env_checked = 0;
static dpar_status dpar__trace_env_status = DPAR_OK; /* DPAR_TRACE's start failed: why, in the text below */
static char dpar__trace_env_bad[256];
static int dpar__pool_next_id = 0; /* names pools' tracks */

static DPAR__TLS int dpar__tls_track = 0;
static DPAR__TLS uint32_t dpar__tls_track_session = 0;
static DPAR__TLS char dpar__tls_track_name[64];

DPAR_API int dpar_trace_enabled(void) { return DPAR__LOAD(&dpar__trace_on, DPAR__RELAXED); }

static void dpar__json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
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

/* DPAR_TRACE=file.json starts a trace the first time a pool (or comm) is created (unless the program started one).
   Returns: DPAR_OK, or, at that time and every time after, why the file could not be started (the text in
   dpar__trace_env_bad): dpar__env_check makes it the creation's error. */
static dpar_status dpar__trace_from_env(void)
{
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    const char *path;
    dpar_status st;
    pthread_mutex_lock(&lock);
    if (!DPAR__LOAD(&dpar__trace_env_checked, DPAR__ACQUIRE)) {
        DPAR__STORE(&dpar__trace_env_checked, 1, DPAR__RELEASE);
        dpar__trace_env_status = DPAR_OK, dpar__trace_env_bad[0] = 0;
        path = getenv("DPAR_TRACE");
        if (path && *path && !dpar_trace_enabled()) {
            if ((st = dpar_trace_start(path)) == DPAR_OK) {
                atexit(dpar__trace_stop_at_exit);
            } else {
                dpar__trace_env_status = st;
                snprintf(dpar__trace_env_bad, sizeof dpar__trace_env_bad, "DPAR_TRACE=\"%.64s\": %.160s", path,
                         dpar_last_error());
            }
        }
    }
    st = dpar__trace_env_status;
    pthread_mutex_unlock(&lock);
    return st;
}

DPAR_API void dpar_trace_set_thread_name(const char *name)
{
    size_t n = name ? strlen(name) : 0;
    if (n >= sizeof dpar__tls_track_name) n = sizeof dpar__tls_track_name - 1;
    memcpy(dpar__tls_track_name, name ? name : "", n);
    dpar__tls_track_name[n] = 0;
    dpar__tls_track_session = 0; /* emit the (new) name with the next event */
}

/* the process's first thread (Linux: its thread id is the process id); elsewhere never said */
static int dpar__is_main_thread(void)
{
#if defined(__linux__) && defined(SYS_gettid)
    return (long)syscall(SYS_gettid) == (long)getpid();
#else
    return 0;
#endif
}

/* Called with the trace mutex held: the thread's track id, and its name once per trace (an unnamed one: "main
   thread", or "user thread N" where N is its track, so it is never taken for a pool's "pool0 thread N") */
static int dpar__trace_track_locked(void)
{
    if (!dpar__tls_track) dpar__tls_track = ++dpar__trace_next_track;
    if (dpar__tls_track_session != dpar__trace_session) {
        dpar__tls_track_session = dpar__trace_session;
        dpar__trace_sep();
        fprintf(dpar__trace_file,
                "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%ld,\"tid\":%d,\"args\":{\"name\":", (long)getpid(),
                dpar__tls_track);
        if (dpar__tls_track_name[0]) dpar__json_string(dpar__trace_file, dpar__tls_track_name);
        else if (dpar__is_main_thread()) fputs("\"main thread\"", dpar__trace_file);
        else fprintf(dpar__trace_file, "\"user thread %d\"", dpar__tls_track); /* not "thread N": workers are */
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

/* >>fault: DPAR_FAULT and dpar_fault_set: the parser, the schedule, the counting of operations ---- */
/* Operation kinds: 0..DPAR_COLL_COUNT - 1 are dpar_coll's values (the comm's calls; split is never one: its name is
   refused), then the callbacks. */
enum {
    DPAR__FOP_BUCKET = DPAR_COLL_COUNT,
    DPAR__FOP_STAGE,
    DPAR__FOP_STEAL,
    DPAR__FOP_TASK,
    DPAR__FOP_ANY,
    DPAR__FOP_COUNT
};
static const char *const dpar__fop_names[DPAR__FOP_COUNT] = {
    "send",     "recv",  "barrier",   "broadcast", "reduce", "reduce_scatter", "allgather", "allreduce",
    "alltoall", "split", "alltoallv", "bucket",    "stage",  "steal",          "task",      "any"};
enum { DPAR__FAULT_DELAY = 1, DPAR__FAULT_VANISH = 2, DPAR__FAULT_FAIL = 3 };
#define DPAR__FAULT_MAX 16

typedef struct dpar__fault {
    int kind, rank, op, ms; /* rank -1: every rank */
    uint64_t at;
    char comm[32]; /* "": every comm */
    char text[96]; /* the fault as written, for the messages */
} dpar__fault;

/* a schedule; the copy a comm or pool makes of it also counts its operations */
typedef struct dpar__faults {
    int n;
    dpar__fault f[DPAR__FAULT_MAX];
    char bad[DPAR__ERROR_TEXT];      /* not empty: DPAR_FAULT is malformed, and this says how */
    uint64_t count[DPAR__FOP_COUNT]; /* operations seen, by kind (atomics: a comm's progress thread counts too) */
    int vanished;                    /* 1 + the fault that made this rank vanish; 0: none */
    dpar_allocator allocator;
} dpar__faults;

static pthread_mutex_t dpar__fault_mutex = PTHREAD_MUTEX_INITIALIZER;
static dpar__faults dpar__fault_sched; /* the schedule new comms and pools copy */
static int dpar__fault_read;           /* 1: DPAR_FAULT read, or dpar_fault_set called */
static dpar__faults dpar__fault_nomem; /* what a comm or pool keeps when its copy could not be allocated */

static int dpar__fault_number(const char *s, size_t n, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;
    size_t i;
    if (!n) return 0;
    for (i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return 0;
        v = v * 10u + (uint64_t)(s[i] - '0');
        if (v > max) return 0;
    }
    *out = v;
    return 1;
}

/* parse `spec` into `out` (zeroed first); on an error the message names `who` and quotes the bad part */
static dpar_status dpar__fault_parse(const char *spec, dpar__faults *out, const char *who)
{
    const char *p = spec;
    int index = 0;
    memset(out, 0, sizeof *out);
    while (p && *p) {
        const char *end = strchr(p, ';'), *q;
        size_t len = end ? (size_t)(end - p) : strlen(p);
        dpar__fault *f;
        int has_rank = 0;
        index++;
        while (len && *p == ' ') p++, len--;
        while (len && p[len - 1] == ' ') len--;
        if (!len) { /* an empty fault (";;" or a trailing ';') */
            p = end ? end + 1 : p + len;
            continue;
        }
        if (len >= sizeof out->f[0].text)
            return dpar__err(DPAR_EINVAL, "%s: fault %d (\"%.40s...\") is longer than %d characters", who, index, p,
                             (int)sizeof out->f[0].text - 1);
        if (out->n == DPAR__FAULT_MAX)
            return dpar__err(DPAR_EINVAL, "%s: more than %d faults (at \"%.*s\")", who, DPAR__FAULT_MAX, (int)len, p);
        f = &out->f[out->n];
        memcpy(f->text, p, len);
        f->text[len] = 0;
        f->rank = -1;
        f->op = DPAR__FOP_ANY;
        f->at = 1;
        for (q = p; q < p + len;) {
            const char *fe = (const char *)memchr(q, ',', (size_t)(p + len - q)), *eq;
            size_t flen = fe ? (size_t)(fe - q) : (size_t)(p + len - q), klen, vlen;
            const char *v;
            uint64_t num = 0;
            int k, ok = 1;
            eq = (const char *)memchr(q, '=', flen);
            if (!eq)
                return dpar__err(DPAR_EINVAL, "%s: \"%.*s\" in fault %d (\"%s\") is not key=value", who, (int)flen, q,
                                 index, f->text);
            klen = (size_t)(eq - q);
            v = eq + 1;
            vlen = flen - klen - 1;
#define DPAR__KEY(name) (klen == sizeof name - 1 && !memcmp(q, name, klen))
            if (DPAR__KEY("rank")) {
                ok = dpar__fault_number(v, vlen, INT32_MAX, &num);
                f->rank = (int)num;
                has_rank = 1;
            } else if (DPAR__KEY("at")) {
                ok = dpar__fault_number(v, vlen, UINT64_MAX / 10u, &num) && num >= 1;
                f->at = num;
            } else if (DPAR__KEY("op")) {
                for (k = 0; k < DPAR__FOP_COUNT; k++)
                    if (strlen(dpar__fop_names[k]) == vlen && !memcmp(v, dpar__fop_names[k], vlen)) break;
                ok = k < DPAR__FOP_COUNT && k != DPAR_COLL_SPLIT;
                f->op = k;
            } else if (DPAR__KEY("comm")) {
                ok = vlen >= 1 && vlen < sizeof f->comm;
                if (ok) memcpy(f->comm, v, vlen);
            } else if (DPAR__KEY("kind")) {
                if (vlen == 4 && !memcmp(v, "fail", 4)) f->kind = DPAR__FAULT_FAIL;
                else if (vlen == 6 && !memcmp(v, "vanish", 6)) f->kind = DPAR__FAULT_VANISH;
                else if (vlen > 6 && !memcmp(v, "delay:", 6) && dpar__fault_number(v + 6, vlen - 6, 3600000u, &num))
                    f->kind = DPAR__FAULT_DELAY, f->ms = (int)num;
                else ok = 0;
            } else {
                return dpar__err(DPAR_EINVAL,
                                 "%s: \"%.*s\" in fault %d (\"%s\"): unknown key (rank, op, at, kind or comm)", who,
                                 (int)flen, q, index, f->text);
            }
#undef DPAR__KEY
            if (!ok)
                return dpar__err(
                    DPAR_EINVAL,
                    "%s: \"%.*s\" in fault %d (\"%s\"): bad value (rank: a number >= 0; at: a number >= 1; "
                    "op: any, barrier, broadcast, reduce, reduce_scatter, allgather, allreduce, alltoall, alltoallv, "
                    "send, recv, bucket, stage, steal, task; kind: fail, vanish, delay:MS with MS <= "
                    "3600000; comm: 1..31 characters)",
                    who, (int)flen, q, index, f->text);
            q += flen + (fe ? 1 : 0);
            if (fe && q == p + len)
                return dpar__err(DPAR_EINVAL, "%s: fault %d (\"%s\") ends with a ','", who, index, f->text);
        }
        if (!f->kind)
            return dpar__err(DPAR_EINVAL, "%s: fault %d (\"%s\") has no kind= (fail, vanish or delay:MS)", who, index,
                             f->text);
        if (f->op == DPAR__FOP_TASK && (has_rank || f->kind == DPAR__FAULT_VANISH))
            return dpar__err(DPAR_EINVAL,
                             "%s: fault %d (\"%s\"): a task belongs to a pool, which has no rank and cannot vanish "
                             "(use fail or delay, without rank=)",
                             who, index, f->text);
        out->n++;
        p = end ? end + 1 : p + len;
    }
    return DPAR_OK;
}

/* read DPAR_FAULT once, unless dpar_fault_set came first (fault mutex held) */
static void dpar__fault_env_locked(void)
{
    const char *env;
    if (dpar__fault_read) return;
    dpar__fault_read = 1;
    env = getenv("DPAR_FAULT");
    if (env && dpar__fault_parse(env, &dpar__fault_sched, "DPAR_FAULT") != DPAR_OK) {
        snprintf(dpar__fault_sched.bad, sizeof dpar__fault_sched.bad, "%s", dpar__tls_error);
        dpar__fault_sched.n = 0;
    }
}

DPAR_API dpar_status dpar_fault_set(const char *spec)
{
    dpar__faults *parsed = (dpar__faults *)malloc(sizeof *parsed);
    dpar_status st;
    if (!parsed) return dpar__err(DPAR_ENOMEM, "dpar_fault_set: out of memory");
    st = dpar__fault_parse(spec, parsed, "dpar_fault_set");
    if (st == DPAR_OK) {
        pthread_mutex_lock(&dpar__fault_mutex);
        dpar__fault_read = 1;
        dpar__fault_sched = *parsed;
        pthread_mutex_unlock(&dpar__fault_mutex);
    }
    free(parsed);
    return st;
}

/* where a pool or comm is made: DPAR_EINVAL when DPAR_FAULT is malformed */
static dpar_status dpar__fault_check(const char *who)
{
    char bad[DPAR__ERROR_TEXT];
    pthread_mutex_lock(&dpar__fault_mutex);
    dpar__fault_env_locked();
    memcpy(bad, dpar__fault_sched.bad, sizeof bad);
    pthread_mutex_unlock(&dpar__fault_mutex);
    return bad[0] ? dpar__err(DPAR_EINVAL, "%s: %s", who, bad) : DPAR_OK;
}

/* DPAR_TIMEOUT_MS's reading: 1 and *ms when s is a whole number of milliseconds from -1 up that the timeout's
   nanoseconds can hold (above UINT64_MAX / 10^6 ms they wrap: found by tests/fuzz/fuzz_env.c) */
static int dpar__timeout_ms_of(const char *s, long *ms)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || v < -1 || (v > 0 && (uint64_t)v > UINT64_MAX / 1000000u)) return 0;
    *ms = v;
    return 1;
}

/* where a pool or comm is made: the environment it reads. A malformed DPAR_FAULT, DPAR_TIMEOUT_MS or DPAR_LOG is
   DPAR_EINVAL naming the variable and quoting its value, a DPAR_TRACE file that cannot be started its status and
   reason; every time, not only the first (DPAR_NUM_THREADS and DPAR_ALGO fall back to their default, warning) */
static dpar_status dpar__env_check(const char *who)
{
    const char *s;
    long ms;
    dpar_status st = dpar__fault_check(who);
    if (st != DPAR_OK) return st;
    s = getenv("DPAR_TIMEOUT_MS");
    if (s && *s && !dpar__timeout_ms_of(s, &ms))
        return dpar__err(DPAR_EINVAL,
                         "%s: DPAR_TIMEOUT_MS=\"%.64s\" is not a number of milliseconds (a whole number: 1 to %llu, or "
                         "0 or -1 for no timeout)",
                         who, s, (unsigned long long)(UINT64_MAX / 1000000u));
    s = getenv("DPAR_LOG");
    if (s && *s && dpar__log_level_of(s) < 0)
        return dpar__err(DPAR_EINVAL, "%s: DPAR_LOG=\"%.64s\" is not one of off, error, warn, info, debug", who, s);
    if ((st = dpar__trace_from_env()) != DPAR_OK) return dpar__err(st, "%s: %s", who, dpar__trace_env_bad);
    return DPAR_OK;
}

/* the copy of the schedule a new comm or pool keeps: NULL when nothing is scheduled (the hooks' one branch) */
static dpar__faults *dpar__fault_attach(const dpar_allocator *a)
{
    dpar__faults *fs = NULL;
    pthread_mutex_lock(&dpar__fault_mutex);
    dpar__fault_env_locked();
    if (dpar__fault_sched.n || dpar__fault_sched.bad[0]) {
        fs = (dpar__faults *)dpar__alloc(a, sizeof *fs);
        if (fs) {
            *fs = dpar__fault_sched;
            fs->allocator = *a;
        } else {
            snprintf(dpar__fault_nomem.bad, sizeof dpar__fault_nomem.bad, "out of memory for the fault schedule");
            fs = &dpar__fault_nomem;
        }
    }
    pthread_mutex_unlock(&dpar__fault_mutex);
    return fs;
}
static void dpar__fault_detach(dpar__faults *fs)
{
    if (fs && fs != &dpar__fault_nomem) {
        dpar_allocator a = fs->allocator;
        dpar__free(&a, fs);
    }
}

/* Count one operation `op` of `rank` on the comm (or pool) `name`. Delays due here are slept here. Returns the
   kind of the fault due (fail or vanish; *f and *nth say which and at what count), 0 for none, -1 when the
   schedule is unusable (fs->bad says why). A rank that vanished stays vanished on this comm. */
static int dpar__fault_due(dpar__faults *fs, int rank, int op, const char *name, const dpar__fault **f, uint64_t *nth)
{
    uint64_t n_op, n_any;
    int i, v;
    if (fs->bad[0]) return -1;
    if ((v = DPAR__LOAD(&fs->vanished, DPAR__ACQUIRE)) != 0) {
        *f = &fs->f[v - 1];
        *nth = fs->f[v - 1].at;
        return DPAR__FAULT_VANISH;
    }
    n_op = DPAR__ADD(&fs->count[op], 1, DPAR__RELAXED) + 1;
    n_any = DPAR__ADD(&fs->count[DPAR__FOP_ANY], 1, DPAR__RELAXED) + 1;
    for (i = 0; i < fs->n; i++) {
        const dpar__fault *g = &fs->f[i];
        if ((g->rank >= 0 && g->rank != rank) || (g->comm[0] && strcmp(g->comm, name))) continue;
        if ((op == DPAR__FOP_TASK) != (g->op == DPAR__FOP_TASK)) continue; /* a pool's faults and a comm's apart */
        if (g->op == DPAR__FOP_ANY ? n_any != g->at : (g->op != op || n_op != g->at)) continue;
        if (g->kind == DPAR__FAULT_DELAY) {
            struct timespec ts;
            ts.tv_sec = g->ms / 1000;
            ts.tv_nsec = (long)(g->ms % 1000) * 1000000L;
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
            continue;
        }
        if (g->kind == DPAR__FAULT_VANISH) DPAR__STORE(&fs->vanished, i + 1, DPAR__RELEASE);
        *f = g;
        *nth = g->op == DPAR__FOP_ANY ? n_any : n_op;
        return g->kind;
    }
    return 0;
}

/* >>pool: the pool object, parallel-for, SPMD run, barrier -------------------------------------- */
enum { DPAR__JOB_FOR_STATIC, DPAR__JOB_FOR_DYNAMIC, DPAR__JOB_RUN };
enum {
    DPAR__TASK_PENDING,
    DPAR__TASK_READY,
    DPAR__TASK_RUNNING,
    DPAR__TASK_DONE,
    DPAR__TASK_FAILED,
    DPAR__TASK_CANCELLED
};

#define DPAR__TASK_CHUNK 1024u /* records per slab chunk */
#define DPAR__EDGE_CHUNK 4096u /* dependency edges per slab chunk */
#define DPAR__NONE 0xffffffffu

typedef struct dpar__task_rec {
    dpar_task_fn fn;
    void *user;
    const char *name;
    int state;
    dpar_status status;  /* the status waiters get (the root failure's for a cancelled task) */
    uint32_t unresolved; /* dependencies not finished */
    uint32_t dependents; /* first edge of the list of tasks waiting for this one */
    uint32_t next, prev; /* ready-queue links; next is also the work-list link */
    uint32_t root;       /* the failed task that cancelled this one (itself when it failed) */
    uint32_t mark;       /* deadlock search stamp */
    char *message;       /* failure text (failed tasks only) */
} dpar__task_rec;

typedef struct dpar__edge {
    uint32_t to, next;
} dpar__edge;

typedef struct dpar__thread {
    dpar_pool *pool;
    int index;
    uint32_t seen_fork;     /* last fork generation this worker ran its part of */
    dpar_status run_status; /* dpar_pool_run result of this thread */
    char run_error[256];
    pthread_t handle;
    int cpu;             /* the CPU it last ran on, or -1 (see dpar__unshare) */
    uint64_t moved_ns;   /* when it last moved */
    uint32_t share_seq;  /* dynamic, guided and steal shares this thread began in the current run */
    uint32_t reduce_seq; /* dpar_pool_reduce_* calls of this thread in the current run; its parity picks the buffer */
    uint64_t reduce_buf[2][DPAR_POOL_REDUCE_MAX]; /* this thread's contribution, read by all after the barrier */
    uint64_t steal_word; /* its steal share: the share's tag (24 bits), the units [lo, hi) left (20 bits each) */
    char pad[DPAR__CACHE_LINE];
} dpar__thread;

struct dpar_pool {
    dpar_allocator allocator;
    int nthreads, pin, spin_us, id, started;
    int unshare; /* workers move off a CPU another thread of the pool is on */
    dpar__spin spin;
    char name[32];
    dpar__thread *threads;     /* [nthreads]; [0] stands for the caller of fork-join calls */
    dpar__faults *fault;       /* >>fault: the pool's copy of the schedule (op=task); NULL: none */
    pthread_mutex_t fork_lock; /* outside callers of fork-join calls take turns */

    /* fork-join: written by the caller before fork_gen is bumped, read by workers after */
    uint32_t fork_gen;
    uint32_t wake_seq; /* bumped on every new work: fork, ready task, shutdown */
    uint32_t wake_sleepers;
    int job_kind;
    int64_t job_n, job_grain, job_chunks;
    dpar_pool_for_fn job_for;
    dpar_pool_run_fn job_run;
    void *job_user;
    int in_run;
    int shutdown;
    char pad0[DPAR__CACHE_LINE];

    uint32_t join_pending; /* workers not done with the current fork */
    uint32_t join_sleepers;
    char pad1[DPAR__CACHE_LINE];
    uint64_t next_chunk; /* dynamic schedule: next chunk to hand out */
    char pad2[DPAR__CACHE_LINE];
    uint64_t share_word; /* dynamic and guided shares of a run: the share's tag (24 bits), its next unit (40 bits) */
    char pad_share[DPAR__CACHE_LINE];
    uint32_t bar_count, bar_gen, bar_sleepers;
    char pad3[DPAR__CACHE_LINE];

    /* tasks: every field below is guarded by task_lock except the atomics noted */
    pthread_mutex_t task_lock;
    uint32_t ready_count; /* atomic: tasks in the ready queue */
    uint32_t done_seq;    /* atomic: bumped when tasks finish (and on forks, shutdown) */
    uint32_t done_sleepers;
    uint32_t epoch; /* handles carry it; wait_all bumps it */
    uint32_t ntasks, nedges, unfinished;
    uint32_t ready_head, ready_tail;
    uint32_t mark_stamp;
    void **task_chunks; /* chunks of DPAR__TASK_CHUNK records */
    uint32_t task_chunk_cap;
    void **edge_chunks; /* chunks of DPAR__EDGE_CHUNK edges */
    uint32_t edge_chunk_cap;
    uint32_t *search_stack; /* deadlock search scratch */
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

static void dpar__trace_span(const char *name, const char *cat, uint64_t t0, const char *fmt, ...) DPAR_PRINTF(4, 5);
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

/* Block t of the T near-equal contiguous blocks of [0, n), the first n % T of them one longer:
   [t q + min(t, r), that + q + (t < r)) with q = n / T, r = n % T; t q <= n, so nothing can overflow. The static
   split of dpar_pool_for and of static and steal shares. */
static void dpar__block(int64_t n, int64_t T, int64_t t, int64_t *lo, int64_t *hi)
{
    int64_t q = n / T, r = n % T;
    *lo = t * q + (t < r ? t : r);
    *hi = *lo + q + (t < r ? 1 : 0);
}

/* Thread `index` runs its part of the current fork. */
static void dpar__fork_part(dpar_pool *p, int index)
{
    uint64_t t0 = dpar_trace_enabled() ? dpar_time_ns() : 0;
    if (p->job_kind == DPAR__JOB_FOR_STATIC) {
        int64_t begin, end;
        dpar__block(p->job_n, p->nthreads, index, &begin, &end);
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
        t->share_seq = 0;
        t->reduce_seq = 0;
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
static void dpar__cpu_note(int *cpu)
{
#if DPAR__LINUX
    int c = sched_getcpu();
    if (c != DPAR__LOAD(cpu, DPAR__RELAXED)) DPAR__STORE(cpu, c, DPAR__RELAXED);
#else
    (void)cpu;
#endif
}

/* dpar__unshare_cpus: n threads note their CPU in ints `stride` bytes apart from `cpus`; thread
   `self` notes its own and, when another of them is on the same CPU, moves to a CPU none uses. */
static void dpar__unshare_cpus(char *cpus, size_t stride, int n, int self, uint64_t *moved_ns)
{
#if DPAR__LINUX
    enum { WORDS = 1024 / (8 * sizeof(unsigned long)), BITS = 8 * sizeof(unsigned long) };
    unsigned long allowed[WORDS], mask[WORDS];
    int *mine = (int *)(void *)(cpus + (size_t)self * stride), me, j, clash = 0, any = 0;
    uint64_t now;
    dpar__cpu_note(mine);
    me = DPAR__LOAD(mine, DPAR__RELAXED);
    for (j = 0; j < n; j++)
        if (j != self && DPAR__LOAD((int *)(void *)(cpus + (size_t)j * stride), DPAR__RELAXED) == me) clash = 1;
    if (!clash || me < 0 || me >= 1024) return;
    now = dpar_time_ns();
    if (now - *moved_ns < 1000000u) return;
    *moved_ns = now;
    memset(allowed, 0, sizeof allowed);
    if (syscall(SYS_sched_getaffinity, 0, sizeof allowed, allowed) <= 0) return;
    memcpy(mask, allowed, sizeof mask);
    for (j = 0; j < n; j++) {
        int c = j == self ? me : DPAR__LOAD((int *)(void *)(cpus + (size_t)j * stride), DPAR__RELAXED);
        if (c >= 0 && c < 1024) mask[c / BITS] &= ~(1ul << (c % BITS));
    }
    for (j = 0; j < WORDS; j++) any |= mask[j] != 0;
    if (!any) return;                                              /* every allowed CPU is taken: stay */
    if (syscall(SYS_sched_setaffinity, 0, sizeof mask, mask) == 0) /* the kernel moves us now */
        syscall(SYS_sched_setaffinity, 0, sizeof allowed, allowed);
    dpar__cpu_note(mine);
#else
    (void)cpus;
    (void)stride;
    (void)n;
    (void)self;
    (void)moved_ns;
#endif
}

static void dpar__unshare(dpar_pool *p, dpar__thread *t)
{
    if (p->unshare)
        dpar__unshare_cpus((char *)&p->threads[0].cpu, sizeof(dpar__thread), p->nthreads, t->index, &t->moved_ns);
    else dpar__cpu_note(&t->cpu);
}

/* A worker takes part in a fork it has not seen yet. Returns 1 if it did. */
static int dpar__fork_poll(dpar_pool *p, dpar__thread *t)
{
    uint32_t gen = DPAR__LOAD(&p->fork_gen, DPAR__ACQUIRE);
    if (gen == t->seen_fork) return 0;
    t->seen_fork = gen;
    dpar__unshare(p, t); /* first: a woken worker may sit on the caller's CPU for the whole part */
    dpar__fork_part(p, t->index);
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
    dpar__cpu_note(&p->threads[0].cpu);
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
        dpar__wait_while(&p->join_pending, left, &p->join_sleepers, p->spin, 0, NULL);
}

static dpar_status dpar__for(dpar_pool *pool, int64_t n, int64_t grain, int dynamic, dpar_pool_for_fn fn, void *user,
                             const char *api)
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

DPAR_API dpar_status dpar_pool_for(dpar_pool *pool, int64_t n, dpar_pool_for_fn fn, void *user)
{
    return dpar__for(pool, n, 0, 0, fn, user, "dpar_pool_for");
}

DPAR_API dpar_status dpar_pool_for_dynamic(dpar_pool *pool, int64_t n, int64_t grain, dpar_pool_for_fn fn, void *user)
{
    return dpar__for(pool, n, grain, 1, fn, user, "dpar_pool_for_dynamic");
}

DPAR_API dpar_status dpar_pool_run(dpar_pool *pool, dpar_pool_run_fn fn, void *user)
{
    int i;
    uint64_t t0;
    dpar_status st = DPAR_OK;
    if (!pool) return dpar__err(DPAR_EINVAL, "dpar_pool_run: pool is NULL");
    if (!fn) return dpar__err(DPAR_EINVAL, "dpar_pool_run: fn is NULL");
    if (dpar__in_pool(pool))
        return dpar__err(DPAR_EBUSY,
                         "dpar_pool_run: called from thread %d of the same pool; an SPMD run "
                         "needs every thread of the pool at once, so it cannot nest",
                         dpar__tls_index);
    t0 = dpar_trace_enabled() ? dpar_time_ns() : 0;
    pthread_mutex_lock(&pool->fork_lock);
    pool->job_kind = DPAR__JOB_RUN;
    pool->job_run = fn;
    pool->job_user = user;
    DPAR__STORE(&pool->share_word, 0, DPAR__RELAXED); /* tag 0: older than the run's first share (tag 1) */
    for (i = 0; i < pool->nthreads; i++) /* and no units left over from a share an earlier run's thread left early */
        DPAR__STORE(&pool->threads[i].steal_word, 0, DPAR__RELAXED);
    DPAR__STORE(&pool->in_run, 1, DPAR__RELAXED);
    dpar__fork(pool);
    DPAR__STORE(&pool->in_run, 0, DPAR__RELAXED);
    for (i = 0; i < pool->nthreads; i++) {
        if (pool->threads[i].run_status != DPAR_OK) {
            st = dpar__err(pool->threads[i].run_status, "dpar_pool_run: thread %d of %d failed: %s", i, pool->nthreads,
                           pool->threads[i].run_error);
            break;
        }
    }
    pthread_mutex_unlock(&pool->fork_lock);
    if (t0) dpar__trace_span("pool_run", "pool", t0, "\"threads\":%d", pool->nthreads);
    return st;
}

/* The barrier of a run, without the checks: every thread of the run calls it. */
static void dpar__pool_barrier(dpar_pool *pool)
{
    dpar__thread *self = &pool->threads[dpar__tls_index];
    uint32_t gen = DPAR__LOAD(&pool->bar_gen, DPAR__ACQUIRE);
    if (DPAR__ADD(&pool->bar_count, 1, DPAR__ACQ_REL) + 1 == (uint32_t)pool->nthreads) {
        DPAR__STORE(&pool->bar_count, 0, DPAR__RELAXED);
        dpar__bump(&pool->bar_gen, &pool->bar_sleepers, INT_MAX);
    } else {
        dpar__wait_while(&pool->bar_gen, gen, &pool->bar_sleepers, pool->spin, 0, NULL);
    }
    if (self->index > 0) dpar__unshare(pool, self);
    else dpar__cpu_note(&self->cpu);
}

/* The calling thread takes part in a run of this pool with more than one thread. */
static int dpar__in_run(const dpar_pool *pool)
{
    return dpar__in_pool(pool) && DPAR__LOAD(&pool->in_run, DPAR__RELAXED) && pool->nthreads > 1;
}

DPAR_API dpar_status dpar_pool_barrier(dpar_pool *pool)
{
    if (!pool) return dpar__err(DPAR_EINVAL, "dpar_pool_barrier: pool is NULL");
    if (!dpar__in_pool(pool) || !DPAR__LOAD(&pool->in_run, DPAR__RELAXED))
        return dpar__err(DPAR_ESTATE, "dpar_pool_barrier: the calling thread is not inside dpar_pool_run of this pool");
    if (pool->nthreads == 1) return DPAR_OK;
    dpar__pool_barrier(pool);
    return DPAR_OK;
}

/* ---- shares: the parallel-region form of parallel-for ---- */

/* A dynamic or guided share takes its chunks from pool->share_word: the share's tag (the number of dynamic and
   guided shares each thread has begun in this run, 24 bits) above the next unhanded unit (40 bits; a unit is one
   iteration unless the range has 2^40 or more). A compare-and-swap takes a chunk only while the tag is the share's
   own, so a thread that arrives late never takes from a later share. The first thread to reach share k finds an
   older tag and swaps in (k, 0): it has left every earlier share because that share had nothing left, so nothing
   is lost. A thread that finds a newer tag knows share k is spent.
   A steal share keeps one word per thread, threads[t].steal_word: the share's tag, then the units [lo, hi) of the
   thread's block not yet handed out (20 bits each: a unit is one iteration unless the range has 2^19 or more). The
   thread writes its block there when it begins the share and takes chunks from lo; when lo reaches hi it takes
   the back half of the fullest word with its own tag (lowering that hi by compare-and-swap) and runs it as its
   own. A word with another tag belongs to a thread that is not in this share (behind, or ahead, which means its
   block is done), so it is left alone; a thread leaves the share when no word with its tag has units left. */
#define DPAR__SHARE_STEAL_BITS 20
#define DPAR__SHARE_STEAL_MASK ((UINT64_C(1) << DPAR__SHARE_STEAL_BITS) - 1)
#define DPAR__SHARE_BITS 40
#define DPAR__SHARE_MASK ((UINT64_C(1) << DPAR__SHARE_BITS) - 1)
#define DPAR__SHARE_TAGS 0xffffffu

static dpar_share dpar__share_begin(dpar_pool *pool, int dims, int64_t n0, int64_t n1, int64_t n2,
                                    dpar_schedule schedule, int64_t grain)
{
    dpar_share s;
    DPAR_ASSERT((unsigned)schedule <= (unsigned)DPAR_SCHEDULE_STEAL); /* one of the four dpar_schedule values */
    memset(&s, 0, sizeof s);
    s.dpar__state.pool = pool;
    s.dpar__state.dims = dims;
    s.dpar__state.schedule = (int)schedule;
    s.dpar__state.n1 = n1;
    s.dpar__state.n2 = n2;
    if (n0 <= 0 || n1 <= 0 || n2 <= 0) return s; /* empty: pos = stop = total = 0 */
    DPAR_ASSERT(n1 <= INT64_MAX / n2 && n0 <= INT64_MAX / (n1 * n2));
    s.dpar__state.total = n0 * n1 * n2;
    s.dpar__state.grain = grain < 0 ? 0 : grain;
    if (dpar__in_run(pool)) {
        s.dpar__state.thread = dpar__tls_index;
        s.dpar__state.nthreads = pool->nthreads;
    } else {
        s.dpar__state.thread = 0;
        s.dpar__state.nthreads = 1;
    }
    if (s.dpar__state.nthreads > 1 && schedule != DPAR_SCHEDULE_STATIC) {
        dpar__thread *t = &pool->threads[s.dpar__state.thread];
        int64_t total = s.dpar__state.total, T = s.dpar__state.nthreads, g = s.dpar__state.grain, unit;
        t->share_seq = (t->share_seq + 1) & DPAR__SHARE_TAGS;
        s.dpar__state.tag = t->share_seq;
        if (schedule == DPAR_SCHEDULE_STEAL) { /* block t of T, in units, as a static share's */
            int64_t units, lo, hi;
            unit = (total >> (DPAR__SHARE_STEAL_BITS - 1)) + 1;
            units = total / unit + (total % unit != 0); /* at most 2^19 */
            dpar__block(units, T, s.dpar__state.thread, &lo, &hi);
            if (g == 0) g = units / (T * 16) * unit; /* a sixteenth of a block */
            DPAR__STORE(&t->steal_word,
                        ((uint64_t)s.dpar__state.tag << (2 * DPAR__SHARE_STEAL_BITS)) |
                            ((uint64_t)lo << DPAR__SHARE_STEAL_BITS) | (uint64_t)hi,
                        DPAR__RELEASE);
        } else {
            unit = (total >> DPAR__SHARE_BITS) + 1;
            if (schedule == DPAR_SCHEDULE_DYNAMIC && g == 0) g = total / (T * 16);
        }
        g = g / unit + (g % unit != 0); /* in units */
        s.dpar__state.unit = unit;
        s.dpar__state.grain = g < 1 ? 1 : g;
    }
    return s;
}

/* The next chunk of the share into [pos, stop), in iterations of the collapsed range. Returns 0 when none is left. */
static int dpar__share_chunk(dpar_share *share)
{
    dpar_pool *pool = share->dpar__state.pool;
    int64_t total = share->dpar__state.total, T = share->dpar__state.nthreads, t = share->dpar__state.thread;
    int64_t g = share->dpar__state.grain, c;
    if (total == 0) return 0;
    if (T == 1) { /* a team of one: the whole range once */
        if (share->dpar__state.next++ > 0) return 0;
        share->dpar__state.pos = 0;
        share->dpar__state.stop = total;
        return 1;
    }
    if (share->dpar__state.schedule == DPAR_SCHEDULE_STATIC) {
        if (g == 0) { /* block t of T, as dpar_pool_for */
            if (share->dpar__state.next++ > 0) return 0;
            dpar__block(total, T, t, &share->dpar__state.pos, &share->dpar__state.stop);
            return share->dpar__state.stop > share->dpar__state.pos;
        }
        /* chunk c = t + m T of ceil(total / g): round-robin */
        c = t + share->dpar__state.next * T;
        if (c > (total - 1) / g) return 0;
        share->dpar__state.next++;
        share->dpar__state.pos = c * g;
        share->dpar__state.stop = total - c * g < g ? total : c * g + g;
        return 1;
    }
    if (share->dpar__state.schedule == DPAR_SCHEDULE_STEAL) {
        uint64_t *own = &pool->threads[t].steal_word, tag = share->dpar__state.tag, M = DPAR__SHARE_STEAL_MASK;
        uint64_t unit = (uint64_t)share->dpar__state.unit;
        for (;;) {
            uint64_t w = DPAR__LOAD(own, DPAR__ACQUIRE), lo = (w >> DPAR__SHARE_STEAL_BITS) & M, hi = w & M;
            uint64_t most = 0, vw = 0;
            int64_t v, victim = -1;
            if (lo < hi) { /* a chunk of my own from the front */
                uint64_t take = (uint64_t)g < hi - lo ? (uint64_t)g : hi - lo;
                if (!__atomic_compare_exchange_n(own, &w, w + (take << DPAR__SHARE_STEAL_BITS), 0, DPAR__ACQ_REL,
                                                 DPAR__ACQUIRE))
                    continue; /* a thief lowered hi: look again */
                share->dpar__state.pos = (int64_t)(lo * unit);
                share->dpar__state.stop = (lo + take) * unit > (uint64_t)total ? total : (int64_t)((lo + take) * unit);
                return 1;
            }
            for (v = 0; v < T; v++) { /* mine is empty: the fullest word of this share */
                uint64_t x = DPAR__LOAD(&pool->threads[v].steal_word, DPAR__ACQUIRE);
                uint64_t xl = (x >> DPAR__SHARE_STEAL_BITS) & M, xh = x & M;
                if (v != t && x >> (2 * DPAR__SHARE_STEAL_BITS) == tag && xh > xl && xh - xl > most) {
                    most = xh - xl;
                    victim = v;
                    vw = x;
                }
            }
            if (victim < 0) return 0;
            {
                uint64_t hi_v = vw & M, cut = hi_v - (most + 1) / 2; /* the back half, rounded up: at least one */
                if (__atomic_compare_exchange_n(&pool->threads[victim].steal_word, &vw, (vw & ~M) | cut, 0,
                                                DPAR__ACQ_REL, DPAR__ACQUIRE))
                    DPAR__STORE(own, (tag << (2 * DPAR__SHARE_STEAL_BITS)) | (cut << DPAR__SHARE_STEAL_BITS) | hi_v,
                                DPAR__RELEASE); /* empty until now, so no thief was at it */
            }
        }
    }
    {
        uint64_t units = (uint64_t)(total / share->dpar__state.unit + (total % share->dpar__state.unit != 0));
        uint64_t tag = share->dpar__state.tag, v = DPAR__LOAD(&pool->share_word, DPAR__ACQUIRE);
        for (;;) {
            uint64_t have = v >> DPAR__SHARE_BITS, at = v & DPAR__SHARE_MASK, take, d;
            d = (have - tag) & DPAR__SHARE_TAGS;
            if (d != 0 && d < (DPAR__SHARE_TAGS + 1) / 2) return 0; /* a later share: this one is spent */
            if (d != 0) {                                           /* an earlier share: begin this one */
                if (!__atomic_compare_exchange_n(&pool->share_word, &v, tag << DPAR__SHARE_BITS, 0, DPAR__ACQ_REL,
                                                 DPAR__ACQUIRE))
                    continue;
                v = tag << DPAR__SHARE_BITS;
                continue;
            }
            if (at >= units) return 0;
            take = (uint64_t)g;
            if (share->dpar__state.schedule == DPAR_SCHEDULE_GUIDED) {
                uint64_t q = (units - at + (uint64_t)T - 1) / (uint64_t)T;
                if (q > take) take = q;
            }
            if (take > units - at) take = units - at;
            if (__atomic_compare_exchange_n(&pool->share_word, &v, v + take, 0, DPAR__ACQ_REL, DPAR__ACQUIRE)) {
                uint64_t unit = (uint64_t)share->dpar__state.unit, b = at * unit, e = (at + take) * unit;
                share->dpar__state.pos = (int64_t)b;
                share->dpar__state.stop = e > (uint64_t)total ? total : (int64_t)e;
                return 1;
            }
        }
    }
}

DPAR_API dpar_share dpar_pool_share(dpar_pool *pool, int64_t n, dpar_schedule schedule, int64_t grain)
{
    return dpar__share_begin(pool, 1, n, 1, 1, schedule, grain);
}

DPAR_API dpar_share dpar_pool_share_2d(dpar_pool *pool, int64_t n0, int64_t n1, dpar_schedule schedule, int64_t grain)
{
    return dpar__share_begin(pool, 2, n0, n1, 1, schedule, grain);
}

DPAR_API dpar_share dpar_pool_share_3d(dpar_pool *pool, int64_t n0, int64_t n1, int64_t n2, dpar_schedule schedule,
                                       int64_t grain)
{
    return dpar__share_begin(pool, 3, n0, n1, n2, schedule, grain);
}

DPAR_API int dpar_share_next(dpar_share *share)
{
    int64_t pos, len, last;
    if (share->dpar__state.pos >= share->dpar__state.stop && !dpar__share_chunk(share)) return 0;
    pos = share->dpar__state.pos;
    len = share->dpar__state.stop - pos;
    if (share->dpar__state.dims == 1) {
        share->i = pos;
        share->end = pos + len;
    } else if (share->dpar__state.dims == 2) {
        int64_t n1 = share->dpar__state.n1;
        share->i = pos / n1;
        share->j = last = pos % n1;
        if (len > n1 - last) len = n1 - last;
        share->end = last + len;
    } else {
        int64_t n1 = share->dpar__state.n1, n2 = share->dpar__state.n2, r = pos % (n1 * n2);
        share->i = pos / (n1 * n2);
        share->j = r / n2;
        share->k = last = r % n2;
        if (len > n2 - last) len = n2 - last;
        share->end = last + len;
    }
    share->dpar__state.pos = pos + len;
    return 1;
}

/* ---- reductions across the threads of a run ---- */

/* Combine element e of every thread's buffer `which` in thread order into inout[e] (memcpy: the buffers are bytes). */
#define DPAR__POOL_REDUCE(T)                                                                                        \
    do {                                                                                                            \
        int e_, t_;                                                                                                 \
        for (e_ = 0; e_ < count; e_++) {                                                                            \
            T a_, b_;                                                                                               \
            memcpy(&a_, (const char *)pool->threads[0].reduce_buf[which] + (size_t)e_ * sizeof(T), sizeof(T));      \
            for (t_ = 1; t_ < pool->nthreads; t_++) {                                                               \
                memcpy(&b_, (const char *)pool->threads[t_].reduce_buf[which] + (size_t)e_ * sizeof(T), sizeof(T)); \
                if (op == DPAR_POOL_SUM) a_ = a_ + b_;                                                              \
                else if (op == DPAR_POOL_MAX) a_ = b_ > a_ ? b_ : a_;                                               \
                else a_ = b_ < a_ ? b_ : a_;                                                                        \
            }                                                                                                       \
            inout[e_] = a_;                                                                                         \
        }                                                                                                           \
    } while (0)

/* Checks, then copies this thread's elements into its buffer and waits for all. Returns 1 when the caller is to
   combine the buffers of parity *which, 0 with *st set when there is nothing to do (or an error). */
static int dpar__reduce_enter(dpar_pool *pool, const void *inout, int count, size_t size, dpar_pool_op op,
                              const char *api, dpar_status *st, uint32_t *which)
{
    dpar__thread *self;
    *st = DPAR_OK;
    if (count < 0) *st = dpar__err(DPAR_EINVAL, "%s: count = %d is negative", api, count);
    else if (count > DPAR_POOL_REDUCE_MAX)
        *st = dpar__err(DPAR_ERANGE,
                        "%s: count = %d is above DPAR_POOL_REDUCE_MAX (%d); reduce a large array with "
                        "a share of its elements per thread instead",
                        api, count, DPAR_POOL_REDUCE_MAX);
    else if (count > 0 && !inout) *st = dpar__err(DPAR_EINVAL, "%s: inout is NULL", api);
    else if (op != DPAR_POOL_SUM && op != DPAR_POOL_MAX && op != DPAR_POOL_MIN)
        *st = dpar__err(DPAR_EINVAL, "%s: op = %d is not DPAR_POOL_SUM, _MAX or _MIN", api, (int)op);
    if (*st != DPAR_OK || !dpar__in_run(pool)) return 0;
    self = &pool->threads[dpar__tls_index];
    *which = self->reduce_seq++ & 1u;
    if (count > 0) memcpy(self->reduce_buf[*which], inout, (size_t)count * size);
    dpar__pool_barrier(pool); /* the other parity's buffers are free: everyone has left the previous call */
    return 1;
}

DPAR_API dpar_status dpar_pool_reduce_f32(dpar_pool *pool, float *inout, int count, dpar_pool_op op)
{
    dpar_status st;
    uint32_t which = 0;
    if (dpar__reduce_enter(pool, inout, count, sizeof *inout, op, "dpar_pool_reduce_f32", &st, &which))
        DPAR__POOL_REDUCE(float);
    return st;
}

DPAR_API dpar_status dpar_pool_reduce_f64(dpar_pool *pool, double *inout, int count, dpar_pool_op op)
{
    dpar_status st;
    uint32_t which = 0;
    if (dpar__reduce_enter(pool, inout, count, sizeof *inout, op, "dpar_pool_reduce_f64", &st, &which))
        DPAR__POOL_REDUCE(double);
    return st;
}

DPAR_API dpar_status dpar_pool_reduce_i64(dpar_pool *pool, int64_t *inout, int count, dpar_pool_op op)
{
    dpar_status st;
    uint32_t which = 0;
    if (dpar__reduce_enter(pool, inout, count, sizeof *inout, op, "dpar_pool_reduce_i64", &st, &which))
        DPAR__POOL_REDUCE(int64_t);
    return st;
}

/* >>task: the task graph: submit, dependencies, failure propagation, waits ---------------------- */
/* Records and edges live in chunked slabs reused across epochs: no allocation per task once warm. A
   thread that runs a task pushes a frame, so a wait can tell which tasks sit below it on its stack. */
typedef struct dpar__frame {
    dpar_pool *pool;
    uint32_t task;
    struct dpar__frame *up;
} dpar__frame;
static DPAR__TLS dpar__frame *dpar__tls_frame = NULL;

static dpar_task dpar__handle(dpar_pool *p, uint32_t index)
{
    return ((uint64_t)p->epoch << 32) | (uint64_t)(index + 1);
}

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
    if (p->ready_tail == DPAR__NONE) p->ready_head = i;
    else dpar__rec(p, p->ready_tail)->next = i;
    p->ready_tail = i;
    DPAR__ADD(&p->ready_count, 1, DPAR__RELEASE);
}

static void dpar__ready_take(dpar_pool *p, uint32_t i)
{
    dpar__task_rec *r = dpar__rec(p, i);
    if (r->prev == DPAR__NONE) p->ready_head = r->next;
    else dpar__rec(p, r->prev)->next = r->next;
    if (r->next == DPAR__NONE) p->ready_tail = r->prev;
    else dpar__rec(p, r->next)->prev = r->prev;
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

/* >>fault's hook: a task due to fail (op=task) fails with DPAR_EUSER before it runs */
static dpar_status dpar__task_fault(dpar_pool *p, uint32_t i, const char *name)
{
    const dpar__fault *f = NULL;
    uint64_t nth = 0;
    int kind = dpar__fault_due(p->fault, -1, DPAR__FOP_TASK, p->name, &f, &nth);
    if (kind < 0) return dpar__err(DPAR_EINVAL, "pool %s: %s", p->name, p->fault->bad);
    if (kind == 0) return DPAR_OK;
    return dpar__err(
        DPAR_EUSER, "pool %s: injected fault (DPAR_FAULT \"%s\"): task %u%s%s%s (the pool's task #%llu to run) failed",
        p->name, f->text, i + 1, name ? " (" : "", name ? name : "", name ? ")" : "", (unsigned long long)nth);
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
    st = p->fault ? dpar__task_fault(p, i, name) : DPAR_OK;
    if (st == DPAR_OK) st = fn(user);
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
    if (desc->num_deps < 0)
        return dpar__err(DPAR_EINVAL, "dpar_task_submit: num_deps = %d is negative", desc->num_deps);
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
            return dpar__err(DPAR_EINVAL,
                             "dpar_task_submit: deps[%u] = 0x%llx is not a live task of this pool "
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
    if (cancelled_by >= 0) dpar__task_notify(pool, 0);
    else if (woke) dpar__bump(&pool->wake_seq, &pool->wake_sleepers, 1);
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
        dpar__wait_while(&p->done_seq, seq, &p->done_sleepers, p->spin, 0, NULL);
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
        return dpar__err(DPAR_EINVAL,
                         "dpar_task_wait: 0x%llx is not a live task of this pool (never submitted, "
                         "or ended by dpar_task_wait_all)",
                         (unsigned long long)task);
    }
    /* Every task running lower on this thread's stack can only finish after this wait returns. */
    for (f = dpar__tls_frame; f && !dpar__finished(dpar__rec(pool, i)->state); f = f->up) {
        if (f->pool == pool && dpar__task_reaches(pool, f->task, i)) {
            uint32_t self = dpar__tls_frame->task;
            pthread_mutex_unlock(&pool->task_lock);
            if (i == self) return dpar__err(DPAR_EDEADLK, "dpar_task_wait: task %u waits for itself", self + 1);
            return dpar__err(DPAR_EDEADLK,
                             "dpar_task_wait: task %u waits for task %u, which cannot finish before "
                             "task %u does",
                             self + 1, i + 1, f->task + 1);
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
    if (i == DPAR__NONE)
        dpar__err(DPAR_EINVAL, "dpar_task_state_of: 0x%llx is not a live task", (unsigned long long)task);
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
        return dpar__err(DPAR_EBUSY,
                         "dpar_task_wait_all: called from inside the pool (thread %d) or a task; it "
                         "would wait for itself (wait on single tasks there)",
                         dpar__tls_index);
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
        st = dpar__err(r->status,
                       "dpar_task_wait_all: %u of %u tasks failed and %u were cancelled; the first, task %u "
                       "(%s), failed: %s",
                       failed, pool->ntasks, cancelled, first + 1, r->name ? r->name : "task",
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

/* >>workers: worker threads, pool create and destroy -------------------------------------------- */

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
        dpar__wait_while(&p->wake_seq, wake, &p->wake_sleepers, p->spin, 0, NULL);
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
    dpar__fault_detach(p->fault);
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
    if ((st = dpar__env_check("dpar_pool_create")) != DPAR_OK) return st;
    if (d.num_threads < 0)
        return dpar__err(DPAR_EINVAL, "dpar_pool_create: num_threads = %d is negative (0 means the default)",
                         d.num_threads);
    if (d.num_threads > DPAR_MAX_THREADS)
        return dpar__err(DPAR_ERANGE, "dpar_pool_create: num_threads = %d is above DPAR_MAX_THREADS (%d)",
                         d.num_threads, DPAR_MAX_THREADS);
    if (d.spin_us < -1)
        return dpar__err(DPAR_EINVAL, "dpar_pool_create: spin_us = %d (use -1 for no spinning, 0 for the default)",
                         d.spin_us);
    n = d.num_threads;
    if (n == 0) {
        const char *env = getenv("DPAR_NUM_THREADS");
        if (env && *env) {
            char *end;
            long v = strtol(env, &end, 10);
            if (*end || v < 1 || v > DPAR_MAX_THREADS)
                DPAR__LOG(DPAR_LOG_WARN, "DPAR_NUM_THREADS=%s is not a thread count in 1..%d; using the online CPUs",
                          env, DPAR_MAX_THREADS);
            else n = (int)v;
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
    p->fault = dpar__fault_attach(&p->allocator);
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
    if (!pool) return DPAR_OK;
    if (dpar__in_pool(pool))
        return dpar__err(DPAR_EBUSY, "dpar_pool_destroy: called from thread %d of the pool itself; the pool is kept",
                         dpar__tls_index);
    pthread_mutex_lock(&pool->fork_lock); /* let a fork-join call of another thread end first */
    pthread_mutex_unlock(&pool->fork_lock);
    cancelled = dpar__pool_stop(pool);
    dpar__pool_free(pool);
    if (cancelled)
        return dpar__err(DPAR_ECANCELED,
                         "dpar_pool_destroy: %u tasks had not started and were cancelled; the pool "
                         "is destroyed (call dpar_task_wait_all first to run them)",
                         cancelled);
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

/* >>dtype: element types: names and sizes, block ranges, bf16/f16, the reduction loops, the fixed tree --- */
static const char *const dpar__dtype_names[] = {"f32", "f64", "i32", "i64", "bf16", "f16", "u8"};
static const size_t dpar__dtype_sizes[] = {4, 8, 4, 8, 2, 2, 1};
static const char *const dpar__op_names[] = {"sum", "avg", "min", "max", "prod"};
static const char *const dpar__coll_names[] = {"send",     "recv",           "barrier",   "broadcast",
                                               "reduce",   "reduce_scatter", "allgather", "allreduce",
                                               "alltoall", "split",          "alltoallv"};

DPAR_API size_t dpar_dtype_size(dpar_dtype t) { return (unsigned)t < DPAR_DTYPE_COUNT ? dpar__dtype_sizes[t] : 0; }
DPAR_API const char *dpar_dtype_name(dpar_dtype t)
{
    return (unsigned)t < DPAR_DTYPE_COUNT ? dpar__dtype_names[t] : "?";
}
DPAR_API const char *dpar_op_name(dpar_op op) { return (unsigned)op < DPAR_OP_COUNT ? dpar__op_names[op] : "?"; }
DPAR_API const char *dpar_coll_name(dpar_coll k) { return (unsigned)k < DPAR_COLL_COUNT ? dpar__coll_names[k] : "?"; }

DPAR_API void dpar_block_range(size_t count, int parts, int index, size_t *offset, size_t *length)
{
    size_t q, r, i;
    if (parts < 1 || index < 0 || index >= parts) {
        if (offset) *offset = 0;
        if (length) *length = 0;
        return;
    }
    q = count / (size_t)parts;
    r = count % (size_t)parts;
    i = (size_t)index;
    if (offset) *offset = i * q + (i < r ? i : r);
    if (length) *length = q + (i < r ? 1 : 0);
}

/* ---- bf16 / f16 ---- */
DPAR_API float dpar_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

DPAR_API uint16_t dpar_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

DPAR_API float dpar_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    float f;
    if (e == 0) {
        if (m == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            e = 113;
            while (!(m & 0x400u)) {
                m <<= 1;
                e--;
            }
            u = sign | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        u = sign | 0x7f800000u | (m << 13);
    } else {
        u = sign | ((e + 112) << 23) | (m << 13);
    }
    memcpy(&f, &u, sizeof f);
    return f;
}

DPAR_API uint16_t dpar_f32_to_f16(float f)
{
    uint32_t u, sign, m, half, rem;
    int32_t e;
    memcpy(&u, &f, sizeof u);
    sign = (u >> 16) & 0x8000u;
    m = u & 0x7fffffu;
    if (((u >> 23) & 0xffu) == 0xffu) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u : 0u));
    e = (int32_t)((u >> 23) & 0xffu) - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) { /* subnormal or zero */
        uint32_t shift;
        if (e < -10) return (uint16_t)sign;
        m |= 0x800000u;
        shift = (uint32_t)(14 - e);
        half = m >> shift;
        rem = m & ((1u << shift) - 1u);
        if (rem > (1u << (shift - 1)) || (rem == (1u << (shift - 1)) && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    half = sign | ((uint32_t)e << 10) | (m >> 13);
    rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++; /* a carry rounds up into the exponent */
    return (uint16_t)half;
}

/* ---- the reduction kernel: out[i] = a[i] op b[i] (then / div when div > 1); out may alias a or b ---- */
/* clang-format off */
#define DPAR__RED_LOOP(T, EXPR)                                                          \
    do {                                                                                 \
        T *o_ = (T *)out;                                                                \
        const T *a_ = (const T *)a, *b_ = (const T *)b;                                  \
        size_t i_;                                                                       \
        for (i_ = 0; i_ < n; i_++) {                                                     \
            T x = a_[i_], y = b_[i_];                                                    \
            o_[i_] = (EXPR);                                                             \
        }                                                                                \
    } while (0)
#define DPAR__RED_FLOAT(T)                                                               \
    switch (op) {                                                                        \
    case DPAR_SUM: DPAR__RED_LOOP(T, x + y); break;                                      \
    case DPAR_AVG:                                                                       \
        if (div > 1) DPAR__RED_LOOP(T, (x + y) / (T)div);                                \
        else DPAR__RED_LOOP(T, x + y);                                                   \
        break;                                                                           \
    case DPAR_MIN: DPAR__RED_LOOP(T, y < x ? y : x); break;                              \
    case DPAR_MAX: DPAR__RED_LOOP(T, y > x ? y : x); break;                              \
    default: DPAR__RED_LOOP(T, x * y); break;                                            \
    }
/* integers wrap: the sum and product are computed on the unsigned type of the same width */
#define DPAR__RED_INT(T, U)                                                              \
    switch (op) {                                                                        \
    case DPAR_SUM: DPAR__RED_LOOP(T, (T)((U)x + (U)y)); break;                           \
    case DPAR_AVG:                                                                       \
        if (div > 1) DPAR__RED_LOOP(T, (T)((int64_t)(T)((U)x + (U)y) / (int64_t)div));  \
        else DPAR__RED_LOOP(T, (T)((U)x + (U)y));                                        \
        break;                                                                           \
    case DPAR_MIN: DPAR__RED_LOOP(T, y < x ? y : x); break;                              \
    case DPAR_MAX: DPAR__RED_LOOP(T, y > x ? y : x); break;                              \
    default: DPAR__RED_LOOP(T, (T)((U)x * (U)y)); break;                                 \
    }
/* clang-format on */

static float dpar__apply_f32(float x, float y, dpar_op op, int div)
{
    switch (op) {
    case DPAR_SUM: return x + y;
    case DPAR_AVG: return div > 1 ? (x + y) / (float)div : x + y;
    case DPAR_MIN: return y < x ? y : x;
    case DPAR_MAX: return y > x ? y : x;
    default: return x * y;
    }
}

/* The hot case, f32/f64 sum, average and product, in explicit 16-byte vectors (GCC/Clang vector
   extensions): gcc -O2 does not vectorize the plain loop, and this must be fast whatever the user's
   flags. VPOST/SPOST follow the op in the vector and the scalar tail (the average's division: the
   same correctly rounded (x + y) / div as the plain loop, 4 at a time instead of a scalar divide per
   element). Loads come before stores in each step, so out == a or out == b is fine. */
#if defined(__GNUC__) || defined(__clang__)
#define DPAR__SIMD 1
typedef float dpar__v4f __attribute__((vector_size(16)));
typedef double dpar__v2d __attribute__((vector_size(16)));
/* clang-format off */
#define DPAR__VLOOP(T, V, PER, OPER, VPOST, SPOST)                                       \
    do {                                                                                 \
        T *o_ = (T *)out;                                                                \
        const T *a_ = (const T *)a, *b_ = (const T *)b;                                  \
        size_t i_ = 0;                                                                   \
        for (; i_ + 2 * (PER) <= n; i_ += 2 * (PER)) {                                   \
            V x0, x1, y0, y1;                                                            \
            memcpy(&x0, a_ + i_, sizeof x0);                                             \
            memcpy(&x1, a_ + i_ + (PER), sizeof x1);                                     \
            memcpy(&y0, b_ + i_, sizeof y0);                                             \
            memcpy(&y1, b_ + i_ + (PER), sizeof y1);                                     \
            x0 = (x0 OPER y0) VPOST;                                                     \
            x1 = (x1 OPER y1) VPOST;                                                     \
            memcpy(o_ + i_, &x0, sizeof x0);                                             \
            memcpy(o_ + i_ + (PER), &x1, sizeof x1);                                     \
        }                                                                                \
        for (; i_ < n; i_++) o_[i_] = (a_[i_] OPER b_[i_]) SPOST;                        \
    } while (0)
/* clang-format on */
#else
#define DPAR__SIMD 0
#endif

static void dpar__reduce(void *out, const void *a, const void *b, size_t n, dpar_dtype t, dpar_op op, int div)
{
    size_t i;
#if DPAR__SIMD
    if ((op == DPAR_SUM || (op == DPAR_AVG && div <= 1)) && t == DPAR_F32) {
        DPAR__VLOOP(float, dpar__v4f, 4, +, , );
        return;
    }
    if ((op == DPAR_SUM || (op == DPAR_AVG && div <= 1)) && t == DPAR_F64) {
        DPAR__VLOOP(double, dpar__v2d, 2, +, , );
        return;
    }
    if (op == DPAR_AVG && t == DPAR_F32) {
        const float f = (float)div;
        const dpar__v4f d = {f, f, f, f};
        DPAR__VLOOP(float, dpar__v4f, 4, +, / d, / f);
        return;
    }
    if (op == DPAR_AVG && t == DPAR_F64) {
        const double f = (double)div;
        const dpar__v2d d = {f, f};
        DPAR__VLOOP(double, dpar__v2d, 2, +, / d, / f);
        return;
    }
    if (op == DPAR_PROD && t == DPAR_F32) {
        DPAR__VLOOP(float, dpar__v4f, 4, *, , );
        return;
    }
    if (op == DPAR_PROD && t == DPAR_F64) {
        DPAR__VLOOP(double, dpar__v2d, 2, *, , );
        return;
    }
#endif
    switch (t) {
    case DPAR_F32: DPAR__RED_FLOAT(float); break;
    case DPAR_F64: DPAR__RED_FLOAT(double); break;
    case DPAR_I32: DPAR__RED_INT(int32_t, uint32_t); break;
    case DPAR_I64: DPAR__RED_INT(int64_t, uint64_t); break;
    case DPAR_U8: DPAR__RED_INT(uint8_t, uint32_t); break;
    case DPAR_BF16: {
        uint16_t *o = (uint16_t *)out;
        const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;
        for (i = 0; i < n; i++)
            o[i] = dpar_f32_to_bf16(dpar__apply_f32(dpar_bf16_to_f32(x[i]), dpar_bf16_to_f32(y[i]), op, div));
        break;
    }
    default: {
        uint16_t *o = (uint16_t *)out;
        const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;
        for (i = 0; i < n; i++)
            o[i] = dpar_f32_to_f16(dpar__apply_f32(dpar_f16_to_f32(x[i]), dpar_f16_to_f32(y[i]), op, div));
        break;
    }
    }
}

/* out = in / div (AVG on one rank, or after a tree); integer division for integers */
static void dpar__divide(void *out, const void *in, size_t n, dpar_dtype t, int div)
{
    size_t i;
    if (div <= 1) {
        if (out != in) memmove(out, in, n * dpar__dtype_sizes[t]);
        return;
    }
    switch (t) {
    case DPAR_F32:
        for (i = 0; i < n; i++) ((float *)out)[i] = ((const float *)in)[i] / (float)div;
        break;
    case DPAR_F64:
        for (i = 0; i < n; i++) ((double *)out)[i] = ((const double *)in)[i] / (double)div;
        break;
    case DPAR_I32:
        for (i = 0; i < n; i++) ((int32_t *)out)[i] = ((const int32_t *)in)[i] / div;
        break;
    case DPAR_I64:
        for (i = 0; i < n; i++) ((int64_t *)out)[i] = ((const int64_t *)in)[i] / div;
        break;
    case DPAR_U8:
        for (i = 0; i < n; i++) ((uint8_t *)out)[i] = (uint8_t)(((const uint8_t *)in)[i] / div);
        break;
    case DPAR_BF16:
        for (i = 0; i < n; i++)
            ((uint16_t *)out)[i] = dpar_f32_to_bf16(dpar_bf16_to_f32(((const uint16_t *)in)[i]) / (float)div);
        break;
    default:
        for (i = 0; i < n; i++)
            ((uint16_t *)out)[i] = dpar_f32_to_f16(dpar_f16_to_f32(((const uint16_t *)in)[i]) / (float)div);
        break;
    }
}

/* ---- the fixed tree of the deterministic mode ---- */
#define DPAR__TREE_BLOCK 64 /* elements combined at a time: the temporaries stay small and in L1 */

/* out[0..n) = tree(leaves[lo..hi)) at element offset e; tmp has room for depth * n elements */
static void dpar__tree(char *out, const void *const *leaves, int lo, int hi, size_t e, size_t n, dpar_dtype t,
                       dpar_op op, char *tmp)
{
    size_t es = dpar__dtype_sizes[t];
    int mid;
    if (hi - lo == 1) {
        memcpy(out, (const char *)leaves[lo] + e * es, n * es);
        return;
    }
    mid = lo + (hi - lo) / 2;
    dpar__tree(out, leaves, lo, mid, e, n, t, op, tmp + n * es);
    dpar__tree(tmp, leaves, mid, hi, e, n, t, op, tmp + n * es);
    dpar__reduce(out, out, tmp, n, t, op == DPAR_AVG ? DPAR_SUM : op, 0);
}

DPAR_API dpar_status dpar_tree_reduce(void *out, const void *const *leaves, int num_leaves, size_t count,
                                      dpar_dtype dtype, dpar_op op)
{
    char tmp[32 * DPAR__TREE_BLOCK * 8], block[DPAR__TREE_BLOCK * 8];
    size_t es = dpar_dtype_size(dtype), e;
    int k, depth = 0;
    if (!es) return dpar__err(DPAR_EINVAL, "dpar_tree_reduce: dtype %d is not a dpar_dtype", (int)dtype);
    if ((unsigned)op >= DPAR_OP_COUNT)
        return dpar__err(DPAR_EINVAL, "dpar_tree_reduce: op %d is not a dpar_op", (int)op);
    if (num_leaves < 1 || !leaves) return dpar__err(DPAR_EINVAL, "dpar_tree_reduce: needs at least one leaf");
    if (count && !out) return dpar__err(DPAR_EINVAL, "dpar_tree_reduce: out is NULL");
    for (k = 0; k < num_leaves; k++)
        if (count && !leaves[k]) return dpar__err(DPAR_EINVAL, "dpar_tree_reduce: leaves[%d] is NULL", k);
    for (k = num_leaves - 1; k > 0; k >>= 1) depth++;
    for (e = 0; e < count; e += DPAR__TREE_BLOCK) {
        size_t n = count - e < DPAR__TREE_BLOCK ? count - e : DPAR__TREE_BLOCK;
        /* into a block first: `out` may be a leaf; each block reads only its own elements */
        dpar__tree(block, leaves, 0, num_leaves, e, n, dtype, op, tmp);
        if (op == DPAR_AVG) dpar__divide((char *)out + e * es, block, n, dtype, num_leaves);
        else memcpy((char *)out + e * es, block, n * es);
    }
    return DPAR_OK;
}

/* >>transport: the interface between the algorithms and the transports; the comm object --------- */
#ifndef DPAR_TIMEOUT_MS_DEFAULT
#define DPAR_TIMEOUT_MS_DEFAULT 30000
#endif
#define DPAR__QDEPTH 4    /* offers in flight per channel */
#define DPAR__LANE_P2P 0  /* user send/recv */
#define DPAR__LANE_COLL 1 /* collectives */
#define DPAR__LANES 2
#define DPAR__SEGMENT_DEFAULT (128u * 1024u)
/* over MPI each segment is a message of its own: on 2 processes 128 KiB ones took 1.07-1.30 times as long as
   1 MiB ones at 1, 16 and 64 MiB, 512 KiB ones 0.94-1.07 times (docs/mpi.md, 'The default segment') */
#ifndef DPAR_MPI_SEGMENT_BYTES
#define DPAR_MPI_SEGMENT_BYTES (1u << 20)
#endif

/* ---- fingerprints ---- */
typedef struct dpar__fp {
    uint64_t seq; /* collective number on this comm (0 for point-to-point) */
    uint64_t count;
    int coll, dtype, op, root, tag, rank;
    const char *file;
    int line;
} dpar__fp;

typedef struct dpar__ctx dpar__ctx;
struct dpar__call;

/* The transport interface. Everything above the transports (the ring algorithms, the comm front end,
   the pipeline runner, direct buckets, work stealing, checkpoints, the hybrid MPI comm) reaches a
   transport only through this table, by way of the dpar__tp_* wrappers below; a transport's own
   state hangs off dpar_comm.tp_data and is defined and read only in its own section.

   `x` is the call in progress (dpar__ctx): its comm, its lane (user point-to-point or collectives,
   two independent message streams), the fingerprint of the call and its deadline. Every primitive is
   called on the rank's own thread, or on its progress thread while the rank's thread waits for it
   (never both at once). A primitive that fails has already poisoned the comm when the failure
   concerns the others (mismatch, timeout), and sets dpar_last_error.

   Moving bytes (required), called by the algorithms (>>ring) and the front end (>>comm):
     post(x, peer, buf, bytes)    offer bytes to peer on x's lane; buf stays untouched until the peer
                                  releases it. At most DPAR__QDEPTH offers per peer and lane are
                                  unreleased; post waits while there are more.
     fetch(x, peer, bytes, &p)    wait for peer's next offer on x's lane and check its fingerprint
                                  against x's (DPAR_EMISMATCH, poisoning the comm, when they disagree);
                                  p is readable until release. bytes must be what the peer offered.
     release(x, peer)             done with the offer of peer fetched last
     drain(x, peer, k)            wait until at most k of my offers to peer are unreleased
   Local arithmetic (optional; NULL: the host loops of >>dtype), on buffers where this transport's
   ranks keep their data (host memory for threads and MPI, device memory for thread ranks with
   dpar_comm_memory), unless x->host says the buffers are the algorithms' own host memory (split and
   expose gather host words): then the host loops. A failure has poisoned the comm.
     reduce(x, out, a, b, n, dtype, op, div)  out = a op b elementwise, then / div when div > 1;
                                  out may alias a or b. Called by the algorithms and direct buckets.
     divide(x, out, in, n, dtype, div)        out = in / div (div <= 1: a copy); out may alias in
     copy(x, dst, src, bytes)     dst = src, no overlap
   Group state (required but quiesce):
     enter(x)                     a call starts: publish where this rank is, for the others' timeout
                                  messages
     poisoned(c)                  the comm's error (its text in dpar_last_error), or DPAR_OK. Reads the
                                  poison sequentially consistently, so a caller may pair it with a
                                  store of its own (Dekker: "reading now", then "poisoned?").
     poison(c, why, msg)          every current and later call of every rank returns `why` with msg;
                                  the first poison wins and is what it returns. Any thread. Stores the
                                  poison sequentially consistently (the other half of the Dekker pairs).
     quiesce(c)                   leaving on an error: wait until no peer still reads this rank's
                                  buffers, so the caller may free them (NULL: nothing can be reading)
     split(x, color, key, out)    dpar_comm_split (a transport may run it on the ring algorithms)
     destroy(c)                   leave the group; free this rank's transport state
   Speed-ups (optional):
     recv_into(x, peer, dst, bytes)  receive straight into dst (NULL: fetch + copy + release)
     native(x, call, &done)       run the whole call with the transport's own collective; done = 0:
                                  not taken, the ring runs it
     prefetch(x, peer)            the next fetch will be from peer: start receiving it now
   Shared memory (optional, all or none; without them direct buckets and dpar_steal return
   DPAR_EUNSUPPORTED). Ranks that share memory synchronise through words in that memory and wait on a
   per-rank doorbell: read the doorbell, test the condition, then sleep until the doorbell changes.
     one_process                  1: the ranks are threads of one process, so every pointer (function
                                  pointers too) means the same on every rank (dpar_steal runs one
                                  rank's tasks on another's thread; direct buckets free rank 0's
                                  flags with its allocator); both require it today
     expose(x, bufs, n, peers)    collective: peers[q * n + i] is rank q's bufs[i] as this rank can read
                                  and write it (NULL where q passed NULL); valid until the comm is
                                  destroyed
     doorbell(c)                  this rank's doorbell now (acquire)
     wait_bell(c, seen, deadline) return once the doorbell differs from seen: DPAR_OK, or
                                  DPAR_ETIMEDOUT at deadline (absolute ns, 0: none). Spins, then sleeps.
     wake(c, peer)                ring peer's doorbell; call after the store the peer waits for
     timeout(x, peer, what)       a wait for peer gave up at x's deadline: poison the comm with a
                                  DPAR_ETIMEDOUT message naming the ranks that are behind, return it
   native_first                   1: the front end asks native first, even on one rank (>>ops)
   alltoallv_parts(x, send, recv, v, es, &done)  (optional) move an alltoallv's parts, its counts met and checked
                                  on every rank already (the node's block), with the transport's own all-to-all;
                                  done = 0: not taken, the pairwise rounds move them */
typedef struct dpar__transport {
    const char *name;
    dpar_status (*post)(dpar__ctx *x, int peer, const void *buf, size_t bytes);
    dpar_status (*fetch)(dpar__ctx *x, int peer, size_t bytes, const void **data);
    dpar_status (*release)(dpar__ctx *x, int peer);
    dpar_status (*drain)(dpar__ctx *x, int peer, int max_outstanding);
    dpar_status (*reduce)(dpar__ctx *x, void *out, const void *a, const void *b, size_t n, dpar_dtype t, dpar_op op,
                          int div);
    dpar_status (*divide)(dpar__ctx *x, void *out, const void *in, size_t n, dpar_dtype t, int div);
    dpar_status (*copy)(dpar__ctx *x, void *dst, const void *src, size_t bytes);
    void (*enter)(dpar__ctx *x);
    dpar_status (*poisoned)(dpar_comm *c);
    dpar_status (*poison)(dpar_comm *c, dpar_status why, const char *msg);
    void (*quiesce)(dpar_comm *c);
    dpar_status (*split)(dpar__ctx *x, int color, int key, dpar_comm **out);
    void (*destroy)(dpar_comm *c);
    dpar_status (*recv_into)(dpar__ctx *x, int peer, void *dst, size_t bytes);
    dpar_status (*native)(dpar__ctx *x, const struct dpar__call *call, int *done);
    void (*prefetch)(dpar__ctx *x, int peer);
    int one_process;
    dpar_status (*expose)(dpar__ctx *x, const void *const *bufs, int n, void **peers);
    uint32_t (*doorbell)(dpar_comm *c);
    dpar_status (*wait_bell)(dpar_comm *c, uint32_t seen, uint64_t deadline);
    void (*wake)(dpar_comm *c, int peer);
    dpar_status (*timeout)(dpar__ctx *x, int peer, const char *what);
    int native_first; /* 1: native takes every collective, also on one rank (a library that runs whole calls) */
    int polls;        /* 1: wait_bell returns at once (no doorbell to sleep on: the MPI transport's block), so a
                         waiter looks at the clock and the peers' fingerprints only every 16th time round */
    dpar_status (*alltoallv_parts)(dpar__ctx *x, const char *send, char *recv, const size_t *v, size_t es, int *done);
    /* a peer's whole offer: held where it is (*held = 1, *data: the peer's buffer, released later) when this rank's
       arithmetic can read it there, else copied into dst and released (*data = dst); NULL: recv_into */
    dpar_status (*hold)(dpar__ctx *x, int peer, void *dst, size_t bytes, const void **data, int *held);
    /* one-shot's combine in one call (dpar__sm_combine's contract); NULL: dpar__tp_reduce, block by block */
    dpar_status (*combine)(dpar__ctx *x, char *out, const char *const *in, size_t lo, size_t n, size_t count,
                           dpar_dtype t, dpar_op op);
} dpar__transport;

/* One call in progress: who, what, until when, what it moved. */
struct dpar__ctx {
    dpar_comm *c;
    int lane;
    int host; /* 1: the buffers are host memory whatever the comm's dpar_comm_memory (split, expose) */
    dpar__fp fp;
    uint64_t deadline; /* absolute ns, 0: none */
    uint64_t sent, received;
    int vpack; /* alltoallv on 2 ranks: fp.count carries both directions of the pair (dpar__alltoallv_pairwise) */
    int vfits; /* alltoallv through the node's block: every rank's counts and displacements, in bytes, fit an int */
};

/* an asynchronous request, from the comm's free list */
/* A chained request (dpar_buckets with an update): after its reduce-scatter, on the progress thread,
   fn(user, base + this rank's block offset, its length), then an all-gather of gather's count floats. */
typedef struct dpar__then {
    void (*fn)(void *user, size_t offset, size_t count);
    void *user;
    size_t base;
    float *gather;
} dpar__then;

struct dpar_request {
    dpar_comm *comm;
    int coll;
    const void *send;
    void *recv;
    size_t count;
    dpar_dtype dtype;
    dpar_op op;
    uint64_t seq;
    const char *file;
    int line;
    uint32_t done; /* futex word: 1 when finished */
    uint32_t done_sleepers;
    dpar_status status;
    char error[DPAR__ERROR_TEXT];
    dpar_request *next;
    dpar__then then; /* fn NULL: a plain request */
    uint64_t seq2;   /* the chained all-gather's call number */
    size_t *v;       /* alltoallv: its copy of the counts and displacements (4 N), kept when the request is reused */
    size_t v_cap, vrecv;
};

struct dpar_comm {
    const dpar__transport *tp;
    void *tp_data;       /* the transport's own state of this rank (its section alone reads it) */
    dpar_comm_desc desc; /* as given when the comm was made (name: this comm's) */
    int rank, size;
    int worker;                  /* the rank this thread joined its first group with: dpar_comm_memory's `worker` */
    dpar_comm_memory ops_memory; /* dpar_comm_from_ops: the memory its buffers are in, for dpar_zero and dpar_fsdp */
    int batch;                   /* dpar_batch_begin .. _end: a batch is open */
    dpar_allocator allocator;
    uint64_t timeout_ns; /* 0: none */
    int check, det;
    size_t segment_bytes;
    dpar__spin spin;
    char name[32];
    const char *split_suffix; /* set by dpar_mesh_init around its splits: the new comm is "name.suffix" */
    uint64_t seq;             /* collectives issued by this rank */
    void *scratch;            /* grown on demand, kept: no allocation per call once warm */
    size_t scratch_bytes;
    void *hscratch; /* the same for calls on host words (x->host) where scratch is the device's (memory.alloc) */
    size_t hscratch_bytes;
    size_t *vbuf; /* a blocking alltoallv's counts and displacements, resolved (4 N, host memory, kept) */
    size_t vbuf_cap;
    dpar_comm_stats stats; /* counters, updated with relaxed atomics */
    int last_coll;
    uint64_t last_busbw_bits; /* the double, as bits, so it can be an atomic */
    /* async */
    pthread_mutex_t qlock;
    dpar_request *qhead, *qtail, *free_reqs;
    uint32_t qseq, qsleepers; /* bumped when requests are queued or the thread must stop */
    uint32_t pending;         /* requests issued and not finished */
    uint32_t pending_sleepers;
    int stop, thread_started;
    pthread_t thread;
    const char *no_async; /* why async requests cannot run here (NULL: they can) */
    /* >>algo: the allreduce algorithm asked for, the memory the ranks share for it */
    int algo;                   /* dpar_algo: the desc's, else DPAR_ALGO's, else AUTO */
    struct dpar__sm *sm;        /* NULL until the first allreduce that may use it */
    int sm_state;               /* 0: not set up yet, 1: sm ready, -1: unavailable (the ring instead) */
    uint32_t sm_phase;          /* meetings passed (the same count on every rank) */
    struct dpar__faults *fault; /* >>fault: this rank's copy of the schedule; NULL: none (the hooks' one branch) */
};

/* memory where the comm's ranks keep their buffers: host memory, or dpar_comm_memory's */
static void *dpar__data_alloc(dpar_comm *c, size_t bytes)
{
    const dpar_comm_memory *m = &c->desc.memory;
    return m->alloc ? m->alloc(m->user, c->worker, bytes) : dpar__alloc(&c->allocator, bytes);
}
static void dpar__data_free(dpar_comm *c, void *p)
{
    const dpar_comm_memory *m = &c->desc.memory;
    if (!p) return;
    if (m->free) m->free(m->user, c->worker, p);
    else dpar__free(&c->allocator, p);
}

/* the algorithms' scratch, in the memory of the comm's buffers */
static dpar_status dpar__scratch(dpar_comm *c, size_t bytes, char **out)
{
    if (bytes > c->scratch_bytes) {
        void *p = dpar__data_alloc(c, bytes);
        if (!p)
            return dpar__err(DPAR_ENOMEM, "%s rank %d: cannot allocate %zu bytes of scratch", c->name, c->rank, bytes);
        dpar__data_free(c, c->scratch);
        c->scratch = p;
        c->scratch_bytes = bytes;
    }
    *out = (char *)c->scratch;
    return DPAR_OK;
}
/* the scratch of call x: host memory for a call on host words (x->host: split's, checkpoints' own) on a comm whose
   buffers are device memory, else the comm's scratch */
static dpar_status dpar__x_scratch(dpar__ctx *x, size_t bytes, char **out)
{
    dpar_comm *c = x->c;
    if (!x->host || !c->desc.memory.alloc) return dpar__scratch(c, bytes, out);
    if (bytes > c->hscratch_bytes) {
        void *p = dpar__alloc(&c->allocator, bytes);
        if (!p)
            return dpar__err(DPAR_ENOMEM, "%s rank %d: cannot allocate %zu bytes of scratch", c->name, c->rank, bytes);
        dpar__free(&c->allocator, c->hscratch);
        c->hscratch = p;
        c->hscratch_bytes = bytes;
    }
    *out = (char *)c->hscratch;
    return DPAR_OK;
}

/* "allreduce(count=1000, dtype=f32, op=sum) #12 at train.c:88" */
static void dpar__fp_describe(const dpar__fp *f, char *buf, size_t n)
{
    const char *name = dpar_coll_name((dpar_coll)f->coll);
    int k = 0;
    switch (f->coll) {
    case DPAR_COLL_SEND:
    case DPAR_COLL_RECV:
        k = snprintf(buf, n, "%s(count=%llu, dtype=%s, tag=%d)", name, (unsigned long long)f->count,
                     dpar_dtype_name((dpar_dtype)f->dtype), f->tag);
        break;
    case DPAR_COLL_BARRIER:
    case DPAR_COLL_SPLIT: k = snprintf(buf, n, "%s()", name); break;
    case DPAR_COLL_ALLTOALLV: /* its count is one pair's: the messages about a pair say it */
        k = snprintf(buf, n, "%s(dtype=%s)", name, dpar_dtype_name((dpar_dtype)f->dtype));
        break;
    case DPAR_COLL_BROADCAST:
        k = snprintf(buf, n, "%s(count=%llu, dtype=%s, root=%d)", name, (unsigned long long)f->count,
                     dpar_dtype_name((dpar_dtype)f->dtype), f->root);
        break;
    case DPAR_COLL_REDUCE:
        k = snprintf(buf, n, "%s(count=%llu, dtype=%s, op=%s, root=%d)", name, (unsigned long long)f->count,
                     dpar_dtype_name((dpar_dtype)f->dtype), dpar_op_name((dpar_op)f->op), f->root);
        break;
    case DPAR_COLL_ALLGATHER:
    case DPAR_COLL_ALLTOALL:
        k = snprintf(buf, n, "%s(count=%llu, dtype=%s)", name, (unsigned long long)f->count,
                     dpar_dtype_name((dpar_dtype)f->dtype));
        break;
    default:
        k = snprintf(buf, n, "%s(count=%llu, dtype=%s, op=%s)", name, (unsigned long long)f->count,
                     dpar_dtype_name((dpar_dtype)f->dtype), dpar_op_name((dpar_op)f->op));
        break;
    }
    if (k < 0 || (size_t)k >= n) return;
    if (f->seq)
        snprintf(buf + k, n - (size_t)k, " #%llu at %s:%d", (unsigned long long)f->seq, f->file ? f->file : "?",
                 f->line);
    else snprintf(buf + k, n - (size_t)k, " at %s:%d", f->file ? f->file : "?", f->line);
}

/* a call's description gets " on NAME" when its comm has a name of its own (not the default "comm"),
   so that messages about a mesh's sub-comms say which one */
static void dpar__on_comm(const dpar_comm *c, char *buf, size_t n)
{
    size_t k = strlen(buf);
    if (strcmp(c->name, "comm") != 0 && k < n) snprintf(buf + k, n - k, " on %s", c->name);
}

/* alltoallv's mismatch story: `from` says it sends from->count elements to `to`, which expects to->count */
static void dpar__v_story(char *msg, size_t n, const dpar__fp *from, const dpar__fp *to, const dpar_comm *c)
{
    char where[48];
    where[0] = 0;
    dpar__on_comm(c, where, sizeof where);
    snprintf(msg, n,
             "rank %d sends %llu elements to rank %d in alltoallv #%llu at %s:%d but rank %d expects %llu from rank %d "
             "(alltoallv #%llu at %s:%d)%s",
             from->rank, (unsigned long long)from->count, to->rank, (unsigned long long)from->seq,
             from->file ? from->file : "?", from->line, to->rank, (unsigned long long)to->count, from->rank,
             (unsigned long long)to->seq, to->file ? to->file : "?", to->line, where);
}

/* Does the fingerprint `theirs` (from a message) fit the call `x` makes? Writes the mismatch story. */
static int dpar__fp_agree(const dpar__ctx *x, const dpar__fp *theirs, size_t their_bytes, size_t my_bytes, char *msg,
                          size_t n)
{
    const dpar__fp *mine = &x->fp;
    char a[200], b[200];
    int same;
    if (x->lane == DPAR__LANE_P2P)
        same = theirs->count == mine->count && theirs->dtype == mine->dtype && theirs->tag == mine->tag;
    else if (!x->c->check) same = 1;
    else
        same = theirs->seq == mine->seq && theirs->coll == mine->coll && theirs->count == mine->count &&
               theirs->dtype == mine->dtype && theirs->op == mine->op && theirs->root == mine->root;
    if (same && their_bytes == my_bytes) return 1;
    dpar__fp_describe(theirs, a, sizeof a);
    dpar__fp_describe(mine, b, sizeof b);
    dpar__on_comm(x->c, b, sizeof b);
    if (!same && mine->coll == DPAR_COLL_ALLTOALLV && theirs->coll == mine->coll && theirs->seq == mine->seq &&
        theirs->dtype == mine->dtype && theirs->count != mine->count) { /* one pair's counts: the sender's, mine */
        dpar__fp from = *theirs, to = *mine;
        /* two ranks (vpack): both directions in one count: theirs = (they send me) + (they expect from me) << 32,
           mine = (I expect from them) + (I send them) << 32; the pair that disagrees, told "from sends, to expects" */
        if (x->vpack && (theirs->count & 0xffffffffu) != (mine->count & 0xffffffffu)) { /* their sends to me */
            from.count = theirs->count & 0xffffffffu;
            to.count = mine->count & 0xffffffffu;
        } else if (x->vpack) { /* my sends to them */
            from = *mine;
            to = *theirs;
            from.count = mine->count >> 32;
            to.count = theirs->count >> 32;
        }
        dpar__v_story(msg, n, &from, &to, x->c);
    } else if (same) /* only possible with no_check, or a bug: never read past the buffer */
        snprintf(msg, n, "rank %d offered %zu bytes where rank %d expected %zu (%s vs %s)", theirs->rank, their_bytes,
                 mine->rank, my_bytes, a, b);
    else snprintf(msg, n, "rank %d called %s while rank %d called %s", mine->rank, b, theirs->rank, a);
    return 0;
}

/* ---- primitives, dispatched to the transport ---- */
/* DPAR_TEST_STEP_HOOK(): the test suite injects random delays between the steps here */
#ifndef DPAR_TEST_STEP_HOOK
#define DPAR_TEST_STEP_HOOK() ((void)0)
#endif
static dpar_status dpar__post(dpar__ctx *x, int peer, const void *buf, size_t bytes)
{
    DPAR_TEST_STEP_HOOK();
    x->sent += bytes;
    return x->c->tp->post(x, peer, buf, bytes);
}
static dpar_status dpar__fetch(dpar__ctx *x, int peer, size_t bytes, const void **data)
{
    DPAR_TEST_STEP_HOOK();
    x->received += bytes;
    return x->c->tp->fetch(x, peer, bytes, data);
}
static dpar_status dpar__release(dpar__ctx *x, int peer) { return x->c->tp->release(x, peer); }
static dpar_status dpar__drain(dpar__ctx *x, int peer, int max) { return x->c->tp->drain(x, peer, max); }

/* local arithmetic: the transport's, or the host loops */
static dpar_status dpar__tp_reduce(dpar__ctx *x, void *out, const void *a, const void *b, size_t n, dpar_dtype t,
                                   dpar_op op, int div)
{
    if (x->c->tp->reduce && !x->host) return x->c->tp->reduce(x, out, a, b, n, t, op, div);
    dpar__reduce(out, a, b, n, t, op, div);
    return DPAR_OK;
}
static dpar_status dpar__tp_divide(dpar__ctx *x, void *out, const void *in, size_t n, dpar_dtype t, int div)
{
    if (x->c->tp->divide && !x->host) return x->c->tp->divide(x, out, in, n, t, div);
    dpar__divide(out, in, n, t, div);
    return DPAR_OK;
}
static dpar_status dpar__tp_copy(dpar__ctx *x, void *dst, const void *src, size_t bytes)
{
    if (!bytes) return DPAR_OK;
    if (x->c->tp->copy && !x->host) return x->c->tp->copy(x, dst, src, bytes);
    memcpy(dst, src, bytes);
    return DPAR_OK;
}

/* group state */
static dpar_status dpar__tp_poisoned(dpar_comm *c) { return c->tp->poisoned(c); }
static dpar_status dpar__tp_poison(dpar_comm *c, dpar_status why, const char *msg)
{
    return c->tp->poison(c, why, msg);
}
static void dpar__tp_quiesce(dpar_comm *c)
{
    if (c->tp->quiesce) c->tp->quiesce(c);
}
/* a rank fails a run it shares with the others: poison (they must not wait for it), then wait until
   no peer still reads this rank's buffers */
static dpar_status dpar__tp_fail(dpar_comm *c, dpar_status why, const char *msg)
{
    dpar_status st = dpar__tp_poison(c, why, msg);
    dpar__tp_quiesce(c);
    return st;
}

/* poison, leaving this thread's error text as it was (the caller's own error is the one to report) */
static int dpar__tp_is_poisoned(dpar_comm *c) /* without touching this thread's error text */
{
    char keep[DPAR__ERROR_TEXT];
    int poisoned;
    memcpy(keep, dpar__tls_error, sizeof keep);
    poisoned = dpar__tp_poisoned(c) != DPAR_OK;
    memcpy(dpar__tls_error, keep, sizeof keep);
    return poisoned;
}
static void dpar__tp_poison_quietly(dpar_comm *c, dpar_status why, const char *msg)
{
    char keep[DPAR__ERROR_TEXT];
    memcpy(keep, dpar__tls_error, sizeof keep);
    dpar__tp_poison(c, why, msg);
    memcpy(dpar__tls_error, keep, sizeof keep);
}

/* shared memory between ranks that are threads of one process (what direct buckets and stealing need:
   their flags are freed with rank 0's allocator, and stealing calls another rank's task function), and the
   calls (only after dpar__tp_shares_memory said yes) */
static int dpar__tp_shares_memory(const dpar_comm *c)
{
    const dpar__transport *t = c->tp;
    return t->one_process && t->expose && t->doorbell && t->wait_bell && t->wake && t->timeout;
}
static uint32_t dpar__tp_doorbell(dpar_comm *c) { return c->tp->doorbell(c); }
static dpar_status dpar__tp_wait_bell(dpar_comm *c, uint32_t seen, uint64_t deadline)
{
    return c->tp->wait_bell(c, seen, deadline);
}
static void dpar__tp_wake(dpar_comm *c, int peer) { c->tp->wake(c, peer); }
static void dpar__tp_wake_all(dpar_comm *c) /* every rank but this one */
{
    int q;
    for (q = 0; q < c->size; q++)
        if (q != c->rank) c->tp->wake(c, q);
}
static dpar_status dpar__tp_timeout(dpar__ctx *x, int peer, const char *what)
{
    return x->c->tp->timeout(x, peer, what);
}

/* the rest of a call's life */
static void dpar__tp_enter(dpar__ctx *x) { x->c->tp->enter(x); }
static void dpar__tp_prefetch(dpar__ctx *x, int peer)
{
    if (x->c->tp->prefetch) x->c->tp->prefetch(x, peer);
}
static dpar_status dpar__tp_native(dpar__ctx *x, const struct dpar__call *call, int *done)
{
    *done = 0;
    return x->c->tp->native ? x->c->tp->native(x, call, done) : DPAR_OK;
}
static dpar_status dpar__tp_split(dpar__ctx *x, int color, int key, dpar_comm **out)
{
    return x->c->tp->split(x, color, key, out);
}
static void dpar__tp_destroy(dpar_comm *c) { c->tp->destroy(c); }

static int dpar__mod(long a, int n) { return (int)(((a % n) + n) % n); }

/* fetch + copy + release, or the transport's direct receive */
static dpar_status dpar__recv_into(dpar__ctx *x, int peer, void *dst, size_t bytes)
{
    const void *p;
    if (x->c->tp->recv_into) {
        DPAR_TEST_STEP_HOOK();
        x->received += bytes;
        return x->c->tp->recv_into(x, peer, dst, bytes);
    }
    DPAR__TRY(dpar__fetch(x, peer, bytes, &p));
    if (p != dst) DPAR__TRY(dpar__tp_copy(x, dst, p, bytes));
    return dpar__release(x, peer);
}

/* a peer's whole offer through the transport's hold: held where it is (*held = 1), or copied into dst and released */
static dpar_status dpar__hold(dpar__ctx *x, int peer, void *dst, size_t bytes, const void **data, int *held)
{
    DPAR_TEST_STEP_HOOK();
    x->received += bytes;
    return x->c->tp->hold(x, peer, dst, bytes, data, held);
}

/* >>ring: the collective algorithms, written once over the transport interface ------------------ */
/* The algorithms, for every transport. Rank r of N; chunks are the blocks of dpar_block_range.
   Ring reduce-scatter, step s = 0..N-2: send chunk r-s-1, receive chunk r-s-2 and reduce it into
   mine; after N-1 steps rank r holds chunk r complete. Ring all-gather, step s: send chunk r-s,
   receive chunk r-s-1. Each step streams in segments of segment_bytes, so the neighbours work on
   consecutive segments at once. Every rank moves (N-1)/N of the buffer in each phase. */

/* reduce a fetched offer of `peer`, then release it, even when the reduce failed: the peer, leaving on the
   error, waits until nobody reads its buffer */
static dpar_status dpar__reduce_release(dpar__ctx *x, int peer, void *out, const void *a, const void *b, size_t n,
                                        dpar_dtype t, dpar_op op, int div)
{
    dpar_status st = dpar__tp_reduce(x, out, a, b, n, t, op, div), rel = dpar__release(x, peer);
    return st != DPAR_OK ? st : rel;
}

typedef struct dpar__chunks {
    size_t count, seg; /* elements, segment length in elements */
    int n;
    size_t segs;               /* segments per chunk (of the longest chunk; at least 1) */
    const size_t *offs, *lens; /* chunk c, when not dpar_block_range's */
} dpar__chunks;

static void dpar__chunk(const dpar__chunks *k, int c, size_t *off, size_t *len)
{
    if (k->offs) {
        *off = k->offs[c];
        *len = k->lens[c];
    } else {
        dpar_block_range(k->count, k->n, c, off, len);
    }
}

static dpar__chunks dpar__chunks_make(dpar__ctx *x, size_t count, size_t es, const size_t *offs, const size_t *lens)
{
    dpar__chunks k;
    size_t longest = 0, o, l;
    int c;
    k.count = count;
    k.n = x->c->size;
    k.offs = offs;
    k.lens = lens;
    k.seg = x->c->segment_bytes / es;
    if (k.seg < 1) k.seg = 1;
    for (c = 0; c < k.n; c++) {
        dpar__chunk(&k, c, &o, &l);
        if (l > longest) longest = l;
        if (!offs) break; /* block 0 is the longest of dpar_block_range */
    }
    k.segs = longest ? (longest + k.seg - 1) / k.seg : 1;
    return k;
}

/* segment g of chunk c: [*off, *off + *len) in elements of the whole buffer; *local: offset in the chunk */
static void dpar__seg(const dpar__chunks *k, int c, size_t g, size_t *off, size_t *len, size_t *local)
{
    size_t o, l, lo = g * k->seg;
    dpar__chunk(k, c, &o, &l);
    *local = lo;
    *off = o + (lo < l ? lo : l);
    *len = lo < l ? (l - lo < k->seg ? l - lo : k->seg) : 0;
}

/* reduce-scatter. dst(rc, g) is where the partial of chunk rc (segment g) goes: for allreduce `recv`
   itself (whole buffer), for reduce_scatter a double buffer and finally `recv` (rank's block). */
static dpar_status dpar__ring_reduce_scatter(dpar__ctx *x, const char *send, char *recv, size_t count, dpar_dtype t,
                                             dpar_op op, int whole)
{
    dpar_comm *c = x->c;
    int N = c->size, r = c->rank, next = (r + 1) % N, prev = (r + N - 1) % N, s;
    size_t es = dpar__dtype_sizes[t], g;
    dpar__chunks k = dpar__chunks_make(x, count, es, NULL, NULL);
    size_t longest;
    char *part[2] = {NULL, NULL};
    dpar_block_range(count, N, 0, NULL, &longest);
    if (!whole && N > 2) {
        char *scr = NULL;
        DPAR__TRY(dpar__x_scratch(x, 2 * longest * es, &scr));
        part[0] = scr;
        part[1] = scr + longest * es;
    }
    for (s = 0; s < N - 1; s++) {
        int sc = dpar__mod(r - s - 1, N), rc = dpar__mod(r - s - 2, N), last = s == N - 2;
        for (g = 0; g < k.segs; g++) {
            size_t so, sl, slo, ro, rl, rlo;
            const char *src;
            const void *p;
            char *dst;
            dpar__seg(&k, sc, g, &so, &sl, &slo);
            dpar__seg(&k, rc, g, &ro, &rl, &rlo);
            if (s == 0) src = send + so * es;     /* my own input, zero-copy */
            else if (whole) src = recv + so * es; /* the partial I made last step */
            else src = part[(s - 1) % 2] + slo * es;
            DPAR__TRY(dpar__post(x, next, src, sl * es));
            DPAR__TRY(dpar__fetch(x, prev, rl * es, &p));
            if (whole) dst = recv + ro * es;
            else if (last) dst = recv + rlo * es;
            else {
                /* part[s%2] was posted at step s-1; its segment g must be released first */
                if (s >= 2) DPAR__TRY(dpar__drain(x, next, (int)k.segs));
                dst = part[s % 2] + rlo * es;
            }
            /* the next segment streams in while this one is reduced (all but the very last) */
            if (!(last && g + 1 == k.segs)) dpar__tp_prefetch(x, prev);
            DPAR__TRY(dpar__reduce_release(x, prev, dst, send + ro * es, p, rl, t, op, last && op == DPAR_AVG ? N : 0));
        }
    }
    return dpar__drain(x, next, 0);
}

/* all-gather: rank r's block is at `mine` (zero-copy source); every block ends in recv. The
   blocks are dpar_block_range's, or offs/lens when given (a shard plan's uneven rows). Thread
   ranks whose recv is one shared buffer copy nothing: a fetched block already at its place is left
   (dpar__recv_into), and the ranks only meet. */
static dpar_status dpar__ring_allgather(dpar__ctx *x, const char *mine, char *recv, size_t count, size_t es,
                                        const size_t *offs, const size_t *lens)
{
    dpar_comm *c = x->c;
    int N = c->size, r = c->rank, next = (r + 1) % N, prev = (r + N - 1) % N, s;
    dpar__chunks k = dpar__chunks_make(x, count, es, offs, lens);
    size_t g;
    for (s = 0; s < N - 1; s++) {
        int sc = dpar__mod(r - s, N), rc = dpar__mod(r - s - 1, N);
        for (g = 0; g < k.segs; g++) {
            size_t so, sl, slo, ro, rl, rlo;
            dpar__seg(&k, sc, g, &so, &sl, &slo);
            dpar__seg(&k, rc, g, &ro, &rl, &rlo);
            DPAR__TRY(dpar__post(x, next, s == 0 ? mine + slo * es : recv + so * es, sl * es));
            DPAR__TRY(dpar__recv_into(x, prev, recv + ro * es, rl * es));
        }
    }
    return dpar__drain(x, next, 0);
}

static dpar_status dpar__allreduce_ring(dpar__ctx *x, const char *send, char *recv, size_t count, dpar_dtype t,
                                        dpar_op op)
{
    size_t es = dpar__dtype_sizes[t], off;
    dpar_block_range(count, x->c->size, x->c->rank, &off, NULL);
    DPAR__TRY(dpar__ring_reduce_scatter(x, send, recv, count, t, op, 1));
    return dpar__ring_allgather(x, recv + off * es, recv, count, es, NULL, NULL);
}

/* Deterministic allreduce: recursive halving then doubling with partner r ^ 2^k, the lower rank's
   value always on the left, so element e of the result is the fixed tree
   ((x0 op x1) op (x2 op x3)) op ... over the ranks, whatever N. */
static dpar_status dpar__allreduce_tree(dpar__ctx *x, const char *send, char *recv, size_t count, dpar_dtype t,
                                        dpar_op op)
{
    dpar_comm *c = x->c;
    int N = c->size, r = c->rank, levels = 0, k;
    size_t es = dpar__dtype_sizes[t], seg = c->segment_bytes / es, lo = 0, hi = count;
    size_t los[32], his[32];
    if (seg < 1) seg = 1;
    while ((1 << levels) < N) levels++;
    for (k = 0; k < levels; k++) {
        int partner = r ^ (1 << k), lower = r < partner;
        size_t mid = lo + (hi - lo) / 2, klo = lower ? lo : mid, khi = lower ? mid : hi;
        size_t glo = lower ? mid : lo, ghi = lower ? hi : mid, g, ng, nk;
        const char *src = k == 0 ? send : recv;
        los[k] = lo;
        his[k] = hi;
        ng = ghi - glo;
        nk = khi - klo;
        /* both halves stream in segments; the partner's half mirrors mine */
        for (g = 0; g * seg < (ng > nk ? ng : nk) || g == 0; g++) {
            size_t go = g * seg, gl = go < ng ? (ng - go < seg ? ng - go : seg) : 0;
            size_t ko = g * seg, kl = ko < nk ? (nk - ko < seg ? nk - ko : seg) : 0;
            const void *p;
            DPAR__TRY(dpar__post(x, partner, src + (glo + go) * es, gl * es));
            DPAR__TRY(dpar__fetch(x, partner, kl * es, &p));
            if (lower)
                DPAR__TRY(dpar__reduce_release(x, partner, recv + (klo + ko) * es, src + (klo + ko) * es, p, kl, t,
                                               op == DPAR_AVG ? DPAR_SUM : op, 0));
            else
                DPAR__TRY(dpar__reduce_release(x, partner, recv + (klo + ko) * es, p, src + (klo + ko) * es, kl, t,
                                               op == DPAR_AVG ? DPAR_SUM : op, 0));
        }
        lo = klo;
        hi = khi;
    }
    for (k = 0; k < levels; k++) DPAR__TRY(dpar__drain(x, r ^ (1 << k), 0)); /* recv is rewritten below */
    if (op == DPAR_AVG) DPAR__TRY(dpar__tp_divide(x, recv + lo * es, recv + lo * es, hi - lo, t, N));
    for (k = levels - 1; k >= 0; k--) {
        int partner = r ^ (1 << k);
        size_t plo = lo == los[k] ? hi : los[k], phi = lo == los[k] ? his[k] : lo, g;
        size_t nm = hi - lo, np = phi - plo;
        for (g = 0; g * seg < (nm > np ? nm : np) || g == 0; g++) {
            size_t mo = g * seg, ml = mo < nm ? (nm - mo < seg ? nm - mo : seg) : 0;
            size_t po = g * seg, pl = po < np ? (np - po < seg ? np - po : seg) : 0;
            DPAR__TRY(dpar__post(x, partner, recv + (lo + mo) * es, ml * es));
            DPAR__TRY(dpar__recv_into(x, partner, recv + (plo + po) * es, pl * es));
        }
        lo = los[k];
        hi = his[k];
    }
    for (k = 0; k < levels; k++) DPAR__TRY(dpar__drain(x, r ^ (1 << k), 0));
    return DPAR_OK;
}

/* broadcast: a pipelined chain root, root+1, ..., root-1 */
static dpar_status dpar__broadcast_chain(dpar__ctx *x, const char *send, char *recv, size_t count, size_t es, int root)
{
    dpar_comm *c = x->c;
    int N = c->size, r = c->rank, pos = dpar__mod(r - root, N), next = (r + 1) % N, prev = (r + N - 1) % N;
    size_t seg = c->segment_bytes / es, o;
    if (seg < 1) seg = 1;
    if (pos == 0 && send != recv) DPAR__TRY(dpar__tp_copy(x, recv, send, count * es));
    for (o = 0; o < count; o += seg) { /* count >= 1 here */
        size_t l = count - o < seg ? count - o : seg;
        if (pos > 0) DPAR__TRY(dpar__recv_into(x, prev, recv + o * es, l * es));
        if (pos < N - 1) DPAR__TRY(dpar__post(x, next, (pos == 0 ? send : recv) + o * es, l * es));
    }
    return pos < N - 1 ? dpar__drain(x, next, 0) : DPAR_OK;
}

/* reduce: a pipelined chain root+1, root+2, ..., root; the partials travel in scratch slots */
static dpar_status dpar__reduce_chain(dpar__ctx *x, const char *send, char *recv, size_t count, dpar_dtype t,
                                      dpar_op op, int root)
{
    dpar_comm *c = x->c;
    int N = c->size, r = c->rank, pos = dpar__mod(r - root - 1, N), next = (r + 1) % N, prev = (r + N - 1) % N;
    size_t es = dpar__dtype_sizes[t], seg = c->segment_bytes / es, o, slot = 0;
    char *scr = NULL;
    if (seg < 1) seg = 1;
    if (seg > count) seg = count; /* the scratch: no more slots' worth than the message */
    if (pos > 0 && pos < N - 1) DPAR__TRY(dpar__x_scratch(x, DPAR__QDEPTH * seg * es, &scr));
    for (o = 0; o < count; o += seg, slot++) { /* count >= 1 here */
        size_t l = count - o < seg ? count - o : seg;
        const void *p;
        if (pos == 0) {
            DPAR__TRY(dpar__post(x, next, send + o * es, l * es));
        } else {
            char *dst = pos == N - 1 ? recv + o * es : scr + (slot % DPAR__QDEPTH) * seg * es;
            if (pos < N - 1) DPAR__TRY(dpar__drain(x, next, DPAR__QDEPTH - 1)); /* the slot is free */
            DPAR__TRY(dpar__fetch(x, prev, l * es, &p));
            DPAR__TRY(
                dpar__reduce_release(x, prev, dst, send + o * es, p, l, t, op, pos == N - 1 && op == DPAR_AVG ? N : 0));
            if (pos < N - 1) DPAR__TRY(dpar__post(x, next, dst, l * es));
        }
    }
    return pos < N - 1 ? dpar__drain(x, next, 0) : DPAR_OK;
}

/* alltoall: N-1 rounds of pairwise exchange, round i: send to r+i, receive from r-i */
static dpar_status dpar__alltoall_pairwise(dpar__ctx *x, const char *send, char *recv, size_t count, size_t es)
{
    dpar_comm *c = x->c;
    int N = c->size, r = c->rank, i;
    size_t block = count * es;
    if (send == recv && block) { /* in place: the blocks I send are overwritten as others arrive */
        char *scr = NULL;
        DPAR__TRY(dpar__x_scratch(x, (size_t)N * block, &scr));
        DPAR__TRY(dpar__tp_copy(x, scr, send, (size_t)N * block));
        send = scr;
    }
    DPAR__TRY(dpar__tp_copy(x, recv + (size_t)r * block, send + (size_t)r * block, block));
    for (i = 1; i < N; i++) {
        int dst = (r + i) % N, src = (r + N - i) % N;
        DPAR__TRY(dpar__post(x, dst, send + (size_t)dst * block, block));
        DPAR__TRY(dpar__recv_into(x, src, recv + (size_t)src * block, block));
    }
    for (i = 1; i < N; i++) DPAR__TRY(dpar__drain(x, (r + i) % N, 0));
    return DPAR_OK;
}

/* dissemination: ceil(log2 N) rounds of empty messages to r + 2^k. When it ends, every rank has
   started it: a causal path leads from each rank's first post to every rank's last fetch. */
static dpar_status dpar__dissemination(dpar__ctx *x)
{
    int N = x->c->size, r = x->c->rank, d;
    const void *p;
    for (d = 1; d < N; d <<= 1) {
        DPAR__TRY(dpar__post(x, (r + d) % N, NULL, 0));
        DPAR__TRY(dpar__fetch(x, (r + N - d) % N, 0, &p));
        DPAR__TRY(dpar__release(x, (r + N - d) % N));
    }
    return DPAR_OK;
}

/* The contract checker's agreement. Fingerprints are compared where messages meet: between ring
   neighbours in every algorithm (pairwise in alltoall). If any two ranks disagree, two neighbours
   on the ring disagree (a cycle cannot change value only once), and the ring algorithms make every
   rank's last step depend on all neighbour checks but one, so every rank fails. A chain (broadcast,
   reduce) ends without such a dependency, so it ends with a dissemination that no rank finishes
   before every rank has finished its checks: the mismatch reaches every rank, not only some. */
static dpar_status dpar__agree(dpar__ctx *x) { return x->c->check ? dpar__dissemination(x) : DPAR_OK; }

/* one ring hop: my fingerprint meets my neighbour's (for calls that move nothing) */
static dpar_status dpar__ring_check(dpar__ctx *x)
{
    int N = x->c->size, r = x->c->rank;
    const void *p;
    DPAR__TRY(dpar__post(x, (r + 1) % N, NULL, 0));
    DPAR__TRY(dpar__fetch(x, (r + N - 1) % N, 0, &p));
    return dpar__release(x, (r + N - 1) % N);
}

/* barrier, and calls with count 0: a ring check, then a dissemination */
static dpar_status dpar__barrier(dpar__ctx *x)
{
    if (x->c->check) DPAR__TRY(dpar__ring_check(x));
    return dpar__dissemination(x);
}

/* alltoallv: alltoall's N-1 pairwise rounds with a count per peer; v: sendcounts, sdispls, recvcounts, rdispls (N
   each, elements, resolved). Every pair exchanges a message, empty or not: its fingerprint carries the pair's count
   (what the sender sends), which the receiver's fetch compares with what it expects before it reads a byte. One pair
   that disagrees is seen by one rank only, so the checker ends with a dissemination: no rank finishes it before every
   rank has finished its checks, and the rank that saw the mismatch poisons the comm instead of starting it, so every
   rank fails. fp_only 1: the messages are empty (the check before MPI's own alltoallv); 2: the counts were checked
   already, so no closing round. */
static dpar_status dpar__alltoallv_pairwise(dpar__ctx *x, const char *send, char *recv, const size_t *v, size_t es,
                                            int fp_only)
{
    dpar_comm *c = x->c;
    int N = c->size, r = c->rank, i;
    const size_t *sc = v, *sd = v + N, *rc = v + 2 * N, *rd = v + 3 * N;
    if (sc[r] != rc[r]) { /* this rank disagrees with itself: a peer never learns it unless told */
        char msg[DPAR__ERROR_TEXT];
        dpar__fp me = x->fp;
        me.count = sc[r];
        x->fp.count = rc[r];
        dpar__v_story(msg, sizeof msg, &me, &x->fp, c);
        return dpar__tp_fail(c, DPAR_EMISMATCH, msg);
    }
    if (fp_only != 1 && sc[r]) DPAR__TRY(dpar__tp_copy(x, recv + rd[r] * es, send + sd[r] * es, sc[r] * es));
    /* two ranks: each message carries both directions of the pair (what I send you, what I expect from you, in
       one 64-bit count when both fit 32 bits), so each rank checks both and neither can return with a mismatch
       the other saw: no closing dissemination (one round instead of two) */
    x->vpack = N == 2 && sc[1 - r] <= 0xffffffffu && rc[1 - r] <= 0xffffffffu;
    for (i = 1; i < N; i++) {
        int dst = (r + i) % N, src = (r + N - i) % N;
        size_t sb = fp_only == 1 ? 0 : sc[dst] * es, rb = fp_only == 1 ? 0 : rc[src] * es;
        x->fp.count = x->vpack ? sc[dst] + ((uint64_t)rc[dst] << 32) : sc[dst];
        DPAR__TRY(dpar__post(x, dst, sb ? send + sd[dst] * es : NULL, sb));
        x->fp.count = x->vpack ? rc[src] + ((uint64_t)sc[src] << 32) : rc[src];
        DPAR__TRY(dpar__recv_into(x, src, rb ? recv + rd[src] * es : NULL, rb));
    }
    for (i = 1; i < N; i++) DPAR__TRY(dpar__drain(x, (r + i) % N, 0));
    x->fp.count = 0;
    if (x->vpack || fp_only == 2) return DPAR_OK; /* 2: the counts were checked already (dpar__sm_alltoallv) */
    return dpar__agree(x);
}

/* >>algo: one-shot and reduce-by-slice allreduce over shared memory; streaming stores ----------- */
/* Thread ranks (a transport that shares memory, dpar__tp_shares_memory) may meet through words in
   memory instead of messages. At the first allreduce of a comm, rank 0 allocates one block the ranks
   share (dpar__sm: per rank a record and two staging buffers), exposes it (collective) and the last
   rank to leave frees it. A rank's record holds `phase`, the meetings it has passed (every rank
   passes the same ones, in the same order), the fingerprint of the call it is in (the contract
   checker compares it: a peer in another call of the same number is a mismatch, not a wait), and for
   reduce-by-slice this call's buffers. A meeting: publish my phase, ring every doorbell, wait for
   each peer's phase on my own doorbell (dpar__tp_wait_bell spins, then sleeps).
   One-shot, per piece of at most a staging buffer: copy my input to staging buffer (phase & 1), meet,
   reduce the whole piece reading every rank's staging copy. Two buffers suffice: a rank writes buffer
   b at phase p only after everyone has passed phase p - 1, so after they stopped reading b (p - 2).
   Reduce-by-slice: publish send/recv, meet (A), reduce my block reading every rank's send where it
   is, meet (B), copy the other blocks from their owners' recv, meet (C) so nobody still reads mine.
   Both combine the inputs of each element in the ring's order (dpar_algo), so every algorithm gives
   the same bits. Destinations of at least the streaming size (the LLC) are written with streaming
   (non-temporal) stores where the host loops do the arithmetic, fenced before each meeting. */
#ifndef DPAR_ONESHOT_MAX_BYTES
#define DPAR_ONESHOT_MAX_BYTES 2048
#endif
#ifndef DPAR_SLICE_MIN_BYTES
#define DPAR_SLICE_MIN_BYTES 2048
#endif
#ifndef DPAR_RING_MIN_BYTES
#define DPAR_RING_MIN_BYTES (2u << 20)
#endif
#ifndef DPAR_MSG_ONESHOT_MAX_BYTES
#define DPAR_MSG_ONESHOT_MAX_BYTES 16384
#endif
#ifndef DPAR_SHM_ONESHOT_MAX_BYTES
#define DPAR_SHM_ONESHOT_MAX_BYTES 65536 /* MPI, processes of one node: one-shot through their block up to this */
#endif
#ifndef DPAR_SHM_TWO_MAX_BYTES /* MPI, two processes of one node: one-shot through their block up to this */
#define DPAR_SHM_TWO_MAX_BYTES (16u << 20)
#endif
/* the staging buffers of the block of `procs` processes: the largest one-shot message, at most 256 KiB on two
   processes (larger ones go through in pieces of one buffer). The pieces must stay in the cache: on 2 processes
   one-shot in 256 KiB pieces took 100-102 us at 1 MiB and 439-447 at 4 MiB, in 1 MiB pieces 220-236 and 917-949
   (the ring: 187-194 and 653-716; docs/mpi.md, 'One-shot through the block against the ring from 1 MiB') */
#define DPAR__SHM_TWO_STAGE ((size_t)256 << 10)
#define DPAR__SHM_TWO_MAX ((size_t)DPAR_SHM_TWO_MAX_BYTES)
#define DPAR__SHM_STAGE(procs)                                                                 \
    ((procs) == 2 && DPAR__SHM_TWO_MAX > (size_t)DPAR_SHM_ONESHOT_MAX_BYTES                    \
         ? (DPAR__SHM_TWO_MAX < DPAR__SHM_TWO_STAGE ? DPAR__SHM_TWO_MAX : DPAR__SHM_TWO_STAGE) \
         : (size_t)DPAR_SHM_ONESHOT_MAX_BYTES)
#define DPAR__MSG_PIECE 2048 /* one-shot over messages sends pieces of this size (below MPI's eager limits) */
#ifndef DPAR_STREAM_MIN_BYTES
#define DPAR_STREAM_MIN_BYTES 0 /* 0: the last-level cache's size */
#endif
#define DPAR__SM_BLOCK 8192 /* bytes reduced at a time by reduce-by-slice: the partial stays in L1 */

static const char *const dpar__algo_names[] = {"auto", "ring", "oneshot", "slice", "tree", "native"};
DPAR_API const char *dpar_algo_name(dpar_algo a) { return (unsigned)a < DPAR_ALGO_COUNT ? dpar__algo_names[a] : "?"; }

/* ---- streaming stores: x86 with SSE2; elsewhere ordinary stores ---- */
#if !defined(DPAR_NO_STREAM) && (defined(__GNUC__) || defined(__clang__)) && \
    (defined(__x86_64__) || (defined(__i386__) && defined(__SSE2__)))
#include <emmintrin.h>
#define DPAR__STREAM 1
/* dst = src with stores that bypass the caches (dst 16-byte aligned inside; the edges ordinary) */
static void dpar__stream_copy(void *dst, const void *src, size_t bytes)
{
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (16u - ((uintptr_t)d & 15u)) & 15u;
    if (head > bytes) head = bytes;
    memcpy(d, s, head);
    d += head, s += head, bytes -= head;
    for (; bytes >= 64; bytes -= 64, d += 64, s += 64) {
        __m128i v0 = _mm_loadu_si128((const __m128i *)(const void *)s);
        __m128i v1 = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
        __m128i v2 = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
        __m128i v3 = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
        _mm_stream_si128((__m128i *)(void *)d, v0);
        _mm_stream_si128((__m128i *)(void *)(d + 16), v1);
        _mm_stream_si128((__m128i *)(void *)(d + 32), v2);
        _mm_stream_si128((__m128i *)(void *)(d + 48), v3);
    }
    memcpy(d, s, bytes);
}
/* streaming stores are weakly ordered: this fence makes them visible before any later store (the
   release of a meeting's phase) */
static void dpar__stream_fence(void) { _mm_sfence(); }
/* out = a + b (then / div when div > 1) for f32, streamed: the bits of dpar__reduce's (the same IEEE
   single-precision add and divide per element); 0 when it does not apply (then the caller goes through L1) */
static int dpar__stream_reduce(void *out, const void *a, const void *b, size_t n, dpar_dtype t, dpar_op op, int div)
{
    float *o = (float *)out;
    const float *x = (const float *)a, *y = (const float *)b;
    size_t i = 0;
    float f = (float)div;
    __m128 d = _mm_set1_ps(f);
    if (t != DPAR_F32 || (op != DPAR_SUM && op != DPAR_AVG) || ((uintptr_t)o & 3u)) return 0;
    if (op == DPAR_SUM) div = 0;
    for (; i < n && ((uintptr_t)(o + i) & 15u); i++) o[i] = div > 1 ? (x[i] + y[i]) / f : x[i] + y[i];
    for (; i + 8 <= n; i += 8) {
        __m128 s0 = _mm_add_ps(_mm_loadu_ps(x + i), _mm_loadu_ps(y + i));
        __m128 s1 = _mm_add_ps(_mm_loadu_ps(x + i + 4), _mm_loadu_ps(y + i + 4));
        if (div > 1) s0 = _mm_div_ps(s0, d), s1 = _mm_div_ps(s1, d);
        _mm_stream_ps(o + i, s0);
        _mm_stream_ps(o + i + 4, s1);
    }
    for (; i < n; i++) o[i] = div > 1 ? (x[i] + y[i]) / f : x[i] + y[i];
    return 1;
}
#else
#define DPAR__STREAM 0
static void dpar__stream_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static void dpar__stream_fence(void) {}
static int dpar__stream_reduce(void *out, const void *a, const void *b, size_t n, dpar_dtype t, dpar_op op, int div)
{
    (void)out, (void)a, (void)b, (void)n, (void)t, (void)op, (void)div;
    return 0;
}
#endif

/* the size in bytes of the last-level cache CPU 0 sees: Linux's sysfs (per core complex: glibc's
   sysconf reports a whole AMD socket's L3, ten times too much), else sysconf, else 32 MiB */
static size_t dpar__llc_bytes(void)
{
    long v = -1;
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    if (f) {
        char unit = 0;
        if (fscanf(f, "%ld%c", &v, &unit) >= 1)
            v = unit == 'K' ? v * 1024 : unit == 'M' ? v * 1024 * 1024 : unit == 'G' ? v << 30 : v;
        fclose(f);
    }
#ifdef _SC_LEVEL3_CACHE_SIZE
    /* without sysfs's entry (a VM that shows no cache topology) sysconf reads CPUID, which there can give a whole
       package's L3: 508 MiB on a 2-vCPU AMD EPYC VM, where streaming from N x bytes = 32 MiB made 2 ranks' 16 MiB
       allreduce 1.56-1.86 times the add pass against 0.78-0.88, 64 MiB 1.22-1.24 against 0.98 (bench_comm, two runs
       each). More than 64 MiB from there is taken as 32 MiB, one AMD CCD's L3. */
    if (v <= 0) {
        v = sysconf(_SC_LEVEL3_CACHE_SIZE);
        if (v > (64L << 20)) v = 32L << 20;
    }
#endif
    return v > 0 ? (size_t)v : (size_t)32 << 20;
}

/* ---- the shared block ---- */
typedef struct dpar__sm_rank { /* one rank's record, on cache lines of its own */
    uint32_t phase;            /* meetings passed */
    uint32_t reading;          /* 1 while it reads other ranks' buffers (reduce-by-slice) */
    uint64_t seq;              /* the call it is in (0 while the fingerprint below changes) */
    uint64_t count;
    int coll, dtype, op, root, line;
    const char *file;
    const void *send; /* reduce-by-slice: this call's buffers */
    void *recv;
    /* processes (a block the transport maps into each, dpar__sm_make_in): file means nothing in another
       process, so the name is copied here when it changes, read only for the message of a mismatch */
    const char *text_of; /* the file pointer text was copied from (the writer's own) */
    char text[64];
} dpar__sm_rank;

typedef struct dpar__sm {
    int refs;      /* ranks still using it; the last one frees it with rank 0's allocator */
    int processes; /* 1: the ranks are processes; this header is each one's own, the records and stages are
                      in a block the transport maps into all (one-shot only: nobody reads a send buffer) */
    int n;
    dpar_allocator allocator;
    size_t stride;     /* bytes per rank record */
    size_t stage;      /* bytes of one staging buffer */
    size_t stream_min; /* streaming stores for destinations of at least this many bytes */
    char *ranks;       /* n records */
    char *stages;      /* n x 2 staging buffers */
} dpar__sm;

static dpar__sm_rank *dpar__sm_at(dpar__sm *sh, int q)
{
    return (dpar__sm_rank *)(void *)(sh->ranks + (size_t)q * sh->stride);
}
static char *dpar__sm_stage(dpar__sm *sh, int q, uint32_t phase)
{
    return sh->stages + ((size_t)q * 2 + (phase & 1u)) * sh->stage;
}

/* the bytes of the records and staging buffers of n ranks (stages of `stage` bytes, rounded up to lines) */
static size_t dpar__sm_bytes(size_t n, size_t stage)
{
    size_t line = DPAR__CACHE_LINE, stride = (sizeof(dpar__sm_rank) + line - 1) / line * line;
    return n * stride + 2 * n * ((stage + line - 1) / line * line);
}
static void dpar__sm_layout(dpar__sm *sh, dpar_comm *c, char *block, size_t stage)
{
    size_t line = DPAR__CACHE_LINE, n = (size_t)c->size;
    sh->n = c->size;
    sh->allocator = c->allocator;
    sh->stride = (sizeof(dpar__sm_rank) + line - 1) / line * line;
    sh->stage = (stage + line - 1) / line * line;
    sh->stream_min = DPAR_STREAM_MIN_BYTES ? (size_t)DPAR_STREAM_MIN_BYTES : dpar__llc_bytes();
    sh->ranks = block;
    sh->stages = block + n * sh->stride;
}

#ifdef DPAR_MPI
/* processes (the MPI transport): the records and stages in `block` (zeroed, mapped by every rank's
   process), the header sh this process's own (zeroed, from c's allocator: dpar__sm_release frees it) */
static void dpar__sm_init_in(dpar__sm *sh, dpar_comm *c, char *block, size_t stage)
{
    sh->refs = 1;
    sh->processes = 1;
    dpar__sm_layout(sh, c, block, stage);
    c->sm = sh;
    c->sm_state = 1;
}
#endif

static dpar__sm *dpar__sm_make(dpar_comm *c)
{
    size_t line = DPAR__CACHE_LINE, head = (sizeof(dpar__sm) + line - 1) / line * line;
    size_t stage = 2 * (size_t)DPAR_ONESHOT_MAX_BYTES > 4096 ? 2 * (size_t)DPAR_ONESHOT_MAX_BYTES : 4096;
    char *p = (char *)dpar__calloc(&c->allocator, 1, head + dpar__sm_bytes((size_t)c->size, stage));
    dpar__sm *sh = (dpar__sm *)(void *)p;
    if (!p) return NULL;
    sh->refs = c->size;
    dpar__sm_layout(sh, c, p + head, stage);
    return sh;
}

/* leaving the comm (dpar_comm_destroy) */
static void dpar__sm_release(dpar_comm *c)
{
    dpar__sm *sh = c->sm;
    c->sm = NULL;
    if (sh && DPAR__SUB(&sh->refs, 1, DPAR__ACQ_REL) == 1) {
        dpar_allocator a = sh->allocator;
        dpar__free(&a, sh);
    }
}

/* a call starts (dpar__execute, dpar__coll_begin): its fingerprint into my record, for the peers'
   contract checks (a seqlock: seq 0 while the fields change) */
static void dpar__sm_enter(const dpar__ctx *x)
{
    dpar__sm_rank *me;
    if (!x->c->sm || x->lane != DPAR__LANE_COLL) return;
    me = dpar__sm_at(x->c->sm, x->c->rank);
    DPAR__STORE(&me->seq, 0, DPAR__RELAXED); /* the release stores below keep it ahead of them */
    DPAR__STORE(&me->count, x->fp.count, DPAR__RELEASE);
    DPAR__STORE(&me->coll, x->fp.coll, DPAR__RELEASE);
    DPAR__STORE(&me->dtype, x->fp.dtype, DPAR__RELEASE);
    DPAR__STORE(&me->op, x->fp.op, DPAR__RELEASE);
    DPAR__STORE(&me->root, x->fp.root, DPAR__RELEASE);
    DPAR__STORE(&me->line, x->fp.line, DPAR__RELEASE);
    DPAR__STORE(&me->file, x->fp.file, DPAR__RELEASE);
    if (x->c->sm->processes && me->text_of != x->fp.file) { /* byte by byte: a reader may be copying it */
        const char *f = x->fp.file ? x->fp.file : "?";
        size_t i;
        for (i = 0; i + 1 < sizeof me->text && f[i]; i++) DPAR__STORE(&me->text[i], f[i], DPAR__RELAXED);
        DPAR__STORE(&me->text[i], (char)0, DPAR__RELAXED);
        me->text_of = x->fp.file;
    }
    DPAR__STORE(&me->seq, x->fp.seq, DPAR__RELEASE);
}

/* Does peer q's call fit mine? Only a peer in the call of my number is compared (an earlier one has
   not arrived; a later one has compared itself with me). The bytes are compared even with no_check.
   A mismatch poisons the comm with the story every rank returns. */
static dpar_status dpar__sm_agree(dpar__ctx *x, int q)
{
    dpar__sm_rank *p = dpar__sm_at(x->c->sm, q);
    dpar__fp theirs;
    char msg[DPAR__ERROR_TEXT];
    size_t es = dpar__dtype_sizes[x->fp.dtype];
    uint64_t seq = DPAR__LOAD(&p->seq, DPAR__ACQUIRE);
    if (seq != x->fp.seq) return DPAR_OK;
    memset(&theirs, 0, sizeof theirs);
    theirs.seq = seq;
    theirs.rank = q;
    theirs.count = DPAR__LOAD(&p->count, DPAR__ACQUIRE);
    theirs.coll = DPAR__LOAD(&p->coll, DPAR__ACQUIRE);
    theirs.dtype = DPAR__LOAD(&p->dtype, DPAR__ACQUIRE);
    theirs.op = DPAR__LOAD(&p->op, DPAR__ACQUIRE);
    theirs.root = DPAR__LOAD(&p->root, DPAR__ACQUIRE);
    theirs.line = DPAR__LOAD(&p->line, DPAR__ACQUIRE);
    theirs.file = DPAR__LOAD(&p->file, DPAR__ACQUIRE);
    /* (acquire loads: the second look at seq cannot move ahead of them; no fences, which TSan lacks) */
    if (DPAR__LOAD(&p->seq, DPAR__RELAXED) != seq) return DPAR_OK; /* it has moved on: it agreed */
    if ((unsigned)theirs.dtype >= DPAR_DTYPE_COUNT) theirs.dtype = x->fp.dtype;
    if (x->c->sm->processes) theirs.file = ""; /* the name is fetched below, only for the message */
    if (dpar__fp_agree(x, &theirs, (size_t)theirs.count * dpar__dtype_sizes[theirs.dtype], (size_t)x->fp.count * es,
                       msg, sizeof msg))
        return DPAR_OK;
    if (x->c->sm->processes) {
        char text[sizeof p->text];
        size_t i;
        for (i = 0; i < sizeof text; i++) text[i] = DPAR__LOAD(&p->text[i], DPAR__RELAXED);
        text[sizeof text - 1] = 0;
        theirs.file = text;
        (void)dpar__fp_agree(x, &theirs, (size_t)theirs.count * dpar__dtype_sizes[theirs.dtype],
                             (size_t)x->fp.count * es, msg, sizeof msg);
    }
    return dpar__tp_poison(x->c, DPAR_EMISMATCH, msg);
}

/* a meeting: I have passed `phase` (my streaming stores fenced first); every peer is woken */
static void dpar__sm_arrive(dpar_comm *c, uint32_t phase)
{
    dpar__stream_fence();
    DPAR__STORE(&dpar__sm_at(c->sm, c->rank)->phase, phase, DPAR__RELEASE);
    dpar__tp_wake_all(c);
}

/* wait until rank q has passed `phase`, on my doorbell; a peer in another call of my number fails it */
static dpar_status dpar__sm_wait(dpar__ctx *x, int q, uint32_t phase, const char *what)
{
    dpar_comm *c = x->c;
    dpar__sm_rank *p = dpar__sm_at(c->sm, q);
    uint64_t now, poll;
    unsigned i;
    DPAR_TEST_STEP_HOOK();
    /* a peer in step arrives within a few hundred ns: look at its phase before the clock and the checks, and
       (thread ranks) before the doorbell, whose line the peer's wake would pass first: one cache-line transfer
       less per meeting (2 ranks: 1 KiB 0.43 us against 0.48-0.52). Not where ranks outnumber the CPUs: there
       the peer may need this CPU (4 ranks on 2 cores: 4 KiB 5.6-10.7 us against 4.7-4.8) */
    if (c->tp->polls || !c->spin.yield)
        for (i = 0; i < 32; i++) {
            if ((int32_t)(DPAR__LOAD(&p->phase, DPAR__ACQUIRE) - phase) >= 0) return DPAR_OK;
            dpar__cpu_relax();
        }
    for (i = 0;; i++) {
        uint32_t bell = dpar__tp_doorbell(c);
        if ((int32_t)(DPAR__LOAD(&p->phase, DPAR__ACQUIRE) - phase) >= 0) return DPAR_OK;
        DPAR__TRY(dpar__tp_poisoned(c));
        if (c->tp->polls && (i & 15u)) { /* a polling transport's look: the phase and the poison only */
            dpar__tp_wait_bell(c, bell, 0);
            continue;
        }
        DPAR__TRY(dpar__sm_agree(x, q));
        now = dpar_time_ns();
        if (x->deadline && now >= x->deadline) return dpar__tp_timeout(x, q, what);
        /* a peer that enters another call rings no bell: look again at least every 50 ms */
        poll = now + 50000000u;
        dpar__tp_wait_bell(c, bell, x->deadline && x->deadline < poll ? x->deadline : poll);
    }
}

/* every peer has passed `phase`; at the first meeting of a call, every peer is in the same call */
static dpar_status dpar__sm_meet(dpar__ctx *x, uint32_t phase, int first, const char *what)
{
    dpar_comm *c = x->c;
    int q;
    dpar__sm_arrive(c, phase);
    for (q = 1; q < c->size; q++) DPAR__TRY(dpar__sm_wait(x, (c->rank + q) % c->size, phase, what));
    for (q = 0; first && q < c->size; q++)
        if (q != c->rank) DPAR__TRY(dpar__sm_agree(x, q));
    return DPAR_OK;
}

/* Collective, at a comm's first allreduce: rank 0 makes the block and exposes it; NULL on every rank
   (rank 0 out of memory) leaves the comm on the ring. The fingerprints meet in a barrier first, so
   ranks that disagree, or one that never comes, fail with the usual story about this call. */
static dpar_status dpar__sm_setup(dpar__ctx *x)
{
    dpar_comm *c = x->c;
    dpar__sm *mine = c->rank == 0 ? dpar__sm_make(c) : NULL;
    const void *bufs[1];
    void **peers = NULL;
    dpar__fp keep = x->fp;
    dpar_status st;
    char *scr = NULL;
    bufs[0] = mine;
    if ((st = dpar__scratch(c, (size_t)c->size * sizeof(void *), &scr)) != DPAR_OK) {
        dpar__free(&c->allocator, mine);
        return dpar__tp_fail(c, st, dpar_last_error());
    }
    peers = (void **)(void *)scr;
    if ((st = dpar__barrier(x)) != DPAR_OK) { /* everyone is here: expose's own waits cannot time out */
        dpar__free(&c->allocator, mine);
        return st;
    }
    st = c->tp->expose(x, bufs, 1, peers); /* once given, the block is never freed on an error */
    x->fp = keep;
    DPAR__TRY(st);
    c->sm = (dpar__sm *)peers[0];
    c->sm_state = c->sm ? 1 : -1;
    dpar__sm_enter(x);
    return DPAR_OK;
}

/* the story of pair (i, j) whose counts disagree, from the records of the node's block (every rank tells it) */
static dpar_status dpar__sm_v_story(dpar__ctx *x, int i, uint64_t sends, int j, uint64_t expects)
{
    dpar__sm *sh = x->c->sm;
    char msg[DPAR__ERROR_TEXT], text[2][sizeof(((dpar__sm_rank *)0)->text)];
    dpar__fp from, to;
    size_t k, w;
    for (w = 0; w < 2; w++) { /* the callers' file names, as their processes copied them */
        const dpar__sm_rank *rec = dpar__sm_at(sh, w ? j : i);
        for (k = 0; k < sizeof text[w]; k++) text[w][k] = DPAR__LOAD(&rec->text[k], DPAR__RELAXED);
        text[w][sizeof text[w] - 1] = 0;
    }
    memset(&from, 0, sizeof from);
    memset(&to, 0, sizeof to);
    from.rank = i, from.count = sends, from.seq = x->fp.seq, from.file = text[0];
    from.line = DPAR__LOAD(&dpar__sm_at(sh, i)->line, DPAR__ACQUIRE);
    to.rank = j, to.count = expects, to.seq = x->fp.seq, to.file = text[1];
    to.line = DPAR__LOAD(&dpar__sm_at(sh, j)->line, DPAR__ACQUIRE);
    dpar__v_story(msg, sizeof msg, &from, &to, x->c);
    return dpar__tp_poison(x->c, DPAR_EMISMATCH, msg);
}
/* alltoallv between processes of one node (the MPI transport's shared block): instead of N - 1 rounds of messages
   and a dissemination, each rank writes a header (its N send counts, its N receive counts) and what it sends, packed
   in rank order, into its staging buffer, and the ranks meet. Every rank then reads every header, so every rank finds
   the same first pair whose counts disagree and returns the same story (no closing round), and copies, from each
   sender's buffer, the bytes of its own block that the round brought. A part of up to two buffers takes a second
   round (a second meeting); when some part is larger (every rank sees it in the headers), the transport's
   alltoallv_parts moves the blocks (MPI_Ialltoallv; else the pairwise rounds, without their closing round: the
   counts are checked): there MPI's messages, which copy once, beat two copies through the block (bench_mpi). A
   rank whose part will not go through the block writes only its header. The buffers alternate by phase, so a
   round's writes never meet the reads of the round before it (a rank that writes has passed a meeting every reader
   of the round before last came to after reading). *done 0: the caller moves the blocks. */
static dpar_status dpar__sm_alltoallv(dpar__ctx *x, const char *send, char *recv, const size_t *v, size_t es, int *done)
{
    dpar_comm *c = x->c;
    dpar__sm *sh = c->sm;
    size_t N = (size_t)c->size, me = (size_t)c->rank, q, k, head = (2 * N + 1) * sizeof(uint64_t), total = 0,
           rounds = 1;
    size_t most = 2 * sh->stage - head; /* the largest part that goes through the block */
    const size_t *sc = v, *sd = v + N, *rc = v + 2 * N, *rd = v + 3 * N;
    size_t *at; /* per sender q: where my block starts in its part */
    char *scr = NULL;
    dpar_status st;
    *done = 0;
    if ((st = dpar__scratch(c, N * sizeof(size_t), &scr)) != DPAR_OK)
        return dpar__tp_fail(c, st, dpar_last_error()); /* the others must not wait for me */
    at = (size_t *)(void *)scr;
    for (q = 0; q < N; q++) total += sc[q] * es;
    for (k = 0; k < rounds; k++) {
        uint32_t phase = ++c->sm_phase;
        char *mine = dpar__sm_stage(sh, c->rank, phase);
        size_t lo = k ? sh->stage - head : 0, first = k ? 0 : head; /* this round: my part's bytes from lo, at first */
        size_t room = sh->stage - first, b;
        if (k == 0) { /* my counts, and whether my counts and displacements in bytes all fit an int (MPI's) */
            uint64_t *h = (uint64_t *)(void *)mine;
            for (q = 0; q < N; q++) h[q] = sc[q], h[N + q] = rc[q];
            h[2 * N] = 1;
            for (q = 0; q < 4 * N; q++)
                if (v[q] > (size_t)INT_MAX / es) h[2 * N] = 0;
        }
        for (q = 0, b = 0; total <= most && q < N && b < lo + room; b += sc[q] * es, q++) {
            size_t from = b > lo ? b : lo, to = b + sc[q] * es < lo + room ? b + sc[q] * es : lo + room;
            if (from < to) memcpy(mine + first + (from - lo), send + sd[q] * es + (from - b), to - from);
        }
        DPAR__TRY(dpar__sm_meet(x, phase, k == 0, "arrive"));
        if (k == 0) { /* every pair, in the same order on every rank: i's count for j against j's for i */
            for (q = 0; q < N * N; q++) {
                size_t i = q / N, j = q % N;
                const uint64_t *hi = (const uint64_t *)(const void *)dpar__sm_stage(sh, (int)i, phase);
                const uint64_t *hj = (const uint64_t *)(const void *)dpar__sm_stage(sh, (int)j, phase);
                if (hi[j] != hj[N + i]) return dpar__sm_v_story(x, (int)i, hi[j], (int)j, hj[N + i]);
            }
            for (q = 0, x->vfits = 1; q < N; q++) /* the same on every rank: every rank reads every header */
                if (!((const uint64_t *)(const void *)dpar__sm_stage(sh, (int)q, phase))[2 * N]) x->vfits = 0;
            for (q = 0; q < N; q++) { /* where my block starts in q's part; the rounds the longest part needs */
                const uint64_t *hq = (const uint64_t *)(const void *)dpar__sm_stage(sh, (int)q, phase);
                size_t j, len = 0;
                for (j = 0, at[q] = 0; j < N; j++) {
                    if (j < me) at[q] += (size_t)hq[j] * es;
                    len += (size_t)hq[j] * es;
                }
                if (len > most) return DPAR_OK; /* the caller moves the blocks */
                if (head + len > sh->stage) rounds = 2;
            }
        }
        for (q = 0; q < N; q++) { /* the bytes of my block from q that this round brought */
            size_t from = at[q] > lo ? at[q] : lo, to = at[q] + rc[q] * es < lo + room ? at[q] + rc[q] * es : lo + room;
            if (from < to)
                memcpy(recv + rd[q] * es + (from - at[q]), dpar__sm_stage(sh, (int)q, phase) + first + (from - lo),
                       to - from);
        }
    }
    for (q = 0; q < N; q++)
        if (q != me) x->sent += sc[q] * es, x->received += rc[q] * es;
    *done = 1;
    return DPAR_OK;
}

/* out[0..n) = elements [lo, lo + n) of the whole message (count elements) combined in the ring's
   order: in[q] is rank q's copy of those elements. out is none of the inputs. */
static dpar_status dpar__sm_combine(dpar__ctx *x, char *out, const char *const *in, size_t lo, size_t n, size_t count,
                                    dpar_dtype t, dpar_op op)
{
    int N = x->c->size, c, j;
    size_t es = dpar__dtype_sizes[t];
    if (x->c->tp->combine && !x->host && x->c->desc.memory.combine && N <= DPAR_COMBINE_MAX_RANKS)
        return x->c->tp->combine(x, out, in, lo, n, count, t, op); /* one launch, not N(N-1) */
    for (c = 0; c < N; c++) {
        size_t co, cl, a, b, o;
        dpar_block_range(count, N, c, &co, &cl);
        a = co > lo ? co : lo;
        b = co + cl < lo + n ? co + cl : lo + n;
        if (a >= b) continue;
        o = (a - lo) * es;
        DPAR__TRY(dpar__tp_reduce(x, out + o, in[(c + 2) % N] + o, in[(c + 1) % N] + o, b - a, t, op,
                                  N == 2 && op == DPAR_AVG ? N : 0));
        for (j = 3; j <= N; j++)
            DPAR__TRY(dpar__tp_reduce(x, out + o, in[(c + j) % N] + o, out + o, b - a, t, op,
                                      j == N && op == DPAR_AVG ? N : 0));
    }
    return DPAR_OK;
}

static dpar_status dpar__allreduce_oneshot(dpar__ctx *x, const char *send, char *recv, size_t count, dpar_dtype t,
                                           dpar_op op)
{
    dpar_comm *c = x->c;
    dpar__sm *sh = c->sm;
    int N = c->size, q;
    size_t es = dpar__dtype_sizes[t], per = sh->stage / es, lo;
    const char *small[64], **in = small;
    char *scr = NULL;
    dpar_status st;
    if (N > 64) {
        if ((st = dpar__scratch(c, (size_t)N * sizeof(char *), &scr)) != DPAR_OK)
            return dpar__tp_fail(c, st, dpar_last_error()); /* the others must not wait for me */
        in = (const char **)(void *)scr;
    }
    for (lo = 0; lo < count; lo += per) {
        size_t n = count - lo < per ? count - lo : per;
        uint32_t phase = ++c->sm_phase;
        for (q = 0; q < N; q++) in[q] = dpar__sm_stage(sh, q, phase);
        (void)dpar__tp_copy(x, (char *)in[c->rank], send + lo * es, n * es); /* shared memory: host loops */
        DPAR__TRY(dpar__sm_meet(x, phase, lo == 0, "arrive"));
        (void)dpar__sm_combine(x, recv + lo * es, in, lo, n, count, t, op);
        x->sent += (size_t)(N - 1) * n * es; /* what the others read of mine, and I of theirs */
        x->received += (size_t)(N - 1) * n * es;
    }
    return DPAR_OK;
}

/* One-shot over messages, for transports that do not share memory (MPI): every rank offers its input
   to every other rank, receives theirs straight into scratch and combines all N in the ring's order
   (the same bits as the ring). One step instead of 2(N-1), N-1 messages each way per rank; the
   fingerprints meet in every receive. Device memory (the transport's hold): a peer's input that this rank's
   kernels reach is read where it is and released after the combine (no copy), and the combine is one call
   (memory.combine) where the memory has it: on a GPU, N(N-1) + N - 1 launches, each followed by a
   synchronisation in a host-blocking pool, become one (two in place). */
static dpar_status dpar__allreduce_oneshot_msg(dpar__ctx *x, const char *send, char *recv, size_t count, dpar_dtype t,
                                               dpar_op op)
{
    dpar_comm *c = x->c;
    int N = c->size, r = c->rank, k;
    size_t es = dpar__dtype_sizes[t], bytes = count * es, slot = (bytes + 63) / 64 * 64, o;
    /* pieces an MPI library sends eagerly, no handshake; a transport that copies through callbacks (device
       memory) pays a launch and a wait per piece instead: one piece (2 KiB pieces made a 1 MiB allreduce of
       two workers on an H200 take 7.2 ms, against 0.03 ms for the ring) */
    size_t piece = c->tp->copy ? bytes : DPAR__MSG_PIECE / es * es;
    const char *small[64], **in = small; /* host pointers: the scratch may be device memory (dpar_comm_memory) */
    char *scr = NULL;
    dpar_status st = DPAR_OK;
    int hold = c->tp->hold && piece == bytes;
    DPAR__TRY(dpar__x_scratch(x, (size_t)N * slot, &scr));
    if (N > 64 && !(in = (const char **)dpar__alloc(&c->allocator, (size_t)N * sizeof(char *))))
        return dpar__err(DPAR_ENOMEM, "%s rank %d: out of memory", c->name, r);
    in[r] = send;
    if (send == recv) { /* in place: what I offer must stay as it is while I write recv */
        st = dpar__tp_copy(x, scr + (size_t)r * slot, send, bytes);
        in[r] = scr + (size_t)r * slot;
    }
    for (k = 1; k < N; k++) in[(r + N - k) % N] = scr + (size_t)((r + N - k) % N) * slot;
    for (o = 0; o < bytes && st == DPAR_OK; o += piece) {
        size_t l = bytes - o < piece ? bytes - o : piece;
        for (k = 1; k < N && st == DPAR_OK; k++) st = dpar__post(x, (r + k) % N, in[r] + o, l);
        for (k = 1; k < N && st == DPAR_OK; k++) {
            int q = (r + N - k) % N, held = 0;
            const void *p = NULL;
            if (!hold) {
                st = dpar__recv_into(x, q, (char *)in[q] + o, l);
                continue;
            }
            st = dpar__hold(x, q, (char *)in[q], l, &p, &held);
            if (st == DPAR_OK && held) in[q] = (const char *)p; /* a peer's buffer: released below */
        }
    }
    if (st == DPAR_OK) st = dpar__sm_combine(x, recv, in, 0, count, count, t, op);
    for (k = 1; k < N && hold; k++) { /* the held offers: their reads are done (queued) */
        int q = (r + N - k) % N;
        dpar_status rel = in[q] != scr + (size_t)q * slot ? dpar__release(x, q) : DPAR_OK;
        if (st == DPAR_OK) st = rel;
    }
    for (k = 1; k < N && st == DPAR_OK; k++) st = dpar__drain(x, (r + k) % N, 0);
    if (in != small) dpar__free(&c->allocator, (void *)in);
    return st;
}

/* streaming stores for this call? When the destinations of all ranks together (N x bytes) are at least
   the streaming size: they cannot stay in the cache anyway. The host loops only: a transport with
   arithmetic of its own keeps its own stores. */
static int dpar__sm_streams(dpar_comm *c, size_t bytes)
{
    return DPAR__STREAM && c->sm && bytes >= c->sm->stream_min / (size_t)c->size && !c->tp->reduce && !c->tp->copy;
}
static int dpar__sm_stream(dpar__ctx *x, size_t bytes) { return dpar__sm_streams(x->c, bytes); }

/* "reading now", then one more look at the poison (a Dekker pair with dpar__sm_quiesce): either this
   rank sees that a peer left on an error, or that peer sees this reader and waits before it returns */
static dpar_status dpar__sm_read_begin(dpar_comm *c)
{
    dpar__sm_rank *me = dpar__sm_at(c->sm, c->rank);
    dpar_status st;
    DPAR__STORE(&me->reading, 1u, DPAR__SEQ_CST);
    if ((st = dpar__tp_poisoned(c)) != DPAR_OK) DPAR__STORE(&me->reading, 0u, DPAR__SEQ_CST);
    return st;
}
static void dpar__sm_read_end(dpar_comm *c) { DPAR__STORE(&dpar__sm_at(c->sm, c->rank)->reading, 0u, DPAR__SEQ_CST); }

/* leaving reduce-by-slice on an error: the comm is poisoned (nobody starts reading my buffers); wait
   until nobody still reads them, so the caller may free them */
static dpar_status dpar__sm_quiesce(dpar_comm *c, dpar_status st)
{
    uint64_t give_up = dpar_time_ns() + 5000000000u;
    int q;
    dpar__sm_read_end(c);
    if (!dpar__tp_is_poisoned(c)) dpar__tp_poison_quietly(c, st, dpar_last_error());
    for (q = 0; q < c->size; q++)
        while (q != c->rank && DPAR__LOAD(&dpar__sm_at(c->sm, q)->reading, DPAR__SEQ_CST) && dpar_time_ns() < give_up)
            sched_yield();
    return st;
}

/* my block, reduced in the ring's order from every rank's send (blocks of DPAR__SM_BLOCK through L1) */
static void dpar__sm_reduce_block(dpar__ctx *x, char *out, const char *const *send, size_t off, size_t len,
                                  dpar_dtype t, dpar_op op, int stream, char *tmp)
{
    int N = x->c->size, r = x->c->rank, j;
    size_t es = dpar__dtype_sizes[t], per = DPAR__SM_BLOCK / es, b;
    for (b = 0; b < len; b += per) {
        size_t n = len - b < per ? len - b : per, o = (off + b) * es;
        char *dst = stream ? tmp : out + o;
        const char *acc = send[(r + 1) % N] + o;
        for (j = 2; j < N; j++) { /* the partial in tmp: out may be my own send (in place) */
            (void)dpar__tp_reduce(x, tmp, send[(r + j) % N] + o, acc, n, t, op, 0); /* shared memory: host loops */
            acc = tmp;
        }
        if (stream && dpar__stream_reduce(out + o, send[r] + o, acc, n, t, op, op == DPAR_AVG ? N : 0)) continue;
        (void)dpar__tp_reduce(x, dst, send[r] + o, acc, n, t, op, op == DPAR_AVG ? N : 0);
        if (stream) dpar__stream_copy(out + o, tmp, n * es);
    }
}

static dpar_status dpar__allreduce_slice(dpar__ctx *x, const char *send, char *recv, size_t count, dpar_dtype t,
                                         dpar_op op)
{
    dpar_comm *c = x->c;
    dpar__sm *sh = c->sm;
    dpar__sm_rank *me = dpar__sm_at(sh, c->rank);
    int N = c->size, r = c->rank, q, k;
    size_t es = dpar__dtype_sizes[t], off, len;
    int stream = dpar__sm_stream(x, count * es);
    uint32_t phase = c->sm_phase;
    const char **sends;
    char *scr = NULL, *tmp;
    dpar_status st;
    c->sm_phase += 3;
    if ((st = dpar__scratch(c, (size_t)N * sizeof(char *) + DPAR__SM_BLOCK + DPAR__CACHE_LINE, &scr)) != DPAR_OK)
        return dpar__tp_fail(c, st, dpar_last_error()); /* the others must not wait for me */
    sends = (const char **)(void *)scr;
    tmp = scr + ((size_t)N * sizeof(char *) + DPAR__CACHE_LINE - 1) / DPAR__CACHE_LINE * DPAR__CACHE_LINE;
    DPAR__STORE(&me->send, (const void *)send, DPAR__RELAXED);
    DPAR__STORE(&me->recv, (void *)recv, DPAR__RELAXED);
    /* A: everyone's buffers are published */
    if ((st = dpar__sm_meet(x, phase + 1, 1, "arrive")) != DPAR_OK) return dpar__sm_quiesce(c, st);
    for (q = 0; q < N; q++) sends[q] = (const char *)DPAR__LOAD(&dpar__sm_at(sh, q)->send, DPAR__RELAXED);
    if ((st = dpar__sm_read_begin(c)) != DPAR_OK) return dpar__sm_quiesce(c, st);
    dpar_block_range(count, N, r, &off, &len);
    dpar__sm_reduce_block(x, recv, sends, off, len, t, op, stream, tmp);
    x->received += (size_t)(N - 1) * len * es;
    /* B: my block is final in my recv; copy each other block once its owner has passed B */
    dpar__sm_arrive(c, phase + 2);
    for (k = 1; k < N; k++) {
        size_t qo, ql;
        const char *from;
        q = (r + k) % N;
        if ((st = dpar__sm_wait(x, q, phase + 2, "reduce its block")) != DPAR_OK) return dpar__sm_quiesce(c, st);
        from = (const char *)DPAR__LOAD(&dpar__sm_at(sh, q)->recv, DPAR__RELAXED);
        dpar_block_range(count, N, q, &qo, &ql);
        if (from == recv) { /* ranks that share one recv: the block is already in place */
        } else if (stream) {
            dpar__stream_copy(recv + qo * es, from + qo * es, ql * es);
        } else {
            (void)dpar__tp_copy(x, recv + qo * es, from + qo * es, ql * es); /* shared memory: host loops */
        }
        x->received += ql * es;
    }
    dpar__sm_read_end(c);
    x->sent += ((count - len) + (size_t)(N - 1) * len) * es; /* what the others read of mine */
    /* C: nobody reads my buffers any more */
    if ((st = dpar__sm_meet(x, phase + 3, 0, "copy the blocks")) != DPAR_OK) return dpar__sm_quiesce(c, st);
    return DPAR_OK;
}

/* The algorithm for this allreduce: the comm's choice, else by size and rank count; the ring where
   memory is not shared (or could not be set up). */
static dpar_algo dpar__algo_choose(dpar_comm *c, size_t bytes)
{
    int a = c->algo;
    if (!dpar__tp_shares_memory(c)) /* one-shot (through a block processes share, else messages) for small ones */
        return a == DPAR_ALGO_ONESHOT || (a == DPAR_ALGO_AUTO &&
                                          bytes <= (!(c->sm && c->sm->processes) ? (size_t)DPAR_MSG_ONESHOT_MAX_BYTES
                                                    : c->size == 2               ? (size_t)DPAR_SHM_TWO_MAX_BYTES
                                                                                 : (size_t)DPAR_SHM_ONESHOT_MAX_BYTES))
                   ? DPAR_ALGO_ONESHOT
                   : DPAR_ALGO_RING;
    if (c->sm_state < 0) return DPAR_ALGO_RING;
    if (a == DPAR_ALGO_RING || a == DPAR_ALGO_ONESHOT || a == DPAR_ALGO_SLICE) return (dpar_algo)a;
    /* one meeting against three: more ranks, more meetings worth saving (measured: 4 KiB on 4 ranks) */
    if (bytes <= (size_t)DPAR_ONESHOT_MAX_BYTES * (c->size > 2 ? 2u : 1u)) return DPAR_ALGO_ONESHOT;
    /* 2 ranks move the same bytes either way; in the caches the ring's pipelined segments measured
       faster, beyond them reduce-by-slice's streaming stores (not known before the setup: slice) */
    if (c->size == 2 && bytes >= (size_t)DPAR_RING_MIN_BYTES && c->sm && !dpar__sm_streams(c, bytes))
        return DPAR_ALGO_RING;
    if (bytes >= (size_t)DPAR_SLICE_MIN_BYTES) return DPAR_ALGO_SLICE;
    return DPAR_ALGO_RING;
}

/* allreduce on N > 1 ranks, count > 0, not deterministic; *used: the algorithm that ran */
static dpar_status dpar__allreduce_auto(dpar__ctx *x, const char *send, char *recv, size_t count, dpar_dtype t,
                                        dpar_op op, dpar_algo *used)
{
    dpar_comm *c = x->c;
    dpar_algo a = dpar__algo_choose(c, count * dpar__dtype_sizes[t]);
    if (a == DPAR_ALGO_ONESHOT && !dpar__tp_shares_memory(c)) {
        *used = a;
        if (c->sm && c->sm->processes) return dpar__allreduce_oneshot(x, send, recv, count, t, op);
        return dpar__allreduce_oneshot_msg(x, send, recv, count, t, op);
    }
    if (a != DPAR_ALGO_RING && c->sm_state == 0) {
        DPAR__TRY(dpar__sm_setup(x));
        a = dpar__algo_choose(c, count * dpar__dtype_sizes[t]);
    }
    *used = a;
    if (a == DPAR_ALGO_ONESHOT) return dpar__allreduce_oneshot(x, send, recv, count, t, op);
    if (a == DPAR_ALGO_SLICE) return dpar__allreduce_slice(x, send, recv, count, t, op);
    return dpar__allreduce_ring(x, send, recv, count, t, op);
}

/* DPAR_ALGO=ring|oneshot|slice|auto, for a desc that says 0 */
static int dpar__algo_from_env(void)
{
    const char *e = getenv("DPAR_ALGO");
    int a;
    if (!e || !*e) return DPAR_ALGO_AUTO;
    for (a = DPAR_ALGO_AUTO; a <= DPAR_ALGO_SLICE; a++)
        if (!strcmp(e, dpar__algo_names[a])) return a;
    DPAR__LOG(DPAR_LOG_WARN, "DPAR_ALGO=%s is not one of ring, oneshot, slice, auto; choosing by size", e);
    return DPAR_ALGO_AUTO;
}

/* >>comm: the front end: validation, running a call, collectives, point-to-point, comm life ----- */
/* ---- running a call: validation, fingerprint, timeout, counters, trace ---- */
typedef struct dpar__call { /* one collective call, as made */
    dpar_coll coll;
    const void *send;
    void *recv;
    size_t count;
    dpar_dtype dtype;
    dpar_op op;
    int root;
    uint64_t seq;
    const char *file;
    int line;
    const size_t *offs, *lens; /* allgather: rank r's block, when not dpar_block_range's */
    const size_t *v;           /* alltoallv: sendcounts, sdispls, recvcounts, rdispls (N each, resolved); count is
                                  the elements this rank sends, vrecv those it receives */
    size_t vrecv;
    int host; /* 1: the buffers are host memory whatever the comm's dpar_comm_memory (dpar_alltoallv_counts) */
} dpar__call;

/* >>fault's hook, where a comm operation starts (only when c->fault is set): the fault due here, if any */
static dpar_status dpar__comm_fault(dpar_comm *c, int op)
{
    const dpar__fault *f = NULL;
    uint64_t nth = 0;
    char msg[DPAR__ERROR_TEXT];
    int kind = dpar__fault_due(c->fault, c->rank, op, c->name, &f, &nth);
    if (kind == 0) return DPAR_OK;
    if (kind < 0) return dpar__err(DPAR_EINVAL, "%s rank %d: %s", c->name, c->rank, c->fault->bad);
    if (kind == DPAR__FAULT_VANISH) /* nothing reaches the others: they time out, naming this rank */
        return dpar__err(DPAR_ECANCELED,
                         "%s rank %d has vanished (injected fault, DPAR_FAULT \"%s\", at its %s #%llu): it takes no "
                         "part in its %s",
                         c->name, c->rank, f->text, f->op == DPAR__FOP_ANY ? "operation" : dpar__fop_names[f->op],
                         (unsigned long long)nth, dpar__fop_names[op]);
    snprintf(msg, sizeof msg, "%s rank %d: injected fault (DPAR_FAULT \"%s\"): its %s%s #%llu failed", c->name, c->rank,
             f->text, dpar__fop_names[op], f->op == DPAR__FOP_ANY ? ", operation" : "", (unsigned long long)nth);
    return dpar__tp_fail(c, op == DPAR__FOP_BUCKET || op == DPAR__FOP_STAGE ? DPAR_EUSER : DPAR_EIO, msg);
}
/* DPAR__FAULT(c, op): DPAR_OK, or the status of the fault injected here; one branch when none is scheduled */
#define DPAR__FAULT(c, op) ((c)->fault ? dpar__comm_fault((c), (op)) : DPAR_OK)

static dpar_status dpar__execute(dpar_comm *c, const dpar__call *call)
{
    dpar__ctx x;
    dpar_status st = DPAR_OK;
    size_t es = dpar__dtype_sizes[call->dtype];
    const char *send = (const char *)call->send;
    char *recv = (char *)call->recv;
    uint64_t t0 = dpar__now_ns(), dt, bytes;
    double factor = 1.0, busbw;
    int N = c->size, native = 0;
    dpar_algo algo = DPAR_ALGO_RING;
    memset(&x, 0, sizeof x);
    x.c = c;
    x.lane = DPAR__LANE_COLL;
    x.fp.seq = call->seq;
    x.fp.coll = (int)call->coll;
    x.fp.count = call->count;
    x.fp.dtype = (int)call->dtype;
    x.fp.op = (int)call->op;
    x.fp.root = call->root;
    x.fp.rank = c->rank;
    x.fp.file = call->file;
    x.fp.line = call->line;
    x.deadline = c->timeout_ns ? t0 + c->timeout_ns : 0;
    x.host = call->host;
    if (call->coll == DPAR_COLL_ALLTOALLV) x.fp.count = 0; /* the pairs' counts travel with their messages */
    if ((st = DPAR__FAULT(c, call->coll)) != DPAR_OK) return st;
    if ((st = dpar__tp_poisoned(c)) != DPAR_OK) return st;
    dpar__tp_enter(&x);
    dpar__sm_enter(&x);
    if (c->tp->native_first) {
        st = dpar__tp_native(&x, call, &native); /* the library runs every call */
    } else if (N == 1) {                         /* nothing to meet: copies only */
        size_t bytes1 = call->count * es;
        switch (call->coll) {
        case DPAR_COLL_BROADCAST:
        case DPAR_COLL_ALLGATHER:
        case DPAR_COLL_ALLTOALL:
            if (send != recv) st = dpar__tp_copy(&x, recv, send, bytes1);
            break;
        case DPAR_COLL_REDUCE:
        case DPAR_COLL_REDUCE_SCATTER:
        case DPAR_COLL_ALLREDUCE:
            if (bytes1) st = dpar__tp_divide(&x, recv, send, call->count, call->dtype, 1);
            break;
        case DPAR_COLL_ALLTOALLV: st = dpar__alltoallv_pairwise(&x, send, recv, call->v, es, 0); break;
        default: break;
        }
    } else if ((st = dpar__tp_native(&x, call, &native)) != DPAR_OK) {
        /* the transport's own collective failed */
    } else if (native) {
        algo = DPAR_ALGO_NATIVE; /* done by the transport's own collective */
    } else if (call->count == 0 && call->coll != DPAR_COLL_BARRIER && call->coll != DPAR_COLL_ALLTOALLV) {
        st = x.c->check ? dpar__barrier(&x) : DPAR_OK; /* nothing to move; the fingerprints still meet */
    } else {
        switch (call->coll) {
        case DPAR_COLL_BARRIER: st = dpar__barrier(&x); break;
        case DPAR_COLL_BROADCAST:
            st = dpar__broadcast_chain(&x, send, recv, call->count, es, call->root);
            if (st == DPAR_OK) st = dpar__agree(&x);
            break;
        case DPAR_COLL_REDUCE:
            st = dpar__reduce_chain(&x, send, recv, call->count, call->dtype, call->op, call->root);
            if (st == DPAR_OK) st = dpar__agree(&x);
            break;
        case DPAR_COLL_REDUCE_SCATTER:
            if (c->det) { /* the allreduce's tree, then my block: the bits of dpar_allreduce, N-independent */
                char *all = NULL;
                size_t off, len;
                dpar_block_range(call->count, N, c->rank, &off, &len);
                if ((st = dpar__x_scratch(&x, call->count * es, &all)) != DPAR_OK)
                    st = dpar__tp_fail(c, st, dpar_last_error()); /* the others must not wait for me */
                if (st == DPAR_OK) st = dpar__allreduce_tree(&x, send, all, call->count, call->dtype, call->op);
                if (st == DPAR_OK && len) st = dpar__tp_copy(&x, recv, all + off * es, len * es);
                break;
            }
            st = dpar__ring_reduce_scatter(&x, send, recv, call->count, call->dtype, call->op, 0);
            break;
        case DPAR_COLL_ALLGATHER: {
            size_t off, len;
            if (call->offs) {
                off = call->offs[c->rank];
                len = call->lens[c->rank];
            } else {
                dpar_block_range(call->count, N, c->rank, &off, &len);
            }
            if (send != recv + off * es) st = dpar__tp_copy(&x, recv + off * es, send, len * es);
            if (st == DPAR_OK) st = dpar__ring_allgather(&x, send, recv, call->count, es, call->offs, call->lens);
            break;
        }
        case DPAR_COLL_ALLREDUCE:
            if (c->det) algo = DPAR_ALGO_TREE;
            st = c->det ? dpar__allreduce_tree(&x, send, recv, call->count, call->dtype, call->op)
                        : dpar__allreduce_auto(&x, send, recv, call->count, call->dtype, call->op, &algo);
            break;
        case DPAR_COLL_ALLTOALL: st = dpar__alltoall_pairwise(&x, send, recv, call->count, es); break;
        case DPAR_COLL_ALLTOALLV: { /* processes of one node: through their shared block (small parts) */
            int done = 0, sm = c->sm && c->sm->processes && c->sm->n == N && c->sm_state == 1 &&
                               (2 * (size_t)N + 1) * sizeof(uint64_t) <= c->sm->stage;
            if (sm) st = dpar__sm_alltoallv(&x, send, recv, call->v, es, &done);
            if (st == DPAR_OK && !done && sm && c->tp->alltoallv_parts) /* the counts met in the block */
                st = c->tp->alltoallv_parts(&x, send, recv, call->v, es, &done);
            if (st == DPAR_OK && !done) st = dpar__alltoallv_pairwise(&x, send, recv, call->v, es, sm ? 2 : 0);
            break;
        }
        default: st = dpar__err(DPAR_EINVAL, "internal: collective %d", (int)call->coll); break;
        }
    }
    if (st != DPAR_OK) dpar__tp_quiesce(c); /* no peer still reads our buffers */
    dt = dpar__since(t0);
    bytes = (uint64_t)call->count * es * (call->coll == DPAR_COLL_ALLTOALL ? (uint64_t)N : 1u);
    if (call->coll == DPAR_COLL_ALLREDUCE) factor = 2.0 * (N - 1) / N;
    else if (call->coll == DPAR_COLL_REDUCE_SCATTER || call->coll == DPAR_COLL_ALLGATHER ||
             call->coll == DPAR_COLL_ALLTOALL || call->coll == DPAR_COLL_ALLTOALLV)
        factor = (double)(N - 1) / N;
    busbw = dt ? (double)bytes / (double)dt * factor : 0.0;
    {
        dpar_comm_counters *s = &c->stats.by_coll[call->coll];
        uint64_t bits;
        DPAR__ADD(&s->calls, 1, DPAR__RELAXED);
        DPAR__ADD(&s->bytes_sent, x.sent, DPAR__RELAXED);
        DPAR__ADD(&s->bytes_received, x.received, DPAR__RELAXED);
        DPAR__ADD(&s->time_ns, dt, DPAR__RELAXED);
        DPAR__STORE(&c->stats.last.calls, 1, DPAR__RELAXED);
        DPAR__STORE(&c->stats.last.bytes_sent, x.sent, DPAR__RELAXED);
        DPAR__STORE(&c->stats.last.bytes_received, x.received, DPAR__RELAXED);
        DPAR__STORE(&c->stats.last.time_ns, dt, DPAR__RELAXED);
        memcpy(&bits, &busbw, sizeof bits);
        DPAR__STORE(&c->last_coll, (int)call->coll, DPAR__RELAXED);
        DPAR__STORE(&c->last_busbw_bits, bits, DPAR__RELAXED);
        if (call->coll == DPAR_COLL_ALLREDUCE) {
            DPAR__ADD(&c->stats.algo_calls[algo], 1, DPAR__RELAXED);
            DPAR__STORE(&c->stats.last_algo, algo, DPAR__RELAXED);
        }
    }
    if (dpar_trace_enabled())
        dpar__trace_span(dpar_coll_name(call->coll), "comm", t0,
                         "\"seq\":%llu,\"count\":%llu,\"dtype\":\"%s\",\"bytes\":%llu,\"sent\":%llu,\"received\":%llu,"
                         "\"busbw_GBps\":%.3f,\"status\":%d,\"algo\":\"%s\"",
                         (unsigned long long)call->seq, (unsigned long long)call->count, dpar_dtype_name(call->dtype),
                         (unsigned long long)bytes, (unsigned long long)x.sent, (unsigned long long)x.received, busbw,
                         (int)st, call->coll == DPAR_COLL_ALLREDUCE ? dpar_algo_name(algo) : "-");
    return st;
}

/* Argument errors of a collective also poison the group: the other ranks would wait forever. */
static dpar_status dpar__bad_call(dpar_comm *c, dpar_status st)
{
    char msg[DPAR__ERROR_TEXT];
    snprintf(msg, sizeof msg, "%s", dpar__tls_error);
    dpar__tp_poison(c, st, msg);
    return dpar__err(st, "%s", msg);
}

static int dpar__overlap(const void *a, size_t na, const void *b, size_t nb)
{
    const char *x = (const char *)a, *y = (const char *)b;
    return na && nb && x < y + nb && y < x + na;
}

static dpar_status dpar__comm_wait_async(dpar_comm *c);

static dpar_status dpar__validate(dpar_comm *c, const dpar__call *call, const char *api)
{
    size_t es, n = call->count, mine = 0, off = 0, total;
    int N;
    if (!c) return dpar__err(DPAR_EINVAL, "%s: comm is NULL", api);
    N = c->size;
    es = dpar_dtype_size(call->dtype);
    if (!es)
        return dpar__err(DPAR_EINVAL, "%s at %s:%d: dtype %d is not a dpar_dtype", api, call->file, call->line,
                         (int)call->dtype);
    if ((unsigned)call->op >= DPAR_OP_COUNT)
        return dpar__err(DPAR_EINVAL, "%s at %s:%d: op %d is not a dpar_op", api, call->file, call->line,
                         (int)call->op);
    if (call->coll == DPAR_COLL_ALLTOALLV) return DPAR_OK; /* dpar__v_prepare has checked the rest */
    if (n > SIZE_MAX / es / (call->coll == DPAR_COLL_ALLTOALL ? (size_t)N : 1u))
        return dpar__err(DPAR_EINVAL, "%s at %s:%d: count %zu is too large", api, call->file, call->line, n);
    if (call->coll == DPAR_COLL_ALLREDUCE && c->det && (N & (N - 1)))
        return dpar__err(DPAR_EUNSUPPORTED,
                         "%s at %s:%d: the deterministic mode needs a power-of-two number of ranks, "
                         "not %d",
                         api, call->file, call->line, N);
    if ((call->coll == DPAR_COLL_BROADCAST || call->coll == DPAR_COLL_REDUCE) && (call->root < 0 || call->root >= N))
        return dpar__err(DPAR_EINVAL, "%s at %s:%d: root %d is not a rank of 0..%d", api, call->file, call->line,
                         call->root, N - 1);
    total = n * es;
    if (call->coll == DPAR_COLL_REDUCE_SCATTER || call->coll == DPAR_COLL_ALLGATHER) {
        if (call->offs) {
            off = call->offs[c->rank];
            mine = call->lens[c->rank];
        } else {
            dpar_block_range(n, N, c->rank, &off, &mine);
        }
        mine *= es;
        off *= es;
    }
    if (call->coll == DPAR_COLL_ALLTOALL) total *= (size_t)N;
    if (total == 0) return DPAR_OK;
    switch (call->coll) {
    case DPAR_COLL_BROADCAST:
        if (!call->recv || (c->rank == call->root && !call->send))
            return dpar__err(DPAR_EINVAL, "%s at %s:%d: a buffer is NULL", api, call->file, call->line);
        if (c->rank == call->root && call->send != call->recv && dpar__overlap(call->send, total, call->recv, total))
            return dpar__err(DPAR_EINVAL, "%s at %s:%d: send and recv overlap without being equal", api, call->file,
                             call->line);
        break;
    case DPAR_COLL_REDUCE:
        if (!call->send || (c->rank == call->root && !call->recv))
            return dpar__err(DPAR_EINVAL, "%s at %s:%d: a buffer is NULL", api, call->file, call->line);
        if (c->rank == call->root && call->send != call->recv && dpar__overlap(call->send, total, call->recv, total))
            return dpar__err(DPAR_EINVAL, "%s at %s:%d: send and recv overlap without being equal", api, call->file,
                             call->line);
        break;
    case DPAR_COLL_REDUCE_SCATTER: /* in place: recv is my block of send */
        if (!call->send || (mine && !call->recv))
            return dpar__err(DPAR_EINVAL, "%s at %s:%d: a buffer is NULL", api, call->file, call->line);
        if ((const char *)call->recv != (const char *)call->send + off &&
            dpar__overlap(call->send, total, call->recv, mine))
            return dpar__err(DPAR_EINVAL,
                             "%s at %s:%d: recv overlaps send without being this rank's block of it (offset "
                             "%zu)",
                             api, call->file, call->line, off / es);
        break;
    case DPAR_COLL_ALLGATHER: /* in place: send is my block of recv */
        if (!call->recv || (mine && !call->send))
            return dpar__err(DPAR_EINVAL, "%s at %s:%d: a buffer is NULL", api, call->file, call->line);
        if ((const char *)call->send != (const char *)call->recv + off &&
            dpar__overlap(call->send, mine, call->recv, total))
            return dpar__err(DPAR_EINVAL,
                             "%s at %s:%d: send overlaps recv without being this rank's block of it (offset "
                             "%zu)",
                             api, call->file, call->line, off / es);
        break;
    default:
        if (!call->send || !call->recv)
            return dpar__err(DPAR_EINVAL, "%s at %s:%d: a buffer is NULL", api, call->file, call->line);
        if (call->send != call->recv && dpar__overlap(call->send, total, call->recv, total))
            return dpar__err(DPAR_EINVAL, "%s at %s:%d: send and recv overlap without being equal", api, call->file,
                             call->line);
        break;
    }
    return DPAR_OK;
}

static dpar_status dpar__collective(dpar_comm *comm, dpar__call *call, const char *api)
{
    dpar_status st = dpar__validate(comm, call, api);
    if (st != DPAR_OK) return comm ? dpar__bad_call(comm, st) : st;
    DPAR__TRY(dpar__comm_wait_async(comm)); /* calls keep their order */
    call->seq = ++comm->seq;
    return dpar__execute(comm, call);
}

static dpar__call dpar__call_make(dpar_coll coll, const void *send, void *recv, size_t count, dpar_dtype t, dpar_op op,
                                  int root, const char *file, int line)
{
    dpar__call call;
    memset(&call, 0, sizeof call);
    call.coll = coll;
    call.send = send;
    call.recv = recv;
    call.count = count;
    call.dtype = t;
    call.op = op;
    call.root = root;
    call.file = file;
    call.line = line;
    return call;
}

/* a collective on host memory whatever the comm's dpar_comm_memory: a layer's own words on a comm whose buffers are
   device memory (checkpoints' agreements, sizes and manifests) */
static dpar_status dpar__host_coll(dpar_comm *comm, dpar_coll coll, const void *send, void *recv, size_t count,
                                   dpar_dtype t, dpar_op op, int root, const char *api, const char *file, int line)
{
    dpar__call call = dpar__call_make(coll, send, recv, count, t, op, root, file, line);
    call.host = 1;
    return dpar__collective(comm, &call, api);
}

DPAR_API dpar_status dpar_barrier_at(dpar_comm *comm, const char *file, int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_BARRIER, NULL, NULL, 0, DPAR_U8, DPAR_SUM, 0, file, line);
    return dpar__collective(comm, &call, "dpar_barrier");
}
DPAR_API dpar_status dpar_broadcast_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                       int root, const char *file, int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_BROADCAST, send, recv, count, dtype, DPAR_SUM, root, file, line);
    return dpar__collective(comm, &call, "dpar_broadcast");
}
DPAR_API dpar_status dpar_reduce_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                    dpar_op op, int root, const char *file, int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_REDUCE, send, recv, count, dtype, op, root, file, line);
    return dpar__collective(comm, &call, "dpar_reduce");
}
DPAR_API dpar_status dpar_reduce_scatter_at(dpar_comm *comm, const void *send, void *recv, size_t count,
                                            dpar_dtype dtype, dpar_op op, const char *file, int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_REDUCE_SCATTER, send, recv, count, dtype, op, 0, file, line);
    return dpar__collective(comm, &call, "dpar_reduce_scatter");
}
DPAR_API dpar_status dpar_allgather_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                       const char *file, int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_ALLGATHER, send, recv, count, dtype, DPAR_SUM, 0, file, line);
    return dpar__collective(comm, &call, "dpar_allgather");
}
DPAR_API dpar_status dpar_allreduce_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                       dpar_op op, const char *file, int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_ALLREDUCE, send, recv, count, dtype, op, 0, file, line);
    return dpar__collective(comm, &call, "dpar_allreduce");
}
DPAR_API dpar_status dpar_alltoall_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                      const char *file, int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_ALLTOALL, send, recv, count, dtype, DPAR_SUM, 0, file, line);
    return dpar__collective(comm, &call, "dpar_alltoall");
}

/* alltoallv's arguments: checked, and resolved into the comm's kept array (4 N: sendcounts, sdispls, recvcounts,
   rdispls; NULL displacements become the packed ones); call->v, count (elements sent) and vrecv set */
static dpar_status dpar__v_prepare(dpar_comm *c, dpar__call *call, const size_t *sc, const size_t *sd, const size_t *rc,
                                   const size_t *rd, const char *api)
{
    size_t es, N, q, *v, send_end = 0, recv_end = 0, sent = 0, got = 0, lim;
    int sorted = 1;
    if (!c) return dpar__err(DPAR_EINVAL, "%s: comm is NULL", api);
    es = dpar_dtype_size(call->dtype);
    if (!es)
        return dpar__err(DPAR_EINVAL, "%s at %s:%d: dtype %d is not a dpar_dtype", api, call->file, call->line,
                         (int)call->dtype);
    if (!sc || !rc)
        return dpar__err(DPAR_EINVAL, "%s at %s:%d: %s is NULL", api, call->file, call->line,
                         !sc ? "sendcounts" : "recvcounts");
    N = (size_t)c->size;
    if (4 * N > c->vbuf_cap) {
        size_t *p = (size_t *)dpar__alloc(&c->allocator, 4 * N * sizeof(size_t));
        if (!p) return dpar__err(DPAR_ENOMEM, "%s: out of memory", api);
        dpar__free(&c->allocator, c->vbuf);
        c->vbuf = p;
        c->vbuf_cap = 4 * N;
    }
    v = c->vbuf;
    lim = SIZE_MAX / es; /* every element offset below must stay under it: its bytes fit a size_t */
    for (q = 0; q < N; q++) {
        size_t s_off = sd ? sd[q] : sent, r_off = rd ? rd[q] : got;
        if (sc[q] > lim || s_off > lim - sc[q] || rc[q] > lim || r_off > lim - rc[q] || sent > lim - sc[q] ||
            got > lim - rc[q])
            return dpar__err(DPAR_EINVAL,
                             "%s at %s:%d: the block of rank %zu overflows (send %zu elements at %zu, recv %zu at "
                             "%zu, %s)",
                             api, call->file, call->line, q, sc[q], s_off, rc[q], r_off, dpar_dtype_name(call->dtype));
        v[q] = sc[q], v[N + q] = s_off, v[2 * N + q] = rc[q], v[3 * N + q] = r_off;
        sent += sc[q];
        got += rc[q];
        if (sc[q] && s_off + sc[q] > send_end) send_end = s_off + sc[q];
        if (rc[q]) {
            if (r_off < recv_end) sorted = 0; /* behind an earlier block: the pairwise check below */
            if (r_off + rc[q] > recv_end) recv_end = r_off + rc[q];
        }
    }
    if ((send_end && !call->send) || (recv_end && !call->recv))
        return dpar__err(DPAR_EINVAL, "%s at %s:%d: %s is NULL with %zu elements to %s", api, call->file, call->line,
                         send_end && !call->send ? "send" : "recv", send_end && !call->send ? send_end : recv_end,
                         send_end && !call->send ? "send" : "receive");
    if (dpar__overlap(call->send, send_end * es, call->recv, recv_end * es) || (call->send == call->recv && got))
        return dpar__err(DPAR_EINVAL,
                         "%s at %s:%d: send and recv overlap (alltoallv is not in place: a rank's blocks "
                         "differ in size from its peers')",
                         api, call->file, call->line);
    if (!sorted) { /* recv blocks out of rank order: each pair (rare layouts; in rank order the loop above did it) */
        size_t a, b;
        for (a = 0; a < N; a++)
            for (b = a + 1; b < N; b++)
                if (rc[a] && rc[b] && v[3 * N + a] < v[3 * N + b] + rc[b] && v[3 * N + b] < v[3 * N + a] + rc[a])
                    return dpar__err(DPAR_EINVAL, "%s at %s:%d: the recv blocks of ranks %zu and %zu overlap", api,
                                     call->file, call->line, a, b);
    }
    call->v = v;
    call->count = sent;
    call->vrecv = got;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_alltoallv_at(dpar_comm *comm, const void *send, const size_t *sendcounts,
                                       const size_t *sdispls, void *recv, const size_t *recvcounts,
                                       const size_t *rdispls, dpar_dtype dtype, const char *file, int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_ALLTOALLV, send, recv, 0, dtype, DPAR_SUM, 0, file, line);
    dpar_status st = dpar__v_prepare(comm, &call, sendcounts, sdispls, recvcounts, rdispls, "dpar_alltoallv");
    if (st != DPAR_OK) return comm ? dpar__bad_call(comm, st) : st;
    return dpar__collective(comm, &call, "dpar_alltoallv");
}

/* an alltoall of one size_t per peer, on host memory whatever the comm's dpar_comm_memory */
DPAR_API dpar_status dpar_alltoallv_counts_at(dpar_comm *comm, const size_t *sendcounts, size_t *recvcounts,
                                              const char *file, int line)
{
    dpar__call call =
        dpar__call_make(DPAR_COLL_ALLTOALL, sendcounts, recvcounts, sizeof(size_t), DPAR_U8, DPAR_SUM, 0, file, line);
    call.host = 1;
    if (comm && (const void *)sendcounts == (const void *)recvcounts && sendcounts)
        return dpar__bad_call(comm, dpar__err(DPAR_EINVAL,
                                              "dpar_alltoallv_counts at %s:%d: sendcounts == recvcounts "
                                              "(not in place)",
                                              file, line));
    return dpar__collective(comm, &call, "dpar_alltoallv_counts");
}

/* ---- point-to-point ---- */
static dpar_status dpar__p2p_check(dpar_comm *c, const void *buf, size_t count, dpar_dtype t, int peer, const char *api,
                                   const char *file, int line)
{
    size_t es;
    if (!c) return dpar__err(DPAR_EINVAL, "%s: comm is NULL", api);
    es = dpar_dtype_size(t);
    if (!es) return dpar__err(DPAR_EINVAL, "%s at %s:%d: dtype %d is not a dpar_dtype", api, file, line, (int)t);
    if (peer < 0 || peer >= c->size)
        return dpar__err(DPAR_EINVAL, "%s at %s:%d: peer %d is not a rank of 0..%d", api, file, line, peer,
                         c->size - 1);
    if (count > SIZE_MAX / es)
        return dpar__err(DPAR_EINVAL, "%s at %s:%d: count %zu is too large", api, file, line, count);
    if (count && !buf) return dpar__err(DPAR_EINVAL, "%s at %s:%d: buf is NULL", api, file, line);
    return DPAR_OK;
}

static void dpar__p2p_ctx(dpar__ctx *x, dpar_comm *c, dpar_coll coll, size_t count, dpar_dtype t, int tag,
                          const char *file, int line)
{
    memset(x, 0, sizeof *x);
    x->c = c;
    x->lane = DPAR__LANE_P2P;
    x->fp.coll = (int)coll;
    x->fp.count = count;
    x->fp.dtype = (int)t;
    x->fp.tag = tag;
    x->fp.rank = c->rank;
    x->fp.file = file;
    x->fp.line = line;
    x->deadline = c->timeout_ns ? dpar__now_ns() + c->timeout_ns : 0;
}

/* one point-to-point call (or pipeline message) into the comm's counters */
static void dpar__p2p_count(dpar_comm *c, dpar_coll coll, uint64_t sent, uint64_t received, uint64_t t0)
{
    dpar_comm_counters *s = &c->stats.by_coll[coll];
    DPAR__ADD(&s->calls, 1, DPAR__RELAXED);
    DPAR__ADD(&s->bytes_sent, sent, DPAR__RELAXED);
    DPAR__ADD(&s->bytes_received, received, DPAR__RELAXED);
    DPAR__ADD(&s->time_ns, dpar__since(t0), DPAR__RELAXED);
}

static void dpar__p2p_done(dpar_comm *c, dpar_coll coll, const dpar__ctx *x, uint64_t t0, dpar_status st)
{
    if (st != DPAR_OK) dpar__tp_quiesce(c);
    dpar__p2p_count(c, coll, x->sent, x->received, t0);
    if (dpar_trace_enabled())
        dpar__trace_span(dpar_coll_name(coll), "comm", t0, "\"bytes\":%llu,\"tag\":%d",
                         (unsigned long long)(x->sent + x->received), x->fp.tag);
}

DPAR_API dpar_status dpar_send_at(dpar_comm *comm, const void *buf, size_t count, dpar_dtype dtype, int peer, int tag,
                                  const char *file, int line)
{
    dpar__ctx x;
    uint64_t t0 = dpar__now_ns();
    dpar_status st = dpar__p2p_check(comm, buf, count, dtype, peer, "dpar_send", file, line);
    if (st != DPAR_OK) return comm ? dpar__bad_call(comm, st) : st;
    if (peer == comm->rank)
        return dpar__err(DPAR_EDEADLK,
                         "dpar_send at %s:%d: rank %d sends to itself; a synchronous send to oneself never "
                         "completes (use dpar_sendrecv)",
                         file, line, peer);
    DPAR__TRY(dpar__tp_poisoned(comm));
    DPAR__TRY(DPAR__FAULT(comm, DPAR_COLL_SEND));
    dpar__p2p_ctx(&x, comm, DPAR_COLL_SEND, count, dtype, tag, file, line);
    dpar__tp_enter(&x);
    st = dpar__post(&x, peer, buf, count * dpar__dtype_sizes[dtype]);
    if (st == DPAR_OK) st = dpar__drain(&x, peer, 0);
    dpar__p2p_done(comm, DPAR_COLL_SEND, &x, t0, st);
    return st;
}

DPAR_API dpar_status dpar_recv_at(dpar_comm *comm, void *buf, size_t count, dpar_dtype dtype, int peer, int tag,
                                  const char *file, int line)
{
    dpar__ctx x;
    uint64_t t0 = dpar__now_ns();
    dpar_status st = dpar__p2p_check(comm, buf, count, dtype, peer, "dpar_recv", file, line);
    if (st != DPAR_OK) return comm ? dpar__bad_call(comm, st) : st;
    DPAR__TRY(dpar__tp_poisoned(comm));
    DPAR__TRY(DPAR__FAULT(comm, DPAR_COLL_RECV));
    dpar__p2p_ctx(&x, comm, DPAR_COLL_RECV, count, dtype, tag, file, line);
    dpar__tp_enter(&x);
    st = dpar__recv_into(&x, peer, buf, count * dpar__dtype_sizes[dtype]);
    dpar__p2p_done(comm, DPAR_COLL_RECV, &x, t0, st);
    return st;
}

DPAR_API dpar_status dpar_sendrecv_at(dpar_comm *comm, const void *sendbuf, size_t sendcount, int dst, void *recvbuf,
                                      size_t recvcount, int src, dpar_dtype dtype, int tag, const char *file, int line)
{
    dpar__ctx x;
    uint64_t t0 = dpar__now_ns();
    size_t es;
    dpar_status st = dpar__p2p_check(comm, sendbuf, sendcount, dtype, dst, "dpar_sendrecv", file, line);
    if (st == DPAR_OK) st = dpar__p2p_check(comm, recvbuf, recvcount, dtype, src, "dpar_sendrecv", file, line);
    if (st != DPAR_OK) return comm ? dpar__bad_call(comm, st) : st;
    if (dst == comm->rank && src == comm->rank && sendcount && recvcount &&
        dpar__overlap(sendbuf, sendcount * dpar__dtype_sizes[dtype], recvbuf, recvcount * dpar__dtype_sizes[dtype]))
        return dpar__bad_call(
            comm, dpar__err(DPAR_EINVAL, "dpar_sendrecv at %s:%d: send and recv buffers overlap", file, line));
    DPAR__TRY(dpar__tp_poisoned(comm));
    DPAR__TRY(DPAR__FAULT(comm, DPAR_COLL_SEND));
    es = dpar__dtype_sizes[dtype];
    dpar__p2p_ctx(&x, comm, DPAR_COLL_SEND, sendcount, dtype, tag, file, line);
    dpar__tp_enter(&x);
    st = dpar__post(&x, dst, sendbuf, sendcount * es);
    if (st == DPAR_OK) {
        x.fp.coll = DPAR_COLL_RECV; /* what the message from src must match */
        x.fp.count = recvcount;
        st = dpar__recv_into(&x, src, recvbuf, recvcount * es);
    }
    if (st == DPAR_OK) st = dpar__drain(&x, dst, 0);
    dpar__p2p_done(comm, DPAR_COLL_SEND, &x, t0, st);
    return st;
}

/* Point-to-point for the modules above the comm (the pipeline runner): messages of `bytes` bytes
   named by `tag`, counted in the comm's stats as sends and receives (not traced: the caller traces
   what they mean). dpar__send_posted returns once the message is offered: buf stays untouched until
   the receiver has taken it, and a send waits while DPAR__QDEPTH of this rank's messages to peer are
   not taken yet; dpar__send_flush waits until at most `keep` (of `bytes` each) are left. `who` names the caller in the
   contract checker's and the timeout's messages. */
static void dpar__p2p_begin(dpar__ctx *x, dpar_comm *c, dpar_coll coll, size_t bytes, int tag, const char *who)
{
    dpar__p2p_ctx(x, c, coll, bytes, DPAR_U8, tag, who, 0);
    dpar__tp_enter(x);
}
static dpar_status dpar__send_posted(dpar_comm *c, int peer, const void *buf, size_t bytes, int tag, const char *who)
{
    dpar__ctx x;
    uint64_t t0 = dpar__now_ns();
    dpar_status st;
    DPAR__TRY(DPAR__FAULT(c, DPAR_COLL_SEND));
    dpar__p2p_begin(&x, c, DPAR_COLL_SEND, bytes, tag, who);
    st = dpar__post(&x, peer, buf, bytes);
    if (st == DPAR_OK) dpar__p2p_count(c, DPAR_COLL_SEND, bytes, 0, t0);
    return st;
}
static dpar_status dpar__recv_tagged(dpar_comm *c, int peer, void *buf, size_t bytes, int tag, const char *who)
{
    dpar__ctx x;
    uint64_t t0 = dpar__now_ns();
    dpar_status st;
    DPAR__TRY(DPAR__FAULT(c, DPAR_COLL_RECV));
    dpar__p2p_begin(&x, c, DPAR_COLL_RECV, bytes, tag, who);
    st = dpar__recv_into(&x, peer, buf, bytes);
    if (st == DPAR_OK) dpar__p2p_count(c, DPAR_COLL_RECV, 0, bytes, t0);
    return st;
}
static dpar_status dpar__send_flush(dpar_comm *c, int peer, int keep, size_t bytes, const char *who)
{
    dpar__ctx x; /* a timeout names the messages it waits for: sends of `bytes` */
    dpar__p2p_begin(&x, c, DPAR_COLL_SEND, bytes, 0, who);
    return dpar__drain(&x, peer, keep);
}

/* ---- comm life, queries, stats ---- */
static dpar_status dpar__comm_init(dpar_comm *c, const dpar_comm_desc *d, int rank, int size)
{
    uint64_t to = 0;
    c->rank = rank;
    c->worker = rank;
    c->size = size;
    c->allocator = d->allocator;
    if (d->timeout_ms > 0) {
        to = (uint64_t)d->timeout_ms * 1000000u;
    } else if (d->timeout_ms == 0) {
        const char *env = getenv("DPAR_TIMEOUT_MS");
        long ms = DPAR_TIMEOUT_MS_DEFAULT;
        if (env && *env && !dpar__timeout_ms_of(env, &ms)) /* set after creation checked it (dpar__env_check) */
            DPAR__LOG(DPAR_LOG_WARN, "DPAR_TIMEOUT_MS=%s is not a number of milliseconds; using %d", env,
                      DPAR_TIMEOUT_MS_DEFAULT);
        to = ms > 0 ? (uint64_t)ms * 1000000u : 0;
    }
    c->timeout_ns = to;
    c->check = !d->no_check;
    c->det = d->deterministic != 0;
    c->segment_bytes = d->segment_bytes ? d->segment_bytes : DPAR__SEGMENT_DEFAULT;
    c->algo = d->algo > DPAR_ALGO_AUTO && d->algo <= DPAR_ALGO_SLICE ? d->algo : dpar__algo_from_env();
    c->spin = dpar__spin_make(d->spin_us == 0 ? DPAR_SPIN_US : (d->spin_us < 0 ? 0 : d->spin_us), size);
    snprintf(c->name, sizeof c->name, "%s", d->name && *d->name ? d->name : "comm");
    c->desc = *d;
    c->desc.name = c->name;
    pthread_mutex_init(&c->qlock, NULL);
    c->fault = dpar__fault_attach(&c->allocator);
    return DPAR_OK;
}

static void dpar__comm_free(dpar_comm *c)
{
    dpar_allocator a = c->allocator;
    while (c->free_reqs) {
        dpar_request *q = c->free_reqs;
        c->free_reqs = q->next;
        dpar__free(&a, q->v);
        dpar__free(&a, q);
    }
    dpar__free(&a, c->vbuf);
    dpar__data_free(c, c->scratch);
    dpar__free(&a, c->hscratch);
    dpar__fault_detach(c->fault);
    pthread_mutex_destroy(&c->qlock);
    dpar__free(&a, c);
}

DPAR_API dpar_status dpar_comm_destroy(dpar_comm *comm)
{
    if (!comm) return DPAR_OK;
    dpar__comm_wait_async(comm);
    if (comm->thread_started) {
        DPAR__STORE(&comm->stop, 1, DPAR__RELEASE);
        dpar__bump(&comm->qseq, &comm->qsleepers, INT_MAX);
        pthread_join(comm->thread, NULL);
    }
    dpar__sm_release(comm);
    dpar__tp_destroy(comm);
    dpar__comm_free(comm);
    return DPAR_OK;
}

DPAR_API int dpar_comm_rank(const dpar_comm *comm) { return comm ? comm->rank : -1; }
DPAR_API int dpar_comm_size(const dpar_comm *comm) { return comm ? comm->size : 0; }

DPAR_API dpar_status dpar_comm_query(const dpar_comm *comm, dpar_comm_desc *used)
{
    if (!comm || !used) return dpar__err(DPAR_EINVAL, "dpar_comm_query: comm or used is NULL");
    memset(used, 0, sizeof *used);
    used->size = comm->size;
    used->timeout_ms = comm->timeout_ns ? (int)(comm->timeout_ns / 1000000u) : -1;
    used->no_check = !comm->check;
    used->deterministic = comm->det;
    used->segment_bytes = comm->segment_bytes;
    used->algo = comm->algo;
    used->spin_us = comm->spin.spin_ns ? (int)(comm->spin.spin_ns / 1000u) : -1;
    used->name = comm->name;
    used->allocator = comm->allocator;
    used->memory = comm->desc.memory;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_comm_abort(dpar_comm *comm)
{
    char msg[200];
    if (!comm) return dpar__err(DPAR_EINVAL, "dpar_comm_abort: comm is NULL");
    snprintf(msg, sizeof msg, "%s was aborted by dpar_comm_abort (called on rank %d)", comm->name, comm->rank);
    return dpar__tp_poison(comm, DPAR_EABORTED, msg);
}

DPAR_API dpar_status dpar_comm_fail(dpar_comm *comm, dpar_status why, const char *msg)
{
    char text[DPAR__ERROR_TEXT];
    if (!comm || why == DPAR_OK) return dpar__err(DPAR_EINVAL, "dpar_comm_fail: comm is NULL or why is DPAR_OK");
    snprintf(text, sizeof text, "%s rank %d failed: %.440s", comm->name, comm->rank, msg ? msg : "(no message)");
    return dpar__tp_poison(comm, why, text);
}

DPAR_API dpar_status dpar_comm_stats_get(const dpar_comm *comm, dpar_comm_stats *out)
{
    int i;
    if (!comm || !out) return dpar__err(DPAR_EINVAL, "dpar_comm_stats_get: comm or out is NULL");
    for (i = 0; i < DPAR_COLL_COUNT; i++) {
        const dpar_comm_counters *s = &comm->stats.by_coll[i];
        out->by_coll[i].calls = DPAR__LOAD(&s->calls, DPAR__RELAXED);
        out->by_coll[i].bytes_sent = DPAR__LOAD(&s->bytes_sent, DPAR__RELAXED);
        out->by_coll[i].bytes_received = DPAR__LOAD(&s->bytes_received, DPAR__RELAXED);
        out->by_coll[i].time_ns = DPAR__LOAD(&s->time_ns, DPAR__RELAXED);
    }
    out->last_coll = (dpar_coll)DPAR__LOAD(&comm->last_coll, DPAR__RELAXED);
    out->last.calls = DPAR__LOAD(&comm->stats.last.calls, DPAR__RELAXED);
    out->last.bytes_sent = DPAR__LOAD(&comm->stats.last.bytes_sent, DPAR__RELAXED);
    out->last.bytes_received = DPAR__LOAD(&comm->stats.last.bytes_received, DPAR__RELAXED);
    out->last.time_ns = DPAR__LOAD(&comm->stats.last.time_ns, DPAR__RELAXED);
    {
        uint64_t bits = DPAR__LOAD(&comm->last_busbw_bits, DPAR__RELAXED);
        memcpy(&out->last_busbw_gbps, &bits, sizeof bits);
    }
    for (i = 0; i < DPAR_ALGO_COUNT; i++) out->algo_calls[i] = DPAR__LOAD(&comm->stats.algo_calls[i], DPAR__RELAXED);
    out->last_algo = (dpar_algo)DPAR__LOAD(&comm->stats.last_algo, DPAR__RELAXED);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_comm_stats_reset(dpar_comm *comm)
{
    if (!comm) return dpar__err(DPAR_EINVAL, "dpar_comm_stats_reset: comm is NULL");
    dpar__comm_wait_async(comm);
    memset(&comm->stats, 0, sizeof comm->stats);
    DPAR__STORE(&comm->last_busbw_bits, 0, DPAR__RELAXED);
    return DPAR_OK;
}

/* A collective the transport runs as a whole (split, expose): its call context, entered. */
static dpar_status dpar__coll_begin(dpar__ctx *x, dpar_comm *c, dpar_coll coll, const char *who)
{
    DPAR__TRY(dpar__comm_wait_async(c));
    DPAR__TRY(dpar__tp_poisoned(c));
    memset(x, 0, sizeof *x);
    x->c = c;
    x->lane = DPAR__LANE_COLL;
    x->fp.seq = ++c->seq;
    x->fp.coll = (int)coll;
    x->fp.rank = c->rank;
    x->fp.file = who;
    x->deadline = c->timeout_ns ? dpar_time_ns() + c->timeout_ns : 0;
    dpar__tp_enter(x);
    dpar__sm_enter(x);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_comm_split(dpar_comm *comm, int color, int key, dpar_comm **out)
{
    dpar__ctx x;
    if (out) *out = NULL;
    if (!comm || !out) return dpar__err(DPAR_EINVAL, "dpar_comm_split: comm or out is NULL");
    DPAR__TRY(dpar__coll_begin(&x, comm, DPAR_COLL_SPLIT, "dpar_comm_split"));
    return dpar__tp_split(&x, color, key, out);
}

/* Collective, for the modules that share memory between ranks (direct buckets, work stealing), once
   dpar__tp_shares_memory said yes on every rank: each rank passes n buffers (or NULLs); peers[q * n + i]
   gets rank q's buffer i as this rank may read and write it. */
static dpar_status dpar__expose(dpar_comm *c, const void *const *bufs, int n, void **peers, const char *who)
{
    dpar__ctx x;
    dpar_status st;
    char msg[DPAR__ERROR_TEXT];
    DPAR__TRY(dpar__coll_begin(&x, c, DPAR_COLL_ALLGATHER, who));
    if ((st = c->tp->expose(&x, bufs, n, peers)) == DPAR_OK) return DPAR_OK;
    /* a failure of this rank alone must not leave the others waiting, nor a peer reading what it posted */
    snprintf(msg, sizeof msg, "%s", dpar__tls_error);
    return dpar__tp_fail(c, st, msg);
}

DPAR_API dpar_status dpar_mesh_init(dpar_mesh *out, const dpar_mesh_desc *desc)
{
    int w, dp, tp, pp;
    dpar_comm *world;
    dpar_status st;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_mesh_init: mesh is NULL");
    memset(out, 0, sizeof *out);
    if (!desc || !desc->world) return dpar__err(DPAR_EINVAL, "dpar_mesh_init: desc or desc->world is NULL");
    world = desc->world;
    tp = desc->tp ? desc->tp : 1;
    pp = desc->pp ? desc->pp : 1;
    dp = desc->dp ? desc->dp : (tp > 0 && pp > 0 ? (int)(world->size / ((long)tp * pp)) : 0);
    if (dp < 1 || tp < 1 || pp < 1 || (long)dp * tp * pp != world->size)
        return dpar__bad_call(world, dpar__err(DPAR_EINVAL,
                                               "dpar_mesh_init: dp %d x tp %d x pp %d is not the %d "
                                               "ranks of the world",
                                               dp, tp, pp, world->size));
    w = world->rank;
    out->dp = dp;
    out->tp = tp;
    out->pp = pp;
    out->tp_rank = w % tp;
    out->dp_rank = (w / tp) % dp;
    out->pp_rank = w / (tp * dp);
    /* the sub-comms are named after the world: "comm.tp", "comm.dp", "comm.pp" */
    world->split_suffix = "tp";
    st = dpar_comm_split(world, out->pp_rank * dp + out->dp_rank, out->tp_rank, &out->tp_comm);
    world->split_suffix = "dp";
    if (st == DPAR_OK) st = dpar_comm_split(world, out->pp_rank * tp + out->tp_rank, out->dp_rank, &out->dp_comm);
    world->split_suffix = "pp";
    if (st == DPAR_OK) st = dpar_comm_split(world, out->dp_rank * tp + out->tp_rank, out->pp_rank, &out->pp_comm);
    world->split_suffix = NULL;
    if (st != DPAR_OK) dpar_mesh_destroy(out);
    return st;
}

DPAR_API dpar_status dpar_mesh_destroy(dpar_mesh *mesh)
{
    dpar_status st = DPAR_OK, st2;
    if (!mesh) return DPAR_OK;
    st2 = dpar_comm_destroy(mesh->tp_comm);
    if (st == DPAR_OK) st = st2;
    st2 = dpar_comm_destroy(mesh->dp_comm);
    if (st == DPAR_OK) st = st2;
    st2 = dpar_comm_destroy(mesh->pp_comm);
    if (st == DPAR_OK) st = st2;
    memset(mesh, 0, sizeof *mesh);
    return st;
}

/* >>async: asynchronous requests: one progress thread per rank runs them in order --------------- */
static void dpar__request_finish(dpar_request *q, dpar_status st)
{
    size_t n = strlen(dpar__tls_error);
    q->status = st;
    if (st != DPAR_OK) {
        if (n >= sizeof q->error) n = sizeof q->error - 1;
        memcpy(q->error, dpar__tls_error, n);
        q->error[n] = 0;
    }
    DPAR__STORE(&q->done, 1, DPAR__SEQ_CST);
    dpar__wake(&q->done, &q->done_sleepers, INT_MAX);
}

/* run a request: its collective, and for a chained one the update and the all-gather */
static dpar_status dpar__request_run(dpar_comm *c, dpar_request *q)
{
    dpar__call call =
        dpar__call_make((dpar_coll)q->coll, q->send, q->recv, q->count, q->dtype, q->op, 0, q->file, q->line);
    dpar_status st;
    call.seq = q->seq;
    if (q->coll == DPAR_COLL_ALLTOALLV) call.v = q->v, call.vrecv = q->vrecv;
    st = dpar__execute(c, &call);
    if (st == DPAR_OK && q->then.fn) { /* update my block, then gather everyone's */
        size_t off, len;
        dpar_block_range(q->count, c->size, c->rank, &off, &len);
        if ((st = DPAR__FAULT(c, DPAR__FOP_BUCKET)) != DPAR_OK) return st; /* >>fault */
        q->then.fn(q->then.user, q->then.base + off, len);
        call = dpar__call_make(DPAR_COLL_ALLGATHER, q->then.gather + off, q->then.gather, q->count, DPAR_F32, DPAR_SUM,
                               0, q->file, q->line);
        call.seq = q->seq2;
        st = dpar__execute(c, &call);
    }
    return st;
}

static void *dpar__progress_main(void *arg)
{
    dpar_comm *c = (dpar_comm *)arg;
    char name[64];
    snprintf(name, sizeof name, "%s rank %d progress", c->name, c->rank);
    dpar_trace_set_thread_name(name);
    for (;;) {
        dpar_request *q;
        uint32_t seq = DPAR__LOAD(&c->qseq, DPAR__ACQUIRE);
        pthread_mutex_lock(&c->qlock);
        q = c->qhead;
        if (q) {
            c->qhead = q->next;
            if (!c->qhead) c->qtail = NULL;
        }
        pthread_mutex_unlock(&c->qlock);
        if (q) {
            dpar_status st;
            dpar_clear_error();
            st = dpar__request_run(c, q);
            dpar__request_finish(q, st);
            if (DPAR__SUB(&c->pending, 1, DPAR__SEQ_CST) == 1) dpar__wake(&c->pending, &c->pending_sleepers, INT_MAX);
            continue;
        }
        if (DPAR__LOAD(&c->stop, DPAR__ACQUIRE)) break;
        dpar__wait_while(&c->qseq, seq, &c->qsleepers, c->spin, 0, NULL);
    }
    return NULL;
}

static dpar_status dpar__icollective(dpar_comm *comm, dpar__call *call, dpar_request **req, const char *api,
                                     const dpar__then *then)
{
    dpar_request *q;
    dpar_status st;
    if (req) *req = NULL;
    if (!req) {
        st = dpar__err(DPAR_EINVAL, "%s at %s:%d: req is NULL", api, call->file, call->line);
        return comm ? dpar__bad_call(comm, st) : st;
    }
    st = dpar__validate(comm, call, api);
    if (st != DPAR_OK) return comm ? dpar__bad_call(comm, st) : st;
    if (comm->no_async) {
        st = dpar__err(DPAR_EUNSUPPORTED, "%s at %s:%d: %s", api, call->file, call->line, comm->no_async);
        return dpar__bad_call(comm, st);
    }
    if (comm->batch)
        return dpar__err(DPAR_EINVAL,
                         "%s at %s:%d: an async call inside a batch (dpar_batch_begin): call it before "
                         "or after",
                         api, call->file, call->line);
    pthread_mutex_lock(&comm->qlock);
    q = comm->free_reqs;
    if (q) comm->free_reqs = q->next;
    pthread_mutex_unlock(&comm->qlock);
    if (!q && (q = (dpar_request *)dpar__alloc(&comm->allocator, sizeof *q)) != NULL) q->v = NULL, q->v_cap = 0;
    if (!q) return dpar__err(DPAR_ENOMEM, "%s: out of memory", api);
    {
        size_t *v = q->v, cap = q->v_cap; /* kept across reuse */
        memset(q, 0, sizeof *q);
        q->v = v, q->v_cap = cap;
    }
    q->comm = comm;
    if (call->coll == DPAR_COLL_ALLTOALLV) { /* the caller may free its arrays once this returns */
        size_t n4 = 4 * (size_t)comm->size;
        if (q->v_cap < n4) {
            size_t *v = (size_t *)dpar__alloc(&comm->allocator, n4 * sizeof(size_t));
            if (!v) {
                pthread_mutex_lock(&comm->qlock);
                q->next = comm->free_reqs;
                comm->free_reqs = q;
                pthread_mutex_unlock(&comm->qlock);
                return dpar__err(DPAR_ENOMEM, "%s: out of memory", api);
            }
            dpar__free(&comm->allocator, q->v);
            q->v = v, q->v_cap = n4;
        }
        memcpy(q->v, call->v, n4 * sizeof(size_t));
        q->vrecv = call->vrecv;
    }
    q->coll = (int)call->coll;
    q->send = call->send;
    q->recv = call->recv;
    q->count = call->count;
    q->dtype = call->dtype;
    q->op = call->op;
    q->file = call->file;
    q->line = call->line;
    q->seq = ++comm->seq;
    if (then) {
        q->then = *then;
        q->seq2 = ++comm->seq;
    }
    if (comm->size == 1) { /* nothing to wait for: run it now, on this thread (no progress thread) */
        dpar__request_finish(q, dpar__request_run(comm, q));
        *req = q;
        return DPAR_OK;
    }
    if (!comm->thread_started) {
        int e = pthread_create(&comm->thread, NULL, dpar__progress_main, comm);
        if (e != 0) {
            pthread_mutex_lock(&comm->qlock);
            q->next = comm->free_reqs;
            comm->free_reqs = q;
            pthread_mutex_unlock(&comm->qlock);
            return dpar__err(DPAR_ESYSTEM, "%s: cannot start the progress thread: %s", api, strerror(e));
        }
        comm->thread_started = 1;
    }
    DPAR__ADD(&comm->pending, 1, DPAR__SEQ_CST);
    pthread_mutex_lock(&comm->qlock);
    if (comm->qtail) comm->qtail->next = q;
    else comm->qhead = q;
    comm->qtail = q;
    pthread_mutex_unlock(&comm->qlock);
    dpar__bump(&comm->qseq, &comm->qsleepers, 1);
    *req = q;
    return DPAR_OK;
}

static dpar_status dpar__comm_wait_async(dpar_comm *c)
{
    uint32_t left;
    while ((left = DPAR__LOAD(&c->pending, DPAR__ACQUIRE)) != 0)
        dpar__wait_while(&c->pending, left, &c->pending_sleepers, c->spin, 0, NULL);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_iallreduce_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                        dpar_op op, dpar_request **req, const char *file, int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_ALLREDUCE, send, recv, count, dtype, op, 0, file, line);
    return dpar__icollective(comm, &call, req, "dpar_iallreduce", NULL);
}
DPAR_API dpar_status dpar_ireduce_scatter_at(dpar_comm *comm, const void *send, void *recv, size_t count,
                                             dpar_dtype dtype, dpar_op op, dpar_request **req, const char *file,
                                             int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_REDUCE_SCATTER, send, recv, count, dtype, op, 0, file, line);
    return dpar__icollective(comm, &call, req, "dpar_ireduce_scatter", NULL);
}
DPAR_API dpar_status dpar_iallgather_at(dpar_comm *comm, const void *send, void *recv, size_t count, dpar_dtype dtype,
                                        dpar_request **req, const char *file, int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_ALLGATHER, send, recv, count, dtype, DPAR_SUM, 0, file, line);
    return dpar__icollective(comm, &call, req, "dpar_iallgather", NULL);
}
DPAR_API dpar_status dpar_ialltoallv_at(dpar_comm *comm, const void *send, const size_t *sendcounts,
                                        const size_t *sdispls, void *recv, const size_t *recvcounts,
                                        const size_t *rdispls, dpar_dtype dtype, dpar_request **req, const char *file,
                                        int line)
{
    dpar__call call = dpar__call_make(DPAR_COLL_ALLTOALLV, send, recv, 0, dtype, DPAR_SUM, 0, file, line);
    dpar_status st;
    if (req) *req = NULL;
    st = dpar__v_prepare(comm, &call, sendcounts, sdispls, recvcounts, rdispls, "dpar_ialltoallv");
    if (st != DPAR_OK) return comm ? dpar__bad_call(comm, st) : st;
    return dpar__icollective(comm, &call, req, "dpar_ialltoallv", NULL); /* it copies call.v into the request */
}

static dpar_status dpar__request_release(dpar_request *q)
{
    dpar_comm *c = q->comm;
    dpar_status st = q->status;
    if (st != DPAR_OK) dpar__err(st, "%s", q->error);
    pthread_mutex_lock(&c->qlock);
    q->next = c->free_reqs;
    c->free_reqs = q;
    pthread_mutex_unlock(&c->qlock);
    return st;
}

DPAR_API dpar_status dpar_request_wait(dpar_request *req)
{
    if (!req) return dpar__err(DPAR_EINVAL, "dpar_request_wait: req is NULL");
    while (!DPAR__LOAD(&req->done, DPAR__ACQUIRE))
        dpar__wait_while(&req->done, 0, &req->done_sleepers, req->comm->spin, 0, NULL);
    return dpar__request_release(req);
}

DPAR_API dpar_status dpar_request_test(dpar_request *req, int *done)
{
    if (!req || !done) return dpar__err(DPAR_EINVAL, "dpar_request_test: req or done is NULL");
    *done = DPAR__LOAD(&req->done, DPAR__ACQUIRE) != 0;
    return *done ? dpar__request_release(req) : DPAR_OK;
}

/* >>threads: the threads transport: zero-copy channels and doorbells between thread ranks ------- */
/* The threads transport. A channel carries the offers of one rank to another on one lane: a queue
   of DPAR__QDEPTH (pointer, bytes, fingerprint) entries and two counters, `posted` (written by the
   sender) and `released` (written by the receiver), on separate cache lines. A rank waits for a
   counter on its own doorbell: whoever changes something a rank may wait for bumps that rank's
   doorbell, and wakes it only if it sleeps. Poisoning the group bumps every doorbell. */

typedef struct dpar__chan {
    uint32_t posted, unused;
    uint64_t rel_waited; /* stream-ordered memory: the newest read-done ticket the sender's stream waits for */
    char pad0[DPAR__CACHE_LINE - 2 * sizeof(uint32_t) - sizeof(uint64_t)];
    uint32_t released;
    uint32_t fetched;    /* messages the receiver has started to read (fetched - released: reading now) */
    uint64_t rel_ticket; /* stream-ordered memory: the receiver's newest read-done ticket (before released) */
    char pad1[DPAR__CACHE_LINE - 2 * sizeof(uint32_t) - sizeof(uint64_t)];
    struct {
        const void *ptr;
        size_t bytes;
        dpar__fp fp;
        uint64_t ticket; /* stream-ordered memory: the sender's stream has written the bytes at this ticket */
    } q[DPAR__QDEPTH];
} dpar__chan;

typedef struct dpar__slot {
    uint32_t bell, bell_sleepers;
    char pad0[DPAR__CACHE_LINE - 2 * sizeof(uint32_t)];
    /* what the rank is doing, for timeout messages (relaxed atomics) */
    uint64_t at_seq;
    int at_coll, at_line, joined, cpu;
    const char *at_file;
    int at_seq_coll, at_seq_line; /* the collective #at_seq itself (at_coll..: the last call of either lane) */
    const char *at_seq_file;
    uint64_t moved_ns;
    int worker;            /* dpar_comm_memory: the rank's worker (set when it joins) */
    void *stage;           /* dpar_comm_memory: where a peer's offer is copied for reduce (the rank's own) */
    const dpar_pool *pool; /* the pool whose thread joined this rank (NULL: another thread, or just joining) */
    size_t stage_bytes;
    char pad1[DPAR__CACHE_LINE];
} dpar__slot;

struct dpar_group {
    dpar_comm_desc desc; /* as given, name copied */
    char name[32];
    int size, refs, unshare;
    int poison; /* atomic: 0, or the status every call now returns */
    char poison_msg[DPAR__ERROR_TEXT];
    pthread_mutex_t lock;
    dpar__slot *slots;
    dpar__chan **chans; /* [(src * size + dst) * DPAR__LANES + lane], made on first use */
    /* split: where the new groups are handed over */
    dpar_group **handover;
};

/* a thread rank's transport state is its group */
#define DPAR__TG(c) ((dpar_group *)(c)->tp_data)

static void dpar__group_unref(dpar_group *g)
{
    if (DPAR__SUB(&g->refs, 1, DPAR__ACQ_REL) == 1) {
        dpar_allocator a = g->desc.allocator;
        size_t i, n = (size_t)g->size * (size_t)g->size * DPAR__LANES;
        for (i = 0; i < n; i++) dpar__free(&a, g->chans[i]);
        dpar__free(&a, g->chans);
        dpar__free(&a, g->slots);
        dpar__free(&a, g->handover);
        pthread_mutex_destroy(&g->lock);
        dpar__free(&a, g);
    }
}

static dpar__chan *dpar__chan_get(dpar_group *g, int src, int dst, int lane)
{
    dpar__chan **slot = &g->chans[((size_t)src * (size_t)g->size + (size_t)dst) * DPAR__LANES + (size_t)lane];
    dpar__chan *ch = DPAR__LOAD(slot, DPAR__ACQUIRE), *fresh, *expected = NULL;
    if (ch) return ch;
    fresh = (dpar__chan *)dpar__calloc(&g->desc.allocator, 1, sizeof *fresh);
    if (!fresh) return NULL;
    if (__atomic_compare_exchange_n(slot, &expected, fresh, 0, DPAR__ACQ_REL, DPAR__ACQUIRE)) return fresh;
    dpar__free(&g->desc.allocator, fresh);
    return expected;
}

static void dpar__ring_bell(dpar_group *g, int rank)
{
    dpar__slot *s = &g->slots[rank];
    dpar__bump(&s->bell, &s->bell_sleepers, INT_MAX);
}

static dpar_status dpar__t_poisoned(dpar_comm *c)
{
    dpar_group *g = DPAR__TG(c);
    int st = DPAR__LOAD(&g->poison, DPAR__SEQ_CST); /* callers pair it with stores of their own (Dekker) */
    if (!st) return DPAR_OK;
    pthread_mutex_lock(&g->lock);
    dpar__err((dpar_status)st, "%s", g->poison_msg);
    pthread_mutex_unlock(&g->lock);
    return (dpar_status)st;
}

static dpar_status dpar__t_poison(dpar_comm *c, dpar_status why, const char *msg)
{
    dpar_group *g = DPAR__TG(c);
    int i;
    pthread_mutex_lock(&g->lock);
    if (!DPAR__LOAD(&g->poison, DPAR__RELAXED)) {
        snprintf(g->poison_msg, sizeof g->poison_msg, "%s", msg);
        DPAR__STORE(&g->poison, (int)why, DPAR__SEQ_CST);
    }
    pthread_mutex_unlock(&g->lock);
    for (i = 0; i < g->size; i++) dpar__ring_bell(g, i);
    return dpar__t_poisoned(c);
}

static void dpar__t_enter(dpar__ctx *x)
{
    dpar__slot *s = &DPAR__TG(x->c)->slots[x->c->rank];
    DPAR__STORE(&s->at_coll, x->fp.coll, DPAR__RELAXED);
    DPAR__STORE(&s->at_file, x->fp.file, DPAR__RELAXED);
    DPAR__STORE(&s->at_line, x->fp.line, DPAR__RELAXED);
    if (x->lane == DPAR__LANE_COLL) {
        DPAR__STORE(&s->at_seq_coll, x->fp.coll, DPAR__RELAXED);
        DPAR__STORE(&s->at_seq_file, x->fp.file, DPAR__RELAXED);
        DPAR__STORE(&s->at_seq_line, x->fp.line, DPAR__RELAXED);
        DPAR__STORE(&s->at_seq, x->fp.seq, DPAR__RELEASE);
    }
    dpar__cpu_note(&s->cpu);
}

/* Likely why a peer never joined: every rank that joined runs on a thread of one pool, the pool has fewer threads
   than the group has ranks, and all of them have joined (a pool runs one rank per thread: the common slip of a
   group of N ranks run on a pool made with fewer threads). The pool, or NULL. For the timeout's story only: ranks
   may also join from other threads, so it cannot fail a call early (desc.pool lets dpar_group_create check). */
static const dpar_pool *dpar__t_short_pool(dpar_group *g, int peer)
{
    const dpar_pool *pool = NULL;
    int i, joined = 0;
    if (DPAR__LOAD(&g->slots[peer].joined, DPAR__ACQUIRE) != 0) return NULL;
    for (i = 0; i < g->size; i++) {
        const dpar_pool *p;
        if (DPAR__LOAD(&g->slots[i].joined, DPAR__ACQUIRE) == 0) continue;
        p = DPAR__LOAD(&g->slots[i].pool, DPAR__ACQUIRE);
        if (!p || (pool && p != pool)) return NULL;
        pool = p;
        joined++;
    }
    return pool && joined == pool->nthreads && pool->nthreads < g->size ? pool : NULL;
}

/* The timeout story: which ranks never arrived where this one waits. Poisons the group with it. */
static dpar_status dpar__t_timeout(dpar__ctx *x, int peer, const char *what)
{
    dpar_group *g = DPAR__TG(x->c);
    char me[200], msg[DPAR__ERROR_TEXT];
    int k, i;
    dpar__fp_describe(&x->fp, me, sizeof me);
    dpar__on_comm(x->c, me, sizeof me);
    k = snprintf(msg, sizeof msg, "rank %d timed out after %llu ms in %s, waiting for rank %d to %s", x->c->rank,
                 (unsigned long long)(x->c->timeout_ns / 1000000u), me, peer, what);
    for (i = 0; i < g->size && k > 0 && (size_t)k < sizeof msg; i++) {
        dpar__slot *s = &g->slots[i];
        uint64_t at = DPAR__LOAD(&s->at_seq, DPAR__ACQUIRE);
        int coll_lane = x->lane == DPAR__LANE_COLL;
        int coll = DPAR__LOAD(coll_lane ? &s->at_seq_coll : &s->at_coll, DPAR__RELAXED);
        int line = DPAR__LOAD(coll_lane ? &s->at_seq_line : &s->at_line, DPAR__RELAXED);
        const char *file = DPAR__LOAD(coll_lane ? &s->at_seq_file : &s->at_file, DPAR__RELAXED);
        int behind = x->lane == DPAR__LANE_COLL ? at < x->fp.seq : i == peer;
        if (!behind || i == x->c->rank) continue;
        int joined = DPAR__LOAD(&s->joined, DPAR__RELAXED);
        if (joined == 0) {
            const dpar_pool *short_pool = dpar__t_short_pool(g, i);
            k += snprintf(msg + k, sizeof msg - (size_t)k, "; rank %d never joined (no dpar_group_join)", i);
            if (short_pool && k > 0 && (size_t)k < sizeof msg)
                k += snprintf(msg + k, sizeof msg - (size_t)k,
                              ": %s%d has %d threads for %d ranks, one rank per thread: num_threads = %d",
                              short_pool->name, short_pool->id, short_pool->nthreads, g->size, g->size);
        } else if (joined == 2)
            k += snprintf(msg + k, sizeof msg - (size_t)k, "; rank %d has left (dpar_comm_destroy)", i);
        else if (x->lane == DPAR__LANE_COLL && at == 0)
            k += snprintf(msg + k, sizeof msg - (size_t)k, "; rank %d never arrived (it has made no collective call)",
                          i);
        else if (x->lane == DPAR__LANE_COLL)
            k += snprintf(msg + k, sizeof msg - (size_t)k, "; rank %d never arrived (its last call: %s #%llu at %s:%d)",
                          i, dpar_coll_name((dpar_coll)coll), (unsigned long long)at, file ? file : "?", line);
        else
            k += snprintf(msg + k, sizeof msg - (size_t)k, "; rank %d is in %s at %s:%d", i,
                          dpar_coll_name((dpar_coll)coll), file ? file : "?", line);
    }
    return dpar__t_poison(x->c, DPAR_ETIMEDOUT, msg);
}

/* Wait until the counter reaches target (mod 2^32), on this rank's doorbell. */
static dpar_status dpar__t_wait(dpar__ctx *x, const uint32_t *ctr, uint32_t target, int peer, const char *what)
{
    dpar_comm *c = x->c;
    dpar_group *g = DPAR__TG(c);
    dpar__slot *me = &g->slots[c->rank];
    int parked = 0, checked = 0;
    for (;;) {
        uint32_t bell = DPAR__LOAD(&me->bell, DPAR__ACQUIRE);
        if ((int32_t)(DPAR__LOAD(ctr, DPAR__ACQUIRE) - target) >= 0) break;
        if (DPAR__LOAD(&g->poison, DPAR__ACQUIRE)) return dpar__t_poisoned(c);
        if (x->deadline && dpar_time_ns() >= x->deadline) return dpar__t_timeout(x, peer, what);
        if (!checked && g->unshare) { /* about to wait for a peer: not on its CPU, where it could not run */
            checked = 1;
            dpar__unshare_cpus((char *)&g->slots[0].cpu, sizeof(dpar__slot), g->size, c->rank, &me->moved_ns);
        }
        dpar__wait_while(&me->bell, bell, &me->bell_sleepers, c->spin, x->deadline, &parked);
    }
    if (parked && g->unshare) /* woken up: maybe onto a CPU another rank is on */
        dpar__unshare_cpus((char *)&g->slots[0].cpu, sizeof(dpar__slot), g->size, c->rank, &me->moved_ns);
    return DPAR_OK;
}

static dpar_status dpar__t_chan(dpar__ctx *x, int src, int dst, dpar__chan **out)
{
    *out = dpar__chan_get(DPAR__TG(x->c), src, dst, x->lane);
    return *out ? DPAR_OK : dpar__err(DPAR_ENOMEM, "%s: out of memory for a channel", x->c->name);
}

static dpar_status dpar__t_post_ticket(dpar__ctx *x, int peer, const void *buf, size_t bytes, uint64_t ticket)
{
    dpar__chan *ch;
    uint32_t n;
    DPAR__TRY(dpar__t_chan(x, x->c->rank, peer, &ch));
    n = DPAR__LOAD(&ch->posted, DPAR__RELAXED); /* only this rank writes it */
    DPAR__TRY(dpar__t_wait(x, &ch->released, n + 1 - DPAR__QDEPTH, peer, "take an earlier message"));
    ch->q[n % DPAR__QDEPTH].ptr = buf;
    ch->q[n % DPAR__QDEPTH].bytes = bytes;
    ch->q[n % DPAR__QDEPTH].fp = x->fp;
    ch->q[n % DPAR__QDEPTH].ticket = ticket;
    DPAR__STORE(&ch->posted, n + 1, DPAR__RELEASE);
    dpar__ring_bell(DPAR__TG(x->c), peer);
    return DPAR_OK;
}

static dpar_status dpar__t_post(dpar__ctx *x, int peer, const void *buf, size_t bytes)
{
    return dpar__t_post_ticket(x, peer, buf, bytes, 0);
}

static dpar_status dpar__t_fetch_ticket(dpar__ctx *x, int peer, size_t bytes, const void **data, uint64_t *ticket)
{
    dpar__chan *ch;
    uint32_t n;
    char msg[DPAR__ERROR_TEXT];
    DPAR__TRY(dpar__t_chan(x, peer, x->c->rank, &ch));
    n = DPAR__LOAD(&ch->released, DPAR__RELAXED); /* only this rank writes it */
    DPAR__TRY(dpar__t_wait(x, &ch->posted, n + 1, peer, x->lane == DPAR__LANE_P2P ? "send" : "arrive"));
    /* "reading now", then one more look at the poison (a Dekker pair with dpar__t_quiesce): either
       a sender leaving on an error sees this reader and waits, or this reader sees the error */
    DPAR__STORE(&ch->fetched, n + 1, DPAR__SEQ_CST);
    if (DPAR__LOAD(&DPAR__TG(x->c)->poison, DPAR__SEQ_CST)) {
        DPAR__STORE(&ch->fetched, n, DPAR__SEQ_CST);
        return dpar__t_poisoned(x->c);
    }
    if (!dpar__fp_agree(x, &ch->q[n % DPAR__QDEPTH].fp, ch->q[n % DPAR__QDEPTH].bytes, bytes, msg, sizeof msg)) {
        DPAR__STORE(&ch->fetched, n, DPAR__SEQ_CST);
        return dpar__t_poison(x->c, DPAR_EMISMATCH, msg);
    }
    *data = ch->q[n % DPAR__QDEPTH].ptr;
    if (ticket) *ticket = ch->q[n % DPAR__QDEPTH].ticket;
    return DPAR_OK;
}

static dpar_status dpar__t_fetch(dpar__ctx *x, int peer, size_t bytes, const void **data)
{
    return dpar__t_fetch_ticket(x, peer, bytes, data, NULL);
}

static dpar_status dpar__t_release(dpar__ctx *x, int peer)
{
    dpar__chan *ch;
    DPAR__TRY(dpar__t_chan(x, peer, x->c->rank, &ch));
    DPAR__STORE(&ch->released, DPAR__LOAD(&ch->released, DPAR__RELAXED) + 1, DPAR__SEQ_CST);
    dpar__ring_bell(DPAR__TG(x->c), peer);
    return DPAR_OK;
}

static dpar_status dpar__t_drain(dpar__ctx *x, int peer, int max)
{
    dpar__chan *ch;
    DPAR__TRY(dpar__t_chan(x, x->c->rank, peer, &ch));
    return dpar__t_wait(x, &ch->released, DPAR__LOAD(&ch->posted, DPAR__RELAXED) - (uint32_t)max, peer,
                        x->lane == DPAR__LANE_P2P ? "receive" : "take its data");
}

/* Leaving on an error: wait until no peer is still reading a message of this rank (it is copying
   or reducing one segment, microseconds; a one-shot on device memory holds its peers' offers until its
   combine has run, one callback), so the caller may free its buffers. Peers that have not
   started reading see the poison and never will. */
static void dpar__t_quiesce(dpar_comm *c)
{
    dpar_group *g = DPAR__TG(c);
    int q, lane;
    uint64_t give_up = dpar_time_ns() + 5000000000u;
    for (q = 0; q < g->size; q++)
        for (lane = 0; lane < DPAR__LANES; lane++) {
            dpar__chan *ch = DPAR__LOAD(
                &g->chans[((size_t)c->rank * (size_t)g->size + (size_t)q) * DPAR__LANES + (size_t)lane], DPAR__ACQUIRE);
            if (!ch) continue;
            while ((int32_t)(DPAR__LOAD(&ch->fetched, DPAR__SEQ_CST) - DPAR__LOAD(&ch->released, DPAR__SEQ_CST)) > 0 &&
                   dpar_time_ns() < give_up)
                sched_yield();
        }
}

static dpar_status dpar__t_join(dpar_group *g, int rank, int worker, dpar_comm **out);

/* split: allgather (color, key), the first member of each color makes its group, allgather the
   groups, everyone joins, and a barrier keeps the makers' references until all have joined. */
static dpar_status dpar__t_split(dpar__ctx *x, int color, int key, dpar_comm **out)
{
    dpar_comm *c = x->c;
    dpar_group *g = DPAR__TG(c), *mine = NULL;
    int N = c->size, r = c->rank, i, members = 0, newrank = 0, leader = -1;
    int64_t *ck;
    dpar_status st;
    /* host words, whatever the comm's memory; out of memory here alone: the others must not wait for this rank */
    ck = (int64_t *)dpar__alloc(&c->allocator, (size_t)N * 2 * sizeof(int64_t));
    if (!ck) {
        dpar__err(DPAR_ENOMEM, "%s rank %d: dpar_comm_split: out of memory", c->name, r);
        return dpar__t_poison(c, DPAR_ENOMEM, dpar_last_error());
    }
    ck[2 * r] = color;
    ck[2 * r + 1] = key;
    x->fp.count = 2 * (uint64_t)N;
    x->fp.dtype = DPAR_I64;
    x->host = 1;
    st = dpar__ring_allgather(x, (const char *)(ck + 2 * r), (char *)ck, 2 * (size_t)N, sizeof(int64_t), NULL, NULL);
    x->host = 0;
    if (st != DPAR_OK) {
        dpar__t_quiesce(c); /* the peers may be reading ck */
        dpar__free(&c->allocator, ck);
        return st;
    }
    if (color >= 0) {
        for (i = 0; i < N; i++) {
            if (ck[2 * i] != color) continue;
            members++;
            if (leader < 0) leader = i;
            if (ck[2 * i + 1] < key || (ck[2 * i + 1] == key && i < r)) newrank++;
        }
    }
    dpar__free(&c->allocator, ck); /* the allgather has drained: no peer reads it any more */
    /* the leader (lowest old rank of the color) makes the group and hands it over in g->handover */
    if (color >= 0 && leader == r) {
        dpar_comm_desc d = g->desc;
        char name[sizeof g->name];
        d.size = members;
        d.name = g->name;
        if (c->split_suffix) {
            snprintf(name, sizeof name, "%.28s.%.2s", c->name, c->split_suffix); /* fits: 28 + 3 */
            d.name = name;
        }
        st = dpar_group_create(&d, &mine);
        if (st != DPAR_OK) return dpar__t_poison(c, st, dpar_last_error());
        DPAR__STORE(&g->handover[r], mine, DPAR__RELEASE);
    }
    x->fp.count = 0;
    DPAR__TRY(dpar__dissemination(x)); /* every leader has handed over */
    if (color >= 0) {
        mine = DPAR__LOAD(&g->handover[leader], DPAR__ACQUIRE);
        st = dpar__t_join(mine, newrank, c->worker, out);
        if (st != DPAR_OK) return dpar__t_poison(c, st, dpar_last_error());
    }
    DPAR__TRY(dpar__dissemination(x)); /* everyone has joined: the makers may let go */
    if (color >= 0 && leader == r) {
        DPAR__STORE(&g->handover[r], (dpar_group *)NULL, DPAR__RELAXED);
        dpar_group_destroy(mine);
    }
    return DPAR_OK;
}

static void dpar__t_destroy(dpar_comm *c)
{
    DPAR__STORE(&DPAR__TG(c)->slots[c->rank].joined, 2, DPAR__RELEASE); /* left: it cannot join again */
    dpar__group_unref(DPAR__TG(c));
}

/* ---- shared memory: the ranks are threads, every pointer is valid on every rank ---- */
static dpar_status dpar__t_expose(dpar__ctx *x, const void *const *bufs, int n, void **peers)
{
    dpar_comm *c = x->c;
    size_t words = (size_t)c->size * (size_t)n, i;
    void **mine = peers + (size_t)c->rank * (size_t)n;
    for (i = 0; i < (size_t)n; i++) mine[i] = (void *)(uintptr_t)bufs[i]; /* gathered in place: nothing to allocate */
    x->fp.count = words;
    x->fp.dtype = sizeof(void *) == 8 ? DPAR_I64 : DPAR_I32;
    x->host = 1;
    return dpar__ring_allgather(x, (const char *)mine, (char *)peers, words, sizeof(void *), NULL, NULL);
}

static uint32_t dpar__t_doorbell(dpar_comm *c) { return DPAR__LOAD(&DPAR__TG(c)->slots[c->rank].bell, DPAR__ACQUIRE); }

static dpar_status dpar__t_wait_bell(dpar_comm *c, uint32_t seen, uint64_t deadline)
{
    dpar__slot *me = &DPAR__TG(c)->slots[c->rank];
    return dpar__wait_while(&me->bell, seen, &me->bell_sleepers, c->spin, deadline, NULL);
}

static void dpar__t_wake(dpar_comm *c, int peer) { dpar__ring_bell(DPAR__TG(c), peer); }

/* ---- dpar_comm_memory: the same channels, the buffers' bytes touched only by the callbacks ---- */
/* Each callback returns when its result is complete, so the channels' order (post after the bytes are
   written, release after they are read) holds as for host memory. A failure poisons the group with the
   callback's text: the peers return instead of waiting for this rank. */
static dpar_status dpar__tm_failed(dpar_comm *c, dpar_status st)
{
    char msg[DPAR__ERROR_TEXT];
    if (st == DPAR_OK) return st;
    snprintf(msg, sizeof msg, "%s rank %d: %.440s", c->name, c->rank, dpar__tls_error);
    return dpar__t_poison(c, st, msg);
}
#define DPAR__MEM(c) (&(c)->desc.memory)

static void dpar__tm_enter(dpar__ctx *x)
{
    const dpar_comm_memory *m = DPAR__MEM(x->c);
    dpar__t_enter(x);
    if (m->enter) dpar__tm_failed(x->c, m->enter(m->user, x->c->worker)); /* the next wait returns the poison */
}
static dpar_status dpar__tm_reduce(dpar__ctx *x, void *out, const void *a, const void *b, size_t n, dpar_dtype t,
                                   dpar_op op, int div)
{
    const dpar_comm_memory *m = DPAR__MEM(x->c);
    return dpar__tm_failed(x->c, m->reduce(m->user, x->c->worker, out, a, b, n, t, op, div));
}
static dpar_status dpar__tm_divide(dpar__ctx *x, void *out, const void *in, size_t n, dpar_dtype t, int div)
{
    const dpar_comm_memory *m = DPAR__MEM(x->c);
    return dpar__tm_failed(x->c, m->divide(m->user, x->c->worker, out, in, n, t, div));
}
static dpar_status dpar__tm_copy(dpar__ctx *x, void *dst, const void *src, size_t bytes)
{
    const dpar_comm_memory *m = DPAR__MEM(x->c);
    return dpar__tm_failed(x->c, m->copy(m->user, x->c->worker, dst, src, bytes));
}

/* ---- stream-ordered memory (record and wait set): tickets order the workers' streams ----
   The host protocol is the one above; each of its edges gets a ticket. An offer carries the sender's ticket after
   the bytes' writes, and the receiver's stream waits for it before reading. A release carries the receiver's
   "read done" ticket (written before `released`), and the sender's stream waits for the newest one whenever the
   sender's host sees releases (posting, draining), so whatever the sender's stream writes next comes after the
   peer's reads. The algorithms end by draining: a call returns with every peer's reads of this rank's buffers
   behind this rank's stream. Host buffers (x->host: split's words) have no tickets. */
#define DPAR__ASYNC(x) (DPAR__MEM((x)->c)->record != NULL && !(x)->host)

/* the sender's stream waits for the newest read-done ticket of `peer` on this lane, if it has not yet */
static dpar_status dpar__tm_reads_done(dpar__ctx *x, int peer)
{
    dpar_comm *c = x->c;
    dpar_group *g = DPAR__TG(c);
    const dpar_comm_memory *m = DPAR__MEM(c);
    dpar__chan *ch;
    uint64_t ticket;
    if (!DPAR__ASYNC(x)) return DPAR_OK;
    ch = dpar__chan_get(g, c->rank, peer, x->lane); /* made by the post this wait follows */
    if (!ch) return DPAR_OK;
    ticket = DPAR__LOAD(&ch->rel_ticket, DPAR__ACQUIRE);
    if (ticket <= ch->rel_waited) return DPAR_OK; /* rel_waited: this rank's alone */
    ch->rel_waited = ticket;
    return dpar__tm_failed(c, m->wait(m->user, c->worker, g->slots[peer].worker, ticket));
}

static dpar_status dpar__tm_post(dpar__ctx *x, int peer, const void *buf, size_t bytes)
{
    const dpar_comm_memory *m = DPAR__MEM(x->c);
    uint64_t ticket = 0;
    if (DPAR__ASYNC(x)) DPAR__TRY(dpar__tm_failed(x->c, m->record(m->user, x->c->worker, &ticket)));
    DPAR__TRY(dpar__t_post_ticket(x, peer, buf, bytes, ticket));
    return dpar__tm_reads_done(x, peer);
}

static dpar_status dpar__tm_drain(dpar__ctx *x, int peer, int max)
{
    DPAR__TRY(dpar__t_drain(x, peer, max));
    return dpar__tm_reads_done(x, peer);
}

/* a fetched offer: this rank's stream waits for the sender's ticket before anything reads the bytes */
static dpar_status dpar__tm_fetch_ordered(dpar__ctx *x, int peer, size_t bytes, const void **data)
{
    dpar_comm *c = x->c;
    const dpar_comm_memory *m = DPAR__MEM(c);
    uint64_t ticket = 0;
    dpar_status st;
    DPAR__TRY(dpar__t_fetch_ticket(x, peer, bytes, data, &ticket));
    if (!DPAR__ASYNC(x) || !ticket) return DPAR_OK;
    st = m->wait(m->user, c->worker, DPAR__TG(c)->slots[peer].worker, ticket);
    if (st == DPAR_OK) return DPAR_OK;
    dpar__t_release(x, peer);
    return dpar__tm_failed(c, st);
}

static dpar_status dpar__tm_release(dpar__ctx *x, int peer)
{
    dpar_comm *c = x->c;
    const dpar_comm_memory *m = DPAR__MEM(c);
    if (DPAR__ASYNC(x)) {
        dpar__chan *ch;
        uint64_t ticket = 0;
        dpar_status st = m->record(m->user, c->worker, &ticket);
        DPAR__TRY(dpar__t_chan(x, peer, c->rank, &ch));
        if (st != DPAR_OK) {
            dpar__t_release(x, peer);
            return dpar__tm_failed(c, st);
        }
        DPAR__STORE(&ch->rel_ticket, ticket, DPAR__RELEASE); /* before `released`: the sender sees it with it */
    }
    return dpar__t_release(x, peer);
}

/* a peer's offer that this rank's reduce cannot read where it is: copied into the rank's staging memory
   (at most one fetched offer is unreleased at a time on a rank, so one staging area suffices) */
static dpar_status dpar__tm_fetch(dpar__ctx *x, int peer, size_t bytes, const void **data)
{
    dpar_comm *c = x->c;
    dpar_group *g = DPAR__TG(c);
    const dpar_comm_memory *m = DPAR__MEM(c);
    dpar__slot *me = &g->slots[c->rank];
    DPAR__TRY(dpar__tm_fetch_ordered(x, peer, bytes, data));
    if (x->host || !bytes || !m->peer_access || m->peer_access(m->user, c->worker, g->slots[peer].worker))
        return DPAR_OK;
    if (bytes > me->stage_bytes) {
        void *p = m->alloc(m->user, c->worker, bytes);
        if (!p) {
            dpar__err(DPAR_ENOMEM, "%s rank %d: cannot allocate %zu bytes of staging memory", c->name, c->rank, bytes);
            dpar__t_release(x, peer);
            return dpar__tm_failed(c, DPAR_ENOMEM);
        }
        if (me->stage) m->free(m->user, c->worker, me->stage);
        me->stage = p;
        me->stage_bytes = bytes;
    }
    if (dpar__tm_copy(x, me->stage, *data, bytes) != DPAR_OK) {
        dpar__t_release(x, peer);
        return dpar__t_poisoned(c);
    }
    *data = me->stage;
    return DPAR_OK;
}

/* received bytes go straight to their place: copy reads the peer's buffer wherever it is */
static dpar_status dpar__tm_recv_into(dpar__ctx *x, int peer, void *dst, size_t bytes)
{
    const void *p;
    dpar_status st, rel;
    DPAR__TRY(dpar__tm_fetch_ordered(x, peer, bytes, &p));
    st = p != dst ? dpar__tp_copy(x, dst, p, bytes) : DPAR_OK;
    rel = dpar__tm_release(x, peer);
    return st != DPAR_OK ? st : rel;
}

/* a peer's offer, held where it is when this rank's reduce can read it there (released by the caller), else copied
   into dst and released at once (the peer's worker is known once its offer has come) */
static dpar_status dpar__tm_hold(dpar__ctx *x, int peer, void *dst, size_t bytes, const void **data, int *held)
{
    dpar_comm *c = x->c;
    const dpar_comm_memory *m = DPAR__MEM(c);
    const void *p;
    dpar_status st, rel;
    *held = 0;
    DPAR__TRY(dpar__tm_fetch_ordered(x, peer, bytes, &p));
    if (x->host || !m->peer_access || m->peer_access(m->user, c->worker, DPAR__TG(c)->slots[peer].worker)) {
        *data = p;
        *held = 1;
        return DPAR_OK;
    }
    st = p != dst ? dpar__tp_copy(x, dst, p, bytes) : DPAR_OK;
    rel = dpar__tm_release(x, peer);
    *data = dst;
    return st != DPAR_OK ? st : rel;
}
static dpar_status dpar__tm_combine(dpar__ctx *x, char *out, const char *const *in, size_t lo, size_t n, size_t count,
                                    dpar_dtype t, dpar_op op)
{
    const dpar_comm_memory *m = DPAR__MEM(x->c);
    return dpar__tm_failed(
        x->c, m->combine(m->user, x->c->worker, out, (const void *const *)in, x->c->size, lo, n, count, t, op));
}

static void dpar__tm_destroy(dpar_comm *c)
{
    dpar__slot *me = &DPAR__TG(c)->slots[c->rank];
    const dpar_comm_memory *m = DPAR__MEM(c);
    if (me->stage) m->free(m->user, c->worker, me->stage);
    me->stage = NULL;
    me->stage_bytes = 0;
    dpar__t_destroy(c);
}

/* clang-format off */
static const dpar__transport dpar__threads_memory_transport = {
    "threads+memory",
    dpar__tm_post, dpar__tm_fetch, dpar__tm_release, dpar__tm_drain, /* moving bytes */
    dpar__tm_reduce, dpar__tm_divide, dpar__tm_copy,                /* local arithmetic: the callbacks */
    dpar__tm_enter, dpar__t_poisoned, dpar__t_poison, dpar__t_quiesce, dpar__t_split, dpar__tm_destroy,
    dpar__tm_recv_into, NULL, NULL,
    1, NULL, NULL, NULL, NULL, NULL, /* no shared memory: the host cannot read the buffers */
    0, 0, NULL,
    dpar__tm_hold, dpar__tm_combine, /* one-shot: peers' buffers read where they are, one combine */
};
static const dpar__transport dpar__threads_transport = {
    "threads",
    dpar__t_post, dpar__t_fetch, dpar__t_release, dpar__t_drain, /* moving bytes */
    NULL, NULL, NULL,                                            /* local arithmetic: the host loops */
    dpar__t_enter, dpar__t_poisoned, dpar__t_poison, dpar__t_quiesce, dpar__t_split, dpar__t_destroy,
    NULL, NULL, NULL, /* recv_into, native, prefetch: zero-copy needs none */
    1, dpar__t_expose, dpar__t_doorbell, dpar__t_wait_bell, dpar__t_wake, dpar__t_timeout, /* shared memory */
    0, 0, NULL,
    NULL, NULL, /* one-shot through the memory the ranks share */
};
/* clang-format on */

DPAR_API dpar_status dpar_group_create(const dpar_comm_desc *desc, dpar_group **out)
{
    dpar_group *g;
    dpar_status st;
    size_t nchan;
    int i;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_group_create: out is NULL");
    *out = NULL;
    if (!desc) return dpar__err(DPAR_EINVAL, "dpar_group_create: desc is NULL (size is required)");
    if ((st = dpar__check_allocator("dpar_group_create", &desc->allocator)) != DPAR_OK) return st;
    if ((st = dpar__env_check("dpar_group_create")) != DPAR_OK) return st;
    if (desc->size < 1)
        return dpar__err(DPAR_EINVAL, "dpar_group_create: size = %d (needs at least 1 rank)", desc->size);
    if (desc->size > DPAR_MAX_THREADS)
        return dpar__err(DPAR_ERANGE, "dpar_group_create: size = %d is above DPAR_MAX_THREADS (%d)", desc->size,
                         DPAR_MAX_THREADS);
    if (desc->timeout_ms < -1) return dpar__err(DPAR_EINVAL, "dpar_group_create: timeout_ms = %d", desc->timeout_ms);
    if (desc->spin_us < -1) return dpar__err(DPAR_EINVAL, "dpar_group_create: spin_us = %d", desc->spin_us);
    if (desc->pool && desc->pool->nthreads < desc->size)
        return dpar__err(DPAR_EINVAL,
                         "dpar_group_create: a group of %d ranks on pool %s%d of %d threads: dpar_pool_run runs one "
                         "rank per thread, so ranks %d..%d could never join (make the pool with num_threads = %d)",
                         desc->size, desc->pool->name, desc->pool->id, desc->pool->nthreads, desc->pool->nthreads,
                         desc->size - 1, desc->size);
    {
        const dpar_comm_memory *m = &desc->memory;
        int set = !!m->reduce + !!m->divide + !!m->copy + !!m->alloc + !!m->free;
        if (set != 0 && set != 5)
            return dpar__err(DPAR_EINVAL,
                             "dpar_group_create: the memory callbacks reduce, divide, copy, alloc and "
                             "free are all or none (%d of 5 set)",
                             set);
        if (!m->record != !m->wait)
            return dpar__err(DPAR_EINVAL,
                             "dpar_group_create: memory.record and memory.wait go together (stream-"
                             "ordered memory), %s is missing",
                             m->record ? "wait" : "record");
        if (!m->clear != !m->update)
            return dpar__err(DPAR_EINVAL,
                             "dpar_group_create: memory.clear and memory.update go together, %s is missing",
                             m->clear ? "update" : "clear");
        if (!m->to_host != !m->from_host)
            return dpar__err(DPAR_EINVAL,
                             "dpar_group_create: memory.to_host and memory.from_host go together, %s is missing",
                             m->to_host ? "from_host" : "to_host");
        if (!set && (m->enter || m->peer_access || m->record || m->clear || m->to_host || m->combine))
            return dpar__err(DPAR_EINVAL, "dpar_group_create: memory.enter, memory.peer_access, memory.record, "
                                          "memory.clear, memory.to_host or memory.combine without the memory "
                                          "callbacks");
    }
    if (desc->algo < DPAR_ALGO_AUTO || desc->algo > DPAR_ALGO_SLICE)
        return dpar__err(DPAR_EINVAL, "dpar_group_create: algo = %d (auto, ring, oneshot or slice)", desc->algo);
    if (desc->deterministic && (desc->size & (desc->size - 1)))
        return dpar__err(DPAR_EUNSUPPORTED,
                         "dpar_group_create: the deterministic mode needs a power-of-two number of "
                         "ranks, not %d",
                         desc->size);
    g = (dpar_group *)dpar__calloc(&desc->allocator, 1, sizeof *g);
    if (!g) return dpar__err(DPAR_ENOMEM, "dpar_group_create: out of memory");
    g->desc = *desc;
    snprintf(g->name, sizeof g->name, "%s", desc->name && *desc->name ? desc->name : "comm");
    g->desc.name = g->name;
    g->size = desc->size;
    g->refs = 1;
    g->unshare = desc->size > 1 && desc->size <= dpar__online_cpus();
    pthread_mutex_init(&g->lock, NULL);
    nchan = (size_t)g->size * (size_t)g->size * DPAR__LANES;
    g->slots = (dpar__slot *)dpar__calloc(&desc->allocator, (size_t)g->size, sizeof(dpar__slot));
    g->chans = (dpar__chan **)dpar__calloc(&desc->allocator, nchan, sizeof(dpar__chan *));
    g->handover = (dpar_group **)dpar__calloc(&desc->allocator, (size_t)g->size, sizeof(dpar_group *));
    if (!g->slots || !g->chans || !g->handover) {
        dpar__group_unref(g);
        return dpar__err(DPAR_ENOMEM, "dpar_group_create: out of memory");
    }
    for (i = 0; i < g->size; i++) g->slots[i].cpu = -1;
    *out = g;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_group_destroy(dpar_group *group)
{
    if (!group) return DPAR_OK;
    dpar__group_unref(group);
    return DPAR_OK;
}

static dpar_status dpar__t_join(dpar_group *g, int rank, int worker, dpar_comm **out)
{
    dpar_comm *c;
    char name[64];
    int expected = 0;
    if (rank < 0 || rank >= g->size)
        return dpar__err(DPAR_EINVAL, "dpar_group_join: rank %d is not in 0..%d", rank, g->size - 1);
    if (!__atomic_compare_exchange_n(&g->slots[rank].joined, &expected, 1, 0, DPAR__ACQ_REL, DPAR__RELAXED))
        return dpar__err(DPAR_EBUSY, "dpar_group_join: rank %d of %s has already joined", rank, g->name);
    c = (dpar_comm *)dpar__calloc(&g->desc.allocator, 1, sizeof *c);
    if (!c) {
        DPAR__STORE(&g->slots[rank].joined, 0, DPAR__RELEASE);
        return dpar__err(DPAR_ENOMEM, "dpar_group_join: out of memory");
    }
    dpar__comm_init(c, &g->desc, rank, g->size);
    c->tp = g->desc.memory.reduce ? &dpar__threads_memory_transport : &dpar__threads_transport;
    c->tp_data = g;
    c->worker = worker;
    g->slots[rank].worker = worker; /* read by the peers after the first message: its release orders it */
    DPAR__STORE(&g->slots[rank].pool, (const dpar_pool *)dpar__tls_pool, DPAR__RELEASE);
    DPAR__ADD(&g->refs, 1, DPAR__ACQ_REL);
    dpar__cpu_note(&g->slots[rank].cpu);
    snprintf(name, sizeof name, "%s rank %d", c->name, rank);
    dpar_trace_set_thread_name(name);
    *out = c;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_group_join(dpar_group *group, int rank, dpar_comm **out)
{
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_group_join: out is NULL");
    *out = NULL;
    if (!group) return dpar__err(DPAR_EINVAL, "dpar_group_join: group is NULL");
    return dpar__t_join(group, rank, rank, out);
}

/* >>ops: comms whose collectives another library carries out (dpar_comm_from_ops) ------------------ */
/* The front end stays dpar's; native takes every collective (native_first): the fingerprints are
   allgathered through ops.exchange and compared on every rank, then ops.run does the call. Nothing
   else of the interface is used: point-to-point and split say so. */
typedef struct dpar__ops {
    dpar_comm_ops ops;
    int poison; /* atomic: 0, or the status every call now returns (this rank's) */
    char poison_msg[DPAR__ERROR_TEXT];
    pthread_mutex_t lock;
    dpar_comm_call *bcalls; /* the open batch's calls (bn of them, room for bcap; kept between batches) */
    struct dpar__ofp *bfps; /* and their fingerprints */
    int bn, bcap;
} dpar__ops;
#define DPAR__O(c) ((dpar__ops *)(c)->tp_data)

/* a fingerprint as it crosses to the other ranks: no pointers */
typedef struct dpar__ofp {
    uint64_t seq, count;
    int32_t coll, dtype, op, root, line, pad;
    char file[48]; /* the last 47 characters of the caller's file */
} dpar__ofp;

static dpar_status dpar__o_poisoned(dpar_comm *c)
{
    dpar__ops *o = DPAR__O(c);
    int st = DPAR__LOAD(&o->poison, DPAR__SEQ_CST);
    if (!st) return DPAR_OK;
    pthread_mutex_lock(&o->lock);
    dpar__err((dpar_status)st, "%s", o->poison_msg);
    pthread_mutex_unlock(&o->lock);
    return (dpar_status)st;
}
static dpar_status dpar__o_poison(dpar_comm *c, dpar_status why, const char *msg)
{
    dpar__ops *o = DPAR__O(c);
    pthread_mutex_lock(&o->lock);
    if (!DPAR__LOAD(&o->poison, DPAR__RELAXED)) {
        snprintf(o->poison_msg, sizeof o->poison_msg, "%s", msg);
        DPAR__STORE(&o->poison, (int)why, DPAR__SEQ_CST);
    }
    pthread_mutex_unlock(&o->lock);
    return dpar__o_poisoned(c);
}
static dpar_status dpar__o_unsupported(dpar_comm *c)
{
    return dpar__err(DPAR_EUNSUPPORTED,
                     "%s: point-to-point and split are not on a comm run by another library "
                     "(dpar_comm_from_ops): use the library's own",
                     c->name);
}
static dpar_status dpar__o_post(dpar__ctx *x, int peer, const void *buf, size_t bytes)
{
    (void)peer, (void)buf, (void)bytes;
    return dpar__o_unsupported(x->c);
}
static dpar_status dpar__o_fetch(dpar__ctx *x, int peer, size_t bytes, const void **data)
{
    (void)peer, (void)bytes, (void)data;
    return dpar__o_unsupported(x->c);
}
static dpar_status dpar__o_peer(dpar__ctx *x, int peer)
{
    (void)peer;
    return dpar__o_unsupported(x->c);
}
static dpar_status dpar__o_drain(dpar__ctx *x, int peer, int max)
{
    (void)peer, (void)max;
    return dpar__o_unsupported(x->c);
}
static dpar_status dpar__o_split(dpar__ctx *x, int color, int key, dpar_comm **out)
{
    (void)color, (void)key, (void)out;
    return dpar__o_unsupported(x->c);
}
static void dpar__o_enter(dpar__ctx *x) { (void)x; }

static void dpar__o_fp(dpar__ofp *f, const dpar__fp *from)
{
    const char *file = from->file ? from->file : "?";
    size_t n = strlen(file);
    memset(f, 0, sizeof *f);
    f->seq = from->seq;
    f->count = from->count;
    f->coll = from->coll, f->dtype = from->dtype, f->op = from->op, f->root = from->root, f->line = from->line;
    snprintf(f->file, sizeof f->file, "%s", n >= sizeof f->file ? file + n - (sizeof f->file - 1) : file);
}

/* the fingerprints every rank sent (all[q]; all[size]: this rank's, of call `mine`) agree, else every rank fails
   naming the first other rank that differs and both calls; in a batch (ended: a rank's batch that had no call left,
   its count in `count`) */
static dpar_status dpar__o_compare(dpar_comm *c, const dpar__ofp *all, const dpar__fp *mine_fp, int batch)
{
    char msg[DPAR__ERROR_TEXT];
    int q;
    for (q = 0; q < c->size; q++) {
        const dpar__ofp *t = &all[q], *m = &all[c->size];
        dpar__fp theirs, mine = *mine_fp;
        char a[200], b[200];
        if (t->seq == m->seq && t->count == m->count && t->coll == m->coll && t->dtype == m->dtype && t->op == m->op &&
            t->root == m->root)
            continue;
        memset(&theirs, 0, sizeof theirs);
        theirs.seq = t->seq, theirs.count = t->count, theirs.coll = t->coll, theirs.dtype = t->dtype;
        theirs.op = t->op, theirs.root = t->root, theirs.rank = q, theirs.file = t->file, theirs.line = t->line;
        if ((unsigned)theirs.coll >= DPAR_COLL_COUNT || (unsigned)theirs.dtype >= DPAR_DTYPE_COUNT ||
            (unsigned)theirs.op >= DPAR_OP_COUNT)
            theirs.coll = DPAR_COLL_BARRIER; /* bytes the library garbled: never index a name table with them */
        if (t->coll == -1)
            snprintf(a, sizeof a, "nothing more (its batch ended after %llu calls)", (unsigned long long)t->count);
        else dpar__fp_describe(&theirs, a, sizeof a);
        if (m->coll == -1)
            snprintf(b, sizeof b, "nothing more (its batch ended after %llu calls)", (unsigned long long)m->count);
        else dpar__fp_describe(&mine, b, sizeof b);
        dpar__on_comm(c, b, sizeof b);
        snprintf(msg, sizeof msg, "rank %d called %s while rank %d called %s%s", c->rank, b, q, a,
                 batch ? " (in a batch, dpar_batch_begin)" : "");
        return dpar__o_poison(c, DPAR_EMISMATCH, msg);
    }
    return DPAR_OK;
}

static dpar_status dpar__o_exchange_failed(dpar_comm *c, dpar_status st)
{
    char msg[DPAR__ERROR_TEXT];
    snprintf(msg, sizeof msg, "%s rank %d: the contract check's exchange failed: %.400s", c->name, c->rank,
             dpar__tls_error);
    return dpar__o_poison(c, st, msg);
}
/* every rank sees every rank's fingerprint: a disagreement fails every rank, naming both sides. alltoallv: then every
   rank's counts (what it sends to each rank, what it expects from each), so every rank finds the same first pair
   that disagrees (the library offers an allgather, not messages that could carry them pair by pair) */
static dpar_status dpar__o_check(dpar__ctx *x, const dpar__call *call)
{
    dpar_comm *c = x->c;
    dpar__ops *o = DPAR__O(c);
    dpar__ofp *all;
    char *scr = NULL, msg[DPAR__ERROR_TEXT];
    dpar_status st;
    size_t N = (size_t)c->size, fps = (N + 1) * sizeof(dpar__ofp), vb = 2 * N * sizeof(uint64_t);
    DPAR__TRY(dpar__scratch(c, fps + (call->coll == DPAR_COLL_ALLTOALLV ? vb * (N + 1) : 0), &scr));
    all = (dpar__ofp *)(void *)scr;
    dpar__o_fp(&all[c->size], &x->fp);
    st = o->ops.exchange(o->ops.user, &all[c->size], all, sizeof(dpar__ofp), x->deadline);
    if (st != DPAR_OK) return dpar__o_exchange_failed(c, st);
    DPAR__TRY(dpar__o_compare(c, all, &x->fp, 0));
    if (call->coll == DPAR_COLL_ALLTOALLV) { /* row i of counts: rank i's sendcounts, then its recvcounts */
        uint64_t *counts = (uint64_t *)(void *)(scr + fps), *mine = counts + 2 * N * N;
        size_t i, j;
        for (i = 0; i < N; i++) mine[i] = call->v[i], mine[N + i] = call->v[2 * N + i];
        st = o->ops.exchange(o->ops.user, mine, counts, vb, x->deadline);
        if (st != DPAR_OK) return dpar__o_exchange_failed(c, st);
        for (i = 0; i < N; i++)
            for (j = 0; j < N; j++)
                if (counts[i * 2 * N + j] != counts[j * 2 * N + N + i]) { /* i sends to j; j expects from i */
                    dpar__fp from, to;
                    memset(&from, 0, sizeof from);
                    memset(&to, 0, sizeof to);
                    from.rank = (int)i, from.count = counts[i * 2 * N + j], from.seq = all[i].seq;
                    from.file = all[i].file, from.line = all[i].line;
                    to.rank = (int)j, to.count = counts[j * 2 * N + N + i], to.seq = all[j].seq;
                    to.file = all[j].file, to.line = all[j].line;
                    dpar__v_story(msg, sizeof msg, &from, &to, c);
                    return dpar__o_poison(c, DPAR_EMISMATCH, msg);
                }
    }
    return DPAR_OK;
}

/* the call as the library gets it */
static void dpar__o_call(const dpar__ctx *x, const dpar__call *call, dpar_comm_call *cc)
{
    memset(cc, 0, sizeof *cc);
    cc->coll = call->coll;
    cc->send = call->send;
    cc->recv = call->recv;
    cc->count = call->count;
    cc->dtype = call->dtype;
    cc->op = call->op;
    cc->root = call->root;
    cc->seq = call->seq;
    cc->deadline_ns = x->deadline;
    cc->file = call->file;
    cc->line = call->line;
    if (call->coll == DPAR_COLL_ALLTOALLV) {
        size_t N = (size_t)x->c->size;
        cc->count = call->count + call->vrecv;
        cc->sendcounts = call->v, cc->sdispls = call->v + N, cc->recvcounts = call->v + 2 * N;
        cc->rdispls = call->v + 3 * N;
    }
}

/* a collective on host words on a library's comm (its run takes the library's memory): each rank's piece to all
   through the exchange, then this rank's result from the pieces: an alltoall (dpar_alltoallv_counts), an all-reduce
   combined in rank order (the same bits on every rank), an all-gather of dpar_block_range's blocks, a broadcast */
static dpar_status dpar__o_host(dpar__ctx *x, const dpar__call *call)
{
    dpar_comm *c = x->c;
    dpar__ops *o = DPAR__O(c);
    size_t es = dpar__dtype_sizes[call->dtype], N = (size_t)c->size, me = (size_t)c->rank, q, b, off, len;
    const char *mine = (const char *)call->send;
    char *scr = NULL, *out = (char *)call->recv;
    switch (call->coll) {
    case DPAR_COLL_ALLTOALL: b = N * call->count * es; break;
    case DPAR_COLL_ALLGATHER: dpar_block_range(call->count, c->size, 0, &off, &len), b = len * es; break;
    default: b = call->count * es; break; /* allreduce, broadcast: the whole buffer */
    }
    DPAR__TRY(dpar__scratch(c, (N + 1) * b, &scr));
    if (call->coll == DPAR_COLL_ALLGATHER) { /* my block, padded to the largest (the first) */
        dpar_block_range(call->count, c->size, c->rank, &off, &len);
        if (len) memcpy(scr + N * b, call->send, len * es);
        mine = scr + N * b;
    }
    if (call->coll == DPAR_COLL_BROADCAST && call->root != c->rank) mine = out; /* any bytes: only the root's count */
    if (!mine) mine = out;
    DPAR__TRY(o->ops.exchange(o->ops.user, mine, scr, b, x->deadline));
    for (q = 0; q < N; q++) {
        const char *piece = scr + q * b;
        switch (call->coll) {
        case DPAR_COLL_ALLTOALL: memcpy(out + q * (b / N), piece + me * (b / N), b / N); break;
        case DPAR_COLL_ALLGATHER:
            dpar_block_range(call->count, c->size, (int)q, &off, &len);
            memcpy(out + off * es, piece, len * es);
            break;
        case DPAR_COLL_BROADCAST:
            if ((int)q == call->root) memcpy(out, piece, b);
            break;
        default:
            if (q == 0) memcpy(out, piece, b);
            else dpar__reduce(out, out, piece, call->count, call->dtype, call->op, q + 1 == N ? c->size : 0);
            break;
        }
    }
    return DPAR_OK;
}

/* batches on a library's comm: a call inside a batch is recorded (its arguments were checked), and dpar_batch_end
   checks the batch with one exchange and runs it (ops.run_group, else call by call) */
static dpar_status dpar__o_record(dpar__ctx *x, const dpar__call *call)
{
    dpar_comm *c = x->c;
    dpar__ops *o = DPAR__O(c);
    if (call->coll == DPAR_COLL_ALLTOALLV || call->host)
        return dpar__err(DPAR_EUNSUPPORTED,
                         "%s: %s at %s:%d inside a batch (its counts are checked call by call: call "
                         "it before dpar_batch_begin or after dpar_batch_end)",
                         c->name, dpar_coll_name(call->coll), call->file, call->line);
    if (o->bn == o->bcap) { /* grown by doubling, kept: a steady loop of batches allocates nothing */
        int cap = o->bcap ? 2 * o->bcap : 16;
        dpar_comm_call *calls = (dpar_comm_call *)dpar__alloc(&c->allocator, (size_t)cap * sizeof *calls);
        dpar__ofp *fps = (dpar__ofp *)dpar__alloc(&c->allocator, (size_t)cap * sizeof *fps);
        if (!calls || !fps) {
            dpar__free(&c->allocator, calls);
            dpar__free(&c->allocator, fps);
            return dpar__err(DPAR_ENOMEM, "%s: out of memory (a batch of %d calls)", c->name, o->bn + 1);
        }
        if (o->bn)
            memcpy(calls, o->bcalls, (size_t)o->bn * sizeof *calls), memcpy(fps, o->bfps, (size_t)o->bn * sizeof *fps);
        dpar__free(&c->allocator, o->bcalls);
        dpar__free(&c->allocator, o->bfps);
        o->bcalls = calls, o->bfps = fps, o->bcap = cap;
    }
    dpar__o_call(x, call, &o->bcalls[o->bn]);
    dpar__o_fp(&o->bfps[o->bn], &x->fp);
    o->bn++;
    return DPAR_OK;
}
/* the fields the checker compares, hashed over the batch (FNV-1a, 64 bits) */
static uint64_t dpar__o_batch_hash(const dpar__ofp *f, int n)
{
    uint64_t h = 14695981039346656037ull;
    int i, k;
    for (i = 0; i < n; i++) {
        uint64_t w[6];
        w[0] = f[i].seq, w[1] = f[i].count, w[2] = (uint64_t)(uint32_t)f[i].coll, w[3] = (uint64_t)(uint32_t)f[i].dtype;
        w[4] = (uint64_t)(uint32_t)f[i].op, w[5] = (uint64_t)(uint32_t)f[i].root;
        for (k = 0; k < 6; k++) h = (h ^ w[k]) * 1099511628211ull;
    }
    return h;
}
static dpar_status dpar__o_batch_end(dpar_comm *c)
{
    dpar__ops *o = DPAR__O(c);
    uint64_t deadline = c->timeout_ns ? dpar__now_ns() + c->timeout_ns : 0;
    int n = o->bn, i, q;
    dpar_status st = DPAR_OK;
    char msg[DPAR__ERROR_TEXT];
    o->bn = 0;
    DPAR__TRY(dpar__o_poisoned(c));
    if (c->check) { /* one exchange: every rank's count and hash; where they differ, call by call to the first */
        size_t N = (size_t)c->size;
        uint64_t *all, maxn = (uint64_t)n;
        int differ = 0;
        char *scr = NULL;
        dpar__ofp *fps;
        DPAR__TRY(dpar__scratch(c, (N + 1) * (2 * sizeof(uint64_t) + sizeof(dpar__ofp)), &scr));
        all = (uint64_t *)(void *)scr;
        fps = (dpar__ofp *)(void *)(scr + (N + 1) * 2 * sizeof(uint64_t));
        all[2 * N] = (uint64_t)n, all[2 * N + 1] = dpar__o_batch_hash(o->bfps, n);
        if ((st = o->ops.exchange(o->ops.user, &all[2 * N], all, 2 * sizeof(uint64_t), deadline)) != DPAR_OK)
            return dpar__o_exchange_failed(c, st);
        for (q = 0; q < c->size; q++) {
            differ |= all[2 * q] != all[2 * N] || all[2 * q + 1] != all[2 * N + 1];
            if (all[2 * q] > maxn) maxn = all[2 * q];
        }
        for (i = 0; differ && (uint64_t)i < maxn; i++) {
            dpar__fp mine;
            memset(&mine, 0, sizeof mine);
            if (i < n) {
                fps[N] = o->bfps[i];
                mine.seq = fps[N].seq, mine.count = fps[N].count, mine.coll = fps[N].coll;
                mine.dtype = fps[N].dtype, mine.op = fps[N].op, mine.root = fps[N].root;
                mine.file = o->bfps[i].file, mine.line = fps[N].line;
            } else { /* this rank's batch has ended */
                memset(&fps[N], 0, sizeof fps[N]);
                fps[N].coll = -1, fps[N].count = (uint64_t)n;
            }
            mine.rank = c->rank;
            if ((st = o->ops.exchange(o->ops.user, &fps[N], fps, sizeof(dpar__ofp), deadline)) != DPAR_OK)
                return dpar__o_exchange_failed(c, st);
            DPAR__TRY(dpar__o_compare(c, fps, &mine, 1));
        }
    }
    for (i = 0; i < n; i++) o->bcalls[i].deadline_ns = deadline;
    if (n && o->ops.run_group) st = o->ops.run_group(o->ops.user, o->bcalls, n);
    for (i = 0; i < n && !o->ops.run_group && st == DPAR_OK; i++) st = o->ops.run(o->ops.user, &o->bcalls[i]);
    if (st == DPAR_OK) return DPAR_OK;
    snprintf(msg, sizeof msg, "%.400s", dpar__tls_error);
    return dpar__o_poison(c, st, msg);
}

static dpar_status dpar__o_native(dpar__ctx *x, const dpar__call *call, int *done)
{
    dpar_comm *c = x->c;
    dpar__ops *o = DPAR__O(c);
    dpar_comm_call cc;
    dpar_status st;
    char msg[DPAR__ERROR_TEXT];
    *done = 1;
    if (call->offs)
        return dpar__err(DPAR_EUNSUPPORTED,
                         "%s: an all-gather of uneven blocks of one's own layout (a shard plan) is "
                         "not on a comm run by another library",
                         c->name);
    if (c->batch) return dpar__o_record(x, call);
    if (c->check) DPAR__TRY(dpar__o_check(x, call));
    if (call->host && !o->ops.exchange && c->ops_memory.reduce) /* the same on every rank: nobody waits */
        return dpar__err(DPAR_EUNSUPPORTED,
                         "%s: %s at %s:%d on host words (a checkpoint's own, dpar_alltoallv_counts) needs ops.exchange "
                         "on a comm whose buffers are the device's (desc.memory)",
                         c->name, dpar_coll_name(call->coll), call->file, call->line);
    if (call->host && o->ops.exchange) { /* host words (dpar_alltoallv_counts, checkpoints' own): through the
                                            exchange (an allgather); without one, host buffers go to run as any */
        st = dpar__o_host(x, call);
        if (st == DPAR_OK) return DPAR_OK;
        snprintf(msg, sizeof msg, "%.400s", dpar__tls_error);
        return dpar__o_poison(c, st, msg);
    }
    dpar__o_call(x, call, &cc);
    st = o->ops.run(o->ops.user, &cc);
    if (st == DPAR_OK) return DPAR_OK;
    snprintf(msg, sizeof msg, "%.400s", dpar__tls_error);
    return dpar__o_poison(c, st, msg);
}

static void dpar__o_destroy(dpar_comm *c)
{
    dpar__ops *o = DPAR__O(c);
    dpar__free(&c->allocator, o->bcalls);
    dpar__free(&c->allocator, o->bfps);
    if (o->ops.destroy) o->ops.destroy(o->ops.user);
    pthread_mutex_destroy(&o->lock);
    dpar__free(&c->allocator, o);
}

/* clang-format off */
static const dpar__transport dpar__ops_transport = {
    "ops",
    dpar__o_post, dpar__o_fetch, dpar__o_peer, dpar__o_drain, /* moving bytes: not here */
    NULL, NULL, NULL,
    dpar__o_enter, dpar__o_poisoned, dpar__o_poison, NULL, dpar__o_split, dpar__o_destroy,
    NULL, dpar__o_native, NULL,
    0, NULL, NULL, NULL, NULL, NULL,
    1, 0, NULL, /* native_first: the library runs every collective */
    NULL, NULL,
};
/* clang-format on */

DPAR_API dpar_status dpar_comm_from_ops(const dpar_comm_ops *ops, const dpar_comm_desc *desc, dpar_comm **out)
{
    dpar_comm_desc d;
    dpar_comm *c;
    dpar__ops *o;
    dpar_status st;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_comm_from_ops: out is NULL");
    *out = NULL;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (!ops || !ops->run || ops->size < 1 || ops->rank < 0 || ops->rank >= ops->size ||
        (!ops->exchange && !d.no_check))
        return dpar__err(DPAR_EINVAL,
                         "dpar_comm_from_ops: ops %s (run, rank in 0..size-1, and exchange unless no_check "
                         "are required)",
                         ops ? "incomplete" : "NULL");
    if ((st = dpar__check_allocator("dpar_comm_from_ops", &d.allocator)) != DPAR_OK) return st;
    if (d.deterministic || d.timeout_ms < -1)
        return dpar__err(DPAR_EINVAL,
                         "dpar_comm_from_ops: deterministic or timeout_ms %d: the library decides in which order the "
                         "bytes are combined",
                         d.timeout_ms);
    {
        const dpar_comm_memory *m = &d.memory; /* for dpar_zero and dpar_fsdp only: the library moves the bytes */
        int set = !!m->reduce + !!m->divide + !!m->copy + !!m->alloc + !!m->free + !!m->clear + !!m->update;
        if ((set != 0 && (set != 7 || m->record || m->wait || m->peer_access)) || m->combine)
            return dpar__err(DPAR_EINVAL,
                             "dpar_comm_from_ops: memory callbacks: reduce, divide, copy, alloc, free, clear and "
                             "update all or none (%d of 7 set), no record, wait, peer_access or combine (the "
                             "library's)",
                             set);
        if (!m->to_host != !m->from_host || (!set && m->to_host))
            return dpar__err(DPAR_EINVAL, "dpar_comm_from_ops: memory.to_host and memory.from_host go together, "
                                          "and with the seven others");
    }
    if ((st = dpar__env_check("dpar_comm_from_ops")) != DPAR_OK) return st;
    c = (dpar_comm *)dpar__calloc(&d.allocator, 1, sizeof *c);
    o = (dpar__ops *)dpar__calloc(&d.allocator, 1, sizeof *o);
    if (!c || !o) {
        dpar__free(&d.allocator, c);
        dpar__free(&d.allocator, o);
        return dpar__err(DPAR_ENOMEM, "dpar_comm_from_ops: out of memory");
    }
    d.size = ops->size;
    c->ops_memory = d.memory;
    memset(&d.memory, 0, sizeof d.memory); /* the comm's own scratch and checks stay in host memory */
    dpar__comm_init(c, &d, ops->rank, ops->size);
    o->ops = *ops;
    pthread_mutex_init(&o->lock, NULL);
    c->tp = &dpar__ops_transport;
    c->tp_data = o;
    *out = c;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_batch_begin(dpar_comm *comm)
{
    if (!comm) return dpar__err(DPAR_EINVAL, "dpar_batch_begin: comm is NULL");
    if (comm->batch) return dpar__err(DPAR_EINVAL, "dpar_batch_begin: %s: a batch is open already", comm->name);
    comm->batch = 1;
    if (comm->tp == &dpar__ops_transport) DPAR__O(comm)->bn = 0;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_batch_end(dpar_comm *comm)
{
    if (!comm || !comm->batch)
        return dpar__err(DPAR_EINVAL, "dpar_batch_end: %s", comm ? "no batch is open" : "comm is NULL");
    comm->batch = 0;
    if (comm->tp != &dpar__ops_transport) return DPAR_OK; /* its calls ran when they were made */
    return dpar__o_batch_end(comm);
}

/* >>gemm: dpar_sgemm: OpenBLAS or the built-in blocked kernel; one GEMM over a pool ------------- */
/* dpar_sgemm: OpenBLAS's cblas_sgemm under DPAR_OPENBLAS, else the built-in kernel below, the
   Goto/BLIS structure: C is computed in blocks; op(A) is packed into panels of MR rows and op(B)
   into panels of NR columns (k-major, zero-padded), so the micro-kernel streams both with unit
   stride and keeps an MR x NR tile of C in registers. On x86 the micro-kernel is AVX2 + FMA (6 x 16:
   12 accumulators, 2 loads, 1 broadcast), picked at run time whatever the program was compiled for;
   elsewhere a portable one of GCC/Clang vector extensions. Packing buffers live per thread and are
   kept (pthread key), so a steady training loop allocates nothing. */
#define DPAR__MR 6
#define DPAR__NR 16
#define DPAR__KC 256
#define DPAR__MC 144 /* multiple of MR: an A block of MC x KC floats stays in L2 */
#define DPAR__NC 2048

DPAR_API void dpar_sgemm_ref(dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha, const float *A, int lda,
                             const float *B, int ldb, float beta, float *C, int ldc)
{
    int i, j, k;
    for (i = 0; i < M; i++)
        for (j = 0; j < N; j++) {
            double acc = 0; /* the reference accumulates in double */
            for (k = 0; k < K; k++)
                acc += (double)(ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k]) *
                       (double)(tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j]);
            C[(size_t)i * ldc + j] =
                (float)(alpha * acc + (beta == 0.0f ? 0.0 : (double)beta * C[(size_t)i * ldc + j]));
        }
}

static dpar_status dpar__gemm_check(const char *api, dpar_trans ta, dpar_trans tb, int M, int N, int K, const float *A,
                                    int lda, const float *B, int ldb, const float *C, int ldc)
{
    if ((unsigned)ta > 1 || (unsigned)tb > 1)
        return dpar__err(DPAR_EINVAL, "%s: trans must be DPAR_NO_TRANS or DPAR_TRANS", api);
    if (M < 0 || N < 0 || K < 0) return dpar__err(DPAR_EINVAL, "%s: M = %d, N = %d, K = %d (negative)", api, M, N, K);
    if (lda < (ta ? (M > 1 ? M : 1) : (K > 1 ? K : 1)))
        return dpar__err(DPAR_EINVAL, "%s: lda = %d is less than the %s of op(A)", api, lda, ta ? "M" : "K");
    if (ldb < (tb ? (K > 1 ? K : 1) : (N > 1 ? N : 1)))
        return dpar__err(DPAR_EINVAL, "%s: ldb = %d is less than the %s of op(B)", api, ldb, tb ? "K" : "N");
    if (ldc < (N > 1 ? N : 1)) return dpar__err(DPAR_EINVAL, "%s: ldc = %d is less than N = %d", api, ldc, N);
    if ((M && N && !C) || (M && N && K && (!A || !B))) return dpar__err(DPAR_EINVAL, "%s: a matrix is NULL", api);
    return DPAR_OK;
}

/* ---- packing ---- */
/* op(A)[ic.., pc..] (mc x kc) into panels of MR rows: panel p holds for each k the MR values */
/* The packing loops read the source in its own row order, straight through. Reading a panel
   down its k direction instead would step one row (often a power of two: 4 KiB) per element: a new
   page and the same cache set each time, with no prefetcher to help; that made packing a third
   of the GEMM at the sizes of a training step. */
static void dpar__pack_a(dpar_trans ta, const float *A, int lda, int ic, int pc, int mc, int kc, float *dst)
{
    int p, k, i;
    if (ta) { /* op(A) = A^T: row pc+k of A holds, side by side, the k-th values of every panel */
        for (k = 0; k < kc; k++) {
            const float *a = A + (size_t)(pc + k) * lda + ic;
            for (p = 0; p < mc; p += DPAR__MR) {
                float *d = dst + (size_t)p * kc + (size_t)k * DPAR__MR;
                int mr = mc - p < DPAR__MR ? mc - p : DPAR__MR;
                for (i = 0; i < mr; i++) d[i] = a[p + i];
                for (; i < DPAR__MR; i++) d[i] = 0.0f;
            }
        }
        return;
    }
    for (p = 0; p < mc; p += DPAR__MR, dst += (size_t)DPAR__MR * kc) { /* row ic+p+i is panel p's i-th */
        int mr = mc - p < DPAR__MR ? mc - p : DPAR__MR;
        for (i = 0; i < mr; i++) {
            const float *a = A + (size_t)(ic + p + i) * lda + pc;
            for (k = 0; k < kc; k++) dst[(size_t)k * DPAR__MR + i] = a[k];
        }
        for (; i < DPAR__MR; i++)
            for (k = 0; k < kc; k++) dst[(size_t)k * DPAR__MR + i] = 0.0f;
    }
}

/* op(B)[pc.., jc..] (kc x nc) into panels of NR columns */
static void dpar__pack_b(dpar_trans tb, const float *B, int ldb, int pc, int jc, int kc, int nc, float *dst)
{
    int p, k, j;
    if (!tb) { /* row pc+k of B holds, side by side, the k-th values of every panel */
        for (k = 0; k < kc; k++) {
            const float *b = B + (size_t)(pc + k) * ldb + jc;
            for (p = 0; p + DPAR__NR <= nc; p += DPAR__NR)
                memcpy(dst + (size_t)p * kc + (size_t)k * DPAR__NR, b + p, DPAR__NR * sizeof(float));
            if (p < nc) {
                float *d = dst + (size_t)p * kc + (size_t)k * DPAR__NR;
                for (j = 0; j < nc - p; j++) d[j] = b[p + j];
                for (; j < DPAR__NR; j++) d[j] = 0.0f;
            }
        }
        return;
    }
    for (p = 0; p < nc; p += DPAR__NR, dst += (size_t)DPAR__NR * kc) { /* op(B) = B^T: row jc+p+j is column j */
        int nr = nc - p < DPAR__NR ? nc - p : DPAR__NR;
        for (j = 0; j < nr; j++) {
            const float *b = B + (size_t)(jc + p + j) * ldb + pc;
            for (k = 0; k < kc; k++) dst[(size_t)k * DPAR__NR + j] = b[k];
        }
        for (; j < DPAR__NR; j++)
            for (k = 0; k < kc; k++) dst[(size_t)k * DPAR__NR + j] = 0.0f;
    }
}

/* C (mr x nr tile at c) += alpha * acc (MR x NR, row-major) */
static void dpar__tile_add(float *c, int ldc, const float *acc, int mr, int nr, float alpha, int store)
{
    int i, j;
    for (i = 0; i < mr; i++)
        for (j = 0; j < nr; j++)
            c[(size_t)i * ldc + j] = alpha * acc[i * DPAR__NR + j] + (store ? 0.0f : c[(size_t)i * ldc + j]);
}

/* ---- micro-kernels: acc (MR x NR) = sum over k of a[k] (MR) outer b[k] (NR); then the mr x nr
   tile of C gets C += alpha acc, or C = alpha acc when `store` (the first K block with beta = 0:
   C is never read, and never cleared beforehand) ---- */
#if DPAR__SIMD
/* portable: 16-byte vectors, 6 x 4 of them (compilers with 32 vector registers keep them all) */
static void dpar__ukernel_generic(int kc, const float *a, const float *b, float *c, int ldc, float alpha, int mr,
                                  int nr, int store)
{
    dpar__v4f acc[DPAR__MR][4], bv[4];
    float out[DPAR__MR * DPAR__NR];
    int k, i, j;
    memset(acc, 0, sizeof acc);
    for (k = 0; k < kc; k++) {
        for (j = 0; j < 4; j++) memcpy(&bv[j], b + 4 * j, sizeof bv[j]);
        for (i = 0; i < DPAR__MR; i++) {
            dpar__v4f av = {a[i], a[i], a[i], a[i]};
            for (j = 0; j < 4; j++) acc[i][j] += av * bv[j];
        }
        a += DPAR__MR;
        b += DPAR__NR;
    }
    for (i = 0; i < DPAR__MR; i++)
        for (j = 0; j < 4; j++) memcpy(out + i * DPAR__NR + 4 * j, &acc[i][j], sizeof acc[i][j]);
    dpar__tile_add(c, ldc, out, mr, nr, alpha, store);
}
#else
static void dpar__ukernel_generic(int kc, const float *a, const float *b, float *c, int ldc, float alpha, int mr,
                                  int nr, int store)
{
    float out[DPAR__MR * DPAR__NR];
    int k, i, j;
    memset(out, 0, sizeof out);
    for (k = 0; k < kc; k++, a += DPAR__MR, b += DPAR__NR)
        for (i = 0; i < DPAR__MR; i++)
            for (j = 0; j < DPAR__NR; j++) out[i * DPAR__NR + j] += a[i] * b[j];
    dpar__tile_add(c, ldc, out, mr, nr, alpha, store);
}
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DPAR_NO_AVX2)
#include <immintrin.h>
#define DPAR__AVX2 1
__attribute__((target("avx2,fma"))) static void dpar__ukernel_avx2(int kc, const float *a, const float *b, float *c,
                                                                   int ldc, float alpha, int mr, int nr, int store)
{
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, b0, b1, av;
    int k;
    /* ask for the C tile now, so it is in cache when the k loop ends: C's rows are ldc apart, often a
       power of two, a stride the hardware prefetchers do not follow */
    for (k = 0; k < mr; k++) {
        _mm_prefetch((const char *)(c + (size_t)k * ldc), _MM_HINT_T0);
        _mm_prefetch((const char *)(c + (size_t)k * ldc + DPAR__NR - 1), _MM_HINT_T0);
    }
    /* clang-format off */
    for (k = 0; k < kc; k++) {
        b0 = _mm256_load_ps(b);
        b1 = _mm256_load_ps(b + 8);
        av = _mm256_broadcast_ss(a + 0); c00 = _mm256_fmadd_ps(av, b0, c00); c01 = _mm256_fmadd_ps(av, b1, c01);
        av = _mm256_broadcast_ss(a + 1); c10 = _mm256_fmadd_ps(av, b0, c10); c11 = _mm256_fmadd_ps(av, b1, c11);
        av = _mm256_broadcast_ss(a + 2); c20 = _mm256_fmadd_ps(av, b0, c20); c21 = _mm256_fmadd_ps(av, b1, c21);
        av = _mm256_broadcast_ss(a + 3); c30 = _mm256_fmadd_ps(av, b0, c30); c31 = _mm256_fmadd_ps(av, b1, c31);
        av = _mm256_broadcast_ss(a + 4); c40 = _mm256_fmadd_ps(av, b0, c40); c41 = _mm256_fmadd_ps(av, b1, c41);
        av = _mm256_broadcast_ss(a + 5); c50 = _mm256_fmadd_ps(av, b0, c50); c51 = _mm256_fmadd_ps(av, b1, c51);
        a += DPAR__MR;
        b += DPAR__NR;
    }
    if (mr == DPAR__MR && nr == DPAR__NR && store) { /* a whole tile: C = alpha * acc */
        __m256 al = _mm256_set1_ps(alpha);
#define DPAR__ROW(i, x0, x1)                                                  \
    _mm256_storeu_ps(c + (size_t)(i) * ldc, _mm256_mul_ps(al, x0)); \
    _mm256_storeu_ps(c + (size_t)(i) * ldc + 8, _mm256_mul_ps(al, x1))
        DPAR__ROW(0, c00, c01);
        DPAR__ROW(1, c10, c11);
        DPAR__ROW(2, c20, c21);
        DPAR__ROW(3, c30, c31);
        DPAR__ROW(4, c40, c41);
        DPAR__ROW(5, c50, c51);
#undef DPAR__ROW
    } else if (mr == DPAR__MR && nr == DPAR__NR) { /* a whole tile: C += alpha * acc in place */
        __m256 al = _mm256_set1_ps(alpha);
#define DPAR__ROW(i, x0, x1)                                                                                \
    _mm256_storeu_ps(c + (size_t)(i) * ldc, _mm256_fmadd_ps(al, x0, _mm256_loadu_ps(c + (size_t)(i) * ldc))); \
    _mm256_storeu_ps(c + (size_t)(i) * ldc + 8, _mm256_fmadd_ps(al, x1, _mm256_loadu_ps(c + (size_t)(i) * ldc + 8)))
        DPAR__ROW(0, c00, c01);
        DPAR__ROW(1, c10, c11);
        DPAR__ROW(2, c20, c21);
        DPAR__ROW(3, c30, c31);
        DPAR__ROW(4, c40, c41);
        DPAR__ROW(5, c50, c51);
#undef DPAR__ROW
    } else { /* an edge tile */
        float out[DPAR__MR * DPAR__NR];
        _mm256_storeu_ps(out + 0, c00); _mm256_storeu_ps(out + 8, c01);
        _mm256_storeu_ps(out + 16, c10); _mm256_storeu_ps(out + 24, c11);
        _mm256_storeu_ps(out + 32, c20); _mm256_storeu_ps(out + 40, c21);
        _mm256_storeu_ps(out + 48, c30); _mm256_storeu_ps(out + 56, c31);
        _mm256_storeu_ps(out + 64, c40); _mm256_storeu_ps(out + 72, c41);
        _mm256_storeu_ps(out + 80, c50); _mm256_storeu_ps(out + 88, c51);
        /* clang-format on */
        /* leave AVX state clean before the plain (SSE) code: GCC does not do it on this path, and with
           the upper halves left dirty the SSE code after the GEMM (packing, the allreduce's reduction,
           the optimizer) ran 3.5 times slower here (AMD EPYC, KVM) */
        _mm256_zeroupper();
        dpar__tile_add(c, ldc, out, mr, nr, alpha, store);
    }
}
/* op(B) = B^T packing with 8 x 8 register transposes: 8 source rows (8 columns of the panel) are
   read 8 values at a time and written as 8 k-rows of the panel; the same result as dpar__pack_b. */
__attribute__((target("avx2,fma"))) static void dpar__pack_bt_avx2(const float *B, int ldb, int pc, int jc, int kc,
                                                                   int nc, float *dst)
{
    int p, k, j, h;
    for (p = 0; p < nc; p += DPAR__NR, dst += (size_t)DPAR__NR * kc) {
        int nr = nc - p < DPAR__NR ? nc - p : DPAR__NR, k8 = nr == DPAR__NR ? kc / 8 * 8 : 0;
        for (h = 0; h < DPAR__NR && k8 > 0; h += 8) { /* the panel's columns h..h+7 */
            const float *b = B + (size_t)(jc + p + h) * ldb + pc;
            for (k = 0; k < k8; k += 8) {
                __m256 r0 = _mm256_loadu_ps(b + k), r1 = _mm256_loadu_ps(b + (size_t)ldb + k);
                __m256 r2 = _mm256_loadu_ps(b + 2 * (size_t)ldb + k), r3 = _mm256_loadu_ps(b + 3 * (size_t)ldb + k);
                __m256 r4 = _mm256_loadu_ps(b + 4 * (size_t)ldb + k), r5 = _mm256_loadu_ps(b + 5 * (size_t)ldb + k);
                __m256 r6 = _mm256_loadu_ps(b + 6 * (size_t)ldb + k), r7 = _mm256_loadu_ps(b + 7 * (size_t)ldb + k);
                __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
                __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
                __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
                __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
                __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
                __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
                __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
                __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
                float *d = dst + (size_t)k * DPAR__NR + h;
                _mm256_storeu_ps(d + 0 * DPAR__NR, _mm256_permute2f128_ps(u0, u4, 0x20));
                _mm256_storeu_ps(d + 1 * DPAR__NR, _mm256_permute2f128_ps(u1, u5, 0x20));
                _mm256_storeu_ps(d + 2 * DPAR__NR, _mm256_permute2f128_ps(u2, u6, 0x20));
                _mm256_storeu_ps(d + 3 * DPAR__NR, _mm256_permute2f128_ps(u3, u7, 0x20));
                _mm256_storeu_ps(d + 4 * DPAR__NR, _mm256_permute2f128_ps(u0, u4, 0x31));
                _mm256_storeu_ps(d + 5 * DPAR__NR, _mm256_permute2f128_ps(u1, u5, 0x31));
                _mm256_storeu_ps(d + 6 * DPAR__NR, _mm256_permute2f128_ps(u2, u6, 0x31));
                _mm256_storeu_ps(d + 7 * DPAR__NR, _mm256_permute2f128_ps(u3, u7, 0x31));
            }
        }
        for (j = 0; j < DPAR__NR; j++) { /* what the transposes left: the last kc % 8, an edge panel */
            const float *b = B + (size_t)(jc + p + j) * ldb + pc;
            for (k = k8; k < kc; k++) dst[(size_t)k * DPAR__NR + j] = j < nr ? b[k] : 0.0f;
        }
    }
}

static int dpar__have_avx2(void)
{
    static int have = -1; /* a benign race: every thread computes the same answer */
    int h = DPAR__LOAD(&have, DPAR__RELAXED);
    if (h < 0) {
        __builtin_cpu_init();
        h = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        DPAR__STORE(&have, h, DPAR__RELAXED);
    }
    return h;
}
#else
#define DPAR__AVX2 0
#endif

/* ---- per-thread packing buffers ---- */
static pthread_key_t dpar__gemm_key;
static pthread_once_t dpar__gemm_once = PTHREAD_ONCE_INIT;
static void dpar__gemm_buf_free(void *p) { free(p); }
static void dpar__gemm_key_init(void) { pthread_key_create(&dpar__gemm_key, dpar__gemm_buf_free); }

static float *dpar__gemm_buffers(void)
{
    float *buf;
    pthread_once(&dpar__gemm_once, dpar__gemm_key_init);
    buf = (float *)pthread_getspecific(dpar__gemm_key);
    if (!buf) {
        void *p = NULL;
        size_t bytes = ((size_t)DPAR__MC * DPAR__KC + (size_t)DPAR__KC * (DPAR__NC + DPAR__NR)) * sizeof(float);
        if (posix_memalign(&p, 64, bytes) != 0) return NULL;
        buf = (float *)p;
        pthread_setspecific(dpar__gemm_key, buf);
    }
    return buf;
}

DPAR_API dpar_status dpar_sgemm_builtin(dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha, const float *A,
                                        int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    float *apack, *bpack;
    int i, j, jc, pc, ic, jr, ir, kcb;
    void (*kernel)(int, const float *, const float *, float *, int, float, int, int, int) = dpar__ukernel_generic;
    DPAR__TRY(dpar__gemm_check("dpar_sgemm_builtin", ta, tb, M, N, K, A, lda, B, ldb, C, ldc));
    if (M == 0 || N == 0) return DPAR_OK;
    /* C = beta C first; beta 0 clears (NaN too, as BLAS) */
    if (beta != 1.0f && (beta != 0.0f || K == 0 || alpha == 0.0f))
        for (i = 0; i < M; i++)
            for (j = 0; j < N; j++) C[(size_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(size_t)i * ldc + j];
    if (K == 0 || alpha == 0.0f) return DPAR_OK;
    if (!(apack = dpar__gemm_buffers())) return dpar__err(DPAR_ENOMEM, "dpar_sgemm_builtin: out of memory");
    bpack = apack + (size_t)DPAR__MC * DPAR__KC;
#if DPAR__AVX2
    if (dpar__have_avx2()) kernel = dpar__ukernel_avx2;
#endif
    kcb = (K + DPAR__KC - 1) / DPAR__KC; /* K in equal blocks: 784 is 4 x 196, not 3 x 256 + 16 */
    kcb = (K + kcb - 1) / kcb;
    for (jc = 0; jc < N; jc += DPAR__NC) {
        int nc = N - jc < DPAR__NC ? N - jc : DPAR__NC;
        for (pc = 0; pc < K; pc += kcb) {
            int kc = K - pc < kcb ? K - pc : kcb;
#if DPAR__AVX2
            if (tb && kernel == dpar__ukernel_avx2) dpar__pack_bt_avx2(B, ldb, pc, jc, kc, nc, bpack);
            else
#endif
                dpar__pack_b(tb, B, ldb, pc, jc, kc, nc, bpack);
            for (ic = 0; ic < M; ic += DPAR__MC) {
                int mc = M - ic < DPAR__MC ? M - ic : DPAR__MC;
                dpar__pack_a(ta, A, lda, ic, pc, mc, kc, apack);
                for (jr = 0; jr < nc; jr += DPAR__NR)
                    for (ir = 0; ir < mc; ir += DPAR__MR)
                        kernel(kc, apack + (size_t)ir * kc, bpack + (size_t)jr * kc,
                               C + (size_t)(ic + ir) * ldc + jc + jr, ldc, alpha,
                               mc - ir < DPAR__MR ? mc - ir : DPAR__MR, nc - jr < DPAR__NR ? nc - jr : DPAR__NR,
                               pc == 0 && beta == 0.0f);
            }
        }
    }
    return DPAR_OK;
}

DPAR_API dpar_status dpar_sgemm(dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha, const float *A, int lda,
                                const float *B, int ldb, float beta, float *C, int ldc)
{
#ifdef DPAR_OPENBLAS
    DPAR__TRY(dpar__gemm_check("dpar_sgemm", ta, tb, M, N, K, A, lda, B, ldb, C, ldc));
    if (M == 0 || N == 0) return DPAR_OK;
    /* inside a pool thread OpenBLAS runs on this thread only: dpar owns the threads */
    if (dpar__tls_pool && openblas_get_num_threads() != 1) openblas_set_num_threads(1);
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda,
                B, ldb, beta, C, ldc);
    return DPAR_OK;
#else
    return dpar_sgemm_builtin(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

/* ---- one GEMM over the threads of a pool: C cut into row (or column) blocks ---- */
typedef struct dpar__pgemm {
    dpar_trans ta, tb;
    int M, N, K, lda, ldb, ldc, by_rows;
    float alpha, beta;
    const float *A, *B;
    float *C;
    dpar_status st[64];
} dpar__pgemm;

static void dpar__pgemm_part(void *user, int64_t begin, int64_t end, int thread)
{
    dpar__pgemm *g = (dpar__pgemm *)user;
    dpar_status st;
    int b = (int)begin, n = (int)(end - begin);
    if (g->by_rows) /* rows [b, b+n) of C: rows of op(A) */
        st = dpar_sgemm(g->ta, g->tb, n, g->N, g->K, g->alpha, g->ta ? g->A + b : g->A + (size_t)b * g->lda, g->lda,
                        g->B, g->ldb, g->beta, g->C + (size_t)b * g->ldc, g->ldc);
    else /* columns [b, b+n): columns of op(B) */
        st = dpar_sgemm(g->ta, g->tb, g->M, n, g->K, g->alpha, g->A, g->lda,
                        g->tb ? g->B + (size_t)b * g->ldb : g->B + b, g->ldb, g->beta, g->C + b, g->ldc);
    if (st != DPAR_OK && thread < 64) g->st[thread] = st;
}

DPAR_API dpar_status dpar_sgemm_pool(dpar_pool *pool, dpar_trans ta, dpar_trans tb, int M, int N, int K, float alpha,
                                     const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    dpar__pgemm g;
    int T, i, blocks;
    DPAR__TRY(dpar__gemm_check("dpar_sgemm_pool", ta, tb, M, N, K, A, lda, B, ldb, C, ldc));
    if (!pool) return dpar__err(DPAR_EINVAL, "dpar_sgemm_pool: pool is NULL");
    T = dpar_pool_num_threads(pool);
    if (M == 0 || N == 0) return DPAR_OK;
    memset(&g, 0, sizeof g);
    g.ta = ta;
    g.tb = tb;
    g.M = M;
    g.N = N;
    g.K = K;
    g.alpha = alpha;
    g.beta = beta;
    g.A = A;
    g.B = B;
    g.C = C;
    g.lda = lda;
    g.ldb = ldb;
    g.ldc = ldc;
    g.by_rows = M >= N || N < 2 * T; /* cut the larger side */
    blocks = g.by_rows ? M : N;
    if (T == 1 || blocks < 2 || (int64_t)M * N * K < 64 * 64 * 64)
        return dpar_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    DPAR__TRY(dpar_pool_for(pool, blocks, dpar__pgemm_part, &g));
    for (i = 0; i < 64; i++)
        if (g.st[i] != DPAR_OK) return g.st[i];
    return DPAR_OK;
}

/* >>shard: shard plans: scatter, gather, all-gather of row or column blocks --------------------- */
#define DPAR__SHARD_TAG 0x5348 /* "SH": the point-to-point tag of the shard helpers */

DPAR_API dpar_status dpar_shard_plan_init(dpar_shard_plan *out, const dpar_shard_plan_desc *desc)
{
    size_t rows, cols;
    int parts;
    dpar_shard_axis axis;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_shard_plan_init: plan is NULL");
    memset(out, 0, sizeof *out);
    if (!desc) return dpar__err(DPAR_EINVAL, "dpar_shard_plan_init: desc is NULL (parts is required)");
    rows = desc->rows, cols = desc->cols, parts = desc->parts, axis = desc->axis;
    if (parts < 1) return dpar__err(DPAR_EINVAL, "dpar_shard_plan_init: parts = %d (needs at least 1)", parts);
    if ((unsigned)axis > 1)
        return dpar__err(DPAR_EINVAL, "dpar_shard_plan_init: axis %d is neither rows nor cols", (int)axis);
    if (cols && rows > SIZE_MAX / cols)
        return dpar__err(DPAR_EINVAL, "dpar_shard_plan_init: %zu x %zu is too large", rows, cols);
    out->rows = rows;
    out->cols = cols;
    out->parts = parts;
    out->axis = axis;
    return DPAR_OK;
}

DPAR_API size_t dpar_shard_slice(const dpar_shard_plan *p, int rank, size_t *row0, size_t *nrows, size_t *col0,
                                 size_t *ncols)
{
    size_t r0 = 0, nr = 0, c0 = 0, nc = 0;
    if (p && rank >= 0 && rank < p->parts) {
        nr = p->rows;
        nc = p->cols;
        if (p->axis == DPAR_SHARD_ROWS) dpar_block_range(p->rows, p->parts, rank, &r0, &nr);
        else dpar_block_range(p->cols, p->parts, rank, &c0, &nc);
    }
    if (row0) *row0 = r0;
    if (nrows) *nrows = nr;
    if (col0) *col0 = c0;
    if (ncols) *ncols = nc;
    return nr * nc;
}

/* copy rank's slice between the full tensor and a contiguous shard (to_shard: full -> shard) */
static void dpar__shard_copy(const dpar_shard_plan *p, int rank, char *full, char *shard, size_t es, int to_shard)
{
    size_t r0, nr, c0, nc, i;
    dpar_shard_slice(p, rank, &r0, &nr, &c0, &nc);
    for (i = 0; i < nr; i++) {
        char *f = full + ((r0 + i) * p->cols + c0) * es, *s = shard + i * nc * es;
        if (to_shard) memcpy(s, f, nc * es);
        else memcpy(f, s, nc * es);
    }
}

static dpar_status dpar__shard_check(dpar_comm *c, const dpar_shard_plan *p, dpar_dtype t, int root, const char *api)
{
    if (!c || !p) return dpar__err(DPAR_EINVAL, "%s: comm or plan is NULL", api);
    if (!dpar_dtype_size(t)) return dpar__err(DPAR_EINVAL, "%s: dtype %d is not a dpar_dtype", api, (int)t);
    if (p->parts != c->size)
        return dpar__err(DPAR_EINVAL, "%s: the plan has %d parts but the comm %d ranks", api, p->parts, c->size);
    if (root < 0 || root >= c->size) return dpar__err(DPAR_EINVAL, "%s: root %d is not a rank", api, root);
    return DPAR_OK;
}

/* scatter (to_shards) and gather, one loop: the root moves each rank's slice between full and
   shard. A row shard is a contiguous piece of full, sent or received in place; a column shard goes
   through scratch. */
static dpar_status dpar__shard_move(dpar_comm *c, const dpar_shard_plan *p, char *full, char *shard, dpar_dtype t,
                                    int root, int to_shards, const char *api)
{
    size_t es = dpar_dtype_size(t), n;
    int r;
    dpar_status st = dpar__shard_check(c, p, t, root, api);
    if (st != DPAR_OK) return c ? dpar__bad_call(c, st) : st;
    n = dpar_shard_slice(p, c->rank, NULL, NULL, NULL, NULL);
    if ((n && !shard) || (c->rank == root && p->rows && p->cols && !full))
        return dpar__bad_call(c, dpar__err(DPAR_EINVAL, "%s: a buffer is NULL", api));
    if (c->rank != root)
        return to_shards ? dpar_recv(c, shard, n, t, root, DPAR__SHARD_TAG)
                         : dpar_send(c, shard, n, t, root, DPAR__SHARD_TAG);
    for (r = 0; r < c->size; r++) {
        size_t nr = dpar_shard_slice(p, r, NULL, NULL, NULL, NULL), r0;
        char *buf = NULL;
        if (r == root) {
            if (n) dpar__shard_copy(p, r, full, shard, es, to_shards);
            continue;
        }
        if (p->axis == DPAR_SHARD_ROWS) {
            dpar_shard_slice(p, r, &r0, NULL, NULL, NULL);
            buf = full + r0 * p->cols * es;
        } else {
            DPAR__TRY(dpar__scratch(c, nr * es, &buf));
            if (to_shards && nr) dpar__shard_copy(p, r, full, buf, es, 1);
        }
        if (to_shards) {
            DPAR__TRY(dpar_send(c, buf, nr, t, r, DPAR__SHARD_TAG));
        } else {
            DPAR__TRY(dpar_recv(c, buf, nr, t, r, DPAR__SHARD_TAG));
            if (p->axis != DPAR_SHARD_ROWS && nr) dpar__shard_copy(p, r, full, buf, es, 0);
        }
    }
    return DPAR_OK;
}

DPAR_API dpar_status dpar_shard_scatter(dpar_comm *c, const dpar_shard_plan *p, const void *full, void *shard,
                                        dpar_dtype t, int root)
{
    return dpar__shard_move(c, p, (char *)(uintptr_t)full, (char *)shard, t, root, 1, "dpar_shard_scatter");
}

DPAR_API dpar_status dpar_shard_gather(dpar_comm *c, const dpar_shard_plan *p, const void *shard, void *full,
                                       dpar_dtype t, int root)
{
    return dpar__shard_move(c, p, (char *)full, (char *)(uintptr_t)shard, t, root, 0, "dpar_shard_gather");
}

/* all-gather with the blocks of the plan: by rows straight into full (each shard is a contiguous
   piece of it); by columns into the concatenated shards in scratch, then each slice into place */
DPAR_API dpar_status dpar_shard_allgather(dpar_comm *c, const dpar_shard_plan *p, const void *shard, void *full,
                                          dpar_dtype t)
{
    size_t es = dpar_dtype_size(t), total, *layout, off = 0;
    char *dst, *scr = NULL;
    int r;
    dpar__call call;
    dpar_status st = dpar__shard_check(c, p, t, 0, "dpar_shard_allgather");
    if (st != DPAR_OK) return c ? dpar__bad_call(c, st) : st;
    total = p->rows * p->cols;
    if ((total && !full) || (dpar_shard_slice(p, c->rank, NULL, NULL, NULL, NULL) && !shard))
        return dpar__bad_call(c, dpar__err(DPAR_EINVAL, "dpar_shard_allgather: a buffer is NULL"));
    layout = (size_t *)dpar__alloc(&c->allocator, 2 * (size_t)c->size * sizeof(size_t));
    if (!layout) return dpar__err(DPAR_ENOMEM, "dpar_shard_allgather: out of memory");
    for (r = 0; r < c->size; r++) { /* block r: where rank r's shard goes in the gathered buffer */
        layout[c->size + r] = dpar_shard_slice(p, r, NULL, NULL, NULL, NULL);
        layout[r] = off;
        off += layout[c->size + r];
    }
    dst = (char *)full;
    if (p->axis == DPAR_SHARD_COLS && c->size > 1) {
        st = dpar__scratch(c, total * es, &scr);
        dst = scr;
    }
    if (st == DPAR_OK) {
        if (dst + layout[c->rank] * es != (const char *)shard && layout[c->size + c->rank])
            memcpy(dst + layout[c->rank] * es, shard, layout[c->size + c->rank] * es);
        call = dpar__call_make(DPAR_COLL_ALLGATHER, dst + layout[c->rank] * es, dst, total, t, DPAR_SUM, 0,
                               "dpar_shard_allgather", 0);
        call.offs = layout;
        call.lens = layout + c->size;
        st = dpar__collective(c, &call, "dpar_shard_allgather");
    }
    if (st == DPAR_OK && scr)
        for (r = 0; r < c->size; r++) dpar__shard_copy(p, r, (char *)full, scr + layout[r] * es, es, 0);
    dpar__free(&c->allocator, layout);
    return st;
}

/* >>tp: tensor-parallel linear layers (column and row parallel, Megatron) ----------------------- */
static dpar_status dpar__gemm_on(dpar_pool *pool, dpar_trans ta, dpar_trans tb, int M, int N, int K, const float *A,
                                 int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    return pool ? dpar_sgemm_pool(pool, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc)
                : dpar_sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
}

/* rank r's part of a dimension cut over N ranks: dpar_block_range's block, or with L leaves the whole leaves of block
   r of dpar_block_range(L, N, r) */
static void dpar__linear_cut(int dim, int N, int r, int L, size_t *off, size_t *len)
{
    size_t first, count, end, ignored;
    if (!L) {
        dpar_block_range((size_t)dim, N, r, off, len);
        return;
    }
    dpar_block_range((size_t)L, N, r, &first, &count);
    dpar_block_range((size_t)dim, L, (int)first, off, &ignored);
    if (first + count < (size_t)L) dpar_block_range((size_t)dim, L, (int)(first + count), &end, &ignored);
    else end = (size_t)dim;
    *len = end - *off;
}

/* the leaves' partial products of a sum over a cut dimension of `dim` (the forward's over in: ta = NO_TRANS, partial
   q = a[:, leaf q] w[leaf q, :]; the input gradient's over out: partial q = a[:, leaf q] w[:, leaf q]^T), this rank's
   leaves computed into their slots of l->scratch (rows x cols each), the others' all-gathered (a parallel layer
   whose comm cuts this dimension), then added in dpar_tree_reduce's tree into c */
static dpar_status dpar__linear_leaves(dpar_linear *l, int over_out, const float *a, int lda, int rows, int cols,
                                       float *c)
{
    int L = l->leaves, dim = over_out ? l->out : l->in,
        cut = l->mode == (over_out ? DPAR_LINEAR_COLUMN : DPAR_LINEAR_ROW);
    int local_offset = over_out ? l->out_offset : l->in_offset, N = cut ? l->comm->size : 1,
        r = cut ? l->comm->rank : 0;
    size_t block = (size_t)rows * (size_t)cols, at_parts = ((size_t)L * block + 1) & ~(size_t)1; /* 8-byte aligned */
    size_t need = at_parts + 2 * (size_t)L, first, count, q;
    const void **parts;
    if (need > l->scratch_floats) { /* the first call, or a larger batch: grown once, kept */
        float *grown = (float *)dpar__alloc(&l->allocator, need * sizeof(float));
        if (!grown) return dpar__err(DPAR_ENOMEM, "dpar_linear: out of memory for the leaves' partial products");
        dpar__free(&l->allocator, l->scratch);
        l->scratch = grown;
        l->scratch_floats = need;
    }
    parts = (const void **)(void *)(l->scratch + at_parts); /* the L pointers after the partials */
    dpar_block_range((size_t)L, N, r, &first, &count);
    for (q = first; q < first + count; q++) {
        size_t off, len, at;
        dpar_block_range((size_t)dim, L, (int)q, &off, &len);
        at = off - (size_t)local_offset; /* where the leaf starts in this rank's part of the dimension */
        if (over_out)
            DPAR__TRY(dpar_sgemm_builtin(DPAR_NO_TRANS, DPAR_TRANS, rows, cols, (int)len, 1.0f, a + at, lda, l->w + at,
                                         l->out_local, 0.0f, l->scratch + q * block, cols));
        else
            DPAR__TRY(dpar_sgemm_builtin(DPAR_NO_TRANS, DPAR_NO_TRANS, rows, cols, (int)len, 1.0f, a + at, lda,
                                         l->w + at * (size_t)l->out_local, l->out_local, 0.0f, l->scratch + q * block,
                                         cols));
    }
    if (cut && N > 1) /* every rank's leaves: equal blocks (N divides L), mine in place */
        DPAR__TRY(dpar_allgather(l->comm, l->scratch + first * block, l->scratch, (size_t)L * block, DPAR_F32));
    for (q = 0; q < (size_t)L; q++) parts[q] = l->scratch + q * block;
    return dpar_tree_reduce(c, parts, L, block, DPAR_F32, DPAR_SUM);
}

DPAR_API dpar_status dpar_linear_init(dpar_linear *l, const dpar_linear_desc *desc)
{
    int N = 1, r = 0, in, out, has_bias;
    size_t off, len, nw;
    dpar_linear_mode mode;
    dpar_comm *comm;
    if (!l) return dpar__err(DPAR_EINVAL, "dpar_linear_init: layer is NULL");
    memset(l, 0, sizeof *l);
    if (!desc) return dpar__err(DPAR_EINVAL, "dpar_linear_init: desc is NULL (in and out are required)");
    mode = desc->mode, in = desc->in, out = desc->out, has_bias = !desc->no_bias, comm = desc->comm;
    if ((unsigned)mode > 2) return dpar__err(DPAR_EINVAL, "dpar_linear_init: mode %d", (int)mode);
    if (in < 1 || out < 1) return dpar__err(DPAR_EINVAL, "dpar_linear_init: in = %d, out = %d", in, out);
    if (mode != DPAR_LINEAR_FULL && !comm)
        return dpar__err(DPAR_EINVAL, "dpar_linear_init: a parallel layer needs its comm");
    if (desc->leaves < 0 || desc->leaves > 4096 ||
        (desc->leaves && mode != DPAR_LINEAR_FULL && desc->leaves % comm->size) || (desc->leaves && desc->pool))
        return dpar__err(DPAR_EINVAL,
                         "dpar_linear_init: leaves = %d (0..4096, a multiple of the tp ranks (%d), and no pool: the "
                         "bitwise mode runs dpar_sgemm_builtin on the calling thread)",
                         desc->leaves, mode != DPAR_LINEAR_FULL ? comm->size : 1);
    DPAR__TRY(dpar__check_allocator("dpar_linear_init", &desc->allocator));
    l->allocator = desc->allocator;
    if (mode != DPAR_LINEAR_FULL) {
        N = comm->size;
        r = comm->rank;
    }
    l->mode = mode;
    l->in = in;
    l->out = out;
    l->comm = mode == DPAR_LINEAR_FULL ? NULL : comm;
    l->pool = desc->pool;
    l->in_local = in;
    l->out_local = out;
    l->leaves = desc->leaves;
    if (mode == DPAR_LINEAR_COLUMN) {
        dpar__linear_cut(out, N, r, l->leaves, &off, &len);
        l->out_offset = (int)off;
        l->out_local = (int)len;
    } else if (mode == DPAR_LINEAR_ROW) {
        dpar__linear_cut(in, N, r, l->leaves, &off, &len);
        l->in_offset = (int)off;
        l->in_local = (int)len;
    }
    l->bias_local = has_bias ? (mode == DPAR_LINEAR_COLUMN ? l->out_local : out) : 0;
    nw = (size_t)l->in_local * (size_t)l->out_local;
    l->w = (float *)dpar__calloc(&l->allocator, nw + 1, sizeof(float));
    l->dw = (float *)dpar__calloc(&l->allocator, nw + 1, sizeof(float));
    l->b = (float *)dpar__calloc(&l->allocator, (size_t)l->bias_local + 1, sizeof(float));
    l->db = (float *)dpar__calloc(&l->allocator, (size_t)l->bias_local + 1, sizeof(float));
    if (!l->w || !l->dw || !l->b || !l->db) {
        dpar_linear_destroy(l);
        return dpar__err(DPAR_ENOMEM, "dpar_linear_init: out of memory");
    }
    if (!has_bias) {
        dpar__free(&l->allocator, l->b);
        dpar__free(&l->allocator, l->db);
        l->b = l->db = NULL;
    }
    return DPAR_OK;
}

DPAR_API dpar_status dpar_linear_set_weights(dpar_linear *l, const float *w_full, const float *b_full)
{
    int i;
    if (!l || !l->w || !w_full) return dpar__err(DPAR_EINVAL, "dpar_linear_set_weights: layer or w_full is NULL");
    for (i = 0; i < l->in_local; i++) /* W is (in x out): my rows and columns of it */
        memcpy(l->w + (size_t)i * l->out_local, w_full + (size_t)(l->in_offset + i) * l->out + l->out_offset,
               (size_t)l->out_local * sizeof(float));
    if (l->b && b_full)
        memcpy(l->b, b_full + (l->mode == DPAR_LINEAR_COLUMN ? l->out_offset : 0),
               (size_t)l->bias_local * sizeof(float));
    return DPAR_OK;
}

DPAR_API dpar_status dpar_linear_forward(dpar_linear *l, const float *x, float *y, int batch)
{
    int i, j;
    if (!l || !l->w || !x || !y || batch < 0) return dpar__err(DPAR_EINVAL, "dpar_linear_forward: bad argument");
    if (l->leaves && batch > 0) { /* the sum over in: the leaves' partials in the fixed tree */
        DPAR__TRY(dpar__linear_leaves(l, 0, x, l->in_local, batch, l->out_local, y));
    } else {
        /* y (batch, out_local) = x (batch, in_local) W (in_local, out_local) */
        DPAR__TRY(dpar__gemm_on(l->pool, DPAR_NO_TRANS, DPAR_NO_TRANS, batch, l->out_local, l->in_local, x, l->in_local,
                                l->w, l->out_local, 0.0f, y, l->out_local));
        if (l->mode == DPAR_LINEAR_ROW) /* partial sums over my input rows: add them up */
            DPAR__TRY(dpar_allreduce(l->comm, y, y, (size_t)batch * (size_t)l->out, DPAR_F32, DPAR_SUM));
    }
    if (l->b)
        for (i = 0; i < batch; i++)
            for (j = 0; j < l->out_local; j++) y[(size_t)i * l->out_local + j] += l->b[j];
    return DPAR_OK;
}

DPAR_API dpar_status dpar_linear_backward(dpar_linear *l, const float *x, const float *dy, float *dx, int batch)
{
    int i, j;
    if (!l || !l->w || !x || !dy || batch < 0) return dpar__err(DPAR_EINVAL, "dpar_linear_backward: bad argument");
    /* dW (in_local, out_local) += x^T (in_local, batch) dy (batch, out_local) */
    if (l->leaves)
        DPAR__TRY(dpar_sgemm_builtin(DPAR_TRANS, DPAR_NO_TRANS, l->in_local, l->out_local, batch, 1.0f, x, l->in_local,
                                     dy, l->out_local, 1.0f, l->dw, l->out_local));
    else
        DPAR__TRY(dpar__gemm_on(l->pool, DPAR_TRANS, DPAR_NO_TRANS, l->in_local, l->out_local, batch, x, l->in_local,
                                dy, l->out_local, 1.0f, l->dw, l->out_local));
    if (l->db)
        for (i = 0; i < batch; i++)
            for (j = 0; j < l->out_local; j++) l->db[j] += dy[(size_t)i * l->out_local + j];
    if (!dx) return DPAR_OK;
    if (l->leaves) /* the sum over out: the leaves' partials in the fixed tree (COLUMN: all-gathered) */
        return batch > 0 ? dpar__linear_leaves(l, 1, dy, l->out_local, batch, l->in_local, dx) : DPAR_OK;
    /* dx (batch, in_local) = dy (batch, out_local) W^T (out_local, in_local) */
    DPAR__TRY(dpar__gemm_on(l->pool, DPAR_NO_TRANS, DPAR_TRANS, batch, l->in_local, l->out_local, dy, l->out_local,
                            l->w, l->out_local, 0.0f, dx, l->in_local));
    if (l->mode == DPAR_LINEAR_COLUMN) /* each rank saw only its outputs: the input's gradient adds up */
        DPAR__TRY(dpar_allreduce(l->comm, dx, dx, (size_t)batch * (size_t)l->in, DPAR_F32, DPAR_SUM));
    return DPAR_OK;
}

DPAR_API void dpar_linear_zero_grad(dpar_linear *l)
{
    if (!l || !l->dw) return;
    memset(l->dw, 0, (size_t)l->in_local * (size_t)l->out_local * sizeof(float));
    if (l->db) memset(l->db, 0, (size_t)l->bias_local * sizeof(float));
}

DPAR_API dpar_status dpar_linear_destroy(dpar_linear *l)
{
    if (!l) return DPAR_OK;
    dpar__free(&l->allocator, l->w);
    dpar__free(&l->allocator, l->dw);
    dpar__free(&l->allocator, l->b);
    dpar__free(&l->allocator, l->db);
    dpar__free(&l->allocator, l->scratch);
    memset(l, 0, sizeof *l);
    return DPAR_OK;
}

/* >>zero: ZeRO-1: sharded optimizer state ------------------------------------------------------- */
/* a list of tensors (dpar_tensor): checked, and numbered one after the other: tensor i is [start[i], start[i + 1]) */
static dpar_status dpar__tensors_check(const char *fn, const char *what, const dpar_tensor *t, int n, dpar_dtype want,
                                       size_t *total)
{
    int i, j;
    size_t sz = dpar_dtype_size(want), sum = 0;
    if (n < 0 || (n > 0 && !t)) return dpar__err(DPAR_EINVAL, "%s: %s: %d tensors at %p", fn, what, n, (const void *)t);
    for (i = 0; i < n; i++) {
        if (!t[i].data || !t[i].count)
            return dpar__err(DPAR_EINVAL, "%s: %s tensor %d: %s", fn, what, i,
                             !t[i].data ? "data is NULL" : "count is 0");
        if (t[i].dtype != want)
            return dpar__err(DPAR_EINVAL, "%s: %s tensor %d is %s; this object works in %s", fn, what, i,
                             dpar_dtype_name(t[i].dtype), dpar_dtype_name(want));
        if (t[i].count > ((size_t)-1 - sum) / sz)
            return dpar__err(DPAR_EINVAL, "%s: %s: the tensors' sizes overflow", fn, what);
        sum += t[i].count;
        for (j = 0; j < i; j++) /* once, at create: n^2 / 2 comparisons */
            if (dpar__overlap(t[i].data, t[i].count * sz, t[j].data, t[j].count * sz))
                return dpar__err(DPAR_EINVAL, "%s: %s tensors %d and %d overlap", fn, what, j, i);
    }
    if (total) *total = sum;
    return DPAR_OK;
}
/* the tensor holding element x of the numbering (start: n + 1 offsets) */
static int dpar__tensor_at(const size_t *start, int n, size_t x)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (start[mid] <= x) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}
/* copy elements [lo, hi) of the numbering between the tensors and flat[0, hi - lo) (in: tensors to flat) */
static void dpar__tensors_copy(const dpar_tensor *t, const size_t *start, int n, float *flat, size_t lo, size_t hi,
                               int in)
{
    int i = lo < hi ? dpar__tensor_at(start, n, lo) : n;
    for (; i < n && start[i] < hi; i++) {
        size_t a = start[i] > lo ? start[i] : lo, e = start[i + 1] < hi ? start[i + 1] : hi;
        float *at = (float *)t[i].data + (a - start[i]);
        if (in) memcpy(flat + (a - lo), at, (e - a) * sizeof(float));
        else memcpy(at, flat + (a - lo), (e - a) * sizeof(float));
    }
}
/* the numbering's offsets of a checked list: n + 1 of them */
static size_t *dpar__tensors_number(const dpar_allocator *a, const dpar_tensor *t, int n)
{
    size_t *start = (size_t *)dpar__calloc(a, (size_t)n + 1, sizeof(size_t));
    int i;
    for (i = 0; start && i < n; i++) start[i + 1] = start[i] + t[i].count;
    return start;
}

/* one optimizer step on the host (dpar_optim_update's math): dpar_zero's, dpar_fsdp's */
static void dpar__optim_apply(const dpar_optim_update *u)
{
    float *p = u->params, *m = u->m, *v = u->v;
    const float *g = u->grads;
    size_t i;
    if (u->kind == DPAR_OPTIM_SGD) {
        float lr = u->lr, mu = u->momentum, wd = u->weight_decay;
        for (i = 0; i < u->n; i++) {
            float gi = g[i] + wd * p[i];
            m[i] = mu * m[i] + gi;
            p[i] -= lr * m[i];
        }
    } else {
        float lr = u->lr, b1 = u->beta1, b2 = u->beta2, eps = u->eps, wd = u->weight_decay;
        float c1 = 1.0f - powf(b1, (float)u->step), c2 = 1.0f - powf(b2, (float)u->step);
        for (i = 0; i < u->n; i++) {
            m[i] = b1 * m[i] + (1.0f - b1) * g[i];
            v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
            p[i] -= lr * ((m[i] / c1) / (sqrtf(v[i] / c2) + eps) + wd * p[i]);
        }
    }
}

/* the optimizer's constants from a desc (dpar_zero_desc, dpar_fsdp_desc: the same fields, defaults applied) */
#define DPAR__OPTIM_HYPER(h, d)                                                                                       \
    ((h).kind = (d).kind, (h).lr = (d).lr, (h).momentum = (d).momentum, (h).beta1 = (d).beta1, (h).beta2 = (d).beta2, \
     (h).eps = (d).eps, (h).weight_decay = (d).weight_decay)

/* dpar_zero and dpar_fsdp on a comm whose buffers are device memory (dpar_comm_memory): their buffers
   made, cleared, copied, added and stepped through its callbacks; a failing callback poisons the comm */
static const dpar_comm_memory *dpar__dev(const dpar_comm *c)
{
    return c->desc.memory.reduce ? &c->desc.memory : c->ops_memory.reduce ? &c->ops_memory : NULL;
}
/* the device can run them (fn: the caller, what: the part it was asked for that the device path lacks, or NULL) */
static dpar_status dpar__dev_check(const dpar_comm *c, const char *fn, const char *what)
{
    const dpar_comm_memory *m = dpar__dev(c);
    if (m && !m->update)
        return dpar__err(DPAR_EUNSUPPORTED,
                         "%s: the comm's buffers are device memory and its dpar_comm_memory has no "
                         "clear and update callbacks",
                         fn);
    if (m && what) return dpar__err(DPAR_EUNSUPPORTED, "%s: %s on device memory (f32 flat arrays only)", fn, what);
    return DPAR_OK;
}
static void *dpar__dev_alloc(dpar_comm *c, size_t bytes) /* cleared */
{
    const dpar_comm_memory *m = dpar__dev(c);
    void *p = m->alloc(m->user, c->worker, bytes ? bytes : 1);
    if (p && m->clear(m->user, c->worker, p, bytes) != DPAR_OK) {
        m->free(m->user, c->worker, p);
        return NULL;
    }
    return p;
}
static void dpar__dev_free(dpar_comm *c, void *p)
{
    const dpar_comm_memory *m = dpar__dev(c);
    if (p) m->free(m->user, c->worker, p);
}
/* a callback's status; first (with `enter`) the device's earlier work on the buffers ordered before what comes */
static dpar_status dpar__dev_result(dpar_comm *c, dpar_status st) { return st == DPAR_OK ? st : dpar__bad_call(c, st); }
static dpar_status dpar__dev_enter(dpar_comm *c, const dpar_comm_memory *m)
{
    return m->enter ? dpar__dev_result(c, m->enter(m->user, c->worker)) : DPAR_OK;
}
static dpar_status dpar__dev_clear(dpar_comm *c, void *p, size_t bytes)
{
    const dpar_comm_memory *m = dpar__dev(c);
    if (!m) return memset(p, 0, bytes), DPAR_OK;
    DPAR__TRY(dpar__dev_enter(c, m));
    return dpar__dev_result(c, m->clear(m->user, c->worker, p, bytes));
}
static dpar_status dpar__dev_copy(dpar_comm *c, void *dst, const void *src, size_t bytes)
{
    const dpar_comm_memory *m = dpar__dev(c);
    if (!m) return memcpy(dst, src, bytes), DPAR_OK;
    DPAR__TRY(dpar__dev_enter(c, m));
    return dpar__dev_result(c, m->copy(m->user, c->worker, dst, src, bytes));
}
static dpar_status dpar__dev_add(dpar_comm *c, float *out, const float *in, size_t n) /* out += in (device only) */
{
    const dpar_comm_memory *m = dpar__dev(c);
    DPAR__TRY(dpar__dev_enter(c, m));
    return dpar__dev_result(c, m->reduce(m->user, c->worker, out, out, in, n, DPAR_F32, DPAR_SUM, 0));
}
static dpar_status dpar__dev_update(dpar_comm *c, const dpar_optim_update *u)
{
    const dpar_comm_memory *m = dpar__dev(c);
    if (!m) return dpar__optim_apply(u), DPAR_OK;
    DPAR__TRY(dpar__dev_enter(c, m));
    return dpar__dev_result(c, m->update(m->user, c->worker, u));
}
/* checkpoints of state in device memory: a piece to its host copy, or back (after the device's earlier work). A
   failure does not poison the comm: the caller's agreement (dpar__ckpt_agree) tells every rank, also on a library's
   comm, whose poison is the rank's own and would leave the others waiting */
static dpar_status dpar__dev_host(dpar_comm *c, int to_host, void *host, void *dev, size_t bytes)
{
    const dpar_comm_memory *m = dpar__dev(c);
    dpar_status st;
    if (!bytes) return DPAR_OK;
    st = m->enter ? m->enter(m->user, c->worker) : DPAR_OK;
    if (st != DPAR_OK) return st;
    return to_host ? m->to_host(m->user, c->worker, host, dev, bytes)
                   : m->from_host(m->user, c->worker, dev, host, bytes);
}
/* the device can take a checkpoint (DPAR_OK on host memory) */
static dpar_status dpar__dev_ckpt_check(const dpar_comm *c, const char *api)
{
    const dpar_comm_memory *m = dpar__dev(c);
    if (m && !m->to_host)
        return dpar__err(DPAR_EUNSUPPORTED,
                         "%s: the state is in device memory and the comm's dpar_comm_memory has no to_host and "
                         "from_host callbacks to stage it through host memory",
                         api);
    return DPAR_OK;
}

struct dpar_zero {
    dpar_comm *comm;
    dpar_zero_desc d;
    size_t count, off, len;
    float *m, *v; /* SGD: m is the momentum; Adam: the two moments. len floats each (device memory: the comm's) */
    long step;
    dpar_optim_update hyper; /* the optimizer's constants */
    dpar_tensor *tp, *tg;    /* the tensor form: the parameters and gradients (nt each), numbered by tstart */
    size_t *tstart;
    int nt;
    float *stage; /* the tensor form: count floats, the gradients then the parameters, contiguous */
};

DPAR_API dpar_status dpar_zero_create(const dpar_zero_desc *desc, dpar_zero **out)
{
    dpar_zero *z;
    dpar_comm *dp;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_zero_create: out is NULL");
    *out = NULL;
    if (!desc || !desc->comm) return dpar__err(DPAR_EINVAL, "dpar_zero_create: desc or desc->comm is NULL");
    dp = desc->comm;
    if ((unsigned)desc->kind > 1) return dpar__err(DPAR_EINVAL, "dpar_zero_create: kind %d", (int)desc->kind);
    if (!(desc->lr > 0))
        return dpar__err(DPAR_EINVAL, "dpar_zero_create: lr = %g (must be positive)", (double)desc->lr);
    DPAR__TRY(dpar__dev_check(dp, "dpar_zero_create",
                              desc->num_tensors || desc->params || desc->grads ? "the tensor form" : NULL));
    DPAR__TRY(dpar__check_allocator("dpar_zero_create", &desc->allocator));
    z = (dpar_zero *)dpar__calloc(&desc->allocator, 1, sizeof *z);
    if (!z) return dpar__err(DPAR_ENOMEM, "dpar_zero_create: out of memory");
    z->comm = dp;
    z->d = *desc;
    if (z->d.beta1 == 0) z->d.beta1 = 0.9f;
    if (z->d.beta2 == 0) z->d.beta2 = 0.999f;
    if (z->d.eps == 0) z->d.eps = 1e-8f;
    z->count = desc->count;
    z->d.params = z->d.grads = NULL;
    DPAR__OPTIM_HYPER(z->hyper, z->d);
    if (desc->num_tensors || desc->params || desc->grads) { /* the tensor form */
        size_t total = 0, gtotal = 0;
        int i, n = desc->num_tensors;
        dpar_status st = dpar__tensors_check("dpar_zero_create", "params", desc->params, n, DPAR_F32, &total);
        if (st == DPAR_OK) st = dpar__tensors_check("dpar_zero_create", "grads", desc->grads, n, DPAR_F32, &gtotal);
        for (i = 0; st == DPAR_OK && i < n; i++)
            if (desc->grads[i].count != desc->params[i].count)
                st = dpar__err(DPAR_EINVAL, "dpar_zero_create: grads tensor %d has %zu elements, its parameter %zu", i,
                               desc->grads[i].count, desc->params[i].count);
        if (st == DPAR_OK && n < 1) st = dpar__err(DPAR_EINVAL, "dpar_zero_create: num_tensors is %d", n);
        if (st == DPAR_OK && desc->count && desc->count != total)
            st = dpar__err(DPAR_EINVAL, "dpar_zero_create: count is %zu, the tensors hold %zu", desc->count, total);
        if (st == DPAR_OK) /* one list of both: a gradient must not overlap any parameter either */
            for (i = 0; st == DPAR_OK && i < n; i++) {
                int j;
                for (j = 0; j < n; j++)
                    if (dpar__overlap(desc->grads[i].data, desc->grads[i].count * 4, desc->params[j].data,
                                      desc->params[j].count * 4)) {
                        st =
                            dpar__err(DPAR_EINVAL, "dpar_zero_create: grads tensor %d overlaps params tensor %d", i, j);
                        break;
                    }
            }
        if (st != DPAR_OK) {
            dpar__free(&desc->allocator, z);
            return st;
        }
        z->count = total;
        z->nt = n;
        z->tp = (dpar_tensor *)dpar__calloc(&desc->allocator, (size_t)n, sizeof(dpar_tensor));
        z->tg = (dpar_tensor *)dpar__calloc(&desc->allocator, (size_t)n, sizeof(dpar_tensor));
        z->tstart = dpar__tensors_number(&desc->allocator, desc->params, n);
        z->stage = (float *)dpar__calloc(&desc->allocator, total, sizeof(float));
        if (!z->tp || !z->tg || !z->tstart || !z->stage) {
            dpar_zero_destroy(z);
            return dpar__err(DPAR_ENOMEM, "dpar_zero_create: out of memory");
        }
        memcpy(z->tp, desc->params, (size_t)n * sizeof(dpar_tensor));
        memcpy(z->tg, desc->grads, (size_t)n * sizeof(dpar_tensor));
    }
    dpar_block_range(z->count, dp->size, dp->rank, &z->off, &z->len);
    if (dpar__dev(dp)) { /* the state beside the parameters, in the comm's device memory */
        z->m = (float *)dpar__dev_alloc(dp, (z->len + 1) * sizeof(float));
        if (desc->kind == DPAR_OPTIM_ADAM) z->v = (float *)dpar__dev_alloc(dp, (z->len + 1) * sizeof(float));
    } else {
        z->m = (float *)dpar__calloc(&desc->allocator, z->len + 1, sizeof(float));
        if (desc->kind == DPAR_OPTIM_ADAM) z->v = (float *)dpar__calloc(&desc->allocator, z->len + 1, sizeof(float));
    }
    if (!z->m || (desc->kind == DPAR_OPTIM_ADAM && !z->v)) {
        dpar_zero_destroy(z);
        return dpar__err(DPAR_ENOMEM, "dpar_zero_create: out of memory");
    }
    *out = z;
    return DPAR_OK;
}

/* the optimizer on n elements of this rank's block, from element `at` of it (m, v: the state there) */
static dpar_status dpar__zero_update(dpar_zero *z, float *p, const float *g, size_t at, size_t n)
{
    dpar_optim_update u = z->hyper;
    u.step = z->step;
    u.params = p;
    u.grads = g;
    u.m = z->m + at;
    u.v = z->v ? z->v + at : NULL;
    u.n = n;
    return dpar__dev_update(z->comm, &u);
}

DPAR_API dpar_status dpar_zero_step(dpar_zero *z, float *params, float *grads)
{
    if (!z || (z->count && (!params || !grads) && !(z->tp && !params && !grads)))
        return dpar__err(DPAR_EINVAL, "dpar_zero_step: a pointer is NULL%s",
                         z && !z->tp ? " (only the tensor form steps on NULL, NULL)" : "");
    if (z->tp && !params) { /* the tensor form: the same collectives on the staging array */
        size_t lo = z->off, hi = z->off + z->len;
        int i;
        dpar__tensors_copy(z->tg, z->tstart, z->nt, z->stage, 0, z->count, 1);
        DPAR__TRY(dpar_reduce_scatter(z->comm, z->stage, z->stage + z->off, z->count, DPAR_F32, DPAR_AVG));
        z->step++;
        for (i = lo < hi ? dpar__tensor_at(z->tstart, z->nt, lo) : z->nt; i < z->nt && z->tstart[i] < hi; i++) {
            size_t a = z->tstart[i] > lo ? z->tstart[i] : lo, e = z->tstart[i + 1] < hi ? z->tstart[i + 1] : hi;
            float *p = (float *)z->tp[i].data + (a - z->tstart[i]);
            DPAR__TRY(dpar__zero_update(z, p, z->stage + a, a - lo, e - a));
            memcpy(z->stage + a, p, (e - a) * sizeof(float)); /* my block of the parameters, for the all-gather */
        }
        DPAR__TRY(dpar_allgather(z->comm, z->stage + z->off, z->stage, z->count, DPAR_F32));
        dpar__tensors_copy(z->tp, z->tstart, z->nt, z->stage, 0, lo, 0); /* the others' blocks */
        dpar__tensors_copy(z->tp, z->tstart, z->nt, z->stage + hi, hi, z->count, 0);
        return DPAR_OK;
    }
    /* my block of the averaged gradient, in place: grads + off */
    DPAR__TRY(dpar_reduce_scatter(z->comm, grads, grads + z->off, z->count, DPAR_F32, DPAR_AVG));
    z->step++;
    DPAR__TRY(dpar__zero_update(z, params + z->off, grads + z->off, 0, z->len));
    /* everyone's blocks of the parameters, in place */
    return dpar_allgather(z->comm, params + z->off, params, z->count, DPAR_F32);
}

DPAR_API size_t dpar_zero_state_bytes(const dpar_zero *z)
{
    return z ? z->len * sizeof(float) * (z->d.kind == DPAR_OPTIM_ADAM ? 2u : 1u) : 0;
}

DPAR_API void dpar_zero_shard(const dpar_zero *z, size_t *offset, size_t *length)
{
    if (offset) *offset = z ? z->off : 0;
    if (length) *length = z ? z->len : 0;
}

DPAR_API dpar_status dpar_zero_destroy(dpar_zero *z)
{
    dpar_allocator a;
    if (!z) return DPAR_OK;
    a = z->d.allocator;
    if (dpar__dev(z->comm)) {
        dpar__dev_free(z->comm, z->m);
        dpar__dev_free(z->comm, z->v);
    } else {
        dpar__free(&a, z->m);
        dpar__free(&a, z->v);
    }
    dpar__free(&a, z->tp);
    dpar__free(&a, z->tg);
    dpar__free(&a, z->tstart);
    dpar__free(&a, z->stage);
    dpar__free(&a, z);
    return DPAR_OK;
}

/* >>fsdp: ZeRO-2 and ZeRO-3 (FSDP): sharded by unit ----------------------------------------------- */
/* The shards are always fp32: p (this rank's block of each unit: the master weights; absent at stage 2 in f32,
   where the full copy is the master), g (its gradient), m and v (the optimizer's). What the caller sees is in
   the compute type (ces bytes an element). */
struct dpar_fsdp {
    dpar_comm *comm;
    dpar_fsdp_desc d;
    int U, stage;
    dpar_dtype ct, rt;                       /* compute and reduction types */
    size_t ces;                              /* bytes of a compute element */
    size_t *count, *off, *len, *soff, *foff; /* per unit: size; this rank's block in it; the block in the shards;
                                                stage 2: the unit in `full` (elements) */
    unsigned char *fresh;                    /* per unit: no gradient reduced into the shard since the last step */
    size_t slen, maxc, maxlen, total;        /* the shards' length; the largest unit and block; all parameters */
    float *p, *g, *m, *v;                    /* shards: parameters (master), gradients, optimizer state */
    void *full;                              /* stage 2: every unit's full parameters, in the compute type */
    void *buf[2];                            /* stage 3: the two pooled unit buffers (compute type), both in one
                                                arena of the two largest units (cap elements): buf[0] at its start,
                                                buf[1] flush with its end (it moves with what it holds) */
    size_t cap;
    void *send[2];         /* stage 3, 16-bit: this rank's block converted, per buffer */
    int held[2], taken[2]; /* the unit in buf[i] (-1: none); taken: gathered by the caller */
    dpar_request *req;     /* the prefetch in flight, into buf[req_slot] */
    int req_slot, no_async, last;
    void *gbuf;              /* the gradients of unit gunit (-1: none): buf[gslot] when that was free (stage 3), else
                                the third buffer gbuf (stage 2: made at create; stage 3: at the first need, kept) */
    int gslot;               /* 0 or 1: the gradients are in buf[gslot] (held[gslot] = -2); 2: in gbuf */
    float *gwide;            /* 16-bit compute reduced in f32: the gradients widened */
    int gunit, bad, dynamic; /* bad: an inf or NaN gradient on this rank this step */
    float scale;
    long good, skipped;
    size_t bytes;
    long step;
    int dev; /* the buffers below the tables (p, g, m, v, full, buf, gbuf) are the comm's device memory */
    dpar_optim_update hyper; /* the optimizer's constants */
    /* the tensor form: the params and grads lists (tg NULL: none), numbered by tstart; unit u is tensors
       ufirst[u] .. ufirst[u + 1] - 1. At stage 2 tp holds the full parameters (full is NULL) */
    dpar_tensor *tp, *tg;
    size_t *tstart;
    int *ufirst, nt;
    /* the leaves (L > 0): rank j holds leaves lfirst[j] .. lfirst[j + 1] - 1 and reduces them locally into the tree
       nodes nlo[i]..nhi[i] for i in nstart[j] .. nstart[j + 1] - 1 (the largest nodes inside its leaves; at most
       M on a rank); lgrad: this rank's leaves' gradients (one unit each), then the result; lsend, lrecv: the
       alltoall of the nodes' blocks (to rank k: M nodes of block k, each `stride` elements) */
    int L, M, *lfirst, *nstart, *nlo, *nhi;
    float *lgrad, *lsend, *lrecv;
    const void **lptr;
};

static void *dpar__fsdp_alloc(dpar_fsdp *f, size_t n, size_t size)
{
    void *p = dpar__calloc(&f->d.allocator, n ? n : 1, size);
    if (p) f->bytes += (n ? n : 1) * size;
    return p;
}
/* a buffer of the model's values: in the comm's device memory when its buffers are there (zeroed either way) */
static void *dpar__fsdp_data(dpar_fsdp *f, size_t n, size_t size)
{
    void *p;
    if (!f->dev) return dpar__fsdp_alloc(f, n, size);
    p = dpar__dev_alloc(f->comm, (n ? n : 1) * size);
    if (p) f->bytes += (n ? n : 1) * size;
    return p;
}
static void dpar__fsdp_data_free(dpar_fsdp *f, void *p)
{
    if (f->dev) dpar__dev_free(f->comm, p);
    else dpar__free(&f->d.allocator, p);
}

/* wait for the prefetch in flight, if any (its buffer is dropped when it failed) */
static dpar_status dpar__fsdp_settle(dpar_fsdp *f)
{
    dpar_status st = DPAR_OK;
    if (f->req) {
        st = dpar_request_wait(f->req);
        f->req = NULL;
        if (st != DPAR_OK) f->held[f->req_slot] = -1;
    }
    return st;
}

/* floats to the compute type and back */
static void dpar__fsdp_narrow(void *out, const float *in, size_t n, dpar_dtype t)
{
    size_t i;
    uint16_t *o = (uint16_t *)out;
    if (t == DPAR_F32) memcpy(out, in, n * sizeof(float));
    else if (t == DPAR_BF16)
        for (i = 0; i < n; i++) o[i] = dpar_f32_to_bf16(in[i]);
    else
        for (i = 0; i < n; i++) o[i] = dpar_f32_to_f16(in[i]);
}
static void dpar__fsdp_widen(float *out, const void *in, size_t n, dpar_dtype t)
{
    size_t i;
    const uint16_t *h = (const uint16_t *)in;
    if (t == DPAR_F32) memcpy(out, in, n * sizeof(float));
    else if (t == DPAR_BF16)
        for (i = 0; i < n; i++) out[i] = dpar_bf16_to_f32(h[i]);
    else
        for (i = 0; i < n; i++) out[i] = dpar_f16_to_f32(h[i]);
}

/* the tensor form: elements [lo, hi) of the numbering between the tensors t (the compute type) and flat[0, hi - lo)
   of type ft (the compute type: copied; f32 with 16-bit tensors: widened in, narrowed out); in: tensors to flat */
static void dpar__fsdp_tmove(const dpar_fsdp *f, const dpar_tensor *t, void *flat, dpar_dtype ft, size_t lo, size_t hi,
                             int in)
{
    int i = lo < hi ? dpar__tensor_at(f->tstart, f->nt, lo) : f->nt;
    size_t fes = dpar_dtype_size(ft);
    for (; i < f->nt && f->tstart[i] < hi; i++) {
        size_t a = f->tstart[i] > lo ? f->tstart[i] : lo, e = f->tstart[i + 1] < hi ? f->tstart[i + 1] : hi;
        char *at = (char *)t[i].data + (a - f->tstart[i]) * f->ces, *fl = (char *)flat + (a - lo) * fes;
        if (ft == f->ct) memcpy(in ? fl : at, in ? at : fl, (e - a) * f->ces);
        else if (in) dpar__fsdp_widen((float *)fl, at, e - a, f->ct);
        else dpar__fsdp_narrow(at, (const float *)fl, e - a, f->ct);
    }
}

/* stage 2: every rank's full parameters from the master blocks, in the compute type (after a step, a load): each
   unit's own array, or through the gradient buffer (free between steps) into the unit's tensors */
static dpar_status dpar__fsdp_publish(dpar_fsdp *f)
{
    int u;
    for (u = 0; u < f->U; u++) {
        int one = f->tp && f->ufirst[u + 1] - f->ufirst[u] == 1; /* the tensor form: a unit of one array */
        char *unit = f->tp ? (one ? (char *)f->tp[f->ufirst[u]].data : (char *)f->gbuf)
                           : (char *)f->full + f->foff[u] * f->ces,
             *mine = unit + f->off[u] * f->ces;
        if (f->p) dpar__fsdp_narrow(mine, f->p + f->soff[u], f->len[u], f->ct);
        DPAR__TRY(dpar_allgather(f->comm, mine, unit, f->count[u], f->ct));
        if (f->tp && !one) dpar__fsdp_tmove(f, f->tp, unit, f->ct, f->foff[u], f->foff[u] + f->count[u], 0);
    }
    return DPAR_OK;
}

DPAR_API dpar_status dpar_fsdp_destroy(dpar_fsdp *f)
{
    dpar_allocator a;
    dpar_status st = DPAR_OK;
    if (!f) return DPAR_OK;
    st = dpar__fsdp_settle(f); /* its buffer is about to go */
    a = f->d.allocator;
    dpar__free(&a, f->count), dpar__free(&a, f->off), dpar__free(&a, f->len), dpar__free(&a, f->soff);
    dpar__free(&a, f->foff), dpar__free(&a, f->fresh), dpar__fsdp_data_free(f, f->p), dpar__fsdp_data_free(f, f->g);
    dpar__fsdp_data_free(f, f->m), dpar__fsdp_data_free(f, f->v), dpar__fsdp_data_free(f, f->full);
    dpar__fsdp_data_free(f, f->buf[0]), dpar__fsdp_data_free(f, f->gbuf);
    dpar__free(&a, f->send[0]), dpar__free(&a, f->send[1]);
    dpar__free(&a, f->gwide), dpar__free(&a, f->tp), dpar__free(&a, f->tg), dpar__free(&a, f->tstart);
    dpar__free(&a, f->ufirst), dpar__free(&a, f->lfirst), dpar__free(&a, f->nstart), dpar__free(&a, f->nlo);
    dpar__free(&a, f->nhi), dpar__free(&a, f->lgrad), dpar__free(&a, f->lsend), dpar__free(&a, f->lrecv);
    dpar__free(&a, (void *)f->lptr), dpar__free(&a, f);
    return st;
}

/* the leaves' tree: the largest nodes tree(lo, hi) (mid = lo + (hi - lo) / 2, as dpar_tree_reduce) lying inside leaves
   [a, b), left to right, into nlo/nhi from index n (NULL: counted only); returns the new n */
static int dpar__leaf_nodes(int lo, int hi, int a, int b, int *nlo, int *nhi, int n)
{
    if (hi <= a || lo >= b) return n;
    if (a <= lo && hi <= b) {
        if (nlo) nlo[n] = lo, nhi[n] = hi;
        return n + 1;
    }
    n = dpar__leaf_nodes(lo, lo + (hi - lo) / 2, a, b, nlo, nhi, n);
    return dpar__leaf_nodes(lo + (hi - lo) / 2, hi, a, b, nlo, nhi, n);
}

/* the leaves' layout on N ranks: who holds which leaves and nodes, and the buffers (at create) */
static int dpar__fsdp_leaves_make(dpar_fsdp *f)
{
    int N = f->comm->size, r = f->comm->rank, j, n = 0;
    size_t o, l, most = 0;
    f->lfirst = (int *)dpar__fsdp_alloc(f, (size_t)N + 1, sizeof(int));
    f->nstart = (int *)dpar__fsdp_alloc(f, (size_t)N + 1, sizeof(int));
    if (!f->lfirst || !f->nstart) return 0;
    for (j = 0; j < N; j++) {
        dpar_block_range((size_t)f->L, N, j, &o, &l);
        f->lfirst[j] = (int)o;
    }
    f->lfirst[N] = f->L;
    for (j = 0; j < N; j++) {
        f->nstart[j] = n;
        n = dpar__leaf_nodes(0, f->L, f->lfirst[j], f->lfirst[j + 1], NULL, NULL, n);
        if (n - f->nstart[j] > f->M) f->M = n - f->nstart[j];
    }
    f->nstart[N] = n;
    f->nlo = (int *)dpar__fsdp_alloc(f, (size_t)n, sizeof(int));
    f->nhi = (int *)dpar__fsdp_alloc(f, (size_t)n, sizeof(int));
    if (!f->nlo || !f->nhi) return 0;
    for (j = 0; j < N; j++) dpar__leaf_nodes(0, f->L, f->lfirst[j], f->lfirst[j + 1], f->nlo, f->nhi, f->nstart[j]);
    dpar_block_range(f->maxc, N, 0, &o, &most); /* block 0 is a longest one */
    l = (size_t)(f->lfirst[r + 1] - f->lfirst[r]);
    f->lgrad = (float *)dpar__fsdp_alloc(f, l * f->maxc, sizeof(float));
    f->lsend = (float *)dpar__fsdp_alloc(f, (size_t)N * (size_t)f->M * most, sizeof(float));
    f->lrecv = (float *)dpar__fsdp_alloc(f, (size_t)N * (size_t)f->M * most, sizeof(float));
    f->lptr = (const void **)dpar__fsdp_alloc(f, l, sizeof(void *));
    return f->lgrad && f->lsend && f->lrecv && f->lptr;
}

/* out[0..n) = tree(lo, hi) at element e of this rank's block, from the nodes' blocks the ranks sent (recv: rank j's
   nodes at j * M * stride, each stride long); tmp has room for n elements per level below */
static void dpar__fsdp_up(const dpar_fsdp *f, int lo, int hi, size_t stride, size_t e, size_t n, float *out, float *tmp)
{
    int j = 0, i, mid = lo + (hi - lo) / 2;
    size_t q;
    while (f->lfirst[j + 1] <= lo) j++;
    for (i = f->nstart[j]; hi <= f->lfirst[j + 1] && i < f->nstart[j + 1]; i++)
        if (f->nlo[i] == lo && f->nhi[i] == hi) { /* a node rank j summed */
            memcpy(out, f->lrecv + ((size_t)j * (size_t)f->M + (size_t)(i - f->nstart[j])) * stride + e, n * 4);
            return;
        }
    dpar__fsdp_up(f, lo, mid, stride, e, n, out, tmp + n);
    dpar__fsdp_up(f, mid, hi, stride, e, n, tmp, tmp + n);
    for (q = 0; q < n; q++) out[q] = out[q] + tmp[q]; /* as dpar_tree_reduce: left + right */
}

/* the leaves' reduction of unit u: this rank's block of the average over the leaves, into lgrad */
static dpar_status dpar__fsdp_leaves_reduce(dpar_fsdp *f, int u)
{
    int N = f->comm->size, r = f->comm->rank, k, i, l;
    size_t n = f->count[u], o, bl, stride, e;
    float tmp[18 * 64];
    dpar_block_range(n, N, 0, &o, &stride);
    for (k = 0; k < N; k++) { /* each of my nodes, block k of it, for rank k */
        dpar_block_range(n, N, k, &o, &bl);
        for (i = f->nstart[r]; bl && i < f->nstart[r + 1]; i++) {
            for (l = f->nlo[i]; l < f->nhi[i]; l++)
                f->lptr[l - f->nlo[i]] = f->lgrad + (size_t)(l - f->lfirst[r]) * n + o;
            DPAR__TRY(dpar_tree_reduce(f->lsend + ((size_t)k * (size_t)f->M + (size_t)(i - f->nstart[r])) * stride,
                                       f->lptr, f->nhi[i] - f->nlo[i], bl, DPAR_F32, DPAR_SUM));
        }
    }
    DPAR__TRY(dpar_alltoall(f->comm, f->lsend, f->lrecv, (size_t)f->M * stride, DPAR_F32));
    for (e = 0; e < f->len[u]; e += 64) {
        size_t m = f->len[u] - e < 64 ? f->len[u] - e : 64;
        dpar__fsdp_up(f, 0, f->L, stride, e, m, f->lgrad + e, tmp);
    }
    dpar__divide(f->lgrad, f->lgrad, f->len[u], DPAR_F32, f->L);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_fsdp_leaves(const dpar_fsdp *f, int *first, int *count)
{
    if (!f) return dpar__err(DPAR_EINVAL, "dpar_fsdp_leaves: fsdp is NULL");
    if (first) *first = f->L ? f->lfirst[f->comm->rank] : 0;
    if (count) *count = f->L ? f->lfirst[f->comm->rank + 1] - f->lfirst[f->comm->rank] : 1;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_fsdp_create(const dpar_fsdp_desc *desc, dpar_fsdp **out)
{
    dpar_fsdp *f;
    dpar_comm *c;
    int u, ok, half;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_fsdp_create: out is NULL");
    *out = NULL;
    if (!desc || !desc->comm || (!desc->unit_counts && !desc->params) || desc->num_units < 1)
        return dpar__err(DPAR_EINVAL, "dpar_fsdp_create: desc, comm or unit_counts is NULL, or num_units < 1");
    if ((desc->stage != 0 && desc->stage != 2 && desc->stage != 3) || (unsigned)desc->kind > 1 || !(desc->lr > 0))
        return dpar__err(DPAR_EINVAL, "dpar_fsdp_create: stage %d (2 or 3), kind %d, lr %g (positive)", desc->stage,
                         (int)desc->kind, (double)desc->lr);
    half = desc->compute == DPAR_BF16 || desc->compute == DPAR_F16;
    if ((desc->compute != DPAR_F32 && !half) ||
        (desc->reduce_dtype != DPAR_F32 && desc->reduce_dtype != desc->compute) || desc->loss_scale < 0)
        return dpar__err(DPAR_EINVAL,
                         "dpar_fsdp_create: compute %s (f32, bf16 or f16), reduce_dtype %s (f32 or the "
                         "compute type), loss_scale %g",
                         dpar_dtype_name(desc->compute), dpar_dtype_name(desc->reduce_dtype), (double)desc->loss_scale);
    if (desc->params || desc->grads || desc->unit_tensors) { /* the tensor form */
        int n = 0, i;
        size_t es = dpar_dtype_size(desc->compute);
        for (u = 0; desc->unit_tensors && u < desc->num_units; u++) {
            if (desc->unit_tensors[u] < 1 || desc->unit_tensors[u] > INT_MAX - n)
                return dpar__err(DPAR_EINVAL, "dpar_fsdp_create: unit %d has %d tensors (at least 1)", u,
                                 desc->unit_tensors[u]);
            n += desc->unit_tensors[u];
        }
        if (!desc->params || !desc->unit_tensors)
            return dpar__err(DPAR_EINVAL, "dpar_fsdp_create: the tensor form needs params and unit_tensors");
        /* every tensor in the compute type: a list that mixes types is refused, naming the tensor */
        DPAR__TRY(dpar__tensors_check("dpar_fsdp_create", "params", desc->params, n, desc->compute, NULL));
        if (desc->grads) {
            DPAR__TRY(dpar__tensors_check("dpar_fsdp_create", "grads", desc->grads, n, desc->compute, NULL));
            for (i = 0; i < n; i++)
                if (desc->grads[i].count != desc->params[i].count)
                    return dpar__err(DPAR_EINVAL,
                                     "dpar_fsdp_create: grads tensor %d has %zu elements, its parameter %zu", i,
                                     desc->grads[i].count, desc->params[i].count);
            for (i = 0; i < n; i++) { /* a gradient over a parameter */
                int k;
                for (k = 0; k < n; k++)
                    if (dpar__overlap(desc->grads[i].data, desc->grads[i].count * es, desc->params[k].data,
                                      desc->params[k].count * es))
                        return dpar__err(DPAR_EINVAL, "dpar_fsdp_create: grads tensor %d overlaps params tensor %d", i,
                                         k);
            }
        }
        for (u = 0, i = 0; u < desc->num_units; u++) { /* unit_counts, when given, must agree */
            size_t sum = 0;
            int e = i + desc->unit_tensors[u];
            for (; i < e; i++) sum += desc->params[i].count;
            if (desc->unit_counts && desc->unit_counts[u] != sum)
                return dpar__err(DPAR_EINVAL, "dpar_fsdp_create: unit %d: unit_counts says %zu, its tensors hold %zu",
                                 u, desc->unit_counts[u], sum);
        }
    }
    if (desc->leaves && (desc->leaves < desc->comm->size || desc->leaves > 65536 || half || desc->grads))
        return dpar__err(DPAR_EINVAL,
                         "dpar_fsdp_create: leaves %d: the deterministic mode wants %d to 65536 leaves (one per rank "
                         "at least), f32 compute and no grads tensors",
                         desc->leaves, desc->comm->size);
    DPAR__TRY(dpar__dev_check(desc->comm, "dpar_fsdp_create",
                              half                                               ? "16-bit compute"
                              : desc->params                                     ? "the tensor form"
                              : desc->leaves                                     ? "the leaves (the deterministic mode)"
                              : desc->loss_scale > 0 && desc->loss_scale != 1.0f ? "a loss scale"
                                                                                 : NULL));
    DPAR__TRY(dpar__check_allocator("dpar_fsdp_create", &desc->allocator));
    f = (dpar_fsdp *)dpar__calloc(&desc->allocator, 1, sizeof *f);
    if (!f) return dpar__err(DPAR_ENOMEM, "dpar_fsdp_create: out of memory");
    f->bytes = sizeof *f;
    f->d = *desc;
    f->d.unit_counts = NULL;
    f->d.params = f->d.grads = NULL;
    f->d.unit_tensors = NULL;
    if (f->d.beta1 == 0) f->d.beta1 = 0.9f;
    if (f->d.beta2 == 0) f->d.beta2 = 0.999f;
    if (f->d.eps == 0) f->d.eps = 1e-8f;
    f->comm = c = desc->comm;
    f->dev = dpar__dev(c) != NULL;
    DPAR__OPTIM_HYPER(f->hyper, f->d);
    f->U = desc->num_units;
    f->stage = desc->stage ? desc->stage : 3;
    f->ct = desc->compute;
    f->rt = desc->reduce_dtype;
    f->ces = dpar_dtype_size(f->ct);
    f->scale = desc->loss_scale > 0 ? desc->loss_scale : f->ct == DPAR_F16 ? 65536.0f : 1.0f;
    f->dynamic = f->ct == DPAR_F16 && !desc->static_loss_scale;
    f->held[0] = f->held[1] = f->gunit = f->last = -1;
    f->count = (size_t *)dpar__fsdp_alloc(f, (size_t)f->U, sizeof(size_t));
    f->off = (size_t *)dpar__fsdp_alloc(f, (size_t)f->U, sizeof(size_t));
    f->len = (size_t *)dpar__fsdp_alloc(f, (size_t)f->U, sizeof(size_t));
    f->soff = (size_t *)dpar__fsdp_alloc(f, (size_t)f->U, sizeof(size_t));
    f->foff = (size_t *)dpar__fsdp_alloc(f, (size_t)f->U, sizeof(size_t));
    f->fresh = (unsigned char *)dpar__fsdp_alloc(f, (size_t)f->U, 1);
    ok = f->count && f->off && f->len && f->soff && f->foff && f->fresh;
    if (ok && desc->params) { /* the tensor form: the lists and their numbering, kept */
        int n = 0;
        for (u = 0; u < f->U; u++) n += desc->unit_tensors[u];
        f->nt = n;
        f->tp = (dpar_tensor *)dpar__fsdp_alloc(f, (size_t)n, sizeof(dpar_tensor));
        if (desc->grads) f->tg = (dpar_tensor *)dpar__fsdp_alloc(f, (size_t)n, sizeof(dpar_tensor));
        f->ufirst = (int *)dpar__fsdp_alloc(f, (size_t)f->U + 1, sizeof(int));
        f->tstart = (size_t *)dpar__fsdp_alloc(f, (size_t)n + 1, sizeof(size_t));
        ok = f->tp && (!desc->grads || f->tg) && f->ufirst && f->tstart;
        if (ok) {
            memcpy(f->tp, desc->params, (size_t)n * sizeof(dpar_tensor));
            if (f->tg) memcpy(f->tg, desc->grads, (size_t)n * sizeof(dpar_tensor));
            for (n = 0; n < f->nt; n++) f->tstart[n + 1] = f->tstart[n] + f->tp[n].count;
            for (u = 0; u < f->U; u++) f->ufirst[u + 1] = f->ufirst[u] + desc->unit_tensors[u];
        }
    }
    for (u = 0; ok && u < f->U; u++) {
        f->count[u] = f->tp ? f->tstart[f->ufirst[u + 1]] - f->tstart[f->ufirst[u]] : desc->unit_counts[u];
        dpar_block_range(f->count[u], c->size, c->rank, &f->off[u], &f->len[u]);
        f->soff[u] = f->slen;
        f->foff[u] = f->total;
        f->slen += f->len[u];
        f->total += f->count[u];
        if (f->count[u] > f->maxc) f->maxc = f->count[u];
        if (f->len[u] > f->maxlen) f->maxlen = f->len[u];
        f->fresh[u] = 1;
    }
    if (ok) {
        f->g = (float *)dpar__fsdp_data(f, f->slen, sizeof(float));
        f->m = (float *)dpar__fsdp_data(f, f->slen, sizeof(float));
        if (f->d.kind == DPAR_OPTIM_ADAM) f->v = (float *)dpar__fsdp_data(f, f->slen, sizeof(float));
        if (f->stage == 2) f->gbuf = dpar__fsdp_data(f, f->maxc, f->ces);
        if (half && f->rt == DPAR_F32) f->gwide = (float *)dpar__fsdp_alloc(f, f->maxc, sizeof(float));
        if (f->stage == 3 || half || f->tp) f->p = (float *)dpar__fsdp_data(f, f->slen, sizeof(float));
        if (f->stage == 2) {
            if (!f->tp) f->full = dpar__fsdp_data(f, f->total, f->ces);
        } else {
            size_t second = 0; /* the second largest unit (the largest again when two tie) */
            int big = 0;
            for (u = 1; u < f->U; u++) big = f->count[u] > f->count[big] ? u : big;
            for (u = 0; u < f->U; u++) second = u != big && f->count[u] > second ? f->count[u] : second;
            f->cap = f->maxc + second;
            f->buf[0] = f->buf[1] = dpar__fsdp_data(f, f->cap, f->ces);
            if (half) f->send[0] = dpar__fsdp_alloc(f, f->maxlen, f->ces);
            if (half) f->send[1] = dpar__fsdp_alloc(f, f->maxlen, f->ces);
        }
        f->L = desc->leaves;
        ok = (!f->L || dpar__fsdp_leaves_make(f)) && f->g && f->m && (f->d.kind != DPAR_OPTIM_ADAM || f->v) &&
             (f->stage == 3 || f->gbuf) && (!half || f->rt != DPAR_F32 || f->gwide) &&
             ((f->stage != 3 && !half && !f->tp) || f->p) &&
             (f->stage == 2 ? f->full != NULL || f->tp
                            : f->buf[0] && f->buf[1] && (!half || (f->send[0] && f->send[1])));
    }
    if (ok && f->tp) { /* the initial parameters: this rank's block of each unit (16-bit: widened, exactly) */
        for (u = 0; u < f->U; u++)
            dpar__fsdp_tmove(f, f->tp, f->p + f->soff[u], DPAR_F32, f->foff[u] + f->off[u],
                             f->foff[u] + f->off[u] + f->len[u], 1);
        /* stage 3 reads them here only; the list is kept for the tensors' counts (dpar_fsdp_gather_tensors) */
    }
    if (!ok) {
        dpar_fsdp_destroy(f);
        return dpar__err(DPAR_ENOMEM, "dpar_fsdp_create: out of memory");
    }
    *out = f;
    return DPAR_OK;
}

static dpar_status dpar__fsdp_unit(const dpar_fsdp *f, int unit, const void *p, const char *fn)
{
    if (!f || !p) return dpar__err(DPAR_EINVAL, "%s: a NULL argument", fn);
    if (unit < 0 || unit >= f->U) return dpar__err(DPAR_EINVAL, "%s: unit %d is not in 0..%d", fn, unit, f->U - 1);
    return DPAR_OK;
}

/* this rank's block of the unit's parameters: the master shard, or (stage 2 in f32) the full copy itself */
static float *dpar__fsdp_master(dpar_fsdp *f, int u)
{
    return f->p ? f->p + f->soff[u] : (float *)f->full + f->foff[u] + f->off[u];
}
/* this rank's block of the unit's parameters (k = 0), momentum or first moment (1), second moment (2) */
static float *dpar__fsdp_piece(dpar_fsdp *f, int u, int k)
{
    return k == 0 ? dpar__fsdp_master(f, u) : (k == 1 ? f->m : f->v) + f->soff[u];
}

DPAR_API dpar_status dpar_fsdp_set_params(dpar_fsdp *f, int unit, const float *full)
{
    DPAR__TRY(dpar__fsdp_unit(f, unit, full, "dpar_fsdp_set_params"));
    if (f->held[0] >= 0 || f->held[1] >= 0)
        return dpar__err(DPAR_EINVAL, "dpar_fsdp_set_params: a unit is gathered or being gathered");
    if (f->dev) { /* full is device memory too */
        if (f->p) return dpar__dev_copy(f->comm, f->p + f->soff[unit], full + f->off[unit], f->len[unit] * 4);
        return dpar__dev_copy(f->comm, (float *)f->full + f->foff[unit], full, f->count[unit] * 4);
    }
    if (f->p) memcpy(f->p + f->soff[unit], full + f->off[unit], f->len[unit] * sizeof(float));
    if (f->stage == 2 && f->tp) /* the tensors are the full copy (in the compute type) */
        dpar__fsdp_tmove(f, f->tp, (void *)full, DPAR_F32, f->foff[unit], f->foff[unit] + f->count[unit], 0);
    else if (f->stage == 2) dpar__fsdp_narrow((char *)f->full + f->foff[unit] * f->ces, full, f->count[unit], f->ct);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_fsdp_get_params(dpar_fsdp *f, int unit, float *full)
{
    DPAR__TRY(dpar__fsdp_unit(f, unit, full, "dpar_fsdp_get_params"));
    if (!f->p) return dpar__dev_copy(f->comm, full, (float *)f->full + f->foff[unit], f->count[unit] * sizeof(float));
    DPAR__TRY(dpar__fsdp_settle(f)); /* the calls stay in order on every rank */
    return dpar_allgather(f->comm, f->p + f->soff[unit], full, f->count[unit], DPAR_F32);
}

/* stage 3: the elements held by the other slot than s (a unit, or gradients); whether n more fit beside them, and
   if so, point buf[s] at their place (slot 1 flush with the arena's end) */
static int dpar__fsdp_place(dpar_fsdp *f, int s, size_t n)
{
    int o = f->held[1 - s];
    size_t m = o == -1 ? 0 : o == -2 ? f->count[f->gunit] : f->count[o];
    if (n + m > f->cap) return 0;
    if (s == 1) f->buf[1] = (char *)f->buf[0] + (f->cap - n) * f->ces;
    return 1;
}

/* stage 3: start gathering `unit` into buf[slot] (async where the comm allows, else now) */
static dpar_status dpar__fsdp_fetch(dpar_fsdp *f, int unit, int slot, int async)
{
    dpar_status st;
    const void *mine = f->p + f->soff[unit];
    if (f->ct != DPAR_F32) { /* this rank's block in the compute type, kept until the gather is done */
        dpar__fsdp_narrow(f->send[slot], f->p + f->soff[unit], f->len[unit], f->ct);
        mine = f->send[slot];
    }
    f->held[slot] = unit;
    f->taken[slot] = 0;
    if (async && !f->no_async) {
        st = dpar_iallgather(f->comm, mine, f->buf[slot], f->count[unit], f->ct, &f->req);
        if (st == DPAR_OK) {
            f->req_slot = slot;
            return DPAR_OK;
        }
        f->held[slot] = -1;
        if (st != DPAR_EUNSUPPORTED) return st;
        f->no_async = 1; /* an MPI comm without MPI_THREAD_MULTIPLE: gathers without prefetch */
        return DPAR_OK;
    }
    st = dpar_allgather(f->comm, mine, f->buf[slot], f->count[unit], f->ct);
    if (st != DPAR_OK) f->held[slot] = -1;
    return st;
}

static dpar_status dpar__fsdp_gather(dpar_fsdp *f, int unit, void **params)
{
    int s, next, dir;
    if (f->stage == 2 && f->tp) { /* the unit's own array, when it is one */
        if (f->ufirst[unit + 1] - f->ufirst[unit] != 1)
            return dpar__err(DPAR_EINVAL,
                             "dpar_fsdp_gather: unit %d is %d tensors, not one array (at stage 2 they are "
                             "yours: dpar_fsdp_gather_tensors names them)",
                             unit, f->ufirst[unit + 1] - f->ufirst[unit]);
        *params = f->tp[f->ufirst[unit]].data;
        return DPAR_OK;
    }
    if (f->stage == 2) {
        *params = (char *)f->full + f->foff[unit] * f->ces;
        return DPAR_OK;
    }
    for (s = 0; s < 2 && !(f->held[s] == unit && !f->taken[s]); s++) continue;
    if (s < 2 && f->req && f->req_slot == s) DPAR__TRY(dpar__fsdp_settle(f)); /* prefetched: wait for it */
    if (s < 2 && f->held[s] != unit) s = 2;                                   /* its gather failed */
    if (s == 2) { /* not prefetched: a free buffer, or the one a useless prefetch holds */
        for (s = 0; s < 2 && f->held[s] != -1; s++) continue;
        if (s == 2) {
            for (s = 0; s < 2 && (f->held[s] < 0 || f->taken[s]); s++) continue; /* not lent to gradients */
            if (s == 2)
                return dpar__err(DPAR_EBUSY, "dpar_fsdp_gather: units %d and %d are held (release one; -2: gradients)",
                                 f->held[0], f->held[1]);
        }
        DPAR__TRY(dpar__fsdp_settle(f)); /* the calls stay in the same order on every rank */
        if (!dpar__fsdp_place(f, s, f->count[unit]))
            return dpar__err(DPAR_EBUSY, "dpar_fsdp_gather: unit %d does not fit beside %s %d (release it)", unit,
                             f->held[1 - s] == -2 ? "the gradients of unit" : "unit",
                             f->held[1 - s] == -2 ? f->gunit : f->held[1 - s]);
        DPAR__TRY(dpar__fsdp_fetch(f, unit, s, 0));
    }
    f->taken[s] = 1;
    *params = f->buf[s];
    /* prefetch the next unit in the direction of the calls: up in forward, down once a unit repeats (backward) */
    dir = f->last < 0 || unit > f->last ? 1 : -1;
    f->last = unit;
    next = unit + dir;
    if (next >= 0 && next < f->U && !f->req && f->held[1 - s] == -1 && dpar__fsdp_place(f, 1 - s, f->count[next]))
        return dpar__fsdp_fetch(f, next, 1 - s, 1); /* two different units always fit */
    return DPAR_OK;
}

/* the unit is one, and the call's element type the fsdp's compute type (16: a _16 call) */
static dpar_status dpar__fsdp_typed(const dpar_fsdp *f, int unit, const void *p, int is16, const char *fn)
{
    DPAR__TRY(dpar__fsdp_unit(f, unit, p, fn));
    if ((f->ct != DPAR_F32) != is16)
        return dpar__err(DPAR_EINVAL, "%s: the compute type is %s: use the %s call", fn, dpar_dtype_name(f->ct),
                         is16 ? "f32" : "16-bit (..16)");
    return DPAR_OK;
}
DPAR_API dpar_status dpar_fsdp_gather(dpar_fsdp *f, int unit, float **params)
{
    void *p = NULL;
    DPAR__TRY(dpar__fsdp_typed(f, unit, params, 0, "dpar_fsdp_gather"));
    DPAR__TRY(dpar__fsdp_gather(f, unit, &p));
    *params = (float *)p;
    return DPAR_OK;
}
/* the tensor form: the unit's parameters for its views (*base NULL: at stage 2 the arrays themselves; else the
   gathered buffer), and view i of the unit (without the tensor form one: the whole unit) */
static dpar_status dpar__fsdp_gather_base(dpar_fsdp *f, int unit, void **base)
{
    *base = NULL;
    return f->tp && f->stage == 2 ? DPAR_OK : dpar__fsdp_gather(f, unit, base);
}
static void *dpar__fsdp_view(const dpar_fsdp *f, int unit, void *base, int i)
{
    int t = f->tp ? f->ufirst[unit] + i : 0;
    if (!base) return f->tp[t].data;
    return f->tp ? (char *)base + (f->tstart[t] - f->foff[unit]) * f->ces : base;
}
static int dpar__fsdp_nviews(const dpar_fsdp *f, int unit) { return f->tp ? f->ufirst[unit + 1] - f->ufirst[unit] : 1; }
DPAR_API dpar_status dpar_fsdp_gather_tensors(dpar_fsdp *f, int unit, float **views)
{
    void *base;
    int i;
    DPAR__TRY(dpar__fsdp_typed(f, unit, views, 0, "dpar_fsdp_gather_tensors"));
    DPAR__TRY(dpar__fsdp_gather_base(f, unit, &base));
    for (i = 0; i < dpar__fsdp_nviews(f, unit); i++) views[i] = (float *)dpar__fsdp_view(f, unit, base, i);
    return DPAR_OK;
}
DPAR_API dpar_status dpar_fsdp_gather16_tensors(dpar_fsdp *f, int unit, uint16_t **views)
{
    void *base;
    int i;
    DPAR__TRY(dpar__fsdp_typed(f, unit, views, 1, "dpar_fsdp_gather16_tensors"));
    DPAR__TRY(dpar__fsdp_gather_base(f, unit, &base));
    for (i = 0; i < dpar__fsdp_nviews(f, unit); i++) views[i] = (uint16_t *)dpar__fsdp_view(f, unit, base, i);
    return DPAR_OK;
}
DPAR_API dpar_status dpar_fsdp_gather16(dpar_fsdp *f, int unit, uint16_t **params)
{
    void *p = NULL;
    DPAR__TRY(dpar__fsdp_typed(f, unit, params, 1, "dpar_fsdp_gather16"));
    DPAR__TRY(dpar__fsdp_gather(f, unit, &p));
    *params = (uint16_t *)p;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_fsdp_release(dpar_fsdp *f, int unit)
{
    int s;
    if (!f || unit < 0 || unit >= f->U) return dpar__err(DPAR_EINVAL, "dpar_fsdp_release: a bad fsdp or unit");
    if (f->stage == 2) return DPAR_OK;
    for (s = 0; s < 2 && !(f->held[s] == unit && f->taken[s]); s++) continue;
    if (s == 2) return dpar__err(DPAR_EINVAL, "dpar_fsdp_release: unit %d is not gathered", unit);
    f->held[s] = -1;
    f->taken[s] = 0;
    return DPAR_OK;
}

static dpar_status dpar__fsdp_grads(dpar_fsdp *f, int unit, void **grads)
{
    int s;
    void *at;
    if (f->gunit >= 0)
        return dpar__err(DPAR_EBUSY, "dpar_fsdp_grads: unit %d's gradients are not reduced yet", f->gunit);
    if (f->L) { /* one array per leaf of this rank */
        memset(f->lgrad, 0, (size_t)(f->lfirst[f->comm->rank + 1] - f->lfirst[f->comm->rank]) * f->count[unit] * 4);
        f->gunit = unit;
        f->gslot = 4;
        *grads = f->lgrad;
        return DPAR_OK;
    }
    /* stage 3: a free pooled buffer (the unit's own, released once backward no longer reads it), else the third */
    for (s = 0; f->stage == 3 && s < 2 && (f->held[s] != -1 || !dpar__fsdp_place(f, s, f->count[unit])); s++) continue;
    if (f->stage == 3 && s < 2) {
        at = f->buf[s];
    } else {
        if (!f->gbuf && !(f->gbuf = dpar__fsdp_data(f, f->maxc, f->ces)))
            return dpar__err(DPAR_ENOMEM, "dpar_fsdp_grads: out of memory (a third unit-sized buffer)");
        s = 2;
        at = f->gbuf;
    }
    DPAR__TRY(dpar__dev_clear(f->comm, at, f->count[unit] * f->ces));
    if (s < 2) f->held[s] = -2;
    f->gunit = unit;
    f->gslot = s;
    *grads = at;
    return DPAR_OK;
}
DPAR_API dpar_status dpar_fsdp_grads(dpar_fsdp *f, int unit, float **grads)
{
    void *g = NULL;
    DPAR__TRY(dpar__fsdp_typed(f, unit, grads, 0, "dpar_fsdp_grads"));
    if (f->tg)
        return dpar__err(DPAR_EINVAL, "dpar_fsdp_grads: the gradients are the desc's grads tensors (backward writes "
                                      "them; dpar_fsdp_reduce reads them)");
    DPAR__TRY(dpar__fsdp_grads(f, unit, &g));
    *grads = (float *)g;
    return DPAR_OK;
}
DPAR_API dpar_status dpar_fsdp_grads16(dpar_fsdp *f, int unit, uint16_t **grads)
{
    void *g = NULL;
    DPAR__TRY(dpar__fsdp_typed(f, unit, grads, 1, "dpar_fsdp_grads16"));
    if (f->tg)
        return dpar__err(DPAR_EINVAL, "dpar_fsdp_grads16: the gradients are the desc's grads tensors (backward writes "
                                      "them; dpar_fsdp_reduce reads them)");
    DPAR__TRY(dpar__fsdp_grads(f, unit, &g));
    *grads = (uint16_t *)g;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_fsdp_reduce(dpar_fsdp *f, int unit)
{
    float *mine, *g, x;
    void *gb;
    size_t i;
    if (f && f->tg && unit >= 0 && unit < f->U) { /* the tensor form: the unit's gradient tensors */
        int t = f->ufirst[unit], wide = f->ct != DPAR_F32 && f->rt == DPAR_F32;
        if (f->ufirst[unit + 1] - t == 1 || wide) { /* one array reduced where it is, or 16-bit widened from them */
            if (f->gunit >= 0)
                return dpar__err(DPAR_EBUSY, "dpar_fsdp_reduce: unit %d's gradients are not reduced yet", f->gunit);
            f->gunit = unit, f->gslot = wide ? 5 : 3;
            if (wide) dpar__fsdp_tmove(f, f->tg, f->gwide, DPAR_F32, f->foff[unit], f->foff[unit] + f->count[unit], 1);
        } else { /* through a unit buffer */
            void *at = NULL;
            DPAR__TRY(dpar__fsdp_grads(f, unit, &at));
            dpar__fsdp_tmove(f, f->tg, at, f->ct, f->foff[unit], f->foff[unit] + f->count[unit], 1);
        }
    }
    if (!f || unit < 0 || unit >= f->U || f->gunit != unit)
        return dpar__err(DPAR_EINVAL, "dpar_fsdp_reduce: unit %d's gradients were not taken with dpar_fsdp_grads",
                         unit);
    gb = f->gslot == 3   ? f->tg[f->ufirst[unit]].data
         : f->gslot == 2 ? f->gbuf
         : f->gslot >= 4 ? NULL /* the leaves' own; 5: already widened into gwide */
                         : f->buf[f->gslot];
    if (f->gslot == 4) { /* the leaves: their fixed tree */
        DPAR__TRY(dpar__fsdp_leaves_reduce(f, unit));
        mine = f->lgrad;
    } else if (f->ct == DPAR_F32) { /* this rank's block of the average, in place */
        mine = (float *)gb + f->off[unit];
        DPAR__TRY(dpar_reduce_scatter(f->comm, gb, mine, f->count[unit], DPAR_F32, DPAR_AVG));
    } else if (f->rt == DPAR_F32) { /* widened first: the reduction in f32 */
        if (f->gslot != 5) dpar__fsdp_widen(f->gwide, gb, f->count[unit], f->ct);
        mine = f->gwide + f->off[unit];
        DPAR__TRY(dpar_reduce_scatter(f->comm, f->gwide, mine, f->count[unit], DPAR_F32, DPAR_AVG));
    } else { /* in the 16-bit type: half the bytes; then widened (into the front of gbuf's floats' room: f->g) */
        char *block = (char *)gb + f->off[unit] * f->ces;
        DPAR__TRY(dpar_reduce_scatter(f->comm, gb, block, f->count[unit], f->ct, DPAR_AVG));
        mine = NULL;
        g = f->g + f->soff[unit];
        for (i = 0; i < f->len[unit]; i++) {
            float w;
            dpar__fsdp_widen(&w, block + i * f->ces, 1, f->ct);
            x = f->scale != 1.0f ? w / f->scale : w;
            if (!(x - x == 0)) f->bad = 1; /* inf or NaN */
            g[i] = f->fresh[unit] ? x : g[i] + x;
        }
    }
    if (mine && f->dev) { /* the first one a copy, then sums (no inf/NaN check: the scale is 1) */
        g = f->g + f->soff[unit];
        DPAR__TRY(f->fresh[unit] ? dpar__dev_copy(f->comm, g, mine, f->len[unit] * sizeof(float))
                                 : dpar__dev_add(f->comm, g, mine, f->len[unit]));
    } else if (mine) {
        g = f->g + f->soff[unit];
        for (i = 0; i < f->len[unit]; i++) {
            x = f->scale != 1.0f ? mine[i] / f->scale : mine[i];
            if (!(x - x == 0)) f->bad = 1;        /* inf or NaN */
            g[i] = f->fresh[unit] ? x : g[i] + x; /* the first one a copy: a -0 stays -0 */
        }
    }
    f->fresh[unit] = 0;
    f->gunit = -1;
    if (f->gslot < 2) f->held[f->gslot] = -1; /* the pooled buffer is free again */
    f->gslot = -1;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_fsdp_step(dpar_fsdp *f)
{
    int u;
    int32_t bad, any = 0;
    if (!f) return dpar__err(DPAR_EINVAL, "dpar_fsdp_step: fsdp is NULL");
    if (f->gunit >= 0 || (f->held[0] >= 0 && f->taken[0]) || (f->held[1] >= 0 && f->taken[1]))
        return dpar__err(DPAR_EBUSY, "dpar_fsdp_step: a unit is still gathered or its gradients not reduced");
    DPAR__TRY(dpar__fsdp_settle(f)); /* a prefetch of the old parameters */
    f->held[0] = f->held[1] = f->last = -1;
    bad = f->bad; /* every rank skips together, or none does (device memory: f32 at scale 1, nothing to skip) */
    if (!f->dev) DPAR__TRY(dpar_allreduce(f->comm, &bad, &any, 1, DPAR_I32, DPAR_MAX));
    f->bad = 0;
    if (any) {
        for (u = 0; u < f->U; u++) f->fresh[u] = 1; /* the step's gradients are dropped */
        f->skipped++;
        f->good = 0;
        if (f->dynamic && f->scale > 1.0f) f->scale *= 0.5f;
        return DPAR_OK;
    }
    f->step++;
    for (u = 0; u < f->U; u++) { /* dpar_zero_step's math on this rank's block of each unit */
        dpar_optim_update k = f->hyper;
        k.step = f->step;
        k.params = dpar__fsdp_master(f, u);
        k.grads = f->g + f->soff[u];
        k.m = f->m + f->soff[u];
        k.v = f->v ? f->v + f->soff[u] : NULL;
        k.n = f->len[u];
        if (f->fresh[u]) DPAR__TRY(dpar__dev_clear(f->comm, f->g + f->soff[u], k.n * sizeof(float))); /* no gradient */
        DPAR__TRY(dpar__dev_update(f->comm, &k));
        f->fresh[u] = 1;
    }
    if (f->dynamic && ++f->good >= 1000) f->scale *= 2.0f, f->good = 0;
    if (f->stage == 2) return dpar__fsdp_publish(f); /* everyone's blocks of the parameters, in place */
    return DPAR_OK;
}

DPAR_API dpar_status dpar_fsdp_scale(const dpar_fsdp *f, float *loss_scale, long *skipped)
{
    if (!f) return dpar__err(DPAR_EINVAL, "dpar_fsdp_scale: fsdp is NULL");
    if (loss_scale) *loss_scale = f->scale;
    if (skipped) *skipped = f->skipped;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_fsdp_memory(const dpar_fsdp *f, size_t *bytes, size_t *peak)
{
    if (!f) return dpar__err(DPAR_EINVAL, "dpar_fsdp_memory: fsdp is NULL");
    if (bytes) *bytes = f->bytes; /* everything is allocated at create and kept: the peak is the same */
    if (peak) *peak = f->bytes;
    return DPAR_OK;
}

/* >>pipe: pipeline schedules as checked data, the stage runner ---------------------------------- */
/* the virtual stage of (stage s, chunk c): c * p + s (the next one lives on stage (s + 1) % p), or in a V (ZBV,
   DUALPIPEV: two chunks) s on chunk 0 and 2p - 1 - s on chunk 1, so the turn from p - 1 to p stays on stage p - 1 */
static int dpar__pipe_vshape(const dpar_pipe_schedule *S)
{
    return S->kind == DPAR_PIPE_ZBV || S->kind == DPAR_PIPE_DUALPIPEV;
}
static int dpar__pipe_vs(const dpar_pipe_schedule *S, int s, int c)
{
    return dpar__pipe_vshape(S) && c == 1 ? 2 * S->p - 1 - s : c * S->p + s;
}
static void dpar__pipe_place(const dpar_pipe_schedule *S, int vs, int *s, int *c)
{
    if (dpar__pipe_vshape(S) && vs >= S->p) *s = 2 * S->p - 1 - vs, *c = 1;
    else *s = vs % S->p, *c = vs / S->p;
}
static int dpar__pipe_first(const dpar_pipe_schedule *S, int s, int c) { return dpar__pipe_vs(S, s, c) == 0; }
static int dpar__pipe_last(const dpar_pipe_schedule *S, int s, int c)
{
    return dpar__pipe_vs(S, s, c) == S->p * S->v - 1;
}
DPAR_API int dpar_pipe_virtual_stage(const dpar_pipe_schedule *S, int stage, int chunk)
{
    if (!S || stage < 0 || stage >= S->p || chunk < 0 || chunk >= S->v) return -1;
    return dpar__pipe_vs(S, stage, chunk);
}

static void dpar__pipe_add(dpar_pipe_schedule *S, int s, int code, int micro, int chunk)
{
    dpar_pipe_op *op = &S->ops[s][S->num_ops[s]++];
    op->code = code;
    op->micro = micro;
    op->chunk = chunk;
}
/* receive what it needs, compute, send what it made */
static void dpar__pipe_fwd(dpar_pipe_schedule *S, int s, int micro, int chunk)
{
    if (!dpar__pipe_first(S, s, chunk)) dpar__pipe_add(S, s, DPAR_PIPE_RECV_ACT, micro, chunk);
    dpar__pipe_add(S, s, DPAR_PIPE_FORWARD, micro, chunk);
    if (!dpar__pipe_last(S, s, chunk)) dpar__pipe_add(S, s, DPAR_PIPE_SEND_ACT, micro, chunk);
}
/* ZB-H1's split schedules: B in the backward's place, its W placed apart (dpar__pipe_zb_backward) */
static void dpar__pipe_bwd(dpar_pipe_schedule *S, int s, int micro, int chunk)
{
    if (!dpar__pipe_last(S, s, chunk)) dpar__pipe_add(S, s, DPAR_PIPE_RECV_GRAD, micro, chunk);
    dpar__pipe_add(S, s, S->kind == DPAR_PIPE_ZB_H1 ? DPAR_PIPE_BACKWARD_INPUT : DPAR_PIPE_BACKWARD, micro, chunk);
    if (!dpar__pipe_first(S, s, chunk)) dpar__pipe_add(S, s, DPAR_PIPE_SEND_GRAD, micro, chunk);
}

/* Megatron's interleaved order: unit k of a stage's N = m v forwards (or backwards) */
static void dpar__pipe_unit(const dpar_pipe_schedule *S, int k, int backward, int *micro, int *chunk)
{
    int p = S->p, v = S->v, c = (k / p) % v;
    *micro = (k / (p * v)) * p + k % p;
    *chunk = backward ? v - 1 - c : c;
}

/* ZB-H1 (v = 1): 1F1B's order of forwards and input gradients (B), each stage's weight gradients (W) placed s
   backwards late: stage s does W of micro-batch i right after B of micro-batch i + s, and the last s at the end.
   The W's of later stages fill what were 1F1B's cool-down bubbles while their B's go on at once, so every stage
   holds at most p micro-batches' stashes (1F1B's most, on its first stage). With F = B = W the bubble is
   (p - 1) / (3 m + p - 1), a third of 1F1B's idle time (the lower bound of a flushed step: the last stage's first
   activation needs p - 1 forwards). */
static void dpar__pipe_zb_backward(dpar_pipe_schedule *S, int s, int micro)
{
    dpar__pipe_bwd(S, s, micro, 0); /* B */
    if (micro - s >= 0) dpar__pipe_add(S, s, DPAR_PIPE_BACKWARD_WEIGHT, micro - s, 0);
}
static void dpar__pipe_generate_zb(dpar_pipe_schedule *S)
{
    int p = S->p, m = S->m, s, i;
    for (s = 0; s < p; s++) {
        int warm = m < p - s - 1 ? m : p - s - 1; /* 1F1B's warm-up */
        S->num_ops[s] = 0;
        for (i = 0; i < warm; i++) dpar__pipe_fwd(S, s, i, 0);
        for (i = 0; i < m - warm; i++) {
            dpar__pipe_fwd(S, s, warm + i, 0);
            dpar__pipe_zb_backward(S, s, i);
        }
        for (i = m - warm; i < m; i++) dpar__pipe_zb_backward(S, s, i);
        for (i = m - s > 0 ? m - s : 0; i < m; i++) dpar__pipe_add(S, s, DPAR_PIPE_BACKWARD_WEIGHT, i, 0);
    }
}

/* ---- V schedules (ZBV, DUALPIPEV): each stage's compute ops first, then their messages (dpar__pipe_wire) ---- */
static double dpar__pipe_cost(const dpar_pipe_schedule *S, int code);

/* ZBV: a greedy list scheduler on the op costs. At each time T (the earliest clock of a stage with ops left), every
   stage whose clock is T takes, of what it may start now: a B (the lowest micro-batch; chunk 1 first, it is nearer
   the loss), else a forward while it holds fewer than `limit` chunk stashes (chunk 1 first), else a W (the lowest
   micro-batch). Stages with nothing to start wait for the next event (an arrival or another stage's clock). Each
   chunk's F's, B's and W's run in micro-batch order (so its gradient sums come out as a whole backward's). Returns
   0; 1 when `limit` stashes cannot finish (the caller raises it); -1 out of memory. */
static int dpar__pipe_greedy_v(dpar_pipe_schedule *S, int limit)
{
    int p = S->p, m = S->m, n = 2 * p, s, c, i, rc = 0, total = 6 * m;
    const double inf = 1e300;
    double *t = (double *)dpar__calloc(&S->allocator, (size_t)p, sizeof(double));
    double *act = (double *)dpar__calloc(&S->allocator, (size_t)n * (size_t)m * 2, sizeof(double));
    double *grad = act ? act + (size_t)n * (size_t)m : NULL; /* when (virtual stage, micro) has its input, grad */
    int *next = (int *)dpar__calloc(&S->allocator, (size_t)p * 7, sizeof(int)); /* f, b, w per chunk; stashes */
    if (!t || !act || !next) {
        rc = -1;
        goto out;
    }
    for (i = 0; i < 2 * n * m; i++) act[i] = inf;
    for (i = 0; i < m; i++) act[i] = 0; /* virtual stage 0 reads its micro-batches itself */
    for (s = 0; s < p; s++) S->num_ops[s] = 0;
    for (;;) {
        double T = inf, when = inf;
        int any = 0;
        for (s = 0; s < p; s++)
            if (S->num_ops[s] < total && t[s] < T) T = t[s];
        if (T == inf) break;
        for (s = 0; s < p; s++) {
            int *f = next + 7 * s, *b = f + 2, *w = f + 4, *stash = f + 6, code = -1, micro = 0, chunk = 0, vs;
            double d;
            if (S->num_ops[s] == total || t[s] != T) continue;
            for (c = 1; c >= 0; c--) { /* B */
                vs = dpar__pipe_vs(S, s, c);
                if (b[c] < f[c] && grad[vs * m + b[c]] <= T && (code < 0 || b[c] < micro))
                    code = DPAR_PIPE_BACKWARD_INPUT, micro = b[c], chunk = c;
            }
            for (c = 1; c >= 0 && code < 0 && *stash < limit; c--) /* F */
                if (f[c] < m && act[dpar__pipe_vs(S, s, c) * m + f[c]] <= T)
                    code = DPAR_PIPE_FORWARD, micro = f[c], chunk = c;
            for (c = 1; c >= 0; c--) /* W */
                if (w[c] < b[c] && (code < 0 || (code == DPAR_PIPE_BACKWARD_WEIGHT && w[c] < micro)))
                    code = DPAR_PIPE_BACKWARD_WEIGHT, micro = w[c], chunk = c;
            if (code < 0) continue;
            dpar__pipe_add(S, s, code, micro, chunk);
            d = dpar__pipe_cost(S, code);
            t[s] = T + d;
            vs = dpar__pipe_vs(S, s, chunk);
            if (code == DPAR_PIPE_FORWARD) {
                f[chunk]++, (*stash)++;
                if (vs == n - 1) grad[vs * m + micro] = t[s]; /* the loss: its B may follow */
                else act[(vs + 1) * m + micro] = t[s];
            } else if (code == DPAR_PIPE_BACKWARD_INPUT) {
                b[chunk]++;
                if (vs > 0) grad[(vs - 1) * m + micro] = t[s];
            } else {
                w[chunk]++, (*stash)--;
            }
            any = 1;
        }
        if (any) continue;
        /* nobody could start at T: the next event */
        for (s = 0; s < p; s++) {
            if (S->num_ops[s] == total) continue;
            if (t[s] > T && t[s] < when) when = t[s];
            for (c = 0; c < 2; c++) {
                int *f = next + 7 * s, *b = f + 2, vs = dpar__pipe_vs(S, s, c);
                if (b[c] < f[c] && grad[vs * m + b[c]] > T && grad[vs * m + b[c]] < when) when = grad[vs * m + b[c]];
                if (f[c] < m && act[vs * m + f[c]] > T && act[vs * m + f[c]] < when) when = act[vs * m + f[c]];
            }
        }
        if (when == inf) { /* every stage waits for another: too few stashes */
            rc = 1;
            break;
        }
        for (s = 0; s < p; s++)
            if (S->num_ops[s] < total && t[s] == T) t[s] = when;
    }
out:
    dpar__free(&S->allocator, t);
    dpar__free(&S->allocator, act);
    dpar__free(&S->allocator, next);
    return rc;
}

/* DUALPIPEV: DeepSeek's DualPipeV order (dualpipev.py's eight steps) on stage s of p: each chunk's forwards and
   backwards in micro-batch order; a B followed at once by its W, or with its W deferred into a FIFO that the later
   "weight" steps empty (DualPipeV's zero-bubble steps). A pair of ops DualPipeV overlaps runs here one after the
   other, the forward first; backward_first: the backward first (ZBV's fixed order: the pair's forward then never
   adds a stash before the backward frees one, so at most 2p, 1F1B's memory, where DualPipeV holds 2p + 1). */
typedef struct {
    dpar_pipe_schedule *S;
    int s, f[2], b[2], head, tail;
    int *fifo; /* the deferred W's: micro-batch * 2 + chunk */
} dpar__dpv;
static void dpar__dpv_forward(dpar__dpv *g, int c) { dpar__pipe_add(g->S, g->s, DPAR_PIPE_FORWARD, g->f[c]++, c); }
static void dpar__dpv_backward(dpar__dpv *g, int c, int defer)
{
    int micro = g->b[c]++;
    dpar__pipe_add(g->S, g->s, DPAR_PIPE_BACKWARD_INPUT, micro, c);
    if (defer) g->fifo[g->tail++] = micro * 2 + c;
    else dpar__pipe_add(g->S, g->s, DPAR_PIPE_BACKWARD_WEIGHT, micro, c);
}
static void dpar__dpv_weight(dpar__dpv *g)
{
    int u = g->fifo[g->head++];
    dpar__pipe_add(g->S, g->s, DPAR_PIPE_BACKWARD_WEIGHT, u / 2, u % 2);
}
static void dpar__dpv_pair(dpar__dpv *g, int forward_chunk, int backward_first)
{
    if (backward_first) dpar__dpv_backward(g, 1 - forward_chunk, 0);
    dpar__dpv_forward(g, forward_chunk);
    if (!backward_first) dpar__dpv_backward(g, 1 - forward_chunk, 0);
}
static int dpar__pipe_generate_dpv(dpar_pipe_schedule *S, int backward_first)
{
    int p = S->p, m = S->m, s, i, defer;
    dpar__dpv g;
    memset(&g, 0, sizeof g);
    g.S = S;
    g.fifo = (int *)dpar__calloc(&S->allocator, 2 * (size_t)m, sizeof(int));
    if (!g.fifo) return -1;
    for (s = 0; s < p; s++) {
        g.s = s, g.f[0] = g.f[1] = g.b[0] = g.b[1] = g.head = g.tail = 0;
        S->num_ops[s] = 0;
        for (i = 0; i < (p - s - 1) * 2; i++) dpar__dpv_forward(&g, 0); /* 1: chunk 0's warm-up */
        for (i = 0; i < s + 1; i++) {                                   /* 2: F0 F1 */
            dpar__dpv_forward(&g, 0);
            dpar__dpv_forward(&g, 1);
        }
        for (i = 0; i < p - s - 1; i++) { /* 3: B1 W1 F1 */
            dpar__dpv_backward(&g, 1, 1);
            dpar__dpv_weight(&g);
            dpar__dpv_forward(&g, 1);
        }
        for (i = 0; i < m - 2 * p + s + 1; i++) { /* 4, the main step: F0 with B1, F1 with B0 */
            dpar__dpv_pair(&g, 0, backward_first);
            dpar__dpv_pair(&g, 1, backward_first);
        }
        for (i = 0; i < p - s - 1; i++) { /* 5: B1, F1 with B0 */
            dpar__dpv_backward(&g, 1, 0);
            dpar__dpv_pair(&g, 1, backward_first);
        }
        for (i = 0, defer = 0; i < s + 1; i++) { /* 6: B1 B0, the second half's W's deferred */
            if (i == (s + 1) / 2 && s % 2 == 1) defer = 1;
            dpar__dpv_backward(&g, 1, defer);
            if (i == (s + 1) / 2 && s % 2 == 0) defer = 1;
            dpar__dpv_backward(&g, 0, defer);
        }
        for (i = 0; i < p - s - 1; i++) { /* 7: W B0 */
            dpar__dpv_weight(&g);
            dpar__dpv_backward(&g, 0, 1);
        }
        while (g.head < g.tail) dpar__dpv_weight(&g); /* 8: the W's left (s + 1) */
    }
    dpar__free(&S->allocator, g.fifo);
    return 0;
}

/* A V schedule's messages. Each stage's compute ops (in S->ops) get a send right after the compute that makes its
   message, and before a compute that needs one, the receives of that channel up to it: a channel (an ordered pair of
   stages; a stage's own for the turn) delivers in the order it was sent, so a stage may receive a message early and
   hold it. Returns 0, -1 out of memory. */
static int dpar__pipe_wire(dpar_pipe_schedule *S)
{
    int p = S->p, m = S->m, n = 2 * p, s, k, rc = 0;
    size_t per = 3 * (size_t)m * 2; /* compute ops of a stage */
    dpar_pipe_op *comp = (dpar_pipe_op *)dpar__calloc(&S->allocator, per * (size_t)p, sizeof(dpar_pipe_op));
    /* [p] compute ops, [3p] a channel's next message to receive, [3p + 1] where its messages start, [3p] their
       count; a channel (from, to) is from * 3 + to - from + 1 */
    int *ncomp = (int *)dpar__calloc(&S->allocator, (size_t)p * 10 + 1, sizeof(int));
    int *chan = (int *)dpar__calloc(&S->allocator, (size_t)n * (size_t)m * 2, sizeof(int)); /* messages, in order */
    int *pos = (int *)dpar__calloc(&S->allocator, (size_t)n * (size_t)m * 2, sizeof(int));  /* (vs, micro, grad) */
    int *cursor = ncomp ? ncomp + p : NULL, *start = ncomp ? ncomp + 4 * p : NULL,
        *len = ncomp ? ncomp + 7 * p + 1 : NULL;
    if (!comp || !ncomp || !chan || !pos) {
        rc = -1;
        goto out;
    }
    /* a message is (the receiver's virtual stage, micro-batch, gradient?) */
    for (s = 0; s < p; s++) { /* how many each channel carries */
        ncomp[s] = S->num_ops[s];
        memcpy(comp + per * (size_t)s, S->ops[s], (size_t)ncomp[s] * sizeof(dpar_pipe_op));
        for (k = 0; k < ncomp[s]; k++) {
            const dpar_pipe_op *op = comp + per * (size_t)s + k;
            int vs = dpar__pipe_vs(S, s, op->chunk), to, tc, grad = op->code != DPAR_PIPE_FORWARD;
            if (op->code == DPAR_PIPE_BACKWARD_WEIGHT || (grad && vs == 0) || (!grad && vs == n - 1)) continue;
            dpar__pipe_place(S, grad ? vs - 1 : vs + 1, &to, &tc);
            start[s * 3 + to - s + 1 + 1]++;
        }
    }
    for (k = 0; k < 3 * p; k++) start[k + 1] += start[k];
    for (s = 0; s < p; s++) {
        for (k = 0; k < ncomp[s]; k++) {
            const dpar_pipe_op *op = comp + per * (size_t)s + k;
            int vs = dpar__pipe_vs(S, s, op->chunk), to, tc, ch, grad = op->code != DPAR_PIPE_FORWARD, dest;
            if (op->code == DPAR_PIPE_BACKWARD_WEIGHT || (grad && vs == 0) || (!grad && vs == n - 1)) continue;
            dest = grad ? vs - 1 : vs + 1;
            dpar__pipe_place(S, dest, &to, &tc);
            ch = s * 3 + to - s + 1;
            pos[((size_t)dest * (size_t)m + (size_t)op->micro) * 2 + (size_t)grad] = start[ch] + len[ch];
            chan[start[ch] + len[ch]++] = (dest * m + op->micro) * 2 + grad;
        }
    }
    for (s = 0; s < p; s++) {
        S->num_ops[s] = 0;
        for (k = 0; k < ncomp[s]; k++) {
            const dpar_pipe_op op = comp[per * (size_t)s + (size_t)k];
            int vs = dpar__pipe_vs(S, s, op.chunk), grad = op.code != DPAR_PIPE_FORWARD;
            if (op.code != DPAR_PIPE_BACKWARD_WEIGHT && (grad ? vs < n - 1 : vs > 0)) { /* receive up to its input */
                int from, fc, ch, want;
                dpar__pipe_place(S, grad ? vs + 1 : vs - 1, &from, &fc);
                ch = from * 3 + s - from + 1;
                want = pos[((size_t)vs * (size_t)m + (size_t)op.micro) * 2 + (size_t)grad];
                while (start[ch] + cursor[ch] <= want) {
                    int msg = chan[start[ch] + cursor[ch]++], ms, mc;
                    dpar__pipe_place(S, msg / 2 / m, &ms, &mc);
                    dpar__pipe_add(S, s, msg % 2 ? DPAR_PIPE_RECV_GRAD : DPAR_PIPE_RECV_ACT, msg / 2 % m, mc);
                }
            }
            dpar__pipe_add(S, s, op.code, op.micro, op.chunk);
            if (op.code != DPAR_PIPE_BACKWARD_WEIGHT && (grad ? vs > 0 : vs < n - 1))
                dpar__pipe_add(S, s, grad ? DPAR_PIPE_SEND_GRAD : DPAR_PIPE_SEND_ACT, op.micro, op.chunk);
        }
    }
out:
    dpar__free(&S->allocator, comp);
    dpar__free(&S->allocator, ncomp);
    dpar__free(&S->allocator, chan);
    dpar__free(&S->allocator, pos);
    return rc;
}

static int dpar__pipe_simulate(dpar_pipe_schedule *S, double *makespan, double *busy, int *peak, double **start,
                               char *msg, size_t n);
/* the schedule's simulated makespan (a huge one when it cannot be laid out); -1 when out of memory */
static double dpar__pipe_makespan(dpar_pipe_schedule *S)
{
    double makespan = 1e300, *busy = (double *)dpar__calloc(&S->allocator, (size_t)S->p, sizeof(double));
    int *peak = (int *)dpar__calloc(&S->allocator, (size_t)S->p, sizeof(int)), rc;
    char msg[64];
    if (!busy || !peak) makespan = -1;
    else if ((rc = dpar__pipe_simulate(S, &makespan, busy, peak, NULL, msg, sizeof msg)) != 0)
        makespan = rc < 0 ? -1 : 1e300;
    dpar__free(&S->allocator, busy);
    dpar__free(&S->allocator, peak);
    return makespan;
}

/* ZBV: the greedy's order on the desc's costs; with m >= 2p also the fixed V order (DualPipeV's with each pair's
   backward first: at most 2p stashes, and with equal costs the bound (p-1)/(6m+p-1) for every p), and the one of
   the two that simulates shorter (the fixed one on a tie). Returns -1 out of memory, 1 no order found, 0. */
static int dpar__pipe_generate_v(dpar_pipe_schedule *S)
{
    int limit = 2 * S->p, rc, s;
    double greedy, fixed;
    dpar_pipe_op **saved;
    int *saved_num;
    if (S->kind == DPAR_PIPE_DUALPIPEV) return (rc = dpar__pipe_generate_dpv(S, 0)) != 0 ? rc : dpar__pipe_wire(S);
    /* more stashes until it finishes: at 2m nothing waits for memory, and a list scheduler without a resource limit
       always finds a ready op in a DAG, so the loop ends there at the latest */
    while ((rc = dpar__pipe_greedy_v(S, limit)) == 1 && limit < 2 * S->m) limit++;
    if (rc || (rc = dpar__pipe_wire(S)) != 0 || S->m < 2 * S->p) return rc;
    if ((greedy = dpar__pipe_makespan(S)) < 0) return -1;
    saved = (dpar_pipe_op **)dpar__calloc(&S->allocator, (size_t)S->p, sizeof(dpar_pipe_op *));
    saved_num = (int *)dpar__calloc(&S->allocator, (size_t)S->p, sizeof(int));
    for (s = 0; s < S->p && saved && saved_num; s++) { /* keep the greedy's ops: the fixed order goes into new ones */
        saved[s] = S->ops[s];
        saved_num[s] = S->num_ops[s];
        S->ops[s] = (dpar_pipe_op *)dpar__calloc(&S->allocator, (size_t)S->m * (size_t)S->v * 7, sizeof(dpar_pipe_op));
        if (!S->ops[s]) break;
    }
    if (!saved || !saved_num || s < S->p || (rc = dpar__pipe_generate_dpv(S, 1)) != 0 ||
        (rc = dpar__pipe_wire(S)) != 0 || (fixed = dpar__pipe_makespan(S)) < 0)
        rc = -1;
    else if (fixed > greedy) rc = 1; /* keep the greedy's */
    for (s = 0; s < S->p && saved && saved_num; s++) {
        if (rc && saved[s]) { /* back to the greedy's ops */
            dpar__free(&S->allocator, S->ops[s]);
            S->ops[s] = saved[s];
            S->num_ops[s] = saved_num[s];
        } else {
            dpar__free(&S->allocator, saved[s]);
        }
    }
    dpar__free(&S->allocator, saved);
    dpar__free(&S->allocator, saved_num);
    return rc < 0 ? -1 : 0;
}

static int dpar__pipe_generate(dpar_pipe_schedule *S)
{
    int p = S->p, m = S->m, v = S->v, s, i, k;
    if (dpar__pipe_vshape(S)) return dpar__pipe_generate_v(S);
    if (S->kind == DPAR_PIPE_ZB_H1) {
        dpar__pipe_generate_zb(S);
        return 0;
    }
    for (s = 0; s < p; s++) {
        S->num_ops[s] = 0;
        if (S->kind == DPAR_PIPE_GPIPE) {
            for (i = 0; i < m; i++) dpar__pipe_fwd(S, s, i, 0);
            for (i = 0; i < m; i++) dpar__pipe_bwd(S, s, i, 0);
        } else if (S->kind == DPAR_PIPE_1F1B) {
            int warm = p - s - 1 < m ? p - s - 1 : m;
            for (i = 0; i < warm; i++) dpar__pipe_fwd(S, s, i, 0);
            for (i = 0; i < m - warm; i++) {
                dpar__pipe_fwd(S, s, warm + i, 0);
                dpar__pipe_bwd(S, s, i, 0);
            }
            for (i = m - warm; i < m; i++) dpar__pipe_bwd(S, s, i, 0);
        } else {
            int n = m * v, warm = m == p ? n : (p - s - 1) * 2 + (v - 1) * p, mi, ci;
            if (warm > n) warm = n;
            for (k = 0; k < warm; k++) {
                dpar__pipe_unit(S, k, 0, &mi, &ci);
                dpar__pipe_fwd(S, s, mi, ci);
            }
            for (k = 0; k < n - warm; k++) {
                dpar__pipe_unit(S, warm + k, 0, &mi, &ci);
                dpar__pipe_fwd(S, s, mi, ci);
                dpar__pipe_unit(S, k, 1, &mi, &ci);
                dpar__pipe_bwd(S, s, mi, ci);
            }
            for (k = n - warm; k < n; k++) {
                dpar__pipe_unit(S, k, 1, &mi, &ci);
                dpar__pipe_bwd(S, s, mi, ci);
            }
        }
    }
    return 0;
}

static const char *dpar__pipe_names[] = {"forward",
                                         "backward",
                                         "send of the activation",
                                         "receive of the activation",
                                         "send of the gradient",
                                         "receive of the gradient",
                                         "input gradient (B)",
                                         "weight gradient (W)"};

/* Where a send from stage s (chunk c) goes: the stage and chunk of the next (act) or previous
   (grad) virtual stage. */
static void dpar__pipe_peer(const dpar_pipe_schedule *S, int s, int c, int act, int *ps, int *pc)
{
    dpar__pipe_place(S, dpar__pipe_vs(S, s, c) + (act ? 1 : -1), ps, pc);
}

static int dpar__pipe_compute(int code)
{
    return code == DPAR_PIPE_FORWARD || code == DPAR_PIPE_BACKWARD || code == DPAR_PIPE_BACKWARD_INPUT ||
           code == DPAR_PIPE_BACKWARD_WEIGHT;
}
/* the simulated time of a compute op: the schedule's costs (0: 1), a whole backward B + W */
static double dpar__pipe_cost(const dpar_pipe_schedule *S, int code)
{
    double f = S->cost[0] > 0 ? S->cost[0] : 1.0, b = S->cost[1] > 0 ? S->cost[1] : 1.0;
    double w = S->cost[2] > 0 ? S->cost[2] : 1.0;
    return code == DPAR_PIPE_FORWARD          ? f
           : code == DPAR_PIPE_BACKWARD_INPUT ? b
           : code == DPAR_PIPE_BACKWARD       ? b + w
                                              : w;
}

/* The simulation: stages run their ops in order, each compute op for its cost (dpar__pipe_cost); a receive waits for
   its message; a send waits while DPAR__QDEPTH messages are unconsumed on its channel. A channel is
   an ordered pair of stages, shared by activations and gradients (as on the transport). Returns 0,
   1 with the deadlock story, or -1 out of memory. Fills per-op start times when `start` is not NULL. */
typedef struct {
    double ready;
} dpar__pipe_msg;
static int dpar__pipe_simulate(dpar_pipe_schedule *S, double *makespan, double *busy, int *peak, double **start,
                               char *msg, size_t n)
{
    int p = S->p, s, nch = p * p, progress = 1, done = 0, maxq = 2 * S->m * S->v + 1;
    int *pc = (int *)dpar__calloc(&S->allocator, (size_t)p, sizeof(int));
    int *stash = (int *)dpar__calloc(&S->allocator, (size_t)p, sizeof(int));
    double *t = (double *)dpar__calloc(&S->allocator, (size_t)p, sizeof(double));
    double *ready = (double *)dpar__calloc(&S->allocator, (size_t)nch * (size_t)maxq, sizeof(double));
    double *freed = (double *)dpar__calloc(&S->allocator, (size_t)nch * (size_t)maxq, sizeof(double));
    int *qhead = (int *)dpar__calloc(&S->allocator, (size_t)nch, sizeof(int));
    int *qtail = (int *)dpar__calloc(&S->allocator, (size_t)nch, sizeof(int));
    int rc = 0;
    if (!pc || !stash || !t || !ready || !freed || !qhead || !qtail) {
        snprintf(msg, n, "out of memory simulating the schedule");
        rc = -1;
        goto out;
    }
    for (s = 0; s < p; s++) {
        busy[s] = 0;
        peak[s] = 0;
    }
    while (progress && done < p) {
        progress = 0;
        done = 0;
        for (s = 0; s < p; s++) {
            for (;;) {
                dpar_pipe_op *op;
                int ps, pcc, ch;
                size_t at;
                if (pc[s] == S->num_ops[s]) {
                    done++;
                    break;
                }
                op = &S->ops[s][pc[s]];
                if (dpar__pipe_compute(op->code)) {
                    double d = dpar__pipe_cost(S, op->code);
                    if (start) start[s][pc[s]] = t[s];
                    t[s] += d;
                    busy[s] += d;
                    /* a stash lives from the forward to the backward that ends its use: the whole one, or W */
                    stash[s] += op->code == DPAR_PIPE_FORWARD ? 1 : op->code == DPAR_PIPE_BACKWARD_INPUT ? 0 : -1;
                    if (stash[s] > peak[s]) peak[s] = stash[s];
                } else if (op->code == DPAR_PIPE_SEND_ACT || op->code == DPAR_PIPE_SEND_GRAD) {
                    dpar__pipe_peer(S, s, op->chunk, op->code == DPAR_PIPE_SEND_ACT, &ps, &pcc);
                    ch = s * p + ps;
                    /* the channel is full: wait (a stage's own, the V's turn, is a local hand-off: never full) */
                    if (ps != s && qtail[ch] - qhead[ch] >= DPAR__QDEPTH) break;
                    at = (size_t)ch * (size_t)maxq;
                    if (ps != s && qtail[ch] >= DPAR__QDEPTH && freed[at + (size_t)(qtail[ch] - DPAR__QDEPTH)] > t[s])
                        t[s] = freed[at + (size_t)(qtail[ch] - DPAR__QDEPTH)];
                    ready[at + (size_t)qtail[ch]++] = t[s];
                } else {
                    dpar__pipe_peer(S, s, op->chunk, op->code == DPAR_PIPE_RECV_GRAD, &ps, &pcc);
                    ch = ps * p + s;
                    if (qhead[ch] == qtail[ch]) break; /* not sent yet: wait */
                    at = (size_t)ch * (size_t)maxq + (size_t)qhead[ch]++;
                    if (ready[at] > t[s]) t[s] = ready[at];
                    freed[at] = t[s];
                }
                pc[s]++;
                progress = 1;
            }
        }
    }
    if (done < p) {
        int k = snprintf(msg, n, "the schedule deadlocks (rule: no deadlock):");
        for (s = 0; s < p && k > 0 && (size_t)k < n; s++)
            if (pc[s] < S->num_ops[s]) {
                dpar_pipe_op *op = &S->ops[s][pc[s]];
                k += snprintf(msg + k, n - (size_t)k, " stage %d waits at op %d (%s of micro-batch %d, chunk %d);", s,
                              pc[s], dpar__pipe_names[op->code], op->micro, op->chunk);
            }
        rc = 1;
        goto out;
    }
    *makespan = 0;
    for (s = 0; s < p; s++)
        if (t[s] > *makespan) *makespan = t[s];
out:
    dpar__free(&S->allocator, pc);
    dpar__free(&S->allocator, stash);
    dpar__free(&S->allocator, t);
    dpar__free(&S->allocator, ready);
    dpar__free(&S->allocator, freed);
    dpar__free(&S->allocator, qhead);
    dpar__free(&S->allocator, qtail);
    return rc;
}

/* the next send from stage s to stage d at or after op *k (act and grad alike), or NULL */
static dpar_pipe_op *dpar__pipe_next_send(const dpar_pipe_schedule *S, int s, int d, int *k, int *dchunk)
{
    for (; *k < S->num_ops[s]; (*k)++) {
        dpar_pipe_op *o = &S->ops[s][*k];
        int ps;
        if (o->code != DPAR_PIPE_SEND_ACT && o->code != DPAR_PIPE_SEND_GRAD) continue;
        dpar__pipe_peer(S, s, o->chunk, o->code == DPAR_PIPE_SEND_ACT, &ps, dchunk);
        if (ps == d) return o;
    }
    return NULL;
}
/* the next receive at stage d from stage s at or after op *k, or NULL */
static dpar_pipe_op *dpar__pipe_next_recv(const dpar_pipe_schedule *S, int d, int s, int *k)
{
    for (; *k < S->num_ops[d]; (*k)++) {
        dpar_pipe_op *o = &S->ops[d][*k];
        int ps, pc;
        if (o->code != DPAR_PIPE_RECV_ACT && o->code != DPAR_PIPE_RECV_GRAD) continue;
        dpar__pipe_peer(S, d, o->chunk, o->code == DPAR_PIPE_RECV_GRAD, &ps, &pc);
        if (ps == s) return o;
    }
    return NULL;
}

#define DPAR__PIPE_FAIL(...) return dpar__err(DPAR_EINVAL, "dpar_pipe_schedule_check: " __VA_ARGS__)

DPAR_API dpar_status dpar_pipe_schedule_check(dpar_pipe_schedule *S)
{
    int p, m, v, s, k, i, c;
    unsigned char *seen; /* per stage and (micro, chunk): bits of the ops done */
    double makespan = 0, *busy, total = 0;
    char msg[DPAR__ERROR_TEXT];
    enum { F = 1, B = 2, SA = 4, RA = 8, SG = 16, RG = 32, BI = 64, BW = 128 };
    if (!S || !S->num_ops || !S->ops) return dpar__err(DPAR_EINVAL, "dpar_pipe_schedule_check: schedule is NULL");
    p = S->p;
    m = S->m;
    v = S->v;
    if (p < 1 || m < 1 || v < 1) DPAR__PIPE_FAIL("p = %d, m = %d, v = %d (each must be at least 1)", p, m, v);
    if (S->kind == DPAR_PIPE_INTERLEAVED && (m < p || m % p))
        DPAR__PIPE_FAIL(
            "an interleaved schedule needs m at least p and a multiple of it (rule: m >= p); m = %d, p = %d", m, p);
    if (dpar__pipe_vshape(S) && v != 2) DPAR__PIPE_FAIL("a V schedule has 2 chunks per stage (rule: v = 2); v = %d", v);
    seen = (unsigned char *)dpar__calloc(&S->allocator, (size_t)p * (size_t)m * (size_t)v, 1);
    if (!seen) return dpar__err(DPAR_ENOMEM, "dpar_pipe_schedule_check: out of memory");
#define DPAR__SEEN(s, i, c) seen[(m * (size_t)(s) + (size_t)(i)) * v + (size_t)(c)]
#define DPAR__BAD(...)                   \
    do {                                 \
        dpar__free(&S->allocator, seen); \
        DPAR__PIPE_FAIL(__VA_ARGS__);    \
    } while (0)
    for (s = 0; s < p; s++) {
        for (k = 0; k < S->num_ops[s]; k++) {
            dpar_pipe_op *op = &S->ops[s][k];
            int first, last;
            unsigned char *b;
            if ((unsigned)op->code > DPAR_PIPE_BACKWARD_WEIGHT)
                DPAR__BAD("stage %d op %d: code %d is not an op", s, k, op->code);
            if (op->micro < 0 || op->micro >= m || op->chunk < 0 || op->chunk >= v)
                DPAR__BAD("stage %d op %d: micro-batch %d, chunk %d is outside 0..%d, 0..%d", s, k, op->micro,
                          op->chunk, m - 1, v - 1);
            first = dpar__pipe_first(S, s, op->chunk);
            last = dpar__pipe_last(S, s, op->chunk);
            b = &DPAR__SEEN(s, op->micro, op->chunk);
#define DPAR__AT "stage %d op %d (%s of micro-batch %d, chunk %d): "
#define DPAR__ATV s, k, dpar__pipe_names[op->code], op->micro, op->chunk
            switch (op->code) {
            case DPAR_PIPE_FORWARD:
                if (*b & F) DPAR__BAD(DPAR__AT "appears twice (rule: each forward once)", DPAR__ATV);
                if (!first && !(*b & RA))
                    DPAR__BAD(DPAR__AT "comes before its activation is received (rule: every receive before the "
                                       "compute that needs it)",
                              DPAR__ATV);
                *b |= F;
                break;
            case DPAR_PIPE_BACKWARD:
            case DPAR_PIPE_BACKWARD_INPUT:
                if (*b & (B | BI)) DPAR__BAD(DPAR__AT "appears twice (rule: each backward once)", DPAR__ATV);
                if (!(*b & F))
                    DPAR__BAD(DPAR__AT "comes before its forward (rule: every backward after its forward)", DPAR__ATV);
                if (!last && !(*b & RG))
                    DPAR__BAD(DPAR__AT "comes before the gradient of its output is received (rule: every receive "
                                       "before the compute that needs it)",
                              DPAR__ATV);
                *b |= op->code == DPAR_PIPE_BACKWARD ? B : BI;
                break;
            case DPAR_PIPE_BACKWARD_WEIGHT:
                if (*b & (B | BW)) DPAR__BAD(DPAR__AT "appears twice (rule: each backward once)", DPAR__ATV);
                if (!(*b & BI))
                    DPAR__BAD(DPAR__AT "comes before its input gradient (rule: every W after the B of its unit)",
                              DPAR__ATV);
                *b |= BW;
                break;
            case DPAR_PIPE_SEND_ACT:
                if (last) DPAR__BAD(DPAR__AT "the last virtual stage has no activation to send", DPAR__ATV);
                if (!(*b & F) || (*b & SA))
                    DPAR__BAD(DPAR__AT "comes before its forward or twice (rule: every send after the compute that "
                                       "makes it)",
                              DPAR__ATV);
                *b |= SA;
                break;
            case DPAR_PIPE_RECV_ACT:
                if (first) DPAR__BAD(DPAR__AT "the first virtual stage receives no activation", DPAR__ATV);
                if (*b & RA) DPAR__BAD(DPAR__AT "appears twice", DPAR__ATV);
                *b |= RA;
                break;
            case DPAR_PIPE_SEND_GRAD:
                if (first) DPAR__BAD(DPAR__AT "the first virtual stage has no input gradient to send", DPAR__ATV);
                if (!(*b & (B | BI)) || (*b & SG))
                    DPAR__BAD(DPAR__AT "comes before its backward or twice (rule: every send after the compute that "
                                       "makes it)",
                              DPAR__ATV);
                *b |= SG;
                break;
            default:
                if (last) DPAR__BAD(DPAR__AT "the last virtual stage receives no gradient", DPAR__ATV);
                if (*b & RG) DPAR__BAD(DPAR__AT "appears twice", DPAR__ATV);
                *b |= RG;
                break;
            }
        }
        for (i = 0; i < m; i++)
            for (c = 0; c < v; c++) {
                unsigned char b = DPAR__SEEN(s, i, c), want = b & BI ? F + BI + BW : F + B; /* distinct bits */
                if (!dpar__pipe_first(S, s, c)) want |= RA | SG;
                if (!dpar__pipe_last(S, s, c)) want |= SA | RG;
                if ((b & want) != want)
                    DPAR__BAD("stage %d never does the %s of micro-batch %d, chunk %d (rule: each forward and backward "
                              "once, with its sends and receives)",
                              s,
                              dpar__pipe_names[!(b & F)                   ? 0
                                               : !(b & (B | BI))          ? 1
                                               : !(b & BW) && (want & BW) ? 7
                                               : !(b & SA) && (want & SA) ? 2
                                               : !(b & RA) && (want & RA) ? 3
                                               : !(b & SG) && (want & SG) ? 4
                                                                          : 5],
                              i, c);
            }
    }
    /* the messages from stage s to stage d (activations and gradients share the channel) are
       received in the order they are sent */
    for (s = 0; s < p; s++) {
        int d;
        for (d = 0; d < p; d++) {
            int ks = 0, kr = 0;
            for (;;) {
                int dc = -1;
                dpar_pipe_op *snd = dpar__pipe_next_send(S, s, d, &ks, &dc), *rcv = dpar__pipe_next_recv(S, d, s, &kr);
                if (!snd && !rcv) break;
                if (!snd || !rcv || snd->micro != rcv->micro || dc != rcv->chunk || snd->code + 1 != rcv->code)
                    DPAR__BAD("stage %d op %d sends %s while stage %d op %d receives %s (rule: sends and receives "
                              "between neighbours in the same order)",
                              s, ks,
                              snd ? (snd->code == DPAR_PIPE_SEND_ACT ? "an activation" : "a gradient") : "nothing", d,
                              kr, rcv ? (rcv->code == DPAR_PIPE_RECV_ACT ? "an activation" : "a gradient") : "nothing");
                ks++;
                kr++;
            }
        }
    }
    dpar__free(&S->allocator, seen);
#undef DPAR__SEEN
#undef DPAR__BAD
#undef DPAR__AT
#undef DPAR__ATV
    busy = (double *)dpar__calloc(&S->allocator, (size_t)p, sizeof(double));
    if (!busy) return dpar__err(DPAR_ENOMEM, "dpar_pipe_schedule_check: out of memory");
    if ((k = dpar__pipe_simulate(S, &makespan, busy, S->peak_stash, NULL, msg, sizeof msg)) != 0) {
        dpar__free(&S->allocator, busy);
        return dpar__err(k < 0 ? DPAR_ENOMEM : DPAR_EINVAL, "dpar_pipe_schedule_check: %s", msg);
    }
    for (s = 0; s < p; s++) total += busy[s];
    S->bubble = makespan > 0 ? 1.0 - total / (p * makespan) : 0.0;
    dpar__free(&S->allocator, busy);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_pipe_schedule_destroy(dpar_pipe_schedule *S)
{
    int s;
    dpar_allocator a;
    if (!S) return DPAR_OK;
    a = S->allocator;
    if (S->ops)
        for (s = 0; s < S->p; s++) dpar__free(&a, S->ops[s]);
    dpar__free(&a, S->ops);
    dpar__free(&a, S->num_ops);
    dpar__free(&a, S->peak_stash);
    dpar__free(&a, S);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_pipe_schedule_create(const dpar_pipe_schedule_desc *desc, dpar_pipe_schedule **out)
{
    dpar_pipe_schedule *S;
    dpar_allocator a;
    dpar_pipe_kind kind;
    int s, p, m, v;
    dpar_status st;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_pipe_schedule_create: out is NULL");
    *out = NULL;
    if (!desc) return dpar__err(DPAR_EINVAL, "dpar_pipe_schedule_create: desc is NULL (p and m are required)");
    DPAR__TRY(dpar__check_allocator("dpar_pipe_schedule_create", &desc->allocator));
    a = desc->allocator, kind = desc->kind, p = desc->p, m = desc->m, v = desc->v ? desc->v : 1;
    if ((unsigned)kind > DPAR_PIPE_DUALPIPEV)
        return dpar__err(DPAR_EINVAL, "dpar_pipe_schedule_create: kind %d (0..%d)", (int)kind,
                         (int)DPAR_PIPE_DUALPIPEV);
    if ((kind == DPAR_PIPE_ZBV || kind == DPAR_PIPE_DUALPIPEV) && !desc->v) v = 2;
    {
        const double costs[3] = {desc->cost_forward, desc->cost_input_grad, desc->cost_weight_grad};
        static const char *names[3] = {"cost_forward", "cost_input_grad", "cost_weight_grad"};
        int i;
        for (i = 0; i < 3; i++)
            if (!(costs[i] >= 0 && costs[i] <= 1e9)) /* NaN fails both */
                return dpar__err(DPAR_EINVAL, "dpar_pipe_schedule_create: %s = %g (0 for 1, or a time in 0..1e9)",
                                 names[i], costs[i]);
    }
    if (p < 1 || m < 1 || p > 4096 || m > 65535)
        return dpar__err(DPAR_EINVAL,
                         "dpar_pipe_schedule_create: p = %d, m = %d (1..4096 stages, 1..65535 "
                         "micro-batches)",
                         p, m);
    if ((kind == DPAR_PIPE_ZBV || kind == DPAR_PIPE_DUALPIPEV) && v != 2)
        return dpar__err(DPAR_EINVAL, "dpar_pipe_schedule_create: v = %d, but a V schedule (%s) has 2 chunks per stage",
                         v, kind == DPAR_PIPE_ZBV ? "ZBV" : "DUALPIPEV");
    if (kind == DPAR_PIPE_DUALPIPEV && m < 2 * p)
        return dpar__err(DPAR_EINVAL,
                         "dpar_pipe_schedule_create: DUALPIPEV needs at least 2p micro-batches; m = %d, p = %d", m, p);
    if (kind != DPAR_PIPE_INTERLEAVED && kind != DPAR_PIPE_ZBV && kind != DPAR_PIPE_DUALPIPEV && v != 1)
        return dpar__err(DPAR_EINVAL,
                         "dpar_pipe_schedule_create: v = %d chunks per stage needs "
                         "DPAR_PIPE_INTERLEAVED",
                         v);
    if (kind == DPAR_PIPE_INTERLEAVED && (v < 1 || v > 64))
        return dpar__err(DPAR_EINVAL, "dpar_pipe_schedule_create: v = %d chunks per stage (1..64)", v);
    if (kind == DPAR_PIPE_INTERLEAVED && (m < p || m % p))
        return dpar__err(DPAR_EINVAL,
                         "dpar_pipe_schedule_create: the interleaved schedule needs m at least p and a "
                         "multiple of it; m = %d, p = %d",
                         m, p);
    S = (dpar_pipe_schedule *)dpar__calloc(&a, 1, sizeof *S);
    if (!S) return dpar__err(DPAR_ENOMEM, "dpar_pipe_schedule_create: out of memory");
    S->allocator = a;
    S->p = p;
    S->m = m;
    S->v = v;
    S->kind = kind;
    S->cost[0] = desc->cost_forward > 0 ? desc->cost_forward : 1.0;
    S->cost[1] = desc->cost_input_grad > 0 ? desc->cost_input_grad : 1.0;
    S->cost[2] = desc->cost_weight_grad > 0 ? desc->cost_weight_grad : 1.0;
    S->num_ops = (int *)dpar__calloc(&a, (size_t)p, sizeof(int));
    S->peak_stash = (int *)dpar__calloc(&a, (size_t)p, sizeof(int));
    S->ops = (dpar_pipe_op **)dpar__calloc(&a, (size_t)p, sizeof(dpar_pipe_op *));
    if (!S->num_ops || !S->peak_stash || !S->ops) {
        dpar_pipe_schedule_destroy(S);
        return dpar__err(DPAR_ENOMEM, "dpar_pipe_schedule_create: out of memory");
    }
    for (s = 0; s < p; s++)
        if (!(S->ops[s] = (dpar_pipe_op *)dpar__calloc(&a, (size_t)m * (size_t)v * 7, sizeof(dpar_pipe_op)))) {
            dpar_pipe_schedule_destroy(S);
            return dpar__err(DPAR_ENOMEM, "dpar_pipe_schedule_create: out of memory");
        }
    if ((s = dpar__pipe_generate(S)) != 0) { /* -1: out of memory; 1: ZBV's scheduler found no order */
        dpar_pipe_schedule_destroy(S);
        return s < 0 ? dpar__err(DPAR_ENOMEM, "dpar_pipe_schedule_create: out of memory")
                     : dpar__err(DPAR_EINVAL, "dpar_pipe_schedule_create: ZBV found no order (a bug of dpar's)");
    }
    if ((st = dpar_pipe_schedule_check(S)) != DPAR_OK) { /* dpar's own schedules always pass */
        dpar_pipe_schedule_destroy(S);
        return st;
    }
    *out = S;
    return DPAR_OK;
}

DPAR_API size_t dpar_pipe_schedule_format(const dpar_pipe_schedule *S0, char *buf, size_t size)
{
    static const char *kinds[] = {"GPipe", "1F1B", "interleaved 1F1B", "ZB-H1", "ZB-V", "DualPipeV"};
    dpar_pipe_schedule *S = (dpar_pipe_schedule *)(uintptr_t)S0; /* the simulation only reads it */
    double makespan = 0, *busy, **start;
    int p, s, k, cells, *peak, bad = 0;
    size_t len = 0;
    char msg[DPAR__ERROR_TEXT], *line;
#define DPAR__OUT(...)                                                                                            \
    do {                                                                                                          \
        int w_ = snprintf(buf && len < size ? buf + len : NULL, buf && len < size ? size - len : 0, __VA_ARGS__); \
        if (w_ > 0) len += (size_t)w_;                                                                            \
    } while (0)
    if (buf && size) buf[0] = 0;
    if (!S) return 0;
    p = S->p;
    busy = (double *)dpar__calloc(&S->allocator, (size_t)p, sizeof(double));
    peak = (int *)dpar__calloc(&S->allocator, (size_t)p, sizeof(int));
    start = (double **)dpar__calloc(&S->allocator, (size_t)p, sizeof(double *));
    for (s = 0; s < p && start; s++)
        start[s] = (double *)dpar__calloc(&S->allocator, (size_t)S->num_ops[s] + 1, sizeof(double));
    DPAR__OUT("%s, p=%d stages, m=%d micro-batches%s", (unsigned)S->kind < 6 ? kinds[S->kind] : "?", p, S->m,
              S->v > 1 ? "" : "");
    if (S->v > 1) DPAR__OUT(", v=%d chunks", S->v);
    DPAR__OUT(": predicted bubble %.3f, peak stash", S->bubble);
    for (s = 0; s < p && S->peak_stash; s++) DPAR__OUT(" %d", S->peak_stash[s]);
    DPAR__OUT("\n");
    if (busy && peak && start) { /* only a schedule the checker passes can be laid out (issue 19's fuzzing) */
        dpar_pipe_schedule copy = *S;
        copy.peak_stash = peak;
        if (dpar_pipe_schedule_check(&copy) != DPAR_OK) {
            snprintf(msg, sizeof msg, "%s", dpar_last_error());
            bad = 1;
        }
    }
    if (!bad && (!busy || !peak || !start)) {
        snprintf(msg, sizeof msg, "out of memory");
        bad = 1;
    }
    if (bad || dpar__pipe_simulate(S, &makespan, busy, peak, start, msg, sizeof msg)) {
        DPAR__OUT("(cannot lay it out: %s)\n", msg);
    } else {
        cells = (int)(makespan + 0.5);
        line = (char *)dpar__alloc(&S->allocator, (size_t)cells * 4 + 1);
        for (s = 0; s < p && line; s++) {
            memset(line, ' ', (size_t)cells * 4);
            for (k = 0; k < cells; k++) line[k * 4 + 1] = '.';
            line[cells * 4] = 0;
            for (k = 0; k < S->num_ops[s]; k++) {
                dpar_pipe_op *op = &S->ops[s][k];
                int c, w, j;
                char cell[8];
                if (!dpar__pipe_compute(op->code)) continue;
                c = (int)(start[s][k] + 0.5);
                w = (int)(dpar__pipe_cost(S, op->code) + 0.5);
                if (w < 1) w = 1;
                if (c >= cells) continue;
                for (j = 0; j < w && c + j < cells; j++) memcpy(line + (c + j) * 4, j ? "====" : "    ", 4);
                snprintf(cell, sizeof cell, "%c%d%c",
                         op->code == DPAR_PIPE_FORWARD           ? 'F'
                         : op->code == DPAR_PIPE_BACKWARD_WEIGHT ? 'W'
                                                                 : 'B',
                         op->micro, S->v > 1 ? 'a' + op->chunk : ' ');
                memcpy(line + c * 4, cell, strlen(cell) < 4 ? strlen(cell) : 4);
            }
            DPAR__OUT("stage %-2d|%s|\n", s, line);
        }
        dpar__free(&S->allocator, line);
    }
    for (s = 0; s < p && start; s++) dpar__free(&S->allocator, start[s]);
    dpar__free(&S->allocator, start);
    dpar__free(&S->allocator, busy);
    dpar__free(&S->allocator, peak);
#undef DPAR__OUT
    return len;
}

/* ---- the stage runner ---- */
struct dpar_pipe {
    dpar_pipe_desc d;
    int stage;
    void **free_bufs; /* buffers not in use */
    void **all_bufs;  /* every buffer, for destroy */
    int nfree, nbufs, cap;
    void **stash, **grad_out, **pending; /* [m * v]: input activation, output gradient, made but not sent */
    void *ring[2][DPAR__QDEPTH];         /* the last buffers posted to the next [0] and previous [1] stage */
    uint32_t posted[2];
    void **local; /* [2 m v]: messages to this stage itself (a V's turn, p = 1), in order */
    int *local_tag, local_head, local_tail;
    /* dpar_pipe_saved's buffers: [0] saved_bytes, [1] recompute_bytes; per unit, a free list, every buffer */
    void **unit_buf[2], **spare[2], **every[2];
    int nspare[2], nevery[2], live[2], peak[2], predicted[2];
    void *cur[2]; /* the current callback's */
};

/* a saved (k = 0) or recompute (k = 1) buffer for unit u, from the list or the allocator; 1 when out of memory */
static int dpar__pipe_hold(dpar_pipe *pp, int k, size_t u)
{
    void *b = pp->nspare[k] ? pp->spare[k][--pp->nspare[k]] : NULL;
    if (!b) {
        b = dpar__alloc(&pp->d.allocator, k ? pp->d.recompute_bytes : pp->d.saved_bytes);
        if (!b) return 1;
        pp->every[k][pp->nevery[k]++] = b;
    }
    pp->unit_buf[k][u] = b;
    if (++pp->live[k] > pp->peak[k]) pp->peak[k] = pp->live[k];
    return 0;
}
static void dpar__pipe_drop(dpar_pipe *pp, int k, size_t u)
{
    if (!pp->unit_buf[k][u]) return;
    pp->spare[k][pp->nspare[k]++] = pp->unit_buf[k][u];
    pp->unit_buf[k][u] = NULL;
    pp->live[k]--;
}

/* the most saved and recompute buffers this stage's ops hold at once: saved from the forward to the end of the
   unit's backward (its W when split); recompute from the forward run again before the backward (or B) to that end */
static void dpar__pipe_predict(dpar_pipe *pp)
{
    const dpar_pipe_schedule *S = pp->d.schedule;
    int k, live[2] = {0, 0}, j, re = pp->d.recompute_bytes > 0;
    int has[2];
    has[0] = pp->d.saved_bytes > 0, has[1] = re;
    pp->predicted[0] = pp->predicted[1] = 0;
    for (k = 0; k < S->num_ops[pp->stage]; k++) {
        int code = S->ops[pp->stage][k].code;
        if (code == DPAR_PIPE_FORWARD) live[0] += has[0];
        if (re && (code == DPAR_PIPE_BACKWARD || code == DPAR_PIPE_BACKWARD_INPUT)) live[1]++;
        for (j = 0; j < 2; j++)
            if (live[j] > pp->predicted[j]) pp->predicted[j] = live[j];
        if (code == DPAR_PIPE_BACKWARD || code == DPAR_PIPE_BACKWARD_WEIGHT) live[0] -= has[0], live[1] -= re;
    }
}

DPAR_API void *dpar_pipe_saved(dpar_pipe *pp, void **recomputed)
{
    if (recomputed) *recomputed = pp ? pp->cur[1] : NULL;
    return pp ? pp->cur[0] : NULL;
}

static void *dpar__pipe_take(dpar_pipe *pp)
{
    void *b;
    if (pp->nfree) return pp->free_bufs[--pp->nfree];
    if (pp->nbufs == pp->cap) { /* warming up: longer lists (their size settles after the first run) */
        int cap = pp->cap ? 2 * pp->cap : 16;
        void **nl = (void **)dpar__alloc(&pp->d.allocator, 2 * (size_t)cap * sizeof(void *));
        if (!nl) return NULL;
        if (pp->free_bufs) {
            memcpy(nl, pp->free_bufs, (size_t)pp->nfree * sizeof(void *));
            memcpy(nl + cap, pp->all_bufs, (size_t)pp->nbufs * sizeof(void *));
        }
        dpar__free(&pp->d.allocator, pp->free_bufs);
        pp->free_bufs = nl;
        pp->all_bufs = nl + cap;
        pp->cap = cap;
    }
    b = dpar__alloc(&pp->d.allocator, pp->d.act_bytes ? pp->d.act_bytes : 1);
    if (b) pp->all_bufs[pp->nbufs++] = b;
    return b;
}
static void dpar__pipe_give(dpar_pipe *pp, void *b)
{
    if (b) pp->free_bufs[pp->nfree++] = b;
}

DPAR_API dpar_status dpar_pipe_create(const dpar_pipe_desc *d, dpar_pipe **out)
{
    dpar_pipe *pp;
    size_t n;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_pipe_create: out is NULL");
    *out = NULL;
    if (!d || !d->schedule || !d->comm || !d->forward)
        return dpar__err(DPAR_EINVAL, "dpar_pipe_create: the desc needs a schedule, a comm and forward");
    { /* the callbacks the schedule's ops call */
        const dpar_pipe_schedule *S = d->schedule;
        int s, k, whole = 0, split = 0;
        for (s = 0; s < S->p && S->num_ops && S->ops; s++)
            for (k = 0; k < S->num_ops[s]; k++) {
                whole |= S->ops[s][k].code == DPAR_PIPE_BACKWARD;
                split |=
                    S->ops[s][k].code == DPAR_PIPE_BACKWARD_INPUT || S->ops[s][k].code == DPAR_PIPE_BACKWARD_WEIGHT;
            }
        if ((whole && !d->backward) || (split && (!d->backward_input || !d->backward_weight)))
            return dpar__err(DPAR_EINVAL, "dpar_pipe_create: the schedule has %s ops but the desc no %s: set %s",
                             whole && !d->backward ? "BACKWARD" : "split backward (B and W)",
                             whole && !d->backward ? "backward" : "backward_input and backward_weight",
                             whole && !d->backward ? "desc.backward" : "both");
    }
    DPAR__TRY(dpar__check_allocator("dpar_pipe_create", &d->allocator));
    if (d->schedule->p != d->comm->size)
        return dpar__err(DPAR_EINVAL, "dpar_pipe_create: the schedule has %d stages but the comm %d ranks",
                         d->schedule->p, d->comm->size);
    pp = (dpar_pipe *)dpar__calloc(&d->allocator, 1, sizeof *pp);
    if (!pp) return dpar__err(DPAR_ENOMEM, "dpar_pipe_create: out of memory");
    pp->d = *d;
    pp->stage = d->comm->rank;
    n = (size_t)d->schedule->m * (size_t)d->schedule->v;
    pp->stash = (void **)dpar__calloc(&d->allocator, 3 * n, sizeof(void *));
    if (!pp->stash) {
        dpar__free(&d->allocator, pp);
        return dpar__err(DPAR_ENOMEM, "dpar_pipe_create: out of memory");
    }
    pp->grad_out = pp->stash + n;
    pp->pending = pp->stash + 2 * n;
    pp->local = (void **)dpar__calloc(&d->allocator, 2 * n, sizeof(void *));
    pp->local_tag = (int *)dpar__calloc(&d->allocator, 2 * n, sizeof(int));
    if (!pp->local || !pp->local_tag) {
        dpar_pipe_destroy(pp);
        return dpar__err(DPAR_ENOMEM, "dpar_pipe_create: out of memory");
    }
    { /* dpar_pipe_saved's lists: a unit's, the spare ones, every one; at most n of each kind live at once */
        int k;
        for (k = 0; k < 2; k++) {
            pp->unit_buf[k] = (void **)dpar__calloc(&d->allocator, 3 * n, sizeof(void *));
            if (!pp->unit_buf[k]) {
                dpar_pipe_destroy(pp);
                return dpar__err(DPAR_ENOMEM, "dpar_pipe_create: out of memory");
            }
            pp->spare[k] = pp->unit_buf[k] + n;
            pp->every[k] = pp->unit_buf[k] + 2 * n;
        }
    }
    dpar__pipe_predict(pp);
    *out = pp;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_pipe_destroy(dpar_pipe *pp)
{
    int i, k;
    if (!pp) return DPAR_OK;
    for (i = 0; i < pp->nbufs; i++) dpar__free(&pp->d.allocator, pp->all_bufs[i]);
    dpar__free(&pp->d.allocator, pp->free_bufs);
    for (k = 0; k < 2; k++) {
        for (i = 0; i < pp->nevery[k]; i++) dpar__free(&pp->d.allocator, pp->every[k][i]);
        dpar__free(&pp->d.allocator, pp->unit_buf[k]);
    }
    dpar__free(&pp->d.allocator, pp->stash);
    dpar__free(&pp->d.allocator, pp->local);
    dpar__free(&pp->d.allocator, pp->local_tag);
    dpar__free(&pp->d.allocator, pp);
    return DPAR_OK;
}

/* post a made buffer to a neighbour; the buffer posted DPAR__QDEPTH messages ago is free again
   (post only returns once fewer than DPAR__QDEPTH of its messages wait unconsumed) */
static dpar_status dpar__pipe_send(dpar_pipe *pp, int dir, int peer, int tag, void *buf)
{
    uint32_t slot = pp->posted[dir] % DPAR__QDEPTH;
    DPAR__TRY(dpar__send_posted(pp->d.comm, peer, buf, pp->d.act_bytes, tag, "dpar_pipe_run"));
    if (pp->posted[dir] >= DPAR__QDEPTH) dpar__pipe_give(pp, pp->ring[dir][slot]);
    pp->ring[dir][slot] = buf;
    pp->posted[dir]++;
    return DPAR_OK;
}

/* the run failed on this stage: every stage must hear of it */
static dpar_status dpar__pipe_fail(dpar_pipe *pp, dpar_status st, const char *what, int micro, int chunk)
{
    char msg[DPAR__ERROR_TEXT];
    snprintf(msg, sizeof msg, "pipeline stage %d: %s of micro-batch %d (chunk %d) failed: %.400s", pp->stage, what,
             micro, chunk, dpar__tls_error[0] ? dpar__tls_error : dpar_status_string(st));
    return dpar__tp_fail(pp->d.comm, st, msg); /* our buffers may be freed once it returns */
}

/* a unit's backward has ended (the whole one, or its W): its saved and recompute buffers, its stashed input and its
   output's gradient go back to their lists */
static void dpar__pipe_unit_done(dpar_pipe *pp, size_t u)
{
    dpar__pipe_drop(pp, 0, u);
    dpar__pipe_drop(pp, 1, u);
    dpar__pipe_give(pp, pp->stash[u]);
    dpar__pipe_give(pp, pp->grad_out[u]);
    pp->stash[u] = pp->grad_out[u] = NULL;
}

/* activation recomputation: the unit's forward once more, on its stashed input, just before its backward (or B),
   with a recompute buffer that lives until the backward's end (its W); `out` NULL: nothing is sent. Its time counts
   as the stage's work; a span R<micro> in the trace */
static dpar_status dpar__pipe_recompute(dpar_pipe *pp, const dpar_pipe_op *op, size_t u)
{
    dpar_status st;
    uint64_t t0 = dpar_time_ns();
    char name[48];
    if (!pp->d.recompute_bytes) return DPAR_OK;
    if (dpar__pipe_hold(pp, 1, u)) return dpar__pipe_fail(pp, DPAR_ENOMEM, "a recompute buffer", op->micro, op->chunk);
    pp->cur[0] = pp->unit_buf[0][u], pp->cur[1] = pp->unit_buf[1][u];
    st = pp->d.forward(pp->d.user, op->micro, op->chunk, pp->stash[u], NULL);
    pp->cur[0] = pp->cur[1] = NULL;
    if (st != DPAR_OK) return dpar__pipe_fail(pp, st, "the recomputed forward", op->micro, op->chunk);
    snprintf(name, sizeof name, "R%d%s%c", op->micro, pp->d.schedule->v > 1 ? "." : "",
             pp->d.schedule->v > 1 ? 'a' + op->chunk : 0);
    dpar_trace_event(name, "pipe", t0, dpar_time_ns(), NULL);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_pipe_run(dpar_pipe *pp, dpar_pipe_stats *stats)
{
    dpar_pipe_schedule *S;
    dpar_comm *c;
    uint64_t t_start, busy = 0, t_end;
    dpar_status st = DPAR_OK;
    int k, p, dir;
    if (!pp) return dpar__err(DPAR_EINVAL, "dpar_pipe_run: pipe is NULL");
    S = pp->d.schedule;
    c = pp->d.comm;
    p = S->p;
    DPAR__TRY(dpar_barrier(c)); /* a common start: the bubble is measured from here */
    {                           /* this run's peaks; buffers a failed run left held go back to the lists */
        size_t u, n = (size_t)S->m * (size_t)S->v;
        while (pp->local_head < pp->local_tail) dpar__pipe_give(pp, pp->local[pp->local_head++]);
        pp->local_head = pp->local_tail = 0;
        for (k = 0; k < 2; k++) {
            for (u = 0; u < n; u++) dpar__pipe_drop(pp, k, u);
            pp->peak[k] = 0;
        }
    }
    t_start = dpar_time_ns();
    for (k = 0; k < S->num_ops[pp->stage] && st == DPAR_OK; k++) {
        dpar_pipe_op *op = &S->ops[pp->stage][k];
        size_t u = (size_t)op->micro * (size_t)S->v + (size_t)op->chunk;
        int first = dpar__pipe_first(S, pp->stage, op->chunk), last = dpar__pipe_last(S, pp->stage, op->chunk);
        int peer, pc;
        uint64_t t0 = dpar_time_ns(), t1;
        void *buf;
        char name[48];
        /* the tag names the message: a mismatch is caught as EMISMATCH, never read as data */
        switch (op->code) {
        case DPAR_PIPE_FORWARD:
            buf = last ? NULL : dpar__pipe_take(pp);
            if (!last && !buf) return dpar__pipe_fail(pp, DPAR_ENOMEM, "a buffer", op->micro, op->chunk);
            if (pp->d.saved_bytes && dpar__pipe_hold(pp, 0, u))
                return dpar__pipe_fail(pp, DPAR_ENOMEM, "a saved buffer", op->micro, op->chunk);
            dpar_clear_error();
            if ((st = DPAR__FAULT(c, DPAR__FOP_STAGE)) != DPAR_OK) return st; /* >>fault: a fail has poisoned c */
            pp->cur[0] = pp->unit_buf[0][u];
            st = pp->d.forward(pp->d.user, op->micro, op->chunk, pp->stash[u], buf);
            pp->cur[0] = NULL;
            t1 = dpar_time_ns();
            busy += t1 - t0;
            if (st != DPAR_OK) return dpar__pipe_fail(pp, st, "the forward", op->micro, op->chunk);
            pp->pending[u] = buf;
            snprintf(name, sizeof name, "F%d%s%c", op->micro, S->v > 1 ? "." : "", S->v > 1 ? 'a' + op->chunk : 0);
            dpar_trace_event(name, "pipe", t0, t1, NULL);
            break;
        case DPAR_PIPE_BACKWARD:
        case DPAR_PIPE_BACKWARD_INPUT: { /* a whole backward, or B: the input's gradient (the buffers stay for W) */
            int whole = op->code == DPAR_PIPE_BACKWARD;
            dpar_pipe_backward_fn backward = whole ? pp->d.backward : pp->d.backward_input;
            buf = first ? NULL : dpar__pipe_take(pp);
            if (!first && !buf) return dpar__pipe_fail(pp, DPAR_ENOMEM, "a buffer", op->micro, op->chunk);
            dpar_clear_error();
            if ((st = DPAR__FAULT(c, DPAR__FOP_STAGE)) != DPAR_OK) return st; /* >>fault: a fail has poisoned c */
            if ((st = dpar__pipe_recompute(pp, op, u)) != DPAR_OK) return st;
            pp->cur[0] = pp->unit_buf[0][u], pp->cur[1] = pp->unit_buf[1][u];
            st = backward(pp->d.user, op->micro, op->chunk, pp->stash[u], pp->grad_out[u], buf);
            pp->cur[0] = pp->cur[1] = NULL;
            t1 = dpar_time_ns();
            busy += t1 - t0;
            if (st != DPAR_OK)
                return dpar__pipe_fail(pp, st, whole ? "the backward" : "the input gradient (B)", op->micro, op->chunk);
            if (whole) dpar__pipe_unit_done(pp, u);
            pp->pending[u] = buf;
            snprintf(name, sizeof name, "B%d%s%c", op->micro, S->v > 1 ? "." : "", S->v > 1 ? 'a' + op->chunk : 0);
            dpar_trace_event(name, "pipe", t0, t1, NULL);
            break;
        }
        case DPAR_PIPE_BACKWARD_WEIGHT: /* W: the weights' gradients; then the unit's buffers are free */
            dpar_clear_error();
            if ((st = DPAR__FAULT(c, DPAR__FOP_STAGE)) != DPAR_OK) return st; /* >>fault: a fail has poisoned c */
            pp->cur[0] = pp->unit_buf[0][u], pp->cur[1] = pp->unit_buf[1][u];
            st = pp->d.backward_weight(pp->d.user, op->micro, op->chunk, pp->stash[u], pp->grad_out[u]);
            pp->cur[0] = pp->cur[1] = NULL;
            t1 = dpar_time_ns();
            busy += t1 - t0;
            if (st != DPAR_OK) return dpar__pipe_fail(pp, st, "the weight gradient (W)", op->micro, op->chunk);
            dpar__pipe_unit_done(pp, u);
            snprintf(name, sizeof name, "W%d%s%c", op->micro, S->v > 1 ? "." : "", S->v > 1 ? 'a' + op->chunk : 0);
            dpar_trace_event(name, "pipe", t0, t1, NULL);
            break;
        case DPAR_PIPE_SEND_ACT:
        case DPAR_PIPE_SEND_GRAD:
            dir = op->code == DPAR_PIPE_SEND_ACT ? 0 : 1;
            dpar__pipe_peer(S, pp->stage, op->chunk, !dir, &peer, &pc);
            if (peer == pp->stage) { /* to itself (a V's turn): the buffer is handed over, nothing is copied */
                pp->local_tag[pp->local_tail] = (op->code << 24) | (pc << 16) | op->micro;
                pp->local[pp->local_tail++] = pp->pending[u];
            } else { /* a ring per neighbour: what a channel has consumed is free */
                st = dpar__pipe_send(pp, peer == (pp->stage + 1) % p ? 0 : 1, peer,
                                     (op->code << 24) | (pc << 16) | op->micro, pp->pending[u]);
            }
            pp->pending[u] = NULL;
            snprintf(name, sizeof name, "send %s %d", dir ? "grad" : "act", op->micro);
            dpar_trace_event(name, "pipe", t0, dpar_time_ns(), NULL);
            break;
        default: /* the receives */
            dir = op->code == DPAR_PIPE_RECV_ACT ? 0 : 1;
            dpar__pipe_peer(S, pp->stage, op->chunk, dir, &peer, &pc);
            if (peer == pp->stage) { /* from itself: the buffer handed over (a checked schedule keeps the order) */
                int tag = ((op->code - 1) << 24) | (op->chunk << 16) | op->micro;
                if (pp->local_head == pp->local_tail || pp->local_tag[pp->local_head] != tag)
                    return dpar__pipe_fail(pp, DPAR_EINVAL, "a hand-off to itself (not sent yet, or out of order)",
                                           op->micro, op->chunk);
                buf = pp->local[pp->local_head++];
            } else {
                buf = dpar__pipe_take(pp);
                if (!buf) return dpar__pipe_fail(pp, DPAR_ENOMEM, "a buffer", op->micro, op->chunk);
                /* the tag of the sender's SEND op */
                st = dpar__recv_tagged(c, peer, buf, pp->d.act_bytes,
                                       ((op->code - 1) << 24) | (op->chunk << 16) | op->micro, "dpar_pipe_run");
            }
            if (dir == 0) pp->stash[u] = buf;
            else pp->grad_out[u] = buf;
            snprintf(name, sizeof name, "recv %s %d", dir ? "grad" : "act", op->micro);
            dpar_trace_event(name, "pipe", t0, dpar_time_ns(), NULL);
            break;
        }
    }
    /* every message delivered, every buffer back in the list */
    if (st == DPAR_OK && (pp->posted[0] || pp->posted[1])) {
        int next = (pp->stage + 1) % p, prev = (pp->stage + p - 1) % p;
        st = dpar__send_flush(c, next, 0, pp->d.act_bytes, "dpar_pipe_run (the last sends)");
        if (st == DPAR_OK && prev != next)
            st = dpar__send_flush(c, prev, 0, pp->d.act_bytes, "dpar_pipe_run (the last sends)");
        for (dir = 0; dir < 2 && st == DPAR_OK; dir++) {
            uint32_t i, n = pp->posted[dir] < DPAR__QDEPTH ? pp->posted[dir] : DPAR__QDEPTH;
            for (i = 0; i < n; i++) dpar__pipe_give(pp, pp->ring[dir][(pp->posted[dir] - 1 - i) % DPAR__QDEPTH]);
            pp->posted[dir] = 0;
        }
    }
    if (st != DPAR_OK) {
        dpar__tp_quiesce(c);
        return st;
    }
    t_end = dpar_time_ns();
    { /* the agreement: every stage ends with the same status; and the measured bubble */
        uint64_t v[2];
        double totals[2];
        v[0] = t_end - t_start;
        st = dpar_allreduce(c, v, v, 1, DPAR_I64, DPAR_MAX);
        totals[0] = (double)busy;
        if (st == DPAR_OK) st = dpar_allreduce(c, totals, totals, 1, DPAR_F64, DPAR_SUM);
        if (st == DPAR_OK && stats) {
            stats->predicted_bubble = S->bubble;
            stats->run_ns = v[0];
            stats->busy_ns = busy;
            stats->measured_bubble = v[0] ? 1.0 - totals[0] / ((double)p * (double)v[0]) : 0.0;
            stats->buffers = pp->nbufs;
            stats->predicted_saved = pp->predicted[0], stats->peak_saved = pp->peak[0];
            stats->predicted_recomputed = pp->predicted[1], stats->peak_recomputed = pp->peak[1];
        }
    }
    return st;
}

/* >>dp: data-parallel helpers: the sampler, gradient buckets (ring and direct) ------------------ */
static uint64_t dpar__splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

DPAR_API dpar_status dpar_sampler_init(dpar_sampler *s, const dpar_sampler_desc *desc)
{
    size_t n;
    int ranks, rank, drop_last;
    if (!s) return dpar__err(DPAR_EINVAL, "dpar_sampler_init: sampler is NULL");
    memset(s, 0, sizeof *s);
    if (!desc) return dpar__err(DPAR_EINVAL, "dpar_sampler_init: desc is NULL (n is required)");
    DPAR__TRY(dpar__check_allocator("dpar_sampler_init", &desc->allocator));
    n = desc->n, ranks = desc->ranks ? desc->ranks : 1, rank = desc->rank, drop_last = desc->drop_last;
    if (n == 0) return dpar__err(DPAR_EINVAL, "dpar_sampler_init: no samples (n = 0)");
    if (ranks < 1 || rank < 0 || rank >= ranks)
        return dpar__err(DPAR_EINVAL, "dpar_sampler_init: rank %d of %d ranks", rank, ranks);
    if (drop_last && n < (size_t)ranks)
        return dpar__err(DPAR_EINVAL, "dpar_sampler_init: %zu samples cannot give each of %d ranks one (drop_last)", n,
                         ranks);
    s->allocator = desc->allocator;
    s->n = n;
    s->ranks = ranks;
    s->rank = rank;
    s->seed = desc->seed;
    s->drop_last = drop_last != 0;
    s->per_rank = drop_last ? n / (size_t)ranks : (n + (size_t)ranks - 1) / (size_t)ranks;
    s->perm = (size_t *)dpar__alloc(&s->allocator, n * sizeof(size_t));
    s->mine = (size_t *)dpar__alloc(&s->allocator, s->per_rank * sizeof(size_t));
    if (!s->perm || !s->mine) {
        dpar_sampler_destroy(s);
        return dpar__err(DPAR_ENOMEM, "dpar_sampler_init: out of memory for %zu samples", n);
    }
    return DPAR_OK;
}

DPAR_API size_t dpar_sampler_epoch(dpar_sampler *s, uint64_t epoch, const size_t **indices)
{
    return dpar_sampler_resume(s, epoch, 0, indices);
}

DPAR_API size_t dpar_sampler_resume(dpar_sampler *s, uint64_t epoch, size_t consumed, const size_t **indices)
{
    uint64_t state;
    size_t i, k, count, left;
    if (!s || !s->perm) {
        if (indices) *indices = NULL;
        return 0;
    }
    state = s->seed ^ (epoch * 0xD1B54A32D192ED03ull + 0x8CB92BA72F3D8DD7ull);
    for (i = 0; i < s->n; i++) s->perm[i] = i;
    for (i = s->n - 1; i > 0; i--) { /* Fisher-Yates */
        size_t j = (size_t)(dpar__splitmix(&state) % (uint64_t)(i + 1)), t = s->perm[i];
        s->perm[i] = s->perm[j];
        s->perm[j] = t;
    }
    left = consumed < s->n ? s->n - consumed : 0;
    count = s->drop_last ? left / (size_t)s->ranks : (left + (size_t)s->ranks - 1) / (size_t)s->ranks;
    if (count > s->per_rank) count = s->per_rank; /* cannot be more: left <= n */
    s->start = consumed < s->n ? consumed : s->n;
    for (k = 0; k < count; k++) s->mine[k] = s->perm[(s->start + (size_t)s->rank + k * (size_t)s->ranks) % s->n];
    if (indices) *indices = s->mine;
    return count;
}

DPAR_API size_t dpar_sampler_consumed(const dpar_sampler *s, size_t taken)
{
    size_t pos;
    if (!s || !s->perm) return 0;
    pos = s->start + taken * (size_t)s->ranks;
    return pos < s->n && pos >= s->start ? pos : s->n;
}

DPAR_API dpar_status dpar_sampler_destroy(dpar_sampler *s)
{
    if (!s) return DPAR_OK;
    dpar__free(&s->allocator, s->perm);
    dpar__free(&s->allocator, s->mine);
    memset(s, 0, sizeof *s);
    return DPAR_OK;
}

/* ---- gradient buckets ---- */
struct dpar_buckets {
    dpar_comm *comm;
    dpar_allocator allocator;
    float *grads;
    size_t count, per; /* elements, per bucket */
    int nb;
    dpar_op op;
    size_t *filled;     /* [nb]: elements marked this step */
    dpar_request **req; /* [nb]: in flight, or NULL */
    size_t *marks;      /* marked ranges this step, sorted: [2 k] start, [2 k + 1] end */
    size_t nmarks, capmarks;
    uint64_t first_launch, overlap;
    dpar__then update; /* dpar_buckets_set_update: fn, user, gather = the params (base: per bucket) */
    /* dpar_buckets_set_direct: flags shared by the ranks, everyone's grads and params, my buckets in
       progress (pend, in marking order) and where each is (0 idle, 1 marked, 2 reduced, 3 done) */
    struct dpar__direct *direct;
    float **dgrads, **dparams;
    int *pend, npend;
    unsigned char *dstate;
    int dcopy;          /* blocks to copy from the other ranks: no update, or params not shared */
    dpar_status failed; /* this step: a bucket that could not start, or an error wait_range saw */
    uint32_t gen;       /* steps made since direct was set: this step's flags say gen + 1 */
    /* the tensor form (grads NULL): the tensors, numbered by tstart; bucket k's elements lie contiguous at
       base[k]: inside its one tensor, or (staged[k] != 0) in `stage`, copied in at launch and out once reduced
       (staged 2: copied out this step) */
    dpar_tensor *tens;
    size_t *tstart;
    int nt;
    float **base, *stage;
    unsigned char *staged;
    /* the tensor form with an update (dpar_buckets_set_update_tensors): the params tensors, bucket k's params
       contiguous at pbase[k] (in its tensor, or in pstage as the gradients in stage); update.fn is
       dpar__bucket_tupdate, which calls tfn(tuser, ...) tensor by tensor */
    dpar_tensor *ptens;
    float **pbase, *pstage;
    dpar_buckets_update_fn tfn;
    void *tuser;
    float ***dbase, ***dpbase; /* direct: every rank's base and pbase (NULL: a flat rank) */
};

/* Direct buckets (thread ranks): flag[phase][bucket][rank] = the step (gen + 1) in which that rank
   finished that phase of that bucket: marked all its gradients ready, reduced (and updated) its
   block, copied the other blocks (without an update). Each flag has one writer; readers wait on
   their doorbell, which the writer rings. */
typedef struct dpar__direct {
    int refs; /* ranks still using it; the last one frees it */
    dpar_allocator allocator;
    uint32_t flags[1];
} dpar__direct;
enum { DPAR__D_MARKED, DPAR__D_REDUCED, DPAR__D_COPIED };

static size_t dpar__bucket_end(const dpar_buckets *b, int k) /* bucket k is [k per, this) */
{
    size_t bs = (size_t)k * b->per;
    return bs + b->per < b->count ? bs + b->per : b->count;
}

DPAR_API dpar_status dpar_buckets_create(const dpar_buckets_desc *desc, dpar_buckets **out)
{
    dpar_buckets *b;
    dpar_status st;
    size_t total = desc ? desc->count : 0;
    int ok;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_buckets_create: out is NULL");
    *out = NULL;
    if (!desc || !desc->comm) return dpar__err(DPAR_EINVAL, "dpar_buckets_create: desc or desc->comm is NULL");
    if (desc->num_tensors || desc->tensors) { /* the tensor form */
        DPAR__TRY(
            dpar__tensors_check("dpar_buckets_create", "gradient", desc->tensors, desc->num_tensors, DPAR_F32, &total));
        if (desc->num_tensors < 1 || desc->grads || (desc->count && desc->count != total))
            return dpar__err(DPAR_EINVAL,
                             "dpar_buckets_create: %d tensors (at least 1) holding %zu gradients, with grads %p (must "
                             "be NULL) and count %zu (0 or their total)",
                             desc->num_tensors, total, (void *)desc->grads, desc->count);
    } else if (desc->count && !desc->grads) return dpar__err(DPAR_EINVAL, "dpar_buckets_create: grads is NULL");
    if ((unsigned)desc->op >= DPAR_OP_COUNT) return dpar__err(DPAR_EINVAL, "dpar_buckets_create: op %d", (int)desc->op);
    if ((st = dpar__check_allocator("dpar_buckets_create", &desc->allocator)) != DPAR_OK) return st;
    b = (dpar_buckets *)dpar__calloc(&desc->allocator, 1, sizeof *b);
    if (!b) return dpar__err(DPAR_ENOMEM, "dpar_buckets_create: out of memory");
    b->comm = desc->comm;
    b->allocator = desc->allocator;
    b->grads = desc->grads;
    b->count = total;
    b->op = desc->op;
    b->per = (desc->bucket_bytes ? desc->bucket_bytes : (size_t)4 << 20) / sizeof(float);
    if (b->per < 1) b->per = 1;
    b->nb = b->count ? (int)((b->count + b->per - 1) / b->per) : 0;
    b->filled = (size_t *)dpar__calloc(&b->allocator, (size_t)b->nb + 1, sizeof(size_t));
    b->req = (dpar_request **)dpar__calloc(&b->allocator, (size_t)b->nb + 1, sizeof(dpar_request *));
    b->capmarks = 64;
    b->marks = (size_t *)dpar__alloc(&b->allocator, 2 * b->capmarks * sizeof(size_t));
    ok = b->filled && b->req && b->marks;
    if (ok && desc->tensors) { /* where each bucket lies; the spanning ones' room */
        size_t room = 0;
        int k, n = desc->num_tensors;
        b->nt = n;
        b->tens = (dpar_tensor *)dpar__calloc(&b->allocator, (size_t)n, sizeof(dpar_tensor));
        b->tstart = dpar__tensors_number(&b->allocator, desc->tensors, n);
        b->base = (float **)dpar__calloc(&b->allocator, (size_t)b->nb + 1, sizeof(float *));
        b->staged = (unsigned char *)dpar__calloc(&b->allocator, (size_t)b->nb + 1, 1);
        if (b->tens && b->tstart && b->base && b->staged) {
            memcpy(b->tens, desc->tensors, (size_t)n * sizeof(dpar_tensor));
            for (k = 0; k < b->nb; k++) {
                size_t bs = (size_t)k * b->per, be = dpar__bucket_end(b, k);
                int t = dpar__tensor_at(b->tstart, n, bs);
                b->staged[k] = be > b->tstart[t + 1];
                if (!b->staged[k]) b->base[k] = (float *)b->tens[t].data + (bs - b->tstart[t]);
                else room += be - bs;
            }
            if (room) b->stage = (float *)dpar__calloc(&b->allocator, room, sizeof(float));
            for (k = 0, room = 0; b->stage && k < b->nb; k++)
                if (b->staged[k]) b->base[k] = b->stage + room, room += dpar__bucket_end(b, k) - (size_t)k * b->per;
        }
        ok = b->tens && b->tstart && b->base && b->staged && (!room || b->stage);
    }
    if (!ok) {
        dpar_buckets_destroy(b);
        return dpar__err(DPAR_ENOMEM, "dpar_buckets_create: out of memory");
    }
    *out = b;
    return DPAR_OK;
}

static uint32_t *dpar__dflag(dpar_buckets *b, int phase, int k, int r)
{
    return &b->direct->flags[((size_t)phase * (size_t)b->nb + (size_t)k) * (size_t)b->comm->size + (size_t)r];
}
/* rank r is reading the other ranks' memory right now (after the flags: one word per rank) */
static uint32_t *dpar__dreading(dpar_buckets *b, int r)
{
    return &b->direct->flags[3 * (size_t)b->nb * (size_t)b->comm->size + (size_t)r];
}

static void dpar__dset(dpar_buckets *b, int phase, int k) /* I finished phase of bucket k: tell everyone */
{
    DPAR__STORE(dpar__dflag(b, phase, k, b->comm->rank), b->gen + 1, DPAR__RELEASE);
    dpar__tp_wake_all(b->comm);
}

/* the first rank that has not finished phase of bucket k this step, or -1 */
static int dpar__dmissing(dpar_buckets *b, int phase, int k)
{
    int q;
    for (q = 0; q < b->comm->size; q++)
        if ((int32_t)(DPAR__LOAD(dpar__dflag(b, phase, k, q), DPAR__ACQUIRE) - (b->gen + 1)) < 0) return q;
    return -1;
}

/* About to read the other ranks' memory: "reading now", then one more look at the poison (a Dekker
   pair with dpar__dquiesce, as a transport's fetch with its quiesce): either this rank sees that a
   peer left on an error, or that peer sees this reader and waits before it returns. */
static dpar_status dpar__dread_begin(dpar_buckets *b)
{
    dpar_status st;
    DPAR__STORE(dpar__dreading(b, b->comm->rank), 1u, DPAR__SEQ_CST);
    if ((st = dpar__tp_poisoned(b->comm)) != DPAR_OK) DPAR__STORE(dpar__dreading(b, b->comm->rank), 0u, DPAR__SEQ_CST);
    return st;
}
static void dpar__dread_end(dpar_buckets *b) { DPAR__STORE(dpar__dreading(b, b->comm->rank), 0u, DPAR__SEQ_CST); }

/* Leaving a step on an error: poison the group (the others must not wait for this rank, nor start
   reading its memory), then wait until no rank is still reading it, so the caller may free it. */
static void dpar__dquiesce(dpar_buckets *b)
{
    uint64_t give_up = dpar_time_ns() + 5000000000u;
    int q;
    char msg[DPAR__ERROR_TEXT];
    if (!b->direct) return;
    /* the first poison wins: a no-op after an error; the message names this rank and why it left */
    snprintf(msg, sizeof msg, "dpar_buckets: rank %d of %s left its direct buckets in the middle of a step: %.400s",
             b->comm->rank, b->comm->name, dpar__tls_error[0] ? dpar__tls_error : "(no error text)");
    dpar__tp_poison_quietly(b->comm, DPAR_EINVAL, msg);
    for (q = 0; q < b->comm->size; q++)
        while (q != b->comm->rank && DPAR__LOAD(dpar__dreading(b, q), DPAR__SEQ_CST) && dpar_time_ns() < give_up)
            sched_yield();
}

static void dpar__dbucket(const dpar_buckets *b, int k, int rank, size_t *lo, size_t *len)
{
    size_t bs = (size_t)k * b->per, be = dpar__bucket_end(b, k), off;
    dpar_block_range(be - bs, b->comm->size, rank, &off, len);
    *lo = bs + off;
}

/* direct: bucket k of rank q's gradients (params 0) or parameters (1), where that rank keeps it */
static float *dpar__dptr(const dpar_buckets *b, int q, int k, int params)
{
    float **base = params ? b->dpbase[q] : b->dbase[q];
    if (base) return base[k];
    return (params ? b->dparams[q] : b->dgrads[q]) + (size_t)k * b->per;
}

/* my buckets in progress, in order, never waiting: reduce my block of each one every rank has marked
   (reading their gradients where they are), update it; then copy the other blocks once their owners
   are done */
static dpar_status dpar__dpoll(dpar_buckets *b)
{
    dpar_comm *c = b->comm;
    int i, w = 0, q, N = c->size;
    size_t lo, len;
    dpar_status st = DPAR_OK;
    dpar__ctx x; /* for the local arithmetic: the transport's own, on its memory */
    memset(&x, 0, sizeof x);
    x.c = c;
    for (i = 0; i < b->npend; i++) {
        int k = b->pend[i];
        if (b->dstate[k] == 1 && dpar__dmissing(b, DPAR__D_MARKED, k) < 0) {
            DPAR__TRY(dpar__dread_begin(b));
            dpar__dbucket(b, k, c->rank, &lo, &len);
            float *mine = dpar__dptr(b, c->rank, k, 0) + (lo - (size_t)k * b->per);
            for (q = 1; q < N && len && st == DPAR_OK; q++) /* ((mine op next) op next) ... in ring order */
                st = dpar__tp_reduce(&x, mine, mine, dpar__dptr(b, (c->rank + q) % N, k, 0) + (lo - (size_t)k * b->per),
                                     len, DPAR_F32, b->op, q == N - 1 && b->op == DPAR_AVG ? N : 0);
            dpar__dread_end(b);
            if (st != DPAR_OK) return st;
            if (b->update.fn && (st = DPAR__FAULT(c, DPAR__FOP_BUCKET)) != DPAR_OK) return st; /* >>fault */
            if (b->update.fn) b->update.fn(b->update.user, lo, len);
            dpar__dset(b, DPAR__D_REDUCED, k);
            b->dstate[k] = b->dcopy ? 2 : 3;
        }
        if (b->dstate[k] == 2 && dpar__dmissing(b, DPAR__D_REDUCED, k) < 0) {
            int upd = b->update.fn != NULL;
            size_t bs = (size_t)k * b->per;
            float *to = dpar__dptr(b, c->rank, k, upd); /* bucket k's first element */
            DPAR__TRY(dpar__dread_begin(b));
            for (q = 0; q < N; q++) {
                float *from = dpar__dptr(b, q, k, upd);
                dpar__dbucket(b, k, q, &lo, &len);
                if (q != c->rank && from != to && st == DPAR_OK)
                    st = dpar__tp_copy(&x, to + (lo - bs), from + (lo - bs), len * sizeof(float));
            }
            dpar__dread_end(b);
            if (st != DPAR_OK) return st;
            dpar__dset(b, DPAR__D_COPIED, k);
            b->dstate[k] = 3;
        }
        if (b->dstate[k] != 3) b->pend[w++] = k;
    }
    b->npend = w;
    return DPAR_OK;
}

/* Wait until buckets first..last are finished on every rank, doing this rank's part of every bucket
   in progress meanwhile: never blocked on one bucket while a peer waits for this rank's part of
   another (so ranks may call dpar_buckets_wait_range for different ranges). Sleeps on the doorbell. */
static dpar_status dpar__dfinish(dpar_buckets *b, int first, int last)
{
    static const char *const what[] = {"mark its gradients of a bucket ready", "reduce its block of a bucket",
                                       "copy the blocks of a bucket"};
    dpar_comm *c = b->comm;
    dpar_status st;
    int fin = b->dcopy ? DPAR__D_COPIED : DPAR__D_REDUCED, i, entered = 0;
    dpar__ctx x; /* for the timeout: this wait, described as the collective it stands for, on bucket `first` */
    dpar__p2p_ctx(&x, c, b->update.fn ? DPAR_COLL_REDUCE_SCATTER : DPAR_COLL_ALLREDUCE,
                  dpar__bucket_end(b, first) - (size_t)first * b->per, DPAR_F32, 0, __FILE__, __LINE__);
    x.fp.op = (int)b->op;
    for (;;) {
        uint32_t bell = dpar__tp_doorbell(c);
        int phase = 0, q = -1, k = -1;
        DPAR__TRY(dpar__dpoll(b));
        for (i = first; i <= last && q < 0 && k < 0; i++) {
            phase = b->dstate[i] == 1 ? DPAR__D_MARKED : b->dstate[i] == 2 ? DPAR__D_REDUCED : fin;
            q = dpar__dmissing(b, phase, i);
            if (q >= 0 || b->dstate[i] != 3) k = i; /* waiting for rank q, or (q < 0) mine to do: poll again */
        }
        if (k < 0) return DPAR_OK;
        if (q < 0) continue;
        if ((st = dpar__tp_poisoned(c)) != DPAR_OK) return st;
        if (!entered) dpar__tp_enter(&x), entered = 1; /* where this rank waits, for the others' timeout messages */
        if (x.deadline && dpar_time_ns() >= x.deadline) return dpar__tp_timeout(&x, q, what[phase]);
        dpar__tp_wait_bell(c, bell, x.deadline);
    }
}

DPAR_API dpar_status dpar_buckets_ready(dpar_buckets *b, size_t offset, size_t count)
{
    size_t lo = 0, hi, end = offset + count;
    int first, last, i;
    dpar_status st0 = DPAR_OK;
    if (!b) return dpar__err(DPAR_EINVAL, "dpar_buckets_ready: buckets is NULL");
    if (count == 0) return DPAR_OK;
    if (offset > b->count || count > b->count - offset)
        return dpar__err(DPAR_EINVAL, "dpar_buckets_ready: [%zu, %zu) is outside the %zu gradients", offset, end,
                         b->count);
    /* the marked ranges are sorted: find where this one goes, and refuse overlaps */
    hi = b->nmarks;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (b->marks[2 * mid] < offset) lo = mid + 1;
        else hi = mid;
    }
    if ((lo > 0 && b->marks[2 * (lo - 1) + 1] > offset) || (lo < b->nmarks && b->marks[2 * lo] < end))
        return dpar__err(DPAR_EINVAL,
                         "dpar_buckets_ready: [%zu, %zu) overlaps gradients already marked ready this step", offset,
                         end);
    if (b->nmarks == b->capmarks) {
        size_t *m = (size_t *)dpar__alloc(&b->allocator, 4 * b->capmarks * sizeof(size_t));
        if (!m) return dpar__err(DPAR_ENOMEM, "dpar_buckets_ready: out of memory");
        memcpy(m, b->marks, 2 * b->nmarks * sizeof(size_t));
        dpar__free(&b->allocator, b->marks);
        b->marks = m;
        b->capmarks *= 2;
    }
    memmove(b->marks + 2 * lo + 2, b->marks + 2 * lo, 2 * (b->nmarks - lo) * sizeof(size_t));
    b->marks[2 * lo] = offset;
    b->marks[2 * lo + 1] = end;
    b->nmarks++;
    /* count it into its buckets; launch the ones that are complete */
    first = (int)(offset / b->per);
    last = (int)((end - 1) / b->per);
    for (i = first; i <= last; i++) {
        size_t bs = (size_t)i * b->per, be = dpar__bucket_end(b, i);
        size_t s0 = offset > bs ? offset : bs, e0 = end < be ? end : be;
        b->filled[i] += e0 - s0;
        if (b->filled[i] == be - bs) {
            dpar_status st;
            if (b->direct) { /* marked here; reduced by whoever polls once all are */
                if (!b->grads && b->staged[i]) dpar__tensors_copy(b->tens, b->tstart, b->nt, b->base[i], bs, be, 1);
                dpar__dset(b, DPAR__D_MARKED, i);
                b->dstate[i] = 1;
                b->pend[b->npend++] = i;
                st = DPAR_OK;
            } else if (b->update.fn) { /* reduce-scatter, update my block, all-gather the params: one chained request */
                dpar__then then = b->update;
                size_t off;
                dpar__call call;
                float *at = b->grads ? b->grads + bs : b->base[i];
                if (!b->grads && b->staged[i]) dpar__tensors_copy(b->tens, b->tstart, b->nt, at, bs, be, 1);
                dpar_block_range(be - bs, b->comm->size, b->comm->rank, &off, NULL);
                call = dpar__call_make(DPAR_COLL_REDUCE_SCATTER, at, at + off, be - bs, DPAR_F32, b->op, 0, __FILE__,
                                       __LINE__);
                then.base = bs;
                then.gather = b->grads ? then.gather + bs : b->pbase[i];
                st = dpar__icollective(b->comm, &call, &b->req[i], "dpar_buckets_ready", &then);
            } else {
                float *at = b->grads ? b->grads + bs : b->base[i];
                if (!b->grads && b->staged[i]) dpar__tensors_copy(b->tens, b->tstart, b->nt, at, bs, be, 1);
                st = dpar_iallreduce(b->comm, at, at, be - bs, DPAR_F32, b->op, &b->req[i]);
            }
            /* the bucket never starts: the others must not wait for it, nor this rank's wait pass */
            if (st != DPAR_OK) {
                b->failed = st = dpar__bad_call(b->comm, st);
                return st;
            }
            if (!b->first_launch) b->first_launch = dpar_time_ns();
        }
    }
    if (b->direct && (st0 = dpar__dpoll(b)) != DPAR_OK) dpar__dquiesce(b); /* no peer reads my memory after this */
    return st0;
}

DPAR_API dpar_status dpar_buckets_ready_tensor(dpar_buckets *b, int index)
{
    if (!b || index < 0 || index >= b->nt)
        return dpar__err(DPAR_EINVAL, "dpar_buckets_ready_tensor: no tensor %d (the buckets have %d)", index,
                         b ? b->nt : 0);
    return dpar_buckets_ready(b, b->tstart[index], b->tens[index].count);
}

/* the tensor form: a spanning bucket, reduced (and its params updated), back into its tensors (once a step) */
static void dpar__bucket_out(dpar_buckets *b, int k)
{
    size_t bs = (size_t)k * b->per;
    if (b->grads || b->staged[k] != 1) return;
    dpar__tensors_copy(b->tens, b->tstart, b->nt, b->base[k], bs, dpar__bucket_end(b, k), 0);
    if (b->update.fn && b->ptens)
        dpar__tensors_copy(b->ptens, b->tstart, b->nt, b->pbase[k], bs, dpar__bucket_end(b, k), 0);
    b->staged[k] = 2;
}

/* the tensor form's update of my block [offset, offset + count) of a bucket (on the progress thread, or the rank's
   own with direct buckets): a spanning bucket's reduced block into the gradient tensors first, the user's update
   tensor by tensor, then the updated block into the params' staging array (the all-gather sends it from there) */
static void dpar__bucket_tupdate(void *user, size_t offset, size_t count)
{
    dpar_buckets *b = (dpar_buckets *)user;
    int k = (int)(offset / b->per);
    size_t bs = (size_t)k * b->per, o = offset, end = offset + count;
    if (b->staged[k]) dpar__tensors_copy(b->tens, b->tstart, b->nt, b->base[k] + (offset - bs), offset, end, 0);
    while (o < end) {
        int t = dpar__tensor_at(b->tstart, b->nt, o);
        size_t e = b->tstart[t + 1] < end ? b->tstart[t + 1] : end;
        b->tfn(b->tuser, o, e - o);
        o = e;
    }
    if (b->staged[k]) dpar__tensors_copy(b->ptens, b->tstart, b->nt, b->pbase[k] + (offset - bs), offset, end, 1);
}

DPAR_API dpar_status dpar_buckets_wait(dpar_buckets *b)
{
    dpar_status st = DPAR_OK, w;
    uint64_t now = dpar_time_ns();
    size_t k, at = 0;
    int i;
    if (!b) return dpar__err(DPAR_EINVAL, "dpar_buckets_wait: buckets is NULL");
    b->overlap = b->first_launch ? now - b->first_launch : 0;
    for (k = 0; k < b->nmarks && st == DPAR_OK; k++) { /* the first gap */
        if (b->marks[2 * k] > at)
            st = dpar__err(DPAR_EINVAL, "dpar_buckets_wait: gradients [%zu, %zu) were never marked ready", at,
                           b->marks[2 * k]);
        at = b->marks[2 * k + 1];
    }
    if (st == DPAR_OK && at < b->count)
        st = dpar__err(DPAR_EINVAL, "dpar_buckets_wait: gradients [%zu, %zu) were never marked ready", at, b->count);
    if (st != DPAR_OK) st = dpar__bad_call(b->comm, st); /* the other ranks must not wait for us */
    if (st == DPAR_OK && b->failed) st = b->failed;      /* a bucket that never started, or failed in wait_range */
    if (st == DPAR_OK && b->direct) st = dpar__dfinish(b, 0, b->nb - 1); /* mine, then everyone's */
    if (st != DPAR_OK && b->direct) dpar__dquiesce(b); /* either way no rank reads my memory after this */
    if (b->direct) {
        b->gen++;
        b->npend = 0;
        memset(b->dstate, 0, (size_t)b->nb);
    }
    for (i = 0; i < b->nb; i++) {
        if (b->req[i] && (w = dpar_request_wait(b->req[i])) != DPAR_OK && st == DPAR_OK) st = w;
        if (st == DPAR_OK) dpar__bucket_out(b, i);
        if (!b->grads && b->staged[i]) b->staged[i] = 1;
        b->req[i] = NULL;
        b->filled[i] = 0;
    }
    b->nmarks = 0;
    b->first_launch = 0;
    b->failed = DPAR_OK;
    return st;
}

DPAR_API dpar_status dpar_buckets_wait_range(dpar_buckets *b, size_t offset, size_t count)
{
    dpar_status st = DPAR_OK;
    int first, last, i;
    if (!b) return dpar__err(DPAR_EINVAL, "dpar_buckets_wait_range: buckets is NULL");
    if (count == 0) return DPAR_OK;
    if (offset > b->count || count > b->count - offset)
        return dpar__err(DPAR_EINVAL, "dpar_buckets_wait_range: [%zu, %zu) is outside the %zu gradients", offset,
                         offset + count, b->count);
    first = (int)(offset / b->per);
    last = (int)((offset + count - 1) / b->per);
    for (i = first; i <= last; i++) {
        size_t bs = (size_t)i * b->per, be = dpar__bucket_end(b, i);
        if (b->filled[i] != be - bs)
            return dpar__err(DPAR_EINVAL,
                             "dpar_buckets_wait_range: the bucket [%zu, %zu) holding part of [%zu, %zu) is not "
                             "full (%zu of %zu gradients marked ready this step)",
                             bs, be, offset, offset + count, b->filled[i], be - bs);
    }
    if (b->direct) {
        if ((st = dpar__dfinish(b, first, last)) != DPAR_OK) dpar__dquiesce(b);
        for (i = first; i <= last && st == DPAR_OK; i++) dpar__bucket_out(b, i);
        return st;
    }
    if (b->failed) return b->failed;
    for (i = first; i <= last; i++) {
        dpar_status w = b->req[i] ? dpar_request_wait(b->req[i]) : DPAR_OK;
        b->req[i] = NULL;
        if (w != DPAR_OK && st == DPAR_OK) b->failed = st = w; /* dpar_buckets_wait says it again */
        if (st == DPAR_OK) dpar__bucket_out(b, i);
    }
    return st;
}

DPAR_API dpar_status dpar_buckets_set_update(dpar_buckets *b, float *params, dpar_buckets_update_fn update, void *user)
{
    if (!b) return dpar__err(DPAR_EINVAL, "dpar_buckets_set_update: buckets is NULL");
    if (b->tens && update)
        return dpar__err(DPAR_EINVAL, "dpar_buckets_set_update: buckets of tensors take their params as tensors "
                                      "(dpar_buckets_set_update_tensors)");
    if (b->nmarks) return dpar__err(DPAR_EBUSY, "dpar_buckets_set_update: gradients of this step are marked ready");
    if (b->direct) return dpar__err(DPAR_EBUSY, "dpar_buckets_set_update: direct buckets are on (turn them off first)");
    if (update && b->count && !params) return dpar__err(DPAR_EINVAL, "dpar_buckets_set_update: params is NULL");
    if (update && dpar__overlap(params, b->count * sizeof(float), b->grads, b->count * sizeof(float)))
        return dpar__err(DPAR_EINVAL, "dpar_buckets_set_update: params overlaps the gradients");
    memset(&b->update, 0, sizeof b->update);
    b->tfn = NULL;
    if (update) {
        b->update.fn = update;
        b->update.user = user;
        b->update.gather = params;
    }
    return DPAR_OK;
}

DPAR_API dpar_status dpar_buckets_set_update_tensors(dpar_buckets *b, const dpar_tensor *params,
                                                     dpar_buckets_update_fn update, void *user)
{
    size_t room = 0;
    int i, k;
    if (!b || !b->tens)
        return dpar__err(DPAR_EINVAL, "dpar_buckets_set_update_tensors: %s",
                         b ? "not buckets of tensors (use "
                             "dpar_buckets_set_update)"
                           : "buckets is NULL");
    if (b->nmarks)
        return dpar__err(DPAR_EBUSY, "dpar_buckets_set_update_tensors: gradients of this step are marked ready");
    if (b->direct)
        return dpar__err(DPAR_EBUSY, "dpar_buckets_set_update_tensors: direct buckets are on (turn them off first)");
    if (!update) return dpar_buckets_set_update(b, NULL, NULL, NULL);
    DPAR__TRY(dpar__tensors_check("dpar_buckets_set_update_tensors", "params", params, b->nt, DPAR_F32, NULL));
    for (i = 0; i < b->nt; i++) {
        if (params[i].count != b->tens[i].count)
            return dpar__err(DPAR_EINVAL,
                             "dpar_buckets_set_update_tensors: params tensor %d has %zu elements, its "
                             "gradient %zu",
                             i, params[i].count, b->tens[i].count);
        for (k = 0; k < b->nt; k++)
            if (dpar__overlap(params[i].data, params[i].count * 4, b->tens[k].data, b->tens[k].count * 4))
                return dpar__err(DPAR_EINVAL,
                                 "dpar_buckets_set_update_tensors: params tensor %d overlaps gradient tensor %d", i, k);
    }
    if (!b->ptens) { /* made once: the list, the per-bucket pointers, the spanning buckets' room */
        for (k = 0; k < b->nb; k++)
            if (b->staged[k]) room += dpar__bucket_end(b, k) - (size_t)k * b->per;
        b->ptens = (dpar_tensor *)dpar__calloc(&b->allocator, (size_t)b->nt, sizeof(dpar_tensor));
        b->pbase = (float **)dpar__calloc(&b->allocator, (size_t)b->nb + 1, sizeof(float *));
        if (room) b->pstage = (float *)dpar__calloc(&b->allocator, room, sizeof(float));
        if (!b->ptens || !b->pbase || (room && !b->pstage)) {
            dpar__free(&b->allocator, b->ptens), dpar__free(&b->allocator, b->pbase);
            dpar__free(&b->allocator, b->pstage);
            b->ptens = NULL, b->pbase = NULL, b->pstage = NULL;
            return dpar__err(DPAR_ENOMEM, "dpar_buckets_set_update_tensors: out of memory");
        }
    }
    memcpy(b->ptens, params, (size_t)b->nt * sizeof(dpar_tensor));
    for (k = 0; k < b->nb; k++) { /* where the gradients are, the params are: in their tensor or at the same place */
        size_t bs = (size_t)k * b->per;
        int t = dpar__tensor_at(b->tstart, b->nt, bs);
        b->pbase[k] =
            b->staged[k] ? b->pstage + (b->base[k] - b->stage) : (float *)params[t].data + (bs - b->tstart[t]);
    }
    memset(&b->update, 0, sizeof b->update);
    b->update.fn = dpar__bucket_tupdate;
    b->update.user = b;
    b->tfn = update;
    b->tuser = user;
    return DPAR_OK;
}

static void dpar__direct_off(dpar_buckets *b)
{
    dpar_allocator *a = &b->allocator;
    if (b->direct && (b->nmarks || dpar__tp_is_poisoned(b->comm)))
        dpar__dquiesce(b); /* left mid-step, or after an error: nobody may still read our memory */
    if (b->direct && __atomic_sub_fetch(&b->direct->refs, 1, DPAR__ACQ_REL) == 0) {
        dpar_allocator mine = b->direct->allocator;
        dpar__free(&mine, b->direct);
    }
    b->direct = NULL;
    dpar__free(a, b->dgrads);
    dpar__free(a, b->dparams);
    dpar__free(a, b->pend);
    dpar__free(a, b->dstate);
    dpar__free(a, b->dbase);
    dpar__free(a, b->dpbase);
    b->dbase = b->dpbase = NULL;
    b->dgrads = b->dparams = NULL;
    b->pend = NULL;
    b->dstate = NULL;
    b->npend = 0;
}

DPAR_API dpar_status dpar_buckets_set_direct(dpar_buckets *b, int on)
{
    enum { V_OK, V_COUNT, V_UPDATE, V_PER, V_OP, V_N };        /* what the ranks must agree on */
    enum { S_GRADS, S_PARAMS, S_FLAGS, S_BASE, S_PBASE, S_N }; /* what they share (the tensor form: per bucket) */
    dpar_comm *c;
    dpar__direct *d = NULL;
    uint64_t *v = NULL;  /* V_N words per rank */
    void **peers = NULL; /* S_N per rank */
    const void *mine[S_N];
    dpar_status st;
    int N, r, q, ok, shared = 0;
    if (!b) return dpar__err(DPAR_EINVAL, "dpar_buckets_set_direct: buckets is NULL");
    c = b->comm;
    /* one process: the last rank to leave frees the flags with rank 0's allocator; params are compared by address */
    if (on && !dpar__tp_shares_memory(c)) /* the same on every rank: nobody waits */
        return dpar__err(DPAR_EUNSUPPORTED,
                         "dpar_buckets_set_direct: %s is not a comm of thread ranks with buffers in host "
                         "memory (direct buckets read the other ranks' memory)",
                         c->name);
    if (b->nmarks) {
        dpar__err(DPAR_EBUSY, "dpar_buckets_set_direct: gradients of this step are marked ready");
        return on ? dpar__bad_call(c, DPAR_EBUSY) : DPAR_EBUSY; /* turning on is collective: the others must not wait */
    }
    dpar__direct_off(b);
    if (!on) return DPAR_OK;
    N = c->size;
    r = c->rank;
    v = (uint64_t *)dpar__calloc(&b->allocator, V_N * (size_t)N, sizeof(uint64_t));
    peers = (void **)dpar__calloc(&b->allocator, S_N * (size_t)N, sizeof(void *));
    b->dgrads = (float **)dpar__calloc(&b->allocator, (size_t)N, sizeof(float *));
    b->dparams = (float **)dpar__calloc(&b->allocator, (size_t)N, sizeof(float *));
    b->dbase = (float ***)dpar__calloc(&b->allocator, (size_t)N, sizeof(float **));
    b->dpbase = (float ***)dpar__calloc(&b->allocator, (size_t)N, sizeof(float **));
    b->pend = (int *)dpar__calloc(&b->allocator, (size_t)b->nb + 1, sizeof(int));
    b->dstate = (unsigned char *)dpar__calloc(&b->allocator, (size_t)b->nb + 1, 1);
    if (r == 0) { /* the flags, then one "reading" word per rank */
        d = (dpar__direct *)dpar__calloc(&b->allocator, 1,
                                         sizeof *d + (3 * (size_t)b->nb + 1) * (size_t)N * sizeof(uint32_t));
        if (d) d->refs = N, d->allocator = b->allocator;
    }
    ok = peers && b->dgrads && b->dparams && b->dbase && b->dpbase && b->pend && b->dstate && (r != 0 || d);
    if (!v) { /* cannot even say so: fail the others' allgather too */
        dpar__direct_off(b);
        dpar__free(&b->allocator, d);
        dpar__free(&b->allocator, peers);
        return dpar__bad_call(c, dpar__err(DPAR_ENOMEM, "dpar_buckets_set_direct: out of memory"));
    }
    v[V_N * r + V_OK] = (uint64_t)ok;
    v[V_N * r + V_COUNT] = (uint64_t)b->count;
    v[V_N * r + V_UPDATE] = (uint64_t)(b->update.fn != NULL);
    v[V_N * r + V_PER] = (uint64_t)b->per;
    v[V_N * r + V_OP] = (uint64_t)b->op;
    st = dpar_allgather(c, v + V_N * r, v, V_N * (size_t)N, DPAR_I64);
    for (q = 0; q < N && st == DPAR_OK; q++) {
        const uint64_t *w = v + V_N * q;
        if (!w[V_OK]) st = dpar__err(DPAR_ENOMEM, "dpar_buckets_set_direct: out of memory on rank %d", q);
        else if (w[V_COUNT] != v[V_COUNT] || w[V_UPDATE] != v[V_UPDATE] || w[V_PER] != v[V_PER] || w[V_OP] != v[V_OP])
            st = dpar__err(DPAR_EINVAL,
                           "dpar_buckets_set_direct: rank %d has %llu gradients in buckets of %llu, op %s, %s "
                           "an update; rank 0 %llu, %llu, %s, %s",
                           q, (unsigned long long)w[V_COUNT], (unsigned long long)w[V_PER],
                           dpar_op_name((dpar_op)w[V_OP]), w[V_UPDATE] ? "with" : "without",
                           (unsigned long long)v[V_COUNT], (unsigned long long)v[V_PER], dpar_op_name((dpar_op)v[V_OP]),
                           v[V_UPDATE] ? "with" : "without");
    }
    if (st == DPAR_OK) { /* every rank agrees: share the buffers (once given, the flags are never freed on an error) */
        mine[S_GRADS] = b->grads;
        /* the params (the tensor form: its first tensor's data, to see whether the ranks share them) */
        mine[S_PARAMS] = !b->update.fn ? NULL : b->ptens ? b->ptens[0].data : (const void *)b->update.gather;
        mine[S_FLAGS] = d;
        mine[S_BASE] = b->grads ? NULL : (const void *)b->base;
        mine[S_PBASE] = b->update.fn && b->ptens ? (const void *)b->pbase : NULL;
        if ((st = dpar__expose(c, mine, S_N, peers, "dpar_buckets_set_direct")) != DPAR_OK) d = NULL;
    }
    /* the same count on every rank: how many ranks share an earlier rank's params */
    for (q = 0; q < N && st == DPAR_OK; q++) {
        int e;
        for (e = 0; e < q && peers[S_N * e + S_PARAMS] != peers[S_N * q + S_PARAMS]; e++) {}
        shared += e < q;
    }
    if (st == DPAR_OK && v[V_UPDATE] && shared != 0 && shared != N - 1) /* all share one, or none shares */
        st = dpar__err(DPAR_EINVAL,
                       "dpar_buckets_set_direct: some ranks share their params and some do not (all or none)");
    for (q = 0; q < N && st == DPAR_OK && v[V_UPDATE] && shared; q++) /* the same answer on every rank */
        if (peers[S_N * q + S_PBASE])
            st = dpar__err(DPAR_EINVAL,
                           "dpar_buckets_set_direct: rank %d's params tensors are shared with another "
                           "rank's (each rank's own, with the tensor form)",
                           q);
    if (st == DPAR_OK) {
        b->direct = (dpar__direct *)peers[S_FLAGS]; /* rank 0's */
        b->dcopy = !b->update.fn || shared == 0;
        for (q = 0; q < N; q++) {
            b->dgrads[q] = (float *)peers[S_N * q + S_GRADS];
            b->dparams[q] = (float *)peers[S_N * q + S_PARAMS];
            b->dbase[q] = (float **)peers[S_N * q + S_BASE];
            b->dpbase[q] = (float **)peers[S_N * q + S_PBASE];
        }
        b->gen = 0;
        b->failed = DPAR_OK;
    } else { /* every rank saw the same words: nobody keeps the flags (unless the exposing failed) */
        dpar__direct_off(b);
        dpar__free(&b->allocator, d);
    }
    dpar__free(&b->allocator, v);
    dpar__free(&b->allocator, peers);
    return st;
}

DPAR_API int dpar_buckets_count(const dpar_buckets *b) { return b ? b->nb : 0; }
DPAR_API uint64_t dpar_buckets_overlap_ns(const dpar_buckets *b) { return b ? b->overlap : 0; }

DPAR_API dpar_status dpar_buckets_destroy(dpar_buckets *b)
{
    int i;
    dpar_status st = DPAR_OK, st2;
    if (!b) return DPAR_OK;
    for (i = 0; i < b->nb && b->req; i++)
        if (b->req[i] && (st2 = dpar_request_wait(b->req[i])) != DPAR_OK && st == DPAR_OK) st = st2;
    dpar__direct_off(b);
    dpar__free(&b->allocator, b->filled);
    dpar__free(&b->allocator, b->req);
    dpar__free(&b->allocator, b->marks);
    dpar__free(&b->allocator, b->tens);
    dpar__free(&b->allocator, b->tstart);
    dpar__free(&b->allocator, b->base);
    dpar__free(&b->allocator, b->stage);
    dpar__free(&b->allocator, b->staged);
    dpar__free(&b->allocator, b->ptens);
    dpar__free(&b->allocator, b->pbase);
    dpar__free(&b->allocator, b->pstage);
    dpar__free(&b->allocator, b);
    return st;
}

/* >>steal: work stealing between thread ranks --------------------------------------------------- */
/* One list per rank, in a block the ranks share (the last to leave frees it). The word packs
   (run << 40 | front << 20 | back): the owner takes task `front` and thieves task `back - 1`, each
   with one compare-and-swap, so a task is taken exactly once; the run number (the owner's count of
   its calls, 24 bits) keeps a thief's stale compare-and-swap from landing on a later list. The rest
   is what a thief needs to run a task of the list; the owner writes it only while its list is empty. */
typedef struct dpar__steal_list {
    uint64_t word;
    dpar_steal_task_fn task;
    void *user;
    uint32_t *ran; /* [max]: 1 once a task taken by another rank has run (the owner clears them) */
    int failing;   /* atomic: 1 once a task run by another rank has failed: that rank writes msg... */
    int err;       /* atomic: ...then its status here (0: none), so whoever sees err may read msg */
    char msg[DPAR__ERROR_TEXT];
    char pad[DPAR__CACHE_LINE];
} dpar__steal_list;
typedef struct dpar__steal_shared {
    int refs;
    dpar_allocator allocator;
    dpar__steal_list lists[1];
} dpar__steal_shared;

struct dpar_steal {
    dpar_comm *comm;
    dpar_allocator allocator;
    dpar__steal_shared *sh;
    uint32_t *ran;
    int max;
    uint64_t run, taken, given;
};

#define DPAR__STEAL_MASK 0xFFFFFu
static uint64_t dpar__steal_word(uint64_t run, uint64_t front, uint64_t back)
{
    return (run & 0xFFFFFFu) << 40 | front << 20 | back;
}

DPAR_API dpar_status dpar_steal_create(const dpar_steal_desc *desc, dpar_steal **out)
{
    dpar_comm *comm;
    dpar_allocator a;
    int max_tasks;
    dpar_steal *s;
    dpar__steal_shared *sh = NULL;
    uint64_t *v;         /* per rank: ok */
    void **peers = NULL; /* per rank: its shared block (rank 0's is the one) */
    const void *mine;
    dpar_status st;
    int N, q, ok;
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_steal_create: out is NULL");
    *out = NULL;
    if (!desc || !desc->comm) return dpar__err(DPAR_EINVAL, "dpar_steal_create: desc or desc->comm is NULL");
    comm = desc->comm, a = desc->allocator, max_tasks = desc->max_tasks;
    if (!dpar__tp_shares_memory(comm)) /* the same on every rank: nobody waits */
        return dpar__err(DPAR_EUNSUPPORTED,
                         "dpar_steal_create: %s is not a comm of thread ranks with buffers in host memory "
                         "(work stealing runs tasks on the other ranks' threads)",
                         comm->name);
    if (max_tasks < 1 || (unsigned)max_tasks > DPAR__STEAL_MASK)
        return dpar__bad_call(
            comm, dpar__err(DPAR_EINVAL, "dpar_steal_create: max_tasks = %d (1 to %u)", max_tasks, DPAR__STEAL_MASK));
    if ((st = dpar__check_allocator("dpar_steal_create", &a)) != DPAR_OK) return dpar__bad_call(comm, st);
    N = comm->size;
    s = (dpar_steal *)dpar__calloc(&a, 1, sizeof *s);
    v = (uint64_t *)dpar__calloc(&a, (size_t)N, sizeof(uint64_t));
    peers = (void **)dpar__calloc(&a, (size_t)N, sizeof(void *));
    if (s) s->ran = (uint32_t *)dpar__calloc(&a, (size_t)max_tasks, sizeof(uint32_t));
    if (comm->rank == 0) {
        sh = (dpar__steal_shared *)dpar__calloc(&a, 1, sizeof *sh + (size_t)N * sizeof(dpar__steal_list));
        if (sh) sh->refs = N, sh->allocator = a;
    }
    ok = s && s->ran && peers && (comm->rank != 0 || sh);
    if (!v) { /* cannot even say so: fail the others' allgather too */
        st = dpar__bad_call(comm, dpar__err(DPAR_ENOMEM, "dpar_steal_create: out of memory"));
    } else {
        v[comm->rank] = (uint64_t)ok;
        st = dpar_allgather(comm, v + comm->rank, v, (size_t)N, DPAR_I64);
    }
    for (q = 0; q < N && st == DPAR_OK; q++)
        if (!v[q]) st = dpar__err(DPAR_ENOMEM, "dpar_steal_create: out of memory on rank %d", q);
    if (st == DPAR_OK) { /* every rank has its memory: share the block (once given, it is never freed on an error) */
        mine = sh;
        if ((st = dpar__expose(comm, &mine, 1, peers, "dpar_steal_create")) != DPAR_OK) sh = NULL;
    }
    if (st == DPAR_OK) {
        s->comm = comm;
        s->allocator = a;
        s->max = max_tasks;
        s->sh = (dpar__steal_shared *)peers[0];
        s->sh->lists[comm->rank].ran = s->ran; /* the one field of my list that never changes */
        *out = s;
    } else {
        if (s) dpar__free(&a, s->ran);
        dpar__free(&a, s);
        dpar__free(&a, sh); /* every rank saw the same words: nobody keeps it */
    }
    dpar__free(&a, v);
    dpar__free(&a, peers);
    return st;
}

/* Take a task of this round from the back of the list with the most left, and run it: 1. Else 0 when
   every other rank has posted its list of this round (or is past it) and none has a task left; -1
   when some rank has not posted it yet (*missing: the first such). */
static int dpar__steal_one(dpar_steal *s, int *missing)
{
    dpar_comm *c = s->comm;
    for (;;) {
        int q, i, best = -1, late = -1;
        uint64_t w = 0, most = 0, t0;
        dpar__steal_list *l;
        dpar_status st;
        for (q = 0; q < c->size; q++) {
            uint64_t x, f, b;
            uint32_t d; /* its round - mine, mod 2^24: 0 the same, below 2^23 ahead of me, else behind */
            if (q == c->rank) continue;
            x = DPAR__LOAD(&s->sh->lists[q].word, DPAR__ACQUIRE);
            d = (uint32_t)((x >> 40) - s->run) & 0xFFFFFFu;
            f = x >> 20 & DPAR__STEAL_MASK, b = x & DPAR__STEAL_MASK;
            if (d >= 0x800000u && late < 0) late = q;
            if (d == 0 && b > f && b - f > most && !DPAR__LOAD(&s->sh->lists[q].failing, DPAR__RELAXED))
                most = b - f, best = q, w = x;
        }
        if (best < 0) {
            if (missing) *missing = late;
            return late < 0 ? 0 : -1;
        }
        l = &s->sh->lists[best];
        if (!__atomic_compare_exchange_n(&l->word, &w, w - 1, 0, DPAR__ACQ_REL, DPAR__ACQUIRE)) continue;
        i = (int)(w & DPAR__STEAL_MASK) - 1; /* the task this rank took: the last */
        t0 = dpar_time_ns();
        st = l->task(l->user, i, c->rank);
        if (st != DPAR_OK && __atomic_exchange_n(&l->failing, 1, DPAR__ACQ_REL) == 0) {
            snprintf(l->msg, sizeof l->msg, "task %d of rank %d (run on rank %d): %.440s", i, best, c->rank,
                     dpar__tls_error);
            DPAR__STORE(&l->err, (int)st, DPAR__RELEASE);
        }
        if (dpar_trace_enabled()) {
            char args[64];
            snprintf(args, sizeof args, "\"from_rank\":%d,\"task\":%d", best, i);
            dpar_trace_event("steal", "dp", t0, dpar_time_ns(), args);
        }
        DPAR__STORE(&l->ran[i], 1u, DPAR__RELEASE);
        dpar__tp_wake(c, best);
        s->taken++;
        return 1;
    }
}

DPAR_API dpar_status dpar_steal_run(dpar_steal *s, int n, dpar_steal_task_fn task, dpar_steal_done_fn done, void *user)
{
    dpar__steal_list *me;
    dpar_comm *c;
    dpar_status st = DPAR_OK;
    uint64_t w, deadline;
    int i, q, tail;
    if (!s) return dpar__err(DPAR_EINVAL, "dpar_steal_run: s is NULL");
    c = s->comm;
    if (n < 0 || n > s->max || (n > 0 && !task)) /* the others would wait for this round's list: poison */
        return dpar__bad_call(c, dpar__err(DPAR_EINVAL, "dpar_steal_run: %s (n = %d, max_tasks = %d)",
                                           n < 0 || n > s->max ? "n is outside 0 to max_tasks" : "task is NULL", n,
                                           s->max));
    DPAR__TRY(DPAR__FAULT(c, DPAR__FOP_STEAL)); /* >>fault */
    me = &s->sh->lists[c->rank];
    /* post this round's list (nobody takes from it before the word says so) and wake the ranks
       waiting for it */
    me->task = task;
    me->user = user;
    DPAR__STORE(&me->failing, 0, DPAR__RELAXED);
    DPAR__STORE(&me->err, 0, DPAR__RELAXED);
    for (i = 0; i < n; i++) DPAR__STORE(&s->ran[i], 0u, DPAR__RELAXED);
    s->run++;
    DPAR__STORE(&me->word, dpar__steal_word(s->run, 0, (uint64_t)n), DPAR__RELEASE);
    dpar__tp_wake_all(c);
    /* my tasks from the front, each handed to done at once */
    for (;;) {
        uint64_t f, b;
        w = DPAR__LOAD(&me->word, DPAR__ACQUIRE);
        f = w >> 20 & DPAR__STEAL_MASK, b = w & DPAR__STEAL_MASK;
        if (f >= b) break;
        if (st == DPAR_OK && DPAR__LOAD(&me->err, DPAR__ACQUIRE)) /* a task failed on another rank */
            st = dpar__err((dpar_status)me->err, "dpar_steal_run: %s", me->msg);
        if (st != DPAR_OK) { /* a failure: close the list (what others took still runs) */
            if (__atomic_compare_exchange_n(&me->word, &w, dpar__steal_word(s->run, b, b), 0, DPAR__ACQ_REL,
                                            DPAR__ACQUIRE))
                break;
            continue;
        }
        if (!__atomic_compare_exchange_n(&me->word, &w, w + ((uint64_t)1 << 20), 0, DPAR__ACQ_REL, DPAR__ACQUIRE))
            continue;
        if ((st = task(user, (int)f, c->rank)) != DPAR_OK)
            dpar__err(st, "dpar_steal_run: task %d of rank %d: %s", (int)f, c->rank, dpar__tls_error);
        else if (done && (st = done(user, (int)f)) != DPAR_OK)
            dpar__err(st, "dpar_steal_run: done(%d) of rank %d: %s", (int)f, c->rank, dpar__tls_error);
    }
    tail = (int)(DPAR__LOAD(&me->word, DPAR__ACQUIRE) & DPAR__STEAL_MASK); /* [tail, n) were taken by others */
    s->given += (uint64_t)(n - tail);
    /* the tasks others took, in order: wait until each has run (it writes our memory, and a task
       never waits for its owner, so it finishes), helping the others meanwhile; after a failure
       only wait (a task run for another rank could fail too and overwrite this thread's message).
       A taken task still running at the comm's timeout (one that waits, against the rules, or a stuck
       taker) poisons the comm: this rank gives up on it rather than hang */
    deadline = c->timeout_ns ? dpar_time_ns() + c->timeout_ns : 0;
    for (i = tail; i < n; i++) {
        for (;;) {
            uint32_t bell = dpar__tp_doorbell(c);
            if (DPAR__LOAD(&s->ran[i], DPAR__ACQUIRE)) break;
            if (st == DPAR_OK && dpar__steal_one(s, NULL) > 0) continue;
            if (dpar__tp_wait_bell(c, bell, deadline) != DPAR_OK && !DPAR__LOAD(&s->ran[i], DPAR__ACQUIRE)) {
                char msg[DPAR__ERROR_TEXT];
                snprintf(msg, sizeof msg,
                         "dpar_steal_run: rank %d timed out after %llu ms waiting for its task %d of round %llu, "
                         "run by another rank, to finish (a task must not wait for other ranks) on %s",
                         c->rank, (unsigned long long)(c->timeout_ns / 1000000u), i, (unsigned long long)s->run,
                         c->name);
                return dpar__tp_poison(c, DPAR_ETIMEDOUT, msg);
            }
        }
        if (st != DPAR_OK) continue;
        if (DPAR__LOAD(&me->err, DPAR__ACQUIRE)) st = dpar__err((dpar_status)me->err, "dpar_steal_run: %s", me->msg);
        else if (done && (st = done(user, i)) != DPAR_OK)
            dpar__err(st, "dpar_steal_run: done(%d) of rank %d: %s", i, c->rank, dpar__tls_error);
    }
    /* then the others' tasks of this round, until every rank has posted its list and none is left
       (waiting for a rank that has not posted yet: time out, or see the comm poisoned, as any call) */
    deadline = c->timeout_ns ? dpar_time_ns() + c->timeout_ns : 0;
    while (st == DPAR_OK) {
        uint32_t bell = dpar__tp_doorbell(c);
        int got = dpar__steal_one(s, &q);
        char msg[160];
        if (got > 0) continue;
        if (got == 0) break;
        if ((st = dpar__tp_poisoned(c)) != DPAR_OK) break;
        if (dpar__tp_wait_bell(c, bell, deadline) == DPAR_OK) continue;
        snprintf(msg, sizeof msg,
                 "dpar_steal_run: rank %d timed out after %llu ms waiting for rank %d to start its "
                 "tasks of round %llu on %s",
                 c->rank, (unsigned long long)(c->timeout_ns / 1000000u), q, (unsigned long long)s->run, c->name);
        st = dpar__tp_poison(c, DPAR_ETIMEDOUT, msg);
    }
    return st;
}

DPAR_API void dpar_steal_counts(const dpar_steal *s, uint64_t *taken, uint64_t *given)
{
    if (taken) *taken = s ? s->taken : 0;
    if (given) *given = s ? s->given : 0;
}

DPAR_API dpar_status dpar_steal_destroy(dpar_steal *s)
{
    dpar_allocator a;
    if (!s) return DPAR_OK;
    a = s->allocator;
    if (__atomic_sub_fetch(&s->sh->refs, 1, DPAR__ACQ_REL) == 0) {
        dpar_allocator mine = s->sh->allocator;
        dpar__free(&mine, s->sh);
    }
    dpar__free(&a, s->ran);
    dpar__free(&a, s);
    return DPAR_OK;
}

/* >>idx: IDX data files (MNIST format) ---------------------------------------------------------- */
static uint32_t dpar__be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static dpar_status dpar__idx_read(dpar_idx *out, const char *path, float scale)
{
    FILE *f;
    unsigned char head[4 + 8 * 4], *raw = NULL;
    long size;
    size_t count = 1, es, want, i;
    int type, d;
    dpar_status st = DPAR_OK;
    f = fopen(path, "rb");
    if (!f) return dpar__err(DPAR_EIO, "dpar_idx_init: cannot open '%s': %s", path, strerror(errno));
    if (fseek(f, 0, SEEK_END) != 0 || (size = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return dpar__err(DPAR_EIO, "dpar_idx_init: cannot size '%s'", path);
    }
    if (size < 4 || fread(head, 1, 4, f) != 4) {
        fclose(f);
        return dpar__err(DPAR_ECORRUPT, "dpar_idx_init: '%s' is %ld bytes, too short for an IDX header", path, size);
    }
    type = head[2];
    out->ndims = head[3];
    if (head[0] || head[1]) {
        fclose(f);
        return dpar__err(DPAR_ECORRUPT, "dpar_idx_init: '%s' is not an IDX file (magic %02x %02x %02x %02x)", path,
                         head[0], head[1], head[2], head[3]);
    }
    if (type != 0x08 && type != 0x0D) {
        fclose(f);
        return dpar__err(DPAR_EUNSUPPORTED,
                         "dpar_idx_init: '%s' has data type 0x%02x; u8 (0x08) and f32 (0x0D) are "
                         "supported",
                         path, type);
    }
    if (out->ndims < 1 || out->ndims > 8) {
        fclose(f);
        return dpar__err(DPAR_ECORRUPT, "dpar_idx_init: '%s' says it has %d dimensions (1..8)", path, out->ndims);
    }
    if (size < 4 + 4 * out->ndims || fread(head + 4, 4, (size_t)out->ndims, f) != (size_t)out->ndims) {
        fclose(f);
        return dpar__err(DPAR_ECORRUPT, "dpar_idx_init: '%s' is truncated inside its header (%ld bytes)", path, size);
    }
    es = type == 0x08 ? 1 : 4;
    for (d = 0; d < out->ndims; d++) {
        out->dims[d] = dpar__be32(head + 4 + 4 * d);
        if (out->dims[d] && count > SIZE_MAX / es / out->dims[d]) {
            fclose(f);
            return dpar__err(DPAR_ECORRUPT, "dpar_idx_init: '%s' has dimensions too large to hold", path);
        }
        count *= out->dims[d];
    }
    want = count * es;
    if ((size_t)(size - 4 - 4 * out->ndims) != want) {
        fclose(f);
        return dpar__err(DPAR_ECORRUPT, "dpar_idx_init: '%s' has %ld bytes of data where its dimensions say %zu (%s)",
                         path, size - 4 - 4L * out->ndims, want,
                         (size_t)(size - 4 - 4 * out->ndims) < want ? "truncated" : "extra bytes");
    }
    out->count = count;
    out->data = (float *)dpar__alloc(&out->allocator, count * sizeof(float) + 1);
    raw = (unsigned char *)dpar__alloc(&out->allocator, want + 1);
    if (!out->data || !raw) {
        st = dpar__err(DPAR_ENOMEM, "dpar_idx_init: out of memory for %zu values", count);
    } else if (fread(raw, 1, want, f) != want) {
        st = dpar__err(DPAR_EIO, "dpar_idx_init: reading '%s' failed", path);
    } else if (es == 1) {
        for (i = 0; i < count; i++) out->data[i] = (float)raw[i] * scale;
    } else {
        for (i = 0; i < count; i++) {
            uint32_t u = dpar__be32(raw + 4 * i);
            memcpy(&out->data[i], &u, sizeof u);
        }
    }
    dpar__free(&out->allocator, raw);
    fclose(f);
    return st;
}

DPAR_API dpar_status dpar_idx_init(dpar_idx *idx, const dpar_idx_desc *desc)
{
    dpar_status st;
    if (!idx) return dpar__err(DPAR_EINVAL, "dpar_idx_init: idx is NULL");
    memset(idx, 0, sizeof *idx);
    if (!desc || !desc->path) return dpar__err(DPAR_EINVAL, "dpar_idx_init: desc or desc->path is NULL");
    DPAR__TRY(dpar__check_allocator("dpar_idx_init", &desc->allocator));
    idx->allocator = desc->allocator;
    st = dpar__idx_read(idx, desc->path, desc->scale != 0.0f ? desc->scale : 1.0f);
    if (st != DPAR_OK) dpar_idx_destroy(idx);
    return st;
}

DPAR_API dpar_status dpar_idx_destroy(dpar_idx *idx)
{
    if (!idx) return DPAR_OK;
    dpar__free(&idx->allocator, idx->data);
    memset(idx, 0, sizeof *idx);
    return DPAR_OK;
}

/* >>ckpt: checkpoints: sharded, CRC-checked, written atomically --------------------------------- */
DPAR_API uint32_t dpar_crc32(uint32_t crc, const void *data, size_t bytes)
{
    uint32_t table[256], c;
    const unsigned char *p = (const unsigned char *)data;
    int i, k;
    for (i = 0; i < 256; i++) { /* 256 x 8 steps: cheap beside the data, and no global table */
        c = (uint32_t)i;
        for (k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[i] = c;
    }
    crc = ~crc;
    while (bytes--) crc = table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#define DPAR__CKPT_MAGIC "DPARCKP1"
#define DPAR__MAN_MAGIC "DPARMAN2" /* version 2: with the planned tensors; "DPARMAN1" still loads */

static void dpar__put32(unsigned char *p, uint32_t v)
{
    int i;
    for (i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void dpar__put64(unsigned char *p, uint64_t v)
{
    int i;
    for (i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t dpar__get32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t dpar__get64(const unsigned char *p)
{
    return (uint64_t)dpar__get32(p) | (uint64_t)dpar__get32(p + 4) << 32;
}

/* write `bytes` to path atomically: a temporary file, fsync, rename, fsync of the directory */
static dpar_status dpar__write_atomic(const char *path, const void *a, size_t na, const void *b, size_t nb)
{
    char tmp[4096], dir[4096];
    FILE *f;
    int bad, fd;
    char *slash;
    if (strlen(path) + 5 >= sizeof tmp) return dpar__err(DPAR_EINVAL, "checkpoint: path '%s' is too long", path);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    f = fopen(tmp, "wb");
    if (!f) return dpar__err(DPAR_EIO, "checkpoint: cannot create '%s': %s", tmp, strerror(errno));
    bad = (na && fwrite(a, 1, na, f) != na) || (nb && fwrite(b, 1, nb, f) != nb) || fflush(f) != 0 ||
          fsync(fileno(f)) != 0;
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0) {
        int e = errno;
        remove(tmp);
        return dpar__err(DPAR_EIO, "checkpoint: writing '%s' failed: %s", path, strerror(e));
    }
    snprintf(dir, sizeof dir, "%s", path);
    slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    else snprintf(dir, sizeof dir, ".");
    if (slash == dir) snprintf(dir, sizeof dir, "/");
    if ((fd = open(dir, O_RDONLY)) >= 0) { /* the rename itself reaches the disk */
        fsync(fd);
        close(fd);
    }
    return DPAR_OK;
}

static dpar_status dpar__read_file(const char *path, unsigned char **out, size_t *n, const dpar_allocator *a)
{
    FILE *f = fopen(path, "rb");
    long size;
    *out = NULL;
    if (!f) return dpar__err(DPAR_EIO, "cannot open '%s': %s", path, strerror(errno));
    if (fseek(f, 0, SEEK_END) != 0 || (size = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return dpar__err(DPAR_EIO, "cannot size '%s'", path);
    }
    *out = (unsigned char *)dpar__alloc(a, (size_t)size + 1);
    if (!*out) {
        fclose(f);
        return dpar__err(DPAR_ENOMEM, "out of memory reading '%s'", path);
    }
    if (fread(*out, 1, (size_t)size, f) != (size_t)size) {
        fclose(f);
        dpar__free(a, *out);
        *out = NULL;
        return dpar__err(DPAR_EIO, "reading '%s' failed", path);
    }
    fclose(f);
    *n = (size_t)size;
    return DPAR_OK;
}

struct dpar__ckpt_ten;
/* the manifest's generation and rank count (save: the next generation, and the old shards to remove) */
static dpar_status dpar__ckpt_parse(const char *path, const unsigned char *m, size_t n, uint32_t *nsaved, uint64_t *gen,
                                    struct dpar__ckpt_ten **tens, uint32_t *ntens, const dpar_allocator *a);
static dpar_status dpar__manifest_read(const char *path, uint64_t *gen, uint32_t *nranks, const dpar_allocator *a)
{
    unsigned char *m;
    size_t n;
    uint32_t nt;
    struct dpar__ckpt_ten *t = NULL;
    dpar_status st = dpar__read_file(path, &m, &n, a);
    if (st != DPAR_OK) return st;
    st = dpar__ckpt_parse(path, m, n, nranks, gen, &t, &nt, a);
    dpar__free(a, t);
    dpar__free(a, m);
    return st;
}

/* everyone's status: the worst (most negative) wins, with the failing rank's own story */
static dpar_status dpar__ckpt_agree(dpar_comm *c, dpar_status mine, const char *what)
{
    int64_t v = (int64_t)mine;
    dpar_status st;
    char text[DPAR__ERROR_TEXT];
    if (!c) return mine;
    snprintf(text, sizeof text, "%s", dpar_last_error());
    st =
        dpar__host_coll(c, DPAR_COLL_ALLREDUCE, &v, &v, 1, DPAR_I64, DPAR_MIN, 0, "dpar_allreduce", __FILE__, __LINE__);
    if (st != DPAR_OK) return st;
    if (mine != DPAR_OK) return dpar__err(mine, "%s", text);
    if (v != DPAR_OK)
        return dpar__err((dpar_status)v, "%s: another rank failed: %s", what, dpar_status_string((dpar_status)v));
    return DPAR_OK;
}

/* the constructors: an item with its plan */
DPAR_API dpar_ckpt_item dpar_ckpt_own(const char *name, void *data, size_t bytes)
{
    dpar_ckpt_item it;
    memset(&it, 0, sizeof it);
    it.name = name;
    it.data = data;
    it.bytes = bytes;
    return it;
}
DPAR_API dpar_ckpt_item dpar_ckpt_block(const char *name, void *data, size_t elem, size_t rows, size_t cols,
                                        size_t row0, size_t nrows, size_t col0, size_t ncols)
{
    dpar_ckpt_item it = dpar_ckpt_own(name, data, nrows * ncols * elem);
    it.elem = elem;
    it.rows = rows, it.cols = cols;
    it.row0 = row0, it.nrows = nrows;
    it.col0 = col0, it.ncols = ncols;
    return it;
}
DPAR_API dpar_ckpt_item dpar_ckpt_replica(const char *name, void *data, size_t bytes)
{
    return dpar_ckpt_block(name, data, 1, 1, bytes, 0, 1, 0, bytes);
}
DPAR_API dpar_ckpt_item dpar_ckpt_flat(const char *name, void *data, size_t elem, size_t total, size_t offset,
                                       size_t count)
{
    return dpar_ckpt_block(name, data, elem, 1, total, 0, 1, offset, count);
}
DPAR_API dpar_ckpt_item dpar_ckpt_shard(const char *name, void *data, size_t elem, const dpar_shard_plan *plan,
                                        int rank)
{
    size_t r0 = 0, nr = 0, c0 = 0, nc = 0;
    DPAR_ASSERT(plan != NULL);
    dpar_shard_slice(plan, rank, &r0, &nr, &c0, &nc);
    return dpar_ckpt_block(name, data, elem, plan->rows, plan->cols, r0, nr, c0, nc);
}

static dpar_status dpar__ckpt_check_items(const dpar_ckpt_item *items, int count, const char *api)
{
    int i, j;
    if (count < 0 || (count && !items)) return dpar__err(DPAR_EINVAL, "%s: %d items", api, count);
    for (i = 0; i < count; i++) {
        const dpar_ckpt_item *t = &items[i];
        if (!t->name || !*t->name || strlen(t->name) > 63)
            return dpar__err(DPAR_EINVAL, "%s: item %d needs a name of 1..63 characters", api, i);
        if (t->bytes && !t->data) return dpar__err(DPAR_EINVAL, "%s: item '%s' has no data", api, t->name);
        if (t->elem) { /* the block lies in the tensor and is the item's bytes, without overflow */
            size_t big = (size_t)-1;
            int ok = t->row0 <= t->rows && t->nrows <= t->rows - t->row0 && t->col0 <= t->cols &&
                     t->ncols <= t->cols - t->col0 && (!t->rows || t->cols <= big / t->rows) &&
                     (!t->rows || !t->cols || t->elem <= big / (t->rows * t->cols)) &&
                     t->nrows * t->ncols * t->elem == t->bytes;
            if (!ok)
                return dpar__err(DPAR_EINVAL,
                                 "%s: item '%s': its plan (rows %zu+%zu, columns %zu+%zu of %zu x %zu elements of %zu "
                                 "bytes) lies outside the tensor or is not its %zu bytes (zero an item before filling "
                                 "it: dpar_ckpt_item it = {0}, or the dpar_ckpt_* constructors)",
                                 api, t->name, t->row0, t->nrows, t->col0, t->ncols, t->rows, t->cols, t->elem,
                                 t->bytes);
        }
        for (j = 0; j < i; j++)
            if (!strcmp(t->name, items[j].name))
                return dpar__err(DPAR_EINVAL, "%s: two items are called '%s'", api, t->name);
    }
    return DPAR_OK;
}

/* a planned block as the ranks exchange it on save: name, elem, rows, cols, row0, nrows, col0, ncols */
typedef struct dpar__ckpt_rec {
    const unsigned char *name;
    uint32_t nlen;
    int rank, idx, dup; /* dup: a rank before holds the same block, or it is empty: not written */
    uint64_t v[7];      /* elem, rows, cols, row0, nrows, col0, ncols */
} dpar__ckpt_rec;

static int dpar__ckpt_rec_cmp(const void *pa, const void *pb)
{
    const dpar__ckpt_rec *a = (const dpar__ckpt_rec *)pa, *b = (const dpar__ckpt_rec *)pb;
    uint32_t n = a->nlen < b->nlen ? a->nlen : b->nlen;
    int c = memcmp(a->name, b->name, n);
    if (c) return c;
    if (a->nlen != b->nlen) return a->nlen < b->nlen ? -1 : 1;
    return a->rank < b->rank ? -1 : a->rank > b->rank;
}

/* the blocks [a0, a0 + an) and [b0, b0 + bn) overlap */
static int dpar__ckpt_meet(uint64_t a0, uint64_t an, uint64_t b0, uint64_t bn)
{
    return an && bn && a0 < b0 + bn && b0 < a0 + an;
}

/* check the gathered plans of one tensor (recs[lo..hi), sorted by rank): one shape, blocks that tile it; mark
   duplicates. Every rank runs it on the same data, so every rank reaches the same verdict. */
static dpar_status dpar__ckpt_tile(dpar__ckpt_rec *r, int lo, int hi)
{
    int i, j;
    uint64_t area = 0;
    for (i = lo; i < hi; i++) {
        if (memcmp(r[i].v, r[lo].v, 3 * sizeof(uint64_t)))
            return dpar__err(DPAR_EINVAL,
                             "dpar_ckpt_save: tensor '%.*s': rank %d holds a block of %llu x %llu elements of %llu "
                             "bytes, rank %d of %llu x %llu of %llu (shape mismatch)",
                             (int)r[i].nlen, (const char *)r[i].name, r[lo].rank, (unsigned long long)r[lo].v[1],
                             (unsigned long long)r[lo].v[2], (unsigned long long)r[lo].v[0], r[i].rank,
                             (unsigned long long)r[i].v[1], (unsigned long long)r[i].v[2],
                             (unsigned long long)r[i].v[0]);
        r[i].dup = r[i].v[4] * r[i].v[6] == 0;
        for (j = lo; j < i && !r[i].dup; j++) {
            if (r[j].dup) continue;
            if (!memcmp(r[i].v + 3, r[j].v + 3, 4 * sizeof(uint64_t))) r[i].dup = 1; /* a replica: stored once */
            else if (dpar__ckpt_meet(r[i].v[3], r[i].v[4], r[j].v[3], r[j].v[4]) &&
                     dpar__ckpt_meet(r[i].v[5], r[i].v[6], r[j].v[5], r[j].v[6]))
                return dpar__err(DPAR_EINVAL, "dpar_ckpt_save: tensor '%.*s': the blocks of ranks %d and %d overlap",
                                 (int)r[i].nlen, (const char *)r[i].name, r[j].rank, r[i].rank);
        }
        if (!r[i].dup) area += r[i].v[4] * r[i].v[6];
    }
    if (area != r[lo].v[1] * r[lo].v[2])
        return dpar__err(DPAR_EINVAL,
                         "dpar_ckpt_save: tensor '%.*s': the ranks' blocks cover %llu of its %llu x %llu elements "
                         "(a hole: a rank is missing or its block is wrong)",
                         (int)r[lo].nlen, (const char *)r[lo].name, (unsigned long long)area,
                         (unsigned long long)r[lo].v[1], (unsigned long long)r[lo].v[2]);
    return DPAR_OK;
}

/* save, step 1: every rank learns every rank's plans; the tensors are checked, and each planned item learns whether
   this rank writes it (*mine[i], per planned item in order). On success *recs (sorted by name, then rank) and
   *table (the bytes they point into) are the caller's to free. */
static dpar_status dpar__ckpt_plans(dpar_comm *comm, const dpar_ckpt_item *items, int count, const dpar_allocator *a,
                                    unsigned char **table, dpar__ckpt_rec **recs, int *nrecs, unsigned char *mine)
{
    int rank = comm ? comm->rank : 0, nranks = comm ? comm->size : 1, i, r, n = 0, k = 0;
    int64_t len = 8, most;
    size_t slot;
    unsigned char *p;
    dpar__ckpt_rec *rec;
    dpar_status st = DPAR_OK;
    *table = NULL, *recs = NULL, *nrecs = 0;
    for (i = 0; i < count; i++)
        if (items[i].elem) len += 4 + (int64_t)strlen(items[i].name) + 56;
    most = len;
    if (comm)
        DPAR__TRY(dpar__host_coll(comm, DPAR_COLL_ALLREDUCE, &len, &most, 1, DPAR_I64, DPAR_MAX, 0, "dpar_allreduce",
                                  __FILE__, __LINE__));
    slot = (size_t)most;
    *table = (unsigned char *)dpar__calloc(a, (size_t)nranks, slot);
    if (!*table) st = dpar__err(DPAR_ENOMEM, "dpar_ckpt_save: out of memory");
    if (comm) DPAR__TRY(dpar__ckpt_agree(comm, st, "checkpoint"));
    else if (st != DPAR_OK) return st;
    p = *table + (size_t)rank * slot;
    dpar__put64(p, (uint64_t)len);
    p += 8;
    for (i = 0; i < count; i++) {
        const dpar_ckpt_item *t = &items[i];
        uint64_t v[7];
        int q;
        if (!t->elem) continue;
        v[0] = t->elem, v[1] = t->rows, v[2] = t->cols, v[3] = t->row0, v[4] = t->nrows, v[5] = t->col0;
        v[6] = t->ncols;
        dpar__put32(p, (uint32_t)strlen(t->name));
        memcpy(p + 4, t->name, strlen(t->name));
        p += 4 + strlen(t->name);
        for (q = 0; q < 7; q++) dpar__put64(p + 8 * q, v[q]);
        p += 56;
        n++;
    }
    if (comm)
        DPAR__TRY(dpar__host_coll(comm, DPAR_COLL_ALLGATHER, *table + (size_t)rank * slot, *table,
                                  slot * (size_t)nranks, DPAR_U8, DPAR_SUM, 0, "dpar_allgather", __FILE__, __LINE__));
    /* count and parse every rank's records */
    for (r = 0, n = 0; r < nranks; r++) {
        unsigned char *s = *table + (size_t)r * slot, *end = s + dpar__get64(s);
        for (p = s + 8; p < end; p += 60 + dpar__get32(p)) n++;
    }
    rec = (dpar__ckpt_rec *)dpar__calloc(a, (size_t)n + 1, sizeof *rec);
    if (!rec) return dpar__err(DPAR_ENOMEM, "dpar_ckpt_save: out of memory");
    for (r = 0; r < nranks; r++) {
        unsigned char *s = *table + (size_t)r * slot, *end = s + dpar__get64(s);
        int idx = 0;
        for (p = s + 8; p < end; p += 60 + rec[k].nlen, idx++, k++) {
            int q;
            rec[k].nlen = dpar__get32(p);
            rec[k].name = p + 4;
            rec[k].rank = r;
            rec[k].idx = idx;
            for (q = 0; q < 7; q++) rec[k].v[q] = dpar__get64(p + 4 + rec[k].nlen + 8 * q);
        }
    }
    qsort(rec, (size_t)n, sizeof *rec, dpar__ckpt_rec_cmp);
    for (i = 0; i < n && st == DPAR_OK; i = k) {
        for (k = i + 1; k < n && rec[k].nlen == rec[i].nlen && !memcmp(rec[k].name, rec[i].name, rec[i].nlen); k++)
            continue;
        st = dpar__ckpt_tile(rec, i, k);
    }
    for (i = 0; i < n; i++)
        if (rec[i].rank == rank) mine[rec[i].idx] = (unsigned char)!rec[i].dup;
    *recs = rec, *nrecs = n;
    return st;
}

DPAR_API dpar_status dpar_ckpt_save(dpar_comm *comm, const char *path, const dpar_ckpt_item *items, int count)
{
    dpar_allocator a;
    int rank = comm ? comm->rank : 0, nranks = comm ? comm->size : 1, i, k, nrecs = 0, nwrite = 0, planned = 0;
    uint64_t gen = 1, old = 0, *sizes = NULL;
    uint32_t old_n = 0;
    unsigned char *head = NULL, *table = NULL, *mine = NULL;
    dpar__ckpt_rec *recs = NULL;
    size_t hn, total = 0;
    char shard[4096];
    dpar_status st;
    int64_t sh[2];
    memset(&a, 0, sizeof a);
    if (comm) a = comm->allocator;
    if (!path || !*path) return dpar__err(DPAR_EINVAL, "dpar_ckpt_save: path is NULL or empty");
    st = dpar__ckpt_check_items(items, count, "dpar_ckpt_save");
    if (st != DPAR_OK) return comm ? dpar__bad_call(comm, st) : st;
    /* the generation: one after the current manifest's (rank 0 decides, everyone hears) */
    if (rank == 0 && dpar__manifest_read(path, &old, &old_n, &a) == DPAR_OK) gen = old + 1;
    dpar_clear_error();
    if (comm) {
        int64_t g[3];
        g[0] = (int64_t)gen;
        g[1] = (int64_t)old;
        g[2] = (int64_t)old_n;
        DPAR__TRY(dpar__host_coll(comm, DPAR_COLL_BROADCAST, g, g, 3, DPAR_I64, DPAR_SUM, 0, "dpar_broadcast", __FILE__,
                                  __LINE__));
        gen = (uint64_t)g[0];
        old = (uint64_t)g[1];
        old_n = (uint32_t)g[2];
    }
    /* the plans: every rank's, checked; which planned items this rank writes (a replica: only its first holder) */
    for (i = 0; i < count; i++) planned += items[i].elem != 0;
    mine = (unsigned char *)dpar__calloc(&a, (size_t)planned + 1, 1);
    st = dpar__ckpt_agree(comm, mine ? DPAR_OK : dpar__err(DPAR_ENOMEM, "dpar_ckpt_save: out of memory"), "checkpoint");
    if (st != DPAR_OK) goto done;
    st = dpar__ckpt_plans(comm, items, count, &a, &table, &recs, &nrecs, mine);
    if (st != DPAR_OK) goto done; /* the same verdict on every rank, or a comm error */
    /* this rank's shard: a header with every item's name, size and CRC, then the data */
    hn = 32;
    for (i = 0, k = 0; i < count; i++) {
        int w = items[i].elem ? mine[k++] : 1;
        if (w) hn += 4 + strlen(items[i].name) + 8 + 4, nwrite++;
    }
    head = (unsigned char *)dpar__alloc(&a, hn);
    if (!head) {
        st = dpar__ckpt_agree(comm, dpar__err(DPAR_ENOMEM, "dpar_ckpt_save: out of memory"), "checkpoint");
        goto done;
    }
    memcpy(head, DPAR__CKPT_MAGIC, 8);
    dpar__put32(head + 8, 1);
    dpar__put32(head + 12, (uint32_t)rank);
    dpar__put32(head + 16, (uint32_t)nranks);
    dpar__put32(head + 20, (uint32_t)nwrite);
    dpar__put64(head + 24, gen);
    {
        unsigned char *p = head + 32;
        for (i = 0, k = 0; i < count; i++) {
            size_t ln = strlen(items[i].name);
            if (items[i].elem && !mine[k++]) continue;
            dpar__put32(p, (uint32_t)ln);
            memcpy(p + 4, items[i].name, ln);
            dpar__put64(p + 4 + ln, items[i].bytes);
            dpar__put32(p + 12 + ln, dpar_crc32(0, items[i].data, items[i].bytes));
            p += 16 + ln;
            total += items[i].bytes;
        }
    }
    snprintf(shard, sizeof shard, "%s.g%llu.r%d", path, (unsigned long long)gen, rank);
    {
        /* header and items in one buffer, so the file is written once */
        unsigned char *all = (unsigned char *)dpar__alloc(&a, hn + total + 1), *p;
        uint32_t crc;
        if (!all) {
            st = dpar__ckpt_agree(comm, dpar__err(DPAR_ENOMEM, "dpar_ckpt_save: out of memory"), "checkpoint");
            goto done;
        }
        memcpy(all, head, hn);
        p = all + hn;
        for (i = 0, k = 0; i < count; i++) {
            if (items[i].elem && !mine[k++]) continue;
            if (items[i].bytes) memcpy(p, items[i].data, items[i].bytes);
            p += items[i].bytes;
        }
        crc = dpar_crc32(0, all, hn + total);
        st = dpar__write_atomic(shard, all, hn + total, NULL, 0);
        sh[0] = (int64_t)(hn + total);
        sh[1] = (int64_t)crc;
        dpar__free(&a, all);
    }
    st = dpar__ckpt_agree(comm, st, "checkpoint");
    if (st != DPAR_OK) goto done;
    /* rank 0 learns every shard's size and CRC and commits the manifest */
    sizes = (uint64_t *)dpar__alloc(&a, 2 * (size_t)nranks * sizeof(uint64_t));
    if (!sizes) {
        st = dpar__ckpt_agree(comm, dpar__err(DPAR_ENOMEM, "dpar_ckpt_save: out of memory"), "checkpoint");
        goto done;
    }
    sizes[2 * rank] = (uint64_t)sh[0];
    sizes[2 * rank + 1] = (uint64_t)sh[1];
    if (comm)
        st = dpar__host_coll(comm, DPAR_COLL_ALLGATHER, sizes + 2 * rank, sizes, 2 * (size_t)nranks, DPAR_I64, DPAR_SUM,
                             0, "dpar_allgather", __FILE__, __LINE__);
    if (st == DPAR_OK && rank == 0) {
        /* magic, nranks, generation, per rank (size, crc), the tensors, crc of all before it. A tensor: name
           length, name, elem, rows, cols, its stored blocks: count, then per block (rank, row0, nrows, col0, ncols) */
        size_t mn = 20 + 12 * (size_t)nranks + 4 + 4;
        unsigned char *man, *p;
        uint32_t ntens = 0;
        for (i = 0; i < nrecs; i++) {
            int first =
                i == 0 || recs[i].nlen != recs[i - 1].nlen || memcmp(recs[i].name, recs[i - 1].name, recs[i].nlen);
            if (first) mn += 4 + recs[i].nlen + 24 + 4, ntens++;
            if (!recs[i].dup) mn += 36;
        }
        man = (unsigned char *)dpar__alloc(&a, mn);
        if (!man) {
            st = dpar__err(DPAR_ENOMEM, "dpar_ckpt_save: out of memory");
        } else {
            unsigned char *nb = NULL;
            memcpy(man, DPAR__MAN_MAGIC, 8);
            dpar__put32(man + 8, (uint32_t)nranks);
            dpar__put64(man + 12, gen);
            for (i = 0; i < nranks; i++) {
                dpar__put64(man + 20 + 12 * i, sizes[2 * i]);
                dpar__put32(man + 28 + 12 * i, (uint32_t)sizes[2 * i + 1]);
            }
            p = man + 20 + 12 * (size_t)nranks;
            dpar__put32(p, ntens);
            p += 4;
            for (i = 0; i < nrecs; i++) {
                int first =
                    i == 0 || recs[i].nlen != recs[i - 1].nlen || memcmp(recs[i].name, recs[i - 1].name, recs[i].nlen);
                if (first) {
                    dpar__put32(p, recs[i].nlen);
                    memcpy(p + 4, recs[i].name, recs[i].nlen);
                    p += 4 + recs[i].nlen;
                    for (k = 0; k < 3; k++) dpar__put64(p + 8 * k, recs[i].v[k]);
                    nb = p + 24;
                    dpar__put32(nb, 0);
                    p += 28;
                }
                if (recs[i].dup) continue;
                dpar__put32(nb, dpar__get32(nb) + 1);
                dpar__put32(p, (uint32_t)recs[i].rank);
                for (k = 0; k < 4; k++) dpar__put64(p + 4 + 8 * k, recs[i].v[3 + k]);
                p += 36;
            }
            dpar__put32(man + mn - 4, dpar_crc32(0, man, mn - 4));
            st = dpar__write_atomic(path, man, mn, NULL, 0);
            dpar__free(&a, man);
        }
    }
    st = dpar__ckpt_agree(comm, st, "checkpoint");
    if (st == DPAR_OK && old) { /* the new manifest is in place: the old generation may go */
        snprintf(shard, sizeof shard, "%s.g%llu.r%d", path, (unsigned long long)old, rank);
        remove(shard);
        if (rank == 0) /* ranks the old checkpoint had beyond this job's */
            for (i = nranks; i < (int)old_n; i++) {
                snprintf(shard, sizeof shard, "%s.g%llu.r%d", path, (unsigned long long)old, i);
                remove(shard);
            }
    }
done:
    dpar__free(&a, sizes);
    dpar__free(&a, head);
    dpar__free(&a, table);
    dpar__free(&a, recs);
    dpar__free(&a, mine);
    return st;
}

/* a manifest parsed: the shards' sizes and CRCs, the planned tensors (version 1 has none) */
typedef struct dpar__ckpt_ten {
    const unsigned char *name, *blocks; /* blocks: nb x (rank u32, row0, nrows, col0, ncols u64) */
    uint32_t nlen, nb;
    uint64_t elem, rows, cols;
} dpar__ckpt_ten;

static dpar_status dpar__ckpt_parse(const char *path, const unsigned char *m, size_t n, uint32_t *nsaved, uint64_t *gen,
                                    dpar__ckpt_ten **tens, uint32_t *ntens, const dpar_allocator *a)
{
    size_t at;
    uint32_t i, v2;
    *tens = NULL, *ntens = 0;
    if (n < 24 || (memcmp(m, DPAR__MAN_MAGIC, 8) && memcmp(m, "DPARMAN1", 8)))
        return dpar__err(DPAR_ECORRUPT, "'%s' is not a dpar checkpoint manifest", path);
    v2 = !memcmp(m, DPAR__MAN_MAGIC, 8);
    *nsaved = dpar__get32(m + 8);
    *gen = dpar__get64(m + 12);
    at = 20 + 12 * (size_t)*nsaved;
    if (*nsaved < 1 || *nsaved > 1u << 20 || n < at + 4 + 4 * v2 || dpar_crc32(0, m, n - 4) != dpar__get32(m + n - 4))
        return dpar__err(DPAR_ECORRUPT, "the checkpoint manifest '%s' is damaged (%zu bytes, CRC mismatch or bad size)",
                         path, n);
    if (!v2) return n == at + 4 ? DPAR_OK : dpar__err(DPAR_ECORRUPT, "the checkpoint manifest '%s' is damaged", path);
    *ntens = dpar__get32(m + at);
    at += 4;
    if (*ntens > n / 32) return dpar__err(DPAR_ECORRUPT, "the checkpoint manifest '%s' is damaged", path);
    *tens = (dpar__ckpt_ten *)dpar__calloc(a, (size_t)*ntens + 1, sizeof **tens);
    if (!*tens) return dpar__err(DPAR_ENOMEM, "out of memory");
    for (i = 0; i < *ntens; i++) {
        dpar__ckpt_ten *t = *tens + i;
        uint32_t b;
        if (at + 4 > n - 4 || (t->nlen = dpar__get32(m + at)) > 63 || at + 4 + t->nlen + 28 > n - 4) break;
        t->name = m + at + 4;
        at += 4 + t->nlen;
        t->elem = dpar__get64(m + at), t->rows = dpar__get64(m + at + 8), t->cols = dpar__get64(m + at + 16);
        t->nb = dpar__get32(m + at + 24);
        at += 28;
        t->blocks = m + at;
        if (t->nb > (n - 4 - at) / 36) break;
        for (b = 0; b < t->nb && dpar__get32(t->blocks + 36 * b) < *nsaved; b++) continue;
        if (b < t->nb) break;
        at += 36 * (size_t)t->nb;
    }
    if (i < *ntens || at != n - 4) {
        dpar__free(a, *tens);
        *tens = NULL;
        return dpar__err(DPAR_ECORRUPT, "the checkpoint manifest '%s' is damaged (its tensor table)", path);
    }
    return DPAR_OK;
}

/* find `name` among a shard's items (the header was checked against the file's size): 1 and its data, size
   and CRC in *data, *bytes, *crc; 0 where the shard has no such item; -1 where its item table is malformed (an
   entry or its data past the end of the file, a name over 63 bytes) before the item is found */
static int dpar__ckpt_find(const unsigned char *file, size_t size, const char *name, const unsigned char **data,
                           uint64_t *bytes, uint32_t *crc)
{
    uint32_t count = dpar__get32(file + 20), i;
    const unsigned char *p = file + 32, *d;
    size_t ln = strlen(name);
    for (i = 0, d = p; i < count; i++) { /* the data starts after the header */
        /* the whole entry inside the file (its name too: else the data would start past the end) */
        if (p + 16 > file + size || dpar__get32(p) > 63 || (size_t)(file + size - p) < 16 + (size_t)dpar__get32(p))
            return -1;
        d += 16 + dpar__get32(p);
        p += 16 + dpar__get32(p);
    }
    for (i = 0, p = file + 32; i < count; i++) {
        uint32_t l = dpar__get32(p);
        uint64_t b = dpar__get64(p + 4 + l);
        if (b > (uint64_t)(file + size - d)) return -1;
        if (l == ln && !memcmp(p + 4, name, ln)) {
            *data = d;
            *bytes = b;
            *crc = dpar__get32(p + 12 + l);
            return 1;
        }
        d += b;
        p += 16 + l;
    }
    return 0;
}

/* the rows and columns a saved block shares with an asked one, copied */
static uint64_t dpar__ckpt_copy(const dpar_ckpt_item *t, const unsigned char *blk, const unsigned char *src)
{
    uint64_t r0 = dpar__get64(blk + 4), nr = dpar__get64(blk + 12), c0 = dpar__get64(blk + 20),
             nc = dpar__get64(blk + 28), lo, hi, clo, chi, r;
    lo = r0 > t->row0 ? r0 : t->row0;
    hi = r0 + nr < t->row0 + t->nrows ? r0 + nr : t->row0 + t->nrows;
    clo = c0 > t->col0 ? c0 : t->col0;
    chi = c0 + nc < t->col0 + t->ncols ? c0 + nc : t->col0 + t->ncols;
    if (lo >= hi || clo >= chi) return 0;
    for (r = lo; r < hi; r++)
        memcpy((unsigned char *)t->data + ((r - t->row0) * t->ncols + (clo - t->col0)) * t->elem,
               src + ((r - r0) * nc + (clo - c0)) * t->elem, (size_t)((chi - clo) * t->elem));
    return (hi - lo) * (chi - clo);
}

static int dpar__ckpt_meets(const dpar_ckpt_item *t, const unsigned char *blk)
{
    return dpar__ckpt_meet(dpar__get64(blk + 4), dpar__get64(blk + 12), t->row0, t->nrows) &&
           dpar__ckpt_meet(dpar__get64(blk + 20), dpar__get64(blk + 28), t->col0, t->ncols);
}

DPAR_API dpar_status dpar_ckpt_load(dpar_comm *comm, const char *path, const dpar_ckpt_item *items, int count)
{
    dpar_allocator a;
    int rank = comm ? comm->rank : 0, nranks = comm ? comm->size : 1, i, pass;
    uint64_t gen = 0, *done = NULL;
    uint32_t nsaved = 0, ntens = 0, s, b;
    int64_t info[2];
    unsigned char *man = NULL, *file = NULL;
    size_t mn = 0, size = 0;
    dpar__ckpt_ten *tens = NULL;
    int *which = NULL; /* per item: its tensor, or -1: read by name from this rank's own shard */
    char shard[4096];
    dpar_status st;
    memset(&a, 0, sizeof a);
    if (comm) a = comm->allocator;
    if (!path || !*path) return dpar__err(DPAR_EINVAL, "dpar_ckpt_load: path is NULL or empty");
    st = dpar__ckpt_check_items(items, count, "dpar_ckpt_load");
    if (st != DPAR_OK) return comm ? dpar__bad_call(comm, st) : st;
    /* rank 0 reads the manifest (on machines without a shared disk only it has one) and sends it to all */
    info[0] = DPAR_OK, info[1] = 0;
    if (rank == 0) {
        st = dpar__read_file(path, &man, &mn, &a);
        if (st != DPAR_OK) st = dpar__err(DPAR_EIO, "no checkpoint at '%s': %s", path, dpar_last_error());
        else st = dpar__ckpt_parse(path, man, mn, &nsaved, &gen, &tens, &ntens, &a);
        info[0] = st;
        info[1] = (int64_t)mn;
    }
    if (comm)
        DPAR__TRY(dpar__host_coll(comm, DPAR_COLL_BROADCAST, info, info, 2, DPAR_I64, DPAR_SUM, 0, "dpar_broadcast",
                                  __FILE__, __LINE__));
    if (info[0] != DPAR_OK) {
        dpar__free(&a, man);
        dpar__free(&a, tens);
        if (rank == 0) return dpar__ckpt_agree(comm, (dpar_status)info[0], "checkpoint");
        return dpar__ckpt_agree(
            comm, dpar__err((dpar_status)info[0], "rank 0 cannot read the checkpoint manifest '%s'", path),
            "checkpoint");
    }
    mn = (size_t)info[1];
    if (rank != 0) man = (unsigned char *)dpar__alloc(&a, mn + 1);
    st = man ? DPAR_OK : dpar__err(DPAR_ENOMEM, "out of memory");
    DPAR__TRY(dpar__ckpt_agree(comm, st, "checkpoint"));
    if (comm)
        st = dpar__host_coll(comm, DPAR_COLL_BROADCAST, man, man, mn, DPAR_U8, DPAR_SUM, 0, "dpar_broadcast", __FILE__,
                             __LINE__);
    if (st == DPAR_OK && rank != 0) st = dpar__ckpt_parse(path, man, mn, &nsaved, &gen, &tens, &ntens, &a);
    which = (int *)dpar__calloc(&a, (size_t)count + 1, sizeof(int));
    done = (uint64_t *)dpar__calloc(&a, (size_t)count + 1, sizeof(uint64_t));
    if (st == DPAR_OK && (!which || !done)) st = dpar__err(DPAR_ENOMEM, "out of memory");
    /* every item resolved before a file is read: a layout the checkpoint cannot fill says why */
    for (i = 0; i < count && st == DPAR_OK; i++) {
        const dpar_ckpt_item *t = &items[i];
        size_t ln = strlen(t->name);
        uint32_t k;
        which[i] = -1;
        for (k = 0; k < ntens && !(tens[k].nlen == ln && !memcmp(tens[k].name, t->name, ln)); k++) continue;
        if (k < ntens && t->elem) {
            which[i] = (int)k;
            if (tens[k].elem != t->elem || tens[k].rows != t->rows || tens[k].cols != t->cols)
                st = dpar__err(DPAR_ECORRUPT,
                               "checkpoint '%s': tensor '%s' is %llu x %llu elements of %llu bytes there, the "
                               "program asks for %zu x %zu of %zu (shape mismatch)",
                               path, t->name, (unsigned long long)tens[k].rows, (unsigned long long)tens[k].cols,
                               (unsigned long long)tens[k].elem, t->rows, t->cols, t->elem);
        } else if (k < ntens && t->bytes != tens[k].rows * tens[k].cols * tens[k].elem) {
            st = dpar__err(DPAR_ECORRUPT,
                           "checkpoint '%s': tensor '%s' has %llu bytes, the program asks for %zu without a plan", path,
                           t->name, (unsigned long long)(tens[k].rows * tens[k].cols * tens[k].elem), t->bytes);
        } else if (k < ntens) { /* asked without a plan: the whole tensor */
            which[i] = (int)k;
        } else if (nsaved != (uint32_t)nranks) {
            st = dpar__err(DPAR_ECORRUPT,
                           "checkpoint '%s' has %u shards, this job %d ranks: item '%s' %s, so it loads only into "
                           "the world size it was saved from",
                           path, nsaved, nranks, t->name,
                           t->elem ? "is not a planned tensor there (missing tensor, or saved without a plan)"
                                   : "has no shard plan");
        }
    }
    /* the shards, one at a time: this rank's own, and those holding blocks that meet the asked ones */
    for (s = 0; s < nsaved && st == DPAR_OK; s++) {
        int need = 0;
        for (i = 0; i < count && !need; i++) {
            if (which[i] < 0) {
                need = s == (uint32_t)rank;
                continue;
            }
            for (b = 0; b < tens[which[i]].nb && !need; b++) {
                const unsigned char *blk = tens[which[i]].blocks + 36 * b;
                dpar_ckpt_item whole = items[i];
                if (!items[i].elem) /* asked whole */
                    whole = dpar_ckpt_block(items[i].name, items[i].data, tens[which[i]].elem, tens[which[i]].rows,
                                            tens[which[i]].cols, 0, tens[which[i]].rows, 0, tens[which[i]].cols);
                need = dpar__get32(blk) == s && dpar__ckpt_meets(&whole, blk);
            }
        }
        if (!need) continue;
        snprintf(shard, sizeof shard, "%s.g%llu.r%u", path, (unsigned long long)gen, s);
        st = dpar__read_file(shard, &file, &size, &a);
        if (st != DPAR_OK) {
            st = dpar__err(DPAR_ECORRUPT, "the checkpoint's shard is missing: %s", dpar_last_error());
            break;
        }
        if (size != dpar__get64(man + 20 + 12 * s) || dpar_crc32(0, file, size) != dpar__get32(man + 28 + 12 * s)) {
            st = dpar__err(DPAR_ECORRUPT,
                           "'%s' is damaged: %zu bytes with CRC 0x%08x, the manifest says %llu bytes with CRC 0x%08x",
                           shard, size, dpar_crc32(0, file, size), (unsigned long long)dpar__get64(man + 20 + 12 * s),
                           (unsigned)dpar__get32(man + 28 + 12 * s));
        } else if (size < 32 || memcmp(file, DPAR__CKPT_MAGIC, 8) || dpar__get32(file + 12) != s ||
                   dpar__get32(file + 16) != nsaved || dpar__get64(file + 24) != gen) {
            st = dpar__err(DPAR_ECORRUPT, "'%s' is not rank %u's shard of generation %llu", shard, s,
                           (unsigned long long)gen);
        }
        /* pass 0 checks every needed item of the shard (present, its size, its CRC); pass 1 copies */
        for (pass = 0; pass < 2 && st == DPAR_OK; pass++)
            for (i = 0; i < count && st == DPAR_OK; i++) {
                const dpar_ckpt_item *t = &items[i];
                const unsigned char *data = NULL, *blk = NULL;
                uint64_t bytes = 0, want = t->bytes;
                uint32_t crc = 0;
                int found;
                dpar_ckpt_item whole = *t;
                if (which[i] >= 0) { /* the block this shard holds, if it meets the asked one */
                    const dpar__ckpt_ten *x = &tens[which[i]];
                    if (!t->elem)
                        whole = dpar_ckpt_block(t->name, t->data, x->elem, x->rows, x->cols, 0, x->rows, 0, x->cols);
                    for (b = 0; b < x->nb && !blk; b++)
                        if (dpar__get32(x->blocks + 36 * b) == s && dpar__ckpt_meets(&whole, x->blocks + 36 * b))
                            blk = x->blocks + 36 * b;
                    if (!blk) continue;
                    want = dpar__get64(blk + 12) * dpar__get64(blk + 28) * x->elem;
                } else if (s != (uint32_t)rank) {
                    continue;
                }
                found = dpar__ckpt_find(file, size, t->name, &data, &bytes, &crc);
                if (found < 0)
                    st = dpar__err(DPAR_ECORRUPT,
                                   "'%s' is damaged: its item table is malformed (an entry or its data past the "
                                   "end of the file, or a name over 63 bytes) before item '%s'",
                                   shard, t->name);
                else if (!found)
                    st = dpar__err(DPAR_ECORRUPT, "'%s' has no item '%s' (the program asks for '%s'; missing tensor)",
                                   shard, t->name, t->name);
                else if (bytes != want)
                    st = dpar__err(DPAR_ECORRUPT, "'%s': item '%s' has %llu bytes, the program asks for %llu", shard,
                                   t->name, (unsigned long long)bytes, (unsigned long long)want);
                else if (pass == 0 && dpar_crc32(0, data, (size_t)bytes) != crc)
                    st = dpar__err(DPAR_ECORRUPT, "'%s': item '%s' is damaged (CRC mismatch)", shard, t->name);
                else if (pass == 1 && blk) done[i] += dpar__ckpt_copy(&whole, blk, data);
                else if (pass == 1) {
                    if (bytes) memcpy(t->data, data, (size_t)bytes);
                    done[i] = 1;
                }
            }
        dpar__free(&a, file);
        file = NULL;
    }
    for (i = 0; i < count && st == DPAR_OK; i++) { /* everything asked was found */
        uint64_t want = which[i] < 0    ? 1
                        : items[i].elem ? (uint64_t)items[i].nrows * items[i].ncols
                                        : tens[which[i]].rows * tens[which[i]].cols;
        if (done[i] != want)
            st = dpar__err(DPAR_ECORRUPT, "checkpoint '%s': %s '%s' %s", path, which[i] < 0 ? "item" : "tensor",
                           items[i].name,
                           which[i] < 0 ? "is not in this rank's shard (missing tensor)"
                                        : "is not wholly in it (its blocks miss some of the elements asked)");
    }
    dpar__free(&a, man);
    dpar__free(&a, tens);
    dpar__free(&a, which);
    dpar__free(&a, done);
    return dpar__ckpt_agree(comm, st, "checkpoint");
}

/* ZeRO-1 and FSDP in one call: their planned items, then the caller's */
static dpar_status dpar__ckpt_obj(dpar_comm *comm, int save, const char *path, dpar_ckpt_item *own, int n,
                                  const dpar_ckpt_item *extra, int count, const char *api)
{
    dpar_status st;
    if (count < 0 || (count && !extra)) {
        st = dpar__err(DPAR_EINVAL, "%s: %d extra items", api, count);
        return dpar__bad_call(comm, st);
    }
    if (count) memcpy(own + n, extra, (size_t)count * sizeof *extra);
    return save ? dpar_ckpt_save(comm, path, own, n + count) : dpar_ckpt_load(comm, path, own, n + count);
}

static dpar_status dpar__ckpt_zero(dpar_zero *z, float *params, const char *path, const char *prefix,
                                   const dpar_ckpt_item *extra, int count, int save)
{
    const char *api = save ? "dpar_ckpt_save_zero" : "dpar_ckpt_load_zero";
    char names[4][64];
    dpar_ckpt_item *items;
    int64_t step;
    dpar_allocator a;
    dpar_status st;
    int dev;
    size_t pn;        /* the parameters' floats in the checkpoint's view: my block (save) or all of them (load) */
    float *p, *m, *v; /* what the items point at: the state itself, or (device memory) its host copy */
    float *staged = NULL;
    if (!z) return dpar__err(DPAR_EINVAL, "%s: zero is NULL", api);
    DPAR__TRY(dpar__dev_ckpt_check(z->comm, api));
    dev = dpar__dev(z->comm) != NULL;
    if (!prefix) prefix = "zero.";
    if ((z->count && !params) || strlen(prefix) > 56) {
        st = dpar__err(DPAR_EINVAL, "%s: params is NULL, or the prefix is longer than 56 characters", api);
        return dpar__bad_call(z->comm, st);
    }
    a = z->d.allocator;
    pn = save ? z->len : z->count;
    items = (dpar_ckpt_item *)dpar__calloc(&a, (size_t)(count > 0 ? count : 0) + 4, sizeof *items);
    if (dev) staged = (float *)dpar__alloc(&a, (pn + 2 * z->len) * sizeof(float) + 1);
    if (!items || (dev && !staged)) {
        dpar__free(&a, items);
        dpar__free(&a, staged);
        st = dpar__err(DPAR_ENOMEM, "%s: out of memory", api);
        return dev ? dpar__ckpt_agree(z->comm, st, api) : dpar__bad_call(z->comm, st); /* the host copy's */
    }
    p = dev ? staged : save ? params + z->off : params;
    m = dev ? staged + pn : z->m;
    v = dev ? staged + pn + z->len : z->v;
    st = DPAR_OK;
    if (dev && save) { /* the device's state into its host copy */
        st = dpar__dev_host(z->comm, 1, p, params + z->off, z->len * sizeof(float));
        if (st == DPAR_OK) st = dpar__dev_host(z->comm, 1, m, z->m, z->len * sizeof(float));
        if (st == DPAR_OK && z->v) st = dpar__dev_host(z->comm, 1, v, z->v, z->len * sizeof(float));
    }
    if (dev && save) st = dpar__ckpt_agree(z->comm, st, api); /* staged on every rank, or every rank says why not */
    snprintf(names[0], 64, "%sparams", prefix);
    snprintf(names[1], 64, "%sm", prefix);
    snprintf(names[2], 64, "%sv", prefix);
    snprintf(names[3], 64, "%sstep", prefix);
    step = (int64_t)z->step;
    /* save: each rank writes its block of the parameters (they are the same everywhere); load: the whole vector */
    items[0] = save ? dpar_ckpt_flat(names[0], p, sizeof(float), z->count, z->off, z->len)
                    : dpar_ckpt_flat(names[0], p, sizeof(float), z->count, 0, z->count);
    items[1] = dpar_ckpt_flat(names[1], m, sizeof(float), z->count, z->off, z->len);
    items[2] = dpar_ckpt_replica(names[3], &step, sizeof step);
    if (z->v) items[3] = dpar_ckpt_flat(names[2], v, sizeof(float), z->count, z->off, z->len);
    if (st == DPAR_OK) st = dpar__ckpt_obj(z->comm, save, path, items, z->v ? 4 : 3, extra, count, api);
    if (st == DPAR_OK && dev && !save) { /* loaded whole: the host copy into the device's state */
        st = dpar__dev_host(z->comm, 0, p, params, z->count * sizeof(float));
        if (st == DPAR_OK) st = dpar__dev_host(z->comm, 0, m, z->m, z->len * sizeof(float));
        if (st == DPAR_OK && z->v) st = dpar__dev_host(z->comm, 0, v, z->v, z->len * sizeof(float));
        st = dpar__ckpt_agree(z->comm, st, api);
    }
    if (st == DPAR_OK && !save) z->step = (long)step;
    dpar__free(&a, items);
    dpar__free(&a, staged);
    return st;
}
DPAR_API dpar_status dpar_ckpt_check(const char *path, int flags)
{
    struct stat sb;
    char dir[4096], head[8];
    const char *slash;
    size_t len;
    FILE *f;
    int is_ckpt = 0;
    if (!path || !*path) return dpar__err(DPAR_EINVAL, "dpar_ckpt_check: path is %s", path ? "empty" : "NULL");
    if (flags != 0 && flags != DPAR_CKPT_RESUME && flags != DPAR_CKPT_OVERWRITE)
        return dpar__err(DPAR_EINVAL, "dpar_ckpt_check: flags = %d (0, DPAR_CKPT_RESUME or DPAR_CKPT_OVERWRITE)",
                         flags);
    len = strlen(path);
    if (path[len - 1] == '/' || (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)))
        return dpar__err(DPAR_EINVAL, "checkpoint '%s' is a directory: name a file in it (such as '%s%sckpt')", path,
                         path, path[len - 1] == '/' ? "" : "/");
    slash = strrchr(path, '/');
    if (slash && (size_t)(slash - path) >= sizeof dir)
        return dpar__err(DPAR_EINVAL, "dpar_ckpt_check: the path '%.200s...' is too long", path);
    snprintf(dir, sizeof dir, "%.*s", slash ? (slash == path ? 1 : (int)(slash - path)) : 1, slash ? path : ".");
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return dpar__err(DPAR_EIO, "checkpoint '%s': its directory '%s' does not exist", path, dir);
    { /* a file made and removed: access(W_OK) says yes to root where a write fails (a read-only mount, /proc) */
        char probe[4200];
        int fd;
        snprintf(probe, sizeof probe, "%s.probe.%ld", path, (long)getpid()); /* not .tmp: kill.sh counts those */
        fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0600);
        if (fd < 0)
            return dpar__err(DPAR_EIO, "checkpoint '%s': cannot write in its directory '%s': %s", path, dir,
                             strerror(errno));
        close(fd);
        unlink(probe);
    }
    if (stat(path, &sb) != 0) {
        if (flags == DPAR_CKPT_RESUME) return dpar__err(DPAR_EIO, "no checkpoint at '%s' to resume from", path);
        return DPAR_OK;
    }
    if ((f = fopen(path, "rb")) != NULL) {
        is_ckpt =
            fread(head, 1, 8, f) == 8 && (memcmp(head, DPAR__MAN_MAGIC, 8) == 0 || memcmp(head, "DPARMAN1", 8) == 0);
        fclose(f);
    }
    if (flags == DPAR_CKPT_RESUME && !is_ckpt)
        return dpar__err(DPAR_EIO, "'%s' is not a dpar checkpoint: nothing to resume from", path);
    if (flags == 0)
        return dpar__err(DPAR_EEXIST,
                         is_ckpt ? "a checkpoint exists at '%s': a fresh run would replace it"
                                 : "'%s' exists and is not a dpar checkpoint: a run would replace it",
                         path);
    return DPAR_OK;
}

DPAR_API dpar_status dpar_ckpt_save_zero(dpar_zero *zero, float *params, const char *path, const char *prefix,
                                         const dpar_ckpt_item *extra, int count)
{
    return dpar__ckpt_zero(zero, params, path, prefix, extra, count, 1);
}
DPAR_API dpar_status dpar_ckpt_load_zero(dpar_zero *zero, float *params, const char *path, const char *prefix,
                                         const dpar_ckpt_item *extra, int count)
{
    return dpar__ckpt_zero(zero, params, path, prefix, extra, count, 0);
}

static dpar_status dpar__ckpt_fsdp(dpar_fsdp *f, const char *path, const char *prefix, const dpar_ckpt_item *extra,
                                   int count, int save)
{
    const char *api = save ? "dpar_ckpt_save_fsdp" : "dpar_ckpt_load_fsdp";
    dpar_ckpt_item *items;
    char *names;
    int64_t state[4]; /* step, steps since the scale last changed, steps skipped, the loss scale's bits */
    uint32_t bits;
    int u, n = 0, k, dev, read;
    float *staged = NULL; /* device memory: the shards' host copy (master, m, v, each slen floats) */
    dpar_allocator a;
    dpar_status st = DPAR_OK;
    if (!f) return dpar__err(DPAR_EINVAL, "%s: fsdp is NULL", api);
    DPAR__TRY(dpar__dev_ckpt_check(f->comm, api));
    dev = f->dev;
    if (!prefix) prefix = "fsdp.";
    if (strlen(prefix) > 40 || f->gunit >= 0 || (f->held[0] >= 0 && f->taken[0]) || (f->held[1] >= 0 && f->taken[1])) {
        st = dpar__err(DPAR_EINVAL,
                       "%s: the prefix is longer than 40 characters, or a unit is still gathered or its gradients "
                       "not reduced",
                       api);
        return dpar__bad_call(f->comm, st);
    }
    DPAR__TRY(dpar__fsdp_settle(f)); /* a prefetch of the parameters about to change */
    if (!save) f->held[0] = f->held[1] = f->last = -1;
    a = f->d.allocator;
    items = (dpar_ckpt_item *)dpar__calloc(&a, 3 * (size_t)f->U + 1 + (size_t)(count > 0 ? count : 0), sizeof *items);
    names = (char *)dpar__calloc(&a, 3 * (size_t)f->U + 1, 64);
    if (dev) staged = (float *)dpar__alloc(&a, 3 * f->slen * sizeof(float) + 1);
    if (!items || !names || (dev && !staged)) {
        dpar__free(&a, items);
        dpar__free(&a, names);
        dpar__free(&a, staged);
        st = dpar__err(DPAR_ENOMEM, "%s: out of memory", api);
        return dev ? dpar__ckpt_agree(f->comm, st, api) : dpar__bad_call(f->comm, st); /* the host copy's */
    }
    for (u = 0; dev && save && u < f->U && st == DPAR_OK; u++) /* the device's shards into their host copy */
        for (k = 0; k < (f->v ? 3 : 2) && st == DPAR_OK; k++)
            st = dpar__dev_host(f->comm, 1, staged + k * f->slen + f->soff[u], dpar__fsdp_piece(f, u, k),
                                f->len[u] * sizeof(float));
    if (dev && save) st = dpar__ckpt_agree(f->comm, st, api); /* staged on every rank, or every rank says why not */
    memcpy(&bits, &f->scale, sizeof bits);
    state[0] = (int64_t)f->step, state[1] = (int64_t)f->good, state[2] = (int64_t)f->skipped, state[3] = bits;
    snprintf(names, 64, "%sstate", prefix);
    items[n++] = dpar_ckpt_replica(names, state, sizeof state);
    for (u = 0; u < f->U; u++) {
        char *nm = names + 64 * (size_t)n;
        static const char *const what[3] = {"param", "m", "v"};
        for (k = 0; k < (f->v ? 3 : 2); k++, nm += 64) {
            float *at = dev ? staged + k * f->slen + f->soff[u] : dpar__fsdp_piece(f, u, k);
            snprintf(nm, 64, "%su%d.%s", prefix, u, what[k]);
            items[n++] = dpar_ckpt_flat(nm, at, sizeof(float), f->count[u], f->off[u], f->len[u]);
        }
    }
    if (st == DPAR_OK) st = dpar__ckpt_obj(f->comm, save, path, items, n, extra, count, api);
    read = st == DPAR_OK; /* the same on every rank (a failed load fails everywhere) */
    for (u = 0; dev && !save && u < f->U && st == DPAR_OK; u++) /* loaded: the host copy into the device's shards */
        for (k = 0; k < (f->v ? 3 : 2) && st == DPAR_OK; k++)
            st = dpar__dev_host(f->comm, 0, staged + k * f->slen + f->soff[u], dpar__fsdp_piece(f, u, k),
                                f->len[u] * sizeof(float));
    if (dev && !save && read) /* restored on every rank before stage 2's publish, or every rank says why not */
        st = dpar__ckpt_agree(f->comm, st, api);
    if (st == DPAR_OK && !save) {
        f->step = (long)state[0], f->good = (long)state[1], f->skipped = (long)state[2];
        bits = (uint32_t)state[3];
        memcpy(&f->scale, &bits, sizeof bits);
        f->bad = 0;
        for (u = 0; u < f->U; u++) f->fresh[u] = 1;
        if (f->stage == 2) st = dpar__fsdp_publish(f); /* every rank's full copy from the blocks, as a step ends */
    }
    dpar__free(&a, items);
    dpar__free(&a, names);
    dpar__free(&a, staged);
    return st;
}
DPAR_API dpar_status dpar_ckpt_save_fsdp(dpar_fsdp *fsdp, const char *path, const char *prefix,
                                         const dpar_ckpt_item *extra, int count)
{
    return dpar__ckpt_fsdp(fsdp, path, prefix, extra, count, 1);
}
DPAR_API dpar_status dpar_ckpt_load_fsdp(dpar_fsdp *fsdp, const char *path, const char *prefix,
                                         const dpar_ckpt_item *extra, int count)
{
    return dpar__ckpt_fsdp(fsdp, path, prefix, extra, count, 0);
}

/* >>mpi: the MPI transport (DPAR_MPI) ----------------------------------------------------------- */
/* The MPI transport: the same four primitives over MPI point-to-point on a private duplicate of
   the user's communicator. post = MPI_Isend (at most DPAR__QDEPTH in flight per peer and lane);
   fetch = MPI_Irecv into a staging buffer of one segment; recv_into = MPI_Irecv straight into the
   destination; release = nothing; drain = wait for the oldest sends. The first message of a call
   to each peer carries its fingerprint on a header tag, so the contract checker works across
   processes: the fingerprint and the first DPAR__M_PACK bytes of the data travel as one message
   (a small collective costs one message per peer, not two), the rest of the data follows on the
   data tag. Every wait is a loop of MPI_Test that also watches the comm's deadline, its abort
   flag and poison messages from other ranks (tag 0), spinning for spin_us and then yielding and
   napping, so oversubscribed ranks leave the CPU to each other. With `native`, the collectives MPI
   has for the dtype run as MPI's non-blocking collectives (MPI_Iallreduce, ...) inside that loop. */
#ifdef DPAR_MPI

#define DPAR__TAG_POISON 0 /* "the group is poisoned: status + message" */
#define DPAR__TAG_ASK 1    /* "where are you?" (from a rank that timed out) */
#define DPAR__TAG_ANSWER 2 /* "rank r is in call c #seq at file:line" */
#define DPAR__TAG_DATA 3   /* the first tag of the data and header messages */

typedef struct dpar__wire { /* a fingerprint on the wire: only file's first flen bytes travel */
    uint64_t seq, count;
    int32_t coll, dtype, op, root, tag, rank, line, flen;
    char file[128];
} dpar__wire;
#define DPAR__M_WIRE_HEAD offsetof(dpar__wire, file)
#define DPAR__M_PACK 2048 /* data bytes sent with the fingerprint (header + data stay below eager limits) */
#define DPAR__M_PACK_BYTES (sizeof(dpar__wire) + DPAR__M_PACK)
enum { DPAR__M_LENT_STAGING = 1, DPAR__M_LENT_STAGING2 = 2, DPAR__M_LENT_PACK = 4 };

typedef struct dpar__mpi {
    MPI_Comm comm; /* ours: a duplicate (flat) or shared by a process's threads (hybrid) */
    int own_comm;  /* free it on destroy */
    int level;     /* the thread level MPI gave */
    int native, oversub;
    int T, t;                 /* hybrid: threads per process, and mine (flat: 1, 0) */
    char *staging, *staging2; /* the segment being reduced, and the next one arriving */
    char *pack;               /* [DPAR__LANES][2][DPAR__M_PACK_BYTES]: fingerprint + first data, out and in */
    void *shm;                /* the block the processes of the node share (one-shot allreduce), or NULL */
    size_t shm_bytes;
    uint64_t bell_since; /* waits on the shared block: when this call's first wait began (0: none yet) */
    unsigned bell_looks; /* this call's looks so far */
    int bell_stage;      /* 0: spinning, 1: yielding, 2: napping */
    size_t staging_bytes;
    MPI_Request pf_req; /* the receive of the next segment (collective lane), or none */
    int pf_peer;        /* its peer, -1: none */
    int lent; /* DPAR__M_LENT_*: own buffers a receive given up on may still write (dpar__m_give_up): never freed */
    MPI_Request *sends;            /* [DPAR__LANES][size][DPAR__QDEPTH] */
    uint32_t *send_first, *send_n; /* [DPAR__LANES][size] */
    uint64_t *hdr_sent, *hdr_recv; /* [size]: the collective whose header went to / came from a peer */
    int poison;                    /* atomic */
    int abort;                     /* atomic: dpar_comm_abort asked, the rank thread spreads it */
    char poison_msg[DPAR__ERROR_TEXT];
    pthread_mutex_t lock;
    dpar_comm *local;            /* hybrid: this thread's comm in its process's group */
    dpar_comm *leaders;          /* hybrid, thread 0: the comm of the process leaders */
    dpar_comm *parent;           /* the comm of the process leaders: thread 0's hybrid comm, watched by its waits */
    struct dpar__hybrid *shared; /* hybrid: the process's MPI comm, shared by its threads */
    dpar__wire where;            /* the call this rank is in (under lock), for the answers to ASK */
    const char *where_from;      /* the file name where.file was copied from */
} dpar__mpi;

typedef struct dpar__hybrid {
    MPI_Comm comm;
    int refs;    /* threads of the process still using it; the last frees it */
    int retired; /* atomic: a thread's comm was poisoned: the last keeps comm (dpar__m_free) */
    dpar_allocator allocator;
} dpar__hybrid;

/* Free the MPI communicator of a comm being destroyed, unless the comm was poisoned. A poisoned comm
   gave up on calls whose messages may still be in flight (poison news, a freed send, a fragment no
   receive took), and MPI hands a freed communicator's context id to the next one it makes: a late
   message would then be taken as that comm's (poison news, say, failing a fresh comm's first
   allreduce; 4 processes re-making a comm after a refused call 300 times saw it 50 times). So a
   poisoned comm's MPI communicator is kept, unused, until MPI_Finalize: late messages land there. */
static void dpar__m_free(MPI_Comm *mc, int poisoned)
{
    if (!poisoned) MPI_Comm_free(mc);
}

#define DPAR__M(c) ((dpar__mpi *)(c)->tp_data)

static dpar_status dpar__m_error(dpar_comm *c, int rc, const char *what, int peer)
{
    char text[MPI_MAX_ERROR_STRING];
    int n = 0, cls = MPI_ERR_OTHER;
    dpar_status st = DPAR_ESYSTEM;
    MPI_Error_string(rc, text, &n);
    MPI_Error_class(rc, &cls);
    if (cls == MPI_ERR_TRUNCATE) st = DPAR_EMISMATCH;
    else if (cls == MPI_ERR_NO_MEM) st = DPAR_ENOMEM;
    else if (cls == MPI_ERR_COUNT || cls == MPI_ERR_TYPE || cls == MPI_ERR_TAG || cls == MPI_ERR_RANK ||
             cls == MPI_ERR_COMM || cls == MPI_ERR_BUFFER || cls == MPI_ERR_ARG)
        st = DPAR_EINVAL;
    return dpar__err(st, "%s rank %d: %s with rank %d failed: MPI error %d: %s", c->name, c->rank, what, peer, rc,
                     text);
}

static int dpar__m_tag(const dpar__mpi *m, int lane, int hdr, int peer)
{
    /* flat: 2 lane + hdr; hybrid: the sending and receiving threads are in the tag too */
    int base = DPAR__TAG_DATA + 2 * lane + hdr;
    return m->T == 1 ? base : DPAR__TAG_DATA + (((2 * lane + hdr) * m->T + m->t) * m->T + peer % m->T);
}
static int dpar__m_tag_from(const dpar__mpi *m, int lane, int hdr, int peer)
{
    int base = DPAR__TAG_DATA + 2 * lane + hdr;
    return m->T == 1 ? base : DPAR__TAG_DATA + (((2 * lane + hdr) * m->T + peer % m->T) * m->T + m->t);
}

/* a peer's rank in the MPI comm: its process */
static int dpar__m_proc(const dpar__mpi *m, int peer) { return peer / m->T; }

static dpar_status dpar__m_poisoned(dpar_comm *c);
static dpar_status dpar__m_poison(dpar_comm *c, dpar_status why, const char *msg);

/* Answer a "where are you?" with the call this rank is in. */
static void dpar__m_answer(dpar__mpi *m)
{
    int flag = 0;
    MPI_Status s;
    MPI_Message msg;
    if (MPI_Improbe(MPI_ANY_SOURCE, DPAR__TAG_ASK, m->comm, &flag, &msg, &s) == MPI_SUCCESS && flag) {
        char none;
        dpar__wire w;
        MPI_Request r;
        MPI_Mrecv(&none, 0, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
        pthread_mutex_lock(&m->lock);
        w = m->where;
        pthread_mutex_unlock(&m->lock);
        if (MPI_Isend(&w, (int)sizeof w, MPI_BYTE, s.MPI_SOURCE, DPAR__TAG_ANSWER, m->comm, &r) == MPI_SUCCESS) {
            int done = 0, i;
            for (i = 0; i < 100000 && !done; i++) MPI_Test(&r, &done, MPI_STATUS_IGNORE);
            if (!done) MPI_Request_free(&r);
        }
    }
}

/* Poison news: a message on tag 0 from any rank, or our own abort flag. */
static dpar_status dpar__m_watch(dpar_comm *c)
{
    dpar__mpi *m = DPAR__M(c);
    int flag = 0;
    MPI_Status s;
    MPI_Message msg;
    if (DPAR__LOAD(&m->poison, DPAR__ACQUIRE)) return dpar__m_poisoned(c);
    if (DPAR__LOAD(&m->abort, DPAR__ACQUIRE)) {
        char text[200];
        snprintf(text, sizeof text, "%s was aborted by dpar_comm_abort (called on rank %d)", c->name, c->rank);
        return dpar__m_poison(c, DPAR_EABORTED, text);
    }
    /* a matched probe: of several threads of a hybrid process, exactly one takes the message */
    if (MPI_Improbe(MPI_ANY_SOURCE, DPAR__TAG_POISON, m->comm, &flag, &msg, &s) == MPI_SUCCESS && flag) {
        struct {
            int32_t status;
            char msg[DPAR__ERROR_TEXT];
        } news;
        MPI_Mrecv(&news, (int)sizeof news, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
        news.msg[sizeof news.msg - 1] = 0;
        pthread_mutex_lock(&m->lock);
        if (!DPAR__LOAD(&m->poison, DPAR__RELAXED)) {
            snprintf(m->poison_msg, sizeof m->poison_msg, "%s", news.msg);
            DPAR__STORE(&m->poison, news.status, DPAR__RELEASE);
        }
        pthread_mutex_unlock(&m->lock);
        if (m->local) dpar__tp_poison(m->local, (dpar_status)news.status, news.msg); /* hybrid: wake the threads */
        return dpar__m_poisoned(c);
    }
    dpar__m_answer(m);
    if (m->local) return dpar__tp_poisoned(m->local); /* hybrid: a thread of ours saw it */
    if (m->parent) { /* the leaders' comm: news and questions that came to the hybrid comm it serves */
        dpar_status st = dpar__m_watch(m->parent);
        if (st != DPAR_OK) return dpar__m_poison(c, st, dpar_last_error());
    }
    return DPAR_OK;
}

/* A timeout: ask every process where it is; ranks inside dpar answer from their waits. Those
   behind this call, and those that do not answer at all (outside dpar), are the story. */
static void dpar__m_survey(dpar__ctx *x, char *msg, size_t n, int k)
{
    dpar_comm *c = x->c;
    dpar__mpi *m = DPAR__M(c);
    int procs = c->size / m->T, me = c->rank / m->T, p, answered = 0, flag;
    char *seen = (char *)dpar__calloc(&c->allocator, (size_t)procs, 1);
    uint64_t until;
    for (p = 0; p < procs; p++) {
        MPI_Request r;
        char none = 0;
        if (p == me) continue;
        if (MPI_Isend(&none, 0, MPI_BYTE, p, DPAR__TAG_ASK, m->comm, &r) == MPI_SUCCESS) MPI_Request_free(&r);
    }
    until = dpar_time_ns() + 300000000u; /* answers come from waits that look every few microseconds */
    while (dpar_time_ns() < until && answered < procs - 1) {
        MPI_Status s;
        MPI_Message mm;
        flag = 0;
        if (MPI_Improbe(MPI_ANY_SOURCE, DPAR__TAG_ANSWER, m->comm, &flag, &mm, &s) == MPI_SUCCESS && flag) {
            dpar__wire w;
            MPI_Mrecv(&w, (int)sizeof w, MPI_BYTE, &mm, MPI_STATUS_IGNORE);
            w.file[sizeof w.file - 1] = 0;
            if (seen && !seen[s.MPI_SOURCE]) answered++;
            if (seen) seen[s.MPI_SOURCE] = 1;
            if (w.seq < x->fp.seq && k > 0 && (size_t)k < n)
                k += snprintf(msg + k, n - (size_t)k, "; rank %d never arrived (it is in %s #%llu at %s:%d)", w.rank,
                              dpar_coll_name((dpar_coll)w.coll), (unsigned long long)w.seq, w.file, w.line);
        } else {
            struct timespec ts = {0, 100000};
            dpar__m_answer(m); /* the others may be asking too: they timed out at the same moment */
            nanosleep(&ts, NULL);
        }
    }
    for (p = 0; p < procs && seen; p++)
        if (p != me && !seen[p] && k > 0 && (size_t)k < n) {
            if (m->T == 1)
                k += snprintf(msg + k, n - (size_t)k,
                              "; rank %d never arrived (it does not answer: it is outside dpar, "
                              "busy, stuck or gone)",
                              p);
            else
                k += snprintf(msg + k, n - (size_t)k,
                              "; process %d (ranks %d..%d) does not answer: it is outside dpar, "
                              "busy, stuck or gone",
                              p, p * m->T, p * m->T + m->T - 1);
        }
    dpar__free(&c->allocator, seen);
}

/* The wait of every MPI operation: test, watch, time out, back off. */
/* a wait for peer (-1: MPI's own collective) gave up at the deadline: the survey's story, on every rank */
static dpar_status dpar__m_timeout(dpar__ctx *x, int peer, const char *what)
{
    dpar_comm *c = x->c;
    char me[200], msg[DPAR__ERROR_TEXT];
    int k;
    dpar__fp_describe(&x->fp, me, sizeof me);
    dpar__on_comm(c, me, sizeof me);
    if (peer >= 0)
        k = snprintf(msg, sizeof msg, "rank %d timed out after %llu ms in %s, waiting for rank %d to %s", c->rank,
                     (unsigned long long)(c->timeout_ns / 1000000u), me, peer, what);
    else
        k = snprintf(msg, sizeof msg, "rank %d timed out after %llu ms in %s (MPI's own collective)", c->rank,
                     (unsigned long long)(c->timeout_ns / 1000000u), me);
    dpar__m_survey(x, msg, sizeof msg, k);
    return dpar__m_poison(c, DPAR_ETIMEDOUT, msg);
}

static dpar_status dpar__m_wait(dpar__ctx *x, MPI_Request *req, MPI_Status *status, int peer, const char *what)
{
    dpar_comm *c = x->c;
    dpar__mpi *m = DPAR__M(c);
    uint64_t t0 = 0, now; /* the clock is read only once a wait takes a while: most end at once */
    unsigned i;
    for (i = 0;; i++) {
        int flag = 0, rc = MPI_Test(req, &flag, status);
        dpar_status st;
        if (rc != MPI_SUCCESS) return dpar__m_poison(c, dpar__m_error(c, rc, what, peer), dpar_last_error());
        if (flag) return DPAR_OK;
        if ((i & 15) != 15) {
            if (!m->oversub) dpar__cpu_relax();
            else sched_yield();
            continue;
        }
        if ((st = dpar__m_watch(c)) != DPAR_OK) return st;
        now = dpar_time_ns();
        if (!t0) t0 = now;
        if (x->deadline && now >= x->deadline) return dpar__m_timeout(x, peer, what);
        if (now - t0 > c->spin.spin_ns) { /* past the spin: let others run, and nap when it takes long */
            if (now - t0 > 2000000u) {
                struct timespec ts = {0, 50000};
                nanosleep(&ts, NULL);
            } else {
                sched_yield();
            }
        }
    }
}

/* A receive of buf that a failed call leaves behind (a poison or a timeout ended its wait): cancelled and waited
   for, up to 1 s. MPI may have matched it to a message already; the cancel then fails and MPI writes buf until the
   message is in (a large one comes in pieces, and a segment of the poisoned call's ring can arrive after the
   news). Left posted, it took a message that came later: a write after free once destroy had freed the buffer
   (ASan: 1 run of test_mpi in 24, 3 processes, a failed bucket). Past the second the request is freed, and one of
   the comm's own buffers is marked lent: never freed or reused (a user's buffer may still be written: docs/mpi.md). */
static void dpar__m_give_up(dpar__mpi *m, MPI_Request *r, const void *buf)
{
    uint64_t until = dpar_time_ns() + 1000000000u;
    uintptr_t b = (uintptr_t)buf, s1 = (uintptr_t)m->staging, s2 = (uintptr_t)m->staging2, pk = (uintptr_t)m->pack;
    int flag = 0;
    MPI_Cancel(r);
    for (;;) {
        MPI_Test(r, &flag, MPI_STATUS_IGNORE);
        if (flag) return;
        if (dpar_time_ns() >= until) break;
        sched_yield();
    }
    MPI_Request_free(r);
    if (b - s1 < m->staging_bytes) m->lent |= DPAR__M_LENT_STAGING; /* (unsigned: below the start is far above) */
    else if (b - s2 < m->staging_bytes) m->lent |= DPAR__M_LENT_STAGING2;
    else if (b - pk < 2 * DPAR__LANES * DPAR__M_PACK_BYTES) m->lent |= DPAR__M_LENT_PACK;
}
/* a receive's wait: a failure gives the receive up (dpar__m_give_up) */
static dpar_status dpar__m_wait_recv(dpar__ctx *x, MPI_Request *r, MPI_Status *s, int peer, const void *buf)
{
    dpar_status st = dpar__m_wait(x, r, s, peer, x->lane == DPAR__LANE_P2P ? "send" : "arrive");
    if (st != DPAR_OK) dpar__m_give_up(DPAR__M(x->c), r, buf);
    return st;
}

/* the oldest send to peer on the lane completes */
static dpar_status dpar__m_retire(dpar__ctx *x, int peer)
{
    dpar__mpi *m = DPAR__M(x->c);
    size_t k = (size_t)x->lane * (size_t)x->c->size + (size_t)peer;
    MPI_Request *r = &m->sends[k * DPAR__QDEPTH + m->send_first[k] % DPAR__QDEPTH];
    DPAR__TRY(dpar__m_wait(x, r, MPI_STATUS_IGNORE, peer, "take an earlier message"));
    m->send_first[k]++;
    m->send_n[k]--;
    return DPAR_OK;
}

static dpar_status dpar__m_isend(dpar__ctx *x, int peer, const void *buf, size_t bytes, int hdr)
{
    dpar__mpi *m = DPAR__M(x->c);
    size_t k = (size_t)x->lane * (size_t)x->c->size + (size_t)peer;
    int rc;
    if (bytes > (size_t)INT_MAX)
        return dpar__err(DPAR_ERANGE, "%s: a message of %zu bytes is larger than MPI's int count", x->c->name, bytes);
    while (m->send_n[k] >= DPAR__QDEPTH) DPAR__TRY(dpar__m_retire(x, peer));
    rc = MPI_Isend((void *)(uintptr_t)buf, (int)bytes, MPI_BYTE, dpar__m_proc(m, peer),
                   dpar__m_tag(m, x->lane, hdr, peer), m->comm,
                   &m->sends[k * DPAR__QDEPTH + (m->send_first[k] + m->send_n[k]) % DPAR__QDEPTH]);
    if (rc != MPI_SUCCESS) return dpar__m_poison(x->c, dpar__m_error(x->c, rc, "MPI_Isend", peer), dpar_last_error());
    m->send_n[k]++;
    return DPAR_OK;
}

/* The fingerprint goes first: every message on the point-to-point lane, the first message of a
   collective to each peer. Is one due to (out) or from (in) this peer? */
static int dpar__m_header_due(dpar__ctx *x, int peer, int out)
{
    dpar__mpi *m = DPAR__M(x->c);
    uint64_t *last = out ? m->hdr_sent : m->hdr_recv;
    if (x->lane != DPAR__LANE_COLL) return 1;
    if (!x->c->check || last[peer] == x->fp.seq) return 0;
    last[peer] = x->fp.seq;
    return 1;
}

static char *dpar__m_pack_buf(dpar__ctx *x, int in)
{
    return DPAR__M(x->c)->pack + ((size_t)x->lane * 2 + (size_t)in) * DPAR__M_PACK_BYTES;
}

/* a message of `bytes` to peer: [fingerprint | the first DPAR__M_PACK bytes] on the header tag when a
   fingerprint is due (sent at once: it is small, MPI sends it eagerly), the rest on the data tag */
static dpar_status dpar__m_post(dpar__ctx *x, int peer, const void *buf, size_t bytes)
{
    dpar__mpi *m = DPAR__M(x->c);
    dpar__wire *w;
    size_t head, first, flen = 0;
    MPI_Request r;
    int rc;
    if (!dpar__m_header_due(x, peer, 1)) return dpar__m_isend(x, peer, buf, bytes, 0);
    w = (dpar__wire *)(void *)dpar__m_pack_buf(x, 0);
    w->seq = x->fp.seq;
    w->count = x->fp.count;
    w->coll = x->fp.coll;
    w->dtype = x->fp.dtype;
    w->op = x->fp.op;
    w->root = x->fp.root;
    w->tag = x->fp.tag;
    w->rank = x->fp.rank;
    w->line = x->fp.line;
    if (x->fp.file) {
        flen = strlen(x->fp.file);
        if (flen > sizeof w->file - 1) flen = sizeof w->file - 1;
        memcpy(w->file, x->fp.file, flen);
    }
    w->file[flen++] = 0;
    w->flen = (int32_t)flen;
    head = DPAR__M_WIRE_HEAD + flen;
    first = bytes < DPAR__M_PACK ? bytes : DPAR__M_PACK;
    if (first) memcpy((char *)w + head, buf, first); /* buf may be NULL for 0 bytes */
    rc = MPI_Isend(w, (int)(head + first), MPI_BYTE, dpar__m_proc(m, peer), dpar__m_tag(m, x->lane, 1, peer), m->comm,
                   &r);
    if (rc != MPI_SUCCESS) return dpar__m_poison(x->c, dpar__m_error(x->c, rc, "MPI_Isend", peer), dpar_last_error());
    DPAR__TRY(dpar__m_wait(x, &r, MPI_STATUS_IGNORE, peer, "take a header"));
    return bytes > first ? dpar__m_isend(x, peer, (const char *)buf + first, bytes - first, 0) : DPAR_OK;
}

/* a received message must be exactly as long as the receiver expects */
static dpar_status dpar__m_check_count(dpar__ctx *x, MPI_Status *s, int peer, size_t bytes)
{
    int got = 0;
    char msg[DPAR__ERROR_TEXT];
    MPI_Get_count(s, MPI_BYTE, &got);
    if ((size_t)got == bytes) return DPAR_OK;
    snprintf(msg, sizeof msg, "rank %d sent %d bytes where rank %d expected %zu", peer, got, x->c->rank, bytes);
    return dpar__m_poison(x->c, DPAR_EMISMATCH, msg);
}

/* the fingerprint and the first data of a message from peer (dpar__m_post's first message): checked
   against my call, the data copied to dst; *first: how many bytes of the data it held */
static dpar_status dpar__m_header_in(dpar__ctx *x, int peer, void *dst, size_t bytes, size_t *first)
{
    dpar__mpi *m = DPAR__M(x->c);
    dpar__wire *w = (dpar__wire *)(void *)dpar__m_pack_buf(x, 1);
    dpar__fp theirs;
    MPI_Request r;
    MPI_Status s;
    char msg[DPAR__ERROR_TEXT];
    int rc, got = 0;
    size_t head;
    rc = MPI_Irecv(w, (int)DPAR__M_PACK_BYTES, MPI_BYTE, dpar__m_proc(m, peer), dpar__m_tag_from(m, x->lane, 1, peer),
                   m->comm, &r);
    if (rc != MPI_SUCCESS) return dpar__m_poison(x->c, dpar__m_error(x->c, rc, "MPI_Irecv", peer), dpar_last_error());
    DPAR__TRY(dpar__m_wait_recv(x, &r, &s, peer, w));
    MPI_Get_count(&s, MPI_BYTE, &got);
    if (got < (int)DPAR__M_WIRE_HEAD + 1 || w->flen < 1 || w->flen > (int32_t)sizeof w->file ||
        (size_t)got < DPAR__M_WIRE_HEAD + (size_t)w->flen) {
        snprintf(msg, sizeof msg, "rank %d sent a malformed header of %d bytes to rank %d", peer, got, x->c->rank);
        return dpar__m_poison(x->c, DPAR_EMISMATCH, msg);
    }
    head = DPAR__M_WIRE_HEAD + (size_t)w->flen;
    w->file[w->flen - 1] = 0;
    memset(&theirs, 0, sizeof theirs);
    theirs.seq = w->seq;
    theirs.count = w->count;
    theirs.coll = w->coll;
    theirs.dtype = w->dtype;
    theirs.op = w->op;
    theirs.root = w->root;
    theirs.tag = w->tag;
    theirs.rank = w->rank;
    theirs.line = w->line;
    theirs.file = w->file;
    /* the byte count of the data is checked below and by MPI (truncation) for the rest */
    if (!dpar__fp_agree(x, &theirs, bytes, bytes, msg, sizeof msg)) return dpar__m_poison(x->c, DPAR_EMISMATCH, msg);
    *first = bytes < DPAR__M_PACK ? bytes : DPAR__M_PACK;
    if ((size_t)got - head != *first) {
        snprintf(msg, sizeof msg, "rank %d sent %zu%s bytes where rank %d expected %zu", peer, (size_t)got - head,
                 (size_t)got - head == DPAR__M_PACK ? " or more" : "", x->c->rank, bytes);
        return dpar__m_poison(x->c, DPAR_EMISMATCH, msg);
    }
    if (*first) memcpy(dst, (char *)w + head, *first);
    return DPAR_OK;
}

static dpar_status dpar__m_recv_into(dpar__ctx *x, int peer, void *dst, size_t bytes)
{
    dpar__mpi *m = DPAR__M(x->c);
    MPI_Request r;
    MPI_Status s;
    size_t first = 0;
    int rc;
    if (dpar__m_header_due(x, peer, 0)) {
        DPAR__TRY(dpar__m_header_in(x, peer, dst, bytes, &first));
        if (first == bytes) return DPAR_OK;
        dst = (char *)dst + first;
        bytes -= first;
    }
    if (bytes > (size_t)INT_MAX)
        return dpar__err(DPAR_ERANGE, "%s: a message of %zu bytes is larger than MPI's int count", x->c->name, bytes);
    rc =
        MPI_Irecv(dst, (int)bytes, MPI_BYTE, dpar__m_proc(m, peer), dpar__m_tag_from(m, x->lane, 0, peer), m->comm, &r);
    if (rc != MPI_SUCCESS) return dpar__m_poison(x->c, dpar__m_error(x->c, rc, "MPI_Irecv", peer), dpar_last_error());
    DPAR__TRY(dpar__m_wait_recv(x, &r, &s, peer, dst));
    return dpar__m_check_count(x, &s, peer, bytes);
}

static void dpar__m_prefetch(dpar__ctx *x, int peer)
{
    dpar__mpi *m = DPAR__M(x->c);
    if (m->pf_peer >= 0 || x->lane != DPAR__LANE_COLL) return;
    if (MPI_Irecv(m->staging2, (int)m->staging_bytes, MPI_BYTE, dpar__m_proc(m, peer),
                  dpar__m_tag_from(m, x->lane, 0, peer), m->comm, &m->pf_req) == MPI_SUCCESS)
        m->pf_peer = peer;
}

static void dpar__m_prefetch_cancel(dpar__mpi *m)
{
    if (m->pf_peer < 0) return;
    dpar__m_give_up(m, &m->pf_req, m->staging2);
    m->pf_peer = -1;
}
/* free one of the comm's staging buffers, unless MPI may still write it */
static void dpar__m_drop(dpar_comm *c, char *p, int lent)
{
    if (!(DPAR__M(c)->lent & lent)) dpar__free(&c->allocator, p);
}

static dpar_status dpar__m_fetch(dpar__ctx *x, int peer, size_t bytes, const void **data)
{
    dpar__mpi *m = DPAR__M(x->c);
    if (m->pf_peer == peer && x->lane == DPAR__LANE_COLL) { /* it was already on its way */
        MPI_Status s;
        char *t;
        m->pf_peer = -1;
        DPAR__TRY(dpar__m_wait_recv(x, &m->pf_req, &s, peer, m->staging2));
        DPAR__TRY(dpar__m_check_count(x, &s, peer, bytes));
        t = m->staging;
        m->staging = m->staging2;
        m->staging2 = t;
        *data = m->staging;
        return DPAR_OK;
    }
    if (bytes > m->staging_bytes) { /* larger than a segment: never in dpar's own algorithms */
        char *p = (char *)dpar__alloc(&x->c->allocator, bytes), *q = (char *)dpar__alloc(&x->c->allocator, bytes);
        if (!p || !q) {
            dpar__free(&x->c->allocator, p);
            dpar__free(&x->c->allocator, q);
            return dpar__err(DPAR_ENOMEM, "%s: out of memory for staging", x->c->name);
        }
        dpar__m_prefetch_cancel(m);
        dpar__m_drop(x->c, m->staging, DPAR__M_LENT_STAGING);
        dpar__m_drop(x->c, m->staging2, DPAR__M_LENT_STAGING2);
        m->staging = p;
        m->staging2 = q;
        m->staging_bytes = bytes;
        m->lent &= ~(DPAR__M_LENT_STAGING | DPAR__M_LENT_STAGING2);
    }
    DPAR__TRY(dpar__m_recv_into(x, peer, m->staging, bytes));
    *data = m->staging;
    return DPAR_OK;
}

static dpar_status dpar__m_release(dpar__ctx *x, int peer)
{
    (void)x;
    (void)peer;
    return DPAR_OK;
}

static dpar_status dpar__m_drain(dpar__ctx *x, int peer, int max)
{
    dpar__mpi *m = DPAR__M(x->c);
    size_t k = (size_t)x->lane * (size_t)x->c->size + (size_t)peer;
    while (m->send_n[k] > (uint32_t)(max < 0 ? 0 : max)) DPAR__TRY(dpar__m_retire(x, peer));
    return DPAR_OK;
}

static void dpar__m_enter(dpar__ctx *x)
{
    dpar__mpi *m = DPAR__M(x->c);
    if (x->lane != DPAR__LANE_COLL) return; /* the survey asks where a rank is in its collectives */
    m->bell_since = 0, m->bell_looks = 0;
    m->bell_stage = m->oversub; /* oversubscribed: yield at once, never spin */
    pthread_mutex_lock(&m->lock);
    m->where.seq = x->fp.seq;
    m->where.coll = x->fp.coll;
    m->where.line = x->fp.line;
    m->where.rank = x->c->rank;
    if (m->where_from != x->fp.file || !m->where.file[0]) { /* the text of __FILE__ only when it changes */
        m->where_from = x->fp.file;
        snprintf(m->where.file, sizeof m->where.file, "%s", x->fp.file ? x->fp.file : "?");
    }
    pthread_mutex_unlock(&m->lock);
}

static dpar_status dpar__m_poisoned(dpar_comm *c)
{
    dpar__mpi *m = DPAR__M(c);
    int st = DPAR__LOAD(&m->poison, DPAR__ACQUIRE);
    if (!st) {
        if (DPAR__LOAD(&m->abort, DPAR__ACQUIRE) || (m->local && dpar__tp_poisoned(m->local) != DPAR_OK))
            return dpar__m_watch(c);
        return DPAR_OK;
    }
    pthread_mutex_lock(&m->lock);
    dpar__err((dpar_status)st, "%s", m->poison_msg);
    pthread_mutex_unlock(&m->lock);
    return (dpar_status)st;
}

/* Poison this rank and tell every other process (tag 0; the sends are left to complete on their own). */
static dpar_status dpar__m_poison(dpar_comm *c, dpar_status why, const char *msg)
{
    dpar__mpi *m = DPAR__M(c);
    int first = 0, p, procs = c->size / m->T, me = c->rank / m->T;
    pthread_mutex_lock(&m->lock);
    if (!DPAR__LOAD(&m->poison, DPAR__RELAXED)) {
        snprintf(m->poison_msg, sizeof m->poison_msg, "%s", msg);
        DPAR__STORE(&m->poison, (int)why, DPAR__RELEASE);
        first = 1;
    }
    pthread_mutex_unlock(&m->lock);
    if (first) {
        struct {
            int32_t status;
            char msg[DPAR__ERROR_TEXT];
        } news;
        memset(&news, 0, sizeof news);
        news.status = (int32_t)why;
        snprintf(news.msg, sizeof news.msg, "%s", msg);
        for (p = 0; p < procs; p++) {
            MPI_Request r;
            if (p == me) continue;
            if (MPI_Isend(&news, (int)sizeof news, MPI_BYTE, p, DPAR__TAG_POISON, m->comm, &r) == MPI_SUCCESS) {
                /* small: delivered eagerly; wait a moment so the buffer on our stack may go */
                int flag = 0, i;
                for (i = 0; i < 100000 && !flag; i++) MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
                if (!flag) MPI_Request_free(&r);
            }
        }
        if (m->local) dpar__tp_poison(m->local, why, msg);
        /* (the other processes' leaders, when they wait among the leaders, hear this news there: dpar__m_watch) */
    }
    return dpar__m_poisoned(c);
}
/* (a prefetched receive of a poisoned comm is cancelled when the comm is destroyed) */

static dpar_status dpar__m_make(MPI_Comm mc, int own, const dpar_comm_desc *desc, int T, int t, int node_procs,
                                dpar_comm **out);
static int dpar__m_node_procs(MPI_Comm mc);

static dpar_status dpar__m_split(dpar__ctx *x, int color, int key, dpar_comm **out)
{
    dpar_comm *c = x->c;
    dpar__mpi *m = DPAR__M(c);
    MPI_Comm nc;
    dpar_comm_desc d;
    char name[sizeof c->name];
    int rc;
    if (m->T != 1)
        return dpar__err(DPAR_EUNSUPPORTED, "dpar_comm_split: not supported on a hybrid comm yet (split the MPI "
                                            "communicator and the thread groups, and make hybrid comms of them)");
    if (c->check) DPAR__TRY(dpar__barrier(x)); /* the fingerprints meet first: MPI_Comm_split can hang */
    rc = MPI_Comm_split(m->comm, color < 0 ? MPI_UNDEFINED : color, key, &nc);
    if (rc != MPI_SUCCESS) return dpar__m_poison(c, dpar__m_error(c, rc, "MPI_Comm_split", -1), dpar_last_error());
    if (nc == MPI_COMM_NULL) return DPAR_OK;
    memset(&d, 0, sizeof d);
    d.timeout_ms = c->timeout_ns ? (int)(c->timeout_ns / 1000000u) : -1;
    d.no_check = !c->check;
    d.deterministic = c->det;
    d.segment_bytes = c->segment_bytes;
    d.spin_us = c->spin.spin_ns ? (int)(c->spin.spin_ns / 1000u) : -1;
    d.name = c->name;
    if (c->split_suffix) {
        snprintf(name, sizeof name, "%.28s.%.2s", c->name, c->split_suffix); /* fits: 28 + 3 */
        d.name = name;
    }
    d.allocator = c->allocator;
    d.native = m->native;
    return dpar__m_make(nc, 1, &d, 1, 0, dpar__m_node_procs(nc), out);
}

static void dpar__m_destroy(dpar_comm *c)
{
    dpar__mpi *m = DPAR__M(c);
    size_t k, n = (size_t)DPAR__LANES * (size_t)c->size;
    int poisoned;
    if (!m) return;
    /* (every poison of this comm went through dpar__m_poison or news in dpar__m_watch, which set m->poison; of a
       hybrid comm, on at least one thread of the process: the one whose shared->retired keeps the communicator) */
    poisoned = DPAR__LOAD(&m->poison, DPAR__ACQUIRE) != 0;
    dpar__m_prefetch_cancel(m);
    if (!poisoned) { /* let sends finish (they are matched: all calls ended) */
        for (k = 0; k < n; k++)
            while (m->send_n[k]) {
                MPI_Wait(&m->sends[k * DPAR__QDEPTH + m->send_first[k] % DPAR__QDEPTH], MPI_STATUS_IGNORE);
                m->send_first[k]++;
                m->send_n[k]--;
            }
    } else {
        for (k = 0; k < n; k++)
            while (m->send_n[k]) {
                MPI_Request_free(&m->sends[k * DPAR__QDEPTH + m->send_first[k] % DPAR__QDEPTH]);
                m->send_first[k]++;
                m->send_n[k]--;
            }
    }
    /* (the leaders' comm: a call of theirs that the hybrid comm's poison cut short poisoned it too) */
    if (m->leaders) dpar_comm_destroy(m->leaders);
    if (m->local) dpar_comm_destroy(m->local);
    if (m->own_comm) dpar__m_free(&m->comm, poisoned);
    if (m->shared) {
        if (poisoned) DPAR__STORE(&m->shared->retired, 1, DPAR__RELEASE);
        if (DPAR__SUB(&m->shared->refs, 1, DPAR__ACQ_REL) == 1) { /* (acquires the others' retired) */
            dpar_allocator a = m->shared->allocator;
            dpar__m_free(&m->shared->comm, DPAR__LOAD(&m->shared->retired, DPAR__RELAXED));
            dpar__free(&a, m->shared);
        }
    }
    dpar__m_drop(c, m->staging, DPAR__M_LENT_STAGING);
    dpar__m_drop(c, m->staging2, DPAR__M_LENT_STAGING2);
    dpar__m_drop(c, m->pack, DPAR__M_LENT_PACK);
    if (m->shm) munmap(m->shm, m->shm_bytes);
    dpar__free(&c->allocator, m->sends);
    dpar__free(&c->allocator, m->send_first);
    dpar__free(&c->allocator, m->send_n);
    dpar__free(&c->allocator, m->hdr_sent);
    dpar__free(&c->allocator, m->hdr_recv);
    pthread_mutex_destroy(&m->lock);
    dpar__free(&c->allocator, m);
    c->tp_data = NULL;
}

static dpar_status dpar__m_native(dpar__ctx *x, const struct dpar__call *call, int *done); /* >>hybrid */
static dpar_status dpar__m_alltoallv_parts(dpar__ctx *x, const char *send, char *recv, const size_t *v, size_t es,
                                           int *done); /* >>hybrid */

/* Leaving on an error: let the sends in flight finish (briefly) so the caller may free buffers. */
static void dpar__m_quiesce(dpar_comm *c)
{
    dpar__mpi *m = DPAR__M(c);
    size_t k, n = (size_t)DPAR__LANES * (size_t)c->size;
    uint64_t give_up = dpar_time_ns() + 1000000000u;
    dpar__m_prefetch_cancel(m);
    for (k = 0; k < n; k++)
        while (m->send_n[k]) {
            MPI_Request *r = &m->sends[k * DPAR__QDEPTH + m->send_first[k] % DPAR__QDEPTH];
            int flag = 0;
            MPI_Test(r, &flag, MPI_STATUS_IGNORE);
            if (!flag && dpar_time_ns() < give_up) {
                sched_yield();
                continue;
            }
            if (!flag) MPI_Request_free(r); /* a peer that never takes it: MPI keeps the request */
            m->send_first[k]++;
            m->send_n[k]--;
        }
}

/* ---- one-shot allreduce through memory the processes of a node share ---- */
/* When every process of a flat comm runs on one node, rank 0 creates a POSIX shared-memory object
   (shm_open) for >>algo's records and staging buffers, every process maps it, and rank 0 removes the
   name once all have: the block lives exactly as long as the mappings, and a process that dies leaves
   nothing behind. Allreduce up to DPAR_MSG_ONESHOT_MAX_BYTES is then >>algo's one-shot (copy in,
   meet on phase words, reduce every rank's copy in the ring's order: the ring's bits) instead of
   messages. Its waits have no doorbell to sleep on: they poll the phase, spin for spin_us, then yield,
   then nap 50 us at a time, and every 16th look serves MPI (poison news, "where are you?" questions).
   Collective, at the comm's creation; able = 0 (this rank could not make its comm) or a failure
   anywhere leaves every rank without it. The answer is the same on every process: all on one node. */
static void *dpar__m_shm_map(MPI_Comm mc, int T, int procs, int node_procs, int able, size_t bytes)
{
    char name[64];
    void *p = MAP_FAILED;
    int fd = -1, prank = 0, ok, all = 0;
    if (T != 1 || procs < 2 || node_procs != procs) return NULL;
    MPI_Comm_rank(mc, &prank);
    memset(name, 0, sizeof name);
    if (prank == 0 && able) {
        snprintf(name, sizeof name, "/dpar.%ld.%llx", (long)getpid(), (unsigned long long)dpar_time_ns());
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd >= 0 && ftruncate(fd, (off_t)bytes) != 0) {
            close(fd);
            shm_unlink(name);
            fd = -1;
        }
        if (fd < 0) name[0] = 0;
    }
    MPI_Bcast(name, (int)sizeof name, MPI_CHAR, 0, mc);
    name[sizeof name - 1] = 0;
    if (prank != 0 && able && name[0]) fd = shm_open(name, O_RDWR, 0600);
    if (fd >= 0) {
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
    }
    ok = p != MAP_FAILED;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, mc);
    if (prank == 0 && name[0]) shm_unlink(name); /* everyone has it open or mapped by now */
    if (!all) {
        if (p != MAP_FAILED) munmap(p, bytes);
        DPAR__LOG(DPAR_LOG_DEBUG, "MPI: no shared block for the node's processes (%s): small allreduce over messages",
                  !name[0] ? "shm_open failed on rank 0" : "a process could not map it");
        return NULL;
    }
    return p;
}

static uint32_t dpar__m_doorbell(dpar_comm *c)
{
    (void)c;
    return 0;
}
static void dpar__m_wake(dpar_comm *c, int peer)
{
    (void)c;
    (void)peer;
}
/* one look's pause in a wait on the block (the caller's loop looks at the phase between two): spin,
   then yield, then nap. The clock is read, and MPI served (poison news, "where are you?"), every 64th look
   while spinning, every 8th while yielding and at every nap: MPI's probe runs its progress engine, which
   at every yield cost 4 processes on 2 cores half their small alltoallv's speed (docs/benchmarks.md). */
static dpar_status dpar__m_wait_bell(dpar_comm *c, uint32_t seen, uint64_t deadline)
{
    dpar__mpi *m = DPAR__M(c);
    (void)seen;
    (void)deadline;
    ++m->bell_looks;
    if (m->bell_stage == 2 || (m->bell_stage == 1 && (m->bell_looks & 7u) == 0) || (m->bell_looks & 63u) == 0) {
        uint64_t now = dpar_time_ns();
        if (!m->bell_since) m->bell_since = now;
        m->bell_stage = now - m->bell_since < c->spin.spin_ns && !m->oversub ? 0
                        : now - m->bell_since < 2000000u                     ? 1
                                                                             : 2;
        (void)dpar__m_watch(c); /* its news comes back through poisoned() */
    }
    if (m->bell_stage == 0) {
        dpar__cpu_relax();
    } else if (m->bell_stage == 1) {
        sched_yield();
    } else {
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    return DPAR_OK;
}

/* clang-format off */
static const dpar__transport dpar__mpi_transport = {
    "mpi",
    dpar__m_post, dpar__m_fetch, dpar__m_release, dpar__m_drain, /* moving bytes */
    NULL, NULL, NULL,                                            /* local arithmetic: the host loops */
    dpar__m_enter, dpar__m_poisoned, dpar__m_poison, dpar__m_quiesce, dpar__m_split, dpar__m_destroy,
    dpar__m_recv_into, dpar__m_native, dpar__m_prefetch,
    0, NULL, /* not threads of one process: no expose, so no direct buckets and no stealing */
    dpar__m_doorbell, dpar__m_wait_bell, dpar__m_wake, dpar__m_timeout, /* waits on the node's block (one-shot) */
    0, 1, /* polls: wait_bell returns at once */
    dpar__m_alltoallv_parts, /* parts too large for the node's block: MPI_Ialltoallv */
    NULL, NULL, /* a fetched message is a received copy: one at a time */
};
/* clang-format on */

/* processes of mc on this node (collective over mc: one thread per process calls it) */
static int dpar__m_node_procs(MPI_Comm mc)
{
    MPI_Comm node;
    int prank = 0, local = 1;
    MPI_Comm_rank(mc, &prank);
    if (MPI_Comm_split_type(mc, MPI_COMM_TYPE_SHARED, prank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        MPI_Comm_size(node, &local);
        MPI_Comm_free(&node);
    }
    return local;
}

/* Make a comm on MPI communicator mc (freed with the comm when own). Hybrid: T threads per process,
   this is thread t. node_procs: processes of mc on this node, to tell oversubscription. */
static dpar_status dpar__m_make(MPI_Comm mc, int own, const dpar_comm_desc *desc, int T, int t, int node_procs,
                                dpar_comm **out)
{
    dpar_comm *c;
    dpar__mpi *m;
    int procs = 0, prank = 0;
    size_t n;
    size_t shm_bytes;
    dpar__sm *sh;
    const char *shm_env;
    int made; /* every allocation of this rank's comm succeeded */
    MPI_Comm_size(mc, &procs);
    MPI_Comm_rank(mc, &prank);
    shm_bytes = dpar__sm_bytes((size_t)procs, DPAR__SHM_STAGE(procs));
    c = (dpar_comm *)dpar__calloc(&desc->allocator, 1, sizeof *c);
    m = (dpar__mpi *)dpar__calloc(&desc->allocator, 1, sizeof *m);
    if (!c || !m) {
        dpar__free(&desc->allocator, c);
        dpar__free(&desc->allocator, m);
        (void)dpar__m_shm_map(mc, T, procs, node_procs, 0, shm_bytes); /* the others must not wait for me */
        return dpar__err(DPAR_ENOMEM, "dpar_comm_from_mpi: out of memory");
    }
    dpar__comm_init(c, desc, prank * T + t, procs * T);
    if (!desc->segment_bytes) c->segment_bytes = (size_t)DPAR_MPI_SEGMENT_BYTES;
    c->tp = &dpar__mpi_transport;
    c->tp_data = m;
    m->comm = mc;
    m->own_comm = own;
    m->native = desc->native != 0;
    m->T = T;
    m->t = t;
    MPI_Query_thread(&m->level);
    if (m->level < MPI_THREAD_MULTIPLE)
        c->no_async = "async requests run on a progress thread, which needs MPI_THREAD_MULTIPLE (ask for it in "
                      "MPI_Init_thread)";
    pthread_mutex_init(&m->lock, NULL);
    m->oversub = node_procs * T > dpar__online_cpus(); /* then waits yield */
    c->spin =
        dpar__spin_make(desc->spin_us == 0 ? DPAR_SPIN_US : (desc->spin_us < 0 ? 0 : desc->spin_us), node_procs * T);
    m->staging_bytes = c->segment_bytes;
    n = (size_t)DPAR__LANES * (size_t)c->size;
    m->pf_peer = -1;
    m->staging = (char *)dpar__alloc(&c->allocator, m->staging_bytes);
    m->staging2 = (char *)dpar__alloc(&c->allocator, m->staging_bytes);
    m->pack = (char *)dpar__calloc(&c->allocator, (size_t)DPAR__LANES * 2, DPAR__M_PACK_BYTES);
    m->sends = (MPI_Request *)dpar__calloc(&c->allocator, n * DPAR__QDEPTH, sizeof(MPI_Request));
    m->send_first = (uint32_t *)dpar__calloc(&c->allocator, n, sizeof(uint32_t));
    m->send_n = (uint32_t *)dpar__calloc(&c->allocator, n, sizeof(uint32_t));
    m->hdr_sent = (uint64_t *)dpar__calloc(&c->allocator, (size_t)c->size, sizeof(uint64_t));
    m->hdr_recv = (uint64_t *)dpar__calloc(&c->allocator, (size_t)c->size, sizeof(uint64_t));
    sh = (dpar__sm *)dpar__calloc(&c->allocator, 1, sizeof *sh);
    made = m->staging && m->staging2 && m->pack && m->sends && m->send_first && m->send_n && m->hdr_sent &&
           m->hdr_recv && sh;
    shm_env = getenv("DPAR_MPI_SHM"); /* 0: small allreduce over messages even on one node */
    if ((m->shm = dpar__m_shm_map(mc, T, procs, node_procs, made && !(shm_env && !strcmp(shm_env, "0")), shm_bytes))) {
        m->shm_bytes = shm_bytes;
        dpar__sm_init_in(sh, c, (char *)m->shm, DPAR__SHM_STAGE(procs));
    } else {
        dpar__free(&c->allocator, sh);
    }
    if (!made) {
        m->own_comm = 0;
        dpar__m_destroy(c);
        dpar__comm_free(c);
        return dpar__err(DPAR_ENOMEM, "dpar_comm_from_mpi: out of memory");
    }
    *out = c;
    return DPAR_OK;
}

DPAR_API dpar_status dpar_comm_from_mpi(MPI_Comm mpi_comm, const dpar_comm_desc *desc, dpar_comm **out)
{
    dpar_comm_desc d;
    MPI_Comm dup;
    int inited = 0, finalized = 0, rc;
    dpar_status st;
    char why[DPAR__ERROR_TEXT] = "";
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_comm_from_mpi: out is NULL");
    *out = NULL;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if ((st = dpar__check_allocator("dpar_comm_from_mpi", &d.allocator)) != DPAR_OK) return st;
    if (d.timeout_ms < -1 || d.spin_us < -1)
        return dpar__err(DPAR_EINVAL, "dpar_comm_from_mpi: timeout_ms = %d, spin_us = %d", d.timeout_ms, d.spin_us);
    if (d.memory.reduce || d.memory.alloc)
        return dpar__err(DPAR_EUNSUPPORTED, "dpar_comm_from_mpi: dpar_comm_memory is for thread groups (the MPI "
                                            "transport moves host memory)");
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (!inited || finalized)
        return dpar__err(DPAR_ESTATE, "dpar_comm_from_mpi: MPI is not initialised (call MPI_Init_thread first)");
    if (mpi_comm == MPI_COMM_NULL)
        return dpar__err(DPAR_EINVAL, "dpar_comm_from_mpi: the communicator is MPI_COMM_NULL");
    st = dpar__env_check("dpar_comm_from_mpi");
    if (st != DPAR_OK) snprintf(why, sizeof why, "%s", dpar_last_error());
    rc = MPI_Comm_dup(mpi_comm, &dup); /* dpar's traffic never meets the program's */
    if (rc != MPI_SUCCESS) {
        char text[MPI_MAX_ERROR_STRING];
        int n = 0;
        MPI_Error_string(rc, text, &n);
        return dpar__err(DPAR_ESYSTEM, "dpar_comm_from_mpi: MPI_Comm_dup failed: %s", text);
    }
    MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
    { /* a process that refused its environment says so to all: every process fails, none waits in MPI */
        int bad = -1;
        if (st != DPAR_OK) MPI_Comm_rank(dup, &bad);
        rc = MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, dup);
        if (rc != MPI_SUCCESS || bad >= 0) {
            MPI_Comm_free(&dup);
            if (st != DPAR_OK) return dpar__err(st, "%s", why);
            if (rc != MPI_SUCCESS) return dpar__err(DPAR_ESYSTEM, "dpar_comm_from_mpi: MPI_Allreduce failed");
            return dpar__err(DPAR_EINVAL,
                             "dpar_comm_from_mpi: process %d (its rank in the MPI communicator) refused its "
                             "environment (DPAR_FAULT, DPAR_TIMEOUT_MS, DPAR_LOG or DPAR_TRACE; its error says which)",
                             bad);
        }
    }
    {
        int size = 0;
        MPI_Comm_size(dup, &size);
        if (d.deterministic && (size & (size - 1))) {
            MPI_Comm_free(&dup);
            return dpar__err(DPAR_EUNSUPPORTED,
                             "dpar_comm_from_mpi: the deterministic mode needs a power-of-two "
                             "number of ranks, not %d",
                             size);
        }
    }
    st = dpar__m_make(dup, 1, &d, 1, 0, dpar__m_node_procs(dup), out);
    if (st != DPAR_OK) MPI_Comm_free(&dup);
    return st;
}

/* >>hybrid: MPI's own collectives (desc.native) and the processes x threads comm ---------------- */
static dpar_status dpar__h_allreduce(dpar__ctx *x, const struct dpar__call *call);
static MPI_Datatype dpar__m_type(dpar_dtype t)
{
    switch (t) {
    case DPAR_F32: return MPI_FLOAT;
    case DPAR_F64: return MPI_DOUBLE;
    case DPAR_I32: return MPI_INT32_T;
    case DPAR_I64: return MPI_INT64_T;
    case DPAR_U8: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL; /* bf16, f16: MPI has none, the ring does them */
    }
}
static MPI_Op dpar__m_op(dpar_op op)
{
    switch (op) {
    case DPAR_MIN: return MPI_MIN;
    case DPAR_MAX: return MPI_MAX;
    case DPAR_PROD: return MPI_PROD;
    default: return MPI_SUM; /* avg: a sum, then / N here */
    }
}

/* MPI_Ialltoallv of v's counts and displacements times scale (each fits an int), elements of ty, waited for */
static dpar_status dpar__m_ialltoallv(dpar__ctx *x, const void *send, void *recv, const size_t *v, size_t scale,
                                      MPI_Datatype ty)
{
    dpar_comm *c = x->c;
    MPI_Request r = MPI_REQUEST_NULL;
    size_t N = (size_t)c->size, q;
    int *iv = (int *)dpar__alloc(&c->allocator, 4 * N * sizeof(int)), rc;
    dpar_status st;
    if (!iv) return dpar__tp_fail(c, dpar__err(DPAR_ENOMEM, "%s: out of memory", c->name), dpar_last_error());
    for (q = 0; q < 4 * N; q++) iv[q] = (int)(v[q] * scale);
    rc = MPI_Ialltoallv(send, iv, iv + N, ty, recv, iv + 2 * N, iv + 3 * N, ty, DPAR__M(c)->comm, &r);
    if (rc != MPI_SUCCESS) {
        dpar__free(&c->allocator, iv);
        return dpar__m_poison(c, dpar__m_error(c, rc, "alltoallv", -1), dpar_last_error());
    }
    st = dpar__m_wait(x, &r, MPI_STATUS_IGNORE, -1, "join the collective");
    if (st != DPAR_OK) return st; /* MPI's collective cannot be cancelled or freed: it keeps iv */
    dpar__free(&c->allocator, iv);
    return DPAR_OK;
}

/* MPI_Alltoallv, when every rank's counts and displacements fit MPI's int (one MPI_Iallreduce of a word says so on
   every rank; else the pairwise rounds run it everywhere); the checker's fingerprints meet first in empty pairwise
   messages, each carrying its pair's count */
static dpar_status dpar__m_alltoallv(dpar__ctx *x, const struct dpar__call *call, MPI_Datatype ty, int *done)
{
    dpar_comm *c = x->c;
    size_t N = (size_t)c->size, q;
    int fits = 1, all = 0, rc;
    MPI_Request r = MPI_REQUEST_NULL;
    for (q = 0; q < 4 * N; q++)
        if (call->v[q] > (size_t)INT_MAX) fits = 0;
    rc = MPI_Iallreduce(&fits, &all, 1, MPI_INT, MPI_MIN, DPAR__M(c)->comm, &r);
    if (rc != MPI_SUCCESS) return dpar__m_poison(c, dpar__m_error(c, rc, "alltoallv", -1), dpar_last_error());
    DPAR__TRY(dpar__m_wait(x, &r, MPI_STATUS_IGNORE, -1, "join the collective"));
    if (!all) return DPAR_OK;
    if (c->check) DPAR__TRY(dpar__alltoallv_pairwise(x, NULL, NULL, call->v, 0, 1));
    DPAR__TRY(dpar__m_ialltoallv(x, call->send, call->recv, call->v, 1, ty));
    *done = 1;
    return DPAR_OK;
}

/* an alltoallv's parts too large for the node's block, their counts checked there already: one MPI_Ialltoallv of
   bytes when every byte count and displacement fits MPI's int. MPI's shared-memory transport lets whichever
   process runs make progress, where the pairwise rounds wait for each peer in turn (4 processes on 2 cores:
   docs/benchmarks.md, 'Alltoallv') */
static dpar_status dpar__m_alltoallv_parts(dpar__ctx *x, const char *send, char *recv, const size_t *v, size_t es,
                                           int *done)
{
    dpar_comm *c = x->c;
    size_t N = (size_t)c->size, q;
    *done = 0;
    if (!x->vfits) return DPAR_OK; /* some rank's bytes do not fit an int (every rank read it in the headers) */
    DPAR__TRY(dpar__m_ialltoallv(x, send, recv, v, es, MPI_BYTE));
    for (q = 0; q < N; q++)
        if (q != (size_t)c->rank) x->sent += v[q] * es, x->received += v[2 * N + q] * es;
    *done = 1;
    return DPAR_OK;
}

static dpar_status dpar__m_native(dpar__ctx *x, const struct dpar__call *call, int *done)
{
    dpar_comm *c = x->c;
    dpar__mpi *m = DPAR__M(c);
    MPI_Datatype ty = dpar__m_type(call->dtype);
    MPI_Op op = dpar__m_op(call->op);
    MPI_Request r = MPI_REQUEST_NULL;
    size_t es = dpar__dtype_sizes[call->dtype], i;
    int rc = MPI_SUCCESS, N = c->size;
    int *counts = NULL, *displs = NULL;
    void *in_place_send;
    char *staged = NULL;
    *done = 0;
    if (m->T > 1 && call->coll == DPAR_COLL_ALLREDUCE) {
        dpar_status st = dpar__h_allreduce(x, call);
        *done = st == DPAR_OK;
        return st;
    }
    if (!m->native || m->T != 1 || c->det || (ty == MPI_DATATYPE_NULL && call->coll != DPAR_COLL_BARRIER))
        return DPAR_OK;
    if (call->coll == DPAR_COLL_ALLTOALLV) return dpar__m_alltoallv(x, call, ty, done);
    if (call->count > (size_t)INT_MAX / (size_t)N || call->offs)
        return DPAR_OK;                           /* MPI counts are ints; own layouts: the ring */
    if (c->check) DPAR__TRY(dpar__ring_check(x)); /* fingerprints meet before MPI's call, which cannot time out */
    if (call->coll == DPAR_COLL_REDUCE_SCATTER || call->coll == DPAR_COLL_ALLGATHER) {
        counts = (int *)dpar__alloc(&c->allocator, 2 * (size_t)N * sizeof(int));
        if (!counts) return dpar__err(DPAR_ENOMEM, "%s: out of memory", c->name);
        displs = counts + N;
        for (i = 0; i < (size_t)N; i++) {
            size_t o, l;
            dpar_block_range(call->count, N, (int)i, &o, &l);
            counts[i] = (int)l;
            displs[i] = (int)o;
        }
    }
    in_place_send = call->send == call->recv ? MPI_IN_PLACE : (void *)(uintptr_t)call->send;
    switch (call->coll) {
    case DPAR_COLL_BARRIER: rc = MPI_Ibarrier(m->comm, &r); break;
    case DPAR_COLL_ALLREDUCE:
        rc = MPI_Iallreduce(in_place_send, call->recv, (int)call->count, ty, op, m->comm, &r);
        break;
    case DPAR_COLL_REDUCE:
        rc = MPI_Ireduce(c->rank == call->root ? in_place_send : call->send, call->recv, (int)call->count, ty, op,
                         call->root, m->comm, &r);
        break;
    case DPAR_COLL_BROADCAST:
        if (c->rank == call->root && call->send != call->recv) memcpy(call->recv, call->send, call->count * es);
        rc = MPI_Ibcast(call->recv, (int)call->count, ty, call->root, m->comm, &r);
        break;
    case DPAR_COLL_REDUCE_SCATTER: {
        /* dpar's in place (recv = my block of send) is not MPI's: the block goes through scratch,
           so that every rank takes this path whatever its layout */
        char *dst = (char *)call->recv;
        if (counts[c->rank] && dpar__overlap(call->send, call->count * es, call->recv, (size_t)counts[c->rank] * es)) {
            dpar_status st = dpar__scratch(c, (size_t)counts[c->rank] * es, &dst);
            if (st != DPAR_OK) {
                dpar__free(&c->allocator, counts);
                return st;
            }
            staged = dst;
        }
        rc = MPI_Ireduce_scatter(call->send, dst, counts, ty, op, m->comm, &r);
        break;
    }
    case DPAR_COLL_ALLGATHER:
        rc = MPI_Iallgatherv((const char *)call->send == (const char *)call->recv + (size_t)displs[c->rank] * es
                                 ? MPI_IN_PLACE
                                 : call->send,
                             counts[c->rank], ty, call->recv, counts, displs, ty, m->comm, &r);
        break;
    case DPAR_COLL_ALLTOALL:
        rc = MPI_Ialltoall(in_place_send, (int)call->count, ty, call->recv, (int)call->count, ty, m->comm, &r);
        break;
    default: dpar__free(&c->allocator, counts); return DPAR_OK;
    }
    if (rc != MPI_SUCCESS) {
        dpar__free(&c->allocator, counts);
        return dpar__m_poison(c, dpar__m_error(c, rc, dpar_coll_name(call->coll), -1), dpar_last_error());
    }
    rc = dpar__m_wait(x, &r, MPI_STATUS_IGNORE, -1, "join the collective");
    if (rc != DPAR_OK) { /* MPI's collective cannot be cancelled or freed: it keeps counts and the scratch */
        if (staged) c->scratch = NULL, c->scratch_bytes = 0;
        return (dpar_status)rc;
    }
    if (staged) memcpy(call->recv, staged, (size_t)counts[c->rank] * es);
    dpar__free(&c->allocator, counts);
    if (call->op == DPAR_AVG &&
        (call->coll == DPAR_COLL_ALLREDUCE || (call->coll == DPAR_COLL_REDUCE && c->rank == call->root)))
        dpar__divide(call->recv, call->recv, call->count, call->dtype, N);
    if (call->op == DPAR_AVG && call->coll == DPAR_COLL_REDUCE_SCATTER) {
        size_t l;
        dpar_block_range(call->count, N, c->rank, NULL, &l);
        dpar__divide(call->recv, call->recv, l, call->dtype, N);
    }
    *done = 1;
    return DPAR_OK;
}

/* ---- hybrid: processes x threads ---- */
/* Hierarchical allreduce: the T threads of a process reduce through shared memory, thread t
   computing block t of the process's sum straight into thread 0's recv (in the fixed tree in the
   deterministic mode); thread 0 allreduces that over MPI with the other processes' thread 0; every
   thread copies the result. World rank = process * T + thread, so in the deterministic mode the
   tree over threads and then over processes is the tree over world ranks: the bits of a flat comm. */
/* an inner comm's call failed: poison the hybrid comm (every process, every thread: those waiting among the leaders
   too) with its text; a timeout's story names the inner comm's ranks, so it is told with their world ranks: the
   rule, and each rank the story names (the first four) written out */
static dpar_status dpar__h_fail(dpar_comm *c, dpar_status st, int leaders)
{
    dpar__mpi *m = DPAR__M(c);
    char msg[2 * DPAR__ERROR_TEXT], story[DPAR__ERROR_TEXT]; /* (the poison keeps what fits) */
    const char *s;
    int k, named[4], n = 0, i, base = leaders ? 0 : c->rank - m->t, mul = leaders ? m->T : 1;
    if (DPAR__LOAD(&m->poison, DPAR__ACQUIRE)) return dpar__m_poisoned(c);               /* told already */
    if (st != DPAR_ETIMEDOUT || strstr(dpar_last_error(), "where rank k is world rank")) /* world ranks already */
        return dpar__m_poison(c, st, dpar_last_error());
    snprintf(story, sizeof story, "%s", dpar_last_error());
    k = snprintf(msg, sizeof msg, "%s rank %d (process %d, thread %d), in %s, where rank k is world rank %s%d", c->name,
                 c->rank, c->rank / m->T, m->t, leaders ? "the comm of the process leaders" : "its process's threads",
                 leaders ? "k x " : "k + ", leaders ? m->T : base);
    for (s = strstr(story, "rank "); s && n < 4; s = strstr(s + 5, "rank ")) {
        int r;
        if ((s != story && s[-1] != ' ') || s[5] < '0' || s[5] > '9') continue;
        r = atoi(s + 5);
        for (i = 0; i < n && named[i] != r; i++) {}
        if (i == n) named[n++] = r;
    }
    for (i = 0; i < n && (size_t)k < sizeof msg / 2; i++) /* (the story keeps the other half) */
        k += snprintf(msg + k, sizeof msg - (size_t)k, "%s rank %d is world rank %d", i ? "," : " (here", named[i],
                      base + named[i] * mul);
    if ((size_t)k < sizeof msg) snprintf(msg + k, sizeof msg - (size_t)k, "%s: %.600s", n ? ")" : "", story);
    return dpar__m_poison(c, st, msg);
}

static dpar_status dpar__h_allreduce(dpar__ctx *x, const struct dpar__call *call)
{
    dpar_comm *c = x->c;
    dpar__mpi *m = DPAR__M(c);
    dpar_comm *lc = m->local;
    int T = m->T, t = m->t, j;
    size_t es = dpar__dtype_sizes[call->dtype], off, len;
    dpar_op op = call->op == DPAR_AVG ? DPAR_SUM : call->op;
    char *scr = NULL, *root;
    int64_t *ptrs;
    const void **leaves;
    dpar_status st;
    DPAR__TRY(dpar__scratch(c, (size_t)T * 3 * sizeof(int64_t), &scr));
    ptrs = (int64_t *)(void *)scr;
    leaves = (const void **)(void *)(ptrs + 2 * T);
    ptrs[2 * t] = (int64_t)(uintptr_t)call->send;
    ptrs[2 * t + 1] = (int64_t)(uintptr_t)call->recv;
    st = dpar_allgather_at(lc, ptrs + 2 * t, ptrs, 2 * (size_t)T, DPAR_I64, call->file, call->line);
    if (st != DPAR_OK) return dpar__h_fail(c, st, 0);
    root = (char *)(uintptr_t)ptrs[1];
    dpar_block_range(call->count, T, t, &off, &len);
    if (len) {
        for (j = 0; j < T; j++) leaves[j] = (const char *)(uintptr_t)ptrs[2 * j] + off * es;
        if (c->det) {
            dpar_tree_reduce(root + off * es, leaves, T, len, call->dtype, op);
        } else {
            dpar__reduce(root + off * es, leaves[0], T > 1 ? leaves[1] : leaves[0], len, call->dtype, op, 0);
            for (j = 2; j < T; j++) dpar__reduce(root + off * es, root + off * es, leaves[j], len, call->dtype, op, 0);
            if (T == 1) memcpy(root + off * es, leaves[0], len * es);
        }
        x->received += (uint64_t)(T - 1) * len * es;
    }
    if ((st = dpar_barrier_at(lc, call->file, call->line)) != DPAR_OK) return dpar__h_fail(c, st, 0);
    if (t == 0) {
        st = dpar_allreduce_at(m->leaders, root, root, call->count, call->dtype, op, call->file, call->line);
        if (st != DPAR_OK) return dpar__h_fail(c, st, 1);
        if (call->op == DPAR_AVG) dpar__divide(root, root, call->count, call->dtype, c->size);
        {
            dpar_comm_stats ls;
            dpar_comm_stats_get(m->leaders, &ls);
            x->sent += ls.last.bytes_sent;
            x->received += ls.last.bytes_received;
        }
    }
    if (t != 0) { /* waiting for thread 0 among the leaders, whose own wait there ends first and tells why */
        uint64_t keep = lc->timeout_ns;
        if (keep) lc->timeout_ns = 2 * keep + 1000000000u;
        st = dpar_barrier_at(lc, call->file, call->line);
        lc->timeout_ns = keep;
    } else {
        st = dpar_barrier_at(lc, call->file, call->line);
    }
    if (st != DPAR_OK) return dpar__h_fail(c, st, 0);
    if (t != 0) {
        memcpy(call->recv, root, call->count * es);
        x->received += call->count * es;
    }
    if ((st = dpar_barrier_at(lc, call->file, call->line)) != DPAR_OK) return dpar__h_fail(c, st, 0);
    return DPAR_OK;
}

static const char *dpar__m_level_name(int level)
{
    return level == MPI_THREAD_SINGLE       ? "MPI_THREAD_SINGLE"
           : level == MPI_THREAD_FUNNELED   ? "MPI_THREAD_FUNNELED"
           : level == MPI_THREAD_SERIALIZED ? "MPI_THREAD_SERIALIZED"
                                            : "MPI_THREAD_MULTIPLE";
}

DPAR_API dpar_status dpar_group_join_mpi(dpar_group *local, int local_rank, MPI_Comm mpi_comm, dpar_comm **out)
{
    dpar_comm *lc = NULL, *ld = NULL, *c = NULL;
    dpar__hybrid *h = NULL;
    int inited = 0, level = 0, T, node = 1;
    int64_t handover = 0, tmax, tmin;
    dpar_status st = DPAR_OK;
    char why[DPAR__ERROR_TEXT] = "";
    if (!out) return dpar__err(DPAR_EINVAL, "dpar_group_join_mpi: out is NULL");
    *out = NULL;
    if (!local) return dpar__err(DPAR_EINVAL, "dpar_group_join_mpi: local group is NULL");
    MPI_Initialized(&inited);
    if (!inited)
        return dpar__err(DPAR_ESTATE, "dpar_group_join_mpi: MPI is not initialised (call MPI_Init_thread "
                                      "with MPI_THREAD_MULTIPLE first)");
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_MULTIPLE)
        return dpar__err(DPAR_EUNSUPPORTED,
                         "dpar_group_join_mpi: the threads of a process call MPI at once, which "
                         "needs MPI_THREAD_MULTIPLE, but MPI_Init_thread gave %s",
                         dpar__m_level_name(level));
    DPAR__TRY(dpar_group_join(local, local_rank, &lc));
    dpar__fault_detach(lc->fault); /* DPAR_FAULT's ranks are the hybrid comm's: none on its inner comms */
    lc->fault = NULL;
    if (lc->desc.memory.reduce) {
        dpar_comm_destroy(lc);
        return dpar__err(DPAR_EUNSUPPORTED, "dpar_group_join_mpi: the local group has dpar_comm_memory, which the "
                                            "MPI transport cannot move");
    }
    T = lc->size;
    if (local_rank == 0) { /* the leader: the process's shared MPI comm, and the comm of the leaders */
        dpar_comm_desc d = lc->desc;
        d.size = 0;
        h = (dpar__hybrid *)dpar__calloc(&d.allocator, 1, sizeof *h);
        if (!h) {
            st = dpar__err(DPAR_ENOMEM, "dpar_group_join_mpi: out of memory");
        } else if (MPI_Comm_dup(mpi_comm, &h->comm) != MPI_SUCCESS) {
            st = dpar__err(DPAR_ESYSTEM, "dpar_group_join_mpi: MPI_Comm_dup failed");
            dpar__free(&d.allocator, h);
            h = NULL;
        } else {
            MPI_Comm_set_errhandler(h->comm, MPI_ERRORS_RETURN);
            h->refs = T;
            h->allocator = d.allocator;
            d.deterministic = 0; /* checked below against the world size */
            st = dpar_comm_from_mpi(mpi_comm, &d, &ld);
            d.deterministic = lc->desc.deterministic;
            if (st == DPAR_OK) dpar__fault_detach(ld->fault), ld->fault = NULL;
        }
        if (st == DPAR_OK) { /* every process must have the same number of threads */
            tmax = T;
            tmin = -T;
            st = dpar_allreduce(ld, &tmax, &tmax, 1, DPAR_I64, DPAR_MAX);
            if (st == DPAR_OK) st = dpar_allreduce(ld, &tmin, &tmin, 1, DPAR_I64, DPAR_MAX);
            if (st == DPAR_OK && (tmax != T || -tmin != T))
                st = dpar__err(DPAR_EINVAL,
                               "dpar_group_join_mpi: processes have from %lld to %lld threads; every "
                               "process needs the same",
                               (long long)-tmin, (long long)tmax);
            if (st == DPAR_OK && d.deterministic && ((ld->size * T) & (ld->size * T - 1)))
                st = dpar__err(DPAR_EUNSUPPORTED,
                               "dpar_group_join_mpi: the deterministic mode needs a power-of-two "
                               "number of ranks, not %d processes x %d threads",
                               ld->size, T);
            if (st == DPAR_OK) {
                ld->det = d.deterministic;
                node = dpar__m_node_procs(h->comm);
            }
        }
        if (st != DPAR_OK) {
            snprintf(why, sizeof why, "%s", dpar_last_error());
            if (h) { /* made, never handed over: nobody else will free it */
                MPI_Comm_free(&h->comm);
                dpar__free(&d.allocator, h);
                h = NULL;
            }
        }
        handover = st == DPAR_OK ? (int64_t)(uintptr_t)h : 0;
    }
    /* hand the shared comm to the process's threads (NULL: the leader failed) */
    {
        int64_t msg[3];
        msg[0] = handover;
        msg[1] = node;
        msg[2] = st;
        if (dpar_broadcast(lc, msg, msg, 3, DPAR_I64, 0) != DPAR_OK) st = st != DPAR_OK ? st : DPAR_ESYSTEM;
        else if (local_rank != 0) st = (dpar_status)msg[2];
        h = (dpar__hybrid *)(uintptr_t)msg[0];
        node = (int)msg[1];
    }
    if (!h) {
        if (ld) dpar_comm_destroy(ld);
        dpar_comm_destroy(lc);
        if (local_rank == 0) return dpar__err(st, "%s", why);
        if (st == DPAR_OK) st = DPAR_ESYSTEM;
        return dpar__err(st, "dpar_group_join_mpi: thread 0 of this process failed (%s)", dpar_status_string(st));
    }
    st = dpar__m_make(h->comm, 0, &lc->desc, T, local_rank, node, &c);
    if (st != DPAR_OK) { /* this thread's share of what the process made goes with it */
        if (DPAR__SUB(&h->refs, 1, DPAR__ACQ_REL) == 1) {
            dpar_allocator a = h->allocator;
            MPI_Comm_free(&h->comm);
            dpar__free(&a, h);
        }
        if (ld) dpar_comm_destroy(ld);
        dpar_comm_destroy(lc);
        return st;
    }
    DPAR__M(c)->local = lc;
    DPAR__M(c)->leaders = ld;
    if (ld) {
        /* A leader waiting among the leaders hears the hybrid comm's news (a rank of another process that timed
           out among its own threads), and waits a quarter longer than the threads do: a late or vanished thread is
           first noticed by the threads of its own process, whose story names it, not by the other processes'
           leaders, who would name its process's leader. */
        DPAR__M(ld)->parent = c;
        ld->timeout_ns += ld->timeout_ns / 4;
    }
    DPAR__M(c)->shared = h;
    *out = c;
    return DPAR_OK;
}

#endif /* DPAR_MPI */

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
