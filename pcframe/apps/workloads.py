"""Built-in training workloads: small, deterministic, no downloads.

A workload builds the model, optimizer, scheduler and a resumable data loader from a seed,
and knows how to run one training step. Everything is seeded, so two runs with the same
seed produce bit-identical parameters on the same machine and thread count.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pcframe.state.data import ResumableLoader, ResumableSampler


@dataclass
class Workload:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: ResumableLoader

    def train_step(self, batch: Any) -> float:
        inputs, targets = batch
        logits = self.model(inputs)
        # Flattening makes one loss serve classifiers (B, C) and language models (B, T, V).
        loss = nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach().item()

    def state_bytes(self) -> int:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return params * 3  # weights + Adam's two moments


def mlp(
    seed: int = 0,
    hidden: int = 256,
    layers: int = 3,
    inputs: int = 64,
    classes: int = 10,
    samples: int = 4096,
    batch_size: int = 64,
    lr: float = 1e-3,
    dropout: float = 0.1,
) -> Workload:
    """A multi-layer perceptron learning a fixed random teacher (with dropout, so RNG matters)."""
    torch.manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed + 1)
    features = torch.randn(samples, inputs, generator=data_gen)
    teacher = torch.randn(inputs, classes, generator=data_gen)
    labels = (features @ teacher).argmax(dim=1)
    dims = [inputs] + [hidden] * layers
    blocks: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(dims):
        blocks += [
            nn.Linear(fan_in, fan_out),
            nn.LayerNorm(fan_out),
            nn.GELU(),
            nn.Dropout(dropout),
        ]
    model = nn.Sequential(*blocks, nn.Linear(dims[-1], classes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=200)
    sampler = ResumableSampler(samples, seed=seed)
    # The loader gets its own generator: otherwise every new epoch iterator draws a seed from
    # the global RNG, and a resumed run would shift the dropout stream by one draw.
    loader = DataLoader(
        TensorDataset(features, labels),
        batch_size=batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed + 2),
    )
    return Workload(model, optimizer, scheduler, ResumableLoader(loader))


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP, both residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyGPT(nn.Module):
    """A decoder-only language model in the GPT-2 layout (learned positions, tied head)."""

    def __init__(
        self, vocab: int, context: int, width: int, layers: int, heads: int, dropout: float
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"workload.args.width={width} must be a multiple of heads={heads}")
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.register_buffer("position_ids", torch.arange(context), persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # GPT-2's small-normal init; torch's defaults (N(0, 1) embeddings) make the tied
        # head's first logits so large that the loss starts near 100 instead of log(vocab).
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(self.position_ids[: ids.shape[1]])
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.T  # weight tying, as in GPT-2


def markov_corpus(
    vocab: int, samples: int, context: int, branching: int, generator: torch.Generator
) -> torch.Tensor:
    """``samples`` token windows of ``context + 1`` tokens from a random sparse Markov chain.

    Every token has ``branching`` likely successors, so there is structure to learn (the loss
    falls towards log(branching)) without downloading a corpus. Generated one position at a
    time but vectorised over all windows, so it takes milliseconds.
    """
    successors = torch.randint(vocab, (vocab, branching), generator=generator)
    windows = torch.empty(samples, context + 1, dtype=torch.long)
    windows[:, 0] = torch.randint(vocab, (samples,), generator=generator)
    choices = torch.randint(branching, (samples, context), generator=generator)
    for t in range(context):
        windows[:, t + 1] = successors[windows[:, t], choices[:, t]]
    return windows


def gpt(
    seed: int = 0,
    vocab: int = 2048,
    context: int = 32,
    width: int = 256,
    layers: int = 4,
    heads: int = 4,
    samples: int = 2048,
    batch_size: int = 4,
    lr: float = 1e-3,
    dropout: float = 0.1,
    branching: int = 4,
) -> Workload:
    """A small GPT-style language model on a synthetic Markov corpus (built in code).

    The defaults give 3.7 M parameters (a 44 MB checkpoint with AdamW's moments) and a step
    of roughly 75 ms on 2 CPU cores: writing the checkpoint takes longer than a step, so its
    cost shows, and the model still trains at a useful pace there.
    """
    torch.manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed + 1)
    windows = markov_corpus(vocab, samples, context, branching, data_gen)
    model = TinyGPT(vocab, context, width, layers, heads, dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=500)
    sampler = ResumableSampler(samples, seed=seed)
    loader = DataLoader(
        TensorDataset(windows[:, :-1], windows[:, 1:]),
        batch_size=batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed + 2),
    )
    return Workload(model, optimizer, scheduler, ResumableLoader(loader))


WORKLOADS = {"mlp": mlp, "gpt": gpt}


def build(name: str, **kwargs: Any) -> Workload:
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; available: {', '.join(sorted(WORKLOADS))}"
        ) from None
    return factory(**kwargs)
