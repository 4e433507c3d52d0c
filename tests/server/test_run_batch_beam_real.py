"""run-batch lines with vLLM's ``"use_beam_search": true``: each line's status and body are what
the HTTP server answers for the same body on the same weights (ids and timestamps aside), the
beams, a field beam search refuses (a 400 naming it) and an extreme length penalty included."""

from __future__ import annotations

from tests.server.test_run_batch_real import assert_same_answer, line, run_batch, server_answer, world  # noqa: F401


def test_beam_search_lines_answer_as_the_server_does(world):
    beam = {"use_beam_search": True, "n": 2, "max_tokens": 4}
    bodies = [
        ("/v1/completions", {"model": world.model, "prompt": "The quick brown fox", **beam}),
        ("/v1/completions", {"model": world.model, "prompt": ["a", "bc"], **beam, "length_penalty": 0.0}),
        ("/v1/chat/completions", {"model": world.model, "messages": [{"role": "user", "content": "hi"}],
                                  "use_beam_search": True, "n": 3, "max_completion_tokens": 3}),
        ("/v1/completions", {"model": world.model, "prompt": "x", **beam, "logprobs": 2}),
        ("/v1/completions", {"model": world.model, "prompt": "x", **beam, "length_penalty": 1e4}),
    ]
    out = {o["custom_id"]: o["response"] for o in run_batch(world, [line(str(i), u, b) for i, (u, b) in
                                                                    enumerate(bodies)])}
    for i, (url, body) in enumerate(bodies):
        theirs = server_answer(world, url, body)
        assert_same_answer(out[str(i)], theirs, str(i))
        assert theirs[0] == (400 if "logprobs" in body else 200), theirs
