/* fuzz_idx.c - libFuzzer target of the IDX reader (>>idx): the input is the file. Property: dpar_idx_init
   never crashes, and when it accepts the file, its dimensions, count and every value are what an
   independent reading of the bytes gives (u8 scaled by 0.5, f32 big-endian). */
#define DPAR_IMPLEMENTATION
#include "dpar.h"
#include "fuzz_common.h"

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    char path[512];
    dpar_idx idx;
    dpar_idx_desc d;
    dpar_status st;
    snprintf(path, sizeof path, "%s/in.idx", fuzz_scratch());
    fuzz_write(path, data, n);
    memset(&d, 0, sizeof d);
    d.path = path;
    d.scale = 0.5f;
    st = dpar_idx_init(&idx, &d);
    if (st == DPAR_OK) {
        size_t count = 1, i, es;
        int k;
        FUZZ_ASSERT(n >= 4 && !data[0] && !data[1] && (data[2] == 0x08 || data[2] == 0x0D), "accepted a bad magic");
        FUZZ_ASSERT(idx.ndims == data[3] && idx.ndims >= 1 && idx.ndims <= 8, "ndims %d", idx.ndims);
        for (k = 0; k < idx.ndims; k++) {
            FUZZ_ASSERT(idx.dims[k] == be32(data + 4 + 4 * k), "dim %d", k);
            count *= idx.dims[k];
        }
        es = data[2] == 0x08 ? 1 : 4;
        FUZZ_ASSERT(idx.count == count && n == 4 + 4 * (size_t)idx.ndims + count * es, "count %zu of %zu bytes",
                    idx.count, n);
        for (i = 0; i < count; i++) {
            const uint8_t *q = data + 4 + 4 * idx.ndims + i * es;
            if (es == 1) {
                FUZZ_ASSERT(idx.data[i] == (float)q[0] * 0.5f, "value %zu", i);
            } else {
                uint32_t u = be32(q), w;
                memcpy(&w, &idx.data[i], 4);
                FUZZ_ASSERT(u == w, "value %zu", i);
            }
        }
    } else {
        FUZZ_ASSERT(st == DPAR_ECORRUPT || st == DPAR_EUNSUPPORTED || st == DPAR_ENOMEM, "status %d: %s", st,
                    dpar_last_error());
        FUZZ_ASSERT(dpar_last_error()[0] && idx.data == NULL && idx.count == 0, "no message or not zeroed");
    }
    dpar_idx_destroy(&idx);
    return 0;
}
