"""Copy, checksum and compression kernels (``pcframe.kernels``): Triton, Numba and torch."""
