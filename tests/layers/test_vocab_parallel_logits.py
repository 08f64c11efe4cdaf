"""VocabParallelHead + VocabParallelLogits vs a serial nn.Linear head, at tp=2 (two
subgroups of a 4-process world) and tp=4, in ONE spawn."""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megastrategy.layers import vocab_parallel_logits as vpl_mod
from megastrategy.layers.embedding import VocabParallelEmbedding
from megastrategy.layers.mappings import record_collectives
from megastrategy.layers.shard_spec import get_shard_spec, shard_full_tensor
from megastrategy.layers.vocab_head import VocabParallelHead
from megastrategy.layers.vocab_parallel_logits import VocabParallelLogits
from tests.helpers.dist import run_distributed

B, S, H, V = 2, 5, 8, 101  # V padded to 102 (tp=2) / 104 (tp=4)


def _tp_groups():
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return [(2, pairs[dist.get_rank() // 2]), (4, dist.group.WORLD)]


def _close(a, b, what, atol=1e-5, rtol=1e-5):
    # torch.testing.assert_close imports DTensor+sympy once dist is initialized (~3 s/process)
    a, b = a.detach(), b.detach()
    assert type(b) is torch.Tensor
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    if type(a) is not torch.Tensor:
        a = a.full_logits()
    if not torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
        err = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"{what}: max abs difference {err:.3g} (atol={atol}, rtol={rtol})")


class _Setup:
    """A serial head and its vocab-parallel copy, fed the same hidden states."""

    def __init__(self, tp, group, bias=True):
        self.tp, self.group, self.r = tp, group, dist.get_rank(group)
        torch.manual_seed(0)
        self.lin = nn.Linear(H, V, bias=bias)
        self.head = VocabParallelHead.from_linear(self.lin, group=group)
        g = torch.Generator().manual_seed(1)
        self.h0 = torch.randn(B, S, H, generator=g)
        self.y = torch.randint(0, V, (B, S), generator=g)
        self.y[0, 1] = -100
        self.y[1, 0] = V - 1

    def run(self, fn):
        """fn(logits) -> loss on the serial and on the parallel model; compare everything."""
        self.lin.zero_grad()
        self.head.zero_grad()
        hs = self.h0.clone().requires_grad_(True)
        ref = fn(self.lin(hs))
        ref.backward()
        hp = self.h0.clone().requires_grad_(True)
        logits = self.head(hp)
        assert isinstance(logits, VocabParallelLogits)
        out = fn(logits)
        assert type(out) is torch.Tensor, type(out)
        _close(out, ref, "loss")
        out.backward()
        _close(hp.grad, hs.grad, "hidden grad")
        spec = get_shard_spec(self.head.weight)
        _close(self.head.weight.grad, shard_full_tensor(self.lin.weight.grad, spec, self.r, self.tp), "weight grad")
        if self.lin.bias is not None:
            _close(self.head.bias.grad, shard_full_tensor(self.lin.bias.grad, spec, self.r, self.tp), "bias grad")
        return out


def _check_loss_paths(tp, group):
    s = _Setup(tp, group)
    y = s.y
    # the user code of every HF / Lightning LM
    s.run(lambda lg: F.cross_entropy(lg.view(-1, lg.size(-1)), y.view(-1)))
    s.run(lambda lg: F.cross_entropy(lg.view(-1, V), y.view(-1), reduction="sum"))
    s.run(lambda lg: nn.CrossEntropyLoss(label_smoothing=0.1)(lg.reshape(-1, V), y.reshape(-1)))
    yy = y.clamp(min=0)
    s.run(lambda lg: F.cross_entropy(lg.view(B * S, -1), yy.view(-1), ignore_index=int(yy[1, 1])))
    s.run(lambda lg: (F.cross_entropy(lg.view(-1, V), y.view(-1), reduction="none") * torch.arange(B * S)).sum())
    s.run(lambda lg: F.cross_entropy(lg[1, 2], y[1, 2]))  # 1-D logits, 0-d target
    s.run(lambda lg: F.cross_entropy((lg / 0.7).float().view(-1, V), y.view(-1)))  # temperature

    # GPT shift, as in transformers' ForCausalLMLoss (float, pad labels, slice, view, to)
    def hf_causal(lg):
        lg = lg.float()
        labels = F.pad(y, (0, 1), value=-100)
        shift_labels = labels[..., 1:].contiguous()
        lg = lg.view(-1, V)
        shift_labels = shift_labels.view(-1).to(lg.device)
        return F.cross_entropy(lg, shift_labels, ignore_index=-100, reduction="sum") / torch.tensor(7.0)

    s.run(hf_causal)

    def gpt_shift(lg):
        shift_logits = lg[..., :-1, :].contiguous()
        shift_labels = y[..., 1:].contiguous()
        assert shift_logits.shape == (B, S - 1, V)
        assert isinstance(shift_logits, VocabParallelLogits) == isinstance(lg, VocabParallelLogits)
        return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))

    s.run(gpt_shift)

    # loss communication is O(tokens): nothing near tokens x V/tp elements moves
    hp = s.h0.clone().requires_grad_(True)
    logits = s.head(hp)
    limit = B * S * (logits.padded_vocab_size // tp)
    with record_collectives() as log:
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
    assert log and all(e.numel < limit for e in log), (limit, log)
    assert sum(e.numel for e in log if e.op.startswith("all_reduce")) <= 3 * B * S + B * S * H
    # ... while a gathering op does move that much (the check above can fail)
    with record_collectives() as log, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits.softmax(-1)
    assert any(e.numel >= limit for e in log), log

    # weight= falls back to the gathered logits and is still exact
    w = torch.rand(V) + 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.run(lambda lg: F.cross_entropy(lg.view(-1, V), y.view(-1), weight=w))
        s.run(lambda lg: F.cross_entropy(lg.permute(0, 2, 1), y))  # class dim 1: gathered, exact


def _check_tensor_behaviour(tp, group):
    s = _Setup(tp, group, bias=False)
    hp = s.h0.clone().requires_grad_(True)
    logits = s.head(hp)
    ref = s.lin(s.h0)
    local_v = logits.padded_vocab_size // tp

    with record_collectives() as log:
        # sizes report the real vocab (without communicating)
        assert logits.shape == (B, S, V) and logits.size() == (B, S, V)
        assert logits.size(-1) == V and logits.size(2) == V and logits.size(0) == B
        assert logits.dim() == 3 and logits.ndim == 3 and logits.numel() == B * S * V and len(logits) == B
        assert logits.local_logits.shape == (B, S, local_v) and type(logits.local_logits) is torch.Tensor
        assert logits.vocab_size == V and logits.dtype == torch.float32 and logits.requires_grad
        assert logits.device == ref.device and logits.grad_fn is not None

        # local ops stay VocabParallelLogits and communicate nothing
        local_cases = {
            "float": logits.float(),
            "double": logits.double(),
            "to": logits.to(torch.float64),
            "contiguous": logits.contiguous(),
            "clone": logits.clone(),
            "detach": logits.detach(),
            "div": logits / 2.0,
            "rmul": 3 * logits,
            "rsub": 1 - logits,
            "add_t": logits + torch.ones(B, S, 1),
            "slice_seq": logits[..., :-1, :],
            "index_0": logits[:, 0],
            "index_last": logits[:, -1, :],
            "index_both": logits[1, 2],
            "ellipsis": logits[...],
            "transpose": logits.transpose(0, 1),
            "permute": logits.permute(1, 0, 2),
            "view": logits.view(-1, V),
            "view_tuple": logits.view((B * S, V)),
            "reshape_neg": logits.reshape(B, -1, V),
            "flatten": logits.flatten(0, 1),
            "unsqueeze": logits.unsqueeze(0),
            "tanh": torch.tanh(logits),
            "sum_of_two": logits + logits.detach(),
        }
        ref_cases = {
            "float": ref.float(), "double": ref.double(), "to": ref.to(torch.float64),
            "contiguous": ref, "clone": ref, "detach": ref, "div": ref / 2.0, "rmul": 3 * ref,
            "rsub": 1 - ref, "add_t": ref + 1, "slice_seq": ref[..., :-1, :], "index_0": ref[:, 0],
            "index_last": ref[:, -1, :], "index_both": ref[1, 2], "ellipsis": ref,
            "transpose": ref.transpose(0, 1), "permute": ref.permute(1, 0, 2), "view": ref.view(-1, V),
            "view_tuple": ref.view(-1, V), "reshape_neg": ref, "flatten": ref.flatten(0, 1),
            "unsqueeze": ref.unsqueeze(0), "tanh": torch.tanh(ref), "sum_of_two": 2 * ref,
        }
        for name, t in local_cases.items():
            assert isinstance(t, VocabParallelLogits), name
            assert t.shape == ref_cases[name].shape, (name, t.shape)
        assert not local_cases["detach"].requires_grad
        am = logits.argmax(dim=-1)
        am2 = torch.argmax(logits, -1, keepdim=True)
        r = repr(logits)  # never communicates (a print on one rank only must not hang)
        f"{logits}"
    assert [e.op for e in log] == ["all_gather", "all_gather"], log  # the two argmax exchanges
    assert all(e.numel <= 2 * B * S for e in log)
    assert "VocabParallelLogits" in r and f"{V}" in r
    assert type(am) is torch.Tensor and torch.equal(am, ref.argmax(-1)) and torch.equal(am2, ref.argmax(-1, keepdim=True))
    for name, t in local_cases.items():
        _close(t, ref_cases[name].to(t.dtype), f"local op {name}")

    # in-place ops that are per column stay local; others refuse (no silent no-op)
    t = logits.detach().clone()
    t2 = t.div_(2.0)
    assert t2 is t and isinstance(t, VocabParallelLogits)
    t[:, 0] = 0.0
    expect = ref / 2.0
    expect[:, 0] = 0.0
    _close(t, expect, "in-place local ops")
    with pytest.raises(RuntimeError, match="in-place"):
        t.log_()

    # everything else gathers (differentiably), strips the padding, warns once per op
    vpl_mod._reset_gather_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = logits.softmax(dim=-1)
        p2 = F.softmax(logits, -1)
        lp = F.log_softmax(logits, dim=-1)
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 2 and "softmax" in msgs[0] and "log_softmax" in msgs[1], msgs
    assert type(p) is torch.Tensor and p.shape == (B, S, V)
    _close(p, ref.softmax(-1), "softmax")
    _close(p2, ref.softmax(-1), "F.softmax")
    _close(lp, F.log_softmax(ref, -1), "log_softmax")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cat = torch.cat([logits, logits], dim=0)
        assert type(cat) is torch.Tensor and cat.shape == (2 * B, S, V)
        _close(cat, torch.cat([ref, ref]), "cat")
        gt = logits > 0
        assert type(gt) is torch.Tensor and torch.equal(gt, ref > 0)
        flat = logits.view(-1)
        assert type(flat) is torch.Tensor and flat.shape == (B * S * V,)
        _close(flat, ref.view(-1), "view(-1) gathers")
        assert torch.equal(torch.tensor(logits.detach().numpy()), ref.detach())
        assert logits[0, 0, 3].item() == pytest.approx(ref[0, 0, 3].item(), abs=1e-5)  # last-dim index
        _close(logits.mean(), ref.mean(), "mean")
        full = logits.full_logits()
        assert type(full) is torch.Tensor and full.shape == (B, S, V)

    # gradients flow exactly through gathered ops and local ops mixed
    G = torch.randn(B, S, V)
    s.run(lambda lg: (F.log_softmax(lg / 1.3, dim=-1) * G).sum())
    s.run(lambda lg: (lg.transpose(0, 1)[:, :, :] * 1.0).float().softmax(-1)[..., 7].sum())

    # deepcopy keeps the layout
    dc = copy.deepcopy(logits.detach())
    assert isinstance(dc, VocabParallelLogits) and dc.shape == logits.shape and dc.tp_group is group


def _check_tied_and_construction(tp, group):
    r = dist.get_rank(group)
    torch.manual_seed(3)
    emb = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    head.weight = emb.weight  # tied, as in GPT-2

    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4))
    labels = torch.roll(ids, -1, dims=1)

    def model(e, hd):
        h = torch.tanh(e(ids))
        logits = hd(h)
        return F.cross_entropy(logits.view(-1, V), labels.view(-1))

    ref = model(emb, head)
    ref.backward()

    pemb = VocabParallelEmbedding.from_embedding(emb, group=group)
    phead = VocabParallelHead.from_linear(head, group=group, tied_embedding=pemb)
    assert phead.weight is pemb.weight  # ONE Parameter
    both = nn.ModuleList([pemb, phead])
    assert len(list(both.parameters())) == 1
    loss = model(pemb, phead)
    _close(loss, ref, "tied loss")
    loss.backward()
    spec = get_shard_spec(pemb.weight)
    _close(pemb.weight.grad, shard_full_tensor(emb.weight.grad, spec, r, tp), "tied grad")
    assert "tied=True" in repr(phead)

    # padding rows are zero; bias is padded and sharded the same way
    torch.manual_seed(5)
    lin = nn.Linear(H, V)
    ph = VocabParallelHead.from_linear(lin, group=group)
    vp = ph.padded_out_features
    assert vp == -(-V // tp) * tp and ph.out_features == V
    per = vp // tp
    assert (ph.vocab_start_index, ph.vocab_end_index) == (r * per, (r + 1) * per)
    n_pad = max(0, (r + 1) * per - V)
    if n_pad:
        assert torch.count_nonzero(ph.weight[-n_pad:]) == 0 and torch.count_nonzero(ph.bias[-n_pad:]) == 0
    assert get_shard_spec(ph.bias) == get_shard_spec(ph.weight)
    # the plain constructor initializes what nn.Linear would, whatever tp is
    torch.manual_seed(5)
    ph2 = VocabParallelHead(H, V, group=group)
    assert torch.equal(ph2.weight, ph.weight) and torch.equal(ph2.bias, ph.bias)


def _all_checks(rank, world):
    for tp, group in _tp_groups():
        _check_loss_paths(tp, group)
        _check_tensor_behaviour(tp, group)
        _check_tied_and_construction(tp, group)
    return True


def test_vocab_parallel_head_and_logits_tp2_and_tp4():
    assert run_distributed(_all_checks, 4) == [True] * 4


def test_world_size_one_without_dist():
    torch.manual_seed(0)
    lin = nn.Linear(4, 9)
    head = VocabParallelHead.from_linear(lin, group=None)
    x = torch.randn(3, 4)
    y = torch.tensor([0, 8, 4])
    logits = head(x)
    assert isinstance(logits, VocabParallelLogits) and logits.shape == (3, 9)
    torch.testing.assert_close(F.cross_entropy(logits, y), F.cross_entropy(lin(x), y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(logits.softmax(-1), lin(x).softmax(-1))
