/* test_pipe.c - pipeline schedules against their closed forms, the checker against hand-broken
   schedules, an MLP trained through p = 2 and 4 stages against sequential training, failing
   callbacks, buffer reuse and the trace. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <unistd.h>

#include "dpar_test.h"
#include "coll_matrix.h"
#include "json.h"
#include "pipe_mlp.h"

/* dpar_pipe_schedule_create of kind k, p stages, m micro-batches, v chunks per stage */
static dpar_status sched(int p, int m, int v, dpar_pipe_kind k, dpar_pipe_schedule **S)
{
    dpar_pipe_schedule_desc d = {0};
    d.kind = k, d.p = p, d.m = m, d.v = v;
    return dpar_pipe_schedule_create(&d, S);
}

/* ZB-H1's stash: 1F1B's most (min(m, p)) on every stage; and every stage's W's in micro-batch order, each after its
   B (what makes a split run the same bits as a whole backward) */
static int zb_stash_ok(const dpar_pipe_schedule *S)
{
    int s, k;
    for (s = 0; s < S->p; s++) {
        int next_w = 0, b_done = 0;
        if (S->peak_stash[s] != (S->m < S->p ? S->m : S->p)) return 0;
        for (k = 0; k < S->num_ops[s]; k++) {
            const dpar_pipe_op *op = &S->ops[s][k];
            if (op->code == DPAR_PIPE_BACKWARD_INPUT) b_done++;
            if (op->code == DPAR_PIPE_BACKWARD_WEIGHT && (op->micro != next_w++ || op->micro >= b_done)) return 0;
            if (op->code == DPAR_PIPE_BACKWARD) return 0;
        }
        if (next_w != S->m) return 0;
    }
    return 1;
}

static void test_schedules_match_closed_forms(void)
{
    int kind, p, m, v, bad = 0, checked = 0;
    for (kind = 0; kind < 4; kind++)
        for (p = 1; p <= 8; p++)
            for (m = 1; m <= 32; m++)
                for (v = (kind == 2 ? 2 : 1); v <= (kind == 2 ? 3 : 1); v++) {
                    dpar_pipe_schedule *S;
                    double want;
                    int s, stash = 0, ops = 0;
                    if (kind == 2 && m % p) continue;
                    if (sched(p, m, v, (dpar_pipe_kind)kind, &S) != DPAR_OK) {
                        printf("    kind %d p=%d m=%d v=%d: %s\n", kind, p, m, v, dpar_last_error());
                        bad++;
                        continue;
                    }
                    /* GPipe and 1F1B: (p-1)/(m+p-1). Interleaved: Megatron's bubble over ideal
                       time (p-1)/m divided by v, i.e. (p-1)/(v m + p - 1) of the makespan. ZB-H1 with F = B = W:
                       a makespan of 3m + p - 1 once m >= p, so a bubble of (p-1)/(3m+p-1) (a third of 1F1B's idle
                       time: the last stage's first forward waits p - 1); with fewer micro-batches one micro-batch's
                       forwards and input gradients through every stage (2p), 2 more per further micro-batch and the
                       last W: 2(m + p) - 1 */
                    want = kind < 2    ? (double)(p - 1) / (m + p - 1)
                           : kind == 2 ? (double)(p - 1) / ((double)v * m + p - 1)
                           : m >= p    ? (double)(p - 1) / (3.0 * m + p - 1)
                                       : 1.0 - 3.0 * m / (2.0 * (m + p) - 1);
                    for (s = 0; s < p; s++) {
                        if (S->peak_stash[s] > stash) stash = S->peak_stash[s];
                        ops += S->num_ops[s];
                    }
                    if (fabs(S->bubble - want) > 1e-12 || (kind == 0 && stash != m) ||
                        (kind == 1 && (stash > p || stash != (m < p ? m : p))) || (kind == 3 && !zb_stash_ok(S))) {
                        if (bad++ < 5)
                            printf("    kind %d p=%d m=%d v=%d: bubble %.6f (want %.6f), stash %d\n", kind, p, m, v,
                                   S->bubble, want, stash);
                    }
                    /* each stage: m v forwards and backwards (ZB-H1: B and W), and a send/receive pair per boundary */
                    if (ops != (kind == 3 ? 3 : 2) * m * v * p + 4 * m * (v * p - 1)) bad++;
                    checked++;
                    dpar_pipe_schedule_destroy(S);
                }
    CHECK_MSG(bad == 0, "%d of %d schedules off their closed forms", bad, checked);
    printf("    %d schedules checked\n", checked);
}

/* V schedules (ZBV, DualPipeV): the V placement (dpar_pipe_virtual_stage), each chunk's W's in micro-batch order
   after their B's (the whole backward's sums), the stash bounds, and the bubble against the lower bound of a flushed
   step with F = B = W: every stage has 6m unit ops, and stage p - 1 waits p - 1 chunk forwards for its first
   activation, so the makespan is at least 6m + p - 1 and the bubble at least (p-1)/(6m+p-1). Both meet it for every
   m >= 2p (ZBV with 2p stashes, DualPipeV 2p + 1); below, ZBV's greedy. With other costs: the same bound in time,
   (p-1) F over 2m (F + B + W) + (p-1) F. */
static int v_ok(const dpar_pipe_schedule *S, char *why, size_t n)
{
    int s, k, c;
    for (s = 0; s < S->p; s++) {
        int next_w[2] = {0, 0}, b_done[2] = {0, 0};
        if (dpar_pipe_virtual_stage(S, s, 0) != s || dpar_pipe_virtual_stage(S, s, 1) != 2 * S->p - 1 - s)
            return snprintf(why, n, "stage %d is not placed in a V", s), 0;
        for (k = 0; k < S->num_ops[s]; k++) {
            const dpar_pipe_op *op = &S->ops[s][k];
            if (op->code == DPAR_PIPE_BACKWARD) return snprintf(why, n, "stage %d has a whole backward", s), 0;
            if (op->code == DPAR_PIPE_BACKWARD_INPUT && op->micro != b_done[op->chunk]++)
                return snprintf(why, n, "stage %d op %d: B out of order", s, k), 0;
            if (op->code == DPAR_PIPE_BACKWARD_WEIGHT &&
                (op->micro != next_w[op->chunk]++ || op->micro >= b_done[op->chunk]))
                return snprintf(why, n, "stage %d op %d: W out of order or before its B", s, k), 0;
        }
        for (c = 0; c < 2; c++)
            if (next_w[c] != S->m) return snprintf(why, n, "stage %d chunk %d: %d W's", s, c, next_w[c]), 0;
    }
    return 1;
}

