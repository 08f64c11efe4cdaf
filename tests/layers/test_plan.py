"""Plan resolution (pure), validation errors, and applying a user plan on real processes.

Built-in architectures (HF BERT / GPT-2 / Llama, torch Transformer layers) are in
test_builtin_plans.py; the equivalence helpers here are shared with it.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import (
    STYLES,
    FixUp,
    ResolvedPlan,
    apply_tp_plan,
    glob_specificity,
    resolve_tp_plan,
)
from tests.helpers.dist import run_distributed

VOCAB = 99  # divisible by neither 2 nor 4


# ----------------------------------------------------------------------------- a hand-written GPT
class Block(nn.Module):
    def __init__(self, d: int, n_head: int, ffn: int, p: float = 0.0):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.drop = nn.Dropout(p)  # between fc and out: acts on column-sharded activations

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(B, T, self.n_head, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, -1))
        return x + self.out(self.drop(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    PLAN = {
        "wte": "vocab",
        "lm_head": "vocab",
        "blocks.*.q": "column",
        "blocks.*.k": "column",
        "blocks.*.v": "column",
        "blocks.*.proj": "row",
        "blocks.*.fc": "column",
        "blocks.*.drop": "column",
        "blocks.*.out": "row",
    }

    def __init__(self, d=32, n_head=4, n_layer=2, ffn=64, vocab=VOCAB, tie=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(16, d)
        self.blocks = nn.ModuleList(Block(d, n_head, ffn) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


class Wrapper(nn.Module):
    """Like a LightningModule holding the model: names are relative to the wrapper."""

    def __init__(self, **kw):
        super().__init__()
        self.model = TinyGPT(**kw)
        self.head = nn.Linear(32, 3)  # stand-alone: replicated


def _plan_for(prefix: str) -> dict[str, str]:
    return {f"{prefix}{k}": v for k, v in TinyGPT.PLAN.items()}


# ---------------------------------------------------------------------------------- pure tests
def test_styles_constant():
    assert STYLES == ("column", "row", "vocab", "replicate")


def test_glob_specificity_rule():
    # more literal characters win; on a tie, fewer wildcards
    assert glob_specificity("a.b.c") > glob_specificity("a.*.c")
    assert glob_specificity("a.b.c") > glob_specificity("a.b.c*")
    assert glob_specificity("blocks.*.q") > glob_specificity("*.q")
    assert glob_specificity("*") < glob_specificity("x")
    assert glob_specificity("a.[bc].d") == (4, -1)


def test_user_plan_resolves_hand_written_gpt():
    model = Wrapper()
    plan = resolve_tp_plan(model, _plan_for("model."), 2)
    assert isinstance(plan, ResolvedPlan) and plan.tp_size == 2 and not plan.auto
    styles = plan.styles()
    assert styles["model.wte"] == "vocab" and styles["model.lm_head"] == "vocab"
    assert styles["model.blocks.0.q"] == "column" and styles["model.blocks.1.proj"] == "row"
    assert styles["model.blocks.0.drop"] == "dropout"  # 'column' on an nn.Dropout
    assert styles["model.wpe"] == "replicate" and styles["head"] == "replicate"
    assert plan["model.wpe"].source == "default"
    assert plan["model.blocks.0.q"].source == "tp_plan['model.blocks.*.q']"
    # the head is tied to the embedding: recorded before anything is replaced
    assert plan["model.lm_head"].extra["tied_to"] == "model.wte"
    assert plan["model.lm_head"].extra["vocab_layer"] == "head"
    # column layers of one parent share one input copy
    for n in ("q", "k", "v", "fc"):
        assert plan[f"model.blocks.0.{n}"].extra["input_copy"] == "model.blocks.0"
    # generic head-count fix-up: int attribute with a known name on the column layers' parent
    assert FixUp("model.blocks.0", "n_head", 4, 2, "parent of column-sharded model.blocks.0.q") in plan.fixups
    assert {(f.module, f.attr) for f in plan.fixups} == {("model.blocks.0", "n_head"), ("model.blocks.1", "n_head")}
    # inspectable as (name, style, extra) and printable
    items = plan.items()
    assert ("model.blocks.0.proj", "row", {}) in items
    text = str(plan)
    assert "model.blocks.1.out" in text and "n_head: 4 -> 2" in text and "tp=2" in text
    # the module itself is untouched
    assert isinstance(model.model.blocks[0].q, nn.Linear) and model.model.blocks[0].n_head == 4


def test_most_specific_glob_wins_and_replicate_parent_excludes_children():
    model = TinyGPT()
    plan = resolve_tp_plan(
        model,
        {**TinyGPT.PLAN, "blocks.0.q": "replicate", "*.k": "replicate", "blocks.1": "replicate"},
        2,
    )
    s = plan.styles()
    assert s["blocks.0.q"] == "replicate"  # exact name beats 'blocks.*.q'
    assert s["blocks.0.k"] == "column"  # 'blocks.*.k' (9 literals) beats '*.k' (2)
    assert all(s[f"blocks.1.{n}"] == "replicate" for n in ("q", "k", "v", "proj", "fc", "out"))
    assert plan["blocks.1.q"].source == "tp_plan['blocks.1']"
    assert not any(f.module == "blocks.1" for f in plan.fixups)


def test_equally_specific_globs_with_different_styles_are_an_error():
    with pytest.raises(MegatronConfigError, match=r"'blocks\.0\.q' is matched by equally specific globs.*'blocks\.\*\.q'"):
        resolve_tp_plan(TinyGPT(), {**TinyGPT.PLAN, "blocks.0.?": "row"}, 2)


def test_plan_without_auto_is_used_as_given():
    model = TinyGPT()
    plan = resolve_tp_plan(model, {"blocks.*.fc": "column", "blocks.*.out": "row"}, 2)
    assert [e.name for e in plan.sharded] == ["blocks.0.fc", "blocks.0.out", "blocks.1.fc", "blocks.1.out"]
    # fc's parent is the Block: n_head is divided by the generic rule even though only the MLP is sharded
    assert {f.attr for f in plan.fixups} == {"n_head"}


def test_tp1_resolves_without_sharding_errors():
    plan = resolve_tp_plan(nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)), None, 1)
    assert plan.sharded == ()


# ------------------------------------------------------------------------------ validation errors
def test_error_unknown_style_names_the_entry_and_suggests():
    with pytest.raises(MegatronConfigError, match=r"tp_plan\['blocks\.\*\.q'\]='colwise'.*did you mean 'column'"):
        resolve_tp_plan(TinyGPT(), {**TinyGPT.PLAN, "blocks.*.q": "colwise"}, 2)
    with pytest.raises(MegatronConfigError, match=r"tp_plan\['wte'\]='sharded' is not a tensor-parallel style"):
        resolve_tp_plan(TinyGPT(), {**TinyGPT.PLAN, "wte": "sharded"}, 2)


def test_error_glob_matching_nothing_lists_close_names():
    with pytest.raises(
        MegatronConfigError, match=r"tp_plan\['blocks\.\*\.qq'\]='column': the glob matches no module.*close names: 'blocks\.\*\.q'"
    ):
        resolve_tp_plan(TinyGPT(), {**TinyGPT.PLAN, "blocks.*.qq": "column"}, 2)
    with pytest.raises(MegatronConfigError, match=r"tp_plan\['blocks\.\*\.q'\].*close names: 'model\.blocks\.\*\.q'"):
        resolve_tp_plan(Wrapper(), {"blocks.*.q": "column"}, 2)


def test_error_style_that_does_not_fit_the_module():
    with pytest.raises(MegatronConfigError, match=r"tp_plan\['wte'\]='row' matches 'wte' \(type Embedding\).*'vocab' or 'replicate'"):
        resolve_tp_plan(TinyGPT(), {**TinyGPT.PLAN, "wte": "row"}, 2)
    with pytest.raises(MegatronConfigError, match=r"tp_plan\['blocks\.\*'\]='column' matches 'blocks\.0' \(type Block\).*container"):
        resolve_tp_plan(TinyGPT(), {"blocks.*": "column"}, 2)
    with pytest.raises(MegatronConfigError, match=r"tp_plan\['blocks\.0\.drop'\]='row'.*nn\.Dropout takes 'column'"):
        resolve_tp_plan(TinyGPT(), {**TinyGPT.PLAN, "blocks.0.drop": "row"}, 2)


def test_error_heads_not_divisible_lists_working_tp():
    model = TinyGPT(d=24, n_head=6, ffn=48)
    with pytest.raises(MegatronConfigError, match=r"tp=4 does not divide n_head=6 of blocks\.0 .*use tp in \{1, 2, 3, 6\}"):
        resolve_tp_plan(model, TinyGPT.PLAN, 4)
    resolve_tp_plan(model, TinyGPT.PLAN, 3)  # fine


def test_error_ffn_not_divisible():
    with pytest.raises(MegatronConfigError, match=r"tp=4 does not divide out_features=70 of blocks\.0\.fc .*use tp in \{1, 2\}"):
        resolve_tp_plan(TinyGPT(ffn=70), TinyGPT.PLAN, 4)
    with pytest.raises(MegatronConfigError, match=r"tp=4 does not divide in_features=70 of blocks\.0\.out"):
        resolve_tp_plan(TinyGPT(ffn=70), {"blocks.*.out": "row"}, 4)


def test_vocab_not_divisible_is_fine():
    plan = resolve_tp_plan(TinyGPT(vocab=101), TinyGPT.PLAN, 4)
    assert plan["wte"].style == "vocab"


def test_error_tied_head_whose_embedding_is_not_vocab():
    plan = {k: v for k, v in TinyGPT.PLAN.items() if k != "wte"}
    with pytest.raises(MegatronConfigError, match=r"lm_head\.weight.*tied to 'wte'.*add \{'wte': 'vocab'\}"):
        resolve_tp_plan(TinyGPT(), plan, 2)
    plan = {k: v for k, v in TinyGPT.PLAN.items() if k != "lm_head"}
    with pytest.raises(MegatronConfigError, match=r"wte\.weight.*tied to lm_head\.weight.*mark 'lm_head' 'vocab'"):
        resolve_tp_plan(TinyGPT(), plan, 2)
    # untied: each may be sharded alone
    resolve_tp_plan(TinyGPT(tie=False), plan, 2)


def test_error_other_ties_between_sharded_parameters():
    model = TinyGPT()
    model.blocks[0].k.weight = model.blocks[0].q.weight
    with pytest.raises(MegatronConfigError, match=r"blocks\.0\.(q|k)\.weight \('column'\) is the same Parameter as blocks\.0\.(q|k)\.weight"):
        resolve_tp_plan(model, TinyGPT.PLAN, 2)


def test_error_auto_detection_finds_nothing_to_shard():
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 2)

    with pytest.raises(MegatronConfigError, match=r"tp=2 with tp_plan=None: auto-detection found nothing to shard in MLP.*tp_plan=\{.*'fc1'"):
        resolve_tp_plan(MLP(), None, 2)


class _LeakyBlock(nn.Module):
    """``q``'s output reaches the residual stream as well as ``proj``: no column/row region."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.q, self.proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.q(x)
        return x + h + self.proj(h)


