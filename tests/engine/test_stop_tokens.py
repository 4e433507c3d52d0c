"""A sequence ended by one of ``stop_token_ids`` (or EOS) keeps the token in ``token_ids`` but
not its text, unless ``include_stop_str_in_output`` (vLLM's rule)."""

from __future__ import annotations

import random

import pytest

from tests.engine.scheduler_harness import reference_output
from tests.engine.test_engine_fake import greedy, make_engine


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
