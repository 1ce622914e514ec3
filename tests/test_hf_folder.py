"""Hugging Face folders (``--model DIR``: config.json, *.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) against the GGUF of the same model.

The folders are tiny random models of each family (tests/hf_reference.py), saved by
transformers' ``save_pretrained``, with a byte-level BPE tokenizer.json built by
``tokenizers`` from tests/tiny_gguf.py's vocabulary. Their GGUFs are written as
llama.cpp's converter writes them (F32, or Q8_0 / Q4_0). The same weights and the same
math give the same bits: the folder's config is the GGUF's (but for its name and the
q/k row layout), its logits equal the F32 GGUF's exactly (fp32, fp16 and bf16 files,
one file or shards), and with ``--weights q8_0|q4_0`` they equal the served logits of
the GGUF stored in that type, bit for bit. The tokenizer encodes as tokenizer.json
does under ``tokenizers`` and as the GGUF's does, the chat template renders as
transformers renders it, and ``lifecycle serve --model DIR`` answers.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from typing import Any

import httpx
import numpy as np
import pytest
import tokenizers
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from gpu.kernels import native
from gpu.model.loader import load_model
from gpu.worker.generate import run_generate
from modelfile.check import check_model
from modelfile.gguf_meta import ModelFileError
from modelfile.hf_config import HF_ARCHITECTURES, llama3_rope_factors
from modelfile.safetensors_file import read_directory, read_float32
from modelfile.vocab import load_tokenizer
from tests.dense_cache import DenseKVCache
from tests.hf_reference import FAMILIES, Family, build_hf, write_family_gguf
from tests.scripted import lifecycle_server
from tests.test_model import PagedSeqs, run_steps
from tests.test_model_check import _assert_one_line, _run
from tests.tiny_gguf import CHATML, CONTROL, MERGES, TinySpec, tiny_vocab, write_tiny_gguf

pytest.importorskip("transformers")
needs_kernels = pytest.mark.skipif(
    native.load_kernels() is None, reason="quantized weights need the native kernels"
)

TEXTS = [
    "hello world",
    "Hello, World! 12345 and 3.14",
    "<|im_start|>user\nhello<|im_end|>\n",
    "héllo wörld — ünïcode ✓ 日本語",
    "  leading spaces\tand\ttabs\n\nnewlines  ",
    "",
]


def write_tokenizer(folder: pathlib.Path, **config: Any) -> None:
    """tokenizer.json (byte-level BPE over tiny_vocab, SmolLM's split: digits alone,
    then GPT-2's) and tokenizer_config.json, as a published folder has them."""
    tokens, _ = tiny_vocab()
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[(a, b) for a, b in (m.split(" ") for m in MERGES)],
    )
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    tok.save(str(folder / "tokenizer.json"))
    tc = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
        **config,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))


def save_folder(model: Any, folder: pathlib.Path, **kw: Any) -> pathlib.Path:
    model.save_pretrained(folder, **kw)
    write_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """name -> (fp32 transformers model, its folder, its F32 GGUF), built once each."""
    cache: dict[str, tuple[Any, pathlib.Path, pathlib.Path]] = {}

    def get(name: str) -> tuple[Any, pathlib.Path, pathlib.Path]:
        if name not in cache:
            fam, root = FAMILIES[name], tmp_path_factory.mktemp(name)
            model = build_hf(fam, dtype=torch.float32)
            folder = save_folder(model, root / name)
            cache[name] = (model, folder, write_family_gguf(fam, model, root / "f32.gguf"))
        return cache[name]

    return get


def _ids(n: int = 80) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return [int(i) for i in torch.randint(4, 269, (n,), generator=g)]


def _fp32_logits(path: pathlib.Path) -> torch.Tensor:
    lm = load_model(path, device="cpu", weights="fp32")
    return run_steps(lm.model, DenseKVCache(lm.config, 1, 256), [([0], [_ids()])])[0]


def _served_logits(path: pathlib.Path, weights: str) -> torch.Tensor:
    lm = load_model(path, device="cpu", weights=weights)
    assert lm.model.quantized()
    return run_steps(lm.model, PagedSeqs(lm, 1, 256), [([0], [_ids()])])[0]


# The families a folder may hold (modelfile/hf_config.py): the others are GGUF-only.
FOLDER_FAMILIES = sorted(n for n, f in FAMILIES.items() if f.model_class in HF_ARCHITECTURES)


@pytest.mark.parametrize("name", FOLDER_FAMILIES)
def test_config_is_the_ggufs(name: str, made: Any) -> None:
    _, folder, gguf = made(name)
    ours, theirs = check_model(folder).config, check_model(gguf).config
    assert ours.name == folder.name and not ours.rope_permuted  # HF rows: rotate-half
    differ = {"name", "rope_permuted"}
    a, b = dataclasses.asdict(ours), dataclasses.asdict(theirs)
    assert {k: a[k] for k in a if k not in differ} == {k: b[k] for k in b if k not in differ}


