/* test_fault.c - fault injection (DPAR_FAULT, dpar_fault_set) on thread ranks: a delay, a vanished rank and a
   failed operation at each kind of operation (every collective, send, recv, gradient buckets, the pipeline
   runner, work stealing, pool tasks). Every surviving rank must return an error naming the faulty rank (and the
   operation) within the timeout; a delay below the timeout must change nothing (results against serial
   references). A watchdog thread kills the program (exit 1, naming the case) when a case runs longer than twice
   its timeout after its ranks have met. A malformed spec (dpar_fault_set, DPAR_FAULT) is a clear error.
   Build and run: make build/test_fault && build/test_fault   (one test: build/test_fault stage) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <unistd.h>
#include <sys/wait.h>

#include "dpar_test.h"

/* ---- the watchdog: a case still running 2 x its timeout after its ranks met fails the program ---- */
static double wd_deadline; /* 0: disarmed; written and read under wd_lock */
static char wd_case[128];
static pthread_mutex_t wd_lock = PTHREAD_MUTEX_INITIALIZER;
static void *watchdog_main(void *arg)
{
    (void)arg;
    for (;;) {
        double d;
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&wd_lock);
        d = wd_deadline;
        pthread_mutex_unlock(&wd_lock);
        if (d > 0 && dt_now() > d) {
            printf("FAIL %s: still running 2 x its timeout after its ranks met: killed by the watchdog\n", wd_case);
            fflush(stdout);
            _exit(1);
        }
    }
    return NULL;
}
static void wd_arm(const char *name, int timeout_ms)
{
    pthread_mutex_lock(&wd_lock);
    snprintf(wd_case, sizeof wd_case, "%s", name);
    wd_deadline = dt_now() + 2e-3 * timeout_ms;
    pthread_mutex_unlock(&wd_lock);
}
static void wd_disarm(void)
{
    pthread_mutex_lock(&wd_lock);
    wd_deadline = 0;
    pthread_mutex_unlock(&wd_lock);
}

/* ---- the scenarios: K steps of one kind of operation on every rank, each result checked ---- */
enum {
    SC_BARRIER,
    SC_BCAST,
    SC_REDUCE,
    SC_RSCATTER,
    SC_ALLGATHER,
    SC_ALLREDUCE,
    SC_ALLTOALL,
    SC_ALLTOALLV,
    SC_SEND,
    SC_RECV,
    SC_BUCKET,
    SC_STAGE,
    SC_STEAL,
    SC_COUNT
};
static const char *const sc_op[SC_COUNT] = {"barrier",   "broadcast", "reduce",    "reduce_scatter", "allgather",
                                            "allreduce", "alltoall",  "alltoallv", "send",           "recv",
                                            "bucket",    "stage",     "steal"};
enum { K_NONE, K_DELAY, K_VANISH, K_FAIL };
static const char *const k_name[] = {"none", "delay", "vanish", "fail"};

#define MAXN 4
#define STEPS 4
#define CNT 257
#define AT 3 /* the faulty rank's operation number (on its comm) */

typedef struct fcase {
    int sc, kind, N, F, timeout_ms, delay_ms, direct;
    char name[96];
    dpar_group *g;
    dpar_pool *pool;
    /* per rank */
    dpar_status st[MAXN];
    int err_step[MAXN]; /* 1-based step of the first error; 0: none */
    int wrong[MAXN];    /* results that differ from the reference */
    int again[MAXN];    /* the status of one more call after the error (the vanished rank's) */
    double err_s[MAXN]; /* seconds from the meeting to the error */
    double step_s[MAXN][STEPS];
    char msg[MAXN][DPAR__ERROR_TEXT];
} fcase;

static float xval(int r, int i, int step) { return (float)((r + 1) + (i + step) % 13); }

