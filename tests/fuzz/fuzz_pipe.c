/* fuzz_pipe.c - libFuzzer target of the pipeline schedule checker (>>pipe) fed arbitrary op lists.
   Input:    byte 0: p (1..4), byte 1: m (1..4), byte 2: v (1..2) and the kind (any of the six: the V kinds
             place chunks in a V, with a stage's hand-off to itself), then per stage a count byte and that many
             3-byte ops (code, micro, chunk; the values go out of range on purpose; codes include B and W).
   Property: dpar_pipe_schedule_check never crashes and says DPAR_OK or DPAR_EINVAL with a message; when it
             says DPAR_OK, an independent pass agrees that every stage runs each (micro, chunk) forward once and
             its backward once (whole, or B and W), and the schedule then runs on p thread ranks (timeout 5 s)
             without error, calling every forward, backward, B and W exactly as often: the checker's no-deadlock
             claim holds on the real runner. dpar_pipe_schedule_format never writes past its buffer. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"
#include "fuzz_common.h"

typedef struct {
    dpar_pipe_schedule *S;
    dpar_group *g;
    int calls[4][4][4][2]; /* stage, forward/backward/B/W, micro, chunk */
    dpar_status st[4];
} run_ctx;
typedef struct {
    run_ctx *r;
    int stage;
} stage_ctx;

