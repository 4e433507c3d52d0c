"""``tool_choice: "auto"`` and reasoning over HTTP, on a fake engine that emits scripted model
text: the OpenAI chat contract whole and streamed (the stream joined equals the whole answer for
the same engine output, cut at awkward places), the openai client reading ``tool_calls`` and
the reasoning field, the 400 without ``--tool-call-parser``, and a multi-turn agent loop whose
tool-call history the chat template renders."""

from __future__ import annotations

import json
import re

import jinja2
import openai
import pytest

from loraplex.cli import build_parser
from loraplex.config import Settings
from loraplex.server.app import create_app
from loraplex.server.cli import settings_from_args
from tests.server.fakes import FakeTokenizer
from tests.server.scripted_engine import ScriptedEngine
from tests.server.test_errors_fake import _envelope

PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": PLACE}}]
USER = [{"role": "user", "content": "Weather in Oslo?"}]
CHAT = {"model": "fake-model", "messages": USER, "tools": TOOLS}
PATH = "/v1/chat/completions"

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
# the same output as the engine might hand it over: cut inside the marker and inside the JSON
PIECES = ["Let me check.\n<tool", "_call>\n{\"na", "me\": \"get_weather\", \"argu", "ments\": {\"ci",
          "ty\": \"Os", "lo\"}}\n</tool_", "call>"]


def _sse(r) -> list[dict]:
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _join(chunks, index=0) -> tuple:
    """A choice's stream accumulated as the openai client does: content, reasoning, calls,
    finish reasons."""
    content, reasoning, calls, reasons = "", "", {}, []
    for ch in chunks:
        (c,) = ch["choices"]
        if c["index"] != index:
            continue
        d = c["delta"]
        content += d.get("content") or ""
        reasoning += d.get("reasoning") or ""
        assert d.get("reasoning") == d.get("reasoning_content")
        for entry in d.get("tool_calls", []):
            if "id" in entry:
                calls[entry["index"]] = [entry["function"]["name"], entry["function"]["arguments"]]
            else:
                calls[entry["index"]][1] += entry["function"]["arguments"]
        if c["finish_reason"]:
            assert d == {}  # the finish reason on a chunk of its own
            reasons.append(c["finish_reason"])
    return content or None, reasoning or None, [tuple(calls[k]) for k in sorted(calls)], reasons


def _whole(choice) -> tuple:
    msg = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    return msg["content"], msg.get("reasoning"), calls, [choice["finish_reason"]]


@pytest.fixture
def serve(server_factory):
    def make(*scripts, **settings):
        srv = server_factory(ScriptedEngine(*scripts), **settings)
        return srv, srv.tenant_client(srv.make_tenant("agent"))
    return make


