/* test_mpi.c - the communicator over MPI processes, and processes x threads (hybrid).
   Build: mpicc -std=c99 -O2 -I. -Itests tests/test_mpi.c -o build/test_mpi -pthread -lm
   Run:   mpirun -np 4 --oversubscribe ./build/test_mpi            (flat: MPI processes)
          mpirun -np 2 ./build/test_mpi --hybrid 2                 (2 processes x 2 threads)
          mpirun -np 2 ./build/test_mpi --funneled                 (what needs MPI_THREAD_MULTIPLE says so)
   Every process runs every test (DPAR_TEST_ONLY=word: those whose name holds it); the failures of all are added up
   and rank 0 prints the results.
   DPAR_TEST_BIG sets the large count of the matrix (default 1000003). */
static void test_step_hook(void);
#define DPAR_TEST_STEP_HOOK() test_step_hook()
#define DPAR_MPI
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <sys/mman.h>
#include <unistd.h>

#include "dpar_test.h"
#include "coll_matrix.h"
#include "pipe_mlp.h"
#include "fsdp_case.h"
#include "tensors_case.h"
#include "ckpt_case.h"
#include "stress.h"

static int hook_on;
static DPAR__TLS unsigned long long hook_rng = 1;
static void test_step_hook(void)
{
    if (!__atomic_load_n(&hook_on, __ATOMIC_RELAXED)) return;
    hook_rng = hook_rng * 6364136223846793005ull + 1442695040888963407ull;
    if ((hook_rng >> 33) % 3 == 0) usleep((unsigned)((hook_rng >> 40) % 40));
}

static int me, nprocs, hybrid_threads;
static const char *only; /* a word of the test names to run (tests/mutate.sh), or NULL: all */

static dpar_comm *world_comm(const dpar_comm_desc *desc)
{
    dpar_comm *c = NULL;
    if (dpar_comm_from_mpi(MPI_COMM_WORLD, desc, &c) != DPAR_OK)
        printf("    rank %d: comm_from_mpi: %s\n", me, dpar_last_error());
    return c;
}

/* a world of one rank per process, noting failures like the thread tests */
static int run_proc(const dpar_comm_desc *desc, rank_fn fn, void *user)
{
    world w;
    dpar_comm *c = world_comm(desc);
    memset(&w, 0, sizeof w);
    pthread_mutex_init(&w.lock, NULL);
    w.n = nprocs;
    w.user = user;
    if (!c) return 1;
    fn(&w, c, me);
    dpar_comm_destroy(c);
    if (w.failures) printf("    rank %d: %d failures, first: %s\n", me, w.failures, w.first);
    pthread_mutex_destroy(&w.lock);
    return w.failures;
}

static size_t big_count(void)
{
    const char *e = getenv("DPAR_TEST_BIG");
    return e && *e ? (size_t)strtoull(e, NULL, 10) : 1000003;
}

static void test_collectives_matrix_over_mpi(void)
{
    size_t big = big_count(), counts[6];
    char *send = (char *)malloc((big + 64) * 8), *recv = (char *)malloc((big + 64) * 8);
    int ci, t, op, native, fails = 0, a;
    counts[0] = 0;
    counts[1] = 1;
    counts[2] = (size_t)(nprocs > 1 ? nprocs - 1 : 2);
    counts[3] = (size_t)nprocs;
    counts[4] = (size_t)nprocs + 1;
    counts[5] = big;
    for (native = 0; native < 2; native++)
        for (ci = 0; ci < 6; ci++) {
            matrix_case m;
            dpar_comm_desc d;
            memset(&d, 0, sizeof d);
            d.native = native;
            memset(&m, 0, sizeof m);
            m.count = counts[ci];
            m.send[me] = send;
            m.recv[me] = recv;
            for (t = 0; t < DPAR_DTYPE_COUNT; t++) {
                m.t = (dpar_dtype)t;
                m.root = (int)(counts[ci] % (size_t)nprocs);
                for (op = 0; op < DPAR_OP_COUNT; op++) {
                    if (ci == 5 && op != DPAR_SUM && t != DPAR_F32) continue;
                    if (native && ci == 5 && t != DPAR_F32 && t != DPAR_I64) continue;
                    m.op = (dpar_op)op;
                    fails += run_proc(&d, matrix_rank, &m);
                    if (!native) { /* allreduce forced to each algorithm MPI comms run; one-shot twice:
                                      through the node's shared block, and over messages (DPAR_MPI_SHM=0) */
                        dpar_comm_desc da = d;
                        for (a = DPAR_ALGO_RING; a <= DPAR_ALGO_ONESHOT + 1; a++) {
                            da.algo = a > DPAR_ALGO_ONESHOT ? DPAR_ALGO_ONESHOT : a;
                            allreduce_want = (dpar_algo)da.algo;
                            if (a > DPAR_ALGO_ONESHOT) setenv("DPAR_MPI_SHM", "0", 1);
                            fails += run_proc(&da, allreduce_rank, &m);
                            unsetenv("DPAR_MPI_SHM");
                        }
                        if (ci == 5) { /* the ring in many segments (the default's are 1 MiB over MPI) */
                            da.algo = DPAR_ALGO_RING;
                            da.segment_bytes = 12288;
                            allreduce_want = DPAR_ALGO_RING;
                            fails += run_proc(&da, allreduce_rank, &m);
                        }
                    }
                }
                m.op = DPAR_SUM;
                fails += run_proc(&d, movement_rank, &m);
            }
        }
    CHECK(fails == 0);
    free(send);
    free(recv);
}

static void p2p_proc(world *w, dpar_comm *c, int r)
{
    int N = w->n, i;
    int32_t token[100], back[100];
    for (i = 0; i < 100; i++) token[i] = r * 1000 + i;
    expect_ok(w, dpar_sendrecv(c, token, 100, (r + 1) % N, back, 100, (r + N - 1) % N, DPAR_I32, 7), "sendrecv", r);
    if (back[5] != ((r + N - 1) % N) * 1000 + 5) note(w, "sendrecv rank %d got %d", r, back[5]);
    expect_ok(w, dpar_sendrecv(c, token, 100, r, back, 100, r, DPAR_I32, 1), "self sendrecv", r);
    if (back[99] != r * 1000 + 99) note(w, "self sendrecv wrong on rank %d", r);
    if (dpar_send(c, token, 1, DPAR_I32, r, 0) != DPAR_EDEADLK) note(w, "send to self not refused on rank %d", r);
    if (r % 2 == 0 && r + 1 < N) {
        for (i = 0; i < 50; i++) {
            token[0] = i;
            expect_ok(w, dpar_send(c, token, 1 + (size_t)i, DPAR_I32, r + 1, i), "send", r);
        }
    } else if (r % 2 == 1) {
        for (i = 0; i < 50; i++) {
            expect_ok(w, dpar_recv(c, back, 1 + (size_t)i, DPAR_I32, r - 1, i), "recv", r);
            if (back[0] != i) note(w, "recv %d out of order on rank %d", i, r);
        }
    }
}

static void test_point_to_point_over_mpi(void) { CHECK(run_proc(NULL, p2p_proc, NULL) == 0); }

/* the counters: a ring allreduce moves exactly 2(N-1)/N of the buffer per rank */
static void bytes_proc(world *w, dpar_comm *c, int r)
{
    size_t n = (size_t)w->n * 100000;
    float *x = (float *)calloc(n, sizeof(float));
    dpar_comm_stats s;
    uint64_t want = 4 * (uint64_t)n * 2 * (uint64_t)(w->n - 1) / (uint64_t)w->n;
    dpar_comm_desc used;
    memset(&used, 0, sizeof used);
    /* made with segment_bytes 0: over MPI the default is DPAR_MPI_SEGMENT_BYTES, not the threads' 128 KiB */
    if (dpar_comm_query(c, &used) != DPAR_OK || used.segment_bytes != (size_t)DPAR_MPI_SEGMENT_BYTES)
        note(w, "rank %d: default segment %zu bytes over MPI, want %zu", r, used.segment_bytes,
             (size_t)DPAR_MPI_SEGMENT_BYTES);
    expect_ok(w, dpar_allreduce(c, x, x, n, DPAR_F32, DPAR_SUM), "allreduce", r);
    dpar_comm_stats_get(c, &s);
    if (s.by_coll[DPAR_COLL_ALLREDUCE].bytes_sent != want || s.by_coll[DPAR_COLL_ALLREDUCE].bytes_received != want)
        note(w, "rank %d moved %llu/%llu bytes, want %llu", r,
             (unsigned long long)s.by_coll[DPAR_COLL_ALLREDUCE].bytes_sent,
             (unsigned long long)s.by_coll[DPAR_COLL_ALLREDUCE].bytes_received, (unsigned long long)want);
    free(x);
}

static void test_ring_bytes_over_mpi(void) { CHECK(run_proc(NULL, bytes_proc, NULL) == 0); }

/* the same bits on every rank and every run, whatever the timing; the deterministic mode */
typedef struct {
    size_t n;
    float *first;
    int rep;
} det_job;
static void random_floats(float *x, size_t n, unsigned seed)
{
    size_t i;
    unsigned long long s = seed * 2654435761ull + 1;
    for (i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)((s >> 33) % 2000001) / 1000.0 - 1000.0) * (float)(1 << ((s >> 20) % 12));
    }
}
static void det_proc(world *w, dpar_comm *c, int r)
{
    det_job *d = (det_job *)w->user;
    float *x = (float *)malloc(d->n * sizeof(float)), *y = (float *)malloc(d->n * sizeof(float));
    dpar_comm_desc used;
    memset(&used, 0, sizeof used);
    if (dpar_comm_query(c, &used) != DPAR_OK || used.segment_bytes != 8192) /* the desc's segment is kept */
        note(w, "rank %d: segment %zu bytes, the desc said 8192", r, used.segment_bytes);
    random_floats(x, d->n, (unsigned)r + 7);
    expect_ok(w, dpar_allreduce(c, x, y, d->n, DPAR_F32, DPAR_SUM), "allreduce", r);
    if (d->rep == 0) memcpy(d->first, y, d->n * sizeof(float));
    else if (memcmp(d->first, y, d->n * sizeof(float))) note(w, "rep %d on rank %d differs", d->rep, r);
    free(x);
    free(y);
}

static void test_bitwise_reproducible_over_mpi(void)
{
    det_job d;
    dpar_comm_desc desc;
    float *all;
    int q;
    memset(&desc, 0, sizeof desc);
    desc.segment_bytes = 8192;
    d.n = 20011;
    d.first = (float *)malloc(d.n * sizeof(float));
    __atomic_store_n(&hook_on, 1, __ATOMIC_RELAXED);
    for (d.rep = 0; d.rep < 30; d.rep++) CHECK(run_proc(&desc, det_proc, &d) == 0);
    desc.algo = DPAR_ALGO_ONESHOT; /* one-shot through the node's shared block, then over messages: the ring's bits */
    for (; d.rep < 40; d.rep++) CHECK(run_proc(&desc, det_proc, &d) == 0);
    setenv("DPAR_MPI_SHM", "0", 1);
    for (; d.rep < 50; d.rep++) CHECK(run_proc(&desc, det_proc, &d) == 0);
    unsetenv("DPAR_MPI_SHM");
    __atomic_store_n(&hook_on, 0, __ATOMIC_RELAXED);
    /* every rank has the same bits */
    all = (float *)malloc(d.n * sizeof(float) * (size_t)nprocs);
    MPI_Allgather(d.first, (int)d.n, MPI_FLOAT, all, (int)d.n, MPI_FLOAT, MPI_COMM_WORLD);
    for (q = 1; q < nprocs; q++) CHECK(!memcmp(all, all + (size_t)q * d.n, d.n * sizeof(float)));
    free(all);
    free(d.first);
}

