"""``pcframe list`` and ``verify`` on a multi-rank checkpoint root (``global/`` + ``rank-N/``).

A global version is valid when its record reads back and every rank's shard is the very
version the record pins (the manifest checksum) and verifies chunk by chunk; this is what a
multi-rank restore checks before it chooses a version.
"""

from __future__ import annotations

import os
from pathlib import Path

from pcframe.distributed import global_versions
from pcframe.errors import CheckpointError, ManifestError, UnsupportedCheckpoint
from pcframe.format.manifest import MANIFEST_NAME
from pcframe.format.names import version_name
from pcframe.restore.reader import load_version

# A version this pcframe cannot read but a newer one can: named as such, never as damage
# (in list, and in verify's verdicts).
NEWER = "newer format (not damaged; this pcframe cannot read or verify it)"
NEWER_VERDICT = "NEWER FORMAT (not damaged; this pcframe cannot read or verify it)"


def structure_only(counts: str, ranks: list[int] | None = None) -> str:
    """verify's verdict on a version saved with checksum "none" (of ``ranks`` only, where
    not every rank's was): it has no checksums for its data, so only its structure was
    checked. Not "OK", which says the data was compared too; one wording for a version of
    one process and a multi-rank one."""
    who = "saved" if ranks is None else f"rank(s) {', '.join(map(str, ranks))} saved"
    return f"structure OK, data not verified ({counts}; {who} with checksum none)"


def is_multi_rank_root(root: Path) -> bool:
    """A root written by ``DistributedCheckpointer`` (its record folder or pointer)."""
    return (root / global_versions.RECORDS).is_dir() or (root / global_versions.POINTER).is_file()


def refuse_multi_rank_root(root: Path, command: str) -> None:
    """``inspect`` and ``export`` read one rank's shard: say which directory to give."""
    if is_multi_rank_root(root):
        ranks = sorted(p.name for p in root.glob("rank-*") if p.is_dir())
        example = root / (ranks[0] if ranks else global_versions.rank_dirname(0))
        raise CheckpointError(
            f"{root} is a multi-rank checkpoint root ({len(ranks)} rank directories): "
            f"{command} one rank's shard, e.g. pcframe {command} {example}"
        )


def list_global(root: Path, when, one_line) -> int:
    """One line per global version, newest last; 1 if any record is unreadable."""
    latest = global_versions.read_pointer(root)
    good, bad = global_versions.valid_records(root)
    rows = {r.version: r for r in good}
    unreadable = dict(bad)
    print(f"{'version':>8} {'step':>10} {'ranks':>5} {'size':>12}  written              ")
    for version in sorted(set(rows) | set(unreadable)):
        if version in unreadable:
            reason = one_line(unreadable[version])
            what = NEWER if _newer_record(root, version) else "unreadable"
            print(f"{version:>8} {'?':>10} {'?':>5} {'?':>12}  {what}: {reason}")
            continue
        record = rows[version]
        size = sum(s.nbytes for s in record.shards)
        mark = "  <- GLOBAL" if version == latest else ""
        print(
            f"{version:>8} {record.step:>10} {record.world_size:>5} {size:>12}  "
            f"{when(record.wall_time)}{mark}"
        )
    if not rows and not unreadable:
        print(f"(no committed global versions in {root})")
    for name, why in global_versions.set_aside_records(root):
        print(
            "(set aside by a restore as damaged, kept for inspection: "
            f"{one_line(name)}: {one_line(why)})"
        )
    return 1 if unreadable else 0


def _newer_record(root: Path, version: int) -> bool:
    """Whether the record of ``version`` failed for being of a newer format (not damage)."""
    try:
        global_versions.read_record(global_versions.record_path(root, version))
    except UnsupportedCheckpoint:
        return True
    except (CheckpointError, OSError):
        return False
    return False


def verify_global(root: Path, version: int | None, threads: int, one_line) -> int:
    """Verify every shard of every global version (or one); 1 if any fails or cannot be
    verified by this pcframe (a newer format, named as such)."""
    good, bad = global_versions.valid_records(root)
    found = {r.version for r in good} | {v for v, _ in bad}
    if version is not None and version not in found:
        raise CheckpointError(f"{root}: global version {version} not found; have {sorted(found)}")
    failures = 0
    for v, reason in sorted(bad):
        if version in (None, v):
            failures += 1
            what = NEWER_VERDICT if _newer_record(root, v) else "FAILED"
            print(f"v{v}: {what}: {one_line(reason)}")
    for record in sorted(good, key=lambda r: r.version):
        if version not in (None, record.version):
            continue
        problems, newer, tensors = [], [], 0
        unchecked: list[int] = []  # the ranks whose shard has no data checksums
        for shard in record.shards:
            where = root / shard.directory / version_name(shard.version)
            link = next((p for p in (where.parent, where) if os.path.islink(p)), None)
            if link is not None:  # a restore refuses it: so does verify
                problems.append(f"rank {shard.rank}: {link} is a link (never read through)")
                continue
            if not (root / shard.directory).is_dir():  # not "damaged": kept elsewhere
                problems.append(
                    f"rank {shard.rank}: no {shard.directory} folder in this root (a root per "
                    "node keeps only its own ranks' shards: verify where that rank ran)"
                )
                continue
            try:
                if global_versions.manifest_crc(where / MANIFEST_NAME) != shard.manifest_crc32c:
                    raise ManifestError(f"{where}: not the shard the global record pins")
                loaded = load_version(where, threads=max(1, threads))
                loaded.state_tree(classes=False)  # the training code's classes: not here
                tensors += len(loaded.tensors)
                if loaded.manifest.checksum == "none":  # nothing to compare its data with
                    unchecked.append(shard.rank)
            except UnsupportedCheckpoint as exc:
                newer.append(f"rank {shard.rank}: {one_line(exc)}")
            except (CheckpointError, OSError) as exc:
                problems.append(f"rank {shard.rank}: {one_line(exc)}")
        if (problems or newer) and not global_versions.record_path(root, record.version).exists():
            # The coordinator's retention deleted the record (then the ranks its shards).
            print(f"v{record.version}: deleted while it was verified (a live job's retention)")
        elif problems:
            failures += 1
            print(f"v{record.version}: FAILED: {'; '.join(problems + newer)}")
        elif newer:
            failures += 1
            print(f"v{record.version}: {NEWER_VERDICT}: {'; '.join(newer)}")
        else:
            size = sum(s.nbytes for s in record.shards)
            counts = f"{record.world_size} ranks, {tensors} tensors, {size} bytes"
            if unchecked:
                every = len(unchecked) == len(record.shards)
                print(f"v{record.version}: {structure_only(counts, None if every else unchecked)}")
            else:
                print(f"v{record.version}: OK ({counts})")
    set_aside = global_versions.set_aside_records(root) if version is None else []
    for name, why in set_aside:  # damage found by an earlier restore: named until moved away
        print(
            "set aside by a restore as damaged, kept for inspection: "
            f"{one_line(name)}: {one_line(why)}; "
            f"move it out of {root} once inspected"
        )
    if not found:
        print(f"no committed global versions in {root}")
        return 1
    return 1 if failures or set_aside else 0
