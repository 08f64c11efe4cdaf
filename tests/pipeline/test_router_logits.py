"""A Hugging Face MoE model's load-balancing loss under pp: the router logits of earlier stages
are carried to the last one (src/megastrategy/pipeline/router_logits.py).

Unit level: what is refused (several microbatches: a batch-wide statistic; an encoder-decoder), and
the carry itself (stacked in layer order, put in front of the receiving forward's record,
differentiable). With real processes: Mixtral and Qwen3-MoE with ``output_router_logits=True``
train at pp2 exactly as on one device, Mixtral at pp3 (a middle stage passes stage 0's logits on
with its own) too, and at pp2·ep2 exactly as DDP on two processes (the same runs without the
carry differ by about 1e-3: the aux loss would miss stage 0's layers).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.router_logits import (
    carry_for, prepend_router_logits, records_router_logits, refuse_router_logits, stacked_router_logits,
)
from tests.helpers.launch import run_script

transformers = pytest.importorskip("transformers")
output_capturing = pytest.importorskip("transformers.utils.output_capturing")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hf_moe.py"


def _mixtral(**extra):
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, output_router_logits=True, **extra)
    return transformers.MixtralForCausalLM(cfg)


def test_mixtral_records_its_router_logits_through_transformers_output_hooks():
    assert records_router_logits(_mixtral())
    assert not records_router_logits(torch.nn.Linear(2, 2))


def test_several_microbatches_are_refused_naming_the_fix():
    with pytest.raises(MegatronConfigError, match=r"num_microbatches=4.*two statistics of the whole batch.*"
                                                  r"Pass num_microbatches=1.*output_router_logits=False"):
        refuse_router_logits(_mixtral(), 2, 4, encoder_decoder=False)
    refuse_router_logits(_mixtral(), 2, 1, encoder_decoder=False)


def test_an_encoder_decoder_is_refused_its_logits_are_not_carried():
    with pytest.raises(MegatronConfigError, match="not for an encoder-decoder.*output_router_logits=False"):
        refuse_router_logits(_mixtral(), 2, 1, encoder_decoder=True)


def test_without_output_router_logits_nothing_is_refused():
    module = _mixtral()
    module.config.output_router_logits = False
    refuse_router_logits(module, 2, 8, encoder_decoder=True)


def test_logits_asked_for_in_the_call_with_several_microbatches_are_refused_when_they_arrive():
    """The config says no (setup allowed several microbatches) but the forward passes
    output_router_logits=True: the logits are carried anyway, and the next stage refuses them."""
    module = _mixtral()
    assert carry_for(torch.nn.Linear(2, 2), 2, 1) is None
    assert carry_for(module, 2, 1).refusal is None
    carry = carry_for(module, 2, 4)
    carry.receive(torch.zeros(0))  # a stage of dense layers sent none, or none was asked for
    with pytest.raises(MegatronConfigError, match=r"num_microbatches=4.*called with output_router_logits=True.*"
                                                  r"Pass num_microbatches=1"):
        carry.receive(torch.zeros(2, 6, 4))


def _recording(record: list):
    """transformers' collector as ``capture_outputs`` sets it while a forward runs."""
    return output_capturing._active_collector.set({"router_logits": record})


def test_the_logits_cross_stacked_in_layer_order_and_go_in_front_of_the_next_stages_record():
    early = [torch.randn(6, 4, requires_grad=True) for _ in range(2)]
    token = _recording(list(early))
    try:
        sent = stacked_router_logits(torch.zeros(6, 16))
    finally:
        output_capturing._active_collector.reset(token)
    assert sent.shape == (2, 6, 4)
    late = torch.randn(6, 4)
    record = [late]
    token = _recording(record)
    try:
        prepend_router_logits(sent)
    finally:
        output_capturing._active_collector.reset(token)
    assert [t.shape for t in record] == [(6, 4)] * 3 and record[2] is late
    torch.testing.assert_close(torch.stack(record[:2]), torch.stack(early))
    sum(t.sum() for t in record).backward()  # the aux loss's gradient reaches the earlier stage's logits
    assert all(torch.equal(t.grad, torch.ones(6, 4)) for t in early)


def test_a_stage_of_dense_layers_sends_an_empty_tensor_and_receives_nothing():
    token = _recording([])
    try:
        sent = stacked_router_logits(torch.zeros(6, 16))
        assert sent.numel() == 0 and sent.dtype == torch.float32
        prepend_router_logits(sent)
        assert output_capturing._active_collector.get()["router_logits"] == []
    finally:
        output_capturing._active_collector.reset(token)


@lru_cache(maxsize=None)
def _run(strategy: str, nprocs: int, *extra: str) -> dict:
    return run_script(SCRIPT, nprocs, ["--strategy", strategy, *extra], timeout=600)


#: layout -> (processes, arguments, models, DDP processes: the same dense data parallelism)
LAYOUTS = {
    "pp2": (2, ("--pp", "2"), "mixtral,qwen3_moe", 1),
    # a middle stage: it puts stage 0's logits in front of its own and sends them all on
    "pp3": (3, ("--pp", "3", "--layers", "3"), "mixtral", 1),
    "pp2-ep2": (4, ("--pp", "2", "--ep", "2"), "mixtral", 2),
    # the config says no, the step's call says output_router_logits=True: carried all the same
    "pp2-call": (2, ("--pp", "2", "--call-router-logits"), "mixtral", 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_load_balancing_loss_under_pp_equals_one_devices(layout):
    nprocs, extra, models, ddp = LAYOUTS[layout]
    same = [a for a in ("--layers", "3", "--call-router-logits") if a in extra]  # the model and step DDP runs too
    ours = _run("megatron", nprocs, *extra, "--microbatches", "1", "--models", models)
    ref = _run("ddp", ddp, "--models", models, *same)
    if "--ep" in extra:
        assert ours["mixtral"]["local_experts"][0][0] == 2, "the experts were not split"
    for arch in models.split(","):
        assert len(ours[arch]["losses"]) == len(ref[arch]["losses"]) == 4
        diff = max(abs(a - b) for a, b in zip(ours[arch]["losses"], ref[arch]["losses"]))
        assert diff < 2e-4, f"{arch} {layout}: losses differ by {diff:.2e}: {ours[arch]['losses']} vs {ref[arch]['losses']}"
