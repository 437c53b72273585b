"""Numbering the writers of a checkpoint directory, so a restore knows who died unseen.

The interval policy's state travels inside the checkpoint, so a process that dies before
committing takes what it learned with it. To count those lives anyway, every
``Checkpointer`` that opens a directory takes the next number in its ``.starts`` file (once
it is fully built, before any version) and each manifest records the number of the writer
that made it (``engine.writer_start``), how many clean closes preceded it
(``writer_clean``) and which count the number belongs to (``writer_epoch``). A later
writer restoring that version then knows how many writers ended since without a clean
close: :meth:`Starts.unseen`, reported as ``Restarted.unseen_starts``.

The epoch is a random id minted whenever counting starts afresh (a new, damaged or
unwritable ``.starts``), so a number is only ever compared with numbers of the same count:
not with a version written through another directory (a shared tier), nor with one
written before the count was lost.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pcframe.errors import NotRegularFile
from pcframe.format.files import read_small

log = logging.getLogger("pcframe")

STARTS = ".starts"
_EPOCH = re.compile(r"^[0-9a-f]{16}$")
_LIMIT = 1 << 62
# ``Checkpointer.resumed`` when the loaded state's writer is not known: counts nothing.
UNKNOWN_WRITER: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Starts:
    """This writer's number (1, 2, ...; 0: not counted), the clean closes among the writers
    before it, and the count's epoch."""

    number: int = 0
    clean: int = 0
    epoch: str = ""

    def manifest_fields(self) -> dict[str, Any]:
        """What a version's manifest records about its writer (``engine`` section)."""
        return {"writer_start": self.number, "writer_clean": self.clean, "writer_epoch": self.epoch}

    def unseen(self, written: Mapping[str, Any] | None) -> int:
        """``Restarted.unseen_starts`` for this writer.

        The writers that ended without a clean close (killed, preempted, crashed) since
        the one that wrote the restored version, itself included, less the newest of them
        (the ``Restarted`` event itself stands for it). ``written``: the restored
        manifest's ``engine`` section; ``None`` when nothing was restored (every earlier
        writer counts). 0 whenever the version's writer is unknown or of another count.
        """
        if not self.number:
            return 0
        if written is None:
            died = self.number - 1 - self.clean
        else:
            number, clean = written.get("writer_start"), written.get("writer_clean")
            if (
                written.get("writer_epoch") != self.epoch
                or type(number) is not int
                or type(clean) is not int
                or not 0 < number < self.number
                or not 0 <= clean <= self.clean
            ):
                return 0
            died = (self.number - number) - (self.clean - clean)
        return max(0, died - 1)

    def to_bytes(self) -> bytes:
        body = {"starts": self.number, "clean": self.clean, "epoch": self.epoch}
        return json.dumps(body).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Starts | None:
        try:
            body = json.loads(raw)
            number, clean, epoch = body["starts"], body["clean"], body["epoch"]
        except (ValueError, TypeError, KeyError):
            return None
        counts = all(type(v) is int and 0 <= v < _LIMIT for v in (number, clean))
        if not counts or not clean < number or not isinstance(epoch, str):
            return None
        return cls(number, clean, epoch) if _EPOCH.match(epoch) else None


def count_start(root: Path, previous_clean: bool, write) -> Starts:
    """Take the next writer number in ``root/.starts`` (written with ``write(path, bytes)``,
    durably). ``previous_clean``: the previous writer closed cleanly. A damaged or
    unreadable count starts afresh under a new epoch; one that cannot be written leaves
    this writer uncounted (``Starts()``): a count must never stop training."""
    path = root / STARTS
    previous: Starts | None = None
    try:
        previous = Starts.parse(read_small(path, 256))
        if previous is None:
            log.warning("ignoring %s: not pcframe's writer count; counting afresh", path)
    except FileNotFoundError:
        pass
    except (OSError, NotRegularFile) as exc:
        log.warning("ignoring %s (%s): counting writer starts afresh", path, exc)
    if previous is None:
        starts = Starts(1, 0, secrets.token_hex(8))
    else:
        starts = Starts(previous.number + 1, previous.clean + previous_clean, previous.epoch)
    try:
        write(path, starts.to_bytes())
    except OSError as exc:
        log.warning("cannot write %s (%s): restarts will not be counted", path, exc)
        return Starts()
    return starts
