/* test_fuzz.c - the findings of the libFuzzer targets (tests/fuzz/, make fuzz), each kept as a test with the
   input that found it. */
#define DPAR_IMPLEMENTATION
#include "dpar.h"
#include "dpar_test.h"

/* fuzz_pipe, input 01 00 02 01 f7 01 00 01 00 00: a 1F1B schedule of 2 stages, 1 micro-batch, whose stage 0 has
   one op of code -2. dpar_pipe_schedule_format simulated it without checking it and indexed the op names with
   -2 (UBSan: index -2 out of bounds); duplicated sends overran the simulation's queues. Now it prints the
   header and the checker's reason. */
static void pipe_format_of_a_refused_schedule(void)
{
    dpar_pipe_op s0[1] = {{-2, 1, 0}}, s1[1] = {{DPAR_PIPE_FORWARD, 0, 0}}, *ops[2];
    dpar_pipe_op d0[12], d1[2] = {{DPAR_PIPE_RECV_ACT, 0, 0}, {DPAR_PIPE_FORWARD, 0, 0}};
    int num[2] = {1, 1}, peak[2] = {0, 0}, k;
    dpar_pipe_schedule S;
    char text[512];
    size_t n;
    memset(&S, 0, sizeof S);
    S.p = 2, S.m = 1, S.v = 1, S.kind = DPAR_PIPE_1F1B;
    ops[0] = s0, ops[1] = s1;
    S.num_ops = num, S.ops = ops, S.peak_stash = peak;
    CHECK(dpar_pipe_schedule_check(&S) == DPAR_EINVAL);
    CHECK(strstr(dpar_last_error(), "code -2 is not an op") != NULL);
    n = dpar_pipe_schedule_format(&S, text, sizeof text);
    CHECK(n < sizeof text && strlen(text) == n);
    CHECK_MSG(strstr(text, "1F1B, p=2 stages, m=1") && strstr(text, "cannot lay it out") &&
                  strstr(text, "code -2 is not an op"),
              "%s", text);
    /* in range, but stage 0 sends micro-batch 0's activation 11 times: the queues of the simulation hold
       2 m v + 1 messages per channel */
    d0[0].code = DPAR_PIPE_FORWARD, d0[0].micro = 0, d0[0].chunk = 0;
    for (k = 1; k < 12; k++) d0[k].code = DPAR_PIPE_SEND_ACT, d0[k].micro = 0, d0[k].chunk = 0;
    ops[0] = d0, ops[1] = d1, num[0] = 12, num[1] = 2;
    S.kind = DPAR_PIPE_GPIPE;
    CHECK(dpar_pipe_schedule_check(&S) == DPAR_EINVAL);
    n = dpar_pipe_schedule_format(&S, text, sizeof text);
    CHECK_MSG(strstr(text, "cannot lay it out") && strstr(text, "twice"), "%s", text);
    /* a good schedule still lays out */
    {
        dpar_pipe_schedule *G;
        dpar_pipe_schedule_desc gd;
        memset(&gd, 0, sizeof gd);
        gd.kind = DPAR_PIPE_1F1B, gd.p = 2, gd.m = 2;
        CHECK(dpar_pipe_schedule_create(&gd, &G) == DPAR_OK);
        n = dpar_pipe_schedule_format(G, text, sizeof text);
        CHECK_MSG(strstr(text, "stage 0 |") && strstr(text, "stage 1 |") && !strstr(text, "cannot"), "%s", text);
        dpar_pipe_schedule_destroy(G);
    }
}

/* fuzz_env, input 01 "33331333334777777777777777373": DPAR_TIMEOUT_MS beyond what the timeout can hold. strtol
   gave LONG_MAX and the nanoseconds wrapped (18446744073708551616 ns, about 584 years short of the maximum);
   values of 2^64 / 10^6 ms and up now count as not a number of milliseconds: group creation fails with DPAR_EINVAL
   naming the variable and quoting the value (it was a warning and the default until issue 19). */
