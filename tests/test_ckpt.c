/* test_ckpt.c - checkpoints that reshard: saved from one layout (a tp x pp x dp mesh over thread ranks, ZeRO flat
   shards, replicas) and loaded into every other layout and world size, each element checked bitwise against the
   closed formula of its global position (ckpt_case.h); the layouts a checkpoint cannot fill, refused with the tensor
   and the reason; ZeRO-1 and FSDP objects saved on 4 ranks and resumed on 1, 2 and 3, their next step bitwise that of
   a serial reference; the sampler's position carried across a 4 -> 3 restart, no sample repeated or skipped.
   Build and run: make build/test_ckpt && build/test_ckpt   (one test: build/test_ckpt sampler) */
#define DPAR_IMPLEMENTATION
#include "dpar.h"

#include <math.h>
#include <unistd.h>

#include "dpar_test.h"
#include "coll_matrix.h"

#include "ckpt_case.h"
#include "fsdp_case.h"

static void tmpdir_path(char *dir, char *path, size_t n, const char *name)
{
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, n, "%s/%s", dir, name);
}
static void rmdir_all(const char *dir)
{
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

/* ---- every layout from one ---- */
typedef struct {
    char path[256];
    int tp, pp, save;
} cc_job;

static void cc_rank(world *w, dpar_comm *c, int r)
{
    cc_job *j = (cc_job *)w->user;
    dpar_ckpt_item items[CC_T];
    void *bufs[CC_T];
    int k = cc_items(j->tp, j->pp, w->n, r, j->save, items, bufs);
    size_t bad;
    if (j->save) {
        expect_ok(w, dpar_ckpt_save(c, j->path, items, k), "save", r);
    } else {
        expect_ok(w, dpar_ckpt_load(c, j->path, items, k), "load", r);
        if ((bad = cc_wrong(items, k)) != 0)
            note(w, "tp %d pp %d N %d rank %d: %zu elements differ", j->tp, j->pp, w->n, r, bad);
    }
    cc_free(bufs, k);
}

static int file_has(const char *path, const char *what)
{
    char buf[65536];
    size_t n, i, l = strlen(what);
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    for (i = 0; i + l <= n; i++)
        if (!memcmp(buf + i, what, l)) return 1;
    return 0;
}

static void test_reshard_any_layout(void)
{
    static const int saves[2][2] = {{2, 1}, {2, 2}}; /* (tp, pp) on 4 ranks: dp 2, and a pipeline of 2 stages */
    int s, n, tp, pp;
    for (s = 0; s < 2; s++) {
        cc_job j;
        char dir[] = "/tmp/dpar_ckpt_XXXXXX", shard[300];
        memset(&j, 0, sizeof j);
        tmpdir_path(dir, j.path, sizeof j.path, "mesh");
        j.tp = saves[s][0], j.pp = saves[s][1], j.save = 1;
        CHECK(run_world(4, cc_rank, &j) == 0);
        if (s == 0) { /* dp 2: ranks 2 and 3 hold replicas of ranks 0 and 1's blocks: written once, by 0 and 1 */
            snprintf(shard, sizeof shard, "%s.g1.r2", j.path);
            CHECK(file_has(shard, "w0") == 0 && file_has(shard, "z") == 1);
            snprintf(shard, sizeof shard, "%s.g1.r1", j.path);
            CHECK(file_has(shard, "w0") == 1 && file_has(shard, "step") == 0);
            snprintf(shard, sizeof shard, "%s.g1.r0", j.path);
            CHECK(file_has(shard, "step") == 1);
        }
        j.save = 0;
        for (n = 1; n <= 4; n++)
            for (tp = 1; tp <= 3; tp++)
                for (pp = 1; pp <= 2; pp++) {
                    if (n % (tp * pp)) continue;
                    j.tp = tp, j.pp = pp;
                    CHECK_MSG(run_world(n, cc_rank, &j) == 0, "saved tp %d pp %d on 4, loaded tp %d pp %d on %d",
                              saves[s][0], saves[s][1], tp, pp, n);
                }
        rmdir_all(dir);
    }
}

/* ---- what cannot load says why ---- */
static void plain_rank(world *w, dpar_comm *c, int r)
{
    cc_job *j = (cc_job *)w->user;
    int64_t mine = r;
    dpar_ckpt_item it = dpar_ckpt_own("rng", &mine, sizeof mine);
    expect_ok(w, dpar_ckpt_save(c, j->path, &it, 1), "save", r);
}

typedef struct {
    char path[256];
    int kind; /* 0: overlap, 1: a hole, 2: two shapes */
} bad_job;
static void bad_plan_rank(world *w, dpar_comm *c, int r)
{
    bad_job *j = (bad_job *)w->user;
    float buf[64];
    dpar_ckpt_item it;
    dpar_status st;
    memset(buf, 0, sizeof buf);
    if (j->kind == 0) it = dpar_ckpt_block("w", buf, 4, 8, 4, r == 0 ? 0 : 3, 5, 0, 4);      /* rows 0..4 and 3..7 */
    else if (j->kind == 1) it = dpar_ckpt_block("w", buf, 4, 8, 4, r == 0 ? 0 : 5, 3, 0, 4); /* rows 3, 4 */
    else it = dpar_ckpt_block("w", buf, 4, 8, 4 + r, 4 * r, 4, 0, 4);
    st = dpar_ckpt_save(c, j->path, &it, 1);
    if (st != DPAR_EINVAL || !strstr(dpar_last_error(), "tensor 'w'") ||
        !strstr(dpar_last_error(), j->kind == 0   ? "overlap"
                                   : j->kind == 1 ? "a hole"
                                                  : "shape mismatch"))
        note(w, "rank %d, kind %d: %s: %s", r, j->kind, dpar_status_string(st), dpar_last_error());
}

static void test_reshard_refusals(void)
{
    cc_job j;
    char dir[] = "/tmp/dpar_ckpt_XXXXXX", shard[300];
    dpar_ckpt_item items[CC_T], it;
    void *bufs[CC_T];
    float w0[8 * 10], small[4];
    int k, kind;
    memset(&j, 0, sizeof j);
    tmpdir_path(dir, j.path, sizeof j.path, "mesh");
    j.tp = 2, j.pp = 1, j.save = 1;
    CHECK(run_world(4, cc_rank, &j) == 0);
    /* a tensor that is not there */
    it = dpar_ckpt_flat("w9", small, 4, 4, 0, 4);
    CHECK(dpar_ckpt_load(NULL, j.path, &it, 1) == DPAR_ECORRUPT && strstr(dpar_last_error(), "'w9'") &&
          strstr(dpar_last_error(), "missing tensor"));
    /* another shape */
    it = dpar_ckpt_block("w0", w0, 4, 8, 10, 0, 8, 0, 10);
    CHECK(dpar_ckpt_load(NULL, j.path, &it, 1) == DPAR_ECORRUPT && strstr(dpar_last_error(), "'w0'") &&
          strstr(dpar_last_error(), "8 x 12 elements of 4 bytes there") && strstr(dpar_last_error(), "shape mismatch"));
    it = dpar_ckpt_block("w0", w0, 8, 8, 12, 0, 1, 0, 10); /* elements of another size */
    CHECK(dpar_ckpt_load(NULL, j.path, &it, 1) == DPAR_ECORRUPT && strstr(dpar_last_error(), "shape mismatch"));
    /* a plan outside its tensor, or not of its bytes: refused before anything is read */
    it = dpar_ckpt_block("w0", w0, 4, 8, 12, 6, 4, 0, 12);
    CHECK(dpar_ckpt_load(NULL, j.path, &it, 1) == DPAR_EINVAL && strstr(dpar_last_error(), "item 'w0'"));
    it = dpar_ckpt_block("w0", w0, 4, 8, 12, 0, 1, 0, 12);
    it.bytes = 40;
    CHECK(dpar_ckpt_load(NULL, j.path, &it, 1) == DPAR_EINVAL && strstr(dpar_last_error(), "not its 40 bytes"));
    /* a damaged shard of another rank, read by a reshard: the CRC names it */
    k = cc_items(1, 1, 1, 0, 0, items, bufs);
    snprintf(shard, sizeof shard, "%s.g1.r1", j.path);
    {
        FILE *f = fopen(shard, "r+b");
        CHECK(f != NULL);
        if (f) fseek(f, -3, SEEK_END), fputc(0x5A, f), fclose(f);
    }
    CHECK(dpar_ckpt_load(NULL, j.path, items, k) == DPAR_ECORRUPT && strstr(dpar_last_error(), ".g1.r1' is damaged"));
    cc_free(bufs, k);
    rmdir_all(dir);
    /* an item without a plan loads only into the world size it was saved from */
    {
        char dir2[] = "/tmp/dpar_ckpt_XXXXXX";
        int64_t v = -1;
        tmpdir_path(dir2, j.path, sizeof j.path, "own");
        CHECK(run_world(2, plain_rank, &j) == 0);
        it = dpar_ckpt_own("rng", &v, sizeof v);
        CHECK(dpar_ckpt_load(NULL, j.path, &it, 1) == DPAR_ECORRUPT && strstr(dpar_last_error(), "'rng'") &&
              strstr(dpar_last_error(), "has no shard plan") && v == -1);
        rmdir_all(dir2);
    }
    /* save: blocks that overlap, leave a hole, or disagree on the shape: every rank refuses, naming the tensor */
    for (kind = 0; kind < 3; kind++) {
        bad_job b;
        char dir3[] = "/tmp/dpar_ckpt_XXXXXX";
        tmpdir_path(dir3, b.path, sizeof b.path, "bad");
        b.kind = kind;
        CHECK_MSG(run_world(2, bad_plan_rank, &b) == 0, "kind %d", kind);
        CHECK(access(b.path, F_OK) != 0); /* no manifest */
        rmdir_all(dir3);
    }
}

/* v at p, little-endian (the checkpoint files' byte order) */
static void put_le32(unsigned char *p, uint32_t v)
{
    int i;
    for (i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* a checkpoint of the format before plans (manifest DPARMAN1) still loads in its own layout */
static void test_old_manifest_loads(void)
{
    char dir[] = "/tmp/dpar_ckpt_XXXXXX", path[256];
    unsigned char man[64];
    float p[50], back[50];
    dpar_ckpt_item it = dpar_ckpt_own("params", p, sizeof p);
    size_t n;
    int i;
    FILE *f;
    for (i = 0; i < 50; i++) p[i] = (float)i / 3.0f;
    tmpdir_path(dir, path, sizeof path, "old");
    CHECK(dpar_ckpt_save(NULL, path, &it, 1) == DPAR_OK);
    f = fopen(path, "rb");
    n = fread(man, 1, sizeof man, f);
    fclose(f);
    CHECK(n == 40 && !memcmp(man, "DPARMAN2", 8));
    /* version 1: the same without the tensor count */
    memcpy(man, "DPARMAN1", 8);
    put_le32(man + 32, dpar_crc32(0, man, 32));
    f = fopen(path, "wb");
    fwrite(man, 1, 36, f);
    fclose(f);
    it.data = back;
    memset(back, 0, sizeof back);
    CHECK(dpar_ckpt_load(NULL, path, &it, 1) == DPAR_OK && !memcmp(back, p, sizeof p));
    it = dpar_ckpt_flat("params", back, 4, 50, 0, 50); /* asked with a plan: read from the shard of the same rank */
    memset(back, 0, sizeof back);
    CHECK(dpar_ckpt_load(NULL, path, &it, 1) == DPAR_OK && !memcmp(back, p, sizeof p));
    it = dpar_ckpt_own("params", p, sizeof p); /* and a new save after it: generation 2 */
    CHECK(dpar_ckpt_save(NULL, path, &it, 1) == DPAR_OK);
    snprintf(dir + strlen(dir), 1, "%s", "");
    {
        char g2[300];
        snprintf(g2, sizeof g2, "%s.g2.r0", path);
        CHECK(access(g2, F_OK) == 0);
    }
    rmdir_all(dir);
}

/* a shard whose item table is malformed, with CRCs that match (as a writer with a bug would leave it): the
   load says the table is damaged, not that the item is missing */
static int rewrite_crcs(const char *path, const char *shard, unsigned char *sh, size_t shn)
{
    unsigned char man[64];
    size_t n;
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    n = fread(man, 1, sizeof man, f);
    fclose(f);
    if (n != 40) return 0;                      /* one shard, no planned tensor */
    put_le32(man + 28, dpar_crc32(0, sh, shn)); /* the shard's CRC */
    put_le32(man + 36, dpar_crc32(0, man, 36)); /* the manifest's own */
    if (!(f = fopen(path, "wb")) || fwrite(man, 1, 40, f) != 40 || fclose(f)) return 0;
    if (!(f = fopen(shard, "wb")) || fwrite(sh, 1, shn, f) != shn || fclose(f)) return 0;
    return 1;
}

static void test_damaged_item_table(void)
{
    char dir[] = "/tmp/dpar_ckpt_XXXXXX", path[256], shard[300];
    unsigned char sh[256], keep[256];
    float a[3] = {1, 2, 3}, w[5] = {4, 5, 6, 7, 8}, back[5];
    dpar_ckpt_item it[2];
    size_t shn;
    int kind;
    FILE *f;
    it[0] = dpar_ckpt_own("a", a, sizeof a);
    it[1] = dpar_ckpt_own("w", w, sizeof w);
    tmpdir_path(dir, path, sizeof path, "table");
    CHECK(dpar_ckpt_save(NULL, path, it, 2) == DPAR_OK);
    snprintf(shard, sizeof shard, "%s.g1.r0", path);
    f = fopen(shard, "rb");
    CHECK(f != NULL);
    if (!f) return;
    shn = fread(keep, 1, sizeof keep, f);
    fclose(f);
    /* header 32 bytes; then per item: name length (4), name, bytes (8), CRC (4); then the data */
    CHECK(shn == 32 + 2 * (16 + 1) + sizeof a + sizeof w && keep[32] == 1 && keep[36] == 'a');
    it[1].data = back;
    for (kind = 0; kind < 3; kind++) {
        memcpy(sh, keep, shn);
        if (kind == 0) sh[32] = 64;            /* item 'a's name is 64 bytes long: over 63 */
        else if (kind == 1) sh[37 + 7] = 0x7f; /* item 'a' has more bytes than the file */
        else memcpy(sh + 32 + 17 + 4, "v", 1); /* the second item is 'v': intact, no 'w' (control) */
        CHECK(rewrite_crcs(path, shard, sh, shn));
        memset(back, 0, sizeof back);
        if (kind < 2)
            CHECK_MSG(dpar_ckpt_load(NULL, path, &it[1], 1) == DPAR_ECORRUPT &&
                          strstr(dpar_last_error(), "item table is malformed") &&
                          strstr(dpar_last_error(), "item 'w'") && !strstr(dpar_last_error(), "missing"),
                      "kind %d: %s", kind, dpar_last_error());
        else
            CHECK_MSG(dpar_ckpt_load(NULL, path, &it[1], 1) == DPAR_ECORRUPT &&
                          strstr(dpar_last_error(), "has no item 'w'") && strstr(dpar_last_error(), "missing tensor"),
                      "kind %d: %s", kind, dpar_last_error());
        CHECK(back[0] == 0); /* nothing loaded */
    }
    CHECK(rewrite_crcs(path, shard, keep, shn)); /* as saved: loads */
    CHECK(dpar_ckpt_load(NULL, path, &it[1], 1) == DPAR_OK && !memcmp(back, w, sizeof w));
    rmdir_all(dir);
}

/* ---- the sampler across a 4 -> 3 restart ---- */
typedef struct {
    char path[256];
    size_t n, batch, steps;
    int drop;
    size_t *seen;     /* [n]: how often each sample was taken */
    size_t *taken[4]; /* per rank, in order */
    size_t ntaken[4];
    uint64_t epoch;
} samp_job;

static void samp_rank(world *w, dpar_comm *c, int r)
{
    samp_job *j = (samp_job *)w->user;
    dpar_sampler s;
    dpar_sampler_desc d;
    const size_t *ix;
    uint64_t pos[2] = {0, 0}; /* epoch, samples of it consumed by all ranks */
    dpar_ckpt_item it = dpar_ckpt_replica("sampler", pos, sizeof pos);
    size_t count, k, steps;
    memset(&d, 0, sizeof d);
    d.n = j->n, d.ranks = w->n, d.rank = r, d.seed = 7, d.drop_last = j->drop;
    expect_ok(w, dpar_sampler_init(&s, &d), "sampler_init", r);
    if (w->n == 4) { /* the first run: some steps of the epoch, then a checkpoint */
        count = dpar_sampler_epoch(&s, j->epoch, &ix);
        steps = j->steps;
        pos[0] = j->epoch;
        pos[1] = dpar_sampler_consumed(&s, steps * j->batch);
    } else { /* the resumed run: the rest of the epoch */
        expect_ok(w, dpar_ckpt_load(c, j->path, &it, 1), "load", r);
        count = dpar_sampler_resume(&s, pos[0], (size_t)pos[1], &ix);
        steps = (count + j->batch - 1) / j->batch;
    }
    for (k = 0; k < steps * j->batch && k < count; k++) j->taken[r][j->ntaken[r]++] = ix[k];
    if (w->n == 4) expect_ok(w, dpar_ckpt_save(c, j->path, &it, 1), "save", r);
    dpar_sampler_destroy(&s);
}

static void test_sampler_resume_4_to_3(void)
{
    int drop, r;
    for (drop = 0; drop < 2; drop++) {
        samp_job j;
        char dir[] = "/tmp/dpar_ckpt_XXXXXX";
        dpar_sampler one;
        dpar_sampler_desc d;
        const size_t *perm;
        size_t k, consumed, rest, per3, total = 0, i;
        memset(&j, 0, sizeof j);
        tmpdir_path(dir, j.path, sizeof j.path, "samp");
        j.n = 103, j.batch = 5, j.steps = 3, j.drop = drop, j.epoch = 2;
        for (r = 0; r < 4; r++) j.taken[r] = (size_t *)calloc(2 * j.n, sizeof(size_t));
        CHECK(run_world(4, samp_rank, &j) == 0);
        consumed = 4 * j.steps * j.batch; /* 60 */
        /* the independent reference: the epoch's permutation from a sampler of one rank */
        memset(&d, 0, sizeof d);
        d.n = j.n, d.seed = 7;
        CHECK(dpar_sampler_init(&one, &d) == DPAR_OK);
        CHECK(dpar_sampler_epoch(&one, j.epoch, &perm) == j.n);
        for (r = 0; r < 4; r++) {
            CHECK(j.ntaken[r] == j.steps * j.batch);
            for (k = 0; k < j.ntaken[r]; k++) CHECK(j.taken[r][k] == perm[r + 4 * k]);
            j.ntaken[r] = 0;
        }
        CHECK(run_world(3, samp_rank, &j) == 0);
        rest = j.n - consumed; /* 43 */
        per3 = drop ? rest / 3 : (rest + 2) / 3;
        j.seen = (size_t *)calloc(j.n, sizeof(size_t));
        for (k = 0; k < consumed; k++) j.seen[perm[k]]++; /* the first run took positions 0..59 */
        for (r = 0; r < 3; r++) {
            CHECK(j.ntaken[r] == per3);
            for (k = 0; k < j.ntaken[r]; k++) {
                CHECK(j.taken[r][k] == perm[(consumed + (size_t)r + 3 * k) % j.n]); /* position 60 + r + 3 k */
                j.seen[j.taken[r][k]]++;
            }
            total += j.ntaken[r];
        }
        /* no sample repeated or skipped, but for the padding (or drop_last's rest) at the epoch's end */
        for (i = 0, k = 0; i < j.n; i++) k += j.seen[i] == 0;
        CHECK(k == (drop ? rest % 3 : 0));
        for (i = 0, k = 0; i < j.n; i++) k += j.seen[i] > 1 ? j.seen[i] - 1 : 0;
        CHECK(k == (drop ? 0 : 3 * per3 - rest));
        CHECK(total == 3 * per3);
        CHECK(dpar_sampler_resume(&one, j.epoch, j.n + 5, &perm) == 0); /* past the end: nothing left */
        CHECK(dpar_sampler_consumed(&one, 0) == j.n);
        dpar_sampler_destroy(&one);
        for (r = 0; r < 4; r++) free(j.taken[r]);
        free(j.seen);
        rmdir_all(dir);
    }
}

/* ---- FSDP and ZeRO-1: saved on 4 ranks, resumed on 1, 2, 3, the next step bitwise a serial reference ---- */
typedef struct {
    char path[256];
    int stage, save;
    float *p[FC_U], *m[FC_U], *v[FC_U]; /* after the save: the serial state (read back whole) */
    long t;
} fs_job;

static void fsdp_ckpt_rank(world *w, dpar_comm *c, int r)
{
    fs_job *j = (fs_job *)w->user;
    dpar_fsdp *f = NULL;
    dpar_fsdp_desc d;
    float *pp, *gg, s[FC_U];
    int u, step;
    int64_t mark = 0;
    dpar_ckpt_item extra = dpar_ckpt_replica("mark", &mark, sizeof mark);
    memset(&d, 0, sizeof d);
    d.comm = c, d.stage = j->stage, d.num_units = FC_U, d.unit_counts = fc_counts, d.kind = DPAR_OPTIM_ADAM;
    d.lr = 0.05f, d.weight_decay = 0.01f;
    expect_ok(w, dpar_fsdp_create(&d, &f), "fsdp_create", r);
    if (!f) return;
    if (j->save) {
        for (u = 0; u < FC_U; u++) {
            float *full = (float *)malloc(fc_counts[u] * 4);
            size_t i;
            for (i = 0; i < fc_counts[u]; i++) full[i] = fc_init(u, i);
            expect_ok(w, dpar_fsdp_set_params(f, u, full), "set_params", r);
            free(full);
        }
        for (step = 0; step < 2; step++) fc_fsdp_train_step(w, f, r, step); /* two steps on 4 ranks, then the save */
        expect_ok(w, dpar_fsdp_gather(f, 0, &pp), "gather", r);             /* a prefetch in flight at the save */
        expect_ok(w, dpar_fsdp_release(f, 0), "release", r);
        mark = 42;
        expect_ok(w, dpar_ckpt_save_fsdp(f, j->path, NULL, &extra, 1), "save_fsdp", r);
    } else {
        expect_ok(w, dpar_ckpt_load_fsdp(f, j->path, NULL, &extra, 1), "load_fsdp", r);
        if (mark != 42) note(w, "rank %d: the extra item came back as %lld", r, (long long)mark);
        for (u = 0; u < FC_U; u++) { /* the parameters: bitwise those saved */
            float *got = (float *)malloc(fc_counts[u] * 4);
            expect_ok(w, dpar_fsdp_get_params(f, u, got), "get_params", r);
            if (memcmp(got, j->p[u], fc_counts[u] * 4))
                note(w, "N=%d rank %d: unit %d's parameters differ", w->n, r, u);
            free(got);
        }
        /* one more step here, against the reference: plain data parallelism from the saved state */
        {
            fsdp_case k;
            float *p[FC_U], *g[FC_U], *m[FC_U], *v[FC_U];
            memset(&k, 0, sizeof k);
            k.kind = DPAR_OPTIM_ADAM;
            for (u = 0; u < FC_U; u++) {
                size_t n = fc_counts[u] * 4;
                p[u] = (float *)malloc(n), g[u] = (float *)malloc(n), m[u] = (float *)malloc(n);
                v[u] = (float *)malloc(n);
                memcpy(p[u], j->p[u], n), memcpy(m[u], j->m[u], n), memcpy(v[u], j->v[u], n);
                s[u] = fc_forward(p[u], r, 2, u);
            }
            for (u = FC_U - 1; u >= 0; u--) {
                fc_backward(g[u], p[u], s[u], r, 2, u);
                expect_ok(w, dpar_allreduce(c, g[u], g[u], fc_counts[u], DPAR_F32, DPAR_AVG), "allreduce", r);
            }
            for (u = 0; u < FC_U; u++) fc_ref_step(p[u], g[u], m[u], v[u], fc_counts[u], &k, j->t + 1);
            for (u = 0; u < FC_U; u++) {
                expect_ok(w, dpar_fsdp_gather(f, u, &pp), "gather", r);
                s[u] = fc_forward(pp, r, 2, u);
                expect_ok(w, dpar_fsdp_release(f, u), "release", r);
            }
            for (u = FC_U - 1; u >= 0; u--) {
                expect_ok(w, dpar_fsdp_gather(f, u, &pp), "gather", r);
                expect_ok(w, dpar_fsdp_grads(f, u, &gg), "grads", r);
                fc_backward(gg, pp, s[u], r, 2, u);
                expect_ok(w, dpar_fsdp_reduce(f, u), "reduce", r);
                expect_ok(w, dpar_fsdp_release(f, u), "release", r);
            }
            expect_ok(w, dpar_fsdp_step(f), "step", r);
            for (u = 0; u < FC_U; u++) {
                float *got = (float *)malloc(fc_counts[u] * 4);
                expect_ok(w, dpar_fsdp_get_params(f, u, got), "get_params", r);
                if (memcmp(got, p[u], fc_counts[u] * 4))
                    note(w, "stage %d N=%d rank %d: unit %d after the resumed step differs from the reference",
                         j->stage, w->n, r, u);
                free(got);
                free(p[u]), free(g[u]), free(m[u]), free(v[u]);
            }
        }
    }
    expect_ok(w, dpar_fsdp_destroy(f), "destroy", r);
}

/* an fsdp of other units cannot take the checkpoint: the tensor and the reason, on every rank, nothing hangs */
static void fsdp_other_units_rank(world *w, dpar_comm *c, int r)
{
    fs_job *j = (fs_job *)w->user;
    static const size_t other[FC_U] = {1000, 8, 4099, 1};
    dpar_fsdp *f = NULL;
    dpar_fsdp_desc d;
    dpar_status st;
    memset(&d, 0, sizeof d);
    d.comm = c, d.stage = 3, d.num_units = FC_U, d.unit_counts = other, d.kind = DPAR_OPTIM_ADAM, d.lr = 0.05f;
    expect_ok(w, dpar_fsdp_create(&d, &f), "fsdp_create", r);
    st = dpar_ckpt_load_fsdp(f, j->path, NULL, NULL, 0);
    if (st != DPAR_ECORRUPT || !strstr(dpar_last_error(), "tensor 'fsdp.u1.param'") ||
        !strstr(dpar_last_error(), "shape mismatch"))
        note(w, "rank %d: %s: %s", r, dpar_status_string(st), dpar_last_error());
    dpar_fsdp_destroy(f);
}

static void test_fsdp_resumes_on_other_rank_counts(void)
{
    int stage, n, u;
    for (stage = 2; stage <= 3; stage++) {
        fs_job j;
        char dir[] = "/tmp/dpar_ckpt_XXXXXX";
        int64_t state[4];
        memset(&j, 0, sizeof j);
        tmpdir_path(dir, j.path, sizeof j.path, "fsdp");
        j.stage = stage, j.save = 1;
        CHECK(run_world(4, fsdp_ckpt_rank, &j) == 0);
        /* the serial state, read whole out of the 4 ranks' shards by one reader */
        for (u = 0; u < FC_U; u++) {
            dpar_ckpt_item it[3];
            char n0[64], n1[64], n2[64];
            j.p[u] = (float *)malloc(fc_counts[u] * 4), j.m[u] = (float *)malloc(fc_counts[u] * 4);
            j.v[u] = (float *)malloc(fc_counts[u] * 4);
            snprintf(n0, sizeof n0, "fsdp.u%d.param", u);
            snprintf(n1, sizeof n1, "fsdp.u%d.m", u);
            snprintf(n2, sizeof n2, "fsdp.u%d.v", u);
            it[0] = dpar_ckpt_flat(n0, j.p[u], 4, fc_counts[u], 0, fc_counts[u]);
            it[1] = dpar_ckpt_flat(n1, j.m[u], 4, fc_counts[u], 0, fc_counts[u]);
            it[2] = dpar_ckpt_flat(n2, j.v[u], 4, fc_counts[u], 0, fc_counts[u]);
            CHECK(dpar_ckpt_load(NULL, j.path, it, 3) == DPAR_OK);
        }
        {
            dpar_ckpt_item st = dpar_ckpt_replica("fsdp.state", state, sizeof state);
            CHECK(dpar_ckpt_load(NULL, j.path, &st, 1) == DPAR_OK && state[0] == 2);
            j.t = (long)state[0];
        }
        j.save = 0;
        for (n = 1; n <= 3; n++) CHECK_MSG(run_world(n, fsdp_ckpt_rank, &j) == 0, "stage %d N=%d", stage, n);
        CHECK(run_world(2, fsdp_other_units_rank, &j) == 0);
        for (u = 0; u < FC_U; u++) free(j.p[u]), free(j.m[u]), free(j.v[u]);
        rmdir_all(dir);
    }
}

typedef struct {
    char path[256];
    int save;
    float *p, *m, *v; /* the serial state after the save */
} zo_job;
#define ZO_N 1001
static float zo_grad(int r, int step, size_t i) { return (float)((int)((r * 13 + step * 5 + i * 7) % 29) - 14) / 8.0f; }

static void zero_ckpt_rank(world *w, dpar_comm *c, int r)
{
    zo_job *j = (zo_job *)w->user;
    dpar_zero *z = NULL;
    dpar_zero_desc d;
    float *p = (float *)malloc(ZO_N * 4), *g = (float *)malloc(ZO_N * 4);
    size_t i;
    int step;
    memset(&d, 0, sizeof d);
    d.comm = c, d.count = ZO_N, d.kind = DPAR_OPTIM_ADAM, d.lr = 0.01f, d.weight_decay = 0.1f;
    expect_ok(w, dpar_zero_create(&d, &z), "zero_create", r);
    for (i = 0; i < ZO_N; i++) p[i] = (float)(i % 17) / 17.0f;
    if (j->save) {
        for (step = 0; step < 3; step++) {
            for (i = 0; i < ZO_N; i++) g[i] = zo_grad(r, step, i);
            expect_ok(w, dpar_zero_step(z, p, g), "zero_step", r);
        }
        expect_ok(w, dpar_ckpt_save_zero(z, p, j->path, NULL, NULL, 0), "save_zero", r);
    } else {
        float *q = (float *)malloc(ZO_N * 4), *m = (float *)malloc(ZO_N * 4), *v = (float *)malloc(ZO_N * 4);
        memset(p, 0, ZO_N * 4);
        expect_ok(w, dpar_ckpt_load_zero(z, p, j->path, NULL, NULL, 0), "load_zero", r);
        if (memcmp(p, j->p, ZO_N * 4)) note(w, "N=%d rank %d: the parameters differ", w->n, r);
        /* the reference step: the average gradient, AdamW at t = 4 from the saved moments */
        memcpy(q, j->p, ZO_N * 4), memcpy(m, j->m, ZO_N * 4), memcpy(v, j->v, ZO_N * 4);
        for (i = 0; i < ZO_N; i++) g[i] = zo_grad(r, 3, i);
        expect_ok(w, dpar_allreduce(c, g, g, ZO_N, DPAR_F32, DPAR_AVG), "allreduce", r);
        {
            float c1 = 1.0f - powf(0.9f, 4.0f), c2 = 1.0f - powf(0.999f, 4.0f);
            for (i = 0; i < ZO_N; i++) {
                m[i] = 0.9f * m[i] + (1.0f - 0.9f) * g[i];
                v[i] = 0.999f * v[i] + (1.0f - 0.999f) * g[i] * g[i];
                q[i] -= 0.01f * ((m[i] / c1) / (sqrtf(v[i] / c2) + 1e-8f) + 0.1f * q[i]);
            }
        }
        for (i = 0; i < ZO_N; i++) g[i] = zo_grad(r, 3, i);
        expect_ok(w, dpar_zero_step(z, p, g), "zero_step", r);
        if (memcmp(p, q, ZO_N * 4)) note(w, "N=%d rank %d: the resumed step differs from the reference", w->n, r);
        free(q), free(m), free(v);
    }
    dpar_zero_destroy(z);
    free(p), free(g);
}

static void test_zero_resumes_on_other_rank_counts(void)
{
    zo_job j;
    char dir[] = "/tmp/dpar_ckpt_XXXXXX";
    dpar_ckpt_item it[3];
    int n;
    memset(&j, 0, sizeof j);
    tmpdir_path(dir, j.path, sizeof j.path, "zero");
    j.save = 1;
    CHECK(run_world(4, zero_ckpt_rank, &j) == 0);
    j.p = (float *)malloc(ZO_N * 4), j.m = (float *)malloc(ZO_N * 4), j.v = (float *)malloc(ZO_N * 4);
    it[0] = dpar_ckpt_flat("zero.params", j.p, 4, ZO_N, 0, ZO_N);
    it[1] = dpar_ckpt_flat("zero.m", j.m, 4, ZO_N, 0, ZO_N);
    it[2] = dpar_ckpt_flat("zero.v", j.v, 4, ZO_N, 0, ZO_N);
    CHECK(dpar_ckpt_load(NULL, j.path, it, 3) == DPAR_OK);
    j.save = 0;
    for (n = 1; n <= 3; n++) CHECK_MSG(run_world(n, zero_ckpt_rank, &j) == 0, "N=%d", n);
    free(j.p), free(j.m), free(j.v);
    rmdir_all(dir);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(test_reshard_any_layout);
    RUN(test_reshard_refusals);
    RUN(test_old_manifest_loads);
    RUN(test_damaged_item_table);
    RUN(test_sampler_resume_4_to_3);
    RUN(test_fsdp_resumes_on_other_rank_counts);
    RUN(test_zero_resumes_on_other_rank_counts);
    pools_free();
    return dt_summary();
}
