"""An adapter unloaded (admin unload, or a deleted version dropped from the engine) while requests
for it are queued: those requests still run, reloading it from its local copy, and end as they
would have. Found by tests/e2e/test_chaos_e2e.py: requests pinned to a version deleted while they
waited never got a token (the engine idle, the client waiting until its timeout)."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from tests.fixtures.peft_adapters import make_peft_adapter

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("unload-queued")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    path = make_peft_adapter(base, root / "a", seed=3, r=4)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", home=root / "home", kv_cache_bytes=4 << 20,
              max_loras=2, max_lora_rank=8, max_num_seqs=8)
    want = llm.generate([[5, 6, 7]], PARAMS, adapters=[str(path)])[0].token_ids
    yield llm, str(path), want


@pytest.fixture(autouse=True)
def _abort_leftovers(world):
    yield
    engine = world[0].engine
    for rid in list(engine._requests):  # a failed test must not leave its requests to the next
        engine.abort(rid)


def _run(engine, max_steps: int = 50) -> dict:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


@pytest.mark.parametrize("pinned", [False, True])
def test_request_queued_when_its_adapter_is_unloaded_still_runs(world, pinned):
    llm, path, want = world
    engine = llm.engine
    adapter_id = engine.lora_manager.load(path, tier="device", pin=pinned)
    engine.add_request("queued", [5, 6, 7], PARAMS, adapter=path)  # queued: no step has run yet
    engine.lora_manager.unload(adapter_id)
    assert _run(engine) == {"queued": want}
    assert engine.stats()["lora"]["adapters"][adapter_id]["outstanding_requests"] == 0


def test_waiting_behind_a_running_one_still_runs(world):
    """One request of the adapter is running, a second waits (max_num_seqs full of base ones)."""
    llm, path, want = world
    engine = llm.engine
    engine.add_request("running", [5, 6, 7], PARAMS, adapter=path)
    engine.step()
    for i in range(7):
        engine.add_request(f"base-{i}", [9, 9, 9], PARAMS)
    engine.add_request("waiting", [5, 6, 7], PARAMS, adapter=path)
    engine.lora_manager.unload(engine.lora_manager.resolve(path))
    done = _run(engine)
    assert done["running"] == want and done["waiting"] == want and len(done) == 9