/* one collective step of rank r: run it and count wrong elements against the serial reference */
static dpar_status coll_step(fcase *fc, dpar_comm *c, int r, int step, float *x, float *y, int *wrong)
{
    int N = fc->N, i, q;
    size_t off, len;
    dpar_status st;
    for (i = 0; i < CNT * MAXN; i++) x[i] = xval(r, i, step), y[i] = -1.0f;
    switch (fc->sc) {
    case SC_BARRIER: return dpar_barrier(c);
    case SC_BCAST:
        st = dpar_broadcast(c, x, y, CNT, DPAR_F32, step % N);
        for (i = 0; st == DPAR_OK && i < CNT; i++) *wrong += y[i] != xval(step % N, i, step);
        return st;
    case SC_REDUCE:
        st = dpar_reduce(c, x, y, CNT, DPAR_F32, DPAR_SUM, step % N);
        for (i = 0; st == DPAR_OK && r == step % N && i < CNT; i++) {
            float want = 0;
            for (q = 0; q < N; q++) want += xval(q, i, step);
            *wrong += y[i] != want;
        }
        return st;
    case SC_RSCATTER:
        st = dpar_reduce_scatter(c, x, y, CNT, DPAR_F32, DPAR_SUM);
        dpar_block_range(CNT, N, r, &off, &len);
        for (i = 0; st == DPAR_OK && i < (int)len; i++) {
            float want = 0;
            for (q = 0; q < N; q++) want += xval(q, (int)off + i, step);
            *wrong += y[i] != want;
        }
        return st;
    case SC_ALLGATHER:
        dpar_block_range(CNT, N, r, &off, &len);
        st = dpar_allgather(c, x + off, y, CNT, DPAR_F32);
        for (q = 0; st == DPAR_OK && q < N; q++) {
            dpar_block_range(CNT, N, q, &off, &len);
            for (i = 0; i < (int)len; i++) *wrong += y[off + i] != xval(q, (int)off + i, step);
        }
        return st;
    case SC_ALLREDUCE:
        st = dpar_allreduce(c, x, y, CNT, DPAR_F32, DPAR_SUM);
        for (i = 0; st == DPAR_OK && i < CNT; i++) {
            float want = 0;
            for (q = 0; q < N; q++) want += xval(q, i, step);
            *wrong += y[i] != want;
        }
        return st;
    case SC_ALLTOALLV: { /* rank r sends q + r elements to rank q, from the start of its block q */
        size_t sc[MAXN] = {0}, sd[MAXN] = {0}, rc[MAXN] = {0}, rd[MAXN] = {0};
        for (q = 0; q < N; q++) {
            sc[q] = (size_t)(q + r), sd[q] = (size_t)q * (CNT / MAXN);
            rc[q] = (size_t)(r + q), rd[q] = (size_t)q * (CNT / MAXN);
        }
        st = dpar_alltoallv(c, x, sc, sd, y, rc, rd, DPAR_F32);
        for (q = 0; st == DPAR_OK && q < N; q++)
            for (i = 0; i < r + q; i++) *wrong += y[q * (CNT / MAXN) + i] != xval(q, r * (CNT / MAXN) + i, step);
        return st;
    }
    default: /* SC_ALLTOALL: block q of my send goes to rank q */
        st = dpar_alltoall(c, x, y, CNT / MAXN, DPAR_F32);
        for (q = 0; st == DPAR_OK && q < N; q++)
            for (i = 0; i < CNT / MAXN; i++) *wrong += y[q * (CNT / MAXN) + i] != xval(q, r * (CNT / MAXN) + i, step);
        return st;
    }
}

/* send/recv: a star of 3 ranks around rank 1 (so that every survivor waits for the faulty rank itself): ranks 0
   and 2 send to rank 1 and receive its answer; rank 1 receives from 0, then 2, and answers 0, then 2 */
static dpar_status p2p_step(fcase *fc, dpar_comm *c, int r, int step, float *x, float *y, int *wrong)
{
    int i, k;
    dpar_status st = DPAR_OK;
    (void)fc;
    for (i = 0; i < CNT; i++) x[i] = xval(r, i, step);
    if (r != 1) {
        st = dpar_send(c, x, CNT, DPAR_F32, 1, step);
        for (i = 0; i < CNT; i++) y[i] = -1.0f;
        if (st == DPAR_OK) st = dpar_recv(c, y, CNT, DPAR_F32, 1, step);
        for (i = 0; st == DPAR_OK && i < CNT; i++) *wrong += y[i] != xval(1, i, step);
        return st;
    }
    for (k = 0; k <= 2 && st == DPAR_OK; k += 2) {
        for (i = 0; i < CNT; i++) y[i] = -1.0f;
        st = dpar_recv(c, y, CNT, DPAR_F32, k, step);
        for (i = 0; st == DPAR_OK && i < CNT; i++) *wrong += y[i] != xval(k, i, step);
    }
    for (k = 0; k <= 2 && st == DPAR_OK; k += 2) st = dpar_send(c, x, CNT, DPAR_F32, k, step);
    return st;
}

/* gradient buckets with an update: params -= avg(grads), in 4 buckets; params start at i % 5 */
#define BCOUNT 4096
typedef struct bucket_rank {
    float grads[BCOUNT], params[BCOUNT];
} bucket_rank;
static void bucket_update(void *user, size_t offset, size_t count)
{
    bucket_rank *br = (bucket_rank *)user;
    size_t i;
    for (i = offset; i < offset + count; i++) br->params[i] -= br->grads[i];
}

/* the pipeline: forward adds 1 to a float, backward doubles the gradient; the last stage sums what it gets and
   the first stage what comes back */
