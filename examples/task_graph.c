/* task_graph.c - a training epoch as a task graph: loading and augmenting later batches overlap the train steps.
   Build: cc -std=c99 -O2 -I. examples/task_graph.c -o task_graph -pthread -lm
   Run:   ./task_graph            (./task_graph --threads 2)
   Check: ^epoch 1: [0-9]+ load, [0-9]+ augment, [0-9]+ train, 4 eval, 1 report
   Check: ^task_graph: .*parameters bitwise equal to the serial run

   Not all parallelism is data, tensor or pipeline parallelism over ranks: inside one process the
   work of a training loop is itself a graph. Each batch has to be loaded (here: samples decoded
   from a procedural data set, the costly part), then augmented (noise and a random gain), and only
   then can a train step use it; train steps must run in order, since each one changes the model the
   next one reads. Written as tasks with dependencies on a dpar_pool (dpar_task_submit), the graph
   says exactly that: augment(b) after load(b), train(b) after augment(b) and train(b-1), and
   load(b) after train(b-SLOTS), because batches live in a ring of SLOTS buffers and load(b) reuses
   the buffer of batch b-SLOTS. The pool runs every task as soon as its dependencies are done, so
   while step b trains, other threads already load and augment batches b+1..b+SLOTS-1. At the end
   of an epoch, 4 evaluation tasks (each a quarter of a held-out set) depend on the last step, and a
   report task on them; dpar_task_wait_all ends the epoch. The program times every task, prints
   how much of the work overlapped, and checks the result against the same calls made serially:
   the train steps ran in the same order on the same data, so the parameters are the same bits. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define D 64       /* features */
#define H 128      /* hidden units */
#define K 4        /* classes */
#define BS 128     /* samples per batch */
#define SLOTS 4    /* batch buffers: how far loading may run ahead */
#define EVALS 4    /* evaluation tasks */
#define EVAL_N 512 /* held-out samples */
#define MAX_BATCHES 32
#define MAX_TASKS (3 * MAX_BATCHES + EVALS + 1)
#define LR 0.1f

enum { LOAD, AUGMENT, TRAIN, EVAL, REPORT }; /* printed as their initials: "LATER"[kind] */

typedef struct record {
    int kind, batch, thread;
    uint64_t t0, t1;
} record;

typedef struct ctx {
    dpar_pool *pool; /* NULL: the serial run */
    int epoch, batches, ntasks;
    float x[SLOTS][BS * D], ex[EVAL_N * D]; /* the batch ring; the held-out set */
    int y[SLOTS][BS], ey[EVAL_N];
    dpar_linear l1, l2;
    float h[BS * H], z[BS * K], dz[BS * K], dh[BS * H];
    double part[EVALS][2], eval_loss, eval_acc; /* per eval task: loss sum, correct */
    record rec[MAX_TASKS];
} ctx;

typedef struct task_arg {
    ctx *c;
    record *r;
} task_arg;

static int by_start(const void *a, const void *b)
{
    uint64_t x = ((const record *)a)->t0, y = ((const record *)b)->t0;
    return x < y ? -1 : x > y;
}

static uint64_t mix(uint64_t s) /* a hash: a seed per sample, per batch and epoch */
{
    s = (s ^ (s >> 30)) * 0xbf58476d1ce4e5b9ull;
    s = (s ^ (s >> 27)) * 0x94d049bb133111ebull;
    return s ^ (s >> 31);
}
static float unit(uint64_t *s) { return (float)((double)((*s = mix(*s + 1)) >> 11) / 9007199254740992.0); }

/* "decode" sample `id`: its class picks a pattern of frequencies, plus noise; 16 sines per feature */
static void decode(uint64_t id, float *x, int *y)
{
    uint64_t s = mix(id);
    int k, f, c = (int)(unit(&s) * K) % K;
    float phase = unit(&s) * 6.2831853f;
    for (k = 0; k < D; k++) {
        float v = 0;
        for (f = 1; f <= 16; f++)
            v += sinf((float)(f * (c + 1)) * 0.05f * (float)k + phase * (float)(f % 2)) / (float)f;
        x[k] = v + 0.5f * (unit(&s) - 0.5f);
    }
    *y = c;
}

/* forward of n rows: h = ReLU(x W1 + b1), z = h W2 + b2 (the logits); *loss = the summed cross-entropy,
   dz (if not NULL) = its gradient over the logits, divided by n */
