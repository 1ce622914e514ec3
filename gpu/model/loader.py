"""Load a model: one open of a GGUF file or a Hugging Face folder (``modelfile.source``)
yields config, tokenizer, chat template and weights.

Weights (``load_model(weights=...)``): ``"fp32"`` dequantizes every tensor to the device
dtype (what CUDA and ``--tp`` use). ``"quantized"`` keeps each projection, the embedding
and an untied LM head as GGUF blocks the native kernels read (``gpu/model/quant.py``): in
place where the file stores Q4_1 or Q8_0 (q/k rows un-permuted and fused tensors joined
row-wise, both on whole rows of blocks), requantized to Q8_0 otherwise. ``"auto"`` (the
default) is ``"quantized"`` for the tensors the file stores quantized when the device is
the CPU in fp32 and the native kernels load, ``"fp32"`` otherwise; tensors the file
stores as floats (F32, F16, BF16) stay dense then: a folder's matrices all, since its
weights are floats. ``"q8_0"`` and ``"q4_0"`` quantize every matrix to that type at load
on the CPU (``requantize``; what the file already stores in that type is read as is).
"""

from __future__ import annotations

import itertools
import logging
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import psutil
import torch
from gguf import GGMLQuantizationType as Q

from gpu.kernels.arena import weight_arena
from gpu.kernels.cpu_runtime import trim_heap
from gpu.kernels.native import load_kernels
from gpu.model.decoder import Llama, LlamaWeights
from gpu.model.quant import KERNEL_TYPES, QuantWeight, requantize
from gpu.model.rope import unpermute_rope_rows
from gpu.model.shard import ShardPlan, ShardSource, shard_plan
from modelfile.chat import ChatTemplate
from modelfile.check import check_tensors
from modelfile.config import ModelConfig, with_context
from modelfile.gguf_file import ModelFileError
from modelfile.source import ModelSource, model_parts, open_model
from modelfile.tokenizer import Tokenizer
from wire.worker_options import DTYPES, WEIGHT_MODES

__all__ = ["LoadedModel", "load_model", "resolve_device"]

