"""A Lightning fit of N real processes (CPU, gloo) checkpointed by PcframeCheckpoint: the
multi-process tests' ranks, and the warm launcher that starts them.

A rank: ``main(args)`` in a process whose environment is torchrun's contract (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); Lightning's environment detection then
takes the processes as created outside it (``LightningEnvironment``), as under torchrun, so
a test can SIGKILL one rank and restart the whole job as a launcher would.

``python train_child_lightning_ddp.py serve``: the launcher. Importing Lightning costs each
process several seconds of CPU; the launcher imports it once, then forks the ranks of each
job asked on its stdin (one JSON line: world size, arguments, log folder, port, environment
and each rank's additions, e.g. ``PCFRAME_CRASH_AT``), answers
their pids, and, like torchrun, SIGKILLs the others when one rank dies (unless the job
says ``kill_on_failure: false``); it answers the
ranks' exit codes (negative: the signal) when all have ended. A rank is a real process of
its own (its own pid, process group membership, gloo sockets, files), forked before any
thread or process group exists.

Each rank writes ``OUT/final-r<rank>.pt`` at the end of its fit (weights, optimizer,
scheduler, torch RNG, data position, global step, the step it resumed from),
``OUT/start-r<rank>.pt`` when it resumed, ``OUT/at<step>-r<rank>.pt`` at each ``--dump-at``
step, ``OUT/held-r<rank>`` when it reaches ``--hold-at`` (it then waits to be killed), and
the callback's log lines with their level in ``OUT/said-r<rank>.log``.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import logging
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

import pcframe.runtime.faults
from pcframe import ResumableLoader, ResumableSampler
from pcframe.integrations.lightning import PcframeCheckpoint

warnings.filterwarnings("ignore", module="lightning")  # tiny model on CPU: harmless advice

SAMPLES = 48
GLOBAL_BATCH = 12  # split evenly among 1, 2 or 3 processes: 4 batches an epoch on each


class Tiny(pl.LightningModule):
    def __init__(self, hidden: int, fsdp: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(hidden, 1),
        )
        self.fsdp = fsdp

    def configure_model(self) -> None:
        if self.fsdp:  # ModelParallelStrategy: FSDP2 over the data-parallel mesh
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[3]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> ResumableLoader:
        # This rank's share of the data, the global batch kept whatever the number of
        # processes (a resume by another number of them then has epochs of the same length).
        world, rank = self.trainer.world_size, self.trainer.global_rank
        gen = torch.Generator().manual_seed(1)
        data = TensorDataset(
            torch.randn(SAMPLES, 8, generator=gen), torch.randn(SAMPLES, 1, generator=gen)
        )
        mine = Subset(data, range(rank, SAMPLES, world))
        sampler = ResumableSampler(len(mine), seed=3 + rank)
        return ResumableLoader(DataLoader(mine, batch_size=GLOBAL_BATCH // world, sampler=sampler))


class Probe(pl.Callback):
    """What the tests compare, and where they kill."""

    def __init__(self, out: Path, rank: int, args: argparse.Namespace, ckpt: Any) -> None:
        self.out, self.rank, self.args, self.ckpt = out, rank, args, ckpt

    def state(self, trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        optimizer = trainer.optimizers[0]
        full = {k: _full(v) for k, v in module.state_dict().items()}
        return {
            "model": full,
            "optimizer": copy.deepcopy(_full(optimizer.state_dict())),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step,
            "resumed_step": self.ckpt.resumed_step,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "data": trainer.train_dataloader.state_dict(),
        }

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.ckpt.resumed_step is not None:
            torch.save(self.state(trainer, module), self.out / f"start-r{self.rank}.pt")

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.args.hold_at and self.rank in self.args.hold_ranks:
            (self.out / f"held-r{self.rank}").write_text(str(os.getpid()))
            while True:  # the test SIGKILLs this rank here
                time.sleep(0.05)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *a: Any) -> None:
        if trainer.global_step in self.args.dump_at:
            state = self.state(trainer, module)
            torch.save(state, self.out / f"at{trainer.global_step}-r{self.rank}.pt")

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        torch.save(self.state(trainer, module), self.out / f"final-r{self.rank}.pt")


def _full(value: Any) -> Any:
    """DTensors (FSDP2) as whole tensors, so ranks and runs compare directly."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dirpath")
    parser.add_argument("steps", type=int)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--hold-ranks", type=int, nargs="*", default=[])
    parser.add_argument("--dump-at", type=int, nargs="*", default=[])
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--precision", default="32-true", help="the Trainer's precision=")
    args = parser.parse_args(argv)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    args.out.mkdir(parents=True, exist_ok=True)
    # The callback's lines with their level, beside what Lightning's console handler shows.
    said = logging.FileHandler(args.out / f"said-r{rank}.log")
    said.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("lightning.pytorch.callbacks.pcframe").addHandler(said)
    pl.seed_everything(0, verbose=False)
    # "{rank}" in the folder: each rank its own (a node-local folder per rank)
    callback = PcframeCheckpoint(args.dirpath.format(rank=rank), every_n_train_steps=args.every)
    strategy: Any = "auto"
    if args.fsdp:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    elif world > 1:
        strategy = "ddp"
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cuda" if args.cuda else "cpu",
        devices=world,
        strategy=strategy,
        use_distributed_sampler=False,  # each rank's share is its train_dataloader's
        deterministic=True,
        precision=args.precision,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        callbacks=[callback, Probe(args.out, rank, args, callback)],
    )
    trainer.fit(Tiny(args.hidden, args.fsdp))
    print(f"rank {rank} resumed_step {callback.resumed_step} global_step {trainer.global_step}")


# --- the warm launcher --------------------------------------------------------------------------


def _rank(env: dict[str, str], args: list[str], log: str) -> None:
    """The forked rank: its own environment, output into its log, exit as python would."""
    try:
        os.setpgid(0, 0)  # killed alone, not with the launcher's group
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.clear()
        os.environ.update(env)
        # pcframe read PCFRAME_CRASH_AT when the launcher imported it: read this rank's.
        importlib.reload(pcframe.runtime.faults)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve() -> None:
    """Fork the ranks of each job asked on stdin; answer their pids, then their exit codes."""
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        job = json.loads(line)
        pids = []
        for rank in range(job["world"]):
            env = {
                **job["env"],
                **job.get("rank_env", {}).get(str(rank), {}),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(job["world"]),
                "MASTER_PORT": str(job["port"]),
            }
            pid = os.fork()
            if pid == 0:
                _rank(env, job["args"], f"{job['logdir']}/rank{rank}.log")
            pids.append(pid)
        answer.write(json.dumps({"pids": pids}) + "\n")
        codes: dict[int, int] = {}
        while len(codes) < len(pids):
            pid, status = os.wait()
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and job.get("kill_on_failure", True):  # as torchrun
                for other in pids:
                    if other not in codes:
                        os.kill(other, signal.SIGKILL)
        answer.write(json.dumps({"codes": [codes[p] for p in pids]}) + "\n")
    answer.flush()
    os._exit(0)  # stdin closed: no job left (skips seconds of torch's interpreter shutdown)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        main(sys.argv[1:])
