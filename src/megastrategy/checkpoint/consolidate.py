"""Offline tools: one full ``state_dict`` from a sharded checkpoint, and a Hugging Face export.

Everything here runs in one process with no process group: DCP reads the files directly.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from megastrategy.checkpoint.dcp_io import PathLike
from megastrategy.checkpoint.sharded import load_full_model_state, read_info, read_lightning_metadata

__all__ = ["consolidate", "consolidate_lightning", "export_hf", "import_object"]

#: Lightning keys kept by :func:`consolidate_lightning` (enough for ``load_from_checkpoint``)
_LIGHTNING_KEEP = ("epoch", "global_step", "pytorch-lightning_version", "hyper_parameters", "hparams_name", "hparams_type")


def consolidate(path: PathLike) -> dict[str, Tensor]:
    """The user's ORIGINAL full ``state_dict`` from the sharded checkpoint directory ``path``.

    Original names (``in_proj_weight``, tied parameters under each of their names), original
    shapes (unpadded vocabulary, packed QKV as ``[3H, in]``, ``Conv1D`` weights ``[in, out]``),
    whatever ``tp``/``pp``/``dp`` wrote it; holds the whole model in this process's memory.
    """
    read_info(path)  # a clear error for a DCP checkpoint that megastrategy did not write
    return load_full_model_state(path)


def consolidate_lightning(path: PathLike) -> dict[str, Any]:
    """A single-file Lightning checkpoint for ``LightningModule.load_from_checkpoint`` (weights only)."""
    meta = read_lightning_metadata(path)
    out = {k: meta[k] for k in _LIGHTNING_KEEP if k in meta}
    out["state_dict"] = consolidate(path)
    return out


def import_object(dotted: str) -> Any:
    """``"transformers.BertForSequenceClassification"`` -> the class."""
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"{dotted!r}: give the full dotted path, e.g. transformers.BertForSequenceClassification")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def export_hf(
    state_dict: dict[str, Tensor],
    *,
    hf_class: str | type,
    hf_config: PathLike,
    out_dir: PathLike,
    prefix: str = "",
) -> Any:
    """Build ``hf_class`` from the config in ``hf_config``, load the keys of ``state_dict`` under
    ``prefix`` (e.g. ``"model."`` for a LightningModule holding the model as ``self.model``)
    into it and ``save_pretrained(out_dir)``. Returns the model."""
    cls = import_object(hf_class) if isinstance(hf_class, str) else hf_class
    config_class = getattr(cls, "config_class", None)
    if config_class is None:  # pragma: no cover - every PreTrainedModel has one
        from transformers import AutoConfig as config_class
    config = config_class.from_pretrained(str(hf_config))
    model = cls(config)
    sub = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not sub:
        sample = ", ".join(list(state_dict)[:3])
        raise ValueError(f"no key of the checkpoint starts with prefix={prefix!r}; keys look like: {sample}")
    missing, unexpected = model.load_state_dict(sub, strict=False)
    if unexpected:
        raise ValueError(
            f"{len(unexpected)} checkpoint keys are not in {cls.__name__}: {unexpected[:5]} "
            f"(is prefix={prefix!r} right?)"
        )
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    loaded_ptrs = {t.data_ptr() for k, t in model.state_dict().items() if k in sub}
    untied = [k for k in missing if model.state_dict()[k].data_ptr() not in loaded_ptrs]
    if untied:
        raise ValueError(f"{len(untied)} tensors of {cls.__name__} are not in the checkpoint: {untied[:5]}")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    return model


def save_state_dict(state_dict: dict[str, Any], out: PathLike, extra: Optional[dict] = None) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state_dict if extra is None else {**extra, **state_dict}, str(out))
