"""The ``pcframe`` CLI on a real checkpoint directory, run as a real process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from pcframe import Checkpointer
from pcframe.apps import cli as pcframe_cli
from pcframe.store.directory import CheckpointDir
from tests.helpers import flip_byte


def cli_process(python, *args):
    """The CLI as a user runs it: a real process (its start costs 1.5-4 s on 2 cores)."""
    return subprocess.run(
        [python, "-m", "pcframe.apps.cli", *map(str, args)], capture_output=True, text=True
    )


def cli(python, *args):
    """The CLI's ``main`` in this process, with what it prints captured: the same exit codes
    and text as a real process (``test_list_verify_inspect_export`` and the pipe test run
    real ones), without a 2-4 s interpreter start per call."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = pcframe_cli.main([str(a) for a in args])
        except SystemExit as exit:  # argparse: --help, --version and usage errors
            code = exit.code if isinstance(exit.code, int) else 2
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def make(tmp_path):
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    with Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        ckpt.save(step=10).wait()
        ckpt.save(step=20, metadata={"note": "hi"}).wait()
    return model


@pytest.mark.slow
def test_list_verify_inspect_export(tmp_path, python):
    model = make(tmp_path)
    listing = cli_process(python, "list", tmp_path)
    assert listing.returncode == 0
    rows = [line.split() for line in listing.stdout.splitlines()[1:]]
    assert [r[:2] for r in rows] == [["1", "10"], ["2", "20"]] and "LATEST" in listing.stdout

    verify = cli_process(python, "verify", tmp_path)
    assert verify.returncode == 0 and verify.stdout.count("OK") == 2

    inspect = cli_process(python, "inspect", tmp_path, "--tensors", "--json")
    info = json.loads(inspect.stdout)
    assert info["step"] == 20 and info["metadata"] == {"note": "hi"}
    assert {t["name"] for t in info["tensors"]} >= {"model/weight", "model/bias"}

    out = tmp_path / "export.safetensors"
    export = cli_process(python, "export", tmp_path, "--format", "safetensors", "-o", out)
    assert export.returncode == 0, export.stderr
    tensors = load_file(out)
    assert torch.equal(tensors["model/weight"], model.weight.detach())
    assert any(name.endswith("exp_avg") for name in tensors)


def test_verify_reports_corruption_with_exit_code(tmp_path, python):
    make(tmp_path)
    data = tmp_path / "v00000002" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[3] ^= 1
    data.write_bytes(bytes(raw))
    verify = cli(python, "verify", tmp_path)
    assert verify.returncode == 1
    assert "v1: OK" in verify.stdout and "v2: FAILED" in verify.stdout
    assert "checksum mismatch" in verify.stdout


def test_verify_says_a_version_without_checksums_was_checked_for_structure_only(tmp_path, python):
    """A version saved with checksum="none" has no checksums for its data: verify said
    "OK" even with its bytes changed, as if it had checked them."""
    with Checkpointer(tmp_path, model=torch.nn.Linear(6, 3), checksum="none") as ckpt:
        ckpt.save(step=1).wait()
    flip_byte(tmp_path / "v00000001" / "data.bin", 3)
    verify = cli(python, "verify", tmp_path)
    assert verify.returncode == 0
    assert verify.stdout.startswith("v1: structure OK, data not verified (")
    assert "saved with checksum none" in verify.stdout


def test_clear_errors_for_missing_things(tmp_path, python):
    for command in ("list", "verify", "inspect", "export"):
        result = cli(python, command, tmp_path / "typo")
        assert result.returncode == 2 and "typo: no such directory" in result.stderr, command
    (tmp_path / "empty").mkdir()
    result = cli(python, "inspect", tmp_path / "empty")
    assert result.returncode == 2 and "no committed checkpoint versions" in result.stderr
    make(tmp_path)
    result = cli(python, "export", tmp_path, "--version", "7")
    assert result.returncode == 2 and "version 7 not found" in result.stderr
    result = cli(python, "verify", tmp_path / "v00000002")
    assert result.returncode == 2 and "pick the version with --version 2" in result.stderr
    manifest = tmp_path / "v00000002" / "manifest.json"
    assert manifest.is_file()
    for given in (manifest, tmp_path / "LATEST"):  # a file, not "no such directory"
        result = cli(python, "list", given)
        assert result.returncode == 2 and "not a directory (a file)" in result.stderr, given
    assert f"version folders, here {tmp_path})" in cli(python, "verify", manifest).stderr


