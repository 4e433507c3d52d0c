"""Expert LoRA through the serving path, in process: the real engine with ``enable_expert_lora`` on a
tiny random Qwen3-MoE checkpoint, the real admin upload (validation against the MoE base) and
registry, the tenant's ``/v1/completions``. An adapter made by PEFT on transformers 5 with
gate/up/down targets (PEFT turns them into ``target_parameters`` on the fused experts, gate_up at
twice the rank) is stored and answers as PEFT does, beside base-model requests; a router adapter
is refused at upload in the API's error shape and not stored."""

from __future__ import annotations

import json

import pytest
import torch
from starlette.testclient import TestClient

from loraplex import LLM
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.server.app import create_app
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_moe import make_tiny_moe_dir
from tests.lora.test_acceptance import reference
from tests.server.registry_stack import registry_stack

ADMIN_KEY = "moe-expert-admin-key"
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe-expert-serving")
    model_dir = make_tiny_moe_dir(root / "tiny-qwen3-moe", "qwen3_moe", "per_expert", seed=9)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    experts = make_peft_adapter(base, root / "experts", seed=2, r=4,
                                target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    home = root / "home"
    llm = LLM(model=str(model_dir), dtype="float32", home=home, kv_cache_bytes=4 << 20, max_loras=2, max_lora_rank=8,
              enable_expert_lora=True)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    settings, registry, manager, key = registry_stack(home, llm, model_dir, ADMIN_KEY, enable_expert_lora=True)
    with TestClient(create_app(settings, engine=engine, registry=registry, adapters=manager)) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        yield client, {"Authorization": f"Bearer {key}"}, root, base, experts


def _upload(client, name, path):
    return client.post(f"/admin/v1/tenants/acme/adapters/{name}/versions",
                       files={n: (n, (path / n).read_bytes()) for n in FILES})


def test_expert_adapter_uploads_and_answers_as_peft(world):
    client, tenant, _, base, experts = world
    cfg = json.loads((experts / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == ["down_proj", "gate_up_proj"]
    r = _upload(client, "expert-tuned", experts)
    assert r.status_code == 201, r.text
    assert r.json()["targets"] == ["q_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj"]
    assert r.json()["rank"] == 8  # PEFT's rank_pattern doubles gate_up's rank
    peft_model = peft_model_for(base, {"experts": experts})
    prompts = [[5 + (11 * i + j) % 250 for j in range(9 + 5 * i)] for i in range(3)]
    changed = False
    for model, adapter in (("expert-tuned", "experts"), ("tiny-qwen3-moe", None)):
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0, "return_tokens_as_token_ids": True}
            served = client.post("/v1/completions", headers=tenant, json=body)
            assert served.status_code == 200, served.text
            tokens = [int(t.removeprefix("token_id:")) for t in served.json()["choices"][0]["logprobs"]["tokens"]]
            assert tokens == reference(peft_model, prompt, adapter, n=6)
            changed |= adapter is not None and tokens != reference(peft_model, prompt, None, n=6)
    assert changed


def test_router_adapter_is_refused_at_upload_and_not_stored(world):
    client, _, root, base, _ = world
    router = make_peft_adapter(base, root / "router", seed=3, r=2, target_modules=["q_proj"],
                               target_parameters=["mlp.gate.weight"])
    r = _upload(client, "router-tuned", router)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "model.layers.0.mlp.gate" in error["message"] and "router" in error["message"]
    assert "is not served" in error["message"]
    assert "router-tuned" not in str(client.get("/admin/v1/tenants/acme/adapters").json())
