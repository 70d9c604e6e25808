/* data_parallel.c - an MLP classifier trained data-parallel over thread ranks: the sampler deals
   each rank its share of every epoch, and gradient buckets are reduced while backward runs.
   Build: cc -std=c99 -O2 -I. examples/data_parallel.c -o data_parallel -pthread -lm
   Run:   ./data_parallel              (--images train-images-idx3-ubyte --labels train-labels-idx1-ubyte)
   Check: ^loss [0-9.]+ -> [0-9.]+: falls$
   Check: ^weights: (one copy shared by [0-9]+ ranks|[0-9]+ replicas, identical), crc32 [0-9a-f]{8}$
   Check: ^train samples_per_s=[0-9.]+ final_loss=[0-9.]+$

   Each rank trains on batch/threads samples of each global batch. Backward computes every input
   gradient first (they read the weights), then the weight gradients from the first layer up as
   tasks of one bucket each (dpar_steal: a rank ahead runs a slower one's last tasks, same bits),
   each handed to the buckets once final: a full bucket is reduced and each rank applies SGD to its
   1/N of it (ZeRO-1's split of the step), in shared memory between the ranks' GEMMs
   (dpar_buckets_set_direct), to one copy of the weights that the ranks share. The next forward
   waits for a layer's weights only when it gets there (dpar_buckets_wait_range). --replicas gives
   each rank its own copy, as processes must, checked identical; both train bit for bit alike.
   Options: --layers 784,1024,1024,10 --batch 256 (global) --steps 30 --threads 2 --lr 0.05 --replicas
   --images F --labels F (IDX files, e.g. MNIST; synthetic data without them); --params-out F writes the final
   weights as raw floats. Checkpoints (dpar_ckpt_save/_load, off by default; the step loop is the same without):
   --ckpt PATH saves the weights and the position in the data at the end, --ckpt-every K also after every K-th
   step (the step's buckets waited for first), --resume continues from PATH (with any --threads; bit for bit with
   the same); tests/kill.sh kills it at random moments and mid-write. --deterministic trains on 1, 2 or 4 ranks
   with the same bits (4 leaves of the batch, dpar_tree_reduce, a deterministic comm; slower, no buckets), and
   --bitwise-check trains so on 1, 2 and 4 ranks and prints "bitwise equal" only when all three end with the same
   bits (else exits 1). Add -DDPAR_OPENBLAS and -lopenblas to use OpenBLAS's GEMM. This is the showcase and the
   benchmark (bench=train); to learn the strategy, read the simple version first: examples/guide/02_data_parallel.c
   (docs/guide/). */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXL 8
#define MAXT 256                 /* weight-gradient tasks */
#define BUCKET ((size_t)1 << 18) /* gradients per bucket (1 MiB) */

typedef struct {
    int nl, width[MAXL + 1], batch, steps, threads, replicas;
    float lr;
    const char *images, *labels;
    const char *ckpt;                     /* --ckpt: the checkpoint's path (NULL: none) */
    int ckpt_every;                       /* --ckpt-every K: also after every K-th step */
    uint64_t resume_at[3];                /* --resume: the step, epoch and samples consumed that the checkpoint holds */
    size_t n, woff[MAXL], boff[MAXL], np; /* samples; offsets of each layer's W and b in the flat arrays */
    float *x, *params[64];                /* inputs n x width[0]; the weights (each rank's replica) */
    dpar_idx images_file;                 /* when x comes from an IDX file */
    int *y;                               /* labels */
    dpar_group *group;
    double seconds, first_loss, final_loss, gemm_ns, overlap_ns, wait_ns, task_ns[64]; /* task_ns: by the thread */
    uint64_t given;                                    /* rank 0's tasks that another rank ran */
    uint64_t t_main, t_data, t_init, t_setup, t_first; /* main() began, the data, the weights, rank 0's dpar
                                                          objects were ready, rank 0 finished step 1 */
} job;

static uint64_t rng_next(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 11;
}
static float uniform(uint64_t *s) { return (float)((double)rng_next(s) / 9007199254740992.0); }

/* relu and its backward without a branch (on random signs one mispredicts half the time, and
   compilers make a branch of both `v > 0 ? v : 0` and `v * (v > 0)`); (v + |v|) / 2 is exact */
static float relu(float v) { return 0.5f * (v + fabsf(v)); }
static void relu_backward(float *d, const float *a, size_t n) /* d = a > 0 ? d : 0 */
{
    for (size_t q = 0; q < n; q++) {
        uint32_t bits, keep = 0u - (uint32_t)(a[q] > 0.0f);
        memcpy(&bits, d + q, sizeof bits);
        bits &= keep;
        memcpy(d + q, &bits, sizeof bits);
    }
}

/* C (M x N) = op(A) op(B) + beta C, timed: the program reports the share of the step spent here */
static void gemm(double *ns, dpar_trans ta, dpar_trans tb, int M, int N, int K, const float *A, int lda, const float *B,
                 int ldb, float beta, float *C, int ldc)
{
    uint64_t t0 = dpar_time_ns();
    dpar_sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
    *ns += (double)(dpar_time_ns() - t0);
}

