"""llguidance against xgrammar on the default model's tokenizer (issue 21, docs/structured.md).

For each library: the tokenizer build, then for the 20 JSON schemas, 10 regexes and the
EBNF grammar of ``tests/structured_cases.py`` the compile time (an ``LLMatcher``; a
``GrammarCompiler.compile_*`` call), the first mask, and the mask time per step over a
real walk: the case's example, tokenized as the frontend would, is fed one token at a
time with the mask computed before each token (and checked to allow it), then the stop
token. First-request latency is compile + first mask: llguidance builds much of its
lexer lazily, on the first mask, so compile time alone would flatter it.

    python bench/grammar_libs.py                        # both, if xgrammar is found
    python bench/grammar_libs.py --xgrammar-path DIR    # where xgrammar was installed

xgrammar is not a dependency and must not go into .venv. Install it beside it with
``.venv/bin/pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi``; the bench
puts ``--xgrammar-path`` (default ``$XGRAMMAR_PATH`` or /tmp/xg) on sys.path only when it
exists. xgrammar imports ``transformers`` at module level only for type checks and the
HF LogitsProcessor; without it installed, a stub module stands in (we never pass it an
HF tokenizer: its ``TokenizerInfo`` is built from the encoded vocabulary directly).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import llguidance  # noqa: E402
import llguidance.numpy as llg_np  # noqa: E402
from llguidance.gbnf_to_lark import gbnf_to_lark  # noqa: E402

from modelfile.config import config_from_gguf  # noqa: E402
from modelfile.gguf_file import default_model_path  # noqa: E402
from modelfile.gguf_meta import GGUFMetadata  # noqa: E402
from modelfile.tokenizer import Tokenizer, tokenizer_from_gguf  # noqa: E402
from tests.structured_cases import (  # noqa: E402
    EBNF_EXAMPLE,
    EBNF_GRAMMAR,
    REGEX_CASES,
    SCHEMA_CASES,
)

INSTALL_HINT = ".venv/bin/pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi"


@dataclass(frozen=True, slots=True)
class Case:
    kind: str  # "json", "regex" or "ebnf"
    name: str
    source: Any  # a schema dict, a regex, or EBNF text
    text: str  # a valid output

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}"  # names repeat across kinds ("phone")


@dataclass(slots=True)
class Walk:
    """One case walked by one library: times in ms."""

    compile_ms: float
    first_mask_ms: float
    mask_ms: list[float] = field(default_factory=list)
    consume_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Model:
    tok: Tokenizer
    vocab_size: int
    eog_ids: tuple[int, ...]


def cases() -> list[Case]:
    out = [Case("json", c.name, c.schema, json.dumps(c.example)) for c in SCHEMA_CASES]
    out += [Case("regex", c.name, c.pattern, c.example) for c in REGEX_CASES]
    out.append(Case("ebnf", "name_value", EBNF_GRAMMAR, EBNF_EXAMPLE))
    return out


def load_model() -> Model:
    f = GGUFMetadata(default_model_path())
    cfg = config_from_gguf(f, f.strings("tokenizer.ggml.tokens"))
    tok = tokenizer_from_gguf(f, eog_ids=cfg.eog_ids)
    return Model(tok, cfg.vocab_size, tuple(cfg.eog_ids))


def allowed(mask_row: np.ndarray, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t) * 1e3


# -- llguidance ------------------------------------------------------------------------


class Llg:
    name = "llguidance " + getattr(llguidance, "__version__", "")

    def __init__(self, m: Model) -> None:
        self.model = m
        self.tokenizer, self.tokenizer_ms = timed(
            lambda: llguidance.LLTokenizer(
                m.tok.backend.to_str(), n_vocab=m.vocab_size, eos_token=list(m.eog_ids)
            )
        )
        self.mask = llg_np.allocate_token_bitmask(1, m.vocab_size)

    @staticmethod
    def grammar(case: Case) -> str:
        M = llguidance.LLMatcher
        if case.kind == "json":
            return M.grammar_from_json_schema(case.source)
        if case.kind == "regex":
            return M.grammar_from_regex(case.source)
        return M.grammar_from_lark(gbnf_to_lark(case.source))

    def walk(self, case: Case, ids: Sequence[int]) -> Walk:
        matcher, compile_ms = timed(
            lambda: llguidance.LLMatcher(self.tokenizer, self.grammar(case))
        )
        if matcher.is_error():
            raise RuntimeError(f"llguidance {case.name}: {matcher.get_error()}")
        w = Walk(compile_ms, 0.0)
        for token in [*ids, self.model.eog_ids[0]]:
            _, ms = timed(lambda: llg_np.fill_next_token_bitmask(matcher, self.mask))
            w.mask_ms.append(ms)
            if not allowed(self.mask[0], token):
                raise RuntimeError(f"llguidance {case.name}: mask forbids token {token}")
            ok, ms = timed(partial(matcher.consume_token, token))
            w.consume_ms.append(ms)
            if not ok:
                raise RuntimeError(f"llguidance {case.name}: {matcher.get_error()}")
        if not matcher.is_stopped():
            raise RuntimeError(f"llguidance {case.name}: not stopped after the stop token")
        w.first_mask_ms = w.mask_ms[0]
        return w


# -- xgrammar --------------------------------------------------------------------------


def import_xgrammar(path: str) -> tuple[Any, float] | str:
    """The xgrammar module and its import time in ms, or why it could not be imported."""
    if Path(path).is_dir() and path not in sys.path:
        sys.path.append(path)
    try:
        import transformers  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        # xgrammar.tokenizer_info and xgrammar.contrib.hf import these names at module
        # level; we use neither HF path, so empty classes are enough.
        stub = types.ModuleType("transformers")
        for cls in ("PreTrainedTokenizerBase", "PreTrainedTokenizerFast", "LogitsProcessor"):
            setattr(stub, cls, type(cls, (), {}))
        sys.modules["transformers"] = stub
    t = time.perf_counter()
    try:
        import xgrammar  # type: ignore[import-not-found]
    except ImportError as e:
        return f"not installed ({e}; install with: {INSTALL_HINT})"
    except Exception as e:  # a broken install: say what broke
        return f"cannot be imported: {type(e).__name__}: {e}"
    return xgrammar, (time.perf_counter() - t) * 1e3


class Xgr:
    def __init__(self, xgr: Any, m: Model, threads: int) -> None:
        from importlib.metadata import version

        try:
            self.name = "xgrammar " + version("xgrammar")
        except Exception:
            self.name = "xgrammar"
        self.xgr = xgr
        self.model = m
        self.tokenizer_ms = 0.0

        def build() -> Any:
            vocab = [""] * m.vocab_size
            for text, i in m.tok.backend.get_vocab(with_added_tokens=True).items():
                if i < m.vocab_size:
                    vocab[i] = text
            # What TokenizerInfo.from_huggingface reads from the same tokenizer.json.
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(m.tok.backend.to_str())
            info = xgr.TokenizerInfo(
                vocab,
                meta["vocab_type"],
                vocab_size=m.vocab_size,
                stop_token_ids=list(m.eog_ids),
                add_prefix_space=meta["add_prefix_space"],
            )
            # No cache: each schema is compiled once, so a cache would only hide work
            # between the repeats.
            compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return info, compiler

        (self.info, self.compiler), self.tokenizer_ms = timed(build)
        self.mask = xgr.allocate_token_bitmask(1, m.vocab_size)

    def compile(self, case: Case) -> Any:
        if case.kind == "json":
            return self.compiler.compile_json_schema(json.dumps(case.source))
        if case.kind == "regex":
            return self.compiler.compile_regex(case.source)
        return self.compiler.compile_grammar(case.source)

    def walk(self, case: Case, ids: Sequence[int]) -> Walk:
        # The matcher's construction counts, as LLMatcher's does for llguidance.
        matcher, compile_ms = timed(lambda: self.xgr.GrammarMatcher(self.compile(case)))
        w = Walk(compile_ms, 0.0)
        for token in [*ids, self.model.eog_ids[0]]:
            _, ms = timed(lambda: matcher.fill_next_token_bitmask(self.mask))
            w.mask_ms.append(ms)
            if not allowed(self.mask[0].numpy(), token):
                raise RuntimeError(f"xgrammar {case.name}: mask forbids token {token}")
            ok, ms = timed(partial(matcher.accept_token, token))
            w.consume_ms.append(ms)
            if not ok:
                raise RuntimeError(f"xgrammar {case.name}: rejected token {token}")
        if not matcher.is_terminated():
            raise RuntimeError(f"xgrammar {case.name}: not terminated after the stop token")
        w.first_mask_ms = w.mask_ms[0]
        return w


# -- report ----------------------------------------------------------------------------


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run(lib: Any, all_cases: list[Case], ids: dict[str, list[int]], repeats: int) -> dict:
    """Per case, the walk of median first-request latency over ``repeats``."""
    out: dict[str, Walk] = {}
    for case in all_cases:
        walks = [lib.walk(case, ids[case.key]) for _ in range(repeats)]
        walks.sort(key=lambda w: w.compile_ms + w.first_mask_ms)
        out[case.key] = walks[len(walks) // 2]
    return out


def summary(walks: list[Walk]) -> dict[str, float]:
    first = [w.compile_ms + w.first_mask_ms for w in walks]
    compile_ = [w.compile_ms for w in walks]
    masks = [ms for w in walks for ms in w.mask_ms]
    consumes = [ms for w in walks for ms in w.consume_ms]
    return {
        "compile mean": statistics.fmean(compile_),
        "compile max": max(compile_),
        "first request mean": statistics.fmean(first),
        "first request p50": statistics.median(first),
        "first request max": max(first),
        "mask/step mean": statistics.fmean(masks),
        "mask/step p50": statistics.median(masks),
        "mask/step p99": pct(masks, 0.99),
        "consume/step mean": statistics.fmean(consumes),
    }


def print_report(libs: list[Any], results: list[dict], all_cases: list[Case], ids: dict) -> None:
    names = [lib.name for lib in libs]
    print(f"\n{'':28}" + "".join(f"{n:>24}" for n in names))
    print(f"{'tokenizer build ms':28}" + "".join(f"{lib.tokenizer_ms:24.1f}" for lib in libs))
    for kind, label in (("json", "20 JSON schemas"), ("regex", "10 regexes"), ("ebnf", "EBNF")):
        names_k = [c.key for c in all_cases if c.kind == kind]
        steps = sum(len(ids[n]) + 1 for n in names_k)
        print(f"\n{label} ({steps} mask steps), ms")
        sums = [summary([r[n] for n in names_k]) for r in results]
        for key in sums[0]:
            print(f"  {key:26}" + "".join(f"{s[key]:24.3f}" for s in sums))
    print("\nper JSON schema: tokens, then compile / first mask / mean mask ms per library")
    for c in all_cases:
        if c.kind != "json":
            continue
        cells = "".join(
            f"  {r[c.key].compile_ms:7.2f} {r[c.key].first_mask_ms:6.2f} "
            f"{statistics.fmean(r[c.key].mask_ms):6.3f}"
            for r in results
        )
        print(f"  {c.name:14}{len(ids[c.key]):4}{cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--xgrammar-path", default=os.environ.get("XGRAMMAR_PATH", "/tmp/xg"))
    ap.add_argument("--repeats", type=int, default=3, help="walks per case; the median is kept")
    ap.add_argument(
        "--xgrammar-threads", type=int, default=os.cpu_count() or 1, help="its compiler's pool"
    )
    args = ap.parse_args()

    m = load_model()
    all_cases = cases()
    ids = {c.key: m.tok.encode(c.text, add_special_tokens=False) for c in all_cases}
    libs: list[Any] = [Llg(m)]
    xgr = import_xgrammar(args.xgrammar_path)
    if isinstance(xgr, str):
        print(f"xgrammar: {xgr}")
    else:
        module, import_ms = xgr
        libs.append(Xgr(module, m, args.xgrammar_threads))
        print(f"xgrammar: imported from {module.__file__} in {import_ms:.0f} ms (torch included)")
        print(f"xgrammar: compiler threads {args.xgrammar_threads}")
    print(f"cpu: {os.cpu_count()} cores; vocab {m.vocab_size}; repeats {args.repeats}")
    results = [run(lib, all_cases, ids, args.repeats) for lib in libs]
    print_report(libs, results, all_cases, ids)


if __name__ == "__main__":
    main()
