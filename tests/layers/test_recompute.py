"""Activation recomputation: bitwise the same losses and gradients, with dropout on.

Single-process checks (tp=1) for the wrapping itself, then one spawn of 2 gloo processes
(tp=2) in which dropout runs on both streams (replicated activations on the default
stream, TP-sharded ones on the tracker's) for ``"full"`` and ``"selective"``.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.random import ModelParallelRNGTracker
from megastrategy.layers.recompute import apply_activation_checkpointing, is_checkpointed
from tests.helpers.dist import run_distributed

SEQ = 16
P = 0.1


def _tracker(rank=0):
    t = ModelParallelRNGTracker(tp_rank=rank, device="cpu")
    t.seed(1234)
    return t


def _batch(batch=4, seq=SEQ, seed=3):
    from tests.helpers.models import TokenDataset

    ds = TokenDataset(batch, seq=seq, seed=seed)
    return {k: torch.stack([ds[i][k] for i in range(batch)]) for k in ("input_ids", "attention_mask", "labels")}


def _with_dropout(model, p=P):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = p
    return model


class SavedBytes:
    """Bytes of activations autograd saves for backward (parameters excluded)."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.total = 0

    def pack(self, t):
        if t.untyped_storage().data_ptr() not in self.params:
            self.total += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._cm = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)