static dpar_status fwd(void *user, int micro, int chunk, const void *in, void *out)
{
    stage_ctx *s = (stage_ctx *)user;
    s->r->calls[s->stage][0][micro][chunk]++;
    if (out) memset(out, micro, 8);
    (void)in;
    return DPAR_OK;
}
static dpar_status bwd(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    stage_ctx *s = (stage_ctx *)user;
    s->r->calls[s->stage][1][micro][chunk]++;
    if (grad_in) memset(grad_in, chunk, 8);
    (void)in, (void)grad_out;
    return DPAR_OK;
}
static dpar_status bwd_input(void *user, int micro, int chunk, const void *in, const void *grad_out, void *grad_in)
{
    stage_ctx *s = (stage_ctx *)user;
    s->r->calls[s->stage][2][micro][chunk]++;
    if (grad_in) memset(grad_in, chunk, 8);
    (void)in, (void)grad_out;
    return DPAR_OK;
}
static dpar_status bwd_weight(void *user, int micro, int chunk, const void *in, const void *grad_out)
{
    stage_ctx *s = (stage_ctx *)user;
    s->r->calls[s->stage][3][micro][chunk]++;
    (void)in, (void)grad_out;
    return DPAR_OK;
}
static void *stage_main(void *arg)
{
    stage_ctx *s = (stage_ctx *)arg;
    dpar_comm *c;
    dpar_pipe *pipe = NULL;
    dpar_pipe_desc d;
    dpar_status st = dpar_group_join(s->r->g, s->stage, &c);
    if (st == DPAR_OK) {
        memset(&d, 0, sizeof d);
        d.schedule = s->r->S;
        d.comm = c;
        d.act_bytes = 8;
        d.forward = fwd;
        d.backward = bwd;
        d.backward_input = bwd_input;
        d.backward_weight = bwd_weight;
        d.user = s;
        st = dpar_pipe_create(&d, &pipe);
        if (st == DPAR_OK) st = dpar_pipe_run(pipe, NULL);
        dpar_pipe_destroy(pipe);
        dpar_comm_destroy(c);
    }
    s->r->st[s->stage] = st;
    return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    dpar_pipe_schedule S;
    int num[4], peak[4], s, k;
    dpar_pipe_op *ops[4];
    size_t at = 3;
    dpar_status st;
    char text[256];
    if (n < 3) return 0;
    memset(&S, 0, sizeof S);
    S.p = 1 + data[0] % 4;
    S.m = 1 + data[1] % 4;
    S.v = 1 + (data[2] & 1);
    S.kind = (dpar_pipe_kind)((data[2] >> 1) % 6);
    for (s = 0; s < S.p; s++) {
        num[s] = at < n ? data[at++] % 48 : 0;
        ops[s] = (dpar_pipe_op *)calloc((size_t)num[s] + 1, sizeof(dpar_pipe_op));
        for (k = 0; k < num[s]; k++) {
            ops[s][k].code = at < n ? (signed char)data[at++] % 9 : 0;
            ops[s][k].micro = at < n ? (signed char)data[at++] % 5 : 0;
            ops[s][k].chunk = at < n ? (signed char)data[at++] % 3 : 0;
        }
        peak[s] = -7;
    }
    S.num_ops = num;
    S.ops = ops;
    S.peak_stash = peak;
    st = dpar_pipe_schedule_check(&S);
    if (st == DPAR_OK) {
        int i, c, f, b, bi, w;
        run_ctx r;
        stage_ctx sc[4];
        pthread_t th[4];
        dpar_comm_desc cd;
        FUZZ_ASSERT(S.bubble >= 0.0 && S.bubble < 1.0, "bubble %g", S.bubble);
        for (s = 0; s < S.p; s++) {
            FUZZ_ASSERT(peak[s] >= 0 && peak[s] <= S.m * S.v, "peak stash %d", peak[s]);
            for (i = 0; i < S.m; i++)
                for (c = 0; c < S.v; c++) {
                    f = b = bi = w = 0;
                    for (k = 0; k < num[s]; k++) {
                        if (ops[s][k].micro != i || ops[s][k].chunk != c) continue;
                        f += ops[s][k].code == DPAR_PIPE_FORWARD;
                        b += ops[s][k].code == DPAR_PIPE_BACKWARD;
                        bi += ops[s][k].code == DPAR_PIPE_BACKWARD_INPUT;
                        w += ops[s][k].code == DPAR_PIPE_BACKWARD_WEIGHT;
                    }
                    FUZZ_ASSERT(f == 1 && b + bi == 1 && w == bi,
                                "stage %d micro %d chunk %d: %d forwards, %d backwards, %d B, %d W", s, i, c, f, b, bi,
                                w);
                }
        }
        memset(&r, 0, sizeof r);
        memset(&cd, 0, sizeof cd);
        cd.size = S.p;
        cd.timeout_ms = 5000;
        r.S = &S;
        FUZZ_ASSERT(dpar_group_create(&cd, &r.g) == DPAR_OK, "%s", dpar_last_error());
        for (s = 0; s < S.p; s++) {
            sc[s].r = &r;
            sc[s].stage = s;
            pthread_create(&th[s], NULL, stage_main, &sc[s]);
        }
        for (s = 0; s < S.p; s++) pthread_join(th[s], NULL);
        dpar_group_destroy(r.g);
        for (s = 0; s < S.p; s++) {
            FUZZ_ASSERT(r.st[s] == DPAR_OK, "a checked schedule failed on stage %d: %s", s,
                        dpar_status_string(r.st[s]));
            for (i = 0; i < S.m; i++)
                for (c = 0; c < S.v; c++)
                    FUZZ_ASSERT(r.calls[s][0][i][c] == 1 && r.calls[s][1][i][c] + r.calls[s][2][i][c] == 1 &&
                                    r.calls[s][3][i][c] == r.calls[s][2][i][c],
                                "stage %d micro %d chunk %d ran %d forwards, %d backwards, %d B, %d W", s, i, c,
                                r.calls[s][0][i][c], r.calls[s][1][i][c], r.calls[s][2][i][c], r.calls[s][3][i][c]);
        }
    } else {
        FUZZ_ASSERT(st == DPAR_EINVAL && dpar_last_error()[0], "status %d", st);
    }
    memset(text, 'Z', sizeof text);
    k = (int)dpar_pipe_schedule_format(&S, text, 100);
    FUZZ_ASSERT(text[99] == 0 || k < 99, "format did not end its text");
    for (k = 100; k < (int)sizeof text; k++) FUZZ_ASSERT(text[k] == 'Z', "format wrote past its buffer");
    for (s = 0; s < S.p; s++) free(ops[s]);
    return 0;
}
