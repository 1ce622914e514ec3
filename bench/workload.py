"""Prompts for the load generator: synthetic text, random token ids, or a JSONL file.

Nothing is downloaded. Synthetic text is built from common English words that are each
one token in SmolLM2's byte-level BPE vocabulary (every word below exists there as a
single ``Ġword`` entry), so a prompt of n words is about n tokens; ``prompt_len`` is that
nominal count, as ``bench_serving`` counts its random dataset. Each prompt is drawn
independently, so no two requests share a long prefix a prefix cache could reuse.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "WORDS",
    "Prompt",
    "WorkloadConfig",
    "load_jsonl",
    "make_workload",
    "random_lengths",
    "total_tokens",
]

WORDS: tuple[str, ...] = tuple(
    """the of and to in is was for on that with as by at from his her it an are were which be
    this had not but they have one their has been who its also first after he two new or other
    more into all she time can only would when most there about over three up out school some
    many between during than later may world what used year people city him these under years
    then made state both such while where before part through however well known university
    national four since area work being team life them second de american war name game
    including could each season so did south film united history north family like series use
    high early album music found any those member public number will government held best until
    against same several small around""".split()
)

# SmolLM2's special tokens occupy ids 0..16; random-id prompts stay clear of them.
_FIRST_PLAIN_ID = 17
_VOCAB_SIZE = 49152


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's input: text or token ids, its token count, the tokens to generate."""

    prompt: str | tuple[int, ...]
    prompt_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Which prompts to make. ``range_ratio`` 1.0 fixes every length at its nominal value;
    below 1.0 each length is uniform in [ratio * len, len] (``bench_serving``'s rule)."""

    kind: str = "text"  # "text" | "ids" | "jsonl"
    num_requests: int = 64
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 1.0
    seed: int = 1
    path: str | None = None
    vocab_size: int = _VOCAB_SIZE


def random_lengths(full_len: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """n lengths uniform in [max(1, full_len * range_ratio), full_len]."""
    lo = max(int(full_len * range_ratio), 1)
    hi = max(full_len, lo)
    return [rng.randint(lo, hi) for _ in range(n)]


def _text_prompt(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=n_words))


def _ids_prompt(n_ids: int, vocab_size: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(_FIRST_PLAIN_ID, vocab_size) for _ in range(n_ids))


def load_jsonl(path: str | Path, default_output_len: int) -> list[Prompt]:
    """Rows of ``{"prompt": str | [int], "output_len"?: int, "prompt_len"?: int}``.

    A text prompt without ``prompt_len`` counts one token per whitespace-separated word,
    a rough figure: give ``prompt_len`` where input throughput matters."""
    rows: list[Prompt] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        prompt = obj.get("prompt")
        if isinstance(prompt, list) and all(isinstance(x, int) for x in prompt):
            value: str | tuple[int, ...] = tuple(prompt)
            n = len(prompt)
        elif isinstance(prompt, str):
            value, n = prompt, len(prompt.split())
        else:
            raise ValueError(f"{path}:{lineno}: 'prompt' must be a string or a list of ints")
        rows.append(
            Prompt(
                prompt=value,
                prompt_len=int(obj.get("prompt_len", n)),
                output_len=int(obj.get("output_len", default_output_len)),
            )
        )
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def make_workload(cfg: WorkloadConfig) -> list[Prompt]:
    """``cfg.num_requests`` prompts (a JSONL file is cycled if it has fewer rows)."""
    rng = random.Random(cfg.seed)
    if cfg.kind == "jsonl":
        if not cfg.path:
            raise ValueError("the jsonl workload needs a path")
        rows = load_jsonl(cfg.path, cfg.output_len)
        return [rows[i % len(rows)] for i in range(cfg.num_requests)]
    in_lens = random_lengths(cfg.input_len, cfg.range_ratio, cfg.num_requests, rng)
    out_lens = random_lengths(cfg.output_len, cfg.range_ratio, cfg.num_requests, rng)
    if cfg.kind == "text":
        return [Prompt(_text_prompt(i, rng), i, o) for i, o in zip(in_lens, out_lens, strict=True)]
    if cfg.kind == "ids":
        return [
            Prompt(_ids_prompt(i, cfg.vocab_size, rng), i, o)
            for i, o in zip(in_lens, out_lens, strict=True)
        ]
    raise ValueError(f"unknown workload kind {cfg.kind!r} (text, ids, jsonl)")


def total_tokens(prompts: Sequence[Prompt]) -> tuple[int, int]:
    """Nominal (input, output) token totals of a workload."""
    return sum(p.prompt_len for p in prompts), sum(p.output_len for p in prompts)
