"""Hot-swap and delete under load on the real engine (tiny Llama, CPU) behind the real admin API
and AdapterManager, in process: every response is exactly one version's output (the one pinned
with ``name@N`` gives the reference), never a mix; a request running on a deleted, pinned
adapter finishes on its weights, then its slot pin, KV blocks, blob and local copy are gone."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
import torch

from tests.fixtures.peft_adapters import make_peft_adapter
from tests.server.registry_stack import ADAPTER_FILES, real_server, stream_around, upload

ADMIN_KEY = "swap-admin-key"


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("swap")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    adapters = {  # different ranks and targets
        "v1": make_peft_adapter(base, root / "v1", seed=1, r=4, target_modules=["q_proj", "v_proj"]),
        "v2": make_peft_adapter(base, root / "v2", seed=2, r=8, target_modules=["k_proj", "o_proj", "down_proj"]),
        "other": make_peft_adapter(base, root / "other", seed=3, r=2),
    }
    home = root / "home"
    llm_options = dict(kv_cache_bytes=4 << 20, max_loras=2, max_lora_rank=8, max_num_seqs=16)
    with real_server(tiny_llama_dir, home, ADMIN_KEY, llm_options) as (client, stack):
        yield client, {"Authorization": f"Bearer {stack.tenant_key}"}, adapters, home, stack.manager


_upload = upload


def _stream(client, headers, body) -> str:
    text = ""
    with client.stream("POST", "/v1/completions", headers=headers, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(c["text"] for c in chunk["choices"])
    return text


def _engine(client) -> dict:
    return client.get("/admin/v1/status").json()["engine"]


def test_swaps_under_load_never_mix_versions(world):
    client, tenant, adapters, _, manager = world
    _upload(client, "m", adapters["v1"])
    _upload(client, "m", adapters["v2"])
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    prompts = [f"prompt {i}" for i in range(4)]
    ref = {(v, p): client.post("/v1/completions", headers=tenant, json={"model": f"m@{v}", "prompt": p, **params})
           .json()["choices"][0]["text"] for v in (1, 2) for p in prompts}
    assert all(ref[(1, p)] != ref[(2, p)] for p in prompts)

    results, errors = [], []

    def worker(i):
        try:
            for k in range(3):
                p = prompts[(i + k) % len(prompts)]
                results.append((p, _stream(client, tenant, {"model": "m", "prompt": p, **params})))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    version = 1
    while any(t.is_alive() for t in threads):
        version = 3 - version
        assert client.put("/admin/v1/tenants/acme/adapters/m/active", json={"version": version}).status_code == 200
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert not errors and len(results) == 12
    served = Counter(next((v for v in (1, 2) if text == ref[(v, p)]), "mixed") for p, text in results)
    assert "mixed" not in served, served
    # after the last swap, new requests get the active version
    after = client.post("/v1/completions", headers=tenant, json={"model": "m", "prompt": prompts[0], **params})
    assert after.json()["choices"][0]["text"] == ref[(version, prompts[0])]
    stats = _engine(client)
    assert stats["num_blocks_free"] == stats["num_blocks_total"] and manager.stats()["in_use"] == {}


def test_delete_of_a_pinned_adapter_mid_stream(world):
    client, tenant, adapters, home, manager = world
    sha = _upload(client, "gone", adapters["other"])["sha256"]
    body = {"model": "gone", "prompt": "bye", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    want = client.post("/v1/completions", headers=tenant, json={**body, "model": "gone@1"}).json()["choices"][0]["text"]
    assert client.post("/admin/v1/tenants/acme/adapters/gone/load", json={"tier": "device", "pin": True}).status_code == 200

    def delete_and_ask():
        return (client.delete("/admin/v1/tenants/acme/adapters/gone"),
                client.post("/v1/completions", headers=tenant, json=body))

    text, (deleted, refused) = stream_around(client, tenant, body, delete_and_ask)
    assert deleted.status_code == 200
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    assert text == want  # the running request finished on its weights

    deadline = time.monotonic() + 5
    while manager.stats()["in_use"] or (home / "blobs" / "sha256" / sha).exists():
        assert time.monotonic() < deadline, manager.stats()
        time.sleep(0.02)
    assert not (home / "adapter-cache" / "entries" / sha).exists()
    time.sleep(0.1)  # engine stats refresh
    stats = _engine(client)
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["lora"]["slots"]["pinned"] == 0 and not stats["lora"]["adapters"].get(sha, {}).get("pinned")


def test_an_adapter_named_as_the_base_model_is_refused(world):
    """``model`` naming the served base model reaches the base model, so an upload under that
    name is a 400 ``invalid_name`` and registers nothing (it was a 201 whose adapter only
    ``name@1`` could reach, beside a second ``/v1/models`` entry of the same id)."""
    client, headers, adapters, _, _ = world
    base = client.get("/v1/models", headers=headers).json()["data"][0]["id"]
    r = client.post(f"/admin/v1/tenants/acme/adapters/{base}/versions",
                    files={n: (n, (adapters["other"] / n).read_bytes()) for n in ADAPTER_FILES})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_name" and "served base model's name" in error["message"], error
    assert base not in [a["name"] for a in client.get("/admin/v1/tenants/acme/adapters").json()["data"]]
    ids = [m["id"] for m in client.get("/v1/models", headers=headers).json()["data"]]
    assert ids.count(base) == 1
