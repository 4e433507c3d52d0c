"""Batched penalties (loraplex/engine/penalties.py) against a row-by-row torch reference, and the
rows of a step launched ahead, whose last token is still on the device, against the same rows
with that token on the host: penalties, ``min_tokens`` and seeded draws alike; and the prompts
kept on the device across steps (``PromptTokens``) against the same reference."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from loraplex.engine.penalties import PendingLastTokens, PromptTokens, apply_penalties
from loraplex.engine.sampler import Sampler, apply_min_tokens
from loraplex.engine.sequence import Sequence
from loraplex.sampling_params import SamplingParams

VOCAB = 64


def reference_penalties(logits: torch.Tensor, seqs) -> torch.Tensor:
    """One row at a time, from the token lists (ids outside the vocabulary ignored)."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        p = seq.params
        rep, freq, pres = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        if rep == 1.0 and freq == 0.0 and pres == 0.0:
            continue
        out = torch.tensor([t for t in seq.output_token_ids if 0 <= t < vocab], dtype=torch.long)
        counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
        if rep != 1.0:
            seen = counts > 0
            prompt = torch.tensor([t for t in seq.prompt_token_ids if 0 <= t < vocab], dtype=torch.long)
            seen[prompt] = True
            x = logits[row]
            logits[row] = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        logits[row] -= freq * counts + pres * (counts > 0).to(logits.dtype)
    return logits


def _batch(rng: random.Random, rows: int):
    seqs = []
    for i in range(rows):
        kind = rng.choice(["none", "rep", "freq", "pres", "all"])
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8]), seed=rng.choice([None, 17 + i]), min_tokens=rng.choice([0, 3, 9]),
            stop_token_ids=[5, 6],
            repetition_penalty=rng.choice([1.3, 0.7]) if kind in ("rep", "all") else 1.0,
            frequency_penalty=rng.uniform(-1, 1.5) if kind in ("freq", "all") else 0.0,
            presence_penalty=rng.uniform(-1, 1.5) if kind in ("pres", "all") else 0.0)
        # ids past the vocabulary (a tokenizer larger than the head) and empty outputs included
        prompt = [rng.randrange(0, VOCAB + 8) for _ in range(rng.randint(1, 20))]
        output = [rng.randrange(0, VOCAB + 2) for _ in range(rng.randint(0, 12))]
        seqs.append(SimpleNamespace(params=params, prompt_token_ids=prompt, output_token_ids=output, index=0,
                                    seq_id=i, grammar=None, reasoning_gate=None))
    return seqs


def penalized(logits: torch.Tensor, seqs, pending: PendingLastTokens | None = None) -> torch.Tensor:
    """``apply_penalties`` on a copy of ``logits``, the prompts uploaded for this call alone."""
    return apply_penalties(logits.clone(), seqs, PromptTokens(), pending)


@pytest.mark.parametrize("seed", range(6))
def test_batched_penalties_match_the_row_by_row_reference_bit_for_bit(seed):
    rng = random.Random(seed)
    seqs = _batch(rng, rng.randint(1, 12))
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    assert torch.equal(penalized(logits, seqs), reference_penalties(logits.clone(), seqs))


@pytest.mark.parametrize("seed", range(4))
def test_prompts_kept_across_steps_match_the_reference(seed):
    """Steps of shuffled subsets of one set of sequences: each sequence's prompt is found again by
    its id whatever row it takes, forgotten ones go up again, and nothing else is kept."""
    rng = random.Random(200 + seed)
    seqs = _batch(rng, 12)
    for seq in seqs[::2]:  # every other one with a repetition penalty at least
        seq.params = SamplingParams(repetition_penalty=1.4, frequency_penalty=seq.params.frequency_penalty)
    prompts = PromptTokens()
    for step in range(5):
        batch = rng.sample(seqs, rng.randint(1, len(seqs)))
        logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(seed * 10 + step)) * 3
        got = apply_penalties(logits.clone(), batch, prompts)
        assert torch.equal(got, reference_penalties(logits.clone(), batch)), f"step {step}"
        if step == 2:
            prompts.forget([s.seq_id for s in seqs[:6]] + [99])  # an id never seen is no error
    kept = {s.seq_id for s in seqs if s.params.repetition_penalty != 1.0}
    assert 0 < len(prompts) <= len(kept)  # only prompts a repetition penalty reads
    prompts.forget(kept)
    assert len(prompts) == 0


