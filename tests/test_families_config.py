"""What a family's configuration reads where the file leaves it unsaid or the context
decides: a Gemma 2 file's query scale, soft caps and window pattern as llama.cpp reads
them (GGUF files of keys and no tensors), RoPE scaling kinds outside the table refused,
and Phi-3 served within its original context reading LongRoPE's short factors (fp32
logits against transformers in float64, within tests/test_families.py's bound)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from gpu.model.loader import load_model
from modelfile.config import RopeScaling
from tests.dense_cache import DenseKVCache
from tests.family_helpers import FP32_FACTOR, hf_logits, needs_kernels, prompt_ids
from tests.hf_reference import FAMILIES, build_hf, write_family_gguf
from tests.test_model import run_steps

pytest.importorskip("transformers")


@needs_kernels
def test_longrope_reads_the_short_factors_within_the_original_context(
    tmp_path: pathlib.Path,
) -> None:
    """Phi-3 served at no more than its original context reads the short factors, as
    llama.cpp chooses by context and transformers by sequence length (the family's own
    file, at 256 tokens, reads the long ones:
    tests/test_families.py::test_fp32_logits_match_transformers)."""
    family = FAMILIES["phi3"]
    hf64, hf32 = build_hf(family), build_hf(family, dtype=torch.float32)
    original = family.config["original_max_position_embeddings"]
    ids = prompt_ids(original, 3)
    want, theirs = hf_logits(hf64, ids), hf_logits(hf32, ids)
    path = write_family_gguf(family, hf32, tmp_path / "f32.gguf")
    lm = load_model(path, device="cpu", weights="fp32", context_length=original)
    assert not lm.config.rope_scaling.long_factors(lm.config.context_length)
    ours = run_steps(lm.model, DenseKVCache(lm.config, 1, original), [([0], [ids])])[0]
    err, their_err = float((ours.double() - want).abs().max()), float((theirs - want).abs().max())
    assert err <= FP32_FACTOR * their_err, (err, their_err)


def _metadata_only(path: pathlib.Path, arch: str, keys: dict[str, Any]) -> pathlib.Path:
    """A GGUF of keys and no tensors: what ``config_from_gguf`` reads."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("layers", "scale"), [(42, 256**-0.5), (46, (4608 / 32) ** -0.5)], ids=["9b", "27b"]
)
def test_gemma2_query_scale_and_window_pattern(layers: int, scale: float,
                                               tmp_path: pathlib.Path) -> None:  # fmt: skip
    """What a Gemma 2 file does not say, as llama.cpp reads it: the 27B model (46 layers)
    scales queries by 1/sqrt(hidden / heads) (its query_pre_attn_scalar, 144), the
    others by 1/sqrt(head size); the window is 4096 keys on the even layers unless the
    file says otherwise (``attention.sliding_window_pattern``: a period, or per layer)."""
    from modelfile.config import config_from_gguf
    from modelfile.gguf_meta import GGUFMetadata
    from tests.tiny_gguf import tiny_vocab

    keys: dict[str, Any] = {"block_count": layers, "embedding_length": 4608,
                            "feed_forward_length": 36864, "attention.head_count": 32,
                            "attention.head_count_kv": 16, "attention.key_length": 256}  # fmt: skip
    tokens = tiny_vocab()[0]
    c = config_from_gguf(GGUFMetadata(_metadata_only(tmp_path / "a.gguf", "gemma2", keys)), tokens)
    assert c.query_scale == pytest.approx(scale, rel=1e-12)
    assert c.sliding_window == 4096 and c.window_layers == tuple(range(0, layers, 2))
    assert (c.attn_softcap, c.final_softcap) == (50.0, 30.0)
    flags = [i % 3 == 0 for i in range(layers)]
    for pattern, want in ((3, [i for i in range(layers) if i % 3 < 2]),
                          (flags, [i for i in range(layers) if i % 3 == 0])):  # fmt: skip
        more = {
            **keys,
            "attention.sliding_window": 512,
            "attention.sliding_window_pattern": pattern,
        }
        c = config_from_gguf(GGUFMetadata(_metadata_only(tmp_path / "b.gguf", "gemma2", more)),
                             tokens)  # fmt: skip
        assert c.sliding_window == 512 and list(c.window_layers) == want


def test_rope_scaling_kinds_outside_the_table_are_refused(tmp_path: pathlib.Path) -> None:
    import gguf

    from modelfile.gguf_meta import GGUFMetadata, ModelFileError
    from tests.tiny_gguf import tiny_vocab

    path = tmp_path / "longrope.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 4)):  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_string("llama.rope.scaling.type", "longrope")
    w.add_float32("llama.rope.scaling.factor", 4.0)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    from modelfile.config import config_from_gguf

    with pytest.raises(ModelFileError, match="rope.scaling.type 'longrope' unsupported"):
        config_from_gguf(GGUFMetadata(path), tiny_vocab()[0])
    assert RopeScaling().kind == "none"
