"""Tensor parallel against one rank on the default model: decode and prefill step times.

Loads the model twice in one run: whole (tp 1, this process, ``TP1_THREADS`` torch
threads, default all cores) and as a ``--tp 2`` group (rank 0 in this process, rank 1
spawned as the worker spawns it, one torch thread each). Then, alternating A (tp 1) and
B (tp 2) for ``ROUNDS`` rounds, times a decode step at batch 1 and batch 8 (~128 tokens of
context each, logits for every row, as the engine's decode steps are) and a prefill of a
256-token prompt (logits for its last row), each a step value run by the worker's
``ModelRunner`` (on rank 0 of tp 2 broadcast to rank 1 first, which runs it too); prints min
and median per leg and measure, and the CPU's steal share over each leg (a leg above
10 % is flagged as not comparable).

On a 2-core machine the two ranks share the cores, and each layer's two all-reduces
(gloo over loopback) cost more than the split saves: tp 2 is slower there; the figure is
for the record. ``python bench/tp.py [ROUNDS] [TP1_THREADS]`` (default 3 rounds).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu.kernels.cpu_runtime import tune_cpu_runtime  # noqa: E402

tune_cpu_runtime()

import torch  # noqa: E402

from bench.cpu_steal import steal_share, steal_ticks  # noqa: E402
from gpu.cache.kv_cache import PrefillChunk  # noqa: E402
from gpu.model.loader import load_model  # noqa: E402
from gpu.parallel import tp  # noqa: E402
from gpu.runtime.engine_config import EngineConfig  # noqa: E402
from gpu.runtime.runner import ModelRunner, StepInput  # noqa: E402
from modelfile.gguf_file import default_model_path  # noqa: E402

CONTEXT = 128
PROMPT = 256
BATCHES = (1, 8)
BLOCK_SIZE = 16
RUNS = 9  # timed steps per measure and leg (after 2 untimed)


def _times(fn: Callable[[], object], runs: int = RUNS, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


class Leg:
    """One side of the comparison: a model's runner (its paged cache), its thread count."""

    def __init__(self, runner: ModelRunner, threads: int) -> None:
        self.runner, self.threads = runner, threads
        per = -(-max(CONTEXT + 1, PROMPT) // BLOCK_SIZE)
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(max(BATCHES))]

    def decode(self, batch: int) -> list[float]:
        step = StepInput(
            [1000] * batch, [CONTEXT] * batch, [(self.tables[s], CONTEXT + 1) for s in range(batch)],
            logit_rows=list(range(batch)),
        )  # fmt: skip
        return _times(lambda: self.runner.run(step))

    def prefill(self) -> list[float]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 40000, (PROMPT,), generator=g).tolist()
        step = StepInput(ids, list(range(PROMPT)), [], [PrefillChunk(self.tables[0], 0, PROMPT)],
                         logit_rows=[PROMPT - 1])  # fmt: skip
        return _times(lambda: self.runner.run(step), runs=max(3, RUNS // 2), warmup=1)

    def run(self) -> tuple[dict[str, list[float]], float]:
        torch.set_num_threads(self.threads)
        start = steal_ticks()
        out = {f"decode b{b}": self.decode(b) for b in BATCHES}
        out[f"prefill {PROMPT}"] = self.prefill()
        return out, steal_share(start, steal_ticks())


def _config() -> EngineConfig:
    blocks = max(BATCHES) * -(-max(CONTEXT + 1, PROMPT) // BLOCK_SIZE)
    return EngineConfig(blocks, BLOCK_SIZE, decode_graphs="off", fuse_trunk=False)


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    tp1_threads = int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads()
    path = str(default_model_path())
    whole, config = load_model(path, device="cpu", weights="fp32"), _config()
    a = Leg(ModelRunner(whole, config, CONTEXT + PROMPT), tp1_threads)
    shard, followers = tp.start_leader(2, path, "cpu", None, 1)
    b = Leg(ModelRunner(shard, config, CONTEXT + PROMPT, followers=followers), 1)
    followers.start(config, CONTEXT + PROMPT)
    legs = {"A tp 1": a, "B tp 2": b}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in legs}
    steal: dict[str, list[float]] = {name: [] for name in legs}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, leg in legs.items():
                got, share = leg.run()
                steal[name].append(share)
                for measure, ms in got.items():
                    times[name].setdefault(measure, []).extend(ms)
    followers.close()
    print(f"model {Path(path).name}; {rounds} rounds A B A B; context {CONTEXT} for decode")
    print(f"A: tp 1, {tp1_threads} torch threads; B: tp 2, 1 torch thread per rank (gloo)")
    print(f"{'measure':14} {'leg':8} {'min ms':>8} {'median ms':>10}")
    for measure in times["A tp 1"]:
        for name in legs:
            ms = times[name][measure]
            print(f"{measure:14} {name:8} {min(ms):8.1f} {statistics.median(ms):10.1f}")
    for name, shares in steal.items():
        flag = "  (a leg above 10 %: not comparable)" if max(shares) > 0.10 else ""
        print(f"steal {name}: " + " ".join(f"{s:.1%}" for s in shares) + flag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
