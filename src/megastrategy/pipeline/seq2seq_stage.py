"""A pipeline stage of an encoder-decoder: a share of the joined stack (:mod:`.seq2seq_layout`).

The user's unchanged forward runs on every stage, through the encoder's loop and then the
decoder's. Each list of blocks is replaced by the chunk's view of it (its own blocks, placeholders
for those before, :mod:`.leading_blocks`), and what crosses a boundary depends on where it is:

- inside the encoder: the hidden state and what encoder blocks hand the next (T5's position bias);
- at the seam (a chunk starting at decoder block 0): the encoder's last hidden state, which the
  placeholder of the last encoder block returns, so the encoder's final norm, the decoder's
  embeddings and the decoder's masks all run on this stage from the microbatch, as on one device;
- inside the decoder: the hidden state, what decoder blocks hand the next (T5's two position
  biases) and the encoder's output (the *memory*). The memory is an argument every decoder block
  reads, not an output, so each decoder block of a chunk after the seam gets the received one,
  and the chunk's last block's argument is sent on. Its gradient comes back the same way: every
  stage's cross-attention adds to it, as the one device's backward sums them.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from megastrategy.anatomy import get_submodule_path
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.boundary_pack import pack, unpack
from megastrategy.pipeline.forward_order import block_outputs
from megastrategy.pipeline.leading_blocks import SkippedBlock, skipped_blocks
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.seq2seq_layout import MEMORY_ARGUMENT, Seq2SeqLayout
from megastrategy.pipeline.stage import (LocalLayers, MetaStandIn, PipelineStage, StageBoundary, Unreachable, _Swap)
from megastrategy.pipeline.stand_in_values import refuse_if_marked

__all__ = ["Seq2SeqStage", "cut_seq2seq_stage", "held_modules"]


class _SeamInput(SkippedBlock):
    """The last encoder block's placeholder on a chunk starting at decoder block 0: it returns the
    encoder's last hidden state, received from the previous stage, in the blocks' structure."""

    def __init__(self, index: int, real: nn.Module, arity: int, stage: "Seq2SeqStage"):
        super().__init__(index, real, arity)
        self._stage = [stage]  # a list: not registered

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = self._stage[0].take_seam_input()
        return (hidden,) + (None,) * (self.arity - 1) if self.arity else hidden


@dataclass
class Seq2SeqStage(PipelineStage):
    """:class:`PipelineStage` over the joined stack; ``chunks`` index it (decoder block ``j`` is ``N + j``)."""

    num_encoder: int = 0  # N: joined block N is decoder block 0 (numbers, not the layout: it holds every module)
    encoder_carried: tuple = ()  # (output index, argument) an encoder block hands the next
    decoder_carried: tuple = ()
    _blocks: dict = field(default_factory=dict)  # joined index -> block, for the blocks this rank holds
    _memory: Optional[torch.Tensor] = None  # the encoder's output received for this microbatch
    _received: Optional[list] = None  # the message, unpacked early by the encoder's output hook
    _memory_out: Optional[torch.Tensor] = None  # the memory the chunk's last decoder block read

    def activate(self, chunk: int, input_tensor: Optional[torch.Tensor]) -> None:
        self._memory = self._memory_out = self._received = None
        super().activate(chunk, input_tensor)

    def deactivate(self) -> None:
        self._memory = self._memory_out = self._received = None
        super().deactivate()

    def _side_carried(self, g: int) -> tuple[tuple[int, str], ...]:
        return self.encoder_carried if g < self.num_encoder else self.decoder_carried

    def _unpack_input(self, after: int) -> list[torch.Tensor]:
        """The message sent after block ``after``: hidden, carried outputs, then (decoder) the memory."""
        x, self._pending_input = self._pending_input, None
        count = 1 + len(self._side_carried(after)) + (after >= self.num_encoder)
        return unpack(x, count) if count > 1 else [x]

    def take_seam_input(self) -> torch.Tensor:
        """The encoder's last hidden state, for the last encoder placeholder of a chunk starting at the seam."""
        if self._pending_input is None:
            raise MegatronConfigError("the encoder's last block ran twice in one microbatch on the seam stage.")
        return self._unpack_input(self.num_encoder - 1)[0]

    def block_pre_hook(self, g: int):
        """The pre-hook of block ``g``: the chunk's first block takes the received hidden state and
        carried outputs; a decoder block after the seam takes the received memory (the forward hands
        each block its own, from the stand-ins); the chunk's last decoder block's memory is kept to send."""
        def hook(block: nn.Module, args: tuple, kwargs: dict):
            chunk = self.chunks[self._active_chunk] if self._active_chunk is not None else ()
            if g not in chunk:
                return None
            n = self.num_encoder
            if g == chunk[0] and g != n and (self._pending_input is not None or self._received is not None):
                hidden, *rest = self._received or self._unpack_input(g - 1)
                self._received = None
                args, kwargs = _put(block, args, kwargs, None, hidden)
                for (_, name), value in zip(self._side_carried(g - 1), rest):
                    args, kwargs = _put(block, args, kwargs, name, value)
                self._memory = rest[-1] if g > n else None
            if g >= n and self._memory is not None:
                args, kwargs = _put(block, args, kwargs, MEMORY_ARGUMENT, self._memory)
            if g >= n and g == chunk[-1]:
                self._memory_out = _get(block, args, kwargs, MEMORY_ARGUMENT)
            return args, kwargs

        return hook

    def encoder_output_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """On a chunk after the seam, the encoder's output is the received memory, not what its
        stand-ins computed: the model's output (``encoder_last_hidden_state``) and the decoder's
        cross-attention then read what the one device computes."""
        chunk = self.chunks[self._active_chunk] if self._active_chunk is not None else ()
        if not chunk or chunk[0] <= self.num_encoder or self._pending_input is None:
            return None
        self._received = self._unpack_input(chunk[0] - 1)
        self._memory = self._received[-1]
        if isinstance(output, dict) and "last_hidden_state" in output:
            output["last_hidden_state"] = self._memory
            return output
        if isinstance(output, tuple) and output:
            return (self._memory, *output[1:])
        if isinstance(output, torch.Tensor):
            return self._memory
        raise MegatronConfigError(
            f"the encoder returned {type(output).__name__}; a pipeline stage after the encoder-decoder seam replaces "
            "the encoder's output (a tensor, a tuple or a ModelOutput with last_hidden_state) with the one it "
            "receives. Use pp=1 for this model.")

    def block_post_hook(self, g: int):
        """The hook after block ``g``: the chunk's last block ends the forward with the message for the
        next stage (its hidden state, carried outputs and, in the decoder, the memory)."""
        def hook(block: nn.Module, args: tuple, output: Any) -> None:
            if self._active_chunk is None or g != self.chunks[self._active_chunk][-1]:
                return
            self._stack_finished = True
            if self.is_last_virtual(self._active_chunk):
                return
            values = block_outputs(output)
            sent = [values[0]] + [values[i] for i, _ in self._side_carried(g)]
            sent += [self._memory_out] if g >= self.num_encoder else []
            if self.probing:
                refuse_if_marked(sent, f"what block {g} of the joined encoder-decoder stack hands the next stage",
                                 self._place())
            if not all(isinstance(v, torch.Tensor) for v in sent):
                raise MegatronConfigError(
                    f"block {g} of the joined encoder-decoder stack hands the next stage "
                    f"{[type(v).__name__ for v in sent]}; pipeline stages need tensors there (the memory is the "
                    f"decoder blocks' {MEMORY_ARGUMENT!r} argument). Use pp=1 for this model.")
            raise StageBoundary(pack(sent) if len(sent) > 1 else sent[0])

        return hook


