"""Command line: ``lifecycle serve``, ``lifecycle worker``, ``lifecycle generate``."""

from __future__ import annotations

import argparse
import sys

from lifecycle.trace_cli import add_trace_parser, run_trace

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lifecycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print a greedy continuation of a prompt (offline)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="GGUF file (default: bundled SmolLM2)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--device", default=None)
    add_trace_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "generate":
        from gpu.generate import run_generate

        return run_generate(
            args.prompt,
            model=args.model,
            max_new_tokens=args.max_new_tokens,
            chat=args.chat,
            device=args.device,
        )
    if args.command == "trace":
        return run_trace(args)
    print(f"unknown command {args.command}", file=sys.stderr)
    return 2
