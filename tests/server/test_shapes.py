"""Response shapes that need a real tokenizer: chat logprobs' ``bytes`` of partial characters."""

from __future__ import annotations

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