static void test_v_schedules(void)
{
    int kind, p, m, bad = 0, checked = 0;
    for (kind = DPAR_PIPE_ZBV; kind <= DPAR_PIPE_DUALPIPEV; kind++)
        for (p = 1; p <= 8; p++)
            for (m = 1; m <= 32; m++) {
                dpar_pipe_schedule *S;
                double bound = (double)(p - 1) / (6.0 * m + p - 1);
                int s, ops = 0, stash_ok = 1, most = kind == DPAR_PIPE_ZBV ? 2 * p : 2 * p + 1;
                char why[128] = "";
                if (kind == DPAR_PIPE_DUALPIPEV && m < 2 * p) {
                    CHECK(sched(p, m, 0, (dpar_pipe_kind)kind, &S) == DPAR_EINVAL && !S &&
                          strstr(dpar_last_error(), "at least 2p micro-batches"));
                    continue;
                }
                if (sched(p, m, 0, (dpar_pipe_kind)kind, &S) != DPAR_OK) {
                    printf("    kind %d p=%d m=%d: %s\n", kind, p, m, dpar_last_error());
                    bad++;
                    continue;
                }
                for (s = 0; s < p; s++) {
                    ops += S->num_ops[s];
                    stash_ok &= S->peak_stash[s] <= most;
                }
                if (S->v != 2 || !v_ok(S, why, sizeof why) || !stash_ok || S->bubble < bound - 1e-12 ||
                    (m >= 2 * p && fabs(S->bubble - bound) > 1e-12) ||
                    ops != 3 * m * 2 * p + 4 * m * (2 * p - 1)) { /* F, B, W per unit; 4 messages per boundary */
                    if (bad++ < 5)
                        printf("    kind %d p=%d m=%d: bubble %.6f (bound %.6f), stash ok %d, %d ops %s\n", kind, p, m,
                               S->bubble, bound, stash_ok, ops, why);
                }
                checked++;
                dpar_pipe_schedule_destroy(S);
            }
    CHECK_MSG(bad == 0, "%d of %d V schedules off their bounds", bad, checked);
    printf("    %d V schedules checked at F = B = W\n", checked);
    { /* ZBV on other costs (its greedy adapts to them, the fixed order does not: the shorter is kept): valid, 2p
         stashes, never below the bound in time */
        static const double costs[] = {0.5, 1, 2};
        int fi, bi, wi;
        bad = checked = 0;
        for (p = 2; p <= 6; p++)
            for (m = 2 * p - 1; m <= 3 * p; m += p - 1 > 0 ? p - 1 : 1)
                for (fi = 0; fi < 3; fi++)
                    for (bi = 0; bi < 3; bi++)
                        for (wi = 0; wi < 3; wi++) {
                            dpar_pipe_schedule_desc d = {0};
                            dpar_pipe_schedule *S;
                            double F = costs[fi], B = costs[bi], W = costs[wi];
                            double bound = (p - 1) * F / (2.0 * m * (F + B + W) + (p - 1) * F);
                            int s, stash_ok = 1;
                            char why[128] = "";
                            d.kind = DPAR_PIPE_ZBV, d.p = p, d.m = m;
                            d.cost_forward = F, d.cost_input_grad = B, d.cost_weight_grad = W;
                            if (dpar_pipe_schedule_create(&d, &S) != DPAR_OK) {
                                bad++;
                                continue;
                            }
                            for (s = 0; s < p; s++) stash_ok &= S->peak_stash[s] <= 2 * p;
                            if (!v_ok(S, why, sizeof why) || !stash_ok || S->bubble < bound - 1e-12) {
                                if (bad++ < 5)
                                    printf("    ZBV p=%d m=%d F=%g B=%g W=%g: bubble %.4f (bound %.4f) %s\n", p, m, F,
                                           B, W, S->bubble, bound, why);
                            }
                            checked++;
                            dpar_pipe_schedule_destroy(S);
                        }
        CHECK_MSG(bad == 0, "%d of %d ZBV schedules on other costs wrong", bad, checked);
        printf("    %d ZBV schedules on other op costs checked\n", checked);
    }
    { /* v: 0 or 2 */
        dpar_pipe_schedule *S;
        CHECK(sched(4, 8, 3, DPAR_PIPE_ZBV, &S) == DPAR_EINVAL && strstr(dpar_last_error(), "2 chunks per stage"));
        CHECK(sched(4, 8, 2, DPAR_PIPE_ZBV, &S) == DPAR_OK && S->v == 2);
        CHECK(dpar_pipe_virtual_stage(S, 3, 1) == 4 && dpar_pipe_virtual_stage(S, 0, 1) == 7 &&
              dpar_pipe_virtual_stage(S, 4, 0) == -1 && dpar_pipe_virtual_stage(S, 0, 2) == -1 &&
              dpar_pipe_virtual_stage(NULL, 0, 0) == -1);
        dpar_pipe_schedule_destroy(S);
        CHECK(sched(4, 8, 2, DPAR_PIPE_INTERLEAVED, &S) == DPAR_OK && dpar_pipe_virtual_stage(S, 3, 1) == 7 &&
              dpar_pipe_virtual_stage(S, 0, 1) == 4);
        dpar_pipe_schedule_destroy(S);
    }
}

/* schedules made with an allocator that fails its n-th call, for every n until one succeeds: each failure is
   DPAR_ENOMEM with *out NULL and nothing left allocated (ZBV makes two orders and keeps one: its copies too) */
typedef struct {
    int calls, fail_at, live;
} oom_counter;
static void *oom_alloc(void *user, size_t n)
{
    oom_counter *k = (oom_counter *)user;
    if (k->calls++ == k->fail_at) return NULL;
    k->live++;
    return malloc(n);
}
static void oom_free(void *user, void *ptr)
{
    oom_counter *k = (oom_counter *)user;
    if (ptr) k->live--;
    free(ptr);
}
static void test_schedules_out_of_memory(void)
{
    static const dpar_pipe_kind kinds[] = {DPAR_PIPE_ZB_H1, DPAR_PIPE_ZBV, DPAR_PIPE_DUALPIPEV};
    int ki;
    for (ki = 0; ki < 3; ki++) {
        oom_counter k;
        dpar_pipe_schedule_desc d = {0};
        dpar_pipe_schedule *S = NULL;
        dpar_status st = DPAR_ENOMEM;
        int failures = 0;
        d.kind = kinds[ki], d.p = 3, d.m = 6;
        d.allocator.alloc = oom_alloc, d.allocator.free = oom_free, d.allocator.user = &k;
        for (k.fail_at = 0; st == DPAR_ENOMEM && k.fail_at < 10000; k.fail_at++) {
            k.calls = k.live = 0;
            st = dpar_pipe_schedule_create(&d, &S);
            if (st == DPAR_ENOMEM) {
                CHECK_MSG(S == NULL && k.live == 0, "kind %d, allocation %d failed: %d blocks left", (int)kinds[ki],
                          k.fail_at, k.live);
                failures++;
            }
        }
        CHECK_MSG(st == DPAR_OK && S && S->bubble > 0, "kind %d: %s", (int)kinds[ki], dpar_last_error());
        dpar_pipe_schedule_destroy(S);
        CHECK(k.live == 0);
        printf("    kind %d: each of its %d allocations failed once: ENOMEM, nothing left\n", (int)kinds[ki], failures);
    }
}

static dpar_pipe_schedule *make(int p, int m, int v, dpar_pipe_kind k)
{
    dpar_pipe_schedule *S = NULL;
    if (sched(p, m, v, k, &S) != DPAR_OK) printf("    make: %s\n", dpar_last_error());
    return S;
}

