/* 19_checkpoint_elastic.c - lesson 19 of the guide (docs/guide/19_checkpoint_elastic.md): checkpoints, resuming, and
   an elastic restart on another number of ranks.
   Build: mkdir -p build && cc -std=c99 -O2 -I. examples/guide/19_checkpoint_elastic.c -o build/lesson19 -pthread -lm
   Run:   build/lesson19   (build/lesson19 1: resume on 1 rank instead of 2, or 4; it writes build/lesson19.ckpt*)
   Check: ^saved on 4 ranks at step 5, resumed on 2: step 9's parameters = the uninterrupted run's, bit for bit$
   Check: ^resumed without the sampler's position: the parameters differ from the uninterrupted run's \(as they must\)$

   A linear model y = x W + b (6 inputs, 4 outputs) trained with Adam by dpar_fsdp (ZeRO-3: rank r keeps block r of
   the weights, the bias and both Adam moments) on 4 thread ranks. The global batch of 16 samples is 4 fixed leaves of
   4 (dpar_fsdp's deterministic mode, desc.leaves), drawn in the order of a dpar_sampler's shuffle of 96 samples.
   Runs: 4 ranks from step 0 to 9 without stopping (the reference), and 1 rank the same; 4 ranks to step 5, saving a
   checkpoint (dpar_ckpt_save_fsdp: the shards, with the step and the sampler's position) in build/; then 2 ranks load
   it (dpar_ckpt_load_fsdp reshards 4 blocks into 2) and go on to step 9. Checked: the resumed run's parameters equal
   the reference's bit for bit, and a resume that forgets the sampler's position does not. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define INPUTS 6
#define OUTPUTS 4
#define SAMPLES 96 /* the data set: 6 steps an epoch */
#define BATCH 16   /* the global batch: it must not change across a restart */
#define LEAVES 4   /* the batch in 4 fixed leaves of 4 samples: the same sums on 1, 2 or 4 ranks */
#define SEED 19
#define STEPS 10
#define SAVE_STEP 5
#define CKPT "build/lesson19.ckpt"
#define UNITS 2 /* unit 0: W (INPUTS x OUTPUTS), unit 1: b */

static const size_t unit_counts[UNITS] = {INPUTS * OUTPUTS, OUTPUTS};
static float inputs[SAMPLES][INPUTS], targets[SAMPLES][OUTPUTS];

typedef struct run { /* one training run on `ranks` thread ranks, steps [first_step, last_step) */
    int ranks, first_step, last_step;
    int load, save;      /* load: start from the checkpoint (its step); save: write one at last_step */
    int forget_position; /* 1: after loading, start the sampler at the epoch's beginning (WRONG, on purpose) */
    float weights[INPUTS * OUTPUTS], bias[OUTPUTS]; /* the parameters at the end */
    int64_t resumed_epoch, resumed_consumed;
    dpar_group *group; /* where its ranks meet */
} run;

/* the gradient of one leaf's mean squared error / 2, for its samples, into grad_w and grad_b */
static void leaf_gradient(const size_t *samples, const float *w, const float *b, float *grad_w, float *grad_b)
{
    int i, j, k;
    for (i = 0; i < BATCH / LEAVES; i++) {
        const float *x = inputs[samples[i]];
        for (k = 0; k < OUTPUTS; k++) {
            float y = b[k];
            float error;
            for (j = 0; j < INPUTS; j++) y += x[j] * w[j * OUTPUTS + k];
            error = (y - targets[samples[i]][k]) / (BATCH / LEAVES);
            for (j = 0; j < INPUTS; j++) grad_w[j * OUTPUTS + k] += x[j] * error;
            grad_b[k] += error;
        }
    }
}

