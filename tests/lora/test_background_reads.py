"""Host misses of known adapters are read on a worker thread (``HostLoader``), never on the engine
thread: the engine keeps decoding other requests while such an adapter is read, the adapter's
requests wait for it and then run with exactly its weights (PEFT's greedy output), one read
serves every request that waits for it, and a read that fails fails only that adapter's waiting
requests with the read's error, leaving nothing behind."""

from __future__ import annotations

import asyncio
import shutil
import threading

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.async_engine import AsyncLLMEngine, EngineDeadError
from loraplex.lora.errors import AdapterLoadFailedError, InvalidAdapterError
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.lora.test_acceptance import reference
from tests.lora.test_manager import new_manager

WORKER = "loraplex-adapter-read"


class GatedParse:
    """Wraps ``AdapterCatalog.parse``: records the reading thread, and holds reads of the adapter
    ids in ``gated`` until ``release`` is set."""

    def __init__(self, manager, gated: set[str] = frozenset()):
        self.parse = manager.catalog.parse
        self.gated = set(gated)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []

    def __call__(self, path, expected_id=None):
        self.threads.append(threading.current_thread().name)
        if expected_id in self.gated:
            self.entered.set()
            assert self.release.wait(30)
        return self.parse(path, expected_id)


def _wait_read(m, woke: threading.Event) -> None:
    assert m.host_tier.loader.wait(30) and woke.wait(30)  # the read ended, and said so
    woke.clear()


def test_manager_reads_host_misses_in_the_background(lora_base, make_adapter, monkeypatch):
    probe = new_manager(lora_base.spec)
    size = probe.host.get(probe.register("probe", make_adapter("probe", seed=9))).nbytes
    m = new_manager(lora_base.spec, max_loras=1, max_cpu_lora_bytes=size)  # one slot, room for one in host
    a, b, c = (m.register(n, make_adapter(n, seed=i)) for i, n in enumerate("abc"))
    assert m.tier_of(a) == m.tier_of(b) == "disk" and m.tier_of(c) == "host"
    woke = threading.Event()
    m.start_background_reads(on_done=woke.set)
    gate = GatedParse(m)
    monkeypatch.setattr(m.catalog, "parse", gate)
    host_loads = m.stats()["adapters"][a]["host_loads"]

    for _ in range(3):  # three requests for a: one read
        m.prefetch(a)
    assert not m.is_ready(a) and m.tier_of(a) == "disk" and m.stats()["host_reads_in_flight"] == 1
    _wait_read(m, woke)
    assert m.collect_reads() == []
    assert m.tier_of(a) == "device" and m.stats()["adapters"][a]["host_loads"] == host_loads + 1
    assert gate.threads and all(t.startswith(WORKER) for t in gate.threads)

    m.prefetch(b)  # the slot is a's (it has requests): b is read into host, evicting c (idle)
    _wait_read(m, woke)
    m.collect_reads()
    assert m.host.ids() == [b] and m.tier_of(c) == "disk"
    m.prefetch(c)  # host holds b, which waits for the slot: no room, so no read is started
    assert not m.is_ready(c) and m.stats()["host_reads_in_flight"] == 0
    for _ in range(3):
        m.on_request_finished(a, 1, 1)  # a idle: b takes the slot; its host copy may now go
    assert m.tier_of(b) == "device"
    m.prepare_step([b])  # room in host now: c's read starts
    assert m.stats()["host_reads_in_flight"] == 1
    _wait_read(m, woke)
    m.collect_reads()
    assert m.is_ready(c) and m.tier_of(c) == "host" and m.stats()["host_reads_in_flight"] == 0
    assert all(t.startswith(WORKER) for t in gate.threads)
    m.stop_background_reads()


def test_manager_failed_background_read_keeps_nothing(lora_base, make_adapter, tmp_path):
    m = new_manager(lora_base.spec, max_loras=1)
    path = tmp_path / "gone"
    shutil.copytree(make_adapter("x", seed=3), path)
    x = m.register("x", path)
    m.unload(x)
    shutil.rmtree(path)
    woke = threading.Event()
    m.start_background_reads(on_done=woke.set)
    m.prefetch(x)
    _wait_read(m, woke)
    failed = m.collect_reads()
    assert [e.adapter_id for e in failed] == [x] and isinstance(failed[0], AdapterLoadFailedError)
    assert isinstance(failed[0].__cause__, InvalidAdapterError)
    assert m.tier_of(x) == "disk" and not m.host_tier.wanted and m.stats()["host_reads_in_flight"] == 0
    m.stop_background_reads()