static int find(dpar_pipe_schedule *S, int s, int code, int micro)
{
    int k;
    for (k = 0; k < S->num_ops[s]; k++)
        if (S->ops[s][k].code == code && S->ops[s][k].micro == micro) return k;
    return -1;
}

static void swap_ops(dpar_pipe_schedule *S, int s, int a, int b)
{
    dpar_pipe_op t = S->ops[s][a];
    S->ops[s][a] = S->ops[s][b];
    S->ops[s][b] = t;
}

static void remove_op(dpar_pipe_schedule *S, int s, int k)
{
    memmove(&S->ops[s][k], &S->ops[s][k + 1], (size_t)(S->num_ops[s] - k - 1) * sizeof(dpar_pipe_op));
    S->num_ops[s]--;
}

static void expect_broken(dpar_pipe_schedule *S, const char *rule)
{
    dpar_status st = dpar_pipe_schedule_check(S);
    CHECK_MSG(st == DPAR_EINVAL && strstr(dpar_last_error(), rule), "want '%s', got %s: %s", rule,
              dpar_status_string(st), dpar_last_error());
    dpar_pipe_schedule_destroy(S);
}

static void test_checker_rejects_broken_schedules(void)
{
    dpar_pipe_schedule *S, *T;
    /* a backward before its forward (the last stage of 1F1B does F0 then B0) */
    S = make(2, 4, 1, DPAR_PIPE_1F1B);
    swap_ops(S, 1, find(S, 1, DPAR_PIPE_FORWARD, 0), find(S, 1, DPAR_PIPE_BACKWARD, 0));
    expect_broken(S, "rule: every backward after its forward");
    /* a compute before the receive it needs */
    S = make(3, 4, 1, DPAR_PIPE_GPIPE);
    remove_op(S, 1, find(S, 1, DPAR_PIPE_RECV_ACT, 2));
    expect_broken(S, "rule: every receive before the compute that needs it");
    /* a send before the compute that makes it */
    S = make(2, 2, 1, DPAR_PIPE_GPIPE);
    swap_ops(S, 0, find(S, 0, DPAR_PIPE_FORWARD, 1), find(S, 0, DPAR_PIPE_SEND_ACT, 1));
    expect_broken(S, "rule: every send after the compute that makes it");
    /* a forward twice (the second replaces a backward) */
    S = make(2, 2, 1, DPAR_PIPE_GPIPE);
    S->ops[1][find(S, 1, DPAR_PIPE_BACKWARD, 1)].code = DPAR_PIPE_FORWARD;
    expect_broken(S, "appears twice");
    /* a stage that never sends an activation */
    S = make(2, 2, 1, DPAR_PIPE_GPIPE);
    remove_op(S, 0, find(S, 0, DPAR_PIPE_SEND_ACT, 1));
    expect_broken(S, "never does the send of the activation of micro-batch 1");
    /* receives in another order than the sends: stage 1 takes micro-batch 1 first */
    S = make(2, 4, 1, DPAR_PIPE_GPIPE);
    swap_ops(S, 1, find(S, 1, DPAR_PIPE_RECV_ACT, 0), find(S, 1, DPAR_PIPE_RECV_ACT, 1));
    swap_ops(S, 1, find(S, 1, DPAR_PIPE_FORWARD, 0), find(S, 1, DPAR_PIPE_FORWARD, 1));
    expect_broken(S, "rule: sends and receives between neighbours in the same order");
    /* a deadlock: stage 0 waits for the gradient of micro-batch 0 before sending its activation */
    S = make(2, 2, 1, DPAR_PIPE_GPIPE);
    {
        int k = find(S, 0, DPAR_PIPE_SEND_ACT, 0), r = find(S, 0, DPAR_PIPE_RECV_GRAD, 0);
        dpar_pipe_op recv = S->ops[0][r];
        remove_op(S, 0, r);
        memmove(&S->ops[0][k + 1], &S->ops[0][k], (size_t)(S->num_ops[0] - k) * sizeof(dpar_pipe_op));
        S->ops[0][k] = recv;
        S->num_ops[0]++;
    }
    expect_broken(S, "rule: no deadlock");
    /* the split backward: a W before its B; a W missing; a whole backward and a W of one unit; a B twice */
    S = make(2, 4, 1, DPAR_PIPE_ZB_H1);
    swap_ops(S, 0, find(S, 0, DPAR_PIPE_BACKWARD_INPUT, 1), find(S, 0, DPAR_PIPE_BACKWARD_WEIGHT, 1));
    expect_broken(S, "rule: every W after the B of its unit");
    S = make(2, 4, 1, DPAR_PIPE_ZB_H1);
    remove_op(S, 1, find(S, 1, DPAR_PIPE_BACKWARD_WEIGHT, 3));
    expect_broken(S, "never does the weight gradient (W) of micro-batch 3");
    S = make(2, 4, 1, DPAR_PIPE_ZB_H1);
    S->ops[1][find(S, 1, DPAR_PIPE_BACKWARD_INPUT, 2)].code = DPAR_PIPE_BACKWARD;
    expect_broken(S, "appears twice (rule: each backward once)");
    S = make(2, 4, 1, DPAR_PIPE_ZB_H1);
    S->ops[0][find(S, 0, DPAR_PIPE_BACKWARD_WEIGHT, 0)].code = DPAR_PIPE_BACKWARD_INPUT;
    expect_broken(S, "appears twice");
    /* the V's turn, a hand-off on stage p - 1 to itself: without its receive; received before it is sent (the
       stage would wait for itself); a V schedule's chunks */
    S = make(3, 6, 2, DPAR_PIPE_ZBV);
    {
        int k;
        for (k = 0; k < S->num_ops[2]; k++)
            if (S->ops[2][k].code == DPAR_PIPE_RECV_ACT && S->ops[2][k].chunk == 1 && S->ops[2][k].micro == 2) break;
        CHECK(k < S->num_ops[2]);
        remove_op(S, 2, k);
    }
    expect_broken(S, "comes before its activation is received");
    S = make(3, 6, 2, DPAR_PIPE_DUALPIPEV);
    {
        int k, send = -1, recv = -1;
        for (k = 0; k < S->num_ops[2]; k++) {
            const dpar_pipe_op *op = &S->ops[2][k];
            if (op->micro == 0 && op->code == DPAR_PIPE_SEND_ACT && op->chunk == 0) send = k;
            if (op->micro == 0 && op->code == DPAR_PIPE_RECV_ACT && op->chunk == 1) recv = k;
        }
        CHECK(send >= 0 && recv == send + 1); /* the hand-off: sent, then received at once */
        swap_ops(S, 2, send, recv);
        swap_ops(S, 2, send - 1, send); /* the receive before the forward that makes it */
    }
    expect_broken(S, "rule: no deadlock");
    S = make(2, 4, 2, DPAR_PIPE_ZBV);
    S->v = 3;
    expect_broken(S, "rule: v = 2");
    /* costs: bad ones refused; a W twice as long as F and B moves the predicted bubble as the simulation says */
    {
        dpar_pipe_schedule_desc d = {0};
        d.kind = DPAR_PIPE_ZB_H1, d.p = 2, d.m = 4, d.cost_weight_grad = -1;
        CHECK(dpar_pipe_schedule_create(&d, &T) == DPAR_EINVAL && T == NULL && strstr(dpar_last_error(), "cost"));
        d.cost_weight_grad = 0.0 / 0.0;
        CHECK(dpar_pipe_schedule_create(&d, &T) == DPAR_EINVAL && T == NULL);
        d.kind = DPAR_PIPE_1F1B, d.cost_forward = 1, d.cost_input_grad = 1, d.cost_weight_grad = 2;
        /* 1F1B with F = 1 and a whole backward of 3: (p-1)/(m+p-1) still, the shape does not change */
        CHECK(dpar_pipe_schedule_create(&d, &T) == DPAR_OK && fabs(T->bubble - 1.0 / 5) < 1e-12);
        dpar_pipe_schedule_destroy(T);
        /* ZB-H1, p = 2, m = 2, F = B = 1, W = 2, by hand: stage 0 F0 F1 . B0 W0= B1 W1= (B0 at 3: stage 1's B0 ends
           there; B1 at 6: after W0, its gradient came at 5), stage 1 . F0 B0 F1 B1 W0= W1=; both end at 9, each
           busy 8: bubble 1 - 16/18 */
        d.kind = DPAR_PIPE_ZB_H1, d.m = 2;
        CHECK(dpar_pipe_schedule_create(&d, &T) == DPAR_OK && fabs(T->bubble - 1.0 / 9) < 1e-12);
        dpar_pipe_schedule_destroy(T);
        CHECK(sched(2, 4, 1, (dpar_pipe_kind)6, &T) == DPAR_EINVAL && T == NULL);
    }
    /* out of range */
    S = make(2, 2, 1, DPAR_PIPE_GPIPE);
    S->ops[0][0].micro = 7;
    expect_broken(S, "outside 0..1");
    /* interleaved needs m >= p (and a multiple of p) */
    CHECK(sched(4, 2, 2, DPAR_PIPE_INTERLEAVED, &T) == DPAR_EINVAL);
    CHECK(strstr(dpar_last_error(), "m at least p") != NULL);
    CHECK(sched(4, 6, 2, DPAR_PIPE_INTERLEAVED, &T) == DPAR_EINVAL);
    CHECK(sched(0, 2, 1, DPAR_PIPE_GPIPE, &T) == DPAR_EINVAL);
    CHECK(sched(2, 2, 2, DPAR_PIPE_1F1B, &T) == DPAR_EINVAL); /* v > 1 is interleaved only */
    CHECK(dpar_pipe_schedule_create(NULL, &T) == DPAR_EINVAL && T == NULL);
    CHECK(sched(2, 2, 0, DPAR_PIPE_1F1B, &T) == DPAR_OK && T->v == 1); /* v 0: 1 */
    CHECK(dpar_pipe_schedule_destroy(T) == DPAR_OK && dpar_pipe_schedule_destroy(NULL) == DPAR_OK);
    CHECK(dpar_pipe_schedule_check(NULL) == DPAR_EINVAL);
    /* the formatted timeline */
    {
        char buf[4096];
        size_t n;
        S = make(2, 2, 1, DPAR_PIPE_1F1B);
        n = dpar_pipe_schedule_format(S, buf, sizeof buf);
        CHECK(n == strlen(buf) && strstr(buf, "predicted bubble 0.333") && strstr(buf, "stage 1 |") &&
              strstr(buf, "B1"));
        CHECK(dpar_pipe_schedule_format(S, NULL, 0) == n); /* snprintf-like */
        dpar_pipe_schedule_destroy(S);
    }
}

