"""The Hugging Face Trainer checkpointed by PcframeCallback vs by its own ``save_steps``.

    python experiments/integrations/bench_hf.py --steps 40 --every 10 --repeats 5 \
        --out experiments/results/hf_trainer.md

One process, then a DDP job of two (torchrun, gloo: ``--processes 1 2``), CPU, a GPT-2
built from a config (no download) with ~120 MB of state (weights and AdamW's two moments),
the same data and seed in every run. Three ways, in rotating
order each repeat so drift on a shared machine hits each alike:

- ``none``: no checkpoints (``save_strategy="no"``, no callback): the baseline;
- ``trainer``: the Trainer's own checkpoints, ``save_strategy="steps"``, ``save_steps=every``
  (model safetensors, ``optimizer.pt``, scheduler, RNG, ``trainer_state.json``; written in
  the training thread, not fsynced);
- ``pcframe``: ``PcframeCallback(save_steps=every)`` (the Trainer's own saves off; the
  snapshot copied off the training thread, every file fsynced before a version commits).

Measured by a callback: the wall time between consecutive ``on_step_begin`` (a step and
everything after it: the Trainer's save, PcframeCallback's ``on_step_end``, the gate on the
next ``optimizer.step``). *Stall per checkpoint*: at each checkpoint step ``s``, the
intervals of ``s`` and ``s+1`` less twice the median interval of the run's other steps,
averaged over the run's checkpoints. *Overhead*: the loop's wall time (first step to
``train()`` returning, so pcframe's wait for its last version counts) over the baseline's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from pcframe.integrations.transformers import PcframeCallback

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

warnings.filterwarnings("ignore")
WAYS = ("none", "trainer", "pcframe")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Clock(transformers.TrainerCallback):
    """The time of every ``on_step_begin`` (last in the callbacks: after the others' hooks)."""

    def __init__(self) -> None:
        self.begins: list[float] = []

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self.begins.append(time.perf_counter())


def config(args: argparse.Namespace) -> GPT2Config:
    return GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.length,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=8,
    )


def state_mb(args: argparse.Namespace) -> float:
    params = sum(p.numel() for p in GPT2LMHeadModel(config(args)).parameters())
    return params * 4 * 3 / 1e6  # float32 weights + AdamW's exp_avg and exp_avg_sq


