"""Property-based fuzzing of manifests and codec meta: hostile input is refused, never crashes.

A manifest of a real checkpoint (format 1, and format 2 with int8 / fp8 / zstd /
xor_delta_zstd tensors, a delta version) gets one to three mutations anywhere in its body
(types swapped, huge and negative numbers, wrong lengths, keys deleted or added, elements
duplicated) and is re-signed, so it reaches validation. The only allowed outcomes:

* ``read_manifest`` raises :class:`ManifestError`, or
* it parses, and then loading (every chunk and segment read, checksummed and decoded, the
  state tree decoded) either succeeds or raises :class:`ManifestError` /
  :class:`CorruptCheckpoint`;

and ``pcframe verify`` agrees with that outcome in one line per version (exit 0 or 1, never
an internal error). The same for codec meta straight through ``Codec.decode``: a result of
the right dtype and shape (finite, for the lossy codecs) or a ``ValueError``.

The default run is small (a few seconds); the ``campaign`` variants run many more examples
(``PCFRAME_FUZZ_EXAMPLES`` sets how many).
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pcframe import ManifestError
from pcframe.format.manifest import read_manifest
from pcframe.kernels import get_codec
from pcframe.restore.reader import load_version

from .hostile_kit import build, read_body, run_cli, write_body

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FAST = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
# The many-examples variants run with the campaigns (pytest -m campaign; the default run has
# the 100-example ones); PCFRAME_FUZZ_EXAMPLES=20000 (say) fuzzes for as long as you like.
MANY = int(os.environ.get("PCFRAME_FUZZ_EXAMPLES", "600"))
SLOW = settings(FAST, max_examples=MANY)

# --- what goes in ----------------------------------------------------------------------------

EDGES = [0, 1, -1, 2, 3, 7, 255, 256, 4096, 2**31 - 1, 2**31, 2**32, 2**53, 2**62, 2**63]
EDGES += [2**64, 10**12, 10**12 + 1, 10**30, -(2**31), -(2**63), -(10**30)]
WORDS = ["", "garbage:::", "cpu", "cuda:0", "float32", "bfloat16", "int8_block", "zstd"]
WORDS += ["xor_delta_zstd", "raw", "data.bin", "codec.bin", "../data.bin", "crc32c", "none"]
WORDS += ["$t", "$tuple", "$dict", "$float", "$dtype", "$device", "nan", "inf", "previous"]
TAGS = ["$t", "$tuple", "$dict", "$float", "$dtype", "$device", "$pickle"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGES),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e300, -1e300, 1e-300, 0.5, -0.0]),
    st.sampled_from(WORDS),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(TAGS), st.text(max_size=6)), inner, max_size=3),
        st.builds(lambda tag, v: {tag: v}, st.sampled_from(TAGS), inner),
    ),
    max_leaves=8,
)


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every node's path; long lists (chunks, the RNG state) by their ends only."""
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += paths(value, (*prefix, key))
    elif isinstance(node, list):
        picks = range(len(node)) if len(node) <= 4 else (0, 1, len(node) - 1)
        for i in picks:
            found += paths(node[i], (*prefix, i))
    return found


def regions(body: dict[str, Any]) -> dict[str, list[tuple]]:
    """The body's paths by part, so each part is fuzzed as often as the big state tree."""
    parts: dict[str, list[tuple]] = {}
    for path in paths(body):
        if len(path) <= 1:
            part = "top level"
        elif path[0] == "tensors" and "segments" in path:
            part = "segment meta" if len(path) > 5 and path[5] == 5 else "segments"
        elif path[0] in ("files", "tensors", "tree"):
            part = path[0]
        else:
            part = "other"  # numpy_tensors, delta, codecs, metadata, engine
        parts.setdefault(part, []).append(path)
    return parts


def _get(body: Any, path: tuple) -> Any:
    for key in path:
        body = body[key]
    return body


@st.composite
def mutation(draw: Any, template: dict[str, Any], where: dict[str, list[tuple]]) -> tuple:
    part = draw(st.sampled_from(sorted(where)))
    path = draw(st.sampled_from(where[part]))
    target = _get(template, path)
    kinds = ["set", "set", "delete", "extra"]
    if isinstance(target, int) and not isinstance(target, bool):
        kinds += ["nudge", "nudge", "scale"]
    if isinstance(target, list):
        kinds += ["duplicate", "truncate"]
    if isinstance(target, str):
        kinds += ["word", "word"]
    kind = draw(st.sampled_from(kinds))
    if kind == "word":  # another plausible string: a real name, or this one slightly changed
        return ("set", path, draw(st.sampled_from([*WORDS, target[:-1], target + "0", target * 2])))
    if kind == "set":
        return (kind, path, draw(values))
    if kind == "extra":
        return (kind, path, draw(st.text(max_size=8)), draw(values))
    if kind == "nudge":
        return (kind, path, draw(st.sampled_from([-2, -1, 1, 2, 64, -64, 4096])))
    if kind == "scale":
        return (kind, path, draw(st.sampled_from([-1, 0, 2, 2**20, 2**40])))
    return (kind, path)