/* ---- the MLP through a pipeline of threads ---- */
typedef struct {
    pm_data d;
    dpar_pipe_schedule *S;
    pm_stage *st[8];
    int steps, fail_stage, fail_micro;
    dpar_status result[8];
    char msg[8][DPAR__ERROR_TEXT];
    dpar_pipe_stats stats[8];
} pipe_job;

static void pipe_rank(world *w, dpar_comm *c, int r)
{
    pipe_job *j = (pipe_job *)w->user;
    pm_stage *st = j->st[r];
    st->d = &j->d;
    st->fail_at = r == j->fail_stage ? j->fail_micro : -1;
    j->result[r] = pm_train_stage(st, c, j->S, j->steps, &j->stats[r]);
    snprintf(j->msg[r], sizeof j->msg[r], "%s", j->result[r] == DPAR_OK ? "" : dpar_last_error());
}

static void test_pipelined_mlp_matches_sequential(void)
{
    static const int ps[] = {2, 4}, ms[] = {4, 8};
    static const dpar_pipe_kind kinds[] = {DPAR_PIPE_1F1B,  DPAR_PIPE_GPIPE, DPAR_PIPE_INTERLEAVED,
                                           DPAR_PIPE_ZB_H1, DPAR_PIPE_ZBV,   DPAR_PIPE_DUALPIPEV};
    static const char *names[] = {"1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev"};
    /* the 1F1B run's weights and biases, per (p, m): every other schedule (the same forwards, and each layer's
       per-micro-batch gradients summed in micro-batch order: whole backwards, or B and W with each chunk's W's in
       order; only the places of the ops differ) must give the same bits, wherever its layers sit */
    static float bits[2][2][PM_LAYERS][PM_WIDTH * PM_WIDTH + PM_WIDTH];
    pipe_job *j = (pipe_job *)calloc(1, sizeof *j);
    dpar_linear ref[PM_LAYERS];
    int pi, mi, ki, r, l;
    pm_init(&j->d);
    pm_train_sequential(ref, &j->d, 20);
    j->steps = 20;
    j->fail_stage = -1;
    for (r = 0; r < 4; r++) j->st[r] = (pm_stage *)calloc(1, sizeof(pm_stage));
    for (ki = 0; ki < 6; ki++)
        for (pi = 0; pi < 2; pi++)
            for (mi = 0; mi < 2; mi++) {
                int p = ps[pi], m = ms[mi], v = ki == 2 || ki >= 4 ? 2 : 1, same = 1, c, lo, hi;
                double worst = 0;
                if (ki == 5 && m < 2 * p) continue; /* DualPipeV needs 2p micro-batches */
                j->S = make(p, m, v, kinds[ki]);
                CHECK(run_world(p, pipe_rank, j) == 0);
                for (r = 0; r < p; r++) {
                    double d;
                    CHECK_MSG(j->result[r] == DPAR_OK, "stage %d: %s", r, j->msg[r]);
                    d = pm_compare(j->st[r], ref);
                    if (d > worst) worst = d;
                    for (c = 0; c < v; c++)
                        for (pm_range(j->st[r], c, &lo, &hi), l = lo; l < hi; l++) {
                            float *w = bits[pi][mi][l], *b = w + PM_WIDTH * PM_WIDTH;
                            size_t nw = (size_t)pm_dims[l] * pm_dims[l + 1] * sizeof(float);
                            size_t nb = (size_t)pm_dims[l + 1] * sizeof(float);
                            if (ki == 0) memcpy(w, j->st[r]->L[l].w, nw), memcpy(b, j->st[r]->L[l].b, nb);
                            else same &= !memcmp(w, j->st[r]->L[l].w, nw) && !memcmp(b, j->st[r]->L[l].b, nb);
                        }
                    pm_stage_free(j->st[r]);
                }
                CHECK_MSG(worst <= 1e-5, "%s p=%d m=%d: %.2e from sequential training", names[ki], p, m, worst);
                CHECK_MSG(same, "%s p=%d m=%d: not bitwise equal to 1F1B's weights", names[ki], p, m);
                printf("    %s p=%d m=%d v=%d: within %.1e of sequential after 20 steps\n", names[ki], p, m, v, worst);
                dpar_pipe_schedule_destroy(j->S);
            }
    for (l = 0; l < PM_LAYERS; l++) dpar_linear_destroy(&ref[l]);
    for (r = 0; r < 4; r++) free(j->st[r]);
    free(j);
}

