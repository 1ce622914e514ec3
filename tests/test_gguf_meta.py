"""The frontend's GGUF reader (modelfile/gguf_meta.py) against gguf-py's ``GGUFReader``:
the same metadata, the same tensor directory, and one clear error for every bad file."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from modelfile.gguf_file import GGUFFile, default_model_path
from modelfile.gguf_meta import GGUFMetadata, ModelFileError
from modelfile.vocab import load_tokenizer
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf

# gguf-py's own bookkeeping fields, not keys of the file
_READER_ONLY = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def _reader_value(field) -> object:  # type: ignore[no-untyped-def]
    if field.types and field.types[0].name == "ARRAY":
        if field.types[-1].name == "STRING":
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]) if field.data else []
    return field.contents()


def _assert_same_as_gguf_py(path: pathlib.Path) -> None:
    ours, theirs = GGUFMetadata(path), GGUFReader(path, "r")
    keys = [k for k in theirs.fields if k not in _READER_ONLY]
    assert sorted(keys) == sorted(ours._fields)
    for key in keys:
        want = _reader_value(theirs.fields[key])
        if isinstance(want, np.ndarray):
            got = ours.array(key)
            assert got is not None and got.dtype == want.dtype, key
            assert np.array_equal(got, want), key
        elif isinstance(want, list):
            assert ours.strings(key) == want, key
        else:
            assert ours.get(key) == want and type(ours.get(key)) is type(want), key
    assert ours.tensor_names == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        entry = ours.tensors[t.name]
        assert entry.dims == tuple(int(d) for d in t.shape)
        assert entry.ggml_type == int(t.tensor_type) and entry.offset == t.data_offset


def test_tiny_file_reads_like_gguf_py(tmp_path: pathlib.Path) -> None:
    spec = TinySpec(quant={"ffn_up": Q.Q8_0, "ffn_gate": Q.Q4_1, "attn_output": Q.F16})
    _assert_same_as_gguf_py(write_tiny_gguf(tmp_path / "mixed.gguf", spec).path)


@pytest.mark.model
def test_default_model_reads_like_gguf_py() -> None:
    _assert_same_as_gguf_py(default_model_path())


def test_tensors_dequantise_like_gguf_py(tiny_gguf: TinyModel) -> None:
    ours, theirs = GGUFFile(tiny_gguf.path), GGUFReader(tiny_gguf.path, "r")
    from gguf.quants import dequantize

    for t in theirs.tensors:
        want = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        got = ours.dequantize(t.name)
        assert got.shape == ours.tensor_shape(t.name) and np.array_equal(got.ravel(), want.ravel())


# -- bad files: the tokenizer's reader refuses them as the weight loader does ----------


def _refused(path: pathlib.Path, problem: str) -> None:
    for read in (load_tokenizer, GGUFFile):
        with pytest.raises(ModelFileError) as exc:
            read(path)
        assert str(path) in str(exc.value) and problem in str(exc.value)
        assert exc.value.__cause__ is None


@pytest.mark.parametrize(
    ("offset", "patch", "problem"),
    [
        (0, b"GGML", "bad magic"),
        (4, (99).to_bytes(4, "little"), "unsupported GGUF version (99)"),
        (4, (3).to_bytes(4, "big"), "unsupported GGUF version"),
    ],
)
def test_bad_header(
    tmp_path: pathlib.Path, tiny_gguf: TinyModel, offset: int, patch: bytes, problem: str
) -> None:
    data = bytearray(tiny_gguf.path.read_bytes())
    data[offset : offset + len(patch)] = patch
    (path := tmp_path / "header.gguf").write_bytes(bytes(data))
    _refused(path, problem)


@pytest.mark.parametrize("keep", [3, 20, 2000])
def test_metadata_cut_short(tmp_path: pathlib.Path, tiny_gguf: TinyModel, keep: int) -> None:
    (path := tmp_path / "cut.gguf").write_bytes(tiny_gguf.path.read_bytes()[:keep])
    _refused(path, "truncated")


def test_empty_and_missing(tmp_path: pathlib.Path) -> None:
    (empty := tmp_path / "empty.gguf").write_bytes(b"")
    _refused(empty, "empty file")
    _refused(tmp_path / "nope.gguf", "file not found")


def test_a_long_metadata_section_is_read_past_the_first_chunk(tmp_path: pathlib.Path) -> None:
    # 5 MiB of metadata: more than the first read, so the reader must read on.
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "llama")
    words = [f"word{i:07d}" * 4 for i in range(120_000)]
    w.add_array("test.words", words)
    w.add_tensor("t", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = GGUFFile(tmp_path / "long.gguf")
    assert meta.strings("test.words") == words
    assert np.array_equal(meta.dequantize("t"), np.arange(32, dtype=np.float32))
