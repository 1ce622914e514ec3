"""Tensor parallelism (``--tp K``): K ranks under ``torch.distributed``."""
