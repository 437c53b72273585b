"""Pickle-free encoding of training state: a JSON tree plus a flat list of tensors.

Tensors (and numpy arrays) are replaced in the tree by ``{"$t": index}`` and stored as raw
bytes. Everything else must be JSON-representable; the few Python types that JSON lacks
(tuples, dicts with non-string keys, dtypes) get a small tagged form. Decoding never runs
code chosen by the file: tags map to a fixed set of constructors.

The standard subtypes state holds keep their type (a scheduler's ``Counter``, an
``IntEnum``, a namedtuple came back a dict, an int, a tuple): ``{"$counter": d}``,
``{"$odict": d}``, ``{"$defaultdict": [factory, d]}`` (``d``: the dict's own encoding;
``factory``: null or a class's ``[module, qualname]``), ``{"$namedtuple": [module,
qualname, [items]]}`` and ``{"$enum": [module, qualname, value]}`` (a JSON scalar value):
manifest format version 5, written only when used. A class a file names is looked up among
the modules this process has imported, never imported, and used only if it is of the kind
its tag says (:mod:`pcframe.format.classes`): a namedtuple is built without its class's
code, an enum member found in its class's table of values, a defaultdict's factory is a
built-in type. A class a reader could not find again (made inside a function), or a
factory that is not a built-in type (a lambda), is stored as the base type, as before,
with a warning naming the place.
"""

from __future__ import annotations

import enum
import math
import re
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pcframe.errors import ManifestError, UnstorableState, UnsupportedCheckpoint
from pcframe.format.classes import (
    SAFE_FACTORIES,
    ClassProblem,
    checked_names,
    factory_names,
    findable_names,
    is_namedtuple_class,
    kept_as_base,
    resolve_class,
    unfindable,
)
from pcframe.kernels.dtypes import DTYPES, dtype_name

MAX_DEPTH = 64
_PLAIN = frozenset({int, str, bool, type(None)})  # stored as they are, no tensor inside
# Python's JSON reader refuses integers of more than 4300 digits by default
# (sys.int_max_str_digits): a writer whose user lifted that limit could commit a version
# no default reader can open. Integers are kept below 10**4300 in magnitude (4300 digits).
INT_LIMIT = 10**4300


def is_storable_int(value: int) -> bool:
    """Whether ``value`` (an int) reads back from JSON under Python's default limits."""
    return -INT_LIMIT < value < INT_LIMIT


def _ints_storable(values: list | tuple) -> bool:
    """Whether every int of a flat sequence reads back (one min and max, not a test each:
    an RNG state is 625 of them, encoded at every save on the training thread)."""
    ints = [v for v in values if type(v) is int]
    return not ints or (min(ints) > -INT_LIMIT and max(ints) < INT_LIMIT)


def huge_int_message(path: str, value: int) -> str:
    return (
        f"cannot checkpoint the integer at '{path}': it has {value.bit_length()} bits, more "
        "digits than Python's JSON reader accepts (4300); store it as a str or a tensor"
    )


@dataclass
class TensorRef:
    """One tensor found in the state tree."""

    path: str
    tensor: torch.Tensor
    numpy: bool = False  # decode back to a numpy array


