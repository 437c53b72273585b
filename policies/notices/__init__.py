"""Sources of preemption notices: signals, files, cloud metadata endpoints."""

from pcframe.policies.notices.base import ManualNoticeSource, NoticeSource
from pcframe.policies.notices.file_source import FileNoticeSource
from pcframe.policies.notices.metadata_source import MetadataNoticeSource
from pcframe.policies.notices.signal_source import SignalNoticeSource

__all__ = [
    "FileNoticeSource",
    "ManualNoticeSource",
    "MetadataNoticeSource",
    "NoticeSource",
    "SignalNoticeSource",
]