_AT_LOAD = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0}  # --weights that quantize every matrix
_FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.F64})

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    model: Llama
    tokenizer: Tokenizer
    chat: ChatTemplate | None
    path: pathlib.Path
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """None -> CUDA if available else CPU; dtype None -> bf16 on CUDA, fp32 on CPU.

    fp32 on CPU because half-precision matmuls there are 50-200x slower (no AVX512-BF16).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return dev, getattr(torch, DTYPES[dtype])


def load_model(
    path: str | pathlib.Path | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    weights: str = "auto",
    context_length: int | None = None,
    rank: int = 0,
    world: int = 1,
) -> LoadedModel:
    """``context_length``: the tokens to serve (``modelfile.config.with_context``; None:
    the model's own); the RoPE tables are made for that many positions. ``world`` > 1:
    tensor-parallel rank ``rank``'s shard (``gpu/model/shard.py``), its slices only
    (fp32 weights), the decoder built with its parallel linears and its config (its
    own heads and MLP width) the loaded one."""
    dev, dt = resolve_device(device, dtype)
    t0 = time.perf_counter()
    f = open_model(path)
    t_open = time.perf_counter()
    tokenizer, chat, config = model_parts(f)
    config = with_context(config, context_length, str(f.path))
    check_tensors(f, config)  # every problem of the file before a weight is read
    t_vocab = time.perf_counter()
    quant = _quant_mode(weights, dev, dt)
    plan = None
    if world > 1:
        if quant is not None:
            raise ValueError("tensor-parallel shards are read as fp32 weights")
        plan = shard_plan(config, world, rank)
    with torch.inference_mode():
        model = _Reader(f, config, dev, dt, quant, plan, _AT_LOAD.get(weights)).build()
    model.eval()
    if dev.type == "cpu":
        trim_heap()  # the file's blocks read, copied and packed: their heap pages back
    t_end = time.perf_counter()
    log.info(
        "loaded %s (%s) on %s/%s, %s weights (%.0f MiB), in %.2fs (open %.2fs, tokenizer %.2fs, "
        "weights %.2fs); rss %.0f MiB",
        f.path.name,
        config.name,
        dev,
        str(dt).removeprefix("torch."),
        "quantized" if model.quantized() else "dense",
        model.weight_bytes() / 2**20,
        t_end - t0,
        t_open - t0,
        t_vocab - t_open,
        t_end - t_vocab,
        psutil.Process().memory_info().rss / 2**20,
    )
    return LoadedModel(model.config, model, tokenizer, chat, f.path, dev, dt)


def _quant_mode(weights: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """None (dense), "file" (quantize what the file stores quantized) or "all"."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"unknown weights {weights!r} (choose from {', '.join(WEIGHT_MODES)})")
    if weights == "fp32":
        return None
    usable = device.type == "cpu" and dtype == torch.float32
    if weights == "quantized" or weights in _AT_LOAD:
        if not usable:
            raise ValueError("quantized weights run on the CPU in float32 only")
        if load_kernels() is None:
            raise ValueError("quantized weights need the native CPU kernels (LIFECYCLE_NATIVE=0?)")
        return "all" if weights == "quantized" else "file"  # at load: every matrix
    return "file" if usable and load_kernels() is not None else None


# One tensor of a joined matrix or vector: (GGUF name, shape, heads to un-permute or None).
_Part = tuple[str, tuple[int, ...], int | None]


class _Reader:
    """Builds the model from a file's tensors: dense (dequantized, placed on the device in
    the dtype) or kept as blocks (``quant``), q/k rows un-permuted, the progress line
    kept, and what had to be requantized counted for one warning. ``retype``
    (``--weights q8_0|q4_0``): every matrix read as blocks of that type. ``plan``: a
    tensor-parallel rank's, whose tensors are read as its slices (``ShardSource``: the
    vocabulary ones padded to ``vocab_rows``), its decoder's config its own heads and MLP."""

    def __init__(self, f: ModelSource, config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, quant: str | None, plan: ShardPlan | None = None,
                 retype: Q | None = None) -> None:  # fmt: skip
        self.local = config if plan is None else plan.local_config(config)
        c = self.local if plan is None else replace(self.local, vocab_size=plan.vocab_rows)
        self.f = f if plan is None else ShardSource(f, config, plan)
        self.c, self.device, self.dtype, self.plan = c, device, dtype, plan
        self.progress, self.quant, self.retype = _progress_printer(f.path.name), quant, retype
        self.sizes = f.stored_bytes()  # what each tensor takes in the file
        self.total, self.done = sum(self.sizes.values()), 0
        # type name -> (tensors, bytes in the file, bytes as Q8_0) the kernels cannot read
        self.requantized: dict[str, tuple[int, int, int]] = {}
        self.arena = weight_arena()  # the packed weights' memory, in the order they are read
        self.q_rows, self.kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        # a llama file's q/k rows (and biases) are permuted for llama.cpp's RoPE: undone
        self.q_perm: int | None = c.n_heads if c.rope_permuted else None
        self.k_perm: int | None = c.n_kv_heads if c.rope_permuted else None

    def _read(self, name: str, shape: tuple[int, ...]) -> None:
        got = self.f.tensor_shape(name)
        if got != shape:
            raise ModelFileError(self.f.path, f"tensor {name!r} has shape {got}, expected {shape}")
        self.done += self.sizes.get(name, 0)
        self.progress(self.done, self.total)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor dequantized to fp32, on the CPU."""
        self._read(name, shape)
        arr = self.f.dequantize(name)
        # F32 tensors come back as read-only views of the mmap: copy those, not the rest.
        arr = arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr, order="C")
        return torch.from_numpy(arr)

    def raw_blocks(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor's blocks as stored, uint8 ``[rows, bytes per row]`` (copied out); with
        ``retype``, one stored in another type quantized here from its floats
        (``requantize``: gguf-py's reference quantizer, what llama-quantize computes for
        the legacy types)."""
        self._read(name, shape)
        if self.retype is None or self.f.tensor_type(name) == self.retype:
            return torch.from_numpy(np.array(self.f.blocks(name)))
        w = np.require(self.f.dequantize(name), np.float32, ["C", "W"])  # a copy of a view
        return requantize(torch.from_numpy(w), self.retype).blocks

    def place(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def vector(self, name: str, n: int) -> torch.Tensor:
        """A 1-D tensor of ``n`` (a norm weight), placed."""
        return self.place(self.get(name, (n,)))

    def joined(
        self, parts: list[_Part], read: Callable[[str, tuple[int, ...]], torch.Tensor]
    ) -> torch.Tensor:
        """Each part read (dense rows or their blocks), q/k rows un-permuted (whole rows:
        the permutation commutes with row-wise quantization), joined row-wise."""
        ts = [read(n, s) if h is None else unpermute_rope_rows(read(n, s), h) for n, s, h in parts]
        return torch.cat(ts) if len(ts) > 1 else ts[0]

    def matrix(self, parts: list[_Part]) -> torch.Tensor | QuantWeight | list[QuantWeight]:
        """Tensors ``parts`` joined row-wise: dense, or quantized blocks when ``quant``
        says so (module docstring): one ``QuantWeight``, or one per run of parts of the
        same type when the file stores them in different types (read in place all the
        same)."""
        types = [self.retype or self.f.tensor_type(name) for name, _, _ in parts]
        k, quant = parts[0][1][1], self.quant
        if quant is None or k % 32 or (quant == "file" and set(types) & _FLOAT_TYPES):
            return self.place(self.joined(parts, self.get))
        if all(t in KERNEL_TYPES for t in types):
            groups = itertools.groupby(zip(parts, types, strict=True), key=lambda p: p[1])
            runs = [self.packed(QuantWeight(self.joined([p for p, _ in group], self.raw_blocks), qtype, k))
                    for qtype, group in groups]  # fmt: skip
            return runs[0] if len(runs) == 1 else runs
        w = self.packed(requantize(self.joined(parts, self.get)))
        kinds = sorted({t.name for t in types if t not in _FLOAT_TYPES})
        if kinds:  # floats quantized on request are no loss to report
            key = "+".join(kinds)
            n, was, now = self.requantized.get(key, (0, 0, 0))
            was += sum(self.sizes.get(name, 0) for name, _, _ in parts)
            self.requantized[key] = (n + len(parts), was, now + w.blocks.numel())
        return w

    def packed(self, w: QuantWeight) -> QuantWeight:
        """``w`` as the kernels read it fastest: packed into panels where their build packs
        (``QuantWeight.packed``; quantized weights exist only where the kernels load),
        carved from this load's arena right after the matrix packed before it, so the
        layers lie in memory in the order a step reads them (``gpu/kernels/arena.py``)."""
        kernels = load_kernels()
        assert kernels is not None
        return w.packed(kernels, self.arena)

    def single(self, name: str, shape: tuple[int, int]) -> torch.Tensor | QuantWeight:
        w = self.matrix([(name, shape, None)])
        assert not isinstance(w, list)  # one tensor is one run
        return w

    def layer(self, i: int) -> LlamaWeights:
        """Decoder layer ``i``'s weights: what the configuration says the file holds."""
        c, p = self.c, f"blk.{i}."
        q_rows, kv_rows = self.q_rows, self.kv_rows
        # q/k norms per head, or over the whole projection's rows (OLMo 2)
        q_norm, k_norm = (q_rows, kv_rows) if c.qk_norm_whole else (c.head_dim, c.head_dim)
        return LlamaWeights(
            attn_norm=self.vector(p + "attn_norm.weight", c.hidden) if c.pre_norms else None,
            wqkv=self.matrix(self._qkv_parts(p)),
            wo=self.matrix([(p + "attn_output.weight", (c.hidden, q_rows), None)]),
            ffn_norm=self.vector(p + "ffn_norm.weight", c.hidden) if c.pre_norms else None,
            w_gate_up=self.matrix(self._gate_up_parts(p)),
            w_down=self.matrix([(p + "ffn_down.weight", (c.hidden, c.ffn), None)]),
            bqkv=self._bias(p) if c.qkv_bias else None,
            q_norm=self.vector(p + "attn_q_norm.weight", q_norm) if c.qk_norm else None,
            k_norm=self.vector(p + "attn_k_norm.weight", k_norm) if c.qk_norm else None,
            post_attn_norm=(self.vector(p + "post_attention_norm.weight", c.hidden)
                            if c.post_norms else None),
            post_ffn_norm=(self.vector(p + "post_ffw_norm.weight", c.hidden)
                           if c.post_norms else None),
            reduce=self.plan is not None,
        )  # fmt: skip

    def _bias(self, p: str) -> torch.Tensor:
        parts: list[_Part] = [(p + "attn_q.bias", (self.q_rows,), self.q_perm),
                              (p + "attn_k.bias", (self.kv_rows,), self.k_perm),
                              (p + "attn_v.bias", (self.kv_rows,), None)]  # fmt: skip
        return self.place(self.joined(parts, self.get))

    def _qkv_parts(self, p: str) -> list[_Part]:
        c, q_rows, kv_rows = self.c, self.q_rows, self.kv_rows
        if c.fused_qkv:  # Phi-3: one tensor, q then k then v, HF's layout
            return [(p + "attn_qkv.weight", (q_rows + 2 * kv_rows, c.hidden), None)]
        return [
            (p + "attn_q.weight", (q_rows, c.hidden), self.q_perm),
            (p + "attn_k.weight", (kv_rows, c.hidden), self.k_perm),
            (p + "attn_v.weight", (kv_rows, c.hidden), None),
        ]

    def _gate_up_parts(self, p: str) -> list[_Part]:
        c = self.c
        if c.fused_gate_up:  # Phi-3: ffn_up holds gate then up
            return [(p + "ffn_up.weight", (2 * c.ffn, c.hidden), None)]
        return [
            (p + "ffn_gate.weight", (c.ffn, c.hidden), None),
            (p + "ffn_up.weight", (c.ffn, c.hidden), None),
        ]

    def rope_freqs(self) -> torch.Tensor | None:
        """Llama 3's frequency factors, or Phi-3's long or short ones (those the served
        context reads); None for neither."""
        c = self.c
        if c.rope_scaling.kind == "longrope":
            which = "long" if c.rope_scaling.long_factors(c.context_length) else "short"
            return self.get(f"rope_factors_{which}.weight", (c.head_dim // 2,))
        return self.get("rope_freqs.weight", (c.head_dim // 2,)) if c.rope_freq_factors else None

    def build(self) -> Llama:
        c = self.c
        layers = [self.layer(i) for i in range(c.n_layers)]
        embed = self.single("token_embd.weight", (c.vocab_size, c.hidden))
        norm = self.vector("output_norm.weight", c.hidden)
        head = None if c.tied_embeddings else self.single("output.weight", (c.vocab_size, c.hidden))
        freqs = self.rope_freqs()
        self.progress(self.total, self.total)  # the line ends even when tensors were skipped
        self.warn_requantized()
        return Llama(self.local, embed, layers, norm, head, freqs, self.plan)

    def warn_requantized(self) -> None:
        if not self.requantized:
            return
        log.warning(
            "requantized to Q8_0 at load (the kernels read %s in place, not %s): %s",
            ", ".join(sorted(t.name for t in KERNEL_TYPES)),
            ", ".join(sorted(self.requantized)),
            "; ".join(
                f"{name}: {n} tensors, {was / 2**20:.1f} MiB in the file, {now / 2**20:.1f} MiB "
                "in memory"
                for name, (n, was, now) in sorted(self.requantized.items())
            ),
        )


def _progress_printer(label: str) -> Callable[[int, int], None]:
    """A carriage-return progress line on stderr (MiB of the GGUF's tensors read), only
    when stderr is a terminal."""
    if not sys.stderr.isatty():
        return lambda done, total: None

    def show(done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        pct = 100 * done / total if total else 100.0
        sys.stderr.write(
            f"\rloading {label}: {done / 2**20:.1f} / {total / 2**20:.1f} MiB ({pct:3.0f} %){end}"
        )
        sys.stderr.flush()

    return show
