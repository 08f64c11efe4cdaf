"""Activation recompute with context parallelism on real gloo processes, against one device.

Every way of recomputing (the strategy's ``"full"`` and ``"selective"``, Hugging Face's
``gradient_checkpointing_enable()``, the user's own ``torch.utils.checkpoint`` around the blocks,
reentrant and not) must give the single-device loss and gradients (averaged over the cp ranks,
within 2e-4), and must really recompute under the ring: attention modules run twice per step
(once for selective, which recomputes only the attention function) and the ring carries exactly
one more forward's K/V than without recompute (forward 1 unit, backward 3: K/V and both
gradients; with a replay 5/4 of it). All cases in one launch.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from tests.context import checkpointed_models as cm
from tests.context import tiny_models as tm
from tests.helpers.dist import run_distributed

TOL = dict(rtol=2e-4, atol=2e-4)


def _strategy_recompute(model, mode):
    from megastrategy.layers.recompute import apply_activation_checkpointing

    apply_activation_checkpointing(model, mode, rng_tracker=None)
    return model


GPT = (tm.SdpaGPT, tm.gpt_batch, tm.gpt_loss, "qkv")
LLAMA = (functools.partial(tm.llama, "sdpa"), tm.lm_batch, tm.lm_loss, "self_attn")
#: name -> (model, batch, loss, counted module suffix, recompute form or None, backward inside the forward)
CASES = {
    "gpt_plain": (*GPT, None, False),
    "gpt_user": (*GPT, functools.partial(cm.checkpoint_blocks, reentrant=False), False),
    "gpt_user_reentrant": (*GPT, functools.partial(cm.checkpoint_blocks, reentrant=True), False),
    "gpt_full": (*GPT, functools.partial(_strategy_recompute, mode="full"), False),
    "gpt_user_backward_in_forward": (*GPT, functools.partial(cm.checkpoint_blocks, reentrant=False), True),
    "llama_plain": (*LLAMA, None, False),
    "llama_full": (*LLAMA, functools.partial(_strategy_recompute, mode="full"), False),
    "llama_selective": (*LLAMA, functools.partial(_strategy_recompute, mode="selective"), False),
    "llama_hf": (*LLAMA, functools.partial(cm.hf_gradient_checkpointing, reentrant=False), False),
    "llama_hf_reentrant": (*LLAMA, functools.partial(cm.hf_gradient_checkpointing, reentrant=True), False),
    "llama_user": (*LLAMA, functools.partial(cm.checkpoint_blocks, reentrant=False), False),
    "llama_user_reentrant": (*LLAMA, functools.partial(cm.checkpoint_blocks, reentrant=True), False),
    "llama_user_backward_in_forward": (*LLAMA, functools.partial(cm.checkpoint_blocks, reentrant=True), True),
}


def _run_case(name, build, make_batch, loss_fn, suffix, recompute, backward_inside, rank, cp):
    """``(attention calls, ring bytes)`` after checking the loss and every gradient against one device."""
    from megastrategy.context import ContextParallel

    torch.manual_seed(0)
    reference = build()
    model = copy.deepcopy(reference).train()
    if recompute is not None:
        model = recompute(model)
    calls = cm.count_attention_calls(model, suffix)
    batch = make_batch(seed=1)
    ref_loss, _ = loss_fn(reference, batch)
    ref_loss.backward()

    ContextParallel.validate(model, cp)
    context = ContextParallel(dist.group.WORLD)
    context.apply(model)
    local = context.transform_microbatch(batch, training=True)
    with context.forward_context(local):
        loss, _ = loss_fn(model, local)
        if backward_inside:  # manual optimization: backward from inside the training step
            loss.backward()
    if not backward_inside:
        loss.backward()
    ring_bytes = context.ring.bytes_sent
    context.teardown()

    torch.testing.assert_close(loss, ref_loss, **TOL, msg=f"{name}: loss")
    for (pname, param), (_, ref_param) in zip(model.named_parameters(), reference.named_parameters()):
        grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        torch.testing.assert_close(grad / cp, ref_param.grad, **TOL, msg=f"{name}: grad of {pname}")
    return calls[0], ring_bytes


def _all_cases(rank, world_size):
    return {name: _run_case(name, *case, rank, world_size) for name, case in CASES.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_recompute_form_matches_one_device_and_replays_under_the_ring():
    results = run_distributed(_all_cases, 2, timeout=240)[0]
    plain = {"gpt": results["gpt_plain"], "llama": results["llama_plain"]}
    for name, (calls, ring_bytes) in results.items():
        if name.endswith("_plain"):
            continue
        base_calls, base_bytes = plain[name.split("_")[0]]
        expected_calls = base_calls if name.endswith("selective") else 2 * base_calls
        assert calls == expected_calls, f"{name}: attention ran {calls} times, {expected_calls} expected"
        assert ring_bytes * 4 == base_bytes * 5, f"{name}: the ring sent {ring_bytes} bytes, {base_bytes} without recompute"


# ---------------------------------------------------------------- the interception itself (one process)
class _FakeSplit:
    def __init__(self):
        from megastrategy.context.hf_masks import MaskMarkers

        self.masks = MaskMarkers()


def _installed(split):
    """A ReplayInSplit whose forward runs ``split`` (None: no split forward now); ``entered`` records replays."""
    from contextlib import contextmanager

    from megastrategy.context.recompute import ReplayInSplit

    entered = []

    @contextmanager
    def replay(s):
        entered.append(s)
        yield

    owner = ReplayInSplit(lambda: split, replay)
    owner.install()
    return owner, entered


def test_torchs_checkpoint_is_restored_when_the_last_owner_is_removed():
    import torch.utils.checkpoint as tc

    saved = (tc._checkpoint_without_reentrant_generator, tc.CheckpointFunction)
    first, _ = _installed(None)
    second, _ = _installed(None)
    first.remove()
    assert tc.CheckpointFunction is not saved[1]  # the second one still needs it
    second.remove()
    assert (tc._checkpoint_without_reentrant_generator, tc.CheckpointFunction) == saved


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_replay_enters_the_split_and_gets_the_forwards_mask_marker(reentrant):
    from torch.utils.checkpoint import checkpoint

    split = _FakeSplit()
    marker = split.masks.make((True, None), 2, 3)
    seen = []

    def block(x, mask):
        seen.append(mask)
        return (x * 2).sin()

    owner, entered = _installed(split)
    try:
        x = torch.randn(2, 3, requires_grad=True)
        checkpoint(block, x, marker, use_reentrant=reentrant).sum().backward()
    finally:
        owner.remove()
    runs = 2 if reentrant else 1  # the reentrant checkpoint also calls the function it got for the forward
    assert entered == [split] * runs, "the replay ran outside the split"
    assert len(seen) == 2 and all(m is marker for m in seen), "the replay got another mask than the forward's marker"
    torch.testing.assert_close(x.grad, 2 * (2 * x.detach()).cos())


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_pipeline_step_installed_later_still_sees_its_boundary_block(reentrant):
    """pp's handler (pipeline/user_checkpoint.py) wraps cp's: a stage's boundary block runs plainly (never
    replayed), any other checkpoint replays in the split."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from megastrategy.pipeline.stage import PipelineStage
    from megastrategy.pipeline.user_checkpoint import UserCheckpoints

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    stage = PipelineStage(stack_path="", chunks=[[0, 1]], pp_rank=0, pp_size=2, vp_size=1)
    model[1].register_forward_hook(stage._post_hook)  # inactive stage: the hook does nothing
    calls = {0: 0, 1: 0}
    for i in (0, 1):
        model[i].register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    split = _FakeSplit()
    owner, entered = _installed(split)
    try:
        with UserCheckpoints().step("training_step", model):
            x = torch.randn(2, 3, requires_grad=True)
            checkpoint(model[1], checkpoint(model[0], x, use_reentrant=reentrant), use_reentrant=reentrant).sum().backward()
    finally:
        owner.remove()
    assert calls == {0: 2, 1: 1} and entered == [split] * (2 if reentrant else 1)
