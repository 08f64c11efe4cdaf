"""Lightning's step methods routed through the one step path.

``training_step``, ``validation_step``, ``test_step`` and ``predict_step`` all hand the user's step
to the :class:`~megastrategy.pipeline.step_runner.StepRunner`, which runs it over this rank's
schedule (one stage and one microbatch without a pipeline). Under automatic optimization the
runner also runs every backward of the step, so Lightning's own ``backward`` has nothing left to do.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.strategies import DDPStrategy

from megastrategy.precision import loss_scaler

__all__ = ["LightningStepMethods"]


class LightningStepMethods:
    """A mixin for a Lightning strategy that owns a step runner (placed before ``DDPStrategy``)."""

    _runner: Any

    def _before_training_step(self) -> None:
        """Before the step runner's backward (the strategy clears gradients no optimizer step used)."""

    def _before_backward(self, loss: torch.Tensor) -> None:
        """A single stage's loss, before its backward (the strategy checks what it reads)."""

    def _step(self, name: str, context: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        module = self.lightning_module
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        training = name == "training_step"
        scaler = loss_scaler(self.precision_plugin) if training else None
        automatic = module.automatic_optimization
        if training:
            self._before_training_step()
        with context():
            return self._runner.run(
                module, name, args, kwargs,
                accumulate_grad_batches=module.trainer.accumulate_grad_batches if training else 1,
                grad_scale=scaler.get_scale() if scaler is not None else 1.0,
                lightning_backward=self._lightning_backward if automatic else None,
                backward_hooks=self._lightning_backward_hooks if automatic else None,
            )

    def _lightning_backward(self, loss: torch.Tensor) -> None:
        """The one-stage backward, as Lightning runs it: hooks, precision plugin, ``module.backward``."""
        self._before_backward(loss)
        DDPStrategy.backward(self, loss, None)

    def _lightning_backward_hooks(self, loss: torch.Tensor) -> None:
        """Lightning's before/after-backward hooks for a backward the pipeline schedule already ran."""
        loss = self.precision_plugin.pre_backward(loss, self.lightning_module)
        self.precision_plugin.post_backward(loss, self.lightning_module)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._doing(f"validation_step (batch {args[1] if len(args) > 1 else '?'})")
        return self._step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.lightning_module.automatic_optimization:
            return closure_loss  # the step runner already ran every backward of the step
        self._before_backward(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
