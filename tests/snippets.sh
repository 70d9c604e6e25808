#!/usr/bin/env bash
# tests/snippets.sh - every C snippet of the documentation is a complete program that this script builds and runs, or
# is cut from a program that the tests build.
#   tests/snippets.sh [FILE.md...]      default: README.md, docs/comm.md, docs/guide/*.md
# A snippet is complete when the line just before its ```c fence is an HTML comment (invisible on GitHub) of the form
#   <!-- complete program: tests/snippets.sh builds and runs it[; prints: TEXT] -->
# It is built as a reader would build it, with warnings as errors (gcc -std=c99 -Wall -Wextra -Wpedantic -Werror
# -I. x.c -pthread -lm, from the repository's root), run, and must exit 0 and, with `prints:`, print TEXT on a line of
# its own. Every line of any other ```c snippet (leading and trailing blanks aside; blank lines and "..." skipped)
# must be a line of dpar.h, dpar_cuda.h, examples/ (.c and .cu), demo/ or tests/; one after the line
#   <!-- the whole of FILE: ... -->
# must be FILE, byte for byte (README.md's first program is examples/first.c). The other pages of docs/ are not
# held to it yet (their snippets are sketches). Prints one line per snippet and `N passed, N failed`; exits 1 when any failed.
set -u
cd "$(dirname "$0")/.." || exit 2
CC=${CC:-gcc}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
[ $# -gt 0 ] || set -- README.md docs/comm.md docs/guide/*.md
# every line of the sources the tests build, trimmed
cat dpar.h dpar_cuda.h examples/*.c examples/*.cu examples/guide/*.c examples/guide/*.cu demo/*.c tests/*.c 2>/dev/null |
    sed 's/^[[:space:]]*//; s/[[:space:]]*$//' | sort -u >"$tmp/lines"
for md in "$@"; do
    # every complete snippet of the file into $tmp/NAME.N.c, its expected line into $tmp/NAME.N.want
    rm -f "$tmp"/s.*
    awk -v out="$tmp/s" '
        /^<!-- complete program: / { want = $0; sub(/^.*; prints: /, "", want); sub(/ -->$/, "", want)
                                     if (want ~ /^<!--/) want = ""; marked = NR; next }
        marked == NR - 1 && /^```c$/ { n++; inside = 1; printf "%s", want > (out "." n ".want"); next }
        inside && /^```$/ { inside = 0; next }
        inside { print > (out "." n ".c") }
        END { exit 0 }' "$md"
    # the other snippets: each line must be found in the sources
    awk -v md="$md" '
        FILENAME != md { known[$0] = 1; next }
        /^```c$/ && prev !~ /^<!-- complete program: / { n++; inside = 1; missing = 0; first = ""; start = FNR; prev = $0; next }
        inside && /^```$/ { inside = 0
            if (missing) { printf "FAIL %s snippet at line %d: %d lines are in no program the tests build, the first: %s\n", md, start, missing, first; bad++ }
            else { printf "ok   %s snippet at line %d: cut from a program the tests build\n", md, start; good++ } }
        inside { line = $0; sub(/^[ \t]+/, "", line); sub(/[ \t]+$/, "", line)
                 if (line != "" && line != "..." && !(line in known)) { missing++; if (first == "") first = line } }
        { prev = $0 }
        END { printf "cut %d %d\n", good, bad }' "$tmp/lines" "$md" >"$tmp/cut"
    grep -v '^cut ' "$tmp/cut"
    # a snippet under <!-- the whole of FILE: ... --> must be FILE, byte for byte (a program quoted whole)
    rm -f "$tmp"/w.*
    awk -v out="$tmp/w" '
        /^<!-- the whole of [^ :]+: / { file = $0; sub(/^<!-- the whole of /, "", file); sub(/:.*$/, "", file); marked = NR; next }
        marked == NR - 1 && /^```c$/ { n++; inside = 1; printf "%s", file > (out "." n ".path"); printf "" > (out "." n ".c"); next }
        inside && /^```$/ { inside = 0; next }
        inside { print > (out "." n ".c") }' "$md"
    for c in "$tmp"/w.*.c; do
        [ -f "$c" ] || continue
        file=$(cat "${c%.c}.path")
        if cmp -s "$c" "$file"; then
            passed=$((passed + 1)); echo "ok   $md: the block quoting $file is the file"
        else
            failed=$((failed + 1)); echo "FAIL $md: the block quoting $file differs from the file (< the page, > the file)"
            diff "$c" "$file" 2>&1 | head -20 | sed 's/^/    /'
        fi
    done
    passed=$((passed + $(sed -n 's/^cut \([0-9]*\) .*/\1/p' "$tmp/cut")))
    failed=$((failed + $(sed -n 's/^cut [0-9]* \([0-9]*\)$/\1/p' "$tmp/cut")))
    for c in "$tmp"/s.*.c; do
        [ -f "$c" ] || continue
        name="$md snippet ${c#"$tmp"/s.}"
        name=${name%.c}
        want=$(cat "${c%.c}.want")
        if ! $CC -std=c99 -Wall -Wextra -Wpedantic -Werror -I. "$c" -o "$tmp/prog" -pthread -lm >"$tmp/out" 2>&1; then
            failed=$((failed + 1)); echo "FAIL $name: does not build"; sed 's/^/    /' "$tmp/out" | head -20; continue
        fi
        if ! timeout 60 "$tmp/prog" >"$tmp/out" 2>&1; then
            failed=$((failed + 1)); echo "FAIL $name: exits non-zero"; sed 's/^/    /' "$tmp/out" | head -20; continue
        fi
        if [ -n "$want" ] && ! grep -qxF "$want" "$tmp/out"; then
            failed=$((failed + 1)); echo "FAIL $name: does not print '$want'"; sed 's/^/    /' "$tmp/out" | head -20; continue
        fi
        passed=$((passed + 1)); echo "ok   $name${want:+: prints '$want'}"
    done
done
echo "$passed passed, $failed failed"
[ $failed = 0 ]