static dpar_status train(dpar_comm *comm, run *job)
{
    dpar_fsdp_desc desc = {0};
    dpar_fsdp *fsdp = NULL;
    dpar_sampler sampler = {0};
    dpar_sampler_desc sampler_desc = {0};
    const size_t *order = NULL;      /* the rest of the epoch's shuffle, from the position on */
    int64_t position[3] = {0, 0, 0}; /* the step, the epoch, the epoch's samples consumed: saved with the shards */
    size_t available = 0, taken = 0;
    int first_leaf, leaf_count, step, u, leaf;
    dpar_status st;
    desc.comm = comm;
    desc.stage = 3;
    desc.num_units = UNITS;
    desc.unit_counts = unit_counts;
    desc.kind = DPAR_OPTIM_ADAM;
    desc.lr = 0.05f;
    desc.leaves = LEAVES;
    sampler_desc.n = SAMPLES;
    sampler_desc.ranks = 1; /* every rank sees the whole shuffle: the batch is cut by leaves, not by ranks */
    sampler_desc.seed = SEED;
    st = dpar_fsdp_create(&desc, &fsdp);
    if (st == DPAR_OK) st = dpar_sampler_init(&sampler, &sampler_desc);
    if (st == DPAR_OK) st = dpar_fsdp_leaves(fsdp, &first_leaf, &leaf_count);
    if (st == DPAR_OK && job->load) { /* the shards of 4 ranks into this rank's blocks, and where the data was */
        dpar_ckpt_item item = dpar_ckpt_replica("position", position, sizeof position);
        st = dpar_ckpt_load_fsdp(fsdp, CKPT, NULL, &item, 1);
        job->resumed_epoch = position[1];
        job->resumed_consumed = position[2];
        if (job->forget_position) position[2] = 0;
    } else if (st == DPAR_OK) { /* a fresh run: the same start on every rank */
        float zeros[INPUTS * OUTPUTS] = {0};
        st = dpar_fsdp_set_params(fsdp, 0, zeros);
        if (st == DPAR_OK) st = dpar_fsdp_set_params(fsdp, 1, zeros);
    }
    if (st == DPAR_OK) available = dpar_sampler_resume(&sampler, (uint64_t)position[1], (size_t)position[2], &order);
    for (step = job->load ? (int)position[0] : job->first_step; step < job->last_step && st == DPAR_OK; step++) {
        float *w, *b, *grad_w, *grad_b;
        float leaf_grad_w[LEAVES][INPUTS * OUTPUTS], leaf_grad_b[LEAVES][OUTPUTS];
        if (taken == available) { /* the epoch is over: the next one's shuffle */
            position[1]++;
            available = dpar_sampler_resume(&sampler, (uint64_t)position[1], 0, &order);
            taken = 0;
        }
        memset(leaf_grad_w, 0, sizeof leaf_grad_w);
        memset(leaf_grad_b, 0, sizeof leaf_grad_b);
        st = dpar_fsdp_gather(fsdp, 0, &w); /* the whole W and b, gathered from the ranks' blocks */
        if (st == DPAR_OK) st = dpar_fsdp_gather(fsdp, 1, &b);
        for (leaf = 0; leaf < leaf_count && st == DPAR_OK; leaf++) { /* each leaf of this rank apart */
            const size_t *samples = order + taken + (size_t)(first_leaf + leaf) * (BATCH / LEAVES);
            leaf_gradient(samples, w, b, leaf_grad_w[leaf], leaf_grad_b[leaf]);
        }
        if (st == DPAR_OK) st = dpar_fsdp_release(fsdp, 1);
        if (st == DPAR_OK) st = dpar_fsdp_release(fsdp, 0);
        if (st == DPAR_OK) st = dpar_fsdp_grads(fsdp, 1, &grad_b); /* room for this rank's leaves, one after another */
        if (st == DPAR_OK) memcpy(grad_b, leaf_grad_b, sizeof(float) * OUTPUTS * leaf_count);
        if (st == DPAR_OK) st = dpar_fsdp_reduce(fsdp, 1); /* the leaves' average, in the fixed tree */
        if (st == DPAR_OK) st = dpar_fsdp_grads(fsdp, 0, &grad_w);
        if (st == DPAR_OK) memcpy(grad_w, leaf_grad_w, sizeof(float) * INPUTS * OUTPUTS * leaf_count);
        if (st == DPAR_OK) st = dpar_fsdp_reduce(fsdp, 0);
        if (st == DPAR_OK) st = dpar_fsdp_step(fsdp); /* Adam on this rank's blocks */
        taken += BATCH;
        position[0] = step + 1;
        position[2] = (int64_t)dpar_sampler_consumed(&sampler, taken);
    }
    if (st == DPAR_OK && job->save) {
        dpar_ckpt_item item = dpar_ckpt_replica("position", position, sizeof position);
        st = dpar_ckpt_save_fsdp(fsdp, CKPT, NULL, &item, 1);
    }
    for (u = 0; u < UNITS && st == DPAR_OK; u++) /* collective: every rank's blocks into the whole */
        st = dpar_fsdp_get_params(fsdp, u, u == 0 ? job->weights : job->bias);
    dpar_sampler_destroy(&sampler);
    dpar_fsdp_destroy(fsdp);
    return st;
}

