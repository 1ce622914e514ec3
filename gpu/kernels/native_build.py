"""Building the CPU kernels: which instruction set to compile for, and the one shared
library per source, compiler and flag set in the kernel cache.

``LIFECYCLE_NATIVE_ISA`` picks the build (``auto``: what /proc/cpuinfo lists; the others
leave extensions out, to compare builds or to avoid a listed but slow one), every build
computing the same bits (docs/determinism.md). The library is built with the system C
compiler (``$CC``, else ``cc``) into ``$LIFECYCLE_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/lifecycle/kernels``, else ``~/.cache/lifecycle/kernels``, beside its
target and renamed, so concurrent workers never load a partial file. ``gpu/kernels/native.py``
loads it.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "ISAS",
    "SOURCES",
    "build",
    "kernel_cache_dir",
    "native_enabled",
    "native_isa",
    "other_isas",
]

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    CSRC / "paged_attention.c",
    CSRC / "small_linear.c",
    CSRC / "token_mask.c",
    CSRC / "quant_linear.c",
    CSRC / "fused_trunk.c",
)
HEADERS = (CSRC / "fixed_order.h",)
# No -ffast-math, and no fused multiply-add the source did not write: a kernel's result is
# then one function of its inputs whatever the compiler vectorizes and for whichever CPU
# (gpu/kernels/csrc/fixed_order.h, docs/determinism.md). The sums and exponentials that have to
# be fast are vectorized by hand, in a fixed order. -fno-math-errno only lets sqrtf
# inline (errno is never read).
COMPILE_FLAGS = ("-O3", "-fPIC", "-fopenmp", "-std=c11", "-ffp-contract=off", "-fno-math-errno")
# What LIFECYCLE_NATIVE_ISA may ask for: the CPU's own (auto), AVX512-VNNI without AMX,
# AVX-512F without VNNI, AVX2 with AVX-VNNI (no AVX-512), AVX2/FMA/F16C alone, or no
# vector extensions. Every choice computes the same bits (tests/test_determinism.py).
ISAS = ("auto", "avx512vnni", "avx512", "avxvnni", "avx2", "portable")
LINK_FLAGS = ("-shared", "-fopenmp")
_OFF = ("0", "false", "no", "off")


def native_enabled() -> bool:
    """``LIFECYCLE_NATIVE=0`` (or false, no, off) leaves the torch path in place."""
    return os.environ.get("LIFECYCLE_NATIVE", "1").strip().lower() not in _OFF


def kernel_cache_dir() -> Path:
    if d := os.environ.get("LIFECYCLE_KERNEL_CACHE"):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lifecycle" / "kernels"


def native_isa() -> str:
    """``LIFECYCLE_NATIVE_ISA``, one of ``ISAS`` (default auto)."""
    isa = os.environ.get("LIFECYCLE_NATIVE_ISA", "auto").strip().lower() or "auto"
    if isa not in ISAS:
        raise RuntimeError(f"LIFECYCLE_NATIVE_ISA={isa!r}: expected one of {', '.join(ISAS)}")
    return isa


def _cpu_flags(isa: str | None = None) -> tuple[str, ...]:
    """The compiler's ISA flags for ``isa`` (``ISAS``), each only where /proc/cpuinfo
    lists it: AVX2/FMA/F16C (all three, or no vector paths), AVX-512F (only the compiler's
    own vectorization of element-wise loops uses it), VNNI (the int8 dot products of
    quant_linear.c in one instruction) and AMX's tiles (``auto`` only), each computing
    the same results as the build without it."""
    isa = isa or native_isa()
    flags = _cpu_flag_set()
    if isa == "portable" or not {"avx2", "fma", "f16c"} <= flags:
        return ()
    out: tuple[str, ...] = ("-mavx2", "-mfma", "-mf16c")
    if isa == "avx2":
        return out
    if isa == "avxvnni":
        return (*out, "-mavxvnni") if "avx_vnni" in flags else out
    if "avx512f" in flags:
        out += ("-mavx512f",)
    if isa == "avx512":
        return out
    if {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"} <= flags:
        out += ("-mavx512vl", "-mavx512bw", "-mavx512vnni")
        if isa == "auto" and {"amx_tile", "amx_int8"} <= flags:
            out += ("-mamx-tile", "-mamx-int8")
    elif "avx_vnni" in flags:
        out += ("-mavxvnni",)
    return out


def other_isas() -> list[str]:
    """The builds whose compiler flags differ from ``auto``'s on this CPU (each computes
    the same bits by design: what the tests compare)."""
    seen = {_cpu_flags("auto")}
    out = []
    for isa in ISAS[1:]:
        if (flags := _cpu_flags(isa)) not in seen:  # one build per distinct flag set
            seen.add(flags)
            out.append(isa)
    return out


def _cpu_flag_set() -> frozenset[str]:
    """The first ``flags`` line of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def build(cache: Path, isa: str | None = None) -> Path:
    """The library for ``isa`` (default: ``LIFECYCLE_NATIVE_ISA``) in ``cache``, built
    there first if it is not; raises with the compiler's message when it cannot be."""
    cc = os.environ.get("CC", "cc")
    cc_cmd = shlex.split(cc)
    if shutil.which(cc_cmd[0]) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found)")
    flags = (*COMPILE_FLAGS, *_cpu_flags(isa))
    version = subprocess.run(
        [*cc_cmd, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    digest = hashlib.sha256(version.encode() + " ".join((*flags, *LINK_FLAGS)).encode())
    for src in (*SOURCES, *HEADERS):
        digest.update(src.read_bytes())
    target = cache / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent workers never load a partial file.
    with tempfile.TemporaryDirectory(dir=cache) as objdir:
        objects = [os.path.join(objdir, src.stem + ".o") for src in SOURCES]
        for src, obj in zip(SOURCES, objects, strict=True):
            _run([*cc_cmd, *flags, "-c", "-o", obj, str(src)], cc)
        lib = os.path.join(objdir, "cpu_kernels.so")
        _run([*cc_cmd, *LINK_FLAGS, "-o", lib, *objects, "-lm"], cc)
        os.replace(lib, target)
    return target


def _run(cmd: list[str], cc: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
