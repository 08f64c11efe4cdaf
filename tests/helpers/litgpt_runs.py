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


#: the reference trains a multi-head (4 groups), a grouped-query (2 groups) and a multi-query (1 group)
#: model side by side, so the tp and pp comparisons share its one launch whatever layouts they check
REFERENCE_GROUPS = "4,2,1"


@lru_cache(maxsize=None)
def litgpt_run(nprocs: int, groups: str, *args: str) -> dict:
    """The script's report: per-step losses and val_loss of each model, under ``by_groups``."""
    report = run_script(SCRIPT, nprocs, [*args, "--groups", groups], timeout=240)
    return report.get("by_groups") or {groups: report}


def assert_litgpt_matches_ddp(*layout: str, groups: str = "4") -> dict:
    """Each model of ``groups`` (comma-separated key/value groups) trains under the 2-process
    ``layout`` like the DDP reference; returns the largest loss difference per model."""
    pytest.importorskip("litgpt", reason="LitGPT is optional: pip install --no-deps litgpt")
    reference = litgpt_run(1, REFERENCE_GROUPS, "--strategy", "ddp")
    ours = litgpt_run(2, groups, "--strategy", "megatron", *layout)
    diffs = {}
    for g in groups.split(","):
        mine, ref = ours[g], reference[g]
        assert len(mine["losses"]) == 3
        diffs[g] = max([abs(a - b) for a, b in zip(mine["losses"], ref["losses"])]
                       + [abs(mine["val_loss"] - ref["val_loss"])])
    assert max(diffs.values()) < 2e-4, diffs
    return diffs