def _index(block: nn.Module, name: Optional[str], args: tuple) -> Optional[int]:
    """Where argument ``name`` (``None``: the hidden state, the first) sits in ``args``, or ``None``."""
    if name is None:
        return 0 if args else None
    params = list(inspect.signature(block.forward).parameters)
    return params.index(name) if name in params and params.index(name) < len(args) else None


def _put(block: nn.Module, args: tuple, kwargs: dict, name: Optional[str], value: Any) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with argument ``name`` (``None``: the hidden state) set to ``value``."""
    i = _index(block, name, args)
    if i is not None:
        return tuple(value if k == i else a for k, a in enumerate(args)), kwargs
    key = name if name is not None else next(iter(kwargs))
    return args, {**kwargs, key: value}


def _get(block: nn.Module, args: tuple, kwargs: dict, name: str) -> Any:
    i = _index(block, name, args)
    return args[i] if i is not None else kwargs.get(name)


def held_modules(layout: Seq2SeqLayout, stages: list[tuple[int, int]], first: bool, last: bool) -> set[str]:
    """Names of the outside modules a rank runs for real, given its chunks' ``(first, last block)``
    and whether it runs the first/last virtual stage."""
    seam = any(a <= layout.num_encoder <= b for a, b in stages)
    return ({o.name for o in layout.pre} if first else set()) | ({o.name for o in layout.between} if seam else set()) \
        | ({o.name for o in layout.post} if last else set())


def _outside_swaps(layout: Seq2SeqLayout, stage: Seq2SeqStage, held: set[str]) -> list[_Swap]:
    """The real module where it is held, a meta stand-in for one whose output a later block's input
    replaces (pre, between), and an unreachable placeholder for a module after the stack."""
    seen, swaps = set(), []
    before = {o.name for o in layout.pre + layout.between}
    for o in layout.pre + layout.between + layout.post:
        if o.name in seen:
            continue
        seen.add(o.name)
        if o.name in held:
            swaps.append(_Swap(o.parent, o.attr, o.module))
        elif o.name in before:
            stand_in = MetaStandIn(o.module, o.name, o.by_registration)
            stand_in.marking = lambda: stage.probing
            swaps.append(_Swap(o.parent, o.attr, stand_in))
        else:
            swaps.append(_Swap(o.parent, o.attr, Unreachable(o.name, o.by_registration)))
    return swaps


def cut_seq2seq_stage(module: nn.Module, layout: Seq2SeqLayout, assignment: list[list[list[int]]], pp_rank: int,
                      pp_size: int, vp_size: int, placement: Optional[StagePlacement] = None) -> Seq2SeqStage:
    """Rewrite ``module`` in place into this rank's stage of the joined stack (see the module docstring)."""
    chunks, n = assignment[pp_rank], layout.num_encoder
    stage = Seq2SeqStage(stack_path=layout.encoder_path, chunks=chunks, pp_rank=pp_rank, pp_size=pp_size,
                         vp_size=vp_size, placement=placement, num_encoder=n,
                         encoder_carried=layout.encoder_carried, decoder_carried=layout.decoder_carried)
    enc, dec = (get_submodule_path(module, p) for p in (layout.encoder_path, layout.decoder_path))
    stage._blocks = {g: layout.block(module, g) for chunk in chunks for g in chunk}
    enc_skipped = skipped_blocks(enc, n, layout.encoder_arity)  # before any hook is registered
    dec_skipped = skipped_blocks(dec, len(dec), layout.decoder_arity)
    seam_input = _SeamInput(n - 1, enc[n - 1], layout.encoder_arity, stage)
    stage._chunk_swaps, stage._probe_targets = [], []
    ranks = _rank_ranges(assignment, stage)
    held_all = held_modules(layout, ranks[pp_rank][0], *ranks[pp_rank][1])
    for c, chunk in enumerate(chunks):
        a, b = chunk[0], chunk[-1]
        leading = enc_skipped[: min(a, n)] if a != n else enc_skipped[: n - 1] + [seam_input]
        enc_view = LocalLayers({g: enc[g] for g in chunk if g < n}, leading)
        dec_view = LocalLayers({g - n: dec[g - n] for g in chunk if g >= n}, dec_skipped[: max(a - n, 0)])
        held = held_modules(layout, [(a, b)], stage.is_first_virtual(c), stage.is_last_virtual(c))
        stage._chunk_swaps.append([_Swap(*_parent(module, layout.encoder_path), enc_view),
                                   _Swap(*_parent(module, layout.decoder_path), dec_view)]
                                  + _outside_swaps(layout, stage, held))
        after = [(o.name, o.module) for o in layout.post] if stage.is_last_virtual(c) else []
        stage._probe_targets.append([(f"joined block {g}", stage._blocks[g]) for g in chunk] + after)
    for chunk in chunks:
        for g in chunk:
            if g == chunk[0] or g == chunk[-1] or g >= n:
                stage._blocks[g].register_forward_pre_hook(stage.block_pre_hook(g), with_kwargs=True)
        stage._blocks[chunk[-1]].register_forward_hook(stage.block_post_hook(chunk[-1]))
    if any(chunk[0] > n for chunk in chunks):
        get_submodule_path(module, layout.encoder_module_path).register_forward_hook(stage.encoder_output_hook)
    mine = [g for chunk in chunks for g in chunk]
    stage._resting_swaps = [_Swap(*_parent(module, layout.encoder_path), LocalLayers({g: enc[g] for g in mine if g < n})),
                            _Swap(*_parent(module, layout.decoder_path),
                                  LocalLayers({g - n: dec[g - n] for g in mine if g >= n}))]
    stage._resting_swaps += _outside_swaps(layout, stage, held_all)
    stage.tied_parameters = _tied(layout, ranks, pp_rank)
    stage.deactivate()
    unreachable = [s.module for swaps in stage._chunk_swaps + [stage._resting_swaps] for s in swaps
                   if isinstance(s.module, Unreachable)]
    parts = layout.encoder_path.split(".")
    ancestors = [(".".join(parts[:i]), get_submodule_path(module, ".".join(parts[:i])) if i else module)
                 for i in range(len(parts))]
    stage.call_modules = ancestors + [(o.name, o.module) for o in layout.post] + [(m._name, m) for m in unreachable]
    return stage


