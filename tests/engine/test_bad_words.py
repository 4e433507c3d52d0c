"""``bad_words`` (loraplex/engine/bad_words.py) in a step launched ahead: rows whose last output
token is still on the device (``PendingLastTokens``) ban exactly what the same rows ban with
that token on the host, for words of one to four tokens that do or do not end the output, and
for a token two words ban where only one matches."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from loraplex.engine.bad_words import apply_bad_words
from loraplex.engine.penalties import PendingLastTokens
from loraplex.sampling_params import SamplingParams

VOCAB = 32


def _rows(rng: random.Random, num_rows: int) -> list:
    rows = []
    for i in range(num_rows):
        out = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))]
        words = [[rng.randrange(VOCAB)] for _ in range(rng.randint(0, 2))]  # one token: always banned
        for length in (1, 2, 3):  # words whose prefix is the output's tail (the pending token last)
            if len(out) >= length and rng.random() < 0.7:
                words.append(out[len(out) - length:] + [rng.randrange(VOCAB)])
        if out:  # the same banned token by a word that matches and one that does not
            token = rng.randrange(VOCAB)
            words += [[out[-1], token], [(out[-1] + 1) % VOCAB, token]]
        words += [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 4))] for _ in range(rng.randint(0, 3))]
        rows.append(SimpleNamespace(params=SamplingParams(bad_words_token_ids=words or None), output_token_ids=out,
                                    seq_id=i))
    return rows


def _ahead_view(rng: random.Random, rows: list):
    """The rows as a step launched ahead sees them: some last output tokens still on the device."""
    pending_rows = [i for i, row in enumerate(rows) if row.output_token_ids and rng.random() < 0.7]
    short = [SimpleNamespace(**{**vars(row), "output_token_ids": row.output_token_ids[:-1]})
             if i in pending_rows else row for i, row in enumerate(rows)]
    tokens = torch.tensor([rows[i].output_token_ids[-1] for i in pending_rows], dtype=torch.long)
    return short, PendingLastTokens(pending_rows, tokens)


def _reference(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """Row by row from the whole output list: a word is banned where its prefix ends the output."""
    for r, row in enumerate(rows):
        out = row.output_token_ids
        for ids in row.params.bad_words_token_ids or []:
            prefix = ids[:-1]
            if not prefix or out[-len(prefix):] == prefix and len(out) >= len(prefix):
                logits[r, ids[-1]] = float("-inf")
    return logits


@pytest.mark.parametrize("seed", range(8))
def test_a_token_still_on_the_device_bans_what_it_would_on_the_host(seed):
    rng = random.Random(seed)
    rows = _rows(rng, rng.randint(1, 10))
    short, pending = _ahead_view(rng, rows)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed))
    want = _reference(logits.clone(), rows)
    assert torch.equal(apply_bad_words(logits.clone(), rows), want)
    assert torch.equal(apply_bad_words(logits.clone(), short, pending), want)


def test_without_the_pending_token_the_bans_would_differ():
    """The comparison above can fail: a word whose prefix ends in the token being drawn."""
    row = SimpleNamespace(params=SamplingParams(bad_words_token_ids=[[3, 4, 9]]), output_token_ids=[1, 3, 4])
    short = SimpleNamespace(params=row.params, output_token_ids=[1, 3])
    logits = torch.zeros(1, VOCAB)
    want = apply_bad_words(logits.clone(), [row])
    assert want[0, 9] == float("-inf") and torch.isfinite(apply_bad_words(logits.clone(), [short])).all()
    assert torch.equal(apply_bad_words(logits.clone(), [short], PendingLastTokens([0], torch.tensor([4]))), want)
    other = apply_bad_words(logits.clone(), [short], PendingLastTokens([0], torch.tensor([5])))
    assert torch.isfinite(other).all()  # another token drawn: the word is not completed