class _LeakyStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_LeakyBlock() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_error_auto_detection_cannot_classify_repeated_block():
    with pytest.raises(
        MegatronConfigError,
        match=r"tp=2 with auto-detection \(tp_plan=None\).*cannot classify.*'blocks\.\*\.q'.*tp_plan=\{'\*': 'auto', 'blocks\.\*\.q'",
    ):
        resolve_tp_plan(_LeakyStack(), None, 2)
    # the combined form: auto-detection plus the user's entries
    plan = resolve_tp_plan(TinyGPT(), {"*": "auto", **TinyGPT.PLAN}, 2)
    assert plan.auto and plan["blocks.0.q"].style == "column"


def test_error_plan_that_shards_nothing():
    with pytest.raises(MegatronConfigError, match=r"tp=2 with tp_plan=\{'blocks': 'replicate'\}: the plan shards nothing"):
        resolve_tp_plan(TinyGPT(), {"blocks": "replicate"}, 2)


def test_error_replicate_parent_contradicts_sharding_glob():
    with pytest.raises(MegatronConfigError, match=r"tp_plan\['blocks\.1\.q'\]='column' matches only modules beneath 'blocks\.1'"):
        resolve_tp_plan(TinyGPT(), {"blocks.*": "replicate", "blocks.1.q": "column"}, 2)