/* this rank's share of the SGD step, called by the buckets for each reduced block of gradients */
typedef struct {
    float *p, *g, lr;
} sgd_state;
static void sgd(void *user, size_t offset, size_t count)
{
    sgd_state *s = (sgd_state *)user;
    float *restrict p = s->p + offset, lr = s->lr;
    const float *restrict g = s->g + offset;
    size_t q = 0;
    for (; q + 4 <= count; q += 4) { /* four at a time: cc -O2 makes it one SSE multiply and subtract */
        float a = p[q] - lr * g[q], b = p[q + 1] - lr * g[q + 1], c = p[q + 2] - lr * g[q + 2],
              d = p[q + 3] - lr * g[q + 3];
        p[q] = a, p[q + 1] = b, p[q + 2] = c, p[q + 3] = d;
    }
    for (; q < count; q++) p[q] -= lr * g[q];
}

/* one rank's weight gradients as tasks (dpar_steal): task i is rows r0..r0+nr of layer l's, on any rank's thread */
typedef struct {
    job *j;
    float **act, **delta, *g;
    dpar_buckets *buckets;
    int b, n, l[MAXT], r0[MAXT], nr[MAXT];
} wgrad;
static dpar_status wgrad_task(void *user, int i, int by)
{
    wgrad *w = (wgrad *)user;
    int l = w->l[i], in = w->j->width[l], out = w->j->width[l + 1];
    gemm(&w->j->task_ns[by], DPAR_TRANS, DPAR_NO_TRANS, w->nr[i], out, w->b, w->act[l] + w->r0[i], in, w->delta[l + 1],
         out, 0, w->g + w->j->woff[l] + (size_t)w->r0[i] * out, out);
    return DPAR_OK;
}
static dpar_status wgrad_done(void *user, int i) /* on the owner's thread, in order: to the buckets */
{
    wgrad *w = (wgrad *)user;
    size_t out = (size_t)w->j->width[w->l[i] + 1];
    return dpar_buckets_ready(w->buckets, w->j->woff[w->l[i]] + (size_t)w->r0[i] * out, (size_t)w->nr[i] * out);
}

#define TRY(call)                               \
    do {                                        \
        if ((st = (call)) != DPAR_OK) goto out; \
    } while (0)
#define WAIT(call)                      \
    do {                                \
        uint64_t t0_ = dpar_time_ns();  \
        TRY(call);                      \
        waited += dpar_time_ns() - t0_; \
    } while (0)

