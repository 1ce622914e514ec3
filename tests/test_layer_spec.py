"""The one layer description (modelfile/layer_spec.py): what each family's configuration makes
of its layers, the features it names, and the refusals that name a backend and the
feature it lacks, before an engine is made (issue 57, point 1)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from modelfile import layer_spec
from modelfile.config import ModelConfig
from modelfile.layer_spec import BACKENDS, FEATURES, ModelSpec, refusal, spec_of
from tests.scripted import free_port
from tests.tiny_gguf import TinyModel

LLAMA = ModelConfig("llama", 4, 64, 128, 4, 2, 16, 1e4, 1e-5, 256, 300, True, 1, 2, (2,),
                    False, "tiny")  # fmt: skip
GEMMA2 = replace(
    LLAMA, arch="gemma2", act="gelu_tanh", embed_scale=8.0, attn_softcap=50.0,
    final_softcap=30.0, post_norms=True, sliding_window=32, window_layers=(0, 2),
)  # fmt: skip
GEMMA3 = replace(
    LLAMA, arch="gemma3", act="gelu_tanh", embed_scale=8.0, qk_norm=True, post_norms=True,
    sliding_window=32, window_layers=(0, 1, 2), window_rope_theta=1e4, rope_theta=1e6,
)  # fmt: skip


def test_llama_is_the_plain_layer() -> None:
    spec = ModelSpec.of(LLAMA)
    assert spec.features == frozenset()
    assert spec.rope_tables == ((1e4, True),) and spec.windows == (0, 0, 0, 0)
    layer = spec.layers[0]
    assert (layer.act, layer.window, layer.rope_table, layer.attn_softcap) == ("silu", 0, 0, 0.0)
    assert layer.query_scale == 16**-0.5 and layer.sdpa_scale is None


def test_gemma2_and_gemma3_layers_as_their_configurations_say() -> None:
    g2 = ModelSpec.of(GEMMA2)
    assert g2.features == {"gelu_tanh", "embed_scale", "attn_softcap", "final_softcap",
                           "post_norms", "sliding_window"}  # fmt: skip
    assert g2.windows == (32, 0, 32, 0) and g2.widest_window == 32
    g3 = ModelSpec.of(GEMMA3)
    # the windowed layers rotate with their own table, unscaled; the last one with the
    # model's, scaled
    assert g3.rope_tables == ((1e6, True), (1e4, False))
    assert [layer.rope_table for layer in g3.layers] == [1, 1, 1, 0]
    assert "window_rope" in g3.features and "qk_norm" in g3.features
    scaled = ModelSpec.of(replace(LLAMA, attn_scale=1 / math.sqrt(16)))
    assert scaled.layers[0].sdpa_scale == 0.25  # given: SDPA is passed it


def test_smollm3_layers_without_rope() -> None:
    spec = ModelSpec.of(replace(LLAMA, arch="smollm3", nope_layers=(3,)))
    assert spec.rope_of == (0, 0, 0, None) and spec.features == {"nope_layers"}


def test_every_feature_is_named_and_every_backend_row_names_features() -> None:
    assert set(BACKENDS) == {"torch", "native", "triton", "tp", "graphs"}
    for backend, row in BACKENDS.items():
        assert row <= set(FEATURES), backend
    # what no backend runs: layers that differ where the kernels take one value
    nobody = set(FEATURES) - set().union(*BACKENDS.values())
    assert nobody == {"layer_activations", "layer_attention", "layer_windows"}


def test_layers_that_differ_where_kernels_take_one_value_are_refused() -> None:
    base = ModelSpec.of(GEMMA2)
    other = replace(base.layers[1], act="silu")
    mixed = replace(base, layers=(base.layers[0], other, *base.layers[2:]))
    assert "layer_activations" in mixed.features
    why = refusal("torch", mixed)
    assert why == (
        "the torch backend does not run layers of different activations "
        "(layer_activations), which this model uses"
    )


def test_a_backend_without_a_feature_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = ModelSpec.of(GEMMA2)
    assert all(refusal(b, spec) is None for b in BACKENDS)
    monkeypatch.setitem(layer_spec.BACKENDS, "triton", BACKENDS["triton"] - {"attn_softcap"})
    assert refusal("triton", spec) == (
        "the triton backend does not run soft-capped attention scores (attn_softcap), "
        "which this model uses"
    )
    assert refusal("triton", ModelSpec.of(LLAMA)) is None  # a model without it runs


def test_spec_is_made_once_per_configuration() -> None:
    assert spec_of(GEMMA2) is spec_of(replace(GEMMA2))  # equal configurations, one spec


@pytest.fixture(scope="module")
def qlm(tiny_gguf: TinyModel) -> LoadedModel:
    return load_model(tiny_gguf.path, device="cpu", weights="quantized")


def test_an_engine_asked_for_a_backend_that_lacks_a_feature_is_not_made(
    qlm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine (so the worker, so the server before it listens) refuses the combination
    by name; the fused trunk, never asked for by an option, gives way to the torch path.
    The tiny model is Llama's plain layer: its spec is replaced by one with scaled
    embeddings (a stand-in spec, for the refusal only), and the graphs' row lacks them."""
    assert qlm.model.spec.features == frozenset()
    config = EngineConfig(64, 16, 4, 16, 64, 16, decode_graphs="eager")
    assert Engine(qlm, config).runner.backends()["trunk"] == "fused"
    monkeypatch.setattr(qlm.model, "spec", replace(qlm.model.spec, embed_scale=2.0))
    monkeypatch.setitem(layer_spec.BACKENDS, "graphs", BACKENDS["graphs"] - {"embed_scale"})
    with pytest.raises(ValueError, match=r"the graphs backend does not run scaled embeddings"):
        Engine(qlm, config)
    monkeypatch.setitem(layer_spec.BACKENDS, "native", BACKENDS["native"] - {"embed_scale"})
    engine = Engine(qlm, replace(config, decode_graphs="off"))
    assert engine.runner.backends()["trunk"] == "torch"  # the fused trunk gave way


def test_a_server_refuses_tensor_parallel_olmo2_before_it_listens(tmp_path: Path) -> None:
    """OLMo 2's q/k norms sum over the whole projection, which a shard holds part of: the
    tp backend's row lacks the feature, so ``serve --tp 2`` ends before it listens or
    spawns a worker, its one line naming the backend, the feature and the option."""
    import torch

    from tests.hf_reference import FAMILIES, build_hf, write_family_gguf

    fam = FAMILIES["olmo2"]
    path = write_family_gguf(fam, build_hf(fam, dtype=torch.float32), tmp_path / "olmo2.gguf")
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "lifecycle", "serve", "--model", str(path), "--device", "cpu",
         "--tp", "2", "--port", str(port)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stderr + proc.stdout
    assert proc.returncode == 2, out[-2000:]
    assert out.strip() == (
        f"error: {path}: the tp backend does not run RMSNorm of q and k over the whole "
        "projection (qk_norm_whole), which this model uses, asked for by --tp 2"
    )