def apply(body: Any, change: tuple) -> Any:
    """``body`` with one change made (the body itself may be replaced)."""
    kind, path = change[0], change[1]
    if not path and kind in ("set", "delete"):
        return change[2] if kind == "set" else {}
    if not path:
        extra = kind == "extra" and isinstance(body, dict)
        return {**body, change[2]: change[3]} if extra else body
    try:
        parent = _get(body, path[:-1])
        key = path[-1]
        target = parent[key]
    except (KeyError, IndexError, TypeError):  # an earlier mutation moved it
        return body
    if not isinstance(parent, dict | list):  # ...or put a string where the container was
        return body  # ('abc'[0] indexes, but cannot be assigned or deleted)
    if kind == "set":
        parent[key] = change[2]
    elif kind == "delete":
        del parent[key]
    elif kind == "nudge" and isinstance(target, int):
        parent[key] = target + change[2]
    elif kind == "scale" and isinstance(target, int):
        parent[key] = target * change[2]
    elif kind == "extra":
        if isinstance(target, dict):
            target[change[2]] = change[3]
        elif isinstance(target, list):
            target.append(change[3])
        else:
            parent[key] = [target, change[3]]
    elif kind == "duplicate" and isinstance(target, list) and target:
        target.append(copy.deepcopy(target[0]))
    elif kind == "truncate" and isinstance(target, list):
        del target[len(target) // 2 :]
    return body


@pytest.mark.parametrize(
    "changes",
    [  # a list replaced by a string (or holding one), then a path into it: skipped, no crash
        [("set", ("files", "data.bin", "chunks"), "garbage:::"),
         ("set", ("files", "data.bin", "chunks", 0), None)],
        [("set", ("files", "data.bin", "chunks"), ["garbage:::"]),
         ("delete", ("files", "data.bin", "chunks", 0, 0))],
    ],
)  # fmt: skip
def test_apply_skips_a_path_into_a_string(checkpoints, changes):
    """The harness itself: these drew once in ~12,000 examples and crashed ``apply``."""
    body = copy.deepcopy(read_body(checkpoints["format 1"] / "v00000002"))
    for change in changes:
        body = apply(body, change)
    assert isinstance(body["files"]["data.bin"]["chunks"], str | list)


# --- the property ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz")
    return {"format 1": build(root / "plain", False), "format 2": build(root / "coded", True)}


def check_outcome(root: Path, body: Any) -> None:
    """Write ``body`` (re-signed) as version 2's manifest and check every allowed outcome."""
    version = root / "v00000002"
    original = (version / "manifest.json").read_bytes()
    try:
        write_body(version, body)
        try:
            read_manifest(str(version / "manifest.json"))
            loaded = load_version(version)
            loaded.state_tree()
            ok = True
        except ManifestError:  # CorruptCheckpoint is one too
            ok = False
        code, out, err = run_cli("verify", root, "--threads", 2)
        assert code == (0 if ok else 1), (out, err)
        assert len(out.splitlines()) == 2 and not err, (out, err)
        assert "internal error" not in out
        code, out, err = run_cli("list", root)
        assert code in (0, 1) and len(out.splitlines()) == 3 and not err, (out, err)
        code, out, err = run_cli("inspect", root, "--tensors", "--json")
        assert code in (0, 2) and "internal error" not in err, err
        if code == 0:
            json.loads(out)
        else:
            assert len(err.splitlines()) == 1
    finally:
        (version / "manifest.json").write_bytes(original)


def _fuzz_manifest(checkpoints: dict[str, Path], data: Any) -> None:
    which = data.draw(st.sampled_from(sorted(checkpoints)), label="checkpoint")
    root = checkpoints[which]
    template = read_body(root / "v00000002")
    where = regions(template)
    body = copy.deepcopy(template)
    for change in data.draw(st.lists(mutation(template, where), min_size=1, max_size=3)):
        body = apply(body, change)
    check_outcome(root, body)


@FAST
@given(data=st.data())
def test_mutated_manifests_are_refused_or_load(checkpoints, data):
    _fuzz_manifest(checkpoints, data)


@pytest.mark.campaign
@SLOW
@given(data=st.data())
def test_mutated_manifests_are_refused_or_load_many(checkpoints, data):
    _fuzz_manifest(checkpoints, data)


@pytest.mark.parametrize("which", ["format 1", "format 2"])
def test_unmutated_template_loads(checkpoints, which):
    """The property's baseline: the template itself is valid and verifies."""
    root = checkpoints[which]
    check_outcome(root, read_body(root / "v00000002"))
    assert run_cli("verify", root)[0] == 0


# --- codec meta through decode -----------------------------------------------------------------

CODEC_NAMES = ["raw", "zstd", "xor_delta_zstd", "int8_block", "fp8_block"]
DTYPE_CHOICES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8]


