"""OpenAI-compatible routes over a fake engine, driven by the official openai client."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.fakes import expected_text


def _upload(srv, tenant: str, name: str, payload: bytes) -> dict:
    return srv.upload(tenant, name, payload)


@pytest.fixture
def setup(fake_server):
    key = fake_server.make_tenant("acme")
    version = _upload(fake_server, "acme", "sql", b"weights-v1")
    client = openai.OpenAI(base_url=f"{fake_server.url}/t/acme/v1", api_key=key, max_retries=0)
    return fake_server, key, version, client


def test_completion_matches_engine_output(setup):
    srv, key, version, client = setup
    tok = srv.engine.tokenizer
    out = client.completions.create(model="sql", prompt="hello world", max_tokens=7, seed=3)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == "sql"
    prompt_ids = tok("hello world")["input_ids"]
    assert out.choices[0].text == expected_text(tok, prompt_ids, version["sha256"], 3, 7)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 7
    assert out.usage.total_tokens == len(prompt_ids) + 7
    # the base model by its served name: no adapter
    base = client.completions.create(model="fake-model", prompt="hello world", max_tokens=5, seed=3)
    assert base.choices[0].text == expected_text(tok, prompt_ids, None, 3, 5)


def test_completion_prompt_forms_and_n(setup):
    srv, key, version, client = setup
    tok = srv.engine.tokenizer
    out = client.completions.create(model="sql", prompt=["ab", "cd"], max_tokens=3, n=2, seed=1)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        ids = tok(["ab", "cd"][c.index // 2])["input_ids"]
        assert c.text == expected_text(tok, ids, version["sha256"], 1, 3, choice=c.index % 2)
    ids = [5, 6, 7]
    out = client.completions.create(model="sql", prompt=ids, max_tokens=4, seed=2)
    assert out.choices[0].text == expected_text(tok, ids, version["sha256"], 2, 4)
    out = client.completions.create(model="sql", prompt=[ids, [8, 9]], max_tokens=2, seed=2)
    assert len(out.choices) == 2 and out.usage.prompt_tokens == 5


def test_chat_and_streaming_with_usage(setup):
    srv, key, version, client = setup
    tok = srv.engine.tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    want = expected_text(tok, ids, version["sha256"], 5, 6)
    out = client.chat.completions.create(model="sql", messages=messages, max_completion_tokens=6, seed=5)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    assert out.usage.prompt_tokens == len(ids)

    stream = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=6, seed=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    cstream = client.completions.create(model="sql", prompt="abc", max_tokens=4, seed=9, stream=True)
    texts = [c.choices[0].text for c in cstream]
    assert "".join(texts) == expected_text(tok, tok("abc")["input_ids"], version["sha256"], 9, 4)


def test_raw_sse_ends_with_done(setup):
    srv, key, version, client = setup
    import httpx

    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    json.loads(events[0][6:])


def test_logprobs_shapes(setup):
    srv, key, version, client = setup
    out = client.completions.create(model="sql", prompt="ab", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "x"}], max_tokens=2, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and len(content[0].top_logprobs) == 2
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_models_lists_only_own_adapters(setup):
    srv, key, version, client = setup
    other_key = srv.make_tenant("globex")
    _upload(srv, "globex", "secret-adapter", b"w")
    ids = [m.id for m in client.models.list()]
    assert ids == ["fake-model", "sql"]
    other = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=other_key, max_retries=0)
    assert [m.id for m in other.models.list()] == ["fake-model", "secret-adapter"]
    # models.retrieve: one entry of the same list; another tenant's adapter is not found
    sql = client.models.retrieve("sql")
    assert (sql.id, sql.object, sql.owned_by) == ("sql", "model", "acme")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("secret-adapter")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/t/acme/v1", api_key=other_key, max_retries=0).models.retrieve("sql")


def test_models_retrieve_takes_every_name_a_request_takes(setup):
    """OpenAI's retrieve answers for any ``model`` a request runs on: ``name@N`` pins too, in the
    list's card shape; a name no request runs on is OpenAI's 404, on both path forms."""
    srv, key, version, client = setup
    other_key = srv.make_tenant("globex")
    _upload(srv, "globex", "secret-adapter", b"w")
    assert _upload(srv, "acme", "sql", b"weights-v2")["version"] == 2
    listed = {m.id: m.model_dump(exclude={"created"}) for m in client.models.list()}
    plain = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
    for c in (client, plain):
        for pinned in ("sql@1", "sql@2"):
            # the name runs a request, so it retrieves
            assert c.completions.create(model=pinned, prompt="q", max_tokens=1).model == pinned
            card = c.models.retrieve(pinned).model_dump(exclude={"created"})
            assert card == {**listed["sql"], "id": pinned}
            assert (card["root"], card["parent"], card["owned_by"]) == ("sql", "fake-model", "acme")
        assert c.models.retrieve("sql").model_dump(exclude={"created"}) == listed["sql"]
        assert c.models.retrieve("fake-model").model_dump(exclude={"created"}) == listed["fake-model"]
        for unknown in ("sql@3", "sql@0", "sql@x", "SQL", "secret-adapter", "secret-adapter@1", "nope@1"):
            with pytest.raises(openai.NotFoundError) as info:
                c.completions.create(model=unknown, prompt="q", max_tokens=1)  # no request runs on it
            with pytest.raises(openai.NotFoundError) as info:
                c.models.retrieve(unknown)
            assert info.value.code == "model_not_found" and info.value.body["param"] == "model"
            assert info.value.body["message"] == f"The model `{unknown}` does not exist or you do not have access to it."
    # the other tenant's pinned name retrieves for that tenant only
    other = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=other_key, max_retries=0)
    assert other.models.retrieve("secret-adapter@1").owned_by == "globex"


def test_v1_prefix_uses_the_keys_tenant_and_hot_swap(setup):
    srv, key, version, client = setup
    tok = srv.engine.tokenizer
    v2 = _upload(srv, "acme", "sql", b"weights-v2")
    assert v2["version"] == 2
    plain = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
    ids = tok("q")["input_ids"]
    assert plain.completions.create(model="sql", prompt="q", max_tokens=3).choices[0].text == expected_text(
        tok, ids, version["sha256"], None, 3
    )
    with srv.admin() as c:
        assert c.put("/admin/v1/tenants/acme/adapters/sql/active", json={"version": 2}).status_code == 200
    assert plain.completions.create(model="sql", prompt="q", max_tokens=3).choices[0].text == expected_text(
        tok, ids, v2["sha256"], None, 3
    )
    pinned = plain.completions.create(model="sql@1", prompt="q", max_tokens=3)
    assert pinned.choices[0].text == expected_text(tok, ids, version["sha256"], None, 3)


@pytest.mark.parametrize("model", ["left out", None, ""])
def test_model_left_out_is_the_base_model(setup, model):
    """vLLM's request models have ``model: str | None = None``: no model (or null) is the base
    model, on chat, completions and Responses alike; so is "" (vLLM's ``_is_model_supported``
    takes any empty name as the base model's); the answer names the served model."""
    import httpx

    srv, key, version, client = setup
    tok = srv.engine.tokenizer
    ids = tok("hello world")["input_ids"]
    extra = {} if model == "left out" else {"model": model}
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}) as c:
        comp = c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 5, "seed": 3, **extra})
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                    **extra})
        resp = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, **extra})
    assert [r.status_code for r in (comp, chat, resp)] == [200, 200, 200], comp.text + chat.text + resp.text
    assert comp.json()["choices"][0]["text"] == expected_text(tok, ids, None, 3, 5)  # no adapter
    assert {r.json()["model"] for r in (comp, chat, resp)} == {"fake-model"}
    assert all(adapter is None for _, adapter in srv.engine.started[-3:])


def test_a_huge_unknown_model_is_clipped_in_the_answer_and_the_access_line(setup, caplog):
    """A tenant's 2 MB `model` was echoed whole in the 404 and written whole into the access
    line (a 20 MB request, a 20 MB log line); both now show its start and its length."""
    import json
    import logging

    import httpx

    from loraplex.server.errors import MAX_ECHOED_CHARS

    srv, key, _, _ = setup
    model = "m" * (2 << 20)
    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        r = httpx.post(f"{srv.url}/t/acme/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": model, "prompt": "hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert message == (f"The model `{'m' * MAX_ECHOED_CHARS}... ({len(model)} characters)` does not exist or you "
                       "do not have access to it.")
    access = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "loraplex.access"]
    assert [a["status"] for a in access] == [404]
    assert access[0]["model"] == f"{'m' * MAX_ECHOED_CHARS}... ({len(model)} characters)"
    assert all(len(rec.getMessage()) < 4096 for rec in caplog.records)
