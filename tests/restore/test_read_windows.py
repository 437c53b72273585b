"""The reader hashes each chunk a window at a time: every byte still lands where it belongs.

A chunk is read in windows (``READ_WINDOW``) and the checksum consumes them in order, the
bytes only the checksum needs sharing one scratch window. These tests shrink the window to
odd sizes so that windows split tensors, padding and pcf64's 8-byte words, then check that
what is restored is bit-identical, that a flipped byte anywhere is still caught, and that a
partial read (another rank's tensors) gets exactly its bytes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import pcframe.restore.chunk_io as reading
import pcframe.restore.reader as reader
from pcframe import Checkpointer
from pcframe.errors import NoValidCheckpoint
from pcframe.format.manifest import MANIFEST_NAME, read_manifest

WINDOWS = (1000, 3 * 4096 + 5)  # neither a page nor a word multiple


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Odd sizes: tensors end mid-page, so the chunks hold alignment padding between them.
    return torch.nn.Sequential(torch.nn.Linear(97, 131), torch.nn.Linear(131, 3))


def _trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 97)).sum().backward()
    optimizer.step()
    return optimizer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, values in optimizer.state_dict()["state"].items():
        state |= {f"optimizer/state/{i}/{k}": v.clone() for k, v in values.items()}
    return state


def _save(directory: Path, checksum: str, versions: int = 1) -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = _trained(model)
    options = {"checksum": checksum, "chunk_bytes": 16384}  # several tensors per chunk
    with Checkpointer(directory, model=model, optimizer=optimizer, **options) as ckpt:
        for step in range(1, versions + 1):
            ckpt.save(step)
            ckpt.wait()
    return _state(model, optimizer)


def _newest(directory: Path) -> Path:
    return max(p for p in directory.iterdir() if p.name.startswith("v"))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("checksum", ["crc32c", "pcf64", "xxh3_64"])
@pytest.mark.parametrize("into", ["live", "fresh"])
def test_restore_is_bit_identical_whatever_the_window(
    tmp_path, monkeypatch, window, checksum, into
):
    monkeypatch.setattr(reading, "READ_WINDOW", window)
    saved = _save(tmp_path, checksum)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if into == "live":  # in-place targets: verified through scratch, filled afterwards
        optimizer = _trained(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() == 1
    restored = _state(model, optimizer)
    assert restored.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("checksum", ["crc32c", "pcf64"])
def test_a_flipped_byte_in_any_window_is_caught(tmp_path, monkeypatch, window, checksum):
    monkeypatch.setattr(reading, "READ_WINDOW", window)
    # The first window, one straddling a window boundary, and the file's last byte.
    for offset in (3, window - 1, window, -1):
        directory = tmp_path / str(offset)
        _save(directory, checksum)
        data = _newest(directory) / "data.bin"
        damaged = bytearray(data.read_bytes())
        damaged[offset] ^= 0x10
        data.write_bytes(damaged)
        model = _model()
        optimizer = _trained(model)
        before = _state(model, optimizer)
        with (
            Checkpointer(directory, model=model, optimizer=optimizer) as ckpt,
            pytest.raises(NoValidCheckpoint),
        ):
            ckpt.restore()
        after = _state(model, optimizer)
        assert all(torch.equal(after[k], v) for k, v in before.items()), offset


def test_a_partial_read_gets_exactly_its_tensors(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "READ_WINDOW", 1000)
    saved = _save(tmp_path, "crc32c")
    directory = _newest(tmp_path)
    manifest = read_manifest(str(directory / MANIFEST_NAME))
    names = [entry.name for entry in manifest.entries]
    wanted = [i for i, name in enumerate(names) if name.endswith(("weight", "exp_avg_sq"))]
    tensors = reader.read_entries(directory, manifest, wanted, threads=2)
    assert sorted(tensors) == wanted
    assert len(wanted) == 6  # two weights, four parameters' exp_avg_sq
    for i in wanted:
        assert torch.equal(tensors[i], saved[names[i]]), names[i]


def _resident(view: memoryview) -> int:
    """Pages of ``view`` in memory (mincore), page-aligned interior only."""
    page = mmap.PAGESIZE
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    start = -(-address // page) * page
    pages = (address + len(view)) // page - start // page
    flags = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(start, pages * page, flags) == 0, ctypes.get_errno()
    return sum(f & 1 for f in flags)


def test_prefault_maps_the_pages_of_new_memory_in_one_call():
    # Reading into new tensors faulted a page in at a time; prefault maps them in one call.
    # New anonymous memory (as the allocator's for a large tensor): no page is mapped yet.
    fresh = memoryview(mmap.mmap(-1, 16 << 20))
    assert _resident(fresh) == 0
    release = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    if release < (5, 14):
        pytest.skip(f"Linux {os.uname().release} has no MADV_POPULATE_WRITE (5.14)")
    assert reading.prefault(fresh)
    assert _resident(fresh) == (16 << 20) // mmap.PAGESIZE
    assert not reading.prefault(fresh[: 4 * mmap.PAGESIZE])  # too small to be worth a call


def test_a_restore_prefaults_the_new_tensors_it_reads_into_and_never_the_live_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    asked: list[tuple[int, int]] = []  # (address, bytes) of every view prefaulted

    def recorded(view: memoryview) -> bool:
        asked.append((np.frombuffer(view, dtype=np.uint8).ctypes.data, len(view)))
        return reading.prefault(view)

    monkeypatch.setattr(reader, "prefault", recorded)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 1024)).sum().backward()
    optimizer.step()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(1)
    # a restarted job: its model is live (read in place), its optimizer has no state yet
    fresh_model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512))
    fresh_optimizer = torch.optim.Adam(fresh_model.parameters())
    with Checkpointer(tmp_path, model=fresh_model, optimizer=fresh_optimizer) as ckpt:
        assert ckpt.restore() == 1

    def span(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    def inside(t: torch.Tensor) -> bool:
        low, high = span(t)
        return any(low <= address and address + n <= high for address, n in asked)

    for live in fresh_model.parameters():
        low, high = span(live)
        assert not any(address < high and low < address + n for address, n in asked)
    moments = [
        value
        for state in fresh_optimizer.state.values()
        for key, value in state.items()
        if key != "step"
    ]
    assert moments and all(inside(m) for m in moments if m.numel() * 4 >= 64 << 10)
    for old, new in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(old, new)
        for key, value in optimizer.state[old].items():
            assert torch.equal(fresh_optimizer.state[new][key], value)
