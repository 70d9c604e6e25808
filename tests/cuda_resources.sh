#!/usr/bin/env bash
# tests/cuda_resources.sh - the resource use of every kernel of dpar_cuda.h, read from ptxas as nvcc
# compiles the implementation for sm_90: registers, stack frame (local memory), spill stores and loads.
# Prints one `kernel=NAME registers=R stack=S spill_stores=T spill_loads=L` line per kernel, then
# `kernels=N spills=0 local=0` and exits 0; exits 1 if any kernel spills or uses local memory (a
# stack frame), or if ptxas reports no kernel at all; prints `skipped: nvcc not found` and exits 0
# without nvcc.
#   tests/cuda_resources.sh [FILE.cu]   (default tests/compile_cuda.cu)
# Environment: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc), CUDA_ARCH (default 90).
set -u
cd "$(dirname "$0")/.." || exit 2
NVCC=${NVCC:-$(command -v nvcc || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })}
if [ -z "$NVCC" ]; then echo "skipped: nvcc not found"; exit 0; fi
SRC=${1:-tests/compile_cuda.cu}
ARCH=${CUDA_ARCH:-90}
out=$(mktemp) && trap 'rm -f "$out" "$out.o"' EXIT
if ! "$NVCC" -std=c++14 -O2 -gencode "arch=compute_$ARCH,code=[sm_$ARCH,compute_$ARCH]" -Xptxas -v -I. -Itests \
    -c "$SRC" -o "$out.o" >"$out" 2>&1; then
    echo "cuda_resources: $NVCC failed on $SRC:"; sed 's/^/    /' "$out" | head -20
    exit 1
fi
# ptxas -v: "Compiling entry function 'MANGLED' for 'sm_90'", then "N bytes stack frame, N bytes spill
# stores, N bytes spill loads", then "Used N registers, ..."
awk -v arch="sm_$ARCH" '
    /Compiling entry function/ { name = $0; sub(/.*function .\047?/, "", name); sub(/\047? for .*/, "", name); next }
    /bytes stack frame/ && name != "" { stack = $1; stores = $5; loads = $9; next }
    /Used [0-9]+ registers/ && name != "" {
        regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
        print name, regs, stack + 0, stores + 0, loads + 0; name = ""
    }' "$out" | while read -r mangled regs stack stores loads; do
    printf 'kernel=%s registers=%s stack=%s spill_stores=%s spill_loads=%s\n' \
        "$(echo "$mangled" | c++filt 2>/dev/null | sed 's/^void //; s/ //g; s/(.*//' || echo "$mangled")" "$regs" "$stack" "$stores" "$loads"
done >"$out.tab"
n=$(wc -l <"$out.tab")
bad=$(grep -E ' (stack|spill_stores|spill_loads)=[1-9]' "$out.tab")
cat "$out.tab"
rm -f "$out.tab"
if [ "$n" -eq 0 ]; then echo "cuda_resources: ptxas reported no kernel in $SRC"; exit 1; fi
if [ -n "$bad" ]; then
    echo "cuda_resources: kernels that spill or use local memory (a stack frame):"; echo "$bad" | sed 's/^/    /'
    exit 1
fi
echo "kernels=$n spills=0 local=0"