@pytest.mark.parametrize("name", FOLDER_FAMILIES)
def test_fp32_logits_equal_the_ggufs(name: str, made: Any) -> None:
    _, folder, gguf = made(name)
    assert torch.equal(_fp32_logits(folder), _fp32_logits(gguf))


@pytest.mark.parametrize(
    ("dtype", "shard"),
    [(torch.bfloat16, None), (torch.float16, None), (torch.float32, "40KB"),
     (torch.bfloat16, "40KB")],
    ids=["bf16", "fp16", "fp32-sharded", "bf16-sharded"],
)  # fmt: skip
def test_half_and_sharded_files(dtype: torch.dtype, shard: str | None,
                                tmp_path: pathlib.Path) -> None:  # fmt: skip
    """A bf16 / fp16 file's values widen to float32 exactly: the logits are the F32
    GGUF's of the same (rounded) weights; shards read as one file."""
    fam = FAMILIES["qwen2"]
    model = build_hf(fam, dtype=dtype)
    kw = {"max_shard_size": shard} if shard else {}
    folder = save_folder(model, tmp_path / "m", **kw)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert (len(files) > 2) == (shard is not None), files
    assert (folder / "model.safetensors.index.json").exists() == (shard is not None)
    gguf = write_family_gguf(fam, model.to(torch.float32), tmp_path / "f32.gguf")
    assert torch.equal(_fp32_logits(folder), _fp32_logits(gguf))


@needs_kernels
@pytest.mark.parametrize("weights", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3", "gemma2"])
def test_quantized_at_load_is_the_quantized_gguf(name: str, weights: str, made: Any,
                                                 tmp_path: pathlib.Path) -> None:  # fmt: skip
    """--weights q8_0|q4_0 quantizes each matrix as the GGUF of that type stores it
    (llama: the GGUF's q/k rows are permuted, row-wise blocks commute): the served path
    gives the same bits."""
    model, folder, _ = made(name)
    qtype = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[weights]
    gguf = write_family_gguf(FAMILIES[name], model, tmp_path / f"{weights}.gguf", qtype)
    assert torch.equal(_served_logits(folder, weights), _served_logits(gguf, "auto"))


def test_float_folders_run_dense_by_default_and_quantized_on_request(made: Any) -> None:
    _, folder, _ = made("qwen2")
    assert not load_model(folder, device="cpu").model.quantized()  # auto: floats stay dense
    if native.load_kernels() is not None:
        assert load_model(folder, device="cpu", weights="quantized").model.quantized()


def test_tokenizer_encodes_as_tokenizer_json_and_the_gguf(made: Any,
                                                          tmp_path: pathlib.Path) -> None:  # fmt: skip
    _, folder, gguf = made("llama")
    ours, _, config = load_tokenizer(folder)
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    theirs = load_tokenizer(gguf)[0]
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special).ids, text
            assert ids == theirs.encode(text, add_special_tokens=special), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert (config.bos_id, config.eos_id, config.eog_ids) == (1, 2, (0, 2, 3))
    assert ours.special_ids == theirs.special_ids == frozenset({0, 1, 2, 3})
    # add_bos_token: true prepends BOS, as the GGUF with tokenizer.ggml.add_bos_token does
    shutil.copytree(folder, tmp_path / "bos")
    write_tokenizer(tmp_path / "bos", add_bos_token=True)
    bos_tok, _, bos_config = load_tokenizer(tmp_path / "bos")
    gguf_bos = load_tokenizer(write_tiny_gguf(tmp_path / "bos.gguf", TinySpec(add_bos=True)).path)
    assert bos_config.add_bos and bos_tok.encode("hello") == [1, 263]
    assert bos_tok.encode("hello") == gguf_bos[0].encode("hello")


def test_chat_template_renders_as_transformers(made: Any, tmp_path: pathlib.Path) -> None:
    import transformers

    _, folder, _ = made("qwen3")
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "again"}]  # fmt: skip
    want = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    chat = load_tokenizer(folder)[1]
    assert chat is not None and chat.render(messages) == want
    # chat_template.jinja (how transformers >= 4.43 saves it) wins over tokenizer_config
    shutil.copytree(folder, tmp_path / "jinja")
    (tmp_path / "jinja" / "chat_template.jinja").write_text(
        "{{ bos_token }}{{ messages[0]['content'] }}"
    )
    jinja = load_tokenizer(tmp_path / "jinja")[1]
    assert jinja is not None and jinja.render(messages) == "<|im_start|>hello"


