"""Lightning habits, round 9, against Lightning's own DDPStrategy (per-step losses within 2e-4).

One launch per layout of tests/scripts/habits_round9.py runs every habit one after another
(tests/helpers/round9_habits.py): tp2 and pp2 against DDP on one process; habits refused at the first
step on one pipeline stage run alone (the watchdog stops the other stage, so they cannot share a launch).

* the user's hooks on a layer the tp plan shards were dropped by the split, silently: ``prune.l1_unstructured``
  in ``__init__`` (the pruned weights trained again, 10.444 against 10.401 at the second step), a forward
  or full backward hook whose statistic is logged (it stayed at the set-up check's run: 26.8 every step
  against 71.4), ``p.register_hook`` scaling a gradient (10.318 against 10.427); now refused by name before
  the split (``layers/user_hooks.py``), and the route it names (the layer ``replicate``) is DDP's. Hooks on
  modules and parameters kept whole (a block, a LayerNorm) are DDP's at tp2; at pp2 pruning and gradient
  hooks are DDP's;
* a step that runs the blocks itself (sentence-transformers-style, its own ``encode`` loop called per view):
  at pp2 stage 0 crashed with ``KeyError: 0`` inside the step runner and stage 1 blamed the registration
  order; now refused by name (``pipeline/model_calls.py``); at tp2 DDP's. A learnable temperature in the
  step at pp2: the round-8 refusal, now naming it;
* ``nn.Embedding(scale_grad_by_freq=True)`` at pp2 counted a microbatch's rows (10.2775 against 10.2807),
  ``max_norm`` tied to the head renormalized stage 0's copy only (14.74 against 12.86): silently; now refused
  in setup (``pipeline/embedding_options.py``), the routes named (``num_microbatches=1``, untied) DDP's; at tp2
  both were already refused;
* not yet (strict xfails): in-batch negatives at pp2 contrast a microbatch's rows (silently other losses);
  a hook on a module another stage holds, read in the step at pp2 (``KeyError`` in the user's step);
* a user's running statistic in a buffer updated by the training forward: once per microbatch at pp2 (22.788
  against 22.653 at the first step, silently), now refused at the first step naming the buffer
  (``pipeline/running_buffers.py``), ``num_microbatches=1`` DDP's; DDP's at tp2;
* a learnable scalar registered on the module itself (``self.scale``) multiplying the logits in ``forward``
  (and the embeddings): at tp2 its gradient was a rank's vocab columns' part (``layers/vocab_parallel_logits.py``
  now sums it over tp); at pp2 every stage holds a copy and each took its stage's part (or none), silently; now
  summed over the pipeline (``pipeline/ancestor_parameters.py``);
* a learnable scalar gate on a column-sharded activation inside a user's block: refused at tp2 by the set-up
  block check (the gate's gradient), DDP's at pp2;
* DDP's with no change: random masking drawn in ``training_step`` (tp2, pp2), ``validate(ckpt_path="last")``
  and ``test(ckpt_path="best")`` after fit, ``val_check_interval=3`` with ``check_val_every_n_epoch=None``
  and ``limit_val_batches=0.5`` across epochs.
"""
from pathlib import Path

import pytest

from tests.helpers.habit_launches import Launches, close as _close

SCRIPT = Path(__file__).parent / "scripts" / "habits_round9.py"
pytestmark = pytest.mark.slow

HOOKS = ["prune-in-init", "forward-hook-sharded", "forward-hook-whole", "backward-hook-sharded",
         "backward-hook-whole", "grad-hooks-sharded", "grad-hooks-whole"]
EVERYWHERE = ["mask-in-step", "contrastive-forward", "ckpt-best-last", "val-every-steps"]
EMBEDDINGS = ["embedding-max-norm", "embedding-grad-by-freq"]
EVERYWHERE += ["scalar-at-head", "scalar-both-ends", "gated-blocks"]
TP2 = HOOKS + EVERYWHERE + EMBEDDINGS + ["prune-in-init-replicated", "contrastive-own-loop",
                                        "contrastive-learnable-scale", "running-buffer"]
PP2 = ["prune-in-init", "grad-hooks-sharded", "grad-hooks-whole", "running-buffer-one-microbatch",
       "embedding-max-norm-untied", "embedding-grad-by-freq-one-microbatch"] + EVERYWHERE + EMBEDDINGS
LAUNCHES = {  # layout: (processes, strategy arguments, habits)
    "ddp": (1, ["--strategy", "ddp"], sorted(set(TP2 + PP2))),
    "tp2": (2, ["--strategy", "megatron", "--tp", "2"], TP2),
    "pp2": (2, ["--strategy", "megatron", "--pp", "2"], PP2),
}
REFERENCE = {"tp2": "ddp", "pp2": "ddp"}

LAUNCHED = Launches(SCRIPT, LAUNCHES, REFERENCE, "habits9-")
_pair = LAUNCHED.pair


