#!/bin/sh
# docs/gen/record.sh [--bench] - records again the sources that docs/gen/svg.c draws (make docs-record, make docs-bench):
#   docs/img/src/dp_step.trace.json   a DPAR_TRACE file of docs/gen/dp_record.c (2 thread ranks, buckets)
#   docs/img/src/memory.txt           examples/fsdp.c (ZeRO-2 and ZeRO-3 on 4 thread ranks) and examples/zero.c (4 ranks)
#   docs/img/src/bench.txt            with --bench only: the machine (date, lscpu, load), then a whole make bench (minutes)
# Run from the repository's root on a quiet machine, then make docs, and commit the sources with the pictures.
set -eu
cd "$(dirname "$0")/../.."
B=${BUILD:-build}
S=docs/img/src
mkdir -p "$B" "$S"
if [ "${1:-}" = --bench ]; then
    {
        echo "# make bench, recorded by docs/gen/record.sh --bench (make docs-bench)"
        echo "# date: $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo "# load before the run: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
        lscpu | grep -Ev '^(Flags|Vulnerability|NUMA node[0-9])' | sed 's/^/# /'
        make -s bench 2>&1 | grep -v '^dpar: '
        echo "# load after the run: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
    } >"$S/bench.txt.new"
    mv "$S/bench.txt.new" "$S/bench.txt"
    echo "record.sh: wrote $S/bench.txt"
    exit 0
fi
cc -std=c99 -O2 -I. docs/gen/dp_record.c -o "$B/dp_record" -pthread -lm
cc -std=c99 -O2 -I. examples/fsdp.c -o "$B/fsdp" -pthread -lm
cc -std=c99 -O2 -I. examples/zero.c -o "$B/zero" -pthread -lm
"$B/dp_record" "$S/dp_step.trace.json"
{
    echo "# examples/fsdp.c --stage 2 and --stage 3 --threads 4 --steps 3, then examples/zero.c --ranks 4 (docs/gen/record.sh)"
    "$B/fsdp" --stage 2 --threads 4 --steps 3
    "$B/fsdp" --stage 3 --threads 4 --steps 3
    "$B/zero" --ranks 4
} >"$S/memory.txt"
echo "record.sh: wrote $S/dp_step.trace.json and $S/memory.txt"
