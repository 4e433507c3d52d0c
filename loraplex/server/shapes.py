"""OpenAI response and stream-chunk shapes for completions and chat completions.

Ids are ``cmpl-<hex>`` / ``chatcmpl-<hex>``; ``object`` is ``text_completion``,
``chat.completion`` or ``chat.completion.chunk``. Streams end with ``data: [DONE]`` (see
streaming.py); with ``stream_options.include_usage`` every chunk carries ``"usage": null`` and a
last chunk with empty ``choices`` carries the usage. With vLLM's ``continuous_usage_stats`` each
chunk's ``usage`` is its choice's so far instead (see ``track_usage``). With
``--enable-prompt-tokens-details`` the whole request's usage (answer or last chunk) carries
``prompt_tokens_details: {"cached_tokens"}``, the prompt tokens the prefix cache served (vLLM's).

vLLM's ``return_tokens_as_token_ids`` writes each logprob token as ``"token_id:<id>"`` (vLLM's
form), so tokens that are not valid text on their own stay identifiable. Chat's ``bytes`` stay the
token's own bytes and completions' ``text_offset`` stays the offset in the text, where vLLM takes
both from the ``"token_id:<id>"`` string for some entries.

Completions' ``text_offset`` is where each token's text starts in the answer's text
(``TextOffsets``): the tokens go through the engine's incremental detokenizer, so a token inside
a multi-byte character adds nothing until the character is whole and a skipped special token
adds nothing. vLLM adds up each token's text decoded alone, which counts a partial character's
"\ufffd" as a character: offsets past the end of the text, and other offsets streamed.
"""

from __future__ import annotations

import functools
import re
import time
import uuid

from loraplex.engine.detokenizer import IncrementalDetokenizer, backend_decoder
from loraplex.sampling_params import SamplingParams
from loraplex.server.chunk_templates import TextChunkTemplate

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


def new_id(kind: str) -> str:
    return _id_prefix(kind) + uuid.uuid4().hex


def client_answer_id(kind: str, client_id: str) -> str:
    """The answer's ``id`` where the body named vLLM's ``request_id``: ``chatcmpl-<it>``, as vLLM
    answers (the engine's own ids stay unique: two requests may name the same one)."""
    return _id_prefix(kind) + client_id


def _id_prefix(kind: str) -> str:
    return "chatcmpl-" if kind == "chat" else "cmpl-"


@functools.lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the stand-in character of each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """The bytes a token stands for (chat logprobs' ``bytes``). ``text`` is the token decoded
    alone; where that holds U+FFFD the token is part of a multi-byte character, and its own
    bytes are read from the vocabulary (byte-level BPE, or SentencePiece's ``<0xNN>``), so the
    bytes of consecutive entries join into the real text, as OpenAI documents."""
    if "\ufffd" in text and tokenizer is not None and hasattr(tokenizer, "convert_ids_to_tokens"):
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece:
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return [int(match.group(1), 16)]
            table = _byte_level_chars()
            if all(c in table for c in piece):
                return [table[c] for c in piece]
    return list(text.encode("utf-8"))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; ``cached_tokens`` (with --enable-prompt-tokens-details, else None: left
    out, as vLLM leaves it) goes in ``prompt_tokens_details``."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


