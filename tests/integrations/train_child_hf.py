"""A transformers.Trainer run checkpointed by PcframeCallback (the SIGKILL tests' child).

    python train_child_hf.py DIR STEPS [--policy NAME] [--delay SECONDS] [--accumulate N]

A tiny GPT-2 built from a config (no download), synthetic token data, CPU, dropout on.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from pcframe.integrations.transformers import PcframeCallback

warnings.filterwarnings("ignore")  # tiny model on CPU: advice about pin_memory and the like
transformers.logging.set_verbosity_error()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 40, length: int = 12, vocab: int = 32) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Slow(transformers.TrainerCallback):
    """Spreads the run so that kills land between versions."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def on_step_begin(self, *args: object, **kwargs: object) -> None:
        time.sleep(self.delay)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dirpath")
    parser.add_argument("steps", type=int)
    parser.add_argument("--policy", default=None)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.03)
    parser.add_argument("--accumulate", type=int, default=1)  # gradient_accumulation_steps
    args = parser.parse_args()
    transformers.set_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=f"{args.dirpath}-hf",
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        gradient_accumulation_steps=args.accumulate,
        seed=0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    policy = {"policy": args.policy} if args.policy else {"save_steps": args.every}
    callback = PcframeCallback(args.dirpath, **policy)
    trainer = Trainer(
        model=model, args=training, train_dataset=Tokens(), callbacks=[callback, Slow(args.delay)]
    )
    trainer.train()
    print(f"resumed_step {callback.resumed_step} global_step {trainer.state.global_step}")


if __name__ == "__main__":
    main()
