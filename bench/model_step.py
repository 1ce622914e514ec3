"""Model step costs on the default model, per weight mode side by side.

For each ``--weights`` mode (default: quantized, the CPU default, then fp32, the
baseline), prints prefill tokens/s for a 512-token prompt, decode step time at batch
1/8/32/64 (independent sequences, ~128 tokens of context each) on the worker's paged KV
cache (its decode attention kernel included, as the engine runs it; K and V stored as
the worker's default stores them: fp16 with quantized weights), and the same
matmul shapes timed bare (the model's projections and LM head at those row counts), so
the gap between the model and its matmul floor is visible; then the two modes' ratios.
With quantized weights the decode step is timed twice, alternating: through the fused
native trunk (``gpu/backends/fused.py``, what the worker runs) and through the torch path
(``unfused``), the baseline it replaced. The steal share of each mode's run is printed
(above 10 %: not comparable). Runs in about a minute on an idle machine. ``python bench/model_step.py [THREADS] [--weights
quantized,fp32] [--model GGUF]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

# As the worker does (gpu/worker/process.py): bounded OpenMP spin, big temporaries kept in the heap.
from gpu.kernels.cpu_runtime import tune_cpu_runtime  # noqa: E402

tune_cpu_runtime()

import torch  # noqa: E402

from bench.cpu_steal import steal_share, steal_ticks  # noqa: E402
from gpu.cache.kv_cache import PagedKVCache, PrefillChunk, kv_storage_dtype  # noqa: E402
from gpu.model.decoder import Linear  # noqa: E402
from gpu.model.loader import LoadedModel, load_model  # noqa: E402
from gpu.runtime.runner import trunk_for  # noqa: E402

BATCHES = (1, 8, 32, 64)
CONTEXT = 128
PROMPT = 512
BLOCK_SIZE = 16


def median_ms(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def paged_cache(lm: LoadedModel, seqs: int, length: int) -> tuple[PagedKVCache, list[list[int]]]:
    """A paged cache holding ``seqs`` sequences of ``length`` positions, and their tables;
    its K and V stored as the worker's default stores them (``--kv-cache-dtype auto``)."""
    per = -(-length // BLOCK_SIZE)
    kv = kv_storage_dtype("auto", lm.device, lm.dtype, lm.model.quantized())
    cache = PagedKVCache(lm.config, seqs * per, BLOCK_SIZE, lm.device, lm.dtype, kv_dtype=kv)
    return cache, [list(range(i * per, (i + 1) * per)) for i in range(seqs)]


def prefill_ms(lm: LoadedModel) -> float:
    ids = torch.randint(100, 40000, (PROMPT,), generator=torch.Generator().manual_seed(0))
    last = torch.tensor([PROMPT - 1])
    cache, (table,) = paged_cache(lm, 1, PROMPT)
    positions = torch.arange(PROMPT)
    trunk = trunk_for(lm.model, cache)  # what a served step runs

    def step() -> None:
        cache.prepare([], [PrefillChunk(table, 0, PROMPT)])
        lm.model.logits(trunk(ids, positions), last)

    return median_ms(step, runs=2)


def decode_ms(lm: LoadedModel, cache: PagedKVCache, tables: list[list[int]], batch: int,
              fuse: bool = True) -> float:  # fmt: skip
    """One new token per sequence after CONTEXT positions (attention cost does not depend
    on what the cached rows hold, so they are never computed); ``fuse`` False: the torch
    path."""
    trunk = trunk_for(lm.model, cache, fuse=fuse)
    ids = torch.full((batch,), 1000, dtype=torch.int64)
    positions = torch.full((batch,), CONTEXT, dtype=torch.int64)
    decodes = [(tables[s], CONTEXT + 1) for s in range(batch)]

    def step() -> None:
        cache.prepare(decodes, [])
        lm.model.logits(trunk(ids, positions))

    return median_ms(step, runs=7 if batch <= 8 else 5, warmup=2)


def decode_pair(lm: LoadedModel, cache: PagedKVCache, tables: list[list[int]],
                batch: int) -> tuple[float, float]:  # fmt: skip
    """(fused, unfused) decode step medians, timed in turn A B A B."""
    fused, unfused = [], []
    for _ in range(3):
        for flag, got in ((True, fused), (False, unfused)):
            got.append(decode_ms(lm, cache, tables, batch, flag))
    return statistics.median(fused), statistics.median(unfused)


def bare_matmul_ms(lm: LoadedModel, rows: int) -> tuple[float, float]:
    """(one layer's four projections x n_layers, the LM head) at ``rows`` rows, through
    the model's own linear layers (what the forward runs)."""
    layer = lm.model.layers[0]
    linears: list[Linear] = [layer.qkv, layer.o, layer.gate_up, layer.down]
    c = lm.config
    widths = [c.hidden, c.n_heads * c.head_dim, c.hidden, c.ffn]
    xs = [torch.randn(rows, k) for k in widths]
    head_x = torch.randn(rows, c.hidden)

    def layer_mm() -> None:
        for x, lin in zip(xs, linears, strict=True):
            lin(x)

    per_layer = median_ms(layer_mm, runs=15, warmup=3)
    head = median_ms(lambda: lm.model.head(head_x), runs=7)
    return per_layer * c.n_layers, head


def measure(mode: str, model: str | None = None) -> dict[str, float]:
    t = time.perf_counter()
    lm = load_model(model, device="cpu", weights=mode)
    start = steal_ticks()
    out = {"load_s": time.perf_counter() - t, "weights_mib": lm.model.weight_bytes() / 2**20}
    print(f"\n--weights {mode}: {lm.path.name}, {'quantized' if lm.model.quantized() else 'dense'} "
          f"weights {out['weights_mib']:.0f} MiB, load {out['load_s']:.1f}s, "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    with torch.inference_mode():
        ms = prefill_ms(lm)
        out["prefill"] = ms
        print(f"prefill {PROMPT} tokens: {ms:.0f} ms = {PROMPT / ms * 1e3:.0f} tok/s")
        cache, tables = paged_cache(lm, max(BATCHES), CONTEXT + 1)
        print(f"decode step, context {CONTEXT} per sequence, logits for every row:")
        fused = lm.model.quantized()
        print(f"{'batch':>5} {'step ms':>8} {'tok/s':>7} {'bare mm ms':>11} {'(layers':>8} "
              f"{'+ head)':>8}" + (f" {'unfused ms':>11} {'fused/unf':>9}" if fused else ""))  # fmt: skip
        for b in BATCHES:
            step, unfused = decode_pair(lm, cache, tables, b) if fused else (
                decode_ms(lm, cache, tables, b), None)  # fmt: skip
            layers, head = bare_matmul_ms(lm, b)
            out[f"decode{b}"] = step
            extra = f" {unfused:>11.1f} {step / unfused:>9.2f}" if unfused else ""
            print(f"{b:>5} {step:>8.1f} {b / step * 1e3:>7.0f} {layers + head:>11.1f} "
                  f"{layers:>8.1f} {head:>8.1f}{extra}")  # fmt: skip
    share = steal_share(start, steal_ticks())
    flag = "  NOT COMPARABLE" if share > 0.10 else ""
    print(f"steal share {share * 100:.1f} %{flag}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("threads", nargs="?", type=int, help="torch threads (default: all cores)")
    ap.add_argument("--weights", default="quantized,fp32", help="modes, comma-separated")
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2)")
    args = ap.parse_args()
    if args.threads:  # compare 1 vs 2 when the CPU is shared
        torch.set_num_threads(args.threads)
    modes = args.weights.split(",")
    results = {mode: measure(mode, args.model) for mode in modes}
    if len(modes) > 1:
        a, b = modes[0], modes[1]
        print(f"\n{a} / {b} time ratio (below 1: {a} faster)")
        for key in ("prefill", *(f"decode{b_}" for b_ in BATCHES)):
            print(f"  {key:>9}: {results[a][key] / results[b][key]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
