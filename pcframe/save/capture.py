"""Capture: the live training objects turned into one immutable :class:`SaveRequest`.

Runs on the training thread inside ``save()``. The state tree is encoded pickle-free
(:mod:`pcframe.format.tree`); its tensors are referenced, not copied, where the optimizer
step gate protects them, and cloned otherwise. The :class:`~pcframe.format.layout.Layout`
is built once and reused while the (name, dtype, shape) signature stays the same.
"""

from __future__ import annotations

import copy
import enum
import json
import math
from collections import OrderedDict
from typing import Any

import torch

from pcframe.config import EngineConfig
from pcframe.format.classes import is_namedtuple_class
from pcframe.format.layout import Layout
from pcframe.format.manifest import MAX_DIMS, MAX_NAME, MAX_NUMEL, MAX_TENSORS, is_valid_step
from pcframe.format.tree import (
    MAX_DEPTH,
    TensorRef,
    encode_tree,
    huge_int_message,
    is_storable_int,
)
from pcframe.kernels.dtypes import DTYPE_NAMES
from pcframe.save.request import SaveRequest, in_place_version, same_sample, value_sample
from pcframe.state.migrations import versions_to_save
from pcframe.state.objects import (
    Section,
    TrainingObjects,
    check_params_are_the_models,
    class_name,
    optimizer_param_names,
)
from pcframe.state.rng import capture_rng


