"""Deleted adapters leave the engine's stats (real engine, tiny Llama on CPU, in process): after
vLLM's ``/v1/unload_lora_adapter`` and the admin delete, the adapter's record is gone from
``/admin/v1/status`` (``engine.lora.adapters`` and ``adapter_names``) once no request holds it,
kept while a stream still runs on it, and loading the same files again serves them as before;
weights another adapter still uses stay, without the deleted one's name."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.fixtures.peft_adapters import make_peft_adapter
from tests.server.registry_stack import real_server, upload

ADMIN_KEY = "forget-admin-key"
BODY = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("forget")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    adapters = {name: make_peft_adapter(base, root / "allowed" / name, seed=seed, r=4)
                for seed, name in enumerate(("runtime", "admin", "held", "shared"), start=1)}
    llm_options = dict(kv_cache_bytes=4 << 20, max_loras=2, max_lora_rank=8, max_num_seqs=8)
    with real_server(tiny_llama_dir, root / "home", ADMIN_KEY, llm_options, allow_runtime_lora_updating=True,
                     lora_path_roots=[root / "allowed"]) as (client, stack):
        yield client, {"Authorization": f"Bearer {stack.tenant_key}"}, adapters


def _status(client) -> dict:
    time.sleep(0.1)  # the engine's stats are refreshed between steps
    return client.get("/admin/v1/status").json()


def _complete(client, tenant, model) -> str:
    r = client.post("/v1/completions", headers=tenant, json={**BODY, "model": model})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _upload(client, name, path) -> str:
    return upload(client, name, path)["sha256"]


def _load_runtime(client, tenant, name, path) -> None:
    r = client.post("/v1/load_lora_adapter", headers=tenant, json={"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text


def _listed(status: dict, sha: str) -> bool:
    return sha in status["engine"]["lora"]["adapters"] or sha in status["adapter_names"]


def test_runtime_unload_drops_the_record_and_a_reload_serves_again(world):
    client, tenant, adapters = world
    _load_runtime(client, tenant, "rt", adapters["runtime"])
    want = _complete(client, tenant, "rt")
    sha = client.get("/admin/v1/tenants/acme/adapters/rt").json()["versions"][0]["sha256"]
    status = _status(client)
    assert _listed(status, sha) and status["engine"]["lora"]["adapters"][sha]["requests"] == 1
    loads = status["loads"]
    assert loads >= 1
    r = client.post("/v1/unload_lora_adapter", headers=tenant, json={"lora_name": "rt"})
    assert r.status_code == 200, r.text
    status = _status(client)
    assert not _listed(status, sha)
    assert status["loads"] == loads  # the totals keep the dropped record's counters
    _load_runtime(client, tenant, "rt", adapters["runtime"])  # the same files again
    assert _complete(client, tenant, "rt") == want
    status = _status(client)
    assert _listed(status, sha) and status["engine"]["lora"]["adapters"][sha]["requests"] == 1  # counted afresh


def test_admin_delete_drops_the_record_and_an_upload_serves_again(world):
    client, tenant, adapters = world
    sha = _upload(client, "ad", adapters["admin"])
    want = _complete(client, tenant, "ad")
    assert _listed(_status(client), sha)
    assert client.delete("/admin/v1/tenants/acme/adapters/ad").status_code == 200
    assert not _listed(_status(client), sha)
    assert _upload(client, "ad", adapters["admin"]) == sha
    assert _complete(client, tenant, "ad") == want
    assert _listed(_status(client), sha)


def test_a_running_stream_keeps_the_record_until_it_ends(world):
    client, tenant, adapters = world
    sha = _upload(client, "hd", adapters["held"])
    # long enough to outlast the delete and the status read below (the tiny model's context)
    body = {**BODY, "model": "hd", "max_tokens": 1000, "stream": True}
    with client.stream("POST", "/v1/completions", headers=tenant, json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        assert client.delete("/admin/v1/tenants/acme/adapters/hd").status_code == 200
        status = _status(client)
        running = status["engine"]["num_requests_running"]
        tail = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert running == 1 and sha in status["engine"]["lora"]["adapters"]  # the stream still ran on it
    assert tail[-1]["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 5
    while sha in _status(client)["engine"]["lora"]["adapters"]:
        assert time.monotonic() < deadline, "the record outlived the last request"


def test_weights_another_adapter_uses_stay_without_the_deleted_name(world):
    client, tenant, adapters = world
    sha = _upload(client, "sh-one", adapters["shared"])
    assert _upload(client, "sh-two", adapters["shared"]) == sha  # the same weights under two names
    want = _complete(client, tenant, "sh-two")
    assert _status(client)["adapter_names"][sha] == "acme/sh-two@1"  # the last name a request used
    assert client.delete("/admin/v1/tenants/acme/adapters/sh-two").status_code == 200
    status = _status(client)
    assert sha in status["engine"]["lora"]["adapters"] and sha not in status["adapter_names"]
    assert _complete(client, tenant, "sh-one") == want
    assert _status(client)["adapter_names"][sha] == "acme/sh-one@1"
    # a delete of a name the status page does not show leaves the page's name alone
    assert _upload(client, "sh-three", adapters["shared"]) == sha
    assert client.delete("/admin/v1/tenants/acme/adapters/sh-three").status_code == 200
    assert _status(client)["adapter_names"][sha] == "acme/sh-one@1"
