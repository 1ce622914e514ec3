"""What constrained decoding costs the requests that share its batch.

Runs the worker's step engine in process on the default model, 32 sequences of 64
output tokens each (greedy, ``ignore_eos``), three ways in one run, alternating A B A B:

- A: all 32 unconstrained;
- B: 16 unconstrained + 16 constrained (8 regexes, 8 JSON schemas, each long enough that
  no grammar completes before 64 tokens, so the batch keeps its size);

and prints, per leg, the unconstrained sequences' output tokens/s per sequence (their
tokens over their count and the wall time until the last of them ended), the step time, and in B the grammar mask time
per step (the one parallel llguidance call that computes every constrained row's mask)
and the compile time of each distinct grammar. The CPU's steal share over each leg is
printed too (``/proc/stat``); a leg above 10 % is flagged as not comparable.

``python bench/structured.py [ROUNDS]`` (default 2 rounds of A B).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu.kernels.cpu_runtime import tune_cpu_runtime  # noqa: E402

tune_cpu_runtime()

from bench.cpu_steal import steal_share, steal_ticks  # noqa: E402
from gpu.model.loader import load_model  # noqa: E402
from gpu.runtime.engine import Engine, EngineConfig  # noqa: E402
from modelfile.gguf_file import default_model_path  # noqa: E402
from wire import SubmitEntry, ids_to_list, pack_ids  # noqa: E402

BATCH = 32
OUTPUT = 64
REGEXES = [r"[a-z ]{300}", r"([0-9]{3}, ){100}", r"(yes|no)( (yes|no)){150}", r"[A-Z][a-z]{400}"]
SCHEMAS = [
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 60},
    {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 40},
    {
        "type": "object",
        "properties": {
            "words": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 80}
        },
        "required": ["words"],
    },  # fmt: skip
    {"type": "array", "items": {"type": "boolean"}, "minItems": 60},
]


class _MaskTimer:
    """Wraps ``Grammars.masks`` to time each step's one mask call."""

    def __init__(self, engine: Engine) -> None:
        self.times: list[float] = []
        inner = engine.grammars.masks

        def timed(matchers):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = inner(matchers)
            self.times.append((time.perf_counter() - t0) * 1e3)
            return out

        engine.grammars.masks = timed  # type: ignore[method-assign]


def _grammars(k: int) -> list[list[str]]:
    out = []
    for i in range(k):
        if i % 2:
            out.append(["regex", REGEXES[(i // 2) % len(REGEXES)]])
        else:
            out.append(["json_schema", json.dumps(SCHEMAS[(i // 2) % len(SCHEMAS)])])
    return out


def run_leg(engine: Engine, prompts: list[list[int]], constrained: int, rid0: int) -> dict:
    grammars = _grammars(constrained)
    entries = []
    for i, p in enumerate(prompts):
        s = {"temperature": 0, "ignore_eos": True, "max_new_tokens": OUTPUT}
        if i < constrained:
            s["grammar"] = grammars[i]
        entries.append(SubmitEntry(rid0 + i, pack_ids(p), s, {}))
    free = {rid0 + i for i in range(constrained, len(prompts))}
    n_free = len(free)
    timer = _MaskTimer(engine) if constrained else None
    steal0 = steal_ticks()
    t0 = time.perf_counter()
    errors, _ = engine.submit(entries)
    assert not errors, errors
    free_tokens, steps, compile_ms, free_end = 0, [], {}, None
    while engine.has_work:
        s0 = time.perf_counter()
        out = engine.step()
        steps.append((time.perf_counter() - s0) * 1e3)
        for e in out:
            if e.rid in free:
                free_tokens += len(ids_to_list(e.new_ids))
                if e.finish is not None:
                    free.discard(e.rid)
                    if not free:
                        free_end = time.perf_counter()
            if e.extra and "grammar_compile_ms" in e.extra:
                compile_ms[e.rid] = e.extra["grammar_compile_ms"]
            if e.finish is not None and e.rid - rid0 < constrained:
                assert e.finish[0] == "length", ("a grammar completed early", e)
    steal1 = steal_ticks()
    if timer is not None:
        del engine.grammars.masks  # back to the class's method
    end = free_end or time.perf_counter()
    return {
        "free_tok_s": free_tokens / n_free / (end - t0),  # per sequence
        "step_ms": statistics.median(steps),
        "mask_ms": timer.times if timer else [],
        "compile_ms": list(compile_ms.values()),
        "steal": steal_share(steal0, steal1),
    }


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    lm = load_model(default_model_path(), device="cpu")
    engine = Engine(lm, EngineConfig(kv_blocks=2048, max_running=BATCH))
    tok = lm.tokenizer
    prompts = [tok.encode(f"Item {i}: write a long list of things, one after another.")
               for i in range(BATCH)]  # fmt: skip
    run_leg(engine, prompts[:4], 0, 10_000)  # warm-up: threads and caches
    engine.grammars.compile(("regex", "warm-up"))  # the tokenizer view (built once, ~0.3 s)
    legs: dict[str, list[dict]] = {"A all free": [], "B half constrained": []}
    rid = 20_000
    for _ in range(rounds):
        for name, k in (("A all free", 0), ("B half constrained", BATCH // 2)):
            legs[name].append(run_leg(engine, prompts, k, rid))
            rid += 1000
    print(f"batch {BATCH}, {OUTPUT} output tokens each, greedy; {rounds} rounds, A B A B")
    print(f"{'leg':22} {'tok/s/seq':>11} {'step ms p50':>12} {'steal':>7}")
    for name, runs in legs.items():
        for r in runs:
            flag = "  (steal > 10 %: not comparable)" if r["steal"] > 0.10 else ""
            print(f"{name:22} {r['free_tok_s']:11.1f} {r['step_ms']:12.1f} {r['steal']:7.1%}{flag}")
    a = statistics.median(r["free_tok_s"] for r in legs["A all free"])
    b = statistics.median(r["free_tok_s"] for r in legs["B half constrained"])
    print(f"unconstrained tokens/s, B / A: {b / a:.3f}")
    masks = [m for r in legs["B half constrained"] for m in r["mask_ms"]]
    qs = statistics.quantiles(masks, n=100)
    print(
        f"mask time per step (16 constrained rows, one call): mean {statistics.mean(masks):.2f} ms, "
        f"p50 {statistics.median(masks):.2f} ms, p99 {qs[98]:.2f} ms over {len(masks)} steps"
    )
    compiles = [c for r in legs["B half constrained"][:1] for c in r["compile_ms"]]
    print(
        f"first leg's grammar compile per request: max {max(compiles):.2f} ms (8 distinct sources)"
    )


if __name__ == "__main__":
    main()
