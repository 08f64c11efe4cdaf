"""Several tensors crossing a stage boundary as the one tensor the schedule sends.

Most blocks hand the next block only the hidden state. Some also hand it tensors they computed
(T5's blocks pass the ``position_bias`` block 0 computed from its parameters), and the next
stage's first block needs those too, with gradients flowing back. The executor moves one tensor
per message, so they are packed: one flat tensor of their common dtype, led by a header of
small integers (dtype code, rank, every size written as base-128 digits, which every float dtype
holds exactly) that says how to cut it apart. Packing and unpacking are differentiable
(``cat`` and views), so the received tensor's gradient reaches every packed tensor.

Integer tensors (the top-k indices a DeepSeek sparse-attention indexer computes in one block and
hands the next) cannot be cast to the common float dtype exactly (bfloat16 holds integers to 256
only), so their bytes are carried as they are, reinterpreted as that dtype and back; they have no
gradient.
"""
from __future__ import annotations

import torch

from megastrategy.errors import MegatronConfigError

__all__ = ["pack", "unpack", "header_length"]

MAX_NDIM = 6
DIGITS = 3  # base-128 digits per size: sizes below 2**21
_BASE = 128
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64)
_PER_TENSOR = 2 + DIGITS * MAX_NDIM


def header_length(count: int) -> int:
    """Elements of header in front of ``count`` packed tensors."""
    return count * _PER_TENSOR


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``tensors`` (their promoted float dtype; integers bit for bit) behind
    a header describing them."""
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype not in _DTYPES or t.dim() > MAX_NDIM or any(s >= _BASE**DIGITS for s in t.shape):
            raise MegatronConfigError(
                f"a tensor handed to the next pipeline stage has dtype {t.dtype} and shape {tuple(t.shape)}; "
                f"only float, int32 and int64 tensors of at most {MAX_NDIM} dimensions below {_BASE**DIGITS} "
                "each can be carried."
            )
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    header: list[int] = []
    for t in tensors:
        sizes = list(t.shape) + [0] * (MAX_NDIM - t.dim())
        header += [_DTYPES.index(t.dtype), t.dim()]
        header += [(s // _BASE**d) % _BASE for s in sizes for d in range(DIGITS)]
    head = torch.tensor(header, dtype=dtype, device=tensors[0].device)
    return torch.cat([head] + [_flat(t, dtype) for t in tensors])


def _flat(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a flat ``dtype`` tensor: cast if floating, else its bytes (zero-padded) reinterpreted."""
    if t.is_floating_point():
        return t.to(dtype).reshape(-1)
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -raw.numel() % dtype.itemsize
    return torch.cat([raw, raw.new_zeros(pad)]).view(dtype)


def _slots(numel: int, code: int, dtype: torch.dtype) -> int:
    """Elements of the packed ``dtype`` a tensor of ``numel`` elements of ``_DTYPES[code]`` takes."""
    if _DTYPES[code].is_floating_point:
        return numel
    return -(-numel * _DTYPES[code].itemsize // dtype.itemsize)


def unpack(flat: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The ``count`` tensors :func:`pack` put in ``flat``, as differentiable views of it."""
    n = header_length(count)
    header = [int(v) for v in flat[:n].tolist()]
    out, offset = [], n
    for i in range(count):
        code, ndim, *digits = header[i * _PER_TENSOR:(i + 1) * _PER_TENSOR]
        sizes = [sum(digits[k * DIGITS + d] * _BASE**d for d in range(DIGITS)) for k in range(ndim)]
        numel = 1
        for s in sizes:
            numel *= s
        slots = _slots(numel, code, flat.dtype)
        piece = flat[offset:offset + slots]
        if _DTYPES[code].is_floating_point:
            out.append(piece.view(sizes).to(_DTYPES[code]))
        else:  # its bytes, copied to storage of its own (aligned for the integer dtype)
            raw = piece.detach().view(torch.uint8)[: numel * _DTYPES[code].itemsize].clone()
            out.append(raw.view(_DTYPES[code]).view(sizes))
        offset += slots
    return out
