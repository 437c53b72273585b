"""One checkpoint directory per job of a ``--multirun`` sweep.

A sweep whose jobs share one ``directory=`` is a mistake that looks like a result: the
second job restores the first one's final checkpoint, trains nothing ("0 of N steps") and
its row joins the sweep's table. Each job claims its resolved checkpoint directory in the
sweep folder (``.pcframe-directories/``, one file per directory, created exclusively, so
jobs started in parallel by a launcher are told apart too); a job whose directory another
job of the same sweep claimed stops before training.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pcframe.errors import ConfigError

CLAIMS = ".pcframe-directories"


def claim_directory(directory: str | Path, sweep_dir: str | Path, job: int) -> None:
    """Record that job ``job`` of the sweep in ``sweep_dir`` checkpoints into ``directory``.

    Raises:
        ConfigError: another job of this sweep claimed the same directory.
    """
    resolved = str(Path(directory).expanduser().resolve())
    claims = Path(sweep_dir) / CLAIMS
    claims.mkdir(parents=True, exist_ok=True)
    claim = claims / hashlib.sha256(resolved.encode()).hexdigest()[:32]
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        owner = claim.read_text().split("\n", 1)[0].strip()
        if owner == str(job):  # the same job again (a launcher's retry)
            return
        raise ConfigError(
            f"directory={resolved} is job {owner}'s checkpoint directory too: each job of a "
            "sweep would resume the previous one's checkpoint and train nothing; leave "
            "directory unset (each job's own output folder) or make it per job, e.g. "
            "directory=/ckpts/${hydra:job.num}"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(f"{job}\n{resolved}\n")
