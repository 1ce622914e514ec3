"""What the CPU default weights are in this process, for tests that name them.

``--weights auto`` on the CPU is the GGUF's quantized blocks read by the native kernels,
and dense fp32 where those kernels are off (``LIFECYCLE_NATIVE=0``) or cannot be built:
the suite passes both ways (docs/determinism.md).
"""

from __future__ import annotations

import pytest

from gpu.kernels import native

__all__ = ["cpu_default_weights", "needs_native"]


def cpu_default_weights() -> str:
    """The weights mode a CPU worker reports for ``--weights auto``."""
    return "quantized" if native.load_kernels() is not None else "dense"


def needs_native(why: str) -> pytest.MarkDecorator:
    """Skip where the native kernels are off: ``why`` says what rests on them."""
    return pytest.mark.skipif(native.load_kernels() is None, reason=why)