static dpar_status rank_main(void *user, int rank, int nranks)
{
    job *j = (job *)user;
    int L = j->nl, b = j->batch / nranks, l, i, k, step, step0 = (int)j->resume_at[0];
    float lr = j->lr, *p = j->params[j->replicas ? rank : 0], *g, *act[MAXL + 1] = {0}, *delta[MAXL + 1] = {0},
          loss = 0;
    double gemm_ns = 0, first = 0;
    uint64_t t_start = 0, overlap = 0, waited = 0, epoch = j->resume_at[1], pos_at[3];
    int pending = 0; /* the last step's buckets are still in flight (not after a checkpoint) */
    dpar_ckpt_item items[2];
    size_t pos, per;
    const size_t *mine;
    dpar_sampler sampler = {0};
    dpar_sampler_desc smd = {0};
    dpar_buckets *buckets = NULL;
    dpar_buckets_desc bd = {0};
    dpar_steal *steal = NULL;
    dpar_steal_desc sd = {0};
    wgrad wg = {0};
    sgd_state opt;
    dpar_comm *comm;
    dpar_status st;
    if ((st = dpar_group_join(j->group, rank, &comm)) != DPAR_OK) return st;
    g = (float *)calloc(j->np, sizeof(float));
    for (l = 0, k = g != NULL; l <= L; l++) { /* activations and their gradients, allocated once */
        act[l] = (float *)malloc(sizeof(float) * b * j->width[l]);
        delta[l] = (float *)malloc(sizeof(float) * b * j->width[l]);
        k &= act[l] && delta[l];
    }
    if (!k) TRY(dpar_set_error(DPAR_ENOMEM, "out of memory"));
    /* the same starting weights everywhere, then each rank its own share of the data */
    if (j->replicas) TRY(dpar_broadcast(comm, p, p, j->np, DPAR_F32, 0));
    smd.n = j->n, smd.ranks = nranks, smd.rank = rank, smd.seed = 7, smd.drop_last = 1;
    TRY(dpar_sampler_init(&sampler, &smd));
    bd.comm = comm, bd.grads = g, bd.count = j->np, bd.bucket_bytes = BUCKET * sizeof(float), bd.op = DPAR_AVG;
    TRY(dpar_buckets_create(&bd, &buckets));
    opt.p = p, opt.g = g, opt.lr = lr;
    TRY(dpar_buckets_set_update(buckets, p, sgd, &opt));
    TRY(dpar_buckets_set_direct(buckets, 1)); /* thread ranks: reduce in shared memory, between our GEMMs */
    wg.j = j, wg.act = act, wg.delta = delta, wg.g = g, wg.buckets = buckets, wg.b = b;
    for (l = 0; l < L; l++) /* the weight-gradient tasks, layer by layer from the first */
        for (k = 0, i = (int)(BUCKET / j->width[l + 1]) > 1 ? (int)(BUCKET / j->width[l + 1]) : 1; k < j->width[l];
             k += i) {
            if (wg.n == MAXT)
                TRY(dpar_set_error(DPAR_EINVAL, "more than %d weight-gradient tasks: a smaller model", MAXT));
            wg.l[wg.n] = l, wg.r0[wg.n] = k, wg.nr[wg.n++] = j->width[l] - k < i ? j->width[l] - k : i;
        }
    sd.comm = comm, sd.max_tasks = wg.n;
    TRY(dpar_steal_create(&sd, &steal));
    if (rank == 0) j->t_setup = dpar_time_ns();
    per = dpar_sampler_resume(&sampler, epoch, (size_t)j->resume_at[2], &mine), pos = 0;
    items[0] = dpar_ckpt_replica("params", p, j->np * sizeof(float)); /* shared: every rank's p is the same */
    items[1] = dpar_ckpt_replica("position", pos_at, sizeof pos_at);
    for (step = step0; step < j->steps; step++) {
        if (step == step0 + 1 && rank == 0) j->t_first = dpar_time_ns(); /* time to the first step (bench=startup) */
        if (step == step0 + 1)
            t_start = dpar_time_ns(), gemm_ns = j->task_ns[rank] = 0, overlap = 0, waited = 0; /* step 0 warms up */
        if (pos + (size_t)b > per) per = dpar_sampler_epoch(&sampler, ++epoch, &mine), pos = 0;
        for (i = 0; i < b; i++)
            memcpy(act[0] + (size_t)i * j->width[0], j->x + mine[pos + i] * j->width[0], sizeof(float) * j->width[0]);
        /* forward: act[l+1] = relu(act[l] W_l + b_l); the last layer's are logits. Each layer first
           waits for its own weights to have taken the last step, not for all of them */
        for (l = 0; l < L; l++) {
            int in = j->width[l], out = j->width[l + 1];
            float *bias = p + j->boff[l], *a;
            if (pending) WAIT(dpar_buckets_wait_range(buckets, j->woff[l], j->boff[l] + (size_t)out - j->woff[l]));
            gemm(&gemm_ns, DPAR_NO_TRANS, DPAR_NO_TRANS, b, out, in, act[l], in, p + j->woff[l], out, 0, act[l + 1],
                 out);
            for (i = 0; i < b; i++) /* + bias, then relu (not on the logits) */
                for (k = 0, a = act[l + 1] + (size_t)i * out; k < out; k++)
                    a[k] = l + 1 < L ? relu(a[k] + bias[k]) : a[k] + bias[k];
        }
        /* softmax cross-entropy; delta[L] = (softmax - onehot) / b */
        loss = 0;
        for (i = 0; i < b; i++) {
            int C = j->width[L], c;
            float *z = act[L] + (size_t)i * C, *d = delta[L] + (size_t)i * C, mx = z[0], sum = 0;
            for (c = 1; c < C; c++) mx = z[c] > mx ? z[c] : mx;
            for (c = 0; c < C; c++) sum += (d[c] = expf(z[c] - mx));
            loss += logf(sum) - (z[j->y[mine[pos + i]]] - mx);
            for (c = 0; c < C; c++) d[c] = (d[c] / sum - (c == j->y[mine[pos + i]])) / (float)b;
        }
        loss /= (float)b;
        pos += (size_t)b;
        if (pending) WAIT(dpar_buckets_wait(buckets)); /* the last step ends: all its buckets were waited for above */
        /* backward: first every input gradient, last layer first (they read the weights: the input of
           layer 0 needs none), then the bias and weight gradients, from the first layer up */
        for (l = L - 1; l > 0; l--) {
            gemm(&gemm_ns, DPAR_NO_TRANS, DPAR_TRANS, b, j->width[l], j->width[l + 1], delta[l + 1], j->width[l + 1],
                 p + j->woff[l], j->width[l + 1], 0, delta[l], j->width[l]);
            relu_backward(delta[l], act[l], (size_t)b * j->width[l]);
        }
        for (l = 0; l < L; l++) {
            int out = j->width[l + 1];
            float *gb = g + j->boff[l];
            memset(gb, 0, sizeof(float) * out);
            for (i = 0; i < b; i++)
                for (k = 0; k < out; k++) gb[k] += delta[l + 1][(size_t)i * out + k];
            TRY(dpar_buckets_ready(buckets, j->boff[l], (size_t)out));
        }
        TRY(dpar_steal_run(steal, wg.n, wgrad_task, wgrad_done, &wg));
        overlap += pending ? dpar_buckets_overlap_ns(buckets) : 0;
        pending = 1;
        if (step == step0 || step == j->steps - 1 || (j->steps >= 5 && (step + 1) % (j->steps / 5) == 0)) {
            float mean = loss; /* the global batch's loss: the mean over the ranks */
            TRY(dpar_allreduce(comm, &mean, &mean, 1, DPAR_F32, DPAR_AVG));
            if (step == step0) first = mean;
            if (rank == 0) printf("step %4d  loss %.4f\n", step + 1, mean);
            loss = mean;
        }
        if (j->ckpt && (step + 1 == j->steps || (j->ckpt_every && (step + 1) % j->ckpt_every == 0))) {
            /* a checkpoint: the step's weights whole on every rank, then every rank writes (the weights once) */
            TRY(dpar_buckets_wait(buckets));
            pending = 0;
            pos_at[0] = (uint64_t)step + 1, pos_at[1] = epoch, pos_at[2] = dpar_sampler_consumed(&sampler, pos);
            TRY(dpar_ckpt_save(comm, j->ckpt, items, 2));
            if (rank == 0) printf("checkpoint step %d saved\n", step + 1), fflush(stdout);
        }
    }
    if (pending) WAIT(dpar_buckets_wait(buckets)); /* the last step's weights */
    if (rank == 0) {
        j->seconds = (double)(dpar_time_ns() - t_start) * 1e-9;
        j->gemm_ns = gemm_ns + j->task_ns[0], j->overlap_ns = (double)overlap, j->wait_ns = (double)waited;
        dpar_steal_counts(steal, NULL, &j->given);
        j->first_loss = first, j->final_loss = loss;
    }
out: /* on an error, abort the comm: the other ranks return at once instead of waiting for us */
    if (st != DPAR_OK) dpar_comm_abort(comm);
    dpar_steal_destroy(steal);
    dpar_buckets_destroy(buckets);
    dpar_sampler_destroy(&sampler);
    for (l = 0; l <= L; l++) free(act[l]), free(delta[l]);
    free(g);
    dpar_comm_destroy(comm);
    return st;
}

