"""Decode steps with and without captured graphs against the memory-bandwidth floor.

    python bench/gpu_step.py [--model GGUF] [--device cuda|cpu] [--batches 1 64]
                             [--context 256] [--prompt 512] [--json PATH]
                             [--kernels torch triton]

For each batch size: one decode step (every sequence adds one token after ``--context``
tokens of context, logits for every row, no sampling) run three ways:

- ``eager``: ``PagedKVCache.prepare`` + the model's forward, as the engine runs a step
  with ``decode_graphs="off"``;
- ``graphs``: ``gpu.backends.graphs.StepGraphs.run`` (the static buffers filled from the host,
  then the captured graph replayed: ``CudaBackend`` on a GPU, ``EagerBackend``, the same
  step without capture, on the CPU);
- ``replay``: on a GPU, the captured graph alone, buffers already filled (the device's
  share of the step).

Each step is timed on its own (CUDA events around it and a synchronisation after, as
the engine syncs each step to sample; ``perf_counter`` on the CPU) after warm-up; min
and median over ``--runs``. The floor: the device's copy bandwidth (a large
device-to-device copy, bytes read plus written per second) and the bytes a step must
read, the weights in their dtype (``w``) and with the KV cache rows of the context
(``w+kv``); the ratio is step time / floor time. Also a ``--prompt``-token prefill. A
check that graphs and eager agree: the largest logit difference and the share of rows
whose argmax matches.

And a mixed step, ``--mixed-decodes`` decode rows (``--context`` each) beside one
``--mixed-chunk``-token prompt chunk, logits for the decode rows and the chunk's last:
``eager`` as above, ``piecewise`` through ``gpu.backends.piecewise.MixedGraphs`` (captured
pieces around an eager attention; without capture on the CPU), and the check against the
model's torch path (eager on a GPU), which the pieces are made of.

``--kernels torch triton`` runs all of it once with each (``gpu/kernels/triton_ops.py``: the
torch path's ops fused into Triton kernels), one table each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from gpu.kernels.cpu_runtime import tune_cpu_runtime  # noqa: E402

tune_cpu_runtime()

import torch  # noqa: E402

from gpu.backends.graphs import CudaBackend, EagerBackend, StepGraphs  # noqa: E402
from gpu.backends.piecewise import MixedGraphs  # noqa: E402
from gpu.cache.kv_cache import PagedKVCache, PrefillChunk  # noqa: E402
from gpu.cache.memory import kv_bytes_per_token  # noqa: E402
from gpu.kernels.kernel_choice import triton_ops  # noqa: E402
from gpu.model.decoder import Ops  # noqa: E402
from gpu.model.loader import LoadedModel, load_model  # noqa: E402
from gpu.runtime.runner import trunk_for  # noqa: E402
from wire.worker_options import KERNEL_MODES  # noqa: E402

BLOCK_SIZE = 16
TOKEN = 1000  # the id every decode row feeds (attention cost does not depend on it)


class Clock:
    """Milliseconds of one call: CUDA events on a GPU, ``perf_counter`` elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    def stats(self, fn: Callable[[], object], runs: int, warmup: int) -> dict[str, float]:
        for _ in range(warmup):
            fn()
        self.sync()
        times = [self.ms(fn) for _ in range(runs)]
        return {"min_ms": min(times), "median_ms": statistics.median(times)}


def copy_bandwidth(device: torch.device, mib: int, clock: Clock) -> float:
    """Bytes per second of a ``mib`` MiB device-to-device copy, read plus written."""
    n = mib * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = clock.stats(lambda: dst.copy_(src), runs=5, warmup=2)["min_ms"]
    return 2 * n / (best / 1e3)