static dpar_status rank_main(void *user, int rank, int ranks)
{
    run *job = (run *)user;
    dpar_comm *comm;
    dpar_status st = dpar_group_join(job->group, rank, &comm);
    (void)ranks;
    if (st == DPAR_OK) st = train(comm, job);
    dpar_comm_destroy(comm);
    return st;
}

static dpar_status run_on_ranks(run *job)
{
    dpar_comm_desc comm_desc = {0};
    dpar_pool_desc pool_desc = {0};
    dpar_pool *pool = NULL;
    dpar_status st;
    pool_desc.num_threads = job->ranks;
    st = dpar_pool_create(&pool_desc, &pool);
    comm_desc.size = job->ranks;
    comm_desc.pool = pool;
    job->group = NULL;
    if (st == DPAR_OK) st = dpar_group_create(&comm_desc, &job->group);
    if (st == DPAR_OK) st = dpar_pool_run(pool, rank_main, job);
    dpar_group_destroy(job->group);
    dpar_pool_destroy(pool);
    return st;
}

static int checkpoint_files(void) /* build/lesson19.ckpt and the files beside it that share its name */
{
    DIR *dir = opendir("build");
    struct dirent *entry;
    int count = 0;
    while (dir && (entry = readdir(dir)) != NULL) count += strncmp(entry->d_name, "lesson19.ckpt", 13) == 0;
    if (dir) closedir(dir);
    return count;
}

static int same_parameters(const run *a, const run *b)
{
    return memcmp(a->weights, b->weights, sizeof a->weights) == 0 && memcmp(a->bias, b->bias, sizeof a->bias) == 0;
}

