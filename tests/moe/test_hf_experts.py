"""Hugging Face MoE decoders under expert parallelism: fused experts (Mixtral, Qwen3-MoE, OLMoE,
DeepSeek-V3) and GPT-OSS's experts in their own layout.

Unit level: the fused-experts module is recognised, refused clearly when ``ep`` or ``etp`` cannot
split it, and its expert-parallel slice computes what Hugging Face's own loop computes. With real
processes: each model, an ordinary LightningModule whose forward passes ``labels=`` (so the loss
includes the router's auxiliary loss), trains at ep=2 exactly as under ``DDPStrategy`` on the same
two processes, and the sharded checkpoint consolidates to DDP's final weights.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.fused_experts import is_routed_experts
from megastrategy.moe.hf_experts import (
    FusedExpertsParallel, RoutedExpertsParallel, fused_experts, is_fused_experts, plain_gating, validate_fused_experts,
)
from megastrategy.parallel_state import ParallelLayout
from tests.helpers.launch import run_script

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "scripts" / "hf_moe.py"


def _mixtral():
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg)


def test_the_fused_experts_of_each_layer_are_found_and_nothing_else():
    names = [n for n, _ in fused_experts(_mixtral())]
    assert names == ["model.layers.0.mlp.experts"]
    assert not is_fused_experts(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("ep,etp,rule", [(3, 1, "not divisible by ep"), (2, 2, "Pass etp=1")])
def test_a_layout_that_cannot_split_the_experts_is_refused_by_name(ep, etp, rule):
    layout = ParallelLayout(world_size=ep * etp * 2, tp=etp, ep=ep, etp=etp) if etp > 1 else None
    layout = layout or ParallelLayout(world_size=ep, ep=ep)
    with pytest.raises(MegatronConfigError, match=rule) as info:
        validate_fused_experts(_mixtral(), layout)
    assert "model.layers.0.mlp.experts" in str(info.value)


def _routed_tokens(hidden: int):
    """Six tokens, each routed to two of four experts, with softmaxed weights."""
    x = torch.randn(6, hidden, requires_grad=True)
    index = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    return x, index, torch.rand(6, 2).softmax(-1)


def test_the_parallel_slice_computes_hugging_face_experts_on_one_rank():
    torch.manual_seed(0)
    experts = _mixtral().model.layers[0].mlp.experts
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = FusedExpertsParallel(experts, ep_group=None)
    x, index, weights = _routed_tokens(16)
    expected, got = experts(x, index, weights), ours(x, index, weights)
    torch.testing.assert_close(got, expected)
    grad_ref = torch.autograd.grad(expected.square().sum(), [x, experts.gate_up_proj, experts.down_proj])
    grad_ours = torch.autograd.grad(got.square().sum(), [x, ours.gate_up_proj, ours.down_proj])
    for a, b in zip(grad_ours, grad_ref):
        torch.testing.assert_close(a, b)


def test_gpt_oss_experts_in_their_own_layout_run_their_own_code_on_the_ranks_slice():
    """GPT-OSS: gate_up_proj [E, H, 2F] with biases, gate/up interleaved, a clamped activation."""
    from tests.helpers.hf_zoo import tiny_model

    torch.manual_seed(0)
    experts = tiny_model("gpt_oss").model.layers[0].mlp.experts
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    assert [n for n, _ in fused_experts(experts)] == [""]
    ours = RoutedExpertsParallel(experts, ep_group=None)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in experts.named_parameters()]
    x = torch.randn(6, 32, requires_grad=True)
    index = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(6, 2).softmax(-1)
    expected, got = experts(x, index, weights), ours(x, index, weights)
    torch.testing.assert_close(got, expected)
    grad_ref = torch.autograd.grad(expected.square().sum(), [x, *experts.parameters()])
    grad_ours = torch.autograd.grad(got.square().sum(), [x, *ours.parameters()])
    for a, b in zip(grad_ours, grad_ref):
        torch.testing.assert_close(a, b)


class _OwnGateExperts(torch.nn.Module):
    """Fused experts with a gate of their own (``_apply_gate``: a clamped SwiGLU, as DeepSeek-V4,
    Step-3.7 and HunYuan-V4 have; ``up=False``: NemotronH's ungated ``up_proj`` with relu²)."""

    def __init__(self, gated: bool = True):
        super().__init__()
        first = 2 * 8 if gated else 8
        setattr(self, "gate_up_proj" if gated else "up_proj", torch.nn.Parameter(torch.randn(4, first, 16) * 0.5))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 8) * 0.5)
        self.gated, self.limit, self.num_experts = gated, 0.3, 4
        self.act_fn = torch.nn.SiLU()

    def _apply_gate(self, gate_up):
        if not self.gated:
            return torch.relu(gate_up).square()
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        first = self.gate_up_proj if self.gated else self.up_proj
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            h = self._apply_gate(torch.nn.functional.linear(hidden_states[token], first[e]))
            out = out.index_add(0, token, torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token, slot, None])
        return out


