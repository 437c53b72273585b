"""Malformed or hostile manifests are rejected with a clear error: no crash, no huge allocation."""

from __future__ import annotations

import json
import resource

import crc32c
import pytest
import torch

from pcframe import Checkpointer, ManifestError
from pcframe.format.manifest import read_manifest
from pcframe.restore.reader import load_version


@pytest.fixture
def version_dir(tmp_path):
    model = torch.nn.Linear(8, 8)
    with Checkpointer(tmp_path, model=model, chunk_bytes=4096) as ckpt:
        ckpt.save(step=1).wait()
    return tmp_path / "v00000001"


def rewrite(version_dir, mutate):
    """Apply ``mutate`` to the manifest body and write it back with a *valid* checksum."""
    path = version_dir / "manifest.json"
    header, body = path.read_bytes().split(b"\n", 1)
    parsed = json.loads(body)
    mutate(parsed)
    new_body = json.dumps(parsed).encode()
    new_header = json.loads(header)
    new_header.update(body_bytes=len(new_body), body_crc32c=f"{crc32c.crc32c(new_body):08x}")
    path.write_bytes(json.dumps(new_header).encode() + b"\n" + new_body)


def tensor0(body):
    return body["tensors"][0]


HOSTILE = {
    "negative nbytes": (lambda b: tensor0(b).update(nbytes=-4), "invalid nbytes"),
    "huge shape": (lambda b: tensor0(b).update(shape=[1 << 40, 1 << 20]), "nbytes"),
    "offset past end": (lambda b: tensor0(b).update(offset=1 << 40), "past the data"),
    "unknown dtype": (lambda b: tensor0(b).update(dtype="float128"), "unknown dtype"),
    "path traversal": (lambda b: tensor0(b).update(file="../../etc/passwd"), "refers to file"),
    "absurd tensor count": (lambda b: b.update(tensors=[tensor0(b)] * 5001), "over the limit"),
    "huge data size": (lambda b: b["files"]["data.bin"].update(size=1 << 50), "chunks"),
    "negative step": (lambda b: b.update(step="ten"), "step must be an integer"),
    "bad chunk": (lambda b: b["files"]["data.bin"]["chunks"][0].__setitem__(1, -1), "length"),
    "overlap": (lambda b: b["tensors"][1].update(offset=b["tensors"][0]["offset"]), "overlaps"),
    "bool as int": (lambda b: b.update(version=True), "version must be an integer"),
    "deep tree": (lambda b: b.update(tree=_deep(200)), "deeper"),
    "bad tensor ref": (lambda b: b.update(tree={"model": {"w": {"$t": 99}}}), "out of range"),
    "unknown codec": (lambda b: tensor0(b).update(codec="pickle"), "codec"),
}


def _deep(n):
    node = 1
    for _ in range(n):
        node = [node]
    return node


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_is_rejected(version_dir, case, monkeypatch):
    import pcframe.format.manifest as manifest_module

    monkeypatch.setattr(manifest_module, "MAX_TENSORS", 5000)  # the limit logic, at small scale
    mutate, message = HOSTILE[case]
    rewrite(version_dir, mutate)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ManifestError, match=message):
        loaded = load_version(version_dir)
        loaded.state_tree()
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 512, f"rejecting {case!r} allocated {grown_mb:.0f} MB"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "no header line"),
        (b"not json\n{}", "header is not JSON"),
        (b'{"format": "pickle"}\n{}', "not a pcframe manifest"),
        (b'{"format": "pcframe-manifest", "format_version": 99}\n{}', "format_version 99"),
        (b'{"format": "pcframe-manifest", "format_version": 1, "body_bytes": 5}\n{}', "body is"),
    ],
)
def test_malformed_manifest_files(version_dir, content, message):
    (version_dir / "manifest.json").write_bytes(content)
    with pytest.raises(ManifestError, match=message):
        read_manifest(str(version_dir / "manifest.json"))


def test_oversized_manifest_is_not_read(version_dir, monkeypatch):
    import pcframe.format.manifest as manifest_module

    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(ManifestError, match="over the 100 limit"):
        read_manifest(str(version_dir / "manifest.json"))


