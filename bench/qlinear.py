"""Decode-row linear layers: fp32 (what the worker runs today) against GGUF Q4_1 / Q8_0 kernels.

For SmolLM2's projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) and
its LM head (49152x576) at 1 and 2 rows, times ``gpu.model.decoder.PackedLinear`` on the
dequantized weight against ``NativeKernels.q_linear`` on the blocks: Q4_1 as the
bundled GGUF stores the layers, Q8_0 as it stores the embedding (the tied head); the
other type of each is a requantization with gguf.quants. Every layer's own weight is
used, so one pass over the 30 layers reads them from memory as a decode step does (one
layer's weights alone would sit in the cache and flatter fp32). The three paths run
interleaved (A B C A B C ...); per call min and median, the bytes of weight it reads,
the GB/s that makes at the min, the kernel's max error against F.linear on its blocks'
dequantization relative to max |that|, and
the sum over 30 layers + head. The steal share of each thread count's run comes from
``/proc/stat``, with the CPU other processes used meanwhile (on 2 cores one busy
neighbour makes the second OpenMP thread wait for a time slice: ~1.6 ms a call); above
10 % steal or 0.1 cores of others the run is flagged as not comparable.
``python bench/qlinear.py [THREADS ...] [--rows 1,2,32,500]`` (default threads 1 2, rows 1,2).

``Q4_1p`` / ``Q8_0p`` are the same blocks packed into panels by ``q_pack``, the layout
the loader keeps where the build packs (gpu/model/quant.py): the packed and the file's
layouts compute the same bits, so the columns compare speed only.
``--kinds Q4_1,Q8_0`` leaves fp32 out, ``--reps`` sets the passes; ``--against REV`` also
builds quant_linear.c as git revision REV has it (alone, with the same flags, into a
temporary directory) and times it interleaved with the working tree's as ``Q4_1@REV`` /
``Q8_0@REV``: a before / after in one run, under the same load (the working tree's is
then built the same way, so both are called through the same ctypes lines). Each
build's step (the file's types: Q4_1 layers, Q8_0 head) is printed per row count, min
and median, with their ratios to one row's (speculative decoding verifies 1 + k rows a
step: ``--rows 1,2,3,4,6,8,12,16,32``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu.kernels.cpu_runtime import tune_cpu_runtime  # noqa: E402

tune_cpu_runtime()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from bench.cpu_steal import steal_share, steal_ticks  # noqa: E402
from bench.procs import busy_cpu_seconds  # noqa: E402
from gpu.kernels.native import NativeKernels, load_kernels, quant_row_bytes  # noqa: E402
from gpu.kernels.native_build import COMPILE_FLAGS, _cpu_flags  # noqa: E402
from gpu.model.decoder import PackedLinear  # noqa: E402
from modelfile.gguf_file import GGUFFile, default_model_path  # noqa: E402

SHAPES = {  # name -> the GGUF tensors fused into it, as the loader fuses them
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}
# Q4_1p / Q8_0p: the same blocks packed into panels (q_pack), as the loader keeps them
# where the build packs (gpu/model/quant.py)
KINDS = ("fp32", "Q4_1", "Q8_0", "Q4_1p", "Q8_0p")
REPO = Path(__file__).resolve().parent.parent
ROWS = (1, 2)  # default --rows: decode at batch 1-2
REPS = 15
STEAL_LIMIT = 0.10
OTHERS_LIMIT = 0.10  # cores other processes kept busy: they take our second thread's core


class Weights:
    """One shape's weights for every layer (or the head), in the three forms."""

    def __init__(self, f: GGUFFile, names: list[list[str]], kn: NativeKernels) -> None:
        self.fp32: list[PackedLinear] = []
        self.blocks: dict[str, list[torch.Tensor]] = {"Q4_1": [], "Q8_0": []}
        self.packed: dict[str, list[torch.Tensor | None]] = {"Q4_1": [], "Q8_0": []}
        for group in names:
            dense = np.concatenate([f.dequantize(n) for n in group])
            self.fp32.append(PackedLinear(torch.from_numpy(dense)))
            for kind in self.blocks:
                qtype = Q[kind]
                if all(f.tensor_type(n) == qtype for n in group):  # the file's own blocks
                    raw = np.concatenate([file_blocks(f, n) for n in group])
                else:
                    raw = quantize(dense, qtype)
                self.blocks[kind].append(torch.from_numpy(np.ascontiguousarray(raw)))
                self.packed[kind].append(
                    kn.q_pack(self.blocks[kind][-1], int(qtype), dense.shape[1])
                )
        self.n, self.k = self.fp32[0].weight.shape

    def bytes_per_call(self, kind: str) -> int:
        if kind == "fp32":
            return self.n * self.k * 4
        row = quant_row_bytes(int(Q[kind.partition("@")[0].removesuffix("p")]), self.k)
        assert row is not None
        return self.n * row


