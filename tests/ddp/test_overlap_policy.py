"""What overlap_grad_reduce=None (the default) resolves to, and why (no processes needed)."""
import lightning as L
from lightning.pytorch import Callback

from megastrategy.ddp.overlap_policy import resolve_overlap_grad_reduce


class Plain(L.LightningModule):
    pass


class Manual(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class ReadsGrads(L.LightningModule):
    def on_after_backward(self):
        pass


class GradLogger(Callback):
    def on_after_backward(self, trainer, pl_module):
        pass


class Trainer:  # what the policy reads of a trainer
    def __init__(self, *callbacks):
        self.callbacks = list(callbacks)


def test_auto_is_on_for_a_plain_module_with_plain_callbacks():
    assert resolve_overlap_grad_reduce(None, Plain(), Trainer(Callback()))[0] is True


def test_auto_is_off_with_manual_optimization_or_an_on_after_backward_hook():
    assert resolve_overlap_grad_reduce(None, Manual(), Trainer())[0] is False
    assert resolve_overlap_grad_reduce(None, ReadsGrads(), Trainer())[0] is False
    off, why = resolve_overlap_grad_reduce(None, Plain(), Trainer(GradLogger()))
    assert off is False and "on_after_backward" in why


def test_an_explicit_choice_wins():
    assert resolve_overlap_grad_reduce(True, ReadsGrads(), Trainer())[0] is True
    assert resolve_overlap_grad_reduce(False, Plain(), Trainer())[0] is False