#define LEAVES 8
static void test_deterministic_mode_over_mpi(void)
{
    dpar_comm_desc desc;
    dpar_comm *c = NULL;
    size_t n = 10007;
    float *leaf[LEAVES], *out = (float *)malloc(n * sizeof(float)), *want = (float *)malloc(n * sizeof(float));
    int k, per;
    memset(&desc, 0, sizeof desc);
    desc.deterministic = 1;
    if (nprocs & (nprocs - 1)) {
        CHECK(dpar_comm_from_mpi(MPI_COMM_WORLD, &desc, &c) == DPAR_EUNSUPPORTED && c == NULL);
        free(out);
        free(want);
        return;
    }
    for (k = 0; k < LEAVES; k++) {
        leaf[k] = (float *)malloc(n * sizeof(float));
        random_floats(leaf[k], n, (unsigned)k + 100);
    }
    dpar_tree_reduce(want, (const void *const *)leaf, LEAVES, n, DPAR_F32, DPAR_SUM); /* one rank's answer */
    per = LEAVES / nprocs;
    c = world_comm(&desc);
    CHECK(c != NULL);
    if (c) {
        CHECK(dpar_tree_reduce(out, (const void *const *)(leaf + me * per), per, n, DPAR_F32, DPAR_SUM) == DPAR_OK);
        CHECK(dpar_allreduce(c, out, out, n, DPAR_F32, DPAR_SUM) == DPAR_OK);
        CHECK_MSG(!memcmp(out, want, n * sizeof(float)), "rank %d: not the bits of one rank", me);
        dpar_comm_destroy(c);
    }
    for (k = 0; k < LEAVES; k++) free(leaf[k]);
    free(out);
    free(want);
}

/* the contract checker across processes */
static void test_mismatch_timeout_abort_over_mpi(void)
{
    int kind;
    float x[2048], y[2048];
    memset(x, 0, sizeof x);
    for (kind = 0; kind < 5; kind++) {
        dpar_comm_desc d;
        dpar_comm *c;
        dpar_status st = DPAR_OK;
        uint64_t t0;
        double secs;
        const char *msg;
        memset(&d, 0, sizeof d);
        d.timeout_ms = kind == 1 ? 300 : 5000;
        c = world_comm(&d);
        if (!c) {
            CHECK(0);
            continue;
        }
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = dpar_time_ns();
        if (kind == 0) { /* count */
            st = dpar_allreduce(c, x, y, me == nprocs - 1 ? 1000 : 1024, DPAR_F32, DPAR_SUM);
        } else if (kind == 1) { /* the last rank is busy elsewhere past the timeout */
            if (me != nprocs - 1) st = dpar_allreduce(c, x, y, 100, DPAR_F32, DPAR_SUM);
            else usleep(1000000);
        } else if (kind == 3) { /* count, both small: the fingerprint travels with the data */
            st = dpar_allreduce(c, x, y, me == nprocs - 1 ? 10 : 12, DPAR_F32, DPAR_SUM);
        } else if (kind == 4) { /* a send of 10 received as 12 (ranks 0 and 1; the others look on) */
            if (me == 0) st = dpar_send(c, x, 10, DPAR_F32, 1, 3);
            else if (me == 1) st = dpar_recv(c, y, 12, DPAR_F32, 0, 3);
        } else { /* abort on rank 0 while the others wait for it */
            if (me == 0) {
                usleep(100000);
                st = dpar_comm_abort(c);
                st = dpar_barrier(c); /* the flag is spread by the next call */
            } else {
                st = dpar_allreduce(c, x, y, 100, DPAR_F32, DPAR_SUM);
            }
        }
        secs = (double)(dpar_time_ns() - t0) * 1e-9;
        msg = dpar_last_error();
        if (kind == 0) {
            CHECK_MSG(st == DPAR_EMISMATCH, "rank %d: %s (%s)", me, dpar_status_string(st), msg);
            CHECK_MSG(strstr(msg, "count=1000") && strstr(msg, "count=1024") && strstr(msg, "tests/test_mpi.c"), "%s",
                      msg);
            /* both calls' places: the peer's file name crossed (over a message, or the node's shared block) */
            CHECK_MSG(strstr(msg, "tests/test_mpi.c:") &&
                          strstr(strstr(msg, "tests/test_mpi.c:") + 1, "tests/test_mpi.c:"),
                      "%s", msg);
            if (me == 0) printf("    e.g. %s\n", msg);
        } else if (kind == 1 && me != nprocs - 1) {
            CHECK_MSG(st == DPAR_ETIMEDOUT, "rank %d: %s (%s)", me, dpar_status_string(st), msg);
            CHECK_MSG(strstr(msg, "timed out after 300 ms") && strstr(msg, "never arrived (it does not answer"), "%s",
                      msg);
            {
                char who[64];
                snprintf(who, sizeof who, "rank %d never arrived", nprocs - 1);
                CHECK_MSG(strstr(msg, who) != NULL, "%s", msg);
            }
            if (me == 0) printf("    e.g. %s\n", msg);
        } else if (kind == 3) {
            CHECK_MSG(st == DPAR_EMISMATCH, "rank %d: %s (%s)", me, dpar_status_string(st), msg);
            CHECK_MSG(strstr(msg, "count=10") && strstr(msg, "count=12"), "%s", msg);
        } else if (kind == 4 && me == 1) { /* the receiver sees it (the sender's message is eager: it is gone) */
            CHECK_MSG(st == DPAR_EMISMATCH, "rank %d: %s (%s)", me, dpar_status_string(st), msg);
            CHECK_MSG(strstr(msg, "count=10") && strstr(msg, "count=12"), "%s", msg);
        } else if (kind == 2) {
            CHECK_MSG(st == DPAR_EABORTED, "rank %d: %s (%s)", me, dpar_status_string(st), msg);
            CHECK_MSG(strstr(msg, "aborted by dpar_comm_abort (called on rank 0)"), "%s", msg);
        }
        CHECK_MSG(secs < 2.0, "rank %d took %.2f s", me, secs);
        if (kind == 1 && me == nprocs - 1) usleep(400000); /* the news has arrived */
        /* destroyed at once: the next kind's comm must not read this one's late messages (it did, before
           dpar__m_free kept a poisoned comm's MPI communicator: kind 1 returned kind 0's mismatch) */
        dpar_comm_destroy(c);
        MPI_Barrier(MPI_COMM_WORLD);
    }
}

/* fault injection over MPI (DPAR_FAULT's grammar through dpar_fault_set): a delay changes nothing but the time;
   a failed allreduce or receive, and a vanished rank, end in an error on every other process naming rank 1 and the
   operation, within twice the timeout (checked: the error's time); a vanished rank's error comes after the timeout.
   A watchdog thread ends the program if a case hangs: still running FAULT_SLACK_S past twice its timeout, counted
   from when its ranks met. The slack keeps a host that stalls the processes for a moment from reading as a hang
   (CI once had a case of this test still running at twice its timeout; the tightest then, a vanished rank, took
   1.3 s of 2); the message says which case and where in it the process was. */
#define FAULT_SLACK_S 5.0
static double fault_deadline, fault_began; /* 0: disarmed; -1: the watchdog ends. Under fault_lock */
static pthread_mutex_t fault_lock = PTHREAD_MUTEX_INITIALIZER;
static const char *fault_what = "a fault case over MPI"; /* what the watchdog's failure names */
static char fault_case[96];                              /* the case under way (fm_arm) */
static const char *fault_phase = "";                     /* where this process is in it (fault_at) */
static void *fault_watchdog(void *arg)
{
    (void)arg;
    for (;;) {
        double d, now;
        usleep(20000);
        pthread_mutex_lock(&fault_lock);
        d = fault_deadline, now = dt_now();
        if (d > 0 && now > d) {
            printf("FAIL %s: rank %d still running %.1f s after the case began (twice its timeout and %.0f s more), "
                   "a hang: %s, in %s\n",
                   fault_what, me, now - fault_began, FAULT_SLACK_S, fault_case, fault_phase);
            fflush(stdout);
            _exit(1);
        }
        pthread_mutex_unlock(&fault_lock);
        if (d < 0) return NULL;
    }
}
/* the watchdog: timeout_ms > 0, a case (named) begins now; 0, disarmed; -1, it ends */
static void fm_arm(int timeout_ms, const char *name)
{
    pthread_mutex_lock(&fault_lock);
    fault_began = dt_now();
    fault_deadline = timeout_ms > 0 ? fault_began + 2e-3 * timeout_ms + FAULT_SLACK_S : timeout_ms;
    snprintf(fault_case, sizeof fault_case, "%s", name ? name : "");
    fault_phase = "its calls";
    pthread_mutex_unlock(&fault_lock);
}
static void fault_at(const char *phase)
{
    pthread_mutex_lock(&fault_lock);
    fault_phase = phase;
    pthread_mutex_unlock(&fault_lock);
}
static void test_faults_over_mpi(void)
{
    static const char *const specs[4] = {"rank=1,op=allreduce,at=2,kind=delay:150",
                                         "rank=1,op=allreduce,at=2,kind=fail", "rank=1,op=allreduce,at=2,kind=vanish",
                                         "rank=1,op=recv,kind=fail"};
    /* the vanish case: a timeout waits up to 300 ms more for the processes' answers (dpar__m_survey); the
       vanished one never answers, so its story comes at 2.3 s, 1.7 s before twice the timeout */
    static const int timeouts[4] = {5000, 2000, 2000, 2000};
    pthread_t wd;
    int kind, i;
    fm_arm(0, NULL); /* (the test before ended its watchdog with -1) */
    pthread_create(&wd, NULL, fault_watchdog, NULL);
    for (kind = 0; kind < 4; kind++) {
        dpar_comm_desc d;
        dpar_comm *c;
        dpar_status st = DPAR_OK;
        float x[64], y[64];
        int step, err_step = 0;
        double t0, secs = 0, slow = 0;
        char msg[DPAR__ERROR_TEXT] = "";
        memset(&d, 0, sizeof d);
        d.timeout_ms = timeouts[kind];
        CHECK(dpar_fault_set(specs[kind]) == DPAR_OK);
        c = world_comm(&d);
        CHECK(dpar_fault_set(NULL) == DPAR_OK);
        if (!c) {
            CHECK(0);
            continue;
        }
        MPI_Barrier(MPI_COMM_WORLD);
        fm_arm(timeouts[kind], specs[kind]);
        t0 = dt_now();
        for (step = 1; step <= 3 && st == DPAR_OK; step++) {
            double ts = dt_now();
            if (kind < 3) {
                for (i = 0; i < 64; i++) x[i] = (float)(me + i + step);
                st = dpar_allreduce(c, x, y, 64, DPAR_F32, DPAR_SUM);
                for (i = 0; st == DPAR_OK && i < 64; i++) /* sum over q of q + i + step */
                    CHECK(y[i] == (float)(nprocs * (nprocs - 1) / 2 + nprocs * (i + step)));
            } else if (step == 1) { /* rank 0 sends to rank 1, whose receive fails; then everyone meets */
                for (i = 0; i < 64; i++) x[i] = (float)i;
                if (me == 0) st = dpar_send(c, x, 64, DPAR_F32, 1, 7);
                else if (me == 1) st = dpar_recv(c, y, 64, DPAR_F32, 0, 7);
            } else {
                st = dpar_barrier(c);
            }
            if (me == 1 && step == 2) slow = dt_now() - ts;
            if (st != DPAR_OK) {
                err_step = step;
                secs = dt_now() - t0;
                snprintf(msg, sizeof msg, "%s", dpar_last_error());
            }
        }
        if (kind == 0) {
            CHECK_MSG(st == DPAR_OK, "rank %d: %s", me, msg);
            if (me == 1) CHECK_MSG(slow >= 0.14, "the delayed allreduce took %.0f ms", 1e3 * slow);
        } else if (me == 1) {
            CHECK_MSG(st == (kind == 2 ? DPAR_ECANCELED : DPAR_EIO), "rank 1: %s", msg);
            if (kind == 2) CHECK(dpar_barrier(c) == DPAR_ECANCELED); /* still away */
        } else {
            const char *want = kind == 1
                                   ? "rank 1: injected fault (DPAR_FAULT \"rank=1,op=allreduce,at=2,kind=fail\"): "
                                     "its allreduce #2 failed"
                               : kind == 2 ? "rank 1 never arrived"
                                           : "rank 1: injected fault (DPAR_FAULT \"rank=1,op=recv,kind=fail\"): its "
                                             "recv #1 failed";
            CHECK_MSG(st != DPAR_OK && strstr(msg, want), "rank %d: %s (%s)", me, dpar_status_string(st), msg);
            if (kind == 2) { /* after the timeout, not before it (0.9: the ranks begin their calls a little apart) */
                CHECK_MSG(st == DPAR_ETIMEDOUT && strstr(msg, "allreduce"), "rank %d: %s", me, msg);
                CHECK_MSG(secs >= 0.9e-3 * timeouts[kind], "rank %d timed out after %.2f s", me, secs);
            }
            if (kind < 3) CHECK_MSG(err_step == 2, "rank %d: failed at call %d", me, err_step);
            CHECK_MSG(secs < 2e-3 * timeouts[kind], "rank %d took %.2f s", me, secs);
            if (me == 0 && kind == 2) printf("    e.g. %s\n", msg);
        }
        fault_at("dpar_comm_destroy");
        dpar_comm_destroy(c); /* at once, as in test_mismatch_timeout_abort_over_mpi */
        fault_at("MPI_Barrier after the case");
        MPI_Barrier(MPI_COMM_WORLD);
        fm_arm(0, NULL);
    }
    fm_arm(-1, NULL); /* the watchdog ends */
    pthread_join(wd, NULL);
}

