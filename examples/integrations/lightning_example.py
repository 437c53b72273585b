"""The smallest Lightning run checkpointed by pcframe: run it, kill it, run it again.

python lightning_example.py      # checkpoints in ./ckpts-lightning; a second run resumes from there
"""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pcframe import ResumableLoader, ResumableSampler
from pcframe.integrations.lightning import PcframeCheckpoint


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


pl.seed_everything(0)
data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
# A resumable loader, so that a resume continues mid-epoch with the next unseen batch.
loader = ResumableLoader(
    DataLoader(data, batch_size=32, sampler=ResumableSampler(len(data), seed=0))
)
checkpoint = PcframeCheckpoint("ckpts-lightning", every_n_train_steps=10)  # or policy="young"
trainer = pl.Trainer(max_steps=50, callbacks=[checkpoint], logger=False, enable_progress_bar=False)
trainer.fit(Regressor(), train_dataloaders=loader)  # resumes from the newest valid version
if checkpoint.resumed_step is not None:
    print(f"resumed from step {checkpoint.resumed_step}")
print(f"trained to step {trainer.global_step}")
