"""Per-request bookkeeping of the engine: its sequences, their detokenizers, and what has been
reported so far, so outputs can be whole (offline API) or deltas (async API)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.engine.sequence import Sequence
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
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class _SeqTrack:
    seq: Sequence
    detok: IncrementalDetokenizer
    sent_text_len: int = 0
    sent_tokens: int = 0
    finish_sent: bool = False


class RequestState:
    """A live request: ``n`` sequences sharing one prompt and sampling params."""

    def __init__(self, req: PreparedRequest, seqs: list[Sequence], tokenizer, fast_decode=None):
        self.req = req
        self.tracks = [
            _SeqTrack(s, IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params, fast_decode))
            for s in seqs
        ]
        self.finished_time: float | None = None

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def finished(self) -> bool:
        return all(t.seq.is_finished for t in self.tracks)

    def track(self, seq_id: int) -> _SeqTrack | None:
        for t in self.tracks:
            if t.seq.seq_id == seq_id:
                return t
        return None

    def make_output(self, delta: bool | None = None) -> RequestOutput | None:
        """The request's output now: cumulative, or (``delta``) only what is new since the last
        call. Returns None for a delta with nothing new."""
        delta = self.req.stream_deltas if delta is None else delta
        finished = self.finished
        if finished and self.finished_time is None:
            self.finished_time = time.monotonic()  # same clock as arrival_time
        completions: list[CompletionOutput] = []
        for t in self.tracks:
            seq = t.seq
            text = t.detok.visible_text(seq.is_finished)
            logprobs = seq.output_logprobs if seq.params.logprobs is not None else None
            if not delta:
                completions.append(
                    CompletionOutput(seq.index, text, list(seq.output_token_ids), seq.finish_reason, logprobs, seq.stop_reason)
                )
                continue
            new_text = text[t.sent_text_len :]
            new_tokens = seq.output_token_ids[t.sent_tokens :]
            report_finish = seq.is_finished and not t.finish_sent
            if not new_text and not new_tokens and not report_finish:
                continue
            completions.append(
                CompletionOutput(
                    seq.index,
                    new_text,
                    list(new_tokens),
                    seq.finish_reason,
                    logprobs[t.sent_tokens :] if logprobs is not None else None,
                    seq.stop_reason,
                )
            )
            t.sent_text_len = len(text)
            t.sent_tokens = seq.num_output_tokens
            t.finish_sent = seq.is_finished
        if delta and not completions:
            return None
        first_token = [t.seq.first_token_time for t in self.tracks if t.seq.first_token_time is not None]
        return RequestOutput(
            request_id=self.req.request_id,
            prompt=self.req.prompt,
            prompt_token_ids=self.req.prompt_token_ids,
            outputs=completions,
            finished=finished,
            adapter_id=self.req.adapter_id,
            metrics={
                "arrival_time": self.req.arrival_time,
                "first_token_time": min(first_token) if first_token else None,
                "finished_time": self.finished_time,
                "num_preemptions": sum(t.seq.num_preemptions for t in self.tracks),
            },
        )
