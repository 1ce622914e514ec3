"""Deterministic by default (issue 34): the same request gives the same tokens alone, with
its prefix cached and under load, on the default server.

    python bench/determinism.py                    # starts a default server (quantized weights)
    python bench/determinism.py --weights fp32     # the same with fp32 weights
    python bench/determinism.py --url http://127.0.0.1:30000   # a server already running
    python bench/determinism.py --prompts 4 --tokens 48        # the suite's reduced set

The acceptance set: 8 greedy prompts of 20-70 words, 96 new tokens each (``ignore_eos``),
run one at a time on a cold cache, then (a) again one at a time with their prefixes
cached, (b) all at once, cache flushed, while 8 sampled streams (temperature 0.8, other
prompts) run; a seeded ``n`` = 3 request at temperature 0.8 alone against under the same
load; one text's embedding alone against inside a batch of 16. Each case prints
"identical" or the first token where it parts, and a count. Exits 0 whatever it finds
(these are figures); non-zero only when something fails to run.
``tests/test_determinism_served.py`` asserts the same cases on a reduced set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.procs import ServerProcess, free_port, serve_argv  # noqa: E402

__all__ = [
    "EMBED_TEXTS",
    "GREEDY_PROMPTS",
    "LOAD_PROMPTS",
    "Case",
    "first_parting",
    "run_acceptance",
]

GREEDY_PROMPTS = [  # 20 to 70 words each
    "Write a short story about a lighthouse keeper who finds a message in a bottle that was "
    "written by her own grandmother fifty years ago.",
    "Explain to a ten year old why the sky is blue during the day but turns orange and red "
    "at sunset, using a simple example they could try at home with a glass of water and a "
    "torch.",
    "List the main steps to bake a loaf of bread at home, from mixing the flour and yeast to "
    "letting it cool, and say which step beginners most often get wrong.",
    "The old train station had been closed for twenty years when the town council decided "
    "to turn it into a library. On the first morning after the opening, the librarian "
    "noticed that",
    "Describe the water cycle in a few sentences: evaporation, condensation, precipitation "
    "and collection, and explain how mountains change where the rain falls and why deserts "
    "often lie on one side of a range.",
    "A farmer has chickens and cows. Together they have thirty heads and seventy four legs. "
    "Work out step by step how many chickens and how many cows the farmer has, and check "
    "the answer.",
    "Give three pieces of advice to someone starting their first job as a software engineer "
    "in a small team, covering code review, asking questions, and how to estimate how long "
    "a task will take, with one concrete example for each piece of advice so that the "
    "advice is easy to follow during the first few weeks.",
    "Summarise the plot of a detective novel in which the detective slowly realises that "
    "the person who hired her is the one who committed the crime.",
]

LOAD_PROMPTS = [
    "Tell me a joke about a cat and a computer.",
    "What are the benefits of drinking water every day?",
    "Write a poem about autumn leaves falling in a quiet park.",
    "How do airplanes stay in the air? Explain lift simply.",
    "Invent a new board game and describe its rules.",
    "What would you pack for a week of hiking in the mountains?",
    "Describe a city in the year 2200 from the point of view of a tourist.",
    "Why do people enjoy listening to music? Give a few reasons.",
]

EMBED_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "Paris is the capital and most populous city of France.",
    "Photosynthesis converts light energy into chemical energy.",
    "She sells sea shells by the sea shore.",
    "The mitochondria is the powerhouse of the cell.",
    "In the beginning was the word.",
    "Deterministic outputs make every request reproducible from its trace.",
    "Rain is expected tomorrow afternoon with strong winds from the west.",
    "The committee will meet again next Thursday to review the budget.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "He played the violin every evening after dinner.",
    "Large language models predict the next token from the previous ones.",
    "The museum opens at nine and closes at five on weekdays.",
    "Bring a warm jacket, the nights in the desert are cold.",
    "Every prime number greater than two is odd.",
]
EMBED_TARGET = 6  # the text embedded alone, at this index in the batch of 16

SAMPLED_LOAD = {"temperature": 0.8, "max_new_tokens": 48, "ignore_eos": True}
SEED = 1234


def first_parting(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first index where ``a`` and ``b`` differ (their common length when one is a
    prefix of the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(slots=True)
class Case:
    """One comparison: each item's first parting index (None: identical)."""

    name: str
    parted: list[int | None] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    note: str = ""
    cached_tokens: list[int] = field(default_factory=list)  # of the repeats, when cached

    def add(self, label: str, want: Sequence[Any], got: Sequence[Any]) -> None:
        self.labels.append(label)
        self.parted.append(first_parting(want, got))

    @property
    def identical(self) -> int:
        return sum(p is None for p in self.parted)

    @property
    def ok(self) -> bool:
        return self.identical == len(self.parted)

    def lines(self) -> list[str]:
        out = [f"{self.name}: {self.identical}/{len(self.parted)} identical" + self.note]
        for label, p in zip(self.labels, self.parted, strict=True):
            out.append(f"  {label}: " + ("identical" if p is None else f"parts at {p}"))
        return out


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
    r = await client.post(path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:500]}")
    return r.json()


