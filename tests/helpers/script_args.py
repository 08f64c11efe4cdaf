"""The command line every launched test script shares: where to write, which strategy, which layout."""
from __future__ import annotations

import argparse


def layout_parser() -> argparse.ArgumentParser:
    """``--out``, ``--strategy ddp|megatron``, ``--tp``, ``--pp``, ``--vp``; a script adds its own options."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["ddp", "megatron"], required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vp", type=int, default=None)
    return p
