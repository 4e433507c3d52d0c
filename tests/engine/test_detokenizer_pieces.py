"""The detokenizer keeps its text as the pieces tokens added (no quadratic ``+=``): what streams
read of it (``text_between``, ``held_back``) against plain string operations on the whole text,
and the deltas a streamed request sends joined against the text a one-shot decode gives, over
random token streams (multi-byte characters split over tokens) and random stop strings."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.request_state import PreparedRequest, RequestState
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.sampling_params import SamplingParams
from tests.fixtures.tiny_models import make_tiny_tokenizer

WORDS = ["héllo", " wörld", " 😀", " ab", "c", " END", "E", "N", "D", " xyz", "\n", " the", " ü"]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def naive_hold(text: str, stops: list[str]) -> int:
    """The longest tail of ``text`` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(6))
def test_pieces_read_as_the_whole_text(tok, seed):
    rng = random.Random(seed)
    for _ in range(8):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        stops = rng.sample(["END", "xyz", "ü t", "D\n", "😀 a"], rng.randint(0, 2))
        params = SamplingParams(stop=stops or None, include_stop_str_in_output=rng.random() < 0.5,
                                min_tokens=rng.choice([0, 0, 5]))
        read = IncrementalDetokenizer(tok, [5, 6], params)  # queried piecewise only
        whole = IncrementalDetokenizer(tok, [5, 6], params)  # the same stream, read whole
        for t in ids:
            stop = read.add_token(t)
            assert whole.add_token(t) == stop
            full = whole.text
            assert read.text_len == len(full)
            a, b = sorted(rng.randint(0, len(full)) for _ in range(2))
            assert read.text_between(a, b) == full[a:b]
            assert read.text_between(max(0, len(full) - 3), len(full)) == full[-3:]
            finished = stop is not None
            assert read.held_back(finished) == (0 if finished else naive_hold(full, stops))
            if finished:
                break
        assert read.text == whole.text


@pytest.mark.parametrize("seed", range(4))
def test_streamed_deltas_join_to_the_final_text(tok, seed):
    rng = random.Random(100 + seed)
    text = "".join(rng.choice(WORDS) for _ in range(300))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(stop=["xyz END"] if seed % 2 else None, max_tokens=len(ids))
    prompt = [5, 6, 7]
    seq = Sequence(0, "r", prompt, params)
    seq.status = SequenceStatus.RUNNING
    state = RequestState(PreparedRequest("r", None, prompt, params, None, stream_deltas=True), [seq], tok)
    detok, sent, shown = state.single.detok, [], []
    for t in ids:
        seq.output_token_ids.append(t)
        if detok.add_token(t) is not None:
            seq.status = SequenceStatus.FINISHED_STOPPED
        out = state.make_output()
        if out is not None:
            sent.append(out.outputs[0].text)
        # what a client has seen is always a prefix of the one-shot decode
        shown.append("".join(sent))
        assert tok.decode(seq.output_token_ids).startswith(shown[-1].rstrip("\ufffd"))
        if seq.status is not SequenceStatus.RUNNING:
            break
    assert "".join(sent) == detok.text
    cumulative = state.make_output(delta=False).outputs[0].text
    assert cumulative == detok.text
    if seq.status is SequenceStatus.RUNNING:
        assert detok.text == tok.decode(ids)