class Capture:
    def __init__(self, objects: TrainingObjects, config: EngineConfig) -> None:
        self.objects, self.config = objects, config
        self._layout: Layout | None = None
        self._layout_signature: tuple | None = None
        self._names_key: tuple | None = None  # the param groups _names was made from
        self._names: list[list[str | None]] = []
        self._buffers: frozenset[str] = frozenset()  # model buffers' tree paths (by layout)
        self._footprint_key: int | None = None  # size_key at the last new_footprint
        # In-place version counters of the model parameters when the engine was built, by id:
        # one the optimizer does not step is read in place while its counter keeps still.
        self._unstepped_versions: dict[int, int | None] = {}
        self._stepped: set[int] = set()  # ids of the optimizer's parameters (_param_names)
        self._moving: set[int] = set()  # ids of unstepped parameters seen changing: cloned
        self._whole: dict[int, tuple[int, bool]] = {}  # entry -> (address, whole storage)
        # And a sample of each one's values (host tensors): an update through ``.data``
        # (``t.data.mul_(m)``, much EMA code) moves no counter, but moves the values.
        self._samples: dict[int, torch.Tensor | None] = {}
        self._sampled: dict[int, torch.Tensor] = {}  # storage address -> sample, this capture
        if isinstance(objects.model, torch.nn.Module):
            for param in objects.model.parameters():
                self._unstepped_versions[id(param)] = in_place_version(param)
                self._samples[id(param)] = value_sample(param)

    def request(self, version: int, step: int, metadata: dict[str, Any]) -> SaveRequest:
        """Capture the state now as version ``version`` at ``step``.

        Raises:
            TypeError, ValueError: the state (or ``step``) is one a reader would refuse, so
                the version would be committed and then quarantined on restore.
        """
        if not is_valid_step(step):
            raise ValueError(f"step={step!r}: a checkpoint's step is an integer in ±2**62")
        encoded, refs, live = self._encoded()
        signature = Layout.signature(live)
        changed = self._layout is None or self._layout_signature != signature
        if changed:  # before any storage is touched (a sparse tensor has none)
            check_reader_limits(live)
            self._buffers = self._buffer_paths()  # the names are in the signature
        tensors = self._detach_from_training(refs)
        named = [(name, t) for (name, _), t in zip(live, tensors, strict=True)]
        if changed:
            self._layout = Layout.build(named, self.config.chunk_bytes, self.config.tensor_align)
            self._layout_signature = signature
        cuda_ready = None
        if any(t.is_cuda for t in tensors):
            cuda_ready = torch.cuda.Event()
            cuda_ready.record()
        # Tensors carved from one allocation share one in-place counter (a buffer cut from
        # the same arena as a parameter moves it in every forward): only a tensor that is
        # its whole storage is watched for a change before its copy finished.
        if changed:
            self._whole = {}
        watched = tuple(
            (i, v)
            for i, (ref, tensor) in enumerate(zip(refs, tensors, strict=True))
            if tensor is ref.tensor
            and self._whole_storage(i, tensor)
            and (v := in_place_version(tensor)) is not None
        )
        sampled = tuple(  # only when some parameter was sampled: no storage asked per tensor
            (i, sample)
            for i, (ref, tensor) in enumerate(
                zip(refs, tensors, strict=True) if self._sampled else ()
            )
            if tensor is ref.tensor
            and (sample := self._sampled.get(tensor.untyped_storage().data_ptr())) is not None
        )
        return SaveRequest(
            version=version,
            step=step,
            layout=self._layout,
            tensors=tuple(tensors),
            watched=watched,
            sampled=sampled,
            tree=encoded,
            numpy_tensors=tuple(i for i, ref in enumerate(refs) if ref.numpy),
            metadata=json_only(metadata, "metadata"),
            cuda_ready=cuda_ready,
        )

    def new_footprint(self, steps: int) -> tuple[int, bool] | None:
        """:meth:`footprint` when the state's size is known and may have changed since the
        last call (:meth:`size_key`), else None."""
        key = self.size_key(steps)
        if key is None or key == self._footprint_key:
            return None
        self._footprint_key = key
        return self.footprint()

    def size_key(self, steps: int) -> int | None:
        """What the state's size follows, or None while it is not known. An optimizer
        makes a parameter's moments at its first step with a gradient, so once it has
        stepped (``steps`` seen by the gate) or holds state, the key is how many parameters
        have state: it grows when a branch first gets a gradient (a mixture of experts)."""
        optimizer = self.objects.optimizer
        if optimizer is None:
            return 0
        return len(optimizer.state) if steps or optimizer.state else None

    def footprint(self) -> tuple[int, bool]:
        """Bytes a version of the state as it is now would stage, and whether any of its
        tensors is on a GPU: the layout alone, nothing copied or recorded (the staging pool
        is sized from it ahead of the first save: ``Checkpointer.decide``)."""
        _, _, live = self._encoded()
        layout = Layout.build(live, self.config.chunk_bytes, self.config.tensor_align)
        return layout.data_size, any(t.is_cuda for _, t in live)

    def _encoded(self) -> tuple[Any, list[TensorRef], list[tuple[str, torch.Tensor]]]:
        """The state tree encoded now, its tensor references, and ``(name, tensor)`` of each."""
        refs: list[TensorRef] = []
        encoded = encode_tree(self._tree(), "", refs)
        return encoded, refs, [(ref.path.lstrip("/"), ref.tensor) for ref in refs]

    def _tree(self) -> dict[str, Any]:
        o = self.objects
        tree: dict[str, Any] = {}
        if o.model is not None:
            state = o.model.state_dict()
            versions = versions_to_save(state)
            if versions:  # module versions other than the default, for migrations
                tree["model_versions"] = versions
            # An OrderedDict by torch's habit, not for its load_state_dict: a plain dict
            # keeps a default version in format 1 (the tree keeps an OrderedDict's type).
            tree[Section.MODEL] = _plain_top(state)
        if o.optimizer is not None:
            tree[Section.OPTIMIZER] = o.optimizer.state_dict()
            if isinstance(o.optimizer, torch.optim.Optimizer):  # not a multi-rank stand-in
                # So a restore can refuse Adam state for AdamW (same keys, other maths).
                tree["optimizer_class"] = class_name(o.optimizer)
                if o.model is not None:  # so a restore can refuse state in another order
                    tree["optimizer_param_names"] = self._param_names()
        if o.scheduler is not None:
            tree[Section.SCHEDULER] = o.scheduler.state_dict()
            # torch loads any scheduler's state into any other (a __dict__.update).
            tree["scheduler_class"] = class_name(o.scheduler)
        if o.scaler is not None:
            tree[Section.SCALER] = o.scaler.state_dict()
        tree[Section.RNG] = capture_rng()
        # A module given as a stateful object (an EMA, SWA's AveragedModel) as the model.
        tree[Section.STATEFUL] = {
            name: _plain_top(obj.state_dict()) for name, obj in o.stateful.items()
        }
        tree[Section.POLICY] = o.policy.state_dict()
        if o.extra is not None:
            tree[Section.EXTRA] = json_only(o.extra, Section.EXTRA, typed=True)
        # Plain keys: the tree would keep the StrEnum Section as an enum (format 5).
        return {str(key): value for key, value in tree.items()}

    def _buffer_paths(self) -> frozenset[str]:
        """The model's buffers, as their paths in the state tree."""
        model = self.objects.model
        if not isinstance(model, torch.nn.Module):
            return frozenset()
        return frozenset(f"/model/{name}" for name, _ in model.named_buffers())

    def _param_names(self) -> list[list[str | None]]:
        """``optimizer_param_names``, computed again only when the param groups change."""
        groups = self.objects.optimizer.param_groups
        key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if self._names_key != key:
            names = optimizer_param_names(self.objects.model, self.objects.optimizer)
            check_params_are_the_models(names, self.objects.optimizer)
            self._stepped = {id(p) for g in groups for p in g["params"]}
            self._names, self._names_key = names, key
        return self._names

    def _whole_storage(self, index: int, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is all of its storage (memoised by address: asking the storage
        costs a microsecond, thousands of times per save)."""
        address = tensor.data_ptr()
        known = self._whole.get(index)
        if known is None or known[0] != address:
            whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            self._whole[index] = known = (address, whole)
        return known[1]

    def _gated(self, param: torch.Tensor, stepped: set[int] | None) -> bool:
        """Whether ``optimizer.step()`` waiting for the copy keeps ``param`` still: it steps
        it (``stepped``: the ids it steps; ``None``: not a torch optimizer, a multi-rank view:
        every parameter), or the parameter has never changed in place since the engine was
        built (a frozen layer). One that has (an EMA teacher updated in place under
        ``no_grad`` before each step: read in place, its update ran into the background copy
        and the version held a torn mix) is cloned at every save from then on, also when it
        moves only every few steps. A change through ``.data`` moves no counter but the
        values: a sample of them (host tensors) is compared too."""
        if stepped is None or id(param) in stepped or id(param) in self._moving:
            return stepped is None or id(param) in stepped
        now, sample = in_place_version(param), value_sample(param)
        if (
            now is None
            or now != self._unstepped_versions.get(id(param))
            or not same_sample(sample, self._samples.get(id(param)))
        ):
            self._moving.add(id(param))
            return False
        if sample is not None:  # checked again when the copy is done
            self._sampled[param.untyped_storage().data_ptr()] = sample
        return True

    def _detach_from_training(self, refs: list[TensorRef]) -> list[torch.Tensor]:
        """Decide per tensor whether the background copy may read it later.

        Parameters and optimizer state change only in ``optimizer.step()``, which is gated on
        the copy, so they are read in place (recognised by their storage: a view of one, such
        as a rank's share of a replicated parameter, too). Everything else (buffers such as
        batch-norm statistics change in the next forward; RNG and small state) is cloned
        right now, and so is a model buffer that lives inside a parameter's storage (one
        flat allocation for the whole model): the forward changes it, not the step.
        """
        o = self.objects
        gated: set[int] = set()
        buffers = self._buffers
        self._sampled = {}
        if o.optimizer is not None:
            if o.model is not None:
                stepped = None  # not a torch optimizer (a multi-rank view): every parameter
                if isinstance(o.optimizer, torch.optim.Optimizer):
                    self._param_names()  # the groups' parameter ids, kept with their names
                    stepped = self._stepped
                gated = {
                    p.untyped_storage().data_ptr()
                    for p in o.model.parameters()
                    if self._gated(p, stepped)
                }
            for state in o.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        gated.add(value.untyped_storage().data_ptr())
        tensors = []
        for ref in refs:
            tensor = ref.tensor
            if (
                tensor.numel()
                and tensor.untyped_storage().data_ptr() in gated
                and ref.path not in buffers
            ):
                tensors.append(tensor)
            else:
                tensors.append(tensor.clone())
        return tensors


def check_reader_limits(named: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse tensors that cannot be stored or are beyond the reader's limits (checked when
    the layout changes), naming the tensor and the fix."""
    if len(named) > MAX_TENSORS:
        raise ValueError(
            f"the state holds {len(named)} tensors, over the {MAX_TENSORS} a pcframe reader "
            "accepts; group small tensors into fewer, larger ones"
        )
    seen: set[str] = set()
    for name, tensor in named:
        if len(name) > MAX_NAME:
            raise ValueError(
                f"cannot checkpoint tensor {name[:80]!r}...: its path in the state is "
                f"{len(name)} characters, over the {MAX_NAME} a pcframe reader accepts; "
                "use shorter keys in the object's state_dict()"
            )
        if name in seen:
            raise ValueError(
                f"cannot checkpoint the state: two tensors are both at {name!r} (keys such "
                "as 0 and '0', or a key with '/' beside a list or dict of that name); give "
                "them distinct string keys without '/' in the object's state_dict()"
            )
        seen.add(name)
        if tensor.layout is not torch.strided:
            raise TypeError(
                f"cannot checkpoint tensor {name!r}: it is a {tensor.layout} tensor and pcframe "
                "stores dense ones; keep it dense in the object's state_dict() (.to_dense())"
            )
        if tensor.is_meta:
            raise TypeError(
                f"cannot checkpoint tensor {name!r}: it is on the meta device (it has no data); "
                "materialize the model first (model.to_empty(device=...), then initialise it)"
            )
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(
                f"cannot checkpoint tensor {name!r} of dtype {tensor.dtype}: pcframe stores "
                "plain dtypes only; dequantize() it in the object's state_dict()"
            )
        # Zero-sized dimensions count as 1, as the reader counts them: [0, 2**57] is empty
        # but no reader builds it.
        if tensor.dim() > MAX_DIMS or math.prod(max(d, 1) for d in tensor.shape) > MAX_NUMEL:
            raise ValueError(
                f"cannot checkpoint tensor {name!r} of shape {list(tensor.shape)}: a pcframe "
                f"reader accepts at most {MAX_DIMS} dimensions and {MAX_NUMEL} elements; "
                "reshape it in the object's state_dict()"
            )


