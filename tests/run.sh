#!/usr/bin/env bash
# tests/run.sh - runs dpar's checks and ends with one total line: `N passed, N failed[, N skipped]`.
#
#   tests/run.sh [--no-mpi-reason TEXT] [--matrix] [TEST_PROGRAM...]
#
# --matrix first checks the formatting (tests/format.sh), dpar.h's layout (tests/layout.sh), docs/api.md's
# coverage (tests/api.sh) and the pictures of docs/img (tests/docs.sh), runs the compile matrix (dpar.h under gcc
# and clang, C99 and C11, as C++, twice linked, DPAR_STATIC, dpar_cuda.h through nvcc), builds and runs every
# example with the exact Build:/Run: commands of its first comment, and checks the documentation's C snippets
# (tests/snippets.sh). Then each test program runs (under `timeout`); its own
# `N passed, N failed[, N skipped]` line is added to the total. A program that crashes or hangs
# counts as one failure. Then the MPI tests under mpirun, when MPITEST names the program.
# Environment: BUILD, NVCC, MPICC, MPIRUN, MPITEST, OPENBLAS (set by the Makefile); V=1 prints every
# program's whole output.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD:-build}
mkdir -p "$BUILD/matrix"
passed=0 failed=0 skipped=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

ok()   { passed=$((passed + 1)); echo "ok   $1"; }
bad()  { failed=$((failed + 1)); echo "FAIL $1"; sed 's/^/    /' "$tmp/out" | tail -40; }
skip() { skipped=$((skipped + 1)); echo "skip $1: skipped: $2"; }

# step NAME COMMAND...: passes when the command exits 0
step() {
    local name=$1; shift
    if "$@" >"$tmp/out" 2>&1; then ok "$name"; else bad "$name"; fi
}

WARN="-Wall -Wextra -Wpedantic -Werror"
M="$BUILD/matrix"
# Open MPI refuses to start as root unless told; CI runs as root
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

matrix() {
    local cc std cxx
    # formatting: every C file as clang-format writes it (.clang-format), no line over 120 columns;
    # skipped (the length still checked) where clang-format 14 is not installed
    if tests/format.sh >"$tmp/out" 2>&1; then
        if grep -q '^skipped: ' "$tmp/out"; then skip "format" "$(sed -n 's/^skipped: //p' "$tmp/out" | head -1)"
        else ok "format: $(tail -1 "$tmp/out" | sed 's/^formatted: //')"; fi
    else
        bad "format: tests/format.sh (make format rewrites the files; long comments are wrapped by hand)"
    fi
    for cc in gcc clang; do
        if ! command -v $cc >/dev/null; then skip "compile $cc" "$cc is not installed"; continue; fi
        for std in c99 c11; do
            step "compile dpar.h: $cc -std=$std, two units linked" \
                sh -c "$cc -std=$std $WARN -I. tests/compile_impl.c tests/compile_user.c -o $M/link_${cc}_$std -pthread -lm && $M/link_${cc}_$std"
        done
    done
    for cxx in g++ clang++; do
        if ! command -v $cxx >/dev/null; then skip "compile $cxx" "$cxx is not installed"; continue; fi
        step "compile dpar.h as C++: $cxx -std=c++11, two units linked" \
            sh -c "$cxx -std=c++11 $WARN -I. -x c++ tests/compile_impl.c -x c++ tests/compile_user.c -o $M/link_$cxx -pthread -lm && $M/link_$cxx"
    done
    step "compile dpar.h: DPAR_STATIC in two units of one program" \
        sh -c "gcc -std=c99 $WARN -I. tests/compile_static_a.c tests/compile_static_b.c -o $M/static -pthread -lm && $M/static"
    step "dpar.h layout: the section table lists every tag; no transport's private names outside its section" tests/layout.sh
    # docs/api.md: an entry for every public name of dpar.h and dpar_cuda.h under its section, none stale
    if tests/api.sh >"$tmp/out" 2>&1; then
        if grep -q '^skipped: ' "$tmp/out"; then skip "docs/api.md coverage" "$(sed -n 's/^skipped: //p' "$tmp/out" | head -1)"
        else ok "docs/api.md: $(tail -1 "$tmp/out" | sed 's/^api ok: //')"; fi
    else
        bad "docs/api.md: tests/api.sh (every public name of dpar.h and dpar_cuda.h needs its entry; none stale)"
    fi
    step "docs pictures: docs/img/*.svg are what make docs makes from their sources (tests/docs.sh)" env BUILD="$BUILD" tests/docs.sh
    for cc in gcc clang; do # the implementation after system headers: -pthread makes glibc show POSIX (compile_late.c)
        command -v $cc >/dev/null || continue
        step "compile dpar.h: $cc -std=c99 -pthread, the implementation after system headers" \
            sh -c "$cc -std=c99 $WARN -pthread -I. tests/compile_late.c -o $M/late_$cc -lm && $M/late_$cc"
    done
    step "compile dpar.h: DPAR_NO_FUTEX" gcc -std=c99 $WARN -I. -c tests/compile_impl.c -DDPAR_NO_FUTEX -o $M/nofutex.o
    step "compile dpar.h: gcc -O3 (more warnings surface with more inlining)" gcc -std=c99 -O3 $WARN -I. -c tests/compile_impl.c -o $M/o3.o
    step "compile dpar.h: clang -O3" clang -std=c11 -O3 $WARN -I. -c tests/compile_impl.c -o $M/o3c.o
    if [ -n "${OPENBLAS:-}" ]; then
        step "compile dpar.h with DPAR_OPENBLAS, as C and C++" sh -c "gcc -std=c99 -O2 $WARN -DDPAR_OPENBLAS -I. tests/compile_impl.c tests/compile_user.c -o $M/blas -pthread -lm -lopenblas && $M/blas && g++ -std=c++11 $WARN -DDPAR_OPENBLAS -I. -x c++ tests/compile_impl.c -x c++ tests/compile_user.c -o $M/blaspp -pthread -lm -lopenblas"
    else
        skip "compile dpar.h with DPAR_OPENBLAS" "OpenBLAS not found"
    fi
    # the GPU half without a GPU: tests/gpu.sh --build (every .cu built for sm_90 with host warnings as
    # errors, the kernels' resource use, C99/C++ callers linked with the nvcc-built implementation, the
    # kernels' element functions on the host), then the device tests (skipped without a usable device)
    if [ -n "${NVCC:-}" ]; then
        program "tests/gpu.sh --build" env NVCC="$NVCC" BUILD="$BUILD" tests/gpu.sh --build
        if [ -x "$BUILD/gpu/test_cuda" ]; then program "$BUILD/gpu/test_cuda" "$BUILD/gpu/test_cuda"; fi
    else
        skip "dpar_cuda.h" "nvcc not found"
    fi
}

