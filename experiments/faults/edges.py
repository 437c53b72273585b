"""The fault campaign's edge classes (issue 40): the trust a user places at the edges.

* ``handler``: a training child that saves every step handles SIGTERM the way spot users
  write it (save, wait, close, exit; or save and exit without close; or close alone; or the
  notice way), and gets a real SIGTERM at a random moment. ``ok``: it exits 0 within the
  timeout, without a traceback or a version number taken twice; the newest committed
  version is the step its handler named (the notice way: the step its emergency save
  named; close alone: no newer than it), every version verifies, steps rise with numbers,
  and a fresh writer restores the newest and saves above it.
* ``dcp_hostile``: one or two random fields anywhere in the newest DCP manifest of a real
  one-process ``StorageWriter`` root made hostile (a wrong type, a negative or huge number,
  an off-by-one, a missing key, an empty list), re-signed as a buggy writer would leave it.
  ``ok``: the load gives version 3's exact state (the field was not one it needs), or
  version 2's (the newest fell back), or a one-line ``CheckpointError`` with the live
  tensors untouched. ``undetected``: other bytes loaded; ``traceback``: another exception.
* ``prune_race``: ``dcp.load`` in a loop beside a ``dcp.save`` loop with ``keep_last=1``
  in another process. ``ok``: every load gives one saved step's exact state; never
  "damaged" nor a raw error for a version that was only pruned.

Rows are variants, not modes (these do not depend on the codec or tier). Run through
``campaign.py`` (``--kinds handler,dcp_hostile,prune_race``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EDGE_KINDS = ("handler", "dcp_hostile", "prune_race")
HANDLERS = ("readme", "save_exit", "close_exit", "notice")
EXIT_LINE = "emergency save at step"
CHILD_TIMEOUT = 90.0
HOSTILE_VALUES = ("none", "negative", "huge", "off_by_one", "string", "empty_list", "missing")


class EdgeVerdict(Exception):
    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome, self.detail = outcome, detail


def plan_edges(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """``count`` trials of each edge kind (the prune race: one per four, it is long)."""
    specs: list[dict[str, Any]] = []
    for _ in range(count * 2):
        specs.append({
            "kind": "handler", "mode": rng.choice(HANDLERS),
            "in_flight": rng.choice((1, 2, 3)), "optimizer": rng.random() < 0.7,
            "codec": rng.choice((None, None, "zstd")), "delay": round(rng.uniform(0.0, 2.0), 3),
        })  # fmt: skip
    for _ in range(count * 3):
        specs.append({
            "kind": "dcp_hostile", "mode": "one_field" if rng.random() < 0.7 else "two_fields",
            "seed": rng.randrange(1 << 30),
        })  # fmt: skip
    for _ in range(max(1, count // 4)):
        specs.append({"kind": "prune_race", "mode": "one_writer", "loads": 25})
    return specs


def variant_of(spec: dict[str, Any]) -> str:
    if spec["kind"] == "handler":
        codec = spec["codec"] or "raw"
        return f"{spec['mode']}:mif{spec['in_flight']}:{codec}"
    if spec["kind"] == "dcp_hostile":
        return spec.get("did", spec["mode"])
    return f"{spec['loads']} loads"


def run_edge(top: Path, spec: dict[str, Any]) -> None:
    """One trial in ``top / spec['name']``; raises :class:`EdgeVerdict` unless ok."""
    where = top / spec["name"]
    where.mkdir(parents=True, exist_ok=True)
    {"handler": _trial_handler, "dcp_hostile": _trial_dcp_hostile,
     "prune_race": _trial_prune_race}[spec["kind"]](top, where, spec)  # fmt: skip


# --- running children ---------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _start(command: str, config: dict[str, Any], log: Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - the child owns it; closed when the Popen is reaped
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), command, json.dumps(config)],
        cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen, log: Path, timeout: float, what: str) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise EdgeVerdict("hung", f"{what}: no exit within {timeout:.0f} s: "
                                  f"{log.read_text()[-1500:]}") from None  # fmt: skip
    return log.read_text()


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if proc.poll() is not None:
            raise EdgeVerdict("other", f"child ended before '{text}': {log.read_text()[-1500:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise EdgeVerdict("hung", f"child never said '{text}'")
        time.sleep(0.02)


def _result(text: str) -> dict[str, Any]:
    for line in text.splitlines():
        if line.startswith("result "):
            return json.loads(line[len("result ") :])
    raise EdgeVerdict("traceback", f"no result: {text[-2000:]}")


# --- handler ------------------------------------------------------------------------------


def _trial_handler(top: Path, where: Path, spec: dict[str, Any]) -> None:
    root, log = where / "ckpt", where / "child.log"
    proc = _start("handler_child", {**spec, "root": str(root)}, log)
    _wait_for(log, "ready", proc, CHILD_TIMEOUT)
    time.sleep(spec["delay"])
    proc.send_signal(signal.SIGTERM)
    text = _finish(proc, log, CHILD_TIMEOUT, "after SIGTERM")
    if proc.returncode != 0:
        raise EdgeVerdict("other", f"exit code {proc.returncode}: {text[-2000:]}")
    if "Traceback" in text or "FileExistsError" in text:
        outcome = "traceback" if "Traceback" in text else "other"
        raise EdgeVerdict(outcome, text[-2000:])
    named = [int(s) for s in re.findall(rf"{EXIT_LINE} (\d+)", text)]
    if len(named) != 1:
        raise EdgeVerdict("other", f"the handler named {named}: {text[-1500:]}")
    probe_log = where / "probe.log"
    probe = _start("handler_probe", {**spec, "root": str(root)}, probe_log)
    got = _result(_finish(probe, probe_log, CHILD_TIMEOUT, "probe"))
    if got.get("error"):
        raise EdgeVerdict(got.get("outcome", "traceback"), got["error"])
    steps = got["steps"]
    if not steps:
        raise EdgeVerdict("lost", "no committed version after the handler")
    if steps != sorted(steps):
        raise EdgeVerdict("other", f"steps do not rise with version numbers: {steps}")
    newest = steps[-1]
    wanted = newest <= named[0] if spec["mode"] == "close_exit" else newest == named[0]
    if not wanted:
        raise EdgeVerdict("lost", f"newest committed step {newest}, the handler named {named[0]}")
    if got["restored"] != newest or not got["saved_above"]:
        raise EdgeVerdict("other", f"fresh writer: {got}")


def _handler_objects(with_optimizer: bool) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2) if with_optimizer else None
    return model, optimizer


def _handler_options(spec: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {"chunk_bytes": 16 << 10, "writer_threads": 2, "keep_last": 3}
    options["max_in_flight"] = spec["in_flight"]
    if spec["codec"]:
        options["codecs"] = {"model/*": spec["codec"]}
    return options


def handler_child(spec: dict[str, Any]) -> None:
    """Train, saving every step; handle SIGTERM as ``spec['mode']`` says."""
    import torch

    from pcframe import Checkpointer
    from pcframe.policies import FixedSteps, NoticeDriven, SignalNoticeSource

    model, optimizer = _handler_objects(spec["optimizer"])
    notice = spec["mode"] == "notice"
    ckpt = Checkpointer(
        spec["root"], model=model, optimizer=optimizer,
        policy=NoticeDriven(FixedSteps(1)) if notice else FixedSteps(1),
        notices=[SignalNoticeSource(window=30.0)] if notice else None, **_handler_options(spec),
    )  # fmt: skip
    step = 0

    def on_sigterm(signum: int, frame: Any) -> None:
        os.write(1, f"{EXIT_LINE} {step}\n".encode())
        if spec["mode"] != "close_exit":
            ckpt.save(step).wait()
        if spec["mode"] != "save_exit":  # save_exit leaves the close to the exit hooks
            ckpt.close()
        sys.exit(0)

    if not notice:
        signal.signal(signal.SIGTERM, on_sigterm)
    os.write(1, b"ready\n")
    while True:
        step += 1
        if optimizer is None:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.999).add_(1e-3)
        else:
            loss = model(torch.randn(8, 64)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        ckpt.maybe_save(step)
        if ckpt.notice is not None:
            os.write(1, f"{EXIT_LINE} {step}\n".encode())
            ckpt.close()
            sys.exit(0)


def handler_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Every version verifies (the CLI); a fresh writer restores the newest and saves."""
    from pcframe import Checkpointer
    from pcframe.apps import cli
    from pcframe.errors import CheckpointError
    from pcframe.format.manifest import MANIFEST_NAME, read_manifest
    from pcframe.store.directory import CheckpointDir

    root = spec["root"]
    if cli.main(["verify", root]) != 0:
        return {"error": "pcframe verify failed after the handler", "outcome": "lost"}
    directory = CheckpointDir(root)
    versions = directory.committed_versions()
    steps = [read_manifest(str(directory.path(v) / MANIFEST_NAME)).step for v in versions]
    model, optimizer = _handler_objects(spec["optimizer"])
    try:
        with Checkpointer(root, model=model, optimizer=optimizer, **_handler_options(spec)) as c:
            restored = c.restore()
            handle = c.save((restored or 0) + 1)
            handle.wait()
            saved_above = handle.version > max(versions, default=0)
    except CheckpointError as exc:
        return {"error": f"fresh writer: {exc}", "outcome": "other"}
    return {"steps": steps, "restored": restored, "saved_above": saved_above}