def file_blocks(f: GGUFFile, name: str) -> np.ndarray:
    t = f.tensors[name]
    n, k = f.tensor_shape(name)
    row = quant_row_bytes(int(f.tensor_type(name)), k)
    assert row is not None
    return np.array(np.memmap(f.path, np.uint8, "r", t.offset, (n, row)))


class QLinearAt:
    """``q_linear`` of quant_linear.c as git revision ``rev`` has it (None: the working
    tree), built alone (no other kernel) with the build's flags for this CPU and called
    through the same few lines of ctypes: the two sides of an A/B."""

    def __init__(self, rev: str | None) -> None:
        self.rev = rev
        self._dir = tempfile.TemporaryDirectory(prefix="qlinear-")
        d = Path(self._dir.name)
        for name in ("quant_linear.c", "fixed_order.h"):
            if rev is None:
                (d / name).write_bytes((REPO / "gpu/kernels/csrc" / name).read_bytes())
                continue
            src = f"{rev}:gpu/kernels/csrc/{name}"
            (d / name).write_bytes(subprocess.run(
                ["git", "-C", str(REPO), "show", src], check=True, capture_output=True
            ).stdout)  # fmt: skip
        lib = d / "ql.so"
        subprocess.run(
            ["cc", *COMPILE_FLAGS, *_cpu_flags(), "-shared", "-o", str(lib),
             str(d / "quant_linear.c"), "-lm"], check=True,
        )  # fmt: skip
        self._fn = ctypes.CDLL(str(lib)).q_linear
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        self._fn.argtypes, self._fn.restype = [p, p, p, i32, i32, i64, i64, i32], ctypes.c_int

    def q_linear(self, x: torch.Tensor, w: torch.Tensor, qtype: int) -> torch.Tensor:
        y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
        rc = self._fn(x.data_ptr(), w.data_ptr(), y.data_ptr(), qtype, x.shape[0], w.shape[0],
                      x.shape[1], torch.get_num_threads())  # fmt: skip
        assert rc == 0, rc
        return y


def runner(
    kn: NativeKernels | QLinearAt, w: Weights, kind: str, x: torch.Tensor, old: QLinearAt | None
) -> Callable[[], object]:
    """One pass over every copy of the weight (30 layers, or the head once); ``kind``
    ``Q4_1@REV`` runs ``old``."""
    if kind == "fp32":
        return lambda: [lin(x) for lin in w.fp32]
    if kind.endswith("p"):  # packed: this tree's kernels, whichever side --against times
        packed, qtype, n = w.packed[kind[:-1]], int(Q[kind[:-1]]), w.n
        kernels = load_kernels()
        assert kernels is not None and all(wp is not None for wp in packed)
        return lambda: [kernels.q_linear_packed(x, wp, qtype, n) for wp in packed]  # type: ignore[arg-type]
    name, _, rev = kind.partition("@")
    qtype, fn = int(Q[name]), (old if rev and old is not None else kn).q_linear
    return lambda: [fn(x, b, qtype) for b in w.blocks[name]]


def max_rel_err(kn: NativeKernels, w: Weights, kind: str, x: torch.Tensor) -> float:
    """The kernel's own error: against F.linear on what its blocks dequantize to (a
    requantized weight's distance from the file's is a separate matter)."""
    blocks, qtype = w.blocks[kind][0], int(Q[kind])
    ref = F.linear(x, kn.q_dequantize(blocks, qtype, w.k))
    return float((kn.q_linear(x, blocks, qtype) - ref).abs().max() / ref.abs().max())


