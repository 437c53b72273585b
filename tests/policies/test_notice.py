"""Notice sources (signal, file, metadata URL) and the notice-driven emergency checkpoint."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import pcframe.policies as P
from pcframe.policies import Notice, PolicyContext, SaveCompleted

# --- signal -----------------------------------------------------------------------------------


def _deliver(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    for _ in range(100):  # Python runs handlers between bytecodes of the main thread
        time.sleep(0.001)


def test_sigterm_to_this_process_becomes_a_notice() -> None:
    before = signal.getsignal(signal.SIGTERM)
    src = P.SignalNoticeSource(["SIGTERM"], window=30.0)
    src.start()
    try:
        assert src.poll(100.0) is None
        _deliver(signal.SIGTERM)  # would kill the test run if the handler were not ours
        n = src.poll(100.0)
        assert n is not None and n.source == "SIGTERM"
        assert 69.0 < n.received_at <= 100.0 and n.deadline == pytest.approx(n.received_at + 30)
        src.reset()
        assert src.poll(101.0) is None
    finally:
        src.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigusr1_and_chaining_to_the_previous_handler() -> None:
    seen: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        with P.SignalNoticeSource(["USR1"], window=120.0) as src:
            _deliver(signal.SIGUSR1)
            assert src.poll(0.0) is not None
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_close_leaves_a_handler_installed_after_the_source_in_place() -> None:
    """close() put back the handler from before start() whatever was installed since, so a
    handler a framework installed later (and that chains to ours) was thrown away. Now it
    stays, and ours, still called by it, only passes the signal on to what it replaced."""
    seen: list[str] = []
    base = signal.signal(signal.SIGUSR1, lambda s, f: seen.append("base"))
    try:
        src = P.SignalNoticeSource(["SIGUSR1"])
        src.start()
        ours = signal.getsignal(signal.SIGUSR1)

        def later(signum: int, frame: Any) -> None:
            seen.append("later")
            ours(signum, frame)  # type: ignore[operator]

        signal.signal(signal.SIGUSR1, later)
        src.close()
        assert signal.getsignal(signal.SIGUSR1) is later
        _deliver(signal.SIGUSR1)
        assert seen == ["later", "base"] and src.poll(0.0) is None  # closed: no notice
    finally:
        signal.signal(signal.SIGUSR1, base)


def test_a_closed_checkpointer_puts_back_the_handler_before_its_source(tmp_path: Path) -> None:
    """Checkpointer.close() closes its sources while signals are held (a hold stands in
    for every Python handler): the source must see its own handler through the hold."""
    import torch

    from pcframe import Checkpointer

    before = signal.getsignal(signal.SIGTERM)
    source = P.SignalNoticeSource()
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2), notices=[source]) as ckpt:
        assert signal.getsignal(signal.SIGTERM) == source._handle
        ckpt.maybe_save(1)
    assert signal.getsignal(signal.SIGTERM) == before


def test_sources_closed_in_the_order_they_started_leave_sigterm_fatal() -> None:
    """Two sources (two Checkpointers with notices=) closed first-opened first: the first
    put back SIG_DFL over the second's handler, then the second put back the first's, a
    closed source's handler that took every SIGTERM after the engines were gone: the
    process could not be stopped by SIGTERM any more."""
    child = textwrap.dedent(
        """
        import os, signal, time
        import pcframe.policies as P
        a, b = P.SignalNoticeSource(), P.SignalNoticeSource()
        a.start(); b.start()
        a.close(); b.close()
        print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
        print("alive", flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["True"]


def test_signal_source_refuses_other_threads_and_bad_names() -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            P.SignalNoticeSource().start()
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0])
    with pytest.raises(ValueError, match="unknown signal"):
        P.SignalNoticeSource(["SIGNOPE"])
    for uncatchable in ("SIGKILL", "SIGSTOP"):  # refused now, not at the first poll
        with pytest.raises(ValueError, match=f"{uncatchable} cannot be caught"):
            P.SignalNoticeSource(["SIGTERM", uncatchable])


@pytest.mark.parametrize("window", [math.nan, 0.0, -1.0])
def test_a_window_that_is_not_a_positive_number_is_refused(window: float) -> None:
    """window=nan made every notice's deadline NaN: the signal was taken and never acted on
    (no save, the run went on to its end)."""
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        P.SignalNoticeSource(window=window)
    with pytest.raises(ValueError, match="must be >= 0"):
        P.NoticeDriven(margin=math.nan)


