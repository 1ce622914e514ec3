"""Chat templates from the GGUF, rendered in jinja2's immutable sandbox."""

from __future__ import annotations

import pytest

from gpu.model.loader import LoadedModel
from modelfile.chat import ChatTemplate, ChatTemplateError

SMOLLM2_HI = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)


def test_generation_prompt_and_default_system() -> None:
    from tests.tiny_gguf import CHATML

    chat = ChatTemplate(CHATML)
    msgs = [{"role": "user", "content": "Hi"}]
    assert chat.render(msgs) == (
        "<|im_start|>system\nYou are tiny.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *msgs]
    assert chat.render(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_special_token_variables_and_tojson() -> None:
    chat = ChatTemplate(
        "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}", bos_token="<s>", eos_token="</s>"
    )
    assert (
        chat.render([{"role": "user", "content": "é"}])
        == '<s>[{"role": "user", "content": "é"}]</s>'
    )


def test_raise_exception_becomes_template_error() -> None:
    chat = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="user first"):
        chat.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.append(1) }}",  # immutable: no mutation of caller data
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # sandbox: no dunder escape
    ],
)
def test_sandbox_refuses_unsafe_templates(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_bad_content_is_a_template_error() -> None:
    from tests.tiny_gguf import CHATML

    with pytest.raises(ChatTemplateError):
        ChatTemplate(CHATML).render([{"role": "user", "content": None}])  # type: ignore[dict-item]


@pytest.mark.model
def test_smollm2_template_verbatim(cpu_model: LoadedModel) -> None:
    assert cpu_model.chat is not None
    assert cpu_model.chat.render([{"role": "user", "content": "Hi"}]) == SMOLLM2_HI
