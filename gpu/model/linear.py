"""The decoder's dense linears, and their tensor-parallel forms (nano-vllm's
``layers/linear.py`` and ``embed_head.py``, Megatron's split).

``PackedLinear`` is every fp32 projection. Under ``--tp`` (``gpu/model/shard.py``) a rank's
q/k/v and gate/up rows are column-parallel (a plain ``PackedLinear``, nothing to
communicate), its o and down columns row-parallel (``RowParallelLinear``: a layer's two
all-reduces), its embedding and LM head rows vocabulary-parallel. Collectives go over the
default process group (gloo on the CPU, NCCL on CUDA).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from gpu.kernels.native import SMALL_LINEAR_MAX_ROWS, NativeKernels, load_kernels

__all__ = ["PackedLinear", "RowParallelLinear", "VocabParallelHead", "vocab_parallel_rows"]


class PackedLinear:
    """``F.linear(x, weight)`` without bias, through the fastest path for the row count.

    On CPU in fp32: at one or two rows (decode at batch 1-2) the C kernel of
    ``gpu/kernels/native.py`` over a row-interleaved copy of the weight (a pass over the weights
    at memory speed: the 30 layers and the LM head at one row in 17-22 ms against 33-39
    ms through oneDNN); above that oneDNN with the weight reordered once at construction
    (the 30 layers' four projections plus the LM head at 32 rows cost 114-117 ms against
    184-188 ms with ``F.linear``, which spends ~25 % of it copying weights into MKL's
    panel format; 1.46 vs 2.06 s at 512 rows). Elsewhere (CUDA, half precision, no
    oneDNN) it is plain ``F.linear``. The packed and interleaved copies are extra
    tensors: the plain weight stays the model's parameter.
    """

    __slots__ = ("interleaved", "kernels", "packed", "weight")

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight
        self.packed: Tensor | None = None
        self.interleaved: Tensor | None = None
        self.kernels: NativeKernels | None = None
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            if torch.backends.mkldnn.is_available():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            if weight.shape[0] % 8 == 0 and (kernels := load_kernels()) is not None:
                self.kernels = kernels
                self.interleaved = kernels.interleave(weight)

    def __call__(self, x: Tensor) -> Tensor:
        if self.interleaved is not None and self.kernels is not None:
            if x.dim() == 2 and x.shape[0] <= SMALL_LINEAR_MAX_ROWS:
                return self.kernels.small_linear(x, self.interleaved)
        if self.packed is None:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class RowParallelLinear(PackedLinear):
    """A row-parallel projection (o, down): this rank's share of the inner dimension
    multiplied, the partial products summed over the ranks."""

    __slots__ = ()

    def __call__(self, x: Tensor) -> Tensor:
        out = super().__call__(x)
        dist.all_reduce(out)
        return out


class VocabParallelHead(PackedLinear):
    """The LM head over this rank's vocabulary rows (every rank's padded to the same
    count): the whole logits ``[K, vocab]`` gathered on rank 0, the only rank that
    samples; another rank returns its own slice, which nobody reads."""

    __slots__ = ("rank", "vocab_size", "world")

    def __init__(self, weight: Tensor, rank: int, world: int, vocab_size: int) -> None:
        super().__init__(weight)
        self.rank, self.world, self.vocab_size = rank, world, vocab_size

    def __call__(self, x: Tensor) -> Tensor:
        part = super().__call__(x).contiguous()
        if self.rank != 0:
            dist.gather(part, None, dst=0)
            return part
        parts = [torch.empty_like(part) for _ in range(self.world)]
        dist.gather(part, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def vocab_parallel_rows(table: Tensor, ids: Tensor, vocab: range) -> Tensor:
    """Rows of the whole embedding from this rank's rows ``table`` of ``vocab``: its
    range looked up, zeros elsewhere, summed over the ranks (exact: every row has a
    single non-zero term)."""
    local = ids - vocab.start
    mine = (local >= 0) & (local < len(vocab))
    x = F.embedding(local.clamp(0, len(vocab) - 1), table)
    x = x * mine.unsqueeze(1).to(x.dtype)
    dist.all_reduce(x)
    return x
