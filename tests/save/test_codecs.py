"""Codecs per tensor group through the real engine: format, round trips, bounds, gate, errors."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch

from pcframe import Checkpointer, ConfigError, ManifestError, SaveError
from pcframe.format.manifest import read_manifest
from pcframe.kernels import dequantize_blockwise, quantize_blockwise
from pcframe.restore.reader import load_version
from pcframe.save.fill import Filler
from tests.helpers import small_training, state_equal, train_steps

MOMENTS = "optimizer/state/*/exp_avg*"


def header(version_dir):
    return json.loads((version_dir / "manifest.json").read_bytes().split(b"\n", 1)[0])


def big_training(seed: int = 0):
    """Weights larger than a 4 KiB chunk, so coded tensors span several segments."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(16, 64)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_lossless_codecs_round_trip_bit_exact(tmp_path):
    model, optimizer = big_training()
    codecs = {"model/*": "zstd", MOMENTS: {"codec": "zstd", "level": 1}, "rng/*": "raw"}
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, codecs=codecs, chunk_bytes=4096
    ) as ckpt:
        ckpt.save(step=1).wait()
    version = tmp_path / "v00000001"
    assert header(version)["format_version"] == 2
    manifest = read_manifest(str(version / "manifest.json"))
    codec_of = {e.name: e.codec for e in manifest.entries}
    assert codec_of["model/0.weight"] == "zstd" and codec_of["optimizer/state/0/step"] == "raw"
    assert codec_of["rng/torch"] == "raw"  # the first matching rule wins, "raw" included
    weight = next(i for i, e in enumerate(manifest.entries) if e.name == "model/0.weight")
    assert len(manifest.segments[weight]) > 1  # 24 KiB of fp32 in 4 KiB segments
    model2, optimizer2 = big_training(seed=3)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2) as ckpt:
        assert ckpt.restore() == 1
    assert state_equal(model2.state_dict(), model.state_dict())
    assert state_equal(optimizer2.state_dict()["state"], optimizer.state_dict()["state"])


def test_default_stays_raw_format_1(tmp_path):
    with Checkpointer(tmp_path, model=torch.nn.Linear(4, 4)) as ckpt:
        ckpt.save(step=1).wait()
    assert header(tmp_path / "v00000001")["format_version"] == 1
    assert not (tmp_path / "v00000001" / "codec.bin").exists()


@pytest.mark.parametrize(("codec", "fmt"), [("int8_block", "int8"), ("fp8_block", "fp8_e4m3")])
def test_lossy_moments_stay_within_the_recorded_bound(tmp_path, codec, fmt):
    model, optimizer = big_training()
    saved = {k: {n: v.clone() for n, v in s.items()} for k, s in optimizer.state.items()}
    block = 64
    codecs = {MOMENTS: {"codec": codec, "block_size": block}}
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, codecs=codecs, chunk_bytes=4096
    ) as ckpt:
        ckpt.save(step=1).wait()
    manifest = read_manifest(str(tmp_path / "v00000001" / "manifest.json"))
    model2, optimizer2 = big_training(seed=5)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2) as ckpt:
        ckpt.restore()
    assert state_equal(model2.state_dict(), model.state_dict())  # weights untouched: raw
    moments_bytes = 0
    for index, (param, state) in enumerate(zip(model2.parameters(), saved.values(), strict=True)):
        for name in ("exp_avg", "exp_avg_sq"):
            original, restored = state[name], optimizer2.state[param][name]
            bound = manifest.error_bound(f"optimizer/state/{index}/{name}")
            error = (original - restored).abs().max().item()
            assert 0 < bound < original.abs().max().item()
            assert error <= bound
            # Segments start on quantization blocks: identical to quantizing the whole tensor.
            whole = dequantize_blockwise(quantize_blockwise(original, fmt, block))
            assert torch.equal(restored, whole)
            moments_bytes += original.numel() * 4
        assert torch.equal(optimizer2.state[param]["step"], state["step"])
    assert manifest.codec_size < moments_bytes * 0.3  # 1-byte codes + a scale per 64