def _same(layout: str, habit: str) -> tuple:
    ours, ref = _pair(layout, habit)
    assert ours["raised"] is ref["raised"] is None
    _close(ours["losses"], ref["losses"])
    return ours, ref


def _refused_at_tp2(habit: str) -> str:
    ours, ref = _pair("tp2", habit)
    assert ref["raised"] is None and ours["losses"] == [], "refused before the first step"
    assert ours["raised"].startswith("MegatronConfigError: tp=2: "), ours["raised"]
    return ours["raised"]


def test_pruning_a_sharded_layer_in_init_is_refused_at_tp2():
    message = _refused_at_tp2("prune-in-init")
    assert "'blocks.0.fc' has torch.nn.utils.prune's L1Unstructured on 'weight', and the plan shards 'blocks.0.fc' " \
           "(column, from tp_plan['blocks.*.fc'])" in message
    assert "tp_plan={'blocks.0.fc': 'replicate'}" in message and "prune.remove(module, 'weight')" in message


def test_the_route_the_pruning_refusal_names_is_ddps_at_tp2():
    ours, ref = _pair("tp2", "prune-in-init-replicated")
    _close(ours["losses"] + [ours["val_loss"]], ref["losses"] + [ref["val_loss"]])


@pytest.mark.parametrize("habit, what", [("forward-hook-sharded", "a forward hook"),
                                         ("backward-hook-sharded", "a backward hook")])
def test_a_statistics_hook_on_a_sharded_layer_is_refused_at_tp2(habit, what):
    message = _refused_at_tp2(habit)
    assert f"'blocks.0.fc' has {what} " in message and "the block around it" in message


def test_a_gradient_hook_on_a_sharded_parameter_is_refused_at_tp2():
    message = _refused_at_tp2("grad-hooks-sharded")
    assert "'wte.weight' has a gradient hook (register_hook)" in message and "(vocab, from tp_plan['wte'])" in message


@pytest.mark.parametrize("habit", ["forward-hook-whole", "backward-hook-whole"])
def test_statistics_hooks_on_layers_kept_whole_log_ddps_values_at_tp2(habit):
    ours, ref = _same("tp2", habit)
    assert len(ours["rows"]) == len(ref["rows"]) == 3 and all(len(r) == 2 for r in ref["rows"])
    for mine, theirs in zip(ours["rows"], ref["rows"]):
        _close([mine[k] for k in sorted(theirs)], [theirs[k] for k in sorted(theirs)])


@pytest.mark.parametrize("layout, habit", [("tp2", "grad-hooks-whole"), ("pp2", "grad-hooks-whole"),
                                           ("pp2", "grad-hooks-sharded"), ("pp2", "prune-in-init")])
def test_pruning_and_gradient_hooks_where_nothing_is_sharded(layout, habit):
    ours, ref = _same(layout, habit)
    _close([ours["val_loss"]], [ref["val_loss"]])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_random_masking_drawn_in_the_training_step(layout):
    _same(layout, "mask-in-step")


@pytest.mark.parametrize("habit", ["contrastive-own-loop", "contrastive-forward", "contrastive-learnable-scale"])
def test_in_batch_negatives_at_tp2(habit):
    _same("tp2", habit)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_validate_last_and_test_best_checkpoints_after_fit(layout):
    ours, ref = _pair(layout, "ckpt-best-last")
    _close(ours["losses"] + [ours["last_val"], ours["best_test"]], ref["losses"] + [ref["last_val"], ref["best_test"]])
    assert ours["best"] == ref["best"]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_validation_every_three_steps_across_epochs_on_half_the_loader(layout):
    ours, ref = _same(layout, "val-every-steps")
    assert [s for s, _ in ours["val"]] == [s for s, _ in ref["val"]] == [3, 6, 9]
    _close([v for _, v in ours["val"]], [v for _, v in ref["val"]])


@pytest.mark.parametrize("option", ["max_norm", "scale_grad_by_freq"])
def test_embedding_options_that_need_the_whole_vocabulary_are_refused_at_tp2(option):
    message = _pair("tp2", "embedding-" + {"max_norm": "max-norm", "scale_grad_by_freq": "grad-by-freq"}[option])[0]["raised"]
    assert message.startswith(f"MegatronConfigError: nn.Embedding({option}="), message


def test_an_embedding_counting_rows_is_refused_with_microbatches_at_pp2():
    """``scale_grad_by_freq`` counted a microbatch's rows (10.2775 against 10.2807 at the second step, silently)."""
    message = _pair("pp2", "embedding-grad-by-freq")[0]["raised"]
    assert message.startswith("MegatronConfigError: pp=2 with num_microbatches=2: 'wte' is "
                              "nn.Embedding(scale_grad_by_freq=True)"), message
    ours, ref = _pair("pp2", "embedding-grad-by-freq-one-microbatch")  # the route it names
    _close(ours["losses"] + [ours["val_loss"]], ref["losses"] + [ref["val_loss"]])