def test_auto_call_whole_and_streamed(serve):
    srv, c = serve(PIECES, PIECES, tool_call_parser="hermes")
    r = c.post(PATH, json={**CHAT, "n": 1})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    msg = choice["message"]
    assert msg["role"] == "assistant" and msg["content"] == "Let me check.\n"
    (call,) = msg["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert choice["finish_reason"] == "tool_calls"
    # vLLM lets hermes markers through as text (they are special tokens in Hermes models)
    assert srv.engine.params_seen[srv.engine.started[-1][0]].skip_special_tokens is False
    chunks = _sse(c.post(PATH, json={**CHAT, "stream": True}))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert _join(chunks) == _whole(choice)
    first_call = next(ch for ch in chunks if ch["choices"][0]["delta"].get("tool_calls"))
    assert first_call["choices"][0]["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}


@pytest.mark.parametrize("parser,pieces,content,calls", [
    ("hermes", ["The weather is ", "nice. <tool", "box> is not a tag"],
     "The weather is nice. <toolbox> is not a tag", []),
    # a call that does not parse (here, no name ever comes, so the stream never announced it)
    ("hermes", ['Sure. <tool_call>{"function": "get_wea', 'ther"}</tool_call>'],
     'Sure. <tool_call>{"function": "get_weather"}</tool_call>', []),
    ("llama3_json", ['<|python_tag|>{"name": "get_weather", "para', 'meters": {"city": "Oslo"}}; {"name": "get_',
                     'weather", "parameters": {"city": "Rome"}}'],
     None, [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')]),
    ("llama3_json", ["Oslo is ", "sunny."], "Oslo is sunny.", []),
])
def test_auto_outputs_whole_and_streamed(serve, parser, pieces, content, calls):
    srv, c = serve(*[pieces] * 4, tool_call_parser=parser)
    for body in ({**CHAT}, {**CHAT, "tool_choice": "auto"}):
        choice = c.post(PATH, json=body).json()["choices"][0]
        assert _whole(choice) == (content, None, calls, ["tool_calls" if calls else "stop"])
        assert _join(_sse(c.post(PATH, json={**body, "stream": True}))) == _whole(choice)


def test_length_stays_length_and_n_choices_each_read(serve):
    pieces = ['<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>', " ok"]
    srv, c = serve(pieces, pieces, tool_call_parser="hermes")
    r = c.post(PATH, json={**CHAT, "max_tokens": 2, "n": 2})
    for choice in r.json()["choices"]:
        assert _whole(choice) == (None, None, [("get_weather", '{"city": "Oslo"}')], ["length"])
    chunks = _sse(c.post(PATH, json={**CHAT, "max_tokens": 2, "n": 2, "stream": True}))
    for i in range(2):
        assert _join(chunks, i) == _whole(r.json()["choices"][i])


def test_parallel_tool_calls_false_answers_the_first_call(serve):
    two = [CALL_TEXT, CALL_TEXT.replace("Oslo", "Rome")]
    srv, c = serve(two, two, tool_call_parser="hermes")
    body = {**CHAT, "parallel_tool_calls": False}
    choice = c.post(PATH, json=body).json()["choices"][0]
    assert _whole(choice) == (None, None, [("get_weather", '{"city": "Oslo"}')], ["tool_calls"])
    assert _join(_sse(c.post(PATH, json={**body, "stream": True}))) == _whole(choice)


def test_without_a_parser_auto_is_a_400_naming_the_flag(serve):
    srv, c = serve()
    for body, param in (({**CHAT}, "tools"), ({**CHAT, "tool_choice": "auto"}, "tool_choice")):
        for stream in (False, True):
            err = _envelope(c.post(PATH, json={**body, "stream": stream}), 400, code="unsupported_parameter",
                            param=param)
            assert "--tool-call-parser" in err["message"]
    assert not srv.engine.started


def test_none_and_named_choices_are_not_read_by_the_parsers(serve):
    """"none" asks for no call: the text stays content; a named choice keeps its constraint and
    its own answer, read by no tool-call parser (reasoning before it: test_reasoned_constraints_fake.py)."""
    srv, c = serve([CALL_TEXT], ['{"city": ', '"Oslo"}'], tool_call_parser="hermes", reasoning_parser="qwen3")
    msg = c.post(PATH, json={**CHAT, "tool_choice": "none"}).json()["choices"][0]["message"]
    assert msg["content"] == CALL_TEXT and "tool_calls" not in msg and msg["reasoning"] is None
    assert srv.engine.params_seen[srv.engine.started[-1][0]].skip_special_tokens is True
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = c.post(PATH, json={**CHAT, "tool_choice": named}).json()["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert choice["message"]["reasoning"] is None and choice["finish_reason"] == "stop"


THINK = ["<think>\nThe user asks", " about Oslo.\n</th", "ink>\n\nIt is ", "sunny."]


def test_reasoning_whole_streamed_and_completions_untouched(serve):
    srv, c = serve(THINK, THINK, THINK, reasoning_parser="qwen3")
    choice = c.post(PATH, json={"model": "fake-model", "messages": USER}).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "\n\nIt is sunny.",
                                 "reasoning": "\nThe user asks about Oslo.\n",
                                 "reasoning_content": "\nThe user asks about Oslo.\n"}
    chunks = _sse(c.post(PATH, json={"model": "fake-model", "messages": USER, "stream": True}))
    assert _join(chunks) == _whole(choice)
    # completions return the raw text, as vLLM's do
    r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 10})
    assert r.json()["choices"][0]["text"] == "".join(THINK)


def test_openai_client_reads_tool_calls_and_reasoning(serve):
    text = ["<think>\nNeed the weather.\n</think>\n\n", CALL_TEXT[:20], CALL_TEXT[20:]]
    srv, c = serve(text, text, tool_call_parser="hermes", reasoning_parser="qwen3")
    key = c.headers["Authorization"].split(" ", 1)[1]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
    resp = client.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert msg.reasoning == msg.reasoning_content == "\nNeed the weather.\n"  # extra fields the client keeps
    name, args, reasoning = None, "", ""
    for chunk in client.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning", None) or ""
        for tc in delta.tool_calls or []:
            name = tc.function.name or name
            args += tc.function.arguments or ""
    assert (name, args, reasoning) == ("get_weather", msg.tool_calls[0].function.arguments, msg.reasoning)


# A chat template in the style of Qwen2.5's: tools in the system turn, earlier calls as
# <tool_call> blocks, tool results as <tool_response> blocks
QWEN_STYLE = jinja2.Environment().from_string(
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t.function.name }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class QwenStyleTokenizer(FakeTokenizer):
    """Renders with QWEN_STYLE and keeps what it rendered."""

    def __init__(self):
        self.rendered: list[str] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, tools=None):
        text = QWEN_STYLE.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        self.rendered.append(text)
        return text


def test_multi_turn_agent_loop(server_factory):
    engine = ScriptedEngine([CALL_TEXT], ["It is sunny in Oslo."], max_model_len=1024)
    engine.tokenizer = QwenStyleTokenizer()
    srv = server_factory(engine, tool_call_parser="hermes")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.make_tenant("loop"), max_retries=0)
    messages = list(USER)
    first = client.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS).choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    messages.append(first.message.model_dump(exclude_none=True))  # as agent frameworks send it back
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
    second = client.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS).choices[0]
    assert (second.finish_reason, second.message.content, second.message.tool_calls) == (
        "stop", "It is sunny in Oslo.", None)
    prompt = engine.tokenizer.rendered[-1]
    assert ('<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in prompt
    assert prompt.startswith("<|im_start|>system\n<tools>\nget_weather\n</tools>")


def test_parser_flags_and_startup_check(tmp_path, capsys):
    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json", "--reasoning-parser",
                                      "deepseek_r1"])
    s = settings_from_args(args)
    assert (s.tool_call_parser, s.reasoning_parser) == ("llama3_json", "deepseek_r1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    assert "hermes" in capsys.readouterr().err  # argparse lists the choices
    # the same names from the environment (LORAPLEX_TOOL_CALL_PARSER): checked when the app is made
    with pytest.raises(ValueError, match="known: hermes, llama3_json"):
        create_app(Settings(home=tmp_path, tool_call_parser="mistral"))
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        create_app(Settings(home=tmp_path, reasoning_parser="r1"))


class Qwen3StyleTokenizer(FakeTokenizer):
    """One token per character (any character) but ``<think>`` and ``</think>``, one token each as
    in Qwen3's vocabulary, and a template that, as Qwen3's, writes an empty think block after the
    assistant header when ``enable_thinking`` is false."""

    TAGS = {"<think>": 0x110000 + 3, "</think>": 0x110000 + 4}

    def __len__(self) -> int:
        return 0x110000 + 5

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = []
        for part in re.split("(</?think>)", text):
            ids += [self.TAGS[part]] if part in self.TAGS else [ord(c) + 3 for c in part]
        return {"input_ids": ids}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.TAGS)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        tags = {i: tag for tag, i in self.TAGS.items()}
        return "".join(tags.get(i) or chr(i - 3) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, tools=None, **kwargs):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        text += "<|im_start|>assistant\n"
        return text + ("<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False else "")


def test_a_prompt_that_closes_the_think_block_makes_the_output_content(server_factory):
    """Qwen3 with ``enable_thinking: false``: the template closes the think block in the prompt,
    so nothing the model writes is reasoning (vLLM reads the prompt's end the same way)."""
    text = ["<think>Not reasoning</think>", "answer"]
    engine = ScriptedEngine(text, text, max_model_len=1024)
    engine.tokenizer = Qwen3StyleTokenizer()
    srv = server_factory(engine, reasoning_parser="qwen3")
    with srv.tenant_client(srv.make_tenant("think")) as c:
        body = {"model": "fake-model", "messages": USER}
        msg = c.post(PATH, json=body).json()["choices"][0]["message"]
        assert (msg["reasoning"], msg["content"]) == ("Not reasoning", "answer")
        off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
        msg = c.post(PATH, json=off).json()["choices"][0]["message"]
        assert (msg["reasoning"], msg["content"]) == (None, "<think>Not reasoning</think>answer")