def test_safetensors_read_as_the_package_reads_them(tmp_path: pathlib.Path) -> None:
    from safetensors.numpy import save_file
    from safetensors.torch import save_file as save_torch

    g = np.random.default_rng(0)
    arrays = {"a": g.standard_normal((3, 5)).astype(np.float32),
              "b": g.standard_normal(7).astype(np.float16)}  # fmt: skip
    save_file(arrays, str(tmp_path / "np.safetensors"))
    for name, t in read_directory(tmp_path / "np.safetensors").items():
        assert np.array_equal(read_float32(t), arrays[name].astype(np.float32))
    bf = torch.randn(4, 6).to(torch.bfloat16)
    save_torch({"c": bf}, str(tmp_path / "bf.safetensors"))
    (t,) = read_directory(tmp_path / "bf.safetensors").values()
    assert t.dtype == "BF16" and torch.equal(torch.from_numpy(read_float32(t)), bf.float())


# config.json as transformers 4 saved these families (the published checkpoints):
# rope_scaling, rope_theta and Gemma 3's rope_local_base_freq at the top, no layer_types.
TRANSFORMERS4 = {
    "gemma2": lambda c: {"rope_theta": 10000.0, "hidden_act": "gelu_pytorch_tanh",
                         "cache_implementation": "hybrid"},
    "gemma3": lambda c: {"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                         "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                         "sliding_window_pattern": 6, "model_type": "gemma3_text"},
    "phi3": lambda c: {"rope_theta": 10000.0, "original_max_position_embeddings": 16,
                       "rope_scaling": {"type": "su", **{k: c["rope_parameters"][k]
                                        for k in ("long_factor", "short_factor")}}},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TRANSFORMERS4))
def test_transformers4_configs_read_the_same(name: str, made: Any,
                                             tmp_path: pathlib.Path) -> None:  # fmt: skip
    _, folder, gguf = made(name)
    old = shutil.copytree(folder, tmp_path / name)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    (old / "config.json").write_text(json.dumps({**cfg, **TRANSFORMERS4[name](
        json.loads((folder / "config.json").read_text()))}))  # fmt: skip
    a = dataclasses.asdict(check_model(old).config)
    b = dataclasses.asdict(check_model(gguf).config)
    differ = {"name", "rope_permuted"}
    assert {k: a[k] for k in a if k not in differ} == {k: b[k] for k in b if k not in differ}


def test_mistral_window_is_on_every_layer_as_transformers_reads_it(
    tmp_path: pathlib.Path,
) -> None:
    """A Mistral folder's ``sliding_window`` (v0.1's 4096; here 16 keys of 80) windows
    every layer, which no GGUF of it says (llama.cpp drops it): fp32 logits against
    transformers' in float64, within 4x transformers' own float32 error (the bound
    tests/test_families.py derives), and every position's top token equal."""
    fam = Family("mistral", "llama", "MistralForCausalLM", {"sliding_window": 16})
    hf64, hf32 = build_hf(fam), build_hf(fam, dtype=torch.float32)
    folder = save_folder(hf32, tmp_path / "mistral")
    config = check_model(folder).config
    assert (config.arch, config.sliding_window, config.window_layers) == ("llama", 16, (0, 1))
    ids = _ids()
    with torch.no_grad():
        want = hf64(torch.tensor([ids])).logits[0]
        theirs = hf32(torch.tensor([ids])).logits[0].double()
    ours = _fp32_logits(folder).double()
    err, their_err = float((ours - want).abs().max()), float((theirs - want).abs().max())
    assert err <= 4.0 * their_err, (err, their_err)
    assert torch.equal(ours.argmax(-1), want.argmax(-1))
    # without the window the logits past 16 tokens differ: the window is what matched
    _edit_config(folder, sliding_window=None)
    unwindowed = _fp32_logits(folder).double()
    assert check_model(folder).config.sliding_window == 0
    assert float((unwindowed[16:] - want[16:]).abs().max()) > 100 * their_err


def test_gemma3_rows_past_the_tokenizer_are_dropped(made: Any, tmp_path: pathlib.Path) -> None:
    """Gemma 3 checkpoints store more embedding rows than their tokenizer has tokens
    (262208 for 262145); its converter drops them, and so do we: the vocabulary is the
    tokenizer's and the logits are the unpadded folder's."""
    _, folder, _ = made("gemma3")
    padded = shutil.copytree(folder, tmp_path / "padded")
    name = "model.embed_tokens.weight"
    _edit_tensors(padded, lambda t: t.update(
        {name: np.concatenate([t[name], np.ones((8, t[name].shape[1]), t[name].dtype)])}))  # fmt: skip
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    _edit_config(padded, vocab_size=vocab + 8)
    assert check_model(padded).config.vocab_size == vocab
    assert torch.equal(_fp32_logits(padded), _fp32_logits(folder))


