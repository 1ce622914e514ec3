"""Tensor parallelism (``--tp``): the split, the step message, and real worker groups.

The split and the step message are tested in memory; the worker is run as a process and spoken
to over the wire: on a tiny GGUF with 3 KV heads (K = 2 splits them unevenly and its
odd vocabulary needs padding) for greedy equality, refusal and the followers' lifetime,
and on the real model for greedy equality on the reference prompts.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

from gpu.cache.kv_cache import PrefillChunk
from gpu.model.shard import even_runs, shard_plan
from gpu.parallel.tp import decode_step, encode_step
from gpu.runtime.runner import StepInput
from modelfile.config import ModelConfig
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf
from tests.worker_client import WorkerClient, spawn_worker
from wire import Shutdown

pytestmark = pytest.mark.timeout(120)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
GREEDY = {"temperature": 0, "ignore_eos": True}


def _config(n_heads: int, n_kv: int, ffn: int = 1536, vocab: int = 49152) -> ModelConfig:
    return ModelConfig(
        "llama",
        30,
        576,
        ffn,
        n_heads,
        n_kv,
        64,
        1e5,
        1e-5,
        2048,
        vocab,
        True,
        1,
        2,
        (2,),
        False,
        "m",
    )


# -- the split ---------------------------------------------------------------------------


def test_smollm2_split_at_two_ranks_is_by_kv_group() -> None:
    c = _config(9, 3)
    r0, r1 = shard_plan(c, 2, 0), shard_plan(c, 2, 1)
    assert (r0.kv_heads, r0.q_heads) == (range(0, 2), range(0, 6))
    assert (r1.kv_heads, r1.q_heads) == (range(2, 3), range(6, 9))
    assert (r0.ffn, r1.ffn) == (range(0, 768), range(768, 1536))
    assert (r0.vocab, r1.vocab, r0.vocab_rows) == (range(0, 24576), range(24576, 49152), 24576)
    local = r1.local_config(c)
    assert (local.n_heads, local.n_kv_heads, local.ffn, local.vocab_size) == (3, 1, 768, 49152)


@pytest.mark.parametrize(
    ("n_heads", "n_kv", "ffn", "vocab"), [(9, 3, 1536, 49152), (6, 3, 160, 269), (32, 8, 11, 7)]
)
def test_every_head_column_and_token_has_exactly_one_rank(
    n_heads: int, n_kv: int, ffn: int, vocab: int
) -> None:
    c = _config(n_heads, n_kv, ffn, vocab)
    for world in range(1, n_kv + 1):
        plans = [shard_plan(c, world, r) for r in range(world)]
        assert [h for p in plans for h in p.kv_heads] == list(range(n_kv))
        assert [h for p in plans for h in p.q_heads] == list(range(n_heads))
        assert [f for p in plans for f in p.ffn] == list(range(ffn))
        assert [v for p in plans for v in p.vocab] == list(range(vocab))
        group = n_heads // n_kv
        for p in plans:  # a rank's query heads are those reading its KV heads
            assert p.q_heads == range(p.kv_heads.start * group, p.kv_heads.stop * group)
            assert len(p.vocab) <= p.vocab_rows == -(-vocab // world)
        sizes = [len(p.kv_heads) for p in plans]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_even_runs() -> None:
    assert even_runs(3, 2) == [range(0, 2), range(2, 3)]
    assert even_runs(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert even_runs(4, 4) == [range(i, i + 1) for i in range(4)]


def test_more_ranks_than_kv_heads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--tp 4 exceeds the 3 KV heads of m.*--tp 3 or fewer"):
        shard_plan(_config(9, 3), 4, 0)
    with pytest.raises(ValueError, match="at least 1"):
        shard_plan(_config(9, 3), 0, 0)


# -- the step message -------------------------------------------------------------------


def test_a_step_reaches_the_followers_whole_and_in_order() -> None:
    """The step value as rank 0 broadcasts it (JSON) and a follower runs it: rows, their
    layout and the KV copies in order; an overlapped step's rows read on the device
    arrive as the tokens they read."""
    import json

    step = StepInput(
        ids=[10, 0, 12, 13], pos=[39, 1, 16, 17], decodes=[([3, 4, 5], 40), ([7], 2)],
        prefills=[PrefillChunk([9, 8, 6], 16, 2)], logit_rows=[0, 1, 3], want_hidden=True,
        future=([1], [2], torch.tensor([5, 6, 11])), copies=[(1, 2, 3), (5, 6, 16), (2, 1, 4)],
    )  # fmt: skip
    got = decode_step(json.loads(json.dumps(encode_step(step))))
    assert got == StepInput(
        [10, 11, 12, 13], [39, 1, 16, 17], [([3, 4, 5], 40), ([7], 2)],
        [PrefillChunk([9, 8, 6], 16, 2)], [0, 1, 3], True, False, None,
        [(1, 2, 3), (5, 6, 16), (2, 1, 4)],
    )  # fmt: skip


# -- worker groups on a tiny model ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """3 KV heads (6 query heads), an MLP of 160 and a vocabulary of 269."""
    spec = TinySpec(n_heads=6, n_kv_heads=3, hidden=96, ffn=160, untied=True)
    return write_tiny_gguf(tmp_path_factory.mktemp("tp") / "tiny3.gguf", spec)


def test_each_rank_reads_only_its_slices(tiny3: TinyModel) -> None:
    """``load_model(rank=, world=)``: every rank's weights are its slices of the
    single-process model's, read as such from the file (o and down by columns, the rest
    by rows, the vocabulary padded), and together the ranks hold each weight once."""
    from gpu.model.loader import load_model

    full = load_model(tiny3.path, device="cpu", weights="fp32")
    c, hd = full.config, full.config.head_dim
    shards = []
    for rank in range(2):
        lm = load_model(tiny3.path, device="cpu", weights="fp32", rank=rank, world=2)
        assert lm.model.plan is not None
        shards.append((lm.model.plan, lm.model))
    (p0, m0), (p1, m1) = shards
    for i, layer in enumerate(full.model.layers):
        q, k, v = layer.wqkv.split([c.n_heads * hd, c.n_kv_heads * hd, c.n_kv_heads * hd])
        gate, up = layer.w_gate_up.chunk(2)
        for plan, m in shards:
            mine = m.layers[i]
            qs = slice(plan.q_heads.start * hd, plan.q_heads.stop * hd)
            ks = slice(plan.kv_heads.start * hd, plan.kv_heads.stop * hd)
            f = slice(plan.ffn.start, plan.ffn.stop)
            assert torch.equal(mine.wqkv, torch.cat([q[qs], k[ks], v[ks]]))
            assert torch.equal(mine.wo, layer.wo[:, qs])
            assert torch.equal(mine.w_gate_up, torch.cat([gate[f], up[f]]))
            assert torch.equal(mine.w_down, layer.w_down[:, f])
        assert m0.layers[i].wqkv.shape[0] + m1.layers[i].wqkv.shape[0] == layer.wqkv.shape[0]
    for plan, m in shards:
        v = plan.vocab
        assert m.embed.shape[0] == plan.vocab_rows
        assert torch.equal(m.embed[: len(v)], full.model.embed[v.start : v.stop])
        assert torch.equal(m.lm_head[: len(v)], full.model.lm_head[v.start : v.stop])
        assert not m.embed[len(v) :].any()


class Worker:
    def __init__(self, sock: str, proc: subprocess.Popen[bytes]) -> None:
        self.sock, self.proc = sock, proc

    @property
    def log(self) -> str:
        return pathlib.Path(self.sock + ".log").read_text(errors="replace")

    def followers(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def connect(self, timeout: float = 60) -> WorkerClient:
        """A client once the worker listens; fails at once (with its log) if it exits."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.sock):
            code = self.proc.poll()
            assert code is None, f"the worker exited with {code}:\n{self.log[-4000:]}"
            assert time.monotonic() < deadline, f"the worker never listened:\n{self.log[-4000:]}"
            time.sleep(0.05)
        return WorkerClient(self.sock, timeout=timeout)


