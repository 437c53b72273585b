"""Signal handlers that call the engine: never a hang, never two versions with one number.

The handler spot users write (and the README recommends) saves the state at the signal,
waits for it, closes and exits::

    def on_sigterm(signum, frame):
        ckpt.save(step).wait()
        ckpt.close()
        sys.exit(0)

Python runs it between two bytecodes of the training thread, so it lands in the middle of
the engine's own calls: it used to wait forever for the staging slot the interrupted
``save()`` held, or (``close()``) for the version that save had not handed over, and two
saves took one version number. Here real signals land in every engine call: at chosen
points (a real signal raised from inside the call, or sent by another thread while the call
blocks), at every line of the engine's code the call runs (a signal raised there), at
random moments of a training loop (a timer), and from another process at random moments of
real training children that exit through the handler. A handler's save and close run once
the interrupted call has returned or unwound; ``decide`` and ``maybe_save`` are refused with
one line naming the fix.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from pcframe import Checkpointer
from pcframe.errors import CheckpointError
from pcframe.format.manifest import read_manifest
from pcframe.format.names import MANIFEST_NAME
from pcframe.policies import FixedSteps, NoticeDriven, SignalNoticeSource
from pcframe.restore.restorer import load
from pcframe.runtime.collector import current_frames
from pcframe.save.fill import Filler
from pcframe.save.status import SaveStatus
from pcframe.save.write import Writer
from pcframe.store.directory import CheckpointDir
from tests.helpers import commits_in_save_order

SMALL = {"chunk_bytes": 16 << 10, "writer_threads": 2, "keep_last": 100}
SIG = signal.SIGUSR1  # in this process; the children get a real SIGTERM
EXIT_LINE = "emergency save at step"


def _objects(optimizer: bool = True) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))  # a few chunks
    return model, torch.optim.Adam(model.parameters(), lr=1e-2) if optimizer else None


def _step(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """One training step: the state changes at every step, with or without an optimizer."""
    if optimizer is None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.999).add_(1e-3)
        return
    loss = model(torch.randn(8, 64)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@contextlib.contextmanager
def _handler(signum: int, handler: Callable[[], object]) -> Iterator[None]:
    previous = signal.signal(signum, lambda *_: handler())
    try:
        yield
    finally:
        signal.signal(signum, previous)


class Valve:
    """Holds one stage of the engine (a slow disk, or a slow copy) until :meth:`open`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> None:
        self._open = threading.Event()
        real = getattr(cls, name)

        def held(*args, **kwargs):
            self._open.wait(30)  # bounded: a broken engine fails the test, it never hangs it
            return real(*args, **kwargs)

        monkeypatch.setattr(cls, name, held)

    def open(self) -> None:
        self._open.set()


def _signal_then_open(valve: Valve, waiting_in: str) -> threading.Thread:
    """From another thread: a real signal to the training thread once it waits in the
    function ``waiting_in`` (seen on its stack), then the held stage goes on (the handler's
    calls must not need it before that wait ends)."""
    main = threading.main_thread().ident
    assert main is not None

    def inside() -> bool:
        frame = current_frames().get(main)
        while frame is not None and frame.f_code.co_name != waiting_in:
            frame = frame.f_back
        return frame is not None

    def run() -> None:
        deadline = time.monotonic() + 20
        while not inside() and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(0.02)  # inside it: most likely blocked by now
        signal.pthread_kill(main, SIG)
        time.sleep(0.05)
        valve.open()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _signal_inside(monkeypatch: pytest.MonkeyPatch, target: object, name: str) -> list[int]:
    """The first call of ``target.name`` raises a real signal in the training thread; its
    handler runs inside that call (the next bytecode that checks for signals)."""
    real, sent = getattr(target, name), []

    def then_signal(*args, **kwargs):
        if not sent:
            sent.append(SIG)
            signal.raise_signal(SIG)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, then_signal)
    return sent


