"""Setup-time verification of sharded blocks (megastrategy.layers.block_check) on two real
processes: every declared and built-in plan of the zoo passes, and plans that would be silently
wrong are refused with the block named -- including one that transformers itself declares."""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.hf_zoo import BUILTIN_DECODERS, DECLARED_DECODERS, ENCODERS, REFUSED_DECLARED


def _shard_and_verify(model, tp_plan, rank):
    import torch
    import torch.distributed as dist

    from megastrategy.layers.block_capture import capture_blocks
    from megastrategy.layers.block_check import verify_sharded_blocks
    from megastrategy.layers.plan import apply_tp_plan, resolve_tp_plan
    from megastrategy.layers.random import ModelParallelRNGTracker

    from megastrategy.layers.plan_report import parameters_per_rank

    plan = resolve_tp_plan(model, tp_plan, 2)
    predicted, _ = parameters_per_rank(model, plan)
    captured = capture_blocks(model, plan)
    tracker = ModelParallelRNGTracker(tp_rank=rank, device=torch.device("cpu"))
    tracker.seed(0)
    apply_tp_plan(model, plan, group=dist.group.WORLD, rng_tracker=tracker)
    held = sum(p.numel() for p in model.parameters())  # what `megastrategy plan` predicted
    verify_sharded_blocks(model, captured, dist.group.WORLD, 2)
    return [c.name for c in captured], predicted, held


#: a user tp_plan with the two FFN layers' styles swapped: it resolves (sizes divide) but is wrong
SWAPPED_FFN = {"*": "auto", "distilbert.transformer.layer.*.ffn.lin1": "row",
               "distilbert.transformer.layer.*.ffn.lin2": "column"}


def _misdeclared(name):
    """Models whose plan is shape-consistent but wrong (patched declarations)."""
    from tests.helpers.hf_zoo import tiny_model

    if name == "stablelm_qk_norm":  # one LayerNorm per head, picked by position: local heads get heads 0..1's
        return tiny_model("stablelm", qk_layernorm=True)
    model = tiny_model({"qwen3_no_norm_sum": "qwen3", "phi3_naive": "phi3", "distilbert_swapped": "distilbert"}[name])
    plan = dict(model._tp_plan)
    if name == "qwen3_no_norm_sum":  # per-head norms after sharded q/k, gradients left partial
        plan = {k: v for k, v in plan.items() if not k.endswith("_norm")}
    elif name == "phi3_naive":  # packed [q|k|v] of unequal sizes split as one plain column
        plan["model.layers.*.self_attn.qkv_proj"] = "colwise"
        plan["model.layers.*.self_attn.o_proj"] = "rowwise"
    model._tp_plan = plan
    return model


def _verify_all(rank, world, archs, misdeclared):
    from megastrategy.errors import MegatronConfigError
    from tests.helpers.hf_zoo import tiny_model

    out = {}
    for name in list(archs) + list(misdeclared):
        model = _misdeclared(name) if name in misdeclared else tiny_model(name)
        tp_plan = SWAPPED_FFN if name == "distilbert_swapped" else None
        try:
            out[name] = ("ok", _shard_and_verify(model, tp_plan, rank))
        except MegatronConfigError as e:
            out[name] = ("refused", str(e))
    return out


