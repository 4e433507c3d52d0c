"""A sequence ended by one of ``stop_token_ids`` (or EOS) keeps the token in ``token_ids`` but
not its text, unless ``include_stop_str_in_output`` (vLLM's rule)."""

from __future__ import annotations

import random

import pytest

from tests.engine.scheduler_harness import reference_output
from tests.engine.test_engine_fake import greedy, make_engine

MAX_TOKENS = 30


def _case(engine):
    tok = engine.tokenizer
    for seed in range(200):
        rng = random.Random(seed)
        prompt = [rng.randrange(4, 97) for _ in range(5)]
        ref = reference_output(prompt, 8)
        text = tok.decode(ref[:4], skip_special_tokens=True)
        if all(t >= 4 for t in ref[:4]) and ref[3] not in ref[:3] and len(text) == 4 and "\ufffd" not in text:
            return prompt, ref[:4], text
    pytest.fail("no case found")


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_left_out(include):
    engine = make_engine()
    prompt, ref, text = _case(engine)
    params = greedy(max_tokens=8, stop_token_ids=[ref[3]], include_stop_str_in_output=include)
    engine.add_request("s", prompt, params, stream_deltas=True)
    streamed, tokens, final = "", [], None
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.outputs[0].text
            tokens += out.outputs[0].token_ids
            final = out if out.finished else final
    comp = final.outputs[0]
    assert tokens == ref  # the stop token is generated (and counted)
    assert (comp.finish_reason, comp.stop_reason) == ("stop", ref[3])
    assert streamed == (text if include else text[:3])


def _repeating_case(engine):
    """A prompt whose greedy output is printable one-byte tokens, the one at index 1 coming
    back after index 4 (a stop string of it ends both inside and after 4 min_tokens)."""
    tok = engine.tokenizer
    for seed in range(2000):
        rng = random.Random(seed)
        prompt = [rng.randrange(4, 97) for _ in range(5)]
        ref = reference_output(prompt, MAX_TOKENS)
        pieces = [tok.decode([t]) if 36 <= t < 97 else None for t in ref]
        again = [i for i in range(5, MAX_TOKENS) if pieces[i] == pieces[1]]
        if pieces[1] is not None and pieces[1] != pieces[0] and again and None not in pieces[: again[0]]:
            return prompt, ref, pieces
    pytest.fail("no case found")


def test_min_tokens_holds_for_stop_strings():
    # vLLM's rule (vllm-project/vllm#22014): no stop string ends generation before min_tokens
    engine = make_engine()
    prompt, ref, pieces = _repeating_case(engine)
    stop = pieces[1]
    outs = {}
    for min_tokens in (0, 4):
        engine.add_request(f"m{min_tokens}", prompt, greedy(max_tokens=MAX_TOKENS, min_tokens=min_tokens, stop=[stop]))
    while engine.has_unfinished():
        outs.update({out.request_id: out.outputs[0] for out in engine.step() if out.finished})
    for min_tokens in (0, 4):
        comp = outs[f"m{min_tokens}"]
        # the first token after min_tokens whose text is the stop string ends the output
        k = next(i for i in range(min_tokens, len(pieces)) if pieces[i] == stop) + 1
        assert comp.token_ids == ref[:k]
        assert (comp.finish_reason, comp.stop_reason, comp.text) == ("stop", stop, "".join(pieces[: k - 1]))
