"""SIGTERM in a Lightning fit and a Hugging Face ``Trainer.train``, handled the way
``docs/integrations.md`` recommends: a notice-driven policy on the callback (and, for the
Trainer, a callback that stops it once the notice is seen). A real SIGTERM at a random
moment (seeded) of a real training process: it exits 0 within seconds, and its newest
version, verified, holds the step training stopped at.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from pcframe.apps.cli import main as pcframe_cli
from pcframe.format.manifest import read_manifest
from pcframe.format.names import MANIFEST_NAME
from pcframe.store.directory import CheckpointDir


def _lightning(directory: str) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from pcframe import ResumableLoader, ResumableSampler
    from pcframe.integrations.lightning import PcframeCheckpoint
    from pcframe.policies import FixedSteps, NoticeDriven, SignalNoticeSource

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            time.sleep(0.01)  # a step long enough for the signal to land inside it
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Ready(pl.Callback):
        def on_train_batch_end(self, trainer, *args, **kwargs):
            if trainer.global_step == 3:
                os.write(1, b"ready\n")

    pl.seed_everything(0)
    data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    sampler = ResumableSampler(len(data), seed=0)
    loader = ResumableLoader(DataLoader(data, batch_size=32, sampler=sampler))
    policy = NoticeDriven(FixedSteps(10), SignalNoticeSource(window=30))  # the docs' way
    checkpoint = PcframeCheckpoint(directory, policy=policy)
    trainer = pl.Trainer(
        max_steps=100_000, callbacks=[Ready(), checkpoint], logger=False, enable_progress_bar=False
    )
    try:
        trainer.fit(Regressor(), train_dataloaders=loader)
    finally:
        os.write(1, f"stopped at step {trainer.global_step}\n".encode())


def _transformers(directory: str) -> None:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from pcframe.integrations.transformers import PcframeCallback
    from pcframe.policies import FixedSteps, NoticeDriven, SignalNoticeSource

    class RandomTokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    args = TrainingArguments(
        output_dir=directory + "-hf",
        max_steps=100_000,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    policy = NoticeDriven(FixedSteps(10), SignalNoticeSource(window=30))  # the docs' way
    callback = PcframeCallback(directory, policy=policy)

    class StopOnNotice(TrainerCallback):  # the docs' callback, and a line for the test
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                os.write(1, b"ready\n")
            if callback.checkpointer is not None and callback.checkpointer.notice is not None:
                control.should_training_stop = True

    trainer = Trainer(
        LlamaForCausalLM(config),
        args,
        train_dataset=RandomTokens(),
        callbacks=[callback, StopOnNotice()],
    )
    trainer.train()
    os.write(1, f"stopped at step {trainer.state.global_step}\n".encode())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("framework", ["lightning", "transformers"])
@pytest.mark.slow
def test_sigterm_in_a_framework_loop_the_docs_way(tmp_path, child_env, framework):
    pytest.importorskip("lightning" if framework == "lightning" else "transformers")
    from tests.warm import WarmProcess

    repo = Path(__file__).resolve().parents[2]
    directory, log = tmp_path / "ckpts", tmp_path / "child.log"
    log.touch()  # read below before the child may have opened it
    child = WarmProcess(__name__, [framework, str(directory)], env=child_env, cwd=repo, log=log)
    try:
        deadline = time.monotonic() + 180
        while "ready" not in log.read_text():
            assert child.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.05)
        time.sleep(random.Random(framework).uniform(0.0, 0.3))
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=60)  # a hang fails here
    finally:
        child.kill()
    text = log.read_text()
    assert code == 0, text[-3000:]
    (stopped,) = map(int, re.findall(r"stopped at step (\d+)", text))
    root = CheckpointDir(directory)
    newest = root.committed_versions()[-1]
    assert read_manifest(str(root.path(newest) / MANIFEST_NAME)).step == stopped
    assert pcframe_cli(["verify", str(directory)]) == 0


if __name__ == "__main__":
    {"lightning": _lightning, "transformers": _transformers}[sys.argv[1]](sys.argv[2])
