"""Each hostile manifest field and codec meta seen to escape as a raw exception, one by one.

Every manifest here is re-signed (a valid header crc32c), so it reaches validation. The
outcome must always be the same: restore falls back to the previous version and says why
(``last_restore.skipped``), ``pcframe verify`` prints one FAILED line and exits 1, and every
other command answers in one line, never a traceback.
"""

from __future__ import annotations

import math
import re
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file

from pcframe import Checkpointer, ManifestError
from pcframe.format.names import MAX_VERSION
from pcframe.kernels import get_codec
from pcframe.kernels.codecs import FORMAT_VERSION
from pcframe.restore.reader import load_version

from .hostile_kit import build, objects, replace_payload, rewrite, run_cli, tensor


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return {coded: build(root / f"coded-{coded}", coded) for coded in (False, True)}


@pytest.fixture
def plain(templates, tmp_path):
    return shutil.copytree(templates[False], tmp_path / "plain")


@pytest.fixture
def coded(templates, tmp_path):
    return shutil.copytree(templates[True], tmp_path / "coded")


def first(body):
    return body["tensors"][0]


def add_to_tree(node):
    return lambda b: b["tree"]["model"].update(hostile=node)


def numpy_index(body):
    return body["numpy_tensors"][-1]  # stateful/tricky/array, decoded back to numpy