/* --deterministic: the same bits on 1, 2 or 4 ranks (docs/comm.md, 'Determinism'). Each global batch is cut into
   LEAVES leaves, the same samples whatever the rank count (a sampler of one rank deals the global batch); rank r
   computes leaves [r*LEAVES/N, (r+1)*LEAVES/N), each with GEMMs of the leaf's size alone (so each gradient element
   is added in the same order on any N), adds its leaves with dpar_tree_reduce and the ranks' sums with the
   deterministic allreduce (DPAR_SUM, the gradient already scaled by 1/batch): together the same fixed tree on any N.
   Each rank keeps a replica and applies the whole SGD step. No buckets, no overlap: a check, not the showcase. */
#define LEAVES 4
static dpar_status det_rank_main(void *user, int rank, int nranks)
{
    job *j = (job *)user;
    int L = j->nl, lb = j->batch / LEAVES, mine_n = LEAVES / nranks, l, i, k, f, step;
    float *p = j->params[rank], *act[MAXL + 1] = {0}, *delta[MAXL + 1] = {0}, *g[LEAVES] = {0}, lossv[LEAVES];
    const void *leaves[LEAVES], *lossp[LEAVES];
    float loss = 0, first = 0, lr = j->lr;
    uint64_t t_start = dpar_time_ns(), epoch = 0;
    size_t pos = 0, per, q;
    const size_t *mine;
    dpar_sampler sampler = {0};
    dpar_sampler_desc smd = {0};
    dpar_comm *comm;
    dpar_status st;
    if ((st = dpar_group_join(j->group, rank, &comm)) != DPAR_OK) return st;
    for (l = 0, k = 1; l <= L; l++) {
        act[l] = (float *)malloc(sizeof(float) * lb * j->width[l]);
        delta[l] = (float *)malloc(sizeof(float) * lb * j->width[l]);
        k &= act[l] && delta[l];
    }
    for (f = 0; f < mine_n; f++) k &= (g[f] = (float *)malloc(sizeof(float) * j->np)) != NULL;
    if (!k) TRY(dpar_set_error(DPAR_ENOMEM, "out of memory"));
    TRY(dpar_broadcast(comm, p, p, j->np, DPAR_F32, 0));
    smd.n = j->n, smd.ranks = 1, smd.seed = 7, smd.drop_last = 1; /* the global batch, the same for any N */
    TRY(dpar_sampler_init(&sampler, &smd));
    per = dpar_sampler_epoch(&sampler, 0, &mine);
    for (step = 0; step < j->steps; step++) {
        if (pos + (size_t)j->batch > per) per = dpar_sampler_epoch(&sampler, ++epoch, &mine), pos = 0;
        for (f = 0; f < mine_n; f++) { /* leaf rank * mine_n + f: samples pos + leaf * lb ... */
            const size_t *s = mine + pos + (size_t)(rank * mine_n + f) * lb;
            float *gf = g[f];
            for (i = 0; i < lb; i++)
                memcpy(act[0] + (size_t)i * j->width[0], j->x + s[i] * j->width[0], sizeof(float) * j->width[0]);
            for (l = 0; l < L; l++) {
                int in = j->width[l], out = j->width[l + 1];
                float *bias = p + j->boff[l], *a;
                dpar_sgemm(DPAR_NO_TRANS, DPAR_NO_TRANS, lb, out, in, 1, act[l], in, p + j->woff[l], out, 0, act[l + 1],
                           out);
                for (i = 0; i < lb; i++)
                    for (k = 0, a = act[l + 1] + (size_t)i * out; k < out; k++)
                        a[k] = l + 1 < L ? relu(a[k] + bias[k]) : a[k] + bias[k];
            }
            lossv[f] = 0; /* the leaf's share of the batch's mean loss; delta = (softmax - onehot) / batch */
            for (i = 0; i < lb; i++) {
                int C = j->width[L], c;
                float *z = act[L] + (size_t)i * C, *d = delta[L] + (size_t)i * C, mx = z[0], sum = 0;
                for (c = 1; c < C; c++) mx = z[c] > mx ? z[c] : mx;
                for (c = 0; c < C; c++) sum += (d[c] = expf(z[c] - mx));
                lossv[f] += logf(sum) - (z[j->y[s[i]]] - mx);
                for (c = 0; c < C; c++) d[c] = (d[c] / sum - (c == j->y[s[i]])) / (float)j->batch;
            }
            lossv[f] /= (float)j->batch;
            for (l = L - 1; l > 0; l--) {
                dpar_sgemm(DPAR_NO_TRANS, DPAR_TRANS, lb, j->width[l], j->width[l + 1], 1, delta[l + 1],
                           j->width[l + 1], p + j->woff[l], j->width[l + 1], 0, delta[l], j->width[l]);
                relu_backward(delta[l], act[l], (size_t)lb * j->width[l]);
            }
            for (l = 0; l < L; l++) {
                int in = j->width[l], out = j->width[l + 1];
                float *gb = gf + j->boff[l];
                dpar_sgemm(DPAR_TRANS, DPAR_NO_TRANS, in, out, lb, 1, act[l], in, delta[l + 1], out, 0, gf + j->woff[l],
                           out);
                memset(gb, 0, sizeof(float) * out);
                for (i = 0; i < lb; i++)
                    for (k = 0; k < out; k++) gb[k] += delta[l + 1][(size_t)i * out + k];
            }
            leaves[f] = gf, lossp[f] = &lossv[f];
        }
        TRY(dpar_tree_reduce(g[0], leaves, mine_n, j->np, DPAR_F32, DPAR_SUM));
        TRY(dpar_allreduce(comm, g[0], g[0], j->np, DPAR_F32, DPAR_SUM));
        TRY(dpar_tree_reduce(&loss, lossp, mine_n, 1, DPAR_F32, DPAR_SUM));
        TRY(dpar_allreduce(comm, &loss, &loss, 1, DPAR_F32, DPAR_SUM));
        for (q = 0; q < j->np; q++) p[q] -= lr * g[0][q];
        pos += (size_t)j->batch;
        if (step == 0) first = loss;
        if (rank == 0 && (step == 0 || step == j->steps - 1 || (j->steps >= 5 && (step + 1) % (j->steps / 5) == 0)))
            printf("step %4d  loss %.4f\n", step + 1, loss);
    }
    if (rank == 0) j->first_loss = first, j->final_loss = loss, j->seconds = (double)(dpar_time_ns() - t_start) * 1e-9;
out:
    if (st != DPAR_OK) dpar_comm_abort(comm);
    dpar_sampler_destroy(&sampler);
    for (l = 0; l <= L; l++) free(act[l]), free(delta[l]);
    for (f = 0; f < LEAVES; f++) free(g[f]);
    dpar_comm_destroy(comm);
    return st;
}