@pytest.fixture
def start(tmp_path: pathlib.Path) -> Iterator[object]:
    started: list[Worker] = []

    def run(model: pathlib.Path | None, *args: str) -> Worker:
        sock = str(tmp_path / f"w{len(started)}.sock")
        extra = ("--model", str(model)) if model is not None else ()
        w = Worker(sock, spawn_worker(sock, "--device", "cpu", *extra, *args))
        started.append(w)
        return w

    yield run
    for w in started:
        kids = w.followers() if w.proc.poll() is None else []
        w.proc.kill()
        w.proc.wait()
        for k in kids:
            k.kill()


def _greedy_runs(c: WorkerClient, prompts: list[list[int]], tokens: int, rid0: int) -> list:
    c.submit_many(
        [(rid0 + i, p, {**GREEDY, "max_new_tokens": tokens}, {}) for i, p in enumerate(prompts)]
    )
    got = c.wait([rid0 + i for i in range(len(prompts))])
    return [got[rid0 + i].ids for i in range(len(prompts))]


def _tiny_session(c: WorkerClient) -> list:
    """Batched prompts, then prefix-cache hits ending inside a block (a KV copy) and a
    fork with n = 2 (a copy of the partial last block)."""
    prompts = [[5 + (i * 7 + j * 3) % 250 for j in range(3 + 5 * i)] for i in range(6)]
    out = _greedy_runs(c, prompts, 12, 1)
    out += _greedy_runs(c, [prompts[5][:21] + [9, 9, 9]], 8, 100)
    c.submit(200, prompts[4] + [17], {**GREEDY, "max_new_tokens": 9, "n": 2})
    got = c.wait([200, 201])
    return [*out, got[200].ids, got[201].ids, got[200].extras[0].get("cached_tokens")]