def test_error_bad_arguments():
    with pytest.raises(MegatronConfigError, match=r"tp=0 must be a positive integer"):
        resolve_tp_plan(TinyGPT(), TinyGPT.PLAN, 0)
    with pytest.raises(MegatronConfigError, match=r"tp_plan=\['wte'\] must be a dict"):
        resolve_tp_plan(TinyGPT(), ["wte"], 2)


def test_resolve_is_pure():
    model = TinyGPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = [type(m) for m in model.modules()]
    resolve_tp_plan(model, TinyGPT.PLAN, 2)
    assert [type(m) for m in model.modules()] == types
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.wte.weight and model.blocks[0].n_head == 4


# ---------------------------------------------------------------- equivalence helpers (shared)
def check_params_and_grads(tp_model, ref_model, rank, world, *, rename=None, transposed=(), atol=2e-5, rtol=1e-4):
    """Every parameter of ``tp_model`` is this rank's shard of the reference's (weights AND
    loss gradients); replicated ones equal the reference. Returns the number checked."""
    from megastrategy.layers.shard_spec import get_shard_spec, shard_full_tensor

    ref = dict(ref_model.named_parameters())
    seen = set()
    for name, p in tp_model.named_parameters():
        rname = rename(name) if rename else name
        assert rname in ref, f"{name} ({rname}) has no reference parameter"
        seen.add(rname)
        r = ref[rname]
        full_w, full_g = r.detach(), r.grad
        if rname in transposed:  # HF Conv1D stores [in, out]; the sharded layer [out, in]
            full_w, full_g = full_w.t(), full_g.t()
        spec = get_shard_spec(p)
        if spec is None:
            exp_w, exp_g = full_w, full_g
        else:
            exp_w = shard_full_tensor(full_w, spec, rank, world)
            exp_g = shard_full_tensor(full_g, spec, rank, world)
        assert p.shape == exp_w.shape, f"{name}: {tuple(p.shape)} vs {tuple(exp_w.shape)}"
        torch.testing.assert_close(p.detach(), exp_w, atol=0, rtol=0, msg=f"weight {name}")
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, exp_g, atol=atol, rtol=rtol, msg=lambda m: f"grad {name}: {m}")
    missing = set(ref) - seen
    assert not missing, f"reference parameters without a counterpart: {sorted(missing)}"
    return len(seen)


