"""A model named as the Hugging Face Hub names it: ``ORG/NAME[:QUANT]``.

``resolve_model(spec, revision, hf_file)`` turns ``--model`` into a local path once,
before anything listens or spawns: a path is kept as it is; a repo id is listed (on the
Hub, or in the local cache when offline), the files serving needs are chosen
(``choose_files``) and fetched into huggingface_hub's own cache by ``snapshot_download``
(its progress bars, its resume, ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_TOKEN``,
``HF_HUB_OFFLINE``, as every tool of the ecosystem honours them). What cannot be found
or chosen is one ``HubModelError`` naming the repo and where it looked.

The choice, as llama-server makes it for a GGUF repo: the file whose name carries the
quant tag (case-insensitive: ``:q8_0`` picks ``...-Q8_0.gguf``); without a tag, the one
GGUF file, else the Q4_K_M one; several and no tag is refused, listing them. A
safetensors repo gives only what ``modelfile.hf_folder`` reads (config, tokenizer files,
the top-level weights), never the rest of the repo.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pathlib
import re
import sys
from dataclasses import dataclass
from typing import Any

from modelfile.gguf_meta import ModelFileError

__all__ = [
    "DEFAULT_QUANT",
    "PROGRESS_EVERY_S",
    "HubModelError",
    "ResolvedModel",
    "choose_files",
    "parse_repo_spec",
    "progress_lines",
    "repo_of_path",
    "resolve_model",
]

log = logging.getLogger("modelfile.hub")

PROGRESS_EVERY_S = 5.0  # off a terminal, a download's progress is a log line this often
DEFAULT_QUANT = "Q4_K_M"  # llama-server's choice when a repo has several files
# What modelfile.hf_folder reads of a folder, besides its *.safetensors.
_FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
)
# ORG/NAME, then an optional :QUANT (the Hub's names: letters, digits, '-', '_', '.').
_SPEC = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<quant>[\w.-]+))?")
_HUB_PREFIX = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class HubModelError(ModelFileError):
    """A repo, revision or file that cannot be found or chosen: ``ORG/NAME: problem``."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """``--model`` as a local path (None: the bundled default), and the repo it came
    from (the model's id), None for a path."""

    path: str | None
    repo_id: str | None = None


def parse_repo_spec(spec: str) -> tuple[str, str | None] | None:
    """``(repo id, quant tag or None)`` when ``spec`` names a Hub repo, else None: a
    path that exists, or one that looks like a path (``./``, ``~``, ``/``, two slashes,
    a ``.gguf`` name), is a path. The Hub's address before the id (``hf.co/``, as
    Ollama users write it, or ``https://huggingface.co/``) is dropped."""
    if os.path.exists(spec) or spec.startswith((".", "~", "/")):
        return None
    match = _SPEC.fullmatch(_HUB_PREFIX.sub("", spec))
    if match is None or match["repo"].lower().endswith(".gguf"):
        return None
    return match["repo"], match["quant"]


def repo_of_path(path: str | pathlib.Path) -> str | None:
    """The repo a hub cache snapshot folder (or a file in one) belongs to:
    ``.../models--ORG--NAME/snapshots/<commit>[/...]`` is ``ORG/NAME``; else None."""
    parts = pathlib.Path(path).parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return parts[i - 1].removeprefix("models--").replace("--", "/")
    return None


def _quant_matches(name: str, quant: str) -> bool:
    """Whether the file name carries the tag as a whole word: ``Q4_K`` is not in
    ``-Q4_K_M.gguf``, ``q8_0`` is in ``.Q8_0.gguf``."""
    base = name.rsplit("/", 1)[-1]
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", base, re.I) is not None


def _gguf_files(files: list[str]) -> list[str]:
    """The repo's model GGUF files (a vision projector ``mmproj*`` is not a model); of
    a split model, its first part only."""
    out = []
    for f in sorted(files):
        base = f.rsplit("/", 1)[-1].lower()
        if not base.endswith(".gguf") or base.startswith("mmproj"):
            continue
        split = _SPLIT.search(base)
        if split is None or int(split[1]) == 1:
            out.append(f)
    return out


def _gguf_choice(repo: str, quant: str | None, hf_file: str | None, files: list[str]) -> str:
    ggufs = _gguf_files(files)
    if hf_file is not None:
        if hf_file not in files:
            raise HubModelError(repo, f"no file {hf_file!r} in the repo ({_listed(ggufs)})")
        return hf_file
    if quant is not None:
        picked = [f for f in ggufs if _quant_matches(f, quant)]
        if not picked:
            raise HubModelError(repo, f"no GGUF file for the quant {quant!r} ({_listed(ggufs)})")
    elif len(ggufs) == 1:
        picked = ggufs
    else:
        picked = [f for f in ggufs if _quant_matches(f, DEFAULT_QUANT)]
        if len(picked) != 1:
            raise HubModelError(
                repo, f"several GGUF files and no quant tag: name one as {repo}:QUANT or "
                f"with --hf-file ({_listed(ggufs)})",
            )  # fmt: skip
    if len(picked) > 1:
        raise HubModelError(
            repo, f"several GGUF files match {quant!r}: name one with --hf-file "
            f"({_listed(picked)})",
        )  # fmt: skip
    return picked[0]


def _listed(ggufs: list[str]) -> str:
    return "its GGUF files: " + ", ".join(ggufs) if ggufs else "it has no GGUF file"


def choose_files(
    repo: str, quant: str | None, hf_file: str | None, files: list[str]
) -> tuple[str, list[str]]:
    """What to serve of a repo holding ``files``: ``(the entry, the files to fetch)``,
    the entry a GGUF file's path in the repo, or ``""`` for the repo's folder (a
    safetensors repo: one with a top-level config.json and weights, unless a quant tag
    or ``--hf-file`` names a GGUF file). Raises ``HubModelError``."""
    top = [f for f in files if "/" not in f]
    weights = [f for f in top if f.endswith(".safetensors")]
    folder = "config.json" in top and bool(weights)
    if quant is not None or hf_file is not None or (_gguf_files(files) and not folder):
        chosen = _gguf_choice(repo, quant, hf_file, files)
        if not chosen.lower().endswith(".gguf"):
            raise HubModelError(repo, f"--hf-file {chosen!r} is not a GGUF file")
        if (split := _SPLIT.search(chosen)) is not None:
            raise HubModelError(
                repo, f"{chosen} is split in {int(split[2])} parts, which this runtime does "
                "not read: join them (llama-gguf-split --merge) and serve the file by path",
            )  # fmt: skip
        return chosen, [chosen]
    if "config.json" not in top:
        raise HubModelError(repo, "neither a GGUF file nor a config.json in the repo")
    if not weights:
        raise HubModelError(repo, "no *.safetensors weights in the repo (.bin is not read)")
    return "", sorted({*weights, *(f for f in _FOLDER_FILES if f in top)})


def resolve_model(
    spec: str | None,
    revision: str | None = None,
    hf_file: str | None = None,
    *,
    cache_dir: str | pathlib.Path | None = None,
) -> ResolvedModel:
    """``--model`` (with ``--revision`` and ``--hf-file``) as a local path: a path as
    given; a repo id fetched into the Hugging Face cache (``cache_dir``, None: the
    library's, from ``HF_HUB_CACHE`` / ``HF_HOME``). Raises ``HubModelError``."""
    repo = parse_repo_spec(spec) if spec else None
    if repo is None:
        if revision is not None or hf_file is not None:  # as vLLM: they name a repo's files
            log.warning("--revision and --hf-file apply to a Hub repo id, not to %s", spec)
        return ResolvedModel(spec)
    repo_id, quant = repo
    commit, files, cached = _listing(repo_id, revision, cache_dir)
    try:
        entry, wanted = choose_files(repo_id, quant, hf_file, files)
    except HubModelError as exc:  # say where the list came from
        source = f"the Hugging Face cache {_where(cache_dir)}" if cached else _endpoint()
        raise HubModelError(repo_id, f"{exc.problem}; listed from {source}") from None
    folder = _fetch(repo_id, commit, wanted, cache_dir, offline=cached)
    return ResolvedModel(str(folder / entry) if entry else str(folder), repo_id)


def _where(cache_dir: str | pathlib.Path | None) -> str:
    from huggingface_hub import constants

    return str(cache_dir or constants.HF_HUB_CACHE)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _listing(
    repo: str, revision: str | None, cache_dir: str | pathlib.Path | None
) -> tuple[str, list[str], bool]:
    """``(commit, the repo's files, whether they come from the cache)``: the Hub's list
    at ``revision`` (None: main), or, offline or when the Hub cannot be reached, the
    cached snapshot's."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RevisionNotFoundError

    online_error: Exception | None = None
    if not constants.HF_HUB_OFFLINE:
        try:  # within the library's own timeout for metadata (HF_HUB_ETAG_TIMEOUT)
            info = HfApi().model_info(
                repo, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT
            )
            return str(info.sha), [s.rfilename for s in info.siblings or ()], False
        except RevisionNotFoundError:
            raise HubModelError(repo, f"no revision {revision!r} on {constants.ENDPOINT}") from None
        # Not found (a typo; private or gated without a token), or unreachable: the cache
        # may hold it. Any error: the transport's classes differ between huggingface_hub
        # versions (requests, httpx, httpx2), as snapshot_download's own fallback knows.
        except Exception as exc:
            online_error = exc
    return (*_cached_listing(repo, revision, cache_dir, online_error), True)


def _cached_listing(
    repo: str, revision: str | None, cache_dir: str | pathlib.Path | None, online: Exception | None
) -> tuple[str, list[str]]:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        folder = pathlib.Path(
            snapshot_download(repo, revision=revision, cache_dir=cache_dir, local_files_only=True)
        )
    except (OSError, ValueError):
        at = f" at revision {revision!r}" if revision else ""
        if online is None:
            why = "offline (HF_HUB_OFFLINE)"
        elif isinstance(online, RepositoryNotFoundError):
            why = f"not on {constants.ENDPOINT} either (a private or gated repo needs HF_TOKEN)"
        else:
            first = (str(online).splitlines() or [""])[0][:160]
            why = f"{constants.ENDPOINT} could not be reached ({type(online).__name__}: {first})"
        raise HubModelError(
            repo, f"no such file or folder, and no model repo{at} in the Hugging Face cache "
            f"{_where(cache_dir)}: {why}",
        ) from None  # fmt: skip
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return folder.name, sorted(files)


def _fetch(
    repo: str,
    commit: str,
    files: list[str],
    cache_dir: str | pathlib.Path | None,
    *,
    offline: bool,
) -> pathlib.Path:
    """The snapshot folder holding ``files`` of ``repo`` at ``commit``, downloaded where
    they are not cached yet (on a terminal the library's progress bars, else a log line
    every few seconds; an interrupted download resumes)."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo,
            revision=commit,
            cache_dir=cache_dir,
            allow_patterns=files,
            local_files_only=offline,
            tqdm_class=None if sys.stderr.isatty() else progress_lines(),
        )
    except Exception as exc:  # the transport's error classes vary (see _listing)
        problem = " ".join(str(exc).split())  # the library's messages span lines
        raise HubModelError(repo, f"cannot fetch {', '.join(files)}: {problem}") from None
    missing = [f for f in files if not (pathlib.Path(folder) / f).is_file()]
    if missing:
        raise HubModelError(repo, f"{', '.join(missing)} missing from the cache {folder}")
    return pathlib.Path(folder)


@functools.cache
def progress_lines() -> type[Any]:
    """A tqdm class that writes its bar as a log line at most every
    ``PROGRESS_EVERY_S`` seconds (and at the end), for a download whose stderr is a log,
    not a terminal (where the library's own bars, redrawn in place, would be noise)."""
    from tqdm import tqdm

    class ProgressLines(tqdm):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)  # huggingface_hub's own bars take a name; tqdm does not
            kwargs.update(file=io.StringIO(), mininterval=PROGRESS_EVERY_S, disable=False)
            self.last_line = ""
            super().__init__(*args, **kwargs)

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            line = " ".join((msg or str(self)).split())
            if line and line != self.last_line:  # a bar refreshed, then closed: one line
                log.info("%s", line)
                self.last_line = line
            return True

    return ProgressLines
