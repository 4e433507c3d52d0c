"""Which draft tokens the scheduler gives a decoding sequence this step (speculative decoding).

A draft is what ``NgramProposer`` finds, cut so that verifying it can never overrun the
sequence's limits: accepting every draft token plus the one sampled after them must fit
``max_tokens`` and ``max_model_len``, and the draft must fit the token budget ``spare`` the
scheduler can still give. Sequences whose next token a grammar constrains get no draft (the
grammar would have to advance through every drafted position; they decode one token a step).
Pure Python: the scheduler calls this.
"""

from __future__ import annotations

from loraplex.engine.ngram_proposer import NgramProposer
from loraplex.engine.sequence import Sequence
from loraplex.engine.token_history import history_of
from loraplex.speculative_config import NgramSpeculation


class DraftPlanner:
    """Drafts for decoding sequences, within their limits (see module doc)."""

    def __init__(self, config: NgramSpeculation, max_model_len: int | None):
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.max_model_len = max_model_len

    def draft(self, seq: Sequence, spare: int) -> list[int]:
        """Draft tokens for ``seq`` (a decode: only its last token lacks KV), at most ``spare``."""
        if seq.grammar is not None:
            return []
        limit = spare
        max_tokens = seq.params.max_tokens
        if max_tokens is not None:  # the token sampled after the draft counts too
            limit = min(limit, max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - seq.num_tokens - 1)
        if limit <= 0:
            return []
        return self.proposer.propose_array(history_of(seq).view(seq), limit)
