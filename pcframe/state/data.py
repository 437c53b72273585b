"""Data position that survives a restart: a seeded sampler and a loader that counts batches.

A ``DataLoader`` prefetches, so its sampler runs ahead of what the training loop consumed.
:class:`ResumableLoader` therefore counts the batches handed to the loop and, on restore,
tells :class:`ResumableSampler` to skip exactly those samples of the interrupted epoch.

It also owns the loader's randomness. Every new ``DataLoader`` iterator draws a base seed
(for worker seeds) from ``loader.generator``, or from the *global* torch RNG when the loader
has none: after a resume that draw would happen at another point of the global stream and
shift everything that follows (dropout masks, noise), so the run would not be bit-identical.
A loader without a generator gets one of its own (seeded from the sampler's seed), and its
state at the start of the epoch is saved and restored with the data position.

With ``num_workers > 0`` the randomness of loading (augmentation in ``__getitem__``, masking
in ``collate_fn``) is drawn in the worker processes, whose RNGs torch seeds once per worker
and which then advance with every sample that worker loaded. A resume skips the epoch's
consumed samples, so those draws would not be replayed, and the batches after it would go
to other workers: the rest of the epoch would see other noise. So each worker reseeds
``torch``, ``random`` and numpy before every sample from (the sampler's seed, the epoch, the
sample's index) (:class:`SeedEachSample`): a sample's randomness no longer depends on which
worker loads it or on what was loaded before, and a resumed epoch draws what the first one
drew. Persistent workers learn the epoch from a shared counter.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler, get_worker_info

log = logging.getLogger("pcframe")


class ResumableSampler(Sampler[int]):
    """A permutation per epoch from ``seed + epoch``; can start mid-epoch."""

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError(f"ResumableSampler: num_samples={num_samples} must be >= 1")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch = 0
        self.start = 0  # samples of this epoch to skip (set on restore)

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[int]:
        indices = self.order(self.epoch)[self.start :]
        self.start = 0
        return iter(indices.tolist())

    def __len__(self) -> int:
        return self.num_samples - self.start


class ResumableLoader:
    """Wraps a ``DataLoader`` built on a :class:`ResumableSampler`; iterate it once per epoch.

    ``state_dict()`` is the position after the last batch handed out, so a checkpoint taken
    after a training step resumes with the next unseen batch.
    """

    def __init__(self, loader: DataLoader) -> None:
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"ResumableLoader wraps a torch DataLoader, not {type(loader).__name__}"
            )
        if not isinstance(loader.sampler, ResumableSampler):
            raise TypeError(
                "ResumableLoader needs DataLoader(..., sampler=ResumableSampler(len(dataset))) "
                f"(this loader samples with {type(loader.sampler).__name__}, whose position "
                "and order cannot be restored exactly)"
            )
        if loader.generator is None:
            # Never the global RNG: see the module docstring.
            loader.generator = torch.Generator().manual_seed(loader.sampler.seed + _OWN_SEED)
        self._epoch_seen_by_workers: Any = None  # the epoch, shared with the workers
        if loader.num_workers > 0:
            context = loader.multiprocessing_context or multiprocessing
            if isinstance(context, str):
                context = multiprocessing.get_context(context)
            self._epoch_seen_by_workers = context.RawValue("q", 0)
            loader.worker_init_fn = SeedEachSample(
                loader.sampler.seed, self._epoch_seen_by_workers, loader.worker_init_fn
            )
        self.loader = loader
        self.sampler: ResumableSampler = loader.sampler
        self.epoch = 0
        self.consumed = 0  # samples of the current epoch handed to the training loop
        self._epoch_rng: torch.Tensor | None = None  # loader.generator at this epoch's start

    def __iter__(self) -> Iterator[Any]:
        if self._epoch_rng is not None and self._exhausted():
            # A consumer that stops after len(self) batches (Lightning, the HF Trainer) never
            # resumed the last epoch's generator to its end: roll over to the next epoch here.
            self._next_epoch()
        self.sampler.epoch, self.sampler.start = self.epoch, self.consumed
        if self._epoch_rng is not None:  # resumed mid-epoch: the same draws as the first time
            self.loader.generator.set_state(self._epoch_rng)
        self._epoch_rng = self.loader.generator.get_state()
        if self._epoch_seen_by_workers is not None:  # before any index reaches a worker
            self._epoch_seen_by_workers.value = self.epoch
        # Counted from the loader's batch size, never from the batch: a sequence-first
        # collate (pad_sequence's default) or a batch of strings says nothing reliable.
        per_batch = self.loader.batch_size or 1  # None: the loader hands out single samples
        for batch in self.loader:
            self.consumed += min(per_batch, self.sampler.num_samples - self.consumed)
            yield batch
        self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0
        self._epoch_rng = None

    def _exhausted(self) -> bool:
        """Every batch of the current epoch was handed out."""
        left = self.sampler.num_samples - self.consumed
        batch_size = self.loader.batch_size
        return left <= 0 or bool(self.loader.drop_last and batch_size and left < batch_size)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        epoch, consumed = self.epoch, self.consumed
        rng = self._epoch_rng if self._epoch_rng is not None else self.loader.generator.get_state()
        if self._epoch_rng is not None and self._exhausted():
            # Saved after the epoch's last batch: the position is the start of the next epoch,
            # whose iterator draws from the generator as it is now (as a run without a stop).
            epoch, consumed, rng = epoch + 1, 0, self.loader.generator.get_state()
        return {
            "epoch": epoch,
            "consumed": consumed,
            "seed": self.sampler.seed,
            "generator": rng.clone(),
            # What the epoch's permutation is of: a mid-epoch position means nothing in another.
            "num_samples": self.sampler.num_samples,
            "shuffle": self.sampler.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.sampler.seed) != self.sampler.seed:
            raise ValueError(
                f"data position was saved with sampler seed {state['seed']}, but this sampler "
                f"uses {self.sampler.seed}: use the same seed to resume the same data order"
            )
        sampler = self.sampler
        here = (sampler.num_samples, sampler.shuffle)
        saved = (state.get("num_samples", here[0]), state.get("shuffle", here[1]))  # older: unsaid
        if state.get("consumed") and saved != here:  # mid-epoch: the rest of *that* permutation
            raise ValueError(
                f"data position was saved mid-epoch ({state['consumed']} samples handed out) of "
                f"{saved[0]} samples an epoch, shuffle={saved[1]}; this sampler has {here[0]}, "
                f"shuffle={here[1]}: the rest of that epoch would be other samples than the ones "
                "not trained yet. Resume with the same data, or from a version saved at the end "
                "of an epoch"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        rng = state.get("generator")  # absent in data positions saved before it was kept
        if rng is not None:
            self._epoch_rng = torch.as_tensor(rng, dtype=torch.uint8).clone()
            self.loader.generator.set_state(self._epoch_rng)


_OWN_SEED = 0x5EED  # offset, so the loader's stream differs from the sampler's permutations


class SeedEachSample:
    """A ``worker_init_fn``: the worker reseeds its RNGs before each sample (module docstring).

    The worker's copy of the dataset gets a subclass whose ``__getitem__`` (and
    ``__getitems__``, seeded by the batch's indices) seeds ``torch``, ``random`` and numpy
    from ``(seed, epoch, index)``; then the user's own ``worker_init_fn`` runs, as before.
    """

    def __init__(self, seed: int, epoch: Any, then: Callable[[int], None] | None) -> None:
        self.seed, self.epoch, self.then = seed, epoch, then

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        assert info is not None  # called by torch in a worker process only
        dataset = info.dataset
        try:
            dataset.__class__ = _seeded_class(type(dataset))
        except TypeError as exc:  # a type whose instances cannot change class (a C type)
            log.warning(
                "pcframe ResumableLoader: cannot reseed %s's samples in worker %d (%s): a "
                "resume mid-epoch draws other random augmentation than the first run",
                type(dataset).__name__,
                worker_id,
                exc,
            )
        global _WORKER_SEED
        _WORKER_SEED = (self.seed, self.epoch)
        if self.then is not None:
            self.then(worker_id)


_WORKER_SEED: tuple[int, Any] | None = None  # (seed, shared epoch) in a worker process
_SEEDED: dict[type, type] = {}


def _seeded_class(cls: type) -> type:
    if getattr(cls, "_pcframe_seeded", False):
        return cls
    if cls not in _SEEDED:

        def __getitem__(self: Any, index: Any) -> Any:
            _reseed(index)
            return cls.__getitem__(self, index)

        namespace: dict[str, Any] = {
            "__getitem__": __getitem__,
            "__slots__": (),  # the same layout, so __class__ can be assigned
            "_pcframe_seeded": True,
            "__module__": cls.__module__,
        }
        if getattr(cls, "__getitems__", None):

            def __getitems__(self: Any, indices: Any) -> Any:
                _reseed(tuple(indices))
                return cls.__getitems__(self, indices)

            namespace["__getitems__"] = __getitems__
        _SEEDED[cls] = type(cls.__name__, (cls,), namespace)
    return _SEEDED[cls]


def _reseed(index: Any) -> None:
    assert _WORKER_SEED is not None
    seed, epoch = _WORKER_SEED
    key = f"{seed}:{epoch.value}:{index}".encode()
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    # The CPU generator only: torch.manual_seed also seeds every accelerator backend, at
    # 140 us a call; a worker's samples draw from the CPU one.
    torch.default_generator.manual_seed(value)
    random.seed(value)
    if "numpy" in sys.modules:  # numpy's global RNG, if the dataset could be using it
        sys.modules["numpy"].random.seed(value & 0xFFFF_FFFF)
