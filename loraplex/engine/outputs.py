"""The seams of the engine: what the scheduler hands the model runner, what the runner hands
back, and what the engine hands callers. Pure Python; no torch here.

Step loop (``LLMEngine.step``)::

    sched_out = scheduler.schedule()            # SchedulerOutput
    run_out   = runner.execute(sched_out)       # ModelRunnerOutput
    deltas    = scheduler.update(sched_out, run_out) -> engine postprocess -> RequestOutput deltas
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from loraplex.engine.sequence import Sequence


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: ``num_tokens`` tokens starting at ``start_pos``.

    The tokens are ``seq.all_token_ids[start_pos : start_pos + num_tokens]``; their KV goes to
    the slots given by ``block_tables`` (one table per layer group, already allocated for all of
    them; ``block_table`` alone stands for a model with one group). ``needs_sample`` is
    true when this chunk reaches the end of the known tokens (last prefill chunk, or a decode),
    so a new token is sampled from the logits of its last position.

    Speculative decoding: ``draft_token_ids`` (not yet the sequence's tokens) follow the known
    tokens in the chunk and count in ``num_tokens``; a token is sampled at each of the last
    ``1 + len(draft_token_ids)`` positions, and ``scheduler.update`` keeps the ones the draft
    predicted right (spec_verify.py).
    """

    seq: "Sequence"
    start_pos: int
    num_tokens: int
    block_table: list[int]
    needs_sample: bool
    adapter_id: str | None  # content sha256 of the adapter version, None = base model
    draft_token_ids: list[int] = field(default_factory=list)
    block_tables: list[list[int]] | None = None  # per layer group; None: [block_table]

    def __post_init__(self):
        if self.block_tables is None:
            self.block_tables = [self.block_table]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    num_batched_tokens: int
    # sequences the runner may drop per-sequence state for (finished/aborted/preempted since last step)
    released_seq_ids: list[int] = field(default_factory=list)
    num_preempted: int = 0  # preemptions made while building this step (for stats and tests)
    num_chunked_prefills: int = 0  # scheduled prefills that did not reach the prompt's end
    num_draft_tokens: int = 0  # speculative draft tokens scheduled in this step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # token id -> logprob, when asked


@dataclass
class ModelRunnerOutput:
    """Per scheduled sequence that ``needs_sample``: the token sampled for it."""

    sampled: dict[int, SampledToken]  # seq_id -> token
    # seq_id -> the next prompt logprob entries of a sequence that asked for them, in order
    prompt_logprobs: dict[int, list[dict]] = field(default_factory=dict)
    # seq_id -> for a sequence scheduled with drafts, the token sampled at each of its last
    # 1 + len(draft) positions (instead of an entry in ``sampled``)
    verified: dict[int, list[SampledToken]] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    logprobs: list[dict] | None = None  # per token: {"token_id", "logprob", "top_logprobs"}
    stop_reason: int | str | None = None  # the stop string or token id that ended it


@dataclass
class RequestOutput:
    """Result (or incremental delta, in the async API) of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    adapter_id: str | None = None
    metrics: dict = field(default_factory=dict)  # arrival_time, first_token_time, finished_time
    # with params.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # predicts it), else {"token_id", "logprob", "rank", "top_logprobs": {id: logprob}}; set once
    # the whole prompt is computed (in the async API's deltas: on the first output after that)
    prompt_logprobs: list[dict | None] | None = None
    # set on the final output of a request that ended before it ran because its adapter could not
    # be read (what the read raised); the async API raises it to the caller, as it would have at
    # admission had the adapter been read then
    error: BaseException | None = None
    # prompt tokens served from the prefix cache (vLLM's ``num_cached_tokens``): whole blocks
    # found cached when the request's first sequence was first admitted (block_manager.py). Its
    # other sequences (n > 1) share the same prompt and find the blocks the first registered;
    # the prompt is counted once, as in usage's prompt_tokens. None before the request ran
    num_cached_tokens: int | None = None

    # Convenience for the common n == 1 case (``out.text``, ``out.token_ids``, ``out.finish_reason``).
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
