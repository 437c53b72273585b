"""Engine configuration: one dataclass, validated up front so bad values fail at start-up."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pcframe.errors import ConfigError
from pcframe.format.checksum import CHECKSUMS
from pcframe.format.stripes import MAX_STRIPES

PAGE = 4096
COPY_BACKENDS = ("torch", "numba", "triton", "auto")
PERSIST_PATHS = ("write", "mmap", "auto")
_INTEGERS = (
    "stripes",
    "max_in_flight",
    "writer_threads",
    "chunk_bytes",
    "staging_bytes",
    "keep_last",
    "tensor_align",
    "read_threads",
    "full_every",
)
_OPTIONAL = ("staging_bytes",)
_STRINGS = ("o_direct", "checksum", "copy_backend", "persist")

MAX_THREADS = 256  # writer and reader threads of one engine (and of a read-only load)


@dataclass
class EngineConfig:
    """Knobs of the checkpoint engine (also the Hydra ``engine`` config group's schema).

    Attributes:
        max_in_flight: checkpoints that may be copying/persisting at once (PCcheck's N).
        writer_threads: threads writing chunks of all in-flight versions.
        chunk_bytes: size of one staging buffer and one checksummed unit on disk.
        staging_bytes: host staging budget in bytes; ``None`` means
            ``staging_ratio`` x the size of the state (computed before the first save once
            the state's size is known, else at it).
        staging_ratio: see ``staging_bytes``. 1.0 stages one whole version; PCcheck uses 2
            so that two overlapping saves never wait for buffers.
        o_direct: ``"off"``, ``"on"`` (error if the file system refuses) or ``"auto"``.
        checksum: per-chunk checksum algorithm.
        keep_last: committed versions kept; the newest committed one is never deleted.
        tensor_align: byte alignment of each tensor inside the data file.
        copy_backend: kernel of the copy stage. ``"auto"`` (the default): host chunks
            copied from address tables built once per layout, libc ``memmove`` per piece
            through ctypes with the GIL released (a state of 3200 tensors: 0.4x the stall of
            ``Tensor.copy_`` per piece on 2 cores), CUDA chunks by the GPU's copy engine
            through torch (Triton's copy ran at 0.32x its rate on an H200); ``"torch"``
            (``Tensor.copy_`` per piece everywhere), ``"numba"`` (host chunks in one Numba
            call each, a little faster than ``auto`` for thousands of tensors, but Numba
            holds about 125 MiB more of host memory; CUDA as ``auto``) or ``"triton"``
            (CUDA chunks by its kernel). With ``checksum="pcf64"``, ``numba`` and ``triton``
            compute the checksum in the same pass as the copy.
        read_threads: threads reading and verifying chunks on restore (more threads keep a
            cold disk busier: 8 read 1 GiB 25% faster than 4 on the benchmark machine).
        codecs: tensor-name glob -> codec, first match wins, e.g.
            ``{"optimizer/state/*/exp_avg*": "int8_block", "model/*": "zstd"}``. A value is a
            codec name or ``{"codec": name, **options}`` (e.g. ``block_size``, ``level``).
            Empty (the default): every tensor is stored raw, bit-exact. ``xor_delta_zstd``
            stores the XOR against the previous committed version (see ``full_every``).
        full_every: with ``xor_delta_zstd`` tensors, at most ``full_every - 1`` delta
            versions follow a full one, so a restore reads a chain of at most
            ``full_every`` versions. 1 disables deltas.
        persist: how chunks reach the data file: ``"write"`` (pwrite, O_DIRECT per
            ``o_direct``), ``"mmap"`` (copy into a shared mapping with the checksum in the
            same pass, then msync) or ``"auto"`` (mmap on DAX / persistent-memory mounts,
            write elsewhere: on tmpfs pwrite measured cheaper than a mapping).
        stripes: files a version's ``data.bin`` chunks are spread over, chunk ``c`` in file
            ``c % stripes`` (:mod:`pcframe.format.stripes`). Buffered writes to one file take
            turns on its lock, so where the page cache is the medium, parallel writers need
            several files (tmpfs, 2 threads: 5.6 GB/s into one file, 10.7 GB/s into two).
            ``0`` (auto): ``writer_threads`` files on tmpfs / ramfs, one elsewhere (an
            O_DIRECT disk writes one file in parallel at the same rate; at most 16). One
            stripe is the unstriped format, readable by every pcframe; more need format
            version 4. ``persist: mmap`` always writes one file (a mapping takes no lock).
    """

    max_in_flight: int = 2
    writer_threads: int = 4
    chunk_bytes: int = 16 * 1024 * 1024
    staging_bytes: int | None = None
    staging_ratio: float = 1.0
    o_direct: str = "auto"
    checksum: str = "crc32c"
    keep_last: int = 3
    tensor_align: int = 64
    copy_backend: str = "auto"
    read_threads: int = 8
    codecs: dict[str, Any] = field(default_factory=dict)
    full_every: int = 8
    persist: str = "auto"
    stripes: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(key: str, fix: str) -> ConfigError:
            return ConfigError(f"engine.{key}={getattr(self, key)!r} is invalid: {fix}")

        self._check_types(bad)
        if not 1 <= self.max_in_flight <= 64:
            raise bad("max_in_flight", "use 1..64 concurrent checkpoints (2-4 is typical)")
        if not 1 <= self.writer_threads <= MAX_THREADS:
            raise bad("writer_threads", f"use 1..{MAX_THREADS} writer threads")
        if not 1 <= self.read_threads <= MAX_THREADS:
            raise bad("read_threads", f"use 1..{MAX_THREADS} reader threads")
        if self.chunk_bytes < PAGE or self.chunk_bytes % PAGE or self.chunk_bytes > 1 << 30:
            raise bad("chunk_bytes", f"use a multiple of {PAGE} between 4 KiB and 1 GiB")
        if self.staging_bytes is not None and self.staging_bytes < self.chunk_bytes:
            raise bad("staging_bytes", "give at least one chunk (chunk_bytes) or null")
        if self.staging_ratio <= 0:
            raise bad("staging_ratio", "use a positive multiple of the state size, e.g. 2.0")
        if self.o_direct not in ("off", "on", "auto"):
            raise bad("o_direct", "use 'off', 'on' or 'auto'")
        if self.checksum not in CHECKSUMS:
            raise bad("checksum", f"use one of {', '.join(CHECKSUMS)}")
        if self.keep_last < 1:
            raise bad("keep_last", "keep at least 1 version (the newest committed one)")
        align = self.tensor_align
        if align < 1 or align & (align - 1) or align > PAGE:
            raise bad("tensor_align", f"use a power of two up to {PAGE}")
        if self.copy_backend not in COPY_BACKENDS:
            raise bad("copy_backend", f"use one of {', '.join(COPY_BACKENDS)}")
        if self.persist not in PERSIST_PATHS:
            raise bad("persist", f"use one of {', '.join(PERSIST_PATHS)}")
        if not 0 <= self.stripes <= MAX_STRIPES:
            raise bad("stripes", f"use 1..{MAX_STRIPES} files per version, or 0 (auto)")
        if not 1 <= self.full_every <= 100:
            raise bad("full_every", "use 1..100 versions per full version (1: no deltas)")
        if not isinstance(self.codecs, Mapping):
            raise bad("codecs", "map tensor-name globs to codecs, e.g. {'model/*': 'zstd'}")
        if self.codecs:
            # Imported only when used: the codec registry pulls in the kernels package.
            from pcframe.save.codec import check_codec_config

            try:
                check_codec_config(self.codecs, self.chunk_bytes)
            except ValueError as exc:
                raise bad("codecs", str(exc)) from None

    def _check_types(self, bad: Any) -> None:
        """Every field has its type before any range check (``1.5``, ``"2"`` and ``nan`` are
        refused here, naming the key, instead of failing later inside the engine)."""
        for key in _INTEGERS:
            value = getattr(self, key)
            if value is None and key in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(key, f"must be a whole number, not {type(value).__name__}")
        for key in _STRINGS:
            if not isinstance(getattr(self, key), str):
                raise bad(key, f"must be a string, not {type(getattr(self, key)).__name__}")
        ratio = self.staging_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float):
            raise bad("staging_ratio", f"must be a number, not {type(ratio).__name__}")
        if not math.isfinite(ratio) or ratio > 64:
            raise bad("staging_ratio", "use a finite multiple of the state size up to 64")

    def check_runtime(self) -> None:
        """Raise :class:`ConfigError` if this machine cannot run the configuration.

        Separate from :meth:`validate` so configs compose anywhere (a Triton config on a
        laptop); the engine calls it when it starts. An explicitly named ``copy_backend``
        is used or refused up front, never swapped for another silently.
        """
        if self.copy_backend not in ("numba", "triton"):
            return
        import torch

        from pcframe.kernels import resolve_backend

        # Numba copies host chunks (CUDA ones go to the copy engine, as with auto); Triton
        # needs a GPU or its interpreter.
        gpu = self.copy_backend == "triton" and torch.cuda.is_available()
        device = "cuda" if gpu else "cpu"
        try:
            resolve_backend(self.copy_backend, device, op="the engine's copy stage")
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(
                f"engine.copy_backend={self.copy_backend!r} cannot run on this machine: {exc}. "
                "Use copy_backend='auto' (picks what is available) or 'torch'"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """This config with keyword overrides on top (``max_in_flight=4``), checked again.

        Raises:
            TypeError: an override names no engine option (with the nearest one).
        """
        base = self.to_dict()
        unknown = sorted(set(overrides) - set(base))
        if unknown:
            near = {k: difflib.get_close_matches(k, base, n=1) for k in unknown}
            hints = "".join(f"; {k!r}: did you mean {m[0]!r}?" for k, m in near.items() if m)
            raise TypeError(f"unknown engine option(s) {unknown}{hints}")
        return EngineConfig(**{**base, **overrides}) if overrides else self
