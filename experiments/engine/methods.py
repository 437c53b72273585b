"""The checkpointing methods ``bench_engine.py`` compares, and the state they save.

Each :class:`Method` saves one state (a model + Adam moments on CPU) its own way and
restores the newest checkpoint; :func:`loop` is the training loop that measures it. Shared
by the stall rounds (``bench_engine.py``) and the restore rounds (``restore_rounds.py``);
:func:`build_stack` (the state cut into many tensors) and the report helpers by
``stall_tensors.py``, ``restore_tensors.py``, ``gc_saves.py`` and ``stall_floor.py``.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

METHODS = [
    ("no checkpoint", "{}"),  # the training loop alone: its own peak memory (Adam's temporaries)
    ("torch.save", "{}"),
    ("dcp.save", "{}"),
    ("dcp.async_save (2024)", "{}"),
    ("dcp.async_save + DefaultStager", "{}"),
    ("pcframe", '{"max_in_flight": 1}'),
    ("pcframe", '{"max_in_flight": 2}'),
]


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


WIDTH = 4096
PER_LAYER = WIDTH * WIDTH + WIDTH  # one Linear's weight and bias, in elements


def layers_for(size_gb: float) -> int:
    """Linear layers whose weights and two Adam moments (fp32) make about ``size_gb`` GiB."""
    return max(1, round(size_gb * (1 << 30) / 12 / PER_LAYER))


def build_model(size_gb: float):
    import torch

    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers_for(size_gb))])


def fresh_objects(size_gb: float):
    """A model and an optimizer as a resumed job builds them: weights set, no Adam state."""
    import torch

    with torch.device("meta"):
        model = build_model(size_gb)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.zero_()  # touched, like initialised weights
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def build_state(size_gb: float):
    import torch

    torch.manual_seed(0)
    model = build_model(size_gb)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # materialise the moments
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return model, optimizer, nbytes


class Method:
    """One way to checkpoint: ``save`` returns the stall; ``durables`` collects durations."""

    def __init__(self, model, optimizer, directory: Path) -> None:
        self.model, self.optimizer, self.dir, self.n = model, optimizer, directory, 0
        self.durables: list[float] = []

    def state(self):
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def save(self) -> float:
        raise NotImplementedError

    def finish(self) -> None:
        """Wait for everything in flight."""

    def restore(self, model, optimizer) -> None:
        """Load the newest checkpoint into ``model`` and ``optimizer``."""
        raise NotImplementedError

    def rollback(self) -> None:
        """Load the newest checkpoint back into this method's own objects, in the process
        that saved it (a training job going back to its last good state)."""
        self.finish()
        self.restore(self.model, self.optimizer)

    def prune(self) -> None:
        """Delete every checkpoint but the newest (pcframe's retention does it itself)."""
        for path in self.dir.glob("ckpt*"):
            if path.name not in (f"ckpt{self.n}", f"ckpt{self.n}.pt"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()


class NoCheckpoint(Method):
    def save(self) -> float:
        return 0.0

    def restore(self, model, optimizer) -> None:
        raise RuntimeError("nothing to restore")


class TorchSave(Method):
    def save(self) -> float:
        import torch

        start = time.perf_counter()
        self.n += 1
        with open(self.dir / f"ckpt{self.n}.pt", "wb") as f:
            torch.save(self.state(), f)
            f.flush()
            os.fsync(f.fileno())
        self.durables.append(time.perf_counter() - start)
        return self.durables[-1]

    def restore(self, model, optimizer) -> None:
        import torch

        state = torch.load(self.dir / f"ckpt{self.n}.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])


class DCP(Method):
    def __init__(self, model, optimizer, directory: Path, mode: str) -> None:
        super().__init__(model, optimizer, directory)
        self.mode, self.pending, self.started = mode, None, 0.0
        self.stager = None
        if mode == "stager":
            import torch
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(pinned, pinned, True, pinned))

    def state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # DCP's own way (fully qualified names): what its load below reads back.
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def save(self) -> float:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        self.finish()  # one async save at a time (torchtitan waits the same way): stall too
        self.n += 1
        path = str(self.dir / f"ckpt{self.n}")
        self.started = time.perf_counter()
        if self.mode == "sync":
            dcp.save(self.state(), checkpoint_id=path)
            self.durables.append(time.perf_counter() - self.started)
        elif self.mode == "async":
            self._track(dcp.async_save(self.state(), checkpoint_id=path))
        else:
            response = dcp.async_save(self.state(), checkpoint_id=path, async_stager=self.stager)
            response.staging_completion.result()  # before optimizer.step(), per the tutorial
            self._track(response.upload_completion)
        return time.perf_counter() - start

    def _track(self, future) -> None:
        """Time to durable when the upload completes, not when the loop next waits for it."""
        self.done_at, self.done = None, threading.Event()

        def completed(_) -> None:
            self.done_at = time.perf_counter()
            self.done.set()

        future.add_done_callback(completed)  # run at once if it is already done
        self.pending = future

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.done.wait()  # callbacks run just after the result is set
            self.durables.append(self.done_at - self.started)
            self.pending = None

    def restore(self, model, optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # DCP's own way: state dicts it can load into (optimizer state created if missing).
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(self.dir / f"ckpt{self.n}"))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


class PCFrame(Method):
    def __init__(self, model, optimizer, directory: Path, **options) -> None:
        from pcframe import Checkpointer

        super().__init__(model, optimizer, directory)
        # The benchmarks reopen scratch folders holding versions they made themselves (a
        # rollback round saves beside the version an earlier round left, without restoring):
        # they are this method's to prune, as before the engine refused that by default.
        options = {"take_over": True, **options}
        self.ckpt = Checkpointer(directory, model=model, optimizer=optimizer, **options)
        self.seen: set[int] = set()

    def save(self) -> float:
        self.n += 1
        self.ckpt.save(self.n)
        return float("nan")  # taken from the engine's records: save() + the gate

    def finish(self) -> None:
        self.ckpt.wait()

    def stalls_and_durables(self, since: int) -> tuple[list[float], list[float]]:
        self.finish()
        records = [r for v, r in sorted(self.ckpt.records.items()) if v > since]
        return [r.stall for r in records], [r.durable for r in records]

    def restore(self, model, optimizer) -> None:
        from pcframe import Checkpointer

        self.ckpt.close()
        with Checkpointer(self.dir, model=model, optimizer=optimizer) as ckpt:
            ckpt.restore()

    def rollback(self) -> None:
        self.ckpt.wait()
        self.ckpt.restore()  # the same checkpointer: its staging pool is idle now


def make_method(name: str, options: dict, model, optimizer, directory: Path) -> Method:
    if name == "no checkpoint":
        return NoCheckpoint(model, optimizer, directory)
    if name == "torch.save":
        return TorchSave(model, optimizer, directory)
    if name.startswith("dcp"):
        mode = "sync" if name == "dcp.save" else "stager" if "Stager" in name else "async"
        return DCP(model, optimizer, directory, mode)
    return PCFrame(model, optimizer, directory, **options)


def loop(
    impl: Method,
    checkpoints: int,
    every: int,
    iteration: float,
    reference: Callable[[], float] | None = None,
) -> dict:
    """Train ``checkpoints * every`` steps, checkpointing every ``every``: stalls, durables.

    ``reference`` (with no idle iteration): timed just before each save, once the previous
    one is durable (a memcpy of the state in this process: the save's own floor, paired with
    each checkpoint rather than once per turn, as memory bandwidth here drifts by the second).
    """
    since, stalls, references = impl.n, [], []
    impl.durables = []
    for step in range(1, checkpoints * every + 1):
        if iteration:
            time.sleep(iteration)  # forward/backward on an accelerator: the CPU is free
        impl.optimizer.step()  # pcframe's gate waits here (in its records' stall)
        if step % every == 0:
            if not iteration:
                impl.finish()  # the snapshot alone is measured, not the previous write
                if reference is not None:
                    references.append(reference())
            stalls.append(impl.save())
            if not iteration:
                impl.optimizer.step()  # at once: nothing to overlap the snapshot with
    impl.finish()
    durables = impl.durables
    if isinstance(impl, PCFrame):
        stalls, durables = impl.stalls_and_durables(since)
    return {"stalls": stalls, "durables": durables, "references": references}


def stall_of_one(impl: Method) -> float:
    """One checkpoint with nothing to overlap, taken once the previous one is durable:
    ``save()``, then ``optimizer.step()`` at once. Its stall: until ``staging_completion``
    for DefaultStager, ``save()`` + the gate for pcframe (from its records)."""
    stall = impl.save()
    impl.optimizer.step()  # pcframe's gate waits here for the copy
    impl.finish()
    if isinstance(impl, PCFrame):
        stall = impl.stalls_and_durables(impl.n - 1)[0][0]
    return stall


def build_state_bytes(size_gb: float) -> int:
    """The bytes :func:`build_state` makes, without making them."""
    return layers_for(size_gb) * PER_LAYER * 12


def build_stack(size_gb: float, layers: int, fresh: bool = False):
    """``layers`` x Linear(w, w) with Adam, about ``size_gb`` GiB with its moments: the same
    bytes cut into more tensors as ``layers`` grows (eight per layer, two of them 0-d step
    counts). ``fresh``: as a restarted job builds them (weights set, no optimizer state)."""
    import torch

    torch.manual_seed(0)
    width = max(8, round(math.sqrt(size_gb * (1 << 30) / (12 * layers))))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if not fresh:
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        optimizer.step()  # the moments exist
    return model, optimizer
