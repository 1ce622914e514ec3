"""The vocabulary side of a model: tokenizer, chat template and config, no weights."""

from __future__ import annotations

import pathlib

from modelfile.chat import ChatTemplate, ChatTemplateError
from modelfile.config import ModelConfig, config_from_gguf
from modelfile.gguf_file import default_model_path
from modelfile.gguf_meta import GGUFMetadata, ModelFileError
from modelfile.hf_folder import HFFolder
from modelfile.tokenizer import Tokenizer, tokenizer_from_gguf

__all__ = ["load_tokenizer", "vocab_parts"]


def load_tokenizer(
    path: str | pathlib.Path | None = None,
) -> tuple[Tokenizer, ChatTemplate | None, ModelConfig]:
    """Tokenizer, chat template and config without reading any weights, from a GGUF
    file or a Hugging Face folder."""
    if path is not None and pathlib.Path(path).is_dir():
        return HFFolder(path).vocab_parts()
    return vocab_parts(GGUFMetadata(path or default_model_path()))


def vocab_parts(f: GGUFMetadata) -> tuple[Tokenizer, ChatTemplate | None, ModelConfig]:
    tokens = f.strings("tokenizer.ggml.tokens")
    config = config_from_gguf(f, tokens)
    tokenizer = tokenizer_from_gguf(f, eog_ids=config.eog_ids)
    source = f.get("tokenizer.chat_template")
    chat = None
    if source:
        bos = tokens[config.bos_id] if config.bos_id is not None else ""
        try:
            chat = ChatTemplate(source, bos_token=bos, eos_token=tokens[config.eos_id])
        except ChatTemplateError as exc:
            raise ModelFileError(f.path, str(exc)) from None
    return tokenizer, chat, config
