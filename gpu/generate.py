"""Offline greedy generation: ``python -m gpu.generate "prompt" [--chat]``."""

from __future__ import annotations

import argparse
import sys

from gpu.cpu_runtime import tune_cpu_runtime

tune_cpu_runtime()  # before torch is imported

import torch  # noqa: E402

from gpu.loader import LoadedModel, load_model  # noqa: E402
from gpu.model import DenseKVCache  # noqa: E402
from modelfile.gguf_file import ModelFileError  # noqa: E402

__all__ = ["greedy_generate", "main", "run_generate"]


def greedy_generate(
    lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int, *, stream: bool = False
) -> list[int]:
    """Greedy continuation of ``prompt_ids``, stopping at an end-of-generation id.

    With ``stream``, text is written to stdout as it is decoded.
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    room = lm.config.context_length - len(prompt_ids)
    if room <= 0:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens fills the {lm.config.context_length}-token context"
        )
    max_new_tokens = min(max_new_tokens, room)
    cache = DenseKVCache(
        lm.config, 1, len(prompt_ids) + max_new_tokens, device=lm.device, dtype=lm.dtype
    )
    decoder = lm.tokenizer.decode_stream(skip_special_tokens=True)
    out: list[int] = []
    ids = prompt_ids
    with torch.inference_mode():
        while len(out) < max_new_tokens:
            positions = cache.positions([0], [len(ids)])
            cache.prepare([0], [len(ids)])
            x = torch.tensor(ids, dtype=torch.int64, device=lm.device)
            last = torch.tensor([len(ids) - 1], device=lm.device)
            logits = lm.model(x, positions, cache, logits_indices=last)
            token = int(logits[0].argmax())
            if token in lm.tokenizer.eog_ids:
                break
            out.append(token)
            if stream:
                sys.stdout.write(decoder.step(token))
                sys.stdout.flush()
            ids = [token]
    if stream:
        sys.stdout.write(decoder.flush() + "\n")
        sys.stdout.flush()
    return out


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
        lm = load_model(model, device=device)
    except (ModelFileError, ValueError) as exc:
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
    parser = argparse.ArgumentParser(prog="python -m gpu.generate", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--model", default=None, help="GGUF file (default: bundled SmolLM2)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    return run_generate(
        args.prompt,
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        device=args.device,
    )


if __name__ == "__main__":
    raise SystemExit(main())
