"""How long a GPU snapshot's device-to-host copy takes, estimated before it starts.

The estimate is the workload's GPU bytes over the copy rate measured by earlier snapshots of
this run (bytes / the time of ``cuCheckpointProcessCheckpoint``, the median), or
:data:`DEFAULT_D2H_BYTES_PER_S` before any was measured. A final snapshot that cannot fit the
time left is not attempted (the supervisor's budget); a periodic snapshot whose copy alone
would outlast the whole grace period is refused, since no final snapshot of that workload
could ever fit it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cairn.exceptions import NotSnapshottable

# An assumed effective device-to-host rate for the checkpoint copy: PCIe Gen4 x16 peaks near
# 25 GB/s and the driver's copy sees less. The same figure cairn doctor's estimates use.
DEFAULT_D2H_BYTES_PER_S = 10e9


@dataclass(frozen=True)
class CopyEstimate:
    seconds: float
    bytes_per_s: float
    measured: bool  # from this run's earlier snapshots, not the default

    def describe(self, gpu_bytes: int) -> str:
        how = "measured" if self.measured else "assumed"
        return (f"{gpu_bytes / 2**30:.1f} GiB of GPU memory at {self.bytes_per_s / 1e9:.1f} "
                f"GB/s ({how}) is about {self.seconds:.1f}s")


def estimate(gpu_bytes: int, history: Iterable[Mapping[str, Any]]) -> CopyEstimate:
    """The copy time of ``gpu_bytes``; ``history``: the snapshot cost records (entries with
    ``gpu_bytes`` and ``gpu_checkpoint_s`` count)."""
    rates = [h["gpu_bytes"] / h["gpu_checkpoint_s"] for h in history
             if (h.get("gpu_bytes") or 0) > 0 and (h.get("gpu_checkpoint_s") or 0) > 0]
    # statistics (and decimal, which it imports) only here: 7 ms of `cairn run`'s cold start.
    import statistics

    rate = statistics.median(rates) if rates else DEFAULT_D2H_BYTES_PER_S
    return CopyEstimate(gpu_bytes / rate, rate, bool(rates))


def check_periodic(gpu_bytes: int, history: Iterable[Mapping[str, Any]], *,
                   grace_s: float) -> None:
    """Refuse a periodic snapshot whose GPU copy alone outlasts the grace period (a grace of
    0 means no final snapshots are taken: nothing to protect)."""
    if grace_s <= 0 or gpu_bytes <= 0:
        return
    guess = estimate(gpu_bytes, history)
    if guess.seconds > grace_s:
        raise NotSnapshottable(
            f"the GPU copy of {guess.describe(gpu_bytes)}, longer than the {grace_s:g}s grace "
            "period: a final snapshot could never fit it. Give the pod a longer grace "
            "(terminationGracePeriodSeconds and --grace), hold fewer GPU bytes, or use state "
            "mode (cairn.Checkpointer)")


__all__ = ["DEFAULT_D2H_BYTES_PER_S", "CopyEstimate", "check_periodic",
           "estimate"]
