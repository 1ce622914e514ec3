"""Whether a model (a GGUF file or a Hugging Face folder) is one this runtime can run,
from its metadata and tensor directory alone: no weight is read and torch is never
imported, so ``lifecycle serve`` refuses a model before it listens or spawns a worker,
and the worker refuses it before it reads a weight.

What is checked: everything ``model_parts`` reads (architecture, hyper-parameters,
RoPE scaling, tokenizer, chat template), each tensor's type, and every tensor the
architecture reads: present, with the shape the config implies (a folder's tensors the
architecture would not read are refused too: ``HFFolder.check_tensor_types``). Each
problem is one ``ModelFileError("<path>: <problem>")``.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from modelfile.chat import ChatTemplate, ChatTemplateError
from modelfile.config import ModelConfig, with_context
from modelfile.gguf_meta import ModelFileError
from modelfile.source import ModelSource, model_parts, open_model
from modelfile.tokenizer import Tokenizer

__all__ = ["CheckedModel", "check_model", "check_tensors", "expected_tensors", "template_file"]


@dataclass(frozen=True, slots=True)
class CheckedModel:
    """A model file that passed ``check_model``, with what the frontend takes from it."""

    path: pathlib.Path
    tokenizer: Tokenizer
    chat: ChatTemplate | None
    config: ModelConfig


def expected_tensors(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads for ``c``, by GGUF name, with its row-major shape
    (what ``gpu/model/loader.py`` reads, in its order)."""
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out: dict[str, tuple[int, ...]] = {}
    for i in range(c.n_layers):
        p = f"blk.{i}."
        if c.pre_norms:
            out[p + "attn_norm.weight"] = (c.hidden,)
        if c.fused_qkv:
            out[p + "attn_qkv.weight"] = (q_rows + 2 * kv_rows, c.hidden)
        else:
            out[p + "attn_q.weight"] = (q_rows, c.hidden)
            out[p + "attn_k.weight"] = (kv_rows, c.hidden)
            out[p + "attn_v.weight"] = (kv_rows, c.hidden)
        out[p + "attn_output.weight"] = (c.hidden, q_rows)
        if c.pre_norms:
            out[p + "ffn_norm.weight"] = (c.hidden,)
        if c.fused_gate_up:
            out[p + "ffn_up.weight"] = (2 * c.ffn, c.hidden)
        else:
            out[p + "ffn_gate.weight"] = (c.ffn, c.hidden)
            out[p + "ffn_up.weight"] = (c.ffn, c.hidden)
        out[p + "ffn_down.weight"] = (c.hidden, c.ffn)
        if c.qkv_bias:
            out[p + "attn_q.bias"] = (q_rows,)
            out[p + "attn_k.bias"] = (kv_rows,)
            out[p + "attn_v.bias"] = (kv_rows,)
        if c.qk_norm:  # per head, or over the whole projection (OLMo 2)
            out[p + "attn_q_norm.weight"] = (q_rows,) if c.qk_norm_whole else (c.head_dim,)
            out[p + "attn_k_norm.weight"] = (kv_rows,) if c.qk_norm_whole else (c.head_dim,)
        if c.post_norms:
            out[p + "post_attention_norm.weight"] = (c.hidden,)
            out[p + "post_ffw_norm.weight"] = (c.hidden,)
    out["token_embd.weight"] = (c.vocab_size, c.hidden)
    out["output_norm.weight"] = (c.hidden,)
    if not c.tied_embeddings:
        out["output.weight"] = (c.vocab_size, c.hidden)
    if c.rope_freq_factors:
        out["rope_freqs.weight"] = (c.head_dim // 2,)
    if c.rope_scaling.kind == "longrope":
        out["rope_factors_long.weight"] = (c.head_dim // 2,)
        out["rope_factors_short.weight"] = (c.head_dim // 2,)
    return out


def check_tensors(f: ModelSource, config: ModelConfig) -> None:
    """Every tensor of a type the loader reads; every tensor ``config`` needs present,
    in its shape."""
    f.check_tensor_types()
    for name, shape in expected_tensors(config).items():
        stored = f.stored_name(name)
        if not f.has_tensor(name):
            raise ModelFileError(
                f.path, f"tensor {stored!r} is missing (the {config.arch} architecture reads it)"
            )
        got = f.tensor_shape(name)
        if got != shape:
            raise ModelFileError(f.path, f"tensor {stored!r} has shape {got}, expected {shape}")


def check_model(
    path: str | pathlib.Path | None = None,
    context_length: int | None = None,
    chat_template: str | pathlib.Path | None = None,
) -> CheckedModel:
    """Open and check the model at ``path`` (a GGUF file or a Hugging Face folder; None:
    the bundled default), serving ``context_length`` tokens (None: the model's own),
    with the chat template in the file ``chat_template`` (None: the model's); raises
    ``ModelFileError`` for the first problem."""
    f = open_model(path)
    tokenizer, chat, config = model_parts(f)
    config = with_context(config, context_length, str(f.path))
    check_tensors(f, config)
    if chat_template is not None:
        chat = template_file(pathlib.Path(chat_template), tokenizer, config)
    return CheckedModel(f.path, tokenizer, chat, config)


def template_file(path: pathlib.Path, tokenizer: Tokenizer, config: ModelConfig) -> ChatTemplate:
    """The chat template in ``path`` (``--chat-template``), with the model's BOS and EOS
    texts as ``bos_token`` / ``eos_token``."""
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFileError(path, f"cannot read the chat template: {exc}") from None
    bos = tokenizer.token_text(config.bos_id) if config.bos_id is not None else ""
    try:
        return ChatTemplate(source, bos_token=bos, eos_token=tokenizer.token_text(config.eos_id))
    except ChatTemplateError as exc:
        raise ModelFileError(path, str(exc)) from None