/* ---- a receive that a failed call gave up on writes nothing after the call has returned ----
   Before, the receive stayed posted on the poisoned comm's MPI communicator (kept until MPI_Finalize), and a
   message that came later landed in memory the comm had freed: ASan saw a ring segment written into a freed
   staging buffer in test_faults_in_modules_over_mpi (3 processes, 1 run of test_mpi in 24). Here rank 0 is
   delayed 300 ms at its send (DPAR_FAULT); rank 1, waiting in dpar_recv for it, is aborted by a thread of its own
   after 50 ms and gives up; then rank 0 sends (it has not read the news yet). Once the comm is destroyed and
   MPI_Barrier has brought rank 0's message in, the buffers the comm freed (kept by the test's allocator, filled
   with a pattern) must still hold the pattern (before: the message's first 2 KiB and its fingerprint, 2113 bytes,
   in the fingerprint buffer, on 2 processes; with more, rank 0 reads the news before it sends), and so must the
   user's buffer. */
#define GY_MAX 64
static struct {
    unsigned char *p;
    size_t n;
} gy[GY_MAX];
static int gy_n;
static pthread_mutex_t gy_lock = PTHREAD_MUTEX_INITIALIZER;
static void *gy_alloc(void *user, size_t size)
{
    size_t *p = (size_t *)malloc(size + 16);
    (void)user;
    if (!p) return NULL;
    p[0] = size;
    return (char *)p + 16;
}
static void gy_free(void *user, void *ptr) /* kept, filled with 0xA5, until gy_check */
{
    size_t n;
    (void)user;
    if (!ptr) return;
    memcpy(&n, (char *)ptr - 16, sizeof n);
    memset(ptr, 0xA5, n);
    pthread_mutex_lock(&gy_lock);
    if (gy_n < GY_MAX) gy[gy_n].p = (unsigned char *)ptr, gy[gy_n++].n = n;
    else free((char *)ptr - 16);
    pthread_mutex_unlock(&gy_lock);
}
static size_t gy_check(void) /* bytes written after they were freed; the blocks are freed now */
{
    size_t bad = 0, i;
    int k;
    pthread_mutex_lock(&gy_lock);
    for (k = 0; k < gy_n; k++) {
        for (i = 0; i < gy[k].n; i++) bad += gy[k].p[i] != 0xA5;
        free(gy[k].p - 16);
    }
    gy_n = 0;
    pthread_mutex_unlock(&gy_lock);
    return bad;
}
static void *abort_later(void *arg)
{
    usleep(50000);
    dpar_comm_abort((dpar_comm *)arg);
    return NULL;
}
static void test_given_up_receives_write_nothing_later(void)
{
    enum { N = 4096 };
    static float x[N], y[N];
    dpar_comm_desc d;
    dpar_comm *c;
    dpar_status st = DPAR_OK;
    pthread_t th;
    size_t after = 0;
    int i;
    if (nprocs < 2) SKIP("needs 2 processes or more");
    memset(&d, 0, sizeof d);
    d.timeout_ms = 5000;
    d.allocator.alloc = gy_alloc, d.allocator.free = gy_free;
    CHECK(dpar_fault_set("rank=0,op=send,at=1,kind=delay:300") == DPAR_OK);
    c = world_comm(&d);
    CHECK(dpar_fault_set(NULL) == DPAR_OK);
    if (!c) {
        CHECK(0);
        return;
    }
    for (i = 0; i < N; i++) x[i] = (float)(me + 1), y[i] = -1.0f;
    MPI_Barrier(MPI_COMM_WORLD);
    if (me == 0) {
        st = dpar_send(c, x, N, DPAR_F32, 1, 5);
    } else if (me == 1) {
        pthread_create(&th, NULL, abort_later, c);
        st = dpar_recv(c, y, N, DPAR_F32, 0, 5);
        pthread_join(th, NULL);
        CHECK_MSG(st == DPAR_EABORTED, "rank 1: %s (%s)", dpar_status_string(st), dpar_last_error());
    }
    for (i = 0; i < N; i++) y[i] = -2.0f; /* the call has returned: the buffer is the caller's again */
    dpar_comm_destroy(c);
    MPI_Barrier(MPI_COMM_WORLD); /* rank 0's message is in before its barrier message */
    MPI_Barrier(MPI_COMM_WORLD);
    for (i = 0; i < N; i++) after += y[i] != -2.0f;
    CHECK_MSG(after == 0, "rank %d: %zu values of the user's buffer written after dpar_recv returned", me, after);
    after = gy_check();
    CHECK_MSG(after == 0, "rank %d: %zu bytes of the comm's freed memory written after destroy", me, after);
}

/* faults in the modules over MPI: gradient buckets (the update on the progress thread), the pipeline runner, and
   comms of processes x threads (hybrid). Each case: 4 steps, every result before the fault checked against a
   closed form; then the faulty rank gets its own status and every other rank an error naming it (and the operation
   for a failure) within 2 x the timeout, under the watchdog above. */
enum { FM_ALLREDUCE, FM_BUCKET, FM_STAGE };
#define FM_COUNT 4096 /* 4 buckets of 1024 floats */
#define FM_MICRO 4
typedef struct fm_case {
    int module, F, vanish, timeout_ms;
    const char *spec, *op; /* the fault; the operation a failure's message names */
    int unnamed; /* 1 (a vanished rank of a hybrid comm): every survivor's error is one inner comm's timeout, told once
                    with the world ranks of the ranks it names, the vanished one among them; 0, every survivor's
                    names the faulty rank */
} fm_case;
typedef struct fm_rank {
    const fm_case *fc;
    int r, N;
    float x[64], y[64], grads[FM_COUNT], params[FM_COUNT];
    double got; /* pipeline: what the first and last stage add up */
    dpar_status st;
    int err_step, wrong;
    double secs;
    char msg[DPAR__ERROR_TEXT];
} fm_rank;
static void fm_update(void *user, size_t offset, size_t count)
{
    fm_rank *f = (fm_rank *)user;
    size_t i;
    for (i = offset; i < offset + count; i++) f->params[i] -= f->grads[i];
}
static dpar_status fm_fwd(void *user, int micro, int chunk, const void *in, void *out)
{
    fm_rank *f = (fm_rank *)user;
    float v = in ? *(const float *)in : (float)micro;
    (void)chunk;
    if (out) *(float *)out = v + 1.0f;
    else f->got += v;
    return DPAR_OK;
}
static dpar_status fm_bwd(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    fm_rank *f = (fm_rank *)user;
    float g = grad_out ? *(const float *)grad_out : 1.0f;
    (void)micro, (void)chunk, (void)in;
    if (grad_in) *(float *)grad_in = 2.0f * g;
    else f->got += g;
    return DPAR_OK;
}
/* rank f->r of f->N runs the case's 4 steps on c (made with the fault scheduled) and notes its first error */
static void fm_run(fm_rank *f, dpar_comm *c)
{
    const fm_case *fc = f->fc;
    dpar_buckets *b = NULL;
    dpar_pipe_schedule *S = NULL;
    dpar_pipe *pp = NULL;
    dpar_status st = DPAR_OK;
    int step, i, N = f->N, r = f->r;
    double t0;
    if (fc->module == FM_BUCKET) {
        dpar_buckets_desc bd;
        memset(&bd, 0, sizeof bd);
        bd.comm = c, bd.grads = f->grads, bd.count = FM_COUNT, bd.bucket_bytes = FM_COUNT, bd.op = DPAR_AVG;
        for (i = 0; i < FM_COUNT; i++) f->params[i] = (float)(i % 5);
        if ((st = dpar_buckets_create(&bd, &b)) == DPAR_OK) st = dpar_buckets_set_update(b, f->params, fm_update, f);
    } else if (fc->module == FM_STAGE) {
        dpar_pipe_schedule_desc sd;
        dpar_pipe_desc pd;
        memset(&sd, 0, sizeof sd);
        memset(&pd, 0, sizeof pd);
        sd.p = N, sd.m = FM_MICRO;
        if ((st = dpar_pipe_schedule_create(&sd, &S)) == DPAR_OK) {
            pd.schedule = S, pd.comm = c, pd.act_bytes = sizeof(float), pd.forward = fm_fwd, pd.backward = fm_bwd;
            pd.user = f;
            st = dpar_pipe_create(&pd, &pp);
        }
    }
    if (st != DPAR_OK) f->wrong += 1000; /* the setup failed */
    t0 = dt_now();
    for (step = 0; step < 4 && st == DPAR_OK; step++) {
        if (fc->module == FM_ALLREDUCE) {
            for (i = 0; i < 64; i++) f->x[i] = (float)(r + i + step);
            st = dpar_allreduce(c, f->x, f->y, 64, DPAR_F32, DPAR_SUM);
            for (i = 0; st == DPAR_OK && i < 64; i++) /* sum over q of q + i + step */
                f->wrong += f->y[i] != (float)(N * (N - 1) / 2 + N * (i + step));
        } else if (fc->module == FM_BUCKET) { /* params -= the mean of (q + 1) x (i % 7) over the ranks q */
            for (i = 0; i < FM_COUNT; i++) f->grads[i] = (float)((r + 1) * (i % 7));
            st = dpar_buckets_ready(b, 0, FM_COUNT);
            if (st == DPAR_OK) st = dpar_buckets_wait(b);
            for (i = 0; st == DPAR_OK && i < FM_COUNT; i++)
                f->wrong += f->params[i] != (float)(i % 5) - (float)(step + 1) * 0.5f * (float)(N + 1) * (float)(i % 7);
        } else { /* last stage: the sum of micro + p - 1; first stage: m x 2^(p-1) */
            double want = r == N - 1 ? FM_MICRO * (FM_MICRO - 1) / 2.0 + FM_MICRO * (N - 1)
                                     : (r == 0 ? FM_MICRO * (double)(1 << (N - 1)) : 0.0);
            f->got = 0;
            st = dpar_pipe_run(pp, NULL);
            if (st == DPAR_OK && (r == 0 || r == N - 1)) f->wrong += f->got != want;
        }
        if (st != DPAR_OK && !f->err_step) {
            f->st = st, f->err_step = step + 1, f->secs = dt_now() - t0;
            snprintf(f->msg, sizeof f->msg, "%s", dpar_last_error());
        }
    }
    dpar_pipe_destroy(pp);
    dpar_pipe_schedule_destroy(S);
    dpar_buckets_destroy(b);
}
/* what rank f->r must have seen */
static fm_case hy_case; /* test_hybrid_faults's case */
static void fm_check(const fm_rank *f, const char *where)
{
    const fm_case *fc = f->fc;
    char name[32], fault[160];
    snprintf(name, sizeof name, "rank %d never arrived", fc->F);
    snprintf(fault, sizeof fault, "rank %d: injected fault (DPAR_FAULT \"%s\"): its %s", fc->F, fc->spec, fc->op);
    CHECK_MSG(f->wrong == 0, "%s: %s: %d wrong results before the fault", where, fc->spec, f->wrong);
    /* (a hybrid comm's allreduce ends in three barriers of the process's threads: a poison that comes while a thread
       is still in the last one of the step before ends that call with the error; its results were checked) */
    CHECK_MSG(f->err_step >= (fc == &hy_case && fc->unnamed == 0 ? 1 : 2),
              "%s: %s: the error came at step %d, not after the first", where, fc->spec, f->err_step);
    if (f->r == fc->F) {
        dpar_status want = fc->vanish ? DPAR_ECANCELED : fc->module == FM_ALLREDUCE ? DPAR_EIO : DPAR_EUSER;
        CHECK_MSG(f->st == want, "%s (the faulty rank): %s: %s (%s)", where, fc->spec, dpar_status_string(f->st),
                  f->msg);
    } else if (fc->unnamed == 1) {
        /* hybrid, a vanished rank: the threads of its own process time out first (the leaders' comm waits a quarter
           longer, the threads that wait for their leader longer still) and tell every rank their story once, with
           the world rank of each rank it names: the vanished one among them, as the one that never arrived */
        const char *w = strstr(f->msg, " (process "),
                   *g = w ? strstr(w, "), in its process's threads, where rank k is world rank k + ") : NULL;
        int P = -1, th = -1, base = -1, X, named = 0;
        if (w) sscanf(w, " (process %d, thread %d)", &P, &th);
        if (g) sscanf(strstr(g, "k + ") + 4, "%d", &base);
        for (X = 0; X < hybrid_threads; X++) {
            char a[64], b[64];
            snprintf(a, sizeof a, "rank %d is world rank %d", X, fc->F);
            snprintf(b, sizeof b, "; rank %d never arrived", X);
            named |= strstr(f->msg, a) && strstr(f->msg, b);
        }
        CHECK_MSG(f->st == DPAR_ETIMEDOUT && named && P == fc->F / hybrid_threads && base == P * hybrid_threads &&
                      !strstr(strstr(f->msg, "where rank k") + 1, "where rank k"),
                  "%s: %s: %s (%s)", where, fc->spec, dpar_status_string(f->st), f->msg);
    } else if (fc->vanish) {
        CHECK_MSG(f->st == DPAR_ETIMEDOUT && strstr(f->msg, name), "%s: %s: %s (%s)", where, fc->spec,
                  dpar_status_string(f->st), f->msg);
    } else {
        CHECK_MSG(f->st != DPAR_OK && strstr(f->msg, fault), "%s: %s: %s (%s)", where, fc->spec,
                  dpar_status_string(f->st), f->msg);
    }
    CHECK_MSG(f->secs < 2e-3 * fc->timeout_ms, "%s: %s: the error took %.2f s", where, fc->spec, f->secs);
    if (fc->vanish && f->r != fc->F) /* a timeout: not before it (0.9: the ranks begin their calls a little apart) */
        CHECK_MSG(f->secs >= 0.9e-3 * fc->timeout_ms, "%s: %s: timed out after %.2f s", where, fc->spec, f->secs);
    if (getenv("DPAR_TEST_VERBOSE")) printf("    %s: %s: %s: %s\n", where, fc->spec, dpar_status_string(f->st), f->msg);
}
static void test_faults_in_modules_over_mpi(void)
{
    /* buckets: 4 updates per step on each rank, so #6 is in the second step; a pipeline stage: 8 callbacks a step */
    static const fm_case cases[4] = {{FM_BUCKET, 1, 0, 2000, "rank=1,op=bucket,at=6,kind=fail", "bucket #6 failed", 0},
                                     {FM_BUCKET, 1, 1, 2000, "rank=1,op=bucket,at=6,kind=vanish", "", 0},
                                     {FM_STAGE, 1, 0, 2000, "rank=1,op=stage,at=10,kind=fail", "stage #10 failed", 0},
                                     {FM_STAGE, 1, 1, 2000, "rank=1,op=stage,at=10,kind=vanish", "", 0}};
    static fm_rank f;
    dpar_comm *c;
    pthread_t wd;
    int k;
    if (nprocs < 2) SKIP("needs 2 processes or more");
    fm_arm(0, NULL);
    pthread_create(&wd, NULL, fault_watchdog, NULL);
    for (k = 0; k < 4; k++) {
        dpar_comm_desc d;
        char where[32];
        memset(&d, 0, sizeof d);
        memset(&f, 0, sizeof f);
        d.timeout_ms = cases[k].timeout_ms;
        f.fc = &cases[k], f.r = me, f.N = nprocs;
        CHECK(dpar_fault_set(cases[k].spec) == DPAR_OK);
        c = world_comm(&d);
        CHECK(dpar_fault_set(NULL) == DPAR_OK);
        if (!c) continue;
        MPI_Barrier(MPI_COMM_WORLD);
        fm_arm(cases[k].timeout_ms, cases[k].spec);
        fm_run(&f, c);
        snprintf(where, sizeof where, "rank %d", me);
        fm_check(&f, where);
        fault_at("dpar_comm_destroy");
        dpar_comm_destroy(c); /* at once, as in test_faults_over_mpi */
        fault_at("MPI_Barrier after the case");
        MPI_Barrier(MPI_COMM_WORLD);
        fm_arm(0, NULL);
    }
    fm_arm(-1, NULL); /* the watchdog ends */
    pthread_join(wd, NULL);
}

