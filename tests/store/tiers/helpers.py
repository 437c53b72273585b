"""Small training state shared by the tier tests."""

from __future__ import annotations

import torch
from torch import nn


def model_and_optimizer(width: int = 64, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(8, model[0].in_features, generator=generator)
    optimizer.zero_grad()
    model(inputs).pow(2).mean().backward()
    optimizer.step()


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
