"""One definition of the options (lifecycle/options.py): ``lifecycle serve``'s flags and
``Engine(...)``'s keywords are the same table and give the same configuration."""

from __future__ import annotations

import pytest

from lifecycle.app import AppConfig
from lifecycle.cli import _build_parser
from lifecycle.option_args import engine_values, option_values
from lifecycle.options import OPTIONS
from lifecycle.runtime import app_config


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


def test_help_shows_each_default_and_it_is_the_one_that_runs(capsys) -> None:
    """Issue 40: ``--help`` showed no defaults (and one it described, the CPU KV cache's
    1024 MiB, was not the code's). Each option with a default shows it, and the config a
    server runs with by default holds exactly that value."""
    import dataclasses

    from wire.worker_options import DEFAULT_CPU_KV_MIB

    with pytest.raises(SystemExit):
        _build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    running = app_config(engine_values(None, {}))
    fields = {f.name: f.default for f in dataclasses.fields(AppConfig)}
    checked = 0
    for o in OPTIONS:
        if o.type is None or o.repeat or o.default in (None, ""):
            continue
        assert f"(default: {o.default})" in text, o.name
        if o.into == o.name:  # the AppConfig field of its name
            assert getattr(running, o.name) == o.default, o.name
            assert fields[o.name] == o.default, f"AppConfig's {o.name} default differs"
            checked += 1
    assert checked >= 8
    assert f"(default: {DEFAULT_CPU_KV_MIB} on the CPU" in text  # the worker's own figure


def test_the_model_id_is_the_files_name_without_spaces(tmp_path) -> None:
    """Issue 40: the default id was the file's ``general.name``, "Smollm2 135M 8k Lc100K
    Mix1 Ep2", spaces included. It is the file's name without ``.gguf`` (a folder's name,
    dots kept), unless ``--served-model-name`` says otherwise."""
    from lifecycle.runtime import model_id

    assert model_id(AppConfig(), "/m/SmolLM2-135M-Instruct.Q4_1.gguf") == (
        "SmolLM2-135M-Instruct.Q4_1"
    )
    folder = tmp_path / "Qwen2.5-0.5B-Instruct"
    folder.mkdir()
    assert model_id(AppConfig(), str(folder)) == "Qwen2.5-0.5B-Instruct"
    assert model_id(AppConfig(served_model_name="mine"), str(folder)) == "mine"


def test_the_worker_options_are_one_table() -> None:
    """Issue 38: the worker's options are declared once (``wire.worker_options``). Its
    argparse, ``WorkerConfig``'s fields and defaults, ``lifecycle serve``'s forwarded
    options (name, type, help) and what ``worker_args`` passes on all come from that
    table: every forwarded option set on ``lifecycle serve`` reaches the worker's config
    with its value."""
    import dataclasses

    from gpu.worker.config import WorkerConfig, parse_config
    from lifecycle.runtime import worker_args
    from wire.worker_options import WORKER_OPTIONS, worker_defaults

    fields = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}
    assert fields == worker_defaults()
    assert dataclasses.replace(parse_config([]), token=None) == WorkerConfig()
    by_name = {o.name: o for o in OPTIONS}
    samples = {int: 7, float: 0.5, str: "x"}
    given: dict[str, object] = {}
    for w in WORKER_OPTIONS:
        if not w.forwarded:
            continue
        serve = by_name[w.serve_name or w.name]
        if w.serve_name is None:  # "model" says more on the serve side
            assert serve.type == w.type and serve.help.endswith(w.help_with_default), w.name
        given[w.serve_name or w.name] = (
            w.choices[-1] if w.choices else "cuda:1" if w.form else samples[w.type]
        )
    # the worker takes one KV size at a time: each in its own round
    for drop in ("kv_cache_tokens", "kv_memory_mib"):
        values = {k: v for k, v in given.items() if k != drop}
        worker = parse_config(list(worker_args(app_config(engine_values(None, values)))))
        for w in WORKER_OPTIONS:
            name = w.serve_name or w.name
            if w.forwarded and name != drop:
                assert getattr(worker, w.name) == values[name], w.name


def test_each_option_is_declared_once() -> None:
    """Issue 57: each option was listed three times (``OPTIONS``, ``AppConfig``'s fields,
    the ``_PLAIN`` names in runtime.py). ``AppConfig``'s declarations are now the one
    list: in lifecycle/options.py each option's name is written once (a field declared
    with ``option()`` or ``forwarded()``, or the ``Option`` a field is fed by or the
    process takes), every option names the ``AppConfig`` field it sets, and no module
    holds a list or a class of option names again (a restated list fails here)."""
    import ast
    import dataclasses
    from collections import Counter
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    names = {o.name for o in OPTIONS}
    assert len(names) == len(OPTIONS)
    written: Counter[str] = Counter()
    for node in ast.walk(ast.parse((root / "lifecycle/options.py").read_text())):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            made_by = getattr(getattr(node.value, "func", None), "id", "")
            if made_by in ("option", "forwarded"):
                written[node.target.id] += 1
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Option":
            if isinstance(node.args[0], ast.Constant):  # not the makers' Option(name, ...)
                written[node.args[0].value] += 1
    assert written == Counter(names)

    fields = {f.name for f in dataclasses.fields(AppConfig)}
    assert fields & names == {o.name for o in OPTIONS if o.into == o.name}
    assert {o.into for o in OPTIONS} - {None} <= fields
    assert {o.name for o in OPTIONS if o.into is None} == {"faults", "log_level"}  # the process's

    for path in sorted((root / "lifecycle").rglob("*.py")):
        schema = path == root / "lifecycle/options.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                listed = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            elif isinstance(node, ast.ClassDef) and not (schema and node.name == "AppConfig"):
                listed = [s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]  # fmt: skip
            else:
                continue
            restated = names.intersection(listed)
            assert len(restated) < 8, f"{path}:{node.lineno} lists options again: {restated}"


def test_each_fields_type_is_its_options() -> None:
    """The flag of an option field reads the field's annotated type (a forwarded one's
    is the worker's, which the annotation must agree with)."""
    import typing

    hints = typing.get_type_hints(AppConfig)
    for o in OPTIONS:
        if o.into != o.name or o.type is None or getattr(o.type, "__name__", "") == "<lambda>":
            continue
        kinds = {k for k in typing.get_args(hints[o.name]) if k is not type(None)}
        kinds = {typing.get_args(k)[0] if typing.get_args(k) else k for k in kinds}
        if o.name != "restart_backoff":  # a comma list, read by runtime._backoff
            assert o.type in kinds or hints[o.name] is o.type, o.name
