"""SGLang's native API (POST /generate with `text`/`input_ids`, /get_model_info,
/get_server_info, /health_generate, /flush_cache) over the fake engine, against SGLang's
documented contract (docs.sglang.io "Sampling Parameters" and "SGLang Native APIs";
sgl-project/sglang io_struct.py GenerateReqInput, tokenizer_manager.py's output objects,
schedule_batch.py's finish reasons, http_server.py's error shape). Expected texts come from the
fake engine's own token function (tests/server/fakes.py), not from the code under test."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import ADMIN_KEY
from tests.server.fakes import VOCAB_OFFSET, FakeEngine, expected_text, fake_token


@pytest.fixture(scope="module")
def world(module_server):
    srv = module_server
    key = srv.make_tenant("sg")
    version = srv.upload("sg", "sql", b"sg-v1")
    with srv.tenant_client(key) as client:
        yield srv, client, version["sha256"]


def _ids(srv, text: str) -> list[int]:
    return srv.engine.tokenizer(text)["input_ids"]


def _events(r) -> list:
    assert r.headers["content-type"].startswith("text/event-stream")
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"  # SGLang ends every stream so
    return [json.loads(d) for d in data[:-1]]


def _started(srv) -> int:
    return len(srv.engine.started)


def test_single_text_with_adapter(world):
    srv, client, sha = world
    ids = _ids(srv, "hello world")
    r = client.post("/t/sg/generate", json={"text": "hello world", "lora_path": "sql", "rid": "r-1",
                                            "sampling_params": {"temperature": 0, "max_new_tokens": 7}})
    assert r.status_code == 200, r.text
    body = r.json()
    tokens = [fake_token(ids, sha, None, 0, k) for k in range(7)]
    assert body["text"] == expected_text(srv.engine.tokenizer, ids, sha, None, 7)
    assert body["output_ids"] == tokens
    meta = body["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (len(ids), 7, 0)
    assert meta["e2e_latency"] >= 0 and "input_token_logprobs" not in meta
    # name@N, and the base model without lora_path
    assert client.post("/generate", json={"text": "hello world", "lora_path": "sql@1",
                                          "sampling_params": {"max_new_tokens": 7, "temperature": 0}}
                       ).json()["text"] == body["text"]
    base = client.post("/generate", json={"text": "hello world", "sampling_params": {"max_new_tokens": 4,
                                                                                   "temperature": 0}}).json()
    assert base["text"] == expected_text(srv.engine.tokenizer, ids, None, None, 4)
    assert srv.adapters.in_use[sha] == 0


def test_batch_text_and_lora_path_list(world):
    srv, client, sha = world
    tok = srv.engine.tokenizer
    r = client.post("/generate", json={"text": ["ab cd", "ef gh", "ab cd"], "lora_path": ["sql", None, None],
                                       "rid": "job", "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 3
    want = [(_ids(srv, "ab cd"), sha), (_ids(srv, "ef gh"), None), (_ids(srv, "ab cd"), None)]
    assert [o["text"] for o in out] == [expected_text(tok, i, a, None, 5) for i, a in want]
    assert [o["meta_info"]["id"] for o in out] == ["job_0", "job_1", "job_2"]  # SGLang's rid_<i>
    assert all("index" not in o for o in out)  # only streamed objects carry it


def test_input_ids_single_and_batch(world):
    srv, client, _ = world
    tok = srv.engine.tokenizer
    ids = [VOCAB_OFFSET + 1, VOCAB_OFFSET + 2, VOCAB_OFFSET + 3]
    one = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 3,
                                                                              "temperature": 0}}).json()
    assert one["text"] == expected_text(tok, ids, None, None, 3) and one["meta_info"]["prompt_tokens"] == 3
    two = client.post("/generate", json={"input_ids": [ids, ids[:2]], "sampling_params": [
        {"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 2, "temperature": 0}]}).json()
    assert [o["text"] for o in two] == [expected_text(tok, ids, None, None, 3),
                                        expected_text(tok, ids[:2], None, None, 2)]
    assert two[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_n_gives_a_list_prompt_by_prompt(world):
    srv, client, _ = world
    tok = srv.engine.tokenizer
    r = client.post("/generate", json={"text": ["ab", "cd"], "sampling_params": {
        "n": 2, "max_new_tokens": 4, "temperature": 0.7, "sampling_seed": 11}})
    out = r.json()
    assert len(out) == 4
    want = [expected_text(tok, _ids(srv, p), None, 11, 4, choice=c) for p in ("ab", "cd") for c in range(2)]
    assert [o["text"] for o in out] == want
    assert len({o["meta_info"]["id"] for o in out}) == 4
    single = client.post("/generate", json={"text": "ab", "sampling_params": {"n": 2, "max_new_tokens": 4,
                                                                             "sampling_seed": 11}}).json()
    assert [o["text"] for o in single] == want[:2]


def test_sampling_params_reach_the_engine(world):
    srv, client, _ = world
    sp = {"max_new_tokens": 6, "min_new_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1,
          "frequency_penalty": 0.2, "presence_penalty": -0.3, "repetition_penalty": 1.2, "stop": "zz",
          "stop_token_ids": [5], "ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True,
          "sampling_seed": 3, "spaces_between_special_tokens": True, "stream_interval": 2}
    assert client.post("/generate", json={"text": "ab", "sampling_params": sp}).status_code == 200
    p = list(srv.engine.params_seen.values())[-1]
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (6, 2, 0.5, 0.9, 7, 0.1)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.2, -0.3, 1.2)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.skip_special_tokens) == (["zz"], [5], True, False)
    assert (p.include_stop_str_in_output, p.seed, p.logprobs, p.prompt_logprobs) == (True, 3, None, None)
    # SGLang's defaults: 128 new tokens, temperature 1, top_k -1 (all); below 1e-6 is greedy
    assert client.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 3,
                                                                           "temperature": 1e-7}}).status_code == 200
    assert list(srv.engine.params_seen.values())[-1].temperature == 0.0
    client.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 3}})
    p = list(srv.engine.params_seen.values())[-1]
    assert (p.temperature, p.top_k, p.top_p) == (1.0, 0, 1.0)
    r = client.post("/generate", json={"text": "ab", "sampling_params": {"regex": "[a-c]+", "max_new_tokens": 3}})
    assert r.status_code == 200 and list(srv.engine.params_seen.values())[-1].structured_outputs.regex == "[a-c]+"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.post("/generate", json={"text": "ab", "sampling_params": {"json_schema": json.dumps(schema),
                                                                    "max_new_tokens": 3}})
    assert list(srv.engine.params_seen.values())[-1].structured_outputs.json == schema


def test_default_max_new_tokens_is_sglangs(server_factory):
    srv = server_factory(engine=FakeEngine(max_model_len=512))
    with srv.tenant_client(srv.make_tenant("d")) as client:
        r = client.post("/generate", json={"text": "ab"})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 128


def test_stop_finish_reason_names_what_matched(world):
    srv, client, _ = world
    ids = _ids(srv, "ab")
    first = srv.engine.tokenizer.decode([fake_token(ids, None, None, 0, 2)])
    r = client.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                        "stop": [first]}})
    meta = r.json()["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": first}


def test_logprobs_in_sglangs_tuples(world):
    srv, client, _ = world
    ids = _ids(srv, "ab")
    tokens = [fake_token(ids, None, None, 0, k) for k in range(3)]
    r = client.post("/generate", json={"text": "ab", "return_logprob": True, "top_logprobs_num": 1,
                                       "return_text_in_logprobs": True,
                                       "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    meta = r.json()["meta_info"]
    decode = srv.engine.tokenizer.decode
    assert meta["output_token_logprobs"] == [[-0.5, t, decode([t])] for t in tokens]
    # the fake's alternatives: the chosen token at -0.5 and VOCAB_OFFSET at -1.5; top 1 keeps the first
    assert meta["output_top_logprobs"] == [[[-0.5, t, decode([t])]] for t in tokens]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []  # logprob_start_len -1
    assert list(srv.engine.params_seen.values())[-1].logprobs == 1
    plain = client.post("/generate", json={"text": "ab", "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    assert plain["meta_info"]["output_token_logprobs"] == [[-0.5, t, None] for t in tokens[:2]]
    assert "output_top_logprobs" not in plain["meta_info"]


def test_stream_is_cumulative_and_ends_with_done(world):
    srv, client, sha = world
    ids = _ids(srv, "ab")
    r = client.post("/generate", json={"text": "ab", "stream": True, "lora_path": "sql",
                                       "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    events = _events(r)
    full = expected_text(srv.engine.tokenizer, ids, sha, None, 4)
    assert [e["text"] for e in events] == [full[:k] for k in range(1, 5)]
    assert [e["meta_info"]["finish_reason"] for e in events] == [None] * 3 + [{"type": "length", "length": 4}]
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3, 4]
    assert all("index" not in e for e in events)
    batch = _events(client.post("/generate", json={"text": ["ab", "cd"], "stream": True,
                                                   "sampling_params": {"max_new_tokens": 2, "temperature": 0}}))
    assert sorted(e["index"] for e in batch) == [0, 0, 1, 1]
    last = {e["index"]: e["text"] for e in batch}
    assert last == {0: expected_text(srv.engine.tokenizer, ids, None, None, 2),
                    1: expected_text(srv.engine.tokenizer, _ids(srv, "cd"), None, None, 2)}
    assert srv.adapters.in_use[sha] == 0


@pytest.mark.parametrize("body, words", [
    ({"text": "ab", "input_ids": [4, 5]}, ["text", "input_ids"]),
    ({"sampling_params": {}}, ["text", "input_ids"]),
    ({"text": "ab", "inputs": "ab"}, ["inputs", "text"]),
    ({"text": "ab", "sampling_params": {"temprature": 0}}, ["temprature"]),
    ({"text": "ab", "sampling_params": {"stop_regex": "a+"}}, ["stop_regex"]),
    ({"text": "ab", "sampling_params": {"temperature": -1}}, ["temperature"]),
    ({"text": "ab", "sampling_params": {"top_k": 0}}, ["top_k"]),
    ({"text": "ab", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, ["regex", "ebnf"]),
    ({"text": "ab", "lora_path": "nope"}, ["nope"]),
    ({"text": ["ab", "cd"], "lora_path": ["sql", "nope"]}, ["nope"]),
    ({"text": ["ab", "cd"], "lora_path": ["sql"]}, ["lora_path"]),
    ({"text": ["ab", "cd"], "sampling_params": [{"n": 1}, {"n": 2}]}, ["parallel_sample_num"]),
    ({"text": "ab", "image_data": "x.png"}, ["image_data"]),
    ({"input_ids": [4, 10 ** 6]}, ["input_ids"]),
    ({"input_ids": [-1, 4]}, ["input_ids"]),  # was run (the engine refuses it: a stream began, then failed)
    ({"input_ids": [[4, 5], [-3]], "stream": True}, ["input_ids"]),
    ({"input_ids": [4, "a"]}, ["input_ids"]),
    ({"text": "ab", "sampling_params": {"max_new_tokens": -1}}, ["max_new_tokens"]),
    ({"text": "ab", "sampling_params": {"n": [2]}}, ["n"]),  # was a 500 (a list cannot be compared)
    ({"text": "ab", "sampling_params": {"sampling_seed": 2 ** 64}}, ["sampling_seed"]),
    ({"text": "ab", "sampling_params": {"max_new_tokens": 0, "min_new_tokens": 1}}, ["min_new_tokens"]),
    # "ab" is 3 prompt tokens (bos, a, b): SGLang refuses a start past the prompt
    ({"text": "ab", "return_logprob": True, "logprob_start_len": 4, "sampling_params": {"max_new_tokens": 2}},
     ["logprob_start_len"]),
    ({"text": ["abcd", "ab"], "return_logprob": True, "logprob_start_len": 4, "sampling_params": {"max_new_tokens": 2}},
     ["logprob_start_len"]),
    ({"text": "ab", "rid": ["a", "b"]}, ["rid"]),
    ({"text": ["ab", "cd"], "rid": ["a", "a"]}, ["Duplicate"]),
    ({"text": "ab", "sampling_params": {"json_schema": "{not json"}}, ["json_schema"]),
    # integers no float holds (JSON's 1e400 reads as inf, 10**400 written out is an int): were 500s
    ({"text": "ab", "sampling_params": {"temperature": 10**400}}, ["temperature"]),
    ({"text": "ab", "sampling_params": {"top_p": 10**400}}, ["top_p"]),
    ({"text": "ab", "sampling_params": {"min_p": -10**400}}, ["min_p"]),
    ({"text": "ab", "sampling_params": {"frequency_penalty": 10**400}}, ["frequency_penalty"]),
    ({"text": "ab", "sampling_params": {"repetition_penalty": 10**400}}, ["repetition_penalty"]),
    ({"text": "ab", "sampling_params": {"logit_bias": {"5": 10**400}}}, ["logit_bias"]),
])
def test_bad_input_is_a_400_in_sglangs_shape_and_runs_nothing(world, body, words):
    srv, client, sha = world
    before = _started(srv)
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message"}
    assert all(w in r.json()["error"]["message"] for w in words), r.text
    assert _started(srv) == before and srv.adapters.in_use.get(sha, 0) == 0


def test_max_new_tokens_0_scores_the_prompt_and_shows_no_output(world):
    """SGLang's prefill-only request (what sgl.function's RuntimeEndpoint sends for cache_prefix
    and select): no text, no ids, finish {"type": "length", "length": 0}, streamed or not."""
    srv, client, sha = world
    before = len(srv.engine.started)
    r = client.post("/generate", json={"text": ["ab", "cd"], "lora_path": "sql", "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 0, "temperature": 0}})
    assert r.status_code == 200, r.text
    for out, text in zip(r.json(), ["ab", "cd"]):
        meta = out["meta_info"]
        assert (out["text"], out["output_ids"], meta["output_token_logprobs"]) == ("", [], [])
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(_ids(srv, text)), 0)
    assert len(srv.engine.started) > before and srv.adapters.in_use[sha] == 0
    events = _events(client.post("/generate", json={"text": "ab", "stream": True,
                                                    "sampling_params": {"max_new_tokens": 0}}))
    assert len(events) == 1 and events[0]["text"] == "" and events[0]["output_ids"] == []
    assert events[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_lorax_bodies_still_reach_lorax(world):
    srv, client, sha = world
    r = client.post("/generate", json={"inputs": "ab", "parameters": {"adapter_id": "sql", "max_new_tokens": 3}})
    assert r.status_code == 200 and r.json() == {
        "generated_text": expected_text(srv.engine.tokenizer, _ids(srv, "ab"), sha, None, 3)}


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"text": ' + b"[" * 100_000])
def test_a_body_nested_past_the_parser_is_lorax_bad_json_answer(world, raw):
    """Nested deeper than json.loads recurses (RecursionError, no ValueError): it was a 500 and a
    reset connection; it is now what any other unparseable body gets here (LoRAX's 422)."""
    srv, client, _ = world
    before = _started(srv)
    r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    assert client.post("/generate", content=b"{not json", headers={"content-type": "application/json"}
                       ).json() == r.json()
    assert _started(srv) == before


def test_a_json_schema_nested_past_the_parser_is_a_400(world):
    srv, client, _ = world
    before = _started(srv)
    r = client.post("/generate", json={"text": "ab", "sampling_params": {"json_schema": "[" * 100_000}})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": "`sampling_params.json_schema` must be a JSON schema in a string."}}
    assert _started(srv) == before


def test_info_health_and_flush(world):
    srv, client, _ = world
    info = client.get("/t/sg/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] == srv.app.state.ctx.settings.model
    server = client.get("/get_server_info").json()
    s = srv.app.state.ctx.settings
    assert (server["max_loras_per_batch"], server["max_running_requests"], server["disable_radix_cache"]) == (
        s.max_loras, s.max_num_seqs, not s.enable_prefix_caching)
    assert server["context_length"] == srv.engine.max_model_len
    assert client.get("/get_model_info", headers={"Authorization": "Bearer nope"}).status_code == 401
    before = _started(srv)
    assert client.get("/health_generate").status_code == 200
    assert _started(srv) == before + 1  # an idle server runs one token to say so
    flushes = srv.engine.flushes
    assert client.post("/flush_cache").status_code == 401  # a tenant key: the operator's act
    r = client.post("/flush_cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200 and r.text.startswith("Cache flushed") and srv.engine.flushes == flushes + 1


def test_runtime_lora_routes_exist_only_when_turned_on(world):
    _, client, _ = world  # this server runs without --allow-runtime-lora-updating, as SGLang without --enable-lora
    assert client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}).status_code == 404


def test_n_past_max_n_is_refused_before_any_per_sample_work(world):
    """A huge ``n`` is the server's ``--max-n`` 400 at once: the request's per-sample ids were
    made first, so n = 10**12 held the event loop (every other request) for good."""
    srv, client, sha = world
    before = _started(srv)
    for n in (17, 10**12):  # the test server's max_n is 16
        for body in ({"text": "ab"}, {"text": ["ab", "cd"], "lora_path": ["sql", None]}):
            r = client.post("/generate", json={**body, "sampling_params": {"n": n, "max_new_tokens": 2}}, timeout=5)
            assert r.status_code == 400, r.text
            assert r.json() == {"error": {"message": f"`n` must be <= 16, got {n}"}}
    assert _started(srv) == before and srv.adapters.in_use.get(sha, 0) == 0
    assert client.post("/generate", json={"text": "ab", "sampling_params": {"n": 16, "max_new_tokens": 1}}
                       ).status_code == 200


def test_context_overflow_and_logprob_cap_name_sglangs_fields(world):
    srv, client, _ = world
    before = _started(srv)
    r = client.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 500}})
    assert r.status_code == 400 and "maximum context length of 128" in r.json()["error"]["message"]
    assert "max_new_tokens" in r.json()["error"]["message"]
    r = client.post("/generate", json={"text": "ab", "return_logprob": True, "top_logprobs_num": 21})
    assert r.status_code == 400 and "top_logprobs_num" in r.json()["error"]["message"]
    assert _started(srv) == before


