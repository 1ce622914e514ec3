"""The q8_0 and q4_0 KV caches against the fp16 one on the bundled model, side by side in
one run.

    python bench/kv_q8.py [--tokens 4096] [--decode 48] [--threads N] [--model GGUF]
                          [--weights auto,fp32]

For each ``--weights`` mode (default both: ``auto``, the quantized weights the worker
serves on the fused native trunk, then ``fp32``, dequantized weights on the torch path,
where no matmul rounds its input to int8), prints, for ``--kv-cache-dtype fp16`` (what
``auto`` stores for quantized weights on the CPU), ``q8_0`` and ``q4_0``:

- bytes per token (K and V of every layer as stored) and their ratio;
- teacher-forced top-1 agreement: the same ``--tokens`` tokens of real text (this
  repository's README and docs, prose lines) prefilled through each cache in chunks of
  256, every position's argmax compared; beside it the same for an fp32 cache against
  fp16 (what rounding K and V at all costs on this model: with quantized weights the
  int8-rounded activations turn any change into another near-tie somewhere, so this is
  the floor of every cache there; with fp32 weights it is almost 1), and each cache's
  top-1 accuracy on the text's own next token;
- decode ms/token at that context: one sequence continuing from the prefilled text, one
  token a step, the caches' steps timed in turn (A B C A B C) so drift falls on all;
  the median of each.

Each mode runs the trunk the worker runs for it (``trunk_for``): the fused native trunk
for quantized weights, the torch path for fp32 ones; q8_0 and q4_0 rows are rotated and
quantized by the kernels' one writer either way. About four minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# As the worker does (gpu/worker/process.py): bounded OpenMP spin, big temporaries kept in the heap.
from gpu.kernels.cpu_runtime import tune_cpu_runtime  # noqa: E402

tune_cpu_runtime()

import torch  # noqa: E402

from bench.cpu_steal import steal_share, steal_ticks  # noqa: E402
from gpu.cache.kv_cache import PagedKVCache, PrefillChunk, kv_storage_dtype  # noqa: E402
from gpu.model.loader import LoadedModel, load_model  # noqa: E402
from gpu.runtime.runner import NativeTrunk, Trunk, trunk_for  # noqa: E402
from modelfile.vocab import load_tokenizer  # noqa: E402

BLOCK = 16
CHUNK = 256
KINDS = ("fp16", "q8_0", "q4_0")  # timed A B C; fp32 is only prefilled (agreement's baseline)
QUANT = KINDS[1:]


def real_text_ids(path: Path, n: int) -> list[int]:
    """``n`` tokens of this repository's prose (README, docs/*.md; no tables or code)."""
    tok, _, _ = load_tokenizer(path)
    lines: list[str] = []
    fenced = False
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in f.read_text(encoding="utf-8").splitlines():
            fenced ^= line.startswith("```")
            if not fenced and line.strip() and not line.lstrip().startswith(("|", "```")):
                lines.append(line)
    ids = tok.encode("\n".join(lines), add_special_tokens=False)
    if len(ids) < n:
        raise SystemExit(f"only {len(ids)} tokens of text, {n} asked")
    return ids[:n]


class Run:
    """One cache (``--kv-cache-dtype kind``) and its trunk, holding one sequence."""

    def __init__(self, lm: LoadedModel, kind: str, tokens: int) -> None:
        kv = kv_storage_dtype(kind, lm.device, lm.dtype, lm.model.quantized())
        blocks = -(-tokens // BLOCK)
        self.cache = PagedKVCache(lm.config, blocks, BLOCK, lm.device, lm.dtype, kv_dtype=kv)
        self.trunk: Trunk = trunk_for(lm.model, self.cache)
        # the fused trunk for quantized weights, for every cache; else the torch path
        assert isinstance(self.trunk, NativeTrunk) == lm.model.quantized()
        self.lm, self.table, self.len = lm, list(range(blocks)), 0

    def prefill(self, ids: list[int]) -> list[int]:
        """Every position's argmax over ``ids``, fed in chunks of CHUNK."""
        out: list[int] = []
        for at in range(0, len(ids), CHUNK):
            part = ids[at : at + CHUNK]
            self.cache.prepare([], [PrefillChunk(self.table, self.len, len(part))])
            x = self.trunk(torch.tensor(part), torch.arange(self.len, self.len + len(part)))
            out += self.lm.model.logits(x).argmax(-1).tolist()  # type: ignore[union-attr]
            self.len += len(part)
        return out

    def decode(self, token: int) -> tuple[int, float]:
        """One decode step of ``token``: its argmax and the step's ms."""
        t = time.perf_counter()
        self.cache.prepare([(self.table, self.len + 1)], [])
        x = self.trunk(torch.tensor([token]), torch.tensor([self.len]))
        nxt = int(self.lm.model.logits(x).argmax(-1))  # type: ignore[union-attr]
        self.len += 1
        return nxt, (time.perf_counter() - t) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="teacher-forced context")
    p.add_argument("--decode", type=int, default=96, help="decode steps timed per cache")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--weights", default="auto,fp32", help="weight modes, in turn")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    for weights in a.weights.split(","):
        report(a, weights)
        print()