def json_only(value: dict[str, Any], what: str, typed: bool = False) -> dict[str, Any]:
    """A deep copy of ``value`` through JSON (so later changes do not leak into the version).

    ``typed``: ``value`` goes into the state tree, which keeps the standard subtypes
    (``Counter``, ``OrderedDict``, ``defaultdict``, namedtuples, enum members:
    :mod:`pcframe.format.tree`), so they are allowed and copied as they are, not through JSON
    (which made a Counter a dict and an IntEnum an int).

    Raises:
        TypeError: naming the first key path whose value JSON would not give back as it is
            (an int key comes back as a str, a tuple as a list) or cannot hold at all.
    """
    _check_round_trip(value, what, typed)
    try:
        text = json.dumps(value, default=_json_of_enum if typed else None)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be JSON-able (no tensors or objects): {exc}") from None
    return copy.deepcopy(value) if typed else json.loads(text)


def _json_of_enum(value: Any) -> Any:
    """What JSON checks of an enum member (json.dumps takes only int and str ones)."""
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _check_round_trip(value: Any, path: str, typed: bool = False, depth: int = 0) -> None:
    if depth > MAX_DEPTH:  # JSON's reader recurses: nested ~1000 deep, no reader opens it
        shown = path if len(path) <= 200 else f"{path[:200]}..."
        raise TypeError(
            f"{shown}: nested deeper than {MAX_DEPTH} levels, which pcframe does not store; "
            "flatten it"
        )
    if isinstance(value, int) and not isinstance(value, bool) and not is_storable_int(value):
        raise TypeError(huge_int_message(path, value))
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{path}: key {key!r} ({type(key).__name__}) would not be restored as it is "
                    "(JSON keys are strings); use str keys"
                )
            _check_round_trip(item, f"{path}[{key!r}]", typed, depth + 1)
    elif isinstance(value, list) or (typed and is_namedtuple_class(type(value))):
        for index, item in enumerate(value):
            _check_round_trip(item, f"{path}[{index}]", typed, depth + 1)
    elif isinstance(value, tuple):
        raise TypeError(f"{path}: a tuple would be restored as a list; store a list")


def _plain_top(state: Any) -> Any:
    """A module's state_dict is an OrderedDict by torch's habit, not for its load_state_dict:
    a plain dict keeps such a version in format 1 (the tree keeps an OrderedDict's type)."""
    return dict(state) if type(state) is OrderedDict else state
