#!/usr/bin/env bash
# Run one part of `make test` in a folder, framed by the time it started, how long it took and
# the CPU time it and everything it started used, so that a CI log shows where its minutes went
# (on 2 cores the run's length is mostly the sum of the parts' CPU time over 2):
#
#   scripts/timed_part.sh LABEL DIR COMMAND [ARG...]
#
# Exits with COMMAND's code.
set -uo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 LABEL DIR COMMAND [ARG...]" >&2
    exit 2
fi
label=$1 dir=$2
shift 2
start=$(date +%s)
echo "==> [$(date -u +%T)] $label"
(cd "$dir" && "$@")
code=$?
# `times` prints this shell's, then its children's user and system time (waited-for
# descendants included: pytest reaps its workers, they reap what they start). It must run in
# this shell, not in a pipe or $(...), whose subshell has no children of its own.
usage=$(mktemp)
times > "$usage"
cpu=$(tail -1 "$usage" | awk '{ split($1, u, "m"); split($2, s, "m");
    printf "%.0f", u[1] * 60 + u[2] + s[1] * 60 + s[2] }')
rm -f "$usage"
echo "<== [$(date -u +%T)] $label: exit $code after $(( $(date +%s) - start )) s, CPU ${cpu} s"
exit $code
