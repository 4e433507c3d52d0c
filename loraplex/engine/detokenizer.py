"""Incremental detokenization and stop strings, per generated sequence.

Text is decoded over a short window of earlier tokens (the prompt's tail included), as vLLM
does, so tokenizers that drop a leading space at the start of a decode still give the right
text, and a multi-byte character split over several tokens is emitted only once it is whole.

Stop strings never leak: when one appears, the text is cut before it (after it with
``include_stop_str_in_output``), and while streaming, any tail of the text that could be the
start of a stop string is held back until the next tokens decide.

``min_tokens`` holds for stop strings too (as vLLM's detokenizer, vllm-project/vllm#22014): a
stop string counts only once more than ``min_tokens`` tokens were generated, and only where it
ends in text those later tokens added (it may start in the earlier text).

The text is kept as the pieces each token added (``text_between`` reads a span of it): growing
one string with ``+=`` copies it whole per token, which is quadratic in the output's length
(a stream of 8,000 tokens copied about 180 MB of text that way); the whole text is joined only
when someone reads ``text``.

With a Rust fast tokenizer (``backend_decoder``), each new token goes through its
``DecodeStream``, the same windowed rule in one Rust call (1.65 against 2.15 us per token on the
CI VM, ``benchmarks/bench_detokenize.py``: 0.13 ms of a decode step's host time at 256 streams).
Its one difference: started on a prompt tail that ends inside a multi-byte character, its first
piece repeats the prompt's tail; such a sequence keeps the Python window (``_stream_for``).
"""

from __future__ import annotations

from typing import Callable

from loraplex.sampling_params import SamplingParams

# prompt tokens kept as decode context (enough for any tokenizer's merge/space rules)
_CONTEXT_TOKENS = 5


