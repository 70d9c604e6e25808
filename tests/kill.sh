#!/usr/bin/env bash
# tests/kill.sh - kill tests: the demo trainer (demo/char_lm.c), checkpointing every K steps, is killed with SIGKILL
# once per trial: at a random moment of one of its runs, or (a third each) the moment the checkpoint's shard or
# its manifest starts being written (tests/kill_on_write.c, inotify). After every kill the newest whole checkpoint
# must load (the resumed run starts after the last checkpoint written in full, or after the one being written when
# its manifest was already in place), and the trial, carried on to the end, must save a final checkpoint bitwise
# identical to that of a run that was never killed.
# Then the same for examples/data_parallel.c on 2 thread ranks, which checkpoints every K steps inside one run
# (--ckpt-every: each rank writes its shard, rank 0 the manifest): one run per trial killed at a random moment or
# when a shard's or the manifest's temporary file appears; the resumed run (--resume) must start at the newest
# checkpoint that it reported saved or the one after (whose manifest may have landed before the kill), and end
# with weights (--params-out: raw floats, compared with cmp, apart from the checkpoint code) identical to those of
# a run with no checkpoints at all.
#   tests/kill.sh [KILLS [PARTS]]   KILLS of each trainer: default 20 (make test); make stress: 200
#                                   PARTS: any of demo dp mpi (default all three)
set -u
cd "$(dirname "$0")/.." || exit 2
kills=${1:-20}
parts=${2:-demo dp mpi}
BUILD=${BUILD:-build}
CC=${CC:-cc}
has() { case " $parts " in *" $1 "*) return 0 ;; esac; return 1; }
S=60 K=10 # steps, checkpoint interval: 6 runs a trial
d=$BUILD/kill
rm -rf "$d" && mkdir -p "$d" || exit 2
$CC -std=c99 -O2 -I. demo/char_lm.c -o "$d/char_lm" -pthread -lm || exit 2
$CC -std=c99 -O2 -I. examples/data_parallel.c -o "$d/data_parallel" -pthread -lm || exit 2
$CC -std=c99 -O2 tests/kill_on_write.c -o "$d/kill_on_write" || exit 2
ln -s "$(pwd)/data" "$d/data"
cd "$d" || exit 2
: >run.out

fail() { echo "FAIL kill.sh: $*"; sed 's/^/    /' run.out | tail -20; exit 1; }
rng=$$
rand() { rng=$(((rng * 1103515245 + 12345) % 2147483648)); r=$(((rng >> 8) % $1)); }

demo_kills() {
args="--steps $S --batch 32 --sample 0 --seed 7"

# the reference: one run, never killed; its final shard without the 32-byte header (which names the generation)
./char_lm $args --ckpt ref.ckpt >ref.out 2>&1 || { cat ref.out; echo "kill.sh: the reference run failed"; exit 1; }
ref=$(tail -c +33 ref.ckpt.g1.r0 | cksum)

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
}

