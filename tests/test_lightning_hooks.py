"""Lightning's gradient hooks and ``self.log`` reductions mean what they mean under DDP.

One launch per layout of ``tests/scripts/hooks_and_logs.py`` (a Hugging Face BERT recording
``p.grad`` in ``on_after_backward``/``on_before_optimizer_step`` and logging with every
``reduce_fx``), compared with Lightning's ``DDPStrategy`` on one process (dp=1 in every layout
here): hook call counts, the loss given to ``on_before_backward``, every parameter's gradient
(TP shards summed over the TP ranks of one replica, PP stages joined), the true global norm from
``strategy.grad_norm()``, and every metric Lightning shows on rank 0, per step and per epoch.
"""
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "hooks_and_logs.py"
TOL = 2e-4
pytestmark = pytest.mark.slow

LAYOUTS = {"tp2": (2, ("--tp", "2")), "pp2": (2, ("--pp", "2")), "tp2-pp2": (4, ("--tp", "2", "--pp", "2"))}
DP2 = {"tp2-dp2": (4, ("--tp", "2"))}  # compared with DDP on 2 processes


@lru_cache(maxsize=None)
def _run(nprocs: int, *args: str) -> dict:
    return run_script(SCRIPT, nprocs, list(args), timeout=300)


def _ddp(*extra: str, nprocs: int = 1) -> dict:
    return _run(nprocs, "--strategy", "ddp", *extra)


def _ours(layout: str, *extra: str) -> dict:
    nprocs, args = {**LAYOUTS, **DP2}[layout]
    return _run(nprocs, "--strategy", "megatron", *args, *extra)


def _full_grad_norms(ranks: list, key: str) -> list[dict[str, float]]:
    """Per step, each parameter's gradient norm over the whole model: squared norms of TP shards
    added over the ranks holding them, a replicated parameter counted once."""
    steps, ranks = [], [rank for rank in ranks if rank["replica"] == 0]
    for step in range(len(ranks[0][key])):
        sq: dict[str, float] = {}
        for rank in ranks:
            for name, (value, sharded) in rank[key][step].items():
                sq[name] = sq.get(name, 0.0) + value if sharded else value
        steps.append({name: v ** 0.5 for name, v in sq.items()})
    return steps


def _assert_close(mine: dict, theirs: dict, what: str) -> None:
    assert mine.keys() == theirs.keys(), (what, sorted(set(mine) ^ set(theirs)))
    bad = {k: (mine[k], theirs[k]) for k in mine if abs(mine[k] - theirs[k]) > TOL * max(1.0, abs(theirs[k]))}
    assert not bad, (what, bad)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_backward_hooks_see_the_gradients_ddp_sees(layout):
    ours, ref = _ours(layout), _ddp()
    for rank in ours["ranks"]:
        assert rank["counts"] == ref["ranks"][0]["counts"] == {
            "on_before_backward": 4, "on_after_backward": 4, "on_before_optimizer_step": 4}
        assert all(not missing for missing in rank["missing"]), rank["missing"]  # every local p.grad is set
        assert max(abs(a - b) for a, b in zip(rank["before_backward"], ref["ranks"][0]["before_backward"])) < TOL
    for key in ("after_backward", "before_opt"):
        for step, (mine, theirs) in enumerate(zip(_full_grad_norms(ours["ranks"], key), _full_grad_norms(ref["ranks"], key))):
            _assert_close(mine, theirs, f"{key} step {step}")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_strategy_grad_norm_is_the_true_global_norm(layout):
    ours, ref = _ours(layout), _ddp()
    true = ref["ranks"][0]["lightning_total"]
    for rank in ours["ranks"]:
        assert max(abs(a - b) for a, b in zip(rank["true_norm"], true)) < TOL
    # Lightning's grad_norm(self) is the norm of what this rank holds: a shard or a stage
    assert all(a < b for a, b in zip(ours["ranks"][0]["lightning_total"], true))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_reduce_fx_logs_what_one_device_logs(layout):
    ours, ref = _ours(layout), _ddp()
    assert len(ours["steps"]) == len(ref["steps"]) == 4
    for step, (mine, theirs) in enumerate(zip(ours["steps"], ref["steps"])):
        _assert_close(mine, theirs, f"step {step}")
    assert {"l_sum_epoch", "l_max_epoch", "l_min_epoch", "l_mean_epoch", "per_token_epoch", "loss_sync"} <= ref["final"].keys()
    _assert_close(ours["final"], ref["final"], "epoch")


def test_gradient_accumulation_calls_the_hooks_once_per_backward_under_pp():
    ours, ref = _ours("pp2", "--accumulate", "2"), _ddp("--accumulate", "2")
    for rank in ours["ranks"]:
        assert rank["counts"] == ref["ranks"][0]["counts"] == {
            "on_before_backward": 4, "on_after_backward": 4, "on_before_optimizer_step": 2}
        assert max(abs(a - b) for a, b in zip(rank["before_backward"], ref["ranks"][0]["before_backward"])) < TOL
        assert max(abs(a - b) for a, b in zip(rank["true_norm"], ref["ranks"][0]["lightning_total"])) < TOL
    for key in ("after_backward", "before_opt"):
        for step, (mine, theirs) in enumerate(zip(_full_grad_norms(ours["ranks"], key), _full_grad_norms(ref["ranks"], key))):
            _assert_close(mine, theirs, f"{key} step {step}")
    _assert_close(ours["final"], ref["final"], "epoch")


@pytest.mark.parametrize("overlap", [(), ("--overlap",)], ids=["", "overlap_grad_reduce"])
def test_with_two_replicas_the_reduced_gradients_and_logs_are_ddps(overlap):
    """dp=2: on_before_optimizer_step and strategy.grad_norm() see the replica average as DDP does
    (on_after_backward sees this replica's gradient before the reduction: documented)."""
    ours, ref = _ours("tp2-dp2", *overlap), _ddp(nprocs=2)
    for rank in ours["ranks"]:
        assert rank["counts"] == ref["ranks"][0]["counts"]
        assert max(abs(a - b) for a, b in zip(rank["true_norm"], ref["ranks"][0]["lightning_total"])) < TOL
    for step, (mine, theirs) in enumerate(zip(_full_grad_norms(ours["ranks"], "before_opt"),
                                              _full_grad_norms(ref["ranks"], "before_opt"))):
        _assert_close(mine, theirs, f"before_opt step {step}")
    for step, (mine, theirs) in enumerate(zip(ours["steps"], ref["steps"])):
        _assert_close(mine, theirs, f"step {step}")
    _assert_close(ours["final"], ref["final"], "epoch")


LATE_MODEL = Path(__file__).parent / "scripts" / "configure_model.py"


@pytest.mark.timeout(500)
def test_a_model_built_in_configure_model_trains_like_ddp_under_tp_and_pp():
    """Lightning's recipe for large models builds the model in ``configure_model()``, after the
    strategy exists: the strategy validates and cuts it there, not when the module arrives empty."""
    reference = run_script(LATE_MODEL, 1, ["--strategy", "ddp"], timeout=180)
    for layout in (["--tp", "2"], ["--pp", "2"]):
        got = run_script(LATE_MODEL, 2, ["--strategy", "megatron", *layout], timeout=180)
        assert len(got["losses"]) == 4, layout
        assert max(abs(a - b) for a, b in zip(got["losses"], reference["losses"])) < 2e-4, layout
        assert abs(got["val_loss"] - reference["val_loss"]) < 2e-4, layout


GENERATE = Path(__file__).parent / "scripts" / "generate_in_validation.py"


@pytest.mark.timeout(400)
def test_generate_in_validation_step_under_tp_continues_as_one_device():
    """Greedy decoding with the key/value cache on the sharded attention: the same tokens as DDP."""
    reference = run_script(GENERATE, 1, ["--strategy", "ddp"], timeout=180)
    tp2 = run_script(GENERATE, 2, ["--strategy", "megatron", "--tp", "2"], timeout=180)
    assert len(reference["continuations"]) >= 2  # the sanity check's batches and the validation's
    assert tp2["continuations"] == reference["continuations"]
    assert max(abs(a - b) for a, b in zip(tp2["losses"], reference["losses"])) < 2e-4