def backend_decoder(tokenizer) -> Callable[..., str] | None:
    """The Rust ``tokenizers.Tokenizer.decode`` behind a transformers fast tokenizer, when
    calling it gives exactly ``tokenizer.decode``'s text; else None.

    Each generated token costs two decodes; through transformers' ``decode`` (argument
    conversion, kwargs handling) each took about 9x the Rust call itself (cProfile). The
    shortcut is taken only where transformers' fast
    ``_decode`` is not overridden and does not post-process the text (its
    ``clean_up_tokenization_spaces`` is off, or ignored as for every BPE model)."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or not isinstance(backend, Tokenizer):
        return None
    base_decode = getattr(PreTrainedTokenizerFast, "_decode", None)  # other transformers versions
    if base_decode is None or getattr(type(tokenizer), "_decode", None) is not base_decode:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        bpe = type(backend.model).__name__ == "BPE"
        forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        if not bpe or forced:
            return None  # transformers cleans the text up afterwards
    return backend.decode


def _stream_for(backend, context: list[int], skip_special_tokens: bool):
    """A ``tokenizers`` ``DecodeStream`` that continues after ``context`` (the prompt's tail),
    or None where the window in Python must decode instead: no Rust tokenizer (``backend``), a
    ``tokenizers`` without ``DecodeStream(ids=...)``, or a context whose text ends in an
    incomplete character."""
    if backend is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream

        if context and backend.decode(context, skip_special_tokens).endswith("\ufffd"):
            return None
        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):
        return None


def single_token_texts() -> dict[bool, dict[int, str]]:
    """A cache of what single tokens decode to, by ``skip_special_tokens`` then token id, for
    the detokenizers of one tokenizer to share. Once a sequence's text started, each new token's
    first decode is of the one token read before it, alone: remembered, that is one decode of
    the two per token. A decode is a function of the ids for a given tokenizer, so entries never
    go stale; at most two per vocabulary entry."""
    return {True: {}, False: {}}


class IncrementalDetokenizer:
    """Decodes one sequence's generated tokens as they arrive and watches for stop strings."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        fast_decode: Callable[..., str] | None = None,  # backend_decoder(tokenizer), if known
        token_texts: dict[bool, dict[int, str]] | None = None,  # single_token_texts(), shared by an engine
    ):
        self.tokenizer = tokenizer
        self._fast_decode = fast_decode
        self.skip_special_tokens = params.skip_special_tokens
        self._token_texts = {} if token_texts is None else token_texts[self.skip_special_tokens]
        self.stop = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._stop_ends = frozenset(s[-1] for s in self.stop)  # each stop string's last character
        # the characters a held-back tail can end in (each stop string's but its last)
        self._hold_ends = frozenset(c for s in self.stop for c in s[:-1])
        self.min_tokens = params.min_tokens
        self._num_tokens = 0  # generated tokens seen
        context = list(prompt_token_ids[-(_CONTEXT_TOKENS + 1) :])
        self._ids = context  # decode window: prompt tail + every generated token
        self._prefix_offset = max(len(context) - _CONTEXT_TOKENS, 0)
        self._read_offset = len(context)
        self._backend = getattr(fast_decode, "__self__", None)  # the Rust tokenizer behind it
        self._stream = _stream_for(self._backend, context, self.skip_special_tokens)
        # the decoded generated text (cut at a stop string once one was found), as pieces
        self._pieces: list[str] = []
        self.text_len = 0  # len(text)
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """All of the generated text (joined once, then kept as one piece)."""
        pieces = self._pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    def text_between(self, start: int, stop: int) -> str:
        """``text[start:stop]``, joining only the pieces from ``start`` on (a streamed output
        reads what is new since it last sent: the last piece or few)."""
        if start >= stop:
            return ""
        if start == 0:  # the whole text (a cumulative output): joined once, kept as one piece
            text = self.text
            return text if stop >= len(text) else text[:stop]
        pieces = self._pieces
        i, begin = len(pieces), self.text_len  # begin: where pieces[i:] starts in the text
        while begin > start:
            i -= 1
            begin -= len(pieces[i])
        tail = pieces[i] if i == len(pieces) - 1 else "".join(pieces[i:])
        return tail[start - begin : stop - begin]

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:  # positional: a keyword costs ~0.4 us per Rust call
            return self._fast_decode(ids, self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append a generated token; returns the stop string if the text now contains one."""
        if self.stop_string is not None:
            return self.stop_string
        # called for every sequence on every step: attributes read once into locals, and the
        # Rust decode called directly rather than through ``_decode``
        ids = self._ids
        ids.append(token_id)
        self._num_tokens += 1
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 (never seen; a guard on a Rust error)
                self._leave_stream()
            else:
                return None if piece is None else self._add_piece(piece)
        prefix_offset, read_offset = self._prefix_offset, self._read_offset
        fast_decode = self._fast_decode
        if read_offset - prefix_offset == 1:  # after the first text: the token read last
            token = ids[prefix_offset]
            prefix_text = self._token_texts.get(token)
            if prefix_text is None:
                prefix_text = self._token_texts[token] = self._decode([token])
        else:
            prefix_text = self._decode(ids[prefix_offset:read_offset])
        if fast_decode is not None:  # positional: a keyword costs ~0.4 us per Rust call
            new_text = fast_decode(ids[prefix_offset:], self.skip_special_tokens)
        else:
            new_text = self._decode(ids[prefix_offset:])
        # "\ufffd" at the end: an incomplete multi-byte character; wait for more tokens
        num_prefix_chars = len(prefix_text)
        if len(new_text) <= num_prefix_chars or new_text.endswith("\ufffd"):
            return None
        self._prefix_offset = read_offset
        self._read_offset = len(ids)
        return self._add_piece(new_text[num_prefix_chars:])

    def _leave_stream(self) -> None:
        """The window in Python decodes from the new token on, after a ``DecodeStream`` failed:
        the tokens before it become its context (what they had not yet shown, an incomplete
        character, is lost)."""
        self._stream = None
        self._read_offset = len(self._ids) - 1
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)

    def _add_piece(self, piece: str) -> str | None:
        """Append a token's new text; returns the stop string if the text now contains one."""
        before = self.text_len
        self._pieces.append(piece)
        self.text_len += len(piece)
        # a stop string that ends in the new text has its last character in it (most pieces
        # have none: no search; with the hold-back's own check, 7.56 -> 3.87 us per token for a
        # request with two stop strings, bench_detokenize)
        if not self.stop or self._num_tokens <= self.min_tokens or self._stop_ends.isdisjoint(piece):
            return None
        return self._find_stop(before)

    def _find_stop(self, before: int) -> str | None:
        """The stop string that starts first among those ending in the text after ``before``
        (each one's own window, as vLLM's ``check_stop_strings``: one that lies wholly in the
        earlier text, which ``min_tokens`` kept unsearched, does not count)."""
        begin = max(before - self._max_stop_len + 1, 0)
        tail = self.text_between(begin, self.text_len)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            pos = tail.find(stop, max(before - len(stop) + 1 - begin, 0))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        cut = begin + pos + (len(stop) if self.include_stop else 0)
        text = self.text[:cut]
        self._pieces[:] = [text] if text else []
        self.text_len = cut
        self.stop_string = stop
        return stop

    def held_back(self, finished: bool) -> int:
        """How many characters at the end of the text to hold back now: none when finished or
        without stop strings, else the longest tail that could still grow into a stop string."""
        if finished or not self.stop:
            return 0
        last = self._pieces[-1] if self._pieces else ""
        if last and last[-1] not in self._hold_ends:  # no stop string's start ends the text
            return 0
        tail = self.text_between(max(self.text_len - self._max_stop_len + 1, 0), self.text_len)
        hold = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(tail)), hold, -1):
                if tail.endswith(stop[:k]):
                    hold = k
                    break
        return hold

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: all of it when finished, else without a tail that could
        still grow into a stop string."""
        hold = self.held_back(finished)
        return self.text[: self.text_len - hold] if hold else self.text
