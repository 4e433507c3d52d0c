"""SGLang's runtime LoRA endpoints (POST /load_lora_adapter, /unload_lora_adapter) with SGLang's
bodies and its ``LoRAUpdateOutput`` answer (sgl-project/sglang io_struct.py
LoadLoRAAdapterReqInput / UnloadLoRAAdapterReqInput / LoRAUpdateOutput, http_server.py: 200 on
success, 400 on failure), over the fake engine with the real AdapterManager; a loaded adapter is
then what /generate's lora_path names."""

from __future__ import annotations

import httpx
import pytest

from loraplex.storage.base import open_blob_store
from tests.fixtures.peft_adapters import make_peft_adapter, tiny_llama
from tests.registry.adapter_manager_helpers import build_adapters, make_manager
from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine, expected_text


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-root")
    spec, dirs = build_adapters(root)
    outside = make_peft_adapter(tiny_llama(seed=11), tmp_path_factory.mktemp("elsewhere") / "a", seed=1)

    def make(registry, home):
        return make_manager(registry, open_blob_store(str(home / "blobs")), home / "cache", spec)

    srv = start_server(tmp_path_factory.mktemp("sg-lora"), FakeEngine(), make,
                       allow_runtime_lora_updating=True, lora_path_roots=[root])
    yield srv, dirs, outside
    srv.stop()


def _fail(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["success"] is False and set(body) == {"success", "error_message", "loaded_adapters"}
    return body["error_message"]


def test_load_generate_unload(world):
    srv, dirs, outside = world
    with srv.tenant_client(srv.make_tenant("sgl")) as c:
        r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(dirs["a"]), "pinned": True})
        assert r.status_code == 200, r.text
        assert r.json() == {"success": True, "error_message": None, "loaded_adapters": {"a": "a@1"}}
        ref = srv.registry.resolve("sgl", "a")
        ids = srv.engine.tokenizer("ab")["input_ids"]
        out = c.post("/generate", json={"text": "ab", "lora_path": "a",
                                        "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
        assert out["text"] == expected_text(srv.engine.tokenizer, ids, ref.sha256, None, 3)
        # SGLang has no load in place: a loaded name is refused, and so is vLLM's load_inplace
        assert "already" in _fail(c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(dirs["b"])}))
        assert "load_inplace" in _fail(c.post("/load_lora_adapter", json={
            "lora_name": "a", "lora_path": str(dirs["b"]), "load_inplace": True}))
        assert srv.registry.resolve("sgl", "a").sha256 == ref.sha256  # unchanged
        _fail(c.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(outside)}), 403)
        _fail(c.post("/load_lora_adapter", json={"lora_name": "x"}))
        r = c.post("/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200 and r.json() == {"success": True, "error_message": None, "loaded_adapters": {}}
        assert "cannot be found" in _fail(c.post("/unload_lora_adapter", json={"lora_name": "a"}))
        gone = c.post("/generate", json={"text": "ab", "lora_path": "a"})
        assert gone.status_code == 400 and "a" in gone.json()["error"]["message"]
        # a body nested past json.loads' recursion (RecursionError) is SGLang's failure, not a 500
        for path in ("/load_lora_adapter", "/unload_lora_adapter"):
            raw = c.post(path, content=b"[" * 100_000, headers={"content-type": "application/json"})
            assert "JSON" in _fail(raw)
