"""A JSON schema after reasoning, end to end: the real engine (tiny random thinking model, CPU)
behind the server with ``--reasoning-parser deepseek_r1``, greedy. Chat whole, chat streamed and
the Responses API (whole and streamed) give the same answer: ``reasoning`` is the model's own
greedy path up to ``</think>`` (transformers' logits), which no JSON grammar would allow, and the
content after it validates against the schema; with the reasoning closed by the prompt, the
content is JSON from the first token."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.engine.llm import LLM
from tests.engine.reasoning_helpers import END_THINK, THINK, end_bias, make_thinking_model_dir
from tests.server.conftest import start_server
from tests.server.test_auto_tools_fake import _join, _sse, _whole
from tests.server.test_responses_fake import _streamed, _whole_items

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "y"]}},
          "required": ["ok", "tag"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Is it sunny?"}]
# no whitespace: a random model would otherwise fill the JSON's optional whitespace for ever
NO_SPACE = {4 + ord(c): -100.0 for c in " \t\n\r"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = make_thinking_model_dir(tmp_path_factory.mktemp("thinking"))
    llm = LLM(model=str(path), dtype="float32", device="cpu", home=tmp_path_factory.mktemp("home"))
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    srv = start_server(tmp_path_factory.mktemp("srv"), engine, reasoning_parser="deepseek_r1")
    key = srv.make_tenant("think")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield srv, key, llm.get_tokenizer(), model
    srv.stop()
    engine.shutdown()


def _answers(srv, key, body: dict) -> tuple[dict, tuple]:
    """The chat answer whole, checked against its stream and the Responses API's two answers."""
    with srv.tenant_client(key) as c:
        choice = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert _join(_sse(c.post("/v1/chat/completions", json={**body, "stream": True}))) == _whole(choice)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
    extra = {k: body[k] for k in ("logit_bias", "temperature", "chat_template_kwargs") if k in body}
    resp = client.responses.create(model=body["model"], input=MESSAGES[0]["content"], text=fmt,
                                   max_output_tokens=body["max_tokens"], extra_body=extra)
    msg = choice["message"]
    items = [("reasoning", msg["reasoning"])] if msg["reasoning"] else []
    assert _whole_items(resp) == items + [("message", msg["content"])]
    streamed, _ = _streamed(client.responses.create(model=body["model"], input=MESSAGES[0]["content"], text=fmt,
                                                    max_output_tokens=body["max_tokens"], extra_body=extra,
                                                    stream=True))
    assert streamed == _whole_items(resp)
    return choice, msg


def test_reasoning_then_json_through_every_route(world):
    srv, key, tok, model = world
    end = tok.convert_tokens_to_ids(END_THINK)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    path: list[int] = []
    bias = end_bias(model, prompt, end, NO_SPACE, path=path)
    assert bias is not None
    body = {"model": srv.app.state.ctx.served_model_name, "messages": MESSAGES, "temperature": 0, "max_tokens": 60,
            "logit_bias": {str(t): b for t, b in {**NO_SPACE, end: bias}.items()},
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}
    choice, msg = _answers(srv, key, body)
    assert choice["finish_reason"] == "stop"
    assert msg["reasoning"] == msg["reasoning_content"] == tok.decode(path)
    assert not msg["reasoning"].lstrip().startswith("{")  # a grammar from the first token forbids it
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)


def test_prompt_closed_reasoning_gives_json_from_the_first_token(world):
    """The template's empty thinking block (enable_thinking false): however strongly the model
    is pushed to the tags, the answer is JSON from its first token, with no reasoning."""
    srv, key, tok, model = world
    push = {tok.convert_tokens_to_ids(THINK): 100.0, tok.convert_tokens_to_ids(END_THINK): 100.0}
    body = {"model": srv.app.state.ctx.served_model_name, "messages": MESSAGES, "temperature": 0, "max_tokens": 60,
            "logit_bias": {str(t): b for t, b in {**NO_SPACE, **push}.items()},
            "chat_template_kwargs": {"enable_thinking": False},
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}
    choice, msg = _answers(srv, key, body)
    assert choice["finish_reason"] == "stop" and msg["reasoning"] is None
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)
