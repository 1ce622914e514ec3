"""A Hugging Face model folder (what SGLang and vLLM take as ``--model DIR``) read as the
loader reads a ``GGUFFile``: config, tokenizer, chat template, and tensors by GGUF name
with their shapes and types, dequantized to float32 numpy.

The folder: ``config.json`` (``modelfile/hf_config.py``), the weights in
``model.safetensors`` or the shards ``model.safetensors.index.json`` names (else every
``*.safetensors`` there), F32, F16 or BF16 (``modelfile/safetensors_file.py``);
``tokenizer.json`` (read by ``tokenizers`` as it is), ``tokenizer_config.json`` (the
bos/eos tokens, ``add_bos_token``, ``chat_template`` unless ``chat_template.jinja`` holds
it) and, if present, ``generation_config.json`` (its ``eos_token_id`` ids end a
generation too). Tensors are renamed as the converter renames them (each
architecture's table in ``_LAYERS``) and changed as it changes them: Gemma's norm
weights plus 1, Gemma 3's embedding rows past its tokenizer dropped; Llama 3's RoPE
factors (``rope_freqs.weight``) and Phi-3's LongRoPE factors (``rope_factors_long`` /
``_short``) are computed from config.json. Tensors the decoder would not read (o_proj or
MLP biases, anything unknown) are refused, not ignored.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import numpy as np
import tokenizers
from gguf import GGMLQuantizationType as Q
from tokenizers import processors

from modelfile.chat import ChatTemplate, ChatTemplateError
from modelfile.config import ModelConfig
from modelfile.gguf_meta import ModelFileError
from modelfile.hf_config import (
    config_from_hf,
    hf_architecture,
    llama3_rope_factors,
    longrope_factors,
    rope_kind,
)
from modelfile.safetensors_file import SafeTensor, read_directory, read_float32
from modelfile.tokenizer import Tokenizer

__all__ = ["HFFolder"]

_TYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16}
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Each architecture's layer tensors, GGUF name -> the folder's (gguf-py's tensor map,
# the converter's): exactly what its decoder reads.
_ATTN = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **_ATTN,
    **_MLP,
}
_QK_NORM = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GEMMA = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    **_ATTN,
    **_MLP,
}
_LAYERS = {
    "llama": _LLAMA,
    "qwen2": {
        **_LLAMA,
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
    },
    "qwen3": {**_LLAMA, **_QK_NORM},
    "phi3": {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate rows first, as GGUF's
        "ffn_down.weight": "mlp.down_proj.weight",
    },
    "smollm3": _LLAMA,
    "granite": _LLAMA,
    "olmo2": {  # no norm before attention or MLP; each one's output normed
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        **_QK_NORM,
        **_ATTN,
        **_MLP,
    },
    "gemma2": _GEMMA,
    "gemma3": {**_GEMMA, **_QK_NORM},
}
# Gemma's RMSNorm scales by 1 + w; its converters store w + 1 (GemmaModel.modify_tensors).
_NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")  # a buffer older checkpoints saved
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_ROPE_FREQS = "rope_freqs.weight"
# Tensors the converter computes from config.json rather than copies.
_COMPUTED = (_ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight")
_VOCAB_ROWS = ("token_embd.weight", "output.weight")


def _read_json(path: pathlib.Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelFileError(path, "file not found")
        return {}
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelFileError(path, f"not readable JSON: {exc}") from None
    if not isinstance(out, dict):
        raise ModelFileError(path, "not a JSON object")
    return out


class HFFolder:
    """A model folder: ``vocab_parts()`` and the tensor interface of ``GGUFFile``."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        if not self.path.is_dir():
            raise ModelFileError(self.path, "not a directory")
        self.hf_config = _read_json(self.path / "config.json", required=True)
        self.arch = hf_architecture(self.path / "config.json", self.hf_config)
        self._layer = _LAYERS[self.arch]
        self._to_gguf = {hf: name for name, hf in self._layer.items()}
        self._rows: int | None = None  # the embedding rows used, once the vocabulary is read
        self._tensors = self._directory()
        self._gguf = {gguf: hf for hf in self._tensors if (gguf := self._gguf_name(hf)) is not None}

    # -- the files ----------------------------------------------------------------------

    def _weight_files(self) -> list[pathlib.Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index, required=True).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelFileError(index, "no weight_map")
            return [self.path / f for f in sorted(set(map(str, weight_map.values())))]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelFileError(
                self.path,
                "no model.safetensors or model.safetensors.index.json "
                "(supported: safetensors weights; *.bin / PyTorch pickles are not read)",
            )
        return files

    def _directory(self) -> dict[str, SafeTensor]:
        out: dict[str, SafeTensor] = {}
        for file in self._weight_files():
            for name, t in read_directory(file).items():
                if name in out:
                    raise ModelFileError(file, f"tensor {name!r} also in {out[name].file.name}")
                out[name] = t
        return out

    def stored_bytes(self) -> dict[str, int]:
        """Each tensor's bytes in its file, by GGUF name (load progress)."""
        return {name: self._tensors[hf].nbytes for name, hf in self._gguf.items()}

    # -- vocabulary, template, config ---------------------------------------------------

    def vocab_parts(self) -> tuple[Tokenizer, ChatTemplate | None, ModelConfig]:
        inner = self._tokenizer_json()
        tc = _read_json(self.path / "tokenizer_config.json", required=False)
        gen = _read_json(self.path / "generation_config.json", required=False)
        tokens = _tokens_by_id(inner)
        gen_eos, cfg_eos = _ids(gen.get("eos_token_id")), _ids(self.hf_config.get("eos_token_id"))
        eos_id = _token_id(inner, tc.get("eos_token"), [*gen_eos, *cfg_eos])
        if eos_id is None:
            raise ModelFileError(
                self.path,
                "no end-of-sequence token (eos_token in tokenizer_config.json, or "
                "eos_token_id in generation_config.json or config.json)",
            )
        bos_ids = [*_ids(gen.get("bos_token_id")), *_ids(self.hf_config.get("bos_token_id"))]
        bos_id = _token_id(inner, tc.get("bos_token"), bos_ids)
        add_bos = _apply_add_bos(inner, tc.get("add_bos_token"), bos_id, tokens)
        config = config_from_hf(
            self.path / "config.json",
            self.hf_config,
            tokens=tokens,
            bos_id=bos_id,
            eos_id=eos_id,
            extra_eog=[*gen_eos, *cfg_eos],
            add_bos=add_bos,
            name=self.path.name,
            has_tensor=self.has_tensor,
        )
        self._rows = config.vocab_size
        special = [i for i, t in inner.get_added_tokens_decoder().items() if t.special]
        tokenizer = Tokenizer(
            inner, bos_id=bos_id, eos_id=eos_id, eog_ids=config.eog_ids, special_ids=special
        )
        bos = tokens[bos_id] if bos_id is not None else ""
        return tokenizer, self._chat(tc, bos, tokens[eos_id]), config

    def _tokenizer_json(self) -> tokenizers.Tokenizer:
        path = self.path / "tokenizer.json"
        if not path.is_file():
            raise ModelFileError(
                path, "file not found (the tokenizer is read from tokenizer.json; a "
                "sentencepiece tokenizer.model alone is unsupported)",
            )  # fmt: skip
        try:
            return tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library's own message says what it could not read
            raise ModelFileError(path, f"tokenizers cannot read it: {exc}") from None

    def _chat(self, tc: dict[str, Any], bos: str, eos: str) -> ChatTemplate | None:
        jinja = self.path / "chat_template.jinja"
        where = jinja if jinja.is_file() else self.path / "tokenizer_config.json"
        source: Any = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
        source = source or tc.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not source:
            return None
        try:
            return ChatTemplate(str(source), bos_token=bos, eos_token=eos)
        except ChatTemplateError as exc:
            raise ModelFileError(where, str(exc)) from None

    # -- tensors by GGUF name (the loader's interface) -------------------------------------

    def _gguf_name(self, hf: str) -> str | None:
        for name, top in _TOP.items():
            if hf == top:
                return name
        m = _LAYER_NAME.fullmatch(hf)
        if m and m.group(2) in self._to_gguf:
            return f"blk.{m.group(1)}.{self._to_gguf[m.group(2)]}"
        return None

    def stored_name(self, name: str) -> str:
        """The folder's name for the GGUF tensor ``name``."""
        if name in _TOP:
            return _TOP[name]
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m and m.group(2) in self._layer:
            return f"model.layers.{m.group(1)}.{self._layer[m.group(2)]}"
        return name

    def _computed(self, name: str) -> np.ndarray | None:
        """A tensor the converter computes from config.json (None: this model has none)."""
        if name == _ROPE_FREQS:
            if rope_kind(self.hf_config) != "llama3":
                return None
            return llama3_rope_factors(self.hf_config, self._head_dim())
        which = name.removeprefix("rope_factors_").removesuffix(".weight")
        factors = longrope_factors(self.hf_config, which) if self.arch == "phi3" else None
        if factors is not None and factors.shape != (self._head_dim() // 2,):
            raise ModelFileError(
                self.path / "config.json", f"rope_scaling.{which}_factor has {factors.size} "
                f"values for {self._head_dim() // 2} frequencies",
            )  # fmt: skip
        return factors

    def has_tensor(self, name: str) -> bool:
        if name in _COMPUTED:
            return self._computed(name) is not None
        return name in self._gguf

    def _entry(self, name: str) -> SafeTensor:
        hf = self._gguf.get(name)
        if hf is None:
            raise ModelFileError(self.path, f"tensor {self.stored_name(name)!r} is missing")
        return self._tensors[hf]

    def tensor_type(self, name: str) -> Q:
        if name in _COMPUTED and self.has_tensor(name):
            return Q.F32
        t = self._entry(name)
        if t.dtype not in _TYPES:
            raise ModelFileError(t.file, _dtype_problem(self.stored_name(name), t.dtype))
        return _TYPES[t.dtype]

    def _trimmed_rows(self, name: str, rows: int) -> int:
        """Gemma 3's embedding rows past its tokenizer's tokens are dropped, as its
        converter drops them (``hf_config.vocab_rows``)."""
        if name in _VOCAB_ROWS and self._rows is not None and rows > self._rows:
            return self._rows
        return rows

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        computed = self._computed(name) if name in _COMPUTED else None
        if computed is not None:
            return computed.shape
        shape = self._entry(name).shape
        return (self._trimmed_rows(name, shape[0]), *shape[1:]) if shape else shape

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 numpy (F32: a read-only view of the file), changed as
        the converter changes it (Gemma's norms plus 1, Gemma 3's unused rows dropped)."""
        computed = self._computed(name) if name in _COMPUTED else None
        if computed is not None:
            return computed
        self.tensor_type(name)
        out = read_float32(self._entry(name))
        if self.arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            out = out + np.float32(1.0)
        rows = self._trimmed_rows(name, out.shape[0])
        return out[:rows] if rows < out.shape[0] else out

    def blocks(self, name: str) -> np.ndarray:
        raise ModelFileError(
            self.path, f"tensor {self.stored_name(name)!r} holds floats, not quantized blocks"
        )

    def check_tensor_types(self) -> None:
        """Every tensor a float type, and one the architecture reads."""
        for hf, t in self._tensors.items():
            if t.dtype not in _TYPES:
                raise ModelFileError(t.file, _dtype_problem(hf, t.dtype))
            gguf = self._gguf_name(hf)
            if gguf is None and not _IGNORED.fullmatch(hf):
                raise ModelFileError(
                    t.file, f"tensor {hf!r} is not read by the {self.arch} architecture "
                    "(unsupported: the model would run without it)",
                )  # fmt: skip

    def _head_dim(self) -> int:
        c = self.hf_config
        return int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))


def _dtype_problem(name: str, dtype: str) -> str:
    return f"tensor {name!r} has unsupported dtype {dtype} (supported: {', '.join(_TYPES)})"


def _ids(value: Any) -> list[int]:
    """A config's token id field: an int, a list of them, or absent."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int)]


def _token_id(inner: tokenizers.Tokenizer, token: Any, fallback: list[int]) -> int | None:
    """A tokenizer_config token (a string, or an AddedToken dict) as an id; else the
    first of ``fallback`` (generation_config / config.json ids)."""
    text = token.get("content") if isinstance(token, dict) else token
    found = inner.token_to_id(text) if isinstance(text, str) and text else None
    return found if found is not None else next(iter(fallback), None)


def _tokens_by_id(inner: tokenizers.Tokenizer) -> list[str]:
    vocab = inner.get_vocab(with_added_tokens=True)
    tokens = [""] * (max(vocab.values(), default=-1) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    return tokens


def _bos_added(inner: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    with_special = inner.encode("a", add_special_tokens=True).ids
    return with_special[:1] == [bos_id] != inner.encode("a", add_special_tokens=False).ids[:1]


def _apply_add_bos(
    inner: tokenizers.Tokenizer, want: Any, bos_id: int | None, tokens: list[str]
) -> bool:
    """Whether encoding adds BOS: tokenizer.json's post-processor as it is, unless
    tokenizer_config's ``add_bos_token`` says otherwise (then it is made to agree, as
    transformers' fast tokenizers do)."""
    has = _bos_added(inner, bos_id)
    if not isinstance(want, bool) or want == has or bos_id is None:
        return has
    if want:
        bos = tokens[bos_id]
        inner.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        inner.post_processor = None
    return want