def time_interleaved(
    fns: dict[str, Callable[[], object]], copies: int, reps: int = REPS
) -> dict[str, list[float]]:
    """Per-call seconds of each path over ``reps`` passes, the paths alternating each pass."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {kind: [] for kind in fns}
    for _ in range(reps):
        for kind, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[kind].append((time.perf_counter() - t) / copies)
    return times


def run(
    kn: NativeKernels | QLinearAt, weights: dict[str, Weights], n_layers: int, threads: int,
    rows_list: tuple[int, ...], kinds: tuple[str, ...], old: QLinearAt | None, reps: int,
) -> None:  # fmt: skip
    torch.set_num_threads(threads)
    errs_of = tuple(k for k in ("Q4_1", "Q8_0") if k in kinds)
    errs_kn = load_kernels()
    assert errs_kn is not None
    start, wall0, busy0, own0 = steal_ticks(), time.perf_counter(), busy_cpu_seconds(), own_cpu()
    print(f"\nthreads {threads}")
    print(f"{'shape':>8} {'rows':>4} " + " ".join(
        f"{k + ' min/med us':>18} {'MB':>5} {'GB/s':>5}" for k in kinds
    ) + "".join(f" {'err ' + k:>9}" for k in errs_of))  # fmt: skip
    totals = {(r, k): [0.0, 0.0] for r in rows_list for k in kinds}
    step = {(r, k): [0.0, 0.0] for r in rows_list for k in kinds}
    for rows in rows_list:
        for name, w in weights.items():
            x = torch.randn(rows, w.k, generator=torch.Generator().manual_seed(rows))
            copies = len(w.fp32)
            fns = {k: runner(kn, w, k, x, old) for k in kinds}
            times = time_interleaved(fns, copies, reps)
            cols = []
            for kind in kinds:
                lo, med = min(times[kind]), statistics.median(times[kind])
                mb = w.bytes_per_call(kind) / 1e6
                cols.append(
                    f"{lo * 1e6:>8.0f} / {med * 1e6:>7.0f} {mb:>5.1f} {mb / 1e3 / lo:>5.1f}"
                )
                scale = n_layers if name != "head" else 1
                totals[rows, kind][0] += lo * scale
                totals[rows, kind][1] += med * scale
                # the file's types: Q4_1 layers, Q8_0 head (either build)
                if kind.startswith("Q8_0" if name == "head" else "Q4_1"):
                    key = (rows, kind.replace("Q8_0", "Q4_1"))
                    if key in step:
                        step[key][0] += lo * scale
                        step[key][1] += med * scale
            errs = [max_rel_err(errs_kn, w, k, x) for k in errs_of]
            print(f"{name:>8} {rows:>4} " + " ".join(cols) + "".join(f" {e:>9.4f}" for e in errs))
    for rows in rows_list:
        line = ", ".join(
            f"{k} {totals[rows, k][0] * 1e3:.2f} / {totals[rows, k][1] * 1e3:.2f} ms" for k in kinds
        )
        print(f"per decode step ({n_layers} layers + head), rows {rows}, min / median: {line}")
    builds = [k for k in kinds if k.startswith("Q4_1") and step[rows_list[0], k][1] > 0]
    if builds:
        print(f"step: {n_layers} Q4_1 layers + Q8_0 head, min / median ms (each / rows 1's)")
        print(f"{'rows':>4} " + " ".join(f"{b:>34}" for b in builds))
        for rows in rows_list:
            cells = []
            for b in builds:
                lo, med = step[rows, b]
                one = step.get((1, b), [float("nan")] * 2)
                cells.append(
                    f"{lo * 1e3:>7.2f} / {med * 1e3:>7.2f} ({lo / one[0]:>4.2f} / {med / one[1]:>4.2f}x)"
                )
            print(f"{rows:>4} " + " ".join(f"{c:>34}" for c in cells))
    share = steal_share(start, steal_ticks())
    others = (busy_cpu_seconds() - busy0 - (own_cpu() - own0)) / (time.perf_counter() - wall0)
    flag = "  NOT COMPARABLE" if share > STEAL_LIMIT or others > OTHERS_LIMIT else ""
    print(f"steal share {share * 100:.1f} %, other processes {others:.2f} cores busy{flag}")


def own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument(
        "--rows", default=",".join(map(str, ROWS)),
        help="comma-separated row counts (decode batch sizes; 500 for a prefill)",
    )  # fmt: skip
    ap.add_argument("--kinds", default=",".join(KINDS), help="of " + ", ".join(KINDS))
    ap.add_argument("--reps", type=int, default=REPS, help="passes per path and shape")
    ap.add_argument(
        "--against", metavar="REV",
        help="also time quant_linear.c as git revision REV has it (e.g. HEAD), interleaved",
    )  # fmt: skip
    args = ap.parse_args()
    rows_list = tuple(int(r) for r in args.rows.split(","))
    kinds = tuple(args.kinds.split(","))
    kn = load_kernels()
    if kn is None:
        print("native kernels unavailable (LIFECYCLE_NATIVE=0 or no C compiler): nothing to time")
        return 1
    old = QLinearAt(args.against) if args.against else None
    mine: NativeKernels | QLinearAt = kn
    if old is not None:  # both sides built and called the same way
        kinds += tuple(f"{k}@{args.against}" for k in kinds if k in ("Q4_1", "Q8_0"))
        mine = QLinearAt(None)
    f = GGUFFile(default_model_path())
    n_layers = sum(1 for n in f.tensors if n.endswith(".attn_q.weight"))
    t = time.perf_counter()
    with torch.inference_mode():
        weights = {
            name: Weights(f, [[f"blk.{i}.{p}.weight" for p in parts] for i in range(n_layers)], kn)
            for name, parts in SHAPES.items()
        }
        weights["head"] = Weights(f, [["token_embd.weight"]], kn)
        print(f"{f.path.name}: {n_layers} layers, weights ready in {time.perf_counter() - t:.1f}s")
        for threads in args.threads:
            run(mine, weights, n_layers, threads, rows_list, kinds, old, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
