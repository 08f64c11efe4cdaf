"""Ring attention on real gloo processes against full attention on one process.

Every case (causal, bidirectional with padding, sliding window, GQA; balanced and contiguous
layouts) runs in one launch per cp size: each rank compares its slice of the output and of
the q/k/v gradients with the single-process reference computed from the same seed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist import run_distributed

TOL = dict(rtol=2e-4, atol=2e-5)
CASES = [  # (layout, causal, window, padding, value width; queries and keys are 8 wide)
    ("balanced", True, None, False, 8),
    ("balanced", True, 5, False, 8),
    ("balanced", True, 11, True, 8),
    ("contiguous", False, None, True, 8),
    ("contiguous", True, None, False, 8),
    ("balanced", True, 5, False, 5),  # multi-head latent attention: values narrower than keys
]


def reference_mask(seq: int, causal: bool, window, key_padding):
    pos = torch.arange(seq)
    allowed = torch.ones(seq, seq, dtype=torch.bool)
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    allowed = allowed[None, None]
    return allowed & key_padding[:, None, None, :] if key_padding is not None else allowed


def _inputs(seed: int, seq: int, v_dim: int = 8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, seq, 8, generator=gen)
    k, v = torch.randn(2, 2, seq, 8, generator=gen), torch.randn(2, 2, seq, v_dim, generator=gen)
    grad = torch.randn(2, 4, seq, v_dim, generator=gen)
    padding = torch.ones(2, seq, dtype=torch.bool)
    padding[1, seq - 5 :] = False
    return q, k, v, grad, padding


def _check_case(rank, cp, case, seq, group=None):
    import torch.distributed as dist

    from megastrategy.context.layout import SequenceLayout
    from megastrategy.context.masks import MaskRule
    from megastrategy.context.ring import Ring
    from megastrategy.context.ring_attention import RingPlan, ring_attention

    kind, causal, window, pad, v_dim = case
    q, k, v, grad, padding = _inputs(seed=len(str(case)), seq=seq, v_dim=v_dim)
    key_padding = padding if pad else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, attn_mask=reference_mask(seq, causal, window, key_padding), enable_gqa=True)
    ref.backward(grad)
    layout = SequenceLayout(kind, seq, cp)
    local = [layout.split(t, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    plan = RingPlan(Ring.of(group or dist.group.WORLD), layout, MaskRule(causal, window, key_padding), 8 ** -0.5)
    out = ring_attention(*local, plan)
    out.backward(layout.split(grad, rank, dim=2))
    torch.testing.assert_close(out, layout.split(ref, rank, dim=2), **TOL, msg=f"output {case}")
    for name, mine, whole in zip("qkv", local, full):
        torch.testing.assert_close(mine.grad, layout.split(whole.grad, rank, dim=2), **TOL, msg=f"d{name} {case}")


def _all_cases(rank, world_size):
    for case in CASES:
        _check_case(rank, world_size, case, seq=8 * world_size)
    return True


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_attention(cp):
    assert all(run_distributed(_all_cases, cp, timeout=120))


def _subgroup_cases(rank, world_size):
    import torch.distributed as dist

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # cp groups of a tp=2 x cp=2 grid
    group = groups[rank % 2]
    for case in CASES[:3]:
        _check_case(dist.get_rank(group), 2, case, seq=16, group=group)
    return True


def test_ring_attention_on_cp_subgroups():
    assert all(run_distributed(_subgroup_cases, 4, timeout=120))


def _eager_reference(q, k, v, seq: int, sinks=None, softcap=None):
    """Eager causal attention, with one sink logit per head (GPT-OSS) and/or soft-capped scores (Gemma 2)."""
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~reference_mask(seq, True, None, None), float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :-1] @ v


def _sinks_and_softcap_case(rank, world_size, softcap):
    import torch.distributed as dist

    from megastrategy.context.layout import SequenceLayout
    from megastrategy.context.masks import MaskRule
    from megastrategy.context.ring import Ring
    from megastrategy.context.ring_attention import RingPlan, ring_attention

    seq = 8 * world_size
    q, k, v, grad, _ = _inputs(seed=7, seq=seq)
    q = q * 4  # scores large enough for the cap to bend them
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3))
    full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = _eager_reference(*full[:3], seq, sinks=full[3], softcap=softcap)
    ref.backward(grad)
    layout = SequenceLayout("balanced", seq, world_size)
    local = [layout.split(t, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    mine = sinks.clone().requires_grad_()
    plan = RingPlan(Ring.of(dist.group.WORLD), layout, MaskRule(True, None, None), 8 ** -0.5, softcap)
    out = ring_attention(*local, plan, sinks=mine)
    out.backward(layout.split(grad, rank, dim=2))
    torch.testing.assert_close(out, layout.split(ref, rank, dim=2), **TOL, msg="output with sinks")
    for name, got, whole in zip("qkv", local, full):
        torch.testing.assert_close(got.grad, layout.split(whole.grad, rank, dim=2), **TOL, msg=f"d{name} with sinks")
    sink_grad = mine.grad.clone()
    dist.all_reduce(sink_grad)  # every rank's rows use the sinks: their gradients add up
    torch.testing.assert_close(sink_grad, full[3].grad, **TOL, msg="d sinks")
    return True


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_ring_attention_applies_attention_sinks_and_soft_capping_exactly(softcap):
    assert all(run_distributed(_sinks_and_softcap_case, 2, softcap, timeout=120))
