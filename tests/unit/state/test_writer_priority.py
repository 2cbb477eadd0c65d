"""The writer process yields the CPU to training: SCHED_IDLE (inherited by the threads it
starts afterwards), nice 19 and the lowest best-effort I/O level. Checked in a child process,
since the policy cannot be undone without privilege."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, os, threading
from cairn.state.writer_process import lower_priority
lower_priority(19)
seen = {}
def worker():
    tid = threading.get_native_id()
    seen["thread_policy"] = os.sched_getscheduler(tid)
    seen["thread_nice"] = os.getpriority(os.PRIO_PROCESS, tid)
t = threading.Thread(target=worker); t.start(); t.join()
seen["policy"] = os.sched_getscheduler(0)
seen["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
print(json.dumps(seen))
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux's SCHED_IDLE")
def test_lower_priority_sets_sched_idle_and_nice_for_later_threads_too() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    seen = json.loads(out)
    assert seen["policy"] == os.SCHED_IDLE and seen["thread_policy"] == os.SCHED_IDLE
    assert seen["nice"] == 19 and seen["thread_nice"] == 19
