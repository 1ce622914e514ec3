"""``pip install .`` without the worker extra (README "Installing"): the frontend, the
transport, the wire codec and modelfile, and no torch.

This checkout's sources are copied and installed, offline from the local package indexes
pip is configured with, into a scratch venv that has no torch. From there ``lifecycle
serve`` answers /generate on the scripted worker and through a real worker started
elsewhere (``lifecycle worker --listen`` from this venv, which has torch, on a tiny
GGUF); ``lifecycle worker`` there refuses with the install hint."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.scripted import listening_worker
from tests.test_frontend_no_torch import generate_once, serve_process, torch_libraries
from tests.tiny_gguf import TinyModel

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lifecycle", "transport", "wire", "modelfile", "gpu")
# Measured on the busy 2-core machine: the install 10-17 s, the whole module 20-27 s.
pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True, slots=True)
class LocalIndex:
    """The package indexes and find-links folders on local disk that pip is configured
    with; naming only them (``--index-url``) keeps the install offline whatever else the
    configuration names."""

    indexes: tuple[str, ...]  # file:// simple indexes
    links: tuple[Path, ...]  # find-links folders

    @classmethod
    def configured(cls) -> LocalIndex:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
        ).stdout
        indexes: list[str] = []
        links: list[Path] = []
        for line in listed.splitlines():
            key, _, value = line.partition("=")
            values = value.strip("'\"").split()
            if key.endswith("index-url"):
                indexes += [v for v in values if v.startswith("file://")]
            elif key.endswith("find-links"):
                links += [Path(v.removeprefix("file://")) for v in values]
        return cls(
            tuple(dict.fromkeys(indexes)), tuple(p for p in dict.fromkeys(links) if p.is_dir())
        )

    def holds(self, name: str) -> bool:
        canonical = re.sub(r"[-_.]+", "-", name).lower()
        if any(Path(url.removeprefix("file://"), canonical).is_dir() for url in self.indexes):
            return True
        wheel = canonical.replace("-", "_") + "-*.whl"
        return any(next(folder.glob(wheel), None) for folder in self.links)

    def options(self, *more_links: Path) -> list[str]:
        options = ["--index-url", self.indexes[0]] if self.indexes else ["--no-index"]
        for url in self.indexes[1:]:
            options += ["--extra-index-url", url]
        for folder in (*self.links, *more_links):
            options += ["--find-links", str(folder)]
        return options


def _requirement_names() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0] for req in project["dependencies"]]


def wheel_from_installed(name: str, dest: Path) -> Path:
    """A wheel of the distribution ``name`` as this venv has it installed: what the install
    takes from here when no local index holds it (llguidance, on this
    machine, came from the registry). A binary one keeps the tag its WHEEL file names
    (llguidance: one abi3 library)."""
    dist = importlib.metadata.distribution(name)
    wheel_info = dist.read_text("WHEEL") or ""
    tags = re.findall(r"^Tag: (\S+)$", wheel_info, re.M)
    assert "Root-Is-Purelib: true" in wheel_info or tags, f"{name} has no wheel tag"
    tag = "py3-none-any" if "Root-Is-Purelib: true" in wheel_info else tags[0]
    info = next(f.parent for f in dist.files or () if f.name == "METADATA")
    skip = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    files = [
        f
        for f in dist.files or ()
        if f.parts[0] != ".." and "__pycache__" not in f.parts and f.name not in skip
    ]
    stem = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}"
    path = dest / f"{stem}-{tag}.whl"
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for f in files:
            data = Path(dist.locate_file(f)).read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{f.as_posix()},sha256={digest.decode()},{len(data)}")
            whl.writestr(f.as_posix(), data)
        record.append(f"{info.as_posix()}/RECORD,,")
        whl.writestr(f"{info.as_posix()}/RECORD", "\n".join(record) + "\n")
    return path


def _sources(dest: Path) -> Path:
    """What a wheel is built from, copied so the build leaves this checkout untouched."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def frontend_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv holding ``pip install .`` (no extras); yields its bin/ folder."""
    local = LocalIndex.configured()
    if not (local.indexes or local.links):
        pytest.skip("pip names no local package index or find-links (offline install)")
    tmp = tmp_path_factory.mktemp("install")
    src = _sources(tmp / "src")
    wheelhouse = tmp / "wheelhouse"
    wheelhouse.mkdir()
    for name in _requirement_names():
        if not local.holds(name):
            wheel_from_installed(name, wheelhouse)
    # No pip of its own: this venv's pip installs into it (pip --python), which saves
    # the few seconds ensurepip takes.
    venv.EnvBuilder(with_pip=False).create(tmp / "venv")
    python = tmp / "venv" / "bin" / "python"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
        + ["--disable-pip-version-check", *local.options(wheelhouse), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    # pip warns once per package about every index that lacks it: keep only the rest.
    said = [line for line in done.stderr.splitlines() if "is ignored" not in line]
    assert done.returncode == 0, "\n".join(said[-40:])
    yield python.parent


def _env() -> dict[str, str]:
    """The environment without what would put this checkout on the scratch venv's path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _scratch_python(bin_dir: Path, code: str) -> str:
    return subprocess.run(
        [str(bin_dir / "python"), "-c", code],
        cwd=bin_dir,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_the_install_has_the_frontend_and_no_torch(frontend_venv: Path) -> None:
    names = _scratch_python(
        frontend_venv,
        "import importlib.metadata as m; print(' '.join(d.metadata['Name'].lower() "
        "for d in m.distributions()))",
    ).split()
    assert "lifecycle" in names and "anyio" in names and "tokenizers" in names
    assert "torch" not in names and "psutil" not in names
    where = _scratch_python(
        frontend_venv,
        "import importlib.util as u; import lifecycle, transport, wire, modelfile; "
        "print(lifecycle.__file__, u.find_spec('torch'))",
    )
    assert where.startswith(str(frontend_venv.parent)) and where.endswith(" None"), where


def test_worker_there_refuses_with_the_install_hint(frontend_venv: Path, tmp_path: Path) -> None:
    sock = tmp_path / "w.sock"
    done = subprocess.run(
        [str(frontend_venv / "lifecycle"), "worker", "--listen", f"unix:{sock}"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "install the worker extra: pip install 'lifecycle[worker]'" in done.stderr
    assert "Traceback" not in done.stderr and not sock.exists()


def _serve_argv(bin_dir: Path, *args: str) -> list[str]:
    return [str(bin_dir / "lifecycle"), "serve", "--port", "0", *args]


def test_serves_on_the_scripted_worker(
    frontend_venv: Path, tiny_gguf: TinyModel, tmp_path: Path
) -> None:
    argv = _serve_argv(frontend_venv, "--scripted-worker", "--model", str(tiny_gguf.path))
    with serve_process(argv, tmp_path / "serve.log", cwd=tmp_path, env=_env()) as served:
        generate_once(served.url)
        assert torch_libraries(served.proc.pid) == []


@pytest.fixture
def remote_worker(tiny_gguf: TinyModel, tmp_path: Path) -> Iterator[str]:
    """``lifecycle worker --listen unix:...`` from this checkout's venv (it has torch)."""
    pytest.importorskip("torch", reason="the remote worker needs torch in this venv")
    args = ("--model", str(tiny_gguf.path), "--device", "cpu", "--kv-cache-tokens", "256")
    with listening_worker(tmp_path / "w.sock", *args, log=tmp_path / "worker.log", timeout=60) as a:
        yield a


def test_serves_through_a_worker_started_elsewhere(
    frontend_venv: Path, tiny_gguf: TinyModel, remote_worker: str, tmp_path: Path
) -> None:
    argv = _serve_argv(frontend_venv, "--worker", remote_worker, "--model", str(tiny_gguf.path))
    with serve_process(argv, tmp_path / "serve.log", cwd=tmp_path, env=_env()) as served:
        body = generate_once(served.url, "hello world")
        assert isinstance(body["text"], str)
        info = httpx.get(served.url + "/server_info", timeout=10).json()
        assert info["worker"] == [remote_worker]
        assert torch_libraries(served.proc.pid) == []