def test_access_lines_name_the_endpoint(world, caplog):
    _, client, _ = world
    with caplog.at_level("INFO", logger="loraplex.access"):
        client.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 2}})
        client.post("/generate", json={"text": "ab", "lora_path": "nope"})
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "loraplex.access"]
    assert [(line["endpoint"], line["status"]) for line in lines[-2:]] == [("sglang_generate", 200),
                                                                         ("sglang_generate", 400)]


class _BreaksAfterOneToken(FakeEngine):
    async def generate(self, prompt, params, **kwargs):
        async for out in super().generate(prompt, params, **kwargs):
            yield out
            raise RuntimeError("device lost")


def test_a_stream_that_fails_says_so_in_band_then_done(server_factory):
    srv = server_factory(engine=_BreaksAfterOneToken())
    with srv.tenant_client(srv.make_tenant("b")) as client:
        events = _events(client.post("/generate", json={"text": "ab", "stream": True,
                                                        "sampling_params": {"max_new_tokens": 4}}))
        assert events[0]["meta_info"]["finish_reason"] is None
        assert events[-1] == {"error": {"message": "Internal server error."}}  # SGLang's in-band error
        r = client.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 500 and r.json() == {"error": {"message": "Internal server error."}}
    assert srv.app.state.ctx.lifecycle.in_flight == 0  # both runs gave their slots back


