"""Real spot traces in one normalised schema (:class:`Trace`), from any supported file."""

from pcframe.policies.errors import TraceFormatError
from pcframe.policies.traces.loader import (
    ENV_VAR,
    FORMATS,
    detect_format,
    is_trace_file,
    load_trace,
    load_traces,
    shared_traces_dir,
    trace_files,
)
from pcframe.policies.traces.schema import FORMAT_TAG, Trace, TraceStats

__all__ = [
    "ENV_VAR",
    "FORMATS",
    "FORMAT_TAG",
    "Trace",
    "TraceFormatError",
    "TraceStats",
    "detect_format",
    "is_trace_file",
    "load_trace",
    "load_traces",
    "shared_traces_dir",
    "trace_files",
]
