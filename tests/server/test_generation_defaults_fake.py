"""The model's generation config as the defaults of the OpenAI routes (vLLM's --generation-config),
checked on the SamplingParams the engine receives: a field left out or null takes the file's
value (as transformers reads the file), a field sent wins, an adapter gets the same defaults as
the base model, an open max_tokens takes max_new_tokens under what the context leaves, and
LoRAX's /generate keeps its own (greedy) defaults."""

from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig

from loraplex.generation_defaults import resolve
from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine

FILE = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05,
            max_new_tokens=20, eos_token_id=2)
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    (folder / "generation_config.json").write_text(json.dumps(FILE))
    return folder


@pytest.fixture(scope="module")
def expected(model_dir) -> dict:
    """SamplingParams fields as transformers reads the file."""
    hf = GenerationConfig.from_pretrained(model_dir)
    return {"temperature": hf.temperature, "top_p": hf.top_p, "top_k": hf.top_k, "min_p": hf.min_p,
            "repetition_penalty": hf.repetition_penalty, "max_tokens": hf.max_new_tokens}


def serve(tmp_path_factory, model_dir, mode="auto", override=None):
    engine = FakeEngine()  # max_model_len 128
    engine.sampling_defaults = resolve(mode, model_dir, override)
    srv = start_server(tmp_path_factory.mktemp("srv"), engine)
    key = srv.make_tenant("acme")
    srv.upload("acme", "sql")
    return srv, srv.tenant_client(key)


@pytest.fixture(scope="module")
def world(tmp_path_factory, model_dir):
    srv, client = serve(tmp_path_factory, model_dir)
    yield srv, client
    client.close()
    srv.stop()


def params_of(srv, client, path: str, body: dict):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    request_id = srv.engine.started[-1][0]
    return srv.engine.params_seen[request_id], len(srv.engine.prompts_seen[request_id])


def fields(params) -> dict:
    return {k: getattr(params, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                            "max_tokens")}


BODIES = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES}),
    "completions": ("/v1/completions", {"prompt": "hello there", "max_tokens": None}),
    "responses": ("/v1/responses", {"input": "hello there"}),
}


@pytest.mark.parametrize("route", list(BODIES))
@pytest.mark.parametrize("model", ["fake-model", "sql"])
def test_unset_fields_take_the_files_values(world, expected, route, model):
    srv, client = world
    path, body = BODIES[route]
    params, _ = params_of(srv, client, path, {"model": model, **body})
    assert fields(params) == expected


@pytest.mark.parametrize("route", list(BODIES))
def test_null_is_unset_as_in_vllm(world, expected, route):
    srv, client = world
    path, body = BODIES[route]
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    params, _ = params_of(srv, client, path, {"model": "fake-model", **body, **nulls})
    assert fields(params) == expected


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_field_sent_wins(world, expected, route):
    srv, client = world
    path, body = BODIES[route]
    sent = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 3}
    params, _ = params_of(srv, client, path, {"model": "fake-model", **body, **sent})
    assert fields(params) == {**sent, "top_k": 0}  # -1 and 0 both mean no top-k
    params, _ = params_of(srv, client, path, {"model": "fake-model", **body, "temperature": 1.2})
    assert fields(params) == {**expected, "temperature": 1.2}


def test_completions_without_max_tokens_keep_openais_16(world):
    srv, client = world
    params, _ = params_of(srv, client, "/v1/completions", {"model": "fake-model", "prompt": "hello there"})
    assert params.max_tokens == 16  # vLLM's CompletionRequest: max_tokens defaults to 16, null is open


def test_the_default_max_tokens_is_capped_by_the_context(tmp_path_factory, tmp_path):
    folder = tmp_path / "long"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 1000}))
    srv, client = serve(tmp_path_factory, folder)
    try:
        params, prompt_len = params_of(srv, client, "/v1/chat/completions", {"model": "fake-model", "messages": MESSAGES})
        assert params.max_tokens == srv.engine.max_model_len - prompt_len < 1000
        r = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": MESSAGES, "max_tokens": 1000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # a sent one is not
    finally:
        client.close()
        srv.stop()


def test_vllm_mode_ignores_the_file(tmp_path_factory, model_dir):
    srv, client = serve(tmp_path_factory, model_dir, mode="vllm")
    try:
        params, prompt_len = params_of(srv, client, "/v1/chat/completions", {"model": "sql", "messages": MESSAGES})
        assert fields(params) == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                  "repetition_penalty": 1.0, "max_tokens": srv.engine.max_model_len - prompt_len}
    finally:
        client.close()
        srv.stop()


def test_the_override_wins_and_its_max_new_tokens_is_a_ceiling(tmp_path_factory, model_dir, expected):
    srv, client = serve(tmp_path_factory, model_dir, override='{"temperature": 0.5, "max_new_tokens": 6}')
    try:
        params, _ = params_of(srv, client, "/v1/chat/completions", {"model": "fake-model", "messages": MESSAGES})
        assert fields(params) == {**expected, "temperature": 0.5, "max_tokens": 6}
        params, _ = params_of(srv, client, "/v1/chat/completions",
                              {"model": "fake-model", "messages": MESSAGES, "max_tokens": 50})
        assert params.max_tokens == 6  # vLLM's override_max_tokens caps a sent max_tokens too
        params, _ = params_of(srv, client, "/v1/completions", {"model": "fake-model", "prompt": "hi"})
        assert params.max_tokens == 6
    finally:
        client.close()
        srv.stop()


def test_lorax_generate_keeps_its_greedy_default(world):
    # TGI / LoRAX read no sampling defaults from the generation config: unset means greedy there
    srv, client = world
    params, prompt_len = params_of(srv, client, "/generate", {"inputs": "hello there"})
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (0.0, 0, 1.0, 1.0)
    assert params.max_tokens == srv.engine.max_model_len - prompt_len


def test_the_operators_ceiling_holds_on_lorax_generate_too(tmp_path_factory, model_dir):
    """vLLM: an operator's max_new_tokens "sets a server-wide limit on the number of output tokens
    for all requests"; LoRAX's route keeps its greedy sampling, not a way around the limit."""
    srv, client = serve(tmp_path_factory, model_dir, override='{"max_new_tokens": 6}')
    try:
        for path in ("/generate", "/generate_stream"):
            for sent in ({}, {"max_new_tokens": 50}):
                params, _ = params_of(srv, client, path, {"inputs": "hello there", "parameters": sent})
                assert params.max_tokens == 6, (path, sent)
                assert params.temperature == 0.0  # still LoRAX's greedy default
        params, _ = params_of(srv, client, "/generate", {"inputs": "hello there", "parameters": {"max_new_tokens": 3}})
        assert params.max_tokens == 3  # under the ceiling: as sent
    finally:
        client.close()
        srv.stop()

def test_the_defaults_are_in_the_admin_status(world, expected):
    srv, _ = world
    with srv.admin() as c:
        status = c.get("/admin/v1/status").json()
    taken = status["sampling_defaults"]
    assert {k: taken[k] for k in expected} == expected and taken["max_tokens_cap"] is None