@pytest.mark.parametrize("gated", [True, False], ids=["clamped-gate", "ungated-up-proj"])
def test_experts_with_a_gate_of_their_own_run_their_own_code_not_a_plain_swiglu(gated):
    """The sweep found HunYuan-V4 and MiniMax-M3 crashing (no act_fn), Inkling-2 crashing (a two-input gate)
    and, worse, clamped SwiGLUs that FusedExpertsParallel would compute without their clamp."""
    torch.manual_seed(0)
    experts = _OwnGateExperts(gated)
    assert [n for n, _ in fused_experts(experts)] == [""] and not plain_gating(experts)
    assert is_fused_experts(experts) if gated else is_routed_experts(experts)
    ours = RoutedExpertsParallel(experts, ep_group=None)
    x, index, weights = _routed_tokens(16)
    expected, got = experts(x, index, weights), ours(x, index, weights)
    torch.testing.assert_close(got, expected)
    if gated:  # what the plain SwiGLU path would have computed: silently not the model
        assert not torch.allclose(FusedExpertsParallel(experts, ep_group=None)(x, index, weights), expected)


def test_experts_that_run_on_every_token_are_refused_under_ep_not_left_whole():
    """Llama 4's experts take the tokens only (every expert on every token, scaled beforehand)."""
    from tests.helpers.hf_zoo import tiny_model

    with pytest.raises(MegatronConfigError, match="not called with the routing") as info:
        validate_fused_experts(tiny_model("llama4_text"), ParallelLayout(world_size=2, ep=2))
    assert "'model.layers.1.feed_forward.experts' (Llama4TextExperts)" in str(info.value) and "Use ep=1" in str(info.value)


@lru_cache(maxsize=None)
def _run(strategy: str, nprocs: int, *extra: str) -> dict:
    return run_script(SCRIPT, nprocs, ["--strategy", strategy, *extra], timeout=600)


LAYOUTS = {"ep2": (2, ("--ep", "2")), "tp2-ep2": (4, ("--tp", "2", "--ep", "2"))}  # dense dp = 2 in both
#: their declared tensor-parallel plans leave the attention whole (GPT-OSS: the embedding only; DeepSeek-V3: the MLPs)
ATTENTION_WHOLE = ("gpt_oss", "deepseek_v3")


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"])
def test_hugging_face_moe_trains_as_under_ddp_and_its_checkpoint_consolidates(arch, layout):
    from megastrategy.checkpoint.consolidate import consolidate

    nprocs, extra = LAYOUTS[layout]
    ours, ref = _run("megatron", nprocs, *extra)[arch], _run("ddp", 2)[arch]
    assert ours["local_experts"][0][0] == 2 and ref["local_experts"][0][0] == 4, "the experts were not split"
    tp = 2 if "--tp" in extra else 1
    split = 1 if arch in ATTENTION_WHOLE else tp
    assert [s[0] * split for s in ours["q_proj"]] == [s[0] for s in ref["q_proj"]], "the attention was not split as declared"
    assert len(ours["losses"]) == len(ref["losses"]) == 4
    assert ref["losses"][0] != ref["losses"][-1], "the reference did not train"
    diff = max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))
    assert diff < 2e-4, f"{arch}: losses differ by {diff:.2e}: {ours['losses']} vs {ref['losses']}"
    full = consolidate(ours["checkpoint"])
    ddp = {k.removeprefix("model."): v for k, v in torch.load(ref["checkpoint"], weights_only=True)["state_dict"].items()}
    full = {k.removeprefix("model."): v for k, v in full.items()}
    assert full.keys() == ddp.keys()
    experts = [k for k in ddp if k.endswith("experts.gate_up_proj")]
    assert experts and all(full[k].shape == ddp[k].shape for k in experts)
    for k in ddp:  # SGD at lr 0.5: a wrong or mis-scaled expert gradient shows far above 1e-4
        torch.testing.assert_close(full[k], ddp[k], atol=1e-4, rtol=1e-3, msg=lambda m, k=k: f"{arch} {k}: {m}")
