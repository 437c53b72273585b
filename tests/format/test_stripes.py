"""A version's data.bin striped over several files (engine.stripes, pcframe.format.stripes)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pcframe import Checkpointer, ConfigError, EngineConfig
from pcframe.errors import CorruptCheckpoint, ManifestError, UnsupportedCheckpoint
from pcframe.format.manifest import parse_body, read_manifest
from pcframe.format.stripes import stored_data_bytes, stripe_location, stripe_sizes
from pcframe.kernels import checksum
from pcframe.restore.reader import load_version
from pcframe.save import persist
from pcframe.store.mounts import Mount
from tests.helpers import flip_byte, small_training, state_equal, train_steps

CHUNK = 4096


def _saved(directory, stripes, steps=(1, 2), **kw):
    model, optimizer, scheduler = small_training()
    with Checkpointer(
        directory,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        chunk_bytes=CHUNK,  # the small model's ~7 KiB of Adam state: a few chunks
        stripes=stripes,
        **kw,
    ) as ckpt:
        for s in steps:
            train_steps(model, optimizer, scheduler, 1, seed=s)
            ckpt.save(step=s).wait()
    return model, optimizer


def test_a_striped_version_spreads_its_chunks_and_restores_bit_identically(tmp_path):
    model, optimizer = _saved(tmp_path, stripes=3)
    version = tmp_path / "v00000002"
    manifest = read_manifest(str(version / "manifest.json"))
    assert manifest.stripes == 3 and len(manifest.chunks) >= 3
    header = json.loads((version / "manifest.json").read_bytes().split(b"\n")[0])
    assert header["format_version"] == 4
    names = sorted(p.name for p in version.iterdir() if p.name.startswith("data"))
    assert names == ["data.1.bin", "data.2.bin", "data.bin"]
    sizes = stripe_sizes(manifest.data_size, CHUNK, 3)
    assert [os.path.getsize(version / n) for n in ("data.bin", "data.1.bin", "data.2.bin")] == sizes
    assert stored_data_bytes(version) == manifest.data_size
    # every chunk's recorded checksum matches the bytes where the stripes put it
    for index, record in enumerate(manifest.chunks):
        stripe, local = stripe_location(record.offset, CHUNK, 3)
        name = "data.bin" if stripe == 0 else f"data.{stripe}.bin"
        with open(version / name, "rb") as f:
            f.seek(local)
            data = f.read(record.length)
        assert record.checksum == f"{checksum(data, manifest.checksum):08x}", index
    model2, optimizer2, scheduler2 = small_training(seed=5)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2, scheduler=scheduler2) as c:
        assert c.restore() == 2
    assert state_equal(model2.state_dict(), model.state_dict())
    assert state_equal(optimizer2.state_dict(), optimizer.state_dict())


def test_one_stripe_is_the_unstriped_format(tmp_path):
    _saved(tmp_path, stripes=1)
    version = tmp_path / "v00000002"
    assert not (version / "data.1.bin").exists()
    header = json.loads((version / "manifest.json").read_bytes().split(b"\n")[0])
    assert header["format_version"] == 1  # readable by every pcframe
    manifest = json.loads((version / "manifest.json").read_bytes().split(b"\n", 1)[1])
    assert "stripes" not in manifest["files"]["data.bin"]


def test_auto_stripes_one_file_per_writer_on_tmpfs_and_one_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setattr(persist, "mount_of", lambda path: Mount("/dev/shm", "tmpfs", "rw"))
    assert persist.choose_stripes(tmp_path, 0, writers=4) == 4
    assert persist.choose_stripes(tmp_path, 2, writers=4) == 2  # as configured
    assert persist.choose_stripes(tmp_path, 0, writers=64) == persist.AUTO_STRIPES_MAX
    monkeypatch.setattr(persist, "mount_of", lambda path: Mount("/", "ext4", "rw"))
    assert persist.choose_stripes(tmp_path, 0, writers=4) == 1
    # never more files than chunks: a one-chunk version is one data.bin
    monkeypatch.setattr(persist, "mount_of", lambda path: Mount("/dev/shm", "tmpfs", "rw"))
    for width, files in ((4, 1), (128, 4)):  # 4x4 weights: one chunk with the RNG states
        directory = tmp_path / str(width)
        model = torch.nn.Linear(width, width)
        with Checkpointer(directory, model=model, chunk_bytes=CHUNK * 4, writer_threads=4) as c:
            c.save(step=1).wait()
        manifest = read_manifest(str(directory / "v00000001" / "manifest.json"))
        assert manifest.stripes == min(4, len(manifest.chunks)) == files
        data = [p for p in (directory / "v00000001").iterdir() if p.name.startswith("data")]
        assert len(data) == files


def test_a_damaged_stripe_falls_back_to_the_previous_version_naming_the_file(tmp_path):
    _saved(tmp_path, stripes=3)
    flip_byte(tmp_path / "v00000002" / "data.2.bin", 5)
    model, optimizer, scheduler = small_training(seed=5)
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler) as c:
        assert c.restore() == 1
        reason = c.last_restore.skipped[0][1]
    assert "data.2.bin" in reason and "checksum mismatch" in reason


def test_a_missing_or_short_stripe_is_damage_not_a_crash(tmp_path):
    _saved(tmp_path, stripes=3)
    (tmp_path / "v00000002" / "data.1.bin").unlink()
    os.truncate(tmp_path / "v00000001" / "data.2.bin", 10)
    with pytest.raises(CorruptCheckpoint, match=r"data\.1\.bin"):
        load_version(tmp_path / "v00000002")
    with pytest.raises(CorruptCheckpoint, match=r"data\.2\.bin"):
        load_version(tmp_path / "v00000001")


def test_a_pcframe_without_stripes_says_upgrade(tmp_path, monkeypatch):
    import pcframe.format.manifest as manifest_module

    _saved(tmp_path, stripes=2, steps=(1,))
    monkeypatch.setattr(manifest_module, "READABLE_VERSIONS", (1, 2, 3))
    with pytest.raises(UnsupportedCheckpoint, match=r"format_version 4 .*upgrade"):
        load_version(tmp_path / "v00000001")


def test_the_manifest_refuses_stripes_it_cannot_hold(tmp_path):
    _saved(tmp_path, stripes=2, steps=(1,))
    text = (tmp_path / "v00000001" / "manifest.json").read_bytes().split(b"\n", 1)[1]
    body = json.loads(text)
    assert parse_body(body, format_version=4).stripes == 2
    with pytest.raises(ManifestError, match="stripes needs format version 4"):
        parse_body(body, format_version=3)
    chunks = len(body["files"]["data.bin"]["chunks"])
    for bad in (0, chunks + 1, "2", True, 2.0):
        body["files"]["data.bin"]["stripes"] = bad
        with pytest.raises(ManifestError, match="stripes must be an integer"):
            parse_body(body, format_version=4)


def test_stripes_with_codecs_and_deltas(tmp_path):
    codecs = {"optimizer/state/*/exp_avg_sq": "xor_delta_zstd", "model/*": "zstd"}
    model, optimizer = _saved(tmp_path, stripes=2, steps=(1, 2, 3), codecs=codecs)
    manifest = read_manifest(str(tmp_path / "v00000003" / "manifest.json"))
    assert manifest.stripes == 2 and manifest.delta is not None
    model2, optimizer2, scheduler2 = small_training(seed=5)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2, scheduler=scheduler2) as c:
        assert c.restore() == 3
    assert state_equal(model2.state_dict(), model.state_dict())
    assert state_equal(optimizer2.state_dict(), optimizer.state_dict())


def test_stripes_is_checked_like_every_engine_key():
    with pytest.raises(ConfigError, match=r"engine\.stripes=-1 .*0 \(auto\)"):
        EngineConfig(stripes=-1)
    with pytest.raises(ConfigError, match=r"engine\.stripes='4'"):
        EngineConfig(stripes="4")


def test_closing_a_striped_file_closes_every_stripe_when_one_close_fails(tmp_path):
    striped = persist.StripedFile(tmp_path, 5 * CHUNK, CHUNK, 3, "off")
    fds = [f.fd for f in striped.files]
    os.close(fds[0])  # the first close now fails (EBADF), as an NFS close can (EIO)
    with pytest.raises(OSError):
        striped.close()
    for fd in fds[1:]:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed


def test_stripe_sizes_add_up_the_chunks_each_stripe_holds():
    for data_size in (0, 1, 4095, 4096, 4097, 5 * 4096, 5 * 4096 + 17, 11 * 4096 - 1):
        for stripes in (1, 2, 3, 7):
            walked = [0] * stripes
            for offset in range(0, data_size, CHUNK):
                stripe, local = stripe_location(offset, CHUNK, stripes)
                length = min(CHUNK, data_size - offset)
                assert local + length <= stripe_sizes(data_size, CHUNK, stripes)[stripe]
                walked[stripe] += length
            assert stripe_sizes(data_size, CHUNK, stripes) == walked, (data_size, stripes)
