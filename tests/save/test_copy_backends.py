"""Copy-stage backends (torch, numba, triton, auto) and the pcf64 checksum through the engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pcframe import Checkpointer, ConfigError, EngineConfig
from pcframe.format.manifest import read_manifest
from pcframe.kernels import checksum
from tests.helpers import small_training, state_equal, train_steps

DIGITS = {"crc32c": 8, "pcf64": 16, "xxh3_64": 16}


def recomputed_checksums_match(version_dir) -> None:
    """Every chunk's recorded checksum equals an independent one over the bytes on disk."""
    manifest = read_manifest(str(version_dir / "manifest.json"))
    data = (version_dir / "data.bin").read_bytes()
    assert len(data) == manifest.data_size
    for chunk in manifest.chunks:
        expected = checksum(data[chunk.offset : chunk.offset + chunk.length], manifest.checksum)
        assert chunk.checksum == f"{expected:0{DIGITS[manifest.checksum]}x}", chunk


@pytest.mark.parametrize("algo", ["crc32c", "pcf64"])
@pytest.mark.parametrize("backend", ["torch", "numba", "auto"])
def test_backends_round_trip_and_checksums_are_right(tmp_path, backend, algo):
    model, optimizer, scheduler = small_training()
    train_steps(model, optimizer, scheduler, 2)
    transposed = {"t": torch.randn(40, 30).t()}  # strided source tensor

    class Holder:
        def state_dict(self):
            return transposed

        def load_state_dict(self, state):
            transposed.update(state)

    expected_t = transposed["t"].clone()
    with Checkpointer(
        tmp_path,
        model=model,
        optimizer=optimizer,
        stateful={"h": Holder()},
        copy_backend=backend,
        checksum=algo,
        chunk_bytes=4096,  # several chunks, tensors split across chunk boundaries
    ) as ckpt:
        ckpt.save(step=2).wait()
    recomputed_checksums_match(tmp_path / "v00000001")
    model2, optimizer2, _ = small_training(seed=3)
    transposed["t"] = torch.zeros(30, 40)
    with Checkpointer(
        tmp_path, model=model2, optimizer=optimizer2, stateful={"h": Holder()}
    ) as ckpt:
        assert ckpt.restore() == 2
    assert state_equal(model2.state_dict(), model.state_dict())
    assert state_equal(optimizer2.state_dict()["state"], optimizer.state_dict()["state"])
    assert torch.equal(transposed["t"], expected_t)


def test_numba_with_pcf64_checksums_in_the_copy_pass(tmp_path, monkeypatch):
    """Every chunk's pcf64 comes from the copy, never from a second pass in the writer."""
    from pcframe.save.copy import Copier

    calls = []
    host = Copier.fill_host

    def host_spy(self, *args, checksum):
        calls.append(checksum)
        return host(self, *args, checksum=checksum)

    monkeypatch.setattr(Copier, "fill_host", host_spy)
    model = torch.nn.Linear(64, 64)
    with Checkpointer(
        tmp_path, model=model, copy_backend="numba", checksum="pcf64", chunk_bytes=4096
    ) as ckpt:
        ckpt.save(step=1).wait()
    manifest = read_manifest(str(tmp_path / "v00000001" / "manifest.json"))
    recomputed_checksums_match(tmp_path / "v00000001")
    assert calls == [True] * len(manifest.chunks)


