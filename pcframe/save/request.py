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

    @property
    def nbytes(self) -> int:
        """Bytes of state this version captures (before any codec)."""
        return self.layout.data_size

    @property
    def on_cuda(self) -> bool:
        # Capture records the event exactly when some tensor is on a GPU: no second scan.
        return self.cuda_ready is not None