#define MICRO 4
typedef struct stage_rank {
    int stage, p;
    int nf, nb; /* callbacks called */
    double got;
} stage_rank;
static stage_rank srs[MAXN];
static dpar_status stage_fwd(void *user, int micro, int chunk, const void *in, void *out)
{
    stage_rank *s = (stage_rank *)user;
    float v = in ? *(const float *)in : (float)micro;
    (void)chunk;
    s->nf++;
    if (out) *(float *)out = v + 1.0f;
    else s->got += v;
    return DPAR_OK;
}
static dpar_status stage_bwd(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    stage_rank *s = (stage_rank *)user;
    float g = grad_out ? *(const float *)grad_out : 1.0f;
    (void)micro, (void)chunk, (void)in;
    s->nb++;
    if (grad_in) *(float *)grad_in = 2.0f * g;
    else s->got += g;
    return DPAR_OK;
}

/* work stealing: task i of rank r writes r * 1000 + i + step into r's array */
typedef struct steal_rank {
    int r, step;
    int out[16];
} steal_rank;
static dpar_status steal_task(void *user, int i, int by)
{
    steal_rank *s = (steal_rank *)user;
    (void)by;
    s->out[i] = s->r * 1000 + i + s->step;
    return DPAR_OK;
}

static dpar_status note(fcase *fc, int r, int step, dpar_status st, double t0)
{
    if (st != DPAR_OK && !fc->err_step[r]) {
        fc->st[r] = st;
        fc->err_step[r] = step + 1;
        fc->err_s[r] = dt_now() - t0;
        snprintf(fc->msg[r], sizeof fc->msg[r], "%s", dpar_last_error());
    }
    return st;
}

static dpar_status case_rank(void *user, int r, int num_threads)
{
    fcase *fc = (fcase *)user;
    dpar_comm *c = NULL;
    dpar_status st = DPAR_OK;
    static float xs[MAXN][CNT * MAXN], ys[MAXN][CNT * MAXN];
    static bucket_rank brs[MAXN];
    static steal_rank strs[MAXN];
    dpar_buckets *b = NULL;
    dpar_pipe_schedule *S = NULL;
    dpar_pipe *pp = NULL;
    dpar_steal *sl = NULL;
    double t0;
    int step, i;
    (void)num_threads;
    if (dpar_group_join(fc->g, r, &c) != DPAR_OK) return DPAR_EINVAL;
    if (fc->sc == SC_BUCKET) { /* 4 buckets of 1024 floats; each rank updates its block of each */
        dpar_buckets_desc bd;
        memset(&bd, 0, sizeof bd);
        bd.comm = c;
        bd.grads = brs[r].grads;
        bd.count = BCOUNT;
        bd.bucket_bytes = BCOUNT;
        bd.op = DPAR_AVG;
        for (i = 0; i < BCOUNT; i++) brs[r].params[i] = (float)(i % 5);
        if (dpar_buckets_create(&bd, &b) != DPAR_OK ||
            dpar_buckets_set_update(b, brs[r].params, bucket_update, &brs[r]) != DPAR_OK ||
            (fc->direct && dpar_buckets_set_direct(b, 1) != DPAR_OK))
            st = DPAR_EINVAL;
    } else if (fc->sc == SC_STAGE) {
        dpar_pipe_schedule_desc sd;
        dpar_pipe_desc pd;
        memset(&sd, 0, sizeof sd);
        memset(&pd, 0, sizeof pd);
        sd.p = fc->N;
        sd.m = MICRO;
        srs[r].stage = r;
        srs[r].p = fc->N;
        srs[r].got = 0;
        srs[r].nf = srs[r].nb = 0;
        if (dpar_pipe_schedule_create(&sd, &S) != DPAR_OK) st = DPAR_EINVAL;
        pd.schedule = S;
        pd.comm = c;
        pd.act_bytes = sizeof(float);
        pd.forward = stage_fwd;
        pd.backward = stage_bwd;
        pd.user = &srs[r];
        if (st == DPAR_OK && dpar_pipe_create(&pd, &pp) != DPAR_OK) st = DPAR_EINVAL;
    } else if (fc->sc == SC_STEAL) {
        dpar_steal_desc sd;
        memset(&sd, 0, sizeof sd);
        sd.comm = c;
        sd.max_tasks = 16;
        strs[r].r = r;
        if (dpar_steal_create(&sd, &sl) != DPAR_OK) st = DPAR_EINVAL;
    }
    if (st != DPAR_OK) fc->wrong[r] += 1000; /* setup failed */
    dpar_pool_barrier(fc->pool);
    if (r == 0) wd_arm(fc->name, fc->timeout_ms);
    t0 = dt_now();
    for (step = 0; step < STEPS && st == DPAR_OK; step++) {
        double ts = dt_now();
        if (fc->sc <= SC_ALLTOALLV) {
            st = coll_step(fc, c, r, step, xs[r], ys[r], &fc->wrong[r]);
        } else if (fc->sc <= SC_RECV) {
            st = p2p_step(fc, c, r, step, xs[r], ys[r], &fc->wrong[r]);
        } else if (fc->sc == SC_BUCKET) {
            for (i = 0; i < BCOUNT; i++) brs[r].grads[i] = (float)((r + 1) * (i % 7));
            st = dpar_buckets_ready(b, 0, BCOUNT);
            if (st == DPAR_OK) st = dpar_buckets_wait(b);
            for (i = 0; st == DPAR_OK && i < BCOUNT; i++) /* the sum of (r + 1) over 4 ranks is 10 */
                fc->wrong[r] += brs[r].params[i] != (float)(i % 5) - (float)(step + 1) * 2.5f * (float)(i % 7);
        } else if (fc->sc == SC_STAGE) {
            double want;
            srs[r].got = 0;
            st = dpar_pipe_run(pp, NULL);
            /* last stage: sum of micro + p - 1; first stage: m x 2^(p-1) (the last stage's gradient is 1) */
            want = r == fc->N - 1 ? MICRO * (MICRO - 1) / 2.0 + MICRO * (fc->N - 1)
                                  : (r == 0 ? MICRO * (double)(1 << (fc->N - 1)) : 0.0);
            if (st == DPAR_OK && (r == 0 || r == fc->N - 1)) fc->wrong[r] += srs[r].got != want;
        } else { /* SC_STEAL: 8 tasks per rank and round */
            strs[r].step = step;
            memset(strs[r].out, 0xff, sizeof strs[r].out);
            st = dpar_steal_run(sl, 8, steal_task, NULL, &strs[r]);
            for (i = 0; st == DPAR_OK && i < 8; i++) fc->wrong[r] += strs[r].out[i] != r * 1000 + i + step;
        }
        fc->step_s[r][step] = dt_now() - ts;
        note(fc, r, step, st, t0);
    }
    if (st != DPAR_OK && fc->sc <= SC_ALLTOALLV) /* one more call: the vanished rank stays away */
        fc->again[r] = coll_step(fc, c, r, STEPS, xs[r], ys[r], &i);
    dpar_pool_barrier(fc->pool); /* nobody frees what another rank may still read */
    if (r == 0) wd_disarm();
    dpar_buckets_destroy(b);
    dpar_pipe_destroy(pp);
    dpar_pipe_schedule_destroy(S);
    dpar_steal_destroy(sl);
    dpar_comm_destroy(c);
    return DPAR_OK;
}

