"""Models named by Hugging Face Hub repo id (issue 55, point 1): ``--model
ORG/NAME[:QUANT]`` with ``--revision`` and ``--hf-file``, resolved once by
``modelfile.hub.resolve_model`` in huggingface_hub's own cache.

No test reaches the Hub: each builds a cache in the library's on-disk layout
(``models--ORG--NAME/{blobs,refs/main,snapshots/<commit>}``, the snapshot's files
symlinks to their blobs) and resolves from it offline (``HF_HUB_OFFLINE=1``,
``HF_HUB_CACHE``). The repos hold one tiny random Llama (tests/hf_reference.py): a GGUF
repo with its Q4_K_M and Q8_0 files, a safetensors repo with its transformers folder,
and a repo of two quants with no Q4_K_M (ambiguous without a tag).
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import httpx
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lifecycle.app import AppConfig
from lifecycle.engine import EngineError
from lifecycle.runtime import model_id
from modelfile.hub import (
    HubModelError,
    choose_files,
    parse_repo_spec,
    progress_lines,
    resolve_model,
)
from tests.hf_reference import FAMILIES, build_hf, write_family_gguf
from tests.hub_cache import COMMIT, Files, fake_hub, hub_repo
from tests.scripted import lifecycle_server
from tests.test_hf_folder import save_folder
from tests.test_model_check import _assert_one_line, _run

pytest.importorskip("transformers")

GGUF_REPO, FOLDER_REPO, MULTI_REPO = "org/tiny-GGUF", "org/tiny", "org/tiny-multi-GGUF"
ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Hub:
    cache: pathlib.Path
    repos: dict[str, Files]  # what the cache holds, by repo id
    folder: pathlib.Path  # the safetensors folder, by path
    q8_0: pathlib.Path  # the Q8_0 GGUF, by path


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Hub:
    fam, root = FAMILIES["llama"], tmp_path_factory.mktemp("hub")
    model = build_hf(fam, dtype=torch.float32)
    folder = save_folder(model, root / "folder")
    q8 = write_family_gguf(fam, model, root / "tiny-Q8_0.gguf", Q.Q8_0)
    q4km = write_family_gguf(fam, model, root / "tiny-Q4_K_M.gguf", "Q4_K_M")
    q4 = write_family_gguf(fam, model, root / "tiny-Q4_0.gguf", Q.Q4_0)
    readme = "# tiny\n"
    repos: dict[str, Files] = {
        GGUF_REPO: {"Tiny-Q4_K_M.gguf": q4km, "Tiny-Q8_0.gguf": q8, "README.md": readme},
        MULTI_REPO: {"tiny.Q4_0.gguf": q4, "tiny.Q8_0.gguf": q8},
        FOLDER_REPO: {**{f.name: f for f in folder.iterdir()}, "README.md": readme,
                      "pytorch_model.bin": "not read", "original/consolidated.safetensors": "no"},
    }  # fmt: skip
    for repo, files in repos.items():
        hub_repo(root / "cache", repo, files)
    return Hub(root / "cache", repos, folder, q8)


@pytest.fixture
def offline(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> Hub:
    """The hub cache offline, for subprocesses (the environment) and in-process calls
    (huggingface_hub read both variables when it was imported)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


# -- the choice: pure functions over a repo's file list -------------------------------

GGUFS = ["Qwen-Q4_K_M.gguf", "Qwen-Q4_K_S.gguf", "Qwen-Q8_0.gguf", "mmproj-Qwen-f16.gguf",
         "README.md"]  # fmt: skip
