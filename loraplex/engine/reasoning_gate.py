"""One sequence's way through its reasoning, for structured output that starts after it
(``loraplex.reasoning_boundary``). Pure Python: the sampler asks it which logits the grammar
masks this step and tells it each sampled token.

The grammar's matcher sees only the answer: no token of the reasoning reaches it, so after the
end marker it starts from its first state, as a request without reasoning would.
"""

from __future__ import annotations

from loraplex.reasoning_boundary import ReasoningBoundary


class ReasoningGate:
    """Whether a sequence's grammar holds yet: ``state`` is ``"reasoning"`` (free),
    ``"content"`` (the grammar holds) or ``"either"`` (the first tokens may open the reasoning)."""

    def __init__(self, boundary: ReasoningBoundary):
        self.boundary = boundary
        self.state = boundary.starts_in
        self._tail: list[int] = []  # the last reasoning tokens, at most len(end_token_ids)
        self._opened = 0  # "either": how many of start_token_ids the output begins with so far
        # "either": whether the grammar took every token so far (so the answer may still go on
        # from them), and how many it took
        self._grammar_took_all = True
        self._taken = 0

    @property
    def masks(self) -> bool:
        """Whether the logits are masked this step (by the grammar, or to the opening tokens)."""
        return self.state != "reasoning"

    def opening_token(self) -> int | None:
        """In ``"either"``: the next token of the opening marker, allowed besides the grammar's."""
        return self.boundary.start_token_ids[self._opened] if self.state == "either" else None

    @property
    def grammar_open(self) -> bool:
        """False once an opening token was one the grammar refuses: then only the rest of the
        opening marker may follow (a half-written marker is neither answer nor reasoning)."""
        return self.state == "content" or (self.state == "either" and self._grammar_took_all)

    def advance(self, token: int, matcher) -> None:
        """After ``token`` was sampled: feed the grammar or watch for the markers."""
        if self.state == "content":
            matcher.consume_token(token)
        elif self.state == "reasoning":
            self._watch_for_end(token)
        else:
            self._either(token, matcher)

    def _watch_for_end(self, token: int) -> None:
        end = self.boundary.end_token_ids
        self._tail.append(token)
        if len(self._tail) > len(end):
            del self._tail[0]
        if tuple(self._tail) == end:
            self.state = "content"  # the grammar starts with the next token

    def _either(self, token: int, matcher) -> None:
        start = self.boundary.start_token_ids
        if token != start[self._opened]:
            # the answer began (the mask let only the grammar's tokens through besides the marker)
            self.state = "content"
            matcher.consume_token(token)
            return
        self._opened += 1
        if self._grammar_took_all and matcher.validate_tokens([token]) == 1:
            matcher.consume_token(token)
            self._taken += 1
        else:
            self._grammar_took_all = False
        if self._opened == len(start):
            # the reasoning is open: whatever the grammar took of the marker was not the answer
            if self._taken:
                matcher.reset()
            self.state = "reasoning"