def test_codec_tensors_are_gated_but_encoding_is_not(tmp_path, monkeypatch):
    """optimizer.step() waits for the raw copy of coded tensors, not for their encoding.

    Ordered by events, not sleeps (a step slower than a 0.5 s encode on a busy machine used
    to fail it): the raw copy of the segments starts only once a step waits in the gate, so
    that step is stalled by it; every encode is held until the steps are done, so steps that
    waited for an encode would not return before the 30 s hold (and the test fails).
    The staging pool holds every buffer of the version: with one buffer (the default for a
    state this small: staging_ratio 1.0 rounds up to one 16 MiB chunk) the copy waits for a
    buffer back after each segment, i.e. for its encode, which is the pool's backpressure.
    """
    import pcframe.save.write as pipeline_module

    encode, fill = pipeline_module.encode_segment, Filler.segment
    gated, steps_done = threading.Event(), threading.Event()
    held: list[bool] = []  # per encode: released by the steps being done (else by timeout)

    def held_encode(*args):
        released = steps_done.wait(30.0)
        steps_done.set()  # after a timeout: fail once, not once per segment
        held.append(released)
        return encode(*args)

    def late_fill(self, *args):
        if not gated.wait(30.0):
            gated.set()
            raise AssertionError("no optimizer step waited for the coded tensors' copy")
        time.sleep(0.05)  # the gate's stall is at least this
        fill(self, *args)

    monkeypatch.setattr(pipeline_module, "encode_segment", held_encode)
    monkeypatch.setattr(Filler, "segment", late_fill)
    model, optimizer, scheduler = small_training()
    train_steps(model, optimizer, scheduler, 2)
    codecs = {"model/*": "zstd", MOMENTS: "zstd"}
    staging = {"chunk_bytes": 4096, "staging_bytes": 256 * 4096}
    with Checkpointer(
        tmp_path, model=model, optimizer=optimizer, codecs=codecs, writer_threads=1, **staging
    ) as ckpt:
        gate_waits = ckpt._flight.wait_for_copies

        def waiting_in_the_gate(progresses):
            gated.set()  # after the gate started timing its stall
            gate_waits(progresses)

        ckpt._flight.wait_for_copies = waiting_in_the_gate
        handle = ckpt.save(step=2)
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        moments = {k: v.clone() for k, v in optimizer.state[next(model.parameters())].items()}
        try:
            train_steps(model, optimizer, scheduler, 3)  # waits for late_fill, not held_encode
            assert gated.is_set() and not held, "the steps waited for an encode"
            assert not handle.done()
        finally:
            steps_done.set()
        assert handle.wait() == "committed"
        ckpt.wait()  # records are updated at the next engine call
        assert held and all(held), "an encode was held until its timeout"
        assert ckpt.records[1].stall >= 0.05
    manifest = read_manifest(str(tmp_path / "v00000001" / "manifest.json"))
    buffers = len(manifest.chunks) + sum(len(s) for s in manifest.segments.values())
    assert buffers <= 256, "the pool must stage the whole version for this test"
    model2, optimizer2, _ = small_training(seed=4)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2) as ckpt:
        ckpt.restore()
    assert state_equal(model2.state_dict(), snapshot)
    assert state_equal(optimizer2.state[next(model2.parameters())], moments)


@pytest.mark.parametrize(
    ("codecs", "message"),
    [
        ({"model/*": "pickle"}, r"engine\.codecs.*unknown codec 'pickle'"),
        ({"model/*": {"codec": "zstd", "levle": 3}}, r"engine\.codecs.*rejects options"),
        ({"model/*": {"level": 3}}, r"engine\.codecs.*give a codec name"),
        ({"model/*": {"codec": "int8_block", "block_size": 8192}}, r"block_size 8192 .* fit"),
        # these were accepted and failed at the first save (ZeroDivisionError, a bad type)
        ({"model/*": {"codec": "int8_block", "block_size": 0}}, r"block_size=0 must be in 1"),
        ({"model/*": {"codec": "fp8_block", "block_size": 2.5}}, r"block_size must be an int"),
        # accepted, then every version written with them was refused by the reader (lost)
        ({"model/*": {"codec": "zstd", "level": True}}, r"level must be an integer"),
        ({"model/*": {"codec": "zstd", "shuffle": 0}}, r"shuffle must be True or False"),
        ({"model/*": {"codec": "xor_delta_zstd", "level": 1.0}}, r"level must be an integer"),
        (["model/*"], r"engine\.codecs.*map tensor-name globs"),
    ],
)
def test_bad_codec_config_names_the_key(tmp_path, codecs, message):
    with pytest.raises(ConfigError, match=message):
        Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), codecs=codecs, chunk_bytes=65536)
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)):
        pass  # the failed construction left the directory unlocked


