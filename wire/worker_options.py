"""The worker's options, declared once as torch-free data (``python -m gpu.worker --help``).

``gpu/worker/config.py`` builds the worker's argparse and ``WorkerConfig``'s defaults
from this table; ``lifecycle serve`` offers the options marked ``forwarded`` under the
same name and help, and passes the ones set on to the worker it spawns
(``lifecycle.runtime.worker_args``); the scripted worker takes those marked
``scripted``. Defaults that the worker picks at start (by device) are ``None`` here, and
the help says what it picks. Neither side imports the other: this module is the contract
between them, like the rest of ``wire``.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = [
    "CPU_MIXED_PREFILL_TOKENS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CPU_KV_MIB",
    "DEFAULT_MEM_FRACTION",
    "DEFAULT_PREFIX_CACHE_DISK_MIB",
    "DEVICE_FORM",
    "DTYPES",
    "GRAPH_MODES",
    "KERNEL_MODES",
    "MIXED_GRAPH_MODES",
    "KV_CACHE_DTYPES",
    "OneLineParser",
    "OVERLAP_MODES",
    "SPECULATIVE_MODES",
    "WEIGHT_MODES",
    "WORKER_OPTIONS",
    "WorkerOption",
    "refused_combination",
    "refused_value",
    "value_parser",
    "worker_defaults",
]

GRAPH_MODES = ("auto", "on", "eager", "off")  # gpu/backends/graphs.py
MIXED_GRAPH_MODES = ("auto", "off")  # gpu/backends/piecewise.py: auto is with the decode graphs
KERNEL_MODES = ("torch", "triton")  # gpu/kernels/kernel_choice.py
OVERLAP_MODES = ("auto", "on", "off")  # gpu/runtime/engine.py, Engine.step
SPECULATIVE_MODES = ("off", "ngram", "draft")  # gpu/runtime/speculation.py
WEIGHT_MODES = ("auto", "quantized", "fp32", "q8_0", "q4_0")  # gpu/model/loader.py
KV_CACHE_DTYPES = ("auto", "fp16", "bf16", "fp32", "q8_0", "q4_0")  # gpu/cache/kv_cache.py
# --dtype's names, each to torch's name of the type (gpu/model/loader.py, resolve_device)
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16",
          "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}  # fmt: skip
DEVICE_FORM = (r"cpu|cuda(:\d+)?", "cpu, cuda or cuda:N")  # a pattern, and it in words
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block; the frontend reads it from HELLO
# 29,120 tokens of SmolLM2 in the CPU's default fp16 cache (23,040 bytes each; 14,560 in
# fp32), near llama-server's default 32k-token f16 cache: with the quantized weights
# (96 MiB) and the rest (~260 MiB) the worker stays near llama-server's resident size.
DEFAULT_CPU_KV_MIB = 640
DEFAULT_PREFIX_CACHE_DISK_MIB = 4096  # --prefix-cache-dir's bound (gpu/cache/disk.py)
DEFAULT_MEM_FRACTION = 0.85  # CUDA: the KV cache's share of free memory (gpu/cache/memory.py)
# On the CPU a step's time grows with its rows (about 1.8 ms a row at 32-64 rows), so a
# prompt chunk that joins the decodes lengthens every stream's gap. Capping a mixed
# step's prompt tokens at 32, measured 2026-12-04 (64 tokens in, 64 out, streaming):
# at 32 streams ITL p50 / p99 104 / 126 ms at 277 tok/s, against 75 / 144 at cap 64
# (305 tok/s) and 77 / 654 with no cap (512: waves of new prompts make 0.7 s steps);
# at 4 and 16 streams throughput and TTFT p50 as without a cap.
CPU_MIXED_PREFILL_TOKENS = 32


@dataclass(frozen=True, slots=True)
class WorkerOption:
    name: str  # the WorkerConfig field (and lifecycle's option of the same name)
    help: str
    type: type = str
    default: Any = None  # the worker's; None: picked at start (the help says how)
    choices: tuple[str, ...] | None = None
    flag: str | None = None  # None: --name with dashes
    forwarded: bool = False  # lifecycle serve offers it and passes it on
    serve_name: str | None = None  # lifecycle serve's name for it, when not ``name``
    scripted: bool = False  # the scripted worker takes it too
    minimum: float | None = None  # the least value a number may have
    maximum: float | None = None
    form: tuple[str, str] | None = None  # a pattern the value matches, and it in words

    @property
    def cli(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def refused(self, value: Any) -> str | None:
        """Why ``value`` is not one this option takes, or None (``refused_value``)."""
        return refused_value(value, self.choices, self.minimum, self.maximum, self.form)

    @property
    def help_with_default(self) -> str:
        """The help, ending with the default when the table has one."""
        if self.default is None or "default" in self.help:
            return self.help
        return f"{self.help} (default: {self.default})"


class OneLineParser(argparse.ArgumentParser):
    """A mistake on a command line is one line on stderr and exit 2 (argparse's own
    prints the whole usage first, dozens of lines for ``serve``, before the error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def value_parser(
    type_: Callable[[str], Any], refused: Callable[[Any], str | None]
) -> Callable[[str], Any]:
    """A flag's text as an option's value (``type_``), refused with the parser's one
    line (which names the flag) when the option does not take it (``refused``)."""

    def parse(text: str) -> Any:
        try:
            value = type_(text)
        except ValueError:
            kind = "an integer" if type_ is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if (why := refused(value)) is not None:
            raise argparse.ArgumentTypeError(why)
        return value

    return parse


def refused_value(
    value: Any,
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    form: tuple[str, str] | None = None,
) -> str | None:
    """Why an option's ``value`` is refused, in words that name what it takes, or None.
    The one check of an option's own value: ``lifecycle serve``'s flags, its config
    file, the Engine's keywords and the worker's command line all apply it."""
    if value is None:
        return None
    if choices is not None and value not in choices:
        return f"invalid choice {value!r} (choose from {', '.join(choices)})"
    if form is not None and not re.fullmatch(form[0], str(value)):
        return f"invalid value {value!r} (expected {form[1]})"
    if minimum is not None and value < minimum:
        return f"must be at least {_number(minimum)}, got {value}"
    if maximum is not None and value > maximum:
        return f"must be at most {_number(maximum)}, got {value}"
    return None


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _w(name: str, help: str, **kw: Any) -> WorkerOption:
    return WorkerOption(name, help, **kw)


WORKER_OPTIONS: tuple[WorkerOption, ...] = (
    _w("model_path", "the model: a GGUF file or a Hugging Face folder", flag="--model",
       forwarded=True, serve_name="model"),
    _w("device", "cpu | cuda | cuda:N (default: cuda when present)", form=DEVICE_FORM,
       forwarded=True),
    _w("dtype", "the weights' and the KV cache's dtype (default: bf16 on CUDA, fp32 on the "
       "CPU)", choices=tuple(DTYPES), forwarded=True),
    _w("listen", "where the worker listens: unix:/path or tcp:HOST:PORT",
       default="unix:/tmp/lifecycle-worker.sock"),
    _w("weights", "auto: on the CPU keep the GGUF's quantized blocks and compute on them "
       "(native kernels), else dequantize to --dtype; quantized: blocks for every "
       "projection (floats requantized to Q8_0); fp32: dequantize all; q8_0 / q4_0: "
       "quantize every matrix to that type at load (a float GGUF or a Hugging Face "
       "folder, on the CPU)", choices=WEIGHT_MODES, default="auto", forwarded=True),
    _w("context_length", "tokens a request may span, prompt and output (default: the "
       "model's; higher only with RoPE scaling in the file)", type=int, minimum=1,
       forwarded=True),
    _w("kv_cache_tokens", "tokens the KV cache holds, in whole blocks (SGLang's "
       "--max-total-tokens; default: from --kv-memory-mib)", type=int, minimum=1,
       forwarded=True),
    _w("kv_cache_dtype", "what the KV cache stores K and V as (auto: fp16 for quantized "
       "weights on the CPU, as llama.cpp's f16 cache, else --dtype; q8_0: llama.cpp's "
       "q8_0 blocks, 34 bytes per 32 values, 0.53x fp16's memory a token; q4_0: its "
       "q4_0 blocks, 18 bytes per 32 values, 0.28x; both rotated per row before they are "
       "rounded, on the CPU's native kernels only); attention reads them back in --dtype",
       choices=KV_CACHE_DTYPES, default="auto", forwarded=True),
    _w("kv_memory_mib", "the KV cache's size in MiB, K and V of every layer in "
       f"--kv-cache-dtype (default: {DEFAULT_CPU_KV_MIB} on the CPU; on CUDA, --mem-fraction); not with "
       "--kv-cache-tokens", type=int, minimum=1, forwarded=True),
    _w("mem_fraction", "CUDA: the KV cache's share of free memory after the weights, less "
       f"a step's working set and the graph pool (default {DEFAULT_MEM_FRACTION} when no "
       "KV size is given)", type=float, minimum=0.01, maximum=1.0, forwarded=True),
    _w("decode_graphs", "decode steps replayed from captured graphs (auto: CUDA graphs on "
       "CUDA)", choices=GRAPH_MODES, default="auto", forwarded=True),
    _w("mixed_graphs", "with the decode graphs, steps that carry prompt chunks replay "
       "piecewise: captured graphs around an eager attention (auto; off: those steps run "
       "eagerly)", choices=MIXED_GRAPH_MODES, default="auto", forwarded=True),
    _w("kernels", "the model's torch path as torch ops, or fused Triton kernels (RMSNorm "
       "with the residual add, RoPE, SwiGLU, paged decode attention; CUDA)",
       choices=KERNEL_MODES, default="torch", forwarded=True),
    _w("overlap", "launch each step before reading the previous step's sampled tokens, "
       "so the host's work runs while the device computes (auto: on CUDA; the same "
       "tokens either way)", choices=OVERLAP_MODES, default="auto", forwarded=True),
    _w("prefix_cache_dir", "keep the prefix cache's full blocks in this directory too, so "
       "a prefix outlives the worker: written as memory evicts them and at shutdown, read "
       "back when a prompt's prefix matches (one model per directory; files of another "
       "model, KV element or layout are removed; default: none)", forwarded=True),
    _w("prefix_cache_disk_mib", "the most MiB --prefix-cache-dir holds (the least recently "
       "used files go first)", type=int, default=DEFAULT_PREFIX_CACHE_DISK_MIB, minimum=1,
       forwarded=True),
    _w("speculative", "speculative decoding: ngram proposes the tokens that followed the "
       "latest earlier occurrence of the sequence's last tokens (prompt lookup), draft the "
       "greedy tokens of --speculative-draft's model; one step checks them all, and the "
       "tokens are the same as without it, greedy or seeded",
       choices=SPECULATIVE_MODES, default="off", forwarded=True),
    _w("speculative_draft", "the draft model of --speculative draft: a GGUF file or a "
       "Hugging Face folder with the served model's vocabulary, smaller and faster",
       forwarded=True),
    _w("speculative_tokens", "the most tokens --speculative proposes for a request in "
       "one step (at most 15 at one stream: a step's decodes and drafts stay within 16 "
       "rows)", type=int, default=12, minimum=1, maximum=32, forwarded=True),
    _w("speculative_ngram_min", "the fewest last tokens an ngram proposal must match",
       type=int, default=2, minimum=1, forwarded=True),
    _w("speculative_ngram_max", "the most last tokens an ngram proposal tries to match "
       "(the longest match wins)", type=int, default=4, minimum=1, forwarded=True),
    _w("block_size", "tokens per KV block", type=int, default=DEFAULT_BLOCK_SIZE, minimum=1),
    _w("max_running", "requests the worker runs in one batch", type=int, default=64,
       minimum=1, forwarded=True, scripted=True),
    _w("max_pending", "requests the worker may hold (running + waiting)", type=int,
       default=256, minimum=1, forwarded=True, scripted=True),
    _w("step_tokens", "tokens one step computes at most", type=int, default=512, minimum=1),
    _w("mixed_prefill_tokens", "prompt tokens per step while other requests decode "
       f"(bounds their ITL; default {CPU_MIXED_PREFILL_TOKENS} on the CPU, --step-tokens "
       "on CUDA)", type=int, minimum=1),
    _w("threads", "CPU threads of every pool (torch's, OpenMP's, the native kernels'), "
       "fewer while other processes want the CPUs (default: $OMP_NUM_THREADS, else the "
       "CPUs this process may use: affinity and cgroup quota)", type=int, minimum=1,
       forwarded=True),
    _w("tp", "tensor-parallel ranks, one process each (at most the model's KV heads; one "
       "torch thread per rank unless --threads)", type=int, default=1, minimum=1,
       forwarded=True),
    _w("token", "serve only a frontend that knows this secret (default: "
       "$LIFECYCLE_WORKER_TOKEN)"),
    _w("tls_cert", "TLS on the TCP link (PEM chain)"),
    _w("tls_key", "the certificate's key (PEM)"),
)  # fmt: skip


def worker_defaults() -> dict[str, Any]:
    """Each option's default by name (``WorkerConfig``'s)."""
    return {o.name: o.default for o in WORKER_OPTIONS}


# The worker's defaults that the engine's, the scheduler's and the scripted worker's
# configurations take as theirs (one definition: the options above).
DEFAULT_MAX_RUNNING: int = worker_defaults()["max_running"]
DEFAULT_MAX_PENDING: int = worker_defaults()["max_pending"]
DEFAULT_STEP_TOKENS: int = worker_defaults()["step_tokens"]


def refused_combination(values: Mapping[str, Any]) -> str | None:
    """Why the worker refuses these options together, in one line, or None. ``values``:
    options by name, None or absent for the worker's default. The one definition of the
    rules that need no model and no device probe: the worker applies it at start
    (``gpu/worker/config.py``), ``lifecycle serve`` before it listens or spawns."""
    v = {**worker_defaults(), **{k: x for k, x in values.items() if x is not None}}
    if v["kv_cache_tokens"] is not None and v["kv_memory_mib"] is not None:
        return "size the KV cache by --kv-cache-tokens or by --kv-memory-mib, not both"
    if v["tp"] > 1:
        if v["weights"] in ("quantized", "q8_0", "q4_0"):
            return f"--tp > 1 splits fp32 weights: --weights {v['weights']} runs at --tp 1"
        if v["kv_cache_dtype"] != "auto":
            return "--tp > 1 keeps the KV cache in --dtype: leave --kv-cache-dtype at auto"
        if v["kernels"] != "torch":
            return "--tp > 1 runs the torch ops on every rank: leave --kernels at torch"
        if v["prefix_cache_dir"] is not None:
            return "--prefix-cache-dir keeps whole blocks: it runs at --tp 1"
    if (kv := v["kv_cache_dtype"]) in ("q8_0", "q4_0"):  # the CPU's native kernels'
        if str(v["device"]).startswith("cuda"):
            return f"--kv-cache-dtype {kv} is read by the CPU's native kernels: use --device cpu"
        if v["kernels"] != "torch":
            return (f"--kv-cache-dtype {kv} is read by the CPU's native kernels, not Triton's: "
                    "leave --kernels at torch")  # fmt: skip
    if v["speculative_ngram_min"] > v["speculative_ngram_max"]:
        return "--speculative-ngram-min must not exceed --speculative-ngram-max"
    if (v["speculative"] == "draft") != (v["speculative_draft"] is not None):
        return "--speculative draft and --speculative-draft MODEL go together"
    if v["speculative"] == "draft" and (v["tp"] > 1 or v["prefix_cache_dir"] is not None):
        return ("--speculative draft keeps the draft model's KV beside the served one's: "
                "not with --tp > 1 or --prefix-cache-dir")  # fmt: skip
    if v["device"] == "cpu":
        if v["decode_graphs"] == "on":
            return "CUDA graphs need a CUDA device (use --decode-graphs eager or off)"
        if v["kernels"] == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            return "--kernels triton needs a CUDA device (or TRITON_INTERPRET=1)"
        if v["mem_fraction"] is not None:
            return ("--mem-fraction sizes the KV cache on a CUDA device; "
                    "use --kv-cache-tokens or --kv-memory-mib on the CPU")  # fmt: skip
    return None
