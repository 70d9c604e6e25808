/* fuzz_ckpt.c - libFuzzer target of the checkpoint reader (>>ckpt): dpar_ckpt_load of one rank on a directory
   written from the input.
   Input:    byte 0: flags (1: give the manifest its right CRC, 2: make the manifest's shard size and CRC the
             shard's, so the fuzzer reaches the shard's header and items); byte 1: how many of the four items
             the program asks for; bytes 2-3: the manifest's length L (little-endian); then L bytes of manifest,
             the rest the shard, written as path.g<the manifest's generation>.r0.
   Property: never a crash; an error is DPAR_EIO or DPAR_ECORRUPT with a message, and leaves the items as they
             were; DPAR_OK only when an independent reading of the files (manifest CRC and size, shard size and
             CRC, item names, sizes and CRCs) says they are whole and hold the asked items (by name: a shard may hold
             more; a table with a name longer than 63 bytes, which no writer makes, is not whole), and then every
             item holds its bytes. Asked for no item, dpar_ckpt_load reads no shard (it reads only the shards
             holding what is asked): DPAR_OK then needs only a manifest whose magic and CRC hold (make fuzz found
             the stricter property wrong). */
#define DPAR_IMPLEMENTATION
#include "dpar.h"
#include "fuzz_common.h"

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }
static void put32(uint8_t *p, uint32_t v)
{
    int i;
    for (i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    put32(p, (uint32_t)v);
    put32(p + 4, (uint32_t)(v >> 32));
}

/* the independent reading: 1 when the files are a whole checkpoint holding these items (the shard may hold more: a
   load asks for a subset by name, and the loader checks only those: their CRCs and that they lie inside the shard,
   beside the whole shard's CRC); at[i] is where item i's bytes lie in the shard */
static int whole_at(const uint8_t *m, size_t mn, const uint8_t *s, size_t sn, const dpar_ckpt_item *items, int count,
                    size_t *at)
{
    size_t pos = 32, data, tab[64][5]; /* per shard entry: name offset, name length, bytes, CRC offset, CRC right */
    uint32_t k, nk;
    int i;
    if (mn != 20 + 12 + 4 || memcmp(m, "DPARMAN1", 8) || le32(m + 8) != 1) return 0;
    if (dpar_crc32(0, m, mn - 4) != le32(m + mn - 4)) return 0;
    if (le64(m + 20) != sn || le32(m + 28) != dpar_crc32(0, s, sn)) return 0;
    if (sn < 32 || memcmp(s, "DPARCKP1", 8) || le32(s + 12) != 0 || le32(s + 16) != 1) return 0;
    nk = le32(s + 20);
    if (le64(s + 24) != le64(m + 12) || nk > 64) return 0;
    for (k = 0; k < nk; k++) {
        size_t ln;
        if (pos + 16 > sn || (ln = le32(s + pos)) > 63 || ln > sn - pos - 16) return 0; /* names of at most 63 */
        tab[k][0] = pos + 4, tab[k][1] = ln, tab[k][2] = (size_t)le64(s + pos + 4 + ln), tab[k][3] = pos + 12 + ln;
        pos += 16 + ln;
    }
    data = pos;
    for (k = 0; k < nk; k++) {
        uint32_t crc;
        if (tab[k][2] > sn - data) break; /* this one and those after it lie outside: they must not be asked */
        crc = le32(s + tab[k][3]);
        tab[k][3] = data; /* now: where its bytes lie; its CRC is checked for the asked items below */
        tab[k][4] = dpar_crc32(0, s + data, tab[k][2]) == crc;
        data += tab[k][2];
    }
    nk = k;
    for (i = 0; i < count; i++) {
        size_t ln = strlen(items[i].name);
        for (k = 0; k < nk && !(tab[k][1] == ln && !memcmp(s + tab[k][0], items[i].name, ln)); k++) continue;
        if (k == nk || tab[k][2] != items[i].bytes || !tab[k][4]) return 0;
        if (at) at[i] = tab[k][3];
    }
    return 1;
}

/* what a load of no item reads: the manifest, its magic (v1 or v2) and its CRC */
static int manifest_sound(const uint8_t *m, size_t mn)
{
    return mn >= 24 && (!memcmp(m, "DPARMAN1", 8) || !memcmp(m, DPAR__MAN_MAGIC, 8)) &&
           dpar_crc32(0, m, mn - 4) == le32(m + mn - 4);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    static const char *names[4] = {"w", "step", "adam.m", "rng"};
    static const size_t sizes[4] = {16, 8, 0, 5};
    uint8_t buf[4][16], *m, *s;
    dpar_ckpt_item items[4];
    char path[512], shard[600];
    size_t mn, sn;
    int flags, count, i;
    dpar_status st;
    if (n < 4) return 0;
    flags = data[0];
    count = data[1] % 5;
    mn = (size_t)data[2] | (size_t)data[3] << 8;
    if (mn > n - 4) mn = n - 4;
    m = (uint8_t *)malloc(mn + 1);
    memcpy(m, data + 4, mn);
    s = (uint8_t *)data + 4 + mn;
    sn = n - 4 - mn;
    if ((flags & 2) && mn >= 32) {
        put64(m + 20, sn);
        put32(m + 28, dpar_crc32(0, s, sn));
    }
    if ((flags & 1) && mn >= 4) put32(m + mn - 4, dpar_crc32(0, m, mn - 4));
    snprintf(path, sizeof path, "%s/ck", fuzz_scratch());
    snprintf(shard, sizeof shard, "%s.g%llu.r0", path, (unsigned long long)(mn >= 20 ? le64(m + 12) : 0));
    fuzz_write(path, m, mn);
    fuzz_write(shard, s, sn);
    memset(items, 0, sizeof items); /* whole items: no shard plan (a found crash: the plan was stack garbage) */
    for (i = 0; i < 4; i++) {
        memset(buf[i], 0xA5, sizeof buf[i]);
        items[i].name = names[i];
        items[i].data = buf[i];
        items[i].bytes = sizes[i];
    }
    st = dpar_ckpt_load(NULL, path, items, count);
    if (getenv("FUZZ_VERBOSE")) fprintf(stderr, "load: %s\n", st == DPAR_OK ? "ok" : dpar_last_error());
    if (st == DPAR_OK) {
        size_t at[4];
        FUZZ_ASSERT(count ? whole_at(m, mn, s, sn, items, count, at) : manifest_sound(m, mn),
                    "accepted a damaged checkpoint");
        for (i = 0; i < count; i++) FUZZ_ASSERT(!memcmp(buf[i], s + at[i], sizes[i]), "item %s", names[i]);
    } else {
        FUZZ_ASSERT(st == DPAR_EIO || st == DPAR_ECORRUPT, "status %d: %s", st, dpar_last_error());
        FUZZ_ASSERT(dpar_last_error()[0], "no message");
        FUZZ_ASSERT(!whole_at(m, mn, s, sn, items, count, NULL), "refused a whole checkpoint: %s", dpar_last_error());
        for (i = 0; i < 4; i++) {
            size_t k;
            for (k = 0; k < sizeof buf[i]; k++) FUZZ_ASSERT(buf[i][k] == 0xA5, "a refused load wrote item %d", i);
        }
    }
    remove(shard);
    remove(path);
    free(m);
    return 0;
}
