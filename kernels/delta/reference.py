"""XOR delta in plain torch: the specification and the fallback.

``delta = bytes(cur) XOR bytes(prev)`` over the logical bytes, and
``bytes(cur) = delta XOR bytes(prev)``: exactly invertible for every dtype (NaN
payloads, signed zeros and all). Unchanged bytes become 0, which the lossless pass
after it (byte shuffle + zstd) compresses to almost nothing.
"""

from __future__ import annotations

import torch


def xor_bytes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a XOR b`` for 1-D uint8 tensors of equal length."""
    torch.bitwise_xor(a, b, out=out)
