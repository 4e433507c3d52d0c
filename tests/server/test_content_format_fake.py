"""``--chat-template-content-format`` over the HTTP layer (fake engine, real tiny tokenizer): the
prompt the engine gets for multi-part text content is transformers' ``apply_chat_template`` over
the messages as vLLM would hand them to that template (texts joined with "\\n" for a string
template, the parts list for one that loops over content), on ``/v1/chat/completions``,
``/v1/responses``, ``/tokenize`` and a batch file; ``auto`` picks each template's format,
``string`` and ``openai`` override it; a non-text part is a 400 that starts nothing."""

from __future__ import annotations

import asyncio
import json

import pytest

from loraplex.config import Settings
from loraplex.server.app import new_context, use_parts
from loraplex.server.batch_file import parse_lines
from loraplex.server.batch_runner import run_lines
from loraplex.server.tenant_limits import TenantLimitsCache
from tests.fixtures.chat_templates import GEMMA3_LIKE, TEMPLATES, smollm2_template
from tests.server.fakes import FakeEngine
from tests.server.conftest import start_server
from tests.server.prompt_field_servers import Tenant, bos_tokenizer

TEXTS = ["  Name a colour. ", " One word only.  "]
PARTS = [{"type": "text", "text": t} for t in TEXTS]
SYSTEM = [{"type": "text", "text": " be brief "}, {"type": "text", "text": "please"}]
# (role, texts or a string): the conversation every test sends, built into either shape below
TURNS = [("system", [" be brief ", "please"]), ("user", TEXTS), ("assistant", "Blue."), ("user", ["And", "another?"])]
MAX_MODEL_LEN = 1024
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def as_sent(turns=TURNS) -> list[dict]:
    """The OpenAI messages: text parts where the turn has several texts."""
    return [{"role": r, "content": c if isinstance(c, str) else [{"type": "text", "text": t} for t in c]}
            for r, c in turns]


def as_vllm_hands_them(fmt: str, turns=TURNS) -> list[dict]:
    """The messages vLLM gives the template in format ``fmt``: written out here from its rules
    (vllm/entrypoints/chat_utils.py), not by loraplex."""
    out = []
    for role, content in turns:
        texts = [content] if isinstance(content, str) else content
        out.append({"role": role, "content": "\n".join(texts) if fmt == "string"
                    else [{"type": "text", "text": t} for t in texts]})
    return out


def reference_ids(template: str, messages: list[dict]) -> list[int]:
    tok = bos_tokenizer(template)
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def all_templates() -> dict[str, tuple[str, str]]:
    found = dict(TEMPLATES)
    smollm2 = smollm2_template()
    if smollm2 is not None:
        found["smollm2"] = (smollm2, "string")
    return found


def serve(tmp_path_factory, option: str):
    """A tenant whose tokenizer's template takes parts; every other template comes with the
    request. The context holds Llama 3's long headers, one token a byte."""
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    engine.tokenizer = bos_tokenizer(GEMMA3_LIKE)
    srv = start_server(tmp_path_factory.mktemp(option), engine, trust_request_chat_template=True,
                       chat_template_content_format=option)
    key = srv.make_tenant("acme")
    sha = srv.upload("acme", "sql", b"w", config=b"{}")["sha256"]
    tenant = Tenant(srv, srv.tenant_client(key), sha)
    try:
        yield tenant
    finally:
        tenant.client.close()
        srv.stop()


@pytest.fixture(scope="module")
def auto(tmp_path_factory):
    yield from serve(tmp_path_factory, "auto")


@pytest.fixture(scope="module")
def string(tmp_path_factory):
    yield from serve(tmp_path_factory, "string")


@pytest.fixture(scope="module")
def openai(tmp_path_factory):
    yield from serve(tmp_path_factory, "openai")


