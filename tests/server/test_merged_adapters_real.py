"""LoRAX's ``merged_adapters`` on the real engine (tiny Llama, CPU, float32) behind the real
registry, AdapterManager and LoRAX routes, in process: the greedy tokens of a merge are those of
PEFT's own merged model (``add_weighted_adapter``, the independent reference), unstreamed and
streamed; the merge sits in the engine's tiers like any adapter (host bytes, device slot); a
hot-swapped constituent moves the outputs to the new version's merge; DARE below density 1 is
reproducible (a fresh merger rebuilds the same weights); a merge refused once the files are read
(LoRA on embed_tokens) loads, builds and caches nothing."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch
from peft import PeftModel
from starlette.testclient import TestClient

from loraplex import LLM
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.lora.merge import MergeParams
from loraplex.registry.adapter_merges import AdapterMerger
from loraplex.server.app import create_app
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.server.registry_stack import registry_stack

ADMIN_KEY = "merge-admin-key"
N = 8
PROMPT = "merge me"


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("merged")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    dirs = {
        "p": make_peft_adapter(base, root / "p", seed=1, r=4, target_modules=["q_proj", "v_proj"]),
        "q": make_peft_adapter(base, root / "q", seed=2, r=4, lora_alpha=3, use_rslora=True,
                               target_modules=["q_proj", "k_proj", "o_proj", "down_proj"]),
        "q2": make_peft_adapter(base, root / "q2", seed=3, r=4, target_modules=["q_proj", "up_proj"]),
    }
    home = root / "home"
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", home=home, kv_cache_bytes=4 << 20,
              max_loras=2, max_lora_rank=8, max_num_seqs=8)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    settings, registry, manager, key = registry_stack(home, llm, tiny_llama_dir, ADMIN_KEY)
    for name in ("p", "q"):
        manager.upload("acme", name, dirs[name], "admin")
    app = create_app(settings, engine=engine, registry=registry, adapters=manager)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        yield client, base, dirs, llm, manager, app.state.ctx


def greedy(model, prompt: list[int], n: int = N) -> list[int]:
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def peft_merged(base, dirs: dict, weights, strategy, **kw):
    names = list(dirs)
    model = PeftModel.from_pretrained(copy.deepcopy(base), str(dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(dirs[name]), adapter_name=name)
    model.add_weighted_adapter(names, weights, "merged", combination_type=strategy, **kw)
    model.set_adapter("merged")
    return model.eval()


def generate(client, merged: dict) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, x-adapter-id) of a greedy LoRAX generate on the merge."""
    r = client.post("/t/acme/generate", json={"inputs": PROMPT, "parameters": {
        "merged_adapters": merged, "max_new_tokens": N, "ignore_eos_token": True, "details": True,
        "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    d = r.json()["details"]
    return [t["id"] for t in d["prefill"]], [t["id"] for t in d["tokens"]], r.headers["x-adapter-id"]


@pytest.mark.parametrize("strategy, kw", [
    ("linear", {}),
    ("ties", {"density": 0.4, "majority_sign_method": "total"}),
    ("dare_ties", {"density": 1.0, "majority_sign_method": "frequency"}),
])
def test_greedy_tokens_equal_peft_merged_model(world, strategy, kw):
    client, base, dirs, llm, _, ctx = world
    weights = [0.8, 1.7]
    merged = {"ids": ["p", "q"], "weights": weights, "merge_strategy": strategy, **kw}
    known = set(llm.engine.lora_manager.stats()["adapters"])
    prompt, tokens, header = generate(client, merged)
    reference = peft_merged(base, {"p": dirs["p"], "q": dirs["q"]}, weights, strategy, **kw)
    assert tokens == greedy(reference, prompt)
    with reference.disable_adapter():
        assert tokens != greedy(reference, prompt)  # the merge changes the output
    assert header == "p,q"

    # streamed: the same tokens
    with client.stream("POST", "/t/acme/generate_stream", json={"inputs": PROMPT, "parameters": {
            "merged_adapters": merged, "max_new_tokens": N, "ignore_eos_token": True}}) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert [e["token"]["id"] for e in events] == tokens

    # an ordinary adapter to the engine: in its tiers, its bytes counted in the host tier
    lora = llm.engine.lora_manager
    stats = lora.stats()
    [merged_hash] = set(stats["adapters"]) - known  # one new adapter: the merge
    assert ctx.adapter_display[merged_hash] == "acme/+merged(p,q)"
    entry = stats["adapters"][merged_hash]
    assert (entry["tier"], entry["requests"], entry["host_loads"], entry["loads"]) == ("device", 2, 1, 1)
    assert merged_hash in lora.host and stats["host_bytes"] >= lora.catalog.records[merged_hash].host_bytes > 0
    assert ctx.adapters.stats()["in_use"] == {}


def test_swapped_constituent_moves_outputs_to_the_new_version(world):
    client, base, dirs, _, manager, _ = world
    manager.upload("acme", "s", dirs["q"], "admin")
    merged = {"ids": ["p", "s"], "weights": [1.0, 0.9]}
    prompt, before, _ = generate(client, merged)
    assert before == greedy(peft_merged(base, {"p": dirs["p"], "q": dirs["q"]}, [1.0, 0.9], "linear"), prompt)

    manager.upload("acme", "s", dirs["q2"], "admin", activate=True)  # the hot-swap
    _, after, _ = generate(client, merged)
    want = greedy(peft_merged(base, {"p": dirs["p"], "q2": dirs["q2"]}, [1.0, 0.9], "linear"), prompt)
    assert after == want and want != before


def test_dare_below_density_one_is_reproducible(world):
    client, _, _, _, manager, ctx = world
    merged = {"ids": ["p", "q"], "weights": [1.0, 1.0], "merge_strategy": "dare_linear", "density": 0.5}
    _, first, _ = generate(client, merged)
    builds = ctx.merges.builds
    _, again, _ = generate(client, merged)
    assert again == first and ctx.merges.builds == builds  # the cached merge
    # a fresh merger (as after a restart) draws the same drop: the same content hash
    served = ctx.merges.resolve("acme", ["p", "q"], MergeParams("dare_linear", (1.0, 1.0), 0.5))
    manager.release(served.ref.content_hash)
    manager.disk_cache.remove(served.ref.content_hash)
    rebuilt = AdapterMerger(manager).resolve("acme", ["p", "q"], MergeParams("dare_linear", (1.0, 1.0), 0.5))
    manager.release(rebuilt.ref.content_hash)
    assert rebuilt.built and rebuilt.ref.content_hash == served.ref.content_hash


def test_refused_merge_leaves_engine_and_caches_alone(world):
    client, base, _, llm, manager, ctx = world
    emb = make_peft_adapter(base, manager.disk_cache.root.parent / "emb-src", seed=9, r=4,
                            target_modules=["q_proj", "embed_tokens"])
    version, _ = manager.upload("acme", "emb", emb, "admin")
    engine_adapters = set(llm.engine.lora_manager.stats()["adapters"])
    entries = {p.name for p in (manager.disk_cache.root / "entries").iterdir()}
    builds = ctx.merges.builds
    r = client.post("/t/acme/generate", json={"inputs": PROMPT, "parameters": {
        "merged_adapters": {"ids": ["p", "emb"]}, "max_new_tokens": 2}})
    assert r.status_code == 422 and "embed_tokens" in r.json()["error"], r.text
    assert set(llm.engine.lora_manager.stats()["adapters"]) == engine_adapters  # nothing loaded
    assert ctx.merges.builds == builds
    # the disk cache gained at most the constituents' own copies, no merge
    constituents = {version.sha256, manager.registry.resolve("acme", "p").sha256}
    assert {p.name for p in (manager.disk_cache.root / "entries").iterdir()} - entries <= constituents
    assert manager.stats()["in_use"] == {}


def test_forgotten_merges_leave_the_engine(world):
    """Past the tenant's bound of remembered merges, a forgotten merge nobody runs leaves the
    engine's catalog and stats (no record per distinct weight kept for ever); asked again, it
    gives the same tokens."""
    client, _, _, llm, _, ctx = world
    lora = llm.engine.lora_manager
    saved = ctx.merges.max_per_tenant
    ctx.merges.max_per_tenant = 1
    try:
        known = set(lora.stats()["adapters"])
        first = {"ids": ["p", "q"], "weights": [0.3, 0.45]}
        _, tokens, _ = generate(client, first)
        [first_hash] = set(lora.stats()["adapters"]) - known
        generate(client, {"ids": ["p", "q"], "weights": [0.3, 0.55]})
        adapters = set(lora.stats()["adapters"])
        assert first_hash not in adapters and first_hash not in lora.catalog.records
        assert first_hash not in ctx.adapter_display and len(adapters - known) <= 1
        _, again, _ = generate(client, first)
        assert again == tokens and first_hash in lora.stats()["adapters"]
        assert ctx.adapters.stats()["in_use"] == {}
    finally:
        ctx.merges.max_per_tenant = saved


def test_a_merge_running_when_its_constituent_is_deleted_leaves_the_engine_once_done(world):
    """Deleting a constituent drops the merges built from it; one a stream still runs on stays
    until that stream ends, then leaves the engine's catalog and stats as a deleted adapter does
    (the forget was tried once, found the merge held, and never again: a record kept for ever)."""
    import time

    client, base, _, llm, manager, ctx = world
    lora = llm.engine.lora_manager
    own = make_peft_adapter(base, manager.disk_cache.root.parent / "gone-src", seed=21, r=4, target_modules=["q_proj"])
    manager.upload("acme", "gone", own, "admin")  # weights no other version has: deleting them drops them
    known = set(lora.stats()["adapters"])
    body = {"inputs": PROMPT, "parameters": {"merged_adapters": {"ids": ["p", "gone"], "weights": [0.7, 0.2]},
                                             "max_new_tokens": 60, "ignore_eos_token": True}}
    with client.stream("POST", "/t/acme/generate_stream", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        [merged_hash] = set(lora.stats()["adapters"]) - known - {manager.registry.resolve("acme", "gone").sha256}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert client.delete("/admin/v1/tenants/acme/adapters/gone", headers=admin).status_code == 200
        assert merged_hash in lora.stats()["adapters"]  # the stream still runs on it
        tail = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert tail[-1]["generated_text"] is not None  # the stream ran to its end
    deadline = time.monotonic() + 5
    while merged_hash in lora.stats()["adapters"] or merged_hash in lora.catalog.records:
        assert time.monotonic() < deadline, "the merge's record outlived its last request"
        time.sleep(0.02)
    assert ctx.adapters.stats()["in_use"] == {}


def test_a_merge_built_while_its_constituent_is_deleted_is_forgotten_once_done(world, monkeypatch):
    """The delete comes while the merge is being built (drop_merges_of finds nothing to drop
    yet): the request still runs on it, but the merger does not remember it, and once that
    request ended it leaves the disk cache, the engine's catalog and stats and the status page's
    names (nothing can name it again), with no other merge request needed."""
    import threading

    import loraplex.registry.adapter_merges as adapter_merges

    client, base, _, llm, manager, ctx = world
    lora = llm.engine.lora_manager
    own = make_peft_adapter(base, manager.disk_cache.root.parent / "mid-src", seed=22, r=4, target_modules=["v_proj"])
    gone = manager.upload("acme", "mid", own, "admin")[0].sha256
    building, release = threading.Event(), threading.Event()
    real_merge = adapter_merges.merge_adapters

    def held_merge(*args, **kwargs):
        building.set()
        assert release.wait(30), "the test never released the build"
        return real_merge(*args, **kwargs)

    monkeypatch.setattr(adapter_merges, "merge_adapters", held_merge)
    handed_over = []  # what the merger hands the server to drop, as it happens
    take_forgotten = ctx.merges.take_forgotten

    def recorded_take_forgotten():
        taken = take_forgotten()
        handed_over.extend(taken)
        return taken

    monkeypatch.setattr(ctx.merges, "take_forgotten", recorded_take_forgotten)
    known = set(lora.stats()["adapters"]) | {gone}
    result = {}
    worker = threading.Thread(target=lambda: result.update(reply=generate(client, {"ids": ["p", "mid"],
                                                                                   "weights": [0.6, 0.4]})))
    worker.start()
    try:
        assert building.wait(30), "the merge was never built"
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert client.delete("/admin/v1/tenants/acme/adapters/mid", headers=admin).status_code == 200
    finally:
        release.set()
        worker.join(60)
    assert "reply" in result  # the request ran on the merge it asked for (generate checks the 200)
    # handed over to be dropped on the loop once the run let go of it, with no request meanwhile
    deadline = time.monotonic() + 30
    while not handed_over and time.monotonic() < deadline:
        time.sleep(0.02)
    [merged_hash] = handed_over
    assert merged_hash not in known and merged_hash not in ctx.merges.remembered_hashes()
    # the drop is one task on the loop: the engine forgets the merge, then the task takes its
    # names off the status page and metrics; done when the task has left housekeeping_tasks (the
    # catalog record alone goes first: waiting on it raced the names' removal in CI, 2026-12-04)
    while (ctx.housekeeping_tasks or merged_hash in lora.catalog.records) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ctx.merges.stats()["forgotten_pending"] == 0
    assert not manager.disk_cache.contains(merged_hash)
    assert merged_hash not in lora.stats()["adapters"] and merged_hash not in lora.catalog.records
    assert merged_hash not in ctx.adapter_display and merged_hash not in ctx.metrics.hash_labels
    assert ctx.adapters.stats()["in_use"] == {}