def _run(model, loss_fn, batch, seed=11):
    torch.manual_seed(seed)
    with SavedBytes(model) as saved:
        loss = loss_fn(model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, saved.total


def _assert_bitwise(a, b, what):
    assert torch.equal(a[0], b[0]), f"{what}: loss {a[0]} vs {b[0]}"
    assert set(a[1]) == set(b[1]), what
    for n in a[1]:
        assert torch.equal(a[1][n], b[1][n]), f"{what}: grad {n} differs"


# -------------------------------------------------------------------------------- models
def _bert():
    from tests.helpers.models import BertClassifier

    return BertClassifier(n_layer=2), None, lambda m, b: m.model(**b).loss


def _gpt():
    from tests.helpers.models import GPT, VOCAB

    def loss_fn(m, b):
        ids = b["input_ids"]
        return F.cross_entropy(m(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    return GPT(n_layer=2), GPT.TP_PLAN, loss_fn


def _encoder():
    from tests.helpers.models import EncoderClassifier

    return EncoderClassifier(n_layer=2), None, lambda m, b: m.compute_loss(b)


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=101, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
    return GPT2LMHeadModel(cfg), None, lambda m, b: m(input_ids=b["input_ids"], labels=b["input_ids"]).loss


MODELS = {"hf-bert": _bert, "gpt-user-plan": _gpt, "torch-encoder": _encoder, "hf-gpt2": _hf_gpt2}


# ------------------------------------------------------------------------ single process
def test_unknown_mode_is_a_config_error():
    model, _, _ = _gpt()
    with pytest.raises(MegatronConfigError, match="activation_checkpointing='partial'"):
        apply_activation_checkpointing(model, "partial", rng_tracker=None)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bert_single_process_bitwise_with_dropout(mode, impl):
    torch.manual_seed(0)
    model, _, loss_fn = _bert()
    model.model.config._attn_implementation = impl
    _with_dropout(model)
    model.train()
    twin = copy.deepcopy(model)
    keys = list(model.state_dict())
    ref = _run(model, loss_fn, _batch())
    done = apply_activation_checkpointing(twin, mode, rng_tracker=_tracker())
    if mode == "full":
        assert done == ["model.bert.encoder.layer.0", "model.bert.encoder.layer.1"]
    else:
        assert done == ["model.bert.encoder.layer.0.attention.self", "model.bert.encoder.layer.1.attention.self"]
    assert list(twin.state_dict()) == keys
    assert type(twin.model.bert.encoder.layer[0]).__name__ == "BertLayer"
    got = _run(twin, loss_fn, _batch())
    _assert_bitwise(got, ref, f"bert {mode} {impl}")
    assert got[2] < ref[2], "recomputation saved nothing"
    # applying twice is a no-op
    assert apply_activation_checkpointing(twin, mode, rng_tracker=_tracker()) == done
    # a deep copy recomputes too, with its own weights and the same results
    again = copy.deepcopy(twin)
    again.zero_grad()
    assert all(is_checkpointed(again.get_submodule(n)) for n in done)
    _assert_bitwise(_run(again, loss_fn, _batch()), ref, f"deepcopy of bert {mode} {impl}")


def test_selective_needs_an_attention_module():
    model, _, _ = _gpt()
    with pytest.raises(MegatronConfigError, match="found no attention module in the blocks of blocks"):
        apply_activation_checkpointing(model, "selective", rng_tracker=None)
    done = apply_activation_checkpointing(model, "selective", rng_tracker=None, selective_modules=["ln1", "fc"])
    assert done == ["blocks.0.ln1", "blocks.0.fc", "blocks.1.ln1", "blocks.1.fc"]


def test_eval_and_no_grad_do_not_checkpoint():
    torch.manual_seed(0)
    model, _, loss_fn = _gpt()
    apply_activation_checkpointing(model, "full", rng_tracker=None)
    with SavedBytes(model) as saved, torch.no_grad():
        loss_fn(model, _batch())
    assert saved.total == 0


def test_deepcopy_of_a_wrapped_module_recomputes_itself():
    torch.manual_seed(0)
    model, _, loss_fn = _gpt()
    apply_activation_checkpointing(model, "full", rng_tracker=None)
    twin = copy.deepcopy(model)
    assert is_checkpointed(twin.blocks[0])
    assert twin.blocks[0].forward.module is twin.blocks[0]
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    a, b = _run(model, loss_fn, _batch()), _run(twin, loss_fn, _batch())
    assert not torch.equal(a[0], b[0])  # the copy really runs its own weights
    assert all(p.grad is not None for p in twin.parameters())


def test_hooks_stay_outside_the_checkpoint():
    """The pipeline stage's hooks: a pre-hook substituting the first block's input, and a
    forward hook that ends the forward with a BaseException after the last local block."""

    class Boundary(BaseException):
        def __init__(self, out):
            self.out = out

    torch.manual_seed(0)
    model, _, _ = _gpt()
    apply_activation_checkpointing(model, "full", rng_tracker=None)
    calls = []
    x_in = torch.randn(2, 8, 32, requires_grad=True)
    model.blocks[0].register_forward_pre_hook(lambda m, args: (calls.append("pre"), (x_in,))[1])

    def post(m, args, out):
        calls.append("post")
        raise Boundary(out)

    model.blocks[0].register_forward_hook(post)
    with pytest.raises(Boundary) as info:
        model(torch.zeros(2, 8, dtype=torch.long))
    out = info.value.out
    assert calls == ["pre", "post"]
    out.square().mean().backward()  # recomputes block 0 from x_in; the hooks do not run again
    assert calls == ["pre", "post"] and x_in.grad is not None
    plain, _, _ = _gpt()
    plain.load_state_dict(model.state_dict())
    x2 = x_in.detach().clone().requires_grad_(True)
    plain.blocks[0](x2).square().mean().backward()
    assert torch.equal(x2.grad, x_in.grad)


def test_hf_gradient_checkpointing_enable_is_adopted():
    torch.manual_seed(0)
    model, _, loss_fn = _bert()
    _with_dropout(model)
    model.train()
    twin = copy.deepcopy(model)
    enable = getattr(twin.model, "activation_checkpointing_enable", None) or twin.model.gradient_checkpointing_enable
    enable()
    assert twin.model.bert.encoder.layer[0].gradient_checkpointing
    ref = _run(model, loss_fn, _batch())
    done = apply_activation_checkpointing(twin, None, rng_tracker=_tracker())
    assert done == ["model.bert.encoder.layer.0", "model.bert.encoder.layer.1"]
    assert not twin.model.bert.encoder.layer[0].gradient_checkpointing  # ours now: hooks outside
    got = _run(twin, loss_fn, _batch())
    _assert_bitwise(got, ref, "hf gradient checkpointing adopted")
    assert got[2] < ref[2]
    assert apply_activation_checkpointing(model, None, rng_tracker=None) == []  # nothing asked, nothing done


# ------------------------------------------------------------------------ tensor parallel
def _tp2(rank, world):
    from megastrategy.layers.plan import apply_tp_plan, resolve_tp_plan

    group = dist.group.WORLD
    batch = _batch()
    report = {}
    for name, build in MODELS.items():
        runs = {}
        for mode in (None, "full", "selective"):
            if mode == "selective" and name == "gpt-user-plan":
                continue
            torch.manual_seed(0)
            model, plan_arg, loss_fn = build()
            _with_dropout(model)
            tracker = _tracker(rank)
            plan = resolve_tp_plan(model, plan_arg, world)
            apply_tp_plan(model, plan, group=group, rng_tracker=tracker)
            model.train()
            keys = list(model.state_dict())
            done = apply_activation_checkpointing(model, mode, rng_tracker=tracker) if mode else []
            assert list(model.state_dict()) == keys
            assert bool(done) == bool(mode), (name, mode)
            runs[mode] = _run(model, loss_fn, batch)
            # a second step from the advanced streams must still agree (replay restores them)
            runs[(mode, 2)] = _run(model, loss_fn, batch, seed=12)
        for mode in ("full", "selective"):
            if mode in runs:
                _assert_bitwise(runs[mode], runs[None], f"{name} {mode}")
                _assert_bitwise(runs[(mode, 2)], runs[(None, 2)], f"{name} {mode} second step")
                assert runs[mode][2] < runs[None][2], f"{name} {mode}: nothing recomputed"
        # dropout really is on: another seed changes the loss
        assert not torch.equal(runs[None][0], runs[(None, 2)][0]) or name == "gpt-user-plan"
        report[name] = {str(k): float(v[0]) for k, v in runs.items()} | {
            f"saved_{k}": v[2] for k, v in runs.items() if not isinstance(k, tuple)
        }
    return report


def test_tp2_full_and_selective_recompute_are_bitwise_with_dropout():
    results = run_distributed(_tp2, 2, timeout=600)
    for r in results:
        assert set(r) == set(MODELS)
        for name, rep in r.items():
            assert rep["saved_full"] < rep["saved_None"], name


# ------------------------------------------------------------------------------- Lightning
@functools.lru_cache(maxsize=None)
def _train(nprocs: int, *args: str) -> dict:
    from pathlib import Path

    from tests.helpers.launch import run_script

    script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
    return run_script(script, nprocs, list(args), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--tp", "2", "--user-plan"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_lightning_full_recompute_matches_ddp(layout):
    ours = _train(2, "--model", "gpt", "--strategy", "megatron", *layout, "--recompute", "full")
    ref = _train(1, "--model", "gpt", "--strategy", "ddp")
    diffs = [abs(a - b) for a, b in zip(ours["train_loss"], ref["train_loss"])]
    assert len(ours["train_loss"]) == len(ref["train_loss"]) > 0 and max(diffs) < 2e-4, (ours, ref)
    assert max(abs(a - b) for a, b in zip(ours["val_loss"], ref["val_loss"])) < 2e-4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_lightning_recompute_with_dropout_is_bitwise(mode):
    base = ("--model", "bert", "--strategy", "megatron", "--tp", "2", "--dropout", "0.1")
    plain = _train(2, *base)
    ours = _train(2, *base, "--recompute", mode)
    assert ours["train_loss"] == plain["train_loss"], (ours["train_loss"], plain["train_loss"])
    assert ours["val_loss"] == plain["val_loss"]
    assert len(set(plain["train_loss"])) > 1
