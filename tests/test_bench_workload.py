"""The serving load generator's workloads: prompt lengths and determinism, JSONL files,
the grounded prompts (passages of the tree quoted whole, chosen by seed) and their chat
wrapping (the model's template, ChatML where it has none), counted in its tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.workload import (
    GROUNDED_TASKS,
    WORDS,
    Prompt,
    WorkloadConfig,
    chat_wrapped,
    grounded_prompts,
    load_jsonl,
    make_workload,
)


def test_workload_lengths_and_determinism(tmp_path: Path) -> None:
    cfg = WorkloadConfig(kind="text", num_requests=5, input_len=12, output_len=7)
    rows = make_workload(cfg)
    assert rows == make_workload(cfg)
    assert all(p.prompt_len == 12 and p.output_len == 7 for p in rows)
    assert all(
        len(str(p.prompt).split()) == 12 and set(str(p.prompt).split()) <= set(WORDS) for p in rows
    )
    assert len({p.prompt for p in rows}) == 5
    ranged = make_workload(
        WorkloadConfig(kind="ids", num_requests=50, input_len=20, range_ratio=0.5)
    )
    assert all(10 <= p.prompt_len <= 20 for p in ranged)
    assert all(len(p.prompt) == p.prompt_len and min(p.prompt) >= 17 for p in ranged)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b c"}\n\n{"prompt": [1, 2], "output_len": 3, "prompt_len": 9}\n')
    assert load_jsonl(f, 5) == [Prompt("a b c", 3, 5), Prompt((1, 2), 9, 3)]
    assert len(make_workload(WorkloadConfig(kind="jsonl", path=str(f), num_requests=5))) == 5


def test_grounded_prompts_quote_the_tree_by_seed() -> None:
    """Every task in turn, the same prompts for the same seed, other ones for another, and
    each passage quoted whole within the output length's budget."""
    cfg = WorkloadConfig(kind="grounded", num_requests=8, output_len=128, seed=3)
    rows = make_workload(cfg)
    assert rows == grounded_prompts(8, 128, 3)
    assert rows != grounded_prompts(8, 128, 4)
    assert len({p.prompt for p in rows}) == 8 and all(p.output_len == 128 for p in rows)
    openings = (
        "Rename the",
        "The paragraph",
        "Repeat the following Python",
        "Repeat the following text",
    )
    for i, p in enumerate(rows):
        text = str(p.prompt)
        assert text.startswith(openings[i % len(GROUNDED_TASKS)]), text[:60]
        passage = text.split("\n\n", 1)[1].removeprefix("```python\n").removesuffix("\n```")
        assert 0.35 * 128 * 3.0 <= len(passage) <= 0.85 * 128 * 3.0
        if text.startswith("Rename"):  # the name to change is in the function, twice or more
            old = text.split("`")[1]
            assert passage.count(old) >= 2 and "def " in passage
        if text.startswith("The paragraph"):  # the misspelling is in it, the word is not
            typo, word = text.split('"')[1], text.split('"')[3]
            assert sorted(typo) == sorted(word) and typo in passage


def test_grounded_prompts_refuse_an_output_too_short_for_any_passage() -> None:
    with pytest.raises(ValueError, match="use >= 64"):
        grounded_prompts(4, 2, 1)


def test_chat_wrapped_renders_the_models_template_and_counts_its_tokens() -> None:
    from modelfile.vocab import load_tokenizer

    rows = chat_wrapped(grounded_prompts(2, 64, 1))
    tokenizer, _, _ = load_tokenizer()
    for row, raw in zip(rows, grounded_prompts(2, 64, 1), strict=True):
        text = str(row.prompt)
        assert f"<|im_start|>user\n{raw.prompt}<|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n")
        assert row.prompt_len == len(tokenizer.encode(text, add_special_tokens=False))
    with pytest.raises(ValueError, match="text prompts"):
        chat_wrapped([Prompt((1, 2), 2, 4)])


def test_chat_wrapped_gives_chatml_to_a_model_without_a_template(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import modelfile.vocab

    tokenizer, _, config = modelfile.vocab.load_tokenizer()
    monkeypatch.setattr(modelfile.vocab, "load_tokenizer", lambda _: (tokenizer, None, config))
    [row] = chat_wrapped([Prompt("Repeat: a b", 3, 8)], "shaped.gguf")
    assert row.prompt == "<|im_start|>user\nRepeat: a b<|im_end|>\n<|im_start|>assistant\n"
    assert row.prompt_len == len(tokenizer.encode(str(row.prompt), add_special_tokens=False))