def test_real_sigterm_to_a_training_subprocess_triggers_an_emergency_save() -> None:
    child = textwrap.dedent(
        """
        import sys, time
        import pcframe.policies as P
        policy = P.NoticeDriven(P.FixedSteps(10_000), P.SignalNoticeSource(window=30.0),
                                save_time_prior=2.0)
        step = 0
        while True:
            step += 1
            d = policy.decide(P.PolicyContext(step=step, now=time.monotonic()))
            if step == 1:
                print("ready", flush=True)
            if d.save:
                print("EMERGENCY", d.emergency, step, d.reason, flush=True)
                sys.exit(0)
            time.sleep(0.005)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err  # SIGTERM's default action (die at once) was replaced
    assert out.startswith("EMERGENCY True"), out


# --- file -------------------------------------------------------------------------------------


def test_file_source(tmp_path: Path) -> None:
    flag = tmp_path / "preempt"
    src = P.FileNoticeSource(str(flag), window=120.0, poll_interval=5.0)
    assert src.poll(0.0) is None
    flag.write_text("20")
    assert src.poll(1.0) is None  # checked at most every 5 s of the caller's clock
    n = src.poll(6.0)
    assert n is not None and n.deadline - n.received_at == pytest.approx(20.0)
    assert 6.0 - 5.0 < n.received_at <= 6.0
    flag.write_text("not a number")
    src.reset()
    n = src.poll(7.0)
    assert n is not None and n.deadline - n.received_at == pytest.approx(120.0)
    flag.unlink()
    assert src.poll(8.0) is not None  # cached until the next check
    assert src.poll(13.0) is None


def test_file_source_content_that_is_not_text_is_a_notice_with_the_window(tmp_path: Path) -> None:
    """The file's presence is the notice; its content only may say the seconds left. Bytes
    that are not UTF-8 (a watcher writing binary, a torn write) raised UnicodeDecodeError
    from poll, i.e. from ``maybe_save``: the training loop died on the notice it was given."""
    flag = tmp_path / "preempt"
    flag.write_bytes(b"\xff\xfe\x00garbage\x80")
    n = P.FileNoticeSource(str(flag), window=45.0, poll_interval=0.0).poll(1.0)
    assert n is not None and n.deadline - n.received_at == pytest.approx(45.0)


def test_file_source_path_under_a_file_or_a_folder_is_no_notice(tmp_path: Path) -> None:
    """A path whose folder is a file cannot exist (NotADirectoryError escaped from poll); a
    folder, or a symlink loop, is no file a watcher wrote."""
    (tmp_path / "afile").write_text("")
    assert P.FileNoticeSource(str(tmp_path / "afile" / "preempt")).poll(1.0) is None
    (tmp_path / "folder").mkdir()
    assert P.FileNoticeSource(str(tmp_path / "folder")).poll(1.0) is None
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert P.FileNoticeSource(str(tmp_path / "loop")).poll(1.0) is None


def test_file_source_does_not_open_a_fifo(tmp_path: Path) -> None:
    """A FIFO at the path (not a file a watcher writes) blocked the training thread in
    open() until something wrote to it: poll reads regular files only."""
    fifo = tmp_path / "preempt"
    os.mkfifo(fifo)
    src = P.FileNoticeSource(str(fifo), poll_interval=0.0)
    answers: list[Any] = []
    thread = threading.Thread(target=lambda: answers.append(src.poll(1.0)), daemon=True)
    thread.start()
    thread.join(60.0)
    if thread.is_alive():  # release the blocked open() so the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(60.0)
        pytest.fail("FileNoticeSource.poll blocked on a FIFO")
    assert answers == [None]


@pytest.mark.parametrize("window", [math.nan, -1.0, 0.0])
def test_file_source_refuses_a_window_that_is_not_positive(window: float) -> None:
    """A NaN window passed ``window <= 0``; a notice with a NaN deadline is never acted on
    (SignalNoticeSource refuses it for that reason)."""
    with pytest.raises(ValueError, match="window"):
        P.FileNoticeSource("/tmp/preempt", window=window)


class _CarelessSource(P.NoticeSource):
    """A user's notice source whose ``poll`` answers something other than a Notice."""

    name = "careless_test_source"

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def poll(self, now: float) -> Any:
        return self.answer(now)


CARELESS_POLLS = [
    lambda now: True,  # "a notice is pending"
    lambda now: now + 30.0,  # the deadline alone
    lambda now: Notice(now, math.nan, "x"),  # a deadline never met, never passed
    lambda now: Notice(now, "soon", "x"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("answer", CARELESS_POLLS)
def test_a_notice_source_answering_no_notice_is_named(answer: Any, tmp_path: Path) -> None:
    """NoticeSource is a plugin point: its ``poll`` was used unchecked, an AttributeError
    ('bool' object has no attribute 'deadline') or a TypeError deep in pcframe, or a NaN
    deadline kept pending for ever. Now a PolicyError naming the source's class, from the
    engine's sources and from NoticeDriven's own."""
    import torch

    from pcframe import Checkpointer
    from pcframe.errors import PolicyError

    match = "_CarelessSource.poll returned"
    with (
        Checkpointer(
            tmp_path / "a", model=torch.nn.Linear(2, 2), notices=[_CarelessSource(answer)]
        ) as c,
        pytest.raises(PolicyError, match=match),
    ):
        c.maybe_save(1)
    policy = P.NoticeDriven(P.FixedSteps(10), _CarelessSource(answer))
    with pytest.raises(PolicyError, match=match):
        policy.decide(PolicyContext(step=1, now=1.0))


# --- metadata URL -----------------------------------------------------------------------------


class _Metadata(BaseHTTPRequestHandler):
    """Fake AWS/GCP metadata server; ``server.state`` says what to answer."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_PUT(self) -> None:  # IMDSv2 token
        self._reply(200, "tok123")

    def do_GET(self) -> None:
        state = self.server.state  # type: ignore[attr-defined]
        if state.get("need_token") and self.headers.get("X-aws-ec2-metadata-token") != "tok123":
            return self._reply(401, "")
        if self.path.startswith("/gcp"):
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._reply(403, "")
            return self._reply(200, "TRUE" if state.get("preempted") else "FALSE")
        if state.get("action_time") is None:
            return self._reply(404, "")
        body = {"action": "terminate", "time": state["action_time"]}
        self._reply(200, json.dumps(body))

    def _reply(self, code: int, body: str) -> None:
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())


@pytest.fixture
def metadata_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    server.state = {}  # type: ignore[attr-defined]
    t = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    t.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: ThreadingHTTPServer, path: str) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def test_aws_metadata_notice_with_termination_time(metadata_server: ThreadingHTTPServer) -> None:
    src = P.MetadataNoticeSource(_url(metadata_server, "/spot/instance-action"), flavor="aws")
    src.check_once()
    assert src.poll(50.0) is None and src.last_error is None  # 404: no notice
    end = datetime.fromtimestamp(time.time() + 90.0, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    metadata_server.state["action_time"] = end  # type: ignore[attr-defined]
    src.check_once()
    n = src.poll(50.0)
    assert n is not None and n.source == "metadata:aws"
    assert 50.0 + 85.0 < n.deadline < 50.0 + 91.0  # from the endpoint's time, not the window


def test_aws_imdsv2_token_and_background_thread(metadata_server: ThreadingHTTPServer) -> None:
    metadata_server.state.update(need_token=True, action_time="2000-01-01T00:00:00Z")  # type: ignore[attr-defined]
    src = P.MetadataNoticeSource(
        _url(metadata_server, "/spot/instance-action"),
        flavor="aws",
        token_url=_url(metadata_server, "/latest/api/token"),
        poll_interval=0.02,
    )
    src.start()
    try:
        deadline = time.monotonic() + 10.0
        while src.poll(0.0) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        n = src.poll(0.0)
        assert n is not None and n.deadline < 0.0  # the termination time is in the past
    finally:
        src.close()
    assert src._thread is None


def test_gcp_metadata_needs_its_header_and_true(metadata_server: ThreadingHTTPServer) -> None:
    src = P.MetadataNoticeSource(_url(metadata_server, "/gcp"), flavor="gcp")
    assert src.window == 30.0
    src.check_once()
    assert src.poll(0.0) is None
    metadata_server.state["preempted"] = True  # type: ignore[attr-defined]
    src.check_once()
    n = src.poll(10.0)
    assert n is not None and n.deadline == pytest.approx(40.0, abs=1.0)


def test_unreachable_endpoint_is_no_notice() -> None:
    src = P.MetadataNoticeSource("http://127.0.0.1:9/none", timeout=0.2)
    src.check_once()
    assert src.poll(0.0) is None and src.last_error is not None and src.polls == 1


@pytest.mark.parametrize(
    "bad",
    [{"window": math.nan}, {"window": -5.0}, {"poll_interval": math.nan}, {"timeout": math.nan}],
)
def test_metadata_source_refuses_nan_and_negative_seconds(bad: dict[str, float]) -> None:
    """NaN passed ``<= 0``: a NaN ``poll_interval`` made the poller's wait return at once
    (a thread hammering the endpoint in a loop), a NaN window a notice whose deadline is
    never met, a negative one a notice whose deadline is before it arrived."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        P.MetadataNoticeSource("http://127.0.0.1:9/none", **bad)


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH_8.9\r\n",  # not HTTP (another service on the port): BadStatusLine
        b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"act',  # cut short: IncompleteRead
    ],
)
def test_a_garbled_endpoint_answer_does_not_end_the_poller(answer: bytes) -> None:
    """http.client's errors are not OSErrors: an answer that is not HTTP, or one cut short,
    escaped check_once and ended the poller thread, and every later notice was missed
    without a word. Now it is a failed poll (last_error) and the thread polls on."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}/x"
    src = P.MetadataNoticeSource(url, flavor="generic", timeout=5.0, poll_interval=0.01)
    try:
        src.check_once()
        assert src.last_error is not None and src.poll(0.0) is None
        src.start()
        deadline = time.monotonic() + 60.0  # bounds a broken run only; times nothing
        while src.polls < 4 and src._thread is not None and src._thread.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert src._thread is not None and src._thread.is_alive() and src.polls >= 4
    finally:
        src.close()
        server.close()


# --- the notice-driven policy -----------------------------------------------------------------


def test_emergency_save_when_it_fits() -> None:
    src = P.ManualNoticeSource()
    p = P.NoticeDriven(P.FixedSteps(1000), src, margin=5.0, save_time_prior=10.0, z=0.0)
    assert not p.decide(PolicyContext(step=1, now=0.0)).save
    src.trigger(now=1.0, window=30.0)
    d = p.decide(PolicyContext(step=2, now=2.0))
    assert d.save and d.emergency and "29.0 s left" in d.reason
    assert not p.decide(PolicyContext(step=3, now=3.0)).save  # once per notice
    # still alive after the deadline: a false alarm; periodic saving resumes
    assert p.decide(PolicyContext(step=1000, now=40.0)).save


def test_one_emergency_save_per_notice_whose_deadline_jitters(tmp_path: Path) -> None:
    """A real source recomputes the deadline from two clocks at every poll; compared
    exactly, each step looked like a new notice and saved again until the kill (the replay
    validation: 36 commits where the simulator, whose notice is one object, made 19)."""
    notice = tmp_path / "notice"
    notice.write_text("2.0")
    src = P.FileNoticeSource(str(notice), window=2.0, poll_interval=0.0)
    p = P.NoticeDriven(P.FixedSteps(1000), src, margin=0.25, save_time_prior=0.05, z=0.0)
    saves = []
    for step in range(1, 40):
        time.sleep(0.001)
        d = p.decide(PolicyContext(step=step, now=time.monotonic()))
        saves += [step] if d.save else []
    assert saves == [1]
    # A notice with a clearly later deadline (the termination time moved) is a new one.
    src2 = P.ManualNoticeSource()
    q = P.NoticeDriven(None, src2, margin=1.0, save_time_prior=1.0, z=0.0)
    src2.trigger(now=0.0, window=30.0)
    assert q.decide(PolicyContext(step=1, now=0.0)).save
    src2.trigger(now=1.0, window=30.0)
    assert q.decide(PolicyContext(step=2, now=1.0)).save


def test_a_far_deadline_is_written_short_in_the_reason() -> None:
    """A notice file saying 1e308 seconds (or a huge prior) printed the 309 digits of
    ``f"{left:.1f}"`` into the reason, the log line and the version's metadata."""
    src = P.ManualNoticeSource()
    p = P.NoticeDriven(P.FixedSteps(1000), src, margin=1e300, save_time_prior=1e299, z=0.0)
    src.trigger(now=0.0, window=1e308)
    d = p.decide(PolicyContext(step=2, now=0.0))
    assert d.save and "1e+308 s left" in d.reason and len(d.reason) < 120, d.reason
    src.trigger(now=0.0, window=2e300)
    d = p.decide(PolicyContext(step=3, now=0.0, save_duration=2e300))
    assert not d.save and "2e+300 s left" in d.reason and len(d.reason) < 160, d.reason


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"inner": P.Daly}, "inner="),  # the class, not an instance
        ({"inner": "daly"}, "inner="),
        ({"source": P.SignalNoticeSource}, "source="),
        ({"source": "SIGTERM"}, "source="),
        ({"tiers": "survivor"}, "tiers="),  # a CLI's policy.interval.tiers=survivor
        ({"tiers": ["survivor", 3]}, "tiers="),
    ],
)
def test_notice_driven_checks_its_parts_when_made(kwargs: dict[str, Any], key: str) -> None:
    """A class or a name where an object goes failed at the first decide, deep inside, as
    "decide() missing 1 required positional argument" or "'str' object has no attribute
    'start'"; tiers="survivor" was taken as the tiers 's', 'u', 'r', ... silently, so the
    survivor tier's write time was never used."""
    with pytest.raises(TypeError, match=re.escape(key)):
        P.NoticeDriven(**kwargs)