async def _flush(client: httpx.AsyncClient) -> None:
    r = await client.post("/flush_cache")
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache answered {r.status_code}: {r.text[:500]}")


def _greedy(tokens: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}


def _seeded(tokens: int) -> dict[str, Any]:
    return {"temperature": 0.8, "n": 3, "seed": SEED, "max_new_tokens": tokens, "ignore_eos": True}


async def _generate(
    client: httpx.AsyncClient, text: str, sampling: dict[str, Any]
) -> list[dict[str, Any]]:
    """``/generate`` on one text: its answers (n of them), each with ``output_ids``."""
    out = await _post(client, "/generate", {"text": text, "sampling_params": sampling})
    return out if isinstance(out, list) else [out]


async def _stream_forever(client: httpx.AsyncClient, text: str, started: anyio.Event) -> None:
    """One sampled stream after another on ``text`` until cancelled."""
    body = {"text": text, "sampling_params": SAMPLED_LOAD, "stream": True}
    while True:
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"load stream answered {r.status_code}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    started.set()


@asynccontextmanager
async def _load(client: httpx.AsyncClient, streams: int) -> AsyncIterator[None]:
    """``streams`` sampled streams decoding on other prompts for as long as the block runs."""
    async with anyio.create_task_group() as tg:
        started = [anyio.Event() for _ in range(streams)]
        for i in range(streams):
            tg.start_soon(_stream_forever, client, LOAD_PROMPTS[i % len(LOAD_PROMPTS)], started[i])
        for ev in started:  # every stream is past its prefill before the measured requests go
            await ev.wait()
        yield
        tg.cancel_scope.cancel()