/* hybrid: T threads per process. The faulty rank is the last (N - 1: the last thread of the last process, beside
   the other threads of its process), the leader of the last process (thread 0, waited for by the other processes'
   leaders), or rank 1 (thread 1 of process 0, whose number the process's thread group also has: DPAR_FAULT's ranks
   are the hybrid comm's alone, so the group's own calls must not fail). A failure reaches every rank by name; a
   vanished rank is first noticed by the threads of its own process, whose story every survivor gets with the world
   ranks of the ranks it names. */
static fm_rank hy_ranks[8];
static dpar_comm *hy_keep[5][8];
static int hy_k;
static dpar_status hy_thread(void *user, int t, int T)
{
    dpar_group *local = (dpar_group *)user;
    dpar_comm *c = NULL;
    fm_rank *f = &hy_ranks[t];
    (void)T;
    memset(f, 0, sizeof *f);
    f->fc = &hy_case;
    if (dpar_group_join_mpi(local, t, MPI_COMM_WORLD, &c) != DPAR_OK) {
        f->wrong = 1000;
        snprintf(f->msg, sizeof f->msg, "%s", dpar_last_error());
        return DPAR_OK;
    }
    f->r = dpar_comm_rank(c), f->N = dpar_comm_size(c);
    fm_run(f, c);
    hy_keep[hy_k][t] = c;
    return DPAR_OK;
}
static void test_hybrid_faults(void)
{
    int T = hybrid_threads, k, t, F = nprocs * hybrid_threads - 1, L = (nprocs - 1) * hybrid_threads;
    fm_case cases[5] = {{FM_ALLREDUCE, 0, 0, 1000, NULL, "allreduce #2 failed", 0},
                        {FM_ALLREDUCE, 0, 1, 2000, NULL, "", 1},
                        {FM_BUCKET, 0, 0, 2000, NULL, "bucket #6 failed", 0},
                        {FM_ALLREDUCE, 0, 0, 1000, NULL, "allreduce #2 failed", 0},
                        {FM_ALLREDUCE, 0, 1, 2000, NULL, "", 1}};
    char specs[5][64];
    pthread_t wd;
    if (nprocs < 2 || T < 2 || T > 8) SKIP("needs 2 processes or more of 2 to 8 threads");
    snprintf(specs[0], sizeof specs[0], "rank=%d,op=allreduce,at=2,kind=fail", F);
    snprintf(specs[1], sizeof specs[1], "rank=%d,op=allreduce,at=2,kind=vanish", F);
    snprintf(specs[2], sizeof specs[2], "rank=%d,op=bucket,at=6,kind=fail", F);
    snprintf(specs[3], sizeof specs[3], "rank=1,op=allreduce,at=2,kind=fail");
    snprintf(specs[4], sizeof specs[4], "rank=%d,op=allreduce,at=2,kind=vanish", L);
    for (k = 0; k < 5; k++) cases[k].F = k == 3 ? 1 : k == 4 ? L : F, cases[k].spec = specs[k];
    memset(hy_keep, 0, sizeof hy_keep);
    fm_arm(0, NULL);
    pthread_create(&wd, NULL, fault_watchdog, NULL);
    for (k = 0; k < 5; k++) {
        dpar_pool *pool = NULL;
        dpar_pool_desc pd;
        dpar_group *local = NULL;
        dpar_comm_desc d;
        memset(&pd, 0, sizeof pd);
        memset(&d, 0, sizeof d);
        pd.num_threads = d.size = T;
        d.timeout_ms = cases[k].timeout_ms;
        hy_case = cases[k], hy_k = k;
        CHECK(dpar_fault_set(cases[k].spec) == DPAR_OK);
        if (dpar_pool_create(&pd, &pool) != DPAR_OK || dpar_group_create(&d, &local) != DPAR_OK) {
            CHECK_MSG(0, "%s", dpar_last_error());
            dpar_pool_destroy(pool);
            continue;
        }
        MPI_Barrier(MPI_COMM_WORLD);
        fm_arm(cases[k].timeout_ms, specs[k]);
        dpar_pool_run(pool, hy_thread, local);
        CHECK(dpar_fault_set(NULL) == DPAR_OK);
        for (t = 0; t < T; t++) {
            char where[48];
            snprintf(where, sizeof where, "process %d thread %d (rank %d)", me, t, hy_ranks[t].r);
            fm_check(&hy_ranks[t], where);
        }
        fault_at("MPI_Barrier after the case");
        MPI_Barrier(MPI_COMM_WORLD);
        fm_arm(0, NULL);
        for (t = 0; t < T; t++) dpar_comm_destroy(hy_keep[k][t]); /* the group outlives its comms */
        dpar_group_destroy(local);
        dpar_pool_destroy(pool);
    }
    fm_arm(-1, NULL);
    pthread_join(wd, NULL);
}

/* async requests, split and mesh */
static void async_proc(world *w, dpar_comm *c, int r)
{
    size_t n = 100003, i;
    int N = w->n, k;
    float *g[3], *o[3];
    dpar_request *req[3];
    for (k = 0; k < 3; k++) {
        g[k] = (float *)malloc(n * sizeof(float));
        o[k] = (float *)malloc(n * sizeof(float));
        for (i = 0; i < n; i++) g[k][i] = (float)(r + k + (int)(i % 5));
        expect_ok(w, dpar_iallreduce(c, g[k], o[k], n, DPAR_F32, DPAR_SUM, &req[k]), "iallreduce", r);
    }
    for (k = 0; k < 3; k++) {
        expect_ok(w, dpar_request_wait(req[k]), "wait", r);
        for (i = 0; i < n; i += 97)
            if (o[k][i] != (float)(N * (N - 1) / 2 + N * (k + (int)(i % 5))))
                note(w, "iallreduce %d wrong on %d", k, r);
        free(g[k]);
        free(o[k]);
    }
}

static void mesh_proc(world *w, dpar_comm *c, int r)
{
    dpar_mesh m;
    dpar_mesh_desc md = {0};
    dpar_comm *half = NULL;
    int64_t v = r, want = 0;
    int q, dp = w->n % 2 == 0 ? 2 : w->n, tp = w->n % 2 == 0 ? w->n / 2 : 1;
    expect_ok(w, dpar_comm_split(c, r % 2, r, &half), "split", r);
    for (q = r % 2; q < w->n; q += 2) want += q;
    if (half) {
        expect_ok(w, dpar_allreduce(half, &v, &v, 1, DPAR_I64, DPAR_SUM), "allreduce on split", r);
        if (v != want) note(w, "split sum on %d: %lld", r, (long long)v);
        dpar_comm_destroy(half);
    }
    md.world = c, md.dp = dp, md.tp = tp; /* pp 0: 1 */
    expect_ok(w, dpar_mesh_init(&m, &md), "mesh", r);
    if (m.tp_rank != r % tp || m.dp_rank != r / tp || dpar_comm_size(m.dp_comm) != dp)
        note(w, "mesh coordinates of %d", r);
    {
        dpar_comm_desc dw, dt;
        dpar_comm_query(c, &dw), dpar_comm_query(m.tp_comm, &dt);
        if (strncmp(dt.name, dw.name, strlen(dw.name)) || strcmp(dt.name + strlen(dw.name), ".tp"))
            note(w, "tp comm of %d is named '%s' (world '%s')", r, dt.name, dw.name);
    }
    v = r;
    expect_ok(w, dpar_allreduce(m.tp_comm, &v, &v, 1, DPAR_I64, DPAR_SUM), "tp allreduce", r);
    for (want = 0, q = (r / tp) * tp; q < (r / tp + 1) * tp; q++) want += q;
    if (v != want) note(w, "tp sum on %d: %lld != %lld", r, (long long)v, (long long)want);
    dpar_mesh_destroy(&m);
}

