"""Speculative decoding with a draft model (``--speculative draft --speculative-draft
MODEL``, gpu/runtime/drafter.py): the draft model's KV kept beside the served one's
(``Drafter.mirror``, which runs only a check's last row), the same tokens as without
speculation whatever the draft proposes, the vocabulary and option checks, and a real
server. The bundled model, its helpers and what is asserted as in test_speculative.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gpu.model.loader import LoadedModel
from gpu.runtime.drafter import DraftMismatch
from gpu.runtime.engine import Engine, EngineConfig
from gpu.runtime.speculation import Speculation
from tests.engine_runs import run_to_end
from tests.test_speculative import _engine, _greedy, _prompts


@pytest.fixture(scope="module")
def lm(cpu_model: LoadedModel) -> LoadedModel:
    assert cpu_model.model.quantized(), "the bit-exact promise is the native path's"
    return cpu_model


DRAFT = Speculation("draft", tokens=4)


def test_the_mirror_runs_a_checks_last_row_only() -> None:
    """``Drafter.mirror``'s step: a decode, a check (``lay_out``'s chunk of a sequence's
    last token and a draft of 3, which ``fill`` ran) and a prompt chunk become the decode,
    the check's last row as a decode (``fill`` wrote the other three) and the whole
    prompt chunk, decodes first; chunks of no check stay whole, and a step without checks
    is run as it is."""
    from types import SimpleNamespace

    from gpu.cache.kv_cache import PrefillChunk
    from gpu.runtime.drafter import _past_fill
    from gpu.runtime.runner import StepInput

    dec, chk, pro = [1, 2], [3, 4], [5]
    step = StepInput(
        ids=[10, 20, 21, 22, 23, 30, 31], pos=[7, 40, 41, 42, 43, 0, 1], decodes=[(dec, 8)],
        prefills=[PrefillChunk(chk, 40, 4), PrefillChunk(pro, 0, 2)], copies=[(1, 2, 3)],
    )  # fmt: skip
    seq = SimpleNamespace(block_table=chk, draft=[21, 22, 23])
    cut = _past_fill(step, [(1, seq, seq.draft)])  # type: ignore[list-item]
    assert (cut.ids, cut.pos) == ([10, 23, 30, 31], [7, 43, 0, 1])
    assert cut.decodes == [(dec, 8), (chk, 44)]
    assert cut.prefills == [PrefillChunk(pro, 0, 2)] and cut.copies == [(1, 2, 3)]
    other = SimpleNamespace(block_table=[9], draft=[21, 22])  # a check not in this step
    assert _past_fill(step, [(1, other, other.draft)]) == step  # type: ignore[list-item]
    assert _past_fill(step, []) is step


def test_draft_model_as_itself_is_always_right(lm: LoadedModel) -> None:
    """The served model as its own draft proposes exactly its tokens: every proposal is
    accepted whole, which holds only if the draft's KV follows the served model's through
    prompt chunks, prefix hits and accepted drafts (``Drafter.mirror``)."""
    prompts = _prompts(lm)[:4]
    params = [_greedy(40) for _ in prompts]
    plain = run_to_end(_engine(lm, Speculation()), prompts, params)
    spec = Engine(lm, EngineConfig(kv_blocks=400, step_tokens=32, mixed_prefill_tokens=16,
                                   speculation=DRAFT), draft=lm)  # fmt: skip
    assert run_to_end(spec, prompts, params) == plain
    assert run_to_end(spec, prompts, params) == plain  # from the prefix cache
    t = spec.spec_totals
    assert t.verify_steps > 10 and t.accepted_tokens == t.draft_tokens


def test_draft_model_of_other_weights(lm: LoadedModel) -> None:
    """A draft that is another function of the same vocabulary (the same file's weights
    dequantized to fp32, on the torch path): some proposals fail, the tokens stay the
    served model's, greedy and seeded."""
    from gpu.model.loader import load_model

    dense = load_model(lm.path, device="cpu", weights="fp32")
    prompts = _prompts(lm)[:4]
    params = [_greedy(32) for _ in prompts[:2]] + [
        {"max_new_tokens": 32, "temperature": 0.8, "seed": 3 + i} for i in range(2)
    ]
    plain = [run_to_end(_engine(lm, Speculation()), [p], [s])[0]
             for p, s in zip(prompts, params, strict=True)]  # fmt: skip
    spec = Engine(lm, EngineConfig(kv_blocks=400, speculation=DRAFT), draft=dense)
    assert run_to_end(spec, prompts, params) == plain
    t = spec.spec_totals
    assert 0 < t.accepted_tokens < t.draft_tokens


def test_draft_model_must_share_the_vocabulary(lm: LoadedModel, tiny_gguf: Any) -> None:
    from gpu.model.loader import load_model

    other = load_model(tiny_gguf.path, device="cpu")
    with pytest.raises(DraftMismatch, match="vocabulary"):  # the worker refuses to start
        Engine(lm, EngineConfig(kv_blocks=64, speculation=DRAFT), draft=other)


def test_draft_options_go_together() -> None:
    from wire.worker_options import refused_combination

    assert "go together" in (refused_combination({"speculative": "draft"}) or "")
    assert "go together" in (refused_combination({"speculative_draft": "m.gguf"}) or "")
    both = {"speculative": "draft", "speculative_draft": "m.gguf"}
    assert refused_combination(both) is None
    assert "--prefix-cache-dir" in (refused_combination({**both, "prefix_cache_dir": "d"}) or "")


def test_served_with_a_draft_model(lm: LoadedModel) -> None:
    from tests.scripted import lifecycle_server

    prompt = _prompts(lm)[2]
    plain = run_to_end(_engine(lm, Speculation()), [prompt], [_greedy(24)])[0]
    with lifecycle_server("--device", "cpu", "--speculative", "draft",
                          "--speculative-draft", str(lm.path)) as base:  # fmt: skip
        body = httpx.post(base + "/generate", timeout=120,
                          json={"input_ids": prompt, "sampling_params": _greedy(24)}).json()  # fmt: skip
        assert body["output_ids"] == plain
        assert body["meta_info"]["spec_accept_rate"] == 1.0  # the model is its own draft
        info = httpx.get(base + "/server_info", timeout=30).json()
        assert f"'draft': '{lm.path}'" in repr(info)
