"""Sharded checkpoints: a directory with one file per rank plus a layout record.

Each rank writes exactly the shards it holds, so nothing is gathered through one process.
The layout record lets a load on a different layout fail with a clear message instead of
silently loading mismatched shards.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

META_FILE = "megastrategy_meta.json"


def rank_file(path: str | os.PathLike, rank: int) -> Path:
    return Path(path) / f"rank_{rank:05d}.pt"


def save_rank_shard(checkpoint: dict[str, Any], path: str | os.PathLike, rank: int) -> None:
    """Write this rank's part under ``path``; the file appears whole or not at all."""
    target = rank_file(path, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".pt.tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, target)


def write_meta(path: str | os.PathLike, meta: dict[str, Any]) -> None:
    target = Path(path) / META_FILE
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.replace(tmp, target)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    target = Path(path) / META_FILE
    if not target.is_file():
        raise FileNotFoundError(
            f"{path} is not a complete megastrategy checkpoint: {META_FILE} is missing "
            "(the save did not finish, or this is not a checkpoint directory)."
        )
    return json.loads(target.read_text())


def load_rank_shard(path: str | os.PathLike, rank: int, *, expected_layout: dict[str, Any]) -> dict[str, Any]:
    meta = read_meta(path)
    saved = meta.get("layout", {})
    if saved != expected_layout:
        diff = {k: (saved.get(k), expected_layout.get(k)) for k in expected_layout if saved.get(k) != expected_layout.get(k)}
        raise ValueError(
            f"checkpoint {path} was written with layout {saved}, but this run uses {expected_layout} "
            f"(differences as saved→now: {diff}). Resume with the same tp/pp/dp layout."
        )
    target = rank_file(path, rank)
    if not target.is_file():
        raise FileNotFoundError(f"checkpoint {path} has no shard for rank {rank} ({target.name} is missing).")
    return torch.load(target, map_location="cpu", weights_only=False)


def remove(path: str | os.PathLike) -> None:
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()