def test_an_unlistable_directory_is_named_as_such_not_as_a_stranger(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    make(tmp_path)
    listing = Path.iterdir

    def denied(path):
        if path == tmp_path:  # what a mode-0311 folder or a dead mount answers
            raise PermissionError(13, "Permission denied", str(path))
        return listing(path)

    monkeypatch.setattr(Path, "iterdir", denied)
    assert pcframe_cli.main(["list", str(tmp_path)]) == 2
    message = capsys.readouterr().err
    assert "cannot list the directory (Permission denied, errno 13)" in message
    assert "not a pcframe checkpoint directory" not in message


def test_version_readable_inspect_and_export_of_one_group(tmp_path, python):
    model = make(tmp_path)
    version = cli(python, "--version")
    assert version.returncode == 0 and version.stdout.startswith("pcframe ")
    table = cli(python, "inspect", tmp_path)
    assert table.returncode == 0
    assert "step  20" in table.stdout and "model" in table.stdout and "{" not in table.stdout[:40]
    out = tmp_path / "model.safetensors"
    export = cli(python, "export", tmp_path, "--only", "model", "--dtype", "float64", "-o", out)
    assert export.returncode == 0, export.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    fresh = torch.nn.Linear(model.in_features, model.out_features).double()
    fresh.load_state_dict(load_file(out))  # prefixes stripped: straight into load_state_dict
    assert torch.equal(fresh.weight, model.weight.detach().double())
    missing = cli(python, "export", tmp_path, "--only", "nope", "-o", tmp_path / "x.st")
    assert missing.returncode == 2 and "has no tensors under 'nope/'" in missing.stderr


def test_export_to_bfloat16_keeps_step_counters_exact(tmp_path, python):
    """Before, every floating tensor was cast: Adam's step 1001 came back as 1000."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    for state in optimizer.state.values():
        state["step"].fill_(1001.0)
    with Checkpointer(tmp_path / "ckpt", model=model, optimizer=optimizer) as ckpt:
        ckpt.save(step=1001).wait()
    out = tmp_path / "all.safetensors"
    export = cli(python, "export", tmp_path / "ckpt", "--dtype", "bfloat16", "-o", out)
    assert export.returncode == 0, export.stderr
    assert "but 2 scalar(s) such as step counters, kept as saved" in export.stdout
    tensors = load_file(out)
    steps = [t for name, t in tensors.items() if name.endswith("/step")]
    assert len(steps) == 2 and all(t.dtype == torch.float32 and t.item() == 1001 for t in steps)
    assert tensors["model/weight"].dtype == torch.bfloat16


def test_a_reader_that_goes_away_is_no_error_message(tmp_path, python):
    """`pcframe list DIR | head`: the pipe closes before the listing is written."""
    make(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as in a shell
    proc = subprocess.Popen(
        [python, "-m", "pcframe.apps.cli", "list", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    proc.stdout.close()  # the only reader: the listing's first write finds no one
    stderr = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 141  # as a writer stopped by SIGPIPE
    assert stderr == ""


def test_export_never_writes_over_a_checkpoint_or_an_unnamed_file(tmp_path, python):
    """``-o`` into a version's own file once broke the newest checkpoint; an existing file
    was replaced without asking, and /dev/full became a regular file."""
    root = tmp_path / "ckpt"
    root.mkdir()
    make(root)
    newest = max(CheckpointDir(root).committed_versions())
    data = root / f"v{newest:08d}" / "data.bin"
    before = data.read_bytes()
    named_like_the_engine = (  # LATEST.tmp: the next writer removes it as its own leftover
        root / f"v{newest + 1:08d}",
        root / f"v{newest + 1:08d}.tmp",
        root / "LATEST.tmp",
    )
    for target in (
        data,
        root / "LATEST",
        root / f"v{newest:08d}" / "new.st",
        *named_like_the_engine,
    ):
        result = cli(python, "export", root, "-o", target)
        assert result.returncode == 2 and "inside the checkpoint folder" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert data.read_bytes() == before
    assert not any(path.exists() for path in named_like_the_engine)  # next save's names
    assert cli(python, "verify", root).returncode == 0
    precious = tmp_path / "precious.st"
    precious.write_text("precious")
    refused = cli(python, "export", root, "-o", precious)
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert precious.read_text() == "precious"
    assert cli(python, "export", root, "-o", precious, "--force").returncode == 0
    assert load_file(str(precious))  # replaced on purpose: a real export now
    device = cli(python, "export", root, "-o", "/dev/null", "--force")
    assert device.returncode == 2 and "not a regular file" in device.stderr
    missing = cli(python, "export", root, "-o", tmp_path / "no" / "such" / "x.st")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_wrong_folders_versions_and_threads_are_one_line_and_exit_code_2(tmp_path, python):
    """Each of these once exited 0 (an empty listing, 1 thread for -5) or said something
    other than what inspect and export say for the same mistake."""
    stranger = tmp_path / "photos"
    stranger.mkdir()
    (stranger / "cat.jpg").write_bytes(b"meow")
    for command in ("list", "verify", "inspect"):
        result = cli(python, command, stranger)
        assert result.returncode == 2, (command, result.stdout)
        assert "not a pcframe checkpoint directory" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    quarantined = tmp_path / "all-failed"  # every version was set aside by a restore
    (quarantined / ".corrupt-v00000001-77").mkdir(parents=True)
    result = cli(python, "list", quarantined)
    assert result.returncode == 0 and "no committed versions" in result.stdout, result.stderr
    assert "set aside by a restore as damaged" in result.stdout
    assert ".corrupt-v00000001-77" in result.stdout
    root = tmp_path / "ckpt"
    root.mkdir()
    make(root)
    result = cli(python, "verify", root, "--version", "99")
    assert result.returncode == 2 and "version 99 not found; have [1, 2]" in result.stderr
    for threads in ("-5", "0", "many"):
        result = cli(python, "verify", root, "--threads", threads)
        assert result.returncode == 2 and "1..256" in result.stderr, threads
        assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


def test_a_damaged_newest_version_is_skipped_by_inspect_and_export_and_named(tmp_path, python):
    model = make(tmp_path)
    (tmp_path / "v00000003").mkdir()  # a version folder with nothing in it
    (tmp_path / "v00000003" / "manifest.json").write_text("not json")
    inspect = cli(python, "inspect", tmp_path, "--json")
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["step"] == 20
    (warning,) = inspect.stderr.strip().splitlines()
    assert "using version 2" in warning and "version 3" in warning
    out = tmp_path.parent / f"{tmp_path.name}-export.safetensors"
    export = cli(python, "export", tmp_path, "-o", out)
    assert export.returncode == 0, export.stderr
    assert torch.equal(load_file(out)["model/weight"], model.weight.detach())
    explicit = cli(python, "inspect", tmp_path, "--version", "3")
    assert explicit.returncode == 2 and "v00000003" in explicit.stderr


def test_a_version_deleted_by_a_live_writer_while_read_is_not_called_damaged(
    tmp_path, monkeypatch, capsys
):
    """`pcframe verify` as a scrub of a training job's directory: its retention deletes old
    versions under the walk. Before, each one read as FAILED (a missing data.bin), exit 1."""
    import shutil

    with Checkpointer(tmp_path, model=torch.nn.Linear(6, 3)) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step=step).wait()
    real_load = pcframe_cli.load_version
    prune = {"v00000001"}

    def pruned_while_read(path, **kwargs):
        if path.name in prune:  # the writer's retention, at the worst moment
            prune.discard(path.name)
            shutil.rmtree(path)
        return real_load(path, **kwargs)

    monkeypatch.setattr(pcframe_cli, "load_version", pruned_while_read)
    assert pcframe_cli.main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "v1: deleted while it was verified (a live writer's retention)"
    assert out[1].startswith("v2: OK") and out[2].startswith("v3: OK")
    # inspect/export: the newest one was deleted under the read: the next one, no warning.
    prune.add("v00000003")
    out_file = tmp_path.parent / f"{tmp_path.name}.safetensors"
    assert pcframe_cli.main(["export", str(tmp_path), "-o", str(out_file)]) == 0
    printed = capsys.readouterr()
    assert "from version 2," in printed.out and "warning" not in printed.err

    # Every listed version deleted under the walk while a newer one was committed: the
    # directory is listed again and the newer one read (before: "no version reads back").
    def commit_newer():
        with Checkpointer(tmp_path, model=torch.nn.Linear(6, 3)) as writer:
            writer.save(step=40).wait()

    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda path: (real_rmtree(path), commit_newer()))
    prune.add("v00000002")  # the only one left
    assert pcframe_cli.main(["export", str(tmp_path), "-o", str(out_file), "--force"]) == 0
    assert "from version 4, step 40" in capsys.readouterr().out
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    # Damage is still damage: a flipped byte in a version that is still there fails.
    flip_byte(tmp_path / "v00000004" / "data.bin", 0)
    assert pcframe_cli.main(["verify", str(tmp_path)]) == 1
    assert "v4: FAILED" in capsys.readouterr().out


def test_list_and_verify_count_the_bytes_of_coded_tensors(tmp_path, python):
    """A version stored in codec.bin was listed as 0 bytes ("OK (4 tensors, 0 bytes)")."""
    model = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path, model=model, codecs={"*": "zstd"}) as ckpt:
        ckpt.save(step=1).wait()
    version = tmp_path / "v00000001"
    on_disk = sum((version / name).stat().st_size for name in ("data.bin", "codec.bin"))
    assert (version / "codec.bin").stat().st_size > 0
    listing = cli(python, "list", tmp_path)
    assert listing.returncode == 0 and f" {on_disk} " in listing.stdout, listing.stdout
    verify = cli(python, "verify", tmp_path)
    assert verify.returncode == 0 and f"{on_disk} bytes" in verify.stdout, verify.stdout


def test_a_url_is_named_as_one_not_mangled_into_a_missing_folder(python):
    """`pcframe verify s3://bucket/run` said "s3:/bucket/run: no such directory"."""
    for command in ("list", "verify"):
        result = cli(python, command, "s3://my-bucket/runs/run1")
        assert result.returncode == 2, result.stderr
        assert "s3://my-bucket/runs/run1 is a URL" in result.stderr
        assert "tiers=" in result.stderr and "s3:/my" not in result.stderr


def test_verify_and_list_name_each_version_a_restore_set_aside_and_why(tmp_path, python):
    """A restore that found v2 damaged set it aside and loaded v1: verify fails (the damage
    is still there, until inspected and moved away) and both commands say what and why."""
    model = make(tmp_path)
    flip_byte(tmp_path / "v00000002" / "data.bin", 3)
    with Checkpointer(tmp_path, model=model, optimizer=torch.optim.Adam(model.parameters())) as c:
        assert c.restore() == 10
    verify = cli(python, "verify", tmp_path)
    assert verify.returncode == 1 and "v1: OK" in verify.stdout, verify.stdout
    set_aside = [line for line in verify.stdout.splitlines() if "set aside" in line]
    assert len(set_aside) == 1 and ".corrupt-v00000002-" in set_aside[0]
    assert "checksum mismatch" in set_aside[0] and "move it out of" in set_aside[0]
    listing = cli(python, "list", tmp_path)
    assert "set aside" in listing.stdout and "checksum mismatch" in listing.stdout
    # One set aside by a pcframe that recorded no reason is still named.
    (tmp_path / ".corrupt-v00000007-12").mkdir()
    assert "v00000007-12: reason not recorded" in cli(python, "verify", tmp_path).stdout


def test_list_and_verify_name_a_version_entry_that_is_a_link_or_a_file(tmp_path, python):
    """A version folder linked in from elsewhere and a file named like a version were passed
    over without a word: both are named below the table, and the link is never followed."""
    root = tmp_path / "run"
    make(root)
    shutil.copytree(root / "v00000002", tmp_path / "elsewhere")  # a valid version, outside
    (root / "v00000003").symlink_to(tmp_path / "elsewhere")
    (root / "v00000004").write_text("not a version\n")
    listing = cli(python, "list", root)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split()[0] for line in listing.stdout.splitlines()[1:]]
    assert rows[:2] == ["1", "2"] and "3" not in rows, listing.stdout  # the link: not read
    named = [line for line in listing.stdout.splitlines() if line.startswith("(v0000000")]
    assert len(named) == 2 and "v00000003: a symbolic link" in named[0], named
    assert "never reads through a link" in named[0] and str(root) in named[0]
    assert "v00000004: a file, not a version folder; move it out of" in named[1]
    verify = cli(python, "verify", root)
    assert verify.returncode == 0 and verify.stdout.count(": OK") == 2, verify.stdout
    assert "not verified: v00000003: a symbolic link" in verify.stdout
    assert "not verified: v00000004: a file" in verify.stdout


def test_help_is_plain_text(python):
    """``pcframe --help`` showed the module docstring's reStructuredText (``pcframe``)."""
    for args in (["--help"], *([command, "--help"] for command in COMMANDS)):
        shown = cli(python, *args)
        assert shown.returncode == 0 and shown.stdout, args
        for markup in ("``", ":class:", ":func:", ":mod:", ":meth:", ".. "):
            assert markup not in shown.stdout, (args, markup)
    top = cli(python, "--help").stdout
    assert "List, verify, inspect and export" in top
    assert max(map(len, top.splitlines())) <= 80  # the raw text, as written
    assert "pcframe verify ckpts-run" in top  # an example, with pcframe-run's README folder


COMMANDS = ("list", "verify", "inspect", "export")


def test_inspect_shortens_large_metadata_and_json_keeps_all_of_it(tmp_path, python):
    """200 KB of a version's metadata was printed on one line of the table."""
    model = torch.nn.Linear(2, 2)
    metadata = {"notes": "x" * 200_000, "limit": 1e308}
    with Checkpointer(tmp_path, model=model) as ckpt:
        ckpt.save(step=1, metadata=metadata).wait()
    table = cli(python, "inspect", tmp_path)
    assert table.returncode == 0 and len(table.stdout) < 5_000
    (line,) = [row for row in table.stdout.splitlines() if row.strip().startswith("metadata")]
    assert line.endswith("characters; --json prints all of it)")
    assert json.loads(cli(python, "inspect", tmp_path, "--json").stdout)["metadata"] == metadata


def test_inspect_json_is_strict_json_when_metadata_holds_nan(tmp_path, python):
    """NaN was printed as a bare token, which jq and strict readers refuse."""
    with Checkpointer(tmp_path, model=torch.nn.Linear(2, 2)) as ckpt:
        ckpt.save(step=1, metadata={"loss": float("nan"), "best": float("-inf")}).wait()
    text = cli(python, "inspect", tmp_path, "--json").stdout

    def refuse(token: str) -> None:
        raise ValueError(token)

    info = json.loads(text, parse_constant=refuse)
    assert info["metadata"] == {"loss": "nan", "best": "-inf"}


def test_a_set_aside_versions_name_and_reason_cannot_drive_the_terminal(tmp_path, python):
    """Both were printed raw: a reason file (or a folder name) holding escape sequences set
    the window title, cleared the screen and overwrote lines."""
    make(tmp_path)
    hostile = "\x1b]0;pwned\x07\x1b[2J\rOVERWRITE"
    aside = tmp_path / f".corrupt-v00000001-{hostile}"
    aside.mkdir()
    (aside / "set-aside.txt").write_text(f"checksum mismatch {hostile}\n")
    for command in ("list", "verify"):
        result = cli(python, command, tmp_path)
        assert "\x1b" not in result.stdout + result.stderr and "\r" not in result.stdout
        assert "\\x1b]0;pwned\\x07" in result.stdout + result.stderr


def test_export_names_the_tensor_safetensors_cannot_store(tmp_path, python):
    """A complex128 tensor failed as "cannot write --output PATH: torch.complex128"."""

    class Spectrum:
        def state_dict(self) -> dict:
            return {"z": torch.zeros(3, dtype=torch.complex128)}

        def load_state_dict(self, state: dict) -> None:
            pass

    root = tmp_path / "ckpt"
    with Checkpointer(root, model=torch.nn.Linear(2, 2), stateful={"fft": Spectrum()}) as ckpt:
        ckpt.save(step=1).wait()
    out = tmp_path / "all.st"
    refused = cli(python, "export", root, "-o", out)
    assert refused.returncode == 2 and not out.exists()
    assert "stateful/fft/z in this version is torch.complex128" in refused.stderr
    assert "--only GROUP" in refused.stderr
    assert cli(python, "export", root, "--only", "model", "-o", out).returncode == 0


def test_export_names_a_tensor_whose_name_is_not_utf8(tmp_path, python):
    """A state dict key with a lone surrogate failed as "cannot write --output PATH: 'utf-8'
    codec can't encode...", blaming the output path; the tensor is named instead."""
    odd = torch.nn.Module()
    odd.register_buffer("\ud800", torch.ones(2))
    root = tmp_path / "ckpt"
    with Checkpointer(root, model=odd, stateful={"other": torch.nn.Linear(2, 2)}) as ckpt:
        ckpt.save(step=1).wait()
    out = tmp_path / "all.st"
    refused = cli(python, "export", root, "-o", out)
    assert refused.returncode == 2 and not out.exists()
    (line,) = refused.stderr.strip().splitlines()
    assert "the tensor model/\\ud800 in this version has a name that is not valid UTF-8" in line
    assert "cannot write --output" not in line and "--only GROUP" in line
    assert cli(python, "export", root, "--only", "stateful/other", "-o", out).returncode == 0