static int scenario_ranks(int sc) { return sc == SC_SEND || sc == SC_RECV || sc == SC_STAGE ? 3 : 4; }

/* the string a survivor's message must hold: the faulty rank named as the one that failed, or as the one
   the survivor (or the first survivor to time out) waits for */
static int direct_buckets; /* 1: the buckets reduce on the ranks' own threads */
static void run_case(int sc, int kind)
{
    static fcase fc;
    dpar_comm_desc d;
    dpar_pool_desc pd;
    dpar_pool *pool = NULL;
    char spec[160], want[320];
    int r;
    memset(&fc, 0, sizeof fc);
    fc.sc = sc;
    fc.kind = kind;
    fc.N = scenario_ranks(sc);
    fc.direct = direct_buckets;
    fc.F = 1;
    fc.delay_ms = 60;
    fc.timeout_ms = kind == K_DELAY ? 5000 : 300;
    snprintf(fc.name, sizeof fc.name, "%s at %s%s", k_name[kind], sc_op[sc], fc.direct ? " (direct)" : "");
    if (kind == K_DELAY) snprintf(spec, sizeof spec, "rank=1,op=%s,at=%d,kind=delay:%d", sc_op[sc], AT, fc.delay_ms);
    else snprintf(spec, sizeof spec, "op=%s,kind=%s,at=%d,rank=1", sc_op[sc], k_name[kind], AT);
    CHECK(dpar_fault_set(spec) == DPAR_OK);
    memset(&d, 0, sizeof d);
    d.size = fc.N;
    d.timeout_ms = fc.timeout_ms;
    d.name = "fault";
    memset(&pd, 0, sizeof pd);
    pd.num_threads = fc.N;
    CHECK(dpar_pool_create(&pd, &pool) == DPAR_OK);
    CHECK(dpar_group_create(&d, &fc.g) == DPAR_OK);
    if (!pool || !fc.g) return;
    fc.pool = pool;
    CHECK(dpar_pool_run(pool, case_rank, &fc) == DPAR_OK);
    CHECK(dpar_fault_set(NULL) == DPAR_OK); /* the comms made from now on have no fault */
    for (r = 0; r < fc.N; r++) {
        CHECK_MSG(fc.wrong[r] == 0, "%s: rank %d: %d wrong results", fc.name, r, fc.wrong[r]);
        if (kind == K_DELAY) {
            CHECK_MSG(fc.st[r] == DPAR_OK, "%s: rank %d: %s", fc.name, r, fc.msg[r]);
            continue;
        }
        CHECK_MSG(fc.st[r] != DPAR_OK, "%s: rank %d returned no error", fc.name, r);
        CHECK_MSG(fc.err_s[r] < 2e-3 * fc.timeout_ms, "%s: rank %d returned after %.0f ms", fc.name, r,
                  1e3 * fc.err_s[r]);
        if (sc <= SC_ALLTOALLV) /* a survivor sees the poison in step AT, or while it finishes step AT - 1 */
            CHECK_MSG(fc.err_step[r] == AT || (kind == K_FAIL && r != fc.F && fc.err_step[r] == AT - 1),
                      "%s: rank %d failed at step %d", fc.name, r, fc.err_step[r]);
        if (r == fc.F) {
            if (sc == SC_STAGE) /* GPipe: forwards first; the 3rd callback is the 3rd forward, and is not called */
                CHECK_MSG(srs[r].nf == AT - 1 && srs[r].nb == 0, "%s: %d forwards, %d backwards", fc.name, srs[r].nf,
                          srs[r].nb);
            if (kind == K_VANISH) {
                CHECK_MSG(fc.st[r] == DPAR_ECANCELED && strstr(fc.msg[r], "fault rank 1 has vanished"), "%s: %s",
                          fc.name, fc.msg[r]);
                if (sc <= SC_ALLTOALLV) CHECK(fc.again[r] == DPAR_ECANCELED);
            } else {
                CHECK_MSG(fc.st[r] == (sc == SC_BUCKET || sc == SC_STAGE ? DPAR_EUSER : DPAR_EIO), "%s: %s", fc.name,
                          fc.msg[r]);
            }
            continue;
        }
        if (kind == K_FAIL) { /* the poison names the rank and its operation */
            snprintf(want, sizeof want, "fault rank 1: injected fault (DPAR_FAULT \"%s\"): its %s #%d failed", spec,
                     sc_op[sc], AT);
        } else if (fc.direct) { /* a rank that leaves direct buckets poisons (its memory is read): it says so */
            snprintf(want, sizeof want,
                     "rank 1 of fault left its direct buckets in the middle of a step: fault rank 1 "
                     "has vanished");
        } else if (sc <= SC_ALLTOALLV || sc == SC_BUCKET) { /* a collective's timeout: who never came */
            snprintf(want, sizeof want, "rank 1 never arrived");
        } else if (sc == SC_STEAL) {
            snprintf(want, sizeof want, "waiting for rank 1 to start its tasks of round %d", AT);
        } else {
            snprintf(want, sizeof want, "waiting for rank 1 to");
        }
        CHECK_MSG(strstr(fc.msg[r], want) != NULL, "%s: rank %d: \"%s\" lacks \"%s\"", fc.name, r, fc.msg[r], want);
        if (kind == K_VANISH && !fc.direct) {
            CHECK_MSG(fc.st[r] == DPAR_ETIMEDOUT, "%s: rank %d: %s", fc.name, r, fc.msg[r]);
            if (sc <= SC_ALLTOALLV) CHECK_MSG(strstr(fc.msg[r], sc_op[sc]) != NULL, "%s: %s", fc.name, fc.msg[r]);
        }
    }
    if (getenv("DPAR_TEST_VERBOSE") && kind != K_DELAY) /* what the users see, for docs/reliability.md */
        printf("    %s: rank 1: %s\n    %s: rank 0: %s\n", fc.name, fc.msg[1], fc.name, fc.msg[0]);
    if (kind == K_DELAY) { /* the delay happened, at the faulty rank's step AT (the collectives: the others wait) */
        /* operations of that kind per step: 1; rank 1 of the star: 2 sends and 2 receives; buckets: 4 updates;
           the pipeline: 2 x MICRO callbacks */
        int per = sc == SC_SEND || sc == SC_RECV ? 2 : sc == SC_BUCKET ? 4 : sc == SC_STAGE ? 2 * MICRO : 1;
        int step = (AT - 1) / per;
        CHECK_MSG(fc.step_s[fc.F][step] >= 0.9e-3 * fc.delay_ms, "%s: step %d took %.1f ms", fc.name, step,
                  1e3 * fc.step_s[fc.F][step]);
    }
    dpar_group_destroy(fc.g);
    dpar_pool_destroy(pool);
}