def test_tp2_greedy_equals_tp1_on_uneven_split(start, tiny3: TinyModel) -> None:  # type: ignore[no-untyped-def]
    workers = [
        start(tiny3.path, "--block-size", "4"),
        start(tiny3.path, "--block-size", "4", "--tp", "2"),
    ]
    runs = []
    for w in workers:
        c = w.connect()
        runs.append(_tiny_session(c))
        if w is workers[1]:
            assert c.hello.model["tp"] == 2
        c.close()
    assert runs[0] == runs[1]
    assert runs[0][-1] > 0  # the fork's prompt was (partly) a prefix-cache hit


@pytest.mark.parametrize("name", ["phi3", "gemma2", "gemma3"])
def test_tp2_greedy_equals_tp1_on_other_families(start, name: str, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """What other architectures add to the layer shards too: fused q/k/v and gate/up
    split per rank, the windows, Gemma's scaled embeddings, post-norms and caps, Gemma
    3's local RoPE tables."""
    pytest.importorskip("transformers")
    from tests.hf_reference import FAMILIES, build_hf, write_family_gguf

    family = FAMILIES[name]
    path = write_family_gguf(family, build_hf(family, dtype=torch.float32), tmp_path / "f.gguf")
    prompts = [[5 + (i * 7 + j * 3) % 250 for j in range(10 + 20 * i)] for i in range(3)]
    runs = []
    for args in ((), ("--tp", "2")):
        c = start(path, "--block-size", "4", *args).connect()
        runs.append(_greedy_runs(c, prompts, 30, 1))
        c.close()
    assert runs[0] == runs[1]


def test_tp_above_kv_heads_refused_before_any_rank_starts(start, tiny3: TinyModel) -> None:  # type: ignore[no-untyped-def]
    w = start(tiny3.path, "--tp", "4")
    assert w.proc.wait(60) != 0
    assert "--tp 4 exceeds the 3 KV heads" in w.log
    assert "rank 1" not in w.log


def test_followers_exit_with_rank0(start, tiny3: TinyModel) -> None:  # type: ignore[no-untyped-def]
    killed, stopped = start(tiny3.path, "--tp", "3"), start(tiny3.path, "--tp", "2")
    for w, n in ((killed, 2), (stopped, 1)):
        w.connect().close()  # HELLO: every rank has joined
        assert len(w.followers()) == n, w.log
    kids = killed.followers()
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait()
    gone, alive = psutil.wait_procs(kids, timeout=15)
    assert not alive, f"orphaned followers: {alive}"
    kids = stopped.followers()
    c = stopped.connect()
    c.send(Shutdown())
    assert stopped.proc.wait(30) == 0
    assert all(not k.is_running() or k.status() == psutil.STATUS_ZOMBIE for k in kids)
    c.close()


# -- the real model ---------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow  # `make test-full` (17 s); the tiny-model and other-family tests above stay
@pytest.mark.timeout(300)
def test_tp2_greedy_equals_tp1_on_reference_prompts(start) -> None:  # type: ignore[no-untyped-def]
    meta = json.loads((FIXTURES / "model_reference.json").read_text(encoding="utf-8"))
    # The shortest prompts, a middle one and the longest (608 tokens: 38 blocks, a
    # partial last one), 16 steps each; the tiny-model tests above cover the mechanics.
    chosen = [meta["prompts"][i] for i in (0, 1, 4, 12)]
    prompts = [p["ids"] for p in chosen]
    steps = 16
    # --tp splits fp32 weights: tp 1 runs them too (the quantized default rounds activations)
    tp1, tp2 = ("--weights", "fp32"), ("--tp", "2")
    workers = [start(None, "--kv-memory-mib", "128", *tp) for tp in (tp1, tp2)]
    runs = []
    for w in workers:
        c = w.connect(240)
        runs.append(_greedy_runs(c, prompts, steps, 1))
        c.close()
    for p, one, two in zip(chosen, *runs, strict=True):
        assert one == two, f"{p['name']}: tp 1 {one} != tp 2 {two}"
