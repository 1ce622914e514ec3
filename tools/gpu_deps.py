"""Which installed distributions the GPU check imports, and which of them the GPU
machine's image lacks and ``.whl/`` does not carry.

    python tools/gpu_deps.py [--wheels .whl]      # exit 1 when something would be missing

Imports every module ``tools/gpu_check.sh`` runs (the frontend and its app, the worker,
the load generator, the benches, the CUDA tests and their conftest), maps the modules
then loaded to the distributions that provide them, and subtracts the standard library,
this project and the packages of the device image (``DEVICE_PACKAGES``: the list in the
workplace's device notes, KINDS.md, as read on 2026-11-17). Modules imported only on
some paths (``llguidance`` for grammars) are in ``LAZY``; ones a dependency imports only
when present, in ``OPTIONAL``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

__all__ = ["DEVICE_PACKAGES", "MODULES", "missing", "needed"]

MODULES = (
    "lifecycle.cli",
    "lifecycle.app",
    "lifecycle.runtime",
    "lifecycle.testing.pytest_plugin",
    "gpu.worker",
    "gpu.runtime.engine",
    "bench.serving",
    "bench.procs",
    "bench.gpu_step",
    "gpu_serving",
    "random_gguf",
    "tests.conftest",
    "tests.test_graphs",
    "tests.test_gpu_kit",
)
LAZY = ("llguidance",)
# Imported under ``try`` by a dependency and used only when present (anyio's sniffio).
OPTIONAL = frozenset({"sniffio"})
DEVICE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed() -> set[str]:
    """Distributions (normalised names) of every module the check's code loads."""
    for m in MODULES + LAZY:
        importlib.import_module(m)
    by_module = md.packages_distributions()
    stdlib = sys.stdlib_module_names
    dists = set()
    for name in list(sys.modules):
        top = name.split(".")[0]
        if top in stdlib or top.startswith("_"):
            continue
        dists.update(_norm(d) for d in by_module.get(top, ()))
    return dists - {"lifecycle"} - OPTIONAL


def carried(wheels: pathlib.Path) -> set[str]:
    return {_norm(w.name.split("-")[0]) for w in wheels.glob("*.whl")}


def missing(wheels: pathlib.Path) -> tuple[set[str], set[str]]:
    """(needed and neither on the device nor carried, carried though on the device)."""
    need, have, carry = needed(), {_norm(p) for p in DEVICE_PACKAGES}, carried(wheels)
    return need - have - carry, carry & have


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheels", default=str(ROOT / ".whl"))
    args = p.parse_args(argv)
    lost, twice = missing(pathlib.Path(args.wheels))
    print(f"the check imports: {', '.join(sorted(needed()))}")
    if twice:
        print(f"carried although the image has them (ours win on PYTHONPATH): {sorted(twice)}")
    if lost:
        print(f"MISSING on the device and not carried: {', '.join(sorted(lost))}")
        return 1
    print("every distribution the check imports is on the device image or carried")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