static void run_kind(int sc)
{
    int kind;
    for (kind = K_DELAY; kind <= K_FAIL; kind++) run_case(sc, kind);
}
static void test_fault_barrier(void) { run_kind(SC_BARRIER); }
static void test_fault_broadcast(void) { run_kind(SC_BCAST); }
static void test_fault_reduce(void) { run_kind(SC_REDUCE); }
static void test_fault_reduce_scatter(void) { run_kind(SC_RSCATTER); }
static void test_fault_allgather(void) { run_kind(SC_ALLGATHER); }
static void test_fault_allreduce(void) { run_kind(SC_ALLREDUCE); }
static void test_fault_alltoall(void) { run_kind(SC_ALLTOALL); }
static void test_fault_alltoallv(void) { run_kind(SC_ALLTOALLV); }
static void test_fault_send(void) { run_kind(SC_SEND); }
static void test_fault_recv(void) { run_kind(SC_RECV); }
static void test_fault_bucket(void) { run_kind(SC_BUCKET); }
static void test_fault_bucket_direct(void)
{
    direct_buckets = 1;
    run_kind(SC_BUCKET);
    direct_buckets = 0;
}
static void test_fault_stage(void) { run_kind(SC_STAGE); }
static void test_fault_steal(void) { run_kind(SC_STEAL); }

