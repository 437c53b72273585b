"""What the engine needs from the Python runtime: its threads (single-threaded torch, one
engine call at a time), signal and interrupt handling, the garbage collector's pauses, and
the crash points the fault tests kill at."""