# examples: build and run each with the exact commands of its first comment, in a scratch copy of
# the repository layout, so a pasted command works as written. The run must exit 0 and, when the
# comment has a `Check: REGEX` line, print something that matches it (grep -E). The examples see
# DPAR_TEST_QUICK=1 and may run shorter.
examples() {
    local f name build run
    for f in examples/*.c examples/*.cu examples/guide/*.c examples/guide/*.cu; do # guide/: the lessons of docs/guide/
        [ -f "$f" ] || continue
        name=${f#examples/}
        build=$(head -20 "$f" | sed -n 's/^ *\(\/\*\)\{0,1\} *Build: *//p' | head -1)
        run=$(head -20 "$f" | sed -n 's/^ *Run: *//p' | head -1 | sed 's/  \+(.*//; s/ \{2,\}.*//')
        if [ -z "$build" ] || [ -z "$run" ]; then
            echo "no Build:/Run: line" >"$tmp/out"; bad "example $name"; continue
        fi
        if [ "$name" = guide/10_mpi.c ]; then # the same file without -DDPAR_MPI: its ranks are threads of one process
            step "example $name without DPAR_MPI: 3 thread ranks, checked as the processes are" sh -c "cd '$tmp' &&
                cc -std=c99 -O2 -I'$ROOT' '$ROOT/$f' -o 10_threads -pthread -lm && ./10_threads 3 > t.txt; rc=\$?; cat t.txt;
                [ \$rc = 0 ] && grep -q '^ranks: 3 in 1 process (threads of one process)\$' t.txt"
        fi
        case "$build" in
            mpicc*) if [ -z "${MPICC:-}" ] || [ -z "${MPIRUN:-}" ]; then skip "example $name" "MPI not found"; continue; fi ;;
            nvcc*) if [ -z "${NVCC:-}" ]; then skip "example $name" "nvcc not found"; continue; fi ;;
        esac
        case "$build" in # an OpenMP comparison needs a compiler with -fopenmp
            *-fopenmp*) if ! printf 'int main(void){return 0;}\n' | ${build%% *} -fopenmp -x c - -o "$tmp/omp" >/dev/null 2>&1; then
                skip "example $name" "${build%% *} has no -fopenmp"; continue; fi ;;
        esac
        rm -rf "$tmp/ex" && mkdir -p "$tmp/ex"
        for p in dpar.h dpar_cuda.h examples data tests; do [ -e "$p" ] && ln -s "$ROOT/$p" "$tmp/ex/$p"; done
        head -30 "$f" | sed -n 's/^ *Check: *//p' >"$tmp/checks"
        step "example $name: $build && $run" sh -c "cd '$tmp/ex' && $build && DPAR_TEST_QUICK=1 timeout 300 $run > out.txt 2>&1; rc=\$?; cat out.txt; [ \$rc = 0 ] || exit \$rc; while IFS= read -r re; do grep -Eq \"\$re\" out.txt || { echo \"the output does not match the example's Check: \$re\"; exit 1; }; done < '$tmp/checks'"
        if [ "$name" = cuda_data_parallel.cu ]; then # its CPU reference is the CPU example's training
            step "example $name: its CPU reference (--cpu 2) gives examples/data_parallel.c's losses (within 2e-4)" sh -c "cd '$tmp/ex' &&
                cc -std=c99 -O2 -I. examples/data_parallel.c -o dp -pthread -lm && ./dp --threads 2 --steps 12 | grep '^step' > a.txt &&
                ./cuda_data_parallel --cpu 2 --steps 12 | grep '^step' > b.txt && paste a.txt b.txt &&
                [ \$(wc -l < a.txt) = 7 ] && paste a.txt b.txt | awk '{ d = \$4 - \$8; if (\$2 != \$6 || d > 2e-4 || d < -2e-4) bad = 1 } END { exit bad }'"
            step "example $name: its bf16 reference (--cpu 4 --bf16: gradients averaged in bf16) keeps the fp32 losses within 2e-3 over 30 steps" sh -c "cd '$tmp/ex' &&
                ./cuda_data_parallel --cpu 4 --steps 30 > f.txt && ./cuda_data_parallel --cpu 4 --steps 30 --bf16 > h.txt && paste f.txt h.txt &&
                ! cmp -s f.txt h.txt && [ \$(wc -l < h.txt) = 6 ] && paste f.txt h.txt | awk '{ d = \$4 - \$8; if (\$2 != \$6 || d > 2e-3 || d < -2e-3) bad = 1 } END { exit bad }'"
        fi
        if [ "$name" = moe.c ]; then # its claims: bitwise equal to one rank where tokens are dropped, a backward that
            # matches central differences, and the alltoallv count check naming both sides of a wrong count
            step "example $name: N = 1, 2, 4 bitwise equal to 1 rank with k = 1 and k = 2, capacity 0.75 (tokens dropped)" sh -c "cd '$tmp/ex' &&
                for k in 1 2; do ./moe --ranks 1,2,4 --k \$k --capacity 0.75 --steps 60 > k\$k.txt || { cat k\$k.txt; exit 1; }; grep '^moe ranks' k\$k.txt;
                [ \$(grep -c '^moe ranks=[24] .* bitwise equal to 1 rank: yes\$' k\$k.txt) = 2 ] && grep -Eq '^moe ranks=1 .* dropped=[1-9]' k\$k.txt || exit 1; done"
            step "example $name: --gradcheck (router, dense and expert weights, aux loss on, tokens dropped) with k = 1 on 2 ranks and k = 2 on 4" sh -c "cd '$tmp/ex' &&
                ./moe --gradcheck --k 1 --capacity 0.75 --ranks 2 > g1.txt; r1=\$?; ./moe --gradcheck --k 2 --capacity 0.75 --ranks 4 > g2.txt; r2=\$?; cat g1.txt g2.txt;
                [ \$r1 = 0 ] && [ \$r2 = 0 ] && [ \$(grep -Ec '^moe gradcheck .* dropped=[1-9][0-9]*: .*: OK\$' g1.txt g2.txt | awk -F: '{ s += \$2 } END { print s }') = 2 ]"
            step "example $name: --wrong-count fails every rank with DPAR_EMISMATCH naming both ranks and both counts" sh -c "cd '$tmp/ex' &&
                ./moe --wrong-count --ranks 2 > w.txt 2>&1; rc=\$?; cat w.txt;
                [ \$rc != 0 ] && grep -Eq 'DPAR_EMISMATCH\\) on every rank: rank 1 sends [0-9]+ elements to rank 0 in alltoallv .* but rank 0 expects [0-9]+ from rank 1 ' w.txt"
        fi
        if [ "$name" = data_parallel.c ]; then # its claim: one shared copy of the weights = separate replicas
            step "example $name: weights shared by 3 ranks end bit for bit as 3 replicas (--replicas)" sh -c "cd '$tmp/ex' &&
                ./data_parallel --threads 3 --batch 96 --steps 6 > s.txt && ./data_parallel --threads 3 --batch 96 --steps 6 --replicas > r.txt &&
                grep -h crc32 s.txt r.txt && [ \"\$(sed -n 's/.*crc32 //p' s.txt)\" = \"\$(sed -n 's/.*crc32 //p' r.txt)\" ]"
            step "example $name: a wrong command line names the option and its value (--bogus last: unknown, not 'without its value')" sh -c "cd '$tmp/ex' &&
                ./data_parallel --steps 2 --bogus > u1.txt 2>&1; r1=\$?; ./data_parallel --threads 3 > u2.txt 2>&1; r2=\$?;
                ./data_parallel --steps > u3.txt 2>&1; r3=\$?; cat u1.txt u2.txt u3.txt; [ \$r1 = 2 ] && [ \$r2 = 2 ] && [ \$r3 = 2 ] &&
                grep -qx \"data_parallel: unknown option '--bogus'\" u1.txt && grep -q '^data_parallel: --batch 256: a multiple of --threads 3 ' u2.txt &&
                grep -qx 'data_parallel: --steps without its value' u3.txt"
        fi
        if [ "$name" = context_parallel.c ]; then # the gradcheck alone; other sizes, cp 8 too; what it refuses
            step "example $name --gradcheck: the unsharded attention's dQ dK dV and the layer's dW against central differences" sh -c "cd '$tmp/ex' &&
                ./context_parallel --gradcheck > g.txt; rc=\$?; cat g.txt; [ \$rc = 0 ] && grep -q '^gradcheck: .* of central differences: OK\$' g.txt"
            step "example $name --seq 48 --heads 8 --dim 4 --cp 1,2,4,8: Ulysses bitwise, ring within tolerance, training as unsharded" sh -c "cd '$tmp/ex' &&
                ./context_parallel --mode both --cp 1,2,4,8 --seq 48 --heads 8 --dim 4 --steps 20 > s.txt; rc=\$?; cat s.txt; [ \$rc = 0 ] &&
                [ \$(grep -c '^block cp=[1248] mode=ulysses: .*bitwise equal.*: OK\$' s.txt) = 4 ] && [ \$(grep -c '^block cp=[1248] mode=ring: .*(balanced); .* bitwise as blocking: OK\$' s.txt) = 4 ] &&
                [ \$(grep -c '^cp=[1248] mode=\(ulysses\|ring\) loss=.* OK\$' s.txt) = 8 ] && grep -q '^context_parallel: all checks passed\$' s.txt"
            step "example $name: a sequence the zig-zag split cannot cut (--seq 50, cp 4) and heads Ulysses cannot split (--heads 2, cp 4) are refused" sh -c "cd '$tmp/ex' &&
                ./context_parallel --mode ring --seq 50 --cp 4 > r.txt 2>&1; rc=\$?; cat r.txt; [ \$rc = 2 ] && grep -q 'is not a multiple of 2 cp = 8' r.txt &&
                ./context_parallel --mode ulysses --heads 2 --cp 4 > u.txt 2>&1; rc=\$?; cat u.txt; [ \$rc = 2 ] && grep -q 'Ulysses with cp = 4 needs' u.txt"
            step "example $name --bench --seq 128: one bench=ring_attention line for cp 2 and for cp 4 (times not judged)" sh -c "cd '$tmp/ex' &&
                ./context_parallel --bench --seq 128 --cp 2,4 > b.txt; rc=\$?; cat b.txt; [ \$rc = 0 ] && [ \$(grep -c '^bench=ring_attention cp=[24] seq=128 us=[0-9]* overlap=[0-9.]* ' b.txt) = 2 ]"
        fi
    done
}

