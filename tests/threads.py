"""A block of torch (and the native kernels, which read ``torch.get_num_threads()``) on a
given number of threads.

``make test`` runs every test process with ``OMP_NUM_THREADS=1`` (the Makefile says
why); the checks that a kernel's bits do not depend on its thread count take two
threads here explicitly, so they hold their meaning whatever the environment sets.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["torch_threads"]


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
