"""The ``torch.distributed.checkpoint`` (DCP) side: what each local tensor becomes, the
planners, the crash-safe directory protocol and reading the metadata.

What a local tensor becomes (see :mod:`megastrategy.checkpoint.layout` for the chunks):

* replicated: the plain tensor. Every rank holding it offers it under the same key; DCP's
  save planner writes it once (duplicate write items are dropped across ranks).
* sharded, one chunk (column/row/vocab layers): a ``DTensor`` over a 1-D device mesh of the
  rank's tensor-parallel group, ``Shard(dim)``, whose global shape is the user's UNPADDED shape
  and whose local tensor is a view of the real rows. Data-parallel replicas offer the same
  ``(key, offset)`` and are written once; DCP reshards on load from the chunk metadata.
* sharded with several chunks per rank (packed QKV ``[q_r|k_r|v_r]``) -- which a DTensor
  placement cannot describe -- or any single chunk whose placement DTensor would compute
  differently: a :class:`ChunkedTensor`, handled by the planners below through DCP's public
  planner extension points (``create_local_plan``/``lookup_object``/``lookup_tensor`` and
  ``create_read_items_for_chunk_list``). On disk it is indistinguishable from a DTensor.

Loading always runs with ``no_dist=True``: every rank plans and reads only its own chunks,
so a load needs no collective (and a rank that fails cannot hang the others inside DCP).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megastrategy.checkpoint.layout import Chunk, TensorLayout
from megastrategy.checkpoint.safe_unpickle import load_byte_item, load_metadata_pickle
from megastrategy.errors import UnsafeCheckpointError

PathLike = Union[str, os.PathLike]
METADATA_FILE = ".metadata"  # written last by DCP's coordinator
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"

__all__ = [
    "ChunkedTensor",
    "CheckpointNotFoundError",
    "MeshCache",
    "to_dcp_object",
    "save_state",
    "load_state",
    "read_metadata",
]


class CheckpointNotFoundError(FileNotFoundError):
    """The path is not a complete megastrategy (DCP) checkpoint directory."""


class CheckpointCorruptError(CheckpointNotFoundError):
    """The metadata is there but a shard file it names is missing, truncated or unreadable."""


# ---------------------------------------------------------------------------------------- objects
class ChunkedTensor:
    """This rank's chunks of one canonical tensor (views of its local tensor)."""

    def __init__(self, shape: tuple[int, ...], chunks: list[Chunk]):
        self.shape = torch.Size(shape)
        self.chunks = [(torch.Size(o), v) for o, v in chunks]

    def size(self) -> torch.Size:
        return self.shape

    def chunk_list(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=v.size()) for o, v in self.chunks]

    def write_items(self, fqn: str) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=o, sizes=v.size()),
                    properties=TensorProperties.create_from_tensor(v),
                    size=self.shape,
                ),
            )
            for o, v in self.chunks
        ]

    def chunk_at(self, index: MetadataIndex) -> Tensor:
        if index.index is not None and index.index < len(self.chunks) and self.chunks[index.index][0] == index.offset:
            return self.chunks[index.index][1]
        for o, v in self.chunks:
            if o == index.offset:
                return v
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {tuple(index.offset or ())}")


class MeshCache:
    """1-D device meshes over the groups tensors are split over (``{"tp": group, "etp": group}``),
    created on first use (no collective)."""

    def __init__(self, groups: dict[str, Any]):
        self.groups = {k: g for k, g in groups.items() if g is not None}
        self._meshes: dict[tuple[str, str], Any] = {}

    def get(self, group: str, device_type: str):
        if group not in self.groups or not dist.is_initialized():
            return None
        if (group, device_type) not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            self._meshes[(group, device_type)] = DeviceMesh.from_group(self.groups[group], device_type)
        return self._meshes[(group, device_type)]


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def _as_dtensor(layout: TensorLayout, local: Tensor, shape: torch.Size, chunk: Chunk, meshes: Optional[MeshCache]):
    """The chunk as a ``DTensor`` ``Shard(dim)``, or None when DTensor would place it elsewhere."""
    if meshes is None:
        return None
    mesh = meshes.get(layout.group, local.device.type)
    if mesh is None or mesh.size() != layout.tp_size:
        return None
    from torch.distributed.tensor import DTensor, Shard

    offsets, view = chunk
    dim = layout.canonical_dim(local.dim())
    dt = DTensor.from_local(
        view, mesh, [Shard(dim)], run_check=False, shape=shape, stride=_contiguous_stride(shape)
    )
    placed = dt.__create_chunk_list__()  # DCP's view of where this rank's piece lies
    if len(placed) != 1 or tuple(placed[0].offsets) != tuple(offsets) or tuple(placed[0].sizes) != tuple(view.shape):
        return None
    return dt