class ResponseShaper:
    """Builds the bodies of one response (all chunks share id, created and model)."""

    def __init__(self, kind: str, model: str, tokenizer, include_usage: bool = False, response_id: str | None = None,
                 tokens_as_ids: bool = False, role: str = "assistant"):
        self.kind = kind
        self.role = role  # a chat answer's role (vLLM's --response-role, or the continued message's)
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.tokens_as_ids = tokens_as_ids
        self.id = response_id or new_id(kind)
        self.created = int(time.time())
        # continuous usage: per choice [prompt tokens, completion tokens so far]; None when off
        self._choice_usage: list[list[int]] | None = None
        self._text_template: TextChunkTemplate | None = None  # built on the first text_event

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # --- usage on every chunk (vLLM's continuous_usage_stats) -------------------------------

    def track_usage(self, prompt_tokens_per_choice: list[int]) -> None:
        """From now on every choice chunk carries its choice's usage: the prompt's tokens and
        the tokens generated so far (vLLM's shape: cumulative, per choice; the role chunk
        reports 0). The last chunk still carries the whole request's usage."""
        self._choice_usage = [[p, 0] for p in prompt_tokens_per_choice]

    def count_tokens(self, index: int, n: int) -> None:
        if self._choice_usage is not None:
            self._choice_usage[index][1] += n

    # --- logprobs --------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _token_label(self, token_id: int) -> str:
        """A token as the logprobs name it: its text, or vLLM's ``"token_id:<id>"``."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self._token_text(token_id)

    def text_offsets(self, context_ids: list[int], skip_special_tokens: bool, start: int = 0) -> "TextOffsets":
        """Text offsets of tokens that follow ``context_ids`` (a prompt: [] for the prompt's own
        tokens), counted from ``start`` (the length of the text before theirs)."""
        return TextOffsets(self.tokenizer, context_ids, skip_special_tokens, start)

    @staticmethod
    def _top_items(entry: dict, limit: int) -> list[tuple[int, float]]:
        top = entry.get("top_logprobs") or {}
        items = list(top.items()) if isinstance(top, dict) else [(t["token_id"], t["logprob"]) for t in top]
        items.sort(key=lambda kv: -kv[1])
        return items[:limit]

    def completion_logprobs(self, entries: list[dict], top_n: int, offsets: list[int]) -> dict:
        """Completions' ``logprobs`` object for the tokens of ``entries``, whose ``text_offset``
        are ``offsets`` (``TextOffsets``). Each ``top_logprobs`` dict holds the ``top_n`` most
        likely tokens and always the sampled one, so up to ``top_n + 1`` entries (OpenAI's rule;
        vLLM does the same)."""
        tokens, token_logprobs, top = [], [], []
        for e in entries:
            label = self._token_label(e["token_id"])
            tokens.append(label)
            token_logprobs.append(e.get("logprob"))
            entry: dict[str, float] = {}
            items = self._top_items(e, top_n)
            for t, lp in items:  # most likely first: a text shared by two tokens keeps the higher
                entry.setdefault(self._token_label(t), lp)
            if e.get("logprob") is not None and all(t != e["token_id"] for t, _ in items):
                entry.setdefault(label, e["logprob"])
            # a prompt's first token: nothing predicts it, so no logprob and no alternatives
            top.append(None if e.get("logprob") is None and e.get("top_logprobs") is None else entry)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": list(offsets)}

    @staticmethod
    def prompt_entries(prompt_ids: list[int], prompt_logprobs: list) -> list[dict]:
        """The engine's prompt logprobs as logprob entries (the first token's without values),
        for completions' ``echo`` with ``logprobs``."""
        first = {"token_id": prompt_ids[0], "logprob": None, "top_logprobs": None}
        return [first] + list(prompt_logprobs[1:]) if prompt_ids else []

    def vllm_prompt_logprobs(self, prompt_logprobs: list, top_n: int) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or
        ``{token_id: {"logprob", "rank", "decoded_token"}}`` holding the top ``top_n`` and the
        prompt's own token."""
        out: list = []
        for e in prompt_logprobs:
            if e is None:
                out.append(None)
                continue
            items = {}
            for rank, (token, lp) in enumerate(self._top_items(e, top_n), start=1):
                items[str(token)] = {"logprob": lp, "rank": rank, "decoded_token": self._token_text(token)}
            items[str(e["token_id"])] = {
                "logprob": e["logprob"], "rank": e["rank"], "decoded_token": self._token_text(e["token_id"]),
            }
            out.append(items)
        return out

    def chat_logprobs(self, entries: list[dict], top_n: int) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": self._token_label(token_id), "logprob": logprob,
                    "bytes": token_bytes(self.tokenizer, token_id, text)}

        content = []
        for e in entries:
            d = item(e["token_id"], e.get("logprob"))
            d["top_logprobs"] = [item(t, lp) for t, lp in self._top_items(e, top_n)]
            content.append(d)
        return {"content": content}

    # --- whole responses -------------------------------------------------------------------

    def completion_response(self, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                            cached_tokens: int | None = None) -> dict:
        """choices: [{"index", "text", "logprobs", "finish_reason"}] in index order."""
        body = self._head("text_completion")
        body["choices"] = choices
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        body["system_fingerprint"] = None
        return body

    def chat_response(self, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                      cached_tokens: int | None = None) -> dict:
        """choices: [{"index", "text", "logprobs", "finish_reason"}] -> chat message shape; a
        choice's ready "message" (tool calls) is taken as it is."""
        body = self._head("chat.completion")
        body["choices"] = [
            {
                "index": c["index"],
                "message": {**(c.get("message") or {"content": c["text"]}), "role": self.role},
                "logprobs": c.get("logprobs"),
                "finish_reason": c["finish_reason"],
            }
            for c in choices
        ]
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        body["system_fingerprint"] = None
        return body

    # --- stream chunks ---------------------------------------------------------------------

    def chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs=None, role: bool = False,
              tool_calls: list[dict] | None = None) -> dict:
        """One choice's chunk; chat deltas carry ``tool_calls`` entries when given."""
        if self.kind == "chat":
            body = self._head("chat.completion.chunk")
            delta: dict = {}
            if role:
                delta["role"] = self.role
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        choice["stop_reason"] = None  # vLLM's: ``openai_routes.chunks`` sets it on a finishing chunk
        body["choices"] = [choice]
        if self._choice_usage is not None:
            body["usage"] = usage(*self._choice_usage[index])
        elif self.include_usage:
            body["usage"] = None
        return body

    def text_event(self, index: int, text: str) -> bytes:
        """``sse_event(self.chunk(index, text, None))`` (streaming.py), written from a template."""
        template = self._text_template
        if template is None:
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            template = self._text_template = TextChunkTemplate(self.kind, self._head(obj), self.include_usage)
        if self._choice_usage is not None:
            return template.event_with_usage(index, text, *self._choice_usage[index])
        return template.event(index, text)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body


class TextOffsets:
    """Where each token's text starts, for tokens arriving in order (one per choice, kept
    across a stream's deltas): the length of the text the tokens before it decode to through
    the engine's ``IncrementalDetokenizer`` (with the prompt's tail as context, as the engine
    decodes), plus ``start``. Without a tokenizer each token counts as its id's digits."""

    def __init__(self, tokenizer, context_ids: list[int], skip_special_tokens: bool, start: int = 0):
        self._start = start
        self._length = 0  # without a tokenizer
        self._detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, context_ids, SamplingParams(skip_special_tokens=skip_special_tokens), backend_decoder(tokenizer))

    def of(self, token_ids: list[int]) -> list[int]:
        """The offsets of ``token_ids``, the next tokens."""
        offsets, detok = [], self._detok
        for token in token_ids:
            if detok is None:
                offsets.append(self._start + self._length)
                self._length += len(str(token))
            else:
                offsets.append(self._start + detok.text_len)
                detok.add_token(token)
        return offsets