# what the lesson pages show a program printing is what it prints (issue 39): tests/shown.sh runs each page's shown
# runs (its fenced blocks that open with a `$ ` command) in a scratch copy and compares the output line for line, the
# numbers that vary from run to run (after `measured `, before ` ms`, ` us` or ` GB/s`) masked by one rule; README.md's
# first program (examples/first.c, which tests/snippets.sh checks the README quotes whole) too. Lessons 10 and 13 show
# mpicc and mpirun runs (skipped without them); lesson 11's GPU runs are recorded, not `$ ` blocks (its page says why)
lessons_shown() {
    local md
    for md in README.md docs/guide/0[1-9]_*.md docs/guide/1[0-6]_*.md docs/guide/17_mixed_precision.md \
        docs/guide/18_accumulation_clipping.md \
        docs/guide/19_checkpoint_elastic.md; do
        case "$md" in
            docs/guide/11_gpu.md)
                skip "$md: the program prints what the page shows" "its runs are recorded (a GPU's and a machine's without one)"
                continue ;;
            docs/guide/10_mpi.md | docs/guide/13_porting.md)
                if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
                    skip "$md: the program prints what the page shows" "mpicc or mpirun not found (the page runs them)"; continue
                fi ;;
        esac
        step "$md: the program prints what the page shows (tests/shown.sh)" tests/shown.sh "$md"
    done
}