/* gradient buckets that update the parameters (reduce-scatter, update, all-gather on the progress
   thread) against the full update with the gradients summed here; integer gradients, so the sums are
   exact */
static void sgd_half(void *user, size_t offset, size_t count)
{
    float **pg = (float **)user;
    size_t q;
    for (q = offset; q < offset + count; q++) pg[0][q] -= 0.5f * pg[1][q];
}

static void buckets_proc(world *w, dpar_comm *c, int r)
{
    size_t n = 100003, i;
    float *g = (float *)malloc(n * sizeof(float)), *p = (float *)malloc(n * sizeof(float));
    float *rp = (float *)malloc(n * sizeof(float)), *pg[2];
    dpar_buckets *b = NULL;
    dpar_buckets_desc bd = {0};
    pg[0] = p, pg[1] = g;
    for (i = 0; i < n; i++) g[i] = (float)((r * 13 + (int)i) % 32), p[i] = rp[i] = (float)(i % 100);
    bd.comm = c, bd.grads = g, bd.count = n, bd.bucket_bytes = 40000, bd.op = DPAR_SUM;
    expect_ok(w, dpar_buckets_create(&bd, &b), "buckets_create", r);
    expect_ok(w, dpar_buckets_set_update(b, p, sgd_half, pg), "buckets_set_update", r);
    if (dpar_buckets_set_direct(b, 1) != DPAR_EUNSUPPORTED || !strstr(dpar_last_error(), "thread ranks"))
        note(w, "rank %d: direct buckets over MPI processes accepted: %s", r, dpar_last_error());
    {
        dpar_steal *s = NULL; /* work stealing runs tasks on other ranks' threads: not across processes */
        dpar_steal_desc sd = {0};
        sd.comm = c, sd.max_tasks = 4;
        if (dpar_steal_create(&sd, &s) != DPAR_EUNSUPPORTED || s || !strstr(dpar_last_error(), "thread ranks"))
            note(w, "rank %d: work stealing over MPI processes accepted: %s", r, dpar_last_error());
    }
    for (i = 0; i < n; i++) { /* the reference, here: the sum over the ranks is exact */
        int q, sum = 0;
        for (q = 0; q < w->n; q++) sum += (q * 13 + (int)i) % 32;
        rp[i] -= 0.5f * (float)sum;
    }
    expect_ok(w, dpar_buckets_ready(b, n / 2, n - n / 2), "buckets_ready", r);
    /* the buckets of that half alone (10000 floats each: the one holding n / 2 is not full yet) */
    if (dpar_buckets_wait_range(b, n / 2, 10) != DPAR_EINVAL) note(w, "rank %d: wait_range on a bucket not full", r);
    expect_ok(w, dpar_buckets_wait_range(b, 60000, n - 60000), "buckets_wait_range", r);
    if (memcmp(p + 60000, rp + 60000, (n - 60000) * sizeof(float))) note(w, "rank %d: wait_range returned early", r);
    expect_ok(w, dpar_buckets_ready(b, 0, n / 2), "buckets_ready", r);
    expect_ok(w, dpar_buckets_wait(b), "buckets_wait", r);
    for (i = 0; i < n && p[i] == rp[i]; i++) {}
    if (i < n) note(w, "rank %d: buckets' update differs from the summed gradients' step at %zu", r, i);
    dpar_buckets_destroy(b);
    free(g), free(p), free(rp);
}

/* ZeRO-2 and ZeRO-3 across processes: bitwise plain data parallelism after every step (tests/fsdp_case.h) */
static void test_fsdp_over_mpi(void)
{
    int stage, kind;
    for (stage = 2; stage <= 3; stage++)
        for (kind = 0; kind < 2; kind++) {
            fsdp_case k;
            memset(&k, 0, sizeof k);
            k.stage = stage;
            k.kind = (dpar_optim)kind;
            k.release_first = kind; /* both backward orders: SGD takes the gradients first, Adam releases first */
            CHECK_MSG(run_proc(NULL, fsdp_rank, &k) == 0, "stage %d %s over %d processes", stage, kind ? "adam" : "sgd",
                      nprocs);
        }
}

/* the tensor form across processes: buckets, ZeRO-1 and FSDP (f32 and 16-bit) over separate arrays, bitwise the flat
   form (tests/tensors_case.h) */
static void test_tensors_over_mpi(void)
{
    int stage, kind;
    tjob j;
    fjob f;
    memset(&j, 0, sizeof j);
    j.steps = 2;
    CHECK_MSG(run_proc(NULL, buckets_rank, &j) == 0, "buckets over %d processes", nprocs);
    CHECK_MSG(run_proc(NULL, buckets_update_rank, &j) == 0, "buckets of tensors with an update over %d processes",
              nprocs);
    for (kind = 0; kind < 2; kind++) {
        j.kind = (dpar_optim)kind;
        CHECK_MSG(run_proc(NULL, zero_rank, &j) == 0, "ZeRO-1 %s over %d processes", kind ? "adam" : "sgd", nprocs);
        for (stage = 2; stage <= 3; stage++) {
            f.stage = stage, f.kind = (dpar_optim)kind;
            CHECK_MSG(run_proc(NULL, fsdp_tensor_rank, &f) == 0, "fsdp stage %d %s over %d processes", stage,
                      kind ? "adam" : "sgd", nprocs);
        }
    }
    for (stage = 2; stage <= 3; stage++) { /* 16-bit compute: bf16 reduced in f32, f16 in f16 (an inf skipped) */
        f16job h;
        h.stage = stage, h.compute = DPAR_BF16, h.reduce = DPAR_F32, h.kind = DPAR_OPTIM_ADAM, h.loss_scale = 0;
        h.inject = -1;
        CHECK_MSG(run_proc(NULL, fsdp16_tensor_rank, &h) == 0, "fsdp bf16 stage %d over %d processes", stage, nprocs);
        h.compute = h.reduce = DPAR_F16, h.kind = DPAR_OPTIM_SGD, h.loss_scale = 1024, h.inject = 3;
        CHECK_MSG(run_proc(NULL, fsdp16_tensor_rank, &h) == 0, "fsdp f16 stage %d over %d processes", stage, nprocs);
    }
}
/* checkpoints that reshard across processes (tests/ckpt_case.h): saved by every process as a tp x dp mesh, loaded by
   a split comm of another size (the first N - 1 processes with tp = N - 1, the last alone) and by the whole world
   with another tp; every element bitwise its formula. The processes share the directory, as a cluster's file system. */
static void ckpt_proc(world *w, dpar_comm *c, int r)
{
    char path[256];
    dpar_ckpt_item items[CC_T];
    void *bufs[CC_T];
    dpar_comm *part = NULL;
    int k, n = w->n, tp = n % 2 == 0 ? 2 : 1, mine, size;
    size_t bad;
    memset(path, 0, sizeof path);
    if (r == 0) {
        char dir[] = "/tmp/dpar_mpi_ckpt_XXXXXX";
        if (!mkdtemp(dir)) note(w, "mkdtemp failed");
        snprintf(path, sizeof path, "%s/mesh", dir);
    }
    expect_ok(w, dpar_broadcast(c, path, path, sizeof path, DPAR_U8, 0), "broadcast path", r);
    k = cc_items(tp, 1, n, r, 1, items, bufs);
    expect_ok(w, dpar_ckpt_save(c, path, items, k), "save", r);
    cc_free(bufs, k);
    /* the whole world, tp 1 (or n when it was 1) */
    k = cc_items(tp == 1 ? n : 1, 1, n, r, 0, items, bufs);
    expect_ok(w, dpar_ckpt_load(c, path, items, k), "load (world)", r);
    if ((bad = cc_wrong(items, k)) != 0) note(w, "rank %d, world load: %zu elements differ", r, bad);
    cc_free(bufs, k);
    /* a split comm of n - 1 processes (tp n - 1) and one of 1 */
    expect_ok(w, dpar_comm_split(c, r == n - 1, r, &part), "split", r);
    if (part) {
        mine = dpar_comm_rank(part), size = dpar_comm_size(part);
        k = cc_items(size, 1, size, mine, 0, items, bufs);
        expect_ok(w, dpar_ckpt_load(part, path, items, k), "load (split)", r);
        if ((bad = cc_wrong(items, k)) != 0) note(w, "rank %d of %d, split load: %zu elements differ", mine, size, bad);
        cc_free(bufs, k);
        dpar_comm_destroy(part);
    }
    dpar_barrier(c);
    if (r == 0) {
        char cmd[400];
        *strrchr(path, '/') = 0;
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
        if (system(cmd) != 0) note(w, "cannot remove %s", path);
    }
}
static void test_ckpt_reshard_over_mpi(void) { CHECK(run_proc(NULL, ckpt_proc, NULL) == 0); }

/* dpar_fsdp (stage 3, Adam) trained 2 steps by every process and saved; loaded by a split comm of the first N - 1
   processes and by the last alone: the parameters bitwise those saved */
static void fsdp_ckpt_proc(world *w, dpar_comm *c, int r)
{
    char path[256];
    dpar_fsdp *f = NULL, *g = NULL;
    dpar_fsdp_desc d;
    dpar_comm *part = NULL;
    float *want[FC_U];
    int u, step;
    size_t i;
    memset(path, 0, sizeof path);
    if (r == 0) {
        char dir[] = "/tmp/dpar_mpi_fsdp_XXXXXX";
        if (!mkdtemp(dir)) note(w, "mkdtemp failed");
        snprintf(path, sizeof path, "%s/fsdp", dir);
    }
    expect_ok(w, dpar_broadcast(c, path, path, sizeof path, DPAR_U8, 0), "broadcast path", r);
    memset(&d, 0, sizeof d);
    d.comm = c, d.stage = 3, d.num_units = FC_U, d.unit_counts = fc_counts, d.kind = DPAR_OPTIM_ADAM, d.lr = 0.05f;
    expect_ok(w, dpar_fsdp_create(&d, &f), "fsdp_create", r);
    if (!f) return;
    for (u = 0; u < FC_U; u++) {
        want[u] = (float *)malloc(fc_counts[u] * 4);
        for (i = 0; i < fc_counts[u]; i++) want[u][i] = fc_init(u, i);
        expect_ok(w, dpar_fsdp_set_params(f, u, want[u]), "set_params", r);
    }
    for (step = 0; step < 2; step++) {
        fc_fsdp_train_step(w, f, r, step);
    }
    expect_ok(w, dpar_ckpt_save_fsdp(f, path, NULL, NULL, 0), "save_fsdp", r);
    for (u = 0; u < FC_U; u++) expect_ok(w, dpar_fsdp_get_params(f, u, want[u]), "get_params", r);
    expect_ok(w, dpar_comm_split(c, r == w->n - 1, r, &part), "split", r);
    if (part) {
        d.comm = part;
        expect_ok(w, dpar_fsdp_create(&d, &g), "fsdp_create (split)", r);
        expect_ok(w, dpar_ckpt_load_fsdp(g, path, NULL, NULL, 0), "load_fsdp (split)", r);
        for (u = 0; g && u < FC_U; u++) {
            float *got = (float *)malloc(fc_counts[u] * 4);
            expect_ok(w, dpar_fsdp_get_params(g, u, got), "get_params (split)", r);
            if (memcmp(got, want[u], fc_counts[u] * 4))
                note(w, "rank %d of %d: unit %d differs after the load", dpar_comm_rank(part), dpar_comm_size(part), u);
            free(got);
        }
        dpar_fsdp_destroy(g);
        dpar_comm_destroy(part);
    }
    dpar_fsdp_destroy(f);
    for (u = 0; u < FC_U; u++) free(want[u]);
    dpar_barrier(c);
    if (r == 0) {
        char cmd[400];
        *strrchr(path, '/') = 0;
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
        if (system(cmd) != 0) note(w, "cannot remove %s", path);
    }
}
static void test_fsdp_ckpt_reshard_over_mpi(void) { CHECK(run_proc(NULL, fsdp_ckpt_proc, NULL) == 0); }

