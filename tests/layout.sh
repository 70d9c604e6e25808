#!/usr/bin/env bash
# tests/layout.sh - checks dpar.h's layout (issue 15): the table of contents at the top lists exactly
# the section tags of the file, and no code outside a transport's own section uses that transport's
# private names (the threads transport's group, slots, channels and doorbells; the MPI transport's
# state). Prints what is wrong and exits 1, or prints `layout ok` and exits 0.
set -u
cd "$(dirname "$0")/.."
H=${1:-dpar.h}
fail=0
# tags of the banners: `/* >>tag:` or `/* >>tag ` at the start of a line
banners=$(grep -oE '^/\* >>[a-z_]+' "$H" | sed 's|^/\* >>||' | sort -u)
# tags of the table: `     >>tag ` lines of the SECTIONS block in the opening comment
toc=$(awk '/^   SECTIONS/{on=1; next} on && /^   [A-Z]/{exit} on' "$H" | grep -oE '^     >>[a-z_]+' | sed 's|^ *>>||' | sort -u)
if [ "$banners" != "$toc" ]; then
    echo "FAIL: the SECTIONS table and the section banners differ (< banners only, > table only):"
    diff <(echo "$banners") <(echo "$toc") | grep '^[<>]'
    fail=1
fi
# private names and the sections allowed to use them
check_private() { # PATTERN SECTION...
    local pat=$1; shift
    local allowed=" $* "
    awk -v pat="$pat" -v allowed="$allowed" '
        /^\/\* >>[a-z_]+/ { s = $0; sub(/^\/\* >>/, "", s); sub(/[^a-z_].*/, "", s); sec = s }
        $0 ~ pat && index(allowed, " " sec " ") == 0 { printf "FAIL: %s:%d (section >>%s) uses %s: %s\n", FILENAME, NR, sec, pat, $0; bad = 1 }
        END { exit bad }' "$H" || fail=1
}
check_private 'dpar__t_[a-z]|dpar__slot|dpar__chan|dpar__ring_bell|dpar__threads_transport|DPAR__TG\(|->slots|->chans|->handover' threads
check_private 'dpar__m_[a-z]|dpar__mpi\b|DPAR__M\(|dpar__mpi_transport|dpar__hybrid\b' mpi hybrid
check_private 'dpar__o_[a-z]|dpar__ops\b|DPAR__O\(|dpar__ops_transport' ops
# the dpar_group struct's fields are private to the threads transport
check_private 'struct dpar_group \{' threads
[ $fail = 0 ] && echo "layout ok"
exit $fail