static void test_failing_callback_stops_every_stage(void)
{
    pipe_job *j = (pipe_job *)calloc(1, sizeof *j);
    int r, fail, kind;
    pm_init(&j->d);
    j->steps = 3;
    for (r = 0; r < 4; r++) j->st[r] = (pm_stage *)calloc(1, sizeof(pm_stage));
    for (kind = 0; kind < 2; kind++)
        for (fail = 0; fail < 4; fail++) {
            uint64_t t0 = dpar_time_ns();
            j->S = make(4, 4, 1, kind ? DPAR_PIPE_GPIPE : DPAR_PIPE_1F1B);
            j->fail_stage = fail;
            j->fail_micro = fail % 4;
            run_world(4, pipe_rank, j);
            for (r = 0; r < 4; r++) {
                char want[64];
                snprintf(want, sizeof want, "stage %d cannot do micro-batch %d", fail, fail % 4);
                CHECK_MSG(j->result[r] == DPAR_EUSER && strstr(j->msg[r], want) && strstr(j->msg[r], "the forward"),
                          "fail on stage %d: stage %d got %s: %s", fail, r, dpar_status_string(j->result[r]),
                          j->msg[r]);
                pm_stage_free(j->st[r]);
            }
            CHECK((dpar_time_ns() - t0) < 2000000000u); /* no stage waited for a timeout */
            dpar_pipe_schedule_destroy(j->S);
        }
    printf("    e.g. %s\n", j->msg[0]);
    for (r = 0; r < 4; r++) free(j->st[r]);
    free(j);
}

/* ---- activation recomputation: the MLP's layer inputs (acts) and outputs (pre) in dpar_pipe_saved's buffers ----
   keep: both saved from forward to backward; full: both recomputed before the backward (nothing kept);
   selective: the outputs (the GEMMs') saved, the inputs recomputed from them without a GEMM (ReLU of the saved
   output). Each must train the same bits as the stage that keeps everything itself (pm_stage), and hold as many
   buffers at once as dpar_pipe_stats predicts, counted through the runner's allocator. */
enum { RC_KEEP, RC_FULL, RC_SELECTIVE };
#define RC_ACTS ((size_t)(PM_LAYERS + 1) * PM_BATCH * PM_WIDTH * sizeof(float))
#define RC_PRE ((size_t)PM_LAYERS * PM_BATCH * PM_WIDTH * sizeof(float))
typedef struct {
    pm_stage *st;
    dpar_pipe *pp;
    int mode;
    float scratch[RC_ACTS / sizeof(float) + RC_PRE / sizeof(float)]; /* a first pass's activations, not kept */
} rc_stage;
typedef struct { /* counts the runner's allocations of the saved and recompute sizes */
    size_t sizes[2];
    int count[2];
} rc_counter;
static void *rc_alloc(void *user, size_t n)
{
    rc_counter *k = (rc_counter *)user;
    /* dpar's allocations ask for what they need plus a cache line and a pointer (its alignment) */
    k->count[0] += k->sizes[0] && n >= k->sizes[0] && n <= k->sizes[0] + 128;
    k->count[1] += k->sizes[1] && n >= k->sizes[1] && n <= k->sizes[1] + 128;
    return malloc(n);
}
static void rc_free(void *user, void *ptr)
{
    (void)user;
    free(ptr);
}
/* where this call's layer inputs and outputs live */
static void rc_arrays(rc_stage *r, float (**acts)[PM_BATCH * PM_WIDTH], float (**pre)[PM_BATCH * PM_WIDTH])
{
    void *re, *saved = dpar_pipe_saved(r->pp, &re);
    float *a = r->scratch, *o = r->scratch + RC_ACTS / sizeof(float);
    if (r->mode == RC_KEEP) a = (float *)saved, o = (float *)saved + RC_ACTS / sizeof(float);
    if (r->mode == RC_FULL && re) a = (float *)re, o = (float *)re + RC_ACTS / sizeof(float);
    if (r->mode == RC_SELECTIVE) o = (float *)saved, a = re ? (float *)re : a;
    *acts = (float(*)[PM_BATCH * PM_WIDTH]) a;
    *pre = (float(*)[PM_BATCH * PM_WIDTH]) o;
}
static dpar_status rc_forward(void *user, int micro, int chunk, const void *in, void *out)
{
    rc_stage *r = (rc_stage *)user;
    pm_stage *st = r->st;
    float(*acts)[PM_BATCH * PM_WIDTH], (*pre)[PM_BATCH * PM_WIDTH];
    const float *x = in ? (const float *)in : st->d->x + (size_t)micro * st->rows * 8;
    void *re;
    int lo, hi, l, i;
    pm_range(st, chunk, &lo, &hi);
    dpar_pipe_saved(r->pp, &re);
    rc_arrays(r, &acts, &pre);
    if (re && r->mode == RC_SELECTIVE) { /* the outputs are kept: the inputs are the input and ReLUs of them */
        memcpy(acts[lo], x, (size_t)st->rows * (size_t)pm_dims[lo] * sizeof(float));
        for (l = lo; l + 1 < hi; l++)
            for (i = 0; i < st->rows * pm_dims[l + 1]; i++) acts[l + 1][i] = pre[l][i] < 0 ? 0 : pre[l][i];
        return out ? dpar_set_error(DPAR_EUSER, "a recomputed forward was given an output") : DPAR_OK;
    }
    {
        float *y = pm_forward(st->L, lo, hi, x, st->rows, acts, pre);
        if (re && out) return dpar_set_error(DPAR_EUSER, "a recomputed forward was given an output");
        if (out) memcpy(out, y, (size_t)st->rows * PM_WIDTH * sizeof(float));
    }
    return DPAR_OK;
}
static dpar_status rc_backward(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    rc_stage *r = (rc_stage *)user;
    pm_stage *st = r->st;
    float(*acts)[PM_BATCH * PM_WIDTH], (*pre)[PM_BATCH * PM_WIDTH], dy[PM_BATCH * 4];
    int lo, hi;
    (void)in;
    pm_range(st, chunk, &lo, &hi);
    rc_arrays(r, &acts, &pre);
    if (r->mode != RC_KEEP && acts == (float(*)[PM_BATCH * PM_WIDTH]) r->scratch)
        return dpar_set_error(DPAR_EUSER, "a backward without its recomputed activations");
    if (!grad_out) {
        const float *y = pre[PM_LAYERS - 1], *t = st->d->t + (size_t)micro * st->rows * 4;
        int i;
        for (i = 0; i < st->rows * 4; i++) dy[i] = 2.0f * (y[i] - t[i]) / (PM_BATCH * 4);
        grad_out = dy;
    }
    pm_backward(st->L, lo, hi, (const float *)grad_out, (float *)grad_in, st->rows, acts, pre);
    return DPAR_OK;
}
/* the split halves (ZB-H1, ZBV, DualPipeV): B with the recomputed arrays, W with the same ones (they live until W) */
static dpar_status rc_backward_input(void *user, int micro, int chunk, const void *in, const void *grad_out,
                                     void *grad_in)
{
    rc_stage *r = (rc_stage *)user;
    pm_stage *st = r->st;
    float(*acts)[PM_BATCH * PM_WIDTH], (*pre)[PM_BATCH * PM_WIDTH], dy[PM_BATCH * 4];
    int lo, hi;
    (void)in;
    pm_range(st, chunk, &lo, &hi);
    rc_arrays(r, &acts, &pre);
    if (!grad_out) {
        const float *y = pre[PM_LAYERS - 1], *t = st->d->t + (size_t)micro * st->rows * 4;
        int i;
        for (i = 0; i < st->rows * 4; i++) dy[i] = 2.0f * (y[i] - t[i]) / (PM_BATCH * 4);
        grad_out = dy;
    }
    pm_backward_input(st->L, lo, hi, (const float *)grad_out, (float *)grad_in, st->rows, acts, pre,
                      st->gl[micro * st->v + chunk]);
    return DPAR_OK;
}
static dpar_status rc_backward_weight(void *user, int micro, int chunk, const void *in, const void *grad_out)
{
    rc_stage *r = (rc_stage *)user;
    float(*acts)[PM_BATCH * PM_WIDTH], (*pre)[PM_BATCH * PM_WIDTH];
    int lo, hi;
    (void)in, (void)grad_out;
    pm_range(r->st, chunk, &lo, &hi);
    rc_arrays(r, &acts, &pre);
    pm_backward_weight(r->st->L, lo, hi, r->st->rows, acts, r->st->gl[micro * r->st->v + chunk]);
    return DPAR_OK;
}

