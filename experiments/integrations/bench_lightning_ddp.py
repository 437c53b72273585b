"""Lightning DDP on 2 CPU processes: PcframeCheckpoint vs ModelCheckpoint (sync, and with
Lightning's AsyncCheckpointIO), at the same interval.

    python experiments/integrations/bench_lightning_ddp.py \
        --repeats 4 --out experiments/results/lightning_ddp.md

One job of two rank processes (gloo, started as torchrun starts them), each fit in it a
``Trainer(strategy="ddp", devices=2, accelerator="cpu")`` on the same model and data; the
four ways of checkpointing run in rotating order in each round, so drift on a shared machine
hits all alike. Every fit trains ``--steps`` optimizer steps and checkpoints every
``--every`` steps, each checkpoint followed by at least one step (the last step is not
saved, so no fit ends waiting on a save it just started); a fit without checkpointing is the
baseline. Measured on rank 0 (``perf_counter`` at every batch start and at the end):

- the stall per checkpoint: the checkpoint's step plus the next one, minus twice the median
  of the same fit's other steps (pcframe's ``optimizer.step`` may wait for the snapshot copy
  in the next step);
- how much slower the steps without a checkpoint are than the baseline's (same round);
- the training time (first batch to last) and its overhead over the baseline;
- the whole ``fit`` (setup, and the end that waits for saves in flight).

What each one has made durable differs: ModelCheckpoint writes ``torch.save`` files from rank
0 without fsync (the page cache holds them); pcframe's versions are fsynced, checksummed and
globally committed by every rank (each writing its half of the replicated state).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODES = ("none", "pcframe", "ModelCheckpoint", "ModelCheckpoint + AsyncCheckpointIO")


# --- one rank ----------------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins import AsyncCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from pcframe.integrations.lightning import PcframeCheckpoint

    warnings.filterwarnings("ignore")  # Lightning's advice for a CPU run (workers, logging)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])

    class Model(pl.LightningModule):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(width, 2 * width),
                torch.nn.ReLU(),
                torch.nn.Linear(2 * width, 2 * width),
                torch.nn.ReLU(),
                torch.nn.Linear(2 * width, width),
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(pl.Callback):
        """Batch starts and the end of the last batch (perf_counter), on this rank."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.end = 0.0

        def on_train_batch_start(self, *a: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, *a: Any) -> None:
            self.end = time.perf_counter()

    gen = torch.Generator().manual_seed(0)
    samples = 64 * args.steps
    data = TensorDataset(
        torch.randn(samples, args.width, generator=gen),
        torch.randn(samples, args.width, generator=gen),
    )

    def fit(mode: str, steps: int, where: Path) -> dict[str, Any]:
        torch.manual_seed(0)
        clock = Clock()
        callbacks: list[Any] = [clock]
        plugins: list[Any] = []
        if mode == "pcframe":
            callbacks.append(
                PcframeCheckpoint(where, every_n_train_steps=args.every, save_last=False)
            )
        elif mode.startswith("ModelCheckpoint"):
            callbacks.append(ModelCheckpoint(where, every_n_train_steps=args.every))
            if "Async" in mode:
                plugins.append(AsyncCheckpointIO())
        trainer = pl.Trainer(
            max_steps=steps,
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=mode != "none",  # on: no default ModelCheckpoint is added
            callbacks=callbacks,
            plugins=plugins,
        )
        model = Model(args.width)
        loader = DataLoader(data, batch_size=32)
        start = time.perf_counter()
        trainer.fit(model, train_dataloaders=loader)
        whole = time.perf_counter() - start
        steps_s = [b - a for a, b in zip(clock.starts, [*clock.starts[1:], clock.end], strict=True)]
        return {"train": clock.end - clock.starts[0], "fit": whole, "steps": steps_s}

    base = Path(args.workdir)
    fit("none", 5, base / "warm-up")  # first-fit costs (gloo, allocator) out of the rounds
    results: list[dict[str, Any]] = []
    for round_ in range(args.repeats):
        order = MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]
        for mode in order:
            where = base / f"{round_}-{mode.split()[0]}"
            result = fit(mode, args.steps, where)
            results.append({"round": round_, "mode": mode, **result})
            if rank == 0:
                shutil.rmtree(where, ignore_errors=True)  # the disk stays as it was
    if rank == 0:
        Path(args.json).write_text(json.dumps(results))