async def _all(calls: Sequence[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Run the calls at once; their results in order."""
    results: list[Any] = [None] * len(calls)

    async def one(i: int) -> None:
        results[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return results


async def _embed(client: httpx.AsyncClient, texts: list[str]) -> list[list[float]]:
    out = await _post(client, "/v1/embeddings", {"input": texts})
    return [d["embedding"] for d in sorted(out["data"], key=lambda d: d["index"])]


async def acceptance(
    url: str,
    prompts: int = 8,
    tokens: int = 96,
    streams: int = 8,
    log: Callable[[str], None] = print,
) -> list[Case]:
    """The acceptance cases against the server at ``url``, on the first ``prompts`` greedy
    prompts with ``tokens`` new tokens each; ``log`` hears of each phase."""
    texts = GREEDY_PROMPTS[:prompts]
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def timed(name: str, work: Awaitable[Any]) -> Any:
            t0 = time.monotonic()
            out = await work
            log(f"{name}: {time.monotonic() - t0:.1f} s")
            return out

        async def each(sampling: dict[str, Any]) -> list[dict[str, Any]]:
            return [(await _generate(client, t, sampling))[0] for t in texts]

        async def loaded(work: Callable[[], Awaitable[Any]]) -> Any:
            await _flush(client)  # what differs is the batch, not the cache
            async with _load(client, streams):
                return await work()

        greedy, seeded = _greedy(tokens), _seeded(tokens)
        await _flush(client)
        alone = await timed("greedy alone", each(greedy))
        again = await timed("greedy repeated", each(greedy))
        under = await timed(
            "greedy under load",
            loaded(lambda: _all([partial(_generate, client, t, greedy) for t in texts])),
        )
        await _flush(client)
        seeded_alone = await timed("seeded n=3 alone", _generate(client, texts[0], seeded))
        seeded_under = await timed(
            "seeded n=3 under load", loaded(lambda: _generate(client, texts[0], seeded))
        )
        await _flush(client)
        emb_alone = (await _embed(client, [EMBED_TEXTS[EMBED_TARGET]]))[0]
        await _flush(client)
        emb_batch = (await _embed(client, EMBED_TEXTS))[EMBED_TARGET]

    cached = [a["meta_info"].get("cached_tokens", 0) for a in again]
    cases = [
        Case(
            "greedy repeated (cache warm)", note=f"; cached_tokens {cached}", cached_tokens=cached
        ),
        Case(f"greedy under load ({streams} sampled streams)"),
        Case(f"seeded n=3 T=0.8 under load ({streams} sampled streams)"),
        Case("embedding alone vs in a batch of 16"),
    ]
    for i, (a, b, c) in enumerate(zip(alone, again, under, strict=True)):
        cases[0].add(f"prompt {i}", a["output_ids"], b["output_ids"])
        cases[1].add(f"prompt {i}", a["output_ids"], c[0]["output_ids"])
    for k, (a, b) in enumerate(zip(seeded_alone, seeded_under, strict=True)):
        cases[2].add(f"sample {k} (seed {SEED}+{k})", a["output_ids"], b["output_ids"])
    cases[3].add(f"text {EMBED_TARGET} (component index)", emb_alone, emb_batch)
    diff = max(abs(x - y) for x, y in zip(emb_alone, emb_batch, strict=True))
    cases[3].note = f"; max |difference| {diff:.3g}"
    return cases


def run_acceptance(url: str, **kw: Any) -> list[Case]:
    return anyio.run(lambda: acceptance(url, **kw))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="a running server; without it one is started")
    p.add_argument("--weights", help="the started server's --weights (default: its default)")
    p.add_argument("--prompts", type=int, default=8, choices=range(1, len(GREEDY_PROMPTS) + 1))
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--streams", type=int, default=8, help="sampled streams for 'under load'")
    args = p.parse_args()
    srv = None
    url = args.url
    if url is None:
        port = free_port()
        flags = {} if args.weights is None else {"weights": args.weights}
        srv = ServerProcess.start(
            "determinism", serve_argv(port, scripted=False, **flags), port, "/health",
            timeout_s=600, cwd=ROOT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
    weights = args.weights or "default"
    print(
        f"{args.prompts} greedy prompts x {args.tokens} tokens, {args.streams} sampled streams, "
        f"weights {weights}; {os.cpu_count()} CPUs, Python {sys.version.split()[0]}"
    )
    t0 = time.monotonic()
    try:
        cases = run_acceptance(
            url, prompts=args.prompts, tokens=args.tokens, streams=args.streams,
            log=lambda s: print("  " + s, flush=True),
        )  # fmt: skip
    finally:
        if srv is not None:
            srv.stop()
    for case in cases:
        print("\n".join(case.lines()))
    held = sum(c.ok for c in cases)
    print(f"{held}/{len(cases)} cases identical; {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
