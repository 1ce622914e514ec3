"""The model configuration, read from GGUF metadata (llama family)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modelfile.gguf_meta import GGUFMetadata, ModelFileError

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "config_from_gguf", "derive_eog_ids"]

SUPPORTED_ARCHITECTURES = frozenset({"llama"})

# Token texts llama.cpp (src/llama-vocab.cpp) treats as end-of-generation whatever their
# role, plus the FIM "pad"/"repo"/"sep" texts it auto-detects and also adds to its EOG set.
# SmolLM2's `<reponame>` (id 4) is in llama.cpp's EOG set for this reason; `<repo_name>`
# (id 3) and `<file_sep>` (id 5) are not, as measured with llama_vocab_is_eog.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<｜end▁of▁sentence｜>",
    }
)
_FIM_EOG_TEXTS = frozenset(
    {
        # fim pad
        "<|fim_pad|>",
        "<fim-pad>",
        "<fim_pad>",
        "<PAD>",
        # fim repo
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
        # fim file separator
        "<|file_sep|>",
    }
)
_EOG_ID_KEYS = (
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool
    bos_id: int | None
    eos_id: int
    eog_ids: tuple[int, ...]
    add_bos: bool
    name: str


def derive_eog_ids(
    tokens: Sequence[str], eos_id: int, extra_ids: Sequence[int] = ()
) -> tuple[int, ...]:
    """End-of-generation ids, mirroring llama.cpp's text-based auto-detection.

    ``extra_ids`` are ids the file names explicitly (eot, eom, fim pad/rep/sep).
    """
    eog = {eos_id, *extra_ids}
    for i, text in enumerate(tokens):
        if text in _EOG_TEXTS or text in _FIM_EOG_TEXTS:
            eog.add(i)
    return tuple(sorted(i for i in eog if 0 <= i < len(tokens)))


def config_from_gguf(f: GGUFMetadata, tokens: Sequence[str]) -> ModelConfig:
    """Read the llama-family hyper-parameters; refuse what the torch model cannot run."""
    arch = f.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f.path,
            f"unsupported architecture {arch!r} (supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})",
        )
    hidden = int(f.require(f"{arch}.embedding_length"))
    n_heads = int(f.require(f"{arch}.attention.head_count"))
    n_kv_heads = int(f.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(f.get(f"{arch}.attention.key_length", hidden // n_heads))
    _check_shape_support(f, arch, n_heads, n_kv_heads, head_dim)
    vocab_size = len(tokens) or int(f.require(f"{arch}.vocab_size"))
    eos_id = int(f.require("tokenizer.ggml.eos_token_id"))
    bos = f.get("tokenizer.ggml.bos_token_id")
    extra = [int(v) for k in _EOG_ID_KEYS if (v := f.get(k)) is not None]
    return ModelConfig(
        arch=arch,
        n_layers=int(f.require(f"{arch}.block_count")),
        hidden=hidden,
        ffn=int(f.require(f"{arch}.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(f.get(f"{arch}.context_length", 2048)),
        vocab_size=vocab_size,
        tied_embeddings=not f.has_tensor("output.weight"),
        bos_id=None if bos is None else int(bos),
        eos_id=eos_id,
        eog_ids=derive_eog_ids(tokens, eos_id, extra),
        add_bos=bool(f.get("tokenizer.ggml.add_bos_token", False)),
        name=str(f.get("general.name", f.path.stem)),
    )


def _check_shape_support(
    f: GGUFMetadata, arch: str, n_heads: int, n_kv_heads: int, head_dim: int
) -> None:
    if n_heads % n_kv_heads:
        raise ModelFileError(f.path, f"{n_heads} heads not divisible by {n_kv_heads} kv heads")
    rope_dims = int(f.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFileError(f.path, f"partial rotary ({rope_dims} of {head_dim} dims) unsupported")
    scaling = f.get(f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or f.has_tensor("rope_freqs.weight"):
        raise ModelFileError(f.path, f"RoPE scaling ({scaling or 'rope_freqs'}) unsupported")
