"""A tiny LitGPT model (``litgpt.model.GPT``), and one DDP reference run of the LightningModule in
tests/scripts/litgpt_gpt.py shared by the tp (tests/layers) and pp (tests/pipeline) comparisons."""
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "litgpt_gpt.py"


#: LitGPT layouts: LLaMA-style (RMSNorm, gated MLP, rotary on every dim) and Pythia-style (parallel
#: residual, LayerNorm, GELU MLP, biases, rotary on a quarter of each head)
VARIANTS = {
    "llama": dict(bias=False, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", rotary_percentage=1.0,
                  parallel_residual=False),
    "neox": dict(bias=True, mlp_class_name="GptNeoxMLP", norm_class_name="LayerNorm", rotary_percentage=0.25,
                 parallel_residual=True),
}


def tiny_litgpt(groups: int, variant: str = "llama"):
    """4 layers, embedding 32, 4 heads in ``groups`` key/value groups, vocab 128."""
    pytest.importorskip("litgpt", reason="LitGPT is optional: pip install --no-deps litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(Config(n_layer=4, n_embd=32, n_head=4, n_query_groups=groups, block_size=32, vocab_size=128,
                      padded_vocab_size=128, intermediate_size=64, **VARIANTS[variant]))


@lru_cache(maxsize=None)
def litgpt_run(nprocs: int, *args: str) -> dict:
    """The script's report (per-step losses, val_loss) for the multi-head model (4 groups)."""
    return run_script(SCRIPT, nprocs, [*args, "--groups", "4"], timeout=240)


def assert_litgpt_matches_ddp(*layout: str) -> None:
    pytest.importorskip("litgpt", reason="LitGPT is optional: pip install --no-deps litgpt")
    reference, ours = litgpt_run(1, "--strategy", "ddp"), litgpt_run(2, "--strategy", "megatron", *layout)
    assert len(ours["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(ours["losses"], reference["losses"])) < 2e-4
    assert abs(ours["val_loss"] - reference["val_loss"]) < 2e-4