int main(int argc, char **argv)
{
    static run uninterrupted, one_rank, saving, resumed, forgetful;
    int resume_ranks = argc > 1 ? atoi(argv[1]) : 2;
    int i, j, k, ok = 1;
    dpar_status st;
    if (resume_ranks < 1 || resume_ranks > LEAVES || LEAVES % resume_ranks != 0) {
        fprintf(stderr, "usage: %s [ranks to resume on: 1, 2 or 4, which divide the %d leaves]\n", argv[0], LEAVES);
        return 2;
    }
    for (i = 0; i < SAMPLES; i++) /* targets: a fixed W and b, plus what no linear model fits */
        for (k = 0; k < OUTPUTS; k++) {
            float target = 0.1f * (float)k + 0.2f * sinf((float)(i * OUTPUTS + k));
            for (j = 0; j < INPUTS; j++) {
                inputs[i][j] = cosf(0.7f * (float)(i * INPUTS + j));
                target += inputs[i][j] * (float)((j + k) % 3 - 1);
            }
            targets[i][k] = target;
        }
    if (dpar_ckpt_check(CKPT, DPAR_CKPT_OVERWRITE) != DPAR_OK) { /* build/ missing or not writable: say so now */
        fprintf(stderr, "lesson19: %s\n", dpar_last_error());
        return 1;
    }
    uninterrupted.ranks = 4;
    uninterrupted.last_step = STEPS;
    one_rank = uninterrupted;
    one_rank.ranks = 1;
    saving = uninterrupted;
    saving.last_step = SAVE_STEP;
    saving.save = 1;
    resumed = uninterrupted;
    resumed.ranks = resume_ranks;
    resumed.load = 1;
    forgetful = resumed;
    forgetful.forget_position = 1;
    printf("%d samples, a global batch of %d in %d leaves of %d; steps 0 to %d, a checkpoint after step %d\n", SAMPLES,
           BATCH, LEAVES, BATCH / LEAVES, STEPS - 1, SAVE_STEP - 1);
    st = run_on_ranks(&uninterrupted);
    if (st == DPAR_OK) st = run_on_ranks(&one_rank);
    if (st == DPAR_OK) st = run_on_ranks(&saving);
    if (st == DPAR_OK) printf("saved: %s and %d files beside it, one per rank\n", CKPT, checkpoint_files() - 1);
    if (st == DPAR_OK) st = run_on_ranks(&resumed);
    if (st == DPAR_OK) st = run_on_ranks(&forgetful);
    if (st != DPAR_OK) {
        fprintf(stderr, "lesson19: %s\n", dpar_last_error());
        return 1;
    }
    printf("its position: step %d, epoch %lld, %lld of the epoch's %d samples consumed\n", SAVE_STEP,
           (long long)resumed.resumed_epoch, (long long)resumed.resumed_consumed, SAMPLES);
    for (k = 0; k < UNITS; k++) { /* what reshards: each rank's block of a unit (and of its Adam moments) */
        size_t offset, length;
        printf("unit %d (%s, %zu values): blocks of 4 ranks", k, k == 0 ? "W" : "b", unit_counts[k]);
        for (i = 0; i < 4; i++) {
            dpar_block_range(unit_counts[k], 4, i, &offset, &length);
            printf(" %zu", length);
        }
        printf(" -> of %d ranks", resume_ranks);
        for (i = 0; i < resume_ranks; i++) {
            dpar_block_range(unit_counts[k], resume_ranks, i, &offset, &length);
            printf(" %zu", length);
        }
        printf("\n");
    }
    printf("W[0][0..3] after step %d: uninterrupted on 4 ranks %.6f %.6f %.6f %.6f\n", STEPS - 1,
           uninterrupted.weights[0], uninterrupted.weights[1], uninterrupted.weights[2], uninterrupted.weights[3]);
    printf("                          resumed on %d         %.6f %.6f %.6f %.6f\n", resume_ranks, resumed.weights[0],
           resumed.weights[1], resumed.weights[2], resumed.weights[3]);
    printf("                          without the position  %.6f %.6f %.6f %.6f\n", forgetful.weights[0],
           forgetful.weights[1], forgetful.weights[2], forgetful.weights[3]);
    ok &= same_parameters(&one_rank, &uninterrupted);
    ok &= same_parameters(&resumed, &uninterrupted);
    ok &= !same_parameters(&forgetful, &uninterrupted);
    if (!ok) {
        fprintf(stderr, "FAILED: a run that must equal the uninterrupted one differs, or the forgetful one does not\n");
        return 1;
    }
    printf("on 1 rank, uninterrupted: step %d's parameters = the 4 ranks' run's, bit for bit\n", STEPS - 1);
    printf("saved on 4 ranks at step %d, resumed on %d: step %d's parameters = the uninterrupted run's, bit for bit\n",
           SAVE_STEP, resume_ranks, STEPS - 1);
    printf(
        "resumed without the sampler's position: the parameters differ from the uninterrupted run's (as they must)\n");
    return 0;
}