def encode_tree(obj: Any, path: str, refs: list[TensorRef], depth: int = 0) -> Any:
    """Return a JSON-able tree; append every tensor to ``refs``.

    ``depth`` counts the containers above ``obj`` as :func:`decode_tree` counts them, so a
    tree this returns is never refused on read for its nesting.

    Raises:
        UnstorableState: naming the path of a value that cannot be stored without pickle,
            or of one nested deeper than :data:`MAX_DEPTH` (the reader's limit).
    """
    if depth > MAX_DEPTH:
        raise UnstorableState(
            f"cannot checkpoint the state at '{path}': it is nested deeper than {MAX_DEPTH} "
            "levels, which no pcframe reader accepts; flatten it in the object's state_dict()"
        )
    # Exact built-in types first: a save encodes ~1000 nodes on the training thread, and
    # these checks are most of them (the isinstance chain below cost twice as much).
    kind = type(obj)
    if kind is int and not -INT_LIMIT < obj < INT_LIMIT:
        raise UnstorableState(huge_int_message(path, obj))
    if kind is str or kind is int or kind is bool or obj is None:
        return obj
    if kind is torch.Tensor:
        if obj.is_nested:  # it has no single shape: torch raises on .shape
            raise UnstorableState(
                f"cannot checkpoint the nested tensor at '{path}': pcframe stores dense "
                "tensors; keep its components (.unbind()) or a padded tensor "
                "(.to_padded_tensor(0)) in the object's state_dict()"
            )
        # Always a tensor of its own: it keeps the storage it saw alive and its shape, even
        # if the object in the state is later given other memory (``.data =``, ``set_``).
        refs.append(TensorRef(path, obj.detach()))
        return {"$t": len(refs) - 1}
    inner = depth + 1
    if (
        (kind is list or kind is tuple)
        and inner <= MAX_DEPTH
        and _PLAIN.issuperset(map(type, obj))
        and _ints_storable(obj)
    ):
        # Flat sequences of plain values (an RNG state is a tuple of 625 ints): one node,
        # not one call and one path string per element (half of save() before this).
        return list(obj) if kind is list else {"$tuple": list(obj)}
    if kind is list:
        return [encode_tree(v, f"{path}/{i}", refs, inner) for i, v in enumerate(obj)]
    if kind is dict and all(type(k) is str and not k.startswith("$") for k in obj):
        return {k: encode_tree(v, f"{path}/{k}", refs, inner) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        refs.append(TensorRef(path, obj.detach()))
        return {"$t": len(refs) - 1}
    if isinstance(obj, np.ndarray):
        refs.append(TensorRef(path, _numpy_tensor(obj, path), numpy=True))
        return {"$t": len(refs) - 1}
    if isinstance(obj, np.generic) and not isinstance(obj, np.str_ | np.bytes_ | np.void):
        return {"$np": _numpy_scalar(obj, path)}  # its type kept: float32 maths resumes as such
    if isinstance(obj, enum.Enum):  # before str and int: an IntEnum is an int
        names = findable_names(type(obj))
        if names is not None:
            return {"$enum": [*names, _enum_value(obj, path)]}
        if not isinstance(obj, int | str | float):  # a plain Enum has no base value
            raise unfindable(type(obj), path, "enum")
        base = next(b for b in (int, str, float) if isinstance(obj, b))
        kept_as_base(path, f"enum member {obj!r:.60}", base.__name__)
        return encode_tree(base(obj), path, refs, inner)
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, int | np.integer):
        if not is_storable_int(int(obj)):
            raise UnstorableState(huge_int_message(path, int(obj)))
        return int(obj)
    if isinstance(obj, float | np.floating):
        value = float(obj)
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(obj, torch.dtype):
        return {"$dtype": dtype_name(obj)}
    if isinstance(obj, torch.device):
        return {"$device": str(obj)}
    if isinstance(obj, list):
        return [encode_tree(v, f"{path}/{i}", refs, inner) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [encode_tree(v, f"{path}/{i}", refs, inner) for i, v in enumerate(obj)]
        if is_namedtuple_class(type(obj)):
            names = findable_names(type(obj))
            if names is not None:
                return {"$namedtuple": [*names, items]}
            kept_as_base(path, f"namedtuple {type(obj).__qualname__}", "tuple")
        return {"$tuple": items}
    if kind in _DICT_TAGS:  # Counter, OrderedDict: their own subclasses stay plain dicts
        return {_DICT_TAGS[kind]: encode_tree(dict(obj), path, refs, inner)}
    if kind is defaultdict:
        factory = factory_names(obj.default_factory)
        if factory is not False:
            return {"$defaultdict": [factory, encode_tree(dict(obj), path, refs, inner)]}
        name = getattr(obj.default_factory, "__qualname__", type(obj.default_factory).__name__)
        kept_as_base(path, f"defaultdict (default_factory {name})", "dict")
        return encode_tree(dict(obj), path, refs, inner)
    if isinstance(obj, dict):
        if all(
            (type(k) is str or (isinstance(k, str) and not isinstance(k, enum.Enum)))
            and not k.startswith("$")
            for k in obj
        ):
            return {k: encode_tree(v, f"{path}/{k}", refs, inner) for k, v in obj.items()}
        return {
            "$dict": [
                [
                    encode_tree(k, f"{path}/<key>", refs, inner),
                    encode_tree(v, f"{path}/{k}", refs, inner),
                ]
                for k, v in obj.items()
            ]
        }
    raise UnstorableState(
        f"cannot checkpoint a value of type {type(obj).__name__} at '{path}': pcframe "
        "checkpoints are pickle-free, so state must be tensors, numpy arrays or JSON-able "
        "values (dict, list, tuple, str, int, float, bool, None); convert it in the "
        "object's state_dict()"
    )


_DICT_TAGS: dict[type, str] = {Counter: "$counter", OrderedDict: "$odict"}
_DICT_TYPES: dict[str, Callable[[dict[Any, Any]], dict[Any, Any]]] = {
    "$counter": Counter,
    "$odict": OrderedDict,
}


def _enum_value(member: enum.Enum, path: str) -> Any:
    value = member.value
    kind = type(value)
    if (
        (kind is int and is_storable_int(value))
        or (kind is float and math.isfinite(value))
        or kind is str
        or kind is bool
        or value is None
    ):
        return value
    raise UnstorableState(
        f"cannot checkpoint the enum member {member!r:.80} at '{path}': its value is a "
        f"{kind.__name__}; pcframe keeps enum members whose value is a str, int, finite "
        "float, bool or None: store its .name in the object's state_dict()"
    )


def _numpy_tensor(array: np.ndarray, path: str) -> torch.Tensor:
    """A tensor over ``array``'s values, in its shape (a 0-d array stays 0-d)."""
    if not array.dtype.isnative:
        raise UnstorableState(
            f"cannot checkpoint the numpy array at '{path}': its dtype {array.dtype.str!r} "
            "is not in this machine's byte order; convert it in the object's state_dict() "
            "(array.astype(array.dtype.newbyteorder('=')))"
        )
    try:
        # ascontiguousarray makes a 0-d array 1-d: the reshape gives the shape back.
        return torch.from_numpy(np.ascontiguousarray(array).reshape(array.shape))
    except TypeError:
        raise UnstorableState(
            f"cannot checkpoint the numpy array at '{path}' of dtype {array.dtype}: pcframe "
            "stores numeric and bool arrays; keep strings or objects as lists in the "
            "object's state_dict()"
        ) from None


# numpy scalar types a checkpoint keeps as such, by dtype name: each value's text parses back
# to the same value (float32 to float64 is exact; longdouble would not be, so it is refused).
_NUMPY_SCALARS = frozenset(
    {
        *("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
        *("float16", "float32", "float64", "complex64", "complex128"),
    }
)


def _numpy_scalar(value: np.generic, path: str) -> list[str]:
    name = value.dtype.name
    if name not in _NUMPY_SCALARS:
        raise UnstorableState(
            f"cannot checkpoint the numpy {name} scalar at '{path}': pcframe keeps numpy "
            f"scalars of {', '.join(sorted(_NUMPY_SCALARS))}; convert it in the object's "
            "state_dict()"
        )
    return [name, repr(value.item())]


def _np_value(value: Any) -> np.generic:
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, str) for v in value)
        and value[0] in _NUMPY_SCALARS
        and len(value[1]) <= 64
    ):
        raise ManifestError(f"malformed '$np' value {value!r:.80} ([dtype name, value text])")
    name, text = value
    kind = np.dtype(name).kind
    try:
        if kind == "b":
            if text not in ("True", "False"):
                raise ValueError(text)
            parsed: Any = text == "True"
        elif kind in "iu":
            parsed = int(text)
        elif kind == "f":
            parsed = float(text)
        else:
            parsed = complex(text)
        with np.errstate(over="raise"):
            scalar = np.dtype(name).type(parsed)
        if kind in "iu" and int(scalar) != parsed:
            raise OverflowError(text)
    except (ValueError, OverflowError, FloatingPointError):
        raise ManifestError(f"'$np' value {text!r:.40} is not a {name}") from None
    return scalar


