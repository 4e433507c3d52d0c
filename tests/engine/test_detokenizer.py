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


def _incremental_text(tok, prompt_ids, ids, fast_decode, **params) -> str:
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params), fast_decode)
    for t in ids:
        detok.add_token(t)
    return detok.text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decoder_gives_the_same_text_as_transformers(tok, skip_special_tokens):
    import random

    from loraplex.engine.detokenizer import backend_decoder

    fast = backend_decoder(tok)
    assert fast is not None  # the tiny tokenizer is a plain fast BPE tokenizer: the shortcut applies
    rng = random.Random(7 + skip_special_tokens)
    for _ in range(20):
        # any ids: bytes that do not form valid UTF-8, special tokens, fillers
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        assert fast(ids, skip_special_tokens=skip_special_tokens) == tok.decode(
            ids, skip_special_tokens=skip_special_tokens
        )
        args = dict(skip_special_tokens=skip_special_tokens)
        assert _incremental_text(tok, prompt, ids, fast, **args) == _incremental_text(tok, prompt, ids, None, **args)


def test_backend_decoder_not_used_where_transformers_cleans_up_the_text():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loraplex.engine.detokenizer import backend_decoder

    vocab = {"[UNK]": 0, "hello": 1, ",": 2, "world": 3, "!": 4}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cleaned = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    ids = cleaned("hello , world !", add_special_tokens=False)["input_ids"]
    assert cleaned.decode(ids) != backend.decode(ids)  # transformers post-processes: " ," -> ","
    assert backend_decoder(cleaned) is None
    plain = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=False)
    assert backend_decoder(plain) is not None
