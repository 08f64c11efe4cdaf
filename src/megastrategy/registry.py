"""Named layouts for ``Trainer(strategy="megatron_tp2")``, registered in Lightning's ``StrategyRegistry``.

Lightning has no entry point for strategies: a name exists once something calls
``StrategyRegistry.register``. ``import megastrategy`` does that through
:func:`register_when_lightning_loads` without importing Lightning itself (seconds), so
``import megastrategy.pipeline`` stays light: if Lightning is already imported the presets are
registered at once, otherwise the moment ``lightning.pytorch.strategies`` finishes loading.

Lightning refuses an unknown strategy string with a generic message that cannot list these
names; :func:`preset` gives the clear one (and :data:`PRESETS` is the list).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from megastrategy.errors import MegatronConfigError
from megastrategy.import_hooks import when_loaded

__all__ = ["PRESETS", "Preset", "preset", "register_presets", "register_when_lightning_loads"]

LIGHTNING_STRATEGIES = "lightning.pytorch.strategies"


class Preset(NamedTuple):
    """What a name means: the ``MegatronStrategy`` keywords, and one line for the registry."""

    kwargs: Mapping[str, Any]
    description: str


PRESETS: dict[str, Preset] = {
    "megatron": Preset({}, "data parallelism through Megatron's gradient buffers (tp=1, pp=1)"),
    "megatron_tp2": Preset({"tp": 2}, "tensor parallelism over 2 ranks"),
    "megatron_tp4": Preset({"tp": 4}, "tensor parallelism over 4 ranks"),
    "megatron_tp8": Preset({"tp": 8}, "tensor parallelism over 8 ranks (one 8-GPU node)"),
    "megatron_pp2": Preset({"pp": 2}, "2 pipeline stages, 2 microbatches per step"),
    "megatron_pp4": Preset({"pp": 4}, "4 pipeline stages, 4 microbatches per step"),
    "megatron_tp2_pp2": Preset({"tp": 2, "pp": 2}, "tensor parallelism over 2 ranks inside 2 pipeline stages"),
    "megatron_tp2_sp": Preset({"tp": 2, "sequence_parallel": True}, "tp=2 with sequence parallelism"),
    "megatron_zero1": Preset({"use_distributed_optimizer": True},
                             "distributed optimizer (ZeRO-1): optimizer state split over data-parallel ranks"),
    "megatron_tp2_zero1": Preset({"tp": 2, "use_distributed_optimizer": True}, "tp=2 with the distributed optimizer"),
}


def preset(name: str, **overrides: Any):
    """``MegatronStrategy`` for a preset name, with ``overrides`` on top; unknown names list the presets."""
    if name not in PRESETS:
        raise MegatronConfigError(
            f"strategy={name!r}: not a megastrategy preset. Use one of {', '.join(PRESETS)}, "
            "or MegatronStrategy(tp=..., pp=..., ...) for any other layout."
        )
    from megastrategy.strategy import MegatronStrategy

    return MegatronStrategy(**{**PRESETS[name].kwargs, **overrides})


def _make(name: str):
    """The registry's factory: Lightning calls ``factory(**init_params)``; ours take the name."""
    return lambda: preset(name)


def register_presets(registry: Any) -> None:
    """Put every preset in a Lightning ``StrategyRegistry`` (again: replaces an earlier entry)."""
    for name, p in PRESETS.items():
        registry.register(name, _make(name), description=f"MegatronStrategy: {p.description}", override=True)


def register_when_lightning_loads() -> None:
    """Register the presets now if Lightning is loaded, else as soon as it is (idempotent)."""
    when_loaded(LIGHTNING_STRATEGIES, lambda module: register_presets(module.StrategyRegistry),
                ready=lambda module: hasattr(module, "StrategyRegistry"))
