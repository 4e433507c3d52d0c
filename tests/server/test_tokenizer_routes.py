"""vLLM's POST /tokenize and /detokenize, and LoRAX's GET /info and POST /tokenize, over the fake
engine carrying the tests' real byte-level tokenizer (tests/fixtures/tiny_models.py), given a
BOS post-processor so that ``add_special_tokens`` makes a difference. References: the tokenizer
called directly (``__call__``, ``decode``, ``apply_chat_template``, ``convert_ids_to_tokens``),
the settings the server was started with, and offsets worked out by hand from UTF-8."""

from __future__ import annotations


import httpx
import pytest
from tokenizers import processors

import loraplex
from tests.fixtures.tiny_models import BOS_ID, CHAT_TEMPLATE, VOCAB_SIZE, make_tiny_tokenizer
from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine

TEXT = "héllo, wörld ✓"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ✓"}]
MAX_MODEL_LEN = 96
MAX_PROMPT_TOKENS = 50
MAX_PER_TENANT = 7


def _tokenizer():
    tok = make_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE + "{% if note is defined %}({{ note }}){% endif %}"  # for chat_template_kwargs
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return tok


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    engine.tokenizer = _tokenizer()
    srv = start_server(tmp_path_factory.mktemp("tok"), engine, max_prompt_tokens=MAX_PROMPT_TOKENS,
                       max_concurrent_requests_per_tenant=MAX_PER_TENANT)
    key = srv.make_tenant("tk")
    other = srv.make_tenant("tk-other")
    srv.upload("tk", "sql", b"tk-v1")
    with srv.tenant_client(key) as client, srv.tenant_client(other) as other_client:
        yield srv, client, other_client
    srv.stop()


def test_the_fixture_tokenizer_adds_bos():
    tok = _tokenizer()
    assert tok("ab")["input_ids"][0] == BOS_ID and tok("ab", add_special_tokens=False)["input_ids"][0] != BOS_ID


# --- vLLM's /tokenize and /detokenize ---------------------------------------------------------


@pytest.mark.parametrize("path", ["/tokenize", "/t/tk/tokenize", "/v1/tokenize", "/t/tk/v1/tokenize"])
@pytest.mark.parametrize("add_special", [None, True, False])
def test_tokenize_prompt_matches_the_tokenizer(world, path, add_special):
    srv, client, _ = world
    tok = srv.engine.tokenizer
    body = {"model": "fake-model", "prompt": TEXT}
    if add_special is not None:
        body["add_special_tokens"] = add_special
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    want = tok(TEXT, add_special_tokens=add_special is not False)["input_ids"]  # vLLM's default: true
    assert r.json() == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want, "token_strs": None}


def test_truncate_prompt_tokens_as_completions_take_it(world):
    srv, client, _ = world
    r = client.post("/tokenize", json={"prompt": TEXT, "truncate_prompt_tokens": 3})
    assert r.json()["tokens"] == srv.engine.tokenizer(TEXT)["input_ids"][-3:]


def test_token_strs_when_asked(world):
    srv, client, _ = world
    tok = srv.engine.tokenizer
    r = client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert r["token_strs"] == tok.convert_ids_to_tokens(tok(TEXT)["input_ids"])
    assert r["token_strs"][0] == "<s>"


CONTINUED = [*CHAT, {"role": "assistant", "content": "well"}]


@pytest.mark.parametrize("fields, messages, reference", [
    ({}, CHAT, dict(add_generation_prompt=True)),
    ({"add_special_tokens": False}, CHAT, dict(add_generation_prompt=True)),
    ({"add_generation_prompt": False}, CHAT, dict(add_generation_prompt=False)),
    ({"chat_template_kwargs": {"note": "x"}}, CHAT, dict(add_generation_prompt=True, note="x")),
    ({"add_generation_prompt": False, "continue_final_message": True}, CONTINUED,
     dict(add_generation_prompt=False, continue_final_message=True)),
])
def test_tokenize_chat_matches_apply_chat_template(world, fields, messages, reference):
    srv, client, _ = world
    tok = srv.engine.tokenizer
    r = client.post("/tokenize", json={"model": "fake-model", "messages": messages, **fields})
    assert r.status_code == 200, r.text
    want = tok.apply_chat_template(messages, tokenize=True, **reference)["input_ids"]  # no special tokens added
    assert r.json()["tokens"] == want and r.json()["count"] == len(want)


def test_tokenize_chat_with_special_tokens_adds_them_on_top(world):
    srv, client, _ = world
    tok = srv.engine.tokenizer
    r = client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True})
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == tok(text, add_special_tokens=True)["input_ids"]
    assert r.json()["tokens"][:2] == [BOS_ID, BOS_ID]  # the tokenizer's, then the template's own


