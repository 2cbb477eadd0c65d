"""Process mode: checkpoint a whole training process with CRIU and restore it after preemption.

This package so far holds the host checks (:mod:`cairn.process.doctor`) and the CRIU binary
helpers (:mod:`cairn.process.criu`); importing it starts nothing and needs no CRIU.
"""

from __future__ import annotations

from cairn.process.criu import CriuCheck, criu_check, criu_version, find_criu, parse_version
from cairn.process.doctor import Check, DoctorReport, Status, run_doctor

__all__ = [
    "Check",
    "CriuCheck",
    "DoctorReport",
    "Status",
    "criu_check",
    "criu_version",
    "find_criu",
    "parse_version",
    "run_doctor",
]