static dpar_status forward(dpar_linear *l1, dpar_linear *l2, const float *x, const int *y, float *h, float *z,
                           float *dz, int n, double *loss, int *correct)
{
    dpar_status st;
    int i, k, best;
    *loss = 0;
    if ((st = dpar_linear_forward(l1, x, h, n)) != DPAR_OK) return st;
    for (i = 0; i < n * H; i++) h[i] = h[i] > 0 ? h[i] : 0;
    if ((st = dpar_linear_forward(l2, h, z, n)) != DPAR_OK) return st;
    for (i = 0; i < n; i++) {
        float *zi = z + i * K, mx = zi[0], sum = 0;
        for (best = 0, k = 1; k < K; k++)
            if (zi[k] > mx) mx = zi[best = k];
        for (k = 0; k < K; k++) sum += expf(zi[k] - mx);
        *loss += log(sum) + mx - zi[y[i]];
        *correct += best == y[i];
        for (k = 0; dz && k < K; k++) dz[i * K + k] = (expf(zi[k] - mx) / sum - (k == y[i])) / (float)n;
    }
    return DPAR_OK;
}

/* one task; the graph decides when it runs. batch b lives in slot b % SLOTS */
static dpar_status run(void *user)
{
    task_arg *t = (task_arg *)user;
    ctx *c = t->c;
    record *r = t->r;
    int i, k, slot = r->batch % SLOTS, correct = 0;
    dpar_status st;
    double loss;
    uint64_t s;
    r->t0 = dpar_time_ns();
    r->thread = c->pool ? dpar_pool_thread_index(c->pool) : 0;
    switch (r->kind) {
    case LOAD: /* the same samples every epoch, as a data set on disk */
        for (i = 0; i < BS; i++) decode((uint64_t)r->batch * BS + (uint64_t)i, c->x[slot] + i * D, &c->y[slot][i]);
        break;
    case AUGMENT: /* different every epoch: Gaussian-ish noise and a random gain per sample */
        s = mix(((uint64_t)c->epoch << 32) + (uint64_t)r->batch);
        for (i = 0; i < BS; i++) {
            float gain = 0.8f + 0.4f * unit(&s), *xi = c->x[slot] + i * D;
            for (k = 0; k < D; k++) xi[k] = gain * xi[k] + 0.3f * (unit(&s) + unit(&s) + unit(&s) - 1.5f);
        }
        break;
    case TRAIN: /* one SGD step on the batch */
        dpar_linear_zero_grad(&c->l1);
        dpar_linear_zero_grad(&c->l2);
        if ((st = forward(&c->l1, &c->l2, c->x[slot], c->y[slot], c->h, c->z, c->dz, BS, &loss, &correct)) != DPAR_OK ||
            (st = dpar_linear_backward(&c->l2, c->h, c->dz, c->dh, BS)) != DPAR_OK)
            return st; /* the task fails with dpar's message; the tasks after it are cancelled */
        for (i = 0; i < BS * H; i++) c->dh[i] = c->h[i] > 0 ? c->dh[i] : 0;
        if ((st = dpar_linear_backward(&c->l1, c->x[slot], c->dh, NULL, BS)) != DPAR_OK) return st;
        for (i = 0; i < D * H; i++) c->l1.w[i] -= LR * c->l1.dw[i];
        for (i = 0; i < H; i++) c->l1.b[i] -= LR * c->l1.db[i];
        for (i = 0; i < H * K; i++) c->l2.w[i] -= LR * c->l2.dw[i];
        for (i = 0; i < K; i++) c->l2.b[i] -= LR * c->l2.db[i];
        break;
    case EVAL: { /* a quarter of the held-out set; its own scratch, the model only read */
        int n = EVAL_N / EVALS, first = r->batch * n;
        float *h = (float *)malloc(sizeof(float) * (size_t)n * (H + K)), *z = h ? h + n * H : NULL;
        if (!h) return dpar_set_error(DPAR_ENOMEM, "eval %d: out of memory", r->batch);
        st = forward(&c->l1, &c->l2, c->ex + first * D, c->ey + first, h, z, NULL, n, &c->part[r->batch][0], &correct);
        c->part[r->batch][1] = correct;
        free(h);
        if (st != DPAR_OK) return st;
        break;
    }
    default: /* REPORT: add the parts up in a fixed order */
        c->eval_loss = c->eval_acc = 0;
        for (i = 0; i < EVALS; i++) {
            c->eval_loss += c->part[i][0] / EVAL_N;
            c->eval_acc += c->part[i][1] / EVAL_N;
        }
    }
    r->t1 = dpar_time_ns();
    return DPAR_OK;
}

