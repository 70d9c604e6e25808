#!/usr/bin/env bash
# tests/format.sh - the C files as clang-format writes them (the repository's .clang-format), and no line
# over 120 columns (clang-format leaves long comments and some literals alone, so this is checked apart).
#
#   tests/format.sh          check: name every file that is not formatted, with the first lines of its
#                            diff, and every line over 120 columns; exit 1 if there is any
#   tests/format.sh --fix    rewrite the files in place (make format), then check the line length
#
# The files: git ls-files '*.c' '*.h' '*.cu' (every .c/.h/.cu file under the root outside a git checkout).
# The style is tuned with clang-format 14; other major versions lay out some constructs differently,
# so they are not used unless DPAR_FORMAT_ANY_VERSION=1. CLANG_FORMAT names the program to use.
# Without a usable clang-format the check prints `skipped: REASON` and exits 0 (tests/run.sh counts
# it as skipped); the line-length check runs all the same.
# Exit status: 0 formatted (or skipped), 1 not formatted or a line too long, 2 usage or setup error.
set -u
cd "$(dirname "$0")/.." || exit 2
MAX_COLUMNS=120
WANT_MAJOR=14
mode=check
case "${1:-}" in
    "") ;;
    --fix) mode=fix ;;
    -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: tests/format.sh [--fix]" >&2; exit 2 ;;
esac
[ -f .clang-format ] || { echo "format: no .clang-format at the repository root" >&2; exit 2; }

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    files=$(git ls-files '*.c' '*.h' '*.cu')
else
    files=$(find . -path ./build -prune -o -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' \) -print |
        sed 's|^\./||' | sort)
fi
[ -n "$files" ] || { echo "format: no C files found" >&2; exit 2; }

# the program: $CLANG_FORMAT, else clang-format-14, else clang-format
cf=${CLANG_FORMAT:-}
if [ -z "$cf" ]; then
    for c in clang-format-$WANT_MAJOR clang-format; do
        if command -v "$c" >/dev/null 2>&1; then cf=$c; break; fi
    done
fi
skip_reason=
if [ -z "$cf" ] || ! command -v "$cf" >/dev/null 2>&1; then
    skip_reason="clang-format not found"
else
    major=$("$cf" --version 2>/dev/null | sed -n 's/.*clang-format version \([0-9][0-9]*\).*/\1/p' | head -1)
    if [ "${major:-0}" != "$WANT_MAJOR" ] && [ "${DPAR_FORMAT_ANY_VERSION:-0}" != 1 ]; then
        skip_reason="$cf is version ${major:-unknown}; the style is checked with clang-format $WANT_MAJOR"
        skip_reason="$skip_reason (DPAR_FORMAT_ANY_VERSION=1 uses it anyway)"
    fi
fi
if [ -n "$skip_reason" ] && [ $mode = fix ]; then
    echo "format: $skip_reason" >&2
    exit 2
fi

status=0
if [ -z "$skip_reason" ]; then
    if [ $mode = fix ]; then
        # shellcheck disable=SC2086
        "$cf" -i --style=file $files || exit 2
    fi
    bad=0 names=
    tmp=$(mktemp) || exit 2
    trap 'rm -f "$tmp"' EXIT
    for f in $files; do
        [ -f "$f" ] || continue # deleted, not yet committed
        if ! "$cf" --style=file "$f" >"$tmp" 2>&1; then
            echo "format: $cf failed on $f:"; sed 's/^/    /' "$tmp" | head -5
            bad=$((bad + 1))
        elif ! cmp -s "$f" "$tmp"; then
            echo "--- $f: $(diff "$f" "$tmp" | grep -c '^[<>]') lines differ; the first ones:"
            diff -u "$f" "$tmp" | sed -n '3,18p' | sed 's/^/    /'
            names="$names$f "
            bad=$((bad + 1))
        fi
    done
    if [ $bad -gt 0 ]; then
        for f in $names; do echo "not formatted: $f"; done
        echo "format: $bad of $(echo "$files" | wc -l) files are not as $cf writes them (make format rewrites them)"
        status=1
    fi
fi

# columns: clang-format does not break comments (ReflowComments: false) nor the text of #error.
# UTF-8 continuation bytes do not count; the sources have no tabs.
long=$(echo "$files" | while read -r f; do
    LC_ALL=C awk -v max=$MAX_COLUMNS '{ s = $0; gsub(/[\200-\277]/, "", s) }
        length(s) > max { printf "%s:%d: %d columns: %.70s...\n", FILENAME, FNR, length(s), $0 }' "$f"
done)
if [ -n "$long" ]; then
    echo "$long" | head -15
    echo "format: $(echo "$long" | wc -l) lines over $MAX_COLUMNS columns" \
        "(make format wraps code; comments and #error text are wrapped by hand)"
    status=1
fi

if [ $status = 0 ]; then
    if [ -n "$skip_reason" ]; then
        echo "no line over $MAX_COLUMNS columns"
        echo "skipped: $skip_reason"
    else
        echo "formatted: $(echo "$files" | wc -l) files as $cf writes them, no line over $MAX_COLUMNS columns"
    fi
fi
exit $status
