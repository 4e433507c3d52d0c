"""Deletes made through another replica leave this replica's engine (real engine, tiny Llama on
CPU, in process): weights pinned here whose versions another replica deleted (a direct registry
write, as that replica's admin API makes) leave the device slots, pin included, within a few
``registry_poll_seconds``; weights another live version still uses stay pinned; and a request
streaming on deleted weights finishes on them, as on the replica that took the delete. A local
copy of deleted weights that the engine does not hold goes too (before, it waited for the disk
cache's LRU)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.fixtures.peft_adapters import make_peft_adapter
from tests.server.registry_stack import real_server, stream_around, upload

ADMIN_KEY = "replica-admin-key"
POLL = 0.2


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("replica-deletes")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    adapters = {name: make_peft_adapter(base, root / name, seed=seed, r=4)
                for seed, name in enumerate(("gone", "kept", "held", "cold"), start=1)}
    llm_options = dict(kv_cache_bytes=4 << 20, max_loras=4, max_lora_rank=8, max_num_seqs=8)
    with real_server(tiny_llama_dir, root / "home", ADMIN_KEY, llm_options, registry_poll_seconds=POLL) as (client, stack):
        yield client, {"Authorization": f"Bearer {stack.tenant_key}"}, adapters, stack.registry, stack.manager


def _upload(client, name, path) -> str:
    return upload(client, name, path)["sha256"]


def _pin(client, name) -> None:
    r = client.post(f"/admin/v1/tenants/acme/adapters/{name}/load", json={"tier": "device", "pin": True})
    assert r.status_code == 200, r.text


def _engine_adapters(client) -> dict:
    return client.get("/admin/v1/status").json()["engine"]["lora"]["adapters"]


def _wait_until(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(POLL / 2)


def test_weights_deleted_through_another_replica_leave_this_engine_pins_included(world):
    client, _, adapters, registry, manager = world
    gone = _upload(client, "gone", adapters["gone"])
    kept = _upload(client, "kept", adapters["kept"])
    assert _upload(client, "kept-too", adapters["kept"]) == kept  # the same weights under a second name
    for name in ("gone", "kept"):
        _pin(client, name)
    held = _engine_adapters(client)
    assert held[gone]["pinned"] and held[kept]["pinned"]
    # the other replica's deletes: the registry rows only, nothing through this server
    registry.delete_adapter("acme", "gone")
    registry.delete_adapter("acme", "kept")
    _wait_until(lambda: gone not in _engine_adapters(client))
    assert not manager.disk_cache.contains(gone) and manager.disk_cache.contains(kept)  # its local copy too
    time.sleep(3 * POLL)  # a few more polls: the weights kept-too still uses stay
    after = _engine_adapters(client)
    assert after[kept]["pinned"] and after[kept]["tier"] == "device"
    assert client.get("/admin/v1/status").json()["engine"]["lora"]["slots"]["pinned"] == 1


def test_a_stream_on_weights_deleted_elsewhere_finishes_on_them(world):
    client, tenant, adapters, registry, _ = world
    sha = _upload(client, "held", adapters["held"])
    body = {"model": "held", "prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = client.post("/v1/completions", headers=tenant, json=body).json()["choices"][0]["text"]
    _pin(client, "held")
    text, _ = stream_around(client, tenant, body, lambda: registry.delete_adapter("acme", "held"))
    assert text == want
    _wait_until(lambda: sha not in _engine_adapters(client))


def test_a_local_copy_the_engine_does_not_hold_goes_too(world):
    client, _, adapters, registry, manager = world
    sha = _upload(client, "cold", adapters["cold"])
    version = registry.resolve("acme", "cold")
    manager.local_path(version)  # on disk, as after a request some time ago; not in the engine
    assert manager.disk_cache.contains(sha) and sha not in _engine_adapters(client)
    registry.delete_adapter("acme", "cold")  # the other replica's delete
    _wait_until(lambda: not manager.disk_cache.contains(sha))
    assert not manager.disk_cache.path_of(sha).exists()