@pytest.mark.slow
def test_every_plan_verifies_and_wrong_plans_are_refused_tp2():
    misdeclared = ["qwen3_no_norm_sum", "phi3_naive", "distilbert_swapped", "stablelm_qk_norm"]
    archs = list(DECLARED_DECODERS + BUILTIN_DECODERS + ENCODERS + REFUSED_DECLARED)
    ranks = run_distributed(_verify_all, 2, archs, misdeclared, timeout=400)
    assert ranks[0].keys() == ranks[1].keys()
    for rank in ranks:  # every rank agrees and refuses together
        assert {k: v[0] for k, v in rank.items()} == {k: v[0] for k, v in ranks[0].items()}
    res = ranks[0]
    # transformers' own Apertus plan shards the MLP around xIELU, whose learnable alpha_p/alpha_n
    # would get partial gradients on each rank: caught, never trained silently wrong
    status, msg = res.pop("apertus")
    assert status == "refused" and "'model.layers.0.mlp'" in msg and "gradient of act_fn.alpha_" in msg
    ok = {k for k, (status, _) in res.items() if status == "ok"} - set(misdeclared)
    assert ok == set(archs) - {"apertus"}, {k: v for k, v in res.items() if k not in ok}
    assert res["llama"][1][0] == ["model.layers.0.self_attn", "model.layers.0.mlp"]  # one per distinct block
    assert res["albert"][1][0][0] == "albert.encoder.albert_layer_groups.0.albert_layers.0"
    for name in ok:  # the parameters per rank `megastrategy plan` prints are what a rank holds
        assert res[name][1][1] == res[name][1][2], (name, res[name][1][1:])
    status, msg = res.pop("qwen3_no_norm_sum")
    assert status == "refused" and "'model.layers.0.self_attn'" in msg and "gradient of q_norm.weight" in msg
    assert "declared:qwen3" in msg and "'model.layers.*.self_attn': 'replicate'" in msg
    status, msg = res.pop("phi3_naive")
    assert status == "refused" and "'model.layers.0.self_attn'" in msg and "Phi3Attention" in msg
    status, msg = res.pop("distilbert_swapped")  # the user's glob, not a declaration, is wrong here
    assert status == "refused" and "'distilbert.transformer.layer.0.ffn'" in msg and "tp_plan[" in msg
    assert "its forward raised RuntimeError" in msg
    status, msg = res.pop("stablelm_qk_norm")  # the built-in rule is right only without per-head norms
    assert status == "refused" and "'model.layers.0.self_attn'" in msg and "auto:stablelm" in msg



def test_a_model_that_cannot_run_on_token_ids_alone_is_reported_unverified(caplog):
    import logging

    from megastrategy.layers.block_capture import capture_blocks
    from megastrategy.layers.plan import resolve_tp_plan
    from tests.helpers.hf_zoo import tiny_model

    model = tiny_model("llama")
    plan = resolve_tp_plan(model, None, 2)

    def needs_pixels(*args, **kwargs):
        raise ValueError("pixel_values are required")

    model.forward = needs_pixels
    with caplog.at_level(logging.WARNING, logger="megastrategy.layers.block_capture"):
        assert capture_blocks(model, plan) == []
    assert "model.layers.0.self_attn" in caplog.text and "are not verified" in caplog.text
    assert "pixel_values are required" in caplog.text


def test_hidden_states_passed_under_another_keyword_are_the_input_whose_gradient_is_compared():
    """FSMT's attention takes ``query=``, Pegasus-X's blocks other names: the first floating keyword
    is the hidden state (setup crashed with KeyError: 'hidden_states')."""
    import torch

    from megastrategy.layers.block_check import _hidden_input

    query, mask = torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool)
    args, kwargs, leaf = _hidden_input((), {"key_padding_mask": mask, "query": query})
    assert leaf.requires_grad and kwargs["query"] is leaf and torch.equal(leaf, query) and kwargs["key_padding_mask"] is mask


def test_a_cache_under_any_argument_name_is_dropped_from_captured_inputs():
    """XLM passes its key/value cache as ``cache=``: replaying the capture run's cache would make the
    unsharded reference itself fail (it attends over the cached keys too)."""
    import torch
    from transformers import DynamicCache

    from megastrategy.layers.block_capture import _detached

    args, kwargs = _detached(((torch.ones(2), DynamicCache()), {"cache": DynamicCache(), "mask": torch.ones(3)}))
    assert args[1] is None and kwargs["cache"] is None and kwargs["mask"].shape == (3,)
