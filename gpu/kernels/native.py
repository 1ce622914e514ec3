"""Small C kernels for the CPU path, compiled on first use with the system C compiler.

Only what torch cannot do well with its own ops lives here: decode attention read
straight from the paged KV cache (``gpu/kernels/csrc/paged_attention.c``), linear layers
at one or two rows from a row-interleaved weight copy (``gpu/kernels/csrc/small_linear.c``),
grammar masks applied to logits in place (``gpu/kernels/csrc/token_mask.c``), linear
layers straight from GGUF quantized blocks (``gpu/kernels/csrc/quant_linear.c``), and a
step's decoder layers in one call over those (``gpu/kernels/csrc/fused_trunk.c``,
``gpu/backends/fused.py``). The library is built once per source, compiler and flag set
into the kernel cache (``gpu/kernels/native_build.py``) and loaded with ctypes; the build
takes about a second. No compiler, a failed build, or ``LIFECYCLE_NATIVE=0`` leaves the
torch path in place (same results to rounding, slower at long contexts), with one log line
saying why.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from torch import Tensor

from gpu.kernels.arena import Arena, TorchArena
from gpu.kernels.kv_element import KV_Q4, KV_Q8, KVElement, kv_element
from gpu.kernels.native_build import ISAS, build, kernel_cache_dir, native_enabled

__all__ = [
    "QL_PARTS",
    "QP_FLAG",
    "QP_ROWS",
    "QParts",
    "QUANT_TYPES",
    "quant_row_bytes",
    "SMALL_LINEAR_MAX_ROWS",
    "NativeKernels",
    "load_kernels",
    "load_kernels_built_for",
]

log = logging.getLogger("gpu.kernels.native")

SMALL_LINEAR_MAX_ROWS = 2  # above this oneDNN's packed GEMM is as fast or faster
# The GGML types ``q_linear`` reads in place (codes): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
# Q5_K, Q6_K. Their block sizes are gguf's (GGML_QUANT_SIZES).
QUANT_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})


# q_linear's qtype for a weight in parts of different types (``QParts``).
QL_PARTS = -1
# q_linear's qtype bit for a weight packed into panels by ``q_pack`` (its type's code
# or'ed with it), and the rows of a panel.
QP_FLAG = 0x100
QP_ROWS = 16
QL_MAX_PARTS = 4


class QParts(ctypes.Structure):
    """``q_parts`` in quant_linear.c: up to four weights of their own types stacked
    row-wise (their outputs side by side)."""

    _fields_ = [
        ("n", ctypes.c_int32),
        ("qtype", ctypes.c_int32 * QL_MAX_PARTS),
        ("rows", ctypes.c_int64 * QL_MAX_PARTS),
        ("w", ctypes.c_void_p * QL_MAX_PARTS),
    ]


def quant_row_bytes(qtype: int, k: int) -> int | None:
    """Bytes of one row of ``k`` weights of GGML type ``qtype``; None when ``qtype`` is not
    a kernel type or ``k`` is not a whole number of its blocks."""
    if qtype not in QUANT_TYPES:
        return None
    elems, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return None if k % elems else k // elems * size


_lock = threading.Lock()
_loaded: dict[str, NativeKernels | None] = {}


class NativeKernels:
    """The loaded library, with typed entry points."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, rc = ctypes.c_void_p, ctypes.c_int
        i32, i64, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float

        def bind(name: str, restype: Any, *argtypes: Any) -> Any:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), restype
            return fn

        self._attention = bind("paged_attention", rc, p, i64, p, p, i32, p, p, p, i32, i32, i32,
                               i32, i64, i32, i32, f32, i32, f32, i32)  # fmt: skip
        self._small_linear = bind("small_linear", None, p, p, p, i32, i64, i64, i32)
        self._token_mask = bind("apply_token_bitmask", None, p, i64, p, p, i32, i32, i32, p)
        self._q_linear = bind("q_linear", rc, p, p, p, i32, i32, i64, i64, i32)
        self._q_linear_reference = bind("q_linear_reference", rc, p, p, p, i32, i32, i64, i64)
        self._q_dequantize = bind("q_dequantize", rc, p, p, i32, i64, i64)
        self._q_pack = bind("q_pack", rc, p, p, i32, i64, i64, i32)
        self._q_packed_bytes = bind("q_packed_bytes", i64, i32, i64, i64)
        self._q_packed_rows = bind("q_packed_rows", rc, p, p, i64, p, i32, i64, i64)
        # whether this build packs weights (q_pack; the portable build does not)
        self.packs = self._q_packed_bytes(3, QP_ROWS, 32) > 0
        # gpu/backends/fused.py builds its arguments
        self.trunk_layers = bind("trunk_layers", rc, p, i32, p, p, i32, i32, i32, i32, i32, i32,
                                 f32, p, p, p, i32, i64, i32, i32, f32, i32, f32, i32)  # fmt: skip
        self._softcap = bind("softcap_rows", None, p, i64, f32)
        self._rms_norm = bind("rms_norm_rows", None, p, p, p, i32, i32, f32)
        self._kv_q8_quantize = bind("kv_q8_quantize", None, p, p, i64)
        self._kv_q4_quantize = bind("kv_q4_quantize", None, p, p, i64)
        self._kv_rotate = bind("kv_rotate", None, p, i64, i32, f32)
        self._kv_store_rows = bind("kv_store_rows", rc, p, p, i32, i64, i32)
        self._kv_load_rows = bind("kv_load_rows", rc, p, p, i32, i64, i32)

    def q_linear(self, x: Tensor, w: Tensor, qtype: int) -> Tensor:
        """``x [M, K] fp32 @ w^T`` with ``w`` a GGUF tensor's blocks, uint8 ``[N,
        quant_row_bytes(qtype, K)]``; ``qtype`` a GGML type code of ``QUANT_TYPES``. x is
        rounded to int8 per block of 32 first (llama.cpp's way): close to, not equal to,
        ``F.linear`` on the dequantized weight."""
        return self._q_call(self._q_linear, "q_linear", x, w, qtype, torch.get_num_threads())

    def q_linear_reference(self, x: Tensor, w: Tensor, qtype: int) -> Tensor:
        """``q_linear``'s function as quant_linear.c's header defines it, computed output
        by output on one thread: what the tests hold the kernel's paths to."""
        return self._q_call(self._q_linear_reference, "q_linear_reference", x, w, qtype)

    @staticmethod
    def _q_call(fn: Any, name: str, x: Tensor, w: Tensor, qtype: int, *threads: int) -> Tensor:
        x = _fp32_rows(x)
        m, k = x.shape
        _check_blocks(w, qtype, k)
        y = torch.empty((m, w.shape[0]), dtype=torch.float32)
        if fn(x.data_ptr(), w.data_ptr(), y.data_ptr(), qtype, m, w.shape[0], k, *threads) != 0:
            raise MemoryError(f"{name}: scratch allocation failed")
        return y

    def q_pack(self, w: Tensor, qtype: int, k: int, arena: Arena | None = None) -> Tensor | None:
        """``w``'s rows (blocks as ``q_linear`` takes them) packed into panels of
        ``QP_ROWS`` (quant_linear.c, ``q_pack``: the same bytes, give or take, laid out
        for the decode path): uint8 ``[panels, bytes]``, carved from ``arena`` (a model's
        ``WeightArena``; default ``torch.empty``). None where this build does not pack
        (no AVX2)."""
        _check_blocks(w, qtype, k)
        n = w.shape[0]
        size = self._q_packed_bytes(qtype, n, k)
        if size == 0:
            return None
        panels = -(-n // QP_ROWS)
        out = (arena or TorchArena()).empty((panels, size // panels))
        rc = self._q_pack(w.data_ptr(), out.data_ptr(), qtype, n, k, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("q_pack: allocation failed") if rc == -1 else ValueError(rc)
        return out

    def q_linear_packed(self, x: Tensor, wp: Tensor, qtype: int, n: int) -> Tensor:
        """``q_linear`` (the same function, bit for bit) for ``n`` rows packed by
        ``q_pack``."""
        x = _fp32_rows(x)
        m, k = x.shape
        self._check_packed(wp, qtype, n, k)
        y = torch.empty((m, n), dtype=torch.float32)
        rc = self._q_linear(x.data_ptr(), wp.data_ptr(), y.data_ptr(), qtype | QP_FLAG, m, n, k,
                            torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise MemoryError("q_linear: scratch allocation failed")
        return y

    def q_packed_rows(self, wp: Tensor, ids: Tensor, qtype: int, n: int, k: int) -> Tensor:
        """Rows ``ids`` of ``n`` packed rows of ``k`` as fp32 ``[len(ids), k]``: what
        ``q_dequantize`` gives for the same rows of the file's blocks."""
        self._check_packed(wp, qtype, n, k)
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), k), dtype=torch.float32)
        rc = self._q_packed_rows(wp.data_ptr(), ids.data_ptr(), ids.numel(), out.data_ptr(),
                                 qtype, n, k)  # fmt: skip
        if rc != 0:
            raise IndexError(f"row ids outside 0 .. {n - 1}")
        return out

    def _check_packed(self, wp: Tensor, qtype: int, n: int, k: int) -> None:
        size = self._q_packed_bytes(qtype, n, k) if qtype in QUANT_TYPES else 0
        if size == 0 or wp.dtype != torch.uint8 or wp.numel() != size:
            raise ValueError(f"{tuple(wp.shape)} {wp.dtype} is not {n} packed rows of {k}")
        if not wp.is_contiguous() or wp.device.type != "cpu":
            raise ValueError("packed weights must be a contiguous CPU tensor")

    def q_linear_parts(self, x: Tensor, parts: QParts, n: int) -> Tensor:
        """``q_linear`` over a weight in parts (``QParts``, checked by its maker: each
        part's blocks hold rows of ``x.shape[1]``; rows add up to ``n``)."""
        x = _fp32_rows(x)
        y = torch.empty((x.shape[0], n), dtype=torch.float32)
        rc = self._q_linear(
            x.data_ptr(), ctypes.addressof(parts), y.data_ptr(), QL_PARTS, x.shape[0], n,
            x.shape[1], torch.get_num_threads(),
        )  # fmt: skip
        if rc == -2:
            raise ValueError(f"q_linear refused the parts for rows of {x.shape[1]}")
        if rc != 0:
            raise MemoryError("q_linear: scratch allocation failed")
        return y

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight`` per row of fp32 ``x [M, N]``, the
        fused trunk's norm: each row one function of itself (fixed_order.h)."""
        if x.dtype != torch.float32 or x.dim() != 2 or weight.dtype != torch.float32:
            raise ValueError(f"rms_norm takes fp32 [M, N] rows, not {x.dtype} {tuple(x.shape)}")
        x, weight = x.contiguous(), weight.contiguous()
        if weight.shape != (x.shape[1],):
            raise ValueError(f"norm weight {tuple(weight.shape)} for rows of {x.shape[1]}")
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def q_dequantize(self, w: Tensor, qtype: int, k: int) -> Tensor:
        """The fp32 ``[N, K]`` that ``q_linear`` multiplies by (what tests compare)."""
        _check_blocks(w, qtype, k)
        out = torch.empty((w.shape[0], k), dtype=torch.float32)
        if self._q_dequantize(w.data_ptr(), out.data_ptr(), qtype, w.shape[0], k) != 0:
            raise MemoryError("q_dequantize: scratch allocation failed")
        return out

    def apply_token_bitmask(self, logits: Tensor, rows: Tensor, bitmask: Tensor) -> Tensor:
        """Ban, in place, what ``bitmask`` [R, W] int32 does not allow in ``logits``' rows
        ``rows`` (int64 [R]); ``logits`` fp32 with unit stride along the vocabulary.
        Returns alive (int32 [R]): 1 where a row kept a logit above -inf."""
        assert logits.dtype == torch.float32 and logits.stride(1) == 1
        bitmask = bitmask.contiguous()
        alive = torch.empty(rows.shape[0], dtype=torch.int32)
        self._token_mask(
            logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), rows.data_ptr(),
            rows.shape[0], bitmask.shape[1], logits.shape[1], alive.data_ptr(),
        )  # fmt: skip
        return alive

    @staticmethod
    def interleave(weight: Tensor) -> Tensor:
        """``[N, K]`` -> ``[N/8, K, 8]``: the layout ``small_linear`` reads (N % 8 == 0)."""
        n, k = weight.shape
        return weight.detach().view(n // 8, 8, k).transpose(1, 2).contiguous()

    def small_linear(self, x: Tensor, w8: Tensor) -> Tensor:
        """``x [M, K] @ w^T`` for M <= a few rows, ``w8`` from ``interleave``."""
        x = x.contiguous()
        m, k = x.shape
        n = w8.shape[0] * 8
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        self._small_linear(
            x.data_ptr(), w8.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads()
        )
        return y

    def paged_attention(self, q: Tensor, kc: Tensor, vc: Tensor, tables: Tensor, lens: Tensor,
                        block_size: int, scale: float, window: int = 0, softcap: float = 0.0,
                        element: KVElement | None = None) -> Tensor:  # fmt: skip
        """Decode attention from the paged cache (``gpu/kernels/csrc/paged_attention.c``): ``q [D,
        H, HD]`` fp32 (rows may be strided), ``kc``/``vc [KV, ROWS, HD]`` contiguous, both
        fp32 or both fp16, or, with ``element`` ``KV_Q8``, q8_0 rows (uint8 ``[KV, ROWS, HD
        / 32 * 34]``) or, with ``KV_Q4``, q4_0 rows (``[KV, ROWS, HD / 32 * 18]``), both as
        ``kv_store`` writes them (rotated: each query is rotated the same way and each
        output back), ``tables [D, MAXNB]`` and ``lens [D]`` int32;
        returns ``[D, H, HD]``. Over the last ``window`` keys of each sequence (0: all),
        its scores capped at ``softcap`` (0: not). ``element``: what the rows hold (None:
        their dtype's; uint8 rows, q8_0's or q4_0's, must be named: ``ValueError``)."""
        d, h, hd = q.shape
        kv, rows, width = kc.shape
        elem = element
        if elem is None:
            try:
                elem = kv_element(kc.dtype)
            except ValueError as exc:  # uint8 rows, q8_0's or q4_0's, unnamed
                raise ValueError(f"paged_attention: {exc} (element=)") from None
            except KeyError:
                pass  # a dtype no cache holds: refused below
        if kc.dtype != vc.dtype or elem is None or elem.kind is None or elem.dtype != kc.dtype:
            raise ValueError(f"paged_attention reads an fp16, fp32, q8_0 or q4_0 cache, not "
                             f"{kc.dtype} / {vc.dtype} as {elem}")  # fmt: skip
        kind = elem.kind
        if width != elem.row_width(hd):
            raise ValueError(f"cache rows of {width} {kc.dtype} do not hold head_dim {hd} "
                             f"of {elem.name}")  # fmt: skip
        if q.stride(2) != 1 or q.stride(1) != hd:
            q = q.contiguous()
        out = torch.empty((d, h, hd), dtype=q.dtype, device=q.device)
        rc = self._attention(
            q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), kind,
            tables.data_ptr(), lens.data_ptr(), out.data_ptr(), d, h, kv, hd, rows, block_size,
            tables.shape[1], scale, window, softcap, torch.get_num_threads(),
        )  # fmt: skip
        if rc == -2:
            raise ValueError(f"paged_attention does not take {elem.name} at head_dim {hd}")
        if rc != 0:
            raise MemoryError("paged_attention: scratch allocation failed")
        return out

    def kv_q8_quantize(self, x: Tensor) -> Tensor:
        """Rows of fp32 ``x [..., N]`` (N a multiple of 32) as the q8_0 cache stores them:
        uint8 ``[..., N / 32 * 34]``, the kernel's own quantizer (paged_attention.c,
        llama.cpp's ``quantize_row_q8_0_ref``)."""
        return self._kv_quantize(x, KV_Q8, self._kv_q8_quantize)

    def kv_q4_quantize(self, x: Tensor) -> Tensor:
        """Rows of fp32 ``x [..., N]`` (N a multiple of 32) as the q4_0 cache stores them:
        uint8 ``[..., N / 32 * 18]``, the kernel's own quantizer (paged_attention.c,
        llama.cpp's ``quantize_row_q4_0_ref``)."""
        return self._kv_quantize(x, KV_Q4, self._kv_q4_quantize)

    def kv_store(self, x: Tensor, elem: KVElement) -> Tensor:
        """Rows of fp32 ``x [..., HD]`` (HD a multiple of 32, at most 512) as a cache of
        ``elem`` (``KV_Q8`` or ``KV_Q4``) stores them: uint8 ``[..., elem.row_width(HD)]``,
        each row rotated (``kv_rotate``) and then quantized by llama.cpp's rule
        (``kv_q8_quantize`` / ``kv_q4_quantize``): paged_attention.c's ``kv_store_rows``,
        the one writer of those caches."""
        if not elem.blocked or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"kv_store writes fp32 CPU rows as q8_0 or q4_0, not {x.dtype} "
                             f"as {elem.name}")  # fmt: skip
        x = x.contiguous()
        hd = x.shape[-1]
        out = torch.empty((*x.shape[:-1], elem.row_width(hd)), dtype=torch.uint8)
        if self._kv_store_rows(x.data_ptr(), out.data_ptr(), elem.kind, x.numel() // hd, hd):
            raise ValueError(f"kv_store takes head_dim a multiple of 32 up to 512, not {hd}")
        return out

    def kv_values(self, b: Tensor, elem: KVElement, head_dim: int) -> Tensor:
        """The fp32 values ``[..., head_dim]`` that rows of a q8_0 or q4_0 cache ``b
        [..., elem.row_width(head_dim)]`` stand for: the blocks read back exactly, then
        rotated back (paged_attention.c's ``kv_load_rows``)."""
        if not elem.blocked or b.dtype != torch.uint8 or b.shape[-1] != elem.row_width(head_dim):
            raise ValueError(f"kv_values reads {elem.name} rows of head_dim {head_dim}, not "
                             f"{b.dtype} {tuple(b.shape)}")  # fmt: skip
        b = b.contiguous()
        out = torch.empty((*b.shape[:-1], head_dim), dtype=torch.float32)
        rows = b.numel() // b.shape[-1] if b.numel() else 0
        if self._kv_load_rows(b.data_ptr(), out.data_ptr(), elem.kind, rows, head_dim):
            raise ValueError(f"kv_values takes head_dim a multiple of 32 up to 512, not {head_dim}")
        return out

    def kv_rotate(self, x: Tensor, scale: float = 1.0) -> Tensor:
        """``x [..., HD]`` fp32 (HD a multiple of 32) rotated in place and returned: each
        group of G values (G the largest power of two dividing HD) times the Walsh-Hadamard
        matrix of order G (+-1 entries), then ``scale``; ``scale`` 1 / G rotates back."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"kv_rotate takes contiguous fp32 CPU rows, not {x.dtype}")
        hd = x.shape[-1]
        if hd % 32:
            raise ValueError(f"kv_rotate takes rows of a multiple of 32 values, not {hd}")
        self._kv_rotate(x.data_ptr(), x.numel() // hd, hd, scale)
        return x

    @staticmethod
    def _kv_quantize(x: Tensor, elem: KVElement, fn: Any) -> Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] % elem.block:
            raise ValueError(f"kv_{elem.name[:2]}_quantize takes fp32 CPU rows of 32k values, "
                             f"not {x.dtype} {tuple(x.shape)}")  # fmt: skip
        x = x.contiguous()
        out = torch.empty((*x.shape[:-1], elem.row_width(x.shape[-1])), dtype=torch.uint8)
        fn(x.data_ptr(), out.data_ptr(), x.numel() // elem.block)
        return out

    def softcap(self, x: Tensor, cap: float) -> Tensor:
        """``cap * tanh(x / cap)`` in place on contiguous fp32 ``x`` (returned), the same
        bits on every build (fixed_order.h)."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"softcap takes contiguous fp32 CPU values, not {x.dtype}")
        self._softcap(x.data_ptr(), x.numel(), cap)
        return x


def _fp32_rows(x: Tensor) -> Tensor:
    """``x`` as the quantized linear takes it: fp32 ``[M, K]``, contiguous."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"q_linear takes fp32 [M, K] rows, not {x.dtype} {tuple(x.shape)}")
    return x.contiguous()


def _check_blocks(w: Tensor, qtype: int, k: int) -> None:
    if qtype not in QUANT_TYPES:
        raise ValueError(f"q_linear takes GGML types {sorted(QUANT_TYPES)}, not {qtype}")
    row = quant_row_bytes(qtype, k)
    if row is None or k % 32 or w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != row:
        raise ValueError(f"blocks {tuple(w.shape)} {w.dtype} do not hold rows of {k} weights")
    if not w.is_contiguous() or w.device.type != "cpu":
        raise ValueError("blocks must be a contiguous CPU tensor")


def load_kernels_built_for(isa: str) -> NativeKernels:
    """A separate build of the kernels for ``isa`` (one of ``ISAS``), loaded beside the
    process's own: what tests compare the default build with. Raises when it cannot be
    built."""
    if isa not in ISAS:
        raise ValueError(f"isa {isa!r}: expected one of {', '.join(ISAS)}")
    with _lock:
        return NativeKernels(build(kernel_cache_dir(), isa))


def load_kernels() -> NativeKernels | None:
    """The kernels, built if needed; None (logged once) when disabled or unavailable."""
    if not native_enabled():
        return None
    cache = kernel_cache_dir()
    with _lock:
        if str(cache) in _loaded:
            return _loaded[str(cache)]
        kernels: NativeKernels | None = None
        try:
            kernels = NativeKernels(build(cache))
            log.info("native CPU kernels loaded from %s", kernels.path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("native CPU kernels unavailable, using the torch path: %s", exc)
        _loaded[str(cache)] = kernels
        return kernels
