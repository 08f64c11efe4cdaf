"""Tensor parallelism as a component: resolve the plan before any collective, apply it in setup."""
from __future__ import annotations

from typing import Optional

from torch import nn

from megastrategy.component import Component, SetupContext
from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.block_capture import capture_blocks
from megastrategy.layers.block_check import verify_sharded_blocks
from megastrategy.layers.block_fallback import keep_failing_blocks_whole
from megastrategy.layers.plan import ResolvedPlan, apply_tp_plan, resolve_tp_plan
from megastrategy.layers.user_hooks import refuse_user_hooks


class TensorParallel(Component):
    """Shards the layers the plan names over the TP ranks (``tp_plan`` or auto-detection).

    The plan is resolved from names and shapes only, so every plan error comes before the
    first collective. After sharding, each distinct sharded block is run against its unsharded
    copy on a random input (``block_check``; outside Hugging Face on a guessed one,
    ``plain_block_inputs``): a plan that would be silently wrong, or whose forward cannot run on
    the local heads, refuses to train, naming the block. An auto-detected block that would fail
    the check is found first, on a sharded copy, and kept whole instead (``block_fallback``, one
    warning); only blocks the user named in ``tp_plan`` still refuse. At ``tp=1`` it is still resolved: the Transformer Engine backend swaps
    exactly the layers the plan marks.
    """

    def __init__(self, config: MegatronConfig) -> None:
        self.tp, self.tp_plan = config.tp, config.tp_plan
        self.plan: Optional[ResolvedPlan] = None

    def validate(self, module: nn.Module, layout) -> None:
        if self.tp > 1:
            _refuse_compiled(module, self.tp)
        if self.plan is None:
            self.plan = _resolve(module, self.tp_plan, self.tp)
            if self.tp > 1:
                refuse_user_hooks(module, self.plan, self.tp)

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        self.validate(module, None)
        ctx.plan = self.plan
        group = ctx.parallel_state.tp_group
        if self.tp > 1:
            captured = capture_blocks(module, self.plan)
            self.plan, captured = keep_failing_blocks_whole(module, self.plan, captured, group, self.tp, ctx.rng_tracker)
            ctx.plan = self.plan
            apply_tp_plan(module, self.plan, group=group, rng_tracker=ctx.rng_tracker)
            verify_sharded_blocks(module, captured, group, self.tp)
        elif ctx.backend_in_use == "te":  # at tp=1 the plan marks what TE takes over
            apply_tp_plan(module, self.plan, group=group, rng_tracker=ctx.rng_tracker)


def _resolve(module: nn.Module, tp_plan: Optional[dict], tp: int) -> ResolvedPlan:
    """The plan; at ``tp=1`` without a ``tp_plan`` of the user's, an empty one when resolving refuses:
    nothing is sharded there, so a flaw of the declared or detected plan changes nothing. The sweeps
    found such refusals stopping runs with no tensor parallelism (Zaya's declared plan names half of
    a block, at ep2, pp2 and plain data parallelism; BERT-generation's tied head at pp2 and cp2)."""
    try:
        return resolve_tp_plan(module, tp_plan, tp)
    except MegatronConfigError:
        if tp > 1 or tp_plan is not None:
            raise
        return ResolvedPlan(tp_size=1, entries=())


def _refuse_compiled(module: nn.Module, tp: int) -> None:
    """``torch.compile(model)`` kept in the module: dynamo would trace the sharded layers, whose
    vocab-parallel logits report the whole vocabulary while holding a slice, and fail at the
    first step with a guard error about tensor sizes. Refused before any work instead."""
    from torch._dynamo.eval_frame import OptimizedModule

    compiled = next((name or type(m).__name__ for name, m in module.named_modules() if isinstance(m, OptimizedModule)), None)
    if compiled is not None:
        raise MegatronConfigError(
            f"tp={tp} with the torch.compile'd module {compiled!r}: compiling a tensor-parallel model is not "
            "supported yet (dynamo cannot trace the sharded layers). Pass the model without torch.compile, or "
            "use pp and dp, which run a compiled model."
        )
