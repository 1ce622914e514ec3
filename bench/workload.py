"""Prompts for the load generator: synthetic text, random token ids, a JSONL file, or
input-grounded requests whose answers copy the prompt.

Nothing is downloaded. Synthetic text is built from common English words that are each
one token in SmolLM2's byte-level BPE vocabulary (every word below exists there as a
single ``Ġword`` entry), so a prompt of n words is about n tokens; ``prompt_len`` is that
nominal count, as ``bench_serving`` counts its random dataset. Each prompt is drawn
independently, so no two requests share a long prefix a prefix cache could reuse.

``grounded`` prompts are the requests agents and editors send, whose answers copy long
spans of the prompt (what prompt-lookup speculation turns into several tokens a step):
rename one identifier in a Python function, correct one misspelled word in a paragraph,
or repeat a function or a paragraph word for word. The passages are this repository's
own sources (``lifecycle/``, ``transport/``, ``wire/``, ``modelfile/``) and the
paragraphs of ``docs/*.md``, chosen by the seed; each fits the output length (the answer
restates it). They are the user's turn of a chat: ``chat_wrapped`` renders them with a
model's chat template for the APIs that take a prompt (``/generate``, completions).
"""

from __future__ import annotations

import ast
import functools
import json
import random
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GROUNDED_TASKS",
    "WORDS",
    "Passage",
    "Prompt",
    "WorkloadConfig",
    "chat_wrapped",
    "grounded_prompts",
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

    kind: str = "text"  # "text" | "ids" | "jsonl" | "grounded"
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
    if cfg.kind == "grounded":
        return grounded_prompts(cfg.num_requests, cfg.output_len, cfg.seed)
    in_lens = random_lengths(cfg.input_len, cfg.range_ratio, cfg.num_requests, rng)
    out_lens = random_lengths(cfg.output_len, cfg.range_ratio, cfg.num_requests, rng)
    if cfg.kind == "text":
        return [Prompt(_text_prompt(i, rng), i, o) for i, o in zip(in_lens, out_lens, strict=True)]
    if cfg.kind == "ids":
        return [
            Prompt(_ids_prompt(i, cfg.vocab_size, rng), i, o)
            for i, o in zip(in_lens, out_lens, strict=True)
        ]
    raise ValueError(f"unknown workload kind {cfg.kind!r} (text, ids, jsonl, grounded)")


def total_tokens(prompts: Sequence[Prompt]) -> tuple[int, int]:
    """Nominal (input, output) token totals of a workload."""
    return sum(p.prompt_len for p in prompts), sum(p.output_len for p in prompts)


# --- grounded: answers that copy the prompt ------------------------------------------

_ROOT = Path(__file__).resolve().parent.parent
_SOURCE_DIRS = ("lifecycle", "transport", "wire", "modelfile")
# Characters per token of SmolLM2's byte-level BPE on these passages: median 3.5, tenth
# percentile 2.9 (code and docs alike). 3.0 keeps nearly every restated passage inside
# the output length.
_CHARS_PER_TOKEN = 3.0
# A passage fills at most the upper share of the output length (the rest is room for
# the answer's fence or sentence around it) and at least the lower share.
_FILL = (0.35, 0.85)
GROUNDED_TASKS = ("rename", "fix_word", "repeat_code", "repeat_prose")
_NOT_PROSE = re.compile(r"\s|[#|>*<!\[-]|\d+\.")
_TYPO_WORD = re.compile(r"\b[a-z]{6,}\b")
_CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True, slots=True)
class Passage:
    """A piece of this repository that a grounded prompt quotes: a Python function, with
    the names bound in it that occur at least twice (what a rename may pick), or a docs
    paragraph joined into one line."""

    text: str
    names: tuple[str, ...] = ()
    source: str = ""


