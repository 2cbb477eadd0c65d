#!/usr/bin/env bash
# Run a command as on a machine of its own, for the tests marked `isolated` (ADR 0038):
#
#   scripts/isolated.sh COMMAND [ARG...]
#
# - a PID namespace of its own: CRIU restores a snapshot's exact PIDs in it, and `cairn run`
#   moves that namespace's PID cursor, so no process outside can hold a PID a restore needs,
#   and nothing outside is handed a PID near the cursor it moved;
# - a mount namespace with its own /proc (that namespace's processes) and its own /dev/shm, so
#   that counts of /dev/shm files see only its own.
#
# PID 1 there reaps every orphan (a zombie would hold its PID, which a later restore may need)
# and passes SIGINT and SIGTERM on to COMMAND; the namespace ends with COMMAND (--kill-child)
# and the script exits with COMMAND's code. Needs root and util-linux's unshare.
set -euo pipefail
if [ $# -eq 0 ]; then
    echo "usage: $0 COMMAND [ARG...]" >&2
    exit 2
fi
exec unshare --pid --fork --mount-proc --kill-child -- /bin/sh -c '
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm || exit 1
    exec python3 -c "
import os, signal, subprocess, sys

child = subprocess.Popen(sys.argv[1:])
for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda n, _frame: child.send_signal(n))
while True:
    try:
        pid, status = os.wait()
    except InterruptedError:
        continue
    if pid == child.pid:
        sys.exit(os.waitstatus_to_exitcode(status))
" "$@"' sh "$@"
