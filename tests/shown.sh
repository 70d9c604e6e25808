#!/usr/bin/env bash
# tests/shown.sh - what a lesson page shows a program printing is what the program prints (issue 39).
#   tests/shown.sh docs/guide/NN_name.md...
# A shown run is a fenced block (```) of the page whose first line starts with `$ `: its `$ ` lines are commands,
# its other lines what they print. The blocks of a page run in order, in one scratch copy of the repository (dpar.h,
# examples/, data/, tests/ linked; a build/ made by the page's own commands), each command with sh -c, stdout and stderr
# together. Every command must exit 0: a run that fails on purpose is shown as `CMD; echo "exit status $?"`. The
# output must equal the block line for line after one rule for the numbers that vary from run to run (mask below):
# a number after `measured ` and a number before ` ms`, ` us` or ` GB/s` (a time or a rate, with the spaces that pad
# it) become `#`. Every other number is compared, so a stale one fails. Prints each block's verdict (and a diff when
# it differs); exits 1 when any differs.
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
[ $# -gt 0 ] || { echo "usage: tests/shown.sh docs/guide/NN_name.md..." >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mask() { sed -E 's/(measured )[0-9][0-9.e+-]*/\1#/g; s/ *[0-9][0-9.]*( ms| us| GB\/s)/ #\1/g'; }
bad=0
for md in "$@"; do
    rm -rf "$tmp/tree" && mkdir -p "$tmp/tree"
    for p in dpar.h dpar_cuda.h examples data tests; do [ -e "$p" ] && ln -s "$ROOT/$p" "$tmp/tree/$p"; done
    # each shown block into $tmp/block.N (the page's text, fences dropped)
    rm -f "$tmp"/block.*
    awk -v out="$tmp/block" '
        /^```/ && inside { inside = 0; next }
        /^```/ { inside = 1; first = 1; next }
        inside && first { first = 0; if ($0 ~ /^\$ /) { n++; shown = 1 } else shown = 0 }
        inside && shown { print > (out "." n) }' "$md"
    n=0
    for block in $(ls "$tmp"/block.* 2>/dev/null | sort -t. -k2 -n); do
        n=$((n + 1))
        : >"$tmp/got"
        status=0
        while IFS= read -r line; do
            case "$line" in
                '$ '*) echo "$line" >>"$tmp/got"
                       (cd "$tmp/tree" && sh -c "${line#\$ }") >>"$tmp/got" 2>&1 </dev/null || status=$? ;;
            esac
        done <"$block"
        if [ $status != 0 ]; then
            echo "FAIL $md, shown run $n: a command exited $status"; sed 's/^/    /' "$tmp/got" | tail -20; bad=1
        elif ! diff <(mask <"$block") <(mask <"$tmp/got") >"$tmp/diff"; then
            echo "FAIL $md, shown run $n: the program prints otherwise (< the page, > the program, numbers masked)"
            sed 's/^/    /' "$tmp/diff" | head -40; bad=1
        else
            echo "ok   $md, shown run $n: $(grep -c '^\$ ' "$block") commands, $(grep -vc '^\$ ' "$block") lines as shown"
        fi
    done
    [ $n -gt 0 ] || { echo "FAIL $md: no shown run (a fenced block whose first line starts with '\$ ')"; bad=1; }
done
exit $bad
