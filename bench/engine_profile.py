"""Where a whole engine step's time goes at a large batch: the worker's host work per row.

    python bench/engine_profile.py [--model GGUF] [--device cuda|cpu] [--batch 256]
                                   [--prompt 64] [--steps 20] [--json PATH]

Served on a GPU at 256 streams the worker's step took ~35 ms against ~3-4 ms of captured
decode on the device (docs/benchmarks.md, the H200 figures): the rest is the host. This
submits ``--batch`` greedy requests of ``--prompt`` tokens to an ``Engine`` (as the
worker builds it, decode graphs on CUDA), runs their prefills, then times ``--steps``
pure-decode steps twice: plain (wall time per step and per row), and under cProfile,
printing the functions with the most time of their own. ``--device cpu`` runs the same
on the CPU (where the model itself is most of a step).
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from gpu.cpu_runtime import tune_cpu_runtime  # noqa: E402

tune_cpu_runtime()

import torch  # noqa: E402

from gpu.engine import Engine, EngineConfig  # noqa: E402
from gpu.loader import load_model  # noqa: E402
from wire import SubmitEntry, pack_ids  # noqa: E402


def build(args: argparse.Namespace) -> Engine:
    lm = load_model(args.model, device=args.device)
    blocks = args.batch * (-(-(args.prompt + args.steps * 3 + 8) // 16))
    graphs = "auto" if lm.device.type == "cuda" else "off"
    return Engine(lm, EngineConfig(blocks, 16, args.batch, args.batch, 512, 512, graphs))


def fill(engine: Engine, args: argparse.Namespace) -> None:
    """Every request admitted and decoding."""
    vocab = engine.model.config.vocab_size
    sampling = {"temperature": 0, "ignore_eos": True, "max_new_tokens": args.steps * 3 + 4}
    prompts = [[(17 + i * 31 + j) % vocab for j in range(args.prompt)] for i in range(args.batch)]
    errors, _ = engine.submit(
        [SubmitEntry(i + 1, pack_ids(p), sampling, {}) for i, p in enumerate(prompts)]
    )
    assert not errors, errors
    while len(engine.scheduler.running) < args.batch or any(
        len(s.tokens) - s.num_computed > 1 for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # capture the decode shape, settle the allocator
        engine.step()


def timed(engine: Engine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = build(args)
    fill(engine, args)
    ms = sorted(timed(engine, args.steps))
    med = ms[len(ms) // 2]
    print(f"{engine.model.config.name} on {engine.cache.device}, batch {args.batch}: "
          f"decode step median {med:.2f} ms (min {ms[0]:.2f}), "
          f"{med * 1e3 / args.batch:.1f} us a row")  # fmt: skip
    prof = cProfile.Profile()
    prof.enable()
    timed(engine, args.steps)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())
    if args.json:
        out: dict[str, Any] = {"batch": args.batch, "step_ms": ms, "median_ms": med,
                               "device": str(engine.cache.device), "torch": torch.__version__,
                               "profile": text.getvalue()}  # fmt: skip
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
