"""Shared by the hostile-manifest tests: real checkpoints, and manifests rewritten *re-signed*.

A re-signed manifest has a valid header crc32c over its new body, so it reaches the body's
validation (a flipped byte without re-signing only ever tests the checksum). Segment payloads
can be replaced the same way: same length, checksum recomputed, so the bytes reach the codec.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import torch

from pcframe import Checkpointer
from pcframe.apps import cli
from pcframe.format.checksum import checksum_function

CODECS = {
    "model/weight": "xor_delta_zstd",
    "model/bias": "zstd",
    "optimizer/state/*/exp_avg": "int8_block",
    "optimizer/state/*/exp_avg_sq": "fp8_block",
}


class Tricky:
    """A stateful object whose state uses every tag of the tree encoding."""

    def __init__(self) -> None:
        self.state: dict[Any, Any] = {}

    def state_dict(self) -> dict[Any, Any]:
        return {
            1: "int key",
            (2, "b"): (torch.float16, torch.device("cpu")),
            "$dollar": float("nan"),
            "inf": float("-inf"),
            "array": np.arange(3, dtype=np.int32),
            "nested": [{"t": (1, [2, 3])}, None, True, 1.5],
        }

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        self.state = state


def objects(width: int = 8) -> dict[str, Any]:
    """A model, an optimizer with state, and a tricky stateful object."""
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "stateful": {"tricky": Tricky()}}


def build(root: Path, coded: bool) -> Path:
    """Versions 1 (step 1) and 2 (step 2) in ``root``; coded: format 2, v2 a delta of v1."""
    width = 64 if coded else 8  # coded: 16 KiB of weights, four 4 KiB segments
    kwargs: dict[str, Any] = {"chunk_bytes": 4096}
    if coded:
        kwargs["codecs"] = CODECS
    o = objects(width)
    with Checkpointer(root, **o, extra={"$x": [1, {"y": None}]}, **kwargs) as ckpt:
        ckpt.save(step=1).wait()
        with torch.no_grad():
            o["model"].weight.add_(0.5)
        ckpt.save(step=2).wait()
    return root


def read_body(version_dir: Path) -> dict[str, Any]:
    _, body = (version_dir / "manifest.json").read_bytes().split(b"\n", 1)
    return json.loads(body)


def write_body(version_dir: Path, body: Any) -> None:
    """Write ``body`` as the manifest, with a header that is valid for it."""
    path = version_dir / "manifest.json"
    header = json.loads(path.read_bytes().split(b"\n", 1)[0])
    raw = json.dumps(body).encode()
    header.update(body_bytes=len(raw), body_crc32c=f"{crc32c.crc32c(raw):08x}")
    path.write_bytes(json.dumps(header).encode() + b"\n" + raw)


def rewrite(version_dir: Path, mutate: Callable[[dict[str, Any]], Any]) -> None:
    body = read_body(version_dir)
    mutate(body)
    write_body(version_dir, body)


def tensor(body: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in body["tensors"] if t["name"] == name)


def replace_payload(
    version_dir: Path, name: str, k: int, change: Callable[[bytearray, dict[str, Any]], None]
) -> None:
    """Change segment ``k`` of tensor ``name`` in place and re-sign its checksum."""
    body = read_body(version_dir)
    segment = tensor(body, name)["segments"][k]
    offset, length = segment[0], segment[1]
    path = version_dir / "codec.bin"
    data = bytearray(path.read_bytes())
    payload = data[offset : offset + length]
    change(payload, segment[5])
    assert len(payload) == length, "a replacement payload keeps its length (codec.bin tiling)"
    data[offset : offset + length] = payload
    path.write_bytes(bytes(data))
    segment[2] = checksum_function(body["checksum"])([memoryview(bytes(payload))])
    write_body(version_dir, body)


def run_cli(*args: Any) -> tuple[int, str, str]:
    """``pcframe ARGS`` in this process; stdout and stderr as a strict UTF-8 terminal has them."""
    out, err = io.BytesIO(), io.BytesIO()
    out_text = io.TextIOWrapper(out, encoding="utf-8", errors="strict", write_through=True)
    err_text = io.TextIOWrapper(err, encoding="utf-8", errors="strict", write_through=True)
    with contextlib.redirect_stdout(out_text), contextlib.redirect_stderr(err_text):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue().decode(), err.getvalue().decode()
