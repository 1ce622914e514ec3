"""The kernels build wherever the C compiler can build OpenMP code at all.

Every test of the native kernels skips when ``native.load_kernels()`` gives None (no
compiler, ``LIFECYCLE_NATIVE=0``), so a compile error in ``gpu/kernels/csrc/`` would turn them
into skips and the suite would stay green on the torch fallback. This test fails
instead, with the compiler's message, for every build the CPU can run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from gpu.kernels import native, native_build

PROBE = "#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n"


def test_every_build_compiles_where_openmp_code_does(tmp_path: Path) -> None:
    if not native_build.native_enabled():
        pytest.skip("LIFECYCLE_NATIVE=0: the kernels are not wanted")
    cc = shlex.split(os.environ.get("CC", "cc"))
    if shutil.which(cc[0]) is None:
        pytest.skip(f"no C compiler ({cc[0]!r})")
    (tmp_path / "probe.c").write_text(PROBE)
    probe = subprocess.run(
        [*cc, "-fopenmp", str(tmp_path / "probe.c"), "-o", str(tmp_path / "probe")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        pytest.skip(f"the compiler builds no OpenMP code: {probe.stderr[-300:]}")
    assert native.load_kernels() is not None
    for isa in ("auto", *native_build.other_isas()):
        native.load_kernels_built_for(isa)  # raises with the compiler's message