# --- the job and the table ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args: argparse.Namespace, workdir: Path, result: Path) -> None:
    """Two rank processes with torchrun's environment; one dies, the other is killed."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    forwarded = ["--steps", str(args.steps), "--every", str(args.every)]
    forwarded += ["--width", str(args.width), "--repeats", str(args.repeats)]
    command = [sys.executable, __file__, "--rank", "--workdir", str(workdir), "--json"]
    procs = [
        subprocess.Popen(
            [*command, str(result), *forwarded],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ]
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
        time.sleep(0.2)
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"the benchmark job failed: exit codes {codes}")


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    values = [v * scale for v in values]
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    from results_file import table_lines

    marks = checkpoint_steps(args)
    # A checkpoint stalls its own step (on_train_batch_end) and may stall the next one
    # (pcframe's optimizer.step waits for the snapshot copy): both, against the same run's
    # median of the other steps, so a burst of other work on the machine in another run
    # does not count.
    hit = {i for m in marks for i in (m, m + 1)}
    base = {r["round"]: r for r in results if r["mode"] == "none"}
    rows = []
    for mode in MODES:
        runs = [r for r in results if r["mode"] == mode]
        overhead, stall, slower = [], [], []
        for run in runs:
            ref = base[run["round"]]
            overhead.append(run["train"] / ref["train"] - 1)
            quiet = statistics.median(s for i, s in enumerate(run["steps"]) if i not in hit)
            stall += [run["steps"][m] + run["steps"][m + 1] - 2 * quiet for m in marks]
            slower.append(quiet / statistics.median(ref["steps"]) - 1)
        rows.append(
            [
                mode,
                spread([statistics.median(r["steps"]) for r in runs], 1000, 0),
                "-" if mode == "none" else spread(slower, 100, 1),
                "-" if mode == "none" else spread(stall, 1000, 0),
                spread([r["train"] for r in runs]),
                "-" if mode == "none" else spread(overhead, 100, 1),
                spread([r["fit"] for r in runs]),
            ]
        )
    headers = [
        "checkpointing",
        "median step ms",
        "steps without a checkpoint: slower than none, %",
        "stall per checkpoint, ms",
        "training s",
        "training: over none, %",
        "whole fit s",
    ]
    return table_lines(headers, rows, "lrrrrrr")


def checkpoint_steps(args: argparse.Namespace) -> list[int]:
    """0-based indices of the steps that checkpoint (each followed by one more step)."""
    return [s - 1 for s in range(args.every, args.steps, args.every)]


def state_mib(width: int) -> float:
    params = width * 2 * width + 2 * width + (2 * width) ** 2 + 2 * width + 2 * width * width
    return 3 * (params + width) * 4 / 2**20  # weights and AdamW's two moments, float32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a tmp dir)")
    parser.add_argument("--out", default=str(REPO / "experiments/results/lightning_ddp.md"))
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return rank_main(args)
    if not checkpoint_steps(args):
        parser.error("--steps must be more than --every (a checkpoint and a step after it)")
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
    from results_file import command_line, header, write_results

    workdir = Path(tempfile.mkdtemp(prefix="bench-lightning-ddp-", dir=args.dir))
    try:
        result = workdir / "results.json"
        started = time.perf_counter()
        run_job(args, workdir, result)
        results = json.loads(result.read_text())
        took = time.perf_counter() - started
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    load = os.getloadavg()[0]
    lines = header(
        "Lightning DDP (2 CPU processes): PcframeCheckpoint vs ModelCheckpoint",
        command_line(),
        f"{os.cpu_count()} CPUs shared with other jobs (load average {load:.1f} at the end)",
    )
    lines += [
        f"A {state_mib(args.width):.0f} MiB training state (MLP of width {args.width}, float32 "
        f"weights and AdamW moments), {args.steps} steps of batch 32 per process, a "
        f"checkpoint every {args.every} steps ({len(checkpoint_steps(args))} per fit, none "
        f"at the last step), {args.repeats} rounds with the four in rotating order "
        f"(benchmark {took:.0f} s). Median (min..max) over the rounds, the stall over every "
        "checkpoint of every round: the checkpoint's step and the next, minus twice the "
        "median of that fit's other steps. 'Slower than none': the median of the steps "
        "without a checkpoint against the baseline fit's median step, same round (pcframe: "
        "maybe_save's all-gather at every step, and the background writes sharing the "
        "CPUs). 'Training': first batch start to last batch end; 'whole fit': trainer.fit, "
        "setup and the wait for saves in flight at the end included.",
        "",
        *table(results, args),
        "",
        "The machine is shared: other work ran beside this one, so compare columns within a "
        "row's spread, not the last digit. ModelCheckpoint's files are written by rank 0 "
        "with torch.save and not fsynced; pcframe's versions are fsynced, checksummed and "
        "committed by both ranks (each writing half of the replicated state). "
        "ModelCheckpoint keeps 1 file (save_top_k=1), pcframe its default keep_last.",
    ]
    write_results(args.out, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
