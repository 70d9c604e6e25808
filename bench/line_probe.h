/* bench/line_probe.h - the machine's price of a message, for bench_comm and bench_mpi: one cache line passed
   from side 0 to side 1 and back, `trips` times. The two sides run at once (two threads of a pool, two
   processes sharing a window); each call of a pair passes the same `base`, a number above every value of
   the previous probe, so the lines need no resetting. Side 0 returns the nanoseconds per round trip (by
   dpar_time_ns), side 1 returns 0. On a virtual machine the result moves with where the host puts the
   virtual CPUs (the development machine gave 55, 120 and 500 ns within an hour), and small messages with it. */
#ifndef DPAR_BENCH_LINE_PROBE_H
#define DPAR_BENCH_LINE_PROBE_H
static double line_pingpong(int *ball, int *back, int side, int base, int trips)
{
    int i;
    uint64_t t0 = dpar_time_ns();
    for (i = base + 1; i <= base + trips; i++) {
        if (side == 0) {
            __atomic_store_n(ball, i, __ATOMIC_RELEASE);
            while (__atomic_load_n(back, __ATOMIC_ACQUIRE) != i) continue;
        } else {
            while (__atomic_load_n(ball, __ATOMIC_ACQUIRE) != i) continue;
            __atomic_store_n(back, i, __ATOMIC_RELEASE);
        }
    }
    return side == 0 ? (double)(dpar_time_ns() - t0) / trips : 0.0;
}
#endif