def run(way: str, args: argparse.Namespace, base: Path, index: int) -> dict[str, float]:
    transformers.set_seed(0)
    model = GPT2LMHeadModel(config(args))
    out = base / f"{way}-{index}"
    training = TrainingArguments(
        output_dir=str(out / "hf-out"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-4,
        seed=0,
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,  # every parameter is used: no extra graph walk
        save_strategy="steps" if way == "trainer" else "no",
        save_steps=args.every,
        save_total_limit=2 if way == "trainer" else None,  # as pcframe's keep_last=2
    )
    clock = Clock()
    callbacks: list[Any] = []
    if way == "pcframe":
        callbacks.append(PcframeCallback(out / "ckpt", save_steps=args.every, keep_last=2))
    callbacks.append(clock)
    data = Tokens(args.steps * args.batch, args.length, args.vocab)
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    trainer.train()
    end = time.perf_counter()
    begins = [*clock.begins, end]
    intervals = [b - a for a, b in itertools.pairwise(begins)]  # [i]: step i+1 and its hooks
    saved = [s for s in range(args.every, args.steps + 1, args.every)] if way != "none" else []
    touched = {s - 1 for s in saved} | {s for s in saved if s < args.steps}  # 0-based
    plain = [t for i, t in enumerate(intervals[1:], 1) if i not in touched]
    median = statistics.median(plain)
    stalls = [
        intervals[s - 1] + (intervals[s] if s < args.steps else median) - 2 * median for s in saved
    ]
    shutil.rmtree(out, ignore_errors=True)
    return {
        "loop": end - begins[0],
        "step": median,
        "stall": statistics.mean(stalls) if stalls else 0.0,
    }


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Every way ``args.repeats`` times, in rotating order, after one warm-up run."""
    base = Path(tempfile.mkdtemp(prefix="bench-hf-", dir=args.dir))
    results: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    try:
        run("none", args, base, -1)  # warm-up: imports, allocator, first-touch pages
        for repeat in range(args.repeats):
            order = WAYS[repeat % 3 :] + WAYS[: repeat % 3]
            for way in order:
                results[way].append(run(way, args, base, repeat))
                print(way, repeat, results[way][-1], flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


def in_ranks(args: argparse.Namespace, processes: int) -> dict[str, list[dict[str, float]]]:
    """:func:`measure` in a DDP job of ``processes`` ranks on CPU (gloo), started by torchrun
    once for all runs (each run opens and closes its own checkpointer); rank 0's timings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        keep = ["--steps", "--every", "--repeats", "--batch", "--length", "--width"]
        keep += ["--layers", "--vocab", "--threads"]
        given = [x for name in keep for x in (name, str(getattr(args, name[2:])))]
        if args.dir:
            given += ["--dir", args.dir]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={processes}", __file__, *given, "--worker", str(out)]
        subprocess.run(command, check=True)
        return json.loads(out.read_text())


def table_rows(results: dict[str, list[dict[str, float]]], processes: int) -> list[list[str]]:
    baseline = [r["loop"] for r in results["none"]]
    rows = []
    for way in WAYS:
        loops = [r["loop"] for r in results[way]]
        over = [
            (loop / base_loop - 1) * 100 for loop, base_loop in zip(loops, baseline, strict=True)
        ]
        rows.append(
            [
                str(processes),
                way,
                spread([r["step"] for r in results[way]], 1000, 1),
                "-" if way == "none" else spread([r["stall"] for r in results[way]], 1000, 0),
                spread(loops, 1, 2),
                "-" if way == "none" else spread(over, 1, 1),
            ]
        )
    return rows


def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}..{max(v):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where runs write (default: a temp dir)")
    parser.add_argument("--out", default="experiments/results/hf_trainer.md")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a torchrun rank
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    if args.worker is not None:
        results = measure(args)
        if int(os.environ["RANK"]) == 0:
            Path(args.worker).write_text(json.dumps(results))
        return
    started, load = time.perf_counter(), os.getloadavg()[0]
    rows = []
    for processes in args.processes:
        results = measure(args) if processes == 1 else in_ranks(args, processes)
        rows += table_rows(results, processes)
    checkpoints = args.steps // args.every
    took = time.perf_counter() - started
    lines = header(
        "Hugging Face Trainer: PcframeCallback vs the Trainer's own save_steps",
        " ".join(["python", "experiments/integrations/bench_hf.py", *sys.argv[1:]]),
        f"{args.threads} torch thread(s); a shared machine: load average {load:.1f} at the "
        f"start on {os.cpu_count()} cores (other jobs on them)",
    )
    lines += [
        f"GPT-2 from a config ({args.layers} layers, width {args.width}, vocab {args.vocab}), "
        f"{state_mb(args):.0f} MB of state (float32 weights and AdamW's two moments), batch "
        f"{args.batch} x {args.length} tokens a process, CPU (several processes: DDP, gloo, "
        f"torchrun; rank 0's timings); {args.steps} steps, a "
        f"checkpoint every {args.every} ({checkpoints} a run), {args.repeats} repeats in "
        f"rotating order. Median (min..max) over the repeats; wall time {took:.0f} s.",
        "",
        *table_lines(
            [
                "processes",
                "checkpoints",
                "step, ms (median of a run)",
                "stall per checkpoint, ms",
                "loop, s",
                "overhead vs none, %",
            ],
            rows,
            "rlrrrr",
        ),
        "",
        "*Stall per checkpoint*: the intervals of the checkpoint step and the next one less",
        "twice the run's median step, over the checkpoints before the last step (the Trainer's",
        "save runs in the training thread; pcframe's `on_step_end` starts a version and the next",
        "`optimizer.step` waits for the snapshot copy). *Overhead*: the loop's wall time, first",
        "step to `train()` returning (pcframe's wait for its last version included), over the",
        "run without checkpoints of the same repeat.",
        "The Trainer's files are not fsynced; every pcframe version is durable when it commits.",
        "",
    ]
    write_results(args.out, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
