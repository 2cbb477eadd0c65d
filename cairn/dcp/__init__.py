"""torch.distributed.checkpoint and cairn's state snapshots (ADR 0051).

::

    import cairn.dcp
    cairn.dcp.load({"models": {"default": model.state_dict()}}, store=STORE, key=KEY)
    # or, with DCP's own call:
    dcp.load(state_dict, storage_reader=cairn.dcp.StoreReader(STORE, KEY),
             planner=cairn.dcp.LoadPlanner())

Keys are the snapshot's tree flattened by DCP's rule (``models.<name>.<parameter>``,
``optimizers.<name>...``, ``items.<name>...``; see :mod:`cairn.state.dcp_reader`). Nothing
from a store is unpickled; every byte is verified before any is loaded. ``cairn export --dcp``
writes a snapshot in DCP's own layout. This package's names are public API.
"""

from __future__ import annotations

from cairn.state.dcp_io import export, load
from cairn.state.dcp_reader import LoadPlanner, StoreReader

__all__ = ["LoadPlanner", "StoreReader", "export", "load"]