def weight_bytes(lm: LoadedModel) -> int:
    """Every weight once (tied embeddings are the LM head too), in the loaded dtype."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in lm.model.parameters()}
    return sum(seen.values())


def decode_case(lm: LoadedModel, ops: Ops, batch: int, context: int, backend: Any,
                args: argparse.Namespace, clock: Clock) -> dict[str, Any]:  # fmt: skip
    """The three timings of one batch size, and how far graphs and eager agree."""
    per = -(-(context + 1) // BLOCK_SIZE)
    cache = PagedKVCache(
        lm.config, batch * per, BLOCK_SIZE, lm.device, lm.dtype, scratch=True, ops=ops
    )  # --kernels: the torch path's and the cache's alike
    trunk = trunk_for(lm.model, cache, ops)
    tables = [list(range(s * per, (s + 1) * per)) for s in range(batch)]
    decodes = [(t, context + 1) for t in tables]
    ids = [min(TOKEN, lm.config.vocab_size - 1)] * batch
    pos = [context] * batch
    ids_t = torch.tensor(ids, device=lm.device)
    pos_t = torch.tensor(pos, device=lm.device)

    def eager() -> torch.Tensor:
        cache.prepare(decodes, [])
        return lm.model.logits(trunk(ids_t, pos_t))  # type: ignore[return-value]

    # The engine's bound (the model's context): blocks pad to the next power of two.
    graphs = StepGraphs(lm.model, cache, trunk_for(lm.model, cache, ops, fuse=False), backend,
                        batch, lm.config.context_length)  # fmt: skip
    key = graphs.shape_for(decodes)
    assert key is not None, (batch, context)
    t = time.perf_counter()
    graphs.warm_up([key])
    capture_s = time.perf_counter() - t

    def graphed() -> torch.Tensor | None:
        return graphs.run(ids, pos, decodes)

    out: dict[str, Any] = {"batch": batch, "context": context, "shape": list(key)}
    out["capture_s"] = capture_s
    out["eager"] = clock.stats(eager, args.runs, args.warmup)
    out["graphs"] = clock.stats(graphed, args.runs, args.warmup)
    if backend.kind == "cuda_graph":
        replay = graphs.shapes[key].replay
        assert replay is not None
        graphed()  # the buffers now hold this step
        out["replay"] = clock.stats(replay, args.runs, args.warmup)
    a, b = eager().float(), graphed()
    assert b is not None
    clock.sync()
    out["max_abs_logit_diff"] = float((a - b).abs().max())
    out["logit_std"] = float(a.std())
    out["argmax_agree"] = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return out


def prefill_case(lm: LoadedModel, ops: Ops, n: int, args: argparse.Namespace, clock: Clock,
                 ) -> dict[str, Any]:  # fmt: skip
    ids = torch.randint(100, lm.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    ids, positions = ids.to(lm.device), torch.arange(n, device=lm.device)
    last = torch.tensor([n - 1], device=lm.device)
    blocks = -(-n // BLOCK_SIZE)
    cache = PagedKVCache(lm.config, blocks, BLOCK_SIZE, lm.device, lm.dtype, ops=ops)
    trunk = trunk_for(lm.model, cache, ops)
    chunk = PrefillChunk(list(range(blocks)), 0, n)

    def step() -> None:
        cache.prepare([], [chunk])
        lm.model.logits(trunk(ids, positions), last)

    s = clock.stats(step, max(2, args.runs // 2), args.warmup)
    return {"tokens": n, **s, "tokens_per_s": n / (s["min_ms"] / 1e3)}


def mixed_case(lm: LoadedModel, ops: Ops, decodes: int, context: int, chunk: int, backend: Any,
               args: argparse.Namespace, clock: Clock) -> dict[str, Any]:  # fmt: skip
    """One step of ``decodes`` decode rows and a ``chunk``-token prompt chunk, eager and
    piecewise, and how far the two agree."""
    per = -(-(context + 1) // BLOCK_SIZE)
    chunk_blocks = -(-chunk // BLOCK_SIZE)
    blocks = decodes * per + chunk_blocks
    cache = PagedKVCache(lm.config, blocks, BLOCK_SIZE, lm.device, lm.dtype, scratch=True,
                         ops=ops)  # fmt: skip
    trunk = trunk_for(lm.model, cache, ops)
    dec = [(list(range(s * per, (s + 1) * per)), context + 1) for s in range(decodes)]
    prefill = [PrefillChunk(list(range(decodes * per, blocks)), 0, chunk)]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(100, lm.config.vocab_size, (decodes + chunk,), generator=gen).tolist()
    pos = [context] * decodes + list(range(chunk))
    rows = [*range(decodes), decodes + chunk - 1]  # the decodes' and the chunk's last
    ids_t, pos_t = torch.tensor(ids, device=lm.device), torch.tensor(pos, device=lm.device)
    idx = torch.tensor(rows, device=lm.device)

    def eager() -> torch.Tensor:
        cache.prepare(dec, prefill)
        return lm.model.logits(trunk(ids_t, pos_t), idx)  # type: ignore[return-value]

    mixed = MixedGraphs(lm.model, cache, ops, backend, max(512, decodes + chunk))

    def piecewise() -> torch.Tensor:
        x = mixed.run(ids, pos, dec, prefill)
        assert x is not None
        return lm.model.logits(x, idx)

    t = time.perf_counter()
    piecewise()  # captures the size
    out: dict[str, Any] = {"decodes": decodes, "context": context, "chunk": chunk,
                           "capture_s": time.perf_counter() - t,
                           "size": mixed.size_for(decodes + chunk)}  # fmt: skip
    out["eager"] = clock.stats(eager, args.runs, args.warmup)
    out["piecewise"] = clock.stats(piecewise, args.runs, args.warmup)

    def layers() -> torch.Tensor:  # the pieces' own function: the model's torch path
        cache.prepare(dec, prefill)
        x = lm.model.run_layers(lm.model.embed_rows(ids_t), pos_t, cache, ops)
        return lm.model.logits(x, idx)  # type: ignore[return-value]

    # Eager is that path on a GPU; with quantized weights on the CPU it is the fused
    # trunk, another function (docs/determinism.md), so the check reads the torch path.
    a, b = layers().float(), piecewise().float()
    clock.sync()
    out["max_abs_logit_diff"] = float((a - b).abs().max())
    out["argmax_agree"] = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return out


def _floors(row: dict[str, Any], wbytes: int, kv_token: int, bw: float) -> None:
    kv = row["batch"] * (row["context"] + 1) * kv_token
    row["weight_bytes"], row["kv_bytes"] = wbytes, kv
    # What the captured shape gathers: its padded blocks' keys and values for every row.
    row["kv_bytes_graph_shape"] = row["shape"][0] * row["shape"][1] * BLOCK_SIZE * kv_token
    row["floor_w_ms"] = wbytes / bw * 1e3
    row["floor_wkv_ms"] = (wbytes + kv) / bw * 1e3
    for mode in ("eager", "graphs", "replay"):
        if mode in row:
            row[mode]["ratio_w"] = row[mode]["min_ms"] / row["floor_w_ms"]
            row[mode]["ratio_wkv"] = row[mode]["min_ms"] / row["floor_wkv_ms"]


def _print_table(res: dict[str, Any]) -> None:
    print(
        f"copy bandwidth {res['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (read + written); "
        f"weights {res['weight_bytes'] / 2**20:.1f} MiB {res['dtype']}: floor "
        f"{res['decode'][0]['floor_w_ms'] * 1e3:.1f} us per step"
    )
    print(f"{'batch':>5} {'mode':>7} {'min ms':>8} {'med ms':>8} {'tok/s':>9} "
          f"{'floor w':>8} {'x w':>6} {'floor w+kv':>10} {'x w+kv':>7}")  # fmt: skip
    for row in res["decode"]:
        for mode in ("eager", "graphs", "replay"):
            if mode not in row:
                continue
            m = row[mode]
            print(
                f"{row['batch']:>5} {mode:>7} {m['min_ms']:>8.3f} {m['median_ms']:>8.3f} "
                f"{row['batch'] / m['min_ms'] * 1e3:>9.0f} {row['floor_w_ms']:>8.3f} "
                f"{m['ratio_w']:>6.1f} {row['floor_wkv_ms']:>10.3f} {m['ratio_wkv']:>7.1f}"
            )
        print(
            f"{'':>5} graphs vs eager: shape {tuple(row['shape'])}, capture "
            f"{row['capture_s'] * 1e3:.0f} ms, max |logit diff| {row['max_abs_logit_diff']:.3g} "
            f"(logit std {row['logit_std']:.3g}), argmax agrees on "
            f"{row['argmax_agree'] * 100:.0f} % of rows"
        )
    p = res["prefill"]
    print(
        f"prefill {p['tokens']} tokens: min {p['min_ms']:.2f} ms, median {p['median_ms']:.2f} ms "
        f"= {p['tokens_per_s']:.0f} tok/s"
    )
    m = res["mixed"]
    print(f"mixed step: {m['decodes']} decodes + a {m['chunk']}-token chunk (padded to "
          f"{m['size']} rows, captured in {m['capture_s'] * 1e3:.0f} ms): eager min "
          f"{m['eager']['min_ms']:.2f} / median {m['eager']['median_ms']:.2f} ms, piecewise "
          f"min {m['piecewise']['min_ms']:.2f} / median {m['piecewise']['median_ms']:.2f} ms; "
          f"against the torch path: max |logit diff| {m['max_abs_logit_diff']:.3g}, argmax agrees on "
          f"{m['argmax_agree'] * 100:.0f} % of rows")  # fmt: skip


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return platform.machine()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF (default: the bundled model)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=256, help="tokens of context per sequence")
    p.add_argument("--prompt", type=int, default=512, help="prefill length")
    p.add_argument("--mixed-decodes", type=int, default=64, help="decode rows of the mixed step")
    p.add_argument("--mixed-chunk", type=int, default=192, help="its prompt chunk's tokens")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 20 GPU, 5 CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--copy-mib", type=int, default=None, help="default 2048 GPU, 256 CPU")
    p.add_argument(
        "--kernels",
        nargs="+",
        default=["torch"],
        choices=KERNEL_MODES,
        help="run everything with each: torch ops, fused Triton kernels",
    )
    p.add_argument("--json", default=None, help="write the figures here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    dev = lm.device
    cuda = dev.type == "cuda"
    args.runs = args.runs or (20 if cuda else 5)
    clock = Clock(dev)
    backend = CudaBackend(dev) if cuda else EagerBackend()
    res: dict[str, Any] = {
        "model": str(lm.path),
        "config": lm.config.name,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if cuda else _cpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "backend": backend.kind,
        "runs": args.runs,
        "load_s": time.perf_counter() - t0,
    }
    print(f"{lm.path.name} ({lm.config.name}) on {res['device_name']} ({dev}, "
          f"{res['dtype']}), torch {torch.__version__}, graphs: {backend.kind}")  # fmt: skip
    with torch.inference_mode():
        bw = copy_bandwidth(dev, args.copy_mib or (2048 if cuda else 256), clock)
        wbytes, kv_token = (
            weight_bytes(lm),
            kv_bytes_per_token(lm.config, lm.model.embed.element_size()),
        )
        res.update(bandwidth_bytes_per_s=bw, weight_bytes=wbytes, kv_bytes_per_token=kv_token)
        runs: dict[str, dict[str, Any]] = {}
        for kernels in args.kernels:
            ops = triton_ops(kernels, dev)
            run: dict[str, Any] = {}
            rows = []
            for b in args.batches:
                row = decode_case(lm, ops, b, args.context, backend, args, clock)
                _floors(row, wbytes, kv_token, bw)
                rows.append(row)
            run["decode"] = rows
            run["prefill"] = prefill_case(lm, ops, args.prompt, args, clock)
            run["mixed"] = mixed_case(lm, ops, args.mixed_decodes, args.context, args.mixed_chunk,
                                      backend, args, clock)  # fmt: skip
            runs[kernels] = run
    res.update(runs[args.kernels[0]])  # the first kernels' figures at the top, as before
    res["kernels"] = runs
    if cuda:
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
    for kernels, run in runs.items():
        print(f"\nkernels: {kernels}")
        _print_table({**res, **run})
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