# the demo trainer (demo/char_lm.c), built with its own Build: line in a scratch copy: the default run
# (what `make demo` shows) must bring the loss well down; a run stopped and resumed must end with
# the same parameters, bit for bit, as one that never stopped; Ctrl-C must save a checkpoint that
# resumes; bad input must give one line on stderr and a non-zero exit.
demo() {
    local d="$tmp/demo" build first last crc1 crc2 pid rc n
    build=$(head -5 demo/char_lm.c | sed -n 's/^ *Build: *//p')
    rm -rf "$d" && mkdir -p "$d"
    for p in dpar.h demo data; do ln -s "$ROOT/$p" "$d/$p"; done
    if [ -z "$build" ] || ! (cd "$d" && sh -c "$build") >"$tmp/out" 2>&1; then bad "demo: build with '$build'"; return; fi
    ok "demo: $build"
    (cd "$d" && timeout 300 ./char_lm --ckpt full.ckpt) >"$tmp/out" 2>&1
    rc=$?
    first=$(sed -nE 's/.*loss ([0-9.]+) \(first step\) -> ([0-9.]+).*/\1/p' "$tmp/out")
    last=$(sed -nE 's/.*loss ([0-9.]+) \(first step\) -> ([0-9.]+).*/\2/p' "$tmp/out")
    if [ $rc = 0 ] && [ -n "$last" ] && awk -v a="$first" -v b="$last" 'BEGIN { exit !(a > 3.5 && b < 1.8) }' &&
        grep -q 'replicas are identical' "$tmp/out" && grep -q -A1 '^sample' "$tmp/out"; then
        ok "demo: the default run: loss $first -> $last, replicas identical, a sample"
    else
        bad "demo: the default run (want exit 0, loss from above 3.5 to below 1.8, a sample)"
    fi
    # the sample reads like the text only if the model does well on text it never saw: its held-out loss must beat
    # a table of the training text's bigram counts (which the demo computes) by 0.3 nats/char (a model that learned
    # the text by heart, CTX 16, scored 2.39 against the table's 2.32), and most words of the sample must be words
    # of the text (82% with CTX 6 at temperature 0.5; a broken sampler, the context not moving on, gives 0%; the
    # model that learned the text by heart gave 64-74%, which only the loss check catches)
    held=$(sed -nE 's/^held-out loss ([0-9.]+) .*bigrams: ([0-9.]+)\)$/\1 \2/p' "$tmp/out")
    words=$(sed -nE 's/^sample: ([0-9]+)% of its [0-9]+ words are words of the training text$/\1/p' "$tmp/out")
    if [ -n "$held" ] && [ -n "$words" ] && echo "$held $words" | awk '{ exit !($1 < $2 - 0.3 && $3 >= 70) }'; then
        ok "demo: held-out loss $held (model, bigram table); $words% of the sample's words are the text's"
    else
        bad "demo: the sample must read like the text (held-out loss 0.3 below the bigram table's: '$held'; 70% known words: '$words')"
    fi
    (cd "$d" && ./char_lm --steps 40 --batch 64 --sample 0 --ckpt a.ckpt && ./char_lm --steps 40 --batch 64 --sample 0 \
        --ckpt b.ckpt --stop-at 17 && ./char_lm --steps 40 --batch 64 --sample 0 --ckpt b.ckpt --resume) >"$tmp/out" 2>&1
    crc1=$(grep crc32 "$tmp/out" | sed -n 1p | sed 's/.*crc32 //')
    crc2=$(grep crc32 "$tmp/out" | sed -n 3p | sed 's/.*crc32 //')
    if [ -n "$crc1" ] && [ "$crc1" = "$crc2" ] && grep -q 'stopped at step 17' "$tmp/out" && grep -q 'trained steps 18..40' "$tmp/out"; then
        ok "demo: stopped at 17 and resumed to 40 = 40 straight (parameters crc32 $crc1)"
    else
        bad "demo: stop and resume must equal the uninterrupted run ($crc1 vs $crc2)"
    fi
    # an elastic restart: stopped on 2 thread ranks, resumed on 3; the same samples, float sums grouped otherwise
    (cd "$d" && ./char_lm --steps 40 --batch 48 --sample 0 --ckpt e1.ckpt && ./char_lm --steps 40 --batch 48 --sample 0 \
        --ckpt e2.ckpt --stop-at 17 && ./char_lm --steps 40 --batch 48 --sample 0 --ckpt e2.ckpt --resume --threads 3) >"$tmp/out" 2>&1
    first=$(sed -nE 's/^eval loss ([0-9.]+) .*/\1/p' "$tmp/out" | sed -n 1p)
    last=$(sed -nE 's/^eval loss ([0-9.]+) .*/\1/p' "$tmp/out" | sed -n 3p)
    if [ -n "$last" ] && grep -q 'trained steps 18..40' "$tmp/out" && grep -q 'the 3 replicas are identical' "$tmp/out" &&
        awk -v a="$first" -v b="$last" 'BEGIN { d = a - b; exit !(d * d < 1e-6) }'; then
        ok "demo: stopped at 17 on 2 threads, resumed on 3 to 40: eval loss $last, straight $first"
    else
        bad "demo: --resume with another --threads must end as the uninterrupted run (eval loss $first vs $last)"
    fi
    (cd "$d" && exec ./char_lm --steps 100000000 --batch 32 --sample 0 --ckpt int.ckpt) >"$tmp/out" 2>&1 &
    pid=$!
    sleep 2
    kill -INT $pid
    wait $pid
    rc=$?
    n=$(sed -nE 's/^interrupted at step ([0-9]+).*/\1/p' "$tmp/out")
    if [ $rc = 130 ] && [ -n "$n" ] && (cd "$d" && ./char_lm --steps $((n + 3)) --batch 32 --sample 20 --ckpt int.ckpt --resume) >>"$tmp/out" 2>&1 &&
        grep -q "trained steps $((n + 1))..$((n + 3))" "$tmp/out"; then
        ok "demo: Ctrl-C at step $n saved a checkpoint that resumes"
    else
        bad "demo: Ctrl-C (exit $rc, want 130 and a checkpoint that resumes)"
    fi
    if (cd "$d" && ./char_lm --help) >"$tmp/out" 2>&1 && [ "$(grep -c -- '^  --' "$tmp/out")" -ge 12 ]; then
        ok "demo: --help"; else bad "demo: --help"; fi
    (cd "$d" && ./char_lm --steps 3 --sample 0 --ckpt t.ckpt --trace t.json) >"$tmp/out" 2>&1
    if [ $? = 0 ] && grep -q '"name":"forward"' "$d/t.json" && grep -q '"name":"allreduce"' "$d/t.json" && tail -c 3 "$d/t.json" | grep -q ']'; then
        ok "demo: --trace writes forward/backward/allreduce spans"; else cat "$d/t.json" >>"$tmp/out"; bad "demo: --trace"; fi
    printf 'abcabcabcabcabcabcabcabcabcabcabcabcabcabc\n' >"$d/abc.txt"
    for args in "--bogus" "--steps" "--steps -3" "--threads 0" "--batch 7 --threads 2" "--lr x" "--data nonexistent.txt" \
        "--data ." "--data /dev/null" "--temp 0" "--resume --ckpt nothing.ckpt" "--ckpt no/such/dir/c.ckpt" "--data abc.txt --resume --ckpt a.ckpt"; do
        (cd "$d" && ./char_lm $args --steps 2 --sample 0 >/dev/null 2>"$tmp/err"; echo $? >"$tmp/rc")
        if [ "$(cat "$tmp/rc")" != 0 ] && [ "$(wc -l <"$tmp/err")" = 1 ] && grep -q '^char_lm: ' "$tmp/err"; then
            ok "demo: $args -> $(cat "$tmp/err")"
        else
            cp "$tmp/err" "$tmp/out"; bad "demo: $args must print one error line and exit non-zero (exit $(cat "$tmp/rc"))"
        fi
    done
    demo_checkpoints "$d"
}