static void test_async_split_mesh_over_mpi(void)
{
    CHECK(run_proc(NULL, async_proc, NULL) == 0);
    CHECK(run_proc(NULL, buckets_proc, NULL) == 0);
    CHECK(run_proc(NULL, mesh_proc, NULL) == 0);
}

/* ---- a pipeline over processes: the MLP through np stages against sequential training ---- */
static void test_pipeline_over_mpi(void)
{
    static pm_data d;
    static pm_stage st;
    static const dpar_pipe_kind kinds[] = {DPAR_PIPE_1F1B, DPAR_PIPE_GPIPE, DPAR_PIPE_ZB_H1, DPAR_PIPE_ZBV,
                                           DPAR_PIPE_DUALPIPEV};
    static const char *names[] = {"1f1b", "gpipe", "zb-h1", "zbv", "dualpipev"};
    /* every layer after 1F1B, and after the schedule at hand: each rank writes its own (every chunk's), the others
       stay 0, and a bitwise OR over the processes gives every rank the whole model, bit for bit */
    static int32_t bits[2][PM_LAYERS][PM_WIDTH * PM_WIDTH + PM_WIDTH];
    dpar_linear ref[PM_LAYERS];
    int kind, l;
    if (2 * nprocs > PM_LAYERS) SKIP("more virtual stages than layers");
    pm_init(&d);
    pm_train_sequential(ref, &d, 20);
    for (kind = 0; kind < 5; kind++) {
        dpar_pipe_schedule *S = NULL;
        dpar_pipe_schedule_desc sd = {0};
        dpar_comm *c = world_comm(NULL);
        dpar_status rc;
        double worst;
        int ch, lo, hi, k = kind ? 1 : 0;
        sd.p = nprocs, sd.m = 8, sd.kind = kinds[kind];
        CHECK(dpar_pipe_schedule_create(&sd, &S) == DPAR_OK);
        if (!S || !c) return;
        memset(&st, 0, sizeof st);
        st.d = &d;
        st.fail_at = -1;
        rc = pm_train_stage(&st, c, S, 20, NULL);
        CHECK_MSG(rc == DPAR_OK, "rank %d: %s", me, dpar_last_error());
        worst = pm_compare(&st, ref);
        CHECK_MSG(worst <= 1e-5, "%s p=%d: rank %d is %.2e from sequential training", names[kind], nprocs, me, worst);
        memset(bits[k], 0, sizeof bits[k]);
        for (ch = 0; ch < S->v; ch++) /* every schedule sums each layer's micro-batch gradients in order: 1F1B's bits */
            for (pm_range(&st, ch, &lo, &hi), l = lo; l < hi; l++) {
                memcpy(bits[k][l], st.L[l].w, (size_t)pm_dims[l] * pm_dims[l + 1] * sizeof(float));
                memcpy(bits[k][l] + PM_WIDTH * PM_WIDTH, st.L[l].b, (size_t)pm_dims[l + 1] * sizeof(float));
            }
        MPI_Allreduce(MPI_IN_PLACE, bits[k], (int)(sizeof bits[k] / sizeof(int32_t)), MPI_INT32_T, MPI_BOR,
                      MPI_COMM_WORLD);
        if (kind) CHECK_MSG(!memcmp(bits[0], bits[1], sizeof bits[0]), "%s p=%d: not 1F1B's bits", names[kind], nprocs);
        pm_stage_free(&st);
        dpar_comm_destroy(c);
        dpar_pipe_schedule_destroy(S);
    }
    for (l = 0; l < PM_LAYERS; l++) dpar_linear_destroy(&ref[l]);
}

/* ---- hybrid: processes x threads ---- */
typedef struct {
    dpar_group *local;
    matrix_case *m;
    dpar_comm_desc desc;
    int det;
    world *w;
    size_t n;
} hyb_job;

static dpar_status hybrid_thread(void *user, int t, int T)
{
    hyb_job *h = (hyb_job *)user;
    dpar_comm *c = NULL;
    dpar_status st = dpar_group_join_mpi(h->local, t, MPI_COMM_WORLD, &c);
    int r;
    (void)T;
    if (st != DPAR_OK) {
        note(h->w, "thread %d: group_join_mpi: %s", t, dpar_last_error());
        return st;
    }
    r = dpar_comm_rank(c);
    if (r != me * hybrid_threads + t || dpar_comm_size(c) != nprocs * hybrid_threads)
        note(h->w, "hybrid rank %d/%d on process %d thread %d", r, dpar_comm_size(c), me, t);
    if (h->det) {
        /* the bits of the flat tree over all N world ranks (every process knows every input) */
        int N = dpar_comm_size(c), q;
        float **in = (float **)malloc((size_t)N * sizeof(float *)), *want = (float *)malloc(h->n * sizeof(float));
        float *out = (float *)malloc(h->n * sizeof(float));
        for (q = 0; q < N; q++) {
            in[q] = (float *)malloc(h->n * sizeof(float));
            random_floats(in[q], h->n, (unsigned)q + 900);
        }
        dpar_tree_reduce(want, (const void *const *)in, N, h->n, DPAR_F32, DPAR_SUM);
        expect_ok(h->w, dpar_allreduce(c, in[r], out, h->n, DPAR_F32, DPAR_SUM), "hybrid det allreduce", r);
        if (memcmp(out, want, h->n * sizeof(float))) note(h->w, "hybrid det allreduce on %d: not the flat bits", r);
        /* and the ring hybrid is within rounding of it */
        for (q = 0; q < N; q++) free(in[q]);
        free(in);
        free(want);
        free(out);
    } else {
        matrix_rank(h->w, c, r);
        movement_rank(h->w, c, r);
        p2p_proc(h->w, c, r);
        expect_ok(h->w, dpar_barrier(c), "barrier", r);
    }
    dpar_comm_destroy(c);
    return DPAR_OK;
}

static int run_hybrid(int det, matrix_case *m, size_t n)
{
    hyb_job h;
    world w;
    dpar_pool *pool;
    dpar_pool_desc pd;
    memset(&h, 0, sizeof h);
    memset(&w, 0, sizeof w);
    pthread_mutex_init(&w.lock, NULL);
    w.n = nprocs * hybrid_threads;
    w.user = m;
    h.w = &w;
    h.m = m;
    h.det = det;
    h.n = n;
    h.desc.size = hybrid_threads;
    h.desc.deterministic = det;
    memset(&pd, 0, sizeof pd);
    pd.num_threads = hybrid_threads;
    dpar_pool_create(&pd, &pool);
    if (dpar_group_create(&h.desc, &h.local) != DPAR_OK) return 1;
    dpar_pool_run(pool, hybrid_thread, &h);
    dpar_group_destroy(h.local);
    dpar_pool_destroy(pool);
    if (w.failures) printf("    process %d: %d failures, first: %s\n", me, w.failures, w.first);
    pthread_mutex_destroy(&w.lock);
    return w.failures;
}

/* alltoallv over MPI, dpar's pairwise rounds and MPI_Alltoallv (native): a count one pair disagrees on fails every
   process naming both sides; the native path moves the data itself (dpar's counters see only the fingerprints'
   empty messages), bf16 (no MPI type) takes the pairwise rounds; a process that never comes is named by the others'
   timeout */
static void test_alltoallv_over_mpi(void)
{
    int native, kind, q;
    float x[256], y[256];
    memset(x, 0, sizeof x);
    for (native = 0; native < 2; native++)
        for (kind = 0; kind < 4; kind++) {
            dpar_comm_desc d;
            dpar_comm *c;
            dpar_comm_stats cs;
            size_t sc[16], rc[16], es = kind == 2 ? 2 : 4, sent = 0;
            dpar_status st;
            int line;
            memset(&d, 0, sizeof d);
            d.native = native;
            d.timeout_ms = kind == 3 ? 300 : 5000;
            if (nprocs > 16 || !(c = world_comm(&d))) {
                CHECK(nprocs > 16);
                return;
            }
            for (q = 0; q < nprocs; q++) {
                sc[q] = (size_t)(me + q) % 5, rc[q] = (size_t)(q + me) % 5;
                if (q != me) sent += sc[q] * es;
            }
            { /* f32: element k of what rank a sends to rank b is a * 100 + b * 5 + k (packed by destination) */
                size_t at = 0, k;
                for (q = 0; q < nprocs; q++)
                    for (k = 0; k < sc[q]; k++) x[at++] = (float)(me * 100 + q * 5) + (float)k;
                memset(y, 0, sizeof y);
            }
            if (kind == 0 && me == 0) sc[nprocs - 1] = 7; /* rank N-1 expects (N-1) % 5 */
            if (kind == 3) { /* the last process is busy elsewhere past the others' timeout */
                char who[64];
                MPI_Barrier(MPI_COMM_WORLD);
                if (me == nprocs - 1) {
                    usleep(1000000);
                } else {
                    st = dpar_alltoallv(c, x, sc, NULL, y, rc, NULL, DPAR_F32);
                    snprintf(who, sizeof who, "rank %d never arrived", nprocs - 1);
                    CHECK_MSG(st == DPAR_ETIMEDOUT && strstr(dpar_last_error(), "in alltoallv(dtype=f32) #1") &&
                                  strstr(dpar_last_error(), who),
                              "native %d rank %d: %s: %s", native, me, dpar_status_string(st), dpar_last_error());
                }
                dpar_comm_destroy(c);
                continue;
            }
            line = __LINE__ + 1;
            st = dpar_alltoallv(c, x, sc, NULL, y, rc, NULL, kind == 2 ? DPAR_BF16 : DPAR_F32);
            if (kind == 0) {
                char a[160], b[160];
                snprintf(a, sizeof a, "rank 0 sends 7 elements to rank %d in alltoallv #1 at tests/test_mpi.c:%d",
                         nprocs - 1, line);
                snprintf(b, sizeof b, "but rank %d expects %d from rank 0 (alltoallv #1 at tests/test_mpi.c:%d)",
                         nprocs - 1, (nprocs - 1) % 5, line);
                CHECK_MSG(st == DPAR_EMISMATCH && strstr(dpar_last_error(), a) && strstr(dpar_last_error(), b),
                          "native %d rank %d: %s: %s", native, me, dpar_status_string(st), dpar_last_error());
                if (me == 0 && native) printf("    e.g. %s\n", dpar_last_error());
            } else {
                size_t at = 0, k;
                CHECK_MSG(st == DPAR_OK, "native %d rank %d: %s", native, me, dpar_last_error());
                for (q = 0; kind == 1 && q < nprocs; q++)
                    for (k = 0; k < rc[q]; k++, at++)
                        CHECK_MSG(y[at] == (float)(q * 100 + me * 5) + (float)k,
                                  "native %d rank %d: element %zu from rank %d is %g, want %d", native, me, k, q,
                                  (double)y[at], q * 100 + me * 5 + (int)k);
                dpar_comm_stats_get(c, &cs);
                CHECK_MSG(cs.by_coll[DPAR_COLL_ALLTOALLV].bytes_sent == (native && kind == 1 ? 0 : sent),
                          "native %d kind %d rank %d: %llu bytes sent by dpar, want %zu", native, kind, me,
                          (unsigned long long)cs.by_coll[DPAR_COLL_ALLTOALLV].bytes_sent,
                          native && kind == 1 ? (size_t)0 : sent);
            }
            dpar_comm_destroy(c);
        }
}

/* alltoallv parts of every size through the node's staging buffers (64 KiB a process, 256 KiB for two): one round,
   two rounds, and parts beyond two buffers (MPI_Ialltoallv after the counts met in the block); every element where
   the serial reference puts it, zero counts and uneven ones among them, the bytes sent counted; a count one pair
   disagrees on at the largest size fails every process naming both sides */
