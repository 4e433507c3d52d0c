"""Response shapes that need a real tokenizer: chat logprobs' ``bytes`` of partial characters."""

from __future__ import annotations

import pytest

from loraplex.server.shapes import ResponseShaper, token_bytes
from tests.fixtures.tiny_models import make_tiny_tokenizer


def test_chat_logprob_bytes_join_into_the_text():
    tok = make_tiny_tokenizer()
    text = "é→ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())  # one token per byte
    entries = [{"token_id": t, "logprob": -1.0, "top_logprobs": {t: -1.0}} for t in ids]
    content = ResponseShaper("chat", "m", tok).chat_logprobs(entries, 1)["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == text
    assert content[0]["bytes"] == [0xC3] and content[0]["top_logprobs"][0]["bytes"] == [0xC3]
    assert content[-1] == {"token": "k", "logprob": -1.0, "bytes": [107], "top_logprobs": [
        {"token": "k", "logprob": -1.0, "bytes": [107]}]}


class SentencePieceLike:
    def convert_ids_to_tokens(self, token_id):
        return {7: "<0xE2>", 8: "▁hi"}[token_id]


def test_sentencepiece_byte_fallback_and_plain_tokens():
    assert token_bytes(SentencePieceLike(), 7, "\ufffd") == [0xE2]
    assert token_bytes(SentencePieceLike(), 8, " hi") == list(b" hi")  # whole text: as decoded
    assert token_bytes(None, 9, "\ufffd") == list("\ufffd".encode())  # nothing better known


def test_completion_top_logprobs_always_hold_the_sampled_token():
    tok = make_tiny_tokenizer()
    a, b, c = (tok.convert_tokens_to_ids(ch) for ch in "abc")
    entries = [
        {"token_id": c, "logprob": -3.0, "top_logprobs": {a: -0.5, b: -1.0, c: -3.0}},  # sampled, not in the top 2
        {"token_id": a, "logprob": -0.5, "top_logprobs": {a: -0.5, b: -1.0}},  # sampled is the best
    ]
    shaper = ResponseShaper("completion", "m", tok)
    lp = shaper.completion_logprobs(entries, 2, shaper.text_offsets([5], True).of([c, a]))
    assert lp["top_logprobs"] == [{"a": -0.5, "b": -1.0, "c": -3.0}, {"a": -0.5, "b": -1.0}]
    zero = shaper.completion_logprobs(entries, 0, [0, 1])
    assert zero["top_logprobs"] == [{"c": -3.0}, {"a": -0.5}]  # logprobs=0: the sampled token alone
    assert lp["tokens"] == ["c", "a"] and lp["token_logprobs"] == [-3.0, -0.5] and lp["text_offset"] == [0, 1]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_offsets_index_the_text_the_tokens_decode_to(skip_special_tokens):
    """Each token's offset is the length of the text the tokens before it decode to (one-shot
    decode as the reference), however the tokens arrive: a token inside a multi-byte character
    or a skipped special token adds nothing, so no offset lies past the end of the text (summing
    each token decoded alone counted a partial character's "\ufffd" as a character)."""
    import random

    tok = make_tiny_tokenizer()
    shaper = ResponseShaper("completion", "m", tok)
    rng = random.Random(3 + skip_special_tokens)
    adding_nothing = 0  # tokens whose text is not yet whole, or skipped: the case summing got wrong
    for _ in range(40):
        text = "".join(rng.choice(["北京", "é", "😀", " ab", "c", "\n"]) for _ in range(rng.randint(1, 12)))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for _ in range(rng.randint(0, 2)):
            ids.insert(rng.randrange(len(ids) + 1), tok.eos_token_id)
        offsets = shaper.text_offsets(tok("q: ")["input_ids"], skip_special_tokens, start=7)
        got, at = [], 0
        while at < len(ids):  # arriving in deltas of one to three tokens, as a stream's
            step = rng.randint(1, 3)
            got += offsets.of(ids[at: at + step])
            at += step
        decoded = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        want = [7 + len(tok.decode(ids[:k], skip_special_tokens=skip_special_tokens).rstrip("\ufffd"))
                for k in range(len(ids))]
        assert got == want, (text, ids)
        assert max(got) <= 7 + len(decoded)
        adding_nothing += sum(a == b for a, b in zip(got, got[1:]))
    assert adding_nothing > 20
