"""The prefix cache's disk tier (issue 59, point 3: ``--prefix-cache-dir``): block files
read back bit for bit; a corrupt, truncated or foreign file (another model, KV element
or layout version) logged, removed and never served; writes atomic; the directory held
to its bound, oldest first; and a real worker that restarts serves a long prefix from
disk with the cold run's tokens."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpu.cache.blocks import block_hash
from gpu.cache.disk import LAYOUT_VERSION, DiskLayout, DiskPrefixCache, model_identity
from gpu.model.loader import LoadedModel, load_model
from gpu.runtime.engine import Engine, EngineConfig
from tests.test_worker_engine import GREEDY, ids_of, prompts, run
from tests.tiny_gguf import TinyModel, TinySpec, write_tiny_gguf
from tests.worker_client import WorkerClient, spawn_worker
from wire import Shutdown, Stats, StatsReq

LAYOUT = DiskLayout("ab" * 16, "float16", n_layers=2, n_kv_heads=2, block_size=4, head_dim=8)
TOKENS = (5, 6, 7, 8)
KEY = block_hash(None, TOKENS)


def _rows(seed: int = 0, layout: DiskLayout = LAYOUT) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layout.shape, generator=g).to(layout.dtype)
    v = torch.randn(layout.shape, generator=g).to(layout.dtype)
    return k, v


def _store(root: Path, layout: DiskLayout = LAYOUT, max_bytes: int = 1 << 30) -> DiskPrefixCache:
    return DiskPrefixCache(root, max_bytes, layout)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_a_block_reads_back_bit_for_bit(tmp_path: Path) -> None:
    k, v = _rows()
    k[0, 0, 0, 0] = float("nan")  # bits, not values: a NaN comes back as written
    assert _store(tmp_path).put(KEY, None, TOKENS, k, v)
    got = _store(tmp_path).get(KEY, None, TOKENS)  # a new store: the index from the directory
    assert got is not None
    assert torch.equal(_bits(got[0]), _bits(k)) and torch.equal(_bits(got[1]), _bits(v))


def test_the_wrong_tokens_or_parent_are_never_served(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put(KEY, None, TOKENS, *_rows())
    assert store.get(KEY, 123, TOKENS) is None  # a file under a name it does not hold
    assert not store.path(KEY).exists()


def _damaged(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[len(data) - 100] ^= 0x01  # one bit of the payload
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))


@pytest.mark.parametrize("how", ["corrupt", "truncated", "empty", "garbage"])
def test_a_damaged_file_is_logged_removed_and_never_served(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    _store(tmp_path).put(KEY, None, TOKENS, *_rows())
    _damaged(_store(tmp_path).path(KEY), how)
    store = _store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="gpu.cache.disk"):
        assert store.get(KEY, None, TOKENS) is None
    assert not store.path(KEY).exists() and KEY not in store and store.bytes == 0
    assert store.dropped == 1 and "removed" in caplog.text


@pytest.mark.parametrize(
    "other",
    [
        replace(LAYOUT, model="cd" * 16),  # another model file
        replace(LAYOUT, kv_dtype="bfloat16"),  # another KV element
        replace(LAYOUT, kv_dtype="float32"),  # ... of another size
        replace(LAYOUT, version=LAYOUT_VERSION + 1),  # another layout version
        replace(LAYOUT, n_kv_heads=1),  # another shape
    ],
    ids=["model", "bf16", "fp32", "version", "shape"],
)
def test_a_foreign_file_is_logged_removed_and_never_served(
    tmp_path: Path, other: DiskLayout, caplog: pytest.LogCaptureFixture
) -> None:
    _store(tmp_path, other).put(KEY, None, TOKENS, *_rows(layout=other))
    store = _store(tmp_path)
    assert KEY in store
    with caplog.at_level(logging.WARNING, logger="gpu.cache.disk"):
        assert store.get(KEY, None, TOKENS) is None
    assert "foreign" in caplog.text and not store.path(KEY).exists()


def test_a_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block's name appears only with the whole file; a crash before the rename
    leaves a temporary file, which the next start removes and never reads."""
    store = _store(tmp_path)
    seen: list[tuple[bool, int]] = []
    real_replace = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        seen.append((Path(dst).exists(), Path(src).stat().st_size))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    store.put(KEY, None, TOKENS, *_rows())
    assert seen == [(False, store.path(KEY).stat().st_size)]

    def crash(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        raise KeyboardInterrupt  # the process dies between the write and the rename

    monkeypatch.setattr(os, "replace", crash)
    other = block_hash(KEY, TOKENS)
    with pytest.raises(KeyboardInterrupt):
        store.put(other, KEY, TOKENS, *_rows(1))
    monkeypatch.undo()
    assert not store.path(other).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    again = _store(tmp_path)
    assert other not in again and KEY in again
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_the_bound_holds_under_a_stream_of_distinct_prefixes(tmp_path: Path) -> None:
    """Fifty blocks of distinct prefixes into room for ten: never over the bound, the
    oldest go first, a block read is young again, and a restart keeps the order."""
    one = _store(tmp_path / "probe")
    one.put(KEY, None, TOKENS, *_rows())
    size = one.bytes
    store = _store(tmp_path / "c", max_bytes=10 * size + size // 2)
    keys = []
    for i in range(50):
        tokens = (i, i + 1, i + 2, i + 3)
        key = block_hash(None, tokens)
        keys.append((key, tokens))
        time.sleep(0.005)  # distinct modification times (a file system's clock is coarse)
        assert store.put(key, None, tokens, *_rows(i))
        assert store.bytes <= store.max_bytes and len(store) == min(i + 1, 10)
        on_disk = sum(p.stat().st_size for p in (tmp_path / "c").iterdir())
        assert on_disk == store.bytes
        if i == 45:
            assert store.get(keys[40][0], None, keys[40][1]) is not None
    kept = {k for k, _ in keys[-9:]} | {keys[40][0]}
    assert {k for k, _ in keys if k in store} == kept  # 41 went, 40 was read at 45
    again = _store(tmp_path / "c", max_bytes=3 * size + size // 2)  # a restart with a smaller bound
    assert {k for k, _ in keys if k in again} == {k for k, _ in keys[-3:]}


def test_a_block_larger_than_the_bound_is_not_written(tmp_path: Path) -> None:
    store = _store(tmp_path, max_bytes=100)
    assert not store.put(KEY, None, TOKENS, *_rows())
    assert not list(tmp_path.iterdir())


def test_the_model_identity_tells_files_apart(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"\x01" * 3_000_000)
    b.write_bytes(b"\x01" * 2_999_999 + b"\x02")  # the same size, the last byte differs
    assert model_identity(a) != model_identity(b)
    assert model_identity(a) == model_identity(tmp_path / "a.gguf")


# -- the engine and the worker -------------------------------------------------------


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return write_tiny_gguf(
        tmp_path_factory.mktemp("gguf") / "long.gguf", TinySpec(context_length=6144)
    )


@pytest.fixture(scope="module")
def lm(long_model: TinyModel) -> LoadedModel:
    return load_model(long_model.path, device="cpu")


def _engine(lm: LoadedModel, root: Path, blocks: int = 300) -> Engine:
    config = EngineConfig(kv_blocks=blocks, block_size=16, prefix_cache_dir=str(root))
    return Engine(lm, config)


def test_evicted_blocks_come_back_from_disk_with_the_cold_tokens(
    lm: LoadedModel, tmp_path: Path
) -> None:
    """Distinct prompts evict the first one's blocks to disk; a new engine on the same
    directory reads them back, and a damaged file only shortens the hit."""
    p, *others = prompts(4, lm.config.vocab_size, seed=31, lo=1000, hi=1001)
    s = {**GREEDY, "max_new_tokens": 6}
    engine = _engine(lm, tmp_path, blocks=80)  # room for one prompt at a time
    cold = ids_of(run(engine, [(1, p, s, {})])[1])
    for i, q in enumerate(others):
        run(engine, [(10 + i, q, s, {})])
    assert engine.disk is not None and engine.disk.store.writes >= 62
    fresh = _engine(lm, tmp_path)
    warm = run(fresh, [(2, p, s, {})])[2]
    assert ids_of(warm) == cold and warm[0].extra["cached_tokens"] == 992  # 62 blocks
    third = _engine(lm, tmp_path)  # the blocks of p's 30th are damaged
    key = block_hash(None, p[:16])
    for i in range(1, 30):
        key = block_hash(key, p[i * 16 : (i + 1) * 16])
    path = third.disk.store.path(key) if third.disk is not None else None
    assert path is not None and path.exists()
    _damaged(path, "corrupt")
    again = run(third, [(3, p, s, {})])[3]
    assert ids_of(again) == cold and again[0].extra["cached_tokens"] == 29 * 16


def test_a_restarted_worker_serves_a_long_prefix_from_disk(
    long_model: TinyModel, tmp_path: Path
) -> None:
    """The real worker process: a 4,000-token prompt, SHUTDOWN (the cache spilled to
    disk), a new worker on the same directory: the same tokens, the prefix cached."""
    root = tmp_path / "prefix"
    args = ["--model", str(long_model.path), "--prefix-cache-dir", str(root),
            "--prefix-cache-disk-mib", "64", "--kv-cache-tokens", "8192"]  # fmt: skip
    p = prompts(1, 200, seed=5, lo=4000, hi=4001)[0]
    s = {**GREEDY, "max_new_tokens": 8}
    got = []
    for run_no in range(2):
        sock = str(tmp_path / f"w{run_no}.sock")
        proc = spawn_worker(sock, *args)
        try:
            c = WorkerClient(sock, timeout=120)
            cap = c.hello.capacity
            assert cap["prefix_cache_dir"] == str(root) and cap["prefix_cache_disk_mib"] == 64
            c.submit(1, p, s)
            r = c.wait()[1]
            stats = c.request(StatsReq(1), Stats).load
            got.append((r.ids, r.extras[0]["cached_tokens"], stats))
            c.send(Shutdown())
            assert proc.wait(timeout=60) == 0
            c.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    (cold, cold_cached, _), (warm, warm_cached, stats) = got
    assert cold_cached == 0 and warm_cached == 249 * 16  # whole blocks, the last fed again
    assert warm == cold
    assert stats["prefix_disk_reads"] == 249
    assert 0 < sum(f.stat().st_size for f in root.iterdir()) <= 64 << 20


def test_lifecycle_serve_forwards_the_options_and_reports_them(
    long_model: TinyModel, tmp_path: Path
) -> None:
    """``lifecycle serve --prefix-cache-dir``: the worker it spawns takes the options,
    ``/server_info`` shows them, and after the server is stopped (SIGTERM: drain, the
    worker's SHUTDOWN, the spill) and started again, the same request is served from
    disk with the same tokens."""
    import httpx

    from tests.scripted import lifecycle_server

    root = tmp_path / "prefix"
    p = prompts(1, 200, seed=6, lo=2000, hi=2001)[0]
    body = {"input_ids": p, "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    outs = []
    for _ in range(2):
        with lifecycle_server("--model", str(long_model.path), "--device", "cpu",
                              "--prefix-cache-dir", str(root), "--prefix-cache-disk-mib",
                              "32", "--kv-cache-tokens", "4096") as url:  # fmt: skip
            cap = httpx.get(url + "/server_info").json()["internal_states"][0]["capacity"]
            assert cap["prefix_cache_dir"] == str(root) and cap["prefix_cache_disk_mib"] == 32
            r = httpx.post(url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            outs.append((r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"]))
    (cold, cold_cached), (warm, warm_cached) = outs
    assert cold_cached == 0 and warm_cached == 124 * 16 and warm == cold


def _chain(p: list[int], n: int) -> list[int]:
    """The hashes of ``p``'s first ``n`` whole blocks of 16."""
    keys, parent = [], None
    for i in range(n):
        parent = block_hash(parent, p[i * 16 : (i + 1) * 16])
        keys.append(parent)
    return keys


def test_a_block_is_not_written_back_before_its_rows_are_loaded(
    lm: LoadedModel, tmp_path: Path
) -> None:
    """A block read back holds garbage until the next step writes its rows: evicted
    before then (a request that read it and was not admitted), it is not written."""
    p = prompts(1, lm.config.vocab_size, seed=41, lo=100, hi=101)[0]
    first = _engine(lm, tmp_path / "a")
    run(first, [(1, p, {**GREEDY, "max_new_tokens": 2}, {})])
    assert first.disk is not None and first.disk.spill(first.blocks) == 6
    second = _engine(lm, tmp_path / "a")
    disk = second.disk
    assert disk is not None
    blocks: list[int] = []
    hashes: list[int] = []
    assert disk.extend(second.blocks, p, blocks, hashes, 99) == 6 and hashes == _chain(p, 6)
    disk.store = _store(tmp_path / "b", disk.store.layout)  # an empty store to write to
    tokens = tuple(p[:16])
    assert not disk.write(blocks[0], hashes[0], None, tokens)  # its load is pending
    (loaded, k, v), *_ = disk.take_loads()
    assert loaded == blocks[0] and k.shape == disk.store.layout.shape
    assert disk.write(blocks[0], hashes[0], None, tokens)  # the step has written it


def test_a_spill_dates_the_most_recently_used_newest(lm: LoadedModel, tmp_path: Path) -> None:
    """At shutdown every cached full block goes to disk, dated by use: a restart with
    room for fewer keeps the most recently used."""
    p1, p2 = prompts(2, lm.config.vocab_size, seed=42, lo=64, hi=65)
    engine = _engine(lm, tmp_path)
    s = {**GREEDY, "max_new_tokens": 1}
    run(engine, [(1, p1, s, {})])
    run(engine, [(2, p2, s, {})])
    assert engine.disk is not None and engine.disk.spill(engine.blocks) == 8
    old, new = _chain(p1, 4), _chain(p2, 4)
    mtime = {k: engine.disk.store.path(k).stat().st_mtime_ns for k in old + new}
    assert max(mtime[k] for k in old) < min(mtime[k] for k in new)
    size = max(engine.disk.store.path(k).stat().st_size for k in new)
    again = _store(tmp_path, engine.disk.store.layout, max_bytes=4 * size)
    assert {k for k in old + new if k in again} == set(new)


def test_a_worker_with_a_disk_cache_is_given_time_to_spill() -> None:
    """A spawned worker is killed this long after its SHUTDOWN: longer with a disk tier,
    whose spill writes the blocks out as it stops."""
    from lifecycle.link.supervisor import STOP_GRACE
    from lifecycle.runtime import SPILL_GRACE, AppConfig, _supervisor_config

    plain = _supervisor_config(AppConfig(), None, None)
    spilling = _supervisor_config(AppConfig(prefix_cache_dir="/tmp/kv"), None, None)
    assert plain.stop_grace == STOP_GRACE < SPILL_GRACE == spilling.stop_grace
