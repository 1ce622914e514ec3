"""Where a whole engine step's time goes at a large batch: the worker's host work per row.

    python bench/engine_profile.py [--model GGUF | --tiny] [--device cuda|cpu]
                                   [--batch 256] [--prompt 64] [--steps 20] [--json PATH]
    python bench/engine_profile.py --tiny --device cpu --baseline REV   # side by side

Served on a GPU at 256 streams the worker's step took ~35 ms against ~3-4 ms of captured
decode on the device (docs/benchmarks.md, the H200 figures): the rest is the host. This
submits ``--batch`` greedy requests of ``--prompt`` tokens to an ``Engine`` (as the
worker builds it, decode graphs on CUDA), runs their prefills, then times ``--steps``
pure-decode steps twice: plain (wall time per step and per row), and under cProfile,
printing the functions with the most time of their own. ``--device cpu`` runs the same
on the CPU (where the model itself is most of a step).

Each step's time is split at the model's own calls (its trunk and its LM head, or a
captured graph's replay): the host's share is the rest of the step (scheduling, input
preparation with the cache's step layout and the input tensors, sampling and its
bookkeeping, the STEP entries) plus encoding the STEP frame the worker would send. ``--tiny`` runs a
random two-layer model (``tests/tiny_gguf.py``), so on the CPU the model call is small
and the host's cost per row shows (issue 39's figure: at most 1 ms a step at batch 256).

``--baseline REV`` measures this tree and commit REV (``git archive``) with this same
script, alternately (A B A B, ``--reps`` rounds, each a fresh process), and prints their
medians side by side: the same clock for both, whatever REV's own copy of this file did.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pathlib
import pstats
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
# ``--code DIR``: import the worker's packages from DIR (another commit's tree) instead.
CODE = pathlib.Path(sys.argv[sys.argv.index("--code") + 1]) if "--code" in sys.argv else ROOT
sys.path.insert(0, str(CODE))

from gpu.kernels.cpu_runtime import tune_cpu_runtime  # noqa: E402

tune_cpu_runtime()

import torch  # noqa: E402

from gpu.model.loader import load_model  # noqa: E402
from gpu.runtime.engine import Engine, EngineConfig  # noqa: E402
from wire import Step, SubmitEntry, encode_frame, pack_ids  # noqa: E402


def new_tokens(args: argparse.Namespace) -> int:
    """Enough output that no request ends before the timed steps: the prefills of the
    whole batch take about ``batch * prompt / step budget`` steps while the first ones
    already decode (a request that ended would shrink the batch, and ``fill`` would wait
    for a full batch forever)."""
    return args.steps * 3 + 4 + -(-args.batch * args.prompt // 128)


def build(args: argparse.Namespace) -> Engine:
    lm = load_model(args.model, device=args.device)
    blocks = args.batch * (-(-(args.prompt + new_tokens(args) + 4) // 16))
    graphs = "auto" if lm.device.type == "cuda" else "off"
    # --baseline runs this script on an older tree, whose EngineConfig may lack overlap.
    known = EngineConfig.__dataclass_fields__
    more = {"overlap": args.overlap} if "overlap" in known else {}
    return Engine(lm, EngineConfig(blocks, 16, args.batch, args.batch, 512, 512, graphs, **more))


def fill(engine: Engine, args: argparse.Namespace) -> None:
    """Every request admitted and decoding."""
    vocab = engine.model.config.vocab_size
    sampling = {"temperature": 0, "ignore_eos": True, "max_new_tokens": new_tokens(args)}
    prompts = [[(17 + i * 31 + j) % vocab for j in range(args.prompt)] for i in range(args.batch)]
    errors, _ = engine.submit(
        [SubmitEntry(i + 1, pack_ids(p), sampling, {}) for i, p in enumerate(prompts)]
    )
    assert not errors, f"{len(errors)} refused, the first: {errors[0]}"
    while len(engine.scheduler.running) < args.batch or any(
        len(s.tokens) - s.num_computed > 1 for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # capture the decode shape, settle the allocator
        engine.step()


class _ModelClock:
    """Wraps the model's calls (trunk, LM head, graph replay) and adds up their time."""

    def __init__(self, engine: Engine) -> None:
        self.ms = 0.0
        runner = engine.runner
        # the trunk the runner chose once (gpu/runtime/runner.py); a tree from before that choice
        # (``--baseline``) called the model's own
        self._wrap(runner if hasattr(runner, "trunk") else runner.model, "trunk")
        self._wrap(runner.model, "logits")
        if runner.graphs is not None:
            self._wrap(runner.graphs, "run")

    def _wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ms += (time.perf_counter() - t) * 1e3

        setattr(owner, name, timed_call)