def report(a: argparse.Namespace, weights: str) -> None:
    """The figures of one weight mode."""
    lm = load_model(a.model, device="cpu", weights=weights)
    ids = real_text_ids(lm.path, a.tokens)
    runs = {k: Run(lm, k, a.tokens + a.decode + 1) for k in (*KINDS, "fp32")}
    trunk = "fused native trunk" if lm.model.quantized() else "torch path"
    print(f"{lm.path.name}, --weights {weights} ({trunk}): {a.tokens} tokens of README + "
          f"docs, torch threads {torch.get_num_threads()}, block {BLOCK}")  # fmt: skip
    start = steal_ticks()
    with torch.inference_mode():
        t = time.perf_counter()
        argmax = {k: r.prefill(ids) for k, r in runs.items()}
        prefill_s = time.perf_counter() - t
        del runs["fp32"]
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        nxt = {k: ids[-1] for k in KINDS}
        for _ in range(a.decode):  # A B C A B C: all see the same machine
            for k in KINDS:
                nxt[k], ms = runs[k].decode(nxt[k])
                times[k].append(ms)
    bpt = {k: r.cache.bytes_per_token() for k, r in runs.items()}

    def agree(x: str, y: str) -> str:
        same = sum(i == j for i, j in zip(argmax[x], argmax[y], strict=True))
        return f"{same}/{len(ids)} = {same / len(ids):.4f}"

    def truth(k: str) -> str:
        hits = sum(i == j for i, j in zip(argmax[k][:-1], ids[1:], strict=True))
        return f"{hits / (len(ids) - 1):.4f}"

    ms = {k: statistics.median(v[2:]) for k, v in times.items()}  # the first two warm up
    print(f"{'':28}{'fp16':>14}" + "".join(f"{k:>14}" for k in QUANT)
          + "".join(f"{k + ' / fp16':>14}" for k in QUANT))  # fmt: skip
    print(f"{'bytes per token':28}" + "".join(f"{bpt[k]:>14,}" for k in KINDS)
          + "".join(f"{bpt[k] / bpt['fp16']:>13.4f}x" for k in QUANT))  # fmt: skip
    print(f"{'decode ms/token at ' + str(a.tokens):28}" + "".join(f"{ms[k]:>14.2f}" for k in KINDS)
          + "".join(f"{ms[k] / ms['fp16']:>13.3f}x" for k in QUANT))  # fmt: skip
    print("teacher-forced top-1 agreement, " + "; ".join(
        f"{k} vs fp16: {agree(k, 'fp16')}" for k in QUANT) + f"; fp32 vs fp16: {agree('fp32', 'fp16')}; "
        + "; ".join(f"{k} vs fp32: {agree(k, 'fp32')}" for k in QUANT))  # fmt: skip
    print(f"top-1 = the text's next token: fp32 {truth('fp32')}, fp16 {truth('fp16')}, "
          + ", ".join(f"{k} {truth(k)}" for k in QUANT))  # fmt: skip
    print(f"(prefill of the four {prefill_s:.1f} s; steal "
          f"{100 * steal_share(start, steal_ticks()):.1f} %; decode p10-p90 fp16 "
          f"{_spread(times['fp16'])}, " + ", ".join(f"{k} {_spread(times[k])}" for k in QUANT)
          + ")")  # fmt: skip


def _spread(v: list[float]) -> str:
    q = statistics.quantiles(v[2:], n=10)
    return f"{q[0]:.2f}-{q[-1]:.2f} ms"


if __name__ == "__main__":
    main()
