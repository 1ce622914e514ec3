"""``--chat-template FILE``, ``chat_template_kwargs`` and ``continue_final_message``
through a real server on the scripted worker, which echoes the prompt back: the reply
shows the text the template rendered. A template file that cannot be used stops
``lifecycle serve`` before it listens, in one line."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .scripted import ROOT, echoed_chat_prompt, template_server

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}: "
    "{{ m.content }}]{% endfor %}{% if flavour %}<{{ flavour }}>{% endif %}"
    "{% if add_generation_prompt %}[assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with template_server(tmp_path_factory.mktemp("tpl"), TEMPLATE) as base:
        yield base


_prompt = echoed_chat_prompt


def test_the_file_replaces_the_models_template_and_kwargs_reach_it(url: str) -> None:
    user = {"role": "user", "content": "Hi", "name": "ann"}
    assert _prompt(url, messages=[user]) == "[user ann: Hi][assistant: "
    got = _prompt(url, messages=[user], chat_template_kwargs={"flavour": "plain"})
    assert got == "[user ann: Hi]<plain>[assistant: "


def test_continue_final_message_stops_inside_the_last_turn(url: str) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    got = _prompt(url, messages=messages, continue_final_message=True)
    assert got == "[user: Hi][assistant: Hel"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ([1], "chat_template_kwargs must be an object."),
        ({"messages": []}, "chat_template_kwargs cannot set ['messages']: the server sets them."),
    ],
)
def test_bad_chat_template_kwargs_are_400(url: str, kwargs: Any, message: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": kwargs}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == message
    assert r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("text", "problem"),
    [(None, "cannot read the chat template"), ("{% for %}", "chat template does not compile")],
)
def test_an_unusable_template_file_stops_serve(
    tmp_path: pathlib.Path, text: str | None, problem: str
) -> None:
    path = tmp_path / "chat.jinja"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    argv = [sys.executable, "-m", "lifecycle", "serve", "--scripted-worker", "--port", "9"]
    done = subprocess.run(
        [*argv, "--chat-template", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {path}: {problem}"), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
