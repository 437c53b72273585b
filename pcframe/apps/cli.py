"""``pcframe``: list, verify, inspect and export checkpoints (a plain CLI, not a Hydra app)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import stat
import sys
import time
import typing
from pathlib import Path

from pcframe import __version__
from pcframe.apps.cli_ranks import (
    NEWER,
    NEWER_VERDICT,
    is_multi_rank_root,
    list_global,
    refuse_multi_rank_root,
    structure_only,
    verify_global,
)
from pcframe.apps.cli_versions import (
    check_directory,
    deleted_while_read,
    explicit_version,
    is_engine_name,
    pick,
)
from pcframe.errors import CheckpointError, ManifestError, UnsupportedCheckpoint
from pcframe.format.manifest import MANIFEST_NAME, Manifest, read_manifest
from pcframe.format.names import VERSION_DIR
from pcframe.restore.reader import LoadedVersion, load_version
from pcframe.store.directory import CheckpointDir, quarantined_versions, set_aside_reason
from pcframe.text import one_line as _one_line


def _manifest(directory: CheckpointDir, version: int) -> Manifest:
    """The validated manifest of ``version``, which must say it is that version."""
    path = directory.path(version) / MANIFEST_NAME
    manifest = read_manifest(str(path))
    if manifest.version != version:
        raise ManifestError(
            f"{path}: 'version' is {manifest.version}, but the folder is "
            f"{directory.path(version).name}"
        )
    return manifest


def _verified(directory: CheckpointDir, version: int, threads: int = 4) -> LoadedVersion:
    """``version`` read with every chunk and segment checksummed and decoded, the tree too
    (its namedtuple and enum classes are the training code's, not looked up here)."""
    loaded = load_version(directory.path(version), threads=threads)
    loaded.state_tree(classes=False)
    return loaded


def _when(wall_time: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_time))
    except (OverflowError, OSError, ValueError):  # validated, but a platform may disagree
        return f"{wall_time:.0f}s"


def cmd_list(args: argparse.Namespace) -> int:
    if is_multi_rank_root(Path(args.directory)):
        return list_global(Path(args.directory), _when, _one_line)
    directory = CheckpointDir(args.directory)
    versions = directory.committed_versions()
    latest = directory.latest_hint()
    print(f"{'version':>8} {'step':>10} {'size':>12}  written              ")
    unreadable = 0
    for version in versions:
        try:
            manifest = _manifest(directory, version)
        except UnsupportedCheckpoint as exc:  # a newer writer's, not damage
            unreadable += 1
            print(f"{version:>8} {'?':>10} {'?':>12}  {NEWER}: {_one_line(exc)}")
            continue
        except (CheckpointError, OSError) as exc:
            unreadable += 1
            print(f"{version:>8} {'?':>10} {'?':>12}  unreadable: {_one_line(exc)}")
            continue
        mark = "  <- LATEST" if version == latest else ""
        when = _when(manifest.wall_time)
        print(f"{version:>8} {manifest.step:>10} {manifest.stored_bytes:>12}  {when}{mark}")
    if not versions:
        print(f"(no committed versions in {directory.root})")
    # Named, or a version that failed a restore would just vanish from the listing.
    for line in _set_aside_lines(directory) + _not_version_lines(directory):
        print(f"({line})")
    return 1 if unreadable else 0


def _set_aside_lines(directory: CheckpointDir) -> list[str]:
    """One line per version a restore set aside as damaged: the folder and why."""
    return [  # both escaped: a folder's name and its reason file are anyone's to write
        f"set aside by a restore as damaged, kept for inspection: {_one_line(name)}: "
        f"{_one_line(set_aside_reason(directory.root / name))}"
        for name in quarantined_versions(directory.root)
    ]