/* synthetic data: inputs in [0, 1), labels from a random linear "teacher": learnable, not trivial */
static int make_synthetic(job *j)
{
    int D = j->width[0], C = j->width[j->nl], c, k;
    uint64_t s = 12345;
    float *teacher = (float *)malloc(sizeof(float) * D * C);
    j->n = 8192;
    j->x = (float *)malloc(sizeof(float) * j->n * D);
    j->y = (int *)malloc(sizeof(int) * j->n);
    if (!teacher || !j->x || !j->y) return 0;
    for (k = 0; k < D * C; k++) teacher[k] = uniform(&s) - 0.5f;
    for (size_t i = 0; i < j->n; i++) {
        float best = -1e30f, *xi = j->x + i * D;
        for (k = 0; k < D; k++) xi[k] = uniform(&s);
        for (c = 0; c < C; c++) {
            float z = 0;
            for (k = 0; k < D; k++) z += teacher[c * D + k] * (xi[k] - 0.5f);
            if (z > best) best = z, j->y[i] = c;
        }
    }
    free(teacher);
    return 1;
}

static int load_idx(job *j)
{
    dpar_idx *im = &j->images_file, lb;
    dpar_idx_desc imd = {0}, lbd = {0};
    size_t i, D = 1;
    int d;
    imd.path = j->images, imd.scale = 1.0f / 255;
    lbd.path = j->labels;
    if (dpar_idx_init(im, &imd) != DPAR_OK) return fprintf(stderr, "data_parallel: %s\n", dpar_last_error()), 0;
    if (dpar_idx_init(&lb, &lbd) != DPAR_OK) return fprintf(stderr, "data_parallel: %s\n", dpar_last_error()), 0;
    for (d = 1; d < im->ndims; d++) D *= im->dims[d];
    if (D != (size_t)j->width[0] || lb.ndims != 1 || lb.dims[0] != im->dims[0])
        return fprintf(stderr, "data_parallel: %zu inputs of %zu values and %u labels do not fit --layers %d,...\n",
                       (size_t)im->dims[0], D, lb.dims[0], j->width[0]),
               0;
    j->n = im->dims[0], j->x = im->data;
    j->y = (int *)malloc(sizeof(int) * j->n);
    for (i = 0; j->y && i < j->n; i++)
        if ((j->y[i] = (int)lb.data[i]) < 0 || j->y[i] >= j->width[j->nl])
            return fprintf(stderr, "data_parallel: label %d of sample %zu is not below %d\n", j->y[i], i,
                           j->width[j->nl]),
                   0;
    dpar_idx_destroy(&lb);
    return j->y != NULL;
}