def test_a_prompt_kept_is_the_sequences_own():
    """Two sequences with different prompts in swapped rows: a cache keyed by row, or one that
    kept the first prompt it saw, would penalize the wrong tokens."""
    a = SimpleNamespace(params=SamplingParams(repetition_penalty=2.0), prompt_token_ids=[1, 2], output_token_ids=[],
                        index=0, seq_id=7, grammar=None, reasoning_gate=None)
    b = SimpleNamespace(**{**vars(a), "prompt_token_ids": [3, 4], "seq_id": 8})
    prompts = PromptTokens()
    logits = torch.ones(2, VOCAB)
    for batch in ([a, b], [b, a], [b]):
        got = apply_penalties(logits[: len(batch)].clone(), batch, prompts)
        assert torch.equal(got, reference_penalties(logits[: len(batch)].clone(), batch))
    assert not torch.equal(penalized(logits, [a, b]), penalized(logits, [b, a]))


@pytest.mark.parametrize("seed", range(4))
def test_output_tokens_from_each_sequences_history_match_the_reference(seed):
    """Real ``Sequence`` rows read their output tokens from their ``TokenHistory``, grown by the
    tokens that arrived since the last step. Over steps that append one or several tokens, cut
    an output back or change its last token (a history that must be rebuilt), and shuffle the
    rows, the penalties equal the reference's from the lists."""
    rng = random.Random(300 + seed)
    seqs = []
    for i, row in enumerate(_batch(rng, 10)):
        seq = Sequence(i, f"r{i}", row.prompt_token_ids, row.params)
        seq.output_token_ids = list(row.output_token_ids)
        seqs.append(seq)
    for step in range(12):
        for seq in seqs:
            roll = rng.random()
            if roll < 0.1 and seq.output_token_ids:
                del seq.output_token_ids[rng.randrange(len(seq.output_token_ids)):]
            elif roll < 0.2 and seq.output_token_ids:
                seq.output_token_ids[-1] = (seq.output_token_ids[-1] + 1) % VOCAB
            else:
                seq.output_token_ids.extend(rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 3])))
        batch = rng.sample(seqs, rng.randint(1, len(seqs)))
        logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(seed * 100 + step)) * 3
        assert torch.equal(penalized(logits, batch), reference_penalties(logits.clone(), batch)), f"step {step}"
    penalizing = [s for s in seqs if s.params.frequency_penalty or s.params.presence_penalty
                  or s.params.repetition_penalty != 1.0]
    assert penalizing and all(s.token_history is not None for s in penalizing)


def _ahead_view(rng: random.Random, seqs):
    """The same rows as a step launched ahead sees them: some decodes' last output token not yet
    on the host, but on the device (``PendingLastTokens``)."""
    rows = [i for i, s in enumerate(seqs) if s.output_token_ids and s.output_token_ids[-1] < VOCAB
            and rng.random() < 0.7]
    short = [SimpleNamespace(**{**vars(s), "output_token_ids": s.output_token_ids[:-1] if i in rows
                                else s.output_token_ids}) for i, s in enumerate(seqs)]
    tokens = torch.tensor([seqs[i].output_token_ids[-1] for i in rows], dtype=torch.long)
    return short, PendingLastTokens(rows, tokens), rows


@pytest.mark.parametrize("seed", range(6))
def test_a_token_still_on_the_device_counts_as_output(seed):
    rng = random.Random(100 + seed)
    seqs = _batch(rng, rng.randint(2, 12))
    short, pending, rows = _ahead_view(rng, seqs)
    assert rows, "no row went ahead: the comparison would be vacuous"
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    assert torch.equal(penalized(logits, short, pending), penalized(logits, seqs))
    want = apply_min_tokens(logits.clone(), seqs, {2})
    assert torch.equal(apply_min_tokens(logits.clone(), short, {2}, pending), want)
    # the whole draw: seeded rows seeded by the generated count, the pending token included
    seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None or s.params.temperature == 0.0]
    full = Sampler(seed=1).launch(logits.clone(), seqs, {2}).result()
    ahead = Sampler(seed=1).launch(logits.clone(), short, {2}, pending).result()
    assert [full[i].token_id for i in seeded] == [ahead[i].token_id for i in seeded]


def test_without_the_pending_token_the_counts_would_differ():
    """The comparison above can fail: dropping a penalized row's last token changes its logits."""
    seq = SimpleNamespace(params=SamplingParams(frequency_penalty=1.0), prompt_token_ids=[1],
                          output_token_ids=[3, 4], index=0, seq_id=0, grammar=None, reasoning_gate=None)
    short = SimpleNamespace(**{**vars(seq), "output_token_ids": [3]})
    logits = torch.zeros(1, VOCAB)
    assert not torch.equal(penalized(logits, [short]), penalized(logits, [seq]))
    pending = PendingLastTokens([0], torch.tensor([4]))
    assert torch.equal(penalized(logits, [short], pending), penalized(logits, [seq]))