# the demo never loses a checkpoint (issue 39): a fresh run over one refuses to start and leaves it as it was;
# --overwrite replaces it; a --ckpt that is a directory or cannot be written fails before the first step; the
# default path is the program's own + .ckpt, so `build/char_lm --resume` continues what `make demo` wrote; a
# checkpoint of another text (the same alphabet, or another) says so; a --data that is not text warns and its
# sample writes no control byte
demo_checkpoints() {
    local d=$1 before after out
    before=$(cat "$d"/a.ckpt "$d"/a.ckpt.g*.r0 | cksum)
    (cd "$d" && ./char_lm --steps 40 --batch 64 --sample 0 --ckpt a.ckpt) >"$tmp/out" 2>&1
    rc=$?
    after=$(cat "$d"/a.ckpt "$d"/a.ckpt.g*.r0 | cksum)
    if [ $rc != 0 ] && grep -q "^char_lm: a checkpoint exists at 'a.ckpt'.*--resume.*--overwrite" "$tmp/out" &&
        ! grep -q '^step\|^trained' "$tmp/out" && [ "$before" = "$after" ]; then
        ok "demo: a fresh run over a checkpoint refuses before the first step; the checkpoint is unchanged"
    else
        bad "demo: a fresh run over a checkpoint must refuse and leave it as it was (exit $rc)"
    fi
    (cd "$d" && ./char_lm --steps 3 --batch 64 --sample 0 --ckpt a.ckpt --overwrite) >"$tmp/out" 2>&1
    if [ $? = 0 ] && grep -q '^trained steps 1\.\.3 ' "$tmp/out" && ! cmp -s <(cat "$d"/a.ckpt "$d"/a.ckpt.g*.r0) <(:) &&
        [ "$(cat "$d"/a.ckpt "$d"/a.ckpt.g*.r0 | cksum)" != "$before" ]; then
        ok "demo: --overwrite starts afresh over a checkpoint"
    else
        bad "demo: --overwrite must replace the checkpoint"
    fi
    mkdir -p "$d/ckdir"
    for args in "--ckpt ckdir" "--ckpt ckdir/" "--ckpt /proc/dpar-test.ckpt" "--resume --overwrite --ckpt a.ckpt"; do
        (cd "$d" && timeout 60 ./char_lm $args --sample 0) >"$tmp/out" 2>&1
        rc=$?
        if [ $rc != 0 ] && [ $rc != 124 ] && [ "$(wc -l <"$tmp/out")" = 1 ] && grep -q '^char_lm: ' "$tmp/out"; then
            ok "demo: $args fails before the first step: $(cat "$tmp/out")"
        else
            bad "demo: $args must fail before training with one line (exit $rc)"
        fi
    done
    # the default path: build/char_lm writes build/char_lm.ckpt, which a plain build/char_lm --resume continues
    mkdir -p "$d/build" && cp "$d/char_lm" "$d/build/char_lm"
    (cd "$d" && build/char_lm --steps 3 --batch 64 --sample 0 && build/char_lm --steps 5 --batch 64 --sample 0 --resume) \
        >"$tmp/out" 2>&1
    if [ $? = 0 ] && [ -e "$d/build/char_lm.ckpt" ] && grep -q '^trained steps 4\.\.5 .*checkpoint build/char_lm.ckpt$' "$tmp/out"; then
        ok "demo: the default checkpoint is build/char_lm.ckpt for build/char_lm, and --resume finds it"
    else
        bad "demo: build/char_lm --resume must continue build/char_lm.ckpt"
    fi
    # another text: the same alphabet (the lines reversed) and another alphabet
    tac "$d/data/fables.txt" >"$d/rev.txt"
    for data in rev.txt abc.txt; do
        (cd "$d" && ./char_lm --data $data --resume --ckpt a.ckpt --steps 9 --sample 0) >"$tmp/out" 2>&1
        rc=$?
        if [ $rc != 0 ] && [ "$(wc -l <"$tmp/out")" = 1 ] && grep -q "was trained on another text" "$tmp/out"; then
            ok "demo: --resume on $data: $(cat "$tmp/out")"
        else
            bad "demo: --resume on another text ($data) must say so (exit $rc)"
        fi
    done
    # not text: random bytes; the warning on stderr, and no control byte but newlines in what the sample printed
    head -c 4000 /dev/urandom >"$d/rnd.bin"
    (cd "$d" && ./char_lm --data rnd.bin --steps 3 --batch 64 --sample 300 --ckpt rnd.ckpt) >"$tmp/out" 2>"$tmp/err"
    rc=$?
    out=$(sed -n '/^sample (/,$p' "$tmp/out" | LC_ALL=C tr -d '\n\40-\176' | wc -c)
    if [ $rc = 0 ] && grep -q "does not look like text" "$tmp/err" && grep -q '\\x' "$tmp/out" && [ "$out" = 0 ]; then
        ok "demo: random bytes as --data: a warning, and the sample shows odd bytes as \\xNN"
    else
        cat "$tmp/err" >>"$tmp/out"; bad "demo: random bytes as --data (exit $rc, $out raw bytes outside printable ASCII)"
    fi
}

# examples/data_parallel.c on IDX files (the MNIST format) that this test writes: 256 images of 8 x 8
# bytes, the label a function of the pixels, so that the loss can fall; and a truncated file, which
# must give a clear error, not a crash.
idx_example() {
    local d="$tmp/idx"
    rm -rf "$d" && mkdir -p "$d"
    if ! command -v perl >/dev/null; then skip "example data_parallel.c on IDX files" "perl (which writes the files) is not installed"; return; fi
    perl -e 'srand(5); open(I, ">", $ARGV[0]); open(L, ">", $ARGV[1]); binmode I; binmode L;
        print I pack("N4", 0x803, 256, 8, 8); print L pack("N2", 0x801, 256);
        for (1..256) { my @p = map { int rand 256 } 1..64; print I pack("C*", @p); print L pack("C", int($p[0] * 10 / 256)); }' \
        "$d/images" "$d/labels"
    head -c 1000 "$d/images" >"$d/short"
    step "example data_parallel.c on IDX files: the loss falls" sh -c "cc -std=c99 -O2 -I. examples/data_parallel.c -o '$d/dp' -pthread -lm &&
        '$d/dp' --images '$d/images' --labels '$d/labels' --layers 64,32,10 --batch 32 --steps 60 --lr 0.1 > '$d/out' 2>&1; rc=\$?; cat '$d/out';
        [ \$rc = 0 ] && grep -q 'samples ($d/images)' '$d/out' && grep -Eq '^loss .*: falls' '$d/out'"
    step "example data_parallel.c on a truncated IDX file: one clear error" sh -c "'$d/dp' --images '$d/short' --labels '$d/labels' --layers 64,32,10 > '$d/out' 2>&1; rc=\$?; cat '$d/out';
        [ \$rc != 0 ] && grep -q 'truncated' '$d/out'"
}

# program NAME COMMAND...: a test program; its own summary line is added to the total
program() {
    local name=$1 rc summary p f s
    shift
    timeout "${DPAR_TEST_TIMEOUT:-900}" "$@" >"$tmp/out" 2>&1
    rc=$?
    [ "${V:-0}" = 1 ] && cat "$tmp/out"
    summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$tmp/out" | tail -1)
    if [ -z "$summary" ]; then
        echo "    (exit status $rc, no summary line: crashed or timed out)"
        bad "$name"
        return
    fi
    p=$(echo "$summary" | sed -E 's/^([0-9]+) passed.*/\1/')
    f=$(echo "$summary" | sed -E 's/^[0-9]+ passed, ([0-9]+) failed.*/\1/')
    s=$(echo "$summary" | sed -nE 's/.*, ([0-9]+) skipped.*/\1/p')
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + ${s:-0}))
    [ "${V:-0}" = 1 ] || grep -E '^(FAIL|skip) |^    ' "$tmp/out" | head -60
    if [ "$f" = 0 ] && [ $rc != 0 ]; then
        failed=$((failed + 1))
        echo "FAIL $name: exit status $rc after a clean summary"
        tail -20 "$tmp/out" | sed 's/^/    /'
    fi
    echo "     $name: $summary"
}

