"""A layer stack whose blocks the forward applies more than once (ALBERT's one shared layer).

The pipeline splits the *applications*, not the blocks: with 12 applications of one block at
pp=2, stage 0 runs applications 0-5 and stage 1 runs 6-11, each with its own copy of the block.
The forward indexes the stack as usual (``layer_groups[group_idx](...)``); what it gets back is
an :class:`_Application` that counts the calls of the current microbatch and
- before this chunk's share: returns zeros shaped like the block's output (a meta twin computes
  the shape); the first call of the share takes the previous stage's activation instead;
- within the share: runs the real block, and after the share's last call ends the stage;
- beyond it: cannot happen (the stage has ended), so it is an error naming the mismatch.
A block applied on several stages is a tied weight: its gradients are summed over the pipeline
group (:class:`~megastrategy.pipeline.component.Pipeline`), as one device sums them over its
applications.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from megastrategy.errors import MegatronConfigError

if TYPE_CHECKING:
    from megastrategy.pipeline.stage import PipelineStage

__all__ = ["ReusedLayers"]


class ReusedLayers(nn.ModuleList):
    """The rank's copies of the blocks it applies, registered under their indices in the full stack."""

    def __init__(self, held: dict[int, nn.Module], stand_ins: dict[int, nn.Module], stage: "PipelineStage"):
        super().__init__()
        for index in sorted(held):
            self.add_module(str(index), held[index])
        self._stand_ins = stand_ins  # a dict, not registered: parameter-free meta twins
        self._stage = stage
        self._size = len(stand_ins)

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(self._size)[idx]]
        index = idx + self._size if idx < 0 else idx
        return _Application(self, index)

    def __iter__(self):
        return iter(self[i] for i in range(self._size))

    def run(self, index: int, args: tuple, kwargs: dict) -> Any:
        """One application of block ``index`` in the current chunk (see the module docstring)."""
        stage = self._stage
        k = stage.next_application()
        share = stage.chunks[stage.active_chunk]
        if k >= len(stage.stack_calls) or stage.stack_calls[k] != index:
            raise MegatronConfigError(
                f"application {k} of {stage.stack_path} called block {index}, but the dry run of the forward "
                f"applied blocks {list(stage.stack_calls)}; pipelining a shared layer needs the forward to apply "
                "the blocks in the same order every time."
            )
        if k < share[0]:
            return self._stand_ins[index](*args, **kwargs)
        if k > share[-1]:
            raise MegatronConfigError(f"{stage.stack_path}: application {k} ran after this stage's share {share}.")
        block = self._modules[str(index)]
        if k == share[0]:
            args, kwargs = stage.substitute_input(block, args, kwargs)
        out = block(*args, **kwargs)
        if k == share[-1]:
            stage.end_of_chunk(out)
        return out


class _Application:
    """What indexing the stack returns: a call of it is one counted application of one block."""

    def __init__(self, layers: ReusedLayers, index: int):
        self._layers, self._index = layers, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._layers.run(self._index, args, kwargs)

    def __getattr__(self, name: str) -> Any:  # attributes of the block itself (e.g. its config)
        layers, index = self.__dict__["_layers"], self.__dict__["_index"]
        block = layers._modules.get(str(index)) or layers._stand_ins[index]._meta[0]
        return getattr(block, name)