def test_tokenize_chat_is_what_chat_completions_run(world):
    """The same conversation through /v1/chat/completions: the engine's prompt is the tokens."""
    srv, client, _ = world
    tokens = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    r = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": CHAT, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokens)
    assert srv.engine.started[-1][0] in srv.engine.params_seen  # it ran


@pytest.mark.parametrize("text", [TEXT, "", "plain ascii"])
def test_detokenize_round_trip(world, text):
    srv, client, _ = world
    tok = srv.engine.tokenizer
    ids = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = client.post("/detokenize", json={"model": "fake-model", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text} == {"prompt": tok.decode(ids)}
    with_bos = client.post("/t/tk/detokenize", json={"tokens": tok(text)["input_ids"]}).json()
    assert with_bos == {"prompt": tok.decode(tok(text)["input_ids"])} == {"prompt": "<s>" + text}


@pytest.mark.parametrize("model", [None, "", "fake-model", "sql", "sql@1"])  # "": the base model, as vLLM
def test_models_of_the_tenant_are_looked_up_not_pinned(world, model, monkeypatch):
    srv, client, _ = world
    tok = srv.engine.tokenizer

    def no_resolve(*args, **kwargs):  # AdapterManager.resolve fetches the files: never from here
        raise AssertionError("the tokenizer routes must not fetch, pin or load an adapter")

    monkeypatch.setattr(srv.adapters, "resolve", no_resolve)
    in_use, loaded, started = dict(srv.adapters.in_use), dict(srv.engine.loaded), len(srv.engine.started)
    body = {} if model is None else {"model": model}
    r = client.post("/tokenize", json={**body, "prompt": "ab"})
    assert r.status_code == 200 and r.json()["tokens"] == tok("ab")["input_ids"]
    r = client.post("/detokenize", json={**body, "tokens": [BOS_ID]})
    assert r.status_code == 200 and r.json() == {"prompt": "<s>"}
    assert (srv.adapters.in_use, srv.engine.loaded, len(srv.engine.started)) == (in_use, loaded, started)


@pytest.mark.parametrize("model", ["nope", "sql@9", "bad name!"])
def test_unknown_models_are_chat_completions_404(world, model):
    srv, client, other = world
    chat = client.post("/v1/chat/completions", json={"model": model, "messages": CHAT})
    assert chat.status_code == 404
    for c in (client, other):
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
            r = c.post(path, json={"model": model, **body})
            assert (r.status_code, r.json()) == (404, chat.json())
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        r = other.post(path, json={"model": "sql", **body})  # tk's adapter is not tk-other's
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_key_is_required(world):
    srv, _, other = world
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        r = httpx.post(srv.url + path, json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = other.post("/t/tk" + path, json=body)  # a key of another tenant
        assert r.status_code == 401


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [VOCAB_SIZE]}, "tokens"),
    ("/detokenize", {"tokens": [5, 10**12]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {"tokens": "5"}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [5], "model": 3}, "model"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {"prompt": [5, 6]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "messages"),
    ("/tokenize", {"prompt": "x", "model": 7}, "model"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": 2}, "return_token_strs"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),  # not trusted here
    ("/tokenize", {"messages": CONTINUED, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "documents": [{"text": 1}]}, "documents"),
    ("/tokenize", {"messages": CHAT, "documents": {"text": "x"}}, "documents"),
    ("/tokenize", {"messages": [{"role": "assistant", "content": "a", "reasoning_content": 1}]},
     "messages[0].reasoning_content"),
])
def test_bad_fields_are_400(world, path, body, param):
    _, client, _ = world
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_bad_bodies_are_400(world):
    _, client, _ = world
    for path in ("/tokenize", "/detokenize"):
        assert client.post(path, content=b"{nope", headers={"content-type": "application/json"}).status_code == 400
        assert client.post(path, json=[1, 2]).status_code == 400


# --- LoRAX's /info and /tokenize --------------------------------------------------------------


@pytest.mark.parametrize("path", ["/info", "/t/tk/info"])
def test_info_reports_the_servers_settings(world, path):
    srv, client, _ = world
    r = client.get(path)
    assert r.status_code == 200
    info = r.json()
    settings = srv.app.state.ctx.settings
    assert info["model_id"] == "fake-model" == srv.engine.model_name
    assert info["max_total_tokens"] == MAX_MODEL_LEN
    assert info["max_input_length"] == info["max_input_tokens"] == MAX_PROMPT_TOKENS
    assert info["max_concurrent_requests"] == MAX_PER_TENANT
    assert info["version"] == loraplex.__version__
    assert info["max_best_of"] == 1
    assert info["model_dtype"] == settings.dtype and info["model_device_type"] == settings.device  # no runner
    # a prompt of max_input_length tokens (BOS and one per byte) is admitted, one more is not
    assert client.post("/generate", json={"inputs": "a" * (MAX_PROMPT_TOKENS - 1),
                                          "parameters": {"max_new_tokens": 1}}).status_code == 200
    assert client.post("/generate", json={"inputs": "a" * MAX_PROMPT_TOKENS,
                                          "parameters": {"max_new_tokens": 1}}).status_code == 422


