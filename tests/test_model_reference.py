"""Our torch Llama against two independent implementations of the same GGUF, on the
fixture made by tools/make_model_fixture.py (see docs/references.md).

* transformers' GGUF loader, fp32 on the same dequantised weights: last-position logits
  within 2e-3, and greedy continuations identical except at near-ties.
* llama.cpp (quantised kernels): teacher-forced top-1 agreement of at least 95 %.

Two modes run every test: ``fp32`` (weights dequantized at load, what CUDA and --tp run,
on the dense test cache) and ``served``: the CPU default, quantized weights (GGUF blocks
read by gpu/kernels/csrc/quant_linear.c, x rounded to int8 per block of 32 as llama.cpp's Q4_1 /
Q8_0 dot products do) on the worker's paged cache, every step through the fused native
trunk (gpu/backends/fused.py). The served path computes the same bits on every CPU and build
(docs/determinism.md, tests/test_determinism.py), so its figures below are exact values
of this code on this file, the same on an AVX2 or an AVX-512 machine (a digest of the
whole run is held to the one recorded, ``SERVED_SHA256``), and each bound sits above
its figure to catch a change of the function, not noise. (The quantized
weights on torch's own norms, RoPE and SDPA, which sum in an order that depends on the
CPU's vector width, are no longer a mode here: no request runs that path.)

Measured 2026-12-06 (the kernel's function of quant_linear.c as it is now: one integer
per block, one FMA per block; K and V stored as fp16, as the CPU worker keeps them for
quantized weights, ``--kv-cache-dtype auto``): last-position logits within 0.53-0.96 of
transformers' (0.96 on ``chat_code``; with an fp32 cache 0.42-0.91), so the bound is
1.0; greedy decode first leaves transformers' continuation where transformers' own
top-1/top-2 gap was 0.004-0.30 (chat_code 2, chat_system 3, chat_summary_long 3,
one_word 4, code 4, capital 5, chat_math 9, story 10, chat_multi 16, chat_hi 23,
history_long 23), so a "near tie" there is a gap under 0.5, for teacher-forced
positions as well (22 of 624 differ from transformers' argmax). The teacher-forced
top-1 agreement with llama.cpp is 0.970 (with an fp32 cache 0.978; the function before,
eight fp32 lanes per output: 0.974; fp32 weights: 0.973, transformers' own: 0.973).

* llama.cpp's server (tests/fixtures/llamaserver_greedy.json, made by
  tools/make_llamaserver_fixture.py): its greedy continuation token for token, except
  where ours stands at a near-tie, the same gap under 0.5 as against transformers: both
  implementations round x to int8 per block, but llama.cpp keeps K/V in f16 and sums
  attention in another order, and each lands up to ~0.9 from transformers' logits, so
  no mode of ours can follow it through a tie. Served, 2026-12-06 (fp16 cache): the
  full 32 tokens on capital, numbers, chinese; first divergences at chat_code 2,
  chat_system 3, chat_summary_long 3, chat_hi 5, code 5, one_word 7, chat_multi 7,
  chat_math 9, story 10, history_long 23 (our gaps 0.008-0.26). fp32 (2026-12-04): divergences at one_word 4,
  capital 5, chat_hi 5, code 4, story 19, chat_multi 7, chat_system 10 (gaps up to
  0.26), where transformers leaves llama-server too.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from gpu.cache.kv_cache import PagedKVCache, PrefillChunk, kv_storage_dtype
from gpu.kernels import native
from gpu.model.loader import LoadedModel, load_model
from modelfile.gguf_file import default_model_path
from tests.dense_cache import DenseKVCache
from tests.model_steps import forward

# The module fixture runs 13 prompts (~420 forward passes): about 1-2 minutes on an idle
# 2-core machine, several times that when the cores are shared.
pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
LOGITS_ATOL = {"fp32": 2e-3, "quantized": 1.0}
NEAR_TIE = 1e-3  # a top-1/top-2 logit gap below this may flip between fp32 summation orders
MODE_NEAR_TIE = {"fp32": NEAR_TIE, "quantized": 0.5}  # see the module docstring
MIN_LLAMACPP_TOP1 = 0.95
LLAMASERVER_NEAR_TIE = MODE_NEAR_TIE["quantized"]  # see the module docstring
MAX_LEN = 1024
# The served run's bits (every prompt's last logits, greedy ids and teacher-forced argmax;
# _served_digest): recorded 2026-12-06 on an AVX-512 VNNI Xeon (fp16 cache), and the same
# there with the avx512, avxvnni, AVX2 and portable builds; the figures of the module
# docstring are this run's. So on any x86 CPU this digest holds or the
# promise of docs/determinism.md is broken. A deliberate change of the function (a
# kernel's order of operations, the model math) changes it: the failure prints the new
# one to record, with the figures above to re-measure.
SERVED_SHA256 = "d4b5d6e3eded175477a857333e81870b3dcb141040f788ee57f3f7d11e2f5a03"


@dataclass(frozen=True, slots=True)
class OurRun:
    """What our model computed for one reference prompt."""

    mode: str  # the weights: "fp32" or "quantized"
    last_logits: np.ndarray  # [vocab] after prefilling the prompt
    greedy: list[int]
    greedy_gaps: list[float]
    teacher_argmax: list[int]  # argmax at each teacher-forced position (one prefill)


@pytest.fixture(scope="module")
def reference() -> dict:
    meta = json.loads((FIXTURES / "model_reference.json").read_text(encoding="utf-8"))
    with np.load(FIXTURES / "model_reference.npz") as npz:
        meta["last_logits"] = npz["last_logits"]
    return meta


def _gap(logits: torch.Tensor) -> float:
    top2 = torch.topk(logits, 2).values
    return float(top2[0] - top2[1])


class _PagedSequence:
    """``DenseKVCache``'s calls for sequence 0 on a ``PagedKVCache`` (the worker's cache):
    a one-token append is a decode, anything longer a prompt chunk; K and V stored as
    the worker stores them by default (fp16 for quantized weights)."""

    def __init__(self, lm: LoadedModel, max_len: int) -> None:
        kv = kv_storage_dtype("auto", lm.device, lm.dtype, lm.model.quantized())
        self.backend = PagedKVCache(lm.config, -(-max_len // 16), 16, kv_dtype=kv)
        self.table = list(range(self.backend.num_blocks))
        self.n = 0

    def reset(self, seq_id: int) -> None:
        self.n = 0

    def positions(self, seq_ids: list[int], new_lens: list[int]) -> torch.Tensor:
        return torch.arange(self.n, self.n + new_lens[0])

    def prepare(self, seq_ids: list[int], new_lens: list[int]) -> None:
        k = new_lens[0]
        if k == 1 and self.n:
            self.backend.prepare([(self.table, self.n + 1)], [])
        else:
            self.backend.prepare([], [PrefillChunk(self.table, self.n, k)])
        self.n += k


Cache = DenseKVCache | _PagedSequence


def _forward(lm: LoadedModel, cache: Cache, ids: list[int], rows: list[int]) -> torch.Tensor:
    """Append ``ids`` to sequence 0 and return the logits of ``rows`` (indices into ``ids``)."""
    positions = cache.positions([0], [len(ids)])
    cache.prepare([0], [len(ids)])
    x = torch.tensor(ids, dtype=torch.int64, device=lm.device)
    idx = torch.tensor(rows, dtype=torch.int64, device=lm.device)
    if isinstance(cache, _PagedSequence):  # the trunk an engine chooses
        return forward(lm.model, cache.backend, x, positions, logits_indices=idx)
    out = lm.model(x, positions, cache, logits_indices=idx)
    assert isinstance(out, torch.Tensor)
    return out


def _run_prompt(lm: LoadedModel, cache: Cache, prompt: dict) -> OurRun:
    """Prefill, greedy decode one token at a time, then the teacher's tail as one chunk.

    Three paths meet the references: a fresh prefill (last logits), single-token decode
    (greedy), and a multi-token chunk appended to a filled cache (the teacher's tail).
    """
    ids, teacher, steps = prompt["ids"], prompt["teacher"], len(prompt["greedy"])
    cache.reset(0)
    logits = _forward(lm, cache, ids, [len(ids) - 1])[0]
    last = logits.numpy().copy()
    greedy, gaps = [], []
    for _ in range(steps):
        greedy.append(int(logits.argmax()))
        gaps.append(_gap(logits))
        logits = _forward(lm, cache, [greedy[-1]], [0])[0]
    if greedy == teacher[:steps]:
        # The cache already holds prompt + teacher[:steps]: only the rest is new.
        tail = teacher[steps:-1]
        rows = _forward(lm, cache, tail, list(range(len(tail))))
        teacher_argmax = [*greedy, int(logits.argmax()), *rows.argmax(-1).tolist()]
    else:  # diverged at a near-tie: teacher-force the whole sequence in one prefill
        cache.reset(0)
        seq = ids + teacher[:-1]
        rows = _forward(lm, cache, seq, list(range(len(ids) - 1, len(seq))))
        teacher_argmax = rows.argmax(-1).tolist()
    return OurRun(
        "quantized" if lm.model.quantized() else "fp32", last, greedy, gaps, teacher_argmax
    )


# The fp32 run (about 25 s: its own fp32 load and ~420 forward passes) is `make test-full`'s:
# `make test` keeps the served default against the same references, within CI's limit.
@pytest.fixture(scope="module", params=[pytest.param("fp32", marks=pytest.mark.slow), "served"])
def ours(request: pytest.FixtureRequest, reference: dict) -> list[OurRun]:
    if request.param == "served":
        if native.load_kernels() is None:
            pytest.skip("quantized weights need the native kernels (LIFECYCLE_NATIVE=0 here)")
        lm: LoadedModel = request.getfixturevalue("cpu_model")  # the CPU default
        assert lm.model.quantized()
    else:
        lm = load_model(device="cpu", weights="fp32")
    assert lm.dtype == torch.float32
    cache: Cache = DenseKVCache(
        lm.config, max_seqs=1, max_len=MAX_LEN, device=lm.device, dtype=lm.dtype
    )
    if request.param == "served":
        cache = _PagedSequence(lm, MAX_LEN)
    with torch.inference_mode():
        return [_run_prompt(lm, cache, p) for p in reference["prompts"]]


def test_fixture_covers_the_acceptance_set(reference: dict) -> None:
    digest = hashlib.sha256(default_model_path().read_bytes()).hexdigest()
    assert digest == reference["model_sha256"], (
        "the default model file changed: regenerate with tools/make_model_fixture.py"
    )
    prompts = reference["prompts"]
    lengths = [len(p["ids"]) for p in prompts]
    assert len(prompts) >= 10
    assert {p["kind"] for p in prompts} == {"plain", "chat"}
    assert min(lengths) <= 8 and 500 <= max(lengths) < MAX_LEN - reference["teacher_steps"]
    assert reference["last_logits"].shape == (len(prompts), 49152)


def _served_digest(runs: list[OurRun]) -> str:
    h = hashlib.sha256()
    for run in runs:
        h.update(run.last_logits.astype(np.float32).tobytes())
        h.update(json.dumps([run.greedy, run.teacher_argmax]).encode())
    return h.hexdigest()


def test_served_run_is_the_same_bits_on_every_cpu(ours: list[OurRun]) -> None:
    if ours[0].mode != "quantized":
        pytest.skip("fp32 weights run torch's matmuls: nothing is promised bit for bit")
    assert _served_digest(ours) == SERVED_SHA256


def test_last_position_logits_match_transformers(reference: dict, ours: list[OurRun]) -> None:
    diffs = {
        p["name"]: float(np.abs(run.last_logits - want).max())
        for p, run, want in zip(reference["prompts"], ours, reference["last_logits"], strict=True)
    }
    worst = max(diffs, key=diffs.__getitem__)
    atol = LOGITS_ATOL[ours[0].mode]
    assert diffs[worst] <= atol, f"max |ours - transformers| per prompt: {diffs}"


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def test_greedy_matches_transformers_except_near_ties(reference: dict, ours: list[OurRun]) -> None:
    problems = []
    for p, run in zip(reference["prompts"], ours, strict=True):
        i = _first_divergence(run.greedy, p["greedy"])
        if i is not None and p["greedy_gaps"][i] >= MODE_NEAR_TIE[run.mode]:
            problems.append(
                f"{p['name']}: step {i}: ours {run.greedy[i]} (gap {run.greedy_gaps[i]:.2e}), "
                f"transformers {p['greedy'][i]} (gap {p['greedy_gaps'][i]:.2e})"
            )
    assert not problems, "\n".join(problems)


def test_teacher_forced_agrees_with_transformers_greedy(
    reference: dict, ours: list[OurRun]
) -> None:
    # The teacher sequence is transformers' own greedy output, so its argmax at every
    # teacher-forced position is the teacher token. The last 15 positions come from one
    # chunk appended to a filled cache (the masked, chunked-prefill attention path).
    problems = []
    for p, run in zip(reference["prompts"], ours, strict=True):
        for i, (got, want) in enumerate(zip(run.teacher_argmax, p["teacher"], strict=True)):
            if got != want and p["teacher_gaps"][i] >= MODE_NEAR_TIE[run.mode]:
                problems.append(f"{p['name']} step {i}: ours {got}, transformers {want}")
    assert not problems, "\n".join(problems)


def test_teacher_forced_top1_agrees_with_llamacpp(reference: dict, ours: list[OurRun]) -> None:
    per_prompt = {
        p["name"]: sum(
            a == b for a, b in zip(run.teacher_argmax, p["llamacpp_argmax"], strict=True)
        )
        for p, run in zip(reference["prompts"], ours, strict=True)
    }
    total = len(ours) * reference["teacher_steps"]
    rate = sum(per_prompt.values()) / total
    assert rate >= MIN_LLAMACPP_TOP1, f"top-1 agreement {rate:.4f} per prompt: {per_prompt}"


def test_greedy_matches_llamaserver_except_near_ties(reference: dict, ours: list[OurRun]) -> None:
    peer = json.loads((FIXTURES / "llamaserver_greedy.json").read_text(encoding="utf-8"))
    assert peer["model_sha256"] == reference["model_sha256"]
    problems = []
    for p, run in zip(reference["prompts"], ours, strict=True):
        theirs = peer["greedy"][p["name"]]
        i = _first_divergence(run.greedy, theirs)
        if i is not None and run.greedy_gaps[i] >= LLAMASERVER_NEAR_TIE:
            problems.append(
                f"{p['name']}: step {i}: ours {run.greedy[i]} (gap {run.greedy_gaps[i]:.2e}), "
                f"llama-server {theirs[i]}"
            )
    assert not problems, "\n".join(problems)
