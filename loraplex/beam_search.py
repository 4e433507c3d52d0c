"""Beam search as vLLM serves it: the parameters, the per-prompt search state and the scoring.

The search runs above the engine, as vLLM's does (vllm/beam_search.py and its
``LLM.beam_search`` / online ``beam_search``): each step asks the engine for ONE token per live
beam (the beam's tokens as the prompt, ``max_tokens=1``, the top ``2 * beam_width`` logprobs) and
expands every beam by those candidates. The KV of the shared prefix is reused through the prefix
cache, each step request carries the request's adapter, and the step requests batch with any
other traffic like any request. This module is pure Python (no torch, no engine): the drivers
are ``LLM.beam_search`` (offline) and ``loraplex.engine.beam_search_async`` (the server).

Semantics, vLLM's:
- candidates of a beam: the top ``2 * beam_width`` tokens of the model's raw distribution (the
  engine's logprobs are raw, as vLLM V1's default ``raw_logprobs`` mode);
- a candidate ending in an end-of-sequence token is finished (unless ``ignore_eos``) and kept
  however many there are; the best ``beam_width`` others, by cumulative logprob, live on;
- the search runs ``max_tokens`` steps (no early stopping) or until no beam lives; finished and
  live beams are then ranked by ``cumulative_logprob / length ** length_penalty``, where the
  length counts the PROMPT and the generated tokens, without a final end-of-sequence token
  (vLLM's ``get_beam_search_score``; transformers counts only generated tokens, with the EOS);
  the best ``beam_width`` are returned.
Differences from vLLM, on purpose: the end-of-sequence tokens are the engine's (the model's
generation config and config, as plain generation stops on), not only the tokenizer's; an EOS
kept as an ordinary token under ``ignore_eos`` counts in the length (vLLM discounts any last
EOS); ``temperature`` is accepted and changes nothing (vLLM also adds the token its step request
sampled at that temperature to the candidates, which makes its result random).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loraplex.sampling_params import InvalidRequestError, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams kept and returned, up to ``max_tokens``
    generated tokens each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise InvalidRequestError("beam_width must be an integer >= 1", param="beam_width")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be an integer >= 1", param="max_tokens")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= float(self.temperature) <= 100.0:
            raise InvalidRequestError("temperature must be in [0, 100]", param="temperature")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or self.length_penalty != self.length_penalty or abs(self.length_penalty) == float("inf"):
            raise InvalidRequestError("length_penalty must be a finite number", param="length_penalty")

    @property
    def candidates_per_beam(self) -> int:
        """How many logprobs each step request asks for (vLLM's and transformers' 2 x width)."""
        return 2 * self.beam_width


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt and the generated tokens (with the end-of-sequence
    token that finished it, as vLLM's offline output); ``text`` is set on returned beams."""

    tokens: list[int]
    prompt_len: int
    cum_logprob: float = 0.0
    # per generated token: the candidates its step saw (token id -> logprob)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) | "length"
    stop_reason: int | None = None  # the end-of-sequence token that finished it

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class BeamSearchOutput:
    """vLLM's: the best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def step_sampling_params(params: BeamSearchParams, vocab_size: int | None = None) -> SamplingParams:
    """What each live beam's one-token step request runs with (greedy: the token it samples is
    not used, only its logprobs)."""
    wanted = params.candidates_per_beam if vocab_size is None else min(params.candidates_per_beam, vocab_size)
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=wanted, ignore_eos=True)


def beam_search_score(seq: BeamSearchSequence, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: ``cum_logprob / length ** length_penalty``, the length
    counting the prompt and the generated tokens but not the EOS that finished the beam."""
    return seq.cum_logprob / (_score_length(seq) ** length_penalty)


