"""The opener stage: each version's storage planned and its files created.

The copy thread plans a version (:meth:`VersionOpener.plan`: which tensors are coded, the
raw layout of ``data.bin``; the plan is reused while the captured layout is the same
object) and hands it to the opener thread (:meth:`VersionOpener.open`), which creates the
staging directory, reserves the data file at its full size and chooses delta or full while
the copy already runs: staged chunks need no file, and their writers (and the commit) wait
for the version's ``opened``.
"""

from __future__ import annotations

import time

from pcframe.config import EngineConfig
from pcframe.format.layout import Layout
from pcframe.format.manifest import CODEC_NAME
from pcframe.save.codec import CodecPlan
from pcframe.save.delta import DeltaTracker
from pcframe.save.persist import WrittenFile, choose_stripes, open_data_file
from pcframe.save.status import Stage
from pcframe.save.write import VersionWrite
from pcframe.store.directory import WritableCheckpointDir


class VersionOpener:
    """Plans versions and opens their files, in the order they were saved.

    ``delta_blockers``: who needs every version to be full (replica tiers copy single
    versions, not delta chains); while it is non-empty no delta version is made.
    """

    def __init__(
        self,
        config: EngineConfig,
        storage: WritableCheckpointDir,
        persist: str,
        deltas: DeltaTracker,
    ) -> None:
        self.config, self.storage, self.persist, self.deltas = config, storage, persist, deltas
        self.stripes = choose_stripes(storage.root, config.stripes, config.writer_threads)
        self.delta_blockers: list[str] = []
        self._plan: CodecPlan | None = None  # reused while the layout is the same object
        self._plan_source: Layout | None = None

    def plan(self, write: VersionWrite) -> None:
        """Plan the version's storage (codecs; the plan is reused while the layout is)."""
        layout = write.request.layout
        if self._plan is None or self._plan_source is not layout:
            self._plan = CodecPlan.build(layout, self.config.codecs, self.config.tensor_align)
            self._plan_source = layout
        write.plan = self._plan
        write.checksums = [""] * write.plan.layout.num_chunks

    def open(self, write: VersionWrite) -> None:
        """Create the staging directory and files, choose delta or full; then ``opened``.

        Runs on the opener thread while the copy already runs. Not deferred until the copy
        is done when training waits for it (which would keep the file system off the cores
        the copy uses): then an older version's files could open only after the newer
        copy, its writes would race the newer version's, and a version that loses commits
        discarded. A failure fails the version (the copy stops at its next chunk), never
        the thread; a version that already failed gets no files.
        """
        plan = write.plan
        assert plan is not None
        cpu = time.thread_time()  # kernel time of mkdir and posix_fallocate counts too
        try:
            if write.failed:
                return
            directory = self.storage.staging_path(write.version)
            directory.mkdir()
            layout = plan.layout
            write.data_file = open_data_file(
                directory,
                layout.data_size,
                self.persist,
                self.config.o_direct,
                layout.chunk_bytes,
                max(1, min(self.stripes, layout.num_chunks)),  # no empty stripe files
            )
            write.o_direct = write.data_file.direct
            if plan.segments:
                write.codec_file = WrittenFile(directory / CODEC_NAME, 0)
                # Retention keeps every chain a kept version needs; replica tiers are what
                # cannot take deltas.
                write.delta = self.deltas.begin(write.version, plan, self.delta_blockers)
        except BaseException as exc:
            write.progress.fail(Stage.PERSIST, exc)
        finally:
            write.progress.add_cpu(cpu)
            write.opened.set()
