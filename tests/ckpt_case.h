/* ckpt_case.h - the resharding checkpoint case, shared by test_ckpt.c (thread ranks) and test_mpi.c (processes): a
   small model laid out over a tp x pp x dp mesh (column- and row-parallel weights, their optimizer state, a tensor of
   8-byte elements, an uneven column split, replicas, a ZeRO flat shard over every rank), each element's value a
   closed formula of its global position, so a rank of any layout can check its blocks bitwise after a load. */
#ifndef DPAR_TEST_CKPT_CASE_H
#define DPAR_TEST_CKPT_CASE_H

typedef struct {
    const char *name;
    int layer;               /* the pipeline layer holding it (stage layer % pp); -1: every rank */
    size_t elem, rows, cols; /* the global tensor */
    int how;                 /* 0: columns over tp, 1: rows over tp, 2: a replica, 3: flat over every rank (ZeRO) */
} cc_tensor;
#define CC_T 10
static const cc_tensor cc_tensors[CC_T] = {{"w0", 0, 4, 8, 12, 0},  {"w0.m", 0, 4, 8, 12, 0}, {"b0", 0, 4, 1, 12, 0},
                                           {"e", 0, 8, 10, 3, 1},   {"w1", 1, 4, 12, 6, 1},   {"w1.m", 1, 4, 12, 6, 1},
                                           {"b1", 1, 4, 1, 6, 2},   {"u", 1, 4, 5, 7, 0},     {"z", -1, 4, 1, 101, 3},
                                           {"step", -1, 8, 1, 1, 2}};

/* element (i, j) of tensor t: exact in a float */
static void cc_value(int t, size_t i, size_t j, unsigned char *out)
{
    if (cc_tensors[t].elem == 8) {
        int64_t v = (int64_t)t * 100000 + (int64_t)i * 1000 + (int64_t)j;
        memcpy(out, &v, 8);
    } else {
        float v = (float)(t * 1000 + (int)i * 20 + (int)j) * 0.5f;
        memcpy(out, &v, 4);
    }
}

/* rank r of n in a tp x pp mesh (dp = n / (tp pp)): its items, data filled with the values (fill) or junk; the
   buffers are malloc'ed into bufs. Returns the count. */
static int cc_items(int tp, int pp, int n, int r, int fill, dpar_ckpt_item *items, void **bufs)
{
    int t, k = 0, tpr = r % tp, ppr = (r / tp) % pp;
    for (t = 0; t < CC_T; t++) {
        const cc_tensor *x = &cc_tensors[t];
        dpar_ckpt_item it;
        size_t i, j;
        if (x->layer >= 0 && x->layer % pp != ppr) continue;
        if (x->how == 0 || x->how == 1) {
            dpar_shard_plan plan;
            dpar_shard_plan_desc pd;
            memset(&pd, 0, sizeof pd);
            pd.rows = x->rows, pd.cols = x->cols, pd.parts = tp;
            pd.axis = x->how == 0 ? DPAR_SHARD_COLS : DPAR_SHARD_ROWS;
            dpar_shard_plan_init(&plan, &pd);
            it = dpar_ckpt_shard(x->name, NULL, x->elem, &plan, tpr);
        } else if (x->how == 2) {
            it = dpar_ckpt_block(x->name, NULL, x->elem, x->rows, x->cols, 0, x->rows, 0, x->cols);
        } else {
            size_t off, len;
            dpar_block_range(x->cols, n, r, &off, &len);
            it = dpar_ckpt_flat(x->name, NULL, x->elem, x->cols, off, len);
        }
        bufs[k] = malloc(it.bytes + 1);
        it.data = bufs[k];
        memset(it.data, 0xA5, it.bytes);
        if (fill)
            for (i = 0; i < it.nrows; i++)
                for (j = 0; j < it.ncols; j++)
                    cc_value(t, it.row0 + i, it.col0 + j, (unsigned char *)it.data + (i * it.ncols + j) * x->elem);
        items[k++] = it;
    }
    return k;
}

/* the elements of the items that differ from the formula */
static size_t cc_wrong(const dpar_ckpt_item *items, int count)
{
    size_t wrong = 0, i, j;
    int k, t;
    unsigned char want[8];
    for (k = 0; k < count; k++) {
        for (t = 0; t < CC_T && strcmp(cc_tensors[t].name, items[k].name); t++) continue;
        for (i = 0; i < items[k].nrows; i++)
            for (j = 0; j < items[k].ncols; j++) {
                cc_value(t, items[k].row0 + i, items[k].col0 + j, want);
                wrong += memcmp(want, (unsigned char *)items[k].data + (i * items[k].ncols + j) * items[k].elem,
                                items[k].elem) != 0;
            }
    }
    return wrong;
}

static void cc_free(void **bufs, int count)
{
    int k;
    for (k = 0; k < count; k++) free(bufs[k]);
}
#endif
