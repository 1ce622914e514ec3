"""llama.cpp's ``llama-server`` in ``bench/speculative.py``'s rotation, without and with its
own n-gram speculation: the flags its ``--help`` offers for it, the two servers started
(``bench/llama_server.py``'s binary and command line, plus those flags for the second),
and the untimed non-streaming requests to its ``/completion``, whose ``timings`` give the
acceptance. ``start_contender`` starts ``bench/speculative.py``'s own servers as well.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from bench import llama_server
from bench.apis import RequestSpec
from bench.contenders import ROOT, Contender
from bench.procs import ServerProcess, free_port
from bench.workload import Prompt

if TYPE_CHECKING:
    from bench.speculative import SameTokens

__all__ = [
    "LABELS",
    "PROBE_PATH",
    "ngram_flags",
    "probe_body",
    "probe_reading",
    "same_line",
    "start_contender",
    "start_peers",
]

LABELS = ("llama-off", "llama-ngram")  # (without, with) its speculation
PROBE_PATH = "/completion"  # llama-server's own API: its response carries ``timings``


def ngram_flags(help_text: str, tokens: int, match: int = 4) -> list[str] | None:
    """llama-server's flags for its own n-gram speculation, from its ``--help``: the
    ``--spec-type`` n-gram variant (``ngram-simple`` first: prompt lookup, as ours), its
    lookup length ``match`` (ours: ``--speculative-ngram-max``; its default is 12) and
    draft length ``tokens`` where the build names them (``--spec-ngram-simple-size-n`` /
    ``-size-m``; older builds: ``--draft-max``); None where the build has no
    ``--spec-type`` with an n-gram type."""
    line = next((ln for ln in help_text.splitlines() if "--spec-type" in ln), "")
    kinds = list(dict.fromkeys(re.findall(r"ngram[\w-]*", line)))
    if not kinds:
        return None
    kind = "ngram-simple" if "ngram-simple" in kinds else kinds[0]
    flags = ["--spec-type", kind]
    if kind == "ngram-simple" and "--spec-ngram-simple-size-m" in help_text:
        return [*flags, "--spec-ngram-simple-size-n", str(match),
                "--spec-ngram-simple-size-m", str(tokens)]  # fmt: skip
    removed = "--draft-max N" in help_text and "has been removed" in help_text
    if "--draft-max" in help_text and not removed:
        return [*flags, "--draft-max", str(tokens)]
    return flags


def start_contender(
    label: str, argv: list[str], spec: RequestSpec, kind: str, start_timeout: float
) -> Contender | None:
    """Start ``argv`` (its ``--port``) from the repository root and wait for ``/health``;
    None, with a note, where it does not start."""
    print(f"starting {label}: {shlex.join(argv)}", flush=True)
    try:
        proc = ServerProcess.start(
            label,
            argv,
            int(argv[argv.index("--port") + 1]),
            "/health",
            start_timeout,
            cwd=ROOT,
        )
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"{label} did not start, leaving it out:\n{exc}", file=sys.stderr)
        return None
    return Contender(label, proc, spec, kind=kind)


def start_peers(
    model: str, tokens: int, binary: str | None, start_timeout: float
) -> list[Contender]:
    """llama-server (``binary``, else ``make bench-peer``'s build) on ``model`` twice:
    ``llama-off`` as it is, ``llama-ngram`` with ``ngram_flags`` (draft length
    ``tokens``); none, with a note, where it is not built or has no n-gram speculation."""
    path = llama_server.binary_path(binary)
    if note := llama_server.skip_note(path):
        print(note, file=sys.stderr)
        return []
    help_run = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=60)
    flags = ngram_flags(help_run.stdout + help_run.stderr, tokens)
    if flags is None:
        print(
            f"{path} has no n-gram speculation (no --spec-type ngram-* in its --help): "
            "skipping the peer",
            file=sys.stderr,
        )
        return []
    out = []
    for label, extra in zip(LABELS, ([], flags), strict=True):
        argv = llama_server.server_argv(path, model, free_port()) + extra
        c = start_contender(label, argv, llama_server.peer_spec(), "llama-server", start_timeout)
        if c is not None:
            out.append(c)
    return out


def probe_body(p: Prompt, spec: RequestSpec) -> bytes:
    """One greedy non-streaming ``/completion`` request for ``p`` (``ignore_eos`` where
    ``spec`` forces the length)."""
    eos = {"ignore_eos": True} if spec.ignore_eos == "flag" else {}
    fields = {"prompt": p.prompt, "n_predict": p.output_len, "temperature": 0.0, **eos}
    return json.dumps(fields).encode()


def probe_reading(obj: dict[str, Any]) -> tuple[str, tuple[Any, Any, None]]:
    """A ``/completion`` response's text and its (proposed, accepted, verify steps) draft
    tokens from its ``timings`` (None where absent; it reports no verify steps)."""
    t = obj.get("timings") or {}
    return obj.get("content", ""), (t.get("draft_n"), t.get("draft_n_accepted"), None)


def same_line(same: SameTokens) -> str:
    """The report's line on llama-server's own texts without and with its speculation."""
    return (
        f"llama-server, its own texts without and with its speculation: "
        f"{len(same.mismatches)} of {same.compared} differ (not our promise)"
    )