typedef struct {
    pm_data d;
    dpar_pipe_schedule *S;
    int mode, steps;
    pm_stage *st[4];
    rc_stage rc[4];
    rc_counter count[4];
    dpar_pipe_stats stats[4];
    dpar_status result[4];
    char msg[4][DPAR__ERROR_TEXT];
} rc_job;
static void rc_rank(world *w, dpar_comm *c, int r)
{
    rc_job *j = (rc_job *)w->user;
    pm_stage *st = j->st[r];
    rc_stage *rs = &j->rc[r];
    dpar_pipe_desc pd;
    dpar_status rc = DPAR_OK;
    int s, ch, lo, hi;
    (void)w;
    memset(st, 0, sizeof *st);
    st->d = &j->d, st->fail_at = -1, st->p = j->S->p, st->m = j->S->m, st->v = j->S->v, st->stage = r;
    st->S = j->S;
    st->rows = PM_BATCH / st->m;
    pm_range(st, 0, &st->lo, &st->hi);
    for (ch = 0; ch < st->v; ch++) {
        pm_range(st, ch, &lo, &hi);
        pm_layers(st->L, st->d, lo, hi);
    }
    rs->st = st, rs->mode = j->mode;
    j->count[r].sizes[0] = j->mode == RC_FULL ? 0 : j->mode == RC_KEEP ? RC_ACTS + RC_PRE : RC_PRE;
    j->count[r].sizes[1] = j->mode == RC_KEEP ? 0 : j->mode == RC_FULL ? RC_ACTS + RC_PRE : RC_ACTS;
    j->count[r].count[0] = j->count[r].count[1] = 0;
    memset(&pd, 0, sizeof pd);
    pd.schedule = j->S, pd.comm = c, pd.act_bytes = (size_t)st->rows * PM_WIDTH * sizeof(float);
    pd.forward = rc_forward, pd.backward = rc_backward, pd.user = rs;
    pd.backward_input = rc_backward_input, pd.backward_weight = rc_backward_weight;
    pd.saved_bytes = j->count[r].sizes[0], pd.recompute_bytes = j->count[r].sizes[1];
    pd.allocator.alloc = rc_alloc, pd.allocator.free = rc_free, pd.allocator.user = &j->count[r];
    rc = dpar_pipe_create(&pd, &rs->pp);
    for (s = 0; s < j->steps && rc == DPAR_OK; s++) {
        rc = dpar_pipe_run(rs->pp, &j->stats[r]);
        for (ch = 0; ch < st->v && rc == DPAR_OK; ch++) {
            pm_range(st, ch, &lo, &hi);
            pm_sgd(st->L, lo, hi);
        }
    }
    j->result[r] = rc;
    snprintf(j->msg[r], sizeof j->msg[r], "%s", rc == DPAR_OK ? "" : dpar_last_error());
    dpar_pipe_destroy(rs->pp);
}

/* the most units of stage s between their B and their W at once (a recompute buffer lives from just before B to
   the end of W), counted from the ops */
static int b_to_w(const dpar_pipe_schedule *S, int s)
{
    int k, live = 0, most = 0;
    for (k = 0; k < S->num_ops[s]; k++) {
        live += S->ops[s][k].code == DPAR_PIPE_BACKWARD_INPUT;
        if (live > most) most = live;
        live -= S->ops[s][k].code == DPAR_PIPE_BACKWARD_WEIGHT;
    }
    return most;
}