def test_read_nobody_waits_for_any_more_is_not_kept(lora_base, make_adapter, monkeypatch):
    m = new_manager(lora_base.spec, max_loras=1)
    a = m.register("a", make_adapter("a", seed=1))
    m.unload(a)
    woke = threading.Event()
    m.start_background_reads(on_done=woke.set)
    gate = GatedParse(m, gated={a})
    monkeypatch.setattr(m.catalog, "parse", gate)
    m.prefetch(a)
    assert gate.entered.wait(30) and m.host.reserved_bytes > 0
    m.on_request_finished(a, 1, 0)  # its only request was aborted while the read ran
    gate.release.set()
    _wait_read(m, woke)
    assert m.collect_reads() == []
    assert m.tier_of(a) == "disk" and m.host.reserved_bytes == 0 and not m.host_tier.wanted
    m.stop_background_reads()


def test_reads_dropped_by_stop_stay_wanted(lora_base, make_adapter, monkeypatch):
    """A request that arrives while its adapter is read does not queue the adapter again (the
    read will bring it). When ``stop_background_reads`` drops that read (the async engine
    stopped; the engine may be driven offline after), the adapter must be queued for the
    engine thread's own read, or its request waits for ever."""
    m = new_manager(lora_base.spec, max_loras=1)
    a = m.register("a", make_adapter("a", seed=1))
    m.unload(a)
    m.start_background_reads(on_done=lambda: None)
    gate = GatedParse(m, gated={a})
    monkeypatch.setattr(m.catalog, "parse", gate)
    m.prefetch(a)
    assert gate.entered.wait(30)
    m.on_request_finished(a, 1, 0)  # aborted while read...
    m.prefetch(a)  # ...and asked for again before the read landed
    m.stop_background_reads()
    gate.release.set()
    m.prepare_step([])  # the next step (no loader now) reads it here
    assert m.is_ready(a) and m.host.reserved_bytes == 0


def test_failed_read_of_an_adapter_loaded_meanwhile_fails_nothing(lora_base, make_adapter, monkeypatch):
    """An operator's load (``load`` reads on the engine thread) put the adapter in a slot while
    its background read was still running; that read then failing aborted every request of an
    adapter that was loaded and serving."""
    m = new_manager(lora_base.spec, max_loras=1)
    a = m.register("a", make_adapter("a", seed=1))
    m.unload(a)
    m.start_background_reads(on_done=lambda: None)
    parse, entered, release = m.catalog.parse, threading.Event(), threading.Event()

    def worker_fails(path, expected_id=None):
        if threading.current_thread().name.startswith(WORKER):
            entered.set()
            assert release.wait(30)
            raise OSError("flaky disk")
        return parse(path, expected_id)

    monkeypatch.setattr(m.catalog, "parse", worker_fails)
    m.prefetch(a)
    assert entered.wait(30)
    m.load("a", tier="device")
    release.set()
    assert m.host_tier.loader.wait(30)
    assert m.collect_reads() == []
    assert m.tier_of(a) == "device" and m.host.reserved_bytes == 0 and not m.host_tier.wanted
    m.stop_background_reads()


def test_host_cache_reservation_holds_room_until_its_put(lora_base, make_adapter):
    """Room reserved for a read in flight is taken by nothing else; the read's put lands in it
    without evicting; a cancelled reservation gives the room back."""
    from loraplex.lora.host_cache import HostCache

    m = new_manager(lora_base.spec)
    w = [m.catalog.parse(str(make_adapter(n, seed=i))) for i, n in enumerate("abc")]
    size = w[0].nbytes
    assert all(x.nbytes == size for x in w)
    cache = HostCache(2 * size)
    assert cache.put(w[0])[0]
    assert cache.reserve(w[1].adapter_id, size, lambda _: True) == (True, [])
    assert cache.put(w[2], lambda _: True) == (False, [])  # a is protected, b's room is held
    assert not cache.can_fit(size, lambda _: True)
    assert cache.put(w[1], lambda _: True) == (True, []) and cache.reserved_bytes == 0
    assert cache.reserve(w[2].adapter_id, size, lambda _: False) == (True, [w[0].adapter_id])  # LRU makes room
    cache.cancel(w[2].adapter_id)
    assert cache.reserved_bytes == 0 and cache.can_fit(size)


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("background-reads")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    dirs = {"slow": make_peft_adapter(base, root / "slow", seed=11, r=8, lora_alpha=16)}
    peft = peft_model_for(base, dirs)
    prompt = [3, 4, 5, 6]
    return dirs, {"slow": reference(peft, prompt, "slow", 6), None: reference(peft, prompt, None, 6)}, prompt


