#!/usr/bin/env bash
# tests/run.sh - runs dpar's checks and ends with one total line: `N passed, N failed[, N skipped]`.
#
#   tests/run.sh [--matrix] [TEST_PROGRAM...]
#
# --matrix first runs the compile matrix (dpar.h under gcc and clang, C99 and C11, as C++, twice
# linked, DPAR_STATIC, dpar_cuda.h through nvcc) and builds and runs every example with the exact
# Build:/Run: commands of its first comment. Then each test program runs (under `timeout`); its own
# `N passed, N failed[, N skipped]` line is added to the total. A program that crashes or hangs
# counts as one failure. Environment: BUILD, NVCC, MPICC, MPIRUN, OPENBLAS (set by the Makefile);
# V=1 prints every program's whole output.
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

matrix() {
    local cc std cxx
    for cc in gcc clang; do
        if ! command -v $cc >/dev/null; then skip "compile $cc" "$cc is not installed"; continue; fi
        for std in c99 c11; do
            step "compile dpar.h: $cc -std=$std, two units linked" \
                sh -c "$cc -std=$std $WARN -I. tests/compile_impl.c tests/compile_user.c -o $M/link_${cc}_$std -pthread && $M/link_${cc}_$std"
        done
    done
    for cxx in g++ clang++; do
        if ! command -v $cxx >/dev/null; then skip "compile $cxx" "$cxx is not installed"; continue; fi
        step "compile dpar.h as C++: $cxx -std=c++11, two units linked" \
            sh -c "$cxx -std=c++11 $WARN -I. -x c++ tests/compile_impl.c -x c++ tests/compile_user.c -o $M/link_$cxx -pthread && $M/link_$cxx"
    done
    step "compile dpar.h: DPAR_STATIC in two units of one program" \
        sh -c "gcc -std=c99 $WARN -I. tests/compile_static_a.c tests/compile_static_b.c -o $M/static -pthread && $M/static"
    step "compile dpar.h: DPAR_NO_FUTEX" gcc -std=c99 $WARN -I. -c tests/compile_impl.c -DDPAR_NO_FUTEX -o $M/nofutex.o
    step "compile dpar.h: gcc -O3 (more warnings surface with more inlining)" gcc -std=c99 -O3 $WARN -I. -c tests/compile_impl.c -o $M/o3.o
    step "compile dpar.h: clang -O3" clang -std=c11 -O3 $WARN -I. -c tests/compile_impl.c -o $M/o3c.o
    if [ -n "${NVCC:-}" ]; then
        step "compile dpar_cuda.h: nvcc -c" "$NVCC" -std=c++14 -I. -c tests/compile_cuda.cu -o $M/cuda.o
        step "compile dpar_cuda.h: plain C sees the declarations" gcc -std=c99 $WARN -I. -c tests/compile_cuda_c.c -o $M/cuda_c.o
        step "build tests/test_cuda.cu with nvcc" "$NVCC" -std=c++14 -I. -Itests tests/test_cuda.cu -o $M/test_cuda
        program $M/test_cuda
    else
        skip "compile dpar_cuda.h" "nvcc not found"
    fi
}

# examples: build and run each with the exact commands of its first comment, in a scratch copy of
# the repository layout, so a pasted command works as written
examples() {
    local f name build run
    for f in examples/*.c examples/*.cu; do
        [ -f "$f" ] || continue
        name=$(basename "$f")
        build=$(head -20 "$f" | sed -n 's/^ *\(\/\*\)\{0,1\} *Build: *//p' | head -1)
        run=$(head -20 "$f" | sed -n 's/^ *Run: *//p' | head -1 | sed 's/  \+(.*//; s/ \{2,\}.*//')
        if [ -z "$build" ] || [ -z "$run" ]; then
            echo "no Build:/Run: line" >"$tmp/out"; bad "example $name"; continue
        fi
        case "$build" in
            mpicc*) if [ -z "${MPICC:-}" ]; then skip "example $name" "MPI not found"; continue; fi ;;
            nvcc*) if [ -z "${NVCC:-}" ]; then skip "example $name" "nvcc not found"; continue; fi ;;
        esac
        rm -rf "$tmp/ex" && mkdir -p "$tmp/ex"
        for p in dpar.h dpar_cuda.h examples data; do [ -e "$p" ] && ln -s "$ROOT/$p" "$tmp/ex/$p"; done
        step "example $name: $build && $run" sh -c "cd '$tmp/ex' && $build && DPAR_TEST_QUICK=1 timeout 300 $run"
    done
}

program() {
    local bin=$1 rc summary p f s
    if [ ! -x "$bin" ]; then echo "missing $bin" >"$tmp/out"; bad "$bin"; return; fi
    timeout "${DPAR_TEST_TIMEOUT:-900}" "$bin" >"$tmp/out" 2>&1
    rc=$?
    [ "${V:-0}" = 1 ] && cat "$tmp/out"
    summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$tmp/out" | tail -1)
    if [ -z "$summary" ]; then
        echo "    (exit status $rc, no summary line: crashed or timed out)"
        bad "$bin"
        return
    fi
    p=$(echo "$summary" | sed -E 's/^([0-9]+) passed.*/\1/')
    f=$(echo "$summary" | sed -E 's/^[0-9]+ passed, ([0-9]+) failed.*/\1/')
    s=$(echo "$summary" | sed -nE 's/.*, ([0-9]+) skipped.*/\1/p')
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + ${s:-0}))
    [ "${V:-0}" = 1 ] || grep -E '^(FAIL|skip) |^    ' "$tmp/out" | head -60
    if [ "$f" = 0 ] && [ $rc != 0 ]; then
        failed=$((failed + 1))
        echo "FAIL $bin: exit status $rc after a clean summary"
        tail -20 "$tmp/out" | sed 's/^/    /'
    fi
    echo "     $bin: $summary"
}

if [ "${1:-}" = "--matrix" ]; then
    shift
    matrix
    examples
fi
for bin in "$@"; do program "$bin"; done

if [ $skipped -gt 0 ]; then
    echo "$passed passed, $failed failed, $skipped skipped"
else
    echo "$passed passed, $failed failed"
fi
[ $failed = 0 ]