# --- hostile DCP manifests ----------------------------------------------------------------


def _dcp_base(top: Path) -> Path:
    """Versions 1..3 of a one-process DCP root (built once per campaign run)."""
    base = top / "base-dcp" / "ckpt"
    if not (top / "base-dcp" / "built").exists():
        shutil.rmtree(base.parent, ignore_errors=True)
        log = top / "base-dcp.log"
        base.parent.mkdir(parents=True)
        proc = _start("dcp_base_child", {"root": str(base)}, log)
        if _finish(proc, log, CHILD_TIMEOUT, "DCP base") and proc.returncode != 0:
            raise RuntimeError(f"building the DCP base failed: {log.read_text()[-2000:]}")
        (top / "base-dcp" / "built").touch()
    return base


def dcp_base_child(spec: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    from pcframe.integrations.dcp import StorageWriter
    from tests.integrations.dcp_ranks import training_state

    for step in (1, 2, 3):
        dcp.save(training_state(step), storage_writer=StorageWriter(spec["root"], step=step))


def _leaves(node: Any, path: tuple = ()) -> list[tuple]:
    """Every (container path, key) of a JSON tree whose value is a scalar or a list."""
    found = []
    if isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return found
    for key, value in items:
        found.append((*path, key))
        found += _leaves(value, (*path, key))
    return found


def _spoil(body: dict, rng: random.Random) -> str:
    """Make one field of ``body`` hostile; returns what was done (for the table)."""
    leaves = _leaves(body)
    target = rng.choice(leaves)
    parent = body
    for key in target[:-1]:
        parent = parent[key]
    key, old = target[-1], parent[target[-1]]
    how = rng.choice(HOSTILE_VALUES)
    if how == "missing" and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = _hostile(how, old)
    field = "/".join(str(k) for k in target if not isinstance(k, int))
    return f"{how}:{field}"


def _hostile(how: str, old: Any) -> Any:
    """A value in place of ``old`` that a careless reader would trust."""
    number = isinstance(old, int) and not isinstance(old, bool)
    if how == "negative":
        return -old if number and old else -1
    if how == "huge":
        return 1 << 62
    if how == "string":
        return "x"
    if how == "empty_list":
        return []
    if how == "off_by_one":
        if number:
            return old + 1
        if isinstance(old, list):
            return old[:-1]  # one element short
        return [old, old]
    return None  # "none", and "missing" inside a list


def _trial_dcp_hostile(top: Path, where: Path, spec: dict[str, Any]) -> None:
    import crc32c

    from pcframe.format.manifest import MANIFEST_NAME

    root = where / "ckpt"
    shutil.copytree(_dcp_base(top), root)
    path = root / "v00000003" / MANIFEST_NAME
    header, body = path.read_bytes().split(b"\n", 1)
    parsed = json.loads(body)
    rng = random.Random(spec["seed"])
    done = [_spoil(parsed, rng) for _ in range(1 if spec["mode"] == "one_field" else 2)]
    spec["did"] = "+".join(sorted({d.split(":")[0] for d in done}))
    raw = json.dumps(parsed).encode()
    signed = {"body_bytes": len(raw), "body_crc32c": f"{crc32c.crc32c(raw):08x}"}
    fields = json.loads(header) | signed
    path.write_bytes(json.dumps(fields).encode() + b"\n" + raw)
    log = where / "load.log"
    got = _result(_finish(_start("dcp_load_child", {"root": str(root)}, log), log,
                          CHILD_TIMEOUT, "load"))  # fmt: skip
    if got["outcome"] != "ok":
        raise EdgeVerdict(got["outcome"], f"{'; '.join(done)}: {got['detail']}")


def dcp_load_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the newest version into fresh live objects and classify what happened."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from pcframe.errors import CheckpointError
    from pcframe.integrations.dcp import StorageReader
    from tests.integrations.dcp_ranks import assert_loaded, fresh_state

    net, opt, state = fresh_state()
    live = [p.detach() for p in net.parameters()]
    live += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    before = [t.clone() for t in live]
    try:
        dcp.load(state, storage_reader=StorageReader(spec["root"]))
    except CheckpointException as exc:
        (wrapped,) = exc.failures.values()
        error = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if not isinstance(error, CheckpointError):
            return {"outcome": "traceback", "detail": f"{type(error).__name__}: {error}"}
        if "\n" in str(error):
            return {"outcome": "other", "detail": f"more than one line: {error}"}
        if not all(torch.equal(a, b) for a, b in zip(before, live, strict=True)):
            return {"outcome": "other", "detail": f"refused but changed the live state: {error}"}
        return {"outcome": "ok", "detail": f"refused: {error}"}
    except Exception as exc:
        return {"outcome": "traceback", "detail": f"{type(exc).__name__}: {exc}"}
    for step in (3, 2):
        try:
            assert_loaded(net, opt, state, step)  # applies the loaded state, then compares
        except AssertionError:
            continue
        return {"outcome": "ok", "detail": f"loaded step {step}"}
    detail = f"loaded a state of no saved step (its step field: {state['step']})"
    return {"outcome": "undetected", "detail": detail}


# --- a load beside a pruning writer -------------------------------------------------------


def _trial_prune_race(top: Path, where: Path, spec: dict[str, Any]) -> None:
    root = where / "ckpt"
    writer_log, loads_log = where / "writer.log", where / "loads.log"
    env = {**_env(), "DCP_TEST_STEPS": "100000", "DCP_TEST_PADDING": str(1 << 18)}
    with open(writer_log, "w") as out:
        writer = subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.dcp_ranks", "saves", str(root)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        _wait_for(writer_log, "committed 2", writer, CHILD_TIMEOUT)
        loads = _start("dcp_race_child", {"root": str(root), "loads": spec["loads"]}, loads_log)
        got = _result(_finish(loads, loads_log, 4 * CHILD_TIMEOUT, "loads"))
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait()
    if got["outcome"] != "ok":
        raise EdgeVerdict(got["outcome"], got["detail"])


def dcp_race_child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from pcframe.integrations.dcp import StorageReader
    from tests.integrations.dcp_ranks import assert_loaded, fresh_state

    for _ in range(spec["loads"]):
        net, opt, state = fresh_state()
        state["padding"] = torch.zeros((1 << 18) + 4096)
        try:
            dcp.load(state, storage_reader=StorageReader(spec["root"]))
        except CheckpointException as exc:
            return {"outcome": "other", "detail": f"a load failed: {str(exc)[-600:]}"}
        except Exception as exc:
            return {"outcome": "traceback", "detail": f"{type(exc).__name__}: {exc}"}
        step = state["step"]
        try:
            assert_loaded(net, opt, state, step)
        except AssertionError as exc:
            return {"outcome": "undetected", "detail": f"step {step}: {exc}"}
        if not torch.equal(state["padding"], torch.full_like(state["padding"], float(step))):
            return {"outcome": "undetected", "detail": f"step {step}: padding differs"}
    return {"outcome": "ok", "detail": ""}


CHILDREN = {
    "handler_child": handler_child,
    "handler_probe": handler_probe,
    "dcp_base_child": dcp_base_child,
    "dcp_load_child": dcp_load_child,
    "dcp_race_child": dcp_race_child,
}

if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    outcome = CHILDREN[sys.argv[1]](json.loads(sys.argv[2]))
    if outcome is not None:
        print("result " + json.dumps(outcome, default=str), flush=True)
