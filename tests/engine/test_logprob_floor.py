"""Reported logprobs are finite JSON numbers: a row whose logits are NaN (an overflowed forward)
or a token the model gives -inf reports vLLM's floor, -9999.0, and the other rows of its batch
are untouched; every API can then encode them (a NaN made whole answers fail with 500 and
streams write ``NaN``, which is no JSON)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from loraplex.engine.logprob_floor import LOGPROB_FLOOR
from loraplex.engine.prompt_logprobs import prompt_token_logprobs
from loraplex.engine.sampler import Sampler
from tests.engine.test_sampler import VOCAB, random_logits, seq
from loraplex.sampling_params import SamplingParams


def test_sampled_logprobs_of_a_nan_row_and_a_ruled_out_token_are_the_floor():
    logits = random_logits(3, seed=4)
    logits[1] = float("nan")  # a row whose forward overflowed
    logits[2, 7] = float("-inf")  # a token the model rules out; the row asks for every logprob
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.0, logprobs=VOCAB)]
    out = Sampler()(logits.clone(), [seq(p, seq_id=i) for i, p in enumerate(params)])
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out[0].logprob == raw[out[0].token_id].item()
    assert out[0].top_logprobs == {i: v for v, i in zip(*[t.tolist() for t in raw.topk(5)])}
    assert out[1].logprob == LOGPROB_FLOOR and set(out[1].top_logprobs.values()) == {LOGPROB_FLOOR}
    assert out[2].top_logprobs[7] == LOGPROB_FLOOR
    finite = {i: v for i, v in out[2].top_logprobs.items() if i != 7}
    assert finite == {i: v for i, v in enumerate(torch.log_softmax(logits[2], dim=-1).tolist()) if i != 7}
    json.dumps([[t.logprob, t.top_logprobs] for t in out], allow_nan=False)  # what a JSON answer needs


def test_prompt_logprobs_of_nan_rows_are_the_floor():
    hidden = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    head = torch.randn(VOCAB, 8, generator=torch.Generator().manual_seed(2))

    def compute_logits(h, _lora=None):
        logits = h @ head.T
        logits[2] = float("nan")
        return logits

    model = SimpleNamespace(compute_logits=compute_logits)
    sequence = SimpleNamespace(seq_id=5, params=SamplingParams(prompt_logprobs=3), prompt_token_ids=[9, 1, 4, 6, 2])
    entries = prompt_token_logprobs(model, hidden, [(sequence, 1, 0, 4)])[5]
    raw = torch.log_softmax(hidden @ head.T, dim=-1)
    for row, entry in enumerate(entries):
        if row == 2:
            assert entry["logprob"] == LOGPROB_FLOOR and set(entry["top_logprobs"].values()) == {LOGPROB_FLOOR}
        else:
            assert entry["logprob"] == raw[row, sequence.prompt_token_ids[1 + row]].item()
    json.dumps(entries, allow_nan=False)