# the MPI tests: 2, 3 and 4 processes, 2 processes x 2 threads, and a run at MPI_THREAD_FUNNELED
mpi_tests() {
    local flags="--oversubscribe" np
    if [ -n "${NO_MPI_REASON:-}" ]; then skip "MPI tests" "$NO_MPI_REASON"; return; fi
    if [ -z "${MPIRUN:-}" ] || [ -z "${MPITEST:-}" ]; then skip "MPI tests" "mpicc or mpirun not found"; return; fi
    [ "$(id -u)" = 0 ] && flags="$flags --allow-run-as-root"
    for np in 2 3 4; do program "mpirun -np $np $MPITEST" "$MPIRUN" $flags -np $np "$MPITEST"; done
    for np in 2 4; do program "mpirun -np $np $MPITEST --hybrid 2" "$MPIRUN" $flags -np $np "$MPITEST" --hybrid 2; done
    program "mpirun -np 2 $MPITEST --funneled" "$MPIRUN" $flags -np 2 "$MPITEST" --funneled
    [ -n "${MPIASAN:-}" ] && return # those below build plain programs: make test runs them, make check has no more to see
    mpi_elastic "$flags"
    guide_mpi "$flags"
    moe_mpi "$flags"
}

# examples/moe.c built with -DDPAR_MPI: 2 and 4 processes (k = 1 and 2, tokens dropped) end with the bits of the one-rank
# run each process makes itself, and a wrong count fails every process with DPAR_EMISMATCH naming both ranks
moe_mpi() {
    local flags=$1 d
    if [ -z "${MPICC:-}" ]; then skip "examples/moe.c over MPI" "mpicc not found"; return; fi
    d=$(mktemp -d)
    step "examples/moe.c over MPI: 2 and 4 processes bitwise equal to 1 rank (k = 1 and 2, capacity 0.75); --wrong-count caught" sh -c "
        $MPICC -std=c99 -O2 -DDPAR_MPI -I. examples/moe.c -o $d/moe_mpi -pthread -lm && for np in 2 4; do for k in 1 2; do
        $MPIRUN $flags -np \$np $d/moe_mpi --k \$k --capacity 0.75 --steps 60 > $d/o.txt || { cat $d/o.txt; exit 1; }; cat $d/o.txt;
        grep -Eq \"^moe ranks=\$np \\(MPI processes\\) experts=4 k=\$k .*dropped=[1-9].* bitwise equal to 1 rank: yes\$\" $d/o.txt || exit 1; done; done;
        $MPIRUN $flags -np 2 $d/moe_mpi --wrong-count > $d/w.txt 2>&1; rc=\$?; cat $d/w.txt; [ \$rc != 0 ] &&
        grep -Eq 'DPAR_EMISMATCH\\) on every process: rank 1 sends [0-9]+ elements to rank 0 in alltoallv .* but rank 0 expects [0-9]+ from rank 1 ' $d/w.txt"
    rm -rf "$d"
}

