"""A Lightning fit of several processes: a ``DistributedCheckpointer`` on every rank, and
the ranks' agreement on the resume.

Several processes (``strategy="ddp"``; ``ModelParallelStrategy``, FSDP2 / DTensor) save
through :class:`pcframe.distributed.DistributedCheckpointer`, each of whose methods is
collective: every rank opens it in ``on_fit_start`` and calls it at the same steps (rank 0's
policy decides for all). One process resuming a directory that several wrote (the job
shrank) opens it too, in a process group of that process alone.

A resume is all or nothing on every rank: a refusal that only some ranks meet (their own
data position, say) must stop all of them, or the others would train into a collective the
refusing rank never joins; :meth:`Processes.agree` all-gathers each rank's outcome on a
gloo group of the callback's own. Another number of processes: the global version is
resharded; ranks beyond the saved job get saved rank 0's Lightning state, their data
starting where a fresh loader starts.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from pcframe.distributed import DistributedCheckpointer
from pcframe.distributed.global_versions import RECORDS, record_versions
from pcframe.errors import CheckpointError
from pcframe.integrations._common import refused_resume
from pcframe.integrations.lightning.messages import (
    AGAIN,
    DTYPE_FIX,
    OWNER,
    SECTION,
    error_line,
)
from pcframe.integrations.lightning.section import LightningSection
from pcframe.policies.base import IntervalPolicy
from pcframe.store.directory import CheckpointDir


def several_processes(trainer: pl.Trainer, module: pl.LightningModule, dirpath: Path) -> bool:
    """Whether this fit checkpoints through DistributedCheckpointer: several processes, a
    directory of a multi-process fit (resumed by another number of them), or DTensor
    parameters (ModelParallelStrategy, even on one device)."""
    if trainer.world_size > 1 or multi_process_layout(dirpath):
        return True
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def multi_process_layout(dirpath: Path) -> bool:
    return (dirpath / RECORDS).is_dir() and bool(record_versions(dirpath))


def one_process_versions(dirpath: Path) -> list[int]:
    """Committed versions of a one-process Checkpointer at the top of ``dirpath``."""
    if not dirpath.is_dir() or multi_process_layout(dirpath):
        return []
    try:
        return CheckpointDir(dirpath).committed_versions()
    except (OSError, CheckpointError):
        return []


class Processes:
    """The callback's part of a multi-process fit: the engine on every rank, the gloo group
    of the resume's agreement, and the process group of one process resuming alone."""

    def __init__(self, dirpath: Path, section: LightningSection) -> None:
        self.dirpath = dirpath
        self.section = section
        self.group: Any = None  # a gloo group for the resume's agreement
        self.own_world = False  # one process resuming a multi-process version: our group

    def open(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        optimizer: Any,
        scheduler: Any,
        policy: IntervalPolicy,
        resume: bool | int,
        options: dict[str, Any],
    ) -> DistributedCheckpointer:
        """A DistributedCheckpointer on every rank (each of its methods is collective)."""
        if resume is not True and resume is not False:
            raise ValueError(
                f"{OWNER}: resume={resume}: a multi-process checkpoint resumes from its newest "
                "global version; use resume='auto' (or False)"
            )
        if not dist.is_initialized():
            # One process resuming a multi-process checkpoint (another number of processes):
            # the engine's collectives run in a group of this process alone.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.own_world = True
        self.group = dist.new_group(backend="gloo")  # same order on every rank
        refusal: BaseException | None = None
        try:  # on some ranks only where each has a folder of its own: agreed
            one_process = one_process_versions(self.dirpath)
        except Exception as exc:  # an unreadable folder too: every rank must reach agree()
            refusal, one_process = exc, []
        if one_process:
            refusal = ValueError(
                f"{OWNER}: {self.dirpath} holds checkpoints of a one-process fit (versions "
                f"{one_process[0]}..{one_process[-1]}) and this fit runs {trainer.world_size} "
                "processes: give it its own dirpath, or resume that one with devices=1"
            )
        self.agree(refusal)
        return DistributedCheckpointer(
            self.dirpath,
            model=module,
            optimizer=optimizer,
            scheduler=scheduler,
            stateful={SECTION: self.section},
            policy=policy,
            **options,
        )

    def restore(self, checkpointer: DistributedCheckpointer, trainer: pl.Trainer) -> int | None:
        """``DistributedCheckpointer.restore`` on every rank, then :meth:`agree`; ranks beyond
        the saved job's get saved rank 0's Lightning state (without data positions)."""
        step: int | None = None
        error: BaseException | None = None
        try:
            with self.section.restoring():
                step = checkpointer.restore()
        except Exception as exc:
            error = exc
        self.agree(error)
        report = checkpointer.last_restore
        saved = report.saved_world_size if report is not None else None
        if step is None or saved is None or saved >= trainer.world_size:
            return step
        # A grown job: ranks >= saved world size kept their own (fresh) per-rank state.
        sent = [self.section.applied if trainer.global_rank == 0 else None]
        dist.broadcast_object_list(sent, src=0, group=self.group)
        error = None
        if report.per_rank_state_from is None:
            try:
                self.section.apply_from_rank_zero(sent[0])
            except Exception as exc:
                error = exc
        self.agree(error)
        return step

    def agree(self, error: BaseException | None) -> None:
        """Every rank learns whether the restore succeeded on every rank (one all-gather on
        the callback's gloo group), so a refusal on some ranks stops all of them, each
        saying why, instead of leaving the others to train into a collective it never
        joins. A rank that succeeded while another refused has loaded the version; it stops
        all the same (fit ends, its state is not used)."""
        mine = None if error is None else error_line(self._reworded(error))
        outcomes: list[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(outcomes, mine, group=self.group)
        except Exception:  # another rank is gone: the restore's own error says more
            if error is not None:
                raise self._reworded(error) from error
            raise
        if error is not None:
            reworded = self._reworded(error)
            if reworded is not error:  # one line: its mismatches are on it
                raise reworded from None
            raise error
        refused = [(rank, why) for rank, why in enumerate(outcomes) if why is not None]
        if refused:
            rank, why = refused[0]
            raise CheckpointError(
                f"{OWNER}: rank {rank} refused the resume ({why}); every rank stops: fix it "
                f"and {AGAIN}"
            )

    def _reworded(self, error: BaseException) -> BaseException:
        """A refusal because the saved state does not fit (another model, dtype, optimizer,
        scheduler) as one line naming the folder and the fix; any other error as it is."""
        return refused_resume(OWNER, self.dirpath, error, dtype_fix=DTYPE_FIX) or error

    def release(self) -> None:
        """Destroy the agreement's group, and the one-process world if this made it."""
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
        if self.own_world:
            self.own_world = False
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
