"""Random initializers found in the source of the hooks that run after the split (hooks_that_initialize.py)."""
from types import SimpleNamespace

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateFinder
from torch import nn

from megastrategy.hooks_that_initialize import random_initializers_in_hooks


def init_weights(m):
    if isinstance(m, nn.Linear):
        torch.nn.init.kaiming_uniform_(m.weight)


class LinearLoop(L.LightningModule):
    def on_fit_start(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)


class HuggingFaceStyle(L.LightningModule):
    def on_train_start(self):
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.bias.data.zero_()


class ConstantsOnly(L.LightningModule):
    def on_fit_start(self):
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
        self.seen = sum(p.numel() for p in self.parameters())


class NoiseAndNamedLayer(L.LightningModule):
    """Draws into a buffer and into a layer named directly: no pick by type, so no sharded layer is skipped
    (a named parameter's write is caught by its values)."""

    def on_train_epoch_start(self):
        self.noise.normal_()
        nn.init.xavier_uniform_(self.head.weight)


class ClassNameLoop(L.LightningModule):
    def on_fit_start(self):
        for m in self.modules():
            if m.__class__.__name__ == "Linear":
                m.reset_parameters()


class ReinitCallback(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        pl_module.apply(init_weights)


def _found(module, callbacks=()):
    module._trainer = SimpleNamespace(callbacks=list(callbacks))
    return random_initializers_in_hooks(module)


def test_an_isinstance_loop_in_on_fit_start():
    (found,) = _found(LinearLoop())
    assert found.startswith("LinearLoop.on_fit_start line ") and found.endswith("nn.init.normal_(m.weight, std=0.02)")


def test_a_method_applied_from_the_hook_is_read_too():
    (found,) = _found(HuggingFaceStyle())
    assert found.startswith("HuggingFaceStyle._init_weights line ")
    assert found.endswith("module.weight.data.normal_(mean=0.0, std=0.02)")


def test_a_user_callbacks_hook_and_the_function_it_applies():
    (found,) = _found(ConstantsOnly(), [ReinitCallback(), LearningRateFinder()])
    assert found.startswith("init_weights line ") and found.endswith("torch.nn.init.kaiming_uniform_(m.weight)")


def test_constant_fills_and_lightnings_own_hooks_are_not_listed():
    assert _found(ConstantsOnly(), [LearningRateFinder()]) == []
    assert _found(L.LightningModule()) == []


def test_draws_without_a_pick_by_type_are_not_listed():
    assert _found(NoiseAndNamedLayer()) == []


def test_a_pick_by_class_name_counts_as_a_type_test():
    (found,) = _found(ClassNameLoop())
    assert found.startswith("ClassNameLoop.on_fit_start line ") and found.endswith("m.reset_parameters()")