# ---- examples/data_parallel.c: checkpoints every DK steps inside one run, 2 thread ranks ----
dp_kills() {
    local DS=60 DK=10 dargs="--layers 64,128,128,10 --batch 64 --steps 60 --threads 2" ms n t0 kills_dp=0
    local trials_dp=0 mode want hi lo from last files=3 # files a checkpoint writes: 2 shards, then the manifest
    local -a dhow=(0 0 0)
    local dmid=0 dmissed=0 starts=""
    # the reference: no checkpoints at all; its final weights as raw floats. Then one run with them, not killed: the
    # same weights, and how long such a run takes (the random kills fall inside it)
    ./data_parallel $dargs --params-out dref.bin >run.out 2>&1 || fail "data_parallel: the reference run failed"
    t0=$(date +%s%N)
    ./data_parallel $dargs --ckpt dt.ckpt --ckpt-every $DK --params-out dck.bin >run.out 2>&1 ||
        fail "data_parallel: the run with checkpoints failed"
    ms=$((($(date +%s%N) - t0) / 1000000 + 20))
    cmp -s dck.bin dref.bin || fail "data_parallel: checkpoints every $DK steps change the weights"
    while [ $kills_dp -lt "$kills" ]; do
        trials_dp=$((trials_dp + 1))
        rm -f dk.ckpt* dout.bin
        : >run.out # a kill may come before the run's shell opens it: no stale "saved" lines
        mode=$((trials_dp % 3)) # 0: a random moment, 1: a shard's write, 2: the manifest's write
        if [ $mode = 0 ]; then
            ./data_parallel $dargs --ckpt dk.ckpt --ckpt-every $DK >run.out 2>&1 &
            pid=$!
            rand $ms; sleep "$(printf '%d.%03d' $((r / 1000)) $((r % 1000)))"
            kill -9 $pid 2>/dev/null
            wait $pid 2>/dev/null
            rc=$?
        else
            rand $((DS / DK)); n=$((r * files + (mode == 1 ? 1 + r % 2 : files))) # the file's number, from 1
            ./kill_on_write . $n ./data_parallel $dargs --ckpt dk.ckpt --ckpt-every $DK >run.out 2>&1
            rc=$?
        fi
        if [ $rc = 0 ]; then
            [ $mode = 0 ] || fail "data_parallel: run saved all its checkpoints without temporary file $n (the write is not atomic)"
            dmissed=$((dmissed + 1)) # it ended before the kill: aim earlier from now on
            ms=$((ms * 4 / 5 > 20 ? ms * 4 / 5 : 20))
            continue
        fi
        [ $rc = 137 ] || fail "data_parallel: the run failed (exit $rc)"
        kills_dp=$((kills_dp + 1))
        dhow[$mode]=$((${dhow[$mode]} + 1))
        if compgen -G 'dk.ckpt*.tmp' >/dev/null; then dmid=$((dmid + 1)); fi
        # the newest whole checkpoint: the last one reported saved (lo), or the next (its manifest may have been
        # renamed into place just before the kill); at the Nth file, that checkpoint or the one before
        last=$(sed -n 's/^checkpoint step \([0-9]*\) saved$/\1/p' run.out | tail -1)
        lo=${last:-0} hi=$((${last:-0} + DK))
        if [ $mode != 0 ]; then # the checkpoint before the one being written, or (a kill that came late) that one
            want=$(((n - 1) / files * DK))
            [ $lo = $want ] || [ $lo = $((want + DK)) ] ||
                fail "data_parallel: kill $kills_dp: checkpoint $lo reported saved, file $n belongs to step $((want + DK))'s"
            [ $lo = $want ] || hi=$lo # it reported the one being written: that one
        fi
        if [ ! -e dk.ckpt ]; then
            [ $lo = 0 ] || fail "data_parallel: kill $kills_dp: the checkpoint of step $lo is gone"
            ./data_parallel $dargs --ckpt dk.ckpt --ckpt-every $DK --params-out dout.bin >run.out 2>&1 ||
                fail "data_parallel: kill $kills_dp: the run started again failed"
            from=0
        else
            ./data_parallel $dargs --ckpt dk.ckpt --ckpt-every $DK --resume --params-out dout.bin >run.out 2>&1 ||
                fail "data_parallel: kill $kills_dp (mode $mode, last reported $lo): the checkpoint does not load"
            from=$(sed -n 's/^resumed from dk.ckpt at step \([0-9]*\) .*/\1/p' run.out)
            [ -n "$from" ] && { [ "$from" = $lo ] || [ "$from" = $hi ]; } ||
                fail "data_parallel: kill $kills_dp (mode $mode): resumed at step '$from', the newest whole checkpoint is $lo or $hi"
            [ $from -gt 0 ] || fail "data_parallel: kill $kills_dp: a checkpoint of step 0"
        fi
        starts="$starts $from"
        cmp -s dout.bin dref.bin || fail "data_parallel: kill $kills_dp (mode $mode, resumed at ${from:-0}): the final weights differ from the run without checkpoints"
    done
    echo "kill.sh: data_parallel: $kills_dp kills in $trials_dp trials (${dhow[0]} at random moments," \
        "${dhow[1]} at a shard's write, ${dhow[2]} at the manifest's; $dmid left a half-written .tmp; $dmissed runs" \
        "ended before their kill): every newest checkpoint loaded, every resumed run ended with the uninterrupted" \
        "run's weights, bit for bit"
    echo "kill.sh: data_parallel: resumed at step (count):$(echo $starts | tr ' ' '\n' | sort -n | uniq -c |
        awk '{printf " %s (%s)", $2, $1}')"
}

has demo && demo_kills
has dp && dp_kills
has mpi || exit 0

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

