"""``RequestState.make_output`` for a one-sequence request (its fast path) against the general
loop over sequences (``_tracks_output``): two copies of a request driven through the same
random events (tokens arriving one or several at a time, steps with nothing new, stop strings
held back and cut, logprobs, preemptions, every finish reason), one asked through each path,
deltas and cumulative outputs. Every output must be equal (the finish time is a clock read:
only whether it is set is compared)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from loraplex.engine.request_state import PreparedRequest, RequestState
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.sampling_params import SamplingParams
from tests.fixtures.tiny_models import make_tiny_tokenizer

WORDS = ["hello", " wörld", " END", "E", "N", "D", " 😀", " ok", "zz", "\n"]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def make_request(tok, params: SamplingParams, stream_deltas: bool) -> tuple[RequestState, Sequence]:
    prompt = tok("a prompt:")["input_ids"]
    req = PreparedRequest("r", "a prompt:", prompt, params, "adapter-sha", stream_deltas, arrival_time=5.0)
    seq = Sequence(0, "r", list(prompt), params, adapter_id="adapter-sha")
    return RequestState(req, [seq], tok), seq


def comparable(out):
    if out is None:
        return None
    fields = dataclasses.asdict(out)
    fields["metrics"] = dict(fields["metrics"], finished_time=fields["metrics"]["finished_time"] is not None)
    return fields


def apply(event, state: RequestState, seq: Sequence) -> None:
    kind, value = event
    if kind == "tokens":
        for token in value:
            if seq.is_finished:
                return
            seq.output_token_ids.append(token)
            if seq.params.logprobs is not None:
                seq.output_logprobs.append({"token_id": token, "logprob": -0.5, "top_logprobs": {token: -0.5}})
            if seq.first_token_time is None:
                seq.first_token_time = 1.0 + len(seq.output_token_ids)
            stop = state.tracks[0].detok.add_token(token)
            if stop is not None:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
    elif kind == "preempt":
        seq.num_preemptions += 1
    elif kind == "finish" and not seq.is_finished:
        seq.status, seq.stop_reason = value


def test_single_sequence_fast_path_matches_the_loop_over_sequences(tok):
    rng = random.Random(0)
    word_ids = [tok(w, add_special_tokens=False)["input_ids"] for w in WORDS]
    finishes = [(SequenceStatus.FINISHED_LENGTH, None), (SequenceStatus.FINISHED_STOPPED, 7),
                (SequenceStatus.FINISHED_STOPPED, None), (SequenceStatus.FINISHED_ABORTED, None)]
    compared = finished = 0
    for trial in range(300):
        params = SamplingParams(
            stop=rng.choice([[], ["END"], ["END", "zz"], ["\n"]]), include_stop_str_in_output=rng.random() < 0.3,
            logprobs=rng.choice([None, None, 1]), min_tokens=rng.choice([0, 0, 3]), max_tokens=None)
        stream_deltas = rng.random() < 0.7
        fast, fast_seq = make_request(tok, params, stream_deltas)
        slow, slow_seq = make_request(tok, params, stream_deltas)
        fast_seq.status = slow_seq.status = SequenceStatus.RUNNING
        after_finish = rng.randrange(3)  # calls made after the finish was reported (nothing new)
        for _ in range(rng.randrange(1, 40)):
            roll = rng.random()
            if roll < 0.05:
                event = ("finish", rng.choice(finishes))
            elif roll < 0.1:
                event = ("preempt", None)
            elif roll < 0.2:
                event = ("tokens", [])
            else:  # a word's tokens, whole or split over steps (multi-byte characters too)
                ids = rng.choice(word_ids)
                event = ("tokens", ids[: rng.randrange(1, len(ids) + 1)])
            apply(event, fast, fast_seq)
            apply(event, slow, slow_seq)
            delta = rng.choice([None, None, True, False])  # None: the request's own mode
            expected = comparable(slow._tracks_output(stream_deltas if delta is None else delta))
            assert comparable(fast.make_output(delta)) == expected, trial
            compared += expected is not None
            if fast_seq.is_finished:
                finished += 1
                if after_finish == 0:
                    break
                after_finish -= 1
    assert compared > 2000 and finished > 50