/* why the command line is refused (printf-style, naming the option and the value at fault), then the usage; 2 */
static int usage(const char *why, ...)
{
    va_list ap;
    fputs("data_parallel: ", stderr);
    va_start(ap, why);
    vfprintf(stderr, why, ap);
    va_end(ap);
    fputs("\nusage: data_parallel [--layers 784,1024,1024,10] [--batch 256] [--steps 30] [--threads 2] [--lr 0.05]"
          " [--replicas] [--images FILE --labels FILE] [--ckpt PATH [--ckpt-every K] [--resume | --overwrite]]"
          " [--params-out FILE] [--deterministic | --bitwise-check]\n",
          stderr);
    return 2;
}

/* the value of a whole-number option: 1, or 0 when it is not one ("12x", "", "1e3") */
static int whole_number(const char *text, int *value)
{
    char *end;
    long v = strtol(text, &end, 10);
    if (end == text || *end != '\0' || v < -1000000000L || v > 1000000000L) return 0;
    *value = (int)v;
    return 1;
}

/* He initialisation into params[0]; replicas start from a broadcast of this copy */
static void init_weights(job *j)
{
    uint64_t s = 99;
    memset(j->params[0], 0, j->np * sizeof(float));
    for (int l = 0; l < j->nl; l++)
        for (size_t q = 0; q < (size_t)j->width[l] * j->width[l + 1]; q++)
            j->params[0][j->woff[l] + q] = (2 * uniform(&s) - 1) * sqrtf(6.0f / (float)j->width[l]);
}

/* one training run on `threads` thread ranks: the showcase's path, or the deterministic one */
static int train(job *j, int threads, int det)
{
    dpar_pool *pool;
    dpar_pool_desc pd = {0};
    dpar_comm_desc cd = {0};
    pd.num_threads = cd.size = threads;
    cd.deterministic = det;
    j->t_init = dpar_time_ns();
    if (dpar_pool_create(&pd, &pool) != DPAR_OK || dpar_group_create(&cd, &j->group) != DPAR_OK ||
        dpar_pool_run(pool, det ? det_rank_main : rank_main, j) != DPAR_OK)
        return fprintf(stderr, "data_parallel: %s\n", dpar_last_error()), 0;
    dpar_group_destroy(j->group);
    dpar_pool_destroy(pool);
    return 1;
}

