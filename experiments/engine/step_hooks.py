"""What pcframe's optimizer hooks cost per step when no save is in flight.

The engine gates ``optimizer.step()`` with a pre-hook (it waits for a snapshot's copy, marks
the step for saves on other threads and for signal handlers) and ends it with a post-hook.
With nothing in flight they only take their locks and return: this measures that cost per
step, against the same step with no checkpointer attached (the hooks removed), in rounds
that alternate the two, for a tiny model (where the hooks are the largest share a real step
can have) and a small MLP with Adam.

Run:  python experiments/engine/step_hooks.py --out experiments/results/step_hooks.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pcframe import Checkpointer

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.0)


def mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return model, torch.optim.Adam(model.parameters(), lr=0.0)


WORKLOADS: dict[str, Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]] = {
    "Linear(4, 4), SGD": tiny,
    "MLP 256-256-8, Adam": mlp,
}


def microseconds_per_step(optimizer: torch.optim.Optimizer, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps * 1e6


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20000, help="per round and variant")
    parser.add_argument("--out", default="experiments/results/step_hooks.md")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = []
    for name, build in WORKLOADS.items():
        model, optimizer = build()
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        bare: list[float] = []
        hooked: list[float] = []
        with tempfile.TemporaryDirectory() as root:
            microseconds_per_step(optimizer, args.steps // 10)  # warm-up
            for r in range(args.rounds):
                for variant in ("bare", "hooked")[r % 2 :] + ("bare", "hooked")[: r % 2]:
                    if variant == "bare":
                        bare.append(microseconds_per_step(optimizer, args.steps))
                    else:
                        with Checkpointer(root, model=model, optimizer=optimizer):
                            hooked.append(microseconds_per_step(optimizer, args.steps))
        costs = [h - b for h, b in zip(hooked, bare, strict=True)]
        ratios = [h / b for h, b in zip(hooked, bare, strict=True)]
        rows.append([name, spread(bare), spread(hooked), spread(costs), spread(ratios)])
        print(name, rows[-1][1:], flush=True)

    command = (
        f"python experiments/engine/step_hooks.py --rounds {args.rounds} --steps {args.steps} "
        f"--out {args.out}"
    )
    lines = header("The optimizer hooks' cost per step, nothing in flight", command)
    lines += [
        f"{args.rounds} rounds of {args.steps} `optimizer.step()` calls per variant, the "
        "variants alternating (the order reversed every other round), one torch thread, "
        "gradients of zeros; median (min..max) over the rounds, the cost and the ratio "
        "paired within a round. `bare`: no checkpointer attached; `pcframe`: a "
        "`Checkpointer` open on the model and optimizer, no save made.",
        "",
    ]
    lines += table_lines(
        ["workload", "bare (µs/step)", "pcframe (µs/step)", "hooks (µs/step)", "pcframe ÷ bare"],
        rows,
        "lrrrr",
    )
    print(write_results(args.out, "\n".join(lines) + "\n"))


if __name__ == "__main__":
    main()
