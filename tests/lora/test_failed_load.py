"""An adapter whose files fail when the engine (re)loads them at admission (deleted, or changed
since they were registered) fails that request with ``InvalidAdapterError`` and leaves nothing
behind: no queued request, no outstanding count, no KV block; the engine keeps serving."""

from __future__ import annotations

import shutil

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.spec import AdapterRef
from tests.fixtures.peft_adapters import make_peft_adapter

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("failed-load")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    good = make_peft_adapter(base, root / "good", seed=1, r=4)
    other = make_peft_adapter(base, root / "other", seed=2, r=4)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", home=root / "home", kv_cache_bytes=4 << 20,
              max_loras=2, max_lora_rank=8, max_num_seqs=8)
    reference = {
        "base": llm.generate([[5, 6, 7]], PARAMS)[0].token_ids,
        "good": llm.generate([[5, 6, 7]], PARAMS, adapters=[str(good)])[0].token_ids,
    }
    return llm, root, good, other, reference


def _break(how: str, good, other, dst):
    """A copy of ``good`` registered with the engine, then dropped from its tiers and broken."""
    shutil.copytree(good, dst)
    return dst, lambda: shutil.rmtree(dst) if how == "deleted" else shutil.copy(
        other / "adapter_model.safetensors", dst / "adapter_model.safetensors"
    )


def _assert_clean(llm, adapter_id):
    engine = llm.engine
    stats = engine.stats()
    assert engine.num_unfinished_requests == 0 and stats["num_requests_waiting"] == 0
    assert stats["lora"]["adapters"][adapter_id]["outstanding_requests"] == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("how", ["deleted", "changed"])
def test_offline_request_on_broken_files_leaves_nothing(world, how, tmp_path):
    llm, _, good, other, reference = world
    path, breaks = _break(how, good, other, tmp_path / "x")
    adapter_id = llm.add_adapter(f"x-{how}", str(path))
    llm.engine.lora_manager.unload(adapter_id)  # next use reads the files again
    breaks()
    with pytest.raises(InvalidAdapterError):
        # the good request ahead of it in the same call must not stay queued either
        llm.generate([[5, 6, 7], [5, 6, 7]], PARAMS, adapters=[None, f"x-{how}"])
    _assert_clean(llm, adapter_id)
    assert llm.generate([[5, 6, 7]], PARAMS)[0].token_ids == reference["base"]
    assert llm.generate([[5, 6, 7]], PARAMS, adapters=[str(good)])[0].token_ids == reference["good"]
    llm.remove_adapter(f"x-{how}")


def test_async_request_on_changed_files_leaves_nothing(world, tmp_path):
    """The server's path: an ``AdapterRef`` with the content hash the engine already knows."""
    llm, _, good, other, reference = world
    path, breaks = _break("changed", good, other, tmp_path / "y")
    adapter_id = llm.add_adapter("y", str(path))
    llm.engine.lora_manager.unload(adapter_id)
    breaks()
    aengine = AsyncLLMEngine(llm.config, engine=llm.engine)

    async def tokens(adapter):
        out = []
        async for delta in aengine.generate([5, 6, 7], PARAMS, adapter=adapter):
            out += delta.outputs[0].token_ids
        return out

    import asyncio

    async def main():
        with pytest.raises(InvalidAdapterError):
            await tokens(AdapterRef(name="y@1", path=str(path), content_hash=adapter_id))
        return await tokens(None)

    try:
        base_tokens = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert base_tokens == reference["base"]
    _assert_clean(llm, adapter_id)
    llm.remove_adapter("y")


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "schedule-ahead"])
def test_adapter_lost_mid_run_aborts_only_its_requests(world, tmp_path, ahead, monkeypatch):
    """The weights of an adapter with running requests leave device and host and its files go:
    the next step cannot place it. Its requests end ("abort", blocks freed); a base request and
    another adapter's request in the same batch finish with their reference outputs; the engine
    keeps serving. With schedule_ahead the step already launched ahead still runs (its adapter was
    in place when it was launched); no step goes ahead without its adapters in their slots, so
    the failure comes from a step the engine can drop, as without it."""
    llm, root, good, other, reference = world
    engine, manager = llm.engine, llm.engine.lora_manager
    monkeypatch.setattr(engine, "schedule_ahead", ahead)
    doomed = tmp_path / "doomed"  # other weights than good's: another adapter id, another path
    shutil.copytree(other, doomed)
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rids = [engine.add_request(None, [5, 6, 7], long, adapter=str(doomed)),
            engine.add_request(None, [5, 6, 7], PARAMS),
            engine.add_request(None, [5, 6, 7], PARAMS, adapter=str(good))]
    finals = {}
    for out in engine.step() + engine.step():  # all three running, the doomed adapter in a slot
        if out.finished:
            finals[out.request_id] = out
    doomed_id = engine._requests[rids[0]].req.adapter_id
    slot = manager.pool.slot_of(doomed_id)
    assert slot is not None
    manager.pool.clear(slot)
    manager.host.remove(doomed_id)
    shutil.rmtree(doomed)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[rids[0]].finish_reason == "abort"
    assert finals[rids[1]].token_ids == reference["base"]
    assert finals[rids[2]].token_ids == reference["good"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks or engine.config.enable_prefix_caching
    stats = engine.stats()
    assert stats["num_seqs_running"] == 0 and stats["num_seqs_waiting"] == 0 and stats["kv_cache_usage"] == 0
    assert llm.generate([[5, 6, 7]], PARAMS, adapters=[str(good)])[0].token_ids == reference["good"]


def _uncomputed_cached_blocks(engine) -> list[int]:
    """Blocks the prefix cache offers as computed that an unfinished sequence has not computed."""
    bm = engine.block_manager
    cached = set(bm._cached.values())
    uncomputed = set()
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        uncomputed.update(seq.block_table[seq.num_computed_tokens // bm.block_size:])
    return sorted(cached & uncomputed)


def test_a_step_that_did_not_run_leaves_no_uncomputed_block_in_the_prefix_cache(world, tmp_path):
    """The step that finds the adapter gone also admits a base request with a three-block
    prompt, whose blocks are registered in the prefix cache when scheduled. The step never ran:
    no cached block may then stand for K/V that nobody computed (a request admitted before the
    owner runs again would read it as a prefix hit), and the base request still gets its
    reference output."""
    llm, root, good, other, reference = world
    engine, manager = llm.engine, llm.engine.lora_manager
    assert engine.config.enable_prefix_caching
    prompt = [(7 * i) % 97 + 3 for i in range(3 * engine.block_manager.block_size + 2)]
    want = llm.generate([prompt], PARAMS)[0].token_ids
    engine.reset_prefix_cache()
    doomed = tmp_path / "doomed"
    shutil.copytree(other, doomed)
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rid_doomed = engine.add_request(None, [5, 6, 7], long, adapter=str(doomed))
    engine.step(), engine.step()
    doomed_id = engine._requests[rid_doomed].req.adapter_id
    manager.pool.clear(manager.pool.slot_of(doomed_id))
    manager.host.remove(doomed_id)
    shutil.rmtree(doomed)
    rid_base = engine.add_request(None, prompt, PARAMS)
    failed = engine.step()  # schedules both; placing the doomed adapter fails
    assert [out.finish_reason for out in failed] == ["abort"]
    assert _uncomputed_cached_blocks(engine) == []
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[rid_base].token_ids == want
    stats = engine.stats()
    assert stats["num_seqs_running"] == 0 and stats["kv_cache_usage"] == 0
