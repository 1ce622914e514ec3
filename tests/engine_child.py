"""Run by tests/test_engine.py in a fresh interpreter: the Engine on the real model, its
answers as one JSON line on stdout."""

from __future__ import annotations

import asyncio
import json
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])

    torch_after_import = "torch" in sys.modules
    from lifecycle import Engine

    out: dict = {"torch_after_import": torch_after_import}
    with Engine(**spec["options"]) as engine:
        out["torch_after_start"] = "torch" in sys.modules
        greedy = {"temperature": 0, "max_new_tokens": spec["max_new_tokens"]}
        batch = engine.generate(input_ids=spec["ids"], sampling_params=greedy, progress=False)
        out["batch_ids"] = [r["output_ids"] for r in batch]

        async def stream_text() -> str:
            text = ""
            chunks = await engine.async_generate(spec["text"], greedy, stream=True)
            async for chunk in chunks:
                text = chunk["text"]
            return text

        out["async_stream_text"] = asyncio.run(stream_text())
        out["embedding"] = engine.encode(spec["text"])["embedding"]
        long = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
        n = 0
        for _chunk in engine.generate(spec["text"], long, stream=True, rid="broken-off"):
            n += 1
            if n == 3:
                break
        out["chunks_before_break"] = n
        deadline = time.monotonic() + 10
        while True:
            info = engine.server_info()
            worker = info["internal_states"][0]
            idle = info["live_requests"] == 0
            if idle and worker["kv_blocks_free"] == worker["kv_blocks_total"]:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        out["after_break"] = {
            "live_requests": info["live_requests"],
            "kv_blocks_free": worker["kv_blocks_free"],
            "kv_blocks_total": worker["kv_blocks_total"],
            "failed_requests": info["failed_requests"],
        }
        trace = engine.trace("broken-off")
        out["broken_off_trace"] = None if trace is None else trace.get("cause")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
