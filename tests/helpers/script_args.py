"""What every launched test script shares: the command line (where to write, which strategy, which
layout) and the way out."""
from __future__ import annotations

import argparse
import os
import sys


def layout_parser() -> argparse.ArgumentParser:
    """``--out``, ``--strategy ddp|megatron``, ``--tp``, ``--pp``, ``--vp``; a script adds its own options."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["ddp", "megatron"], required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vp", type=int, default=None)
    return p


def leave_without_static_destructors() -> None:
    """End the process after a clean run without C++ static destructors: gloo's threads can abort
    the process at interpreter exit ("terminate called without an active exception")."""
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()
    os._exit(0)
