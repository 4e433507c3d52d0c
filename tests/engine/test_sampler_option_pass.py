"""The sampler's one pass that finds which per-request options a batch uses (and skips the
``apply_*`` passes of the others) against applying every one of them to every batch, as the
sampler did before: random batches mixing greedy, seeded and unseeded random rows, logprobs,
``logit_bias``, ``min_tokens``, each penalty alone, ``allowed_token_ids`` and bad words, one
option at a time or several. Tokens and logprobs must be identical."""

from __future__ import annotations

import random

import torch

from loraplex.engine.bad_words import apply_bad_words
from loraplex.engine.penalties import apply_penalties
from loraplex.engine.sampler import Sampler, apply_allowed_token_ids, apply_logit_bias, apply_min_tokens, row_argmax
from loraplex.engine.sequence import Sequence
from loraplex.sampling_params import SamplingParams

VOCAB = 40
EOS = frozenset({2})


def every_pass(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], eos) -> list:
    """The sampler without the option pass: every apply_* on every batch, then the draw."""
    params = [s.params for s in seqs]
    raw = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
    for apply in (apply_logit_bias, lambda lg, ss: apply_min_tokens(lg, ss, eos),
                  lambda lg, ss: apply_penalties(lg, ss, sampler.prompts),
                  apply_allowed_token_ids, apply_bad_words):
        logits = apply(logits, seqs)
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0.0]
    random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
    token_ids = torch.empty(len(params), dtype=torch.long)
    if greedy_rows:
        token_ids[greedy_rows] = row_argmax(logits[greedy_rows])
    if random_rows:
        token_ids[random_rows] = sampler._sample_random(logits[random_rows], [seqs[i] for i in random_rows],
                                                        {j: len(seqs[i].output_token_ids)
                                                         for j, i in enumerate(random_rows)})
    ids = token_ids.tolist()
    if raw is None:
        return [(t, None, None) for t in ids]
    rows = []
    for row, (token, p) in enumerate(zip(ids, params)):
        if p.logprobs is None:
            rows.append((token, None, None))
            continue
        top = raw[row].topk(p.logprobs) if p.logprobs else None
        top_lp = dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {}
        rows.append((token, raw[row, token].item(), top_lp))
    return rows


def random_params(rng: random.Random, options: list[str]) -> SamplingParams:
    kw: dict = {"temperature": rng.choice([0.0, 0.0, 0.8]), "ignore_eos": rng.random() < 0.3}
    if kw["temperature"] and rng.random() < 0.5:
        kw["seed"] = rng.randrange(100)
    for option in options:
        if option == "logprobs":
            kw["logprobs"] = rng.choice([0, 3])
        elif option == "logit_bias":
            kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 4))}
        elif option == "min_tokens":
            kw["min_tokens"] = rng.randrange(1, 6)
            kw["stop_token_ids"] = [rng.randrange(VOCAB)]
        elif option == "repetition_penalty":
            kw["repetition_penalty"] = rng.choice([0.5, 1.5])
        elif option == "frequency_penalty":
            kw["frequency_penalty"] = rng.choice([-1.0, 1.0])
        elif option == "presence_penalty":
            kw["presence_penalty"] = rng.choice([-1.0, 1.0])
        elif option == "allowed_token_ids":
            kw["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randrange(1, 6))
    params = SamplingParams(**kw)
    if "bad_words" in options:
        params.bad_words_token_ids = [[rng.randrange(VOCAB)], [rng.randrange(4), rng.randrange(VOCAB)]]
    return params


OPTIONS = ["logprobs", "logit_bias", "min_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty",
           "allowed_token_ids", "bad_words"]


def test_option_pass_matches_every_pass_on_random_batches():
    rng = random.Random(0)
    for trial in range(400):
        seqs = []
        for i in range(rng.randrange(1, 7)):
            # mostly none or one option per row, so that a batch often uses exactly one
            options = rng.sample(OPTIONS, rng.choice([0, 0, 1, 1, 2]))
            output = [rng.randrange(4) for _ in range(rng.randrange(0, 8))]
            seqs.append(Sequence(i, f"r{i}", [rng.randrange(VOCAB) for _ in range(5)], random_params(rng, options),
                                 index=i, output_token_ids=output))
        logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
        fast = Sampler(seed=trial)(logits.clone(), seqs, EOS)
        expected = every_pass(Sampler(seed=trial), logits.clone(), seqs, EOS)
        assert [(t.token_id, t.logprob, t.top_logprobs) for t in fast] == expected, trial