CHOICES: list[tuple[list[str], str | None, str | None, str]] = [
    (GGUFS, "q8_0", None, "Qwen-Q8_0.gguf"),  # the tag, case-insensitive
    (GGUFS, "Q4_K_S", None, "Qwen-Q4_K_S.gguf"),
    (GGUFS, None, None, "Qwen-Q4_K_M.gguf"),  # no tag: Q4_K_M, as llama-server
    (["only.Q5_K_M.gguf", "mmproj-f16.gguf"], None, None, "only.Q5_K_M.gguf"),  # the one file
    (GGUFS, None, "Qwen-Q4_K_S.gguf", "Qwen-Q4_K_S.gguf"),  # --hf-file
    (["config.json", "model.safetensors", "m-Q8_0.gguf"], "Q8_0", None, "m-Q8_0.gguf"),
    (["sub/m-Q6_K.gguf", "m-Q6_K_L.gguf"], "q6_k", None, "sub/m-Q6_K.gguf"),
]  # fmt: skip
REFUSED: list[tuple[list[str], str | None, str | None, str]] = [
    (GGUFS, "Q5_K_M", None, "no GGUF file for the quant 'Q5_K_M' (its GGUF files: "
                            "Qwen-Q4_K_M.gguf, Qwen-Q4_K_S.gguf, Qwen-Q8_0.gguf)"),
    (GGUFS, "Q4_K", None, "no GGUF file for the quant 'Q4_K'"),  # a whole word only
    (["a-Q8_0.gguf", "a-Q4_0.gguf"], None, None, "several GGUF files and no quant tag: name "
     "one as o/r:QUANT or with --hf-file (its GGUF files: a-Q4_0.gguf, a-Q8_0.gguf)"),
    (["x/a-Q8_0.gguf", "y/a-Q8_0.gguf"], "Q8_0", None, "several GGUF files match 'Q8_0'"),
    (GGUFS, None, "nope.gguf", "no file 'nope.gguf' in the repo"),
    (["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"], None, None,
     "m-Q8_0-00001-of-00002.gguf is split in 2 parts, which this runtime does not read"),
    (["config.json", "pytorch_model.bin"], None, None, "no *.safetensors weights"),
    (["README.md"], None, None, "neither a GGUF file nor a config.json"),
    (["config.json", "model.safetensors"], "Q8_0", None, "no GGUF file for the quant 'Q8_0' "
                                                         "(it has no GGUF file)"),
]  # fmt: skip


@pytest.mark.parametrize(("files", "quant", "hf_file", "chosen"), CHOICES)
def test_a_gguf_repo_gives_the_file_its_tag_names(
    files: list[str], quant: str | None, hf_file: str | None, chosen: str
) -> None:
    assert choose_files("o/r", quant, hf_file, files) == (chosen, [chosen])


@pytest.mark.parametrize(("files", "quant", "hf_file", "problem"), REFUSED)
def test_what_cannot_be_chosen_is_one_error(
    files: list[str], quant: str | None, hf_file: str | None, problem: str
) -> None:
    with pytest.raises(HubModelError) as exc:
        choose_files("o/r", quant, hf_file, files)
    assert str(exc.value).startswith("o/r: ") and problem in str(exc.value), str(exc.value)


