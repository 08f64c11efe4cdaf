"""Lightning habits, round 7: life after ``fit``, against Lightning's own DDPStrategy (per-step losses within 2e-4).

One launch per layout of tests/scripts/habits_round7.py runs every habit one after another
(tests/helpers/round7_habits.py): tp2 and pp2 against DDP on one process, dp2 against DDP on two.

* ``fit`` then ``validate``, ``test``, ``predict`` on the same Trainer, and ``test``/``predict`` on a new
  Trainer with a new strategy of the same arguments: DDP's values;
* a second ``fit`` of the same module instance with a new Trainer and a new ``MegatronStrategy``
  (two-phase fine-tuning, the blocks frozen then unfrozen): with the same arguments DDP's losses (at
  pp2 it failed with a misleading "ln_f is registered after the stack" error: the new strategy
  checked the already split module as a user's model; now it takes over the earlier split,
  ``second_fit.py``); with tp and pp exchanged it is refused, naming the checkpoint route (tp2 then
  pp2 silently ran tp2 again), and that route (``save_checkpoint``, ``consolidate`` into a fresh
  module, fit on the other layout) gives DDP's losses; ``save_checkpoint`` then a new Trainer's
  ``fit(model, ckpt_path=...)`` of the same instance continues as an uninterrupted run;
* after fit, on rank 0: ``model(batch)`` (it hung at tp2: the forward's collectives wait for rank 1) and
  ``model.state_dict()`` (rank 0's shards and stage, silently) are refused outside a Trainer run, naming
  ``save_checkpoint`` + ``consolidate`` and ``export_hf`` (``outside_run_guard.py``), and
  ``consolidate`` of ``trainer.save_checkpoint`` is DDP's state dict; ``copy.deepcopy`` works and the
  copy's forward is refused the same way, and so is a plain ``Trainer(devices=1).test(model)`` on rank 0
  (not the strategy's run), and ``torch.save(model, path)`` (a pickle of the parts); ``save_pretrained``
  refused (as before); at dp2 the module is whole and all of it is DDP's;
* ``BaseFinetuning`` (a subclass unfreezing the blocks into a new param group at epoch 1) and
  ``BackboneFinetuning`` (also of an HF BERT classifier at tp2 and pp2, where its first stage is all
  backbone: its optimizer starts with one empty group, which the callback fills);
  ``ReduceLROnPlateau(monitor="val_loss")`` with ``LearningRateMonitor`` into a ``CSVLogger`` (row for
  row) and ``gradient_clip_algorithm="value"``; two validation loaders (``dataloader_idx``,
  ``add_dataloader_idx=False``) with ``val_check_interval=0.5``; an HF GPT-2 and Llama with
  ``resize_token_embeddings(129)`` (not divisible by tp) before fit: DDP's (no change needed).
"""
import math
from pathlib import Path

import pytest

from tests.helpers.habit_launches import Launches, close as _close

SCRIPT = Path(__file__).parent / "scripts" / "habits_round7.py"
pytestmark = pytest.mark.slow

AFTER_FIT = ["evaluate-after-fit", "second-fit", "second-fit-other-layout", "second-fit-via-checkpoint", "second-fit-resumed",
             "forward-rank-zero", "state-dict-rank-zero", "deepcopy-rank-zero", "save-pretrained-rank-zero",
             "plain-trainer-rank-zero", "new-trainer-test", "pickle-rank-zero", "ddp-trainer-after-fit"]
MORE = ["base-finetuning", "backbone-finetuning", "plateau-monitor-clip-value", "two-val-loaders",
        "resize-embeddings-gpt2", "resize-embeddings-llama"]
DATA = ["second-fit", "forward-rank-zero", "state-dict-rank-zero"]
LAUNCHES = {  # layout: (processes, strategy arguments, habits)
    "ddp": (1, ["--strategy", "ddp"], AFTER_FIT + MORE + ["backbone-finetuning-bert"]),
    "tp2": (2, ["--strategy", "megatron", "--tp", "2"], AFTER_FIT + MORE + ["backbone-finetuning-bert"]),
    "pp2": (2, ["--strategy", "megatron", "--pp", "2"], AFTER_FIT + MORE + ["backbone-finetuning-bert"]),
    "ddp2": (2, ["--strategy", "ddp", "--dp", "2"], DATA),
    "dp2": (2, ["--strategy", "megatron", "--dp", "2"], DATA),
}
REFERENCE = {"tp2": "ddp", "pp2": "ddp", "dp2": "ddp2"}

LAUNCHED = Launches(SCRIPT, LAUNCHES, REFERENCE, "habits7-")
_pair = LAUNCHED.pair
SPLIT = ["tp2", "pp2"]


def _same_values(ours: dict, ref: dict) -> None:
    assert sorted(ours) == sorted(ref)
    _close([ours[k] for k in sorted(ref)], [ref[k] for k in sorted(ref)])