class Emergency:
    """The recommended handler (README) and its variants, acting on ``ckpt`` at ``step``."""

    def __init__(self, kind: str, ckpt: Checkpointer, step: int = 500) -> None:
        self.kind, self.ckpt, self.step = kind, ckpt, step
        self.handles: list = []
        self.ran = 0

    def __call__(self) -> None:
        self.ran += 1
        if self.kind in ("recommended", "save"):
            handle = self.ckpt.save(self.step)
            self.handles.append(handle)
            handle.wait()
        if self.kind == "wait":
            self.handles.append(self.ckpt.save(self.step))
            self.ckpt.wait()
        if self.kind in ("recommended", "close"):
            self.ckpt.close()
        if self.kind == "recommended":
            sys.exit(0)
        if self.kind == "decide":
            self.ckpt.decide(self.step)
        if self.kind == "maybe_save":
            self.ckpt.maybe_save(self.step)

    @contextlib.contextmanager
    def expected(self) -> Iterator[None]:
        """What the interrupted call does: unwinds with the handler's exit, raises the
        refusal, or returns."""
        if self.kind == "recommended":
            with pytest.raises(SystemExit):
                yield
        elif self.kind in ("decide", "maybe_save"):
            fix = r"was called while \w+.*\(\) runs on this thread.*SignalNoticeSource"
            with pytest.raises(CheckpointError, match=rf"Checkpointer\.{self.kind}\(\) {fix}"):
                yield
        else:
            yield


def _versions(
    directory: Path, optimizer: bool = True, only: set[int] | None = None, strict: bool = True
) -> list[tuple[int, int]]:
    """(version, step) of every committed version (or of those in ``only``), each read back
    and verified."""
    found = []
    for version in CheckpointDir(directory).committed_versions():
        if only is not None and version not in only:
            continue
        model, opt = _objects(optimizer)
        report = load(directory, model=model, optimizer=opt, version=version, strict=strict)
        assert report.version == version and not report.skipped
        found.append((version, report.step))
    return found


def _check_after(
    emergency: Emergency, directory: Path, optimizer: bool = True, closing: bool = False
) -> None:
    """The engine's state after the interrupted call (``closing``: a close) and the
    handler's calls are over."""
    ckpt = emergency.ckpt
    assert emergency.ran == 1  # the handler did run inside the call
    refused = emergency.kind in ("decide", "maybe_save")
    if emergency.kind in ("recommended", "close") or (closing and not refused):
        with pytest.raises(CheckpointError, match="closed"):
            ckpt.save(1000)
    else:
        ckpt.save(1000).wait()  # no slot left taken, no number reused
        ckpt.close(timeout=30)
    found = _versions(directory, optimizer)
    steps = [step for _, step in found]
    assert steps == sorted(steps)  # numbered in the order they were saved
    if emergency.kind in ("recommended", "save", "wait"):
        (handle,) = emergency.handles
        assert handle.wait() is SaveStatus.COMMITTED
        assert (handle.version, emergency.step) in found
    if emergency.kind == "recommended":
        assert found[-1][1] == emergency.step  # the handler's save is the last version


# --- a handler inside each engine call, at a chosen point --------------------------------

