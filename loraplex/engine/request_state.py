"""Per-request bookkeeping of the engine: its sequences, their detokenizers, and what has been
reported so far, so outputs can be whole (offline API) or deltas (async API)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.engine.sequence import FINISHED_STATUSES, Sequence
from loraplex.sampling_params import SamplingParams


@dataclass
class PreparedRequest:
    """A validated request, ready to enter the scheduler (``LLMEngine.prepare_request``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter_id: str | None
    stream_deltas: bool = False
    final_only: bool = False  # report nothing until finished (``LLM.generate`` reads no partials)
    grammar: object | None = None  # structured output: a fresh matcher, copied for each sequence
    cache_salt: str | None = None  # prefix-cache isolation (vLLM's ``cache_salt``)
    tenant: str | None = None  # for the scheduler's fair share (admission_order.py)
    priority: int = 0  # lower first, under the "fair" and "priority" policies
    tenant_weight: float = 1.0  # the tenant's share under "fair" (admission_order.py)
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class _SeqTrack:
    seq: Sequence
    detok: IncrementalDetokenizer
    sent_text_len: int = 0
    sent_tokens: int = 0
    detok_tokens: int = 0  # output tokens given to ``detok`` so far (a speculative step adds several)
    finish_sent: bool = False


class RequestState:
    """A live request: ``n`` sequences sharing one prompt and sampling params."""

    def __init__(self, req: PreparedRequest, seqs: list[Sequence], tokenizer, fast_decode=None, token_texts=None):
        self.req = req
        self.tracks = [
            _SeqTrack(s, IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params, fast_decode, token_texts))
            for s in seqs
        ]
        self.finished_time: float | None = None
        self._prompt_logprobs_sent = False
        # the common request of one sequence gets its outputs built without the loop over tracks
        self.single = self.tracks[0] if len(self.tracks) == 1 else None

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def finished(self) -> bool:
        for t in self.tracks:
            if t.seq.status not in FINISHED_STATUSES:
                return False
        return True

    def track(self, seq_id: int) -> _SeqTrack | None:
        for t in self.tracks:
            if t.seq.seq_id == seq_id:
                return t
        return None

    def make_output(self, delta: bool | None = None) -> RequestOutput | None:
        """The request's output now: cumulative, or (``delta``) only what is new since the last
        call. Returns None for a delta with nothing new.

        Called for every running request after every step (the host-side cost of a decode step
        at large batches), so it reads each sequence's state once and builds nothing it
        does not return."""
        req = self.req
        delta = req.stream_deltas if delta is None else delta
        if self.single is not None and req.params.prompt_logprobs is None:
            return self._single_output(delta)
        return self._tracks_output(delta)

    def _tracks_output(self, delta: bool) -> RequestOutput | None:
        """``make_output`` for any request: a loop over its sequences."""
        req = self.req
        completions: list[CompletionOutput] = []
        finished = True
        first_token_time = None
        num_preemptions = 0
        for t in self.tracks:
            seq = t.seq
            status = seq.status
            seq_finished = status in FINISHED_STATUSES
            finished = finished and seq_finished
            if seq.first_token_time is not None and (first_token_time is None or seq.first_token_time < first_token_time):
                first_token_time = seq.first_token_time
            num_preemptions += seq.num_preemptions
            detok = t.detok
            text_len = detok.text_len - detok.held_back(seq_finished)  # what may show now
            logprobs = seq.output_logprobs if seq.params.logprobs is not None else None
            finish_reason = status.value if seq_finished else None
            token_ids = seq.output_token_ids
            if not delta:
                completions.append(CompletionOutput(seq.index, detok.text_between(0, text_len), list(token_ids),
                                                    finish_reason, logprobs, seq.stop_reason))
                continue
            num_tokens = len(token_ids)
            sent_text_len, sent_tokens = t.sent_text_len, t.sent_tokens
            report_finish = seq_finished and not t.finish_sent
            if text_len == sent_text_len and num_tokens == sent_tokens and not report_finish:
                continue
            completions.append(
                CompletionOutput(
                    seq.index,
                    detok.text_between(sent_text_len, text_len),
                    token_ids[sent_tokens:],
                    finish_reason,
                    logprobs[sent_tokens:] if logprobs is not None else None,
                    seq.stop_reason,
                )
            )
            t.sent_text_len = text_len
            t.sent_tokens = num_tokens
            t.finish_sent = seq_finished
        if delta and not completions:
            return None
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None and not (delta and self._prompt_logprobs_sent):
            first = self.tracks[0].seq  # the request's sequences share the prompt; the first computes it
            if not first.needs_prompt_logprobs:
                prompt_logprobs = [None] + first.prompt_logprobs
                self._prompt_logprobs_sent = delta
        if finished and self.finished_time is None:
            self.finished_time = time.monotonic()  # same clock as arrival_time
        metrics = {
            "arrival_time": req.arrival_time,
            "first_token_time": first_token_time,
            "finished_time": self.finished_time,
            "num_preemptions": num_preemptions,
        }
        # positional (RequestOutput's field order): keywords cost about 0.7 us more per output
        # the first sequence is admitted before its siblings (they arrive together, in index
        # order): its hits are the prompt's (RequestOutput.num_cached_tokens)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, finished,
                             req.adapter_id, metrics, prompt_logprobs, None, self.tracks[0].seq.num_cached_tokens)

    def _single_output(self, delta: bool) -> RequestOutput | None:
        """``make_output`` for a request of one sequence without prompt logprobs: the same
        output, built without the loops and sums over sequences (checked against the general
        path in tests/engine/test_request_output_fast_path.py)."""
        t = self.single
        seq = t.seq
        status = seq.status
        finished = status in FINISHED_STATUSES
        detok = t.detok
        text_len = detok.text_len  # what may show now: nothing held back without stop strings
        if detok.stop:
            text_len -= detok.held_back(finished)
        logprobs = seq.output_logprobs if seq.params.logprobs is not None else None
        finish_reason = status.value if finished else None
        token_ids = seq.output_token_ids
        if not delta:
            completion = CompletionOutput(seq.index, detok.text_between(0, text_len), list(token_ids),
                                          finish_reason, logprobs, seq.stop_reason)
        else:
            num_tokens = len(token_ids)
            sent_text_len, sent_tokens = t.sent_text_len, t.sent_tokens
            if text_len == sent_text_len and num_tokens == sent_tokens and (t.finish_sent or not finished):
                return None
            completion = CompletionOutput(
                seq.index,
                detok.text_between(sent_text_len, text_len),
                token_ids[sent_tokens:],
                finish_reason,
                logprobs[sent_tokens:] if logprobs is not None else None,
                seq.stop_reason,
            )
            t.sent_text_len = text_len
            t.sent_tokens = num_tokens
            t.finish_sent = finished
        if finished and self.finished_time is None:
            self.finished_time = time.monotonic()  # same clock as arrival_time
        req = self.req
        metrics = {
            "arrival_time": req.arrival_time,
            "first_token_time": seq.first_token_time,
            "finished_time": self.finished_time,
            "num_preemptions": seq.num_preemptions,
        }
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished,
                             req.adapter_id, metrics, None, None, seq.num_cached_tokens)
