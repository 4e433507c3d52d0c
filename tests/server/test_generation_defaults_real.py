"""On a real (tiny) engine whose model ships Qwen-style sampling defaults: a seeded request that
leaves the sampling fields out gets the same tokens as the same request sending the file's
values (as transformers reads them), through chat, completions (max_tokens null) and Responses;
sending the library's values instead gives other tokens."""

from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig

from loraplex.engine.async_engine import AsyncLLMEngine
from tests.engine.test_engine_exact import tight_llm
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.server.conftest import start_server

FILE = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_new_tokens=8,
            bos_token_id=0, eos_token_id=1, pad_token_id=2)
LIBRARY = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen-like"), "qwen2")
    (folder / "generation_config.json").write_text(json.dumps(FILE))
    hf = GenerationConfig.from_pretrained(folder)
    sent = {"temperature": hf.temperature, "top_p": hf.top_p, "top_k": hf.top_k,
            "repetition_penalty": hf.repetition_penalty}
    llm = tight_llm(folder, tmp_path_factory.mktemp("home"), num_blocks=64, max_num_batched_tokens=256)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    srv = start_server(tmp_path_factory.mktemp("srv"), engine)
    client = srv.tenant_client(srv.make_tenant("acme"))
    yield client, srv.app.state.ctx.served_model_name, sent, hf.max_new_tokens
    client.close()
    srv.stop()
    engine.shutdown()


def ask(client, path: str, body: dict) -> tuple[str, int]:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    if path.endswith("/responses"):
        return out["output"][-1]["content"][0]["text"], out["usage"]["output_tokens"]
    choice = out["choices"][0]
    return choice.get("text", (choice.get("message") or {}).get("content")), out["usage"]["completion_tokens"]


@pytest.mark.parametrize("path, body, max_name", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me a story"}]}, "max_tokens"),
    ("/v1/completions", {"prompt": "once upon a time", "max_tokens": None}, "max_tokens"),
    ("/v1/responses", {"input": "tell me a story"}, "max_output_tokens"),
])
def test_a_seeded_request_without_sampling_fields_samples_as_the_files_values(world, path, body, max_name):
    client, model, sent, max_new_tokens = world
    base = {"model": model, "seed": 7, **body}
    implicit = ask(client, path, base)
    explicit = ask(client, path, {**base, **sent, max_name: max_new_tokens})
    library = ask(client, path, {**base, **LIBRARY, max_name: max_new_tokens})
    assert implicit == explicit
    assert implicit[0] != library[0]
