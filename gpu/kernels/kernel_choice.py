"""Which kernels the model's torch path launches (``--kernels``): ``torch``, its own ops,
or ``triton``, the fused kernels of ``gpu/kernels/triton_ops.py`` (CUDA; Triton's interpreter
runs them on CPU tensors under ``TRITON_INTERPRET=1``, for the tests)."""

from __future__ import annotations

from types import ModuleType

import torch

from wire.worker_options import KERNEL_MODES, refused_combination

__all__ = ["triton_ops"]


def triton_ops(mode: str, device: torch.device) -> ModuleType | None:
    """``gpu.kernels.triton_ops`` when ``mode`` is ``triton``; None for ``torch``. ValueError for
    another mode, or Triton asked for where it cannot run (no Triton, or the CPU without
    its interpreter)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    if mode == "torch":
        return None
    if (refused := refused_combination({"device": device.type, "kernels": mode})) is not None:
        raise ValueError(refused)
    try:
        import gpu.kernels.triton_ops as ops
    except ImportError as exc:
        raise ValueError(f"--kernels triton needs Triton: {exc}") from None
    return ops
