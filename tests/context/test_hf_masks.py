"""The mask rule of a Hugging Face layer, read off transformers' mask function on global
positions (hf_masks.py): causal, bidirectional, sliding window, or refused."""
from __future__ import annotations

import pytest
import torch
from transformers import masking_utils as mu

from megastrategy.context.hf_masks import MaskMarkers, classify
from megastrategy.errors import MegatronConfigError


@pytest.mark.parametrize("seq", [2, 12, 64])
def test_standard_masks_are_classified(seq):
    assert classify(mu.causal_mask_function, seq, "m") == (True, None)
    assert classify(mu.bidirectional_mask_function, seq, "m") == (False, None)
    window = classify(mu.sliding_window_causal_mask_function(5), seq, "m")
    assert window == ((True, 5) if seq > 5 else (True, None))


def test_masks_the_ring_cannot_reproduce_are_refused_naming_the_layer():
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    with pytest.raises(MegatronConfigError, match="attention in layer 3 .*neither causal nor bidirectional"):
        classify(chunked, 12, "layer 3")
    with pytest.raises(MegatronConfigError, match="neither causal nor bidirectional"):
        classify(mu.sliding_window_bidirectional_mask_function(2), 12, "layer 3")
    blocks = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(torch.tensor([[0, 0, 0, -1]])))
    with pytest.raises(MegatronConfigError, match="cannot be evaluated on global positions|neither causal"):
        classify(blocks, 12, "layer 3")


def test_a_marker_and_its_views_map_back_to_the_rule():
    markers = MaskMarkers()
    marker = markers.make((True, 4), 2, 6)
    assert markers.rule_of(marker) == (True, 4)
    assert markers.rule_of(marker[:, :, :, :3]) == (True, 4)  # an eager path slicing the mask to the keys
    assert markers.rule_of(torch.zeros(2, 1, 6, 0, dtype=torch.bool)) is None
