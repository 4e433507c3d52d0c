"""Each request's prefix-cache hits on every API, on the real engine (tiny Llama, CPU, a PEFT
adapter behind the real AdapterManager), with ``--enable-prompt-tokens-details`` on: OpenAI's
``usage.prompt_tokens_details.cached_tokens`` (completions and chat, whole and streamed with
``include_usage``), SGLang's ``meta_info.cached_tokens`` and the Responses API's
``usage.input_tokens_details.cached_tokens``.

The expected numbers come from the block size and the prompts, not from the engine: a prompt of
``L`` tokens whose first ``s`` tokens an earlier request of the same tenant and adapter left
cached reports ``min(s // 16, (L - 1) // 16) * 16`` (whole blocks; the last prompt token is
always computed). ``L`` is the answer's own prompt token count where a template makes the prompt."""

from __future__ import annotations

import json

import pytest
import torch
from starlette.testclient import TestClient

from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.server.app import create_app
from tests.engine.test_engine_exact import tight_llm
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.server.registry_stack import registry_stack

ADMIN_KEY = "cached-tokens-admin-key"
FILES = ("adapter_config.json", "adapter_model.safetensors")
BLOCK = 16  # tight_llm's block size


def expected_hits(length: int, shared: int) -> int:
    return min(shared // BLOCK, (length - 1) // BLOCK) * BLOCK


def random_ids(seed: int, n: int) -> list[int]:
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("cached")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    adapter = make_peft_adapter(base, root / "sql", seed=5, r=4, target_modules=["q_proj", "v_proj"])
    home = root / "home"
    llm = tight_llm(tiny_llama_dir, home, num_blocks=256, enable_prefix_caching=True, max_num_batched_tokens=512,
                    max_loras=2, max_lora_rank=8)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    stack = registry_stack(home, llm, tiny_llama_dir, ADMIN_KEY, enable_prompt_tokens_details=True)
    try:
        with TestClient(create_app(stack.settings, engine=engine, registry=stack.registry, adapters=stack.manager)) as c:
            r = c.post("/admin/v1/tenants/acme/adapters/sql/versions", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                       files={n: (n, (adapter / n).read_bytes()) for n in FILES})
            assert r.status_code == 201, r.text
            c.headers["Authorization"] = f"Bearer {stack.tenant_key}"
            yield c
    finally:
        engine.shutdown()


def _post(client, path: str, body: dict):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r


def _events(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _completion(client, prompt, **extra) -> dict:
    body = {"model": client.app.state.ctx.served_model_name, "prompt": prompt, "max_tokens": 3, "temperature": 0,
            **extra}
    return _post(client, "/v1/completions", body).json()


def test_completions_report_whole_cached_blocks(client):
    a = random_ids(1, 70)
    cold = _completion(client, a)
    assert cold["usage"] == {"prompt_tokens": 70, "completion_tokens": 3, "total_tokens": 73,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    b = a[:50] + random_ids(2, 20)
    assert _completion(client, b)["usage"]["prompt_tokens_details"] == {"cached_tokens": expected_hits(70, 50)}
    # several prompts: their counts add up, as their prompt tokens do
    both = _completion(client, [a, random_ids(3, 40)])
    assert both["usage"]["prompt_tokens"] == 110
    assert both["usage"]["prompt_tokens_details"] == {"cached_tokens": expected_hits(70, 70)}
    # n > 1: the prompt counts once (its siblings' shared blocks are the request's own)
    fresh = random_ids(4, 45)
    sampled = _completion(client, fresh, n=3, temperature=1.0, seed=2)
    assert sampled["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_a_streamed_completion_carries_them_on_its_usage_chunk(client):
    a = random_ids(5, 60)
    _completion(client, a)
    r = _post(client, "/v1/completions", {"model": client.app.state.ctx.served_model_name, "prompt": a,
                                          "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
    chunks = _events(r)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 60, "completion_tokens": 3, "total_tokens": 63,
        "prompt_tokens_details": {"cached_tokens": expected_hits(60, 60)}}


def test_another_adapter_finds_none_of_the_base_s_blocks(client):
    a = random_ids(6, 70)
    _completion(client, a)
    on_adapter = {"model": "sql", "prompt": a, "max_tokens": 3, "temperature": 0}
    assert _post(client, "/v1/completions", on_adapter).json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = _post(client, "/v1/completions", on_adapter).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": expected_hits(70, 70)}


def test_chat_whole_and_streamed(client):
    body = {"model": client.app.state.ctx.served_model_name, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": " ".join(f"chat{i}" for i in range(40))}]}
    cold = _post(client, "/v1/chat/completions", body).json()["usage"]
    assert cold["prompt_tokens_details"] == {"cached_tokens": 0}
    n = cold["prompt_tokens"]
    assert n > 2 * BLOCK
    warm = _post(client, "/v1/chat/completions", body).json()["usage"]
    assert warm["prompt_tokens_details"] == {"cached_tokens": expected_hits(n, n)}
    chunks = _events(_post(client, "/v1/chat/completions", {**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}))
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": expected_hits(n, n)}


def test_sglang_meta_info(client):
    a = random_ids(7, 66)
    params = {"max_new_tokens": 3, "temperature": 0}
    cold = _post(client, "/generate", {"input_ids": a, "sampling_params": params}).json()
    assert (cold["meta_info"]["prompt_tokens"], cold["meta_info"]["cached_tokens"]) == (66, 0)
    b = a[:40] + random_ids(8, 10)
    warm = _post(client, "/generate", {"input_ids": b, "sampling_params": params}).json()
    assert warm["meta_info"]["cached_tokens"] == expected_hits(50, 40)
    # streamed: every object carries it, as SGLang's do (known once the prompt is admitted)
    events = _events(_post(client, "/generate", {"input_ids": a, "sampling_params": params, "stream": True}))
    assert events and all(e["meta_info"]["cached_tokens"] == expected_hits(66, 66) for e in events)
    # a batch: each prompt its own
    batch = _post(client, "/generate", {"input_ids": [a, random_ids(9, 30)], "sampling_params": params}).json()
    assert [o["meta_info"]["cached_tokens"] for o in batch] == [expected_hits(66, 66), 0]


def test_responses_usage(client):
    body = {"model": client.app.state.ctx.served_model_name, "max_output_tokens": 3, "temperature": 0,
            "input": " ".join(f"resp{i}" for i in range(40))}
    cold = _post(client, "/v1/responses", body).json()["usage"]
    assert cold["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    n = cold["input_tokens"]
    warm = _post(client, "/v1/responses", body).json()["usage"]
    assert warm["input_tokens_details"]["cached_tokens"] == expected_hits(n, n) > 0
    events = _events(_post(client, "/v1/responses", {**body, "stream": True}))
    (done,) = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
    assert done["response"]["usage"]["input_tokens_details"]["cached_tokens"] == expected_hits(n, n)