def timed(
    engine: Engine, steps: int, clock: _ModelClock | None = None
) -> list[tuple[float, float]]:
    """(whole step with its STEP frame's encoding, model call) in ms, per step. In
    inference mode throughout, as the worker's step loop runs (``gpu/worker/process.py``)."""
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            before = clock.ms if clock is not None else 0.0
            t = time.perf_counter()
            entries = engine.step()
            encode_frame(Step(engine.step_no, entries))
            whole = (time.perf_counter() - t) * 1e3
            out.append((whole, (clock.ms - before) if clock is not None else 0.0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--tiny", action="store_true", help="a random two-layer model (tests/tiny_gguf.py)"
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--overlap", default="auto", help="auto | on | off: overlapped steps (docs/worker.md)"
    )
    ap.add_argument("--code", default=None, help="import the packages from this tree")
    ap.add_argument("--baseline", default=None, help="a git ref to measure side by side")
    ap.add_argument("--reps", type=int, default=2, help="A B rounds with --baseline")
    args = ap.parse_args()
    if args.baseline is not None:
        return side_by_side(args)
    if args.tiny:
        import tempfile

        from tests.tiny_gguf import write_tiny_gguf

        args.model = str(pathlib.Path(tempfile.mkdtemp()) / "tiny.gguf")
        write_tiny_gguf(pathlib.Path(args.model))
    engine = build(args)
    fill(engine, args)
    clock = _ModelClock(engine)
    pairs = timed(engine, args.steps, clock)
    ms = sorted(w for w, _ in pairs)
    host = sorted(w - m for w, m in pairs)
    model = sorted(m for _, m in pairs)
    med, host_med, model_med = ms[len(ms) // 2], host[len(host) // 2], model[len(model) // 2]
    print(f"{engine.model.config.name} on {engine.cache.device}, batch {args.batch}, "
          f"overlap {'on' if getattr(engine, 'overlap', False) else 'off'}: "
          f"decode step median {med:.2f} ms (min {ms[0]:.2f}), "
          f"{med * 1e3 / args.batch:.1f} us a row")  # fmt: skip
    print(f"  model call {model_med:.2f} ms; host (the rest of the step and the STEP frame) "
          f"{host_med:.2f} ms = {host_med * 1e3 / args.batch:.1f} us a row, "
          f"{100 * host_med / med:.0f}% of the step")  # fmt: skip
    prof = cProfile.Profile()
    prof.enable()
    timed(engine, args.steps)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())
    if args.json:
        out: dict[str, Any] = {"batch": args.batch, "step_ms": ms, "median_ms": med,
                               "host_median_ms": host_med, "model_median_ms": model_med,
                               "overlap": getattr(engine, "overlap", False),
                               "device": str(engine.cache.device), "torch": torch.__version__,
                               "profile": text.getvalue()}  # fmt: skip
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


def side_by_side(args: argparse.Namespace) -> int:
    """This tree against ``args.baseline``, A B A B, each run a fresh process of the
    tree's own copy of this script (whose imports match its layout)."""
    import statistics
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="lc-profile-") as tmp:
        base = pathlib.Path(tmp) / "tree"
        base.mkdir()
        tar = subprocess.run(["git", "archive", args.baseline], cwd=ROOT, check=True,
                             capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(base)], input=tar, check=True)
        trees = {"this tree": ROOT, f"baseline {args.baseline}": base}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for rep in range(args.reps):
            for name, tree in trees.items():
                out = pathlib.Path(tmp) / f"{rep}-{len(runs[name])}-{name[:4]}.json"
                # each tree measured by its own copy of this script (its module layout)
                script = tree / "bench" / "engine_profile.py"
                cmd = [sys.executable, str(script), "--code", str(tree), "--json", str(out),
                       "--batch", str(args.batch), "--prompt", str(args.prompt),
                       "--steps", str(args.steps), "--top", "0"]  # fmt: skip
                cmd += ["--tiny"] if args.tiny else ["--model", str(args.model)]
                cmd += ["--device", args.device] if args.device else []
                subprocess.run(cmd, check=True, capture_output=True)
                runs[name].append(json.loads(out.read_text(encoding="utf-8")))
    rows = [("step, ms", "median_ms"), ("model calls, ms", "model_median_ms"),
            ("host, ms", "host_median_ms")]  # fmt: skip
    print(f"batch {args.batch}, {args.steps} decode steps a run, {args.reps} runs each, "
          f"medians (each run's in brackets)")  # fmt: skip
    print("figure".ljust(18) + "".join(n.rjust(30) for n in runs))
    for label, key in rows:
        cells = []
        for name in runs:
            values = [r[key] for r in runs[name]]
            each = "/".join(f"{v:.2f}" for v in values)
            cells.append(f"{statistics.median(values):.2f} ({each})".rjust(30))
        print(label.ljust(18) + "".join(cells))
    for name in runs:
        host = statistics.median(r["host_median_ms"] for r in runs[name])
        print(f"  {name}: host {host * 1e3 / args.batch:.1f} us a row")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