def as_bfloat16(body):
    array = body["tensors"][numpy_index(body)]
    array.update(dtype="bfloat16", nbytes=array["nbytes"] // 2)


def int8_meta(**change):
    def mutate(body):
        for segment in tensor(body, "optimizer/state/0/exp_avg")["segments"]:
            segment[5].update(change)

    return mutate


# case: (mutate the body of v2, what the reason must say)
PLAIN = {
    "dtype as a list": (lambda b: first(b).update(dtype=["float32"]), "unknown dtype"),
    "dtype as an object": (lambda b: first(b).update(dtype={"a": 1}), "unknown dtype"),
    "empty shape with a 10**30 dim": (
        lambda b: first(b).update(shape=[0, 10**30], nbytes=0),
        "over .* elements",
    ),
    "empty shape overflowing int64": (
        lambda b: first(b).update(shape=[2**32, 2**32, 0], nbytes=0),
        "over .* elements",
    ),
    "device tag garbage": (add_to_tree({"$device": "garbage:::"}), r"'\$device'"),
    "device tag a list": (add_to_tree({"$device": ["cpu"]}), r"'\$device'"),
    "dtype tag a list": (add_to_tree({"$dtype": ["float32"]}), "unknown dtype"),
    "dtype tag unknown": (add_to_tree({"$dtype": "float128"}), "unknown dtype"),
    "float tag garbage": (add_to_tree({"$float": "1.5"}), r"'\$float'"),
    "tuple tag not a list": (add_to_tree({"$tuple": 5}), r"'\$tuple'"),
    "dict tag bad pair": (add_to_tree({"$dict": [[1]]}), r"'\$dict'"),
    "dict tag unhashable key": (add_to_tree({"$dict": [[[1, 2], 3]]}), "unhashable"),
    "dict tag numpy key": (
        lambda b: add_to_tree({"$dict": [[{"$t": numpy_index(b)}, 3]]})(b),
        "unhashable",
    ),
    "unknown tag": (add_to_tree({"$pickle": "os.system"}), "malformed tagged node"),
    "tag with extra key": (add_to_tree({"$t": 0, "x": 1}), "malformed tagged node"),
    "tensor ref a bool": (add_to_tree({"$t": True}), "out of range"),
    "tensor ref negative": (add_to_tree({"$t": -1}), "out of range"),
    "tensor ref past the end": (add_to_tree({"$t": 10**6}), "out of range"),
    "wall_time 1e300": (lambda b: b.update(wall_time=1e300), "wall_time"),
    "wall_time negative": (lambda b: b.update(wall_time=-1.0), "wall_time"),
    "wall_time NaN": (lambda b: b.update(wall_time=math.nan), "wall_time"),
    "wall_time a bool": (lambda b: b.update(wall_time=True), "wall_time"),
    "duplicate tensor names": (
        lambda b: b["tensors"][1].update(name=b["tensors"][0]["name"]),
        "more than once",
    ),
    "version above the limit": (lambda b: b.update(version=MAX_VERSION + 1), "version must"),
    "version 2**63": (lambda b: b.update(version=2**63), "version must"),
    "version negative": (lambda b: b.update(version=-1), "version must"),
    "version of another folder": (lambda b: b.update(version=7), "the folder is v00000002"),
    "step 2**63": (lambda b: b.update(step=2**63), "step must"),
    "step -2**63": (lambda b: b.update(step=-(2**63)), "step must"),
    "checksum algorithm a list": (lambda b: b.update(checksum=["crc32c"]), "checksum"),
    "numpy tensor a bool": (lambda b: b.update(numpy_tensors=[True]), "numpy_tensors"),
    "numpy tensor of bfloat16": (as_bfloat16, "numpy cannot hold"),
    "numpy tensor listed twice": (
        lambda b: b["numpy_tensors"].append(numpy_index(b)),
        "more than once",
    ),
    "codec a list": (lambda b: first(b).update(codec=["raw"]), "codec"),
}

CODED = {
    "int8 block_size 0": (int8_meta(block_size=0), "block_size"),
    "int8 block_size -5": (int8_meta(block_size=-5), "block_size"),
    "int8 block_size 2**40": (int8_meta(block_size=2**40), "block_size"),
    "int8 block_size a string": (int8_meta(block_size="256"), "block_size"),
    "int8 n_blocks off by one": (int8_meta(n_blocks=5), "n_blocks"),
    "int8 scales_offset past the payload": (int8_meta(scales_offset=1 << 40), "scales_offset"),
    "int8 error_bound NaN": (int8_meta(error_bound=math.nan), "error_bound"),
    "int8 meta of format 99": (int8_meta(format_version=99), "format_version"),
    "int8 fmt of fp8": (int8_meta(fmt="fp8_e4m3"), "fmt"),
    "int8 on an int32 tensor": (
        lambda b: tensor(b, "optimizer/state/0/exp_avg").update(dtype="int32"),
        "decodes to",
    ),
    "zstd shuffle a string": (
        lambda b: [s[5].update(shuffle="yes") for s in tensor(b, "model/bias")["segments"]],
        "shuffle",
    ),
    "zstd nbytes lie": (
        lambda b: [s[5].update(nbytes=1 << 50) for s in tensor(b, "model/bias")["segments"]],
        "nbytes",
    ),
    "xor delta base not previous": (
        lambda b: [s[5].update(base="v1") for s in tensor(b, "model/weight")["segments"]],
        "base",
    ),
}


def _garbage(payload, meta):
    del meta
    payload[:] = bytes((i * 37 + 11) % 256 for i in range(len(payload)))


def _nan_scale(payload, meta):
    struct.pack_into("<f", payload, meta["scales_offset"], math.nan)


def _huge_scale(payload, meta):
    struct.pack_into("<f", payload, meta["scales_offset"], 3e38)


def _fp8_nan_code(payload, meta):
    del meta
    payload[0] = 0x7F


# case: (tensor, segment, change the payload, what the reason must say); checksums re-signed
PAYLOADS = {
    "zstd garbage": ("model/bias", 0, _garbage, "not a zstd frame|does not decompress"),
    "xor delta garbage": ("model/weight", 1, _garbage, "not a zstd frame|does not decompress"),
    "int8 NaN scale": ("optimizer/state/0/exp_avg", 0, _nan_scale, "scale"),
    "int8 huge scale": ("optimizer/state/0/exp_avg", 0, _huge_scale, "scale"),
    "fp8 NaN code": ("optimizer/state/0/exp_avg_sq", 0, _fp8_nan_code, "NaN code"),
}


def check_refused(root, message, *, manifest_level=True):
    """verify fails v2 in one line; inspect, export and restore fall back to v1 and say why."""
    code, out, err = run_cli("verify", root)
    assert code == 1, out + err
    lines = out.splitlines()
    assert lines[0].startswith("v1: OK"), out
    assert lines[1].startswith("v2: FAILED: ") and len(lines) == 2, out
    assert re.search(message, lines[1]), lines[1]
    code, out, err = run_cli("list", root)
    assert code == (1 if manifest_level else 0) and not err, out + err
    for command in ("inspect", "export") if manifest_level else ("export",):
        extra = ["-o", root / "out.safetensors"] if command == "export" else []
        code, out, err = run_cli(command, root, *extra)
        assert code == 0 and len(err.splitlines()) == 1, (command, out, err)
        assert "using version 1" in err and "skipped the newer version 2" in err, err
        assert re.search(message, err) and "Traceback" not in err, err
    with pytest.raises(ManifestError, match=message):
        load_version(root / "v00000002").state_tree()
    o = objects(64 if "coded" in root.name else 8)
    with Checkpointer(root, **o, extra={}) as ckpt:
        assert ckpt.restore() == 1
        (version, reason), *_ = ckpt.last_restore.skipped
        assert version == 2
        assert re.search(message, reason), reason
    assert torch.isfinite(o["optimizer"].state_dict()["state"][0]["exp_avg"]).all()


@pytest.mark.parametrize("case", sorted(PLAIN))
def test_hostile_field_falls_back(plain, case):
    mutate, message = PLAIN[case]
    rewrite(plain / "v00000002", mutate)
    check_refused(plain, message)


@pytest.mark.parametrize("case", sorted(CODED))
def test_hostile_codec_meta_falls_back(coded, case):
    mutate, message = CODED[case]
    rewrite(coded / "v00000002", mutate)
    check_refused(coded, message)


@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_undecodable_payload_with_a_valid_checksum_falls_back(coded, case):
    name, k, change, message = PAYLOADS[case]
    replace_payload(coded / "v00000002", name, k, change)
    check_refused(coded, f"does not decode.*({message})", manifest_level=False)


def test_duplicate_names_never_export_a_subset(plain):
    rewrite(plain / "v00000002", lambda b: b["tensors"][1].update(name=b["tensors"][0]["name"]))
    out = plain.parent / "x.safetensors"
    code, _, err = run_cli("export", plain, "--version", "2", "-o", out)
    assert code == 2 and "more than once" in err and not out.exists()
    code, _, err = run_cli("export", plain, "-o", out)  # the newest that reads back: all of v1
    assert code == 0 and "more than once" in err and "using version 1" in err, err
    assert set(load_file(out)) == set(load_version(plain / "v00000001").named_tensors())


@pytest.mark.parametrize("where", ["tensor name", "tree key"])
def test_hostile_names_are_escaped_on_one_line(plain, where):
    """A name with a newline, a terminal escape sequence and a lone surrogate."""
    name = "a\nb\x1b[2J\udcff"
    if where == "tensor name":
        mutate = lambda b: first(b).update(name=name, dtype="x")  # noqa: E731
    else:
        mutate = lambda b: b["tree"]["model"].update({name: {"$device": "bad"}})  # noqa: E731
    rewrite(plain / "v00000002", mutate)
    code, out, err = run_cli("verify", plain)
    assert code == 1 and len(out.splitlines()) == 2 and "\x1b" not in out, out
    code, out, _ = run_cli("list", plain)
    assert code == 1 and len(out.splitlines()) == 3 and "\x1b" not in out, out
    code, out, err = run_cli("inspect", plain)
    assert code == 0 and len(err.splitlines()) == 1 and "\x1b" not in err, err
    code, out, err = run_cli("inspect", plain, "--version", "2")
    assert code == 2 and len(err.splitlines()) == 1 and "\x1b" not in err, err


@pytest.mark.slow
def test_cli_is_one_line_in_a_real_process(plain, python):
    """The same through a real ``pcframe`` process: exit codes and no traceback."""
    import subprocess

    rewrite(plain / "v00000002", lambda b: first(b).update(dtype=["float32"]))
    # inspect and export read v1, the newest that reads back, and name v2 on stderr
    for command, expected in (("list", 1), ("verify", 1), ("inspect", 0), ("export", 0)):
        result = subprocess.run(
            [python, "-m", "pcframe.apps.cli", command, str(plain)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=plain,
        )
        assert result.returncode == expected, (command, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 1


# --- the codecs themselves: decode refuses bad meta with a ValueError ----------------------


def _encoded(name, x, previous=None):
    payload, meta = get_codec(name).encode(x, previous=previous)
    return bytes(payload), dict(meta)


@pytest.mark.parametrize("block_size", [0, -5, 2**40, True, 256.0, "256", None])
@pytest.mark.parametrize("name", ["int8_block", "fp8_block"])
def test_block_codecs_refuse_bad_block_size(name, block_size):
    x = torch.randn(1000)
    payload, meta = _encoded(name, x)
    with pytest.raises(ValueError, match="block_size"):
        get_codec(name).decode(payload, {**meta, "block_size": block_size}, x.dtype, x.shape)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("n_blocks", 3),
        ("n_blocks", -1),
        ("codes_nbytes", 999),
        ("scales_offset", 0),
        ("scales_dtype", "float16"),
        ("source_dtype", "float16"),
        ("error_bound", -1.0),
        ("error_bound", "big"),
        ("format_version", True),
        ("fmt", ["int8"]),
    ],
)
def test_int8_codec_refuses_inconsistent_meta(key, value):
    x = torch.randn(1000)
    payload, meta = _encoded("int8_block", x)
    with pytest.raises(ValueError, match=key):
        get_codec("int8_block").decode(payload, {**meta, key: value}, x.dtype, x.shape)


def test_block_codec_refuses_a_payload_of_another_size():
    x = torch.randn(1000)
    payload, meta = _encoded("int8_block", x)
    with pytest.raises(ValueError, match="payload has"):
        get_codec("int8_block").decode(payload[:-4], meta, x.dtype, x.shape)
    with pytest.raises(ValueError, match="codes_nbytes"):  # the tensor is not what was encoded
        get_codec("int8_block").decode(payload, meta, x.dtype, (999,))


@pytest.mark.parametrize("name", ["zstd", "xor_delta_zstd"])
def test_zstd_codecs_refuse_garbage_and_bad_flags(name):
    x = torch.randn(1000)
    previous = torch.zeros(1000) if name == "xor_delta_zstd" else None
    payload, meta = _encoded(name, x, previous)
    codec = get_codec(name)
    garbage = bytes(range(256)) * 4
    with pytest.raises(ValueError, match="zstd"):
        codec.decode(garbage, meta, x.dtype, x.shape, previous=previous)
    with pytest.raises(ValueError, match="shuffle"):
        codec.decode(payload, {**meta, "shuffle": "no"}, x.dtype, x.shape, previous=previous)
    with pytest.raises(ValueError, match="nbytes"):
        codec.decode(payload, {**meta, "nbytes": 4}, x.dtype, x.shape, previous=previous)
    shorter = previous[:999] if previous is not None else None
    with pytest.raises(ValueError, match="exactly"):  # the frame records its size
        codec.decode(payload, {**meta, "nbytes": 3996}, x.dtype, (999,), previous=shorter)
    with pytest.raises(ValueError, match="meta must be an object"):
        codec.decode(payload, ["format_version", FORMAT_VERSION], x.dtype, x.shape)


def test_valid_meta_still_decodes_exactly():
    """No behaviour change for what the encoder writes (every codec, bit-exact or in bound)."""
    x = torch.randn(3000)
    for name in ("raw", "zstd", "xor_delta_zstd", "int8_block", "fp8_block"):
        previous = torch.randn(3000) if name == "xor_delta_zstd" else None
        payload, meta = _encoded(name, x, previous)
        back = get_codec(name).decode(payload, meta, x.dtype, x.shape, previous=previous)
        bound = meta.get("error_bound", 0.0)
        assert (back - x).abs().max().item() <= bound, name
