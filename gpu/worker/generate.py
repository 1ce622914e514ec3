"""Offline greedy generation: ``python -m gpu.worker.generate "prompt" [--chat]``.

It runs the worker's own code, the step ``Engine`` on the paged KV cache, with one
request in memory (no socket): what it prints is what a server would generate for the
same greedy request.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator

from gpu.kernels.cpu_runtime import tune_cpu_runtime

tune_cpu_runtime()  # before torch is imported (gpu.runtime.engine imports it)

from gpu.model.loader import LoadedModel, load_model  # noqa: E402
from gpu.runtime.engine import Engine, EngineConfig  # noqa: E402
from modelfile.gguf_file import ModelFileError  # noqa: E402
from modelfile.hub import resolve_model  # noqa: E402
from wire import Finish, SamplingParams, SubmitEntry, ids_to_list, pack_ids  # noqa: E402
from wire.worker_options import DEFAULT_BLOCK_SIZE, OneLineParser  # noqa: E402

__all__ = ["greedy_generate", "main", "run_generate"]


def greedy_generate(
    lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int, *, stream: bool = False
) -> list[int]:
    """Greedy continuation of ``prompt_ids``, stopping at an end-of-generation id (not
    returned) or after ``max_new_tokens``, capped by what the context leaves. With
    ``stream``, text is written to stdout as it is decoded."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    room = lm.config.context_length - len(prompt_ids)
    if room <= 0:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens fills the {lm.config.context_length}-token context"
        )
    decoder = lm.tokenizer.decode_stream(skip_special_tokens=True)
    out: list[int] = []
    for token in _engine_tokens(lm, prompt_ids, min(max_new_tokens, room)):
        out.append(token)
        if stream:
            print(decoder.step(token), end="", flush=True)
    if stream:
        print(decoder.flush(), flush=True)
    return out


def _engine_tokens(lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int) -> Iterator[int]:
    """The request's tokens as the engine steps; a matched end-of-generation id ends it."""
    blocks = max(1, math.ceil((len(prompt_ids) + max(max_new_tokens, 0)) / DEFAULT_BLOCK_SIZE))
    engine = Engine(lm, EngineConfig(kv_blocks=blocks, max_running=1))  # DEFAULT_BLOCK_SIZE
    sampling = SamplingParams(max_new_tokens=max_new_tokens, top_k=1).to_wire()
    errors, entries = engine.submit([SubmitEntry(0, pack_ids(prompt_ids), sampling, {})])
    if errors:
        raise ValueError(errors[0][2])
    while True:
        for e in entries:
            new = ids_to_list(e.new_ids)
            if e.finish is not None and e.finish[0] == Finish.STOP:
                new = new[:-1]  # the end-of-generation id itself is not part of the text
            yield from new
            if e.finish is not None:
                return
        if not engine.has_work:
            raise RuntimeError("the engine went idle before the request finished")
        entries = engine.step()
        if failed := engine.take_failed():
            raise RuntimeError(failed[0][1])


def run_generate(
    prompt: str,
    *,
    model: str | None = None,
    max_new_tokens: int = 32,
    chat: bool = False,
    device: str | None = None,
) -> int:
    """Print a greedy continuation of ``prompt``; returns the process exit code."""
    try:
        lm = load_model(resolve_model(model).path, device=device)  # a path, or ORG/NAME[:QUANT]
    except ModelFileError as exc:  # a file this runtime cannot run: as `lifecycle serve`
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if chat:
        if lm.chat is None:
            print(f"error: {lm.path} has no chat template", file=sys.stderr)
            return 1
        text = lm.chat.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = lm.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = lm.tokenizer.encode(prompt, add_special_tokens=True)
    try:
        greedy_generate(lm, ids, max_new_tokens, stream=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m gpu.worker.generate", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument(
        "--model",
        help="GGUF file, Hugging Face folder or Hub repo ORG/NAME[:QUANT] (default: bundled "
        "SmolLM2)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--device")
    args = vars(parser.parse_args(argv))  # run_generate's keywords, by name
    return run_generate(args.pop("prompt"), **args)


if __name__ == "__main__":
    raise SystemExit(main())
