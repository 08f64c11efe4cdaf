"""Global positions for models that number positions themselves (positions.py), checked on the
split arithmetic alone (the cp sweep checks whole models on real processes)."""
from __future__ import annotations

import torch
from torch import nn

from megastrategy.context.layout import SequenceLayout
from megastrategy.context.positions import globalize, padding_index_numbering, padding_numbered_positions


def test_a_locally_numbered_run_becomes_the_ranks_global_positions():
    layout = SequenceLayout("balanced", 8, 2)
    for rank in range(2):
        positions = layout.positions(rank)
        assert torch.equal(globalize(torch.arange(4), positions), positions)  # BART: arange(local)
    positions = layout.positions(0)  # chunks 0 and 3: not a run, so any run was numbered locally
    assert torch.equal(globalize(torch.arange(4)[None].expand(3, -1) + 2, positions), (positions[None] + 2).expand(3, -1))


def test_global_or_user_positions_are_left_alone():
    balanced, contiguous = SequenceLayout("balanced", 8, 2), SequenceLayout("contiguous", 8, 2)
    given = balanced.positions(1)[None] + 5  # user positions, split: never a run under the balanced layout
    assert globalize(given, balanced.positions(1)) is given
    run = contiguous.positions(1)[None]  # the contiguous layout's global positions are a run
    assert globalize(run, contiguous.positions(1)) is run
    assert torch.equal(globalize(torch.arange(4), contiguous.positions(1)), contiguous.positions(1))


def test_padding_index_numbering_follows_the_model_rule_on_the_whole_sequence():
    ids = torch.tensor([[5, 6, 7, 8, 9, 1, 1, 1]])  # right padding with padding_idx 1
    numbered = padding_numbered_positions({"input_ids": ids}, 1, 8)
    assert numbered.tolist() == [[2, 3, 4, 5, 6, 1, 1, 1]]  # RoBERTa's create_position_ids_from_input_ids


def test_padding_index_numbering_is_found_on_a_position_table_with_padding_idx():
    class Embeddings(nn.Module):
        def __init__(self, padding_idx):
            super().__init__()
            self.position_embeddings = nn.Embedding(16, 4, padding_idx=padding_idx)

    assert padding_index_numbering(Embeddings(1)) == 1
    assert padding_index_numbering(Embeddings(None)) is None
