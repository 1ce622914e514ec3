"""A GGUF with random weights in the shape ``tools/model_meta.py`` recorded: the same
metadata (tokenizer, merges, chat template, architecture keys) and tensor names and
shapes, F16 (or F32) weights drawn like a trained model's scale.

    python tools/random_gguf.py [--meta .gpu/model_meta.json.gz] [--out /tmp/random.gguf]
                                [--dtype f16|f32] [--layers N] [--seed S]

What the GPU machine serves and tests with, since the bundled 98 MB model does not
travel there (docs/benchmarks.md, "Proving the CUDA path"). Matrices are normal with
std 0.02 (what Llama-family models are initialised with and roughly keep), norm weights
are 1.0 and other vectors 0, so activations and logits stay finite and spread out.
``--layers N`` keeps the first N blocks only (a small model with the same tokenizer:
the CPU dry run). Quantised originals are written as F16 (or F32), which the loader
accepts as is; written with gguf-py's ``GGUFWriter``, one tensor at a time.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from model_meta import read_meta  # noqa: E402

__all__ = ["DTYPES", "main", "random_tensor", "shrink", "write_random_gguf"]

DTYPES = {"f16": np.float16, "f32": np.float32}
STD = 0.02
# Keys that describe the original file's encoding, not the model: rewritten or dropped.
_FILE_TYPE = {"f16": 1, "f32": 0}  # llama.cpp's LLAMA_FTYPE_MOSTLY_F16 / ALL_F32
_DROP = ("general.architecture", "general.quantization_version")  # the writer adds the first
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def shrink(meta: dict[str, Any], layers: int) -> dict[str, Any]:
    """The same model with only its first ``layers`` blocks."""
    arch = _arch(meta)
    kv = [{**e, "value": layers} if e["key"] == f"{arch}.block_count" else e for e in meta["kv"]]
    tensors = [
        t for t in meta["tensors"] if not (m := _BLOCK.match(t["name"])) or int(m[1]) < layers
    ]
    return {**meta, "kv": kv, "tensors": tensors}


def random_tensor(name: str, shape: list[int], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Norm weights 1.0, other vectors 0, matrices N(0, STD) (vectors stay F32, as
    llama.cpp writes them)."""
    if len(shape) == 1:
        fill = 1.0 if name.endswith("norm.weight") else 0.0
        return np.full(shape, fill, dtype=np.float32)
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= STD
    return w.astype(DTYPES[dtype], copy=False)


def write_random_gguf(
    meta: dict[str, Any], out: str | pathlib.Path, dtype: str = "f16", seed: int = 0
) -> pathlib.Path:
    """Write the random model for ``meta`` (``model_meta.read_meta``) to ``out``."""
    import gguf

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")  # a killed run leaves no half file under the name
    writer = gguf.GGUFWriter(str(tmp), _arch(meta))
    for e in meta["kv"]:
        key, value = e["key"], e["value"]
        if key in _DROP:
            continue
        if key == "general.file_type":
            value = _FILE_TYPE[dtype]
        elif key == "general.name":
            value = f"{value} (random weights)"
        sub = gguf.GGUFValueType[e["sub_type"]] if e["sub_type"] else None
        writer.add_key_value(key, value, gguf.GGUFValueType[e["type"]], sub)
    specs = []
    for t in meta["tensors"]:
        shape = [int(d) for d in t["shape"]]
        np_dtype = np.dtype(np.float32 if len(shape) == 1 else DTYPES[dtype])
        nbytes = int(np.prod(shape)) * np_dtype.itemsize
        writer.add_tensor_info(t["name"], shape, np_dtype, nbytes)
        specs.append((t["name"], shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in specs:  # one tensor in memory at a time
        writer.write_tensor_data(random_tensor(name, shape, dtype, rng))
    writer.close()
    tmp.replace(out)
    return out


def _arch(meta: dict[str, Any]) -> str:
    return next(e["value"] for e in meta["kv"] if e["key"] == "general.architecture")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meta", default=str(ROOT / ".gpu" / "model_meta.json.gz"))
    p.add_argument("--out", default="/tmp/lifecycle-random.gguf")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="f16")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    meta = read_meta(args.meta)
    if args.layers is not None:
        meta = shrink(meta, args.layers)
    out = write_random_gguf(meta, args.out, args.dtype, args.seed)
    print(
        f"{out}: random {args.dtype} weights in the shape of {meta['source']} "
        f"({len(meta['tensors'])} tensors, {out.stat().st_size / 2**20:.1f} MiB) "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
