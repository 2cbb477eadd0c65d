"""One real SLURM cluster (MUNGE, slurmctld, slurmd) for the whole session, stopped and removed
at its end (:mod:`tests.support.slurm_cluster`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.slurm_cluster import SlurmCluster, slurm_missing


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    why = slurm_missing()
    if why is not None:
        pytest.skip(f"SLURM test cluster: {why}")
    cluster = SlurmCluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
