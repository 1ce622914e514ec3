"""Loading tiny GGUF files: config, weights, and one clear error for every bad file."""

from __future__ import annotations

import io
import logging
import pathlib
import sys
from typing import cast

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from gpu.kernels import native
from gpu.model.decoder import PackedLinear
from gpu.model.loader import load_model, resolve_device
from gpu.model.quant import QuantLinear, QuantWeight
from gpu.model.rope import unpermute_rope_rows
from modelfile.gguf_file import ModelFileError, default_model_path
from modelfile.vocab import load_tokenizer
from tests.tiny_gguf import TinyModel, TinySpec, hf_permute, write_tiny_gguf


def test_config_from_metadata(tiny_gguf: TinyModel) -> None:
    lm = load_model(tiny_gguf.path, device="cpu")
    c = lm.config
    s = tiny_gguf.spec
    assert (c.arch, c.n_layers, c.hidden, c.ffn) == ("llama", s.n_layers, s.hidden, s.ffn)
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (s.n_heads, s.n_kv_heads, s.hidden // s.n_heads)
    assert c.rope_theta == s.rope_theta and c.rms_eps == pytest.approx(s.rms_eps)
    assert c.context_length == s.context_length and c.vocab_size == len(tiny_gguf.tokens)
    assert c.tied_embeddings and lm.model.lm_head is lm.model.embed
    assert (c.bos_id, c.eos_id, c.add_bos, c.name) == (1, 2, False, "tiny-test-llama")
    # <|endoftext|>, <|im_end|> (eos) and the FIM repo token <reponame>, as llama.cpp derives.
    assert c.eog_ids == (0, 2, 3)
    assert lm.device == torch.device("cpu") and lm.dtype == torch.float32


def test_load_logs_time_and_memory(tiny_gguf: TinyModel, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gpu.model.loader"):
        load_model(tiny_gguf.path, device="cpu")
    (record,) = [r for r in caplog.records if r.name == "gpu.model.loader"]
    assert "tiny.gguf" in record.message and "rss" in record.message and "weights" in record.message


def test_weights_are_dequantised_and_unpermuted(tiny_gguf: TinyModel) -> None:
    lm = load_model(tiny_gguf.path, device="cpu", weights="fp32")
    w = {k: torch.from_numpy(v) for k, v in tiny_gguf.weights.items()}
    layer = lm.model.layers[1]
    expect_qkv = torch.cat(
        [w["blk.1.attn_q.weight"], w["blk.1.attn_k.weight"], w["blk.1.attn_v.weight"]]
    )
    assert torch.equal(layer.wqkv, expect_qkv)
    assert torch.equal(
        layer.w_gate_up, torch.cat([w["blk.1.ffn_gate.weight"], w["blk.1.ffn_up.weight"]])
    )
    assert torch.equal(layer.w_down, w["blk.1.ffn_down.weight"])
    assert torch.equal(lm.model.embed, w["token_embd.weight"])
    assert torch.equal(lm.model.norm, w["output_norm.weight"])


needs_kernels = pytest.mark.skipif(
    native.load_kernels() is None, reason="quantized weights need the native kernels"
)

QUANT_SPEC = TinySpec(
    quant={
        "token_embd": Q.Q8_0,
        **{r: Q.Q4_1 for r in ("attn_q", "attn_k", "ffn_gate", "ffn_up")},
        "attn_v": Q.Q5_0,  # another type than q and k: the fused q/k/v in two parts
        "attn_output": Q.Q4_0,
        "ffn_down": Q.MXFP4,  # a type the kernel does not read: requantized to Q8_0
    }
)


@needs_kernels
def test_quantized_weights_keep_the_file_blocks(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """auto on the CPU: the types the kernel reads stay as their blocks, q/k rows
    un-permuted and fused tensors joined without touching a block (in parts where the
    file stores them in different types); other quantized types become Q8_0, logged with
    their cost."""
    tiny = write_tiny_gguf(tmp_path / "q.gguf", QUANT_SPEC)
    with caplog.at_level(logging.WARNING, logger="gpu.model.loader"):
        lm = load_model(tiny.path, device="cpu")
    assert lm.model.quantized()
    w = {k: torch.from_numpy(v) for k, v in tiny.weights.items()}
    layer = lm.model.layers[1]
    qkv, gate_up, o, down = (
        cast(QuantLinear, lin).weights for lin in (layer.qkv, layer.gate_up, layer.o, layer.down)
    )
    assert [[p.qtype for p in ws] for ws in (qkv, gate_up, o, down)] == [
        [Q.Q4_1, Q.Q5_0],
        [Q.Q4_1],
        [Q.Q4_0],
        [Q.Q8_0],
    ]
    assert torch.equal(
        qkv[0].dequantize(), torch.cat([w["blk.1.attn_q.weight"], w["blk.1.attn_k.weight"]])
    )
    assert torch.equal(qkv[1].dequantize(), w["blk.1.attn_v.weight"])
    assert torch.equal(
        gate_up[0].dequantize(),
        torch.cat([w["blk.1.ffn_gate.weight"], w["blk.1.ffn_up.weight"]]),
    )
    assert torch.equal(o[0].dequantize(), w["blk.1.attn_output.weight"])
    # MXFP4 -> fp32 -> Q8_0: within Q8_0's rounding (half a step of each block's scale,
    # the scale itself rounded to fp16)
    step = w["blk.1.ffn_down.weight"].abs().view(-1, 32).amax(-1, keepdim=True) / 127
    err = (down[0].dequantize() - w["blk.1.ffn_down.weight"]).view(-1, 32).abs()
    assert (err <= step * 0.55 + 1e-6).all(), float((err / step).max())
    [line] = [r.getMessage() for r in caplog.records if "requantized" in r.getMessage()]
    assert "MXFP4: 2 tensors" in line, line
    # the parts compute what each part computes alone, side by side
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    lin = cast(QuantLinear, layer.qkv)
    alone = [QuantLinear(p, lin.kernels)(x) for p in qkv]
    assert torch.equal(lin(x), torch.cat(alone, dim=1))
    # the embedding looks rows up in its blocks; the tied head reads the same storage
    embed = cast(QuantWeight, lm.model.embed_q)
    ids = torch.tensor([[3, 0], [len(tiny.tokens) - 1, 7]])
    assert torch.equal(embed.rows(ids), w["token_embd.weight"][ids])
    assert cast(QuantLinear, lm.model.head).blocks[0].data_ptr() == lm.model.embed.data_ptr()
    # packed into panels where the build packs (the same function, bit for bit: the
    # file's layout computes the same outputs)
    kernels = lin.kernels
    for ws in (qkv, gate_up, o, down, [embed]):
        assert all((p.packed_rows is not None) == kernels.packs for p in ws)
    if kernels.packs:
        q = w["blk.1.attn_q.weight"]
        file_q = QuantWeight(torch.from_numpy(quantize(q.numpy(), Q.Q4_1)), Q.Q4_1, q.shape[1])
        assert torch.equal(
            QuantLinear(file_q, kernels)(x), QuantLinear(file_q.packed(kernels), kernels)(x)
        )
    dense = load_model(tiny.path, device="cpu", weights="fp32")
    assert lm.model.weight_bytes() * 3 < dense.model.weight_bytes()


@needs_kernels
def test_auto_keeps_float_tensors_dense(tiny_gguf: TinyModel) -> None:
    """The session's tiny file mixes F32 and quantized parts in each fused projection:
    auto keeps those dense; "quantized" requantizes the floats too."""
    auto = load_model(tiny_gguf.path, device="cpu")
    assert isinstance(auto.model.layers[0].qkv, PackedLinear)  # q, k Q4_1 but v F32
    assert isinstance(auto.model.head, QuantLinear)  # the Q8_0 embedding, tied
    every = load_model(tiny_gguf.path, device="cpu", weights="quantized")
    assert all(isinstance(lin, QuantLinear) for lin in every.model.linears())


def test_weight_modes_and_their_errors(
    tiny_gguf: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="unknown weights"):
        load_model(tiny_gguf.path, device="cpu", weights="int4")
    with pytest.raises(ValueError, match="float32 only"):
        load_model(tiny_gguf.path, device="cpu", dtype="bf16", weights="quantized")
    monkeypatch.setenv("LIFECYCLE_NATIVE", "0")  # no kernels: auto is dense, quantized an error
    assert not load_model(tiny_gguf.path, device="cpu").model.quantized()
    with pytest.raises(ValueError, match="native CPU kernels"):
        load_model(tiny_gguf.path, device="cpu", weights="quantized")


def test_unpermute_inverts_the_converter_permutation() -> None:
    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    for heads in (1, 2, 4):
        back = unpermute_rope_rows(torch.from_numpy(hf_permute(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))
    # and it is not the identity: a head's rows (d0..d3, e0..e3) come back from (d0 e0 d1 e1 ...)
    assert not np.array_equal(hf_permute(w, 1), w)


def test_untied_output_weight(tmp_path: pathlib.Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "untied.gguf", TinySpec(untied=True))
    lm = load_model(tiny.path, device="cpu")
    assert not lm.config.tied_embeddings
    assert torch.equal(lm.model.lm_head, torch.from_numpy(tiny.weights["output.weight"]))


def test_load_tokenizer_reads_no_weights(tmp_path: pathlib.Path) -> None:
    # A file whose weights cannot be loaded still yields tokenizer, template and config.
    spec = TinySpec(quant={"ffn_up": Q.Q8_0}, omit_tensors=("blk.0.ffn_down.weight",))
    tiny = write_tiny_gguf(tmp_path / "noweights.gguf", spec)
    tok, chat, config = load_tokenizer(tiny.path)
    assert tok.encode("hello") == [tiny.tokens.index("hello")]
    assert chat is not None and config.n_layers == 2
    with pytest.raises(ModelFileError, match="blk.0.ffn_down.weight"):
        load_model(tiny.path, device="cpu")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal(tiny_gguf: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    for stream, shown in ((io.StringIO(), False), (_Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        load_model(tiny_gguf.path, device="cpu")
        text = stream.getvalue()
        assert ("MiB" in text) is shown
        if shown:  # MiB of the file's tensors read, to the whole
            lines = text.split("\r")[1:]
            assert all(line.startswith("loading tiny.gguf: ") for line in lines)
            assert text.endswith("MiB (100 %)\n") and len(lines) > 2


def test_default_model_path_exists() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000


def test_resolve_device_policy() -> None:
    assert resolve_device("cpu", None) == (torch.device("cpu"), torch.float32)
    assert resolve_device("cpu", "bf16") == (torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_device("cpu", "int3")


# -- bad files: one ModelFileError naming the file and the problem ---------------------


def _assert_clean(
    exc: pytest.ExceptionInfo[ModelFileError], path: pathlib.Path, problem: str
) -> None:
    assert str(path) in str(exc.value)
    assert problem in str(exc.value)
    # No chained traceback from inside gguf-py.
    assert exc.value.__cause__ is None
    assert exc.value.__context__ is None or exc.value.__suppress_context__


def test_missing_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError) as exc:
        load_model(path, device="cpu")
    _assert_clean(exc, path, "file not found")


def test_empty_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelFileError) as exc:
        load_model(path, device="cpu")
    _assert_clean(exc, path, "empty file")


@pytest.mark.parametrize(
    ("offset", "patch", "problem"),
    [(0, b"GGML", "bad magic"), (4, (99).to_bytes(4, "little"), "unsupported GGUF version")],
)
def test_bad_header(
    tmp_path: pathlib.Path, tiny_gguf: TinyModel, offset: int, patch: bytes, problem: str
) -> None:
    path = tmp_path / "header.gguf"
    data = bytearray(tiny_gguf.path.read_bytes())
    data[offset : offset + len(patch)] = patch
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as exc:
        load_model(path, device="cpu")
    _assert_clean(exc, path, problem)


@pytest.mark.parametrize("keep", [0.5, 0.97])  # cut in the metadata, cut in the tensor data
def test_truncated_file(tmp_path: pathlib.Path, tiny_gguf: TinyModel, keep: float) -> None:
    path = tmp_path / "cut.gguf"
    data = tiny_gguf.path.read_bytes()
    if keep < 0.9:
        data = data[:2000]
    else:
        data = data[: int(len(data) * keep)]
    path.write_bytes(data)
    with pytest.raises(ModelFileError) as exc:
        load_model(path, device="cpu")
    _assert_clean(exc, path, "truncated")


def test_unsupported_architecture(tmp_path: pathlib.Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "mamba.gguf", TinySpec(arch="mamba"))
    with pytest.raises(ModelFileError) as exc:
        load_model(tiny.path, device="cpu")
    _assert_clean(exc, tiny.path, "unsupported architecture 'mamba'")


def test_unsupported_tensor_type(tmp_path: pathlib.Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "f64.gguf", TinySpec(quant={"ffn_down": Q.F64}))
    with pytest.raises(ModelFileError) as exc:
        load_model(tiny.path, device="cpu")
    _assert_clean(exc, tiny.path, "tensor 'blk.0.ffn_down.weight' has unsupported type F64")


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (TinySpec(tokenizer_model="t5"), "unsupported tokenizer.ggml.model 't5'"),
        (TinySpec(pre="qwen9"), "unsupported tokenizer.ggml.pre 'qwen9'"),
        (TinySpec(chat_template="{% for %}"), "chat template does not compile"),
        (TinySpec(omit_tensors=("output_norm.weight",)), "tensor 'output_norm.weight' is missing"),
    ],
)
def test_unsupported_file_contents(tmp_path: pathlib.Path, spec: TinySpec, problem: str) -> None:
    tiny = write_tiny_gguf(tmp_path / "bad.gguf", spec)
    with pytest.raises(ModelFileError) as exc:
        load_model(tiny.path, device="cpu")
    _assert_clean(exc, tiny.path, problem)


def test_wrong_tensor_shape(tmp_path: pathlib.Path) -> None:
    # The metadata's feed-forward size disagrees with the tensors written.
    tiny = write_tiny_gguf(tmp_path / "shape.gguf", TinySpec())
    with open(tiny.path, "r+b") as fh:
        data = fh.read()
        key = b"llama.feed_forward_length"
        at = data.index(key) + len(key) + 4  # skip the uint32 value-type tag
        fh.seek(at)
        fh.write((96).to_bytes(4, "little"))
    with pytest.raises(ModelFileError) as exc:
        load_model(tiny.path, device="cpu")
    _assert_clean(
        exc, tiny.path, "tensor 'blk.0.ffn_gate.weight' has shape (128, 64), expected (96, 64)"
    )
