"""Read a sharded checkpoint one whole tensor at a time, and write it as bounded safetensors shards.

``consolidate`` holds the whole model in one process. For a model larger than a machine's memory
that is the failure users of consolidated saves know best. Here every tensor is assembled alone
(DCP reads only that tensor's chunks), written into the current output shard, and released when
the shard is full: peak memory is about one shard plus the largest tensor, whatever the model's size.
The output is Hugging Face's sharded layout (``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json``), which ``from_pretrained`` and ``safetensors`` read.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

from torch import Tensor

from megastrategy.checkpoint.dcp_io import PathLike, load_state, read_metadata, template_for

__all__ = ["DEFAULT_SHARD_BYTES", "model_key_order", "write_safetensors_shards"]

DEFAULT_SHARD_BYTES = 2 * 1024**3  # Hugging Face's own default is 5 GB; smaller shards bound memory tighter


def model_key_order(path: PathLike, prefix: str) -> list[str]:
    """The checkpoint's model keys (with ``prefix``) in the user's ``state_dict`` order; reads no tensor."""
    from megastrategy.checkpoint.sharded import INFO_KEY, ORDER_PREFIX, merge_orders, merged_key_order

    md = read_metadata(path).state_dict_metadata
    keys = [k for k in md if k.startswith(prefix)]
    order_keys = [k for k in md if k.startswith(ORDER_PREFIX)]
    loaded = load_state(path, {k: None for k in order_keys + ([INFO_KEY] if INFO_KEY in md else [])})
    by_stage: dict[int, list[list[str]]] = {}
    for k in sorted(order_keys, key=lambda k: int(k[len(ORDER_PREFIX) :])):  # by global rank
        entry = loaded[k]
        by_stage.setdefault(int(entry["pp"]), []).append([prefix + n for n in entry["keys"]])
    stages = {pp: merge_orders(lists) for pp, lists in by_stage.items()}
    info = loaded.get(INFO_KEY) or {}
    order = [k for k in merged_key_order(stages, info.get("stack_path")) if k in md]
    return order + [k for k in keys if k not in set(order)]


def _shard_plan(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive names grouped into shards of at most ``max_bytes`` (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return [s for s in shards if s]


def write_safetensors_shards(
    path: PathLike, out_dir: PathLike, *, prefix: str, strip: str = "", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    rename: Optional[Callable[[str], Optional[str]]] = None,
) -> dict[str, Any]:
    """Stream the model tensors under ``prefix + strip`` into safetensors shards in ``out_dir``.

    ``strip`` is removed from the names (``"model."`` for a LightningModule holding a Hugging Face
    model as ``self.model``); ``rename`` may map a name to another, or to None to leave it out.
    Returns the index (``metadata.total_size`` and ``weight_map``), also written as JSON.
    """
    from safetensors.torch import save_file

    md = read_metadata(path).state_dict_metadata
    wanted: list[tuple[str, str, int]] = []  # (checkpoint key, output name, bytes)
    for key in model_key_order(path, prefix + strip):
        name = key[len(prefix + strip) :]
        name = rename(name) if rename is not None else name
        if name is not None:
            size = md[key].size.numel() * md[key].properties.dtype.itemsize
            wanted.append((key, name, size))
    if not wanted:
        raise ValueError(f"no model tensor of {path} starts with {strip!r}; check the prefix to strip.")
    plan = _shard_plan([(key, size) for key, _, size in wanted], max_shard_bytes)
    names = {key: name for key, name, _ in wanted}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for i, keys in enumerate(plan, 1):
        file = f"model-{i:05d}-of-{len(plan):05d}.safetensors" if len(plan) > 1 else "model.safetensors"
        loaded = load_state(path, {k: template_for(md[k]) for k in keys})  # one read per shard
        tensors = {names[k]: loaded[k].contiguous() for k in keys}
        del loaded
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({names[k]: file for k in keys})
        del tensors
    index = {"metadata": {"total_size": sum(size for _, _, size in wanted)}, "weight_map": weight_map}
    if len(plan) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return index