def test_a_renormalizing_embedding_tied_to_the_head_is_refused_at_pp2():
    """``max_norm`` renormalized stage 0's rows, never the tied head's copy on stage 1 (14.74 against 12.86 at
    the first step, silently); untied it is DDP's."""
    message = _pair("pp2", "embedding-max-norm")[0]["raised"]
    assert message.startswith("MegatronConfigError: pp=2: 'wte' is nn.Embedding(max_norm=1.0) and its weight is "
                              "tied to 'lm_head'"), message
    ours, ref = _pair("pp2", "embedding-max-norm-untied")
    _close(ours["losses"] + [ours["val_loss"]], ref["losses"] + [ref["val_loss"]])


def test_a_running_statistic_in_a_buffer_at_tp2():
    ours, ref = _same("tp2", "running-buffer")
    _close([ours["val_loss"]], [ref["val_loss"]])


def test_a_running_statistic_in_a_buffer_is_refused_at_the_first_step_at_pp2():
    """Updated once per microbatch, it was 22.788 against 22.653 at the first step, silently."""
    failed = _alone_at_pp2("running-buffer")
    assert "MegatronConfigError: pp=2 with num_microbatches=2: the buffer 'center.mean' changed during the " \
           "training step" in failed and "Pass num_microbatches=1" in failed


def test_a_running_statistic_in_a_buffer_with_one_microbatch_at_pp2():
    ours, ref = _same("pp2", "running-buffer-one-microbatch")
    _close([ours["val_loss"]], [ref["val_loss"]])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("habit", ["scalar-at-head", "scalar-both-ends"])
def test_a_learnable_scalar_of_the_module_itself_used_in_forward(layout, habit):
    """``self.scale`` multiplying the logits (and the embeddings): at tp2 it met only a rank's vocab columns
    and trained on half its gradient (7.8604 against 7.8585 at the third step); at pp2 each stage's copy
    took its stage's part (187.07 against 296.61 with SGD), or rank 0's never trained (0.70 against -30.6)."""
    ours, ref = _same(layout, habit)
    _close([ours["val_loss"], ours["scale"]], [ref["val_loss"], ref["scale"]])


def test_a_learnable_gate_on_a_sharded_activation_inside_a_block():
    """``F.gelu(self.fc(x)) * self.gate`` in a user's block: at tp2 the set-up block check finds the gate's
    gradient off (a shard's part) and refuses naming the block; at pp2 DDP's."""
    message = _pair("tp2", "gated-blocks")[0]["raised"]
    assert message.startswith("MegatronConfigError: tp=2: the sharded block 'blocks.0' (GatedBlock;"), message
    assert "gradient of gate" in message
    ours, ref = _same("pp2", "gated-blocks")
    _close([ours["val_loss"]], [ref["val_loss"]])


def _alone_at_pp2(habit: str) -> str:
    """Both ranks' output of ``habit`` launched alone at pp2; no rank may hang."""
    import tempfile

    from tests.helpers.launch import run_script_to_the_end

    ranks = run_script_to_the_end(SCRIPT, 2, ["--strategy", "megatron", "--pp", "2", "--habits", habit,
                                              "--dir", tempfile.mkdtemp()], timeout=240)
    assert all(code is not None for code, _, _ in ranks), "no rank may hang"
    return ranks[0][1] + ranks[1][1]


def test_a_step_running_the_blocks_itself_is_refused_by_name_at_pp2():
    """Stage 0 crashed with ``KeyError: 0`` in the step runner (no model call to pause at), stage 1
    blamed the registration order of ``wte``."""
    failed = _alone_at_pp2("contrastive-own-loop")
    assert "MegatronConfigError: the step ran the blocks of 'blocks' itself, not inside a call of a module " \
           "holding them (the LightningModule)" in failed
    assert "torch.cat them along dim 0 into one call" in failed and "KeyError" not in failed


def test_a_learnable_temperature_in_the_step_is_refused_at_pp2():
    failed = _alone_at_pp2("contrastive-learnable-scale")
    assert "returned a loss that depends on this stage's own parameters outside the model call" in failed
    assert "CLIP's logit_scale" in failed


@pytest.mark.xfail(strict=True, reason="each microbatch contrasts its own rows: in-batch negatives at pp2 see 4 "
                   "negatives where one device sees 8, so the losses differ silently. Exact with num_microbatches=1; "
                   "telling such a loss from a mean over examples needs the step run on the whole batch")
def test_in_batch_negatives_at_pp2():
    _same("pp2", "contrastive-forward")


@pytest.mark.xfail(strict=True, reason="a forward hook on blocks.0 runs only on the stage holding it: the step on "
                   "stage 1 reads a value its hook never set (the user's KeyError), and stage 0's hook sees microbatches")
def test_a_hook_on_a_module_of_another_stage_read_in_the_step_at_pp2():
    failed = _alone_at_pp2("forward-hook-whole")
    assert "Error" not in failed