def _llm(tiny_llama_dir, home):
    return LLM(model=str(tiny_llama_dir), dtype="float32", home=home, kv_cache_bytes=8 << 20,
               max_loras=2, max_lora_rank=8, max_num_seqs=8)


def test_engine_keeps_decoding_while_an_evicted_adapter_is_read(world, tiny_llama_dir, loraplex_home,
                                                                 monkeypatch):
    dirs, expected, prompt = world
    llm = _llm(tiny_llama_dir, loraplex_home)
    engine, manager = llm.engine, llm.engine.lora_manager
    slow = llm.add_adapter("slow", str(dirs["slow"]))
    manager.unload(slow)  # known, in neither tier: the next request must read it again
    gate = GatedParse(manager, gated={slow})
    monkeypatch.setattr(manager.catalog, "parse", gate)
    aengine = AsyncLLMEngine(llm.config, engine=engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def run(adapter, params=greedy):
        tokens = []
        async for delta in aengine.generate(prompt, params, adapter=adapter):
            tokens += delta.outputs[0].token_ids
        return tokens

    async def main():
        base_task = asyncio.create_task(run(None, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)))
        await asyncio.sleep(0.05)
        slow_tasks = [asyncio.create_task(run("slow")) for _ in range(3)]
        assert await asyncio.to_thread(gate.entered.wait, 30)
        before = engine.scheduler.stats.num_steps
        await asyncio.sleep(0.3)  # the read is held: the base request must keep decoding
        steps_while_reading = engine.scheduler.stats.num_steps - before
        waiting_while_reading = engine.stats()["num_requests_waiting"]
        gate.release.set()
        return await asyncio.gather(*slow_tasks), await base_task, steps_while_reading, waiting_while_reading

    try:
        slow_tokens, base_tokens, steps, waiting = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert steps > 0 and waiting == 3
    assert slow_tokens == [expected["slow"]] * 3 and base_tokens[:6] == expected[None] and len(base_tokens) == 400
    assert gate.threads == [gate.threads[0]] and gate.threads[0].startswith(WORKER)  # one read, not on the engine
    assert engine.stats()["lora"]["adapters"][slow]["outstanding_requests"] == 0
    # /metrics: the registration's read and the host miss's; nothing in flight any more
    assert _metric(engine, "loraplex_adapter_host_loads_total") == 2
    assert _metric(engine, "loraplex_adapter_host_reads_in_flight") == 0


