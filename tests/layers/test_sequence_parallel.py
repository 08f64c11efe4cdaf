"""Sequence parallelism: the same losses and gradients as tensor parallelism alone.

One spawn of 2 gloo processes (tp=2) runs every model: for each, two identical copies are
sharded with the same plan, sequence parallelism is enabled on one, and the loss and every
gradient (after the TP sum of the sequence-parallel gradients) must agree tightly.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.sequence_parallel import (
    check_sequence_length,
    validate_sequence_parallel,
)
from tests.helpers.dist import run_distributed

ATOL, RTOL = 1e-6, 1e-5
SEQ = 16


# ---------------------------------------------------------------------------------- pure checks
def test_sequence_parallel_needs_tp_above_one():
    with pytest.raises(MegatronConfigError, match=r"sequence_parallel=True with tp=1"):
        validate_sequence_parallel(tp=1, sequence_parallel=True)
    validate_sequence_parallel(tp=1, sequence_parallel=False)
    validate_sequence_parallel(tp=2, sequence_parallel=True)


def test_sequence_length_must_divide():
    with pytest.raises(MegatronConfigError, match=r"sequence length 15\b.*not divisible by tp=2"):
        check_sequence_length(15, 2)
    check_sequence_length(16, 2)
    check_sequence_length(15, 1)


def test_support_is_checked_before_any_process_group():
    from megastrategy.layers.sequence_parallel import check_sequence_parallel_support
    from tests.helpers.models import GPT, BertClassifier, EncoderClassifier

    assert check_sequence_parallel_support(BertClassifier(n_layer=2)) == "residual"
    assert check_sequence_parallel_support(EncoderClassifier(n_layer=2)) == "residual"
    assert check_sequence_parallel_support(GPT(n_layer=2)) == "norms"
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(32, 4, 64, batch_first=True), 2)
    with pytest.raises(MegatronConfigError, match="nn.TransformerDecoderLayer"):
        check_sequence_parallel_support(dec)
    net = nn.Module()
    net.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2))
    with pytest.raises(MegatronConfigError, match=r"blocks.0 \(Sequential\) has no LayerNorm/RMSNorm"):
        check_sequence_parallel_support(net)


# ---------------------------------------------------------------------------------- models
def _batch(seed=3, batch=4, seq=SEQ):
    from tests.helpers.models import TokenDataset

    ds = TokenDataset(batch, seq=seq, seed=seed)
    return {k: torch.stack([ds[i][k] for i in range(batch)]) for k in ("input_ids", "attention_mask", "labels")}


def _gpt():
    from tests.helpers.models import GPT, VOCAB

    model = GPT(n_layer=2)

    def loss_fn(m, b):
        ids = b["input_ids"]
        logits = m(ids)  # all SEQ positions: divisible by tp
        return F.cross_entropy(logits.reshape(-1, VOCAB), torch.roll(ids, -1, 1).reshape(-1))

    return model, GPT.TP_PLAN, loss_fn


def _bert():
    from tests.helpers.models import BertClassifier

    return BertClassifier(n_layer=2), None, lambda m, b: m.model(**b).loss


def _encoder():
    from tests.helpers.models import EncoderClassifier

    return EncoderClassifier(n_layer=2), None, lambda m, b: m.compute_loss(b)


def _encoder_seq_first():
    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(101, 32)
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=False, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(32, 3)

        def forward(self, b):
            h = self.encoder(self.emb(b["input_ids"]).transpose(0, 1))  # [S, B, H]
            return F.cross_entropy(self.head(h.mean(0)), b["labels"])

    return SeqFirst(), None, lambda m, b: m(b)


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=101, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    return model, None, lambda m, b: m(input_ids=b["input_ids"], labels=b["input_ids"]).loss


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = LlamaForCausalLM(cfg)
    return model, None, lambda m, b: m(input_ids=b["input_ids"], labels=b["input_ids"]).loss


MODELS = {
    "gpt-user-plan": _gpt,
    "hf-bert": _bert,
    "torch-encoder": _encoder,
    "torch-encoder-seq-first": _encoder_seq_first,
    "hf-gpt2": _hf_gpt2,
    "hf-llama": _llama,
}
EXPECTED_LAYOUT = {
    "gpt-user-plan": ("norms", 1),
    "hf-bert": ("residual", 1),
    "torch-encoder": ("residual", 1),
    "torch-encoder-seq-first": ("residual", 0),
    "hf-gpt2": ("residual", 1),
    "hf-llama": ("residual", 1),
}


def _sharded(build, rank, *, sp: bool, seed=0, dropout=None):
    from megastrategy.layers.plan import apply_tp_plan, resolve_tp_plan
    from megastrategy.layers.random import ModelParallelRNGTracker
    from megastrategy.layers.sequence_parallel import enable_sequence_parallel

    torch.manual_seed(seed)
    model, tp_plan, loss_fn = build()
    if dropout is not None:
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = dropout
    group = dist.group.WORLD
    tracker = ModelParallelRNGTracker(tp_rank=rank, device="cpu")
    tracker.seed(1234)
    plan = resolve_tp_plan(model, tp_plan, dist.get_world_size())
    apply_tp_plan(model, plan, group=group, rng_tracker=tracker)
    setup = None
    if sp:
        setup = enable_sequence_parallel(model, plan, tp_group=group, rng_tracker=tracker)
    model.train()
    return model, loss_fn, tracker, setup


def _step(model, loss_fn, batch, *, sp_reduce: bool):
    from megastrategy.layers.mappings import record_collectives
    from megastrategy.layers.sequence_parallel import allreduce_sequence_parallel_grads, sequence_parallel_grad_params

    torch.manual_seed(42)
    with record_collectives() as log:
        loss = loss_fn(model, batch)
        loss.backward()
    if sp_reduce:
        allreduce_sequence_parallel_grads(sequence_parallel_grad_params(model), dist.group.WORLD)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {r.op for r in log}


def _equivalence(rank, world):
    from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear

    report = {}
    batch = _batch()
    for name, build in MODELS.items():
        ref, loss_fn, _, _ = _sharded(build, rank, sp=False)
        sp, _, _, setup = _sharded(build, rank, sp=True)
        assert (setup.layout, setup.sequence_dim) == EXPECTED_LAYOUT[name], (name, setup)
        assert list(sp.state_dict()) == list(ref.state_dict()), name
        cols = [m for m in sp.modules() if isinstance(m, ColumnParallelLinear) and m.sequence_parallel]
        rows = [m for m in sp.modules() if isinstance(m, RowParallelLinear) and m.sequence_parallel]
        assert cols, name
        if setup.layout == "residual":
            assert rows, name
        loss_ref, g_ref, ops_ref = _step(ref, loss_fn, batch, sp_reduce=False)
        loss_sp, g_sp, ops_sp = _step(sp, loss_fn, batch, sp_reduce=True)
        assert "all_gather" in ops_sp, (name, ops_sp)
        if setup.layout == "residual":
            assert "reduce_scatter" in ops_sp, (name, ops_sp)
        torch.testing.assert_close(loss_sp, loss_ref, atol=ATOL, rtol=RTOL, msg=name)
        assert set(g_sp) == set(g_ref), name
        worst = 0.0
        for pname, g in g_ref.items():
            torch.testing.assert_close(g_sp[pname], g, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} {pname}: {m}")
            worst = max(worst, float((g_sp[pname] - g).abs().max()))
        # the eval forward (no_grad) works too and matches
        sp.eval()
        ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(loss_fn(sp, batch), loss_fn(ref, batch), atol=ATOL, rtol=RTOL)
        report[name] = (float(loss_sp), worst, len(setup.grad_params))
    return report


def _recompute_and_dropout(rank, world):
    """SP composes with full recompute: bitwise the same with dropout on (per-rank stream)."""
    from megastrategy.layers.recompute import apply_activation_checkpointing

    batch = _batch()
    out = {}
    for name in ("hf-bert", "gpt-user-plan", "torch-encoder"):
        results = []
        for mode in (None, "full", "selective"):
            if mode == "selective" and name == "gpt-user-plan":
                continue
            model, loss_fn, tracker, _ = _sharded(MODELS[name], rank, sp=True, dropout=0.1)
            if mode:
                apply_activation_checkpointing(model, mode, rng_tracker=tracker)
            results.append(_step(model, loss_fn, batch, sp_reduce=True))
        base = results[0]
        for loss, grads, _ in results[1:]:
            assert torch.equal(loss, base[0]), name
            for pname, g in base[1].items():
                assert torch.equal(grads[pname], g), (name, pname)
        out[name] = float(base[0])
    return out


def _errors(rank, world):
    from megastrategy.layers.plan import apply_tp_plan, resolve_tp_plan
    from megastrategy.layers.sequence_parallel import enable_sequence_parallel

    group = dist.group.WORLD
    msgs = {}
    # 1. a sequence length tp does not divide: named at the first batch
    model, loss_fn, _, _ = _sharded(_bert, rank, sp=True)
    b = _batch(seq=15)
    try:
        loss_fn(model, b)
    except MegatronConfigError as err:
        msgs["length"] = str(err)
    # 2. cross-attention / decoder layers
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)
    plan = resolve_tp_plan(dec, None, world)
    apply_tp_plan(dec, plan, group=group, rng_tracker=_tracker(rank))
    try:
        enable_sequence_parallel(dec, plan, tp_group=group)
    except MegatronConfigError as err:
        msgs["decoder"] = str(err)

    # 3. a post-norm user block: caught at the first batch
    class PostNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out, self.ln = nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)

        def forward(self, x):
            return self.ln(x + self.out(torch.relu(self.fc(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(PostNorm() for _ in range(2))

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return x

    net = Net()
    plan = resolve_tp_plan(net, {"blocks.*.fc": "column", "blocks.*.out": "row"}, world)
    apply_tp_plan(net, plan, group=group, rng_tracker=None)
    enable_sequence_parallel(net, plan, tp_group=group)
    try:
        net(torch.randn(2, 4, 8))
    except MegatronConfigError as err:
        msgs["post-norm"] = str(err)

    # 4. a user block without any norm
    class NoNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return x + self.out(self.fc(x))

    net2 = nn.Sequential()
    net2.blocks = nn.ModuleList(NoNorm() for _ in range(2))
    plan = resolve_tp_plan(net2, {"blocks.*.fc": "column", "blocks.*.out": "row"}, world)
    apply_tp_plan(net2, plan, group=group, rng_tracker=None)
    try:
        enable_sequence_parallel(net2, plan, tp_group=group)
    except MegatronConfigError as err:
        msgs["no-norm"] = str(err)
    return msgs


def _tracker(rank):
    from megastrategy.layers.random import ModelParallelRNGTracker

    t = ModelParallelRNGTracker(tp_rank=rank, device="cpu")
    t.seed(1234)
    return t


def _all(rank, world):
    return {"equivalence": _equivalence(rank, world), "recompute": _recompute_and_dropout(rank, world),
            "errors": _errors(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all, 2, timeout=600)


def test_sequence_parallel_matches_tensor_parallel(results):
    for rank_result in results:
        assert set(rank_result["equivalence"]) == set(MODELS)
        for name, (_, worst, n_sp) in rank_result["equivalence"].items():
            assert worst <= 1e-5, (name, worst)
            assert n_sp > 0, name


def test_sequence_parallel_with_recompute_and_dropout_is_bitwise(results):
    assert set(results[0]["recompute"]) == {"hf-bert", "gpt-user-plan", "torch-encoder"}


def test_sequence_parallel_errors(results):
    msgs = results[0]["errors"]
    assert "sequence length 15" in msgs["length"] and "tp=2" in msgs["length"]
    assert "TransformerDecoderLayer" in msgs["decoder"]
    assert "pre-norm" in msgs["post-norm"]
    assert "no LayerNorm/RMSNorm" in msgs["no-norm"]


# ---------------------------------------------------------------------------------- Lightning
@functools.lru_cache(maxsize=None)
def _train(nprocs: int, *args: str) -> dict:
    from pathlib import Path

    from tests.helpers.launch import run_script

    script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
    return run_script(script, nprocs, list(args), timeout=600)


def _assert_same_training(ours: dict, ref: dict, tol: float = 2e-4) -> None:
    assert len(ours["train_loss"]) == len(ref["train_loss"]) > 0
    diffs = [abs(a - b) for a, b in zip(ours["train_loss"], ref["train_loss"])]
    assert max(diffs) < tol, f"per-step losses differ by up to {max(diffs):.2e}: {ours['train_loss']} vs {ref['train_loss']}"
    assert ref["train_loss"][0] != ref["train_loss"][-1], "the reference did not train"
    assert len(ours["val_loss"]) == len(ref["val_loss"]) > 0
    assert max(abs(a - b) for a, b in zip(ours["val_loss"], ref["val_loss"])) < tol


@pytest.mark.slow
@pytest.mark.parametrize(
    "nprocs, model, extra",
    [(2, "bert", ()), (2, "encoder", ()), (4, "bert", ("--pp", "2"))],
    ids=["hf-bert-tp2", "torch-encoder-tp2", "hf-bert-tp2-pp2"],
)
def test_lightning_sequence_parallel_matches_ddp(nprocs, model, extra):
    ours = _train(nprocs, "--model", model, "--strategy", "megatron", "--tp", "2", "--sequence-parallel", *extra)
    ref = _train(1, "--model", model, "--strategy", "ddp")
    _assert_same_training(ours, ref)
