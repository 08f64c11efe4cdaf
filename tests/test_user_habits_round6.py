"""Lightning habits, round 6, against Lightning's own DDPStrategy (per-step losses within 2e-4).

One launch per layout of tests/scripts/habits_round6.py runs every habit one after another
(tests/helpers/round6_habits.py): tp2 and pp2 against DDP on one process, dp2 against DDP on two.

* the optimization hooks overridden as the docs show: ``optimizer_step`` calling
  ``optimizer.step(closure=optimizer_closure)`` then writing a warm-up lr into the groups,
  ``optimizer_zero_grad`` with ``zero_grad(set_to_none=False)`` (at pp2 it zeroed the step's
  gradients: Lightning calls it after the step runner's backward, while ``p.grad`` views the
  buffer; ddp/zero_grad_guard.py), ``configure_gradient_clipping`` calling ``self.clip_gradients``,
  ``lr_scheduler_step``, an ``optimizer_step`` that steps every second batch and otherwise calls
  ``optimizer_closure()`` alone (the skipped batch's gradients were added to the next one's on every
  layout; unstepped_grads.py clears them where one device's zero_grad does), both also with
  ``accumulate_grad_batches=2``; ``AdamW(foreach=True, fused=False)`` over no-decay groups with their own lr;
* ``strategy.broadcast`` (rank 0's object everywhere), ``strategy.reduce(sum)`` (over the data
  replicas: at tp2 one device's count; at pp2 per microbatch, as documented), ``trainer.world_size``
  (the processes) against ``distributed_sampler_kwargs["num_replicas"]`` (the data replicas, what
  an lr scaled by the replicas needs);
* a ``MetricCollection`` with compute groups and ``BinaryAUROC`` logged as objects in validation;
  ``CharErrorRate`` over a list of strings in the batch (pp2: each microbatch got all the strings;
  now split with the rows, ``batch_tree.PerExample``);
* torch's ``ZeroRedundancyOptimizer`` over the default group: refused at tp2 (it overwrote shards
  with other ranks' shards, silently) and pp2 (gloo aborted), DDP's losses at dp2;
* Lightning's recipe ``self.log_dict(grad_norm(self, norm_type=2))`` with ``from megastrategy import
  grad_norm`` (the same signature): DDP's keys and values, per parameter and total, on every rank
  (Lightning's own gives this rank's shards and stage: documented, and checked to differ);
* ``self.logger.experiment.log_metrics`` of every parameter's statistic from rank 0 (``CSVLogger``):
  rank 0's tensors, as documented (its shards at tp2, its stage's parameters at pp2); reading another
  stage's module there raises, naming hooks and where to read it;
* an ``IterableDataset`` split by ``get_worker_info()`` over ``num_workers=2`` and by the data replica;
* ``torch.utils.checkpoint.checkpoint(block, x)`` in the user's forward: tp2 exact (reentrant or not);
  pp2 exact (reentrant or not: a stage's boundary blocks run plainly, ``pipeline/user_checkpoint.py``;
  the replay had re-run the stage's hooks: 22.29 vs 22.09, and the reentrant variant hung);
* a contrastive loss over ``self.all_gather(z, sync_grads=True)`` (SimCLR/CLIP): at tp2 and pp2 torch's
  gather backward failed on gloo over a data-parallel group without global rank 0 (gather_with_grads.py);
  DDP's losses at tp2, dp2, and pp2 with ``num_microbatches=1`` (microbatches contrast their own rows);
* ``torch.optim.LBFGS`` (it re-evaluates the closure): at dp2 the re-evaluations were not reduced
  again (now DDP's); at tp2/pp2 refused (its dot products see a rank's shards and stage);
  ``torch.optim.Adafactor`` refused at tp2 (per-tensor statistics of a shard), DDP's at pp2;
* ``F.cross_entropy(label_smoothing=0.1)``, ``nn.Embedding(padding_idx=0)``, ``on_train_batch_start``
  returning -1 (the epoch ends): DDP's losses;
* ``LearningRateFinder`` as a callback (DDP's losses at every lr tried), ``BatchSizeFinder``
  refused with DDP's own message.
"""
from pathlib import Path

import pytest

from tests.helpers.habit_launches import Launches, close as _close

SCRIPT = Path(__file__).parent / "scripts" / "habits_round6.py"
pytestmark = pytest.mark.slow

EXACT = ["label-smoothing", "padding-idx", "batch-start-minus-one"]
HOOKS = ["optimizer-step-closure", "zero-grad-keep", "configure-clipping", "scheduler-step", "foreach-groups",
         "closure-without-step", "closure-without-step-sgd", "closure-without-step-accumulate", "zero-grad-keep-accumulate"]