def test_no_emergency_save_when_it_cannot_finish() -> None:
    src = P.ManualNoticeSource()
    p = P.NoticeDriven(None, src, margin=5.0, save_time_prior=30.0)
    src.trigger(now=0.0, window=30.0)
    d = p.decide(PolicyContext(step=5, now=0.0, save_duration=30.0))  # measured: 30 s
    assert not d.save and "relying on the last periodic" in d.reason


def test_before_any_save_is_measured_a_notice_tries_the_save() -> None:
    """The prior (30 s) plus the margin exceeded GCP's 30 s window, so a notice before the
    first measured save never saved, and a job preempted before its first periodic
    checkpoint lost everything; a save that does not finish in time loses nothing."""
    src = P.ManualNoticeSource()
    p = P.NoticeDriven(P.Daly(mtbf=3600.0), src, margin=5.0, save_time_prior=30.0)
    src.trigger(now=0.0, window=30.0)
    d = p.decide(PolicyContext(step=150, now=0.0))
    assert d.save and d.emergency and "no save measured yet" in d.reason
    src.trigger(now=100.0, window=4.0)  # not even the margin is left: nothing to try
    assert not p.decide(PolicyContext(step=151, now=100.0)).save


def test_learned_save_time_changes_the_answer() -> None:
    p = P.NoticeDriven(None, margin=5.0, save_time_prior=30.0, z=2.0)
    notice = Notice(received_at=0.0, deadline=20.0)
    assert not p.decide(PolicyContext(step=1, now=0.0, notice=notice, save_duration=30.0)).save
    for v in range(5):  # saves turn out to take ~3 s
        p.observe(SaveCompleted(v, v, 1.0, stall=0.1, duration=3.0 + 0.1 * (v % 2), nbytes=1))
    assert p.estimated_save_time(PolicyContext(step=1, now=0.0)) < 4.0
    later = Notice(received_at=100.0, deadline=120.0)
    assert p.decide(PolicyContext(step=2, now=100.0, notice=later)).emergency


def test_engine_measurement_is_used_before_own_samples() -> None:
    p = P.NoticeDriven(None, margin=5.0, save_time_prior=30.0)
    ctx = PolicyContext(step=1, now=0.0, save_duration=2.0, notice=Notice(0.0, 20.0))
    assert p.decide(ctx).emergency


def test_no_emergency_for_a_step_already_saved() -> None:
    p = P.NoticeDriven(None, save_time_prior=1.0)
    ctx = PolicyContext(step=7, now=0.0, last_save_step=7, notice=Notice(0.0, 60.0))
    assert not p.decide(ctx).save


def test_without_notice_it_is_the_inner_policy_and_keeps_its_state() -> None:
    wrapped = P.NoticeDriven(P.Daly(mtbf=600.0), P.ManualNoticeSource())
    plain = P.Daly(mtbf=600.0)
    for s in range(500):
        c = PolicyContext(step=s, now=2.0 * s)
        assert wrapped.decide(c) == plain.decide(c)
    restored = P.NoticeDriven(P.Daly(mtbf=600.0))
    restored.load_state_dict(json.loads(json.dumps(wrapped.state_dict())))
    assert restored.inner.state_dict() == plain.state_dict()  # type: ignore[union-attr]
