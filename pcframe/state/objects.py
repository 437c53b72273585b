"""``TrainingObjects``: the live objects one checkpointer saves and restores."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from pcframe.runtime.checks import require_object

Stateful = Any  # anything with state_dict() / load_state_dict()


class Section(StrEnum):
    """The sections of a version's state tree: one per training object a checkpointer
    saves and restores, in one place (each section's key in the tree is its value)."""

    MODEL = "model"
    OPTIMIZER = "optimizer"
    SCHEDULER = "scheduler"
    SCALER = "scaler"
    STATEFUL = "stateful"  # the data position and any other named object
    EXTRA = "extra"  # a JSON-able dict updated in place on restore
    POLICY = "policy"  # the interval policy's learned state
    RNG = "rng"  # every random number generator (captured, not given)


# Sections kept per rank by a multi-rank checkpoint (each rank's own), and those whose
# tensors a restore may read straight into the live objects.
PER_RANK = (Section.RNG, Section.STATEFUL, Section.POLICY)
IN_PLACE = (Section.MODEL, Section.OPTIMIZER)


@dataclass
class TrainingObjects:
    """Model, optimizer, scheduler, scaler, named stateful objects, JSON extras, policy.

    Every entry is optional. ``stateful`` holds the data position (``data=`` of the
    Checkpointer is ``stateful["data"]``) and any other object with ``state_dict()`` and
    ``load_state_dict()``; ``extra`` is a JSON-able dict updated in place on restore.
    """

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    scaler: Any = None
    stateful: Mapping[str, Stateful] = field(default_factory=dict)
    extra: dict[str, Any] | None = None
    policy: Any = None  # the interval policy, whose learned state is saved with each version

    @classmethod
    def given(
        cls,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        scaler: Any,
        data: Stateful | None,
        stateful: Mapping[str, Stateful] | None,
        extra: dict[str, Any] | None,
        policy: Any = None,
    ) -> TrainingObjects:
        """From the front doors' arguments: ``data`` is ``stateful["data"]``."""
        if _named_pairs(stateful):  # (name, object) pairs, as dict() takes them
            stateful = dict(stateful)
        if stateful is not None and not isinstance(stateful, Mapping):
            raise TypeError(
                f"stateful= is a {type(stateful).__name__}: give a dict of name -> object "
                "with state_dict() and load_state_dict(), e.g. stateful={'ema': ema}"
            )
        named = dict(stateful or {})
        if data is not None:
            named["data"] = data
        return cls(model, optimizer, scheduler, scaler, named, extra, policy)

    def __post_init__(self) -> None:
        # Checked at construction: each of these failed only at the first save or decision.
        for what, obj in (
            (Section.MODEL, self.model),
            (Section.SCHEDULER, self.scheduler),
            (Section.SCALER, self.scaler),
        ):
            if obj is not None and not (
                hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
            ):
                raise TypeError(
                    f"{what}= is a {type(obj).__name__}, which has no state_dict() and "
                    f"load_state_dict(); pass the torch object (a plain dict of tensors goes "
                    "in stateful= as an object with both methods)"
                )
        if self.model is not None and not (
            isinstance(self.model, torch.nn.Module) or hasattr(self.model, "parameters")
        ):  # a restore loads a model through its parameters and buffers
            raise TypeError(
                f"model= is a {type(self.model).__name__}, not a torch.nn.Module; pass an "
                "object that only has state_dict() and load_state_dict() in stateful= instead"
            )
        if isinstance(self.model, torch.nn.Module) and isinstance(
            self.optimizer, torch.optim.Optimizer
        ):  # checked again at each save whose param groups changed
            check_params_are_the_models(
                optimizer_param_names(self.model, self.optimizer), self.optimizer
            )
        if self.extra is not None and not isinstance(self.extra, dict):
            # Restore updates the dict in place: any other object would be saved each time
            # and never restored.
            raise TypeError(
                f"extra= is a {type(self.extra).__name__}: give a dict of JSON values (it is "
                "updated in place on restore)"
            )
        # Duck-typed (a user's policy need not derive from IntervalPolicy); a class has a
        # decide too, as a function, and failed at the first maybe_save.
        require_object("policy", self.policy, "decide", "an interval policy", "FixedSteps(100)")
        for name, obj in self.stateful.items():
            if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                continue
            if isinstance(obj, torch.utils.data.DataLoader):
                raise TypeError(
                    f"stateful[{name!r}] is a plain DataLoader, whose position cannot be saved: "
                    "wrap it as pcframe.ResumableLoader(DataLoader(..., "
                    "sampler=pcframe.ResumableSampler(len(dataset)))), or use torchdata's "
                    "StatefulDataLoader"
                )
            raise TypeError(f"stateful[{name!r}] needs state_dict() and load_state_dict()")


def class_name(obj: Any) -> str:
    """The name a version stores as ``optimizer_class`` (``scheduler_class``) next to the
    optimizer's (scheduler's) state."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_param_names(model: Any, optimizer: Any) -> list[list[str | None]]:
    """Each param group's parameters by their name in ``model`` (``None``: not the model's).

    A version stores it as ``optimizer_param_names`` beside the optimizer's state: torch
    keys that state by position in the param groups, so an optimizer built from the same
    parameters in another order (modules registered in another order, a layer renamed)
    would load every moment into another parameter of the same shape.
    """
    names = {id(param): name for name, param in model.named_parameters()}
    return [[names.get(id(param)) for param in group["params"]] for group in optimizer.param_groups]


def check_params_are_the_models(names: list[list[str | None]], optimizer: Any) -> None:
    """Refuse an optimizer stepping parameters the model does not hold (``names`` from
    :func:`optimizer_param_names`): only ``model.state_dict()`` saves parameter values, so a
    CLIP-style ``logit_scale`` given to the optimizer alone was never saved, and a restore
    put its moments back beside its initial value, silently.

    Raises:
        ValueError: naming the first such parameter (group, position, shape) and the fix.
    """
    outside = [
        (g, i) for g, group in enumerate(names) for i, name in enumerate(group) if name is None
    ]
    if outside:
        g, i = outside[0]
        shape = list(optimizer.param_groups[g]["params"][i].shape)
        raise ValueError(
            f"the optimizer steps {len(outside)} parameter(s) the model does not hold (first: "
            f"param group {g}, position {i}, shape {shape}): their values would not be saved; "
            "register them on the model (model.logit_scale = nn.Parameter(...)) so that its "
            "state_dict() holds them"
        )


def require_step_hook(optimizer: Any) -> None:
    """The engine gates ``optimizer.step()`` (the snapshot of the weights it changes is
    copied first): a save's gate needs ``register_step_pre_hook``.

    Raises:
        TypeError: naming the optimizer's type and the fix.
    """
    if optimizer is not None and not hasattr(optimizer, "register_step_pre_hook"):
        raise TypeError(
            f"optimizer ({type(optimizer).__name__}) is not a torch.optim.Optimizer: the "
            "engine gates its step() with register_step_pre_hook; pass the torch optimizer it "
            "wraps (or give it as stateful={'optimizer': ...}: saved, but its step not gated, "
            "so each save copies the whole state before returning)"
        )


def _named_pairs(given: Any) -> bool:
    """Whether ``given`` is a list or tuple of ``(name, object)`` pairs."""
    return isinstance(given, (list, tuple)) and all(
        isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) for pair in given
    )
