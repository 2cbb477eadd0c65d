"""How long a test waits on a subprocess before it calls it hung.

Not a time limit: no test times anything (bench/ does). ``make test`` runs the suites side by
side, the main and range suites at nice 10 (ADR 0038), where a process that imports torch may
get a tenth of a core for minutes while the other lanes run; guards of 180 and 300 s expired
there on runs that were merely starved.
"""

from __future__ import annotations

HANG_S = 900
