"""vLLM's ``stop_reason`` on completions and chat choices, on a real (tiny) engine through the
openai client: the stop string or the stop token id that ended a choice, null for EOS and the
length limit; streamed, on the finishing chunk (null on the others). The stop token is one that
transformers' greedy search picks, so the request really ends on it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures.tiny_models import EOS_ID
from tests.server.real_tiny_server import start_tiny_server

MESSAGES = [{"role": "user", "content": "go on"}]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tiny = start_tiny_server(tmp_path_factory, seed=9)
    yield tiny
    tiny.stop()


def _ask(tiny, kind: str, stream: bool, **kw) -> list[tuple]:
    """Per chunk (or the one answer): (text, finish_reason, stop_reason) of choice 0."""
    common = dict(model=tiny.model, max_tokens=8, temperature=0, stream=stream, **kw)
    if kind == "chat":
        out = tiny.client.chat.completions.create(messages=MESSAGES, **common)
    else:
        out = tiny.client.completions.create(prompt="go on", **common)
    answers = list(out) if stream else [out]
    rows = []
    for a in answers:
        c = a.choices[0]
        text = (c.delta.content if stream else c.message.content) if kind == "chat" else c.text
        rows.append((text, c.finish_reason, c.model_extra["stop_reason"]))
    return rows


def _prompt_ids(tiny, kind: str) -> list[int]:
    tok = AutoTokenizer.from_pretrained(tiny.folder)
    if kind == "chat":
        return tok(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
    return tok("go on")["input_ids"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stop_reason_names_what_ended_the_choice(world, kind):
    hf = AutoModelForCausalLM.from_pretrained(world.folder, dtype=torch.float32).eval()
    ids = _prompt_ids(world, kind)
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(ids):]
    k = next(i for i, t in enumerate(greedy.tolist()) if t not in greedy[:i].tolist() and t != EOS_ID and i >= 1)
    stop_token = int(greedy[k])
    for stream in (False, True):
        (*_, last) = rows = _ask(world, kind, stream, extra_body={"stop_token_ids": [stop_token], "ignore_eos": True})
        assert last[1:] == ("stop", stop_token)
        assert all(r[2] is None for r in rows[:-1] if r[1] is None)  # only the finishing chunk names it
        (*_, last) = _ask(world, kind, stream, extra_body={"ignore_eos": True})
        assert last[1:] == ("length", None)
        (*_, last) = _ask(world, kind, stream, logit_bias={str(EOS_ID): 100})
        assert last[1:] == ("stop", None)  # EOS: no stop string or stop token (vLLM's null)
    text = _ask(world, kind, False, extra_body={"ignore_eos": True})[0][0]
    stop = text[2:4]
    for stream in (False, True):
        (*_, last) = _ask(world, kind, stream, stop=[stop, "never-seen"], extra_body={"ignore_eos": True})
        assert last[1:] == ("stop", stop)