SPLIT = HOOKS + ["strategy-sizes", "metrics", "text-metric", "lr-finder-callback", "batch-size-finder-callback",
                 "zero-redundancy", "grad-norm", "param-stats", "worker-shards", "user-checkpointing",
                 "strategy-recompute", "contrastive", "contrastive-one-microbatch", "lbfgs", "adafactor"] + EXACT
DATA = ["zero-grad-keep", "strategy-sizes", "zero-redundancy", "closure-without-step-sgd", "contrastive", "lbfgs"]
LAUNCHES = {  # layout: (processes, strategy arguments, habits)
    "ddp": (1, ["--strategy", "ddp"], SPLIT + ["user-checkpointing-reentrant"]),
    "tp2": (2, ["--strategy", "megatron", "--tp", "2"], SPLIT + ["user-checkpointing-reentrant"]),
    "pp2": (2, ["--strategy", "megatron", "--pp", "2"], SPLIT + ["user-checkpointing-reentrant"]),
    "ddp2": (2, ["--strategy", "ddp", "--dp", "2"], DATA),
    "dp2": (2, ["--strategy", "megatron", "--dp", "2"], DATA),
}
REFERENCE = {"tp2": "ddp", "pp2": "ddp", "dp2": "ddp2"}

LAUNCHED = Launches(SCRIPT, LAUNCHES, REFERENCE, "habits6-")
_pair = LAUNCHED.pair


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("habit", HOOKS)
def test_optimization_hooks_overridden(layout, habit):
    ours, ref = _pair(layout, habit)
    _close(ours["losses"], ref["losses"])
    assert ours["lrs"] == ref["lrs"]
    for key in ("seen_lrs", "clip_args", "stepped"):
        assert ours.get(key) == ref.get(key), key


@pytest.mark.parametrize("habit", ["zero-grad-keep", "closure-without-step-sgd"])
def test_optimization_hooks_with_two_replicas(habit):
    ours, ref = _pair("dp2", habit)
    _close(ours["losses"], ref["losses"])


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_strategy_broadcast_reduce_and_sizes(layout):
    """``world_size`` counts processes (Lightning's meaning, which its loops rely on); the data
    replicas, which an lr scaled for the global batch needs, are ``distributed_sampler_kwargs``'s."""
    ours, ref = _pair(layout, "strategy-sizes")
    _close(ours["losses"], ref["losses"])
    sizes, expected = ours["sizes"], ref["sizes"]
    assert sizes["one_name"] and sizes["rank_zero"]
    assert sizes["world_size"] == sizes["num_devices"] == 2 and sizes["num_nodes"] == 1
    assert sizes["replicas"] == expected["world_size"]
    per_call = 2 if layout == "pp2" else 1  # under pp the step runs once per microbatch (README)
    assert sizes["examples_summed"] == [x / per_call for x in expected["examples_summed"] for _ in range(per_call)]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_metric_collection_with_compute_groups_and_auroc(layout):
    ours, ref = _pair(layout, "metrics")
    _close(ours["losses"], ref["losses"])
    assert sorted(ours["logged"]) == sorted(ref["logged"])
    _close([ours["logged"][k] for k in sorted(ref["logged"])], [ref["logged"][k] for k in sorted(ref["logged"])])
    _close([ours["validated"][0][k] for k in sorted(ref["validated"][0])], [ref["validated"][0][k] for k in sorted(ref["validated"][0])])


