"""Responses logprobs where the text and the tokens do not line up, over a scripted engine (one
token per piece, each with a logprob the test sets): whitespace the stream holds back before
the message opens, and an end token that writes no text. The whole answer's ``output_text``
part and the stream's (its done events, its deltas joined) hold every token's entry, in order.
Against a real model: tests/server/test_responses_logprobs_real.py."""

from __future__ import annotations

import asyncio

from loraplex.engine.outputs import CompletionOutput, RequestOutput
from tests.server.scripted_engine import ScriptedEngine
from tests.server.test_responses_fake import _client

PIECES = ["\n", " ", "Hi", " there", ""]  # "": the end token, which writes nothing
LOGPROBS = [-0.25 * (k + 1) for k in range(len(PIECES))]


class LogprobScriptedEngine(ScriptedEngine):
    """The scripted pieces, piece ``k`` one token whose logprob is ``LOGPROBS[k]`` (one
    alternative, 1.0 less likely)."""

    async def generate(self, prompt, params, request_id=None, **kwargs):
        self.started.append((request_id, None))
        for k, piece in enumerate(PIECES):
            await asyncio.sleep(0)
            token = 10 + k
            lp = [{"token_id": token, "logprob": LOGPROBS[k],
                   "top_logprobs": {token: LOGPROBS[k], 40: LOGPROBS[k] - 1.0}}]
            last = k == len(PIECES) - 1
            out = CompletionOutput(0, piece, [token], "stop" if last else None, lp, None)
            yield RequestOutput(request_id, None, list(prompt), [out], last, None)


def _values(entries) -> list[tuple[float, list[float]]]:
    return [(e.logprob, [t.logprob for t in e.top_logprobs]) for e in entries]


def test_every_token_has_its_entry_whole_and_streamed(server_factory):
    srv = server_factory(LogprobScriptedEngine(max_model_len=4096))
    client = _client(srv, "lp")
    body = dict(model="fake-model", input="hi", include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**body)
    want = [(lp, [lp, lp - 1.0]) for lp in LOGPROBS]
    assert whole.output_text == "".join(PIECES)
    assert _values(whole.output[0].content[0].logprobs) == want

    events = list(client.responses.create(**body, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == "".join(PIECES)
    assert _values([lp for e in deltas for lp in e.logprobs]) == want
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    (part_done,) = [e for e in events if e.type == "response.content_part.done"]
    assert _values(done.logprobs) == want and _values(part_done.part.logprobs) == want
    assert ([e.model_dump() for e in events[-1].response.output[0].content[0].logprobs]
            == [e.model_dump() for e in whole.output[0].content[0].logprobs])