def _not_version_lines(directory: CheckpointDir) -> list[str]:
    """One line per entry named like a version that is not a version's folder (a link to
    one, a file): no command reads it, and the table alone passed over it without a word."""
    try:
        names = sorted(os.listdir(directory.root))
    except OSError:  # listed a moment ago; gone now is a writer's business, not this line's
        return []
    lines = []
    for name in filter(VERSION_DIR.match, names):
        try:  # lstat: a link is named as one, never followed
            mode = os.lstat(directory.root / name).st_mode
        except OSError:  # deleted meanwhile
            continue
        if stat.S_ISDIR(mode):
            continue
        if stat.S_ISLNK(mode):
            what = "a symbolic link, not listed: pcframe never reads through a link"
            fix = f"move the version itself into {directory.root}"
        else:
            what = "a file, not a version folder" if stat.S_ISREG(mode) else "not a folder"
            fix = f"move it out of {directory.root}"
        lines.append(f"{_one_line(name)}: {what}; {fix}")
    return lines


def cmd_verify(args: argparse.Namespace) -> int:
    if is_multi_rank_root(Path(args.directory)):
        return verify_global(Path(args.directory), args.version, args.threads, _one_line)
    directory = CheckpointDir(args.directory)
    if args.version is not None:  # a version that is not there: the error inspect gives
        versions = [explicit_version(directory, args.version)]
    else:
        versions = directory.committed_versions()
    if not versions:
        print(f"no committed versions in {directory.root}", file=sys.stderr)
        for line in _set_aside_lines(directory) + _not_version_lines(directory):
            print(line, file=sys.stderr)
        return 1
    failures = 0
    for version in versions:
        try:  # every chunk checksummed, every segment checksummed and decoded, the tree too
            loaded = _verified(directory, version, args.threads)
        except UnsupportedCheckpoint as exc:  # not verified, and not damaged either
            failures += 1
            print(f"v{version}: {NEWER_VERDICT}: {_one_line(exc)}")
            continue
        except (CheckpointError, OSError) as exc:
            if deleted_while_read(directory, version):
                print(f"v{version}: deleted while it was verified (a live writer's retention)")
                continue
            failures += 1
            print(f"v{version}: FAILED: {_one_line(exc)}")
            continue
        except Exception as exc:  # a bug, not the file: still one line, then the next version
            failures += 1
            print(f"v{version}: FAILED: internal error: {type(exc).__name__}: {_one_line(exc)}")
            continue
        stored = loaded.manifest.stored_bytes
        if loaded.manifest.checksum == "none":  # nothing to compare its data bytes with
            print(f"v{version}: {structure_only(f'{len(loaded.tensors)} tensors, {stored} bytes')}")
            continue
        print(f"v{version}: OK ({len(loaded.tensors)} tensors, {stored} bytes)")
    # A version a restore set aside is damage found earlier: named, and the run fails, until
    # it is inspected and moved away (or deleted).
    set_aside = _set_aside_lines(directory) if args.version is None else []
    for line in set_aside:
        print(f"{line}; move it out of {directory.root} once inspected")
    if args.version is None:  # named, not failed: not a version, so not a damaged one
        for line in _not_version_lines(directory):
            print(f"not verified: {line}")
    return 1 if failures or set_aside else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    refuse_multi_rank_root(Path(args.directory), "inspect")
    directory = CheckpointDir(args.directory)
    version, manifest = pick(
        directory, args.version, lambda v: _manifest(directory, v), "inspect", _one_line
    )
    if args.json:
        print(json.dumps(_strict_json(_summary(manifest, args.tensors)), indent=2))
        return 0
    engine = manifest.engine if isinstance(manifest.engine, dict) else {}
    config = engine.get("config", {}) if isinstance(engine.get("config"), dict) else {}
    stored = engine.get("stored_bytes", manifest.data_size)
    codecs = sorted({e.codec for e in manifest.entries if e.codec != "raw"})
    rows = [
        ("version", f"{manifest.version} ({directory.path(version).name})"),
        ("step", str(manifest.step)),
        ("written", _when(manifest.wall_time)),
        ("state", f"{len(manifest.entries)} tensors, {_size(_state_bytes(manifest))}"),
        ("stored", f"{_size(stored)} in {len(manifest.chunks)} chunks"
         + (f", striped over {manifest.stripes} files" if manifest.stripes > 1 else "")),
        ("checksum", f"{manifest.checksum} per chunk and segment"),
        ("codecs", ", ".join(codecs) or "none (every tensor raw, bit-exact)"),
        ("delta", f"of version {manifest.delta.base} (depth {manifest.delta.depth})"
         if manifest.delta is not None else "no (a full version)"),
        ("engine", ", ".join(f"{k}={config[k]}" for k in _ENGINE_KEYS if k in config) or "?"),
        ("metadata", _shortened(json.dumps(manifest.metadata)) if manifest.metadata else "none"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:>{width}}  {_one_line(value)}")
    print()
    groups: dict[str, list[int]] = {}
    for entry in manifest.entries:
        group = groups.setdefault(_group(entry.name), [0, 0])
        group[0] += 1
        group[1] += entry.nbytes
    print(f"{'group':<24} {'tensors':>8} {'bytes':>12}")
    for name, (count, nbytes) in groups.items():
        print(f"{_one_line(name):<24} {count:>8} {_size(nbytes):>12}")
    if args.tensors:
        print()
        print(f"{'tensor':<48} {'dtype':<10} {'shape':<20} {'codec':<14} {'bytes':>10}")
        for e in manifest.entries:
            shape = "x".join(map(str, e.shape)) or "scalar"
            print(f"{_one_line(e.name):<48} {e.dtype:<10} {shape:<20} {e.codec:<14} {e.nbytes:>10}")
    else:
        print("(--tensors lists every tensor; --json prints the manifest summary as JSON)")
    return 0


def _strict_json(value: typing.Any) -> typing.Any:
    """``value`` with NaN and the infinities as strings: Python writes them as bare tokens,
    which jq and other JSON readers refuse (metadata may hold them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(item) for item in value]
    return value


METADATA_SHOWN = 500  # characters of a version's metadata `inspect` prints (--json: all)


def _shortened(text: str) -> str:
    if len(text) <= METADATA_SHOWN:
        return text
    return f"{text[:METADATA_SHOWN]}... ({len(text):,} characters; --json prints all of it)"


_ENGINE_KEYS = ("max_in_flight", "chunk_bytes", "o_direct", "persist", "copy_backend", "keep_last")


def _summary(manifest: Manifest, tensors: bool) -> dict:
    return {
        "version": manifest.version,
        "step": manifest.step,
        "wall_time": manifest.wall_time,
        "written": _when(manifest.wall_time),
        "bytes": manifest.data_size,
        "chunks": len(manifest.chunks),
        "stripes": manifest.stripes,
        "checksum": manifest.checksum,
        "metadata": manifest.metadata,
        "engine": manifest.engine,
        "tensors": [
            {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes,
             "codec": e.codec}
            for e in manifest.entries
        ]
        if tensors
        else len(manifest.entries),
    }  # fmt: skip


def _state_bytes(manifest: Manifest) -> int:
    return sum(e.nbytes for e in manifest.entries)


def _group(name: str) -> str:
    """``model``, ``optimizer/state``, ``rng``, ``stateful/data``: what a tensor belongs to."""
    parts = name.split("/")
    return "/".join(parts[:2]) if parts[0] in ("optimizer", "stateful") else parts[0]


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _check_export_target(output: Path, root: Path, force: bool) -> None:
    """Refuse an output that could damage a checkpoint or a file the user did not name to go.

    Inside the checkpoint folder only a new file at its top level is allowed (a version's own
    files, LATEST or the writer lock are never replaced); elsewhere an existing file is
    replaced only with ``--force``, and never a link, device or directory.
    """
    parent = output.absolute().parent
    if not parent.is_dir():
        raise CheckpointError(f"--output {output}: the folder {parent} does not exist")
    target, base = parent.resolve() / output.name, root.resolve()
    inside = target.is_relative_to(base)
    # A new file at the top is allowed, but not under a name the engine uses: an export
    # named v00000004 made the save of version 4 fail (its folder could not be renamed in).
    if inside and (target.parent != base or os.path.lexists(target) or is_engine_name(target.name)):
        raise CheckpointError(
            f"--output {output} is inside the checkpoint folder {root}: writing there could "
            "damage a checkpoint; choose a path outside it"
        )
    if os.path.islink(output) or (os.path.lexists(output) and not output.is_file()):
        raise CheckpointError(f"--output {output} exists and is not a regular file")
    if output.exists() and not force:
        raise CheckpointError(f"--output {output} exists; pass --force to replace it")


def _check_safetensors_dtypes(tensors: dict, only: str | None) -> None:
    """Refuse, naming the tensor, a dtype safetensors cannot store (complex128, complex32):
    its error named only the dtype and came out as a failure to write --output."""
    from safetensors.torch import save

    storable: dict = {}
    for name, tensor in tensors.items():
        if tensor.dtype not in storable:
            try:
                save({"probe": tensor.new_empty(0)})
                storable[tensor.dtype] = True
            except Exception:  # safetensors raises its own error types for a dtype
                storable[tensor.dtype] = False
        if not storable[tensor.dtype]:
            where = f"under --only {only}" if only else "in this version"
            raise CheckpointError(
                f"the tensor {_one_line(name)!s} {where} is {tensor.dtype}, which safetensors "
                "cannot store; export the other groups with --only GROUP (pcframe inspect "
                "lists them), or read the version with pcframe.load"
            )


def _check_safetensors_names(tensors: dict, only: str | None) -> None:
    """Refuse, naming the tensor, a name safetensors cannot store: its header is UTF-8, and a
    lone surrogate (a state dict key such as '\\ud800', which Python allows) failed the
    write with a UnicodeEncodeError that came out as "cannot write --output PATH"."""
    for name in tensors:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = f"under --only {only}" if only else "in this version"
            raise CheckpointError(
                f"the tensor {_one_line(name)} {where} has a name that is not valid UTF-8 "
                f"({exc.reason} at character {exc.start}), which a safetensors file cannot "
                "hold; export the other groups with --only GROUP (pcframe inspect lists "
                "them), or read the version with pcframe.load"
            ) from None


def cmd_export(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save_file

    refuse_multi_rank_root(Path(args.directory), "export")
    directory = CheckpointDir(args.directory)
    if args.output:  # refused before the (long) read of the version
        _check_export_target(Path(args.output), directory.root, args.force)
    version, loaded = pick(
        directory, args.version, lambda v: _verified(directory, v), "export", _one_line
    )
    output = Path(args.output or f"{directory.path(version).name}.safetensors")
    if not args.output:  # the default name depends on the version read
        _check_export_target(output, directory.root, args.force)
    tensors = {name: t.contiguous() for name, t in loaded.named_tensors().items()}
    if args.only:
        prefix = args.only.rstrip("/") + "/"
        tensors = {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}
        if not tensors:
            groups = sorted({_group(n) for n in loaded.named_tensors()})
            raise CheckpointError(
                f"version {version} has no tensors under {prefix!r}; it has {groups}"
            )
    kept = 0  # floating scalars left as saved
    if args.dtype:
        # Scalars are counters and scales (Adam's `step`, a loss scale), not weights: in
        # bfloat16 a step of 1001 reads 1000 and the resumed bias correction is wrong.
        dtype = getattr(torch, args.dtype)
        kept = sum(1 for t in tensors.values() if t.is_floating_point() and t.dim() == 0)
        tensors = {
            n: t.to(dtype) if t.is_floating_point() and t.dim() > 0 else t
            for n, t in tensors.items()
        }
    metadata = {
        "pcframe_version": str(version),
        "pcframe_step": str(loaded.manifest.step),
        "pcframe_only": args.only or "",
    }
    if not args.only:  # the whole state: keep its structure so it can be rebuilt
        metadata["pcframe_tree"] = json.dumps(loaded.manifest.tree)
    _check_safetensors_names(tensors, args.only)
    _check_safetensors_dtypes(tensors, args.only)
    try:
        save_file(tensors, str(output), metadata=metadata)
    except Exception as exc:  # safetensors' own error type for a path it cannot write
        raise CheckpointError(f"cannot write --output {output}: {exc}") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(output, 0o666 & ~umask)  # an ordinary file, as the user's umask says
    what = f"'{args.only}' tensors" if args.only else "tensors"
    print(
        f"wrote {output} ({len(tensors)} {what} from version {version}, "
        f"step {loaded.manifest.step}"
        + (f", as {args.dtype}" if args.dtype else "")
        + (f" but {kept} scalar(s) such as step counters, kept as saved" if kept else "")
        + (
            "; load with model.load_state_dict(safetensors.torch.load_file(path))"
            if args.only == "model"
            else ""
        )
        + ")"
    )
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (no usage block first), exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _threads(text: str) -> int:
    """``--threads``: 1..256 reader threads (the engine's read_threads range), never clamped."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 256:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: give a whole number of reader threads in 1..256, e.g. 8"
        )
    return value


# --help shows plain text: the module docstring is reStructuredText for the API docs.
# (Raw: kept as written, so its lines stay under 80 columns.)
DESCRIPTION = """List, verify, inspect and export the checkpoint folders pcframe writes.
(A plain command line tool; pcframe-run, pcframe-sim and pcframe-tune are the
Hydra apps.)"""
EPILOG = """examples:
  pcframe list ckpts-run
  pcframe verify ckpts-run                  # every manifest and chunk checksum
  pcframe inspect ckpts-run --tensors
  pcframe export ckpts-run --only model -o model.safetensors

exit codes: 0 all well, 1 a version failed, 2 an error, 3 an internal error"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pcframe",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pcframe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="committed versions, newest last")
    p.add_argument("directory")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("verify", help="check manifests and every chunk checksum")
    p.add_argument("directory")
    p.add_argument("--version", type=int)
    p.add_argument("--threads", type=_threads, default=8, help="reader threads, 1..256")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("inspect", help="a version's summary: state, storage, codecs, engine")
    p.add_argument("directory")
    p.add_argument("--version", type=int, help="the version to show (default: the newest)")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("export", help="export a version's tensors to another format")
    p.add_argument("directory")
    p.add_argument("--version", type=int)
    p.add_argument("--format", choices=["safetensors"], default="safetensors")
    p.add_argument("--output", "-o")
    p.add_argument("--force", action="store_true", help="replace an existing --output file")
    p.add_argument(
        "--only",
        help="export one group with its prefix stripped, e.g. 'model' (straight into "
        "model.load_state_dict) or 'optimizer/state'",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16", "float64"],
        help="cast floating-point tensors (e.g. bfloat16 to publish weights); scalars such "
        "as Adam's step are kept as saved",
    )
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command: 0 when all is well, 1 when a version failed, 2 on an error (141,
    silently, when the reader of its output went away).

    Whatever a checkpoint directory holds, the answer is at most one line per version and
    never a traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        check_directory(args.directory)
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is seen below
        return code
    except BrokenPipeError:
        # The reader went away (`pcframe list DIR | head`): no message, the shell's status
        # for a writer stopped by SIGPIPE. Point stdout at /dev/null so the interpreter's
        # final flush does not fail on the same pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (CheckpointError, OSError) as exc:
        print(f"pcframe {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug, not the user's input: still one line, not a traceback
        print(
            f"pcframe {args.command}: internal error: {type(exc).__name__}: {_one_line(exc)} "
            "(please report it)",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
