"""vocab_parallel_cross_entropy / vocab_parallel_argmax vs F.cross_entropy / argmax on the
full logits, at tp=2 (two subgroups of a 4-process world) and tp=4, in ONE spawn."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megastrategy.layers.cross_entropy import vocab_parallel_argmax, vocab_parallel_cross_entropy
from megastrategy.layers.mappings import record_collectives
from megastrategy.layers.shard_spec import ShardSpec, padded_size_for, shard_full_tensor
from tests.helpers.dist import run_distributed

V = 37  # not divisible by 2 or 4: the last rank has padding columns


def _tp_groups():
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return [(2, pairs[dist.get_rank() // 2]), (4, dist.group.WORLD)]


def _close(a, b, what, atol=1e-6, rtol=1e-6):
    # torch.testing.assert_close imports DTensor+sympy once dist is initialized (~3 s/process)
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    if not torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
        err = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"{what}: max abs difference {err:.3g} (atol={atol}, rtol={rtol})")


def _local(full, tp, r, garbage=None):
    """This rank's columns of ``full`` [..., V]; padding columns hold ``garbage`` if given."""
    vp = padded_size_for(V, tp)
    spec = ShardSpec(dim=full.dim() - 1, full_size=V, padded_size=vp)
    local = shard_full_tensor(full.detach(), spec, r, tp).clone()
    per = vp // tp
    n_pad = max(0, (r + 1) * per - V)
    if garbage is not None and n_pad:
        local[..., per - n_pad:] = garbage  # must not matter
    return local, r * per, spec


def _check_ce(tp, group):
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    n = 12
    full = (3 * torch.randn(n, V, generator=g)).requires_grad_(True)
    target = torch.randint(0, V, (n,), generator=g)
    target[:4] = torch.tensor([0, V - 1, 18, 19])  # first/last ids, ids around shard boundaries
    target_ign = target.clone()
    target_ign[[2, 7]] = -100
    target_ign3 = target.clone()
    target_ign3[target_ign3 == target[5]] = 3
    target_ign3[0] = 3

    cases = []
    for reduction in ("mean", "sum", "none"):
        for ls in (0.0, 0.1):
            cases.append((target, dict(reduction=reduction, label_smoothing=ls)))
            cases.append((target_ign, dict(reduction=reduction, label_smoothing=ls)))
        cases.append((target_ign3, dict(reduction=reduction, ignore_index=3)))
    cases.append((target_ign3, dict(ignore_index=3, label_smoothing=0.25)))

    for tgt, kw in cases:
        what = f"tp={tp} {kw} ignored={(tgt == kw.get('ignore_index', -100)).sum().item()}"
        full.grad = None
        ref = F.cross_entropy(full, tgt, **kw)
        upstream = torch.rand(ref.shape, generator=g) + 0.5  # non-trivial grad_output
        (ref * upstream).sum().backward()
        ref_grad = full.grad.clone()

        local, start, spec = _local(full, tp, r, garbage=50.0)
        local.requires_grad_(True)
        with record_collectives() as log:
            loss = vocab_parallel_cross_entropy(local, tgt, vocab_start=start, vocab_size=V, group=group, **kw)
            n_fwd = len(log)
            (loss * upstream).sum().backward()
        _close(loss, ref, f"loss {what}")
        expect_grad, _, _ = _local(ref_grad, tp, r, garbage=0.0)  # zero grad on padding
        _close(local.grad, expect_grad, f"grad {what}")
        # O(tokens) communication, all in forward; backward is local
        assert n_fwd == len(log) == 2, log
        assert [e.op for e in log] == ["all_reduce_max", "all_reduce"], log
        assert all(e.numel <= 3 * n for e in log), log

    # leading dims [b, s, V] with reduction none keeps [b, s]
    full3 = torch.randn(2, 6, V, generator=g, requires_grad=True)
    t3 = torch.randint(0, V, (2, 6), generator=g)
    t3[0, 0] = -100
    ref = F.cross_entropy(full3.view(-1, V), t3.view(-1), reduction="none").view(2, 6)
    ref.sum().backward()
    local, start, _ = _local(full3, tp, r)
    local.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, t3, vocab_start=start, vocab_size=V, group=group, reduction="none")
    assert loss.shape == (2, 6)
    _close(loss, ref, "3-d none")
    loss.sum().backward()
    _close(local.grad, _local(full3.grad, tp, r, garbage=0.0)[0], "3-d grad")

    # every target ignored: mean is nan like torch, gradient is zero like torch
    all_ign = torch.full((n,), -100)
    full.grad = None
    ref = F.cross_entropy(full, all_ign)
    ref.backward()
    local, start, _ = _local(full, tp, r)
    local.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, all_ign, vocab_start=start, vocab_size=V, group=group)
    assert math.isnan(loss.item()) and math.isnan(ref.item())
    loss.backward()
    _close(local.grad, _local(full.grad, tp, r, garbage=0.0)[0], "all-ignored grad")

    # bfloat16 logits: computed in float32, returned as bfloat16
    fb = full.detach().to(torch.bfloat16)
    local, start, _ = _local(fb, tp, r)
    local.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, vocab_start=start, vocab_size=V, group=group)
    assert loss.dtype == torch.bfloat16
    ref32 = F.cross_entropy(fb.float(), target)
    assert abs(loss.float().item() - ref32.item()) < 2e-2
    loss.backward()
    assert local.grad.dtype == torch.bfloat16

    # large logits do not overflow (max subtraction is global)
    big = full.detach() * 0 + 1e4
    big[:, 5] = 1e4 + 3
    local, start, _ = _local(big, tp, r)
    _close(vocab_parallel_cross_entropy(local, target, vocab_start=start, vocab_size=V, group=group),
           F.cross_entropy(big, target), "large logits", atol=1e-4)


