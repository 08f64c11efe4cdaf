"""Read a checkpoint as data: every pickle in it goes through an unpickler that admits only the
types checkpoints are made of, so a crafted checkpoint cannot run code when it is loaded.

Torch DCP reads ``.metadata`` with ``pickle.load`` and byte items with
``torch.load(weights_only=False)``: either executes whatever a pickle's ``__reduce__`` names.
Here instead:

* ``.metadata`` is read by :class:`MetadataUnpickler`, which knows DCP's metadata classes,
  ``torch.Size``, dtypes, layouts and paths, and nothing else;
* byte items (Lightning's loop/callback state, optimizer hyperparameters, per-rank random
  states) are read by torch's ``weights_only`` unpickler; megastrategy saves them as tensors,
  numbers, strings, lists, tuples and plain dicts (:func:`as_data`), which is all it admits.

Anything else is refused with an :class:`~megastrategy.errors.UnsafeCheckpointError` naming the
type. A type the user trusts (e.g. a config dataclass in ``hparams``) is admitted with torch's
own ``torch.serialization.add_safe_globals([MyType])``.
"""
from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from typing import Any, BinaryIO

import torch
from torch.torch_version import TorchVersion

from megastrategy.errors import UnsafeCheckpointError

__all__ = ["as_data", "load_metadata_pickle", "load_byte_item"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ADMITTED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a name -> one of torch's layout objects
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex"}),
}


def _refuse(source: str, type_name: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source} names the type {type_name}, which is not data a checkpoint is made of: unpickling it could "
        "import and run arbitrary code, so nothing was loaded. If you wrote this checkpoint and trust it, admit "
        f"the type with torch.serialization.add_safe_globals([{type_name}])."
    )


def _refuse_torch(source: str, err: pickle.UnpicklingError) -> UnsafeCheckpointError:
    """The type torch's data-only unpickler refused, from its message."""
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return _refuse(source, found.group(1))
    detail = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()[0] if text else type(err).__name__
    return UnsafeCheckpointError(f"{source} is not plain data ({detail}); it was refused and nothing was loaded.")


def as_data(value: Any) -> Any:
    """``value`` with dict subclasses (Lightning's ``AttributeDict`` in ``hparams``) as plain dicts,
    lists and tuples walked, so that what is saved reads back with the data-only unpickler."""
    if isinstance(value, dict) and type(value) not in (dict, OrderedDict):
        return {k: as_data(v) for k, v in value.items()}
    if isinstance(value, dict):
        return type(value)((k, as_data(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(as_data(v) for v in value)
    if isinstance(value, str) and type(value) is not str:  # torch.__version__ is a TorchVersion
        return str(value)
    return value


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` for DCP's ``.metadata``: DCP's own classes and plain values only."""

    def __init__(self, file: BinaryIO, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ADMITTED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if _is_safe_global(module, name):
            return super().find_class(module, name)
        raise _refuse(self.source, f"{module}.{name}")


def _is_safe_global(module: str, name: str) -> bool:
    """Types the user admitted with ``torch.serialization.add_safe_globals``."""
    for g in torch.serialization.get_safe_globals():
        obj = g[0] if isinstance(g, tuple) else g
        if getattr(obj, "__module__", None) == module and getattr(obj, "__qualname__", None) == name:
            return True
    return False


def load_metadata_pickle(file: BinaryIO, source: str) -> Any:
    """Unpickle DCP metadata from ``file`` (``source`` names it in errors)."""
    try:
        return MetadataUnpickler(file, source).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
        raise UnsafeCheckpointError(f"{source} is not a readable DCP metadata pickle ({type(err).__name__}: {err}); "
                                    "nothing was loaded.") from err


def _numeric_numpy_arrays() -> list[Any]:
    """What a NumPy array of numbers unpickles through (no code of its own runs): NumPy's RNG
    state in checkpoints written before it was stored as tensors, arrays in callback state."""
    try:
        import numpy
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - NumPy 1.x or no NumPy
        return []
    kinds = "?bhilqBHILQefdg"
    return [_reconstruct, numpy.ndarray, numpy.dtype, *{type(numpy.dtype(k)) for k in kinds}]


def load_byte_item(value: io.BytesIO, source: str) -> Any:
    """``torch.load`` of one DCP byte item with torch's data-only unpickler (plus version
    strings and numeric NumPy arrays)."""
    try:
        with torch.serialization.safe_globals([TorchVersion, *_numeric_numpy_arrays()]):
            return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        raise _refuse_torch(source, err) from None