class BeamSearch:
    """The search state of one prompt. Until ``done``, each step runs one request per entry of
    ``step_prompts()`` with ``step_sampling`` and hands their logprobs to ``advance_from_outputs``
    (the drivers: loraplex/engine/beam_search_offline.py and beam_search_async.py); ``best``
    gives the result. ``max_steps`` (the room the context leaves) bounds ``params.max_tokens``;
    ``vocab_size`` bounds the candidates asked for."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids,
                 max_steps: int | None = None, vocab_size: int | None = None):
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        prompt = list(prompt_token_ids)
        self.live: list[BeamSearchSequence] = [BeamSearchSequence(tokens=prompt, prompt_len=len(prompt))]
        self.finished: list[BeamSearchSequence] = []
        self.steps_left = params.max_tokens if max_steps is None else max(0, min(params.max_tokens, max_steps))
        # the same for every step request of the search (requests only read their parameters)
        self.step_sampling = step_sampling_params(params, vocab_size)

    @classmethod
    def in_context(cls, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids,
                   max_model_len: int, vocab_size: int) -> "BeamSearch":
        """A search over an engine: at most the steps its context of ``max_model_len`` tokens
        leaves after the prompt."""
        return cls(prompt_token_ids, params, eos_token_ids, max_steps=max_model_len - len(prompt_token_ids),
                   vocab_size=vocab_size)

    @property
    def done(self) -> bool:
        return not self.live or self.steps_left <= 0

    def step_prompts(self) -> list[list[int]]:
        """This step's requests, one per live beam: the beam's tokens as the prompt."""
        return [beam.tokens for beam in self.live]

    def advance_from_outputs(self, step_logprobs: list[list[dict] | None]) -> None:
        """``advance`` from each step request's ``CompletionOutput.logprobs``, in
        ``step_prompts`` order."""
        self.advance([step_candidates(logprobs) for logprobs in step_logprobs])

    def advance(self, candidates: list[dict[int, float] | None]) -> None:
        """One step: ``candidates[i]`` are the (token id -> logprob) choices of ``live[i]``; None
        drops that beam (its step request ended without a token)."""
        if len(candidates) != len(self.live):
            raise ValueError("one set of candidates per live beam")
        width = self.params.beam_width
        pool: list[BeamSearchSequence] = []
        for beam, choices in zip(self.live, candidates):
            if not choices:
                continue
            for token, logprob in sorted(choices.items(), key=lambda kv: -kv[1]):
                child = BeamSearchSequence(
                    tokens=beam.tokens + [int(token)], prompt_len=beam.prompt_len,
                    cum_logprob=beam.cum_logprob + float(logprob), logprobs=beam.logprobs + [dict(choices)])
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", int(token)
                    self.finished.append(child)
                else:
                    pool.append(child)
        # live beams all have the same length: ranking by cumulative logprob is ranking by score
        pool.sort(key=lambda b: b.cum_logprob, reverse=True)  # stable: ties keep beam, then token order
        self.live = pool[:width]
        self.steps_left -= 1

    def best(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` of the finished and live beams by ``beam_search_score``."""
        for beam in self.live:
            beam.finish_reason = "length"
        beams = self.finished + self.live
        ranked = sorted(beams, key=_ranking_key(beams, self.params.length_penalty), reverse=True)
        return ranked[: self.params.beam_width]


def _score_length(seq: BeamSearchSequence) -> int:
    return len(seq.tokens) - (1 if seq.finish_reason == "stop" else 0)


def _ranking_key(beams: list[BeamSearchSequence], length_penalty: float):
    """A sort key ordering ``beams`` as ``beam_search_score`` does. That score in floats, where
    every beam's is a normal float; else (``length ** length_penalty`` past the float range: a
    penalty in the hundreds) the same order from logarithms, ``penalty * log(length) -
    log(-cum_logprob)``, which cannot overflow (vLLM's float formula raises or ties them all)."""
    try:
        scores = {id(b): beam_search_score(b, length_penalty) for b in beams}
    except (OverflowError, ZeroDivisionError):
        scores = None
    if scores is not None and all(1e-300 < abs(v) < 1e300 or b.cum_logprob == 0.0
                                  for b, v in zip(beams, scores.values())):
        return lambda b: scores[id(b)]

    def log_key(b: BeamSearchSequence) -> float:
        if b.cum_logprob >= 0.0:  # score 0, the best there is (logprobs are <= 0)
            return math.inf
        return length_penalty * math.log(_score_length(b)) - math.log(-b.cum_logprob)

    return log_key


def step_candidates(completion_logprobs: list[dict] | None) -> dict[int, float] | None:
    """The engine's logprobs of a one-token step (``CompletionOutput.logprobs``) -> the
    candidates: the top logprobs and the chosen token (vLLM's union)."""
    if not completion_logprobs:
        return None
    entry = completion_logprobs[0]
    choices = dict(entry.get("top_logprobs") or {})
    if entry.get("logprob") is not None:
        choices.setdefault(entry["token_id"], entry["logprob"])
    return choices


def returned_token_ids(seq: BeamSearchSequence, include_stop_str_in_output: bool) -> list[int]:
    """The generated tokens the server returns: without the finishing EOS unless
    ``include_stop_str_in_output`` (vLLM's online ``token_ids``)."""
    out = seq.output_token_ids
    if seq.finish_reason == "stop" and not include_stop_str_in_output:
        return out[:-1]
    return out


def returned_text_ids(seq: BeamSearchSequence) -> list[int]:
    """The generated tokens the server's text decodes: never the finishing EOS (vLLM's online)."""
    out = seq.output_token_ids
    return out[:-1] if seq.finish_reason == "stop" else out


def check_beam_width_cap(beam_width: int, max_logprobs: int, vocab_size: int, param: str = "beam_width") -> None:
    """Each step asks the engine for ``2 * beam_width`` logprobs: that must fit the engine's
    ``max_logprobs`` (vLLM's beam search is bound the same way; -1 lifts the cap)."""
    wanted = min(2 * beam_width, vocab_size)
    if max_logprobs != -1 and wanted > max_logprobs:
        raise InvalidRequestError(
            f"beam search with {beam_width} beams ranks {wanted} candidate tokens per beam and step, more than "
            f"the server's max_logprobs ({max_logprobs}) allows: use at most {max_logprobs // 2} beams",
            param=param)
