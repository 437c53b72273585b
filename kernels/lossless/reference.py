"""Byte shuffle in plain torch: the specification and the fallback.

For n elements of ``itemsize`` bytes, ``shuffled[k * n + i] = byte k of element i``: all
first bytes, then all second bytes, ... Exponent and sign bytes of floats cluster into
long, repetitive runs that zstd compresses far better than the interleaved original.
"""

from __future__ import annotations

import torch


def shuffle(data: torch.Tensor, itemsize: int, out: torch.Tensor) -> None:
    """Shuffle flat uint8 ``data`` holding elements of ``itemsize`` bytes into ``out``."""
    out.view(itemsize, -1).copy_(data.view(-1, itemsize).t())


def unshuffle(data: torch.Tensor, itemsize: int, out: torch.Tensor) -> None:
    """Inverse of :func:`shuffle`."""
    out.view(-1, itemsize).copy_(data.view(itemsize, -1).t())
