"""Setup-time block verification on models outside Hugging Face (megastrategy.layers.plain_block_inputs):
a user tp_plan that the model's forward cannot run on local heads is refused in setup, naming the
block, its entries, the shape error and what works, instead of crashing in the first step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.dist import run_distributed


class NanoAttention(nn.Module):
    """nanoGPT's attention: reshapes back with the full embedding size C."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head, self.c_attn, self.c_proj = n_head, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoMLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), NanoAttention(d, n_head), nn.LayerNorm(d), NanoMLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, d: int = 32, n_head: int = 4, n_layer: int = 2, vocab: int = 64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(16, d)
        self.h = nn.ModuleList(NanoBlock(d, n_head) for _ in range(n_layer))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


#: column/row on attention and MLP, as one would write from Megatron's recipe
NANO_PLAN = {"h.*.attn.c_attn": "column", "h.*.attn.c_proj": "row", "h.*.mlp.c_fc": "column", "h.*.mlp.c_proj": "row"}
#: the same for LitGPT (the resolver divides its attention's head counts: exact)
LITGPT_PLAN = {"transformer.h.*.attn.qkv": "column", "transformer.h.*.attn.proj": "row",
               "transformer.h.*.mlp.fc_1": "column", "transformer.h.*.mlp.fc_2": "column",
               "transformer.h.*.mlp.proj": "row"}


def _models(name):
    if name == "nano":
        return NanoGPT(), NANO_PLAN
    if name == "nano_mlp_only":  # what works: attention kept whole
        return NanoGPT(), {k: v for k, v in NANO_PLAN.items() if ".mlp." in k}
    if name == "helpers_gpt":  # tests/helpers/models.GPT reshapes with -1: a correct user plan
        from tests.helpers.models import GPT

        return GPT(), GPT.TP_PLAN
    if name == "torch_encoder":  # nn.TransformerEncoderLayer, built-in plan (its MHA's parameters are renamed)
        from tests.helpers.models import EncoderClassifier

        return EncoderClassifier(), None
    from tests.helpers.litgpt_runs import tiny_litgpt

    return tiny_litgpt(4), LITGPT_PLAN


def _verify(rank, world, names):
    from tests.layers.test_block_check import _shard_and_verify
    from megastrategy.errors import MegatronConfigError

    out = {}
    for name in names:
        torch.manual_seed(0)
        model, plan = _models(name)
        try:
            out[name] = ("ok", _shard_and_verify(model, plan, rank)[0])
        except MegatronConfigError as e:
            out[name] = ("refused", str(e))
    return out


def test_a_user_plan_the_forward_cannot_run_sharded_is_refused_in_setup_tp2():
    names = ["nano", "nano_mlp_only", "helpers_gpt", "torch_encoder"]
    try:
        import litgpt  # noqa: F401
        names.append("litgpt")
    except ImportError:
        pass
    ranks = run_distributed(_verify, 2, names, timeout=120)
    assert {k: v[0] for k, v in ranks[0].items()} == {k: v[0] for k, v in ranks[1].items()}
    res = ranks[0]
    status, msg = res["nano"]
    assert status == "refused", msg
    assert "'h.0.attn'" in msg and "NanoAttention" in msg and "c_attn: column, c_proj: row" in msg
    assert "tp_plan['h.*.attn.c_attn']" in msg and "its forward raised ValueError: not enough values to unpack" in msg
    assert "\n" not in msg and "'h.*.attn': 'replicate'" in msg and "y.view(B, T, -1)" in msg
    assert res["nano_mlp_only"] == ("ok", ["h.0.mlp"])  # the MLP block is verified, and passes
    assert res["helpers_gpt"] == ("ok", ["blocks.0"])  # one block per distinct (class, plan)
    assert res["torch_encoder"] == ("ok", ["encoder.layers.0"])
    if "litgpt" in res:  # its blocks need rotary tables: captured through GPT(idx), and the plan is exact
        assert res["litgpt"] == ("ok", ["transformer.h.0.attn", "transformer.h.0.mlp"])

def test_blocks_no_guess_reaches_stay_unverified():
    from megastrategy.layers.block_capture import capture_blocks
    from megastrategy.layers.plan import resolve_tp_plan

    class NeedsTwo(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = NanoMLP(8)

        def forward(self, x, scale):
            return self.block(x) * scale

    model = NeedsTwo()
    plan = resolve_tp_plan(model, {"block.c_fc": "column", "block.c_proj": "row"}, 2)
    assert [c.name for c in capture_blocks(model, plan)] == ["block"]  # the block itself takes one input
    model.block.forward = lambda x, y: x
    assert capture_blocks(model, plan) == []