static void test_recomputation_same_bits_predicted_memory(void)
{
    static const char *modes[] = {"keep", "full", "selective"};
    static const dpar_pipe_kind kinds[] = {DPAR_PIPE_1F1B, DPAR_PIPE_GPIPE, DPAR_PIPE_ZB_H1, DPAR_PIPE_ZBV,
                                           DPAR_PIPE_DUALPIPEV};
    static const char *names[] = {"1f1b", "gpipe", "zb-h1", "zbv", "dualpipev"};
    rc_job *j = (rc_job *)calloc(1, sizeof *j);
    pipe_job *ref = (pipe_job *)calloc(1, sizeof *ref);
    int ki, mode, r, l, p = 4, m = 8;
    pm_init(&j->d);
    pm_init(&ref->d);
    for (r = 0; r < 4; r++)
        j->st[r] = (pm_stage *)calloc(1, sizeof(pm_stage)), ref->st[r] = (pm_stage *)calloc(1, sizeof(pm_stage));
    j->steps = ref->steps = 5;
    ref->fail_stage = -1;
    for (ki = 0; ki < 5; ki++) {
        /* the reference: the stage that keeps everything itself, the same schedule */
        ref->S = make(p, m, ki >= 3 ? 2 : 1, kinds[ki]);
        CHECK(run_world(p, pipe_rank, ref) == 0);
        for (mode = 0; mode < 3; mode++) {
            j->S = ref->S;
            j->mode = mode;
            CHECK(run_world(p, rc_rank, j) == 0);
            for (r = 0; r < p; r++) {
                const dpar_pipe_stats *st = &j->stats[r];
                /* the predictions' closed forms: saved buffers live from F to the backward's end (1F1B and GPipe:
                   the schedule's stash; ZB-H1: until W); recompute ones from the backward (B) to its end: 1 for a
                   whole backward, on ZB-H1 stage r's W comes r B's later, so r + 1; V schedules: counted from the
                   ops (B to W) */
                int want_saved = mode == RC_FULL ? 0 : j->S->peak_stash[r];
                int want_re = mode == RC_KEEP                ? 0
                              : kinds[ki] == DPAR_PIPE_ZB_H1 ? (r + 1 < m ? r + 1 : m)
                              : j->S->v == 2                 ? b_to_w(j->S, r)
                                                             : 1;
                int same = 1, c, lo, hi;
                CHECK_MSG(j->result[r] == DPAR_OK, "%s %s stage %d: %s", names[ki], modes[mode], r, j->msg[r]);
                CHECK_MSG(st->predicted_saved == want_saved && st->peak_saved == want_saved &&
                              j->count[r].count[0] == want_saved && st->predicted_recomputed == want_re &&
                              st->peak_recomputed == want_re && j->count[r].count[1] == want_re,
                          "%s %s stage %d: saved %d predicted, %d held, %d allocated (want %d); recomputed %d, %d, %d "
                          "(want %d)",
                          names[ki], modes[mode], r, st->predicted_saved, st->peak_saved, j->count[r].count[0],
                          want_saved, st->predicted_recomputed, st->peak_recomputed, j->count[r].count[1], want_re);
                for (c = 0; c < j->S->v; c++)
                    for (pm_range(j->st[r], c, &lo, &hi), l = lo; l < hi; l++) {
                        size_t nw = (size_t)pm_dims[l] * pm_dims[l + 1] * sizeof(float);
                        same &= !memcmp(j->st[r]->L[l].w, ref->st[r]->L[l].w, nw) &&
                                !memcmp(j->st[r]->L[l].b, ref->st[r]->L[l].b, (size_t)pm_dims[l + 1] * sizeof(float));
                    }
                CHECK_MSG(same, "%s %s stage %d: not the bits of the stage that keeps everything", names[ki],
                          modes[mode], r);
                pm_stage_free(j->st[r]);
            }
            printf("    %s %s: stage 0 holds %d saved + %d recompute buffers at most, stage 3 %d + %d: as predicted, "
                   "same bits\n",
                   names[ki], modes[mode], j->stats[0].peak_saved, j->stats[0].peak_recomputed, j->stats[3].peak_saved,
                   j->stats[3].peak_recomputed);
        }
        for (r = 0; r < p; r++) pm_stage_free(ref->st[r]);
        dpar_pipe_schedule_destroy(ref->S);
    }
    for (r = 0; r < 4; r++) free(j->st[r]), free(ref->st[r]);
    free(j);
    free(ref);
}

/* buffers: allocated in the first run, reused after; the trace has every op on its stage's track */
typedef struct {
    dpar_pipe_schedule *S;
    int buffers[4][3];
} reuse_job;
static dpar_status sleepy_forward(void *user, int micro, int chunk, const void *in, void *out)
{
    (void)user;
    (void)micro;
    (void)chunk;
    (void)in;
    if (out) memset(out, 0, 64);
    return DPAR_OK;
}
static dpar_status sleepy_backward(void *user, int micro, int chunk, const void *in, const void *g, void *gi)
{
    (void)user;
    (void)micro;
    (void)chunk;
    (void)in;
    (void)g;
    if (gi) memset(gi, 0, 64);
    return DPAR_OK;
}
static dpar_status sleepy_weight(void *user, int micro, int chunk, const void *in, const void *g)
{
    (void)user, (void)micro, (void)chunk, (void)in, (void)g;
    return DPAR_OK;
}
/* the split backward's buffers: a forward writes its micro-batch's mark (micro + 1) into its activation, B the
   negative mark into the input's gradient; B and W each check that `in` and `grad_out` still hold the marks of
   their micro-batch (W runs later: a buffer given back after B would hold another micro-batch's by then) */
static dpar_status marked_forward(void *user, int micro, int chunk, const void *in, void *out)
{
    (void)user, (void)chunk;
    if (in && *(const int *)in != micro + 1)
        return dpar_set_error(DPAR_EUSER, "forward %d: in holds %d", micro, *(const int *)in);
    if (out) memset(out, 0, 64), *(int *)out = micro + 1;
    return DPAR_OK;
}
static dpar_status marked_check(const char *who, int micro, const void *in, const void *g)
{
    if (in && *(const int *)in != micro + 1)
        return dpar_set_error(DPAR_EUSER, "%s %d: in holds %d", who, micro, *(const int *)in);
    if (g && *(const int *)g != -(micro + 1))
        return dpar_set_error(DPAR_EUSER, "%s %d: grad_out holds %d", who, micro, *(const int *)g);
    return DPAR_OK;
}
static dpar_status marked_input(void *user, int micro, int chunk, const void *in, const void *g, void *gi)
{
    (void)user, (void)chunk;
    if (gi) memset(gi, 0, 64), *(int *)gi = -(micro + 1);
    return marked_check("B", micro, in, g);
}
static dpar_status marked_weight(void *user, int micro, int chunk, const void *in, const void *g)
{
    (void)user, (void)chunk;
    return marked_check("W", micro, in, g);
}
/* a runner of 64-byte activations whose forward writes zeros (split schedules: backward as B, W doing nothing) */
static dpar_status zero_pipe(dpar_pipe_schedule *S, dpar_comm *c, dpar_pipe_backward_fn backward, void *user,
                             dpar_pipe **pp)
{
    dpar_pipe_desc d;
    memset(&d, 0, sizeof d);
    d.schedule = S;
    d.comm = c;
    d.act_bytes = 64;
    d.forward = sleepy_forward;
    d.backward = backward;
    d.backward_input = backward;
    d.backward_weight = sleepy_weight;
    d.user = user;
    return dpar_pipe_create(&d, pp);
}

