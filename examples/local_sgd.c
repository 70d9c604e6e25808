/* local_sgd.c - local SGD (periodic parameter averaging, as in federated averaging) against a gradient allreduce
   every step.
   Build: cc -std=c99 -O2 -I. examples/local_sgd.c -o local_sgd -pthread -lm
   Run:   ./local_sgd            (./local_sgd --ranks 2 --every 16)
   Check: ^A: allreduce the gradients every step: .* bytes
   Check: ^B: average the parameters every [0-9]+ steps: .* bytes
   Check: ^local_sgd: B communicated 0\.[0-9]+ of A's bytes \(1/K = 0\.[0-9]+\), both losses fell, OK

   Data parallelism usually allreduces the gradients at every step, so every replica takes exactly
   the step that training on all the data would take; the price is one allreduce of the whole model
   per step. Local SGD (and federated averaging, its name when the ranks are phones whose data must
   never leave them) lets each rank take K steps on its own data alone and then averages the
   parameters (dpar_allreduce DPAR_AVG of the model): K times less communication, at the cost of
   replicas that drift apart between averagings, more so when the ranks' data differ. Here every
   rank holds a shard of a 4-class problem skewed towards one class (so the shards really differ),
   trains a softmax classifier both ways for the same number of steps, and reads the bytes each
   variant moved from the comm's counters (dpar_comm_stats_get: bytes sent plus bytes received, over
   all ranks). The loss is evaluated on all the data through a second comm made with
   dpar_comm_split, so the counters of the training comm see nothing but training traffic. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define D 16 /* features */
#define C 4  /* classes */
#define P (C * (D + 1))
#define PER 512 /* samples per rank */
#define MAX_RANKS 16
#define MAX_STEPS 1024
#define LR 0.5f

typedef struct job {
    int ranks, every, steps;
    double loss[2][MAX_STEPS + 1]; /* the model's loss on all data after each averaging (every K steps) */
    uint64_t bytes[2][MAX_RANKS], calls[2][MAX_RANKS];
    dpar_group *group;
} job;

static double uniform(unsigned long long *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*s >> 11) / 9007199254740992.0;
}
static double gauss(unsigned long long *s)
{
    return sqrt(-2.0 * log(uniform(s) + 1e-300)) * cos(6.283185307179586 * uniform(s));
}

/* mean cross-entropy over n samples and, if grad is not NULL, its gradient; w is (C, D+1), bias last */
static double loss_and_grad(const float *x, const int *y, int n, const float *w, float *grad)
{
    double loss = 0;
    int i, k, j;
    if (grad) memset(grad, 0, sizeof(float) * P);
    for (i = 0; i < n; i++) {
        float z[C], zmax = -1e30f, sum = 0;
        const float *xi = x + (size_t)i * D;
        for (k = 0; k < C; k++) {
            z[k] = w[k * (D + 1) + D];
            for (j = 0; j < D; j++) z[k] += w[k * (D + 1) + j] * xi[j];
            zmax = z[k] > zmax ? z[k] : zmax;
        }
        for (k = 0; k < C; k++) sum += (z[k] = expf(z[k] - zmax));
        loss -= log(z[y[i]] / sum);
        for (k = 0; grad && k < C; k++) { /* d loss / d logit = softmax - one-hot */
            float g = (z[k] / sum - (k == y[i] ? 1.0f : 0.0f)) / (float)n;
            for (j = 0; j < D; j++) grad[k * (D + 1) + j] += g * xi[j];
            grad[k * (D + 1) + D] += g;
        }
    }
    return loss / n;
}