#define NOT_MS UINT64_MAX /* timeout_with_env: creation refused the value, as it must */
static uint64_t timeout_with_env(const char *value)
{
    dpar_comm_desc d;
    dpar_group *g = NULL;
    dpar_comm *c = NULL;
    uint64_t ns = 1;
    dpar_status st;
    char want[128];
    memset(&d, 0, sizeof d);
    d.size = 1;
    setenv("DPAR_TIMEOUT_MS", value, 1);
    snprintf(want, sizeof want, "dpar_group_create: DPAR_TIMEOUT_MS=\"%s\" is not a number of milliseconds", value);
    st = dpar_group_create(&d, &g);
    if (st == DPAR_EINVAL && !strncmp(dpar_last_error(), want, strlen(want))) ns = NOT_MS;
    else if (st == DPAR_OK && dpar_group_join(g, 0, &c) == DPAR_OK) ns = c->timeout_ns;
    dpar_comm_destroy(c);
    dpar_group_destroy(g);
    unsetenv("DPAR_TIMEOUT_MS");
    return ns;
}
static void env_timeout_too_large(void)
{
    CHECK(timeout_with_env("33331333334777777777777777373") == NOT_MS);   /* the fuzzer's input */
    CHECK(timeout_with_env("18446744073710") == NOT_MS);                  /* 2^64 / 10^6 + 1: wraps */
    CHECK(timeout_with_env("18446744073709") == 18446744073709000000ull); /* the largest that fits */
    CHECK(timeout_with_env("86400000") == 86400000ull * 1000000u);        /* a day */
    CHECK(timeout_with_env("-1") == 0 && timeout_with_env("0") == 0);     /* none */
    CHECK(timeout_with_env("12ms") == NOT_MS && timeout_with_env("-2") == NOT_MS && timeout_with_env(" ") == NOT_MS);
    CHECK(timeout_with_env("") == (uint64_t)DPAR_TIMEOUT_MS_DEFAULT * 1000000u); /* empty: the default */
}

/* fuzz_ckpt, tests/fuzz/corpus_ckpt/regress-entry-past-end: a shard whose item table's last entry has its name
   running past the end of the file (shard and manifest CRCs right). dpar__ckpt_find checked only the entry's fixed
   16 bytes, so the item's data began past the end and its CRC was read out of bounds (ASan: heap-buffer-overflow).
   Now the load is refused as damaged. */
static uint32_t g32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void p32(unsigned char *p, uint32_t v)
{
    int i;
    for (i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void ckpt_entry_name_past_end(void)
{
    char path[256], shard[300];
    unsigned char w[16], man[4096], sh[50];
    dpar_ckpt_item it;
    FILE *f;
    size_t mn, k;
    unsigned long long gen;
    memset(w, 7, sizeof w);
    snprintf(path, sizeof path, "/tmp/dpar_test_fuzz_%d.ckpt", (int)getpid());
    it = dpar_ckpt_own("w", w, sizeof w);
    CHECK(dpar_ckpt_save(NULL, path, &it, 1) == DPAR_OK);
    f = fopen(path, "rb");
    CHECK(f != NULL);
    if (!f) return;
    mn = fread(man, 1, sizeof man, f);
    fclose(f);
    gen = (unsigned long long)g32(man + 12) | (unsigned long long)g32(man + 16) << 32;
    /* the shard: the header (one item), then an entry of 16 + 10 bytes (a 10-byte name), of which 18 are there */
    memset(sh, 0, sizeof sh);
    memcpy(sh, "DPARCKP1", 8);
    p32(sh + 8, 1), p32(sh + 16, 1), p32(sh + 20, 1), p32(sh + 24, g32(man + 12)), p32(sh + 28, g32(man + 16));
    p32(sh + 32, 10);
    memcpy(sh + 36, "wwwww", 5);
    snprintf(shard, sizeof shard, "%s.g%llu.r0", path, gen);
    f = fopen(shard, "wb");
    CHECK(f && fwrite(sh, 1, sizeof sh, f) == sizeof sh);
    if (f) fclose(f);
    /* the manifest's entry for shard 0 (size, CRC), then its own CRC */
    p32(man + 20, (uint32_t)sizeof sh), p32(man + 24, 0), p32(man + 28, dpar_crc32(0, sh, sizeof sh));
    p32(man + mn - 4, dpar_crc32(0, man, mn - 4));
    f = fopen(path, "wb");
    CHECK(f && fwrite(man, 1, mn, f) == mn);
    if (f) fclose(f);
    it = dpar_ckpt_own("wwwwwwwwww", w, sizeof w);
    CHECK_MSG(dpar_ckpt_load(NULL, path, &it, 1) == DPAR_ECORRUPT, "%s", dpar_last_error());
    for (k = 0; k < sizeof w; k++) CHECK(w[k] == 7);
    remove(shard);
    remove(path);
}

int main(int argc, char **argv)
{
    DT_MAIN_BEGIN(argc, argv);
    RUN(pipe_format_of_a_refused_schedule);
    RUN(env_timeout_too_large);
    RUN(ckpt_entry_name_past_end);
    return dt_summary();
}
