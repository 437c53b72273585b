"""A ``transformers.Trainer`` job of several processes checkpointed by PcframeCallback (the
child of tests/integrations/test_transformers_ranks.py), started by torchrun:

    python -m torch.distributed.run --nproc-per-node 2 train_child_hf_ranks.py OUT STEPS ...

A tiny GPT-2 from a config (no download), synthetic tokens, dropout on, gloo on CPU (DDP; with
``--fsdp`` and CUDA, accelerate's FSDP2). Transformers' logging is left as a default Trainer
setup has it, so the callback's WARNING lines show as a user would see them.

Each rank appends ``<step> <loss as float.hex()>`` to ``OUT/losses-rank<r>.txt`` at every
training step of every start, and at the end writes ``OUT/final-rank<r>.pt`` (weights, torch
optimizer, scheduler, TrainerState). Faults, each once per ``OUT`` (a marker file in ``OUT``
says it happened, so the launcher's restart and a later start go past it):

- ``--kill-rank R --kill-at S``: rank R SIGKILLs itself in ``on_step_end`` of step S, after
  PcframeCallback's save of that step was started and once a global version exists
  (torchrun then stops and restarts all).
- ``--hold-at S``: every rank, once two global versions exist, writes ``OUT/held-rank<r>``
  after step S and blocks, for the test to SIGKILL the whole job at a known step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from pcframe.distributed import global_versions
from pcframe.integrations.transformers import PcframeCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, length: int = 12, vocab: int = 32) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recording(Trainer):
    """Appends each step's loss, bit for bit, to this rank's file."""

    losses: Path

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        value = loss[0] if isinstance(loss, tuple) else loss
        with self.losses.open("a") as out:  # closed at once: a SIGKILL loses no line
            out.write(f"{self.state.global_step + 1} {float(value.detach()).hex()}\n")
        return loss


class Faults(transformers.TrainerCallback):
    """The kills of the test, at known steps, each once per output folder. Each waits for
    the global versions it needs (``n`` of them: the resume it tests must have one to load;
    the version of this step may still be in flight)."""

    def __init__(self, out: Path, ckpt: Path, rank: int, options: argparse.Namespace) -> None:
        self.out, self.ckpt, self.rank, self.options = out, ckpt, rank, options

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        o, step = self.options, state.global_step
        once = self.out / "killed-one"
        if step == o.kill_at and self.rank == o.kill_rank and not once.exists():
            self.global_versions(1)
            once.write_text(str(step))
            os.kill(os.getpid(), signal.SIGKILL)
        held = self.out / f"held-rank{self.rank}"
        if step == o.hold_at and not held.exists():
            self.global_versions(2)
            held.write_text(f"{step} {os.getpid()}")
            threading.Event().wait()  # until the test SIGKILLs the job

    def global_versions(self, n: int) -> None:
        deadline = time.monotonic() + 120  # the other ranks' threads commit meanwhile
        while len(global_versions.valid_records(self.ckpt)[0]) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {n} global versions after 120 s")
            time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--ckpt", default=None, help="the callback's folder (default OUT/ckpt)")
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--embd", type=int, default=16)
    parser.add_argument("--dtype", default="float32", help="the model's dtype (torch.<name>)")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--resume-argument", action="store_true")
    parser.add_argument("--trainer-saves", action="store_true", help="save_strategy default")
    options = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    options.out.mkdir(parents=True, exist_ok=True)
    transformers.set_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=options.embd, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config).to(getattr(torch, options.dtype))
    arguments: dict[str, Any] = {
        "output_dir": str(options.out / "hf-out"),
        "max_steps": options.steps,
        "per_device_train_batch_size": options.batch,
        "learning_rate": 5e-3,
        "lr_scheduler_type": "linear",
        "warmup_steps": 2,
        "seed": 0,
        "report_to": [],
        "logging_strategy": "no",
        "eval_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "ddp_find_unused_parameters": False,
    }
    if not options.trainer_saves:
        arguments["save_strategy"] = "no"
    if options.fsdp:  # accelerate runs FSDP on GPUs only (on CPU it trains DDP instead)
        arguments["fsdp"] = "full_shard"
        arguments["fsdp_config"] = {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}
    else:
        arguments["use_cpu"] = True
    # "{rank}" in the folder: each rank its own (a node-local folder per rank)
    ckpt = (options.ckpt or str(options.out / "ckpt")).format(rank=rank)
    callback = PcframeCallback(ckpt, save_steps=options.every)
    trainer = Recording(
        model=model,
        args=TrainingArguments(**arguments),
        train_dataset=Tokens(),
        callbacks=[callback, Faults(options.out, Path(ckpt), rank, options)],
    )
    trainer.losses = options.out / f"losses-rank{rank}.txt"
    if options.resume_argument:
        trainer.train(resume_from_checkpoint=True)
    else:
        trainer.train()
    optimizer = trainer.optimizer
    final = {
        "model": trainer.model.state_dict(),
        "optimizer": getattr(optimizer, "optimizer", optimizer).state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "trainer_state": dataclasses.asdict(trainer.state),
        "dtensors": sum(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
    }
    torch.save(final, options.out / f"final-rank{rank}.pt")
    print(
        f"rank {rank} resumed_step {callback.resumed_step} global_step {trainer.state.global_step}"
    )


if __name__ == "__main__":
    main()
