"""What only a batch or a forward reveals is refused at that point, naming the module.

All cases run in one two-process launch; each must raise MegatronConfigError with the
expected words and leave the model usable (teardown restores it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.context import tiny_models as tm
from tests.helpers.dist import run_distributed


class MaskedSdpa(nn.Module):
    def __init__(self, **call):
        super().__init__()
        self.call = call

    def forward(self, input_ids):
        x = input_ids.float()[:, None, :, None].expand(-1, 2, -1, 4)
        return F.scaled_dot_product_attention(x, x, x, **self.call)


class HandMixer(nn.Module):  # no "attention" in its name: only the runtime check can see it
    def forward(self, input_ids):
        x = input_ids.float()[..., None]
        return torch.softmax(x @ x.transpose(-1, -2), dim=-1) @ x


def _expect(model, batch, run, *words):
    from megastrategy.context import ContextParallel
    from megastrategy.errors import MegatronConfigError

    context = ContextParallel(dist.group.WORLD)
    context.apply(model)
    try:
        local = context.transform_microbatch(batch)
        with context.forward_context(local):
            run(model, local)
    except MegatronConfigError as error:
        missing = [w for w in words if w not in str(error)]
        assert not missing, f"{missing} not in: {error}"
        return True
    finally:
        context.teardown()
    raise AssertionError(f"no MegatronConfigError for {words}")


def _cases(rank, world_size):
    ids = {"input_ids": torch.randint(0, tm.VOCAB, (2, 16))}
    call = lambda m, b: m(b["input_ids"])  # noqa: E731
    lm = tm.lm_batch(0)
    return [
        _expect(tm.llama("sdpa"), {k: v[:, :14] for k, v in lm.items()}, tm.lm_loss, "sequence length 14", "divisible by 4"),
        _expect(MaskedSdpa(attn_mask=torch.ones(8, 8, dtype=torch.bool)), ids, call, "attn_mask", "is_causal=True"),
        _expect(MaskedSdpa(dropout_p=0.1), ids, call, "dropout p=0.1"),
        _expect(nn.Sequential(HandMixer()), ids, call, "module '0' (HandMixer)", "(8 × 8)"),
        _expect(tm.SdpaGPT(), tm.gpt_batch(0), _shift_by_hand, "cannot be split", "labels="),
        _expect(tm.llama("sdpa"), {**lm, "attention_mask": torch.ones(2, 1, 16, 16)}, tm.lm_loss, "4-D mask"),
        _expect(tm.llama("sdpa"), {**lm, "position_ids": torch.arange(16).remainder(8)[None]}, tm.lm_loss, "packed"),
    ]


def _shift_by_hand(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits[:, :-1].reshape(-1, tm.VOCAB), batch["input_ids"][:, 1:].reshape(-1))


def test_runtime_refusals():
    assert all(all(r) for r in run_distributed(_cases, 2, timeout=120))