#define TRY(call)                                                              \
    do {                                                                       \
        if ((st = (call)) != DPAR_OK) {                                        \
            fprintf(stderr, "rank %d: %s: %s\n", r, #call, dpar_last_error()); \
            goto done;                                                         \
        }                                                                      \
    } while (0)

static dpar_status rank_main(void *user, int r, int n)
{
    job *j = (job *)user;
    static const float zero[P];
    float x[PER * D], w[P], grad[P], centers[C][D];
    int y[PER], i, k, v, step;
    unsigned long long s = 42;
    dpar_comm *c = NULL, *eval = NULL;
    dpar_comm_stats stats;
    dpar_status st;
    double loss;
    (void)n;
    /* the same class centres everywhere; my shard: half my own class (r mod C), half any class */
    for (k = 0; k < C; k++)
        for (i = 0; i < D; i++) centers[k][i] = (float)(1.5 * gauss(&s));
    s = 1000 + (unsigned long long)r;
    for (i = 0; i < PER; i++) {
        y[i] = uniform(&s) < 0.5 ? r % C : (int)(uniform(&s) * C) % C;
        for (k = 0; k < D; k++) x[i * D + k] = centers[y[i]][k] + (float)(1.5 * gauss(&s));
    }
    if ((st = dpar_group_join(j->group, r, &c)) != DPAR_OK) {
        fprintf(stderr, "rank %d: dpar_group_join: %s\n", r, dpar_last_error());
        return st;
    }
    TRY(dpar_comm_split(c, 0, r, &eval)); /* the same ranks, counted apart */
    for (v = 0; v < 2; v++) {             /* A, then B, from the same start: all zeros */
        memcpy(w, zero, sizeof w);
        TRY(dpar_comm_stats_reset(c));
        loss = loss_and_grad(x, y, PER, w, NULL);
        TRY(dpar_allreduce(eval, &loss, &loss, 1, DPAR_F64, DPAR_AVG)); /* equal shards: the mean over all data */
        if (r == 0) j->loss[v][0] = loss; /* the same on every rank: one of them records it */
        for (step = 1; step <= j->steps; step++) {
            loss_and_grad(x, y, PER, w, grad);                                     /* the gradient of my shard alone */
            if (v == 0) TRY(dpar_allreduce(c, grad, grad, P, DPAR_F32, DPAR_AVG)); /* A: everyone's average */
            for (i = 0; i < P; i++) w[i] -= LR * grad[i];
            if (v == 1 && step % j->every == 0) TRY(dpar_allreduce(c, w, w, P, DPAR_F32, DPAR_AVG)); /* B */
            if (step % j->every == 0) { /* both variants hold one shared model now: evaluate it */
                loss = loss_and_grad(x, y, PER, w, NULL);
                TRY(dpar_allreduce(eval, &loss, &loss, 1, DPAR_F64, DPAR_AVG));
                if (r == 0) j->loss[v][step / j->every] = loss;
            }
        }
        TRY(dpar_comm_stats_get(c, &stats));
        j->calls[v][r] = stats.by_coll[DPAR_COLL_ALLREDUCE].calls;
        j->bytes[v][r] =
            stats.by_coll[DPAR_COLL_ALLREDUCE].bytes_sent + stats.by_coll[DPAR_COLL_ALLREDUCE].bytes_received;
    }
done:
    if (st != DPAR_OK) { /* wake the other ranks instead of letting them time out */
        dpar_comm_abort(c);
        if (eval) dpar_comm_abort(eval);
    }
    if (eval) dpar_comm_destroy(eval);
    dpar_comm_destroy(c);
    return st;
}

int main(int argc, char **argv)
{
    static job j;
    static const char *names[2] = {"A: allreduce the gradients every step:",
                                   "B: average the parameters every %d steps:"};
    dpar_pool_desc pd;
    dpar_comm_desc cd;
    dpar_pool *pool = NULL;
    dpar_status st;
    uint64_t bytes[2] = {0, 0};
    char label[64];
    int i, r, v, rounds, fell = 1, ok;
    double ratio;
    j.ranks = 4;
    j.every = 8;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ranks") && i + 1 < argc) j.ranks = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--every") && i + 1 < argc) j.every = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--ranks N] [--every K]\n", argv[0]);
            return 2;
        }
    }
    if (j.ranks < 1 || j.ranks > MAX_RANKS || j.every < 1 || j.every > 64) {
        fprintf(stderr, "local_sgd: --ranks must be 1..%d and --every 1..64\n", MAX_RANKS);
        return 2;
    }
    j.steps = getenv("DPAR_TEST_QUICK") ? 128 : 512;
    j.steps = (j.steps + j.every - 1) / j.every * j.every; /* whole rounds: both end on an averaged model */
    rounds = j.steps / j.every;
    memset(&pd, 0, sizeof pd);
    memset(&cd, 0, sizeof cd);
    pd.num_threads = cd.size = j.ranks;
    if ((st = dpar_pool_create(&pd, &pool)) == DPAR_OK && (st = dpar_group_create(&cd, &j.group)) == DPAR_OK)
        st = dpar_pool_run(pool, rank_main, &j);
    if (st != DPAR_OK) {
        fprintf(stderr, "local_sgd: %s\n", dpar_last_error());
        return 1;
    }
    dpar_group_destroy(j.group);
    dpar_pool_destroy(pool);

    printf(
        "local_sgd: softmax regression, %d parameters, %d ranks with %d samples each (half of them of the rank's own "
        "class), %d steps of SGD\n",
        P, j.ranks, PER, j.steps);
    printf(" step   loss A    loss B   (on all the data)\n");
    for (i = 0; i <= rounds; i++)
        if (i % (rounds / 4 > 0 ? rounds / 4 : 1) == 0 || i == rounds)
            printf("%5d   %.4f    %.4f\n", i * j.every, j.loss[0][i], j.loss[1][i]);
    for (v = 0; v < 2; v++) {
        for (r = 0; r < j.ranks; r++) bytes[v] += j.bytes[v][r];
        snprintf(label, sizeof label, names[v], j.every);
        printf("%-42s %d steps, %llu allreduces of %d floats per rank, %llu bytes sent + received by all ranks, "
               "final loss %.4f\n",
               label, j.steps, (unsigned long long)j.calls[v][0], P, (unsigned long long)bytes[v], j.loss[v][rounds]);
        fell &= j.loss[v][rounds] < 0.5 * j.loss[v][0];
    }
    ratio = bytes[0] ? (double)bytes[1] / bytes[0]
                     : (double)j.calls[1][0] / j.calls[0][0]; /* 1 rank: no bytes, count calls */
    ok = fell && fabs(ratio * j.every - 1.0) < 0.05;
    printf("local_sgd: B communicated %.4f of A's bytes (1/K = %.4f), %s, %s\n", ratio, 1.0 / j.every,
           fell ? "both losses fell" : "a loss DID NOT FALL", ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
}