def check_logits(tp_logits, ref_logits, targets, vocab):
    """Vocab-parallel logits: same loss (F.cross_entropy) and same argmax as the reference."""
    loss_tp = F.cross_entropy(tp_logits.reshape(-1, vocab), targets.reshape(-1))
    loss_ref = F.cross_entropy(ref_logits.reshape(-1, vocab), targets.reshape(-1))
    torch.testing.assert_close(loss_tp.detach(), loss_ref.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(tp_logits.argmax(-1), ref_logits.argmax(-1))
    return loss_tp, loss_ref


def make_tracker(rank):
    from megastrategy.layers.random import ModelParallelRNGTracker

    tracker = ModelParallelRNGTracker(tp_rank=rank, device="cpu")
    tracker.seed(1234)
    return tracker


# ------------------------------------------------------------------------- distributed checks
def _gpt_user_plan_equivalence(rank, world):
    from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear
    from megastrategy.layers.random import TensorParallelRegionDropout

    group = dist.group.WORLD
    results = {}
    for tie in (True, False):
        torch.manual_seed(0)
        model = Wrapper(tie=tie)
        ref = copy.deepcopy(model)
        plan = resolve_tp_plan(model, _plan_for("model."), world)
        apply_tp_plan(model, plan, group=group, rng_tracker=make_tracker(rank))
        blk = model.model.blocks[0]
        assert isinstance(blk.q, ColumnParallelLinear) and isinstance(blk.proj, RowParallelLinear)
        assert isinstance(blk.drop, TensorParallelRegionDropout)
        assert blk.n_head == 4 // world and ref.model.blocks[0].n_head == 4
        assert blk.q.input_copy is not None and blk.q.input_copy is blk.k.input_copy is blk.v.input_copy
        assert model.model.blocks[1].q.input_copy is not blk.q.input_copy
        if tie:
            assert model.model.lm_head.weight is model.model.wte.weight
        else:
            assert model.model.lm_head.weight is not model.model.wte.weight
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, VOCAB, (2, 9), generator=g)
        logits = model.model(ids[:, :-1])
        ref_logits = ref.model(ids[:, :-1])
        assert tuple(logits.shape) == (2, 8, VOCAB)
        loss, ref_loss = check_logits(logits, ref_logits, ids[:, 1:], VOCAB)
        loss.backward()
        ref_loss.backward()
        n = check_params_and_grads(model.model, ref.model, rank, world)
        results[tie] = n
    return results