WHERE = [
    "save: the capture",
    "save: waiting for a slot",
    "save without optimizer: waiting for its copy",
    "maybe_save: the policy's decide",
    "close: waiting for a version",
    "wait",
    "handle.wait",
    "wait_for_snapshot",
    "optimizer.step: waiting for a copy",
]
# Every entry point with the handlers that act (save and exit, save, close); the others
# where they differ most: computing, waiting for the pipeline, inside the optimizer step.
CASES = [(where, kind) for where in WHERE for kind in ("recommended", "save", "close")] + [
    (where, kind)
    for where in ("save: the capture", "save: waiting for a slot", WHERE[-1])
    for kind in ("wait", "decide", "maybe_save")
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("where", "kind"), CASES)
def test_a_handler_inside_an_engine_call(tmp_path, monkeypatch, where, kind):
    """The interrupted call was waiting (a slot, a copy, a commit) or computing (a capture,
    a policy's decision). A save or close the handler asks for runs once it is over (on the
    way out of the ``sys.exit``), durable before the process goes on; ``decide`` and
    ``maybe_save`` are refused at once. It used to hang in every waiting case, and the
    capture's save took the interrupted save's version number."""
    optimizer = not where.startswith("save without")
    model, opt = _objects(optimizer)
    ckpt = Checkpointer(tmp_path, model=model, optimizer=opt, max_in_flight=1, **SMALL)
    emergency = Emergency(kind, ckpt)
    try:
        _step(model, opt)
        with _handler(SIG, emergency):
            if where == "save: the capture":
                from pcframe.save.capture import Capture

                _signal_inside(monkeypatch, Capture, "request")
                with emergency.expected():
                    ckpt.save(1)
            elif where == "maybe_save: the policy's decide":
                _signal_inside(monkeypatch, ckpt.policy, "decide")
                with emergency.expected():
                    ckpt.maybe_save(100)  # FixedSteps(100): a save, unless interrupted
            else:
                copying = where.startswith(("save without", "wait_for", "optimizer"))
                stage = (Filler, "chunk") if copying else (Writer, "write_chunk")
                valve = Valve(monkeypatch, *stage)
                # Held in flight (its copy, or its writes); without an optimizer the save
                # itself waits for its copy: it is the call the signal lands in.
                first = ckpt.save(1) if optimizer else None
                waits = {  # the call, and the function it waits in
                    "save: waiting for a slot": (lambda: ckpt.save(2), "acquire"),
                    "save without optimizer: waiting for its copy": (
                        lambda: ckpt.save(1),
                        "wait_for_copies",
                    ),
                    "close: waiting for a version": (ckpt.close, "wait_all"),
                    "wait": (ckpt.wait, "wait_all"),
                    "handle.wait": (lambda: first.wait(), "outcome"),
                    "wait_for_snapshot": (ckpt.wait_for_snapshot, "wait_for_copies"),
                    "optimizer.step: waiting for a copy": (
                        lambda: _step(model, opt),
                        "wait_for_copies",
                    ),
                }
                call, waiting_in = waits[where]
                signaller = _signal_then_open(valve, waiting_in)
                with emergency.expected():
                    call()
                signaller.join()
        monkeypatch.undo()
        _check_after(emergency, tmp_path, optimizer, closing=where.startswith("close"))
    finally:
        monkeypatch.undo()
        with contextlib.suppress(CheckpointError):
            ckpt.close(timeout=30)


def _on_stack(thread_id: int, function: str) -> bool:
    frame = current_frames().get(thread_id)
    while frame is not None and frame.f_code.co_name != function:
        frame = frame.f_back
    return frame is not None


@pytest.mark.timeout(120)
def test_a_handlers_save_and_another_threads_save_while_the_step_waits(tmp_path, monkeypatch):
    """A spot VM's SIGTERM: the handler saves while optimizer.step() waits in its gate for a
    snapshot's copy, and a notice thread saves at the same time. The step marked itself for
    other threads' saves before its gate: the thread's save held the engine's lock waiting
    for the step, and the handler's save (run as the gate returned) waited for that lock.
    Now the step marks itself after its gate: every save commits, none holds another up."""
    model, opt = _objects()
    ckpt = Checkpointer(tmp_path, model=model, optimizer=opt, max_in_flight=2, **SMALL)
    # Two in flight: one whose writes finish after a newer one's is discarded (by design).
    commits_in_save_order(ckpt)
    main = threading.main_thread().ident
    saves: dict[str, object] = {}
    try:
        _step(model, opt)
        valve = Valve(monkeypatch, Filler, "chunk")  # the first version's copy held
        saves["first"] = ckpt.save(1)

        def notice_thread() -> None:  # saves once the loop waits in its gate
            while not _on_stack(main, "wait_for_copies"):
                time.sleep(0.002)
            saves["thread"] = ckpt.save(2)

        def signaller() -> None:  # once that save is done or waits: SIGTERM, then the copy
            while "thread" not in saves and not _on_stack(saver.ident, "_other_steps"):
                time.sleep(0.002)
            signal.pthread_kill(main, SIG)
            time.sleep(0.05)
            valve.open()

        saver = threading.Thread(target=notice_thread, daemon=True)
        kill = threading.Thread(target=signaller, daemon=True)
        with _handler(SIG, lambda: saves.setdefault("handler", ckpt.save(3))):
            saver.start()
            kill.start()
            _step(model, opt)  # the gate: waits for the first version's copy
            kill.join(60)
            saver.join(60)
        ckpt.wait()
        assert {name: saves[name].wait() for name in ("first", "thread")} == {
            "first": SaveStatus.COMMITTED,
            "thread": SaveStatus.COMMITTED,
        }
        assert "handler" in saves  # deferred to the gate's end, then run
        assert CheckpointDir(tmp_path).committed_versions() == [1, 2, 3]
    finally:
        monkeypatch.undo()
        with contextlib.suppress(CheckpointError):
            ckpt.close(timeout=30)


