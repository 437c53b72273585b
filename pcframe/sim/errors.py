"""The one exception type of the simulator: bad input, with the key or file and the fix."""

from __future__ import annotations


class SimConfigError(ValueError):
    """A simulator parameter or trace that cannot be simulated.

    The message names the offending key (``job.save_stall``) or file and says how to fix it.
    """