def _text_metric(layout):
    ours, ref = _pair(layout, "text-metric")
    per_call = 2 if layout == "pp2" else 1
    assert ours["texts"] == [n // per_call for n in ref["texts"] for _ in range(per_call)], "strings per step call"
    _close([ours["logged"]["val_cer"]], [ref["logged"]["val_cer"]])


def test_text_metric_over_the_batchs_strings_at_tp2():
    _text_metric("tp2")


def test_text_metric_over_the_batchs_strings_at_pp2():
    _text_metric("pp2")


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_finder_callbacks(layout):
    ours, ref = _pair(layout, "lr-finder-callback")
    _close(ours["losses"], ref["losses"])
    _close(ours["finder_losses"], ref["finder_losses"])
    assert ours["suggestion"] == ref["suggestion"] and ours["lr"] == ref["lr"]
    ours, ref = _pair(layout, "batch-size-finder-callback")
    assert ours == ref and "not supported with distributed strategies" in ref["raised"]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_zero_redundancy_optimizer_is_refused_where_ranks_hold_different_parameters(layout):
    ours, _ = _pair(layout, "zero-redundancy")
    assert ours["losses"] == []
    assert "ZeroRedundancyOptimizer over processes [0, 1]" in ours["raised"]
    assert "use_distributed_optimizer=True" in ours["raised"] and "AdamW(self.parameters()" in ours["raised"]


def test_zero_redundancy_optimizer_over_the_replicas_is_ddps():
    ours, ref = _pair("dp2", "zero-redundancy")
    assert ours["raised"] is ref["raised"] is None
    _close(ours["losses"], ref["losses"])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_megastrategy_grad_norm_logs_one_devices_norms(layout):
    ours, ref = _pair(layout, "grad-norm")
    _close(ours["losses"], ref["losses"])
    assert len(ours["norms"]) == len(ref["norms"]) == 2
    for mine, theirs in zip(ours["norms"], ref["norms"]):
        for part in ("model", "blocks"):  # every parameter's whole norm (2 and inf), and the total
            assert sorted(mine[part]) == sorted(theirs[part])
            _close([mine[part][k] for k in sorted(theirs[part])], [theirs[part][k] for k in sorted(theirs[part])])
        assert mine["local_total"] < theirs["model"]["grad_2.0_norm_total"] - 0.1  # Lightning's: this rank's only
    assert sorted(ours["logged"]) == sorted(ref["logged"])
    _close([ours["logged"][k] for k in sorted(ref["logged"])], [ref["logged"][k] for k in sorted(ref["logged"])])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_parameter_statistics_from_rank_zero_are_its_own_tensors(layout):
    ours, ref = _pair(layout, "param-stats")
    _close(ours["losses"], ref["losses"])
    assert ours["raised"] is ref["raised"] is None
    if layout == "tp2":  # every parameter, sharded ones by their shard
        assert ours["columns"] == ref["columns"]
    else:  # the first stage's: the embeddings and the first block
        assert set(ours["columns"]) < set(ref["columns"]) and "blocks.0.q.weight_mean" in ours["columns"]
        assert "ln_f.weight_mean" not in ours["columns"]


def test_reading_another_stages_parameter_in_a_hook_names_hooks():
    from megastrategy.pipeline.stage import Unreachable, UnreachableAttributeError

    with pytest.raises(UnreachableAttributeError) as raised:
        Unreachable("ln_f").weight
    assert "hook" in str(raised.value)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_iterable_dataset_split_by_worker_and_replica(layout):
    _close(*(r["losses"] for r in _pair(layout, "worker-shards")))


@pytest.mark.parametrize("habit", ["user-checkpointing", "user-checkpointing-reentrant"])
def test_users_own_activation_checkpointing_at_tp2(habit):
    _close(*(r["losses"] for r in _pair("tp2", habit)))


@pytest.mark.parametrize("habit", ["user-checkpointing", "user-checkpointing-reentrant"])
def test_users_own_activation_checkpointing_at_pp2(habit):
    """(The strategy's ``activation_checkpointing="full"`` is exact there too: the next test.)"""
    _close(*(r["losses"] for r in _pair("pp2", habit)))


def test_the_strategys_recompute_is_exact_at_pp2():
    _close(*(r["losses"] for r in _pair("pp2", "strategy-recompute")))


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_contrastive_loss_over_gathered_embeddings(layout):
    _close(*(r["losses"] for r in _pair(layout, "contrastive")))


def test_contrastive_loss_at_pp2():
    """Each microbatch contrasts its own rows (a loss that is not a mean over examples: the README's
    microbatch exception), so pp2 runs without error; ``num_microbatches=1`` is one device's loss."""
    ours, ref = _pair("pp2", "contrastive")
    assert len(ours["losses"]) == len(ref["losses"]) and all(0 < a < b for a, b in zip(ours["losses"], ref["losses"]))
    _close(*(r["losses"] for r in _pair("pp2", "contrastive-one-microbatch")))


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("habit", EXACT)
def test_loss_embedding_and_loop_options(layout, habit):
    _close(*(r["losses"] for r in _pair(layout, habit)))


def test_lbfgs_re_evaluations_reduced_with_two_replicas():
    _close(*(r["losses"] for r in _pair("dp2", "lbfgs")))


@pytest.mark.parametrize("layout,habit", [("tp2", "lbfgs"), ("pp2", "lbfgs"), ("tp2", "adafactor")])
def test_optimizers_needing_whole_tensors_are_refused_where_ranks_hold_parts(layout, habit):
    ours, _ = _pair(layout, habit)
    assert ours["losses"] == [] and ours["raised"].startswith("MegatronConfigError: configure_optimizers returned")
    assert ("AdamW" in ours["raised"]) and ("tp=1" in ours["raised"])


def test_adafactor_at_pp2_is_ddps():
    _close(*(r["losses"] for r in _pair("pp2", "adafactor")))