def test_a_safetensors_repo_gives_only_what_serving_reads() -> None:
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "README.md", "pytorch_model.bin", "vocab.json",
             "original/consolidated.safetensors", "onnx/model.onnx", ".gitattributes"]  # fmt: skip
    files.append("extra-Q8_0.gguf")  # a GGUF beside the weights: taken only by its tag
    assert choose_files("o/r", None, None, files) == ("", [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json"])  # fmt: skip


def test_what_names_a_repo(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_repo_spec("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert parse_repo_spec("bartowski/x-GGUF:q4_k_m") == ("bartowski/x-GGUF", "q4_k_m")
    for spec in ("hf.co/o/r:Q8_0", "huggingface.co/o/r:Q8_0", "https://huggingface.co/o/r:Q8_0"):
        assert parse_repo_spec(spec) == ("o/r", "Q8_0"), spec
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m").write_text("")
    for path in ("models/m", "./a/b", "/a/b", "~/a", "a/b/c", "a/m.gguf", "m.gguf", "m"):
        assert parse_repo_spec(path) is None, path


def test_off_a_terminal_a_download_is_a_log_line_now_and_then(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The bar given to snapshot_download when stderr is not a terminal: its start and
    its end as log lines, none between within ``PROGRESS_EVERY_S``, no carriage return."""
    caplog.set_level(logging.INFO, "modelfile.hub")
    bar = progress_lines()(desc="Downloading", total=1000, unit="B", unit_scale=True)
    for _ in range(100):
        bar.update(10)
    bar.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "modelfile.hub"]
    assert len(lines) == 2 and "0%" in lines[0] and "100%" in lines[1], lines
    assert all(line.startswith("Downloading") and "\r" not in line for line in lines)


# -- resolved from a cache built here, offline -----------------------------------------


def test_a_repo_id_resolves_in_the_cache(offline: Hub) -> None:
    snapshot = _snapshot(offline, GGUF_REPO)
    got = resolve_model("org/tiny-GGUF:q8_0")
    assert (got.path, got.repo_id) == (str(snapshot / "Tiny-Q8_0.gguf"), GGUF_REPO)
    assert resolve_model(GGUF_REPO).path == str(snapshot / "Tiny-Q4_K_M.gguf")
    assert resolve_model(GGUF_REPO, COMMIT, "Tiny-Q8_0.gguf").path == got.path
    folder = resolve_model(FOLDER_REPO)
    assert (folder.path, folder.repo_id) == (str(_snapshot(offline, FOLDER_REPO)), FOLDER_REPO)
    assert resolve_model(str(offline.q8_0)).path == str(offline.q8_0)  # a path as it is
    with pytest.raises(HubModelError, match="no model repo at revision 'v2' in the Hugging"):
        resolve_model(GGUF_REPO, "v2")


def test_an_unreachable_hub_leaves_the_cache(offline: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online but the Hub does not answer (here a closed port): the cached snapshot is
    served, and a repo the cache lacks names the endpoint it could not reach."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    got = resolve_model("org/tiny-GGUF:Q8_0")
    assert got.path == str(_snapshot(offline, GGUF_REPO) / "Tiny-Q8_0.gguf")
    with pytest.raises(HubModelError) as exc:
        resolve_model("org/absent")
    assert str(exc.value).startswith(
        f"org/absent: no such file or folder, and no model repo in the Hugging Face cache "
        f"{offline.cache}: http://127.0.0.1:9 could not be reached (Connect"  # the transport's
    ), str(exc.value)


def test_a_repo_the_hub_does_not_know_is_named_with_both_places(
    offline: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online, a repo the Hub does not know (a typo, or private without a token) and
    the cache lacks: one error naming the cache and the Hub, and the token's variable."""
    from huggingface_hub import constants

    with fake_hub({}) as fake:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", fake.endpoint)
        with pytest.raises(HubModelError) as exc:
            resolve_model("org/private")
    assert str(exc.value) == (
        f"org/private: no such file or folder, and no model repo in the Hugging Face cache "
        f"{offline.cache}: not on {fake.endpoint} either (a private or gated repo needs "
        "HF_TOKEN)"
    )


def test_the_model_id_is_the_repo_id() -> None:
    """A repo id is the model's id; a hub snapshot folder given by path is its repo's (not
    the commit hash); a file keeps its name; ``--served-model-name`` overrides each."""
    snapshot = f"/c/models--org--tiny/snapshots/{COMMIT}"
    assert model_id(AppConfig(model_repo=GGUF_REPO), "/c/x/Tiny-Q8_0.gguf") == GGUF_REPO
    assert model_id(AppConfig(), "/c/models--o--r/snapshots/abc/Tiny-Q8_0.gguf") == "Tiny-Q8_0"
    assert model_id(AppConfig(served_model_name="mine", model_repo=GGUF_REPO), snapshot) == "mine"


def test_a_snapshot_folder_by_path_is_named_by_its_repo(offline: Hub) -> None:
    assert model_id(AppConfig(), str(_snapshot(offline, FOLDER_REPO))) == FOLDER_REPO
    assert model_id(AppConfig(), str(offline.folder)) == offline.folder.name


def _greedy(base: str) -> tuple[list[int], list[str]]:
    """/generate's greedy output_ids for a fixed prompt, and /v1/models' ids."""
    r = httpx.post(
        base + "/generate",
        json={"input_ids": [5, 9, 17, 33, 65, 129], "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    models = httpx.get(base + "/v1/models", timeout=10).json()["data"]
    return r.json()["output_ids"], [m["id"] for m in models]


def _snapshot(hub: Hub, repo: str) -> pathlib.Path:
    return hub.cache / ("models--" + repo.replace("/", "--")) / "snapshots" / COMMIT


@pytest.mark.parametrize(("spec", "entry", "by_path"), [
    ("org/tiny-GGUF:q8_0", "Tiny-Q8_0.gguf", "q8_0"), (FOLDER_REPO, "", "folder")])  # fmt: skip
def test_a_repo_is_served_by_its_id(offline: Hub, spec: str, entry: str, by_path: str) -> None:
    """Served by repo id, offline from the cache: the repo id in /v1/models, and the
    greedy tokens of the same weights served by path."""
    repo = spec.split(":")[0]
    with lifecycle_server("--model", spec, "--device", "cpu") as base:
        ids, names = _greedy(base)
        info = httpx.get(base + "/model_info", timeout=10).json()
    assert names == [repo]
    assert info["model_path"] == str(_snapshot(offline, repo) / entry)
    path: pathlib.Path = getattr(offline, by_path)
    with lifecycle_server("--model", str(path), "--device", "cpu") as base:
        want, names = _greedy(base)
    assert ids == want and names == [path.name.removesuffix(".gguf")]


def test_online_only_what_serving_reads_is_downloaded(hub: Hub, tmp_path: pathlib.Path) -> None:
    """Online, from a stand-in for the Hub at ``HF_ENDPOINT`` (tests/hub_cache.py), into
    an empty cache: a GGUF repo's chosen file only, a safetensors repo's serving files
    only (no README, .bin or original/), byte for byte, with the download's progress in
    the log (stderr is not a terminal)."""
    code = ("import logging, sys; logging.basicConfig(level='INFO');"
            "from modelfile.hub import resolve_model;"
            "[print(resolve_model(spec).path) for spec in sys.argv[1:]]")  # fmt: skip
    cache = tmp_path / "hf" / "hub"
    with fake_hub(hub.repos) as fake:
        env = {**os.environ, "HF_ENDPOINT": fake.endpoint, "HF_HOME": str(tmp_path / "hf"),
               "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
        for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
            env.pop(name, None)
        done = subprocess.run([sys.executable, "-c", code, "org/tiny-GGUF:Q8_0", FOLDER_REPO],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    gguf, folder = (pathlib.Path(p) for p in done.stdout.split())
    assert (gguf.read_bytes(), gguf.parent.name) == (hub.q8_0.read_bytes(), COMMIT)
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["Tiny-Q8_0.gguf"]
    assert gguf.parent.parent.parent.parent == cache  # HF_HOME's hub/
    assert sorted(p.name for p in folder.iterdir()) == sorted(f.name for f in hub.folder.iterdir())
    assert all((folder / f.name).read_bytes() == f.read_bytes() for f in hub.folder.iterdir())
    assert not [r for r in fake.requests if "README" in r or ".bin" in r or "original" in r]
    assert "INFO:modelfile.hub:Fetching 1 files: 100%" in done.stderr, done.stderr


# -- refused before listening: one line naming the repo and where it looked ------------


@pytest.mark.parametrize(("spec", "problem"), [
    ("org/absent", "no such file or folder, and no model repo in the Hugging Face cache {cache}: "
                   "offline (HF_HUB_OFFLINE)"),
    ("org/tiny-GGUF:Q5_K_M", "no GGUF file for the quant 'Q5_K_M' (its GGUF files: "
                             "Tiny-Q4_K_M.gguf, Tiny-Q8_0.gguf); listed from the Hugging Face "
                             "cache {cache}"),
    (MULTI_REPO, "several GGUF files and no quant tag: name one as org/tiny-multi-GGUF:QUANT"),
])  # fmt: skip
def test_serve_refuses_a_repo_it_cannot_find(offline: Hub, spec: str, problem: str) -> None:
    done = _run("-m", "lifecycle", "serve", "--model", spec, "--port", "0", "--device", "cpu")
    _assert_one_line(done, spec.split(":")[0], problem.format(cache=offline.cache))


def test_the_engine_resolves_the_same_way(offline: Hub) -> None:
    from lifecycle.engine import Engine

    with pytest.raises(EngineError, match=r"org/absent: no such file or folder, and no model"):
        Engine("org/absent")
    with Engine("org/tiny-GGUF:Q8_0", device="cpu") as engine:
        args = engine.server_info()
        out = engine.generate(input_ids=[5, 9, 17], sampling_params={"max_new_tokens": 2})
    assert args["served_model_name"] == GGUF_REPO and args["model_repo"] == GGUF_REPO
    assert args["model_path"] == str(_snapshot(offline, GGUF_REPO) / "Tiny-Q8_0.gguf")
    assert out["meta_info"]["completion_tokens"] == 2
