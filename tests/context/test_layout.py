"""SequenceLayout: which tokens each rank holds, pure arithmetic."""
from __future__ import annotations

import pytest
import torch

from megastrategy.context.layout import SequenceLayout
from megastrategy.errors import MegatronConfigError


def test_balanced_layout_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    layout = SequenceLayout("balanced", 16, 4)
    assert layout.positions(0).tolist() == [0, 1, 14, 15]
    assert layout.positions(3).tolist() == [6, 7, 8, 9]


def test_contiguous_layout_and_merge_inverts_split():
    x = torch.arange(2 * 24).view(2, 24)
    for kind in ("balanced", "contiguous"):
        layout = SequenceLayout(kind, 24, 3)
        parts = [layout.split(x, r) for r in range(3)]
        assert torch.equal(layout.merge(parts), x)
        assert sorted(torch.cat([layout.positions(r) for r in range(3)]).tolist()) == list(range(24))


def test_balanced_causal_work_is_equal_per_rank():
    layout = SequenceLayout("balanced", 64, 4)
    work = [int((layout.positions(r) + 1).sum()) for r in range(4)]  # keys seen by each query
    assert max(work) == min(work)


@pytest.mark.parametrize("kind, seq, cp, multiple", [("balanced", 14, 2, 4), ("contiguous", 10, 4, 4)])
def test_indivisible_sequence_names_the_multiple(kind, seq, cp, multiple):
    with pytest.raises(MegatronConfigError, match=f"not divisible by {multiple}"):
        SequenceLayout(kind, seq, cp)
