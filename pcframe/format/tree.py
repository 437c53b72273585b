"""Pickle-free encoding of training state: a JSON tree plus a flat list of tensors.

Tensors (and numpy arrays) are replaced in the tree by ``{"$t": index}`` and stored as raw
bytes. Everything else must be JSON-representable; the few Python types that JSON lacks
(tuples, dicts with non-string keys, dtypes) get a small tagged form. Decoding never runs
code chosen by the file: tags map to a fixed set of constructors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pcframe.errors import ManifestError
from pcframe.kernels.dtypes import DTYPES, dtype_name

MAX_DEPTH = 64


@dataclass
class TensorRef:
    """One tensor found in the state tree."""

    path: str
    tensor: torch.Tensor
    numpy: bool = False  # decode back to a numpy array


def encode_tree(obj: Any, path: str, refs: list[TensorRef]) -> Any:
    """Return a JSON-able tree; append every tensor to ``refs``.

    Raises:
        TypeError: naming the path of a value that cannot be stored without pickle.
    """
    if isinstance(obj, torch.Tensor):
        refs.append(TensorRef(path, obj.detach()))
        return {"$t": len(refs) - 1}
    if isinstance(obj, np.ndarray):
        refs.append(TensorRef(path, torch.from_numpy(np.ascontiguousarray(obj)), numpy=True))
        return {"$t": len(refs) - 1}
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, int | np.integer):
        return int(obj)
    if isinstance(obj, float | np.floating):
        value = float(obj)
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(obj, torch.dtype):
        return {"$dtype": dtype_name(obj)}
    if isinstance(obj, torch.device):
        return {"$device": str(obj)}
    if isinstance(obj, list):
        return [encode_tree(v, f"{path}/{i}", refs) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"$tuple": [encode_tree(v, f"{path}/{i}", refs) for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: encode_tree(v, f"{path}/{k}", refs) for k, v in obj.items()}
        return {
            "$dict": [
                [encode_tree(k, f"{path}/<key>", refs), encode_tree(v, f"{path}/{k}", refs)]
                for k, v in obj.items()
            ]
        }
    raise TypeError(
        f"cannot checkpoint a value of type {type(obj).__name__} at '{path}': pcframe "
        "checkpoints are pickle-free, so state must be tensors, numpy arrays or JSON-able "
        "values (dict, list, tuple, str, int, float, bool, None); convert it in the "
        "object's state_dict()"
    )


def decode_tree(node: Any, tensors: list[Any], depth: int = 0) -> Any:
    """Inverse of :func:`encode_tree`; ``tensors[i]`` replaces ``{"$t": i}``."""
    if depth > MAX_DEPTH:
        raise ManifestError(f"state tree nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, list):
        return [decode_tree(v, tensors, depth + 1) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "$t":
            if not isinstance(value, int) or not 0 <= value < len(tensors):
                raise ManifestError(f"tensor reference {value!r} is out of range")
            return tensors[value]
        if tag == "$tuple":
            return tuple(decode_tree(v, tensors, depth + 1) for v in _as_list(value, tag))
        if tag == "$dict":
            items = _as_list(value, tag)
            if not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
                raise ManifestError("malformed '$dict' entry in state tree")
            return {
                _hashable(decode_tree(k, tensors, depth + 1)): decode_tree(v, tensors, depth + 1)
                for k, v in items
            }
        if tag == "$float":
            if value not in ("nan", "inf", "-inf"):
                raise ManifestError(f"malformed '$float' value {value!r}")
            return float(value)
        if tag == "$dtype":
            if value not in DTYPES:
                raise ManifestError(f"unknown dtype {value!r} in state tree")
            return DTYPES[value]
        if tag == "$device":
            return torch.device(str(value))
    return {k: decode_tree(v, tensors, depth + 1) for k, v in node.items()}


def _as_list(value: Any, tag: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"malformed '{tag}' entry in state tree")
    return value


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise ManifestError(f"unhashable dict key {key!r} in state tree") from None
    return key