def chat(t: Tenant, messages, **fields) -> list[int]:
    r = t.client.post("/v1/chat/completions", json={"model": "sql", "messages": messages, "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    return t.last_prompt()


@pytest.mark.parametrize("name", sorted(all_templates()))
def test_auto_renders_each_template_as_vllm_would(auto, name):
    template, fmt = all_templates()[name]
    ids = chat(auto, as_sent(), chat_template=template)
    assert ids == reference_ids(template, as_vllm_hands_them(fmt))
    other = "openai" if fmt == "string" else "string"
    try:  # the format chosen matters here: the other one renders differently, or not at all
        assert ids != reference_ids(template, as_vllm_hands_them(other))
    except TypeError:
        pass


def test_auto_reads_the_tokenizers_own_template(auto):
    ids = chat(auto, as_sent())
    assert ids == reference_ids(GEMMA3_LIKE, as_vllm_hands_them("openai"))
    # Gemma 3 trims each part: the parts run together, where a joined string keeps the newline
    assert "<start_of_turn>user\nName a colour.One word only.<end_of_turn>" in bos_tokenizer().decode(ids)


@pytest.mark.parametrize("fixture, fmt", [("string", "string"), ("openai", "openai")])
@pytest.mark.parametrize("name", ["gemma3", "llama3", "tiny_fixture", "qwen2_vl"])
def test_an_explicit_format_overrides_detection(request, fixture, fmt, name):
    t = request.getfixturevalue(fixture)
    template = TEMPLATES[name][0]
    assert chat(t, as_sent(), chat_template=template) == reference_ids(template, as_vllm_hands_them(fmt))


def test_openai_forced_on_a_template_that_adds_strings_is_a_400(openai):
    concat = "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}"
    started = len(openai.srv.engine.started)
    r = openai.client.post("/v1/chat/completions", json={"model": "sql", "messages": as_sent(), "chat_template": concat})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "cannot render" in r.json()["error"]["message"]
    assert len(openai.srv.engine.started) == started


def test_string_content_is_unchanged_for_a_string_template(auto, string):
    turns = [(r, c if isinstance(c, str) else "".join(c)) for r, c in TURNS]  # one string each
    for name in ("llama3", "tiny_fixture"):
        template = TEMPLATES[name][0]
        want = reference_ids(template, as_sent(turns))  # the messages exactly as sent
        assert chat(auto, as_sent(turns), chat_template=template) == want
        assert chat(string, as_sent(turns), chat_template=template) == want


def test_string_content_is_one_text_part_for_a_parts_template(auto):
    turns = [("user", "  hello  ")]
    ids = chat(auto, as_sent(turns))
    assert ids == reference_ids(GEMMA3_LIKE, [{"role": "user", "content": [{"type": "text", "text": "  hello  "}]}])


def test_tokenize_renders_as_chat_does(auto, string):
    for t, fmt in ((auto, "openai"), (string, "string")):
        r = t.client.post("/tokenize", json={"model": "sql", "messages": as_sent()})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == reference_ids(GEMMA3_LIKE, as_vllm_hands_them(fmt))
    llama = TEMPLATES["llama3"][0]
    r = auto.client.post("/tokenize", json={"model": "sql", "messages": as_sent(), "chat_template": llama})
    assert r.json()["tokens"] == reference_ids(llama, as_vllm_hands_them("string"))


def test_responses_input_text_parts_render_as_chat_text_parts(auto):
    """vLLM passes a message item's input_text / output_text parts to its chat parser as text
    parts; a function_call_output's parts become the tool message's text, joined with "\\n"."""
    items = [{"role": "system", "content": [{"type": "input_text", "text": t} for t in TURNS[0][1]]},
             {"role": "user", "content": [{"type": "input_text", "text": t} for t in TEXTS]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": [{"type": "input_text", "text": t} for t in TURNS[3][1]]}]
    for name in ("gemma3", "llama3"):
        template, fmt = TEMPLATES[name]
        r = auto.client.post("/v1/responses", json={"model": "sql", "input": items, "max_output_tokens": 1,
                                                    "chat_template": template})
        assert r.status_code == 200, r.text
        assert auto.last_prompt() == reference_ids(template, as_vllm_hands_them(fmt))


def test_a_tool_result_of_parts_is_one_string_in_both_formats(auto):
    qwen = TEMPLATES["qwen2_vl"][0]  # takes parts, and prints a string content as it is
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": PARTS}]
    want = [{"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": [], "tool_calls": [{**call, "function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "\n".join(TEXTS)}]
    assert chat(auto, messages, chat_template=qwen) == reference_ids(qwen, want)


def test_a_refusal_part_of_an_earlier_answer_renders_as_its_text(auto):
    """The SDK's assistant message may hold ``{"type": "refusal", "refusal"}`` parts (an earlier
    answer's refusal sent back); vLLM's chat parser takes them as text, as it takes
    input_text / output_text. It was a 400."""
    for name in ("gemma3", "llama3"):
        template = TEMPLATES[name][0]
        sent = [{"role": "user", "content": "help me"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
                {"role": "user", "content": [{"type": "input_text", "text": "why?"}]}]
        as_text = [{"role": "user", "content": "help me"},
                   {"role": "assistant", "content": [{"type": "text", "text": "I can't help with that."}]},
                   {"role": "user", "content": [{"type": "text", "text": "why?"}]}]
        assert chat(auto, sent, chat_template=template) == chat(auto, as_text, chat_template=template)
    r = auto.client.post("/v1/chat/completions", json={"model": "sql", "max_tokens": 1, "messages": [
        {"role": "assistant", "content": [{"type": "refusal", "refusal": 5}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [PARTS[0], IMAGE]}]}, "messages[0].content"),
    ("/tokenize", {"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
])
def test_a_part_that_is_not_text_is_still_refused(auto, path, body, param):
    started = len(auto.srv.engine.started)
    r = auto.client.post(path, json={"model": "sql", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert len(auto.srv.engine.started) == started


def test_a_batch_file_renders_as_the_server_does(tmp_path):
    settings = Settings(home=tmp_path, chat_template_content_format="auto", blob_gc_interval_seconds=0)
    ctx = new_context(settings, tenant_limits=TenantLimitsCache(lambda name: None))
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    engine.tokenizer = bos_tokenizer(GEMMA3_LIKE)
    use_parts(ctx, engine, None, None)
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "fake-model", "messages": as_sent(), "max_tokens": 1}},
             {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "fake-model", "messages": [{"role": "user", "content": [IMAGE]}], "max_tokens": 1}}]
    out: list[dict] = []
    try:
        asyncio.run(run_lines(ctx, "batch", parse_lines("\n".join(json.dumps(x) for x in lines).encode()),
                              out.append, max_concurrency=2))
    finally:
        ctx.tokenizer_thread.shutdown(wait=False)
    assert [o["response"]["status_code"] if o.get("response") else None for o in out] == [200, 400]
    assert list(engine.prompts_seen.values()) == [reference_ids(GEMMA3_LIKE, as_vllm_hands_them("openai"))]
