"""``LLMEngine.step``'s inline detokenization of a sequence's one new token against sending
every sequence through ``_detokenize``: two engines over the fake runner take the same random
requests (n of 1-3, stop strings cut from the outputs themselves so they hit, with and without
``include_stop_str_in_output``, ``min_tokens``, stop token ids, ``max_tokens``, deltas and
cumulative outputs, aborts); every step's outputs must be equal. Clock readings (arrival,
first token, finish times) are left out of the comparison."""

from __future__ import annotations

import dataclasses
import random

from loraplex.sampling_params import SamplingParams
from tests.engine.scheduler_harness import reference_output
from tests.engine.test_engine_fake import make_engine


def comparable(out) -> dict:
    fields = dataclasses.asdict(out)
    fields["metrics"] = {"num_preemptions": fields["metrics"]["num_preemptions"]}
    return fields


def test_inline_one_token_detokenize_matches_detokenize():
    rng = random.Random(0)
    stops_hit = 0
    for trial in range(6):
        inline, general = make_engine(num_blocks=48, max_num_seqs=8), make_engine(num_blocks=48, max_num_seqs=8)
        general.inline_one_token = False
        tok = inline.tokenizer
        for step in range(200):
            if step < 60 and rng.random() < 0.4:
                prompt = [rng.randrange(4, 97) for _ in range(rng.randrange(2, 12))]
                text = tok.decode(reference_output(prompt, 24))
                stop = []
                if rng.random() < 0.6 and len(text) > 4:  # a stop string the output will contain
                    start = rng.randrange(len(text) - 3)
                    stop = [text[start : start + rng.randrange(1, 4)]]
                params = SamplingParams(
                    temperature=0.0, n=rng.choice([1, 1, 1, 2, 3]), max_tokens=rng.randrange(2, 24), stop=stop,
                    include_stop_str_in_output=rng.random() < 0.3, min_tokens=rng.choice([0, 0, 2]),
                    stop_token_ids=rng.sample(range(4, 97), rng.choice([0, 0, 3])), ignore_eos=rng.random() < 0.5)
                stream = rng.random() < 0.6
                for engine in (inline, general):
                    engine.add_request(f"r{step}", list(prompt), params, stream_deltas=stream)
            if step > 5 and rng.random() < 0.03 and inline.has_unfinished():
                victim = rng.choice(sorted(inline._requests))
                assert comparable(inline.abort(victim)) == comparable(general.abort(victim))
            got, expected = inline.step(), general.step()
            assert [comparable(o) for o in got] == [comparable(o) for o in expected], (trial, step)
            stops_hit += sum(isinstance(c.stop_reason, str) for o in got for c in o.outputs if o.finished)
        assert not inline.has_unfinished() and not general.has_unfinished()
    assert stops_hit > 20  # stop strings did end sequences
