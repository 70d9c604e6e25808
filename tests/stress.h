/* stress.h - mixed collectives of random kinds, sizes, dtypes and ops, every element of every result compared with
   a reference computed apart from dpar (coll_matrix.h's inputs: small integers that every reduction order combines
   exactly, and their serial reference). Shared by test_stress.c (8 thread ranks) and test_mpi.c (processes).
   Every rank draws the same sequence of calls from the same seed, so the ranks agree on each call without talking.
   Include after dpar.h, dpar_test.h and coll_matrix.h. */
#ifndef DPAR_TEST_STRESS_H
#define DPAR_TEST_STRESS_H

#define STRESS_MAX 20000 /* elements of the largest call (alltoall: this many in all) */

static uint64_t stress_next(uint64_t *s) /* splitmix64 */
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* the inputs of rank q at element i of call `shift`, and the reference over N ranks */
#define STRESS_IN(q, i, t, op) input((q), (i) + shift, (t), (op))
#define STRESS_REF(N, i, t, op) reference((N), (i) + shift, (t), (op))

typedef struct stress_counts {
    long calls[10];
} stress_counts;
static const char *const stress_names[10] = {"allreduce",  "allreduce in place", "reduce",   "reduce_scatter",
                                             "allgather",  "broadcast",          "alltoall", "barrier",
                                             "iallreduce", "sendrecv ring"};

/* rank r's part of `iters` calls from `seed`; s and v hold STRESS_MAX * 8 bytes each. A wrong element or status
   is noted (the first one in full) and ends this rank's loop; the others then fail by the comm's timeout. */
DT_UNUSED static void stress_rank(world *w, dpar_comm *c, int r, uint64_t seed, long iters, char *s, char *v,
                                  stress_counts *counts)
{
    int N = w->n, q, failed = 0;
    long it;
    for (it = 0; it < iters && !failed; it++) {
        uint64_t rng = seed * 1000003u + (uint64_t)it, x = stress_next(&rng), y = stress_next(&rng);
        int kind = (int)(x % 10), root = (int)((x >> 8) % (uint64_t)N);
        dpar_dtype t = (dpar_dtype)((x >> 16) % DPAR_DTYPE_COUNT);
        dpar_op op = (dpar_op)((x >> 24) % DPAR_OP_COUNT);
        size_t shift = (size_t)((x >> 32) % 1000), n, i, es = dpar_dtype_size(t), off, len, per;
        unsigned sz = (unsigned)(y % 100);
        const char *what = stress_names[kind];
        int bad = -1;
        dpar_status st = DPAR_OK;
        /* sizes: mostly small (the one-shot paths), some medium (slices, the ring's segments), a few large */
        n = sz < 80   ? 1 + (size_t)(y >> 8) % 64
            : sz < 97 ? 65 + (size_t)(y >> 8) % 4000
                      : 4065 + (size_t)(y >> 8) % (STRESS_MAX - 4065);
        if (kind == 6) n = n / (size_t)N ? n / (size_t)N : 1; /* alltoall: per peer, N n in all */
        if (counts) counts->calls[kind]++;
        dpar_block_range(n, N, r, &off, &len);
        memset(v, 0x5a, (size_t)STRESS_MAX * 8);
        switch (kind) {
        case 0:
        case 1:
            for (i = 0; i < n; i++) put(s, t, i, STRESS_IN(r, i, t, op));
            st = dpar_allreduce(c, s, kind ? s : v, n, t, op);
            for (i = 0; i < n && bad < 0; i++)
                if (get(kind ? s : v, t, i) != STRESS_REF(N, i, t, op)) bad = (int)i;
            break;
        case 2:
            for (i = 0; i < n; i++) put(s, t, i, STRESS_IN(r, i, t, op));
            st = dpar_reduce(c, s, r == root ? v : NULL, n, t, op, root);
            for (i = 0; i < n && bad < 0 && r == root; i++)
                if (get(v, t, i) != STRESS_REF(N, i, t, op)) bad = (int)i;
            break;
        case 3:
            for (i = 0; i < n; i++) put(s, t, i, STRESS_IN(r, i, t, op));
            st = dpar_reduce_scatter(c, s, v, n, t, op);
            for (i = 0; i < len && bad < 0; i++)
                if (get(v, t, i) != STRESS_REF(N, off + i, t, op)) bad = (int)i;
            break;
        case 4:
            for (i = 0; i < len; i++) put(s, t, i, STRESS_IN(r, off + i, t, DPAR_SUM));
            st = dpar_allgather(c, s, v, n, t);
            for (q = 0; q < N && bad < 0; q++) {
                size_t qo, ql;
                dpar_block_range(n, N, q, &qo, &ql);
                for (i = qo; i < qo + ql && bad < 0; i++)
                    if (get(v, t, i) != STRESS_IN(q, i, t, DPAR_SUM)) bad = (int)i;
            }
            break;
        case 5: /* in place on half the calls: the others' buffers hold garbage */
            if (r == root)
                for (i = 0; i < n; i++) put(x & 1 ? v : s, t, i, STRESS_IN(r, i, t, DPAR_SUM));
            st = dpar_broadcast(c, x & 1 ? v : s, v, n, t, root);
            for (i = 0; i < n && bad < 0; i++)
                if (get(v, t, i) != STRESS_IN(root, i, t, DPAR_SUM)) bad = (int)i;
            break;
        case 6:
            per = n;
            for (q = 0; q < N; q++)
                for (i = 0; i < per; i++) put(s + (size_t)q * per * es, t, i, STRESS_IN(r * 100 + q, i, t, DPAR_SUM));
            st = dpar_alltoall(c, s, v, per, t);
            for (q = 0; q < N && bad < 0; q++)
                for (i = 0; i < per && bad < 0; i++)
                    if (get(v + (size_t)q * per * es, t, i) != STRESS_IN(q * 100 + r, i, t, DPAR_SUM))
                        bad = (int)((size_t)q * per + i);
            break;
        case 7: st = dpar_barrier(c); break;
        case 8: { /* asynchronous: the result is there after the wait */
            dpar_request *req = NULL;
            for (i = 0; i < n; i++) put(s, t, i, STRESS_IN(r, i, t, op));
            st = dpar_iallreduce(c, s, v, n, t, op, &req);
            if (st == DPAR_OK) st = dpar_request_wait(req);
            for (i = 0; i < n && bad < 0; i++)
                if (get(v, t, i) != STRESS_REF(N, i, t, op)) bad = (int)i;
            break;
        }
        default: /* each rank sends to the next, hears from the previous */
            for (i = 0; i < n; i++) put(s, t, i, STRESS_IN(r, i, t, DPAR_SUM));
            st = dpar_sendrecv(c, s, n, (r + 1) % N, v, n, (r + N - 1) % N, t, (int)(it & 0xffff));
            for (i = 0; i < n && bad < 0; i++)
                if (get(v, t, i) != STRESS_IN((r + N - 1) % N, i, t, DPAR_SUM)) bad = (int)i;
            break;
        }
        failed = st != DPAR_OK || bad >= 0;
        if (st != DPAR_OK)
            note(w, "stress call %ld (%s, n %zu, %s %s, root %d) on rank %d: %s: %s", it, what, n, dpar_dtype_name(t),
                 dpar_op_name(op), root, r, dpar_status_string(st), dpar_last_error());
        else if (bad >= 0)
            note(w, "stress call %ld (%s, n %zu, %s %s, root %d) on rank %d: element %d wrong", it, what, n,
                 dpar_dtype_name(t), dpar_op_name(op), root, r, bad);
    }
}
#endif