/* tasks: the pool's 3rd task to run fails (not called); a delay changes nothing but the time */
static int task_out[8];
static dpar_status square_task(void *user)
{
    int i = (int)(intptr_t)user;
    task_out[i] = i * i + 1;
    return DPAR_OK;
}
static void test_fault_task(void)
{
    int kind;
    for (kind = K_DELAY; kind <= K_FAIL; kind += 2) {
        dpar_pool *pool = NULL;
        dpar_pool_desc pd;
        int i, done = 0;
        double t0;
        dpar_status st;
        CHECK(dpar_fault_set(kind == K_DELAY ? "op=task,at=3,kind=delay:60" : "op=task,at=3,kind=fail") == DPAR_OK);
        memset(&pd, 0, sizeof pd);
        pd.num_threads = 3;
        CHECK(dpar_pool_create(&pd, &pool) == DPAR_OK);
        CHECK(dpar_fault_set("") == DPAR_OK);
        if (!pool) return;
        memset(task_out, 0, sizeof task_out);
        t0 = dt_now();
        for (i = 0; i < 8; i++) {
            dpar_task_desc td;
            memset(&td, 0, sizeof td);
            td.fn = square_task;
            td.user = (void *)(intptr_t)i;
            td.name = "square";
            CHECK(dpar_task_submit(pool, &td, NULL) == DPAR_OK);
        }
        st = dpar_task_wait_all(pool);
        for (i = 0; i < 8; i++) done += task_out[i] == i * i + 1;
        if (kind == K_DELAY) {
            CHECK(st == DPAR_OK && done == 8);
            CHECK(dt_now() - t0 >= 0.055);
        } else {
            CHECK_MSG(st == DPAR_EUSER && strstr(dpar_last_error(), "injected fault") &&
                          strstr(dpar_last_error(), "(the pool's task #3 to run) failed"),
                      "%s", dpar_last_error());
            CHECK(done == 7);
        }
        CHECK(dpar_pool_destroy(pool) == DPAR_OK);
    }
}

/* ---- the grammar ---- */
static void test_fault_spec_errors(void)
{
    static const char *const bad[][2] = {
        {"rank=x,kind=fail", "\"rank=x\" in fault 1 (\"rank=x,kind=fail\"): bad value"},
        {"rank=1,op=allreduc,kind=fail", "\"op=allreduc\""},
        {"op=all,kind=fail", "\"op=all\""},
        {"op=split,kind=fail", "\"op=split\""}, /* a split is no operation a fault can hit */
        {"rank=1,at=0,kind=fail", "\"at=0\""},
        {"rank=1,at=99999999999999999999,kind=fail", "\"at=99999999999999999999\""},
        {"rank=1,kind=delay", "\"kind=delay\""},
        {"rank=1,kind=delay:3600001", "\"kind=delay:3600001\""},
        {"rank=1,kind=delay:1x", "\"kind=delay:1x\""},
        {"rank=1,op=allreduce", "fault 1 (\"rank=1,op=allreduce\") has no kind="},
        {"rank=1,speed=3,kind=fail", "\"speed=3\" in fault 1 (\"rank=1,speed=3,kind=fail\"): unknown key"},
        {"kind=fail;rank=-1,kind=fail", "\"rank=-1\" in fault 2"},
        {"kind=fail;rank", "\"rank\" in fault 2 (\"rank\") is not key=value"},
        {"kind=fail,", "ends with a ','"},
        {"op=task,rank=0,kind=fail", "a task belongs to a pool"},
        {"op=task,kind=vanish", "a task belongs to a pool"},
        {"comm=abcdefghijabcdefghijabcdefghijab,kind=fail", "\"comm=abcdefghijabcdefghijabcdefghijab\""},
    };
    char many[400] = "";
    int i;
    for (i = 0; i < (int)(sizeof bad / sizeof bad[0]); i++) {
        dpar_status st = dpar_fault_set(bad[i][0]);
        CHECK_MSG(st == DPAR_EINVAL && strstr(dpar_last_error(), "dpar_fault_set: ") &&
                      strstr(dpar_last_error(), bad[i][1]),
                  "%s: %d %s", bad[i][0], (int)st, dpar_last_error());
    }
    for (i = 0; i < 17; i++) strcat(many, "kind=fail;");
    CHECK(dpar_fault_set(many) == DPAR_EINVAL && strstr(dpar_last_error(), "more than 16 faults"));
    many[strlen(many) - 10] = 0; /* 16 */
    CHECK(dpar_fault_set(many) == DPAR_OK);
    CHECK(dpar_fault_set(NULL) == DPAR_OK && dpar_fault_set("") == DPAR_OK && dpar_fault_set(" ; ;") == DPAR_OK);
    CHECK(dpar_fault_set("kind=delay:0;rank=2,op=reduce_scatter,at=7,kind=vanish,comm=dp.x; op=task,kind=fail ") ==
          DPAR_OK);
    CHECK(dpar_fault_set(NULL) == DPAR_OK);
}

