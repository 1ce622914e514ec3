"""The model worker: GGUF loading, tokenizer, torch model, KV cache, scheduler, sampling.

Knows nothing about HTTP: it speaks only the wire protocol in ``specs/wire.cddl``.
"""