def _parent(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = path.rpartition(".")
    return (get_submodule_path(module, parent_path) if parent_path else module), attr


def _rank_ranges(assignment: list[list[list[int]]], stage: Seq2SeqStage) -> list[tuple[list[tuple[int, int]], tuple[bool, bool]]]:
    """Per rank: its chunks' (first, last block) and whether it runs the first/last virtual stage."""
    where = stage._where()
    out = []
    for rank, chunks in enumerate(assignment):
        stages = [where.stage(rank, c) for c in range(len(chunks))]
        out.append(([(c[0], c[-1]) for c in chunks], (0 in stages, where.num_stages - 1 in stages)))
    return out


def _tied(layout: Seq2SeqLayout, ranks: list, pp_rank: int) -> list[nn.Parameter]:
    """The parameters this rank holds that another rank holds too (the shared embedding of T5/BART:
    the encoder's and the decoder's embeddings and ``lm_head``): their gradients are summed."""
    modules = {o.name: o.module for o in layout.pre + layout.between + layout.post}
    held = [held_modules(layout, stages, *ends) for stages, ends in ranks]

    def params(names: set[str]) -> dict[int, nn.Parameter]:
        return {id(p): p for name in sorted(names) for p in modules[name].parameters()}

    mine = params(held[pp_rank])
    others = {pid for r, names in enumerate(held) if r != pp_rank for pid in params(names)}
    return [p for pid, p in mine.items() if pid in others]