def _check_argmax(tp, group):
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(1)
    full = torch.randn(3, 5, V, generator=g)
    full[0, 0, 2] = full[0, 0, 30] = 100.0  # tie across shards: the first id wins, like torch
    full[0, 1, 36] = 100.0  # the last real id
    full[0, 2, 19] = full[0, 2, 20] = 100.0  # tie across the tp=2 boundary (ids 18|19)
    local, start, _ = _local(full, tp, r, garbage=1e6)  # huge padding values must be ignored
    with record_collectives() as log:
        am = vocab_parallel_argmax(local, vocab_start=start, vocab_size=V, group=group)
    assert torch.equal(am, full.argmax(dim=-1)), (am, full.argmax(-1))
    assert am.dtype == torch.int64
    assert len(log) == 1 and log[0].numel <= 2 * 15, log
    amk = vocab_parallel_argmax(local, vocab_start=start, vocab_size=V, group=group, keepdim=True)
    assert torch.equal(amk, full.argmax(dim=-1, keepdim=True))


def _all_checks(rank, world):
    for tp, group in _tp_groups():
        _check_ce(tp, group)
        _check_argmax(tp, group)
    return True


def test_vocab_parallel_cross_entropy_and_argmax_tp2_and_tp4():
    assert run_distributed(_all_checks, 4) == [True] * 4


def test_world_size_one_matches_torch_without_dist():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 11, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)
    t[1] = -100
    for kw in (dict(), dict(reduction="sum", label_smoothing=0.2), dict(reduction="none")):
        x.grad = None
        ref = F.cross_entropy(x, t, **kw)
        ref.sum().backward()
        ref_grad = x.grad.clone()
        x.grad = None
        out = vocab_parallel_cross_entropy(x, t, vocab_start=0, vocab_size=11, group=None, **kw)
        out.sum().backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(x.grad, ref_grad)
    assert torch.equal(vocab_parallel_argmax(x, vocab_start=0, vocab_size=11, group=None), x.argmax(-1))
