"""A tiny timm Vision Transformer, and one DDP reference run of the LightningModule in
tests/scripts/timm_vit.py shared by the tp (tests/layers) and pp (tests/pipeline) comparisons.

timm imports torchvision, and this project's CPU torch has no matching torchvision wheel on some
machines (the CUDA build fails to load its operators): then these tests skip, saying so."""
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "timm_vit.py"


def import_timm_or_skip():
    try:
        import timm
    except Exception as e:  # noqa: BLE001 - a broken torchvision raises RuntimeError, not ImportError
        pytest.skip(f"timm is optional and not importable here ({type(e).__name__}: {e}); "
                    "pip install --no-deps timm and a torchvision built for this torch")
    return timm


def tiny_vit():
    """4 blocks, embedding 32, 4 heads, 32x32 images in 8x8 patches, 10 classes."""
    return import_timm_or_skip().create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10,
                                              depth=4, embed_dim=32, num_heads=4)


@lru_cache(maxsize=None)
def vit_run(nprocs: int, *args: str) -> dict:
    return run_script(SCRIPT, nprocs, list(args), timeout=240)


def assert_vit_matches_ddp(*layout: str) -> None:
    import_timm_or_skip()
    reference, ours = vit_run(1, "--strategy", "ddp"), vit_run(2, "--strategy", "megatron", *layout)
    assert len(ours["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(ours["losses"], reference["losses"])) < 2e-4
    assert abs(ours["val_loss"] - reference["val_loss"]) < 2e-4
