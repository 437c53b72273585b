"""Capture, check and restore every random number generator a training loop draws from.

A restore first asks :func:`check_rng` what is wrong with each saved generator state (types,
lengths, shapes, and a load into a scratch generator), so that a damaged state is refused
before any live object is touched; :func:`restore_rng` then sets the live generators.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch

MT19937_WORDS = 624  # numpy's legacy MT19937 key length; its position runs 0..624


def capture_rng() -> dict[str, Any]:
    """State of Python's, numpy's legacy global, torch CPU and (if present) CUDA generators."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_rng(state: Any) -> dict[str, str]:
    """What is wrong with each generator state in ``state`` (as :func:`capture_rng` made it).

    Returns ``{generator: problem}``, empty when every state present can be restored. Only
    scratch generators are loaded; the live ones are untouched. Generators missing from
    ``state`` are not a problem (they keep their state); unknown entries are ignored.
    """
    if not isinstance(state, dict):
        return {"rng": f"is a {type(state).__name__}, not a dict of generator states"}
    problems = {}
    for name, check in _CHECKS.items():
        if name in state:
            problem = check(state[name])
            if problem:
                problems[name] = problem
    return problems


def restore_rng(state: dict[str, Any], skip: Collection[str] = ()) -> None:
    """Set the live generators from ``state`` (checked first with :func:`check_rng`).

    ``skip`` names generators to leave as they are (e.g. those :func:`check_rng` refused).
    """
    if "python" in state and "python" not in skip:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state and "numpy" not in skip:
        np.random.set_state(state["numpy"])
    if "torch" in state and "torch" not in skip:
        torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    if "cuda" in state and "cuda" not in skip and torch.cuda.is_available():
        cuda_states = list(state["cuda"])
        # A restart on fewer GPUs restores those it has; more GPUs keep their fresh seeds.
        count = min(len(cuda_states), torch.cuda.device_count())
        for index in range(count):
            torch.cuda.set_rng_state(cuda_states[index].cpu(), index)


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_python(value: Any) -> str | None:
    if not (isinstance(value, tuple | list) and len(value) == 3):
        return "must be (version, internal state, gauss) as random.getstate() returns"
    version, internal, gauss = value
    if not _is_int(version):
        return f"version {version!r} is not an integer"
    if not (isinstance(internal, tuple | list) and all(_is_int(word) for word in internal)):
        return "internal state must be a sequence of integers"
    if gauss is not None and not isinstance(gauss, float):
        return f"gauss must be None or a float, not {type(gauss).__name__}"
    try:
        random.Random().setstate((int(version), tuple(int(w) for w in internal), gauss))
    except (TypeError, ValueError, OverflowError) as exc:
        return f"refused by random.setstate: {exc} ({len(internal)} words)"
    return None


def _check_numpy(value: Any) -> str | None:
    if not isinstance(value, dict):
        kind = type(value).__name__
        return f"must be the dict np.random.get_state(legacy=False) returns, not a {kind}"
    if value.get("bit_generator") != "MT19937":
        return f"bit_generator {value.get('bit_generator')!r} is not 'MT19937'"
    inner = value.get("state")
    if not isinstance(inner, dict):
        return "'state' must be a dict with 'key' and 'pos'"
    key, pos = inner.get("key"), inner.get("pos")
    if not (
        isinstance(key, np.ndarray) and key.dtype == np.uint32 and key.shape == (MT19937_WORDS,)
    ):
        found = f"{key.dtype} {key.shape}" if isinstance(key, np.ndarray) else type(key).__name__
        return f"'key' must be a uint32 array of shape ({MT19937_WORDS},), not {found}"
    if not (_is_int(pos) and 0 <= pos <= MT19937_WORDS):
        return f"'pos' {pos!r} is not an integer in 0..{MT19937_WORDS}"
    if value.get("has_gauss") not in (0, 1) or isinstance(value.get("has_gauss"), bool):
        return f"'has_gauss' {value.get('has_gauss')!r} is not 0 or 1"
    if not isinstance(value.get("gauss"), float | int) or isinstance(value.get("gauss"), bool):
        return f"'gauss' {value.get('gauss')!r} is not a number"
    try:
        np.random.RandomState().set_state(value)
    except (TypeError, ValueError, KeyError) as exc:
        return f"refused by numpy: {exc}"
    return None


def _byte_state(value: Any, length: int | None) -> str | None:
    if not isinstance(value, torch.Tensor):
        return f"must be a uint8 tensor, not a {type(value).__name__}"
    if value.dtype != torch.uint8 or value.dim() != 1:
        return f"must be a 1-d uint8 tensor, not {value.dtype} of shape {tuple(value.shape)}"
    if length is not None and value.numel() != length:
        return f"holds {value.numel()} bytes, a generator state here holds {length}"
    return None


def _check_torch(value: Any) -> str | None:
    problem = _byte_state(value, torch.get_rng_state().numel())
    if problem:
        return problem
    try:
        torch.Generator().set_state(value.cpu())
    except (RuntimeError, TypeError) as exc:
        return f"refused by torch: {exc}"
    return None


def _check_cuda(value: Any) -> str | None:
    if not isinstance(value, list | tuple):
        return f"must be a list of per-device states, not a {type(value).__name__}"
    for index, device_state in enumerate(value):
        problem = _byte_state(device_state, None)
        if problem:
            return f"device {index}: {problem}"
    if torch.cuda.is_available():  # only the devices restore_rng would set
        for index in range(min(len(value), torch.cuda.device_count())):
            try:
                torch.Generator(device=f"cuda:{index}").set_state(value[index].cpu())
            except (RuntimeError, TypeError) as exc:
                return f"device {index}: refused by torch: {exc}"
    return None


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "python": _check_python,
    "numpy": _check_numpy,
    "torch": _check_torch,
    "cuda": _check_cuda,
}