def test_generate_runs_a_folder(made: Any, capsys: pytest.CaptureFixture[str]) -> None:
    _, folder, _ = made("llama3")
    assert run_generate("hello", model=str(folder), max_new_tokens=4, chat=True) == 0
    assert capsys.readouterr().out.endswith("\n")


# -- refused folders: one ModelFileError naming the file and the problem ----------------


def _edit_config(folder: pathlib.Path, **changes: Any) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_tensors(folder: pathlib.Path, edit: Any) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


BAD_FOLDERS = {
    "arch": (lambda d: _edit_config(d, architectures=["MambaForCausalLM"]),
             "config.json: unsupported architecture 'MambaForCausalLM' (supported: "
             f"{', '.join(HF_ARCHITECTURES)})"),
    "rope": (lambda d: _edit_config(d, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
             "RoPE scaling 'dynamic' unsupported (supported: default, linear, yarn, llama3, "
             "and longrope for Phi-3)"),
    "act": (lambda d: _edit_config(d, hidden_act="gelu"), "hidden_act 'gelu' unsupported"),
    "dtype": (lambda d: _edit_tensors(d, lambda t: t.update(
                  {"model.norm.weight": t["model.norm.weight"].astype(np.float64)})),
              "tensor 'model.norm.weight' has unsupported dtype F64 (supported: F32, F16, BF16)"),
    "missing": (lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                "tensor 'model.layers.1.mlp.up_proj.weight' is missing (the llama "
                "architecture reads it)"),
    "unread": (lambda d: _edit_tensors(d, lambda t: t.update(
                   {"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)})),
               "tensor 'model.layers.0.self_attn.o_proj.bias' is not read by the llama "
               "architecture"),
    "tokenizer": (lambda d: (d / "tokenizer.json").unlink(),
                  "tokenizer.json: file not found (the tokenizer is read from tokenizer.json"),
    "weights": (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
                "no model.safetensors or model.safetensors.index.json"),
}  # fmt: skip


@pytest.mark.parametrize("bad", sorted(BAD_FOLDERS))
def test_unsupported_folders_are_one_error(bad: str, made: Any, tmp_path: pathlib.Path) -> None:
    edit, problem = BAD_FOLDERS[bad]
    folder = shutil.copytree(made("llama")[1], tmp_path / "bad")
    edit(folder)
    with pytest.raises(ModelFileError) as exc:
        check_model(folder)
    assert str(folder) in str(exc.value) and problem in str(exc.value), str(exc.value)
    assert exc.value.__cause__ is None


def test_serve_refuses_a_bad_folder_before_listening(made: Any, tmp_path: pathlib.Path) -> None:
    folder = shutil.copytree(made("qwen2")[1], tmp_path / "mamba")
    _edit_config(folder, architectures=["MambaForCausalLM"])
    done = _run("-m", "lifecycle", "serve", "--model", str(folder), "--port", "0")
    _assert_one_line(done, folder / "config.json", "unsupported architecture 'MambaForCausalLM'")


def test_a_folder_is_served(made: Any) -> None:
    _, folder, _ = made("llama3")
    with lifecycle_server("--model", str(folder), "--device", "cpu") as base:
        r = httpx.post(
            base + "/generate",
            json={"text": "hello world", "sampling_params": {"max_new_tokens": 8,
                                                              "temperature": 0}},
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] >= 1
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                  "temperature": 0},
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == folder.name and body["usage"]["completion_tokens"] >= 1
        info = httpx.get(base + "/model_info", timeout=10).json()
        assert info["model_path"] == str(folder)


def test_llama3_rope_factors_match_transformers_in_the_blend_band() -> None:
    """Issue 54, point 5: a real Llama 3's RoPE (head 128, theta 500000, factor 8, low 1,
    high 4, 8192 original positions) has 6 of its 64 frequencies between the two
    wavelength limits, where the factor blends; the factors written to ``rope_freqs``
    equal transformers' own llama3 computation (its scaled frequencies against the
    unscaled ones) to float32 rounding, in the band and outside it."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, rope_parameters=rope,
        max_position_embeddings=131072,
    )  # fmt: skip
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    dim = 128
    unscaled = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    reference = (unscaled / scaled).numpy()
    band = (reference > 1.0 + 1e-4) & (reference < rope["factor"] - 1e-4)
    assert band.sum() == 6  # the blend is exercised, not only the two ends
    ours = llama3_rope_factors({"rope_parameters": rope}, dim)
    np.testing.assert_allclose(ours, reference, rtol=1e-6)
