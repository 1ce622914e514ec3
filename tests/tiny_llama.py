"""A tiny random-weight Llama for backend and scheduler tests (no model file needed)."""

from __future__ import annotations

import torch

from gpu.config import ModelConfig
from gpu.model import Llama, LlamaWeights

__all__ = ["tiny_config", "tiny_llama"]


def tiny_config(vocab: int = 97, layers: int = 2, context: int = 256) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        n_layers=layers,
        hidden=64,
        ffn=96,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_eps=1e-5,
        context_length=context,
        vocab_size=vocab,
        tied_embeddings=True,
        bos_id=1,
        eos_id=2,
        eog_ids=(2,),
        add_bos=False,
        name="tiny",
    )


def tiny_llama(seed: int = 0, **kw: int) -> Llama:
    c = tiny_config(**kw)
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    layers = [
        LlamaWeights(
            attn_norm=torch.ones(c.hidden),
            wqkv=r(q + 2 * kv, c.hidden),
            wo=r(c.hidden, q),
            ffn_norm=torch.ones(c.hidden),
            w_gate_up=r(2 * c.ffn, c.hidden),
            w_down=r(c.hidden, c.ffn),
        )
        for _ in range(c.n_layers)
    ]
    return Llama(c, r(c.vocab_size, c.hidden) * 5, layers, torch.ones(c.hidden)).eval()