/* a bad spec leaves the schedule as it was; comm= and rank= choose where; op=any counts every operation */
static void test_fault_filters(void)
{
    dpar_comm_desc d;
    dpar_group *ga = NULL, *gb = NULL;
    dpar_comm *a = NULL, *b = NULL;
    int x = 1;
    CHECK(dpar_fault_set("comm=b,rank=0,at=2,kind=fail;comm=a,rank=1,kind=fail;comm=a,op=allreduce,at=2,kind=fail") ==
          DPAR_OK);
    CHECK(dpar_fault_set("comm=b,kind=oops") == DPAR_EINVAL);
    memset(&d, 0, sizeof d);
    d.size = 1;
    d.name = "a";
    CHECK(dpar_group_create(&d, &ga) == DPAR_OK && dpar_group_join(ga, 0, &a) == DPAR_OK);
    d.name = "b";
    CHECK(dpar_group_create(&d, &gb) == DPAR_OK && dpar_group_join(gb, 0, &b) == DPAR_OK);
    CHECK(dpar_fault_set(NULL) == DPAR_OK);
    if (!a || !b) return;
    CHECK(dpar_barrier(a) == DPAR_OK && dpar_barrier(a) == DPAR_OK); /* rank=1: not this rank */
    { /* an asynchronous allreduce counts as one: its 2nd fails on the progress thread, and the request says so */
        dpar_request *q = NULL;
        CHECK(dpar_iallreduce(a, &x, &x, 1, DPAR_I32, DPAR_SUM, &q) == DPAR_OK && dpar_request_wait(q) == DPAR_OK);
        CHECK(dpar_iallreduce(a, &x, &x, 1, DPAR_I32, DPAR_SUM, &q) == DPAR_OK && dpar_request_wait(q) == DPAR_EIO);
        CHECK_MSG(strstr(dpar_last_error(), "a rank 0: injected fault") &&
                      strstr(dpar_last_error(), "its allreduce #2"),
                  "%s", dpar_last_error());
    }
    CHECK(dpar_allreduce(b, &x, &x, 1, DPAR_I32, DPAR_SUM) == DPAR_OK); /* op=any: #1 */
    CHECK(dpar_barrier(b) == DPAR_EIO);                                 /* #2 of any kind */
    CHECK_MSG(strstr(dpar_last_error(), "b rank 0: injected fault (DPAR_FAULT \"comm=b,rank=0,at=2,kind=fail\"): "
                                        "its barrier, operation #2 failed"),
              "%s", dpar_last_error());
    CHECK(dpar_barrier(b) == DPAR_EIO); /* poisoned */
    dpar_comm_destroy(a);
    dpar_comm_destroy(b);
    dpar_group_destroy(ga);
    dpar_group_destroy(gb);
}

/* DPAR_FAULT malformed: pool and group creation fail quoting it; dpar_fault_set wins. Run in a fresh process. */
static int env_child(void)
{
    dpar_pool *pool = NULL;
    dpar_group *g = NULL;
    dpar_comm_desc d;
    int bad = 0;
    memset(&d, 0, sizeof d);
    d.size = 2;
    if (dpar_pool_create(NULL, &pool) != DPAR_EINVAL ||
        !strstr(dpar_last_error(), "dpar_pool_create: DPAR_FAULT: \"at=-2\" in fault 1 (\"rank=1,at=-2,kind=fail\")"))
        bad |= 1, printf("    %s\n", dpar_last_error());
    if (dpar_group_create(&d, &g) != DPAR_EINVAL || !strstr(dpar_last_error(), "dpar_group_create: DPAR_FAULT"))
        bad |= 2, printf("    %s\n", dpar_last_error());
    if (dpar_pool_create(NULL, &pool) != DPAR_EINVAL) bad |= 4; /* every time, not only the first */
    if (dpar_fault_set(NULL) != DPAR_OK || dpar_pool_create(NULL, &pool) != DPAR_OK) bad |= 8;
    dpar_pool_destroy(pool);
    return bad;
}

/* DPAR_TIMEOUT_MS, DPAR_LOG malformed or a DPAR_TRACE file that cannot be made (argv[2]: the variable, argv[3]:
   what the error must say after "<call>: ", argv[4]: the status): pool and group creation fail with it, every
   time (a fresh process: DPAR_TRACE is read once, its failure kept); with the variable gone creation works
   (DPAR_TRACE: its failure stays) */