def test_a_batch_refused_in_part_gives_back_what_its_admitted_parts_took(server_factory):
    """Two adapters: two runs. The tenant's cap of one refuses the second; the first gives back
    its slot and its whole rate-limit reservation, and nothing runs."""
    srv = server_factory()
    key = srv.make_tenant("cap")
    srv.upload("cap", "sql", b"cap-v1")
    with srv.admin() as admin:
        assert admin.patch("/admin/v1/tenants/cap", json={
            "max_concurrent_requests": 1, "max_requests_per_minute": 5, "max_tokens_per_minute": 5000}).status_code == 200
    ctx = srv.app.state.ctx
    with srv.tenant_client(key) as client:
        r = client.post("/generate", json={"text": ["ab", "cd"], "lora_path": ["sql", None],
                                           "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 429 and set(r.json()) == {"error"}
        assert srv.engine.started == []
        assert (ctx.rate_limiter.used("cap", "requests"), ctx.rate_limiter.used("cap", "tokens")) == (0, 0)
        assert ctx.lifecycle.in_flight == 0
        ok = client.post("/generate", json={"text": ["ab", "cd"], "sampling_params": {"max_new_tokens": 3}})
        assert ok.status_code == 200 and len(ok.json()) == 2  # one adapter: one run, one slot


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_every_run_of_its_batch(server_factory, stream):
    from tests.server.test_disconnect_fake import _raw_request, _wait

    engine = FakeEngine(step_seconds=0.05, max_model_len=4096)
    srv = server_factory(engine)
    key = srv.make_tenant("gone")
    srv.upload("gone", "sql", b"gone-v1")
    body = json.dumps({"text": ["ab", "cd"], "lora_path": ["sql", None], "stream": stream,
                       "sampling_params": {"max_new_tokens": 1000}}).encode()
    sock = _raw_request(srv.url, "/generate", key, body)
    if stream:
        received = b""
        while b"data: " not in received:  # streaming has begun
            chunk = sock.recv(4096)
            assert chunk, "connection closed early"
            received += chunk
    else:
        _wait(lambda: len(engine.started) == 2, 2.0)
    sock.close()
    _wait(lambda: engine.stats()["num_blocks_free"] == engine.num_blocks, 2.0)
    assert len(engine.aborted) == 2  # both runs: the adapter's and the base model's
    _wait(lambda: srv.app.state.ctx.limiter.in_flight() == 0, 1.0)


def test_generate_checks_the_key_before_reading_the_body(world):
    """A caller without a valid key gets its 401 before the body is read: before, POST /generate
    buffered and parsed up to --max-body-bytes to learn which API spoke. The refusal has LoRAX's
    shape, which is also what SGLang's --api-key check answers (a string ``error``)."""
    import socket
    import time
    from urllib.parse import urlsplit

    srv, _, _ = world
    url = urlsplit(srv.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        head = ("POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                "Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n")
        sock.sendall(head.encode() + b'{"text": "aaaa')  # 50 MB announced, a few bytes sent
        started = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert time.monotonic() - started < 5
    status_line, _, rest = answer.decode("latin-1").partition("\r\n")
    assert " 401 " in status_line, answer
    body = json.loads(rest.split("\r\n\r\n", 1)[1])
    assert body["error_type"] == "authentication" and isinstance(body["error"], str)