def test_engine_falls_back_past_a_hostile_manifest(tmp_path):
    model = torch.nn.Linear(8, 8)
    with Checkpointer(tmp_path, model=model) as ckpt:
        ckpt.save(step=1).wait()
        ckpt.save(step=2).wait()
    rewrite(tmp_path / "v00000002", lambda b: tensor0(b).update(dtype="evil"))
    with Checkpointer(tmp_path, model=torch.nn.Linear(8, 8)) as ckpt:
        assert ckpt.restore() == 1
        assert "unknown dtype 'evil'" in ckpt.last_restore.skipped[0][1]


# --- format version 2: coded tensors in codec.bin, delta versions ---------------------------


@pytest.fixture
def coded_dir(tmp_path):
    model = torch.nn.Linear(64, 64)  # 16 KiB of weights: four 4 KiB segments
    codecs = {"model/weight": "xor_delta_zstd", "model/bias": "int8_block"}
    with Checkpointer(tmp_path, model=model, chunk_bytes=4096, codecs=codecs) as ckpt:
        ckpt.save(step=1).wait()
        ckpt.save(step=2).wait()  # a delta of version 1
    return tmp_path / "v00000002"


def weight(body):
    return next(t for t in body["tensors"] if t["name"] == "model/weight")


def _swap_first_segments(body):
    segments = weight(body)["segments"]
    segments[0][3], segments[1][3] = segments[1][3], segments[0][3]


HOSTILE_CODED = {
    "unknown codec": (lambda b: weight(b).update(codec="evil"), "unknown codec 'evil'"),
    "segment past the file": (
        lambda b: weight(b)["segments"][0].__setitem__(0, 1 << 40),
        "segment 0 offset must be an integer in",
    ),
    "segments overlap": (
        lambda b: weight(b)["segments"][1].__setitem__(0, weight(b)["segments"][0][0]),
        "overlaps|leaves a gap",  # which one shows first depends on the payload order
    ),
    "segment missing": (lambda b: weight(b)["segments"].pop(), "cover"),
    "segments out of order": (_swap_first_segments, "starts at element"),
    "giant segment count": (lambda b: weight(b)["segments"][0].__setitem__(4, 10**12), "count"),
    "huge shape": (
        lambda b: weight(b).update(shape=[1 << 40], nbytes=4 << 40),
        "segments cover",
    ),
    "meta not an object": (lambda b: weight(b)["segments"][0].__setitem__(5, "x"), "meta"),
    "bad segment": (lambda b: weight(b)["segments"][0].__setitem__(2, 5), r"must be \[offset"),
    "traversal": (lambda b: weight(b).update(file="../../codec.bin"), "refers to file"),
    "extra file": (lambda b: b["files"].update({"evil.bin": {"size": 1}}), "'files' must"),
    "base in the future": (lambda b: b["delta"].update(base=99), "delta base"),
    "base is itself": (lambda b: b["delta"].update(base=b["version"]), "delta base"),
    "absurd depth": (lambda b: b["delta"].update(depth=10**6), "delta depth"),
    "delta without base": (lambda b: b.pop("delta"), "names no 'delta' base"),
    "codec size lie": (lambda b: b["files"]["codec.bin"].update(size=1 << 40), "cover"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CODED))
def test_hostile_coded_manifest_is_rejected(coded_dir, case):
    mutate, message = HOSTILE_CODED[case]
    rewrite(coded_dir, mutate)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ManifestError, match=message):
        load_version(coded_dir).state_tree()
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 512, f"rejecting {case!r} allocated {grown_mb:.0f} MB"


def test_format_1_manifest_may_not_use_codecs(coded_dir):
    path = coded_dir / "manifest.json"
    header, body = path.read_bytes().split(b"\n", 1)
    parsed = json.loads(header)
    parsed["format_version"] = 1
    path.write_bytes(json.dumps(parsed).encode() + b"\n" + body)
    with pytest.raises(ManifestError, match=r"'files' must list 'data\.bin'"):
        read_manifest(str(path))


def test_base_of_another_depth_is_rejected(coded_dir):
    rewrite(coded_dir, lambda b: b["delta"].update(depth=2))  # the base (v1) has depth 0
    with pytest.raises(ManifestError, match="expects version 1 at depth 1"):
        load_version(coded_dir)
