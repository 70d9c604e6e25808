#!/usr/bin/env bash
# tests/mutate.sh - mutation testing: each line of tests/mutations.txt plants one bug (a literal replacement of a
# pattern that occurs exactly once in a file) in a scratch copy of the tree, builds the test program named on
# the line and runs it with the test's name as its filter: the mutation must make it fail ("killed"). Prints one
# line per mutation and `N killed, N survived`; exits 1 when any survived or could not be applied.
#   tests/mutate.sh              every mutation
#   tests/mutate.sh WORD         those whose line contains WORD
# Line format (fields separated by ' | '): file | pattern | replacement | program test-filter | why
# \n in pattern and replacement stands for a newline. Environment: CC (default cc). The program test_mpi is built
# with mpicc and run under `mpirun -np 2` (skipped, and said so, without MPI). A program ending in .sh is a
# shell check of tests/ (api.sh) run on the copy as it is, its test-filter (if any) as its arguments. A program
# field `sh COMMAND...` runs the command in the scratch copy instead (an example's own check, tests/kill.sh):
# killed when it exits non-zero.
set -u
cd "$(dirname "$0")/.." || exit 2
CC=${CC:-cc}
filter=${1:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
killed=0 survived=0 broken=0
# judge WHAT COMMAND...: run the command in the scratch copy; the mutation is killed when it fails
judge() {
    what=$1
    shift
    if (cd "$tmp/t" && "$@" </dev/null) >"$tmp/out.txt" 2>&1; then
        survived=$((survived + 1))
        echo "SURVIVED $what: $why"
    else
        killed=$((killed + 1))
        echo "killed   $what: $why"
    fi
}
while IFS= read -r line; do
    case "$line" in '' | '#'*) continue ;; esac
    [ -n "$filter" ] && case "$line" in *"$filter"*) ;; *) continue ;; esac
    rm -rf "$tmp/t" && mkdir -p "$tmp/t" && cp -r dpar.h dpar_cuda.h tests examples docs demo data "$tmp/t/" 2>/dev/null
    if ! python3 - "$tmp/t" "$line" <<'PY'; then
import sys
root, line = sys.argv[1], sys.argv[2]
f, pat, rep = [x.strip() for x in line.split(' | ')[:3]]
pat, rep = pat.replace('\\n', '\n'), rep.replace('\\n', '\n')
p = root + '/' + f
s = open(p).read()
n = s.count(pat)
if n != 1:
    print('    the pattern occurs %d times in %s' % (n, f))
    sys.exit(1)
open(p, 'w').write(s.replace(pat, rep))
PY
        broken=$((broken + 1))
        echo "BROKEN  $line"
        continue
    fi
    prog=$(echo "$line" | awk -F' [|] ' '{print $4}' | awk '{print $1}')
    name=$(echo "$line" | awk -F' [|] ' '{print $4}' | awk '{print $2}')
    why=$(echo "$line" | awk -F' [|] ' '{print $5}')
    if [ "$prog" = sh ]; then # a shell command in the scratch copy
        cmd=$(echo "$line" | awk -F' [|] ' '{print $4}' | sed 's/^ *sh //')
        judge "sh $cmd" env DPAR_TIMEOUT_MS=10000 timeout 300 sh -c "$cmd"
        continue
    fi
    cc=$CC run=
    if [ "${prog%.sh}" != "$prog" ]; then # a shell check: no build
        judge "$prog $name" timeout 300 "tests/$prog" $name
        continue
    fi
    if [ "$prog" = test_mpi ]; then # the MPI tests: built with mpicc, run on 2 processes
        if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
            echo "skipped  $prog $name: mpicc or mpirun not found: $why"
            continue
        fi
        cc=mpicc run="mpirun --oversubscribe -np 2"
        [ "$(id -u)" = 0 ] && run="$run --allow-run-as-root"
    fi
    if ! (cd "$tmp/t" && $cc -std=c99 -O2 -I. -Itests "tests/$prog.c" -o "$tmp/prog" -pthread -lm) >"$tmp/build.txt" 2>&1; then
        killed=$((killed + 1))
        echo "killed   (does not build) $why"
        continue
    fi
    if (cd "$tmp/t" && DPAR_TIMEOUT_MS=10000 timeout 300 $run "$tmp/prog" "$name" </dev/null) >"$tmp/out.txt" 2>&1; then
        survived=$((survived + 1))
        echo "SURVIVED $prog $name: $why"
    else
        killed=$((killed + 1))
        echo "killed   $prog $name: $why"
    fi
done <tests/mutations.txt
echo "$killed killed, $survived survived$([ $broken -gt 0 ] && echo ", $broken not applied")"
[ $survived -eq 0 ] && [ $broken -eq 0 ]
