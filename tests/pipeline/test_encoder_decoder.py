"""Pipeline stages for encoder-decoders: T5, BART, mBART (and Marian, Pegasus) fine-tuned the usual way
(``AutoModelForSeq2SeqLM.from_config(cfg)``, ``model(input_ids=..., attention_mask=..., labels=...)``,
padded sources) train at pp=2, pp2·vp2 and pp=4 with the per-step losses and the validation loss of
Lightning's DDPStrategy on one process, from the same seed.

One launch per layout trains all its models (tests/scripts/train_seq2seq_stages.py). The layouts put
the cut everywhere it can be: inside the encoder (pp4's stage 1), exactly at the seam (pp2 with equal
depths; pp4's stage 2, which also holds a third copy of the shared embedding), inside a stage
(``t5-6-2``: the last stage runs the encoder's last blocks, its final norm and the whole decoder;
``bart-2-6``: the first stage runs the whole encoder and the decoder's first blocks), and inside the
decoder (T5's two position biases and the encoder's output cross with the hidden state).
"""
import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "train_seq2seq_stages.py"
TOL = 2e-4
WEIGHTS_TOL = 1e-3  # after 4 AdamW steps at lr 2e-2 (Adam's normalized step amplifies 1e-7 gradient noise)
WEIGHTS = tempfile.mkdtemp(prefix="seq2seq-weights-")
atexit.register(shutil.rmtree, WEIGHTS, ignore_errors=True)
pytestmark = pytest.mark.slow

ALL = ("t5", "bart", "mbart", "marian", "pegasus", "m2m_100", "whisper", "t5-6-2", "bart-2-6")
LAYOUTS = {  # name: (processes, strategy arguments, models)
    "pp2": (2, ("--pp", "2"), ALL),
    "pp2-vp2": (2, ("--pp", "2", "--vp", "2"), ("t5", "bart")),
    "pp4": (4, ("--pp", "4", "--weights", f"{WEIGHTS}/pp4"), ("t5",)),  # its checkpoint, consolidated, too
    # ZB-V: rank 0 holds the first and the last stage, rank 1 the seam (the embedding summed over the pipeline)
    "pp2-zb_v": (2, ("--pp", "2", "--schedule", "zb_v", "--microbatches", "4"), ("t5",)),
}


@lru_cache(maxsize=None)
def _run(nprocs: int, strategy: str, models: tuple, *extra: str) -> dict:
    return run_script(SCRIPT, nprocs, ["--strategy", strategy, "--models", ",".join(models), *extra], timeout=400)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_encoder_decoders_train_like_one_device(layout):
    nprocs, extra, models = LAYOUTS[layout]
    ours, ref = _run(nprocs, "megatron", models, *extra), _run(1, "ddp", ALL, "--weights", f"{WEIGHTS}/ref")
    failures = {}
    for name in models:
        assert isinstance(ref[name], dict) and len(ref[name]["train"]) == 4, (name, ref[name])
        assert len(set(ref[name]["train"])) > 1, f"{name}: the reference loss does not move, so it shows nothing"
        if not isinstance(ours[name], dict) or "train" not in ours[name]:
            failures[name] = ours[name]
            continue
        got, want = ours[name]["train"] + [ours[name]["val"]], ref[name]["train"] + [ref[name]["val"]]
        diff = max(abs(a - b) for a, b in zip(got, want))
        if len(got) != len(want) or diff >= TOL:
            failures[name] = f"differs by {diff:.2e}: {got} vs {want}"
    assert not failures, failures
    for name in (n for n in models if "weights" in ours[n]):  # three copies of T5's shared embedding at pp4
        got, want = torch.load(ours[name]["weights"]), torch.load(ref[name]["weights"])
        assert list(got) == list(want), f"{name}: the consolidated checkpoint's keys differ from the state_dict's"
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst < WEIGHTS_TOL, f"{name}: the consolidated weights differ by {worst:.2e}"


@pytest.mark.parametrize("resumed_on", [(2, ("--tp", "2", "--pp", "1")), (1, ("--pp", "1"))], ids=["tp2", "one-rank"])
def test_a_pp2_encoder_decoder_checkpoint_resumes_on_another_layout(resumed_on):
    """T5 and BART saved after 2 steps at pp2 (each stage holds part of the encoder or decoder, T5's
    shared embedding on both) continue on tp2 or one rank with the steps an uninterrupted run takes."""
    saved = f"{WEIGHTS}/saved-pp2"
    if not Path(saved).exists():
        run_script(SCRIPT, 2, ["--strategy", "megatron", "--models", "t5,bart", "--pp", "2", "--steps", "2",
                               "--save", saved], timeout=500)
    nprocs, layout = resumed_on
    resumed = run_script(SCRIPT, nprocs, ["--strategy", "megatron", "--models", "t5,bart", *layout, "--steps", "4",
                                          "--resume", saved], timeout=500)
    straight = _run(1, "ddp", ALL, "--weights", f"{WEIGHTS}/ref")
    for name in ("t5", "bart"):
        got, want = resumed[name]["train"], straight[name]["train"][2:]
        assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, want)) < TOL, (name, got, want)