/* one epoch: as a task graph on the pool, or (pool NULL) the same tasks called in order */
static dpar_status epoch(ctx *c, task_arg *args)
{
    dpar_task id[MAX_TASKS], deps[EVALS];
    dpar_task_desc d;
    dpar_status st = DPAR_OK;
    int b, n = 0, i;
    c->ntasks = 3 * c->batches + EVALS + 1;
    for (i = 0; i < c->ntasks; i++) {
        args[i].c = c;
        args[i].r = &c->rec[i];
        c->rec[i].kind = i < 3 * c->batches ? i % 3 : i < c->ntasks - 1 ? EVAL : REPORT;
        c->rec[i].batch = i < 3 * c->batches ? i / 3 : i - 3 * c->batches;
    }
    if (!c->pool) {
        for (i = 0; i < c->ntasks && st == DPAR_OK; i++) st = run(&args[i]);
        return st;
    }
    memset(&d, 0, sizeof d);
    d.fn = run;
    for (b = 0; b < c->batches && st == DPAR_OK; b++) {
        /* load(b) after train(b - SLOTS): it overwrites that batch's buffer */
        deps[0] = b >= SLOTS ? id[3 * (b - SLOTS) + TRAIN] : 0;
        d.user = &args[n];
        d.name = "load";
        d.deps = deps;
        d.num_deps = b >= SLOTS;
        if ((st = dpar_task_submit(c->pool, &d, &id[n++])) != DPAR_OK) break;
        d.user = &args[n];
        d.name = "augment";
        d.deps = &id[n - 1];
        d.num_deps = 1; /* after load(b) */
        if ((st = dpar_task_submit(c->pool, &d, &id[n++])) != DPAR_OK) break;
        deps[0] = id[n - 1]; /* train(b) after augment(b) and train(b - 1) */
        deps[1] = b > 0 ? id[n - 3] : 0;
        d.user = &args[n];
        d.name = "train";
        d.deps = deps;
        d.num_deps = b > 0 ? 2 : 1;
        st = dpar_task_submit(c->pool, &d, &id[n++]);
    }
    for (i = 0; i < EVALS && st == DPAR_OK; i++) { /* the evaluations after the last train step */
        d.user = &args[n];
        d.name = "eval";
        d.deps = &id[3 * c->batches - 1];
        d.num_deps = 1;
        st = dpar_task_submit(c->pool, &d, &id[n++]);
    }
    d.user = &args[n];
    d.name = "report";
    d.deps = &id[n - EVALS];
    d.num_deps = EVALS;
    if (st == DPAR_OK) st = dpar_task_submit(c->pool, &d, &id[n++]);
    if (st != DPAR_OK) fprintf(stderr, "task_graph: submit: %s\n", dpar_last_error());
    return dpar_task_wait_all(c->pool) != DPAR_OK ? DPAR_EUSER : st; /* ends the epoch; the first failure */
}

static dpar_status init(ctx *c, dpar_pool *pool, int batches)
{
    uint64_t s = 99;
    float *w = (float *)malloc(sizeof(float) * (D * H + H * K));
    dpar_status st = w ? DPAR_OK : dpar_set_error(DPAR_ENOMEM, "out of memory");
    dpar_linear_desc l1d = {0}, l2d = {0}; /* FULL layers with a bias */
    int i;
    l1d.in = D, l1d.out = H;
    l2d.in = H, l2d.out = K;
    c->pool = pool;
    c->batches = batches;
    for (i = 0; i < EVAL_N; i++) decode(((uint64_t)1 << 40) + (uint64_t)i, c->ex + i * D, &c->ey[i]); /* unseen ids */
    for (i = 0; w && i < D * H + H * K; i++) w[i] = (unit(&s) - 0.5f) * (i < D * H ? 0.3f : 0.2f);
    if (st == DPAR_OK && (st = dpar_linear_init(&c->l1, &l1d)) == DPAR_OK &&
        (st = dpar_linear_init(&c->l2, &l2d)) == DPAR_OK && (st = dpar_linear_set_weights(&c->l1, w, NULL)) == DPAR_OK)
        st = dpar_linear_set_weights(&c->l2, w + D * H, NULL);
    free(w);
    return st;
}

