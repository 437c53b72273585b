"""Handles of kernel launches that may still be running on a CUDA side stream."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")

_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The per-device stream that snapshot copies run on (created once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        if index not in _streams:
            _streams[index] = torch.cuda.Stream(device=index)
        return _streams[index]


@contextlib.contextmanager
def on_side_stream(
    device: torch.device, stream: torch.cuda.Stream | None = None
) -> Iterator[torch.cuda.Stream | None]:
    """Run the body on a side stream; one made here first waits for the current stream.

    That wait makes the copy see every value the training step has written so far, while
    the training stream itself goes on without waiting for the copy. A ``stream`` given by
    the caller is used as it is: the caller has ordered it already (the engine's copy stage
    waits on an event recorded at ``save()``; waiting on the current stream here would
    make every chunk wait for whatever training work is queued by then). On CPU this is a
    no-op that yields ``None``.
    """
    if device.type != "cuda":
        yield None
        return
    if stream is None:
        stream = side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield stream


class Completion(Generic[T]):
    """Result of a kernel launch: done on CPU, possibly pending on a CUDA stream.

    Attributes:
        event: The CUDA event recorded after the launch, or ``None`` for CPU launches.
    """

    def __init__(
        self,
        value: Callable[[], T] | None = None,
        *,
        event: torch.cuda.Event | None = None,
        keepalive: Sequence[Any] = (),
        device: torch.device | None = None,
    ) -> None:
        self.event = event
        self._device = device
        self._value = value
        self._keepalive = list(keepalive)  # buffers the pending kernel still reads/writes
        self._result: T | None = None
        self._resolved = False

    @classmethod
    def record(
        cls,
        stream: torch.cuda.Stream | None,
        value: Callable[[], T] | None = None,
        keepalive: Sequence[Any] = (),
        cuda_sources: Sequence[torch.Tensor] = (),
    ) -> Completion[T]:
        """Completion of work just queued on ``stream`` (``None``: already done on CPU)."""
        if stream is None:
            return cls(value, keepalive=keepalive)
        for t in cuda_sources:
            # Keep the caching allocator from handing this memory out while the copy runs.
            t.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        return cls(value, event=event, keepalive=keepalive, device=stream.device)

    def done(self) -> bool:
        """Whether the work has finished (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block the calling thread until the work has finished."""
        if self.event is not None:
            self.event.synchronize()
        self._keepalive.clear()

    def block_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for the work, without a host sync.

        This is how an optimizer-step pre-hook gates the step on the snapshot copy.
        """
        if self.event is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self.event)

    def result(self) -> T:
        """Wait, then return the launch's value (the checksum for fused copies)."""
        self.wait()
        if not self._resolved:
            self._result = self._value() if self._value is not None else None
            self._resolved = True
        return self._result  # type: ignore[return-value]
