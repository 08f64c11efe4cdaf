"""A timm Vision Transformer under pp=2: its blocks are an ``nn.Sequential`` the forward calls
whole (``self.blocks(x)``), split into stages like a list. Skipped where timm cannot be imported."""
import pytest

from tests.helpers.timm_runs import assert_vit_matches_ddp


@pytest.mark.timeout(500)
def test_vit_trains_like_one_device_pp2():
    assert_vit_matches_ddp("--pp", "2")
