"""Lightning's own callbacks, told what one device would tell them about a split model.

Callbacks read the model and the world as they find them on their rank: a model summary counts
this rank's shards and stage, ``ThroughputMonitor`` multiplies one rank's rates by the world size.
Under tp/pp both are wrong for what the user asks (the whole model; the samples the replicas
train on); the pieces here put the right numbers in, so the strategy calls one function.
"""
from __future__ import annotations

from megastrategy.component import SetupContext
from megastrategy.ddp.component import grad_counts_here
from megastrategy.layers.shard_spec import get_shard_spec
from megastrategy.throughput_replicas import count_replicas
from megastrategy.whole_model_summary import summarize_whole_models

__all__ = ["adapt_callbacks"]


def adapt_callbacks(callbacks: list, ctx: SetupContext, fitting: bool) -> None:
    """Throughput counts data-parallel replicas; when fitting a split model, summaries count the whole model."""
    ps, config = ctx.parallel_state, ctx.config
    count_replicas(callbacks, ps.dp_size)
    if not fitting or config.tp * config.pp == 1:
        return
    tp_rank = ps.tp_rank
    summarize_whole_models(callbacks, counted=grad_counts_here(ctx), group=ps.mp_group,
                           replicated_here=lambda p: get_shard_spec(p) is not None or tp_rank == 0,
                           staged=config.pp > 1)
