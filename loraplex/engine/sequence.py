"""One generated sequence (a request with ``n > 1`` has ``n`` of them). Pure Python, no torch.

Preemption is by recompute: a preempted sequence drops its KV blocks and sets
``num_computed_tokens`` back to 0, so prompt + generated-so-far becomes the "prompt" it
recomputes on resume. The output tokens stay in ``output_token_ids`` (penalties and stop checks
keep seeing them as generated tokens); only the KV is recomputed.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from loraplex.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"


# A set, read directly by Sequence (not an Enum property: enum.property is a Python-level
# descriptor costing about a microsecond per call, and the engine asks several times per
# sequence per step).
FINISHED_STATUSES = frozenset(
    (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)
)


# finish_reason string (RequestOutput contract) -> status
FINISH_STATUS = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH,
    "abort": SequenceStatus.FINISHED_ABORTED,
}


@dataclass(eq=False)  # identity semantics: list.remove / `in` must not compare token lists
class Sequence:
    """A prompt and the tokens generated after it, plus its scheduling state.

    The KV of ``all_token_ids[:num_computed_tokens]`` sits in the blocks of ``block_tables``
    (one table per layer group, see ``kv_layout``; ``block_table`` is the first group's).
    ``adapter_id`` is the adapter's content sha256 (None = base model).
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter_id: str | None = None
    # the adapter cannot change any K/V (LoRAManager.shares_base_kv): the prefix cache keys this
    # sequence's blocks as the base model's, so it shares theirs
    shares_base_kv: bool = False
    index: int = 0  # position among the request's n sequences
    cache_salt: str | None = None  # prefix-cache blocks are shared only with the same salt
    tenant: str | None = None  # whose request: the "fair" policy shares admissions between tenants
    priority: int = 0  # lower is admitted first (the "fair" and "priority" policies)
    tenant_weight: float = 1.0  # the tenant's share under "fair": its running load counts divided by this
    output_token_ids: list[int] = field(default_factory=list)
    # per generated token: {"token_id", "logprob", "top_logprobs"} when params.logprobs is set
    output_logprobs: list[dict] = field(default_factory=list)
    # per prompt token from the second on: {"token_id", "logprob", "rank", "top_logprobs"}, when
    # params.prompt_logprobs is set (the first sequence of a request only: they share the prompt)
    prompt_logprobs: list[dict] = field(default_factory=list)
    # structured output: this sequence's llguidance matcher, advanced by the sampler with each
    # token it samples (None: unconstrained)
    grammar: object | None = None
    # structured output after reasoning: a reasoning_gate.ReasoningGate that says whether the
    # grammar holds yet (None: it holds from the first token)
    reasoning_gate: object | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # per layer group, the pages of the sequence's blocks (block_manager.FREED_BLOCK: given back)
    block_tables: list[list[int]] = field(default_factory=list)
    # bumped by the block manager whenever it changes or removes table entries in place
    # (appending needs no bump): the runner's host copy of the tables recopies them then
    block_tables_version: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None  # last admission (RUNNING), for preemption order
    first_token_time: float | None = None
    finished_time: float | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # prompt tokens taken from the prefix cache at the sequence's first admission (vLLM's
    # num_cached_tokens: set once, not again when a preempted sequence is re-admitted, whose
    # hits are mostly its own recomputed blocks); None until first admitted
    num_cached_tokens: int | None = None
    # prefix-cache keys of the leading full blocks of all_token_ids, filled in by the block
    # manager as it needs them; tokens are only ever appended, so they never go stale
    block_hashes: list[bytes] = field(default_factory=list)
    # all_token_ids as a numpy array grown as tokens arrive (token_history.TokenHistory), for the
    # n-gram proposer and the penalties, instead of converting the whole history every step
    token_history: object | None = field(default=None, repr=False)

    @property
    def block_table(self) -> list[int]:
        """The first (for a model without layer groups, the only) group's block table; created
        empty on first use, so a caller may grow it in place."""
        if not self.block_tables:
            self.block_tables = [[]]
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables = [table]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    # the properties the scheduler reads of every running sequence each step spell their sums out:
    # a property calling another costs a Python call more
    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """True when only the last sampled token lacks KV (a one-token step)."""
        out = self.output_token_ids
        return len(self.prompt_token_ids) + len(out) - self.num_computed_tokens == 1 and bool(out)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet. Such a sequence computes its
        whole prompt: the KV of cached blocks is there, their logits are not."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status in FINISHED_STATUSES else None

    def token_at(self, pos: int) -> int:
        n_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n_prompt else self.output_token_ids[pos - n_prompt]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]
