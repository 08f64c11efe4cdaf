"""Pipeline stages for Hugging Face architectures: every model of the matrix, in an ordinary
LightningModule that passes ``labels=`` to the model, trains at pp=2 (and a few at pp2·vp2 and
pp4) with the per-step losses of Lightning's DDPStrategy on one process, from the same seed.

One launch per layout trains all its models (tests/scripts/train_hf_stages.py). The matrix covers
what used to fail: OPT and XLM-R call modules in another order than they register them, ALBERT
applies one shared block N times, rotary models compute position embeddings before the stack, and
T5's encoder blocks hand each other the position bias block 0 computes, and SqueezeBERT calls its blocks'
``forward`` directly (no hooks) and gets a dict from each. DeBERTa-v2 is left out: every layer
reads its shared ``rel_embeddings.weight``, which stages refuse (tests/pipeline/test_stage.py).
"""
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "train_hf_stages.py"
TOL = 2e-4
pytestmark = pytest.mark.slow

ALL = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "albert", "camembert", "modernbert",
       "opt", "gpt2", "gpt-neox", "llama", "gemma", "phi3", "qwen2", "mistral", "t5-encoder",
       # decoders that declare base_model_tp_plan, then two that declare none
       "qwen3", "gemma2", "phi", "olmo", "olmo2", "granite", "cohere", "starcoder2", "glm", "helium", "smollm3",
       "stablelm", "falcon", "persimmon", "squeezebert")
FEW = ("albert", "opt", "xlm-roberta", "llama", "t5-encoder")
LAYOUTS = {  # name: (processes, strategy arguments, models)
    "pp2": (2, ("--pp", "2"), ALL),
    "pp2-vp2": (2, ("--pp", "2", "--vp", "2"), FEW),
    "pp4": (4, ("--pp", "4"), FEW),
}


@lru_cache(maxsize=None)
def _run(nprocs: int, strategy: str, models: tuple, *extra: str) -> dict:
    return run_script(SCRIPT, nprocs, ["--strategy", strategy, "--models", ",".join(models), *extra], timeout=500)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_architecture_trains_like_one_device(layout):
    nprocs, extra, models = LAYOUTS[layout]
    ours, ref = _run(nprocs, "megatron", models, *extra), _run(1, "ddp", ALL)
    failures = {}
    for name in models:
        assert isinstance(ref[name], list) and len(ref[name]) == 4, (name, ref[name])
        assert len(set(ref[name])) > 1, f"{name}: the reference loss does not move, so it shows nothing"
        if not isinstance(ours[name], list) or len(ours[name]) != len(ref[name]):
            failures[name] = ours[name]
            continue
        diff = max(abs(a - b) for a, b in zip(ours[name], ref[name]))
        if diff >= TOL:
            failures[name] = f"differs by {diff:.2e}: {ours[name]} vs {ref[name]}"
    assert not failures, failures
