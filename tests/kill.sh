#!/usr/bin/env bash
# tests/kill.sh - kill tests: the demo trainer (demo/char_lm.c), checkpointing every K steps, is killed with SIGKILL
# once per trial: at a random moment of one of its runs, or (a third each) the moment the checkpoint's shard or
# its manifest starts being written (tests/kill_on_write.c, inotify). After every kill the newest whole checkpoint
# must load (the resumed run starts after the last checkpoint written in full, or after the one being written when
# its manifest was already in place), and the trial, carried on to the end, must save a final checkpoint bitwise
# identical to that of a run that was never killed.
#   tests/kill.sh [KILLS]     default 20 (make test); make stress: 200
# Then, when mpicc and mpirun are found, one of 4 MPI processes (tests/kill_mpi.c) kills itself in a loop of
# allreduces: Open MPI's mpirun, by default, tears the whole job down at once ("mpirun noticed that process rank 1
# ... exited on signal 9"), so the survivors never get to report; with `--mca orte_abort_on_non_zero_status 0` they
# live on, and each must return DPAR_ETIMEDOUT naming rank 1 within 2x its timeout (3 s). Open MPI 4.1's mpirun
# then does not exit by itself (the dead process never finalizes): the test ends it.
# Checkpoints every K steps come from the demo's own options: a chain of runs, each `--resume --stop-at` the next
# multiple of K (the first without --resume), all with the same --steps. Environment: BUILD (default build), CC.
set -u
cd "$(dirname "$0")/.." || exit 2
kills=${1:-20}
BUILD=${BUILD:-build}
CC=${CC:-cc}
S=60 K=10 # steps, checkpoint interval: 6 runs a trial
d=$BUILD/kill
rm -rf "$d" && mkdir -p "$d" || exit 2
$CC -std=c99 -O2 -I. demo/char_lm.c -o "$d/char_lm" -pthread -lm || exit 2
$CC -std=c99 -O2 tests/kill_on_write.c -o "$d/kill_on_write" || exit 2
ln -s "$(pwd)/data" "$d/data"
cd "$d" || exit 2
args="--steps $S --batch 32 --sample 0 --seed 7"

# the reference: one run, never killed; its final shard without the 32-byte header (which names the generation)
./char_lm $args --ckpt ref.ckpt >ref.out 2>&1 || { cat ref.out; echo "kill.sh: the reference run failed"; exit 1; }
ref=$(tail -c +33 ref.ckpt.g1.r0 | cksum)

fail() { echo "FAIL kill.sh: $*"; sed 's/^/    /' run.out | tail -20; exit 1; }
rng=$$
rand() { rng=$(((rng * 1103515245 + 12345) % 2147483648)); r=$(((rng >> 8) % $1)); }

