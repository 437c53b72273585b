"""Persistence into a mapped file: bytes land in the file and the checksum is the chunk's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pcframe.kernels import ALGORITHMS, MappedFile, checksum, flush_mmap, persist_chunk_mmap

from .helpers import make


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_persisted_chunks_reach_the_file_with_their_checksums(
    tmp_path: Path, backend: str, algo: str
) -> None:
    path = tmp_path / "slot.bin"
    chunks = [
        (0, make(torch.uint8, (40_000,), seed=1)),
        (40_003, make(torch.float32, (1001,), seed=2)),  # unaligned offset, 4004 bytes
        (45_000, make(torch.bfloat16, (7, 3), seed=3, strided=True)),
        (46_000, torch.empty(0)),
    ]
    expected = np.zeros(50_000, dtype=np.uint8)
    with MappedFile(path, 50_000) as region:
        for offset, chunk in chunks:
            raw = chunk.contiguous().reshape(-1).view(torch.uint8).numpy()
            value = persist_chunk_mmap(region, offset, chunk, algo=algo, backend=backend)
            assert value == checksum(raw.tobytes(), algo)
            expected[offset : offset + raw.size] = raw
        region.flush()
    assert path.read_bytes() == expected.tobytes()


def test_region_can_be_a_tensor_view_and_flush_a_subrange(tmp_path: Path) -> None:
    with MappedFile(tmp_path / "f.bin", 3 * 4096) as region:
        view = region.tensor[4096:]
        data = bytes(range(256)) * 8
        value = persist_chunk_mmap(view, 100, data, flush=True)
        flush_mmap(view, 100, len(data))
        assert value == checksum(data)
        del view
    assert (tmp_path / "f.bin").read_bytes()[4196 : 4196 + len(data)] == data


def test_existing_file_is_mapped_whole(tmp_path: Path) -> None:
    path = tmp_path / "old.bin"
    path.write_bytes(b"x" * 5000)
    with MappedFile(path, create=False) as region:
        assert region.size == 5000 and bytes(region.array[:3]) == b"xxx"


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    with MappedFile(tmp_path / "g.bin", 4096) as region:
        with pytest.raises(ValueError, match="exceeds"):
            persist_chunk_mmap(region, 4000, b"y" * 100)
        with pytest.raises(ValueError, match="host"):
            persist_chunk_mmap(region, 0, torch.empty(4, device="meta"))
        with pytest.raises(ValueError, match="no 'triton' backend"):
            persist_chunk_mmap(region, 0, b"y", backend="triton")
        with pytest.raises(ValueError, match="unknown checksum"):
            persist_chunk_mmap(region, 0, b"y", algo="sha1")
    with pytest.raises(ValueError, match="closed"):
        persist_chunk_mmap(region, 0, b"y")
