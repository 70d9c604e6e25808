#!/bin/sh
# tests/docs.sh - every picture of docs/img/ is what make docs makes from today's sources: docs/gen/svg.c --check
# compares each SVG's stored hash of its sources (the generator and its input files in docs/img/src/) and then its
# bytes with what the generator makes now (from dpar.h's ring and pipeline schedules too). Exit 1 names each picture
# that is stale or differs: run make docs and commit the pictures.
set -u
cd "$(dirname "$0")/.." || exit 2
B=${BUILD:-build}
mkdir -p "$B"
${CC:-cc} -std=c99 -O2 -Wall -Wextra -Wpedantic -Werror -I. docs/gen/svg.c -o "$B/svg_check" -pthread -lm || exit 1
"$B/svg_check" --check
