"""``pcframe``: list, verify, inspect and export checkpoints (a plain CLI, not a Hydra app)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pcframe.errors import CheckpointError
from pcframe.format.manifest import DATA_NAME, MANIFEST_NAME, read_manifest
from pcframe.format.names import version_number
from pcframe.restore.reader import load_version
from pcframe.store.directory import CheckpointDir


def _pick(directory: CheckpointDir, version: int | None) -> int:
    versions = directory.committed_versions()
    if not versions:
        raise CheckpointError(f"{directory.root}: no committed checkpoint versions")
    if version is None:
        return versions[-1]
    if version not in versions:
        raise CheckpointError(f"{directory.root}: version {version} not found; have {versions}")
    return version


def cmd_list(args: argparse.Namespace) -> int:
    directory = CheckpointDir(args.directory)
    versions = directory.committed_versions()
    latest = directory.latest_hint()
    print(f"{'version':>8} {'step':>10} {'size':>12}  written              ")
    for version in versions:
        try:
            manifest = read_manifest(str(directory.path(version) / MANIFEST_NAME))
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.wall_time))
            mark = "  <- LATEST" if version == latest else ""
            print(f"{version:>8} {manifest.step:>10} {manifest.data_size:>12}  {when}{mark}")
        except CheckpointError as exc:
            print(f"{version:>8} {'?':>10} {'?':>12}  unreadable: {exc}")
    if not versions:
        print(f"(no committed versions in {directory.root})")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    directory = CheckpointDir(args.directory)
    versions = [args.version] if args.version is not None else directory.committed_versions()
    if not versions:
        print(f"no committed versions in {directory.root}", file=sys.stderr)
        return 1
    failures = 0
    for version in versions:
        try:
            loaded = load_version(directory.path(version), threads=args.threads)
            print(
                f"v{version}: OK ({len(loaded.tensors)} tensors, {loaded.manifest.data_size} bytes)"
            )
        except (CheckpointError, OSError) as exc:
            failures += 1
            print(f"v{version}: FAILED: {exc}")
    return 1 if failures else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    directory = CheckpointDir(args.directory)
    version = _pick(directory, args.version)
    manifest = read_manifest(str(directory.path(version) / MANIFEST_NAME))
    summary = {
        "version": manifest.version,
        "step": manifest.step,
        "wall_time": manifest.wall_time,
        "bytes": manifest.data_size,
        "chunks": len(manifest.chunks),
        "checksum": manifest.checksum,
        "metadata": manifest.metadata,
        "engine": manifest.engine,
        "tensors": [
            {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes}
            for e in manifest.entries
        ]
        if args.tensors
        else len(manifest.entries),
    }
    print(json.dumps(summary, indent=2))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    directory = CheckpointDir(args.directory)
    version = _pick(directory, args.version)
    loaded = load_version(directory.path(version))
    tensors = {name: t.contiguous() for name, t in loaded.named_tensors().items()}
    metadata = {
        "pcframe_version": str(version),
        "pcframe_step": str(loaded.manifest.step),
        "pcframe_tree": json.dumps(loaded.manifest.tree),
    }
    output = Path(args.output or f"{directory.path(version).name}.safetensors")
    save_file(tensors, str(output), metadata=metadata)
    print(
        f"wrote {output} ({len(tensors)} tensors from version {version}, "
        f"step {loaded.manifest.step})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pcframe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="committed versions, newest last")
    p.add_argument("directory")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("verify", help="check manifests and every chunk checksum")
    p.add_argument("directory")
    p.add_argument("--version", type=int)
    p.add_argument("--threads", type=int, default=8)
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("inspect", help="print a version's manifest summary as JSON")
    p.add_argument("directory")
    p.add_argument("--version", type=int)
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("export", help=f"export a version ({DATA_NAME}) to another format")
    p.add_argument("directory")
    p.add_argument("--version", type=int)
    p.add_argument("--format", choices=["safetensors"], default="safetensors")
    p.add_argument("--output", "-o")
    p.set_defaults(func=cmd_export)
    return parser


def _check_directory(path: str) -> None:
    """A typo or a version folder given for the checkpoint directory is an error, not 'empty'."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(
            f"{root}: no such directory; give the checkpoint directory (the one holding the "
            "vNNNNNNNN version folders)"
        )
    if (root / MANIFEST_NAME).exists():
        version = version_number(root.name)
        pick = f" and pick the version with --version {version}" if version is not None else ""
        raise CheckpointError(
            f"{root} is the folder of one version; give its parent, the checkpoint directory,{pick}"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_directory(args.directory)
        return args.func(args)
    except (CheckpointError, OSError) as exc:
        print(f"pcframe {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
