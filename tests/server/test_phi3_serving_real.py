"""Phi-3 through the serving path, in process: the real engine (a tiny Phi-4-mini-like model:
LongRoPE over a partial rotary, tied head), the real admin upload (validation against the Phi-3
base) and registry, the tenant's ``/v1/completions``. An adapter on the fused modules answers
with PEFT's own greedy tokens; one made for a Llama's q/v modules is refused at upload, naming
the module."""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from loraplex import LLM
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.server.app import create_app
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for, tiny_llama
from tests.fixtures.tiny_phi3 import longrope_scaling, make_tiny_phi3_dir
from tests.lora.test_acceptance import reference
from tests.server.registry_stack import registry_stack

ADMIN_KEY = "phi3-admin-key"
FILES = ("adapter_config.json", "adapter_model.safetensors")
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("phi3-serving")
    model_dir = make_tiny_phi3_dir(
        root / "phi4-mini-like", seed=9, rope_scaling=longrope_scaling(6), original_max_position_embeddings=256,
        partial_rotary_factor=0.75, tie_word_embeddings=True,
    )
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    adapters = {
        "fused": make_peft_adapter(base, root / "fused", seed=1, r=8, target_modules=FUSED),
        "llama": make_peft_adapter(tiny_llama(seed=2), root / "llama", seed=2, r=4,
                                   target_modules=["q_proj", "v_proj"]),
    }
    home = root / "home"
    llm = LLM(model=str(model_dir), dtype="float32", home=home, kv_cache_bytes=4 << 20, max_loras=2, max_lora_rank=8)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    settings, registry, manager, key = registry_stack(home, llm, model_dir, ADMIN_KEY)
    peft_model = peft_model_for(base, {"fused": adapters["fused"]})
    with TestClient(create_app(settings, engine=engine, registry=registry, adapters=manager)) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        yield client, {"Authorization": f"Bearer {key}"}, adapters, peft_model


def _upload(client, name, path):
    return client.post(f"/admin/v1/tenants/acme/adapters/{name}/versions",
                       files={n: (n, (path / n).read_bytes()) for n in FILES})


def test_fused_adapter_uploads_and_answers_as_peft(world):
    client, tenant, adapters, peft_model = world
    r = _upload(client, "phi-tuned", adapters["fused"])
    assert r.status_code == 201, r.text
    assert r.json()["targets"] == FUSED and r.json()["rank"] == 8
    prompts = [[5 + (11 * i + j) % 250 for j in range(9 + 5 * i)] for i in range(3)]
    answers = {}
    for model, adapter in (("phi-tuned", "fused"), ("phi4-mini-like", None)):
        for i, prompt in enumerate(prompts):
            body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0, "return_tokens_as_token_ids": True}
            served = client.post("/v1/completions", headers=tenant, json=body)
            assert served.status_code == 200, served.text
            tokens = served.json()["choices"][0]["logprobs"]["tokens"]  # "token_id:<id>" (vLLM's form)
            answers[model, i] = [int(t.removeprefix("token_id:")) for t in tokens]
            assert answers[model, i] == reference(peft_model, prompt, adapter, n=6)
    assert any(answers["phi-tuned", i] != answers["phi4-mini-like", i] for i in range(len(prompts)))


def test_llama_adapter_is_refused_at_upload(world):
    client, _, adapters, _ = world
    r = _upload(client, "wrong-base", adapters["llama"])
    assert r.status_code == 400, r.text
    assert "targets 'q_proj', which base model" in r.json()["error"]["message"]
    listed = client.get("/admin/v1/tenants/acme/adapters").json()
    assert "wrong-base" not in str(listed)

