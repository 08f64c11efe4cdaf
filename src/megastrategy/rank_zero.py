"""Say it once per job: messages that every rank would repeat identically go out on global rank 0.

Lightning's ``rank_zero_*`` helpers would do, but importing Lightning here would make every
megastrategy module pull it in; the rank comes from ``torch.distributed`` (or, before the
process group exists, the launcher's ``RANK``/``SLURM_PROCID``), so there is no state to set.
"""
from __future__ import annotations

import logging
import os

import torch.distributed as dist

__all__ = ["is_rank_zero", "log_on_rank_zero"]


def is_rank_zero() -> bool:
    """Global rank 0 of the job (True outside a distributed job)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def log_on_rank_zero(logger: logging.Logger, level: int, message: str) -> None:
    """``logger.log(level, message)`` on global rank 0 only: for messages true of every rank."""
    if is_rank_zero():
        logger.log(level, message)
