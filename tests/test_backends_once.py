"""Backends are chosen once, where an object is built (issue 57, point 2): no product
code assigns an attribute of a model, cache, engine, runner, scheduler, graphs, block
manager or disk tier from outside it after construction, and a loaded model shared by
engines of different kernels holds none of their choices."""

from __future__ import annotations

import ast
import pathlib
from functools import partial

import pytest
import torch

from gpu.cache.kv_cache import PagedKVCache
from gpu.model.loader import LoadedModel, load_model
from gpu.parallel import tp
from gpu.runtime.engine import Engine, EngineConfig
from gpu.runtime.runner import NativeTrunk
from tests.tiny_gguf import TinyModel

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ("gpu", "lifecycle", "wire", "modelfile", "transport")
# What an engine is made of: an attribute of one of these (by the name it goes by) is
# the object's own business, set in its constructor.
BUILT = frozenset({"model", "cache", "engine", "scheduler", "runner", "graphs", "mixed",
                   "mixed_graphs", "lm", "loaded", "trunk", "blocks", "disk"})  # fmt: skip


def _owner_names(node: ast.expr) -> list[str]:
    """The names along an attribute target's owner: ``a.b.c`` of ``a.b.c.d = ...``."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def assignments_from_outside(source: str) -> list[tuple[int, str]]:
    """(line, target) of every assignment to an attribute of a built object that is not
    the assigning object's own: ``engine.cache = ...``, ``self.model.ops = ...``, and
    ``setattr(model, ...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and node.args
        ):
            owner = _owner_names(node.args[0])
            if owner and owner != ["self"] and owner[-1] in BUILT:
                found.append((node.lineno, ast.unparse(node)))
            continue
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if not isinstance(el, ast.Attribute):
                    continue
                owner = _owner_names(el.value)
                if owner and owner != ["self"] and owner[-1] in BUILT:
                    found.append((el.lineno, ast.unparse(el)))
    return found


def test_the_rule_finds_what_it_is_about() -> None:
    """The check itself: each way of changing a built object from outside is found, an
    object's own attributes and other values' are not."""
    bad = """
model.ops = ops
engine.cache = engine.runner.cache = cache
self.model.fuse_trunk = False
engine.kv_plan, x = plan, 1
setattr(cache, "ops", ops)
blocks.evicted = self.write
"""
    good = """
self.ops = ops
seq.started = True
self.cache = cache
out.followers = followers
"""
    assert sorted(line for line, _ in assignments_from_outside(bad)) == [2, 3, 3, 4, 5, 6, 7]
    assert assignments_from_outside(good) == []


def test_no_product_code_sets_a_built_objects_attributes() -> None:
    found = {
        f"{path.relative_to(ROOT)}:{line}": target
        for room in PRODUCT
        for path in sorted((ROOT / room).rglob("*.py"))
        for line, target in assignments_from_outside(path.read_text())
    }
    assert found == {}


@pytest.fixture(scope="module")
def qlm(tiny_gguf: TinyModel) -> LoadedModel:
    return load_model(tiny_gguf.path, device="cpu", weights="quantized")


def _engine(lm: LoadedModel, **kw: object) -> Engine:
    return Engine(lm, EngineConfig(64, 16, 4, 16, 64, 16, **kw))  # type: ignore[arg-type]


def test_engines_of_one_model_choose_their_own_and_leave_the_model_alone(
    qlm: LoadedModel,
) -> None:
    """Two engines of the shared model, one on the fused trunk and one on the torch
    path: each runner says what it runs, HELLO's names, and the model's attributes are
    the same objects before and after."""
    before = {k: id(v) for k, v in vars(qlm.model).items()}
    fused, plain = _engine(qlm), _engine(qlm, fuse_trunk=False)
    assert isinstance(fused.runner.trunk, NativeTrunk)
    assert not isinstance(plain.runner.trunk, NativeTrunk)
    assert fused.runner.backends()["trunk"] == "fused"
    assert plain.runner.backends() == {
        "decode_graphs": "off", "mixed_graphs": "off", "kernels": "torch", "trunk": "torch",
    }  # fmt: skip
    assert {k: id(v) for k, v in vars(qlm.model).items()} == before
    assert fused.cache is fused.runner.cache  # the cache the engine made, the runner's


def test_an_engine_makes_its_cache_with_what_it_is_given(qlm: LoadedModel) -> None:
    """``cache_type``: the cache is made once, of that kind, and the runner (which makes
    each step's KV copies on it) reads that one."""
    engine = Engine(
        qlm, EngineConfig(64, 16, 4, 16, 64, 16), cache_type=partial(PagedKVCache, native=False)
    )
    assert engine.cache is engine.runner.cache and engine.cache.kernels is None
    assert not isinstance(engine.runner.trunk, NativeTrunk)  # no native attention: torch
    with torch.inference_mode():
        assert engine.cache.k.shape[2] == 64 * 16


def test_tensor_parallel_turns_decode_graphs_off_or_refuses_them() -> None:
    assert tp.graphs_under_tp("auto") == "off"
    assert tp.graphs_under_tp("off") == "off"
    for mode in ("on", "eager"):
        with pytest.raises(ValueError, match=f"--tp does not run with --decode-graphs {mode}"):
            tp.graphs_under_tp(mode)
