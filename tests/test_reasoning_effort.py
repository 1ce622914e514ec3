"""Reasoning controls (issue 56, point 4): chat's ``reasoning_effort`` (which the official
SDK sends) is taken instead of a 400 and reaches the chat template as the variables its
templates read: ``reasoning_effort`` as sent and ``enable_thinking`` (false for
``none``); ``chat_template_kwargs`` wins over both. The Responses API's
``reasoning.effort`` means the same. Checked in the parser, on llama.cpp's real
templates against transformers, and end to end on a server whose template shows the
variables (the scripted worker echoes the prompt)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from lifecycle.faces.openai_chat_inputs import REASONING_EFFORTS, reasoning_variables
from lifecycle.faces.openai_params import OpenAIError, parse_chat
from modelfile.chat import ChatTemplate

from .scripted import echoed_chat_prompt, template_server

HI = [{"role": "user", "content": "Hi"}]
OPTS: dict[str, Any] = {
    "vocab_size": 49152,
    "model_names": frozenset({"m"}),
    "default_model": "m",
}
# Shows the two variables (or "-" when the template was not given one).
TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"
    "<effort={{ reasoning_effort if reasoning_effort is defined else '-' }} "
    "thinking={{ enable_thinking if enable_thinking is defined else '-' }}>"
    "{% if add_generation_prompt %}[assistant: {% endif %}"
)


def _kwargs(**body: Any) -> dict[str, Any] | None:
    req, _ = parse_chat({"messages": HI, **body}, **OPTS)
    return req.template_kwargs


@pytest.mark.parametrize("effort", REASONING_EFFORTS)
def test_every_effort_the_sdk_sends_is_taken(effort: str) -> None:
    assert _kwargs(reasoning_effort=effort) == {
        "reasoning_effort": effort,
        "enable_thinking": effort != "none",
    }
    assert reasoning_variables(effort) == _kwargs(reasoning_effort=effort)


def test_no_effort_changes_nothing() -> None:
    assert _kwargs() is None
    assert _kwargs(reasoning_effort=None) is None
    assert _kwargs(chat_template_kwargs={"x": 1}) == {"x": 1}


def test_chat_template_kwargs_win_over_the_effort() -> None:
    got = _kwargs(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert got == {"reasoning_effort": "none", "enable_thinking": True}


@pytest.mark.parametrize("effort", ["extreme", "", 3, ["low"], "LOW"])
def test_an_unknown_effort_is_a_400_naming_the_values(effort: Any) -> None:
    with pytest.raises(OpenAIError) as err:
        _kwargs(reasoning_effort=effort)
    assert err.value.status == 400 and err.value.param == "reasoning_effort"
    assert "none, minimal, low, medium, high, xhigh, max" in err.value.message


def _real_template(name: str) -> str:
    from tests.llamacpp_vocab import templates_dir

    templates, why = templates_dir()
    if templates is None or not (templates / f"{name}.jinja").exists():
        pytest.skip(why or f"no {name} template")
    return (templates / f"{name}.jinja").read_text(encoding="utf-8")


def test_none_turns_qwen3_thinking_off_as_transformers_renders_it() -> None:
    from tests.test_chat_templates_real import transformers_render

    source = _real_template("Qwen-Qwen3-0.6B")
    variables = _kwargs(reasoning_effort="none")
    got = ChatTemplate(source).render(copy.deepcopy(HI), variables=variables)
    assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert got == transformers_render(source, HI, None, **(variables or {}))
    on = ChatTemplate(source).render(copy.deepcopy(HI), variables=_kwargs(reasoning_effort="low"))
    assert on == ChatTemplate(source).render(copy.deepcopy(HI))  # thinking is Qwen3's default


def test_gpt_oss_reads_the_effort_as_transformers_renders_it() -> None:
    from tests.test_chat_templates_real import transformers_render

    source = _real_template("openai-gpt-oss-120b")
    variables = _kwargs(reasoning_effort="low")
    got = ChatTemplate(source).render(copy.deepcopy(HI), variables=variables)
    assert "Reasoning: low" in got
    assert got == transformers_render(source, HI, None, **(variables or {}))


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with template_server(tmp_path_factory.mktemp("tpl"), TEMPLATE) as base:
        yield base


def _prompt(url: str, **body: Any) -> str:
    return echoed_chat_prompt(url, messages=HI, **body)


def _responses_prompt(url: str, effort: str) -> str:
    """As ``_prompt``, through ``/v1/responses``' ``reasoning.effort`` (echoed back)."""

    def post(n: int) -> dict[str, Any]:
        body = {"input": HI, "max_output_tokens": n, "reasoning": {"effort": effort}}
        r = httpx.post(url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["reasoning"]["effort"] == effort
        return dict(r.json())

    n = post(1)["usage"]["input_tokens"]
    return str(post(n)["output"][0]["content"][0]["text"])


def test_the_variables_reach_the_servers_template(url: str) -> None:
    assert _prompt(url) == "[user: Hi]<effort=- thinking=->[assistant: "
    assert _prompt(url, reasoning_effort="none") == (
        "[user: Hi]<effort=none thinking=False>[assistant: "
    )
    assert _prompt(url, reasoning_effort="high") == (
        "[user: Hi]<effort=high thinking=True>[assistant: "
    )
    got = _prompt(url, reasoning_effort="low", chat_template_kwargs={"enable_thinking": False})
    assert got == "[user: Hi]<effort=low thinking=False>[assistant: "
    got = _responses_prompt(url, "minimal")
    assert got == "[user: Hi]<effort=minimal thinking=True>[assistant: "


def test_the_official_sdk_sends_reasoning_effort(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], reasoning_effort="low",
        max_tokens=4,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"reasoning_effort": "extreme"},
        )
    assert err.value.param == "reasoning_effort"
