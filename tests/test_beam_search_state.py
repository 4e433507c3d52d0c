"""The beam search state (loraplex/beam_search.py) on scripted candidates, for the cases the
model-based tests rarely reach: every candidate ends the beam, a step request that ended without
a token, the context's room bounding the steps; and vLLM's scoring written out by hand."""

from __future__ import annotations

import math

import pytest

from loraplex.beam_search import BeamSearch, BeamSearchParams, beam_search_score, step_candidates
from loraplex.sampling_params import InvalidRequestError

EOS = 1


def test_a_search_whose_candidates_all_end_stops_and_ranks_them_by_vllms_score():
    search = BeamSearch([7, 8, 9], BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=2.0), {EOS, 2})
    search.advance([{EOS: -0.5, 2: -0.25}])
    assert search.done and search.live == []
    best = search.best()
    # both end on an EOS token: length 3 (the prompt) for both, so the higher logprob wins
    assert [(b.output_token_ids, b.finish_reason, b.stop_reason) for b in best] == [([2], "stop", 2), ([EOS], "stop", EOS)]
    assert beam_search_score(best[0], 2.0) == pytest.approx(-0.25 / 3 ** 2)


def test_length_penalty_can_prefer_a_longer_live_beam_over_a_finished_one():
    params = BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=1.0)
    search = BeamSearch([5], params, {EOS})
    search.advance([{EOS: -1.0, 3: -1.1}])
    search.advance([{4: -0.2, EOS: -5.0}])
    best = search.best()[0]
    # finished [EOS]: -1.0 / 1; live [3, 4]: -1.3 / 3 -> the live one (vLLM: prompt in the length)
    assert best.output_token_ids == [3, 4] and best.finish_reason == "length"
    assert best.cum_logprob == pytest.approx(-1.3)
    assert beam_search_score(best, 1.0) == pytest.approx(-1.3 / 3)
    assert len(search.finished) == 2  # every EOS candidate is kept, as vLLM's


def test_live_beams_keep_the_best_width_candidates_across_beams():
    search = BeamSearch([5], BeamSearchParams(beam_width=2, max_tokens=3), {EOS})
    search.advance([{10: -0.1, 11: -0.2, 12: -3.0}])
    search.advance([{20: -2.0, 21: -2.5}, {30: -0.3, 31: -0.4}])
    assert [(b.output_token_ids, round(b.cum_logprob, 6)) for b in search.live] == [([11, 30], -0.5), ([11, 31], -0.6)]


def test_a_beam_whose_step_ended_without_a_token_is_dropped():
    search = BeamSearch([5], BeamSearchParams(beam_width=2, max_tokens=3), {EOS})
    search.advance([{10: -0.1, 11: -0.2}])
    search.advance([None, {30: -0.3}])
    assert [b.output_token_ids for b in search.live] == [[11, 30]]
    with pytest.raises(ValueError):
        search.advance([None, None])


def test_the_context_bounds_the_steps_and_ignore_eos_keeps_eos_beams_alive():
    search = BeamSearch([5, 6], BeamSearchParams(beam_width=1, max_tokens=50, ignore_eos=True), {EOS}, max_steps=2)
    search.advance([{EOS: -0.1}])
    assert not search.done and search.live[0].output_token_ids == [EOS]
    search.advance([{EOS: -0.1}])
    assert search.done and search.best()[0].finish_reason == "length"


def test_step_candidates_are_the_top_logprobs_and_the_chosen_token():
    assert step_candidates([{"token_id": 3, "logprob": -0.5, "top_logprobs": {3: -0.5, 4: -1.0}}]) == {3: -0.5, 4: -1.0}
    assert step_candidates([{"token_id": 9, "logprob": -2.0, "top_logprobs": {3: -0.5}}]) == {3: -0.5, 9: -2.0}
    assert step_candidates([]) is None and step_candidates(None) is None


@pytest.mark.parametrize("kwargs,param", [
    ({"beam_width": 0}, "beam_width"), ({"beam_width": True}, "beam_width"), ({"max_tokens": 0}, "max_tokens"),
    ({"length_penalty": math.inf}, "length_penalty"), ({"length_penalty": "1"}, "length_penalty"),
    ({"temperature": -1}, "temperature"),
])
def test_bad_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    assert info.value.param == param


def test_neutral_sampling_fields_pass_and_others_are_refused():
    from loraplex.server.beam_fields import parse_beam_search
    from loraplex.server.errors import APIError

    neutral = {"use_beam_search": True, "top_p": 1, "top_k": -1, "min_p": 0.0, "stop": [], "logprobs": None,
               "echo": False, "response_format": {"type": "text"}, "early_stopping": False, "length_penalty": 0.6}
    assert parse_beam_search(neutral, "completion").length_penalty == 0.6
    assert parse_beam_search({"use_beam_search": False, "stop": "x"}, "completion") is None
    for body, param in (({"top_p": 0.9}, "top_p"), ({"logprobs": 0}, "logprobs"), ({"seed": 1}, "seed"),
                        ({"stop": "x"}, "stop"), ({"min_tokens": True}, "min_tokens")):
        with pytest.raises(APIError) as info:
            parse_beam_search({"use_beam_search": True, **body}, "completion")
        assert (info.value.status, info.value.param) == (400, param)


