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
        return [
            self.layout.entries[i].name
            for i, version in self.watched
            if self.tensors[i]._version != version
        ]
