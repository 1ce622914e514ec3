"""One definition of the options (lifecycle/options.py): ``lifecycle serve``'s flags and
``Engine(...)``'s keywords are the same table and give the same configuration."""

from __future__ import annotations

import pytest

from lifecycle.app import AppConfig
from lifecycle.cli import _build_parser
from lifecycle.options import OPTIONS, app_config, engine_values, option_values


def _serve(*argv: str) -> AppConfig:
    return app_config(option_values(_build_parser().parse_args(["serve", *argv])))


def test_the_defaults_are_appconfigs_and_the_engines() -> None:
    cli = _serve()
    assert cli == AppConfig()  # the table's defaults are the dataclass's
    assert app_config(engine_values(None, {})) == cli


def test_every_option_is_a_flag_and_a_keyword() -> None:
    helptext = _build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for o in OPTIONS:
        assert o.flag in helptext, o.flag
        if not o.server:
            engine_values(None, {o.name: o.default})  # accepted


@pytest.mark.parametrize(
    ("argv", "kwargs"),
    [
        (["--max-running", "3", "--max-pending", "5"], {"max_running": 3, "max_pending": 5}),
        (["--scripted-worker", "--worker-args", "--step-delay 0.1"],
         {"scripted_worker": True, "worker_args": "--step-delay 0.1"}),
        (["--restart-backoff", "0.1,2"], {"restart_backoff": "0.1,2"}),
        (["--trace-log", "t.jsonl", "--trace-ring-size", "7"],
         {"trace_log": "t.jsonl", "trace_ring_size": 7}),
        (["--model", "m.gguf", "--device", "cpu", "--incremental-streaming-output"],
         {"model": "m.gguf", "device": "cpu", "incremental_streaming_output": True}),
    ],
)  # fmt: skip
def test_a_flag_and_its_keyword_give_one_config(argv: list[str], kwargs: dict) -> None:
    assert _serve(*argv) == app_config(engine_values(kwargs.pop("model", None), kwargs))


def test_what_the_options_set() -> None:
    cfg = _serve("--scripted-worker", "--worker-args", "--step-delay 0.1 --burst 2",
                 "--restart-backoff", "0.1,2", "--disable-debug-routes")  # fmt: skip
    assert cfg.worker_module == "lifecycle.testing.scripted_worker"
    assert cfg.worker_extra_args == ("--step-delay", "0.1", "--burst", "2")
    assert cfg.restart_backoff == (0.1, 2.0) and cfg.debug_routes is False


def test_the_engine_refuses_unknown_and_server_options() -> None:
    with pytest.raises(TypeError, match="did you mean 'kv_cache_tokens'"):
        engine_values(None, {"kv_cache_token": 1})
    for name in ("host", "port", "api_key", "ssl_certfile"):
        with pytest.raises(TypeError, match="HTTP server"):
            engine_values(None, {name: None})
