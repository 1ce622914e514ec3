"""``--config FILE`` and ``LIFECYCLE_*``: the same options as the flags (lifecycle/config.py),
file < environment < flags; an unknown key stops start-up with its name."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from lifecycle.cli import parse_args
from lifecycle.config import ConfigError, env_values, file_values
from lifecycle.option_args import engine_values, option_values
from lifecycle.option_fields import Option
from lifecycle.options import OPTIONS
from lifecycle.runtime import app_config

ROOT = Path(__file__).resolve().parent.parent


def _config(argv: list[str]):  # noqa: ANN202
    args, rest = parse_args(argv)
    assert rest == []
    if args.command == "serve":
        return app_config(option_values(args))
    values = option_values(args, server=False)  # batch: the Engine's options
    return app_config(engine_values(values.pop("model"), values))


def _samples(tmp_path: Path) -> dict[str, object]:
    keys = tmp_path / "keys"
    keys.write_text("k-from-file\n")
    models = tmp_path / "models"
    models.mkdir()
    (models / "extra.gguf").write_bytes(b"")
    special: dict[str, object] = {
        "api_key_file": str(keys),
        "models_dir": str(models),
        "restart_backoff": "0.1,2",
        "worker_args": "--step-delay 0.1",
        "log_level": "debug",
        "port": 12345,
        "otlp_traces_endpoint": "http://127.0.0.1:4318/v1/traces",
        "router_policy": "least_load",
        "access_log_format": "common",
        "reasoning_parser": "deepseek-r1",
        "tool_call_parser": "mistral",
        "device": "cuda:1",  # of the form cpu | cuda | cuda:N
        "mem_fraction": 0.5,  # a share: at most 1
        "ray_autoscale": "1:3",  # MIN:MAX
        "ray_autoscale_after": "0.5:2",  # UP:DOWN seconds
    }
    out: dict[str, object] = {}
    for o in OPTIONS:
        choices = o.worker.choices if o.worker else o.choices
        if o.name in special:
            out[o.name] = special[o.name]
        elif choices:
            out[o.name] = choices[-1]
        elif o.type is None:
            out[o.name] = True
        elif o.repeat:
            out[o.name] = [f"{o.name}-1", f"{o.name}-2"]
        elif o.type is int:
            out[o.name] = 7
        elif o.type is float:
            out[o.name] = 1.5
        else:
            out[o.name] = f"{o.name}-value"
    return out


def _flags(values: dict[str, object], options: Sequence[Option] = OPTIONS) -> list[str]:
    argv: list[str] = []
    for o in options:
        v = values[o.name]
        if o.type is None:
            argv += [o.flag] if v else []
        elif isinstance(v, list):
            for item in v:
                argv += [o.flag, str(item)]
        else:
            argv += [f"{o.flag}={v}"]
    return argv


def _toml(values: dict[str, object]) -> str:
    def lit(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(lit(x) for x in v) + "]"
        return repr(v) if not isinstance(v, str) else '"' + v.replace('"', '\\"') + '"'

    return "".join(f"{k} = {lit(v)}\n" for k, v in values.items())


def test_every_key_in_a_file_is_the_flag(tmp_path: Path) -> None:
    values = _samples(tmp_path)
    path = tmp_path / "serve.toml"
    path.write_text(_toml(values))
    from_file = _config(["serve", "--config", str(path)])
    from_flags = _config(["serve", *_flags(values)])
    assert from_file == from_flags
    assert from_file.port == 12345 and from_file.max_running == 7
    assert from_file.api_keys == ("api_key-1", "api_key-2", "k-from-file")
    yaml_path = tmp_path / "serve.yaml"
    yaml_path.write_text("".join(f"{k.replace('_', '-')}: {v!r}\n" for k, v in values.items()))
    assert _config(["serve", "--config", str(yaml_path)]) == from_flags


def test_each_option_sets_the_field_it_names(tmp_path: Path) -> None:
    """Where an option goes is declared with it (``Option.into``): given alone, each one
    changes that ``AppConfig`` field, its own or the one it feeds (``--api-key-file``:
    ``api_keys``, ``--trace-log``: ``trace``); only the process's options set none."""
    values = _samples(tmp_path)
    base = ["--model", "base.gguf"]  # --models-dir's models are served beside it
    for o in OPTIONS:
        if o.into is None:
            assert o.name in ("faults", "log_level"), o.name
            continue
        given = _flags({o.name: values[o.name]}, [o])
        at_default = _config(["serve", *([] if o.name == "model" else base)])
        cfg = _config(["serve", *([] if o.name == "model" else base), *given])
        assert getattr(cfg, o.into) != getattr(at_default, o.into), o.name


def test_file_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.toml"
    path.write_text("max_running = 3\nmax_queued = 10\nhung_timeout = 5\n")
    assert _config(["serve", "--config", str(path)]).max_running == 3
    monkeypatch.setenv("LIFECYCLE_MAX_RUNNING", "4")
    monkeypatch.setenv("LIFECYCLE_SCRIPTED_WORKER", "yes")
    monkeypatch.setenv("LIFECYCLE_NATIVE", "0")  # not an option: left alone
    cfg = _config(["serve", "--config", str(path)])
    assert (cfg.max_running, cfg.max_queued, cfg.hung_timeout) == (4, 10, 5.0)
    assert cfg.worker_module == "lifecycle.testing.scripted_worker"
    cfg = _config(["serve", "--config", str(path), "--max-running", "5", "--max-queued=11"])
    assert (cfg.max_running, cfg.max_queued) == (5, 11)
    # batch reads the same, without the listener's options
    assert _config(["batch", "i", "o", "--config", str(path)]).max_running == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_runing = 3\n", "unknown option 'max_runing'; did you mean 'max_running'?"),
        ('max_running = "many"\n', "max_running: expected an integer, got 'many'"),
        ("max_running = true\n", "max_running: expected an integer, got True"),
        ("scripted_worker = 3\n", "scripted_worker: expected true or false, got 3"),
        ("api_key = [1, 2]\n", "api_key: expected a string or a list of strings"),
        ("max_running = \n", "Invalid value"),
    ],
)
def test_bad_files_are_refused_by_name(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        file_values(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_a_server_key_is_refused_where_there_is_no_server(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("port = 1\n")
    with pytest.raises(ConfigError, match="'port' is an option of the HTTP server"):
        file_values(path, server=False)
    assert env_values({"LIFECYCLE_PORT": "1"}, server=False) == {}
    with pytest.raises(ConfigError, match="LIFECYCLE_MAX_QUEUED: expected an integer"):
        env_values({"LIFECYCLE_MAX_QUEUED": "lots"})


def test_an_unknown_key_stops_serve_with_its_name(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("max_running = 2\ncolour = 'blue'\n")
    done = subprocess.run(
        [sys.executable, "-m", "lifecycle", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    assert "unknown option 'colour'" in done.stderr and str(path) in done.stderr


def test_the_engine_reads_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lifecycle import Engine

    path = tmp_path / "c.toml"
    path.write_text("scripted_worker = true\nmax_queued = 17\nmax_running = 2\n")
    monkeypatch.setenv("LIFECYCLE_MAX_RUNNING", "3")
    with Engine(config=path, max_pending=5) as engine:
        cfg = engine.config
        assert (cfg.max_queued, cfg.max_running, cfg.max_pending) == (17, 3, 5)
        assert engine.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
        assert engine.server_info()["internal_states"][0]["capacity"]["max_running"] == 3