static int env_var_child(const char *var, const char *want, const char *status)
{
    dpar_pool *pool = NULL;
    dpar_group *g = NULL;
    dpar_comm_desc d;
    char full[512];
    int bad = 0, k;
    dpar_status st;
    memset(&d, 0, sizeof d);
    d.size = 2;
    for (k = 0; k < 2; k++) { /* every time, not only the first */
        st = dpar_pool_create(NULL, &pool);
        snprintf(full, sizeof full, "dpar_pool_create: %s", want);
        if (!strstr(dpar_status_string(st), status) || strncmp(dpar_last_error(), full, strlen(full)))
            bad |= 1, printf("    %s: %s\n", dpar_status_string(st), dpar_last_error());
        st = dpar_group_create(&d, &g);
        snprintf(full, sizeof full, "dpar_group_create: %s", want);
        if (!strstr(dpar_status_string(st), status) || strncmp(dpar_last_error(), full, strlen(full)))
            bad |= 2, printf("    %s: %s\n", dpar_status_string(st), dpar_last_error());
    }
    unsetenv(var);
    if (strcmp(var, "DPAR_TRACE") && (dpar_pool_create(NULL, &pool) != DPAR_OK || dpar_group_create(&d, &g) != DPAR_OK))
        bad |= 4, printf("    %s\n", dpar_last_error());
    dpar_pool_destroy(pool);
    dpar_group_destroy(g);
    return bad;
}

static int run_env_child(const char *var, const char *value, const char *want, const char *status)
{
    pid_t pid;
    int status_ = -1;
    fflush(stdout);
    pid = fork();
    if (pid == 0) {
        setenv(var, value, 1);
        if (!strcmp(var, "DPAR_FAULT")) execl("/proc/self/exe", "test_fault", "--env-child", (char *)NULL);
        else execl("/proc/self/exe", "test_fault", "--env-var-child", var, want, status, (char *)NULL);
        _exit(99);
    }
    if (pid <= 0 || waitpid(pid, &status_, 0) != pid) return -1;
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : 100 + WTERMSIG(status_);
}
static void test_fault_env(void)
{
    int rc = run_env_child("DPAR_FAULT", "rank=1,at=-2,kind=fail", NULL, NULL);
    CHECK_MSG(rc == 0, "DPAR_FAULT: the child says %d", rc);
    rc =
        run_env_child("DPAR_TIMEOUT_MS", "5s", "DPAR_TIMEOUT_MS=\"5s\" is not a number of milliseconds", "DPAR_EINVAL");
    CHECK_MSG(rc == 0, "DPAR_TIMEOUT_MS=5s: the child says %d", rc);
    rc =
        run_env_child("DPAR_TIMEOUT_MS", "-2", "DPAR_TIMEOUT_MS=\"-2\" is not a number of milliseconds", "DPAR_EINVAL");
    CHECK_MSG(rc == 0, "DPAR_TIMEOUT_MS=-2: the child says %d", rc);
    rc = run_env_child("DPAR_LOG", "verbose", "DPAR_LOG=\"verbose\" is not one of off, error, warn, info, debug",
                       "DPAR_EINVAL");
    CHECK_MSG(rc == 0, "DPAR_LOG=verbose: the child says %d", rc);
    rc = run_env_child("DPAR_TRACE", "/nonexistent-dir/t.json",
                       "DPAR_TRACE=\"/nonexistent-dir/t.json\": dpar_trace_start: cannot", "DPAR_EIO");
    CHECK_MSG(rc == 0, "DPAR_TRACE in a missing directory: the child says %d", rc);
}

int main(int argc, char **argv)
{
    pthread_t wd;
    if (argc > 1 && !strcmp(argv[1], "--env-child")) return env_child();
    if (argc > 4 && !strcmp(argv[1], "--env-var-child")) return env_var_child(argv[2], argv[3], argv[4]);
    DT_MAIN_BEGIN(argc, argv);
    pthread_create(&wd, NULL, watchdog_main, NULL);
    pthread_detach(wd);
    RUN(test_fault_spec_errors);
    RUN(test_fault_env);
    RUN(test_fault_filters);
    RUN(test_fault_barrier);
    RUN(test_fault_broadcast);
    RUN(test_fault_reduce);
    RUN(test_fault_reduce_scatter);
    RUN(test_fault_allgather);
    RUN(test_fault_allreduce);
    RUN(test_fault_alltoall);
    RUN(test_fault_alltoallv);
    RUN(test_fault_send);
    RUN(test_fault_recv);
    RUN(test_fault_bucket);
    RUN(test_fault_bucket_direct);
    RUN(test_fault_stage);
    RUN(test_fault_steal);
    RUN(test_fault_task);
    return dt_summary();
}
