"""Incremental detokenizer: multi-byte characters split over tokens, stop strings and hold-back,
checked against the tokenizer's own one-shot decode."""

from __future__ import annotations

import pytest

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.sampling_params import SamplingParams
from tests.fixtures.tiny_models import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def stream(tok, prompt: str, text: str, **params):
    """Feed ``text``'s tokens one by one; returns (visible text after each token, detokenizer)."""
    detok = IncrementalDetokenizer(tok, tok(prompt)["input_ids"], SamplingParams(**params))
    shown = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        stop = detok.add_token(t)
        shown.append(detok.visible_text(finished=stop is not None))
        if stop is not None:
            break
    return shown, detok


def test_multibyte_characters_never_emit_replacement_chars(tok):
    text = "héllo wörld 😀 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text)  # several characters take more than one token
    shown, detok = stream(tok, "prompt: ", text)
    assert detok.text == tok.decode(ids) == text
    assert all("\ufffd" not in s for s in shown)
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))


def test_special_tokens_skipped(tok):
    detok = IncrementalDetokenizer(tok, [5, 6], SamplingParams())
    for t in tok("ab", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]:
        detok.add_token(t)
    assert detok.text == "ab"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_cut_and_held_back(tok, include):
    shown, detok = stream(tok, "q", "say héllo END more", stop=["END", "zz"], include_stop_str_in_output=include)
    assert detok.stop_string == "END"
    assert detok.text == ("say héllo END" if include else "say héllo ")
    # while streaming, a tail that could start "END" is held back: "E" and "EN" never show
    for s in shown[:-1]:
        assert not s.endswith("E") and not s.endswith("EN")
    assert shown[-1] == detok.text


def test_earliest_stop_string_wins(tok):
    # both complete with the token "z": the one that starts first cuts the text
    _, detok = stream(tok, "q", "abc xyz", stop=["yz", "xyz"])
    assert detok.stop_string == "xyz" and detok.text == "abc "
