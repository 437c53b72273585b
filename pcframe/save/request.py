"""``SaveRequest``: what one version captures, fixed at ``save()`` and never written again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pcframe.format.layout import Layout


@dataclass(frozen=True, eq=False)
class SaveRequest:
    """The captured state of one version, as handed from the training thread to the pipeline.

    ``tensors`` are read by the copy stage: parameters and optimizer state in place (the
    optimizer step is gated on the copy), everything else cloned at capture time.
    """

    version: int
    step: int
    layout: Layout
    tensors: tuple[torch.Tensor, ...]
    tree: Any  # the encoded (JSON) state tree; tensors are {"$t": index} references
    numpy_tensors: tuple[int, ...]
    metadata: dict[str, Any]
    cuda_ready: Any = None  # torch.cuda.Event recorded on the training stream at save()
    # (index, in-place version counter at capture) of each tensor read in place: one that
    # moved before its copy finished was changed outside optimizer.step() (torn_tensors).
    watched: tuple[tuple[int, int], ...] = ()
    # (index, a sample of its values at capture) of each parameter read in place that the
    # optimizer does not step: an update through ``.data`` moves no counter, but the values.
    sampled: tuple[tuple[int, torch.Tensor], ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of state this version captures (before any codec)."""
        return self.layout.data_size

    @property
    def on_cuda(self) -> bool:
        # Capture records the event exactly when some tensor is on a GPU: no second scan.
        return self.cuda_ready is not None

    def torn_tensors(self) -> list[str]:
        """Names of the tensors read in place that changed since the capture (call once the
        copy is done: ``optimizer.step()`` waits for it, so any change was made elsewhere)."""
        moved = {i for i, version in self.watched if self.tensors[i]._version != version}
        for i, sample in self.sampled:
            now = value_sample(self.tensors[i])
            if not same_sample(now, sample):
                moved.add(i)
        return [self.layout.entries[i].name for i in sorted(moved)]


def in_place_version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (``None``: an inference tensor keeps none)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


SAMPLE_SIZE = 64  # values compared per parameter: an EMA update moves every one of them


def value_sample(tensor: torch.Tensor) -> torch.Tensor | None:
    """Up to ``SAMPLE_SIZE`` of a host tensor's values, evenly spaced, copied (``None`` on a
    device, where reading them would wait for the GPU, or for a strided tensor)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
        return None
    flat = tensor.detach().view(-1)
    return flat[:: max(1, flat.numel() // SAMPLE_SIZE)][:SAMPLE_SIZE].clone()


def same_sample(now: torch.Tensor | None, before: torch.Tensor | None) -> bool:
    """Both missing, or equal values (NaN never equals: such a tensor counts as moving)."""
    return (now is None) == (before is None) and (now is None or torch.equal(now, before))
