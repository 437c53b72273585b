"""The engine a ``PcframeCallback`` opens on its folder, and what it says about the folder.

One process: pcframe's :class:`~pcframe.Checkpointer`. A ``torch.distributed`` job (the
Trainer under ``torchrun`` / ``accelerate launch``: DDP, accelerate's FSDP2): a
:class:`~pcframe.distributed.DistributedCheckpointer` on every rank, whose every call is
collective (the Trainer calls the callback's hooks at the same steps on every rank). It
takes the model as the Trainer holds it: plain tensors are replicated (DDP: each written
once, by its owner rank), DTensors sharded (FSDP2: each rank its own blocks); a restore with
another number of processes reshards them.

The two keep different layouts (``vNNNNNNNN/`` against ``rank-<r>/`` and ``global/``); a
folder the other kind wrote is refused in one line before anything is opened, since neither
engine would see the other's versions and the run would silently start from step 0.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pcframe.checkpointer import Checkpointer
from pcframe.distributed import DistributedCheckpointer, global_versions
from pcframe.errors import CheckpointError
from pcframe.feed import policy_notice
from pcframe.integrations._common import DISTRIBUTED_ARGUMENTS
from pcframe.integrations._hf_state import SECTION, TrainerStateSection
from pcframe.policies.notices.base import polled
from pcframe.store.directory import CheckpointDir

Engine = Checkpointer | DistributedCheckpointer


# torchrun --max-restarts: the restarted ranks share the launcher's store with the attempt
# before, whose gloo addresses are still in it under the same keys; a rank that reads one
# before its peer overwrote it connects to a dead process (torch 2.13).
STALE_STORE = (
    "PcframeCallback: the ranks restarted by torchrun could not connect their gloo groups: "
    "the launcher's shared store still holds the previous attempt's addresses. Launch with "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-backend c10d --rdzv-endpoint "
    "<host>:<port> (each attempt then gets a fresh store); pcframe resumes the newest "
    "global version"
)


def restarted_on_stale_store(error: RuntimeError) -> bool:
    """Whether ``error`` is the stale-store failure of a rank torchrun restarted."""
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return restarted and shared and "connectFullMesh" in str(error)


def job_ranks() -> int | None:
    """The processes of this job when torch.distributed runs (``None``: one plain process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return None


def check_folder_on_every_rank(owner: str, directory: Path, ranks: int | None) -> None:
    """:func:`check_folder` on every rank, its outcome agreed (collective when ``ranks``):
    where each rank has a folder of its own (a node's disk), one rank's refusal stops every
    rank naming it, instead of leaving the others to wait for it in the engine's open."""
    if ranks is None:
        check_folder(owner, directory, ranks)
        return
    error: BaseException | None = None
    try:
        check_folder(owner, directory, ranks)
    except Exception as exc:  # an unreadable folder too: every rank must reach the gather
        error = exc
    group = dist.new_group(backend="gloo")  # same order on every rank
    try:
        outcomes: list[Any] = [None] * ranks
        dist.all_gather_object(outcomes, None if error is None else str(error), group=group)
    finally:
        dist.destroy_process_group(group)
    if error is not None:
        raise error
    refused = next(((r, why) for r, why in enumerate(outcomes) if why is not None), None)
    if refused is not None:
        raise ValueError(
            f"{owner}: rank {refused[0]} refused its folder ({refused[1]}); every rank stops"
        )


def check_folder(owner: str, directory: Path, ranks: int | None) -> None:
    """Refuse ``directory`` in one line when the other kind of job wrote it (``ranks``: as
    :func:`job_ranks`)."""
    records = global_versions.record_versions(directory)
    multi = bool(records) or (directory / global_versions.rank_dirname(0)).is_dir()
    single = CheckpointDir(directory).committed_versions()
    if ranks is None and multi:
        good, _ = global_versions.valid_records(directory)
        what = (
            f"a job of {good[0].world_size} process(es) (global version {good[0].version}, "
            f"step {good[0].step})"
            if good
            else "a job of several processes"
        )
        raise ValueError(
            f"{owner}: {directory} holds the checkpoints of {what}, which one process without "
            "torch.distributed cannot read: resume them under torchrun (--nproc-per-node 1 "
            "for one process; pcframe reshards), or give this run its own output_dir"
        )
    if ranks is not None and single and not multi:
        raise ValueError(
            f"{owner}: {directory} holds the checkpoints of a one-process run (versions "
            f"{single[0]}..{single[-1]}), which a job of {ranks} process(es) under "
            "torch.distributed cannot read: resume them with one process (python "
            "<script>, no launcher), or give this job its own output_dir"
        )


def open_engine(
    directory: Path,
    ranks: int | None,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    section: TrainerStateSection,
    policy: Any,
    options: dict[str, Any],
) -> Engine:
    """The engine for this job; the TrainerState section is every version's ``stateful``
    entry (per rank in a job of several: each rank applies its own inside its restore)."""
    objects = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "stateful": {SECTION: section},
        "policy": policy,
    }
    if ranks is not None:
        try:
            return DistributedCheckpointer(directory, **objects, **options)
        except RuntimeError as exc:
            if restarted_on_stale_store(exc):
                raise RuntimeError(STALE_STORE) from exc
            raise
    local = {k: v for k, v in options.items() if k not in DISTRIBUTED_ARGUMENTS}
    return Checkpointer(directory, **objects, **local)