@pytest.mark.parametrize("backend", ["auto", "numba"])
@pytest.mark.parametrize("algo", ["crc32c", "pcf64"])
def test_the_host_kernel_stages_the_bytes_the_torch_reference_does(tmp_path, algo, backend):
    """Many small tensors, tensors cut by chunk boundaries, alignment gaps, a strided tensor
    and an empty one: the host kernel (a whole chunk per call) writes the same data.bin,
    byte for byte, as Tensor.copy_ per piece, and the checksums are the bytes'."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(9, 7) for _ in range(40)])  # odd sizes
    optimizer = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    strided = {"t": torch.randn(40, 30).t(), "empty": torch.zeros(0, 3), "b": torch.ones(3)}

    class Holder:
        def state_dict(self):
            return strided

        def load_state_dict(self, state):
            strided.update(state)

    data = {}
    for method in ("torch", backend):
        with Checkpointer(
            tmp_path / method,
            model=model,
            optimizer=optimizer,
            stateful={"h": Holder()},
            copy_backend=method,
            checksum=algo,
            chunk_bytes=4096,
            tensor_align=64,
        ) as ckpt:
            assert ckpt._pipeline.copier.host_kernel == (method != "torch")
            ckpt.save(step=1).wait()
        version = tmp_path / method / "v00000001"
        recomputed_checksums_match(version)
        data[method] = (version / "data.bin").read_bytes()
    assert data[backend] == data["torch"]
    model2 = torch.nn.Sequential(*[torch.nn.Linear(9, 7) for _ in range(40)])
    with Checkpointer(tmp_path / backend, model=model2) as ckpt:
        ckpt.restore(strict=False)
    assert state_equal(model2.state_dict(), model.state_dict())


def test_pcf64_detects_a_flipped_bit(tmp_path):
    model = torch.nn.Linear(32, 32)
    with Checkpointer(tmp_path, model=model, checksum="pcf64", copy_backend="numba") as ckpt:
        ckpt.save(step=1).wait()
        ckpt.save(step=2).wait()
    path = tmp_path / "v00000002" / "data.bin"
    data = bytearray(path.read_bytes())
    data[100] ^= 0x08
    path.write_bytes(bytes(data))
    with Checkpointer(tmp_path, model=torch.nn.Linear(32, 32)) as ckpt:
        assert ckpt.restore() == 1
        assert "checksum mismatch in chunk 0" in ckpt.last_restore.skipped[0][1]


def test_an_unavailable_backend_is_refused_at_construction(tmp_path, monkeypatch):
    import pcframe.kernels.dispatch as dispatch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"engine\.copy_backend='triton' cannot run"):
            Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), copy_backend="triton")
    monkeypatch.setattr(dispatch, "has_numba", lambda: False)
    with pytest.raises(ConfigError, match=r"copy_backend='numba'.*numba cannot be imported"):
        Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), copy_backend="numba")
    with pytest.raises(ConfigError, match=r"copy_backend='cuda' is invalid.*torch, numba"):
        EngineConfig(copy_backend="cuda")
    # Nothing was opened: the directory is free for the next writer.
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), copy_backend="auto") as ckpt:
        ckpt.save(step=1).wait()


TRITON_CHILD = r"""
import sys, torch
from pcframe import Checkpointer
from pcframe.restore.reader import load_version
torch.manual_seed(0)
model = torch.nn.Linear(48, 40)
with Checkpointer(sys.argv[1], model=model, copy_backend="triton", checksum=sys.argv[2],
                  chunk_bytes=4096) as ckpt:
    ckpt.save(step=1).wait()
named = load_version(sys.argv[1] + "/v00000001").named_tensors()
assert torch.equal(named["model/weight"], model.weight.detach())
print("ok")
"""


@pytest.mark.parametrize("algo", ["crc32c", "pcf64"])
@pytest.mark.slow
def test_triton_backend_on_cpu_through_its_interpreter(tmp_path, python, child_env, algo):
    """CPU twin of the GPU test: the Triton copy kernels run in Triton's interpreter."""
    pytest.importorskip("triton")
    child_env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [python, "-c", TRITON_CHILD, str(tmp_path), algo],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
    recomputed_checksums_match(tmp_path / "v00000001")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("algo", ["crc32c", "pcf64"])
@pytest.mark.parametrize("backend", ["triton", "auto"])  # auto: the GPU's copy engine
def test_triton_backend_with_cuda_tensors(tmp_path, algo, backend):
    model = torch.nn.Linear(256, 256).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    optimizer.step()
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, copy_backend=backend, checksum=algo
    ) as ckpt:
        ckpt.save(step=1)
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer.step()  # gated: must not leak into the snapshot
        ckpt.wait()
    recomputed_checksums_match(tmp_path / "v00000001")
    model2 = torch.nn.Linear(256, 256).cuda()
    with Checkpointer(tmp_path, model=model2) as ckpt:
        ckpt.restore()
    assert state_equal(model2.state_dict(), snapshot)


def test_pcf64_over_several_buffers_equals_pcf64_of_their_concatenation():
    """The loader verifies a chunk read into many pieces; words straddle piece boundaries."""
    import numpy as np

    from pcframe.kernels.checksum import pcf64_buffers

    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(0, 40, size=rng.integers(1, 7))
        parts = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]
        whole = np.concatenate(parts)
        assert pcf64_buffers([memoryview(p) for p in parts]) == checksum(whole, "pcf64")
    assert pcf64_buffers([]) == checksum(b"", "pcf64")