def test_info_without_the_settings_cap_is_the_context_less_one(server_factory):
    srv = server_factory(FakeEngine(max_model_len=40))
    key = srv.make_tenant("cap")
    info = httpx.get(srv.url + "/info", headers={"Authorization": f"Bearer {key}"}).json()
    assert (info["max_input_length"], info["max_total_tokens"]) == (39, 40)


def test_info_reports_the_callers_own_cap(world):
    srv, client, other = world
    with srv.admin() as admin:
        assert admin.patch("/admin/v1/tenants/tk-other", json={"max_concurrent_requests": 3}).status_code == 200
    try:
        assert other.get("/info").json()["max_concurrent_requests"] == 3  # its operator-set cap
        assert client.get("/info").json()["max_concurrent_requests"] == MAX_PER_TENANT  # the default
    finally:
        with srv.admin() as admin:
            admin.patch("/admin/v1/tenants/tk-other", json={"max_concurrent_requests": None})


def test_info_names_the_runners_dtype_and_device():
    import types

    import torch

    from loraplex.config import Settings
    from loraplex.server.tgi_info import info_body

    runner = types.SimpleNamespace(dtype=torch.float16, device=torch.device("cpu"))
    ctx = types.SimpleNamespace(engine=types.SimpleNamespace(engine=types.SimpleNamespace(runner=runner)),
                                settings=Settings(), served_model_name="m", max_model_len=64)
    info = info_body(ctx)
    assert (info["model_dtype"], info["model_device_type"]) == ("torch.float16", "cpu")  # LoRAX's spelling


def test_info_needs_a_key_in_loraxs_shape(world):
    srv, _, other = world
    r = httpx.get(srv.url + "/info")
    assert r.status_code == 401 and r.json()["error_type"] == "authentication"
    assert other.get("/t/tk/info").status_code == 401


def _utf8_offsets(text: str) -> list[tuple[int, int]]:
    """By hand: the byte-level tokenizer without merges gives one token per UTF-8 byte, each
    covering the character the byte belongs to."""
    return [(i, i + 1) for i, ch in enumerate(text) for _ in ch.encode("utf-8")]


@pytest.mark.parametrize("path", ["/tokenize", "/t/tk/tokenize"])
def test_lorax_tokenize_ids_pieces_and_offsets(world, path):
    srv, client, _ = world
    tok = srv.engine.tokenizer
    r = client.post(path, json={"inputs": TEXT})
    assert r.status_code == 200, r.text
    tokens = r.json()
    ids = tok(TEXT)["input_ids"]
    assert [t["id"] for t in tokens] == ids
    assert [t["text"] for t in tokens] == tok.convert_ids_to_tokens(ids)
    assert (tokens[0]["id"], tokens[0]["start"], tokens[0]["stop"]) == (BOS_ID, 0, 0)  # BOS covers nothing
    assert [(t["start"], t["stop"]) for t in tokens[1:]] == _utf8_offsets(TEXT)
    # each token's bytes are the UTF-8 of the text it covers, in order
    covered = {}
    for t in tokens[1:]:
        covered.setdefault((t["start"], t["stop"]), []).append(t["id"])
    for (start, stop), piece_ids in covered.items():
        assert tok.decode(piece_ids) == TEXT[start:stop]


def test_lorax_tokenize_without_special_tokens_and_truncated(world):
    srv, client, _ = world
    tok = srv.engine.tokenizer
    plain = client.post("/tokenize", json={"inputs": "abc", "add_special_tokens": False}).json()
    assert [t["id"] for t in plain] == tok("abc", add_special_tokens=False)["input_ids"]
    assert [(t["start"], t["stop"], t["text"]) for t in plain] == [(0, 1, "a"), (1, 2, "b"), (2, 3, "c")]
    last = client.post("/tokenize", json={"inputs": "abcdef", "parameters": {"truncate": 2}}).json()
    assert [(t["start"], t["stop"], t["text"]) for t in last] == [(4, 5, "e"), (5, 6, "f")]  # TGI keeps the end
    assert client.post("/tokenize", json={"inputs": ""}).json() == [{"id": BOS_ID, "text": "<s>", "start": 0, "stop": 0}]


def test_lorax_tokenize_errors_in_loraxs_shape(world):
    srv, client, _ = world
    r = httpx.post(srv.url + "/tokenize", json={"inputs": "x"})
    assert r.status_code == 401 and r.json()["error_type"] == "authentication"
    for body in ({"inputs": 5}, {"inputs": "x", "add_special_tokens": "yes"},
                 {"inputs": "x", "parameters": {"truncate": 0}}, {"inputs": "x", "parameters": []}):
        r = client.post("/tokenize", json=body)
        assert r.status_code == 422 and r.json()["error_type"] == "validation", body