def restore(engine: Engine, resume: bool | int) -> int | None:
    """The engine's restore: the newest valid version (``True``) or version ``resume``."""
    if isinstance(engine, DistributedCheckpointer):
        return engine.restore()  # the newest global version that verifies on every rank
    return engine.restore(None if resume is True else resume)


def save_now(engine: Engine, step: int, metadata: dict[str, Any]) -> None:
    """The version of the step after which training stops."""
    if isinstance(engine, DistributedCheckpointer):
        engine.save(step, metadata)
    else:
        engine.save(step, metadata, reason="save_last")


def notice_pending(engine: Engine) -> bool:
    """Whether a preemption notice is pending for one process's engine (its sources polled,
    nothing recorded): its save is not put off until after an evaluation. A job of several
    processes: ``False``, as every rank must call the engine at the same hook (the ranks
    agree on a notice inside ``maybe_save``)."""
    if isinstance(engine, DistributedCheckpointer):
        return False
    now = time.monotonic()
    notices = [polled(source, now) for source in engine.notices]
    notices.append(policy_notice(engine.policy, now))
    return any(notice is not None and now <= notice.deadline for notice in notices)


def share_trainer_state(engine: Engine, section: TrainerStateSection) -> None:
    """After a restore into more processes than saved the version: the ranks the saved job
    did not have got no TrainerState (per-rank state comes from the same rank of the saved
    job); each applies saved rank 0's, the same on every rank (collective)."""
    if not isinstance(engine, DistributedCheckpointer):
        return
    report = engine.last_restore
    saved = report.saved_world_size if report is not None else None
    if saved is None or saved >= engine.world_size:
        return
    sent = [section.applied if engine.rank == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    if report is not None and report.per_rank_state_from is None:
        if not isinstance(sent[0], dict):
            raise CheckpointError(
                f"rank 0 sent no TrainerState to rank {engine.rank} after the restore"
            )
        with section.restoring():
            section.load_state_dict(sent[0])


def resume_summary(engine: Engine) -> str:
    """What the last restore did, for the resume line: the version, the versions skipped as
    damaged, and a change of the number of processes."""
    report = engine.last_restore
    if report is None:
        return ""
    said = [f"version {report.version}"]  # the versions skipped have a line each (fallbacks)
    saved = getattr(report, "saved_world_size", None)
    if isinstance(engine, DistributedCheckpointer) and saved not in (None, engine.world_size):
        said.append(f"saved by {saved} process(es), resharded for {engine.world_size}")
    return "; ".join(said)


def fallbacks(engine: Engine, directory: Path) -> list[str]:
    """One line for each version the last restore fell back from: damaged (set aside), or,
    in a job of several processes, a shard no surviving holder has."""
    report = engine.last_restore
    if report is None:
        return []
    said = [
        f"version {version} in {directory} is damaged ({first_line(why)}); falling back to "
        "an older version"
        for version, why in report.skipped
    ]
    said += [
        f"global version {version} in {directory} cannot be gathered ({first_line(why)}); "
        "falling back to an older version"
        for version, why in getattr(report, "lost", None) or []
    ]
    return said


def first_line(why: object) -> str:
    text = " ".join(str(why).split())
    return text if len(text) <= 160 else text[:157] + "..."