ENTRY_POINTS = [
    "save",
    "save without optimizer",
    "maybe_save",
    "decide",
    "wait",
    "handle.wait",
    "wait_for_snapshot",
    "optimizer.step",
    "close",
]


class HalfwaySGD(torch.optim.SGD):
    """SGD whose update raises a real signal after its first parameter: a handler lands in
    the middle of ``optimizer.step()``, between the hooks the engine gates it with."""

    signal_next = True

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for index, param in enumerate(group["params"]):
                param.add_(param.grad, alpha=-group["lr"])
                if index == 0 and self.signal_next:
                    self.signal_next = False
                    signal.raise_signal(SIG)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["save", "recommended"])
def test_a_handler_in_the_middle_of_an_optimizer_update(tmp_path, kind):
    """Run at the signal, the handler's save held the first parameter updated and the
    others not (and a first Adam step's state half made). It runs once the step is over:
    the version holds the whole step. A handler that exits ends the step there; its save
    and close run on the way out (here: the next engine call, as a with-block's exit)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    optimizer = HalfwaySGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(tmp_path, model=model, optimizer=optimizer, **SMALL)
    emergency = Emergency(kind, ckpt)
    try:
        with _handler(SIG, emergency):
            model(torch.randn(8, 64)).square().mean().backward()
            with emergency.expected():
                optimizer.step()
            now = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        ckpt.close(timeout=30)
    assert emergency.ran == 1
    (handle,) = emergency.handles
    assert handle.wait() is SaveStatus.COMMITTED
    fresh = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    assert load(tmp_path, model=fresh, version=handle.version).step == emergency.step
    saved = fresh.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in now.items())  # the whole step, saved


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_handler_at_random_lines_of_each_engine_call(tmp_path, entry):
    """A real signal raised at a line of the engine's code the call runs (lines picked at
    random, seeded, from all it runs, the first and last included; a signal is handled at
    the next bytecode that checks for one), its handler saving and waiting, as handlers
    do. Every save the handlers asked for commits, holding its step, with a number of its
    own, in the order asked; the engine goes on working (nothing left taken)."""
    optimizer = entry != "save without optimizer"
    engine = str(Path(sys.modules["pcframe"].__file__).parent)
    rng = random.Random(entry)
    asked: list = []
    step = 0
    model, opt = _objects(optimizer)

    def open_engine() -> Checkpointer:
        # take_over: each close's engine saves beside the earlier ones' versions, unrestored
        options = {"max_in_flight": 1, "take_over": True, **SMALL}
        return Checkpointer(tmp_path, model=model, optimizer=opt, **options)

    ckpt = open_engine()
    handle = None

    def handler() -> None:
        try:
            asked.append(ckpt.save(step))
        except CheckpointError:  # landed after a close() had closed the engine: too late
            assert entry == "close"
            asked.append(None)
            return
        asked[-1].wait()

    def prepare() -> None:  # not where the signal lands
        nonlocal ckpt, handle
        _step(model, opt)
        if entry == "close":  # a fresh engine for each close, on the same directory
            ckpt = open_engine()
        if entry in ("handle.wait", "wait_for_snapshot", "close", "wait"):
            handle = ckpt.save(step - 1)  # something to wait for

    calls = {
        "save": lambda: ckpt.save(step),
        "save without optimizer": lambda: ckpt.save(step),
        "maybe_save": lambda: ckpt.maybe_save(step),
        "decide": lambda: ckpt.decide(step),
        "wait": lambda: ckpt.wait(),
        "handle.wait": lambda: handle.wait(),
        "wait_for_snapshot": lambda: ckpt.wait_for_snapshot(),
        "optimizer.step": lambda: _step(model, opt),
        "close": lambda: ckpt.close(),
    }
    fired = 0
    try:
        with _handler(SIG, handler):
            if entry == "close":
                ckpt.close()  # each close below has an engine of its own
            step += 2
            prepare()
            lines = _lines_run(calls[entry], engine)
            assert lines > 3
            # A wait runs its loop as long as it waits: lines from its start, and from all.
            early = rng.sample(range(1, min(lines, 60) + 1), min(lines, 60, 5))
            picked = sorted({1, lines, *early, *rng.sample(range(1, lines + 1), 4)})
            for line in picked:
                step += 2
                prepare()
                before = len(asked)
                with _signal_at_line(line, engine) as raised:
                    calls[entry]()
                # Waits loop as long as they wait: a line past this run's last is no signal.
                assert len(asked) == before + bool(raised), line
                fired += bool(raised)
                with contextlib.suppress(CheckpointError, AttributeError):  # too late: closed
                    asked[-1].wait()
        assert fired >= 6
        if entry == "close":
            ckpt = open_engine()
        ckpt.save(step + 1).wait()  # nothing left taken: a slot, a number, the lock
    finally:
        ckpt.close(timeout=30)
    found = dict(_versions(tmp_path, optimizer))
    started = [handle for handle in asked if handle is not None and handle.version]
    if entry == "close":  # landed as the engine shut down, after its last version: too late
        late = [handle for handle in asked if handle is None or not handle.version]
        assert all(handle is None or handle.status is SaveStatus.FAILED for handle in late)
        assert len(started) >= 3  # those that landed while it waited were saved
    else:
        assert len(started) == len(asked)
    numbers = [handle.version for handle in started]
    assert numbers == sorted(set(numbers))  # each its own number, in the order asked
    assert all(found[handle.version] == handle.step for handle in started)
    assert list(found.values()) == sorted(found.values())


def _lines_run(call: Callable[[], object], engine: str) -> int:
    counted = [0]

    def trace(frame, event, _arg):
        if not frame.f_code.co_filename.startswith(engine):
            return None
        if event == "line":
            counted[0] += 1
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return counted[0]


@contextlib.contextmanager
def _signal_at_line(line: int, engine: str) -> Iterator[list[int]]:
    seen, raised = [0], []

    def trace(frame, event, _arg):
        if not frame.f_code.co_filename.startswith(engine):
            return None
        if event == "line":
            seen[0] += 1
            if seen[0] == line:
                raised.append(line)
                signal.raise_signal(SIG)  # handled right after this line's first bytecodes
        return trace

    sys.settrace(trace)
    try:
        yield raised
    finally:
        sys.settrace(None)


# --- signals at random moments of a training loop -----------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_in_flight", [1, 2])
@pytest.mark.parametrize("optimizer", [True, False], ids=["optimizer", "no-optimizer"])
def test_handlers_at_random_moments_of_a_loop_that_saves_every_step(
    tmp_path, max_in_flight, optimizer
):
    """A timer fires at random moments (seeded) of a loop that saves at every step, most of
    them inside an engine call; each handler saves the step and waits (or waits for
    everything). Every save asked for commits, holding its step, with its own number."""
    rng = random.Random(f"{max_in_flight}-{optimizer}")
    model, opt = _objects(optimizer)
    asked: list = []
    step = 0
    config = {**SMALL, "max_in_flight": max_in_flight, "keep_last": 10_000}
    with Checkpointer(tmp_path, model=model, optimizer=opt, policy=FixedSteps(1), **config) as c:

        def handler(_signum, _frame) -> None:
            asked.append(c.save(step))
            if rng.random() < 0.5:
                asked[-1].wait()
            else:
                c.wait()

        previous = signal.signal(signal.SIGALRM, handler)
        try:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline or len(asked) < 12:
                if signal.getitimer(signal.ITIMER_REAL)[0] == 0:  # the last one was handled
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.001, 0.03))
                step += 1
                _step(model, opt)
                c.maybe_save(step)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        for handle in asked:
            assert handle.wait() is SaveStatus.COMMITTED
    root = CheckpointDir(tmp_path)
    steps = [
        read_manifest(str(root.path(v) / MANIFEST_NAME)).step for v in root.committed_versions()
    ]
    assert steps == sorted(steps)  # numbered in the order they were saved
    by_number = dict(_versions(tmp_path, optimizer, {h.version for h in asked}))
    assert all(by_number[h.version] == h.step for h in asked)
    assert len(asked) >= 12


# --- real children, a real SIGTERM at a random moment ----------------------------------------


def _child(directory: str, max_in_flight: int, with_optimizer: bool, way: str) -> None:
    """A training loop that saves every step and handles SIGTERM the README's way: the
    handler (``plain``) or a notice (``notice``: ``SignalNoticeSource`` + ``NoticeDriven``)."""
    model, optimizer = _objects(with_optimizer)
    notices = [SignalNoticeSource(window=30.0)] if way == "notice" else None
    policy = NoticeDriven(FixedSteps(1)) if way == "notice" else FixedSteps(1)
    config = {**SMALL, "keep_last": 3, "max_in_flight": max_in_flight}
    ckpt = Checkpointer(
        directory, model=model, optimizer=optimizer, policy=policy, notices=notices, **config
    )
    step = 0

    def on_sigterm(signum, frame):  # the recommended handler (README), and a line for the test
        os.write(1, f"{EXIT_LINE} {step}\n".encode())
        ckpt.save(step).wait()
        ckpt.close()
        sys.exit(0)

    if way == "plain":
        signal.signal(signal.SIGTERM, on_sigterm)
    os.write(1, b"ready\n")
    while True:
        step += 1
        _step(model, optimizer)
        ckpt.maybe_save(step)
        if ckpt.notice is not None:  # the notice way (README): the version is durable now
            os.write(1, f"{EXIT_LINE} {step}\n".encode())
            ckpt.close()
            sys.exit(0)


CHILDREN = [(m, o, w) for w in ("plain", "notice") for m in (1, 2) for o in (True, False)]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sigterm_at_random_moments_of_real_training_children(tmp_path, child_env):
    """Real children train and save at every step; the parent sends SIGTERM at a random
    moment (seeded). Each exits 0 within seconds, its emergency version committed holding
    the step it names, no two versions with one number, every version verified."""
    from tests.warm import WarmProcess

    rng = random.Random(40)
    repo = Path(__file__).resolve().parents[2]
    trials = [(*config, rng.uniform(0.0, 0.4)) for config in CHILDREN]
    rng.shuffle(trials)
    for batch in range(0, len(trials), 4):  # four at a time: their waits overlap
        running = []
        for index, (mif, opt, way, delay) in enumerate(trials[batch : batch + 4], batch):
            directory, log = tmp_path / f"ckpt{index}", tmp_path / f"child{index}.log"
            log.touch()  # read below before the child may have opened it
            args = [str(directory), str(mif), str(int(opt)), way]
            child = WarmProcess(__name__, args, env=child_env, cwd=repo, log=log)
            running.append((child, directory, log, opt, delay, (mif, opt, way)))
        for child, _, log, _, delay, _ in running:
            _wait_for(lambda log=log: "ready" in log.read_text(), 120)
            time.sleep(delay)
            child.send_signal(signal.SIGTERM)
        for child, directory, log, opt, _, config in running:
            try:
                code = child.wait(timeout=60)
            except Exception:
                child.kill()
                child.wait()
                pytest.fail(f"{config}: hung after SIGTERM:\n{log.read_text()[-3000:]}")
            text = log.read_text()
            assert code == 0, f"{config}: exit code {code}\n{text[-3000:]}"
            assert "Traceback" not in text and "FileExistsError" not in text, text[-3000:]
            (named,) = map(int, re.findall(rf"{EXIT_LINE} (\d+)", text))
            # Not strict: a handler that exits in the middle of the first optimizer.step()
            # saves the optimizer's state half made (the state at the signal).
            found = _versions(directory, opt, strict=False)
            assert found and found[-1][1] == named, (config, found, named)
            assert [s for _, s in found] == sorted(s for _, s in found)


def _wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.02)


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3])), sys.argv[4])