static void test_alltoallv_large_over_mpi(void)
{
    size_t units[3], sc[16], rc[16], q, k, at;
    int ui;
    units[0] = 7, units[1] = nprocs == 2 ? 40000 : 8000, units[2] = nprocs == 2 ? 80000 : 30011;
    for (ui = 0; ui < 3; ui++) {
        size_t sent = 0, got = 0, u = units[ui];
        float *x, *y;
        dpar_comm_desc d;
        dpar_comm *c;
        memset(&d, 0, sizeof d);
        d.timeout_ms = 20000;
        if (nprocs > 16 || !(c = world_comm(&d))) {
            CHECK(nprocs > 16);
            return;
        }
        for (q = 0; q < (size_t)nprocs; q++) { /* rank a sends (a + 2 q) % 3 units of floats to rank q */
            sc[q] = (size_t)((me + 2 * (int)q) % 3) * u, rc[q] = (size_t)(((int)q + 2 * me) % 3) * u;
            sent += sc[q], got += rc[q];
        }
        x = (float *)malloc((sent + 1) * sizeof(float));
        y = (float *)calloc(got + 1, sizeof(float));
        for (q = 0, at = 0; q < (size_t)nprocs; q++)
            for (k = 0; k < sc[q]; k++) x[at++] = (float)(me * 1000000 + (int)q * 250000) + (float)k;
        CHECK_MSG(dpar_alltoallv(c, x, sc, NULL, y, rc, NULL, DPAR_F32) == DPAR_OK, "rank %d unit %zu: %s", me, u,
                  dpar_last_error());
        for (q = 0, at = 0; q < (size_t)nprocs; q++)
            for (k = 0; k < rc[q]; k++, at++)
                if (y[at] != (float)((int)q * 1000000 + me * 250000) + (float)k) {
                    CHECK_MSG(0, "rank %d unit %zu: element %zu from rank %zu is %g", me, u, k, q, (double)y[at]);
                    q = (size_t)nprocs;
                    break;
                }
        {
            dpar_comm_stats cs;
            size_t mine = (sent - sc[me]) * sizeof(float);
            dpar_comm_stats_get(c, &cs);
            CHECK_MSG(cs.by_coll[DPAR_COLL_ALLTOALLV].bytes_sent == mine, "rank %d unit %zu: %llu bytes sent, want %zu",
                      me, u, (unsigned long long)cs.by_coll[DPAR_COLL_ALLTOALLV].bytes_sent, mine);
        }
        if (ui == 2) { /* rank 0 sends one element more to the last rank than that rank expects */
            char sends[160], expects[160];
            size_t expected = (size_t)((2 * (nprocs - 1)) % 3) * u; /* rank N-1's count from rank 0 */
            dpar_status st;
            int line = __LINE__ + 3;
            if (me == 0) sc[nprocs - 1] += 1;
            x[sent] = 0; /* the element more (x has room for it) */
            st = dpar_alltoallv(c, x, sc, NULL, y, rc, NULL, DPAR_F32);
            snprintf(sends, sizeof sends, "rank 0 sends %zu elements to rank %d in alltoallv #2 at tests/test_mpi.c:%d",
                     expected + 1, nprocs - 1, line);
            snprintf(expects, sizeof expects,
                     "but rank %d expects %zu from rank 0 (alltoallv #2 at tests/test_mpi.c:%d)", nprocs - 1, expected,
                     line);
            CHECK_MSG(st == DPAR_EMISMATCH && strstr(dpar_last_error(), sends) && strstr(dpar_last_error(), expects),
                      "rank %d: %s: %s", me, dpar_status_string(st), dpar_last_error());
        }
        free(x);
        free(y);
        dpar_comm_destroy(c);
    }
}

/* alltoallv parts too large for the node's block where one rank's receive displacement (in bytes) does not fit an
   int: every rank must move them the same way (the pairwise rounds, not MPI_Ialltoallv), which they learn from the
   block's headers, or with native (MPI_Alltoallv) from an agreement; the data lands where the serial reference
   puts it */
static void test_alltoallv_displacement_beyond_int_over_mpi(void)
{
    int native;
    for (native = 0; native < 2; native++) {
        const size_t part = 600 * 1024, far = (size_t)INT_MAX + 4096; /* rank 1 receives from 2 GiB on */
        size_t sc[16], rc[16], rd[16], q, k, span;
        unsigned char *x, *y;
        dpar_comm_desc d;
        dpar_comm *c;
        dpar_status st;
        memset(&d, 0, sizeof d);
        d.timeout_ms = 20000;
        d.native = native;
        if (nprocs > 16 || sizeof(size_t) < 8 || !(c = world_comm(&d))) {
            CHECK(nprocs > 16 || sizeof(size_t) < 8);
            return;
        }
        for (q = 0; q < (size_t)nprocs; q++) sc[q] = rc[q] = part, rd[q] = (me == 1 ? far : 0) + q * part;
        span = rd[nprocs - 1] + part;
        x = (unsigned char *)malloc(part * (size_t)nprocs);
        y = (unsigned char *)mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
                                  0);
        CHECK(x && y != (unsigned char *)MAP_FAILED);
        if (!x || y == (unsigned char *)MAP_FAILED) {
            dpar_comm_destroy(c);
            return;
        }
        for (q = 0; q < (size_t)nprocs; q++)
            for (k = 0; k < part; k++) x[q * part + k] = (unsigned char)(me * 31 + (int)q * 7 + (int)(k % 251));
        st = dpar_alltoallv(c, x, sc, NULL, y, rc, rd, DPAR_U8);
        CHECK_MSG(st == DPAR_OK, "native %d rank %d: %s: %s", native, me, dpar_status_string(st), dpar_last_error());
        for (q = 0; st == DPAR_OK && q < (size_t)nprocs; q++)
            for (k = 0; k < part; k++)
                if (y[rd[q] + k] != (unsigned char)((int)q * 31 + me * 7 + (int)(k % 251))) {
                    CHECK_MSG(0, "native %d rank %d: byte %zu from rank %zu is %d", native, me, k, q, y[rd[q] + k]);
                    break;
                }
        munmap(y, span);
        free(x);
        dpar_comm_destroy(c);
    }
}

static void test_hybrid_collectives(void)
{
    size_t counts[4], big = big_count() / 10;
    int ci, t, op, fails = 0, q, N = nprocs * hybrid_threads;
    char *bufs[16];
    counts[0] = 1;
    counts[1] = (size_t)N + 1;
    counts[2] = 1000;
    counts[3] = big;
    for (q = 0; q < 2 * N && q < 16; q++) bufs[q] = (char *)malloc((big + 64) * 8);
    for (ci = 0; ci < 4; ci++) {
        matrix_case m;
        memset(&m, 0, sizeof m);
        m.count = counts[ci];
        for (q = 0; q < N; q++) { /* world rank q's buffers (only this process's are used) */
            m.send[q] = bufs[2 * q];
            m.recv[q] = bufs[2 * q + 1];
        }
        for (t = 0; t < DPAR_DTYPE_COUNT; t++)
            for (op = 0; op < DPAR_OP_COUNT; op++) {
                if (ci == 3 && (op != DPAR_SUM || (t != DPAR_F32 && t != DPAR_BF16))) continue;
                m.t = (dpar_dtype)t;
                m.op = (dpar_op)op;
                m.root = (int)(counts[ci] % (size_t)N);
                fails += run_hybrid(0, &m, 0);
            }
    }
    CHECK(fails == 0);
    for (q = 0; q < 2 * N && q < 16; q++) free(bufs[q]);
}

static void test_hybrid_deterministic_equals_flat(void)
{
    int N = nprocs * hybrid_threads;
    if (N & (N - 1)) SKIP("the deterministic mode needs a power-of-two number of ranks");
    CHECK(run_hybrid(1, NULL, 30011) == 0);
}

/* ---- hybrid comms made after poisoned ones (test_fresh_comms_after_poisoned_ones, for the MPI communicator the
   threads of a process share): every rank refuses a call, every thread destroys its comm, all join again and
   allreduce. ---- */
typedef struct {
    dpar_group *local[200]; /* two a round: a group is joined once */
    int rounds, done[8], bad[8];
    char first[8][DPAR__ERROR_TEXT + 128];
} hy_fresh_job;
static dpar_status hy_fresh_thread(void *user, int t, int T)
{
    hy_fresh_job *j = (hy_fresh_job *)user;
    float x[64], y[64];
    int it, i, N = nprocs * T, want = N * (N + 1) / 2;
    for (it = 0; it < j->rounds; it++) {
        dpar_comm *c = NULL;
        dpar_status st;
        if ((st = dpar_group_join_mpi(j->local[2 * it], t, MPI_COMM_WORLD, &c)) != DPAR_OK) break;
        st = dpar_allreduce(c, NULL, y, 4, DPAR_F32, DPAR_SUM); /* refused by every rank: poisons */
        if (st != DPAR_EINVAL && !j->bad[t]++)
            snprintf(j->first[t], sizeof j->first[t], "round %d, the poisoning call: %s", it, dpar_status_string(st));
        dpar_comm_destroy(c);
        if ((st = dpar_group_join_mpi(j->local[2 * it + 1], t, MPI_COMM_WORLD, &c)) != DPAR_OK) break;
        for (i = 0; i < 64; i++) x[i] = (float)(dpar_comm_rank(c) + 1), y[i] = -1;
        st = dpar_allreduce(c, x, y, 64, DPAR_F32, DPAR_SUM);
        if ((st != DPAR_OK || y[0] != (float)want || y[63] != (float)want) && !j->bad[t]++)
            snprintf(j->first[t], sizeof j->first[t], "round %d, the fresh comm's allreduce: %s (%s), y[0] = %g", it,
                     dpar_status_string(st), st == DPAR_OK ? "" : dpar_last_error(), (double)y[0]);
        dpar_comm_destroy(c);
    }
    if (it < j->rounds && !j->bad[t]++)
        snprintf(j->first[t], sizeof j->first[t], "round %d, dpar_group_join_mpi: %s", it, dpar_last_error());
    j->done[t] = it;
    return DPAR_OK;
}
static void test_hybrid_fresh_comms_after_poisoned_ones(void)
{
    static hy_fresh_job j;
    dpar_pool *pool = NULL;
    dpar_pool_desc pd;
    dpar_comm_desc d;
    pthread_t wd;
    int t, k, made = 0, T = hybrid_threads;
    if (T > 8) SKIP("needs at most 8 threads");
    memset(&j, 0, sizeof j);
    memset(&pd, 0, sizeof pd);
    memset(&d, 0, sizeof d);
    pd.num_threads = d.size = T;
    j.rounds = 100;
    for (k = 0; k < 2 * j.rounds; k++) made += dpar_group_create(&d, &j.local[k]) == DPAR_OK;
    if (dpar_pool_create(&pd, &pool) != DPAR_OK || made < 2 * j.rounds) {
        CHECK_MSG(0, "%s", dpar_last_error());
        for (k = 0; k < 2 * j.rounds; k++) dpar_group_destroy(j.local[k]);
        dpar_pool_destroy(pool);
        return;
    }
    fault_what = "test_hybrid_fresh_comms_after_poisoned_ones (a hang)";
    fm_arm(30000, "100 rounds");
    pthread_create(&wd, NULL, fault_watchdog, NULL);
    dpar_pool_run(pool, hy_fresh_thread, &j);
    fm_arm(-1, NULL);
    pthread_join(wd, NULL);
    for (t = 0; t < T; t++)
        CHECK_MSG(j.done[t] == j.rounds && j.bad[t] == 0,
                  "process %d thread %d: %d rounds of %d, %d failed; the first: %s", me, t, j.done[t], j.rounds,
                  j.bad[t], j.first[t]);
    for (k = 0; k < 2 * j.rounds; k++) dpar_group_destroy(j.local[k]);
    dpar_pool_destroy(pool);
}

