"""``truncation: "auto"`` on ``/v1/responses`` (vLLM's: ``truncate_prompt_tokens=-1`` with
``max_output_tokens`` reserved): a conversation longer than the context (the fake engine's 128
tokens) is answered, the engine running the rendered prompt's last tokens (the tokenizer's
rendering of the whole conversation, cut), where ``"disabled"`` is a 400. The response echoes
the setting."""

from __future__ import annotations

import pytest

from tests.server.fakes import FakeTokenizer
from tests.server.test_errors_fake import _envelope

CONTEXT = 128  # the fake engine's max_model_len
LONG = "a " * 200  # some 400 tokens: one per character


@pytest.fixture(scope="module")
def world(module_server):
    srv = module_server
    with srv.tenant_client(srv.make_tenant("trunc")) as client:
        yield srv, client


def _rendered(text: str) -> list[int]:
    """The whole conversation's prompt ids, from the tokenizer alone (chat: no special tokens added)."""
    tok = FakeTokenizer()
    return tok(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def _prompt_run(srv) -> list[int]:
    request_id, _ = srv.engine.started[-1]
    return srv.engine.prompts_seen[request_id]


def test_short_conversation_runs_whole(world):
    srv, client = world
    r = client.post("/v1/responses", json={"input": "hello there", "max_output_tokens": 2, "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert _prompt_run(srv) == _rendered("hello there") and r.json()["truncation"] == "auto"


@pytest.mark.parametrize("stream", [False, True])
def test_long_conversation_keeps_its_last_tokens(world, stream):
    srv, client = world
    body = {"input": LONG, "max_output_tokens": 2, "stream": stream}
    _envelope(client.post("/v1/responses", json={**body, "truncation": "disabled"}), 400, param="input")
    before = len(srv.engine.started)
    r = client.post("/v1/responses", json={**body, "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert len(srv.engine.started) == before + 1
    full = _rendered(LONG)
    assert len(full) > CONTEXT
    assert _prompt_run(srv) == full[-(CONTEXT - 2):]  # room left for max_output_tokens
    if not stream:
        assert r.json()["usage"]["input_tokens"] == CONTEXT - 2 and r.json()["truncation"] == "auto"
    else:
        assert '"type":"response.incomplete"' in r.text or '"type":"response.completed"' in r.text


def test_without_max_output_tokens_the_prompt_keeps_what_the_server_admits(world):
    srv, client = world
    r = client.post("/v1/responses", json={"input": LONG, "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert _prompt_run(srv) == _rendered(LONG)[-(CONTEXT - 1):]  # one token short of the context
    assert r.json()["usage"]["output_tokens"] == 1


def test_truncate_prompt_tokens_sent_too_keeps_the_fewer(world):
    srv, client = world
    r = client.post("/v1/responses", json={"input": LONG, "truncation": "auto", "max_output_tokens": 2,
                                           "truncate_prompt_tokens": 50})
    assert r.status_code == 200, r.text
    assert _prompt_run(srv) == _rendered(LONG)[-50:]


def test_max_output_tokens_filling_the_context_is_still_refused(world):
    srv, client = world
    before = len(srv.engine.started)
    _envelope(client.post("/v1/responses", json={"input": LONG, "truncation": "auto", "max_output_tokens": CONTEXT}),
              400, param="max_output_tokens")
    assert len(srv.engine.started) == before
