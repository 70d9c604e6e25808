/* 09_local_sgd.c - lesson 9 of the guide (docs/guide/09_local_sgd.md): local SGD, and federated averaging.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/09_local_sgd.c -o build/lesson09 -pthread -lm
   Run:   build/lesson09
   Check: ^H=1 \(data parallelism\) = one thread on the whole batch: max parameter difference [0-9.e+-]+ < 1e-5$
   Check: ^every run = the same rounds computed serially: max parameter difference [0-9.e+-]+ < 1e-5$
   Check: ^bytes moved = rounds x 4\(N-1\) x 40 bytes \(the ring's traffic over all ranks\): exact, 1/H of H=1's$

   Local SGD: N ranks take H steps each on their own data, then one allreduce averages the parameters (H = 1 is data
   parallelism). Federated averaging (FedAvg): the same rounds on clients whose data differ and never leave them,
   averaged weighted by sample counts, half the clients a round. Every run is checked against a serial one. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define N 4       /* ranks: workers, or clients */
#define D 8       /* features */
#define P (D + 1) /* parameters: w (D), then the bias */
#define B 16      /* samples per local step */
#define STEPS 128 /* local SGD: steps per rank in all */
#define MAXS 512  /* samples per client at most */
#define ALL 960   /* samples of all clients: 64 + 128 + 256 + 512 */
#define LR 0.05f
enum { LOCAL, FEDAVG, FEDAVG_UNWEIGHTED };
static int H, rounds, kind, nsamp[N]; /* the run: H local steps a round, `rounds` rounds, LOCAL or federated */
static float X[N][MAXS * D], Y[N][MAXS], result[N][P];
static uint64_t moved[N];
static dpar_group *group;
static uint32_t seed = 1; /* uniform(): in [-1, 1), a generator of our own, the same numbers on every system */
static float uniform(void) { return (float)((seed = seed * 1664525u + 1013904223u) >> 8) * (2.0f / 16777216) - 1; }
static void make_data(void) /* non-IID: client r has 64 << r samples around its own centre, its own offset */
{
    int r, i, k;
    for (r = 0; r < N; r++) {
        nsamp[r] = 64 << r;
        for (i = 0; i < nsamp[r]; i++) {
            Y[r][i] = 0.3f + 0.05f * uniform() + 0.5f * (r - 1.5f); /* the target: an offset, noise, then w . x */
            for (k = 0; k < D; k++) {
                X[r][i * D + k] = uniform() + 0.5f * (r - 1.5f);
                Y[r][i] += sinf(k + 1.0f) * X[r][i * D + k];
            }
        }
    }
}
static float error(const float *w, int r, int s) /* the model's output minus the target, sample s of client r */
{
    float e = w[D] - Y[r][s];
    for (int k = 0; k < D; k++) e += w[k] * X[r][s * D + k];
    return e;
}
/* SGD step t on the mean gradient of 0.5 error^2 over clients r..r+n-1, B samples each: n = 1 is a local step */
static void sgd_step(float *w, int r, int n, int t)
{
    float g[P] = {0}; /* the gradient */
    float e;          /* a sample's error, scaled for the mean */
    int i, s, k;
    for (i = r; i < r + n; i++)
        for (s = t * B % nsamp[i]; s < t * B % nsamp[i] + B; s++) { /* client i's samples of step t */
            e = error(w, i, s) * (1.0f / (n * B));
            for (k = 0; k < D; k++) g[k] += e * X[i][s * D + k];
            g[D] += e;
        }
    for (i = 0; i < P; i++) w[i] -= LR * g[i];
}
/* client r's weight in round k: 0 if not picked (federated: N/2 clients a round, in turn), else 1 or its samples */
static float weight(int r, int k)
{
    int picked = (r - k % N + N) % N < N / 2;
    if (kind == LOCAL) return 1;
    if (!picked) return 0;
    return kind == FEDAVG ? (float)nsamp[r] : 1;
}
static dpar_status rank_main(void *user, int r, int n)
{
    float acc[P + 1];     /* the weighted parameters, then the weight: what the allreduce sums */
    float *w = result[r]; /* my replica */
    int k, i, t;
    dpar_comm *comm;
    dpar_comm_stats s;
    dpar_status st = dpar_group_join(group, r, &comm);
    memset(w, 0, sizeof result[r]);
    for (k = 0; k < rounds && st == DPAR_OK; k++) {
        for (t = k * H; t < k * H + H && weight(r, k) > 0; t++) sgd_step(w, r, 1, t); /* my data, no messages */
        for (i = 0; i < P; i++) acc[i] = weight(r, k) * w[i];
        acc[P] = weight(r, k); /* the sum of the weights travels with the weighted sum of the parameters */
        st = dpar_allreduce(comm, acc, acc, P + 1, DPAR_F32, DPAR_SUM);
        for (i = 0; i < P; i++) w[i] = acc[i] / acc[P]; /* the (weighted) average: the same on every rank */
    }
    if (st == DPAR_OK) st = dpar_comm_stats_get(comm, &s);
    moved[r] = st ? 0 : s.by_coll[DPAR_COLL_ALLREDUCE].bytes_sent + s.by_coll[DPAR_COLL_ALLREDUCE].bytes_received;
    dpar_comm_destroy(comm);
    (void)user;
    (void)n;
    return st;
}
static void serial(float *w) /* the same rounds, one client after the other */
{
    float local[P]; /* a client's replica in this round */
    float acc[P];   /* the weighted sum of the replicas */
    float total;    /* the sum of the weights */
    int k, r, i, t;
    memset(w, 0, P * sizeof *w);
    for (k = 0; k < rounds; k++) {
        memset(acc, 0, sizeof acc);
        total = 0;
        for (r = 0; r < N; r++) {
            memcpy(local, w, sizeof local); /* (a client not picked in round k has weight 0) */
            for (t = k * H; t < k * H + H; t++) sgd_step(local, r, 1, t);
            for (i = 0; i < P; i++) acc[i] += weight(r, k) * local[i];
            total += weight(r, k);
        }
        for (i = 0; i < P; i++) w[i] = acc[i] / total;
    }
}
static double loss(const float *w) /* the mean of 0.5 error^2 over every client's samples */
{
    double sum = 0;
    int r, s;
    for (r = 0; r < N; r++)
        for (s = 0; s < nsamp[r]; s++) sum += 0.5 * error(w, r, s) * error(w, r, s);
    return sum / ALL;
}
int main(void)
{
    static const int runs[5][3] = {
        {1, STEPS, LOCAL}, {8, STEPS / 8, LOCAL}, {STEPS, 1, LOCAL}, {8, 16, FEDAVG}, {8, 16, FEDAVG_UNWEIGHTED}};
    static const char *label[3] = {"local SGD", "FedAvg, weighted by samples", "FedAvg, clients alike"};
    dpar_comm_desc cd = {0};
    dpar_pool_desc pd = {0};
    dpar_pool *pool;
    float ref[P];      /* a run computed serially */
    float dp[P] = {0}; /* H=1's reference: one thread on all ranks' samples */
    float d = 0;       /* the largest difference from dp */
    float dser = 0;    /* the largest difference from ref */
    double loss0;
    uint64_t bytes;
    int v, r, i, t;
    int ok = 1;
    int exact = 1; /* the bytes moved = the ring's formula, every run */
    cd.size = N;
    pd.num_threads = N;
    cd.algo = DPAR_ALGO_RING; /* the ring at every size: its bytes follow the formula checked below */
    if (dpar_pool_create(&pd, &pool) != DPAR_OK) {
        fprintf(stderr, "09_local_sgd: %s\n", dpar_last_error());
        return 1;
    }
    make_data();
    loss0 = loss(dp);
    printf("%d ranks (clients) of 64..512 samples, non-IID; loss at w = 0: %.5f\n", N, loss0);
    for (t = 0; t < STEPS; t++) sgd_step(dp, 0, N, t); /* the reference of H=1: one thread, all ranks' samples */
    for (v = 0; v < 5; v++) {
        H = runs[v][0];
        rounds = runs[v][1];
        kind = runs[v][2];
        if (dpar_group_create(&cd, &group) != DPAR_OK || dpar_pool_run(pool, rank_main, NULL) != DPAR_OK) {
            fprintf(stderr, "09_local_sgd: %s\n", dpar_last_error());
            return 1;
        }
        dpar_group_destroy(group);
        serial(ref);
        for (i = 0; i < P; i++) dser = fmaxf(dser, fabsf(result[0][i] - ref[i])); /* a NaN fails the loss check */
        for (i = 0; i < P && v == 0; i++) d = fmaxf(d, fabsf(result[0][i] - dp[i]));
        bytes = 0;
        for (r = 0; r < N; r++) {
            ok &= memcmp(result[r], result[0], sizeof ref) == 0; /* every rank holds the same average */
            bytes += moved[r];
        }
        exact &= bytes == (uint64_t)rounds * 4 * (N - 1) * (P + 1) * sizeof(float);
        ok &= loss(result[0]) < 0.5 * loss0;
        printf("  %-27s H=%-3d %3d rounds of %s, %5llu bytes moved, loss %.5f\n", label[kind], H, rounds,
               kind ? "2 clients" : "4 ranks", (unsigned long long)bytes, loss(result[0]));
    }
    printf("the clients' %d samples (%d bytes) never left them\n", ALL, ALL * P * (int)sizeof(float));
    if ((ok &= d < 1e-5f && dser < 1e-5f && exact)) {
        printf("H=1 (data parallelism) = one thread on the whole batch: max parameter difference %.1e < 1e-5\n", d);
        printf("every run = the same rounds computed serially: max parameter difference %.1e < 1e-5\n", dser);
        printf("bytes moved = rounds x 4(N-1) x 40 bytes (the ring's traffic over all ranks): exact, 1/H of H=1's\n");
    }
    dpar_pool_destroy(pool);
    if (!ok) fprintf(stderr, "FAILED: a check against the serial reference failed\n");
    return ok ? 0 : 1;
}
