"""A Lightning training run checkpointed by PcframeCheckpoint (the SIGKILL tests' child).

python train_child_lightning.py DIR STEPS [--policy NAME] [--loader resumable|stateful]
"""

from __future__ import annotations

import argparse
import time
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pcframe import ResumableLoader, ResumableSampler
from pcframe.integrations.lightning import PcframeCheckpoint

warnings.filterwarnings("ignore", module="lightning")  # tiny model on CPU: harmless advice


class Tiny(pl.LightningModule):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
        self.delay = delay

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(self.delay)  # spreads the run so that kills land between versions
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[override]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(kind: str) -> object:
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 8, generator=gen), torch.randn(40, 1, generator=gen))
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(
            data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2)
        )
    return ResumableLoader(DataLoader(data, batch_size=8, sampler=ResumableSampler(40, seed=3)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dirpath")
    parser.add_argument("steps", type=int)
    parser.add_argument("--policy", default=None)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--loader", default="resumable")
    parser.add_argument("--delay", type=float, default=0.03)
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    policy = {"policy": args.policy} if args.policy else {"every_n_train_steps": args.every}
    callback = PcframeCheckpoint(args.dirpath, **policy)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(Tiny(args.delay), train_dataloaders=loader(args.loader))
    print(f"resumed_step {callback.resumed_step} global_step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