def test_a_kernel_backend_copies_host_tensors_it_cannot_read_with_torch(monkeypatch):
    """CPU twin: a pageable host tensor in a chunk for compiled Triton (an RNG state, a
    non-fused optimizer's step beside CUDA weights) is copied by the torch reference, and
    its fused pcf64 is still the checksum of the staged bytes."""
    import pcframe.save.copy as copy_stage

    monkeypatch.setattr(copy_stage, "triton_interpreting", lambda: False, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # compiled Triton
    source = torch.arange(1000, dtype=torch.float32)
    flat = source.view(torch.uint8)
    view = torch.full((4096 + 128,), 7, dtype=torch.uint8)
    pieces = [(flat, 0, 0, 4000)]
    copier = copy_stage.Copier("triton", "pcf64")
    value = copier.fill(pieces, view, None, checksum=True)
    assert torch.equal(view[:4000], flat)
    assert not view[4000:].any()  # zero-filled, as the kernel would
    assert value == checksum(view.numpy(), "pcf64")
    assert copy_stage.Copier("numba", "pcf64")._kernel_reads(pieces, view)
    # Pinned host tensors alone (CPU-offloaded parameters) are no CUDA chunk either: compiled
    # Triton has no device to run on, so the torch reference copies them too.
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    assert not copier._kernel_reads(pieces, view)
    view.fill_(7)
    assert copier.fill(pieces, view, None, checksum=True) == value


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_triton_backend_with_host_tensors_beside_cuda_ones(tmp_path, backend):
    """Non-fused Adam keeps its step counts on the CPU, and the RNG states are CPU tensors:
    the Triton copy stage took them for device memory and failed every save (H200 run)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).cuda()
    optimizer = torch.optim.Adam(model.parameters())  # state["step"]: a CPU tensor
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    optimizer.step()
    assert not optimizer.state[model.weight]["step"].is_cuda
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, copy_backend=backend, checksum="pcf64"
    ) as ckpt:
        ckpt.save(step=1).wait()
    recomputed_checksums_match(tmp_path / "v00000001")
    model2 = torch.nn.Linear(256, 256).cuda()
    optimizer2 = torch.optim.Adam(model2.parameters())
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2) as ckpt:
        ckpt.restore()
    assert state_equal(model2.state_dict(), model.state_dict())
    assert optimizer2.state[model2.weight]["step"].item() == 1


def test_the_host_kernel_reads_only_tensors_whose_bytes_are_their_values():
    """A raw memcpy makes none of Tensor.copy_'s checks: conjugate and negative views (their
    bytes are not their values), a storage freed to fewer bytes, strided and non-host
    tensors take the per-piece path; a view at an offset is read from its own first byte."""
    from pcframe.save.copy import host_address

    base = torch.arange(12, dtype=torch.float32)
    complex_ = torch.randn(4, dtype=torch.complex64)
    freed = torch.ones(8)
    freed.untyped_storage().resize_(0)  # what sharded training does to gathered params
    tensors = [
        base,
        base[4:],
        complex_.conj(),
        torch._neg_view(base),
        freed,
        torch.randn(3, 4).t(),
        torch.empty(3, device="meta"),
    ]
    addresses = [host_address(t) for t in tensors]
    assert addresses[:2] == [base.data_ptr(), base.data_ptr() + 16]
    assert addresses[2:] == [-1] * 5


NO_NUMBA_CHILD = r"""
import sys, torch
from pcframe import Checkpointer
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(30)])
with Checkpointer(sys.argv[1], model=model, chunk_bytes=4096) as ckpt:
    ckpt.save(step=1).wait()
    ckpt.save(step=2).wait()
print("numba" in sys.modules)
"""


def test_the_default_copy_stage_does_not_load_numba(tmp_path):
    """Numba and its compiler hold about 125 MiB of host memory: the default copy (ctypes
    memmove from the address tables) must not bring them in."""
    result = subprocess.run(
        [sys.executable, "-c", NO_NUMBA_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_numba_is_accepted_on_a_machine_with_a_gpu(monkeypatch):
    """Numba copies the host chunks; a CUDA state's chunks go to the copy engine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    EngineConfig(copy_backend="numba").check_runtime()
