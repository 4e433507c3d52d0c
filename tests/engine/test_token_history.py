"""The per-sequence history of the n-gram proposer and the penalties (token_history.TokenHistory), grown as tokens
arrive, against converting the whole history each step: on random sequences that grow by one
or several tokens a step (speculative steps), and that are sometimes cut back (a stop string's
trim) and grown again, the array equals ``all_token_ids`` and the drafts are the same."""

from __future__ import annotations

import random

from loraplex.engine.ngram_proposer import NgramProposer
from loraplex.engine.token_history import TokenHistory
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec_drafts import DraftPlanner
from loraplex.sampling_params import SamplingParams
from loraplex.speculative_config import NgramSpeculation


def test_history_is_all_token_ids_as_it_grows_and_shrinks():
    rng = random.Random(0)
    for trial in range(200):
        seq = Sequence(trial, "r", [rng.randrange(5) for _ in range(rng.randrange(1, 30))], SamplingParams())
        history = TokenHistory()
        for _ in range(rng.randrange(1, 120)):
            roll = rng.random()
            if roll < 0.05 and seq.output_token_ids:  # cut back, then maybe grown past again
                del seq.output_token_ids[rng.randrange(len(seq.output_token_ids)):]
            elif roll < 0.1 and seq.output_token_ids:  # same length, other last token
                seq.output_token_ids[-1] += 1
            else:
                seq.output_token_ids.extend(rng.randrange(5) for _ in range(rng.choice([1, 1, 1, 3, 5])))
            view = history.view(seq)
            assert view.tolist() == seq.all_token_ids
            assert view.dtype.name == "int64"


def test_drafts_from_the_grown_history_match_a_whole_conversion():
    rng = random.Random(1)
    config = NgramSpeculation(4, 4, 1)
    planner = DraftPlanner(config, max_model_len=4000)
    proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    seqs = [Sequence(i, f"r{i}", [rng.randrange(6) for _ in range(rng.randrange(2, 40))], SamplingParams(max_tokens=None))
            for i in range(8)]
    found = 0
    for _ in range(300):
        for seq in seqs:  # interleaved, as a batch: each sequence keeps its own history
            seq.output_token_ids.extend(rng.randrange(6) for _ in range(rng.choice([1, 1, 2, 4])))
            if rng.random() < 0.02:
                del seq.output_token_ids[rng.randrange(len(seq.output_token_ids)):]
            spare = rng.choice([1, 2, 4, 10])
            expected = proposer.propose(seq.all_token_ids, min(spare, 4000 - seq.num_tokens - 1))
            assert planner.draft(seq, spare) == expected
            found += bool(expected)
    assert found > 1000  # a small alphabet: most steps have a draft to compare
