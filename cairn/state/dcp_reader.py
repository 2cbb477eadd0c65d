"""A state snapshot served to ``torch.distributed.checkpoint.load`` (ADR 0051).

:class:`StoreReader` is a DCP ``StorageReader``: with cairn's :class:`LoadPlanner`,
``dcp.load(state_dict, storage_reader=StoreReader(store, key), planner=LoadPlanner())`` fills
``state_dict`` from a cairn state snapshot, every byte verified, and DCP does for it what it
does for a checkpoint of its own: it matches keys, narrows and copies each stored tensor into
the tensor that asks for it. A sharded tensor (a DTensor's pieces, one per rank's part) is
served as one tensor of its global shape whose chunks are the parts' pieces, so DCP reshards
it to whatever layout asks (ADR 0054). Nothing from the store is unpickled: there is no
DCP ``.metadata`` file to unpickle (the reader builds DCP's ``Metadata`` from the snapshot's
``state.json``), and the values DCP carries as bytes (everything that is not a tensor) travel in
cairn's codec (:func:`cairn.state.codec.encode_value`), which only cairn's planner decodes. The
reader refuses a plan with such values from any other planner: DCP's default planner would
hand them to ``torch.load(weights_only=False)``.

Keys are the snapshot's tree as the Checkpointer wrote it, flattened by DCP's own rule (path
elements joined by dots): ``models.<name>.<parameter>``, ``optimizers.<name>.state.<index>.
<moment>``, ``optimizers.<name>.param_groups``, ``schedulers.<name>...``, ``items.<name>...``,
``step``. ``dcp.load`` loads the keys of the ``state_dict`` it is given and ignores the rest.

All or nothing per ``dcp.load``: every array a rank's plan needs is read and verified into
fresh memory before the first byte is copied into the state dict (memory: the rank's share of
the snapshot, once more, while it loads). A snapshot that does not verify raises
:class:`~cairn.exceptions.CorruptSnapshot` (DCP wraps it in its ``CheckpointException``;
:func:`cairn.state.dcp_io.load` unwraps it) and leaves the state dict as it was.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import (
    BytesStorageMetadata,
    DefaultLoadPlanner,
    LoadPlan,
    Metadata,
    StorageReader,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint import LoadPlanner as DcpLoadPlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import LoadItemType

from cairn.exceptions import ConfigError, CorruptSnapshot
from cairn.runtime.stores import open_store
from cairn.state.codec import Shard, decode_value, encode_value, unflatten
from cairn.state.state_io import StateDoc, read_arrays, read_state_doc
from cairn.store import Key, Manifest, SnapshotMode, Store


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that the values DCP carries as bytes are decoded
    with cairn's codec, never unpickled. Use it with :class:`StoreReader`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        decoded = decode_value(value.read())
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], decoded)
        else:
            self.state_dict[fqn] = decoded


class _Stored:
    """Stands in for a numpy array of the snapshot (DCP carries numpy arrays as bytes)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Skeleton:
    """A snapshot part's tree with stand-ins for its arrays: a tensor on the ``meta`` device
    (shape and dtype, no memory) for each torch array, a :class:`_Stored` for each numpy one,
    and for a sharded tensor's piece a ``meta`` tensor of the global shape; flattened by
    DCP's rule into ``leaves`` (key to value, stand-ins inside). ``pieces`` holds, for each
    sharded leaf's key, the piece's offsets, sizes and array index."""

    def __init__(self, doc: StateDoc) -> None:
        stand_ins: list[Any] = []
        self._index_of: dict[int, int] = {}  # id(meta tensor) -> array index
        for index, header in enumerate(doc.headers):
            if header.kind == "torch":
                tensor = torch.empty(header.shape, dtype=getattr(torch, header.dtype),
                                     device="meta")
                self._index_of[id(tensor)] = index
                stand_ins.append(tensor)
            else:
                stand_ins.append(_Stored(index))
        self._stand_ins = stand_ins  # keeps every id() above alive and unique
        self.doc = doc
        self._sharded: dict[int, tuple[torch.Size, torch.Size, int]] = {}
        self._globals: list[torch.Tensor] = []  # keeps the global stand-ins' id()s
        tree = self._unsharded(unflatten(doc.structure, stand_ins))
        self.leaves, _ = flatten_state_dict(tree)
        self.pieces = {fqn: self._sharded[id(leaf)] for fqn, leaf in self.leaves.items()
                       if isinstance(leaf, torch.Tensor) and id(leaf) in self._sharded}

    def _unsharded(self, value: Any) -> Any:
        """``value`` with each piece of a sharded tensor replaced by a global stand-in."""
        if isinstance(value, Shard):
            local = value.local
            if not isinstance(local, torch.Tensor) or local.dim() != len(value.shape):
                raise CorruptSnapshot(f"seq {self.doc.seq}: a shard of {value.shape} holds "
                                      f"a piece of another rank", seq=self.doc.seq)
            whole = torch.empty(value.shape, dtype=local.dtype, device="meta")
            self._globals.append(whole)
            self._sharded[id(whole)] = (torch.Size(value.offsets), local.shape,
                                        self.index_of(local))
            return whole
        if isinstance(value, dict):
            return {k: self._unsharded(v) for k, v in value.items()}
        return value

    def index_of(self, tensor: torch.Tensor) -> int:
        return self._index_of[id(tensor)]

    def arrays_in(self, value: Any) -> list[int]:
        """The array indices a non-tensor leaf holds (a tuple of tensors, a numpy array)."""
        found: list[int] = []
        self._mapped(value, lambda index: found.append(index))
        return found

    def filled(self, value: Any, arrays: dict[int, Any]) -> Any:
        """``value`` with each stand-in replaced by its array, read."""
        return self._mapped(value, arrays.__getitem__)

    def _mapped(self, value: Any, array: Callable[[int], Any]) -> Any:
        """``value`` rebuilt with ``array(index)`` for each stand-in in it."""
        if isinstance(value, torch.Tensor):
            return array(self.index_of(value))
        if isinstance(value, _Stored):
            return array(value.index)
        if isinstance(value, dict):
            return {k: self._mapped(v, array) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._mapped(v, array) for v in value)
        return value

    def metadata(self, others: list[_Skeleton]) -> Metadata:
        """DCP's ``Metadata`` of this part: one whole chunk per tensor (offsets 0), for a
        sharded tensor one chunk per piece, of this part and of ``others`` (the snapshot's
        other parts); bytes for every other leaf. ``storage_data`` maps each chunk's index to
        its part's prefix and array."""
        entries: dict[str, Any] = {}
        storage: dict[MetadataIndex, tuple[str, int]] = {}
        for fqn, leaf in self.leaves.items():
            if not isinstance(leaf, torch.Tensor):
                entries[fqn] = BytesStorageMetadata()
                continue
            if fqn in self.pieces:
                pieces = [(part.doc.prefix, part.pieces.get(fqn)) for part in (self, *others)]
                if any(piece is None for _, piece in pieces):
                    raise CorruptSnapshot(f"seq {self.doc.seq}: {fqn} is sharded, and a part "
                                          "holds no piece of it", seq=self.doc.seq)
            else:
                pieces = [(self.doc.prefix, (torch.Size([0] * leaf.dim()), leaf.shape,
                                             self.index_of(leaf)))]
            chunks = []
            for prefix, (offsets, sizes, index) in pieces:  # type: ignore[misc]
                if MetadataIndex(fqn, offsets) in storage:
                    continue  # a replica's piece (another mesh dimension): one serves
                chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
                storage[MetadataIndex(fqn, offsets)] = (prefix, index)
            entries[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=leaf.dtype),
                                                 size=leaf.shape, chunks=chunks)
        return Metadata(state_dict_metadata=entries, storage_data=storage,
                        storage_meta=StorageMeta())


