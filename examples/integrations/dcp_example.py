"""Smallest working example: torch.distributed.checkpoint saving into pcframe.

    python examples/integrations/dcp_example.py [CHECKPOINT_DIR]   # default: ./ckpts-dcp

Trains a tiny model for 20 steps, saving model + AdamW state every 5 steps with plain
``dcp.save`` (pcframe's StorageWriter is the only change), then builds a fresh model and
optimizer and resumes them with ``dcp.load``. The same code runs under torchrun on many ranks.
Afterwards try ``pcframe list CHECKPOINT_DIR`` and ``pcframe verify CHECKPOINT_DIR``.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from pcframe.integrations.dcp import StorageReader, StorageWriter

# One process, no process group: DCP says so on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main(root: str) -> None:
    torch.manual_seed(0)
    model, optimizer = build()
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    for step in range(1, 21):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "step": step}
            # keep_last=2: older versions are deleted after each commit.
            dcp.save(state, storage_writer=StorageWriter(root, keep_last=2, step=step))
            print(f"step {step}: loss {loss.item():.4f}, saved")

    # A restart: fresh objects, the newest verified version loaded into them.
    model2, optimizer2 = build()
    model_sd, optim_sd = get_state_dict(model2, optimizer2)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(state, storage_reader=StorageReader(root))
    set_state_dict(
        model2, optimizer2, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    same = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )
    print(f"resumed at step {state['step']}; weights identical: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ckpts-dcp")
