#!/usr/bin/env bash
# tests/gpu.sh - everything GPU: build every .cu program (tests, examples, benchmarks) with nvcc for
# sm_90 (+ compute_90 PTX) with host warnings as errors, read every kernel's resource use, run the
# host-side kernel test; then, where a CUDA device is usable, run the device tests under
# compute-sanitizer (memcheck, racecheck) when it is installed, the GPU examples and the benchmarks.
#   tests/gpu.sh            build, then run what this machine can
#   tests/gpu.sh --build    the build part only (what make test runs where there is no GPU)
# Ends with `N passed, N failed[, N skipped]` like tests/run.sh. Environment: NVCC, BUILD, CUDA_ARCH.
set -u
cd "$(dirname "$0")/.." || exit 2
NVCC=${NVCC:-$(command -v nvcc || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })}
BUILD=${BUILD:-build}
ARCH=${CUDA_ARCH:-90}
mode=${1:-all}
passed=0 failed=0 skipped=0
ok()   { passed=$((passed + 1)); echo "ok   $1"; }
bad()  { failed=$((failed + 1)); echo "FAIL $1"; sed 's/^/    /' "$BUILD/gpu/out" | tail -30; }
skip() { skipped=$((skipped + 1)); echo "skip $1: skipped: $2"; }
step() { local name=$1; shift; if "$@" >"$BUILD/gpu/out" 2>&1; then ok "$name"; else bad "$name"; fi; }
summary() {
    if [ $skipped -gt 0 ]; then echo "$passed passed, $failed failed, $skipped skipped"; else echo "$passed passed, $failed failed"; fi
    [ $failed -eq 0 ]
}
mkdir -p "$BUILD/gpu"
if [ -z "$NVCC" ]; then skip "gpu" "nvcc not found"; summary; exit; fi
CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
NV="$NVCC -std=c++14 -O2 -gencode arch=compute_$ARCH,code=[sm_$ARCH,compute_$ARCH] -Xcompiler -Wall,-Wextra,-Werror -I. -Itests"
LIBS="-lcublas"

# ---- build (no GPU needed) ----
for f in tests/*.cu examples/*.cu examples/guide/*.cu bench/*.cu; do
    [ -f "$f" ] || continue
    case "$f" in tests/compile_cuda.cu) continue ;; esac
    name=$(basename "$f" .cu)
    step "nvcc sm_$ARCH: $f" sh -c "$NV $f -o $BUILD/gpu/$name $LIBS"
done
# the NCCL comm (DPAR_NCCL): the test program, the trainer and the benchmark once more with it
NCCL_H=$(ls "$CUDA_HOME/include/nccl.h" /usr/include/nccl.h 2>/dev/null | head -n 1)
if [ -n "$NCCL_H" ]; then
    for f in tests/test_cuda.cu examples/cuda_data_parallel.cu bench/bench_cuda.cu; do
        [ -f "$f" ] || continue
        step "nvcc sm_$ARCH -DDPAR_NCCL: $f" sh -c "$NV -DDPAR_NCCL $f -o $BUILD/gpu/$(basename "$f" .cu)_nccl $LIBS -lnccl"
    done
else
    skip "DPAR_NCCL builds" "nccl.h not found"
fi
step "kernels: no register spills, no local memory (ptxas, sm_$ARCH)" tests/cuda_resources.sh
# dpar_cuda.h's declarations from plain C99 and C++, linked against the nvcc-built implementation
step "dpar_cuda.h from C99 and C++, linked with the nvcc-built implementation" sh -c "
    $NV -c tests/compile_cuda.cu -o $BUILD/gpu/impl.o &&
    gcc -std=c99 -Wall -Wextra -Wpedantic -Werror -I. -c tests/compile_cuda_c.c -o $BUILD/gpu/user_c.o &&
    g++ -std=c++11 -Wall -Wextra -Wpedantic -Werror -I. -x c++ -c tests/compile_cuda_c.c -o $BUILD/gpu/user_cpp.o &&
    $NVCC -o $BUILD/gpu/linked tests/compile_cuda_main.c $BUILD/gpu/impl.o $BUILD/gpu/user_c.o $LIBS &&
    $BUILD/gpu/linked"
if [ -x "$BUILD/gpu/test_cuda_host" ]; then
    step "kernels' element functions on the host against the references (simulated grids)" "$BUILD/gpu/test_cuda_host"
fi
if [ "$mode" = --build ]; then summary; exit; fi

# ---- run (a usable device) ----
if [ -x "$BUILD/gpu/test_cuda" ]; then
    "$BUILD/gpu/test_cuda" >"$BUILD/gpu/out" 2>&1
    rc=$?
    if grep -q 'skipped: no usable CUDA device' "$BUILD/gpu/out"; then
        if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
            bad "test_cuda: nvidia-smi lists a GPU but CUDA has no usable device"
            summary
            exit
        fi
        skip "GPU runs" "$(grep -m1 -o 'no usable CUDA device.*' "$BUILD/gpu/out")"
        summary; exit
    fi
    if [ $rc -eq 0 ]; then ok "test_cuda on the device"; else bad "test_cuda on the device"; fi
    if [ -x "$BUILD/gpu/test_cuda_nccl" ]; then step "test_cuda_nccl (DPAR_NCCL) on the device" "$BUILD/gpu/test_cuda_nccl"; fi
    if [ -x "$CUDA_HOME/bin/compute-sanitizer" ]; then
        # --report-api-errors no: test_cuda makes one bad launch on purpose (the pool's error path)
        for tool in memcheck racecheck; do
            if "$CUDA_HOME/bin/compute-sanitizer" --tool "$tool" --report-api-errors no --error-exitcode 1 \
                "$BUILD/gpu/test_cuda" >"$BUILD/gpu/out" 2>&1; then
                ok "compute-sanitizer --tool $tool test_cuda"
            elif grep -q 'Device not supported' "$BUILD/gpu/out"; then
                skip "compute-sanitizer --tool $tool" "$(grep -m1 'Device not supported' "$BUILD/gpu/out")"
            else
                bad "compute-sanitizer --tool $tool test_cuda"
            fi
        done
    else
        skip "compute-sanitizer" "not installed with this toolkit"
    fi
fi
for f in examples/*.cu examples/guide/*.cu bench/*.cu; do
    [ -f "$f" ] || continue
    for name in "$(basename "$f" .cu)" "$(basename "$f" .cu)_nccl"; do
        [ -x "$BUILD/gpu/$name" ] || continue
        step "run $name" "$BUILD/gpu/$name"
        cat "$BUILD/gpu/out" | grep '^bench=\|^train' || true
    done
done
summary