def decode_tree(
    node: Any, tensors: list[Any], depth: int = 0, *, classes: bool = True, path: str = ""
) -> Any:
    """Inverse of :func:`encode_tree`; ``tensors[i]`` replaces ``{"$t": i}``.

    ``classes=False`` leaves the classes a tree names alone: a namedtuple decodes to a
    tuple, an enum member to its value, a defaultdict to a dict (for a reader that only
    verifies a version, in a process that need not have imported them). ``path``: where
    ``node`` is in the state (``/stateful``), for messages.

    Raises:
        UnsupportedCheckpoint: naming the path and the class, when a class the tree names
            is not defined in this process, is not of the kind its tag says, or does not
            hold the value (a restore stops there: the version is not damaged).
        ManifestError: the tree does not follow the schema :func:`encode_tree` writes (see
            :func:`check_tree`, which validates a tree without building it).
    """
    try:
        return _decoded(node, tensors, depth, classes)
    except ClassProblem as exc:
        where = f"{path}{_path_to(exc.node, node)}" or "/"
        raise UnsupportedCheckpoint(f"cannot restore the value at '{where}': {exc}") from None


def _decoded(node: Any, tensors: list[Any], depth: int, classes: bool) -> Any:
    if depth > MAX_DEPTH:
        raise ManifestError(f"state tree nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, list):
        return [_decoded(v, tensors, depth + 1, classes) for v in node]
    if not isinstance(node, dict):
        return _scalar(node)
    tag = _tag(node)
    if tag is None:
        return {k: _decoded(v, tensors, depth + 1, classes) for k, v in node.items()}
    value = node[tag]
    if tag == "$t":
        return tensors[_tensor_index(value, len(tensors))]
    if tag == "$tuple":
        return tuple(_decoded(v, tensors, depth + 1, classes) for v in _as_list(value, tag))
    if tag == "$dict":
        return {
            _hashable(_decoded(k, tensors, depth + 1, classes)): _decoded(
                v, tensors, depth + 1, classes
            )
            for k, v in _pairs(value)
        }
    if tag in _DICT_TYPES:
        return _DICT_TYPES[tag](_decoded(_dict_node(value, tag), tensors, depth + 1, classes))
    if tag == "$defaultdict":
        factory, inner = _defaultdict_parts(value)
        items = _decoded(inner, tensors, depth + 1, classes)
        if not classes:
            return items
        if factory is not None:  # called at a missing key: a built-in type only
            factory = resolve_class(
                factory, node, "default_factory class", lambda c: c in SAFE_FACTORIES
            )
        return defaultdict(factory, items)
    if tag == "$namedtuple":
        module, qualname, raw = _named_parts(value, tag)
        items = [_decoded(v, tensors, depth + 1, classes) for v in _as_list(raw, tag)]
        if not classes:
            return tuple(items)
        kind = resolve_class([module, qualname], node, "namedtuple class", is_namedtuple_class)
        if len(items) != len(kind._fields):
            raise ClassProblem(
                node,
                f"the checkpoint holds {len(items)} values of the namedtuple "
                f"{module}.{qualname}, which has the fields {kind._fields} in this process: "
                "restore with the class as it was saved",
            )
        return tuple.__new__(kind, items)  # as namedtuple's _make does: no code of the class
    if tag == "$enum":
        module, qualname, raw = _named_parts(value, tag)
        if not classes:
            return raw
        kind = resolve_class(
            [module, qualname],
            node,
            "enum class",
            lambda c: issubclass(c, enum.Enum) and bool(c.__members__),
        )
        return _enum_member(kind, raw, node, f"{module}.{qualname}")
    return _TAG_VALUES[tag](value)


def _enum_member(kind: type[enum.Enum], raw: Any, node: Any, name: str) -> enum.Enum:
    """The member of ``kind`` whose value is ``raw``, from the class's own table of values:
    no code of the class runs (its ``_missing_`` is the user's, and ``raw`` the file's);
    a Flag's combination of members is made by the Flag's own arithmetic."""
    member = kind._value2member_map_.get(raw) if not isinstance(raw, float) or raw == raw else None
    if member is not None and type(member.value) is type(raw):
        return member
    if issubclass(kind, enum.Flag) and type(raw) is int:
        try:
            return kind(raw)
        except Exception:  # any failure of the class is the checkpoint's
            pass
    raise ClassProblem(
        node,
        f"{raw!r:.60} is not a value of the enum {name} in this process (a member removed "
        "or renamed since the save?): restore with the class as it was saved",
    )


def _path_to(target: Any, root: Any) -> str:
    """The path (``/stateful/h/0``, as :func:`encode_tree` names it) of the encoded node
    ``target`` inside ``root``, found by identity ("" when it is ``root``)."""
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if isinstance(node, list):
            stack.extend((v, f"{path}/{i}") for i, v in enumerate(node))
        elif isinstance(node, dict) and len(node) == 1 and next(iter(node)) in _TAGS:
            tag, value = next(iter(node.items()))
            if not isinstance(value, list):  # $counter, $odict: the dict's own path
                stack.append((value, path))
            elif tag in ("$tuple", "$namedtuple"):
                items = value[2] if tag == "$namedtuple" and len(value) == 3 else value
                if isinstance(items, list):
                    stack.extend((v, f"{path}/{i}") for i, v in enumerate(items))
            elif tag == "$defaultdict" and len(value) == 2:
                stack.append((value[1], path))
            elif tag == "$dict":
                for pair in value:
                    if isinstance(pair, list) and len(pair) == 2:
                        key = pair[0] if not isinstance(pair[0], dict | list) else "<key>"
                        stack.extend([(pair[0], f"{path}/<key>"), (pair[1], f"{path}/{key}")])
        elif isinstance(node, dict):
            stack.extend((v, f"{path}/{k}") for k, v in node.items())
    return ""


def check_tree(node: Any, num_tensors: int, numpy: Collection[int] = ()) -> None:
    """Validate an encoded tree against the schema of :func:`encode_tree`, building nothing.

    Every tag is one of the known single-key forms with a well-formed value, every ``$t``
    reference is in ``range(num_tensors)``, every ``$dict`` key decodes to a hashable value
    (``numpy`` lists the references that decode to unhashable numpy arrays), and the nesting
    is at most :data:`MAX_DEPTH`, so a tree that passes decodes with :func:`decode_tree`.

    Raises:
        ManifestError: naming the path in the tree and what is wrong there.
    """
    _check_node(node, num_tensors, frozenset(numpy), "tree", 0)


def _check_node(node: Any, n: int, numpy: frozenset[int], path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ManifestError(f"state tree nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, list):
        for i, v in enumerate(node):
            _check_node(v, n, numpy, f"{path}/{i}", depth + 1)
        return
    if not isinstance(node, dict):
        _at(path, _scalar, node)
        return
    tag = _at(path, _tag, node)
    if tag is None:
        for k, v in node.items():
            _check_node(v, n, numpy, f"{path}/{k}", depth + 1)
        return
    value = node[tag]
    if tag == "$t":
        _at(path, _tensor_index, value, n)
    elif tag == "$tuple":
        for i, v in enumerate(_at(path, _as_list, value, tag)):
            _check_node(v, n, numpy, f"{path}/{i}", depth + 1)
    elif tag == "$dict":
        for i, (k, v) in enumerate(_at(path, _pairs, value)):
            _check_node(k, n, numpy, f"{path}/<key {i}>", depth + 1)
            if not _hashable_node(k, numpy):
                raise ManifestError(f"state tree at '{path}': unhashable dict key {k!r:.80}")
            _check_node(v, n, numpy, f"{path}/{i}", depth + 1)
    elif tag in _DICT_TYPES:
        _check_node(_at(path, _dict_node, value, tag), n, numpy, path, depth + 1)
    elif tag == "$defaultdict":
        _check_node(_at(path, _defaultdict_parts, value)[1], n, numpy, path, depth + 1)
    elif tag == "$namedtuple":
        for i, v in enumerate(_at(path, _as_list, _at(path, _named_parts, value, tag)[2], tag)):
            _check_node(v, n, numpy, f"{path}/{i}", depth + 1)
    elif tag == "$enum":
        _at(path, _named_parts, value, tag)
    else:
        _at(path, _TAG_VALUES[tag], value)


def _at(path: str, check: Any, *args: Any) -> Any:
    """Run one check; a failure names where in the tree it is."""
    try:
        return check(*args)
    except ManifestError as exc:
        raise ManifestError(f"state tree at '{path}': {exc}") from None


def _scalar(value: Any) -> Any:
    # JSON gives only these; anything else means the tree did not come from JSON.
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise ManifestError(f"value of type {type(value).__name__} is not JSON")


def _tag(node: dict[Any, Any]) -> str | None:
    """The tag of a tagged node, None for a plain dict; a stray ``$`` key is malformed."""
    tagged = [k for k in node if not isinstance(k, str) or k.startswith("$")]
    if not tagged:
        return None
    if len(node) != 1 or tagged[0] not in _TAGS:
        raise ManifestError(
            f"malformed tagged node with keys {sorted(map(str, node))[:4]}; known tags are "
            f"single-key objects {', '.join(sorted(_TAGS))}"
        )
    return tagged[0]


def _tensor_index(value: Any, n: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise ManifestError(f"tensor reference {value!r:.40} is out of range (0..{n - 1})")
    return value


def _pairs(value: Any) -> list[Any]:
    items = _as_list(value, "$dict")
    if not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
        raise ManifestError("malformed '$dict' entry in state tree (pairs must be [key, value])")
    return items


def _float(value: Any) -> float:
    if not isinstance(value, str) or value not in ("nan", "inf", "-inf"):
        raise ManifestError(f"malformed '$float' value {value!r:.40} (nan, inf or -inf)")
    return float(value)


def _dtype(value: Any) -> torch.dtype:
    if not isinstance(value, str) or value not in DTYPES:
        raise ManifestError(f"unknown dtype {value!r:.40} in state tree")
    return DTYPES[value]


# torch.device strings encode_tree writes: a backend name and an optional index.
_DEVICE = re.compile(r"^[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?$")


def _device(value: Any) -> torch.device:
    if isinstance(value, str) and _DEVICE.match(value):
        try:
            return torch.device(value)
        except (RuntimeError, ValueError):
            pass
    raise ManifestError(f"malformed '$device' value {value!r:.40} (e.g. 'cpu', 'cuda:0')")


_TAG_VALUES: dict[str, Callable[[Any], Any]] = {
    "$float": _float,
    "$dtype": _dtype,
    "$device": _device,
    "$np": _np_value,
}
# Tags of the standard subtypes (manifest format version 5: an older reader says "upgrade").
TYPED_TAGS = frozenset({*_DICT_TYPES, "$defaultdict", "$namedtuple", "$enum"})
_TAGS = frozenset({"$t", "$tuple", "$dict", *_TAG_VALUES, *TYPED_TAGS})


def tags_held(node: Any) -> set[str]:
    """The tags an encoded (checked) tree uses: what the manifest's format version follows."""
    found: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            if len(current) == 1:
                tag = next(iter(current))
                if tag in _TAGS:
                    found.add(tag)
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)
    return found


def _named_parts(value: Any, tag: str) -> tuple[str, str, Any]:
    """``[module, qualname, x]`` of a ``$namedtuple`` (x: the items) or ``$enum`` (x: a JSON
    scalar, the member's value)."""
    if not isinstance(value, list) or len(value) != 3:
        raise ManifestError(f"malformed '{tag}' entry in state tree ([module, qualname, value])")
    module, qualname = checked_names(value[:2], tag)
    if tag == "$enum" and isinstance(value[2], list | dict):
        raise ManifestError(f"malformed '$enum' value {value[2]!r:.40} (a JSON scalar)")
    if tag == "$enum":
        _scalar(value[2])
    return module, qualname, value[2]


def _dict_node(value: Any, tag: str) -> dict[str, Any]:
    """The encoded dict inside a ``$counter`` / ``$odict`` / ``$defaultdict``."""
    if not isinstance(value, dict) or _tag(value) not in (None, "$dict"):
        raise ManifestError(f"malformed '{tag}' entry in state tree (it holds a dict)")
    return value


def _defaultdict_parts(value: Any) -> tuple[list[str] | None, dict[str, Any]]:
    if not isinstance(value, list) or len(value) != 2:
        raise ManifestError("malformed '$defaultdict' entry in state tree ([factory, dict])")
    factory = None if value[0] is None else checked_names(value[0], "$defaultdict")
    return factory, _dict_node(value[1], "$defaultdict")


def _hashable_node(node: Any, numpy: frozenset[int]) -> bool:
    """Whether an (already checked) encoded node decodes to a hashable value."""
    if isinstance(node, list):
        return False
    if not isinstance(node, dict):
        return True
    tag = _tag(node)
    if tag == "$t":
        return node[tag] not in numpy
    if tag == "$tuple":
        return all(_hashable_node(v, numpy) for v in node[tag])
    if tag == "$namedtuple":
        return all(_hashable_node(v, numpy) for v in node[tag][2])
    # plain dicts, '$dict' and the dict subtypes decode to unhashable dicts
    return tag in _TAG_VALUES or tag == "$enum"


def _as_list(value: Any, tag: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"malformed '{tag}' entry in state tree")
    return value


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise ManifestError(f"unhashable dict key {key!r:.80} in state tree") from None
    return key
