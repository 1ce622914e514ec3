"""Regenerate tests/fixtures/llamaserver_greedy.json: llama.cpp's own server's greedy
continuation of every reference prompt (tests/fixtures/model_reference.json).

llama-server computes with llama.cpp's quantized kernels (activations rounded to int8
inside the Q4_1 / Q8_0 dot products), an f16 KV cache and flash attention: the peer our
quantized CPU weights are compared with token for token. Start the server that
``make bench-peer`` builds on the default model, then::

    llama-server -m <SmolLM2-135M-Instruct.Q4_1.gguf> --threads 2 --port 8282 &
    python tools/make_llamaserver_fixture.py [--url http://127.0.0.1:8282]

Each prompt's ids go to ``POST /completion`` as a token list (no re-tokenization), with
``temperature 0``, ``top_k 1``, ``ignore_eos`` and no prompt cache, for as many tokens as
the reference's greedy run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import urllib.request

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8282")
    ap.add_argument("--out", type=pathlib.Path, default=FIXTURES / "llamaserver_greedy.json")
    args = ap.parse_args()
    meta = json.loads((FIXTURES / "model_reference.json").read_text(encoding="utf-8"))
    with urllib.request.urlopen(args.url + "/props", timeout=30) as r:
        props = json.load(r)
    greedy = {}
    for p in meta["prompts"]:
        body = {
            "prompt": p["ids"], "n_predict": len(p["greedy"]), "temperature": 0, "top_k": 1,
            "cache_prompt": False, "return_tokens": True, "ignore_eos": True,
        }  # fmt: skip
        greedy[p["name"]] = _post(args.url + "/completion", body)["tokens"]
    out = {
        "model_file": meta["model_file"],
        "model_sha256": meta["model_sha256"],
        "server": {
            "build_info": props.get("build_info"),
            "source": "llama-cpp-python 0.3.36 sdist",
        },
        "made": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "greedy": greedy,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(greedy)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