def _metric(engine, name: str) -> float:
    import re

    from loraplex.server.metrics import ServerMetrics

    metrics = ServerMetrics("m", 2)
    metrics.stats_source = engine.stats
    text = metrics.render()
    text = text.decode() if isinstance(text, bytes) else text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_failed_background_read_fails_only_its_waiting_requests(world, tiny_llama_dir, loraplex_home, tmp_path):
    dirs, expected, prompt = world
    llm = _llm(tiny_llama_dir, loraplex_home)
    engine, manager = llm.engine, llm.engine.lora_manager
    path = tmp_path / "doomed"
    shutil.copytree(dirs["slow"], path)
    doomed = llm.add_adapter("doomed", str(path))
    manager.unload(doomed)
    shutil.rmtree(path)
    aengine = AsyncLLMEngine(llm.config, engine=engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def run(adapter):
        tokens = []
        async for delta in aengine.generate(prompt, greedy, adapter=adapter):
            tokens += delta.outputs[0].token_ids
        return tokens

    async def main():
        results = await asyncio.gather(run(None), run("doomed"), run("doomed"), return_exceptions=True)
        return results, await run(None)

    try:
        (base, err1, err2), again = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert base == again == expected[None]
    assert isinstance(err1, InvalidAdapterError) and isinstance(err2, InvalidAdapterError)
    stats = engine.stats()
    assert stats["num_unfinished_requests"] == 0 and stats["lora"]["adapters"][doomed]["outstanding_requests"] == 0
    assert stats["lora"]["host_reads_in_flight"] == 0 and not manager.host_tier.wanted and manager.host_tier.loader is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks or engine.config.enable_prefix_caching


def test_admin_load_of_a_new_version_reads_off_the_engine_thread(world, tiny_llama_dir, loraplex_home,
                                                                  monkeypatch):
    """An operator warming a new version before a swap (``POST .../load``): its files are read
    and hashed while the engine keeps decoding, then it sits in a device slot."""
    from loraplex.lora.spec import AdapterRef

    dirs, expected, prompt = world
    llm = _llm(tiny_llama_dir, loraplex_home)
    engine, manager = llm.engine, llm.engine.lora_manager
    gate = GatedParse(manager)
    parse = gate.parse

    def slow(path, expected_id=None):
        gate.threads.append(threading.current_thread().name)
        gate.entered.set()
        assert gate.release.wait(30)
        return parse(path, expected_id)

    monkeypatch.setattr(manager.catalog, "parse", slow)
    aengine = AsyncLLMEngine(llm.config, engine=engine)

    async def base():
        tokens = []
        async for delta in aengine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)):
            tokens += delta.outputs[0].token_ids
        return tokens

    async def main():
        base_task = asyncio.create_task(base())
        await asyncio.sleep(0.05)
        load = asyncio.create_task(aengine.load_adapter(AdapterRef("slow@2", str(dirs["slow"])), tier="device"))
        assert await asyncio.to_thread(gate.entered.wait, 30)
        before = engine.scheduler.stats.num_steps
        await asyncio.sleep(0.3)
        steps = engine.scheduler.stats.num_steps - before
        gate.release.set()
        return await load, steps, await base_task

    try:
        adapter_id, steps, base_tokens = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert steps > 0 and len(base_tokens) == 300 and base_tokens[:6] == expected[None]
    assert gate.threads and "loraplex-engine" not in gate.threads
    assert manager.tier_of(adapter_id) == "device"
    assert llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        adapters=[AdapterRef("slow@2", str(dirs["slow"]), adapter_id)])[0].token_ids == expected["slow"]


def test_shutdown_mid_read_then_a_second_async_engine(world, tiny_llama_dir, loraplex_home, monkeypatch):
    """The async engine stops while a read is held: the waiting request ends with
    EngineDeadError, the read and its reservation are dropped; a second AsyncLLMEngine on the
    same engine reads in the background again and serves the adapter's exact output."""
    dirs, expected, prompt = world
    llm = _llm(tiny_llama_dir, loraplex_home)
    engine, manager = llm.engine, llm.engine.lora_manager
    slow = llm.add_adapter("slow", str(dirs["slow"]))
    manager.unload(slow)
    gate = GatedParse(manager, gated={slow})
    monkeypatch.setattr(manager.catalog, "parse", gate)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = AsyncLLMEngine(llm.config, engine=engine)

    async def run(aengine):
        tokens = []
        async for delta in aengine.generate(prompt, greedy, adapter="slow"):
            tokens += delta.outputs[0].token_ids
        return tokens

    async def main1():
        task = asyncio.create_task(run(first))
        assert await asyncio.to_thread(gate.entered.wait, 30)
        await asyncio.to_thread(first.shutdown)
        try:
            await task
        except EngineDeadError:
            return "dead"

    assert asyncio.run(main1()) == "dead"
    assert manager.host_tier.loader is None and manager.host.reserved_bytes == 0
    assert engine.stats()["lora"]["adapters"][slow]["outstanding_requests"] == 0
    gate.release.set()
    gate.gated.clear()
    gate.threads.clear()
    second = AsyncLLMEngine(llm.config, engine=engine)
    try:
        assert asyncio.run(asyncio.wait_for(run(second), 30)) == expected["slow"]
    finally:
        second.shutdown()
    assert gate.threads and all(t.startswith(WORKER) for t in gate.threads)
    assert engine.stats()["num_unfinished_requests"] == 0 and manager.host.reserved_bytes == 0
