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


def test_shared_single_token_texts_give_the_same_text(tok):
    """One cache of single-token texts serves every detokenizer of an engine, whatever each one's
    skip_special_tokens: the text is the one each would decode alone."""
    import random

    from loraplex.engine.detokenizer import backend_decoder, single_token_texts

    shared = single_token_texts()
    rng = random.Random(11)
    special = [tok.eos_token_id] * 6  # decodes to "" or to its marker, depending on the flag
    for fast in (backend_decoder(tok), None):
        for i in range(30):
            prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
            ids = [rng.choice(special + list(range(len(tok)))) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(skip_special_tokens=i % 2 == 0)
            detok = IncrementalDetokenizer(tok, prompt, params, fast, shared)
            for t in ids:
                detok.add_token(t)
            assert detok.text == _incremental_text(tok, prompt, ids, None, skip_special_tokens=i % 2 == 0)
    assert shared[True] and shared[False]


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


def brute_force_stop(pieces: list[str], stops: list[str], min_tokens: int) -> tuple[int, str | None]:
    """vLLM's min_tokens rule for stop strings, stated directly: after token k (1-based), a stop
    string counts only when k > min_tokens and it ends inside the text token k added. Returns
    (tokens consumed, stop string) for the earliest such hit (earliest start at that token)."""
    text = ""
    for k, piece in enumerate(pieces, start=1):
        before, text = len(text), text + piece
        if k <= min_tokens or not piece:
            continue
        hits = [(text.find(s, max(before - len(s) + 1, 0)), s) for s in stops]
        hits = [(pos, s) for pos, s in hits if pos != -1]
        if hits:
            return k, min(hits)[1]
    return len(pieces), None


@pytest.mark.parametrize("stops", [["ab", " c"], ["b", " xab c"], ["a", "b x"]])
@pytest.mark.parametrize("min_tokens", [0, 1, 2, 3, 4, 6, 9])
def test_stop_strings_wait_for_min_tokens(tok, min_tokens, stops):
    # vLLM (v1 detokenizer, vllm-project/vllm#22014): the text of the first min_tokens tokens is
    # never searched for a stop string; a stop string may start in it and end after it. Stop
    # strings of unequal lengths: a short one wholly in that text must not be found later
    # through a longer one's window
    text = "ab ab xab cab"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, [5], SamplingParams(stop=stops, min_tokens=min_tokens, max_tokens=20))
    consumed, stop = len(ids), None
    for k, t in enumerate(ids, start=1):
        stop = detok.add_token(t)
        if stop is not None:
            consumed = k
            break
    assert (consumed, stop) == brute_force_stop([tok.decode([t]) for t in ids], stops, min_tokens)


def _pieces(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """The text each token added (streamed outputs send exactly these)."""
    pieces = []
    for t in ids:
        before = detok.text_len
        detok.add_token(t)
        pieces.append(detok.text_between(before, detok.text_len))
    return pieces


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_stream_adds_the_same_pieces_as_the_window(tok, skip_special_tokens):
    """With a Rust tokenizer each token goes through ``tokenizers``' DecodeStream: token by
    token the same pieces as the window decoded in Python, and the same text as a one-shot
    decode, over random ids (incomplete UTF-8 and special tokens included) and real text;
    prompts whose tail ends inside a character keep the window (the stream would repeat it)."""
    import random

    from loraplex.engine.detokenizer import backend_decoder

    fast = backend_decoder(tok)
    rng = random.Random(23 + skip_special_tokens)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    streamed = windowed = checked = 0
    for trial in range(300):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        if trial % 3 == 0:
            ids = tok(rng.choice(["héllo wörld 😀 ok", "日本語 text", "a\n\n  b"]) * 2, add_special_tokens=False)["input_ids"]
        else:
            ids = [rng.choice([tok.eos_token_id, rng.randrange(len(tok))]) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok, prompt, params, fast)
        if detok._stream is None:
            windowed += 1
        else:
            streamed += 1
        got = _pieces(detok, ids)
        assert got == _pieces(IncrementalDetokenizer(tok, prompt, params), ids), (prompt, ids)
        whole = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if "\ufffd" not in whole:  # bytes that never form a character: neither way shows them
            assert "".join(got) == whole
            checked += 1
    assert streamed > 150 and windowed > 10 and checked > 100, (streamed, windowed, checked)  # all ran


def test_a_failing_decode_stream_leaves_the_text_to_the_window(tok):
    """Should the Rust stream raise (never seen), the window goes on from that token: the
    text stays that of a one-shot decode."""
    from loraplex.engine.detokenizer import backend_decoder

    class Failing:
        def step(self, backend, token_id):
            raise RuntimeError("Invalid prefix encountered")

    ids = tok("say hello, world", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, tok("q")["input_ids"], SamplingParams(), backend_decoder(tok))
    assert detok._stream is not None
    for t in ids[:3]:
        detok.add_token(t)
    detok._stream = Failing()
    for t in ids[3:]:
        detok.add_token(t)
    assert detok._stream is None and detok.text == tok.decode(ids)