class StoreReader(StorageReader):
    """A DCP ``StorageReader`` serving one state snapshot of ``key`` (``seq``; default: the
    newest committed one, chosen when the reader is made). A snapshot taken by several ranks
    is served as rank ``rank``'s part (replicated training, DDP: any rank's part holds every
    tensor whole), except its sharded tensors, served whole from every part's pieces (FSDP2).
    Every rank of a ``dcp.load`` makes its own reader of the same snapshot.

    Thread: DCP calls it from the thread that runs ``dcp.load``."""

    def __init__(self, store: Store | str, key: Key | str, *, seq: int | None = None,
                 rank: int = 0) -> None:
        super().__init__()
        self.store = open_store(store) if isinstance(store, str) else store
        self.key = Key.parse(key) if isinstance(key, str) else key
        self.manifest: Manifest = self.store.manifest(self.key, seq)
        if self.manifest.mode is not SnapshotMode.STATE:
            raise ConfigError(f"seq {self.manifest.seq} of {self.key} is a "
                              f"{self.manifest.mode.value} snapshot; torch.distributed.checkpoint "
                              "reads framework-state snapshots only (Checkpointer, the Lightning "
                              "and Hugging Face integrations)")
        world_size = int(self.manifest.metadata.get("world_size", 1))
        if not 0 <= rank < world_size:
            raise ConfigError(f"seq {self.manifest.seq} of {self.key} was taken by {world_size} "
                              f"rank(s); rank= must be 0 to {world_size - 1}, not {rank}")
        self.prefix = f"rank-{rank}/" if world_size > 1 else ""
        self._prefixes = [f"rank-{r}/" for r in range(world_size)] if world_size > 1 else [""]
        self._reader = self.store.reader(self.manifest)
        self._skeletons: dict[str, _Skeleton] = {}
        self._storage: dict[MetadataIndex, tuple[str, int]] = {}

    @property
    def seq(self) -> int:
        return self.manifest.seq

    def skeleton(self, prefix: str | None = None) -> _Skeleton:
        """A part's tree of stand-ins (default: this reader's part; its ``state.json`` read
        and verified once)."""
        prefix = self.prefix if prefix is None else prefix
        if prefix not in self._skeletons:
            self._skeletons[prefix] = _Skeleton(read_state_doc(self._reader, prefix=prefix))
        return self._skeletons[prefix]

    # -- StorageReader -----------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            raise ConfigError("a StoreReader serves the snapshot it was made for; make another "
                              "StoreReader(store, key, seq=...) instead of passing checkpoint_id")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked by DCP for a path: made explicitly, as storage_reader=

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        own = self.skeleton()
        # The other parts are read only for a sharded tensor's pieces.
        others = [self.skeleton(p) for p in self._prefixes if p != self.prefix] \
            if own.pieces else []
        return own.metadata(others)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._storage = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: DcpLoadPlanner) -> torch.futures.Future[None]:
        """Read and verify everything ``plan`` asks for, then hand it to ``planner``."""
        skeleton = self.skeleton()
        wanted: dict[str, set[int]] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                if not isinstance(planner, LoadPlanner):
                    raise ConfigError(
                        f"{item.storage_index.fqn!r} is not a tensor, and "
                        f"{type(planner).__name__} would unpickle it; pass "
                        "planner=cairn.dcp.LoadPlanner() to dcp.load (or use cairn.dcp.load)")
                wanted.setdefault(self.prefix, set()).update(
                    skeleton.arrays_in(skeleton.leaves[item.storage_index.fqn]))
            else:
                prefix, index = self._storage[item.storage_index]
                wanted.setdefault(prefix, set()).add(index)
        arrays = {prefix: read_arrays(self._reader, self.skeleton(prefix).doc, sorted(indices))
                  for prefix, indices in wanted.items()}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                value = skeleton.filled(skeleton.leaves[item.storage_index.fqn],
                                        arrays[self.prefix])
                planner.load_bytes(item, io.BytesIO(encode_value(value)))
                continue
            prefix, index = self._storage[item.storage_index]
            source = _narrowed(arrays[prefix][index], item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise ConfigError(f"{item.storage_index.fqn}: DCP asked for {tuple(target.size())} "
                                  f"where the snapshot holds {tuple(source.size())}")
            target.copy_(source)
            planner.commit_tensor(item, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


def _narrowed(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The part of ``tensor`` at ``offsets`` of ``lengths`` (a view), as DCP's own reader
    narrows a stored chunk to a read item."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor
