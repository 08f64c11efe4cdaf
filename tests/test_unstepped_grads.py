"""``clear_unstepped_grads``: Lightning's zero_grad rule applied before the step runner's backward."""
from types import SimpleNamespace

from megastrategy.unstepped_grads import clear_unstepped_grads


def _trainer(batch_idx, accumulate=1, automatic=True):
    return SimpleNamespace(lightning_module=SimpleNamespace(automatic_optimization=automatic), accumulate_grad_batches=accumulate,
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_idx=batch_idx)))


def _run(trainer, has_grads=True):
    cleared = []
    done = clear_unstepped_grads(trainer, [SimpleNamespace(has_grads=has_grads)], lambda: cleared.append(1))
    assert done == bool(cleared)
    return done


def test_cleared_where_lightning_zeroes():
    assert _run(_trainer(3))
    assert _run(_trainer(4, accumulate=2))


def test_kept_inside_a_window_under_manual_optimization_or_when_empty():
    assert not _run(_trainer(3, accumulate=2))
    assert not _run(_trainer(3, automatic=False))
    assert not _run(_trainer(3), has_grads=False)
