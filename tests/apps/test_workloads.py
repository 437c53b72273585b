"""The built-in GPT workload: seeded, learns, and big enough that checkpoints cost."""

from __future__ import annotations

import math

import torch

from pcframe.apps.training import batches
from pcframe.apps.workloads import build

SMALL = {"vocab": 128, "context": 16, "width": 32, "layers": 2, "heads": 2, "samples": 512}


def test_gpt_is_deterministic_for_a_seed():
    # Dropout draws from the global generator, which build() seeds: build, then train.
    losses, models = {}, {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        w = build("gpt", **SMALL, seed=seed)
        stream = batches(w)
        losses[name] = [w.train_step(next(stream)) for _ in range(5)]
        models[name] = w.model
    assert losses["a"] == losses["b"] != losses["c"]
    pairs = zip(models["a"].parameters(), models["b"].parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)


def test_gpt_learns_the_markov_corpus():
    torch.manual_seed(0)
    w = build("gpt", **SMALL, lr=3e-3, dropout=0.0)
    stream = batches(w)
    losses = [w.train_step(next(stream)) for _ in range(150)]
    # starts near the uniform guess and falls well below it (the floor is log(branching))
    assert abs(losses[0] - math.log(SMALL["vocab"])) < 0.5
    assert sum(losses[-10:]) / 10 < losses[0] - 1.0


def test_gpt_is_causal():
    w = build("gpt", **SMALL, dropout=0.0)
    ids = torch.randint(SMALL["vocab"], (1, SMALL["context"]))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % SMALL["vocab"]
    with torch.no_grad():
        before, after = w.model(ids), w.model(changed)
    assert torch.equal(before[0, :-1], after[0, :-1])  # no position sees the future
    assert not torch.equal(before[0, -1], after[0, -1])


def test_default_gpt_checkpoint_is_tens_of_megabytes():
    w = build("gpt")
    params = sum(p.numel() for p in w.model.parameters())
    assert 3_000_000 < params < 5_000_000
    assert w.state_bytes() > 40e6  # weights + AdamW's two moments, fp32
