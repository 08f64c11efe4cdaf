"""A forward that hands a value computed before the layer stack to anything but the first block is
refused on the stages that hold only a stand-in's zeros for it, in the chunk's first forward;
values built from such a tensor's shape, dtype or device only (masks, rotary tables) pass."""
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from megastrategy.anatomy import ModelAnatomy
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.stage import StageBoundary, cut_stage
from megastrategy.pipeline.stand_in_values import StandInValue, mark, refuse_if_marked, sources_of, stage_place
from tests.helpers.launch import run_script, run_script_to_the_end


def test_marks_follow_values_and_not_shapes():
    x = mark(torch.zeros(2, 3), ["embed"])
    y = mark(torch.zeros(2, 3), ["other"])
    assert sources_of((x * 2 + 1).sum()) == {"embed"}
    assert sources_of(torch.cat([x, y])) == {"embed", "other"}
    assert sources_of({"a": [torch.relu(x)]}) == {"embed"}
    for value_free in (torch.zeros_like(x), x.new_zeros(4), torch.ones(x.shape[0], dtype=x.dtype, device=x.device)):
        assert not isinstance(value_free, StandInValue)
    assert not sources_of(torch.arange(x.size(1)))


def test_a_marked_tensor_keeps_its_autograd_history():
    w = torch.ones(3, requires_grad=True)
    marked = mark(w * 2, ["embed"])
    (marked * 3).sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 6.0))


def test_refusal_names_where_and_what():
    refuse_if_marked((torch.zeros(2), {"k": 1}), "head", stage_place(1, 1, 1))  # nothing marked: nothing happens
    with pytest.raises(MegatronConfigError, match=r"head .*computed by embed on pipeline stage 1.*pp=1"):
        refuse_if_marked([mark(torch.zeros(2), ["embed"])], "head", stage_place(1, 1, 1))


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, bias=None):
        return x + torch.tanh(self.lin(x)) + (0 if bias is None else bias)


class _Model(nn.Module):
    """An embedding before a stack of 4 blocks, a head after it. ``side`` says where the embedding
    also goes: nowhere (only shapes are read), a block's second input, or the head's input."""

    def __init__(self, side: str):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(_Block(4) for _ in range(4))
        self.head = nn.Linear(4, 2)
        self.side = side

    def forward(self, ids):
        e = self.embed(ids)
        h = e * math.sqrt(4)
        mask = torch.ones(h.shape[:2], dtype=h.dtype, device=h.device)  # built from the shape only: fine
        bias = h if self.side == "block" else None
        for block in self.blocks:
            h = block(h, bias)
        out = self.head(h + e if self.side == "head" else h) * mask[..., None]
        return out.sum()


def _last_stage(side: str):
    model = _Model(side)
    anatomy = ModelAnatomy.of(model, "blocks")
    stage = cut_stage(model, stack_path="blocks", stack=anatomy.stack, assignment=assign_layers(4, 2), pp_rank=1,
                      pp_size=2, vp_size=1, anatomy=anatomy)
    return model, stage


def _run(model, stage, received):
    stage.activate(0, received)
    try:
        return model(torch.randint(0, 10, (2, 5)))
    finally:
        stage.deactivate()


def test_a_value_that_reaches_only_the_first_block_or_shapes_passes_and_is_checked_once():
    model, stage = _last_stage("none")
    hooks = lambda: sum(len(m._forward_pre_hooks) for m in model.modules())  # noqa: E731
    before = hooks()
    out = _run(model, stage, torch.randn(2, 5, 4))
    assert not isinstance(out, StandInValue) and stage._probed_chunks == {0} and hooks() == before
    model.side = "block"  # a leak now would go unseen: the chunk was checked, and the check costs nothing more
    assert not isinstance(_run(model, stage, torch.randn(2, 5, 4)), StandInValue)


@pytest.mark.parametrize("side, where", [("block", r"blocks\.2 \(on its inputs\)"), ("head", r"head \(on its inputs\)")])
def test_a_value_that_reaches_a_block_or_the_head_is_refused(side, where):
    model, stage = _last_stage(side)
    with pytest.raises(MegatronConfigError, match=where + r".*computed by embed"):
        _run(model, stage, torch.randn(2, 5, 4))


def test_an_intermediate_stage_refuses_a_marked_boundary():
    model = _Model("block")
    anatomy = ModelAnatomy.of(model, "blocks")
    stage = cut_stage(model, stack_path="blocks", stack=anatomy.stack, assignment=assign_layers(4, 4), pp_rank=1,
                      pp_size=4, vp_size=1, anatomy=anatomy)
    stage._probe_targets = [[]]  # no input checks: the hidden state handed on must be caught by itself
    with pytest.raises(MegatronConfigError, match="hidden state blocks hands the next stage"):
        _run(model, stage, torch.randn(2, 5, 4))
    model, stage = _Model("none"), None
    anatomy = ModelAnatomy.of(model, "blocks")
    stage = cut_stage(model, stack_path="blocks", stack=anatomy.stack, assignment=assign_layers(4, 4), pp_rank=1,
                      pp_size=4, vp_size=1, anatomy=anatomy)
    with pytest.raises(StageBoundary) as boundary:
        _run(model, stage, torch.randn(2, 5, 4))
    assert not isinstance(boundary.value.output, StandInValue)


DEMO = Path(__file__).resolve().parents[1] / "scripts" / "lightning_demo.py"


@pytest.mark.timeout(300)
def test_lightning_demo_transformer_is_refused_under_pp_before_training_and_matches_ddp_under_tp():
    """Lightning's demo ``Transformer`` embeds the decoder's target before the encoder's layers (the
    stack pp splits) and hands it to the decoder after them: at pp=2 the last stage would decode
    zeros. Every rank stops in the sanity check with the names; the same module trains at tp=2."""
    ranks = run_script_to_the_end(DEMO, 2, ["--strategy", "megatron", "--pp", "2"], timeout=180)
    assert all(code not in (0, None) for code, _, _ in ranks), [code for code, _, _ in ranks]
    assert any("model.transformer.decoder (on its inputs) uses a value computed by model.embedding" in log
               for _, log, _ in ranks), ranks[1][1][-3000:]
    assert any("failed while validation_step (batch 0)" in log for _, log, _ in ranks)  # the sanity check's first batch
    reference = run_script(DEMO, 1, ["--strategy", "ddp"], timeout=180)
    tp2 = run_script(DEMO, 2, ["--strategy", "megatron", "--tp", "2"], timeout=180)
    assert len(tp2["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(tp2["losses"], reference["losses"])) < 2e-4
    assert abs(tp2["val_loss"] - reference["val_loss"]) < 2e-4
