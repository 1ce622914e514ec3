"""llama.cpp's tokenizer test files (``models/ggml-vocab-*.gguf`` with ``.inp`` / ``.out``)
and its real chat templates (``models/templates/*.jinja``), found or fetched without
building anything.

The files come from the llama.cpp tree vendored in the llama-cpp-python sdist that
``tools/build_llama_server.sh`` pins. Where ``make bench-peer`` has unpacked that tree
(``<cache>/llama.cpp``) its files are used; otherwise only the ``ggml-vocab-*`` and
``templates/`` members are unpacked from the sdist (kept in ``<cache>/dl``, else downloaded with pip: about
75 MB, then a second or two) into ``<cache>/vocab-tests/models``, a folder of their own
so that nothing mistakes it for the whole tree.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

from bench.llama_server import cache_dir

__all__ = ["VOCABS", "templates_dir", "vocab_cases", "vocab_dir"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEPARATOR = "\n__ggml_vocab_test__\n"
# The vocabularies llama.cpp ships cases for, in the pinned tree.
VOCABS = (
    "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
    "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
)  # fmt: skip
DOWNLOAD_TIMEOUT_S = 180


def _pinned_version() -> str:
    script = (ROOT / "tools" / "build_llama_server.sh").read_text(encoding="utf-8")
    found = re.search(r"^VERSION=(\S+)$", script, re.MULTILINE)
    assert found, "tools/build_llama_server.sh names no VERSION"
    return found.group(1)


def _complete(models: pathlib.Path) -> bool:
    return any((models / "templates").glob("*.jinja")) and all(
        (models / f"ggml-vocab-{n}.gguf{ext}").is_file()
        for n in VOCABS
        for ext in ("", ".inp", ".out")
    )


def templates_dir() -> tuple[pathlib.Path | None, str]:
    """(the folder of llama.cpp's ``*.jinja`` chat templates, "") or (None, why not)."""
    models, why = vocab_dir()
    return (None, why.replace("vocab test files", "chat templates")) if models is None else (
        models / "templates", "")  # fmt: skip


def vocab_dir() -> tuple[pathlib.Path | None, str]:
    """(the folder holding every vocabulary's files, "") or (None, why there is none)."""
    cache = cache_dir()
    for models in (cache / "llama.cpp" / "models", cache / "vocab-tests" / "models"):
        if _complete(models):
            return models, ""
    try:
        return _unpack(cache, _pinned_version()), ""
    except (OSError, subprocess.SubprocessError, tarfile.TarError, ValueError) as exc:
        return None, f"llama.cpp's vocab test files are not here and could not be fetched: {exc}"


def _unpack(cache: pathlib.Path, version: str) -> pathlib.Path:
    sdist = cache / "dl" / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        sdist.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
             ":all:", f"llama-cpp-python=={version}", "-d", str(sdist.parent)],
            check=True, capture_output=True, timeout=DOWNLOAD_TIMEOUT_S,
        )  # fmt: skip
    models = f"llama_cpp_python-{version}/vendor/llama.cpp/models/"
    prefixes = (models + "ggml-vocab-", models + "templates/")
    final = cache / "vocab-tests"
    # Unpacked beside the final folder and renamed into place: a concurrent run never
    # sees half the files.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".vocab-", dir=cache))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                if member.isfile() and member.name.startswith(prefixes):
                    name = member.name.removeprefix(models)
                    if "/" in name.removeprefix("templates/"):
                        continue  # nothing nested deeper is read
                    src = tar.extractfile(member)
                    assert src is not None
                    (tmp / "models" / "templates").mkdir(parents=True, exist_ok=True)
                    with src, open(tmp / "models" / name, "wb") as out:
                        shutil.copyfileobj(src, out)
        if not _complete(tmp / "models"):
            raise ValueError(f"{sdist.name} lacks llama.cpp's ggml-vocab-* files or templates")
        shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _complete(final / "models"):  # else another run put it there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "models"


def vocab_cases(path: pathlib.Path) -> list[tuple[str, list[int]]]:
    """(text, llama.cpp's ids) as llama.cpp's tests/test-tokenizer-0.cpp reads them (a
    separator at the very end opens no case)."""
    raw = path.with_suffix(".gguf.inp").read_bytes().decode("utf-8")
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        texts.pop()
    outs = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    outs = outs[: len(texts)]
    assert len(texts) == len(outs), (path.name, len(texts), len(outs))
    return [(t, [int(i) for i in o.split()]) for t, o in zip(texts, outs, strict=True)]