def test_lossy_codec_on_an_integer_tensor_fails_the_save_clearly(tmp_path):
    model, optimizer, scheduler = small_training()
    train_steps(model, optimizer, scheduler, 1)
    with Checkpointer(tmp_path, model=model, codecs={"model/*": "int8_block"}) as ckpt:
        with pytest.raises(SaveError, match=r"'model/\*'.*num_batches_tracked.*int64"):
            ckpt.save(step=1).wait()
        assert ckpt.committed_versions() == []


class Masked(torch.nn.Module):
    def __init__(self, fill: float) -> None:
        super().__init__()
        self.register_buffer("mask", torch.full((300,), fill))


def test_a_lossy_codec_refuses_values_at_the_dtype_limit_at_save(tmp_path):
    """A finfo.min mask under int8_block: 127 * fl(FLT_MAX / 127) rounds to infinity, so the
    version committed and every restore set it aside as corrupt (NoValidCheckpoint: all work
    lost). fp8_block's 448 * fl(FLT_MAX / 448) stays finite: that one stores it."""
    codecs = {"model/*": "int8_block"}
    with Checkpointer(tmp_path, model=Masked(1.0), codecs=codecs) as ckpt:
        ckpt.save(step=1).wait()
    lowest = torch.finfo(torch.float32).min
    with (
        Checkpointer(tmp_path, model=Masked(lowest), codecs=codecs, take_over=True) as ckpt,
        pytest.raises(SaveError, match=r"'model/mask'.*float32 limit.*infinity"),
    ):
        ckpt.save(step=2).wait()
    back = Masked(0.0)
    with Checkpointer(tmp_path, model=back) as ckpt:
        assert ckpt.restore() == 1 and not ckpt.last_restore.skipped
    fp8 = tmp_path / "fp8"
    with Checkpointer(fp8, model=Masked(lowest), codecs={"model/*": "fp8_block"}) as ckpt:
        ckpt.save(step=3).wait()
    with Checkpointer(fp8, model=back) as ckpt:
        assert ckpt.restore() == 3 and torch.equal(back.mask, Masked(lowest).mask)


def test_corrupt_codec_payload_falls_back_to_the_previous_version(tmp_path):
    model, optimizer = big_training()
    codecs = {MOMENTS: "int8_block"}
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, codecs=codecs) as ckpt:
        ckpt.save(step=1).wait()
        ckpt.save(step=2).wait()
    path = tmp_path / "v00000002" / "codec.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    model2, optimizer2 = big_training(seed=1)
    with Checkpointer(tmp_path, model=model2, optimizer=optimizer2) as ckpt:
        assert ckpt.restore() == 1
        assert (
            "codec.bin: tensor 'optimizer/state/0/exp_avg' segment 0: checksum mismatch"
            in (ckpt.last_restore.skipped[0][1])
        )


def test_readers_of_format_1_reject_a_coded_version(tmp_path, monkeypatch):
    import pcframe.format.manifest as manifest_module

    model, optimizer = big_training()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, codecs={MOMENTS: "zstd"}) as c:
        c.save(step=1).wait()
    monkeypatch.setattr(manifest_module, "READABLE_VERSIONS", (1,))
    with pytest.raises(ManifestError, match=r"format_version 2 is not supported.*upgrade"):
        load_version(tmp_path / "v00000001")


def test_raw_only_readers_refuse_coded_versions(tmp_path):
    model, optimizer = big_training()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer, codecs={MOMENTS: "zstd"}) as c:
        c.save(step=1).wait()
    manifest = read_manifest(str(tmp_path / "v00000001" / "manifest.json"))
    with pytest.raises(ManifestError, match=r"stores tensors with codecs.*load_version"):
        _ = manifest.layout  # e.g. a partial reader of data.bin would miss the coded tensors


def test_a_codec_rule_that_codes_nothing_is_named_in_a_warning(tmp_path, caplog):
    """A typo or a narrower rule after a broader one coded nothing, silently."""
    model, optimizer = big_training()
    codecs = {"model/*": "zstd", "model/0.*": "int8_block", "optimizer/state/*/exp_avgg": "zstd"}
    with (
        caplog.at_level(logging.WARNING, logger="pcframe"),
        Checkpointer(tmp_path, model=model, optimizer=optimizer, codecs=codecs) as ckpt,
    ):
        ckpt.save(step=1).wait()
    assert (
        "engine.codecs['model/0.*'] codes no tensor: every tensor it matches matched "
        "'model/*' first" in caplog.text
    )
    assert (
        "engine.codecs['optimizer/state/*/exp_avgg'] matches no tensor of this state" in caplog.text
    )
    assert "engine.codecs['model/*']" not in caplog.text
