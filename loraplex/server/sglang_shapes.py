"""SGLang's ``/generate`` output objects (sgl-project/sglang ``TokenizerManager._handle_batch_output``):
``{"text", "output_ids", "meta_info"}``, where ``meta_info`` holds ``id``, ``finish_reason``
(null while running; ``{"type": "length", "length": max_new_tokens}``, ``{"type": "stop",
"matched": <stop string or token id>}``, ``{"type": "abort", "message"}``), ``prompt_tokens``,
``completion_tokens``, ``cached_tokens`` and, once finished, ``e2e_latency``. With
``return_logprob``: ``input_token_logprobs`` and ``output_token_logprobs``, lists of
``[logprob, token_id, text or null]`` (SGLang's tuples, as JSON writes them); with
``top_logprobs_num``, ``input_top_logprobs`` and ``output_top_logprobs``: per position a list
of such tuples, most likely first (null for the prompt's first token, which nothing predicts).

``max_new_tokens`` 0 (prompt scoring): no text, ids or output logprobs (the one token the engine
ran is not shown), ``{"type": "length", "length": 0}``, as SGLang's prefill-only request.
``input_token_logprobs`` start at ``logprob_start_len`` with a null logprob, as SGLang pads them
(its scheduler: "Always pad the first one with None"), whatever that position.

Text, ids and logprobs are cumulative in every streamed object, as SGLang streams them by
default. ``cached_tokens`` is the prompt's tokens the prefix cache served (the engine's
``num_cached_tokens``, whole blocks found cached when the prompt was first admitted; one number
for a prompt's ``n`` outputs, which share it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


ABORT_REQUESTED = "abort_requested"  # OutputState.finish of an output ended by /abort_request


@dataclass
class OutputState:
    """One output (a prompt's sample) as it grows."""

    rid: str
    prompt_index: int
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish: str | None = None
    stop_reason: int | str | None = None
    score_only: bool = False  # max_new_tokens 0: the prompt's logprobs, no output
    abort_reason: dict | None = None  # SGLang's finish_reason of an abort a client asked for

    def add(self, comp) -> None:
        if self.score_only:
            if comp.finish_reason is not None and self.finish != ABORT_REQUESTED:  # SGLang's length 0
                self.finish = "abort" if comp.finish_reason == "abort" else "length"
            return
        self.text += comp.text
        self.ids.extend(comp.token_ids)
        self.logprobs.extend(comp.logprobs or [])
        # the engine's own "abort" that follows an asked-for abort is that abort, not a failure
        if comp.finish_reason is not None and not (self.finish == ABORT_REQUESTED and comp.finish_reason == "abort"):
            self.finish, self.stop_reason = comp.finish_reason, comp.stop_reason

    def abort_requested(self) -> None:
        """``POST /abort_request`` ended this output: SGLang answers it as a finished output
        whose finish_reason says so (``Abort in waiting queue`` before its first token, else
        ``FINISH_ABORT``'s), not as an error."""
        if self.finish is not None:
            return
        self.finish = ABORT_REQUESTED
        self.abort_reason = ({"type": "abort", "message": "Abort in waiting queue"} if not self.ids else
                             {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})


class SGLangShaper:
    """Builds the output objects of one request."""

    def __init__(self, tokenizer, *, return_logprob: bool, start: int, top: int, with_text: bool,
                 max_new_tokens: dict[int, int], arrival: float):
        self.tok = tokenizer
        self.return_logprob = return_logprob
        self.start = start
        self.top = top
        self.with_text = with_text
        self.max_new_tokens = max_new_tokens  # prompt index -> its max_new_tokens
        self.arrival = arrival

    def _text(self, token_id: int):
        return self.tok.decode([token_id], skip_special_tokens=False) if self.with_text else None

    def _tuple(self, logprob, token_id: int) -> list:
        return [logprob, token_id, self._text(token_id)]

    def _top(self, entry: dict | None):
        top = (entry or {}).get("top_logprobs") or {}
        items = list(top.items()) if isinstance(top, dict) else [(t["token_id"], t["logprob"]) for t in top]
        items.sort(key=lambda kv: -kv[1])
        return [self._tuple(lp, t) for t, lp in items[:self.top]]

    def finish_reason(self, out: OutputState) -> dict | None:
        if out.finish is None:
            return None
        if out.finish == "length":
            return {"type": "length", "length": self.max_new_tokens[out.prompt_index]}
        if out.finish == ABORT_REQUESTED:
            return dict(out.abort_reason)
        if out.finish == "abort":
            return {"type": "abort", "message": "The request was aborted."}
        matched = out.stop_reason
        if matched is None and out.ids:  # the end-of-sequence token
            matched = out.ids[-1]
        return {"type": "stop", "matched": matched}

    def _input_logprobs(self, meta: dict, prompt_ids: list[int], computed: list | None) -> None:
        if self.start < 0:
            meta["input_token_logprobs"] = []
            if self.top:
                meta["input_top_logprobs"] = []
            return
        entries = []
        for i, token_id in enumerate(prompt_ids):
            entry = computed[i] if computed and i < len(computed) else None
            entries.append((token_id, entry if isinstance(entry, dict) else None))
        entries = entries[self.start:]
        if entries:  # SGLang's first position has no logprob, wherever it starts
            entries[0] = (entries[0][0], None)
        meta["input_token_logprobs"] = [self._tuple(e["logprob"] if e else None, t) for t, e in entries]
        if self.top:
            meta["input_top_logprobs"] = [self._top(e) if e else None for _, e in entries]

    def output(self, out: OutputState, prompt_ids: list[int], computed: list | None, cached_tokens: int = 0) -> dict:
        meta: dict = {
            "id": out.rid,
            "finish_reason": self.finish_reason(out),
            "prompt_tokens": len(prompt_ids),
        }
        if self.return_logprob:
            self._input_logprobs(meta, prompt_ids, computed)
            meta["output_token_logprobs"] = [self._tuple(e.get("logprob"), e["token_id"]) for e in out.logprobs]
            if self.top:
                meta["output_top_logprobs"] = [self._top(e) for e in out.logprobs]
        meta["completion_tokens"] = len(out.ids)
        meta["cached_tokens"] = cached_tokens
        if out.finish is not None:
            meta["e2e_latency"] = time.monotonic() - self.arrival
        return {"text": out.text, "output_ids": list(out.ids), "meta_info": meta}