static void reuse_rank(world *w, dpar_comm *c, int r)
{
    reuse_job *j = (reuse_job *)w->user;
    dpar_pipe *pp;
    dpar_pipe_stats s;
    dpar_comm_stats cs;
    int k, sends = 0, recvs = 0;
    if (j->S->kind == DPAR_PIPE_ZB_H1) { /* a split schedule needs both halves, a whole one its backward */
        dpar_pipe_desc d;
        memset(&d, 0, sizeof d);
        d.schedule = j->S, d.comm = c, d.act_bytes = 64, d.forward = sleepy_forward, d.backward = sleepy_backward;
        d.backward_weight = sleepy_weight;
        pp = (dpar_pipe *)&d;
        if (dpar_pipe_create(&d, &pp) != DPAR_EINVAL || pp || !strstr(dpar_last_error(), "backward_input"))
            note(w, "stage %d: a ZB-H1 runner without backward_input: %s", r, dpar_last_error());
    }
    expect_ok(w, zero_pipe(j->S, c, sleepy_backward, NULL, &pp), "pipe_create", r);
    if (j->S->kind == DPAR_PIPE_ZB_H1) { /* marked buffers: W must see what B saw */
        pp->d.forward = marked_forward, pp->d.backward_input = marked_input, pp->d.backward_weight = marked_weight;
    }
    expect_ok(w, dpar_comm_stats_reset(c), "stats_reset", r);
    for (k = 0; k < 3; k++) {
        expect_ok(w, dpar_pipe_run(pp, &s), "pipe_run", r);
        j->buffers[r][k] = s.buffers;
    }
    /* the messages show in the comm's counters: one send or receive per op of the schedule */
    for (k = 0; k < j->S->num_ops[r]; k++) {
        sends += j->S->ops[r][k].code == DPAR_PIPE_SEND_ACT || j->S->ops[r][k].code == DPAR_PIPE_SEND_GRAD;
        recvs += j->S->ops[r][k].code == DPAR_PIPE_RECV_ACT || j->S->ops[r][k].code == DPAR_PIPE_RECV_GRAD;
    }
    expect_ok(w, dpar_comm_stats_get(c, &cs), "stats_get", r);
    if (cs.by_coll[DPAR_COLL_SEND].calls != (uint64_t)(3 * sends) ||
        cs.by_coll[DPAR_COLL_SEND].bytes_sent != (uint64_t)(3 * sends * 64) ||
        cs.by_coll[DPAR_COLL_RECV].calls != (uint64_t)(3 * recvs) ||
        cs.by_coll[DPAR_COLL_RECV].bytes_received != (uint64_t)(3 * recvs * 64))
        note(w, "stage %d: counters say %llu sends, %llu receives; the schedule %d, %d per run", r,
             (unsigned long long)cs.by_coll[DPAR_COLL_SEND].calls, (unsigned long long)cs.by_coll[DPAR_COLL_RECV].calls,
             sends, recvs);
    dpar_pipe_destroy(pp);
}

static void test_buffers_reused_and_traced(void)
{
    reuse_job j;
    char path[] = "/tmp/dpar_pipe_trace_XXXXXX", *text;
    int fd = mkstemp(path), r, kind, f = 0, b = 0, sends = 0, recvs = 0;
    FILE *fp;
    long n;
    close(fd);
    for (kind = 0; kind < 4; kind++) {
        j.S = make(4, 8, kind == 2 ? 2 : 1, (dpar_pipe_kind)kind);
        if (kind == 1) CHECK(dpar_trace_start(path) == DPAR_OK);
        CHECK(run_world(4, reuse_rank, &j) == 0);
        if (kind == 1) CHECK(dpar_trace_stop() == DPAR_OK);
        for (r = 0; r < 4; r++)
            CHECK_MSG(j.buffers[r][0] > 0 && j.buffers[r][1] == j.buffers[r][0] && j.buffers[r][2] == j.buffers[r][0],
                      "kind %d stage %d: %d, %d, %d buffers after runs 1, 2, 3", kind, r, j.buffers[r][0],
                      j.buffers[r][1], j.buffers[r][2]);
        dpar_pipe_schedule_destroy(j.S);
    }
    fp = fopen(path, "rb");
    fseek(fp, 0, SEEK_END);
    n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    text = (char *)malloc((size_t)n + 1);
    n = (long)fread(text, 1, (size_t)n, fp);
    text[n] = 0;
    fclose(fp);
    {
        jv *doc = jv_parse(text), *ev;
        CHECK(doc != NULL);
        for (ev = doc && jv_get(doc, "traceEvents") ? jv_get(doc, "traceEvents")->child : NULL; ev; ev = ev->next) {
            jv *name = jv_get(ev, "name"), *cat = jv_get(ev, "cat");
            if (!name || !cat || name->type != JV_STR || strcmp(cat->str, "pipe")) continue;
            f += name->str[0] == 'F';
            b += name->str[0] == 'B';
            sends += !strncmp(name->str, "send", 4);
            recvs += !strncmp(name->str, "recv", 4);
        }
        jv_free(doc);
    }
    /* GPipe p=4 m=8, one run traced... three runs: 3 x 4 x 8 forwards */
    CHECK_MSG(f == 96 && b == 96 && sends == 3 * 2 * 3 * 8 && recvs == sends, "F %d B %d send %d recv %d", f, b, sends,
              recvs);
    free(text);
    remove(path);
}

/* A timeout after the messages of a run names the collective the slow stage is in, not its last
   message: p = 2, m = 1; stage 0's backward outlasts the timeout, so stage 1 gives up in the run's
   closing allreduce while stage 0 was last seen in the run's opening barrier (#1), its receive since. */
typedef struct {
    dpar_status st[2];
    char msg[2][DPAR__ERROR_TEXT];
    dpar_pipe_schedule *S;
} late_job;
static dpar_status late_backward(void *user, int micro, int chunk, const void *in, const void *g, void *gi)
{
    (void)micro;
    (void)chunk;
    (void)in;
    (void)g;
    if (*(const int *)user == 0) usleep(600 * 1000);
    if (gi) memset(gi, 0, 64);
    return DPAR_OK;
}
static void late_rank(world *w, dpar_comm *c, int r)
{
    late_job *j = (late_job *)w->user;
    dpar_pipe *pp = NULL;
    expect_ok(w, zero_pipe(j->S, c, late_backward, &r, &pp), "pipe_create", r);
    j->st[r] = dpar_pipe_run(pp, NULL);
    snprintf(j->msg[r], sizeof j->msg[r], "%s", dpar_last_error());
    dpar_pipe_destroy(pp);
}
static void test_timeout_names_the_collective(void)
{
    late_job j;
    dpar_comm_desc d;
    dpar_pipe_schedule_desc sd;
    memset(&j, 0, sizeof j);
    memset(&d, 0, sizeof d);
    memset(&sd, 0, sizeof sd);
    sd.kind = DPAR_PIPE_GPIPE, sd.p = 2, sd.m = 1;
    CHECK(dpar_pipe_schedule_create(&sd, &j.S) == DPAR_OK);
    d.timeout_ms = 200;
    run_world_desc(2, &d, late_rank, &j, NULL, 0);
    CHECK_MSG(j.st[1] == DPAR_ETIMEDOUT && strstr(j.msg[1], "rank 0 never arrived (its last call: barrier #1"),
              "stage 1 got %s: %s", dpar_status_string(j.st[1]), j.msg[1]);
    printf("    e.g. %s\n", j.msg[1]);
    dpar_pipe_schedule_destroy(j.S);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_schedules_match_closed_forms);
    RUN(test_v_schedules);
    RUN(test_schedules_out_of_memory);
    RUN(test_checker_rejects_broken_schedules);
    RUN(test_pipelined_mlp_matches_sequential);
    RUN(test_failing_callback_stops_every_stage);
    RUN(test_recomputation_same_bits_predicted_memory);
    RUN(test_buffers_reused_and_traced);
    RUN(test_timeout_names_the_collective);
    pools_free();
    return dt_summary();
}