int main(int argc, char **argv)
{
    static ctx par, ser;
    static task_arg args[MAX_TASKS];
    static record sorted[MAX_TASKS];
    dpar_pool_desc pd;
    dpar_pool *pool = NULL;
    dpar_status st;
    int threads = 4, epochs, batches, e, i, k, ok, same, counts[5];
    double first_loss = 0;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--threads N]\n", argv[0]);
            return 2;
        }
    }
    epochs = getenv("DPAR_TEST_QUICK") ? 2 : 5;
    batches = getenv("DPAR_TEST_QUICK") ? 12 : MAX_BATCHES;
    memset(&pd, 0, sizeof pd);
    pd.num_threads = threads;
    if ((st = dpar_pool_create(&pd, &pool)) != DPAR_OK || (st = init(&par, pool, batches)) != DPAR_OK ||
        (st = init(&ser, NULL, batches)) != DPAR_OK) {
        fprintf(stderr, "task_graph: %s\n", dpar_last_error());
        return 1;
    }
    ser.batches = 0; /* an epoch of no batches: just the evaluation of the starting model */
    if ((st = epoch(&ser, args)) != DPAR_OK) {
        fprintf(stderr, "task_graph: %s\n", dpar_last_error());
        return 1;
    }
    first_loss = ser.eval_loss;
    ser.batches = batches;
    printf("task_graph: %d epochs of %d batches of %d samples on a pool of %d threads; the first epoch's tasks in the "
           "order they started\n(L = load, A = augment, T = train, E = eval, R = report; .thread, m = the main thread, "
           "which runs tasks while it waits):\n",
           epochs, batches, BS, dpar_pool_num_threads(pool));
    for (e = 0; e < epochs; e++) {
        uint64_t t0 = dpar_time_ns(), wall, serial, busy = 0;
        int most = 0, j;
        par.epoch = ser.epoch = e;
        if ((st = epoch(&par, args)) == DPAR_OK) {
            wall = dpar_time_ns() - t0;
            t0 = dpar_time_ns();
            st = epoch(&ser, args); /* the same tasks, called one after another on this thread */
        }
        if (st != DPAR_OK) {
            fprintf(stderr, "task_graph: %s\n", dpar_last_error());
            return 1;
        }
        serial = dpar_time_ns() - t0;
        memset(counts, 0, sizeof counts);
        for (i = 0; i < par.ntasks; i++) {
            int in_flight = 0;
            counts[par.rec[i].kind]++;
            busy += par.rec[i].t1 - par.rec[i].t0;
            for (j = 0; j < par.ntasks; j++) /* tasks running when task i started */
                in_flight += par.rec[j].t0 <= par.rec[i].t0 && par.rec[i].t0 < par.rec[j].t1;
            if (in_flight > most) most = in_flight;
        }
        if (e == 0) { /* the start order */
            memcpy(sorted, par.rec, sizeof sorted);
            qsort(sorted, (size_t)par.ntasks, sizeof *sorted, by_start);
            for (k = 0; k < par.ntasks; k++) {
                printf("%s%c%d.", k % 16 ? " " : k ? "\n  " : "  ", "LATER"[sorted[k].kind], sorted[k].batch);
                if (sorted[k].thread < 0) printf("m");
                else printf("%d", sorted[k].thread);
            }
            printf("\n");
        }
        printf("epoch %d: %d load, %d augment, %d train, %d eval, %d report tasks in %.1f ms (serially %.1f ms, "
               "%.2fx), %.1f ms of task time, at most %d in flight; held-out loss %.4f, accuracy %.3f\n",
               e + 1, counts[LOAD], counts[AUGMENT], counts[TRAIN], counts[EVAL], counts[REPORT], wall / 1e6,
               serial / 1e6, (double)serial / wall, busy / 1e6, most, par.eval_loss, par.eval_acc);
    }
    same = !memcmp(par.l1.w, ser.l1.w, sizeof(float) * D * H) && !memcmp(par.l1.b, ser.l1.b, sizeof(float) * H) &&
           !memcmp(par.l2.w, ser.l2.w, sizeof(float) * H * K) && !memcmp(par.l2.b, ser.l2.b, sizeof(float) * K) &&
           par.eval_loss == ser.eval_loss;
    ok = same && par.eval_loss < 0.5 * first_loss;
    printf("task_graph: held-out loss %.4f -> %.4f, parameters %s the serial run, %s\n", first_loss, par.eval_loss,
           same ? "bitwise equal to" : "DIFFER FROM", ok ? "OK" : "FAILED");
    dpar_linear_destroy(&par.l1);
    dpar_linear_destroy(&par.l2);
    dpar_linear_destroy(&ser.l1);
    dpar_linear_destroy(&ser.l2);
    dpar_pool_destroy(pool);
    return ok ? 0 : 1;
}
