"""Effect of lossy checkpoints: restore from int8 / fp8 checkpoints and keep training.

For every checkpoint format (exact = all raw, Adam moments int8, moments fp8, and weights +
moments int8) the built-in ``mlp`` workload is trained from scratch to ``--steps`` with a
checkpoint every ``--every`` steps. Then, from each checkpoint at the restore points, a
fresh process-like run (new workload objects, same seed) restores it and trains on to
``--steps``. Batches and dropout masks are restored exactly (data position and RNG are
always raw), so the per-step loss of a lossy continuation differs from the exact
continuation only through the quantized state. Reported per format and restore point:

* mean / max |loss_lossy - loss_exact| over the continued steps, and at the last step;
* the final full-dataset eval loss (model.eval(), no dropout) and its difference;
* relative L2 distance of the final weights from the exact continuation's;
* bytes on storage of one checkpoint (data.bin + codec.bin) and the ratio to exact.

Also checked: the exact continuation reproduces the uninterrupted run bit for bit.

Run:  python experiments/lossy/run_lossy.py --out experiments/results/lossy_cpu.md \\
          --plot experiments/results/lossy_cpu.png
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from pcframe.apps.training import train
from pcframe.apps.workloads import build
from pcframe.config import EngineConfig
from pcframe.format.manifest import read_manifest
from pcframe.policies.fixed import FixedSteps
from pcframe.restore.reader import load_version

sys.path.append(str(Path(__file__).resolve().parents[1]))  # experiments/: results_file
from results_file import header, table_lines, write_results

MOMENTS = "optimizer/state/*/exp_avg*"
FORMATS = {
    "exact (raw)": {},
    "moments int8": {MOMENTS: "int8_block"},
    "moments fp8": {MOMENTS: "fp8_block"},
    "exp_avg int8, exp_avg_sq fp8": {
        "optimizer/state/*/exp_avg": "int8_block",
        "optimizer/state/*/exp_avg_sq": "fp8_block",
    },
    "weights + moments int8": {"model/*": "int8_block", MOMENTS: "int8_block"},
}


def workload(args: argparse.Namespace):
    return build("mlp", seed=args.seed, hidden=args.hidden, layers=args.layers)


def eval_loss(w) -> float:
    features, labels = w.loader.loader.dataset.tensors
    w.model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(w.model(features), labels).item()
    w.model.train()
    return loss


def flat_params(w) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in w.model.parameters()])


def run(args: argparse.Namespace, root: Path) -> dict:
    points = list(range(args.every, args.steps, args.every))
    out: dict = {"points": points, "formats": {}}
    for name, codecs in FORMATS.items():
        engine = EngineConfig(codecs=codecs, keep_last=1000, chunk_bytes=1 << 20)
        full_dir = root / f"{len(out['formats'])}-full"
        w = workload(args)
        uninterrupted, _ = train(w, args.steps, full_dir, FixedSteps(args.every), engine)
        manifest = read_manifest(str(full_dir / "v00000001" / "manifest.json"))
        fmt = {
            "dir": full_dir,
            "uninterrupted": uninterrupted.losses,
            "stored": manifest.data_size + manifest.codec_size,
            "bound": max(
                (manifest.error_bound(e.name) for e in manifest.entries if not e.raw), default=0.0
            ),
            "runs": {},
        }
        for version, point in enumerate(points, start=1):
            assert read_manifest(str(full_dir / f"v{version:08d}/manifest.json")).step == point
            restore_dir = root / f"{len(out['formats'])}-from-{point}"
            shutil.copytree(full_dir / f"v{version:08d}", restore_dir / f"v{version:08d}")
            w = workload(args)
            result, _ = train(w, args.steps, restore_dir, FixedSteps(10**9), engine)
            assert result.start_step == point, (name, point, result.start_step)
            fmt["runs"][point] = {
                "losses": result.losses,
                "eval": eval_loss(w),
                "params": flat_params(w),
            }
        out["formats"][name] = fmt
        print(f"{name}: done", flush=True)
    exact_dir = out["formats"]["exact (raw)"]["dir"]
    for fmt in out["formats"].values():
        fmt["zeroed"] = zeroed_second_moments(exact_dir, fmt["dir"], len(points))
    return out


def zeroed_second_moments(exact_dir: Path, lossy_dir: Path, versions: int) -> tuple[int, int]:
    """Nonzero exp_avg_sq values the checkpoints restore as exactly 0, and all nonzero ones.

    Adam divides by sqrt(exp_avg_sq): a second moment rounded to 0 turns the next update of
    that weight into roughly lr * sign(m), a jump where the exact state makes a tiny step.
    """
    zeroed = nonzero = 0
    for version in range(1, versions + 1):
        name = f"v{version:08d}"
        exact = load_version(exact_dir / name).named_tensors()
        lossy = load_version(lossy_dir / name).named_tensors()
        for key, value in exact.items():
            if key.endswith("exp_avg_sq"):
                nonzero += int((value != 0).sum())
                zeroed += int(((value != 0) & (lossy[key] == 0)).sum())
    return zeroed, nonzero


def report(args: argparse.Namespace, data: dict) -> str:
    exact = data["formats"]["exact (raw)"]
    reproduces = all(
        exact["runs"][p]["losses"] == exact["uninterrupted"][p:] for p in data["points"]
    )
    same_training = all(
        f["uninterrupted"] == exact["uninterrupted"] for f in data["formats"].values()
    )
    command = (
        f"python experiments/lossy/run_lossy.py --steps {args.steps} --every "
        f"{args.every} --hidden {args.hidden} --layers {args.layers} --seed {args.seed} "
        f"--out {args.out} --plot {args.plot}"
    )
    lines = [
        *header("Lossy checkpoints: loss-curve deviation after restore (CPU)", command),
        f"Workload: built-in `mlp` (hidden {args.hidden}, {args.layers} layers, AdamW lr 1e-3, "
        f"cosine warm restarts every 200 steps, dropout 0.1), {args.steps} steps, a checkpoint "
        f"every {args.every}; each checkpoint restored in fresh objects and trained on to step "
        f"{args.steps}. Codec block size 256 (one fp32 scale per 256 values). Baseline: the "
        "exact (raw) continuation from the same step, whose losses equal the uninterrupted "
        f"run's bit for bit: **{'yes' if reproduces else 'NO'}**. Checkpointing never changed "
        f"the training itself (all formats' uninterrupted runs identical): "
        f"**{'yes' if same_training else 'NO'}**.",
        "",
        "|loss| deviations are over the continued steps (per-step training loss, same batches "
        "and dropout masks); eval = cross-entropy on the whole training set at the last step, "
        "dropout off; weight drift = ||w - w_exact|| / ||w_exact|| at the last step; exp_avg_sq "
        "zeroed = nonzero second moments that the format's checkpoints (all restore points "
        "together) restore as exactly 0: Adam then divides by ~eps and that weight jumps.",
        "",
    ]
    rows = []
    for name, fmt in data["formats"].items():
        for point, run_ in fmt["runs"].items():
            base = exact["runs"][point]
            diffs = [abs(a - b) for a, b in zip(run_["losses"], base["losses"], strict=True)]
            drift = (run_["params"] - base["params"]).norm() / base["params"].norm()
            rows.append(
                [
                    name,
                    f"{fmt['stored']:,}",
                    f"{fmt['stored'] / exact['stored']:.3f}",
                    f"{fmt['bound']:.2e}",
                    f"{fmt['zeroed'][0]:,} of {fmt['zeroed'][1]:,}",
                    point,
                    f"{statistics.mean(base['losses']):.4f}",
                    f"{statistics.mean(diffs):.2e}",
                    f"{max(diffs):.2e}",
                    f"{diffs[-1]:.2e}",
                    f"{run_['eval']:.4f}",
                    f"{run_['eval'] - base['eval']:+.2e}",
                    f"{drift:.2e}",
                ]
            )
    columns = ["format", "bytes / checkpoint", "÷ exact", "max recorded bound"]
    columns += ["exp_avg_sq zeroed", "restored at", "mean L (exact)", "mean abs ΔL"]
    columns += ["max abs ΔL", "ΔL last step", "eval loss", "Δ eval", "weight drift"]
    lines += table_lines(columns, rows, align="l" + "r" * 12)
    return "\n".join(lines) + "\n"


def plot(args: argparse.Namespace, data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exact = data["formats"]["exact (raw)"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    steps = range(1, args.steps + 1)
    top.plot(steps, exact["uninterrupted"], color="black", lw=0.8, label="exact / uninterrupted")
    colors = {
        "moments int8": "tab:blue",
        "moments fp8": "tab:orange",
        "exp_avg int8, exp_avg_sq fp8": "tab:green",
        "weights + moments int8": "tab:red",
    }
    window = 10
    for name, color in colors.items():
        fmt = data["formats"][name]
        for i, (point, run_) in enumerate(fmt["runs"].items()):
            xs = range(point + 1, args.steps + 1)
            top.plot(
                xs, run_["losses"], color=color, lw=0.6, alpha=0.8, label=name if i == 0 else None
            )
            diffs = [
                abs(a - b)
                for a, b in zip(run_["losses"], exact["runs"][point]["losses"], strict=True)
            ]
            smooth = [
                statistics.mean(diffs[max(0, j - window + 1) : j + 1]) for j in range(len(diffs))
            ]
            bottom.plot(xs, smooth, color=color, lw=1.0, label=name if i == 0 else None)
    for point in data["points"]:
        top.axvline(point, color="grey", lw=0.5, ls=":")
        bottom.axvline(point, color="grey", lw=0.5, ls=":")
    top.set_ylabel("training loss")
    top.set_title("mlp: continuing from lossy checkpoints (restore points dotted)")
    top.legend(fontsize=8)
    bottom.set_yscale("log")
    bottom.set_ylabel(f"|ΔL| vs exact restore\n({window}-step mean)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="experiments/results/lossy_cpu.md")
    parser.add_argument("--plot", default="experiments/results/lossy_cpu.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # one thread: bit-reproducible, kind to a shared box
    root = Path(tempfile.mkdtemp(prefix="pcf-lossy-"))
    try:
        data = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(args, data)
    write_results(args.out, text)
    plot(args, data)
    print(text)


if __name__ == "__main__":
    main()