def _bound_names(fn: ast.FunctionDef | ast.AsyncFunctionDef, text: str) -> tuple[str, ...]:
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
    names = {p.arg for p in params} | {
        n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    names -= {"self", "cls"}
    return tuple(
        sorted(n for n in names if len(n) >= 3 and len(re.findall(rf"\b{n}\b", text)) >= 2)
    )


@functools.cache
def _functions(root: Path) -> tuple[Passage, ...]:
    """Every function and method of the source folders, dedented, in file order."""
    out: list[Passage] = []
    for folder in _SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            src = path.read_text(encoding="utf-8")
            try:
                tree = ast.parse(src)
            except SyntaxError:
                continue  # a file being edited: the rest still serve
            lines = src.splitlines()
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                    text = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    out.append(Passage(text, _bound_names(node, text), where))
    return tuple(out)


@functools.cache
def _paragraphs(root: Path) -> tuple[Passage, ...]:
    """The plain paragraphs of ``docs/*.md``: no headings, lists, tables, quotes or code."""
    out: list[Passage] = []
    for path in sorted((root / "docs").glob("*.md")):
        fenced, block = False, list[str]()
        for i, line in enumerate([*path.read_text(encoding="utf-8").splitlines(), ""], 1):
            if line.startswith("```"):
                fenced, block = not fenced, []
            elif not fenced and line.strip():
                block.append(line)
            elif block:
                if not any(_NOT_PROSE.match(b) for b in block):
                    text = " ".join(b.strip() for b in block)
                    out.append(Passage(text, source=f"{path.relative_to(root)}:{i - len(block)}"))
                block = []
    return tuple(out)


def _renamed(name: str) -> str:
    head, *rest = name.strip("_").split("_")
    return head + "".join(w.title() for w in rest) if rest else f"new_{name}"


def _with_typo(text: str, rng: random.Random) -> tuple[str, str, str]:
    """(the text with one word misspelled, the misspelling, the word): two inner letters
    of one word of six or more letters swapped, at its first occurrence."""
    words = [w for w in dict.fromkeys(_TYPO_WORD.findall(text)) if w[2] != w[3]]
    word = rng.choice(words)
    typo = word[:2] + word[3] + word[2] + word[4:]
    return re.sub(rf"\b{word}\b", typo, text, count=1), typo, word


def _task_prompt(task: str, p: Passage, rng: random.Random) -> str:
    if task == "rename":
        old = rng.choice(p.names)
        return (
            f"Rename the variable `{old}` to `{_renamed(old)}` in this Python function. "
            "Reply with the whole function, changed only there, and nothing else.\n\n"
            f"```python\n{p.text}\n```"
        )
    if task == "fix_word":
        text, typo, word = _with_typo(p.text, rng)
        return (
            f'The paragraph below misspells one word: "{typo}" should be "{word}". Write '
            "the paragraph again with that word corrected and every other word unchanged. "
            f"Reply with the paragraph only.\n\n{text}"
        )
    if task == "repeat_code":
        return (
            "Repeat the following Python code exactly as it is, with nothing before or "
            f"after it.\n\n```python\n{p.text}\n```"
        )
    return f"Repeat the following text word for word.\n\n{p.text}"


def _task_pool(task: str, output_len: int, root: Path) -> list[Passage]:
    lo, hi = (f * output_len * _CHARS_PER_TOKEN for f in _FILL)
    code = task in ("rename", "repeat_code")
    pool = [p for p in (_functions(root) if code else _paragraphs(root)) if lo <= len(p.text) <= hi]
    if task == "rename":
        pool = [p for p in pool if p.names]
    elif task == "fix_word":
        pool = [p for p in pool if any(w[2] != w[3] for w in _TYPO_WORD.findall(p.text))]
    if not pool:
        raise ValueError(f"no {task} passage fits an output of {output_len} tokens (use >= 64)")
    return pool


def grounded_prompts(
    num_requests: int, output_len: int, seed: int, root: Path = _ROOT
) -> list[Prompt]:
    """``num_requests`` user turns, the tasks of ``GROUNDED_TASKS`` in turn, each passage
    drawn by ``seed`` without repetition until its pool is spent. ``prompt_len`` is
    estimated from the characters (``chat_wrapped`` counts the tokens)."""
    rng = random.Random(seed)
    decks: dict[str, list[Passage]] = {}
    out: list[Prompt] = []
    for i in range(num_requests):
        task = GROUNDED_TASKS[i % len(GROUNDED_TASKS)]
        if not decks.get(task):
            pool = _task_pool(task, output_len, root)
            decks[task] = rng.sample(pool, len(pool))
        text = _task_prompt(task, decks[task].pop(), rng)
        out.append(Prompt(text, round(len(text) / _CHARS_PER_TOKEN), output_len))
    return out


def chat_wrapped(prompts: Sequence[Prompt], model: str | None = None) -> list[Prompt]:
    """Each text prompt as the user's turn of ``model``'s chat template (a GGUF file or a
    Hugging Face folder; None: the bundled SmolLM2), with the generation prompt, as the
    server renders a chat request; ``prompt_len`` counted by the model's tokenizer. For
    the APIs that take a prompt: a small instruct model follows an instruction only in
    its chat format. A model without a template (``tools/shaped_gguf.py`` writes none)
    gets ChatML, SmolLM2's and Qwen2.5's format."""
    from modelfile.vocab import load_tokenizer  # the grounded workload alone needs it

    tokenizer, chat, _ = load_tokenizer(model)
    out: list[Prompt] = []
    for p in prompts:
        if not isinstance(p.prompt, str):
            raise ValueError("only text prompts can be put in a chat template")
        turn = {"role": "user", "content": p.prompt}
        text = chat.render([turn]) if chat else _CHATML.format(p.prompt)
        n = len(tokenizer.encode(text, add_special_tokens=False))
        out.append(Prompt(text, n, p.output_len))
    return out