/* ---- processes with different numbers of threads: every thread of every process gets DPAR_EINVAL ---- */
typedef struct {
    dpar_group *g;
    dpar_status st[2];
    char msg[2][DPAR__ERROR_TEXT];
    int made[2];
} uneven_job;
static uneven_job uneven;
static void *uneven_thread(void *arg)
{
    int t = (int)(intptr_t)arg;
    dpar_comm *c = NULL;
    uneven.st[t] = dpar_group_join_mpi(uneven.g, t, MPI_COMM_WORLD, &c);
    snprintf(uneven.msg[t], sizeof uneven.msg[t], "%s", dpar_last_error());
    uneven.made[t] = c != NULL;
    if (c) dpar_comm_destroy(c);
    return NULL;
}
static void test_hybrid_uneven_threads_refused(void)
{
    dpar_comm_desc d;
    pthread_t th[2];
    int T = me == 0 ? 2 : 1, t;
    if (nprocs < 2) SKIP("needs 2 processes or more");
    memset(&d, 0, sizeof d);
    memset(&uneven, 0, sizeof uneven);
    d.size = T;
    d.timeout_ms = 10000;
    CHECK(dpar_group_create(&d, &uneven.g) == DPAR_OK);
    for (t = 0; t < T; t++) pthread_create(&th[t], NULL, uneven_thread, (void *)(intptr_t)t);
    for (t = 0; t < T; t++) pthread_join(th[t], NULL);
    for (t = 0; t < T; t++) {
        const char *want =
            t == 0 ? "every process needs the same" : "thread 0 of this process failed (invalid argument";
        CHECK_MSG(uneven.st[t] == DPAR_EINVAL && !uneven.made[t] && strstr(uneven.msg[t], want),
                  "process %d thread %d: %s: %s", me, t, dpar_status_string(uneven.st[t]), uneven.msg[t]);
    }
    dpar_group_destroy(uneven.g);
}

/* ---- comms made after poisoned ones: a poisoned comm's late messages (poison news, data of the call it gave up on)
   never reach them. MPI gives a freed communicator's context id to the next one it makes, so dpar keeps a poisoned
   comm's MPI communicator (dpar__m_free); freeing it, 4 processes saw a fresh comm's first allreduce fail with the
   last comm's poison in 50 of 300 rounds. Every rank refuses a call (and poisons) in 9 rounds of 10; in the tenth,
   the last rank aborts while the others are inside a 16 KiB allreduce. Open MPI itself can hang then (in
   MPI_Comm_dup: seen on 4 processes), so a watchdog ends a process still here after 65 s (0.7 s as a rule). ---- */
static void test_fresh_comms_after_poisoned_ones(void)
{
    static float x[4096], y[4096];
    int it, i, bad = 0, rounds = 300;
    char first[DPAR__ERROR_TEXT + 96] = "";
    pthread_t wd;
    for (i = 0; i < 4096; i++) x[i] = (float)(me + 1);
    fault_what = "test_fresh_comms_after_poisoned_ones (a hang)";
    fm_arm(30000, "300 rounds");
    pthread_create(&wd, NULL, fault_watchdog, NULL);
    for (it = 0; it < rounds; it++) {
        dpar_comm *c = world_comm(NULL);
        dpar_status st, want;
        if (!c) break;
        if (it % 10 != 9) {
            want = DPAR_EINVAL;
            st = dpar_allreduce(c, NULL, y, 4, DPAR_F32, DPAR_SUM); /* refused on every rank */
        } else if (me == nprocs - 1) {
            want = DPAR_EABORTED;
            dpar_comm_abort(c);
            st = dpar_barrier(c); /* spreads the flag */
        } else {
            want = DPAR_EABORTED;
            st = dpar_allreduce(c, x, y, 4096, DPAR_F32, DPAR_SUM);
        }
        if (st != want && !bad++)
            snprintf(first, sizeof first, "round %d, the poisoning call: %s (%s)", it, dpar_status_string(st),
                     dpar_last_error());
        dpar_comm_destroy(c);
        c = world_comm(NULL);
        if (!c) break;
        y[0] = y[4095] = -1;
        st = dpar_allreduce(c, x, y, 4096, DPAR_F32, DPAR_SUM);
        if ((st != DPAR_OK || y[0] != (float)(nprocs * (nprocs + 1) / 2) || y[4095] != y[0]) && !bad++)
            snprintf(first, sizeof first, "round %d, the fresh comm's allreduce: %s (%s), y[0] = %g", it,
                     dpar_status_string(st), st == DPAR_OK ? "" : dpar_last_error(), (double)y[0]);
        dpar_comm_destroy(c);
    }
    fm_arm(-1, NULL);
    pthread_join(wd, NULL);
    CHECK_MSG(it == rounds && bad == 0, "rank %d: %d rounds of %d, %d failed; the first: %s", me, it, rounds, bad,
              first);
}

/* a malformed variable on one process only (the last): that process gets its own error, every other one an error
   naming it, and nobody waits in MPI (the watchdog ends the test at 15 s otherwise) */
static void test_env_refused_on_one_process(void)
{
    dpar_comm *c = NULL;
    dpar_status st;
    pthread_t wd;
    char want[64];
    if (nprocs < 2) SKIP("needs 2 processes or more");
    fm_arm(5000, "DPAR_TIMEOUT_MS=soon on the last process");
    pthread_create(&wd, NULL, fault_watchdog, NULL);
    if (me == nprocs - 1) setenv("DPAR_TIMEOUT_MS", "soon", 1);
    st = dpar_comm_from_mpi(MPI_COMM_WORLD, NULL, &c);
    if (me == nprocs - 1) unsetenv("DPAR_TIMEOUT_MS");
    snprintf(want, sizeof want, "process %d (its rank in the MPI communicator) refused", nprocs - 1);
    CHECK_MSG(st == DPAR_EINVAL && !c &&
                  strstr(dpar_last_error(), me == nprocs - 1 ? "DPAR_TIMEOUT_MS=\"soon\" is not a number" : want),
              "process %d: %s: %s", me, dpar_status_string(st), dpar_last_error());
    dpar_comm_destroy(c);
    st = dpar_comm_from_mpi(MPI_COMM_WORLD, NULL, &c); /* and the next comm is made as usual */
    CHECK_MSG(st == DPAR_OK, "%s", dpar_last_error());
    dpar_comm_destroy(c);
    fm_arm(-1, NULL);
    pthread_join(wd, NULL);
}

/* ---- MPI_THREAD_FUNNELED: what needs more says so ---- */
static void test_thread_level_is_checked(void)
{
    dpar_comm *c = world_comm(NULL), *h = NULL;
    dpar_request *req = NULL;
    dpar_group *g;
    dpar_comm_desc d;
    float x[4] = {1, 2, 3, 4};
    CHECK(c != NULL);
    if (!c) return;
    CHECK(dpar_iallreduce(c, x, x, 4, DPAR_F32, DPAR_SUM, &req) == DPAR_EUNSUPPORTED && req == NULL);
    CHECK(strstr(dpar_last_error(), "MPI_THREAD_MULTIPLE") != NULL);
    dpar_comm_destroy(c);
    memset(&d, 0, sizeof d);
    d.size = 1;
    dpar_group_create(&d, &g);
    CHECK(dpar_group_join_mpi(g, 0, MPI_COMM_WORLD, &h) == DPAR_EUNSUPPORTED && h == NULL);
    CHECK_MSG(strstr(dpar_last_error(), "needs MPI_THREAD_MULTIPLE, but MPI_Init_thread gave MPI_THREAD_FUNNELED"),
              "%s", dpar_last_error());
    dpar_group_destroy(g);
    /* blocking calls still work at this level */
    c = world_comm(NULL);
    CHECK(c != NULL);
    if (c) { /* (failed once in a make test, not in 180 runs alone: the status and text say why next time) */
        dpar_status st = dpar_allreduce(c, x, x, 4, DPAR_F32, DPAR_SUM);
        CHECK_MSG(st == DPAR_OK && x[3] == 4.0f * (float)nprocs, "rank %d: allreduce %s (%s), x[3] = %g", me,
                  dpar_status_string(st), st == DPAR_OK ? "" : dpar_last_error(), (double)x[3]);
        dpar_comm_destroy(c);
    }
}

/* ---- mixed collectives of random kinds, sizes, dtypes and ops (tests/stress.h): DPAR_STRESS_ITERS calls (make
   stress: 100000 on 4 processes), else 2000 (300 under ASan) ---- */
static void stress_proc(world *w, dpar_comm *c, int r)
{
    const char *e = getenv("DPAR_STRESS_ITERS");
#ifdef __SANITIZE_ADDRESS__
    long iters = e && *e ? atol(e) : 300;
#else
    long iters = e && *e ? atol(e) : 2000;
#endif
    char *s = (char *)malloc((size_t)STRESS_MAX * 8), *v = (char *)malloc((size_t)STRESS_MAX * 8);
    stress_counts counts;
    double t0 = dt_now();
    memset(&counts, 0, sizeof counts);
    stress_rank(w, c, r, 19, iters, s, v, &counts);
    if (r == 0) printf("    %ld mixed calls on %d processes in %.1f s\n", iters, w->n, dt_now() - t0);
    free(s);
    free(v);
}
static void test_stress_over_mpi(void)
{
    dpar_comm_desc d;
    memset(&d, 0, sizeof d);
    d.timeout_ms = 30000;
    CHECK(run_proc(&d, stress_proc, NULL) == 0);
}

/* ---- a runner whose verdict is the same on every process ---- */
static int passed, failed, skipped;
static void mrun(const char *name, void (*fn)(void))
{
    int local[2], total[2];
    double t0 = dt_now();
    const char *env = getenv("DPAR_TEST_ONLY"); /* e.g. mpirun -x DPAR_TEST_ONLY=faults: the tests named so */
    if (only && !strstr(name, only)) return;
    if (env && *env && !strstr(name, env)) return;
    dt_test_failed = 0;
    dt_test_skipped = 0;
    fn();
    local[0] = dt_test_failed;
    local[1] = dt_test_skipped;
    MPI_Allreduce(local, total, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (me != 0) return;
    if (total[0]) {
        failed++;
        printf("FAIL %s\n", name);
    } else if (total[1]) {
        skipped++;
        printf("skip %s: skipped: %s\n", name, dt_skip_reason);
    } else {
        passed++;
        printf("ok   %s (%.0f ms)\n", name, 1e3 * (dt_now() - t0));
    }
    fflush(stdout);
}
#define MRUN(fn) mrun(#fn, fn)

int main(int argc, char **argv)
{
    int provided = 0, funneled = 0, i;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--hybrid") && i + 1 < argc) hybrid_threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--funneled")) funneled = 1;
        else if (argv[i][0] != '-') only = argv[i];
    }
    MPI_Init_thread(&argc, &argv, funneled ? MPI_THREAD_FUNNELED : MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &nprocs);
    if (me == 0) printf("test_mpi: %d processes x %d threads\n", nprocs, hybrid_threads ? hybrid_threads : 1);
    if (funneled) {
        MRUN(test_thread_level_is_checked);
    } else if (provided < MPI_THREAD_MULTIPLE) {
        if (me == 0) printf("skip test_mpi: skipped: MPI gave no MPI_THREAD_MULTIPLE\n");
        skipped++;
    } else if (hybrid_threads > 0) {
        MRUN(test_hybrid_collectives);
        MRUN(test_hybrid_deterministic_equals_flat);
        MRUN(test_hybrid_uneven_threads_refused);
        MRUN(test_hybrid_faults);
        MRUN(test_hybrid_fresh_comms_after_poisoned_ones);
    } else {
        MRUN(test_point_to_point_over_mpi);
        MRUN(test_collectives_matrix_over_mpi);
        MRUN(test_ring_bytes_over_mpi);
        MRUN(test_bitwise_reproducible_over_mpi);
        MRUN(test_deterministic_mode_over_mpi);
        MRUN(test_fsdp_over_mpi);
        MRUN(test_tensors_over_mpi);
        MRUN(test_ckpt_reshard_over_mpi);
        MRUN(test_fsdp_ckpt_reshard_over_mpi);
        MRUN(test_async_split_mesh_over_mpi);
        MRUN(test_pipeline_over_mpi);
        MRUN(test_stress_over_mpi);
        MRUN(test_env_refused_on_one_process);
        MRUN(test_mismatch_timeout_abort_over_mpi);
        MRUN(test_alltoallv_over_mpi);
        MRUN(test_alltoallv_large_over_mpi);
        MRUN(test_alltoallv_displacement_beyond_int_over_mpi);
        MRUN(test_faults_over_mpi);
        MRUN(test_given_up_receives_write_nothing_later);
        MRUN(test_faults_in_modules_over_mpi);
        MRUN(test_fresh_comms_after_poisoned_ones); /* (after the comms the three above poisoned) */
    }
    if (me == 0) {
        if (skipped) printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
        else printf("%d passed, %d failed\n", passed, failed);
    }
    fflush(stdout);
    MPI_Finalize();
    return failed ? 1 : 0;
}
