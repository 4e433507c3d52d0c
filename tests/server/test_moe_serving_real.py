"""A mixture-of-experts model through the serving path, in process: the real engine on a tiny random
Qwen3-MoE checkpoint directory (per-expert layout, a dense ``mlp_only_layers`` layer), the real
admin upload (validation against the MoE base) and registry, the tenant's ``/v1/completions`` and
``/v1/chat/completions``. Greedy tokens with and without an attention adapter equal PEFT's own on
transformers' model; an adapter on the experts is refused at upload (this engine runs without
``enable_expert_lora``) in the API's error shape, naming the module and the option, and is not
stored (test_moe_expert_lora_serving_real.py serves one)."""

from __future__ import annotations

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

ADMIN_KEY = "moe-admin-key"
FILES = ("adapter_config.json", "adapter_model.safetensors")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("moe-serving")
    model_dir = make_tiny_moe_dir(root / "tiny-qwen3-moe", "qwen3_moe", "per_expert", seed=9)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    adapters = {
        "attn": make_peft_adapter(base, root / "attn", seed=1, r=8, target_modules=ATTENTION),
        # PEFT on transformers 5 turns gate/up/down targets into target_parameters on the experts
        "experts": make_peft_adapter(base, root / "experts", seed=2, r=4,
                                     target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
    }
    home = root / "home"
    llm = LLM(model=str(model_dir), dtype="float32", home=home, kv_cache_bytes=4 << 20, max_loras=2, max_lora_rank=8)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    settings, registry, manager, key = registry_stack(home, llm, model_dir, ADMIN_KEY)
    peft_model = peft_model_for(base, {"attn": adapters["attn"]})
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with TestClient(create_app(settings, engine=engine, registry=registry, adapters=manager)) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        yield client, {"Authorization": f"Bearer {key}"}, adapters, peft_model, tokenizer


def _upload(client, name, path):
    return client.post(f"/admin/v1/tenants/acme/adapters/{name}/versions",
                       files={n: (n, (path / n).read_bytes()) for n in FILES})


def _token_ids(entries) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in entries]  # "token_id:<id>" (vLLM's form)


def test_completions_and_chat_with_and_without_an_adapter_answer_as_peft(world):
    client, tenant, adapters, peft_model, tokenizer = world
    r = _upload(client, "moe-tuned", adapters["attn"])
    assert r.status_code == 201, r.text
    assert r.json()["targets"] == ATTENTION and r.json()["rank"] == 8
    prompts = [[5 + (11 * i + j) % 250 for j in range(9 + 5 * i)] for i in range(3)]
    answers = {}
    for model, adapter in (("moe-tuned", "attn"), ("tiny-qwen3-moe", None)):
        for i, prompt in enumerate(prompts):
            body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0, "return_tokens_as_token_ids": True}
            served = client.post("/v1/completions", headers=tenant, json=body)
            assert served.status_code == 200, served.text
            answers[model, i] = _token_ids(served.json()["choices"][0]["logprobs"]["tokens"])
            assert answers[model, i] == reference(peft_model, prompt, adapter, n=6)
        messages = [{"role": "user", "content": "Which expert answers?"}]
        body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "logprobs": True, "return_tokens_as_token_ids": True}
        served = client.post("/v1/chat/completions", headers=tenant, json=body)
        assert served.status_code == 200, served.text
        chat_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
        content = served.json()["choices"][0]["logprobs"]["content"]
        assert _token_ids(c["token"] for c in content) == reference(peft_model, list(chat_prompt), adapter, n=6)
    assert any(answers["moe-tuned", i] != answers["tiny-qwen3-moe", i] for i in range(len(prompts)))


def test_expert_adapter_is_refused_at_upload_and_not_stored(world):
    client, _, adapters, _, _ = world
    r = _upload(client, "expert-tuned", adapters["experts"])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "gate_up_proj" in error["message"] and "--enable-expert-lora" in error["message"]
    assert "experts" in error["message"]
    listed = client.get("/admin/v1/tenants/acme/adapters").json()
    assert "expert-tuned" not in str(listed)
