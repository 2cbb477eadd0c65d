#!/usr/bin/env bash
# Run one part of `make test` in a folder, framed by the time it started and how long it took,
# so that a CI log shows where its minutes went:
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
echo "<== [$(date -u +%T)] $label: exit $code after $(( $(date +%s) - start )) s"
exit $code
