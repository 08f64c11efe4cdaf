"""The Hugging Face test matrix: tp=2 on two processes against one device (DDPStrategy on one
process, same seed), every model trained a few steps in one launch per side.

Per-step training losses and the validation loss must agree within 2e-4 for every model whose
plan the strategy accepts (a refused plan stops the launch on every rank: those are tested in
test_block_check.py). Set
``HF_MATRIX_JSON=path`` to keep the results; ``tests/scripts/render_hf_matrix.py`` turns them
into the README table.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.hf_zoo import BUILTIN_DECODERS, DECLARED_DECODERS, ENCODERS, STRUCTURAL_DECODERS

#: encoder-decoders sharded by structural detection
STRUCTURAL_SEQ2SEQ = ("bart", "t5")
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hf_matrix.py"
MODELS = (
    [f"{a}:lm" for a in DECLARED_DECODERS + BUILTIN_DECODERS + STRUCTURAL_DECODERS]
    + [f"{a}:mlm" for a in ENCODERS]
    + ["roberta:cls", "distilbert:cls", "albert:cls", "deberta-v2:cls", "modernbert:cls", "llama:cls"]
    + [f"{a}:s2s" for a in STRUCTURAL_SEQ2SEQ]
)
TOL = 2e-4


def _run(strategy: str, nprocs: int, *extra: str) -> dict:
    args = ["--strategy", strategy, "--models", ",".join(MODELS), *extra]
    return run_script(SCRIPT, nprocs, args, timeout=900)


@pytest.mark.slow
def test_tp2_matches_one_device_for_every_model():
    ref, tp2 = _run("ddp", 1), _run("megatron", 2, "--tp", "2")
    if os.environ.get("HF_MATRIX_JSON"):
        Path(os.environ["HF_MATRIX_JSON"]).write_text(json.dumps({"ddp": ref, "tp2": tp2}, indent=1))
    assert all("error" not in r for r in ref.values()), {k: v for k, v in ref.items() if "error" in v}
    worst = {}
    for model in MODELS:
        got, want = tp2[model], ref[model]
        assert "error" not in got, (model, got["error"])
        assert len(got["loss"]) == len(want["loss"]) == 3
        worst[model] = max(abs(a - b) for a, b in zip(got["loss"] + [got["val_loss"]], want["loss"] + [want["val_loss"]]))
        arch = model.split(":")[0]
        structural = arch in STRUCTURAL_DECODERS + STRUCTURAL_SEQ2SEQ
        source = "declared:" if arch in DECLARED_DECODERS else "structural:" if structural else "auto:"
        assert got["sources"] and all(s.startswith(source) for s in got["sources"]), (model, got["sources"])
    bad = {m: w for m, w in worst.items() if not w <= TOL}
    assert not bad, f"tp=2 differs from one device beyond {TOL}: {bad}"
    assert len(worst) >= 12 + len(ENCODERS) + len(BUILTIN_DECODERS) + len(STRUCTURAL_DECODERS) + len(STRUCTURAL_SEQ2SEQ)