# lesson 13 (examples/guide/13_porting.c) built with -DDPAR_MPI: 1, 2 and 4 processes in the deterministic mode must
# end with the bits of the thread ranks (the crc32 the threads build prints), each process checking itself too
guide_mpi() {
    local flags=$1 d
    if [ -z "${MPICC:-}" ]; then skip "lesson 13 over MPI" "mpicc not found"; return; fi
    d=$(mktemp -d)
    step "lesson 13 over MPI: 13_porting built with -DDPAR_MPI on 1, 2 and 4 processes ends with the thread ranks' bits" sh -c "
        cc -std=c99 -O2 -I. examples/guide/13_porting.c -o $d/t -pthread -lm && $MPICC -std=c99 -O2 -DDPAR_MPI -I. \
        examples/guide/13_porting.c -o $d/m -lm && crc=\$($d/t | sed -n 's/.*same bits (crc32 \\([0-9a-f]*\\)).*/\\1/p') &&
        echo \"thread ranks: crc32 \$crc\" && [ -n \"\$crc\" ] && for np in 1 2 4; do $MPIRUN $flags -np \$np $d/m > $d/o.txt || exit 1;
        cat $d/o.txt; [ \$(grep -c \"crc32 \$crc: bit for bit\" $d/o.txt) = \$np ] || exit 1; done"
    rm -rf "$d"
}

# an elastic restart across processes (examples/mpi_data_parallel.c): saved by 3, resumed by 2, it must end as the
# run of 3 that never stopped, within float rounding (each rank's gradient sums its share of the batch)
mpi_elastic() {
    local flags=$1 d
    if [ -z "${MPICC:-}" ]; then skip "elastic restart over MPI" "mpicc not found"; return; fi
    d=$(mktemp -d)
    step "elastic restart over MPI: mpi_data_parallel saved with -np 3 at step 25, resumed with -np 2, ends as the run that never stopped" sh -c "
        $MPICC -std=c99 -O2 -I. examples/mpi_data_parallel.c -o $d/mdp -lm &&
        $MPIRUN $flags -np 3 $d/mdp --steps 60 > $d/a.txt &&
        $MPIRUN $flags -np 3 $d/mdp --steps 60 --stop-at 25 --save $d/r.ckpt > $d/b.txt &&
        $MPIRUN $flags -np 2 $d/mdp --steps 60 --resume $d/r.ckpt > $d/c.txt && cat $d/a.txt $d/b.txt $d/c.txt &&
        grep -q 'resumed from .* at step 25 on 2 processes (epoch 0, 6000 of its samples consumed)' $d/c.txt &&
        a=\$(sed -n 's/.*final_loss=\\([0-9.]*\\).*weights_sum=\\([-0-9.]*\\).*/\\1 \\2/p' $d/a.txt) &&
        c=\$(sed -n 's/.*final_loss=\\([0-9.]*\\).*weights_sum=\\([-0-9.]*\\).*/\\1 \\2/p' $d/c.txt) &&
        echo \"uninterrupted \$a, resumed \$c\" && [ -n \"\$a\" ] && [ -n \"\$c\" ] &&
        echo \"\$a \$c\" | awk '{ d = \$1 - \$3; e = \$2 - \$4; exit !(d * d < 1e-10 && e * e < 1e-8) }'"
    rm -rf "$d"
}

mpi_compile() {
    local inc
    if [ -z "${MPICC:-}" ]; then skip "compile dpar.h with DPAR_MPI" "mpicc not found"; return; fi
    printf '#define DPAR_MPI\n#define DPAR_IMPLEMENTATION\n#include "dpar.h"\nint main(void) { return 0; }\n' >"$M/mpi.c"
    cp "$M/mpi.c" "$M/mpi.cc"
    step "compile dpar.h with DPAR_MPI: mpicc -std=c99" "$MPICC" -std=c99 $WARN -I. "$M/mpi.c" -o $M/mpi_c99 -pthread -lm
    step "compile dpar.h with DPAR_MPI: mpicc -std=c11 -O3" "$MPICC" -std=c11 -O3 $WARN -I. "$M/mpi.c" -o $M/mpi_c11 -pthread -lm
    step "compile dpar.h with DPAR_MPI as C++ (mpicxx -std=c++11)" mpicxx -std=c++11 $WARN -DOMPI_SKIP_MPICXX \
        -DMPICH_SKIP_MPICXX -I. "$M/mpi.cc" -o $M/mpi_cxx -pthread -lm
    inc=$(ls -d /usr/include/x86_64-linux-gnu/mpich /usr/include/mpich 2>/dev/null | head -1)
    if [ -n "$inc" ] && [ -f "$inc/mpi.h" ]; then
        step "compile dpar.h with DPAR_MPI against MPICH's mpi.h" gcc -std=c99 $WARN -I. -I"$inc" -c "$M/mpi.c" -o $M/mpich.o
        if command -v mpicc.mpich >/dev/null; then
            step "build with MPICH: mpicc.mpich -std=c99" mpicc.mpich -std=c99 $WARN -I. "$M/mpi.c" -o $M/mpich -pthread -lm
        fi
    else
        skip "compile dpar.h against MPICH" "MPICH's mpi.h is not installed (apt-get install libmpich-dev)"
    fi
}

# kill tests (tests/kill.sh): the demo trainer and examples/data_parallel.c (checkpoints every 10 steps) killed
# with SIGKILL 20 times each, at random moments and in the middle of checkpoint writes; every newest checkpoint must
# load and every resumed run end bitwise as one never killed; one MPI
# process of 4 killed: the others report it within the timeout
kill_tests() {
    step "kill tests: tests/kill.sh 20 (make stress: 200)" env BUILD="$BUILD" MPICC="${MPICC:-}" MPIRUN="${MPIRUN:-}" tests/kill.sh 20
    grep '^kill.sh: ' "$tmp/out" | sed 's/^/     /'
}

# examples/data_parallel.c on 1 rank against 2 and 4: the same batches give the same losses (to the 4 printed
# decimals, 12 steps). Not bit for bit on its fast path: each rank's weight-gradient GEMM sums its own part of the
# batch, so the additions happen in another order than one GEMM over the whole batch. Its --bitwise-check mode
# cuts the batch into 4 fixed leaves (a GEMM each) joined by dpar_tree_reduce and the deterministic allreduce:
# there 1, 2 and 4 ranks must give the same bits, which the program compares (exit 1 when they differ).
dp_ranks() {
    local d="$tmp/dpr"
    rm -rf "$d" && mkdir -p "$d"
    step "example data_parallel.c: 2 and 4 ranks train as 1 does (the losses of 12 steps, 4 decimals)" sh -c "
        cc -std=c99 -O2 -I. examples/data_parallel.c -o '$d/dp' -pthread -lm &&
        for t in 1 2 4; do '$d/dp' --threads \$t --batch 64 --steps 12 | grep '^step' > '$d/'\$t.txt || exit 1; done &&
        cat '$d/1.txt' && [ \$(wc -l < '$d/1.txt') = 7 ] && cmp '$d/1.txt' '$d/2.txt' && cmp '$d/1.txt' '$d/4.txt'"
    # bit for bit in the deterministic mode (4 leaves, dpar_tree_reduce): the program compares the weights itself
    step "example data_parallel.c --bitwise-check: 1, 2 and 4 ranks end with the same weights, bit for bit" sh -c "
        '$d/dp' --bitwise-check --layers 784,256,256,10 --batch 64 --steps 12 > '$d/bits.txt'; rc=\$?; cat '$d/bits.txt';
        [ \$rc = 0 ] && grep -q '^bitwise equal: 1, 2 and 4 ranks' '$d/bits.txt'"
}

# examples/tensor_parallel.c --bitwise: with 4 leaves per layer the whole block and tp = 2 and 4 train to the same
# bits (every step's loss, every weight, the input gradient; the program compares them and exits 1 otherwise)
tp_bitwise() {
    local d="$tmp/tpb"
    rm -rf "$d" && mkdir -p "$d"
    step "example tensor_parallel.c --bitwise: the whole block, tp = 2 and tp = 4 train to the same bits (4 leaves)" sh -c "
        cc -std=c99 -O2 -I. examples/tensor_parallel.c -o '$d/tp' -pthread -lm &&
        DPAR_TEST_QUICK=1 '$d/tp' --bitwise > '$d/out.txt'; rc=\$?; cat '$d/out.txt'; [ \$rc = 0 ] &&
        [ \$(grep -c 'against the whole block: losses of 100 steps bitwise equal, trained weights bitwise equal, input gradient bitwise equal\$' '$d/out.txt') = 2 ] &&
        grep -q '^tensor_parallel --bitwise: the whole block, tp=2 and tp=4 train to the same bits: OK' '$d/out.txt'"
}

# examples/hybrid.c --bitwise: the 7 dp x tp x pp layouts of 8 ranks and one thread train to the same bits (8 batch
# leaves, layers with 8 leaves, the deterministic allreduce); --zero 3: ZeRO-3 over the dp comm of the 2 x 2 x 2 mesh,
# gathered per step and per micro-batch, the same bits as one thread, and what each gather moves (the program compares
# the weights and every step's loss with memcmp and exits 1 otherwise)
hybrid_layouts() {
    local d="$tmp/hyb"
    rm -rf "$d" && mkdir -p "$d"
    step "example hybrid.c --bitwise: 7 layouts dp x tp x pp of 8 ranks and one thread end with the same bits" sh -c "
        cc -std=c99 -O2 -I. examples/hybrid.c -o '$d/hy' -pthread -lm &&
        DPAR_TEST_QUICK=1 '$d/hy' --bitwise > '$d/bits.txt'; rc=\$?; cat '$d/bits.txt'; [ \$rc = 0 ] &&
        [ \$(grep -c '^hybrid --bitwise: dp=[1248] tp=[1248] pp=[12], .*weights bitwise equal, losses of 60 steps bitwise equal, replicas identical; per step [0-9]* us\$' '$d/bits.txt') = 7 ] &&
        grep -q '^hybrid --bitwise: 7 runs of 8 ranks against one thread: the same bits, OK\$' '$d/bits.txt'"
    step "example hybrid.c --zero 3: fsdp units over the dp comm, gathered per step and per micro-batch, bitwise one thread's" sh -c "
        DPAR_TEST_QUICK=1 '$d/hy' --zero 3 > '$d/z3.txt'; rc=\$?; cat '$d/z3.txt'; [ \$rc = 0 ] &&
        grep -q '^hybrid --zero 3: dp=2 tp=2 pp=2 gather=step, .*bitwise equal.*bitwise equal.*identical; per step [0-9]* us, per rank 1088 bytes gathered, 1088 reduced\$' '$d/z3.txt' &&
        grep -q '^hybrid --zero 3: dp=2 tp=2 pp=2 gather=micro, .*bitwise equal.*bitwise equal.*identical; per step [0-9]* us, per rank 8704 bytes gathered, 1088 reduced\$' '$d/z3.txt' &&
        grep -q '^hybrid --zero 3: 2 runs of 8 ranks against one thread: the same bits, OK\$' '$d/z3.txt' &&
        DPAR_TEST_QUICK=1 '$d/hy' --bitwise --zero 3 --gather micro | tail -n 1 | grep '^hybrid --zero 3: 7 runs of 8 ranks against one thread: the same bits, OK\$'"
}

# --trace of the two examples of issue 37: valid Chrome trace JSON, with their own spans beside dpar's (ring attention's
# blocks and hops; the MoE layer's dispatch and combine)
strategy_traces() {
    local d="$tmp/traces"
    rm -rf "$d" && mkdir -p "$d"
    step "examples context_parallel.c and moe.c --trace: Chrome traces with the blocks, the hops, dispatch and combine" sh -c "
        cc -std=c99 -O2 -I. examples/context_parallel.c -o '$d/cp' -pthread -lm &&
        cc -std=c99 -O2 -I. examples/moe.c -o '$d/moe' -pthread -lm &&
        '$d/cp' --mode both --cp 2 --steps 4 --trace '$d/cp.json' | tail -n 1 &&
        '$d/moe' --ranks 2 --trace '$d/moe.json' | tail -n 1 &&
        python3 -c \"
import json, sys
cp = [e.get('name', '') for e in json.load(open('$d/cp.json'))['traceEvents']]
moe = [e.get('name', '') for e in json.load(open('$d/moe.json'))['traceEvents']]
counts = (sum(n.startswith('block forward') for n in cp), sum(n.startswith('block backward') for n in cp),
          cp.count('send'), sum(n.startswith('attention forward') for n in cp), sum('dispatch' in n for n in moe),
          sum('combine' in n for n in moe))
print('cp: block forward %d, block backward %d, send %d, Ulysses attention %d; moe: dispatch %d, combine %d' % counts)
sys.exit(0 if min(counts) > 0 else 1)
\""
}

# examples/pipeline.c --schedule zb-h1: the split backward (B, then W later) trains the same bits as sequential
# training, on 4 and on 2 stages (the program compares every parameter and exits 1 otherwise)
zero_bubble() {
    local d="$tmp/zb"
    rm -rf "$d" && mkdir -p "$d"
    step "example pipeline.c --schedule zb-h1: B and W apart, p = 4 and 2, parameters bitwise those of sequential training" sh -c "
        cc -std=c99 -O2 -I. examples/pipeline.c -o '$d/pl' -pthread -lm &&
        DPAR_TEST_QUICK=1 '$d/pl' --schedule zb-h1 > '$d/4.txt' && grep 'W0' '$d/4.txt' | head -n 1 &&
        grep -q '^ZB-H1, p=4 stages, m=8 micro-batches: predicted bubble 0.111' '$d/4.txt' &&
        grep -q '^pipeline: ZB-H1 p=4 m=8 matches sequential training.*bitwise equal, OK' '$d/4.txt' &&
        DPAR_TEST_QUICK=1 '$d/pl' --schedule zb-h1 --stages 2 --micro 16 | grep '^pipeline: ZB-H1 p=2 m=16 matches.*bitwise equal, OK'"
}

# examples/pipeline.c --schedule zbv and dualpipev: two chunks per stage placed as a V (the turn a local hand-off on
# the last stage, the loss on stage 0), the bubble at the bound (p-1)/(6m+p-1) = 3/51 for p = 4, m = 8, and the
# same bits as sequential training on 4, 3 and 2 stages
v_schedules() {
    local d="$tmp/v"
    rm -rf "$d" && mkdir -p "$d"
    step "example pipeline.c --schedule zbv and dualpipev: a V of 2 chunks per stage, bubble 3/51, parameters bitwise those of sequential training" sh -c "
        cc -std=c99 -O2 -I. examples/pipeline.c -o '$d/pl' -pthread -lm &&
        DPAR_TEST_QUICK=1 '$d/pl' --schedule zbv > '$d/zbv.txt' && grep 'F0b' '$d/zbv.txt' | head -n 1 &&
        grep -q '^ZB-V, p=4 stages, m=8 micro-batches, v=2 chunks: predicted bubble 0.059, peak stash 8 8 8 8' '$d/zbv.txt' &&
        grep -q '^bubble with the op costs measured here (mean per op: F [0-9.]* ms, B [0-9.]* ms, W [0-9.]* ms): predicted 0\.[0-9]*\$' '$d/zbv.txt' &&
        grep -q '^pipeline: ZB-V p=4 m=8 matches sequential training.*bitwise equal, OK' '$d/zbv.txt' &&
        DPAR_TEST_QUICK=1 '$d/pl' --schedule dualpipev > '$d/dpv.txt' &&
        grep -q '^DualPipeV, p=4 stages, m=8 micro-batches, v=2 chunks: predicted bubble 0.059, peak stash 9 9 9 9' '$d/dpv.txt' &&
        grep -q '^pipeline: DualPipeV p=4 m=8 matches sequential training.*bitwise equal, OK' '$d/dpv.txt' &&
        DPAR_TEST_QUICK=1 '$d/pl' --schedule zbv --stages 3 --micro 16 | grep '^pipeline: ZB-V p=3 m=16 matches.*bitwise equal, OK' &&
        DPAR_TEST_QUICK=1 '$d/pl' --schedule dualpipev --stages 2 --micro 4 | grep '^pipeline: DualPipeV p=2 m=4 matches.*bitwise equal, OK' &&
        ! '$d/pl' --schedule zbv --stages 5 2> '$d/err.txt' && grep -q 'a V schedule cuts the 8 layers into 2p pieces' '$d/err.txt'"
}

NO_MPI_REASON=
if [ "${1:-}" = "--no-mpi-reason" ]; then
    NO_MPI_REASON=$2
    shift 2
fi
if [ "${1:-}" = "--matrix" ]; then
    shift
    matrix
    mpi_compile
    examples
    lessons_shown
    step "docs: C snippets are complete programs that build and run, or cut from programs the tests build (tests/snippets.sh)" tests/snippets.sh
    idx_example
    demo
    dp_ranks
    zero_bubble
    v_schedules
    tp_bitwise
    hybrid_layouts
    strategy_traces
    kill_tests
fi
for bin in "$@"; do program "$bin" "$bin"; done
if [ -n "${MPITEST:-}" ] && [ -n "${MPIASAN:-}" ]; then export ASAN_OPTIONS=detect_leaks=0; fi
mpi_tests

if [ $skipped -gt 0 ]; then
    echo "$passed passed, $failed failed, $skipped skipped"
else
    echo "$passed passed, $failed failed"
fi
[ $failed = 0 ]
