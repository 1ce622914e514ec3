"""A GGUF model's shape without its weights: every metadata key with its GGUF value type,
and every tensor's name, shape and type, as gzipped JSON.

    python tools/model_meta.py [--model GGUF] [--out .gpu/model_meta.json.gz]

The bundled model (98 MB) does not fit the 64 MiB that travels to the GPU machine; its
metadata (tokenizer, merges, chat template, architecture keys: about 1 MB gzipped) does,
and ``tools/random_gguf.py`` rebuilds a file of the same shape from it there. Read with
gguf-py's ``GGUFReader``, which keeps each field's value type (``modelfile.gguf_meta``
does not need them and drops them).
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

__all__ = ["FORMAT", "dump_meta", "main", "read_meta", "write_meta"]

FORMAT = "lifecycle-model-meta/1"
# Fields GGUFReader reports that are the file's header, not metadata key/values.
_HEADER = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


def _value(field: Any) -> Any:
    """A field's value as JSON: scalars, strings, lists of either."""
    from gguf import GGUFValueType

    value = field.contents()
    if field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.BOOL:
        return [bool(v) for v in value]
    if field.types[0] == GGUFValueType.BOOL:
        return bool(value)
    return value


def dump_meta(path: str | pathlib.Path) -> dict[str, Any]:
    """The metadata and tensor directory of the GGUF at ``path``."""
    from gguf import GGUFReader, GGUFValueType

    path = pathlib.Path(path)
    reader = GGUFReader(str(path))
    kv = []
    for key, field in reader.fields.items():
        if key in _HEADER:
            continue
        types = [GGUFValueType(t).name for t in field.types]
        if len(types) > 2:
            raise ValueError(f"{path}: nested array {key!r} is not supported")
        kv.append(
            {
                "key": key,
                "type": types[0],
                "sub_type": types[1] if len(types) == 2 else None,
                "value": _value(field),
            }
        )
    tensors = [
        {
            "name": t.name,
            "shape": [int(d) for d in reversed(t.shape.tolist())],  # numpy order
            "ggml_type": t.tensor_type.name,
        }
        for t in reader.tensors
    ]
    return {
        "format": FORMAT,
        "source": path.name,
        "source_bytes": path.stat().st_size,
        "kv": kv,
        "tensors": tensors,
    }


def write_meta(meta: dict[str, Any], out: str | pathlib.Path) -> pathlib.Path:
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", encoding="utf-8", compresslevel=9) as f:
        json.dump(meta, f, ensure_ascii=False, separators=(",", ":"))
    return out


def read_meta(path: str | pathlib.Path) -> dict[str, Any]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (format {meta.get('format')!r})")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled model)")
    p.add_argument("--out", default=str(ROOT / ".gpu" / "model_meta.json.gz"))
    args = p.parse_args(argv)
    if args.model is None:
        from modelfile.gguf_file import default_model_path

        args.model = default_model_path()
    meta = dump_meta(args.model)
    out = write_meta(meta, args.out)
    print(
        f"{out}: {len(meta['kv'])} keys, {len(meta['tensors'])} tensors of {meta['source']}, "
        f"{out.stat().st_size / 2**20:.2f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