class _ScriptedEngine:
    """``AsyncLLMEngine.generate``'s shape over scripted candidates: the next-token logprobs of a
    sequence depend on its last token; a sequence reaching ``abort_at`` tokens is aborted."""

    def __init__(self, table: dict[int, dict[int, float]], abort_at: int | None = None):
        self.table, self.abort_at, self.requests = table, abort_at, []

    async def generate(self, prompt, params, request_id=None, **kwargs):
        from loraplex.engine.outputs import CompletionOutput, RequestOutput

        self.requests.append((request_id, list(prompt), params.logprobs))
        if self.abort_at is not None and len(prompt) >= self.abort_at:
            yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "", [], "abort")], True)
            return
        top = dict(sorted(self.table[prompt[-1]].items(), key=lambda kv: -kv[1])[: params.logprobs])
        best = max(top, key=top.get)
        entry = {"token_id": best, "logprob": top[best], "top_logprobs": top}
        yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "", [best], "length", [entry])], True)


class _Tok:
    def decode(self, ids):
        return ",".join(map(str, ids))


def _drive(engine, prompt, params):
    import asyncio

    from loraplex.engine.beam_search_async import beam_search_outputs

    async def main():
        return [out async for out in beam_search_outputs(engine, prompt, params, request_id="r", eos_token_ids={EOS},
                                                          tokenizer=_Tok(), vocab_size=10, max_model_len=64)]
    return asyncio.run(main())


TABLE = {5: {6: -0.1, EOS: -0.3, 7: -2.0}, 6: {EOS: -0.05, 6: -3.0, 8: -3.5}, 7: {8: -0.1, EOS: -1.0},
         8: {8: -0.2, EOS: -2.0}, EOS: {8: -0.1}}


def test_the_async_driver_shapes_vllms_online_output():
    engine = _ScriptedEngine(TABLE)
    (out,) = _drive(engine, [5], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0))
    # by hand: finished [6, EOS] -0.15 and [EOS] -0.3 beat every live beam (-2.0 and below)
    assert [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs] == \
        [(0, [6], "6", "stop", EOS), (1, [], "", "stop", EOS)]
    assert {logprobs for _, _, logprobs in engine.requests} == {4}  # 2 x beam_width candidates per step
    assert engine.requests[0][0] == "r-beam0.0" and len({rid for rid, _, _ in engine.requests}) == len(engine.requests)
    (kept,) = _drive(_ScriptedEngine(TABLE), [5], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0,
                                                                     include_stop_str_in_output=True))
    assert [(c.token_ids, c.text) for c in kept.outputs] == [([6, EOS], "6"), ([EOS], "")]


def test_an_aborted_step_ends_the_search_as_aborted():
    engine = _ScriptedEngine(TABLE, abort_at=3)
    (out,) = _drive(engine, [5], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"]
    assert max(len(p) for _, p, _ in engine.requests) == 3  # nothing was asked after the aborted step


def _exact_score(beam, length_penalty: float):
    """vLLM's score in exact decimal arithmetic (no float overflow or underflow), as the reference."""
    from decimal import MAX_EMAX, MIN_EMIN, Decimal, localcontext

    length = len(beam.tokens) - (1 if beam.finish_reason == "stop" else 0)
    with localcontext() as ctx:
        ctx.prec, ctx.Emax, ctx.Emin = 60, MAX_EMAX, MIN_EMIN
        return Decimal(beam.cum_logprob) / Decimal(length) ** Decimal(length_penalty)


@pytest.mark.parametrize("length_penalty", [1000.0, 1e6, -1000.0, -1e6, 350.0])
def test_extreme_length_penalties_rank_as_the_exact_score_does(length_penalty):
    """A length penalty whose ``length ** penalty`` leaves the float range (any |penalty| in the
    hundreds with a prompt of a few tokens) ranks the beams as exact arithmetic does, rather than
    raising (OverflowError / ZeroDivisionError: a 500 after the whole search ran)."""
    params = BeamSearchParams(beam_width=3, max_tokens=3, length_penalty=length_penalty)
    search = BeamSearch(list(range(10, 30)), params, {EOS})
    search.advance([{EOS: -0.5, 3: -0.7, 4: -2.0, 5: -0.9}])
    search.advance([{EOS: -0.3, 6: -0.1}, {7: -0.2, EOS: -1.5}, {8: -0.05}])
    search.advance([{9: -0.4}, {EOS: -0.6, 10: -0.01}, {11: -0.3}])
    beams = search.finished + search.live
    best = search.best()
    expected = sorted(beams, key=lambda b: _exact_score(b, length_penalty), reverse=True)[:3]
    assert [_exact_score(b, length_penalty) for b in best] == [_exact_score(b, length_penalty) for b in expected]