def to_dcp_object(layout: TensorLayout, local: Tensor, meshes: Optional[MeshCache]):
    """What DCP receives for ``local`` (a plain tensor, a DTensor or a :class:`ChunkedTensor`)."""
    local = local.detach()
    chunks = layout.chunks(local)
    if not layout.sharded:
        return chunks[0][1]
    shape = torch.Size(layout.canonical_shape(local))
    if len(chunks) == 1:
        dt = _as_dtensor(layout, local, shape, chunks[0], meshes)
        if dt is not None:
            return dt
    return ChunkedTensor(shape, chunks)


def split_objects(objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, ChunkedTensor]]:
    plain = {k: v for k, v in objects.items() if not isinstance(v, ChunkedTensor)}
    chunked = {k: v for k, v in objects.items() if isinstance(v, ChunkedTensor)}
    return plain, chunked


# --------------------------------------------------------------------------------------- planners
class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner plus write items for :class:`ChunkedTensor` entries."""

    def __init__(self, chunked: dict[str, ChunkedTensor]):
        # Our keys are flat; nested values (lists, dicts) are single objects, not trees to flatten.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunked = chunked

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        extra = [item for fqn, obj in self._chunked.items() for item in obj.write_items(fqn)]
        self.plan = dataclasses.replace(plan, items=list(plan.items) + extra)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self._chunked.get(index.fqn)
        if obj is not None:
            return obj.chunk_at(index)
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner plus read items for :class:`ChunkedTensor` entries; byte items
    are read as data only (:mod:`.safe_unpickle`), never with ``weights_only=False``."""

    def __init__(self, chunked: dict[str, ChunkedTensor], path: Path):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=False)
        self._chunked = chunked
        self._path = path

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = load_byte_item(value, f"{self._path}: the item {fqn!r}")

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        assert self.metadata is not None
        for fqn, obj in self._chunked.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            if not isinstance(md, TensorStorageMetadata) or md.size != obj.size():
                found = md.size if isinstance(md, TensorStorageMetadata) else "an object"
                raise ValueError(f"Size mismatch between saved {found} and current: {obj.size()} for {fqn}")
            items += create_read_items_for_chunk_list(fqn, md, obj.chunk_list())
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        obj = self._chunked.get(index.fqn)
        if obj is not None:
            return obj.chunk_at(index)
        return super().lookup_tensor(index)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with ``.metadata`` unpickled as data only (:mod:`.safe_unpickle`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = load_metadata_pickle(metadata_file, str(path))
        if not isinstance(metadata, Metadata):
            raise CheckpointNotFoundError(f"{path} holds a {type(metadata).__name__}, not DCP metadata.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ------------------------------------------------------------------------------------ directories
def default_barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def save_state(
    path: PathLike,
    objects: dict[str, Any],
    *,
    is_coordinator: bool,
    barrier: Callable[[], None] = default_barrier,
) -> None:
    """Collective: write ``objects`` (this rank's part) as one DCP checkpoint at ``path``.

    Crash safety: everything is written into ``<path>.tmp``; DCP writes ``.metadata`` last,
    after every rank's data; only then, after a barrier, does the coordinator move the
    directory to ``path`` (an existing checkpoint there is replaced). A crash leaves at most
    a ``.tmp`` directory that no loader accepts.
    """
    tmp = prepare_tmp_dir(path, is_coordinator=is_coordinator, barrier=barrier)
    write_dcp(tmp, objects)
    barrier()
    if is_coordinator:
        publish(path)
    barrier()


def prepare_tmp_dir(path: PathLike, *, is_coordinator: bool, barrier: Callable[[], None]) -> Path:
    """Collective: an empty ``<path>.tmp`` for every rank to write into (made by the coordinator)."""
    final = Path(path)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if is_coordinator:
        recover_replaced_checkpoint(final)
        _rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    return tmp


def write_dcp(tmp: Path, objects: dict[str, Any], process_group: Any = None) -> None:
    """Collective over ``process_group``: DCP writes this rank's ``objects`` into ``tmp``."""
    plain, chunked = split_objects(objects)
    dcp.save(
        plain,
        storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True, thread_count=1),
        planner=_SavePlanner(chunked),
        process_group=process_group,
    )


def publish(path: PathLike) -> None:
    """Coordinator, after every rank's data and ``.metadata`` are in ``<path>.tmp``: make it ``path``."""
    final = Path(path)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    old = final.with_name(final.name + OLD_SUFFIX)
    if not (tmp / METADATA_FILE).is_file():  # pragma: no cover - DCP raises first
        raise RuntimeError(f"DCP finished without writing {tmp / METADATA_FILE}")
    if final.exists() or final.is_symlink():
        _rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _rmtree(old)


def snapshot(objects: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``objects`` on the CPU that training may not change while it is written:
    tensors cloned, DTensors as :class:`ChunkedTensor`\\ s of cloned local pieces (the same on
    disk), other objects deep-copied."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for key, value in objects.items():
        if isinstance(value, DTensor):
            (placed,) = value.__create_chunk_list__()
            out[key] = ChunkedTensor(value.shape, [(tuple(placed.offsets), _cpu_copy(value.to_local()))])
        elif isinstance(value, ChunkedTensor):
            out[key] = ChunkedTensor(value.shape, [(o, _cpu_copy(v)) for o, v in value.chunks])
        elif isinstance(value, Tensor):
            out[key] = _cpu_copy(value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _cpu_copy(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True)


def recover_replaced_checkpoint(path: PathLike) -> bool:
    """Replacing a checkpoint takes two renames (``path`` -> ``path.old``, ``path.tmp`` -> ``path``);
    a kill between them leaves only ``path.old``. Put it back (returns whether it did)."""
    final = Path(path)
    old = final.with_name(final.name + OLD_SUFFIX)
    if final.exists() or not (old / METADATA_FILE).is_file():
        return False
    try:
        os.replace(old, final)
    except FileNotFoundError:  # another rank of the same job put it back first
        return False
    return True


def check_checkpoint_dir(path: PathLike) -> Path:
    p = Path(path)
    if not p.exists() and recover_replaced_checkpoint(p):
        warnings.warn(f"{p}: a save that was replacing it was interrupted; the previous checkpoint was restored.")
    if not p.is_dir():
        hint = ""
        if p.is_file():
            hint = (
                " It is a single file (a torch.save checkpoint?); MegatronStrategy checkpoints are "
                "directories. To start from full weights, load them into the module with "
                "megastrategy.checkpoint.load_full_state_dict."
            )
        elif p.with_name(p.name + TMP_SUFFIX).is_dir():
            hint = f" Only {p.name + TMP_SUFFIX} exists: the save was interrupted before it completed."
        else:
            hint = " It does not exist."
        raise CheckpointNotFoundError(f"{p} is not a megastrategy checkpoint directory.{hint}")
    if not (p / METADATA_FILE).is_file():
        legacy = (p / "megastrategy_meta.json").is_file()
        hint = (
            " It is in the old one-file-per-rank format, which this version does not read."
            if legacy
            else " The save did not finish, or this is not a checkpoint directory."
        )
        raise CheckpointNotFoundError(
            f"{p} is not a complete megastrategy checkpoint: DCP's {METADATA_FILE} is missing.{hint}"
        )
    return p


def read_metadata(path: PathLike) -> Metadata:
    """DCP's metadata (every key with its global size and chunks); raises when incomplete."""
    return SafeFileSystemReader(str(check_checkpoint_dir(path))).read_metadata()


def verify_shard_files(path: PathLike, metadata: Metadata) -> None:
    """Refuse a checkpoint whose shard files are missing or shorter than the metadata says,
    before anything is loaded (DCP itself would fail mid-load with an opaque per-rank error)."""
    p = Path(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, size in sorted(needed.items()):
        f = p / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size < size:
            problems.append(f"{name} has {f.stat().st_size} bytes, the metadata needs {size}")
    if problems:
        raise CheckpointCorruptError(
            f"{p} is incomplete: {'; '.join(problems)}. Nothing was loaded. The shard files were lost or "
            "truncated after the save; resume from an earlier checkpoint."
        )


def load_state(path: PathLike, objects: dict[str, Any]) -> dict[str, Any]:
    """Read ``objects`` (templates, loaded in place; objects stored as bytes are replaced)."""
    p = check_checkpoint_dir(path)
    plain, chunked = split_objects(objects)
    if not plain and not chunked:
        return plain
    reader = SafeFileSystemReader(str(p))
    verify_shard_files(p, reader.read_metadata())
    with warnings.catch_warnings():  # no_dist is deliberate (see the module docstring)
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        try:
            dcp.load(plain, storage_reader=reader, planner=_LoadPlanner(chunked, p), no_dist=True)
        except CheckpointException as err:  # e.g. a shard of the right size with garbage in it
            failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
            unsafe = next((e for e in failures if isinstance(e, UnsafeCheckpointError)), None)
            if unsafe is not None:
                raise unsafe from None
            causes = "; ".join(f"{type(e).__name__}: {e}" for e in failures)
            raise CheckpointCorruptError(f"{p} could not be read ({causes or err}); the shard files are damaged.") from err
    return plain


def template_for(md: Any) -> Any:
    """An empty full tensor for a tensor entry, a placeholder for an object entry."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    if isinstance(md, BytesStorageMetadata):
        return None
    raise TypeError(f"unknown DCP storage metadata {type(md).__name__}")


def remove_checkpoint_dir(path: PathLike) -> None:
    """Delete a checkpoint (directory or stray file) and any interrupted ``.tmp`` twin."""
    p = Path(path)
    _rmtree(p)
    _rmtree(p.with_name(p.name + TMP_SUFFIX))
