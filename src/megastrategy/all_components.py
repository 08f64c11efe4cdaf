"""Every component class, in one namespace for the strategy's ordered list (and for users who
want to look one up with ``strategy.component(kind)``)."""
from megastrategy.averaged_copies_component import AveragedCopies
from megastrategy.checkpoint.component import Checkpoints
from megastrategy.context.component import ContextParallelComponent
from megastrategy.cuda_graphs.component import CudaGraphs
from megastrategy.ddp.buffer_sync import BufferBroadcast
from megastrategy.ddp.component import GradientBuffers
from megastrategy.ddp.nonfinite_guard import NonFiniteGuard
from megastrategy.ddp.sync_batchnorm import SyncBatchNormLayers
from megastrategy.layers.components import Recompute, SequenceParallel, TensorParallel, TransformerEngine
from megastrategy.layers.shard_loss_terms import ShardLossTerms
from megastrategy.moe.component import ExpertParallel
from megastrategy.pipeline.component import Pipeline
from megastrategy.runtime import BatchBroadcast, Watchdog
from megastrategy.weights_written_after_split import WeightsWrittenAfterSplit

__all__ = [
    "AveragedCopies", "BatchBroadcast", "BufferBroadcast", "Checkpoints", "ContextParallelComponent", "CudaGraphs", "ExpertParallel", "GradientBuffers", "NonFiniteGuard", "Pipeline",
    "Recompute", "SequenceParallel", "ShardLossTerms", "SyncBatchNormLayers", "TensorParallel", "TransformerEngine", "Watchdog",
    "WeightsWrittenAfterSplit",
]