@pytest.mark.parametrize("layout", SPLIT)
def test_validate_test_predict_after_fit_on_the_same_trainer(layout):
    ours, ref = _pair(layout, "evaluate-after-fit")
    _close(ours["losses"], ref["losses"])
    for key in ("validated", "tested"):
        _same_values(ours[key][0], ref[key][0])
    _close(ours["predicted"], ref["predicted"])


@pytest.mark.parametrize("layout", SPLIT)
def test_test_and_predict_on_a_new_trainer_after_fit(layout):
    ours, ref = _pair(layout, "new-trainer-test")
    _close(ours["losses"], ref["losses"])
    _same_values(ours["tested"][0], ref["tested"][0])
    _close(ours["predicted"], ref["predicted"])


@pytest.mark.parametrize("layout", SPLIT + ["dp2"])
def test_second_fit_with_a_new_trainer_and_strategy_continues_the_split(layout):
    ours, ref = _pair(layout, "second-fit")
    assert ours["raised"] is ref["raised"] is None
    assert len(ours["losses"]) == 4
    _close(ours["losses"], ref["losses"])


@pytest.mark.parametrize("layout", SPLIT)
def test_second_fit_on_another_layout_is_refused_naming_the_checkpoint_route(layout):
    ours, ref = _pair(layout, "second-fit-other-layout")
    assert ref["raised"] is None
    _close(ours["first"], ref["first"])
    assert ours["losses"] == ours["first"], "nothing ran on the refused layout"
    message = ours["raised"]
    assert message.startswith("MegatronConfigError: a new Trainer's fit/validate/test/predict of FrozenBackbone with a "
                              "MegatronStrategy that differs")
    assert "tp=2 -> 1" in message or "tp=1 -> 2" in message
    assert "save_checkpoint('phase1')" in message and "consolidate('phase1')" in message


@pytest.mark.parametrize("layout", SPLIT)
def test_second_fit_on_another_layout_through_a_consolidated_checkpoint(layout):
    _close(*(r["losses"] for r in _pair(layout, "second-fit-via-checkpoint")))


@pytest.mark.parametrize("layout", SPLIT)
def test_save_checkpoint_then_a_new_trainers_fit_with_ckpt_path_continues_exactly(layout):
    """The same instance resumed by a new Trainer: the steps of an uninterrupted run (megastrategy
    resumes at the next unseen batch; DDP's own resume restarts the epoch's loader, documented)."""
    ours, ref = _pair(layout, "second-fit-resumed")
    _close(ours["losses"], ref["uninterrupted"])
    _close(ours["uninterrupted"], ref["uninterrupted"])
    assert abs(ref["losses"][2] - ref["uninterrupted"][2]) > 0.1  # DDP restarted its loader


@pytest.mark.parametrize("layout", SPLIT)
def test_forward_on_rank_zero_after_fit_is_refused_not_hung(layout):
    ours, ref = _pair(layout, "forward-rank-zero")
    _close(ours["losses"], ref["losses"])
    assert ref["raised"] is None and ours["out"] is None
    assert ours["raised"].startswith("MegatronConfigError: model(...) outside a Trainer run of the MegatronStrategy that split it (")
    assert "trainer.predict(model)" in ours["raised"] and "consolidate('ckpt')" in ours["raised"]


@pytest.mark.parametrize("layout", SPLIT)
def test_state_dict_on_rank_zero_after_fit_is_refused_and_the_named_route_is_ddps(layout):
    ours, ref = _pair(layout, "state-dict-rank-zero")
    _close(ours["losses"], ref["losses"])
    assert ours["raised"].startswith("MegatronConfigError: model.state_dict() outside a Trainer run of the MegatronStrategy that split it (")
    assert "sums" not in ours
    assert sorted(ours["consolidated"]) == sorted(ref["sums"])
    _same_state(ours["consolidated"], ref["sums"])


def _same_state(ours: dict, ref: dict) -> None:
    """Each tensor's shape, and its sum within 1e-6 per element (the weights within float rounding).
    The key biases' values are not compared: their gradient is zero but for rounding (a softmax does not
    see a constant added to every key's score), which Adam's normalised step turns into lr-sized moves."""
    assert sorted(ours) == sorted(ref)
    for key, (shape, total) in ref.items():
        assert ours[key][0] == shape, key
        if key.endswith(".k.bias"):
            continue
        _close([ours[key][1]], [total], tol=max(2e-4, 1e-6 * math.prod(shape)))


def test_forward_and_state_dict_after_fit_at_dp2_are_ddps():
    ours, ref = _pair("dp2", "forward-rank-zero")
    assert ours["raised"] is ref["raised"] is None
    _close([ours["out"]], [ref["out"]])
    ours, ref = _pair("dp2", "state-dict-rank-zero")
    assert ours["raised"] is ref["raised"] is None
    _same_state(ours["sums"], ref["sums"])
    _same_state(ours["consolidated"], ref["sums"])


@pytest.mark.parametrize("layout", SPLIT)
def test_deepcopy_after_fit_works_and_its_forward_is_refused(layout):
    ours, ref = _pair(layout, "deepcopy-rank-zero")
    assert ours["raised"] is ref["raised"] is ref["forward_raised"] is None
    assert ours["forward_raised"].startswith("MegatronConfigError: model(...) outside a Trainer run")


