"""Verifying speculative drafts exactly: which drafted tokens a step keeps.

A sequence with draft ``d_1 .. d_k`` runs ``1 + k`` query tokens (its last sampled token, then
the draft) in one forward pass, giving the target's logits at each position. Position ``j``
(0-based) is processed and sampled by the ordinary sampler as if ``d_1 .. d_j`` had already been
generated (``PositionView``): logit_bias, min_tokens, penalties, bad_words, seeds and logprobs
all see the output so far, drafts included. Then ``num_accepted`` keeps the longest prefix of the
draft equal to the sampled tokens, plus the sampled token right after it.

Why this is the target's distribution, token for token:

* Greedy: the sample at position j is the argmax given the prefix, so the kept tokens are
  exactly what one-token-at-a-time greedy decoding produces.
* Random: a draft is deterministic (a one-hot proposal q = 1{d}). The standard rejection rule
  (Leviathan et al. 2023; Chen et al. 2023) accepts d with probability min(1, p(d)/q(d)) = p(d),
  and on rejection samples from norm(max(0, p - q)) = p with d removed, renormalized; after k
  acceptances it samples a bonus token from p. Drawing x ~ p and accepting d iff x == d does
  exactly that: P(accept) = p(d), and given x != d, x is distributed as p restricted to tokens
  other than d, renormalized, and is the token emitted. So each kept token is a draw from the
  target's processed distribution given the tokens before it.
* Seeded requests draw position j's noise from ``(seed, index, number of tokens generated
  before it)``, the same generator plain decoding uses for that token, so a seeded request's
  output is the same with speculation on or off, and independent of what shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.sampling_params import SamplingParams


@dataclass(eq=False)
class PositionView:
    """What the sampler reads of a sequence, as it stands before one verified position: its
    output so far includes the draft tokens before that position. Never has a grammar
    (sequences with one are not speculated)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    index: int
    seq_id: int
    grammar: object | None = None
    reasoning_gate: object | None = None


def position_views(seq, draft: list[int]) -> list[PositionView]:
    """One view per verified position of ``seq`` (``1 + len(draft)`` of them)."""
    out = seq.output_token_ids
    return [
        PositionView(seq.prompt_token_ids, out + draft[:j] if j else out, seq.params, seq.index, seq.seq_id)
        for j in range(len(draft) + 1)
    ]


def num_accepted(draft: list[int], sampled: list[int]) -> int:
    """How many leading draft tokens equal the tokens sampled at their positions. The step
    emits ``sampled[: num_accepted + 1]``: the accepted drafts and one token after them."""
    count = 0
    for proposed, actual in zip(draft, sampled):
        if proposed != actual:
            break
        count += 1
    return count