done_kills=0 trials=0 mid_write=0 missed=0
declare -a how=(0 0 0)
while [ $done_kills -lt "$kills" ]; do
    trials=$((trials + 1))
    rm -f t.ckpt*
    rand $((S / K)); victim=$((r * K)) # the run (by its first step) that is killed
    rand 3; mode=$r                    # 0: a random moment, 1: the shard's write, 2: the manifest's write
    b0=0                               # the last checkpoint known whole
    while [ $b0 -lt $S ]; do
        b1=$((b0 + K))
        stop="--stop-at $b1"; [ $b1 -ge $S ] && stop=""
        resume=""; [ -e t.ckpt ] && resume="--resume"
        if [ $b0 = $victim ] && [ $mode = 0 ]; then
            ./char_lm $args --ckpt t.ckpt $resume $stop >run.out 2>&1 &
            pid=$!
            rand 60; sleep "$(printf '0.%03d' $r)" # the run takes about 40 ms
            kill -9 $pid 2>/dev/null
            wait $pid 2>/dev/null
            rc=$?
        elif [ $b0 = $victim ]; then
            ./kill_on_write . $mode ./char_lm $args --ckpt t.ckpt $resume $stop >run.out 2>&1
            rc=$?
        else
            ./char_lm $args --ckpt t.ckpt $resume $stop >run.out 2>&1
            rc=$?
        fi
        if [ $rc = 137 ]; then
            done_kills=$((done_kills + 1))
            how[$mode]=$((${how[$mode]} + 1))
            if compgen -G 't.ckpt*.tmp' >/dev/null; then mid_write=$((mid_write + 1)); fi
            victim=-1
            # the newest whole checkpoint loads: resume to the boundary after b1 and see where it starts
            b2=$((b1 + K)); [ $b1 -ge $S ] && b2=$S
            stop="--stop-at $b2"; [ $b2 -ge $S ] && stop=""
            if [ ! -e t.ckpt ]; then
                [ $b0 = 0 ] || fail "kill $done_kills: the checkpoint of step $b0 is gone"
                continue # killed before the first checkpoint: start again
            fi
            ./char_lm $args --ckpt t.ckpt --resume $stop >run.out 2>&1 ||
                fail "kill $done_kills (between checkpoints $b0 and $b1, mode $mode): the checkpoint does not load"
            from=$(sed -nE 's/^trained steps ([0-9]+)\.\..*/\1/p; s/^the checkpoint is at step ([0-9]+) already.*/\1/p' run.out | head -1)
            case "$from" in
                $((b0 + 1)) | $((b1 + 1)) | $S) ;;
                *) fail "kill $done_kills (between checkpoints $b0 and $b1): the resumed run starts at step '$from'" ;;
            esac
            b0=$b2
        elif [ $rc = 0 ]; then
            if [ $b0 = $victim ] && [ $mode != 0 ]; then
                fail "run $b0..$b1 saved its checkpoint without a temporary file (the write is not atomic)"
            fi
            [ $b0 = $victim ] && missed=$((missed + 1)) # it ended before the kill: this trial has none
            b0=$b1
        else
            fail "a run between checkpoints $b0 and $b1 failed (exit $rc)"
        fi
    done
    gen=$(od -An -t u8 -j 12 -N 8 t.ckpt | tr -d ' ') # the generation the manifest names
    got=$(tail -c +33 "t.ckpt.g$gen.r0" | cksum)
    [ "$got" = "$ref" ] || fail "trial $trials: the final checkpoint differs from the uninterrupted run's ($got vs $ref)"
done
echo "kill.sh: $done_kills kills in $trials trials (${how[0]} at random moments, ${how[1]} at the shard's write," \
    "${how[2]} at the manifest's; $mid_write left a half-written .tmp; $missed runs ended before their kill):" \
    "every checkpoint loaded, every final checkpoint equal to the uninterrupted run's"

# ---- MPI: one process killed ----
MPICC=${MPICC:-$(command -v mpicc)}
MPIRUN=${MPIRUN:-$(command -v mpirun)}
if [ -z "$MPICC" ] || [ -z "$MPIRUN" ]; then echo "kill.sh: MPI not found: the MPI kill is skipped"; exit 0; fi
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd - >/dev/null || exit 2
$MPICC -std=c99 -O2 -I. tests/kill_mpi.c -o "$d/kill_mpi" -pthread -lm || exit 2
cd "$d" || exit 2
t0=$(date +%s%N)
"$MPIRUN" --oversubscribe --mca orte_abort_on_non_zero_status 0 -np 4 ./kill_mpi >mpi.out 2>&1 &
pid=$!
for i in $(seq 300); do # 30 s at most
    [ "$(grep -c '^kill_mpi: rank' mpi.out)" -ge 3 ] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
done
secs=$((($(date +%s%N) - t0) / 1000000))
kill $pid 2>/dev/null
wait $pid 2>/dev/null
cp mpi.out run.out
n=$(grep -c '^kill_mpi: rank [023]: timed out (DPAR_ETIMEDOUT) .*waiting for rank 1 to arrive; rank 1 never arrived' mpi.out)
[ "$n" = 3 ] || fail "MPI: $n of the 3 survivors reported rank 1 (want 3, each DPAR_ETIMEDOUT naming rank 1)"
[ $secs -lt 12000 ] || fail "MPI: the survivors took $secs ms to report (timeout 3000 ms; started 4 processes)"
echo "kill.sh: MPI: process 1 of 4 killed; the 3 others returned DPAR_ETIMEDOUT naming rank 1 ($secs ms from mpirun's start)"