@pytest.mark.parametrize("layout", SPLIT)
def test_a_plain_one_device_trainer_on_rank_zero_after_fit_is_refused_not_hung(layout):
    """``L.Trainer(devices=1).test(model)`` on rank 0: DDP's one-device test; here the split module's
    ``setup`` hook refuses that Trainer (at tp2 its forward waited for rank 1) and names what works."""
    ours, ref = _pair(layout, "plain-trainer-rank-zero")
    assert ref["raised"] is None and ref["tested"][0]["test_loss"] > 0
    assert ours["tested"] is None and "outside a Trainer run of the MegatronStrategy" in ours["raised"]


@pytest.mark.parametrize("layout", SPLIT)
def test_a_ddp_trainer_after_fit_is_refused_before_it_touches_the_weights(layout):
    """A second phase with ``Trainer(strategy="ddp")`` on the split module: DDP's wrapper broadcast
    rank 0's shards over rank 1's before anything refused (the weights in memory damaged); now the
    module's ``setup`` hook refuses on every rank, naming what works, and no weight moves."""
    ours, ref = _pair(layout, "ddp-trainer-after-fit")
    assert ref["raised"] is None and ref["trained"] == ref["moved_ranks"] == 1
    assert ours["raised"].startswith("MegatronConfigError: a Trainer with DDPStrategy outside a Trainer run")
    assert "MegatronStrategy of the same arguments" in ours["raised"] and "consolidate('ckpt')" in ours["raised"]
    assert ours["trained"] == ours["moved_ranks"] == 0


@pytest.mark.parametrize("layout", SPLIT)
def test_pickling_the_module_after_fit_is_refused_naming_what_works(layout):
    """``torch.save(model, path)``: it failed with torch's "cannot pickle ProcessGroup", naming no way out."""
    ours, ref = _pair(layout, "pickle-rank-zero")
    assert ref["raised"] is None
    assert ours["raised"].startswith("MegatronConfigError: pickling a module split by MegatronStrategy")
    assert "consolidate('ckpt')" in ours["raised"]


@pytest.mark.parametrize("layout", SPLIT)
def test_save_pretrained_after_fit_is_refused_naming_export_hf(layout):
    ours, ref = _pair(layout, "save-pretrained-rank-zero")
    _close(ours["losses"], ref["losses"])
    assert ref["raised"] is None and "export_hf" in ours["raised"]


@pytest.mark.parametrize("layout", SPLIT)
@pytest.mark.parametrize("habit", ["base-finetuning", "backbone-finetuning"])
def test_finetuning_callbacks_unfreeze_into_new_param_groups(layout, habit):
    ours, ref = _pair(layout, habit)
    _close(ours["losses"], ref["losses"])
    assert ours["lrs"] == ref["lrs"] and len(ref["lrs"][-1]) == 2


@pytest.mark.parametrize("layout", SPLIT)
def test_backbone_finetuning_of_a_hugging_face_classifier(layout):
    """At pp2 the first stage holds only backbone layers, all frozen until epoch 1: its optimizer over
    the trainable parameters starts with one empty group (torch refuses an empty list), which
    BackboneFinetuning fills when it unfreezes the backbone, as on one device."""
    ours, ref = _pair(layout, "backbone-finetuning-bert")
    assert ours["raised"] is ref["raised"] is None
    _close(ours["losses"], ref["losses"])
    assert ours["lrs"] == ref["lrs"] and len(ref["lrs"][-1]) == 2


@pytest.mark.parametrize("layout", SPLIT)
def test_reduce_lr_on_plateau_with_lr_monitor_and_clipping_by_value(layout):
    ours, ref = _pair(layout, "plateau-monitor-clip-value")
    _close(ours["losses"], ref["losses"])
    assert [sorted(r) for r in ours["rows"]] == [sorted(r) for r in ref["rows"]]
    for mine, theirs in zip(ours["rows"], ref["rows"]):
        _close([float(v) for v in mine.values()], [float(theirs[k]) for k in mine])


@pytest.mark.parametrize("layout", SPLIT)
def test_two_validation_loaders_twice_an_epoch(layout):
    ours, ref = _pair(layout, "two-val-loaders")
    _close(ours["losses"], ref["losses"])
    assert len(ours["validations"]) == len(ref["validations"]) == 2
    for mine, theirs in zip(ours["validations"], ref["validations"]):
        _same_values(mine, theirs)


@pytest.mark.parametrize("layout", SPLIT)
@pytest.mark.parametrize("habit", ["resize-embeddings-gpt2", "resize-embeddings-llama"])
def test_resized_token_embeddings_not_divisible_by_tp(layout, habit):
    ours, ref = _pair(layout, habit)
    _close(ours["losses"], ref["losses"])
    assert ref["local_rows"] == 129
    if layout == "tp2":  # split over the vocabulary, padded to a multiple of tp
        assert ours["local_rows"] == 65
