"""A random-weight GGUF in the exact shape of a published model, with that family's real
vocabulary: what the realistic-size benchmark serves (docs/benchmarks.md).

    python tools/shaped_gguf.py [--shape qwen2.5-0.5b] [--out /tmp/qwen2.5-0.5b-f16.gguf]

The tokenizer (tokens, merges, token types, special ids, chat template) comes from
llama.cpp's own vocabulary file for the family (``models/ggml-vocab-<family>.gguf`` in
the tree ``make bench-peer`` unpacks); the weights are ``tools/random_gguf.py``'s (F16
matrices N(0, 0.02), norm weights 1, biases 0). Random weights of the real shape run at
the real speed. ``llama-quantize`` (built from the same tree) then makes the quantized
file, e.g. ``llama-quantize in.gguf out.gguf Q4_K_M``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from model_meta import FORMAT, dump_meta  # noqa: E402
from random_gguf import write_random_gguf  # noqa: E402

from bench.llama_server import cache_dir  # noqa: E402

__all__ = ["SHAPES", "Shape", "main", "shaped_meta"]


@dataclass(frozen=True)
class Shape:
    arch: str
    vocab: str  # llama.cpp's models/ggml-vocab-<vocab>.gguf
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    context: int
    rope_theta: float
    rms_eps: float
    qkv_bias: bool
    tied: bool


SHAPES = {
    # Qwen/Qwen2.5-0.5B-Instruct's config.json
    "qwen2.5-0.5b": Shape("qwen2", "qwen2", 24, 896, 14, 2, 4864, 32768, 1e6, 1e-6, True, True),
}


def shaped_meta(shape: Shape, vocab_file: pathlib.Path, name: str) -> dict[str, Any]:
    """``tools/model_meta.py``'s description of the shaped model: the vocabulary file's
    ``tokenizer.*`` keys, the architecture's keys, every tensor's shape."""
    vocab = dump_meta(vocab_file)
    kv = [e for e in vocab["kv"] if e["key"].startswith("tokenizer.")]
    n_vocab = next(len(e["value"]) for e in kv if e["key"] == "tokenizer.ggml.tokens")
    a, hd = shape.arch, shape.hidden // shape.heads

    def u32(key: str, value: int) -> dict[str, Any]:
        return {"key": key, "type": "UINT32", "sub_type": None, "value": value}

    def f32(key: str, value: float) -> dict[str, Any]:
        return {"key": key, "type": "FLOAT32", "sub_type": None, "value": value}

    kv = [
        {"key": "general.architecture", "type": "STRING", "sub_type": None, "value": a},
        {"key": "general.name", "type": "STRING", "sub_type": None, "value": name},
        u32("general.file_type", 1),
        u32(f"{a}.block_count", shape.layers),
        u32(f"{a}.context_length", shape.context),
        u32(f"{a}.embedding_length", shape.hidden),
        u32(f"{a}.feed_forward_length", shape.ffn),
        u32(f"{a}.attention.head_count", shape.heads),
        u32(f"{a}.attention.head_count_kv", shape.kv_heads),
        f32(f"{a}.rope.freq_base", shape.rope_theta),
        f32(f"{a}.attention.layer_norm_rms_epsilon", shape.rms_eps),
        *kv,
    ]
    tensors: list[dict[str, Any]] = [
        {"name": "token_embd.weight", "shape": [n_vocab, shape.hidden]}
    ]
    q, k = shape.heads * hd, shape.kv_heads * hd
    for i in range(shape.layers):
        p = f"blk.{i}."
        tensors += [
            {"name": p + "attn_norm.weight", "shape": [shape.hidden]},
            {"name": p + "attn_q.weight", "shape": [q, shape.hidden]},
            {"name": p + "attn_k.weight", "shape": [k, shape.hidden]},
            {"name": p + "attn_v.weight", "shape": [k, shape.hidden]},
            {"name": p + "attn_output.weight", "shape": [shape.hidden, q]},
            {"name": p + "ffn_norm.weight", "shape": [shape.hidden]},
            {"name": p + "ffn_gate.weight", "shape": [shape.ffn, shape.hidden]},
            {"name": p + "ffn_up.weight", "shape": [shape.ffn, shape.hidden]},
            {"name": p + "ffn_down.weight", "shape": [shape.hidden, shape.ffn]},
        ]
        if shape.qkv_bias:
            tensors += [
                {"name": p + "attn_q.bias", "shape": [q]},
                {"name": p + "attn_k.bias", "shape": [k]},
                {"name": p + "attn_v.bias", "shape": [k]},
            ]
    tensors.append({"name": "output_norm.weight", "shape": [shape.hidden]})
    if not shape.tied:
        tensors.append({"name": "output.weight", "shape": [n_vocab, shape.hidden]})
    return {"format": FORMAT, "source": name, "kv": kv, "tensors": tensors}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--out", default=None, help="default /tmp/<shape>-f16.gguf")
    p.add_argument("--models", default=str(cache_dir() / "llama.cpp" / "models"),
                   help="llama.cpp's models folder (its ggml-vocab-*.gguf)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    vocab = pathlib.Path(args.models) / f"ggml-vocab-{shape.vocab}.gguf"
    if not vocab.is_file():
        print(
            f"error: {vocab} not found (make bench-peer unpacks llama.cpp's tree)", file=sys.stderr
        )
        return 2
    out = pathlib.Path(args.out or f"/tmp/{args.shape}-f16.gguf")
    t0 = time.perf_counter()
    meta = shaped_meta(shape, vocab, f"{args.shape} (random weights)")
    write_random_gguf(meta, out, "f16", args.seed)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