int main(int argc, char **argv)
{
    static job j;
    const char *layers = "784,1024,1024,10", *params_out = NULL;
    int a, l, r, same = 1, resume = 0, overwrite = 0, det = 0, check = 0, trained;
    j.t_main = dpar_time_ns();
    j.batch = 256, j.steps = getenv("DPAR_TEST_QUICK") ? 12 : 30, j.threads = 2, j.lr = 0.05f;
    for (a = 1; a < argc; a++) {
        const char *o = argv[a], *v = a + 1 < argc ? argv[a + 1] : NULL;
        int *flag = !strcmp(o, "--replicas")        ? &j.replicas
                    : !strcmp(o, "--resume")        ? &resume
                    : !strcmp(o, "--overwrite")     ? &overwrite
                    : !strcmp(o, "--deterministic") ? &det
                    : !strcmp(o, "--bitwise-check") ? &check
                                                    : NULL;
        if (flag) {
            *flag = 1;
            continue;
        }
        int *number = !strcmp(o, "--batch")        ? &j.batch
                      : !strcmp(o, "--steps")      ? &j.steps
                      : !strcmp(o, "--threads")    ? &j.threads
                      : !strcmp(o, "--ckpt-every") ? &j.ckpt_every
                                                   : NULL;
        const char **text = !strcmp(o, "--layers")       ? &layers
                            : !strcmp(o, "--images")     ? &j.images
                            : !strcmp(o, "--labels")     ? &j.labels
                            : !strcmp(o, "--ckpt")       ? &j.ckpt
                            : !strcmp(o, "--params-out") ? &params_out
                                                         : NULL;
        int is_lr = !strcmp(o, "--lr");
        if (!number && !text && !is_lr) return usage("unknown option '%s'", o);
        if (!v) return usage("%s without its value", o);
        a++;
        if (number && !whole_number(v, number)) return usage("%s '%s': not a whole number", o, v);
        if (text) *text = v;
        if (is_lr) {
            char *end;
            j.lr = strtof(v, &end);
            if (end == v || *end != '\0') return usage("--lr '%s': not a number", v);
        }
    }
    for (const char *c = layers; j.nl <= MAXL; j.nl++) { /* "784,1024,1024,10" -> widths */
        j.width[j.nl] = atoi(c);
        if (j.width[j.nl] < 1) return usage("--layers '%s': positive widths, like 784,1024,1024,10", layers);
        if (!(c = strchr(c, ','))) break;
        c++;
    }
    if (j.nl < 1 || j.nl > MAXL) return usage("--layers '%s': 2 to 9 widths", layers);
    if (j.threads < 1 || j.threads > 64) return usage("--threads %d: 1 to 64", j.threads);
    if (j.batch < j.threads || j.batch % j.threads)
        return usage("--batch %d: a multiple of --threads %d (each thread an equal share)", j.batch, j.threads);
    if (j.steps < 1) return usage("--steps %d: at least 1", j.steps);
    if (!(j.lr > 0)) return usage("--lr %g: above 0", j.lr);
    if (!!j.images != !!j.labels) return usage("--images and --labels go together");
    if ((resume || overwrite || j.ckpt_every) && !j.ckpt)
        return usage("--resume, --overwrite and --ckpt-every need --ckpt PATH");
    if (resume && overwrite) return usage("--resume continues the checkpoint, --overwrite replaces it: give one");
    if (j.ckpt_every < 0) return usage("--ckpt-every %d: a number of steps >= 0 (0: at the end only)", j.ckpt_every);
    if ((det || check) && (j.ckpt || j.replicas))
        return usage("--deterministic and --bitwise-check go without --ckpt and --replicas (they keep replicas)");
    if ((det || check) && (j.batch % LEAVES || (det && LEAVES % j.threads)))
        return usage("--deterministic cuts the batch into 4 leaves: --batch %d must be a multiple of 4, --threads %d "
                     "1, 2 or 4",
                     j.batch, j.threads);
    if (det || check) j.replicas = 1, j.threads = check ? 4 : j.threads;
    if (j.ckpt) { /* before the first step: a path that cannot be written, or a fresh run over another's checkpoint */
        int flags = resume ? DPAR_CKPT_RESUME : overwrite ? DPAR_CKPT_OVERWRITE : 0;
        if (dpar_ckpt_check(j.ckpt, flags) != DPAR_OK)
            return fprintf(stderr, "data_parallel: --ckpt: %s (--resume continues it, --overwrite replaces it)\n",
                           dpar_last_error()),
                   1;
    }
    if (j.images ? !load_idx(&j) : !make_synthetic(&j)) return 1;
    j.t_data = dpar_time_ns();
    if ((size_t)(j.batch / j.threads) > j.n / (size_t)j.threads)
        return usage("--batch %d is larger than the data (%zu samples)", j.batch, j.n);
    for (l = 0; l < j.nl; l++) { /* flat layout [W0 b0 W1 b1 ...]: backward finishes it from the end */
        j.woff[l] = j.np;
        j.boff[l] = j.np + (size_t)j.width[l] * j.width[l + 1];
        j.np = j.boff[l] + j.width[l + 1];
    }
    for (r = 0; r < (j.replicas ? j.threads : 1); r++)
        if (!(j.params[r] = (float *)calloc(j.np, sizeof(float))))
            return fprintf(stderr, "data_parallel: out of memory\n"), 1;
    init_weights(&j);
    if (resume) { /* the weights and the position in the data, into rank 0's copy (replicas: broadcast from it) */
        dpar_ckpt_item items[2];
        items[0] = dpar_ckpt_replica("params", j.params[0], j.np * sizeof(float));
        items[1] = dpar_ckpt_replica("position", j.resume_at, sizeof j.resume_at);
        if (dpar_ckpt_load(NULL, j.ckpt, items, 2) != DPAR_OK)
            return fprintf(stderr, "data_parallel: --resume: %s\n", dpar_last_error()), 1;
        printf("resumed from %s at step %llu (epoch %llu, %llu of its samples consumed)\n", j.ckpt,
               (unsigned long long)j.resume_at[0], (unsigned long long)j.resume_at[1],
               (unsigned long long)j.resume_at[2]);
    }
    printf("data_parallel: layers %s (%zu parameters), %zu samples (%s), %d thread ranks x %d samples per step%s\n",
           layers, j.np, j.n, j.images ? j.images : "synthetic", j.threads, j.batch / j.threads,
           det || check ? ", deterministic (4 leaves)" : "");
    trained = j.steps - (int)j.resume_at[0];
    if (check) { /* the same training on 1, 2 and 4 ranks: the same bits, or exit 1 */
        float *ref = (float *)malloc(j.np * sizeof(float));
        size_t q = 0;
        int n;
        if (!ref) return fprintf(stderr, "data_parallel: out of memory\n"), 1;
        for (n = 1; n <= 4; n *= 2) {
            init_weights(&j);
            if (!train(&j, n, 1)) return 1;
            for (r = 1; r < n; r++) same &= !memcmp(j.params[r], j.params[0], j.np * sizeof(float));
            printf("deterministic, %d rank%s: loss %.4f -> %.4f, crc32 %08x\n", n, n > 1 ? "s" : " ", j.first_loss,
                   j.final_loss, (unsigned)dpar_crc32(0, j.params[0], j.np * sizeof(float)));
            if (n == 1) memcpy(ref, j.params[0], j.np * sizeof(float));
            for (q = 0; q < j.np && !memcmp(&ref[q], &j.params[0][q], sizeof(float)); q++) continue;
            if (q < j.np || !same) {
                if (q < j.np)
                    printf("NOT bitwise equal: %d ranks end with parameter %zu = %.9g, 1 rank with %.9g\n", n, q,
                           j.params[0][q], ref[q]);
                else printf("NOT bitwise equal: the %d ranks' replicas differ\n", n);
                return 1;
            }
        }
        free(ref);
        printf("bitwise equal: 1, 2 and 4 ranks end with the same %zu parameters, bit for bit\n", j.np);
    } else if (trained > 0 && !train(&j, j.threads, det)) {
        return 1;
    } else if (trained <= 0) {
        printf("the checkpoint is at step %llu already: nothing to train (raise --steps)\n",
               (unsigned long long)j.resume_at[0]);
    }
    for (r = 1; r < j.threads && j.replicas && !check; r++)
        same &= !memcmp(j.params[r], j.params[0], j.np * sizeof(float));
    printf("loss %.4f -> %.4f: %s\n", j.first_loss, j.final_loss,
           j.final_loss < j.first_loss ? "falls" : "DOES NOT FALL");
    if (j.replicas) printf("weights: %d replicas, %s, ", j.threads, same ? "identical" : "NOT IDENTICAL");
    else printf("weights: one copy shared by %d ranks, ", j.threads);
    printf("crc32 %08x\n", (unsigned)dpar_crc32(0, j.params[0], j.np * sizeof(float)));
    if (params_out) { /* the final weights as raw floats: compared by bytes, apart from the checkpoint code */
        FILE *f = fopen(params_out, "wb");
        if (!f || fwrite(j.params[0], sizeof(float), j.np, f) != j.np || fclose(f))
            return fprintf(stderr, "data_parallel: --params-out %s: cannot write it\n", params_out), 1;
    }
    if (trained > 1 && !det && !check)
        printf(
            "time: step_ms=%.2f gemm_frac=%.3f (rank 0's time inside GEMM) overlap_ms=%.2f (buckets in flight before "
            "the step's end) wait_ms=%.2f (then waited for) stolen=%.1f (rank 0's tasks per step run by another "
            "rank)\n",
            j.seconds * 1e3 / (trained - 1), j.gemm_ns * 1e-9 / j.seconds, j.overlap_ns * 1e-6 / (trained - 1),
            j.wait_ns * 1e-6 / (trained - 1), (double)j.given / trained);
    if (j.t_first) /* main() to the end of the first step: the data, the weights, dpar's objects (pool, group,
                      comm, sampler, buckets, stealing), the step itself (its first allreduces included) */
        printf("startup: first_step_ms=%.2f data_ms=%.2f init_ms=%.2f setup_ms=%.2f step0_ms=%.2f\n",
               (double)(j.t_first - j.t_main) * 1e-6, (double)(j.t_data - j.t_main) * 1e-6,
               (double)(j.t_init - j.t_data) * 1e-6, (double)(j.t_setup - j.t_init) * 1e-6,
               (double)(j.t_first - j.t_setup) * 1e-6);
    printf("train samples_per_s=%.1f final_loss=%.4f\n",
           trained > 1 && j.seconds > 0 ? (double)j.batch * (trained - 1) / j.seconds : 0.0, j.final_loss);
    for (r = 0; r < 64; r++) free(j.params[r]);
    if (j.images) dpar_idx_destroy(&j.images_file);
    else free(j.x);
    free(j.y);
    /* a resumed run need not see its loss fall (it may train a few steps only) */
    return same && (resume || j.final_loss < j.first_loss) ? 0 : 1;
}
