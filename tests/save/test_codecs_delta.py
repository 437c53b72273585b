"""Delta versions (xor_delta_zstd): chain rule, full_every, retention, restart, missing bases."""

from __future__ import annotations

import os

import pytest
import torch

from pcframe import Checkpointer, EngineConfig, load
from pcframe.errors import UnsupportedCheckpoint
from pcframe.format.manifest import read_manifest
from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir

DELTA = {"model/*": "xor_delta_zstd", "optimizer/state/*/exp_avg*": "xor_delta_zstd"}


class Trainer:
    """A model whose weights change a little every step, like real training."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(32, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 4)
        )
        self.model[0].requires_grad_(False)  # a frozen layer: identical in every version
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(trained, lr=1e-3)
        self.generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        loss = self.model(torch.randn(8, 32, generator=self.generator)).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def snapshot(self) -> dict[str, torch.Tensor]:
        state = {f"model/{k}": v.clone() for k, v in self.model.state_dict().items()}
        for index, values in self.optimizer.state_dict()["state"].items():
            state.update({f"optimizer/state/{index}/{k}": v.clone() for k, v in values.items()})
        return state


def manifest(root, version):
    return read_manifest(str(root / f"v{version:08d}" / "manifest.json"))


def assert_loads_exactly(root, version, expected):
    loaded = load_version(root / f"v{version:08d}")
    named = loaded.named_tensors()
    for name, value in expected.items():
        assert torch.equal(named[name], value), (version, name)
    return loaded


def save_steps(root, trainer, steps, **config):
    snapshots = {}
    with Checkpointer(
        root, model=trainer.model, optimizer=trainer.optimizer, codecs=DELTA, **config
    ) as ckpt:
        for _ in range(steps):
            trainer.step()
            handle = ckpt.save(step=len(snapshots) + 1)
            snapshots[handle.version] = trainer.snapshot()
            handle.wait()
    return snapshots


def test_chain_rule_full_every_and_exact_restore(tmp_path):
    trainer = Trainer()
    snapshots = save_steps(tmp_path, trainer, 7, full_every=3, keep_last=10, chunk_bytes=4096)
    depths = {v: manifest(tmp_path, v).depth for v in snapshots}
    bases = {v: manifest(tmp_path, v).delta for v in snapshots}
    assert depths == {1: 0, 2: 1, 3: 2, 4: 0, 5: 1, 6: 2, 7: 0}
    assert bases[3].base == 2 and bases[2].base == 1 and bases[1] is None
    for version, expected in snapshots.items():
        loaded = assert_loads_exactly(tmp_path, version, expected)
        assert len(loaded.chain) == depths[version] + 1 <= 3
        assert loaded.chain[-1] == version
    codec_of = {e.name: e.codec for e in manifest(tmp_path, 3).entries}
    assert codec_of["model/0.weight"] == "xor_delta_zstd"
    assert {e.codec for e in manifest(tmp_path, 4).entries if e.name.startswith("model/")} == {
        "zstd"
    }

    # The frozen layer's XOR against the base is all zeros: it must nearly vanish, while the
    # full version stores its (incompressible) random weights.
    def frozen_payload(version):
        m = manifest(tmp_path, version)
        index = next(i for i, e in enumerate(m.entries) if e.name == "model/0.weight")
        return sum(s.length for s in m.segments[index])

    raw_bytes = 32 * 32 * 4
    assert frozen_payload(4) > 0.5 * raw_bytes
    assert frozen_payload(3) < 0.05 * raw_bytes


def test_retention_keeps_the_bases_of_kept_versions(tmp_path):
    trainer = Trainer()
    kept = []
    with Checkpointer(
        tmp_path,
        model=trainer.model,
        optimizer=trainer.optimizer,
        codecs=DELTA,
        full_every=4,
        keep_last=1,
    ) as ckpt:
        for step in range(1, 7):
            trainer.step()
            ckpt.save(step).wait()
            kept.append(ckpt.committed_versions())
    # keep_last=1, but a delta's whole chain down to its full version stays.
    assert kept == [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [5], [5, 6]]
    assert_loads_exactly(tmp_path, 6, trainer.snapshot())


@pytest.mark.parametrize(
    "unreadable",
    [
        lambda path: OSError(24, "Too many open files", path),
        lambda path: UnsupportedCheckpoint(f"{path}: codec 'plugin_codec' is not registered"),
    ],
    ids=["transient-io", "codec-of-a-plugin-not-imported"],
)
def test_retention_keeps_every_older_version_when_a_kept_deltas_base_is_unknown(
    tmp_path, monkeypatch, unreadable
):
    """A kept delta whose manifest could not be read at that moment (EMFILE), or not by this
    process (a plugin codec not imported), counted as needing no base: retention deleted its
    whole chain, and the kept version could never be restored."""
    import pcframe.save.delta as delta

    codecs = {"model/*": "xor_delta_zstd"}
    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path, model=model, keep_last=1, codecs=codecs, full_every=8) as ckpt:
        for step in range(1, 5):  # v1 full, v2..v4 deltas (keep_last=1 keeps the chain)
            with torch.no_grad():
                model.weight[0, 0] = step
            ckpt.save(step=step).wait()
    real, failed = delta.read_manifest, []

    def flaky(path):
        if "v00000004" in path and not failed:
            failed.append(path)
            raise unreadable(path)
        return real(path)

    monkeypatch.setattr(delta, "read_manifest", flaky)
    again = torch.nn.Linear(4, 4)
    options = {"keep_last": 2, "codecs": codecs, "full_every": 8, "take_over": True}
    with Checkpointer(tmp_path, model=again, **options) as ckpt:
        ckpt.save(step=5).wait()  # a restart: v5 is full; v4 is kept, and so is its chain
    assert failed
    monkeypatch.setattr(delta, "read_manifest", real)
    assert CheckpointDir(tmp_path).committed_versions() == [1, 2, 3, 4, 5]
    restored = torch.nn.Linear(4, 4)
    assert load(tmp_path, model=restored, version=4).step == 4
    assert restored.weight[0, 0] == 4


def test_a_restart_starts_with_a_full_version_and_protects_old_chains(tmp_path):
    trainer = Trainer()
    save_steps(tmp_path, trainer, 3, full_every=8, keep_last=2)  # 1 full, 2 -> 1, 3 -> 2
    expected_3 = trainer.snapshot()
    restarted = Trainer(seed=9)
    with Checkpointer(
        tmp_path,
        model=restarted.model,
        optimizer=restarted.optimizer,
        codecs=DELTA,
        full_every=8,
        keep_last=2,
    ) as ckpt:
        assert ckpt.restore() == 3
        restarted.step()
        ckpt.save(step=4).wait()
        # keep_last=2 keeps 3 and 4; 3 needs 2 needs 1 (read from their manifests on disk).
        assert ckpt.committed_versions() == [1, 2, 3, 4]
        restarted.step()
        ckpt.save(step=5).wait()
        assert ckpt.committed_versions() == [4, 5]
    assert manifest(tmp_path, 4).delta is None  # no in-memory reference after a restart
    assert manifest(tmp_path, 5).delta.base == 4
    assert_loads_exactly(tmp_path, 5, restarted.snapshot())
    assert expected_3  # (restored above: the chain 1 <- 2 <- 3 was complete)


def test_a_missing_base_fails_the_delta_and_restore_falls_back(tmp_path):
    trainer = Trainer()
    snapshots = save_steps(tmp_path, trainer, 3, full_every=8, keep_last=5)
    os.rename(tmp_path / "v00000002", tmp_path / "elsewhere")  # e.g. lost or deleted by hand
    other = Trainer(seed=3)
    with Checkpointer(tmp_path, model=other.model, optimizer=other.optimizer) as ckpt:
        assert ckpt.restore() == 1
        reason = ckpt.last_restore.skipped[0][1]
        assert ckpt.last_restore.skipped[0][0] == 3
        assert "needs its base version 2" in reason and "missing" in reason
    assert torch.equal(other.model[0].weight, snapshots[1]["model/0.weight"])


def test_a_corrupt_base_is_detected_when_restoring_a_delta(tmp_path):
    trainer = Trainer()
    save_steps(tmp_path, trainer, 2, full_every=8, keep_last=5)
    path = tmp_path / "v00000001" / "codec.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match=r"v00000001/codec.bin: .*checksum mismatch"):
        load_version(tmp_path / "v00000002")


def test_full_every_1_never_writes_deltas(tmp_path):
    trainer = Trainer()
    save_steps(tmp_path, trainer, 3, full_every=1, keep_last=1)
    versions = sorted(int(p.name[1:]) for p in tmp_path.glob("v0*"))
    assert versions == [3] and manifest(tmp_path, 3).delta is None


def test_full_every_is_validated():
    with pytest.raises(ValueError, match=r"engine\.full_every=0"):
        EngineConfig(full_every=0)


def test_with_storage_tiers_every_version_is_full(tmp_path):
    """Tiers copy and delete versions one by one, so they never see a delta chain."""
    import pcframe.policies as P
    from pcframe.store.tiers import Tiers

    trainer = Trainer()
    with Checkpointer(
        tmp_path / "primary",
        model=trainer.model,
        optimizer=trainer.optimizer,
        codecs=DELTA,
        full_every=8,
        tiers=Tiers({"local": tmp_path / "disk"}),
        placement=P.MemoryThenDisk(memory_keep=1, disk_keep=2, disk_every=1),
        keep_last=1,
    ) as ckpt:
        for step in range(1, 4):
            trainer.step()
            ckpt.save(step).wait()
        assert ckpt.tiers.wait_idle(30)
    for root in (tmp_path / "primary", tmp_path / "disk"):
        for version_dir in sorted(root.glob("v0*")):
            assert read_manifest(str(version_dir / "manifest.json")).delta is None
            load_version(version_dir)  # restorable on its own
    assert_loads_exactly(tmp_path / "disk", 3, trainer.snapshot())