def _apply_errors(rank, world):
    group = dist.group.WORLD
    out = []
    # a plan resolved for another tp size
    plan4 = resolve_tp_plan(TinyGPT(), TinyGPT.PLAN, 4)
    try:
        apply_tp_plan(TinyGPT(), plan4, group=group, rng_tracker=make_tracker(rank))
    except MegatronConfigError as e:
        out.append(str(e))
    # dropout on sharded activations without a tracker
    model = TinyGPT()
    plan = resolve_tp_plan(model, TinyGPT.PLAN, world)
    try:
        apply_tp_plan(model, plan, group=group, rng_tracker=None)
    except MegatronConfigError as e:
        out.append(str(e))
    # applying twice
    apply_tp_plan(model, plan, group=group, rng_tracker=make_tracker(rank))
    try:
        apply_tp_plan(model, plan, group=group, rng_tracker=make_tracker(rank))
    except MegatronConfigError as e:
        out.append(str(e))
    # a module registered under two parents is replaced in both
    shared = nn.Linear(8, 8)
    twin = nn.Module()
    twin.a = nn.Sequential(shared)
    twin.b = nn.Module()
    twin.b.alias = shared
    twin.a.add_module("1", nn.Linear(8, 8))
    p = resolve_tp_plan(twin, {"a.0": "column", "a.1": "row"}, world)
    apply_tp_plan(twin, p, group=group, rng_tracker=None)
    out.append(twin.a[0] is twin.b.alias and type(twin.a[0]).__name__ == "ColumnParallelLinear")
    return out


def _user_plan_checks(rank, world):
    return _gpt_user_plan_equivalence(rank, world), _apply_errors(rank, world)


def test_user_plan_equivalence_and_apply_errors_tp2():
    results = run_distributed(_user_plan_checks, 2)
    equiv = [r[0] for r in results]
    assert equiv[0] == equiv[1] and equiv[0][True] > 10
    errors = results[0][1]
    assert "plan was resolved for tp=4 but group has 2 ranks" in errors[0]
    assert errors[1].startswith("rng_tracker=None")
    assert "was it applied twice?" in errors[2]
    assert errors[3] is True