def _source(name: str, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=generator) * 3).to(dtype)
    previous = (torch.randn(n, generator=generator)).to(dtype) if name == "xor_delta_zstd" else None
    return x, previous


@st.composite
def meta_case(draw: Any) -> tuple:
    name = draw(st.sampled_from(CODEC_NAMES))
    lossy = name.endswith("_block")
    dtype = draw(st.sampled_from(DTYPE_CHOICES[:3] if lossy else DTYPE_CHOICES))
    n = draw(st.sampled_from([0, 1, 5, 255, 256, 257, 1000]))
    return name, dtype, n, draw(st.data())


def _fuzz_meta(case: tuple) -> None:
    name, dtype, n, data = case
    x, previous = _source(name, dtype, n)
    kwargs = {"block_size": data.draw(st.sampled_from([1, 32, 256]))} if "block" in name else {}
    payload, meta = get_codec(name, **kwargs).encode(x, previous=previous)
    payload, meta = bytearray(payload), json.loads(json.dumps(meta))
    shape: tuple[int, ...] = (n,)
    decode_dtype = dtype
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        kind = data.draw(
            st.sampled_from(["set", "set", "set", "delete", "extra", "payload", "shape", "dtype"])
        )
        keys = sorted(meta)
        if kind == "set":
            key = data.draw(st.sampled_from(keys) if keys else st.text(max_size=4))
            if isinstance(meta.get(key), int) and data.draw(st.booleans()):
                meta[key] = meta[key] + data.draw(st.sampled_from([-1, 1, 4, 2**40, -(2**40)]))
            else:
                meta[key] = data.draw(values)
        elif kind == "delete" and keys:
            del meta[data.draw(st.sampled_from(keys))]
        elif kind == "extra":
            meta[data.draw(st.text(max_size=8))] = data.draw(values)
        elif kind == "payload":
            payload = _mutate_payload(payload, data)
        elif kind == "shape":
            shape = data.draw(
                st.sampled_from([(max(n - 1, 0),), (n + 1,), (n, 1), (), (2**40,), (0,)])
            )
        else:
            decode_dtype = data.draw(st.sampled_from(DTYPE_CHOICES))
    previous_for = previous
    if previous is not None and (previous.dtype, tuple(previous.shape)) != (decode_dtype, shape):
        previous_for = torch.zeros(shape, dtype=decode_dtype) if math.prod(shape) < 2**20 else None
    try:
        result = get_codec(name).decode(
            bytes(payload), meta, decode_dtype, shape, previous=previous_for
        )
    except ValueError:
        return
    assert result.dtype == decode_dtype and tuple(result.shape) == shape
    if name.endswith("_block") and result.numel():
        assert torch.isfinite(result.float()).all(), "a lossy decode gave non-finite values"


def _mutate_payload(payload: bytearray, data: Any) -> bytearray:
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "garbage", "empty"]))
    if how == "flip" and payload:
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        payload = payload[: data.draw(st.integers(0, max(len(payload) - 1, 0)))]
    elif how == "extend":
        payload = payload + bytes(data.draw(st.integers(1, 16)))
    elif how == "garbage":
        payload = bytearray(data.draw(st.binary(min_size=len(payload), max_size=len(payload))))
    else:
        payload = bytearray()
    return payload


@FAST
@given(case=meta_case())
def test_mutated_codec_meta_decodes_or_raises_value_error(case):
    _fuzz_meta(case)


@pytest.mark.campaign
@settings(SLOW, max_examples=4 * MANY)
@given(case=meta_case())
def test_mutated_codec_meta_decodes_or_raises_value_error_many(case):
    _fuzz_meta(case)
