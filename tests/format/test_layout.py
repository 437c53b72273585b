"""The data file's layout cut into chunks: which bytes of which tensor each chunk holds.

(Formerly tests of ``pcframe.kernels.Layout``, a second layout class the kernels had; the
engine's :class:`pcframe.format.layout.Layout` is the one that cuts chunks.)
"""

from __future__ import annotations

import torch

from pcframe.format.layout import Layout


def _three() -> list[tuple[str, torch.Tensor]]:
    # 40, 24 and 5 bytes; with 24-byte alignment at offsets 0, 48 and 72 (77 bytes in all).
    return [
        ("a", torch.zeros(10)),
        ("b", torch.zeros(3, dtype=torch.float64)),
        ("c", torch.zeros(5, dtype=torch.int8)),
    ]


def test_chunk_pieces_cover_the_layout_exactly() -> None:
    tensors = _three()
    layout = Layout.build(tensors, chunk_bytes=30, align=24)
    assert [e.offset for e in layout.entries] == [0, 48, 72]
    got = layout.chunks[1].pieces  # bytes [30, 60)
    assert [(p.src_start, p.dst_start, p.nbytes) for p in got] == [(30, 0, 10), (0, 18, 12)]
    assert tensors[got[1].entry][1] is tensors[1][1]


def test_chunks_skip_padding_and_cover_every_tensor_byte() -> None:
    tensors = _three()
    assert Layout.build(tensors, chunk_bytes=16, align=24).data_size == 77
    chunks = Layout.build(tensors, chunk_bytes=16, align=24).chunks
    covered = sum(p.nbytes for c in chunks for p in c.pieces)
    assert covered == 40 + 24 + 5
    assert Layout.build(tensors, chunk_bytes=8, align=24).chunks[5].pieces == ()  # [40, 48)
