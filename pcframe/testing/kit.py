"""What the conformance kits share: the factory plumbing and the engine's JSON round trip."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar


def json_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """What the engine does with a state dict: strict JSON (no NaN/inf) out and back in."""
    assert isinstance(state, dict), f"state_dict() must return a dict, got {type(state)}"
    text = json.dumps(state, allow_nan=False)
    back = json.loads(text)
    assert back == state, "state_dict() must hold JSON types only (no tuples, numpy, objects)"
    return back


class Kit:
    """Factory plumbing shared by the kits."""

    factory: ClassVar[Callable[[], Any] | None] = None

    def make(self) -> Any:
        """A fresh policy; override this or set ``factory`` on the subclass."""
        factory = type(self).factory
        if factory is None:
            raise NotImplementedError(
                f"{type(self).__name__}: set `factory = staticmethod(lambda: MyPolicy(...))` "
                "or override make()"
            )
        return factory()
